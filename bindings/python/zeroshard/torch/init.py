"""Partitioning modules: as they are built (Init), or afterwards."""
import functools

import torch

from . import _context
from ._context import default_device, get_context, working_dtype
from ._malloc import trim
from . import _params
from ._params import fetch_on_access, is_partitioned, partition_param, write_back
from . import generation, heal_buffers, hf_resize
from .hooks import HookEngine
from .input_cast import cast_inputs_to
from .state import arm_state_dict


def _partition_own(module, dtype, config=None, device=None):
    freed = 0  # bytes of host memory the full params held
    for name, p in module.named_parameters(recurse=False):
        # fully_shard's ignored_params stay whole and unmanaged.
        if not is_partitioned(p) and not getattr(p, "_zs_ignored", False):
            # The context is created (or checked) against where this param lives.
            ctx = get_context(config, device=device, like=p.data.device)
            # bf16.enabled / fp16.enabled: floating params in that dtype
            # unless the caller named one.
            cast = dtype if dtype is not None or not p.is_floating_point() else working_dtype(ctx)
            if p.data.device.type == "cpu":
                freed += p.numel() * p.element_size()
            partition_param(p, name=f"{type(module).__name__}.{name}", dtype=cast, ctx=ctx)
    if freed >= _TRIM_AFTER_BYTES:
        trim()
    fetch_on_access(module)
    arm_state_dict(module)


# glibc does not reuse a freed block for the next one of the same size
# when torch asks for it aligned (memalign needs the size plus the
# alignment), so each module's full params, freed once partitioned, stayed
# resident as "free but kept" heap: 12 layers of 16 MiB on 2 ranks rose
# RSS by 224 MiB where the shards are 96 (test_memory_report.py). Giving
# the free pages back after each module of 1 MiB or more keeps
# construction at the shards and one module.
_TRIM_AFTER_BYTES = 1 << 20


class Init:
    """Partition parameters as modules are constructed (the reference's
    zero.Init): when a module's constructor returns, its own params are
    registered (values from rank 0) and all but this rank's shard freed,
    so peak memory is one module, not the model.

        with zeroshard.torch.Init(config=ds_config):
            model = MyModel()

    Device: params live on the context's device. Without `device` (and
    without a "device" config key or $ZS_DEVICE) the context is created on
    the device the first params are built on: a model built on the host
    stays on the host, one built on a GPU (`with torch.device("cuda"):`,
    or `device=` arguments of its layers) stays on that GPU. With
    `device="cuda"`, params built on the host are registered from host
    memory and live on the GPU from then on.

    Dtype: with the config's bf16.enabled (fp16.enabled) floating params
    are partitioned as bf16 (fp16), as DeepSpeed casts the model; `dtype`
    names another. Constructors initialise such params in the dtype they
    built them in, rounded once.
    """

    def __init__(self, module=None, config=None, config_dict_or_path=None, remote_device=None,
                 pin_memory=False, dtype=None, enabled=True, device=None):
        # DeepSpeed's remote_device and pin_memory offload the shards; the
        # engine keeps them on the context's device, so asking is an error.
        if remote_device not in (None, "none"):
            raise NotImplementedError(f"zeroshard.torch.Init: remote_device={remote_device!r} (param offload) "
                                      "is not acted on yet: shards stay on the context's device; leave it "
                                      "unset")
        if pin_memory:
            raise NotImplementedError("zeroshard.torch.Init: pin_memory=True (pinned offload buffers) is not "
                                      "acted on yet; leave it unset")
        self.enabled = enabled
        self.dtype = dtype
        self.device = device
        self.config = config if config is not None else config_dict_or_path
        self._patched = []  # (class, its own __init__, our wrapper of it)
        self._active = False
        if module is not None and enabled:
            get_context(self.config, device=device, like=_where_built(module))
            for m in module.modules():
                _partition_own(m, dtype, self.config, device)

    def __enter__(self):
        if not self.enabled:
            return self
        hf_resize.install()  # a Hugging Face model built here can resize_token_embeddings
        # Where the model will live is known now unless torch could build it
        # on a GPU and nothing names the device: then the context is created
        # when the first params are partitioned (on their device), or on exit
        # if none were. Meanwhile get_context() uses this Init's config.
        if (_context._context is not None or self.device is not None
                or _context.device_configured(self.config) or not torch.cuda.is_available()):
            get_context(self.config, device=self.device, like=default_device())
        _context._pending.append((self.config, self.device))
        self._active = True
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
        _context._pending.pop()
        if self._orig_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._orig_init_subclass
        self._active = False
        for cls, orig, wrapped in reversed(self._patched):
            # A class decorator that replaced __init__ after we patched it
            # (transformers' use_experts_implementation, applied to a class
            # first defined inside this block) keeps its replacement, which
            # calls our wrapper: inactive now, that only calls the original.
            if cls.__dict__.get("__init__") is wrapped:
                if orig is None:
                    del cls.__init__  # inherited again
                else:
                    cls.__init__ = orig
        self._patched.clear()
        if exc[0] is None and _context._context is None:
            # Nothing was partitioned: the context still gets this config.
            get_context(self.config, device=self.device, like=default_device())
        return False

    def _patch(self, cls):
        orig = cls.__dict__.get("__init__")
        if orig is None:
            # A constructor a module class inherits from a mixin that is no
            # module (transformers' GenericForSequenceClassification, whose
            # __init__ calls post_init): wrapped on the class itself, or its
            # weights' initialisation would run after partitioning.
            owner = next((c for c in cls.__mro__ if "__init__" in c.__dict__), None)
            if owner is None or issubclass(owner, torch.nn.Module):
                return
            orig = owner.__dict__["__init__"]
        inherited = "__init__" not in cls.__dict__
        dtype, config, device = self.dtype, self.config, self.device
        init = self

        @functools.wraps(orig)
        def wrapped(module, *args, **kwargs):
            if not init._active:
                return orig(module, *args, **kwargs)
            depth = module.__dict__.get("_zs_init_depth", 0)
            module.__dict__["_zs_init_depth"] = depth + 1
            _params.constructing.append([])  # partitioned params this constructor reads
            try:
                orig(module, *args, **kwargs)
            finally:
                module.__dict__["_zs_init_depth"] = depth
                write_back(_params.constructing.pop())
            if depth == 0:  # the outermost constructor of this object
                _partition_own(module, dtype, config, device)

        cls.__init__ = wrapped
        self._patched.append((cls, None if inherited else orig, wrapped))


