/*
 * zeroshard — a ZeRO-3 engine behind a stable C ABI.
 *
 * Conventions (all functions):
 *  - Every function returns zs_status; ZS_OK is 0. On any other status,
 *    zs_last_error() returns this thread's message, which names what was
 *    wrong and with which value.
 *  - Output parameters come first. zs_xxx_create/_register/fetch give the
 *    caller ownership of a handle; zs_xxx_destroy takes it back and accepts
 *    NULL. A stale, destroyed or foreign handle gives ZS_ERR_INVALID_HANDLE,
 *    never a crash; handle values are never reused within a process.
 *  - Structs that cross the ABI start with their `size`; fill them with the
 *    matching ZS_XXX_INIT macro, or the zs_xxx_init(s, sizeof *s) function
 *    where macros cannot be used, then set the fields you need. Later
 *    releases only append fields: the library reads and writes the first
 *    `size` bytes of a caller's struct and gives the fields after them
 *    their defaults, so a program compiled against an older header keeps
 *    working. A size below the struct's size in the first release (0.1), or
 *    above the size the library knows (a newer header than the library), is
 *    INVALID_ARGUMENT naming both sizes.
 *  - Asynchronous work returns a handle with _wait (blocking, with a
 *    timeout) and _test (non-blocking). Errors of background work surface on
 *    the next call that depends on it and through zs_context_async_error.
 *
 * Thread-safety: every function may be called from any thread, and every
 * handle may be shared between threads. Collective calls (group creation,
 * param registration, fetch, collectives) must be issued in the same order
 * on every member rank; issuing them from several threads at once makes that
 * order unpredictable and is the caller's error. zs_last_error is
 * thread-local. Per object, what runs concurrently and what waits:
 *
 *  - zs_context: its identity and settings (rank, world size, local rank
 *    and size, config JSON, unused and inactive keys, device) are fixed at
 *    create and never wait. The status queries zs_context_memory,
 *    zs_context_fetch_stats, zs_coord_get_stats and zs_context_async_error
 *    never wait for work in progress either: they read counters kept
 *    outside the engine lock (zs_coord_get_stats gives the counters as of
 *    the last coordinator call that returned). Every other call that reads
 *    or changes engine state (params, gathers, gradients, optimizers, the
 *    coordinator's fetch/release/step markers, zs_group_create) takes the
 *    context's one engine lock: such calls on one context run one at a
 *    time, and each waits for the one in progress, blocking ones included
 *    (zs_param_get_status issued during zs_optimizer_step returns after the
 *    step; during zs_coord_fetch or zs_param_register, after their
 *    collectives). Calls on different contexts never wait on each other.
 *  - zs_param, zs_optimizer: under their context's engine lock, as above.
 *    zs_param_data, zs_param_copy_to and zs_param_to_dlpack hold the full
 *    buffer while they use it, so a release from another thread cannot
 *    free it under them.
 *  - zs_gather: zs_gather_wait waits for the gather without the engine lock
 *    (other calls on the context proceed meanwhile), then takes it briefly;
 *    zs_gather_destroy the same; zs_gather_test takes it briefly.
 *  - zs_group and zs_work: collectives (zs_allgather ... zs_barrier) take no
 *    engine lock; they queue on the group's worker thread and run in issue
 *    order within the group, side by side with other groups' work.
 *    zs_work_wait / zs_work_test wait only for their own collective. A
 *    group's worker thread never takes the engine lock, so waiting on a
 *    collective while another thread holds that lock cannot deadlock.
 *  - Callbacks (zs_progress_fn) run on the calling thread while its call
 *    holds the engine lock, which is not recursive: from a callback, the
 *    status queries and calls on other contexts answer; a call that needs
 *    this context's lock fails with ZS_ERR_INVALID_STATE, naming the call
 *    in progress, instead of deadlocking. A destroy (param, gather,
 *    optimizer, the context) made there is refused the same way and its
 *    handle stays valid: a garbage collector that runs in a callback
 *    loses nothing.
 */
#ifndef ZEROSHARD_ZEROSHARD_H
#define ZEROSHARD_ZEROSHARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(ZS_BUILDING_LIBRARY)
#define ZS_API __attribute__((visibility("default")))
#else
#define ZS_API
#endif

/* ------------------------------------------------------------------ */
/* Version                                                             */
/* ------------------------------------------------------------------ */

#define ZS_VERSION_MAJOR 0
#define ZS_VERSION_MINOR 1
#define ZS_VERSION_PATCH 0
/* One number, major * 10000 + minor * 100 + patch. */
#define ZS_VERSION \
  (ZS_VERSION_MAJOR * 10000 + ZS_VERSION_MINOR * 100 + ZS_VERSION_PATCH)

/* The version of the library loaded at run time (compare with ZS_VERSION).
 * Returns a static string "MAJOR.MINOR.PATCH"; any output pointer may be
 * NULL. Never fails. */
ZS_API const char* zs_version(int* major, int* minor, int* patch);

/* ------------------------------------------------------------------ */
/* Status and errors                                                   */
/* ------------------------------------------------------------------ */

/* Every enum spans the whole int range (the _ENUM_MIN_/_ENUM_MAX_ members),
 * so that any int a caller passes is a value of the type and the library
 * can reject it with an error rather than meet undefined behaviour. */

typedef enum zs_status {
  ZS_OK = 0,
  ZS_ERR_INVALID_ARGUMENT = 1, /* NULL pointer, bad value, bad shape */
  ZS_ERR_INVALID_HANDLE = 2,   /* destroyed, never created, or wrong type */
  ZS_ERR_INVALID_STATE = 3,    /* e.g. reading a param that is not gathered */
  ZS_ERR_INVALID_CONFIG = 4,   /* a config value; message names its path */
  ZS_ERR_OUT_OF_MEMORY = 5,
  ZS_ERR_TIMEOUT = 6,   /* a wait, rendezvous or collective timed out */
  ZS_ERR_COMM = 7,      /* a collective failed (peer gone, socket error) */
  ZS_ERR_BOOTSTRAP = 8, /* rank/world/store could not be established */
  ZS_ERR_NOT_SUPPORTED = 9,
  ZS_ERR_BUFFER_SIZE = 10, /* a caller's buffer has the wrong byte size */
  ZS_ERR_INTERNAL = 11,
  ZS_ERR_IO = 12, /* a file could not be read or written, or failed its checksum */
  /* Healing on (zeroshard.healing.peer_copy): a rank stopped or died (its
   * heartbeat fell silent past ZS_HEARTBEAT_TIMEOUT_MS); the message names
   * it. Every call of the context after it fails with this status. */
  ZS_ERR_RANK_LOST = 13,
  /* Healing on: a shard's state and every copy of it were lost together (a
   * rank and the rank holding its copy), or a rank was lost before its
   * first copy landed (in the first step's seed); the message names both
   * ranks. Fall back to a disk checkpoint: exit with ZS_EXIT_STATE_LOST. */
  ZS_ERR_STATE_LOST = 14,
  /* Healing, in a replacement (ZS_HEAL_REPLACEMENT) at zs_context_create:
   * the survivors went on without its rank (they shrank in memory under
   * zeroshard.healing.min_ranks, at once or past
   * zeroshard.healing.replacement_wait_s), so this process has nothing to
   * join; or, started to grow the world back (ZS_HEAL_JOIN=grow), the
   * survivors finished before they could take it in, or refused it (the
   * message says why). Not a failure of the
   * job: exit with ZS_EXIT_NOT_TAKEN. */
  ZS_ERR_NOT_TAKEN = 15,
  ZS_STATUS_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_STATUS_ENUM_MAX_ = 0x7fffffff
} zs_status;

/* The exit status of a process whose heal failed with ZS_ERR_STATE_LOST
 * (EX_TEMPFAIL): zsrun --restarts then says that healing was impossible and
 * why, and restarts every rank, which resume from their last checkpoint. */
#define ZS_EXIT_STATE_LOST 75

/* The exit status of a replacement that was not taken (ZS_ERR_NOT_TAKEN):
 * zsrun --shrink then counts its rank as left, not as a failure. */
#define ZS_EXIT_NOT_TAKEN 76

/* Name of a status ("ZS_ERR_TIMEOUT"); "ZS_UNKNOWN_STATUS" otherwise.
 * Static storage; never fails. */
ZS_API const char* zs_status_string(zs_status status);

/* The message of the last failed call on this thread ("" if none). The
 * pointer stays valid until the next zeroshard call on this thread. */
ZS_API const char* zs_last_error(void);

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

typedef enum zs_dtype {
  ZS_FLOAT32 = 0,
  ZS_BFLOAT16 = 1,
  ZS_FLOAT16 = 2,
  ZS_UINT8 = 3, /* raw bytes: collectives only, not a param dtype */
  ZS_DTYPE_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_DTYPE_ENUM_MAX_ = 0x7fffffff
} zs_dtype;

/* Where memory lives; the values are DLPack's (kDLCPU, kDLCUDA). */
typedef enum zs_device_type {
  ZS_DEVICE_CPU = 1,
  ZS_DEVICE_CUDA = 2,
  ZS_DEVICE_TYPE_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_DEVICE_TYPE_ENUM_MAX_ = 0x7fffffff
} zs_device_type;

typedef enum zs_reduce_op {
  ZS_SUM = 0,
  ZS_AVG = 1,
  ZS_MAX = 2,
  ZS_MIN = 3,
  ZS_REDUCE_OP_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_REDUCE_OP_ENUM_MAX_ = 0x7fffffff
} zs_reduce_op;

/* Lifecycle of a partitioned parameter's full (gathered) data. */
typedef enum zs_param_status {
  ZS_PARAM_NOT_AVAILABLE = 0, /* only this rank's shard is held */
  ZS_PARAM_INFLIGHT = 1,      /* a fetch is gathering it */
  ZS_PARAM_AVAILABLE = 2,      /* full data readable until released */
  ZS_PARAM_STATUS_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_PARAM_STATUS_ENUM_MAX_ = 0x7fffffff
} zs_param_status;

/* How a registered parameter gets its initial values. */
typedef enum zs_init {
  ZS_INIT_ZEROS = 0,
  ZS_INIT_FROM_RANK = 1, /* `data` is read on group rank `src_rank` only */
  ZS_INIT_FROM_ALL = 2,  /* every rank passes identical `data`; no traffic */
  ZS_INIT_NORMAL = 3,    /* N(a, b^2) from `seed`, no traffic */
  ZS_INIT_UNIFORM = 4,    /* U[a, b) from `seed`, no traffic */
  ZS_INIT_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_INIT_ENUM_MAX_ = 0x7fffffff
} zs_init;

