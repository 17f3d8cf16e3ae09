#include "impl/comm/transport/gloo_communicator.h"

#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <cstdio>
#include <cstring>
#include <deque>
#include <random>
#include <vector>

#include "impl/comm/transport/collective_label.h"
#include "impl/comm/transport/collective_watch.h"
#include "impl/comm/algo/collectives.h"
#include "impl/comm/algo/mesh_peers.h"
#include "impl/comm/transport/cross_memory.h"
#include "impl/comm/transport/heartbeat.h"
#include "impl/comm/transport/shared_memory_rings.h"
#include "impl/comm/store/job_secret.h"
#include "impl/comm/algo/point_to_point.h"
#include "impl/common/no_sigpipe.h"

namespace zs {
namespace {

// Slots of our point-to-point algorithms: prefix, the collective's 32-bit
// tag, the message's index within it. A cross-memory read's
// acknowledgement goes in the slot of its message's index with kAckBit set.
constexpr uint64_t kSlotPrefix = 0xA0;
constexpr uint32_t kAckBit = 1u << 23;

// Gloo's connectFullMesh puts all of a rank's pair addresses under one key
// and has every peer read all of it for the one address meant for it: the
// store serves N (N - 1)^2 addresses in all, N^3 bytes (37 MiB at 64 ranks,
// about 160 GB at 1,024), in 2 (N - 1) requests per rank. Here each pair's
// address has a key of its own, written in one request (set_many) and read
// in one (get_many, which waits for them all): a rank reads only the N - 1
// addresses meant for it (N^2 bytes in all), in two requests per 1,024
// peers. Every address comes before any connect, so a member that never
// comes is found in a store read (which a heartbeat can cut short, naming
// it), not in a pair's connect that waits on a peer stuck behind it. The
// same write publishes this rank's empty collective-watch notes, so that
// every member's exist once any member has connected. Past the full mesh
// only the pairs to `peers` (mesh_peers.h) are made: 2 log N of them.
class PairwiseContext final : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;

  void connect_pairs(zs::Store& store, const std::shared_ptr<gloo::transport::Device>& dev,
                     const std::vector<int>& peers) {
    auto pairs = dev->createContext(rank, size);
    pairs->setTimeout(getTimeout());
    const auto key = [](int from, int to) { return "pair/" + std::to_string(from) + "/" + std::to_string(to); };
    std::vector<std::string> mine, theirs;
    std::vector<std::vector<char>> addresses;
    for (const int peer : peers) {
      mine.push_back(key(rank, peer));
      theirs.push_back(key(peer, rank));
      addresses.push_back(pairs->createPair(peer)->address().bytes());
    }
    mine.push_back(CollectiveWatch::notes_key(rank));
    addresses.emplace_back();
    store.set_many(mine, addresses);
    const auto remote = store.get_many(theirs);
    for (size_t i = 0; i < peers.size(); ++i) pairs->getPair(peers[i])->connect(remote[i]);
    device_ = dev;
    transportContext_ = std::move(pairs);
  }
};

using UBuf = std::unique_ptr<gloo::transport::UnboundBuffer>;

// Every collective is its own set of point-to-point messages (the
// algorithms in collectives.h), in slots derived from the collective's
// identity (see collective_watch.h): ranks that disagree on what they run
// use different slots, so they never read each other's bytes and Gloo never
// sees a size it did not expect. Their waits are cut short by the watch
// when it finds the disagreement.
class GlooCommunicator final : public Communicator, private PointToPoint {
 public:
  bool runs_on_any_thread() const override { return true; }
  GlooCommunicator(std::string name, std::shared_ptr<gloo::rendezvous::Context> ctx,
                   std::vector<int> peers, std::chrono::milliseconds timeout,
                   std::shared_ptr<Store> store, std::shared_ptr<Heartbeat> heartbeat,
                   std::vector<int> world_ranks)
      : name_(std::move(name)),
        ctx_(std::move(ctx)),
        peers_(std::move(peers)),
        connected_(static_cast<size_t>(ctx_->size), false),
        timeout_(timeout),
        checks_(collective_check_after().count() > 0),
        watch_(name_, ctx_->rank, ctx_->size, checks_ ? std::move(store) : nullptr,
               collective_check_after(), straggler_warn_after(timeout_), world_ranks,
               full_mesh() ? std::vector<int>() : peers_),
        heartbeat_(std::move(heartbeat)),
        members_(std::move(world_ranks)) {
    for (const int p : peers_) connected_[static_cast<size_t>(p)] = true;
    // A stopped peer keeps its sockets open: only its silence tells.
    if (heartbeat_)
      silenced_ = heartbeat_->watch(members_, [this](const std::string& why) { watch_.interrupt(why); });
  }

