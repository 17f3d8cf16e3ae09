// Checkpoint file streams that bypass the page cache (O_DIRECT) where the
// filesystem allows it. A checkpoint is written once and read once, so the
// cache buys nothing, and a buffered read or write costs a kernel copy and
// page-cache churn per byte: on a 2-core machine that is as much time as
// the disk's own. Where O_DIRECT is refused (tmpfs, some FUSE and network
// filesystems) or ZS_CHECKPOINT_DIRECT_IO=0, the same calls do buffered I/O.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "impl/common/aligned_buffer.h"  // AlignedBuffer, kIoAlign: O_DIRECT's alignment

namespace zs::ckpt {

// False when ZS_CHECKPOINT_DIRECT_IO is "0" (buffered I/O everywhere).
bool direct_io_wanted();

// Writes a new file front to back. Bytes gather in one of two aligned
// buffers; a full buffer goes to the disk on a writer thread while the
// caller fills the other, so copying and hashing overlap the disk.
// finish() writes the rest, trims the O_DIRECT padding and fsyncs.
// Errors (ENOSPC, EFBIG, EIO) name the path and surface at the next call.
class StreamWriter {
 public:
  explicit StreamWriter(const std::string& path, size_t buffer_bytes = 8u << 20);
  ~StreamWriter();  // without finish(): stops the writer, leaves the file as is
  StreamWriter(const StreamWriter&) = delete;
  StreamWriter& operator=(const StreamWriter&) = delete;

  // Room for the next bytes of the stream: at most `want`, at least 1;
  // fill it, then commit how many were filled.
  char* reserve(size_t want, size_t* got);
  void commit(size_t n);
  void append(const void* data, size_t n);
  void finish();
  uint64_t size() const { return size_; }
  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }

 private:
  void hand_off();          // the filled buffer to the writer thread
  void wait_idle();         // the writer thread done with its buffer
  void write_at(const char* p, size_t n, uint64_t at);
  void writer_loop();
  void rethrow();

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  AlignedBuffer buf_[2];
  int filling_ = 0;
  size_t used_ = 0;      // bytes in buf_[filling_]
  uint64_t size_ = 0;    // bytes committed in all
  uint64_t flushed_ = 0; // file offset of buf_[filling_]'s first byte

  std::mutex mu_;
  std::condition_variable cv_;
  const char* job_ = nullptr;  // buffer the writer thread is writing
  size_t job_bytes_ = 0;
  uint64_t job_at_ = 0;
  bool stop_ = false;
  std::string error_;
  std::thread writer_;
};

// A file opened for O_DIRECT reads beside its buffered descriptor; fd() is
// -1 where O_DIRECT is not wanted or the filesystem refuses it.
class DirectReadFile {
 public:
  DirectReadFile() = default;
  explicit DirectReadFile(const std::string& path);
  ~DirectReadFile();
  DirectReadFile(DirectReadFile&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  DirectReadFile(const DirectReadFile&) = delete;
  DirectReadFile& operator=(const DirectReadFile&) = delete;
  bool ok() const { return fd_ >= 0; }
  // Reads exactly n bytes at `at` into p (all three aligned). False when
  // the kernel refused the direct read (EINVAL): the caller reads buffered,
  // and this file stays buffered from then on. A file that ends first is
  // Code::Io naming `what`.
  bool pread_all(char* p, size_t n, uint64_t at, const std::string& what);

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace zs::ckpt