/* Which of the context's own groups (from the config's topology). */
typedef enum zs_group_kind {
  ZS_GROUP_WORLD = 0,
  ZS_GROUP_PARTITION = 1,    /* where params are sharded: world or MiCS shard */
  ZS_GROUP_MICS_SHARD = 2,   /* consecutive ranks of mics_shard_size */
  ZS_GROUP_MICS_REPLICA = 3, /* same position in every shard group */
  ZS_GROUP_HPZ = 4,          /* intra-node secondary shard group */
  ZS_GROUP_MICS_INTER = 5,   /* hierarchical gather hop 1: same local rank, across nodes */
  ZS_GROUP_MICS_INTRA = 6,    /* hierarchical gather hop 2: within the node */
  ZS_GROUP_KIND_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_GROUP_KIND_ENUM_MAX_ = 0x7fffffff
} zs_group_kind;

typedef struct zs_context_s* zs_context;
typedef struct zs_group_s* zs_group;
typedef struct zs_param_s* zs_param;
typedef struct zs_gather_s* zs_gather;
typedef struct zs_work_s* zs_work;
typedef struct zs_optimizer_s* zs_optimizer;
typedef struct zs_store_server_s* zs_store_server;

/* DLPack's tensor (dlpack/dlpack.h); declared here so this header needs
 * nothing else. */
struct DLManagedTensor;

#define ZS_MAX_DIMS 8
/* Infinite wait for *_wait(timeout_ms). */
#define ZS_WAIT_FOREVER (-1)

/* ------------------------------------------------------------------ */
/* Context: one per process and data-parallel world                    */
/* ------------------------------------------------------------------ */

typedef struct zs_context_options {
  size_t size;          /* sizeof(zs_context_options) */
  int rank;             /* -1: from the environment */
  int world_size;       /* -1: from the environment */
  int local_rank;       /* -1: from the environment, else rank */
  int local_world_size; /* -1: from the environment, else world_size */
  /* TCP store served by rank 0. Host NULL: MASTER_ADDR, else 127.0.0.1.
   * Port -1: ZS_STORE_PORT, else MASTER_PORT, else 29500 (zsrun sets
   * ZS_STORE_PORT apart from MASTER_PORT, which stays free for torch). */
  const char* store_host;
  int store_port;
  /* If set, rendezvous through files in this shared directory instead. */
  const char* file_store_path;
  /* DeepSpeed JSON: as text, or as a path. At most one; NULL for defaults. */
  const char* config_json;
  const char* config_path;
  /* Rendezvous and collective timeout; 0: ZS_TIMEOUT_MS or 300000. */
  int timeout_ms;
  /* Address this rank's collective transport binds to. NULL: ZS_SOCKET_HOST,
   * else 127.0.0.1 when the store is on loopback, else this host's name. */
  const char* transport_host;
  /* Where shards, gathered params, gradients and optimizer state live:
   * "cpu", "cuda" or "cuda:N". NULL: the config's "device" key, else
   * ZS_DEVICE, else cuda:(LOCAL_RANK % GPUs) when a GPU is present, else
   * "cpu". Pointers the engine returns are then memory of this device. */
  const char* device;
  /* Collectives between ranks: "gloo" or "nccl". NULL: ZS_BACKEND, else
   * "nccl" on a GPU when libnccl.so.2 loads, else "gloo" (GPU memory is
   * staged through pinned host memory). Every rank must choose the same. */
  const char* backend;
} zs_context_options;

#define ZS_CONTEXT_OPTIONS_INIT \
  { sizeof(zs_context_options), -1, -1, -1, -1, NULL, -1, NULL, NULL, NULL, 0, NULL, NULL, NULL }

/* ZS_CONTEXT_OPTIONS_INIT for languages without C macros: its values into the
 * first `size` bytes of *options (pass sizeof *options). */
ZS_API zs_status zs_context_options_init(zs_context_options* options, size_t size);

/* Bring up a context: read rank and world (options, then torchrun's RANK /
 * WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE, Open MPI's OMPI_COMM_WORLD_*,
 * Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID), parse the config,
 * rendezvous, connect the world group and build the config's topology
 * groups. Collective over the world. A world of one opens no socket.
 * Errors: INVALID_ARGUMENT, INVALID_CONFIG, BOOTSTRAP, TIMEOUT. */
ZS_API zs_status zs_context_create(zs_context* out, const zs_context_options* options);

/* Destroy a context and everything registered in it. Handles of its groups,
 * params, gathers, works and optimizers become invalid. Not collective, but
 * peers still running collectives with this rank will see ZS_ERR_COMM. Rank
 * 0 serves the rendezvous store, so it waits (at most the context timeout)
 * until every rank has destroyed its context or died. NULL is OK. */
ZS_API zs_status zs_context_destroy(zs_context ctx);

ZS_API zs_status zs_context_rank(zs_context ctx, int* rank);
ZS_API zs_status zs_context_world_size(zs_context ctx, int* world_size);
ZS_API zs_status zs_context_local_rank(zs_context ctx, int* local_rank);
ZS_API zs_status zs_context_local_world_size(zs_context ctx, int* local_world_size);

/* The first error raised by background work in this context, or ZS_OK. The
 * message is in zs_last_error(). A context with an async error refuses new
 * collectives with the same status. */
ZS_API zs_status zs_context_async_error(zs_context ctx);

/* The effective config as JSON (defaults filled in, "auto" resolved), and a
 * JSON array of the keys the engine accepted but does not use (trainer keys
 * such as "optimizer"). Pointers owned by the context, valid until it is
 * destroyed. */
ZS_API zs_status zs_context_config_json(zs_context ctx, const char** json);
ZS_API zs_status zs_context_unused_config_keys(zs_context ctx, const char** json_array);

/* The config keys the engine accepts but does not act on yet, as a JSON
 * array of {"key": path as written, "value": value as written, "reason":
 * what the engine does instead}, in the order parsed; "[]" when none.
 * Listed: options the engine never reads, set away from the value that
 * agrees with what it does (a stage other than 3, prescale_gradients,
 * fp16_master_weights_and_grads, DeepSpeed implementation switches, ...); keys of
 * an offload section that its device does not use (NVMe keys under "cpu",
 * pin_memory, ratio other than 1); sub_group_size without NVMe optimizer
 * offload; the aio section tuned without NVMe offload, and use_gds; ZeRO++
 * shapes and LoCo while their quantization is off; communication_data_type
 * under qgZ (it quantizes from fp32); zenflow. The rules, one
 * place: impl/config/inactive.cpp. A key at its default is not
 * listed, so the effective config (zs_context_config_json) lists nothing.
 * Computed once when the context is created; bindings warn with it once per
 * context. Pointer owned by the context, valid until it is destroyed. */
ZS_API zs_status zs_context_inactive_config_keys(zs_context ctx, const char** json_array);

/* Check a DeepSpeed config without a context: ZS_OK, or INVALID_CONFIG with
 * the JSON path, the value and what was expected. world_size <= 0 skips the
 * topology checks. */
ZS_API zs_status zs_config_check(const char* config_json, int world_size);

/* Memory held by this rank, in bytes. */
typedef struct zs_memory_stats {
  size_t size;                /* sizeof(zs_memory_stats) */
  uint64_t shard_bytes;       /* padded shards of every registered param */
  uint64_t gathered_bytes;    /* full params gathered right now */
  uint64_t peak_gathered_bytes;
  uint64_t unsharded_bytes;   /* what the params would take unsharded */
  uint64_t num_params;
  /* Idle host blocks kept for reuse by later fetches (process-wide, capped
   * by ZS_HOST_CACHE_MB, default 1024; with ZS_HOST_CACHE_BOUND=1 also by
   * the host pool's peak: idle plus in-use never exceed the most in use). */
  uint64_t host_cache_bytes;
  uint64_t grad_bytes;        /* fp32 gradient shards */
  uint64_t optimizer_bytes;   /* fp32 masters (16-bit params) + optimizer state */
  uint64_t hpz_secondary_bytes; /* hpZ secondary shards held now */
  /* The context device's caching pool (process-wide per device): idle
   * bytes kept for reuse, allocations that reached the system allocator
   * (cudaMalloc on a GPU), and allocations served from idle blocks. In a
   * steady training step only the last one grows. */
  uint64_t device_cache_bytes;
  uint64_t device_system_allocs;
  uint64_t device_reuses;
  /* On disk, not in memory: the NVMe swap files' bytes (optimizer state
   * under offload_optimizer.device "nvme", preallocated when an optimizer
   * group is added; param shards under offload_param.device "nvme",
   * preallocated as params register). */
  uint64_t nvme_bytes;
  uint64_t loco_error_bytes;  /* qgZ LoCo error-feedback buffers (fp32) */
  /* Where the engine's bytes above (shards, gathered params, gradients,
   * optimizer state, hpZ secondaries, LoCo errors) are: in the CUDA
   * device's memory, and in host memory, of which pinned (none today:
   * offloaded state is not pinned). On a CPU context everything is host. */
  uint64_t device_bytes;
  uint64_t host_bytes;
  uint64_t host_pinned_bytes;
} zs_memory_stats;
#define ZS_MEMORY_STATS_INIT { sizeof(zs_memory_stats), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }

/* ZS_MEMORY_STATS_INIT for languages without C macros: its values into the
 * first `size` bytes of *stats (pass sizeof *stats). */
ZS_API zs_status zs_memory_stats_init(zs_memory_stats* stats, size_t size);

/* Which way fetches went, and the bytes this rank's collectives sent and
 * received since the context was made, by kind, counted as the Gloo
 * algorithms move them (ring gathers, reduce-scatters and all-reduces,
 * direct all-to-all, broadcast and scatter from the root; NCCL may route
 * otherwise). "quantized": qwZ's weight packets and qgZ's all-to-all
 * gradient reduction, apart from the full-precision gathers and
 * reduce-scatters they replace (a param whose shard is no larger than its
 * packet travels exact under qwZ and counts as a full-precision gather). */
typedef struct zs_fetch_stats {
  size_t size;                   /* sizeof(zs_fetch_stats) */
  uint64_t gathers;              /* coalesced fetches issued */
  uint64_t hpz_gathers;          /* served from hpZ secondary shards (intra-node) */
  uint64_t hierarchical_gathers; /* MiCS two-hop gathers */
  uint64_t gather_bytes_sent;
  uint64_t gather_bytes_received;
  uint64_t quantized_gather_bytes_sent;
  uint64_t quantized_gather_bytes_received;
  uint64_t reduce_scatter_bytes_sent;
  uint64_t reduce_scatter_bytes_received;
  uint64_t quantized_reduce_bytes_sent;
  uint64_t quantized_reduce_bytes_received;
  uint64_t allreduce_bytes_sent;
  uint64_t allreduce_bytes_received;
  uint64_t other_bytes_sent;     /* broadcasts, scatters, barriers */
  uint64_t other_bytes_received;
} zs_fetch_stats;
#define ZS_FETCH_STATS_INIT { sizeof(zs_fetch_stats), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }

/* ZS_FETCH_STATS_INIT for languages without C macros: its values into the
 * first `size` bytes of *stats (pass sizeof *stats). */
ZS_API zs_status zs_fetch_stats_init(zs_fetch_stats* stats, size_t size);

ZS_API zs_status zs_context_fetch_stats(zs_context ctx, zs_fetch_stats* stats);

