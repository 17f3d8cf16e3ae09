#include "impl/comm/gloo_communicator.h"

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "impl/comm/collective_watch.h"
#include "impl/common/reduce.h"
#include "impl/common/no_sigpipe.h"
#include "impl/device/buffer.h"

namespace zs {
namespace {

// Slots of our point-to-point algorithms: prefix, the collective's 32-bit
// tag, the message's index within it.
constexpr uint64_t kSlotPrefix = 0xA0;
// Segments of a coalesced gather at least this large travel straight from
// the shard into the gathered buffer; smaller ones are packed together so
// that many tiny params cost one message per peer.
constexpr size_t kDirectSegmentBytes = 256 * 1024;

// Exposes our store to gloo's rendezvous.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  explicit StoreAdapter(zs::Store& s) : store_(s) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(key, data);
  }
  std::vector<char> get(const std::string& key) override { return store_.get(key); }
  void wait(const std::vector<std::string>& keys) override { store_.wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    store_.wait(keys);
  }

 private:
  zs::Store& store_;
};

using UBuf = std::unique_ptr<gloo::transport::UnboundBuffer>;

// Sums and reductions of 16-bit floats run in fp32; u8 stays bytes.
size_t wire_elem(DType dtype) { return dtype == DType::U8 ? 1 : 4; }

// All-reduces up to this many bytes send every rank's whole vector to every
// peer (one message each way) and reduce locally in rank order; larger ones
// reduce-scatter around a ring and gather the reduced blocks.
constexpr size_t kDirectAllreduceBytes = 64 * 1024;

// Every collective is its own set of point-to-point messages, in slots
// derived from the collective's identity (see collective_watch.h): ranks
// that disagree on what they run use different slots, so they never read
// each other's bytes and Gloo never sees a size it did not expect. Their
// waits are cut short by the watch when it finds the disagreement.
class GlooCommunicator final : public Communicator {
 public:
  bool runs_on_any_thread() const override { return true; }
  GlooCommunicator(std::string name, std::shared_ptr<gloo::rendezvous::Context> ctx,
                   std::chrono::milliseconds timeout, std::shared_ptr<Store> store)
      : name_(std::move(name)),
        ctx_(std::move(ctx)),
        timeout_(timeout),
        checks_(collective_check_after().count() > 0),
        watch_(name_, ctx_->rank, ctx_->size, checks_ ? std::move(store) : nullptr,
               collective_check_after()) {}

  int rank() const override { return ctx_->rank; }
  int size() const override { return ctx_->size; }

  void allgather(const void* send, void* recv, size_t bytes) override {
    run("all-gather", [&] { return std::to_string(bytes) + " bytes per rank"; }, 0, [&] {
      gather_segments({GatherSegment{send, recv, bytes}});
    });
  }

