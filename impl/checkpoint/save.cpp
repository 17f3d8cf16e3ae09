#include "impl/checkpoint/save.h"

#include <unistd.h>

#include <algorithm>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "impl/checkpoint/dir_lock.h"
#include "impl/checkpoint/file_io.h"
#include "impl/checkpoint/format.h"
#include "impl/checkpoint/pending_save.h"
#include "impl/checkpoint/shard_io.h"
#include "impl/checkpoint/state_names.h"
#include "impl/common/fault_point.h"
#include "impl/partition/shard_residence.h"

namespace zs::ckpt {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// Saves are numbered per context and healing generation, the same on
// every rank (saves are collective), so each save's store keys are its
// own; after a heal, survivors and replacements count from 0 alike.
struct SaveCounter : Context::Attachment {
  explicit SaveCounter(Context&) {}
  int64_t generation = 0;
  uint64_t next = 0;
};

void check_tag(const std::string& tag) {
  if (tag.empty() || tag == "." || tag == ".." || tag[0] == '.' || tag == kLatest ||
      tag.find('/') != std::string::npos || tag.size() > 200)
    fail(Code::InvalidArgument, "checkpoint tag '", tag,
         "': expected a plain directory name (no '/', not starting with '.', not 'latest')");
}

// Waits for a store key until the deadline; a timeout names `who`.
std::string wait_key(Store& store, const std::string& key, Clock::time_point deadline,
                     const std::string& who, std::chrono::milliseconds timeout) {
  while (true) {
    try {
      if (store.check(key)) {
        const auto v = store.get(key);
        return std::string(v.begin(), v.end());
      }
    } catch (const Error& e) {
      fail(Code::Comm, "checkpoint save: lost the rendezvous store (served by rank 0) while ", who,
           ": ", e.what());
    }
    if (Clock::now() > deadline)
      fail(Code::Timeout, "checkpoint save: timed out after ", timeout.count(), " ms ", who);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// A status through the store: "ok", or "<code> <message>".
std::string status_of(const Error& e) { return std::to_string(static_cast<int>(e.code())) + " " + e.what(); }
[[noreturn]] void throw_status(const std::string& s, const std::string& prefix) {
  const auto sp = s.find(' ');
  int code = static_cast<int>(Code::Io);
  try {
    code = std::stoi(s.substr(0, sp));
  } catch (const std::exception&) {
  }
  throw Error(static_cast<Code>(code), prefix + (sp == std::string::npos ? s : s.substr(sp + 1)));
}

void put(Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<char>(value.begin(), value.end()));
}

// Names, dtypes, shapes and states, so rank 0 can tell that every rank
// saves the same thing.
std::string fingerprint(const std::vector<std::shared_ptr<Param>>& params, const Optimizer* opt,
                        const NameOf& name_of) {
  std::string s = opt ? optim_kind_name(opt->kind()) : "none";
  for (const auto& p : params) {
    s += "|" + name_of.at(p.get()) + ":" + dtype_name(p->dtype) + "[";
    for (auto d : p->shape) s += std::to_string(d) + ",";
    s += "]";
  }
  return hex64(std::hash<std::string>{}(s));
}

// Whether this rank writes param p's shard: its partition group spans the
// world, or (MiCS) this rank's shard group is the first replica.
bool writes_shard(Context& ctx, const Param& p) {
  if (p.group->size() == ctx.world()->size()) return true;
  if (ctx.mics_shard_group() && p.group.get() == ctx.mics_shard_group().get())
    return ctx.mics_replica_group()->rank() == 0;
  fail(Code::NotSupported, "checkpoint save: ", p.describe(), " is partitioned over group '",
       p.group->name(), "' (", p.group->size(), " of ", ctx.world()->size(),
       " ranks), which is neither the world nor the MiCS shard group");
}

struct Local {
  FileEntry file;
  // per param: state -> this rank's chunk (absent: nothing to write)
  std::vector<std::map<std::string, Chunk>> chunks;
  // What the rank file holds, in order; each points at its chunk above
  // (std::map nodes do not move).
  std::vector<ShardSource> sources;
};

// This rank's sources: every shard it writes and, with opt, their state.
void collect_sources(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, Optimizer* opt,
                     const NameOf& name_of, Local& l) {
  l.chunks.resize(params.size());
  std::vector<ShardSource>& sources = l.sources;
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = *params[i];
    if (!writes_shard(ctx, p) || p.layout.shard_valid == 0) continue;
    auto add = [&](const std::string& state, DType dt, const void* data) {
      Chunk& c = l.chunks[i][state];
      c.offset = p.layout.shard_offset;
      sources.push_back({state + "/" + name_of.at(&p), dt, p.layout.shard_valid, data, &c, {}});
    };
    if (p.swapped || p.packet) {  // read back (or dequantized) at its turn
      add(kParam, p.dtype, nullptr);
      sources.back().open = [&ctx, param = params[i]]() -> std::shared_ptr<const void> {
        auto access = std::make_shared<ShardAccess>(ctx, *param, ShardAccess::Read);
        return std::shared_ptr<const void>(access, access->data());
      };
    } else {
      add(kParam, p.dtype, p.shard->data());
    }
    if (opt == nullptr) continue;
    for (int slot = 0; slot < 3; ++slot) {
      if (!opt->has_state(p, slot)) continue;
      // The master is the shard (an fp32 param, or a bf16 one under
      // bf16_master_weights_and_grads): "param" holds it.
      if (slot == 0 && opt->master_in_shard(p)) continue;
      if (opt->state_swapped(p, slot)) {  // read from the swap file at its turn, a param at a time
        add(state_name(*opt, p, slot), DType::F32, nullptr);
        sources.back().open = [opt, slot, param = params[i]]() -> std::shared_ptr<const void> {
          auto copy = std::make_shared<std::vector<float>>(param->layout.shard_numel);
          opt->copy_swapped_state(*param, slot, copy->data());
          return std::shared_ptr<const void>(copy, copy->data());
        };
      } else {  // in its dtype: fp32, or bf16 under bf16_optimizer_states
        DType dtype = DType::F32;
        const void* data = opt->state_raw_locked(p, slot, &dtype, nullptr);
        add(state_name(*opt, p, slot), dtype, data);
      }
    }
    for (const auto& name : opt->named_states(p))  // an external optimizer's, under their names
      add(name, DType::F32, opt->named_state_locked(p, name, false, nullptr));
  }
}

// Writes the sources into this rank's file at path.
void write_local(Local& l, const RankInfo& ranks, Device& device, const std::string& path,
                 const PhaseProgress& on_progress) {
  std::map<std::string, std::string> meta{{"format", kFormatName},
                                          {"rank", std::to_string(ranks.rank)},
                                          {"world_size", std::to_string(ranks.world_size)}};
  Progress progress;
  if (on_progress) progress = [&](uint64_t d, uint64_t t) { on_progress("write", d, t); };
  l.file = write_shard_file(path, l.sources, device, meta, progress);
  l.file.name = rank_file_name(ranks.rank, ranks.world_size);
  l.file.rank = ranks.rank;
}

json local_to_json(const Local& l, const std::string& fp) {
  json chunks = json::array();
  for (size_t i = 0; i < l.chunks.size(); ++i)
    for (const auto& [state, c] : l.chunks[i]) {
      json blocks = json::array();
      for (auto b : c.blocks) blocks.push_back(hex64(b));
      chunks.push_back({{"param", i}, {"state", state}, {"key", c.key}, {"dtype", st_dtype(c.dtype)},
                        {"offset", c.offset}, {"numel", c.numel}, {"begin", c.begin},
                        {"xxh3", hex64(c.xxh3)}, {"blocks", blocks}});
    }
  return {{"ok", true}, {"fingerprint", fp},
          {"file", {{"name", l.file.name}, {"rank", l.file.rank}, {"bytes", l.file.bytes},
                    {"xxh3", hex64(l.file.xxh3)}}},
          {"chunks", chunks}};
}

json optimizer_json(const Optimizer& opt, const NameOf& name_of) {
  json groups = json::array();
  for (size_t g = 0; g < opt.num_groups(); ++g) {
    json names = json::array();
    for (const auto& p : opt.group_params(g))
      if (name_of.count(p.get())) names.push_back(name_of.at(p.get()));
    groups.push_back({{"hparams", hparams_to_json(opt.hparams(g))}, {"params", names}});
  }
  auto& scaler = const_cast<Optimizer&>(opt).scaler();
  const auto st = scaler.state();
  return {{"kind", optim_kind_name(opt.kind())},
          {"steps", opt.steps_locked()},
          {"groups", groups},
          {"loss_scaler", {{"dynamic", scaler.dynamic()}, {"scale", st.scale},
                           {"hysteresis_left", st.hysteresis_left}, {"iter", st.iter},
                           {"last_overflow_iter", st.last_overflow_iter}}}};
}

// What a manifest records of the engine besides the chunks, taken while the
// engine lock is held: an asynchronous save commits after training moved on.
struct Snapshot {
  int world_size = 1;
  json topology;
  uint64_t step = 0;
  json optimizer;  // null without one
  std::vector<ParamEntry> params;  // name, dtype, shape, numel; no chunks yet
};

Snapshot snapshot(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, const Optimizer* opt,
                  const NameOf& name_of) {
  Snapshot s;
  s.world_size = ctx.members().world_size;
  const auto& cfg = ctx.config();
  s.topology = {{"world_size", s.world_size},
                {"mics_shard_size", cfg.mics_shard_size},
                {"zero_hpz_partition_size", cfg.zero_hpz_partition_size}};
  s.step = opt ? opt->steps_locked() : 0;
  s.optimizer = opt ? optimizer_json(*opt, name_of) : json(nullptr);
  for (const auto& p : params) {
    ParamEntry e;
    e.name = name_of.at(p.get());
    e.dtype = p->dtype;
    e.shape = p->shape;
    e.numel = p->layout.numel;
    s.params.push_back(std::move(e));
  }
  return s;
}

Manifest build_manifest(const Snapshot& s, const std::string& tag, const json& user,
                        const std::vector<json>& ranks) {
  Manifest m;
  m.engine_version = ZS_ENGINE_VERSION;
  m.tag = tag;
  m.world_size = s.world_size;
  m.topology = s.topology;
  m.step = s.step;
  m.optimizer = s.optimizer;
  m.user = user;
  m.params = s.params;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const json& j = ranks[r];
    FileEntry f;
    f.name = j.at("file").at("name").get<std::string>();
    f.rank = j.at("file").at("rank").get<int>();
    f.bytes = j.at("file").at("bytes").get<uint64_t>();
    f.xxh3 = parse_hex64(j.at("file").at("xxh3").get<std::string>(), "rank file");
    m.files.push_back(f);
    for (const auto& cj : j.at("chunks")) {
      Chunk c;
      c.file = static_cast<int>(r);
      c.key = cj.at("key").get<std::string>();
      c.dtype = parse_st_dtype(cj.at("dtype").get<std::string>(), "rank chunk");
      c.offset = cj.at("offset").get<uint64_t>();
      c.numel = cj.at("numel").get<uint64_t>();
      c.begin = cj.at("begin").get<uint64_t>();
      c.xxh3 = parse_hex64(cj.at("xxh3").get<std::string>(), "rank chunk");
      for (const auto& b : cj.at("blocks")) c.blocks.push_back(parse_hex64(b.get<std::string>(), "rank chunk"));
      m.params.at(cj.at("param").get<size_t>()).states[cj.at("state").get<std::string>()].push_back(c);
    }
  }
  for (auto& p : m.params)
    for (auto& [state, chunks] : p.states)
      std::sort(chunks.begin(), chunks.end(),
                [](const Chunk& a, const Chunk& b) { return a.offset < b.offset; });
  // What rank 0 writes must read back: the same checks a loader makes.
  return Manifest::from_json(m.to_json(), "the manifest being saved");
}

