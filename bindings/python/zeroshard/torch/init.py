"""Partitioning modules: as they are built (Init), or afterwards."""
import functools

import torch

from ._context import get_context
from ._params import is_partitioned, partition_param
from .hooks import HookEngine


def _partition_own(module, dtype):
    for name, p in module.named_parameters(recurse=False):
        if not is_partitioned(p):
            partition_param(p, name=f"{type(module).__name__}.{name}", dtype=dtype)


class Init:
    """Partition parameters as modules are constructed (the reference's
    zero.Init): when a module's constructor returns, its own params are
    registered (values from rank 0) and all but this rank's shard freed,
    so peak memory is one module, not the model.

        with zeroshard.torch.Init(config=ds_config):
            model = MyModel()
    """

    def __init__(self, module=None, config=None, config_dict_or_path=None, remote_device=None,
                 pin_memory=False, dtype=None, enabled=True):
        if remote_device not in (None, "cpu"):
            raise NotImplementedError(f"zeroshard.torch.Init: remote_device={remote_device!r} is not "
                                      "supported yet (the engine keeps shards in host memory)")
        self.enabled = enabled
        self.dtype = dtype
        self.config = config if config is not None else config_dict_or_path
        self._patched = []
        if module is not None and enabled:
            get_context(self.config)
            for m in module.modules():
                _partition_own(m, dtype)

    def __enter__(self):
        if not self.enabled:
            return self
        get_context(self.config)
        for cls in _all_module_classes():
            self._patch(cls)
        self._orig_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        init = self

        # Classes defined inside the context are wrapped as they appear.
        @classmethod
        def init_subclass(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            init._patch(cls)

        torch.nn.Module.__init_subclass__ = init_subclass
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        if self._orig_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._orig_init_subclass
        for cls, orig in reversed(self._patched):
            cls.__init__ = orig
        self._patched.clear()
        return False

    def _patch(self, cls):
        if "__init__" not in cls.__dict__:
            return
        orig = cls.__dict__["__init__"]
        dtype = self.dtype

        @functools.wraps(orig)
        def wrapped(module, *args, **kwargs):
            depth = module.__dict__.get("_zs_init_depth", 0)
            module.__dict__["_zs_init_depth"] = depth + 1
            try:
                orig(module, *args, **kwargs)
            finally:
                module.__dict__["_zs_init_depth"] = depth
            if depth == 0:  # the outermost constructor of this object
                _partition_own(module, dtype)

        cls.__init__ = wrapped
        self._patched.append((cls, orig))


def _all_module_classes():
    seen, todo = [], [torch.nn.Module]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def partition_module(module, dtype=None, config=None):
    """Partition a built module's params (values from rank 0) and install
    the fetch/release/gradient hooks. Returns the module. Collective."""
    get_context(config)
    for m in module.modules():
        _partition_own(m, dtype)
    if getattr(module, "_zs_hooks", None) is None:
        engine = HookEngine(module)
        engine.install()
        module._zs_hooks = engine
    return module
