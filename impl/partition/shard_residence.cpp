#include "impl/partition/shard_residence.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <system_error>
#include <utility>

#include "impl/common/copy_tally.h"
#include "impl/common/error.h"
#include "impl/offload/swapper.h"
#include "impl/partition/quant_packet.h"
#include "impl/partition/register.h"

namespace zs {
namespace {

std::string swap_file_name(int rank) {
  // Unique per process and context, so runs sharing a directory never open
  // each other's file.
  static std::atomic<int> counter{0};
  return "zeroshard-params-rank" + std::to_string(rank) + "-pid" + std::to_string(::getpid()) +
         "-" + std::to_string(counter.fetch_add(1)) + ".swap";
}

// The rank's param swap file and the cache of resident shards nobody uses.
class ParamSwap : public ParamKeeper {
 public:
  explicit ParamSwap(Context& ctx)
      : ctx_(ctx), budget_(static_cast<uint64_t>(std::max<int64_t>(ctx.config().offload_param.max_in_cpu, 0))) {
    const OffloadConfig& o = ctx.config().offload_param;
    std::error_code ec;
    std::filesystem::create_directories(o.nvme_path, ec);  // as DeepSpeed does; an error shows at open
    SwapperOptions so;
    so.dir = o.nvme_path;
    so.file_name = swap_file_name(ctx.ranks().rank);
    so.aio = ctx.config().aio;
    so.what = "offload_param.nvme_path";
    swapper_ = std::make_shared<Swapper>(so);
  }
  ~ParamSwap() override { ctx_.ledger().sub(Held::Nvme, swapper_->size()); }

  void place(Param& p) {
    const uint64_t bytes = p.shard_bytes();
    if (bytes == 0) return;  // nothing to keep anywhere
    const uint64_t before = swapper_->size();
    p.swap_offset = swapper_->grow(bytes);
    ctx_.ledger().add(Held::Nvme, swapper_->size() - before);
    swapper_->write(p.swap_offset, p.shard->data(), bytes);
    p.swapped = true;
    p.shard_dirty = false;
    idle(p);
    trim();
  }

  BufferPtr acquire(Param& p) {
    if (!p.shard) {
      trim();  // make room first, and report an earlier write-back's error
      auto b = std::make_shared<Buffer>(ctx_.device(), p.shard_bytes(), MemKind::Shards);
      read_back(p, b)();
      p.shard = std::move(b);
      p.shard_dirty = false;
      ctx_.ledger().add(Held::Shards, p.shard_bytes());
    } else if (p.shard_users == 0) {
      busy(p);
    }
    ++p.shard_users;
    return p.shard;
  }

  void release(Param& p, bool wrote) noexcept {
    if (wrote) p.shard_dirty = true;
    if (--p.shard_users > 0 || p.unregistered) return;
    idle(p);
    try {
      trim();
    } catch (const Error&) {
      // The shard stays cached and changed; the next trim retries the
      // write and reports its error.
    }
  }

  void trim() {
    while (idle_elements_ > budget_ && !idle_.empty()) {
      auto oldest = idle_.begin();
      if (auto p = oldest->second.param.lock()) {
        evict(*p);  // throws before anything is dropped
      } else {
        idle_elements_ -= oldest->second.numel;
        idle_.erase(oldest);
      }
    }
  }

  // The read that fills `into` with p's shard, on any thread.
  std::function<void()> read_back(Param& p, const BufferPtr& into) {
    return [swapper = swapper_, into, offset = p.swap_offset, bytes = p.shard_bytes(), what = p.describe()] {
      try {
        swapper->read(offset, into->data(), bytes);
      } catch (const Error& e) {
        throw Error(e.code(), "reading back " + what + " from the param swap file: " + e.what());
      }
    };
  }

  void keep(Param& p) {
    acquire(p);
    busy(p);
    p.shard_users = 0;
    p.swapped = false;  // from now on an ordinary shard, in memory
  }

  // The shard leaves the swap file's care for good (it is about to be
  // kept as a packet): out of the cache and the memory stats, its region
  // abandoned.
  void let_go(Param& p) {
    busy(p);
    if (p.shard) ctx_.ledger().sub(Held::Shards, p.shard_bytes());
    p.shard.reset();
    p.shard_dirty = false;
    p.swapped = false;
  }

