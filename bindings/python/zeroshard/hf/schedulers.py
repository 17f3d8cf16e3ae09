"""DeepSpeed's learning-rate schedulers, for a config's "scheduler" section:
WarmupLR and WarmupDecayLR on any torch optimizer, step for step as
DeepSpeed's (deepspeed/runtime/lr_schedules.py)."""
import math


class WarmupLR:
    """DeepSpeed's WarmupLR on a torch optimizer, step for step: from
    warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear),
    then warmup_max_lr. The first optimizer step runs at warmup_min_lr, as
    under DeepSpeed."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"zeroshard.hf: scheduler.params.warmup_num_steps must be a positive integer, "
                             f"got {warmup_num_steps!r}")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"zeroshard.hf: scheduler.params.warmup_type {warmup_type!r}: expected 'log' or "
                             "'linear'")
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.min_lrs = self._per_group(warmup_min_lr, len(groups))
        self.max_lrs = self._per_group(warmup_max_lr, len(groups))
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    @staticmethod
    def _per_group(value, n):
        return list(value) if isinstance(value, (list, tuple)) else [value] * n

    def _gamma(self):
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(it + 1) / math.log(self.warmup_num_steps)
            return it / self.warmup_num_steps
        return 1.0

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def _apply(self):
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        return lrs

    def step(self, last_batch_iteration=None):
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._last_lr = self._apply()

    def get_last_lr(self):
        return self._last_lr

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        self.last_batch_iteration = state["last_batch_iteration"]
        self._last_lr = self._apply()


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR, then linear decay to 0 at
    total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - self.last_batch_iteration)
                   / max(1.0, self.total_num_steps - self.warmup_num_steps))


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}
