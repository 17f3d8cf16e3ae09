/*
 * Train a two-layer MLP on a synthetic regression task, entirely through
 * the C API: params registered sharded, gathered for compute and released,
 * gradients handed to the engine, and the sharded optimizer stepping.
 *
 *   build/bin/zsrun -n 4 -- build/bin/train_mlp [--steps 50] [--dtype fp32|bf16|fp16]
 *       [--optimizer adamw|adam|sgd] [--lr 0.01] [--batch 24] [--mics N] [--hpz N]
 *       [--clip C] [--accum K] [--bucket ELEMS] [--device cpu|cuda|cuda:N]
 *       [--qwz 0|8|4] [--qgz 0|8|4] [--loco BETA]
 *
 * --qwz gathers the weights quantized to 8- or 4-bit codes (ZeRO++ qwZ);
 * --qgz reduces the gradients as 8- or 4-bit codes over an all-to-all (qgZ).
 * --loco adds qgZ's LoCo error feedback with err_beta BETA (reset_T 1024).
 * Rank 0 prints "step N loss L" per step; the last line is one JSON object
 * with the final loss and every rank's memory for params, grads and
 * optimizer state.
 *
 * It heals (docs/healing.md): under `zsrun --restarts R` (which exports
 * ZS_HEAL=auto), a step that fails with ZS_ERR_RANK_LOST is agreed on
 * (zs_heal_agree), the replacement zsrun started is taken in (zs_heal_join),
 * and the run goes on from the committed step; the replacement, started
 * with ZS_HEAL_REPLACEMENT set, joins before its first step. A heal that
 * cannot be (ZS_ERR_STATE_LOST: a rank and the holder of its copy lost
 * together) exits with ZS_EXIT_STATE_LOST, and zsrun restarts the job; a
 * replacement the survivors went on without (ZS_ERR_NOT_TAKEN) exits with
 * ZS_EXIT_NOT_TAKEN.
 */
#include <math.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zeroshard/zeroshard.h>

#include "mlp_model.h"

/* What a launcher that heals reads from the exit: restart the job from disk
 * (a shard lost with its copy), or nothing to do (a replacement the
 * survivors shrank without, under zsrun --shrink --replacement-wait). */
static int exit_status(zs_status s) {
  if (s == ZS_ERR_STATE_LOST) return ZS_EXIT_STATE_LOST;
  if (s == ZS_ERR_NOT_TAKEN) return ZS_EXIT_NOT_TAKEN;
  return 1;
}

