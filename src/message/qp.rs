//! The queue pair of a message endpoint, owning every buffer the NIC may
//! touch: receive buffers while posted, rendezvous destinations while an
//! RDMA READ into them is outstanding, and the messages being sent.
//!
//! Buffers are named by the runtime's tokens (those of
//! `MessageCore`). The runtime can only
//! take a buffer back once the NIC is done with it: a receive buffer after
//! its completion, a destination once no READ into it is outstanding. What
//! the runtime gives up while a posted WR still names it (a message the
//! core reclaimed at an abort while its SEND is posted, a destination whose
//! READ is in flight) goes to the send queue's [`Ledger`], which frees it at
//! that WR's completion or flush. So the `unsafe` of posting work requests
//! (WRs) with scatter/gather elements (SGEs) stays here, in the one module
//! of the message runtime that opts into `unsafe` (a scoped `allow`, each
//! block with its `SAFETY:` comment). Field order makes the QP be destroyed
//! before any buffer is freed.

use std::collections::HashMap;
use std::task::{Context, Poll, Waker};

use crate::error::{Error, Result};
use crate::pool::{OutgoingMessage, PoolBuf};
use crate::proto::message::{
    MessageError, MsgTransmit, MsgTransmitKind, RTS_HEADER_LEN, RtsHeader, TRAILER_LEN,
    encode_trailer, notify_length, split_trailer,
};
use crate::remote::{GrantAccess, LocalRegion};
use crate::verbs::ledger::{Ledger, PostedOp};
use crate::verbs::mw::{MemoryWindow, WindowAccess};
use crate::verbs::rc::{
    BindTarget, MemoryRegistration, MrAccess, RcQueuePair, RegisteredBuffer, SendOp, SendPayload,
    SendWr, Sge, WcStatus, Work,
};

/// Send-queue slots kept for remote-memory work (one-sided operations,
/// grant binds and revocations) beyond the protocol core's: at most this
/// many such WRs are posted at once; more wait for a slot. 32: a batch
/// of [`MAX_TRANSFER_BATCH`](crate::remote::MAX_TRANSFER_BATCH) takes
/// them all.
pub(crate) const REMOTE_SLOTS: u16 = 32;

/// Memory windows one connection may hold for grants at once (its quota;
/// a device has a few thousand: rxe 8,192 by default).
pub(crate) const MAX_GRANTS: usize = 64;

/// Bytes of scratch per send-queue slot for an RTS header that is not
/// posted inline.
const RTS_SLOT: usize = 32;

/// The SGE of the last data WR posted (a SEND with payload or a READ), for
/// the zero-copy checks of the guest test suite (recorded only in its
/// builds).
#[cfg(tokio_rdma_guest)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PostedSge {
    /// Virtual address the NIC reads (SEND) or writes (READ).
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// Local key.
    pub lkey: u32,
}

pub(crate) struct MessageQp {
    // Dropped first: windows are deallocated before the QP they are bound
    // to and before the memory regions under them; then the QP is
    // destroyed before the buffers below.
    windows: Windows,
    /// Windows bound for grants (`crate::remote`), by grant id: dropped
    /// (deallocated, so their keys die) before the QP and the regions.
    grant_windows: HashMap<u64, MemoryWindow>,
    /// Without memory windows (a QP on a PD of its own): the memory
    /// regions whose keys the peer learns, each over exactly the bytes it
    /// may reach. Dropped (deregistered, so their keys die) before the QP
    /// and before any memory under them is freed.
    scoped: ScopedKeys,
    qp: RcQueuePair,
    /// Posted send-queue WRs not known complete, and what the runtime gave
    /// up while one of them still names it (after the QP: freed once it is
    /// destroyed).
    ledger: Ledger<u64, Held>,
    /// Registered scratch for RTS headers that do not go inline (32 bytes
    /// per send-queue slot); `None` when every RTS goes inline. Held for
    /// the QP's life (after it: deregistered once the QP is destroyed).
    rts_scratch: Option<RegisteredBuffer>,
    /// A device without immediate data: every message is a SEND ending in
    /// the 4-byte trailer of its immediate (`proto::message`, "On a
    /// device without immediate data"). The trailers of SENDs whose
    /// payload is not inline are read from this scratch (4 bytes per
    /// send-queue slot, on the QP's PD, held for the QP's life).
    trailer_scratch: Option<RegisteredBuffer>,
    send_depth: u64,
    /// Posted receive buffers by token.
    recv: HashMap<u64, PoolBuf>,
    /// Rendezvous destinations by token.
    dests: HashMap<u64, PoolBuf>,
    /// Messages being sent, by token.
    sending: HashMap<u64, OutgoingMessage>,
    /// Remote-memory work in flight (one-sided operations, grant binds
    /// and revocations), by wr_id.
    remote: HashMap<u64, RemoteOp>,
    /// Regions under a bound grant window, by grant id: kept alive until
    /// the window is invalidated or deallocated (after the QP).
    grant_regions: HashMap<u64, (LocalRegion, u64)>,
    /// Number of the last remote WR ([`Work::Remote`]).
    next_remote: u64,
    /// Send-queue completions held back until the RDMA READs posted before
    /// them completed, in arrival order (a device whose READ completions
    /// come late: [`OpenDevice::reads_complete_late`](crate::verbs::rc::OpenDevice)).
    held_back: std::collections::VecDeque<crate::verbs::rc::Completion>,
    /// Tasks waiting for a remote slot.
    remote_waiters: Vec<Waker>,
    /// Grants dropped while every remote slot was taken: revoked as slots
    /// free up.
    pending_revokes: Vec<u64>,
    #[cfg(tokio_rdma_guest)]
    last_sge: Option<PostedSge>,
    /// The keys of forged RTSs by token (test hook for a misbehaving
    /// peer: announcements of memory this side does not own).
    #[cfg(tokio_rdma_guest)]
    forged_rts: HashMap<u64, u32>,
}

/// The memory regions of a QP on a PD of its own (a device without
/// memory windows) whose keys reach the peer: each is registered over
/// exactly what the peer may touch, on the connection's own PD (so its
/// key opens nothing through any other QP), and deregistered as soon as
/// the peer is done with it.
#[derive(Default)]
struct ScopedKeys {
    /// Rendezvous sources by message token: `REMOTE_READ` over exactly
    /// the message, from its RTS until the peer's DONE (or an abort).
    sources: HashMap<u64, MemoryRegistration>,
    /// RDMA READ sinks by destination token: `LOCAL_WRITE | REMOTE_WRITE`
    /// over exactly the destination (iWARP's READ response is a tagged
    /// write to the sink's key, RFC 5040 section 4.4), until every READ
    /// into it completed.
    sinks: HashMap<u64, MemoryRegistration>,
    /// Grants by grant id: exactly the granted bytes and rights, until
    /// revoked.
    grants: HashMap<u64, MemoryRegistration>,
    /// Registrations made over the QP's life (sources, sinks and grants).
    registrations: u64,
}

/// One remote-memory operation in flight: one WR, or a batch of WRs
/// posted with one doorbell whose last one is signaled and carries the
/// operation's wr_id.
struct RemoteOp {
    /// What it is.
    kind: RemoteKind,
    /// Its completion status, once polled.
    status: Option<WcStatus>,
    /// The task waiting for it (none once its future was dropped).
    waker: Option<Waker>,
    /// The local buffers its WRs read (WRITE) or write (READ, atomics),
    /// in posting order, while its future waits; each is pinned in the
    /// ledger under its own WR's wr_id until that WR's completion. A
    /// batch's WRs have consecutive wr_ids ending with the operation's,
    /// so buffer `i` of `n` is pinned under `wr_id - (n - 1 - i)`.
    locals: Vec<Local>,
    /// Its future was dropped: nobody takes the result.
    abandoned: bool,
    /// Without memory windows, its RDMA READs' sink registrations over
    /// exactly their local buffers (see [`ScopedKeys::sinks`]): kept
    /// until the completion, even once the future was dropped.
    sinks: Vec<MemoryRegistration>,
    /// Send-queue slots its WRs take (1 but for a batch).
    wrs: u16,
}

