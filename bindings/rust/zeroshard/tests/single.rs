//! The safe API in a world of one (no sockets): errors, RAII, lifetimes of
//! gathered data, the optimizer, collectives.
use zeroshard::*;

fn world_of_one() -> Context {
    Context::new(&ContextOptions::new().rank(0, 1).device("cpu")).expect("context")
}

fn from_all<'c>(ctx: &'c Context, name: &str, values: &[f32], shape: &[i64]) -> Param<'c> {
    ctx.register(&ParamSpec::new(name, DType::F32, shape).init(Init::FromAll(as_bytes(values))))
        .unwrap()
}

#[test]
fn handle_types_are_send_and_sync() {
    fn both<T: Send + Sync>() {}
    both::<Context>();
    both::<Group>();
    both::<Param>();
    both::<Gather>();
    both::<Gathered>();
    both::<Optimizer>();
    both::<Work<Vec<f32>>>();
    both::<Error>();
}

#[test]
fn errors_carry_the_status_and_the_engines_message() {
    let e = Context::new(
        &ContextOptions::new()
            .rank(0, 1)
            .config_json(r#"{"zero_optimization": {"stage": "three"}}"#),
    )
    .err()
    .expect("a bad config must fail");
    assert_eq!(e.status, Status::InvalidConfig);
    assert!(e.message.contains("zero_optimization.stage"), "{e}");
    assert!(e.to_string().starts_with("ZS_ERR_INVALID_CONFIG: "), "{e}");

    let e = config_check(r#"{"zero_optimization": {"mics_shard_size": 3}}"#, 8).unwrap_err();
    assert_eq!(e.status, Status::InvalidConfig);
    assert!(e.message.contains("mics_shard_size"), "{e}");

    let e = Context::new(&ContextOptions::new().rank(3, 2))
        .err()
        .unwrap();
    assert_eq!(e.status, Status::Bootstrap);
    assert!(
        e.message
            .contains("rank 3 is out of range for world size 2"),
        "{e}"
    );

    let ctx = world_of_one();
    let e = ctx
        .register(&ParamSpec::new("bad\0name", DType::F32, &[2]))
        .err()
        .unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("NUL"), "{e}");
    let e = ctx
        .register(&ParamSpec::new("w", DType::F32, &[-1, 2]))
        .err()
        .unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("-1"), "{e}");
    assert_eq!(version(), "0.1.0");
    let (gpus, why) = cuda_device_count().unwrap();
    assert!(gpus > 0 || !why.is_empty(), "no GPU and no reason given");
}

#[test]
fn gathered_data_reads_updates_and_releases() {
    let ctx = world_of_one();
    let values: Vec<f32> = (0..15).map(|i| i as f32 * 0.5).collect();
    let w = from_all(&ctx, "w", &values, &[3, 5]);
    let info = w.info().unwrap();
    assert_eq!(
        (info.name.as_str(), info.shape.as_slice(), info.numel),
        ("w", &[3i64, 5][..], 15)
    );
    assert_eq!(
        (info.device, info.dtype, info.status),
        (Device::Cpu, DType::F32, ParamStatus::NotAvailable)
    );

    let mut g = ctx.fetch(&[&w]).unwrap().wait().unwrap();
    assert_eq!(w.status().unwrap(), ParamStatus::Available);
    assert_eq!(g.data::<f32>(0).unwrap(), values.as_slice());
    let e = g.data::<u8>(0).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("F32"), "{e}");
    assert_eq!(
        g.data::<f32>(1).unwrap_err().status,
        Status::InvalidArgument
    );
    g.data_mut::<f32>(0).unwrap()[4] = 100.0;
    g.update(0).unwrap();
    // The shard was rewritten: a copy kept from before is stale.
    assert_eq!(w.info().unwrap().shard_version, info.shard_version + 1);
    drop(g); // releases
    assert_eq!(w.status().unwrap(), ParamStatus::NotAvailable);

    let g = ctx.fetch(&[&w]).unwrap().wait().unwrap();
    assert_eq!(
        g.data::<f32>(0).unwrap()[4],
        100.0,
        "update made the write stick"
    );
    g.release().unwrap();
    let mut copy = vec![0.0f32; 15];
    let e = w.copy_to(&mut copy).unwrap_err();
    assert_eq!(
        e.status,
        Status::InvalidState,
        "copy_to of a released param: {e}"
    );
}

