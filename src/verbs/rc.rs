//! One reliable-connected (RC) queue pair with everything it needs: its
//! completion queue (CQ, reporting to a completion channel of its own or
//! its runtime's, see [`super::events`]), its registered send buffer and
//! receive ring (MRs), on a protection domain (PD) shared per device.
//!
//! Teardown order is QP, then MRs, then CQ (every event is acknowledged
//! when read, so `ibv_destroy_cq` does not wait), then its channel; the PD
//! and device context live in a process-wide registry. The owner must not
//! drop a [`RcQueuePair`] while the NIC may still touch its memory: the
//! stream driver only drops it after the QP is in the error state and its
//! completions are drained, or never connected.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::HashMap;
use std::io;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use rdma_mummy_sys::{
    bind_mw_t, ibv_access_flags, ibv_modify_qp, ibv_mr, ibv_mw_bind_info, ibv_post_send,
    ibv_qp_attr, ibv_qp_state, ibv_send_flags, ibv_send_wr, ibv_wc, ibv_wr_opcode,
};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::{AllocateProtectionDomainErrorKind, DeviceContext};
use sideway::ibverbs::memory_region::{
    MemoryRegion, RegisterMemoryRegionError, RegisterMemoryRegionErrorKind,
};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, CreateQueuePairErrorKind, PostSendGuard as _, QueuePair as _,
    SetInlineData as _, SetScatterGatherEntry as _, WorkRequestFlags,
};

use super::cm::CmId;
use super::count::{Counted, DeviceLimits, Kind, classify};
use super::events::{CqEvents, QpCq};
use super::mw::{MemoryWindow, WindowAccess};
use crate::error::{Error, Result};

/// An opened device with the protection domain every connection on it shares.
pub(crate) struct OpenDevice {
    /// The device name, for example `rxe0`.
    pub(crate) name: String,
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) ctx: Arc<DeviceContext>,
    /// Memory windows the device supports (`ibv_device_attr::max_mw`); 0
    /// for providers without them.
    pub(crate) max_mw: u32,
    /// The most entries one CQ may have (`ibv_device_attr::max_cqe`; 0 if
    /// unknown).
    pub(crate) max_cqe: u32,
    /// The device's object limits, for typed resource errors.
    pub(crate) limits: DeviceLimits,
    /// Idle stream send buffers on `pd`, kept for the next stream that has
    /// data to send (at most [`SEND_BUFFER_CACHE_BYTES`] in all).
    send_buffers: Mutex<Vec<(RegisteredBuffer, Counted)>>,
    _counted_pd: Counted,
}

/// Bytes of idle stream send buffers an opened device keeps registered
/// for reuse: 4 MiB (64 buffers of the default 64 KiB), so connections
/// that take turns sending do not register and deregister a buffer per
/// response, while thousands of idle connections pin none.
pub(crate) const SEND_BUFFER_CACHE_BYTES: usize = 4 << 20;

impl OpenDevice {
    /// Whether the device has type-2 memory windows.
    pub(crate) fn has_memory_windows(&self) -> bool {
        self.max_mw > 0
    }

    /// A registered, local-only send buffer of `len` bytes on the device's
    /// PD: a cached idle one, or a new registration.
    fn take_send_buffer(&self, len: usize) -> Result<RegisteredBuffer> {
        let cached = {
            let mut cache = self.send_buffers.lock().unwrap_or_else(|p| p.into_inner());
            cache
                .iter()
                .position(|(b, _)| b.len() == len)
                .map(|i| cache.swap_remove(i).0)
        };
        match cached {
            Some(b) => Ok(b),
            None => RegisteredBuffer::new(&self.pd, len, AccessFlags::LocalWrite, &self.limits),
        }
    }

    /// Keeps `buf` for reuse, or deregisters it when the cache is full.
    fn return_send_buffer(&self, buf: RegisteredBuffer) {
        let mut cache = self.send_buffers.lock().unwrap_or_else(|p| p.into_inner());
        let cached: usize = cache.iter().map(|(b, _)| b.len()).sum();
        if cached + buf.len() <= SEND_BUFFER_CACHE_BYTES {
            let counted = Counted::idle_send_buffer(buf.len());
            cache.push((buf, counted));
        }
    }
}

/// Opens (once per process) the device called `name` and its PD.
pub(crate) fn open_device(name: &str) -> Result<Arc<OpenDevice>> {
    static DEVICES: OnceLock<Mutex<HashMap<String, Arc<OpenDevice>>>> = OnceLock::new();
    let map = DEVICES.get_or_init(Default::default);
    let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = map.get(name) {
        return Ok(Arc::clone(d));
    }
    let list = DeviceList::new().map_err(|e| Error::Verbs {
        op: "ibv_get_device_list",
        source: io::Error::other(e),
    })?;
    let dev = list
        .iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| Error::DeviceNotFound { name: name.into() })?;
    let ctx = dev.open().map_err(|e| Error::Verbs {
        op: "ibv_open_device",
        source: io::Error::other(e),
    })?;
    let pd = ctx.alloc_pd().map_err(|e| Error::Verbs {
        op: "ibv_alloc_pd",
        source: errno_of!(e, AllocateProtectionDomainErrorKind::Ibverbs),
    })?;
    let attr = ctx.query_device().ok();
    let max_mw = attr
        .as_ref()
        .map(|a| u32::try_from(a.max_mw()).unwrap_or(0))
        .unwrap_or(0);
    let max_cqe = attr
        .as_ref()
        .map(|a| u32::try_from(a.max_cqe()).unwrap_or(0))
        .unwrap_or(0);
    let limit = |v: i32| u64::try_from(v).unwrap_or(0);
    let limits = attr
        .as_ref()
        .map(|a| DeviceLimits {
            max_qp: limit(a.max_qp()),
            max_cq: limit(a.max_cq()),
            max_mr: limit(a.max_mr()),
            max_mw: limit(a.max_mw()),
        })
        .unwrap_or_default();
    let d = Arc::new(OpenDevice {
        name: name.to_string(),
        pd,
        ctx,
        max_mw,
        max_cqe,
        limits,
        send_buffers: Mutex::new(Vec::new()),
        _counted_pd: Counted::new(Kind::ProtectionDomain),
    });
    map.insert(name.to_string(), Arc::clone(&d));
    Ok(d)
}

/// The OS error of a failed `ibv_reg_mr` (errno kept: `ENOMEM` from
/// RLIMIT_MEMLOCK reads as `OutOfMemory`).
fn reg_mr_errno(e: RegisterMemoryRegionError) -> io::Error {
    match e.0 {
        RegisterMemoryRegionErrorKind::Ibverbs(io) => io,
        other => io::Error::other(other),
    }
}

