// Ragged paged attention for XLA:CPU, called through XLA's FFI (see cpu_attention.py).
//
// The jnp reference gathers every page a step reads into a copy and then multiplies the copy: on a CPU
// that is memory traffic twice over. This reads each sequence's pages where they lie in the pool, one
// (token, kv head) at a time: the `group` query heads sharing the kv head are scored against a page's
// keys, merged into their running softmax (max, sum, weighted values) and the page's values added. For
// head dims a multiple of 8 known at compile time (64, 128), a head's query and its weighted sum are held
// in 8-float vectors over a page (in registers at 64; at 128 with AVX-512's 32), and four keys are scored
// at once (independent sums, not one chain of adds); other head dims read each key and value row once for
// all the group's heads.
// The next page, or the first of the item the thread takes next, is prefetched a line at a time over
// the page's work (decode attention is bound by reading the pool: 31 -> 19 ms for 32 decodes over
// SmolLM2's 30 layers against one burst of all the page's lines, jaxpaged/bench/cpu_attention.py).
// A token of a prompt chunk is a decode over the keys up to its own position. The (token, kv head)
// items are shared between the caller and the threads of XLA's intra-op pool.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;
using jaxpaged::ParallelForAhead;

namespace {

// The largest shapes the fixed-size scratch takes; cpu_attention.py sends others to the reference.
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlock = 64;

// e^x for x <= 0 (a score minus its running max), vectorizable: 2^n e^r with |r| <= ln2 / 2 and a degree-6
// polynomial for e^r (relative error ~1e-7, as expf); 0 below -87, where expf is subnormal.
#pragma omp declare simd
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // rounded (1.5 * 2^23)
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;             // ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = (p * r * r + r) + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &e, sizeof bits);
  bits += static_cast<int32_t>(n) * (1 << 23);
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return x < -87.0f ? 0.0f : out;
}

using Vec8 = float __attribute__((vector_size(32), aligned(4)));   // 8 floats; any alignment

inline Vec8 Load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store8(float* p, const Vec8& v) { std::memcpy(p, &v, sizeof v); }

