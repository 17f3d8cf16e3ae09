// Where a param's shard lives, and the one way to touch its bytes.
//
// Without parameter offload a shard is in the context's memory for the
// param's whole life. With offload_param.device "nvme" every shard has its
// own region in the rank's param swap file (one file per rank under
// offload_param.nvme_path, grown and preallocated as params register, so a
// disk too small fails at registration, naming the path and the bytes), and
// memory holds a cache of shards: those in use, plus at most
// offload_param.max_in_cpu elements of shards nobody uses, the least
// recently used dropped first (and written back first if changed). The file
// holds every shard the cache does not; a shard in the cache that was
// changed is the truth until it is written back.
//
// Anything that reads or writes a shard's bytes does it through a
// ShardAccess, for as long as it uses the pointer. A gather in flight keeps
// its own reference to the buffer it reads, so a shard dropped from the
// cache meanwhile stays readable until the gather is done. All of this runs
// under the engine lock; group threads only see buffers, and a gather's
// read-back (ReadInGather) runs on its group thread, overlapping whatever
// the caller does meanwhile.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "impl/core/context.h"
#include "impl/device/buffer.h"
#include "impl/partition/param.h"

namespace zs {

// Whether this context offloads param shards to NVMe (offload_param.device
// "nvme"). "cpu" on a CPU context is where shards already are; a CUDA
// context refuses either (NotSupported, at the first registration).
bool params_offloaded(Context& ctx);

// Scoped use of a shard's bytes, made and ended under the hold of the
// engine lock that an entry point took: makes the shard resident (reading it from
// the swap file if it was dropped), keeps it resident until destroyed, and
// then, if it was taken for writing, marks it changed. Destroying the last
// access of a param lets the cache trim itself.
//
// ReadInGather, for a gather being set up: a shard in memory is used as it
// is; one only on NVMe gets a fresh buffer that is not read yet: the gather
// runs read_back() on its group thread before it sends (the buffer is the
// gather's alone, never cached, and not counted as a shard in memory).
//
// A frozen param kept as a packet (store_shard_as_packet): ReadInGather
// gives the packet itself (packed() is true: the gather sends it as it
// is); Read and Write give a fresh buffer of its dequantized values, and a
// Write that changed them is quantized into the packet as the access ends.
class ShardAccess {
 public:
  enum Intent { Read, Write, ReadInGather };
  ShardAccess(Context& ctx, Param& param, Intent intent);
  ~ShardAccess();
  ShardAccess(ShardAccess&& other) noexcept;
  ShardAccess(const ShardAccess&) = delete;
  ShardAccess& operator=(const ShardAccess&) = delete;
  ShardAccess& operator=(ShardAccess&&) = delete;

  void* data() const { return buffer_->data(); }
  const BufferPtr& buffer() const { return buffer_; }
  // ReadInGather of a shard only on NVMe: the read that fills buffer(), to
  // run on any thread (it throws the swap file's error); else empty.
  const std::function<void()>& read_back() const { return read_back_; }
  // ReadInGather of a packed param: buffer() is its packet.
  bool packed() const { return packed_; }

 private:
  void repack() noexcept;

  Context* ctx_;
  Param* param_;
  BufferPtr buffer_;
  bool write_;
  bool packed_ = false;
  std::function<void()> read_back_;
  // Write to a packed param: the param, and the values it had.
  Param* packed_param_ = nullptr;
  std::vector<uint8_t> unpacked_;
};

// At registration, after the shard's first values are written: gives the
// shard its place (offload: a region of the swap file, written now) and
// counts it in the context's memory stats.
void place_new_shard(Context& ctx, Param& param);

// A frozen param under zero_quantized_nontrainable_weights: its shard is
// quantized once, now (from memory or the swap file), into a packet that
// replaces it for good; the shard's memory (or swap region) is let go.
// Under the caller's hold of the engine lock.
void store_shard_as_packet(Context& ctx, Param& param, const kernels::QuantSpec& spec);

// At unregistration: the shard leaves the cache and the memory stats. Its
// swap region is not reused (the file only grows, like the optimizer's).
void retire_shard(Context& ctx, Param& param);

// zs_param_shard_data's promise, a shard at a fixed address for the
// param's life: an offloaded shard is read back and leaves the swap file's
// care for good (its region is not reused). Returns the shard's bytes.
void* keep_shard_in_memory(Context& ctx, Param& param);
// The same, for a caller that holds the engine lock (context.h: it is not
// recursive).
void* keep_shard_in_memory_locked(Context& ctx, Param& param);

// Brings the cache back within max_in_cpu, writing changed shards back
// first; throws the swap file's I/O error (the shard that failed stays
// cached and changed: nothing is lost). A ShardAccess that ends trims too,
// but leaves a failed write-back to the next trim, which retries it and
// reports its error. Under the caller's hold.
void trim_shard_cache(Context& ctx);

}  // namespace zs
