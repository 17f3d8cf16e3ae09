// Collectives over one group of ranks. Calls are synchronous and made from
// the group's worker thread only (see group.h), in the same order on every
// member; a failure throws zs::Error (Comm, Timeout).
//
// What every transport supports is checked here, once, before a transport
// sees the call (a refused call leaves the group usable): reductions of
// any DType with sum, max and min, and avg of the float dtypes (ZS_AVG is
// not defined for ZS_UINT8); a root within the group; on the root of a
// scatter, one input per member. Transports implement the do_* methods.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "impl/common/dtype.h"

namespace zs {

// One param of a coalesced all-gather: this rank's `bytes` at send go to
// recv + rank * bytes on every member (recv holds bytes * size).
struct GatherSegment {
  const void* send;
  void* recv;
  size_t bytes;
  bool quantized = false;  // a qwZ packet (counted apart in the stats)
};

// One message of an exchange (Communicator::exchange).
struct ExchangeSend {
  const void* data;
  size_t bytes;
};
struct ExchangeRecv {
  void* data;
  size_t bytes;
};

// The checks above, for callers that validate before queueing (and the
// algorithms' own use). `what` names the collective in the message.
void check_reduction(const char* what, DType dtype, ReduceOp op);
void check_root(const char* what, int root, int size);
void check_stride(size_t count, size_t stride);
[[noreturn]] void fail_reduced_block_op();

class Communicator {
 public:
  virtual ~Communicator() = default;
  // Whether a blocking collective may run on the caller's thread instead of
  // the group's (Group::run, when nothing is queued): no thread-bound state.
  // Gloo and the local communicator say yes; NCCL and the staging path keep
  // their work on the group's thread.
  virtual bool runs_on_any_thread() const { return false; }
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Ends this member's collectives, from any thread (healing: a rank was
  // lost, docs/healing.md section 2): the one in flight fails within
  // milliseconds with Code::Comm, its message starting with `why`, and
  // every later one at once. Never waits on the network; calls after the
  // first keep the first reason. A communicator with no peers has nothing
  // to end (the default).
  virtual void abort(const std::string& why) { (void)why; }

  // recv holds bytes_per_rank * size(); member i's send lands at i * bytes.
  virtual void allgather(const void* send, void* recv, size_t bytes_per_rank) = 0;
  // Many all-gathers as one operation (the param fetch path).
  virtual void allgather_coalesced(const std::vector<GatherSegment>& segments) = 0;
  // send holds count * size() elements; this rank receives block rank().
  // 16-bit floats are summed in fp32, hop by hop; the partial sums cross
  // the wire in their 16 bits (half the bytes of fp32); an fp16 Avg
  // divides each term by size() first (NCCL's PreMulSum) so that they
  // cannot overflow where the mean does not.
  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
    check_reduction("reduce-scatter", dtype, op);
    do_reduce_scatter(send, recv, count, dtype, op);
  }
  // reduce_scatter() of blocks `stride` elements apart in send (stride >=
  // count): a bucket filled to less than its capacity goes out without
  // being packed first. Host memory; the communicators over host memory
  // implement it (the ring reads each block where it is), others refuse.
  void reduce_scatter_strided(const void* send, void* recv, size_t count, size_t stride, DType dtype,
                              ReduceOp op) {
    check_reduction("reduce-scatter", dtype, op);
    check_stride(count, stride);
    if (stride == count) return do_reduce_scatter(send, recv, count, dtype, op);
    do_reduce_scatter_strided(send, recv, count, stride, dtype, op);
  }
  // An fp32 Sum or Avg reduce_scatter_strided whose last hop is handed to
  // `take(own, in, scale)` instead of written to a block of its own: this
  // rank's reduced block is (own[i] + in[i]) * scale (own[i] * scale where
  // `in` is null: a group of one), the bits reduce_scatter would write, so
  // the caller can store it where it goes (a gradient bucket's shards) in
  // the pass that reduces it. Host memory; refused by name elsewhere.
  using ReducedBlock = std::function<void(const float* own, const float* in, float scale)>;
  void reduce_scatter_into(const float* send, size_t count, size_t stride, ReduceOp op,
                           const ReducedBlock& take) {
    if (op != ReduceOp::Sum && op != ReduceOp::Avg)
      fail_reduced_block_op();
    check_stride(count, stride);
    do_reduce_scatter_into(send, count, stride, op, take);
  }
  void allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
    check_reduction("all-reduce", dtype, op);
    do_allreduce(send, recv, count, dtype, op);
  }
  // send and recv hold bytes_per_rank * size(): block j of send goes to
  // member j, block i of recv comes from member i (ZeRO++ qgZ's exchange).
  // send and recv must not overlap. `payload` only says, for the stats,
  // whether the blocks are quantized packets or fp32 (qgZ's exact hop
  // within a host).
  enum class Payload { Quantized, Exact };
  void alltoall(const void* send, void* recv, size_t bytes_per_rank, Payload payload = Payload::Quantized) {
    do_alltoall(send, recv, bytes_per_rank, payload);
  }
  void broadcast(void* buf, size_t bytes, int root) {
    check_root("broadcast", root, size());
    do_broadcast(buf, bytes, root);
  }
  // On root, inputs[i] (bytes_per_rank each) goes to member i's recv.
  void scatter(const std::vector<const void*>& inputs, void* recv, size_t bytes_per_rank,
               int root);
  virtual void barrier() = 0;
  // A permutation's round of point-to-point messages (the heal layer's
  // peer copy): this member sends sends[i] to member `to` while member
  // `from` sends it its own, received into recvs[i]. Every member calls it
  // together, each `to` being some member's `from`; a send's bytes must
  // equal its receiver's recvs[i].bytes (the caller agrees them first).
  // NotSupported on a transport without it.
  void exchange(int to, const std::vector<ExchangeSend>& sends, int from,
                const std::vector<ExchangeRecv>& recvs) {
    check_root("exchange", to, size());
    check_root("exchange", from, size());
    do_exchange(to, sends, from, recvs);
  }

 protected:
  // Called with the arguments checked (see the top of this file).
  virtual void do_reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                                 ReduceOp op) = 0;
  virtual void do_reduce_scatter_strided(const void* send, void* recv, size_t count, size_t stride,
                                         DType dtype, ReduceOp op);
  virtual void do_reduce_scatter_into(const float* send, size_t count, size_t stride, ReduceOp op,
                                      const ReducedBlock& take);
  virtual void do_allreduce(const void* send, void* recv, size_t count, DType dtype,
                            ReduceOp op) = 0;
  virtual void do_alltoall(const void* send, void* recv, size_t bytes_per_rank, Payload payload) = 0;
  virtual void do_broadcast(void* buf, size_t bytes, int root) = 0;
  virtual void do_scatter(const std::vector<const void*>& inputs, void* recv,
                          size_t bytes_per_rank, int root) = 0;
  virtual void do_exchange(int to, const std::vector<ExchangeSend>& sends, int from,
                           const std::vector<ExchangeRecv>& recvs);
};

}  // namespace zs
