# The C API of include/zeroshard/zeroshard.h, one `ccall` per function, and
# its types with the C layout. Written by hand; tests/julia (ctest
# julia_ccalls_match_header) checks every ccall's symbol, argument count and
# types, every struct's fields and every constant against the header.

"""
The shared library: `ENV["ZEROSHARD_LIBRARY"]` when the package is loaded
(precompiled, it keeps the value it had then), else `libzeroshard.so.0` from
the loader's path.
"""
const libzeroshard = get(ENV, "ZEROSHARD_LIBRARY", "libzeroshard.so.0")

const ZS_VERSION_MAJOR = 0
const ZS_VERSION_MINOR = 1
const ZS_VERSION_PATCH = 0
const ZS_MAX_DIMS = 8
const ZS_WAIT_FOREVER = Cint(-1)
const ZS_EXIT_STATE_LOST = Cint(75)
const ZS_EXIT_NOT_TAKEN = Cint(76)

# C enums are ints: one alias per enum type, one constant per value.
const zs_status = Cint
const ZS_OK = Cint(0)
const ZS_ERR_INVALID_ARGUMENT = Cint(1)
const ZS_ERR_INVALID_HANDLE = Cint(2)
const ZS_ERR_INVALID_STATE = Cint(3)
const ZS_ERR_INVALID_CONFIG = Cint(4)
const ZS_ERR_OUT_OF_MEMORY = Cint(5)
const ZS_ERR_TIMEOUT = Cint(6)
const ZS_ERR_COMM = Cint(7)
const ZS_ERR_BOOTSTRAP = Cint(8)
const ZS_ERR_NOT_SUPPORTED = Cint(9)
const ZS_ERR_BUFFER_SIZE = Cint(10)
const ZS_ERR_INTERNAL = Cint(11)
const ZS_ERR_IO = Cint(12)
const ZS_ERR_RANK_LOST = Cint(13)
const ZS_ERR_STATE_LOST = Cint(14)
const ZS_ERR_NOT_TAKEN = Cint(15)

const zs_dtype = Cint
const ZS_FLOAT32 = Cint(0)
const ZS_BFLOAT16 = Cint(1)
const ZS_FLOAT16 = Cint(2)
const ZS_UINT8 = Cint(3)

const zs_device_type = Cint
const ZS_DEVICE_CPU = Cint(1)
const ZS_DEVICE_CUDA = Cint(2)

const zs_reduce_op = Cint
const ZS_SUM = Cint(0)
const ZS_AVG = Cint(1)
const ZS_MAX = Cint(2)
const ZS_MIN = Cint(3)

const zs_param_status = Cint
const ZS_PARAM_NOT_AVAILABLE = Cint(0)
const ZS_PARAM_INFLIGHT = Cint(1)
const ZS_PARAM_AVAILABLE = Cint(2)

const zs_init = Cint
const ZS_INIT_ZEROS = Cint(0)
const ZS_INIT_FROM_RANK = Cint(1)
const ZS_INIT_FROM_ALL = Cint(2)
const ZS_INIT_NORMAL = Cint(3)
const ZS_INIT_UNIFORM = Cint(4)

const zs_group_kind = Cint
const ZS_GROUP_WORLD = Cint(0)
const ZS_GROUP_PARTITION = Cint(1)
const ZS_GROUP_MICS_SHARD = Cint(2)
const ZS_GROUP_MICS_REPLICA = Cint(3)
const ZS_GROUP_HPZ = Cint(4)
const ZS_GROUP_MICS_INTER = Cint(5)
const ZS_GROUP_MICS_INTRA = Cint(6)

const zs_optimizer_kind = Cint
const ZS_OPTIM_ADAMW = Cint(0)
const ZS_OPTIM_ADAM = Cint(1)
const ZS_OPTIM_SGD = Cint(2)
const ZS_OPTIM_EXTERNAL = Cint(3)
const ZS_OPTIM_MUON = Cint(4)

const zs_memory_kind = Cint
const ZS_MEM_SHARDS = Cint(0)
const ZS_MEM_MASTERS = Cint(1)
const ZS_MEM_OPTIMIZER_STATE = Cint(2)
const ZS_MEM_GRADS = Cint(3)
const ZS_MEM_GATHERED = Cint(4)
const ZS_MEM_HPZ_SECONDARY = Cint(5)
const ZS_MEM_REDUCE_BUCKETS = Cint(6)
const ZS_MEM_COMM_STAGING = Cint(7)
const ZS_MEM_SCRATCH = Cint(8)
const ZS_MEM_IO_STAGING = Cint(9)
const ZS_MEM_UNTAGGED = Cint(10)
const ZS_MEM_PEER_COPIES = Cint(11)
const ZS_MEM_INBOXES = Cint(12)
const ZS_MEM_KIND_COUNT = Cint(13)

