/*
 * A program compiled against an older header: make_old_header.py drops the
 * last field(s) of every struct of today's header. Run as
 *
 *   old_caller grown   against zeroshard_abi_grown, a library whose structs
 *                      have grown past these: every call works, the fields
 *                      this program lacks take their defaults, and nothing
 *                      is written past its structs;
 *   old_caller strict  against today's library, whose first release these
 *                      structs predate: every call is refused, naming the
 *                      struct's size here and the library's minimum.
 *
 * World of one, no sockets.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zeroshard/zeroshard.h>

#ifndef ZS_TEST_OLD_HEADER
#error "old_caller must be compiled against make_old_header.py's header"
#endif

static int failures = 0;

#define EXPECT(cond, ...)                                             \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                   \
      fputc('\n', stderr);                                            \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

#define OK(call)                                                                         \
  do {                                                                                   \
    zs_status s_ = (call);                                                               \
    if (s_ != ZS_OK) {                                                                   \
      fprintf(stderr, "FATAL %s: %s: %s\n", #call, zs_status_string(s_), zs_last_error()); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

/* Output structs live at the start of a buffer of guard bytes: the library
 * may write only the struct's own size. */
#define GUARD_BYTE 0xAB
typedef union {
  unsigned char bytes[1024];
  double align_d;
  uint64_t align_u;
  void* align_p;
} guarded_buf;

static void* guarded(guarded_buf* b, size_t size) {
  memset(b->bytes, GUARD_BYTE, sizeof b->bytes);
  memcpy(b->bytes, &size, sizeof size); /* every struct starts with size */
  return b->bytes;
}

static void expect_guard(const guarded_buf* b, size_t size, const char* what) {
  for (size_t i = size; i < sizeof b->bytes; ++i)
    if (b->bytes[i] != GUARD_BYTE) {
      EXPECT(0, "%s: byte %zu past its %zu-byte struct was written", what, i, size);
      return;
    }
}

/* strict: refused with INVALID_ARGUMENT naming this struct's size and a
 * larger minimum. */
static void expect_refused(zs_status s, size_t size, const char* what) {
  char want[64];
  snprintf(want, sizeof want, "size is %zu, below ", size);
  const char* msg = zs_last_error();
  const char* at = strstr(msg, want);
  EXPECT(s == ZS_ERR_INVALID_ARGUMENT && at != NULL, "%s: got %s: '%s', expected '%s<min>'", what,
         zs_status_string(s), msg, want);
  if (at) {
    unsigned long min = strtoul(at + strlen(want), NULL, 10);
    EXPECT(min > size, "%s: minimum %lu is not above %zu", what, min, size);
  }
  printf("%s: refused: %s\n", what, msg);
}

