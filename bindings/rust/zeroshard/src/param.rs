//! Partitioned parameters: registration, gathers, and the full data of a
//! gathered param as slices that live exactly as long as it stays gathered.
use std::ffi::CString;
use std::marker::PhantomData;
use std::os::raw::c_void;
use std::ptr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use zeroshard_sys as sys;

use crate::context::{c_string, owned_str, Context};
use crate::error::{check, Error, Result, Status};
use crate::group::Group;
use crate::types::{expect_element, timeout_ms, DType, Device, Element, ParamStatus};

/// How a param gets its first values.
#[derive(Debug, Clone, Copy)]
pub enum Init<'d> {
    Zeros,
    /// N(mean, std^2) from `seed`, no traffic.
    Normal {
        seed: u64,
        mean: f64,
        std: f64,
    },
    /// U[low, high) from `seed`, no traffic.
    Uniform {
        seed: u64,
        low: f64,
        high: f64,
    },
    /// The same full values on every rank (raw bytes of the dtype), no traffic.
    FromAll(&'d [u8]),
    /// Full values read on group rank `src_rank` only (None elsewhere): a scatter.
    FromRank {
        src_rank: i32,
        data: Option<&'d [u8]>,
    },
}

/// What `Context::register` needs.
pub struct ParamSpec<'d, 'g, 'c> {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub init: Init<'d>,
    /// Partition over this group (default: the context's partition group).
    pub group: Option<&'g Group<'c>>,
}

impl<'d, 'g, 'c> ParamSpec<'d, 'g, 'c> {
    pub fn new(name: impl Into<String>, dtype: DType, shape: &[i64]) -> Self {
        ParamSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            init: Init::Zeros,
            group: None,
        }
    }
    pub fn init(mut self, init: Init<'d>) -> Self {
        self.init = init;
        self
    }
    pub fn group(mut self, group: &'g Group<'c>) -> Self {
        self.group = Some(group);
        self
    }
}

/// Bytes of a slice of elements, for `Init::FromAll` / `FromRank`.
pub fn as_bytes<T: Element>(v: &[T]) -> &[u8] {
    // SAFETY: Element types are plain data.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// `zs_param_info`, with owned fields.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub numel: u64,
    pub shard_numel: u64,
    pub padded_numel: u64,
    pub shard_offset: u64,
    pub shard_valid: u64,
    pub status: ParamStatus,
    pub device: Device,
    /// Moves on each time this rank's shard is rewritten other than by an
    /// optimizer step: a full copy gathered at one version is current while
    /// it stays.
    pub shard_version: u64,
}

pub struct Param<'c> {
    pub(crate) h: sys::zs_param,
    _ctx: PhantomData<&'c Context>,
    dtype: DType,
    numel: u64,
}

// SAFETY: handles may be shared between threads; calls on a param take its
// context's engine lock.
unsafe impl Send for Param<'_> {}
unsafe impl Sync for Param<'_> {}

impl Context {
    /// Register a parameter: this rank keeps only its shard. Collective over
    /// the group for `Init::FromRank`; every member registers the same params
    /// in the same order.
    pub fn register<'c>(&'c self, spec: &ParamSpec<'_, '_, 'c>) -> Result<Param<'c>> {
        let name: CString = c_string(&spec.name, "param name")?;
        let mut o = sys::zs_param_options::new();
        o.name = name.as_ptr();
        o.dtype = spec.dtype.code();
        o.ndim = spec.shape.len() as i32;
        o.shape = spec.shape.as_ptr();
        match spec.init {
            Init::Zeros => o.init = sys::ZS_INIT_ZEROS,
            Init::Normal { seed, mean, std } => {
                (o.init, o.seed, o.a, o.b) = (sys::ZS_INIT_NORMAL, seed, mean, std);
            }
            Init::Uniform { seed, low, high } => {
                (o.init, o.seed, o.a, o.b) = (sys::ZS_INIT_UNIFORM, seed, low, high);
            }
            Init::FromAll(data) => {
                (o.init, o.data, o.data_bytes) =
                    (sys::ZS_INIT_FROM_ALL, data.as_ptr().cast(), data.len());
            }
            Init::FromRank { src_rank, data } => {
                o.init = sys::ZS_INIT_FROM_RANK;
                o.src_rank = src_rank;
                if let Some(d) = data {
                    (o.data, o.data_bytes) = (d.as_ptr().cast(), d.len());
                }
            }
        }
        if let Some(g) = spec.group {
            o.group = g.handle();
        }
        let mut h = ptr::null_mut();
        // SAFETY: every pointer in `o` outlives the call, which copies or
        // scatters what it reads.
        check(unsafe { sys::zs_param_register(&mut h, self.h, &o) })?;
        let numel = spec.shape.iter().product::<i64>() as u64;
        Ok(Param {
            h,
            _ctx: PhantomData,
            dtype: spec.dtype,
            numel,
        })
    }

