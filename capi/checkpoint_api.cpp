// Checkpoints: collective save and load, and the offline verify and export.
#include <mutex>

#include "capi/handles.h"
#include "impl/checkpoint/live_export.h"
#include "impl/checkpoint/load.h"
#include "impl/checkpoint/offline.h"
#include "impl/checkpoint/pending_save.h"
#include "impl/checkpoint/pretrained.h"
#include "impl/checkpoint/save.h"

using namespace zs;
using namespace zs::capi;

namespace {

// The strings zs_checkpoint_info points at, kept until the next load.
// The strings zs_checkpoint_info points into, valid until the next load.
struct LastLoad : Context::Attachment {
  explicit LastLoad(Context&) {}
  std::mutex mu;
  std::string dir, user_json;
};

std::string str_or(const char* s, const char* fallback) { return s ? s : fallback; }

std::vector<std::string> names_of(const char* const* names, size_t n) {
  std::vector<std::string> out;
  if (names == nullptr) return out;
  for (size_t i = 0; i < n; ++i) {
    if (names[i] == nullptr) fail(Code::InvalidArgument, "options->names[", i, "] is NULL");
    out.emplace_back(names[i]);
  }
  return out;
}

Optimizer* optimizer_in(const std::shared_ptr<Context>& ctx, zs_optimizer h,
                        std::shared_ptr<Optimizer>* keep) {
  if (h == nullptr) return nullptr;
  auto r = optimizer_of(h, "opt");
  if (r.ctx != ctx) fail(Code::InvalidArgument, "opt belongs to another context than ctx");
  *keep = r.obj;
  return keep->get();
}

ckpt::PhaseProgress phase_progress(zs_progress_fn fn, void* user) {
  if (fn == nullptr) return {};
  return [fn, user](const char* phase, uint64_t done, uint64_t total) { fn(user, phase, done, total); };
}

ckpt::Progress byte_progress(zs_progress_fn fn, void* user, const char* phase) {
  if (fn == nullptr) return {};
  return [fn, user, phase](uint64_t done, uint64_t total) { fn(user, phase, done, total); };
}

}  // namespace

