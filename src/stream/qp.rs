//! The queue pair of a byte stream, owning every buffer the NIC may touch
//! for it: the registered send buffer that RDMA WRITE WITH IMM work
//! requests (WRs) read, and the receive rings the peer writes (the
//! handshake's and those registered when the ring grew), with the memory
//! windows that open them to the peer on this QP only.
//!
//! It mirrors the message endpoint's QP adapter (`message::qp`): the verbs
//! layer below posts and polls ([`RcQueuePair`]); this adapter decides what
//! a WR names and how long that memory stays allocated. Every send-queue
//! WR is recorded in a [`Ledger`] with the send buffer it reads (when it
//! reads one: not an inline or zero-length WR), so a send buffer given up
//! while a posted WR still names it (back to the device's cache when the
//! stream goes idle, or replaced by a larger one) is kept until that WR's
//! completion or flush. The `unsafe` of posting WRs with scatter/gather
//! elements (SGEs) and of binding windows stays here, in the one module of
//! the stream runtime that opts into `unsafe` (a scoped `allow`, each block
//! with its `SAFETY:` comment). Drop order: the windows (in `Drop`), then
//! the QP is destroyed, then the ledger, the send buffer and the rings are
//! deregistered (field order).
//!
//! # Without immediate data (iWARP)
//!
//! iWARP (RFC 5040) has no RDMA WRITE WITH IMM. On such a device every
//! message of the stream is posted as an RDMA WRITE of its payload (none
//! for a control message), unsignaled, followed by a SEND of the 4-byte
//! immediate (big-endian, inline) with the message's wr_id, signaling and
//! solicited bit: one WR pair per message, the same deadlock argument and
//! the same receive-WR accounting, since the SEND consumes the one receive
//! WR the WRITE WITH IMM would have. RDMAP's ordering (RFC 5040, 5.5)
//! places the WRITE's bytes before the SEND completes at the receiver.
//! Receive WRs then name a 4-byte slot each of a small registered buffer
//! ([`ImmSlots`]); [`StreamQp::poll`] turns a slot's SEND back into the
//! completion an RDMA WRITE WITH IMM would have given, so nothing above
//! this adapter tells the transports apart. rsocket's iWARP mode moves its
//! data the same way. The peer learns the mode in the handshake
//! (`Capabilities::immediate_data`), which refuses a mismatch. MPA's
//! initiator sends the first frame (RFC 5044): the connecting side opens
//! with a CREDIT (`StreamCore::speak_first`) and the accepting side's
//! connection posts nothing before its first receive
//! (`RcQueuePair::awaiting_initiator`).

use std::sync::{Arc, Mutex, OnceLock};

use crate::config::RdmaConfig;
use crate::error::{Error, Result};
use crate::verbs::count::Counted;
use crate::verbs::events::CqEvents;
use crate::verbs::ledger::{Ledger, PostedOp};
use crate::verbs::mw::{MemoryWindow, WindowAccess};
use crate::verbs::rc::{
    BindTarget, Completion, MrAccess, OpenDevice, RcQueuePair, RegisteredBuffer, SendOp,
    SendPayload, SendWr, Sge, WcKind, WcStatus, Work,
};
use crate::verbs::watch::{DeviceCache, cached};

/// Bytes of idle stream send buffers each device keeps registered for
/// reuse: 4 MiB (64 buffers of the default 64 KiB), so connections that
/// take turns sending do not register and deregister a buffer per
/// response, while thousands of idle connections pin none.
pub(crate) const SEND_BUFFER_CACHE_BYTES: usize = 4 << 20;

/// A grown ring's window bind ([`StreamQp::add_ring`]).
pub(crate) const RING_BIND: Work = Work::Window(2);

/// The handshake ring's window bind ([`StreamQp::bind_ring_window`]).
const FIRST_RING_BIND: Work = Work::Window(0);

/// Idle send buffers on one device's shared protection domain (PD), kept
/// for the next stream on it that has data to send (at most
/// [`SEND_BUFFER_CACHE_BYTES`] in all).
struct SendBufferCache {
    device: Arc<OpenDevice>,
    idle: Mutex<Vec<(RegisteredBuffer, Counted)>>,
}

