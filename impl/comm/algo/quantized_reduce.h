// ZeRO++ qgZ: a gradient bucket's averaging reduce-scatter done as an
// all-to-all of block-quantized data (kernels/quant.h) instead of a ring
// of fp32. Each member quantizes block j of its bucket (the part member j
// owns) into one packet [scales | codes] and sends it to member j; each
// member dequantizes the n packets it received to fp32, sums them in rank
// order and divides by n. One quantization per contribution (a ring would
// requantize at every hop), and the sum's order is fixed, so a member's
// result is bitwise the same from run to run.
//
// Error bound, per element i of the result, against the exact average of
// the members' fp32 blocks x_0 .. x_{n-1}:
//
//   |avg_q - avg| <= (1/n) * sum_r s_r * (1/2 + 2^-16)
//                    + (n + 1) * 2^-24 * max_r (|x_r| + s_r) + 2^-149
//
// s_r is the scale of the quantization block holding element i in member
// r's block (max|x_r| over that block / 7 for int4, / 127 for int8; a
// block of the bucket may span several params). The first term is the
// rounding to codes, averaged; the second fp32's rounding of the
// dequantized values, their n - 1 additions and the division.
// A block holding an inf or NaN arrives as NaN in all its elements (as in
// qwZ), so the loss scaler's overflow check sees it.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "impl/comm/algo/communicator.h"
#include "impl/device/device.h"
#include "kernels/quant.h"

namespace zs {

// LoCo error feedback (kernels/quant.h quantize_with_error) for one call:
// `err` holds one fp32 error per element this member quantizes, in the
// order the packets go out (comm.size() * count for the one-hop reduce,
// world * count for hop 1, nodes * count for hop 2), kept by the caller
// from one step to the next and updated here. A null err: no feedback.
// The bound above then holds for the compensated values g + e, not g:
// the error is resent later rather than lost.
struct ErrorFeedback {
  float* err = nullptr;
  float beta = 0.0f;
};

// Bytes of one member's packet for a block of `count` floats: the scales,
// then the codes rounded up to 4 bytes (so packets end to end keep their
// scales aligned).
size_t quantized_block_bytes(size_t count, const kernels::QuantSpec& s);

// send: comm.size() blocks of `count` floats on dev (block j for member
// j); out: `count` floats on dev, the average described above. With a group
// of one, out is the block itself, exact.
void quantized_reduce_scatter_avg(Communicator& comm, const std::shared_ptr<Device>& devp,
                                  const float* send,
                                  float* out, size_t count, const kernels::QuantSpec& s,
                                  const ErrorFeedback& ef = {});

// Across several nodes (the ZeRO++ paper's hierarchical scheme), two hops,
// so each rank sends nodes - 1 packets across nodes instead of
// world - local: within the node an all-to-all of quantized blocks (to
// local peer l the blocks of the ranks at local position l on every node),
// each node's sum per destination node (dequantize, add in local order);
// then that partial sum requantized, an all-to-all among the ranks at this
// local position, dequantized, added in node order and divided by the
// world. The bound gains the requantization's rounding: per element,
//   (1/world) * (sum_r s_r + sum_nodes s'_node) * (1/2 + 2^-16)
//     + (world + 2) * 2^-24 * max(|x_r| + s_r, |partial| + s') + 2^-149
// with s'_node the scale of the partial sum's block. World ranks are
// node * local + l (whole nodes).
//
// Hop 1 on the node's group (size local): send holds world = nodes * local
// blocks of count floats in world-rank order; partial receives nodes blocks.
void qgz_within_node(Communicator& intra, const std::shared_ptr<Device>& devp, const float* send,
                     float* partial, size_t count, int nodes, const kernels::QuantSpec& s,
                     const ErrorFeedback& ef = {});
// Hop 1 at full precision, for a node whose ranks share a host (memory
// speed: Context::quantizes): the same blocks to the same peers as fp32,
// summed in local order. Only hop 2 quantizes then, once, and the bound
// above loses its sum_r s_r term.
void sum_within_node(Communicator& intra, const std::shared_ptr<Device>& devp, const float* send,
                     float* partial, size_t count, int nodes);
// Hop 2 on the group of this local position (size nodes): out gets count
// floats, the average over `world` ranks.
void qgz_across_nodes(Communicator& inter, const std::shared_ptr<Device>& devp,
                      const float* partial, float* out, size_t count, int world,
                      const kernels::QuantSpec& s, const ErrorFeedback& ef = {});

}  // namespace zs
