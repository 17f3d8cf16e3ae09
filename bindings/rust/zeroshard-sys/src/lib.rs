//! Raw declarations of `include/zeroshard/zeroshard.h`, written by hand.
//!
//! C enums are `c_int` type aliases with one constant per value (a C enum
//! may hold any `int`; a Rust enum may not). Structs are `#[repr(C)]` with
//! the header's fields in its order. `tests/layout.rs` checks all of it —
//! every struct's size, alignment and field offsets, every enum value, every
//! function's name and C types — against the C compiler's view of the
//! header, so this file cannot drift from it silently.
#![allow(non_camel_case_types, non_upper_case_globals)]

use std::os::raw::{c_char, c_int, c_void};

pub const ZS_VERSION_MAJOR: c_int = 0;
pub const ZS_VERSION_MINOR: c_int = 1;
pub const ZS_VERSION_PATCH: c_int = 0;
pub const ZS_VERSION: c_int = ZS_VERSION_MAJOR * 10000 + ZS_VERSION_MINOR * 100 + ZS_VERSION_PATCH;
pub const ZS_MAX_DIMS: usize = 8;
pub const ZS_WAIT_FOREVER: c_int = -1;
pub const ZS_EXIT_STATE_LOST: c_int = 75;
pub const ZS_EXIT_NOT_TAKEN: c_int = 76;

macro_rules! c_enum {
    ($ty:ident { $($name:ident = $value:expr,)* }) => {
        pub type $ty = c_int;
        $(pub const $name: $ty = $value;)*
    };
}

