//! The sharded optimizer over fp32 master shards.
use std::ptr;
use std::sync::atomic::Ordering;

use zeroshard_sys as sys;

use crate::context::Context;
use crate::error::{check, Error, Result, Status};
use crate::param::{handles, Param};
use crate::types::Device;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    AdamW,
    Adam,
    Sgd,
    /// DeepSpeed 0.19's Muon with its auxiliary AdamW (`ZS_OPTIM_MUON`):
    /// matrices step Muon, the rest AdamW, as each group's `use_muon` says.
    Muon,
}

/// Muon's Newton-Schulz iteration (`ns_method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NsMethod {
    /// On the small Gram matrix (DeepSpeed's default).
    Gram,
    /// The quintic step on the matrix itself.
    Standard,
}

/// `zs_optim_hparams`; `Hparams::default()` is the header's
/// ZS_OPTIM_HPARAMS_INIT, read from the library.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hparams {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub bias_correction: bool,
    /// `OptimizerKind::Muon` only: `Some(true)` the group steps Muon,
    /// `Some(false)` AdamW, `None` by shape (2 or more dims: Muon).
    pub use_muon: Option<bool>,
    pub ns_method: NsMethod,
    pub ns_steps: i32,
}

impl Default for Hparams {
    fn default() -> Self {
        let h = sys::zs_optim_hparams::new();
        Hparams {
            lr: h.lr,
            beta1: h.beta1,
            beta2: h.beta2,
            eps: h.eps,
            weight_decay: h.weight_decay,
            momentum: h.momentum,
            dampening: h.dampening,
            nesterov: h.nesterov != 0,
            bias_correction: h.bias_correction != 0,
            use_muon: match h.use_muon {
                -1 => None,
                v => Some(v != 0),
            },
            ns_method: if h.ns_method == 1 { NsMethod::Standard } else { NsMethod::Gram },
            ns_steps: h.ns_steps,
        }
    }
}

impl Hparams {
    fn to_c(self) -> sys::zs_optim_hparams {
        let mut h = sys::zs_optim_hparams::new();
        h.lr = self.lr;
        h.beta1 = self.beta1;
        h.beta2 = self.beta2;
        h.eps = self.eps;
        h.weight_decay = self.weight_decay;
        h.momentum = self.momentum;
        h.dampening = self.dampening;
        h.nesterov = self.nesterov as i32;
        h.bias_correction = self.bias_correction as i32;
        h.use_muon = self.use_muon.map_or(-1, |m| m as i32);
        h.ns_method = match self.ns_method {
            NsMethod::Gram => 0,
            NsMethod::Standard => 1,
        };
        h.ns_steps = self.ns_steps;
        h
    }
}

/// What one step did (`zs_step_result`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepResult {
    /// Gradients overflowed (fp16): nothing was updated.
    pub skipped: bool,
    pub grad_norm: f64,
    /// The scale to multiply the next loss by (1 unless fp16).
    pub loss_scale: f64,
    pub step: i64,
}

pub struct Optimizer<'c> {
    h: sys::zs_optimizer,
    ctx: &'c Context,
}

// SAFETY: handles may be shared between threads; calls take the context's
// engine lock. Methods that let the engine write memory a slice may view
// take &mut self.
unsafe impl Send for Optimizer<'_> {}
unsafe impl Sync for Optimizer<'_> {}

impl<'c> Optimizer<'c> {
    pub fn new(ctx: &'c Context, kind: OptimizerKind) -> Result<Self> {
        let k = match kind {
            OptimizerKind::AdamW => sys::ZS_OPTIM_ADAMW,
            OptimizerKind::Adam => sys::ZS_OPTIM_ADAM,
            OptimizerKind::Sgd => sys::ZS_OPTIM_SGD,
            OptimizerKind::Muon => sys::ZS_OPTIM_MUON,
        };
        let mut h = ptr::null_mut();
        // SAFETY: a live context and an out pointer.
        check(unsafe { sys::zs_optimizer_create(&mut h, ctx.h, k) })?;
        Ok(Optimizer { h, ctx })
    }