/* The context's device (type and ordinal; ordinal 0 on the CPU) and the
 * backend its collectives run on ("gloo" | "nccl", owned by the library).
 * Any output may be NULL. */
ZS_API zs_status zs_context_device(zs_context ctx, zs_device_type* type, int* device_id,
                                   const char** backend);

/* CUDA devices this process can use: 0 when the library was built without
 * CUDA, the machine has no driver, or no device is visible; then *reason
 * (if not NULL) says which, else it is "". Never fails on a machine
 * without a GPU. */
ZS_API zs_status zs_cuda_device_count(int* count, const char** reason);

ZS_API zs_status zs_context_memory(zs_context ctx, zs_memory_stats* stats);

/* Every byte the engine allocates, by what it is for (process-wide: the
 * caching pools are). Device memory is counted at the size the pool hands
 * out, so the kinds other than ZS_MEM_IO_STAGING and ZS_MEM_INBOXES add up
 * to zs_memory_pools_in_use; those two are outside the pools:
 * ZS_MEM_IO_STAGING is aligned host memory of checkpoint and NVMe I/O,
 * ZS_MEM_INBOXES the shared-memory transport's inboxes. Idle pool blocks
 * are not in any kind (zs_memory_stats' host_cache_bytes and
 * device_cache_bytes). */
typedef enum zs_memory_kind {
  ZS_MEM_SHARDS = 0,          /* this rank's param shards (packed frozen ones too) */
  ZS_MEM_MASTERS = 1,         /* fp32 masters of 16-bit params */
  ZS_MEM_OPTIMIZER_STATE = 2, /* moments, momentum, an external optimizer's named state */
  ZS_MEM_GRADS = 3,           /* fp32 gradient shards, qgZ LoCo error feedback */
  ZS_MEM_GATHERED = 4,        /* full params gathered for compute */
  ZS_MEM_HPZ_SECONDARY = 5,   /* hpZ secondary shards */
  ZS_MEM_REDUCE_BUCKETS = 6,  /* gradient buckets and copies on their way to the reduce-scatter */
  ZS_MEM_COMM_STAGING = 7,    /* transport staging, quantized packets, two-hop temporaries */
  ZS_MEM_SCRATCH = 8,         /* temporaries of a step or a registration */
  ZS_MEM_IO_STAGING = 9,      /* aligned host buffers of checkpoint and NVMe I/O */
  ZS_MEM_UNTAGGED = 10,       /* an allocation no kind names (stays 0: a bug otherwise) */
  ZS_MEM_PEER_COPIES = 11,    /* healing: the replica of another rank's shard state this rank holds,
                                 and its gradient buffer (zeroshard.healing.peer_copy) */
  ZS_MEM_INBOXES = 12,        /* shared-memory inboxes of ranks on one host (ZS_SHARED_MEMORY): one per
                                 group this rank is in, a ring per member; outside the pools */
  ZS_MEM_KIND_COUNT = 13,
  ZS_MEM_KIND_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_MEM_KIND_ENUM_MAX_ = 0x7fffffff
} zs_memory_kind;

/* The phase whose peaks the engine's allocations raise. The engine follows
 * it by itself: registering params is CONSTRUCTION (a pretrained load
 * too), a fetch FORWARD until a gradient is pushed (BACKWARD, whose fetches
 * stay BACKWARD), an optimizer step STEP until the next fetch, a checkpoint
 * save or load CHECKPOINT (the phase before it resumes after).
 * zs_memory_set_phase overrides it (a trainer with gradient accumulation
 * marks its forwards). */
typedef enum zs_memory_phase {
  ZS_PHASE_NOW = -1, /* zs_memory_by_kind: what is held now */
  ZS_PHASE_CONSTRUCTION = 0,
  ZS_PHASE_FORWARD = 1,
  ZS_PHASE_BACKWARD = 2,
  ZS_PHASE_STEP = 3,
  ZS_PHASE_CHECKPOINT = 4,
  ZS_PHASE_COUNT = 5,
  ZS_PHASE_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_PHASE_ENUM_MAX_ = 0x7fffffff
} zs_memory_phase;

/* Bytes by kind: bytes[k] for kind k < capacity (the rest not written);
 * *num_kinds (may be NULL) receives ZS_MEM_KIND_COUNT. phase ZS_PHASE_NOW:
 * what each kind holds now, *total (may be NULL) their sum; a phase: the
 * most each kind held in it since the process started or
 * zs_memory_reset_peaks, *total the most all kinds held together then.
 * Local; never waits for the engine lock. INVALID_ARGUMENT for another
 * phase, or bytes NULL with capacity > 0. */
ZS_API zs_status zs_memory_by_kind(zs_context ctx, zs_memory_phase phase, uint64_t* bytes, size_t capacity,
                                   size_t* num_kinds, uint64_t* total);
/* The bytes the caching pools of ctx's device (and the host's) hand out now
 * and have not had back: what the kinds but ZS_MEM_IO_STAGING and
 * ZS_MEM_INBOXES add up to. */
ZS_API zs_status zs_memory_pools_in_use(zs_context ctx, uint64_t* bytes);
ZS_API zs_status zs_memory_get_phase(zs_context ctx, zs_memory_phase* phase);
ZS_API zs_status zs_memory_set_phase(zs_context ctx, zs_memory_phase phase);
/* Every phase's peaks start again from what is held now. */
ZS_API zs_status zs_memory_reset_peaks(zs_context ctx);
/* "shards", "masters", ... ; "construction", "forward", ... ; NULL out of range. */
ZS_API const char* zs_memory_kind_name(zs_memory_kind kind);
ZS_API const char* zs_memory_phase_name(zs_memory_phase phase);

/* Bytes the engine copies, by what the copy is for: what a step moves
 * through memory besides what it holds (zs_memory_by_kind). A copy counts
 * the bytes it writes (a bf16 gradient widened into an fp32 bucket: 4 an
 * element); a write in place (a shard scaled, a reduction straight into
 * the gradient shard) is no copy, nor is what a collective moves between
 * ranks (zs_context_fetch_stats), nor a collective's own work but for the
 * kinds named below. Checkpoints and NVMe swapping of params and optimizer
 * state are I/O, not counted. Later releases may append kinds. */
typedef enum zs_copy_kind {
  ZS_COPY_GRAD_INTO_BUCKET = 0,   /* a gradient into its reduce bucket (widened or narrowed, divided by
                                   * the accumulation steps), or into the private fp32 copy a direct-route
                                   * gradient pushed without a loan is reduced from */
  ZS_COPY_BUCKET_COMPACTION = 1,  /* a partly filled bucket's blocks closed up before its reduce-scatter */
  ZS_COPY_GRAD_ONTO_DEVICE = 2,   /* a gradient in the other memory (host <-> device) brought over first */
  ZS_COPY_INTO_GRAD_SHARD = 3,    /* reduced values stored (assigned or added) into an fp32 gradient shard */
  ZS_COPY_WIRE_WIDEN = 4,         /* a 16-bit reduce-scatter's result widened to fp32 */
  ZS_COPY_MICS_REPLICA = 5,       /* MiCS: gradient shards into the replica all-reduce's buffer and back */
  ZS_COPY_MASTER_REFRESH = 6,     /* fp32 master -> 16-bit working shard after an update */
  ZS_COPY_PARAM_CAST = 7,         /* a 16-bit shard cast into its fp32 master (made, or refreshed after
                                   * the shard was rewritten) */
  ZS_COPY_GRAD_SPILL = 8,         /* gradient shards written to and read back from NVMe */
  ZS_COPY_GROUP_OF_ONE = 9,       /* a one-member group's collective, done as a copy */
  ZS_COPY_GATHER_STAGING = 10,    /* small params packed and unpacked around an all-gather, hpZ secondary
                                   * slices, MiCS two-hop reordering */
  ZS_COPY_COMM_STAGING = 11,      /* device memory staged through a host transport, qgZ's blocks */
  ZS_COPY_OTHER = 12,             /* registration, param writes, packed params, Muon's temporaries */
  ZS_COPY_KIND_COUNT = 13,
  ZS_COPY_KIND_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_COPY_KIND_ENUM_MAX_ = 0x7fffffff
} zs_copy_kind;

/* Which copies zs_copied_bytes counts. */
typedef enum zs_copy_span {
  ZS_COPIES_TOTAL = 0,     /* since the context was created */
  /* Between the context's last two optimizer step ends (zs_optimizer_step
   * or zs_optimizer_step_end returning, a skipped step too), after each
   * step's gradients were freed and persistent params sent out: one
   * forward, backward and step in a plain loop; since the context was
   * created for its first step; zeros before it. */
  ZS_COPIES_LAST_STEP = 1,
  ZS_COPY_SPAN_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_COPY_SPAN_ENUM_MAX_ = 0x7fffffff
} zs_copy_span;

/* Bytes copied by kind: bytes[k] for kind k < capacity (the rest not
 * written); *num_kinds (may be NULL) receives ZS_COPY_KIND_COUNT, *total
 * (may be NULL) the sum over every kind. The counters are process-wide
 * (as zs_memory_by_kind's), in atomics: copies on the groups' threads
 * count as they happen; the spans are this context's. Local; never waits
 * for the engine lock. INVALID_ARGUMENT for another span, or bytes NULL
 * with capacity > 0. */
ZS_API zs_status zs_copied_bytes(zs_context ctx, zs_copy_span span, uint64_t* bytes, size_t capacity,
                                 size_t* num_kinds, uint64_t* total);
/* "grad_into_bucket", "bucket_compaction", ... ; NULL out of range. */
ZS_API const char* zs_copy_kind_name(zs_copy_kind kind);

/* ------------------------------------------------------------------ */
/* Groups                                                              */
/* ------------------------------------------------------------------ */

/* A new handle to one of the context's groups. Caller owns the handle (the
 * group itself lives as long as the context). Every rank gets a handle; on a
 * rank outside the group (impossible for these kinds) zs_group_rank is -1. */
ZS_API zs_status zs_context_group(zs_group* out, zs_context ctx, zs_group_kind kind);

/* A sub-group of world ranks. Collective over the world: every rank calls
 * with the same list in the same order of calls; ranks not in the list get a
 * handle whose zs_group_rank is -1 and that refuses collectives. */
ZS_API zs_status zs_group_create(zs_group* out, zs_context ctx, const int* ranks, int num_ranks);
ZS_API zs_status zs_group_destroy(zs_group group);

/* This rank's position in the group (-1 if not a member), its size, and
 * the world rank of group member i. */
ZS_API zs_status zs_group_rank(zs_group group, int* rank);
ZS_API zs_status zs_group_size(zs_group group, int* size);
ZS_API zs_status zs_group_world_rank(zs_group group, int group_rank, int* world_rank);

/* ------------------------------------------------------------------ */
/* Collectives (asynchronous, run in issue order on the group's thread) */
/* ------------------------------------------------------------------ */