// Rank 0, before anyone writes: the target is free (or may be replaced),
// and an empty partial directory is ready. The directory is made with its
// parents, as DeepSpeed's save_checkpoint and torch's DCP writer make theirs
// (Lightning's ModelCheckpoint names <logs>/version_N/checkpoints/<file>
// and leaves its making to the strategy).
void prepare(Context& ctx, const std::string& dir, const std::string& tag, bool overwrite,
             std::string* partial, bool* made_dir) {
  *made_dir = make_dirs(dir);
  if (!is_dir(dir)) fail(Code::Io, "checkpoint directory '", dir, "' is not a directory");
  hold_checkpoint_dir(ctx, dir);
  const std::string target = join(dir, tag);
  if (exists(target) && !overwrite)
    fail(Code::InvalidArgument, "checkpoint '", target,
         "' already exists (save under another tag, or set overwrite)");
  *partial = join(dir, "." + tag + ".partial");
  remove_tree(*partial);  // left by a save that died
  make_dir(*partial);
}

void commit(const std::string& dir, const std::string& tag, const std::string& partial,
            const Manifest& m, const SaveOptions& o) {
  auto phase = [&](const char* name) {
    if (o.progress) o.progress(name, 0, 0);
  };
  const std::string text = m.to_json().dump(1);
  File f = File::create(join(partial, kManifest));
  f.write_all(text.data(), text.size());
  f.sync();
  f.close();
  sync_dir(partial);
  phase("manifest");
  const std::string target = join(dir, tag);
  if (exists(target)) {
    // Atomic swap: dir/<tag> is always a whole checkpoint, old or new.
    exchange_paths(partial, target);
    sync_dir(dir);
    remove_tree(partial);  // now the old one
  } else {
    rename_path(partial, target);
  }
  sync_dir(dir);
  phase("rename");
  if (o.update_latest) {
    write_text_atomic(join(dir, kLatest), tag + "\n");
    phase("latest");
  }
}

