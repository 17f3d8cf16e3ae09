"""Params: Param, and the prebuilt arrays ParamArray and GradBatch."""
from ._ffi import ffi, lib
from .errors import check
from ._dlpack import _dlpack_capsule, dlpack_from_pointer
from ._handle import _Owned
from ._types import (DEVICE_CUDA, DTYPE_NAMES, FLOAT32, _DTYPE_SIZE, _PARAM_STATUS, device_string,
                     dtype_code)
from ._util import _address, _buffer, _new_struct


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
        self._layout_from(info)
        self.device_type = int(info.device_type)  # DEVICE_CPU or DEVICE_CUDA
        self.device_id = int(info.device_id)

    def _layout_from(self, info):
        self.shard_numel = int(info.shard_numel)
        self.padded_numel = int(info.padded_numel)
        self.shard_offset = int(info.shard_offset)
        self.shard_valid = int(info.shard_valid)

    def refresh_layout(self):
        """Read this rank's shard layout again: a shrink in memory or a
        regrow (docs/healing.md, section 4) lays every shard out anew over
        the live ranks."""
        self._layout_from(self._info())

    def _info(self):
        info = _new_struct("zs_param_info")
        check(lib.zs_param_get_info(self._h, info))
        return info

    @property
    def shard_version(self):
        """A count that moves on each time this rank's shard is rewritten
        other than by an optimizer's step (an update, a write, a load): a
        full copy gathered at one version is current while it stays."""
        return int(self._info().shard_version)

    def status_and_version(self):
        """(status, shard_version) from one engine call: whether a full copy
        kept from an earlier gather is still held and still current."""
        info = self._info()
        return _PARAM_STATUS.get(int(info.status), str(int(info.status))), int(info.shard_version)

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

    @property
    def grad_pushed(self):
        """Whether a gradient was pushed since the last optimizer step."""
        out = ffi.new("int*")
        check(lib.zs_grad_pushed(self._h, out))
        return bool(out[0])

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
