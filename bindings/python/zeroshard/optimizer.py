"""The engine's optimizer: Optimizer and its hyperparameters."""
from ._ffi import ffi, lib
from .errors import check
from ._dlpack import dlpack_from_pointer
from ._handle import _Owned
from ._types import FLOAT32
from ._util import _address, _new_struct
from .param import Param, _param_array


_HPARAM_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, momentum=0.0,
                        dampening=0.0, nesterov=False, bias_correction=True, use_muon=None,
                        ns_method="gram", ns_steps=5)
_NS_METHODS = {"gram": 0, "standard": 1}


def _hparams(hp):
    h = _new_struct("zs_optim_hparams")
    h.lr = float(hp["lr"])
    beta1, beta2 = hp["betas"]
    h.beta1, h.beta2 = float(beta1), float(beta2)
    h.eps = float(hp["eps"])
    h.weight_decay = float(hp["weight_decay"])
    h.momentum = float(hp["momentum"])
    h.dampening = float(hp["dampening"])
    h.nesterov = 1 if hp["nesterov"] else 0
    h.bias_correction = 1 if hp["bias_correction"] else 0
    # Muon's (kind "muon"; the defaults on any other kind): use_muon None
    # means by shape (2 or more dims step Muon).
    use_muon = hp.get("use_muon")
    h.use_muon = -1 if use_muon is None else int(bool(use_muon))
    method = hp.get("ns_method", "gram")
    if method not in _NS_METHODS:
        raise ValueError(f"ns_method {method!r}: expected one of {tuple(_NS_METHODS)}")
    h.ns_method = _NS_METHODS[method]
    h.ns_steps = int(hp.get("ns_steps", 5))
    return h


