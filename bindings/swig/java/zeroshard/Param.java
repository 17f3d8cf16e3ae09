package zeroshard;

import java.nio.ByteBuffer;

/** A registered param (zs_param): its shard lives in the engine. */
public final class Param implements AutoCloseable {
  private final Context context; // kept so the context is not collected first
  private SWIGTYPE_p_zs_param_s handle;

  Param(Context context, SWIGTYPE_p_zs_param_s handle) {
    this.context = context;
    this.handle = handle;
  }

  public Context context() { return context; }

  /** The raw handle, for the low-level ZsNative functions. */
  public SWIGTYPE_p_zs_param_s handle() {
    if (handle == null) throw new IllegalStateException("param is closed");
    return handle;
  }

  static SWIGTYPE_p_p_zs_param_s array(Param[] params) {
    SWIGTYPE_p_p_zs_param_s arr = ZsNative.new_zs_param_array(Math.max(params.length, 1));
    for (int i = 0; i < params.length; ++i) ZsNative.zs_param_array_setitem(arr, i, params[i].handle());
    return arr;
  }

  public zs_param_info info() {
    zs_param_info i = new zs_param_info();
    ZsNative.zs_param_get_info(handle(), i);
    return i;
  }

  /** ZsNative.ZS_PARAM_NOT_AVAILABLE, ZS_PARAM_INFLIGHT or ZS_PARAM_AVAILABLE. */
  public int status() {
    int[] v = new int[1];
    ZsNative.zs_param_get_status(handle(), v);
    return v[0];
  }

  public long numel() {
    zs_param_info i = info();
    try {
      return i.getNumel();
    } finally {
      i.delete();
    }
  }

  /** Copies the gathered param (numel * dtype size bytes) into dst, a direct buffer. */
  public void copyTo(ByteBuffer dst, long bytes) { ZsNative.zs_param_copy_to(handle(), dst, bytes); }

  /** Hands this param's full gradient (bytes of dtype) to the engine. */
  public void pushGrad(ByteBuffer grad, int dtype, long bytes) { ZsNative.zs_grad_push(handle(), grad, dtype, bytes); }

  @Override
  public void close() {
    if (handle != null) {
      SWIGTYPE_p_zs_param_s h = handle;
      handle = null;
      ZsNative.zs_param_destroy(h);
    }
  }
}
