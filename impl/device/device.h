// Where engine memory lives and how it moves: the host, or one CUDA device.
// A context picks one device; every shard, gathered param, gradient bucket
// and optimizer state of that context is allocated on it, through the
// device's caching pool, and all element-wise work on that memory is
// dispatched to the device's kernels (impl/device/ops.h).
//
// Ordering on a CUDA device: the engine's kernels and copies run in order
// on one engine stream. Work handed back to the caller (a finished gather,
// an optimizer step, a copy out) is synchronised first, so a trainer may use
// the memory on any stream once the engine call or handle says it is done.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "impl/common/memory_tally.h"
#include "impl/device/pool.h"

namespace zs {

enum class DeviceKind : int { Cpu = 0, Cuda = 1 };

struct DeviceRef {
  DeviceKind kind = DeviceKind::Cpu;
  int ordinal = 0;

  bool is_cuda() const { return kind == DeviceKind::Cuda; }
  bool operator==(const DeviceRef& o) const { return kind == o.kind && ordinal == o.ordinal; }
  bool operator!=(const DeviceRef& o) const { return !(*this == o); }
  std::string str() const;  // "cpu" | "cuda:N"
};

// "cpu", "cuda" (device 0) or "cuda:N"; false for anything else.
bool try_parse_device(const std::string& text, DeviceRef* out);
// The same, with anything else an InvalidArgument error naming the text
// (as for a bad backend); `what` names the setting in the message. The
// config's "device" key is checked by the config parser (InvalidConfig).
DeviceRef parse_device(const std::string& text, const char* what);

class Device : public std::enable_shared_from_this<Device> {
 public:
  virtual ~Device() = default;
  std::shared_ptr<Device> device_shared() { return shared_from_this(); }
  virtual DeviceRef ref() const = 0;
  bool is_cuda() const { return ref().is_cuda(); }

  // Memory on this device from its caching pool (OutOfMemory names the
  // size and the device). Blocks are aligned to 256 bytes on CUDA, 64 on
  // the host. `kind` says what it is for (memory_tally.h): free with the
  // kind and size it was allocated with.
  void* alloc(size_t bytes, MemKind kind) { return tallied_alloc(*pool_, bytes, kind); }
  void free(void* p, size_t bytes, MemKind kind) { tallied_free(*pool_, p, bytes, kind); }
  // free() past the pool's cache: straight back to the system.
  void free_to_system(void* p, size_t bytes, MemKind kind) { tallied_free(*pool_, p, bytes, kind, false); }
  // Host memory for staging this device's data through a host transport
  // (pinned on CUDA so copies are DMA; the plain host pool otherwise).
  void* staging_alloc(size_t bytes, MemKind kind) { return tallied_alloc(*staging_, bytes, kind); }
  void staging_free(void* p, size_t bytes, MemKind kind) { tallied_free(*staging_, p, bytes, kind); }
  // The bytes this device's pools hand out now (the staging pool too when
  // it is a pool of its own): what the tally's pooled kinds add up to.
  uint64_t pools_used_bytes() const {
    uint64_t used = pool_->stats().used_bytes;
    if (staging_ != pool_) used += staging_->stats().used_bytes;
    return used;
  }
  PoolStats pool_stats() const { return pool_->stats(); }
  void trim() {
    pool_->trim();
    staging_->trim();
  }

  // Copy bytes between any two places this process can address (host
  // memory, this device, or another device through unified addressing),
  // in order on the engine stream.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  // Waits for everything queued on the engine stream; raises its errors.
  virtual void synchronize() = 0;
  // Makes this thread's current device this one (CUDA keeps it per thread).
  virtual void bind_thread() = 0;
  // The engine stream (a cudaStream_t); null on the host.
  virtual void* stream() const = 0;
  // Whether p points into this device's memory (false for host memory).
  virtual bool owns_pointer(const void* p) const = 0;

 protected:
  // Counted at the size class the pool hands out (what its used_bytes counts).
  static void* tallied_alloc(CachingPool& pool, size_t bytes, MemKind kind) {
    void* p = pool.alloc(bytes);
    memory_tally::add(kind, pool.size_class(bytes == 0 ? 1 : bytes));
    return p;
  }
  static void tallied_free(CachingPool& pool, void* p, size_t bytes, MemKind kind, bool cache = true) {
    pool.free(p, bytes, cache);
    memory_tally::sub(kind, pool.size_class(bytes == 0 ? 1 : bytes));
  }

  std::shared_ptr<CachingPool> pool_;
  std::shared_ptr<CachingPool> staging_;
};

// The process's host device (shared by every CPU context).
const std::shared_ptr<Device>& host_device();

// CUDA devices this process can use: 0 when the build has no CUDA, there is
// no driver, or no device. *why (if not null) says which, when 0 (else
// ""); the text lives as long as the process, since the answer is asked
// of the runtime once.
int cuda_device_count(const char** why = nullptr);
// The process's device for one ordinal (one engine stream and pool per
// ordinal, shared by contexts). NotSupported names the reason when the
// build, driver or device is missing, or the ordinal is out of range.
std::shared_ptr<Device> cuda_device(int ordinal);
// The device a DeviceRef names.
std::shared_ptr<Device> open_device(const DeviceRef& ref);
// The PCI bus id of a CUDA device ("0000:3c:00.0"): what tells two ranks
// on one host that they were handed the same GPU, whatever each one's
// CUDA_VISIBLE_DEVICES numbers it. Empty where it cannot be read.
std::string cuda_device_pci_bus_id(int ordinal);

}  // namespace zs

namespace zs {

// Where memory a caller handed us lives: a CUDA device for device (or
// managed) memory, otherwise the host. Always the host without CUDA.
DeviceRef pointer_location(const void* p);
// Synchronous copy between any two places (the API boundary: the caller
// may reuse its memory as soon as we return).
void copy_between(void* dst, const void* src, size_t bytes);

}  // namespace zs