const zs_memory_phase = Cint
const ZS_PHASE_NOW = Cint(-1)
const ZS_PHASE_CONSTRUCTION = Cint(0)
const ZS_PHASE_FORWARD = Cint(1)
const ZS_PHASE_BACKWARD = Cint(2)
const ZS_PHASE_STEP = Cint(3)
const ZS_PHASE_CHECKPOINT = Cint(4)
const ZS_PHASE_COUNT = Cint(5)

const zs_copy_kind = Cint
const ZS_COPY_GRAD_INTO_BUCKET = Cint(0)
const ZS_COPY_BUCKET_COMPACTION = Cint(1)
const ZS_COPY_GRAD_ONTO_DEVICE = Cint(2)
const ZS_COPY_INTO_GRAD_SHARD = Cint(3)
const ZS_COPY_WIRE_WIDEN = Cint(4)
const ZS_COPY_MICS_REPLICA = Cint(5)
const ZS_COPY_MASTER_REFRESH = Cint(6)
const ZS_COPY_PARAM_CAST = Cint(7)
const ZS_COPY_GRAD_SPILL = Cint(8)
const ZS_COPY_GROUP_OF_ONE = Cint(9)
const ZS_COPY_GATHER_STAGING = Cint(10)
const ZS_COPY_COMM_STAGING = Cint(11)
const ZS_COPY_OTHER = Cint(12)
const ZS_COPY_KIND_COUNT = Cint(13)

const zs_copy_span = Cint
const ZS_COPIES_TOTAL = Cint(0)
const ZS_COPIES_LAST_STEP = Cint(1)

# Opaque handles.
const zs_context = Ptr{Cvoid}
const zs_group = Ptr{Cvoid}
const zs_param = Ptr{Cvoid}
const zs_gather = Ptr{Cvoid}
const zs_work = Ptr{Cvoid}
const zs_optimizer = Ptr{Cvoid}
const zs_store_server = Ptr{Cvoid}

# zs_progress_fn: void (*)(void* user, const char* phase, uint64_t done,
# uint64_t total), e.g. `@cfunction(f, Cvoid, (Ptr{Cvoid}, Cstring, UInt64, UInt64))`.
const zs_progress_fn = Ptr{Cvoid}

# Structs, laid out as C lays them out. Mutable, so that `Ref{T}` arguments
# pass a pointer to the object itself; `T()` leaves the fields undefined
# until the library's zs_xxx_init fills them (see `new_struct`).

mutable struct zs_context_options
    size::Csize_t
    rank::Cint
    world_size::Cint
    local_rank::Cint
    local_world_size::Cint
    store_host::Ptr{Cchar}
    store_port::Cint
    file_store_path::Ptr{Cchar}
    config_json::Ptr{Cchar}
    config_path::Ptr{Cchar}
    timeout_ms::Cint
    transport_host::Ptr{Cchar}
    device::Ptr{Cchar}
    backend::Ptr{Cchar}
    zs_context_options() = new()  # filled by zs_context_options_init
end

mutable struct zs_memory_stats
    size::Csize_t
    shard_bytes::UInt64
    gathered_bytes::UInt64
    peak_gathered_bytes::UInt64
    unsharded_bytes::UInt64
    num_params::UInt64
    host_cache_bytes::UInt64
    grad_bytes::UInt64
    optimizer_bytes::UInt64
    hpz_secondary_bytes::UInt64
    device_cache_bytes::UInt64
    device_system_allocs::UInt64
    device_reuses::UInt64
    nvme_bytes::UInt64
    loco_error_bytes::UInt64
    device_bytes::UInt64
    host_bytes::UInt64
    host_pinned_bytes::UInt64
    zs_memory_stats() = new()  # filled by zs_memory_stats_init
end

mutable struct zs_fetch_stats
    size::Csize_t
    gathers::UInt64
    hpz_gathers::UInt64
    hierarchical_gathers::UInt64
    gather_bytes_sent::UInt64
    gather_bytes_received::UInt64
    quantized_gather_bytes_sent::UInt64
    quantized_gather_bytes_received::UInt64
    reduce_scatter_bytes_sent::UInt64
    reduce_scatter_bytes_received::UInt64
    quantized_reduce_bytes_sent::UInt64
    quantized_reduce_bytes_received::UInt64
    allreduce_bytes_sent::UInt64
    allreduce_bytes_received::UInt64
    other_bytes_sent::UInt64
    other_bytes_received::UInt64
    zs_fetch_stats() = new()  # filled by zs_fetch_stats_init
end

mutable struct zs_param_options
    size::Csize_t
    name::Ptr{Cchar}
    dtype::zs_dtype
    ndim::Cint
    shape::Ptr{Int64}
    init::zs_init
    data::Ptr{Cvoid}
    data_bytes::Csize_t
    src_rank::Cint
    seed::UInt64
    a::Cdouble
    b::Cdouble
    group::zs_group
    zs_param_options() = new()  # filled by zs_param_options_init