/// What a memory region allows the NIC to do (the least that works is
/// chosen by the caller). None of these opens the region to a peer by its
/// own rkey: peers reach it only through a memory window bound for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MrAccess {
    /// `IBV_ACCESS_LOCAL_WRITE | MW_BIND`: receives and RDMA READs land in
    /// it, and windows may be bound on it. Pool slabs.
    LocalWriteMwBind,
    /// `IBV_ACCESS_MW_BIND` only: the NIC never writes it (read-only pages
    /// can be registered) and windows may be bound on it. User regions.
    MwBind,
    /// `IBV_ACCESS_LOCAL_WRITE` only: a device without memory windows.
    LocalWrite,
    /// No access flags: a read-only region on a device without windows.
    LocalRead,
}

impl MrAccess {
    /// Whether the region's own key lets a peer read, write or run atomics
    /// on it.
    pub(crate) fn grants_remote_access(self) -> bool {
        let f = self.flags();
        f.contains(AccessFlags::RemoteWrite)
            || f.contains(AccessFlags::RemoteRead)
            || f.contains(AccessFlags::RemoteAtomic)
    }

    fn flags(self) -> AccessFlags {
        match self {
            MrAccess::LocalWriteMwBind => AccessFlags::LocalWrite | AccessFlags::MemoryWindowBind,
            MrAccess::MwBind => AccessFlags::MemoryWindowBind,
            MrAccess::LocalWrite => AccessFlags::LocalWrite,
            MrAccess::LocalRead => AccessFlags::none(),
        }
    }
}

/// One memory region on an opened device's PD; deregistered when dropped.
pub(crate) struct MemoryRegistration {
    mr: Arc<MemoryRegion>,
    access: MrAccess,
    // Keeps the device context open while the MR lives.
    _device: Arc<OpenDevice>,
    _counted: Counted,
}

impl MemoryRegistration {
    /// Registers `len` bytes at `ptr` with `access` (`ibv_reg_mr`).
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes (and writes by the NIC
    /// when `access` allows them) until the registration is dropped.
    pub(crate) unsafe fn new(
        device: &Arc<OpenDevice>,
        ptr: NonNull<u8>,
        len: usize,
        access: MrAccess,
    ) -> io::Result<Self> {
        // Pool and user regions never open themselves by their own key.
        debug_assert!(!access.grants_remote_access());
        let flags = access.flags();
        // SAFETY: the caller guarantees `ptr` is valid for `len` bytes (and
        // writable when `access` allows writes) until this registration,
        // which owns the MR, is dropped.
        let mr =
            unsafe { device.pd.reg_mr(ptr.as_ptr() as usize, len, flags) }.map_err(reg_mr_errno)?;
        Ok(MemoryRegistration {
            mr,
            access,
            _device: Arc::clone(device),
            _counted: Counted::memory_region(len),
        })
    }

    /// The local key.
    pub(crate) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// The remote key.
    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// Whether windows can be bound on it (registered with `MW_BIND`).
    pub(crate) fn can_bind_windows(&self) -> bool {
        matches!(self.access, MrAccess::LocalWriteMwBind | MrAccess::MwBind)
    }

    /// The raw `ibv_mr`, for binding memory windows on it (valid while
    /// this registration lives).
    pub(crate) fn raw_mr(&self) -> *mut ibv_mr {
        // SAFETY: the pointer is only handed out, not dereferenced here.
        unsafe { self.mr.mr().as_ptr() }
    }
}

/// Page-aligned, zeroed memory registered as one MR.
pub(crate) struct RegisteredBuffer {
    // Deregistered in Drop before the memory is freed.
    mr: ManuallyDrop<Arc<MemoryRegion>>,
    ptr: NonNull<u8>,
    layout: Layout,
    _counted: Counted,
}

// SAFETY: the buffer is plain heap memory owned by this value; access goes
// through bounds-checked copies.
unsafe impl Send for RegisteredBuffer {}
// SAFETY: shared access (`&self`) only copies out through raw pointers
// (`read_at`, `read_to_vec`) and reads the keys; the program's only write,
// `write_at`, takes `&mut self`, so it never races another thread's copy.
// What the NIC reads or writes concurrently is the protocol's to order (see
// the SAFETY comments of those methods).
unsafe impl Sync for RegisteredBuffer {}

impl RegisteredBuffer {
    /// Allocates and registers `len` bytes on `pd`.
    ///
    /// # Errors
    /// [`Error::ResourceLimit`] at RLIMIT_MEMLOCK or the device's `max_mr`
    /// (from `limits`), [`Error::Verbs`] for other failures.
    pub(crate) fn new(
        pd: &Arc<ProtectionDomain>,
        len: usize,
        access: AccessFlags,
        limits: &DeviceLimits,
    ) -> Result<Self> {
        let layout = Layout::from_size_align(len.max(1), 4096).map_err(|_| Error::Verbs {
            op: "alloc",
            source: io::Error::from(io::ErrorKind::InvalidInput),
        })?;
        // SAFETY: `layout` has non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or(Error::Verbs {
            op: "alloc",
            source: io::Error::from(io::ErrorKind::OutOfMemory),
        })?;
        // SAFETY: `ptr` is valid for `len` bytes until Drop, which
        // deregisters the MR (field `mr` drops first) before freeing.
        let mr = match unsafe { pd.reg_mr(ptr.as_ptr() as usize, len.max(1), access) } {
            Ok(mr) => mr,
            Err(e) => {
                // SAFETY: allocated above with this layout, never registered.
                unsafe { dealloc(ptr.as_ptr(), layout) };
                return Err(classify(
                    "ibv_reg_mr",
                    Kind::MemoryRegion,
                    limits,
                    reg_mr_errno(e),
                ));
            }
        };
        Ok(RegisteredBuffer {
            mr: ManuallyDrop::new(mr),
            ptr,
            layout,
            _counted: Counted::memory_region(len.max(1)),
        })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }
    pub(crate) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The raw `ibv_mr` (valid while the buffer lives).
    pub(crate) fn raw_mr(&self) -> *mut ibv_mr {
        // SAFETY: the pointer is only handed out, not dereferenced here.
        unsafe { self.mr.mr().as_ptr() }
    }

    /// Copies `src` into the buffer at `offset`. Panics never: out-of-range
    /// copies are a bug in the caller and return an error.
    pub(crate) fn write_at(&mut self, offset: usize, src: &[u8]) -> io::Result<()> {
        if offset
            .checked_add(src.len())
            .is_none_or(|end| end > self.len())
        {
            return Err(io::Error::other("registered buffer write out of range"));
        }
        // SAFETY: in range (checked above); `src` cannot alias our private
        // heap block, and `&mut self` excludes the program's other copies.
        // The protocol core guarantees the NIC is not reading this range
        // (free send-buffer space, or an RTS scratch slot no posted WR
        // uses).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len())
        };
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the buffer.
    pub(crate) fn read_at(&self, offset: usize, dst: &mut [u8]) -> io::Result<()> {
        if offset
            .checked_add(dst.len())
            .is_none_or(|end| end > self.len())
        {
            return Err(io::Error::other("registered buffer read out of range"));
        }
        // SAFETY: in range (checked above). The protocol core guarantees the
        // peer does not write this range (it holds delivered, unreturned data).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// Copies `len` bytes at `offset` out of the buffer into a new vector,
    /// without first zeroing it (as `read_at` into `vec![0; len]` would).
    pub(crate) fn read_to_vec(&self, offset: usize, len: usize) -> io::Result<Vec<u8>> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(io::Error::other("registered buffer read out of range"));
        }
        let mut out = Vec::with_capacity(len);
        // SAFETY: the source range is in the buffer (checked above) and the
        // protocol core guarantees the peer does not write it (it holds
        // delivered, unreturned data); `out` has capacity for `len` bytes
        // and cannot alias our private heap block. The `len` bytes are
        // initialized by the copy before `set_len` exposes them.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), len);
            out.set_len(len);
        }
        Ok(out)
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        // SAFETY: the MR is dropped (deregistered) exactly once, here, and
        // only then the memory it covered is freed with the layout it was
        // allocated with. The Arc never leaves this struct, so this is the
        // last reference.
        unsafe {
            ManuallyDrop::drop(&mut self.mr);
            dealloc(self.ptr.as_ptr(), self.layout);
        }
    }
}

