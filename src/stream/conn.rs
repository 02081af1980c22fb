//! The byte stream's part of a connection: its [`StreamState`] (the
//! [`StreamCore`], the QP adapter with its ring and send buffer
//! ([`StreamQp`]), the receive
//! backlog and the waiters) and the stream operations on the shared
//! connection. Connection setup, the handles and the driver are the
//! connection core's ([`crate::conn`]).
//!
//! Receive progress never waits for `poll_read`: whoever holds the lock (the
//! driver on every completion event, or an application call) drains the
//! CQ, reposts receive WRs, returns credit and posts what the application
//! wrote while credit was short, and the driver moves arrived bytes out of
//! the ring (up to `recv_buffer_limit`) unless a reader is at work on them:
//! bytes a read left in the ring wait for the next read until a driver
//! tick without such reads (see `StreamState::driver_drains`). The
//! application side copies into the registered send buffer and posts
//! directly from `poll_write` (no task hop on the fast path).

use std::collections::VecDeque;
use std::io;
use std::sync::MutexGuard;
use std::task::{Context, Poll};

use bytes::Bytes;
use tracing::{debug, warn};

use crate::config::RdmaConfig;
use crate::conn::{Driven, Established, Handle, SpinWait, Started, WakerList, device_caps};
use crate::error::{Error, Result};
use crate::proto::handshake::{EndpointKind, Hello};
use crate::proto::stream::{RecvEvent, StreamCore, Transmit, TransmitKind};
use crate::proto::{ProtocolError, WriteError};
use crate::stats::{ConnectionStats, RemoteAccess};
use crate::verbs::rc::{Completion, RcQueuePair, RegisteredBuffer, WcKind, WcStatus, Work};

use super::qp::{RING_BIND, RingIsolation, RingWrite, StreamQp};

/// A stream connection: the core's shared connection around a
/// [`StreamState`].
pub(crate) type Conn = crate::conn::shared::Shared<StreamState>;

/// Everything behind the stream connection's mutex.
pub(crate) struct StreamState {
    core: StreamCore,
    qp: StreamQp,
    peer_ring_addr: u64,
    peer_rkey: u32,
    /// Bytes already moved out of the ring, oldest first.
    backlog: VecDeque<Bytes>,
    backlog_len: usize,
    /// Arrived ring segments (ring generation, offset, len) not yet moved
    /// or read, in order.
    ring_pending: VecDeque<(u32, u32, u32)>,
    /// Registering or opening a grown ring failed once: the ring stays as
    /// it is for the rest of the connection.
    growth_refused: bool,
    /// Largest length the send buffer grows to when the peer's ring grew:
    /// `max(send_buffer_size, max_ring_size)`.
    send_buf_cap: u32,
    /// A larger send buffer could not be had once: it stays as it is.
    send_buf_growth_refused: bool,
    recv_buffer_limit: usize,
    /// The driver may move arrived bytes out of the ring into the backlog.
    /// A read that left bytes in the ring clears it: the reader is at work
    /// and copies them once, where the driver's move would make two copies
    /// and an allocation. A read that leaves the ring empty sets it again,
    /// and so does a driver tick with no read that left bytes since the
    /// tick before (see [`Driven::on_tick`]), so bytes a reader left
    /// behind are moved out, and their credit returned, within two ticks
    /// of its last read.
    driver_drains: bool,
    /// A read left bytes in the ring since the driver's last tick.
    left_in_ring: bool,
    /// A write accepted bytes since the driver's last tick, and in the
    /// tick period before it: an on-demand send buffer stays taken while
    /// either holds (see [`StreamState::keeps_send_buf`]).
    wrote_since_tick: bool,
    wrote_last_period: bool,
    /// Tasks waiting in `poll_read`.
    readers: WakerList,
    /// Tasks waiting in `poll_write`/`poll_flush`.
    writers: WakerList,
    /// The connection's error, once it failed.
    error: Option<Error>,
    /// The peer disconnected (rdma_cm DISCONNECTED) or the QP failed.
    peer_gone: bool,
    /// How a reader waits, and the wait in progress.
    spin: SpinWait,
    nodelay: bool,
    stats: ConnectionStats,
    /// Reused buffer for polled completions.
    scratch: Vec<Completion>,
}

impl StreamState {
    fn wake_all(&mut self) {
        self.readers.wake_all();
        self.writers.wake_all();
    }

