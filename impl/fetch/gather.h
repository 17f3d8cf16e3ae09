// Fetching and releasing full parameters. A fetch allocates each param's
// full buffer, marks it INFLIGHT and queues one coalesced all-gather on the
// params' group; the param becomes AVAILABLE once the gather is observed
// complete (settle), and release frees the buffer again.
// Each function takes the engine lock itself.
#pragma once

#include <memory>
#include <vector>

#include "impl/core/context.h"
#include "impl/partition/param.h"

namespace zs {

using ParamList = std::vector<std::shared_ptr<Param>>;

// Validates everything before changing anything: on error no param moved.
// With into_gathered, an AVAILABLE param is gathered again into the buffer
// it has (its views stay valid; it is INFLIGHT until the gather is done):
// how persistent params take the values an optimizer step wrote.
// With zero_quantized_weights (qwZ), float params gathered from the
// primary shards (plain or MiCS) travel block-quantized and come back
// within the bound of kernels/quant.h, the same bits on every rank; hpZ's
// gathers from secondary shards stay exact (those shards hold what the
// quantized gather left), and so do a group of one, a group within one
// host (Context::quantizes), and a param whose
// shard is not larger than its packet (worth_quantizing, quant_packet.h:
// it travels exact, in fewer bytes). `exact` asks for the params' own
// values whatever the config (a consolidated export).
std::shared_ptr<Work> fetch_params(Context& ctx, const ParamList& params,
                                   bool into_gathered = false, bool exact = false);
// A function with a `_locked` twin takes the engine lock; the twin is for a
// caller that holds it already (context.h: the lock is not recursive).
// Those without one run under their caller's hold.
std::shared_ptr<Work> fetch_params_locked(Context& ctx, const ParamList& params,
                                          bool into_gathered = false, bool exact = false);

// If an in-flight gather finished: AVAILABLE on success, back to
// NOT_AVAILABLE (buffer freed) on failure. Returns the status it leaves.
ParamStatus settle(Context& ctx, Param& param);
ParamStatus settle_locked(Context& ctx, Param& param);

// Free the full data of AVAILABLE params; all-or-nothing.
void release_params(Context& ctx, const ParamList& params);
void release_params_locked(Context& ctx, const ParamList& params);
// Under the caller's hold of the engine lock.
void release_one(Context& ctx, Param& param);
// Wait out an in-flight gather (a failure is already the context's async
// error), then release the param if it ended up gathered. What
// unregister_param does for the fetch layer. Under the caller's hold.
void release_when_done(Context& ctx, Param& param);

// GatheredParameters' exit: broadcast the full data from group rank
// modifier_rank and rewrite every member's shard from it. Blocking.
// The params' shard_version moves on.
void update_params(Context& ctx, const ParamList& params, int modifier_rank);

// Every rank holds the same full values for the param (numel elements of
// its dtype, on the host or the context's device): this rank's shard is
// rewritten from them, and its full buffer too while AVAILABLE. Local, no
// traffic; the shard_version moves on. A torch `param.data = t`.
void write_param(Context& ctx, Param& param, const void* data, size_t bytes);

// hpZ: every param's secondary shard (this rank's slice of it within the
// intra-node group, left by the step's first gather) is dropped when the
// shards change (optimizer step, GatheredParameters update). Under the
// caller's hold.
void drop_secondaries(Context& ctx);

// The full data of an AVAILABLE param, or InvalidState naming its status.
// Shared, so the buffer outlives a release racing the caller's read.
BufferPtr available_data(Context& ctx, Param& param, const char* what);
BufferPtr available_data_locked(Context& ctx, Param& param, const char* what);

}  // namespace zs
