# Train the two-layer MLP of examples/c/train_mlp.c through ZeroShard.jl,
# with the same data, init, collectives and Float32 arithmetic in the same
# order, so that it prints the C example's losses (fp32, AdamW):
#
#   build/bin/zsrun -n 2 -- julia --project=bindings/julia/ZeroShard.jl \
#       bindings/julia/ZeroShard.jl/examples/train_mlp.jl [steps]
using ZeroShard
using Printf

const IN, HIDDEN, OUT = 16, 33, 5

function noise(x::UInt64)
    x += 0x9e3779b97f4a7c15
    x = xor(x, x >> 30) * 0xbf58476d1ce4e5b9
    x = xor(x, x >> 27) * 0x94d049bb133111eb
    x = xor(x, x >> 31)
    return Float32(Float64(x >> 11) * 2.0^-52 - 1.0)
end

# Sample `index` of `step`: x (IN) and the teacher's target y (OUT).
function sample!(x, y, step, index)
    for k in 0:IN-1
        x[k+1] = noise(xor(xor(UInt64(step) << 32, UInt64(index) << 8), UInt64(k)))
    end
    for j in 0:OUT-1
        s = 0f0
        for k in 0:IN-1
            s += noise(UInt64(0xabcd + j * IN + k)) * x[k+1]
        end
        y[j+1] = ccall(:sinf, Cfloat, (Cfloat,), s)  # libm's, as C (Julia's own sin may differ in the last bit)
    end
end

# Params are row-major in the engine: weight (i, k) is w[i*IN + k + 1].
function train(steps)
    ctx = Context(config="""{"zero_optimization": {"stage": 3, "mics_shard_size": -1,
        "zero_hpz_partition_size": 1, "reduce_bucket_size": 500000000}, "bf16": {"enabled": false},
        "fp16": {"enabled": false, "initial_scale_power": 12}, "gradient_clipping": 0,
        "train_micro_batch_size_per_gpu": "auto"}""")
    r, n = rank(ctx), world_size(ctx)
    batch = 24
    local_n = batch ÷ n
    shapes = ((HIDDEN, IN), (HIDDEN,), (OUT, HIDDEN), (OUT,))
    names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    params = [register_param(ctx, names[p], shapes[p]; init=:normal, seed=100 + p - 1, mean=0.0,
                             std=length(shapes[p]) == 2 ? 1 / sqrt(shapes[p][2]) : 0.1) for p in 1:4]
    opt = Optimizer(ctx, :adamw)
    optimizer_add_group!(opt, [params[1], params[3]]; lr=0.01)
    optimizer_add_group!(opt, [params[2], params[4]]; lr=0.01, weight_decay=0.0)
    world = world_group(ctx)
    full = [zeros(Float32, prod(s)) for s in shapes]
    grads = [zeros(Float32, prod(s)) for s in shapes]
    xs, ys = zeros(Float32, IN, local_n), zeros(Float32, OUT, local_n)
    hs, douts, dhs = zeros(Float32, HIDDEN, local_n), zeros(Float32, OUT, local_n), zeros(Float32, HIDDEN, local_n)
    fc1, fc2 = params[1:2], params[3:4]
    function gather!(layer, dst)
        wait(fetch(ctx, layer))
        copyto!(dst[1], layer[1]); copyto!(dst[2], layer[2])
        release(ctx, layer)
    end
    loss = 0f0
    for step in 0:steps-1
        g1 = fetch(ctx, fc1)                       # fc1, prefetching fc2, as the C example
        g2 = fetch(ctx, fc2)
        wait(g1); copyto!(full[1], fc1[1]); copyto!(full[2], fc1[2]); release(ctx, fc1)
        w1, b1 = full[1], full[2]
        for s in 1:local_n
            sample!(view(xs, :, s), view(ys, :, s), step, r * local_n + s - 1)
            for i in 0:HIDDEN-1
                a = b1[i+1]
                for k in 0:IN-1
                    a += w1[i*IN+k+1] * xs[k+1, s]
                end
                hs[i+1, s] = a > 0f0 ? a : 0f0
            end
        end
        wait(g2); copyto!(full[3], fc2[1]); copyto!(full[4], fc2[2]); release(ctx, fc2)
        w2, b2 = full[3], full[4]
        l = 0f0
        norm = 1f0 / Float32(local_n * OUT)
        for s in 1:local_n, j in 0:OUT-1
            a = b2[j+1]
            for i in 0:HIDDEN-1
                a += w2[j*HIDDEN+i+1] * hs[i+1, s]
            end
            d = a - ys[j+1, s]
            l += d * d * norm
            douts[j+1, s] = 2f0 * d * norm * 1f0
        end
        gather!(fc2, full[3:4])                    # fc2 again for backward
        gw1, gb1, gw2, gb2 = grads
        fill!(gw2, 0f0); fill!(gb2, 0f0)
        for s in 1:local_n
            dhs[:, s] .= 0f0
            for j in 0:OUT-1
                dout = douts[j+1, s]
                gb2[j+1] += dout
                for i in 0:HIDDEN-1
                    gw2[j*HIDDEN+i+1] += dout * hs[i+1, s]
                    dhs[i+1, s] += dout * w2[j*HIDDEN+i+1]
                end
            end
        end
        grad_push(fc2[2], gb2); grad_push(fc2[1], gw2)   # bias first, as the C example
        fill!(gw1, 0f0); fill!(gb1, 0f0)
        for s in 1:local_n, i in 0:HIDDEN-1
            hs[i+1, s] <= 0f0 && continue
            dh = dhs[i+1, s]
            gb1[i+1] += dh
            for k in 0:IN-1
                gw1[i*IN+k+1] += dh * xs[k+1, s]
            end
        end
        grad_push(fc1[2], gb1); grad_push(fc1[1], gw1)
        res = step!(opt)
        loss = allreduce!(world, Float32[l], :avg)[1]
        r == 0 && @printf("step %d loss %.9g grad_norm %.6g loss_scale %g\n", step, loss, res.grad_norm, res.loss_scale)
    end
    r == 0 && @printf("{\"example\":\"train_mlp.jl\",\"ranks\":%d,\"final_loss\":%.9g}\n", n, loss)
    foreach(close, params); close(opt); close(world); close(ctx)
end

train(length(ARGS) >= 1 ? parse(Int, ARGS[1]) : 50)
