"""Small helpers shared by the binding's objects: C strings, caller buffers,
stats structs, name arrays, progress callbacks."""
import os
import sys

from ._ffi import ffi, lib
from . import errors
from .errors import check


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


def _finalizing():
    try:
        return sys.is_finalizing()
    except Exception:  # pragma: no cover - sys half torn down
        return True
