// Fencing a rank taken for lost while its process lives (docs/healing.md,
// section 2): a stopped or starved process whose peers healed around it
// must never come back into the run. Each rank posts what identifies its
// process; a survivor on the same host kills it by that identity, which a
// recycled pid or another host's process never matches.
#pragma once

#include <string>

namespace zs {

// This process, as a line of text: the kernel's boot id, the pid
// namespace, the pid and the process's start time (in clock ticks since
// boot), which together name one process on one machine for good.
std::string process_identity();

// Kills (SIGKILL) the process `identity` names when it runs on this
// machine, in this pid namespace, and has not exited. Returns what was done
// as a sentence fragment ("killed pid 123 (it was stopped)", "could not
// kill pid 123: ..."), or "" where there was nothing to do: the process
// has exited, is not this machine's, or the identity is not one.
std::string fence_process(const std::string& identity);

}  // namespace zs
