//! One reliable-connected (RC) queue pair and its completion queue (CQ,
//! reporting to a completion channel of its own or its runtime's, see
//! [`super::events`]), on a protection domain (PD) shared per device or
//! (on request, for a device without memory windows) one of its own;
//! registered buffers ([`RegisteredBuffer`]); the raw posting of work
//! requests (WRs).
//!
//! This is mechanism only: which memory a WR names, and how long it must
//! stay allocated, is the QP adapter's (`stream::qp`, `message::qp`),
//! which owns that memory beside the [`RcQueuePair`] and destroys the QP
//! first (field order). Teardown order here is QP, then CQ (every event is
//! acknowledged when read, so `ibv_destroy_cq` does not wait), then its
//! channel; the PD and device context live in a process-wide registry.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::HashMap;
use std::io;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use rdma_mummy_sys::{
    bind_mw_t, ibv_access_flags, ibv_modify_qp, ibv_mr, ibv_mw_bind_info, ibv_post_recv,
    ibv_post_send, ibv_qp_attr, ibv_qp_state, ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge,
    ibv_wc, ibv_wr_opcode,
};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList, TransportType};
use sideway::ibverbs::device_context::{
    AllocateProtectionDomainErrorKind, AtomicCapability, DeviceContext, PortState,
};
use sideway::ibverbs::memory_region::{
    MemoryRegion, RegisterMemoryRegionError, RegisterMemoryRegionErrorKind,
};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{BasicQueuePair, CreateQueuePairErrorKind, QueuePair as _};

use super::cm::CmId;
use super::count::{Counted, DeviceLimits, Kind, classify};
use super::events::{CqEvents, QpCq};
use super::fork::ParentOnly;
use super::mw::{MemoryWindow, WindowAccess};
use super::watch::DeviceWatch;
use crate::error::{Error, Result};

/// An opened device with the protection domain every connection on it shares.
pub(crate) struct OpenDevice {
    /// The device name, for example `rxe0`.
    pub(crate) name: String,
    /// Its async events and its removal (`verbs::watch`).
    pub(crate) watch: Arc<DeviceWatch>,
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) ctx: Arc<DeviceContext>,
    /// Memory windows the device supports (`ibv_device_attr::max_mw`); 0
    /// for providers without them.
    pub(crate) max_mw: u32,
    /// The most entries one CQ may have (`ibv_device_attr::max_cqe`; 0 if
    /// unknown).
    pub(crate) max_cqe: u32,
    /// Scatter-gather entries per send-queue WR (`ibv_device_attr::max_sge`;
    /// 1 if unknown).
    pub(crate) max_sge: u32,
    /// Scatter-gather entries per RDMA READ WR
    /// (`ibv_device_attr::max_sge_rd`; 1 if unknown; Soft-iWARP has 1).
    pub(crate) max_sge_rd: u32,
    /// The device's object limits, for typed resource errors.
    pub(crate) limits: DeviceLimits,
    /// Whether the device executes RDMA atomics (`atomic_cap` other than
    /// `IBV_ATOMIC_NONE`; false if the attributes cannot be read).
    pub(crate) atomics: bool,
    /// Whether the device carries immediate data (RDMA WRITE WITH IMM,
    /// SEND WITH IMM): InfiniBand and RoCE do; iWARP (RFC 5040) has no
    /// immediate data, so there a stream carries each 32-bit immediate in
    /// a 4-byte SEND after its RDMA WRITE (`stream::qp`).
    pub(crate) immediate_data: bool,
    /// Whether a send-queue completion may come before that of an earlier
    /// RDMA READ. Soft-iWARP completes a SEND or WRITE once transmitted,
    /// ahead of an earlier READ still waiting for its response
    /// (`siw_qp_sq_process` moves the READ to its ORQ and goes on), which
    /// breaks the in-order send-queue completions the message core and
    /// the ledger rely on (a completion retires every earlier WR); the
    /// message QP then holds such completions back until the READs before
    /// them completed (`MessageQp::hold_back`). A fence (`IBV_SEND_FENCE`)
    /// would order them too, but siw's fenced WQE occupies its transmit
    /// slot and starves the peer's READ responses: two ends reading each
    /// other deadlock. Set on iWARP devices.
    pub(crate) reads_complete_late: bool,
    /// Whether a send completion only means the WR was handed to the
    /// transport, not that the peer received it: iWARP (RFC 5040) needs no
    /// acknowledgement from the responder for a SEND or RDMA WRITE, and
    /// Soft-iWARP completes them once they are in its TCP socket. Only an
    /// RDMA READ's completion tells that the peer processed everything
    /// posted before it (its READ response follows them on the one
    /// ordered stream, RFC 5040 section 5.5), so there the keepalive probe
    /// is a zero-length READ and a closing connection waits for one before
    /// it disconnects ([`RcQueuePair::post_probe`]). Set on iWARP devices.
    pub(crate) completes_at_transmit: bool,
    /// Whether the connection's initiator must send its first frame:
    /// MPA's responder may not send before it received one (RFC 5044,
    /// section 7.1.2), because the initiator tells the MPA reply from the
    /// frames after it only by that order (Soft-iWARP refuses a reply
    /// followed by a frame in the same read: `siw_recv_mpa_rr`, "peer
    /// sent extra data", and the connect fails). Set on iWARP devices
    /// ([`RcQueuePair::awaiting_initiator`], [`RcQueuePair::speaks_first`]).
    pub(crate) initiator_sends_first: bool,
    /// Whether a CQ armed for solicited events only wakes on a solicited
    /// receive. Soft-iWARP (`siw`, vendor id [`SIW_VENDOR_ID`]) does not:
    /// its receive completions test the CQ's arming as unsolicited
    /// (`siw_rqe_complete` in Linux 6.1 passes `SIW_WQE_SIGNALLED`), so a
    /// solicited-only arm never fires there and [`RcQueuePair::arm`] arms
    /// for every completion instead.
    pub(crate) solicited_events: bool,
    /// Soft-iWARP only: a CQ of 32,768 entries (1 MiB of queue, 256 pages)
    /// created first on the context, so its mapping covers pages 0-255 of
    /// the context's mmap space for the process's life. libsiw takes the
    /// key 0x90000 (page 144), a valid offset, for its "invalid key"
    /// (`SIW_INVAL_UOBJ_KEY` is `SIW_UOBJ_MAX_KEY + 1` in `siw-abi.h`)
    /// and destroys a CQ or QP the kernel mapped there, and the kernel
    /// places mappings first-fit from page 0, so once the context's
    /// mappings reach page 144 every new CQ or QP lands there and fails
    /// (`ibv_create_cq`/`ibv_create_qp` with errno unset). Seen with tens
    /// of connections in one process.
    _siw_mmap_guard: Option<ParentOnly<Arc<BasicCompletionQueue>>>,
    _counted_pd: Counted,
}

/// Entries of [`OpenDevice`]'s Soft-iWARP guard CQ: 2^15, so its queue
/// (32 bytes per entry) spans 256 pages, past page 144.
const SIW_MMAP_GUARD_CQE: u32 = 1 << 15;

/// `ibv_device_attr::vendor_id` of Soft-iWARP: ASCII `"bmt"` (Linux
/// `drivers/infiniband/sw/siw/siw.h`, `SIW_VENDOR_ID`).
pub(crate) const SIW_VENDOR_ID: u32 = 0x62_6d74;

impl OpenDevice {
    /// Whether `port` is down now: its `PORT_ERR` came and no
    /// `PORT_ACTIVE` since, or `ibv_query_port` says it is not active
    /// (the event lags the link: Soft-RoCE fails sends as soon as its
    /// netdev stops, before its `PORT_ERR` is read). False if the port
    /// cannot be queried (a device gone: no message can leave it anyway).
    pub(crate) fn port_down(&self, port: u8) -> bool {
        self.watch.down_for(port).is_some()
            || self.ctx.query_port(port).is_ok_and(|a| {
                !matches!(a.port_state(), PortState::Active | PortState::ActiveDefer)
            })
    }

    /// [`Error::PortDown`] for `port` if it is down now
    /// ([`port_down`](Self::port_down)), with how long it has been down
    /// (0 when only `ibv_query_port` says so); `None` if it is up.
    pub(crate) fn port_down_error(&self, port: u8) -> Option<Error> {
        self.port_down(port).then(|| Error::PortDown {
            device: self.name.clone(),
            port,
            after: self.watch.down_for(port).unwrap_or_default(),
        })
    }