  void allgather_coalesced(const std::vector<GatherSegment>& segments) override {
    size_t total = 0;
    uint64_t sizes = 0xcbf29ce484222325ull;
    for (const auto& s : segments) {
      total += s.bytes;
      sizes = (sizes ^ s.bytes) * 0x100000001b3ull;
    }
    run("coalesced all-gather",
        [&] {
          return std::to_string(segments.size()) +
                 (segments.size() == 1 ? " segment, " : " segments, ") + std::to_string(total) +
                 " bytes per rank";
        },
        sizes, [&] { gather_segments(segments); });
  }

  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                      ReduceOp op) override {
    run("reduce-scatter", [&] { return elements(count, dtype, op) + " per rank"; }, 0,
        [&] { ring_reduce_scatter(send, recv, count, dtype, op); });
  }

  void allreduce(const void* send, void* recv, size_t count, DType dtype,
                 ReduceOp op) override {
    run("all-reduce", [&] { return elements(count, dtype, op); }, 0,
        [&] { allreduce_impl(send, recv, count, dtype, op); });
  }

  void broadcast(void* buf, size_t bytes, int root) override {
    run("broadcast", [&] { return std::to_string(bytes) + " bytes from rank " + std::to_string(root); }, 0, [&] {
      if (bytes == 0) return;
      Messages m(*this);
      if (rank() == root) {
        for (int peer = 0; peer < size(); ++peer)
          if (peer != root) m.send(peer, 0, buf, bytes);
      } else {
        m.recv(root, 0, buf, bytes);
      }
      m.wait();
    });
  }

  void scatter(const std::vector<const void*>& inputs, void* recv, size_t bytes,
               int root) override {
    run("scatter",
        [&] { return std::to_string(bytes) + " bytes per rank from rank " + std::to_string(root); }, 0,
        [&] {
          if (bytes == 0) return;
          Messages m(*this);
          if (rank() == root) {
            for (int peer = 0; peer < size(); ++peer)
              if (peer != root) m.send(peer, 0, inputs[static_cast<size_t>(peer)], bytes);
            if (recv != inputs[static_cast<size_t>(root)])
              std::memcpy(recv, inputs[static_cast<size_t>(root)], bytes);
          } else {
            m.recv(root, 0, recv, bytes);
          }
          m.wait();
        });
  }

  void barrier() override {
    run("barrier", [] { return std::string(); }, 0, [&] {
      // One byte to and from every peer: nobody leaves before all arrived.
      std::vector<uint8_t> in(static_cast<size_t>(size())), out(1, 1);
      Messages m(*this);
      for (int peer = 0; peer < size(); ++peer) {
        if (peer == rank()) continue;
        m.recv(peer, 0, &in[static_cast<size_t>(peer)], 1);
        m.send(peer, 0, out.data(), 1);
      }
      m.wait();
    });
  }

 private:
  static std::string elements(size_t count, DType dtype, ReduceOp op) {
    static const char* kOps[] = {"sum", "avg", "max", "min"};
    return std::to_string(count) + " x " + dtype_name(dtype) + ", " +
           kOps[static_cast<int>(op) & 3];
  }

  // The messages of one step of a collective: posted at once, waited on
  // together. Slots come from the collective's tag and the step's index.
  class Messages {
   public:
    explicit Messages(GlooCommunicator& c) : c_(c) {}
    void send(int peer, uint32_t index, const void* data, size_t bytes) {
      sends_.push_back(c_.ctx_->createUnboundBuffer(const_cast<void*>(data), bytes));
      sends_.back()->send(peer, c_.slot(index));
    }
    void recv(int peer, uint32_t index, void* data, size_t bytes) {
      recvs_.push_back(c_.ctx_->createUnboundBuffer(data, bytes));
      recvs_.back()->recv(peer, c_.slot(index));
    }
    void wait() {
      for (auto& b : recvs_) c_.wait_recv(*b);
      for (auto& b : sends_) c_.wait_send(*b);
      recvs_.clear();
      sends_.clear();
    }

   private:
    GlooCommunicator& c_;
    std::vector<UBuf> sends_, recvs_;
  };

  uint64_t slot(uint32_t index) const {
    return (kSlotPrefix << 56) | (static_cast<uint64_t>(tag_) << 24) | (index & 0xffffffu);
  }

  // Runs one collective under its identity: the watch records it, its tag
  // keys every message, and Gloo's exceptions become ours.
  // With the check off (ZS_COLLECTIVE_CHECK_MS=0) the tag is the sequence
  // number alone, as before identities existed: what the overhead is
  // measured against.
  template <typename Detail, typename Fn>
  void run(const char* what, Detail&& detail, uint64_t extra, Fn&& fn) {
    ++seq_;
    if (checks_) {
      CollectiveIdentity id = make_identity(seq_, what, detail(), extra);
      tag_ = static_cast<uint32_t>(id.hash ^ (id.hash >> 32));
      watch_.begin(std::move(id));
    } else {
      tag_ = static_cast<uint32_t>(seq_);
    }
    try {
      fn();
    } catch (const zs::Error& e) {
      watch_.end(false);
      report(e.code(), e.what());
      throw;
    } catch (const std::exception& e) {
      watch_.end(false);
      const std::string msg = e.what();
      const bool timed_out = msg.find("imed out") != std::string::npos ||
                             msg.find("imeout") != std::string::npos;
      const std::string full =
          std::string(what) + " on group '" + name_ + "' (rank " + std::to_string(rank()) +
          " of " + std::to_string(size()) + ") failed" +
          (timed_out ? " after " + std::to_string(timeout_.count()) + " ms" : std::string()) +
          ": " + msg + (timed_out ? watch_.whereabouts() : std::string());
      report(timed_out ? Code::Timeout : Code::Comm, full);
      throw Error(timed_out ? Code::Timeout : Code::Comm, full);
    }
    watch_.end(true);
  }

  // The flight recorder: on the first failure, this rank's last collectives
  // on the group go to stderr, so the ranks' logs show where they parted.
  void report(Code, const std::string& why) {
    if (reported_) return;
    reported_ = true;
    std::fprintf(stderr,
                 "zeroshard: rank %d of group '%s' stopped: %s\nits last collectives on the "
                 "group, oldest first:\n%s",
                 rank(), name_.c_str(), why.c_str(), watch_.history().c_str());
  }

  void wait_recv(gloo::transport::UnboundBuffer& b) {
    watch_.set_abort([&b] { b.abortWaitRecv(); });
    const bool done = b.waitRecv(nullptr, timeout_);
    watch_.set_abort(nullptr);
    if (!done) aborted("receive");
  }
  void wait_send(gloo::transport::UnboundBuffer& b) {
    watch_.set_abort([&b] { b.abortWaitSend(); });
    const bool done = b.waitSend(nullptr, timeout_);
    watch_.set_abort(nullptr);
    if (!done) aborted("send");
  }
  [[noreturn]] void aborted(const char* which) {
    const std::string verdict = watch_.verdict();
    if (!verdict.empty()) fail(Code::Comm, verdict);
    fail(Code::Comm, which, " on group '", name_, "' was aborted");
  }

  // Every rank sends its part of each segment to every peer. Large
  // segments go shard-to-destination with no copy; small ones are packed
  // into one message per peer and unpacked as they arrive.
  void gather_segments(const std::vector<GatherSegment>& segments) {
    const int n = size();
    const int me = rank();
    std::vector<const GatherSegment*> small;
    std::vector<const GatherSegment*> large;
    size_t packed_bytes = 0;
    for (const auto& s : segments) {
      if (s.bytes == 0) continue;
      if (s.bytes >= kDirectSegmentBytes) {
        large.push_back(&s);
      } else {
        small.push_back(&s);
        packed_bytes += s.bytes;
      }
    }

    // Packed small segments: one send buffer, one staging area per peer.
    Messages m(*this);
    std::unique_ptr<Buffer> pack, staging;
    if (packed_bytes > 0) {
      pack = std::make_unique<Buffer>(packed_bytes);
      staging = std::make_unique<Buffer>(packed_bytes * static_cast<size_t>(n));
      size_t off = 0;
      for (const auto* s : small) {
        std::memcpy(static_cast<uint8_t*>(pack->data()) + off, s->send, s->bytes);
        off += s->bytes;
      }
      for (int peer = 0; peer < n; ++peer) {
        if (peer == me) continue;
        m.recv(peer, 0, static_cast<uint8_t*>(staging->data()) + static_cast<size_t>(peer) * packed_bytes,
               packed_bytes);
        m.send(peer, 0, pack->data(), packed_bytes);
      }
    }

    // Large segments: post every receive and send before waiting on any.
    uint32_t index = 1;
    for (const auto* s : large) {
      for (int peer = 0; peer < n; ++peer) {
        if (peer == me) continue;
        m.recv(peer, index, static_cast<uint8_t*>(s->recv) + static_cast<size_t>(peer) * s->bytes,
               s->bytes);
        m.send(peer, index, s->send, s->bytes);
      }
      ++index;
    }

    // Our own part needs no network; copy it while the transfers run.
    for (const auto& s : segments) {
      auto* dst = static_cast<uint8_t*>(s.recv) + static_cast<size_t>(me) * s.bytes;
      if (s.bytes > 0 && dst != s.send) std::memcpy(dst, s.send, s.bytes);
    }
    m.wait();

    if (packed_bytes > 0) {
      for (int peer = 0; peer < n; ++peer) {
        if (peer == me) continue;
        const auto* src = static_cast<const uint8_t*>(staging->data()) +
                          static_cast<size_t>(peer) * packed_bytes;
        for (const auto* s : small) {
          std::memcpy(static_cast<uint8_t*>(s->recv) + static_cast<size_t>(peer) * s->bytes, src,
                      s->bytes);
          src += s->bytes;
        }
      }
    }
  }

  static void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
    if (dtype == DType::U8) {
      reduce_u8(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count, op);
    } else {
      reduce_f32(static_cast<float*>(dst), static_cast<const float*>(src), count, op);
    }
  }

  // Ring reduce-scatter over n blocks of acc (wire elements: fp32 or u8),
  // block b at offsets[b] with counts[b] elements. After n-1 steps, block
  // rank() holds the full reduction. Each step sends the block it just
  // accumulated to the right and accumulates the one arriving from the left.
  void ring_reduce_blocks(uint8_t* acc, const std::vector<size_t>& offsets,
                          const std::vector<size_t>& counts, DType dtype, ReduceOp op) {
    const int n = size();
    const int me = rank();
    const size_t elem = wire_elem(dtype);
    size_t largest = 0;
    for (size_t c : counts) largest = std::max(largest, c);
    Buffer incoming(std::max<size_t>(largest * elem, 1));
    const int right = (me + 1) % n;
    const int left = (me + n - 1) % n;
    auto block = [n](int b) { return static_cast<size_t>(((b % n) + n) % n); };
    for (int step = 0; step < n - 1; ++step) {
      const size_t send_block = block(me - step - 1);
      const size_t recv_block = block(me - step - 2);
      Messages m(*this);
      const auto step_index = static_cast<uint32_t>(step);
      if (counts[recv_block] > 0) m.recv(left, step_index, incoming.data(), counts[recv_block] * elem);
      if (counts[send_block] > 0)
        m.send(right, step_index, acc + offsets[send_block] * elem, counts[send_block] * elem);
      m.wait();
      reduce_into(acc + offsets[recv_block] * elem, incoming.data(), counts[recv_block], dtype, op);
    }
  }

  void check_reduction(DType dtype, ReduceOp op) {
    if (dtype == DType::U8 && op == ReduceOp::Avg)
      fail(Code::NotSupported, "ZS_AVG is not defined for ZS_UINT8");
  }

  // Widens send (count elements) into wire elements: fp32 for every float
  // dtype, so 16-bit sums keep their precision.
  static void widen(const void* send, DType dtype, void* out, size_t count) {
    if (dtype == DType::U8) {
      std::memcpy(out, send, count);
    } else {
      widen_to_f32(send, dtype, static_cast<float*>(out), count);
    }
  }
  // Averages and narrows `count` wire elements into recv.
  void finish(void* wire, DType dtype, ReduceOp op, void* recv, size_t count) {
    if (dtype == DType::U8) {
      if (wire != recv) std::memcpy(recv, wire, count);
      return;
    }
    auto* f = static_cast<float*>(wire);
    if (op == ReduceOp::Avg) scale_f32(f, count, static_cast<float>(size()));
    narrow_from_f32(f, dtype, recv, count);
  }

  void ring_reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                           ReduceOp op) {
    check_reduction(dtype, op);
    if (count == 0) return;
    const int n = size();
    const size_t elem = wire_elem(dtype);
    Buffer acc(count * elem * static_cast<size_t>(n));
    widen(send, dtype, acc.data(), count * static_cast<size_t>(n));
    std::vector<size_t> offsets, counts(static_cast<size_t>(n), count);
    for (int b = 0; b < n; ++b) offsets.push_back(static_cast<size_t>(b) * count);
    auto* bytes = static_cast<uint8_t*>(acc.data());
    ring_reduce_blocks(bytes, offsets, counts, dtype, op);
    finish(bytes + static_cast<size_t>(rank()) * count * elem, dtype, op, recv, count);
  }

  void allreduce_impl(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
    check_reduction(dtype, op);
    if (count == 0) return;
    const int n = size();
    const int me = rank();
    const size_t elem = wire_elem(dtype);
    const size_t bytes = count * elem;
    if (bytes <= kDirectAllreduceBytes) {
      // Everyone's vector to everyone; each rank reduces in rank order, so
      // every rank computes bitwise the same result.
      Buffer all(bytes * static_cast<size_t>(n));
      auto* base = static_cast<uint8_t*>(all.data());
      widen(send, dtype, base + static_cast<size_t>(me) * bytes, count);
      Messages m(*this);
      for (int peer = 0; peer < n; ++peer) {
        if (peer == me) continue;
        m.recv(peer, 0, base + static_cast<size_t>(peer) * bytes, bytes);
        m.send(peer, 0, base + static_cast<size_t>(me) * bytes, bytes);
      }
      m.wait();
      for (int r = 1; r < n; ++r)
        reduce_into(base, base + static_cast<size_t>(r) * bytes, count, dtype, op);
      finish(base, dtype, op, recv, count);
      return;
    }
    // Ring reduce-scatter into n nearly equal blocks, then every rank sends
    // its reduced block to every peer.
    Buffer acc(bytes);
    auto* base = static_cast<uint8_t*>(acc.data());
    widen(send, dtype, base, count);
    std::vector<size_t> offsets, counts;
    size_t off = 0;
    for (int b = 0; b < n; ++b) {
      const size_t c = count / static_cast<size_t>(n) + (static_cast<size_t>(b) < count % static_cast<size_t>(n) ? 1 : 0);
      offsets.push_back(off);
      counts.push_back(c);
      off += c;
    }
    ring_reduce_blocks(base, offsets, counts, dtype, op);
    Messages m(*this);
    const auto mine = static_cast<size_t>(me);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == me) continue;
      const auto p = static_cast<size_t>(peer);
      if (counts[p] > 0) m.recv(peer, 1u << 20, base + offsets[p] * elem, counts[p] * elem);
      if (counts[mine] > 0) m.send(peer, 1u << 20, base + offsets[mine] * elem, counts[mine] * elem);
    }
    m.wait();
    finish(base, dtype, op, recv, count);
  }

  std::string name_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  std::chrono::milliseconds timeout_;
  const bool checks_;
  CollectiveWatch watch_;
  uint64_t seq_ = 0;
  uint32_t tag_ = 0;
  bool reported_ = false;
};

}  // namespace

std::shared_ptr<gloo::transport::Device> make_gloo_device(const std::string& host) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    SigpipeBlockedScope no_sigpipe;  // the device's loop thread writes too
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    fail(Code::Bootstrap, "cannot create the TCP transport on host '", host, "': ", e.what(),
         " (set ZS_SOCKET_HOST or transport_host to an address of this machine)");
  }
}

std::unique_ptr<Communicator> make_gloo_communicator(
    const std::string& group_name, int rank, int size, Store& store,
    const std::shared_ptr<gloo::transport::Device>& device, std::chrono::milliseconds timeout,
    std::shared_ptr<Store> watch_store) {
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(timeout);
  StoreAdapter adapter(store);
  auto dev = device;
  try {
    ctx->connectFullMesh(adapter, dev);
  } catch (const zs::Error& e) {
    fail(e.code(), "connecting group '", group_name, "' (rank ", rank, " of ", size,
         "): ", e.what());
  } catch (const std::exception& e) {
    fail(Code::Comm, "connecting group '", group_name, "' (rank ", rank, " of ", size,
         "): ", e.what());
  }
  return std::make_unique<GlooCommunicator>(group_name, std::move(ctx), timeout,
                                            std::move(watch_store));
}

}  // namespace zs