/* recv holds count * group_size elements: member i's send at i * count. */
ZS_API zs_status zs_allgather(zs_work* out, zs_group group, const void* send,
                              void* recv, size_t count, zs_dtype dtype);
/* send holds recv_count * group_size elements; member i receives the
 * reduction of block i. bf16/fp16 are summed in fp32 at each hop, the
 * partial sums passed on in their 16 bits (half the bytes of fp32); an
 * fp16 AVG divides each term by the group size before summing, as NCCL
 * does, so that it overflows only where the mean would. */
ZS_API zs_status zs_reduce_scatter(zs_work* out, zs_group group, const void* send,
                                   void* recv, size_t recv_count, zs_dtype dtype,
                                   zs_reduce_op op);
/* send may equal recv (in place). */
ZS_API zs_status zs_allreduce(zs_work* out, zs_group group, const void* send, void* recv,
                              size_t count, zs_dtype dtype, zs_reduce_op op);
/* root is a group rank; buf is read on root, written elsewhere. */
ZS_API zs_status zs_broadcast(zs_work* out, zs_group group, void* buf, size_t count,
                              zs_dtype dtype, int root);
ZS_API zs_status zs_barrier(zs_work* out, zs_group group);

/* Wait up to timeout_ms (ZS_WAIT_FOREVER, or >= 0) for the work. ZS_OK when
 * done; ZS_ERR_TIMEOUT if still running (wait again or destroy); the work's
 * own error if it failed. Buffers must stay valid until the work is done. */
ZS_API zs_status zs_work_wait(zs_work work, int timeout_ms);
/* *done = 1 when finished (then returns the work's status), else 0. */
ZS_API zs_status zs_work_test(zs_work work, int* done);
/* Destroying an unfinished work waits for it first (the buffers are in
 * use). NULL is OK. */
ZS_API zs_status zs_work_destroy(zs_work work);

/* ------------------------------------------------------------------ */
/* Partitioned parameters                                              */
/* ------------------------------------------------------------------ */

typedef struct zs_param_options {
  size_t size;        /* sizeof(zs_param_options) */
  const char* name;   /* copied; need not be unique */
  zs_dtype dtype;     /* ZS_FLOAT32, ZS_BFLOAT16 or ZS_FLOAT16 */
  int ndim;           /* 0..ZS_MAX_DIMS; 0 is a scalar */
  const int64_t* shape; /* ndim entries >= 0 (zero-size params are fine) */
  zs_init init;
  const void* data;   /* full values for FROM_RANK (on src_rank) / FROM_ALL; host or CUDA memory */
  size_t data_bytes;  /* must equal numel * dtype size where data is read */
  int src_rank;       /* group rank that holds data, for FROM_RANK */
  uint64_t seed;      /* NORMAL / UNIFORM */
  double a, b;        /* NORMAL: mean, std; UNIFORM: low, high */
  zs_group group;     /* partition over this group; NULL: ZS_GROUP_PARTITION */
} zs_param_options;

#define ZS_PARAM_OPTIONS_INIT \
  { sizeof(zs_param_options), NULL, ZS_FLOAT32, 0, NULL, ZS_INIT_ZEROS, NULL, 0, 0, 0, 0.0, 1.0, NULL }

/* ZS_PARAM_OPTIONS_INIT for languages without C macros: its values into the
 * first `size` bytes of *options (pass sizeof *options). */
ZS_API zs_status zs_param_options_init(zs_param_options* options, size_t size);

/* Register a parameter: this rank keeps only its padded shard of
 * ceil(numel / G) elements (G = group size; the last ranks hold the zero
 * padding) and frees the rest before returning. Collective over the group
 * for ZS_INIT_FROM_RANK (a scatter); local otherwise, but every member must
 * register the same params in the same order. */
ZS_API zs_status zs_param_register(zs_param* out, zs_context ctx, const zs_param_options* options);
/* Unregister; a gathered param is released first. NULL is OK. Local, but
 * where the coordinator has seen the param (zs_coord_fetch, zs_leaf_group)
 * every rank destroys it at the same point, between steps: it leaves the
 * coordinator's trace and kept params, which must stay the same on every
 * rank. */
ZS_API zs_status zs_param_destroy(zs_param param);

typedef struct zs_param_info {
  size_t size;            /* sizeof(zs_param_info) */
  const char* name;       /* owned by the param */
  zs_dtype dtype;
  int ndim;
  int64_t shape[ZS_MAX_DIMS];
  uint64_t numel;
  uint64_t shard_numel;   /* padded shard: ceil(numel / G) */
  uint64_t padded_numel;  /* shard_numel * G */
  uint64_t shard_offset;  /* first element of this rank's shard */
  uint64_t shard_valid;   /* elements of the shard that are not padding */
  zs_param_status status;
  zs_device_type device_type; /* where shard and full data live */
  int device_id;
  /* Moves on each time this rank's shard is rewritten other than by an
   * optimizer's step: zs_param_update, zs_param_write, a checkpoint or
   * safetensors load, quantizing a frozen param's shard. A full copy
   * gathered at one version (a frozen model kept gathered between calls)
   * is current while the version stays. Writes through zs_param_shard_data
   * are the caller's own and do not move it. */
  uint64_t shard_version;
} zs_param_info;
#define ZS_PARAM_INFO_INIT { sizeof(zs_param_info), NULL, ZS_FLOAT32, 0, {0}, 0, 0, 0, 0, 0, ZS_PARAM_NOT_AVAILABLE, ZS_DEVICE_CPU, 0, 0 }

/* ZS_PARAM_INFO_INIT for languages without C macros: its values into the
 * first `size` bytes of *info (pass sizeof *info). */
ZS_API zs_status zs_param_info_init(zs_param_info* info, size_t size);

ZS_API zs_status zs_param_get_info(zs_param param, zs_param_info* info);
ZS_API zs_status zs_param_get_status(zs_param param, zs_param_status* status);

/* This rank's shard: shard_numel elements (padding included), always
 * readable and writable; writes change the param from the next fetch on.
 * Memory of the context's device (see zs_param_info.device_type). With
 * parameter offload to NVMe the shard is read back into memory and stays
 * there for the param's life (it is no longer offloaded). */
ZS_API zs_status zs_param_shard_data(zs_param param, void** data, uint64_t* shard_numel);

/* Gather many params as one coalesced, asynchronous all-gather. All params
 * must belong to this context and one partition group, and be
 * NOT_AVAILABLE (a param listed twice is an error). Collective over that
 * group: members fetch the same params in the same order. Params move to
 * INFLIGHT, then AVAILABLE when the gather completes. */
ZS_API zs_status zs_fetch(zs_gather* out, zs_context ctx, const zs_param* params, size_t num_params);
/* As zs_work_wait / zs_work_test. */
ZS_API zs_status zs_gather_wait(zs_gather gather, int timeout_ms);
ZS_API zs_status zs_gather_test(zs_gather gather, int* done);
/* Waits for an unfinished gather, then drops the handle; the params stay
 * AVAILABLE until released. NULL is OK. */
ZS_API zs_status zs_gather_destroy(zs_gather gather);

/* The full data of an AVAILABLE param (numel elements, row-major, writable:
 * see zs_param_update for making writes stick), in the context's device
 * memory; NULL for a zero-size param. INVALID_STATE unless AVAILABLE. */
ZS_API zs_status zs_param_data(zs_param param, void** data);
/* Copy the full data into dst, which must be exactly numel * dtype size
 * bytes (BUFFER_SIZE otherwise). dst may be host or CUDA memory. */
ZS_API zs_status zs_param_copy_to(zs_param param, void* dst, size_t dst_bytes);
/* A DLPack tensor over the full data of an AVAILABLE param, on the
 * context's device (kDLCPU or kDLCUDA with its ordinal), without a copy.
 * The tensor keeps the memory alive after release until its deleter runs;
 * the caller owns it and must call its deleter. */
ZS_API zs_status zs_param_to_dlpack(zs_param param, struct DLManagedTensor** out);

/* Free the full data of AVAILABLE params; they become NOT_AVAILABLE. A param
 * that is not AVAILABLE is an INVALID_STATE error and nothing is released.
 * Local (no traffic). */
ZS_API zs_status zs_release(zs_context ctx, const zs_param* params, size_t num_params);

/* GatheredParameters: after the caller modified the full data of AVAILABLE
 * params on group rank modifier_rank, broadcast it to every member and write
 * each member's shard from it, so the change survives release. Collective
 * over the params' group; blocks until done. An optimizer's fp32 master of
 * a 16-bit param is read again from the new values before its next update,
 * so the change is not undone. */
ZS_API zs_status zs_param_update(zs_context ctx, const zs_param* params, size_t num_params,
                                 int modifier_rank);

/* Every rank sets the param to the same full values (numel elements of its
 * dtype, in host memory or on the context's device), as a torch
 * `param.data = t` does: this rank's shard is rewritten from them, and the
 * full data too while AVAILABLE. Local: no traffic, nothing to match across
 * ranks (ranks that pass different values keep different shards). INFLIGHT
 * is an INVALID_STATE error. An optimizer's fp32 master of a 16-bit param is
 * read again from the new values before its next update. */
ZS_API zs_status zs_param_write(zs_param param, const void* data, size_t data_bytes);

/* Freeze the param for good, as torch's requires_grad=False and
 * DeepSpeed's treatment of it: it is gathered as before, but a gradient
 * push to it is an INVALID_STATE error naming it, and no optimizer steps it
 * (one it joins afterwards keeps no state for it; state an optimizer
 * already holds stays, never stepped). With zero_optimization.
 * zero_quantized_nontrainable_weights (ZeRO++) its shard is quantized once,
 * now, to zero_quantized_weights_bits codes in blocks of
 * zero_quantized_weights_block_size with one fp32 scale each, and kept only
 * so (an int8 fp32 shard takes about a quarter of the memory; a shard
 * smaller than its codes, which fill whole blocks, stays exact): gathers
 * send those codes as they are, never requantizing, and every rank dequantizes
 * bitwise the same values, within the documented per-block bound of the
 * exact ones, which are gone. zs_param_shard_data is then INVALID_STATE;
 * checkpoints and exports hold the dequantized values; a write
 * (zs_param_write, zs_param_update, a load) is quantized into the codes.
 * Local: every rank must freeze the same params before the next gather of
 * them. INVALID_STATE if a gradient was pushed to it since the last
 * optimizer step. A frozen param stays frozen (freezing it again is OK). */
ZS_API zs_status zs_param_freeze(zs_param param);

/* ------------------------------------------------------------------ */
/* Training: gradients                                                 */
/* ------------------------------------------------------------------ */

