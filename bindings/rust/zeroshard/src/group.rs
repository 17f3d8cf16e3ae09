//! Groups of ranks and their collectives. The engine runs a collective on
//! the group's worker thread after the call returns, so its buffers must
//! stay valid until it is done: the asynchronous forms take owned vectors
//! and give them back from `Work::wait` (forgetting a `Work` then leaks the
//! buffers instead of freeing memory the engine still writes); the blocking
//! forms borrow slices and wait before returning.
use std::marker::PhantomData;
use std::os::raw::c_void;
use std::ptr;
use std::time::Duration;

use zeroshard_sys as sys;

use crate::context::Context;
use crate::error::{check, Error, Result, Status};
use crate::types::{timeout_ms, Element, ReduceOp};

pub struct Group<'c> {
    h: sys::zs_group,
    _ctx: PhantomData<&'c Context>,
}

// SAFETY: handles may be shared between threads (header); collectives queue
// on the group's thread in issue order.
unsafe impl Send for Group<'_> {}
unsafe impl Sync for Group<'_> {}

/// A collective in flight, owning its buffers `B` until it is waited for.
pub struct Work<B> {
    h: sys::zs_work,
    buffers: Option<B>,
}

// SAFETY: as Group; the buffers are only touched by the engine until wait.
unsafe impl<B: Send> Send for Work<B> {}
unsafe impl<B: Send> Sync for Work<B> {}

impl<B> Work<B> {
    /// Wait for the collective and take the buffers back. With a timeout,
    /// `Status::Timeout` hands the work back to wait again.
    pub fn wait_timeout(
        mut self,
        timeout: Option<Duration>,
    ) -> std::result::Result<B, (Error, Option<Work<B>>)> {
        // SAFETY: a live work handle.
        match check(unsafe { sys::zs_work_wait(self.h, timeout_ms(timeout)) }) {
            Ok(()) => Ok(self.buffers.take().expect("buffers taken once")),
            Err(e) if e.status == Status::Timeout => Err((e, Some(self))),
            Err(e) => Err((e, None)), // dropping self destroys the finished work
        }
    }
    pub fn wait(self) -> Result<B> {
        self.wait_timeout(None).map_err(|(e, _)| e)
    }
    /// Whether it finished (Ok(true)), or its error if it failed.
    pub fn test(&self) -> Result<bool> {
        let mut done = 0;
        // SAFETY: a live handle and an out pointer.
        check(unsafe { sys::zs_work_test(self.h, &mut done) })?;
        Ok(done != 0)
    }
}

impl<B> Drop for Work<B> {
    fn drop(&mut self) {
        // Waits for an unfinished collective before the buffers go.
        // SAFETY: the handle is ours.
        unsafe { sys::zs_work_destroy(self.h) };
    }
}

fn count_of<T>(v: &[T], per: usize, what: &str) -> Result<usize> {
    if per == 0 || v.len() % per != 0 {
        return Err(Error::new(
            Status::BufferSize,
            format!("{what} has {} elements, not a multiple of {per}", v.len()),
        ));
    }
    Ok(v.len() / per)
}

impl<'c> Group<'c> {
    pub(crate) fn from_handle(h: sys::zs_group, _ctx: &'c Context) -> Self {
        Group {
            h,
            _ctx: PhantomData,
        }
    }
    pub(crate) fn handle(&self) -> sys::zs_group {
        self.h
    }

    /// This rank's position, or None outside the group.
    pub fn rank(&self) -> Result<Option<i32>> {
        let mut r = -1;
        // SAFETY: a live handle and an out pointer.
        check(unsafe { sys::zs_group_rank(self.h, &mut r) })?;
        Ok((r >= 0).then_some(r))
    }
    pub fn size(&self) -> Result<usize> {
        let mut s = 0;
        // SAFETY: as above.
        check(unsafe { sys::zs_group_size(self.h, &mut s) })?;
        Ok(s as usize)
    }
    pub fn world_rank(&self, group_rank: i32) -> Result<i32> {
        let mut r = -1;
        // SAFETY: as above.
        check(unsafe { sys::zs_group_world_rank(self.h, group_rank, &mut r) })?;
        Ok(r)
    }

