#include "impl/comm/transport/cuda/nccl_communicator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "impl/comm/transport/nccl_library.h"
#include "impl/common/error.h"

namespace zs {
namespace {

using Clock = std::chrono::steady_clock;
using nccl::ncclResult_t;

constexpr const char* kUniqueIdKey = "nccl_unique_id";
// Grouped collectives per ncclGroupStart/End. Recent NCCL has no limit, but
// older releases capped a group at 2048 operations; the segments of one
// coalesced gather go out in groups of at most this many, all on one stream.
constexpr size_t kMaxOpsPerGroup = 1024;
// Longest wait for ncclCommFinalize in the destructor (it synchronises with
// the node's other ranks); past it the communicator is aborted instead.
constexpr std::chrono::milliseconds kMaxFinalizeWait{30000};
// How often the init's poll asks whether a member fell silent (heartbeat):
// a small part of the heartbeat limit (2 s by default), and rare enough
// that the question (a mutex and a scan of the members) costs nothing.
constexpr std::chrono::milliseconds kLivenessCheck{50};

std::string cuda_text(cudaError_t e) {
  return std::string("CUDA error ") + std::to_string(static_cast<int>(e)) + " (" +
         cudaGetErrorName(e) + "): " + cudaGetErrorString(e);
}

Code cuda_code(cudaError_t e) {
  return e == cudaErrorMemoryAllocation ? Code::OutOfMemory : Code::Comm;
}

// Polling with a short spin of yields (small collectives finish within
// microseconds), then sleeps that grow to half a millisecond.
class Backoff {
 public:
  void pause() {
    if (Clock::now() - start_ < std::chrono::microseconds(200)) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(500));
  }