  void forget(Param& p) override {
    if (p.shard_users == 0 && p.shard) busy(p);
  }

 private:
  struct Idle {
    std::weak_ptr<Param> param;
    uint64_t numel;
  };

  void idle(Param& p) {
    if (!p.shard) return;
    p.shard_last_use = ++clock_;
    idle_[p.shard_last_use] = Idle{p.weak_from_this(), p.layout.shard_numel};
    idle_elements_ += p.layout.shard_numel;
  }
  void busy(Param& p) {
    auto it = idle_.find(p.shard_last_use);
    if (it == idle_.end()) return;
    idle_elements_ -= it->second.numel;
    idle_.erase(it);
  }
  void evict(Param& p) {
    if (p.shard_dirty) {
      try {
        swapper_->write(p.swap_offset, p.shard->data(), p.shard_bytes());
      } catch (const Error& e) {
        throw Error(e.code(), "writing back " + p.describe() + " to the param swap file: " + e.what());
      }
      p.shard_dirty = false;
    }
    busy(p);
    ctx_.ledger().sub(Held::Shards, p.shard_bytes());
    p.shard.reset();  // a gather in flight keeps its own reference
  }

  Context& ctx_;
  const uint64_t budget_;  // elements of idle shards kept in memory
  // Shared with gathers' read-backs, which may outlive this attachment on a
  // group thread.
  std::shared_ptr<Swapper> swapper_;
  std::map<uint64_t, Idle> idle_;  // by last use, oldest first
  uint64_t idle_elements_ = 0;
  uint64_t clock_ = 0;
};

ParamSwap* swap_of(Context& ctx, const Param& p) {
  return p.swapped ? &ctx.attachment<ParamSwap>() : nullptr;
}

}  // namespace

bool params_offloaded(Context& ctx) {
  const std::string& where = ctx.config().offload_param.device;
  if (where == "none") return false;
  if (ctx.device()->is_cuda())
    fail(Code::NotSupported, "zero_optimization.offload_param.device \"", where,
         "\" on a CUDA context (", ctx.device()->ref().str(),
         "): parameter offload runs on CPU contexts only so far (shards in host memory or on NVMe "
         "gathered onto the GPU are not written yet); use \"none\" on a GPU");
  return where == "nvme";  // "cpu": a CPU context's shards are in host memory already
}

ShardAccess::ShardAccess(Context& ctx, Param& param, Intent intent)
    : ctx_(&ctx), param_(&param), write_(intent == Write) {
  ctx.expect_locked();
  if (param.packet) {  // a frozen param kept quantized
    param_ = nullptr;  // nothing cached, nothing to release
    if (intent == ReadInGather) {
      buffer_ = param.packet;
      packed_ = true;
      return;
    }
    Device& dev = *ctx.device();
    buffer_ = std::make_shared<Buffer>(ctx.device(), param.shard_bytes(), MemKind::Shards);
    unpack_quantized(dev, param.packet->data(), param.dtype, param.layout.shard_numel,
                     param.packet_spec, buffer_->data());
    dev.synchronize();
    if (write_) {
      packed_param_ = &param;
      unpacked_.resize(param.shard_bytes());
      dev.copy(unpacked_.data(), buffer_->data(), unpacked_.size());
      dev.synchronize();
      copy_tally::add(CopyKind::Other, unpacked_.size());
    }
    return;
  }
  ParamSwap* swap = swap_of(ctx, param);
  if (swap == nullptr) {
    buffer_ = param.shard;
  } else if (intent == ReadInGather && !param.shard) {
    buffer_ = std::make_shared<Buffer>(ctx.device(), param.shard_bytes(), MemKind::Shards);
    read_back_ = swap->read_back(param, buffer_);
    param_ = nullptr;  // nothing acquired, nothing to release
  } else {
    buffer_ = swap->acquire(param);
  }
}

ShardAccess::ShardAccess(ShardAccess&& other) noexcept
    : ctx_(other.ctx_),
      param_(other.param_),
      buffer_(std::move(other.buffer_)),
      write_(other.write_),
      packed_(other.packed_),
      read_back_(std::move(other.read_back_)),
      packed_param_(other.packed_param_),
      unpacked_(std::move(other.unpacked_)) {
  other.param_ = nullptr;
  other.packed_param_ = nullptr;
}

ShardAccess::~ShardAccess() {
  if (packed_param_ != nullptr) repack();
  if (param_ == nullptr) return;
  if (ParamSwap* swap = swap_of(*ctx_, *param_)) swap->release(*param_, write_);
}

// A write to a packed param's values is quantized into its packet, unless
// nothing changed: requantizing dequantized values may move a scale by an
// ulp, and a load or update that rewrites the same values must not drift.
void ShardAccess::repack() noexcept {
  Param& p = *packed_param_;
  try {
    Device& dev = *ctx_->device();
    std::vector<uint8_t> now(unpacked_.size());
    dev.copy(now.data(), buffer_->data(), now.size());
    dev.synchronize();
    copy_tally::add(CopyKind::Other, now.size());
    if (now == unpacked_) return;
    pack_quantized(dev, buffer_->data(), p.dtype, p.layout.shard_numel, p.packet_spec,
                   p.packet->data());
    dev.synchronize();
  } catch (const Error& e) {
    ctx_->record_async_error(e.code(), "quantizing the new values of frozen " + p.describe() +
                                        " into its packet: " + e.what());
  }
}

void store_shard_as_packet(Context& ctx, Param& param, const kernels::QuantSpec& spec) {
  ctx.expect_locked();
  if (param.packet) return;
  auto packet = std::make_shared<Buffer>(ctx.device(), quant_packet(param.layout.shard_numel, spec).bytes,
                                         MemKind::Shards);
  {
    const ShardAccess shard(ctx, param, ShardAccess::Read);
    pack_quantized(*ctx.device(), shard.data(), param.dtype, param.layout.shard_numel, spec,
                   packet->data());
    ctx.device()->synchronize();
  }
  if (ParamSwap* swap = swap_of(ctx, param)) {
    swap->let_go(param);
  } else {
    ctx.ledger().sub(Held::Shards, param.shard_bytes());
    param.shard.reset();  // a gather in flight, or a gathered alias, keeps its own reference
  }
  param.packet = std::move(packet);
  param.packet_spec = spec;
  ++param.shard_version;  // a separate fp32 master re-reads the values
  ctx.ledger().add(Held::Shards, param.packet->bytes());
}

void place_new_shard(Context& ctx, Param& param) {
  const bool offload = params_offloaded(ctx);
  ctx.ledger().add(Held::Shards, param.shard_bytes());
  if (!offload) return;
  try {
    ctx.attachment<ParamSwap>().place(param);
  } catch (...) {
    if (param.shard) ctx.ledger().sub(Held::Shards, param.shard_bytes());  // the caller drops it
    throw;
  }
}

void retire_shard(Context& ctx, Param& param) {
  if (param.packet) {
    ctx.ledger().sub(Held::Shards, param.packet->bytes());
    return;
  }
  if (!param.swapped || param.shard) ctx.ledger().sub(Held::Shards, param.shard_bytes());
}

void* keep_shard_in_memory(Context& ctx, Param& param) {
  const auto held = ctx.lock();
  return keep_shard_in_memory_locked(ctx, param);
}

void* keep_shard_in_memory_locked(Context& ctx, Param& param) {
  ctx.expect_locked();
  if (param.packet)
    fail(Code::InvalidState, param.describe(), " is frozen and kept as int", param.packet_spec.bits,
         " codes (zero_quantized_nontrainable_weights): it has no shard of ",
         dtype_name(param.dtype), " values to point to; gather it (zs_fetch) to read them");
  if (ParamSwap* swap = swap_of(ctx, param)) swap->keep(param);
  return param.shard->data();
}

void trim_shard_cache(Context& ctx) {
  ctx.expect_locked();
  if (auto* swap = ctx.find_attachment<ParamSwap>()) swap->trim();
}

}  // namespace zs
