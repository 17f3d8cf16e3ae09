#include "impl/heal/join.h"

#include <algorithm>
#include <chrono>
#include <sstream>
#include <string>
#include <thread>

#include "impl/common/error.h"
#include "impl/common/fault_point.h"
#include "impl/fetch/coordinator.h"
#include "impl/fetch/gather.h"
#include "impl/grad/reducer.h"
#include "impl/heal/peer_copy.h"
#include "impl/heal/regrow.h"
#include "impl/heal/replacement_wait.h"
#include "impl/heal/shrink.h"
#include "impl/heal/store_text.h"
#include "impl/heal/trainer_state.h"

namespace zs::heal {
namespace {

// The first line where a replacement's description differs from the
// survivor's, as "theirs where rank <me> has mine".
std::string first_difference(const std::string& theirs, const std::string& mine, int me) {
  std::istringstream a(theirs), b(mine);
  std::string x, y;
  for (;;) {
    const bool more_a = static_cast<bool>(std::getline(a, x));
    const bool more_b = static_cast<bool>(std::getline(b, y));
    if (!more_a && !more_b) return "";
    if (!more_a) return "nothing where rank " + std::to_string(me) + " has '" + y + "'";
    if (!more_b) return "'" + x + "' where rank " + std::to_string(me) + " has nothing";
    if (x != y) return "'" + x + "' where rank " + std::to_string(me) + " has '" + y + "'";
  }
}

}  // namespace

void drop_step_in_flight(Context& ctx, Optimizer& opt) {
  ctx.expect_locked();
  for (const auto& s : opt.slot_states_locked()) release_when_done(ctx, *s.param);
  grads(ctx).reset_for_heal();
}

std::string describe_build(Context& ctx, Optimizer& opt) {
  ctx.expect_locked();
  std::ostringstream os;
  os << "config " << ctx.config_json() << "\n";
  for (const auto& s : opt.slot_states_locked()) {
    const Param& p = *s.param;
    os << "param '" << p.name << "' " << dtype_name(p.dtype) << " [";
    for (size_t i = 0; i < p.shape.size(); ++i) os << (i ? ", " : "") << p.shape[i];
    os << "] in optimizer group " << s.group << "\n";
  }
  // The hyper-parameters a trainer sets at each step (an LR schedule) are
  // not compared: a replacement built with the initial ones takes the
  // survivors' from the trainer's shared state before its first step, and
  // every step's agreement (agreement.cpp) compares them on all ranks.
  static const char* const kScheduled[] = {"lr=", "beta1=", "beta2=", "eps=", "weight_decay=", "momentum=",
                                           "dampening="};
  for (const std::string& t : opt.describe()) {
    const size_t dot = t.find('.');
    const std::string key = dot == std::string::npos ? t : t.substr(dot + 1);
    bool scheduled = false;
    for (const char* k : kScheduled) scheduled = scheduled || key.rfind(k, 0) == 0;
    if (!scheduled) os << "optimizer " << t << "\n";
  }
  return os.str();
}

void check_builds(Context& ctx, Optimizer& opt, const std::string& opt_prefix, int coordinator,
                  const std::vector<int>& newcomers, const std::function<void()>& before_ok) {
  Store& store = *ctx.store();
  const int me = ctx.ranks().rank;
  std::string mine;
  {
    const auto held = ctx.lock();
    mine = describe_build(ctx, opt);
  }
  store.set(opt_prefix + "describe/" + std::to_string(me), bytes(mine));
  if (me == coordinator) {
    std::string verdict = "ok";
    for (const int r : newcomers) {
      std::string theirs;
      try {
        ctx.rendezvous_with({r}, "zs_heal_join (rank " + std::to_string(r) + "'s replacement's description)",
                            [&] { theirs = text(store.get(opt_prefix + "describe/" + std::to_string(r))); });
      } catch (const Error& e) {
        // Lost (or never came): the others wait for this verdict, not for
        // the store's timeout.
        verdict = "rank " + std::to_string(r) + ", coming in, was lost before it described what it built: " +
                  e.what();
        break;
      }
      const std::string diff = first_difference(theirs, mine, me);
      if (!diff.empty()) {
        verdict = "the replacement of rank " + std::to_string(r) + " built another model, optimizer or config than "
                  "the survivors: " + diff + " (a replacement must run the same program with the same config)";
        break;
      }
    }
    if (verdict == "ok") before_ok();  // read after the verdict
    store.set(opt_prefix + "verdict", bytes(verdict));
  }
  std::string verdict;
  ctx.rendezvous_with({coordinator}, "zs_heal_join (rank " + std::to_string(coordinator) + "'s verdict)",
                      [&] { verdict = text(store.get(opt_prefix + "verdict")); });
  if (verdict == "ok") return;
  // Rank 0 serves the store: it stays until every rank has read the
  // verdict, so that each fails with it rather than with the store gone.
  store.add(opt_prefix + "verdict_read", 1);
  if (me == 0 && ctx.store_served_by_rank0()) {
    const auto deadline = std::chrono::steady_clock::now() + ctx.timeout();
    while (store.add(opt_prefix + "verdict_read", 0) < ctx.ranks().world_size &&
           std::chrono::steady_clock::now() < deadline && ctx.silence().empty())
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ctx.record_async_error(Code::InvalidState, verdict);
  fail(Code::InvalidState, verdict);
}

Joined join(Context& ctx, Optimizer& opt) {
  if (!ctx.heals())
    fail(Code::InvalidState, "zs_heal_join needs zeroshard.healing.peer_copy on, with heartbeats");
  const int me = ctx.ranks().rank;
  Joined out;
  int ordinal = 0;
  std::vector<int> lost;
  {
    const auto held = ctx.lock();
    PeerCopy& pc = peer_copy_of(ctx, opt);
    ordinal = pc.ordinal();
    out.replacement = pc.awaiting_state;
    if (!out.replacement) {
      if (!pc.agreed.done)
        fail(Code::InvalidState, "zs_heal_join on a survivor runs after zs_heal_agree (for this optimizer), once a "
             "call failed with ZS_ERR_RANK_LOST; no agreement is pending here");
      lost = pc.agreed.lost;
    }
  }
  if (out.replacement && ctx.growing()) return regrow_join(ctx, opt);  // back after a shrink
  // healing.min_ranks: a loss that leaves that many ranks live shrinks
  // instead, at once or when no replacement came within
  // healing.replacement_wait_s (one verdict per loss, for every optimizer).
  if (!out.replacement && ctx.config().heal_min_ranks > 0 && shrinks_instead(ctx, lost)) return shrink(ctx, opt);
  // Survivors regroup once per loss: at the first optimizer's join, while
  // the context's generation is the one the agreement ran in.
  if (!out.replacement && !ctx.lost_ranks().empty()) ctx.regroup(lost);
  Store& store = *ctx.store();
  const std::string prefix = ctx.key_prefix() + "heal/";
  if (out.replacement) lost = parse_list(text(store.get(prefix + "lost")));
  if (!std::binary_search(lost.begin(), lost.end(), me) && out.replacement)
    fail(Code::Internal, "heal join: replacement of rank ", me, " is not among the ranks the survivors lost");
  int coordinator = -1;
  for (int r = 0; r < ctx.ranks().world_size && coordinator < 0; ++r)
    if (!std::binary_search(lost.begin(), lost.end(), r)) coordinator = r;

  // The replacement must have built what the survivors have.
  const std::string opt_prefix = prefix + "opt" + std::to_string(ordinal) + "/";
  check_builds(ctx, opt, opt_prefix, coordinator, lost, [&] { post_shared(ctx, store, opt_prefix + "shared"); });

  if (out.replacement) receive_shared(ctx, store, opt_prefix + "shared");
  const auto held = ctx.lock();
  PeerCopy& pc = peer_copy_of(ctx, opt);
  // Every rank's coordinator starts over (the replacement's too, should its
  // program have fetched through one before joining).
  if (Coordinator* coord = coordinator_if_any(ctx)) coord->reset_for_heal();
  if (!out.replacement) {
    drop_step_in_flight(ctx, opt);
    out.committed = pc.agreed.committed;
    // The replacement holds no replica: seed it at the next step.
    if (std::binary_search(lost.begin(), lost.end(), pc.holder())) pc.reseed();
    pc.agreed = PeerCopy::Agreed{};
  }
  if (!out.replacement) fault_point("join");  // a survivor's, before the state moves
  const int64_t received = pc.hand_over(lost);
  if (out.replacement) {
    out.committed = received;  // and its blob at C came with the replica (hand_over)
    pc.awaiting_state = false;
    ctx.end_replacing();
  }
  out.generation = ctx.generation();
  out.replaced = lost;
  return out;
}

}  // namespace zs::heal
