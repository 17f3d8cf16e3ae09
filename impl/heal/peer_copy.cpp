#include "impl/heal/peer_copy.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "impl/common/error.h"
#include "impl/common/fault_point.h"
#include "impl/device/ops.h"
#include "impl/heal/placement.h"
#include "impl/heal/regrow.h"
#include "impl/heal/trainer_state.h"
#include "impl/partition/register.h"
#include "impl/partition/shard_residence.h"

namespace zs::heal {
namespace {

constexpr uint64_t kMagic = 0x3170616568737aULL;  // "zsheap1"

// The first round: what the rest holds.
struct Header {
  uint64_t magic = kMagic;
  uint32_t with_state = 0;  // 1: a seed (the whole state, then the gradients)
  uint32_t slots = 0;
  int64_t step = 0;  // the source's optimizer steps before this one
  uint64_t blob = 0;  // 0: no per-rank blob follows; else its bytes + 1
};

// The second round: one per param of the source's optimizer, in its order.
struct SlotMeta {
  uint64_t n = 0;      // shard elements
  uint32_t elem = 0;   // bytes per shard element (the param's dtype)
  uint32_t flags = 0;  // kPushed ...
  int64_t updates = 0;
  uint16_t state_esize = 0;
  uint16_t dtype = 0;
  uint32_t group = 0;
};
static_assert(sizeof(Header) == 32 && sizeof(SlotMeta) == 32, "wire layout");

constexpr uint32_t kPushed = 1, kMaster = 2, kState1 = 4, kState2 = 8, kMasterStale = 16,
                   kMasterIsShard = 32, kMasterIsWorking = 64, kFrozen = 128;

// One slot's bytes as the digest reads them.
struct DigestSlot {
  int64_t updates;
  std::vector<std::pair<const void*, size_t>> parts;
};

Digest digest_of(int source, int64_t step, const std::vector<DigestSlot>& slots) {
  XXH3_state_t* st = XXH3_createState();
  if (st == nullptr) fail(Code::OutOfMemory, "peer copy digest: no memory for the hash state");
  XXH3_64bits_reset(st);
  Digest d;
  d.source = source;
  d.step = step;
  XXH3_64bits_update(st, &step, sizeof step);
  for (const auto& s : slots) {
    XXH3_64bits_update(st, &s.updates, sizeof s.updates);
    for (const auto& [p, n] : s.parts) {
      if (n == 0) continue;
      XXH3_64bits_update(st, p, n);
      d.bytes += n;
    }
  }
  d.hash = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return d;
}

// How many peer copies the context made (their ordinals), and the
// optimizers of those alive: a param in none of them rides with ordinal 1.
struct Ordinals final : Context::Attachment {
  explicit Ordinals(Context&) {}
  int made = 0;  // under the engine lock
  std::vector<Optimizer*> optimizers;  // in the order made
};

}  // namespace

PeerCopy::PeerCopy(Context& ctx, Optimizer& opt) : ctx_(ctx), opt_(opt), group_(ctx.heal_group()) {
  if (!group_) fail(Code::Internal, "peer copy without the heal group");
  const int world = ctx.ranks().world_size;
  place_over(ctx.topology().live());
  if (ctx.ranks().rank == 0 && ctx.topology().live().size() == static_cast<size_t>(world)) {
    const std::string note = placement_note(holders_, ctx.topology().host_of());
    if (!note.empty()) std::fprintf(stderr, "zeroshard: zeroshard.healing.peer_copy: %s\n", note.c_str());
  }
  if (const char* drop = std::getenv("ZS_HEAL_DROP_COPY"); drop != nullptr && *drop != '\0') {
    int r = -1;
    long long s = -1;
    char tail = 0;
    if (std::sscanf(drop, "%d:%lld%c", &r, &s, &tail) != 2 || r < 0 || r >= world || s < 1)
      fail(Code::InvalidArgument, "ZS_HEAL_DROP_COPY='", drop, "': expected <rank>:<step>, a rank below ", world,
           " and an optimizer step >= 1");
    drop_rank_ = r;
    drop_step_ = s;
  }
  auto& ordinals = ctx.attachment<Ordinals>();
  ordinal_ = ++ordinals.made;
  ordinals.optimizers.push_back(&opt);
  awaiting_state = ctx.replacing();
  thread_ = std::thread([this] { worker(); });
}

PeerCopy::~PeerCopy() { detach(); }

void PeerCopy::place_over(const std::vector<int>& members) {
  {
    // A replay in flight finishes on the replica before it goes.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
    replay_error_ = nullptr;
  }
  holders_ = member_holders(members, ctx_.topology().host_of());
  const int me = ctx_.ranks().rank;
  holder_ = holder_of(me);
  source_ = -1;
  for (size_t r = 0; r < holders_.size(); ++r)
    if (holders_[r] == me) source_ = static_cast<int>(r);
  replica_.clear();
  replica_seeded_ = false;
  replica_step_ = 0;
  received_ = received_state_ = writing_state_ = false;
  blob_in_ = blob_ = Blob{};
  seeded_ = false;
  versions_sent_.clear();
}

int PeerCopy::at(int world_rank) const {
  const auto& ranks = group_->world_ranks();
  const auto it = std::find(ranks.begin(), ranks.end(), world_rank);
  if (it == ranks.end())
    fail(Code::Internal, "peer copy: rank ", world_rank, " is not in the heal group ", rank_list(ranks));
  return static_cast<int>(it - ranks.begin());
}

std::vector<PeerCopy::Parts> PeerCopy::replica_at(int64_t step) {
  ctx_.expect_locked();
  wait_replay();
  if (!replica_seeded_ || replica_step_ != step)
    fail(Code::StateLost, "rank ", source_, "'s shard state is lost: rank ", ctx_.ranks().rank, ", which holds its "
         "copy, has ", replica_seeded_ ? "it at step " + std::to_string(replica_step_) : std::string("none"),
         ", not at the committed step ", step, "; resume from the last disk checkpoint");
  std::vector<Parts> out;
  for (const Slot& r : replica_) out.push_back({r.shard, r.master, r.state1, r.state2, r.master_stale});
  return out;
}

std::vector<Optimizer::SlotState> PeerCopy::slots_locked() const {
  std::vector<Optimizer::SlotState> slots = opt_.slot_states_locked();
  if (ordinal_ != 1) return slots;
  std::vector<const Param*> in_optimizer;
  if (auto* ordinals = ctx_.find_attachment<Ordinals>())
    for (const Optimizer* o : ordinals->optimizers)
      for (const auto& s : o->slot_states_locked()) in_optimizer.push_back(s.param.get());
  std::sort(in_optimizer.begin(), in_optimizer.end());
  for (const auto& p : registered_params(ctx_)) {
    // Frozen ones only: a param that is not (an unused leftover, one tied
    // away in one process and not in another) may be registered in some
    // ranks only. A quantized frozen shard (its packet) is not copied:
    // written back through a ShardAccess it would be quantized again, not
    // bit for bit (zeroshard.hf does not heal with frozen quantized models).
    if (!p->frozen || p->packet || std::binary_search(in_optimizer.begin(), in_optimizer.end(), p.get()))
      continue;
    Optimizer::SlotState s;
    s.param = p;
    s.group = kInNoOptimizer;
    slots.push_back(std::move(s));
  }
  return slots;
}

int64_t PeerCopy::settled_replica_step() {
  ctx_.expect_locked();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_; });
  return replica_seeded_ && !replay_error_ ? replica_step_ : -1;
}

