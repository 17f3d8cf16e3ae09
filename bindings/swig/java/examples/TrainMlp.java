/*
 * examples/c/train_mlp.c in Java over the SWIG binding: the same two-layer
 * MLP (the math of examples/c/mlp_model.h, in the same order, in float;
 * sin is C's sinf through the binding, as Java's differs in the last bit),
 * params registered sharded, gathered layer by layer and released,
 * gradients pushed last layer first, the sharded optimizer stepping. fp32
 * only. On rank 0 it prints the C program's per-step line:
 *   step N loss L grad_norm G loss_scale S
 *
 *   build/bin/zsrun -n 2 -- java -cp build/bindings/swig/classes \
 *       -Djava.library.path=build/lib TrainMlp [--steps 50] [--optimizer adamw|adam|sgd]
 *       [--lr 0.01] [--batch 24] [--clip C] [--accum K]
 */
import java.nio.ByteBuffer;
import java.nio.FloatBuffer;
import zeroshard.*;

public final class TrainMlp {
  static final int IN = 16, HIDDEN = 33, OUT = 5;
  static final int W1 = 0, B1 = 1, W2 = 2, B2 = 3, NPARAMS = 4;
  static final long[][] SHAPES = {{HIDDEN, IN}, {HIDDEN}, {OUT, HIDDEN}, {OUT}};
  static final String[] NAMES = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

  static int numel(int p) { return (int) (SHAPES[p][0] * (SHAPES[p].length == 2 ? SHAPES[p][1] : 1)); }

  static float noise(long x) {
    x += 0x9e3779b97f4a7c15L;
    x = (x ^ (x >>> 30)) * 0xbf58476d1ce4e5b9L;
    x = (x ^ (x >>> 27)) * 0x94d049bb133111ebL;
    x ^= x >>> 31;
    return (float) ((double) (x >>> 11) * 0x1.0p-52 - 1.0);
  }

  static void sample(int step, int index, float[] x, int xo, float[] y, int yo) {
    for (int k = 0; k < IN; ++k) x[xo + k] = noise(((long) step << 32) ^ ((long) index << 8) ^ (long) k);
    for (int j = 0; j < OUT; ++j) {
      float s = 0.0f;
      for (int k = 0; k < IN; ++k) s += noise(0xabcdL + (long) (j * IN + k)) * x[xo + k];
      y[yo + j] = ZsNative.zs_swig_c_sinf(s); // C's sinf: (float) Math.sin(s) differs in the last bit at times
    }
  }

  static void forward1(float[] w1, float[] b1, int step, int first, int count, float[] xs, float[] ys, float[] hs) {
    for (int s = 0; s < count; ++s) {
      sample(step, first + s, xs, s * IN, ys, s * OUT);
      for (int i = 0; i < HIDDEN; ++i) {
        float a = b1[i];
        for (int k = 0; k < IN; ++k) a += w1[i * IN + k] * xs[s * IN + k];
        hs[s * HIDDEN + i] = a > 0.0f ? a : 0.0f;
      }
    }
  }

  static float forward2(float[] w2, float[] b2, float[] hs, float[] ys, int count, float gradScale, float[] douts) {
    float loss = 0.0f;
    final float norm = 1.0f / (float) (count * OUT);
    for (int s = 0; s < count; ++s) {
      for (int j = 0; j < OUT; ++j) {
        float a = b2[j];
        for (int i = 0; i < HIDDEN; ++i) a += w2[j * HIDDEN + i] * hs[s * HIDDEN + i];
        final float d = a - ys[s * OUT + j];
        loss += d * d * norm;
        douts[s * OUT + j] = 2.0f * d * norm * gradScale;
      }
    }
    return loss;
  }

