// Collectives over NCCL on one CUDA device: the GPU backend, as PyTorch's
// ProcessGroupNCCL, DeepSpeed and FSDP use it. NCCL is loaded at run time
// (impl/comm/transport/nccl_library.h); nothing links libnccl.
//
// Streams: the communicator owns a non-blocking communication stream on its
// device. Before each collective that stream waits (through an event) for
// everything already queued on the engine stream, so kernels that filled the
// send buffers are done; each call then returns only when NCCL has finished
// writing the outputs. The wait polls cudaEventQuery and
// ncclCommGetAsyncError, bounded by the timeout: a stuck or missing peer is a
// Code::Timeout, an NCCL failure a Code::Comm, and either aborts the NCCL
// communicator (ncclCommAbort), after which every call fails at once with
// the same code and message.
//
// Reductions: NCCL reduces bf16/fp16 natively (in its own kernels'
// arithmetic, not by converting to fp32 first as the Gloo backend does); this
// is what DeepSpeed and FSDP get from NCCL too. ReduceOp::Avg is ncclAvg,
// which float types only accept here (U8 with Avg is Code::InvalidArgument).
//
// Calls come from the group's worker thread; each call first makes the
// communicator's device current on that thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "impl/comm/algo/communicator.h"
#include "impl/comm/store/store.h"

namespace zs {

// Joins rank of size on CUDA device cuda_ordinal. store must be prefixed per
// group: rank 0 publishes the NCCL unique id under "nccl_unique_id", the
// others wait for it (bounded by the store's own timeout, Code::Timeout).
// NCCL's init runs non-blocking and is bounded by timeout too (Code::Timeout
// "NCCL init of group 'X' (rank r of n) did not finish in T ms"), as is
// every later collective. engine_stream is the cudaStream_t the engine's
// kernels run on (null: the legacy default stream).
//
// silent_peer (may be empty) says whether a member has stopped or died: ""
// while every member is alive, else a sentence naming the silent one (the
// context's heartbeat, Heartbeat::silence over the group's world ranks).
// NCCL's init waits on every peer and cannot tell a dead one from a slow
// one, so the init's poll asks it every 50 ms: a silent
// member aborts the init within the heartbeat limit with Code::Comm,
// "<sentence>; NCCL init of group 'X' (rank r of n) cannot complete", as a
// Gloo group's rendezvous fails, instead of at the timeout. A collective's
// wait asks it too (after its first 50 ms): a member silent mid-collective
// breaks the communicator the same way, "<sentence>; all-gather on group
// 'X' (rank r of n) cannot complete".
//
// Throws Code::InvalidArgument for a bad rank/size/ordinal,
// Code::NotSupported when the device is not there ("group 'X': CUDA device N
// is not available: ...") or NCCL cannot be loaded, Code::Comm or
// Code::OutOfMemory for CUDA/NCCL failures, Code::Timeout as above.
std::unique_ptr<Communicator> make_nccl_communicator(const std::string& group_name, int rank,
                                                     int size, Store& store, int cuda_ordinal,
                                                     void* engine_stream,
                                                     std::chrono::milliseconds timeout,
                                                     std::function<std::string()> silent_peer = {});

}  // namespace zs
