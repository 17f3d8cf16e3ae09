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
"""
import atexit
import collections
import ctypes
import json
import os
import stat
import sys
import threading
import warnings
import weakref

from ._ffi import ffi, lib
from . import errors
from .errors import check

__all__ = [
    "FLOAT32", "BFLOAT16", "FLOAT16", "UINT8", "WAIT_FOREVER",
    "DEVICE_CPU", "DEVICE_CUDA",
    "version", "config_check", "dtype_code", "dtype_size", "cuda_device_count", "device_string",
    "parse_device", "dlpack_from_pointer",
    "Context", "Group", "Param", "Gather", "Work", "Optimizer", "ParamArray",
]

FLOAT32, BFLOAT16, FLOAT16, UINT8 = 0, 1, 2, 3
WAIT_FOREVER = -1
DEVICE_CPU, DEVICE_CUDA = 1, 2  # zs_device_type: DLPack's kDLCPU, kDLCUDA

_DTYPE_BY_NAME = {
    "float32": FLOAT32, "fp32": FLOAT32, "float": FLOAT32,
    "bfloat16": BFLOAT16, "bf16": BFLOAT16,
    "float16": FLOAT16, "fp16": FLOAT16, "half": FLOAT16,
    "uint8": UINT8, "u8": UINT8,
}
_DTYPE_SIZE = {FLOAT32: 4, BFLOAT16: 2, FLOAT16: 2, UINT8: 1}
DTYPE_NAMES = {FLOAT32: "float32", BFLOAT16: "bfloat16", FLOAT16: "float16", UINT8: "uint8"}

_INIT_BY_NAME = {"zeros": 0, "from_rank": 1, "from_all": 2, "normal": 3, "uniform": 4}
_OP_BY_NAME = {"sum": 0, "avg": 1, "mean": 1, "max": 2, "min": 3}
_GROUP_BY_NAME = {"world": 0, "partition": 1, "mics_shard": 2, "mics_replica": 3, "hpz": 4,
                  "mics_inter": 5, "mics_intra": 6}
_OPTIM_BY_NAME = {"adamw": 0, "adam": 1, "sgd": 2}
_PARAM_STATUS = {0: "NOT_AVAILABLE", 1: "INFLIGHT", 2: "AVAILABLE"}


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------

def _code(value, table, what):
    """An enum value from an int or one of the table's names."""
    if isinstance(value, bool):
        raise TypeError("%s: expected one of %s or an int, got %r" % (what, sorted(table), value))
    if isinstance(value, int):
        return value
    if hasattr(value, "__index__") and not isinstance(value, str):
        return value.__index__()
    if isinstance(value, str):
        key = value.strip().lower()
        if key in table:
            return table[key]
        raise errors.InvalidArgumentError(
            "%s %r: expected one of %s" % (what, value, ", ".join(sorted(table))),
            errors.InvalidArgumentError.status_code)
    raise TypeError("%s: expected one of %s or an int, got %s"
                    % (what, sorted(table), type(value).__name__))


def dtype_code(dtype):
    """The zs_dtype code of ``dtype``: an int, a name ("float32", "bf16", ...),
    a torch dtype (torch.float32) or a numpy dtype / scalar type."""
    if isinstance(dtype, (int, str)) or hasattr(dtype, "__index__"):
        return _code(dtype, _DTYPE_BY_NAME, "dtype")
    name = getattr(dtype, "name", None) if not isinstance(dtype, type) else dtype.__name__
    if not isinstance(name, str):
        name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    return _code(name, _DTYPE_BY_NAME, "dtype")


def dtype_size(dtype):
    """Bytes per element of a dtype (None for a code the binding does not know)."""
    return _DTYPE_SIZE.get(dtype_code(dtype))


def _cstr(value, keep):
    if value is None:
        return ffi.NULL
    if isinstance(value, bytes):
        raw = value
    elif isinstance(value, str):
        raw = value.encode("utf-8")
    else:
        raw = os.fsencode(value)
    c = ffi.new("char[]", raw)
    keep.append(c)
    return c


def _is_torch_tensor(obj):
    t = type(obj)
    return t.__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(
        obj, "element_size")


def _buffer(data, writable, what):
    """(pointer cdata, nbytes, keep-alive object) for a caller's buffer."""
    if data is None:
        return ffi.NULL, 0, None
    if isinstance(data, tuple):
        if len(data) != 2:
            raise TypeError("%s: a raw buffer is a tuple (address, nbytes), got %d items"
                            % (what, len(data)))
        address, nbytes = int(data[0]), int(data[1])
        if nbytes < 0:
            raise ValueError("%s: nbytes %d is negative" % (what, nbytes))
        return ffi.cast("void*", address), nbytes, None
    if _is_torch_tensor(data):
        # CPU and CUDA memory alike: the engine tells them apart itself.
        if data.device.type not in ("cpu", "cuda"):
            raise errors.NotSupportedError(
                "%s: a %s tensor; the engine takes CPU or CUDA memory (use (address, nbytes))"
                % (what, data.device.type), errors.NotSupportedError.status_code)
        if not data.is_contiguous():
            raise ValueError("%s: the tensor is not contiguous" % what)
        return ffi.cast("void*", data.data_ptr()), data.numel() * data.element_size(), data
    try:
        c = ffi.from_buffer("char[]", data, require_writable=writable)
    except (TypeError, BufferError, ValueError) as e:
        raise TypeError("%s: expected a %sbuffer object (bytes, bytearray, memoryview, numpy "
                        "array), a CPU or CUDA torch tensor or (address, nbytes), got %s: %s"
                        % (what, "writable " if writable else "", type(data).__name__, e)) from e
    return ffi.cast("void*", c), len(c), c


_PARAM_ARRAY_T = ffi.typeof("zs_param[]")
_PARAM_STATUS_T = ffi.typeof("zs_param_status*")


class ParamArray:
    """Params as a prebuilt zs_param[]: for calls made with the same params
    over and over (a module's params, every step), which then skip building
    the array. Keeps the Params alive."""

    __slots__ = ("arr", "n", "params")

    def __init__(self, params):
        self.arr, self.n, self.params = _param_array(params)


