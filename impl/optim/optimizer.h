// The sharded optimizer: state sized to this rank's shards, fp32 masters
// for 16-bit params (or none: bf16 masters, below), parameter groups with
// their own hyper-parameters, and the step that turns synced gradient
// shards into updated param shards.
// Each call takes the engine lock itself.
//
// Where the state lives (offload_optimizer.device): "none" and "cpu" keep
// it in the context's memory; on a CPU context that is host memory, so
// "cpu" asks for what is already so. "nvme" keeps the fp32 masters of
// 16-bit params and every moment in a swap file (swapped_state.h) and
// steps it sub-group by sub-group, bit for bit as in memory. On a CUDA
// context both are refused (NotSupported) until the host-side step exists.
//
// bf16.bf16_master_weights_and_grads: a bf16 param keeps no fp32 master;
// its bf16 working shard is the master, stepped in place (each element
// widened, updated in fp32, rounded once to bf16 on store: the *_mixed
// kernels), so it is its slot 0 as an fp32 param's shard is its own
// (master_in_shard). bf16.bf16_optimizer_states (which needs the former)
// also keeps a bf16 param's moments in bf16 (state_dtype): read as fp32,
// updated in fp32, rounded once on store. Both act on bf16 params only:
// fp32 and fp16 params keep fp32 masters and moments. The gradient shards
// stay fp32 either way (impl/grad/reducer.h says why). Per element of a bf16
// param's shard, AdamW keeps 12 bytes (fp32 master + 2 fp32 moments), 8
// with bf16 masters, 4 with bf16 states too. On NVMe the masters key acts
// (no master in the swap file); bf16 states there are refused at creation
// (the swap file holds fp32 arrays). An External optimizer is refused under
// bf16_master_weights_and_grads: its caller steps fp32 masters (slot 0).
//
// Muon: DeepSpeed 0.19's Muon with its auxiliary AdamW. A group's
// use_muon picks, at add_group, which of its params step Muon (matrices:
// momentum on the shard, the whole update orthogonalized on an owner rank,
// muon_step.h; lr, momentum, weight_decay, ns_method, ns_steps; slot 1 is
// the momentum) and which step AdamW (bias corrected, decoupled decay;
// lr, beta1, beta2, eps, weight_decay; slots 1 and 2). Refused, as External
// is, under bf16_master_weights_and_grads and with state on NVMe.
//
// External: the update rule is the caller's (a torch optimizer stepping the
// shards). The engine keeps the fp32 masters of 16-bit params and runs the
// step around the caller's update: step_begin syncs the gradients, takes
// the global norm, skips on overflow, unscales and clips the gradient
// shards in place; the caller then updates the masters (slot 0) from them;
// step_end writes the working shards from the masters and closes the step.
// The caller's per-element state lives in named slots (named_state), which
// checkpoints save and reshard as they do the built-in moments.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "impl/core/context.h"
#include "impl/optim/loss_scaler.h"
#include "impl/optim/shard_step.h"
#include "impl/optim/step_listener.h"
#include "impl/optim/swapped_state.h"
#include "impl/partition/param.h"
#include "impl/partition/shard_residence.h"
#include "kernels/optim.h"

