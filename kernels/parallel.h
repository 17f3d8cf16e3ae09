// A small persistent thread pool for the CPU kernels.
//
// parallel_for(n, grain, fn) calls fn(begin, end) on disjoint ranges that
// cover [0, n). Every range begins on a multiple of `align` (64 elements by
// default, a cache line of fp32 and more) and, but for the last, holds at
// least `grain` elements. When the work is small (n < 2 * grain), when one
// thread is configured, or when the pool is busy with another caller's job
// (or this is a nested call from inside a job), fn(0, n) runs on the calling
// thread: parallel_for never blocks waiting for the pool to become free.
//
// The pool is created lazily on first use, its workers are detached and the
// pool is leaked on purpose (no static destruction order problems at exit).
// It is fork-safe: a pool created before fork() belongs to the parent; the
// first parallel_for in the child notices the pid change, abandons the
// parent's copy (never touching its locks) and starts a fresh pool.
//
// fn should not throw; if it does, the first exception is rethrown on the
// calling thread after every range has finished.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

namespace zs::kernels {

// Threads used by the kernels: set_num_threads(n) if n >= 1 was called,
// else ZS_NUM_THREADS when it is a positive integer, else the CPUs this
// process may run on (sched_getaffinity), else hardware concurrency.
int num_threads();
// n >= 1 fixes the count (tests, benchmarks); n <= 0 restores the default.
void set_num_threads(int n);

namespace detail {
using RangeFn = void (*)(void* ctx, size_t begin, size_t end);
void parallel_for_impl(size_t n, size_t grain, size_t align, RangeFn fn, void* ctx);
}  // namespace detail

template <typename F>
void parallel_for(size_t n, size_t grain, F&& fn, size_t align = 64) {
  using Fn = std::remove_reference_t<F>;
  detail::parallel_for_impl(
      n, grain, align,
      [](void* ctx, size_t begin, size_t end) { (*static_cast<Fn*>(ctx))(begin, end); },
      const_cast<void*>(static_cast<const void*>(&fn)));
}

}  // namespace zs::kernels
