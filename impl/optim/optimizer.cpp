#include "impl/optim/optimizer.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "impl/fetch/coordinator.h"
#include "impl/optim/agreement.h"
#include "impl/optim/muon_step.h"
#include "impl/common/copy_tally.h"
#include "impl/common/fault_point.h"
#include "impl/common/env.h"
#include "impl/device/ops.h"
#include "impl/grad/grad_norm.h"
#include "impl/grad/reducer.h"
#include "impl/partition/shard_residence.h"
#include "kernels/optim.h"

namespace zs {
namespace {

LossScalerConfig scaler_config(const Config& c) {
  LossScalerConfig s;
  if (!c.fp16) {
    s.static_scale = 1.0;  // no scaling outside fp16
    return s;
  }
  s.static_scale = c.loss_scale;
  s.initial_scale_power = c.initial_scale_power;
  s.window = c.loss_scale_window;
  s.hysteresis = c.hysteresis;
  s.consecutive_hysteresis = c.consecutive_hysteresis;
  s.min_scale = c.min_loss_scale;
  return s;
}

}  // namespace

Optimizer::Optimizer(Context& ctx, OptimKind kind)
    : ctx_(ctx), ctx_id_(ctx.id()), kind_(kind),
      bf16_masters_(ctx.config().bf16 && ctx.config().bf16_master_weights_and_grads),
      bf16_states_(ctx.config().bf16 && ctx.config().bf16_optimizer_states),
      scaler_(scaler_config(ctx.config())),
      last_totals_(ctx.comm_stats()->totals()), last_step_end_(Trace::Clock::now()) {
  if (static_cast<int>(kind) < 0 || static_cast<int>(kind) > 4)
    fail(Code::InvalidArgument, "optimizer kind ", static_cast<int>(kind),
         ": expected ZS_OPTIM_ADAMW (0), ZS_OPTIM_ADAM (1), ZS_OPTIM_SGD (2), ZS_OPTIM_EXTERNAL (3) or "
         "ZS_OPTIM_MUON (4)");
  const std::string& where = ctx.config().offload_optimizer.device;
  if (kind == OptimKind::External && bf16_masters_)
    fail(Code::NotSupported, "bf16.bf16_master_weights_and_grads (true) with an external optimizer "
         "(the caller's update rule, e.g. a torch optimizer on the shards): the caller steps fp32 masters "
         "(slot 0), which this key removes. Use the engine's AdamW, Adam or SGD (ZeroShardOptimizer), "
         "which step bf16 masters in place, or set bf16_master_weights_and_grads false");
  if (kind == OptimKind::Muon && bf16_masters_)
    fail(Code::NotSupported, "bf16.bf16_master_weights_and_grads (true) with ZS_OPTIM_MUON: Muon's "
         "Newton-Schulz iteration runs on fp32 masters, which this key removes; set "
         "bf16_master_weights_and_grads false (bf16 params keep fp32 masters)");
  if (kind == OptimKind::Muon && where == "nvme")
    fail(Code::NotSupported, "zero_optimization.offload_optimizer.device \"nvme\" with ZS_OPTIM_MUON: "
         "the step on the swap file is element-wise and Muon's is not; use offload_optimizer.device "
         "\"none\", or AdamW for state on NVMe");
  if (bf16_states_ && where == "nvme")
    fail(Code::NotSupported, "bf16.bf16_optimizer_states (true) with zero_optimization.offload_optimizer."
         "device \"nvme\": the swap file holds fp32 moments. Keep the state in memory (offload_optimizer."
         "device \"none\"), or set bf16_optimizer_states false (bf16_master_weights_and_grads alone "
         "works on NVMe)");
  if (kind == OptimKind::External && where == "nvme")
    fail(Code::NotSupported, "zero_optimization.offload_optimizer.device \"nvme\" with an external optimizer "
         "(the caller's update rule, e.g. a torch optimizer on the shards): its state is the caller's, in "
         "memory. Use the engine's AdamW, Adam or SGD (ZeroShardOptimizer) for state on NVMe, or "
         "offload_optimizer.device \"none\"");
  if (where != "none" && ctx.device()->is_cuda())
    fail(Code::NotSupported, "zero_optimization.offload_optimizer.device \"", where,
         "\" on a CUDA context (", ctx.device()->ref().str(),
         "): optimizer offload runs on CPU contexts only so far (the step on host or NVMe state "
         "while the params stay on the GPU is not written yet); use \"none\" on a GPU");
  if (where == "nvme") {
    const auto held = ctx_.lock();
    swap_ = std::make_unique<SwappedState>(ctx.config(), ctx.ranks().rank, kind == OptimKind::Sgd ? 1 : 2);
  }
}

Optimizer::~Optimizer() {
  // A destructor must not throw. The C ABI never drops an optimizer under
  // the hold, but were the last reference to go there, the hold is ours.
  std::optional<EngineLock::Guard> held;
  if (!ctx_.locked_by_this_thread()) held.emplace(ctx_.lock());
  if (listener_) {
    listener_->detach();
    listener_.reset();
  }
  for (const auto& g : groups_)
    for (const auto& s : g.slots) {
      ctx_.ledger().sub(Held::Optimizer, state_bytes(s));
      // New gradient shards stay in memory; those in the swap file keep it.
      if (s.grad_sink && s.param->grad_sink == s.grad_sink) s.param->grad_sink.reset();
    }
  for (const auto& v : views_) ctx_.ledger().sub(Held::Optimizer, v.second.size() * sizeof(float));
  if (swap_) {
    ctx_.ledger().sub(Held::Optimizer, swap_->buffer_bytes());
    ctx_.ledger().sub(Held::Nvme, swap_->file_bytes());
  }
}

uint64_t Optimizer::state_bytes(const Slot& s) const {
  uint64_t b = 0;
  if (s.master) b += s.master->bytes();
  if (s.state1) b += s.state1->bytes();
  if (s.state2) b += s.state2->bytes();
  for (const auto& [name, buf] : s.named) b += buf->bytes();
  return b;
}

void Optimizer::check_hparams(const Hparams& hp) const {
  auto bad = [](const char* name, double v, const char* want) {
    fail(Code::InvalidArgument, "optimizer hyper-parameter ", name, " = ", v, ": expected ", want);
  };
  if (!(hp.lr >= 0.0)) bad("lr", hp.lr, ">= 0");
  if (!(hp.weight_decay >= 0.0)) bad("weight_decay", hp.weight_decay, ">= 0");
  const Hparams defaults;
  if (kind_ != OptimKind::Muon) {
    if (hp.use_muon != defaults.use_muon) bad("use_muon", hp.use_muon, "-1 (it is read by ZS_OPTIM_MUON only)");
    if (hp.ns_method != defaults.ns_method) bad("ns_method", hp.ns_method, "0 (it is read by ZS_OPTIM_MUON only)");
    if (hp.ns_steps != defaults.ns_steps) bad("ns_steps", hp.ns_steps, "5 (it is read by ZS_OPTIM_MUON only)");
  } else {
    if (hp.use_muon < -1 || hp.use_muon > 1) bad("use_muon", hp.use_muon, "1 (Muon), 0 (AdamW) or -1 (by shape)");
    if (hp.ns_method != 0 && hp.ns_method != 1) bad("ns_method", hp.ns_method, "0 (gram) or 1 (standard)");
    if (hp.ns_steps < 1 || hp.ns_steps > 100) bad("ns_steps", hp.ns_steps, "in [1, 100]");
    if (!(hp.momentum >= 0.0 && hp.momentum < 1.0)) bad("momentum", hp.momentum, "in [0, 1) (Muon's)");
  }
  if (kind_ == OptimKind::Sgd) {
    if (!(hp.momentum >= 0.0)) bad("momentum", hp.momentum, ">= 0");
    if (hp.nesterov && (hp.momentum <= 0.0 || hp.dampening != 0.0))
      bad("nesterov with momentum", hp.momentum, "momentum > 0 and dampening 0 (as torch)");
  } else {
    if (!(hp.beta1 >= 0.0 && hp.beta1 < 1.0)) bad("beta1", hp.beta1, "in [0, 1)");
    if (!(hp.beta2 >= 0.0 && hp.beta2 < 1.0)) bad("beta2", hp.beta2, "in [0, 1)");
    if (!(hp.eps >= 0.0)) bad("eps", hp.eps, ">= 0");
  }
}

int Optimizer::add_group(const std::vector<std::shared_ptr<Param>>& params, const Hparams& hp) {
  const auto held = ctx_.lock();
  check_hparams(hp);
  std::set<const Param*> mine;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param* p = params[i].get();
    if (!mine.insert(p).second)
      fail(Code::InvalidArgument, "optimizer group: params[", i, "] ", p->describe(), " is listed twice");
    for (size_t g = 0; g < groups_.size(); ++g)
      for (const auto& s : groups_[g].slots)
        if (s.param.get() == p)
          fail(Code::InvalidArgument, "optimizer group: params[", i, "] ", p->describe(),
               " is already in group ", g);
  }
  Group group;
  group.hp = hp;
  if (swap_) {
    // Masters and moments go to the swap file; its space is taken now.
    std::vector<SwappedState::SlotSpec> specs;
    std::map<size_t, Param*> by_index;
    for (const auto& p : params) {
      Slot s;
      s.param = p;
      s.index = slot_at_.size();
      slot_at_.push_back({groups_.size(), group.slots.size()});
      if (p->frozen) {  // no state, never stepped
        group.slots.push_back(std::move(s));
        continue;
      }
      if (p->dtype == DType::F32) s.master_is_shard = true;  // the master is the shard
      else if (p->dtype == DType::BF16 && bf16_masters_) s.master_is_working = true;  // likewise
      else s.swapped[0] = true;
      s.master_of_version = p->shard_version;
      s.swapped[1] = kind_ != OptimKind::Sgd || hp.momentum > 0.0;
      s.swapped[2] = kind_ != OptimKind::Sgd;
      specs.push_back({s.index, p->layout.shard_numel, s.swapped[0]});
      by_index[s.index] = p.get();
      group.slots.push_back(std::move(s));
    }
    const uint64_t before = swap_->buffer_bytes(), file_before = swap_->file_bytes();
    try {
      swap_->add_group(static_cast<int>(groups_.size()), specs,
                       [&](size_t index, uint64_t begin, uint64_t count, float* dst) {
                         Param& p = *by_index.at(index);
                         const ShardAccess shard(ctx_, p, ShardAccess::Read);
                         ops::cast_to_f32(*ctx_.device(),
                                          static_cast<const char*>(shard.data()) + begin * p.elem_bytes(),
                                          p.dtype, dst, count);
                         copy_tally::add(CopyKind::ParamCast, count * sizeof(float));
                       });
    } catch (...) {
      slot_at_.resize(slot_at_.size() - group.slots.size());
      throw;
    }
    const uint64_t after = swap_->buffer_bytes();
    if (after >= before) ctx_.ledger().add(Held::Optimizer, after - before);
    else ctx_.ledger().sub(Held::Optimizer, before - after);
    ctx_.ledger().add(Held::Nvme, swap_->file_bytes() - file_before);  // the file only grows
    // Gradient shards made from now on live in the file between writes
    // (one already made stays in memory until the step frees it).
    for (Slot& s : group.slots)
      if (by_index.count(s.index)) {
        s.grad_sink = swap_->grad_sink(s.index);
        s.param->grad_sink = s.grad_sink;
      }
    groups_.push_back(std::move(group));
    return static_cast<int>(groups_.size()) - 1;
  }
  for (const auto& p : params) {
    Slot s;
    s.param = p;
    if (p->frozen) {  // no state, never stepped (partition/freeze.h)
      group.slots.push_back(std::move(s));
      continue;
    }
    const uint64_t n = p->layout.shard_numel;
    if (kind_ == OptimKind::Muon) {
      const bool matrix = p->shape.size() >= 2;
      if (hp.use_muon == 1 && !matrix)
        fail(Code::InvalidArgument, "optimizer group with use_muon 1: ", p->describe(), " has ",
             p->shape.size(), " dims, and Muon steps matrices (2 or more dims); put it in a group "
             "with use_muon 0 (AdamW) or -1 (by shape)");
      s.muon = hp.use_muon == 1 || (hp.use_muon == -1 && matrix);
    }
    if (p->dtype == DType::F32) {
      s.master_is_shard = true;
    } else if (p->dtype == DType::BF16 && bf16_masters_) {
      s.master_is_working = true;  // the bf16 shard is the master: nothing to copy
      if (bf16_states_) s.state_dtype = DType::BF16;
    } else {
      s.master = std::make_shared<Buffer>(ctx_.device(), n * sizeof(float), MemKind::Masters);
      const ShardAccess shard(ctx_, *p, ShardAccess::Read);
      ops::cast_to_f32(*ctx_.device(), shard.data(), p->dtype,
                       static_cast<float*>(s.master->data()), n);
      copy_tally::add(CopyKind::ParamCast, n * sizeof(float));
      s.master_of_version = p->shard_version;
    }
    const bool moments = kind_ != OptimKind::External;  // an external one's are named, the caller's
    const bool needs_momentum = kind_ != OptimKind::Sgd || hp.momentum > 0.0;
    const size_t esize = dtype_size(s.state_dtype);
    if (moments && needs_momentum)
      s.state1 = std::make_shared<Buffer>(ctx_.device(), n * esize, MemKind::OptimizerState, true);
    if (moments && kind_ != OptimKind::Sgd && !s.muon)
      s.state2 = std::make_shared<Buffer>(ctx_.device(), n * esize, MemKind::OptimizerState, true);
    ctx_.ledger().add(Held::Optimizer, state_bytes(s));
    group.slots.push_back(std::move(s));
  }
  ctx_.device()->synchronize();  // the states are readable once we return
  groups_.push_back(std::move(group));
  return static_cast<int>(groups_.size()) - 1;
}

