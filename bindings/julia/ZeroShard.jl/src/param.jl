# Partitioned parameters, gathers, and the full data of a gathered param as
# an Array over engine memory (`unsafe_wrap`), valid until release.

mutable struct Param
    handle::zs_param
    ctx::Context
    dtype::Cint
    dims::Vector{Int}  # row-major, as the engine stores it
    function Param(handle::zs_param, ctx::Context, dtype::Cint, dims::Vector{Int})
        p = new(handle, ctx, dtype, dims)
        finalizer(close, p)
        return p
    end
end

function Base.close(p::Param)
    p.handle == C_NULL && return nothing
    h, p.handle = p.handle, C_NULL
    zs_param_destroy(h)
    return nothing
end

live(p::Param) = p.handle == C_NULL ? throw(ArgumentError("the param is closed")) : p.handle
Base.length(p::Param) = prod(p.dims; init=1)

const DTYPES = Dict(:float32 => ZS_FLOAT32, :bfloat16 => ZS_BFLOAT16, :float16 => ZS_FLOAT16)
eltype_of(dtype::Cint) = dtype == ZS_FLOAT32 ? Float32 : UInt16  # 16-bit floats as raw bits

"""
    register_param(ctx, name, dims; dtype=:float32, init=:zeros, data=nothing,
                   src_rank=0, seed=0, mean=0.0, std=1.0, low=0.0, high=1.0, group=nothing)

Register a parameter of row-major shape `dims`; this rank keeps only its
shard. `init`: `:zeros`, `:normal` (`seed`, `mean`, `std`), `:uniform`
(`seed`, `low`, `high`), `:from_all` (`data` on every rank) or `:from_rank`
(`data` on group rank `src_rank` only; collective). `data` holds the values
in row-major order (a Julia matrix is column-major: pass
`permutedims(M)` or a vector).
"""
function register_param(ctx::Context, name::AbstractString, dims; dtype::Symbol=:float32,
                        init::Symbol=:zeros, data::Union{Nothing,Array}=nothing, src_rank::Integer=0,
                        seed::Integer=0, mean::Real=0.0, std::Real=1.0, low::Real=0.0, high::Real=1.0,
                        group::Union{Nothing,Group}=nothing)
    haskey(DTYPES, dtype) || throw(ArgumentError("dtype :$dtype; one of $(keys(DTYPES))"))
    inits = Dict(:zeros => ZS_INIT_ZEROS, :from_rank => ZS_INIT_FROM_RANK, :from_all => ZS_INIT_FROM_ALL,
                 :normal => ZS_INIT_NORMAL, :uniform => ZS_INIT_UNIFORM)
    haskey(inits, init) || throw(ArgumentError("init :$init; one of $(keys(inits))"))
    shape = Int64.(collect(dims))
    o = new_struct(zs_param_options)
    name_s = String(name)
    out = Ref{zs_param}(C_NULL)
    GC.@preserve name_s shape data begin
        o.name = cstr_or_null(name_s)
        o.dtype = DTYPES[dtype]
        o.ndim = length(shape)
        o.shape = isempty(shape) ? Ptr{Int64}(C_NULL) : pointer(shape)
        o.init = inits[init]
        if data !== nothing
            o.data = Ptr{Cvoid}(pointer(data))
            o.data_bytes = sizeof(data)
        end
        o.src_rank = src_rank
        o.seed = seed
        o.a, o.b = init == :uniform ? (low, high) : (mean, std)
        group === nothing || (o.group = live(group))
        check(zs_param_register(out, live(ctx), o))
    end
    return Param(out[], ctx, DTYPES[dtype], Int.(shape))
end

"""The param's `zs_param_info` as a NamedTuple (shape row-major)."""
function param_info(p::Param)
    i = new_struct(zs_param_info)
    check(zs_param_get_info(live(p), i))
    return (name=unsafe_string(i.name), dtype=i.dtype, shape=collect(i.shape[1:i.ndim]),
            numel=i.numel, shard_numel=i.shard_numel, padded_numel=i.padded_numel,
            shard_offset=i.shard_offset, shard_valid=i.shard_valid, status=i.status,
            device=(i.device_type == ZS_DEVICE_CUDA ? :cuda : :cpu, Int(i.device_id)))
