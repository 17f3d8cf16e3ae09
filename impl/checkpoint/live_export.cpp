#include "impl/checkpoint/live_export.h"

#include <map>

#include "impl/checkpoint/file_io.h"
#include "impl/checkpoint/safetensors.h"
#include "impl/checkpoint/state_names.h"
#include "impl/fetch/gather.h"

namespace zs::ckpt {

void export_live(Context& ctx, const std::vector<std::shared_ptr<Param>>& params,
                 const std::vector<std::string>& names, const std::string& out, const Progress& progress) {
  const auto held = ctx.lock();  // the engine's state stays still while it is read or written
  if (out.empty()) fail(Code::InvalidArgument, "export: the output file name is empty");
  const NameOf name_of = checkpoint_names(params, names, "export");
  // A gather still in flight is waited for, not refused: the coordinator
  // prefetches ahead of a step the trainer may leave open (an evaluation
  // forward just before the export), and every rank issued it alike. A
  // failed one is the context's async error, raised below.
  for (const auto& p : params) {
    settle_locked(ctx, *p);
    if (p->status() != ParamStatus::Inflight) continue;
    try {
      p->inflight()->wait(-1);
    } catch (const Error&) {
    }
    settle_locked(ctx, *p);
  }
  ctx.check_async_error();
  std::vector<StTensor> tensors;
  std::map<std::string, std::shared_ptr<Param>> by_name;
  uint64_t total = 0;
  for (const auto& p : params) {
    const std::string& n = name_of.at(p.get());
    tensors.push_back({n, p->dtype, p->shape, p->full_bytes(), 0});
    by_name[n] = p;
    total += p->full_bytes();
  }
  const std::string header = st_header(tensors, {{"format", "pt"}});  // file order
  const bool writer = ctx.members().rank == 0;
  const std::string tmp = out + ".tmp";
  std::string error;  // rank 0's; it goes on gathering so the others never wait in vain
  Code error_code = Code::Ok;
  File f;
  auto note = [&](const Error& e) {
    if (error.empty()) {
      error = e.what();
      error_code = e.code();
    }
  };
  if (writer) {
    try {
      f = File::create(tmp);
      f.write_all(header.data(), header.size());
    } catch (const Error& e) {
      note(e);
    }
  }
  std::vector<char> host;
  uint64_t done = 0;
  for (const auto& t : tensors) {
    const std::shared_ptr<Param>& p = by_name.at(t.key);
    if (p->layout.numel == 0) continue;
    const bool mine = p->status() == ParamStatus::Available;  // the caller's gather: leave it
    if (!mine) {
      auto work = fetch_params_locked(ctx, {p}, false, /*exact=*/true);  // never the qwZ values
      work->wait(-1);
      settle_locked(ctx, *p);
    }
    if (writer && error.empty()) {
      try {
        host.resize(p->full_bytes());
        ctx.device()->copy(host.data(), available_data_locked(ctx, *p, "export")->data(), host.size());
        ctx.device()->synchronize();
        f.write_all(host.data(), host.size());
      } catch (const Error& e) {
        note(e);
      }
    }
    if (!mine) release_params_locked(ctx, {p});
    done += p->full_bytes();
    if (progress) progress(done, total);
  }
  if (writer && error.empty()) {
    try {
      f.sync();
      f.close();
      rename_path(tmp, out);
      sync_dir(parent_dir(out));
    } catch (const Error& e) {
      note(e);
    }
  }
  if (writer && !error.empty()) {
    try { remove_tree(tmp); } catch (const Error&) {}
  }
  if (ctx.members().world_size > 1) {
    float failed = error.empty() ? 0.0f : 1.0f;
    ctx.world()->run("export outcome", [&](Communicator& c) {
      c.allreduce(&failed, &failed, 1, DType::F32, ReduceOp::Max);
    });
    if (error.empty() && failed > 0.0f) fail(Code::Io, "export failed on rank 0 (its error says why)");
  }
  if (!error.empty()) throw Error(error_code, error);
}

}  // namespace zs::ckpt