class GradBatch:
    """Params of one context and dtype whose gradients are handed over
    together, over and over (zs_grad_push_many): their handles and gradient
    sizes prebuilt. Set `addresses[i]` to the address of params[i]'s
    gradient (numel elements of the dtype, contiguous), or 0 for none this
    time, then push(); the gradients may be reused once it returns."""

    __slots__ = ("ctx", "params", "addresses", "_arr", "_n", "_sizes", "_grads", "_dtype")

    def __init__(self, ctx, params, dtype):
        self.ctx = ctx
        self._arr, self._n, self.params = _param_array(params)
        self._dtype = dtype_code(dtype)
        size = _DTYPE_SIZE[self._dtype]
        self._sizes = ffi.new("size_t[]", [p.numel * size for p in self.params])
        self.addresses = ffi.new("uintptr_t[]", self._n)
        self._grads = ffi.cast("const void* const*", self.addresses)

    def push(self):
        check(lib.zs_grad_push_many(self.ctx._h, self._arr, self._n, self._grads, self._sizes,
                                    self._dtype))


def _param_array(params):
    """A zs_param[] of the handles of one Param or an iterable of Params."""
    if isinstance(params, ParamArray):
        return params.arr, params.n, params.params
    if isinstance(params, Param):
        params = [params]
    params = list(params)
    for p in params:
        if not isinstance(p, Param):
            raise TypeError("expected Param objects, got %s" % type(p).__name__)
    return ffi.new(_PARAM_ARRAY_T, [p._h for p in params]), len(params), params


def _struct_dict(cdata, ctype):
    """Every field of a stats struct but `size`, by name (floats stay floats)."""
    return {name: (float if field.type.cname == "double" else int)(getattr(cdata, name))
            for name, field in ffi.typeof(ctype).fields if name != "size"}


def _new_struct(ctype):
    """A new struct as its ZS_XXX_INIT macro initialises it, filled by the
    library's zs_xxx_init (the defaults of the library actually loaded)."""
    s = ffi.new(ctype + "*")
    check(getattr(lib, ctype + "_init")(s, ffi.sizeof(ctype)))
    return s


def _address(ptr):
    return int(ffi.cast("uintptr_t", ptr))


def _config_source(config):
    """(json_text, path) for a config given as dict, JSON text or path."""
    if config is None:
        return None, None
    if isinstance(config, dict) or (hasattr(config, "keys") and hasattr(config, "items")):
        return json.dumps(dict(config)), None
    if isinstance(config, bytes):
        config = config.decode("utf-8")
    if isinstance(config, str):
        if config.lstrip().startswith("{"):
            return config, None
        return None, config
    if isinstance(config, os.PathLike):
        return None, os.fspath(config)
    raise TypeError("config: expected a dict, JSON text or a path, got %s"
                    % type(config).__name__)


def device_string(device_type, device_id):
    """"cpu" or "cuda:N" for a zs_device_type and ordinal."""
    device_type = int(device_type)
    if device_type == DEVICE_CPU:
        return "cpu"
    if device_type == DEVICE_CUDA:
        return "cuda:%d" % int(device_id)
    return "device_type_%d:%d" % (device_type, int(device_id))


def parse_device(device):
    """(zs_device_type, ordinal) of "cpu", "cuda", "cuda:N", a torch.device,
    or a (type, ordinal) pair; "cuda" is ordinal 0, as for the engine."""
    if isinstance(device, tuple) and len(device) == 2:
        return int(device[0]), int(device[1])
    text = device.decode("ascii") if isinstance(device, bytes) else str(device)
    text = text.strip().lower()
    if text == "cpu":
        return DEVICE_CPU, 0
    if text == "cuda":
        return DEVICE_CUDA, 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return DEVICE_CUDA, int(text[5:])
    raise errors.InvalidArgumentError(
        "device %r: expected \"cpu\", \"cuda\" or \"cuda:N\"" % (device,),
        errors.InvalidArgumentError.status_code)


def _device_option(device):
    """A Context's device argument as the C string the engine parses (which
    names a bad value itself); torch.device and (type, id) are accepted."""
    if device is None or isinstance(device, (str, bytes)):
        return device
    if isinstance(device, tuple):
        return device_string(*parse_device(device))
    return str(device)  # torch.device("cuda", 1) -> "cuda:1"


def cuda_device_count():
    """(count, reason): the CUDA devices this process can use, and when there
    are none, why (built without CUDA, no driver, no device visible)."""
    count = ffi.new("int*")
    reason = ffi.new("const char**")
    check(lib.zs_cuda_device_count(count, reason))
    why = ffi.string(reason[0]).decode("utf-8", "replace") if reason[0] != ffi.NULL else ""
    return int(count[0]), why


def version():
    """The version of the loaded library, "MAJOR.MINOR.PATCH"."""
    return ffi.string(lib.zs_version(ffi.NULL, ffi.NULL, ffi.NULL)).decode("ascii")


# The engine's limit on a config's size (impl/config/config.cpp).
_MAX_CONFIG_BYTES = 1 << 20


