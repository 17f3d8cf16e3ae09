#include "impl/grad/loco.h"

namespace zs {

std::shared_ptr<Buffer> LocoErrors::make(size_t floats) {
  if (floats == 0) return nullptr;
  auto b = std::make_shared<Buffer>(ctx_.device(), floats * sizeof(float), MemKind::Grads, true);
  ctx_.ledger().add(Held::LocoErrors, b->bytes());
  return b;
}

void LocoErrors::drop(Entry& e) {
  for (auto* b : {&e.buffers.hop1, &e.buffers.hop2}) {
    if (*b) ctx_.ledger().sub(Held::LocoErrors, (*b)->bytes());
    b->reset();  // a task still in flight holds its own reference
  }
}

LocoErrors::Buffers LocoErrors::for_bucket(const Group* group,
                                           const std::vector<std::shared_ptr<Param>>& params,
                                           const std::vector<uint64_t>& offsets, uint64_t used,
                                           size_t hop1_floats, size_t hop2_floats) {
  std::vector<uintptr_t> key{reinterpret_cast<uintptr_t>(group), static_cast<uintptr_t>(used),
                             hop1_floats, hop2_floats};
  for (size_t i = 0; i < params.size(); ++i) {
    key.push_back(reinterpret_cast<uintptr_t>(params[i].get()));
    key.push_back(static_cast<uintptr_t>(offsets[i]));
  }
  Entry& e = entries_[key];
  if (!e.made) {  // (a hop that is not quantized has no buffer)
    e.buffers = {make(hop1_floats), make(hop2_floats)};
    e.made = true;
  }
  e.used = true;
  return e.buffers;
}

void LocoErrors::end_round() {
  bool any = false;
  for (const auto& [key, e] : entries_) any = any || e.used;
  if (!any) return;  // a sync with nothing reduced is no round
  ++rounds_;
  const bool reset = rounds_ % static_cast<uint64_t>(ctx_.config().zeropp_loco_reset_T) == 0;
  Device& dev = *ctx_.device();
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (!it->second.used) {
      drop(it->second);
      it = entries_.erase(it);
      continue;
    }
    it->second.used = false;
    if (reset)
      for (const auto& b : {it->second.buffers.hop1, it->second.buffers.hop2})
        if (b) dev.zero(b->data(), b->bytes());
    ++it;
  }
  if (reset) dev.synchronize();
}

void LocoErrors::clear() {
  for (auto& [key, e] : entries_) drop(e);
  entries_.clear();
}

}  // namespace zs
