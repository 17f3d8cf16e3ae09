package zeroshard;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;

/**
 * A zs_context: one rank's engine. Close it after the params, groups and
 * optimizers made from it (try-with-resources closes in reverse order).
 */
public final class Context implements AutoCloseable {
  private SWIGTYPE_p_zs_context_s handle;

  private Context(SWIGTYPE_p_zs_context_s handle) { this.handle = handle; }

  /** A context from these options (new zs_context_options() has the library's defaults). */
  public static Context create(zs_context_options options) {
    SWIGTYPE_p_p_zs_context_s box = ZsNative.new_zs_context_box();
    try {
      ZsNative.zs_context_create(box, options);
      return new Context(ZsNative.zs_context_box_value(box));
    } finally {
      ZsNative.delete_zs_context_box(box);
    }
  }

  /** Rank and world from the environment (zsrun, torchrun), with this DeepSpeed JSON config (may be null). */
  public static Context fromEnv(String configJson) {
    zs_context_options o = new zs_context_options();
    try {
      if (configJson != null) o.setConfig_json(configJson);
      return create(o);
    } finally {
      o.delete();
    }
  }

  /** The raw handle, for the low-level ZsNative functions. */
  public SWIGTYPE_p_zs_context_s handle() {
    if (handle == null) throw new IllegalStateException("context is closed");
    return handle;
  }

  public int rank() {
    int[] v = new int[1];
    ZsNative.zs_context_rank(handle(), v);
    return v[0];
  }

  public int worldSize() {
    int[] v = new int[1];
    ZsNative.zs_context_world_size(handle(), v);
    return v[0];
  }

  /** The resolved DeepSpeed config as JSON. */
  public String configJson() {
    String[] v = new String[1];
    ZsNative.zs_context_config_json(handle(), v);
    return v[0];
  }

  /** Where the engine keeps this rank's memory, "cpu" or "cuda:N", and the collective backend: {device, backend}. */
  public String[] device() {
    int[] type = new int[1], id = new int[1];
    String[] backend = new String[1];
    ZsNative.zs_context_device(handle(), type, id, backend);
    return new String[] {type[0] == ZsNative.ZS_DEVICE_CUDA ? "cuda:" + id[0] : "cpu", backend[0]};
  }

  public void setAccumulationSteps(int steps) { ZsNative.zs_grad_set_accumulation_steps(handle(), steps); }

  public zs_memory_stats memory() {
    zs_memory_stats m = new zs_memory_stats();
    ZsNative.zs_context_memory(handle(), m);
    return m;
  }

  /** A predefined group (ZsNative.ZS_GROUP_WORLD, ...). */
  public Group group(int kind) {
    SWIGTYPE_p_p_zs_group_s box = ZsNative.new_zs_group_box();
    try {
      ZsNative.zs_context_group(box, handle(), kind);
      return new Group(this, ZsNative.zs_group_box_value(box));
    } finally {
      ZsNative.delete_zs_group_box(box);
    }
  }

  /** Registers a param (collective: same order on every rank). */
  public Param register(zs_param_options options) {
    SWIGTYPE_p_p_zs_param_s box = ZsNative.new_zs_param_box();
    try {
      ZsNative.zs_param_register(box, handle(), options);
      return new Param(this, ZsNative.zs_param_box_value(box));
    } finally {
      ZsNative.delete_zs_param_box(box);
    }
  }

  /** Registers a param of this shape, initialized N(mean, std^2) from seed. */
  public Param registerNormal(String name, int dtype, long[] shape, long seed, double mean, double std) {
    zs_param_options o = new zs_param_options();
    SWIGTYPE_p_long_long dims = ZsNative.new_int64_array(Math.max(shape.length, 1));
    try {
      for (int i = 0; i < shape.length; ++i) ZsNative.int64_array_setitem(dims, i, shape[i]);
      o.setName(name);
      o.setDtype(dtype);
      o.setNdim(shape.length);
      o.setShape(dims);
      o.setInit(ZsNative.ZS_INIT_NORMAL);
      o.setSeed(seed);
      o.setA(mean);
      o.setB(std);
      return register(o);
    } finally {
      ZsNative.delete_int64_array(dims);
      o.delete();
    }
  }

  public Optimizer optimizer(int kind) {
    SWIGTYPE_p_p_zs_optimizer_s box = ZsNative.new_zs_optimizer_box();
    try {
      ZsNative.zs_optimizer_create(box, handle(), kind);
      return new Optimizer(this, ZsNative.zs_optimizer_box_value(box));
    } finally {
      ZsNative.delete_zs_optimizer_box(box);
    }
  }

  /** Starts gathering these params (collective); wait on the Gather, read, then release. */
  public Gather fetch(Param... params) {
    SWIGTYPE_p_p_zs_param_s arr = Param.array(params);
    SWIGTYPE_p_p_zs_gather_s box = ZsNative.new_zs_gather_box();
    try {
      ZsNative.zs_fetch(box, handle(), arr, params.length);
      return new Gather(ZsNative.zs_gather_box_value(box));
    } finally {
      ZsNative.delete_zs_gather_box(box);
      ZsNative.delete_zs_param_array(arr);
    }
  }

  /** Gives the full params back; the engine frees them. */
  public void release(Param... params) {
    SWIGTYPE_p_p_zs_param_s arr = Param.array(params);
    try {
      ZsNative.zs_release(handle(), arr, params.length);
    } finally {
      ZsNative.delete_zs_param_array(arr);
    }
  }

  /** A direct buffer in native byte order, as the engine reads and writes memory. */
  public static ByteBuffer buffer(long bytes) {
    return ByteBuffer.allocateDirect((int) bytes).order(ByteOrder.nativeOrder());
  }

  @Override
  public void close() {
    if (handle != null) {
      SWIGTYPE_p_zs_context_s h = handle;
      handle = null;
      ZsNative.zs_context_destroy(h);
    }
  }
}