def _read_config_file(path):
    """A config file's text, read as the engine reads one: a regular file of
    at most _MAX_CONFIG_BYTES (never a FIFO or /dev/zero read forever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise errors.InvalidConfigError("cannot read config file '%s': %s" % (path, e.strerror),
                                        errors.InvalidConfigError.status_code) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise errors.InvalidConfigError(
            "config file '%s' is not a regular file, expected a regular file" % path,
            errors.InvalidConfigError.status_code)
    with os.fdopen(fd, "rb") as f:
        data = f.read(_MAX_CONFIG_BYTES + 1)
    if len(data) > _MAX_CONFIG_BYTES:
        raise errors.InvalidConfigError(
            "config file '%s' is more than %d bytes, expected at most %d"
            % (path, _MAX_CONFIG_BYTES, _MAX_CONFIG_BYTES), errors.InvalidConfigError.status_code)
    return data.decode("utf-8")


def _name_array(names, n, held):
    if names is None:
        return ffi.NULL
    names = list(names)
    if len(names) != n:
        raise ValueError("names: %d names for %d params" % (len(names), n))
    cs = [_cstr(str(x), held) for x in names]
    arr = ffi.new("const char*[]", cs)
    held.append(arr)
    return arr


def _progress_callback(progress, held):
    if progress is None:
        return ffi.NULL, ffi.NULL

    def call(user, phase, done, total):
        progress(ffi.string(phase).decode("ascii"), int(done), int(total))

    cb = ffi.callback("zs_progress_fn", call)
    held.append(cb)
    return cb, ffi.NULL


def checkpoint_verify(path, tag=None, progress=None):
    """Check every checksum of a checkpoint (no context needed); ZsIOError
    names each file and tensor that fails."""
    held = []
    fn, user = _progress_callback(progress, held)
    check(lib.zs_checkpoint_verify(os.fsencode(path), _cstr(tag, held), fn, user))


def checkpoint_export(path, out_file, tag=None, fp32=False, progress=None):
    """One safetensors file of full tensors under their checkpoint names,
    streamed (memory bounded by a buffer); Hugging Face's from_pretrained
    and safetensors.torch.load_file read it."""
    held = []
    o = _new_struct("zs_checkpoint_export_options")
    o.tag = _cstr(tag, held)
    o.fp32 = 1 if fp32 else 0
    o.progress, o.progress_user = _progress_callback(progress, held)
    check(lib.zs_checkpoint_export(os.fsencode(path), os.fsencode(out_file), o))


def checkpoint_reshard(path, out_dir, world_size, tag=None, progress=None):
    """Rewrite a checkpoint for world_size ranks into out_dir (new)."""
    held = []
    fn, user = _progress_callback(progress, held)
    check(lib.zs_checkpoint_reshard(os.fsencode(path), _cstr(tag, held), os.fsencode(out_dir),
                                    int(world_size), fn, user))


def config_check(config, world_size=0):
    """Validate a DeepSpeed config (dict, JSON text or path) without a context.

    Raises InvalidConfigError naming the JSON path on a bad value.
    world_size <= 0 skips the topology checks."""
    text, path = _config_source(config)
    if path is not None:
        text = _read_config_file(path)
    if text is None:
        text = "{}"
    check(lib.zs_config_check(text.encode("utf-8"), int(world_size)))


def inactive_config_message(keys):
    """The warning text for the engine's list of keys accepted but not acted
    on (Context.inactive_config_keys): one line per key."""
    return "\n".join(
        "zeroshard: config key %s = %s is accepted but not acted on yet: %s"
        % (k["key"], json.dumps(k["value"]), k["reason"]) for k in keys)


def _finalizing():
    try:
        return sys.is_finalizing()
    except Exception:  # pragma: no cover - sys half torn down
        return True


# ---------------------------------------------------------------------------
# Handle ownership
# ---------------------------------------------------------------------------

class _Owned:
    """An engine handle owned by a Python object of a Context."""

    _destroy_name = None  # name of the zs_xxx_destroy function

    def __init__(self, ctx, handle):
        self._ctx = ctx
        self._h = handle
        self._closed = False

    @property
    def context(self):
        return self._ctx

    @property
    def closed(self):
        return self._closed

    @property
    def handle(self):
        """The raw C handle (a cffi pointer)."""
        return self._h

    def _release_refs(self):
        pass

    def close(self):
        """Destroy the handle (idempotent). A no-op once the context is closed:
        the engine freed the handle with it."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._ctx is not None and self._ctx._closed:
                return
            check(getattr(lib, self._destroy_name)(self._h))
        finally:
            self._release_refs()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            if self._closed or _finalizing():
                return
            self._closed = True
            ctx = self._ctx
            if ctx is not None and ctx._closed:
                return
            getattr(lib, self._destroy_name)(self._h)
        except Exception:
            pass


# ---------------------------------------------------------------------------
# Asynchronous work
# ---------------------------------------------------------------------------

class _Waitable(_Owned):
    _wait_name = None
    _test_name = None

    def __init__(self, ctx, handle, keep):
        super().__init__(ctx, handle)
        self._keep = keep  # buffers / params in use until done

    def _release_refs(self):
        self._keep = None

    def wait(self, timeout_ms=WAIT_FOREVER):
        """Block until done (ZsTimeoutError after timeout_ms, -1: forever);
        raises the work's own error if it failed."""
        check(getattr(lib, self._wait_name)(self._h, int(timeout_ms)))

    def test(self):
        """True when finished (raising the work's error if it failed)."""
        done = ffi.new("int*")
        check(getattr(lib, self._test_name)(self._h, done))
        return bool(done[0])


class Work(_Waitable):
    """An asynchronous collective. close() waits for unfinished work."""
    _destroy_name = "zs_work_destroy"
    _wait_name = "zs_work_wait"
    _test_name = "zs_work_test"

    def __repr__(self):
        return "<zeroshard.Work%s>" % (" closed" if self._closed else "")


class Gather(_Waitable):
    """A coalesced asynchronous fetch. close() waits for an unfinished gather;
    the params stay AVAILABLE until released."""
    _destroy_name = "zs_gather_destroy"
    _wait_name = "zs_gather_wait"
    _test_name = "zs_gather_test"

    @property
    def params(self):
        return list(self._keep or ())

    def __repr__(self):
        return "<zeroshard.Gather of %d params%s>" % (len(self._keep or ()),
                                                      " closed" if self._closed else "")


# ---------------------------------------------------------------------------
# Groups and collectives
# ---------------------------------------------------------------------------

