# The sharded optimizer.

mutable struct Optimizer
    handle::zs_optimizer
    ctx::Context
    function Optimizer(handle::zs_optimizer, ctx::Context)
        o = new(handle, ctx)
        finalizer(close, o)
        return o
    end
end

function Base.close(o::Optimizer)
    o.handle == C_NULL && return nothing
    h, o.handle = o.handle, C_NULL
    zs_optimizer_destroy(h)
    return nothing
end

live(o::Optimizer) = o.handle == C_NULL ? throw(ArgumentError("the optimizer is closed")) : o.handle

const OPTIMIZER_KINDS = Dict(:adamw => ZS_OPTIM_ADAMW, :adam => ZS_OPTIM_ADAM, :sgd => ZS_OPTIM_SGD)

"""`Optimizer(ctx, :adamw | :adam | :sgd)` over params of `ctx`."""
function Optimizer(ctx::Context, kind::Symbol=:adamw)
    haskey(OPTIMIZER_KINDS, kind) || throw(ArgumentError("optimizer :$kind; one of $(keys(OPTIMIZER_KINDS))"))
    out = Ref{zs_optimizer}(C_NULL)
    check(zs_optimizer_create(out, live(ctx), OPTIMIZER_KINDS[kind]))
    return Optimizer(out[], ctx)
end

function hparams(; kw...)
    h = new_struct(zs_optim_hparams)  # the library's defaults
    for (k, v) in kw
        k in fieldnames(zs_optim_hparams) && k !== :size ||
            throw(ArgumentError("unknown hyper-parameter $k; one of $(fieldnames(zs_optim_hparams)[2:end])"))
        setfield!(h, k, convert(fieldtype(zs_optim_hparams, k), v))
    end
    return h
end

"""A parameter group with its own hyper-parameters (`lr`, `weight_decay`, ...); returns its index."""
function optimizer_add_group!(o::Optimizer, params::AbstractVector{Param}; kw...)
    hs = handles(params)
    h = hparams(; kw...)
    index = Ref{Cint}(-1)
    check(zs_optimizer_add_group(live(o), hs, Csize_t(length(hs)), h, index))
    return Int(index[])
end

set_lr!(o::Optimizer, lr::Real; group::Integer=-1) = check(zs_optimizer_set_lr(live(o), Cint(group), Cdouble(lr)))

struct StepResult
    skipped::Bool
    grad_norm::Float64
    loss_scale::Float64
    step::Int64
end

"""One optimizer step, collective over the world."""
function step!(o::Optimizer)
    r = new_struct(zs_step_result)
    check(zs_optimizer_step(live(o), r))
    return StepResult(r.skipped != 0, r.grad_norm, r.loss_scale, r.step)
end

function loss_scale(o::Optimizer)
    s = Ref{Cdouble}(0)
    check(zs_optimizer_loss_scale(live(o), s))
    return s[]
end