/// What a new [`RemoteOp`] starts with besides its kind.
struct RemoteEntry {
    /// Its local buffers ([`RemoteOp::locals`]).
    locals: Vec<Local>,
    /// Its READ sinks' registrations ([`RemoteOp::sinks`]).
    sinks: Vec<MemoryRegistration>,
    /// A status already known (a grant complete without a WR).
    status: Option<WcStatus>,
    /// Send-queue slots its WRs take.
    wrs: u16,
}

impl Default for RemoteEntry {
    fn default() -> Self {
        RemoteEntry {
            locals: Vec::new(),
            sinks: Vec::new(),
            status: None,
            wrs: 1,
        }
    }
}

/// What a remote-memory WR does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RemoteKind {
    /// A one-sided operation.
    Op,
    /// The bind of grant `grant`'s window.
    Bind { grant: u64 },
    /// The invalidation of grant `grant`'s window.
    Revoke { grant: u64 },
}

/// A one-sided operation to post ([`MessageQp::post_remote`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum RemoteWr {
    /// RDMA READ of the local buffer's capacity (or `len`) from
    /// `addr`/`rkey`.
    Read { addr: u64, rkey: u32, len: u32 },
    /// RDMA WRITE of the local buffer's first `len` bytes.
    Write { addr: u64, rkey: u32, len: u32 },
    /// ATOMIC compare-and-swap.
    CompareSwap {
        addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    /// ATOMIC fetch-and-add.
    FetchAdd { addr: u64, rkey: u32, add: u64 },
}

