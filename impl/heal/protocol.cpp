#include "impl/heal/protocol.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>
#include <thread>

#include "impl/common/error.h"
#include "impl/heal/peer_copy.h"
#include "impl/heal/placement.h"
#include "impl/heal/store_text.h"

namespace zs::heal {
namespace {

// One survivor's report, as posted: "steps norm_step sum nonfinite commits
// replica_steps" (floats in hex, exact).
struct Report {
  int64_t steps = 0;
  Optimizer::NormResult norm;
  int64_t replica_steps = -1;
};

std::string encode(const Report& r) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%lld %lld %a %a %a %lld", static_cast<long long>(r.steps),
                static_cast<long long>(r.norm.step), r.norm.sum_squares, r.norm.nonfinite, r.norm.commits,
                static_cast<long long>(r.replica_steps));
  return buf;
}

Report decode(const std::string& s, int rank) {
  Report r;
  long long steps = 0, norm_step = 0, replica = 0;
  float sum = 0, nonfinite = 0, commits = 0;
  if (std::sscanf(s.c_str(), "%lld %lld %a %a %a %lld", &steps, &norm_step, &sum, &nonfinite, &commits,
                  &replica) != 6)
    fail(Code::Internal, "heal agreement: rank ", rank, "'s report '", s, "' is malformed");
  r.steps = steps;
  r.norm = {norm_step, sum, nonfinite, commits};
  r.replica_steps = replica;
  return r;
}

// The plan, from every live rank's report: "state_lost\nlost <ranks>\n<message>", or
// "ok C\nlost <ranks>\nroll <ranks>\nnorm <a report whose norm step is C>".
// `members`: the world ranks the loss found (all, or the live ones after a
// shrink), each of which keeps a peer copy placed over them.
std::string make_plan(const std::vector<int>& members, const std::vector<int>& host_of, const std::vector<int>& live,
                      const std::vector<Report>& reports) {
  std::vector<int> lost;
  for (const int r : members)
    if (!std::binary_search(live.begin(), live.end(), r)) lost.push_back(r);
  const std::vector<int> holder = member_holders(members, host_of);
  for (const int l : lost) {
    const int h = holder[static_cast<size_t>(l)];
    if (std::binary_search(lost.begin(), lost.end(), h))
      return "state_lost\nlost " + list(lost) + "\nrank " + std::to_string(l) + "'s shard state is lost: rank " + std::to_string(l) +
             " and rank " + std::to_string(h) + ", which held its copy, were lost together (zeroshard.healing."
             "peer_copy keeps one copy of each rank's state); resume from the last disk checkpoint";
  }
  // A holder with no replica yet (the first step's seed, or the seed after
  // a heal, cut short by this loss; or a replay that failed) has nothing
  // to hand over: named here, on every survivor alike, rather than by the
  // holder alone in the join while the others go on.
  for (const int l : lost) {
    const int h = holder[static_cast<size_t>(l)];
    const size_t at = static_cast<size_t>(std::lower_bound(live.begin(), live.end(), h) - live.begin());
    if (reports[at].replica_steps < 0)
      return "state_lost\nlost " + list(lost) + "\nrank " + std::to_string(l) + "'s shard state is lost: rank " +
             std::to_string(h) + ", which holds its copy, has none yet (rank " + std::to_string(l) +
             " was lost before its first copy landed: in the first step's seed, or the one after a heal; or the "
             "copy's replay failed there); resume from the last disk checkpoint";
  }
  int64_t committed = 0;
  for (const Report& r : reports) committed = std::max(committed, r.steps);
  std::vector<int> roll;
  const Report* seen = nullptr;
  for (size_t i = 0; i < live.size(); ++i) {
    const Report& r = reports[i];
    if (r.norm.step == committed && (!seen || seen->steps < r.steps)) seen = &r;
    if (r.steps == committed) continue;
    if (r.steps != committed - 1)
      fail(Code::Internal, "heal agreement: rank ", live[i], " has taken ", r.steps, " optimizer steps where another "
           "survivor has taken ", committed, ": the ranks were more than one step apart");
    roll.push_back(live[i]);
  }
  if (!roll.empty() && seen == nullptr)
    fail(Code::Internal, "heal agreement: step ", committed, " was taken by some survivors but none reports its "
         "norm all-reduce's result");
  return "ok " + std::to_string(committed) + "\nlost " + list(lost) + "\nroll " + list(roll) + "\nnorm " +
         (seen ? encode(*seen) : encode(Report{}));
}

}  // namespace