 private:
  Clock::time_point start_ = Clock::now();
  std::chrono::microseconds sleep_{10};
};

nccl::ncclDataType_t nccl_dtype(DType t, const std::string& where) {
  switch (t) {
    case DType::F32: return nccl::ncclFloat32;
    case DType::BF16: return nccl::ncclBfloat16;
    case DType::F16: return nccl::ncclFloat16;
    case DType::U8: return nccl::ncclUint8;
  }
  fail(Code::InvalidArgument, where, ": dtype ", static_cast<int>(t), " is not supported");
}

// ZS_AVG of ZS_UINT8 never gets here (Communicator refuses it).
nccl::ncclRedOp_t nccl_op(ReduceOp op, const std::string& where) {
  switch (op) {
    case ReduceOp::Sum: return nccl::ncclSum;
    case ReduceOp::Avg: return nccl::ncclAvg;
    case ReduceOp::Max: return nccl::ncclMax;
    case ReduceOp::Min: return nccl::ncclMin;
  }
  fail(Code::InvalidArgument, where, ": reduce op ", static_cast<int>(op), " is not supported");
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclLibrary& lib, std::string name, int rank, int size, int ordinal,
                   cudaStream_t engine_stream, std::chrono::milliseconds timeout,
                   std::function<std::string()> silent_peer)
      : lib_(lib),
        name_(std::move(name)),
        rank_(rank),
        size_(size),
        ordinal_(ordinal),
        engine_(engine_stream),
        timeout_(timeout),
        silent_peer_(std::move(silent_peer)) {}

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  ~NcclCommunicator() override {
    cudaSetDevice(ordinal_);
    if (comm_ != nullptr) {
      // A clean teardown when the communicator is healthy; abort when the
      // finalize fails or does not finish (peers gone).
      bool clean = false;
      ncclResult_t r = lib_.ncclCommFinalize(comm_);
      if (r == nccl::ncclSuccess || r == nccl::ncclInProgress) {
        const auto deadline = Clock::now() + std::min(timeout_, kMaxFinalizeWait);
        Backoff backoff;
        ncclResult_t state = nccl::ncclInProgress;
        while (lib_.ncclCommGetAsyncError(comm_, &state) == nccl::ncclSuccess &&
               state == nccl::ncclInProgress && Clock::now() < deadline)
          backoff.pause();
        clean = state == nccl::ncclSuccess;
      }
      if (clean) {
        lib_.ncclCommDestroy(comm_);
      } else {
        lib_.ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    cudaGetLastError();  // leave no error of ours behind on this thread
  }

  // Creates the stream, events and scratch buffer, exchanges the unique id
  // and initialises NCCL. Throws; the destructor releases what was made.
  void init(Store& store) {
    const std::string where = "creating NCCL group " + who();
    init_cuda(cudaSetDevice(ordinal_), where, "cudaSetDevice");
    init_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), where,
              "cudaStreamCreateWithFlags");
    init_cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), where,
              "cudaEventCreate");
    init_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), where, "cudaEventCreate");
    init_cuda(cudaMalloc(&scratch_, kScratchBytes), where, "cudaMalloc");
    // On the communication stream: it is non-blocking, so a plain cudaMemset
    // (legacy stream, asynchronous for device memory) would not be ordered
    // before the barriers that read the scratch.
    init_cuda(cudaMemsetAsync(scratch_, 0, kScratchBytes, stream_), where, "cudaMemsetAsync");

    nccl::ncclUniqueId id{};
    try {
      if (rank_ == 0) {
        const ncclResult_t r = lib_.ncclGetUniqueId(&id);
        if (r != nccl::ncclSuccess)
          fail(Code::Comm, "ncclGetUniqueId failed: ", lib_.describe(r, nullptr));
        store.set(kUniqueIdKey, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
      } else {
        const std::vector<char> v = store.get(kUniqueIdKey);
        if (v.size() != sizeof(id.internal))
          fail(Code::Bootstrap, "the stored NCCL unique id has ", v.size(), " bytes, expected ",
               sizeof(id.internal));
        std::copy(v.begin(), v.end(), id.internal);
      }
    } catch (const Error& e) {
      fail(e.code(), "NCCL unique id of group ", who(), ": ", e.what());
    }

    // Non-blocking init, polled so that a missing peer is a timeout.
    nccl::ncclConfigV21400 config = nccl::nonblocking_config();
    nccl::ncclComm_t comm = nullptr;
    const auto deadline = Clock::now() + timeout_;
    ncclResult_t r = lib_.ncclCommInitRankConfig(&comm, size_, id, rank_, &config);
    if (r != nccl::ncclSuccess && r != nccl::ncclInProgress) {
      const std::string text = lib_.describe(r, comm);
      if (comm != nullptr) lib_.ncclCommAbort(comm);
      fail(Code::Comm, "NCCL init of group ", who(), " failed: ", text);
    }
    // A member that stopped or died (heartbeat) ends the wait long before
    // the deadline; NCCL itself would wait for it until then.
    auto next_liveness_check = Clock::now();
    Backoff backoff;
    for (;;) {
      ncclResult_t state = nccl::ncclInProgress;
      r = lib_.ncclCommGetAsyncError(comm, &state);
      if (r != nccl::ncclSuccess) state = r;
      if (state == nccl::ncclSuccess) break;
      if (state != nccl::ncclInProgress) {
        const std::string text = lib_.describe(state, comm);
        lib_.ncclCommAbort(comm);
        fail(Code::Comm, "NCCL init of group ", who(), " failed: ", text);
      }
      std::string why;
      try {
        why = silent_member_due(next_liveness_check);
      } catch (...) {
        lib_.ncclCommAbort(comm);
        throw;
      }
      if (!why.empty()) {
        lib_.ncclCommAbort(comm);
        fail(Code::Comm, why, "; NCCL init of group ", who(), " cannot complete");
      }
      if (Clock::now() >= deadline) {
        lib_.ncclCommAbort(comm);
        fail(Code::Timeout, "NCCL init of group ", who(), " did not finish in ", timeout_.count(),
             " ms (is every rank of the group running and on the same unique id?)");
      }
      backoff.pause();
    }
    comm_ = comm;
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void allgather(const void* send, void* recv, size_t bytes) override {
    usable("all-gather");
    if (bytes == 0) return;
    run("all-gather", [&] {
      call(lib_.ncclAllGather(send, recv, bytes, nccl::ncclUint8, comm_, stream_));
    });
  }

  void allgather_coalesced(const std::vector<GatherSegment>& segments) override {
    usable("coalesced all-gather");
    std::vector<const GatherSegment*> todo;
    for (const auto& s : segments)
      if (s.bytes > 0) todo.push_back(&s);
    if (todo.empty()) return;
    run("coalesced all-gather", [&] {
      for (size_t begin = 0; begin < todo.size(); begin += kMaxOpsPerGroup) {
        const size_t end = std::min(todo.size(), begin + kMaxOpsPerGroup);
        grouped([&]() -> ncclResult_t {
          for (size_t i = begin; i < end; ++i) {
            const GatherSegment& s = *todo[i];
            const ncclResult_t r =
                lib_.ncclAllGather(s.send, s.recv, s.bytes, nccl::ncclUint8, comm_, stream_);
            if (failed(r)) return r;
          }
          return nccl::ncclSuccess;
        });
      }
    });
  }

  void do_reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp op) override {
    usable("reduce-scatter");
    const std::string where = "reduce-scatter on group " + who();
    const nccl::ncclDataType_t t = nccl_dtype(dtype, where);
    const nccl::ncclRedOp_t o = nccl_op(op, where);
    if (count == 0) return;
    run("reduce-scatter", [&] {
      call(lib_.ncclReduceScatter(send, recv, count, t, o, comm_, stream_));
    });
  }

  void do_allreduce(const void* send, void* recv, size_t count, DType dtype,
                    ReduceOp op) override {
    usable("all-reduce");
    const std::string where = "all-reduce on group " + who();
    const nccl::ncclDataType_t t = nccl_dtype(dtype, where);
    const nccl::ncclRedOp_t o = nccl_op(op, where);
    if (count == 0) return;
    run("all-reduce", [&] { call(lib_.ncclAllReduce(send, recv, count, t, o, comm_, stream_)); });
  }

  // Grouped sends and receives (ncclSend/ncclRecv, in every NCCL the
  // loader accepts); our own block is a device copy on the same stream.
  void do_alltoall(const void* send, void* recv, size_t bytes, Payload) override {
    usable("all-to-all");
    if (bytes == 0) return;
    const auto* in = static_cast<const char*>(send);
    auto* out = static_cast<char*>(recv);
    auto at = [bytes](int r) { return static_cast<size_t>(r) * bytes; };
    run("all-to-all", [&] {
      cuda(cudaMemcpyAsync(out + at(rank_), in + at(rank_), bytes, cudaMemcpyDefault, stream_),
           "cudaMemcpyAsync");
      if (size_ == 1) return;
      grouped([&]() -> ncclResult_t {
        for (int peer = 0; peer < size_; ++peer) {
          if (peer == rank_) continue;
          ncclResult_t r =
              lib_.ncclSend(in + at(peer), bytes, nccl::ncclUint8, peer, comm_, stream_);
          if (failed(r)) return r;
          r = lib_.ncclRecv(out + at(peer), bytes, nccl::ncclUint8, peer, comm_, stream_);
          if (failed(r)) return r;
        }
        return nccl::ncclSuccess;
      });
    });
  }

  void do_broadcast(void* buf, size_t bytes, int root) override {
    usable("broadcast");
    if (bytes == 0) return;
    run("broadcast", [&] {
      call(lib_.ncclBroadcast(buf, buf, bytes, nccl::ncclUint8, root, comm_, stream_));
    });
  }

  void do_scatter(const std::vector<const void*>& inputs, void* recv, size_t bytes,
                  int root) override {
    usable("scatter");
    if (bytes == 0) return;
    run("scatter", [&] {
      if (rank_ == root && inputs[static_cast<size_t>(root)] != recv)
        cuda(cudaMemcpyAsync(recv, inputs[static_cast<size_t>(root)], bytes, cudaMemcpyDefault,
                             stream_),
             "cudaMemcpyAsync");
      if (size_ == 1) return;
      grouped([&]() -> ncclResult_t {
        if (rank_ != root)
          return lib_.ncclRecv(recv, bytes, nccl::ncclUint8, root, comm_, stream_);
        for (int peer = 0; peer < size_; ++peer) {
          if (peer == root) continue;
          const ncclResult_t r = lib_.ncclSend(inputs[static_cast<size_t>(peer)], bytes,
                                               nccl::ncclUint8, peer, comm_, stream_);
          if (failed(r)) return r;
        }
        return nccl::ncclSuccess;
      });
    });
  }

  void barrier() override {
    usable("barrier");
    run("barrier", [&] {
      call(lib_.ncclAllReduce(scratch_, scratch_, 1, nccl::ncclFloat32, nccl::ncclSum, comm_,
                              stream_));
    });
  }

 private:
  static constexpr size_t kScratchBytes = 256;

  std::string who() const {
    return "'" + name_ + "' (rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
           ")";
  }
  std::string where() const { return std::string(op_) + " on group " + who(); }

  void init_cuda(cudaError_t e, const std::string& where, const char* what) {
    if (e == cudaSuccess) return;
    cudaGetLastError();
    fail(cuda_code(e), where, ": ", what, ": ", cuda_text(e));
  }

  // From any thread: the group's thread, polling, aborts the NCCL
  // communicator (ncclCommAbort is not safe beside a call in progress).
  void abort(const std::string& why) override {
    std::lock_guard<std::mutex> held(abort_mu_);
    if (abort_requested_.load()) return;
    abort_why_ = why;
    abort_requested_.store(true);
  }

  // After an abort every call fails at once, with the original code.
  void usable(const char* op) {
    if (!broken_ && abort_requested_.load()) {
      op_ = op;
      break_comm(Code::Comm, abort_reason() + "; " + where() + " cannot start");
    }
    if (broken_)
      throw Error(broken_code_, std::string(op) + " on group " + who() +
                                    ": unusable after an earlier failure: " +
                                    broken_message_);
  }

  // Aborts the NCCL communicator and throws; later calls throw the same.
  [[noreturn]] void break_comm(Code code, const std::string& message) {
    if (!broken_) {
      broken_ = true;
      broken_code_ = code;
      broken_message_ = message + "; the NCCL communicator was aborted";
      if (comm_ != nullptr) lib_.ncclCommAbort(comm_);
      comm_ = nullptr;
      cudaGetLastError();
    }
    throw Error(code, broken_message_);
  }

  void cuda(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    cudaGetLastError();
    break_comm(cuda_code(e), where() + " failed: " + what + ": " + cuda_text(e));
  }

  // Checks an NCCL return; ncclInProgress (a non-blocking communicator still
  // setting up connections) is waited out within the deadline.
  void call(ncclResult_t r) {
    if (r == nccl::ncclInProgress) r = wait_state();
    if (r != nccl::ncclSuccess)
      break_comm(Code::Comm, where() + " failed: " + lib_.describe(r, comm_));
  }

  ncclResult_t wait_state() {
    Backoff backoff;
    auto next_liveness_check = Clock::now();
    for (;;) {
      ncclResult_t state = nccl::ncclInProgress;
      const ncclResult_t r = lib_.ncclCommGetAsyncError(comm_, &state);
      if (r != nccl::ncclSuccess) return r;
      if (state != nccl::ncclInProgress) return state;
      check_peers(next_liveness_check);
      if (Clock::now() >= deadline_) timed_out();
      backoff.pause();
    }
  }

  // The sentence naming a member that stopped or died (heartbeat), once
  // `next` is due (then the next check is kLivenessCheck away); "" while
  // every member is alive, before `next`, or without a heartbeat.
  std::string silent_member_due(Clock::time_point& next) const {
    if (!silent_peer_) return "";
    const auto now = Clock::now();
    if (now < next) return "";
    next = now + kLivenessCheck;
    return silent_peer_();
  }

  // A silent member breaks the collective within the heartbeat limit,
  // naming it, instead of at the deadline: NCCL would wait for it until
  // then.
  void check_peers(Clock::time_point& next) {
    if (abort_requested_.load()) break_comm(Code::Comm, abort_reason() + "; " + where() + " cannot complete");
    const std::string why = silent_member_due(next);
    if (!why.empty()) break_comm(Code::Comm, why + "; " + where() + " cannot complete");
  }

  [[noreturn]] void timed_out() {
    break_comm(Code::Timeout, where() + " did not finish in " + std::to_string(timeout_.count()) +
                                  " ms (a peer may be missing, stuck or out of step)");
  }

  // Inside a group an operation on a non-blocking communicator may report
  // ncclInProgress; that is no failure, and stopping there would leave the
  // group short of operations its peers do post (a hang, not an error).
  static bool failed(ncclResult_t r) {
    return r != nccl::ncclSuccess && r != nccl::ncclInProgress;
  }

  // Runs body inside ncclGroupStart/End; body returns its first failure. The
  // group is always closed so that this thread's NCCL group state is sane.
  template <typename Body>
  void grouped(Body&& body) {
    call(lib_.ncclGroupStart());
    const ncclResult_t first = body();
    const ncclResult_t end = lib_.ncclGroupEnd();
    if (failed(first)) call(first);
    call(end);
  }

  // One collective: order after the engine stream, enqueue, then wait for
  // completion, an NCCL error or the deadline.
  template <typename Enqueue>
  void run(const char* op, Enqueue&& enqueue) {
    op_ = op;
    deadline_ = Clock::now() + timeout_;
    cuda(cudaSetDevice(ordinal_), "cudaSetDevice");
    cuda(cudaEventRecord(ready_, engine_), "cudaEventRecord on the engine stream");
    cuda(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    enqueue();
    cuda(cudaEventRecord(done_, stream_), "cudaEventRecord on the communication stream");
    Backoff backoff;
    auto next_liveness_check = Clock::now() + kLivenessCheck;
    for (;;) {
      const cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) cuda(q, "waiting for completion (cudaEventQuery)");
      ncclResult_t state = nccl::ncclSuccess;
      const ncclResult_t r = lib_.ncclCommGetAsyncError(comm_, &state);
      if (r != nccl::ncclSuccess) state = r;
      if (state != nccl::ncclSuccess && state != nccl::ncclInProgress)
        break_comm(Code::Comm, where() + " failed: " + lib_.describe(state, comm_));
      check_peers(next_liveness_check);
      if (Clock::now() >= deadline_) timed_out();
      backoff.pause();
    }
  }

  const NcclLibrary& lib_;
  const std::string name_;
  const int rank_;
  const int size_;
  const int ordinal_;
  cudaStream_t engine_;
  const std::chrono::milliseconds timeout_;
  const std::function<std::string()> silent_peer_;  // may be empty

  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
  void* scratch_ = nullptr;
  nccl::ncclComm_t comm_ = nullptr;

  const char* op_ = "";
  Clock::time_point deadline_{};
  std::string abort_reason() const {
    std::lock_guard<std::mutex> held(abort_mu_);
    return abort_why_;
  }
  mutable std::mutex abort_mu_;  // abort_why_
  std::atomic<bool> abort_requested_{false};
  std::string abort_why_;
  bool broken_ = false;
  Code broken_code_ = Code::Comm;
  std::string broken_message_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const std::string& group_name, int rank,
                                                     int size, Store& store, int cuda_ordinal,
                                                     void* engine_stream,
                                                     std::chrono::milliseconds timeout,
                                                     std::function<std::string()> silent_peer) {
  if (size < 1 || rank < 0 || rank >= size)
    fail(Code::InvalidArgument, "group '", group_name, "': rank ", rank, " of ", size,
         " is out of range");
  if (cuda_ordinal < 0)
    fail(Code::InvalidArgument, "group '", group_name, "': CUDA device ", cuda_ordinal,
         " is not a device ordinal");
  if (timeout.count() <= 0)
    fail(Code::InvalidArgument, "group '", group_name, "': timeout ", timeout.count(),
         " ms must be positive");

  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    fail(Code::NotSupported, "group '", group_name, "': CUDA device ", cuda_ordinal,
         " is not available: no CUDA device (cudaGetDeviceCount: ", cuda_text(e), ")");
  }
  if (count == 0)
    fail(Code::NotSupported, "group '", group_name, "': CUDA device ", cuda_ordinal,
         " is not available: no CUDA device");
  if (cuda_ordinal >= count)
    fail(Code::NotSupported, "group '", group_name, "': CUDA device ", cuda_ordinal,
         " is not available: this process sees ", count, " CUDA device",
         count == 1 ? "" : "s", " (check CUDA_VISIBLE_DEVICES)");

  const NcclLibrary* lib = nullptr;
  try {
    lib = &nccl_library();
  } catch (const Error& err) {
    fail(err.code(), "group '", group_name, "' needs NCCL: ", err.what());
  }

  auto comm = std::make_unique<NcclCommunicator>(*lib, group_name, rank, size, cuda_ordinal,
                                                 static_cast<cudaStream_t>(engine_stream),
                                                 timeout, std::move(silent_peer));
  comm->init(store);
  return comm;
}

}  // namespace zs
