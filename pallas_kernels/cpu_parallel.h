// Work shared between the caller of an FFI handler and the threads of XLA's intra-op pool (the
// native CPU kernels: cpu_attention.cc, cpu_matmul.cc).
#ifndef JAXPAGED_CPU_PARALLEL_H_
#define JAXPAGED_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxpaged {

// Items 0..total-1 shared by the caller and up to `pool.num_threads() - 1` pool tasks. The caller never
// waits for a task that has not started: a task counts itself running before it takes an item, and one
// that starts after the items are gone takes none (it touches only `work`, which it keeps alive).
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> running{0};
  std::mutex mu;
  std::condition_variable idle;
};

// Runs drain(work) on the caller and on up to min(pool threads, total) - 1 pool tasks; returns when
// every task that started has finished. drain takes items from work.next until `total` is reached.
template <typename D>
void Share(xla::ffi::ThreadPool& pool, int64_t total, D drain) {
  auto work = std::make_shared<Work>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([work, drain]() {
      work->running.fetch_add(1);
      drain(*work);
      if (work->running.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(work->mu);
        work->idle.notify_all();
      }
    });
  }
  drain(*work);
  std::unique_lock<std::mutex> lock(work->mu);
  work->idle.wait(lock, [&] { return work->running.load() == 0; });
}

template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t total, F& item) {
  Share(pool, total, [total, &item](Work& work) {
    for (int64_t i = work.next.fetch_add(1); i < total; i = work.next.fetch_add(1)) item(i);
  });
}

// As ParallelFor, but item(i, next) also learns the item its thread takes after i (-1: none), so a
// kernel can prefetch that item's data while it computes this one. A thread claims that next item before
// it runs i, so with few items (fewer than 4 a thread: one sequence's decode attention, a narrow matmul)
// one thread could hold two while another finds none: there each item is taken alone (next -1).
template <typename F>
void ParallelForAhead(xla::ffi::ThreadPool& pool, int64_t total, F& item) {
  if (total < 4 * static_cast<int64_t>(pool.num_threads())) {
    auto alone = [&item](int64_t i) { item(i, -1); };
    ParallelFor(pool, total, alone);
    return;
  }
  Share(pool, total, [total, &item](Work& work) {
    for (int64_t i = work.next.fetch_add(1); i < total;) {
      const int64_t next = work.next.fetch_add(1);
      item(i, next < total ? next : -1);
      i = next;
    }
  });
}

}  // namespace jaxpaged

#endif  // JAXPAGED_CPU_PARALLEL_H_