end

mutable struct zs_param_info
    size::Csize_t
    name::Ptr{Cchar}
    dtype::zs_dtype
    ndim::Cint
    shape::NTuple{8, Int64}
    numel::UInt64
    shard_numel::UInt64
    padded_numel::UInt64
    shard_offset::UInt64
    shard_valid::UInt64
    status::zs_param_status
    device_type::zs_device_type
    device_id::Cint
    shard_version::UInt64
    zs_param_info() = new()  # filled by zs_param_info_init
end

mutable struct zs_optim_hparams
    size::Csize_t
    lr::Cdouble
    beta1::Cdouble
    beta2::Cdouble
    eps::Cdouble
    weight_decay::Cdouble
    momentum::Cdouble
    dampening::Cdouble
    nesterov::Cint
    bias_correction::Cint
    use_muon::Cint
    ns_method::Cint
    ns_steps::Cint
    zs_optim_hparams() = new()  # filled by zs_optim_hparams_init
end

mutable struct zs_step_result
    size::Csize_t
    skipped::Cint
    grad_norm::Cdouble
    loss_scale::Cdouble
    step::Int64
    zs_step_result() = new()  # filled by zs_step_result_init
end

mutable struct zs_checkpoint_save_options
    size::Csize_t
    tag::Ptr{Cchar}
    user_json::Ptr{Cchar}
    timeout_ms::Cint
    overwrite::Cint
    update_latest::Cint
    names::Ptr{Ptr{Cchar}}
    progress::zs_progress_fn
    progress_user::Ptr{Cvoid}
    async_save::Cint
    zs_checkpoint_save_options() = new()  # filled by zs_checkpoint_save_options_init
end

mutable struct zs_checkpoint_load_options
    size::Csize_t
    tag::Ptr{Cchar}
    strict::Cint
    names::Ptr{Ptr{Cchar}}
    progress::zs_progress_fn
    progress_user::Ptr{Cvoid}
    zs_checkpoint_load_options() = new()  # filled by zs_checkpoint_load_options_init
end

mutable struct zs_checkpoint_info
    size::Csize_t
    step::Int64
    bytes_read::UInt64
    dir::Ptr{Cchar}
    user_json::Ptr{Cchar}
    zs_checkpoint_info() = new()  # filled by zs_checkpoint_info_init
end

mutable struct zs_checkpoint_export_options
    size::Csize_t
    tag::Ptr{Cchar}
    fp32::Cint
    progress::zs_progress_fn
    progress_user::Ptr{Cvoid}
    zs_checkpoint_export_options() = new()  # filled by zs_checkpoint_export_options_init
end

mutable struct zs_export_options
    size::Csize_t
    names::Ptr{Ptr{Cchar}}
    progress::zs_progress_fn
    progress_user::Ptr{Cvoid}
    zs_export_options() = new()  # filled by zs_export_options_init
end

mutable struct zs_safetensors_load_options
    size::Csize_t
    names::Ptr{Ptr{Cchar}}
    strict::Cint
    from_rank0::Cint
    progress::zs_progress_fn
    progress_user::Ptr{Cvoid}
    zs_safetensors_load_options() = new()  # filled by zs_safetensors_load_options_init
end

mutable struct zs_coord_stats
    size::Csize_t
    steps::UInt64
    fetch_calls::UInt64
    demand_fetches::UInt64
    prefetches::UInt64
    blocked_waits::UInt64
    reuse_hits::UInt64
    kept_for_reuse::UInt64
    persistent_params::UInt64
    live_elements::UInt64
    peak_live_elements::UInt64
    trace_invalidations::UInt64
    trace_length::UInt64
    zs_coord_stats() = new()  # filled by zs_coord_stats_init
end

mutable struct zs_step_stats
    size::Csize_t
    step::Int64
    step_seconds::Cdouble
    gather_seconds::Cdouble
    gather_bytes::UInt64
    gathers::UInt64
    reduce_scatter_seconds::Cdouble
    reduce_scatter_bytes::UInt64
    reduce_scatters::UInt64
    allreduce_seconds::Cdouble
    allreduce_bytes::UInt64
    other_comm_seconds::Cdouble
    other_comm_bytes::UInt64
    wait_seconds::Cdouble
    optimizer_seconds::Cdouble
    peer_copy_seconds::Cdouble
    peer_copy_bytes::UInt64
    replay_seconds::Cdouble
    zs_step_stats() = new()  # filled by zs_step_stats_init
end

# Functions, in the header's order.

zs_version(major, minor, patch) =
    ccall((:zs_version, libzeroshard), Cstring, (Ptr{Cint}, Ptr{Cint}, Ptr{Cint}), major, minor, patch)
zs_status_string(status) =
    ccall((:zs_status_string, libzeroshard), Cstring, (zs_status,), status)