/// Memory of this QP's that a posted send-queue WR may still name when the
/// runtime gives it up: kept by the [`Ledger`] until that WR is done.
enum Held {
    /// A message an eager SEND reads.
    Message(#[allow(dead_code)] OutgoingMessage),
    /// A rendezvous destination an RDMA READ writes.
    Dest(#[allow(dead_code)] PoolBuf),
    /// The local memory of a one-sided WR.
    Local(#[allow(dead_code)] Local),
}

/// The local memory of a one-sided WR (the READ's destination, the
/// WRITE's source, the atomic's 8-byte result): a pool buffer, handed back
/// to the caller, or `len` bytes at `at` of a region registered on this
/// QP's PD, read or written in place (zero-copy). Held by the operation,
/// then by the ledger, until the WR's completion.
pub(crate) enum Local {
    /// A pool buffer of the endpoint's.
    Buf(PoolBuf),
    /// A byte range of a region (the caller checked it lies inside and
    /// that the region's keys are valid on this QP's PD).
    Region {
        /// The region, kept alive with its registration.
        region: LocalRegion,
        /// Offset of the range in the region, bytes.
        at: usize,
        /// Length of the range, bytes.
        len: usize,
    },
    /// A scatter-gather list of region ranges ([`Local::Region`] each),
    /// in order: one WR's SGEs.
    List(Vec<Local>),
}

/// The SGEs of one one-sided WR: one, or a scatter-gather list.
enum Sges {
    One(Sge),
    List(Vec<Sge>),
}

impl Sges {
    /// The first SGE (a zero-length one for an empty list, which
    /// `remote_need` refuses before anything is built).
    fn first(&self) -> Sge {
        match self {
            Sges::One(s) => *s,
            Sges::List(l) => l.first().copied().unwrap_or(Sge {
                addr: 0,
                len: 0,
                lkey: 0,
            }),
        }
    }
}

impl Local {
    /// The first byte's address (0 for a list, which has one per entry).
    fn addr(&self) -> u64 {
        match self {
            Local::Buf(b) => b.addr(),
            Local::Region { region, at, .. } => region.addr() + *at as u64,
            Local::List(_) => 0,
        }
    }

    /// Bytes it holds (a list: the sum of its entries').
    fn capacity(&self) -> usize {
        match self {
            Local::Buf(b) => b.capacity(),
            Local::Region { len, .. } => *len,
            Local::List(l) => l.iter().map(Local::capacity).sum(),
        }
    }

    /// Its lkey (0 for a list, which has one per entry).
    fn lkey(&self) -> u32 {
        match self {
            Local::Buf(b) => b.lkey(),
            Local::Region { region, .. } => region.lkey(),
            Local::List(_) => 0,
        }
    }

    /// The pool buffer, for the operations that return one.
    pub(crate) fn into_buf(self) -> Option<PoolBuf> {
        match self {
            Local::Buf(b) => Some(b),
            Local::Region { .. } | Local::List(_) => None,
        }
    }
}

fn internal(msg: String) -> Error {
    Error::Internal(msg)
}

/// The memory windows of one QP: a rendezvous source is exposed to the peer
/// through a type-2 window bound on this QP over exactly the message's
/// bytes, read-only, from its RTS until the peer's DONE (or an abort), and
/// invalidated (LOCAL_INV completed) before the message's memory is
/// released. A window is then reused with a new key.
#[derive(Default)]
struct Windows {
    /// Unbound windows, ready for the next rendezvous.
    free: Vec<MemoryWindow>,
    /// Bound windows by message token.
    bound: HashMap<u64, MemoryWindow>,
    /// Windows being invalidated, by the LOCAL_INV's wr_id, with their
    /// message's token.
    invalidating: HashMap<u64, (u64, MemoryWindow)>,
    /// Tokens whose message is done and whose window awaits its LOCAL_INV.
    to_invalidate: Vec<u64>,
    /// Number of the last bind or invalidation ([`Work::Window`]).
    next_wr: u64,
    /// Binds posted over the QP's life.
    binds: u64,
    /// The last window bound: (address, length, key).
    last: Option<(u64, u64, u32)>,
}

impl Windows {
    fn wr_id(&mut self) -> u64 {
        self.next_wr += 1;
        Work::Window(self.next_wr).wr_id()
    }
}

impl AsMut<RcQueuePair> for MessageQp {
    fn as_mut(&mut self) -> &mut RcQueuePair {
        &mut self.qp
    }
}

impl MessageQp {
    /// Wraps `qp`, with registered scratch for `send_depth` RTS headers
    /// unless every RTS goes inline (`rts_inline`).
    ///
    /// # Errors
    /// As [`RcQueuePair::register_buffer`] ([`Error::ResourceLimit`] at
    /// RLIMIT_MEMLOCK).
    pub(crate) fn new(qp: RcQueuePair, send_depth: u16, rts_inline: bool) -> Result<Self> {
        let slots = usize::from(send_depth.max(1));
        // Without immediate data an RTS and its trailer always go inline
        // (the QP was created with at least 24 bytes of inline data).
        let trailer = !qp.device().immediate_data;
        let rts_scratch = if rts_inline || trailer {
            None
        } else {
            Some(qp.register_buffer(slots * RTS_SLOT, MrAccess::LocalWrite)?)
        };
        let trailer_scratch = if trailer {
            Some(qp.register_buffer(slots * TRAILER_LEN, MrAccess::LocalWrite)?)
        } else {
            None
        };
        Ok(MessageQp {
            windows: Windows::default(),
            grant_windows: HashMap::new(),
            scoped: ScopedKeys::default(),
            qp,
            ledger: Ledger::default(),
            rts_scratch,
            trailer_scratch,
            send_depth: u64::from(send_depth.max(1)),
            recv: HashMap::new(),
            dests: HashMap::new(),
            sending: HashMap::new(),
            remote: HashMap::new(),
            grant_regions: HashMap::new(),
            next_remote: 0,
            held_back: std::collections::VecDeque::new(),
            remote_waiters: Vec::new(),
            pending_revokes: Vec::new(),
            #[cfg(tokio_rdma_guest)]
            last_sge: None,
            #[cfg(tokio_rdma_guest)]
            forged_rts: HashMap::new(),
        })
    }

    pub(crate) fn qp_ref(&self) -> &RcQueuePair {
        &self.qp
    }

    /// Whether every message is a SEND ending in its immediate's trailer
    /// (a device without immediate data).
    pub(crate) fn trailer(&self) -> bool {
        self.trailer_scratch.is_some()
    }

    /// Memory regions registered for the peer's keys over the QP's life
    /// (rendezvous sources, READ sinks and grants on a device without
    /// memory windows; 0 elsewhere).
    pub(crate) fn scoped_registrations(&self) -> u64 {
        self.scoped.registrations
    }

    /// Such registrations alive now (each deregistered once the peer is
    /// done with it).
    pub(crate) fn scoped_live(&self) -> usize {
        self.scoped.sources.len() + self.scoped.sinks.len() + self.scoped.grants.len()
    }

    /// Registers exactly `len` bytes at `addr` with `access` on the QP's
    /// own PD, counted.
    ///
    /// # Safety
    /// As [`RcQueuePair::register_scoped`]: the memory stays valid until
    /// the registration is dropped.
    unsafe fn register_scoped(
        &mut self,
        addr: u64,
        len: u64,
        access: MrAccess,
    ) -> Result<MemoryRegistration> {
        let len = usize::try_from(len).map_err(|_| internal(format!("{len} bytes")))?;
        // SAFETY: forwarded to the caller.
        let mr = unsafe { self.qp.register_scoped(addr, len, access) }?
            .ok_or_else(|| internal("a peer's key on a QP on the device's shared PD".into()))?;
        self.scoped.registrations += 1;
        Ok(mr)
    }

    /// Posts receive buffers (their whole capacity), keeping them until
    /// [`take_recv`](Self::take_recv); each receive WR is [`Work::Recv`]
    /// of its token.
    pub(crate) fn post_recvs(&mut self, bufs: Vec<(u64, PoolBuf)>) -> Result<()> {
        let mut wrs = Vec::with_capacity(bufs.len());
        for (token, mut buf) in bufs {
            buf.clear();
            let len = u32::try_from(buf.capacity()).unwrap_or(u32::MAX);
            wrs.push((
                Work::Recv(token).wr_id(),
                Sge {
                    addr: buf.addr(),
                    len,
                    lkey: buf.lkey(),
                },
            ));
            self.recv.insert(token, buf);
        }
        // SAFETY: every SGE names a pool buffer registered read-write on
        // this QP's PD (the pool and QP share the device's PD; the endpoint
        // checks it) and owned by `self.recv` until its completion is seen
        // (`take_recv`) or the QP is destroyed (first field, dropped first).
        unsafe { self.qp.post_recv_sges(&wrs) }
    }

    /// The buffer of the completed (or flushed) receive WR of `token`,
    /// with its length set to `byte_len` (clamped to its capacity).
    pub(crate) fn take_recv(&mut self, token: u64, byte_len: u32) -> Option<(u64, PoolBuf)> {
        let mut buf = self.recv.remove(&token)?;
        buf.set_len((byte_len as usize).min(buf.capacity()));
        Some((token, buf))
    }

    /// The buffer of the completed receive WR of `token` that carried a
    /// SEND of `byte_len` bytes, and the message's immediate and length:
    /// without immediate data, split off the SEND's last 4 bytes (the
    /// buffer's length is then the payload's); otherwise `imm` as the
    /// completion gave it. `None` for an unknown token.
    ///
    /// # Errors
    /// [`MessageError::MissingTrailer`] for a SEND too short to carry a
    /// trailer (the buffer is dropped: it is no longer posted).
    pub(crate) fn take_recv_message(
        &mut self,
        token: u64,
        imm: u32,
        byte_len: u32,
    ) -> Option<std::result::Result<(PoolBuf, u32, u32), MessageError>> {
        let (_, mut buf) = self.take_recv(token, byte_len)?;
        if !self.trailer() {
            return Some(Ok((buf, imm, byte_len)));
        }
        let framed = split_trailer(byte_len, buf.as_slice()).and_then(|(imm, len)| {
            buf.set_len(len as usize);
            // A NOTIFY's SEND carries the length its WRITE wrote.
            let len = notify_length(imm, buf.as_slice())?.unwrap_or(len);
            Ok((imm, len))
        });
        Some(framed.map(|(imm, len)| (buf, imm, len)))
    }

    /// Keeps `buf` as destination `token` for READs. Without memory
    /// windows its whole capacity is registered as the READs' sink (see
    /// [`ScopedKeys::sinks`]).
    ///
    /// # Errors
    /// [`Error::Verbs`] when that registration fails (`buf` is dropped).
    pub(crate) fn add_dest(&mut self, token: u64, buf: PoolBuf) -> Result<()> {
        if self.qp.has_own_pd() {
            // SAFETY: `buf` is held in `self.dests` (or by the ledger,
            // pinned while a READ into it is outstanding) until the sink
            // is dropped: `take_dest` and `release_dest` drop the sink
            // first, and `scoped` drops before `dests` and the ledger.
            let mr = unsafe {
                self.register_scoped(
                    buf.addr(),
                    buf.capacity() as u64,
                    MrAccess::LocalWriteRemoteWrite,
                )
            }?;
            self.scoped.sinks.insert(token, mr);
        }
        self.dests.insert(token, buf);
        Ok(())
    }

    /// The destination `token` with every READ into it complete; `None` if
    /// unknown or a READ into it is outstanding. Its sink registration, if
    /// any, is dropped first.
    pub(crate) fn take_dest(&mut self, token: u64) -> Option<PoolBuf> {
        if self.ledger.pinned(token) {
            return None;
        }
        self.scoped.sinks.remove(&token);
        self.dests.remove(&token)
    }

    /// Frees destination `token` now, or (through the ledger) once the
    /// READs into it completed or were flushed. Its sink registration is
    /// dropped now: a READ response still on its way then fails (the
    /// connection is being aborted) rather than write the freed buffer.
    pub(crate) fn release_dest(&mut self, token: u64) {
        self.scoped.sinks.remove(&token);
        if let Some(buf) = self.dests.remove(&token) {
            drop(self.ledger.release(token, Held::Dest(buf)));
        }
    }

    /// Gives message `token` up: freed now if no posted WR names it, by
    /// the ledger once the last such WR completed (or was flushed)
    /// otherwise.
    fn retire_send(&mut self, token: u64) -> bool {
        match self.sending.remove(&token) {
            Some(msg) => {
                drop(self.ledger.release(token, Held::Message(msg)));
                true
            }
            None => false,
        }
    }

    /// Keeps message `token` until [`release_send`](Self::release_send).
    pub(crate) fn add_send(&mut self, token: u64, msg: OutgoingMessage) {
        self.sending.insert(token, msg);
    }

    /// The peer is done with message `token` (or it was aborted): give it
    /// up, for a rendezvous once its window is invalidated (the LOCAL_INV
    /// goes out with the next [`post`](Self::post)). Its memory is freed
    /// only once no posted WR names it any more: an eager SEND still
    /// posted at an abort keeps it until its completion or flush
    /// ([`Ledger`]). Returns whether `token` was a message being sent.
    pub(crate) fn release_send(&mut self, token: u64) -> bool {
        if !self.sending.contains_key(&token) {
            return false;
        }
        // Without windows: the source's key dies now (deregistered before
        // its memory can be freed).
        if let Some(mr) = self.scoped.sources.remove(&token) {
            tracing::trace!(token, rkey = mr.rkey(), "rendezvous source deregistered");
        }
        if self.windows.bound.contains_key(&token) {
            self.windows.to_invalidate.push(token);
        } else {
            self.retire_send(token);
        }
        true
    }

    /// Messages and destinations given up while a posted WR still names
    /// them (held by the ledger until its completion or flush).
    pub(crate) fn retired(&self) -> usize {
        self.ledger.retired()
    }

    /// Messages held for sending (a rendezvous until its window is
    /// invalidated).
    pub(crate) fn sends_held(&self) -> usize {
        self.sending.len()
    }

    /// Messages held for sending that the peer has not taken yet: held
    /// ones minus rendezvous the peer DONE'd whose window is still being
    /// invalidated (taken; only our own clean-up is pending).
    pub(crate) fn sends_not_taken(&self) -> usize {
        self.sending
            .len()
            .saturating_sub(self.windows.invalidating.len() + self.windows.to_invalidate.len())
    }

    /// Memory windows this QP holds (free, bound and being invalidated).
    pub(crate) fn windows_held(&self) -> usize {
        self.windows.free.len() + self.windows.bound.len() + self.windows.invalidating.len()
    }

    /// The last window bound, or without windows the last rendezvous
    /// source registered: (address, length, key) (for the guest tests).
    #[cfg_attr(not(tokio_rdma_guest), allow(dead_code))]
    pub(crate) fn last_window(&self) -> Option<(u64, u64, u32)> {
        self.windows.last
    }

    /// Window binds posted so far.
    pub(crate) fn window_binds(&self) -> u64 {
        self.windows.binds
    }

    /// A bind or invalidation of ours ([`Work::Window`], posted with
    /// `wr_id`) completed with `status`. A completed LOCAL_INV releases its message and frees
    /// its window for reuse. After a failure (the QP is in error, so the
    /// peer can use no key of it) the message stays held until the QP is
    /// torn down, windows first. Returns whether a message was released.
    pub(crate) fn window_completed(&mut self, wr_id: u64, status: WcStatus) -> bool {
        let Some((token, window)) = self.windows.invalidating.remove(&wr_id) else {
            return false;
        };
        if status == WcStatus::Success {
            self.windows.free.push(window);
            self.retire_send(token)
        } else {
            self.windows.bound.insert(token, window);
            false
        }
    }

    /// What the protocol core's send-queue WR `wr_id` (posted, not yet
    /// known complete) is, for its errors: an RDMA READ, a NOTIFY's RDMA
    /// WRITE WITH IMMEDIATE (on iWARP its WRITE, which comes first), or a
    /// SEND; `None` once it is not in the ledger.
    pub(crate) fn core_op(&self, wr_id: u64) -> Option<PostedOp> {
        self.ledger.op(wr_id)
    }

    /// Whether completion `wc` must wait: on a device whose READ
    /// completions may come after later WRs' (siw), a successful
    /// send-queue completion with a READ posted before it not yet
    /// complete is held back (and handed out by
    /// [`released`](Self::released) once those READs completed), because
    /// the ledger and the message core take a completion to retire every
    /// earlier WR. A core WR that a later completion (a READ posted after
    /// it) already retired is dropped (returns true, not held). READs,
    /// receives, failures and the QP's own probes and window work pass.
    pub(crate) fn hold_back(&mut self, wc: &crate::verbs::rc::Completion) -> bool {
        if !self.qp.device().reads_complete_late || wc.status != WcStatus::Success {
            return false;
        }
        let wr_id = match wc.work {
            Work::Core(_) | Work::Remote(_) => wc.wr_id(),
            _ => return false,
        };
        match self.ledger.op(wr_id) {
            // Retired by a later READ's completion (posted after it, so it
            // was sent before): nothing left to report.
            None if matches!(wc.work, Work::Core(_)) => return true,
            // READs complete in order among themselves: every earlier READ
            // is done, and held-back WRs behind it may follow.
            Some(PostedOp::Read) => return false,
            _ => {}
        }
        if !self.held_back.is_empty() || self.ledger.read_before(wr_id) {
            self.held_back.push_back(*wc);
            return true;
        }
        false
    }

    /// The next held-back completion whose earlier READs all completed,
    /// if any (in arrival order). A core WR's completion that a later one
    /// already retired is skipped; a remote WR's still goes to its future.
    pub(crate) fn released(&mut self) -> Option<crate::verbs::rc::Completion> {
        loop {
            let wc = *self.held_back.front()?;
            let wr_id = wc.wr_id();
            if self.ledger.read_before(wr_id) {
                return None;
            }
            self.held_back.pop_front();
            if matches!(wc.work, Work::Core(_)) && self.ledger.op(wr_id).is_none() {
                continue;
            }
            return Some(wc);
        }
    }

    /// Send-queue WR `wr_id` completed (successfully or flushed): it and
    /// every earlier WR are done (RC ordering); the ledger frees what was
    /// given up while they were posted.
    pub(crate) fn send_completed(&mut self, wr_id: u64) {
        self.ledger.complete(wr_id);
    }

    /// The SGE of the last SEND with payload or READ posted.
    #[cfg(tokio_rdma_guest)]
    pub(crate) fn last_sge(&self) -> Option<PostedSge> {
        self.last_sge
    }

    #[cfg(tokio_rdma_guest)]
    fn note_sge(&mut self, sge: Sge) {
        self.last_sge = Some(PostedSge {
            addr: sge.addr,
            len: sge.len,
            lkey: sge.lkey,
        });
    }

    #[cfg(not(tokio_rdma_guest))]
    fn note_sge(&mut self, _sge: Sge) {}

    /// The RTS of message `token` (not one of ours) goes out with `rkey`
    /// (test hook).
    #[cfg(tokio_rdma_guest)]
    pub(crate) fn forge_rts(&mut self, token: u64, rkey: u32) {
        self.forged_rts.insert(token, rkey);
    }

    /// Invalidates the windows of finished messages (signaled LOCAL_INVs),
    /// binds a window for each RTS in `batch` and encodes its header with
    /// the window's key; returns the headers to post, in batch order.
    fn prepare_windows(&mut self, batch: &[MsgTransmit]) -> Result<Vec<[u8; RTS_HEADER_LEN]>> {
        for token in std::mem::take(&mut self.windows.to_invalidate) {
            let Some(window) = self.windows.bound.remove(&token) else {
                self.retire_send(token);
                continue;
            };
            let wr_id = self.windows.wr_id();
            let rkey = window.rkey();
            self.windows.invalidating.insert(wr_id, (token, window));
            self.qp.post_local_inv(wr_id, rkey, true)?;
        }
        let mut headers = Vec::new();
        for t in batch {
            let &MsgTransmitKind::Rts {
                token, len, addr, ..
            } = &t.kind
            else {
                continue;
            };
            #[cfg(tokio_rdma_guest)]
            if let Some(rkey) = self.forged_rts.remove(&token) {
                headers.push(RtsHeader { len, addr, rkey }.encode());
                continue;
            }
            let Some(msg) = self.sending.get(&token) else {
                return Err(internal(format!("an RTS of unknown message {token}")));
            };
            if self.qp.has_own_pd() {
                // No windows: a memory region over exactly the message,
                // remote read only, on this connection's own PD.
                debug_assert_eq!((addr, len), (msg.addr(), msg.len() as u64));
                // SAFETY: the message is held in `self.sending` until
                // `release_send`, which drops this registration first;
                // `scoped` drops before `sending` and the ledger.
                let mr = unsafe { self.register_scoped(addr, len, MrAccess::RemoteRead) }?;
                let rkey = mr.rkey();
                tracing::trace!(token, addr, len, rkey, "rendezvous source registered");
                self.scoped.sources.insert(token, mr);
                self.windows.last = Some((addr, len, rkey));
                headers.push(RtsHeader { len, addr, rkey }.encode());
                continue;
            }
            let mr = msg.raw_mr();
            if mr == 0 {
                return Err(internal(format!(
                    "message {token} has no memory region to bind a window on"
                )));
            }
            debug_assert_eq!((addr, len), (msg.addr(), msg.len() as u64));
            let mut window = match self.windows.free.pop() {
                Some(w) => w,
                None => MemoryWindow::alloc(self.qp.device())?,
            };
            let wr_id = self.windows.wr_id();
            // SAFETY: `mr` is the live MR under the message (registered
            // with MW_BIND on this QP's PD by the pool); the message is held
            // in `self.sending` until the window's LOCAL_INV completed
            // (`window_completed`) or, on a failed connection, until this
            // struct drops, windows first.
            let rkey = unsafe {
                self.qp.post_bind_mw(
                    wr_id,
                    &mut window,
                    BindTarget { mr, addr, len },
                    WindowAccess::RemoteRead,
                    false,
                )
            };
            let rkey = match rkey {
                Ok(k) => k,
                Err(e) => {
                    self.windows.free.push(window);
                    return Err(e);
                }
            };
            self.windows.binds += 1;
            self.windows.last = Some((addr, len, rkey));
            self.windows.bound.insert(token, window);
            headers.push(RtsHeader { len, addr, rkey }.encode());
        }
        Ok(headers)
    }

    /// Posts what the core asked for, all of it with one doorbell (after
    /// the window binds and invalidations it needs), and records every WR
    /// in the ledger with the owner of the memory its SGE names: all of
    /// them even when the post fails part way, since the NIC may have
    /// taken any WR before the one it refused.
    pub(crate) fn post(&mut self, batch: &[MsgTransmit]) -> Result<()> {
        let headers = self.prepare_windows(batch)?;
        let mut headers = headers.iter();
        // Where a READ's completion may come after later WRs' (siw), every
        // READ is signaled, so that completions held back behind it
        // (`hold_back`) are let go when it completes.
        let reads_complete_late = self.qp.device().reads_complete_late;
        let mut wrs = Vec::with_capacity(batch.len());
        let mut records = Vec::with_capacity(batch.len());
        let mut last_sge = None;
        // Without immediate data a NOTIFY's SEND carries the written
        // length, big-endian, before its trailer.
        let notify_lens: Vec<[u8; 4]> = batch
            .iter()
            .filter_map(|t| match t.kind {
                MsgTransmitKind::WriteNotify { len, .. } => Some(len.to_be_bytes()),
                _ => None,
            })
            .collect();
        let mut notify_lens = notify_lens.iter();
        for t in batch {
            let (op, pin) = match &t.kind {
                &MsgTransmitKind::WriteNotify {
                    token,
                    len,
                    remote_addr,
                    rkey,
                    imm,
                    inline,
                } => 'arm: {
                    let (payload, pin) = message_payload(&self.sending, token, len, inline)?;
                    if let SendPayload::Sge(sge) = payload {
                        last_sge = Some(sge);
                    }
                    let Some(scratch) = self.trailer_scratch.as_mut() else {
                        let op = SendOp::WriteImm {
                            payload,
                            remote_addr,
                            rkey,
                            imm,
                        };
                        break 'arm ((op, PostedOp::Write), pin);
                    };
                    // No immediate data (iWARP): the WRITE, then a SEND of
                    // the length and the trailer, which the peer's RDMAP
                    // delivers only after the WRITE was placed (RFC 5040,
                    // section 5.5). Both carry this core WR's number: the
                    // WRITE's completion, unsignaled, comes only as a
                    // failure or a flush, and fails the core's WR as the
                    // WRITE WITH IMMEDIATE's would.
                    let wr_id = Work::Core(t.wr_id).wr_id();
                    wrs.push(SendWr {
                        wr_id,
                        signaled: false,
                        solicited: false,
                        op: SendOp::Write {
                            payload,
                            remote_addr,
                            rkey,
                        },
                    });
                    records.push((wr_id, PostedOp::Write, pin));
                    let length = notify_lens
                        .next()
                        .ok_or_else(|| internal("a NOTIFY without its length".into()))?;
                    let op = with_trailer(SendPayload::Inline(length), imm, t.wr_id, scratch)?;
                    ((op, PostedOp::Send), None)
                }
                &MsgTransmitKind::Eager {
                    token,
                    len,
                    imm,
                    inline,
                } => {
                    let (payload, pin) = message_payload(&self.sending, token, len, inline)?;
                    if let SendPayload::Sge(sge) = payload {
                        last_sge = Some(sge);
                    }
                    let op = match self.trailer_scratch.as_mut() {
                        Some(scratch) => with_trailer(payload, imm, t.wr_id, scratch)?,
                        None => SendOp::SendImm { payload, imm },
                    };
                    ((op, PostedOp::Send), pin)
                }
                MsgTransmitKind::Rts { imm, inline, .. } => {
                    let header = headers
                        .next()
                        .ok_or_else(|| internal("RTS without a prepared header".into()))?;
                    if let Some(scratch) = self.trailer_scratch.as_mut() {
                        // Header and trailer inline (24 bytes; the QP was
                        // created with at least that much inline data).
                        let op = with_trailer(SendPayload::Inline(header), *imm, t.wr_id, scratch)?;
                        wrs.push(SendWr {
                            wr_id: Work::Core(t.wr_id).wr_id(),
                            signaled: t.signaled,
                            solicited: t.solicited,
                            op,
                        });
                        records.push((Work::Core(t.wr_id).wr_id(), PostedOp::Send, None));
                        continue;
                    }
                    let payload = if *inline {
                        SendPayload::Inline(header)
                    } else {
                        // At most `send_depth` WRs are outstanding and
                        // wr_ids are consecutive, so slot `wr_id %
                        // send_depth` is not in use by another WR.
                        let off = (t.wr_id % self.send_depth) as usize * RTS_SLOT;
                        let scratch = self
                            .rts_scratch
                            .as_mut()
                            .ok_or_else(|| internal("message QP without its RTS scratch".into()))?;
                        scratch
                            .write_at(off, header)
                            .map_err(|source| Error::Verbs {
                                op: "RTS scratch",
                                source,
                            })?;
                        SendPayload::Sge(Sge {
                            addr: scratch.addr() + off as u64,
                            len: RTS_HEADER_LEN as u32,
                            lkey: scratch.lkey(),
                        })
                    };
                    // The scratch is the QP's own, held for its life.
                    let op = SendOp::SendImm { payload, imm: *imm };
                    ((op, PostedOp::Send), None)
                }
                &MsgTransmitKind::Control { imm } => {
                    let op = match self.trailer_scratch.as_mut() {
                        Some(scratch) => with_trailer(SendPayload::None, imm, t.wr_id, scratch)?,
                        None => SendOp::SendImm {
                            payload: SendPayload::None,
                            imm,
                        },
                    };
                    ((op, PostedOp::Send), None)
                }
                &MsgTransmitKind::Read {
                    local_token,
                    local_offset,
                    remote_addr,
                    rkey,
                    len,
                } => {
                    let dest = self
                        .dests
                        .get(&local_token)
                        .ok_or_else(|| internal(format!("no destination {local_token}")))?;
                    let end = local_offset.checked_add(u64::from(len));
                    if end.is_none_or(|e| e > dest.capacity() as u64) {
                        return Err(internal(format!(
                            "READ of {len} bytes at {local_offset} beyond destination of {} bytes",
                            dest.capacity()
                        )));
                    }
                    // Without windows, the sink registered over exactly
                    // this destination (`add_dest`).
                    let lkey = match self.scoped.sinks.get(&local_token) {
                        Some(sink) => sink.lkey(),
                        None => dest.lkey(),
                    };
                    let local = Sge {
                        addr: dest.addr() + local_offset,
                        len,
                        lkey,
                    };
                    last_sge = Some(local);
                    let op = SendOp::Read {
                        local,
                        remote_addr,
                        rkey,
                    };
                    ((op, PostedOp::Read), Some(local_token))
                }
            };
            let (op, posted) = op;
            // The core's numbers are the wr_ids of its WRs.
            let wr_id = Work::Core(t.wr_id).wr_id();
            let is_read = posted == PostedOp::Read;
            wrs.push(SendWr {
                wr_id,
                signaled: t.signaled || (is_read && reads_complete_late),
                solicited: t.solicited,
                op,
            });
            records.push((wr_id, posted, pin));
        }
        // SAFETY: every SGE names registered memory on this QP's PD that
        // outlives its WR: a message or destination whose token the ledger
        // records below as named by this WR, so that giving it up before
        // the WR's completion or flush leaves it with the ledger (a field
        // dropped after the QP is destroyed); the QP's own RTS scratch; a
        // destination inside its bounds (checked above) that `take_dest`
        // hands out only once no READ into it is outstanding. A SEND only
        // reads its message; a READ's destination is not read by the
        // program while pinned. Inline payloads are copied at posting.
        let posted = unsafe { self.qp.post_send_batch(&wrs) };
        drop(wrs);
        for (wr_id, op, pin) in records {
            self.ledger.record(wr_id, op, pin);
        }
        if let Some(sge) = last_sge {
            self.note_sge(sge);
        }
        posted
    }
}

/// The first `len` bytes of message `token` as a WR's payload: none,
/// inline (copied into the WR at posting: nothing to hold), or an SGE
/// over the message, which the ledger must pin to `token` (returned).
fn message_payload(
    sending: &HashMap<u64, OutgoingMessage>,
    token: u64,
    len: u32,
    inline: bool,
) -> Result<(SendPayload<'_>, Option<u64>)> {
    let msg = sending
        .get(&token)
        .ok_or_else(|| internal(format!("no message for token {token}")))?;
    let data = msg
        .as_slice()
        .get(..len as usize)
        .ok_or_else(|| internal(format!("message {token} shorter than {len}")))?;
    Ok(if len == 0 {
        (SendPayload::None, None)
    } else if inline {
        (SendPayload::Inline(data), None)
    } else {
        let sge = Sge {
            addr: msg.addr(),
            len,
            lkey: msg.lkey(),
        };
        (SendPayload::Sge(sge), Some(token))
    })
}

/// The send-queue operation of one-sided WR `wr` over `sge`, and what the
/// ledger records of it.
fn remote_send_op(wr: RemoteWr, sges: &Sges) -> (SendOp<'_>, PostedOp) {
    match (wr, sges) {
        (RemoteWr::Read { addr, rkey, .. }, Sges::List(list)) => (
            SendOp::ReadList {
                local: list,
                remote_addr: addr,
                rkey,
            },
            PostedOp::Read,
        ),
        (RemoteWr::Read { addr, rkey, .. }, Sges::One(sge)) => (
            SendOp::Read {
                local: *sge,
                remote_addr: addr,
                rkey,
            },
            PostedOp::Read,
        ),
        (RemoteWr::Write { addr, rkey, .. }, _) => (
            SendOp::Write {
                payload: match sges {
                    Sges::One(sge) => SendPayload::Sge(*sge),
                    Sges::List(list) => SendPayload::SgeList(list),
                },
                remote_addr: addr,
                rkey,
            },
            PostedOp::Write,
        ),
        // An atomic's local memory is one 8-byte buffer (`remote_need`
        // refuses a list for it).
        (
            RemoteWr::CompareSwap {
                addr,
                rkey,
                compare,
                swap,
            },
            _,
        ) => (
            SendOp::CompareSwap {
                local: sges.first(),
                remote_addr: addr,
                rkey,
                compare,
                swap,
            },
            PostedOp::Atomic,
        ),
        (RemoteWr::FetchAdd { addr, rkey, add }, _) => (
            SendOp::FetchAdd {
                local: sges.first(),
                remote_addr: addr,
                rkey,
                add,
            },
            PostedOp::Atomic,
        ),
    }
}

/// The SEND of a message with immediate `imm` on a device without
/// immediate data: `payload` followed by the 4-byte trailer carrying
/// `imm`, inline when the payload is (or empty), from the trailer's slot
/// of `scratch` (slot `wr_id % slots`: at most that many core WRs are
/// posted at once and their numbers are consecutive) when it is read from
/// registered memory.
fn with_trailer<'a>(
    payload: SendPayload<'a>,
    imm: u32,
    wr_id: u64,
    scratch: &mut RegisteredBuffer,
) -> Result<SendOp<'a>> {
    let trailer = encode_trailer(imm);
    let payload = match payload {
        SendPayload::None => SendPayload::InlineTrailer(&[], trailer),
        SendPayload::Inline(data) => SendPayload::InlineTrailer(data, trailer),
        SendPayload::Sge(sge) => {
            let slots = (scratch.len() / TRAILER_LEN) as u64;
            let off = (wr_id % slots.max(1)) as usize * TRAILER_LEN;
            scratch
                .write_at(off, &trailer)
                .map_err(|source| Error::Verbs {
                    op: "trailer scratch",
                    source,
                })?;
            SendPayload::SgeTrailer(
                sge,
                Sge {
                    addr: scratch.addr() + off as u64,
                    len: TRAILER_LEN as u32,
                    lkey: scratch.lkey(),
                },
            )
        }
        other => return Err(internal(format!("a message payload {other:?}"))),
    };
    Ok(SendOp::Send { payload })
}