Outcome agree(Context& ctx, Optimizer& opt) {
  const int me = ctx.ranks().rank;
  // The ranks still in the run: all, or those a shrink went on with.
  const std::vector<int> members = ctx.topology().live();
  const int world = static_cast<int>(members.size());
  if (!ctx.heals())
    fail(Code::InvalidState, "the heal agreement needs zeroshard.healing.peer_copy on, with heartbeats");
  std::string why;
  std::vector<int> lost = ctx.settle_loss(ctx.loss_grace(), &why);
  if (lost.empty()) {
    ctx.end_if_fenced();  // lost itself, back from a stop: it finds nobody else lost
    fail(Code::InvalidState, "the heal agreement runs after a rank was lost (ZS_ERR_RANK_LOST), and none is");
  }
  if (std::binary_search(lost.begin(), lost.end(), 0) && ctx.store_served_by_rank0()) {
    const std::string msg = "the heal agreement cannot run: rank 0, which served the store, was lost (" + why +
                            "); resume from the last disk checkpoint";
    ctx.record_async_error(Code::StateLost, msg);
    fail(Code::StateLost, msg);
  }

  Report mine;
  int ordinal = 0;
  {
    const auto held = ctx.lock();
    PeerCopy& pc = peer_copy_of(ctx, opt);
    ordinal = pc.ordinal();
    mine.steps = opt.steps_locked();
    mine.norm = opt.last_norm_locked();
    mine.replica_steps = pc.settled_replica_step();
  }
  Store& store = *ctx.store();
  const std::string prefix = "zs/heal/gen" + std::to_string(ctx.generation() + 1) + "/opt" + std::to_string(ordinal) + "/";
  const auto report_key = [&](int r) { return prefix + "report/" + std::to_string(r); };
  // After a store call failed: whether a loss found since settle_loss (a
  // second rank that died a tick later, its holder say, whose loss
  // interrupts the call in flight) explains it; `lost` then names it and
  // the call is made again, once the loss thread has acted on it (its
  // interrupt of the store, landing on the call made again, would fail it;
  // a watch of the call may cut it short before the loss is recorded).
  const auto lost_more = [&](const Error& e, int attempt) {
    if (e.code() != Code::Comm || attempt > world) return false;
    const std::vector<int> now = ctx.settle_loss(ctx.loss_grace(), &why, lost);
    if (now == lost) return false;
    lost = now;
    return true;
  };
  for (int attempt = 0;; ++attempt) {
    try {
      store.set(report_key(me), bytes(encode(mine)));
      break;
    } catch (const Error& e) {
      if (!lost_more(e, attempt)) throw;
    }
  }

  std::string plan;
  for (int attempt = 0; plan.empty(); ++attempt) {
    std::vector<int> live;
    for (const int r : members)
      if (!std::binary_search(lost.begin(), lost.end(), r)) live.push_back(r);
    const int coordinator = live.front();
    // The plan's key names its coordinator: a process that others took for
    // lost while it lived, resuming mid-agreement, takes itself for the
    // survivor and some of them for lost; its plan must not be the one they
    // read.
    const std::string plan_key = prefix + "plan/" + std::to_string(coordinator);
    try {
      if (me == coordinator) {
        std::vector<std::string> keys;
        for (const int r : live) keys.push_back(report_key(r));
        std::vector<std::vector<char>> raw;
        ctx.rendezvous_with(live, "the heal agreement (the survivors' reports)", [&] { raw = store.get_many(keys); });
        std::vector<Report> reports;
        for (size_t i = 0; i < live.size(); ++i) reports.push_back(decode(text(raw[i]), live[i]));
        std::string made;
        try {
          made = make_plan(members, ctx.topology().host_of(), live, reports);
        } catch (const Error& e) {
          // The others fail with it too, rather than wait for a plan.
          store.set(plan_key, bytes("error\n" + std::string(e.what())));
          throw;
        }
        store.set(plan_key, bytes(made));
        plan = made;
      } else {
        std::vector<char> raw;
        ctx.rendezvous_with({coordinator}, "the heal agreement (rank " + std::to_string(coordinator) + "'s plan)",
                            [&] { raw = store.get(plan_key); });
        plan = text(raw);
      }
    } catch (const Error& e) {
      if (!lost_more(e, attempt)) throw;  // a survivor lost meanwhile: again without it
    }
  }

  if (plan.rfind("error\n", 0) == 0)
    fail(Code::Internal, "heal agreement: the coordinator could not make a plan: ", plan.substr(6));
  std::istringstream in(plan);
  std::string head, line;
  Outcome out;
  std::getline(in, head);
  std::getline(in, line);
  out.lost = parse_list(line.substr(4));
  // Rank 0 serves the store: it stays until every survivor has read the
  // plan, so that survivors may exit once they return.
  store.add(prefix + "read", 1);
  if (me == 0 && ctx.store_served_by_rank0()) {
    std::vector<int> live;
    for (const int r : members)
      if (!std::binary_search(out.lost.begin(), out.lost.end(), r)) live.push_back(r);
    const auto deadline = std::chrono::steady_clock::now() + ctx.timeout();
    while (store.add(prefix + "read", 0) < static_cast<int64_t>(live.size()) &&
           std::chrono::steady_clock::now() < deadline && ctx.silence(live).empty())
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (head == "state_lost") {
    std::string msg;
    std::getline(in, msg);
    ctx.record_async_error(Code::StateLost, msg);
    fail(Code::StateLost, msg);
  }
  out.committed = std::atoll(head.c_str() + 3);
  std::getline(in, line);
  const std::vector<int> roll = parse_list(line.substr(4));
  std::getline(in, line);
  const Report seen = decode(line.substr(5), -1);
  const auto held = ctx.lock();
  if (std::find(roll.begin(), roll.end(), me) != roll.end()) {
    opt.roll_forward_locked(seen.norm);
    out.rolled_forward = true;
  }
  PeerCopy::Agreed& agreed = peer_copy_of(ctx, opt).agreed;
  agreed.done = true;
  agreed.committed = out.committed;
  agreed.lost = out.lost;
  return out;
}

}  // namespace zs::heal
