// An asynchronous save's background half (zs_checkpoint_save with
// async_save): after every rank staged its shards in host memory, the rank
// file's write, the ranks' agreement and rank 0's commit run on a thread of
// their own while training goes on. One at a time per context: the next
// save, a load, an export, zs_checkpoint_wait and the context's end wait for
// it, and its error surfaces there, naming the checkpoint.
#pragma once

#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "impl/core/context.h"

namespace zs::ckpt {

class PendingSave : public Context::Attachment {
 public:
  explicit PendingSave(Context&) {}
  // Waits; an error nobody collected is printed on stderr (a destructor
  // cannot raise it).
  ~PendingSave() override;
  // Runs work on the background thread; `what` names the checkpoint in
  // its error. The caller waited for the previous one.
  void start(std::string what, std::function<void()> work);
  // Waits for the save in flight, if any; rethrows its error as
  // "asynchronous checkpoint save of '<what>' failed: ...".
  void wait();

 private:
  std::mutex mu_;  // one waiter at a time
  std::thread thread_;
  std::exception_ptr error_;
  std::string what_;
};

// Waits for ctx's save in flight (no-op if it never saved asynchronously).
void wait_for_pending_save(Context& ctx);

}  // namespace zs::ckpt
