"""GatheredParameters: the full params inside a `with` block."""
from ._context import get_context
from ._params import attach_views, detach_views, is_partitioned, zparams


class GatheredParameters:
    """Gather `params` for the block. With modifier_rank set, what that rank
    changed in them is broadcast to every rank and re-partitioned on exit;
    with None, changes are discarded. Collective.

        with GatheredParameters(model.fc.weight, modifier_rank=0):
            if rank == 0:
                model.fc.weight.fill_(1.0)
    """

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if not isinstance(params, (list, tuple)):
            params = [params]
        self.params = [p for p in params if is_partitioned(p)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)
        self._fetched = []

    def __enter__(self):
        if not self.enabled:
            return self
        ctx = get_context()
        status = [p.zs.zparam.status for p in self.params]
        self._fetched = [p for p, s in zip(self.params, status) if s == "NOT_AVAILABLE"]
        if self._fetched:
            with ctx.fetch(zparams(self._fetched)) as g:
                g.wait()
        # Persistent params the coordinator is gathering again after an
        # optimizer step: wait for that gather (they stay the coordinator's).
        inflight = [p for p, s in zip(self.params, status) if s == "INFLIGHT"]
        if inflight:
            ctx.coord_fetch(zparams(inflight))
        attach_views(self.params)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        ctx = get_context()
        if self.modifier_rank is not None and exc[0] is None:
            ctx.update(zparams(self.params), self.modifier_rank)
        if self._fetched:
            ctx.release(zparams(self._fetched))
            detach_views(self._fetched)
        return False
