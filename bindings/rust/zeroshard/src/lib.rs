//! Safe Rust API of zeroshard, a ZeRO-3 engine behind a C ABI.
//!
//! Every handle is an RAII type whose `Drop` gives it back; every call
//! returns `Result<T, Error>` with the engine's status and message. All
//! types are `Send + Sync`, as the header allows every call on any thread
//! (calls on one context serialise on its engine lock). Borrowing follows
//! the engine's lifetimes: groups, params and optimizers borrow their
//! `Context`; `Gathered` hands out slices over engine memory that live
//! until it releases the params; collectives own their buffers until
//! waited for.
//!
//! ```no_run
//! use zeroshard::*;
//! let ctx = Context::new(&ContextOptions::new().rank(0, 1))?;
//! let w = ctx.register(&ParamSpec::new("w", DType::F32, &[4, 4])
//!     .init(Init::Normal { seed: 1, mean: 0.0, std: 0.02 }))?;
//! let gathered = ctx.fetch(&[&w])?.wait()?;
//! let full: &[f32] = gathered.data(0)?;
//! assert_eq!(full.len(), 16);
//! # Ok::<(), zeroshard::Error>(())
//! ```
//!
//! Gathered data cannot outlive the release of its params:
//!
//! ```compile_fail,E0597
//! # use zeroshard::*;
//! # let ctx = Context::new(&ContextOptions::new().rank(0, 1))?;
//! # let w = ctx.register(&ParamSpec::new("w", DType::F32, &[4]))?;
//! let full: &[f32] = {
//!     let gathered = ctx.fetch(&[&w])?.wait()?;
//!     gathered.data(0)?
//! }; // released here
//! # let _ = full;
//! # Ok::<(), zeroshard::Error>(())
//! ```
//!
//! nor a param outlive its context:
//!
//! ```compile_fail,E0597
//! # use zeroshard::*;
//! let w = {
//!     let ctx = Context::new(&ContextOptions::new().rank(0, 1))?;
//!     ctx.register(&ParamSpec::new("w", DType::F32, &[4]))?
//! };
//! # Ok::<(), zeroshard::Error>(())
//! ```
//!
//! and a collective's buffer belongs to the engine until it is waited for:
//!
//! ```compile_fail,E0382
//! # use zeroshard::*;
//! # let ctx = Context::new(&ContextOptions::new().rank(0, 1))?;
//! # let world = ctx.group(GroupKind::World)?;
//! let mut buf = vec![1.0f32; 4];
//! let work = world.allreduce(buf, ReduceOp::Sum)?;
//! buf[0] = 2.0; // moved into the work
//! # Ok::<(), zeroshard::Error>(())
//! ```
mod context;
mod error;
mod group;
mod optimizer;
mod param;
mod types;

pub use context::{
    config_check, cuda_device_count, version, Context, ContextOptions, CoordStats, FetchStats,
    MemoryStats,
};
pub use error::{Error, Result, Status};
pub use group::{Group, Work};
pub use optimizer::{Hparams, NsMethod, Optimizer, OptimizerKind, StepResult};
pub use param::{as_bytes, Gather, Gathered, Init, Param, ParamInfo, ParamSpec};
pub use types::{DType, Device, Element, GroupKind, Half16, ParamStatus, ReduceOp};
pub use zeroshard_sys as sys;
