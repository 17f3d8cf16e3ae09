// The NVMe swapper: one preallocated file per rank under the configured
// directory, tensors addressed by byte offset, I/O through io_uring.
//
// The aio settings mean what they mean in DeepSpeed's swapper: a request is
// cut into `block_size` pieces, at most `queue_depth` of them in flight per
// ring; `intra_op_parallelism` threads, each with its own ring, take equal
// contiguous parts of every request; `single_submit` submits each piece
// with its own system call instead of a batch; `overlap_events` refills the
// queue as each piece completes instead of waiting for the whole batch.
// The file is opened O_DIRECT (no page cache; buffers, offsets and sizes
// aligned to kIoAlign) and falls back, with one warning per process, to
// buffered I/O where the filesystem refuses it (tmpfs). Short reads and
// writes are retried from where they stopped; a failed piece is an Io error
// naming the file, the offset and errno, after every other piece of the
// request has completed (the caller's memory is never written after wait).
// The file is removed when the swapper is destroyed.
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "impl/config/config.h"
#include "impl/common/aligned_buffer.h"

namespace zs {

struct SwapperOptions {
  std::string dir;        // the directory (nvme_path); must exist
  std::string file_name;  // unique within dir (rank and process in it)
  AioConfig aio;
  std::string what = "offload_optimizer.nvme_path";  // names dir in messages
  bool try_direct = true;  // false: buffered I/O from the start (tests)
};

class Swapper {
 public:
  using Ticket = uint64_t;

  explicit Swapper(const SwapperOptions& options);
  ~Swapper();
  Swapper(const Swapper&) = delete;
  Swapper& operator=(const Swapper&) = delete;

  // Appends `bytes` (rounded up to kIoAlign) to the file, allocated on disk
  // now (fallocate), and returns where they begin. Not enough space is an
  // Io error naming the directory, the bytes needed and the bytes free.
  uint64_t grow(uint64_t bytes);
  uint64_t size() const;
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }

  // Memory the rings know in advance (io_uring fixed buffers), so the kernel
  // maps it once rather than per request. Replaces the previous set; waits
  // for requests in flight. The buffers must outlive the swapper or the
  // next call. Where the kernel refuses (locked-memory limit), requests use
  // plain reads and writes, as for any other memory.
  void register_buffers(const std::vector<const AlignedBuffer*>& buffers);

  // Asynchronous I/O between file bytes [offset, offset + bytes) and
  // memory at addr. offset and addr are multiples of kIoAlign; bytes is
  // rounded up to kIoAlign, so addr and the file must have room for that.
  Ticket read_async(uint64_t offset, void* addr, uint64_t bytes);
  Ticket write_async(uint64_t offset, const void* addr, uint64_t bytes);
  // Blocks until the request completed; throws its error.
  void wait(Ticket t);
  // Waits for every request; throws the first error among them.
  void wait_all();

  // Synchronous, for any offset, size and memory: staged through an
  // aligned buffer of the swapper's; a partly covered block of a write is
  // read first and written back whole. Callers keep concurrent writes out
  // of each other's kIoAlign blocks.
  void read(uint64_t offset, void* dst, uint64_t bytes);
  void write(uint64_t offset, const void* src, uint64_t bytes);

  // Fault injection for tests: the next completed piece reports -err, as
  // if the device had returned it.
  void inject_error_for_test(int err) { inject_.store(err); }

 private:
  struct Part;
  struct Request;
  struct Worker;

  Ticket submit(bool write, uint64_t offset, char* addr, uint64_t bytes);
  void worker_loop(Worker& w);
  // Stops and joins the workers, closes and removes the file: the
  // destructor's end, and a constructor's that failed half-way.
  void shut_down();
  int fixed_index(const char* addr, uint64_t bytes) const;
  void check_range(const char* op, uint64_t offset, uint64_t bytes) const;

  std::string dir_, path_, what_;
  AioConfig aio_;
  uint64_t block_ = 0;  // piece size, a multiple of kIoAlign
  int fd_ = -1;
  bool direct_ = false;
  std::atomic<uint64_t> size_{0};
  std::atomic<int> inject_{0};

  std::mutex mu_;  // requests, worker queues, registered buffers
  std::condition_variable done_cv_;
  std::map<Ticket, std::unique_ptr<Request>> requests_;
  Ticket next_ticket_ = 1;
  std::vector<std::pair<const char*, uint64_t>> fixed_;  // registered buffers
  bool fixed_ok_ = false;
  std::vector<std::unique_ptr<Worker>> workers_;

  std::mutex staging_mu_;  // the synchronous path
  AlignedBuffer staging_;
};

}  // namespace zs
