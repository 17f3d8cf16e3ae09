#include "impl/grad/quantized_reduce.h"

#include <cstdint>

#include "impl/device/buffer.h"
#include "impl/device/ops.h"

namespace zs {
namespace {

size_t scale_bytes(size_t count, const kernels::QuantSpec& s) {
  return kernels::quant_blocks(count, s) * sizeof(float);
}

}  // namespace

kernels::QuantSpec gradient_quant_spec(const Config& c) {
  return {static_cast<int>(c.zero_quantized_gradients_bits),
          static_cast<size_t>(c.zero_quantized_gradients_block_size)};
}

size_t quantized_block_bytes(size_t count, const kernels::QuantSpec& s) {
  return scale_bytes(count, s) + (kernels::quant_code_bytes(count, s) + 3) / 4 * 4;
}

void quantized_reduce_scatter_avg(Communicator& comm, const std::shared_ptr<Device>& devp,
                                  const float* send, float* out, size_t count,
                                  const kernels::QuantSpec& s) {
  if (count == 0) return;
  Device& dev = *devp;
  const auto n = static_cast<size_t>(comm.size());
  if (n == 1) {  // nothing travels: no reason to lose precision
    if (out != send) dev.copy(out, send, count * sizeof(float));
    dev.synchronize();
    return;
  }
  if (!kernels::quant_spec_valid(s))
    fail(Code::InvalidArgument, "qgZ: ", s.bits, "-bit codes in blocks of ", s.block,
         " elements is not a valid quantization (bits 8 or 4, an even block size from 2 to ",
         kernels::kQuantMaxBlock, ")");
  const size_t packet = quantized_block_bytes(count, s);
  const size_t scales = scale_bytes(count, s);
  // Zeroed, so the bytes that round the codes up to 4 are defined on the wire.
  Buffer outgoing(devp, packet * n, true), incoming(devp, packet * n);
  auto* o = static_cast<uint8_t*>(outgoing.data());
  auto* in = static_cast<uint8_t*>(incoming.data());
  for (size_t j = 0; j < n; ++j)
    ops::quantize(dev, send + j * count, DType::F32, count, s, o + j * packet + scales,
                  reinterpret_cast<float*>(o + j * packet));
  comm.alltoall(o, in, packet);
  // Sum in rank order, then one true division: the same bits every run.
  Buffer sum(devp, count * sizeof(float)), one(devp, count * sizeof(float));
  auto* acc = static_cast<float*>(sum.data());
  auto* tmp = static_cast<float*>(one.data());
  for (size_t r = 0; r < n; ++r) {
    const uint8_t* p = in + r * packet;
    ops::dequantize(dev, p + scales, reinterpret_cast<const float*>(p), count, s,
                    r == 0 ? acc : tmp, DType::F32);
    if (r > 0) ops::add_f32(dev, acc, tmp, count);
  }
  ops::widen_scaled(dev, acc, DType::F32, out, count, static_cast<float>(n));
  dev.synchronize();
}

}  // namespace zs