void PeerCopy::detach() {
  forget_rank_state(ctx_, opt_);
  if (auto* ordinals = ctx_.find_attachment<Ordinals>()) {
    auto& list = ordinals->optimizers;
    list.erase(std::remove(list.begin(), list.end(), &opt_), list.end());
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PeerCopy::worker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || busy_; });
    if (busy_) {
      auto job = std::move(job_);
      lock.unlock();
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error && !replay_error_) replay_error_ = error;
      busy_ = false;
      cv_.notify_all();
      continue;
    }
    if (stop_) return;
  }
}

void PeerCopy::wait_replay() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_; });
  if (replay_error_) {
    // The replica is no longer its source's state: seed it again.
    replica_seeded_ = false;
    auto e = replay_error_;
    replay_error_ = nullptr;
    lock.unlock();
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      fail(err.code(), "peer copy: the replay of rank ", source_, "'s step on its replica failed: ", err.what());
    }
  }
}

void PeerCopy::step_figures(StepStats& st) {
  st.peer_copy_seconds = copy_seconds_;
  st.peer_copy_bytes = copy_bytes_;
  st.replay_seconds = replayed_seconds_;
}

BufferPtr PeerCopy::alloc(uint64_t bytes) {
  if (bytes == 0) return nullptr;
  return std::make_shared<Buffer>(ctx_.device(), bytes, MemKind::PeerCopies);
}