class Group(_Owned):
    """A process group of the context: collectives run asynchronously on the
    group's thread, in issue order, and return a Work."""
    _destroy_name = "zs_group_destroy"

    @property
    def rank(self):
        """This rank's position in the group (-1 if not a member)."""
        out = ffi.new("int*")
        check(lib.zs_group_rank(self._h, out))
        return out[0]

    @property
    def size(self):
        out = ffi.new("int*")
        check(lib.zs_group_size(self._h, out))
        return out[0]

    def world_rank(self, i):
        """The world rank of group member i."""
        out = ffi.new("int*")
        check(lib.zs_group_world_rank(self._h, int(i), out))
        return out[0]

    def ranks(self):
        """World ranks of every member, in group order."""
        return [self.world_rank(i) for i in range(self.size)]

    def _size_or_none(self):
        out = ffi.new("int*")
        return out[0] if lib.zs_group_size(self._h, out) == 0 else None

    @staticmethod
    def _need(nbytes, need, what, op):
        # The engine sees pointers only; sizes are checked here where they are
        # known, so that a short buffer is an error rather than a wild write.
        if need is not None and nbytes < need:
            raise errors.BufferSizeError(
                "%s: %s holds %d bytes, expected at least %d" % (op, what, nbytes, need),
                errors.BufferSizeError.status_code)

    def _submit(self, fn, *args, keep=()):
        out = ffi.new("zs_work*")
        check(fn(out, self._h, *args))
        return Work(self._ctx, out[0], list(keep))

    def allgather(self, send, recv, count, dtype):
        """recv (count * size elements) receives member i's send at i * count."""
        code = dtype_code(dtype)
        isz, count = _DTYPE_SIZE.get(code), int(count)
        sp, sn, sk = _buffer(send, False, "send")
        rp, rn, rk = _buffer(recv, True, "recv")
        if isz is not None:
            size = self._size_or_none()
            self._need(sn, count * isz, "send", "allgather")
            if size is not None:
                self._need(rn, count * isz * size, "recv", "allgather")
        return self._submit(lib.zs_allgather, sp, rp, count, code, keep=(send, recv, sk, rk))

    def reduce_scatter(self, send, recv, recv_count, dtype, op="sum"):
        """send holds recv_count * size elements; member i gets the reduction of block i."""
        code, o = dtype_code(dtype), _code(op, _OP_BY_NAME, "op")
        isz, recv_count = _DTYPE_SIZE.get(code), int(recv_count)
        sp, sn, sk = _buffer(send, False, "send")
        rp, rn, rk = _buffer(recv, True, "recv")
        if isz is not None:
            size = self._size_or_none()
            if size is not None:
                self._need(sn, recv_count * isz * size, "send", "reduce_scatter")
            self._need(rn, recv_count * isz, "recv", "reduce_scatter")
        return self._submit(lib.zs_reduce_scatter, sp, rp, recv_count, code, o,
                            keep=(send, recv, sk, rk))

    def allreduce(self, send, recv, count, dtype, op="sum"):
        """Reduce count elements over the group; send may be recv (or None: in place)."""
        code, o = dtype_code(dtype), _code(op, _OP_BY_NAME, "op")
        isz, count = _DTYPE_SIZE.get(code), int(count)
        rp, rn, rk = _buffer(recv, True, "recv")
        if send is None or send is recv:
            sp, sn, sk = rp, rn, None
        else:
            sp, sn, sk = _buffer(send, False, "send")
        if isz is not None:
            self._need(sn, count * isz, "send", "allreduce")
            self._need(rn, count * isz, "recv", "allreduce")
        return self._submit(lib.zs_allreduce, sp, rp, count, code, o, keep=(send, recv, sk, rk))

    def broadcast(self, buf, count, dtype, root):
        """buf is read on group rank root and written on the others."""
        code = dtype_code(dtype)
        isz, count = _DTYPE_SIZE.get(code), int(count)
        bp, bn, bk = _buffer(buf, True, "buf")
        if isz is not None:
            self._need(bn, count * isz, "buf", "broadcast")
        return self._submit(lib.zs_broadcast, bp, count, code, int(root), keep=(buf, bk))

    def barrier(self):
        return self._submit(lib.zs_barrier)

    def __repr__(self):
        if self._closed:
            return "<zeroshard.Group closed>"
        try:
            return "<zeroshard.Group rank %d of %d>" % (self.rank, self.size)
        except errors.ZeroShardError:
            return "<zeroshard.Group (invalid)>"


# ---------------------------------------------------------------------------
# DLPack capsules
# ---------------------------------------------------------------------------

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


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

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


# ---------------------------------------------------------------------------
# Params
# ---------------------------------------------------------------------------

