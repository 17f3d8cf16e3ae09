#include "impl/comm/group.h"

#include "impl/comm/transport/collective_label.h"
#include "impl/common/no_sigpipe.h"

namespace zs {

Group::Group(std::string name, std::vector<int> world_ranks, int my_rank,
             std::unique_ptr<Communicator> comm, ErrorSink on_error)
    : name_(std::move(name)),
      world_ranks_(std::move(world_ranks)),
      rank_(my_rank),
      comm_(std::move(comm)),
      on_error_(std::move(on_error)) {
  if (member()) {
    SigpipeBlockedScope no_sigpipe;
    thread_ = std::thread([this] { loop(); });
  }
}

Group::~Group() { shutdown("the group was destroyed"); }

int Group::world_rank(int group_rank) const {
  if (group_rank < 0 || group_rank >= size())
    fail(Code::InvalidArgument, "group rank ", group_rank, " is out of range for group '", name_,
         "' of size ", size());
  return world_ranks_[static_cast<size_t>(group_rank)];
}

std::shared_ptr<Work> Group::submit(const std::string& what,
                                    std::function<void(Communicator&)> fn) {
  if (!member())
    fail(Code::InvalidArgument, what, ": this rank is not a member of group '", name_, "'");
  auto work = std::make_shared<Work>(what + " on group '" + name_ + "'");
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_code_ != Code::Ok) throw Error(broken_code_, broken_message_);
  if (stopping_) fail(Code::InvalidState, what, ": group '", name_, "' is shut down");
  queue_.push_back(Task{work, std::move(fn)});
  cv_.notify_one();
  return work;
}

void Group::run(const std::string& what, std::function<void(Communicator&)> fn) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    const bool inline_ok = member() && !stopping_ && broken_code_ == Code::Ok && queue_.empty() &&
                           !busy_ && comm_->runs_on_any_thread();
    if (inline_ok) {
      busy_ = true;  // the group's thread takes nothing until we are done
      lock.unlock();
      auto [code, message] = execute(what + " on group '" + name_ + "'", fn);
      lock.lock();
      busy_ = false;
      cv_.notify_all();
      if (code != Code::Ok) throw Error(code, message);
      return;
    }
  }
  submit(what, std::move(fn))->wait(-1);
}

std::pair<Code, std::string> Group::execute(const std::string& what,
                                            const std::function<void(Communicator&)>& fn) {
  Code code = Code::Ok;
  std::string message;
  {
    // Gloo writes without MSG_NOSIGNAL: a dead peer's SIGPIPE must become
    // EPIPE here too, as on the group's thread (started with it blocked).
    SigpipeBlockedScope no_sigpipe;
    const CollectiveLabelScope label(what);
    try {
      fn(*comm_);
    } catch (const Error& e) {
      code = e.code();
      message = what + ": " + e.what();
    } catch (const std::bad_alloc&) {
      code = Code::OutOfMemory;
      message = what + ": out of memory";
    } catch (const std::exception& e) {
      code = Code::Internal;
      message = what + ": " + e.what();
    }
    no_sigpipe.drain();  // a SIGPIPE raised meanwhile is not delivered on unblocking
  }
  if (code != Code::Ok) {
    Code aborted;
    std::string why;
    {
      std::lock_guard<std::mutex> lock(mu_);
      aborted = aborted_code_;
      why = aborted_why_;
    }
    // Whoever aborted the group recorded why; the collective may have
    // failed on its own first (a pair the dead rank closed).
    if (aborted != Code::Ok) {
      code = aborted;
      if (message.find(why) == std::string::npos) message += "; " + why;
    } else if (on_error_) {
      message += on_error_(code, message);
    }
    std::lock_guard<std::mutex> lock(mu_);
    broken_code_ = code;
    broken_message_ = message + " (group '" + name_ + "' is unusable after this error)";
  }
  return {code, std::move(message)};
}

void Group::loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || (!queue_.empty() && !busy_); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      if (broken_code_ != Code::Ok) {
        task.fn = nullptr;
        task.work->complete(broken_code_, broken_message_);
        continue;
      }
      busy_ = true;
    }
    auto [code, message] = execute(task.work->what(), task.fn);
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    // What the task holds (a reduce bucket it sent, buffers it filled) goes
    // before the work says it is done: a waiter that then reads the memory
    // report, or frees what it counts on, sees those bytes given back.
    task.fn = nullptr;
    task.work->complete(code, std::move(message));
  }
}

void Group::shutdown(const std::string& why) {
  std::deque<Task> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    dropped.swap(queue_);
  }
  cv_.notify_all();
  for (auto& t : dropped)
    t.work->complete(Code::InvalidState, t.work->what() + " was cancelled: " + why);
  if (thread_.joinable()) thread_.join();
  std::unique_ptr<Communicator> gone;
  {
    // A collective running inline on another thread still uses comm_; an
    // abort may be calling into it (under mu_).
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
    gone = std::move(comm_);
  }
}

void Group::reconnect(std::unique_ptr<Communicator> comm) {
  if (!member() || !comm) fail(Code::Internal, "group '", name_, "': reconnect of a non-member or without a communicator");
  std::unique_ptr<Communicator> gone;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) fail(Code::InvalidState, "group '", name_, "' is shut down: it cannot reconnect");
    cv_.wait(lock, [&] { return !busy_ && queue_.empty(); });
    gone = std::move(comm_);
    comm_ = std::move(comm);
    broken_code_ = aborted_code_ = Code::Ok;
    broken_message_.clear();
    aborted_why_.clear();
  }
}

void Group::reconnect(std::vector<int> world_ranks, int my_rank, std::unique_ptr<Communicator> comm) {
  const int n = static_cast<int>(world_ranks.size());
  if (my_rank < 0 || my_rank >= n || !comm || comm->size() != n)
    fail(Code::Internal, "group '", name_, "': reconnect over ", world_ranks.size(), " members at ", my_rank);
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_ && queue_.empty(); });
    world_ranks_ = std::move(world_ranks);
    rank_ = my_rank;
  }
  reconnect(std::move(comm));
}

void Group::abort(Code code, const std::string& why) {
  std::deque<Task> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!comm_) return;  // not a member, or shut down
    if (aborted_code_ == Code::Ok) {
      aborted_code_ = code;
      aborted_why_ = why;
    }
    if (broken_code_ == Code::Ok) {
      broken_code_ = code;
      broken_message_ = why + " (group '" + name_ + "' is unusable after this error)";
    }
    dropped.swap(queue_);
    comm_->abort(why);
  }
  for (auto& t : dropped) t.work->complete(code, t.work->what() + " was abandoned: " + why);
}

}  // namespace zs