  int rank() const override { return ctx_->rank; }
  int size() const override { return ctx_->size; }

  // The wait in flight is cut short through the watch (as a silent peer's
  // is) and fails, closing this member's pairs (release_after_failure), so
  // peers waiting on it fail too; later collectives fail before posting.
  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> held(abort_mu_);
      if (aborted_.load()) return;
      abort_why_ = why;
      aborted_.store(true);
    }
    watch_.interrupt(why);
  }
  bool full_mesh() const override { return peers_.size() + 1 == static_cast<size_t>(size()); }

  void allgather(const void* send, void* recv, size_t bytes) override {
    run("all-gather", [&] { return std::to_string(bytes) + " bytes per rank"; }, 0,
        [&] { collectives::all_gather(*this, {GatherSegment{send, recv, bytes}}); });
  }

  void allgather_coalesced(const std::vector<GatherSegment>& segments) override {
    size_t total = 0;
    uint64_t sizes = 0xcbf29ce484222325ull;
    for (const auto& s : segments) {
      total += s.bytes;
      sizes = (sizes ^ s.bytes) * 0x100000001b3ull;
    }
    run("coalesced all-gather",
        [&] {
          return std::to_string(segments.size()) +
                 (segments.size() == 1 ? " segment, " : " segments, ") + std::to_string(total) +
                 " bytes per rank";
        },
        sizes, [&] { collectives::all_gather(*this, segments); });
  }

  void do_reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp op) override {
    run("reduce-scatter", [&] { return elements(count, dtype, op) + " per rank"; }, 0,
        [&] { collectives::reduce_scatter(*this, send, recv, count, dtype, op); });
  }

  void do_reduce_scatter_strided(const void* send, void* recv, size_t count, size_t stride, DType dtype,
                                 ReduceOp op) override {
    run("reduce-scatter", [&] { return elements(count, dtype, op) + " per rank"; }, 0,
        [&] { collectives::reduce_scatter(*this, send, recv, count, dtype, op, stride); });
  }

  void do_reduce_scatter_into(const float* send, size_t count, size_t stride, ReduceOp op,
                              const ReducedBlock& take) override {
    run("reduce-scatter", [&] { return elements(count, DType::F32, op) + " per rank"; }, 0,
        [&] { collectives::reduce_scatter_into(*this, send, count, stride, op, take); });
  }

  void do_allreduce(const void* send, void* recv, size_t count, DType dtype,
                    ReduceOp op) override {
    run("all-reduce", [&] { return elements(count, dtype, op); }, 0,
        [&] { collectives::all_reduce(*this, send, recv, count, dtype, op); });
  }

  void do_alltoall(const void* send, void* recv, size_t bytes, Payload) override {
    run("all-to-all", [&] { return std::to_string(bytes) + " bytes per rank"; }, 0,
        [&] { collectives::all_to_all(*this, send, recv, bytes); });
  }

  void do_broadcast(void* buf, size_t bytes, int root) override {
    run("broadcast",
        [&] { return std::to_string(bytes) + " bytes from rank " + std::to_string(root); }, 0,
        [&] { collectives::broadcast(*this, buf, bytes, root); });
  }

  void do_scatter(const std::vector<const void*>& inputs, void* recv, size_t bytes,
                  int root) override {
    run("scatter",
        [&] { return std::to_string(bytes) + " bytes per rank from rank " + std::to_string(root); },
        0, [&] { collectives::scatter(*this, inputs, recv, bytes, root); });
  }

  void barrier() override {
    run("barrier", [] { return std::string(); }, 0, [&] { collectives::barrier(*this); });
  }

  // Members send different bytes, so the identity names only the op: its
  // sequence number keeps rounds apart. One message per buffer, straight
  // from the caller's memory (a large one on the same host by one
  // cross-memory read).
  void do_exchange(int to, const std::vector<ExchangeSend>& sends, int from,
                   const std::vector<ExchangeRecv>& recvs) override {
    if (sends.size() > 0xffffff || recvs.size() > 0xffffff)
      fail(Code::InvalidArgument, "exchange of ", std::max(sends.size(), recvs.size()),
           " messages: at most 16777215");
    run("exchange", [] { return std::string(); }, 0, [&] {
      for (size_t i = 0; i < recvs.size(); ++i)
        if (recvs[i].bytes > 0) recv(from, static_cast<uint32_t>(i), recvs[i].data, recvs[i].bytes);
      for (size_t i = 0; i < sends.size(); ++i)
        if (sends[i].bytes > 0) send(to, static_cast<uint32_t>(i), sends[i].data, sends[i].bytes);
      wait();
    });
  }

  // Every member proves the job secret to every peer over their pair, on a
  // fresh challenge from that peer: a process that connected to a rank's
  // listener before the real peer did (a stranger, or a rank of another
  // job) cannot, and the group fails naming the pair instead of adopting
  // it. The proof says from whom to whom, so it cannot be replayed.
  void prove_pairs(const std::string& secret) {
    const int n = size(), me = rank();
    auto context = [&](int from, int to) {
      return "pair of group " + name_ + " from rank " + std::to_string(from) + " to rank " +
             std::to_string(to);
    };
    const std::string mine = make_challenge();
    std::vector<std::string> theirs(static_cast<size_t>(n), std::string(kChallengeBytes, '\0'));
    for (const int peer : peers_) {
      recv(peer, 0, theirs[static_cast<size_t>(peer)].data(), kChallengeBytes);
      send(peer, 0, mine.data(), kChallengeBytes);
    }
    wait();
    std::vector<std::string> proofs(static_cast<size_t>(n)),
        answers(static_cast<size_t>(n), std::string(kProofBytes, '\0'));
    for (const int peer : peers_) {
      const auto p = static_cast<size_t>(peer);
      proofs[p] = job_proof(secret, context(me, peer), theirs[p]);
      recv(peer, 1, answers[p].data(), kProofBytes);
      send(peer, 1, proofs[p].data(), kProofBytes);
    }
    wait();
    for (const int peer : peers_) {
      if (!proofs_equal(answers[static_cast<size_t>(peer)],
                        job_proof(secret, context(peer, me), mine)))
        fail(Code::Bootstrap, "the connection to rank ", peer, " of group '", name_,
             "' failed the job-secret check: the process at its other end is not rank ", peer,
             " of this job, or was started with another ZS_JOB_SECRET; the group is not used");
    }
  }

  // The group's first collective, #0 (the trainer's are numbered from 1):
  // the job-secret proof when there is a secret, then the cross-memory
  // check, then the shared-memory rings.
  void check_pairs(const std::string& secret) {
    seq_ = UINT64_MAX;  // run() counts it up to 0
    run("check of the group's connections", [] { return std::string(); }, 0, [&] {
      if (!secret.empty()) prove_pairs(secret);
      connect_cross_memory();
      if (full_mesh()) connect_shared_memory();
    });
  }

  // A group whose every pair reads by cross memory moves its messages to
  // shared-memory rings (shared_memory_rings.h) when every member maps
  // every peer's inbox: each member says whether it could, to every peer,
  // so all decide alike. (Messages 4 and 5.)
  void connect_shared_memory() {
    const auto count = static_cast<size_t>(size());
    bool eligible = shared_memory_allowed();
    for (const int peer : peers_) eligible = eligible && peer_pid_[static_cast<size_t>(peer)] != 0;
    std::unique_ptr<SharedMemoryRings> rings = eligible ? SharedMemoryRings::create(rank(), size()) : nullptr;
    const SharedMemoryRings::Hello mine = rings ? rings->hello() : SharedMemoryRings::Hello{};
    std::vector<SharedMemoryRings::Hello> theirs(count);
    for (const int peer : peers_) {
      recv(peer, 4, &theirs[static_cast<size_t>(peer)], sizeof(SharedMemoryRings::Hello));
      send(peer, 4, &mine, sizeof(SharedMemoryRings::Hello));
    }
    wait();
    uint8_t mapped = rings ? 1 : 0;
    for (const int peer : peers_) {
      const auto p = static_cast<size_t>(peer);
      if (mapped && !rings->attach(peer, theirs[p], peer_epoch_at_[p])) mapped = 0;
    }
    std::vector<uint8_t> all(count, 0);
    for (const int peer : peers_) {
      recv(peer, 5, &all[static_cast<size_t>(peer)], 1);
      send(peer, 5, &mapped, 1);
    }
    wait();
    for (const int peer : peers_) mapped = mapped && all[static_cast<size_t>(peer)];
    if (mapped) rings_ = std::move(rings);
  }

  // Which pairs can read each other's memory (cross_memory.h): every
  // member tells every peer where its nonce is, tries reading each peer's,
  // and the two ends of a pair tell each other what they found; a pair
  // uses cross-memory reads only when both ends can. (Messages 2 and 3:
  // the job-secret proof's are 0 and 1.)
  void connect_cross_memory() {
    const auto count = static_cast<size_t>(size());
    nonce_ = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    const CrossMemoryHello mine = cross_memory_hello(&nonce_);
    std::vector<CrossMemoryHello> theirs(count);
    for (const int peer : peers_) {
      recv(peer, 2, &theirs[static_cast<size_t>(peer)], sizeof(CrossMemoryHello));
      send(peer, 2, &mine, sizeof(CrossMemoryHello));
    }
    wait();
    std::vector<uint8_t> reach(count, 0), reached(count, 0);
    for (const int peer : peers_) {
      const auto p = static_cast<size_t>(peer);
      reach[p] = cross_memory_reaches(mine, theirs[p]) ? 1 : 0;
      recv(peer, 3, &reached[p], 1);
      send(peer, 3, &reach[p], 1);
    }
    wait();
    peer_pid_.assign(count, 0);
    peer_epoch_at_.assign(count, 0);
    for (size_t p = 0; p < count; ++p) {
      if (!reach[p] || !reached[p]) continue;
      peer_pid_[p] = static_cast<pid_t>(theirs[p].pid);
      peer_epoch_at_[p] = theirs[p].epoch_at;
    }
  }

 private:
  static std::string elements(size_t count, DType dtype, ReduceOp op) {
    static const char* kOps[] = {"sum", "avg", "max", "min"};
    return std::to_string(count) + " x " + dtype_name(dtype) + ", " +
           kOps[static_cast<int>(op) & 3];
  }

  // PointToPoint over Gloo's unbound buffers: one buffer per message. A
  // large message to a peer that can read our memory goes as its address
  // instead; the peer copies it out (cross_memory_read) and acknowledges,
  // and our wait() returns only after that acknowledgement, so the
  // memory stays valid for as long as the peer reads it.
  //
  // A post that throws (Gloo refuses one to a pair that already failed)
  // first releases everything posted before it: the exception unwinds the
  // collective's frames, freeing the memory those messages point into,
  // before run() gets to abandon them.
  void send(int peer, uint32_t index, const void* data, size_t bytes) override {
    if (rings_) return rings_->send(peer, slot(index), data, bytes);
    posting([&] {
      if (by_cross_memory(peer, bytes)) {
        auto& out = cm_sends_.emplace_back();
        out.where = cross_memory_address(data, bytes);
        post_send(peer, index, &out.where, sizeof(out.where));
        acks_.push_back(ctx_->createUnboundBuffer(&out.ack, 1));
        acks_.back()->recv(peer, slot(index | kAckBit));
        return;
      }
      post_send(peer, index, data, bytes);
    });
  }
  void recv(int peer, uint32_t index, void* data, size_t bytes) override {
    if (rings_) return rings_->recv(peer, slot(index), data, bytes);
    posting([&] {
      if (by_cross_memory(peer, bytes)) {
        auto& in = cm_recvs_.emplace_back();
        in.peer = peer;
        in.index = index;
        in.dst = data;
        in.bytes = bytes;
        post_recv(peer, index, &in.where, sizeof(in.where));
        return;
      }
      post_recv(peer, index, data, bytes);
    });
  }
  template <typename Fn>
  void posting(Fn&& post) {
    try {
      post();
    } catch (...) {
      release_after_failure();
      throw;
    }
  }
  void wait() override {
    if (rings_) return wait_rings();
    try {
      // Every message and address posted to us arrives whatever we do
      // next (the peers posted them before waiting), so reading and
      // acknowledging only after all of them cannot deadlock.
      for (auto& b : recvs_) wait_recv(*b);
      for (auto& in : cm_recvs_) {
        read_peer(in);
        post_send(in.peer, in.index | kAckBit, &in.ack, 1);
      }
      for (auto& b : acks_) wait_recv(*b);  // the peers have read what we sent
      for (auto& b : sends_) wait_send(*b);
    } catch (...) {
      release_after_failure();
      throw;
    }
    clear_posted();
  }

  // The wait on the rings, cut short as a Gloo buffer's is (arm).
  void wait_rings() {
    try {
      rings_->clear_interrupt();
      arm([this] { rings_->interrupt(); });
      const bool done = rings_->wait(timeout_, name_, op_);
      watch_.set_abort(nullptr);
      if (!done) aborted("receive");
    } catch (...) {
      watch_.set_abort(nullptr);
      release_after_failure();
      throw;
    }
  }

  struct CrossMemorySend {
    CrossMemoryAddress where;
    uint8_t ack = 0;
  };
  struct CrossMemoryRecv {
    int peer = 0;
    uint32_t index = 0;
    void* dst = nullptr;
    size_t bytes = 0;
    CrossMemoryAddress where;
    uint8_t ack = 1;
  };

  bool by_cross_memory(int peer, size_t bytes) const {
    return bytes >= kCrossMemoryMinBytes && static_cast<size_t>(peer) < peer_pid_.size() &&
           peer_pid_[static_cast<size_t>(peer)] != 0;
  }
  // An algorithm that messages a member this one has no pair with is a bug
  // (sparse_collectives.h names whom each may message); Gloo would crash.
  void check_connected(int peer) const {
    if (peer < 0 || peer >= size() || !connected_[static_cast<size_t>(peer)])
      fail(Code::Internal, op_, " on group '", name_, "': rank ", rank(), " has no pair with rank ",
           peer, " (", peers_.size(), " pairs of ", size() - 1, " possible)");
  }
  void post_send(int peer, uint32_t index, const void* data, size_t bytes) {
    check_connected(peer);
    sends_.push_back(ctx_->createUnboundBuffer(const_cast<void*>(data), bytes));
    sends_.back()->send(peer, slot(index));
  }
  void post_recv(int peer, uint32_t index, void* data, size_t bytes) {
    check_connected(peer);
    recvs_.push_back(ctx_->createUnboundBuffer(data, bytes));
    recvs_.back()->recv(peer, slot(index));
  }
  void read_peer(const CrossMemoryRecv& in) {
    const auto p = static_cast<size_t>(in.peer);
    cross_memory_fetch(static_cast<pid_t>(peer_pid_[p]), peer_epoch_at_[p], in.dst, in.bytes,
                       in.where, in.peer, rank(), std::string(op_) + " on group '" + name_ + "'");
  }
  void clear_posted() {
    if (rings_) rings_->forget();
    acks_.clear();
    recvs_.clear();
    sends_.clear();
    cm_sends_.clear();
    cm_recvs_.clear();
  }

  // A failed wait or post leaves messages to live peers in flight, which Gloo's
  // thread still reads and writes in memory the collective frees as the
  // error unwinds. Closing the pairs (under each pair's lock) ends that
  // first; the group is unusable after a failure anyway. Ranks that
  // disagree exchange nothing, and keep their pairs so that their peers
  // reach the same verdict instead of seeing a closed connection.
  //
  // Kept pairs may still be finishing a send or receive to an agreeing peer
  // (past the full mesh, rounds run until the verdict arrives): Gloo's
  // thread signals a buffer's completion under the buffer's own lock, so
  // each buffer's lock is taken (abortWait*) before it is freed, and a
  // completion already signalled happens before the free.
  void release_after_failure() {
    cross_memory_abandon();  // before anything posted can be freed
    if (rings_ && watch_.verdict().empty()) rings_->close();
    if (watch_.verdict().empty()) {
      for (const int p : peers_) ctx_->getPair(p)->close();
    } else {
      for (auto& b : sends_) b->abortWaitSend();
      for (auto& b : recvs_) b->abortWaitRecv();
      for (auto& b : acks_) b->abortWaitRecv();
    }
    clear_posted();
  }

  uint64_t slot(uint32_t index) const {
    return (kSlotPrefix << 56) | (static_cast<uint64_t>(tag_) << 24) | (index & 0xffffffu);
  }

  // Runs one collective under its identity: the watch records it, its tag
  // keys every message, and Gloo's exceptions become ours. With the check
  // off (ZS_COLLECTIVE_CHECK_MS=0) the tag is the sequence number alone, as
  // before identities existed: what their cost is measured against.
  template <typename Detail, typename Fn>
  void run(const char* what, Detail&& detail, uint64_t extra, Fn&& fn) {
    if (aborted_.load()) {
      const std::string& label = CollectiveLabelScope::current();
      fail(Code::Comm, abort_reason(), "; this ", what,
           label.empty() ? " on group '" + name_ + "'" : " for '" + label + "'", " cannot start");
    }
    ++seq_;
    op_ = what;
    if (checks_) {
      CollectiveIdentity id = make_identity(seq_, what, detail(), extra);
      tag_ = static_cast<uint32_t>(id.hash ^ (id.hash >> 32));
      watch_.begin(std::move(id));
    } else {
      tag_ = static_cast<uint32_t>(seq_);
    }
    try {
      fn();
    } catch (const zs::Error& e) {
      abandon();
      report(e.what());
      throw;
    } catch (const std::exception& e) {
      abandon();
      const std::string msg = e.what();
      const bool timed_out = msg.find("imed out") != std::string::npos ||
                             msg.find("imeout") != std::string::npos;
      const std::string full =
          std::string(what) + " on group '" + name_ + "' (rank " + std::to_string(rank()) +
          " of " + std::to_string(size()) + ") failed" +
          (timed_out ? " after " + std::to_string(timeout_.count()) + " ms" : std::string()) +
          ": " + msg + (timed_out ? watch_.whereabouts() : std::string());
      report(full);
      throw Error(timed_out ? Code::Timeout : Code::Comm, full);
    }
    watch_.end(true);
  }

  // A failed collective's buffers go (Gloo holds them only weakly).
  void abandon() {
    watch_.end(false);
    cross_memory_abandon();  // peers may hold addresses of what unwinds now
    clear_posted();
  }

  // The flight recorder: on the first failure, this rank's last collectives
  // on the group go to stderr, so the ranks' logs show where they parted.
  void report(const std::string& why) {
    if (reported_) return;
    reported_ = true;
    std::fprintf(stderr,
                 "zeroshard: rank %d of group '%s' stopped: %s\nits last collectives on the "
                 "group, oldest first:\n%s",
                 rank(), name_.c_str(), why.c_str(), watch_.history().c_str());
  }

  // Arms the watch to cut this wait short, then asks the heartbeat: a
  // member already silent ends the wait at once (Gloo keeps an abort that
  // comes before the wait), one that falls silent later through silenced_.
  void arm(std::function<void()> abort) {
    watch_.set_abort(std::move(abort));
    // An abort() that found no wait armed: this one ends at once (its flag
    // is set before its interrupt, which takes the watch's lock after ours).
    if (aborted_.load()) watch_.interrupt(abort_reason());
    if (!heartbeat_) return;
    if (const std::string why = heartbeat_->silence(members_); !why.empty()) watch_.interrupt(why);
  }
  void wait_recv(gloo::transport::UnboundBuffer& b) {
    arm([&b] { b.abortWaitRecv(); });
    const bool done = b.waitRecv(nullptr, timeout_);
    watch_.set_abort(nullptr);
    if (!done) aborted("receive");
  }
  void wait_send(gloo::transport::UnboundBuffer& b) {
    arm([&b] { b.abortWaitSend(); });
    const bool done = b.waitSend(nullptr, timeout_);
    watch_.set_abort(nullptr);
    if (!done) aborted("send");
  }
  [[noreturn]] void aborted(const char* which) {
    const std::string verdict = watch_.verdict();
    if (!verdict.empty()) fail(Code::Comm, verdict);
    const std::string silent = watch_.interruption();
    const std::string& label = CollectiveLabelScope::current();
    if (!silent.empty())
      fail(Code::Comm, silent, "; this ", op_,
           label.empty() ? " on group '" + name_ + "'" : " for '" + label + "'",
           " cannot complete");
    fail(Code::Comm, which, " on group '", name_, "' was aborted");
  }

  std::string name_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  const std::vector<int> peers_;  // the members with a pair, by group rank
  std::vector<bool> connected_;   // by group rank
  std::chrono::milliseconds timeout_;
  const bool checks_;
  CollectiveWatch watch_;
  const std::shared_ptr<Heartbeat> heartbeat_;
  const std::vector<int> members_;  // world ranks, by group rank
  std::unique_ptr<Heartbeat::Subscription> silenced_;  // before watch_ goes
  std::string abort_reason() const {
    std::lock_guard<std::mutex> held(abort_mu_);
    return abort_why_;
  }
  mutable std::mutex abort_mu_;  // abort_why_
  std::atomic<bool> aborted_{false};
  std::string abort_why_;
  const char* op_ = "";
  uint64_t seq_ = 0;
  uint32_t tag_ = 0;
  bool reported_ = false;
  std::vector<UBuf> sends_, recvs_, acks_;  // posted since the last wait
  // Cross-memory messages posted since the last wait (deques: the posted
  // buffers point into them).
  std::deque<CrossMemorySend> cm_sends_;
  std::deque<CrossMemoryRecv> cm_recvs_;
  std::vector<pid_t> peer_pid_;  // by group rank: 0 unless the pair reads by cross memory
  std::vector<uint64_t> peer_epoch_at_;  // where each such peer's abandon count is
  uint64_t nonce_ = 0;           // read back by the peers to prove the pair
  std::unique_ptr<SharedMemoryRings> rings_;  // set: every message goes through them
};

}  // namespace