zs_last_error() =
    ccall((:zs_last_error, libzeroshard), Cstring, ())
zs_context_options_init(options, size) =
    ccall((:zs_context_options_init, libzeroshard), zs_status, (Ref{zs_context_options}, Csize_t), options, size)
zs_context_create(out_, options) =
    ccall((:zs_context_create, libzeroshard), zs_status, (Ptr{zs_context}, Ref{zs_context_options}), out_, options)
zs_context_destroy(ctx) =
    ccall((:zs_context_destroy, libzeroshard), zs_status, (zs_context,), ctx)
zs_context_rank(ctx, rank) =
    ccall((:zs_context_rank, libzeroshard), zs_status, (zs_context, Ptr{Cint}), ctx, rank)
zs_context_world_size(ctx, world_size) =
    ccall((:zs_context_world_size, libzeroshard), zs_status, (zs_context, Ptr{Cint}), ctx, world_size)
zs_context_local_rank(ctx, local_rank) =
    ccall((:zs_context_local_rank, libzeroshard), zs_status, (zs_context, Ptr{Cint}), ctx, local_rank)
zs_context_local_world_size(ctx, local_world_size) =
    ccall((:zs_context_local_world_size, libzeroshard), zs_status, (zs_context, Ptr{Cint}), ctx, local_world_size)
zs_context_async_error(ctx) =
    ccall((:zs_context_async_error, libzeroshard), zs_status, (zs_context,), ctx)
zs_context_config_json(ctx, json) =
    ccall((:zs_context_config_json, libzeroshard), zs_status, (zs_context, Ptr{Ptr{Cchar}}), ctx, json)
zs_context_unused_config_keys(ctx, json_array) =
    ccall((:zs_context_unused_config_keys, libzeroshard), zs_status, (zs_context, Ptr{Ptr{Cchar}}), ctx, json_array)
zs_context_inactive_config_keys(ctx, json_array) =
    ccall((:zs_context_inactive_config_keys, libzeroshard), zs_status, (zs_context, Ptr{Ptr{Cchar}}), ctx, json_array)
zs_config_check(config_json, world_size) =
    ccall((:zs_config_check, libzeroshard), zs_status, (Cstring, Cint), config_json, world_size)
zs_memory_stats_init(stats, size) =
    ccall((:zs_memory_stats_init, libzeroshard), zs_status, (Ref{zs_memory_stats}, Csize_t), stats, size)
zs_fetch_stats_init(stats, size) =
    ccall((:zs_fetch_stats_init, libzeroshard), zs_status, (Ref{zs_fetch_stats}, Csize_t), stats, size)
zs_context_fetch_stats(ctx, stats) =
    ccall((:zs_context_fetch_stats, libzeroshard), zs_status, (zs_context, Ref{zs_fetch_stats}), ctx, stats)
zs_context_device(ctx, type_, device_id, backend) =
    ccall((:zs_context_device, libzeroshard), zs_status, (zs_context, Ptr{zs_device_type}, Ptr{Cint}, Ptr{Ptr{Cchar}}), ctx, type_, device_id, backend)
zs_cuda_device_count(count, reason) =
    ccall((:zs_cuda_device_count, libzeroshard), zs_status, (Ptr{Cint}, Ptr{Ptr{Cchar}}), count, reason)
zs_context_memory(ctx, stats) =
    ccall((:zs_context_memory, libzeroshard), zs_status, (zs_context, Ref{zs_memory_stats}), ctx, stats)
zs_memory_by_kind(ctx, phase, bytes, capacity, num_kinds, total) =
    ccall((:zs_memory_by_kind, libzeroshard), zs_status, (zs_context, zs_memory_phase, Ptr{UInt64}, Csize_t, Ptr{Csize_t}, Ptr{UInt64}), ctx, phase, bytes, capacity, num_kinds, total)
zs_memory_pools_in_use(ctx, bytes) =
    ccall((:zs_memory_pools_in_use, libzeroshard), zs_status, (zs_context, Ptr{UInt64}), ctx, bytes)
zs_memory_get_phase(ctx, phase) =
    ccall((:zs_memory_get_phase, libzeroshard), zs_status, (zs_context, Ptr{zs_memory_phase}), ctx, phase)
zs_memory_set_phase(ctx, phase) =
    ccall((:zs_memory_set_phase, libzeroshard), zs_status, (zs_context, zs_memory_phase), ctx, phase)
zs_memory_reset_peaks(ctx) =
    ccall((:zs_memory_reset_peaks, libzeroshard), zs_status, (zs_context,), ctx)
zs_memory_kind_name(kind) =
    ccall((:zs_memory_kind_name, libzeroshard), Ptr{Cchar}, (zs_memory_kind,), kind)
zs_memory_phase_name(phase) =
    ccall((:zs_memory_phase_name, libzeroshard), Ptr{Cchar}, (zs_memory_phase,), phase)
