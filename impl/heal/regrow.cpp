#include "impl/heal/regrow.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "impl/common/error.h"
#include "impl/common/fault_point.h"
#include "impl/heal/peer_copy.h"
#include "impl/heal/relayout.h"
#include "impl/heal/store_text.h"
#include "impl/heal/trainer_state.h"

namespace zs::heal {
namespace {

std::vector<int64_t> parse_numbers(const std::string& s) {
  std::vector<int64_t> out;
  std::istringstream in(s);
  for (int64_t v; in >> v;) out.push_back(v);
  return out;
}

std::vector<int> left_out(Context& ctx) {
  const std::vector<int> live = ctx.topology().live();
  std::vector<int> out;
  for (int r = 0, i = 0; r < ctx.ranks().world_size; ++r) {
    if (static_cast<size_t>(i) < live.size() && live[static_cast<size_t>(i)] == r) ++i;
    else out.push_back(r);
  }
  return out;
}

// The lowest live rank's view of the requests to come back.
struct Requests final : Context::Attachment {
  explicit Requests(Context& c) : ctx(c) {}
  // Reads the requests posted since the last read: a valid one (a rank
  // left out, asking as its next process) is pending; another is refused
  // by name under its admission key.
  void read(const std::vector<int>& out) {
    Store& store = *ctx.store();
    const int64_t n = store.add(Context::kRegrowRequests, 0);
    for (; seen < n; ++seen) {
      std::istringstream in(text(store.get(Context::regrow_request_key(seen + 1))));
      int r = -1;
      int64_t incarnation = -1;
      if (!(in >> r >> incarnation)) continue;
      std::string why;
      const int64_t losses = std::binary_search(out.begin(), out.end(), r) ? ctx.losses_of(r) : -1;
      if (losses < 0)
        why = "rank " + std::to_string(r) + " is live, or not a rank of this world of " +
              std::to_string(ctx.ranks().world_size) + ": only a rank a shrink left out comes back";
      else if (incarnation != losses)
        why = "ZS_HEAL_REPLACEMENT=" + std::to_string(incarnation) + " for rank " + std::to_string(r) + ", which was "
              "lost " + std::to_string(losses) + " time(s): the process that comes back for it is number " +
              std::to_string(losses);
      if (why.empty()) pending[r] = incarnation;
      else store.set(Context::regrow_admission_key(r, incarnation), bytes("refused: " + why));
    }
  }
  // A joiner still waiting when this context ends learns it: one that asks
  // from now on by the mark, one that asked before by its answer.
  ~Requests() override {
    try {
      const std::vector<int> out = left_out(ctx);
      if (out.empty() || ctx.topology().live().front() != ctx.ranks().rank) return;
      ctx.store()->set(Context::kRegrowEnded, bytes("1"));
      read(out);
      for (const auto& [r, incarnation] : pending)
        ctx.store()->set(Context::regrow_admission_key(r, incarnation), bytes("ended"));
    } catch (const std::exception&) {
      // No store to tell it: its wait ends at the store's timeout.
    }
  }
  // Refuses every pending request by name (under its admission key).
  void refuse(const std::string& why) {
    for (const auto& [r, incarnation] : pending)
      ctx.store()->set(Context::regrow_admission_key(r, incarnation), bytes("refused: " + why));
    pending.clear();
  }
  Context& ctx;
  int64_t seen = 0;                 // requests read so far
  std::map<int, int64_t> pending;  // rank left out -> the incarnation asking
  int waited = 0;  // the first optimizer's steps since a request came, none ending an iteration
};

// How many of the first optimizer's steps a request waits for one that
// ends an iteration: every loop that steps each optimizer once an
// iteration has one within one iteration; past that, one never comes.
constexpr int kStepsToWait = 3;

// Empty when the world may grow back after opt's step `step` (about to
// commit), else why not. A joiner's program begins an iteration after its
// joins, so the survivors must stand at one too: every optimizer keeping a
// peer copy at the same step count. In a loop that steps each optimizer
// once an iteration that is the last optimizer's step, whatever the order
// (a GAN's discriminator first or second); with one optimizer, every step.
// A gradient pushed since an optimizer's step (a GAN's generator loss
// reaching the discriminator, which its zero_grad drops next) is dropped
// by the regrow, as a checkpoint saved there would not carry it
// (pending_note).
std::string not_an_iteration_end(Context& ctx, const Optimizer& opt, int64_t step) {
  const std::vector<Optimizer*> all = peer_copy_optimizers(ctx);
  const auto name = [&](const Optimizer* o) {
    const size_t i = static_cast<size_t>(std::find(all.begin(), all.end(), o) - all.begin());
    return "optimizer " + std::to_string(i + 1) + " of " + std::to_string(all.size());
  };
  for (const Optimizer* o : all)
    if (o != &opt && o->steps_locked() != step)
      return name(&opt) + " took step " + std::to_string(step) + " while " + name(o) + " stood at step " +
             std::to_string(o->steps_locked());
  return {};
}

// Under the hold, after the vote's step: the params of `all` with a
// gradient pushed since their step, which the regrow drops; empty if none.
std::string pending_note(const std::vector<Optimizer*>& all) {
  std::string names;
  size_t n = 0;
  for (const Optimizer* o : all)
    for (size_t g = 0; g < o->num_groups(); ++g)
      for (const auto& p : o->group_params(g))
        if (p->grad_pushed && n++ < 3) names += (names.empty() ? "" : ", ") + p->describe();
  if (n == 0) return {};
  return std::to_string(n) + " param(s) (" + names + (n > 3 ? ", ..." : "") + ") had a gradient pushed since "
         "their optimizer's step; the regrow drops it, as a checkpoint saved there would not carry it (a GAN's "
         "zero_grad drops it next anyway)";
}

// A regrow cut short (a rank lost in it: a survivor, or the joiner) leaves
// the state laid out for neither world on some ranks: every rank that sees
// it fails the context with StateLost by name, so the trainer falls back
// to a disk checkpoint (exit ZS_EXIT_STATE_LOST) instead of healing from
// copies that no longer fit.
template <typename Fn>
void cut_short_is_state_lost(Context& ctx, const std::vector<int>& joined, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = "the regrow (rank(s) " + list(joined) + " coming back) was cut short: " + e.what() +
                            "; the state is laid out for neither world: resume from the last disk checkpoint";
    ctx.record_async_error(Code::StateLost, msg);
    fail(Code::StateLost, msg);
  }
}

std::string key_of(const std::string& prefix, int ordinal, const char* what) {
  return prefix + "grow/opt" + std::to_string(ordinal) + "/" + what;
}

// How long the lowest survivor waits for an admitted joiner's arrival: it
// is claimed milliseconds after the answer, so this only bounds the wait
// for one that died after it asked, or was stopped or starved.
std::chrono::milliseconds arrival_wait(Context& ctx) {
  return std::max(std::chrono::milliseconds(10000), 4 * ctx.loss_grace());
}

std::string next_incarnations(Context& ctx, const std::vector<int>& ranks) {
  std::string out;
  for (const int r : ranks) out += (out.empty() ? "" : " ") + std::to_string(ctx.losses_of(r));
  return out;
}

// Which admitted joiners never came (Context::missing_joiners), alike on
// every survivor: the lowest waits and posts it under the vote's step, the
// others read it. None missing: the regrow goes on; else the survivors go
// on as they are, and none waited for the store's timeout.
std::vector<int> agree_on_missing_joiners(Context& ctx, Store& store, const std::string& prefix, int64_t step,
                                          int lowest, const std::vector<int>& joined) {
  const std::string key = prefix + "missing@" + std::to_string(step);
  try {
    if (ctx.ranks().rank == lowest) {
      const std::vector<int> missing = ctx.missing_joiners(joined, arrival_wait(ctx));
      store.set(key, bytes(list(missing)));
      return missing;
    }
    std::vector<char> raw;
    ctx.rendezvous_with({lowest}, "the regrow (which joiners came, rank " + std::to_string(lowest) + "'s word)",
                        [&] { raw = store.get(key); });
    return parse_list(text(raw));
  } catch (const Error& e) {
    // The joiners wait in the next generation, which a heal of this loss
    // would make anew: the survivors cannot go on in memory.
    const std::string msg = "the regrow (rank(s) " + list(joined) + " coming back) was cut short before it began: " +
                            e.what() + "; resume from the last disk checkpoint";
    ctx.record_async_error(Code::StateLost, msg);
    fail(Code::StateLost, msg);
  }
}

}  // namespace