std::shared_ptr<gloo::transport::Device> make_gloo_device(const std::string& host) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    SigpipeBlockedScope no_sigpipe;  // the device's loop thread writes too
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    fail(Code::Bootstrap, "cannot create the TCP transport on host '", host, "': ", e.what(),
         " (set ZS_SOCKET_HOST or transport_host to an address of this machine)");
  }
}

std::unique_ptr<Communicator> make_gloo_communicator(
    const std::string& group_name, int rank, int size, Store& store,
    const std::shared_ptr<gloo::transport::Device>& device, std::chrono::milliseconds timeout,
    std::shared_ptr<Store> watch_store, std::shared_ptr<Heartbeat> heartbeat,
    std::vector<int> world_ranks, int full_mesh_max) {
  auto ctx = std::make_shared<PairwiseContext>(rank, size);
  ctx->setTimeout(timeout);
  std::vector<int> peers = mesh_peers(rank, size, full_mesh_max);
  try {
    ctx->connect_pairs(store, device, peers);
  } catch (const zs::Error& e) {
    fail(e.code(), "connecting group '", group_name, "' (rank ", rank, " of ", size,
         "): ", e.what());
  } catch (const std::exception& e) {
    fail(Code::Comm, "connecting group '", group_name, "' (rank ", rank, " of ", size,
         "): ", e.what());
  }
  if (heartbeat && world_ranks.size() != static_cast<size_t>(size))
    fail(Code::Internal, "group '", group_name, "': ", world_ranks.size(),
         " world ranks given for ", size, " members");
  auto comm = std::make_unique<GlooCommunicator>(group_name, std::move(ctx), std::move(peers), timeout,
                                                 std::move(watch_store), std::move(heartbeat),
                                                 std::move(world_ranks));
  comm->check_pairs(job_secret());
  return comm;
}

}  // namespace zs
