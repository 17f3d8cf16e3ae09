// Who saves into a checkpoint directory: the first save of a job takes a
// lock file in it (dir/.zeroshard.lock) that names the holder (host, pid,
// world size, since when), so a second live job saving into the same
// directory is refused with the holder's name instead of the two jobs
// interleaving tags and `latest`. A lock whose holder is gone (its pid is
// dead on this host, the host rebooted, or it stopped refreshing the file
// for ZS_CHECKPOINT_LOCK_STALE_S seconds, 120 by default) is taken over
// with a message on stderr. Rank 0 holds the lock, refreshes it every few
// seconds and removes it when the context goes.
#pragma once

#include <string>

#include "impl/core/context.h"

namespace zs::ckpt {

inline constexpr const char* kLockFile = ".zeroshard.lock";

// Takes (or confirms this process holds) the lock of `dir`, which exists.
// Throws Code::InvalidArgument naming the live holder otherwise. Called by
// the rank that commits saves (rank 0) before it writes anything.
void hold_checkpoint_dir(Context& ctx, const std::string& dir);

// Gives up this context's lock of `dir` (the file removed where it is
// still ours): a save that made `dir` and failed leaves nothing behind.
void release_checkpoint_dir(Context& ctx, const std::string& dir);

}  // namespace zs::ckpt
