#include "impl/heal/replacement_wait.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "impl/common/error.h"

namespace zs::heal {
namespace {

// The verdict of the context's latest loss (shrinks_instead).
struct Verdict final : Context::Attachment {
  explicit Verdict(Context&) {}
  bool shrink = false;
};

std::string list_of(const std::vector<int>& ranks) {
  std::string s;
  for (const int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

// The lowest survivor: every lost rank's replacement has posted its
// heartbeat address in generation g + 1 within the deadline. The loss is
// posted first, so the replacements learn their generation at all.
bool replacements_came(Context& ctx, const std::vector<int>& lost, int64_t next, int left) {
  Store& store = *ctx.store();
  ctx.post_losses(lost, false);
  std::vector<std::string> keys;
  for (const int r : lost) keys.push_back(Context::key_prefix_of(next) + "heartbeat/" + std::to_string(r));
  const double wait_s = ctx.config().heal_replacement_wait_s;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::microseconds(static_cast<int64_t>(wait_s * 1e6));
  std::vector<int> missing = lost;
  for (;;) {
    missing.clear();
    for (size_t i = 0; i < keys.size(); ++i)
      if (!store.check(keys[i])) missing.push_back(lost[i]);
    if (missing.empty() || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (missing.empty()) return true;
  std::fprintf(stderr, "zeroshard: rank %d: healing: no replacement of rank %s came within "
               "zeroshard.healing.replacement_wait_s = %g s; the %d live rank%s go on without %s "
               "(healing.min_ranks %d)\n", ctx.ranks().rank, list_of(missing).c_str(), wait_s, left,
               left == 1 ? "" : "s", lost.size() == 1 ? "it" : "them", ctx.config().heal_min_ranks);
  return false;
}

}  // namespace

bool shrinks_instead(Context& ctx, const std::vector<int>& lost) {
  Verdict& verdict = ctx.attachment<Verdict>();
  if (ctx.lost_ranks().empty()) return verdict.shrink;  // a later optimizer's join of this loss
  const std::vector<int>& live = ctx.topology().live();
  std::vector<int> left;
  for (const int r : live)
    if (!std::binary_search(lost.begin(), lost.end(), r)) left.push_back(r);
  const bool may_shrink = static_cast<int>(left.size()) >= ctx.config().heal_min_ranks;
  if (ctx.config().heal_replacement_wait_s <= 0) return verdict.shrink = may_shrink;

  const int64_t next = ctx.generation() + 1;
  const std::string key = Context::heal_decision_key(next);
  Store& store = *ctx.store();
  const int decider = left.front();
  std::string decision;
  if (ctx.ranks().rank == decider) {
    const bool shrink = may_shrink && !replacements_came(ctx, lost, next, static_cast<int>(left.size()));
    if (shrink) ctx.post_losses(lost, true);  // before the verdict: a replacement coming later finds "shrunk"
    decision = shrink ? "shrink" : "join";
    store.set(key, std::vector<char>(decision.begin(), decision.end()));
  } else {
    ctx.rendezvous_with({decider}, "zs_heal_join (rank " + std::to_string(decider) + "'s decision: a replacement "
                        "or a shrink, within zeroshard.healing.replacement_wait_s)", [&] {
                          const std::vector<char> raw = store.get(key);
                          decision.assign(raw.begin(), raw.end());
                        });
  }
  if (decision != "join" && decision != "shrink")
    fail(Code::Internal, "heal: the store's '", key, "' holds '", decision, "', not join or shrink");
  return verdict.shrink = decision == "shrink";
}

}  // namespace zs::heal