impl SendBufferCache {
    /// The cache of `device` (one per device, for the process's life, like
    /// the opened device itself).
    fn of(device: &Arc<OpenDevice>) -> Arc<SendBufferCache> {
        static CACHES: DeviceCache<Arc<SendBufferCache>> = OnceLock::new();
        let made = cached(&CACHES, device, || {
            Ok::<_, std::convert::Infallible>(Arc::new(SendBufferCache {
                device: Arc::clone(device),
                idle: Mutex::new(Vec::new()),
            }))
        });
        let Ok(cache) = made;
        cache
    }

    /// A registered, local-only send buffer of `len` bytes on the device's
    /// PD: a cached idle one, or a new registration.
    fn take(&self, len: usize) -> Result<RegisteredBuffer> {
        let cached = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.iter()
                .position(|(b, _)| b.len() == len)
                .map(|i| idle.swap_remove(i).0)
        };
        match cached {
            Some(b) => Ok(b),
            None => self.device.register_buffer(len, MrAccess::LocalWrite),
        }
    }

    /// Keeps `buf` for reuse, or deregisters it when the cache is full.
    /// No posted WR may name it any more.
    fn put(&self, buf: RegisteredBuffer) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let cached: usize = idle.iter().map(|(b, _)| b.len()).sum();
        if cached + buf.len() <= SEND_BUFFER_CACHE_BYTES {
            let counted = Counted::idle_send_buffer(buf.len());
            idle.push((buf, counted));
        }
    }
}

/// How a stream's receive ring is opened to the peer: never by a key that
/// any other connection's QP could use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RingIsolation {
    /// The ring MR has no remote access; a type-2 window bound on this QP
    /// grants REMOTE_WRITE over exactly the ring.
    Window,
    /// A device without windows: the QP and its buffers live on a PD of
    /// their own, so the ring's REMOTE_WRITE key is useless from any other
    /// QP.
    OwnPd,
}

/// A receive ring registered after the handshake: generation `generation`
/// of a stream whose ring grew ([`StreamQp::add_ring`]).
struct GrownRing {
    generation: u32,
    /// Opens `buf` to the peer on this QP; dropped (deallocated, so its key
    /// dies) before `buf` is deregistered (field order, and `StreamQp`'s
    /// `Drop` before the QP).
    window: Option<MemoryWindow>,
    buf: RegisteredBuffer,
}

/// The unsignaled RDMA WRITE half of a message posted without immediate
/// data carries its SEND's core wr_id with this bit, in the adapter's
/// window space: it completes only with an error, which
/// [`StreamQp::poll`] reports as the message's (`Work::Core`).
const WRITE_HALF: u64 = 1 << 59;

/// Bytes of one immediate carried in a SEND (a big-endian `u32`).
const IMM_LEN: usize = 4;

/// The receive buffer of a stream without immediate data: one 4-byte slot
/// per receive WR (its wr_id is `Work::Recv(slot)`), registered with local
/// write only on the QP's PD. A slot is posted again only after its
/// receive completed or was flushed (`free`), so the value read at its
/// completion is the one the peer's SEND wrote.
struct ImmSlots {
    buf: RegisteredBuffer,
    free: Vec<u32>,
    /// Whether each slot is named by a posted receive WR.
    posted: Vec<bool>,
}

impl ImmSlots {
    fn new(qp: &RcQueuePair, slots: u32) -> Result<Self> {
        let buf = qp.register_buffer(slots as usize * IMM_LEN, MrAccess::LocalWrite)?;
        Ok(ImmSlots {
            buf,
            // Popped from the end: slot 0 first.
            free: (0..slots).rev().collect(),
            posted: vec![false; slots as usize],
        })
    }

    /// A free slot, marked posted.
    fn take(&mut self) -> Option<u32> {
        let slot = self.free.pop()?;
        self.posted[slot as usize] = true;
        Some(slot)
    }