/// Sizes of one RC queue pair's resources.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RcSizes {
    /// Send queue depth (max outstanding send WRs).
    pub send_depth: u32,
    /// Receive queue depth (receive WRs kept posted).
    pub recv_depth: u32,
    /// Inline data requested (bytes); the provider may grant less or more.
    pub max_inline: u32,
    /// Registered send buffer (bytes).
    pub send_buf: usize,
    /// Take the send buffer from the device's cache only while there is
    /// data to send ([`RcQueuePair::ensure_send_buf`],
    /// [`RcQueuePair::release_send_buf`]) instead of holding it for the
    /// QP's life. Ignored on a QP with a PD of its own.
    pub send_buf_on_demand: bool,
    /// Registered receive ring the peer writes into (bytes); 0 for none
    /// (a message endpoint, whose receives land in pool buffers).
    pub recv_ring: usize,
    /// Take a seat on a CQ shared with other QPs of the runtime instead of
    /// a CQ of its own ([`QpCq`]).
    pub share_cq: bool,
}

/// Completion status as the runtime needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WcKind {
    /// A send-queue WR completed (RDMA WRITE [WITH IMM], SEND [WITH IMM],
    /// RDMA READ).
    Send,
    /// An RDMA WRITE WITH IMM landed and consumed a receive WR.
    RecvImm,
    /// A SEND [WITH IMM] landed in a receive WR's buffer (`byte_len` bytes).
    Recv,
    /// Any other opcode (not used by this crate).
    Other,
}

/// One work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Completion {
    pub wr_id: u64,
    /// `IBV_WC_SUCCESS` (0) or the failure status (`ibv_wc_status`).
    pub status: u32,
    pub kind: WcKind,
    /// Immediate data in host byte order (RecvImm and Recv).
    pub imm: u32,
    /// Bytes received (Recv) or transferred.
    pub byte_len: u32,
}

impl Completion {
    /// Copies what the runtime needs out of a work completion.
    pub(crate) fn from_wc(wc: &ibv_wc) -> Completion {
        use rdma_mummy_sys::ibv_wc_opcode as op;
        let kind = match wc.opcode {
            op::IBV_WC_RDMA_WRITE | op::IBV_WC_SEND | op::IBV_WC_RDMA_READ => WcKind::Send,
            op::IBV_WC_RECV_RDMA_WITH_IMM => WcKind::RecvImm,
            op::IBV_WC_RECV => WcKind::Recv,
            _ => WcKind::Other,
        };
        // SAFETY: both members of the union are a u32, so reading either is
        // reading initialised plain data.
        let imm = unsafe { wc.imm_data_invalidated_rkey_union.imm_data };
        Completion {
            wr_id: wc.wr_id,
            status: wc.status,
            kind,
            imm: u32::from_be(imm),
            byte_len: wc.byte_len,
        }
    }
}

/// One scatter/gather element: `len` bytes at virtual address `addr` of a
/// memory region with local key `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// The payload of a SEND ([`SendOp::SendImm`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum SendPayload<'a> {
    /// No payload.
    None,
    /// Copied into the WQE (`IBV_SEND_INLINE`).
    Inline(&'a [u8]),
    /// Read by the NIC from registered memory.
    Sge(Sge),
}

/// One send-queue WR for [`RcQueuePair::post_send_batch`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendWr<'a> {
    pub wr_id: u64,
    pub signaled: bool,
    /// `IBV_SEND_SOLICITED` (a SEND only; see `RcQueuePair::arm`).
    pub solicited: bool,
    pub op: SendOp<'a>,
}

