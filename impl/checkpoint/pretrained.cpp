#include "impl/checkpoint/pretrained.h"

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <map>
#include <mutex>

#include <nlohmann/json.hpp>

#include "impl/checkpoint/file_io.h"
#include "impl/device/buffer.h"
#include "impl/checkpoint/safetensors.h"
#include "impl/checkpoint/state_names.h"
#include "impl/device/ops.h"
#include "impl/fetch/coordinator.h"
#include "impl/fetch/gather.h"
#include "impl/partition/shard_residence.h"

namespace zs::ckpt {
namespace {

using nlohmann::json;

// name -> file, for a single file or an index's weight_map.
std::map<std::string, std::string> weight_map(const std::string& path, std::vector<std::string>* files) {
  std::string index;
  std::string single;
  if (is_dir(path)) {
    if (exists(join(path, "model.safetensors.index.json"))) index = join(path, "model.safetensors.index.json");
    else if (exists(join(path, "model.safetensors"))) single = join(path, "model.safetensors");
    else fail(Code::Io, "'", path, "' holds neither model.safetensors.index.json nor model.safetensors");
  } else if (path.size() > 5 && path.substr(path.size() - 5) == ".json") {
    index = path;
  } else {
    single = path;
  }
  std::map<std::string, std::string> out;
  if (!single.empty()) {
    files->push_back(single);
    return out;  // empty map: every name in the one file
  }
  json j;
  try {
    j = json::parse(read_text(index));
    for (const auto& [name, file] : j.at("weight_map").items()) {
      const std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f[0] == '.')
        fail(Code::Io, "'", index, "': weight_map['", name, "'] = '", f, "' is not a file name beside it");
      out[name] = join(parent_dir(index), f);
    }
  } catch (const json::exception& e) {
    fail(Code::Io, "'", index, "' is not a safetensors index: ", e.what());
  }
  for (const auto& [n, f] : out)
    if (std::find(files->begin(), files->end(), f) == files->end()) files->push_back(f);
  return out;
}

struct Staged {
  void* dst;
  size_t bytes;
  std::unique_ptr<char[]> host;
};

// Rank 0's status to every rank: empty, or a code and a message.
void share_status(Context& ctx, Code* code, std::string* message) {
  uint64_t head[2] = {static_cast<uint64_t>(*code), message->size()};
  ctx.world()->run("load_pretrained status", [&](Communicator& c) { c.broadcast(head, sizeof(head), 0); });
  message->resize(head[1]);
  *code = static_cast<Code>(head[0]);
  if (head[1] > 0)
    ctx.world()->run("load_pretrained status", [&](Communicator& c) { c.broadcast(message->data(), head[1], 0); });
}

size_t load_from_rank0(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, Optimizer* opt,
                       const std::string& path, const PretrainedOptions& o) {
  const NameOf name_of = checkpoint_names(params, o.names, "load_pretrained");
  for (const auto& p : params)
    if (p->group->size() != ctx.world()->size())
      fail(Code::NotSupported, "load_pretrained from rank 0: ", p->describe(), " is partitioned over group '",
           p->group->name(), "', not the world");
  const bool root = ctx.members().rank == 0;
  // Rank 0 checks every tensor before anything moves.
  std::map<std::string, File> files;
  std::map<std::string, StHeader> headers;
  std::vector<StTensor> found(params.size());
  std::vector<uint8_t> present(params.size(), 0);
  Code code = Code::Ok;
  std::string error;
  if (root) {
    try {
      std::vector<std::string> file_list;
      const auto wmap = weight_map(path, &file_list);
      for (size_t i = 0; i < params.size(); ++i) {
        const Param& p = *params[i];
        const std::string& name = name_of.at(&p);
        const std::string f = wmap.empty() ? file_list.front() : (wmap.count(name) ? wmap.at(name) : "");
        const StTensor* t = nullptr;
        if (!f.empty()) {
          if (!files.count(f)) {
            files.emplace(f, File::open_read(f));
            headers[f] = read_st_header(files.at(f));
          }
          for (const auto& x : headers.at(f).tensors)
            if (x.key == name) t = &x;
        }
        if (t == nullptr) {
          if (o.strict) fail(Code::InvalidArgument, "load_pretrained: '", path, "' has no tensor '", name, "'");
          continue;
        }
        if (t->shape != p.shape)
          fail(Code::InvalidArgument, "load_pretrained: tensor '", name, "' in '", f, "' has another shape than ",
               p.describe());
        found[i] = *t;
        found[i].key = f;  // which file
        present[i] = 1;
      }
    } catch (const Error& e) {
      code = e.code();
      error = e.what();
    }
  }
  share_status(ctx, &code, &error);
  if (!error.empty()) throw Error(code, root ? error : "load_pretrained failed on rank 0: " + error);
  ctx.world()->run("load_pretrained plan", [&](Communicator& c) { c.broadcast(present.data(), present.size(), 0); });

  struct Out {
    void* dst;
    std::unique_ptr<Buffer> staged;  // this rank's shard, until every one arrived
  };
  std::vector<Out> outs;
  std::vector<ShardAccess> writing;  // shards resident until the copies land
  uint64_t total = 0, done = 0;
  for (const auto& p : params) total += p->full_bytes();
  size_t loaded = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!present[i]) continue;
    Param& p = *params[i];
    const bool master = opt && !opt->master_in_shard(p) && opt->has_state(p, 0);
    // rank 0: the full tensor, padded, in the param's dtype (and fp32)
    std::vector<char> full, full32;
    if (root) {
      try {
        const StTensor& t = found[i];
        std::vector<char> raw(p.layout.numel * dtype_size(t.dtype));
        read_st_elements(files.at(t.key), t, 0, p.layout.numel, raw.data(), name_of.at(&p));
        full.assign(p.padded_bytes(), 0);
        std::vector<float> f32;
        if (t.dtype != p.dtype || master) {
          f32.resize(p.layout.numel);
          ops::cast_to_f32(*host_device(), raw.data(), t.dtype, f32.data(), p.layout.numel);
        }
        if (t.dtype == p.dtype && !raw.empty()) std::memcpy(full.data(), raw.data(), raw.size());
        else ops::cast_from_f32(*host_device(), f32.data(), p.dtype, full.data(), p.layout.numel);
        if (master) {
          full32.assign(p.layout.padded_numel * sizeof(float), 0);
          if (!f32.empty()) std::memcpy(full32.data(), f32.data(), f32.size() * sizeof(float));
        }
      } catch (const Error& e) {
        code = e.code();
        error = e.what();
      } catch (const std::bad_alloc&) {
        code = Code::OutOfMemory;
        error = "load_pretrained: out of host memory for " + p.describe();
      }
    }
    share_status(ctx, &code, &error);
    if (!error.empty()) throw Error(code, root ? error : "load_pretrained failed on rank 0: " + error);
    auto scatter = [&](const std::vector<char>& src, size_t shard_bytes, void* dst) {
      std::vector<const void*> inputs;
      if (root)
        for (int r = 0; r < p.group->size(); ++r) inputs.push_back(src.data() + static_cast<size_t>(r) * shard_bytes);
      Out out{dst, std::make_unique<Buffer>(ctx.device(), shard_bytes, MemKind::IoStaging)};
      void* recv = out.staged->data();
      p.group->run("load_pretrained " + p.describe(), [&](Communicator& c) { c.scatter(inputs, recv, shard_bytes, 0); });
      outs.push_back(std::move(out));
    };
    writing.emplace_back(ctx, p, ShardAccess::Write);
    scatter(full, p.shard_bytes(), writing.back().data());
    if (master) scatter(full32, p.layout.shard_numel * sizeof(float), opt->state_locked(p, 0, nullptr));
    ++loaded;
    done += p.full_bytes();
    if (o.progress) o.progress(done, total);
  }
  for (const auto& out : outs) ctx.device()->copy(out.dst, out.staged->data(), out.staged->bytes());
  ctx.device()->synchronize();
  if (opt) opt->flush_state_views();  // masters on NVMe go back to the swap file
  shards_rewritten(ctx, params);
  return loaded;
}

}  // namespace