    /// Every member's `send`, concatenated in group order.
    pub fn allgather<T: Element>(&self, send: Vec<T>) -> Result<Work<(Vec<T>, Vec<T>)>> {
        let mut recv =
            vec![send.first().copied().unwrap_or_else(zeroed); send.len() * self.size()?];
        let mut h = ptr::null_mut();
        // SAFETY: send and recv move into the Work, which keeps them until
        // the collective is done.
        check(unsafe {
            sys::zs_allgather(
                &mut h,
                self.h,
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                send.len(),
                T::DTYPE.code(),
            )
        })?;
        Ok(Work {
            h,
            buffers: Some((send, recv)),
        })
    }

    /// Reduce `buf` over the group, in place.
    pub fn allreduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Result<Work<Vec<T>>> {
        let mut h = ptr::null_mut();
        let p = buf.as_mut_ptr().cast::<c_void>();
        // SAFETY: as allgather; send == recv is allowed.
        check(unsafe {
            sys::zs_allreduce(&mut h, self.h, p, p, buf.len(), T::DTYPE.code(), op.code())
        })?;
        Ok(Work {
            h,
            buffers: Some(buf),
        })
    }

    /// Member i receives the reduction of block i of `send`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<(Vec<T>, Vec<T>)>> {
        let n = count_of(&send, self.size()?, "send")?;
        let mut recv = vec![send.first().copied().unwrap_or_else(zeroed); n];
        let mut h = ptr::null_mut();
        // SAFETY: as allgather.
        check(unsafe {
            sys::zs_reduce_scatter(
                &mut h,
                self.h,
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                n,
                T::DTYPE.code(),
                op.code(),
            )
        })?;
        Ok(Work {
            h,
            buffers: Some((send, recv)),
        })
    }

    /// `buf` of group rank `root` to every member.
    pub fn broadcast<T: Element>(&self, mut buf: Vec<T>, root: i32) -> Result<Work<Vec<T>>> {
        let mut h = ptr::null_mut();
        // SAFETY: as allgather.
        check(unsafe {
            sys::zs_broadcast(
                &mut h,
                self.h,
                buf.as_mut_ptr().cast(),
                buf.len(),
                T::DTYPE.code(),
                root,
            )
        })?;
        Ok(Work {
            h,
            buffers: Some(buf),
        })
    }

    pub fn barrier(&self) -> Result<Work<()>> {
        let mut h = ptr::null_mut();
        // SAFETY: no buffers.
        check(unsafe { sys::zs_barrier(&mut h, self.h) })?;
        Ok(Work {
            h,
            buffers: Some(()),
        })
    }

    /// Blocking all-reduce over a borrowed slice: waits before returning,
    /// so the slice is free again when this returns (or fails).
    pub fn allreduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let mut h = ptr::null_mut();
        let p = buf.as_mut_ptr().cast::<c_void>();
        // SAFETY: the work is waited for and destroyed (which waits too)
        // before `buf`'s borrow ends; nothing in between can unwind.
        check(unsafe {
            sys::zs_allreduce(&mut h, self.h, p, p, buf.len(), T::DTYPE.code(), op.code())
        })?;
        let waited = check(unsafe { sys::zs_work_wait(h, sys::ZS_WAIT_FOREVER) });
        unsafe { sys::zs_work_destroy(h) };
        waited
    }

    /// Blocking all-gather into a borrowed slice of `send.len() * size()`.
    pub fn allgather_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        if recv.len() != send.len() * self.size()? {
            return Err(Error::new(
                Status::BufferSize,
                format!(
                    "recv has {} elements, expected {} * {}",
                    recv.len(),
                    send.len(),
                    self.size()?
                ),
            ));
        }
        let mut h = ptr::null_mut();
        // SAFETY: as allreduce_in_place.
        check(unsafe {
            sys::zs_allgather(
                &mut h,
                self.h,
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                send.len(),
                T::DTYPE.code(),
            )
        })?;
        let waited = check(unsafe { sys::zs_work_wait(h, sys::ZS_WAIT_FOREVER) });
        unsafe { sys::zs_work_destroy(h) };
        waited
    }
}

fn zeroed<T: Element>() -> T {
    // SAFETY: Element types are valid for every bit pattern.
    unsafe { std::mem::zeroed() }
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle is ours (the group itself lives with the context).
        unsafe { sys::zs_group_destroy(self.h) };
    }
}