extern "C" {

ZS_API zs_status zs_checkpoint_save(zs_context h, const zs_param* params, size_t n, zs_optimizer opt,
                                    const char* dir, const zs_checkpoint_save_options* options) {
  return guarded([&] {
    const auto& o = checked_options(options, "options");
    if (dir == nullptr) fail(Code::InvalidArgument, "dir is NULL");
    if (o.timeout_ms < 0) fail(Code::InvalidArgument, "options->timeout_ms ", o.timeout_ms, ": expected >= 0");
    auto ctx = context_of(h, "ctx");
    auto list = params_of(ctx, params, n, "params");
    std::shared_ptr<Optimizer> keep;
    Optimizer* op = optimizer_in(ctx, opt, &keep);
    ckpt::SaveOptions so;
    so.tag = str_or(o.tag, "");
    so.user_json = str_or(o.user_json, "");
    so.timeout = std::chrono::milliseconds(o.timeout_ms);
    so.overwrite = o.overwrite != 0;
    so.update_latest = o.update_latest != 0;
    so.names = names_of(o.names, n);
    so.progress = phase_progress(o.progress, o.progress_user);
    so.async_save = o.async_save != 0;
    ckpt::save(*ctx, list, op, dir, so);
  });
}

ZS_API zs_status zs_checkpoint_wait(zs_context h) {
  return guarded([&] { ckpt::wait_for_pending_save(*context_of(h, "ctx")); });
}

ZS_API zs_status zs_checkpoint_load(zs_context h, const zs_param* params, size_t n, zs_optimizer opt,
                                    const char* path, const zs_checkpoint_load_options* options,
                                    zs_checkpoint_info* info_out) {
  return guarded([&] {
    const auto& o = checked_options(options, "options");
    SizedOut<zs_checkpoint_info> info(info_out, "info", true);
    if (path == nullptr) fail(Code::InvalidArgument, "path is NULL");
    auto ctx = context_of(h, "ctx");
    auto list = params_of(ctx, params, n, "params");
    std::shared_ptr<Optimizer> keep;
    Optimizer* op = optimizer_in(ctx, opt, &keep);
    ckpt::LoadOptions lo;
    lo.tag = str_or(o.tag, "");
    lo.strict = o.strict != 0;
    lo.names = names_of(o.names, n);
    lo.progress = phase_progress(o.progress, o.progress_user);
    const ckpt::LoadResult r = ckpt::load(*ctx, list, op, path, lo);
    auto& last = ctx->attachment<LastLoad>();
    std::lock_guard<std::mutex> keep_strings(last.mu);
    last.dir = r.dir;
    last.user_json = r.user_json;
    if (info) {
      info->step = r.step;
      info->bytes_read = r.bytes_read;
      info->dir = last.dir.c_str();
      info->user_json = last.user_json.c_str();
    }
  });
}

ZS_API zs_status zs_checkpoint_verify(const char* path, const char* tag, zs_progress_fn progress,
                                      void* progress_user) {
  return guarded([&] {
    if (path == nullptr) fail(Code::InvalidArgument, "path is NULL");
    const auto r = ckpt::verify(path, str_or(tag, ""), byte_progress(progress, progress_user, "verify"));
    if (r.problems.empty()) return;
    std::string msg = "checkpoint '" + r.dir + "' fails verification (" +
                      std::to_string(r.problems.size()) + " problem" +
                      (r.problems.size() > 1 ? "s" : "") + "):";
    for (const auto& p : r.problems) msg += "\n  " + p;
    fail(Code::Io, msg);
  });
}

ZS_API zs_status zs_checkpoint_export(const char* path, const char* out_file,
                                      const zs_checkpoint_export_options* options) {
  return guarded([&] {
    const auto& o = checked_options(options, "options");
    if (path == nullptr) fail(Code::InvalidArgument, "path is NULL");
    if (out_file == nullptr || *out_file == '\0') fail(Code::InvalidArgument, "out_file is NULL or empty");
    ckpt::ExportOptions eo;
    eo.fp32 = o.fp32 != 0;
    eo.progress = byte_progress(o.progress, o.progress_user, "export");
    ckpt::export_consolidated(path, str_or(o.tag, ""), out_file, eo);
  });
}

ZS_API zs_status zs_checkpoint_reshard(const char* path, const char* tag, const char* out_dir,
                                       int world_size, zs_progress_fn progress, void* progress_user) {
  return guarded([&] {
    if (path == nullptr) fail(Code::InvalidArgument, "path is NULL");
    if (out_dir == nullptr) fail(Code::InvalidArgument, "out_dir is NULL");
    ckpt::reshard(path, str_or(tag, ""), out_dir, world_size,
                  byte_progress(progress, progress_user, "reshard"));
  });
}

ZS_API zs_status zs_export_safetensors(zs_context h, const zs_param* params, size_t n,
                                       const char* out_file, const zs_export_options* options) {
  return guarded([&] {
    const auto& o = checked_options(options, "options");
    if (out_file == nullptr || *out_file == '\0') fail(Code::InvalidArgument, "out_file is NULL or empty");
    auto ctx = context_of(h, "ctx");
    auto list = params_of(ctx, params, n, "params");
    const auto names = names_of(o.names, n);
    ckpt::export_live(*ctx, list, names, out_file, byte_progress(o.progress, o.progress_user, "export"));
  });
}

ZS_API zs_status zs_load_safetensors(zs_context h, const zs_param* params, size_t n, zs_optimizer opt,
                                     const char* path, const zs_safetensors_load_options* options) {
  return guarded([&] {
    const auto& o = checked_options(options, "options");
    if (path == nullptr) fail(Code::InvalidArgument, "path is NULL");
    auto ctx = context_of(h, "ctx");
    auto list = params_of(ctx, params, n, "params");
    std::shared_ptr<Optimizer> keep;
    Optimizer* op = optimizer_in(ctx, opt, &keep);
    ckpt::PretrainedOptions po;
    po.names = names_of(o.names, n);
    po.strict = o.strict != 0;
    po.from_rank0 = o.from_rank0 != 0;
    po.progress = byte_progress(o.progress, o.progress_user, "read");
    ckpt::load_pretrained(*ctx, list, op, path, po);
  });
}

}  // extern "C"
