#include "impl/offload/swapper.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <list>
#include <thread>

#include "impl/common/error.h"
#include "impl/offload/space.h"

namespace zs {
namespace {

std::string errno_text(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

void warn_buffered_once(const std::string& path) {
  static std::once_flag once;
  std::call_once(once, [&] {
    std::fprintf(stderr,
                 "zeroshard: warning: the filesystem of '%s' refuses O_DIRECT; NVMe swap files "
                 "use buffered I/O (through the page cache) instead\n",
                 path.c_str());
  });
}

}  // namespace

struct Swapper::Request {
  int parts_left = 0;
  std::string error;
};

struct Swapper::Part {
  bool write = false;
  uint64_t offset = 0;
  char* addr = nullptr;
  uint64_t bytes = 0;
  int fixed = -1;  // index of the registered buffer holding addr, or -1
  Request* req = nullptr;
};

struct Swapper::Worker {
  io_uring ring{};
  std::thread thread;
  std::deque<Part> queue;
  std::condition_variable cv;
  bool stop = false;
};

Swapper::Swapper(const SwapperOptions& o) : dir_(o.dir), what_(o.what), aio_(o.aio) {
  path_ = dir_ + "/" + o.file_name;
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  fd_ = o.try_direct ? ::open(path_.c_str(), flags | O_DIRECT, 0600) : -1;
  if (fd_ >= 0) {
    direct_ = true;
  } else if (!o.try_direct) {
    fd_ = ::open(path_.c_str(), flags, 0600);
  } else if (errno == EINVAL) {  // the filesystem has no O_DIRECT (tmpfs before Linux 6.6)
    fd_ = ::open(path_.c_str(), flags, 0600);
    if (fd_ >= 0) warn_buffered_once(path_);
  }
  if (fd_ < 0) {
    const int err = errno;
    fail(Code::Io, "cannot create the swap file '", path_, "' (", what_, " '", dir_, "'): ",
         errno_text(err));
  }
  // O_DIRECT moves whole aligned blocks; a piece is at least one.
  block_ = align_up(static_cast<uint64_t>(std::max<int64_t>(aio_.block_size, 1)));
  const unsigned depth = static_cast<unsigned>(std::max<int64_t>(aio_.queue_depth, 1));
  const int threads = static_cast<int>(std::max<int64_t>(aio_.thread_count, 1));
  try {
    staging_ = AlignedBuffer(std::clamp<uint64_t>(block_ * depth, uint64_t{1} << 20, uint64_t{64} << 20));
    for (int i = 0; i < threads; ++i) {
      auto w = std::make_unique<Worker>();
      const int r = io_uring_queue_init(depth, &w->ring, 0);
      if (r < 0)
        fail(Code::NotSupported, "io_uring_queue_init(", depth, ") for the swap file '", path_,
             "' failed: ", errno_text(-r));
      workers_.push_back(std::move(w));
      Worker* wp = workers_.back().get();
      wp->thread = std::thread([this, wp] { worker_loop(*wp); });
    }
  } catch (...) {
    shut_down();
    throw;
  }
  register_buffers({});
}

Swapper::~Swapper() {
  try {
    wait_all();
  } catch (...) {
    // Errors were the callers' to collect; the file goes away regardless.
  }
  shut_down();
}

void Swapper::shut_down() {
  for (auto& w : workers_) {
    {
      std::lock_guard<std::mutex> held(mu_);
      w->stop = true;
    }
    w->cv.notify_all();
    w->thread.join();
    io_uring_queue_exit(&w->ring);
  }
  ::close(fd_);
  ::unlink(path_.c_str());
}

uint64_t Swapper::size() const { return size_.load(); }

uint64_t Swapper::grow(uint64_t bytes) {
  std::lock_guard<std::mutex> held(mu_);
  const uint64_t need = align_up(bytes);
  const uint64_t at = size_.load();
  if (need == 0) return at;
  check_free_space(dir_, need, what_);
  int r = ::fallocate(fd_, 0, static_cast<off_t>(at), static_cast<off_t>(need));
  int err = r == 0 ? 0 : errno;
  if (err == EOPNOTSUPP) err = ::posix_fallocate(fd_, static_cast<off_t>(at), static_cast<off_t>(need));
  if (err == ENOSPC || err == EDQUOT)
    fail(Code::Io, what_, " '", dir_, "': needs ", need, " bytes, ", free_bytes(dir_),
         " bytes free (", errno_text(err), " allocating the swap file '", path_, "')");
  if (err != 0)
    fail(Code::Io, "cannot allocate ", need, " bytes at offset ", at, " of the swap file '", path_,
         "': ", errno_text(err));
  size_.store(at + need);
  return at;
}

void Swapper::register_buffers(const std::vector<const AlignedBuffer*>& buffers) {
  wait_all();
  std::lock_guard<std::mutex> held(mu_);
  std::vector<iovec> iov;
  // The staging buffer (fixed for the swapper's life) is always index 0.
  iov.push_back({staging_.data(), staging_.bytes()});
  for (const AlignedBuffer* b : buffers)
    if (b != nullptr && b->bytes() > 0) iov.push_back({b->data(), b->bytes()});
  fixed_.clear();
  fixed_ok_ = true;
  for (auto& w : workers_) {
    io_uring_unregister_buffers(&w->ring);  // none yet is fine
    if (io_uring_register_buffers(&w->ring, iov.data(), static_cast<unsigned>(iov.size())) < 0)
      fixed_ok_ = false;
  }
  if (!fixed_ok_) {
    for (auto& w : workers_) io_uring_unregister_buffers(&w->ring);
    return;
  }
  for (const iovec& v : iov) fixed_.emplace_back(static_cast<const char*>(v.iov_base), v.iov_len);
}

int Swapper::fixed_index(const char* addr, uint64_t bytes) const {
  if (!fixed_ok_) return -1;
  for (size_t i = 0; i < fixed_.size(); ++i)
    if (addr >= fixed_[i].first && addr + bytes <= fixed_[i].first + fixed_[i].second)
      return static_cast<int>(i);
  return -1;
}

void Swapper::check_range(const char* op, uint64_t offset, uint64_t bytes) const {
  const uint64_t size = size_.load();
  if (offset > size || bytes > size - offset)
    fail(Code::InvalidArgument, "swap file '", path_, "': ", op, " of ", bytes, " bytes at offset ",
         offset, " is beyond its ", size, " bytes");
}

Swapper::Ticket Swapper::submit(bool write, uint64_t offset, char* addr, uint64_t bytes) {
  const char* op = write ? "write" : "read";
  if (offset % kIoAlign != 0 || reinterpret_cast<uintptr_t>(addr) % kIoAlign != 0)
    fail(Code::InvalidArgument, "swap file '", path_, "': asynchronous ", op, " at offset ", offset,
         " from memory ", static_cast<const void*>(addr), ": both must be multiples of ", kIoAlign);
  bytes = align_up(bytes);
  check_range(op, offset, bytes);
  std::lock_guard<std::mutex> held(mu_);
  const Ticket t = next_ticket_++;
  auto req = std::make_unique<Request>();
  // Equal contiguous parts, one per worker, cut at block boundaries.
  const uint64_t blocks = (bytes + block_ - 1) / block_;
  const uint64_t nparts = std::max<uint64_t>(1, std::min<uint64_t>(workers_.size(), blocks));
  const uint64_t per = (blocks + nparts - 1) / nparts * block_;
  std::vector<Part> parts;
  for (uint64_t at = 0; at < bytes || parts.empty(); at += per) {
    Part p;
    p.write = write;
    p.offset = offset + at;
    p.addr = addr + at;
    p.bytes = std::min(per, bytes - at);
    p.fixed = fixed_index(p.addr, p.bytes);
    p.req = req.get();
    parts.push_back(p);
    if (bytes == 0) break;
  }
  req->parts_left = static_cast<int>(parts.size());
  requests_.emplace(t, std::move(req));
  for (size_t i = 0; i < parts.size(); ++i) {
    workers_[i]->queue.push_back(parts[i]);
    workers_[i]->cv.notify_one();
  }
  return t;
}

Swapper::Ticket Swapper::read_async(uint64_t offset, void* addr, uint64_t bytes) {
  return submit(false, offset, static_cast<char*>(addr), bytes);
}

Swapper::Ticket Swapper::write_async(uint64_t offset, const void* addr, uint64_t bytes) {
  return submit(true, offset, static_cast<char*>(const_cast<void*>(addr)), bytes);
}

void Swapper::wait(Ticket t) {
  std::unique_lock<std::mutex> held(mu_);
  auto it = requests_.find(t);
  if (it == requests_.end()) fail(Code::InvalidArgument, "swap request ", t, " is unknown or was waited for");
  done_cv_.wait(held, [&] { return it->second->parts_left == 0; });
  const std::string error = std::move(it->second->error);
  requests_.erase(it);
  if (!error.empty()) throw Error(Code::Io, error);
}

void Swapper::wait_all() {
  std::unique_lock<std::mutex> held(mu_);
  std::string first;
  while (!requests_.empty()) {
    auto it = requests_.begin();
    done_cv_.wait(held, [&] { return it->second->parts_left == 0; });
    if (first.empty()) first = std::move(it->second->error);
    requests_.erase(it);
  }
  if (!first.empty()) throw Error(Code::Io, first);
}

// Each worker runs the parts given to it on its own ring: pieces of block_
// bytes, at most queue_depth in flight, taken from the oldest part that
// has pieces left, so the next request's pieces fill the queue while the
// last ones of the previous request complete. Short transfers go again
// from where they stopped. A part with an error issues nothing more and is
// reported once its pieces in flight have completed.
void Swapper::worker_loop(Worker& w) {
  struct Active {
    Part part;
    uint64_t next = 0;  // bytes handed to the ring so far
    int pending = 0;    // pieces in flight or waiting to go again
    std::string error;
  };
  struct Piece {
    Active* a;
    char* addr;
    uint64_t offset;
    uint64_t bytes;
  };
  const unsigned depth = static_cast<unsigned>(std::max<int64_t>(aio_.queue_depth, 1));
  std::vector<Piece> slots(depth);
  std::vector<unsigned> free_slots;
  for (unsigned i = depth; i-- > 0;) free_slots.push_back(i);
  std::deque<Piece> retry;
  std::list<Active> active;
  unsigned inflight = 0;

  auto fail_piece = [&](const Piece& c, const std::string& why) {
    if (!c.a->error.empty()) return;
    c.a->error = std::string("NVMe swap: ") + (c.a->part.write ? "write" : "read") + " of " +
                 std::to_string(c.bytes) + " bytes at offset " + std::to_string(c.offset) + " of '" + path_ +
                 "' failed: " + why;
  };
  // Parts with nothing left in flight and nothing left to issue are done.
  auto report = [&] {
    std::lock_guard<std::mutex> held(mu_);
    for (auto it = active.begin(); it != active.end();) {
      Active& a = *it;
      const bool issued = a.next == a.part.bytes || !a.error.empty();
      if (!issued || a.pending > 0) {
        ++it;
        continue;
      }
      Request* req = a.part.req;
      if (!a.error.empty() && req->error.empty()) req->error = std::move(a.error);
      if (--req->parts_left == 0) done_cv_.notify_all();
      it = active.erase(it);
    }
  };

  for (;;) {
    {
      std::unique_lock<std::mutex> held(mu_);
      if (active.empty()) {
        w.cv.wait(held, [&] { return w.stop || !w.queue.empty(); });
        if (w.queue.empty()) return;  // stop, with nothing left to do
      }
      while (!w.queue.empty()) {
        active.emplace_back();
        active.back().part = w.queue.front();
        w.queue.pop_front();
      }
    }
    unsigned queued = 0;
    std::string submit_error;
    while (inflight < depth) {
      Piece c{};
      if (!retry.empty()) {
        c = retry.front();
        retry.pop_front();
        if (!c.a->error.empty()) {  // its part failed meanwhile: drop it
          --c.a->pending;
          continue;
        }
      } else {
        Active* a = nullptr;
        for (Active& x : active)
          if (x.error.empty() && x.next < x.part.bytes) {
            a = &x;
            break;
          }
        if (a == nullptr) break;
        c = {a, a->part.addr + a->next, a->part.offset + a->next, std::min(block_, a->part.bytes - a->next)};
        a->next += c.bytes;
        ++a->pending;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&w.ring);
      if (sqe == nullptr) {  // the ring is full of unsubmitted entries
        retry.push_front(c);
        break;
      }
      const unsigned slot = free_slots.back();
      free_slots.pop_back();
      slots[slot] = c;
      const Part& p = c.a->part;
      const unsigned len = static_cast<unsigned>(c.bytes);
      if (p.fixed >= 0) {
        if (p.write) io_uring_prep_write_fixed(sqe, fd_, c.addr, len, c.offset, p.fixed);
        else io_uring_prep_read_fixed(sqe, fd_, c.addr, len, c.offset, p.fixed);
      } else {
        if (p.write) io_uring_prep_write(sqe, fd_, c.addr, len, c.offset);
        else io_uring_prep_read(sqe, fd_, c.addr, len, c.offset);
      }
      io_uring_sqe_set_data64(sqe, slot);
      ++inflight;
      ++queued;
      if (aio_.single_submit) {
        int r;
        do r = io_uring_submit(&w.ring);
        while (r == -EINTR || r == -EAGAIN);
        if (r < 0) submit_error = "io_uring_submit: " + errno_text(-r);
        queued = 0;
      }
    }
    if (queued > 0) {
      int r;
      do r = io_uring_submit(&w.ring);
      while (r == -EINTR || r == -EAGAIN);
      if (r < 0) submit_error = "io_uring_submit: " + errno_text(-r);
    }
    if (!submit_error.empty()) {
      // The ring refused work: what it holds will not complete. Every part
      // here fails; the worker goes on with a fresh view of the ring.
      for (Active& a : active) {
        if (a.error.empty()) a.error = "NVMe swap on '" + path_ + "': " + submit_error;
        a.pending = 0;
      }
      retry.clear();
      inflight = 0;
      free_slots.clear();
      for (unsigned i = depth; i-- > 0;) free_slots.push_back(i);
      report();
      continue;
    }
    if (inflight == 0) {
      report();
      continue;
    }
    // overlap_events: take each completion as it comes and refill; else
    // the whole batch completes before the next is submitted.
    do {
      io_uring_cqe* cqe = nullptr;
      const int r = io_uring_wait_cqe(&w.ring, &cqe);
      if (r == -EINTR || r == -EAGAIN) continue;
      if (r < 0) {
        submit_error = "io_uring_wait_cqe: " + errno_text(-r);
        break;
      }
      const unsigned slot = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
      int res = cqe->res;
      io_uring_cqe_seen(&w.ring, cqe);
      const Piece c = slots[slot];
      free_slots.push_back(slot);
      --inflight;
      if (const int inj = inject_.exchange(0); inj != 0) res = -inj;
      if (res == -EINTR || res == -EAGAIN) {
        retry.push_back(c);
        continue;
      }
      if (res < 0) {
        fail_piece(c, errno_text(-res));
      } else if (res == 0) {
        fail_piece(c, c.a->part.write ? std::string("the device took no bytes")
                                      : "unexpected end of file (truncated swap file?)");
      } else if (static_cast<uint64_t>(res) < c.bytes) {  // short: the rest again
        retry.push_back({c.a, c.addr + res, c.offset + static_cast<uint64_t>(res),
                         c.bytes - static_cast<uint64_t>(res)});
        continue;
      }
      --c.a->pending;
    } while (!aio_.overlap_events && inflight > 0);
    if (!submit_error.empty()) {
      for (Active& a : active) {
        if (a.error.empty()) a.error = "NVMe swap on '" + path_ + "': " + submit_error;
        a.pending = 0;
      }
      retry.clear();
      inflight = 0;
      free_slots.clear();
      for (unsigned i = depth; i-- > 0;) free_slots.push_back(i);
    }
    report();
  }
}

void Swapper::read(uint64_t offset, void* dst, uint64_t bytes) {
  check_range("read", offset, bytes);
  std::lock_guard<std::mutex> held(staging_mu_);
  const uint64_t end = offset + bytes;
  const uint64_t first = align_down(offset);
  const uint64_t last = align_up(end);
  for (uint64_t at = first; at < last; at += staging_.bytes()) {
    const uint64_t len = std::min(staging_.bytes(), last - at);
    wait(read_async(at, staging_.data(), len));
    const uint64_t lo = std::max(offset, at), hi = std::min(end, at + len);
    std::memcpy(static_cast<char*>(dst) + (lo - offset), staging_.data() + (lo - at), hi - lo);
  }
}

void Swapper::write(uint64_t offset, const void* src, uint64_t bytes) {
  check_range("write", offset, bytes);
  std::lock_guard<std::mutex> held(staging_mu_);
  const uint64_t end = offset + bytes;
  const uint64_t first = align_down(offset);
  const uint64_t last = align_up(end);
  for (uint64_t at = first; at < last; at += staging_.bytes()) {
    const uint64_t len = std::min(staging_.bytes(), last - at);
    const uint64_t lo = std::max(offset, at), hi = std::min(end, at + len);
    // A block only partly ours keeps the bytes around it.
    if (lo > at) wait(read_async(at, staging_.data(), kIoAlign));
    if (hi < at + len) {
      const uint64_t tail = align_down(hi);
      wait(read_async(tail, staging_.data() + (tail - at), kIoAlign));
    }
    std::memcpy(staging_.data() + (lo - at), static_cast<const char*>(src) + (lo - offset), hi - lo);
    wait(write_async(at, staging_.data(), len));
  }
}

}  // namespace zs