    /// Gather params as one coalesced asynchronous all-gather. Collective
    /// over their group: members fetch the same params in the same order.
    pub fn fetch<'p, 'c>(&'c self, params: &[&'p Param<'c>]) -> Result<Gather<'p, 'c>> {
        let handles = handles(params);
        let mut h = ptr::null_mut();
        // SAFETY: `handles.len()` handles.
        check(unsafe { sys::zs_fetch(&mut h, self.h, handles.as_ptr(), handles.len()) })?;
        Ok(Gather {
            h,
            ctx: self,
            params: params.to_vec(),
            handles,
        })
    }

    /// The coordinator's fetch of a module's params: blocks until all are
    /// gathered (prefetched along the trace where it could). Read them with
    /// `Param::copy_to`; hand them back with `coord_release`.
    pub fn coord_fetch(&self, params: &[&Param<'_>]) -> Result<()> {
        let handles = handles(params);
        // SAFETY: `handles.len()` handles.
        check(unsafe { sys::zs_coord_fetch(self.h, handles.as_ptr(), handles.len()) })
    }
    pub fn coord_release(&self, params: &[&Param<'_>]) -> Result<()> {
        let handles = handles(params);
        // SAFETY: as above.
        check(unsafe { sys::zs_coord_release(self.h, handles.as_ptr(), handles.len()) })
    }
    /// torch's zero_grad between a backward and the step: the gradients
    /// pushed for params since their last step are dropped, so the step sees
    /// only what is pushed after. No collective when none has one pushed.
    pub fn grad_discard(&self, params: &[&Param<'_>]) -> Result<()> {
        let handles = handles(params);
        // SAFETY: `handles.len()` handles.
        check(unsafe { sys::zs_grad_discard(self.h, handles.as_ptr(), handles.len()) })
    }
    /// Make params one unit for the coordinator (e.g. an MoE layer's experts).
    pub fn leaf_group(&self, params: &[&Param<'_>]) -> Result<()> {
        let handles = handles(params);
        // SAFETY: as above.
        check(unsafe { sys::zs_leaf_group(self.h, handles.as_ptr(), handles.len()) })
    }
}

pub(crate) fn handles(params: &[&Param<'_>]) -> Vec<sys::zs_param> {
    params.iter().map(|p| p.h).collect()
}

impl<'c> Param<'c> {
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn numel(&self) -> u64 {
        self.numel
    }

    pub fn info(&self) -> Result<ParamInfo> {
        let mut i = sys::zs_param_info::new();
        // SAFETY: a struct of the header's size.
        check(unsafe { sys::zs_param_get_info(self.h, &mut i) })?;
        Ok(ParamInfo {
            name: owned_str(i.name),
            dtype: DType::from_code(i.dtype)?,
            shape: i.shape[..i.ndim as usize].to_vec(),
            numel: i.numel,
            shard_numel: i.shard_numel,
            padded_numel: i.padded_numel,
            shard_offset: i.shard_offset,
            shard_valid: i.shard_valid,
            status: ParamStatus::from_code(i.status),
            device: Device::from_codes(i.device_type, i.device_id),
            shard_version: i.shard_version,
        })
    }

    pub fn status(&self) -> Result<ParamStatus> {
        let mut s = 0;
        // SAFETY: an out pointer.
        check(unsafe { sys::zs_param_get_status(self.h, &mut s) })?;
        Ok(ParamStatus::from_code(s))
    }

    /// Copy the full data of a gathered param into `dst` (numel elements),
    /// wherever the engine keeps it.
    pub fn copy_to<T: Element>(&self, dst: &mut [T]) -> Result<()> {
        expect_element::<T>(self.dtype, "this param")?;
        // SAFETY: `dst` is writable for its byte size, which the engine
        // checks against numel * dtype size.
        check(unsafe {
            sys::zs_param_copy_to(self.h, dst.as_mut_ptr().cast(), std::mem::size_of_val(dst))
        })
    }

    /// Hand the engine this param's full gradient (numel elements of `T`'s
    /// dtype; `dtype` says which 16-bit format a `Half16` slice holds). The
    /// engine copies it: the slice is free again on return. Collective over
    /// the param's group, in the same order on every member.
    pub fn grad_push<T: Element>(&self, grad: &[T], dtype: DType) -> Result<()> {
        expect_element::<T>(dtype, "the gradient")?;
        // SAFETY: `grad` is readable for its byte size; the engine copies it.
        check(unsafe {
            sys::zs_grad_push(
                self.h,
                grad.as_ptr().cast::<c_void>(),
                dtype.code(),
                std::mem::size_of_val(grad),
            )
        })
    }

    /// Freeze the param for good (`zs_param_freeze`): gathered as before,
    /// but a gradient push is refused and no optimizer steps it. Under
    /// `zero_quantized_nontrainable_weights` its shard is kept from now on
    /// only as block-quantized codes. Between optimizer steps.
    pub fn freeze(&self) -> Result<()> {
        // SAFETY: the handle is ours.
        check(unsafe { sys::zs_param_freeze(self.h) })
    }
}

impl Drop for Param<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle is ours; a gathered param is released first.
        unsafe { sys::zs_param_destroy(self.h) };
    }
}

/// A fetch in flight. `wait` turns it into `Gathered`; dropping it instead
/// waits and releases the params.
pub struct Gather<'p, 'c> {
    h: sys::zs_gather,
    ctx: &'c Context,
    params: Vec<&'p Param<'c>>,
    handles: Vec<sys::zs_param>,
}

// SAFETY: gather handles may be shared between threads (header).
unsafe impl Send for Gather<'_, '_> {}
unsafe impl Sync for Gather<'_, '_> {}

impl<'p, 'c> Gather<'p, 'c> {
    pub fn wait(self) -> Result<Gathered<'p, 'c>> {
        self.wait_timeout(None).map_err(|(e, _)| e)
    }

    /// As `wait`; on `Status::Timeout` the gather comes back to wait again.
    pub fn wait_timeout(
        self,
        timeout: Option<Duration>,
    ) -> std::result::Result<Gathered<'p, 'c>, (Error, Option<Self>)> {
        // SAFETY: a live gather handle.
        if let Err(e) = check(unsafe { sys::zs_gather_wait(self.h, timeout_ms(timeout)) }) {
            let again = (e.status == Status::Timeout).then_some(self);
            return Err((e, again));
        }
        let mut this = std::mem::ManuallyDrop::new(self);
        // SAFETY: the gather is done; its handle is destroyed here, once,
        // and the fields are moved out of the ManuallyDrop exactly once.
        unsafe { sys::zs_gather_destroy(this.h) };
        let params = std::mem::take(&mut this.params);
        let handles = std::mem::take(&mut this.handles);
        let ctx = this.ctx;
        ctx.views.fetch_add(1, Ordering::SeqCst);
        Ok(Gathered {
            ctx,
            params,
            handles,
            released: false,
            _not_send_by_default: PhantomData,
        })
    }

    pub fn test(&self) -> Result<bool> {
        let mut done = 0;
        // SAFETY: an out pointer.
        check(unsafe { sys::zs_gather_test(self.h, &mut done) })?;
        Ok(done != 0)
    }
}

impl Drop for Gather<'_, '_> {
    fn drop(&mut self) {
        // SAFETY: waits for the gather, then gives the memory back.
        unsafe {
            sys::zs_gather_destroy(self.h);
            sys::zs_release(self.ctx.h, self.handles.as_ptr(), self.handles.len());
        }
    }
}

/// Gathered params: their full data readable (and writable, for
/// `update`) as slices until this is dropped or released, which frees it.
pub struct Gathered<'p, 'c> {
    ctx: &'c Context,
    params: Vec<&'p Param<'c>>,
    handles: Vec<sys::zs_param>,
    released: bool,
    _not_send_by_default: PhantomData<*mut u8>,
}

// SAFETY: the slices it hands out borrow it; the engine does not write a
// gathered param's data except through `update` (which takes &mut self) and
// an optimizer step, which refuses to run while any Gathered is alive.
unsafe impl Send for Gathered<'_, '_> {}
unsafe impl Sync for Gathered<'_, '_> {}

impl<'p, 'c> Gathered<'p, 'c> {
    pub fn len(&self) -> usize {
        self.params.len()
    }
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }
    pub fn param(&self, i: usize) -> &'p Param<'c> {
        self.params[i]
    }

    fn raw(&self, i: usize) -> Result<(*mut c_void, usize)> {
        let p = self.params.get(i).ok_or_else(|| {
            Error::new(
                Status::InvalidArgument,
                format!("index {i}: {} params gathered", self.params.len()),
            )
        })?;
        let info = p.info()?;
        if info.device != Device::Cpu {
            return Err(Error::new(
                Status::NotSupported,
                format!(
                    "param '{}' lives on {:?}: read it with Param::copy_to",
                    info.name, info.device
                ),
            ));
        }
        let mut data = ptr::null_mut();
        // SAFETY: an out pointer; the param is AVAILABLE while self lives.
        check(unsafe { sys::zs_param_data(p.h, &mut data) })?;
        Ok((data, p.numel as usize))
    }

    /// The full data of param `i` (numel elements, row-major).
    pub fn data<T: Element>(&self, i: usize) -> Result<&[T]> {
        expect_element::<T>(
            self.params.get(i).map_or(T::DTYPE, |p| p.dtype),
            "this param",
        )?;
        let (data, n) = self.raw(i)?;
        if n == 0 {
            return Ok(&[]);
        }
        // SAFETY: numel elements of T's dtype, valid until release (self's drop).
        Ok(unsafe { std::slice::from_raw_parts(data.cast::<T>(), n) })
    }

    /// Writable full data; `update` makes the writes stick.
    pub fn data_mut<T: Element>(&mut self, i: usize) -> Result<&mut [T]> {
        expect_element::<T>(
            self.params.get(i).map_or(T::DTYPE, |p| p.dtype),
            "this param",
        )?;
        let (data, n) = self.raw(i)?;
        if n == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as data; &mut self makes the view unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(data.cast::<T>(), n) })
    }

    /// GatheredParameters: broadcast group rank `modifier_rank`'s full data
    /// and re-partition it, so the change survives release. Collective.
    pub fn update(&mut self, modifier_rank: i32) -> Result<()> {
        // SAFETY: the params are AVAILABLE; &mut self excludes other views.
        check(unsafe {
            sys::zs_param_update(
                self.ctx.h,
                self.handles.as_ptr(),
                self.handles.len(),
                modifier_rank,
            )
        })
    }

    /// Release now, with the error if any (dropping releases too).
    pub fn release(mut self) -> Result<()> {
        self.release_inner()
    }

    fn release_inner(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.released, true) {
            return Ok(());
        }
        self.ctx.views.fetch_sub(1, Ordering::SeqCst);
        // SAFETY: the params are AVAILABLE; no view outlives self.
        check(unsafe { sys::zs_release(self.ctx.h, self.handles.as_ptr(), self.handles.len()) })
    }
}

impl Drop for Gathered<'_, '_> {
    fn drop(&mut self) {
        let _ = self.release_inner();
    }
}
