#include "impl/comm/algo/quantized_reduce.h"

#include <cstdint>

#include "impl/common/copy_tally.h"
#include "impl/device/buffer.h"
#include "impl/device/ops.h"

namespace zs {
namespace {

size_t scale_bytes(size_t count, const kernels::QuantSpec& s) {
  return kernels::quant_blocks(count, s) * sizeof(float);
}

void check_spec(const kernels::QuantSpec& s) {
  if (!kernels::quant_spec_valid(s))
    fail(Code::InvalidArgument, "qgZ: ", s.bits, "-bit codes in blocks of ", s.block,
         " elements is not a valid quantization (bits 8 or 4, an even block size from 2 to ",
         kernels::kQuantMaxBlock, ")");
}

// Blocks blocks[i] (count floats each) into packets laid end to end; with
// error feedback, block i is compensated by ef.err[i * count ...].
void pack(Device& dev, const std::vector<const float*>& blocks, size_t count,
          const kernels::QuantSpec& s, uint8_t* packets, const ErrorFeedback& ef) {
  const size_t packet = quantized_block_bytes(count, s), scales = scale_bytes(count, s);
  for (size_t i = 0; i < blocks.size(); ++i) {
    uint8_t* codes = packets + i * packet + scales;
    auto* block_scales = reinterpret_cast<float*>(packets + i * packet);
    if (ef.err)
      ops::quantize_with_error(dev, blocks[i], ef.err + i * count, ef.beta, count, s, codes,
                               block_scales);
    else
      ops::quantize(dev, blocks[i], DType::F32, count, s, codes, block_scales);
  }
}

// acc = the sum of the packets `which` in that order (fp32, one rounding
// per addition), then divided by `divisor` into out (1: acc is out).
void sum_packets(Device& dev, const std::shared_ptr<Device>& devp, const uint8_t* packets,
                 const std::vector<size_t>& which, size_t count, const kernels::QuantSpec& s,
                 float* acc) {
  const size_t packet = quantized_block_bytes(count, s), scales = scale_bytes(count, s);
  Buffer one(devp, count * sizeof(float), MemKind::CommStaging);
  auto* tmp = static_cast<float*>(one.data());
  for (size_t k = 0; k < which.size(); ++k) {
    const uint8_t* p = packets + which[k] * packet;
    ops::dequantize(dev, p + scales, reinterpret_cast<const float*>(p), count, s,
                    k == 0 ? acc : tmp, DType::F32);
    if (k > 0) ops::add_f32(dev, acc, tmp, count);
  }
}

// Hop 1's send order: to local peer l the blocks of ranks node * local + l,
// node by node.
std::vector<const float*> blocks_by_local_peer(const float* send, size_t count, size_t local,
                                               size_t nodes) {
  std::vector<const float*> blocks;
  for (size_t l = 0; l < local; ++l)
    for (size_t node = 0; node < nodes; ++node) blocks.push_back(send + (node * local + l) * count);
  return blocks;
}

std::vector<size_t> in_order(size_t n) {
  std::vector<size_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

}  // namespace

size_t quantized_block_bytes(size_t count, const kernels::QuantSpec& s) {
  return scale_bytes(count, s) + (kernels::quant_code_bytes(count, s) + 3) / 4 * 4;
}

void quantized_reduce_scatter_avg(Communicator& comm, const std::shared_ptr<Device>& devp,
                                  const float* send, float* out, size_t count,
                                  const kernels::QuantSpec& s, const ErrorFeedback& ef) {
  if (count == 0) return;
  Device& dev = *devp;
  const auto n = static_cast<size_t>(comm.size());
  if (n == 1) {  // nothing travels: no reason to lose precision
    if (out != send) {
      dev.copy(out, send, count * sizeof(float));
      copy_tally::add(CopyKind::GroupOfOne, count * sizeof(float));
    }
    dev.synchronize();
    return;
  }
  check_spec(s);
  const size_t packet = quantized_block_bytes(count, s);
  // Zeroed, so the bytes that round the codes up to 4 are defined on the wire.
  Buffer outgoing(devp, packet * n, MemKind::CommStaging, true), incoming(devp, packet * n, MemKind::CommStaging);
  std::vector<const float*> blocks;
  for (size_t j = 0; j < n; ++j) blocks.push_back(send + j * count);
  pack(dev, blocks, count, s, static_cast<uint8_t*>(outgoing.data()), ef);
  comm.alltoall(outgoing.data(), incoming.data(), packet);
  // Sum in rank order, then one true division: the same bits every run.
  Buffer sum(devp, count * sizeof(float), MemKind::CommStaging);
  auto* acc = static_cast<float*>(sum.data());
  sum_packets(dev, devp, static_cast<const uint8_t*>(incoming.data()), in_order(n), count, s, acc);
  ops::widen_scaled(dev, acc, DType::F32, out, count, static_cast<float>(n));
  dev.synchronize();
}

void qgz_within_node(Communicator& intra, const std::shared_ptr<Device>& devp, const float* send,
                     float* partial, size_t count, int nodes, const kernels::QuantSpec& s,
                     const ErrorFeedback& ef) {
  if (count == 0) return;
  check_spec(s);
  Device& dev = *devp;
  const auto local = static_cast<size_t>(intra.size());
  const auto n_nodes = static_cast<size_t>(nodes);
  const size_t packet = quantized_block_bytes(count, s);
  const auto blocks = blocks_by_local_peer(send, count, local, n_nodes);
  Buffer outgoing(devp, packet * blocks.size(), MemKind::CommStaging, true), incoming(devp, packet * blocks.size(), MemKind::CommStaging);
  pack(dev, blocks, count, s, static_cast<uint8_t*>(outgoing.data()), ef);
  intra.alltoall(outgoing.data(), incoming.data(), packet * n_nodes);
  // From local peer l: packet [l][node]; the node's sum for each node, in
  // local order.
  const auto* in = static_cast<const uint8_t*>(incoming.data());
  for (size_t node = 0; node < n_nodes; ++node) {
    std::vector<size_t> which;
    for (size_t l = 0; l < local; ++l) which.push_back(l * n_nodes + node);
    sum_packets(dev, devp, in, which, count, s, partial + node * count);
  }
  dev.synchronize();
}

void sum_within_node(Communicator& intra, const std::shared_ptr<Device>& devp, const float* send,
                     float* partial, size_t count, int nodes) {
  if (count == 0) return;
  Device& dev = *devp;
  const auto local = static_cast<size_t>(intra.size());
  const auto n_nodes = static_cast<size_t>(nodes);
  const size_t block = count * sizeof(float);
  const auto blocks = blocks_by_local_peer(send, count, local, n_nodes);
  Buffer outgoing(devp, block * blocks.size(), MemKind::CommStaging), incoming(devp, block * blocks.size(), MemKind::CommStaging);
  std::vector<ops::Copy> copies;
  for (size_t i = 0; i < blocks.size(); ++i)
    copies.push_back({static_cast<uint8_t*>(outgoing.data()) + i * block, blocks[i], block});
  ops::copy_many(dev, copies, CopyKind::CommStaging);
  dev.synchronize();  // the transport reads outgoing next
  intra.alltoall(outgoing.data(), incoming.data(), block * n_nodes, Communicator::Payload::Exact);
  // From local peer l: block [l][node]; the node's sum for each node, in
  // local order.
  const auto* in = static_cast<const float*>(incoming.data());
  for (size_t node = 0; node < n_nodes; ++node) {
    float* acc = partial + node * count;
    dev.copy(acc, in + node * count, block);
    copy_tally::add(CopyKind::CommStaging, block);
    for (size_t l = 1; l < local; ++l) ops::add_f32(dev, acc, in + (l * n_nodes + node) * count, count);
  }
  dev.synchronize();
}

void qgz_across_nodes(Communicator& inter, const std::shared_ptr<Device>& devp,
                      const float* partial, float* out, size_t count, int world,
                      const kernels::QuantSpec& s, const ErrorFeedback& ef) {
  if (count == 0) return;
  check_spec(s);
  Device& dev = *devp;
  const auto nodes = static_cast<size_t>(inter.size());
  const size_t packet = quantized_block_bytes(count, s);
  std::vector<const float*> blocks;
  for (size_t node = 0; node < nodes; ++node) blocks.push_back(partial + node * count);
  Buffer outgoing(devp, packet * nodes, MemKind::CommStaging, true), incoming(devp, packet * nodes, MemKind::CommStaging);
  pack(dev, blocks, count, s, static_cast<uint8_t*>(outgoing.data()), ef);
  inter.alltoall(outgoing.data(), incoming.data(), packet);
  Buffer sum(devp, count * sizeof(float), MemKind::CommStaging);
  auto* acc = static_cast<float*>(sum.data());
  sum_packets(dev, devp, static_cast<const uint8_t*>(incoming.data()), in_order(nodes), count, s,
              acc);
  ops::widen_scaled(dev, acc, DType::F32, out, count, static_cast<float>(world));
  dev.synchronize();
}

}  // namespace zs