    fn err_io(&self) -> Option<io::Error> {
        self.error.clone().map(io::Error::from)
    }

    /// Posts every work request the core has ready, after freeing the
    /// rings the core no longer uses and offering a larger one when the
    /// core wants it (its GRANT goes out in this same call).
    fn transmit(&mut self) {
        // An iWARP responder sends nothing before the initiator's first
        // frame (`RcQueuePair::awaiting_initiator`).
        if self.qp.rc().awaiting_initiator() {
            return;
        }
        self.qp.retire_rings_before(self.core.oldest_ring());
        // The window bind goes on an idle send queue only: no WR before it
        // can then be resent after a loss. (rxe on Linux 6.1 stopped a QP
        // whose go-back-N retransmission met a bind among the WRs it
        // resent: the two-host test under 1 % loss, 4 of 4 runs.)
        let send_queue_idle = self.core.outstanding_wrs() == 0 && !self.qp.rc().probe_outstanding();
        if !self.growth_refused && send_queue_idle {
            if let Some(len) = self.core.ring_wanted() {
                self.grow_ring(len);
            }
        }
        while let Some(t) = self.core.poll_transmit() {
            if let Err(e) = self.post(&t) {
                self.fail(e);
                return;
            }
        }
    }

    /// Registers and opens a receive ring of `len` bytes and offers it to
    /// the peer. A failure (no memory to pin, no window left) is no
    /// connection error: the ring stays as it is.
    fn grow_ring(&mut self, len: u32) {
        let generation = self.core.ring_generation() + 1;
        match self.qp.add_ring(generation, len as usize) {
            Ok((addr, rkey)) => {
                self.core.offer_ring(addr, rkey);
                debug!(
                    bytes = len,
                    generation, "offering the peer a larger receive ring"
                );
            }
            Err(e) => {
                self.growth_refused = true;
                warn!(error = %e, bytes = len, "could not register a larger receive ring; keeping the current one");
            }
        }
    }

    /// Grows the send buffer to the peer's ring (up to `send_buf_cap`)
    /// while it holds nothing, after the peer's ring grew: a send buffer
    /// smaller than the peer's ring keeps fewer bytes in flight than byte
    /// credit allows (with the default 64 KiB, one 64 KiB WR at a time
    /// against a 256 KiB ring; benches/history/echo-2026-12-06.md, "A send buffer that
    /// follows the peer's ring"). Like TCP's send-buffer autotuning
    /// (`tcp_wmem`), bounded by the local config, never by the peer. A
    /// failure (no memory to pin) keeps the buffer as it is. Returns
    /// whether the buffer grew.
    fn follow_peer_ring(&mut self) -> bool {
        // Only a ring the peer grew under bulk: the handshake's ring, however
        // long, leaves `send_buffer_size` as configured.
        if self.core.peer_ring_generation() == 0 {
            return false;
        }
        let p = self.core.params();
        let want = p.peer_ring_len.min(self.send_buf_cap);
        if want <= p.send_buf_len
            || self.send_buf_growth_refused
            || self.core.send_buf_in_use() != 0
        {
            return false;
        }
        if let Err(e) = self.qp.resize_send_buf(want as usize) {
            self.send_buf_growth_refused = true;
            warn!(error = %e, bytes = want, "could not register a larger send buffer; keeping the current one");
            return false;
        }
        let resized = self.core.resize_send_buf(want);
        debug_assert!(resized, "send buffer resized while empty");
        debug!(bytes = want, "send buffer grown to the peer's ring");
        resized
    }

    fn post(&mut self, t: &Transmit) -> Result<()> {
        let (local_offset, len, remote_offset, imm, inline) = match t.kind {
            TransmitKind::Data {
                ring: _,
                local_offset,
                len,
                remote_offset,
                imm,
                inline,
            } => (local_offset, len, remote_offset, imm, inline),
            TransmitKind::Control { imm } => (0, 0, 0, imm, false),
        };
        self.qp.post_write(RingWrite {
            work: Work::Core(t.wr_id),
            local_offset,
            len,
            // The peer's address is its own business: an address near
            // 2^64 wraps, and the NIC then refuses the key's range.
            remote_addr: self.peer_ring_addr.wrapping_add(u64::from(remote_offset)),
            rkey: self.peer_rkey,
            imm,
            signaled: t.signaled,
            inline,
        })?;
        self.stats.wrs_sent += 1;
        if len > 0 {
            self.stats.bytes_sent += u64::from(len);
            if inline {
                self.stats.inline_sends += 1;
            }
        }
        Ok(())
    }

