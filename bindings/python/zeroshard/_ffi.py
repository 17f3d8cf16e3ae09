"""cffi (ABI mode) declarations of include/zeroshard/zeroshard.h and the loader.

``CDEF`` mirrors the public header by hand: every typedef, enum, struct and
function. ``tests/test_binding_header.py`` compares it with the real header
(function types, enum values, struct sizes and field offsets as the C
compiler lays them out), so a change to the header that is not made here
fails the tests.

The library is looked up, first hit wins:

1. ``$ZEROSHARD_LIBRARY`` (a path). When set, it is the only candidate: a
   library named explicitly is never silently replaced by another one.
2. ``libzeroshard.so*`` next to this file (shipped by ``setup.py``).
3. The dynamic loader's search path: ``libzeroshard.so.0``, then
   ``libzeroshard.so``.
"""
import glob
import os

import cffi

__all__ = ["ffi", "lib", "library_path", "CDEF", "ZS_VERSION_MAJOR", "ZS_VERSION_MINOR",
           "ZS_VERSION_PATCH", "ZS_VERSION", "ZS_MAX_DIMS", "ZS_WAIT_FOREVER",
           "ZS_EXIT_STATE_LOST", "ZS_EXIT_NOT_TAKEN"]

# Macros of the header (cffi's ABI mode cannot read their values from the
# library; the *_INIT initialisers are the library's zs_xxx_init functions).
ZS_VERSION_MAJOR = 0
ZS_VERSION_MINOR = 1
ZS_VERSION_PATCH = 0
ZS_VERSION = ZS_VERSION_MAJOR * 10000 + ZS_VERSION_MINOR * 100 + ZS_VERSION_PATCH
ZS_MAX_DIMS = 8
ZS_WAIT_FOREVER = -1
ZS_EXIT_STATE_LOST = 75
ZS_EXIT_NOT_TAKEN = 76