/// The operation of a [`SendWr`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum SendOp<'a> {
    /// SEND WITH IMMEDIATE (`imm` in host order).
    SendImm { payload: SendPayload<'a>, imm: u32 },
    /// RDMA READ of `local.len` bytes from `remote_addr` into `local`.
    Read {
        local: Sge,
        remote_addr: u64,
        rkey: u32,
    },
    /// RDMA WRITE of `local` to `remote_addr` (no immediate data).
    Write {
        local: Sge,
        remote_addr: u64,
        rkey: u32,
    },
    /// ATOMIC compare-and-swap of the 8 bytes at `remote_addr` (8-byte
    /// aligned): swapped to `swap` if equal to `compare`; the original
    /// value lands in `local` (8 bytes).
    CompareSwap {
        local: Sge,
        remote_addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    /// ATOMIC fetch-and-add of `add` to the 8 bytes at `remote_addr`
    /// (8-byte aligned, wrapping); the original value lands in `local`.
    FetchAdd {
        local: Sge,
        remote_addr: u64,
        rkey: u32,
        add: u64,
    },
}

/// Remote-memory operations and grants (`crate::remote`) carry this wr_id
/// bit: their completions go to the waiting operation, not the protocol
/// core.
pub(crate) const REMOTE_WR_FLAG: u64 = 1 << 60;

/// `IBV_WC_SUCCESS`: a completion without error.
pub(crate) const WC_SUCCESS: u32 = 0;
/// `IBV_WC_WR_FLUSH_ERR`: a WR flushed because its QP is in the error
/// state (the NIC no longer touches its memory).
pub(crate) const WC_WR_FLUSH_ERR: u32 = 5;

/// Receive WRs carry this wr_id bit so send and receive completions are
/// told apart even on providers that report odd opcodes on errors.
pub(crate) const RECV_WR_FLAG: u64 = 1 << 63;

/// An RC QP, its CQ (reporting to a completion channel of its own or its
/// runtime's, see [`super::events`]), and its two registered buffers.
pub(crate) struct RcQueuePair {
    // Drop order: the ring's window (before the QP it is bound to and the
    // MR under it) and the QP (both in Drop, then the CQ's route), then
    // the buffers, the CQ (or its seat on a shared one), its completion
    // channel (or the hub's reference), the PD of its own.
    ring_window: Option<MemoryWindow>,
    /// Destroyed first in Drop (before the CQ is polled a last time).
    qp: ManuallyDrop<BasicQueuePair>,
    qp_num: u32,
    /// `None` while an on-demand send buffer is not held.
    send_buf: Option<RegisteredBuffer>,
    send_buf_len: usize,
    send_buf_on_demand: bool,
    /// `None` for a QP without a ring (a message endpoint's), and once the
    /// ring of the handshake (generation 0) was retired after a growth.
    recv_ring: Option<RegisteredBuffer>,
    /// Receive rings registered after the handshake (a stream's grown
    /// rings), oldest first; their windows are dropped in Drop before the
    /// QP.
    grown_rings: Vec<GrownRing>,
    /// The oldest ring generation still held.
    ring_base: u32,
    cq: QpCq,
    events: Arc<CqEvents>,
    /// A keepalive probe was posted and its completion not polled yet.
    probe_outstanding: bool,
    /// Reused for the payload of inline WRs (no allocation per post).
    inline_scratch: Vec<u8>,
    max_inline: u32,
    ring_isolation: RingIsolation,
    _pd: Arc<ProtectionDomain>,
    device: Arc<OpenDevice>,
    /// QP and (with a PD of its own) the PD.
    _counted: Vec<Counted>,
}

/// A receive ring registered after the handshake: generation `generation`
/// of a stream whose ring grew ([`RcQueuePair::add_ring`]).
struct GrownRing {
    generation: u32,
    /// Opens `buf` to the peer on this QP; dropped (deallocated, so its key
    /// dies) before `buf` is deregistered (field order).
    window: Option<MemoryWindow>,
    buf: RegisteredBuffer,
}

/// The wr_id of a grown ring's window bind ([`RcQueuePair::add_ring`]).
pub(crate) const RING_BIND_WR_ID: u64 = MW_WR_FLAG | 2;

/// How a stream's receive ring is opened to the peer: never by a key that
/// any other connection's QP could use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RingIsolation {
    /// No ring (a message endpoint).
    NoRing,
    /// The ring MR has no remote access; a type-2 window bound on this QP
    /// grants REMOTE_WRITE over exactly the ring.
    Window,
    /// A device without windows: the QP and its buffers live on a PD of
    /// their own, so the ring's REMOTE_WRITE key is useless from any other
    /// QP.
    OwnPd,
}

/// The memory a window is bound over: `len` bytes at virtual address
/// `addr` of the memory region whose `ibv_mr` is at address `mr`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BindTarget {
    pub mr: usize,
    pub addr: u64,
    pub len: u64,
}

/// Work requests the verbs layer posts for itself (memory-window binds and
/// invalidations) carry this wr_id bit, so runtimes tell them apart from
/// their own.
pub(crate) const MW_WR_FLAG: u64 = 1 << 62;

/// The wr_id of a keepalive probe ([`RcQueuePair::post_probe`]).
pub(crate) const PROBE_WR_ID: u64 = MW_WR_FLAG | (1 << 61);

fn verbs(op: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Verbs { op, source }
}

impl RcQueuePair {
    /// Creates the CQ (on a completion channel of its own, or the current
    /// tokio runtime's for the device: [`CqEvents::new`]), the QP in RESET,
    /// and both buffers. Must run on a tokio runtime.
    pub(crate) fn new(device: Arc<OpenDevice>, sizes: RcSizes) -> Result<Self> {
        let limits = &device.limits;
        let events = CqEvents::new(&device, sizes.share_cq)?;
        let mut counted = Vec::with_capacity(2);
        let entries = sizes.send_depth + sizes.recv_depth + 16;
        let cq = QpCq::new(&device, &events, entries, sizes.share_cq)?;
        let ring_isolation = if sizes.recv_ring == 0 {
            RingIsolation::NoRing
        } else if device.has_memory_windows() {
            RingIsolation::Window
        } else {
            RingIsolation::OwnPd
        };
        let pd = if ring_isolation == RingIsolation::OwnPd {
            let pd = device.ctx.alloc_pd().map_err(|e| Error::Verbs {
                op: "ibv_alloc_pd",
                source: errno_of!(e, AllocateProtectionDomainErrorKind::Ibverbs),
            })?;
            counted.push(Counted::new(Kind::ProtectionDomain));
            pd
        } else {
            Arc::clone(&device.pd)
        };
        let qp = pd
            .create_qp_builder()
            .setup_max_send_wr(sizes.send_depth)
            .setup_max_recv_wr(sizes.recv_depth)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(sizes.max_inline)
            .setup_send_cq(Arc::clone(cq.completion_queue()))
            .setup_recv_cq(Arc::clone(cq.completion_queue()))
            .build()
            .map_err(|e| {
                classify(
                    "ibv_create_qp",
                    Kind::QueuePair,
                    limits,
                    errno_of!(e, CreateQueuePairErrorKind::Ibverbs),
                )
            })?;
        counted.push(Counted::new(Kind::QueuePair));
        // A QP on a PD of its own cannot use the device's cached buffers.
        let send_buf_on_demand = sizes.send_buf_on_demand && ring_isolation != RingIsolation::OwnPd;
        // An on-demand buffer is taken now too and given back once the
        // connection is idle: a process that cannot pin one busy
        // connection's memory (RLIMIT_MEMLOCK) fails at connect or accept,
        // where `auto://` can still fall back to TCP, not at its first write.
        let send_buf = if send_buf_on_demand {
            Some(device.take_send_buffer(sizes.send_buf)?)
        } else if sizes.send_buf == 0 {
            None
        } else {
            Some(RegisteredBuffer::new(
                &pd,
                sizes.send_buf,
                AccessFlags::LocalWrite,
                limits,
            )?)
        };
        let ring_access = match ring_isolation {
            RingIsolation::NoRing => AccessFlags::LocalWrite,
            RingIsolation::Window => AccessFlags::LocalWrite | AccessFlags::MemoryWindowBind,
            RingIsolation::OwnPd => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
        };
        let recv_ring = if sizes.recv_ring == 0 {
            None
        } else {
            Some(RegisteredBuffer::new(
                &pd,
                sizes.recv_ring,
                ring_access,
                limits,
            )?)
        };
        let ring_window = match ring_isolation {
            RingIsolation::Window => Some(MemoryWindow::alloc(&device)?),
            _ => None,
        };
        let qp_num = qp.qp_number();
        // Completions on a shared CQ reach this QP from now on (it is in
        // RESET: none can come before). Nothing fails after this.
        cq.route(qp_num);
        Ok(RcQueuePair {
            ring_window,
            qp: ManuallyDrop::new(qp),
            qp_num,
            send_buf,
            send_buf_len: sizes.send_buf,
            send_buf_on_demand,
            recv_ring,
            grown_rings: Vec::new(),
            ring_base: 0,
            cq,
            events: Arc::new(events),
            probe_outstanding: false,
            inline_scratch: Vec::new(),
            max_inline: sizes.max_inline,
            ring_isolation,
            _pd: pd,
            device,
            _counted: counted,
        })
    }