size_t load_pretrained(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, Optimizer* opt,
                       const std::string& path, const PretrainedOptions& o) {
  const auto held = ctx.lock();  // the engine's state stays still while it is read or written
  const memory_tally::PhaseScope phase(MemPhase::Construction);  // a model's weights coming in
  if (ctx.replacing()) {
    // A replacement's shards come from its holder's replica at
    // zs_heal_join (the survivors, who hold the trained state, do not load).
    static std::once_flag said;
    std::call_once(said, [&] {
      std::fprintf(stderr, "zeroshard: rank %d replaces a lost rank: load_pretrained('%s') reads nothing; the "
                   "state comes from the peers' copies at zs_heal_join\n", ctx.ranks().rank, path.c_str());
    });
    return 0;
  }
  if (o.from_rank0 && ctx.members().world_size > 1) return load_from_rank0(ctx, params, opt, path, o);
  std::vector<Staged> staged;
  std::vector<ShardAccess> writing;  // shards resident until the copies land
  size_t loaded = 0;
  std::string error;
  Code error_code = Code::Ok;
  try {
    const NameOf name_of = checkpoint_names(params, o.names, "load_pretrained");
    std::vector<std::string> file_list;
    const auto wmap = weight_map(path, &file_list);
    std::map<std::string, File> files;
    std::map<std::string, std::map<std::string, StTensor>> headers;
    auto tensor_of = [&](const std::string& name, std::string* file) -> const StTensor* {
      const std::string f = wmap.empty() ? file_list.front() : (wmap.count(name) ? wmap.at(name) : "");
      if (f.empty()) return nullptr;
      if (!files.count(f)) {
        files.emplace(f, File::open_read(f));
        for (auto& t : read_st_header(files.at(f)).tensors) headers[f][t.key] = t;
      }
      *file = f;
      auto it = headers[f].find(name);
      return it == headers[f].end() ? nullptr : &it->second;
    };
    uint64_t total = 0, done = 0;
    for (const auto& p : params) total += p->layout.shard_valid * p->elem_bytes();
    for (const auto& sp : params) {
      Param& p = *sp;
      const std::string& name = name_of.at(&p);
      std::string file;
      const StTensor* t = tensor_of(name, &file);
      if (t == nullptr) {
        if (o.strict)
          fail(Code::InvalidArgument, "load_pretrained: '", path, "' has no tensor '", name, "'");
        continue;
      }
      if (t->shape != p.shape) {
        std::string a, b;
        for (auto d : t->shape) a += (a.empty() ? "" : ", ") + std::to_string(d);
        for (auto d : p.shape) b += (b.empty() ? "" : ", ") + std::to_string(d);
        fail(Code::InvalidArgument, "load_pretrained: tensor '", name, "' in '", file, "' has shape [", a,
             "], the param [", b, "]");
      }
      const uint64_t n = p.layout.shard_valid;
      const uint64_t esz = dtype_size(t->dtype);
      std::vector<char> raw(n * esz);
      read_st_elements(files.at(file), *t, p.layout.shard_offset, n, raw.data(), name);
      std::vector<float> f32;
      if (t->dtype != p.dtype || (opt && p.dtype != DType::F32)) {
        f32.resize(n);
        ops::cast_to_f32(*host_device(), raw.data(), t->dtype, f32.data(), n);
      }
      writing.emplace_back(ctx, p, ShardAccess::Write);
      Staged s{writing.back().data(), p.shard_bytes(), std::unique_ptr<char[]>(new char[p.shard_bytes()])};
      std::memset(s.host.get(), 0, s.bytes);
      if (t->dtype == p.dtype && !raw.empty()) std::memcpy(s.host.get(), raw.data(), raw.size());
      else ops::cast_from_f32(*host_device(), f32.data(), p.dtype, s.host.get(), n);
      staged.push_back(std::move(s));
      if (opt && !opt->master_in_shard(p) && opt->has_state(p, 0)) {
        Staged m{opt->state_locked(p, 0, nullptr), p.layout.shard_numel * sizeof(float),
                 std::unique_ptr<char[]>(new char[p.layout.shard_numel * sizeof(float)])};
        std::memset(m.host.get(), 0, m.bytes);
        if (n > 0) std::memcpy(m.host.get(), f32.data(), n * sizeof(float));
        staged.push_back(std::move(m));
      }
      ++loaded;
      done += n * p.elem_bytes();
      if (o.progress) o.progress(done, total);
    }
  } catch (const Error& e) {
    error = e.what();
    error_code = e.code();
  } catch (const std::bad_alloc&) {
    error = "load_pretrained: out of host memory";
    error_code = Code::OutOfMemory;
  }
  if (ctx.members().world_size > 1) {
    float failed = error.empty() ? 0.0f : static_cast<float>(ctx.members().rank + 1);
    ctx.world()->run("load_pretrained agreement", [&](Communicator& c) {
      c.allreduce(&failed, &failed, 1, DType::F32, ReduceOp::Max);
    });
    if (error.empty() && failed > 0.0f)
      fail(Code::Io, "load_pretrained failed on rank ", static_cast<int>(failed) - 1,
           " (its error says why); nothing was changed");
  }
  if (!error.empty()) throw Error(error_code, error);
  for (const auto& s : staged) ctx.device()->copy(s.dst, s.host.get(), s.bytes);
  ctx.device()->synchronize();
  if (opt) opt->flush_state_views();  // masters on NVMe go back to the swap file
  shards_rewritten(ctx, params);
  return loaded;
}

}  // namespace zs::ckpt
