// Optimizer state on NVMe (offload_optimizer.device = "nvme"): the fp32
// masters of 16-bit params and the moments of every param live in one swap
// file per rank, cut into sub-groups of at most sub_group_size elements
// (boundaries fall inside params where they must; sub-groups never span
// optimizer groups, whose hyper-parameters differ). A sub-group's region in
// the file is [masters][state 1][state 2], each array aligned for O_DIRECT,
// and it is moved as one request into one of buffer_count aligned buffers.
// A step visits the sub-groups in order: with pipeline_read the next one is
// read while one steps, with pipeline_write the last one is written back
// while the next steps. An fp32 param's master is its shard (in memory, or
// in the param swap file under parameter offload: partition/
// shard_residence.h), so only its moments are swapped here.
//
// The gradient shards live here too (ZS_NVME_GRADS=0: in memory): each
// sub-group's region ends with its gradients, written by the reducer as
// each shard is reduced (grad_sink(): partition/grad_shard.h) and read by
// the step with the moments; a step writes back the state before them
// only.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "impl/config/config.h"
#include "impl/common/aligned_buffer.h"
#include "impl/offload/swapper.h"
#include "impl/partition/grad_shard.h"

namespace zs {

class SwappedState {
 public:
  // A run of one slot's elements inside a sub-group.
  struct Piece {
    size_t slot = 0;         // the optimizer's numbering of its slots
    uint64_t begin = 0;      // first element of the slot's shard
    uint64_t count = 0;
    uint64_t pos = 0;        // its place in the sub-group's state arrays
    int64_t master_pos = -1; // its place in the masters array; -1: none here
  };
  struct SubGroup {
    int group = 0;
    std::vector<Piece> pieces;
    uint64_t elements = 0, masters = 0;
    uint64_t offset = 0;  // of the region in the file
    uint64_t bytes = 0;   // of the region (aligned)
    uint64_t state_at[3] = {0, 0, 0};  // byte offset in the region of masters, state 1, state 2
    uint64_t grads_at = 0;     // of the gradients (the region's end without them)
  };
  // A sub-group in memory, as a step sees it.
  struct View {
    const SubGroup& sg;
    char* base;
    float* master(const Piece& p) const {
      return p.master_pos < 0 ? nullptr
                              : reinterpret_cast<float*>(base + sg.state_at[0]) + p.master_pos;
    }
    float* state(const Piece& p, int k) const {
      return reinterpret_cast<float*>(base + sg.state_at[k]) + p.pos;
    }
    const float* grad(const Piece& p) const {
      return reinterpret_cast<const float*>(base + sg.grads_at) + p.pos;
    }
  };
  struct SlotSpec {
    size_t slot;
    uint64_t numel;
    bool master;  // its master is kept here (16-bit params)
  };
  using InitMaster = std::function<void(size_t slot, uint64_t begin, uint64_t count, float* dst)>;

  // arrays: moments per element (2 for Adam, 1 for SGD's momentum).
  SwappedState(const Config& config, int rank, int arrays);
  ~SwappedState();

  // Lays out a new optimizer group's slots, grows the file (free space
  // checked first) and writes the initial masters (from init) and zero
  // moments.
  void add_group(int group, const std::vector<SlotSpec>& slots, const InitMaster& init);
  // fn on every sub-group in order, its state in memory; the sub-groups for
  // which fn returns true are written back. Pipelined as configured.
  void for_each(const std::function<bool(const View&)>& fn);
  // One slot's array (0 masters, 1, 2 moments) to and from memory.
  void read_slot(size_t slot, int array, float* dst);
  void write_slot(size_t slot, int array, const float* src);
  // A slot's place for its gradient shards: a sink that outlives this
  // object (it shares the file); null under ZS_NVME_GRADS=0.
  std::shared_ptr<GradSink> grad_sink(size_t slot) const;

  uint64_t buffer_bytes() const;  // host memory held for the pipeline
  uint64_t file_bytes() const { return swapper_->size(); }
  const std::string& path() const { return swapper_->path(); }
  size_t num_sub_groups() const { return sgs_.size(); }

 private:
  void ensure_buffers(uint64_t bytes);

  const int64_t sub_group_size_;
  const int arrays_;
  const size_t buffer_count_;
  const bool pipeline_read_, pipeline_write_;
  const bool grads_;
  std::shared_ptr<Swapper> swapper_;
  std::vector<SubGroup> sgs_;
  std::map<size_t, std::vector<std::pair<size_t, size_t>>> where_;  // slot -> (sub-group, piece)
  std::vector<AlignedBuffer> buffers_;
};

}  // namespace zs
