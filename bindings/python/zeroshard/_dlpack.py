"""DLPack capsules in ctypes: zero-copy tensors of engine memory and of
memory lent by the caller (dlpack_from_pointer)."""
import ctypes
import threading

from ._ffi import ffi
from . import errors
from ._types import BFLOAT16, FLOAT16, FLOAT32, UINT8, dtype_code, parse_device


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DLDeleter)]


# Prototypes of our own: ctypes.pythonapi's function objects are shared by
# every module of the process, and one that sets their argtypes (dill, which
# torch.utils.data imports, does for PyCapsule_New) would break these calls.
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

# The capsule keeps a pointer to its name: a copy that is never freed, so a
# capsule outliving this module still has a valid name.
_libc = ctypes.CDLL(None)
_libc.strdup.restype = ctypes.c_void_p
_libc.strdup.argtypes = [ctypes.c_char_p]
_DLTENSOR_NAME = _libc.strdup(b"dltensor")


def _capsule_destructor(capsule):
    # Runs when the capsule is freed. A consumer (torch.utils.dlpack) renames
    # it "used_dltensor" and owns the tensor from then on; a capsule still
    # named "dltensor" was never consumed, so its tensor is deleted here.
    try:
        if _PyCapsule_IsValid(capsule, b"dltensor"):
            ptr = _PyCapsule_GetPointer(capsule, b"dltensor")
            if ptr:
                managed = _DLManagedTensor.from_address(ptr)
                if managed.deleter:
                    managed.deleter(ptr)
    except Exception:  # never raise out of a destructor
        pass


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_capsule_destructor)
# Capsules may be freed during interpreter shutdown, after this module's
# globals: keep the callback (its code and closure) alive for good.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_CAPSULE_DESTRUCTOR))


def _dlpack_capsule(managed_ptr):
    address = managed_ptr if isinstance(managed_ptr, int) else int(
        ffi.cast("uintptr_t", managed_ptr))
    destructor = ctypes.cast(_CAPSULE_DESTRUCTOR, ctypes.c_void_p).value
    try:
        return _PyCapsule_New(address, _DLTENSOR_NAME, destructor)
    except BaseException:
        managed = _DLManagedTensor.from_address(address)
        if managed.deleter:
            managed.deleter(address)
        raise


# DLPack tensors over memory the engine owns and hands out as raw pointers
# (shards, gradient shards, optimizer state): the DLManagedTensor is built
# here, and its deleter only drops the Python references that kept the
# structure (and the owning object) alive. The engine's memory itself lives
# as long as the engine object that owns it (a Param, an Optimizer).
_DL_DTYPE = {FLOAT32: (2, 32), BFLOAT16: (4, 16), FLOAT16: (2, 16), UINT8: (1, 8)}  # (code, bits)
_borrowed = {}  # address of a DLManagedTensor -> (tensor struct, shape array, owner)
_borrowed_lock = threading.Lock()


def _borrowed_deleter(address):
    # Called by the consumer (torch, from any thread; ctypes takes the GIL)
    # or by the capsule destructor for a capsule never consumed.
    try:
        with _borrowed_lock:
            entry = _borrowed.pop(address, None)
        # Dropped outside the lock: the owner's finaliser may run here.
        del entry
    except Exception:  # never raise into C
        pass


_BORROWED_DELETER = _DLDeleter(_borrowed_deleter)
# Tensors may be freed during interpreter shutdown: keep the callback alive.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_BORROWED_DELETER))


def dlpack_from_pointer(address, shape, dtype, device="cpu", owner=None):
    """A "dltensor" PyCapsule over memory at ``address`` (no copy): a
    row-major tensor of ``shape`` and ``dtype`` on ``device`` ("cpu",
    "cuda:N", or a (zs_device_type, ordinal) pair). Nothing is freed when
    the consumer drops the tensor; ``owner`` (e.g. the Param whose shard it
    is) is kept alive as long as the tensor. The memory must stay valid for
    that long: engine memory lives until its param, optimizer or context is
    closed."""
    if isinstance(shape, int) or hasattr(shape, "__index__"):
        shape = (int(shape),)
    shape = [int(d) for d in shape]
    if len(shape) > 32 or any(d < 0 for d in shape):
        raise ValueError("dlpack_from_pointer: bad shape %r" % (shape,))
    code = dtype_code(dtype)
    if code not in _DL_DTYPE:
        raise errors.InvalidArgumentError("dlpack_from_pointer: dtype %r" % (dtype,),
                                          errors.InvalidArgumentError.status_code)
    device_type, device_id = parse_device(device)
    managed = _DLManagedTensor()
    dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    t = managed.dl_tensor
    t.data = int(address) or None
    t.device = _DLDevice(device_type, device_id)
    t.ndim = len(shape)
    dl_code, bits = _DL_DTYPE[code]
    t.dtype = _DLDataType(dl_code, bits, 1)
    t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    t.strides = None  # compact, row-major
    t.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _BORROWED_DELETER
    key = ctypes.addressof(managed)
    with _borrowed_lock:
        _borrowed[key] = (managed, dims, owner)
    return _dlpack_capsule(key)