zs_copied_bytes(ctx, span, bytes, capacity, num_kinds, total) =
    ccall((:zs_copied_bytes, libzeroshard), zs_status, (zs_context, zs_copy_span, Ptr{UInt64}, Csize_t, Ptr{Csize_t}, Ptr{UInt64}), ctx, span, bytes, capacity, num_kinds, total)
zs_copy_kind_name(kind) =
    ccall((:zs_copy_kind_name, libzeroshard), Ptr{Cchar}, (zs_copy_kind,), kind)
zs_context_group(out_, ctx, kind) =
    ccall((:zs_context_group, libzeroshard), zs_status, (Ptr{zs_group}, zs_context, zs_group_kind), out_, ctx, kind)
zs_group_create(out_, ctx, ranks, num_ranks) =
    ccall((:zs_group_create, libzeroshard), zs_status, (Ptr{zs_group}, zs_context, Ptr{Cint}, Cint), out_, ctx, ranks, num_ranks)
zs_group_destroy(group) =
    ccall((:zs_group_destroy, libzeroshard), zs_status, (zs_group,), group)
zs_group_rank(group, rank) =
    ccall((:zs_group_rank, libzeroshard), zs_status, (zs_group, Ptr{Cint}), group, rank)
zs_group_size(group, size) =
    ccall((:zs_group_size, libzeroshard), zs_status, (zs_group, Ptr{Cint}), group, size)
zs_group_world_rank(group, group_rank, world_rank) =
    ccall((:zs_group_world_rank, libzeroshard), zs_status, (zs_group, Cint, Ptr{Cint}), group, group_rank, world_rank)
zs_allgather(out_, group, send, recv, count, dtype) =
    ccall((:zs_allgather, libzeroshard), zs_status, (Ptr{zs_work}, zs_group, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, zs_dtype), out_, group, send, recv, count, dtype)
zs_reduce_scatter(out_, group, send, recv, recv_count, dtype, op) =
    ccall((:zs_reduce_scatter, libzeroshard), zs_status, (Ptr{zs_work}, zs_group, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, zs_dtype, zs_reduce_op), out_, group, send, recv, recv_count, dtype, op)
zs_allreduce(out_, group, send, recv, count, dtype, op) =
    ccall((:zs_allreduce, libzeroshard), zs_status, (Ptr{zs_work}, zs_group, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, zs_dtype, zs_reduce_op), out_, group, send, recv, count, dtype, op)
zs_broadcast(out_, group, buf, count, dtype, root) =
    ccall((:zs_broadcast, libzeroshard), zs_status, (Ptr{zs_work}, zs_group, Ptr{Cvoid}, Csize_t, zs_dtype, Cint), out_, group, buf, count, dtype, root)
zs_barrier(out_, group) =
    ccall((:zs_barrier, libzeroshard), zs_status, (Ptr{zs_work}, zs_group), out_, group)
zs_work_wait(work, timeout_ms) =
    ccall((:zs_work_wait, libzeroshard), zs_status, (zs_work, Cint), work, timeout_ms)
zs_work_test(work, done) =
    ccall((:zs_work_test, libzeroshard), zs_status, (zs_work, Ptr{Cint}), work, done)
zs_work_destroy(work) =
    ccall((:zs_work_destroy, libzeroshard), zs_status, (zs_work,), work)
zs_param_options_init(options, size) =
    ccall((:zs_param_options_init, libzeroshard), zs_status, (Ref{zs_param_options}, Csize_t), options, size)
zs_param_register(out_, ctx, options) =
    ccall((:zs_param_register, libzeroshard), zs_status, (Ptr{zs_param}, zs_context, Ref{zs_param_options}), out_, ctx, options)
zs_param_destroy(param) =
    ccall((:zs_param_destroy, libzeroshard), zs_status, (zs_param,), param)
zs_param_info_init(info, size) =
    ccall((:zs_param_info_init, libzeroshard), zs_status, (Ref{zs_param_info}, Csize_t), info, size)
zs_param_get_info(param, info) =
    ccall((:zs_param_get_info, libzeroshard), zs_status, (zs_param, Ref{zs_param_info}), param, info)
zs_param_get_status(param, status) =
    ccall((:zs_param_get_status, libzeroshard), zs_status, (zs_param, Ptr{zs_param_status}), param, status)
zs_param_shard_data(param, data, shard_numel) =
    ccall((:zs_param_shard_data, libzeroshard), zs_status, (zs_param, Ptr{Ptr{Cvoid}}, Ptr{UInt64}), param, data, shard_numel)
zs_fetch(out_, ctx, params, num_params) =
    ccall((:zs_fetch, libzeroshard), zs_status, (Ptr{zs_gather}, zs_context, Ptr{zs_param}, Csize_t), out_, ctx, params, num_params)
zs_gather_wait(gather, timeout_ms) =
    ccall((:zs_gather_wait, libzeroshard), zs_status, (zs_gather, Cint), gather, timeout_ms)
