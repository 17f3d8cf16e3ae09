// A group of ranks and the thread that runs its collectives. Operations
// are queued and run strictly in submission order, which is what makes
// collectives issued in the same order on every member match up. After a
// failure the group is broken: its communicator may be mid-message, so
// later operations fail at once with the original error instead of hanging.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "impl/comm/algo/communicator.h"
#include "impl/comm/work.h"

namespace zs {

class Group {
 public:
  // Told of a failed collective; returns a note appended to its message
  // (e.g. which rank is gone), or "", and may change its code (a healing
  // context's Comm becomes RankLost once the heartbeat names the rank).
  using ErrorSink = std::function<std::string(Code&, const std::string&)>;

  // world_ranks lists the members; my_rank is this rank's index in it, or
  // -1 for a non-member (then comm is null and collectives are refused).
  Group(std::string name, std::vector<int> world_ranks, int my_rank,
        std::unique_ptr<Communicator> comm, ErrorSink on_error);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(world_ranks_.size()); }
  bool member() const { return rank_ >= 0; }
  int world_rank(int group_rank) const;
  const std::vector<int>& world_ranks() const { return world_ranks_; }

  // Queue fn to run on the group's thread; the returned work completes when
  // fn returns or throws.
  std::shared_ptr<Work> submit(const std::string& what, std::function<void(Communicator&)> fn);
  // submit + wait forever (the communicator's own timeout bounds it). When
  // nothing is queued or running and the communicator allows it, fn runs
  // on the caller's thread instead: no hand-off to the group's thread and
  // back, which on a busy machine costs more than a small collective
  // itself. Work submitted meanwhile waits behind it, so order holds.
  void run(const std::string& what, std::function<void(Communicator&)> fn);

  // Fail everything queued and stop the thread; later submits fail.
  void shutdown(const std::string& why);

  // From any thread (healing: a rank was lost): the collective in flight
  // ends within milliseconds (Communicator::abort), what is queued and
  // every later submit fail with `code` and `why`. The group stays broken.
  void abort(Code code, const std::string& why);

  // Healing (docs/healing.md, section 3): after abort, the group's members
  // meet again in a new generation of the rendezvous; `comm` (connected
  // there, to the same members) replaces the broken communicator and the
  // group works again, the same object, so whatever holds it (params, the
  // reducer's buckets, the peer copy) needs no rebinding. Nothing may be
  // queued or running (the abort emptied the queue).
  void reconnect(std::unique_ptr<Communicator> comm);
  // A shrink (docs/healing.md, section 4): as reconnect, over fewer
  // members (`world_ranks`, this rank at `my_rank` among them), `comm`
  // connected to them. The same object, so its holders keep it; what they
  // laid out by its size (params' shards) is theirs to lay out again.
  void reconnect(std::vector<int> world_ranks, int my_rank, std::unique_ptr<Communicator> comm);

  // Numbers the params registered on the group 1, 2, ... Members register
  // the same params in the same order (zs_param_register), so the n-th is
  // the same param on every member: what tells apart, in collective labels,
  // params of the same name and shape (every expert's "Linear.weight").
  uint64_t next_param_ordinal() { return ++params_registered_; }

 private:
  struct Task {
    std::shared_ptr<Work> work;
    std::function<void(Communicator&)> fn;
  };
  void loop();
  // Runs fn on this thread; a failure breaks the group (as on its thread)
  // and is returned as (code, message).
  std::pair<Code, std::string> execute(const std::string& what,
                                       const std::function<void(Communicator&)>& fn);

  const std::string name_;
  // Changed only by a shrink's reconnect, while nothing is queued or runs.
  std::vector<int> world_ranks_;
  int rank_;
  std::unique_ptr<Communicator> comm_;
  ErrorSink on_error_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  bool busy_ = false;  // a task runs now (on the group's thread or inline)
  Code broken_code_ = Code::Ok;
  Code aborted_code_ = Code::Ok;  // abort()'s: a collective it ended fails with it
  std::string aborted_why_;
  std::string broken_message_;
  std::thread thread_;
  std::atomic<uint64_t> params_registered_{0};
};

}  // namespace zs