CDEF = r"""
/* Version */
const char* zs_version(int* major, int* minor, int* patch);

/* Status and errors */
typedef enum zs_status {
  ZS_OK = 0,
  ZS_ERR_INVALID_ARGUMENT = 1,
  ZS_ERR_INVALID_HANDLE = 2,
  ZS_ERR_INVALID_STATE = 3,
  ZS_ERR_INVALID_CONFIG = 4,
  ZS_ERR_OUT_OF_MEMORY = 5,
  ZS_ERR_TIMEOUT = 6,
  ZS_ERR_COMM = 7,
  ZS_ERR_BOOTSTRAP = 8,
  ZS_ERR_NOT_SUPPORTED = 9,
  ZS_ERR_BUFFER_SIZE = 10,
  ZS_ERR_INTERNAL = 11,
  ZS_ERR_IO = 12,
  ZS_ERR_RANK_LOST = 13,
  ZS_ERR_STATE_LOST = 14,
  ZS_ERR_NOT_TAKEN = 15,
  ZS_STATUS_ENUM_MIN_ = -2147483648,
  ZS_STATUS_ENUM_MAX_ = 2147483647
} zs_status;

const char* zs_status_string(zs_status status);
const char* zs_last_error(void);

/* Types */
typedef enum zs_dtype {
  ZS_FLOAT32 = 0,
  ZS_BFLOAT16 = 1,
  ZS_FLOAT16 = 2,
  ZS_UINT8 = 3,
  ZS_DTYPE_ENUM_MIN_ = -2147483648,
  ZS_DTYPE_ENUM_MAX_ = 2147483647
} zs_dtype;

/* Where memory lives; DLPack's values (kDLCPU, kDLCUDA). */
typedef enum zs_device_type {
  ZS_DEVICE_CPU = 1,
  ZS_DEVICE_CUDA = 2,
  ZS_DEVICE_TYPE_ENUM_MIN_ = -2147483648,
  ZS_DEVICE_TYPE_ENUM_MAX_ = 2147483647
} zs_device_type;

typedef enum zs_reduce_op {
  ZS_SUM = 0,
  ZS_AVG = 1,
  ZS_MAX = 2,
  ZS_MIN = 3,
  ZS_REDUCE_OP_ENUM_MIN_ = -2147483648,
  ZS_REDUCE_OP_ENUM_MAX_ = 2147483647
} zs_reduce_op;

typedef enum zs_param_status {
  ZS_PARAM_NOT_AVAILABLE = 0,
  ZS_PARAM_INFLIGHT = 1,
  ZS_PARAM_AVAILABLE = 2,
  ZS_PARAM_STATUS_ENUM_MIN_ = -2147483648,
  ZS_PARAM_STATUS_ENUM_MAX_ = 2147483647
} zs_param_status;

typedef enum zs_init {
  ZS_INIT_ZEROS = 0,
  ZS_INIT_FROM_RANK = 1,
  ZS_INIT_FROM_ALL = 2,
  ZS_INIT_NORMAL = 3,
  ZS_INIT_UNIFORM = 4,
  ZS_INIT_ENUM_MIN_ = -2147483648,
  ZS_INIT_ENUM_MAX_ = 2147483647
} zs_init;

typedef enum zs_group_kind {
  ZS_GROUP_WORLD = 0,
  ZS_GROUP_PARTITION = 1,
  ZS_GROUP_MICS_SHARD = 2,
  ZS_GROUP_MICS_REPLICA = 3,
  ZS_GROUP_HPZ = 4,
  ZS_GROUP_MICS_INTER = 5,
  ZS_GROUP_MICS_INTRA = 6,
  ZS_GROUP_KIND_ENUM_MIN_ = -2147483648,
  ZS_GROUP_KIND_ENUM_MAX_ = 2147483647
} zs_group_kind;

typedef struct zs_context_s* zs_context;
typedef struct zs_group_s* zs_group;
typedef struct zs_param_s* zs_param;
typedef struct zs_gather_s* zs_gather;
typedef struct zs_work_s* zs_work;
typedef struct zs_optimizer_s* zs_optimizer;
typedef struct zs_store_server_s* zs_store_server;

struct DLManagedTensor;

/* Context */
typedef struct zs_context_options {
  size_t size;
  int rank;
  int world_size;
  int local_rank;
  int local_world_size;
  const char* store_host;
  int store_port;
  const char* file_store_path;
  const char* config_json;
  const char* config_path;
  int timeout_ms;
  const char* transport_host;
  const char* device;
  const char* backend;
} zs_context_options;
zs_status zs_context_options_init(zs_context_options* options, size_t size);

zs_status zs_context_create(zs_context* out, const zs_context_options* options);
zs_status zs_context_destroy(zs_context ctx);
zs_status zs_context_rank(zs_context ctx, int* rank);
zs_status zs_context_world_size(zs_context ctx, int* world_size);
zs_status zs_context_local_rank(zs_context ctx, int* local_rank);
zs_status zs_context_local_world_size(zs_context ctx, int* local_world_size);
zs_status zs_context_async_error(zs_context ctx);
zs_status zs_context_config_json(zs_context ctx, const char** json);
zs_status zs_context_unused_config_keys(zs_context ctx, const char** json_array);
zs_status zs_context_inactive_config_keys(zs_context ctx, const char** json_array);
zs_status zs_config_check(const char* config_json, int world_size);

typedef struct zs_memory_stats {
  size_t size;
  uint64_t shard_bytes;
  uint64_t gathered_bytes;
  uint64_t peak_gathered_bytes;
  uint64_t unsharded_bytes;
  uint64_t num_params;
  uint64_t host_cache_bytes;
  uint64_t grad_bytes;
  uint64_t optimizer_bytes;
  uint64_t hpz_secondary_bytes;
  uint64_t device_cache_bytes;
  uint64_t device_system_allocs;
  uint64_t device_reuses;
  uint64_t nvme_bytes;
  uint64_t loco_error_bytes;
  uint64_t device_bytes;
  uint64_t host_bytes;
  uint64_t host_pinned_bytes;
} zs_memory_stats;
zs_status zs_memory_stats_init(zs_memory_stats* stats, size_t size);

typedef struct zs_fetch_stats {
  size_t size;
  uint64_t gathers;
  uint64_t hpz_gathers;
  uint64_t hierarchical_gathers;
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
  uint64_t other_bytes_sent;
  uint64_t other_bytes_received;
} zs_fetch_stats;
zs_status zs_fetch_stats_init(zs_fetch_stats* stats, size_t size);

zs_status zs_context_fetch_stats(zs_context ctx, zs_fetch_stats* stats);
zs_status zs_context_device(zs_context ctx, zs_device_type* type, int* device_id,
                            const char** backend);
zs_status zs_cuda_device_count(int* count, const char** reason);
zs_status zs_context_memory(zs_context ctx, zs_memory_stats* stats);
typedef enum zs_memory_kind {
  ZS_MEM_SHARDS = 0,
  ZS_MEM_MASTERS = 1,
  ZS_MEM_OPTIMIZER_STATE = 2,
  ZS_MEM_GRADS = 3,
  ZS_MEM_GATHERED = 4,
  ZS_MEM_HPZ_SECONDARY = 5,
  ZS_MEM_REDUCE_BUCKETS = 6,
  ZS_MEM_COMM_STAGING = 7,
  ZS_MEM_SCRATCH = 8,
  ZS_MEM_IO_STAGING = 9,
  ZS_MEM_UNTAGGED = 10,
  ZS_MEM_PEER_COPIES = 11,
  ZS_MEM_INBOXES = 12,
  ZS_MEM_KIND_COUNT = 13,
  ZS_MEM_KIND_ENUM_MIN_ = -2147483648,
  ZS_MEM_KIND_ENUM_MAX_ = 2147483647
} zs_memory_kind;
typedef enum zs_memory_phase {
  ZS_PHASE_NOW = -1,
  ZS_PHASE_CONSTRUCTION = 0,
  ZS_PHASE_FORWARD = 1,
  ZS_PHASE_BACKWARD = 2,
  ZS_PHASE_STEP = 3,
  ZS_PHASE_CHECKPOINT = 4,
  ZS_PHASE_COUNT = 5,
  ZS_PHASE_ENUM_MIN_ = -2147483648,
  ZS_PHASE_ENUM_MAX_ = 2147483647
} zs_memory_phase;
zs_status zs_memory_by_kind(zs_context ctx, zs_memory_phase phase, uint64_t* bytes, size_t capacity,
                            size_t* num_kinds, uint64_t* total);
zs_status zs_memory_pools_in_use(zs_context ctx, uint64_t* bytes);
zs_status zs_memory_get_phase(zs_context ctx, zs_memory_phase* phase);
zs_status zs_memory_set_phase(zs_context ctx, zs_memory_phase phase);
zs_status zs_memory_reset_peaks(zs_context ctx);
const char* zs_memory_kind_name(zs_memory_kind kind);
const char* zs_memory_phase_name(zs_memory_phase phase);
typedef enum zs_copy_kind {
  ZS_COPY_GRAD_INTO_BUCKET = 0,
  ZS_COPY_BUCKET_COMPACTION = 1,
  ZS_COPY_GRAD_ONTO_DEVICE = 2,
  ZS_COPY_INTO_GRAD_SHARD = 3,
  ZS_COPY_WIRE_WIDEN = 4,
  ZS_COPY_MICS_REPLICA = 5,
  ZS_COPY_MASTER_REFRESH = 6,
  ZS_COPY_PARAM_CAST = 7,
  ZS_COPY_GRAD_SPILL = 8,
  ZS_COPY_GROUP_OF_ONE = 9,
  ZS_COPY_GATHER_STAGING = 10,
  ZS_COPY_COMM_STAGING = 11,
  ZS_COPY_OTHER = 12,
  ZS_COPY_KIND_COUNT = 13,
  ZS_COPY_KIND_ENUM_MIN_ = -2147483648,
  ZS_COPY_KIND_ENUM_MAX_ = 2147483647
} zs_copy_kind;
typedef enum zs_copy_span {
  ZS_COPIES_TOTAL = 0,
  ZS_COPIES_LAST_STEP = 1,
  ZS_COPY_SPAN_ENUM_MIN_ = -2147483648,
  ZS_COPY_SPAN_ENUM_MAX_ = 2147483647
} zs_copy_span;
zs_status zs_copied_bytes(zs_context ctx, zs_copy_span span, uint64_t* bytes, size_t capacity,
                          size_t* num_kinds, uint64_t* total);
const char* zs_copy_kind_name(zs_copy_kind kind);

/* Groups */
zs_status zs_context_group(zs_group* out, zs_context ctx, zs_group_kind kind);
zs_status zs_group_create(zs_group* out, zs_context ctx, const int* ranks, int num_ranks);
zs_status zs_group_destroy(zs_group group);
zs_status zs_group_rank(zs_group group, int* rank);
zs_status zs_group_size(zs_group group, int* size);
zs_status zs_group_world_rank(zs_group group, int group_rank, int* world_rank);

/* Collectives */
zs_status zs_allgather(zs_work* out, zs_group group, const void* send,
                       void* recv, size_t count, zs_dtype dtype);
zs_status zs_reduce_scatter(zs_work* out, zs_group group, const void* send,
                            void* recv, size_t recv_count, zs_dtype dtype,
                            zs_reduce_op op);
zs_status zs_allreduce(zs_work* out, zs_group group, const void* send, void* recv,
                       size_t count, zs_dtype dtype, zs_reduce_op op);
zs_status zs_broadcast(zs_work* out, zs_group group, void* buf, size_t count,
                       zs_dtype dtype, int root);
zs_status zs_barrier(zs_work* out, zs_group group);
zs_status zs_work_wait(zs_work work, int timeout_ms);
zs_status zs_work_test(zs_work work, int* done);
zs_status zs_work_destroy(zs_work work);

/* Partitioned parameters */
typedef struct zs_param_options {
  size_t size;
  const char* name;
  zs_dtype dtype;
  int ndim;
  const int64_t* shape;
  zs_init init;
  const void* data;
  size_t data_bytes;
  int src_rank;
  uint64_t seed;
  double a, b;
  zs_group group;
} zs_param_options;
zs_status zs_param_options_init(zs_param_options* options, size_t size);

zs_status zs_param_register(zs_param* out, zs_context ctx, const zs_param_options* options);
zs_status zs_param_destroy(zs_param param);

typedef struct zs_param_info {
  size_t size;
  const char* name;
  zs_dtype dtype;
  int ndim;
  int64_t shape[8];
  uint64_t numel;
  uint64_t shard_numel;
  uint64_t padded_numel;
  uint64_t shard_offset;
  uint64_t shard_valid;
  zs_param_status status;
  zs_device_type device_type;
  int device_id;
  uint64_t shard_version;
} zs_param_info;
zs_status zs_param_info_init(zs_param_info* info, size_t size);

zs_status zs_param_get_info(zs_param param, zs_param_info* info);
zs_status zs_param_get_status(zs_param param, zs_param_status* status);
zs_status zs_param_shard_data(zs_param param, void** data, uint64_t* shard_numel);
zs_status zs_fetch(zs_gather* out, zs_context ctx, const zs_param* params, size_t num_params);
zs_status zs_gather_wait(zs_gather gather, int timeout_ms);
zs_status zs_gather_test(zs_gather gather, int* done);
zs_status zs_gather_destroy(zs_gather gather);
zs_status zs_param_data(zs_param param, void** data);
zs_status zs_param_copy_to(zs_param param, void* dst, size_t dst_bytes);
zs_status zs_param_to_dlpack(zs_param param, struct DLManagedTensor** out);
zs_status zs_release(zs_context ctx, const zs_param* params, size_t num_params);
zs_status zs_param_update(zs_context ctx, const zs_param* params, size_t num_params,
                          int modifier_rank);
zs_status zs_param_write(zs_param param, const void* data, size_t data_bytes);
zs_status zs_param_freeze(zs_param param);

/* Training: gradients */
zs_status zs_grad_push(zs_param param, const void* grad, zs_dtype dtype, size_t grad_bytes);
zs_status zs_grad_push_many(zs_context ctx, const zs_param* params, size_t n, const void* const* grads,
                            const size_t* grad_bytes, zs_dtype dtype);
zs_status zs_grad_push_borrowed(uint64_t* ticket, zs_param param, const void* grad, zs_dtype dtype,
                                size_t grad_bytes);
zs_status zs_grad_released(zs_context ctx, uint64_t* ticket);
zs_status zs_grad_sync(zs_context ctx);
zs_status zs_grad_set_accumulation_steps(zs_context ctx, int steps);
zs_status zs_grad_discard(zs_context ctx, const zs_param* params, size_t num_params);
zs_status zs_grad_shard_data(zs_param param, float** data, uint64_t* shard_numel);

/* Training: sharded optimizer */
typedef enum zs_optimizer_kind {
  ZS_OPTIM_ADAMW = 0,
  ZS_OPTIM_ADAM = 1,
  ZS_OPTIM_SGD = 2,
  ZS_OPTIM_EXTERNAL = 3,
  ZS_OPTIM_MUON = 4,
  ZS_OPTIM_KIND_ENUM_MIN_ = -2147483648,
  ZS_OPTIM_KIND_ENUM_MAX_ = 2147483647
} zs_optimizer_kind;

typedef struct zs_optim_hparams {
  size_t size;
  double lr;
  double beta1, beta2, eps;
  double weight_decay;
  double momentum, dampening;
  int nesterov;
  int bias_correction;
  int use_muon;
  int ns_method;
  int ns_steps;
} zs_optim_hparams;
zs_status zs_optim_hparams_init(zs_optim_hparams* hparams, size_t size);

zs_status zs_optimizer_create(zs_optimizer* out, zs_context ctx, zs_optimizer_kind kind);
zs_status zs_optimizer_destroy(zs_optimizer opt);
zs_status zs_optimizer_add_group(zs_optimizer opt, const zs_param* params, size_t num_params,
                                 const zs_optim_hparams* hparams, int* group_index);
zs_status zs_optimizer_set_hparams(zs_optimizer opt, int group, const zs_optim_hparams* hparams);
zs_status zs_optimizer_set_lr(zs_optimizer opt, int group, double lr);

typedef struct zs_step_result {
  size_t size;
  int skipped;
  double grad_norm;
  double loss_scale;
  int64_t step;
} zs_step_result;
zs_status zs_step_result_init(zs_step_result* result, size_t size);

zs_status zs_optimizer_step(zs_optimizer opt, zs_step_result* result);
zs_status zs_optimizer_loss_scale(zs_optimizer opt, double* scale);
zs_status zs_optimizer_state_data(zs_optimizer opt, zs_param param, int slot, float** data,
                                  uint64_t* shard_numel);
zs_status zs_optimizer_get_step(zs_optimizer opt, int64_t* step);
zs_status zs_optimizer_set_step(zs_optimizer opt, int64_t step);
zs_status zs_optimizer_sync_params(zs_optimizer opt);
zs_status zs_heal_state_digest(uint64_t* hash, int* source, int64_t* step, zs_optimizer opt, int replica);
zs_status zs_heal_agree(int64_t* committed_step, int* rolled_forward, zs_optimizer opt);
zs_status zs_heal_committed_result(zs_step_result* result, int* found, zs_optimizer opt);
zs_status zs_heal_join(int64_t* committed_step, zs_optimizer opt);
zs_status zs_heal_shrink(int64_t* committed_step, zs_optimizer opt);
zs_status zs_heal_set_rank_state(zs_optimizer opt, const void* data, size_t size);
zs_status zs_heal_set_shared_state(zs_context ctx, const void* data, size_t size);
typedef enum zs_heal_state_kind {
  ZS_HEAL_RANK_STATE = 0,
  ZS_HEAL_SHARED_STATE = 1,
  ZS_HEAL_DONOR_STATE = 2,
  ZS_HEAL_STATE_KIND_ENUM_MIN_ = -2147483648,
  ZS_HEAL_STATE_KIND_ENUM_MAX_ = 2147483647
} zs_heal_state_kind;
zs_status zs_heal_joined_state(size_t* size, int* found, zs_context ctx, zs_heal_state_kind which,
                               void* buffer, size_t capacity);
zs_status zs_store_serve(zs_store_server* server, const char* host, int port, int* bound_port);
zs_status zs_store_server_destroy(zs_store_server server);
zs_status zs_optimizer_step_begin(zs_optimizer opt, zs_step_result* result);
zs_status zs_optimizer_step_end(zs_optimizer opt, zs_step_result* result);
zs_status zs_optimizer_named_state(zs_optimizer opt, zs_param param, const char* name, int create,
                                   float** data, uint64_t* shard_numel);
zs_status zs_grad_pushed(zs_param param, int* pushed);
zs_status zs_grad_clip_norm(zs_context ctx, const zs_param* params, size_t num_params, double max_norm,
                            double* total_norm);

/* Checkpoints */
typedef void (*zs_progress_fn)(void* user, const char* phase, uint64_t done, uint64_t total);

typedef struct zs_checkpoint_save_options {
  size_t size;
  const char* tag;
  const char* user_json;
  int timeout_ms;
  int overwrite;
  int update_latest;
  const char* const* names;
  zs_progress_fn progress;
  void* progress_user;
  int async_save;
} zs_checkpoint_save_options;
zs_status zs_checkpoint_save_options_init(zs_checkpoint_save_options* options, size_t size);

zs_status zs_checkpoint_save(zs_context ctx, const zs_param* params, size_t num_params,
                             zs_optimizer opt, const char* dir,
                             const zs_checkpoint_save_options* options);
zs_status zs_checkpoint_wait(zs_context ctx);

typedef struct zs_checkpoint_load_options {
  size_t size;
  const char* tag;
  int strict;
  const char* const* names;
  zs_progress_fn progress;
  void* progress_user;
} zs_checkpoint_load_options;
zs_status zs_checkpoint_load_options_init(zs_checkpoint_load_options* options, size_t size);

typedef struct zs_checkpoint_info {
  size_t size;
  int64_t step;
  uint64_t bytes_read;
  const char* dir;
  const char* user_json;
} zs_checkpoint_info;
zs_status zs_checkpoint_info_init(zs_checkpoint_info* info, size_t size);

zs_status zs_checkpoint_load(zs_context ctx, const zs_param* params, size_t num_params,
                             zs_optimizer opt, const char* path,
                             const zs_checkpoint_load_options* options,
                             zs_checkpoint_info* info);
zs_status zs_checkpoint_verify(const char* path, const char* tag, zs_progress_fn progress,
                               void* progress_user);

typedef struct zs_checkpoint_export_options {
  size_t size;
  const char* tag;
  int fp32;
  zs_progress_fn progress;
  void* progress_user;
} zs_checkpoint_export_options;
zs_status zs_checkpoint_export_options_init(zs_checkpoint_export_options* options, size_t size);

zs_status zs_checkpoint_export(const char* path, const char* out_file,
                               const zs_checkpoint_export_options* options);
zs_status zs_checkpoint_reshard(const char* path, const char* tag, const char* out_dir,
                                int world_size, zs_progress_fn progress, void* progress_user);

typedef struct zs_export_options {
  size_t size;
  const char* const* names;
  zs_progress_fn progress;
  void* progress_user;
} zs_export_options;
zs_status zs_export_options_init(zs_export_options* options, size_t size);

zs_status zs_export_safetensors(zs_context ctx, const zs_param* params, size_t num_params,
                                const char* out_file, const zs_export_options* options);

typedef struct zs_safetensors_load_options {
  size_t size;
  const char* const* names;
  int strict;
  int from_rank0;
  zs_progress_fn progress;
  void* progress_user;
} zs_safetensors_load_options;
zs_status zs_safetensors_load_options_init(zs_safetensors_load_options* options, size_t size);

zs_status zs_load_safetensors(zs_context ctx, const zs_param* params, size_t num_params,
                              zs_optimizer opt, const char* path,
                              const zs_safetensors_load_options* options);

/* Coordinated fetch */
zs_status zs_step_begin(zs_context ctx);
zs_status zs_step_end(zs_context ctx);
zs_status zs_step_end_agree(zs_context ctx, uint64_t token, int* same);
zs_status zs_coord_fetch(zs_context ctx, const zs_param* params, size_t num_params);
zs_status zs_coord_release(zs_context ctx, const zs_param* params, size_t num_params);
zs_status zs_leaf_group(zs_context ctx, const zs_param* params, size_t num_params);

typedef struct zs_coord_stats {
  size_t size;
  uint64_t steps;
  uint64_t fetch_calls;
  uint64_t demand_fetches;
  uint64_t prefetches;
  uint64_t blocked_waits;
  uint64_t reuse_hits;
  uint64_t kept_for_reuse;
  uint64_t persistent_params;
  uint64_t live_elements;
  uint64_t peak_live_elements;
  uint64_t trace_invalidations;
  uint64_t trace_length;
} zs_coord_stats;
zs_status zs_coord_stats_init(zs_coord_stats* stats, size_t size);

zs_status zs_coord_get_stats(zs_context ctx, zs_coord_stats* stats);

typedef struct zs_step_stats {
  size_t size;
  int64_t step;
  double step_seconds;
  double gather_seconds;
  uint64_t gather_bytes;
  uint64_t gathers;
  double reduce_scatter_seconds;
  uint64_t reduce_scatter_bytes;
  uint64_t reduce_scatters;
  double allreduce_seconds;
  uint64_t allreduce_bytes;
  double other_comm_seconds;
  uint64_t other_comm_bytes;
  double wait_seconds;
  double optimizer_seconds;
  double peer_copy_seconds;
  uint64_t peer_copy_bytes;
  double replay_seconds;
} zs_step_stats;
zs_status zs_step_stats_init(zs_step_stats* stats, size_t size);

zs_status zs_context_step_stats(zs_context ctx, zs_step_stats* stats);
"""

