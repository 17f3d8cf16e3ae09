"""
    ZeroShard

Julia API of zeroshard, a ZeRO-3 engine behind a C ABI: `ccall` over
`libzeroshard.so` (`ENV["ZEROSHARD_LIBRARY"]`, else the loader's path).
Handles close on garbage collection and explicitly with `close`; every
failed call throws a `ZeroShardError` with the status and the engine's
message. `fetch(ctx, params)` and `wait(gather)` extend Base's.
"""
module ZeroShard

export ZeroShardError, Context, Group, Param, Gather, Optimizer, StepResult,
       rank, world_size, local_rank, local_world_size, config_json, device,
       memory_stats, fetch_stats, world_group, new_group, group_rank, group_size,
       allreduce!, allgather, bcast!, barrier,
       register_param, param_info, param_status, gathered, release, update!,
       grad_push, grad_sync, optimizer_add_group!, step!, loss_scale, set_lr!

include("lib.jl")
include("errors.jl")
include("context.jl")
include("group.jl")
include("param.jl")
include("optimizer.jl")

end # module
