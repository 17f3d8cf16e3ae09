#include "impl/checkpoint/offline.h"

#include <xxhash.h>

#include <algorithm>
#include <map>

#include "impl/checkpoint/safetensors.h"
#include "impl/checkpoint/state_names.h"
#include "impl/common/error.h"
#include "impl/device/ops.h"
#include "impl/partition/layout.h"

namespace zs::ckpt {
namespace {

constexpr uint64_t kPiece = 8u << 20;
// verify() hashes whole blocks within a piece.
static_assert(kPiece % kMaxBlockBytes == 0);

void note(VerifyReport& r, const std::string& what) {
  if (r.problems.size() < 100) r.problems.push_back(what);
}

}  // namespace

VerifyReport verify(const std::string& path, const std::string& tag, const Progress& progress) {
  VerifyReport r;
  r.dir = resolve_checkpoint_dir(path, tag);
  const Manifest m = Manifest::read(r.dir);
  uint64_t total = 0, done = 0;
  for (const auto& f : m.files) total += 2 * f.bytes;
  // file index -> its chunks, with the param and state they belong to
  struct Ref {
    const ParamEntry* p;
    std::string state;
    const Chunk* c;
  };
  std::map<int, std::vector<Ref>> by_file;
  for (const auto& p : m.params)
    for (const auto& [state, chunks] : p.states)
      for (const auto& c : chunks) by_file[c.file].push_back({&p, state, &c});
  std::vector<char> buf(kPiece);
  for (size_t i = 0; i < m.files.size(); ++i) {
    const FileEntry& fe = m.files[i];
    const std::string fpath = join(r.dir, fe.name);
    ++r.files;
    try {
      File f = File::open_read(fpath);
      const uint64_t size = f.size();
      // Structure first: a truncated file is named with the tensor it cuts.
      StHeader h;
      try {
        h = read_st_header(f);
      } catch (const Error& e) {
        note(r, e.what());
      }
      std::map<std::string, const StTensor*> in_file;
      for (const auto& t : h.tensors) in_file[t.key] = &t;
      for (const auto& ref : by_file[static_cast<int>(i)]) {
        auto it = in_file.find(ref.c->key);
        if (h.tensors.empty() && h.data_begin == 0) break;  // header unreadable: noted
        if (it == in_file.end()) {
          note(r, "checkpoint file '" + fpath + "' has no tensor '" + ref.c->key + "' (param '" +
                      ref.p->name + "', " + ref.state + ")");
        } else if (it->second->begin != ref.c->begin || it->second->bytes != ref.c->bytes() ||
                   it->second->dtype != ref.c->dtype) {
          note(r, "checkpoint file '" + fpath + "': tensor '" + ref.c->key +
                      "' lies elsewhere or has another dtype than the manifest says");
        }
      }
      // Whole-file checksum.
      XXH3_state_t* st = XXH3_createState();
      XXH3_64bits_reset(st);
      uint64_t read = 0;
      for (uint64_t at = 0; at < size; at += kPiece) {
        const uint64_t n = std::min(kPiece, size - at);
        f.pread_all(buf.data(), n, at, "its bytes");
        XXH3_64bits_update(st, buf.data(), n);
        read += n;
        done += n;
        if (progress) progress(done, total);
      }
      const uint64_t got = XXH3_64bits_digest(st);
      XXH3_freeState(st);
      r.bytes += read;
      if (size != fe.bytes)
        note(r, "checkpoint file '" + fpath + "' is " + std::to_string(size) + " bytes, the manifest says " +
                    std::to_string(fe.bytes) + (size < fe.bytes ? " (truncated)" : ""));
      else if (got != fe.xxh3)
        note(r, "checkpoint file '" + fpath + "' fails its checksum: xxh3 " + hex64(got) +
                    ", the manifest says " + hex64(fe.xxh3));
      // Per tensor and per block, naming the tensor.
      for (const auto& ref : by_file[static_cast<int>(i)]) {
        const Chunk& c = *ref.c;
        ++r.tensors;
        const std::string name = "tensor '" + c.key + "' (param '" + ref.p->name + "', " + ref.state + ")";
        if (c.begin + c.bytes() > size) {
          note(r, "checkpoint file '" + fpath + "' is truncated: " + name + " needs bytes up to " +
                      std::to_string(c.begin + c.bytes()) + ", the file has " + std::to_string(size));
          continue;
        }
        XXH3_state_t* ts = XXH3_createState();
        XXH3_64bits_reset(ts);
        std::string bad_block;
        for (uint64_t at = 0; at < c.bytes(); at += kPiece) {
          const uint64_t n = std::min(kPiece, c.bytes() - at);
          f.pread_all(buf.data(), n, c.begin + at, name);
          XXH3_64bits_update(ts, buf.data(), n);
          for (uint64_t b = 0; b < n; b += m.block_bytes) {
            const uint64_t bn = std::min(m.block_bytes, n - b);
            const uint64_t idx = (at + b) / m.block_bytes;
            if (bad_block.empty() && XXH3_64bits(buf.data() + b, bn) != c.blocks[idx])
              bad_block = "bytes [" + std::to_string(c.begin + at + b) + ", " +
                          std::to_string(c.begin + at + b + bn) + ")";
          }
          done += n;
          if (progress) progress(done, total);
        }
        const uint64_t th = XXH3_64bits_digest(ts);
        XXH3_freeState(ts);
        if (th != c.xxh3 || !bad_block.empty())
          note(r, "checkpoint file '" + fpath + "': " + name + " fails its checksum" +
                      (bad_block.empty() ? "" : " in " + bad_block + " of the file") + ": xxh3 " +
                      hex64(th) + ", the manifest says " + hex64(c.xxh3));
      }
    } catch (const Error& e) {
      note(r, e.what());
    }
  }
  return r;
}

ExportReport export_consolidated(const std::string& path, const std::string& tag,
                                 const std::string& out, const ExportOptions& o) {
  ExportReport rep;
  const std::string dir = resolve_checkpoint_dir(path, tag);
  const Manifest m = Manifest::read(dir);
  ChunkReader reader(dir, m);
  reader.check_sizes();
  struct Plan {
    const ParamEntry* p;
    std::string state;
    DType dtype;
  };
  std::vector<StTensor> tensors;
  std::map<std::string, Plan> plans;
  uint64_t total = 0;
  for (const auto& p : m.params) {
    const DType dt = o.fp32 ? DType::F32 : p.dtype;
    const std::string state = (!o.fp32 || p.dtype == DType::F32) ? kParam
                              : (p.states.count(kMaster) ? kMaster : kParam);
    tensors.push_back({p.name, dt, p.shape, p.numel * dtype_size(dt), 0});
    plans[p.name] = {&p, state, dt};
    total += p.numel * dtype_size(dt);
  }
  const std::string header = st_header(tensors, {{"format", "pt"}});
  const std::string tmp = out + ".tmp";
  File f = File::create(tmp);
  try {
    f.write_all(header.data(), header.size());
    std::vector<char> src, dst;
    std::vector<float> f32;
    uint64_t done = 0;
    for (const auto& t : tensors) {  // file order
      const Plan& plan = plans.at(t.key);
      const auto st = plan.p->states.find(plan.state);
      if (st == plan.p->states.end()) {  // a zero-size param
        ++rep.tensors;
        continue;
      }
      for (const auto& c : st->second) {
        const uint64_t step = std::max<uint64_t>(1, kPiece / dtype_size(c.dtype));
        for (uint64_t at = c.offset; at < c.offset + c.numel; at += step) {
          const uint64_t n = std::min(step, c.offset + c.numel - at);
          src.resize(n * dtype_size(c.dtype));
          reader.read(c, at, n, src.data(), "param '" + plan.p->name + "', " + plan.state);
          const char* data = src.data();
          if (c.dtype != plan.dtype) {
            f32.resize(n);
            dst.resize(n * dtype_size(plan.dtype));
            ops::cast_to_f32(*host_device(), src.data(), c.dtype, f32.data(), n);
            ops::cast_from_f32(*host_device(), f32.data(), plan.dtype, dst.data(), n);
            data = dst.data();
          }
          f.write_all(data, n * dtype_size(plan.dtype));
          done += n * dtype_size(plan.dtype);
          if (o.progress) o.progress(done, total);
        }
      }
      ++rep.tensors;
    }
    f.sync();
    f.close();
    rename_path(tmp, out);
    sync_dir(parent_dir(out));
  } catch (...) {
    try { remove_tree(tmp); } catch (const Error&) {}
    throw;
  }
  rep.bytes = header.size() + total;
  return rep;
}

void reshard(const std::string& path, const std::string& tag, const std::string& out_dir,
             int world, const Progress& progress) {
  if (world < 1) fail(Code::InvalidArgument, "reshard: world size ", world, ": expected >= 1");
  if (out_dir.empty()) fail(Code::InvalidArgument, "reshard: the output directory is empty");
  const std::string dir = resolve_checkpoint_dir(path, tag);
  const Manifest m = Manifest::read(dir);
  if (exists(out_dir)) fail(Code::InvalidArgument, "reshard: '", out_dir, "' already exists");
  ChunkReader reader(dir, m);
  reader.check_sizes();
  Manifest out = m;
  out.moves_latest = false;  // a checkpoint of its own, wherever it is written, never a cut-off save
  out.world_size = world;
  out.topology = {{"world_size", world}, {"resharded_from", m.topology}};
  out.files.clear();
  for (auto& p : out.params)
    for (auto& [state, chunks] : p.states) chunks.clear();
  uint64_t total = 0, before = 0;
  for (const auto& p : m.params)
    for (const auto& [state, chunks] : p.states) total += p.numel * dtype_size(chunks.front().dtype);
  const std::string partial = out_dir + ".partial";
  remove_tree(partial);
  make_dir(partial);
  try {
    for (int r = 0; r < world; ++r) {
      std::vector<std::vector<char>> data;
      std::vector<ShardSource> sources;
      data.reserve(m.params.size() * 4);
      // Chunks land in `out` in place; std::map nodes and reserved vectors
      // keep the pointers valid.
      for (size_t i = 0; i < m.params.size(); ++i) {
        const ParamEntry& p = m.params[i];
        const ShardLayout l = ShardLayout::make(p.numel, world, r);
        if (l.shard_valid == 0) continue;
        for (const auto& [state, chunks] : p.states) {
          const DType dt = chunks.front().dtype;
          data.emplace_back(l.shard_valid * dtype_size(dt));
          for (const Piece& piece : overlaps(spans_of(chunks), l.shard_offset, l.shard_valid))
            reader.read(chunks[piece.source], piece.offset, piece.numel,
                        data.back().data() + (piece.offset - l.shard_offset) * dtype_size(dt),
                        "param '" + p.name + "', " + state);
          auto& dst = out.params[i].states[state];
          dst.reserve(static_cast<size_t>(world));
          Chunk c;
          c.file = r;
          c.offset = l.shard_offset;
          dst.push_back(c);
          sources.push_back({state + "/" + p.name, dt, l.shard_valid, data.back().data(), &dst.back(), {}});
        }
      }
      const std::string name = rank_file_name(r, world);
      Progress inner;
      if (progress) inner = [&](uint64_t d, uint64_t) { progress(before + d, total); };
      FileEntry fe = write_shard_file(join(partial, name), sources, *host_device(),
                                      {{"format", kFormatName}, {"rank", std::to_string(r)},
                                       {"world_size", std::to_string(world)}},
                                      inner);
      for (const auto& src : sources) before += src.numel * dtype_size(src.dtype);
      fe.name = name;
      fe.rank = r;
      out.files.push_back(fe);
    }
    // What is written must read back.
    const Manifest checked = Manifest::from_json(out.to_json(), "the resharded manifest");
    const std::string text = checked.to_json().dump(1);
    File f = File::create(join(partial, kManifest));
    f.write_all(text.data(), text.size());
    f.sync();
    f.close();
    sync_dir(partial);
    rename_path(partial, out_dir);
    sync_dir(parent_dir(out_dir));
  } catch (...) {
    try { remove_tree(partial); } catch (const Error&) {}
    throw;
  }
}

}  // namespace zs::ckpt
