package zeroshard;

/** A sharded optimizer (zs_optimizer) over param groups. */
public final class Optimizer implements AutoCloseable {
  private final Context context;
  private SWIGTYPE_p_zs_optimizer_s handle;

  Optimizer(Context context, SWIGTYPE_p_zs_optimizer_s handle) {
    this.context = context;
    this.handle = handle;
  }

  public Context context() { return context; }

  private SWIGTYPE_p_zs_optimizer_s handle() {
    if (handle == null) throw new IllegalStateException("optimizer is closed");
    return handle;
  }

  /** Adds a param group with these hyperparameters (new zs_optim_hparams() has the defaults); returns its index. */
  public int addGroup(zs_optim_hparams hparams, Param... params) {
    SWIGTYPE_p_p_zs_param_s arr = Param.array(params);
    int[] index = new int[1];
    try {
      ZsNative.zs_optimizer_add_group(handle(), arr, params.length, hparams, index);
      return index[0];
    } finally {
      ZsNative.delete_zs_param_array(arr);
    }
  }

  public void setLr(int group, double lr) { ZsNative.zs_optimizer_set_lr(handle(), group, lr); }

  /** One step (collective); the caller deletes the result or lets it be collected. */
  public zs_step_result step() {
    zs_step_result r = new zs_step_result();
    ZsNative.zs_optimizer_step(handle(), r);
    return r;
  }

  public double lossScale() {
    double[] v = new double[1];
    ZsNative.zs_optimizer_loss_scale(handle(), v);
    return v[0];
  }

  @Override
  public void close() {
    if (handle != null) {
      SWIGTYPE_p_zs_optimizer_s h = handle;
      handle = null;
      ZsNative.zs_optimizer_destroy(h);
    }
  }
}
