//! The context: one per process and data-parallel world. Everything else
//! (groups, params, optimizers) borrows it, so it outlives them.
use std::ffi::{CStr, CString};
use std::os::raw::c_char;
use std::ptr;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use zeroshard_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::types::{Device, GroupKind};

/// `zs_context_options`; `None` takes the engine's default (the
/// environment: torchrun's, Open MPI's or Slurm's variables).
#[derive(Debug, Clone, Default)]
pub struct ContextOptions {
    pub rank: Option<i32>,
    pub world_size: Option<i32>,
    pub local_rank: Option<i32>,
    pub local_world_size: Option<i32>,
    pub store_host: Option<String>,
    pub store_port: Option<i32>,
    /// Rendezvous through files in this shared folder instead of TCP.
    pub file_store_path: Option<String>,
    /// DeepSpeed JSON as text (at most one of this and `config_path`).
    pub config_json: Option<String>,
    pub config_path: Option<String>,
    pub timeout: Option<Duration>,
    pub transport_host: Option<String>,
    /// "cpu", "cuda" or "cuda:N".
    pub device: Option<String>,
    /// "gloo" or "nccl".
    pub backend: Option<String>,
}

impl ContextOptions {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn rank(mut self, rank: i32, world_size: i32) -> Self {
        self.rank = Some(rank);
        self.world_size = Some(world_size);
        self
    }
    pub fn config_json(mut self, json: impl Into<String>) -> Self {
        self.config_json = Some(json.into());
        self
    }
    pub fn file_store(mut self, path: impl Into<String>) -> Self {
        self.file_store_path = Some(path.into());
        self
    }
    pub fn device(mut self, device: impl Into<String>) -> Self {
        self.device = Some(device.into());
        self
    }
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

pub(crate) fn c_string(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| {
        Error::new(
            Status::InvalidArgument,
            format!("{what} contains a NUL byte: {s:?}"),
        )
    })
}

fn opt_c_string(s: &Option<String>, what: &str) -> Result<Option<CString>> {
    s.as_deref().map(|v| c_string(v, what)).transpose()
}

fn ptr_of(s: &Option<CString>) -> *const c_char {
    s.as_ref().map_or(ptr::null(), |c| c.as_ptr())
}

/// Copies a string the library owns.
pub(crate) fn owned_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the library returns NUL-terminated strings valid for the call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Memory held by this rank, in bytes (`zs_memory_stats`).
pub type MemoryStats = sys::zs_memory_stats;
/// Which way fetches went (`zs_fetch_stats`).
pub type FetchStats = sys::zs_fetch_stats;
/// The coordinator's counters (`zs_coord_stats`).
pub type CoordStats = sys::zs_coord_stats;

pub struct Context {
    pub(crate) h: sys::zs_context,
    /// Gathered views alive (see Optimizer::step).
    pub(crate) views: AtomicUsize,
}