inline float Sum8(const Vec8& v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// The first key a query at kv_len - 1 sees (a sliding window of `window` keys; 0: none).
inline int64_t FirstKey(int64_t kv_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(kv_len - window, 0) : 0;
}

struct Shape {
  int64_t group, head_dim, block_size, page_stride;   // page_stride: floats between blocks of one plane
};

// One sequence's query rows for one kv head (`group` heads, contiguous in q and out) against its pages.
// kHeadDim / kBlock: compile-time sizes for the common shapes, 0 for any other (then shape's).
template <int64_t kHeadDim, int64_t kBlock>
void AttendOne(const Shape& shape, const float* q, const float* k_plane, const float* v_plane,
               const int32_t* table, int64_t kv_len, int64_t window, float soft_cap, float sm_scale, float* out,
               const float* after_k, const float* after_v) {
  const int64_t head_dim = kHeadDim ? kHeadDim : shape.head_dim;
  const int64_t block_size = kBlock ? kBlock : shape.block_size;
  const int64_t group = shape.group;
  constexpr int64_t kChunks = kHeadDim % 8 == 0 ? kHeadDim / 8 : 0;   // 8-float vectors per head row
  alignas(64) float qs[kMaxGroup * kMaxHeadDim];
  alignas(64) float acc[kMaxGroup * kMaxHeadDim];
  alignas(64) float s[kMaxGroup][kMaxBlock];
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t j = 0; j < group; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) {
      qs[j * head_dim + d] = q[j * head_dim + d] * sm_scale;
      acc[j * head_dim + d] = 0.0f;
    }
  }
  const int64_t q_pos = kv_len - 1;
  const int64_t first_key = FirstKey(kv_len, window);
  const int64_t num_pages = (kv_len + block_size - 1) / block_size;
  for (int64_t page = first_key / block_size; page < num_pages; ++page) {
    const float* k = k_plane + table[page] * shape.page_stride;
    const float* v = v_plane + table[page] * shape.page_stride;
    const char* next_k = reinterpret_cast<const char*>(after_k);
    const char* next_v = reinterpret_cast<const char*>(after_v);
    if (page + 1 < num_pages) {
      next_k = reinterpret_cast<const char*>(k_plane + table[page + 1] * shape.page_stride);
      next_v = reinterpret_cast<const char*>(v_plane + table[page + 1] * shape.page_stride);
    }
    const int64_t lo = std::max<int64_t>(first_key - page * block_size, 0);
    const int64_t hi = std::min<int64_t>(q_pos - page * block_size + 1, block_size);
    // The next page (or the next item's first) is fetched into L2 a line or two at a time, spread over this
    // page's work: one burst of all its lines overflows the misses a core keeps in flight.
    const int64_t lines = next_k != nullptr ? (block_size * head_dim * 4 + 63) / 64 : 0;
    const int64_t per_row = (lines + 2 * group * (hi - lo) - 1) / std::max<int64_t>(2 * group * (hi - lo), 1);
    int64_t fetched = 0;
    auto prefetch = [&]() {
      for (int64_t end = std::min(fetched + per_row, lines); fetched < end; ++fetched) {
        __builtin_prefetch(next_k + fetched * 64, 0, 1);
        __builtin_prefetch(next_v + fetched * 64, 0, 1);
      }
    };
    if constexpr (kChunks > 0) {
      for (int64_t j = 0; j < group; ++j) {
        float* sj = s[j];
        Vec8 qv[kChunks];
        for (int64_t c = 0; c < kChunks; ++c) qv[c] = Load8(qs + j * head_dim + 8 * c);
        int64_t t = lo;
        for (; t + 4 <= hi; t += 4) {   // four keys at once: four independent sums
          const float* key = k + t * head_dim;
          for (int r = 0; r < 4; ++r) prefetch();
          Vec8 a0 = qv[0] * Load8(key), a1 = qv[0] * Load8(key + head_dim);
          Vec8 a2 = qv[0] * Load8(key + 2 * head_dim), a3 = qv[0] * Load8(key + 3 * head_dim);
          for (int64_t c = 1; c < kChunks; ++c) {
            a0 += qv[c] * Load8(key + 8 * c);
            a1 += qv[c] * Load8(key + head_dim + 8 * c);
            a2 += qv[c] * Load8(key + 2 * head_dim + 8 * c);
            a3 += qv[c] * Load8(key + 3 * head_dim + 8 * c);
          }
          sj[t] = Sum8(a0);
          sj[t + 1] = Sum8(a1);
          sj[t + 2] = Sum8(a2);
          sj[t + 3] = Sum8(a3);
        }
        for (; t < hi; ++t) {
          const float* key = k + t * head_dim;
          prefetch();
          Vec8 a0 = qv[0] * Load8(key);
          for (int64_t c = 1; c < kChunks; ++c) a0 += qv[c] * Load8(key + 8 * c);
          sj[t] = Sum8(a0);
        }
      }
    } else {   // any head dim: each key row read once, for all the group's heads
      for (int64_t t = lo; t < hi; ++t) {
        const float* key = k + t * head_dim;
        for (int64_t j = 0; j < group; ++j) {
          const float* qj = qs + j * head_dim;
          prefetch();
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qj[d] * key[d];
          s[j][t] = dot;
        }
      }
    }
    for (int64_t j = 0; j < group; ++j) {
      float* sj = s[j];
      if (soft_cap > 0.0f) {
        for (int64_t t = lo; t < hi; ++t) sj[t] = soft_cap * std::tanh(sj[t] / soft_cap);
      }
      float m_new = m[j];
      for (int64_t t = lo; t < hi; ++t) m_new = std::max(m_new, sj[t]);
      const float alpha = ExpNonPositive(m[j] - m_new);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = lo; t < hi; ++t) {
        sj[t] = ExpNonPositive(sj[t] - m_new);
        sum += sj[t];
      }
      l[j] = l[j] * alpha + sum;
      m[j] = m_new;
      float* a = acc + j * head_dim;
      if constexpr (kChunks > 0) {   // this head's sums stay in registers over the page's values
        Vec8 av[kChunks];
        for (int64_t c = 0; c < kChunks; ++c) av[c] = Load8(a + 8 * c) * alpha;
        for (int64_t t = lo; t < hi; ++t) {
          const float* value = v + t * head_dim;
          const float p = sj[t];
          prefetch();
          for (int64_t c = 0; c < kChunks; ++c) av[c] += p * Load8(value + 8 * c);
        }
        for (int64_t c = 0; c < kChunks; ++c) Store8(a + 8 * c, av[c]);
      } else {
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] *= alpha;
      }
    }
    if constexpr (kChunks == 0) {   // each value row read once, for all the group's heads
      for (int64_t t = lo; t < hi; ++t) {
        const float* value = v + t * head_dim;
        for (int64_t j = 0; j < group; ++j) {
          const float p = s[j][t];
          float* a = acc + j * head_dim;
          prefetch();
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * value[d];
        }
      }
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    const float inv = l[j] > 0.0f ? 1.0f / l[j] : 1.0f;   // no key (a padding sequence): zeros
    for (int64_t d = 0; d < head_dim; ++d) out[j * head_dim + d] = acc[j * head_dim + d] * inv;
  }
}

