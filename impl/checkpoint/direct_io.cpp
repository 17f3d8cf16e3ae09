#include "impl/checkpoint/direct_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "impl/common/error.h"

namespace zs::ckpt {
namespace {

[[noreturn]] void io_fail(const char* op, const std::string& path, int err) {
  fail(Code::Io, op, " '", path, "': ", std::strerror(err));
}

}  // namespace

bool direct_io_wanted() {
  const char* v = std::getenv("ZS_CHECKPOINT_DIRECT_IO");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// ---------------------------------------------------------------- writing

StreamWriter::StreamWriter(const std::string& path, size_t buffer_bytes) : path_(path) {
  const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  if (direct_io_wanted()) {
    fd_ = ::open(path.c_str(), flags | O_DIRECT, 0644);
    direct_ = fd_ >= 0;
  }
  if (fd_ < 0) fd_ = ::open(path.c_str(), flags, 0644);
  if (fd_ < 0) io_fail("cannot create", path, errno);
  const size_t cap = align_up(buffer_bytes);
  buf_[0] = AlignedBuffer(cap);
  buf_[1] = AlignedBuffer(cap);
  writer_ = std::thread([this] { writer_loop(); });
}

StreamWriter::~StreamWriter() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  writer_.join();
  if (fd_ >= 0) ::close(fd_);
}

void StreamWriter::write_at(const char* p, size_t n, uint64_t at) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(at));
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL && direct_) {
        // The filesystem opened the file for O_DIRECT but refuses the
        // write (or a short write left us unaligned): go on buffered.
        direct_ = false;
        if (::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_DIRECT) != 0) io_fail("cannot write", path_, errno);
        continue;
      }
      io_fail("cannot write", path_, errno);
    }
    if (w == 0) io_fail("cannot write", path_, ENOSPC);
    p += w;
    at += static_cast<uint64_t>(w);
    n -= static_cast<size_t>(w);
  }
}

void StreamWriter::writer_loop() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || job_ != nullptr; });
    if (job_ == nullptr) return;  // stopped and idle
    const char* p = job_;
    const size_t n = job_bytes_;
    const uint64_t at = job_at_;
    l.unlock();
    std::string err;
    try {
      write_at(p, n, at);
    } catch (const Error& e) {
      err = e.what();
    }
    l.lock();
    if (!err.empty() && error_.empty()) error_ = err;
    job_ = nullptr;
    cv_.notify_all();
  }
}

void StreamWriter::wait_idle() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return job_ == nullptr; });
}

void StreamWriter::rethrow() {
  std::lock_guard<std::mutex> l(mu_);
  if (!error_.empty()) throw Error(Code::Io, error_);
}

void StreamWriter::hand_off() {
  wait_idle();
  rethrow();
  {
    std::lock_guard<std::mutex> l(mu_);
    job_ = buf_[filling_].data();
    job_bytes_ = used_;
    job_at_ = flushed_;
  }
  cv_.notify_all();
  flushed_ += used_;
  used_ = 0;
  filling_ ^= 1;
}

char* StreamWriter::reserve(size_t want, size_t* got) {
  if (used_ == buf_[filling_].bytes()) hand_off();
  *got = std::min(want, buf_[filling_].bytes() - used_);
  return buf_[filling_].data() + used_;
}

void StreamWriter::commit(size_t n) {
  used_ += n;
  size_ += n;
}

void StreamWriter::append(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    size_t got = 0;
    char* dst = reserve(n, &got);
    std::memcpy(dst, p, got);
    commit(got);
    p += got;
    n -= got;
  }
}

void StreamWriter::finish() {
  wait_idle();
  rethrow();
  if (used_ > 0) {
    // O_DIRECT writes whole aligned blocks: the tail goes out padded with
    // zeros, and the file is cut back to its true size after.
    const size_t n = direct_ ? align_up(used_) : used_;
    std::memset(buf_[filling_].data() + used_, 0, n - used_);
    write_at(buf_[filling_].data(), n, flushed_);
    if (n != used_ && ::ftruncate(fd_, static_cast<off_t>(size_)) != 0) io_fail("cannot truncate", path_, errno);
    flushed_ += used_;
    used_ = 0;
  }
  if (::fsync(fd_) != 0) io_fail("cannot fsync", path_, errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) io_fail("cannot close", path_, errno);
}

// ---------------------------------------------------------------- reading

DirectReadFile::DirectReadFile(const std::string& path) : path_(path) {
  if (direct_io_wanted()) fd_ = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
}

DirectReadFile::~DirectReadFile() {
  if (fd_ >= 0) ::close(fd_);
}

bool DirectReadFile::pread_all(char* p, size_t n, uint64_t at, const std::string& what) {
  while (n > 0) {
    const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(at));
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL) {  // refused after all: buffered from now on
        ::close(fd_);
        fd_ = -1;
        return false;
      }
      io_fail("cannot read", path_, errno);
    }
    // Nothing, or a short read that is not whole blocks: the file ends
    // before the bytes wanted.
    if (r == 0 || (static_cast<size_t>(r) % kIoAlign != 0 && static_cast<size_t>(r) < n)) {
      struct stat st;
      const uint64_t size = ::fstat(fd_, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
      fail(Code::Io, "file '", path_, "' is truncated: ", what, " needs bytes up to ", at + n,
           ", the file has ", size);
    }
    p += r;
    at += static_cast<uint64_t>(r);
    n -= static_cast<size_t>(r);
  }
  return true;
}

}  // namespace zs::ckpt
