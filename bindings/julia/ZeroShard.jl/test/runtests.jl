# ZeroShard.jl in a world of one (no sockets). Run with
#   ZEROSHARD_LIBRARY=build/lib/libzeroshard.so julia --project=bindings/julia/ZeroShard.jl -e 'using Pkg; Pkg.test()'
using Test
using ZeroShard

@testset "ZeroShard" begin
    @testset "errors carry status and message" begin
        err = try
            Context(rank=0, world_size=1, config="""{"zero_optimization": {"stage": "three"}}""")
            nothing
        catch e
            e
        end
        @test err isa ZeroShardError
        @test err.status == ZeroShard.ZS_ERR_INVALID_CONFIG
        @test err.name == "ZS_ERR_INVALID_CONFIG"
        @test occursin("zero_optimization.stage", err.message)
        @test_throws ZeroShardError ZeroShard.config_check("""{"zero_optimization": {"mics_shard_size": 3}}"""; world_size=8)
        @test ZeroShard.version() == "0.1.0"
    end

    ctx = Context(rank=0, world_size=1, device="cpu")
    @test (rank(ctx), world_size(ctx)) == (0, 1)
    @test device(ctx) == ((:cpu, 0), "gloo")

    @testset "params: register, gather, update, release" begin
        values = Float32[i * 0.5 for i in 0:14]            # row-major 3x5
        w = register_param(ctx, "w", (3, 5); init=:from_all, data=values)
        info = param_info(w)
        @test (info.name, info.shape, info.numel) == ("w", [3, 5], 15)
        @test param_status(w) == :not_available
        wait(fetch(ctx, [w]))
        @test param_status(w) == :available
        A = gathered(w)                                      # 5x3 view, column-major
        @test size(A) == (5, 3)
        @test vec(A) == values
        @test A[2, 1] == values[2]                           # element (0, 1)
        A[5, 1] = 100f0                                      # element (0, 4)
        update!(ctx, [w], 0)
        release(ctx, [w])
        @test param_status(w) == :not_available
        wait(fetch(ctx, [w]))
        @test copyto!(zeros(Float32, 15), w)[5] == 100f0
        release(ctx, [w])
        e = try
            copyto!(zeros(Float32, 15), w); nothing
        catch x
            x
        end
        @test e isa ZeroShardError && e.status == ZeroShard.ZS_ERR_INVALID_STATE
        close(w)
        close(w)                                             # twice is fine
        @test_throws ArgumentError param_info(w)
    end

    @testset "optimizer: one AdamW step" begin
        p = register_param(ctx, "p", (3,); init=:from_all, data=Float32[1, -2, 3])
        opt = Optimizer(ctx, :adamw)
        @test optimizer_add_group!(opt, [p]; lr=0.1, weight_decay=0.0) == 0
        grad_push(p, Float32[1, 1, -1])
        r = step!(opt)
        @test !r.skipped && r.step == 1 && isapprox(r.grad_norm, sqrt(3); atol=1e-6)
        wait(fetch(ctx, [p]))
        @test isapprox(copy(gathered(p)), Float32[0.9, -2.1, 3.1]; atol=1e-5)  # lr * sign(g), bias-corrected
        release(ctx, [p])
        @test_throws ArgumentError optimizer_add_group!(opt, [p]; learning_rate=0.1)
        close(opt)
        close(p)
    end

    @testset "collectives in a world of one" begin
        g = world_group(ctx)
        @test (group_rank(g), group_size(g)) == (0, 1)
        @test allreduce!(g, Float32[1, 2], :sum) == Float32[1, 2]
        @test allgather(g, UInt8[7, 8]) == UInt8[7, 8]
        @test bcast!(g, Float32[3], 0) == Float32[3]
        barrier(g)
        @test_throws ZeroShardError bcast!(g, Float32[3], 5)
        close(g)
    end

    @testset "memory stats" begin
        p = register_param(ctx, "m", (6,))
        s = memory_stats(ctx)
        @test s.num_params == 1 && s.shard_bytes == 24
        close(p)
    end
    close(ctx)
end