#define CHECK(call)                                                                         \
  do {                                                                                      \
    zs_status s_ = (call);                                                                  \
    if (s_ != ZS_OK) {                                                                      \
      fprintf(stderr, "%s failed: %s: %s\n", #call, zs_status_string(s_), zs_last_error()); \
      exit(exit_status(s_));                                                                \
    }                                                                                       \
  } while (0)

/* In a step, which a lost rank may cut short: the failure goes back to the
 * loop, which heals and runs the step again. */
#define TRY(call)              \
  do {                         \
    zs_status t_ = (call);     \
    if (t_ != ZS_OK) return t_; \
  } while (0)

typedef struct {
  int steps, batch, mics, hpz, accum, qwz, qgz;
  int pause_ms; /* after each step: a slower model, as healing's tests want */
  long bucket;
  double lr, clip, loco; /* loco < 0: off */
  const char* dtype;
  const char* optimizer;
  const char* device;
} args_t;

static void usage(const char* why) {
  fprintf(stderr, "train_mlp: %s\nusage: train_mlp [--steps N] [--dtype fp32|bf16|fp16] "
                  "[--optimizer adamw|adam|sgd] [--lr LR] [--batch B] [--mics N] [--hpz N] "
                  "[--clip C] [--accum K] [--bucket ELEMS] [--device cpu|cuda|cuda:N] "
                  "[--qwz 0|8|4] [--qgz 0|8|4] [--loco BETA] [--pause-ms MS]\n", why);
  exit(2);
}

static args_t parse_args(int argc, char** argv) {
  args_t a = {50, 24, 0, 0, 1, 0, 0, 0, 0, 0.01, 0.0, -1.0, "fp32", "adamw", NULL};
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) usage("an option lacks its value");
    const char* k = argv[i];
    const char* v = argv[i + 1];
    if (!strcmp(k, "--steps")) a.steps = atoi(v);
    else if (!strcmp(k, "--batch")) a.batch = atoi(v);
    else if (!strcmp(k, "--mics")) a.mics = atoi(v);
    else if (!strcmp(k, "--hpz")) a.hpz = atoi(v);
    else if (!strcmp(k, "--accum")) a.accum = atoi(v);
    else if (!strcmp(k, "--qwz")) a.qwz = atoi(v);
    else if (!strcmp(k, "--qgz")) a.qgz = atoi(v);
    else if (!strcmp(k, "--bucket")) a.bucket = atol(v);
    else if (!strcmp(k, "--lr")) a.lr = atof(v);
    else if (!strcmp(k, "--clip")) a.clip = atof(v);
    else if (!strcmp(k, "--loco")) a.loco = atof(v);
    else if (!strcmp(k, "--dtype")) a.dtype = v;
    else if (!strcmp(k, "--optimizer")) a.optimizer = v;
    else if (!strcmp(k, "--device")) a.device = v;
    else if (!strcmp(k, "--pause-ms")) a.pause_ms = atoi(v);
    else usage(k);
  }
  if (a.steps < 1 || a.batch < 1 || a.accum < 1) usage("steps, batch and accum must be >= 1");
  if (a.pause_ms < 0) usage("--pause-ms must be >= 0");
  if (strcmp(a.dtype, "fp32") && strcmp(a.dtype, "bf16") && strcmp(a.dtype, "fp16"))
    usage("--dtype must be fp32, bf16 or fp16");
  if (a.qwz != 0 && a.qwz != 8 && a.qwz != 4) usage("--qwz must be 0, 8 or 4");
  if (a.qgz != 0 && a.qgz != 8 && a.qgz != 4) usage("--qgz must be 0, 8 or 4");
  return a;
}

/* fp32 <-> the 16-bit formats, round to nearest even (finite values). */
static float bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float fp16_to_float(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float v = e == 0 ? ldexpf((float)m, -24) : (e == 31 ? INFINITY : ldexpf((float)(m | 0x400), e - 25));
  return (h & 0x8000) ? -v : v;
}
static uint16_t float_to_fp16(float f) {
  const uint16_t sign = signbit(f) ? 0x8000 : 0;
  float a = fabsf(f);
  if (!(a < 65520.0f)) return sign | 0x7c00; /* inf (or NaN as inf: overflow either way) */
  if (a < 6.103515625e-05f) return sign | (uint16_t)lrintf(a * 16777216.0f); /* subnormal */
  int e;
  const float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
  uint32_t mant = (uint32_t)lrintf(ldexpf(m, 11)); /* 11 bits incl. implicit one */
  if (mant == 2048) mant = 1024, ++e;
  return sign | (uint16_t)(((e + 14) << 10) | (mant & 0x3ff));
}

static void to_float(const void* src, zs_dtype t, float* dst, uint64_t n) {
  const uint16_t* h = (const uint16_t*)src;
  if (t == ZS_FLOAT32) memcpy(dst, src, n * 4);
  else for (uint64_t i = 0; i < n; ++i) dst[i] = t == ZS_BFLOAT16 ? bf16_to_float(h[i]) : fp16_to_float(h[i]);
}
static void from_float(const float* src, zs_dtype t, void* dst, uint64_t n) {
  uint16_t* h = (uint16_t*)dst;
  if (t == ZS_FLOAT32) memcpy(dst, src, n * 4);
  else for (uint64_t i = 0; i < n; ++i) h[i] = t == ZS_BFLOAT16 ? float_to_bf16(src[i]) : float_to_fp16(src[i]);
}

