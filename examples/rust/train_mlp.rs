//! Train the two-layer MLP of examples/c/train_mlp.c through the safe Rust
//! API, with the same data, init, order of collectives and arithmetic, so
//! both print the same losses:
//!
//!   build/bin/zsrun -n 2 -- build/rust/debug/examples/train_mlp [--steps 50]
//!       [--dtype fp32|bf16] [--optimizer adamw|adam|sgd] [--lr 0.01] [--batch 24]
//!       [--mics N] [--hpz N] [--clip C] [--accum K] [--bucket ELEMS] [--device cpu|cuda|cuda:N]
//!
//! Rank 0 prints "step N loss L ..." per step as the C example does; the last
//! line is one JSON object with the final loss and every rank's bytes.
mod mlp_model;

use mlp_model as mlp;
use zeroshard::*;

struct Args {
    steps: i32,
    batch: i32,
    mics: i32,
    hpz: i32,
    accum: i32,
    bucket: i64,
    lr: f64,
    clip: f64,
    dtype: String,
    optimizer: String,
    device: Option<String>,
}

fn usage(why: &str) -> ! {
    eprintln!(
        "train_mlp: {why}\nusage: train_mlp [--steps N] [--dtype fp32|bf16] [--optimizer adamw|adam|sgd] \
         [--lr LR] [--batch B] [--mics N] [--hpz N] [--clip C] [--accum K] [--bucket ELEMS] [--device D]"
    );
    std::process::exit(2);
}

fn parse_args() -> Args {
    let mut a = Args {
        steps: 50,
        batch: 24,
        mics: 0,
        hpz: 0,
        accum: 1,
        bucket: 0,
        lr: 0.01,
        clip: 0.0,
        dtype: "fp32".into(),
        optimizer: "adamw".into(),
        device: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for kv in argv.chunks(2) {
        let [k, v] = kv else {
            usage("an option lacks its value")
        };
        let num = |v: &str| {
            v.parse::<f64>()
                .unwrap_or_else(|_| usage(&format!("{k} {v}: not a number")))
        };
        match k.as_str() {
            "--steps" => a.steps = num(v) as i32,
            "--batch" => a.batch = num(v) as i32,
            "--mics" => a.mics = num(v) as i32,
            "--hpz" => a.hpz = num(v) as i32,
            "--accum" => a.accum = num(v) as i32,
            "--bucket" => a.bucket = num(v) as i64,
            "--lr" => a.lr = num(v),
            "--clip" => a.clip = num(v),
            "--dtype" => a.dtype = v.clone(),
            "--optimizer" => a.optimizer = v.clone(),
            "--device" => a.device = Some(v.clone()),
            _ => usage(k),
        }
    }
    if a.steps < 1 || a.batch < 1 || a.accum < 1 {
        usage("steps, batch and accum must be >= 1");
    }
    if a.dtype != "fp32" && a.dtype != "bf16" {
        usage("--dtype must be fp32 or bf16 (the C example also has fp16)");
    }
    a
}

/// C's printf("%.<p>g"): p significant digits, trailing zeros dropped,
/// exponent form below 1e-4 or from 10^p.
fn fmt_g(v: f64, p: usize) -> String {
    if v == 0.0 || !v.is_finite() {
        return if v.is_nan() {
            "nan".into()
        } else if v.is_infinite() {
            if v > 0.0 {
                "inf".into()
            } else {
                "-inf".into()
            }
        } else {
            "0".into()
        };
    }
    let sci = format!("{:.*e}", p - 1, v);
    let (mant, exp) = sci.split_once('e').unwrap();
    let exp: i32 = exp.parse().unwrap();
    let trim = |s: &str| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    if exp < -4 || exp >= p as i32 {
        format!(
            "{}e{}{:02}",
            trim(mant),
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        )
    } else {
        trim(&format!("{:.*}", (p as i32 - 1 - exp) as usize, v))
    }
}

fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}
fn f32_to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// Copy a gathered layer (weight, bias) out as fp32, then release it. As in
/// the C example, a copy: the params may live on a GPU.
fn gather_layer(
    g: Gather,
    dtype: DType,
    out: &mut [Vec<f32>],
    staging: &mut Vec<Half16>,
) -> Result<()> {
    let gathered = g.wait()?;
    for (k, dst) in out.iter_mut().enumerate() {
        let p = gathered.param(k);
        if dtype == DType::F32 {
            p.copy_to(dst.as_mut_slice())?;
        } else {
            staging.resize(dst.len(), Half16(0));
            p.copy_to(staging.as_mut_slice())?;
            for (d, h) in dst.iter_mut().zip(staging.iter()) {
                *d = bf16_to_f32(h.0);
            }
        }
    }
    gathered.release()
}