  static void backward2(float[] w2, float[] hs, float[] douts, int count, float[] gw2, float[] gb2, float[] dhs) {
    java.util.Arrays.fill(gw2, 0.0f);
    java.util.Arrays.fill(gb2, 0.0f);
    for (int s = 0; s < count; ++s) {
      for (int i = 0; i < HIDDEN; ++i) dhs[s * HIDDEN + i] = 0.0f;
      for (int j = 0; j < OUT; ++j) {
        final float dout = douts[s * OUT + j];
        gb2[j] += dout;
        for (int i = 0; i < HIDDEN; ++i) {
          gw2[j * HIDDEN + i] += dout * hs[s * HIDDEN + i];
          dhs[s * HIDDEN + i] += dout * w2[j * HIDDEN + i];
        }
      }
    }
  }

  static void backward1(float[] xs, float[] hs, float[] dhs, int count, float[] gw1, float[] gb1) {
    java.util.Arrays.fill(gw1, 0.0f);
    java.util.Arrays.fill(gb1, 0.0f);
    for (int s = 0; s < count; ++s) {
      for (int i = 0; i < HIDDEN; ++i) {
        if (hs[s * HIDDEN + i] <= 0.0f) continue;
        final float dh = dhs[s * HIDDEN + i];
        gb1[i] += dh;
        for (int k = 0; k < IN; ++k) gw1[i * IN + k] += dh * xs[s * IN + k];
      }
    }
  }

  /* Wait for a layer's gather, copy weight and bias out, release them. */
  static void gatherLayer(Context ctx, Gather g, Param[] params, int first, float[][] full, ByteBuffer staging) {
    try (g) {
      g.await();
      for (int k = first; k < first + 2; ++k) {
        staging.clear();
        params[k].copyTo(staging, 4L * numel(k));
        FloatBuffer f = staging.asFloatBuffer();
        f.get(full[k], 0, numel(k));
      }
      ctx.release(params[first], params[first + 1]);
    }
  }

  /* A layer's two gradients to the engine, bias first. */
  static void pushGrads(Param[] params, int first, float[][] grads, ByteBuffer[] scratch) {
    for (int k = first + 1; k >= first; --k) {
      scratch[k].clear();
      scratch[k].asFloatBuffer().put(grads[k], 0, numel(k));
      params[k].pushGrad(scratch[k], ZsNative.ZS_FLOAT32, 4L * numel(k));
    }
  }

