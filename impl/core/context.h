// The engine's per-process state for one data-parallel world: who we are,
// the config, the rendezvous store, the groups, and the memory counters.
// Everything mutable here, and in the params, gradients, optimizers and
// attachments of the layers above, is guarded by the engine lock (lock()),
// which those layers' entry points take themselves; the counters are
// atomics (ledger.h). Group threads never take the lock, so holding it
// while waiting on a collective cannot deadlock.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <typeindex>
#include <typeinfo>
#include <utility>
#include <vector>

#include "impl/comm/bootstrap.h"
#include "impl/comm/transport/comm_stats.h"
#include "impl/comm/group.h"
#include "impl/comm/store/store.h"
#include "impl/comm/topology.h"
#include "impl/common/copy_tally.h"
#include "impl/common/trace.h"
#include "impl/config/config.h"
#include "impl/core/engine_lock.h"
#include "impl/core/ledger.h"
#include "impl/device/device.h"

namespace gloo::transport {
class Device;
}

namespace zs {

class Heartbeat;

struct ContextOptions {
  int rank = -1;
  int world_size = -1;
  int local_rank = -1;
  int local_world_size = -1;
  std::string store_host;  // empty: MASTER_ADDR / 127.0.0.1
  int store_port = -1;
  std::string file_store_path;  // non-empty: file rendezvous
  std::string config_json;      // empty: none
  std::string config_path;      // empty: none
  int timeout_ms = 0;           // 0: ZS_TIMEOUT_MS or 300000
  std::string transport_host;   // empty: see resolve_transport_host
  std::string device;           // empty: config "device", ZS_DEVICE, or the GPU of LOCAL_RANK
  std::string backend;          // empty: ZS_BACKEND, or nccl on a GPU where NCCL loads, else gloo
};

// Which library runs a context's collectives between ranks.
enum class Backend { Gloo, Nccl };

// One optimizer step's summary (zs_context_step_stats): what happened
// between the end of the previous step and the end of this one.
struct StepStats {
  int64_t step = 0;
  double step_seconds = 0.0;
  CommTotals comm;  // collectives and waits within the step
  double optimizer_seconds = 0.0;
  // Healing's peer copy (StepListener::step_figures): zs_step_stats's.
  double peer_copy_seconds = 0.0;
  uint64_t peer_copy_bytes = 0;
  double replay_seconds = 0.0;
};

class Context {
 public:
  // Collective over the world; throws Bootstrap, InvalidConfig, Timeout.
  static std::shared_ptr<Context> create(const ContextOptions& options);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  uint64_t id() const { return id_; }
  const RankInfo& ranks() const { return ranks_; }
  // ranks() as the run is now: this rank's position among the world
  // group's members and their count. ranks() until a shrink
  // (docs/healing.md, section 4), after which ranks keep their ids but
  // what is written per rank (checkpoint files, agreements) goes by
  // position among the live ones.
  RankInfo members() const {
    RankInfo r = ranks_;
    r.rank = world()->rank();
    r.world_size = world()->size();
    return r;
  }
  const Config& config() const { return config_; }
  const std::string& config_json() const { return config_json_; }
  const std::string& unused_keys_json() const { return unused_keys_json_; }
  // The written keys the engine accepts but does not act on yet (computed
  // once at create): [{"key": path, "value": value, "reason": text}, ...].
  const std::vector<InactiveKey>& inactive_keys() const { return inactive_keys_; }
  const std::string& inactive_keys_json() const { return inactive_keys_json_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Where this context's shards, gathers, gradients and optimizer state live.
  const std::shared_ptr<Device>& device() const { return device_; }
  Backend backend() const { return backend_; }
  // The median gather unit of the order the last step took, in elements
  // (0 until the coordinator has one): a Linear layer, or a block where a
  // block is one unit, which sizes the reduce buckets where the config
  // leaves them out (the coordinator's windows read its orders' own). Alike on every rank: the ranks agree on the order.
  uint64_t typical_unit() const { return typical_unit_; }
  void set_typical_unit(uint64_t elements) { typical_unit_ = elements; }
  // The least a window fitted to units spans, in bytes: the reduce bucket
  // and the prefetch window (with the live cap that admits it) are never
  // smaller where the config leaves them out. Two units of 72 elements
  // made a 144-element bucket, so a model of 200 tiny Linear layers paid
  // ~200 latency-bound reduce-scatters a step (and every gradient took the
  // direct route, a quarter of the bucket), and its params, when not
  // persistent, one gather per unit; at this floor the whole model's
  // gradient is one bucket. Small beside the units of a model whose
  // buckets matter for memory (a 162M GPT's Linear layers: 2.25-9 MiB).
  static constexpr uint64_t kFittedWindowFloorBytes = uint64_t{4} << 20;
  // The engine lock (engine_lock.h), held while the returned guard lives.
  // Taken once by each engine entry point (register_param, fetch_params,
  // the reducer, the coordinator, the optimizer ...), never by capi/: each
  // object locks what it must. Not recursive: what an entry point calls
  // under its hold checks it (expect_locked) rather than taking it again.
  // Held for a whole optimizer step or blocking fetch; the status queries
  // (memory_snapshot, counters_snapshot, async_error) never take it. `who`
  // names the caller in the error a second take on one thread gets.
  [[nodiscard]] EngineLock::Guard lock(const char* who = __builtin_FUNCTION()) {
    return engine_lock_.take(who);
  }
  // Fails (Code::Internal) unless the calling thread holds the lock.
  void expect_locked(const char* who = __builtin_FUNCTION()) const { engine_lock_.expect_held(who); }
  // Fails (Code::InvalidState) when the calling thread holds the lock: for
  // a call that must refuse before it changes anything (EngineLock).
  void refuse_reentry(const char* who) const { engine_lock_.refuse_reentry(who); }
  bool locked_by_this_thread() const noexcept { return engine_lock_.held_by_this_thread(); }

  // Whether what `group` sends is worth quantizing (ZeRO++ qwZ, qgZ): when
  // it spans hosts, or everywhere with ZS_QUANTIZE_WITHIN_HOST=1. Traffic
  // within a host moves at memory speed; quantizing it only loses precision.
  bool quantizes(const Group& group) const;

  // The groups (comm/topology.h): the world, and what the config cuts.
  const Topology& topology() const { return *topology_; }
  const std::shared_ptr<Group>& world() const { return topology_->world(); }
  // The rendezvous store (null in a world of one): for agreements that must
  // name a rank that never answered (checkpoint commit), which a timed-out
  // collective cannot.
  const std::shared_ptr<Store>& store() const { return store_; }
  // Whether rank 0 serves that store (a TCP store, unless
  // ZS_STORE_SERVER=external): its loss takes the store.
  bool store_served_by_rank0() const { return tcp_store_ && !external_store_; }
  const std::shared_ptr<Group>& partition_group() const { return topology_->partition(); }
  const std::shared_ptr<Group>& mics_shard_group() const { return topology_->mics_shard(); }
  const std::shared_ptr<Group>& mics_replica_group() const { return topology_->mics_replica(); }
  const std::shared_ptr<Group>& hpz_group() const { return topology_->hpz(); }
  // MiCS hierarchical gather: same local rank across nodes, and one node,
  // both within this rank's shard group (null unless configured).
  const std::shared_ptr<Group>& mics_inter_group() const { return topology_->mics_inter(); }
  const std::shared_ptr<Group>& mics_intra_group() const { return topology_->mics_intra(); }
  // qgZ across nodes: this rank's node, and the ranks at its local position
  // on every node (null unless zero_quantized_gradients spans several whole
  // nodes of LOCAL_WORLD_SIZE ranks without MiCS).
  const std::shared_ptr<Group>& qgz_intra_group() const { return topology_->qgz_intra(); }
  const std::shared_ptr<Group>& qgz_inter_group() const { return topology_->qgz_inter(); }
  // zeroshard.healing.peer_copy on: the heal layer's group (null when off).
  const std::shared_ptr<Group>& heal_group() const { return topology_->heal(); }

  // A sub-group of world ranks; collective over the world (every rank
  // calls with the same list, in the same order of calls).
  std::shared_ptr<Group> create_group(const std::vector<int>& ranks);

  // Why a world rank in `ranks` (all when empty) counts as stopped: it has
  // sent no heartbeat for longer than the limit. "" otherwise, and with
  // heartbeats off. For waits outside collectives (store agreements).
  std::string silence(std::vector<int> ranks = {}) const;

  // Background failures: the first one is kept and refused from then on,
  // except that a lost rank (RankLost) replaces a Comm or Timeout error it
  // caused, and a lost state (StateLost) any of those three, or the
  // InvalidState of a heal's verdict it ends (a regrow cut short by a loss:
  // the state laid out for neither world is what the trainer acts on).
  void record_async_error(Code code, const std::string& message);

  // Healing on (zeroshard.healing.peer_copy) with heartbeats: the world
  // ranks found lost so far, ascending, and the sentence that named them
  // ("rank 2 is lost: ..."); empty while none is. On a loss (the
  // heartbeat's loss subscription) the context's heal thread records
  // RankLost, aborts every group (Group::abort) and interrupts the store
  // call in flight; a collective that failed otherwise (a pair closed by
  // the dead rank, or by a survivor that failed before) waits up to
  // loss_grace() for the heartbeat's verdict, and is RankLost naming the
  // rank when one comes.
  bool heals() const { return heals_.load(); }
  // Healing: a Comm or Timeout failure (`code`, `message`) that a lost rank
  // caused, a collective's or a store wait's outside groups (a checkpoint
  // save), is that loss once the heartbeat names it within loss_grace():
  // `code` becomes RankLost, recorded as the context's error, and `note`
  // the sentence naming the rank to append (empty when `message` has it).
  // False, all unchanged, otherwise.
  bool as_loss(Code& code, const std::string& message, std::string* note);
  // Healing: when the peers took this process for lost and healed without
  // it (the store counts a loss of its incarnation), it says so and ends
  // itself with SIGKILL (docs/healing.md, section 2: fencing). Else returns.
  void end_if_fenced();
  std::vector<int> lost_ranks(std::string* why = nullptr) const;
  // Waits up to `within` for a loss; returns lost_ranks().
  std::vector<int> await_loss(std::chrono::milliseconds within, std::string* why = nullptr) const;
  std::chrono::milliseconds loss_grace() const;
  // Waits up to `within` for a loss beyond `known` (any, when empty) and
  // for the heal thread to have acted on every loss known (so that its
  // store interrupt is behind the caller's next store call); returns
  // lost_ranks().
  std::vector<int> settle_loss(std::chrono::milliseconds within, std::string* why = nullptr,
                               const std::vector<int>& known = {}) const;

  // Healing generations (docs/healing.md, section 3). Every rendezvous key
  // of a generation lives under key_prefix(): "zs/" for the first (0),
  // "zs/gen<g>/" after g heals, so a replacement's keys never meet a lost
  // rank's. A replacement (ZS_HEAL_REPLACEMENT=<n>: the n-th process
  // started for its rank id) reads its generation from the store at
  // create, connects its groups there while the survivors regroup, skips
  // the ready round (its config is compared at zs_heal_join) and, until
  // its join ends (end_replacing), registers params without collectives
  // or disk reads.
  int64_t generation() const { return generation_; }
  std::string key_prefix() const { return key_prefix_of(generation_); }
  static std::string key_prefix_of(int64_t generation);
  // Where generation g's survivors say whether they wait for the
  // replacements or shrink without them (healing.replacement_wait_s,
  // impl/heal/replacement_wait.h): "join" or "shrink".
  static std::string heal_decision_key(int64_t generation);
  bool replacing() const { return replacing_.load(); }
  // Healing on through ZS_HEAL=auto (zsrun --restarts): what it cannot
  // copy turns it off for that part with a note, instead of a refusal.
  bool heal_soft() const { return heal_soft_; }
  void end_replacing() { replacing_.store(false); }
  // A survivor, after the agreement, under no hold: generation g + 1 for
  // the replacements of `lost` (world ranks). Posts for each lost rank the
  // generation its next replacement joins (zs/heal/rank<r>/loss<n>, by the
  // lowest survivor), republishes this rank's heartbeat address there,
  // waits for each replacement's (the store's timeout bounds it) and
  // readmits it (Heartbeat::readmit), forgets the loss and its RankLost
  // error, then reconnects every group in the new generation
  // (Group::reconnect), a rendezvous the replacements' create joins.
  void regroup(const std::vector<int>& lost);
  // A survivor of a loss no replacement takes (docs/healing.md, section
  // 4), after the agreement, under no hold: generation g + 1 over the live
  // ranks less `lost` (world ranks). Checked first (MiCS, hpZ and qgZ's
  // hierarchy refused by their keys, nothing changed). The lowest survivor
  // counts each loss in the store (so a lost process that comes back
  // fences itself) and names the lost there; the heartbeat drops them; the
  // loss and its RankLost error are forgotten; then the world and heal
  // groups reconnect in place over the live ranks (Topology::shrink), a
  // rendezvous of the survivors. Ranks keep their ids. What was laid out
  // by the old world's size (shards, optimizer state, peer copies) is the
  // heal layer's to lay out again (impl/heal/shrink.cpp).
  void shrink(const std::vector<int>& lost);
  // A regrow (docs/healing.md, section 4), on a survivor after the step
  // whose all-reduce voted for it, under no hold: generation g + 1 over the
  // live ranks and `joined` (world ranks a shrink left out, each with a
  // process started with ZS_HEAL_JOIN=grow). Republishes this rank's
  // heartbeat address there, readmits each joiner once its address is
  // posted (the store's timeout bounds the wait), lays the beats out
  // again, then reconnects the world and heal groups over the grown live
  // list (Topology::regrow), a rendezvous the joiners' create joins.
  void regrow(const std::vector<int>& joined);
  // On the lowest survivor, before regrow(): the joiners of `joined` that
  // have not claimed their arrival in generation g + 1 (arrival_key) after
  // `wait` (an admitted joiner claims it milliseconds after its answer,
  // its heartbeat address posted; one that died while it waited never
  // will, one stopped or starved meanwhile claims too late). Each arrival
  // is claimed once, by the joiner or by this rank at the deadline, so
  // both sides agree on it. Each one missing is counted as a loss of its
  // rank again, marked "shrunk" (the next process for it asks as that
  // loss's), before this returns.
  std::vector<int> missing_joiners(const std::vector<int>& joined, std::chrono::milliseconds wait);
  // Where joiner `rank`, process number `incarnation` (its rank's losses
  // when admitted), claims its arrival into generation `generation`.
  static std::string arrival_key(int64_t generation, int rank, int64_t incarnation);
  // A process started with ZS_HEAL_JOIN=grow and ZS_HEAL_REPLACEMENT=n for
  // a rank the survivors shrank without, admitted into a regrow: it asks at
  // create (zs/heal/grow/request<k>), waits for the survivors' answer
  // under regrow_admission_key(rank, n) (the generation it joins, "ended"
  // when they finished first, or "refused: <why>"), and its zs_heal_join
  // receives its shard of the state laid out over the grown world
  // (impl/heal/regrow.h).
  bool growing() const { return growing_; }
  static std::string regrow_admission_key(int rank, int64_t incarnation);
  static constexpr const char* kRegrowRequests = "zs/heal/grow/requests";
  static constexpr const char* kRegrowEnded = "zs/heal/grow/ended";  // the survivors' run is over
  static std::string regrow_request_key(int64_t k);
  // How many times world rank r was lost so far (its next process's
  // ZS_HEAL_REPLACEMENT number).
  int64_t losses_of(int rank);
  // The lowest survivor's record of a loss in the store, once per
  // generation (g + 1): counts each loss (a lost process that comes back
  // fences itself by that count), posts where each lost rank's next
  // replacement finds its generation (g + 1, or "shrunk" when none is
  // taken), names the lost under the new generation's prefix, and fences
  // each lost process on this host. Called again for the same generation,
  // it only rewrites what the replacements read (a deadline passed:
  // impl/heal/replacement_wait.cpp).
  void post_losses(const std::vector<int>& lost, bool shrunk);

  // Runs fn, a rendezvous of `ranks` (world ranks) through the store (a
  // group's connect, the ready round, the heal agreement), so that a member
  // that is stopped or dead ends it within the heartbeat limit with
  // Code::Comm naming that rank, instead of at the store's timeout; `what`
  // says what was cut short. Without heartbeats fn runs as is (its store
  // timeout bounds it).
  void rendezvous_with(const std::vector<int>& ranks, const std::string& what,
                       const std::function<void()>& fn);
  // Throws the recorded async error, if any.
  void check_async_error() const;
  bool async_error(Code* code, std::string* message) const;

  // Per-context state of a layer above core/ (the gradient reducer in
  // grad/, the fetch coordinator and the hpZ secondary shards in fetch/),
  // kept here without core/ naming its type: attachment<T>() creates a T
  // from this context on first use, find_attachment<T>() gives null until
  // then, each_attachment<I>() visits those that implement I, newest first.
  // The list has its own lock, so a status query finds the coordinator
  // without the engine lock. Destroyed with the context, newest first,
  // before its groups shut down; constructors must not take the engine lock.
  class Attachment {
   public:
    virtual ~Attachment() = default;
  };
  template <class T>
  T* find_attachment() {
    std::lock_guard<std::mutex> held(attachments_mu_);
    return static_cast<T*>(find_locked(std::type_index(typeid(T))));
  }
  template <class T>
  T& attachment() {
    std::lock_guard<std::mutex> held(attachments_mu_);
    if (Attachment* a = find_locked(std::type_index(typeid(T)))) return static_cast<T&>(*a);
    attachments_.emplace_back(std::type_index(typeid(T)), std::make_unique<T>(*this));
    return static_cast<T&>(*attachments_.back().second);
  }
  // fn runs without the list's lock (it may take the engine lock, under
  // which others create attachments); none is removed before ~Context.
  template <class I, class Fn>
  void each_attachment(Fn&& fn) {
    std::vector<I*> found;
    {
      std::lock_guard<std::mutex> held(attachments_mu_);
      for (auto a = attachments_.rbegin(); a != attachments_.rend(); ++a)
        if (auto* i = dynamic_cast<I*>(a->second.get())) found.push_back(i);
    }
    for (I* i : found) fn(*i);
  }

  // Time and bytes of every collective of this context's groups (atomics),
  // and the ZS_TRACE timeline (null when not asked for).
  const std::shared_ptr<CommStats>& comm_stats() const { return comm_stats_; }
  const std::shared_ptr<Trace>& trace() const { return trace_; }
  // The last optimizer step's summary; read without the engine lock.
  void record_step(const StepStats& s) {
    std::lock_guard<std::mutex> held(step_mu_);
    last_step_ = s;
  }
  StepStats last_step() const {
    std::lock_guard<std::mutex> held(step_mu_);
    return last_step_;
  }
  // The engine's copies (copy_tally.h, process-wide) as this context sees
  // them: since it was created, and between its last two optimizer step
  // ends (from its creation before its first; zeros before that). The
  // optimizer calls note_step_copies as a step ends, after the gradients
  // were freed and persistent params sent out: a span brackets one
  // forward, backward and step. Read without the engine lock.
  void note_step_copies() {
    const auto now = copy_tally::snapshot();
    std::lock_guard<std::mutex> held(step_mu_);
    copies_before_step_ = copies_at_step_;
    copies_at_step_ = now;
    stepped_ = true;
  }
  copy_tally::Snapshot copies_since_start() const {
    const auto now = copy_tally::snapshot();
    std::lock_guard<std::mutex> held(step_mu_);
    return difference(now, copies_at_start_);
  }
  copy_tally::Snapshot copies_last_step() const {
    std::lock_guard<std::mutex> held(step_mu_);
    return stepped_ ? difference(copies_at_step_, copies_before_step_) : copy_tally::Snapshot{};
  }

  // Memory and fetch counters: atomics, read without the engine lock.
  Ledger& ledger() { return ledger_; }
  MemoryStats memory_snapshot() const { return ledger_.memory(); }
  FetchCounters counters_snapshot() const { return ledger_.fetches(); }

 private:
  Context() = default;
  void connect(const ContextOptions& options);
  void choose_device(const ContextOptions& options);
  void agree_on_backend();
  void check_store_is_fresh(const ContextOptions& options);
  void wait_for_every_rank();
  // The environment variables every rank must agree on, as "NAME=value ..."
  // (posted in the ready round), and which of rank 0's (mine) another
  // rank's (theirs) differs from, each as "environment NAME=theirs (rank 0: mine)".
  std::string ready_environment() const;
  static std::vector<std::string> environment_differences(const std::string& theirs,
                                                          const std::string& mine);
  // Topology's MakeGroup: connects one group over this context's store,
  // transport and heartbeat.
  std::shared_ptr<Group> make_group(const std::string& name, int id, const std::vector<int>& ranks);
  // A member's communicator for group `id` (my: this rank's index in
  // ranks), connected in the current generation: make_group's and
  // regroup's.
  std::unique_ptr<Communicator> make_communicator(const std::string& name, int id, const std::vector<int>& ranks,
                                                  int my);
  // A replacement's generation: waits for the key the survivors post.
  void find_generation();
  // A replacement under healing.replacement_wait_s, its heartbeat address
  // posted: waits for the survivors' verdict; fails by name (NotTaken)
  // when they went on without it.
  void await_heal_decision();
  // A joiner (ZS_HEAL_JOIN=grow) whose rank the survivors shrank without:
  // asks to come back and waits for the generation it joins.
  void await_regrow();
  // That joiner, its heartbeat address posted: claims its arrival (see
  // missing_joiners); fails by name (NotTaken) when it came too late.
  void claim_arrival();
  // A shrink's or regrow's reconnect of `group` (id `id`) in place over
  // `members` (world ranks, this one among them).
  void rejoin(Group& group, int id, const std::vector<int>& members);
  // A heal's end (regroup, shrink): the loss and its RankLost error forgotten.
  void forget_losses();
  void finalize_store();
  // Healing: this process's identity in the store, for fence(); and the
  // kill of lost rank r's process (that incarnation's) where it still runs
  // on this host.
  void post_process_identity();
  void fence(int r, int64_t incarnation);
  // Says on stderr why destroy leaves without every rank's goodbye.
  void gave_up_on_goodbyes(const std::string& why) const;
  // Every world rank's host, in rank order (wait_for_every_rank).
  void learn_hosts(const std::vector<std::string>& hosts);
  Attachment* find_locked(std::type_index type);  // caller holds attachments_mu_
  void start_loss_watch();
  void loss_loop();
  std::string departed_note();

  uint64_t id_ = 0;
  RankInfo ranks_;
  Config config_;
  std::string config_json_;
  std::string unused_keys_json_;
  std::vector<InactiveKey> inactive_keys_;
  std::string inactive_keys_json_;
  std::chrono::milliseconds timeout_{300000};
  std::string host_;  // comm/transport/host_id.h
  bool quantize_within_host_ = false;  // ZS_QUANTIZE_WITHIN_HOST
  int full_mesh_max_ = 0;              // ZS_FULL_MESH_MAX (mesh_peers.h), this rank's
  int groups_full_mesh_max_ = 0;       // rank 0's: what every group connects by
  bool tcp_store_ = false;
  std::string store_address_;  // host:port of the TCP store, for messages
  bool store_joined_ = false;  // the store passed check_store_is_fresh
  int64_t generation_ = 0;
  int64_t losses_posted_for_ = 0;  // post_losses: the generation whose losses are counted
  int replacement_ = 0;  // ZS_HEAL_REPLACEMENT
  bool grow_wanted_ = false;  // ZS_HEAL_JOIN=grow
  bool growing_ = false;      // admitted into a regrow (await_regrow)
  std::vector<int> regrow_absent_;  // its world ranks not live in the generation it joins
  bool heal_soft_ = false;  // ZS_HEAL=auto
  bool external_store_ = false;  // ZS_STORE_SERVER=external
  std::atomic<bool> replacing_{false};

  std::shared_ptr<Store> store_;
  std::shared_ptr<gloo::transport::Device> transport_;
  std::shared_ptr<Heartbeat> heartbeat_;  // null in a world of one or with ZS_HEARTBEAT_MS=0
  // Its watch on rank 0, which serves the store (a Heartbeat::Subscription).
  std::shared_ptr<void> store_server_watch_;
  std::shared_ptr<Device> device_;
  Backend backend_ = Backend::Gloo;
  std::atomic<uint64_t> typical_unit_{0};
  bool nccl_for_one_ = false;  // NCCL named explicitly: groups of one use it too
  bool backend_defaulted_ = false;  // neither the options nor ZS_BACKEND named one
  bool stage_all_ = false;  // ZS_STAGE_ALL=1: the staging path on any device (tests)
  std::unique_ptr<Topology> topology_;

  // The loss subscription and the heal thread it wakes (healing on).
  std::shared_ptr<void> loss_sub_;
  std::atomic<bool> heals_{false};
  mutable std::mutex loss_mu_;
  mutable std::condition_variable loss_cv_;
  std::vector<int> lost_;          // under loss_mu_
  std::string lost_why_;           // under loss_mu_
  std::vector<int> lost_handled_;  // under loss_mu_: what the heal thread acts on
  std::vector<int> lost_acted_;    // under loss_mu_: what it has acted on
  bool loss_stop_ = false;         // under loss_mu_
  std::thread loss_thread_;

  mutable std::mutex error_mu_;
  Code async_code_ = Code::Ok;
  std::string async_message_;

  EngineLock engine_lock_;
  Ledger ledger_;
  std::shared_ptr<CommStats> comm_stats_ = std::make_shared<CommStats>();
  std::shared_ptr<Trace> trace_;
  mutable std::mutex step_mu_;
  StepStats last_step_;
  static copy_tally::Snapshot difference(const copy_tally::Snapshot& later,
                                         const copy_tally::Snapshot& earlier) {
    copy_tally::Snapshot d;
    for (int k = 0; k < kCopyKinds; ++k) d.bytes[k] = later.bytes[k] - earlier.bytes[k];
    return d;
  }
  copy_tally::Snapshot copies_at_start_ = copy_tally::snapshot();
  copy_tally::Snapshot copies_at_step_ = copies_at_start_, copies_before_step_ = copies_at_start_;
  bool stepped_ = false;
  std::mutex attachments_mu_;
  std::vector<std::pair<std::type_index, std::unique_ptr<Attachment>>> attachments_;
};

}  // namespace zs