float PeerCopy::before_norm() {
  // A failure here must not leave this rank out of the norm's all-reduce,
  // where the others wait: it becomes this rank's flag 0, and the step
  // fails on every rank alike (after_norm), naming it here.
  failure_.clear();
  try {
    return copy();
  } catch (const std::exception& e) {
    failure_ = e.what();
    seeded_ = false;
    if (writing_state_) replica_seeded_ = false;
    writing_state_ = false;
    received_ = false;
    return 0.0f;
  }
}

float PeerCopy::copy() {
  ctx_.expect_locked();
  fault_point("grad_copy");
  const auto began = std::chrono::steady_clock::now();
  copy_seconds_ = 0.0;
  copy_bytes_ = 0;
  wait_replay();  // the replica takes this step's copy only once the last one is replayed
  replayed_seconds_ = replay_seconds_;
  const std::vector<Optimizer::SlotState> mine = slots_locked();
  const int64_t step = opt_.steps_locked();

  // ---- what goes out
  bool with_state = !seeded_ || opt_.state_epoch() != epoch_sent_ || versions_sent_.size() != mine.size();
  for (size_t i = 0; !with_state && i < mine.size(); ++i)
    with_state = versions_sent_[i] != mine[i].param->shard_version;
  Header out_header;
  out_header.with_state = with_state ? 1 : 0;
  out_header.slots = static_cast<uint32_t>(mine.size());
  out_header.step = step;
  std::vector<SlotMeta> out_meta(mine.size());
  std::vector<ShardAccess> shards;  // held until sent
  std::vector<ExchangeSend> sends;
  for (size_t i = 0; i < mine.size(); ++i) {
    const auto& s = mine[i];
    Param& p = *s.param;
    SlotMeta& m = out_meta[i];
    m.n = p.layout.shard_numel;
    m.elem = static_cast<uint32_t>(p.elem_bytes());
    m.updates = s.updates;
    m.state_esize = static_cast<uint16_t>(dtype_size(s.state_dtype));
    m.dtype = static_cast<uint16_t>(p.dtype);
    m.group = static_cast<uint32_t>(s.group);
    const bool pushed = m.n > 0 && p.grad && p.grad_pushed;
    m.flags = (pushed ? kPushed : 0) | (s.master ? kMaster : 0) | (s.state1 ? kState1 : 0) |
              (s.state2 ? kState2 : 0) | (s.master_stale ? kMasterStale : 0) |
              (s.master_is_shard ? kMasterIsShard : 0) | (s.master_is_working ? kMasterIsWorking : 0) |
              (p.frozen ? kFrozen : 0);
    if (with_state && m.n > 0) {
      shards.emplace_back(ctx_, p, ShardAccess::Read);
      sends.push_back({shards.back().data(), m.n * m.elem});
      if (s.master) sends.push_back({s.master->data(), m.n * sizeof(float)});
      if (s.state1) sends.push_back({s.state1->data(), m.n * m.state_esize});
      if (s.state2) sends.push_back({s.state2->data(), m.n * m.state_esize});
    }
    if (pushed) sends.push_back({p.grad->data(), m.n * sizeof(float)});
  }
  // The trainer's blob for the step this copy is for, last.
  const auto blob = rank_state_for(ctx_, opt_, step + 1);
  if (blob) {
    out_header.blob = blob->size() + 1;
    if (!blob->empty()) sends.push_back({blob->data(), blob->size()});
  }

  // ---- round 1, the headers; round 2, the slots' descriptions
  Header in_header;
  group_->run("peer copy header", [&](Communicator& c) {
    c.exchange(at(holder_), {{&out_header, sizeof out_header}}, at(source_), {{&in_header, sizeof in_header}});
  });
  if (in_header.magic != kMagic)
    fail(Code::Comm, "peer copy: rank ", source_, " sent a header that is not one (magic ", in_header.magic, ")");
  std::vector<SlotMeta> in_meta(in_header.slots);
  group_->run("peer copy slots", [&](Communicator& c) {
    c.exchange(at(holder_), {{out_meta.data(), out_meta.size() * sizeof(SlotMeta)}}, at(source_),
               {{in_meta.data(), in_meta.size() * sizeof(SlotMeta)}});
  });

  // ---- where this rank's replica of its source takes what comes in
  const bool in_state = in_header.with_state != 0;
  bool fits = in_header.slots == mine.size();  // the same optimizer, by the agreement in the norm's all-reduce
  for (size_t i = 0; fits && i < in_meta.size(); ++i) {
    const SlotMeta& m = in_meta[i];
    fits = m.n == mine[i].param->layout.shard_numel && m.group == mine[i].group &&
           (in_state || (replica_seeded_ && i < replica_.size() && replica_[i].n == m.n));
  }
  // From here a seed overwrites the replica in place: cut short, it is
  // no state at all. A gradient copy cut short leaves it whole.
  writing_state_ = fits && in_state;
  if (fits && in_state) {
    replica_.resize(in_meta.size());
    for (size_t i = 0; i < in_meta.size(); ++i) {
      const SlotMeta& m = in_meta[i];
      Slot& r = replica_[i];
      auto sized = [&](BufferPtr& b, bool want, uint64_t bytes) {
        if (!want || bytes == 0) b.reset();
        else if (!b || b->bytes() != bytes) b = alloc(bytes);
      };
      r.n = m.n;
      r.dtype = static_cast<DType>(m.dtype);
      r.group = m.group;
      r.state_dtype = m.state_esize == 2 ? DType::BF16 : DType::F32;
      r.master_is_shard = (m.flags & kMasterIsShard) != 0;
      r.master_is_working = (m.flags & kMasterIsWorking) != 0;
      sized(r.shard, true, m.n * m.elem);
      sized(r.master, (m.flags & kMaster) != 0, m.n * sizeof(float));
      sized(r.state1, (m.flags & kState1) != 0, m.n * m.state_esize);
      sized(r.state2, (m.flags & kState2) != 0, m.n * m.state_esize);
      sized(r.grad, (m.flags & kFrozen) == 0, m.n * sizeof(float));  // a frozen param never gets one
    }
  }
  std::vector<ExchangeRecv> recvs;
  std::vector<std::vector<char>> spill;  // what does not fit is received and dropped
  auto into = [&](const BufferPtr& b, uint64_t bytes) {
    if (bytes == 0) return;
    if (fits && b && b->bytes() == bytes) {
      recvs.push_back({b->data(), bytes});
    } else {
      fits = false;
      spill.emplace_back(bytes);
      recvs.push_back({spill.back().data(), bytes});
    }
  };
  spill.reserve(in_meta.size() * 5);
  for (size_t i = 0; i < in_meta.size(); ++i) {
    const SlotMeta& m = in_meta[i];
    Slot* r = fits && i < replica_.size() ? &replica_[i] : nullptr;
    static const BufferPtr none;
    if (in_state && m.n > 0) {
      into(r ? r->shard : none, m.n * m.elem);
      if (m.flags & kMaster) into(r ? r->master : none, m.n * sizeof(float));
      if (m.flags & kState1) into(r ? r->state1 : none, m.n * m.state_esize);
      if (m.flags & kState2) into(r ? r->state2 : none, m.n * m.state_esize);
    }
    if (m.flags & kPushed) into(r ? r->grad : none, m.n * sizeof(float));
  }
  // The source's blob, whether or not the rest fits: kept only if the step
  // commits (after_norm).
  blob_in_.has = in_header.blob > 0;
  blob_in_.step = in_header.step + 1;
  blob_in_.bytes = blob_in_.has ? in_header.blob - 1 : 0;
  if (blob_in_.bytes > 0) {
    if (!blob_in_.buf || blob_in_.buf->bytes() < blob_in_.bytes) blob_in_.buf = alloc(blob_in_.bytes);
    recvs.push_back({blob_in_.buf->data(), blob_in_.bytes});
  }

  // ---- round 3, the state (a seed) and the gradients, one message per buffer
  group_->run("peer copy", [&](Communicator& c) { c.exchange(at(holder_), sends, at(source_), recvs); });
  shards.clear();
  for (const ExchangeRecv& r : recvs) copy_bytes_ += r.bytes;
  copy_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  note_holder_has(mine);

  received_state_ = in_state;
  writing_state_ = false;
  if (fits && in_state) {
    for (size_t i = 0; i < in_meta.size(); ++i) {
      replica_[i].updates = in_meta[i].updates;
      replica_[i].master_stale = (in_meta[i].flags & kMasterStale) != 0;
    }
    replica_step_ = in_header.step;
    replica_seeded_ = true;
  }
  received_ = fits && replica_seeded_ && in_header.step == replica_step_;
  if (received_ && drop_rank_ == ctx_.ranks().rank && in_header.step + 1 == drop_step_) {
    drop_rank_ = -1;  // once
    received_ = false;
    failure_ = "dropped by ZS_HEAL_DROP_COPY";
  }
  if (received_)
    for (size_t i = 0; i < in_meta.size(); ++i) replica_[i].pushed = (in_meta[i].flags & kPushed) != 0;
  return received_ ? 1.0f : 0.0f;
}

