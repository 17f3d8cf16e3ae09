// Collective algorithms written against PointToPoint: any transport that
// can post and wait for messages runs them. A group past the full mesh
// runs those of sparse_collectives.h instead (each entry point below picks). Each is one collective; the
// caller gives it its identity (the transport's message keys) and
// arguments Communicator has checked (communicator.h: dtype and op, root). Reductions
// run in fp32 for every float dtype (u8 stays bytes), and every member ends
// with bitwise the same result.
#pragma once

#include <cstddef>
#include <vector>

#include "impl/comm/algo/communicator.h"
#include "impl/comm/algo/point_to_point.h"
#include "impl/common/dtype.h"

namespace zs::collectives {

// Every member's part of each segment to every member. Segments of at
// least kDirectSegmentBytes travel straight into place; smaller ones are
// packed into one message per peer.
constexpr size_t kDirectSegmentBytes = 256 * 1024;
void all_gather(PointToPoint& p2p, const std::vector<GatherSegment>& segments);

// send: size() blocks of count elements, `stride` elements apart (0: count,
// packed); block rank() of the reduction to recv.
void reduce_scatter(PointToPoint& p2p, const void* send, void* recv, size_t count, DType dtype,
                    ReduceOp op, size_t stride = 0);
// fp32 reduce_scatter whose last hop goes to take(own, in, scale)
// (Communicator::reduce_scatter_into) instead of a block of its own.
void reduce_scatter_into(PointToPoint& p2p, const float* send, size_t count, size_t stride, ReduceOp op,
                         const Communicator::ReducedBlock& take);

// Up to kDirectAllReduceBytes (in fp32): everyone's vector to everyone,
// reduced in rank order; beyond: ring reduce-scatter, then the blocks to
// everyone.
// Past the full mesh (PointToPoint::full_mesh()): up to
// kSparseGatherReduceBytes gathered (every member's vector, size() of them)
// everyone's vector in log N rounds, reduced in rank order; beyond: the
// ring, then the blocks in log N rounds. Both give the full mesh's bits.
constexpr size_t kDirectAllReduceBytes = 64 * 1024;
constexpr size_t kSparseGatherReduceBytes = 4 << 20;
void all_reduce(PointToPoint& p2p, const void* send, void* recv, size_t count, DType dtype,
                ReduceOp op);

// Block j (bytes_per_rank at send + j * bytes_per_rank) to member j; block
// i of recv comes from member i (our own block is copied). Every message
// is posted before any is waited for.
void all_to_all(PointToPoint& p2p, const void* send, void* recv, size_t bytes_per_rank);

void broadcast(PointToPoint& p2p, void* buf, size_t bytes, int root);
void scatter(PointToPoint& p2p, const std::vector<const void*>& inputs, void* recv, size_t bytes,
             int root);
void barrier(PointToPoint& p2p);

}  // namespace zs::collectives