/// Remote memory (`crate::remote`): one-sided operations posted on this
/// QP with a local pool buffer each, and grants (type-2 windows bound on
/// this QP over a region). A buffer stays with its operation while the
/// future waits and with the ledger once the future is dropped, until
/// the WR's completion or flush; a region stays under its window until
/// the window's invalidation completed or the window is deallocated.
impl MessageQp {
    fn remote_wr_id(&mut self) -> u64 {
        self.next_remote += 1;
        Work::Remote(self.next_remote).wr_id()
    }

    /// Whether remote-memory work waits for a completion event: an
    /// operation whose task parked on it (registered its waker) or whose
    /// future was dropped (its buffers wait in the ledger for the
    /// completion), a revocation of a dropped grant (posted, or queued for
    /// a slot), a task waiting for a slot. An operation whose task has
    /// not parked yet needs none: the task polls the CQ before it parks,
    /// and arms it then (`RemoteWait`).
    pub(crate) fn remote_needs_events(&self) -> bool {
        !self.pending_revokes.is_empty()
            || !self.remote_waiters.is_empty()
            || self
                .remote
                .values()
                .any(|o| o.status.is_none() && (o.abandoned || o.waker.is_some()))
    }

    /// Remote-memory WRs whose completion has not come yet (a one-sided
    /// operation, bind or revocation the NIC may still be working on).
    pub(crate) fn remote_pending(&self) -> usize {
        self.remote.values().filter(|o| o.status.is_none()).count()
    }

