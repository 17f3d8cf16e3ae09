// A rank whose launcher died ends. zsrun's ranks get a parent-death signal
// (tools/zsrun.cpp); ranks of another launcher whose process is killed
// (torchrun's agent under kill -9) are orphaned, and would train on into
// the checkpoint directory the next job uses. For them, once per process,
// a thread notes the parent process at the first context and polls
// getppid(): a change means the parent exited, and the rank says so on
// stderr and kills itself (SIGKILL: a handler of its own, such as
// Lightning's SIGTERM one, could keep it alive).
//
// Watched when a launcher started the process (TORCHELASTIC_RUN_ID:
// torchrun; ZS_LAUNCHER: zsrun, for a rank under a wrapper shell) or when
// ZS_WATCH_LAUNCHER=1; ZS_WATCH_LAUNCHER=0 turns it off. A process whose
// parent is already init is not watched.
#pragma once

namespace zs {

void watch_launcher();

}  // namespace zs
