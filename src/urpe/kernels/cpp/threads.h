// How the tile loops' work items are spread over torch's intra-op threads (gemm.cpp defines
// workers_for and chunk_for, which decide how many threads and how many items at once).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace urpe_cpp {

// Runs item(worker, index) for index in [0, count) on torch's intra-op threads. Workers take
// the next index as they finish one (a shared counter), so a thread slowed by another process
// on its core takes fewer items instead of holding everyone back. `worker` < workers(count)
// names per-worker scratch.
// `work`: the call's multiply-adds; a call too small to repay waking another thread (a short
// row) runs on the calling thread alone, and so does one of few query rows (`query_rows` per
// head, a decoding step) up to a larger size.
int64_t workers_for(int64_t count, double work = 1e30, int64_t query_rows = 1 << 30);

// Whether `query_rows` per head make a decoding step (few rows, each streaming the keys once).
bool few_query_rows(int64_t query_rows);

// How many consecutive items a worker takes from the shared counter at once, for `count` items
// of `work` multiply-adds in all on `workers` threads (1 for items that are long on their own).
int64_t chunk_for(int64_t count, int64_t workers, double work);

// While alive, BLAS calls from this thread run on this thread alone. torch turns MKL's dynamic
// thread adjustment off (mkl_set_dynamic(false)), so a product called inside a parallel region
// would otherwise start a team of its own on cores the other workers already use.
class BlasThreadsGuard {
 public:
  BlasThreadsGuard();
  ~BlasThreadsGuard();
  BlasThreadsGuard(const BlasThreadsGuard&) = delete;
  BlasThreadsGuard& operator=(const BlasThreadsGuard&) = delete;

 private:
  int previous_ = -1;
};

// `chunk`: items taken at once (`chunk_for`). `fixed`: worker w takes items w, w + workers, ...
// instead, so that which worker sums what into its private table gradients is the same on every
// run (deterministic mode).
template <typename F>
void run_items(int64_t count, int64_t workers, const F& item, bool fixed = false,
               int64_t chunk = 1) {
  std::atomic<int64_t> next{0};
  auto drain = [&](int64_t worker) {
    const BlasThreadsGuard one_thread;
    if (fixed) {
      for (int64_t index = worker; index < count; index += workers) item(worker, index);
      return;
    }
    for (int64_t begin = next.fetch_add(chunk); begin < count; begin = next.fetch_add(chunk)) {
      const int64_t end = std::min(count, begin + chunk);
      for (int64_t index = begin; index < end; ++index) item(worker, index);
    }
  };
  if (workers <= 1) {
    drain(0);
    return;
  }
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) drain(worker);
  });
}

}  // namespace urpe_cpp
