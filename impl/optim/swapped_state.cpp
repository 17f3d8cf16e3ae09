#include "impl/optim/swapped_state.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>

#include "impl/common/env.h"
#include "impl/common/error.h"

namespace zs {
namespace {

// A slot's gradient shard in the file: one run per piece, in the shard's
// order. Its I/O is the swapper's synchronous path, which keeps the runs'
// partly shared blocks whole (one staging lock).
class SwappedGrads final : public GradSink {
 public:
  struct Run {
    uint64_t offset, begin, count;  // bytes in the file; elements of the shard
  };
  SwappedGrads(std::shared_ptr<Swapper> swapper, std::vector<Run> runs, uint64_t numel)
      : swapper_(std::move(swapper)), runs_(std::move(runs)), numel_(numel) {}
  void write(const float* src, uint64_t n) override {
    check(n);
    for (const Run& r : runs_) swapper_->write(r.offset, src + r.begin, r.count * sizeof(float));
  }
  void read(float* dst, uint64_t n) override {
    check(n);
    for (const Run& r : runs_) swapper_->read(r.offset, dst + r.begin, r.count * sizeof(float));
  }

 private:
  void check(uint64_t n) const {
    if (n != numel_)
      fail(Code::Internal, "gradient swap of ", n, " elements for a slot of ", numel_, " in ", swapper_->path());
  }
  std::shared_ptr<Swapper> swapper_;
  std::vector<Run> runs_;
  uint64_t numel_;
};

std::string swap_file_name(int rank) {
  // Unique per process and per optimizer, so contexts and runs sharing a
  // directory never open each other's file.
  static std::atomic<int> counter{0};
  return "zeroshard-optimizer-rank" + std::to_string(rank) + "-pid" + std::to_string(::getpid()) + "-" +
         std::to_string(counter.fetch_add(1)) + ".swap";
}

}  // namespace

SwappedState::SwappedState(const Config& c, int rank, int arrays)
    : sub_group_size_(std::max<int64_t>(c.sub_group_size, 1)),
      arrays_(arrays),
      buffer_count_(static_cast<size_t>(c.offload_optimizer.buffer_count)),
      pipeline_read_(c.offload_optimizer.pipeline_read),
      pipeline_write_(c.offload_optimizer.pipeline_write),
      grads_(env_int("ZS_NVME_GRADS", 1) != 0) {
  const std::string& dir = c.offload_optimizer.nvme_path;
  if (buffer_count_ < 1)
    fail(Code::InvalidConfig, "zero_optimization.offload_optimizer.buffer_count = 0: expected >= 1 "
         "for NVMe offload (the buffers sub-groups are swapped through)");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);  // as DeepSpeed does; an error shows at open
  SwapperOptions o;
  o.dir = dir;
  o.file_name = swap_file_name(rank);
  o.aio = c.aio;
  swapper_ = std::make_shared<Swapper>(o);
}

SwappedState::~SwappedState() = default;

uint64_t SwappedState::buffer_bytes() const {
  uint64_t b = 0;
  for (const auto& buf : buffers_) b += buf.bytes();
  return b;
}

void SwappedState::ensure_buffers(uint64_t bytes) {
  const size_t want = std::min(buffer_count_, std::max<size_t>(sgs_.size(), 1));
  if (buffers_.size() == want && (buffers_.empty() || buffers_[0].bytes() >= bytes)) return;
  const uint64_t size = std::max(bytes, buffers_.empty() ? 0 : buffers_[0].bytes());
  swapper_->register_buffers({});  // the old ones go away
  buffers_.clear();
  for (size_t i = 0; i < want; ++i) buffers_.emplace_back(size);
  std::vector<const AlignedBuffer*> list;
  for (const auto& b : buffers_) list.push_back(&b);
  swapper_->register_buffers(list);
}