/// Hand a layer's gradients (weight, bias) to the engine, bias first, as C.
fn push_grads(layer: &[&Param], grads: [&[f32]; 2], dtype: DType) -> Result<()> {
    for k in (0..2).rev() {
        if dtype == DType::F32 {
            layer[k].grad_push(grads[k], dtype)?;
        } else {
            let g16: Vec<Half16> = grads[k].iter().map(|&v| Half16(f32_to_bf16(v))).collect();
            layer[k].grad_push(&g16, dtype)?;
        }
    }
    Ok(())
}

fn main() {
    if let Err(e) = run(parse_args()) {
        eprintln!("train_mlp: {e}");
        std::process::exit(1);
    }
}

fn run(a: Args) -> Result<()> {
    let dtype = if a.dtype == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let config = format!(
        "{{\"zero_optimization\": {{\"stage\": 3, \"mics_shard_size\": {}, \"zero_hpz_partition_size\": {}, \
         \"reduce_bucket_size\": {}}}, \"bf16\": {{\"enabled\": {}}}, \"fp16\": {{\"enabled\": false, \
         \"initial_scale_power\": 12}}, \"gradient_clipping\": {}, \"train_micro_batch_size_per_gpu\": \"auto\"}}",
        if a.mics > 0 { a.mics } else { -1 },
        if a.hpz > 0 { a.hpz } else { 1 },
        if a.bucket > 0 { a.bucket } else { 500_000_000 },
        dtype == DType::BF16,
        fmt_g(a.clip, 6),
    );
    let mut opts = ContextOptions::new().config_json(config);
    opts.device = a.device.clone();
    let ctx = Context::new(&opts)?;
    let (rank, world) = (ctx.rank()?, ctx.world_size()?);
    if a.batch % world != 0 {
        if rank == 0 {
            eprintln!(
                "train_mlp: --batch {} must be a multiple of the world size {world}",
                a.batch
            );
        }
        std::process::exit(2);
    }
    ctx.set_accumulation_steps(a.accum)?;

    // Seeded init: the same model on any number of ranks.
    let params: Vec<Param> = (0..mlp::NPARAMS)
        .map(|p| {
            let shape = mlp::SHAPES[p];
            let std = if shape.len() == 2 {
                1.0 / (shape[1] as f64).sqrt()
            } else {
                0.1
            };
            ctx.register(
                &ParamSpec::new(mlp::NAMES[p], dtype, shape).init(Init::Normal {
                    seed: 100 + p as u64,
                    mean: 0.0,
                    std,
                }),
            )
        })
        .collect::<Result<_>>()?;
    let fc1 = [&params[mlp::W1], &params[mlp::B1]];
    let fc2 = [&params[mlp::W2], &params[mlp::B2]];

    // No weight decay on biases: a second param group.
    let kind = match a.optimizer.as_str() {
        "sgd" => OptimizerKind::Sgd,
        "adam" => OptimizerKind::Adam,
        _ => OptimizerKind::AdamW,
    };
    let mut opt = Optimizer::new(&ctx, kind)?;
    let mut hp = Hparams {
        lr: a.lr,
        ..Hparams::default()
    };
    hp.momentum = if kind == OptimizerKind::Sgd { 0.9 } else { 0.0 };
    opt.add_group(&[fc1[0], fc2[0]], &hp)?;
    hp.weight_decay = 0.0;
    opt.add_group(&[fc1[1], fc2[1]], &hp)?;

    let world_group = ctx.group(GroupKind::World)?;
    let mut full: Vec<Vec<f32>> = (0..mlp::NPARAMS)
        .map(|p| vec![0.0; mlp::numel(p)])
        .collect();
    let mut grads = full.clone();
    let mut staging = Vec::new();
    let local = (a.batch / world) as usize;
    let mut s = mlp::Scratch::new(local);
    let mut loss = 0.0f32;
    let mut skipped = 0;
    for step in 0..a.steps {
        let mut step_loss = 0.0f32;
        for micro in 0..a.accum {
            let data_step = step * a.accum + micro;
            let loss_scale = opt.loss_scale()?;
            // Forward: fc1 (prefetching fc2), then fc2, each released at once.
            let g1 = ctx.fetch(&fc1)?;
            let g2 = ctx.fetch(&fc2)?;
            gather_layer(g1, dtype, &mut full[mlp::W1..=mlp::B1], &mut staging)?;
            mlp::forward1(
                &full[mlp::W1],
                &full[mlp::B1],
                data_step,
                rank * local as i32,
                local,
                &mut s,
            );
            gather_layer(g2, dtype, &mut full[mlp::W2..=mlp::B2], &mut staging)?;
            let l = mlp::forward2(
                &full[mlp::W2],
                &full[mlp::B2],
                local,
                loss_scale as f32,
                &mut s,
            );
            // Backward: fc2 gathered again; fc1's gradients need no params.
            // Gradients go to the engine as they are made, last layer first.
            gather_layer(
                ctx.fetch(&fc2)?,
                dtype,
                &mut full[mlp::W2..=mlp::B2],
                &mut staging,
            )?;
            let [gw1, gb1, gw2, gb2] = &mut grads[..] else {
                unreachable!()
            };
            mlp::backward2(&full[mlp::W2], local, &mut s, gw2, gb2);
            push_grads(&fc2, [gw2.as_slice(), gb2.as_slice()], dtype)?;
            mlp::backward1(local, &s, gw1, gb1);
            push_grads(&fc1, [gw1.as_slice(), gb1.as_slice()], dtype)?;
            step_loss += l / a.accum as f32;
        }
        let r = opt.step()?;
        skipped += r.skipped as i32;
        let mut l = [step_loss];
        world_group.allreduce_in_place(&mut l, ReduceOp::Avg)?;
        loss = l[0];
        if rank == 0 {
            println!(
                "step {step} loss {} grad_norm {} loss_scale {}{}",
                fmt_g(loss as f64, 9),
                fmt_g(r.grad_norm, 6),
                fmt_g(r.loss_scale, 6),
                if r.skipped {
                    " (skipped: overflow)"
                } else {
                    ""
                }
            );
        }
    }

    // Every rank's memory, gathered on rank 0 for one JSON line.
    let m = ctx.memory()?;
    let mine = [
        m.shard_bytes,
        m.grad_bytes,
        m.optimizer_bytes,
        m.unsharded_bytes,
    ];
    let mut bytes = vec![0u8; 32];
    for (i, v) in mine.iter().enumerate() {
        bytes[i * 8..i * 8 + 8].copy_from_slice(&v.to_ne_bytes());
    }
    let mut all = vec![0u8; 32 * world as usize];
    world_group.allgather_into(&bytes, &mut all)?;
    let field = |r: usize, i: usize| {
        u64::from_ne_bytes(all[r * 32 + i * 8..r * 32 + i * 8 + 8].try_into().unwrap())
    };
    if rank == 0 {
        let per_rank: Vec<String> = (0..world as usize)
            .map(|r| {
                format!(
                    "{{\"rank\":{r},\"param_bytes\":{},\"grad_bytes\":{},\"optimizer_bytes\":{}}}",
                    field(r, 0),
                    field(r, 1),
                    field(r, 2)
                )
            })
            .collect();
        let (device, backend) = ctx.device()?;
        let fs = ctx.fetch_stats()?;
        println!(
            "{{\"example\":\"train_mlp.rs\",\"ranks\":{world},\"dtype\":\"{}\",\"optimizer\":\"{}\",\"steps\":{},\
             \"device\":\"{}\",\"backend\":\"{backend}\",\"skipped_steps\":{skipped},\"final_loss\":{},\
             \"gathers\":{},\"hpz_gathers\":{},\"unsharded_param_bytes\":{},\"per_rank\":[{}]}}",
            a.dtype,
            a.optimizer,
            a.steps,
            match device {
                Device::Cpu => "cpu".to_string(),
                Device::Cuda(i) => format!("cuda:{i}"),
            },
            fmt_g(loss as f64, 9),
            fs.gathers,
            fs.hpz_gathers,
            field(0, 3),
            per_rank.join(",")
        );
    }
    Ok(())
}