/* Wait for a layer's gather (weight and bias), copy it out as fp32, and
 * release it: the engine frees the full params right away. The params may
 * live on a GPU (--device cuda), so they are copied to the host, where this
 * example computes; on the CPU, zs_param_data would give them in place. */
static zs_status gather_layer(zs_context ctx, zs_gather g, const zs_param* layer, zs_dtype dtype, float** out,
                              void* staging) {
  zs_status s = zs_gather_wait(g, ZS_WAIT_FOREVER);
  for (int k = 0; k < 2 && s == ZS_OK; ++k) {
    zs_param_info info = ZS_PARAM_INFO_INIT;
    s = zs_param_get_info(layer[k], &info);
    if (s == ZS_OK) s = zs_param_copy_to(layer[k], staging, info.numel * (dtype == ZS_FLOAT32 ? 4 : 2));
    if (s == ZS_OK) to_float(staging, dtype, out[k], info.numel);
  }
  if (s == ZS_OK) s = zs_release(ctx, layer, 2);
  zs_gather_destroy(g);
  return s;
}

/* Hand a layer's two gradients (weight, bias) to the engine, bias last. */
static zs_status push_grads(const zs_param* layer, float* const* grads, void* const* scratch, zs_dtype dtype) {
  const size_t esize = dtype == ZS_FLOAT32 ? 4 : 2;
  for (int k = 1; k >= 0; --k) {
    zs_param_info info = ZS_PARAM_INFO_INIT;
    TRY(zs_param_get_info(layer[k], &info));
    from_float(grads[k], dtype, scratch[k], info.numel);
    TRY(zs_grad_push(layer[k], scratch[k], dtype, info.numel * esize));
  }
  return ZS_OK;
}

/* What a training step works with. */
typedef struct {
  zs_context ctx;
  zs_optimizer opt;
  zs_group world;
  zs_param params[MLP_NPARAMS];
  zs_dtype dtype;
  int rank, local, accum;
  void* staging;
  float* full[MLP_NPARAMS];
  float* grads[MLP_NPARAMS];
  void* grad16[MLP_NPARAMS];
  mlp_scratch scratch;
} trainer_t;

/* One optimizer step (accum micro-batches): *loss receives the step's loss
 * averaged over the ranks (before the update, so that a step committed
 * when a rank was lost in its update still has it), *r the step's result. */
static zs_status train_step(trainer_t* t, int step, float* loss, zs_step_result* r) {
  float step_loss = 0.0f;
  for (int micro = 0; micro < t->accum; ++micro) {
    const int data_step = step * t->accum + micro;
    double loss_scale = 1.0;
    TRY(zs_optimizer_loss_scale(t->opt, &loss_scale));
    /* Forward: fc1 (prefetching fc2), then fc2, each released at once. */
    zs_gather g1, g2;
    TRY(zs_fetch(&g1, t->ctx, &t->params[MLP_W1], 2));
    const zs_status s = zs_fetch(&g2, t->ctx, &t->params[MLP_W2], 2);
    if (s != ZS_OK) {
      zs_gather_destroy(g1);
      return s;
    }
    const zs_status s1 = gather_layer(t->ctx, g1, &t->params[MLP_W1], t->dtype, &t->full[MLP_W1], t->staging);
    if (s1 != ZS_OK) {
      zs_gather_destroy(g2);
      return s1;
    }
    mlp_forward1(t->full[MLP_W1], t->full[MLP_B1], data_step, t->rank * t->local, t->local, t->scratch.xs,
                 t->scratch.ys, t->scratch.hs);
    TRY(gather_layer(t->ctx, g2, &t->params[MLP_W2], t->dtype, &t->full[MLP_W2], t->staging));
    const float l = mlp_forward2(t->full[MLP_W2], t->full[MLP_B2], t->scratch.hs, t->scratch.ys, t->local,
                                 (float)loss_scale, t->scratch.douts);
    /* Backward: fc2 is gathered again (from the hpZ secondary shard when
     * configured); fc1's gradients need no params. Gradients go to the
     * engine as they are made, last layer first. */
    TRY(zs_fetch(&g2, t->ctx, &t->params[MLP_W2], 2));
    TRY(gather_layer(t->ctx, g2, &t->params[MLP_W2], t->dtype, &t->full[MLP_W2], t->staging));
    mlp_backward2(t->full[MLP_W2], t->scratch.hs, t->scratch.douts, t->local, t->grads[MLP_W2], t->grads[MLP_B2],
                  t->scratch.dhs);
    TRY(push_grads(&t->params[MLP_W2], &t->grads[MLP_W2], t->grad16 + MLP_W2, t->dtype));
    mlp_backward1(t->scratch.xs, t->scratch.hs, t->scratch.dhs, t->local, t->grads[MLP_W1], t->grads[MLP_B1]);
    TRY(push_grads(&t->params[MLP_W1], &t->grads[MLP_W1], t->grad16 + MLP_W1, t->dtype));
    step_loss += l / (float)t->accum;
  }
  zs_work w;
  TRY(zs_allreduce(&w, t->world, &step_loss, &step_loss, 1, ZS_FLOAT32, ZS_AVG));
  const zs_status s = zs_work_wait(w, ZS_WAIT_FOREVER);
  zs_work_destroy(w);
  if (s != ZS_OK) return s;
  *loss = step_loss;
  return zs_optimizer_step(t->opt, r);
}

