#include "impl/comm/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <cstring>
#include <vector>

#include "impl/common/reduce.h"
#include "impl/common/no_sigpipe.h"
#include "impl/device/buffer.h"

namespace zs {
namespace {

// Slots of our own point-to-point algorithms; gloo's collectives use small
// prefixes, so 0xA0 cannot collide with them.
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

class GlooCommunicator final : public Communicator {
 public:
  bool runs_on_any_thread() const override { return true; }
  GlooCommunicator(std::string name, std::shared_ptr<gloo::rendezvous::Context> ctx,
                   std::chrono::milliseconds timeout)
      : name_(std::move(name)), ctx_(std::move(ctx)), timeout_(timeout) {}

  int rank() const override { return ctx_->rank; }
  int size() const override { return ctx_->size; }

  void allgather(const void* send, void* recv, size_t bytes) override {
    guard("all-gather", [&] {
      if (bytes == 0) return;
      gloo::AllgatherOptions opts(ctx_);
      auto* out = static_cast<uint8_t*>(recv);
      if (send != out + static_cast<size_t>(rank()) * bytes)
        opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send)), bytes);
      opts.setOutput(out, bytes * static_cast<size_t>(size()));
      opts.setTag(next_tag());
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
    });
  }

  void allgather_coalesced(const std::vector<GatherSegment>& segments) override {
    guard("coalesced all-gather", [&] { gather_segments(segments); });
  }

  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                      ReduceOp op) override {
    guard("reduce-scatter", [&] { ring_reduce_scatter(send, recv, count, dtype, op); });
  }

  void allreduce(const void* send, void* recv, size_t count, DType dtype,
                 ReduceOp op) override {
    guard("all-reduce", [&] { gloo_allreduce(send, recv, count, dtype, op); });
  }

  void broadcast(void* buf, size_t bytes, int root) override {
    guard("broadcast", [&] {
      if (bytes == 0) return;
      gloo::BroadcastOptions opts(ctx_);
      opts.setOutput(static_cast<uint8_t*>(buf), bytes);
      opts.setRoot(root);
      opts.setTag(next_tag());
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }

  void scatter(const std::vector<const void*>& inputs, void* recv, size_t bytes,
               int root) override {
    guard("scatter", [&] {
      if (bytes == 0) return;
      gloo::ScatterOptions opts(ctx_);
      std::vector<uint8_t*> ins;
      if (rank() == root) {
        for (const void* p : inputs) ins.push_back(const_cast<uint8_t*>(static_cast<const uint8_t*>(p)));
        opts.setInputs(ins, bytes);
      }
      opts.setOutput(static_cast<uint8_t*>(recv), bytes);
      opts.setRoot(root);
      opts.setTag(next_tag());
      opts.setTimeout(timeout_);
      gloo::scatter(opts);
    });
  }

  void barrier() override {
    guard("barrier", [&] {
      gloo::BarrierOptions opts(ctx_);
      opts.setTag(next_tag());
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  uint32_t next_tag() { return ++seq_; }
  uint64_t slot(uint32_t tag, uint32_t index) const {
    return (kSlotPrefix << 56) | (static_cast<uint64_t>(tag) << 24) | (index & 0xffffffu);
  }

  // Turn gloo's exceptions into ours, naming the operation and the group.
  template <typename Fn>
  void guard(const char* what, Fn&& fn) {
    try {
      fn();
    } catch (const zs::Error&) {
      throw;
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      const bool timed_out = msg.find("imed out") != std::string::npos ||
                             msg.find("imeout") != std::string::npos;
      fail(timed_out ? Code::Timeout : Code::Comm, what, " on group '", name_, "' (rank ",
           rank(), " of ", size(), ") failed", timed_out ? " after " : "",
           timed_out ? std::to_string(timeout_.count()) + " ms" : std::string(), ": ", msg);
    }
  }

  void wait_recv(gloo::transport::UnboundBuffer& b) {
    if (!b.waitRecv(nullptr, timeout_)) fail(Code::Timeout, "receive timed out");
  }
  void wait_send(gloo::transport::UnboundBuffer& b) {
    if (!b.waitSend(nullptr, timeout_)) fail(Code::Timeout, "send timed out");
  }

  // Every rank sends its part of each segment to every peer. Large
  // segments go shard-to-destination with no copy; small ones are packed
  // into one message per peer and unpacked as they arrive.
  void gather_segments(const std::vector<GatherSegment>& segments) {
    const int n = size();
    const int me = rank();
    const uint32_t tag = next_tag();
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
    std::unique_ptr<Buffer> pack, staging;
    UBuf pack_buf, staging_buf;
    if (packed_bytes > 0) {
      pack = std::make_unique<Buffer>(packed_bytes);
      staging = std::make_unique<Buffer>(packed_bytes * static_cast<size_t>(n));
      size_t off = 0;
      for (const auto* s : small) {
        std::memcpy(static_cast<uint8_t*>(pack->data()) + off, s->send, s->bytes);
        off += s->bytes;
      }
      pack_buf = ctx_->createUnboundBuffer(pack->data(), packed_bytes);
      staging_buf = ctx_->createUnboundBuffer(staging->data(), staging->bytes());
      for (int peer = 0; peer < n; ++peer) {
        if (peer == me) continue;
        staging_buf->recv(peer, slot(tag, 0), static_cast<size_t>(peer) * packed_bytes,
                          packed_bytes);
        pack_buf->send(peer, slot(tag, 0));
      }
    }

    // Large segments: post every receive and send before waiting on any.
    std::vector<UBuf> send_bufs, recv_bufs;
    uint32_t index = 1;
    for (const auto* s : large) {
      send_bufs.push_back(ctx_->createUnboundBuffer(const_cast<void*>(s->send), s->bytes));
      recv_bufs.push_back(ctx_->createUnboundBuffer(s->recv, s->bytes * static_cast<size_t>(n)));
      for (int peer = 0; peer < n; ++peer) {
        if (peer == me) continue;
        recv_bufs.back()->recv(peer, slot(tag, index), static_cast<size_t>(peer) * s->bytes,
                               s->bytes);
        send_bufs.back()->send(peer, slot(tag, index));
      }
      ++index;
    }

    // Our own part needs no network; copy it while the transfers run.
    for (const auto& s : segments) {
      auto* dst = static_cast<uint8_t*>(s.recv) + static_cast<size_t>(me) * s.bytes;
      if (s.bytes > 0 && dst != s.send) std::memcpy(dst, s.send, s.bytes);
    }

    if (packed_bytes > 0) {
      for (int i = 0; i < n - 1; ++i) wait_recv(*staging_buf);
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
      for (int i = 0; i < n - 1; ++i) wait_send(*pack_buf);
    }
    for (size_t k = 0; k < large.size(); ++k) {
      for (int i = 0; i < n - 1; ++i) wait_recv(*recv_bufs[k]);
      for (int i = 0; i < n - 1; ++i) wait_send(*send_bufs[k]);
    }
  }

  // Ring reduce-scatter in fp32: after n-1 steps, rank r holds the full
  // reduction of block r. Each step sends the block it just accumulated to
  // the right and accumulates the one arriving from the left.
  void ring_reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                           ReduceOp op) {
    if (count == 0) return;
    if (dtype == DType::U8 && op == ReduceOp::Avg)
      fail(Code::NotSupported, "ZS_AVG is not defined for ZS_UINT8");
    const int n = size();
    const int me = rank();
    const size_t elem = dtype == DType::U8 ? 1 : 4;
    const size_t block_bytes = count * elem;
    Buffer acc(block_bytes * static_cast<size_t>(n));
    Buffer incoming(block_bytes);
    if (dtype == DType::U8) {
      std::memcpy(acc.data(), send, block_bytes * static_cast<size_t>(n));
    } else {
      widen_to_f32(send, dtype, static_cast<float*>(acc.data()), count * static_cast<size_t>(n));
    }
    auto acc_buf = ctx_->createUnboundBuffer(acc.data(), acc.bytes());
    auto in_buf = ctx_->createUnboundBuffer(incoming.data(), incoming.bytes());
    const int right = (me + 1) % n;
    const int left = (me + n - 1) % n;
    const uint32_t tag = next_tag();
    auto block = [n](int b) { return static_cast<size_t>(((b % n) + n) % n); };
    for (int step = 0; step < n - 1; ++step) {
      const size_t send_block = block(me - step - 1);
      const size_t recv_block = block(me - step - 2);
      in_buf->recv(left, slot(tag, static_cast<uint32_t>(step)));
      acc_buf->send(right, slot(tag, static_cast<uint32_t>(step)), send_block * block_bytes,
                    block_bytes);
      wait_recv(*in_buf);
      wait_send(*acc_buf);
      auto* dst = static_cast<uint8_t*>(acc.data()) + recv_block * block_bytes;
      if (dtype == DType::U8) {
        reduce_u8(dst, static_cast<const uint8_t*>(incoming.data()), count, op);
      } else {
        reduce_f32(reinterpret_cast<float*>(dst), static_cast<const float*>(incoming.data()),
                   count, op);
      }
    }
    auto* mine = static_cast<uint8_t*>(acc.data()) + static_cast<size_t>(me) * block_bytes;
    if (dtype == DType::U8) {
      std::memcpy(recv, mine, block_bytes);
      return;
    }
    auto* result = reinterpret_cast<float*>(mine);
    if (op == ReduceOp::Avg) scale_f32(result, count, static_cast<float>(n));
    narrow_from_f32(result, dtype, recv, count);
  }

  void gloo_allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
    if (count == 0) return;
    if (dtype == DType::U8) {
      if (op == ReduceOp::Avg) fail(Code::NotSupported, "ZS_AVG is not defined for ZS_UINT8");
      if (send != recv) std::memmove(recv, send, count);
      run_allreduce(static_cast<uint8_t*>(recv), count, [op](void* c, const void* a, const void* b, size_t k) {
        if (c != a) std::memmove(c, a, k);
        reduce_u8(static_cast<uint8_t*>(c), static_cast<const uint8_t*>(b), k, op);
      });
      return;
    }
    // fp32 on the wire for every float dtype: 16-bit sums keep precision.
    std::unique_ptr<Buffer> wide;
    float* work = static_cast<float*>(recv);
    if (dtype != DType::F32) {
      wide = std::make_unique<Buffer>(count * 4);
      work = static_cast<float*>(wide->data());
    }
    widen_to_f32(send, dtype, work, count);
    run_allreduce(work, count, [op](void* c, const void* a, const void* b, size_t k) {
      if (c != a) std::memmove(c, a, k * 4);
      reduce_f32(static_cast<float*>(c), static_cast<const float*>(b), k, op);
    });
    if (op == ReduceOp::Avg) scale_f32(work, count, static_cast<float>(size()));
    if (dtype != DType::F32) narrow_from_f32(work, dtype, recv, count);
  }

  template <typename T, typename Fn>
  void run_allreduce(T* data, size_t count, Fn fn) {
    gloo::AllreduceOptions opts(ctx_);
    opts.setOutput(data, count);
    opts.setReduceFunction(fn);
    opts.setTag(next_tag());
    opts.setTimeout(timeout_);
    gloo::allreduce(opts);
  }

  std::string name_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  std::chrono::milliseconds timeout_;
  uint32_t seq_ = 0;
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
    const std::shared_ptr<gloo::transport::Device>& device, std::chrono::milliseconds timeout) {
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
  return std::make_unique<GlooCommunicator>(group_name, std::move(ctx), timeout);
}

}  // namespace zs