    /// Grants whose window is bound (or, without windows, whose memory
    /// region is registered) now.
    pub(crate) fn grants_held(&self) -> usize {
        self.grant_windows.len() + self.scoped.grants.len()
    }

    /// Send-queue slots remote work takes now.
    fn remote_wrs(&self) -> usize {
        self.remote.values().map(|o| usize::from(o.wrs)).sum()
    }

    /// Ready once `need` more remote WRs fit within [`REMOTE_SLOTS`];
    /// registers `cx`'s waker otherwise.
    pub(crate) fn poll_remote_slot(&mut self, cx: &mut Context<'_>, need: u16) -> Poll<()> {
        if self.remote_wrs() + usize::from(need) <= usize::from(REMOTE_SLOTS) {
            return Poll::Ready(());
        }
        self.remote_waiters.push(cx.waker().clone());
        Poll::Pending
    }

    /// A remote slot freed: revocations of dropped grants waiting for
    /// one go first, then the waiting tasks are woken.
    fn remote_slot_freed(&mut self) {
        while self.remote_wrs() < usize::from(REMOTE_SLOTS) {
            let Some(grant) = self.pending_revokes.pop() else {
                break;
            };
            // A failed post means a failed QP, whose windows die with it.
            let _ = self.revoke_grant(grant, true);
        }
        for w in self.remote_waiters.drain(..) {
            w.wake();
        }
    }