ffi = cffi.FFI()
ffi.cdef(CDEF)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_LOADER_NAMES = ("libzeroshard.so.0", "libzeroshard.so")


def _packaged_candidates():
    """libzeroshard.so* next to this file: .so, .so.0 first, then the rest."""
    found = glob.glob(os.path.join(_PACKAGE_DIR, "libzeroshard.so*"))
    rank = {"libzeroshard.so": 0, "libzeroshard.so.0": 1}
    return sorted(found, key=lambda p: (rank.get(os.path.basename(p), 2), p))


def _load():
    tried = []
    explicit = os.environ.get("ZEROSHARD_LIBRARY")
    if explicit:
        candidates = [("$ZEROSHARD_LIBRARY", explicit)]
    else:
        candidates = [("next to the package", p) for p in _packaged_candidates()]
        if not candidates:
            tried.append("next to the package: no libzeroshard.so* in %s" % _PACKAGE_DIR)
        candidates += [("loader path", n) for n in _LOADER_NAMES]
    for where, name in candidates:
        try:
            handle = ffi.dlopen(name)
        except OSError as e:
            tried.append("%s: %s (%s)" % (where, name, e))
            continue
        path = name
        if os.sep in name:
            path = os.path.abspath(name)
        else:
            path = _loaded_path(name) or name
        return handle, path
    raise ImportError("zeroshard: cannot load the libzeroshard shared library; tried:\n  " +
                      "\n  ".join(tried) +
                      "\nSet ZEROSHARD_LIBRARY to the library's path (e.g. build/lib/"
                      "libzeroshard.so) or add its folder to LD_LIBRARY_PATH.")


def _loaded_path(soname):
    """The file the dynamic loader picked for a bare soname (from /proc)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(
                        "libzeroshard.so"):
                    return parts[5].strip()
    except OSError:
        pass
    return None


lib, library_path = _load()