end

function param_status(p::Param)
    s = Ref{zs_param_status}(0)
    check(zs_param_get_status(live(p), s))
    return (:not_available, :inflight, :available)[s[]+1]
end

"""A fetch in flight; `wait` it, then read with `gathered` and `release`."""
mutable struct Gather
    handle::zs_gather
    params::Vector{Param}  # kept alive while the gather runs
    function Gather(handle::zs_gather, params::Vector{Param})
        g = new(handle, params)
        finalizer(close, g)
        return g
    end
end

function Base.close(g::Gather)
    g.handle == C_NULL && return nothing
    h, g.handle = g.handle, C_NULL
    zs_gather_destroy(h)  # waits for an unfinished gather
    return nothing
end

handles(params) = zs_param[live(p) for p in params]

"""Gather `params` as one coalesced asynchronous all-gather (collective)."""
function Base.fetch(ctx::Context, params::AbstractVector{Param})
    hs = handles(params)
    out = Ref{zs_gather}(C_NULL)
    check(zs_fetch(out, live(ctx), hs, Csize_t(length(hs))))
    return Gather(out[], collect(params))
end

"""Wait for the gather (`timeout_ms` < 0: forever); then it is closed."""
function Base.wait(g::Gather; timeout_ms::Integer=-1)
    g.handle == C_NULL && throw(ArgumentError("the gather is closed"))
    check(zs_gather_wait(g.handle, Cint(timeout_ms)))
    close(g)
    return nothing
end

"""
    gathered(p) -> Array

The full data of an AVAILABLE param on the CPU, wrapped without a copy
(`unsafe_wrap`): a Julia array of the param's dims reversed (the engine is
row-major, Julia column-major, so `A[j, i]` is element `(i, j)`). The array
is valid until `release`; use `copy` to keep it longer. Writes stick after
`update!`.
"""
function gathered(p::Param)
    info = param_info(p)
    info.device[1] == :cpu ||
        throw(ArgumentError("param '$(info.name)' lives on $(info.device): use copyto!(dst, p)"))
    data = Ref{Ptr{Cvoid}}(C_NULL)
    check(zs_param_data(live(p), data))
    T = eltype_of(p.dtype)
    length(p) == 0 && return Array{T}(undef, reverse(p.dims)...)
    return unsafe_wrap(Array, Ptr{T}(data[]), Tuple(reverse(p.dims)); own=false)
end

"""Copy the full data of a gathered param into `dst` (any device)."""
function Base.copyto!(dst::Array, p::Param)
    GC.@preserve dst check(zs_param_copy_to(live(p), dst, Csize_t(sizeof(dst))))
    return dst
end

"""Free the full data of gathered params (local)."""
function release(ctx::Context, params::AbstractVector{Param})
    hs = handles(params)
    check(zs_release(live(ctx), hs, Csize_t(length(hs))))
end

"""torch's zero_grad between a backward and the step: drop the gradients pushed
for `params` since their last step (no collective when none has one)."""
function grad_discard(ctx::Context, params::AbstractVector{Param})
    hs = handles(params)
    check(zs_grad_discard(live(ctx), hs, Csize_t(length(hs))))
end

"""GatheredParameters: broadcast `modifier_rank`'s full data and re-shard it."""
function update!(ctx::Context, params::AbstractVector{Param}, modifier_rank::Integer)
    hs = handles(params)
    check(zs_param_update(live(ctx), hs, Csize_t(length(hs)), Cint(modifier_rank)))
end

"""Hand the engine a param's full gradient (row-major, its numel elements)."""
function grad_push(p::Param, grad::Array{T}) where {T}
    dt = T === Float32 ? ZS_FLOAT32 : p.dtype
    GC.@preserve grad check(zs_grad_push(live(p), grad, dt, Csize_t(sizeof(grad))))
end