/* Hand the engine a param's full gradient (numel elements of dtype, as
 * produced by backward; with fp16 it carries the loss scale). The engine
 * copies it into a bucket (a large one into a buffer of its own, see
 * zs_grad_push_borrowed), divided by the accumulation steps, so the caller
 * may reuse the buffer on return. A full bucket (reduce_bucket_size
 * elements) is reduce-scattered and averaged over the param's group in the
 * background (overlap_comm) and summed into this rank's fp32 gradient
 * shard. The bucket and the wire hold the dtype communication_data_type
 * names, by default (DeepSpeed's) bf16 under bf16.enabled, fp16 under
 * fp16.enabled, else fp32; qgZ quantizes from fp32. In a group of one (a
 * world of one, or a param's own group of one rank) the reduce-scatter is
 * the identity: the gradient goes straight into the fp32 gradient shard
 * before the call returns, with no bucket, each value divided and rounded
 * through the wire dtype as the bucket would have held it (the same bits).
 * Collective over the group: members push the same params in the
 * same order. BUFFER_SIZE if grad_bytes is not numel * dtype size. grad
 * may be host or CUDA memory; on a CUDA context the engine's stream runs
 * after work queued on the legacy default stream (PyTorch's default), so a
 * gradient produced there needs no synchronisation first. */
ZS_API zs_status zs_grad_push(zs_param param, const void* grad, zs_dtype dtype,
                              size_t grad_bytes);

/* zs_grad_push of n params of ctx in order, in one call: grads[i] is
 * params[i]'s full gradient of grad_bytes[i] bytes of dtype, or NULL for a
 * param without one this time (skipped, as if not pushed). Every gradient
 * is checked before any is taken, so a refused call pushes none; the error
 * names the index. For a trainer that hands over many small gradients at
 * once (zeroshard.torch, when a backward ends). Collective as
 * zs_grad_push. */
ZS_API zs_status zs_grad_push_many(zs_context ctx, const zs_param* params, size_t n,
                                   const void* const* grads, const size_t* grad_bytes,
                                   zs_dtype dtype);

/* zs_grad_push without the copy, for a trainer that can keep a gradient
 * alive a little longer (zeroshard.torch does): the engine may reduce
 * straight from `grad` after this call returns. *ticket > 0: it does, and
 * the caller keeps the memory valid and unchanged until zs_grad_released
 * reports a ticket >= *ticket (at the latest once zs_grad_sync or
 * zs_optimizer_step returns, or fails); the engine only reads it. *ticket
 * == 0: the engine took what it needs, the memory is the caller's again
 * (always so in a group of one: see zs_grad_push).
 *
 * Which gradients go in place, on a host (CPU) context: fp32 host memory,
 * of a param whose numel is a multiple of its group's size and at least a
 * quarter of reduce_bucket_size, without qgZ. Such a param's gradient is
 * reduce-scattered on its own, not in a bucket, whichever of the push calls
 * hands it over (so ranks may mix them; zs_grad_push then reduces from a
 * copy), straight into the gradient shard when the shard holds no gradient
 * since the step. A bucket would have copied it: on a wide layer that copy
 * is the size of the layer's gradient, at the peak of the backward. With
 * accumulation steps, the division is applied to the averaged shard
 * instead of each gradient (within rounding of zs_grad_push's result).
 * Otherwise as zs_grad_push, collective alike; *ticket is 0 on failure. */
ZS_API zs_status zs_grad_push_borrowed(uint64_t* ticket, zs_param param, const void* grad,
                                       zs_dtype dtype, size_t grad_bytes);

/* The highest ticket of zs_grad_push_borrowed that, with every lower one,
 * the engine no longer reads: those gradients' memory is the caller's
 * again. Tickets count up from 1 per context; 0 before the first. */
ZS_API zs_status zs_grad_released(zs_context ctx, uint64_t* ticket);

/* Flush partial buckets and wait for every reduce-scatter; with MiCS also
 * all-reduce the shards across the replica groups. The accumulation
 * boundary; zs_optimizer_step calls it itself. Collective. */
ZS_API zs_status zs_grad_sync(zs_context ctx);

/* Micro-steps per optimizer step (default 1): pushed gradients are divided
 * by it, so the step sees their mean. */
ZS_API zs_status zs_grad_set_accumulation_steps(zs_context ctx, int steps);

/* torch's optimizer.zero_grad() between a backward and the step that uses
 * its gradients (a GAN's generator loss reaching the discriminator's
 * params, which the discriminator's next step must not see): the
 * gradients pushed for params since the last optimizer step that stepped
 * them are dropped, so their next step sees only gradients pushed after
 * this call (with none it leaves them alone, as torch skips a param whose
 * .grad is None). Returns at once when none of them has a gradient pushed
 * (a zero_grad right after the step, or before the backward): no
 * collective. Otherwise it settles the reductions in flight first, a
 * collective point every rank reaches alike as it pushed alike. */
ZS_API zs_status zs_grad_discard(zs_context ctx, const zs_param* params, size_t num_params);

/* This rank's fp32 gradient shard of a param (shard_numel elements, in the
 * context's device memory; NULL before its first push), readable and
 * writable. Call it after zs_grad_sync each time the shard is to be read
 * or written, rather than keeping the pointer: the step does not zero the
 * shards (their next push overwrites them), so this call is what zeroes a
 * shard that got no gradient since the step, and what tells the next step
 * to take the norm from the shard as the caller leaves it. */
ZS_API zs_status zs_grad_shard_data(zs_param param, float** data, uint64_t* shard_numel);

/* *pushed = 1 when a gradient was pushed to the param since the last
 * optimizer step (its shard then holds this step's gradient), else 0: a
 * param without one is left alone by the step, as torch skips a param
 * whose .grad is None. Local. */
ZS_API zs_status zs_grad_pushed(zs_param param, int* pushed);

/* torch.nn.utils.clip_grad_norm_ over params' gradient shards:
 * zs_grad_sync, the L2 norm of the averaged gradients (over each param's
 * partition group, every element once) into *total_norm, and when it
 * exceeds max_norm (>= 0) every shard scaled by max_norm / (norm + 1e-6).
 * A gradient that is not finite gives an inf norm and scales nothing (the
 * step skips). Collective over the world: the same params in the same
 * order on every rank. NOT_SUPPORTED under fp16.enabled, whose shards carry
 * the loss scale until the step (use gradient_clipping). */
ZS_API zs_status zs_grad_clip_norm(zs_context ctx, const zs_param* params, size_t num_params,
                                   double max_norm, double* total_norm);

/* ------------------------------------------------------------------ */
/* Training: sharded optimizer                                         */
/* ------------------------------------------------------------------ */

typedef enum zs_optimizer_kind {
  ZS_OPTIM_ADAMW = 0, /* decoupled weight decay */
  ZS_OPTIM_ADAM = 1,  /* weight decay as L2 added to the gradient */
  ZS_OPTIM_SGD = 2,    /* momentum, dampening, Nesterov */
  /* The caller's update rule (a torch optimizer on the shards): the engine
   * keeps fp32 masters of 16-bit params (slot 0; an fp32 param's is its
   * shard) and named per-param state (zs_optimizer_named_state), and steps
   * by zs_optimizer_step_begin, the caller's update of the masters, then
   * zs_optimizer_step_end. Hyper-parameters are the caller's too.
   * NOT_SUPPORTED under bf16.bf16_master_weights_and_grads (no fp32
   * masters to step). */
  ZS_OPTIM_EXTERNAL = 3,
  /* DeepSpeed 0.19's Muon with its auxiliary AdamW. A group's use_muon
   * (fixed at zs_optimizer_add_group) says which of its params step Muon:
   * 1 all (each needs 2 or more dims), 0 none, -1 those of 2 or more dims.
   * A Muon param's momentum moves toward the gradient on each rank's shard
   * (slot 1; momentum is Muon's beta, e.g. 0.95); the Nesterov update of the
   * whole matrix (dim 0 by the rest) is orthogonalized on one owner rank
   * by ns_steps Newton-Schulz steps (ns_method 0 "gram", 1 "standard"; fp32
   * GEMMs: OpenBLAS on a CPU context, cuBLAS on a CUDA one), owners
   * balanced by flops; then each rank's master shard decays by
   * lr * weight_decay and moves by -lr times its part of the result, scaled
   * by sqrt(max(1, rows / cols)). The other params step AdamW (lr, beta1,
   * beta2, eps, weight_decay; slots 1 and 2). NOT_SUPPORTED under
   * bf16.bf16_master_weights_and_grads and with offload_optimizer.device
   * "nvme". */
  ZS_OPTIM_MUON = 4,
  ZS_OPTIM_KIND_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_OPTIM_KIND_ENUM_MAX_ = 0x7fffffff
} zs_optimizer_kind;

typedef struct zs_optim_hparams {
  size_t size; /* sizeof(zs_optim_hparams) */
  double lr;
  double beta1, beta2, eps; /* Adam(W) */
  double weight_decay;
  double momentum, dampening; /* SGD */
  int nesterov;               /* SGD */
  int bias_correction;        /* Adam(W), default 1 */
  /* ZS_OPTIM_MUON only; any other kind refuses values but the defaults. */
  int use_muon;  /* 1 Muon, 0 AdamW, -1 (default) by shape: 2 or more dims Muon */
  int ns_method; /* Newton-Schulz: 0 (default) "gram", 1 "standard" */
  int ns_steps;  /* Newton-Schulz steps, 1..100, default 5 */
} zs_optim_hparams;

#define ZS_OPTIM_HPARAMS_INIT \
  { sizeof(zs_optim_hparams), 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.0, 0.0, 0, 1, -1, 0, 5 }

/* ZS_OPTIM_HPARAMS_INIT for languages without C macros: its values into the
 * first `size` bytes of *hparams (pass sizeof *hparams). */
ZS_API zs_status zs_optim_hparams_init(zs_optim_hparams* hparams, size_t size);

/* An optimizer over params of ctx; its state is sized to this rank's
 * shards. Mixed precision follows the config: with bf16 or fp16 params the
 * engine keeps fp32 master shards, except that under
 * bf16.bf16_master_weights_and_grads a bf16 param's bf16 shard is its
 * master (stepped in place in fp32 math, rounded once to bf16; gradient
 * shards stay fp32), and bf16.bf16_optimizer_states also keeps its moments
 * in bf16; ZS_OPTIM_EXTERNAL under bf16_master_weights_and_grads, and
 * bf16_optimizer_states with "nvme" below, are NOT_SUPPORTED. With fp16 it
 * runs the loss scaler
 * (fp16.loss_scale, initial_scale_power, loss_scale_window, hysteresis,
 * min_loss_scale); gradient_clipping clips the global norm. With
 * zero_optimization.offload_optimizer.device "nvme" the masters of 16-bit
 * params and the moments live in a swap file under nvme_path (each
 * zs_optimizer_add_group takes its space there, or fails with IO naming the
 * path, the bytes needed and the bytes free); "cpu" on a CPU context is
 * where the state is already; on a CUDA context both are NOT_SUPPORTED. */
ZS_API zs_status zs_optimizer_create(zs_optimizer* out, zs_context ctx, zs_optimizer_kind kind);
ZS_API zs_status zs_optimizer_destroy(zs_optimizer opt);