// One save after the engine's part is taken: this rank's sources (live
// memory, or staged host copies), the manifest's snapshot, and what the
// ranks agree through the store. run() writes and commits it.
struct Job {
  std::string dir, tag, partial, file_name, fp, key;
  json user;
  Snapshot snap;
  Local local;
  SaveOptions options;
  std::chrono::milliseconds timeout{0};
  Clock::time_point start;
  std::shared_ptr<Store> store;  // null in a world of one
  std::shared_ptr<Device> device;  // where the sources' bytes are
  std::shared_ptr<void> staged;  // asynchronous: the host copies the sources point at
  bool made_dir = false;  // rank 0's prepare made `dir` (abandon removes it)
};

// Rank 0, when a save fails: its partial directory goes, and so does the
// directory it made, lock and all, so that the save run again (a healed
// fit's, Lightning's ModelCheckpoint naming one folder per checkpoint)
// finds things as before it and writes the same name, not a "-v1".
void abandon(Context& ctx, const Job& job) {
  try { remove_tree(job.partial); } catch (const Error&) {}
  if (!job.made_dir) return;
  release_checkpoint_dir(ctx, job.dir);
  ::rmdir(job.dir.c_str());  // only if empty: nothing else was put there meanwhile
}

// An asynchronous save's host copies of every source (device memory, NVMe
// state read back), so training may change the originals from now on.
void stage(Context& ctx, Job& job) {
  auto padded = [](uint64_t b) { return (b + 63) / 64 * 64; };
  uint64_t total = 0;
  for (const auto& s : job.local.sources) total += padded(s.numel * dtype_size(s.dtype));
  const auto host = host_device();
  char* base = static_cast<char*>(host->alloc(total, MemKind::IoStaging));
  job.staged = std::shared_ptr<void>(base, [host, total](void* p) { host->free(p, total, MemKind::IoStaging); });
  Device& device = *ctx.device();
  uint64_t at = 0;
  for (auto& s : job.local.sources) {
    const uint64_t bytes = s.numel * dtype_size(s.dtype);
    if (s.open) {
      const std::shared_ptr<const void> opened = s.open();
      device.copy(base + at, opened.get(), bytes);
      device.synchronize();  // before `opened` lets its memory go
    } else {
      device.copy(base + at, s.data, bytes);
    }
    s.data = base + at;
    s.open = nullptr;
    at += padded(bytes);
  }
  device.synchronize();
  job.device = host;
}

