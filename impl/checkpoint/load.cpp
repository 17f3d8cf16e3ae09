#include "impl/checkpoint/load.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "impl/checkpoint/format.h"
#include "impl/checkpoint/json_text.h"
#include "impl/checkpoint/pending_save.h"
#include "impl/checkpoint/reshard_plan.h"
#include "impl/checkpoint/shard_io.h"
#include "impl/checkpoint/state_names.h"
#include "impl/device/ops.h"
#include "impl/fetch/coordinator.h"
#include "impl/fetch/gather.h"
#include "impl/grad/reducer.h"
#include "impl/partition/shard_residence.h"

namespace zs::ckpt {
namespace {

using nlohmann::json;

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Elements [first, first + n) of a state into dst (host, dst_dtype),
// casting from the stored dtype where they differ.
void read_state(ChunkReader& reader, const ParamEntry& e, const std::string& state, uint64_t first,
                uint64_t n, DType dst_dtype, void* dst, uint64_t* done, uint64_t total,
                const LoadOptions& o) {
  const auto& chunks = e.states.at(state);
  const std::string what = "param '" + e.name + "', " + state;
  std::vector<char> tmp;
  for (const Piece& piece : overlaps(spans_of(chunks), first, n)) {
    const Chunk& c = chunks[piece.source];
    const uint64_t lo = piece.offset, hi = piece.offset + piece.numel;
    char* out = static_cast<char*>(dst) + (lo - first) * dtype_size(dst_dtype);
    if (c.dtype == dst_dtype) {
      reader.read(c, lo, hi - lo, out, what);
    } else {
      tmp.resize((hi - lo) * dtype_size(c.dtype));
      reader.read(c, lo, hi - lo, tmp.data(), what);
      std::vector<float> f32(hi - lo);
      ops::cast_to_f32(*host_device(), tmp.data(), c.dtype, f32.data(), hi - lo);
      ops::cast_from_f32(*host_device(), f32.data(), dst_dtype, out, hi - lo);
    }
    *done += (hi - lo) * dtype_size(c.dtype);
    if (o.progress) o.progress("read", *done, total);
  }
}

// A staged copy, applied once every rank has read its part.
struct Staged {
  void* dst;  // engine memory
  size_t bytes = 0;
  AlignedBuffer buf;
  char* host = nullptr;  // in buf; not zero-filled: read over, padding zeroed
};

// Where in its first page the staged copy of elements [first, ...) of a
// state starts: at the file's offset of the chunk holding `first`, so the
// bulk of that chunk reads with O_DIRECT (ChunkReader::direct_offset).
uint64_t staging_offset(const ParamEntry& e, const std::string& state, uint64_t first, DType dst_dtype) {
  for (const auto& c : e.states.at(state))
    if (c.offset <= first && first < c.offset + c.numel)
      return c.dtype == dst_dtype ? ChunkReader::direct_offset(c, first) : 0;
  return 0;
}

}  // namespace

LoadResult load(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, Optimizer* opt,
                const std::string& path, const LoadOptions& o) {
  wait_for_pending_save(ctx);  // it may be writing the checkpoint asked for
  const auto held = ctx.lock();  // the engine's state stays still while it is read or written
  const memory_tally::PhaseScope phase(MemPhase::Checkpoint);
  LoadResult result;
  std::vector<Staged> staged;
  // Shards resident until the staged copies land in them (offload: read
  // back from the swap file, written back when the cache drops them).
  std::vector<ShardAccess> writing;
  json opt_j;
  std::map<const Param*, std::set<std::string>> named_kept;  // an external optimizer's states, by param
  int64_t steps = 0;  // of opt_j, read with the rest before anything changes
  LossScaler::State scaler;
  std::string error;
  Code error_code = Code::Ok;
  try {
    result.dir = resolve_checkpoint_dir(path, o.tag);
    const Manifest m = Manifest::read(result.dir);
    result.user_json = m.user.dump();
    result.step = m.step;
    const NameOf name_of = checkpoint_names(params, o.names, "checkpoint load");
    std::set<std::string> names;
    for (const auto& p : params) {
      const std::string& name = name_of.at(p.get());
      names.insert(name);
      const ParamEntry* e = m.find(name);
      if (e == nullptr)
        fail(Code::InvalidArgument, "checkpoint '", result.dir, "' has no param '", name, "'");
      if (e->shape != p->shape)
        fail(Code::InvalidArgument, "checkpoint '", result.dir, "': param '", name, "' has shape ",
             shape_str(e->shape), ", the registered one ", shape_str(p->shape));
    }
    if (o.strict)
      for (const auto& e : m.params)
        if (!names.count(e.name))
          fail(Code::InvalidArgument, "checkpoint '", result.dir, "' holds param '", e.name,
               "', which is not among the ", params.size(), " params being loaded (load non-strict to skip it)");
    if (opt) {
      opt->expect_no_open_step("checkpoint load");
      if (m.optimizer.is_null())
        fail(Code::InvalidArgument, "checkpoint '", result.dir, "' was saved without an optimizer");
      opt_j = m.optimizer;
      const std::string where = "checkpoint '" + result.dir + "' optimizer";
      const OptimKind kind = parse_optim_kind(opt_j.at("kind").get<std::string>(), where);
      if (kind != opt->kind())
        fail(Code::InvalidArgument, where, " is ", optim_kind_name(kind), ", this one is ",
             optim_kind_name(opt->kind()));
      const auto& groups = opt_j.at("groups");
      if (groups.size() != opt->num_groups())
        fail(Code::InvalidArgument, where, " has ", groups.size(), " param groups, this one has ",
             opt->num_groups());
      for (size_t g = 0; g < opt->num_groups(); ++g) {
        std::set<std::string> mine, theirs;
        for (const auto& p : opt->group_params(g))
          if (name_of.count(p.get())) mine.insert(name_of.at(p.get()));
        for (const auto& n : groups[g].at("params")) theirs.insert(n.get<std::string>());
        if (mine != theirs)
          fail(Code::InvalidArgument, where, ": group ", g, " holds other params (", theirs.size(),
               " in the checkpoint, ", mine.size(), " here, among the params being loaded)");
        (void)hparams_from_json(groups[g].at("hparams"), where);
      }
      // Read here, where a bad value fails every rank before anything
      // changes (and strictly: get<int64_t> of 1e300 is undefined).
      steps = json_int(opt_j.at("steps"), where + ": steps", 0, INT64_MAX);
      const auto& ls = opt_j.at("loss_scaler");
      scaler.scale = ls.at("scale").get<double>();
      scaler.hysteresis_left = json_int(ls.at("hysteresis_left"), where + ": loss_scaler.hysteresis_left",
                                        INT64_MIN, INT64_MAX);
      scaler.iter = json_int(ls.at("iter"), where + ": loss_scaler.iter", INT64_MIN, INT64_MAX);
      scaler.last_overflow_iter =
          json_int(ls.at("last_overflow_iter"), where + ": loss_scaler.last_overflow_iter", INT64_MIN, INT64_MAX);
    }

    ChunkReader reader(result.dir, m);
    reader.check_sizes();
    // What to read: (param, state, target dtype, engine memory).
    struct Item {
      const Param* p;
      const ParamEntry* e;
      std::string state;
      DType dtype;
      void* dst;
    };
    std::vector<Item> items;
    writing.reserve(params.size());
    for (const auto& sp : params) {
      const Param& p = *sp;
      const ParamEntry& e = *m.find(name_of.at(&p));
      if (p.layout.numel == 0) continue;  // nothing saved, nothing to read
      const bool has_master = e.states.count(kMaster) > 0;
      // fp32 values: the master when saved, else the param itself.
      const std::string f32_src = has_master ? kMaster : kParam;
      // The working shard: bit for bit when the dtype is unchanged, else
      // cast from the best fp32 values there are.
      const std::string work_src = e.dtype == p.dtype ? kParam : f32_src;
      writing.emplace_back(ctx, *sp, ShardAccess::Write);
      items.push_back({&p, &e, work_src, p.dtype, writing.back().data()});
      if (!opt || !opt->has_state(p, 0)) continue;
      // An fp32 master of its own (a 16-bit param's): the saved master, or
      // the saved param widened. Where the shard is the master (fp32, or
      // bf16 under bf16_master_weights_and_grads) the working shard above
      // is all: a bf16 param's saved shard is its saved master rounded to
      // bf16 (a step or sync_params writes it so).
      if (!opt->master_in_shard(p))
        items.push_back({&p, &e, f32_src, DType::F32, opt->state_locked(p, 0, nullptr)});
      if (opt->kind() == OptimKind::External) {
        // The caller's named states become the saved ones: each made here
        // (zeros until the staged copy lands), others dropped once loaded.
        std::set<std::string>& kept = named_kept[&p];
        for (const auto& [state, chunks] : e.states) {
          if (state == kParam || state == kMaster) continue;
          kept.insert(state);
          items.push_back({&p, &e, state, DType::F32, opt->named_state_locked(p, state, true, nullptr)});
        }
        continue;
      }
      for (int slot = 1; slot < 3; ++slot) {
        const std::string s = state_name(*opt, p, slot);
        const bool saved = e.states.count(s) > 0;
        if (!saved && opt->has_state(p, slot))
          fail(Code::InvalidArgument, "checkpoint '", result.dir, "': param '", e.name, "' has no ", s,
               " state, which this optimizer keeps");
        if (saved) {  // cast from the saved dtype to the slot's (fp32 <-> bf16) as read
          DType dtype = DType::F32;
          void* dst = opt->ensure_state(p, slot, &dtype, nullptr);
          items.push_back({&p, &e, s, dtype, dst});
        }
      }
    }
    uint64_t total = 0, done = 0;
    for (const auto& it : items) {
      const auto st = it.e->states.find(it.state);
      if (st == it.e->states.end())
        fail(Code::Io, "checkpoint '", result.dir, "': param '", it.e->name, "' has no ", it.state, " state");
      total += it.p->layout.shard_valid * dtype_size(st->second.front().dtype);
    }
    for (const auto& it : items) {
      const Param& p = *it.p;
      Staged s;
      s.dst = it.dst;
      s.bytes = p.layout.shard_numel * dtype_size(it.dtype);
      const uint64_t at = staging_offset(*it.e, it.state, p.layout.shard_offset, it.dtype);
      s.buf = AlignedBuffer(at + s.bytes);
      s.host = s.buf.data() + at;
      const size_t valid = p.layout.shard_valid * dtype_size(it.dtype);
      std::memset(s.host + valid, 0, s.bytes - valid);  // padding stays zero
      read_state(reader, *it.e, it.state, p.layout.shard_offset, p.layout.shard_valid, it.dtype,
                 s.host, &done, total, o);
      staged.push_back(std::move(s));
    }
    result.bytes_read = reader.bytes_read();
  } catch (const Error& e) {
    error = e.what();
    error_code = e.code();
  } catch (const json::exception& e) {
    error = "checkpoint '" + result.dir + "': manifest: " + e.what();
    error_code = Code::Io;
  } catch (const std::bad_alloc&) {
    error = "checkpoint load: out of host memory staging this rank's shards";
    error_code = Code::OutOfMemory;
  }

  // Every rank read its part, or nobody changes anything.
  const int world = ctx.members().world_size;
  if (world > 1) {
    float failed = error.empty() ? 0.0f : static_cast<float>(ctx.members().rank + 1);
    ctx.world()->run("checkpoint load agreement", [&](Communicator& c) {
      c.allreduce(&failed, &failed, 1, DType::F32, ReduceOp::Max);
    });
    if (error.empty() && failed > 0.0f)
      fail(Code::Io, "checkpoint load failed on rank ", static_cast<int>(failed) - 1,
           " (its error says why); nothing was changed");
  }
  if (!error.empty()) throw Error(error_code, error);

  if (opt) {
    const auto& groups = opt_j.at("groups");
    for (size_t g = 0; g < opt->num_groups(); ++g)
      opt->set_hparams_locked(static_cast<int>(g), hparams_from_json(groups[g].at("hparams"), "checkpoint"));
    opt->set_steps_locked(steps);
    opt->scaler().set_state(scaler);
  }
  for (const auto& s : staged)
    if (s.bytes > 0) ctx.device()->copy(s.dst, s.host, s.bytes);
  ctx.device()->synchronize();
  if (opt) opt->flush_state_views();  // state on NVMe goes back to the swap file
  for (const auto& [p, kept] : named_kept) opt->keep_named_states_locked(*p, kept);
  shards_rewritten(ctx, params);
  // qgZ's LoCo errors are not saved: start from zero, as at a reset_T boundary.
  grads(ctx).reset_error_feedback();
  if (o.progress) o.progress("done", 0, 0);
  return result;
}

}  // namespace zs::ckpt