/* A parameter group with its own hyper-parameters (e.g. no weight decay on
 * norms and biases). A param belongs to one group at most. *group_index
 * (may be NULL) receives the group's index. Local. */
ZS_API zs_status zs_optimizer_add_group(zs_optimizer opt, const zs_param* params, size_t num_params,
                                        const zs_optim_hparams* hparams, int* group_index);
/* Change a group's hyper-parameters (group -1: every group), e.g. the
 * learning rate each step. */
ZS_API zs_status zs_optimizer_set_hparams(zs_optimizer opt, int group, const zs_optim_hparams* hparams);
ZS_API zs_status zs_optimizer_set_lr(zs_optimizer opt, int group, double lr);

typedef struct zs_step_result {
  size_t size;       /* sizeof(zs_step_result) */
  int skipped;       /* 1: gradients overflowed (fp16), nothing was updated */
  double grad_norm;  /* global L2 norm of the averaged, unscaled gradient */
  double loss_scale; /* the scale to multiply the next loss by (1 unless fp16) */
  int64_t step;      /* optimizer steps taken so far (skipped ones excluded) */
} zs_step_result;
#define ZS_STEP_RESULT_INIT { sizeof(zs_step_result), 0, 0.0, 1.0, 0 }

/* ZS_STEP_RESULT_INIT for languages without C macros: its values into the
 * first `size` bytes of *result (pass sizeof *result). */
ZS_API zs_status zs_step_result_init(zs_step_result* result, size_t size);

/* One optimizer step, collective over the world: zs_grad_sync, global norm,
 * overflow check (a step with inf/NaN gradients is skipped on every rank),
 * clipping, the update of every group's master shards, the rewrite of the
 * working-dtype shards; then the gradient shards of its params count as
 * zeros (the next push overwrites them, see zs_grad_shard_data); those of
 * params it does not hold keep accumulating, as torch's .grad of a param
 * no optimizer steps does (so two optimizers over disjoint params each step
 * their own). result may be NULL. */
ZS_API zs_status zs_optimizer_step(zs_optimizer opt, zs_step_result* result);

/* The step of a ZS_OPTIM_EXTERNAL optimizer in two halves, collective
 * as zs_optimizer_step. step_begin: zs_grad_sync, the global norm, the
 * overflow check (result->skipped: every rank skips alike), then each
 * gradient shard of a param with a gradient this step (zs_grad_pushed) is
 * unscaled (fp16) and clipped (gradient_clipping) in place, and 16-bit
 * masters are refreshed from shards rewritten since (zs_param_write...).
 * The caller then updates the masters (zs_optimizer_state_data slot 0)
 * from the gradient shards (zs_grad_shard_data), using its named states,
 * and nothing else of the engine, unless the step was skipped. step_end
 * writes 16-bit working shards from the masters, counts the step, marks the
 * gradient shards old and fills result (step, loss_scale). Each needs the
 * other: a second step_begin, or a step_end without one, is INVALID_STATE,
 * as is zs_optimizer_step on this kind or step_begin on another. */
ZS_API zs_status zs_optimizer_step_begin(zs_optimizer opt, zs_step_result* result);
ZS_API zs_status zs_optimizer_step_end(zs_optimizer opt, zs_step_result* result);

/* A ZS_OPTIM_EXTERNAL optimizer's state of param under `name` (1-128
 * printable characters, no spaces or '/', not "param" or "master"):
 * shard_numel fp32 elements in the context's device memory, zeros when
 * made. create 1: made on the first call; 0: *data is NULL if absent.
 * Checkpoints save it as state `name` of the param and load it at any
 * world size (a load replaces the named states with the saved ones).
 * Local. INVALID_ARGUMENT on another kind or for a param not held. */
ZS_API zs_status zs_optimizer_named_state(zs_optimizer opt, zs_param param, const char* name, int create,
                                          float** data, uint64_t* shard_numel);

/* The current loss scale (1.0 unless fp16 is enabled). */
ZS_API zs_status zs_optimizer_loss_scale(zs_optimizer opt, double* scale);

/* This rank's shard of a param's optimizer state, for checkpoints: slot 0
 * is the fp32 master, 1 exp_avg (Adam) or the momentum buffer (SGD), 2
 * exp_avg_sq (Adam). shard_numel fp32 elements in the context's device
 * memory, readable and writable. State offloaded to NVMe is read into a
 * host copy, valid (and written back to the swap file) until the next
 * step, zs_optimizer_sync_params or checkpoint save/load of the optimizer.
 * INVALID_ARGUMENT for a param the optimizer does not hold or a slot it
 * does not have. INVALID_STATE, naming the config key, for a slot that is
 * not fp32: slot 0 of a bf16 param under bf16.bf16_master_weights_and_grads
 * (its shard is the master: zs_param_shard_data) and slots 1 and 2 of a
 * bf16 param under bf16.bf16_optimizer_states (checkpoints save and load
 * them). */
ZS_API zs_status zs_optimizer_state_data(zs_optimizer opt, zs_param param, int slot, float** data,
                                         uint64_t* shard_numel);
/* Optimizer steps taken (bias correction uses it), and restoring it. After
 * writing master shards, zs_optimizer_sync_params rewrites the working
 * (16-bit) shards from them. */
ZS_API zs_status zs_optimizer_get_step(zs_optimizer opt, int64_t* step);
ZS_API zs_status zs_optimizer_set_step(zs_optimizer opt, int64_t step);
ZS_API zs_status zs_optimizer_sync_params(zs_optimizer opt);

/* ------------------------------------------------------------------ */
/* Healing (docs/healing.md)                                           */
/* ------------------------------------------------------------------ */

/* With zeroshard.healing.peer_copy on (the config's "zeroshard" section, or
 * "auto" and ZS_HEAL=1), each rank's optimizer keeps a replica of another
 * rank's state (its source's) in host memory: seeded at the first step,
 * then stepped from the source's gradient shards (memory kind
 * ZS_MEM_PEER_COPIES). A hash of a state, to compare a replica with its
 * source bit for bit: replica 0 hashes this rank's own state, 1 the
 * replica it holds. Both cover, in the optimizer's param order, each
 * param's shard, fp32 master, moments and update count, and the step
 * count; equal states give equal hashes on any two ranks. *hash receives
 * the XXH3-64 hash; *source (may be NULL) the rank whose state it is;
 * *step (may be NULL) the optimizer steps that state has taken. Under the
 * context's lock; waits for the replica's replay of the last step.
 * INVALID_STATE when the optimizer keeps no peer copy, or (replica 1)
 * before its first step seeded one. Not collective. */
ZS_API zs_status zs_heal_state_digest(uint64_t* hash, int* source, int64_t* step, zs_optimizer opt,
                                      int replica);
/* After a call failed with ZS_ERR_RANK_LOST: the survivors' agreement on
 * opt's committed step, through the store (collective over the ranks still
 * alive: every survivor calls it, for each optimizer in the order they were
 * made). *committed_step receives C, the steps opt has taken on every
 * survivor once it returns; *rolled_forward (may be NULL) 1 when this rank
 * applied step C here (its norm all-reduce failed where another
 * survivor's had completed), else 0. Each lost rank's state at C is the
 * replica its holder keeps (zs_heal_state_digest, replica 1). The context
 * still refuses other work (ZS_ERR_RANK_LOST): exit, and the launcher
 * restarts the job. ZS_ERR_STATE_LOST naming both ranks when a lost rank's
 * holder was lost too (or rank 0, which serves the store); INVALID_STATE
 * when no rank is lost or healing is off. */
ZS_API zs_status zs_heal_agree(int64_t* committed_step, int* rolled_forward, zs_optimizer opt);
/* After zs_heal_agree returned C, when C is the step whose
 * zs_optimizer_step the loss cut short: that step's result as
 * zs_optimizer_step would have returned it (its norm from this rank's norm
 * all-reduce, or from the roll-forward), *found 1; *found 0 (result
 * untouched) when this rank has none for step C (it never got step C's
 * norm: its step C had returned before the loss). */
ZS_API zs_status zs_heal_committed_result(zs_step_result* result, int* found, zs_optimizer opt);
/* A replacement takes a lost rank's place (landing step 3 of
 * docs/healing.md). The launcher starts a process with the lost rank's id
 * and ZS_HEAL_REPLACEMENT=<n> (the n-th process started for that id: 1
 * for the first); it runs the program from the top: zs_context_create
 * meets the survivors in the store's next generation (it waits, up to the
 * context's timeout, for them to post it), zs_param_register skips
 * ZS_INIT_FROM_RANK's scatter and zs_load_pretrained reads nothing. Every
 * rank then calls zs_heal_join for each optimizer, in the order made: the
 * survivors after zs_heal_agree, the replacement once its params and
 * optimizer exist. Survivors readmit the replacement to the heartbeat and
 * reconnect every group with it; the replacement's model, optimizer and
 * config are compared with the survivors' (a difference fails every rank
 * with ZS_ERR_INVALID_STATE naming it); the step the loss cut short is
 * dropped on the survivors (gathers, gradients), and every rank's fetch
 * coordinator starts over (its orders, gathered params and open step); the
 * holder of the lost rank's copy sends it its state at C, and the lowest
 * survivor the trainer's shared state (zs_heal_joined_state).
 * The scheduled hyper-parameters (lr, betas, eps, weight_decay, momentum,
 * dampening) are not compared: the trainer sets the survivors' before the
 * next step. *committed_step receives C on every
 * rank: each redoes step C + 1 with the same batch. Collective over the
 * new world. With zeroshard.healing.min_ranks M (or ZS_HEAL_MIN_RANKS=M,
 * which zsrun --min-nproc M --shrink exports), a loss that leaves at least
 * M ranks live makes it zs_heal_shrink on the survivors: no replacement is
 * awaited, and one started anyway fails at its create with
 * ZS_ERR_NOT_TAKEN. With zeroshard.healing.replacement_wait_s W as well
 * (or ZS_HEAL_REPLACEMENT_WAIT_S, which zsrun --replacement-wait exports),
 * the survivors first wait up to W for the replacements and shrink only
 * if one did not come: the lowest survivor decides, the others and the
 * replacements read its verdict. After a shrink, a process started for a
 * rank left out with ZS_HEAL_JOIN=grow as well (zsrun --regrow-after)
 * waits at its create until the survivors take it back (after one of
 * their zs_optimizer_step calls: the regrow runs inside it, the rank's
 * program unchanged), then calls zs_heal_join as a replacement does and
 * receives its shard of the state laid out over the grown world
 * (docs/healing.md, section 4); NOT_TAKEN at its create when the
 * survivors refuse it or finished first (the message says which).
 * ZS_ERR_TIMEOUT naming the rank when no replacement came
 * within the timeout; INVALID_STATE on a survivor that has not agreed;
 * NOT_SUPPORTED for a replacement of rank 0 where rank 0 served the store. */