void PeerCopy::after_norm(float commits, bool skipped, double grad_scale) {
  ctx_.expect_locked();
  const int world = group_->size();
  if (commits != static_cast<float>(world)) {
    seeded_ = false;  // what the holder has is unknown: seed it again
    // A lost gradient copy leaves the replica as it was (the gradients have
    // their own buffers); a lost seed may have overwritten part of it.
    if (!received_ && received_state_) replica_seeded_ = false;
    fail(Code::InvalidState, "optimizer step ", opt_.steps_locked() + 1, " did not commit: ",
         world - static_cast<int>(commits), " of ", world, " ranks' gradient copies did not land whole with "
         "their holders (zeroshard.healing.peer_copy; this rank's from rank ", source_, " ",
         received_ ? "did" : "did not", failure_.empty() ? "" : ": " + failure_, "); nothing was updated");
  }
  if (skipped || !received_) return;
  std::swap(blob_, blob_in_);  // the replica is about to take this step: so is its blob
  // SGD momentum switched on after the state was made starts now, from this
  // gradient, as in Optimizer::update; allocated here, under the hold.
  std::vector<Hparams> hps(opt_.num_groups());
  for (size_t g = 0; g < hps.size(); ++g) hps[g] = opt_.hparams(g);
  const OptimKind kind = opt_.kind();
  for (Slot& r : replica_) {
    r.sgd_first_momentum = false;
    if (kind == OptimKind::Sgd && r.pushed && r.n > 0 && hps.at(r.group).momentum > 0.0 && !r.state1) {
      r.state1 = alloc(r.n * dtype_size(r.state_dtype));
      std::memset(r.state1->data(), 0, r.state1->bytes());
      r.sgd_first_momentum = true;
    }
  }
  const auto scale = static_cast<float>(grad_scale);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = [this, scale, hps = std::move(hps), kind] {
      fault_point("replay");  // on this worker, as the next forward begins on the caller's thread
      const auto began = std::chrono::steady_clock::now();
      Device& dev = *ctx_.device();
      for (Slot& r : replica_) {
        if (!r.pushed || r.n == 0) continue;
        ShardBuffers b;
        b.dtype = r.dtype;
        b.state1 = r.state1 ? r.state1->data() : nullptr;
        b.state2 = r.state2 ? r.state2->data() : nullptr;
        b.state_dtype = r.state_dtype;
        if (r.master_is_working) {
          b.working = r.shard->data();
        } else if (r.master_is_shard) {
          b.master = static_cast<float*>(r.shard->data());
        } else {
          b.master = static_cast<float*>(r.master->data());
          b.working = r.shard->data();
          if (r.master_stale) {  // as Optimizer::fp32_master
            ops::refresh_master(dev, r.shard->data(), r.dtype, b.master, r.n);
            r.master_stale = false;
          }
        }
        step_shard(dev, kind, hps.at(r.group), b, static_cast<const float*>(r.grad->data()), r.n, scale, r.updates,
                   r.updates == 0 || r.sgd_first_momentum);
        ++r.updates;
      }
      dev.synchronize();
      ++replica_step_;
      replay_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    };
    busy_ = true;
  }
  cv_.notify_all();
}

