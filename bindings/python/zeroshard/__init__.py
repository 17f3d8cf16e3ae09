"""zeroshard: a ZeRO-3 engine (C++ behind a C ABI), bound with cffi in ABI mode.

    import zeroshard as zs
    with zs.Context(config={"bf16": {"enabled": True}}, device="cuda:0") as ctx:
        w = ctx.register("w", "bf16", (4096, 4096), init="normal", seed=0, b=0.02)
        with ctx.fetch([w]) as g:
            g.wait()
            t = torch.utils.dlpack.from_dlpack(w.to_dlpack())
        ctx.release([w])

A context lives on one device ("cpu" or "cuda:N"; by default a GPU when the
machine has one); DLPack tensors of its params are on that device, without
a copy. ``zeroshard.cuda_device_count()`` says whether CUDA can be used and,
if not, why.

The shared library is loaded from $ZEROSHARD_LIBRARY, else from next to this
package, else from the loader's search path (see zeroshard._ffi).
"""
from ._ffi import ffi, lib, library_path
from . import errors
from .errors import (ZeroShardError, InvalidArgumentError, InvalidHandleError,
                     InvalidStateError, InvalidConfigError, ZsOutOfMemoryError, ZsTimeoutError,
                     CommError, BootstrapError, NotSupportedError, BufferSizeError,
                     InternalError, ZsIOError, RankLostError, StateLostError,
                     NotTakenError, ZeroShardConfigWarning, check)
from .core import (FLOAT32, BFLOAT16, FLOAT16, UINT8, WAIT_FOREVER, DTYPE_NAMES, DEVICE_CPU,
                   DEVICE_CUDA, version, config_check, dtype_code, dtype_size, cuda_device_count,
                   device_string, parse_device, dlpack_from_pointer, Context, Group, Param,
                   Gather, Work, Optimizer, ParamArray, GradBatch, checkpoint_verify, checkpoint_export,
                   checkpoint_reshard)

__version__ = "0.1.0"

__all__ = [
    "ffi", "lib", "library_path", "errors", "check",
    "ZeroShardError", "InvalidArgumentError", "InvalidHandleError", "InvalidStateError",
    "InvalidConfigError", "ZsOutOfMemoryError", "ZsTimeoutError", "CommError",
    "BootstrapError", "NotSupportedError", "BufferSizeError", "InternalError", "ZsIOError",
    "RankLostError", "StateLostError", "NotTakenError", "ZeroShardConfigWarning",
    "FLOAT32", "BFLOAT16", "FLOAT16", "UINT8", "WAIT_FOREVER", "DTYPE_NAMES",
    "DEVICE_CPU", "DEVICE_CUDA",
    "checkpoint_verify", "checkpoint_export", "checkpoint_reshard",
    "version", "config_check", "dtype_code", "dtype_size", "cuda_device_count", "device_string",
    "parse_device", "dlpack_from_pointer",
    "Context", "Group", "Param", "Gather", "Work", "Optimizer", "ParamArray", "GradBatch",
]