zs_gather_test(gather, done) =
    ccall((:zs_gather_test, libzeroshard), zs_status, (zs_gather, Ptr{Cint}), gather, done)
zs_gather_destroy(gather) =
    ccall((:zs_gather_destroy, libzeroshard), zs_status, (zs_gather,), gather)
zs_param_data(param, data) =
    ccall((:zs_param_data, libzeroshard), zs_status, (zs_param, Ptr{Ptr{Cvoid}}), param, data)
zs_param_copy_to(param, dst, dst_bytes) =
    ccall((:zs_param_copy_to, libzeroshard), zs_status, (zs_param, Ptr{Cvoid}, Csize_t), param, dst, dst_bytes)
zs_param_to_dlpack(param, out_) =
    ccall((:zs_param_to_dlpack, libzeroshard), zs_status, (zs_param, Ptr{Ptr{Cvoid}}), param, out_)
zs_release(ctx, params, num_params) =
    ccall((:zs_release, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t), ctx, params, num_params)
zs_param_update(ctx, params, num_params, modifier_rank) =
    ccall((:zs_param_update, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t, Cint), ctx, params, num_params, modifier_rank)
zs_param_write(param, data, data_bytes) =
    ccall((:zs_param_write, libzeroshard), zs_status, (zs_param, Ptr{Cvoid}, Csize_t), param, data, data_bytes)
zs_param_freeze(param) =
    ccall((:zs_param_freeze, libzeroshard), zs_status, (zs_param,), param)
zs_grad_push(param, grad, dtype, grad_bytes) =
    ccall((:zs_grad_push, libzeroshard), zs_status, (zs_param, Ptr{Cvoid}, zs_dtype, Csize_t), param, grad, dtype, grad_bytes)
zs_grad_push_many(ctx, params, n, grads, grad_bytes, dtype) =
    ccall((:zs_grad_push_many, libzeroshard), zs_status,
          (zs_context, Ptr{zs_param}, Csize_t, Ptr{Ptr{Cvoid}}, Ptr{Csize_t}, zs_dtype),
          ctx, params, n, grads, grad_bytes, dtype)
zs_grad_push_borrowed(ticket, param, grad, dtype, grad_bytes) =
    ccall((:zs_grad_push_borrowed, libzeroshard), zs_status,
          (Ptr{UInt64}, zs_param, Ptr{Cvoid}, zs_dtype, Csize_t), ticket, param, grad, dtype, grad_bytes)
zs_grad_released(ctx, ticket) =
    ccall((:zs_grad_released, libzeroshard), zs_status, (zs_context, Ptr{UInt64}), ctx, ticket)
zs_grad_sync(ctx) =
    ccall((:zs_grad_sync, libzeroshard), zs_status, (zs_context,), ctx)
zs_grad_set_accumulation_steps(ctx, steps) =
    ccall((:zs_grad_set_accumulation_steps, libzeroshard), zs_status, (zs_context, Cint), ctx, steps)
zs_grad_discard(ctx, params, num_params) =
    ccall((:zs_grad_discard, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t), ctx, params, num_params)
zs_grad_shard_data(param, data, shard_numel) =
    ccall((:zs_grad_shard_data, libzeroshard), zs_status, (zs_param, Ptr{Ptr{Cfloat}}, Ptr{UInt64}), param, data, shard_numel)
zs_optim_hparams_init(hparams, size) =
    ccall((:zs_optim_hparams_init, libzeroshard), zs_status, (Ref{zs_optim_hparams}, Csize_t), hparams, size)
zs_optimizer_create(out_, ctx, kind) =
    ccall((:zs_optimizer_create, libzeroshard), zs_status, (Ptr{zs_optimizer}, zs_context, zs_optimizer_kind), out_, ctx, kind)
zs_optimizer_destroy(opt) =
    ccall((:zs_optimizer_destroy, libzeroshard), zs_status, (zs_optimizer,), opt)
zs_optimizer_add_group(opt, params, num_params, hparams, group_index) =
    ccall((:zs_optimizer_add_group, libzeroshard), zs_status, (zs_optimizer, Ptr{zs_param}, Csize_t, Ref{zs_optim_hparams}, Ptr{Cint}), opt, params, num_params, hparams, group_index)
zs_optimizer_set_hparams(opt, group, hparams) =
    ccall((:zs_optimizer_set_hparams, libzeroshard), zs_status, (zs_optimizer, Cint, Ref{zs_optim_hparams}), opt, group, hparams)
zs_optimizer_set_lr(opt, group, lr) =
    ccall((:zs_optimizer_set_lr, libzeroshard), zs_status, (zs_optimizer, Cint, Cdouble), opt, group, lr)
zs_step_result_init(result, size) =
    ccall((:zs_step_result_init, libzeroshard), zs_status, (Ref{zs_step_result}, Csize_t), result, size)