    /// The slot `wr_id` names back to the free list; the immediate it
    /// holds, when the receive succeeded with exactly 4 bytes.
    fn complete(&mut self, slot: u64, ok: bool, byte_len: u32) -> Option<u32> {
        let slot = usize::try_from(slot).ok()?;
        if !std::mem::replace(self.posted.get_mut(slot)?, false) {
            return None;
        }
        self.free.push(slot as u32);
        if !ok || byte_len as usize != IMM_LEN {
            return None;
        }
        let mut imm = [0u8; IMM_LEN];
        self.buf.read_at(slot * IMM_LEN, &mut imm).ok()?;
        Some(u32::from_be_bytes(imm))
    }
}

/// One RDMA WRITE WITH IMM for [`StreamQp::post_write`]: `len` bytes of the
/// send buffer at `local_offset` (none for `len == 0`, a control message),
/// to `remote_addr` with `rkey`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingWrite {
    pub work: Work,
    pub local_offset: u32,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub imm: u32,
    pub signaled: bool,
    /// Copy the payload into the WQE (`IBV_SEND_INLINE`).
    pub inline: bool,
}

/// A byte stream's QP with its send buffer and receive rings.
pub(crate) struct StreamQp {
    // Drop order: the handshake ring's window (first field) and the grown
    // rings' windows (in Drop) before the QP they are bound to and the MRs
    // under them; then the QP is destroyed before any buffer below is
    // deregistered.
    ring_window: Option<MemoryWindow>,
    qp: RcQueuePair,
    /// `Some` on a device without immediate data: the receive WRs' slots
    /// (see the module docs). Dropped after the QP.
    imm_slots: Option<ImmSlots>,
    /// Posted send-queue WRs not known complete, and the send buffers
    /// given up while one of them still names it (by buffer id).
    ledger: Ledger<u32, RegisteredBuffer>,
    /// `None` while an on-demand send buffer is not held.
    send_buf: Option<RegisteredBuffer>,
    /// The ledger's key of `send_buf` (a new one for every buffer held).
    send_buf_id: u32,
    send_buf_len: usize,
    /// Take the send buffer from the device's cache only while there is
    /// data to send, instead of holding one for the QP's life (not on a QP
    /// with a PD of its own, which cannot use the device's buffers).
    send_buf_on_demand: bool,
    cache: Arc<SendBufferCache>,
    /// `None` once the ring of the handshake (generation 0) was retired
    /// after a growth.
    recv_ring: Option<RegisteredBuffer>,
    /// Receive rings registered after the handshake, oldest first.
    grown_rings: Vec<GrownRing>,
    /// The oldest ring generation still held.
    ring_base: u32,
    /// Reused for the payload of inline WRs (no allocation per post).
    inline_scratch: Vec<u8>,
    ring_isolation: RingIsolation,
}

impl AsMut<RcQueuePair> for StreamQp {
    fn as_mut(&mut self) -> &mut RcQueuePair {
        &mut self.qp
    }
}

impl StreamQp {
    /// Wraps `qp` (in RESET) with a send buffer of `cfg.send_buffer_size`
    /// bytes and a receive ring of `cfg.ring_size` bytes, opened to the
    /// peer by a window (allocated here, bound by
    /// [`bind_ring_window`](Self::bind_ring_window)) or, on a QP with a PD
    /// of its own, by the ring MR's own key. The send buffer is taken now
    /// even when on demand (and given back once the connection is idle): a
    /// process that cannot pin one busy connection's memory
    /// (RLIMIT_MEMLOCK) fails at connect or accept, where `auto://` can
    /// still fall back to TCP, not at its first write.
    ///
    /// # Errors
    /// [`Error::ResourceLimit`] at RLIMIT_MEMLOCK or the device's
    /// `max_mr`/`max_mw`, [`Error::Verbs`] for other failures.
    pub(crate) fn new(qp: RcQueuePair, cfg: &RdmaConfig) -> Result<Self> {
        let ring_isolation = if qp.has_own_pd() {
            RingIsolation::OwnPd
        } else {
            RingIsolation::Window
        };
        let send_buf_on_demand = ring_isolation != RingIsolation::OwnPd;
        let cache = SendBufferCache::of(qp.device());
        let send_buf_len = cfg.send_buffer_size as usize;
        let send_buf = if send_buf_on_demand {
            Some(cache.take(send_buf_len)?)
        } else if send_buf_len == 0 {
            None
        } else {
            Some(qp.register_buffer(send_buf_len, MrAccess::LocalWrite)?)
        };
        let recv_ring = qp.register_buffer(cfg.ring_size as usize, ring_access(ring_isolation))?;
        let ring_window = match ring_isolation {
            RingIsolation::Window => Some(MemoryWindow::alloc(qp.device())?),
            RingIsolation::OwnPd => None,
        };
        let imm_slots = if qp.device().immediate_data {
            None
        } else {
            Some(ImmSlots::new(&qp, u32::from(cfg.recv_queue_depth))?)
        };
        Ok(StreamQp {
            ring_window,
            qp,
            imm_slots,
            ledger: Ledger::default(),
            send_buf,
            send_buf_id: 0,
            send_buf_len,
            send_buf_on_demand,
            cache,
            recv_ring: Some(recv_ring),
            grown_rings: Vec::new(),
            ring_base: 0,
            inline_scratch: Vec::new(),
            ring_isolation,
        })
    }

