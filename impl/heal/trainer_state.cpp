#include "impl/heal/trainer_state.h"

#include <cstring>

#include "impl/common/error.h"

namespace zs::heal {
namespace {

// Outside the generations' prefixes: a blob must outlive the generation it
// was posted in (the replacement reads it in the next one).
std::string rank_key(int rank, int64_t step) {
  return "zs/heal/rankstate/" + std::to_string(rank) + "/" + std::to_string(step % 2);
}

}  // namespace

void set_rank_state(Context& ctx, Optimizer& opt, const void* data, size_t size) {
  if (!ctx.heals())
    fail(Code::InvalidState, "zs_heal_set_rank_state needs zeroshard.healing.peer_copy on, with heartbeats");
  if (size > 0 && data == nullptr) fail(Code::InvalidArgument, "data is NULL with size ", size);
  const int64_t step = opt.steps() + 1;
  std::vector<char> value(8 + size);
  std::memcpy(value.data(), &step, 8);
  if (size > 0) std::memcpy(value.data() + 8, data, size);
  ctx.store()->set(rank_key(ctx.ranks().rank, step), value);
}

void set_shared_state(Context& ctx, const void* data, size_t size) {
  if (size > 0 && data == nullptr) fail(Code::InvalidArgument, "data is NULL with size ", size);
  TrainerState& t = ctx.attachment<TrainerState>();
  const std::lock_guard<std::mutex> held(t.mu);
  const char* bytes = static_cast<const char*>(data);
  t.shared.assign(bytes, bytes + size);
  t.has_shared = true;
}

void post_shared(Context& ctx, Store& store, const std::string& key) {
  TrainerState& t = ctx.attachment<TrainerState>();
  const std::lock_guard<std::mutex> held(t.mu);
  // A marker byte first: an empty state is a state.
  std::vector<char> value(1 + t.shared.size());
  value[0] = t.has_shared ? '1' : '0';
  if (!t.shared.empty()) std::memcpy(value.data() + 1, t.shared.data(), t.shared.size());
  store.set(key, value);
}

void receive_shared(Context& ctx, Store& store, const std::string& shared_key) {
  TrainerState& t = ctx.attachment<TrainerState>();
  const std::vector<char> shared = store.get(shared_key);
  const std::lock_guard<std::mutex> held(t.mu);
  t.has_joined_shared = !shared.empty() && shared[0] == '1';
  t.joined_shared.assign(shared.begin() + (shared.empty() ? 0 : 1), shared.end());
}

void receive_rank(Context& ctx, Store& store, int rank, int64_t committed) {
  TrainerState& t = ctx.attachment<TrainerState>();
  std::vector<char> mine;
  bool has_mine = false;
  const std::string key = rank_key(rank, committed);
  if (committed > 0 && store.check(key)) {
    std::vector<char> v = store.get(key);
    int64_t step = -1;
    if (v.size() >= 8) std::memcpy(&step, v.data(), 8);
    // A blob of another step is an older one (the trainer stopped setting
    // it): none rather than a wrong one.
    if (step == committed) {
      mine.assign(v.begin() + 8, v.end());
      has_mine = true;
    }
  }
  const std::lock_guard<std::mutex> held(t.mu);
  t.joined_rank = std::move(mine);
  t.has_joined_rank = has_mine;
}

bool joined_state(Context& ctx, int which, std::vector<char>* out) {
  if (which != 0 && which != 1)
    fail(Code::InvalidArgument, "which ", which, ": expected 0 (this rank's blob) or 1 (the shared state)");
  TrainerState& t = ctx.attachment<TrainerState>();
  const std::lock_guard<std::mutex> held(t.mu);
  if (which == 0) {
    *out = t.joined_rank;
    return t.has_joined_rank;
  }
  *out = t.joined_shared;
  return t.has_joined_shared;
}

}  // namespace zs::heal
