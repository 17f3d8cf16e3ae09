#include "impl/comm/algo/communicator.h"

#include "impl/common/error.h"

namespace zs {

void check_reduction(const char* what, DType dtype, ReduceOp op) {
  if (dtype == DType::U8 && op == ReduceOp::Avg)
    fail(Code::NotSupported, what, ": ZS_AVG is not defined for ZS_UINT8");
}

void check_stride(size_t count, size_t stride) {
  if (stride < count)
    fail(Code::InvalidArgument, "reduce-scatter: blocks ", stride, " elements apart cannot hold ", count,
         " elements each");
}

void Communicator::do_reduce_scatter_strided(const void*, void*, size_t, size_t, DType, ReduceOp) {
  fail(Code::Internal, "this communicator has no strided reduce-scatter (host memory only)");
}

void fail_reduced_block_op() {
  fail(Code::InvalidArgument, "reduce-scatter into a caller's store: Sum or Avg only");
}

void Communicator::do_reduce_scatter_into(const float*, size_t, size_t, ReduceOp, const ReducedBlock&) {
  fail(Code::Internal, "this communicator cannot hand a reduce-scatter's last hop to its caller (host memory only)");
}

void check_root(const char* what, int root, int size) {
  if (root < 0 || root >= size)
    fail(Code::InvalidArgument, what, ": root ", root, " is out of range [0, ", size, ")");
}

void Communicator::scatter(const std::vector<const void*>& inputs, void* recv,
                           size_t bytes_per_rank, int root) {
  check_root("scatter", root, size());
  if (rank() == root && inputs.size() != static_cast<size_t>(size()))
    fail(Code::InvalidArgument, "scatter: the root has ", inputs.size(),
         " inputs, expected one per member (", size(), ")");
  do_scatter(inputs, recv, bytes_per_rank, root);
}

void Communicator::do_exchange(int, const std::vector<ExchangeSend>&, int, const std::vector<ExchangeRecv>&) {
  fail(Code::NotSupported, "exchange (point-to-point messages of the peer copy) on a transport that has none "
       "(it runs over Gloo)");
}

}  // namespace zs