    /// Moves arrived ring bytes into the backlog while under the limit,
    /// returning their ring space (and so credit) to the peer.
    fn drain_ring(&mut self) {
        while self.backlog_len < self.recv_buffer_limit {
            let Some((ring, off, len)) = self.ring_pending.pop_front() else {
                break;
            };
            let buf = match recv_ring(&self.qp, ring)
                .and_then(|r| r.read_to_vec(off as usize, len as usize))
            {
                Ok(buf) => buf,
                Err(source) => {
                    self.fail(Error::Verbs {
                        op: "receive ring copy",
                        source,
                    });
                    return;
                }
            };
            self.core.consume(len as usize);
            self.stats.bytes_buffered += u64::from(len);
            self.backlog_len += len as usize;
            self.backlog.push_back(Bytes::from(buf));
        }
    }

    /// Handles one completion. Returns the number of receive WRs to repost.
    fn on_completion(&mut self, wc: &Completion) -> u32 {
        self.stats.completions += 1;
        if wc.ok() && matches!(wc.work, Work::Window(_) | Work::Probe) {
            // The QP adapter's own work (a window bind) or a probe, not the
            // core's.
            return 0;
        }
        if !wc.ok() {
            if wc.status == WcStatus::Flushed && (self.peer_gone || self.error.is_some()) {
                return 0;
            }
            self.peer_gone = true;
            self.core.on_connection_lost();
            let op = match wc.work {
                Work::Probe => self.qp.rc().probe_op(),
                RING_BIND => "BIND_MW (grown receive ring)",
                _ if matches!(wc.kind, WcKind::RecvImm | WcKind::Recv) => "receive",
                _ => "RDMA WRITE WITH IMM",
            };
            let err = self.qp.rc().wr_failure(Error::WorkCompletion {
                op,
                status: wc.status.code(),
            });
            self.fail(err);
            return 0;
        }
        match (wc.work, wc.kind) {
            (Work::Core(wr_id), _) => {
                if let Err(e) = self.core.on_send_complete(wr_id) {
                    self.protocol_error(e);
                }
                self.writers.wake_all();
                0
            }
            (Work::Recv(_), WcKind::RecvImm) => {
                self.stats.wrs_received += 1;
                match self.core.on_recv(wc.imm) {
                    Ok(RecvEvent::Data { ring, offset, len }) => {
                        self.stats.bytes_received += u64::from(len);
                        self.ring_pending.push_back((ring, offset, len));
                        self.readers.wake_all();
                    }
                    Ok(RecvEvent::Grant { addr, rkey, len }) => {
                        // Every DATA WR from now on writes the new ring,
                        // with fresh byte credit.
                        self.peer_ring_addr = addr;
                        self.peer_rkey = rkey;
                        debug!(bytes = len, "the peer offered a larger receive ring");
                        self.writers.wake_all();
                    }
                    Ok(RecvEvent::GrantChunk { .. } | RecvEvent::Switch) => {}
                    Ok(RecvEvent::Fin) => self.readers.wake_all(),
                    Ok(RecvEvent::Abort { code }) => {
                        self.fail(Error::PeerAborted {
                            code,
                            reason: "the peer aborted the stream",
                        });
                    }
                    // Credit: blocked writers may go on.
                    Ok(_) => self.writers.wake_all(),
                    Err(e) => self.protocol_error(e),
                }
                1
            }
            (Work::Recv(_), WcKind::Recv) => {
                self.protocol_error(ProtocolError::UnexpectedSend { len: wc.byte_len });
                0
            }
            _ => 0,
        }
    }

    /// Registers a task that waits for send progress (buffer space,
    /// send-queue slots, credit) and makes sure the completion it waits
    /// for raises an event: the CQ is armed for every completion (a reader
    /// may have armed it for solicited ones only, see
    /// `Driven::solicited_events_suffice`), then polled, since a
    /// completion queued before the arm raises none. Progress that frees
    /// room wakes the task at once.
    fn register_writer(&mut self, waker: &std::task::Waker) {
        self.writers.register(waker);
        if let Err(e) = self.qp.rc().arm(false) {
            self.fail(e);
            return;
        }
        self.progress_reading();
    }