void await_joiners(Context& ctx) { ctx.attachment<Requests>(); }

float regrow_vote(Context& ctx, Optimizer& opt, int ordinal) {
  const std::vector<int> out = left_out(ctx);
  if (out.empty() || ctx.topology().live().front() != ctx.ranks().rank) return 0.0f;
  try {
    Store& store = *ctx.store();
    Requests& req = ctx.attachment<Requests>();
    req.read(out);
    if (req.pending.empty()) {
      req.waited = 0;
      return 0.0f;
    }
    const int64_t step = opt.steps_locked() + 1;
    if (const std::string why = not_an_iteration_end(ctx, opt, step); !why.empty()) {
      if (ordinal == 1 && ++req.waited >= kStepsToWait) {
        req.refuse("the survivors train " + std::to_string(peer_copies(ctx)) + " optimizers with peer copies, and "
                   "a regrow in memory takes them all at the end of an iteration: after a step at which each has "
                   "taken as many steps as the others; in " +
                   std::to_string(kStepsToWait) + " of the first optimizer's steps none came (after the last, " +
                   why + "); to train on every rank again, restart the job from a disk checkpoint");
        req.waited = 0;
      }
      return 0.0f;
    }
    req.waited = 0;
    const int64_t g = ctx.generation() + 1;
    std::vector<int> joined, live = ctx.topology().live();
    for (const auto& [r, incarnation] : req.pending) joined.push_back(r);
    live.insert(live.end(), joined.begin(), joined.end());
    std::sort(live.begin(), live.end());
    store.set(Context::key_prefix_of(g) + "heal/grown", bytes(list(joined)));
    store.set(Context::key_prefix_of(g) + "heal/live", bytes(list(live)));
    for (const auto& [r, incarnation] : req.pending)
      store.set(Context::regrow_admission_key(r, incarnation), bytes(std::to_string(g)));
    req.pending.clear();
    std::fprintf(stderr, "zeroshard: rank %d: healing: rank(s) %s came back (ZS_HEAL_JOIN=grow): the world grows back "
                 "to %zu of %d ranks after optimizer step %lld\n", ctx.ranks().rank, list(joined).c_str(), live.size(),
                 ctx.ranks().world_size, static_cast<long long>(step));
    return 1.0f;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zeroshard: rank %d: healing: the requests to grow back could not be read: %s\n",
                 ctx.ranks().rank, e.what());
    return 0.0f;
  }
}

