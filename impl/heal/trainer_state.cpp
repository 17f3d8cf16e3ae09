#include "impl/heal/trainer_state.h"

#include <cstring>

#include "impl/common/error.h"

namespace zs::heal {

namespace {

// A state as the store carries it: a marker byte first ('1': there is
// one, '0': none), since an empty state is a state.
std::vector<char> marked(bool there, const std::vector<char>* bytes) {
  std::vector<char> value(1 + (there ? bytes->size() : 0));
  value[0] = there ? '1' : '0';
  if (there && !bytes->empty()) std::memcpy(value.data() + 1, bytes->data(), bytes->size());
  return value;
}

// marked()'s bytes into *out (emptied when there are none); whether there
// were.
bool unmarked(const std::vector<char>& value, std::vector<char>* out) {
  out->assign(value.begin() + (value.empty() ? 0 : 1), value.end());
  return !value.empty() && value[0] == '1';
}

}  // namespace

void set_rank_state(Context& ctx, Optimizer& opt, const void* data, size_t size) {
  if (!ctx.heals())
    fail(Code::InvalidState, "zs_heal_set_rank_state needs zeroshard.healing.peer_copy on, with heartbeats");
  if (size > 0 && data == nullptr) fail(Code::InvalidArgument, "data is NULL with size ", size);
  const char* bytes = static_cast<const char*>(data);
  // Read before t.mu: steps() takes the engine lock, under which the copy
  // takes t.mu (rank_state_for).
  const int64_t step = opt.steps() + 1;
  TrainerState& t = ctx.attachment<TrainerState>();
  const std::lock_guard<std::mutex> held(t.mu);
  // The last step's buffer again, unless a copy still sends from it: a
  // blob of MBs a step (GRPO's completions) is then no fresh allocation,
  // its pages faulted in anew.
  if (!t.pending || t.pending.use_count() > 1) t.pending = std::make_shared<std::vector<char>>();
  t.pending->assign(bytes, bytes + size);
  t.pending_for = &opt;
  t.pending_step = step;
}

std::shared_ptr<const std::vector<char>> rank_state_for(Context& ctx, const Optimizer& opt, int64_t step) {
  auto* t = ctx.find_attachment<TrainerState>();
  if (t == nullptr) return nullptr;
  const std::lock_guard<std::mutex> held(t->mu);
  // A blob of another step is an older one (the trainer stopped setting
  // it): none rather than a wrong one.
  if (t->pending_for != &opt || t->pending_step != step) return nullptr;
  return t->pending;
}

void forget_rank_state(Context& ctx, const Optimizer& opt) {
  auto* t = ctx.find_attachment<TrainerState>();
  if (t == nullptr) return;
  const std::lock_guard<std::mutex> held(t->mu);
  if (t->pending_for != &opt) return;
  t->pending_for = nullptr;
  t->pending.reset();
}

void handed_rank_state(Context& ctx, std::vector<char> blob) {
  TrainerState& t = ctx.attachment<TrainerState>();
  const std::lock_guard<std::mutex> held(t.mu);
  t.joined_rank = std::move(blob);
  t.has_joined_rank = true;
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
  store.set(key, marked(t.has_shared, &t.shared));
}

void receive_shared(Context& ctx, Store& store, const std::string& shared_key) {
  TrainerState& t = ctx.attachment<TrainerState>();
  const std::vector<char> shared = store.get(shared_key);
  const std::lock_guard<std::mutex> held(t.mu);
  t.has_joined_shared = unmarked(shared, &t.joined_shared);
}

void post_donor(Context& ctx, Store& store, const std::string& key, const Optimizer& opt, int64_t step) {
  const auto blob = rank_state_for(ctx, opt, step);
  store.set(key, marked(blob != nullptr, blob.get()));
}

void receive_donor(Context& ctx, Store& store, const std::string& key) {
  std::vector<char> donor;
  if (!unmarked(store.get(key), &donor)) return;  // another optimizer's key carries it
  TrainerState& t = ctx.attachment<TrainerState>();
  const std::lock_guard<std::mutex> held(t.mu);
  t.joined_donor = std::move(donor);
  t.has_joined_donor = true;
}

bool joined_state(Context& ctx, int which, std::vector<char>* out) {
  if (which < 0 || which > 2)
    fail(Code::InvalidArgument, "which ", which,
         ": expected 0 (this rank's blob), 1 (the shared state) or 2 (the donor's blob)");
  TrainerState& t = ctx.attachment<TrainerState>();
  const std::lock_guard<std::mutex> held(t.mu);
  if (which == 0) {
    *out = t.joined_rank;
    return t.has_joined_rank;
  }
  if (which == 2) {
    *out = t.joined_donor;
    return t.has_joined_donor;
  }
  *out = t.joined_shared;
  return t.has_joined_shared;
}

}  // namespace zs::heal
