#include "impl/comm/group.h"

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
  submit(what, std::move(fn))->wait(-1);
}

void Group::loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      if (broken_code_ != Code::Ok) {
        task.work->complete(broken_code_, broken_message_);
        continue;
      }
    }
    Code code = Code::Ok;
    std::string message;
    try {
      task.fn(*comm_);
    } catch (const Error& e) {
      code = e.code();
      message = task.work->what() + ": " + e.what();
    } catch (const std::bad_alloc&) {
      code = Code::OutOfMemory;
      message = task.work->what() + ": out of memory";
    } catch (const std::exception& e) {
      code = Code::Internal;
      message = task.work->what() + ": " + e.what();
    }
    if (code != Code::Ok) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        broken_code_ = code;
        broken_message_ = message + " (group '" + name_ + "' is unusable after this error)";
      }
      if (on_error_) on_error_(code, message);
    }
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
  comm_.reset();
}

}  // namespace zs