void regrow_after_step(Context& ctx, Optimizer& opt) {
  int64_t step = 0;
  std::vector<Optimizer*> all;  // every optimizer with a peer copy, in the order made
  {
    const auto held = ctx.lock();
    auto* pc = dynamic_cast<PeerCopy*>(opt.listener());
    if (pc == nullptr || !pc->grow_due) return;
    pc->grow_due = false;
    step = opt.steps_locked();
    all = peer_copy_optimizers(ctx);
    if (const std::string note = pending_note(all); !note.empty() && ctx.topology().live().front() == ctx.ranks().rank)
      std::fprintf(stderr, "zeroshard: rank %d: healing: %s\n", ctx.ranks().rank, note.c_str());
  }
  Store& store = *ctx.store();
  const std::string prefix = Context::key_prefix_of(ctx.generation() + 1) + "heal/";
  const std::vector<int> joined = parse_list(text(store.get(prefix + "grown")));
  const std::vector<int> before = ctx.topology().live();
  const auto begin = std::chrono::steady_clock::now();
  const std::vector<int> missing = agree_on_missing_joiners(ctx, store, prefix, step, before.front(), joined);
  if (!missing.empty()) {
    if (ctx.ranks().rank == before.front())
      std::fprintf(stderr, "zeroshard: rank %d: healing: rank(s) %s, admitted back after optimizer step %lld, did not "
                   "arrive within %.1f s (the process died after it asked, or was stopped or starved: if it comes "
                   "later it is told so and exits): "
                   "the world stays at %zu of %d ranks, and a new process for the rank may ask again "
                   "(ZS_HEAL_REPLACEMENT=%s)\n", ctx.ranks().rank, list(missing).c_str(), static_cast<long long>(step),
                   std::chrono::duration<double>(arrival_wait(ctx)).count(), before.size(), ctx.ranks().world_size,
                   next_incarnations(ctx, missing).c_str());
    return;
  }
  cut_short_is_state_lost(ctx, joined, [&] {
    ctx.regrow(joined);
    // Each optimizer as the joiners' zs_heal_join calls meet it, in the
    // order made: their builds compared, then its state laid out anew.
    for (Optimizer* o : all) {
      int ordinal = 0;
      {
        const auto held = ctx.lock();
        ordinal = peer_copy_of(ctx, *o).ordinal();
      }
      check_builds(ctx, *o, key_of(prefix, ordinal, ""), before.front(), joined, [&] {
        post_shared(ctx, store, key_of(prefix, ordinal, "shared"));
        post_donor(ctx, store, key_of(prefix, ordinal, "donor"), *o, step);
        const auto held = ctx.lock();
        std::string counts = std::to_string(o->steps_locked());
        for (const auto& s : o->slot_states_locked()) counts += " " + std::to_string(s.updates);
        store.set(key_of(prefix, ordinal, "counts"), bytes(counts));
      });
      const auto held = ctx.lock();
      PeerCopy& pc = peer_copy_of(ctx, *o);
      drop_old_world_state(ctx, *o);
      OldLayout old;
      old.members = before;
      old.provider = before;
      relayout(ctx, *o, pc, old);
      pc.place_over(ctx.topology().live());
    }
  });
  if (ctx.ranks().rank == before.front())
    std::fprintf(stderr, "zeroshard: rank %d: healing: the world grew back to %zu of %d ranks in %.3f s (generation "
                 "%lld; the state of %zu optimizer(s) laid out anew in memory)\n", ctx.ranks().rank,
                 ctx.topology().live().size(), ctx.ranks().world_size,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count(),
                 static_cast<long long>(ctx.generation()), all.size());
}