// SAFETY: the header allows every function on any thread and every handle
// to be shared between threads (calls on one context serialise on its
// engine lock).
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    /// Bring up a context: rendezvous, connect the world, build the
    /// config's groups. Collective over the world.
    pub fn new(options: &ContextOptions) -> Result<Context> {
        let store_host = opt_c_string(&options.store_host, "store_host")?;
        let file_store = opt_c_string(&options.file_store_path, "file_store_path")?;
        let config_json = opt_c_string(&options.config_json, "config_json")?;
        let config_path = opt_c_string(&options.config_path, "config_path")?;
        let transport_host = opt_c_string(&options.transport_host, "transport_host")?;
        let device = opt_c_string(&options.device, "device")?;
        let backend = opt_c_string(&options.backend, "backend")?;
        let mut o = sys::zs_context_options::new();
        o.rank = options.rank.unwrap_or(o.rank);
        o.world_size = options.world_size.unwrap_or(o.world_size);
        o.local_rank = options.local_rank.unwrap_or(o.local_rank);
        o.local_world_size = options.local_world_size.unwrap_or(o.local_world_size);
        o.store_host = ptr_of(&store_host);
        o.store_port = options.store_port.unwrap_or(o.store_port);
        o.file_store_path = ptr_of(&file_store);
        o.config_json = ptr_of(&config_json);
        o.config_path = ptr_of(&config_path);
        if let Some(t) = options.timeout {
            o.timeout_ms = t.as_millis().clamp(1, i32::MAX as u128) as i32;
        }
        o.transport_host = ptr_of(&transport_host);
        o.device = ptr_of(&device);
        o.backend = ptr_of(&backend);
        let mut h = ptr::null_mut();
        // SAFETY: the strings outlive the call; the library copies them.
        check(unsafe { sys::zs_context_create(&mut h, &o) })?;
        Ok(Context {
            h,
            views: AtomicUsize::new(0),
        })
    }

    /// A context from the environment alone (torchrun, zsrun, Slurm, MPI).
    pub fn from_env() -> Result<Context> {
        Self::new(&ContextOptions::default())
    }

    fn int(
        &self,
        f: unsafe extern "C" fn(sys::zs_context, *mut i32) -> sys::zs_status,
    ) -> Result<i32> {
        let mut v = 0;
        // SAFETY: a live handle and an out pointer.
        check(unsafe { f(self.h, &mut v) })?;
        Ok(v)
    }
    pub fn rank(&self) -> Result<i32> {
        self.int(sys::zs_context_rank)
    }
    pub fn world_size(&self) -> Result<i32> {
        self.int(sys::zs_context_world_size)
    }
    pub fn local_rank(&self) -> Result<i32> {
        self.int(sys::zs_context_local_rank)
    }
    pub fn local_world_size(&self) -> Result<i32> {
        self.int(sys::zs_context_local_world_size)
    }

    /// The first error of background work, if any.
    pub fn async_error(&self) -> Result<()> {
        // SAFETY: a live handle.
        check(unsafe { sys::zs_context_async_error(self.h) })
    }

    fn text(
        &self,
        f: unsafe extern "C" fn(sys::zs_context, *mut *const c_char) -> sys::zs_status,
    ) -> Result<String> {
        let mut p = ptr::null();
        // SAFETY: the string is owned by the context and copied at once.
        check(unsafe { f(self.h, &mut p) })?;
        Ok(owned_str(p))
    }
    /// The effective config as JSON.
    pub fn config_json(&self) -> Result<String> {
        self.text(sys::zs_context_config_json)
    }
    /// JSON array of keys accepted but not used (trainer keys).
    pub fn unused_config_keys(&self) -> Result<String> {
        self.text(sys::zs_context_unused_config_keys)
    }
    /// JSON array of keys accepted but not acted on yet, with reasons.
    pub fn inactive_config_keys(&self) -> Result<String> {
        self.text(sys::zs_context_inactive_config_keys)
    }

    /// The context's device and its collectives' backend.
    pub fn device(&self) -> Result<(Device, String)> {
        let (mut kind, mut id, mut backend) = (0, 0, ptr::null());
        // SAFETY: out pointers; the backend string is static in the library.
        check(unsafe { sys::zs_context_device(self.h, &mut kind, &mut id, &mut backend) })?;
        Ok((Device::from_codes(kind, id), owned_str(backend)))
    }

    pub fn memory(&self) -> Result<MemoryStats> {
        let mut s = MemoryStats::new();
        // SAFETY: a struct of this crate's (the header's) size.
        check(unsafe { sys::zs_context_memory(self.h, &mut s) })?;
        Ok(s)
    }
    pub fn fetch_stats(&self) -> Result<FetchStats> {
        let mut s = FetchStats::new();
        // SAFETY: as above.
        check(unsafe { sys::zs_context_fetch_stats(self.h, &mut s) })?;
        Ok(s)
    }
    pub fn coord_stats(&self) -> Result<CoordStats> {
        let mut s = CoordStats::new();
        // SAFETY: as above.
        check(unsafe { sys::zs_coord_get_stats(self.h, &mut s) })?;
        Ok(s)
    }

    /// One of the context's own groups.
    pub fn group(&self, kind: GroupKind) -> Result<crate::Group<'_>> {
        let mut h = ptr::null_mut();
        // SAFETY: a live handle and an out pointer.
        check(unsafe { sys::zs_context_group(&mut h, self.h, kind.code()) })?;
        Ok(crate::Group::from_handle(h, self))
    }

    /// A sub-group of world ranks. Collective over the world.
    pub fn new_group(&self, ranks: &[i32]) -> Result<crate::Group<'_>> {
        let mut h = ptr::null_mut();
        let n = i32::try_from(ranks.len())
            .map_err(|_| Error::new(Status::InvalidArgument, format!("{} ranks", ranks.len())))?;
        // SAFETY: `n` ints at `ranks`.
        check(unsafe { sys::zs_group_create(&mut h, self.h, ranks.as_ptr(), n) })?;
        Ok(crate::Group::from_handle(h, self))
    }

    /// Micro-steps per optimizer step (pushed gradients are divided by it).
    pub fn set_accumulation_steps(&self, steps: i32) -> Result<()> {
        // SAFETY: a live handle.
        check(unsafe { sys::zs_grad_set_accumulation_steps(self.h, steps) })
    }
    /// Flush gradient buckets and wait for their reductions. Collective.
    pub fn grad_sync(&self) -> Result<()> {
        // SAFETY: a live handle.
        check(unsafe { sys::zs_grad_sync(self.h) })
    }

    /// Mark a training step for the coordinator (the first one records the
    /// fetch order, later ones prefetch along it). `step_end` is collective.
    pub fn step_begin(&self) -> Result<()> {
        // SAFETY: a live handle.
        check(unsafe { sys::zs_step_begin(self.h) })
    }
    pub fn step_end(&self) -> Result<()> {
        // SAFETY: a live handle.
        check(unsafe { sys::zs_step_end(self.h) })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the handle is ours; nothing borrows the context any more.
        unsafe { sys::zs_context_destroy(self.h) };
    }
}

/// Check a DeepSpeed config without a context (`world_size` 0 skips the
/// topology checks).
pub fn config_check(json: &str, world_size: i32) -> Result<()> {
    let c = c_string(json, "config")?;
    // SAFETY: a NUL-terminated string.
    check(unsafe { sys::zs_config_check(c.as_ptr(), world_size) })
}

/// CUDA devices this process can use, and why there are none when 0 (a
/// build without CUDA, no driver, no device visible).
pub fn cuda_device_count() -> Result<(i32, String)> {
    let (mut n, mut reason) = (0, ptr::null());
    // SAFETY: out pointers; the reason is a static string of the library.
    check(unsafe { sys::zs_cuda_device_count(&mut n, &mut reason) })?;
    Ok((n, owned_str(reason)))
}

/// The library's version ("MAJOR.MINOR.PATCH").
pub fn version() -> String {
    // SAFETY: a static string; NULL outputs are allowed.
    owned_str(unsafe { sys::zs_version(ptr::null_mut(), ptr::null_mut(), ptr::null_mut()) })
}