int main(int argc, char** argv) {
  const args_t a = parse_args(argc, argv);
  const zs_dtype dtype = !strcmp(a.dtype, "bf16") ? ZS_BFLOAT16 : (!strcmp(a.dtype, "fp16") ? ZS_FLOAT16 : ZS_FLOAT32);
  const size_t esize = dtype == ZS_FLOAT32 ? 4 : 2;

  char loco[96] = "null";
  if (a.loco >= 0) snprintf(loco, sizeof loco, "{\"err_beta\": %g, \"reset_T\": 1024}", a.loco);
  char config[1280];
  snprintf(config, sizeof config,
           "{\"zero_optimization\": {\"stage\": 3, \"mics_shard_size\": %d, \"zero_hpz_partition_size\": %d,"
           " \"reduce_bucket_size\": %ld, \"zero_quantized_weights\": %s,"
           " \"zero_quantized_weights_bits\": %d, \"zero_quantized_gradients\": %s,"
           " \"zero_quantized_gradients_bits\": %d, \"zeropp_loco_param\": %s},"
           " \"bf16\": {\"enabled\": %s}, \"fp16\": {\"enabled\": %s, \"initial_scale_power\": 12},"
           " \"gradient_clipping\": %g, \"train_micro_batch_size_per_gpu\": \"auto\"}",
           a.mics > 0 ? a.mics : -1, a.hpz > 0 ? a.hpz : 1, a.bucket > 0 ? a.bucket : 500000000L,
           a.qwz ? "true" : "false", a.qwz ? a.qwz : 8, a.qgz ? "true" : "false", a.qgz ? a.qgz : 4, loco,
           dtype == ZS_BFLOAT16 ? "true" : "false", dtype == ZS_FLOAT16 ? "true" : "false", a.clip);
  zs_context ctx;
  zs_context_options opts = ZS_CONTEXT_OPTIONS_INIT;
  opts.config_json = config;
  opts.device = a.device; /* NULL: the engine's default (a GPU where there is one) */
  CHECK(zs_context_create(&ctx, &opts));
  int rank, world;
  CHECK(zs_context_rank(ctx, &rank));
  CHECK(zs_context_world_size(ctx, &world));
  if (a.batch % world != 0) {
    if (rank == 0) fprintf(stderr, "train_mlp: --batch %d must be a multiple of the world size %d\n", a.batch, world);
    return 2;
  }
  CHECK(zs_grad_set_accumulation_steps(ctx, a.accum));

  /* Seeded init: the same model on any number of ranks. */
  zs_param params[MLP_NPARAMS];
  for (int p = 0; p < MLP_NPARAMS; ++p) {
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    po.name = mlp_names[p];
    po.dtype = dtype;
    po.ndim = mlp_ndims[p];
    po.shape = mlp_shapes[p];
    po.init = ZS_INIT_NORMAL;
    po.seed = 100 + (uint64_t)p;
    po.a = 0.0;
    po.b = mlp_ndims[p] == 2 ? 1.0 / sqrt((double)mlp_shapes[p][1]) : 0.1;
    CHECK(zs_param_register(&params[p], ctx, &po));
  }

  /* No weight decay on biases: a second param group. */
  zs_optimizer opt;
  const zs_optimizer_kind kind = !strcmp(a.optimizer, "sgd") ? ZS_OPTIM_SGD : (!strcmp(a.optimizer, "adam") ? ZS_OPTIM_ADAM : ZS_OPTIM_ADAMW);
  CHECK(zs_optimizer_create(&opt, ctx, kind));
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = a.lr;
  hp.momentum = kind == ZS_OPTIM_SGD ? 0.9 : 0.0;
  zs_param weights[2] = {params[MLP_W1], params[MLP_W2]}, biases[2] = {params[MLP_B1], params[MLP_B2]};
  CHECK(zs_optimizer_add_group(opt, weights, 2, &hp, NULL));
  hp.weight_decay = 0.0;
  CHECK(zs_optimizer_add_group(opt, biases, 2, &hp, NULL));

  zs_group wg;
  CHECK(zs_context_group(&wg, ctx, ZS_GROUP_WORLD));
  uint64_t largest = 0;
  for (int p = 0; p < MLP_NPARAMS; ++p) largest = mlp_numel(p) > largest ? mlp_numel(p) : largest;
  trainer_t t;
  t.ctx = ctx;
  t.opt = opt;
  t.world = wg;
  memcpy(t.params, params, sizeof params);
  t.dtype = dtype;
  t.rank = rank;
  t.local = a.batch / world;
  t.accum = a.accum;
  t.staging = malloc(largest * 4);
  for (int p = 0; p < MLP_NPARAMS; ++p) {
    t.full[p] = malloc(mlp_numel(p) * 4);
    t.grads[p] = malloc(mlp_numel(p) * 4);
    t.grad16[p] = malloc(mlp_numel(p) * esize);
  }
  t.scratch = mlp_scratch_new(t.local);
  float loss = 0.0f;
  int skipped = 0;
  uint64_t allocs_after_first = 0;
  int step = 0;
  const char* replacement = getenv("ZS_HEAL_REPLACEMENT");
  if (replacement && *replacement && strcmp(replacement, "0")) {
    /* A replacement of a lost rank: its state comes from the peers' copy,
     * and it starts at the step the survivors committed. */
    int64_t committed = 0;
    CHECK(zs_heal_join(&committed, opt));
    fprintf(stderr, "train_mlp: rank %d replaced a lost rank and joined at step %lld\n", rank, (long long)committed);
    step = (int)committed;
  }
  while (step < a.steps) {
    float step_loss = NAN;
    zs_step_result r = ZS_STEP_RESULT_INIT;
    const zs_status s = train_step(&t, step, &step_loss, &r);
    if (s == ZS_ERR_RANK_LOST) {
      /* A rank was lost: agree on the committed step, take its replacement
       * in, and go on from there (the step again, or the next one when it
       * committed). */
      fprintf(stderr, "train_mlp: rank %d: step %d: %s\n", rank, step, zs_last_error());
      int64_t committed = 0;
      CHECK(zs_heal_agree(&committed, NULL, opt));
      CHECK(zs_heal_join(&committed, opt));
      if (rank == 0) fprintf(stderr, "train_mlp: healed; the run goes on after step %lld\n", (long long)committed);
      if (committed == step + 1 && rank == 0) printf("step %d loss %.9g (committed while a rank was lost)\n", step, step_loss);
      if (committed == step + 1) loss = step_loss;
      step = (int)committed;
      continue;
    }
    CHECK(s);
    skipped += r.skipped;
    loss = step_loss;
    if (step == 0) { /* the device pool is warm now: later steps should reuse its blocks */
      zs_memory_stats m1 = ZS_MEMORY_STATS_INIT;
      CHECK(zs_context_memory(ctx, &m1));
      allocs_after_first = m1.device_system_allocs;
    }
    if (rank == 0)
      printf("step %d loss %.9g grad_norm %.6g loss_scale %g%s\n", step, loss, r.grad_norm, r.loss_scale,
             r.skipped ? " (skipped: overflow)" : "");
    fflush(stdout);
    ++step;
    if (a.pause_ms > 0) {
      const struct timespec pause = {a.pause_ms / 1000, (long)(a.pause_ms % 1000) * 1000000L};
      nanosleep(&pause, NULL);
    }
  }

  /* Every rank's memory, gathered on rank 0 for one JSON line. */
  zs_memory_stats m = ZS_MEMORY_STATS_INIT;
  CHECK(zs_context_memory(ctx, &m));
  zs_fetch_stats fs = ZS_FETCH_STATS_INIT;
  CHECK(zs_context_fetch_stats(ctx, &fs));
  /* Over the live ranks: fewer than were started after a shrink. */
  int live = 0;
  CHECK(zs_group_size(wg, &live));
  uint64_t mine[5] = {m.shard_bytes, m.grad_bytes, m.optimizer_bytes, m.unsharded_bytes, (uint64_t)rank};
  uint64_t* all = malloc(sizeof mine * (size_t)live);
  zs_work w;
  CHECK(zs_allgather(&w, wg, mine, all, sizeof mine, ZS_UINT8));
  CHECK(zs_work_wait(w, ZS_WAIT_FOREVER));
  CHECK(zs_work_destroy(w));
  zs_device_type dev_type;
  int dev_id;
  const char* backend;
  CHECK(zs_context_device(ctx, &dev_type, &dev_id, &backend));
  char dev_name[32] = "cpu";
  if (dev_type == ZS_DEVICE_CUDA) snprintf(dev_name, sizeof dev_name, "cuda:%d", dev_id);
  if (rank == 0) {
    printf("{\"example\":\"train_mlp\",\"ranks\":%d,\"dtype\":\"%s\",\"optimizer\":\"%s\",\"steps\":%d,"
           "\"device\":\"%s\",\"backend\":\"%s\",\"device_system_allocs_after_step0\":%llu,"
           "\"device_system_allocs_at_end\":%llu,"
           "\"skipped_steps\":%d,\"final_loss\":%.9g,\"gathers\":%llu,\"hpz_gathers\":%llu,"
           "\"unsharded_param_bytes\":%llu,\"per_rank\":[",
           world, a.dtype, a.optimizer, a.steps, dev_name, backend,
           (unsigned long long)allocs_after_first, (unsigned long long)m.device_system_allocs, skipped, loss,
           (unsigned long long)fs.gathers, (unsigned long long)fs.hpz_gathers, (unsigned long long)all[3]);
    for (int i = 0; i < live; ++i) {
      const uint64_t* of = all + 5 * i;
      printf("%s{\"rank\":%llu,\"param_bytes\":%llu,\"grad_bytes\":%llu,\"optimizer_bytes\":%llu}", i ? "," : "",
             (unsigned long long)of[4], (unsigned long long)of[0], (unsigned long long)of[1],
             (unsigned long long)of[2]);
    }
    printf("]}\n");
  }
  for (int p = 0; p < MLP_NPARAMS; ++p) {
    free(t.full[p]);
    free(t.grads[p]);
    free(t.grad16[p]);
  }
  free(all);
  free(t.staging);
  mlp_scratch_free(&t.scratch);
  CHECK(zs_group_destroy(wg));
  CHECK(zs_optimizer_destroy(opt));
  CHECK(zs_context_destroy(ctx));
  return 0;
}
