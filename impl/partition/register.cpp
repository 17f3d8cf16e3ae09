#include "impl/partition/register.h"

#include <cstring>

#include "impl/common/copy_tally.h"

#include "impl/partition/seeded_init.h"
#include "impl/partition/shard_residence.h"

namespace zs {
namespace {

void check_data(const Param& p, const ParamSpec& spec) {
  if (p.full_bytes() > 0 && spec.data == nullptr)
    fail(Code::InvalidArgument, p.describe(), ": init needs data, got NULL");
  if (spec.data_bytes != p.full_bytes())
    fail(Code::BufferSize, p.describe(), ": data_bytes is ", spec.data_bytes, ", expected ",
         p.full_bytes(), " (", p.layout.numel, " elements of ", p.elem_bytes(), " bytes)");
}

// Root's inputs for the scatter: rank i's shard points into data where it
// is whole; shards that run past the end are copied into padded buffers.
void scatter_from_root(Param& p, const ParamSpec& spec) {
  const int g = p.group->size();
  const size_t shard_bytes = p.shard_bytes();
  std::vector<const void*> inputs;
  std::vector<std::unique_ptr<Buffer>> tails;
  if (p.group->rank() == spec.src_rank) {
    for (int i = 0; i < g; ++i) {
      const uint64_t offset = static_cast<uint64_t>(i) * p.layout.shard_numel;
      const uint64_t valid = ShardLayout::valid_in(p.layout.numel, offset, p.layout.shard_numel);
      const auto* src = static_cast<const uint8_t*>(spec.data) + offset * p.elem_bytes();
      if (valid == p.layout.shard_numel) {
        inputs.push_back(src);
        continue;
      }
      tails.push_back(std::make_unique<Buffer>(shard_bytes, MemKind::Scratch, true));
      if (valid > 0) copy_between(tails.back()->data(), src, valid * p.elem_bytes());
      copy_tally::add(CopyKind::Other, valid * p.elem_bytes());
      inputs.push_back(tails.back()->data());
    }
  }
  void* out = p.shard->data();
  const int root = spec.src_rank;
  p.group->run("registering " + p.describe(), [&](Communicator& comm) {
    comm.scatter(inputs, out, shard_bytes, root);
  });
}

// The registration order, for registered_params (the params themselves
// are the handles' to own).
struct Registered final : Context::Attachment {
  explicit Registered(Context&) {}
  std::vector<std::weak_ptr<Param>> all;
};

}  // namespace

std::vector<std::shared_ptr<Param>> registered_params(Context& ctx) {
  ctx.expect_locked();
  std::vector<std::shared_ptr<Param>> out;
  auto& r = ctx.attachment<Registered>();
  std::vector<std::weak_ptr<Param>> kept;
  for (const auto& w : r.all)
    if (auto p = w.lock(); p && !p->unregistered) {
      out.push_back(p);
      kept.push_back(w);
    }
  r.all = std::move(kept);
  return out;
}

std::shared_ptr<Param> register_param(Context& ctx, const ParamSpec& spec) {
  memory_tally::set_phase(MemPhase::Construction);
  const auto held = ctx.lock();
  ctx.check_async_error();
  auto group = spec.group ? spec.group : ctx.partition_group();
  if (!group->member())
    fail(Code::InvalidArgument, "param '", spec.name, "': this rank is not a member of group '",
         group->name(), "'");
  auto p = std::make_shared<Param>(ctx.id(), spec.name, spec.dtype, spec.shape, group);
  p->shard = std::make_shared<Buffer>(ctx.device(), p->shard_bytes(), MemKind::Shards, true);
  const size_t elem = p->elem_bytes();
  switch (spec.init) {
    case InitKind::Zeros: break;
    case InitKind::FromAll:
      check_data(*p, spec);
      // Ordered after the zeroing: copy_between runs on the same device's
      // engine stream.
      copy_between(p->shard->data(),
                   static_cast<const uint8_t*>(spec.data) + p->layout.shard_offset * elem,
                   p->layout.shard_valid * elem);
      copy_tally::add(CopyKind::Other, p->layout.shard_valid * elem);
      break;
    case InitKind::FromRank:
      if (spec.src_rank < 0 || spec.src_rank >= group->size())
        fail(Code::InvalidArgument, p->describe(), ": src_rank ", spec.src_rank,
             " is out of range for group '", group->name(), "' of size ", group->size());
      if (group->rank() == spec.src_rank) check_data(*p, spec);
      // A replacement's shard comes from its holder's replica at
      // zs_heal_join; the survivors are not registering, so no scatter.
      if (!ctx.replacing()) scatter_from_root(*p, spec);
      break;
    case InitKind::Normal:
    case InitKind::Uniform:
      if (!(spec.b >= 0.0) && spec.init == InitKind::Normal)
        fail(Code::InvalidArgument, p->describe(), ": normal init std b = ", spec.b,
             ": expected >= 0");
    {
      // Values are generated on the host (the same on any device and world
      // size), then moved to the device.
      Buffer host(p->shard_bytes(), MemKind::Scratch);
      fill_seeded(host.data(), p->dtype, p->layout.shard_offset, p->layout.shard_valid,
                  spec.init == InitKind::Normal ? SeededDist::Normal : SeededDist::Uniform,
                  spec.seed, spec.a, spec.b);
      ctx.device()->copy(p->shard->data(), host.data(), p->layout.shard_valid * elem);
      copy_tally::add(CopyKind::Other, p->layout.shard_valid * elem);
      break;
    }
    default:
      fail(Code::InvalidArgument, "param '", spec.name, "': init ", static_cast<int>(spec.init),
           ": expected ZS_INIT_ZEROS (0) .. ZS_INIT_UNIFORM (4)");
  }
  ctx.device()->synchronize();
  place_new_shard(ctx, *p);
  auto& ledger = ctx.ledger();
  ledger.add(Held::Unsharded, p->full_bytes());
  ledger.count_param(+1);
  p->ordinal = group->next_param_ordinal();
  ctx.attachment<Registered>().all.push_back(p);
  return p;
}

void unregister_param(Context& ctx, Param& p) {
  const auto held = ctx.lock();
  if (p.unregistered) return;
  ctx.each_attachment<ParamKeeper>([&](ParamKeeper& keeper) { keeper.forget(p); });
  p.unregistered = true;
  auto& ledger = ctx.ledger();
  retire_shard(ctx, p);
  ledger.sub(Held::Unsharded, p.full_bytes());
  ledger.count_param(-1);
}

}  // namespace zs
