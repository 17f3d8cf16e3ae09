package zeroshard;

/**
 * A collective in flight (zs_work). It holds the buffers the engine reads
 * and writes; close() waits for the collective before destroying it, so
 * those buffers are never freed under the engine.
 */
public final class Work implements AutoCloseable {
  private SWIGTYPE_p_zs_work_s handle;
  @SuppressWarnings("unused")
  private Object[] buffers;
  private boolean waited;

  Work(SWIGTYPE_p_zs_work_s handle, Object... buffers) {
    this.handle = handle;
    this.buffers = buffers;
  }

  private SWIGTYPE_p_zs_work_s handle() {
    if (handle == null) throw new IllegalStateException("work is closed");
    return handle;
  }

  public void await(int timeoutMs) {
    ZsNative.zs_work_wait(handle(), timeoutMs);
    waited = true;
  }

  public void await() { await(ZsNative.ZS_WAIT_FOREVER); }

  public boolean done() {
    int[] d = new int[1];
    ZsNative.zs_work_test(handle(), d);
    return d[0] != 0;
  }

  @Override
  public void close() {
    if (handle != null) {
      try {
        if (!waited) ZsNative.zs_work_wait(handle, ZsNative.ZS_WAIT_FOREVER);
      } finally {
        SWIGTYPE_p_zs_work_s h = handle;
        handle = null;
        buffers = null;
        ZsNative.zs_work_destroy(h);
      }
    }
  }
}
