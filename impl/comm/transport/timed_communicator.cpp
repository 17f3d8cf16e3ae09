#include "impl/comm/transport/timed_communicator.h"

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
  void abort(const std::string& why) override { inner_->abort(why); }

  // Ring and direct algorithms (collectives.cpp): every rank sends and
  // receives the same bytes, except from a root.
  void allgather(const void* send, void* recv, size_t bytes_per_rank) override {
    const uint64_t b = bytes_per_rank * moved();
    timed(CommKind::Gather, "all-gather", b, b, [&] { inner_->allgather(send, recv, bytes_per_rank); });
  }
  void allgather_coalesced(const std::vector<GatherSegment>& segments) override {
    uint64_t exact = 0, quantized = 0;
    for (const auto& s : segments) (s.quantized ? quantized : exact) += s.bytes * moved();
    // The call counts once, as quantized when any of it is.
    const CommKind kind = quantized > 0 ? CommKind::QuantizedGather : CommKind::Gather;
    const uint64_t own = kind == CommKind::Gather ? exact : quantized;
    timed(kind, "coalesced all-gather of " + std::to_string(segments.size()), own, own,
          [&] { inner_->allgather_coalesced(segments); });
    if (kind == CommKind::QuantizedGather && exact > 0) stats_->add_bytes(CommKind::Gather, exact, exact);
  }
  void do_reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp op) override {
    const uint64_t b = count * dtype_size(dtype) * moved();
    timed(CommKind::ReduceScatter, "reduce-scatter", b, b,
          [&] { inner_->reduce_scatter(send, recv, count, dtype, op); });
  }
  void do_reduce_scatter_strided(const void* send, void* recv, size_t count, size_t stride, DType dtype,
                                 ReduceOp op) override {
    const uint64_t b = count * dtype_size(dtype) * moved();
    timed(CommKind::ReduceScatter, "reduce-scatter", b, b,
          [&] { inner_->reduce_scatter_strided(send, recv, count, stride, dtype, op); });
  }
  void do_reduce_scatter_into(const float* send, size_t count, size_t stride, ReduceOp op,
                              const ReducedBlock& take) override {
    const uint64_t b = count * sizeof(float) * moved();
    timed(CommKind::ReduceScatter, "reduce-scatter", b, b,
          [&] { inner_->reduce_scatter_into(send, count, stride, op, take); });
  }
  void do_allreduce(const void* send, void* recv, size_t count, DType dtype,
                    ReduceOp op) override {
    // A ring all-reduce moves about twice the buffer through each rank.
    const uint64_t b = 2 * count * dtype_size(dtype) * moved() / size_or_1();
    timed(CommKind::AllReduce, "all-reduce", b, b, [&] { inner_->allreduce(send, recv, count, dtype, op); });
  }
  // The engine's all-to-all is qgZ's gradient reduction, which replaces the
  // reduce-scatter: quantized, or fp32 on its hop within a host.
  void do_alltoall(const void* send, void* recv, size_t bytes_per_rank, Payload payload) override {
    const uint64_t b = bytes_per_rank * moved();
    timed(payload == Payload::Exact ? CommKind::ReduceScatter : CommKind::QuantizedReduce, "all-to-all", b, b,
          [&] { inner_->alltoall(send, recv, bytes_per_rank, payload); });
  }
  void do_broadcast(void* buf, size_t bytes, int root) override {
    const bool from_me = rank() == root;
    timed(CommKind::Other, "broadcast", from_me ? bytes * moved() : 0, from_me || size() < 2 ? 0 : bytes,
          [&] { inner_->broadcast(buf, bytes, root); });
  }
  void do_scatter(const std::vector<const void*>& inputs, void* recv, size_t bytes_per_rank,
                  int root) override {
    const bool from_me = rank() == root;
    timed(CommKind::Other, "scatter", from_me ? bytes_per_rank * moved() : 0,
          from_me || size() < 2 ? 0 : bytes_per_rank,
          [&] { inner_->scatter(inputs, recv, bytes_per_rank, root); });
  }
  void barrier() override {
    timed(CommKind::Other, "barrier", 0, 0, [&] { inner_->barrier(); });
  }
  void do_exchange(int to, const std::vector<ExchangeSend>& sends, int from,
                   const std::vector<ExchangeRecv>& recvs) override {
    uint64_t sent = 0, received = 0;
    for (const auto& s : sends) sent += s.bytes;
    for (const auto& r : recvs) received += r.bytes;
    timed(CommKind::Other, "exchange", sent, received, [&] { inner_->exchange(to, sends, from, recvs); });
  }

 private:
  // Blocks of the other members each rank sends and receives (a group of
  // one moves nothing).
  size_t moved() const { return static_cast<size_t>(size() > 1 ? size() - 1 : 0); }
  size_t size_or_1() const { return static_cast<size_t>(size() > 1 ? size() : 1); }

  template <typename Fn>
  void timed(CommKind kind, const std::string& name, uint64_t sent, uint64_t received, Fn&& fn) {
    const auto begin = Trace::Clock::now();
    fn();
    const auto end = Trace::Clock::now();
    stats_->add(kind, std::chrono::duration<double>(end - begin).count(), sent, received);
    if (trace_)
      trace_->event("comm", name, group_, begin, end,
                    "{\"sent\": " + std::to_string(sent) + ", \"received\": " + std::to_string(received) + "}");
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