void SwappedState::add_group(int group, const std::vector<SlotSpec>& slots, const InitMaster& init) {
  const size_t first = sgs_.size();
  std::vector<SubGroup> added;
  SubGroup cur;
  cur.group = group;
  auto close = [&] {
    if (cur.elements == 0) return;
    added.push_back(std::move(cur));
    cur = SubGroup();
    cur.group = group;
  };
  for (const SlotSpec& s : slots) {
    uint64_t begin = 0;
    while (begin < s.numel) {
      const uint64_t room = static_cast<uint64_t>(sub_group_size_) - cur.elements;
      const uint64_t count = std::min(room, s.numel - begin);
      Piece p;
      p.slot = s.slot;
      p.begin = begin;
      p.count = count;
      p.pos = cur.elements;
      if (s.master) {
        p.master_pos = static_cast<int64_t>(cur.masters);
        cur.masters += count;
      }
      cur.elements += count;
      cur.pieces.push_back(p);
      begin += count;
      if (cur.elements == static_cast<uint64_t>(sub_group_size_)) close();
    }
  }
  close();
  uint64_t total = 0, largest = 0;
  for (SubGroup& sg : added) {
    sg.state_at[0] = 0;
    uint64_t at = align_up(sg.masters * sizeof(float));
    for (int k = 1; k <= arrays_; ++k) {
      sg.state_at[k] = at;
      at += align_up(sg.elements * sizeof(float));
    }
    sg.grads_at = at;
    if (grads_) at += align_up(sg.elements * sizeof(float));
    sg.bytes = at;
    total += at;
    largest = std::max(largest, at);
  }
  // The whole group's space is taken at once: not enough of it is an error
  // now, before any step.
  uint64_t offset = swapper_->grow(total);
  for (SubGroup& sg : added) {
    sg.offset = offset;
    offset += sg.bytes;
  }
  for (size_t i = 0; i < added.size(); ++i)
    for (size_t k = 0; k < added[i].pieces.size(); ++k) where_[added[i].pieces[k].slot].push_back({first + i, k});
  for (SubGroup& sg : added) sgs_.push_back(std::move(sg));
  try {
    ensure_buffers(largest);
    for (size_t i = first; i < sgs_.size(); ++i) {
      const SubGroup& sg = sgs_[i];
      char* base = buffers_[0].data();
      std::memset(base, 0, sg.bytes);
      const View v{sg, base};
      for (const Piece& p : sg.pieces)
        if (p.master_pos >= 0) init(p.slot, p.begin, p.count, v.master(p));
      swapper_->wait(swapper_->write_async(sg.offset, base, sg.bytes));
    }
  } catch (...) {
    // The group is not added: its sub-groups go (its file space stays
    // allocated, unused).
    for (const SlotSpec& s : slots) where_.erase(s.slot);
    sgs_.resize(first);
    throw;
  }
}

void SwappedState::for_each(const std::function<bool(const View&)>& fn) {
  const size_t n = sgs_.size();
  if (n == 0) return;
  const size_t nb = buffers_.size();
  std::vector<std::optional<Swapper::Ticket>> reading(nb), writing(nb);
  auto read = [&](size_t i) {
    const size_t b = i % nb;
    if (writing[b]) {  // the buffer is still going out
      auto t = *writing[b];
      writing[b].reset();
      swapper_->wait(t);
    }
    reading[b] = swapper_->read_async(sgs_[i].offset, buffers_[b].data(), sgs_[i].bytes);
  };
  try {
    read(0);
    for (size_t i = 0; i < n; ++i) {
      const size_t b = i % nb;
      if (!reading[b]) read(i);
      const auto t = *reading[b];
      reading[b].reset();
      swapper_->wait(t);
      // The next one comes in while this one steps (needs a second buffer).
      if (pipeline_read_ && nb > 1 && i + 1 < n) read(i + 1);
      const bool changed = fn(View{sgs_[i], buffers_[b].data()});
      if (changed) {  // the state, not the gradients (read only)
        const auto w = swapper_->write_async(sgs_[i].offset, buffers_[b].data(), sgs_[i].grads_at);
        if (pipeline_write_) writing[b] = w;
        else swapper_->wait(w);
      }
    }
    for (auto& w : writing)
      if (w) {
        auto t = *w;
        w.reset();
        swapper_->wait(t);
      }
  } catch (...) {
    // Nothing may still be writing into the buffers once we leave.
    try {
      swapper_->wait_all();
    } catch (...) {
    }
    throw;
  }
}

void SwappedState::read_slot(size_t slot, int array, float* dst) {
  auto it = where_.find(slot);
  if (it == where_.end()) return;
  for (const auto& [i, k] : it->second) {
    const SubGroup& sg = sgs_[i];
    const Piece& p = sg.pieces[k];
    const uint64_t pos = array == 0 ? static_cast<uint64_t>(p.master_pos) : p.pos;
    swapper_->read(sg.offset + sg.state_at[array] + pos * sizeof(float), dst + p.begin, p.count * sizeof(float));
  }
}

void SwappedState::write_slot(size_t slot, int array, const float* src) {
  auto it = where_.find(slot);
  if (it == where_.end()) return;
  for (const auto& [i, k] : it->second) {
    const SubGroup& sg = sgs_[i];
    const Piece& p = sg.pieces[k];
    const uint64_t pos = array == 0 ? static_cast<uint64_t>(p.master_pos) : p.pos;
    swapper_->write(sg.offset + sg.state_at[array] + pos * sizeof(float), src + p.begin, p.count * sizeof(float));
  }
}

std::shared_ptr<GradSink> SwappedState::grad_sink(size_t slot) const {
  if (!grads_) return nullptr;
  std::vector<SwappedGrads::Run> runs;
  uint64_t numel = 0;
  if (auto it = where_.find(slot); it != where_.end())
    for (const auto& [i, k] : it->second) {
      const SubGroup& sg = sgs_[i];
      const Piece& p = sg.pieces[k];
      runs.push_back({sg.offset + sg.grads_at + p.pos * sizeof(float), p.begin, p.count});
      numel += p.count;
    }
  return std::make_shared<SwappedGrads>(swapper_, std::move(runs), numel);
}

}  // namespace zs