class Param(_Owned):
    """A partitioned parameter: this rank holds its shard; fetch() gathers the
    full data until release()."""
    _destroy_name = "zs_param_destroy"

    def __init__(self, ctx, handle):
        super().__init__(ctx, handle)
        info = _new_struct("zs_param_info")
        try:
            check(lib.zs_param_get_info(handle, info))
        except BaseException:
            self._closed = True
            lib.zs_param_destroy(handle)
            raise
        self.name = ffi.string(info.name).decode("utf-8", "replace") if info.name else ""
        self.dtype = int(info.dtype)
        self.shape = tuple(int(info.shape[i]) for i in range(info.ndim))
        self.numel = int(info.numel)
        self.shard_numel = int(info.shard_numel)
        self.padded_numel = int(info.padded_numel)
        self.shard_offset = int(info.shard_offset)
        self.shard_valid = int(info.shard_valid)
        self.device_type = int(info.device_type)  # DEVICE_CPU or DEVICE_CUDA
        self.device_id = int(info.device_id)

    @property
    def device(self):
        """Where shard and full data live: "cpu" or "cuda:N"."""
        return device_string(self.device_type, self.device_id)

    @property
    def is_cuda(self):
        return self.device_type == DEVICE_CUDA

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def itemsize(self):
        return _DTYPE_SIZE.get(self.dtype)

    @property
    def nbytes(self):
        """Bytes of the full (gathered) data."""
        return self.numel * _DTYPE_SIZE.get(self.dtype, 0)

    @property
    def status(self):
        """"NOT_AVAILABLE", "INFLIGHT" or "AVAILABLE"."""
        out = ffi.new(_PARAM_STATUS_T)
        check(lib.zs_param_get_status(self._h, out))
        return _PARAM_STATUS.get(int(out[0]), str(int(out[0])))

    def data_ptr(self):
        """Address of the full data of an AVAILABLE param (InvalidStateError otherwise)."""
        out = ffi.new("void**")
        check(lib.zs_param_data(self._h, out))
        return _address(out[0])

    def to_dlpack(self):
        """A "dltensor" PyCapsule over the full data (no copy) of an AVAILABLE
        param; the tensor keeps the memory alive after release."""
        out = ffi.new("struct DLManagedTensor**")
        check(lib.zs_param_to_dlpack(self._h, out))
        return _dlpack_capsule(out[0])

    def __dlpack__(self, stream=None, *, max_version=None, dl_device=None, copy=None):
        # The gathered data is complete on the device when the gather is
        # waited for, so no stream needs to wait (stream is accepted and
        # ignored). A legacy unversioned capsule is what the spec allows a
        # producer to return whatever max_version asks for.
        if copy:
            raise BufferError("zeroshard.Param.__dlpack__: copy=True is not supported; "
                              "the tensor is the engine's memory")
        if dl_device is not None and tuple(int(v) for v in dl_device) != self.__dlpack_device__():
            raise BufferError("zeroshard.Param.__dlpack__: the data is on %s, not on DLPack "
                              "device %r" % (self.device, tuple(dl_device)))
        return self.to_dlpack()

    def __dlpack_device__(self):
        return (self.device_type, self.device_id)  # kDLCPU (1, 0) or kDLCUDA (2, N)

    def copy_to(self, buffer=None):
        """Copy the full data into buffer (exactly nbytes; BufferSizeError
        otherwise). Without a buffer, a new bytearray is returned."""
        if buffer is None:
            buffer = bytearray(self.nbytes)
        ptr, nbytes, keep = _buffer(buffer, True, "buffer")
        check(lib.zs_param_copy_to(self._h, ptr, nbytes))
        del keep
        return buffer

    def write(self, data):
        """Set the param to these full values (numel elements of its dtype),
        passed alike on every rank: rewrites this rank's shard (and the full
        data while gathered). Local, no traffic."""
        ptr, nbytes, keep = _buffer(data, False, "data")
        check(lib.zs_param_write(self._h, ptr, nbytes))
        del keep

    def freeze(self):
        """Freeze the param for good (zs_param_freeze): gathered as before,
        but it takes no gradient and no optimizer steps it; under
        zero_quantized_nontrainable_weights its shard is kept as block-
        quantized codes from now on."""
        check(lib.zs_param_freeze(self._h))

    def shard_ptr(self):
        """Address of this rank's shard (shard_numel elements, writable), in
        the memory of the param's device."""
        data = ffi.new("void**")
        n = ffi.new("uint64_t*")
        check(lib.zs_param_shard_data(self._h, data, n))
        return _address(data[0])

    def shard_dlpack(self):
        """A DLPack capsule over this rank's shard (shard_numel elements of
        the param's dtype, on its device, writable, no copy); the tensor
        keeps this Param object alive but is valid only until it is closed."""
        return dlpack_from_pointer(self.shard_ptr(), (self.shard_numel,), self.dtype,
                                   (self.device_type, self.device_id), owner=self)

    def push_grad(self, data, dtype):
        """Hand the engine the param's full gradient (numel elements of dtype)."""
        code = dtype_code(dtype)
        ptr, nbytes, keep = _buffer(data, False, "grad")
        check(lib.zs_grad_push(self._h, ptr, code, nbytes))
        del keep

    def lend_grad(self, address, nbytes, dtype, owner):
        """push_grad that lets the engine reduce straight from the memory at
        `address` (zs_grad_push_borrowed): `owner`, the object that keeps that
        memory alive (a tensor), is held by the context until the engine
        no longer reads it. The memory must not change until then."""
        ctx = self._ctx
        ticket = ffi.new("uint64_t*")
        check(lib.zs_grad_push_borrowed(ticket, self._h, ffi.cast("const void*", address),
                                        dtype_code(dtype), nbytes))
        if ticket[0]:
            ctx._lent.append((ticket[0], owner))
        # The push may have waited for older reductions: their gradients go
        # now, not at the next push (a layer's gradient less at the peak).
        ctx.release_lent()

    def grad_shard_ptr(self):
        """Address of this rank's fp32 gradient shard (0 before the first push),
        in the memory of the param's device."""
        data = ffi.new("float**")
        n = ffi.new("uint64_t*")
        check(lib.zs_grad_shard_data(self._h, data, n))
        return _address(data[0])

    def grad_shard_dlpack(self):
        """A DLPack capsule over the fp32 gradient shard (shard_numel
        elements, on the param's device, no copy), or None before the first
        push. Valid after Context.grad_sync() and while this Param is open."""
        addr = self.grad_shard_ptr()
        if not addr and self.shard_numel:
            return None
        return dlpack_from_pointer(addr, (self.shard_numel,), FLOAT32,
                                   (self.device_type, self.device_id), owner=self)

    def __repr__(self):
        return "<zeroshard.Param %r %s %s%s>" % (self.name, DTYPE_NAMES.get(self.dtype, self.dtype),
                                                 list(self.shape),
                                                 " closed" if self._closed else "")


# ---------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------

_HPARAM_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, momentum=0.0,
                        dampening=0.0, nesterov=False, bias_correction=True)


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
    return h


