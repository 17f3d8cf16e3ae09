/*
 * A small "model" of a few dozen parameters, partitioned over every rank.
 * Each layer is gathered in turn (the next one prefetched while the current
 * one is checked), checked against the values it was registered with, and
 * released. Each rank prints its shard memory next to the unsharded size.
 *
 *   build/bin/zsrun -n 4 -- build/bin/gather_layers
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zeroshard/zeroshard.h>

#define CHECK(call)                                                              \
  do {                                                                           \
    zs_status s_ = (call);                                                       \
    if (s_ != ZS_OK) {                                                           \
      fprintf(stderr, "%s failed: %s: %s\n", #call, zs_status_string(s_), zs_last_error()); \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

enum { LAYERS = 8, PER_LAYER = 4, HIDDEN = 96, VOCAB = 1000 };

/* The value every rank expects at element i of param p. */
static float expected_value(int p, uint64_t i) { return (float)p + (float)(i % 1024) / 1024.0f; }

int main(void) {
  zs_context ctx;
  zs_context_options opts = ZS_CONTEXT_OPTIONS_INIT;
  opts.config_json = "{\"zero_optimization\": {\"stage\": 3}, \"train_batch_size\": \"auto\"}";
  CHECK(zs_context_create(&ctx, &opts));
  int rank, world;
  CHECK(zs_context_rank(ctx, &rank));
  CHECK(zs_context_world_size(ctx, &world));

  /* Per layer: weight [HIDDEN, HIDDEN+layer] (odd sizes), bias, norm
   * weight and norm bias; plus an embedding. Rank 0 holds the values. */
  zs_param params[LAYERS * PER_LAYER + 1];
  int n = 0;
  for (int l = 0; l <= LAYERS; ++l) {
    for (int k = 0; k < (l == LAYERS ? 1 : PER_LAYER); ++k) {
      int64_t shape[2] = {HIDDEN, k == 0 ? HIDDEN + l : 1};
      if (l == LAYERS) shape[0] = VOCAB, shape[1] = HIDDEN; /* embedding */
      const int ndim = (k == 0 || l == LAYERS) ? 2 : 1;
      const uint64_t numel = (uint64_t)shape[0] * (uint64_t)(ndim == 2 ? shape[1] : 1);
      float* init = NULL;
      if (rank == 0) {
        init = malloc(numel * sizeof(float));
        for (uint64_t i = 0; i < numel; ++i) init[i] = expected_value(n, i);
      }
      char name[64];
      snprintf(name, sizeof name, "layer%d.p%d", l, k);
      zs_param_options po = ZS_PARAM_OPTIONS_INIT;
      po.name = name;
      po.dtype = ZS_FLOAT32;
      po.ndim = ndim;
      po.shape = shape;
      po.init = ZS_INIT_FROM_RANK;
      po.src_rank = 0;
      po.data = init;
      po.data_bytes = rank == 0 ? numel * sizeof(float) : 0;
      CHECK(zs_param_register(&params[n], ctx, &po));
      free(init); /* the engine kept only this rank's shard */
      ++n;
    }
  }

  /* Walk the layers: prefetch layer l+1 while checking layer l. */
  zs_gather next = NULL;
  CHECK(zs_fetch(&next, ctx, &params[0], PER_LAYER));
  int bad = 0;
  for (int l = 0; l < LAYERS; ++l) {
    zs_gather cur = next;
    next = NULL;
    if (l + 1 < LAYERS) CHECK(zs_fetch(&next, ctx, &params[(l + 1) * PER_LAYER], PER_LAYER));
    CHECK(zs_gather_wait(cur, ZS_WAIT_FOREVER));
    for (int k = 0; k < PER_LAYER; ++k) {
      const int p = l * PER_LAYER + k;
      zs_param_info info = ZS_PARAM_INFO_INIT;
      float* data;
      float* host_copy = NULL;
      CHECK(zs_param_get_info(params[p], &info));
      if (info.device_type == ZS_DEVICE_CPU) { /* read in place */
        CHECK(zs_param_data(params[p], (void**)&data));
      } else { /* GPU memory: copy it out to check it here */
        host_copy = malloc(info.numel * sizeof(float));
        CHECK(zs_param_copy_to(params[p], host_copy, info.numel * sizeof(float)));
        data = host_copy;
      }
      for (uint64_t i = 0; i < info.numel; ++i)
        if (fabsf(data[i] - expected_value(p, i)) != 0.0f) ++bad;
      free(host_copy);
    }
    CHECK(zs_release(ctx, &params[l * PER_LAYER], PER_LAYER));
    CHECK(zs_gather_destroy(cur));
  }

  zs_memory_stats mem = ZS_MEMORY_STATS_INIT;
  CHECK(zs_context_memory(ctx, &mem));
  printf("rank %d/%d: %d params, shards %.1f KiB of %.1f KiB unsharded (%.2fx less), "
         "peak gathered %.1f KiB, %d wrong values\n",
         rank, world, (int)mem.num_params, mem.shard_bytes / 1024.0, mem.unsharded_bytes / 1024.0,
         (double)mem.unsharded_bytes / (double)mem.shard_bytes, mem.peak_gathered_bytes / 1024.0,
         bad);
  for (int i = 0; i < n; ++i) CHECK(zs_param_destroy(params[i]));
  CHECK(zs_context_destroy(ctx));
  return bad == 0 ? 0 : 1;
}
