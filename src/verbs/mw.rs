//! Type-2 memory windows (MWs): a remote key that covers exactly the bytes a
//! peer was granted, usable only through the one queue pair it is bound to
//! (IBTA vol. 1, 10.6.7: type 2 windows are bound by a BIND_MW work request
//! on a QP and only that QP's peer may use the key), and invalidated by a
//! LOCAL_INV work request before the memory behind it is used for anything
//! else.
//!
//! The memory region under a window is registered with `MW_BIND` and no
//! remote access of its own (`MrAccess::LocalWriteMwBind` or
//! `MrAccess::MwBind`), so its own rkey opens nothing.
//!
//! A window is allocated once (`ibv_alloc_mw`) and rebound many times; each
//! bind gives it a new key (the low 8 bits advance, `ibv_inc_rkey`), so a key
//! learnt from an earlier bind is dead. Windows must be deallocated before
//! the QP they are bound to is destroyed and before their memory region is
//! deregistered (rxe refuses to deregister an MR with windows bound to it):
//! owners keep them in fields dropped before both.

use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys::{ibv_alloc_mw, ibv_dealloc_mw, ibv_inc_rkey, ibv_mw, ibv_mw_type};

use super::count::{Counted, Kind, classify};
use super::rc::OpenDevice;
use crate::error::Result;

/// What a window lets the peer do with the bytes it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WindowAccess {
    /// RDMA READ only (`IBV_ACCESS_REMOTE_READ`): a rendezvous source.
    RemoteRead,
    /// RDMA WRITE only (`IBV_ACCESS_REMOTE_WRITE`): a stream's receive ring.
    RemoteWrite,
    /// A grant of remote memory (`crate::remote`): any set of READ, WRITE
    /// and atomics (`IBV_ACCESS_REMOTE_READ`/`_WRITE`/`_ATOMIC`).
    Grant {
        read: bool,
        write: bool,
        atomic: bool,
    },
}

/// One type-2 memory window on a device's PD.
pub(crate) struct MemoryWindow {
    mw: NonNull<ibv_mw>,
    /// The key of the current (or, once invalidated, the last) bind.
    rkey: u32,
    _device: Arc<OpenDevice>,
    _counted: Counted,
}

// SAFETY: the window is an opaque verbs object; libibverbs allows its use
// from any thread, and `&mut self` serialises the field writes.
unsafe impl Send for MemoryWindow {}
// SAFETY: shared references only read `rkey`.
unsafe impl Sync for MemoryWindow {}

impl MemoryWindow {
    /// Allocates a type-2 window on `device`'s PD (`ibv_alloc_mw`).
    ///
    /// # Errors
    /// [`Error::Verbs`] with the errno (`EOPNOTSUPP` from a provider without
    /// memory windows, `ENOMEM` at the device's `max_mw`).
    pub(crate) fn alloc(device: &Arc<OpenDevice>) -> Result<MemoryWindow> {
        crate::verbs::fork::check("ibv_alloc_mw")?;
        // SAFETY: the PD is valid while `device` lives (we keep an Arc).
        let raw = unsafe { ibv_alloc_mw(device.pd.pd().as_ptr(), ibv_mw_type::IBV_MW_TYPE_2) };
        let mw = NonNull::new(raw).ok_or_else(|| {
            classify(
                "ibv_alloc_mw",
                Kind::MemoryWindow,
                &device.limits,
                io::Error::last_os_error(),
            )
        })?;
        // SAFETY: just allocated, valid.
        let rkey = unsafe { mw.as_ref().rkey };
        Ok(MemoryWindow {
            mw,
            rkey,
            _device: Arc::clone(device),
            _counted: Counted::new(Kind::MemoryWindow),
        })
    }

    /// The key a peer uses while the window is bound.
    pub(crate) fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The key the next bind will give the window (`ibv_inc_rkey`): the
    /// low 8 bits advance, so the previous bind's key stops working.
    pub(crate) fn next_rkey(&self) -> u32 {
        // SAFETY: pure arithmetic on the key.
        unsafe { ibv_inc_rkey(self.rkey) }
    }

    /// The raw window and the key it had before the bind that is being
    /// posted, then records `new_rkey` as current: libibverbs providers
    /// read `mw->rkey` as the key to replace, so it must follow each bind.
    pub(crate) fn start_bind(&mut self, new_rkey: u32) -> *mut ibv_mw {
        // SAFETY: the window is valid and only this owner writes it.
        unsafe { (*self.mw.as_ptr()).rkey = self.rkey };
        let raw = self.mw.as_ptr();
        self.rkey = new_rkey;
        raw
    }

    /// Undoes [`start_bind`](Self::start_bind)'s key change when the post
    /// failed.
    pub(crate) fn abort_bind(&mut self, old_rkey: u32) {
        self.rkey = old_rkey;
    }

    /// Records that a posted bind completed (the provider's struct now
    /// carries the new key).
    pub(crate) fn bound(&mut self) {
        // SAFETY: the window is valid and only this owner writes it.
        unsafe { (*self.mw.as_ptr()).rkey = self.rkey };
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        if crate::verbs::fork::inherited() {
            return; // the parent's window: leaked
        }
        // SAFETY: allocated by ibv_alloc_mw and deallocated exactly once,
        // here; the owner drops windows before the QP they are bound to and
        // before the MR under them. Deallocating invalidates the key, so no
        // peer can reach the memory through it afterwards.
        unsafe { ibv_dealloc_mw(self.mw.as_ptr()) };
    }
}