#[test]
fn a_gather_dropped_unwaited_waits_and_releases() {
    let ctx = world_of_one();
    let w = from_all(&ctx, "w", &[1.0, 2.0], &[2]);
    let g = ctx.fetch(&[&w]).unwrap();
    let e = ctx
        .fetch(&[&w])
        .err()
        .expect("a param in flight cannot be fetched again");
    assert_eq!(e.status, Status::InvalidState);
    drop(g);
    assert_eq!(w.status().unwrap(), ParamStatus::NotAvailable);
    let g = ctx.fetch(&[&w]).unwrap();
    assert!(g.test().unwrap() || g.wait().is_ok());
}

#[test]
fn zero_size_params_give_empty_slices() {
    let ctx = world_of_one();
    let z = ctx
        .register(&ParamSpec::new("empty", DType::F32, &[0, 4]))
        .unwrap();
    let g = ctx.fetch(&[&z]).unwrap().wait().unwrap();
    assert!(g.data::<f32>(0).unwrap().is_empty());
}

#[test]
fn optimizer_steps_and_refuses_while_views_are_alive() {
    let ctx = world_of_one();
    let values = [1.0f32, -2.0, 3.0];
    let w = from_all(&ctx, "w", &values, &[3]);
    let mut opt = Optimizer::new(&ctx, OptimizerKind::AdamW).unwrap();
    let hp = Hparams {
        lr: 0.1,
        weight_decay: 0.0,
        ..Hparams::default()
    };
    assert!(
        hp.bias_correction && hp.beta1 == 0.9,
        "defaults from the library"
    );
    opt.add_group(&[&w], &hp).unwrap();
    w.grad_push(&[1.0f32, 1.0, -1.0], DType::F32).unwrap();

    let g = ctx.fetch(&[&w]).unwrap().wait().unwrap();
    let e = opt.step().unwrap_err();
    assert_eq!(e.status, Status::InvalidState);
    assert!(e.message.contains("1 Gathered view"), "{e}");
    drop(g);

    let r = opt.step().unwrap();
    assert!(!r.skipped && r.step == 1 && r.loss_scale == 1.0);
    assert!((r.grad_norm - 3f64.sqrt()).abs() < 1e-6, "{}", r.grad_norm);
    // First AdamW step with bias correction: lr * sign(g).
    let want = [0.9f32, -2.1, 3.1];
    let master = opt.state(&w, 0).unwrap().to_vec();
    for (m, x) in master.iter().zip(want) {
        assert!((m - x).abs() < 1e-5, "master {master:?}, want {want:?}");
    }
    let g = ctx.fetch(&[&w]).unwrap().wait().unwrap();
    for (v, x) in g.data::<f32>(0).unwrap().iter().zip(want) {
        assert!((v - x).abs() < 1e-5);
    }
    drop(g);
    assert_eq!(
        opt.state(&w, 7).unwrap_err().status,
        Status::InvalidArgument
    );
    assert_eq!(opt.get_step().unwrap(), 1);
}

#[test]
fn muon_orthogonalizes_matrices_and_steps_vectors_with_adamw() {
    let ctx = world_of_one();
    let w = from_all(&ctx, "w", &[0.0f32; 16], &[4, 4]);
    let b = from_all(&ctx, "b", &[1.0f32, -1.0], &[2]);
    let mut opt = Optimizer::new(&ctx, OptimizerKind::Muon).unwrap();
    let hp = Hparams {
        lr: 0.1,
        weight_decay: 0.0,
        momentum: 0.0,
        ..Hparams::default()
    };
    assert!(hp.use_muon.is_none() && hp.ns_steps == 5, "defaults from the library");
    opt.add_group(&[&w, &b], &hp).unwrap();
    // A gradient of 3 I: normalized it is I / 2, and each Newton-Schulz
    // step maps every singular value s to 3.4445 s - 4.7750 s^3 + 2.0315 s^5.
    let mut g = [0.0f32; 16];
    for i in 0..4 {
        g[i * 5] = 3.0;
    }
    w.grad_push(&g, DType::F32).unwrap();
    b.grad_push(&[2.0f32, -0.5], DType::F32).unwrap();
    opt.step().unwrap();
    let mut s = 0.5f64;
    for _ in 0..5 {
        s = 3.4445 * s - 4.7750 * s.powi(3) + 2.0315 * s.powi(5);
    }
    let master = opt.state(&w, 0).unwrap().to_vec();
    for (i, m) in master.iter().enumerate() {
        let want = if i % 5 == 0 { -0.1 * s } else { 0.0 };
        assert!((*m as f64 - want).abs() < 1e-5, "w[{i}] = {m}, want {want}");
    }
    // The vector steps AdamW: first step lr * sign(g).
    let bias = opt.state(&b, 0).unwrap().to_vec();
    assert!((bias[0] - 0.9).abs() < 1e-5 && (bias[1] + 0.9).abs() < 1e-5, "{bias:?}");
    // Muon's fields on another kind are refused, naming the field.
    let mut adamw = Optimizer::new(&ctx, OptimizerKind::AdamW).unwrap();
    let e = adamw
        .add_group(&[&b], &Hparams { ns_steps: 3, ..Hparams::default() })
        .unwrap_err();
    assert!(e.message.contains("ns_steps"), "{e}");
}

