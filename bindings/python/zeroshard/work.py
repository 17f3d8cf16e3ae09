"""Asynchronous work: Work and Gather."""
from ._ffi import ffi, lib
from .errors import check
from ._handle import _Owned
from ._types import WAIT_FOREVER


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