int64_t PeerCopy::hand_over(const std::vector<int>& lost) {
  ctx_.expect_locked();
  wait_replay();
  // Every rank runs both rounds on the heal group (its collectives must
  // match on every member), with no message where it neither sends nor
  // receives.
  const int me = ctx_.ranks().rank;
  const bool receiving = std::binary_search(lost.begin(), lost.end(), me);
  const bool sending = std::binary_search(lost.begin(), lost.end(), source_);
  const std::vector<Optimizer::SlotState> mine = slots_locked();
  if (sending && !replica_seeded_)
    fail(Code::StateLost, "rank ", me, " holds no replica of rank ", source_, "'s state (it was never seeded, or "
         "a seed was cut short): the replacement cannot receive it; resume from the last disk checkpoint");
  Header out_h, in_h;
  std::vector<SlotMeta> out_meta, in_meta(receiving ? mine.size() : 0);
  std::vector<ExchangeSend> sends;
  if (sending) {
    out_h.with_state = 1;
    out_h.slots = static_cast<uint32_t>(replica_.size());
    out_h.step = replica_step_;
    out_meta.resize(replica_.size());
    for (size_t i = 0; i < replica_.size(); ++i) {
      const Slot& r = replica_[i];
      SlotMeta& m = out_meta[i];
      m.n = r.n;
      m.elem = static_cast<uint32_t>(dtype_size(r.dtype));
      m.updates = r.updates;
      m.state_esize = static_cast<uint16_t>(dtype_size(r.state_dtype));
      m.dtype = static_cast<uint16_t>(r.dtype);
      m.group = static_cast<uint32_t>(r.group);
      m.flags = (r.master ? kMaster : 0) | (r.state1 ? kState1 : 0) | (r.state2 ? kState2 : 0) |
                (r.master_stale ? kMasterStale : 0);
      for (const BufferPtr* b : {&r.shard, &r.master, &r.state1, &r.state2})
        if (*b && r.n > 0) sends.push_back({(*b)->data(), (*b)->bytes()});
    }
    // The source's blob at the replica's step, last (none when the trainer
    // set none for that step).
    if (blob_.has && blob_.step == replica_step_) {
      out_h.blob = blob_.bytes + 1;
      if (blob_.bytes > 0) sends.push_back({blob_.buf->data(), blob_.bytes});
    }
  }
  const int to = at(sending ? source_ : me), from = at(receiving ? holder_ : me);
  // A replacement whose holder is lost before its state has come: no copy
  // of that state is left anywhere (its source was lost before), so the
  // heal is impossible, and said so by name (ZS_EXIT_STATE_LOST: zsrun
  // restarts the job from disk) rather than as one more lost rank.
  const auto run = [&](const char* what, const std::function<void(Communicator&)>& fn) {
    try {
      group_->run(what, fn);
    } catch (const Error& e) {
      const std::vector<int> gone = ctx_.lost_ranks();
      if (!receiving || e.code() != Code::RankLost || std::find(gone.begin(), gone.end(), holder_) == gone.end())
        throw;
      fail(Code::StateLost, "rank ", me, "'s shard state is lost: rank ", holder_, ", which held its copy, was lost "
           "while handing it over to this replacement (", e.what(), "); resume from the last disk checkpoint");
    }
  };
  std::vector<ExchangeSend> head_sends;
  std::vector<ExchangeRecv> head_recvs;
  if (sending) head_sends = {{&out_h, sizeof out_h}, {out_meta.data(), out_meta.size() * sizeof(SlotMeta)}};
  if (receiving) head_recvs = {{&in_h, sizeof in_h}, {in_meta.data(), in_meta.size() * sizeof(SlotMeta)}};
  run("heal hand-over header", [&](Communicator& c) { c.exchange(to, head_sends, from, head_recvs); });

  // A replacement's buffers take its state straight from the wire; what
  // does not fit is received and dropped, then named.
  std::string misfit;
  if (receiving && (in_h.magic != kMagic || in_h.slots != mine.size()))
    misfit = "the replica has " + std::to_string(in_h.slots) + " params where this rank's optimizer has " +
             std::to_string(mine.size());
  std::vector<ShardAccess> shards;
  std::vector<ExchangeRecv> recvs;
  std::vector<std::vector<char>> spill;
  spill.reserve(in_meta.size() * 4);
  auto into = [&](void* dst, uint64_t want, uint64_t bytes, const Param& p, const char* what) {
    if (bytes == 0) return;
    if (dst != nullptr && want == bytes) {
      recvs.push_back({dst, bytes});
      return;
    }
    if (misfit.empty())
      misfit = "param '" + p.name + "''s " + what + ": the replica has " + std::to_string(bytes) +
               " bytes where this rank has " + std::to_string(dst ? want : 0);
    spill.emplace_back(bytes);
    recvs.push_back({spill.back().data(), bytes});
  };
  for (size_t i = 0; i < in_meta.size(); ++i) {
    const auto& s = mine[i];
    Param& p = *s.param;
    const SlotMeta& m = in_meta[i];
    if (m.n == 0) continue;
    const uint64_t n = p.layout.shard_numel;
    shards.emplace_back(ctx_, p, ShardAccess::Write);
    into(shards.back().data(), n * p.elem_bytes(), m.n * m.elem, p, "shard");
    const uint64_t st = n * dtype_size(s.state_dtype);
    if (m.flags & kMaster) into(s.master ? s.master->data() : nullptr, n * sizeof(float), m.n * sizeof(float), p, "master");
    if (m.flags & kState1) into(s.state1 ? s.state1->data() : nullptr, st, m.n * m.state_esize, p, "first moment");
    if (m.flags & kState2) into(s.state2 ? s.state2->data() : nullptr, st, m.n * m.state_esize, p, "second moment");
    if (misfit.empty() && (((m.flags & kMaster) != 0) != static_cast<bool>(s.master) ||
                           ((m.flags & kState1) != 0) != static_cast<bool>(s.state1) ||
                           ((m.flags & kState2) != 0) != static_cast<bool>(s.state2)))
      misfit = "param '" + p.name + "': the replica's master and moments are not this rank's optimizer's";
  }
  std::vector<char> blob(receiving && in_h.blob > 0 ? in_h.blob - 1 : 0);
  if (!blob.empty()) recvs.push_back({blob.data(), blob.size()});
  run("heal hand-over", [&](Communicator& c) { c.exchange(to, sends, from, recvs); });
  shards.clear();
  if (!receiving) return -1;
  if (in_h.blob > 0) handed_rank_state(ctx_, std::move(blob));
  if (!misfit.empty())
    fail(Code::InvalidState, "heal: rank ", holder_, "'s replica of this rank's state does not fit its optimizer: ",
         misfit);
  std::vector<int64_t> updates;
  for (size_t i = 0; i < in_meta.size(); ++i)
    if (mine[i].group != kInNoOptimizer) updates.push_back(in_meta[i].updates);
  opt_.restore_counts_locked(in_h.step, updates);
  // The holder's replica is the state just received, bit for bit: no seed
  // at the next step (660 MB a rank on GPT-2 124M over 3 ranks). A state
  // written later still seeds it then.
  note_holder_has(slots_locked());
  return in_h.step;
}

