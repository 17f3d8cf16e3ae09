#include "impl/partition/shard_residence.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <system_error>
#include <utility>

#include "impl/common/error.h"
#include "impl/offload/swapper.h"
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
      auto b = std::make_shared<Buffer>(ctx_.device(), p.shard_bytes());
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
  const auto held = ctx.lock();
  ParamSwap* swap = swap_of(ctx, param);
  if (swap == nullptr) {
    buffer_ = param.shard;
  } else if (intent == ReadInGather && !param.shard) {
    buffer_ = std::make_shared<Buffer>(ctx.device(), param.shard_bytes());
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
      read_back_(std::move(other.read_back_)) {
  other.param_ = nullptr;
}

ShardAccess::~ShardAccess() {
  if (param_ == nullptr) return;
  const auto held = ctx_->lock();
  if (ParamSwap* swap = swap_of(*ctx_, *param_)) swap->release(*param_, write_);
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
  if (!param.swapped || param.shard) ctx.ledger().sub(Held::Shards, param.shard_bytes());
}

void* keep_shard_in_memory(Context& ctx, Param& param) {
  const auto held = ctx.lock();
  if (ParamSwap* swap = swap_of(ctx, param)) swap->keep(param);
  return param.shard->data();
}

void trim_shard_cache(Context& ctx) {
  const auto held = ctx.lock();
  if (auto* swap = ctx.find_attachment<ParamSwap>()) swap->trim();
}

}  // namespace zs