  public static void main(String[] argv) {
    int steps = 50, batch = 24, accum = 1;
    double lr = 0.01, clip = 0.0;
    String optimizer = "adamw";
    for (int i = 0; i < argv.length; i += 2) {
      if (i + 1 >= argv.length) usage("an option lacks its value");
      String k = argv[i], v = argv[i + 1];
      switch (k) {
        case "--steps": steps = Integer.parseInt(v); break;
        case "--batch": batch = Integer.parseInt(v); break;
        case "--accum": accum = Integer.parseInt(v); break;
        case "--lr": lr = Double.parseDouble(v); break;
        case "--clip": clip = Double.parseDouble(v); break;
        case "--optimizer": optimizer = v; break;
        default: usage(k);
      }
    }
    final String config = "{\"zero_optimization\": {\"stage\": 3, \"mics_shard_size\": -1, \"zero_hpz_partition_size\": 1,"
        + " \"reduce_bucket_size\": 500000000}, \"bf16\": {\"enabled\": false}, \"fp16\": {\"enabled\": false,"
        + " \"initial_scale_power\": 12}, \"gradient_clipping\": " + CFormat.g(clip)
        + ", \"train_micro_batch_size_per_gpu\": \"auto\"}";
    final int kind = optimizer.equals("sgd") ? ZsNative.ZS_OPTIM_SGD
        : optimizer.equals("adam") ? ZsNative.ZS_OPTIM_ADAM : ZsNative.ZS_OPTIM_ADAMW;
    try (Context ctx = Context.fromEnv(config)) {
      final int rank = ctx.rank(), world = ctx.worldSize();
      if (batch % world != 0) usage("--batch must be a multiple of the world size");
      ctx.setAccumulationSteps(accum);
      Param[] params = new Param[NPARAMS];
      try {
        for (int p = 0; p < NPARAMS; ++p)
          params[p] = ctx.registerNormal(NAMES[p], ZsNative.ZS_FLOAT32, SHAPES[p], 100 + p, 0.0,
              SHAPES[p].length == 2 ? 1.0 / Math.sqrt((double) SHAPES[p][1]) : 0.1);
        try (Optimizer opt = ctx.optimizer(kind); Group wg = ctx.group(ZsNative.ZS_GROUP_WORLD)) {
          zs_optim_hparams hp = new zs_optim_hparams();
          hp.setLr(lr);
          hp.setMomentum(kind == ZsNative.ZS_OPTIM_SGD ? 0.9 : 0.0);
          opt.addGroup(hp, params[W1], params[W2]);
          hp.setWeight_decay(0.0);
          opt.addGroup(hp, params[B1], params[B2]);
          hp.delete();

          final int local = batch / world;
          float[][] full = new float[NPARAMS][], grads = new float[NPARAMS][];
          ByteBuffer[] scratch = new ByteBuffer[NPARAMS];
          int largest = 0;
          for (int p = 0; p < NPARAMS; ++p) {
            full[p] = new float[numel(p)];
            grads[p] = new float[numel(p)];
            scratch[p] = Context.buffer(4L * numel(p));
            largest = Math.max(largest, numel(p));
          }
          ByteBuffer staging = Context.buffer(4L * largest);
          float[] xs = new float[local * IN], ys = new float[local * OUT], hs = new float[local * HIDDEN];
          float[] douts = new float[local * OUT], dhs = new float[local * HIDDEN];
          ByteBuffer lossBuf = Context.buffer(4);
          for (int step = 0; step < steps; ++step) {
            float stepLoss = 0.0f;
            for (int micro = 0; micro < accum; ++micro) {
              final int dataStep = step * accum + micro;
              final double lossScale = opt.lossScale();
              Gather g1 = ctx.fetch(params[W1], params[B1]);
              Gather g2 = ctx.fetch(params[W2], params[B2]);
              gatherLayer(ctx, g1, params, W1, full, staging);
              forward1(full[W1], full[B1], dataStep, rank * local, local, xs, ys, hs);
              gatherLayer(ctx, g2, params, W2, full, staging);
              final float l = forward2(full[W2], full[B2], hs, ys, local, (float) lossScale, douts);
              gatherLayer(ctx, ctx.fetch(params[W2], params[B2]), params, W2, full, staging);
              backward2(full[W2], hs, douts, local, grads[W2], grads[B2], dhs);
              pushGrads(params, W2, grads, scratch);
              backward1(xs, hs, dhs, local, grads[W1], grads[B1]);
              pushGrads(params, W1, grads, scratch);
              stepLoss += l / (float) accum;
            }
            zs_step_result r = opt.step();
            lossBuf.clear();
            lossBuf.putFloat(0, stepLoss);
            try (Work w = wg.allreduce(lossBuf, lossBuf, 1, ZsNative.ZS_FLOAT32, ZsNative.ZS_AVG)) {
              w.await();
            }
            stepLoss = lossBuf.getFloat(0);
            if (rank == 0)
              System.out.println("step " + step + " loss " + CFormat.g(stepLoss, 9) + " grad_norm "
                  + CFormat.g(r.getGrad_norm(), 6) + " loss_scale " + CFormat.g(r.getLoss_scale())
                  + (r.getSkipped() != 0 ? " (skipped: overflow)" : ""));
            r.delete();
          }
        }
      } finally {
        for (Param p : params)
          if (p != null) p.close();
      }
    }
  }

  static void usage(String why) {
    System.err.println("TrainMlp: " + why + "\nusage: TrainMlp [--steps N] [--optimizer adamw|adam|sgd] [--lr LR]"
        + " [--batch B] [--clip C] [--accum K]");
    System.exit(2);
  }
}