    /// The verbs QP (state, probes, events).
    pub(crate) fn rc(&self) -> &RcQueuePair {
        &self.qp
    }

    /// The verbs QP, mutably (state transitions, receive WRs, probes).
    pub(crate) fn rc_mut(&mut self) -> &mut RcQueuePair {
        &mut self.qp
    }

    /// Whether the device carries immediate data (false on iWARP: see the
    /// module docs); announced in the handshake.
    pub(crate) fn immediate_data(&self) -> bool {
        self.imm_slots.is_none()
    }

    /// Posts `n` receive WRs, each consumed by one message of the peer:
    /// zero-length ones for RDMA WRITE WITH IMM, or each with a free
    /// 4-byte slot for the immediate's SEND on a device without immediate
    /// data.
    ///
    /// # Errors
    /// [`Error::Verbs`] if the post fails; [`Error::Internal`] if more
    /// receive WRs would be posted than slots exist (the runtime keeps at
    /// most `recv_queue_depth` posted).
    pub(crate) fn post_recvs(&mut self, n: u32) -> Result<()> {
        let Some(slots) = &mut self.imm_slots else {
            return self.qp.post_recvs(n);
        };
        if n as usize > slots.free.len() {
            return Err(Error::Internal(format!(
                "{n} receive WRs posted with {} immediate slots free",
                slots.free.len()
            )));
        }
        let (addr, lkey) = (slots.buf.addr(), slots.buf.lkey());
        let wrs: Vec<(u64, Sge)> = (0..n)
            .filter_map(|_| slots.take())
            .map(|slot| {
                let sge = Sge {
                    addr: addr + u64::from(slot) * IMM_LEN as u64,
                    len: IMM_LEN as u32,
                    lkey,
                };
                (Work::Recv(u64::from(slot)).wr_id(), sge)
            })
            .collect();
        // SAFETY: each SGE names a 4-byte slot of `imm_slots.buf`,
        // registered with local write on this QP's PD, a field dropped
        // after the QP is destroyed. A slot left the free list above and
        // returns to it only at its completion or flush (`poll`), so no
        // two posted receives share one and the program reads a slot only
        // after the NIC is done with it. On an error the slots stay out of
        // the free list (the connection fails; a slot the NIC may still
        // write is never reused).
        unsafe { self.qp.post_recv_sges(&wrs) }
    }

    /// Where the CQ's events arrive, to wait without the lock.
    pub(crate) fn cq_events(&self) -> Arc<CqEvents> {
        self.qp.cq_events()
    }

    /// The send buffer, taking one from the device's cache (or registering
    /// one) if an on-demand buffer is not held now. The caller copies only
    /// into ranges the protocol core reports free (no posted WR reads
    /// them).
    ///
    /// # Errors
    /// [`Error::ResourceLimit`]/[`Error::Verbs`] (`ibv_reg_mr`, errno
    /// kept: `ENOMEM` at RLIMIT_MEMLOCK) when a new buffer cannot be
    /// registered.
    pub(crate) fn ensure_send_buf(&mut self) -> Result<&mut RegisteredBuffer> {
        match &mut self.send_buf {
            Some(buf) => Ok(buf),
            slot @ None => {
                let buf = self.cache.take(self.send_buf_len)?;
                self.send_buf_id = self.send_buf_id.wrapping_add(1);
                Ok(slot.insert(buf))
            }
        }
    }