def _where_built(module):
    """The device of a module's first unpartitioned param; with none, where
    torch builds tensors now if the context is still to be created."""
    for p in module.parameters():
        if not is_partitioned(p):
            return p.data.device
    return default_device() if _context._context is None else None


def _all_module_classes():
    seen, todo = [], [torch.nn.Module]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def partition_module(module, dtype=None, config=None, device=None, cast_forward_inputs=True):
    """Partition a built module's params (values from rank 0) and install
    the fetch/release/gradient hooks. Returns the module. Collective.

    Without `device`, a new context is created on the device of the
    module's params (see Init); params on a GPU other than the context's
    raise RuntimeError.

    Under bf16.enabled / fp16.enabled (and `dtype` bf16/fp16) the root's
    floating inputs are cast to that dtype at each forward, as FSDP2's
    MixedPrecisionPolicy does (input_cast.py); cast_forward_inputs=False
    leaves them as they come."""
    ctx = get_context(config, device=device, like=_where_built(module))
    hf_resize.install()  # a Hugging Face model can resize_token_embeddings
    for m in module.modules():
        _partition_own(m, dtype, config, device)
    working = dtype if dtype is not None else working_dtype(ctx)
    if cast_forward_inputs and working in (torch.bfloat16, torch.float16) \
            and module.__dict__.get("_zs_fsdp") is None:  # fully_shard casts by its policy
        cast_inputs_to(module, working)
    if getattr(module, "_zs_hooks", None) is None:
        engine = HookEngine(module)
        engine.install()
        module._zs_hooks = engine
        if _context.heals(ctx):
            heal_buffers.note_root(module)  # the buffers a heal carries
    hide_partitioned_from_ddp(module)
    generation.install(module)
    return module


def hide_partitioned_from_ddp(module):
    """torch's DDP and its _sync_module_states (Lightning's validate/test
    setup) broadcast every param from C++, where a released param's values
    cannot be refused by name (its storage holds 0 bytes: the read would
    crash). The engine keeps partitioned params identical across ranks and
    reduces their gradients itself, so they are listed where DDP skips
    params (_ddp_params_and_buffers_to_ignore); buffers still sync."""
    ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    known = set(ignored)
    module._ddp_params_and_buffers_to_ignore = ignored + [
        n for n, p in module.named_parameters() if is_partitioned(p) and n not in known]
