"""Pythonic objects over the C API: Context, Group, Param, Gather, Work, Optimizer.

Every object owns one engine handle and keeps a reference to its Context, so
the context outlives its objects in Python. Handles are freed by close(), by
leaving a ``with`` block, or when the object is garbage collected. After
Context.close() the engine has freed every handle of the context: calls on
its objects then raise InvalidHandleError (from the engine), while close()
on them is a no-op.

Buffers: wherever the engine reads or writes caller memory, pass any
buffer-protocol object (bytes, bytearray, memoryview, numpy array; writable
where the engine writes), a CPU or CUDA torch tensor (contiguous), or a tuple
``(address, nbytes)`` for raw memory such as ``tensor.data_ptr()``. The
engine tells host from CUDA memory itself.

Devices: a context lives on one device ("cpu" or "cuda:N", see
``Context(device=...)``); the memory the engine hands out (full params,
shards, gradient and optimizer shards) is that device's. ``Param.to_dlpack``
and ``dlpack_from_pointer`` give zero-copy DLPack tensors of it.

This module re-exports the binding's objects from the modules that hold them
(context, group, param, optimizer, work, checkpoint, config, _types, _dlpack,
_util, _handle); it is kept so that ``zeroshard.core`` names stay importable.
"""
import ctypes  # noqa: F401  (zeroshard.core.ctypes, used by tests)

from ._ffi import ffi, lib  # noqa: F401
from . import errors  # noqa: F401
from .errors import check  # noqa: F401
from ._types import (BFLOAT16, DEVICE_CPU, DEVICE_CUDA, DTYPE_NAMES, FLOAT16, FLOAT32, UINT8,
                     WAIT_FOREVER, _DTYPE_BY_NAME, _DTYPE_SIZE, _GROUP_BY_NAME, _INIT_BY_NAME,
                     _OPTIM_BY_NAME, _OP_BY_NAME, _PARAM_STATUS, _code, _device_option,
                     cuda_device_count, device_string, dtype_code, dtype_size, parse_device,
                     version)  # noqa: F401
from ._util import (_address, _buffer, _cstr, _finalizing, _is_torch_tensor, _name_array,
                    _new_struct, _progress_callback, _struct_dict)  # noqa: F401
from .config import (_MAX_CONFIG_BYTES, _config_source, _read_config_file, config_check,
                     inactive_config_message)  # noqa: F401
from .checkpoint import checkpoint_export, checkpoint_reshard, checkpoint_verify  # noqa: F401
from ._handle import _Owned  # noqa: F401
from .work import Gather, Work, _Waitable  # noqa: F401
from .group import Group  # noqa: F401
from ._dlpack import (_BORROWED_DELETER, _CAPSULE_DESTRUCTOR, _DLDataType, _DLDeleter, _DLDevice,
                      _DLManagedTensor, _DLTENSOR_NAME, _DLTensor, _DL_DTYPE, _PyCapsule_GetPointer,
                      _PyCapsule_IsValid, _PyCapsule_New, _borrowed, _borrowed_deleter,
                      _borrowed_lock, _capsule_destructor, _dlpack_capsule, _libc,
                      dlpack_from_pointer)  # noqa: F401
from .param import (GradBatch, Param, ParamArray, _PARAM_ARRAY_T, _PARAM_STATUS_T,
                     _param_array)  # noqa: F401
from .optimizer import Optimizer, _HPARAM_DEFAULTS, _hparams  # noqa: F401
from .context import Context, _close_live_contexts, _live_contexts  # noqa: F401

__all__ = [
    "FLOAT32", "BFLOAT16", "FLOAT16", "UINT8", "WAIT_FOREVER",
    "DEVICE_CPU", "DEVICE_CUDA",
    "version", "config_check", "dtype_code", "dtype_size", "cuda_device_count", "device_string",
    "parse_device", "dlpack_from_pointer",
    "Context", "Group", "Param", "Gather", "Work", "Optimizer", "ParamArray",
]