    /// Gives the current send buffer up: back to the device's cache (an
    /// on-demand one) or deregistered, at once if no posted WR names it,
    /// by the ledger at that WR's completion or flush otherwise.
    fn give_up_send_buf(&mut self) {
        let Some(buf) = self.send_buf.take() else {
            return;
        };
        if let Some(buf) = self.ledger.release(self.send_buf_id, buf) {
            if self.send_buf_on_demand {
                self.cache.put(buf);
            }
        }
    }

    /// Whether an on-demand send buffer is taken (one a QP on a PD of its
    /// own keeps for its life does not count).
    pub(crate) fn holds_on_demand_send_buf(&self) -> bool {
        self.send_buf_on_demand && self.send_buf.is_some()
    }

    /// Gives an on-demand send buffer back to the device's cache once the
    /// stream holds no bytes in it (the core's `send_buf_in_use` is 0 and
    /// the QP is healthy). No-op for a buffer held for the QP's life.
    pub(crate) fn release_send_buf(&mut self) {
        if self.send_buf_on_demand {
            self.give_up_send_buf();
        }
    }

    /// Replaces the send buffer with one of `len` bytes: from the device's
    /// cache (or a new registration) for an on-demand buffer, which gives
    /// the old one back to the cache; a new registration on the QP's PD
    /// otherwise. The core holds no bytes in the current buffer
    /// (`send_buf_in_use` is 0); a WR that still reads it keeps it through
    /// the ledger.
    ///
    /// # Errors
    /// As [`RcQueuePair::register_buffer`] ([`Error::ResourceLimit`] at
    /// RLIMIT_MEMLOCK): the current buffer and length stay as they were.
    pub(crate) fn resize_send_buf(&mut self, len: usize) -> Result<()> {
        if len == self.send_buf_len {
            return Ok(());
        }
        let new = if self.send_buf_on_demand {
            self.cache.take(len)?
        } else {
            self.qp.register_buffer(len, MrAccess::LocalWrite)?
        };
        self.send_buf_len = len;
        self.give_up_send_buf();
        self.send_buf = Some(new);
        self.send_buf_id = self.send_buf_id.wrapping_add(1);
        Ok(())
    }

    /// Registered bytes this QP holds now: the receive rings, the send
    /// buffer while held, and the immediates' receive slots on a device
    /// without immediate data (4 bytes per receive WR).
    pub(crate) fn registered_bytes(&self) -> usize {
        self.imm_slots.as_ref().map_or(0, |s| s.buf.len())
            + self.recv_ring.as_ref().map_or(0, RegisteredBuffer::len)
            + self.grown_rings.iter().map(|r| r.buf.len()).sum::<usize>()
            + self.send_buf.as_ref().map_or(0, RegisteredBuffer::len)
    }

    /// How the receive ring is opened to the peer.
    pub(crate) fn ring_isolation(&self) -> RingIsolation {
        self.ring_isolation
    }