    fn protocol_error(&mut self, e: ProtocolError) {
        warn!(error = %e, "peer violated the stream protocol; aborting");
        self.fail(Error::Protocol(e));
        self.transmit(); // best-effort ABORT queued by the core
    }

    /// Whether `poll_read` has something to return (data, EOF or an error).
    fn read_ready(&self) -> bool {
        !self.backlog.is_empty()
            || !self.ring_pending.is_empty()
            || self.core.readable_eof()
            || self.error.is_some()
            || self.peer_gone
    }

    /// Progress for a task about to read: arrived bytes stay in the ring
    /// for it to copy straight into its buffer (the driver drains what the
    /// reader leaves when its own round comes: on an event the reader did
    /// not take, or its tick, see `Delegation`; after a read that left
    /// bytes in the ring, only at a tick without such reads, see
    /// `StreamState::driver_drains`).
    fn progress_reading(&mut self) {
        let mut scratch = std::mem::take(&mut self.scratch);
        self.progress_with(&mut scratch, false);
        self.scratch = scratch;
    }

    /// Polls the CQ and does the follow-up work; `drain` moves arrived
    /// ring bytes into the backlog (the driver's receive progress; not
    /// while a reader is at work on them, see `driver_drains`). A task
    /// about to read passes `false`: it copies them out of the ring into
    /// its own buffer itself, one copy instead of two.
    fn progress_with(&mut self, scratch: &mut Vec<Completion>, drain: bool) {
        scratch.clear();
        if let Err(e) = self.qp.poll(scratch) {
            self.fail(e);
            return;
        }
        let mut repost = 0;
        for wc in scratch.iter() {
            repost += self.on_completion(wc);
        }
        if repost > 0 && self.error.is_none() && !self.peer_gone {
            if let Err(e) = self.qp.post_recvs(repost) {
                self.fail(e);
            }
        }
        if drain && self.driver_drains {
            self.drain_ring();
        }
        if self.error.is_none() {
            self.transmit();
        }
        // Every WR that read the send buffer has completed (its bytes are
        // freed only then), the QP is healthy and the stream stopped
        // writing: give the buffer back, so an idle connection pins only
        // its ring.
        if self.alive() && self.core.send_buf_in_use() == 0 && !self.keeps_send_buf() {
            self.qp.release_send_buf();
        }
    }

    /// A stream that wrote in this tick period or the one before keeps
    /// its idle send buffer: given back after each write's completion, as
    /// before, a 64 B ping-pong took it from the device's cache (a lock
    /// and a search) and put it back once per round trip, 3 % of the
    /// client's CPU samples under icount
    /// (benches/history/copies-under-icount-2026-12-07.md). The driver ticks
    /// while the buffer is taken ([`Driven::needs_tick`]; the write that
    /// takes it calls `Shared::ensure_tick`), so a stream gives it back
    /// within two ticks (10 ms) of its last write.
    fn keeps_send_buf(&self) -> bool {
        self.wrote_since_tick || self.wrote_last_period
    }
}

impl Driven for StreamState {
    fn qp(&self) -> &RcQueuePair {
        self.qp.rc()
    }

    fn qp_mut(&mut self) -> &mut RcQueuePair {
        self.qp.rc_mut()
    }

    fn progress(&mut self) {
        let mut scratch = std::mem::take(&mut self.scratch);
        self.progress_with(&mut scratch, true);
        self.scratch = scratch;
    }

    fn fail(&mut self, err: Error) {
        if self.error.is_none() {
            debug!(error = %err, "connection failed");
            self.stats.errors += 1;
            self.error = Some(err);
        }
        self.wake_all();
    }

    /// Close like TCP: FIN after the buffered data. No reader will come,
    /// so the driver moves arrived bytes out of the ring again (their
    /// credit lets the peer finish).
    fn on_last_handle(&mut self) {
        self.driver_drains = true;
        if self.error.is_none() && !self.peer_gone {
            self.core.shutdown();
            self.transmit();
        }
    }

    fn finished(&self) -> bool {
        self.error.is_some() || self.peer_gone || self.core.all_sent()
    }

    fn alive(&self) -> bool {
        self.error.is_none() && !self.peer_gone
    }

    fn peer_connected(&self) -> bool {
        self.alive()
    }

    fn failure(&self) -> Option<bool> {
        self.error.as_ref().map(|_| self.core.all_sent())
    }