void PeerCopy::note_holder_has(const std::vector<Optimizer::SlotState>& mine) {
  seeded_ = true;
  epoch_sent_ = opt_.state_epoch();
  versions_sent_.resize(mine.size());
  for (size_t i = 0; i < mine.size(); ++i) versions_sent_[i] = mine[i].param->shard_version;
}

Digest PeerCopy::own_digest() {
  ctx_.expect_locked();
  const auto mine = slots_locked();
  std::vector<ShardAccess> shards;
  std::vector<DigestSlot> slots;
  for (const auto& s : mine) {
    Param& p = *s.param;
    DigestSlot d{s.updates, {}};
    const uint64_t n = p.layout.shard_numel;
    if (n > 0) {
      shards.emplace_back(ctx_, p, ShardAccess::Read);
      d.parts.push_back({shards.back().data(), n * p.elem_bytes()});
      if (s.master) d.parts.push_back({s.master->data(), n * sizeof(float)});
      if (s.state1) d.parts.push_back({s.state1->data(), n * dtype_size(s.state_dtype)});
      if (s.state2) d.parts.push_back({s.state2->data(), n * dtype_size(s.state_dtype)});
    }
    slots.push_back(std::move(d));
  }
  return digest_of(ctx_.ranks().rank, opt_.steps_locked(), slots);
}

