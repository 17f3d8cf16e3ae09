"""Exceptions for the engine's zs_status codes.

Every non-OK status becomes a ZeroShardError subclass whose message is the
engine's own (``zs_last_error()``), read right after the failing call on the
same thread (the message is thread-local in the engine).
"""
from ._ffi import ffi, lib

__all__ = [
    "ZeroShardError", "InvalidArgumentError", "InvalidHandleError", "InvalidStateError",
    "InvalidConfigError", "ZsOutOfMemoryError", "ZsTimeoutError", "CommError",
    "BootstrapError", "NotSupportedError", "BufferSizeError", "InternalError", "ZsIOError",
    "RankLostError", "StateLostError", "NotTakenError",
    "check", "error_class", "status_name", "ZeroShardConfigWarning",
]


def status_name(status):
    """The engine's name of a status code ("ZS_ERR_TIMEOUT")."""
    return ffi.string(lib.zs_status_string(int(status))).decode("ascii", "replace")


_name_of = status_name


class ZeroShardError(Exception):
    """A zeroshard call failed.

    ``status`` is the zs_status code, ``status_name`` its name
    ("ZS_ERR_INVALID_STATE"), and the message is the engine's.
    """

    status_code = None  # the status a subclass stands for

    def __init__(self, message="", status=None, status_name=None):
        if status is None:
            status = self.status_code if self.status_code is not None else -1
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.status_name = status_name if status_name is not None else _name_of(status)

    def __str__(self):
        return self.message

    def __reduce__(self):
        return (type(self), (self.message, self.status, self.status_name))


class InvalidArgumentError(ZeroShardError, ValueError):
    status_code = 1


class InvalidHandleError(ZeroShardError):
    status_code = 2


class InvalidStateError(ZeroShardError):
    status_code = 3


class InvalidConfigError(ZeroShardError, ValueError):
    status_code = 4


class ZsOutOfMemoryError(ZeroShardError, MemoryError):
    status_code = 5


class ZsTimeoutError(ZeroShardError, TimeoutError):
    status_code = 6


class CommError(ZeroShardError):
    status_code = 7


class BootstrapError(ZeroShardError):
    status_code = 8


class NotSupportedError(ZeroShardError, NotImplementedError):
    status_code = 9


class BufferSizeError(ZeroShardError, ValueError):
    status_code = 10


class InternalError(ZeroShardError):
    status_code = 11


class ZsIOError(ZeroShardError, OSError):
    """A file could not be read or written, or failed its checksum."""
    status_code = 12


class RankLostError(CommError):
    """Healing on: a rank stopped or died (its heartbeat fell silent); the
    message names it. Every later call of the context raises it too."""
    status_code = 13


class StateLostError(ZeroShardError):
    """Healing on: a shard's state and the copy of it were lost together (a
    rank and the rank holding its copy), or a rank was lost before its
    first copy landed (in the first step's seed); the message names both."""
    status_code = 14


class NotTakenError(ZeroShardError):
    """Healing, in a replacement: the survivors went on without its rank
    (they shrank in memory under zeroshard.healing.min_ranks), so there is
    nothing to join. Not a failure of the job: exit with ZS_EXIT_NOT_TAKEN."""
    status_code = 15


class ZeroShardConfigWarning(UserWarning):
    """A config key the engine accepts but does not act on yet (offload,
    NVMe aio, ZeRO++ quantization, ...). ``keys`` holds the engine's list:
    dicts with "key" (the JSON path as written), "value" and "reason"."""

    def __init__(self, message="", keys=()):
        super().__init__(message)
        self.keys = list(keys)


_CLASSES = {c.status_code: c for c in (
    InvalidArgumentError, InvalidHandleError, InvalidStateError, InvalidConfigError,
    ZsOutOfMemoryError, ZsTimeoutError, CommError, BootstrapError, NotSupportedError,
    BufferSizeError, InternalError, ZsIOError, RankLostError, StateLostError,
    NotTakenError)}


def error_class(status):
    """The exception class for a non-OK status (ZeroShardError if unknown)."""
    return _CLASSES.get(int(status), ZeroShardError)


def check(status):
    """Raise the matching ZeroShardError for a non-OK status, else return None.

    Call it directly on the status of the call that just returned, on the
    same thread: the message is the engine's thread-local zs_last_error().
    """
    if status == 0:
        return
    message = ffi.string(lib.zs_last_error()).decode("utf-8", "replace")
    status = int(status)
    raise error_class(status)(message, status, status_name(status))