zs_optimizer_step(opt, result) =
    ccall((:zs_optimizer_step, libzeroshard), zs_status, (zs_optimizer, Ref{zs_step_result}), opt, result)
zs_optimizer_loss_scale(opt, scale) =
    ccall((:zs_optimizer_loss_scale, libzeroshard), zs_status, (zs_optimizer, Ptr{Cdouble}), opt, scale)
zs_optimizer_state_data(opt, param, slot, data, shard_numel) =
    ccall((:zs_optimizer_state_data, libzeroshard), zs_status, (zs_optimizer, zs_param, Cint, Ptr{Ptr{Cfloat}}, Ptr{UInt64}), opt, param, slot, data, shard_numel)
zs_optimizer_get_step(opt, step) =
    ccall((:zs_optimizer_get_step, libzeroshard), zs_status, (zs_optimizer, Ptr{Int64}), opt, step)
zs_optimizer_set_step(opt, step) =
    ccall((:zs_optimizer_set_step, libzeroshard), zs_status, (zs_optimizer, Int64), opt, step)
zs_optimizer_sync_params(opt) =
    ccall((:zs_optimizer_sync_params, libzeroshard), zs_status, (zs_optimizer,), opt)
zs_heal_state_digest(hash, source, step, opt, replica) =
    ccall((:zs_heal_state_digest, libzeroshard), zs_status,
          (Ref{UInt64}, Ref{Cint}, Ref{Int64}, zs_optimizer, Cint), hash, source, step, opt, replica)
zs_heal_agree(committed_step, rolled_forward, opt) =
    ccall((:zs_heal_agree, libzeroshard), zs_status, (Ref{Int64}, Ref{Cint}, zs_optimizer), committed_step,
          rolled_forward, opt)
zs_heal_committed_result(result, found, opt) =
    ccall((:zs_heal_committed_result, libzeroshard), zs_status, (Ref{zs_step_result}, Ref{Cint}, zs_optimizer),
          result, found, opt)
zs_heal_join(committed_step, opt) =
    ccall((:zs_heal_join, libzeroshard), zs_status, (Ref{Int64}, zs_optimizer), committed_step, opt)
zs_heal_shrink(committed_step, opt) =
    ccall((:zs_heal_shrink, libzeroshard), zs_status, (Ref{Int64}, zs_optimizer), committed_step, opt)
zs_heal_set_rank_state(opt, data, size) =
    ccall((:zs_heal_set_rank_state, libzeroshard), zs_status, (zs_optimizer, Ptr{Cvoid}, Csize_t), opt, data, size)
zs_heal_set_shared_state(ctx, data, size) =
    ccall((:zs_heal_set_shared_state, libzeroshard), zs_status, (zs_context, Ptr{Cvoid}, Csize_t), ctx, data, size)
const zs_heal_state_kind = Cint
const ZS_HEAL_RANK_STATE = Cint(0)
const ZS_HEAL_SHARED_STATE = Cint(1)
const ZS_HEAL_DONOR_STATE = Cint(2)
zs_heal_joined_state(size, found, ctx, which, buffer, capacity) =
    ccall((:zs_heal_joined_state, libzeroshard), zs_status,
          (Ref{Csize_t}, Ref{Cint}, zs_context, zs_heal_state_kind, Ptr{Cvoid}, Csize_t), size, found, ctx, which,
          buffer, capacity)
zs_store_serve(server, host, port, bound_port) =
    ccall((:zs_store_serve, libzeroshard), zs_status, (Ptr{zs_store_server}, Cstring, Cint, Ptr{Cint}), server,
          host, port, bound_port)
zs_store_server_destroy(server) =
    ccall((:zs_store_server_destroy, libzeroshard), zs_status, (zs_store_server,), server)
zs_optimizer_step_begin(opt, result) =
    ccall((:zs_optimizer_step_begin, libzeroshard), zs_status, (zs_optimizer, Ref{zs_step_result}), opt, result)
zs_optimizer_step_end(opt, result) =
    ccall((:zs_optimizer_step_end, libzeroshard), zs_status, (zs_optimizer, Ref{zs_step_result}), opt, result)
zs_optimizer_named_state(opt, param, name, create, data, shard_numel) =
    ccall((:zs_optimizer_named_state, libzeroshard), zs_status, (zs_optimizer, zs_param, Cstring, Cint, Ptr{Ptr{Cfloat}}, Ptr{UInt64}), opt, param, name, create, data, shard_numel)
zs_grad_pushed(param, pushed) =
    ccall((:zs_grad_pushed, libzeroshard), zs_status, (zs_param, Ptr{Cint}), param, pushed)
zs_grad_clip_norm(ctx, params, num_params, max_norm, total_norm) =
    ccall((:zs_grad_clip_norm, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t, Cdouble, Ptr{Cdouble}), ctx, params, num_params, max_norm, total_norm)
