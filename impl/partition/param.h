// A partitioned parameter: this rank's padded shard, and the full data
// while gathered. Its mutable state is guarded by the owning context's
// lock(); the group thread only touches the buffers, which the in-flight
// gather keeps alive. The param owns its lifecycle: the gather's status
// (NOT_AVAILABLE -> INFLIGHT -> AVAILABLE -> NOT_AVAILABLE) changes only
// through start_gather, settle and release, which keep the gathered bytes
// in the context's ledger; where the shard lives (memory or the param swap
// file) is owned by shard_residence.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "impl/comm/group.h"
#include "impl/comm/work.h"
#include "impl/common/dtype.h"
#include "impl/core/ledger.h"
#include "impl/device/buffer.h"
#include "impl/partition/grad_shard.h"
#include "impl/partition/layout.h"
#include "kernels/quant.h"

namespace zs {

enum class ParamStatus : int { NotAvailable = 0, Inflight = 1, Available = 2 };

const char* param_status_name(ParamStatus s);

class Param;
// The label of a collective that moves these params ("fetch of param 'w'
// (float32 [3, 5]) #7 and 4 more [params 1f2e3d4c]"), for its identity and
// for messages: the first params by name and registration number, a hash
// of every name, dtype, shape and number, so ranks that move different
// params never agree by accident, not even params of one name and shape.
std::string params_label(const std::string& verb, const std::vector<std::shared_ptr<Param>>& params);

class Param : public std::enable_shared_from_this<Param> {
 public:
  Param(uint64_t context_id, std::string name, DType dtype, std::vector<int64_t> shape,
        std::shared_ptr<Group> group);

  const uint64_t context_id;  // the context that owns it
  const std::string name;
  const DType dtype;
  const std::vector<int64_t> shape;
  const std::shared_ptr<Group> group;
  // Its layout over the group's members; laid out again only by rebind.
  ShardLayout layout;
  // Its number among the params registered on its group (Group::
  // next_param_ordinal), set once registration succeeds; 0 before.
  uint64_t ordinal = 0;

  size_t elem_bytes() const { return dtype_size(dtype); }
  uint64_t shard_bytes() const { return layout.shard_numel * elem_bytes(); }
  uint64_t full_bytes() const { return layout.numel * elem_bytes(); }
  uint64_t padded_bytes() const { return layout.padded_numel * elem_bytes(); }
  // "param 'w' (float32 [3, 5])", for messages.
  std::string describe() const;

  // shard_numel elements, padding zeroed. Read and written through a
  // ShardAccess (shard_residence.h): with parameter offload it is null
  // while only the swap file holds the shard.
  BufferPtr shard;
  // Residence, owned by shard_residence.cpp: the shard's region in the
  // param swap file (offload only), its users, whether the cached bytes
  // changed since they were written there, and its place in the cache.
  bool swapped = false;
  uint64_t swap_offset = 0;
  int shard_users = 0;
  bool shard_dirty = false;
  uint64_t shard_last_use = 0;
  // The gather: its status, the full buffer (padded_numel elements, or
  // more under hpZ) while INFLIGHT or AVAILABLE, the work filling it while
  // INFLIGHT, and whether that buffer is the shard itself (a group of one).
  ParamStatus status() const { return status_; }
  const BufferPtr& full() const { return full_; }
  const std::shared_ptr<Work>& inflight() const { return inflight_; }
  bool full_aliases_shard() const { return aliases_shard_; }
  // NOT_AVAILABLE (or AVAILABLE, re-gathered into its own buffer) ->
  // INFLIGHT while `work` fills `full`; a new buffer that is not the shard
  // counts as gathered bytes.
  void start_gather(BufferPtr full, bool aliases_shard, std::shared_ptr<Work> work, Ledger& ledger);
  // INFLIGHT whose work is done -> AVAILABLE, or NOT_AVAILABLE with the
  // buffer dropped if it failed. Anything else is left as it is.
  enum class Settled { Unchanged, Available, Failed };
  Settled settle(Ledger& ledger);
  // AVAILABLE -> NOT_AVAILABLE, the buffer dropped.
  void release(Ledger& ledger);
  // A shrink reconnected its group over fewer members (heal/shrink.cpp):
  // the layout over the group as it is now, `fresh` its shard in that
  // layout. NOT_AVAILABLE, in memory (no swap file), no gradient shard.
  void rebind(BufferPtr fresh, Ledger& ledger);

  GradShardPtr grad;  // fp32 gradient shard, from a push to the step's end (grad_shard.h)
  // Where its gradient shards live between writes: set by an optimizer
  // whose state is on NVMe, null otherwise (grad_shard.h).
  std::shared_ptr<GradSink> grad_sink;
  // The optimizer step freed `grad` (GradReducer::end_step): the shard
  // stands for zeros, and zs_grad_shard_data makes it again.
  bool grad_released = false;
  // (hpZ's secondary shard is the fetch layer's: fetch/gather.cpp.)
  bool unregistered = false;        // destroyed by the trainer; others may still hold it
  // Bumped whenever the shard is rewritten by anything but the optimizer
  // (update_params): an optimizer keeping a separate fp32 master re-reads
  // it from the shard before its next update, so the write sticks.
  uint64_t shard_version = 0;
  // A gradient was pushed since the last optimizer step. A param that got
  // none (frozen since, unused) is left alone by the step, as torch's
  // optimizers skip a param whose .grad is None.
  bool grad_pushed = false;
  // Frozen for good (partition/freeze.h): gradient pushes are refused and
  // no optimizer steps it.
  bool frozen = false;
  // A frozen param under zero_quantized_nontrainable_weights keeps its
  // shard as this packet (partition/quant_packet.h, quantized with
  // packet_spec) and `shard` is null: gathers send the packet as it is,
  // and a ShardAccess reads and writes its dequantized values.
  BufferPtr packet;
  kernels::QuantSpec packet_spec;

 private:
  ParamStatus status_ = ParamStatus::NotAvailable;
  BufferPtr full_;
  std::shared_ptr<Work> inflight_;
  bool aliases_shard_ = false;
};

// Element count of a shape; throws InvalidArgument for negative or
// overflowing dims, naming the dim.
uint64_t checked_numel(const std::vector<int64_t>& shape);

}  // namespace zs
