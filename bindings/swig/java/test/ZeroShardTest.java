/*
 * ctest java_swig: the SWIG Java binding against the engine.
 *  1. A world of one: a param registered from Java data, fetched, read back
 *     and released; errors arrive as ZeroShardException with the status and
 *     the engine's message (a bad config, a destroyed handle); AutoCloseable
 *     handles close twice without harm.
 *  2. examples/c/train_mlp and java/examples/TrainMlp under `zsrun -n 2`
 *     (AdamW 50 steps, long enough that (float) Math.sin in place of C's
 *     sinf would part the losses at step 22; SGD with clipping and
 *     accumulation, 6 steps): every rank-0 "step" line must be equal.
 * Paths come as system properties: zs.zsrun, zs.c_train_mlp, zs.java.
 */
import java.io.ByteArrayOutputStream;
import java.io.InputStream;
import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import zeroshard.*;

public final class ZeroShardTest {
  static int failures = 0;

  static void check(boolean ok, String what) {
    if (ok) {
      System.out.println("ok: " + what);
    } else {
      System.out.println("FAILED: " + what);
      ++failures;
    }
  }

  static Context worldOfOne() {
    zs_context_options o = new zs_context_options();
    try {
      o.setRank(0);
      o.setWorld_size(1);
      o.setDevice("cpu");
      return Context.create(o);
    } finally {
      o.delete();
    }
  }

  static void singleRank() {
    try (Context ctx = worldOfOne()) {
      check(ctx.rank() == 0 && ctx.worldSize() == 1, "a world of one: rank 0 of 1");
      String[] dev = ctx.device();
      check(dev[0].equals("cpu") && dev[1].equals("gloo"), "device cpu, backend gloo (got " + dev[0] + ", " + dev[1] + ")");
      check(ctx.configJson().contains("zero_optimization"), "the resolved config names zero_optimization");
      int[] major = new int[1], minor = new int[1], patch = new int[1];
      String version = ZsNative.zs_version(major, minor, patch);
      check(version.equals(major[0] + "." + minor[0] + "." + patch[0]) && major[0] == ZsNative.ZS_VERSION_MAJOR,
          "zs_version " + version);
      final int n = 12;
      ByteBuffer init = Context.buffer(4L * n);
      for (int i = 0; i < n; ++i) init.putFloat(4 * i, 0.5f * i - 1.0f);
      zs_param_options po = new zs_param_options();
      SWIGTYPE_p_long_long shape = ZsNative.new_int64_array(2);
      ZsNative.int64_array_setitem(shape, 0, 4);
      ZsNative.int64_array_setitem(shape, 1, 3);
      po.setName("w");
      po.setDtype(ZsNative.ZS_FLOAT32);
      po.setNdim(2);
      po.setShape(shape);
      po.setInit(ZsNative.ZS_INIT_FROM_ALL);
      po.setData(init);
      po.setData_bytes(4L * n);
      try (Param w = ctx.register(po)) {
        ZsNative.delete_int64_array(shape);
        po.delete();
        zs_param_info info = w.info();
        check(info.getNumel() == n && info.getNdim() == 2 && "w".equals(info.getName()),
            "param info: numel 12, ndim 2, name w (got " + info.getNumel() + ", " + info.getNdim() + ", "
                + info.getName() + ")");
        check(info.getStatus() == ZsNative.ZS_PARAM_NOT_AVAILABLE, "not gathered before the fetch");
        info.delete();

        // Reading before a fetch is the engine's INVALID_STATE, with its message.
        ByteBuffer out = Context.buffer(4L * n);
        try {
          w.copyTo(out, 4L * n);
          check(false, "copy_to before a fetch throws");
        } catch (ZeroShardException e) {
          check(e.status() == ZsNative.ZS_ERR_INVALID_STATE && !e.engineMessage().isEmpty(),
              "copy_to before a fetch: " + e.getMessage());
        }

        try (Gather g = ctx.fetch(w)) {
          g.await();
          check(g.done(), "the gather is done after await");
          check(w.status() == ZsNative.ZS_PARAM_AVAILABLE, "available after the gather");
          w.copyTo(out, 4L * n);
          ctx.release(w);
        }
        check(w.status() == ZsNative.ZS_PARAM_NOT_AVAILABLE, "not available after the release");
        boolean same = true;
        for (int i = 0; i < n; ++i) same &= out.getFloat(4 * i) == 0.5f * i - 1.0f;
        check(same, "fetched values equal the registered ones");

        // A wrong buffer size: BUFFER_SIZE naming the sizes.
        try (Gather g = ctx.fetch(w)) {
          g.await();
          try {
            w.copyTo(out, 4L * n - 4);
            check(false, "copy_to with a short buffer throws");
          } catch (ZeroShardException e) {
            check(e.status() == ZsNative.ZS_ERR_BUFFER_SIZE && e.getMessage().startsWith(e.statusName() + ": "),
                "copy_to with a short buffer: " + e.getMessage());
          } finally {
            ctx.release(w);
          }
        }

        // Collectives on the world group.
        try (Group wg = ctx.group(ZsNative.ZS_GROUP_WORLD)) {
          ByteBuffer v = Context.buffer(8);
          v.putFloat(0, 3.0f);
          v.putFloat(4, -2.0f);
          try (Work work = wg.allreduce(v, v, 2, ZsNative.ZS_FLOAT32, ZsNative.ZS_SUM)) {
            work.await();
          }
          check(wg.size() == 1 && v.getFloat(0) == 3.0f && v.getFloat(4) == -2.0f, "allreduce in a world of one");
        }

        // An optimizer step moves the param against its gradient.
        try (Optimizer opt = ctx.optimizer(ZsNative.ZS_OPTIM_SGD)) {
          zs_optim_hparams hp = new zs_optim_hparams();
          hp.setLr(0.5);
          hp.setWeight_decay(0.0);
          opt.addGroup(hp, w);
          hp.delete();
          ByteBuffer grad = Context.buffer(4L * n);
          for (int i = 0; i < n; ++i) grad.putFloat(4 * i, 1.0f);
          w.pushGrad(grad, ZsNative.ZS_FLOAT32, 4L * n);
          zs_step_result r = opt.step();
          check(r.getStep() == 1 && r.getSkipped() == 0, "one SGD step taken (step " + r.getStep() + ")");
          r.delete();
          try (Gather g = ctx.fetch(w)) {
            g.await();
            w.copyTo(out, 4L * n);
            ctx.release(w);
          }
          boolean moved = true;
          for (int i = 0; i < n; ++i) moved &= out.getFloat(4 * i) == 0.5f * i - 1.0f - 0.5f;
          check(moved, "SGD: w - lr * grad");
        }

        // A destroyed handle: INVALID_HANDLE through the low-level class, never a crash.
        SWIGTYPE_p_p_zs_param_s box = ZsNative.new_zs_param_box();
        zs_param_options p2 = new zs_param_options();
        p2.setName("gone");
        ZsNative.zs_param_register(box, ctx.handle(), p2);
        SWIGTYPE_p_zs_param_s gone = ZsNative.zs_param_box_value(box);
        ZsNative.delete_zs_param_box(box);
        p2.delete();
        ZsNative.zs_param_destroy(gone);
        zs_param_info i2 = new zs_param_info();
        try {
          ZsNative.zs_param_get_info(gone, i2);
          check(false, "a destroyed param throws");
        } catch (ZeroShardException e) {
          check(e.status() == ZsNative.ZS_ERR_INVALID_HANDLE, "a destroyed param: " + e.getMessage());
        } finally {
          i2.delete();
        }
        w.close(); // closing twice is a no-op
      }
      ctx.close();
    }

    // A bad config: INVALID_CONFIG naming its path.
    try {
      ZsNative.zs_config_check("{\"zero_optimization\": {\"stage\": 7}}", 1);
      check(false, "a bad config throws");
    } catch (ZeroShardException e) {
      check(e.status() == ZsNative.ZS_ERR_INVALID_CONFIG && e.statusName().equals(ZsNative.zs_status_string(e.status()))
              && e.engineMessage().contains("zero_optimization.stage"),
          "a bad config: " + e.getMessage());
    }
    ZsNative.zs_config_check("{\"zero_optimization\": {\"stage\": 3}}", 2); // no throw on ZS_OK
  }