/* Every zs_xxx_init with this header's size. */
#define INIT_CASE(T, strict)                                                 \
  do {                                                                       \
    guarded_buf b;                                                           \
    T* p = (T*)guarded(&b, sizeof(T));                                       \
    zs_status s = T##_init(p, sizeof(T));                                    \
    if (strict) {                                                            \
      expect_refused(s, sizeof(T), #T "_init");                              \
    } else {                                                                 \
      EXPECT(s == ZS_OK, #T "_init: %s", zs_last_error());                   \
      EXPECT(p->size == sizeof(T), #T "_init wrote size %zu", p->size);      \
      expect_guard(&b, sizeof(T), #T "_init");                               \
    }                                                                        \
  } while (0)

static void init_functions(int strict) {
  INIT_CASE(zs_context_options, strict);
  INIT_CASE(zs_param_options, strict);
  INIT_CASE(zs_optim_hparams, strict);
  INIT_CASE(zs_memory_stats, strict);
  INIT_CASE(zs_fetch_stats, strict);
  INIT_CASE(zs_param_info, strict);
  INIT_CASE(zs_step_result, strict);
  INIT_CASE(zs_coord_stats, strict);
  if (strict) return;
  /* The values the macros of this header give, field by field. */
  zs_context_options o;
  OK(zs_context_options_init(&o, sizeof o));
  EXPECT(o.rank == -1 && o.world_size == -1 && o.store_port == -1 && o.timeout_ms == 0 &&
             o.device == NULL,
         "zs_context_options_init's values differ from ZS_CONTEXT_OPTIONS_INIT");
  zs_optim_hparams h;
  OK(zs_optim_hparams_init(&h, sizeof h));
  EXPECT(h.lr == 1e-3 && h.beta1 == 0.9 && h.beta2 == 0.999 && h.eps == 1e-8 &&
             h.weight_decay == 0.01,
         "zs_optim_hparams_init's values differ from ZS_OPTIM_HPARAMS_INIT");
  zs_param_options po;
  OK(zs_param_options_init(&po, sizeof po));
  EXPECT(po.b == 1.0 && po.dtype == ZS_FLOAT32 && po.init == ZS_INIT_ZEROS,
         "zs_param_options_init's values differ from ZS_PARAM_OPTIONS_INIT");
}

static zs_context_options world_of_one(void) {
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT; /* no `backend` field here */
  o.rank = 0;
  o.world_size = 1;
  o.device = "cpu";
  return o;
}

static void strict_calls(void) {
  zs_context ctx = NULL;
  zs_context_options o = world_of_one();
  expect_refused(zs_context_create(&ctx, &o), sizeof o, "zs_context_create");
  zs_param_options po = ZS_PARAM_OPTIONS_INIT;
  zs_param p = NULL;
  expect_refused(zs_param_register(&p, NULL, &po), sizeof po, "zs_param_register");
  guarded_buf b;
  expect_refused(zs_context_memory(NULL, (zs_memory_stats*)guarded(&b, sizeof(zs_memory_stats))),
                 sizeof(zs_memory_stats), "zs_context_memory");
  expect_guard(&b, sizeof(size_t), "zs_context_memory refused");
  expect_refused(zs_context_fetch_stats(NULL, (zs_fetch_stats*)guarded(&b, sizeof(zs_fetch_stats))),
                 sizeof(zs_fetch_stats), "zs_context_fetch_stats");
  expect_guard(&b, sizeof(size_t), "zs_context_fetch_stats refused");
}

static void grown_calls(void) {
  zs_context ctx;
  zs_context_options o = world_of_one();
  OK(zs_context_create(&ctx, &o));
  const char* backend = NULL;
  OK(zs_context_device(ctx, NULL, NULL, &backend));
  /* backend defaulted to NULL: ZS_BACKEND, else gloo on the CPU. */
  const char* env = getenv("ZS_BACKEND");
  EXPECT(strcmp(backend, env && *env ? env : "gloo") == 0, "backend %s", backend);

  /* A 3x5 fp32 param from every rank's data; `group` is absent here, so it
   * is partitioned over the default group. */
  float w0[15];
  for (int i = 0; i < 15; ++i) w0[i] = 0.5f * (float)i;
  const int64_t shape[2] = {3, 5};
  zs_param_options po = ZS_PARAM_OPTIONS_INIT;
  po.name = "w";
  po.ndim = 2;
  po.shape = shape;
  po.init = ZS_INIT_FROM_ALL;
  po.data = w0;
  po.data_bytes = sizeof w0;
  zs_param p;
  OK(zs_param_register(&p, ctx, &po));

  guarded_buf b;
  zs_param_info* info = (zs_param_info*)guarded(&b, sizeof(zs_param_info));
  OK(zs_param_get_info(p, info));
  EXPECT(info->numel == 15 && info->ndim == 2 && info->shape[1] == 5 &&
             info->device_type == ZS_DEVICE_CPU && strcmp(info->name, "w") == 0,
         "param info: numel %llu ndim %d", (unsigned long long)info->numel, info->ndim);
  expect_guard(&b, sizeof(zs_param_info), "zs_param_get_info");

  zs_gather g;
  OK(zs_fetch(&g, ctx, &p, 1));
  OK(zs_gather_wait(g, ZS_WAIT_FOREVER));
  OK(zs_gather_destroy(g));
  zs_memory_stats* mem = (zs_memory_stats*)guarded(&b, sizeof(zs_memory_stats));
  OK(zs_context_memory(ctx, mem));
  EXPECT(mem->num_params == 1 && mem->shard_bytes == sizeof w0, "memory: %llu params, %llu shard bytes",
         (unsigned long long)mem->num_params, (unsigned long long)mem->shard_bytes);
  expect_guard(&b, sizeof(zs_memory_stats), "zs_context_memory");
  zs_fetch_stats* fs = (zs_fetch_stats*)guarded(&b, sizeof(zs_fetch_stats));
  OK(zs_context_fetch_stats(ctx, fs));
  EXPECT(fs->gathers == 1, "fetch stats: %llu gathers", (unsigned long long)fs->gathers);
  expect_guard(&b, sizeof(zs_fetch_stats), "zs_context_fetch_stats");
  OK(zs_release(ctx, &p, 1));

  /* AdamW, one step on a gradient of ones. This header's hparams lack
   * `bias_correction`; its default (1) makes the first step lr * g / |g|
   * = lr per element. Without it the step would be lr * 0.1 / sqrt(0.001). */
  zs_optimizer opt;
  OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = 0.1;
  hp.weight_decay = 0.0;
  OK(zs_optimizer_add_group(opt, &p, 1, &hp, NULL));
  float ones[15];
  for (int i = 0; i < 15; ++i) ones[i] = 1.0f;
  OK(zs_grad_push(p, ones, ZS_FLOAT32, sizeof ones));
  zs_step_result* r = (zs_step_result*)guarded(&b, sizeof(zs_step_result));
  OK(zs_optimizer_step(opt, r));
  EXPECT(r->skipped == 0 && fabs(r->grad_norm - sqrt(15.0)) < 1e-6 && r->loss_scale == 1.0,
         "step result: skipped %d, norm %g, scale %g", r->skipped, r->grad_norm, r->loss_scale);
  expect_guard(&b, sizeof(zs_step_result), "zs_optimizer_step");
  float w1[15];
  OK(zs_fetch(&g, ctx, &p, 1));
  OK(zs_gather_wait(g, ZS_WAIT_FOREVER));
  OK(zs_gather_destroy(g));
  OK(zs_param_copy_to(p, w1, sizeof w1));
  OK(zs_release(ctx, &p, 1));
  for (int i = 0; i < 15; ++i)
    EXPECT(fabsf(w1[i] - (w0[i] - 0.1f)) < 1e-5f, "w[%d] = %g after the step, expected %g", i,
           (double)w1[i], (double)(w0[i] - 0.1f));

  /* Last: the coordinator keeps this small param gathered (persistence). */
  zs_coord_stats* cs = (zs_coord_stats*)guarded(&b, sizeof(zs_coord_stats));
  OK(zs_step_begin(ctx));
  OK(zs_coord_fetch(ctx, &p, 1));
  OK(zs_coord_release(ctx, &p, 1));
  OK(zs_step_end(ctx));
  OK(zs_coord_get_stats(ctx, cs));
  EXPECT(cs->steps == 1 && cs->fetch_calls == 1, "coord stats: %llu steps, %llu fetch calls",
         (unsigned long long)cs->steps, (unsigned long long)cs->fetch_calls);
  expect_guard(&b, sizeof(zs_coord_stats), "zs_coord_get_stats");

  OK(zs_optimizer_destroy(opt));
  OK(zs_param_destroy(p));
  OK(zs_context_destroy(ctx));
}

int main(int argc, char** argv) {
  if (argc != 2 || (strcmp(argv[1], "grown") && strcmp(argv[1], "strict"))) {
    fprintf(stderr, "usage: old_caller grown|strict\n");
    return 2;
  }
  const int strict = strcmp(argv[1], "strict") == 0;
  printf("old header: context_options %zu, param_options %zu, optim_hparams %zu, memory_stats %zu, "
         "fetch_stats %zu, param_info %zu, step_result %zu, coord_stats %zu bytes\n",
         sizeof(zs_context_options), sizeof(zs_param_options), sizeof(zs_optim_hparams),
         sizeof(zs_memory_stats), sizeof(zs_fetch_stats), sizeof(zs_param_info),
         sizeof(zs_step_result), sizeof(zs_coord_stats));
  init_functions(strict);
  if (strict)
    strict_calls();
  else
    grown_calls();
  if (failures) {
    fprintf(stderr, "old_caller %s: %d failure(s)\n", argv[1], failures);
    return 1;
  }
  printf("old_caller %s: all checks passed\n", argv[1]);
  return 0;
}
