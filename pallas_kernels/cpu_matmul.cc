// A dense f32 matmul for XLA:CPU, called through XLA's FFI (see cpu_matmul.py): y = x @ w, or
// x @ w[layer] for a stacked [layers, K, N] weight.
//
// Inside the scanned layer loop XLA slices each layer's weights out of their stack into a copy before
// its dot (XLA:CPU does not fuse a dynamic slice into a matmul): every decode step wrote the model's
// weights once more. This reads the layer's weights where they lie. A work item is a 64-column panel of
// w, shared by the caller and the intra-op pool: its rows of 64 floats are streamed once (the next
// rows prefetched) into 8-row register tiles of y, and read again from L2 for each further 8 rows of x.
// While it computes, a thread prefetches the panel it takes next into L2, a share of its rows in each
// 8-row tile: the DRAM reads overlap the multiplications (memory-bound at few rows, compute-bound at
// many; without it a panel's first tile waited on DRAM and the others on the FMA units).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;
using jaxpaged::ParallelForAhead;

namespace {

using Vec = float __attribute__((vector_size(64), aligned(4)));   // 16 floats; any alignment
constexpr int64_t kLanes = 16;
constexpr int64_t kPanel = 4 * kLanes;   // columns per work item
constexpr int kRows = 8;                 // rows of x per register tile
constexpr int64_t kPrefetchRows = 8;     // rows of w ahead, while a panel is first streamed

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// y[0:R, 0:16*V] = x[0:R, 0:K] @ w[0:K, 0:16*V] (row strides ldx, ldw, ldy), accumulated in registers.
// `prefetch`: w's rows kPrefetchRows ahead; `ahead` (or null): `ahead_rows` rows of 64 floats, ldw apart,
// into L2, one every `every` rows of K.
template <int R, int V>
void Tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
          bool prefetch, const float* ahead, int64_t ahead_rows, int64_t every) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = Vec{};
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * ldw;
    if (prefetch && k + kPrefetchRows < K) {
      for (int v = 0; v < V; ++v) __builtin_prefetch(wk + kPrefetchRows * ldw + v * kLanes, 0, 3);
    }
    if (ahead != nullptr && k % every == 0 && k / every < ahead_rows) {
      const float* row = ahead + (k / every) * ldw;
      for (int64_t v = 0; v < kPanel; v += kLanes) __builtin_prefetch(row + v, 0, 2);
    }
    Vec b[V];
    for (int v = 0; v < V; ++v) b[v] = Load(wk + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
      for (int v = 0; v < V; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) Store(y + r * ldy + v * kLanes, acc[r][v]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool, const float*,
                        int64_t, int64_t);

template <int V>
constexpr TileFn kTiles[kRows + 1] = {nullptr, Tile<1, V>, Tile<2, V>, Tile<3, V>, Tile<4, V>,
                                      Tile<5, V>, Tile<6, V>, Tile<7, V>, Tile<8, V>};

// All rows of x against columns [n0, n0 + 16 * V) of w; the panel at next_n0 (-1: none) prefetched,
// each 8-row tile taking its share of that panel's K rows.
template <int V>
void Columns(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
             int64_t next_n0) {
  const int64_t tiles = (M + kRows - 1) / kRows;
  const int64_t share = (K + tiles - 1) / tiles;
  for (int64_t r0 = 0, t = 0; r0 < M; r0 += kRows, ++t) {
    const int64_t rows = std::min<int64_t>(kRows, M - r0);
    const int64_t first = t * share, count = std::min(share, K - first);
    const float* ahead = next_n0 >= 0 && count > 0 ? w + first * N + next_n0 : nullptr;
    const int64_t every = ahead != nullptr ? std::max<int64_t>(1, K / count) : 1;
    kTiles<V>[rows](x + r0 * K, K, w + n0, N, K, y + r0 * N + n0, N, r0 == 0, ahead, count, every);
  }
}

// The last N % 16 columns.
void Leftover(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t c = n0; c < N; ++c) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += x[r * K + k] * w[k * N + c];
      y[r * N + c] = sum;
    }
  }
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || (wd.size() != 2 && wd.size() != 3) || wd[wd.size() - 2] != xd[1]) {
    return ffi::Error::InvalidArgument("matmul: x must be [M, K] and w [K, N] or [layers, K, N]");
  }
  const int64_t rows = xd[0], K = xd[1], N = wd[wd.size() - 1];
  const int64_t layers = wd.size() == 3 ? wd[0] : 1;
  const int64_t index = wd.size() == 3 ? layer.typed_data()[0] : 0;
  if (index < 0 || index >= layers) {
    return ffi::Error::InvalidArgument("matmul: layer index out of range");
  }
  float* yp = y->typed_data();
  // Only x's first `live` rows are multiplied (a step's padding tokens follow its real ones); the rest
  // of y is zeros.
  const int64_t M = std::clamp<int64_t>(live.typed_data()[0], 0, rows);
  std::fill(yp + M * N, yp + rows * N, 0.0f);
  if (M == 0 || N == 0) return ffi::Error::Success();   // nothing to write (and no row tiles to share K among)
  const float* xp = x.typed_data();
  const float* wp = w.typed_data() + index * K * N;
  const int64_t panels = N / kPanel, vectors = (N % kPanel) / kLanes;
  // Items: the full panels, then one for the leftover vectors and columns (if any).
  const int64_t items = panels + (N % kPanel != 0);
  auto item = [&](int64_t i, int64_t next) {
    if (i < panels) {
      Columns<4>(xp, wp, yp, M, K, N, i * kPanel, next >= 0 && next < panels ? next * kPanel : -1);
      return;
    }
    const int64_t n0 = panels * kPanel;
    if (vectors == 3) Columns<3>(xp, wp, yp, M, K, N, n0, -1);
    if (vectors == 2) Columns<2>(xp, wp, yp, M, K, N, n0, -1);
    if (vectors == 1) Columns<1>(xp, wp, yp, M, K, N, n0, -1);
    Leftover(xp, wp, yp, M, K, N, n0 + vectors * kLanes);
  };
  ParallelForAhead(pool, items, item);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [K, N] or [layers, K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer (ignored for a 2-D w)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live: x's leading rows multiplied
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