    /// Solicited events (the peer's data, CREDIT, FIN, ABORT) suffice
    /// while the connection is healthy and nobody waits on a send
    /// completion: no writer blocked, nothing buffered unposted (which
    /// may wait for a send-queue slot), no FIN queued (the driver lingers
    /// on its completion), no keepalive probe in flight.
    fn solicited_events_suffice(&self) -> bool {
        self.alive()
            && self.writers.is_empty()
            && self.core.unposted_len() == 0
            && !self.core.shutdown_requested()
            && !self.qp.rc().probe_outstanding()
    }

    /// Send-buffer bytes in flight that no event announces: their
    /// completion gives the buffer back once the stream is idle. (A
    /// CREDIT's completion frees only a send-queue slot, polled with the
    /// next progress; a writer that needs one arms for every completion.)
    /// Or a send buffer taken from the device's cache, which goes back at
    /// the second tick without writes ([`StreamState::keeps_send_buf`]).
    /// Or arrived bytes a reader left in the ring that the backlog has
    /// room for: if no read takes them, the driver moves them out at a
    /// tick, which returns their credit without waiting for `poll_read`.
    fn needs_tick(&self) -> bool {
        (self.core.send_buf_in_use() > 0 && self.solicited_events_suffice())
            || (self.alive() && self.qp.holds_on_demand_send_buf())
            || self.tick_on_schedule()
    }

    /// Bytes a reader left in the ring wait for the driver's tick (the
    /// peer's writer may wait for their credit).
    fn tick_on_schedule(&self) -> bool {
        !self.driver_drains
            && !self.ring_pending.is_empty()
            && self.backlog_len < self.recv_buffer_limit
            && self.alive()
    }

    /// A tick without a read that left bytes in the ring since the tick
    /// before: the driver moves arrived bytes out again.
    fn on_tick(&mut self) {
        if !std::mem::take(&mut self.left_in_ring) {
            self.driver_drains = true;
        }
        self.wrote_last_period = std::mem::take(&mut self.wrote_since_tick);
    }

    fn on_disconnected(&mut self) {
        self.peer_gone = true;
        self.core.on_connection_lost();
        self.qp.rc_mut().set_error();
        self.wake_all();
    }

    fn on_closed(&mut self) {
        self.core.on_connection_lost();
        self.wake_all();
    }
}