namespace zs {

struct StepResult {
  bool skipped = false;
  double grad_norm = 0.0;
  double loss_scale = 1.0;
  int64_t step = 0;
};

class Optimizer {
 public:
  Optimizer(Context& ctx, OptimKind kind);
  ~Optimizer();
  int add_group(const std::vector<std::shared_ptr<Param>>& params, const Hparams& hp);
  // A method with a `_locked` twin takes the engine lock; the twin is for
  // a caller that holds it already (a checkpoint's save or load: the lock
  // is not recursive). Those marked "under the caller's hold" have none.
  //
  // group -1: all groups.
  void set_hparams(int group, const Hparams& hp);
  void set_hparams_locked(int group, const Hparams& hp);
  void set_lr(int group, double lr);
  StepResult step();
  // The two halves of an External optimizer's step (see the top): between
  // them the caller writes the masters and named states, nothing else. A
  // skipped step (overflow) still needs its step_end, which updates nothing.
  StepResult step_begin();
  StepResult step_end();
  bool step_open() const { return open_.has_value(); }
  // InvalidState naming `what` while a step is open (a checkpoint, a state
  // restore would see half-updated masters).
  void expect_no_open_step(const char* what) const;
  double loss_scale() const;
  // An External optimizer's named per-param state: shard_numel fp32
  // elements (zeros when made), created on first request when `create`,
  // else null if absent. Saved and loaded by checkpoints under `name`.
  float* named_state(const Param& p, const std::string& name, bool create, uint64_t* numel);
  float* named_state_locked(const Param& p, const std::string& name, bool create, uint64_t* numel);
  // The names of p's named states, in order, and dropping those not in
  // `keep` (a checkpoint load: the state becomes the saved one). Under the
  // caller's hold.
  std::vector<std::string> named_states(const Param& p);
  void keep_named_states_locked(const Param& p, const std::set<std::string>& keep);
  // Checkpoint access to a param's state (slot 0 master, 1, 2). State on
  // NVMe is read into a host copy that stays valid, and is written back,
  // until the next step, sync_params or flush_state_views. float* only:
  // a bf16 slot (slot 0 of a bf16 param whose shard is its master, a bf16
  // moment) is InvalidState naming the config key; state_raw_locked hands
  // out any slot with its dtype (slot 0 of a master_in_shard param: the
  // shard itself, in the param's dtype).
  float* state(const Param& p, int slot, uint64_t* numel);
  float* state_locked(const Param& p, int slot, uint64_t* numel);
  void* state_raw_locked(const Param& p, int slot, DType* dtype, uint64_t* numel);
  // Whether p's slot 0 is its own shard: an fp32 param, or a bf16 param
  // under bf16.bf16_master_weights_and_grads (no separate master to save
  // or load).
  bool master_in_shard(const Param& p) const;
  // Whether p steps Muon (a Muon optimizer's matrix): its slot 1 is Muon's
  // momentum and it has no slot 2.
  bool steps_muon(const Param& p) const;
  // The dtype of p's slot 1 and 2 (F32, or BF16 under bf16_optimizer_states).
  DType state_dtype(const Param& p) const;
  // Writes the host copies state() made of NVMe state back and frees them.
  // Under the caller's hold, as are the next two.
  void flush_state_views();
  // Whether slot `slot` of p lives in the swap file (read it with
  // copy_swapped_state, a param at a time, rather than state()).
  bool state_swapped(const Param& p, int slot);
  // Copies a swapped slot's shard_numel floats into dst (from the host copy
  // state() made, if there is one), without keeping a copy.
  void copy_swapped_state(const Param& p, int slot, float* dst);
  // The swap file's bytes (0 unless the state is on NVMe).
  uint64_t swapped_bytes() const { return swap_ ? swap_->file_bytes() : 0; }
  int64_t steps() const;
  int64_t steps_locked() const;
  void set_steps(int64_t s);
  void set_steps_locked(int64_t s);
  // Rewrite 16-bit working shards from the masters (after a state load).
  void sync_params();
  uint64_t context_id() const { return ctx_id_; }

  // For checkpoints: the kind, the groups with their params and
  // hyper-parameters, whether a param has a state slot yet, and the loss
  // scaler's state.
  OptimKind kind() const { return kind_; }
  size_t num_groups() const { return groups_.size(); }
  const Hparams& hparams(size_t group) const { return groups_.at(group).hp; }
  std::vector<std::shared_ptr<Param>> group_params(size_t group) const;
  bool has_state(const Param& p, int slot) const;
  // Allocates slot 1 (SGD momentum switched on after add_group) so a
  // checkpoint's buffer can be loaded into it; *dtype receives the slot's
  // dtype (as state_raw_locked). Under the caller's hold.
  void* ensure_state(const Param& p, int slot, DType* dtype, uint64_t* numel);
  LossScaler& scaler() { return scaler_; }

