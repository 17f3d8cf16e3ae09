# Groups of ranks and blocking collectives. Each collective is issued and
# waited for inside one call, with the array preserved from the garbage
# collector meanwhile: the engine writes it from its own thread.

mutable struct Group
    handle::zs_group
    ctx::Context  # keeps the context alive as long as the group
    function Group(handle::zs_group, ctx::Context)
        g = new(handle, ctx)
        finalizer(close, g)
        return g
    end
end

function Base.close(g::Group)
    g.handle == C_NULL && return nothing
    h, g.handle = g.handle, C_NULL
    zs_group_destroy(h)  # a stale handle after the context closed is an error, not a crash
    return nothing
end

live(g::Group) = g.handle == C_NULL ? throw(ArgumentError("the group is closed")) : g.handle

const GROUP_KINDS = Dict(:world => ZS_GROUP_WORLD, :partition => ZS_GROUP_PARTITION,
                         :mics_shard => ZS_GROUP_MICS_SHARD, :mics_replica => ZS_GROUP_MICS_REPLICA,
                         :hpz => ZS_GROUP_HPZ, :mics_inter => ZS_GROUP_MICS_INTER,
                         :mics_intra => ZS_GROUP_MICS_INTRA)

"""One of the context's own groups (`:world`, `:partition`, `:mics_shard`, ...)."""
function Group(ctx::Context, kind::Symbol=:world)
    haskey(GROUP_KINDS, kind) || throw(ArgumentError("unknown group kind :$kind; one of $(keys(GROUP_KINDS))"))
    out = Ref{zs_group}(C_NULL)
    check(zs_context_group(out, live(ctx), GROUP_KINDS[kind]))
    return Group(out[], ctx)
end
world_group(ctx::Context) = Group(ctx, :world)

"""A sub-group of world ranks (0-based, as the engine counts); collective."""
function new_group(ctx::Context, ranks::AbstractVector{<:Integer})
    r = Cint.(collect(ranks))
    out = Ref{zs_group}(C_NULL)
    check(zs_group_create(out, live(ctx), r, Cint(length(r))))
    return Group(out[], ctx)
end

"""This rank's 0-based position in the group, or `nothing` outside it."""
function group_rank(g::Group)
    r = Ref{Cint}(-1)
    check(zs_group_rank(live(g), r))
    return r[] < 0 ? nothing : Int(r[])
end

function group_size(g::Group)
    n = Ref{Cint}(0)
    check(zs_group_size(live(g), n))
    return Int(n[])
end

dtype_of(::Type{Float32}) = ZS_FLOAT32
dtype_of(::Type{UInt8}) = ZS_UINT8
dtype_of(::Type{T}) where {T} = throw(ArgumentError("no zeroshard dtype for $T (Float32 or UInt8)"))

const REDUCE_OPS = Dict(:sum => ZS_SUM, :avg => ZS_AVG, :max => ZS_MAX, :min => ZS_MIN)

function wait_work(out::Ref{zs_work})
    w = out[]
    status = zs_work_wait(w, ZS_WAIT_FOREVER)
    zs_work_destroy(w)
    check(status)
end

"""Reduce `A` over the group in place (`:sum`, `:avg`, `:max`, `:min`)."""
function allreduce!(g::Group, A::Array{T}, op::Symbol=:sum) where {T}
    out = Ref{zs_work}(C_NULL)
    GC.@preserve A begin
        check(zs_allreduce(out, live(g), A, A, Csize_t(length(A)), dtype_of(T), REDUCE_OPS[op]))
        wait_work(out)
    end
    return A
end

"""Every member's `A`, concatenated in group order."""
function allgather(g::Group, A::Array{T}) where {T}
    recv = Vector{T}(undef, length(A) * group_size(g))
    out = Ref{zs_work}(C_NULL)
    GC.@preserve A recv begin
        check(zs_allgather(out, live(g), A, recv, Csize_t(length(A)), dtype_of(T)))
        wait_work(out)
    end
    return recv
end

"""`A` of group rank `root` (0-based) into every member's `A`."""
function bcast!(g::Group, A::Array{T}, root::Integer) where {T}
    out = Ref{zs_work}(C_NULL)
    GC.@preserve A begin
        check(zs_broadcast(out, live(g), A, Csize_t(length(A)), dtype_of(T), Cint(root)))
        wait_work(out)
    end
    return A
end

function barrier(g::Group)
    out = Ref{zs_work}(C_NULL)
    check(zs_barrier(out, live(g)))
    wait_work(out)
end
