package zeroshard;

/** A fetch in flight (zs_gather). */
public final class Gather implements AutoCloseable {
  private SWIGTYPE_p_zs_gather_s handle;

  Gather(SWIGTYPE_p_zs_gather_s handle) { this.handle = handle; }

  private SWIGTYPE_p_zs_gather_s handle() {
    if (handle == null) throw new IllegalStateException("gather is closed");
    return handle;
  }

  /** Waits for the gather; timeoutMs ZsNative.ZS_WAIT_FOREVER (-1) waits for ever. */
  public void await(int timeoutMs) { ZsNative.zs_gather_wait(handle(), timeoutMs); }

  public void await() { await(ZsNative.ZS_WAIT_FOREVER); }

  public boolean done() {
    int[] d = new int[1];
    ZsNative.zs_gather_test(handle(), d);
    return d[0] != 0;
  }

  @Override
  public void close() {
    if (handle != null) {
      SWIGTYPE_p_zs_gather_s h = handle;
      handle = null;
      ZsNative.zs_gather_destroy(h);
    }
  }
}