class Optimizer(_Owned):
    """A sharded optimizer (AdamW, Adam, SGD or Muon with its AdamW) over
    this rank's shards."""
    _destroy_name = "zs_optimizer_destroy"

    def __init__(self, ctx, handle, kind):
        super().__init__(ctx, handle)
        self.kind = kind
        self._groups = []  # hyper-parameters per group index, as last set

    def add_group(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                  momentum=0.0, dampening=0.0, nesterov=False, bias_correction=True, use_muon=None,
                  ns_method="gram", ns_steps=5):
        """Add a parameter group with its hyper-parameters; returns its index.
        use_muon, ns_method and ns_steps are kind "muon"'s (momentum is then
        Muon's, betas and eps its AdamW's)."""
        hp = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                  momentum=momentum, dampening=dampening, nesterov=bool(nesterov),
                  bias_correction=bool(bias_correction), use_muon=use_muon, ns_method=ns_method,
                  ns_steps=int(ns_steps))
        arr, n, keep = _param_array(params)
        index = ffi.new("int*")
        check(lib.zs_optimizer_add_group(self._h, arr, n, _hparams(hp), index))
        i = int(index[0])
        while len(self._groups) <= i:
            self._groups.append(dict(_HPARAM_DEFAULTS))
        self._groups[i] = hp
        return i

    @property
    def num_groups(self):
        return len(self._groups)

    def hparams(self, group):
        """The hyper-parameters of a group as this object last set them."""
        return dict(self._groups[group])

    def set_hparams(self, group, lr=None, betas=None, eps=None, weight_decay=None,
                    momentum=None, dampening=None, nesterov=None, bias_correction=None, ns_method=None,
                    ns_steps=None):
        """Change a group's hyper-parameters (group -1: every group). Keywords
        left None keep the group's current value (use_muon is fixed when the
        group is added)."""
        given = dict(lr=lr, betas=None if betas is None else tuple(betas), eps=eps,
                     weight_decay=weight_decay, momentum=momentum, dampening=dampening,
                     nesterov=None if nesterov is None else bool(nesterov),
                     bias_correction=None if bias_correction is None else bool(bias_correction),
                     ns_method=ns_method, ns_steps=None if ns_steps is None else int(ns_steps))
        group = int(group)
        if group == -1 and self._groups:  # each group from its own values (use_muon differs)
            targets = list(range(len(self._groups)))
        else:
            targets = [group]
        for g in targets:
            base = self._groups[g] if 0 <= g < len(self._groups) else _HPARAM_DEFAULTS
            hp = {k: (base[k] if v is None else v) for k, v in given.items()}
            hp["use_muon"] = base["use_muon"]
            check(lib.zs_optimizer_set_hparams(self._h, g, _hparams(hp)))
            if g == -1:
                self._groups = [dict(hp) for _ in self._groups]
            elif 0 <= g < len(self._groups):
                self._groups[g] = hp

    def set_lr(self, group, lr):
        """Set the learning rate of a group (-1: every group)."""
        group = int(group)
        check(lib.zs_optimizer_set_lr(self._h, group, float(lr)))
        for i, hp in enumerate(self._groups):
            if group in (-1, i):
                hp["lr"] = float(lr)

    def step(self):
        """One optimizer step (collective over the world)."""
        # The gradients still lent (a step waits for their reductions) go
        # first: the last ones, an embedding's table among them, would stay
        # alive through the update, where the step peaks.
        self._ctx.release_lent(wait=True)
        r = _new_struct("zs_step_result")
        check(lib.zs_optimizer_step(self._h, r))
        self._ctx.release_lent()
        return self._result(r)

    @staticmethod
    def _result(r):
        return {"skipped": bool(r.skipped), "grad_norm": float(r.grad_norm),
                "loss_scale": float(r.loss_scale), "step": int(r.step)}

    def step_begin(self):
        """An external optimizer's step, first half (collective): gradients
        synced, unscaled and clipped in place; "skipped" says whether the
        caller must leave the masters alone this time."""
        self._ctx.release_lent(wait=True)  # as step() does
        r = _new_struct("zs_step_result")
        check(lib.zs_optimizer_step_begin(self._h, r))
        self._ctx.release_lent()
        return self._result(r)

    def step_end(self):
        """Second half: 16-bit working shards from the masters, the step
        counted, the gradients consumed."""
        r = _new_struct("zs_step_result")
        check(lib.zs_optimizer_step_end(self._h, r))
        return self._result(r)

    def named_state_dlpack(self, param, name, create=True):
        """A DLPack capsule over an external optimizer's state `name` of a
        param (shard_numel fp32 elements, zeros when made), or None when
        absent and not created. Saved by checkpoints under its name."""
        if not isinstance(param, Param):
            raise TypeError("param: expected a Param, got %s" % type(param).__name__)
        data = ffi.new("float**")
        n = ffi.new("uint64_t*")
        check(lib.zs_optimizer_named_state(self._h, param._h, str(name).encode(), 1 if create else 0, data, n))
        addr = _address(data[0])
        if not addr and not create:
            return None
        return dlpack_from_pointer(addr, (int(n[0]),), FLOAT32, (param.device_type, param.device_id), owner=self)

    @property
    def loss_scale(self):
        out = ffi.new("double*")
        check(lib.zs_optimizer_loss_scale(self._h, out))
        return float(out[0])

    @property
    def steps(self):
        out = ffi.new("int64_t*")
        check(lib.zs_optimizer_get_step(self._h, out))
        return int(out[0])

    @steps.setter
    def steps(self, value):
        check(lib.zs_optimizer_set_step(self._h, int(value)))

    def state_ptr(self, param, slot):
        """(address, numel) of this rank's fp32 shard of a param's optimizer
        state: slot 0 master, 1 exp_avg / momentum, 2 exp_avg_sq."""
        if not isinstance(param, Param):
            raise TypeError("param: expected a Param, got %s" % type(param).__name__)
        data = ffi.new("float**")
        n = ffi.new("uint64_t*")
        check(lib.zs_optimizer_state_data(self._h, param._h, int(slot), data, n))
        return _address(data[0]), int(n[0])

    def state_dlpack(self, param, slot):
        """A DLPack capsule over the fp32 state shard of state_ptr (no copy,
        on the param's device, writable); the tensor keeps this optimizer
        object alive but is valid only while it (and the param) are open."""
        addr, n = self.state_ptr(param, slot)
        return dlpack_from_pointer(addr, (n,), FLOAT32, (param.device_type, param.device_id),
                                   owner=self)

    def sync_params(self):
        """Rewrite the working (16-bit) shards from the fp32 masters."""
        check(lib.zs_optimizer_sync_params(self._h))

    def heal_state_digest(self, replica=False):
        """(hash, source rank, step) of this rank's own optimizer state, or
        with replica=True of the replica of another rank's (its source's)
        that it holds for healing (zeroshard.healing.peer_copy on): equal
        states hash equal on any two ranks (zs_heal_state_digest)."""
        h = ffi.new("uint64_t*")
        source = ffi.new("int*")
        step = ffi.new("int64_t*")
        check(lib.zs_heal_state_digest(h, source, step, self._h, 1 if replica else 0))
        return int(h[0]), int(source[0]), int(step[0])

    def heal_agree(self):
        """After a call raised RankLostError: the survivors' agreement on
        this optimizer's committed step (zs_heal_agree; every survivor
        calls it, per optimizer in the order made). Returns (C,
        rolled_forward): the steps taken on every survivor now, and whether
        this rank applied step C here. StateLostError when a lost rank's
        copy went with it."""
        committed = ffi.new("int64_t*")
        rolled = ffi.new("int*")
        check(lib.zs_heal_agree(committed, rolled, self._h))
        return int(committed[0]), bool(rolled[0])

    def heal_committed_result(self):
        """After heal_agree returned the step a loss cut short (it
        committed): that step's result as step() would have returned it
        (zs_heal_committed_result), or None when this rank has none."""
        r = _new_struct("zs_step_result")
        found = ffi.new("int*")
        check(lib.zs_heal_committed_result(r, found, self._h))
        return self._result(r) if found[0] else None

    def heal_join(self):
        """Take in the replacement of a lost rank (zs_heal_join): survivors
        after heal_agree, a replacement (ZS_HEAL_REPLACEMENT set) once its
        model and this optimizer exist. Returns C on every rank; all redo
        step C + 1 with the same batch."""
        committed = ffi.new("int64_t*")
        check(lib.zs_heal_join(committed, self._h))
        return int(committed[0])

    def heal_shrink(self):
        """Go on without the lost ranks (zs_heal_shrink): every survivor
        after heal_agree, for each optimizer in the order made; the state is
        laid out anew over the live ranks in memory. Returns C; every
        survivor takes step C + 1 next."""
        committed = ffi.new("int64_t*")
        check(lib.zs_heal_shrink(committed, self._h))
        return int(committed[0])

    def heal_set_rank_state(self, data):
        """This rank's blob (bytes) for the step this optimizer takes next,
        posted before that step can commit (zs_heal_set_rank_state); a
        replacement of this rank gets it back from heal_joined_state."""
        data = bytes(data)
        check(lib.zs_heal_set_rank_state(self._h, ffi.from_buffer(data), len(data)))

    def __repr__(self):
        return "<zeroshard.Optimizer %s, %d groups%s>" % (self.kind, len(self._groups),
                                                         " closed" if self._closed else "")