    /// The address of the handshake's receive ring (0 once retired).
    pub(crate) fn first_ring_addr(&self) -> u64 {
        self.recv_ring.as_ref().map_or(0, RegisteredBuffer::addr)
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
    /// `StreamCore::offer_ring`), or, on a QP with a PD of its own, the
    /// MR's own key. Returns the ring's address and key. Uses the
    /// send-queue slot `RdmaConfig::stream_sizes` keeps for it.
    ///
    /// # Errors
    /// [`Error::ResourceLimit`] at RLIMIT_MEMLOCK or the device's
    /// `max_mr`/`max_mw`, [`Error::Verbs`] if registering, allocating the
    /// window or posting the bind fails. Nothing is held after an error.
    pub(crate) fn add_ring(&mut self, generation: u32, len: usize) -> Result<(u64, u32)> {
        let buf = self
            .qp
            .register_buffer(len, ring_access(self.ring_isolation))?;
        let (window, rkey) = match self.ring_isolation {
            RingIsolation::Window => {
                let mut window = MemoryWindow::alloc(self.qp.device())?;
                let target = BindTarget {
                    mr: buf.raw_mr() as usize,
                    addr: buf.addr(),
                    len: buf.len() as u64,
                };
                // SAFETY: `buf` is registered with MW_BIND and LOCAL_WRITE
                // on this QP's PD and covers the target; it is kept in
                // `grown_rings` with the window, which is dropped (and so
                // deallocated) before `buf` in every path (field order,
                // Drop, retire_rings_before), so the window never outlives
                // the memory it opens. On an error both are dropped here,
                // window first.
                let rkey = unsafe {
                    self.qp.post_bind_mw(
                        RING_BIND.wr_id(),
                        &mut window,
                        target,
                        WindowAccess::RemoteWrite,
                        true,
                    )
                }?;
                (Some(window), rkey)
            }
            RingIsolation::OwnPd => (None, buf.rkey()),
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

    /// The key the peer writes the handshake's ring with: the window's key
    /// once [`bind_ring_window`](Self::bind_ring_window) ran (announced in
    /// the handshake before, since the bind chooses it), or the ring MR's
    /// own key on a QP with a PD of its own.
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
        let wr_id = FIRST_RING_BIND.wr_id();
        let want = window.next_rkey();
        // SAFETY: `mr` is the live MR of the ring (registered with MW_BIND
        // and LOCAL_WRITE on this QP's PD), which lives as long as this
        // QP unless retired, and the window is dropped before it in every
        // path (field order, `retire_rings_before`), so the window never
        // outlives the memory it opens.
        let posted = unsafe {
            self.qp.post_bind_mw(
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
            if let Some(wc) = wcs.iter().find(|wc| wc.work == FIRST_RING_BIND) {
                if wc.status != WcStatus::Success {
                    return Err(Error::WorkCompletion {
                        op: "BIND_MW",
                        status: wc.status.code(),
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

    /// Posts one RDMA WRITE WITH IMM (solicited: the peer may arm its CQ
    /// for solicited events only, see `RcQueuePair::arm`) and records it in
    /// the ledger with the send buffer it reads, if any.
    ///
    /// # Errors
    /// [`Error::Internal`] for a range outside the send buffer or a data
    /// WR without one; [`Error::Verbs`] if the post fails.
    pub(crate) fn post_write(&mut self, w: RingWrite) -> Result<()> {
        // Taken and put back: no allocation per inline post (lost only on
        // an error return).
        let mut tmp = std::mem::take(&mut self.inline_scratch);
        tmp.clear();
        let (payload, pin) = if w.len == 0 {
            (SendPayload::None, None)
        } else {
            let buf = self
                .send_buf
                .as_ref()
                .ok_or_else(|| Error::Internal("data WR posted without a send buffer".into()))?;
            let off = w.local_offset as usize;
            if off
                .checked_add(w.len as usize)
                .is_none_or(|end| end > buf.len())
            {
                return Err(Error::Internal(format!(
                    "a WRITE of {} bytes at {off} beyond the send buffer of {} bytes",
                    w.len,
                    buf.len()
                )));
            }
            if w.inline {
                tmp.resize(w.len as usize, 0);
                buf.read_at(off, &mut tmp).map_err(|source| Error::Verbs {
                    op: "inline copy",
                    source,
                })?;
                // Copied into the WQE at posting: nothing to hold.
                (SendPayload::Inline(&tmp), None)
            } else {
                let sge = Sge {
                    addr: buf.addr() + u64::from(w.local_offset),
                    len: w.len,
                    lkey: buf.lkey(),
                };
                (SendPayload::Sge(sge), Some(self.send_buf_id))
            }
        };
        let wr_id = w.work.wr_id();
        let imm_be = w.imm.to_be_bytes();
        let with_imm = self.imm_slots.is_none();
        let message = SendWr {
            wr_id,
            signaled: w.signaled,
            solicited: true,
            op: if with_imm {
                SendOp::WriteImm {
                    payload,
                    remote_addr: w.remote_addr,
                    rkey: w.rkey,
                    imm: w.imm,
                }
            } else {
                // No immediate data: the immediate's SEND, after the
                // payload's RDMA WRITE (module docs).
                SendOp::Send {
                    payload: SendPayload::Inline(&imm_be),
                }
            },
        };
        let write_half = (!with_imm && w.len > 0).then(|| SendWr {
            wr_id: match w.work {
                Work::Core(n) => Work::Window(WRITE_HALF | n).wr_id(),
                _ => wr_id,
            },
            signaled: false,
            solicited: false,
            op: SendOp::Write {
                payload,
                remote_addr: w.remote_addr,
                rkey: w.rkey,
            },
        });
        let pair;
        let wrs: &[SendWr<'_>] = match write_half {
            Some(half) => {
                pair = [half, message];
                &pair
            }
            None => std::slice::from_ref(&message),
        };
        // SAFETY: an SGE (of the WRITE WITH IMM, or of the WRITE half
        // without immediate data) names a range inside the send buffer
        // (checked above), registered with local write on this QP's PD (a
        // cached buffer is on the device's PD, which an on-demand QP
        // shares). The immediate's SEND is inline. The ledger records
        // right below that this message names that buffer (under the
        // SEND's wr_id, which completes after the WRITE half), so
        // giving it up before the WR's completion or flush
        // (`give_up_send_buf`) leaves it with the ledger, a field dropped
        // after the QP is destroyed. The program writes the buffer only
        // in ranges the protocol core reports free, never one a posted WR
        // reads. Inline payloads are copied at posting.
        let posted = unsafe { self.qp.post_send_batch(wrs) };
        // A single WR is taken whole or not at all. Of a pair, the WRITE
        // may have been taken without its SEND: it is recorded anyway, and
        // its error or flush completion (reported with the SEND's wr_id by
        // `poll`) ends the record.
        if posted.is_ok() || wrs.len() > 1 {
            self.ledger.record(wr_id, PostedOp::Write, pin);
        }
        self.inline_scratch = tmp;
        posted
    }

    /// Moves this QP's completions into `out` without blocking; a
    /// send-queue completion (successful or flushed) tells the ledger that
    /// WR and every earlier one are done, which frees a send buffer given
    /// up while they read it.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_poll_cq` fails.
    pub(crate) fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        let start = out.len();
        let polled = self.qp.poll(out);
        for wc in &mut out[start..] {
            match (wc.work, &mut self.imm_slots) {
                (Work::Recv(slot), Some(slots)) => {
                    // The immediate's SEND: reported as the RDMA WRITE
                    // WITH IMM it stands for. A SEND of another length
                    // stays a plain receive (a protocol error above).
                    if let Some(imm) = slots.complete(slot, wc.ok(), wc.byte_len) {
                        wc.kind = WcKind::RecvImm;
                        wc.imm = imm;
                        wc.byte_len = 0;
                    }
                }
                (Work::Window(n), Some(_)) if n & WRITE_HALF != 0 => {
                    // A failed or flushed WRITE half: its message's.
                    wc.work = Work::Core(n & !WRITE_HALF);
                }
                _ => {}
            }
            if !matches!(wc.work, Work::Recv(_)) {
                self.ledger.complete(wc.wr_id());
            }
        }
        polled
    }

    /// Posts an RDMA WRITE WITH IMM of `len` bytes of the send buffer to
    /// `remote_addr` with `rkey`, as a misbehaving peer would (test hook).
    #[cfg(tokio_rdma_guest)]
    pub(crate) fn forge_ring_write(&mut self, remote_addr: u64, rkey: u32, len: u32) -> Result<()> {
        self.ensure_send_buf()?;
        self.post_write(RingWrite {
            work: Work::Window(0xF0),
            local_offset: 0,
            len,
            remote_addr,
            rkey,
            imm: 0,
            signaled: true,
            inline: false,
        })
    }
}

/// The access a receive ring is registered with.
fn ring_access(isolation: RingIsolation) -> MrAccess {
    match isolation {
        RingIsolation::Window => MrAccess::LocalWriteMwBind,
        RingIsolation::OwnPd => MrAccess::LocalWriteRemoteWrite,
    }
}

impl Drop for StreamQp {
    fn drop(&mut self) {
        // The windows before the QP they are bound to (the handshake
        // ring's is the first field, dropped first anyway).
        drop(self.ring_window.take());
        for ring in &mut self.grown_rings {
            drop(ring.window.take());
        }
    }
}
