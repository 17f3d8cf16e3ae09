"""Process groups: Group and its collectives."""
from ._ffi import ffi, lib
from . import errors
from .errors import check
from ._handle import _Owned
from ._types import _DTYPE_SIZE, _OP_BY_NAME, _code, dtype_code
from ._util import _buffer
from .work import Work


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