impl Conn {
    /// With nothing to read: poll the CQ ourselves, spin for what the
    /// wait strategy allows ([`Conn::spin`]), then register this task for
    /// the CQ's next event directly, so an arriving completion wakes the
    /// reader without a hop through the driver task.
    fn wait_readable<'a>(
        &'a self,
        mut st: MutexGuard<'a, StreamState>,
        cx: &mut Context<'_>,
    ) -> MutexGuard<'a, StreamState> {
        st.progress_reading();
        if !st.read_ready() {
            st = self.spin(
                st,
                StreamState::read_ready,
                StreamState::progress_reading,
                |st| &mut st.spin,
            );
        }
        let events = st.qp.cq_events();
        while !st.read_ready() {
            st.progress_and_arm_with(StreamState::progress_reading);
            if st.read_ready() {
                break;
            }
            // Pending: registered for the CQ's next event; an error (the
            // channel left the reactor) is left to the driver.
            if !matches!(events.poll_take(cx), Poll::Ready(Ok(()))) {
                break;
            }
            // The event used up the arm: look before arming again. A
            // reader that finds its data leaves the CQ unarmed under the
            // driver's rule (`Driven::arm_unless_left_to_reader`), so the
            // completions that come while it answers (a response landing
            // during its own write's doorbell) raise no event that wakes
            // the driver. Otherwise it arms as before: a blocked writer's
            // arm was this event's, and a driver that takes every event
            // waits for one.
            st.progress_reading();
            if st.read_ready() {
                let left_to_reader = events.delegation().is_some_and(|d| d.leaves_cq_unarmed());
                st.arm_unless_left_to_reader(left_to_reader, StreamState::progress_reading);
            }
        }
        self.nudge_if_failed(&st);
        st
    }

    pub(crate) fn set_nodelay(&self, v: bool) {
        self.lock().nodelay = v;
    }

    pub(crate) fn nodelay(&self) -> bool {
        self.lock().nodelay
    }

    pub(crate) fn poll_read(
        &self,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Err(e) = crate::verbs::fork::check_io("RdmaStream::poll_read") {
            return Poll::Ready(Err(e));
        }
        let mut st = self.lock();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if !st.read_ready() {
            st = self.wait_readable(st, cx);
        }
        if st.read_ready() {
            st.spin.ready();
            st.qp.rc().unpark();
        }
        let mut copied = 0;
        while buf.remaining() > 0 {
            if let Some(front) = st.backlog.front_mut() {
                let n = front.len().min(buf.remaining());
                buf.put_slice(&front[..n]);
                bytes::Buf::advance(front, n);
                if front.is_empty() {
                    st.backlog.pop_front();
                }
                st.backlog_len -= n;
                copied += n;
                continue;
            }
            let Some(&(ring, off, len)) = st.ring_pending.front() else {
                break;
            };
            let n = (len as usize).min(buf.remaining());
            let dst = buf.initialize_unfilled_to(n);
            if let Err(source) =
                recv_ring(&st.qp, ring).and_then(|r| r.read_at(off as usize, &mut dst[..n]))
            {
                return Poll::Ready(Err(Error::Verbs {
                    op: "receive ring copy",
                    source,
                }
                .into()));
            }
            buf.advance(n);
            st.core.consume(n);
            if n == len as usize {
                st.ring_pending.pop_front();
            } else if let Some(front) = st.ring_pending.front_mut() {
                *front = (ring, off + n as u32, len - n as u32);
            }
            copied += n;
        }
        if copied > 0 {
            if st.backlog.is_empty() && !st.ring_pending.is_empty() {
                // Bytes are left in the ring: leave them to the next read
                // (one copy), unless no read comes before the driver's
                // tick after next.
                st.driver_drains = false;
                st.left_in_ring = true;
            } else {
                // Nothing left in the ring for this reader (or the backlog
                // is ahead of it): the driver moves arrivals out again at
                // once, and backlog space this read freed is filled.
                st.driver_drains = true;
                st.left_in_ring = false;
                st.drain_ring();
            }
            // Return the credit of what was consumed.
            if st.error.is_none() {
                st.transmit();
            }
            if st.left_in_ring {
                self.ensure_tick(&st);
            }
            return Poll::Ready(Ok(()));
        }
        if st.core.readable_eof() {
            return Poll::Ready(Ok(()));
        }
        if let Some(e) = st.err_io() {
            return Poll::Ready(Err(e));
        }
        if st.peer_gone {
            return Poll::Ready(Err(Error::PeerDisconnected.into()));
        }
        st.spin.parking();
        st.readers.register(cx.waker());
        Poll::Pending
    }

    fn write_error(st: &StreamState, e: WriteError) -> io::Error {
        match e {
            WriteError::Shutdown => Error::WriteAfterShutdown.into(),
            _ => st
                .err_io()
                .unwrap_or_else(|| Error::PeerDisconnected.into()),
        }
    }

    pub(crate) fn poll_write_vectored(
        &self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Err(e) = crate::verbs::fork::check_io("RdmaStream::poll_write") {
            return Poll::Ready(Err(e));
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut st = self.lock();
        let cap = match st.core.write_capacity() {
            Ok(c) => c,
            Err(e) => return Poll::Ready(Err(Self::write_error(&st, e))),
        };
        if let Some(e) = st.err_io() {
            return Poll::Ready(Err(e));
        }
        if st.peer_gone {
            return Poll::Ready(Err(Error::PeerClosed.into()));
        }
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        // Nothing in use now: the whole (maybe grown) buffer is free.
        let cap = if st.follow_peer_ring() {
            st.core.params().send_buf_len as usize
        } else {
            cap
        };
        if cap == 0 {
            st.stats.credit_stalls += 1;
            st.register_writer(cx.waker());
            return Poll::Pending;
        }
        let n = cap.min(total);
        // Taken from the device's cache while there is data to send;
        // nothing is accepted if no buffer can be had.
        let state = &mut *st;
        let send_buf = match state.qp.ensure_send_buf() {
            Ok(buf) => buf,
            Err(e) => return Poll::Ready(Err(e.into())),
        };
        let ranges = state.core.accept_write(n);
        state.wrote_since_tick = true;
        // Copy the first n bytes of `bufs` into the ranges, in order.
        let mut src = bufs.iter().map(|b| &b[..]).filter(|c| !c.is_empty());
        let mut cur: &[u8] = src.next().unwrap_or(&[]);
        for r in ranges.iter() {
            let mut at = r.start;
            while at < r.end {
                if cur.is_empty() {
                    cur = src.next().unwrap_or(&[]);
                    if cur.is_empty() {
                        break;
                    }
                }
                let k = (r.end - at).min(cur.len());
                if let Err(source) = send_buf.write_at(at, &cur[..k]) {
                    return Poll::Ready(Err(Error::Verbs {
                        op: "send buffer copy",
                        source,
                    }
                    .into()));
                }
                at += k;
                cur = &cur[k..];
            }
        }
        st.transmit();
        self.ensure_tick(&st);
        Poll::Ready(Ok(n))
    }

    /// Ready once every accepted byte has been posted to the NIC: `Ok`
    /// then even if the connection failed since (the peer may have read
    /// them and gone), as `TcpStream`'s flush is `Ok` once its bytes are
    /// the kernel's; the failure is for the next read or write.
    pub(crate) fn poll_flush(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Err(e) = crate::verbs::fork::check_io("RdmaStream::poll_flush") {
            return Poll::Ready(Err(e));
        }
        let mut st = self.lock();
        if st.core.unposted_len() == 0 {
            return Poll::Ready(Ok(()));
        }
        if let Some(e) = st.err_io() {
            return Poll::Ready(Err(e));
        }
        if st.peer_gone {
            return Poll::Ready(Err(Error::PeerClosed.into()));
        }
        st.register_writer(cx.waker());
        Poll::Pending
    }

    /// Queues a FIN after the buffered bytes without waiting (the write half
    /// was dropped).
    pub(crate) fn shutdown_write(&self) {
        let mut st = self.lock();
        if st.error.is_none() && !st.peer_gone {
            st.core.shutdown();
            st.transmit();
        }
    }

    /// Half-close, as `TcpStream`'s `shutdown(Write)`: queues a FIN behind
    /// the buffered bytes and is ready at once. The driver posts the FIN
    /// when the peer's credit allows (bounded by the linger timeout once
    /// every handle is gone); a later write is `BrokenPipe`.
    pub(crate) fn poll_shutdown(&self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Err(e) = crate::verbs::fork::check_io("RdmaStream::poll_shutdown") {
            return Poll::Ready(Err(e));
        }
        let mut st = self.lock();
        if st.peer_gone && !st.core.fin_received() && st.error.is_none() {
            // The peer vanished without closing: like shutdown(2) on a
            // reset TCP socket.
            return Poll::Ready(Err(Error::NotConnected.into()));
        }
        if let Some(e) = st.err_io() {
            return Poll::Ready(Err(e));
        }
        if !st.peer_gone {
            st.core.shutdown();
            st.transmit();
        }
        Poll::Ready(Ok(()))
    }

    /// The address of the receive ring the peer writes now and the key
    /// announced for it (test hook).
    #[cfg(tokio_rdma_guest)]
    pub(crate) fn ring_key(&self) -> (u64, u32) {
        let st = self.lock();
        let generation = st.core.ring_generation();
        (
            st.qp.ring(generation).map_or(0, |r| r.addr()),
            st.qp.ring_rkey_of(generation),
        )
    }

    /// Posts an RDMA WRITE WITH IMM of `len` bytes of the send buffer to
    /// `remote_addr` with `rkey`, as a misbehaving peer would (test hook).
    #[cfg(tokio_rdma_guest)]
    pub(crate) fn forge_ring_write(&self, remote_addr: u64, rkey: u32, len: u32) -> io::Result<()> {
        let mut st = self.lock();
        st.qp
            .forge_ring_write(remote_addr, rkey, len)
            .map_err(io::Error::from)
    }

    pub(crate) fn stats(&self) -> ConnectionStats {
        let st = self.lock();
        let mut s = st.stats.clone();
        s.credit_stalls += st.core.stats().credit_stalls;
        s.remote_access = match st.qp.ring_isolation() {
            RingIsolation::OwnPd => RemoteAccess::OwnProtectionDomain,
            _ => RemoteAccess::MemoryWindow,
        };
        s.registered_bytes = st.qp.registered_bytes() as u64;
        s.ring_size = st.core.params().ring_len;
        s.send_buffer_size = st.core.params().send_buf_len;
        s.rings_grown = st.core.stats().rings_grown;
        s.spin_hits = st.spin.spin_hits;
        s.read_parks = st.spin.parks;
        s.spin_limit_us = st.spin.limit_us();
        s.events_left_to_reader = st.qp.cq_events().delegation().map_or(0, |d| d.left());
        (s.lock_waits, s.driver_wakeups) = self.contention();
        s
    }
}