    /// The send buffer, taking one from the device's cache (or registering
    /// one) if an on-demand buffer is not held now.
    ///
    /// # Errors
    /// [`Error::Verbs`] (`ibv_reg_mr`, errno kept: `ENOMEM` at
    /// RLIMIT_MEMLOCK) when a new buffer cannot be registered.
    pub(crate) fn ensure_send_buf(&mut self) -> Result<&mut RegisteredBuffer> {
        match &mut self.send_buf {
            Some(buf) => Ok(buf),
            slot @ None => Ok(slot.insert(self.device.take_send_buffer(self.send_buf_len)?)),
        }
    }

    /// The send buffer if one is held now, to copy into.
    pub(crate) fn send_buf_mut(&mut self) -> Option<&mut RegisteredBuffer> {
        self.send_buf.as_mut()
    }

    /// Gives an on-demand send buffer back to the device's cache. The
    /// caller guarantees that no posted WR still reads it (every WR that
    /// referenced it completed, and the QP is healthy). No-op for a buffer
    /// held for the QP's life.
    pub(crate) fn release_send_buf(&mut self) {
        if self.send_buf_on_demand {
            if let Some(buf) = self.send_buf.take() {
                self.device.return_send_buffer(buf);
            }
        }
    }

    /// Replaces the send buffer with one of `len` bytes: from the device's
    /// cache (or a new registration) for an on-demand buffer, which gives
    /// the old one back to the cache; a new registration on the QP's PD
    /// otherwise. The caller guarantees that no posted WR still reads the
    /// current buffer (the core's `send_buf_in_use` is 0).
    ///
    /// # Errors
    /// As [`RegisteredBuffer::new`] ([`Error::ResourceLimit`] at
    /// RLIMIT_MEMLOCK): the current buffer and length stay as they were.
    pub(crate) fn resize_send_buf(&mut self, len: usize) -> Result<()> {
        if len == self.send_buf_len {
            return Ok(());
        }
        let new = if self.send_buf_on_demand {
            self.device.take_send_buffer(len)?
        } else {
            RegisteredBuffer::new(&self._pd, len, AccessFlags::LocalWrite, &self.device.limits)?
        };
        self.send_buf_len = len;
        // An on-demand buffer goes back to the cache; one held for the
        // QP's life is deregistered when replaced.
        self.release_send_buf();
        self.send_buf = Some(new);
        Ok(())
    }

    /// Registered bytes this QP holds now: the receive ring and the send
    /// buffer while held.
    pub(crate) fn registered_bytes(&self) -> usize {
        self.recv_ring.as_ref().map_or(0, RegisteredBuffer::len)
            + self.grown_rings.iter().map(|r| r.buf.len()).sum::<usize>()
            + self.send_buf.as_ref().map_or(0, RegisteredBuffer::len)
    }

    /// How the receive ring is opened to the peer.
    pub(crate) fn ring_isolation(&self) -> RingIsolation {
        self.ring_isolation
    }

    /// The device this QP is on.
    pub(crate) fn device(&self) -> &Arc<OpenDevice> {
        &self.device
    }

    /// The receive ring (a byte stream's QP has one; a message endpoint's
    /// has none).
    pub(crate) fn recv_ring(&self) -> Option<&RegisteredBuffer> {
        self.recv_ring.as_ref()
    }

    /// The receive ring of `generation` (0: the handshake's; later ones
    /// from [`add_ring`](Self::add_ring)), while it is held.
    pub(crate) fn ring(&self, generation: u32) -> Option<&RegisteredBuffer> {
        if generation == 0 {
            return self.recv_ring.as_ref();
        }
        self.grown_rings
            .iter()
            .find(|r| r.generation == generation)
            .map(|r| &r.buf)
    }

    /// The key the peer writes ring `generation` with (0 once it is
    /// retired); for the guest tests' isolation checks.
    #[cfg(tokio_rdma_guest)]
    pub(crate) fn ring_rkey_of(&self, generation: u32) -> u32 {
        if generation == 0 {
            return if self.recv_ring.is_some() {
                self.ring_rkey()
            } else {
                0
            };
        }
        self.grown_rings
            .iter()
            .find(|r| r.generation == generation)
            .map_or(0, |r| {
                r.window.as_ref().map_or(r.buf.rkey(), MemoryWindow::rkey)
            })
    }

    /// Registers receive ring `generation` of `len` bytes and opens it to
    /// the peer as the first ring is: a type-2 window bound on this QP
    /// with REMOTE_WRITE over exactly the ring (the bind is posted, signaled,
    /// on the send queue, where it executes before any WR posted after it:
    /// the peer learns the key only from WRs posted later, see
    /// `StreamCore::offer_ring`), or, on a device without windows, the
    /// MR's own key on this QP's own PD. Returns the ring's address and
    /// key. Uses the send-queue slot `RdmaConfig::stream_sizes` keeps for
    /// it.
    ///
    /// # Errors
    /// [`Error::ResourceLimit`] at RLIMIT_MEMLOCK or the device's
    /// `max_mr`/`max_mw`, [`Error::Verbs`] if registering, allocating the
    /// window or posting the bind fails, [`Error::Internal`] on a QP
    /// without a ring. Nothing is held after an error.
    pub(crate) fn add_ring(&mut self, generation: u32, len: usize) -> Result<(u64, u32)> {
        let access = match self.ring_isolation {
            RingIsolation::NoRing => {
                return Err(Error::Internal(
                    "a ring growth on a QP without a ring".into(),
                ));
            }
            RingIsolation::Window => AccessFlags::LocalWrite | AccessFlags::MemoryWindowBind,
            RingIsolation::OwnPd => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
        };
        let buf = RegisteredBuffer::new(&self._pd, len, access, &self.device.limits)?;
        let (window, rkey) = match self.ring_isolation {
            RingIsolation::Window => {
                let mut window = MemoryWindow::alloc(&self.device)?;
                let target = BindTarget {
                    mr: buf.raw_mr() as usize,
                    addr: buf.addr(),
                    len: buf.len() as u64,
                };
                // SAFETY: `buf` is registered with MW_BIND and LOCAL_WRITE
                // on this QP's PD and covers the target; it is kept in
                // `grown_rings` with the window, which is dropped (and so
                // invalidated) before `buf` in every path (field order,
                // Drop, retire_rings_before), so the window never outlives
                // the memory it opens. On an error both are dropped here,
                // window first.
                let rkey = unsafe {
                    self.post_bind_mw(
                        RING_BIND_WR_ID,
                        &mut window,
                        target,
                        WindowAccess::RemoteWrite,
                        true,
                    )
                }?;
                (Some(window), rkey)
            }
            _ => (None, buf.rkey()),
        };
        let addr = buf.addr();
        self.grown_rings.push(GrownRing {
            generation,
            window,
            buf,
        });
        Ok((addr, rkey))
    }

