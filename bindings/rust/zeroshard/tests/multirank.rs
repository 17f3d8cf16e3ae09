//! Real ranks: each test starts processes and checks what they compute.
//!  - file-store tests run this test binary again, once per rank, with
//!    RANK/WORLD_SIZE and a rendezvous folder (`worker_*` tests, ignored in
//!    a plain run, do the work in the children);
//!  - the zsrun test runs examples/rust/train_mlp.rs and examples/c/train_mlp.c
//!    under the engine's launcher and compares their losses line by line.
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use zeroshard::*;

const WORKER_ENV: &str = "ZS_RUST_TEST_STORE";

/// Runs `worker` in `n` processes of this test binary; panics with every
/// rank's output if any fails.
fn run_ranks(n: i32, worker: &str) {
    let store =
        std::env::temp_dir().join(format!("zeroshard-rust-{}-{worker}", std::process::id()));
    let _ = std::fs::remove_dir_all(&store);
    std::fs::create_dir_all(&store).unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..n)
        .map(|rank| {
            Command::new(&exe)
                .args([
                    worker,
                    "--exact",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(WORKER_ENV, &store)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("ZS_TIMEOUT_MS", "60000")
                .env("ZS_DEVICE", "cpu")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawning a rank")
        })
        .collect();
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let _ = std::fs::remove_dir_all(&store);
    let failed: Vec<_> = outputs
        .iter()
        .enumerate()
        .filter(|(_, o)| !o.status.success())
        .collect();
    for (rank, o) in &failed {
        eprintln!(
            "--- rank {rank}: {}\n{}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert!(
        failed.is_empty(),
        "{worker}: ranks {:?} failed (output above)",
        failed.iter().map(|f| f.0).collect::<Vec<_>>()
    );
}

/// The context of a worker process, or None when run outside run_ranks.
fn worker_context() -> Option<Context> {
    let store = std::env::var(WORKER_ENV).ok()?;
    let opts = ContextOptions::new()
        .file_store(store)
        .timeout(Duration::from_secs(60));
    Some(Context::new(&opts).expect("worker context"))
}

#[test]
fn collectives_on_three_ranks() {
    run_ranks(3, "worker_collectives");
}

#[test]
#[ignore = "a rank of collectives_on_three_ranks"]
fn worker_collectives() {
    let Some(ctx) = worker_context() else { return };
    let (rank, n) = (ctx.rank().unwrap(), ctx.world_size().unwrap());
    assert_eq!(n, 3);
    let world = ctx.group(GroupKind::World).unwrap();

    let sum = world
        .allreduce(vec![rank as f32 + 1.0; 4], ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(sum, vec![6.0; 4]);
    let (_, all) = world
        .allgather(vec![rank as u8; 2])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(all, vec![0, 0, 1, 1, 2, 2]);
    let b = world
        .broadcast(vec![rank as f32 * 10.0; 3], 1)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(b, vec![10.0; 3]);
    let send: Vec<f32> = (0..6).map(|i| (i + rank) as f32).collect();
    let (_, mine) = world
        .reduce_scatter(send, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    let want: Vec<f32> = (0..2)
        .map(|i| (0..3).map(|r| (rank * 2 + i + r) as f32).sum())
        .collect();
    assert_eq!(mine, want);
    let mut m = [rank as f32];
    world.allreduce_in_place(&mut m, ReduceOp::Max).unwrap();
    assert_eq!(m, [2.0]);

    // A sub-group: rank 2 is outside it and gets no rank.
    let pair = ctx.new_group(&[0, 1]).unwrap();
    assert_eq!(
        pair.rank().unwrap(),
        if rank < 2 { Some(rank) } else { None }
    );
    if rank < 2 {
        let s = pair
            .allreduce(vec![1.0f32], ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(s, vec![2.0]);
    }

    // Shared between threads: a collective issued from a scoped thread
    // while this one waits (Group and Context are Sync).
    let mut v = [rank as f32];
    std::thread::scope(|s| {
        s.spawn(|| world.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap());
    });
    assert_eq!(v, [3.0]);
    world.barrier().unwrap().wait().unwrap();
}

#[test]
fn params_and_training_on_two_ranks() {
    run_ranks(2, "worker_params");
}

#[test]
#[ignore = "a rank of params_and_training_on_two_ranks"]
fn worker_params() {
    let Some(ctx) = worker_context() else { return };
    let rank = ctx.rank().unwrap();
    // 7 elements over 2 ranks: shards of 4, the last one padded.
    let values: Vec<f32> = (0..7).map(|i| i as f32).collect();
    let data = (rank == 0).then_some(as_bytes(&values));
    let w = ctx
        .register(&ParamSpec::new("w", DType::F32, &[7]).init(Init::FromRank { src_rank: 0, data }))
        .unwrap();
    let info = w.info().unwrap();
    assert_eq!((info.numel, info.shard_numel, info.padded_numel), (7, 4, 8));
    assert_eq!(
        (info.shard_offset, info.shard_valid),
        (rank as u64 * 4, if rank == 0 { 4 } else { 3 })
    );

    let mut g = ctx.fetch(&[&w]).unwrap().wait().unwrap();
    assert_eq!(g.data::<f32>(0).unwrap(), values.as_slice());
    // GatheredParameters from rank 1: its write reaches every rank's shard.
    if rank == 1 {
        g.data_mut::<f32>(0).unwrap()[6] = -1.0;
    }
    g.update(1).unwrap();
    g.release().unwrap();
    let g = ctx.fetch(&[&w]).unwrap().wait().unwrap();
    assert_eq!(g.data::<f32>(0).unwrap()[6], -1.0);
    drop(g);

    // SGD, lr 1: the step subtracts the mean of the ranks' gradients.
    let mut opt = Optimizer::new(&ctx, OptimizerKind::Sgd).unwrap();
    opt.add_group(
        &[&w],
        &Hparams {
            lr: 1.0,
            weight_decay: 0.0,
            momentum: 0.0,
            ..Hparams::default()
        },
    )
    .unwrap();
    let grad = vec![rank as f32 + 1.0; 7]; // mean 1.5
    w.grad_push(&grad, DType::F32).unwrap();
    let r = opt.step().unwrap();
    assert!(
        (r.grad_norm - (7.0f64 * 1.5 * 1.5).sqrt()).abs() < 1e-5,
        "{}",
        r.grad_norm
    );
    let mut after = vec![0.0f32; 7];
    let g = ctx.fetch(&[&w]).unwrap().wait().unwrap();
    w.copy_to(&mut after).unwrap();
    drop(g);
    let mut want: Vec<f32> = values.iter().map(|v| v - 1.5).collect();
    want[6] = -2.5;
    assert_eq!(after, want);
    let m = ctx.memory().unwrap();
    assert_eq!((m.shard_bytes, m.unsharded_bytes), (16, 28));
}

// ---------------------------------------------------------------- zsrun

/// The CMake build's bin folder (beside the library zeroshard-sys linked).
fn build_bin() -> PathBuf {
    let lib = env!("ZEROSHARD_BUILD_LIB_DIR");
    PathBuf::from(lib).join("../bin")
}

fn program(env: &str, default: PathBuf) -> PathBuf {
    let p = std::env::var(env).map(PathBuf::from).unwrap_or(default);
    assert!(
        p.exists(),
        "{} not found (build it, or set {env})",
        p.display()
    );
    p
}

fn step_lines(out: &Output, what: &str) -> Vec<String> {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed: {}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .filter(|l| l.contains("] step "))
        .map(str::to_string)
        .collect()
}

/// The Rust example, built now with this test's profile (a plain `cargo
/// test` builds it too, but `cargo test --test multirank` would not).
fn build_rust_example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap(); // <target>/<profile>
    let profile = match profile_dir.file_name().unwrap().to_str().unwrap() {
        "debug" => "dev",
        other => other,
    };
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "build",
            "--offline",
            "-p",
            "zeroshard",
            "--example",
            "train_mlp",
            "--profile",
            profile,
        ])
        .env("CARGO_TARGET_DIR", profile_dir.parent().unwrap())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "building the example: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    profile_dir.join("examples/train_mlp")
}

#[test]
fn rust_train_mlp_equals_the_c_example_under_zsrun() {
    let zsrun = program("ZSRUN", build_bin().join("zsrun"));
    let c_example = program("ZS_C_TRAIN_MLP", build_bin().join("train_mlp"));
    let rust_example = program("ZS_RUST_TRAIN_MLP", build_rust_example());
    for args in [
        &["--steps", "12"][..],
        &[
            "--steps",
            "6",
            "--optimizer",
            "sgd",
            "--clip",
            "0.5",
            "--accum",
            "2",
        ],
    ] {
        let run = |example: &PathBuf| {
            Command::new(&zsrun)
                .args(["-n", "2", "--"])
                .arg(example)
                .args(args)
                .env("ZS_DEVICE", "cpu")
                .output()
                .unwrap()
        };
        let c = step_lines(&run(&c_example), "the C example");
        let rust = step_lines(&run(&rust_example), "the Rust example");
        assert!(
            !c.is_empty() && c.len() == rust.len(),
            "{} C lines, {} Rust lines",
            c.len(),
            rust.len()
        );
        assert_eq!(rust, c, "train_mlp {args:?}: Rust and C losses differ");
        println!(
            "{args:?}: {} steps equal, last: {}",
            c.len(),
            c.last().unwrap()
        );
    }
}