// Rank 0 prepares (unless done), every rank writes its file, rank 0
// gathers the others' chunks and commits. Throws on any rank's failure.
void run(Context& ctx, Job& job) {
  const SaveOptions& o = job.options;
  const int rank = ctx.members().rank, world = ctx.members().world_size;
  Store* store = job.store.get();
  if (!store) {  // a world of one: nothing to agree on
    try {
      write_local(job.local, ctx.members(), *job.device, join(job.partial, job.file_name), o.progress);
      Manifest m = build_manifest(job.snap, job.tag, job.user, {local_to_json(job.local, job.fp)});
      m.moves_latest = o.update_latest;
      commit(job.dir, job.tag, job.partial, m, o);
    } catch (...) {
      abandon(ctx, job);
      throw;
    }
    return;
  }
  const std::string& key = job.key;
  const auto start = job.start;
  const auto timeout = job.timeout;
  const std::string& partial = job.partial;
  if (rank != 0) {
    const std::string status =
        wait_key(*store, key + "begin", start + timeout, "waiting for rank 0 to start the save", timeout);
    if (status != "ok") throw_status(status, "checkpoint save failed on rank 0: ");
  }
  // every rank writes its file
  json mine;
  try {
    write_local(job.local, ctx.members(), *job.device, join(partial, job.file_name), o.progress);
    fault_point("save");  // its file written, before rank 0 hears of it
    mine = local_to_json(job.local, job.fp);
  } catch (const Error& e) {
    mine = {{"ok", false}, {"error", status_of(e)}};
  }
  put(*store, key + "written/" + std::to_string(rank), mine.dump());
  if (!mine.at("ok").get<bool>()) {
    // Rank 0 names this rank's error to everyone; wait for it so the
    // partial directory is gone when we return.
    if (rank != 0) {
      (void)wait_key(*store, key + "commit", start + 2 * timeout + std::chrono::seconds(5),
                     "waiting for rank 0 to abandon the failed save", timeout);
      try {
        store->add(key + "ack", 1);
      } catch (const Error&) {
      }
    }
    if (rank == 0) {
      abandon(ctx, job);
      const std::string& err = mine.at("error").get_ref<const std::string&>();
      put(*store, key + "commit", err.substr(0, err.find(' ') + 1) + "checkpoint save failed on rank 0: " + err.substr(err.find(' ') + 1));
    }
    throw_status(mine.at("error").get<std::string>(), "");
  }
  if (rank == 0) {
    std::string status = "ok";
    std::vector<bool> ranks_seen(static_cast<size_t>(world), false);
    ranks_seen[0] = true;
    try {
      std::vector<json> ranks(static_cast<size_t>(world));
      ranks[0] = mine;
      std::vector<int> missing;
      for (int r = 1; r < world; ++r) missing.push_back(r);
      const auto deadline = start + timeout;
      while (!missing.empty()) {
        std::vector<int> still;
        for (int r : missing) {
          const std::string k = key + "written/" + std::to_string(r);
          if (!store->check(k)) {
            still.push_back(r);
            continue;
          }
          const auto v = store->get(k);
          ranks_seen[static_cast<size_t>(r)] = true;
          ranks[static_cast<size_t>(r)] = json::parse(std::string(v.begin(), v.end()));
          const json& j = ranks[static_cast<size_t>(r)];
          if (!j.at("ok").get<bool>())
            throw_status(j.at("error").get<std::string>(),
                         "checkpoint save failed on rank " + std::to_string(r) + ": ");
          if (j.at("fingerprint").get<std::string>() != job.fp)
            fail(Code::InvalidArgument, "checkpoint save: rank ", r,
                 " saves other params (names, dtypes, shapes or optimizer kind) than rank 0");
        }
        missing = still;
        if (missing.empty()) break;
        if (const std::string why = ctx.silence(missing); !why.empty())
          fail(Code::Comm, "checkpoint save: ", why, "; it cannot finish writing its shards");
        if (Clock::now() > deadline) {
          std::string list;
          for (int r : missing) list += (list.empty() ? "" : ", ") + std::to_string(r);
          fail(Code::Timeout, "checkpoint save: rank", missing.size() > 1 ? "s " : " ", list, " of ",
               world, " did not finish writing its shards within ", timeout.count(),
               " ms (dead, or not calling save)");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      Manifest m = build_manifest(job.snap, job.tag, job.user, ranks);
      m.moves_latest = o.update_latest;
      commit(job.dir, job.tag, partial, m, o);
    } catch (const Error& e) {
      status = status_of(e);
      abandon(ctx, job);
    }
    put(*store, key + "commit", status);
    // Rank 0 serves the store: stay until every rank that wrote has read
    // the outcome, so a caller that exits right after (on success or on
    // error) does not take the answer away from the others.
    const int64_t readers = static_cast<int64_t>(std::count_if(
        ranks_seen.begin(), ranks_seen.end(), [](bool b) { return b; })) - 1;
    // Healing: once a rank is lost, every survivor's store wait is cut
    // short (the loss interrupts it), so one may never read the outcome
    // to acknowledge it; the save is that loss on every rank anyway.
    const auto ack_deadline = Clock::now() + timeout;
    try {
      while (store->add(key + "ack", 0) < readers && Clock::now() < ack_deadline && ctx.lost_ranks().empty())
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } catch (const Error&) {
    }
    if (status != "ok") throw_status(status, "");
  } else {
    const std::string status = wait_key(*store, key + "commit", start + 2 * timeout + std::chrono::seconds(5),
                                        "waiting for rank 0 to commit the save", timeout);
    try {
      store->add(key + "ack", 1);
    } catch (const Error&) {
    }
    if (status != "ok") throw_status(status, "");
  }
}

std::string save_now(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, Optimizer* opt,
                     const std::string& dir, const SaveOptions& o) {
  const auto held = ctx.lock();  // the engine's state stays still while it is read or written
  const memory_tally::PhaseScope phase(MemPhase::Checkpoint);
  // Numbered first, so a rank that refuses the call below still keeps its
  // numbering in step with the others for the saves that follow.
  SaveCounter& counter = ctx.attachment<SaveCounter>();
  if (counter.generation != ctx.generation()) {
    counter.generation = ctx.generation();
    counter.next = 0;
  }
  const uint64_t seq = counter.next++;
  if (dir.empty()) fail(Code::InvalidArgument, "checkpoint directory is empty");
  const NameOf name_of = checkpoint_names(params, o.names, "checkpoint save");
  if (opt) opt->expect_no_open_step("checkpoint save");
  for (const auto& p : params) writes_shard(ctx, *p);
  const auto shared_job = std::make_shared<Job>();
  Job& job = *shared_job;
  job.dir = dir;
  job.tag = o.tag.empty() ? "step-" + std::to_string(opt ? opt->steps_locked() : 0) : o.tag;
  check_tag(job.tag);
  job.user = json::object();
  if (!o.user_json.empty()) {
    try {
      job.user = json::parse(o.user_json);
    } catch (const json::exception& e) {
      fail(Code::InvalidArgument, "checkpoint user_json is not valid JSON: ", e.what());
    }
  }
  ctx.check_async_error();
  ctx.device()->synchronize();

  const int rank = ctx.members().rank, world = ctx.members().world_size;
  job.options = o;
  job.timeout = o.timeout.count() > 0 ? o.timeout : ctx.timeout();
  job.fp = fingerprint(params, opt, name_of);
  job.file_name = rank_file_name(rank, world);
  job.store = world > 1 ? ctx.store() : nullptr;
  if (world > 1 && !job.store) fail(Code::Internal, "checkpoint save: no rendezvous store in a world of ", world);
  job.snap = snapshot(ctx, params, opt, name_of);
  job.device = ctx.device();
  job.key = ctx.key_prefix() + "ckpt/" + std::to_string(seq) + "/";
  job.start = Clock::now();
  job.partial = join(dir, "." + job.tag + ".partial");
  collect_sources(ctx, params, opt, name_of, job.local);
  // Rank 0 prepares, here even for an asynchronous save (the directory's
  // lock is taken on the caller's thread); the others wait for its word in run().
  if (!job.store) {
    prepare(ctx, dir, job.tag, o.overwrite, &job.partial, &job.made_dir);
  } else if (rank == 0) {
    std::string status = "ok";
    try {
      prepare(ctx, dir, job.tag, o.overwrite, &job.partial, &job.made_dir);
    } catch (const Error& e) {
      status = status_of(e);
    }
    put(*job.store, job.key + "begin", status);
    if (status != "ok") throw_status(status, "");
  }
  if (o.async_save) {
    stage(ctx, job);
    if (opt) opt->flush_state_views();
    if (o.progress) o.progress("staged", 0, 0);
    job.options.progress = nullptr;  // no caller's callback from the background thread
    ctx.attachment<PendingSave>().start(join(dir, job.tag), [&ctx, shared_job] { run(ctx, *shared_job); });
    return join(dir, job.tag);
  }
  run(ctx, job);
  // Host copies of state on NVMe (state()) are not needed any more.
  if (opt) opt->flush_state_views();
  if (o.progress) o.progress("done", 0, 0);
  return join(dir, job.tag);
}

}  // namespace

std::string save(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, Optimizer* opt,
                 const std::string& dir, const SaveOptions& o) {
  // An earlier asynchronous save's error surfaces here, before this save
  // starts, as it is: one a loss cut short is not healed (a trainer that
  // healed would go on with that checkpoint incomplete), so it stays
  // ZS_ERR_COMM, a restart from the last whole checkpoint.
  wait_for_pending_save(ctx);
  try {
    return save_now(ctx, params, opt, dir, o);
  } catch (const Error& e) {
    // Healing: a save cut short by a lost rank (its store waits) is that
    // loss, as a collective's failure is, so the trainer heals and saves
    // again with the replacement.
    Code code = e.code();
    std::string note;
    if (ctx.as_loss(code, e.what(), &note)) fail(code, e.what(), note);
    throw;
  }
}

}  // namespace zs::ckpt