ZS_API zs_status zs_heal_join(int64_t* committed_step, zs_optimizer opt);
/* The survivors go on without the lost ranks instead (docs/healing.md,
 * section 4): no replacement joins. Every survivor calls it after
 * zs_heal_agree, for each optimizer in the order made, as it would call
 * zs_heal_join. Ranks keep their ids; the world and heal groups reconnect
 * over the live ranks; every param's shard, fp32 master and moments are
 * laid out anew over them in memory (a lost rank's from its holder's copy,
 * bit for bit), the step the loss cut short dropped; gradients are
 * averaged over the live ranks from the next step on, and the peer copies
 * are placed anew (the next step seeds them). *committed_step receives C:
 * every survivor takes step C + 1 next, the lost ranks' shares of the
 * data left out. Shard pointers handed out before (zs_param_shard_data)
 * point to the old layout: read them again. Collective over the
 * survivors. NOT_SUPPORTED naming the key or param, nothing changed, with
 * offloaded params or optimizer state, params kept as quantized codes,
 * LoCo, MiCS, hpZ or qgZ across nodes, or a param no peer copy carries
 * (in no optimizer, not frozen); STATE_LOST when a lost rank's holder has
 * no copy at C; INVALID_STATE on a rank that has not agreed, or in a
 * replacement. */
ZS_API zs_status zs_heal_shrink(int64_t* committed_step, zs_optimizer opt);
/* The trainer's own state a replacement needs beside the engine's
 * (docs/healing.md, landing step 4), as opaque bytes (zeroshard.torch
 * writes JSON). zs_heal_set_rank_state: this rank's blob (its RNG states)
 * for the step opt takes next, set before that step (zeroshard.torch sets
 * it as its optimizer step begins, after the backward); it rides in that
 * step's peer copy to this rank's holder, which keeps it beside its replica
 * once the step commits (peer-copy memory; nothing goes to the store). Not
 * collective; INVALID_STATE with healing off. zs_heal_set_shared_state:
 * the state every rank has alike (loop position, LR scheduler), set after
 * each committed step's bookkeeping; kept in this process, and the lowest
 * survivor hands it over at zs_heal_join. Both copy the bytes. */
ZS_API zs_status zs_heal_set_rank_state(zs_optimizer opt, const void* data, size_t size);
ZS_API zs_status zs_heal_set_shared_state(zs_context ctx, const void* data, size_t size);
/* What the last zs_heal_join handed this rank, a replacement: which
 * ZS_HEAL_RANK_STATE (its own blob as set before step C),
 * ZS_HEAL_SHARED_STATE (the survivors' shared state) or, in a rank that
 * came back at a regrow (ZS_HEAL_JOIN=grow: no predecessor's blob),
 * ZS_HEAL_DONOR_STATE (the lowest survivor's own blob of the step the
 * regrow came in: what a checkpoint load would give every rank from rank
 * 0, such as module buffers; not its RNG, which would repeat rank 0's
 * draws). *size receives its
 * bytes and *found 1, or 0 and 0 when there was none (no committed step, a
 * trainer that set none, a survivor's context); up to capacity bytes are
 * copied to buffer (NULL with capacity 0 to ask the size). BUFFER_SIZE
 * naming both sizes when capacity is short. Not collective. */
typedef enum zs_heal_state_kind {
  ZS_HEAL_RANK_STATE = 0,
  ZS_HEAL_SHARED_STATE = 1,
  ZS_HEAL_DONOR_STATE = 2,
  ZS_HEAL_STATE_KIND_ENUM_MIN_ = -0x7fffffff - 1, /* keep every int a valid value */
  ZS_HEAL_STATE_KIND_ENUM_MAX_ = 0x7fffffff
} zs_heal_state_kind;
ZS_API zs_status zs_heal_joined_state(size_t* size, int* found, zs_context ctx, zs_heal_state_kind which,
                                      void* buffer, size_t capacity);
/* The job's rendezvous store, served by a process of its own (tools/zsstore,
 * which zsrun --restarts starts) instead of rank 0, so that rank 0's loss
 * takes no store with it: its ranks run with ZS_STORE_SERVER=external and
 * connect to it as clients (MASTER_ADDR, ZS_STORE_PORT). Serves on host
 * (NULL or "": every interface) and port (0: a free one, given in
 * *bound_port, which may be NULL) on a thread of its own until
 * zs_store_server_destroy; clients must prove ZS_JOB_SECRET when it is set
 * in this process. With ZS_STORE_JOURNAL naming a file in this process, the
 * keys are kept there too and a server started on the same file begins with
 * those the last one held (zsrun restarts a dead zsstore so). BOOTSTRAP
 * naming the address when it cannot be bound, or the journal when it cannot
 * be read or written; INVALID_ARGUMENT for a port outside 0..65535. */
ZS_API zs_status zs_store_serve(zs_store_server* server, const char* host, int port, int* bound_port);
ZS_API zs_status zs_store_server_destroy(zs_store_server server);

/* ------------------------------------------------------------------ */
/* Checkpoints                                                         */
/* ------------------------------------------------------------------ */

/* A checkpoint is a directory: manifest.json (params, layouts, optimizer,
 * step, loss scaler, xxHash checksums, the caller's JSON) and one
 * safetensors file per rank (README, "Checkpoints"). */

/* Progress of a long save, load, verify or export, called on the calling
 * thread under the engine lock (see the top of this file): phase is "write", "read", "verify", "export", "reshard" (done/total count
 * bytes) or "manifest", "rename", "latest", "done" (0, 0). */
typedef void (*zs_progress_fn)(void* user, const char* phase, uint64_t done, uint64_t total);

typedef struct zs_checkpoint_save_options {
  size_t size;           /* sizeof(zs_checkpoint_save_options) */
  const char* tag;       /* subdirectory name; NULL: "step-<optimizer steps>" */
  const char* user_json; /* the caller's JSON, kept as is (rank 0's); NULL: {} */
  int timeout_ms;        /* for every rank to finish; 0: the context's timeout */
  int overwrite;         /* 1: replace an existing tag (atomic swap); 0: error */
  int update_latest;     /* 1 (default): <dir>/latest names this tag */
  const char* const* names; /* num_params names to save under (e.g. a
                               framework's qualified names); NULL: each
                               param's registration name */
  zs_progress_fn progress; /* may be NULL; with async_save, not called
                              after zs_checkpoint_save returns */
  void* progress_user;
  int async_save;        /* 1: return once this rank's shards are staged in
                            host memory; the write and commit run in the
                            background (see zs_checkpoint_wait) */
} zs_checkpoint_save_options;
#define ZS_CHECKPOINT_SAVE_OPTIONS_INIT \
  { sizeof(zs_checkpoint_save_options), NULL, NULL, 0, 0, 1, NULL, NULL, NULL, 0 }
/* ZS_CHECKPOINT_SAVE_OPTIONS_INIT for languages without C macros: its values into the
 * first `size` bytes of *options (pass sizeof *options). */
ZS_API zs_status zs_checkpoint_save_options_init(zs_checkpoint_save_options* options, size_t size);

/* Save params (names unique) and, when opt is not NULL, its state, step
 * count, hyper-parameters and loss scaler into <dir>/<tag> (<dir> made
 * with its missing parents, on rank 0). Collective over
 * the world: every rank passes the same params in the same order. Crash
 * safe: written under <dir>/.<tag>.partial, fsynced, renamed into place,
 * then <dir>/latest replaced by rename; a process killed at any point
 * leaves the previous checkpoint and latest loadable. A rank that fails or
 * does not call save within the timeout makes every rank fail, naming it. */
ZS_API zs_status zs_checkpoint_save(zs_context ctx, const zs_param* params, size_t num_params,
                                    zs_optimizer opt, const char* dir,
                                    const zs_checkpoint_save_options* options);

/* Waits for ctx's asynchronous save in flight (options->async_save), if
 * any, and returns its status: an error names the checkpoint
 * ("asynchronous checkpoint save of '<dir>/<tag>' failed: ..."). The next
 * save, a load and zs_context_destroy wait for it too (the destroy prints
 * an error nobody collected on stderr). A kill during the background write
 * leaves the previous checkpoint and latest as they were. */
ZS_API zs_status zs_checkpoint_wait(zs_context ctx);

typedef struct zs_checkpoint_load_options {
  size_t size;      /* sizeof(zs_checkpoint_load_options) */
  const char* tag;  /* NULL: path itself if it holds manifest.json, else path/latest */
  int strict;       /* 1 (default): a saved param not among params is an error */
  const char* const* names; /* as in zs_checkpoint_save_options */
  zs_progress_fn progress; /* may be NULL */
  void* progress_user;
} zs_checkpoint_load_options;
#define ZS_CHECKPOINT_LOAD_OPTIONS_INIT \
  { sizeof(zs_checkpoint_load_options), NULL, 1, NULL, NULL, NULL }
/* ZS_CHECKPOINT_LOAD_OPTIONS_INIT for languages without C macros: its values into the
 * first `size` bytes of *options (pass sizeof *options). */
ZS_API zs_status zs_checkpoint_load_options_init(zs_checkpoint_load_options* options, size_t size);

typedef struct zs_checkpoint_info {
  size_t size;           /* sizeof(zs_checkpoint_info) */
  int64_t step;          /* optimizer steps when saved */
  uint64_t bytes_read;   /* by this rank */
  const char* dir;       /* the checkpoint directory loaded */
  const char* user_json; /* as saved */
} zs_checkpoint_info;
#define ZS_CHECKPOINT_INFO_INIT { sizeof(zs_checkpoint_info), 0, 0, NULL, NULL }
/* ZS_CHECKPOINT_INFO_INIT for languages without C macros: its values into the
 * first `size` bytes of *info (pass sizeof *info). */
ZS_API zs_status zs_checkpoint_info_init(zs_checkpoint_info* info, size_t size);

/* Load into params (matched by name; shapes must agree) at any world size
 * and working dtype: each rank reads only the byte ranges that overlap its
 * shards and verifies their checksums; nothing changes on any rank unless
 * every rank read its part. With opt, its state, step count, group
 * hyper-parameters and loss scaler are restored (the groups must hold the
 * same params as when saved). info may be NULL; its strings are owned by
 * the context, valid until the next load on it. Collective over the world. */
ZS_API zs_status zs_checkpoint_load(zs_context ctx, const zs_param* params, size_t num_params,
                                    zs_optimizer opt, const char* path,
                                    const zs_checkpoint_load_options* options,
                                    zs_checkpoint_info* info);

/* Read every byte of a checkpoint (tag NULL: as for load) and check every
 * checksum: ZS_ERR_IO names each file and tensor that fails. Needs no
 * context. */
ZS_API zs_status zs_checkpoint_verify(const char* path, const char* tag, zs_progress_fn progress,
                                      void* progress_user);

typedef struct zs_checkpoint_export_options {
  size_t size;     /* sizeof(zs_checkpoint_export_options) */
  const char* tag; /* NULL: as for load */
  int fp32;        /* 1: fp32 tensors (the masters where saved); 0: working dtypes */
  zs_progress_fn progress; /* may be NULL */
  void* progress_user;
} zs_checkpoint_export_options;
#define ZS_CHECKPOINT_EXPORT_OPTIONS_INIT \
  { sizeof(zs_checkpoint_export_options), NULL, 0, NULL, NULL }