    /// Frees the receive rings of generations below `generation` (their
    /// windows first, so their keys die before the memory is
    /// deregistered). The peer no longer writes them and nothing is left
    /// to read in them (`StreamCore::oldest_ring`).
    pub(crate) fn retire_rings_before(&mut self, generation: u32) {
        if generation <= self.ring_base {
            return;
        }
        self.ring_base = generation;
        if generation > 0 {
            drop(self.ring_window.take());
            drop(self.recv_ring.take());
        }
        self.grown_rings.retain(|r| r.generation >= generation);
    }

    /// The key the peer writes the ring with: the window's key once
    /// [`bind_ring_window`](Self::bind_ring_window) ran (announced in the
    /// handshake before, since the bind chooses it), or the ring MR's own
    /// key on a QP with a PD of its own.
    pub(crate) fn ring_rkey(&self) -> u32 {
        match &self.ring_window {
            Some(w) => w.next_rkey(),
            None => self.recv_ring.as_ref().map_or(0, RegisteredBuffer::rkey),
        }
    }

    /// Binds the ring's window (REMOTE_WRITE over exactly the ring, on this
    /// QP) and waits for the bind to complete. The QP must be in RTS and
    /// the peer must not write yet (called before `rdma_accept`/the RTU).
    /// No-op without a window.
    ///
    /// # Errors
    /// [`Error::Verbs`] if posting fails, [`Error::WorkCompletion`] if the
    /// bind completes with an error, [`Error::Internal`] if it does not
    /// complete within 5 s.
    pub(crate) async fn bind_ring_window(&mut self) -> Result<()> {
        let Some(mut window) = self.ring_window.take() else {
            return Ok(());
        };
        let Some(ring) = &self.recv_ring else {
            return Err(Error::Internal("a ring window without a ring".into()));
        };
        let (addr, len, mr) = (ring.addr(), ring.len() as u64, ring.raw_mr() as usize);
        let wr_id = MW_WR_FLAG;
        let want = window.next_rkey();
        // SAFETY: the ring lives as long as this QP and the window is
        // dropped before both (field order), so the window never outlives
        // the memory it opens.
        let posted = unsafe {
            self.post_bind_mw(
                wr_id,
                &mut window,
                BindTarget { mr, addr, len },
                WindowAccess::RemoteWrite,
                true,
            )
        };
        self.ring_window = Some(window);
        let got = posted?;
        debug_assert_eq!(got, want);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut wcs = Vec::new();
        loop {
            wcs.clear();
            self.poll(&mut wcs)?;
            if let Some(wc) = wcs.iter().find(|wc| wc.wr_id == wr_id) {
                if wc.status != 0 {
                    return Err(Error::WorkCompletion {
                        op: "BIND_MW",
                        status: wc.status,
                    });
                }
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(Error::Internal(
                    "the receive ring's memory-window bind did not complete".into(),
                ));
            }
            tokio::task::yield_now().await;
        }
    }