    /// The active MTU of `port`, bytes (256..=4096): what this side
    /// announces as its path MTU in the handshake. 0 on iWARP (TCP
    /// segments its stream; there is no path MTU to agree) and if the port
    /// cannot be queried.
    pub(crate) fn port_path_mtu(&self, port: u8) -> u32 {
        if !self.immediate_data {
            return 0;
        }
        self.ctx
            .query_port(port)
            .map_or(0, |a| crate::verbs::device::mtu_bytes(a.active_mtu()))
    }

    /// Whether the device has type-2 memory windows.
    pub(crate) fn has_memory_windows(&self) -> bool {
        self.max_mw > 0
    }

    /// `Err(Error::NoAtomics)` unless the device executes RDMA atomics.
    pub(crate) fn check_atomics(&self) -> Result<()> {
        if self.atomics {
            Ok(())
        } else {
            Err(Error::NoAtomics {
                device: self.name.clone(),
            })
        }
    }

    /// Allocates and registers `len` bytes with `access` on the device's
    /// shared PD ([`RegisteredBuffer::new`]).
    pub(crate) fn register_buffer(&self, len: usize, access: MrAccess) -> Result<RegisteredBuffer> {
        RegisteredBuffer::new(&self.pd, len, access, &self.limits)
    }
}

/// Opens (once per process) the device called `name` and its PD.
pub(crate) fn open_device(name: &str) -> Result<Arc<OpenDevice>> {
    crate::verbs::fork::check("open an RDMA device")?;
    crate::verbs::fork::watch();
    let map = DEVICES.get_or_init(Default::default);
    let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = map.get(name) {
        if !d.watch.is_removed() {
            return Ok(Arc::clone(d));
        }
        map.remove(name);
    }
    let list = DeviceList::new().map_err(|e| Error::Verbs {
        op: "ibv_get_device_list",
        source: io::Error::other(e),
    })?;
    let dev = list
        .iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| Error::DeviceNotFound { name: name.into() })?;
    let immediate_data = dev.transport_type() != TransportType::IWarp;
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
    let sges = |v: i32| u32::try_from(v).unwrap_or(0).max(1);
    let max_sge = attr.as_ref().map_or(1, |a| sges(a.max_sge()));
    let max_sge_rd = attr.as_ref().map_or(1, |a| sges(a.max_sge_rd()));
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
    let atomics = attr
        .as_ref()
        .is_some_and(|a| a.atomic_capability() != AtomicCapability::None);
    let siw = attr
        .as_ref()
        .is_some_and(|a| a.vendor_id() == SIW_VENDOR_ID);
    let solicited_events = !siw;
    // Before any other CQ or QP of this context (see `_siw_mmap_guard`).
    let siw_mmap_guard = if siw {
        Some(
            ctx.create_cq_builder()
                .setup_cqe(SIW_MMAP_GUARD_CQE)
                .build()
                .map_err(|e| Error::Verbs {
                    op: "ibv_create_cq (siw mmap guard)",
                    source: io::Error::other(e),
                })?,
        )
    } else {
        None
    };
    let watch = DeviceWatch::start(name, &ctx, immediate_data);
    let d = Arc::new(OpenDevice {
        name: name.to_string(),
        watch,
        pd,
        ctx,
        max_mw,
        max_cqe,
        max_sge,
        max_sge_rd,
        limits,
        atomics,
        immediate_data,
        reads_complete_late: !immediate_data,
        completes_at_transmit: !immediate_data,
        initiator_sends_first: !immediate_data,
        solicited_events,
        _siw_mmap_guard: siw_mmap_guard.map(ParentOnly::new),
        _counted_pd: Counted::new(Kind::ProtectionDomain),
    });
    map.insert(name.to_string(), Arc::clone(&d));
    // The entry goes with the device (not a device opened later under the
    // same name).
    let (key, ptr) = (name.to_string(), Arc::as_ptr(&d) as usize);
    d.watch.on_removed(move || {
        let mut map = DEVICES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if map
            .get(&key)
            .is_some_and(|v| Arc::as_ptr(v) as usize == ptr)
        {
            map.remove(&key);
        }
    });
    Ok(d)
}

/// Every device this process opened, by name (one context and PD each),
/// until the device goes ([`DeviceWatch::removed`]).
static DEVICES: OnceLock<Mutex<HashMap<String, Arc<OpenDevice>>>> = OnceLock::new();

/// rdma_cm reported `DEVICE_REMOVAL` for an id on `name`: if the process
/// has the device open, fail its connections and let the caches go
/// (see `verbs::watch`).
pub(crate) fn device_removed(name: &str) {
    let d = DEVICES.get().and_then(|m| {
        m.lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    });
    if let Some(d) = d {
        d.watch.removed();
    }
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
    /// `IBV_ACCESS_LOCAL_WRITE | REMOTE_WRITE`: a stream's receive ring on
    /// a device without windows, on a QP with a PD of its own (so the key
    /// is useless from any other QP); on such a message QP, the sink of
    /// an RDMA READ (iWARP's READ response is a tagged write to the sink's
    /// key, RFC 5040 section 4.4). Never a pool or user region.
    LocalWriteRemoteWrite,
    /// `IBV_ACCESS_REMOTE_READ`: exactly one rendezvous message's bytes on
    /// a message QP with a PD of its own (a device without windows), from
    /// its RTS until the peer's DONE.
    RemoteRead,
    /// A grant on a device without windows, on the connection's own PD:
    /// `LOCAL_WRITE` (required with remote write or atomics) and exactly
    /// the remote rights granted.
    Grant {
        /// `IBV_ACCESS_REMOTE_READ`.
        read: bool,
        /// `IBV_ACCESS_REMOTE_WRITE`.
        write: bool,
        /// `IBV_ACCESS_REMOTE_ATOMIC`.
        atomic: bool,
    },
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
            MrAccess::LocalWriteRemoteWrite => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
            MrAccess::RemoteRead => AccessFlags::RemoteRead,
            MrAccess::Grant {
                read,
                write,
                atomic,
            } => {
                let mut f = AccessFlags::none();
                if read {
                    f |= AccessFlags::RemoteRead;
                }
                if write {
                    f |= AccessFlags::LocalWrite | AccessFlags::RemoteWrite;
                }
                if atomic {
                    f |= AccessFlags::LocalWrite | AccessFlags::RemoteAtomic;
                }
                f
            }
        }
    }
}