Digest PeerCopy::replica_digest() {
  ctx_.expect_locked();
  wait_replay();
  if (!replica_seeded_)
    fail(Code::InvalidState, "peer copy: this rank holds no replica of rank ", source_,
         "'s state yet (it is seeded at the first optimizer step)");
  std::vector<DigestSlot> slots;
  for (const Slot& r : replica_) {
    DigestSlot d{r.updates, {}};
    for (const BufferPtr* b : {&r.shard, &r.master, &r.state1, &r.state2})
      if (*b) d.parts.push_back({(*b)->data(), (*b)->bytes()});
    slots.push_back(std::move(d));
  }
  return digest_of(source_, replica_step_, slots);
}

void attach(Context& ctx, Optimizer& opt) {
  if (ctx.config().heal_peer_copy != 1) return;
  const auto held = ctx.lock();
  const char* kind = opt.kind() == OptimKind::Muon ? "ZS_OPTIM_MUON (its update is orthogonalized on an owner "
                                                     "rank, not element-wise on each shard)"
                     : opt.kind() == OptimKind::External ? "ZS_OPTIM_EXTERNAL (the update is the caller's code, "
                                                           "which the holder cannot run)"
                                                         : nullptr;
  if (kind != nullptr && ctx.heal_soft()) {
    // ZS_HEAL=auto: this optimizer keeps no copy; a loss is then healed by
    // a restart from disk, as without healing.
    if (ctx.ranks().rank == 0)
      std::fprintf(stderr, "zeroshard: ZS_HEAL=auto: an optimizer of kind %s keeps no peer copy, so a lost rank "
                   "restarts the job\n", kind);
    return;
  }
  if (kind != nullptr)
    fail(Code::NotSupported, "zeroshard.healing.peer_copy (on) with ", kind, ": the holder of a rank's copy "
         "replays its steps from the gradients, which it cannot for this optimizer; use AdamW, Adam or SGD, or "
         "set zeroshard.healing.peer_copy false");
  opt.set_listener(std::make_unique<PeerCopy>(ctx, opt));
}