class Optimizer(_Owned):
    """A sharded optimizer (AdamW, Adam or SGD) over this rank's shards."""
    _destroy_name = "zs_optimizer_destroy"

    def __init__(self, ctx, handle, kind):
        super().__init__(ctx, handle)
        self.kind = kind
        self._groups = []  # hyper-parameters per group index, as last set

    def add_group(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                  momentum=0.0, dampening=0.0, nesterov=False, bias_correction=True):
        """Add a parameter group with its hyper-parameters; returns its index."""
        hp = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                  momentum=momentum, dampening=dampening, nesterov=bool(nesterov),
                  bias_correction=bool(bias_correction))
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
                    momentum=None, dampening=None, nesterov=None, bias_correction=None):
        """Change a group's hyper-parameters (group -1: every group). Keywords
        left None keep the group's current value."""
        given = dict(lr=lr, betas=None if betas is None else tuple(betas), eps=eps,
                     weight_decay=weight_decay, momentum=momentum, dampening=dampening,
                     nesterov=None if nesterov is None else bool(nesterov),
                     bias_correction=None if bias_correction is None else bool(bias_correction))
        group = int(group)
        complete = all(v is not None for v in given.values())
        if group == -1 and not complete and self._groups:
            targets = list(range(len(self._groups)))
        else:
            targets = [group]
        for g in targets:
            base = self._groups[g] if 0 <= g < len(self._groups) else _HPARAM_DEFAULTS
            hp = {k: (base[k] if v is None else v) for k, v in given.items()}
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
        r = _new_struct("zs_step_result")
        check(lib.zs_optimizer_step(self._h, r))
        self._ctx.release_lent()
        return {"skipped": bool(r.skipped), "grad_norm": float(r.grad_norm),
                "loss_scale": float(r.loss_scale), "step": int(r.step)}

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

    def __repr__(self):
        return "<zeroshard.Optimizer %s, %d groups%s>" % (self.kind, len(self._groups),
                                                         " closed" if self._closed else "")


# ---------------------------------------------------------------------------
# Context
# ---------------------------------------------------------------------------

_live_contexts = weakref.WeakSet()


@atexit.register
def _close_live_contexts():
    # Contexts still open at exit are destroyed before the interpreter tears
    # down, so that the engine's threads stop while everything is alive.
    for ctx in list(_live_contexts):
        try:
            ctx.close()
        except Exception:
            pass