  // The heal layer's hooks (impl/heal/peer_copy.h): at most one listener,
  // told of every step (step_listener.h), owned here. Under the caller's hold.
  void set_listener(std::unique_ptr<StepListener> listener);
  StepListener* listener() const { return listener_.get(); }
  // Moves on whenever state may have been written other than by a step
  // (a pointer handed out, set_step, sync_params): the peer copy seeds its
  // holder again before the next step.
  uint64_t state_epoch() const { return state_epoch_; }
  // A slot's state as the heal layer copies and replays it: the param, its
  // group, the buffers (null where there is none: master when the shard is
  // its own master) and its update count. Under the caller's hold.
  struct SlotState {
    std::shared_ptr<Param> param;
    size_t group = 0;
    BufferPtr master, state1, state2;
    DType state_dtype = DType::F32;
    bool master_is_shard = false, master_is_working = false;
    bool master_stale = false;  // the shard was rewritten since the master was read (fp32_master refreshes it)
    bool muon = false;
    int64_t updates = 0;
  };
  std::vector<SlotState> slot_states_locked() const;

  // Healing (docs/healing.md, section 2), under the caller's hold. The
  // last norm all-reduce whose result this rank obtained, with a listener:
  // the step it would commit (steps_locked() + 1 until the update ran) and
  // its sum of squares, non-finite count and commit flags (step 0: none).
  struct NormResult {
    int64_t step = 0;
    float sum_squares = 0.0f, nonfinite = 0.0f, commits = 0.0f;
    // What this rank made of it (plan_locked, here or in the roll-forward):
    // the step's norm and whether it was skipped; `planned` false until then.
    double grad_norm = 0.0;
    bool skipped = false, planned = false;
  };
  const NormResult& last_norm_locked() const { return last_norm_; }
  // The result of this optimizer's last step, when a loss cut that step
  // short after it committed (zs_heal_committed_result): false when this
  // rank never planned it (its norm all-reduce failed and it did not roll
  // forward), or the last step is not the one planned.
  bool committed_result_locked(StepResult* out) const;
  // The roll-forward: step steps_locked() + 1 taken with `seen`, the
  // result another survivor obtained when this rank's all-reduce failed
  // (its gradient shards are still final), as begin_locked, the update and
  // finish_locked would have, less every collective (the groups are
  // aborted). The listener is told, so a holder replays its replica too.
  StepResult roll_forward_locked(const NormResult& seen);
  // A replacement's state received from its holder's replica
  // (impl/heal/join.cpp), its shards, masters and moments written already:
  // the step count, each slot's update count (in slot_states_locked's
  // order), and the masters taken as read from the shards as they are now.
  void restore_counts_locked(int64_t steps, const std::vector<int64_t>& updates);
  // A shrink laid every param out anew (impl/heal/shrink.cpp): slot i (in
  // slot_states_locked's order) takes states[i]'s master, state1 and
  // state2 (each null where the slot has none), sized to its param's new
  // shard; its master is taken as read from the shard as it is now.
  void adopt_resharded_locked(const std::vector<SlotState>& states);
  // Kind, groups and hyper-parameters as tokens (check_agreement's; a
  // replacement's are compared with the survivors' at zs_heal_join).
  std::vector<std::string> describe() const;

