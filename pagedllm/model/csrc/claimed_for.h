// Work items handed to threads as they ask for them, not split up front: on a shared machine a thread that loses
// its core for a while (another process, the server's event loop) leaves its items to the others instead of making
// the whole call wait for it at the end (at::parallel_for gives each thread a fixed share).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// body(i, after) for every i in [0, n), claimed in runs of `run` consecutive items (small items: a run streams
// through adjacent memory, and the claims stay few): `after` is the item the same thread runs next (claimed before i
// starts, so that its data can be prefetched meanwhile), or -1.
template <typename F>
inline void for_each_claimed(int64_t n, int64_t run, F&& body) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t runs = (n + run - 1) / run;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), runs);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    int64_t start = next.fetch_add(run, std::memory_order_relaxed);
    while (start < n) {
      const int64_t following = next.fetch_add(run, std::memory_order_relaxed);
      const int64_t end = std::min(n, start + run);
      for (int64_t i = start; i < end; ++i) body(i, i + 1 < end ? i + 1 : following < n ? following : -1);
      start = following;
    }
  });
}