zs_checkpoint_save_options_init(options, size) =
    ccall((:zs_checkpoint_save_options_init, libzeroshard), zs_status, (Ref{zs_checkpoint_save_options}, Csize_t), options, size)
zs_checkpoint_save(ctx, params, num_params, opt, dir, options) =
    ccall((:zs_checkpoint_save, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t, zs_optimizer, Cstring, Ref{zs_checkpoint_save_options}), ctx, params, num_params, opt, dir, options)
zs_checkpoint_wait(ctx) =
    ccall((:zs_checkpoint_wait, libzeroshard), zs_status, (zs_context,), ctx)
zs_checkpoint_load_options_init(options, size) =
    ccall((:zs_checkpoint_load_options_init, libzeroshard), zs_status, (Ref{zs_checkpoint_load_options}, Csize_t), options, size)
zs_checkpoint_info_init(info, size) =
    ccall((:zs_checkpoint_info_init, libzeroshard), zs_status, (Ref{zs_checkpoint_info}, Csize_t), info, size)
zs_checkpoint_load(ctx, params, num_params, opt, path, options, info) =
    ccall((:zs_checkpoint_load, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t, zs_optimizer, Cstring, Ref{zs_checkpoint_load_options}, Ref{zs_checkpoint_info}), ctx, params, num_params, opt, path, options, info)
zs_checkpoint_verify(path, tag, progress, progress_user) =
    ccall((:zs_checkpoint_verify, libzeroshard), zs_status, (Cstring, Ptr{Cchar}, zs_progress_fn, Ptr{Cvoid}), path, tag, progress, progress_user)
zs_checkpoint_export_options_init(options, size) =
    ccall((:zs_checkpoint_export_options_init, libzeroshard), zs_status, (Ref{zs_checkpoint_export_options}, Csize_t), options, size)
zs_checkpoint_export(path, out_file, options) =
    ccall((:zs_checkpoint_export, libzeroshard), zs_status, (Cstring, Cstring, Ref{zs_checkpoint_export_options}), path, out_file, options)
zs_checkpoint_reshard(path, tag, out_dir, world_size, progress, progress_user) =
    ccall((:zs_checkpoint_reshard, libzeroshard), zs_status, (Cstring, Ptr{Cchar}, Cstring, Cint, zs_progress_fn, Ptr{Cvoid}), path, tag, out_dir, world_size, progress, progress_user)
zs_export_options_init(options, size) =
    ccall((:zs_export_options_init, libzeroshard), zs_status, (Ref{zs_export_options}, Csize_t), options, size)
zs_export_safetensors(ctx, params, num_params, out_file, options) =
    ccall((:zs_export_safetensors, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t, Cstring, Ref{zs_export_options}), ctx, params, num_params, out_file, options)
zs_safetensors_load_options_init(options, size) =
    ccall((:zs_safetensors_load_options_init, libzeroshard), zs_status, (Ref{zs_safetensors_load_options}, Csize_t), options, size)
zs_load_safetensors(ctx, params, num_params, opt, path, options) =
    ccall((:zs_load_safetensors, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t, zs_optimizer, Cstring, Ref{zs_safetensors_load_options}), ctx, params, num_params, opt, path, options)
zs_step_begin(ctx) =
    ccall((:zs_step_begin, libzeroshard), zs_status, (zs_context,), ctx)
zs_step_end(ctx) =
    ccall((:zs_step_end, libzeroshard), zs_status, (zs_context,), ctx)
zs_step_end_agree(ctx, token, same) =
    ccall((:zs_step_end_agree, libzeroshard), zs_status, (zs_context, UInt64, Ptr{Cint}), ctx, token, same)
zs_coord_fetch(ctx, params, num_params) =
    ccall((:zs_coord_fetch, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t), ctx, params, num_params)
zs_coord_release(ctx, params, num_params) =
    ccall((:zs_coord_release, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t), ctx, params, num_params)
zs_leaf_group(ctx, params, num_params) =
    ccall((:zs_leaf_group, libzeroshard), zs_status, (zs_context, Ptr{zs_param}, Csize_t), ctx, params, num_params)
zs_coord_stats_init(stats, size) =
    ccall((:zs_coord_stats_init, libzeroshard), zs_status, (Ref{zs_coord_stats}, Csize_t), stats, size)
zs_coord_get_stats(ctx, stats) =
    ccall((:zs_coord_get_stats, libzeroshard), zs_status, (zs_context, Ref{zs_coord_stats}), ctx, stats)
zs_step_stats_init(stats, size) =
    ccall((:zs_step_stats_init, libzeroshard), zs_status, (Ref{zs_step_stats}, Csize_t), stats, size)
zs_context_step_stats(ctx, stats) =
    ccall((:zs_context_step_stats, libzeroshard), zs_status, (zs_context, Ref{zs_step_stats}), ctx, stats)
