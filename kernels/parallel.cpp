#include "kernels/parallel.h"

#if defined(__linux__)
#include <sched.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace zs::kernels {
namespace {

int default_threads() {
  if (const char* s = std::getenv("ZS_NUM_THREADS")) {
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (end != s && *end == '\0' && v >= 1 && v <= 4096) return static_cast<int>(v);
  }
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int c = CPU_COUNT(&set);
    if (c >= 1) return c;
  }
#endif
  const unsigned h = std::thread::hardware_concurrency();
  return h >= 1 ? static_cast<int>(h) : 1;
}

std::atomic<int> g_threads_override{0};

int default_threads_cached() {
  static const int n = default_threads();
  return n;
}

// True on a pool worker and on a caller while it runs a job: a nested
// parallel_for then runs inline.
thread_local bool t_in_job = false;

struct Job {
  detail::RangeFn fn;
  void* ctx;
  size_t n;
  size_t chunk;
  size_t nchunks;
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::exception_ptr err;

  void run_chunks() {
    for (;;) {
      const size_t k = next.fetch_add(1, std::memory_order_relaxed);
      if (k >= nchunks) return;
      if (failed.load(std::memory_order_relaxed)) continue;  // drain
      const size_t b = k * chunk;
      const size_t e = std::min(n, b + chunk);
      try {
        fn(ctx, b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu);
        if (!err) err = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
      }
    }
  }
};

class Pool {
 public:
  explicit Pool(pid_t pid) : pid_(pid) {}
  pid_t pid() const { return pid_; }

  // Runs the job with up to `threads` threads (the caller included).
  // Returns false, having done nothing, when another caller holds the pool.
  bool run(Job& job, int threads) {
    std::unique_lock<std::mutex> submit(submit_mu_, std::try_to_lock);
    if (!submit.owns_lock()) return false;
    const int wanted = static_cast<int>(
        std::min<size_t>(static_cast<size_t>(threads - 1), job.nchunks - 1));
    const int helpers = ensure_workers(wanted);
    if (helpers <= 0) return false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &job;
      helpers_ = helpers;
      ++generation_;
    }
    cv_work_.notify_all();
    t_in_job = true;
    job.run_chunks();
    t_in_job = false;
    std::unique_lock<std::mutex> lk(mu_);
    job_ = nullptr;  // late wakers do not join any more
    cv_done_.wait(lk, [&] { return busy_ == 0; });
    return true;
  }

 private:
  // Starts workers up to `count`; returns how many there are (fewer when
  // the system refuses new threads).
  int ensure_workers(int count) {
    while (nworkers_ < count) {
      try {
        std::thread(&Pool::worker_main, this, nworkers_).detach();
      } catch (...) {
        break;
      }
      ++nworkers_;
    }
    return std::min(count, nworkers_);
  }

  void worker_main(int index) {
    t_in_job = true;
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_work_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      Job* job = job_;
      if (job == nullptr || index >= helpers_) continue;
      ++busy_;
      lk.unlock();
      job->run_chunks();
      lk.lock();
      if (--busy_ == 0) cv_done_.notify_all();
    }
  }

  const pid_t pid_;
  std::mutex submit_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable cv_work_;
  std::condition_variable cv_done_;
  Job* job_ = nullptr;
  int helpers_ = 0;
  int busy_ = 0;
  uint64_t generation_ = 0;
  int nworkers_ = 0;  // touched only under submit_mu_
};

std::atomic<Pool*> g_pool{nullptr};

// The pool of this process. Lock-free, so a fork() that happened while some
// parent thread held a lock cannot deadlock the child here; the parent's
// pool (and its threads, which do not exist in the child) is abandoned.
Pool* this_process_pool() {
  const pid_t pid = getpid();
  Pool* p = g_pool.load(std::memory_order_acquire);
  while (p == nullptr || p->pid() != pid) {
    Pool* fresh = new Pool(pid);
    if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return fresh;
    delete fresh;  // someone else installed one: p now holds it; check again
  }
  return p;
}

}  // namespace

int num_threads() {
  const int o = g_threads_override.load(std::memory_order_relaxed);
  return o >= 1 ? o : default_threads_cached();
}

void set_num_threads(int n) { g_threads_override.store(n >= 1 ? n : 0, std::memory_order_relaxed); }

namespace detail {

void parallel_for_impl(size_t n, size_t grain, size_t align, RangeFn fn, void* ctx) {
  if (n == 0) return;
  if (align == 0) align = 1;
  if (grain == 0) grain = 1;
  const int threads = num_threads();
  if (threads <= 1 || t_in_job || n < 2 * grain) {
    fn(ctx, 0, n);
    return;
  }
  // About four chunks per thread for balance, none under `grain`, each a
  // multiple of `align`.
  size_t chunk = (n + static_cast<size_t>(threads) * 4 - 1) / (static_cast<size_t>(threads) * 4);
  chunk = std::max(chunk, grain);
  chunk = (chunk + align - 1) / align * align;
  const size_t nchunks = (n + chunk - 1) / chunk;
  if (nchunks <= 1) {
    fn(ctx, 0, n);
    return;
  }
  Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.n = n;
  job.chunk = chunk;
  job.nchunks = nchunks;
  if (!this_process_pool()->run(job, threads)) {
    fn(ctx, 0, n);  // pool busy with another caller
    return;
  }
  if (job.err) std::rethrow_exception(job.err);
}

}  // namespace detail
}  // namespace zs::kernels