using AttendFn = void (*)(const Shape&, const float*, const float*, const float*, const int32_t*, int64_t,
                          int64_t, float, float, float*, const float*, const float*);

AttendFn Specialized(int64_t head_dim, int64_t block_size) {
  if (block_size == 16) {
    if (head_dim == 64) return AttendOne<64, 16>;
    if (head_dim == 128) return AttendOne<128, 16>;
    return AttendOne<0, 16>;
  }
  return AttendOne<0, 0>;
}

ffi::Error RaggedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv_pool,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                           ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> soft_cap, float sm_scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();        // [tokens, heads, head_dim]
  const auto pd = kv_pool.dimensions();  // [layers, 2, blocks, kv_heads, block_size, head_dim]
  if (qd.size() != 3 || pd.size() != 6 || block_tables.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q must be 3-D, the pool 6-D, tables 2-D");
  }
  const int64_t num_tokens = qd[0], num_heads = qd[1], head_dim = qd[2];
  const int64_t num_blocks = pd[2], kv_heads = pd[3], block_size = pd[4];
  const int64_t num_seqs = block_tables.dimensions()[0], max_blocks = block_tables.dimensions()[1];
  if (pd[5] != head_dim || num_heads % kv_heads != 0 || num_heads / kv_heads > kMaxGroup ||
      head_dim > kMaxHeadDim || block_size > kMaxBlock) {
    return ffi::Error::InvalidArgument("paged attention: unsupported head or block shape");
  }
  const Shape shape{num_heads / kv_heads, head_dim, block_size, kv_heads * block_size * head_dim};
  const int64_t plane = num_blocks * shape.page_stride;
  const float* k_base = kv_pool.typed_data() + static_cast<int64_t>(layer.typed_data()[0]) * 2 * plane;
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* tables = block_tables.typed_data();
  const int64_t win = window.typed_data()[0];
  const float cap = soft_cap.typed_data()[0];
  const float* qp = q.typed_data();
  float* o = out->typed_data();
  const AttendFn attend = Specialized(head_dim, block_size);
  const int64_t row = num_heads * head_dim;

  // Each live token's sequence and the keys it sees (query i of a sequence's q_len new tokens sits at
  // kv_len - q_len + i: causal attention is decode attention over the first kv_len - q_len + i + 1 keys).
  // Padding tokens (past the last sequence's) and padding sequences' get zeros.
  const int64_t live = std::clamp<int64_t>(cu[num_seqs], 0, num_tokens);
  std::vector<int32_t> seq_of(live), keys_of(live);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t begin = std::clamp<int64_t>(cu[seq], 0, live), end = std::clamp<int64_t>(cu[seq + 1], begin, live);
    for (int64_t t = begin; t < end; ++t) {
      seq_of[t] = static_cast<int32_t>(seq);
      keys_of[t] = static_cast<int32_t>(lens[seq] - (cu[seq + 1] - cu[seq]) + (t - cu[seq]) + 1);
    }
  }
  std::fill(o + live * row, o + num_tokens * row, 0.0f);
  auto first_page = [&](int64_t i, const float* plane_base) -> const float* {
    if (i < 0) return nullptr;
    const int64_t t = i / kv_heads, h = i % kv_heads;
    if (keys_of[t] <= 0) return nullptr;
    const int64_t page = FirstKey(keys_of[t], win) / block_size;
    return plane_base + h * block_size * head_dim +
           static_cast<int64_t>(tables[seq_of[t] * max_blocks + page]) * shape.page_stride;
  };
  auto item = [&](int64_t i, int64_t next) {
    const int64_t t = i / kv_heads, h = i % kv_heads;
    const int64_t head = h * shape.group * head_dim;
    const int64_t seq = seq_of[t];
    if (keys_of[t] <= 0) {
      std::fill(o + t * row + head, o + t * row + head + shape.group * head_dim, 0.0f);
      return;
    }
    attend(shape, qp + t * row + head, k_base + h * block_size * head_dim, k_base + plane + h * block_size * head_dim,
           tables + seq * max_blocks, keys_of[t], win, cap, sm_scale, o + t * row + head,
           first_page(next, k_base), first_page(next, k_base + plane));
  };
  ParallelForAhead(pool, live * kv_heads, item);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedRaggedPagedAttention, RaggedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // kv_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sliding window (0: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // soft cap (0: none)
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