#[test]
fn collectives_in_a_world_of_one() {
    let ctx = world_of_one();
    let world = ctx.group(GroupKind::World).unwrap();
    assert_eq!((world.rank().unwrap(), world.size().unwrap()), (Some(0), 1));
    let w = world.allreduce(vec![1.0f32, 2.0], ReduceOp::Sum).unwrap();
    assert_eq!(w.wait().unwrap(), vec![1.0, 2.0]);
    let (send, recv) = world.allgather(vec![7u8, 8]).unwrap().wait().unwrap();
    assert_eq!((send, recv), (vec![7, 8], vec![7, 8]));
    assert_eq!(
        world.broadcast(vec![3.0f32], 0).unwrap().wait().unwrap(),
        vec![3.0]
    );
    world.barrier().unwrap().wait().unwrap();
    let mut buf = [2.0f32, 4.0];
    world.allreduce_in_place(&mut buf, ReduceOp::Max).unwrap();
    assert_eq!(buf, [2.0, 4.0]);
    let mut small = [0u8; 1];
    assert_eq!(
        world
            .allgather_into(&[1u8, 2], &mut small)
            .unwrap_err()
            .status,
        Status::BufferSize
    );
    let e = world.broadcast(vec![1.0f32], 5).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains('5'), "{e}");
}

#[test]
fn context_reports_its_settings() {
    let ctx = world_of_one();
    assert_eq!((ctx.rank().unwrap(), ctx.world_size().unwrap()), (0, 1));
    assert_eq!(ctx.device().unwrap(), (Device::Cpu, "gloo".to_string()));
    assert!(ctx.config_json().unwrap().contains("zero_optimization"));
    assert_eq!(ctx.inactive_config_keys().unwrap(), "[]");
    let _w = from_all(&ctx, "w", &[1.0; 6], &[6]);
    let m = ctx.memory().unwrap();
    assert_eq!((m.num_params, m.shard_bytes), (1, 24));
    assert!(ctx.async_error().is_ok());
}

#[test]
fn a_frozen_param_is_kept_quantized_and_refuses_gradients() {
    let ctx = Context::new(
        &ContextOptions::new()
            .rank(0, 1)
            .device("cpu")
            .config_json(r#"{"zero_optimization": {"zero_quantized_nontrainable_weights": true}}"#),
    )
    .expect("context");
    // Two blocks of 256: one scale each, max |x| / 127.
    let values: Vec<f32> = (0..512).map(|i| (i as f32 - 200.0) * 0.01).collect();
    let w = from_all(&ctx, "w", &values, &[512]);
    let before = ctx.memory().unwrap().shard_bytes;
    w.freeze().unwrap();
    let after = ctx.memory().unwrap().shard_bytes;
    assert_eq!((before, after), (2048, 2 * 4 + 512), "int8 codes and two scales");
    let g = ctx.fetch(&[&w]).unwrap().wait().unwrap();
    let got = g.data::<f32>(0).unwrap().to_vec();
    g.release().unwrap();
    for (block, chunk) in values.chunks(256).enumerate() {
        let scale = chunk.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 127.0;
        for (i, x) in chunk.iter().enumerate() {
            let y = got[block * 256 + i];
            assert!((x - y).abs() <= scale * 0.5001, "element {}: {x} -> {y}", block * 256 + i);
        }
    }
    assert_ne!(got, values, "quantized, not exact");
    let e = w.grad_push(&values, DType::F32).unwrap_err();
    assert_eq!(e.status, Status::InvalidState);
    assert!(e.message.contains("frozen"), "{e}");
}
