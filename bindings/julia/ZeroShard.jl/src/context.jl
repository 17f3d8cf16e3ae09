# The context: one per process and data-parallel world. Objects made from it
# keep a reference to it, so the garbage collector cannot destroy it first.

mutable struct Context
    handle::zs_context
    function Context(handle::zs_context)
        ctx = new(handle)
        finalizer(close, ctx)
        return ctx
    end
end

cstr_or_null(s::Nothing) = Ptr{Cchar}(C_NULL)
function cstr_or_null(s::AbstractString)
    occursin('\0', s) && throw(ArgumentError("string contains a NUL byte: $(repr(s))"))
    return Ptr{Cchar}(pointer(s))
end

"""
    Context(; rank, world_size, local_rank, local_world_size, store_host,
            store_port, file_store_path, config, config_path, timeout_ms,
            transport_host, device, backend)

Bring up a context (collective over the world). Omitted settings come from
the environment (torchrun's, Open MPI's or Slurm's variables). `config` is
DeepSpeed JSON text.
"""
function Context(; rank=nothing, world_size=nothing, local_rank=nothing, local_world_size=nothing,
                 store_host=nothing, store_port=nothing, file_store_path=nothing, config=nothing,
                 config_path=nothing, timeout_ms=nothing, transport_host=nothing, device=nothing,
                 backend=nothing)
    o = new_struct(zs_context_options)
    rank === nothing || (o.rank = rank)
    world_size === nothing || (o.world_size = world_size)
    local_rank === nothing || (o.local_rank = local_rank)
    local_world_size === nothing || (o.local_world_size = local_world_size)
    store_port === nothing || (o.store_port = store_port)
    timeout_ms === nothing || (o.timeout_ms = timeout_ms)
    str(s) = s === nothing ? nothing : String(s)
    sh, fs, cj, cp, th, dv, be = str.((store_host, file_store_path, config, config_path,
                                       transport_host, device, backend))
    out = Ref{zs_context}(C_NULL)
    GC.@preserve sh fs cj cp th dv be begin  # the library reads them during the call only
        o.store_host, o.file_store_path, o.config_json, o.config_path = cstr_or_null.((sh, fs, cj, cp))
        o.transport_host, o.device, o.backend = cstr_or_null.((th, dv, be))
        check(zs_context_create(out, o))
    end
    return Context(out[])
end

function Base.close(ctx::Context)
    ctx.handle == C_NULL && return nothing
    h, ctx.handle = ctx.handle, C_NULL
    zs_context_destroy(h)  # NULL-safe; errors ignored in a finalizer
    return nothing
end

function live(ctx::Context)
    ctx.handle == C_NULL && throw(ArgumentError("the context is closed"))
    return ctx.handle
end

function int_query(f, ctx::Context)
    v = Ref{Cint}(0)
    check(f(live(ctx), v))
    return Int(v[])
end
rank(ctx::Context) = int_query(zs_context_rank, ctx)
world_size(ctx::Context) = int_query(zs_context_world_size, ctx)
local_rank(ctx::Context) = int_query(zs_context_local_rank, ctx)
local_world_size(ctx::Context) = int_query(zs_context_local_world_size, ctx)

"""The effective config as JSON text."""
function config_json(ctx::Context)
    p = Ref{Ptr{Cchar}}(C_NULL)
    check(zs_context_config_json(live(ctx), p))
    return unsafe_string(p[])
end

"""`(:cpu, 0)` or `(:cuda, ordinal)`, and the backend ("gloo" | "nccl")."""
function device(ctx::Context)
    t, i, b = Ref{zs_device_type}(0), Ref{Cint}(0), Ref{Ptr{Cchar}}(C_NULL)
    check(zs_context_device(live(ctx), t, i, b))
    return (t[] == ZS_DEVICE_CUDA ? :cuda : :cpu, Int(i[])), unsafe_string(b[])
end

"""Bytes held by this rank (a `zs_memory_stats`)."""
function memory_stats(ctx::Context)
    s = new_struct(zs_memory_stats)
    check(zs_context_memory(live(ctx), s))
    return s
end

function fetch_stats(ctx::Context)
    s = new_struct(zs_fetch_stats)
    check(zs_context_fetch_stats(live(ctx), s))
    return s
end

"""Flush gradient buckets and wait for their reductions (collective)."""
grad_sync(ctx::Context) = check(zs_grad_sync(live(ctx)))

"""Check a DeepSpeed config without a context; throws on an invalid one."""
config_check(json::AbstractString; world_size::Integer=0) =
    check(zs_config_check(json, Cint(world_size)))