/// One memory region on an opened device's PD; deregistered when dropped.
pub(crate) struct MemoryRegistration {
    /// Leaked in a forked child (deregistering would remove the parent's).
    mr: ParentOnly<Arc<MemoryRegion>>,
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
        crate::verbs::fork::check_io("ibv_reg_mr")?;
        // Pool and user regions never open themselves by their own key.
        debug_assert!(!access.grants_remote_access());
        let flags = access.flags();
        // SAFETY: the caller guarantees `ptr` is valid for `len` bytes (and
        // writable when `access` allows writes) until this registration,
        // which owns the MR, is dropped.
        let mr =
            unsafe { device.pd.reg_mr(ptr.as_ptr() as usize, len, flags) }.map_err(reg_mr_errno)?;
        Ok(MemoryRegistration {
            mr: ParentOnly::new(mr),
            access,
            _device: Arc::clone(device),
            _counted: Counted::memory_region(len),
        })
    }

    /// Registers `len` bytes at `ptr` with `access` on `pd`, a PD other
    /// than the device's shared one: a connection's own
    /// ([`RcQueuePair::register_scoped`], [`RcQueuePair::pd`]).
    ///
    /// # Safety
    /// As [`MemoryRegistration::new`].
    pub(crate) unsafe fn on_pd(
        device: &Arc<OpenDevice>,
        pd: &Arc<ProtectionDomain>,
        ptr: NonNull<u8>,
        len: usize,
        access: MrAccess,
    ) -> io::Result<Self> {
        crate::verbs::fork::check_io("ibv_reg_mr")?;
        // A key that opens memory to a peer is only ever made on a PD of
        // one connection's own.
        debug_assert!(!access.grants_remote_access() || !Arc::ptr_eq(pd, &device.pd));
        // SAFETY: as in `new`, guaranteed by the caller.
        let mr = unsafe { pd.reg_mr(ptr.as_ptr() as usize, len, access.flags()) }
            .map_err(reg_mr_errno)?;
        Ok(MemoryRegistration {
            mr: ParentOnly::new(mr),
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
    /// Allocates and registers `len` bytes with `access` on `pd`.
    ///
    /// # Errors
    /// [`Error::ResourceLimit`] at RLIMIT_MEMLOCK or the device's `max_mr`
    /// (from `limits`), [`Error::Verbs`] for other failures.
    fn new(
        pd: &Arc<ProtectionDomain>,
        len: usize,
        access: MrAccess,
        limits: &DeviceLimits,
    ) -> Result<Self> {
        crate::verbs::fork::check("ibv_reg_mr")?;
        let access = access.flags();
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
        if crate::verbs::fork::inherited() {
            return; // the parent's MR: leaked, with the memory
        }
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
    /// On a device without memory windows, create the QP on a PD of its
    /// own (a stream, whose ring is then opened by the MR's own key, which
    /// is useless from any other QP: [`RcQueuePair::has_own_pd`]).
    pub own_pd_without_windows: bool,
    /// Take a seat on a CQ shared with other QPs of the runtime instead of
    /// a CQ of its own ([`QpCq`]).
    pub share_cq: bool,
    /// A stream, whose every message is one RDMA WRITE WITH IMM: on a
    /// device without immediate data (iWARP) it becomes an RDMA WRITE and a
    /// 4-byte inline SEND, so the send queue is made twice as deep and
    /// inline data at least 4 bytes.
    pub imm_in_send_without_immediate: bool,
    /// A message endpoint, whose every message is one SEND WITH IMM: on a
    /// device without immediate data it becomes a SEND whose last 4 bytes
    /// carry the immediate (`proto::message::TRAILER_LEN`), from a second
    /// SGE or inline, so the QP takes 2 send SGEs and inline data of at
    /// least [`TRAILER_INLINE_MIN`] bytes (an RTS header and its trailer).
    pub trailer_without_immediate: bool,
    /// Send SGEs per WR wanted for scatter-gather lists (one-sided
    /// operations of a message endpoint); the QP gets at most the
    /// device's `max_sge`, and at least what the trailer needs.
    pub max_send_sge: u32,
}

/// Inline data a message QP without immediate data is created with at
/// least: a 20-byte RTS header and its 4-byte trailer, so an RTS always
/// goes inline there.
pub(crate) const TRAILER_INLINE_MIN: u32 = 24;

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

/// Whose work request (WR) a completion reports, decoded once from its
/// wr_id (in [`Completion::from_wc`]). A QP adapter numbers its WRs in
/// these spaces and posts them with [`Work::wr_id`]; nothing above the
/// verbs layer reads wr_id bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Work {
    /// A send-queue WR numbered by the protocol core (below 2^60).
    Core(u64),
    /// A receive WR: its token (0 for a stream's zero-length receives).
    Recv(u64),
    /// A memory-window bind or invalidation posted by a QP adapter.
    Window(u64),
    /// A keepalive probe ([`RcQueuePair::post_probe`]).
    Probe,
    /// Remote-memory work (`crate::remote`: one-sided operations, grant
    /// binds and revocations): its completion goes to the waiting
    /// operation, not the protocol core.
    Remote(u64),
}

/// Receive WRs carry this wr_id bit, so send and receive completions are
/// told apart even on providers that report odd opcodes on errors.
const RECV_BIT: u64 = 1 << 63;
/// Memory-window binds and invalidations, and the keepalive probe.
const WINDOW_BIT: u64 = 1 << 62;
/// The keepalive probe (with [`WINDOW_BIT`]).
const PROBE_WR_ID: u64 = WINDOW_BIT | (1 << 61);
/// Remote-memory work.
const REMOTE_BIT: u64 = 1 << 60;
/// The bits that name a [`Work`] space.
const SPACE_BITS: u64 = RECV_BIT | WINDOW_BIT | REMOTE_BIT;

impl Work {
    /// The wr_id to post this WR with. A number must stay below 2^60: the
    /// protocol core's and the adapters' are counters.
    pub(crate) fn wr_id(self) -> u64 {
        let (bit, n) = match self {
            Work::Core(n) => (0, n),
            Work::Recv(n) => (RECV_BIT, n),
            Work::Window(n) => (WINDOW_BIT, n),
            Work::Probe => return PROBE_WR_ID,
            Work::Remote(n) => (REMOTE_BIT, n),
        };
        debug_assert_eq!(
            n & (SPACE_BITS | PROBE_WR_ID),
            0,
            "{self:?} out of its space"
        );
        bit | n
    }

    /// The WR a completion's wr_id names.
    pub(crate) fn of_wr_id(wr_id: u64) -> Work {
        if wr_id & RECV_BIT != 0 {
            Work::Recv(wr_id & !RECV_BIT)
        } else if wr_id == PROBE_WR_ID {
            Work::Probe
        } else if wr_id & WINDOW_BIT != 0 {
            Work::Window(wr_id & !WINDOW_BIT)
        } else if wr_id & REMOTE_BIT != 0 {
            Work::Remote(wr_id & !REMOTE_BIT)
        } else {
            Work::Core(wr_id)
        }
    }
}

/// How a WR ended (`ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WcStatus {
    /// `IBV_WC_SUCCESS`.
    Success,
    /// `IBV_WC_WR_FLUSH_ERR`: flushed because its QP is in the error state
    /// (the NIC no longer touches its memory).
    Flushed,
    /// Any other failure, with its `ibv_wc_status` code.
    Failed(u32),
}

impl WcStatus {
    /// `IBV_WC_SUCCESS`.
    const SUCCESS: u32 = 0;
    /// `IBV_WC_WR_FLUSH_ERR`.
    const WR_FLUSH_ERR: u32 = 5;

    pub(crate) fn from_code(code: u32) -> WcStatus {
        match code {
            Self::SUCCESS => WcStatus::Success,
            Self::WR_FLUSH_ERR => WcStatus::Flushed,
            other => WcStatus::Failed(other),
        }
    }

    /// The `ibv_wc_status` code, for errors.
    pub(crate) fn code(self) -> u32 {
        match self {
            WcStatus::Success => Self::SUCCESS,
            WcStatus::Flushed => Self::WR_FLUSH_ERR,
            WcStatus::Failed(code) => code,
        }
    }
}

/// One work completion, copied out of the CQ, its wr_id decoded.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Completion {
    /// The WR it reports.
    pub work: Work,
    pub status: WcStatus,
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
            work: Work::of_wr_id(wc.wr_id),
            status: WcStatus::from_code(wc.status),
            kind,
            imm: u32::from_be(imm),
            byte_len: wc.byte_len,
        }
    }

    /// The wr_id it was posted with (the key a QP adapter's ledger and
    /// maps use; for logs).
    pub(crate) fn wr_id(&self) -> u64 {
        self.work.wr_id()
    }

    /// Whether it completed without error.
    pub(crate) fn ok(&self) -> bool {
        self.status == WcStatus::Success
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

impl Sge {
    fn raw(self) -> ibv_sge {
        ibv_sge {
            addr: self.addr,
            length: self.len,
            lkey: self.lkey,
        }
    }
}

/// The payload of a SEND or an RDMA WRITE WITH IMM ([`SendOp::SendImm`],
/// [`SendOp::WriteImm`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum SendPayload<'a> {
    /// No payload.
    None,
    /// Copied into the WQE (`IBV_SEND_INLINE`).
    Inline(&'a [u8]),
    /// Read by the NIC from registered memory.
    Sge(Sge),
    /// A message's bytes and its 4-byte trailer, copied into the WQE one
    /// after the other (`IBV_SEND_INLINE`; a message QP without immediate
    /// data).
    InlineTrailer(&'a [u8], [u8; 4]),
    /// A message's bytes and its 4-byte trailer, read by the NIC from two
    /// SGEs of registered memory (a message QP without immediate data).
    SgeTrailer(Sge, Sge),
    /// Read by the NIC from a scatter-gather list of registered memory, in
    /// order (at most the QP's `max_send_sge` entries).
    SgeList(&'a [Sge]),
}

impl SendPayload<'_> {
    /// SGEs it attaches to its WR.
    fn sge_count(&self) -> usize {
        match self {
            SendPayload::None => 0,
            SendPayload::Inline(_) | SendPayload::Sge(_) => 1,
            SendPayload::InlineTrailer(..) | SendPayload::SgeTrailer(..) => 2,
            SendPayload::SgeList(list) => list.len(),
        }
    }

    /// Writes its SGEs to the front of `out` (which has room for
    /// [`sge_count`](Self::sge_count)) and returns how many, adding
    /// `IBV_SEND_INLINE` to `flags` for inline data. An inline SGE names
    /// the caller's bytes (no lkey): `ibv_post_send` copies them into the
    /// WQE before it returns.
    fn write_sges(&self, out: &mut [ibv_sge], flags: &mut u32) -> usize {
        let inline = |d: &[u8]| ibv_sge {
            addr: d.as_ptr() as u64,
            length: d.len() as u32,
            lkey: 0,
        };
        match self {
            SendPayload::None => 0,
            SendPayload::Inline(data) => {
                *flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                out[0] = inline(data);
                1
            }
            SendPayload::InlineTrailer(data, trailer) => {
                *flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                out[0] = inline(data);
                out[1] = inline(trailer);
                2
            }
            SendPayload::Sge(sge) => {
                out[0] = sge.raw();
                1
            }
            SendPayload::SgeTrailer(data, trailer) => {
                out[0] = data.raw();
                out[1] = trailer.raw();
                2
            }
            SendPayload::SgeList(list) => {
                for (o, sge) in out.iter_mut().zip(list.iter()) {
                    *o = sge.raw();
                }
                list.len()
            }
        }
    }
}

/// WRs of one `ibv_post_send` call built on the stack; a longer batch
/// (remote memory's, a burst of messages) takes heap arrays. sideway's
/// post guard made four heap allocations for a WR with inline data (the
/// WR, its SGE, a copy of the data and the list of copies), 2.8 % of a
/// 64 B ping-pong client's CPU samples under icount
/// (benches/history/copies-under-icount-2026-12-07.md).
const STACK_WRS: usize = 4;

/// SGEs of those WRs on the stack.
const STACK_SGES: usize = 8;

/// Sets an RDMA READ or WRITE's opcode and remote range start.
fn set_rdma(r: &mut ibv_send_wr, opcode: u32, remote_addr: u64, rkey: u32) {
    r.opcode = opcode;
    r.wr.rdma.remote_addr = remote_addr;
    r.wr.rdma.rkey = rkey;
}

/// Sets an atomic's opcode and remote 8 bytes (its operands are the
/// caller's).
fn set_atomic(r: &mut ibv_send_wr, opcode: u32, remote_addr: u64, rkey: u32) {
    r.opcode = opcode;
    r.wr.atomic.remote_addr = remote_addr;
    r.wr.atomic.rkey = rkey;
}

/// Fills `raw` (one entry per WR of `wrs`, zeroed) and `sges` (room for
/// every WR's SGEs) and links them: each WR's `sg_list` names its SGEs in
/// `sges`, its `next` the WR after it.
fn fill_send_wrs(wrs: &[SendWr<'_>], raw: &mut [ibv_send_wr], sges: &mut [ibv_sge]) {
    use ibv_wr_opcode as op;
    let mut at = 0;
    for (w, r) in wrs.iter().zip(raw.iter_mut()) {
        r.wr_id = w.wr_id;
        let mut flags = if w.signaled {
            ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        if w.solicited
            && matches!(
                w.op,
                SendOp::SendImm { .. } | SendOp::WriteImm { .. } | SendOp::Send { .. }
            )
        {
            flags |= ibv_send_flags::IBV_SEND_SOLICITED.0;
        }
        let room = &mut sges[at..];
        // Matched by reference: an inline SGE names the bytes in `wrs`
        // (a trailer's array included), which live across the post; a
        // copy of the payload here would not.
        let n = match &w.op {
            SendOp::SendImm { payload, imm } => {
                r.opcode = op::IBV_WR_SEND_WITH_IMM;
                r.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                payload.write_sges(room, &mut flags)
            }
            SendOp::WriteImm {
                payload,
                remote_addr,
                rkey,
                imm,
            } => {
                set_rdma(r, op::IBV_WR_RDMA_WRITE_WITH_IMM, *remote_addr, *rkey);
                r.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                payload.write_sges(room, &mut flags)
            }
            SendOp::Read {
                local,
                remote_addr,
                rkey,
            } => {
                set_rdma(r, op::IBV_WR_RDMA_READ, *remote_addr, *rkey);
                SendPayload::Sge(*local).write_sges(room, &mut flags)
            }
            SendOp::ReadList {
                local,
                remote_addr,
                rkey,
            } => {
                set_rdma(r, op::IBV_WR_RDMA_READ, *remote_addr, *rkey);
                SendPayload::SgeList(local).write_sges(room, &mut flags)
            }
            SendOp::Write {
                payload,
                remote_addr,
                rkey,
            } => {
                set_rdma(r, op::IBV_WR_RDMA_WRITE, *remote_addr, *rkey);
                payload.write_sges(room, &mut flags)
            }
            SendOp::Send { payload } => {
                r.opcode = op::IBV_WR_SEND;
                payload.write_sges(room, &mut flags)
            }
            SendOp::CompareSwap {
                local,
                remote_addr,
                rkey,
                compare,
                swap,
            } => {
                set_atomic(r, op::IBV_WR_ATOMIC_CMP_AND_SWP, *remote_addr, *rkey);
                r.wr.atomic.compare_add = *compare;
                r.wr.atomic.swap = *swap;
                SendPayload::Sge(*local).write_sges(room, &mut flags)
            }
            SendOp::FetchAdd {
                local,
                remote_addr,
                rkey,
                add,
            } => {
                set_atomic(r, op::IBV_WR_ATOMIC_FETCH_AND_ADD, *remote_addr, *rkey);
                r.wr.atomic.compare_add = *add;
                SendPayload::Sge(*local).write_sges(room, &mut flags)
            }
        };
        r.send_flags = flags;
        r.num_sge = n as i32;
        at += n;
    }
    link_wrs(&mut raw[..wrs.len()], sges);
}

/// A send or receive WR as [`link_wrs`] links it.
trait ChainedWr {
    fn num_sge(&self) -> usize;
    fn link(&mut self, next: *mut Self, sg_list: *mut ibv_sge);
}

impl ChainedWr for ibv_send_wr {
    fn num_sge(&self) -> usize {
        usize::try_from(self.num_sge).unwrap_or(0)
    }
    fn link(&mut self, next: *mut Self, sg_list: *mut ibv_sge) {
        (self.next, self.sg_list) = (next, sg_list);
    }
}

impl ChainedWr for ibv_recv_wr {
    fn num_sge(&self) -> usize {
        usize::try_from(self.num_sge).unwrap_or(0)
    }
    fn link(&mut self, next: *mut Self, sg_list: *mut ibv_sge) {
        (self.next, self.sg_list) = (next, sg_list);
    }
}

/// Links the filled WRs `raw`, once everything is written, from one
/// pointer into each array: each WR's `next` names the WR after it (the
/// last none), its `sg_list` its `num_sge` SGEs, which lie in `sges` one
/// WR after the other.
fn link_wrs<W: ChainedWr>(raw: &mut [W], sges: &mut [ibv_sge]) {
    let n = raw.len();
    let base = raw.as_mut_ptr();
    let sge_base = sges.as_mut_ptr();
    let mut at = 0;
    for i in 0..n {
        // SAFETY: `i < n == raw.len()`, and `raw` itself is not used again
        // while this reference lives: every access goes through `base`.
        let r = unsafe { &mut *base.add(i) };
        let k = r.num_sge();
        let next = if i + 1 < n {
            // SAFETY: `i + 1 < n`: inside `raw`.
            unsafe { base.add(i + 1) }
        } else {
            std::ptr::null_mut()
        };
        let sg_list = if k > 0 && at + k <= sges.len() {
            // SAFETY: `at + k <= sges.len()`: inside `sges`.
            unsafe { sge_base.add(at) }
        } else {
            std::ptr::null_mut()
        };
        // Stored only; read by `ibv_post_send`/`ibv_post_recv` while
        // both arrays live.
        r.link(next, sg_list);
        at += k;
    }
}

/// Receive WRs of one `ibv_post_recv` call built on the stack.
const STACK_RECVS: usize = 8;

/// Fills the first `n` entries of `raw` with `wr(i)` (wr_id and at most
/// one SGE, written to `sges` one after the other) and links them: `raw`
/// and `sges` have room for `n`.
fn fill_recv_wrs(
    n: usize,
    wr: &impl Fn(usize) -> (u64, Option<Sge>),
    raw: &mut [ibv_recv_wr],
    sges: &mut [ibv_sge],
) {
    let n = n.min(raw.len());
    let mut at = 0;
    for (i, r) in raw.iter_mut().take(n).enumerate() {
        let (wr_id, sge) = wr(i);
        r.wr_id = wr_id;
        r.num_sge = 0;
        if let Some(sge) = sge {
            sges[at] = sge.raw();
            r.num_sge = 1;
            at += 1;
        }
    }
    link_wrs(&mut raw[..n], sges);
}

/// One send-queue WR for [`RcQueuePair::post_send_batch`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendWr<'a> {
    pub wr_id: u64,
    pub signaled: bool,
    /// `IBV_SEND_SOLICITED` (a WR that consumes a receive WR at the peer:
    /// a SEND or an RDMA WRITE WITH IMM; see `RcQueuePair::arm`).
    pub solicited: bool,
    pub op: SendOp<'a>,
}

/// The operation of a [`SendWr`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum SendOp<'a> {
    /// SEND WITH IMMEDIATE (`imm` in host order).
    SendImm { payload: SendPayload<'a>, imm: u32 },
    /// RDMA WRITE WITH IMMEDIATE of `payload` to `remote_addr` (`imm` in
    /// host order): consumes one receive WR at the peer.
    WriteImm {
        payload: SendPayload<'a>,
        remote_addr: u64,
        rkey: u32,
        imm: u32,
    },
    /// RDMA READ of `local.len` bytes from `remote_addr` into `local`.
    Read {
        local: Sge,
        remote_addr: u64,
        rkey: u32,
    },
    /// RDMA READ of the list's total length from `remote_addr`, scattered
    /// over `local` in order (at most the QP's `max_send_sge` and the
    /// device's `max_sge_rd` entries).
    ReadList {
        local: &'a [Sge],
        remote_addr: u64,
        rkey: u32,
    },
    /// RDMA WRITE of `payload` to `remote_addr` (no immediate data; no
    /// receive WR consumed at the peer).
    Write {
        payload: SendPayload<'a>,
        remote_addr: u64,
        rkey: u32,
    },
    /// SEND of `payload` (no immediate data): consumes one receive WR at
    /// the peer, where it lands in that WR's buffer.
    Send { payload: SendPayload<'a> },
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

impl SendOp<'_> {
    /// SGEs its WR carries.
    fn sge_count(&self) -> usize {
        match self {
            SendOp::SendImm { payload, .. }
            | SendOp::WriteImm { payload, .. }
            | SendOp::Write { payload, .. }
            | SendOp::Send { payload } => payload.sge_count(),
            SendOp::ReadList { local, .. } => local.len(),
            SendOp::Read { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => 1,
        }
    }
}

/// An RC QP and its CQ (reporting to a completion channel of its own or
/// its runtime's, see [`super::events`]).
pub(crate) struct RcQueuePair {
    // Drop order: the QP (in Drop, then the CQ's route), the CQ (or its
    // seat on a shared one), its completion channel (or the hub's
    // reference), the PD of its own.
    /// Destroyed first in Drop (before the CQ is polled a last time).
    qp: ManuallyDrop<BasicQueuePair>,
    qp_num: u32,
    cq: QpCq,
    events: Arc<CqEvents>,
    /// Keepalive or delivery probes posted whose completions were not
    /// polled yet.
    probes_outstanding: u32,
    /// Completions polled so far (every kind, in error or not): the
    /// driver's measure of progress for the keepalive.
    completions_polled: u64,
    /// The agreed path MTU in bytes once in RTR ([`Self::path_mtu`]).
    path_mtu: u32,
    /// The device port rdma_cm bound the QP to (0 before INIT).
    port: u8,
    /// This side connected (rdma_cm's active side), rather than accepted.
    initiator: bool,
    /// A receive WR completed successfully: the peer has sent a frame.
    heard_from_peer: bool,
    max_inline: u32,
    /// Send SGEs per WR the QP was created with.
    max_send_sge: u32,
    /// The QP is on a PD of its own (`RcSizes::own_pd_without_windows` on
    /// a device without windows), not the device's.
    own_pd: bool,
    pd: ParentOnly<Arc<ProtectionDomain>>,
    device: Arc<OpenDevice>,
    /// QP and (with a PD of its own) the PD.
    _counted: Vec<Counted>,
}

/// The memory a window is bound over: `len` bytes at virtual address
/// `addr` of the memory region whose `ibv_mr` is at address `mr`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BindTarget {
    pub mr: usize,
    pub addr: u64,
    pub len: u64,
}

impl RcQueuePair {
    /// Creates the CQ (on a completion channel of its own, or the current
    /// tokio runtime's for the device: [`CqEvents::new`]) and the QP in
    /// RESET. Must run on a tokio runtime.
    pub(crate) fn new(device: Arc<OpenDevice>, sizes: RcSizes) -> Result<Self> {
        crate::verbs::fork::check("ibv_create_qp")?;
        let limits = &device.limits;
        let events = CqEvents::new(&device, sizes.share_cq)?;
        let mut counted = Vec::with_capacity(2);
        let imm_in_send = sizes.imm_in_send_without_immediate && !device.immediate_data;
        let trailer = sizes.trailer_without_immediate && !device.immediate_data;
        let (send_depth, max_inline) = if imm_in_send {
            (sizes.send_depth.saturating_mul(2), sizes.max_inline.max(4))
        } else if trailer {
            (sizes.send_depth, sizes.max_inline.max(TRAILER_INLINE_MIN))
        } else {
            (sizes.send_depth, sizes.max_inline)
        };
        let max_send_sge = sizes
            .max_send_sge
            .max(if trailer { 2 } else { 1 })
            .min(device.max_sge.max(1));
        let entries = send_depth + sizes.recv_depth + 16;
        let cq = QpCq::new(&device, &events, entries, sizes.share_cq)?;
        let own_pd = sizes.own_pd_without_windows && !device.has_memory_windows();
        let pd = if own_pd {
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
            .setup_max_send_wr(send_depth)
            .setup_max_recv_wr(sizes.recv_depth)
            .setup_max_send_sge(max_send_sge)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(max_inline)
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
        let qp_num = qp.qp_number();
        // Completions on a shared CQ reach this QP from now on (it is in
        // RESET: none can come before). Nothing fails after this.
        cq.route(qp_num);
        Ok(RcQueuePair {
            qp: ManuallyDrop::new(qp),
            qp_num,
            cq,
            events: Arc::new(events),
            probes_outstanding: 0,
            completions_polled: 0,
            path_mtu: 0,
            port: 0,
            initiator: false,
            heard_from_peer: false,
            max_inline,
            max_send_sge,
            own_pd,
            pd: ParentOnly::new(pd),
            device,
            _counted: counted,
        })
    }

    /// Whether the QP is on a PD of its own (see
    /// [`RcSizes::own_pd_without_windows`]).
    pub(crate) fn has_own_pd(&self) -> bool {
        self.own_pd
    }

    /// This QP's PD: its own on a device without windows when
    /// [`RcSizes::own_pd_without_windows`] asked for it, the device's
    /// otherwise.
    pub(crate) fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// Registers exactly `len` bytes at `addr` with `access`, which may
    /// open them to the peer, on this QP's PD of its own; `None` on a QP
    /// on the device's shared PD (where a remote key would reach the
    /// memory from every QP of the process).
    ///
    /// # Errors
    /// [`Error::Verbs`] (`ibv_reg_mr`) when the provider refuses.
    ///
    /// # Safety
    /// The memory must stay valid (and not be freed or reused) until the
    /// registration is dropped; the NIC may write it when `access` allows
    /// writes.
    pub(crate) unsafe fn register_scoped(
        &self,
        addr: u64,
        len: usize,
        access: MrAccess,
    ) -> Result<Option<MemoryRegistration>> {
        if !self.own_pd {
            return Ok(None);
        }
        let Some(ptr) = NonNull::new(addr as *mut u8) else {
            return Err(Error::Internal("registration of a null address".into()));
        };
        // SAFETY: forwarded to the caller.
        unsafe { MemoryRegistration::on_pd(&self.device, &self.pd, ptr, len.max(1), access) }
            .map(Some)
            .map_err(|source| Error::Verbs {
                op: "ibv_reg_mr",
                source,
            })
    }

    /// Allocates and registers `len` bytes with `access` on this QP's PD
    /// ([`RegisteredBuffer::new`]). The caller keeps it until the QP is
    /// destroyed or no posted WR names it.
    pub(crate) fn register_buffer(&self, len: usize, access: MrAccess) -> Result<RegisteredBuffer> {
        RegisteredBuffer::new(&self.pd, len, access, &self.device.limits)
    }

    /// The device this QP is on.
    pub(crate) fn device(&self) -> &Arc<OpenDevice> {
        &self.device
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
        crate::verbs::fork::check("ibv_post_send")?;
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

    /// Scatter-gather entries one send WR may carry (the QP's
    /// `max_send_sge`).
    pub(crate) fn max_send_sge(&self) -> u32 {
        self.max_send_sge
    }

    /// Scatter-gather entries one RDMA READ WR may carry: the QP's
    /// `max_send_sge` and at most the device's `max_sge_rd`.
    pub(crate) fn max_read_sge(&self) -> u32 {
        self.max_send_sge.min(self.device.max_sge_rd)
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
        crate::verbs::fork::check("ibv_modify_qp")?;
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
        self.port = id.port_num();
        self.modify_from_cm(id, ibv_qp_state::IBV_QPS_INIT)
    }

    /// The error a failed work request of this QP reports: `err`, or
    /// [`Error::PortDown`] if the QP's port is down now, the cause that
    /// names what to fix. Soft-RoCE fails every send at once while its
    /// netdev is down (the WR completes with `LOC_QP_OP_ERR` instead of
    /// being retransmitted), so a connection that sends during an outage
    /// fails before the port watch's retry bound; a hardware NIC keeps
    /// retransmitting, and the watch fails the connection with `PortDown`
    /// once the port stayed down for the bound.
    pub(crate) fn wr_failure(&self, err: Error) -> Error {
        if self.port == 0 || !matches!(err, Error::WorkCompletion { .. }) {
            return err;
        }
        self.device.port_down_error(self.port).unwrap_or(err)
    }

    /// Moves the QP to RTR (ready to receive) with rdma_cm's attributes,
    /// but the path MTU both sides agree on
    /// ([`agree_path_mtu`](crate::proto::handshake::agree_path_mtu) of
    /// rdma_cm's, `ours`, the MTU this side announced (its port's,
    /// [`OpenDevice::port_path_mtu`]) and `peer_mtu`, the peer's announced
    /// one, in bytes, 0 if none). Where rdma_cm sets no path MTU (iWARP)
    /// nothing is changed and [`path_mtu`](Self::path_mtu) stays 0.
    pub(crate) fn modify_to_rtr(&mut self, id: &CmId, ours: u32, peer_mtu: u32) -> Result<()> {
        use crate::proto::handshake::{agree_path_mtu, mtu_bytes, mtu_code};
        let (mut attr, mask) = id.init_qp_attr(ibv_qp_state::IBV_QPS_RTR)?;
        let path_mtu_bit = rdma_mummy_sys::ibv_qp_attr_mask::IBV_QP_PATH_MTU.0 as i32;
        let mut agreed = 0;
        if mask & path_mtu_bit != 0 {
            let route = u8::try_from(attr.path_mtu)
                .ok()
                .and_then(mtu_bytes)
                .unwrap_or(0);
            agreed = agree_path_mtu(route, ours, peer_mtu);
            if let Some(code) = mtu_code(agreed).filter(|&c| c != 0) {
                attr.path_mtu = code.into();
            }
            tracing::debug!(route, ours, peer = peer_mtu, agreed, "path MTU");
        }
        self.modify(&mut attr, mask)?;
        self.path_mtu = agreed;
        Ok(())
    }

    /// The path MTU the QP uses, bytes (256..=4096; the RDMA payload of
    /// each packet but a message's last), set when it moved to RTR; 0
    /// before that and on iWARP.
    pub(crate) fn path_mtu(&self) -> u32 {
        self.path_mtu
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

    /// Posts a probe of the peer: a signaled zero-length RDMA WRITE (no
    /// data, no immediate: it consumes no receive WR at the peer, and IBTA
    /// C9-88 lets a zero-length operation carry no valid key). A peer that
    /// is gone never acknowledges it, so it completes with RETRY_EXC_ERR
    /// after the retry bound. On a device whose send completions come at
    /// transmit ([`OpenDevice::completes_at_transmit`], iWARP) the WRITE
    /// would complete whether or not the peer is there, so the probe is a
    /// zero-length RDMA READ instead: its completion is the peer's READ
    /// response, which the peer sends only after it processed every WR
    /// posted before the READ (RFC 5040 section 5.5), so it also confirms
    /// their delivery. (One zero-length SGE: siw requires exactly one
    /// SGE for a READ, checks no key for a zero-length one on either side
    /// and sends a response with no payload.) Used for keepalive
    /// ([`Driven::probe`]) and before a clean disconnect on iWARP.
    ///
    /// # Errors
    /// [`Error::Verbs`] with the errno if posting fails.
    ///
    /// [`Driven::probe`]: crate::conn::shared::Driven::probe
    pub(crate) fn post_probe(&mut self) -> Result<()> {
        if self.awaiting_initiator() {
            // Nothing may go out yet; the peer is there (it connected).
            return Ok(());
        }
        let read = self.device.completes_at_transmit;
        let opcode = if read {
            ibv_wr_opcode::IBV_WR_RDMA_READ
        } else {
            ibv_wr_opcode::IBV_WR_RDMA_WRITE
        };
        let mut wr = Self::raw_send_wr(Work::Probe.wr_id(), opcode, true);
        let mut sge = ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        if read {
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
        }
        // SAFETY: the WR names no memory: no SGE, or one of zero bytes
        // (which the NIC neither reads nor writes); `sge` outlives the
        // call.
        unsafe { self.post_raw(&mut wr, "ibv_post_send (probe)") }?;
        self.probes_outstanding += 1;
        Ok(())
    }

    /// Marks this QP's side as the connection's initiator (rdma_cm's
    /// active side); an accepted QP is the responder.
    pub(crate) fn set_initiator(&mut self) {
        self.initiator = true;
    }

    /// Whether this side must post nothing yet: the responder on a device
    /// whose initiator sends first ([`OpenDevice::initiator_sends_first`],
    /// iWARP) before its first receive completed. The QP adapters leave
    /// their work queued in the protocol core until then, and
    /// [`post_probe`](Self::post_probe) posts nothing.
    pub(crate) fn awaiting_initiator(&self) -> bool {
        self.device.initiator_sends_first && !self.initiator && !self.heard_from_peer
    }

    /// Whether this side must send the connection's first frame at once,
    /// whatever its application does: the initiator on a device whose
    /// initiator sends first (the core's `speak_first`).
    pub(crate) fn speaks_first(&self) -> bool {
        self.device.initiator_sends_first && self.initiator
    }

    /// What a probe is, to name it in an error.
    pub(crate) fn probe_op(&self) -> &'static str {
        if self.device.completes_at_transmit {
            "keepalive probe (zero-length RDMA READ)"
        } else {
            "keepalive probe (zero-length RDMA WRITE)"
        }
    }

    /// Whether a completion only says a WR was handed to the transport
    /// ([`OpenDevice::completes_at_transmit`]): then a clean close first
    /// waits for a probe, so the peer has every byte before the
    /// disconnect (Soft-iWARP closes its TCP socket at once on
    /// disconnect, and the peer lost what was still in flight).
    pub(crate) fn completes_at_transmit(&self) -> bool {
        self.device.completes_at_transmit
    }

    /// Completions polled from this QP's CQ so far (every kind, in error
    /// or not); it grows whenever the QP made progress.
    pub(crate) fn completions_polled(&self) -> u64 {
        self.completions_polled
    }

    /// Whether a probe has neither completed nor failed yet (its
    /// completion was not polled).
    pub(crate) fn probe_outstanding(&self) -> bool {
        self.probes_outstanding > 0
    }

    /// The QP's state as the device reports it (`ibv_query_qp`), for the
    /// guest suite's diagnostics.
    #[cfg(tokio_rdma_guest)]
    pub(crate) fn queried_state(&self) -> String {
        use sideway::ibverbs::queue_pair::QueuePairAttributeMask;
        match self.qp.query(QueuePairAttributeMask::State) {
            Ok((attr, _)) => format!("{:?}", attr.state()),
            Err(e) => format!("query failed: {e}"),
        }
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
        crate::verbs::fork::check("ibv_post_recv")?;
        let wr_id = Work::Recv(0).wr_id();
        // SAFETY: no SGE: nothing is written to memory.
        unsafe { self.post_recv_list(n as usize, |_| (wr_id, None)) }
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
        crate::verbs::fork::check("ibv_post_recv")?;
        // SAFETY: the caller guarantees each SGE's memory (see above).
        unsafe { self.post_recv_list(wrs.len(), |i| (wrs[i].0, Some(wrs[i].1))) }
    }

    /// Posts `n` receive WRs, the `i`th `wr(i)` (its wr_id and at most one
    /// SGE), with one `ibv_post_recv` call; up to [`STACK_RECVS`] built on
    /// the stack (sideway's guard made two heap allocations per call).
    ///
    /// # Safety
    /// As [`post_recv_sges`](Self::post_recv_sges) for every SGE given.
    unsafe fn post_recv_list(
        &mut self,
        n: usize,
        wr: impl Fn(usize) -> (u64, Option<Sge>),
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let empty_wr = ibv_recv_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        let empty_sge = ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        // SAFETY: only the address is taken, used below while `self` (and
        // so the QP) lives.
        let qp = unsafe { self.qp.qp() }.as_ptr();
        let post = |raw: &mut [ibv_recv_wr], sges: &mut [ibv_sge]| {
            fill_recv_wrs(n, &wr, raw, sges);
            let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
            // SAFETY: valid QP; `raw` holds `n` linked, initialised WRs
            // whose SGEs lie in `sges`, both live across the call; the
            // memory the SGEs name is the caller's promise.
            let ret = unsafe { ibv_post_recv(qp, raw.as_mut_ptr(), &mut bad) };
            if ret != 0 {
                return Err(Error::Verbs {
                    op: "ibv_post_recv",
                    source: io::Error::from_raw_os_error(ret),
                });
            }
            Ok(())
        };
        if n <= STACK_RECVS {
            post(&mut [empty_wr; STACK_RECVS], &mut [empty_sge; STACK_RECVS])
        } else {
            post(&mut vec![empty_wr; n], &mut vec![empty_sge; n])
        }
    }

    /// Posts `wrs` (SEND and RDMA WRITE WITH IMM, RDMA READ and WRITE,
    /// atomics) with one `ibv_post_send` call: one doorbell for the whole
    /// batch.
    ///
    /// # Safety
    ///
    /// Every SGE must name memory registered under its lkey on this QP's PD
    /// that stays allocated until its WR completes (or is flushed), and that
    /// the program does not touch while a READ writes it.
    pub(crate) unsafe fn post_send_batch(&mut self, wrs: &[SendWr<'_>]) -> Result<()> {
        crate::verbs::fork::check("ibv_post_send")?;
        if wrs.is_empty() {
            return Ok(());
        }
        let n_sges: usize = wrs.iter().map(|w| w.op.sge_count()).sum();
        let zero_wr = || -> ibv_send_wr {
            // SAFETY: ibv_send_wr is plain data (pointers, integers, unions
            // of them); all-zero is a valid value that `fill_send_wrs`
            // completes.
            unsafe { std::mem::zeroed() }
        };
        let zero_sge = ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        if wrs.len() <= STACK_WRS && n_sges <= STACK_SGES {
            let mut raw: [ibv_send_wr; STACK_WRS] = std::array::from_fn(|_| zero_wr());
            let mut sges = [zero_sge; STACK_SGES];
            fill_send_wrs(wrs, &mut raw, &mut sges);
            // SAFETY: the WRs and the SGEs they name live across the call;
            // the memory the SGEs name is the caller's promise (inline
            // bytes are borrowed by `wrs` for this call).
            return unsafe { self.post_linked(&mut raw[0]) };
        }
        let mut raw: Vec<ibv_send_wr> = (0..wrs.len()).map(|_| zero_wr()).collect();
        let mut sges = vec![zero_sge; n_sges];
        fill_send_wrs(wrs, &mut raw, &mut sges);
        // SAFETY: as above.
        unsafe { self.post_linked(&mut raw[0]) }
    }

    /// `ibv_post_send` of the WR list starting at `first`.
    ///
    /// # Safety
    /// `first` and the WRs and SGEs it links to are fully initialised and
    /// live across the call, as does the memory their SGEs name (the
    /// caller of [`post_send_batch`](Self::post_send_batch) guarantees it).
    unsafe fn post_linked(&mut self, first: &mut ibv_send_wr) -> Result<()> {
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: valid QP; the list is the caller's promise (see above).
        let ret = unsafe { ibv_post_send(self.qp.qp().as_ptr(), first, &mut bad) };
        if ret != 0 {
            return Err(Error::Verbs {
                op: "ibv_post_send",
                source: io::Error::from_raw_os_error(ret),
            });
        }
        Ok(())
    }

    /// Moves this QP's completions into `out` without blocking (its own
    /// CQ, or its share of a shared one: [`QpCq::poll`]).
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_poll_cq` fails.
    pub(crate) fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        let start = out.len();
        let polled = self.cq.poll(self.qp_num, out);
        self.completions_polled += (out.len() - start) as u64;
        if !self.heard_from_peer {
            self.heard_from_peer = out[start..]
                .iter()
                .any(|wc| matches!(wc.work, Work::Recv(_)) && wc.ok());
        }
        let probes = out[start..]
            .iter()
            .filter(|wc| wc.work == Work::Probe)
            .count();
        self.probes_outstanding = self
            .probes_outstanding
            .saturating_sub(u32::try_from(probes).unwrap_or(u32::MAX));
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
    /// one until the event fires (rxe keeps the wider request). On a
    /// device whose solicited events do not fire for receives (siw:
    /// [`OpenDevice::solicited_events`]) it always arms for every
    /// completion.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_req_notify_cq` fails.
    pub(crate) fn arm(&self, solicited_only: bool) -> Result<()> {
        self.cq.arm(solicited_only && self.device.solicited_events)
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
        if crate::verbs::fork::inherited() {
            return; // the parent's QP: leaked (its CQ and PD are `ParentOnly`)
        }
        // Only once the QP is destroyed (no completion of it can come any
        // more) is a shared CQ polled a last time and the route removed.
        let qp = &mut self.qp;
        self.cq.unroute_after(self.qp_num, || {
            // SAFETY: the QP is dropped exactly once, here; no method runs
            // on `self` after Drop. The CQ it reports to is a field dropped
            // after it; memory its WRs name belongs to the QP adapter that
            // owns this value, which drops it first (field order).
            unsafe { ManuallyDrop::drop(qp) }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{
        SendOp, SendPayload, SendWr, Sge, WcStatus, Work, fill_recv_wrs, fill_send_wrs,
        ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode,
    };

    fn zero_wr() -> ibv_send_wr {
        // SAFETY: plain data; all-zero is valid.
        unsafe { std::mem::zeroed() }
    }

    const NO_SGE: ibv_sge = ibv_sge {
        addr: 0,
        length: 0,
        lkey: 0,
    };

    /// Three WRs: an inline WRITE WITH IMM, a SEND of data and a trailer
    /// from two SGEs, and a READ: each gets its opcode, flags, remote
    /// fields and SGEs, linked in order, and an inline SGE names the
    /// caller's bytes themselves.
    #[test]
    fn send_wrs_are_filled_and_linked_in_order() {
        let data = [7u8; 24];
        let sge = |addr, len, lkey| Sge { addr, len, lkey };
        let wrs = [
            SendWr {
                wr_id: 11,
                signaled: true,
                solicited: true,
                op: SendOp::WriteImm {
                    payload: SendPayload::InlineTrailer(&data, [1, 2, 3, 4]),
                    remote_addr: 0x1000,
                    rkey: 0x55,
                    imm: 0x0102_0304,
                },
            },
            SendWr {
                wr_id: 12,
                signaled: false,
                solicited: true,
                op: SendOp::SendImm {
                    payload: SendPayload::SgeTrailer(sge(0x2000, 100, 9), sge(0x3000, 4, 9)),
                    imm: 5,
                },
            },
            SendWr {
                wr_id: 13,
                signaled: true,
                // A READ consumes no receive WR: never solicited.
                solicited: true,
                op: SendOp::Read {
                    local: sge(0x4000, 64, 8),
                    remote_addr: 0x5000,
                    rkey: 0x66,
                },
            },
        ];
        let mut raw: [ibv_send_wr; 4] = std::array::from_fn(|_| zero_wr());
        let mut sges = [NO_SGE; 8];
        fill_send_wrs(&wrs, &mut raw, &mut sges);
        let base = raw.as_ptr();
        let sge_base = sges.as_ptr();
        let (signaled, solicited, inline) = (
            ibv_send_flags::IBV_SEND_SIGNALED.0,
            ibv_send_flags::IBV_SEND_SOLICITED.0,
            ibv_send_flags::IBV_SEND_INLINE.0,
        );

        assert_eq!(raw[0].wr_id, 11);
        assert_eq!(raw[0].opcode, ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!(raw[0].send_flags, signaled | solicited | inline);
        // SAFETY (union reads): both members are integers set above.
        assert_eq!(unsafe { raw[0].wr.rdma.remote_addr }, 0x1000);
        assert_eq!(unsafe { raw[0].wr.rdma.rkey }, 0x55);
        assert_eq!(
            unsafe { raw[0].imm_data_invalidated_rkey_union.imm_data },
            0x0102_0304u32.to_be()
        );
        assert_eq!(raw[0].num_sge, 2);
        assert_eq!(raw[0].sg_list.cast_const(), sge_base);
        assert_eq!(raw[0].next.cast_const(), base.wrapping_add(1));
        assert_eq!((sges[0].addr, sges[0].length), (data.as_ptr() as u64, 24));
        // The trailer's SGE names the array inside `wrs`, which outlives
        // the post.
        let SendOp::WriteImm {
            payload: SendPayload::InlineTrailer(_, trailer),
            ..
        } = &wrs[0].op
        else {
            unreachable!()
        };
        assert_eq!((sges[1].addr, sges[1].length), (trailer.as_ptr() as u64, 4));

        assert_eq!(raw[1].wr_id, 12);
        assert_eq!(raw[1].opcode, ibv_wr_opcode::IBV_WR_SEND_WITH_IMM);
        assert_eq!(raw[1].send_flags, solicited);
        assert_eq!(raw[1].num_sge, 2);
        assert_eq!(raw[1].sg_list.cast_const(), sge_base.wrapping_add(2));
        assert_eq!(raw[1].next.cast_const(), base.wrapping_add(2));
        assert_eq!(
            [
                (sges[2].addr, sges[2].length, sges[2].lkey),
                (sges[3].addr, sges[3].length, sges[3].lkey)
            ],
            [(0x2000, 100, 9), (0x3000, 4, 9)]
        );

        assert_eq!(raw[2].wr_id, 13);
        assert_eq!(raw[2].opcode, ibv_wr_opcode::IBV_WR_RDMA_READ);
        assert_eq!(raw[2].send_flags, signaled);
        assert_eq!(unsafe { raw[2].wr.rdma.remote_addr }, 0x5000);
        assert_eq!(unsafe { raw[2].wr.rdma.rkey }, 0x66);
        assert_eq!(raw[2].num_sge, 1);
        assert_eq!(raw[2].sg_list.cast_const(), sge_base.wrapping_add(4));
        assert!(raw[2].next.is_null(), "the last WR ends the list");
        assert_eq!(
            (sges[4].addr, sges[4].length, sges[4].lkey),
            (0x4000, 64, 8)
        );
        // Nothing written past the WRs' SGEs.
        assert_eq!(sges[5].addr, 0);
    }

    /// Atomics carry their operands, and a WR without payload has no SGE.
    #[test]
    fn atomics_and_payloadless_wrs_are_filled() {
        let local = Sge {
            addr: 0x10,
            len: 8,
            lkey: 3,
        };
        let wrs = [
            SendWr {
                wr_id: 1,
                signaled: true,
                solicited: false,
                op: SendOp::CompareSwap {
                    local,
                    remote_addr: 0x20,
                    rkey: 4,
                    compare: 5,
                    swap: 6,
                },
            },
            SendWr {
                wr_id: 2,
                signaled: true,
                solicited: false,
                op: SendOp::FetchAdd {
                    local,
                    remote_addr: 0x28,
                    rkey: 4,
                    add: 9,
                },
            },
            SendWr {
                wr_id: 3,
                signaled: false,
                solicited: true,
                op: SendOp::WriteImm {
                    payload: SendPayload::None,
                    remote_addr: 0,
                    rkey: 0,
                    imm: 77,
                },
            },
        ];
        let mut raw: [ibv_send_wr; 3] = std::array::from_fn(|_| zero_wr());
        let mut sges = [NO_SGE; 2];
        fill_send_wrs(&wrs, &mut raw, &mut sges);
        assert_eq!(raw[0].opcode, ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP);
        // SAFETY (union reads): integers set above.
        let a = unsafe { raw[0].wr.atomic };
        assert_eq!(
            (a.remote_addr, a.rkey, a.compare_add, a.swap),
            (0x20, 4, 5, 6)
        );
        assert_eq!(raw[1].opcode, ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD);
        let a = unsafe { raw[1].wr.atomic };
        assert_eq!((a.remote_addr, a.rkey, a.compare_add), (0x28, 4, 9));
        assert_eq!((raw[0].num_sge, raw[1].num_sge, raw[2].num_sge), (1, 1, 0));
        assert_eq!(raw[1].sg_list.cast_const(), sges.as_ptr().wrapping_add(1));
        assert!(raw[2].sg_list.is_null());
        assert_eq!(
            raw[2].send_flags,
            ibv_send_flags::IBV_SEND_SOLICITED.0,
            "a zero-length WRITE WITH IMM is solicited, not inline"
        );
    }

    /// Receive WRs: each wr_id and at most one SGE, linked.
    #[test]
    fn recv_wrs_are_filled_and_linked() {
        let empty = ibv_recv_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        let mut raw = [empty; 4];
        let mut sges = [NO_SGE; 4];
        let wr = |i: usize| {
            let sge = (i != 1).then_some(Sge {
                addr: 0x100 * i as u64,
                len: 32,
                lkey: 2,
            });
            (40 + i as u64, sge)
        };
        fill_recv_wrs(3, &wr, &mut raw, &mut sges);
        assert_eq!(
            raw.iter().map(|r| (r.wr_id, r.num_sge)).collect::<Vec<_>>(),
            [(40, 1), (41, 0), (42, 1), (0, 0)]
        );
        let base = raw.as_ptr();
        assert_eq!(raw[0].next.cast_const(), base.wrapping_add(1));
        assert_eq!(raw[1].next.cast_const(), base.wrapping_add(2));
        assert!(raw[2].next.is_null());
        assert_eq!(raw[0].sg_list.cast_const(), sges.as_ptr());
        assert!(raw[1].sg_list.is_null());
        // The SGEs lie one after the other: WR 2's is the second.
        assert_eq!(raw[2].sg_list.cast_const(), sges.as_ptr().wrapping_add(1));
        assert_eq!((sges[1].addr, sges[1].length, sges[1].lkey), (0x200, 32, 2));
        assert_eq!(sges[2].addr, 0, "nothing written past the SGEs");
    }

    #[test]
    fn every_work_space_decodes_to_itself() {
        for n in [0, 1, 2, 0xF0, (1 << 60) - 1] {
            for w in [
                Work::Core(n),
                Work::Recv(n),
                Work::Window(n),
                Work::Remote(n),
            ] {
                assert_eq!(Work::of_wr_id(w.wr_id()), w, "{w:?}");
            }
        }
        assert_eq!(Work::of_wr_id(Work::Probe.wr_id()), Work::Probe);
        assert_eq!(
            Work::Core(7).wr_id(),
            7,
            "the core's numbers are its wr_ids"
        );
    }

    #[test]
    fn status_codes_round_trip() {
        assert_eq!(WcStatus::from_code(0), WcStatus::Success);
        assert_eq!(WcStatus::from_code(5), WcStatus::Flushed);
        assert_eq!(WcStatus::from_code(12), WcStatus::Failed(12));
        for code in 0..32 {
            assert_eq!(WcStatus::from_code(code).code(), code);
        }
    }
}
