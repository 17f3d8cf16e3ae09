# Statuses become exceptions carrying the status and the engine's message.

"""
    ZeroShardError(status, name, message)

A failed zeroshard call: `status` (a `zs_status` code), its `name`
("ZS_ERR_TIMEOUT") and the engine's message, which says what was wrong and
with which value.
"""
struct ZeroShardError <: Exception
    status::Cint
    name::String
    message::String
end

Base.showerror(io::IO, e::ZeroShardError) = print(io, e.name, ": ", e.message)

"""Throw the thread's last error unless `status` is `ZS_OK`."""
function check(status::Cint)
    status == ZS_OK && return nothing
    # zs_last_error is thread-local in the library; read it right away.
    message = unsafe_string(zs_last_error())
    throw(ZeroShardError(status, unsafe_string(zs_status_string(status)), message))
end

"""A struct as its ZS_XXX_INIT macro fills it, from the library's zs_xxx_init."""
function new_struct(::Type{T}) where {T}
    s = T()
    init = STRUCT_INITS[T]
    check(init(s, Csize_t(sizeof(T))))
    return s
end

const STRUCT_INITS = Dict{DataType,Function}(
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
)

"""The library's version string, "MAJOR.MINOR.PATCH"."""
version() = unsafe_string(zs_version(C_NULL, C_NULL, C_NULL))