/// What a stream connection holds and waits on, in words, for the guest
/// suite's diagnostics of a stream that stopped moving.
#[cfg(tokio_rdma_guest)]
pub(crate) fn debug_state(conn: &Conn) -> String {
    let st = conn.lock();
    format!(
        "qp {} state {} probe_outstanding {} error {:?} peer_gone {} \
         backlog {} ring_pending {:?} driver_drains {} left_in_ring {} \
         readers {} writers {} handles {} spin {:?}\nstats {:?}\ncore {:?}",
        st.qp.rc().qp_num(),
        st.qp.rc().queried_state(),
        st.qp.rc().probe_outstanding(),
        st.error,
        st.peer_gone,
        st.backlog_len,
        st.ring_pending,
        st.driver_drains,
        st.left_in_ring,
        st.readers.len(),
        st.writers.len(),
        conn.handles(),
        st.spin,
        st.stats,
        st.core,
    )
}

/// Receive ring `generation` of a stream QP (held while bytes in it wait).
fn recv_ring(qp: &StreamQp, generation: u32) -> std::io::Result<&RegisteredBuffer> {
    qp.ring(generation).ok_or_else(|| {
        std::io::Error::other(format!(
            "a stream QP without its receive ring of generation {generation}"
        ))
    })
}

/// Our half of the handshake for a stream QP.
pub(crate) fn local_hello(qp: &StreamQp, cfg: &RdmaConfig) -> Hello {
    Hello {
        kind: EndpointKind::ByteStream,
        ring_addr: qp.first_ring_addr(),
        ring_rkey: qp.ring_rkey(),
        ring_len: cfg.ring_size,
        recv_depth: cfg.recv_queue_depth,
        max_message_len: 0,
        max_rendezvous_in_flight: 0,
        caps: device_caps(qp.rc().device()),
        // Filled in by the handshake (`conn::setup`).
        path_mtu: 0,
    }
}