c_enum!(zs_status {
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
    ZS_STATUS_ENUM_MIN_ = i32::MIN,
    ZS_STATUS_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_dtype {
    ZS_FLOAT32 = 0,
    ZS_BFLOAT16 = 1,
    ZS_FLOAT16 = 2,
    ZS_UINT8 = 3,
    ZS_DTYPE_ENUM_MIN_ = i32::MIN,
    ZS_DTYPE_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_device_type {
    ZS_DEVICE_CPU = 1,
    ZS_DEVICE_CUDA = 2,
    ZS_DEVICE_TYPE_ENUM_MIN_ = i32::MIN,
    ZS_DEVICE_TYPE_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_reduce_op {
    ZS_SUM = 0,
    ZS_AVG = 1,
    ZS_MAX = 2,
    ZS_MIN = 3,
    ZS_REDUCE_OP_ENUM_MIN_ = i32::MIN,
    ZS_REDUCE_OP_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_param_status {
    ZS_PARAM_NOT_AVAILABLE = 0,
    ZS_PARAM_INFLIGHT = 1,
    ZS_PARAM_AVAILABLE = 2,
    ZS_PARAM_STATUS_ENUM_MIN_ = i32::MIN,
    ZS_PARAM_STATUS_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_init {
    ZS_INIT_ZEROS = 0,
    ZS_INIT_FROM_RANK = 1,
    ZS_INIT_FROM_ALL = 2,
    ZS_INIT_NORMAL = 3,
    ZS_INIT_UNIFORM = 4,
    ZS_INIT_ENUM_MIN_ = i32::MIN,
    ZS_INIT_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_group_kind {
    ZS_GROUP_WORLD = 0,
    ZS_GROUP_PARTITION = 1,
    ZS_GROUP_MICS_SHARD = 2,
    ZS_GROUP_MICS_REPLICA = 3,
    ZS_GROUP_HPZ = 4,
    ZS_GROUP_MICS_INTER = 5,
    ZS_GROUP_MICS_INTRA = 6,
    ZS_GROUP_KIND_ENUM_MIN_ = i32::MIN,
    ZS_GROUP_KIND_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_memory_kind {
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
    ZS_MEM_KIND_ENUM_MIN_ = i32::MIN,
    ZS_MEM_KIND_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_memory_phase {
    ZS_PHASE_NOW = -1,
    ZS_PHASE_CONSTRUCTION = 0,
    ZS_PHASE_FORWARD = 1,
    ZS_PHASE_BACKWARD = 2,
    ZS_PHASE_STEP = 3,
    ZS_PHASE_CHECKPOINT = 4,
    ZS_PHASE_COUNT = 5,
    ZS_PHASE_ENUM_MIN_ = i32::MIN,
    ZS_PHASE_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_heal_state_kind {
    ZS_HEAL_RANK_STATE = 0,
    ZS_HEAL_SHARED_STATE = 1,
    ZS_HEAL_DONOR_STATE = 2,
    ZS_HEAL_STATE_KIND_ENUM_MIN_ = i32::MIN,
    ZS_HEAL_STATE_KIND_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_copy_kind {
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
    ZS_COPY_KIND_ENUM_MIN_ = i32::MIN,
    ZS_COPY_KIND_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_copy_span {
    ZS_COPIES_TOTAL = 0,
    ZS_COPIES_LAST_STEP = 1,
    ZS_COPY_SPAN_ENUM_MIN_ = i32::MIN,
    ZS_COPY_SPAN_ENUM_MAX_ = i32::MAX,
});

c_enum!(zs_optimizer_kind {
    ZS_OPTIM_ADAMW = 0,
    ZS_OPTIM_ADAM = 1,
    ZS_OPTIM_SGD = 2,
    ZS_OPTIM_EXTERNAL = 3,
    ZS_OPTIM_MUON = 4,
    ZS_OPTIM_KIND_ENUM_MIN_ = i32::MIN,
    ZS_OPTIM_KIND_ENUM_MAX_ = i32::MAX,
});

macro_rules! opaque {
    ($($s:ident => $h:ident,)*) => {$(
        #[repr(C)]
        pub struct $s {
            _private: [u8; 0],
        }
        pub type $h = *mut $s;
    )*};
}

opaque! {
    zs_context_s => zs_context,
    zs_group_s => zs_group,
    zs_param_s => zs_param,
    zs_gather_s => zs_gather,
    zs_work_s => zs_work,
    zs_optimizer_s => zs_optimizer,
    zs_store_server_s => zs_store_server,
}

/// DLPack's tensor, opaque here (`dlpack/dlpack.h`).
#[repr(C)]
pub struct DLManagedTensor {
    _private: [u8; 0],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_context_options {
    pub size: usize,
    pub rank: c_int,
    pub world_size: c_int,
    pub local_rank: c_int,
    pub local_world_size: c_int,
    pub store_host: *const c_char,
    pub store_port: c_int,
    pub file_store_path: *const c_char,
    pub config_json: *const c_char,
    pub config_path: *const c_char,
    pub timeout_ms: c_int,
    pub transport_host: *const c_char,
    pub device: *const c_char,
    pub backend: *const c_char,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_memory_stats {
    pub size: usize,
    pub shard_bytes: u64,
    pub gathered_bytes: u64,
    pub peak_gathered_bytes: u64,
    pub unsharded_bytes: u64,
    pub num_params: u64,
    pub host_cache_bytes: u64,
    pub grad_bytes: u64,
    pub optimizer_bytes: u64,
    pub hpz_secondary_bytes: u64,
    pub device_cache_bytes: u64,
    pub device_system_allocs: u64,
    pub device_reuses: u64,
    pub nvme_bytes: u64,
    pub loco_error_bytes: u64,
    pub device_bytes: u64,
    pub host_bytes: u64,
    pub host_pinned_bytes: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_fetch_stats {
    pub size: usize,
    pub gathers: u64,
    pub hpz_gathers: u64,
    pub hierarchical_gathers: u64,
    pub gather_bytes_sent: u64,
    pub gather_bytes_received: u64,
    pub quantized_gather_bytes_sent: u64,
    pub quantized_gather_bytes_received: u64,
    pub reduce_scatter_bytes_sent: u64,
    pub reduce_scatter_bytes_received: u64,
    pub quantized_reduce_bytes_sent: u64,
    pub quantized_reduce_bytes_received: u64,
    pub allreduce_bytes_sent: u64,
    pub allreduce_bytes_received: u64,
    pub other_bytes_sent: u64,
    pub other_bytes_received: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_param_options {
    pub size: usize,
    pub name: *const c_char,
    pub dtype: zs_dtype,
    pub ndim: c_int,
    pub shape: *const i64,
    pub init: zs_init,
    pub data: *const c_void,
    pub data_bytes: usize,
    pub src_rank: c_int,
    pub seed: u64,
    pub a: f64,
    pub b: f64,
    pub group: zs_group,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_param_info {
    pub size: usize,
    pub name: *const c_char,
    pub dtype: zs_dtype,
    pub ndim: c_int,
    pub shape: [i64; ZS_MAX_DIMS],
    pub numel: u64,
    pub shard_numel: u64,
    pub padded_numel: u64,
    pub shard_offset: u64,
    pub shard_valid: u64,
    pub status: zs_param_status,
    pub device_type: zs_device_type,
    pub device_id: c_int,
    pub shard_version: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_optim_hparams {
    pub size: usize,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: c_int,
    pub bias_correction: c_int,
    pub use_muon: c_int,
    pub ns_method: c_int,
    pub ns_steps: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_step_result {
    pub size: usize,
    pub skipped: c_int,
    pub grad_norm: f64,
    pub loss_scale: f64,
    pub step: i64,
}

/// Progress of a long checkpoint save, load, verify or export, called on the
/// calling thread (`zs_progress_fn`: phase, bytes done, bytes in all).
pub type zs_progress_fn =
    Option<unsafe extern "C" fn(user: *mut c_void, phase: *const c_char, done: u64, total: u64)>;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_checkpoint_save_options {
    pub size: usize,
    pub tag: *const c_char,
    pub user_json: *const c_char,
    pub timeout_ms: c_int,
    pub overwrite: c_int,
    pub update_latest: c_int,
    pub names: *const *const c_char,
    pub progress: zs_progress_fn,
    pub progress_user: *mut c_void,
    pub async_save: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_checkpoint_load_options {
    pub size: usize,
    pub tag: *const c_char,
    pub strict: c_int,
    pub names: *const *const c_char,
    pub progress: zs_progress_fn,
    pub progress_user: *mut c_void,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_checkpoint_info {
    pub size: usize,
    pub step: i64,
    pub bytes_read: u64,
    pub dir: *const c_char,
    pub user_json: *const c_char,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_checkpoint_export_options {
    pub size: usize,
    pub tag: *const c_char,
    pub fp32: c_int,
    pub progress: zs_progress_fn,
    pub progress_user: *mut c_void,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_export_options {
    pub size: usize,
    pub names: *const *const c_char,
    pub progress: zs_progress_fn,
    pub progress_user: *mut c_void,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_safetensors_load_options {
    pub size: usize,
    pub names: *const *const c_char,
    pub strict: c_int,
    pub from_rank0: c_int,
    pub progress: zs_progress_fn,
    pub progress_user: *mut c_void,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_coord_stats {
    pub size: usize,
    pub steps: u64,
    pub fetch_calls: u64,
    pub demand_fetches: u64,
    pub prefetches: u64,
    pub blocked_waits: u64,
    pub reuse_hits: u64,
    pub kept_for_reuse: u64,
    pub persistent_params: u64,
    pub live_elements: u64,
    pub peak_live_elements: u64,
    pub trace_invalidations: u64,
    pub trace_length: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct zs_step_stats {
    pub size: usize,
    pub step: i64,
    pub step_seconds: f64,
    pub gather_seconds: f64,
    pub gather_bytes: u64,
    pub gathers: u64,
    pub reduce_scatter_seconds: f64,
    pub reduce_scatter_bytes: u64,
    pub reduce_scatters: u64,
    pub allreduce_seconds: f64,
    pub allreduce_bytes: u64,
    pub other_comm_seconds: f64,
    pub other_comm_bytes: u64,
    pub wait_seconds: f64,
    pub optimizer_seconds: f64,
    pub peer_copy_seconds: f64,
    pub peer_copy_bytes: u64,
    pub replay_seconds: f64,
}

/// Declares `new()` for each struct: the library's `zs_xxx_init`, i.e. the
/// header's `ZS_XXX_INIT` values (Rust cannot expand the C macros).
macro_rules! init_with_library {
    ($($ty:ident => $init:ident,)*) => {$(
        impl $ty {
            /// The struct as its `ZS_..._INIT` macro fills it, from the
            /// library's own defaults.
            pub fn new() -> Self {
                let mut s = std::mem::MaybeUninit::<$ty>::zeroed();
                // SAFETY: the library writes size_of::<$ty>() bytes, all of
                // the struct; a failure would leave zeroes, which are valid
                // for every field (null pointers, zero numbers).
                let status = unsafe { $init(s.as_mut_ptr(), std::mem::size_of::<$ty>()) };
                assert_eq!(status, ZS_OK, concat!(stringify!($init), " failed"));
                unsafe { s.assume_init() }
            }
        }
        impl Default for $ty {
            fn default() -> Self {
                Self::new()
            }
        }
    )*};
}

init_with_library! {
    zs_context_options => zs_context_options_init,
    zs_memory_stats => zs_memory_stats_init,
    zs_fetch_stats => zs_fetch_stats_init,
    zs_param_options => zs_param_options_init,
    zs_param_info => zs_param_info_init,
    zs_optim_hparams => zs_optim_hparams_init,
    zs_step_result => zs_step_result_init,
    zs_checkpoint_save_options => zs_checkpoint_save_options_init,
    zs_checkpoint_load_options => zs_checkpoint_load_options_init,
    zs_checkpoint_info => zs_checkpoint_info_init,
    zs_checkpoint_export_options => zs_checkpoint_export_options_init,
    zs_export_options => zs_export_options_init,
    zs_safetensors_load_options => zs_safetensors_load_options_init,
    zs_coord_stats => zs_coord_stats_init,
    zs_step_stats => zs_step_stats_init,
}

// In the header's order; tests/layout.rs reads this block back and compares
// each declaration with the header's prototype.
extern "C" {
    pub fn zs_version(major: *mut c_int, minor: *mut c_int, patch: *mut c_int) -> *const c_char;
    pub fn zs_status_string(status: zs_status) -> *const c_char;
    pub fn zs_last_error() -> *const c_char;
    pub fn zs_context_options_init(options: *mut zs_context_options, size: usize) -> zs_status;
    pub fn zs_context_create(out: *mut zs_context, options: *const zs_context_options)
        -> zs_status;
    pub fn zs_context_destroy(ctx: zs_context) -> zs_status;
    pub fn zs_context_rank(ctx: zs_context, rank: *mut c_int) -> zs_status;
    pub fn zs_context_world_size(ctx: zs_context, world_size: *mut c_int) -> zs_status;
    pub fn zs_context_local_rank(ctx: zs_context, local_rank: *mut c_int) -> zs_status;
    pub fn zs_context_local_world_size(ctx: zs_context, local_world_size: *mut c_int) -> zs_status;
    pub fn zs_context_async_error(ctx: zs_context) -> zs_status;
    pub fn zs_context_config_json(ctx: zs_context, json: *mut *const c_char) -> zs_status;
    pub fn zs_context_unused_config_keys(
        ctx: zs_context,
        json_array: *mut *const c_char,
    ) -> zs_status;
    pub fn zs_context_inactive_config_keys(
        ctx: zs_context,
        json_array: *mut *const c_char,
    ) -> zs_status;
    pub fn zs_config_check(config_json: *const c_char, world_size: c_int) -> zs_status;
    pub fn zs_memory_stats_init(stats: *mut zs_memory_stats, size: usize) -> zs_status;
    pub fn zs_fetch_stats_init(stats: *mut zs_fetch_stats, size: usize) -> zs_status;
    pub fn zs_context_fetch_stats(ctx: zs_context, stats: *mut zs_fetch_stats) -> zs_status;
    pub fn zs_context_device(
        ctx: zs_context,
        type_: *mut zs_device_type,
        device_id: *mut c_int,
        backend: *mut *const c_char,
    ) -> zs_status;
    pub fn zs_cuda_device_count(count: *mut c_int, reason: *mut *const c_char) -> zs_status;
    pub fn zs_context_memory(ctx: zs_context, stats: *mut zs_memory_stats) -> zs_status;
    pub fn zs_memory_by_kind(
        ctx: zs_context,
        phase: zs_memory_phase,
        bytes: *mut u64,
        capacity: usize,
        num_kinds: *mut usize,
        total: *mut u64,
    ) -> zs_status;
    pub fn zs_memory_pools_in_use(ctx: zs_context, bytes: *mut u64) -> zs_status;
    pub fn zs_memory_get_phase(ctx: zs_context, phase: *mut zs_memory_phase) -> zs_status;
    pub fn zs_memory_set_phase(ctx: zs_context, phase: zs_memory_phase) -> zs_status;
    pub fn zs_memory_reset_peaks(ctx: zs_context) -> zs_status;
    pub fn zs_memory_kind_name(kind: zs_memory_kind) -> *const c_char;
    pub fn zs_memory_phase_name(phase: zs_memory_phase) -> *const c_char;
    pub fn zs_copied_bytes(
        ctx: zs_context,
        span: zs_copy_span,
        bytes: *mut u64,
        capacity: usize,
        num_kinds: *mut usize,
        total: *mut u64,
    ) -> zs_status;
    pub fn zs_copy_kind_name(kind: zs_copy_kind) -> *const c_char;
    pub fn zs_context_group(out: *mut zs_group, ctx: zs_context, kind: zs_group_kind) -> zs_status;
    pub fn zs_group_create(
        out: *mut zs_group,
        ctx: zs_context,
        ranks: *const c_int,
        num_ranks: c_int,
    ) -> zs_status;
    pub fn zs_group_destroy(group: zs_group) -> zs_status;
    pub fn zs_group_rank(group: zs_group, rank: *mut c_int) -> zs_status;
    pub fn zs_group_size(group: zs_group, size: *mut c_int) -> zs_status;
    pub fn zs_group_world_rank(
        group: zs_group,
        group_rank: c_int,
        world_rank: *mut c_int,
    ) -> zs_status;
    pub fn zs_allgather(
        out: *mut zs_work,
        group: zs_group,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: zs_dtype,
    ) -> zs_status;
    pub fn zs_reduce_scatter(
        out: *mut zs_work,
        group: zs_group,
        send: *const c_void,
        recv: *mut c_void,
        recv_count: usize,
        dtype: zs_dtype,
        op: zs_reduce_op,
    ) -> zs_status;
    pub fn zs_allreduce(
        out: *mut zs_work,
        group: zs_group,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: zs_dtype,
        op: zs_reduce_op,
    ) -> zs_status;
    pub fn zs_broadcast(
        out: *mut zs_work,
        group: zs_group,
        buf: *mut c_void,
        count: usize,
        dtype: zs_dtype,
        root: c_int,
    ) -> zs_status;
    pub fn zs_barrier(out: *mut zs_work, group: zs_group) -> zs_status;
    pub fn zs_work_wait(work: zs_work, timeout_ms: c_int) -> zs_status;
    pub fn zs_work_test(work: zs_work, done: *mut c_int) -> zs_status;
    pub fn zs_work_destroy(work: zs_work) -> zs_status;
    pub fn zs_param_options_init(options: *mut zs_param_options, size: usize) -> zs_status;
    pub fn zs_param_register(
        out: *mut zs_param,
        ctx: zs_context,
        options: *const zs_param_options,
    ) -> zs_status;
    pub fn zs_param_destroy(param: zs_param) -> zs_status;
    pub fn zs_param_info_init(info: *mut zs_param_info, size: usize) -> zs_status;
    pub fn zs_param_get_info(param: zs_param, info: *mut zs_param_info) -> zs_status;
    pub fn zs_param_get_status(param: zs_param, status: *mut zs_param_status) -> zs_status;
    pub fn zs_param_shard_data(
        param: zs_param,
        data: *mut *mut c_void,
        shard_numel: *mut u64,
    ) -> zs_status;
    pub fn zs_fetch(
        out: *mut zs_gather,
        ctx: zs_context,
        params: *const zs_param,
        num_params: usize,
    ) -> zs_status;
    pub fn zs_gather_wait(gather: zs_gather, timeout_ms: c_int) -> zs_status;
    pub fn zs_gather_test(gather: zs_gather, done: *mut c_int) -> zs_status;
    pub fn zs_gather_destroy(gather: zs_gather) -> zs_status;
    pub fn zs_param_data(param: zs_param, data: *mut *mut c_void) -> zs_status;
    pub fn zs_param_copy_to(param: zs_param, dst: *mut c_void, dst_bytes: usize) -> zs_status;
    pub fn zs_param_to_dlpack(param: zs_param, out: *mut *mut DLManagedTensor) -> zs_status;
    pub fn zs_release(ctx: zs_context, params: *const zs_param, num_params: usize) -> zs_status;
    pub fn zs_param_update(
        ctx: zs_context,
        params: *const zs_param,
        num_params: usize,
        modifier_rank: c_int,
    ) -> zs_status;
    pub fn zs_param_write(param: zs_param, data: *const c_void, data_bytes: usize) -> zs_status;
    pub fn zs_param_freeze(param: zs_param) -> zs_status;
    pub fn zs_grad_push(
        param: zs_param,
        grad: *const c_void,
        dtype: zs_dtype,
        grad_bytes: usize,
    ) -> zs_status;
    pub fn zs_grad_push_many(
        ctx: zs_context,
        params: *const zs_param,
        n: usize,
        grads: *const *const c_void,
        grad_bytes: *const usize,
        dtype: zs_dtype,
    ) -> zs_status;
    pub fn zs_grad_push_borrowed(
        ticket: *mut u64,
        param: zs_param,
        grad: *const c_void,
        dtype: zs_dtype,
        grad_bytes: usize,
    ) -> zs_status;
    pub fn zs_grad_released(ctx: zs_context, ticket: *mut u64) -> zs_status;
    pub fn zs_grad_sync(ctx: zs_context) -> zs_status;
    pub fn zs_grad_set_accumulation_steps(ctx: zs_context, steps: c_int) -> zs_status;
    pub fn zs_grad_discard(ctx: zs_context, params: *const zs_param, num_params: usize) -> zs_status;
    pub fn zs_grad_shard_data(
        param: zs_param,
        data: *mut *mut f32,
        shard_numel: *mut u64,
    ) -> zs_status;
    pub fn zs_optim_hparams_init(hparams: *mut zs_optim_hparams, size: usize) -> zs_status;
    pub fn zs_optimizer_create(
        out: *mut zs_optimizer,
        ctx: zs_context,
        kind: zs_optimizer_kind,
    ) -> zs_status;
    pub fn zs_optimizer_destroy(opt: zs_optimizer) -> zs_status;
    pub fn zs_optimizer_add_group(
        opt: zs_optimizer,
        params: *const zs_param,
        num_params: usize,
        hparams: *const zs_optim_hparams,
        group_index: *mut c_int,
    ) -> zs_status;
    pub fn zs_optimizer_set_hparams(
        opt: zs_optimizer,
        group: c_int,
        hparams: *const zs_optim_hparams,
    ) -> zs_status;
    pub fn zs_optimizer_set_lr(opt: zs_optimizer, group: c_int, lr: f64) -> zs_status;
    pub fn zs_step_result_init(result: *mut zs_step_result, size: usize) -> zs_status;
    pub fn zs_optimizer_step(opt: zs_optimizer, result: *mut zs_step_result) -> zs_status;
    pub fn zs_optimizer_loss_scale(opt: zs_optimizer, scale: *mut f64) -> zs_status;
    pub fn zs_optimizer_state_data(
        opt: zs_optimizer,
        param: zs_param,
        slot: c_int,
        data: *mut *mut f32,
        shard_numel: *mut u64,
    ) -> zs_status;
    pub fn zs_optimizer_get_step(opt: zs_optimizer, step: *mut i64) -> zs_status;
    pub fn zs_optimizer_set_step(opt: zs_optimizer, step: i64) -> zs_status;
    pub fn zs_optimizer_sync_params(opt: zs_optimizer) -> zs_status;
    pub fn zs_heal_state_digest(
        hash: *mut u64,
        source: *mut c_int,
        step: *mut i64,
        opt: zs_optimizer,
        replica: c_int,
    ) -> zs_status;
    pub fn zs_heal_agree(committed_step: *mut i64, rolled_forward: *mut c_int, opt: zs_optimizer) -> zs_status;
    pub fn zs_heal_committed_result(result: *mut zs_step_result, found: *mut c_int, opt: zs_optimizer) -> zs_status;
    pub fn zs_heal_join(committed_step: *mut i64, opt: zs_optimizer) -> zs_status;
    pub fn zs_heal_shrink(committed_step: *mut i64, opt: zs_optimizer) -> zs_status;
    pub fn zs_heal_set_rank_state(opt: zs_optimizer, data: *const c_void, size: usize) -> zs_status;
    pub fn zs_heal_set_shared_state(ctx: zs_context, data: *const c_void, size: usize) -> zs_status;
    pub fn zs_heal_joined_state(
        size: *mut usize,
        found: *mut c_int,
        ctx: zs_context,
        which: zs_heal_state_kind,
        buffer: *mut c_void,
        capacity: usize,
    ) -> zs_status;
    pub fn zs_store_serve(server: *mut zs_store_server, host: *const c_char, port: c_int, bound_port: *mut c_int)
        -> zs_status;
    pub fn zs_store_server_destroy(server: zs_store_server) -> zs_status;
    pub fn zs_optimizer_step_begin(opt: zs_optimizer, result: *mut zs_step_result) -> zs_status;
    pub fn zs_optimizer_step_end(opt: zs_optimizer, result: *mut zs_step_result) -> zs_status;
    pub fn zs_optimizer_named_state(
        opt: zs_optimizer,
        param: zs_param,
        name: *const c_char,
        create: c_int,
        data: *mut *mut f32,
        shard_numel: *mut u64,
    ) -> zs_status;
    pub fn zs_grad_pushed(param: zs_param, pushed: *mut c_int) -> zs_status;
    pub fn zs_grad_clip_norm(
        ctx: zs_context,
        params: *const zs_param,
        num_params: usize,
        max_norm: f64,
        total_norm: *mut f64,
    ) -> zs_status;
    pub fn zs_checkpoint_save_options_init(
        options: *mut zs_checkpoint_save_options,
        size: usize,
    ) -> zs_status;
    pub fn zs_checkpoint_save(
        ctx: zs_context,
        params: *const zs_param,
        num_params: usize,
        opt: zs_optimizer,
        dir: *const c_char,
        options: *const zs_checkpoint_save_options,
    ) -> zs_status;
    pub fn zs_checkpoint_wait(ctx: zs_context) -> zs_status;
    pub fn zs_checkpoint_load_options_init(
        options: *mut zs_checkpoint_load_options,
        size: usize,
    ) -> zs_status;
    pub fn zs_checkpoint_info_init(info: *mut zs_checkpoint_info, size: usize) -> zs_status;
    pub fn zs_checkpoint_load(
        ctx: zs_context,
        params: *const zs_param,
        num_params: usize,
        opt: zs_optimizer,
        path: *const c_char,
        options: *const zs_checkpoint_load_options,
        info: *mut zs_checkpoint_info,
    ) -> zs_status;
    pub fn zs_checkpoint_verify(
        path: *const c_char,
        tag: *const c_char,
        progress: zs_progress_fn,
        progress_user: *mut c_void,
    ) -> zs_status;
    pub fn zs_checkpoint_export_options_init(
        options: *mut zs_checkpoint_export_options,
        size: usize,
    ) -> zs_status;
    pub fn zs_checkpoint_export(
        path: *const c_char,
        out_file: *const c_char,
        options: *const zs_checkpoint_export_options,
    ) -> zs_status;
    pub fn zs_checkpoint_reshard(
        path: *const c_char,
        tag: *const c_char,
        out_dir: *const c_char,
        world_size: c_int,
        progress: zs_progress_fn,
        progress_user: *mut c_void,
    ) -> zs_status;
    pub fn zs_export_options_init(options: *mut zs_export_options, size: usize) -> zs_status;
    pub fn zs_export_safetensors(
        ctx: zs_context,
        params: *const zs_param,
        num_params: usize,
        out_file: *const c_char,
        options: *const zs_export_options,
    ) -> zs_status;
    pub fn zs_safetensors_load_options_init(
        options: *mut zs_safetensors_load_options,
        size: usize,
    ) -> zs_status;
    pub fn zs_load_safetensors(
        ctx: zs_context,
        params: *const zs_param,
        num_params: usize,
        opt: zs_optimizer,
        path: *const c_char,
        options: *const zs_safetensors_load_options,
    ) -> zs_status;
    pub fn zs_step_begin(ctx: zs_context) -> zs_status;
    pub fn zs_step_end(ctx: zs_context) -> zs_status;
    pub fn zs_step_end_agree(ctx: zs_context, token: u64, same: *mut c_int) -> zs_status;
    pub fn zs_coord_fetch(ctx: zs_context, params: *const zs_param, num_params: usize)
        -> zs_status;
    pub fn zs_coord_release(
        ctx: zs_context,
        params: *const zs_param,
        num_params: usize,
    ) -> zs_status;
    pub fn zs_leaf_group(ctx: zs_context, params: *const zs_param, num_params: usize) -> zs_status;
    pub fn zs_coord_stats_init(stats: *mut zs_coord_stats, size: usize) -> zs_status;
    pub fn zs_coord_get_stats(ctx: zs_context, stats: *mut zs_coord_stats) -> zs_status;
    pub fn zs_step_stats_init(stats: *mut zs_step_stats, size: usize) -> zs_status;
    pub fn zs_context_step_stats(ctx: zs_context, stats: *mut zs_step_stats) -> zs_status;
}