    fn insert_remote(&mut self, wr_id: u64, kind: RemoteKind, op: RemoteEntry) {
        self.remote.insert(
            wr_id,
            RemoteOp {
                kind,
                status: op.status,
                waker: None,
                locals: op.locals,
                abandoned: false,
                sinks: op.sinks,
                wrs: op.wrs,
            },
        );
    }

    /// Bytes a one-sided WR touches in its local buffer `local` (the
    /// READ's destination, the WRITE's source, the atomic's 8-byte
    /// result), checked against its capacity and, for an atomic, the
    /// device.
    fn remote_need(&self, wr: RemoteWr, local: &Local) -> Result<usize> {
        let need = match wr {
            RemoteWr::Read { len, .. } | RemoteWr::Write { len, .. } => len as usize,
            RemoteWr::CompareSwap { .. } | RemoteWr::FetchAdd { .. } => {
                self.qp.device().check_atomics()?;
                8
            }
        };
        if let Local::List(list) = local {
            let most = match wr {
                RemoteWr::Read { .. } => self.qp.max_read_sge(),
                RemoteWr::Write { .. } => self.qp.max_send_sge(),
                RemoteWr::CompareSwap { .. } | RemoteWr::FetchAdd { .. } => 0,
            };
            if list.is_empty()
                || list.len() > most as usize
                || list.iter().any(|l| !matches!(l, Local::Region { .. }))
            {
                return Err(internal(format!(
                    "a scatter-gather list of {} entries (at most {most} region ranges)",
                    list.len()
                )));
            }
            if need != local.capacity() {
                return Err(internal(format!(
                    "remote operation of {need} bytes with a scatter-gather list of {}",
                    local.capacity()
                )));
            }
        }
        if need > local.capacity() {
            return Err(internal(format!(
                "remote operation of {need} bytes with a local buffer of {}",
                local.capacity()
            )));
        }
        Ok(need)
    }

