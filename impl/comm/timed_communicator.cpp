#include "impl/comm/timed_communicator.h"

#include <utility>

namespace zs {
namespace {

class TimedCommunicator final : public Communicator {
 public:
  TimedCommunicator(std::unique_ptr<Communicator> inner, std::shared_ptr<CommStats> stats,
                    std::shared_ptr<Trace> trace, std::string group)
      : inner_(std::move(inner)), stats_(std::move(stats)), trace_(std::move(trace)),
        group_(std::move(group)) {}

  bool runs_on_any_thread() const override { return inner_->runs_on_any_thread(); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }

  void allgather(const void* send, void* recv, size_t bytes_per_rank) override {
    timed(CommKind::Gather, "all-gather", bytes_per_rank * moved(),
          [&] { inner_->allgather(send, recv, bytes_per_rank); });
  }
  void allgather_coalesced(const std::vector<GatherSegment>& segments) override {
    size_t bytes = 0;
    for (const auto& s : segments) bytes += s.bytes;
    timed(CommKind::Gather, "coalesced all-gather of " + std::to_string(segments.size()),
          bytes * moved(), [&] { inner_->allgather_coalesced(segments); });
  }
  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                      ReduceOp op) override {
    timed(CommKind::ReduceScatter, "reduce-scatter", count * dtype_size(dtype) * moved(),
          [&] { inner_->reduce_scatter(send, recv, count, dtype, op); });
  }
  void allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    // A ring all-reduce moves about twice the buffer through each rank.
    timed(CommKind::AllReduce, "all-reduce", 2 * count * dtype_size(dtype) * moved() / size_or_1(),
          [&] { inner_->allreduce(send, recv, count, dtype, op); });
  }
  // Counted with the reduce-scatters: the engine's one all-to-all is qgZ's
  // quantized gradient reduction, which replaces the reduce-scatter.
  void alltoall(const void* send, void* recv, size_t bytes_per_rank) override {
    timed(CommKind::ReduceScatter, "all-to-all", bytes_per_rank * moved(),
          [&] { inner_->alltoall(send, recv, bytes_per_rank); });
  }
  void broadcast(void* buf, size_t bytes, int root) override {
    timed(CommKind::Other, "broadcast", size() > 1 ? bytes : 0,
          [&] { inner_->broadcast(buf, bytes, root); });
  }
  void scatter(const std::vector<const void*>& inputs, void* recv, size_t bytes_per_rank,
               int root) override {
    timed(CommKind::Other, "scatter", size() > 1 ? bytes_per_rank : 0,
          [&] { inner_->scatter(inputs, recv, bytes_per_rank, root); });
  }
  void barrier() override {
    timed(CommKind::Other, "barrier", 0, [&] { inner_->barrier(); });
  }

 private:
  // Blocks of the other members each rank sends and receives (a group of
  // one moves nothing).
  size_t moved() const { return static_cast<size_t>(size() > 1 ? size() - 1 : 0); }
  size_t size_or_1() const { return static_cast<size_t>(size() > 1 ? size() : 1); }

  template <typename Fn>
  void timed(CommKind kind, const std::string& name, uint64_t bytes, Fn&& fn) {
    const auto begin = Trace::Clock::now();
    fn();
    const auto end = Trace::Clock::now();
    stats_->add(kind, std::chrono::duration<double>(end - begin).count(), bytes);
    if (trace_)
      trace_->event("comm", name, group_, begin, end, "{\"bytes\": " + std::to_string(bytes) + "}");
  }

  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<CommStats> stats_;
  std::shared_ptr<Trace> trace_;
  const std::string group_;
};

}  // namespace

std::unique_ptr<Communicator> make_timed_communicator(std::unique_ptr<Communicator> inner,
                                                      std::shared_ptr<CommStats> stats,
                                                      std::shared_ptr<Trace> trace,
                                                      std::string group_name) {
  return std::make_unique<TimedCommunicator>(std::move(inner), std::move(stats), std::move(trace),
                                             std::move(group_name));
}

}  // namespace zs
