"""Frozen calls: when a unit with no trainable param is done with its
backward.

A unit with no trainable param (a LoRA adapter's frozen base) whose
output needs a gradient has no gradient of its own to say when its
backward is done: its inputs' gradients do (_FrozenCall), else the end of
the backward; before, it stayed gathered until the optimizer step. The
unit's post-forward hook makes the call (gather_unit.py); the HookEngine
keeps the calls whose backward runs and releases the unit's fetch
(hooks.py: open_frozen_call, release_frozen).
"""
import torch


def _gradient_node(t):
    """The autograd node that takes t's gradient (AccumulateGrad for a
    leaf), or None."""
    edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    if edge is not None:
        return edge(t).node
    return t.grad_fn


class _FrozenCall:
    """One forward of a unit none of whose params needs a gradient (the
    frozen base of a LoRA adapter, a frozen encoder) while its output does.
    No gradient of its own tells when its backward is done, so what does:
    the gradients of the forward's inputs (positional and keyword) that
    need one. Their nodes run only once every op between them and the
    output has, the ones that read the gathered params included. The
    backward fetch is released when every such input of every forward of
    the unit whose backward began has its gradient (a unit called twice
    stays gathered while either call's backward runs), or, when that never
    comes (no input needs a gradient: a frozen module whose output needs
    one through a trainable child; torch.autograd.grad(inputs=...) stopping
    short), when the backward ends. A call begins at its outputs' first
    gradient, so a forward whose graph is never differentiated (the re-run
    of non-reentrant checkpointing, whose recomputed outputs only feed
    saved tensors) holds nothing; reentrant checkpointing's re-run is
    differentiated by a backward of its own (its inputs: detached leaves),
    whose end is then the fallback.

    A release that comes too early (an op reading the params that is on
    no path from an input, run after the inputs' nodes) costs a gather,
    not a wrong gradient: a saved param not gathered is gathered for its
    read (saved.py). The call keeps the input's gradient node, not the
    input (a leaf's AccumulateGrad does hold the leaf): a frozen Linear
    saves no input, and keeping it would keep the activation."""

    __slots__ = ("unit", "nodes", "left", "handles")

    def __init__(self, unit, inputs):
        self.unit = unit
        self.nodes = []
        for t in inputs:
            node = _gradient_node(t)
            if node is not None and all(node is not n for n in self.nodes):
                self.nodes.append(node)
        self.left = 0
        self.handles = None  # while its backward runs

    def backward_begins(self, grad):
        """A gradient hook on the forward's outputs."""
        if self.handles is not None:
            return
        unit = self.unit
        engine = unit.engine
        engine.fetch_for_backward(unit)
        unit.open_calls += 1
        engine.open_frozen_call(self)
        self.left = len(self.nodes)
        self.handles = [node.register_prehook(self._input_grad) for node in self.nodes]

    def _input_grad(self, grad_outputs):
        self.left -= 1
        if self.left == 0 and self.handles is not None:
            self.end()
            self.unit.engine.release_frozen(self.unit)

    def end(self):
        """This call's backward is done (or the backward ended)."""
        if self.handles is not None:
            for h in self.handles:
                h.remove()
            self.handles = None
            self.unit.open_calls -= 1
            self.unit.engine.frozen_calls.discard(self)
