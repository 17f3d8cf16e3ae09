#include "impl/comm/transport/staged_communicator.h"

#include <map>

#include "impl/common/copy_tally.h"

namespace zs {
namespace {

// One collective's staging: the buffers that live on the wrong side get a
// place in one allocation on the backend's side. Inputs are copied in
// before the collective, outputs copied back after it.
class Staging {
 public:
  Staging(Device& dev, BackendMemory backend, bool stage_all)
      : dev_(dev), backend_(backend), stage_all_(stage_all) {}
  ~Staging() {
    if (!base_) return;
    if (backend_ == BackendMemory::Host)
      dev_.staging_free(base_, total_, MemKind::CommStaging);
    else
      dev_.free(base_, total_, MemKind::CommStaging);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  // Declare a buffer (all before place()); input: read by the collective,
  // output: written by it. The same pointer may be both (in place).
  void add(const void* p, size_t bytes, bool input, bool output) {
    if (p == nullptr || bytes == 0 || !needs(p)) return;
    Entry& e = entries_[p];
    if (bytes > e.bytes) e.bytes = bytes;
    e.input = e.input || input;
    e.output = e.output || output;
  }

  // Allocate and copy the inputs in.
  void place() {
    for (auto& [p, e] : entries_) {
      e.offset = total_;
      total_ += (e.bytes + 255) / 256 * 256;
    }
    if (total_ == 0) return;
    base_ = backend_ == BackendMemory::Host ? dev_.staging_alloc(total_, MemKind::CommStaging)
                                          : dev_.alloc(total_, MemKind::CommStaging);
    for (auto& [p, e] : entries_)
      if (e.input) {
        dev_.copy(at(e), p, e.bytes);
        copy_tally::add(CopyKind::CommStaging, e.bytes);
      }
    dev_.synchronize();
  }

  // Where the backend finds p (p itself when it needed no staging).
  template <typename T>
  T* get(T* p) const {
    auto it = entries_.find(p);
    return it == entries_.end() ? p : static_cast<T*>(at(it->second));
  }

  // Copy the outputs back to where the caller wants them.
  void finish() {
    if (total_ == 0) return;
    for (auto& [p, e] : entries_)
      if (e.output) {
        dev_.copy(const_cast<void*>(p), at(e), e.bytes);
        copy_tally::add(CopyKind::CommStaging, e.bytes);
      }
    dev_.synchronize();
  }

 private:
  struct Entry {
    size_t bytes = 0;
    size_t offset = 0;
    bool input = false;
    bool output = false;
  };
  bool needs(const void* p) const {
    if (stage_all_) return true;
    const DeviceRef where = pointer_location(p);
    // Gloo reads host memory only; NCCL's kernels reach only this device's
    // memory (another GPU's would need peer access), so anything else is
    // staged through the engine stream, which copies across devices.
    if (backend_ == BackendMemory::Host) return where.is_cuda();
    return !(where.is_cuda() && where == dev_.ref());
  }
  void* at(const Entry& e) const { return static_cast<char*>(base_) + e.offset; }

  Device& dev_;
  const BackendMemory backend_;
  const bool stage_all_;
  std::map<const void*, Entry> entries_;
  size_t total_ = 0;
  void* base_ = nullptr;
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(std::unique_ptr<Communicator> inner, std::shared_ptr<Device> device,
                     BackendMemory backend, bool stage_all)
      : inner_(std::move(inner)), dev_(std::move(device)), backend_(backend),
        stage_all_(stage_all) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void abort(const std::string& why) override { inner_->abort(why); }

  void allgather(const void* send, void* recv, size_t bytes) override {
    Staging s = staging();
    s.add(send, bytes, true, false);
    s.add(recv, bytes * n(), false, true);
    s.place();
    inner_->allgather(s.get(send), s.get(recv), bytes);
    s.finish();
  }

  void allgather_coalesced(const std::vector<GatherSegment>& segments) override {
    Staging s = staging();
    for (const auto& g : segments) {
      s.add(g.send, g.bytes, true, false);
      s.add(g.recv, g.bytes * n(), false, true);
    }
    s.place();
    std::vector<GatherSegment> staged;
    staged.reserve(segments.size());
    for (const auto& g : segments)
      staged.push_back({s.get(g.send), s.get(g.recv), g.bytes, g.quantized});
    inner_->allgather_coalesced(staged);
    s.finish();
  }

  void do_reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp op) override {
    Staging s = staging();
    s.add(send, count * dtype_size(dtype) * n(), true, false);
    s.add(recv, count * dtype_size(dtype), false, true);
    s.place();
    inner_->reduce_scatter(s.get(send), s.get(recv), count, dtype, op);
    s.finish();
  }

  void do_allreduce(const void* send, void* recv, size_t count, DType dtype,
                    ReduceOp op) override {
    Staging s = staging();
    s.add(send, count * dtype_size(dtype), true, false);
    s.add(recv, count * dtype_size(dtype), false, true);
    s.place();
    inner_->allreduce(s.get(send), s.get(recv), count, dtype, op);
    s.finish();
  }

  void do_alltoall(const void* send, void* recv, size_t bytes, Payload payload) override {
    Staging s = staging();
    s.add(send, bytes * n(), true, false);
    s.add(recv, bytes * n(), false, true);
    s.place();
    inner_->alltoall(s.get(send), s.get(recv), bytes, payload);
    s.finish();
  }

  void do_broadcast(void* buf, size_t bytes, int root) override {
    Staging s = staging();
    s.add(buf, bytes, rank() == root, true);
    s.place();
    inner_->broadcast(s.get(buf), bytes, root);
    s.finish();
  }

  void do_scatter(const std::vector<const void*>& inputs, void* recv, size_t bytes,
                  int root) override {
    Staging s = staging();
    for (const void* in : inputs) s.add(in, bytes, true, false);
    s.add(recv, bytes, false, true);
    s.place();
    std::vector<const void*> staged;
    staged.reserve(inputs.size());
    for (const void* in : inputs) staged.push_back(s.get(in));
    inner_->scatter(staged, s.get(recv), bytes, root);
    s.finish();
  }

  void barrier() override {
    dev_->bind_thread();
    inner_->barrier();
  }

  // Host memory only (ZS_STAGE_ALL on a CPU context): the peer copy's
  // buffers are host memory, and a CUDA context refuses healing for now.
  void do_exchange(int to, const std::vector<ExchangeSend>& sends, int from,
                   const std::vector<ExchangeRecv>& recvs) override {
    if (dev_->is_cuda()) Communicator::do_exchange(to, sends, from, recvs);
    inner_->exchange(to, sends, from, recvs);
  }

 private:
  // The group's worker thread has no CUDA device of its own: bind it before
  // the first runtime call (cudaPointerGetAttributes, cudaHostAlloc), which
  // would otherwise create a context on device 0 for every rank of a node.
  Staging staging() {
    dev_->bind_thread();
    return Staging(*dev_, backend_, stage_all_);
  }
  size_t n() const { return static_cast<size_t>(inner_->size()); }

  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<Device> dev_;
  const BackendMemory backend_;
  const bool stage_all_;
};

}  // namespace

std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> inner,
                                                       std::shared_ptr<Device> device,
                                                       BackendMemory backend, bool stage_all) {
  return std::make_unique<StagedCommunicator>(std::move(inner), std::move(device), backend,
                                              stage_all);
}

}  // namespace zs