PeerCopy& peer_copy_of(Context& ctx, Optimizer& opt) {
  auto* pc = dynamic_cast<PeerCopy*>(opt.listener());
  if (pc == nullptr)
    fail(Code::InvalidState, "this optimizer keeps no peer copy: zeroshard.healing.peer_copy is ",
         ctx.config().heal_peer_copy == 1 ? "on, but the optimizer was made before" : "off (set it true, "
         "or \"auto\" with ZS_HEAL=1)");
  return *pc;
}

std::vector<const Param*> copied_params(Context& ctx) {
  ctx.expect_locked();
  std::vector<const Param*> out;
  if (auto* ordinals = ctx.find_attachment<Ordinals>())
    for (const Optimizer* o : ordinals->optimizers)
      if (auto* pc = dynamic_cast<const PeerCopy*>(o->listener()))
        for (const auto& s : pc->slots_locked()) out.push_back(s.param.get());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

size_t peer_copies(Context& ctx) { return peer_copy_optimizers(ctx).size(); }

std::vector<Optimizer*> peer_copy_optimizers(Context& ctx) {
  ctx.expect_locked();
  auto* ordinals = ctx.find_attachment<Ordinals>();
  return ordinals ? ordinals->optimizers : std::vector<Optimizer*>{};
}

float PeerCopy::grow_vote() { return regrow_vote(ctx_, opt_, ordinal_); }

}  // namespace zs::heal