Joined regrow_join(Context& ctx, Optimizer& opt) {
  int ordinal = 0;
  {
    const auto held = ctx.lock();
    ordinal = peer_copy_of(ctx, opt).ordinal();
  }
  Store& store = *ctx.store();
  const std::string prefix = ctx.key_prefix() + "heal/";
  Joined out;
  out.replacement = true;
  out.replaced = parse_list(text(store.get(prefix + "grown")));
  std::vector<int> before;  // the live ranks before the regrow
  for (const int r : ctx.topology().live())
    if (!std::binary_search(out.replaced.begin(), out.replaced.end(), r)) before.push_back(r);
  fault_point("regrow");  // a joiner's, before it describes its build
  check_builds(ctx, opt, key_of(prefix, ordinal, ""), before.front(), out.replaced, [] {});
  cut_short_is_state_lost(ctx, out.replaced, [&] {
    receive_shared(ctx, store, key_of(prefix, ordinal, "shared"));
    receive_donor(ctx, store, key_of(prefix, ordinal, "donor"));
    const std::vector<int64_t> counts = parse_numbers(text(store.get(key_of(prefix, ordinal, "counts"))));
    if (counts.empty()) fail(Code::Internal, "regrow: no step counts posted for the joiner");
    const auto held = ctx.lock();
    PeerCopy& pc = peer_copy_of(ctx, opt);
    drop_old_world_state(ctx, opt);  // nothing yet, should its program have fetched before the join
    OldLayout old;
    old.members = before;
    old.provider = before;
    relayout(ctx, opt, pc, old);
    opt.restore_counts_locked(counts.front(), std::vector<int64_t>(counts.begin() + 1, counts.end()));
    pc.place_over(ctx.topology().live());
    pc.awaiting_state = false;
    ctx.end_replacing();
    out.committed = counts.front();
  });
  out.generation = ctx.generation();
  return out;
}

}  // namespace zs::heal
