"""Where autograd is now, as the hooks need to know it."""
import torch


def in_backward():
    """Whether this thread is running a backward's graph task now: a
    forward called from it is activation checkpointing's recompute, not a
    forward of the trainer's."""
    return torch._C._current_graph_task_id() != -1