/* ZS_CHECKPOINT_EXPORT_OPTIONS_INIT for languages without C macros: its values into the
 * first `size` bytes of *options (pass sizeof *options). */
ZS_API zs_status zs_checkpoint_export_options_init(zs_checkpoint_export_options* options, size_t size);

/* One safetensors file of full tensors under their registration names
 * (metadata format "pt": Hugging Face from_pretrained reads it), streamed
 * with memory bounded by a buffer; written beside out_file and renamed.
 * Needs no context. */
ZS_API zs_status zs_checkpoint_export(const char* path, const char* out_file,
                                      const zs_checkpoint_export_options* options);

/* Rewrite a checkpoint (tag NULL: as for load) for world_size ranks into
 * out_dir, a new checkpoint directory that must not exist yet (written
 * beside it and renamed). Loading reshards by itself; this is for moving
 * checkpoints to a cluster of another size ahead of time. Needs no
 * context. */
ZS_API zs_status zs_checkpoint_reshard(const char* path, const char* tag, const char* out_dir,
                                       int world_size, zs_progress_fn progress, void* progress_user);

typedef struct zs_export_options {
  size_t size;              /* sizeof(zs_export_options) */
  const char* const* names; /* num_params tensor names; NULL: registration names */
  zs_progress_fn progress;  /* may be NULL; phase "export" */
  void* progress_user;
} zs_export_options;
#define ZS_EXPORT_OPTIONS_INIT { sizeof(zs_export_options), NULL, NULL, NULL }
/* ZS_EXPORT_OPTIONS_INIT for languages without C macros: its values into the
 * first `size` bytes of *options (pass sizeof *options). */
ZS_API zs_status zs_export_options_init(zs_export_options* options, size_t size);

/* One safetensors file of the full params from a live run (DeepSpeed's
 * gather_16bit_weights_on_model_save): each param is gathered in turn and
 * rank 0 streams it to out_file (written beside it, fsynced, renamed), so
 * no rank holds more than one full param. The same bytes as
 * zs_checkpoint_export of a checkpoint of these params. Collective over
 * the world; every rank fails alike when rank 0 cannot write. */
ZS_API zs_status zs_export_safetensors(zs_context ctx, const zs_param* params, size_t num_params,
                                       const char* out_file, const zs_export_options* options);

typedef struct zs_safetensors_load_options {
  size_t size;              /* sizeof(zs_safetensors_load_options) */
  const char* const* names; /* num_params tensor names; NULL: registration names */
  int strict;               /* 1 (default): a param the files lack is an error; 0: left as is */
  int from_rank0;           /* 1: only rank 0 reads (the files need not exist elsewhere), one
                               full tensor at a time, and scatters the shards; params
                               partitioned over the world. 0 (default): every rank reads
                               its own bytes */
  zs_progress_fn progress;  /* may be NULL; phase "read" */
  void* progress_user;
} zs_safetensors_load_options;
#define ZS_SAFETENSORS_LOAD_OPTIONS_INIT \
  { sizeof(zs_safetensors_load_options), NULL, 1, 0, NULL, NULL }
/* ZS_SAFETENSORS_LOAD_OPTIONS_INIT for languages without C macros: its values into the
 * first `size` bytes of *options (pass sizeof *options). */
ZS_API zs_status zs_safetensors_load_options_init(zs_safetensors_load_options* options, size_t size);

/* Full tensors (e.g. pretrained weights) into partitioned params from a
 * .safetensors file, a Hugging Face index (.json), or a directory holding
 * model.safetensors.index.json or model.safetensors. Every rank must see
 * the files: each preads only its own shards' bytes and casts them to the
 * param's dtype (F32, BF16, F16 in the file). With opt, the fp32 masters of
 * 16-bit params take the file's values too. Nothing changes unless every
 * rank read its part. Collective over the world. */
ZS_API zs_status zs_load_safetensors(zs_context ctx, const zs_param* params, size_t num_params,
                                     zs_optimizer opt, const char* path,
                                     const zs_safetensors_load_options* options);

/* ------------------------------------------------------------------ */
/* Coordinated fetch: trace, prefetch, persistence, leaf groups        */
/* ------------------------------------------------------------------ */

/* Mark a step (a training step, or one inference forward). A step records
 * the order of its coordinated fetches; later steps of the same order
 * gather ahead along it (config: stage3_prefetch_bucket_size,
 * stage3_max_live_parameters, stage3_param_persistence_threshold,
 * stage3_max_reuse_distance). The last 4 distinct orders are kept, so steps
 * that take turns between kinds (a reference model's forward, then the
 * policy's training step) each gather ahead. A step whose order differs on
 * any rank drops the kept orders on every rank and is recorded instead; a
 * step of more than 2^18 fetches is not recorded. At the end of a step that
 * pushed no gradient (an inference forward), what the next step uses within
 * stage3_max_reuse_distance elements stays gathered, up to
 * stage3_max_live_parameters. zs_step_end is collective over the world (a
 * quiet step's: see zs_step_end_agree). */
ZS_API zs_status zs_step_begin(zs_context ctx);
ZS_API zs_status zs_step_end(zs_context ctx);
/* zs_step_end, whose one collective also tells every rank whether all
 * passed the same `token` (*same = 1) or not (0): a trainer's own
 * agreement that costs no collective of its own. A quiet step (nothing
 * gathered, and either no fetch recorded, every unit's params kept
 * gathered, or nothing released and no gradient pushed, running on what the
 * last step kept) runs no collective at its end, except every 64th quiet
 * step in a row; where it ran none, *same = -1 (not compared, alike on
 * every rank). For what every rank must do at the same step but learns
 * at different times: pass a hash of it (say, of the params a garbage
 * collector dropped, whose timing differs between ranks) and act once
 * *same is 1. */
ZS_API zs_status zs_step_end_agree(zs_context ctx, uint64_t token, int* same);

/* A module's params before it runs: blocks until all are AVAILABLE
 * (gathering whatever was not prefetched). A param in a leaf group brings
 * its whole group. Collective like zs_fetch when something must be
 * gathered; ranks must call it in the same order. */
ZS_API zs_status zs_coord_fetch(zs_context ctx, const zs_param* params, size_t num_params);
/* After the module: releases what the coordinator gathered, except params
 * under the persistence threshold (kept until the next optimizer step) and
 * params the trace needs again within the reuse distance. Local. */
ZS_API zs_status zs_coord_release(zs_context ctx, const zs_param* params, size_t num_params);
/* Make params one unit, fetched and released together (the reference's
 * leaf modules: e.g. every expert of an MoE layer, so that ranks routing
 * to different experts issue the same collectives). Local, but every rank
 * must declare the same leaf groups. */
ZS_API zs_status zs_leaf_group(zs_context ctx, const zs_param* params, size_t num_params);

typedef struct zs_coord_stats {
  size_t size; /* sizeof(zs_coord_stats) */
  uint64_t steps;
  uint64_t fetch_calls;
  uint64_t demand_fetches; /* gathers issued only when asked (not prefetched) */
  uint64_t prefetches;     /* gathers issued ahead along the trace */
  uint64_t blocked_waits;  /* prefetched gathers still running when needed */
  uint64_t reuse_hits;     /* fetches that needed no gather at all */
  uint64_t kept_for_reuse; /* releases skipped for the reuse distance */
  uint64_t persistent_params;
  uint64_t live_elements;  /* gathered by the coordinator now */
  uint64_t peak_live_elements;
  uint64_t trace_invalidations; /* steps recorded while other orders were kept; kept orders dropped */
  uint64_t trace_length;   /* units of the order the last step recorded or followed */
} zs_coord_stats;
#define ZS_COORD_STATS_INIT { sizeof(zs_coord_stats), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }

/* ZS_COORD_STATS_INIT for languages without C macros: its values into the
 * first `size` bytes of *stats (pass sizeof *stats). */
ZS_API zs_status zs_coord_stats_init(zs_coord_stats* stats, size_t size);

ZS_API zs_status zs_coord_get_stats(zs_context ctx, zs_coord_stats* stats);

/* ------------------------------------------------------------------ */
/* Step summary and timeline                                           */
/* ------------------------------------------------------------------ */

/* What happened on this rank between the end of the previous optimizer step
 * (or the optimizer's creation) and the end of the last one. Bytes are what
 * reached this rank over the wire (ring algorithms: (n-1)/n of a gathered
 * buffer, 2(n-1)/n of an all-reduced one); seconds are those the collectives
 * ran, overlapping the trainer's compute or not. wait_seconds is the time
 * the trainer stood still for them: fetches that found their gather still
 * running, and the gradient reduction the step waited for. Never waits for
 * work in progress. With ZS_TRACE=path every collective, wait and optimizer
 * step also goes on a Chrome-trace timeline, one file per rank ("%r" in the
 * path is the rank, else ".rank<N>.json" is appended). */
typedef struct zs_step_stats {
  size_t size; /* sizeof(zs_step_stats) */
  int64_t step;                 /* the optimizer step these figures end with (0: none yet) */
  double step_seconds;          /* wall time of the whole step, forward and backward included */
  double gather_seconds;        /* all-gathers: param fetches */
  uint64_t gather_bytes;
  uint64_t gathers;
  double reduce_scatter_seconds; /* gradient reduction */
  uint64_t reduce_scatter_bytes;
  uint64_t reduce_scatters;
  double allreduce_seconds;     /* norms, agreement checks, MiCS replica averages */
  uint64_t allreduce_bytes;
  double other_comm_seconds;    /* broadcasts, scatters, barriers */
  uint64_t other_comm_bytes;
  double wait_seconds;          /* the trainer blocked on collectives */
  double optimizer_seconds;     /* the update itself */
  /* Healing's peer copy (zeroshard.healing.peer_copy; 0 without): this
   * step's copy on the trainer's path (the gradient shards to this rank's
   * holder, its source's into the replica this rank holds, and the wait
   * for the replay before), the bytes received into that replica (its
   * seed included, when one came), and the last replay this rank finished
   * of its source's step on the replica (on a thread of its own, while the
   * step's forward and backward ran). */
  double peer_copy_seconds;
  uint64_t peer_copy_bytes;
  double replay_seconds;
} zs_step_stats;
#define ZS_STEP_STATS_INIT { sizeof(zs_step_stats), 0, 0.0, 0.0, 0, 0, 0.0, 0, 0, 0.0, 0, 0.0, 0, 0.0, 0.0, 0.0, 0, 0.0 }

/* ZS_STEP_STATS_INIT for languages without C macros: its values into the
 * first `size` bytes of *stats (pass sizeof *stats). */
ZS_API zs_status zs_step_stats_init(zs_step_stats* stats, size_t size);

ZS_API zs_status zs_context_step_stats(zs_context ctx, zs_step_stats* stats);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ZEROSHARD_ZEROSHARD_H */