    /// The SGEs of a one-sided WR over the first `need` bytes of `local`
    /// (every entry of a list, whose length `remote_need` checked), and,
    /// without windows, a READ's sinks registered over exactly those
    /// bytes (see `ScopedKeys::sinks`), to keep with the operation until
    /// its completion.
    ///
    /// # Safety
    /// `local` must stay allocated until the returned sinks are dropped
    /// (the operation's entry holds both, and `remote_completed` drops
    /// the sinks before the ledger or the future lets the buffer go).
    unsafe fn remote_sge(
        &mut self,
        wr: RemoteWr,
        local: &Local,
        need: usize,
    ) -> Result<(Sges, Vec<MemoryRegistration>)> {
        let scoped = matches!(wr, RemoteWr::Read { .. }) && self.qp.has_own_pd();
        let mut sinks = Vec::new();
        let mut sge = |this: &mut Self, addr: u64, len: usize, lkey: u32| -> Result<Sge> {
            let lkey = if scoped {
                // SAFETY: the caller keeps `local` until the sink drops.
                let sink = unsafe {
                    this.register_scoped(addr, len as u64, MrAccess::LocalWriteRemoteWrite)
                }?;
                let lkey = sink.lkey();
                sinks.push(sink);
                lkey
            } else {
                lkey
            };
            Ok(Sge {
                addr,
                len: len as u32,
                lkey,
            })
        };
        let sges = match local {
            Local::List(list) => {
                let mut out = Vec::with_capacity(list.len());
                for l in list {
                    out.push(sge(self, l.addr(), l.capacity(), l.lkey())?);
                }
                Sges::List(out)
            }
            _ => Sges::One(sge(self, local.addr(), need, local.lkey())?),
        };
        Ok((sges, sinks))
    }

    /// Posts one signaled one-sided WR with `local` as its local buffer
    /// (the READ's destination, the WRITE's source, the atomic's 8-byte
    /// result) and returns its wr_id. The caller checked the remote range
    /// against the grant; the local length is checked here.
    ///
    /// # Errors
    /// [`Error::Internal`] for a local buffer too short;
    /// [`Error::NoAtomics`] for an atomic on a device without them;
    /// [`Error::Verbs`] if the post fails (nothing was posted: a single
    /// WR is taken whole or not at all, and `local` is freed).
    pub(crate) fn post_remote(&mut self, wr: RemoteWr, local: Local) -> Result<u64> {
        let need = self.remote_need(wr, &local)?;
        // SAFETY: `local` goes into this operation's entry with the sink.
        let (sges, sinks) = unsafe { self.remote_sge(wr, &local, need) }?;
        let (op, posted) = remote_send_op(wr, &sges);
        let wr_id = self.remote_wr_id();
        let wrs = [SendWr {
            wr_id,
            signaled: true,
            solicited: false,
            op,
        }];
        // SAFETY: the SGE names `local`, a pool buffer or a region's range
        // registered with local write on this QP's PD (the endpoint checked
        // `usable_with`; or, for a READ without windows, under its sink),
        // inside its capacity (checked above). It is held by this
        // operation's entry in `self.remote` while its future waits, and
        // pinned in the ledger (recorded right below) so that a future
        // dropped before the completion hands it to the ledger, which
        // frees it only at the completion or flush, or after the QP is
        // destroyed (field order). The program reaches it meanwhile only
        // through a region's copies (`read_at`/`write_at`, through raw
        // pointers: no reference to its bytes exists), which the NIC's
        // access is outside of; a pool buffer's future gets it back only
        // after the completion.
        unsafe { self.qp.post_send_batch(&wrs) }?;
        self.ledger.record(wr_id, posted, Some(wr_id));
        let entry = RemoteEntry {
            locals: vec![local],
            sinks,
            status: None,
            wrs: 1,
        };
        self.insert_remote(wr_id, RemoteKind::Op, entry);
        Ok(wr_id)
    }

    /// Posts one-sided WRs, each with its local buffer, with one doorbell:
    /// only the last is signaled (RC completes in order, so its completion
    /// says every one is done; on a device whose READ completions may come
    /// late every READ is signaled as well). Returns the operation's wr_id
    /// (the last WR's). The caller checked the remote ranges against their
    /// grants and took `batch.len()` remote slots; local lengths are
    /// checked here, before anything is posted.
    ///
    /// # Errors
    /// As [`post_remote`](Self::post_remote), and [`Error::Internal`] for
    /// an empty batch. A post that fails part way leaves the WRs the NIC
    /// may have taken, and their buffers, with the ledger until their
    /// completion or flush.
    pub(crate) fn post_remote_batch(&mut self, batch: Vec<(RemoteWr, Local)>) -> Result<u64> {
        if batch.is_empty() {
            return Err(internal("an empty batch of remote operations".into()));
        }
        for (wr, local) in &batch {
            self.remote_need(*wr, local)?;
        }
        let reads_complete_late = self.qp.device().reads_complete_late;
        let last = batch.len() - 1;
        let mut built = Vec::with_capacity(batch.len());
        let mut records = Vec::with_capacity(batch.len());
        let mut locals = Vec::with_capacity(batch.len());
        let mut sinks = Vec::new();
        for (wr, local) in batch {
            let need = self.remote_need(wr, &local)?;
            // SAFETY: `local` goes into this operation's entry with the
            // sinks (below).
            let (sges, sink) = unsafe { self.remote_sge(wr, &local, need) }?;
            sinks.extend(sink);
            built.push((wr, sges, self.remote_wr_id()));
            locals.push(local);
        }
        let mut wrs = Vec::with_capacity(built.len());
        for (i, (wr, sges, wr_id)) in built.iter().enumerate() {
            let (op, posted) = remote_send_op(*wr, sges);
            wrs.push(SendWr {
                wr_id: *wr_id,
                signaled: i == last || (posted == PostedOp::Read && reads_complete_late),
                solicited: false,
                op,
            });
            debug_assert!(records.last().is_none_or(|&(prev, _)| prev + 1 == *wr_id));
            records.push((*wr_id, posted));
        }
        // SAFETY: each SGE names its WR's `local`, a pool buffer or a
        // region's range registered with local write on this QP's PD (the
        // endpoint checked `usable_with`; or, for a READ without windows,
        // under its sink registered above), inside its capacity
        // (checked above). Each is held by this operation's entry in
        // `self.remote` while its future waits, and pinned in the ledger
        // under its own WR (recorded right below, for every WR even when
        // the post fails part way), so that a future dropped before the
        // completion hands it to the ledger, which frees it only at that
        // WR's completion or flush (or a later WR's), or after the QP is
        // destroyed (field order). The program reaches them meanwhile only
        // through a region's copies (raw pointers, no references), which
        // the NIC's access is outside of; pool buffers come back to the
        // future only after the last WR's completion.
        let posted = unsafe { self.qp.post_send_batch(&wrs) };
        drop(wrs);
        for &(wr_id, op) in &records {
            self.ledger.record(wr_id, op, Some(wr_id));
        }
        let wr_id = records[last].0;
        let entry = RemoteEntry {
            locals,
            sinks,
            status: None,
            wrs: records.len() as u16,
        };
        self.insert_remote(wr_id, RemoteKind::Op, entry);
        if let Err(e) = posted {
            // Nobody waits: the buffers stay with the ledger, and the
            // slots until a completion or the QP's end (a failed post
            // means a failed QP).
            self.abandon_remote(wr_id);
            return Err(e);
        }
        Ok(wr_id)
    }

