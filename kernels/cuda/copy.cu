// batched_copy: many device-to-device copies (the segments of a flat buffer
// for a coalesced collective) in one kernel launch.
//
// The segment table travels as the kernel's parameter, up to
// kBatchedCopySegmentsPerLaunch (1000) segments per launch (32,016 bytes):
// since CUDA 12.1 a kernel may take 32,764 bytes of parameters on sm_70 and
// later (this project builds sm_80/sm_90). Compared with uploading the table
// to device memory, that needs no allocation, no host-to-device copy from
// pageable memory (which would synchronise the host) and no lifetime
// management of a staging buffer: the caller's table may be freed on
// return, and the launch is capturable in a CUDA graph as is.
// __grid_constant__ lets the kernel index the table in the constant bank
// where it arrives instead of copying it to local memory.
//
// Work is split into tiles of kTile bytes; block b copies tiles b, b + G, ...
// (G blocks), finding a tile's segment by binary search over the table's
// tile prefix sums (uniform across the block: a constant-cache broadcast).
// Within a tile the threads copy the widest words (16, 8, 4, 2 bytes) for
// which dst and src are equally misaligned, with byte copies at the ends.
#include "kernels/cuda/common.cuh"

namespace zs::kernels::cuda {
namespace {

using detail::kInvalid;
using detail::kThreads;

constexpr size_t kTile = 32768;  // bytes of one work unit
constexpr size_t kSegs = kBatchedCopySegmentsPerLaunch;

struct CopyBatch {
  size_t tile_begin[kSegs + 1];  // first tile of each segment; [count]: all tiles
  char* dst[kSegs];
  const char* src[kSegs];
  size_t bytes[kSegs];
  unsigned count;  // segments, each of bytes > 0
};
static_assert(sizeof(CopyBatch) <= 32764, "kernel parameters are limited to 32,764 bytes");

__device__ __forceinline__ void copy_bytes(char* __restrict__ d, const char* __restrict__ s,
                                           size_t len) {
  for (size_t i = threadIdx.x; i < len; i += kThreads) d[i] = s[i];
}

// nw words, the block's threads interleaved; four loads in flight per
// thread before their stores.
template <class W>
__device__ __forceinline__ void copy_words(W* __restrict__ d, const W* __restrict__ s, size_t nw) {
  constexpr size_t U = 4;
  size_t i = threadIdx.x;
  for (; i + (U - 1) * kThreads < nw; i += U * kThreads) {
    W r[U];
#pragma unroll
    for (size_t u = 0; u < U; ++u) r[u] = s[i + u * kThreads];
#pragma unroll
    for (size_t u = 0; u < U; ++u) d[i + u * kThreads] = r[u];
  }
  for (; i < nw; i += kThreads) d[i] = s[i];
}

template <class W>
__device__ __forceinline__ void copy_aligned(char* d, const char* s, size_t len) {
  constexpr size_t w = sizeof(W);
  const size_t head_raw = (w - (reinterpret_cast<uintptr_t>(d) & (w - 1))) & (w - 1);
  const size_t head = head_raw < len ? head_raw : len;
  const size_t nw = (len - head) / w;
  const size_t tail = head + nw * w;
  copy_bytes(d, s, head);
  copy_words<W>(reinterpret_cast<W*>(d + head), reinterpret_cast<const W*>(s + head), nw);
  copy_bytes(d + tail, s + tail, len - tail);
}

__device__ __forceinline__ void copy_range(char* d, const char* s, size_t len) {
  // Equal low address bits of d and s: both reach a w-byte boundary together.
  const uintptr_t co = reinterpret_cast<uintptr_t>(d) ^ reinterpret_cast<uintptr_t>(s);
  if ((co & 15) == 0)
    copy_aligned<uint4>(d, s, len);
  else if ((co & 7) == 0)
    copy_aligned<uint2>(d, s, len);
  else if ((co & 3) == 0)
    copy_aligned<uint32_t>(d, s, len);
  else if ((co & 1) == 0)
    copy_aligned<uint16_t>(d, s, len);
  else
    copy_bytes(d, s, len);
}

__global__ void __launch_bounds__(kThreads) batched_copy_kernel(const __grid_constant__ CopyBatch b) {
  const size_t tiles = b.tile_begin[b.count];
  for (size_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    // The segment holding tile t: tile_begin[lo] <= t < tile_begin[hi].
    unsigned lo = 0, hi = b.count;
    while (hi - lo > 1) {
      const unsigned mid = lo + (hi - lo) / 2;
      if (b.tile_begin[mid] <= t)
        lo = mid;
      else
        hi = mid;
    }
    const size_t off = (t - b.tile_begin[lo]) * kTile;
    const size_t rest = b.bytes[lo] - off;
    copy_range(b.dst[lo] + off, b.src[lo] + off, rest < kTile ? rest : kTile);
  }
}

}  // namespace

int batched_copy(const CopySegment* segments, size_t count, void* stream) {
  if (count == 0) return 0;
  if (!segments) return kInvalid;
  for (size_t i = 0; i < count; ++i)
    if (segments[i].bytes > 0 && (!segments[i].dst || !segments[i].src)) return kInvalid;
  int sms = 0;
  const cudaError_t e = detail::sm_count(&sms);
  if (e != cudaSuccess) return detail::api_result(e);
  const size_t max_blocks = static_cast<size_t>(sms) * detail::kBlocksPerSm;

  CopyBatch b{};
  size_t i = 0;
  while (i < count) {
    unsigned k = 0;
    size_t tiles = 0;
    for (; i < count && k < kSegs; ++i) {
      const CopySegment& seg = segments[i];
      if (seg.bytes == 0) continue;
      b.tile_begin[k] = tiles;
      b.dst[k] = static_cast<char*>(seg.dst);
      b.src[k] = static_cast<const char*>(seg.src);
      b.bytes[k] = seg.bytes;
      tiles += (seg.bytes + kTile - 1) / kTile;
      ++k;
    }
    if (k == 0) break;
    b.tile_begin[k] = tiles;
    b.count = k;
    const unsigned blocks = static_cast<unsigned>(tiles < max_blocks ? tiles : max_blocks);
    batched_copy_kernel<<<blocks, kThreads, 0, detail::as_stream(stream)>>>(b);
    const int r = detail::launch_result();
    if (r != 0) return r;
  }
  return 0;
}

}  // namespace zs::kernels::cuda
