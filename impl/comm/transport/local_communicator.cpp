#include "impl/comm/transport/local_communicator.h"

#include "impl/common/copy_tally.h"

namespace zs {
namespace {

class LocalCommunicator final : public Communicator {
 public:
  bool runs_on_any_thread() const override { return true; }
  explicit LocalCommunicator(std::shared_ptr<Device> device) : dev_(std::move(device)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }

  void allgather(const void* send, void* recv, size_t bytes) override {
    copy_if_distinct(recv, send, bytes);
  }
  void allgather_coalesced(const std::vector<GatherSegment>& segments) override {
    for (const auto& s : segments) copy_if_distinct(s.recv, s.send, s.bytes);
  }
  void do_reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp) override {
    copy_if_distinct(recv, send, count * dtype_size(dtype));  // avg of one = itself
  }
  void do_reduce_scatter_strided(const void* send, void* recv, size_t count, size_t, DType dtype,
                                 ReduceOp) override {
    copy_if_distinct(recv, send, count * dtype_size(dtype));  // block 0 only
  }
  void do_reduce_scatter_into(const float* send, size_t, size_t, ReduceOp, const ReducedBlock& take) override {
    take(send, nullptr, 1.0f);  // block 0, the average of one
  }
  void do_allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp) override {
    copy_if_distinct(recv, send, count * dtype_size(dtype));
  }
  void do_alltoall(const void* send, void* recv, size_t bytes, Payload) override {
    copy_if_distinct(recv, send, bytes);
  }
  void do_broadcast(void*, size_t, int) override {}
  void do_scatter(const std::vector<const void*>& inputs, void* recv, size_t bytes,
                  int) override {
    copy_if_distinct(recv, inputs.at(0), bytes);
  }
  void barrier() override {}

 private:
  void copy_if_distinct(void* dst, const void* src, size_t bytes) {
    if (dst == src || bytes == 0) return;
    dev_->copy(dst, src, bytes);
    dev_->synchronize();
    copy_tally::add(CopyKind::GroupOfOne, bytes);
  }
  std::shared_ptr<Device> dev_;
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator(std::shared_ptr<Device> device) {
  return std::make_unique<LocalCommunicator>(std::move(device));
}

}  // namespace zs
