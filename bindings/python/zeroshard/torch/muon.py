"""Muon as DeepSpeed 0.19 runs it (its config's optimizer.type "Muon"), with
its auxiliary AdamW, as one torch optimizer.

    opt = zt.Muon(zt.muon_param_groups(model), lr=0.02, momentum=0.95, weight_decay=0.1)

Groups whose "use_muon" is true step Muon: the momentum buffer moves
toward the gradient (lerp by 1 - momentum), the update is the gradient
moved toward the buffer by `momentum` (Nesterov), orthogonalized by a
Newton-Schulz iteration and scaled by sqrt(max(1, rows / cols)); the param
decays by lr * weight_decay and moves by -lr times the update. The
iteration is "gram" (on the rows x rows Gram matrix, restarted after two
steps: fewer flops when rows < cols; fp16 on a GPU, fp32 on a CPU) or
"standard" (the quintic iteration on the matrix itself, in bf16),
DeepSpeed's two methods and dtypes. The other groups step AdamW (bias
corrected, decoupled weight decay). The matrices run through torch's GEMM:
the CPU's BLAS, cuBLAS on a GPU.

Under zeroshard.torch the Muon groups step whole tensors on owner ranks
(their "whole_tensor" key) and the AdamW groups step this rank's shards
(zeroshard.torch.shard_optim).
"""
import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
_RESTART_AT = 2  # the Gram iteration starts again from the matrix after this many steps


def ns_dtype(method, device):
    """The dtype each Newton-Schulz method iterates in on `device`:
    DeepSpeed's choice (fp16 for "gram" where the device runs fp16 matrix
    products well, a GPU; else fp32; bf16 for "standard")."""
    if method == "gram":
        return torch.float16 if torch.device(device).type == "cuda" else torch.float32
    return torch.bfloat16


def orthogonalize(g, steps=5, method="gram"):
    """The Newton-Schulz approximation of the orthogonal factor of the
    2-D matrix g (U V^T of its SVD, singular values pushed toward 1)."""
    if method not in NS_METHODS:
        raise ValueError(f"Muon ns_method {method!r}: expected one of {NS_METHODS}")
    a, b, c = NS_COEFFICIENTS
    tall = g.size(0) > g.size(1)
    dtype = ns_dtype(method, g.device)
    if method == "gram":
        # Normalised before the cast to fp16, whose range a large gradient
        # could leave.
        x = g.float().mT if tall else g.float()
        x = (x / (x.norm() + 1e-7)).to(dtype)
    else:
        x = g.to(dtype).mT if tall else g.to(dtype)
        x = x / (x.norm() + 1e-7)
    rows, cols = x.shape
    if method == "standard" or cols <= rows:
        for _ in range(steps):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.mT if tall else x
    # Every step multiplies x on the left by p(R) = aI + bR + cR^2 of its
    # Gram matrix R = x x^T: track R and the product Q of those factors
    # (rows x rows), and apply Q to x only at the restart and the end.
    r = x @ x.mT
    q = None
    for i in range(steps):
        if i == _RESTART_AT:
            x = q @ x
            r = x @ x.mT
            q = None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal().add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != _RESTART_AT:
            rz = a * r + z @ r  # R' = p(R) R p(R), p(R) = aI + z
            r = a * rz + z @ rz
    x = q @ x
    return x.mT if tall else x


def muon_param_groups(model, **group_settings):
    """The model's trainable params in two groups, tagged as DeepSpeed tags
    them for its Muon: matrices (2 or more dims) whose name has neither
    "embed" nor "lm_head" step Muon, the rest AdamW. group_settings (lr,
    weight_decay, ...) go into both."""
    muon, adam = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden = p.dim() >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))
        (muon if hidden else adam).append(p)
    groups = [dict(group_settings, params=muon, use_muon=True), dict(group_settings, params=adam, use_muon=False)]
    return [g for g in groups if g["params"]]


class Muon(torch.optim.Optimizer):
    """DeepSpeed 0.19's Muon with its auxiliary AdamW (see the module
    docstring), with DeepSpeed's defaults: Muon lr 0.02, momentum 0.95,
    ns_method "gram"; AdamW lr 3e-4, betas (0.9, 0.95), eps 1e-10. `lr`
    sets both halves' rate, muon_lr / adam_lr one half's (DeepSpeed's
    config keys); a group's own "lr" wins. Param groups carry "use_muon";
    a plain list of params is split by shape (2 or more dims: Muon)."""

    def __init__(self, params, lr=None, momentum=0.95, weight_decay=0.0, ns_method="gram", ns_steps=5,
                 betas=(0.9, 0.95), eps=1e-10, muon_lr=None, adam_lr=None):
        if ns_method not in NS_METHODS:
            raise ValueError(f"Muon ns_method {ns_method!r}: expected one of {NS_METHODS}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum {momentum}: expected in [0, 1)")
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = [{"params": [p for p in params if p.dim() >= 2], "use_muon": True},
                      {"params": [p for p in params if p.dim() < 2], "use_muon": False}]
            params = [g for g in params if g["params"]]
        for g in params:
            if "use_muon" not in g:
                raise ValueError("Muon: every param group needs \"use_muon\" (True: Muon, False: AdamW); "
                                 "zeroshard.torch.muon_param_groups(model) tags them as DeepSpeed does")
            if g["use_muon"] and any(p.dim() < 2 for p in g["params"]):
                raise ValueError("Muon: a use_muon group holds a param of fewer than 2 dims")
            # Muon groups step whole matrices; AdamW groups are elementwise.
            g.setdefault("whole_tensor", bool(g["use_muon"]))
            if "lr" not in g:
                half = muon_lr if g["use_muon"] else adam_lr
                g["lr"] = half if half is not None else lr if lr is not None else 0.02 if g["use_muon"] else 3e-4
        defaults = dict(momentum=momentum, weight_decay=weight_decay, ns_method=ns_method,
                        ns_steps=ns_steps, betas=tuple(betas), eps=eps)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon(p, group)
                else:
                    self._adamw(p, group)
        return loss

    def _muon(self, p, group):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, grad = state["momentum_buffer"], p.grad
        buf.lerp_(grad, 1 - group["momentum"])
        update = grad.lerp(buf, group["momentum"])
        matrix = update.reshape(update.size(0), -1)
        rows, cols = matrix.shape
        ortho = orthogonalize(matrix, group["ns_steps"], group["ns_method"])
        if rows > cols:
            ortho = ortho * math.sqrt(rows / cols)  # every row's update at the scale of a square one's
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(ortho.to(p.dtype).reshape(p.shape), alpha=-group["lr"])

    def _adamw(self, p, group):
        state = self.state[p]
        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        grad = p.grad
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].lerp_(grad.square(), 1 - beta2)
        m = state["exp_avg"] / (1 - beta1 ** state["step"])
        v = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(m / (v.sqrt() + group["eps"]), alpha=-group["lr"])