class Context:
    """One engine context per process and data-parallel world.

    Arguments left None come from the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, ...). ``config`` is a dict, JSON text (a string
    starting with "{") or a path to a DeepSpeed JSON file.

    ``device``: "cpu", "cuda" or "cuda:N" (or a torch.device) for shards,
    gathered params, gradients and optimizer state; None: the config's
    "device" key, else $ZS_DEVICE, else this rank's GPU (LOCAL_RANK modulo
    the GPUs) when there is one, else "cpu". ``backend``: "gloo" or "nccl";
    None: $ZS_BACKEND, else NCCL on a GPU when libnccl loads, else Gloo
    (GPU memory staged through pinned host memory)."""

    def __init__(self, rank=None, world_size=None, local_rank=None, local_world_size=None,
                 store_host=None, store_port=None, file_store_path=None, config=None,
                 timeout_ms=0, transport_host=None, device=None, backend=None):
        self._closed = True
        self._h = ffi.NULL
        self._device = None
        keep = []
        o = _new_struct("zs_context_options")
        o.rank = -1 if rank is None else int(rank)
        o.world_size = -1 if world_size is None else int(world_size)
        o.local_rank = -1 if local_rank is None else int(local_rank)
        o.local_world_size = -1 if local_world_size is None else int(local_world_size)
        o.store_host = _cstr(store_host, keep)
        o.store_port = -1 if store_port is None else int(store_port)
        o.file_store_path = _cstr(file_store_path, keep)
        text, path = _config_source(config)
        o.config_json = _cstr(text, keep)
        o.config_path = _cstr(path, keep)
        o.timeout_ms = int(timeout_ms or 0)
        o.transport_host = _cstr(transport_host, keep)
        o.device = _cstr(_device_option(device), keep)
        o.backend = _cstr(backend, keep)
        out = ffi.new("zs_context*")
        check(lib.zs_context_create(out, o))
        self._h = out[0]
        self._closed = False
        # (ticket, owner) of the gradients the engine may still read
        # (Param.lend_grad), oldest first; dropped as it releases them.
        self._lent = collections.deque()
        self._released = ffi.new("uint64_t*")
        _live_contexts.add(self)
        try:
            self._warn_inactive_config()
        except BaseException:  # the warning turned into an error by a filter
            self.close()
            raise

    def _warn_inactive_config(self):
        # Once per context, on rank 0 (every rank parses the same config;
        # each can read the list through inactive_config_keys).
        keys = self.inactive_config_keys
        if keys and self.rank == 0:
            warnings.warn(errors.ZeroShardConfigWarning(inactive_config_message(keys), keys),
                          stacklevel=3)

    # -- lifetime --------------------------------------------------------
    @property
    def closed(self):
        return self._closed

    @property
    def handle(self):
        return self._h

    def close(self):
        """Destroy the context and everything registered in it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _live_contexts.discard(self)
        try:
            check(lib.zs_context_destroy(self._h))
        finally:
            self._lent.clear()  # nothing reads them once the context is gone

    def release_lent(self):
        """Let go of the lent gradients the engine no longer reads."""
        lent = self._lent
        if not lent:
            return
        check(lib.zs_grad_released(self._h, self._released))
        upto = self._released[0]
        while lent and lent[0][0] <= upto:
            lent.popleft()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            if self._closed or _finalizing():
                return
            self._closed = True
            lib.zs_context_destroy(self._h)
            self._lent.clear()
        except Exception:
            pass

    def __repr__(self):
        if self._closed:
            return "<zeroshard.Context closed>"
        try:
            return "<zeroshard.Context rank %d of %d on %s>" % (self.rank, self.world_size,
                                                                 self.device)
        except errors.ZeroShardError:
            return "<zeroshard.Context (invalid)>"

    # -- identity and config -------------------------------------------
    def _int(self, fn):
        out = ffi.new("int*")
        check(fn(self._h, out))
        return out[0]

    @property
    def rank(self):
        return self._int(lib.zs_context_rank)

    @property
    def world_size(self):
        return self._int(lib.zs_context_world_size)

    @property
    def local_rank(self):
        return self._int(lib.zs_context_local_rank)

    @property
    def local_world_size(self):
        return self._int(lib.zs_context_local_world_size)

    def _device_info(self):
        if self._device is None:  # fixed for the context's life
            t = ffi.new("zs_device_type*")
            i = ffi.new("int*")
            b = ffi.new("const char**")
            check(lib.zs_context_device(self._h, t, i, b))
            self._device = (int(t[0]), int(i[0]), ffi.string(b[0]).decode("ascii"))
        return self._device

    @property
    def device(self):
        """Where the context's memory lives: "cpu" or "cuda:N"."""
        t, i, _ = self._device_info()
        return device_string(t, i)

    @property
    def device_type(self):
        """DEVICE_CPU (1) or DEVICE_CUDA (2): DLPack's device type codes."""
        return self._device_info()[0]

    @property
    def device_id(self):
        """The device ordinal (0 on the CPU)."""
        return self._device_info()[1]

    @property
    def backend(self):
        """What collectives run on: "gloo" or "nccl"."""
        return self._device_info()[2]

    @property
    def config(self):
        """The effective config (defaults filled in, "auto" resolved)."""
        out = ffi.new("const char**")
        check(lib.zs_context_config_json(self._h, out))
        return json.loads(ffi.string(out[0]).decode("utf-8"))

    @property
    def unused_config_keys(self):
        """Keys accepted but not used by the engine (trainer keys)."""
        out = ffi.new("const char**")
        check(lib.zs_context_unused_config_keys(self._h, out))
        return list(json.loads(ffi.string(out[0]).decode("utf-8")))

    @property
    def inactive_config_keys(self):
        """Config keys the engine accepts but does not act on yet, computed
        once by the engine: a list of {"key": JSON path as written, "value":
        the value, "reason": what the engine does instead}. Context creation
        warns about them (ZeroShardConfigWarning, once, on rank 0)."""
        out = ffi.new("const char**")
        check(lib.zs_context_inactive_config_keys(self._h, out))
        return list(json.loads(ffi.string(out[0]).decode("utf-8")))

    def memory(self):
        """This rank's memory counters in bytes (and num_params)."""
        s = _new_struct("zs_memory_stats")
        check(lib.zs_context_memory(self._h, s))
        return _struct_dict(s, "zs_memory_stats")

    def fetch_stats(self):
        s = _new_struct("zs_fetch_stats")
        check(lib.zs_context_fetch_stats(self._h, s))
        return _struct_dict(s, "zs_fetch_stats")

    def coord_stats(self):
        s = _new_struct("zs_coord_stats")
        check(lib.zs_coord_get_stats(self._h, s))
        return _struct_dict(s, "zs_coord_stats")

    def step_stats(self):
        """The last optimizer step's summary: time and bytes of all-gathers,
        reduce-scatters, all-reduces and other collectives, the time the
        trainer waited for them, the update's time (zs_context_step_stats)."""
        s = _new_struct("zs_step_stats")
        check(lib.zs_context_step_stats(self._h, s))
        return _struct_dict(s, "zs_step_stats")

    def check_async_error(self):
        """Raise the first error of background work in this context, if any."""
        check(lib.zs_context_async_error(self._h))

    # -- groups ------------------------------------------------------------
    def group(self, kind="world"):
        """A handle to one of the context's groups: "world", "partition",
        "mics_shard", "mics_replica", "hpz", "mics_inter", "mics_intra"."""
        k = _code(kind, _GROUP_BY_NAME, "group kind")
        out = ffi.new("zs_group*")
        check(lib.zs_context_group(out, self._h, k))
        return Group(self, out[0])

    def new_group(self, ranks):
        """A sub-group of world ranks (collective over the world)."""
        ranks = [int(r) for r in ranks]
        arr = ffi.new("int[]", ranks)
        out = ffi.new("zs_group*")
        check(lib.zs_group_create(out, self._h, arr, len(ranks)))
        return Group(self, out[0])

    # -- params ------------------------------------------------------------
    def register(self, name, dtype, shape, init="zeros", data=None, src_rank=0, seed=0, a=0.0,
                 b=1.0, group=None):
        """Register a partitioned param; this rank keeps only its shard.

        init: "zeros", "from_rank" (data read on group rank src_rank),
        "from_all" (identical data everywhere), "normal" (mean a, std b) or
        "uniform" ([a, b)), both from seed. group: a Group, or None for the
        partition group."""
        keep = []
        if isinstance(shape, int) or hasattr(shape, "__index__"):
            shape = (int(shape),)
        shape = [int(d) for d in shape]
        o = _new_struct("zs_param_options")
        o.name = _cstr(name, keep)
        o.dtype = dtype_code(dtype)
        o.ndim = len(shape)
        shape_c = ffi.new("int64_t[]", shape if shape else [0])
        o.shape = shape_c if shape else ffi.NULL
        o.init = _code(init, _INIT_BY_NAME, "init")
        ptr, nbytes, k = _buffer(data, False, "data")
        keep.append(k)
        o.data = ptr
        o.data_bytes = nbytes
        o.src_rank = int(src_rank)
        o.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        o.a = float(a)
        o.b = float(b)
        if group is None:
            o.group = ffi.NULL
        elif isinstance(group, Group):
            o.group = group._h
        else:
            raise TypeError("group: expected a Group or None, got %s" % type(group).__name__)
        out = ffi.new("zs_param*")
        check(lib.zs_param_register(out, self._h, o))
        return Param(self, out[0])

    def fetch(self, params):
        """Gather params (one coalesced asynchronous all-gather) -> Gather."""
        arr, n, keep = _param_array(params)
        out = ffi.new("zs_gather*")
        check(lib.zs_fetch(out, self._h, arr, n))
        return Gather(self, out[0], keep)

    def release(self, params):
        """Free the full data of AVAILABLE params."""
        arr, n, _ = _param_array(params)
        check(lib.zs_release(self._h, arr, n))

    def update(self, params, modifier_rank=0):
        """GatheredParameters: broadcast the full data from modifier_rank and
        re-partition, so changes survive release (collective, blocking)."""
        arr, n, _ = _param_array(params)
        check(lib.zs_param_update(self._h, arr, n, int(modifier_rank)))

    # -- coordinator -------------------------------------------------------
    def step_begin(self):
        check(lib.zs_step_begin(self._h))

    def step_end(self, token=None):
        """End the coordinator's step (collective). With `token` (a 64-bit
        int), whether every rank passed the same token (zs_step_end_agree),
        or None where a quiet step compared nothing."""
        if token is None:
            check(lib.zs_step_end(self._h))
            return None
        same = ffi.new("int*")
        check(lib.zs_step_end_agree(self._h, int(token) & 0xFFFFFFFFFFFFFFFF, same))
        return None if same[0] < 0 else bool(same[0])

    def coord_fetch(self, params):
        arr, n, _ = _param_array(params)
        check(lib.zs_coord_fetch(self._h, arr, n))

    def coord_release(self, params):
        arr, n, _ = _param_array(params)
        check(lib.zs_coord_release(self._h, arr, n))

    def leaf_group(self, params):
        arr, n, _ = _param_array(params)
        check(lib.zs_leaf_group(self._h, arr, n))

    # -- training ------------------------------------------------------------
    def grad_sync(self):
        check(lib.zs_grad_sync(self._h))
        self.release_lent()

    def set_accumulation_steps(self, n):
        check(lib.zs_grad_set_accumulation_steps(self._h, int(n)))

    def save_checkpoint(self, dir, params, optimizer=None, tag=None, names=None, user_json=None,
                        timeout_ms=0, overwrite=False, update_latest=True, progress=None):
        """Save params (and the optimizer's state) into dir/tag, crash-safe;
        collective over the world (README, "Checkpoints"). names: what each
        param is saved under (default: registration names). user_json: text
        kept as is. progress(phase, done, total) is called on this thread.
        Returns the checkpoint directory."""
        arr, n, keep = _param_array(params)
        o = _new_struct("zs_checkpoint_save_options")
        held = []
        o.tag = _cstr(tag, held)
        o.user_json = _cstr(user_json, held)
        o.timeout_ms = int(timeout_ms)
        o.overwrite = 1 if overwrite else 0
        o.update_latest = 1 if update_latest else 0
        o.names = _name_array(names, n, held)
        o.progress, o.progress_user = _progress_callback(progress, held)
        opt = ffi.NULL if optimizer is None else optimizer._h
        check(lib.zs_checkpoint_save(self._h, arr, n, opt, os.fsencode(dir), o))
        if tag is None:
            tag = "step-%d" % (optimizer.steps if optimizer is not None else 0)
        return os.path.join(dir, tag)

    def load_checkpoint(self, path, params, optimizer=None, tag=None, names=None, strict=True,
                        progress=None):
        """Load params (and the optimizer's state, step, hyper-parameters and
        loss scaler) from a checkpoint saved at any world size; collective.
        Returns {"dir", "step", "user_json", "bytes_read"}."""
        arr, n, keep = _param_array(params)
        o = _new_struct("zs_checkpoint_load_options")
        held = []
        o.tag = _cstr(tag, held)
        o.strict = 1 if strict else 0
        o.names = _name_array(names, n, held)
        o.progress, o.progress_user = _progress_callback(progress, held)
        info = _new_struct("zs_checkpoint_info")
        opt = ffi.NULL if optimizer is None else optimizer._h
        check(lib.zs_checkpoint_load(self._h, arr, n, opt, os.fsencode(path), o, info))
        out = {"dir": os.fsdecode(ffi.string(info.dir)), "step": int(info.step),
               "user_json": ffi.string(info.user_json).decode("utf-8"), "bytes_read": int(info.bytes_read)}
        if optimizer is not None:
            # The engine restored the groups' hyper-parameters; keep ours in step.
            with open(os.path.join(out["dir"], "manifest.json"), "r", encoding="utf-8") as f:
                groups = json.load(f)["optimizer"]["groups"]
            for i, g in enumerate(groups):
                h = g["hparams"]
                if i < len(optimizer._groups):
                    optimizer._groups[i] = dict(
                        lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                        weight_decay=h["weight_decay"], momentum=h["momentum"], dampening=h["dampening"],
                        nesterov=bool(h["nesterov"]), bias_correction=bool(h["bias_correction"]))
        return out

    def export_safetensors(self, out_file, params, names=None, progress=None):
        """One safetensors file of the full params (gathered one at a time,
        written by rank 0); collective."""
        arr, n, keep = _param_array(params)
        o = _new_struct("zs_export_options")
        held = []
        o.names = _name_array(names, n, held)
        o.progress, o.progress_user = _progress_callback(progress, held)
        check(lib.zs_export_safetensors(self._h, arr, n, os.fsencode(out_file), o))

    def load_safetensors(self, path, params, optimizer=None, names=None, strict=True, from_rank0=False,
                         progress=None):
        """Full tensors from a safetensors file, an HF index (.json) or a
        directory of them into partitioned params; each rank reads only its
        own shards' bytes. Collective."""
        arr, n, keep = _param_array(params)
        o = _new_struct("zs_safetensors_load_options")
        held = []
        o.names = _name_array(names, n, held)
        o.strict = 1 if strict else 0
        o.from_rank0 = 1 if from_rank0 else 0
        o.progress, o.progress_user = _progress_callback(progress, held)
        opt = ffi.NULL if optimizer is None else optimizer._h
        check(lib.zs_load_safetensors(self._h, arr, n, opt, os.fsencode(path), o))

    def optimizer(self, kind="adamw"):
        """A sharded optimizer: "adamw", "adam" or "sgd"."""
        k = _code(kind, _OPTIM_BY_NAME, "optimizer kind")
        out = ffi.new("zs_optimizer*")
        check(lib.zs_optimizer_create(out, self._h, k))
        name = kind if isinstance(kind, str) else {v: n for n, v in _OPTIM_BY_NAME.items()}.get(
            k, str(k))
        return Optimizer(self, out[0], name)