    /// A parameter group with its own hyper-parameters; returns its index.
    pub fn add_group(&mut self, params: &[&Param<'c>], hparams: &Hparams) -> Result<i32> {
        let handles = handles(params);
        let h = hparams.to_c();
        let mut index = -1;
        // SAFETY: `handles.len()` handles, a struct of the header's size.
        check(unsafe {
            sys::zs_optimizer_add_group(self.h, handles.as_ptr(), handles.len(), &h, &mut index)
        })?;
        Ok(index)
    }

    /// Change a group's hyper-parameters (None: every group).
    pub fn set_hparams(&self, group: Option<i32>, hparams: &Hparams) -> Result<()> {
        let h = hparams.to_c();
        // SAFETY: as above.
        check(unsafe { sys::zs_optimizer_set_hparams(self.h, group.unwrap_or(-1), &h) })
    }
    pub fn set_lr(&self, group: Option<i32>, lr: f64) -> Result<()> {
        // SAFETY: a live handle.
        check(unsafe { sys::zs_optimizer_set_lr(self.h, group.unwrap_or(-1), lr) })
    }

    fn no_views(&self, what: &str) -> Result<()> {
        let n = self.ctx.views.load(Ordering::SeqCst);
        if n != 0 {
            return Err(Error::new(
                Status::InvalidState,
                format!("{what} while {n} Gathered view(s) of this context are alive: drop or release them first (a step rewrites shards, which a world of one gathers in place)"),
            ));
        }
        Ok(())
    }

    /// One optimizer step, collective over the world.
    pub fn step(&mut self) -> Result<StepResult> {
        self.no_views("optimizer step")?;
        let mut r = sys::zs_step_result::new();
        // SAFETY: a struct of the header's size.
        check(unsafe { sys::zs_optimizer_step(self.h, &mut r) })?;
        Ok(StepResult {
            skipped: r.skipped != 0,
            grad_norm: r.grad_norm,
            loss_scale: r.loss_scale,
            step: r.step,
        })
    }

    pub fn loss_scale(&self) -> Result<f64> {
        let mut s = 0.0;
        // SAFETY: an out pointer.
        check(unsafe { sys::zs_optimizer_loss_scale(self.h, &mut s) })?;
        Ok(s)
    }
    pub fn get_step(&self) -> Result<i64> {
        let mut s = 0;
        // SAFETY: an out pointer.
        check(unsafe { sys::zs_optimizer_get_step(self.h, &mut s) })?;
        Ok(s)
    }
    pub fn set_step(&mut self, step: i64) -> Result<()> {
        // SAFETY: a live handle.
        check(unsafe { sys::zs_optimizer_set_step(self.h, step) })
    }
    /// Rewrite the working (16-bit) shards from the masters.
    pub fn sync_params(&mut self) -> Result<()> {
        self.no_views("sync_params")?;
        // SAFETY: a live handle.
        check(unsafe { sys::zs_optimizer_sync_params(self.h) })
    }

    /// This rank's shard of a param's optimizer state, for checkpoints:
    /// slot 0 the fp32 master, 1 exp_avg or momentum, 2 exp_avg_sq. Borrows
    /// the optimizer mutably, so no step runs while the slice is alive.
    pub fn state(&mut self, param: &Param<'c>, slot: i32) -> Result<&mut [f32]> {
        self.no_views("optimizer state access")?;
        if let Device::Cuda(i) = param.info()?.device {
            return Err(Error::new(
                Status::NotSupported,
                format!("optimizer state lives on cuda:{i}"),
            ));
        }
        let (mut data, mut n) = (ptr::null_mut(), 0u64);
        // SAFETY: out pointers.
        check(unsafe { sys::zs_optimizer_state_data(self.h, param.h, slot, &mut data, &mut n) })?;
        if n == 0 || data.is_null() {
            return Ok(&mut []);
        }
        // SAFETY: shard_numel fp32 elements owned by the optimizer, valid
        // while it lives; &mut self keeps steps away.
        Ok(unsafe { std::slice::from_raw_parts_mut(data, n as usize) })
    }
}

impl Drop for Optimizer<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle is ours.
        unsafe { sys::zs_optimizer_destroy(self.h) };
    }
}