void Optimizer::set_listener(std::unique_ptr<StepListener> listener) {
  ctx_.expect_locked();
  if (listener_ && listener)
    fail(Code::InvalidState, "optimizer: a step listener is attached already");
  listener_ = std::move(listener);
}

std::vector<Optimizer::SlotState> Optimizer::slot_states_locked() const {
  ctx_.expect_locked();
  std::vector<SlotState> out;
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (const Slot& s : groups_[gi].slots) {
      SlotState st;
      st.param = s.param;
      st.group = gi;
      st.master = s.master;
      st.state1 = s.state1;
      st.state2 = s.state2;
      st.state_dtype = s.state_dtype;
      st.master_is_shard = s.master_is_shard;
      st.master_is_working = s.master_is_working;
      st.master_stale = s.master && s.master_of_version != s.param->shard_version;
      st.muon = s.muon;
      st.updates = s.updates;
      out.push_back(std::move(st));
    }
  return out;
}

std::vector<int> Optimizer::group_indices(int group) const {
  if (group < -1 || group >= static_cast<int>(groups_.size()))
    fail(Code::InvalidArgument, "optimizer group ", group, " does not exist (", groups_.size(),
         " groups; -1 means all)");
  if (group >= 0) return {group};
  std::vector<int> all(groups_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
  return all;
}

void Optimizer::set_hparams(int group, const Hparams& hp) {
  const auto held = ctx_.lock();
  set_hparams_locked(group, hp);
}

void Optimizer::set_hparams_locked(int group, const Hparams& hp) {
  ctx_.expect_locked();
  check_hparams(hp);
  for (int g : group_indices(group))
    if (hp.use_muon != groups_[static_cast<size_t>(g)].hp.use_muon)
      fail(Code::InvalidArgument, "optimizer group ", g, ": use_muon ", hp.use_muon, " (was ",
           groups_[static_cast<size_t>(g)].hp.use_muon,
           "): which params step Muon is fixed when the group is added (its state differs)");
  for (int g : group_indices(group)) groups_[static_cast<size_t>(g)].hp = hp;
}

void Optimizer::set_lr(int group, double lr) {
  const auto held = ctx_.lock();
  if (!(lr >= 0.0)) fail(Code::InvalidArgument, "learning rate ", lr, ": expected >= 0");
  for (int g : group_indices(group)) groups_[static_cast<size_t>(g)].hp.lr = lr;
}

void Optimizer::update(const Group& g, Slot& s, float grad_scale, StepBatch* batch) {
  Param& p = *s.param;
  const uint64_t n = p.layout.shard_numel;
  // No gradient this step (a frozen param never has one: pushes to it are
  // refused): the param stays.
  if (n == 0 || !p.grad || !p.grad_pushed) return;
  ShardAccess shard(ctx_, p, ShardAccess::Write);
  const auto& hp = g.hp;
  const auto* grad = static_cast<const float*>(p.grad->data());
  if (!s.master_is_working && s.state_dtype != DType::F32)
    fail(Code::Internal, "optimizer: ", p.describe(), " has bf16 moments but an fp32 master");
  bool first = s.updates == 0;
  if (kind_ == OptimKind::Sgd && hp.momentum > 0.0 && !s.state1) {
    // Momentum switched on after the group was made (set_hparams): the
    // buffer starts now, from this step's gradient, as torch's does.
    s.state1 = std::make_shared<Buffer>(ctx_.device(), n * dtype_size(s.state_dtype), MemKind::OptimizerState, true);
    ctx_.ledger().add(Held::Optimizer, s.state1->bytes());
    first = true;
  }
  ShardBuffers b;
  b.dtype = p.dtype;
  b.state1 = s.state1 ? s.state1->data() : nullptr;
  b.state2 = s.state2 ? s.state2->data() : nullptr;
  b.state_dtype = s.state_dtype;
  if (s.master_is_working) {
    b.working = shard.data();  // bf16 masters: the shard is stepped in place
  } else {
    b.master = fp32_master(s, shard);
    b.working = s.master_is_shard ? nullptr : shard.data();
    // The update writes the 16-bit working shard from the new master as it goes.
    if (b.working) copy_tally::add(CopyKind::MasterRefresh, n * p.elem_bytes());
  }
  if (batch != nullptr && b.master == nullptr) {
    // bf16 masters (and maybe bf16 moments): stepped in place, as step_shard does.
    const auto pt = ops::work_dtype(b.dtype), st = ops::work_dtype(b.state_dtype);
    if (kind_ == OptimKind::Sgd)
      batch->sgd_mixed.push_back({b.working, pt, b.state1, st, grad, n, sgd_hyper(hp, first)});
    else
      batch->adam_mixed.push_back({b.working, pt, b.state1, b.state2, st, grad, n, adam_hyper(kind_, hp, s.updates)});
    batch->held.push_back(std::move(shard));
    ++s.updates;
    return;
  }
  if (batch != nullptr) {
    if (kind_ == OptimKind::Sgd)
      batch->sgd.push_back({b.master, static_cast<float*>(b.state1), grad, n, sgd_hyper(hp, first), b.working,
                            ops::work_dtype(p.dtype)});
    else
      batch->adam.push_back({b.master, static_cast<float*>(b.state1), static_cast<float*>(b.state2), grad, n,
                             adam_hyper(kind_, hp, s.updates), b.working, ops::work_dtype(p.dtype)});
    batch->held.push_back(std::move(shard));  // the master may be the shard: kept until the batch runs
    ++s.updates;
    return;
  }
  step_shard(*ctx_.device(), kind_, hp, b, grad, n, grad_scale, s.updates, first);
  ++s.updates;
}

float* Optimizer::fp32_master(Slot& s, const ShardAccess& shard) {
  Param& p = *s.param;
  auto* master = static_cast<float*>(s.master_is_shard ? shard.data() : s.master->data());
  if (!s.master_is_shard && s.master_of_version != p.shard_version) {
    // The shard was rewritten since (GatheredParameters, a param.data
    // assignment): where its values changed they are the truth, not the
    // old master; where they did not, the master keeps its precision.
    ops::refresh_master(*ctx_.device(), shard.data(), p.dtype, master, p.layout.shard_numel);
    copy_tally::add(CopyKind::ParamCast, p.layout.shard_numel * sizeof(float));
    s.master_of_version = p.shard_version;
  }
  return master;
}

void Optimizer::update_muon(float grad_scale) {
  Device& dev = *ctx_.device();
  std::vector<MuonParam> params;
  std::vector<Slot*> slots;
  std::vector<ShardAccess> shards;
  // Which Muon params step: those with a gradient this step. The step is
  // collective, so every rank must agree; a param that got a gradient on
  // some ranks only is named on every rank alike (one all-reduce of
  // [pushed, -pushed] with Max gives each flag's max and min).
  std::vector<std::pair<const Group*, Slot*>> muon;
  for (auto& g : groups_)
    for (auto& s : g.slots)
      if (s.muon && s.param->layout.shard_numel > 0) muon.emplace_back(&g, &s);
  std::vector<float> flags(2 * muon.size());
  for (size_t i = 0; i < muon.size(); ++i) {
    const Param& p = *muon[i].second->param;
    flags[2 * i] = p.grad && p.grad_pushed ? 1.0f : 0.0f;
    flags[2 * i + 1] = -flags[2 * i];
  }
  zs::Group& world = *ctx_.world();
  if (world.size() > 1 && !flags.empty())
    world.run("Muon gradient agreement", [&](Communicator& c) {
      c.allreduce(flags.data(), flags.data(), flags.size(), DType::F32, ReduceOp::Max);
    });
  for (size_t i = 0; i < muon.size(); ++i)
    if (flags[2 * i] != -flags[2 * i + 1])
      fail(Code::InvalidState, "Muon step: ", muon[i].second->param->describe(), " got a gradient on some ranks and "
           "not on others; its step is collective over its partition group (push a gradient, zeros if "
           "need be, on every rank)");
  shards.reserve(muon.size());
  for (const auto& [g, sp] : muon) {
    Slot& s = *sp;
    Param& p = *s.param;
    if (!p.grad || !p.grad_pushed) continue;
    shards.emplace_back(ctx_, p, ShardAccess::Write);
    const Hparams& hp = g->hp;
    params.push_back({&p, fp32_master(s, shards.back()), static_cast<float*>(s.state1->data()),
                      static_cast<const float*>(p.grad->data()), static_cast<float>(hp.lr),
                      static_cast<float>(hp.momentum), static_cast<float>(hp.weight_decay),
                      static_cast<NsMethod>(hp.ns_method), hp.ns_steps});
    slots.push_back(&s);
  }
  muon_step(ctx_, params, grad_scale);
  for (size_t i = 0; i < slots.size(); ++i) {
    Slot& s = *slots[i];
    if (!s.master_is_shard) {
      ops::cast_from_f32(dev, static_cast<const float*>(s.master->data()), s.param->dtype, shards[i].data(),
                         s.param->layout.shard_numel);
      copy_tally::add(CopyKind::MasterRefresh, s.param->layout.shard_numel * s.param->elem_bytes());
    }
    ++s.updates;
  }
}

// update() over the swap file: sub-group by sub-group, each param's part
// of it with the same kernels and the same per-param step count, so the
// result is bitwise that of the whole param at once (the kernels are
// element-wise).
void Optimizer::update_swapped(float grad_scale) {
  Device& dev = *ctx_.device();
  // A param's pieces come in order, sub-group after sub-group: its shard
  // stays resident across them (read back and written once when offloaded).
  std::optional<ShardAccess> shard;
  const Param* shard_of = nullptr;
  swap_->for_each([&](const SwappedState::View& v) {
    // A gradient in the swap file came in with the moments; one made
    // before the optimizer (or held by a caller) is in memory.
    auto grad_of = [&v](const Param& p, const SwappedState::Piece& pc) {
      return p.grad->in_sink() ? v.grad(pc) : static_cast<const float*>(p.grad->data()) + pc.begin;
    };
    bool changed = false;
    const Hparams& hp = groups_[static_cast<size_t>(v.sg.group)].hp;
    for (const auto& pc : v.sg.pieces) {
      const auto [gi, si] = slot_at_[pc.slot];
      Slot& s = groups_[gi].slots[si];
      Param& p = *s.param;
      if (!p.grad || !p.grad_pushed) continue;  // no gradient this step: the param stays
      const bool last = pc.begin + pc.count == p.layout.shard_numel;
      const bool f32 = p.dtype == DType::F32;
      if (shard_of != &p) {
        shard.reset();
        shard.emplace(ctx_, p, ShardAccess::Write);
        shard_of = &p;
      }
      if (s.master_is_working) {
        // bf16 masters: the shard is stepped in place, the moments (fp32)
        // come from the swap file.
        void* master = static_cast<char*>(shard->data()) + pc.begin * p.elem_bytes();
        const float* grad = grad_of(p, pc);
        if (kind_ == OptimKind::Sgd) {
          if (pc.begin == 0) {
            s.sgd_first = s.updates == 0;
            if (hp.momentum > 0.0 && !s.swapped[1]) {
              s.swapped[1] = true;
              s.sgd_first = true;
            }
          }
          kernels::SgdHyper h{static_cast<float>(hp.lr), static_cast<float>(hp.momentum),
                              static_cast<float>(hp.dampening), static_cast<float>(hp.weight_decay),
                              hp.nesterov, s.sgd_first};
          ops::sgd_step_mixed(dev, master, p.dtype, s.swapped[1] ? v.state(pc, 1) : nullptr, DType::F32,
                              grad, pc.count, h, grad_scale);
        } else {
          kernels::AdamHyper h{static_cast<float>(hp.lr),   static_cast<float>(hp.beta1),
                               static_cast<float>(hp.beta2), static_cast<float>(hp.eps),
                               static_cast<float>(hp.weight_decay), kind_ == OptimKind::AdamW || kind_ == OptimKind::Muon,
                               hp.bias_correction, s.updates + 1};
          ops::adam_step_mixed(dev, master, p.dtype, v.state(pc, 1), v.state(pc, 2), DType::F32, grad,
                               pc.count, h, grad_scale);
        }
        if (last) ++s.updates;
        changed = true;
        continue;
      }
      float* master = f32 ? static_cast<float*>(shard->data()) + pc.begin : v.master(pc);
      void* working = f32 ? nullptr : static_cast<char*>(shard->data()) + pc.begin * p.elem_bytes();
      if (!f32 && s.master_of_version != p.shard_version) {
        ops::refresh_master(dev, working, p.dtype, master, pc.count);
        copy_tally::add(CopyKind::ParamCast, pc.count * sizeof(float));
        if (last) s.master_of_version = p.shard_version;
      }
      const float* grad = grad_of(p, pc);
      if (kind_ == OptimKind::Sgd) {
        if (pc.begin == 0) {
          s.sgd_first = s.updates == 0;
          if (hp.momentum > 0.0 && !s.swapped[1]) {
            s.swapped[1] = true;  // momentum from now on, starting from this gradient
            s.sgd_first = true;
          }
        }
        kernels::SgdHyper h{static_cast<float>(hp.lr), static_cast<float>(hp.momentum),
                            static_cast<float>(hp.dampening), static_cast<float>(hp.weight_decay),
                            hp.nesterov, s.sgd_first};
        ops::sgd_step(dev, master, s.swapped[1] ? v.state(pc, 1) : nullptr, grad, pc.count, h,
                      grad_scale, working, p.dtype);
      } else {
        kernels::AdamHyper h{static_cast<float>(hp.lr),   static_cast<float>(hp.beta1),
                             static_cast<float>(hp.beta2), static_cast<float>(hp.eps),
                             static_cast<float>(hp.weight_decay), kind_ == OptimKind::AdamW || kind_ == OptimKind::Muon,
                             hp.bias_correction, s.updates + 1};
        ops::adam_step(dev, master, v.state(pc, 1), v.state(pc, 2), grad, pc.count, h, grad_scale,
                       working, p.dtype);
      }
      if (working) copy_tally::add(CopyKind::MasterRefresh, pc.count * p.elem_bytes());
      if (last) ++s.updates;
      changed = true;
    }
    if (changed) dev.synchronize();  // the buffer is complete before it goes out
    return changed;
  });
  shard.reset();
}

void Optimizer::flush_state_views() {
  ctx_.expect_locked();
  for (auto it = views_.begin(); it != views_.end();) {
    swap_->write_slot(it->first.first, it->first.second, it->second.data());
    ctx_.ledger().sub(Held::Optimizer, it->second.size() * sizeof(float));
    it = views_.erase(it);
  }
}

bool Optimizer::state_swapped(const Param& p, int slot) {
  ctx_.expect_locked();
  const Slot* s = find_slot(p);
  return s != nullptr && slot >= 0 && slot <= 2 && s->swapped[slot];
}

void Optimizer::copy_swapped_state(const Param& p, int slot, float* dst) {
  ctx_.expect_locked();
  const Slot* s = find_slot(p);
  if (s == nullptr || slot < 0 || slot > 2 || !s->swapped[slot])
    fail(Code::InvalidArgument, "optimizer state slot ", slot, " of ", p.describe(), " is not on NVMe");
  auto view = views_.find({s->index, slot});
  if (view != views_.end()) {
    std::memcpy(dst, view->second.data(), view->second.size() * sizeof(float));
    copy_tally::add(CopyKind::Other, view->second.size() * sizeof(float));
  }
  else swap_->read_slot(s->index, slot, dst);
}

std::vector<std::shared_ptr<Param>> Optimizer::group_params(size_t group) const {
  std::vector<std::shared_ptr<Param>> out;
  for (const auto& s : groups_.at(group).slots) out.push_back(s.param);
  return out;
}

Optimizer::Slot* Optimizer::find_slot(const Param& p) {
  for (auto& g : groups_)
    for (auto& s : g.slots)
      if (s.param.get() == &p) return &s;
  return nullptr;
}

bool Optimizer::has_state(const Param& p, int slot) const {
  auto* s = const_cast<Optimizer*>(this)->find_slot(p);
  if (s == nullptr || slot < 0 || slot > 2) return false;
  if (s->swapped[slot]) return true;
  return slot == 0 ? s->master != nullptr || s->master_is_shard || s->master_is_working
                   : slot == 1 ? s->state1 != nullptr : s->state2 != nullptr;
}

bool Optimizer::steps_muon(const Param& p) const {
  const auto* s = const_cast<Optimizer*>(this)->find_slot(p);
  return s != nullptr && s->muon;
}

bool Optimizer::master_in_shard(const Param& p) const {
  const auto* s = const_cast<Optimizer*>(this)->find_slot(p);
  return s != nullptr && (s->master_is_shard || s->master_is_working);
}

DType Optimizer::state_dtype(const Param& p) const {
  const auto* s = const_cast<Optimizer*>(this)->find_slot(p);
  return s != nullptr ? s->state_dtype : DType::F32;
}

void* Optimizer::ensure_state(const Param& p, int slot, DType* dtype, uint64_t* numel) {
  ctx_.expect_locked();
  ++state_epoch_;
  Slot* s = find_slot(p);
  if (swap_ && s != nullptr && slot == 1 && kind_ == OptimKind::Sgd) {
    s->swapped[1] = true;  // its place in the file is reserved from the start
  } else if (s != nullptr && slot == 1 && !s->state1 && kind_ == OptimKind::Sgd) {
    s->state1 = std::make_shared<Buffer>(ctx_.device(), p.layout.shard_numel * dtype_size(s->state_dtype),
                                         MemKind::OptimizerState, true);
    ctx_.ledger().add(Held::Optimizer, s->state1->bytes());
  }
  return state_raw_locked(p, slot, dtype, numel);
}

float* Optimizer::state(const Param& p, int slot, uint64_t* numel) {
  const auto held = ctx_.lock();
  return state_locked(p, slot, numel);
}

float* Optimizer::state_locked(const Param& p, int slot, uint64_t* numel) {
  ctx_.expect_locked();
  DType dtype = DType::F32;
  void* data = state_raw_locked(p, slot, &dtype, numel);
  if (dtype == DType::F32) return static_cast<float*>(data);
  if (slot == 0)
    fail(Code::InvalidState, "optimizer state slot 0 (master) of ", p.describe(),
         ": with bf16.bf16_master_weights_and_grads a bf16 param keeps no fp32 master; its bf16 shard "
         "is the master (read or write it as the param's shard, e.g. zs_param_shard_data)");
  fail(Code::InvalidState, "optimizer state slot ", slot, " of ", p.describe(),
       " is kept in bf16 (bf16.bf16_optimizer_states is true), so it cannot be handed out as fp32 "
       "(float*); checkpoints save and load it (zs_checkpoint_save / zs_checkpoint_load), or set "
       "bf16_optimizer_states false for fp32 moments");
}

void* Optimizer::state_raw_locked(const Param& p, int slot, DType* dtype, uint64_t* numel) {
  ctx_.expect_locked();
  ++state_epoch_;  // the caller may write through the pointer
  if (dtype) *dtype = DType::F32;
  for (auto& g : groups_) {
    for (auto& s : g.slots) {
      if (s.param.get() != &p) continue;
      if (slot >= 0 && slot <= 2 && s.swapped[slot]) {
        auto [it, fresh] = views_.try_emplace({s.index, slot});
        if (fresh) {
          it->second.resize(p.layout.shard_numel);
          swap_->read_slot(s.index, slot, it->second.data());
          ctx_.ledger().add(Held::Optimizer, it->second.size() * sizeof(float));
        }
        if (numel) *numel = p.layout.shard_numel;
        return it->second.data();
      }
      if (slot == 0 && (s.master_is_shard || s.master_is_working)) {  // a fixed address for the caller: see zs_param_shard_data
        if (numel) *numel = p.layout.shard_numel;
        if (dtype) *dtype = p.dtype;
        return keep_shard_in_memory_locked(ctx_, *s.param);
      }
      const BufferPtr* buf = slot == 0 ? &s.master : slot == 1 ? &s.state1 : slot == 2 ? &s.state2 : nullptr;
      if (p.frozen && !s.master && !s.master_is_shard && !s.master_is_working)
        fail(Code::InvalidState, "optimizer state slot ", slot, " of ", p.describe(),
             ": the param was frozen when it joined the optimizer, which keeps no state for it");
      if (buf == nullptr || !*buf)
        fail(Code::InvalidArgument, "optimizer state slot ", slot, " of ", p.describe(),
             ": this optimizer has slots 0 (master)", s.state1 || s.swapped[1] ? ", 1" : "",
             s.state2 || s.swapped[2] ? ", 2" : "");
      if (numel) *numel = p.layout.shard_numel;
      if (dtype) *dtype = slot == 0 ? DType::F32 : s.state_dtype;
      return (*buf)->data();
    }
  }
  fail(Code::InvalidArgument, p.describe(), " is in no group of this optimizer");
}

float* Optimizer::named_state(const Param& p, const std::string& name, bool create, uint64_t* numel) {
  const auto held = ctx_.lock();
  return named_state_locked(p, name, create, numel);
}

float* Optimizer::named_state_locked(const Param& p, const std::string& name, bool create, uint64_t* numel) {
  ctx_.expect_locked();
  ++state_epoch_;
  if (kind_ != OptimKind::External)
    fail(Code::InvalidArgument, "named optimizer state '", name, "': only an external optimizer "
         "(ZS_OPTIM_EXTERNAL) keeps named state; this one's is slots 0 (master), 1 and 2");
  // Checkpoints keep it as "<name>/<param name>" beside "param" and "master".
  const bool printable = std::all_of(name.begin(), name.end(), [](char c) { return c > ' ' && c < 127; });
  if (name.empty() || name.size() > 128 || !printable || name.find('/') != std::string::npos ||
      name == "param" || name == "master")
    fail(Code::InvalidArgument, "named optimizer state '", name, "': expected 1 to 128 printable characters "
         "without spaces or '/', other than \"param\" and \"master\"");
  Slot* s = find_slot(p);
  if (s == nullptr) fail(Code::InvalidArgument, p.describe(), " is in no group of this optimizer");
  if (p.frozen && s->master == nullptr && !s->master_is_shard && !s->master_is_working)
    fail(Code::InvalidState, "named optimizer state '", name, "' of ", p.describe(),
         ": the param was frozen when it joined the optimizer, which keeps no state for it");
  if (numel) *numel = p.layout.shard_numel;
  auto it = s->named.find(name);
  if (it == s->named.end()) {
    if (!create) return nullptr;
    auto buf = std::make_shared<Buffer>(ctx_.device(), p.layout.shard_numel * sizeof(float), MemKind::OptimizerState,
                                        true);
    ctx_.device()->synchronize();  // zeros before the caller reads them
    ctx_.ledger().add(Held::Optimizer, buf->bytes());
    it = s->named.emplace(name, std::move(buf)).first;
  }
  return static_cast<float*>(it->second->data());
}

std::vector<std::string> Optimizer::named_states(const Param& p) {
  ctx_.expect_locked();
  std::vector<std::string> out;
  if (const Slot* s = find_slot(p))
    for (const auto& [name, buf] : s->named) out.push_back(name);
  return out;
}

void Optimizer::keep_named_states_locked(const Param& p, const std::set<std::string>& keep) {
  ctx_.expect_locked();
  ++state_epoch_;
  Slot* s = find_slot(p);
  if (s == nullptr) return;
  for (auto it = s->named.begin(); it != s->named.end();) {
    if (keep.count(it->first)) {
      ++it;
      continue;
    }
    ctx_.ledger().sub(Held::Optimizer, it->second->bytes());
    it = s->named.erase(it);
  }
}

void Optimizer::set_steps(int64_t s) {
  const auto held = ctx_.lock();
  set_steps_locked(s);
}

void Optimizer::restore_counts_locked(int64_t steps, const std::vector<int64_t>& updates) {
  ctx_.expect_locked();
  expect_no_open_step("a heal's restore");
  size_t i = 0;
  for (auto& g : groups_) i += g.slots.size();
  if (updates.size() != i)
    fail(Code::Internal, "heal restore: ", updates.size(), " update counts for ", i, " slots");
  if (steps < 0) fail(Code::InvalidArgument, "heal restore: step count ", steps, ": expected >= 0");
  step_ = steps;
  ++state_epoch_;
  i = 0;
  for (auto& g : groups_)
    for (auto& slot : g.slots) {
      slot.updates = updates[i++];
      slot.master_of_version = slot.param->shard_version;
    }
}

void Optimizer::adopt_resharded_locked(const std::vector<SlotState>& states) {
  ctx_.expect_locked();
  expect_no_open_step("a shrink");
  size_t i = 0;
  for (auto& g : groups_)
    for (auto& slot : g.slots) {
      if (i >= states.size()) fail(Code::Internal, "shrink: ", states.size(), " slot states for more slots");
      const SlotState& st = states[i++];
      if (static_cast<bool>(st.master) != static_cast<bool>(slot.master) ||
          static_cast<bool>(st.state1) != static_cast<bool>(slot.state1) ||
          static_cast<bool>(st.state2) != static_cast<bool>(slot.state2) || st.param != slot.param)
        fail(Code::Internal, "shrink: the resharded state of ", slot.param->describe(), " is not its slot's");
      ctx_.ledger().sub(Held::Optimizer, state_bytes(slot));
      slot.master = st.master;
      slot.state1 = st.state1;
      slot.state2 = st.state2;
      slot.master_of_version = slot.param->shard_version;
      ctx_.ledger().add(Held::Optimizer, state_bytes(slot));
    }
  if (i != states.size()) fail(Code::Internal, "shrink: ", states.size(), " slot states for ", i, " slots");
  for (const auto& v : views_) ctx_.ledger().sub(Held::Optimizer, v.second.size() * sizeof(float));
  views_.clear();
  ++state_epoch_;
}

void Optimizer::set_steps_locked(int64_t s) {
  ctx_.expect_locked();
  expect_no_open_step("set_step");
  if (s < 0) fail(Code::InvalidArgument, "optimizer step count ", s, ": expected >= 0");
  step_ = s;
  ++state_epoch_;
  // A restored state: every param as if updated at each of those steps.
  for (auto& g : groups_)
    for (auto& slot : g.slots) slot.updates = s;
}

void Optimizer::expect_no_open_step(const char* what) const {
  if (open_)
    fail(Code::InvalidState, what, ": the optimizer is between step_begin and step_end (its masters may be "
         "half updated, its gradients unscaled); call step_end first");
}

void Optimizer::sync_params() {
  const auto held = ctx_.lock();
  expect_no_open_step("sync_params");
  ++state_epoch_;
  if (swap_) {
    flush_state_views();
    swap_->for_each([&](const SwappedState::View& v) {
      for (const auto& pc : v.sg.pieces) {
        const auto [gi, si] = slot_at_[pc.slot];
        Slot& s = groups_[gi].slots[si];
        Param& p = *s.param;
        if (!s.swapped[0]) continue;  // the master is the shard (fp32, or bf16 masters)
        const ShardAccess shard(ctx_, p, ShardAccess::Write);
        ops::cast_from_f32(*ctx_.device(), v.master(pc), p.dtype,
                           static_cast<char*>(shard.data()) + pc.begin * p.elem_bytes(), pc.count);
        copy_tally::add(CopyKind::MasterRefresh, pc.count * p.elem_bytes());
        s.master_of_version = p.shard_version;
      }
      return false;
    });
    ctx_.device()->synchronize();
    shards_rewritten(ctx_, {});
    return;
  }
  for (auto& g : groups_)
    for (auto& s : g.slots)
      if (s.master) {  // a 16-bit param's (none for a param frozen when it joined)
        const ShardAccess shard(ctx_, *s.param, ShardAccess::Write);
        ops::cast_from_f32(*ctx_.device(), static_cast<const float*>(s.master->data()),
                           s.param->dtype, shard.data(), s.param->layout.shard_numel);
        copy_tally::add(CopyKind::MasterRefresh, s.param->layout.shard_numel * s.param->elem_bytes());
        s.master_of_version = s.param->shard_version;  // the loaded master is the truth
      }
  ctx_.device()->synchronize();
  shards_rewritten(ctx_, {});  // the masters are the truth: no version moves
}

// What happened since the previous step ended (collectives of every group,
// waits, this step's update), for zs_context_step_stats and the timeline.
void Optimizer::record_step_stats(Trace::Clock::time_point step_begin, double update_seconds) {
  const auto now = Trace::Clock::now();
  const CommTotals totals = ctx_.comm_stats()->totals();
  StepStats st;
  st.step = step_;
  st.step_seconds = std::chrono::duration<double>(now - last_step_end_).count();
  for (int k = 0; k < kCommKinds; ++k) {
    st.comm.seconds[k] = totals.seconds[k] - last_totals_.seconds[k];
    st.comm.sent[k] = totals.sent[k] - last_totals_.sent[k];
    st.comm.received[k] = totals.received[k] - last_totals_.received[k];
    st.comm.calls[k] = totals.calls[k] - last_totals_.calls[k];
  }
  st.comm.wait_seconds = totals.wait_seconds - last_totals_.wait_seconds;
  st.optimizer_seconds = update_seconds;
  if (listener_) listener_->step_figures(st);
  ctx_.record_step(st);
  ctx_.note_step_copies();
  last_totals_ = totals;
  last_step_end_ = now;
  if (ctx_.trace()) ctx_.trace()->event("optimizer", "optimizer step", "optimizer", step_begin, now);
}

double Optimizer::loss_scale() const {
  const auto held = ctx_.lock();
  return scaler_.scale();
}

int64_t Optimizer::steps() const {
  const auto held = ctx_.lock();
  return steps_locked();
}

int64_t Optimizer::steps_locked() const {
  ctx_.expect_locked();
  return step_;
}

std::vector<std::string> Optimizer::describe() const {
  const auto num = [](double v) {
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest exact text
    return std::string(buf, r.ptr);
  };
  static const char* const kKinds[] = {"adamw", "adam", "sgd", "external", "muon"};
  std::vector<std::string> t{std::string("kind=") + kKinds[static_cast<int>(kind_)],
                             "groups=" + std::to_string(groups_.size())};
  for (size_t g = 0; g < groups_.size(); ++g) {
    const std::string p = "g" + std::to_string(g) + ".";
    const Hparams& h = groups_[g].hp;
    uint64_t elements = 0;
    for (const auto& s : groups_[g].slots) elements += s.param->layout.numel;
    t.push_back(p + "params=" + std::to_string(groups_[g].slots.size()));
    t.push_back(p + "elements=" + std::to_string(elements));
    t.push_back(p + "lr=" + num(h.lr));
    t.push_back(p + "beta1=" + num(h.beta1));
    t.push_back(p + "beta2=" + num(h.beta2));
    t.push_back(p + "eps=" + num(h.eps));
    t.push_back(p + "weight_decay=" + num(h.weight_decay));
    t.push_back(p + "momentum=" + num(h.momentum));
    t.push_back(p + "dampening=" + num(h.dampening));
    t.push_back(p + "nesterov=" + std::to_string(h.nesterov));
    t.push_back(p + "bias_correction=" + std::to_string(h.bias_correction));
    t.push_back(p + "use_muon=" + std::to_string(h.use_muon));
    t.push_back(p + "ns_method=" + std::to_string(h.ns_method));
    t.push_back(p + "ns_steps=" + std::to_string(h.ns_steps));
  }
  return t;
}

Optimizer::OpenStep Optimizer::begin_locked() {
  ctx_.expect_locked();
  memory_tally::set_phase(MemPhase::Step);  // until the next fetch
  OpenStep open;
  open.begin = Trace::Clock::now();
  ctx_.check_async_error();
  if (swap_) flush_state_views();  // what a checkpoint load or the caller wrote into them
  // The ranks' optimizers must agree before anything changes; the check
  // rides on the gradient norm's all-reduce below where it can.
  const std::vector<std::string> description = describe();
  zs::Group& world = *ctx_.world();
  const bool fused_agreement = agreement_fusable(world.size());
  if (!fused_agreement) check_agreement(world, description);
  // One world all-reduce (Sum) carries, in this order: the agreement
  // check, the sums of squares of groups spanning the world (0 if none),
  // and how many ranks saw inf/NaN. Every rank issues it alike whatever its
  // optimizer holds, so a disagreement is named before the per-group
  // all-reduces (MiCS shard groups), whose number it could change. Where the
  // step's gradients are one small bucket, the agreement rides on its
  // reduction instead, which also yields the norm (sync_fusing_locked).
  // With a step listener (the peer copy), two floats more: its commit flag
  // and its vote to grow the world back (a regrow), and no fused reduction: the copy needs the gradient shards final before
  // the all-reduce that commits it.
  std::vector<float> v(kAgreementFloats + (listener_ ? 4 : 2), 0.0f);
  if (fused_agreement) agreement_floats(description, v.data());
  const std::vector<float> mine = v;
  std::vector<const Param*> stepped;
  for (const auto& g : groups_)
    for (const auto& s : g.slots) stepped.push_back(s.param.get());
  GradReducer::FusedNorm fused;
  if (listener_) grads(ctx_).sync_locked();
  else fused = grads(ctx_).sync_fusing_locked(v, stepped);
  if (fused.done && fused_agreement && !agreement_holds(v.data(), mine.data(), world.size()))
    fail_disagreement(world, description);

  // Sum of squares per partition group (each group's shards cover its
  // params once), and whether any rank saw inf/NaN. A shard not written
  // since the last step is zeros and adds nothing.
  std::vector<const zs::Group*> order;
  std::map<const zs::Group*, std::pair<std::shared_ptr<zs::Group>, std::vector<const Param*>>>
      ranges;
  for (const auto& g : groups_) {
    for (const auto& s : g.slots) {
      const Param& p = *s.param;
      if (!p.grad || !p.grad->current) continue;
      auto it = ranges.find(p.group.get());
      if (it == ranges.end()) {
        order.push_back(p.group.get());
        it = ranges.emplace(p.group.get(), std::make_pair(p.group, std::vector<const Param*>()))
                 .first;
      }
      it->second.second.push_back(&p);
    }
  }
  std::map<const zs::Group*, std::pair<std::shared_ptr<zs::Group>, double>> sumsq;
  float nonfinite = 0.0f;
  for (const auto* key : order) {
    auto& [group, list] = ranges.at(key);
    double sum = 0.0;
    bool finite = true;
    grad_sum_squares(*ctx_.device(), list, &sum, &finite);
    sumsq.emplace(key, std::make_pair(group, sum));
    if (!finite) nonfinite = 1.0f;
  }
  double total = 0.0;
  float commits = 0.0f;
  if (fused.done && fused.complete) {
    // Every rank reduced every block: the norm is known alike here (and
    // no other group holds a gradient: complete).
    total = fused.sum_squares;
    nonfinite = fused.finite ? 0.0f : 1.0f;
  } else {
    std::fill(v.begin(), v.end(), 0.0f);
    if (fused_agreement && !fused.done) agreement_floats(description, v.data());
    if (listener_) {
      v[kAgreementFloats + 2] = listener_->before_norm();
      v[kAgreementFloats + 3] = listener_->grow_vote();
    }
    for (const auto* key : order) {
      auto& [group, local] = sumsq.at(key);
      if (group->size() == world.size()) v[kAgreementFloats] += static_cast<float>(local);
    }
    v[kAgreementFloats + 1] = nonfinite;
    fault_point("norm_allreduce");
    if (world.size() > 1)
      world.run("gradient norm", [&](Communicator& c) {
        c.allreduce(v.data(), v.data(), v.size(), DType::F32, ReduceOp::Sum);
      });
    fault_point("norm_allreduce_done");
    // What a survivor whose all-reduce failed needs to roll this step
    // forward (healing): the result as this rank saw it.
    if (listener_) last_norm_ = {step_ + 1, v[kAgreementFloats], v[kAgreementFloats + 1], v[kAgreementFloats + 2]};
    if (fused_agreement && !fused.done && !agreement_holds(v.data(), mine.data(), world.size()))
      fail_disagreement(world, description);
    total = v[kAgreementFloats];
    nonfinite = v[kAgreementFloats + 1];
    if (listener_) {
      commits = v[kAgreementFloats + 2];
      listener_->grow_votes(v[kAgreementFloats + 3]);
    }
  }
  for (const auto* key : order) {
    auto& [group, local] = sumsq.at(key);
    if (group->size() == world.size()) continue;
    float part = static_cast<float>(local);
    group->run("gradient norm", [&](Communicator& c) { c.allreduce(&part, &part, 1, DType::F32, ReduceOp::Sum); });
    total += part;
  }

  plan_locked(open, total, nonfinite, commits);
  return open;
}

void Optimizer::plan_locked(OpenStep& open, double total, float nonfinite, float commits) {
  StepResult& r = open.result;
  const double scale = scaler_.scale();
  r.loss_scale = scale;  // what the last backward was scaled by (step_end gives the next one)
  r.step = step_;
  r.grad_norm = std::sqrt(total) / scale;
  const bool overflow = nonfinite > 0.0f || !std::isfinite(r.grad_norm);
  if (overflow) {
    r.skipped = true;
    r.grad_norm = std::numeric_limits<double>::infinity();
  }
  if (listener_ && last_norm_.step == step_ + 1) {  // a survivor reports it if a loss cuts the step short
    last_norm_.grad_norm = r.grad_norm;
    last_norm_.skipped = r.skipped;
    last_norm_.planned = true;
  }
  if (overflow) {
    if (listener_) listener_->after_norm(commits, true, 0.0);
    return;
  }
  open.grad_scale = 1.0 / scale;
  const double clip = ctx_.config().gradient_clipping;
  if (clip > 0.0) {
    const double coef = clip / (r.grad_norm + 1e-6);
    if (coef < 1.0) open.grad_scale *= coef;
  }
  if (listener_) listener_->after_norm(commits, false, open.grad_scale);
  // Gathered copies the coordinator kept are stale from here on.
  if (Coordinator* coord = coordinator_if_any(ctx_)) coord->on_params_updated();
  drop_secondaries(ctx_);
}

StepResult Optimizer::roll_forward_locked(const NormResult& seen) {
  ctx_.expect_locked();
  if (!listener_ || seen.step != step_ + 1)
    fail(Code::Internal, "roll-forward of step ", seen.step, " on an optimizer at step ", step_,
         listener_ ? "" : " without a peer copy");
  OpenStep open;
  open.begin = Trace::Clock::now();
  plan_locked(open, seen.sum_squares, seen.nonfinite, seen.commits);
  if (!open.result.skipped) apply_update_locked(static_cast<float>(open.grad_scale));
  StepResult r = open.result;
  if (!r.skipped) ++step_;
  scaler_.update(r.skipped);
  std::set<const Param*> stepped;
  for (const auto& g : groups_)
    for (const auto& s : g.slots) stepped.insert(s.param.get());
  grads(ctx_).end_step(stepped);
  ctx_.device()->synchronize();
  r.loss_scale = scaler_.scale();
  r.step = step_;
  last_norm_ = seen;
  last_norm_.grad_norm = r.grad_norm;
  last_norm_.skipped = r.skipped;
  last_norm_.planned = true;
  return r;
}

bool Optimizer::committed_result_locked(StepResult* out) const {
  ctx_.expect_locked();
  const int64_t taken = last_norm_.skipped ? step_ + 1 : step_;  // a skipped step leaves the count
  if (!last_norm_.planned || last_norm_.step != taken) return false;
  out->skipped = last_norm_.skipped;
  out->grad_norm = last_norm_.grad_norm;
  out->loss_scale = scaler_.scale();
  out->step = step_;
  return true;
}

void Optimizer::apply_update_locked(float grad_scale) {
  if (swap_) {
    update_swapped(grad_scale);
  } else {
    // With every shard in memory (no param offload, whose shards come back
    // one at a time), the Adam/AdamW/SGD updates run as one multi-tensor
    // pass: on the host one parallel pass, on a GPU one launch per working
    // dtype (ops::adam_step_many / sgd_step_many; bf16 masters,
    // adam_step_mixed_many / sgd_step_mixed_many). On a GPU only with
    // ZS_CUDA_MULTI_TENSOR=1 until a GPU run has checked its kernels
    // against the per-tensor ones (CudaKernels.*StepMany*,
    // CudaEngine.MultiTensorStepsEqualTheCpuBitForBit in gpu_check.sh):
    // they were written and compiled on a machine without one.
    const bool batched = ctx_.config().offload_param.device == "none" &&
                         (!ctx_.device()->is_cuda() || env_int("ZS_CUDA_MULTI_TENSOR", 0) != 0);
    StepBatch batch;
    for (auto& g : groups_)
      for (auto& s : g.slots)
        if (!s.muon) update(g, s, grad_scale, batched ? &batch : nullptr);
    ops::adam_step_many(*ctx_.device(), batch.adam, grad_scale);
    ops::sgd_step_many(*ctx_.device(), batch.sgd, grad_scale);
    ops::adam_step_mixed_many(*ctx_.device(), batch.adam_mixed, grad_scale);
    ops::sgd_step_mixed_many(*ctx_.device(), batch.sgd_mixed, grad_scale);
    batch.held.clear();  // the shards written back (offloaded ones) once stepped
    if (kind_ == OptimKind::Muon) update_muon(grad_scale);
  }
  ctx_.device()->synchronize();
  trim_shard_cache(ctx_);  // offloaded shards the step changed go back to the swap file
}

StepResult Optimizer::finish_locked(const OpenStep& open, double update_seconds) {
  ctx_.expect_locked();
  StepResult r = open.result;
  if (!r.skipped) ++step_;
  const bool scale_exhausted = scaler_.update(r.skipped);
  std::set<const Param*> stepped;
  for (const auto& g : groups_)
    for (const auto& s : g.slots) stepped.insert(s.param.get());
  grads(ctx_).end_step(stepped);
  // New shards are in place once the step returns.
  ctx_.device()->synchronize();
  // ZS_HOST_TRIM=1: every idle block of the host pools goes back to the
  // system after each step too (by default only once a training step's
  // last gather is released: the coordinator), whatever gathered since.
  // 406M GPT, 2 ranks: no lower peak than the gradients alone, step 6.1
  // -> 8.6 s (docs/memory.md): off unless asked.
  if (!ctx_.device()->is_cuda() && env_int("ZS_HOST_TRIM", -1) == 1) ctx_.device()->trim();
  // Persistent params go out again now, to be gathered by the next forward.
  if (Coordinator* coord = coordinator_if_any(ctx_)) coord->refresh_persistent();
  r.loss_scale = scaler_.scale();
  r.step = step_;
  record_step_stats(open.begin, update_seconds);
  // Every rank saw the same overflow, so every rank fails here alike.
  if (scale_exhausted)
    fail(Code::InvalidState, "fp16: the gradients overflowed again with the loss scale already at "
         "min_loss_scale (", scaler_.scale(), ") and no hysteresis left, so the step was skipped and no "
         "later step can succeed (DeepSpeed ends the run here too); lower fp16.min_loss_scale, or find "
         "what overflows (bf16 has fp32's range)");
  return r;
}

StepResult Optimizer::step() {
  const auto held = ctx_.lock();
  if (kind_ == OptimKind::External)
    fail(Code::InvalidState, "an external optimizer (the caller's update rule) steps by "
         "zs_optimizer_step_begin, the caller's update, then zs_optimizer_step_end");
  const OpenStep open = begin_locked();
  double update_seconds = 0.0;
  fault_point("update");
  if (!open.result.skipped) {
    const auto update_begin = Trace::Clock::now();
    apply_update_locked(static_cast<float>(open.grad_scale));
    const auto update_end = Trace::Clock::now();
    update_seconds = std::chrono::duration<double>(update_end - update_begin).count();
    if (ctx_.trace()) ctx_.trace()->event("optimizer", "update", "optimizer", update_begin, update_end);
  }
  return finish_locked(open, update_seconds);
}

StepResult Optimizer::step_begin() {
  const auto held = ctx_.lock();
  if (kind_ != OptimKind::External)
    fail(Code::InvalidState, "step_begin/step_end are for an external optimizer (ZS_OPTIM_EXTERNAL); "
         "this one's update is the engine's: zs_optimizer_step");
  if (open_)
    fail(Code::InvalidState, "step_begin: the previous step_begin has had no step_end yet");
  OpenStep open = begin_locked();
  if (!open.result.skipped) {
    Device& dev = *ctx_.device();
    // The caller's update sees the gradients as the built-in ones do:
    // unscaled and clipped, in place; and 16-bit masters as fresh.
    const auto divisor = static_cast<float>(1.0 / open.grad_scale);
    for (auto& g : groups_)
      for (auto& s : g.slots) {
        Param& p = *s.param;
        const uint64_t n = p.layout.shard_numel;
        if (n == 0 || !p.grad || !p.grad_pushed) continue;
        if (divisor != 1.0f) {
          auto* grad = static_cast<float*>(p.grad->data());
          ops::widen_scaled(dev, grad, DType::F32, grad, n, divisor);
          p.grad->sum_known = false;
        }
        if (s.master && s.master_of_version != p.shard_version) {
          const ShardAccess shard(ctx_, p, ShardAccess::Read);
          ops::refresh_master(dev, shard.data(), p.dtype, static_cast<float*>(s.master->data()), n);
          copy_tally::add(CopyKind::ParamCast, n * sizeof(float));
          s.master_of_version = p.shard_version;
        }
      }
    dev.synchronize();
  }
  open.update_begin = Trace::Clock::now();
  open_ = open;
  return open.result;
}

StepResult Optimizer::step_end() {
  const auto held = ctx_.lock();
  if (!open_) fail(Code::InvalidState, "step_end without a step_begin before it");
  const OpenStep open = *open_;
  open_.reset();
  double update_seconds = 0.0;
  if (!open.result.skipped) {
    Device& dev = *ctx_.device();
    // The caller updated the masters: 16-bit working shards from them.
    for (auto& g : groups_)
      for (auto& s : g.slots) {
        Param& p = *s.param;
        if (p.layout.shard_numel == 0 || !p.grad || !p.grad_pushed) continue;
        if (s.master) {
          const ShardAccess shard(ctx_, p, ShardAccess::Write);
          ops::cast_from_f32(dev, static_cast<const float*>(s.master->data()), p.dtype, shard.data(),
                             p.layout.shard_numel);
          copy_tally::add(CopyKind::MasterRefresh, p.layout.shard_numel * p.elem_bytes());
          s.master_of_version = p.shard_version;
        }
        ++s.updates;
      }
    dev.synchronize();
    trim_shard_cache(ctx_);
    const auto update_end = Trace::Clock::now();
    update_seconds = std::chrono::duration<double>(update_end - open.update_begin).count();
    if (ctx_.trace()) ctx_.trace()->event("optimizer", "update", "optimizer", open.update_begin, update_end);
  }
  return finish_locked(open, update_seconds);
}

}  // namespace zs
