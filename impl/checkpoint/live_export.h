// Consolidated safetensors from a live run (the reference's
// gather_16bit_weights_on_model_save): params are gathered one at a time
// over their groups and rank 0 streams each to the file, so no rank holds
// more than one full param; the file is written beside the target, fsynced
// and renamed. Byte for byte what export_consolidated makes from a
// checkpoint of the same params.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "impl/checkpoint/shard_io.h"
#include "impl/core/context.h"
#include "impl/partition/param.h"

namespace zs::ckpt {

// Collective over the world. names: one per param, or empty (registration
// names). A param the caller holds gathered is written from its full data
// as it is. Every rank fails alike when rank 0 cannot write.
void export_live(Context& ctx, const std::vector<std::shared_ptr<Param>>& params,
                 const std::vector<std::string>& names, const std::string& out, const Progress& progress);

}  // namespace zs::ckpt
