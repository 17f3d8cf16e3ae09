"""Handle ownership: the base of every object owning an engine handle."""
from ._ffi import lib
from .errors import check
from ._util import _finalizing


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
