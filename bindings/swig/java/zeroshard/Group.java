package zeroshard;

import java.nio.ByteBuffer;

/** A process group (zs_group) for collectives on direct buffers. */
public final class Group implements AutoCloseable {
  private final Context context;
  private SWIGTYPE_p_zs_group_s handle;

  Group(Context context, SWIGTYPE_p_zs_group_s handle) {
    this.context = context;
    this.handle = handle;
  }

  public Context context() { return context; }

  private SWIGTYPE_p_zs_group_s handle() {
    if (handle == null) throw new IllegalStateException("group is closed");
    return handle;
  }

  public int rank() {
    int[] v = new int[1];
    ZsNative.zs_group_rank(handle(), v);
    return v[0];
  }

  public int size() {
    int[] v = new int[1];
    ZsNative.zs_group_size(handle(), v);
    return v[0];
  }

  /** Starts an allreduce of count elements; the Work keeps both buffers alive until it is waited for. */
  public Work allreduce(ByteBuffer send, ByteBuffer recv, long count, int dtype, int op) {
    SWIGTYPE_p_p_zs_work_s box = ZsNative.new_zs_work_box();
    try {
      ZsNative.zs_allreduce(box, handle(), send, recv, count, dtype, op);
      return new Work(ZsNative.zs_work_box_value(box), send, recv);
    } finally {
      ZsNative.delete_zs_work_box(box);
    }
  }

  /** Starts an allgather: recv holds size() * count elements. */
  public Work allgather(ByteBuffer send, ByteBuffer recv, long count, int dtype) {
    SWIGTYPE_p_p_zs_work_s box = ZsNative.new_zs_work_box();
    try {
      ZsNative.zs_allgather(box, handle(), send, recv, count, dtype);
      return new Work(ZsNative.zs_work_box_value(box), send, recv);
    } finally {
      ZsNative.delete_zs_work_box(box);
    }
  }

  public Work barrier() {
    SWIGTYPE_p_p_zs_work_s box = ZsNative.new_zs_work_box();
    try {
      ZsNative.zs_barrier(box, handle());
      return new Work(ZsNative.zs_work_box_value(box));
    } finally {
      ZsNative.delete_zs_work_box(box);
    }
  }

  @Override
  public void close() {
    if (handle != null) {
      SWIGTYPE_p_zs_group_s h = handle;
      handle = null;
      ZsNative.zs_group_destroy(h);
    }
  }
}