    /// A zeroed send WR with its id, opcode and (un)signaled flag set.
    fn raw_send_wr(wr_id: u64, opcode: u32, signaled: bool) -> ibv_send_wr {
        // SAFETY: ibv_send_wr is plain data (pointers, integers, unions of
        // them); all-zero is a valid value that callers complete.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = opcode;
        wr.send_flags = if signaled {
            ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        wr
    }

    /// Posts one WR the verbs layer built itself (`ibv_post_send`); `op`
    /// names it in the error.
    ///
    /// # Safety
    /// Any memory `wr` names (an MR under a bind) must stay valid as the
    /// caller of the posting method guarantees.
    unsafe fn post_raw(&mut self, wr: &mut ibv_send_wr, op: &'static str) -> Result<()> {
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: valid QP; `wr` is one fully initialised WR (no `next`)
        // that lives across the call; its memory is the caller's promise.
        let ret = unsafe { ibv_post_send(self.qp.qp().as_ptr(), wr, &mut bad) };
        if ret != 0 {
            return Err(Error::Verbs {
                op,
                source: io::Error::from_raw_os_error(ret),
            });
        }
        Ok(())
    }

    /// Posts a BIND_MW work request: `window` grants `access` over
    /// `target` (`len` bytes at `addr` of the memory region `mr`), through
    /// this QP only.
    /// Returns the window's new key. Unsignaled binds complete silently (an
    /// error still completes, and fails the QP).
    ///
    /// # Safety
    /// `mr` must be the address of a live `ibv_mr` on this QP's PD registered with
    /// `MW_BIND` (and `LOCAL_WRITE` for `RemoteWrite`) covering the range,
    /// and that memory must stay allocated until the window is invalidated
    /// ([`post_local_inv`](Self::post_local_inv) completed) or deallocated.
    pub(crate) unsafe fn post_bind_mw(
        &mut self,
        wr_id: u64,
        window: &mut MemoryWindow,
        target: BindTarget,
        access: WindowAccess,
        signaled: bool,
    ) -> Result<u32> {
        let BindTarget { mr, addr, len } = target;
        let old = window.rkey();
        let new_rkey = window.next_rkey();
        let raw_mw = window.start_bind(new_rkey);
        let flags = match access {
            WindowAccess::RemoteRead => ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            WindowAccess::RemoteWrite => ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
            WindowAccess::Grant {
                read,
                write,
                atomic,
            } => {
                let mut f = 0;
                if read {
                    f |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
                }
                if write {
                    f |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
                }
                if atomic {
                    f |= ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
                }
                f
            }
        };
        let mut wr = Self::raw_send_wr(wr_id, ibv_wr_opcode::IBV_WR_BIND_MW, signaled);
        wr.bind_mw_tso_union.bind_mw = bind_mw_t {
            mw: raw_mw,
            rkey: new_rkey,
            bind_info: ibv_mw_bind_info {
                mr: mr as *mut ibv_mr,
                addr,
                length: len,
                mw_access_flags: flags,
            },
        };
        // SAFETY: the caller guarantees `mr` and its memory.
        if let Err(e) = unsafe { self.post_raw(&mut wr, "ibv_post_send (BIND_MW)") } {
            window.abort_bind(old);
            return Err(e);
        }
        window.bound();
        Ok(new_rkey)
    }

    /// Posts a LOCAL_INV work request for window key `rkey`: once it
    /// completes, the key opens nothing and the window can be bound again.
    ///
    /// # Errors
    /// [`Error::Verbs`] with the errno if posting fails.
    pub(crate) fn post_local_inv(&mut self, wr_id: u64, rkey: u32, signaled: bool) -> Result<()> {
        let mut wr = Self::raw_send_wr(wr_id, ibv_wr_opcode::IBV_WR_LOCAL_INV, signaled);
        wr.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
        // SAFETY: the WR names no memory of ours.
        unsafe { self.post_raw(&mut wr, "ibv_post_send (LOCAL_INV)") }
    }

    /// QP number, for the rdma_cm connect/accept parameters.
    pub(crate) fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// Largest inline payload requested at creation (bytes).
    pub(crate) fn max_inline(&self) -> u32 {
        self.max_inline
    }

    /// Moves the QP to `state` (INIT, RTR or RTS) with the attributes rdma_cm
    /// computed for `id`.
    fn modify_from_cm(&mut self, id: &CmId, state: u32) -> Result<()> {
        let (mut attr, mask) = id.init_qp_attr(state)?;
        self.modify(&mut attr, mask)
    }

    /// `ibv_modify_qp` with attributes from rdma_init_qp_attr (some fields
    /// possibly set to values the caller validated).
    fn modify(&mut self, attr: &mut ibv_qp_attr, mask: i32) -> Result<()> {
        // SAFETY: the QP is valid while `self` lives and `attr` is a valid,
        // writable attribute struct for the call's duration; a transition
        // the QP cannot make is an error return, not undefined behaviour.
        let ret = unsafe { ibv_modify_qp(self.qp.qp().as_ptr(), attr, mask) };
        if ret != 0 {
            return Err(Error::Verbs {
                op: "ibv_modify_qp",
                source: io::Error::from_raw_os_error(ret),
            });
        }
        Ok(())
    }

    /// Moves the QP to INIT with rdma_cm's attributes for `id`.
    pub(crate) fn modify_to_init(&mut self, id: &CmId) -> Result<()> {
        self.modify_from_cm(id, ibv_qp_state::IBV_QPS_INIT)
    }

    /// Moves the QP to RTR (ready to receive) with rdma_cm's attributes.
    pub(crate) fn modify_to_rtr(&mut self, id: &CmId) -> Result<()> {
        self.modify_from_cm(id, ibv_qp_state::IBV_QPS_RTR)
    }

    /// Moves the QP to RTS (ready to send) with rdma_cm's attributes, but
    /// the RC transport's ACK timeout exponent and retry count given here
    /// (`RdmaConfig::ack_timeout`/`retry_count`).
    pub(crate) fn modify_to_rts(
        &mut self,
        id: &CmId,
        ack_timeout: u8,
        retry_count: u8,
    ) -> Result<()> {
        let (mut attr, mask) = id.init_qp_attr(ibv_qp_state::IBV_QPS_RTS)?;
        attr.timeout = ack_timeout;
        attr.retry_cnt = retry_count;
        let mask = mask
            | rdma_mummy_sys::ibv_qp_attr_mask::IBV_QP_TIMEOUT.0 as i32
            | rdma_mummy_sys::ibv_qp_attr_mask::IBV_QP_RETRY_CNT.0 as i32;
        // The two fields changed hold values the config validated (1..=31,
        // 0..=7).
        self.modify(&mut attr, mask)
    }

    /// Posts a keepalive probe: a signaled zero-length RDMA WRITE (no data,
    /// no immediate: it consumes no receive WR at the peer, and IBTA C9-88
    /// lets a zero-length operation carry no valid key). A peer that is
    /// gone never acknowledges it, so it completes with RETRY_EXC_ERR after
    /// the retry bound.
    ///
    /// # Errors
    /// [`Error::Verbs`] with the errno if posting fails.
    pub(crate) fn post_probe(&mut self) -> Result<()> {
        let mut wr = Self::raw_send_wr(PROBE_WR_ID, ibv_wr_opcode::IBV_WR_RDMA_WRITE, true);
        // SAFETY: no SGEs: the WR names no memory.
        unsafe { self.post_raw(&mut wr, "ibv_post_send (keepalive probe)") }?;
        self.probe_outstanding = true;
        Ok(())
    }

    /// Whether the last keepalive probe has neither completed nor failed
    /// yet (its completion was not polled).
    pub(crate) fn probe_outstanding(&self) -> bool {
        self.probe_outstanding
    }

    /// Moves the QP to the error state: outstanding WRs complete with
    /// "flushed" status, and the NIC stops touching our memory.
    pub(crate) fn set_error(&mut self) {
        // SAFETY: ibv_qp_attr is plain data; only qp_state is read with
        // IBV_QP_STATE.
        let mut attr: rdma_mummy_sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: valid QP; the mask names only the state.
        unsafe {
            ibv_modify_qp(
                self.qp.qp().as_ptr(),
                &mut attr,
                rdma_mummy_sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
            )
        };
    }

    /// Posts `n` zero-length receive WRs (RDMA WRITE WITH IMM needs one each).
    pub(crate) fn post_recvs(&mut self, n: u32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let mut guard = self.qp.start_post_recv();
        for _ in 0..n {
            guard.construct_wr(RECV_WR_FLAG);
        }
        guard.post().map_err(|e| Error::Verbs {
            op: "ibv_post_recv",
            source: io::Error::other(e),
        })
    }

    /// Posts one RDMA WRITE WITH IMM of `len` bytes from the send buffer at
    /// `local_offset` to `remote_addr` (rkey `rkey`); `len == 0` posts a
    /// control message. `inline` copies the payload into the WQE.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn post_write_imm(
        &mut self,
        wr_id: u64,
        local_offset: u32,
        len: u32,
        remote_addr: u64,
        rkey: u32,
        imm: u32,
        signaled: bool,
        inline: bool,
    ) -> Result<()> {
        // Solicited: the peer may arm its CQ for solicited events only
        // (see `RcQueuePair::arm`); this WR consumes one of its receive WRs.
        let flags = if signaled {
            WorkRequestFlags::Signaled | WorkRequestFlags::Solicited
        } else {
            WorkRequestFlags::Solicited
        };
        // Taken and put back: no allocation per inline post (lost only on
        // an error return).
        let mut tmp = std::mem::take(&mut self.inline_scratch);
        tmp.clear();
        let (mut lkey, mut laddr) = (0, 0);
        if len > 0 {
            let buf = self
                .send_buf
                .as_ref()
                .ok_or_else(|| Error::Internal("data WR posted without a send buffer".into()))?;
            if inline {
                tmp.resize(len as usize, 0);
                buf.read_at(local_offset as usize, &mut tmp)
                    .map_err(verbs("inline copy"))?;
            }
            lkey = buf.lkey();
            laddr = buf.addr() + u64::from(local_offset);
        }
        let mut guard = self.qp.start_post_send();
        let wr = guard
            .construct_wr(wr_id, flags)
            .setup_write_imm(rkey, remote_addr, imm.to_be());
        if len > 0 {
            if inline {
                wr.setup_inline_data(&tmp);
            } else {
                // SAFETY: the range lies in our registered send buffer (the
                // core hands out offsets inside it) and stays allocated until
                // the QP is destroyed, which happens first in Drop.
                unsafe { wr.setup_sge(lkey, laddr, len) };
            }
        }
        let posted = guard.post().map_err(|e| Error::Verbs {
            op: "ibv_post_send",
            source: io::Error::other(e),
        });
        self.inline_scratch = tmp;
        posted
    }

