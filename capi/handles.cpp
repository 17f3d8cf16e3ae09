#include "capi/handles.h"

#include <mutex>
#include <unordered_map>

namespace zs::capi {

static_assert(static_cast<int>(Code::InvalidHandle) == ZS_ERR_INVALID_HANDLE);
static_assert(static_cast<int>(Code::BufferSize) == ZS_ERR_BUFFER_SIZE);
static_assert(static_cast<int>(Code::Internal) == ZS_ERR_INTERNAL);
static_assert(static_cast<int>(Code::Io) == ZS_ERR_IO);
static_assert(static_cast<int>(Code::RankLost) == ZS_ERR_RANK_LOST);
static_assert(static_cast<int>(Code::StateLost) == ZS_ERR_STATE_LOST);
static_assert(static_cast<int>(Code::NotTaken) == ZS_ERR_NOT_TAKEN);
static_assert(static_cast<int>(DType::U8) == ZS_UINT8);
static_assert(static_cast<int>(ParamStatus::Available) == ZS_PARAM_AVAILABLE);

namespace {

struct Entry {
  Kind kind;
  uint64_t ctx_id;
  std::shared_ptr<void> obj;
};

struct Table {
  std::mutex mu;
  std::unordered_map<uintptr_t, Entry> entries;
  std::unordered_map<uint64_t, uintptr_t> context_handles;  // ctx id -> handle
  uint64_t next = 1;
};

// Leaked on purpose: handles may be destroyed from static destructors.
Table& table() {
  static Table* t = new Table();
  return *t;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Context: return "context";
    case Kind::Group: return "group";
    case Kind::Param: return "param";
    case Kind::Gather: return "gather";
    case Kind::Work: return "work";
    case Kind::Optimizer: return "optimizer";
    case Kind::StoreServer: return "store server";
  }
  return "unknown";
}

thread_local std::string t_last_error;

[[noreturn]] void bad_handle(Kind kind, uintptr_t h, const char* arg, const Entry* found) {
  if (h == 0) fail(Code::InvalidHandle, arg, " is a NULL ", kind_name(kind), " handle");
  if (found != nullptr)
    fail(Code::InvalidHandle, arg, " is a ", kind_name(found->kind), " handle, expected a ",
         kind_name(kind), " handle");
  fail(Code::InvalidHandle, arg, " (0x", std::hex, h, std::dec, ") is not a live ",
       kind_name(kind), " handle: destroyed, never created, or from a destroyed context");
}

// Caller holds the table lock.
template <typename T>
Resolved<T> resolve_locked(Table& t, Kind kind, uintptr_t h, const char* arg) {
  auto it = t.entries.find(h);
  if (it == t.entries.end() || it->second.kind != kind)
    bad_handle(kind, h, arg, it == t.entries.end() ? nullptr : &it->second);
  Resolved<T> r;
  r.obj = std::static_pointer_cast<T>(it->second.obj);
  auto c = t.context_handles.find(it->second.ctx_id);
  if (c == t.context_handles.end())
    fail(Code::InvalidHandle, arg, " belongs to a destroyed context");
  r.ctx = std::static_pointer_cast<Context>(t.entries.at(c->second).obj);
  return r;
}

template <typename T, typename H>
Resolved<T> resolve(Kind kind, H h, const char* arg) {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  return resolve_locked<T>(t, kind, reinterpret_cast<uintptr_t>(h), arg);
}

}  // namespace

uintptr_t add_handle(Kind kind, uint64_t ctx_id, std::shared_ptr<void> obj) {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  const uintptr_t h = static_cast<uintptr_t>(t.next++ << 4) | static_cast<uintptr_t>(kind);
  t.entries.emplace(h, Entry{kind, ctx_id, std::move(obj)});
  if (kind == Kind::Context) t.context_handles[ctx_id] = h;
  return h;
}

std::shared_ptr<void> take_handle(Kind kind, uintptr_t h, uint64_t* ctx_id) {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.entries.find(h);
  if (it == t.entries.end() || it->second.kind != kind) return nullptr;
  auto obj = std::move(it->second.obj);
  if (ctx_id) *ctx_id = it->second.ctx_id;
  if (kind == Kind::Context) t.context_handles.erase(it->second.ctx_id);
  t.entries.erase(it);
  return obj;
}

void drop_context_handles(uint64_t ctx_id) {
  // Objects are destroyed after the lock is released: a gather's or work's
  // last reference may wait on its group thread.
  std::vector<std::shared_ptr<void>> dropped;
  {
    auto& t = table();
    std::lock_guard<std::mutex> lock(t.mu);
    for (auto it = t.entries.begin(); it != t.entries.end();) {
      if (it->second.ctx_id == ctx_id && it->second.kind != Kind::Context) {
        dropped.push_back(std::move(it->second.obj));
        it = t.entries.erase(it);
      } else {
        ++it;
      }
    }
  }
}

std::shared_ptr<Context> context_of(zs_context h, const char* arg) {
  return resolve<Context>(Kind::Context, h, arg).obj;
}
Resolved<Group> group_of(zs_group h, const char* arg) { return resolve<Group>(Kind::Group, h, arg); }
Resolved<Param> param_of(zs_param h, const char* arg) { return resolve<Param>(Kind::Param, h, arg); }
Resolved<GatherState> gather_of(zs_gather h, const char* arg) {
  return resolve<GatherState>(Kind::Gather, h, arg);
}
Resolved<Work> work_of(zs_work h, const char* arg) { return resolve<Work>(Kind::Work, h, arg); }
Resolved<Optimizer> optimizer_of(zs_optimizer h, const char* arg) {
  return resolve<Optimizer>(Kind::Optimizer, h, arg);
}

ParamList params_of(const std::shared_ptr<Context>& ctx, const zs_param* handles, size_t n,
                    const char* arg) {
  if (handles == nullptr && n > 0) fail(Code::InvalidArgument, arg, " is NULL");
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  // Every param is a handle of the table, so a larger n cannot be right
  // (and must not size the list below).
  if (n > t.entries.size())
    fail(Code::InvalidArgument, arg, ": n is ", n, ", more than the ", t.entries.size(),
         " live handles of this process");
  ParamList out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const auto h = reinterpret_cast<uintptr_t>(handles[i]);
    auto it = t.entries.find(h);
    if (it != t.entries.end() && it->second.kind == Kind::Param && it->second.ctx_id == ctx->id()) {
      out.push_back(std::static_pointer_cast<Param>(it->second.obj));
      continue;
    }
    // Not one of this context's params: say which and why (names built
    // only here, off the path every fetch takes).
    const std::string name = std::string(arg) + "[" + std::to_string(i) + "]";
    auto r = resolve_locked<Param>(t, Kind::Param, h, name.c_str());
    if (r.ctx != ctx) fail(Code::InvalidArgument, name, " belongs to another context");
    fail(Code::InvalidHandle, name, " could not be resolved");
  }
  return out;
}

zs_status set_error(zs_status status, const std::string& message) {
  t_last_error = message;
  return status;
}

}  // namespace zs::capi

extern "C" ZS_API const char* zs_last_error(void) { return zs::capi::t_last_error.c_str(); }