    /// The status of remote WR `wr_id` and its local buffer once it
    /// completed (the entry is gone then); registers `cx`'s waker
    /// otherwise. `None` for a wr_id this QP does not know.
    pub(crate) fn poll_remote(
        &mut self,
        wr_id: u64,
        cx: &mut Context<'_>,
    ) -> Poll<Option<(WcStatus, Vec<Local>)>> {
        let Some(op) = self.remote.get_mut(&wr_id) else {
            return Poll::Ready(None);
        };
        if op.status.is_none() {
            op.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let op = self.remote.remove(&wr_id).expect("checked above");
        self.remote_slot_freed();
        Poll::Ready(op.status.map(|s| (s, op.locals)))
    }

    /// Whether remote WR `wr_id`'s completion came (or the WR is gone):
    /// [`poll_remote`](Self::poll_remote) is Ready for it.
    pub(crate) fn remote_done(&self, wr_id: u64) -> bool {
        self.remote.get(&wr_id).is_none_or(|op| op.status.is_some())
    }

    /// The future waiting for remote WR `wr_id` was dropped (or gave up on
    /// a failed connection): its local buffer goes to the ledger until the
    /// WR completes or is flushed; the slot stays taken until then.
    pub(crate) fn abandon_remote(&mut self, wr_id: u64) {
        let Some(op) = self.remote.get_mut(&wr_id) else {
            return;
        };
        if op.status.is_some() {
            self.remote.remove(&wr_id);
            self.remote_slot_freed();
            return;
        }
        op.abandoned = true;
        op.waker = None;
        let locals = std::mem::take(&mut op.locals);
        let first = wr_id - (locals.len() as u64).saturating_sub(1);
        for (key, local) in (first..).zip(locals) {
            drop(self.ledger.release(key, Held::Local(local)));
        }
    }

    /// What remote WR `wr_id` did, for its error.
    pub(crate) fn remote_op_name(&self, wr_id: u64) -> &'static str {
        match (
            self.ledger.op(wr_id),
            self.remote.get(&wr_id).map(|o| o.kind),
        ) {
            (_, Some(RemoteKind::Bind { .. })) => "memory window bind (grant)",
            (_, Some(RemoteKind::Revoke { .. })) => "memory window invalidation (revoke)",
            (Some(PostedOp::Read), _) => "RDMA READ",
            (Some(PostedOp::Write), _) => "RDMA WRITE",
            (Some(PostedOp::Atomic), _) => "ATOMIC",
            _ => "remote memory operation",
        }
    }

    /// Remote WR `wr_id` completed (or was flushed) with `status`: the
    /// ledger lets go of what it pinned, a grant's window whose revocation
    /// completed (or whose bind or revocation failed, on a QP now in
    /// error) is deallocated and its region let go, and the waiting future
    /// is woken.
    pub(crate) fn remote_completed(&mut self, wr_id: u64, status: WcStatus) {
        // A READ's sink key dies before its buffer can be let go.
        if let Some(op) = self.remote.get_mut(&wr_id) {
            op.sinks.clear();
        }
        self.ledger.complete(wr_id);
        let Some(op) = self.remote.get_mut(&wr_id) else {
            return;
        };
        op.status = Some(status);
        let kind = op.kind;
        let abandoned = op.abandoned;
        if let Some(w) = op.waker.take() {
            w.wake();
        }
        match kind {
            RemoteKind::Revoke { grant } => self.drop_grant(grant),
            RemoteKind::Bind { grant } if status != WcStatus::Success => self.drop_grant(grant),
            _ => {}
        }
        if abandoned {
            self.remote.remove(&wr_id);
            self.remote_slot_freed();
        }
    }

    /// Deallocates grant `grant`'s window (its key opens nothing from
    /// then on), then lets its region go.
    fn drop_grant(&mut self, grant: u64) {
        drop(self.grant_windows.remove(&grant));
        drop(self.scoped.grants.remove(&grant));
        self.grant_regions.remove(&grant);
    }

    /// Binds a type-2 window on this QP over `len` bytes at `offset` of
    /// `region` with exactly `access` (a signaled bind); returns the
    /// bind's wr_id (which is also the grant's id) and the window's key.
    /// The region is kept until the window is deallocated.
    ///
    /// # Errors
    /// [`Error::ResourceLimit`] at [`MAX_GRANTS`] windows on this
    /// connection or the device's `max_mw`; [`Error::Verbs`] if the bind
    /// cannot be posted.
    pub(crate) fn bind_grant(
        &mut self,
        region: &LocalRegion,
        offset: u64,
        len: u64,
        access: GrantAccess,
    ) -> Result<(u64, u32)> {
        if access.atomic {
            self.qp.device().check_atomics()?;
        }
        if self.grants_held() >= MAX_GRANTS {
            return Err(Error::ResourceLimit {
                resource: crate::error::Resource::MemoryWindows,
                limit: Some(MAX_GRANTS as u64),
                op: "grant (per-connection quota of memory windows)",
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
            });
        }
        if self.qp.has_own_pd() {
            return self.register_grant(region, offset, len, access);
        }
        let mr = region.raw_mr();
        if mr == 0 {
            return Err(internal("region without a memory region to bind on".into()));
        }
        let mut window = MemoryWindow::alloc(self.qp.device())?;
        let wr_id = self.remote_wr_id();
        let target = BindTarget {
            mr,
            addr: region.addr() + offset,
            len,
        };
        // SAFETY: `mr` is the live MR under the region (a pool buffer or
        // `register_local` memory, registered with LOCAL_WRITE and MW_BIND
        // on the device's shared PD, this QP's PD: the endpoint checked
        // `usable_with`), and the range
        // lies inside it (the caller checked it). The region is kept in
        // `self.grant_regions` until the window is deallocated: at its
        // revocation's completion, a failed bind, or this struct's drop,
        // where `grant_windows` drops before the QP and the regions.
        let rkey = unsafe {
            self.qp.post_bind_mw(
                wr_id,
                &mut window,
                target,
                WindowAccess::Grant {
                    read: access.read,
                    write: access.write,
                    atomic: access.atomic,
                },
                true,
            )
        }?;
        self.grant_windows.insert(wr_id, window);
        self.grant_regions.insert(wr_id, (region.clone(), len));
        self.insert_remote(
            wr_id,
            RemoteKind::Bind { grant: wr_id },
            RemoteEntry::default(),
        );
        Ok((wr_id, rkey))
    }

    /// A grant without memory windows: a memory region over exactly the
    /// granted bytes with exactly the granted rights on this connection's
    /// own PD (no WR posted). The grant is complete at once: its id is
    /// entered as a bind that succeeded, for the caller's wait.
    fn register_grant(
        &mut self,
        region: &LocalRegion,
        offset: u64,
        len: u64,
        access: GrantAccess,
    ) -> Result<(u64, u32)> {
        let addr = region.addr() + offset;
        let access = MrAccess::Grant {
            read: access.read,
            write: access.write,
            atomic: access.atomic,
        };
        // SAFETY: the region is kept in `self.grant_regions` until the
        // registration is dropped (`drop_grant` drops it first; `scoped`
        // drops before `grant_regions`), and the range lies inside it
        // (the caller checked it).
        let mr = unsafe { self.register_scoped(addr, len, access) }?;
        let grant = self.remote_wr_id();
        let rkey = mr.rkey();
        self.scoped.grants.insert(grant, mr);
        self.grant_regions.insert(grant, (region.clone(), len));
        let done = RemoteEntry {
            status: Some(WcStatus::Success),
            ..RemoteEntry::default()
        };
        self.insert_remote(grant, RemoteKind::Bind { grant }, done);
        Ok((grant, rkey))
    }

    /// Posts the invalidation of grant `grant`'s window (signaled) and
    /// returns its wr_id; `None` when the grant's window is already gone.
    /// With `abandoned`, nobody waits for it (a dropped `Grant`): with
    /// every remote slot taken it is queued and posted when one frees
    /// (`None` then too). A caller that waits takes a slot first
    /// ([`poll_remote_slot`](Self::poll_remote_slot)).
    ///
    /// # Errors
    /// [`Error::Verbs`] if the LOCAL_INV cannot be posted.
    pub(crate) fn revoke_grant(&mut self, grant: u64, abandoned: bool) -> Result<Option<u64>> {
        if self.scoped.grants.contains_key(&grant) {
            // No window: deregistering the region kills its key now.
            self.drop_grant(grant);
            return Ok(None);
        }
        let Some(window) = self.grant_windows.get(&grant) else {
            return Ok(None);
        };
        if abandoned && self.remote_wrs() >= usize::from(REMOTE_SLOTS) {
            if !self.pending_revokes.contains(&grant) {
                self.pending_revokes.push(grant);
            }
            return Ok(None);
        }
        let rkey = window.rkey();
        let wr_id = self.remote_wr_id();
        self.qp.post_local_inv(wr_id, rkey, true)?;
        self.insert_remote(wr_id, RemoteKind::Revoke { grant }, RemoteEntry::default());
        if abandoned {
            self.abandon_remote(wr_id);
        }
        Ok(Some(wr_id))
    }
}