    /// Posts one receive WR per `(wr_id, sge)`: a SEND lands in the SGE's
    /// memory. Used by the message endpoint with pool buffers.
    ///
    /// # Safety
    ///
    /// Every SGE must name memory registered with local-write access under
    /// its lkey on this QP's PD that stays allocated and untouched by the
    /// program until the receive completes (or is flushed).
    pub(crate) unsafe fn post_recv_sges(&mut self, wrs: &[(u64, Sge)]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut guard = self.qp.start_post_recv();
        for &(wr_id, sge) in wrs {
            let wr = guard.construct_wr(wr_id);
            // SAFETY: the caller guarantees the SGE's memory (see above).
            unsafe { wr.setup_sge(sge.lkey, sge.addr, sge.len) };
        }
        guard.post().map_err(|e| Error::Verbs {
            op: "ibv_post_recv",
            source: io::Error::other(e),
        })
    }

    /// Posts `wrs` (SEND WITH IMM and RDMA READ) with one `ibv_post_send`
    /// call: one doorbell for the whole batch.
    ///
    /// # Safety
    ///
    /// Every SGE must name memory registered under its lkey on this QP's PD
    /// that stays allocated until its WR completes (or is flushed), and that
    /// the program does not touch while a READ writes it.
    pub(crate) unsafe fn post_send_batch(&mut self, wrs: &[SendWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut guard = self.qp.start_post_send();
        for w in wrs {
            let mut flags = if w.signaled {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            if w.solicited && matches!(w.op, SendOp::SendImm { .. }) {
                flags |= WorkRequestFlags::Solicited;
            }
            let wr = guard.construct_wr(w.wr_id, flags);
            match w.op {
                SendOp::SendImm { payload, imm } => {
                    let wr = wr.setup_send_imm(imm.to_be());
                    match payload {
                        SendPayload::None => {}
                        SendPayload::Inline(data) => wr.setup_inline_data(data),
                        // SAFETY: the caller guarantees the SGE's memory.
                        SendPayload::Sge(sge) => unsafe {
                            wr.setup_sge(sge.lkey, sge.addr, sge.len)
                        },
                    }
                }
                SendOp::Read {
                    local,
                    remote_addr,
                    rkey,
                } => {
                    let wr = wr.setup_read(rkey, remote_addr);
                    // SAFETY: the caller guarantees the SGE's memory.
                    unsafe { wr.setup_sge(local.lkey, local.addr, local.len) };
                }
                SendOp::Write {
                    local,
                    remote_addr,
                    rkey,
                } => {
                    let wr = wr.setup_write(rkey, remote_addr);
                    // SAFETY: the caller guarantees the SGE's memory.
                    unsafe { wr.setup_sge(local.lkey, local.addr, local.len) };
                }
                SendOp::CompareSwap {
                    local,
                    remote_addr,
                    rkey,
                    compare,
                    swap,
                } => {
                    let wr = wr.setup_atomic_compare_swap(rkey, remote_addr, compare, swap);
                    // SAFETY: the caller guarantees the SGE's memory.
                    unsafe { wr.setup_sge(local.lkey, local.addr, local.len) };
                }
                SendOp::FetchAdd {
                    local,
                    remote_addr,
                    rkey,
                    add,
                } => {
                    let wr = wr.setup_atomic_fetch_add(rkey, remote_addr, add);
                    // SAFETY: the caller guarantees the SGE's memory.
                    unsafe { wr.setup_sge(local.lkey, local.addr, local.len) };
                }
            }
        }
        guard.post().map_err(|e| Error::Verbs {
            op: "ibv_post_send",
            source: io::Error::other(e),
        })
    }

    /// Moves this QP's completions into `out` without blocking (its own
    /// CQ, or its share of a shared one: [`QpCq::poll`]).
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_poll_cq` fails.
    pub(crate) fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        let start = out.len();
        let polled = self.cq.poll(self.qp_num, out);
        if out[start..].iter().any(|wc| wc.wr_id == PROBE_WR_ID) {
            self.probe_outstanding = false;
        }
        polled
    }

    /// Requests a completion event (`ibv_req_notify_cq`; nothing on a
    /// shared CQ, which its hub keeps armed for every completion): for the
    /// next completion, or with `solicited_only` for the next solicited
    /// one: a receive completion of a WR the peer posted with
    /// `IBV_SEND_SOLICITED` (every WR of protocol version 5 that consumes
    /// a receive WR: data, CREDIT, FIN, ABORT, messages) or a completion
    /// in error (IBTA spec, vol. 1, 11.4.2.2 and C11-23; rxe raises the
    /// event for flushed receive WRs). Our own send completions then raise
    /// no event: a task that waits for one asks for every completion. A
    /// request for every completion is not narrowed by a later solicited
    /// one until the event fires (rxe keeps the wider request).
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_req_notify_cq` fails.
    pub(crate) fn arm(&self, solicited_only: bool) -> Result<()> {
        self.cq.arm(solicited_only)
    }

    /// Where the CQ's events arrive, to wait without the lock.
    pub(crate) fn cq_events(&self) -> Arc<CqEvents> {
        Arc::clone(&self.events)
    }

    /// An application task that waited on the CQ found work: the driver
    /// no longer leaves events to it ([`CqEvents::unpark`]).
    pub(crate) fn unpark(&self) {
        self.events.unpark();
    }
}

impl AsMut<RcQueuePair> for RcQueuePair {
    fn as_mut(&mut self) -> &mut RcQueuePair {
        self
    }
}

impl Drop for RcQueuePair {
    fn drop(&mut self) {
        // The windows before the QP they are bound to.
        drop(self.ring_window.take());
        for ring in &mut self.grown_rings {
            drop(ring.window.take());
        }
        // Only once the QP is destroyed (no completion of it can come any
        // more) is a shared CQ polled a last time and the route removed.
        let qp = &mut self.qp;
        self.cq.unroute_after(self.qp_num, || {
            // SAFETY: the QP is dropped exactly once, here; no method runs
            // on `self` after Drop, and the fields dropped after it
            // (buffers, CQ) outlive it as the NIC requires.
            unsafe { ManuallyDrop::drop(qp) }
        });
    }
}
