// Kill points for the healing tests (docs/healing.md, section 6): with
// ZS_FAULT_POINT=name:rank:count[,name:rank:count...], the process of that
// rank SIGKILLs itself at the count-th pass (1-based) of fault_point(name).
// Names: "fetch" (a param gather's collective), "reduce_scatter" (a
// gradient bucket's), "grad_copy" (the peer copy's send), "norm_allreduce"
// (just before the step's norm all-reduce: this rank contributes nothing),
// "norm_allreduce_done" (just after it returned here), "update" (the
// optimizer's update, before any shard changes), "replay" (a holder's
// replay of its source's step on the replica, on the peer copy's worker
// thread, once this rank's own step committed), "save" (a checkpoint
// save's rank file written, before rank 0 hears of it), "join" (a
// survivor's zs_heal_join, regrouped, before the lost ranks' state is
// handed over; a replacement's join passes none), "regrow" (a regrow's
// joiner, in zs_heal_join, before it describes its build, while the
// survivors wait for it), "grow_wait" (a regrow's joiner at its create, at
// each poll for the survivors' answer, its request posted), "grow_arrive"
// (a regrow's joiner, its answer read, before it posts its heartbeat
// address and claims its arrival).
// With ":fail" after the
// count, that pass throws Code::Comm instead (on "norm_allreduce_done": an
// all-reduce that completed on the others but failed here, which a real
// loss produces only by chance). With ":stop", the process stops itself
// (SIGSTOP) instead, as one hung or starved past the heartbeat's limit
// would: its peers take it for lost and fence it. Unset: one atomic load per pass. A fault
// is one failure of the job: in a job zsrun restarted whole
// (TORCHELASTIC_RESTART_COUNT > 0) none is armed, so the restart runs
// clean (a replacement of a lost rank is still in the first attempt).
#pragma once

namespace zs {

// Reads ZS_FAULT_POINT for this process's rank (Context::create calls it);
// throws Code::InvalidArgument on a malformed value.
void configure_fault_points(int rank);
void fault_point(const char* name);

}  // namespace zs