/// Builds the stream's state and starts the connection's driver.
pub(crate) fn start(est: Established<StreamQp>, cfg: &RdmaConfig) -> Result<Handle<StreamState>> {
    let max_inline = est.qp.rc().max_inline();
    match est.qp.ring_isolation() {
        RingIsolation::OwnPd => tracing::info!(
            device = %est.device,
            "device has no memory windows: the receive ring is opened to the peer on a protection domain of its own"
        ),
        _ => debug!("receive ring opened to the peer through a memory window bound on this QP"),
    }
    if !est.qp.immediate_data() {
        tracing::info!(
            device = %est.device,
            "device has no immediate data (iWARP): each message's immediate follows its RDMA WRITE in a 4-byte SEND"
        );
    }
    let mut core =
        StreamCore::new(cfg.stream_params(est.peer.ring_len, est.peer.recv_depth, max_inline))?;
    if est.qp.rc().speaks_first() {
        core.speak_first();
    }
    let state = StreamState {
        core,
        qp: est.qp,
        peer_ring_addr: est.peer.ring_addr,
        peer_rkey: est.peer.ring_rkey,
        backlog: VecDeque::new(),
        backlog_len: 0,
        ring_pending: VecDeque::new(),
        growth_refused: false,
        send_buf_cap: cfg.send_buffer_size.max(cfg.max_ring_size),
        send_buf_growth_refused: false,
        recv_buffer_limit: cfg.recv_buffer_limit,
        driver_drains: true,
        left_in_ring: false,
        wrote_since_tick: false,
        wrote_last_period: false,
        readers: WakerList::default(),
        writers: WakerList::default(),
        error: None,
        peer_gone: false,
        spin: SpinWait::new(cfg.wait_strategy),
        nodelay: true,
        stats: ConnectionStats::default(),
        scratch: Vec::with_capacity(64),
    };
    Ok(crate::conn::start(Started {
        state,
        id: est.id,
        device: est.device,
        fallback_addr: est.fallback_addr,
        linger: cfg.linger,
        keepalive: cfg.keepalive,
        port_grace: cfg.retry_bound(),
        kind: "stream",
    }))
}