  static List<String> stepLines(List<String> cmd, String what) throws Exception {
    ProcessBuilder pb = new ProcessBuilder(cmd).redirectErrorStream(true);
    pb.environment().put("ZS_DEVICE", "cpu");
    Process p = pb.start();
    ByteArrayOutputStream buf = new ByteArrayOutputStream();
    try (InputStream in = p.getInputStream()) {
      in.transferTo(buf);
    }
    int rc = p.waitFor();
    String text = buf.toString("UTF-8");
    if (rc != 0) {
      System.out.println(text);
      check(false, what + " exited with " + rc);
    }
    List<String> lines = new ArrayList<>();
    for (String l : text.split("\n"))
      if (l.contains("] step ")) lines.add(l);
    return lines;
  }

  static void trainMlp() throws Exception {
    String zsrun = System.getProperty("zs.zsrun"), c = System.getProperty("zs.c_train_mlp");
    String java = System.getProperty("zs.java", "java");
    String cp = System.getProperty("java.class.path"), lib = System.getProperty("java.library.path");
    List<List<String>> variants = List.of(List.of("--steps", "50"),
        List.of("--steps", "6", "--optimizer", "sgd", "--clip", "0.5", "--accum", "2"));
    for (List<String> args : variants) {
      List<String> cc = new ArrayList<>(Arrays.asList(zsrun, "-n", "2", "--", c));
      cc.addAll(args);
      List<String> jc = new ArrayList<>(Arrays.asList(zsrun, "-n", "2", "--", java, "-cp", cp,
          "-Djava.library.path=" + lib, "TrainMlp"));
      jc.addAll(args);
      List<String> cl = stepLines(cc, "the C train_mlp " + args);
      List<String> jl = stepLines(jc, "the Java TrainMlp " + args);
      boolean equal = !cl.isEmpty() && cl.equals(jl);
      if (!equal) {
        System.out.println("C:");
        cl.forEach(System.out::println);
        System.out.println("Java:");
        jl.forEach(System.out::println);
      }
      check(equal, "train_mlp " + args + " on 2 ranks: " + cl.size() + " step lines equal in C and Java"
          + (cl.isEmpty() ? "" : ", last: " + cl.get(cl.size() - 1)));
    }
  }

  public static void main(String[] argv) throws Exception {
    singleRank();
    if (argv.length == 0 || !argv[0].equals("--single")) trainMlp();
    if (failures > 0) {
      System.out.println(failures + " check(s) failed");
      System.exit(1);
    }
    System.out.println("all checks passed");
  }
}
