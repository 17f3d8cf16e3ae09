"""Enums, dtypes and devices of the C API, and the library's version."""
from ._ffi import ffi, lib
from . import errors
from .errors import check


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
_OPTIM_BY_NAME = {"adamw": 0, "adam": 1, "sgd": 2, "external": 3, "muon": 4}
_PARAM_STATUS = {0: "NOT_AVAILABLE", 1: "INFLIGHT", 2: "AVAILABLE"}


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