 private:
  struct Slot {
    std::shared_ptr<Param> param;
    BufferPtr master;  // fp32 shard of a 16-bit param
    // An fp32 param's master is its shard, reached through a ShardAccess
    // (it may be offloaded), so `master` stays null.
    bool master_is_shard = false;
    // bf16_master_weights_and_grads: a bf16 param's master is its bf16
    // working shard (no `master` buffer; stepped in place).
    bool master_is_working = false;
    BufferPtr state1, state2;  // Adam: exp_avg, exp_avg_sq; SGD: momentum
    DType state_dtype = DType::F32;  // of state1 and state2 (BF16 under bf16_optimizer_states)
    uint64_t master_of_version = 0;  // the param's shard_version the master was read from
    int64_t updates = 0;  // steps that updated this param (Adam's bias correction, as torch's per-param step)
    // On NVMe: which of master, state 1, state 2 the swap file holds for
    // this param, and its number there.
    bool swapped[3] = {false, false, false};
    size_t index = 0;
    std::shared_ptr<GradSink> grad_sink;  // its gradients' place in the swap file, set on the param
    bool sgd_first = false;  // this step's SGD first_step, kept across sub-groups
    bool muon = false;       // a Muon optimizer's matrix (steps_muon)
    std::map<std::string, BufferPtr> named;  // External: the caller's state by name
  };
  // What step_begin left for step_end (and step() between its halves).
  struct OpenStep {
    Trace::Clock::time_point begin;
    StepResult result;
    double grad_scale = 1.0;  // unscale times clip
    Trace::Clock::time_point update_begin;  // External: the caller's update from here
  };
  struct Group {
    Hparams hp;
    std::vector<Slot> slots;
  };
  void check_hparams(const Hparams& hp) const;
  void record_step_stats(Trace::Clock::time_point step_begin, double update_seconds);
  std::vector<int> group_indices(int group) const;
  // The halves of every step, under the hold: begin syncs, agrees, takes
  // the norm and decides skip and scale; finish counts the step, closes
  // the gradients and records the stats.
  OpenStep begin_locked();
  // begin_locked's end, from the norm's sums: the result, the scale, the
  // listener told.
  void plan_locked(OpenStep& open, double total, float nonfinite, float commits);
  void apply_update_locked(float grad_scale);
  NormResult last_norm_;
  StepResult finish_locked(const OpenStep& open, double update_seconds);
  // The Adam/AdamW and SGD updates of one step, run together
  // (ops::adam_step_many / sgd_step_many; for bf16 masters the _mixed_many
  // steps) once every slot is visited: on the host a model of many params
  // under the kernels' parallel grain steps on all threads instead of one
  // param at a time on one; on a GPU one launch per working dtype instead
  // of one per param. Holds each shard until it has run.
  struct StepBatch {
    std::vector<kernels::AdamTensor> adam;
    std::vector<kernels::SgdTensor> sgd;
    std::vector<kernels::AdamMixedTensor> adam_mixed;
    std::vector<kernels::SgdMixedTensor> sgd_mixed;
    std::vector<ShardAccess> held;
  };
  // With `batch`, the slot's update joins it instead of running now
  // (apply_update_locked runs it).
  void update(const Group& g, Slot& s, float grad_scale, StepBatch* batch = nullptr);
  // The Muon slots of every group, one collective pass (muon_step.h).
  void update_muon(float grad_scale);
  // s's fp32 master (an fp32 param's shard itself), refreshed first from a
  // 16-bit shard rewritten since the master was read.
  float* fp32_master(Slot& s, const ShardAccess& shard);
  void update_swapped(float grad_scale);
  uint64_t state_bytes(const Slot& s) const;
  Slot* find_slot(const Param& p);

  Context& ctx_;
  const uint64_t ctx_id_;
  const OptimKind kind_;
  const bool bf16_masters_;  // bf16.bf16_master_weights_and_grads
  const bool bf16_states_;   // bf16.bf16_optimizer_states
  std::vector<Group> groups_;
  LossScaler scaler_;
  int64_t step_ = 0;
  std::unique_ptr<SwappedState> swap_;  // null unless offload_optimizer.device is "nvme"
  std::vector<std::pair<size_t, size_t>> slot_at_;  // a slot's index -> (group, position)
  std::map<std::pair<size_t, int>, std::vector<float>> views_;  // (index, slot) -> host copy
  CommTotals last_totals_;  // the context's collectives as of the previous step's end
  Trace::Clock::time_point last_step_end_;
  std::optional<OpenStep> open_;  // External: between step_begin and step_end
  uint64_t state_epoch_ = 0;
  std::unique_ptr<StepListener> listener_;  // last: it goes first
};

}  // namespace zs
