//! The message endpoint's runtime: state shared by the application's
//! handles and a driver task, around a [`MessageCore`].
//!
//! Whoever holds the lock makes progress: it drains the completion queue,
//! reposts receive buffers (a fresh pool buffer for one kept by an EAGER
//! message, the same buffer otherwise), allocates rendezvous destinations,
//! handles the core's events and posts what the core has ready. The driver
//! task does the same whenever its CQ raises a completion event, so receive
//! progress, credit and rendezvous READs never wait for the application
//! (READs held back while a complete message waits to be taken go at the
//! driver's next tick, [`MsgState::settle`]).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::task::{Context, Poll};

use tracing::{debug, trace, warn};

use super::qp::MessageQp;
#[cfg(tokio_rdma_guest)]
use super::qp::PostedSge;
use super::quota::Quota;
use super::{Incoming, MessageConfig};
use crate::conn::{Driven, Established, Handle, SpinWait, Started, WakerList};
use crate::error::{Error, Result};
use crate::pool::{ExhaustedPolicy, MemoryPool, OutgoingMessage, PoolBuf, PoolBytes, PoolError};
use crate::proto::message::{
    ABORT_CODE_APPLICATION, Delivery, MessageCore, MessageError, MessageStats, MsgEvent,
    MsgTransmit, MsgTransmitKind, NotifyWrite, OutboundMessage, RecvDisposition, SendError,
    abort_code_reason,
};
use crate::remote::{GrantAccess, LocalRegion, Notification};
use crate::verbs::ledger::PostedOp;
use crate::verbs::rc::{Completion, RcQueuePair, WcStatus, Work};

use super::qp::{Local, RemoteWr};

/// Messages fed through `Sink::start_send` are posted together once this
/// many are queued (or at `poll_flush`).
const FEED_BATCH: usize = 32;

/// An endpoint that sent within its last this many takes answers what it
/// takes (an RPC server, an echo, a pipelining client): its drains hold
/// READs while a message waits ([`MsgState::settle`]), whatever the time
/// between its sends. 16 covers a request answered after a few more were
/// taken. A receiver that never sent never holds; one that sent and then
/// only takes stops holding at its 17th take. The count moves only with
/// takes: an endpoint that sent and then stops taking holds while a
/// message waits, so its peer's READs go at the driver's ticks (all that
/// are due, every 5 ms) until it takes again.
const ANSWER_TAKES: u32 = 16;

/// An eager `send()` posts at once while fewer than this many WRs are
/// outstanding (a lone request goes out without delay; a rendezvous always
/// goes at once: [`send_posts_at_once`]); beyond it the message waits in
/// the queue and goes out with the next doorbell, together with
/// everything queued since: at the next completion's drain, the sender's
/// own next post ([`FEED_BATCH`] queued) or wait, or, for a sustained
/// stream, the driver's tick (see [`MsgState::defer_to_completion`]).
/// Every burst ends with a signaled WR, so that completion comes.
const POST_AT_ONCE_BELOW: usize = 4;

/// Whether a `send()` (`defer` false) or a `Sink` feed (`defer` true)
/// posts what is queued at once, given the core's WRs outstanding. An
/// eager `send()` posts at once below [`POST_AT_ONCE_BELOW`]; a rendezvous
/// `send()` always does (what it posts is its window bind and RTS, or,
/// blocked on `max_rendezvous_in_flight`, the completions the call polls
/// free a slot for it): the peer's READ cannot start before the RTS
/// arrives, and the transfer costs far more than the doorbell a batch
/// saves. 1 MiB messages one way on current_thread went at 1.05-1.11x
/// the rate (benches/history/echo-2026-12-05.md, "A rendezvous send posts at once").
fn send_posts_at_once(defer: bool, rendezvous: bool, outstanding_wrs: usize) -> bool {
    !defer && (rendezvous || outstanding_wrs < POST_AT_ONCE_BELOW)
}

/// Whether a drain may hold READs back while a complete message waits, and
/// post one message's READs per doorbell ([`MsgState::settle`]): not in the
/// driver's tick round (held READs go then); otherwise for an endpoint that
/// sent in this tick period or the last (`sent_recently`), or within its
/// last [`ANSWER_TAKES`] takes, whatever the time between its sends (a
/// 1 MiB echo answers about every 40-70 ms in the guest, far outside two
/// 5 ms tick periods).
fn may_hold_reads(tick_round: bool, sent_recently: bool, takes_since_send: u32) -> bool {
    !tick_round && (sent_recently || takes_since_send <= ANSWER_TAKES)
}

/// A message endpoint's connection: the core's shared connection around a
/// [`MsgState`].
pub(crate) type MsgConn = crate::conn::shared::Shared<MsgState>;

/// Everything behind the message endpoint's mutex.
pub(crate) struct MsgState {
    core: MessageCore,
    qp: MessageQp,
    pool: MemoryPool,
    eager_buf_len: usize,
    next_token: u64,
    /// Receive buffers holding EAGER messages not yet taken.
    kept: HashMap<u64, PoolBuf>,
    /// Receive slots without a buffer posted (the pool had none free).
    unposted: u16,
    /// Destination lengths requested by the core, oldest first.
    allocs: VecDeque<u64>,
    /// Pool bytes held for this endpoint's incoming messages (rendezvous
    /// destinations being read, or complete and not yet taken) against its
    /// quota.
    quota: Quota,
    send_queue_limit: usize,
    /// [`MessageConfig::send_queue_bytes`](super::MessageConfig::send_queue_bytes).
    send_queue_bytes: u64,
    /// The bound on waiting for the peer (`RdmaConfig::linger`).
    linger: std::time::Duration,
    /// Tasks waiting in `recv` (and the `Stream` impl).
    receivers: WakerList,
    /// How a receiver waits, and the wait in progress.
    spin: SpinWait,
    /// Tasks waiting for room in the send queue or for posting (`send`,
    /// the `Sink`'s `poll_ready`/`poll_flush`).
    senders: WakerList,
    /// Tasks waiting for every message to be taken (`flush`, `close`,
    /// `Sink::poll_close`).
    flushers: WakerList,
    /// The connection's error, once it failed.
    error: Option<Error>,
    /// The peer closed cleanly: its CLOSE arrived, or rdma_cm DISCONNECTED
    /// with nothing of ours left untaken and nothing of its own half-sent.
    peer_closed: bool,
    /// This side disconnected.
    closing: bool,
    /// Waiting for the pool to have memory again.
    need_memory: bool,
    /// The CQ's last arm was for solicited events only (see
    /// [`MsgState::widen_arm`]).
    solicited_armed: bool,
    /// A message was sent since the driver's last tick.
    sent_since_tick: bool,
    /// A message was sent in the tick period before the driver's last
    /// tick as well: a sustained stream (see
    /// [`MsgState::defer_to_completion`]); the driver keeps ticking.
    sent_last_period: bool,
    /// `send()` calls that left their message queued (see
    /// [`POST_AT_ONCE_BELOW`]).
    sends_deferred: u64,
    /// READs held back while a complete message waits to be taken
    /// ([`MsgState::settle`]): the driver ticks until they go.
    reads_waiting: bool,
    /// Times READs came to be held back (`MessageStats::reads_held`).
    reads_holds: u64,
    /// The driver's tick is running its round: held READs go.
    tick_round: bool,
    /// Messages the application took since its last `send()`, saturating;
    /// starts at [`ANSWER_TAKES`] + 1 (no send yet). An endpoint whose
    /// count is at most [`ANSWER_TAKES`] answers what it takes, and
    /// [`MsgState::settle`] holds READs for it.
    takes_since_send: u32,
    scratch: Vec<Completion>,
    /// Reused list of WRs posted together.
    batch: Vec<MsgTransmit>,
}

impl MsgState {
    fn token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    fn wake_all(&mut self) {
        self.receivers.wake_all();
        self.senders.wake_all();
        self.flushers.wake_all();
    }

    /// Nothing of ours is left for the peer to take and nothing of its own
    /// is half-received: the peer going now is a clean close.
    /// Nothing of ours untaken by the peer, nothing of its own half
    /// received, and no one-sided operation of ours waiting for its
    /// completion: a disconnect now is a clean close. (A peer killed with
    /// our READs or WRITEs in flight is a reset for them, whichever of the
    /// disconnect and their flushed completions is seen first.)
    fn nothing_half_done(&self) -> bool {
        self.qp.sends_not_taken() == 0
            && self.core.incomplete_recv() == 0
            && self.qp.remote_pending() == 0
    }

    fn dead(&self) -> bool {
        self.error.is_some() || self.peer_closed || self.closing
    }

    /// The connection failed underneath: stop the QP, give every buffer
    /// back.
    fn lost(&mut self, err: Error) {
        self.fail(err);
        self.qp.as_mut().set_error();
        self.core.on_connection_lost();
    }

    fn protocol_error(&mut self, e: MessageError) {
        warn!(error = %e, "peer violated the message protocol; aborting");
        self.fail(Error::Message(e));
    }

    /// Whether a completion with `status` reports a failure: not a success,
    /// nor a flush on a connection already known to be dead.
    fn reports_failure(&self, status: WcStatus) -> bool {
        match status {
            WcStatus::Success => false,
            WcStatus::Flushed => !self.dead(),
            WcStatus::Failed(_) => true,
        }
    }

    fn on_completion(&mut self, wc: &Completion) {
        trace!(
            work = ?wc.work,
            status = ?wc.status,
            imm = wc.imm,
            byte_len = wc.byte_len,
            "completion"
        );
        let is_recv = matches!(wc.work, Work::Recv(_));
        if let Work::Remote(_) = wc.work {
            // A one-sided operation, grant bind or revocation
            // (`crate::remote`): its future gets the status.
            // Named (a scan of the ledger) only for a failure, before the
            // completion takes the WR out of the ledger.
            let failed = self.reports_failure(wc.status);
            let op = failed.then(|| self.qp.remote_op_name(wc.wr_id()));
            self.qp.remote_completed(wc.wr_id(), wc.status);
            if let Some(op) = op {
                // The QP is in the error state now (RC): the endpoint with it.
                self.lost(Error::RemoteAccess {
                    op,
                    status: wc.status.code(),
                });
            }
            self.senders.wake_all();
            return;
        }
        if let Work::Window(_) | Work::Probe = wc.work {
            // A keepalive probe, or a window bind or invalidation of the QP
            // layer.
            if self.qp.window_completed(wc.wr_id(), wc.status) {
                self.flushers.wake_all();
            }
            if self.reports_failure(wc.status) {
                let op = if wc.work == Work::Probe {
                    self.qp.qp_ref().probe_op()
                } else {
                    "memory window bind or invalidation"
                };
                let err = self.qp.qp_ref().wr_failure(Error::WorkCompletion {
                    op,
                    status: wc.status.code(),
                });
                self.lost(err);
            }
            return;
        }
        if !wc.ok() {
            let posted = (!is_recv).then(|| self.qp.core_op(wc.wr_id())).flatten();
            let op = match posted {
                _ if is_recv => "receive",
                Some(PostedOp::Read) => "RDMA READ",
                Some(PostedOp::Write) => "RDMA WRITE WITH IMMEDIATE",
                _ => "SEND",
            };
            match wc.work {
                Work::Recv(token) => drop(self.qp.take_recv(token, 0)),
                _ => {
                    self.qp.send_completed(wc.wr_id());
                    if wc.status != WcStatus::Flushed {
                        // Every WR before the first failure was taken.
                        self.core.on_send_failed(wc.wr_id());
                        self.handle_events();
                    }
                }
            }
            if wc.status == WcStatus::Flushed && self.dead() {
                return;
            }
            if self.core.peer_closed() && self.nothing_half_done() {
                // The peer closed (its CLOSE arrived, and it disconnects
                // once that completed) with nothing of ours left untaken:
                // a WR of ours posted before the CLOSE arrived (a CREDIT)
                // failing against its closed QP is the end of a clean
                // close, not a lost connection.
                debug!(op, status = ?wc.status, "WR failed after the peer's CLOSE");
                self.qp.as_mut().set_error();
                return;
            }
            // A NOTIFY's WRITE the peer's NIC refused (a revoked grant,
            // another connection's): as for `write`, a remote access error.
            if posted == Some(PostedOp::Write) && matches!(wc.status, WcStatus::Failed(9..=11)) {
                self.lost(Error::RemoteAccess {
                    op,
                    status: wc.status.code(),
                });
                return;
            }
            // REM_ACCESS_ERR on a READ: the announced range or rkey is not
            // (or no longer) registered for remote read at the peer: a bogus
            // announcement, or a peer that deregistered it by exiting.
            let err = self.qp.qp_ref().wr_failure(Error::WorkCompletion {
                op,
                status: wc.status.code(),
            });
            self.lost(err);
            return;
        }
        if let Work::Recv(token) = wc.work {
            // Without immediate data, the SEND's trailer is split off.
            let (buf, imm, len) = match self.qp.take_recv_message(token, wc.imm, wc.byte_len) {
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    // Found by the runtime, not the core: abort with its
                    // code as the core does for its own findings.
                    self.core.abort(e.abort_code());
                    self.protocol_error(e);
                    return;
                }
                None => {
                    self.fail(Error::Internal(format!(
                        "receive completion for unknown token {token}"
                    )));
                    return;
                }
            };
            match self.core.on_recv(imm, len, token, &buf) {
                Ok(RecvDisposition::Keep) => {
                    self.kept.insert(token, buf);
                    self.unposted += 1;
                }
                Ok(RecvDisposition::Release) => {
                    if !self.dead() {
                        if let Err(e) = self.qp.post_recvs(vec![(token, buf)]) {
                            self.fail(e);
                        }
                    }
                }
                Err(e) => self.protocol_error(e),
            }
            if self.core.peer_closed() && !self.peer_closed {
                // The peer's CLOSE: what arrived is delivered, then the end;
                // our sends fail with PeerClosed (wake_all below and here).
                debug!("peer closed the message endpoint");
                self.peer_closed = true;
                self.flushers.wake_all();
            }
            // A message arrived, or credit for blocked sends.
            self.receivers.wake_all();
            self.senders.wake_all();
        } else {
            self.qp.send_completed(wc.wr_id());
            if let Err(e) = self.core.on_send_complete(wc.wr_id()) {
                self.fail(Error::Message(e));
            }
            // A completed READ may have finished a message for the reader;
            // the last WR outstanding (often a CREDIT or DONE, which release
            // no message) completing is what a flush waits for.
            self.senders.wake_all();
            self.receivers.wake_all();
            self.flushers.wake_all();
        }
    }

    fn handle_events(&mut self) -> bool {
        let mut any = false;
        while let Some(ev) = self.core.poll_event() {
            any = true;
            match ev {
                MsgEvent::SendDone { token } => {
                    self.qp.release_send(token);
                    self.flushers.wake_all();
                }
                MsgEvent::AllocateDestination { len } => self.allocs.push_back(len),
                MsgEvent::Aborted { code } => {
                    self.fail(Error::PeerAborted {
                        code,
                        reason: abort_code_reason(code),
                    });
                }
                MsgEvent::Reclaim { token } => {
                    if !self.qp.release_send(token) && self.kept.remove(&token).is_none() {
                        self.quota_release(token);
                        self.qp.release_dest(token);
                    }
                }
            }
        }
        any
    }

    fn exhausted_waits(&self) -> bool {
        self.pool.config().policy() == ExhaustedPolicy::Wait
    }

    /// Reposts receive buffers for slots whose buffer an EAGER message kept.
    fn refill(&mut self) {
        let (posted, exhausted) = self.post_fresh_recvs(self.unposted);
        self.unposted -= posted;
        if exhausted {
            // The core returns no credit for these slots, so the peer
            // stalls instead of meeting an empty receive queue.
            self.need_memory = true;
        }
        self.core.set_unposted_recvs(self.unposted);
    }

    /// Posts the receive buffers the core wants beyond those it keeps
    /// posted (the peer is about to block on credit: the posted slots
    /// double, up to `recv_queue_depth`), as far as the pool allows now;
    /// an exhausted pool only means no growth yet (the peer waits for
    /// credit as before).
    fn grow(&mut self) {
        let want = self.core.wants_more_recv();
        if want > 0 {
            let (posted, _) = self.post_fresh_recvs(want);
            self.core.grow_recv(posted);
        }
    }

    /// Allocates up to `n` receive buffers from the pool and posts them
    /// with fresh tokens; returns how many were posted and whether the
    /// pool ran out first. Another pool or posting error fails the
    /// endpoint (what was allocated before it is still posted).
    fn post_fresh_recvs(&mut self, n: u16) -> (u16, bool) {
        let mut bufs = Vec::with_capacity(n.into());
        let mut exhausted = false;
        while bufs.len() < usize::from(n) {
            match self.pool.try_alloc(self.eager_buf_len) {
                Ok(b) => {
                    let t = self.token();
                    bufs.push((t, b));
                }
                Err(PoolError::Exhausted { .. }) => {
                    exhausted = true;
                    break;
                }
                Err(e) => {
                    self.fail(e.into());
                    break;
                }
            }
        }
        let posted = bufs.len() as u16;
        if posted == 0 {
            return (0, exhausted);
        }
        match self.qp.post_recvs(bufs) {
            Ok(()) => (posted, exhausted),
            Err(e) => {
                self.fail(e);
                (0, exhausted)
            }
        }
    }

    /// Allocates rendezvous destinations, in order.
    fn allocate(&mut self) {
        while let Some(&len) = self.allocs.front() {
            // Per-connection quota on the shared pool: beyond it this
            // peer's READs wait (its rendezvous stay outstanding, so its
            // sends stall on max_rendezvous_in_flight) until the application
            // takes messages; other connections are not affected.
            if !self.quota.admit(len) {
                break;
            }
            let alloc = usize::try_from(len)
                .map_err(|_| PoolError::TooLarge {
                    len: usize::MAX,
                    max_class: 0,
                })
                .and_then(|l| self.pool.try_alloc_any(l));
            match alloc {
                Ok(buf) => {
                    self.allocs.pop_front();
                    let t = self.token();
                    let buf_len = buf.capacity() as u64;
                    if let Err(e) = self.qp.add_dest(t, buf) {
                        // Without windows the sink could not be registered.
                        self.allocs.clear();
                        self.core.abort(ABORT_CODE_APPLICATION);
                        self.fail(e);
                        break;
                    }
                    self.quota.hold(t, buf_len);
                    if let Err(e) = self.core.destination_ready(t) {
                        self.fail(Error::Message(e));
                    }
                }
                Err(PoolError::Exhausted { .. }) if self.exhausted_waits() => {
                    self.need_memory = true;
                    break;
                }
                Err(e) => {
                    self.allocs.clear();
                    warn!(len, error = %e, "no memory for an incoming message; aborting");
                    self.core.abort(ABORT_CODE_APPLICATION);
                    self.fail(Error::IncomingMessageMemory { len, source: e });
                    break;
                }
            }
        }
    }

    /// Events, buffers and transmissions until nothing changes.
    fn settle(&mut self) {
        self.need_memory = false;
        for _ in 0..64 {
            self.handle_events();
            if !self.peer_closed && !self.closing {
                self.refill();
                self.grow();
                self.allocate();
            }
            let mut posted = false;
            // An iWARP responder sends nothing before the initiator's
            // first frame (`RcQueuePair::awaiting_initiator`).
            if !self.peer_closed && !self.closing && !self.qp.qp_ref().awaiting_initiator() {
                // A message delivered before more is read: rxe runs an RDMA
                // READ inside its post when both ends share the device, so
                // a drain that read every rendezvous it knew of held the
                // first message back for all of their transfers, and an
                // echo's two processes took turns instead of overlapping
                // (benches/history/echo-2026-12-05.md, "A message delivered before more is
                // read"). On a NIC a READ completes later, so the READs of
                // rendezvous announced together still go in one drain; a
                // drain that finds a complete message waiting holds the
                // READs of those announced since. The driver's tick (kept
                // on schedule while READs are held) lets them go, so a
                // receiver that does not take its messages holds the
                // peer's rendezvous for about a tick.
                //
                // Only for an endpoint that also sends (in this tick period
                // or the last, or within its last ANSWER_TAKES takes:
                // `may_hold_reads`), whose answers the hold lets go between
                // the reads: a receiver that only takes gains nothing, and
                // on the multi-thread runtime its driver and application
                // read on two threads (1 MiB one way went at 0.87-0.88x
                // with the hold, 0.92-0.96x with only the doorbell per
                // message below); it posts as before. The count of takes
                // is what keeps a 1 MiB echo holding: its answers come
                // tens of milliseconds apart (1.75-1.95x with it,
                // benches/history/echo-2026-12-06.md, "An endpoint that answers what it
                // takes").
                let may_hold = may_hold_reads(
                    self.tick_round,
                    self.sent_since_tick || self.sent_last_period,
                    self.takes_since_send,
                );
                let hold = may_hold && self.core.has_deliverable();
                self.core.set_reads_held(hold);
                let waiting = hold && self.core.reads_due();
                if waiting && !self.reads_waiting {
                    self.reads_holds += 1;
                }
                self.reads_waiting = waiting;
                let mut batch = std::mem::take(&mut self.batch);
                batch.clear();
                let mut ended_early = false;
                while let Some(t) = self.core.poll_transmit() {
                    trace!(?t, "post");
                    let read_of = match t.kind {
                        MsgTransmitKind::Read { local_token, .. } => Some(local_token),
                        _ => None,
                    };
                    let signaled = t.signaled;
                    batch.push(t);
                    // One message's READs per doorbell: the core signals
                    // the READ that finishes a message's reads; the CQ is
                    // polled after the post, and the next round sees
                    // whether the message completed inside it.
                    if may_hold
                        && signaled
                        && read_of.is_some()
                        && self
                            .core
                            .next_read_destination()
                            .is_some_and(|next| Some(next) != read_of)
                    {
                        ended_early = true;
                        break;
                    }
                }
                posted = !batch.is_empty();
                if let Err(e) = self.qp.post(&batch) {
                    self.lost(e);
                }
                self.batch = batch;
                if ended_early {
                    // The message's READs may have completed inside the
                    // post (rxe): polled now, the next round holds the
                    // next message's READs while this one is taken.
                    self.poll_completions();
                }
            }
            if !posted && !self.handle_events() {
                break;
            }
        }
        self.tick_round = false;
    }

    /// Whether `send` may queue another message: fewer than
    /// `send_queue_limit` messages and `send_queue_bytes` bytes queued.
    fn send_queue_has_room(&self) -> bool {
        self.core.queued() < self.send_queue_limit
            && self.core.queued_bytes() < self.send_queue_bytes
    }

    /// Drains the CQ and does the follow-up work.
    fn drain(&mut self) {
        self.poll_completions();
        self.settle();
    }

    /// Polls the CQ and handles what completed (no follow-up work).
    fn poll_completions(&mut self) {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        if let Err(e) = self.qp.as_mut().poll(&mut scratch) {
            self.fail(e);
        }
        for wc in &scratch {
            // On siw a READ may complete after later WRs: those wait.
            if self.qp.hold_back(wc) {
                continue;
            }
            self.on_completion(wc);
            while let Some(wc) = self.qp.released() {
                self.on_completion(&wc);
            }
        }
        self.scratch = scratch;
    }

    /// Destination `token` left this endpoint's hands (taken by the
    /// application or released): its bytes no longer count against the
    /// quota.
    fn quota_release(&mut self, token: u64) {
        self.quota.release(token);
    }

    /// Whether a message `send()` just left queued should go out at the
    /// next completion (the CQ armed for it: [`widen_arm`](Self::widen_arm)),
    /// as a short burst does, so its last messages wait for nothing. Not
    /// for a sustained stream (sent in the tick period before the driver's
    /// last tick as well) with no task parked on the endpoint: its
    /// queue goes out with its own next post ([`FEED_BATCH`] queued) or
    /// wait, or at the driver's tick (every 5 ms while it sends, so a
    /// stream's last messages wait at most that long when the application
    /// calls nothing on the endpoint after them). Each completion event
    /// woke the driver, on the multi-thread runtime another thread that met
    /// the sender on the lock, to post a burst of a few messages; left to
    /// the sender, 64 B messages with `send()` each went at 1.06-1.61x the
    /// rate (benches/history/echo-2026-12-05.md, "A sustained stream posts its own queue").
    /// A parked task (a `recv`) still gets its wake-up: the deferral
    /// widens the arm, and the woken task's drain posts the queue. So does
    /// a message held back by low credit ([`MessageCore::credit_low`]):
    /// the peer's CREDIT must wake someone, or a stream paced by its
    /// receiver would go at one tick's worth of credit per tick.
    fn defer_to_completion(&self) -> bool {
        !self.sent_last_period || !self.receivers.is_empty() || self.core.credit_low()
    }

    /// A task starts waiting on something a send completion may bring
    /// (room in the send queue, a queued message posted, every message
    /// taken): if the CQ's last arm was for solicited events only, arm it
    /// for every completion (then poll, as a completion queued before the
    /// arm raises no event). One arm per narrowing, not per call.
    fn widen_arm(&mut self) {
        if self.solicited_armed {
            self.progress_and_arm();
        }
    }

    /// The bound on waiting for the peer.
    pub(crate) fn linger(&self) -> std::time::Duration {
        self.linger
    }

    fn error_io(&self) -> Option<io::Error> {
        self.error.clone().map(io::Error::from)
    }
}

impl Driven for MsgState {
    fn qp(&self) -> &RcQueuePair {
        self.qp.qp_ref()
    }

    fn qp_mut(&mut self) -> &mut RcQueuePair {
        self.qp.as_mut()
    }

    fn progress(&mut self) {
        self.drain();
    }

    fn fail(&mut self, err: Error) {
        if self.error.is_none() {
            debug!(error = %err, "message endpoint failed");
            self.error = Some(err);
        }
        self.wake_all();
    }

    /// CLOSE goes out once everything of ours is done (the core decides).
    fn on_last_handle(&mut self) {
        self.core.close();
    }

    fn alive(&self) -> bool {
        !self.dead()
    }

    fn peer_connected(&self) -> bool {
        self.error.is_none() && !self.peer_closed
    }

    fn failure(&self) -> Option<bool> {
        self.error.as_ref().map(|_| self.core.all_sent())
    }

    /// Disconnect once our CLOSE completed (the peer received it; on
    /// iWARP the driver then also waits for a probe), or the
    /// peer closed, or the connection failed; without a credit for CLOSE,
    /// once everything else is done.
    fn finished(&self) -> bool {
        self.error.is_some()
            || self.peer_closed
            || self.core.close_completed()
            || self.core.close_blocked()
    }

    /// A clean close by the peer leaves nothing of ours untaken and nothing
    /// of its own half-sent; anything else is a reset (as TCP's close with
    /// unread data), an error for every waiter.
    fn on_disconnected(&mut self) {
        // Every message of ours is held until the peer took it (an eager
        // SEND completed, a rendezvous DONE'd) and, for a rendezvous, its
        // window is invalidated. A DONE'd one whose invalidation is still
        // in flight was taken: a peer that closes right after taking it
        // closed cleanly (the memory stays held until the invalidation
        // completes or the QP is destroyed). Our own control WRs still in
        // flight (a DONE just posted) do not matter either.
        let clean = self.nothing_half_done();
        self.qp.as_mut().set_error();
        if clean {
            self.peer_closed = true;
            self.wake_all();
        } else {
            self.lost(Error::PeerDisconnected);
        }
    }

    fn on_closed(&mut self) {
        self.closing = true;
        self.core.on_connection_lost();
        self.handle_events();
        self.wake_all();
    }

    fn waiting_for_memory(&self) -> Option<MemoryPool> {
        self.need_memory.then(|| self.pool.clone())
    }

    /// Solicited events (the peer's messages, RTS, DONE, CLOSE, ABORT:
    /// every SEND of the peer but CREDIT) suffice while the endpoint is
    /// healthy and nothing waits on one of its own send completions or on
    /// the peer's CREDIT: no task waiting for room, posting or messages
    /// taken, nothing queued (a message `send()` deferred may be posted at
    /// the next completion), no work for a full send queue, RDMA READ in
    /// flight, no remote-memory work waiting for an event
    /// ([`MessageQp::remote_needs_events`]: a task waiting on its own
    /// one-sided operation arms when it parks, so an operation that
    /// completes before its task looks raises no event; when the driver
    /// armed for every one, each woke the driver, on the multi-thread
    /// runtime another worker that met the caller on the lock: one
    /// driver wake-up and one lock wait per 8 B READ, 2.2x `ib_read_lat
    /// -e` against 1.1x on current_thread), close or abort under way
    /// ([`MessageCore::awaits_send_completion`]), the peer's credit not
    /// low ([`MessageCore::credit_low`]), no keepalive probe in flight, no
    /// wait for pool memory (a completion may free some). A request's
    /// completion then wakes nobody: not the task parked for its
    /// response, nor the driver (on the multi-thread runtime a 64 B
    /// ping-pong took 0.56-0.61x the mean: benches/history/echo-2026-12-04.md, "Messages:
    /// solicited events"); nor does a stream's (its sender reaps them).
    fn solicited_events_suffice(&self) -> bool {
        self.alive()
            && self.senders.is_empty()
            && self.flushers.is_empty()
            && self.core.queued() == 0
            && !self.core.awaits_send_completion()
            && !self.core.credit_low()
            && !self.qp.qp_ref().probe_outstanding()
            && !self.need_memory
            && !self.qp.remote_needs_events()
    }

    /// Messages held until their send completes (an eager SEND's buffer,
    /// a rendezvous whose window is being invalidated) that no event
    /// announces: the driver's tick polls them, so their memory goes back
    /// to the pool without waiting for the endpoint's next call.
    /// Also while the application sends (in this tick period or the one
    /// before): a sustained stream's deferred messages and held buffers
    /// wait for the tick, and a driver that stopped ticking whenever its
    /// round had reaped everything was woken again by the next `send()`
    /// ([`Shared::ensure_tick`]), once per batch.
    ///
    /// [`Shared::ensure_tick`]: crate::conn::shared::Shared::ensure_tick
    fn needs_tick(&self) -> bool {
        self.sent_since_tick
            || self.sent_last_period
            || self.reads_waiting
            || (self.qp.sends_held() > 0 && self.solicited_events_suffice())
    }

    fn on_tick(&mut self) {
        self.sent_last_period = std::mem::take(&mut self.sent_since_tick);
        self.tick_round = true;
    }

    /// Held READs ([`MsgState::settle`]) go at the tick, which other
    /// wake-ups (the peer's messages, a stream of sends) must not keep
    /// putting off: the peer's `flush` and close wait for those READs.
    fn tick_on_schedule(&self) -> bool {
        self.reads_waiting
    }

    fn on_armed(&mut self, solicited_only: bool) {
        self.solicited_armed = solicited_only;
    }
}

impl MsgConn {
    /// Whether `poll_recv` has something to return.
    fn recv_ready(st: &MsgState) -> bool {
        st.core.has_deliverable() || st.error.is_some() || st.peer_closed
    }

    /// With nothing to deliver: spin on the CQ for what the wait strategy
    /// allows ([`MsgConn::spin`]), then arm it and register this task on
    /// the CQ's next event itself, so an arriving message wakes the reader
    /// without a hop through the driver task.
    fn wait_recv<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, MsgState>,
        cx: &mut Context<'_>,
    ) -> std::sync::MutexGuard<'a, MsgState> {
        st = self.spin(st, Self::recv_ready, MsgState::progress, |st| &mut st.spin);
        let events = st.qp.qp_ref().cq_events();
        while !Self::recv_ready(&st) {
            st.progress_and_arm();
            if Self::recv_ready(&st) {
                break;
            }
            // Pending: registered for the CQ's next event; an error (the
            // channel left the reactor) is left to the driver.
            if !matches!(events.poll_take(cx), Poll::Ready(Ok(()))) {
                break;
            }
        }
        self.nudge_if_failed(&st);
        st
    }

    /// The next message, for `recv` and the `Stream`: a notification in
    /// front of it is an `InvalidData` error that leaves it in place for
    /// [`poll_incoming`](Self::poll_incoming).
    pub(crate) fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<io::Result<Option<PoolBytes>>> {
        self.poll_next_incoming(cx, true).map(|r| {
            r.map(|next| match next {
                Some(Incoming::Message(m)) => Some(m),
                _ => None,
            })
        })
    }

    /// The next message or notification, in send order.
    pub(crate) fn poll_incoming(&self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Incoming>>> {
        self.poll_next_incoming(cx, false)
    }

    fn poll_next_incoming(
        &self,
        cx: &mut Context<'_>,
        messages_only: bool,
    ) -> Poll<io::Result<Option<Incoming>>> {
        let mut st = self.lock();
        // A message already complete is taken before more work is posted:
        // a drain can post RDMA READs that rxe runs inside the post, and a
        // receiver that drained first took one message per call while its
        // READs completed several, until the quota stopped them (1 MiB
        // messages: 1.04-1.15x, no quota stalls; benches/history/echo-2026-12-04.md,
        // "Messages: solicited events").
        if !st.core.has_deliverable() {
            st.drain();
        }
        self.nudge_if_failed(&st);
        if !Self::recv_ready(&st) {
            st = self.wait_recv(st, cx);
        }
        // A drain here may have held READs back (a message waits): the
        // driver's tick lets them go if this task does not come back.
        self.ensure_tick(&st);
        if Self::recv_ready(&st) {
            st.spin.ready();
            st.qp.qp_ref().unpark();
        }
        if messages_only && st.core.next_is_notify() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer's next item is a notification (MessageEndpoint::write_notify): \
                 take it with MessageEndpoint::recv_incoming",
            )));
        }
        if let Some(d) = st.core.poll_recv() {
            let msg = match d {
                Delivery::Notify { value, len } => {
                    Some(Incoming::Notification(Notification { value, len }))
                }
                Delivery::Eager { recv_buf_token, .. } => st
                    .kept
                    .remove(&recv_buf_token)
                    .map(|b| Incoming::Message(b.freeze())),
                Delivery::Rendezvous { dest_token, len } => {
                    st.quota_release(dest_token);
                    st.qp.take_dest(dest_token).map(|mut b| {
                        b.set_len(len as usize);
                        Incoming::Message(b.freeze())
                    })
                }
            };
            st.takes_since_send = st.takes_since_send.saturating_add(1);
            // Taking the message made its slot returnable: credit may be due.
            st.settle();
            self.ensure_tick(&st);
            return Poll::Ready(match msg {
                Some(item) => Ok(Some(item)),
                None => {
                    Err(Error::Internal(format!("message buffer {:?} missing", d.token())).into())
                }
            });
        }
        if let Some(e) = st.error_io() {
            return Poll::Ready(Err(e));
        }
        if st.peer_closed || st.closing {
            if st.core.incomplete_recv() > 0 {
                return Poll::Ready(Err(Error::PeerDisconnected.into()));
            }
            return Poll::Ready(Ok(None));
        }
        st.spin.parking();
        st.receivers.register(cx.waker());
        Poll::Pending
    }

    fn send_error(st: &MsgState) -> Option<io::Error> {
        if let Some(e) = st.error_io() {
            return Some(e);
        }
        if st.peer_closed || st.closing {
            return Some(Error::PeerClosed.into());
        }
        None
    }

    pub(crate) fn poll_send_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut st = self.lock();
        if let Some(e) = Self::send_error(&st) {
            return Poll::Ready(Err(e));
        }
        if st.send_queue_has_room() {
            return Poll::Ready(Ok(()));
        }
        st.drain();
        self.ensure_tick(&st);
        if let Some(e) = Self::send_error(&st) {
            return Poll::Ready(Err(e));
        }
        if st.send_queue_has_room() {
            return Poll::Ready(Ok(()));
        }
        st.senders.register(cx.waker());
        st.widen_arm();
        // Its drain may have held READs back.
        self.ensure_tick(&st);
        Poll::Pending
    }

    /// The largest message sent eagerly (without a memory window), bytes.
    pub(crate) fn eager_max(&self) -> usize {
        self.lock().core.params().eager_max as usize
    }

    /// Whether the QP is on a PD of its own (a device without memory
    /// windows): the memory its SGEs name must be the endpoint's own pool.
    pub(crate) fn own_pd(&self) -> bool {
        self.lock().qp.qp_ref().has_own_pd()
    }

    /// Queues `msg`; posts at once unless `defer` (the `Sink` path, whose
    /// `poll_flush` posts the batch with one doorbell; a long batch is
    /// posted every [`FEED_BATCH`] messages).
    pub(crate) fn start_send(&self, msg: OutgoingMessage, defer: bool) -> io::Result<()> {
        self.start_queued(msg, None, defer)
    }

    /// Queues an RDMA WRITE WITH IMMEDIATE of `msg` to `target` (a NOTIFY,
    /// see [`MessageCore::send_notify`]) behind the messages queued
    /// before it, and posts it at once.
    pub(crate) fn start_notify(&self, msg: OutgoingMessage, target: NotifyWrite) -> io::Result<()> {
        self.start_queued(msg, Some(target), false)
    }

    fn start_queued(
        &self,
        msg: OutgoingMessage,
        notify: Option<NotifyWrite>,
        defer: bool,
    ) -> io::Result<()> {
        let mut st = self.lock();
        if let Some(e) = Self::send_error(&st) {
            return Err(e);
        }
        let token = st.token();
        let out = OutboundMessage {
            token,
            len: msg.len() as u64,
            addr: msg.addr(),
        };
        st.qp.add_send(token, msg);
        let queued = match notify {
            Some(target) => st.core.send_notify(out, target),
            None => st.core.send(out),
        };
        if let Err(e) = queued {
            st.qp.release_send(token);
            return Err(match e {
                SendError::TooLong { .. } => io::Error::new(io::ErrorKind::InvalidInput, e),
                SendError::PeerClosed | SendError::Closed => Error::PeerClosed.into(),
                _ => st
                    .error_io()
                    .unwrap_or_else(|| Error::PeerDisconnected.into()),
            });
        }
        st.takes_since_send = 0;
        let rendezvous = notify.is_none() && out.len > u64::from(st.core.params().eager_max);
        let at_once = send_posts_at_once(defer, rendezvous, st.core.outstanding_wrs());
        if at_once || st.core.queued() >= FEED_BATCH {
            st.settle();
        }
        st.sent_since_tick = true;
        if st.core.queued() > 0 && !defer {
            st.sends_deferred += 1;
            if st.defer_to_completion() {
                st.widen_arm();
            }
        }
        self.ensure_tick(&st);
        Ok(())
    }

    /// Ready once every queued message is posted to the NIC (the `Sink`
    /// flush: like a socket write, not an acknowledgement).
    pub(crate) fn poll_posted(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut st = self.lock();
        st.drain();
        self.nudge_if_failed(&st);
        self.ensure_tick(&st);
        if let Some(e) = Self::send_error(&st) {
            return Poll::Ready(Err(e));
        }
        if st.core.queued() == 0 {
            return Poll::Ready(Ok(()));
        }
        st.senders.register(cx.waker());
        st.widen_arm();
        // Its drain may have held READs back.
        self.ensure_tick(&st);
        Poll::Pending
    }

    pub(crate) fn poll_flush(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut st = self.lock();
        st.drain();
        self.nudge_if_failed(&st);
        self.ensure_tick(&st);
        if let Some(e) = st.error_io() {
            return Poll::Ready(Err(e));
        }
        if st.core.all_sent() && st.qp.sends_held() == 0 {
            return Poll::Ready(Ok(()));
        }
        // A peer that closed cleanly took every message of ours (the clean
        // close requires it): with nothing left queued, what is still
        // outstanding is our own control traffic or clean-up, so the flush
        // succeeded. (A server answering EOF with `close` got `PeerClosed`
        // whenever its last CREDIT's completion had not been polled yet.)
        if st.peer_closed && st.core.queued() == 0 && st.qp.sends_not_taken() == 0 {
            return Poll::Ready(Ok(()));
        }
        if st.peer_closed || st.closing {
            return Poll::Ready(Err(Error::PeerClosed.into()));
        }
        st.flushers.register(cx.waker());
        st.widen_arm();
        // Its drain may have held READs back.
        self.ensure_tick(&st);
        Poll::Pending
    }

    pub(crate) fn abort(&self) {
        let mut st = self.lock();
        st.core.abort(ABORT_CODE_APPLICATION);
        st.settle();
        st.fail(Error::LocalAbort);
        drop(st);
        self.nudge();
    }

    pub(crate) fn stats(&self) -> MessageStats {
        let st = self.lock();
        let mut s = st.core.stats();
        s.window_binds = st.qp.window_binds();
        s.windows_held = st.qp.windows_held() as u64;
        s.scoped_registrations = st.qp.scoped_registrations();
        s.scoped_keys_live = st.qp.scoped_live() as u64;
        s.buffers_held_for_nic = st.qp.retired() as u64;
        s.quota_bytes_held = st.quota.held();
        s.quota_stalls = st.quota.stalls();
        s.spin_hits = st.spin.spin_hits;
        s.recv_parks = st.spin.parks;
        s.spin_limit_us = st.spin.limit_us();
        s.sends_deferred = st.sends_deferred;
        s.reads_held = st.reads_holds;
        s.events_left_to_reader = st
            .qp
            .qp_ref()
            .cq_events()
            .delegation()
            .map_or(0, |d| d.left());
        (s.lock_waits, s.driver_wakeups) = self.contention();
        s
    }

    /// The last memory window this endpoint bound (test hook).
    #[cfg(tokio_rdma_guest)]
    pub(crate) fn last_window(&self) -> Option<(u64, u64, u32)> {
        self.lock().qp.last_window()
    }

    #[cfg(tokio_rdma_guest)]
    pub(crate) fn last_sge(&self) -> Option<PostedSge> {
        self.lock().qp.last_sge()
    }

    /// Queues a rendezvous announcement for memory this side does not own
    /// (test hook for a misbehaving peer).
    #[cfg(tokio_rdma_guest)]
    pub(crate) fn send_forged_rts(&self, len: u64, addr: u64, rkey: u32) -> io::Result<()> {
        let mut st = self.lock();
        let token = st.token();
        st.qp.forge_rts(token, rkey);
        st.core
            .send(OutboundMessage { token, len, addr })
            .map_err(io::Error::other)?;
        st.settle();
        // Its drain may have held READs back.
        self.ensure_tick(&st);
        Ok(())
    }
}

/// A grant's connection: revoking goes through the remote slots below.
impl crate::remote::GrantOwner for MsgConn {
    fn revoke(
        self: std::sync::Arc<Self>,
        id: u64,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = io::Result<()>> + Send>> {
        Box::pin(async move {
            let Some(wr_id) = self.revoke_grant(id).await? else {
                return Ok(());
            };
            self.wait_remote(wr_id, "memory window invalidation (revoke)")
                .await
                .map(|_| ())
        })
    }

    fn revoke_dropped(&self, id: u64) {
        self.revoke_dropped_grant(id);
    }
}

/// Remote memory (`crate::remote`): posting one-sided operations, grant
/// binds and revocations, and waiting for them.
impl MsgConn {
    /// Why no remote work can start or finish on this endpoint now.
    fn remote_dead(st: &MsgState) -> Option<io::Error> {
        if let Some(e) = st.error_io() {
            return Some(e);
        }
        (st.peer_closed || st.closing).then(|| Error::PeerClosed.into())
    }

    /// Waits for a remote slot, then runs `post` on the QP in the same lock
    /// hold: `Err` with the endpoint's error once it failed or closed (see
    /// [`remote_dead`](Self::remote_dead)), before or while waiting.
    async fn with_remote_slot<T>(
        &self,
        need: u16,
        post: impl FnOnce(&mut MessageQp) -> Result<T>,
    ) -> io::Result<T> {
        let mut post = Some(post);
        std::future::poll_fn(|cx| {
            let mut st = self.lock();
            st.drain();
            self.nudge_if_failed(&st);
            if let Some(e) = Self::remote_dead(&st) {
                return Poll::Ready(Err(e));
            }
            if st.qp.poll_remote_slot(cx, need).is_pending() {
                // A slot frees at a completion: arm for it (a waiter for a
                // slot keeps the driver's arm wide: `remote_needs_events`).
                st.progress_and_arm();
                if st.qp.poll_remote_slot(cx, need).is_pending() {
                    self.ensure_tick(&st);
                    return Poll::Pending;
                }
            }
            let Some(post) = post.take() else {
                return Poll::Ready(Err(Error::Internal(
                    "remote work polled after it was posted".into(),
                )
                .into()));
            };
            // No arm here: the operation's waiter arms when it parks
            // (`RemoteWait`), and one that completes before it looks
            // raises no event to wake the driver for nothing.
            let r = post(&mut st.qp).map_err(io::Error::from);
            self.ensure_tick(&st);
            Poll::Ready(r)
        })
        .await
    }

    /// Waits for a remote slot, then posts `wr` with `local`; returns the
    /// wr_id to [`wait_remote`](Self::wait_remote) on.
    pub(crate) async fn start_remote(&self, wr: RemoteWr, local: Local) -> io::Result<u64> {
        // One unit of tokio's cooperative budget per operation: rxe can
        // complete a small READ inside its post, so a task looping over
        // operations that all complete at once never returned to the
        // scheduler (a guest test's four tasks held both workers and
        // stopped the runtime's timers).
        tokio::task::coop::consume_budget().await;
        self.with_remote_slot(1, |qp| qp.post_remote(wr, local))
            .await
    }

    /// Waits for `batch.len()` remote slots, then posts the batch with one
    /// doorbell; returns the wr_id to [`wait_remote`](Self::wait_remote)
    /// on (its buffers come back in batch order).
    pub(crate) async fn start_remote_batch(
        &self,
        batch: Vec<(RemoteWr, Local)>,
    ) -> io::Result<u64> {
        tokio::task::coop::consume_budget().await;
        let need = u16::try_from(batch.len()).unwrap_or(u16::MAX);
        self.with_remote_slot(need, |qp| qp.post_remote_batch(batch))
            .await
    }

    /// Waits for a remote slot, then binds a grant's window over `len`
    /// bytes at `offset` of `region`; returns the bind's wr_id (the
    /// grant's id) and the key.
    pub(crate) async fn start_grant(
        &self,
        region: &LocalRegion,
        offset: u64,
        len: u64,
        access: GrantAccess,
    ) -> io::Result<(u64, u32)> {
        self.with_remote_slot(1, |qp| qp.bind_grant(region, offset, len, access))
            .await
    }

    /// Posts the revocation of a dropped grant (queued while every remote
    /// slot is taken); nothing when the endpoint failed or closed (its
    /// QP's windows die with it).
    pub(crate) fn revoke_dropped_grant(&self, grant: u64) {
        let mut st = self.lock();
        if Self::remote_dead(&st).is_some() {
            return;
        }
        // A failed post means a failed QP, whose windows die with it.
        let _ = st.qp.revoke_grant(grant, true);
        st.widen_arm();
        self.ensure_tick(&st);
        drop(st);
        self.nudge();
    }

    /// Waits for a remote slot, then posts the revocation of grant
    /// `grant`; `None` when there is nothing to wait for (its window is
    /// gone, or the endpoint failed or closed, and its QP with it).
    pub(crate) async fn revoke_grant(&self, grant: u64) -> io::Result<Option<u64>> {
        if Self::remote_dead(&self.lock()).is_some() {
            return Ok(None);
        }
        match self
            .with_remote_slot(1, |qp| qp.revoke_grant(grant, false))
            .await
        {
            // Failed or closed while waiting: the QP's windows die with it.
            Err(_) if Self::remote_dead(&self.lock()).is_some() => Ok(None),
            r => r,
        }
    }

    /// Grants whose window is bound now.
    pub(crate) fn grants_held(&self) -> usize {
        self.lock().qp.grants_held()
    }

    /// Scatter-gather entries one RDMA WRITE (or READ, `read`) of this
    /// QP may carry.
    pub(crate) fn max_sge(&self, read: bool) -> usize {
        let st = self.lock();
        let qp = st.qp.qp_ref();
        (if read {
            qp.max_read_sge()
        } else {
            qp.max_send_sge()
        }) as usize
    }

    /// Waits for remote WR `wr_id`: its local buffer on success. Dropping
    /// the future hands the buffer to the ledger.
    pub(crate) fn wait_remote(&self, wr_id: u64, op: &'static str) -> RemoteWait<'_> {
        RemoteWait {
            conn: self,
            wr_id,
            op,
            done: false,
        }
    }
}

/// The future of [`MsgConn::wait_remote`].
pub(crate) struct RemoteWait<'a> {
    conn: &'a MsgConn,
    wr_id: u64,
    op: &'static str,
    done: bool,
}

impl std::future::Future for RemoteWait<'_> {
    type Output = io::Result<Vec<Local>>;

    /// Drains the CQ, and while the WR has not completed arms it and
    /// registers this task on its next event itself, as `recv` does
    /// ([`MsgConn::wait_recv`]): the completion wakes the waiting task
    /// without a hop through the driver task, and the driver keeps its
    /// arm wide only while a task is parked here
    /// ([`MessageQp::remote_needs_events`]; the driver's arm for every
    /// completion, not this hop, was what made an 8 B READ 2.2x
    /// `ib_read_lat -e` on the multi-thread runtime:
    /// benches/history/remote-wait-2026-12-07.md). A task that drops the
    /// future while registered leaves the event to the driver's tick (see
    /// `Delegation`).
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut st = this.conn.lock();
        st.drain();
        this.conn.nudge_if_failed(&st);
        let mut armed = false;
        loop {
            match st.qp.poll_remote(this.wr_id, cx) {
                Poll::Ready(Some((WcStatus::Success, local))) => {
                    this.done = true;
                    if armed {
                        st.qp.qp_ref().unpark();
                    }
                    return Poll::Ready(Ok(local));
                }
                Poll::Ready(Some((status, _))) => {
                    this.done = true;
                    // A flush reports the connection's failure, not this WR's.
                    let err = match st.error_io() {
                        Some(e) if status == WcStatus::Flushed => e,
                        _ => Error::RemoteAccess {
                            op: this.op,
                            status: status.code(),
                        }
                        .into(),
                    };
                    this.conn.nudge_if_failed(&st);
                    return Poll::Ready(Err(err));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    return Poll::Ready(Err(st
                        .error_io()
                        .unwrap_or_else(|| Error::PeerDisconnected.into())));
                }
                Poll::Pending => {}
            }
            if let Some(e) = MsgConn::remote_dead(&st) {
                st.qp.abandon_remote(this.wr_id);
                this.done = true;
                return Poll::Ready(Err(e));
            }
            // Drain, arm, drain again (a completion between the first
            // drain and the arm raises no event), then look again; once
            // registered on the CQ's next event, wait.
            st.progress_and_arm();
            armed = true;
            this.conn.nudge_if_failed(&st);
            if st.qp.remote_done(this.wr_id) {
                continue;
            }
            let events = st.qp.qp_ref().cq_events();
            // Pending: registered for the CQ's next event; an error (the
            // channel left the reactor) is left to the driver.
            if !matches!(events.poll_take(cx), Poll::Ready(Ok(()))) {
                break;
            }
        }
        this.conn.ensure_tick(&st);
        Poll::Pending
    }
}

impl Drop for RemoteWait<'_> {
    /// Hands the operation's buffers to the ledger and arms the CQ for its
    /// completion, which the driver then takes (`remote_needs_events`).
    fn drop(&mut self) {
        if !self.done {
            let mut st = self.conn.lock();
            st.qp.abandon_remote(self.wr_id);
            st.widen_arm();
        }
    }
}

/// Builds the endpoint's state and starts the connection's driver.
pub(crate) fn start(
    est: Established<super::PreparedQp>,
    core: MessageCore,
    cfg: &MessageConfig,
) -> Result<Handle<MsgState>> {
    let super::PreparedQp { qp, pool, .. } = est.qp;
    let quota = cfg.quota_for(&pool);
    let next_token = u64::from(cfg.rdma.recv_queue_depth) + 1;
    let state = MsgState {
        core,
        qp,
        pool,
        eager_buf_len: cfg.eager_buf_len as usize,
        next_token,
        kept: HashMap::new(),
        unposted: 0,
        allocs: VecDeque::new(),
        quota: Quota::new(quota),
        send_queue_limit: cfg.send_queue_limit,
        send_queue_bytes: cfg.send_queue_bytes,
        linger: cfg.rdma.linger,
        receivers: WakerList::default(),
        spin: SpinWait::new(cfg.rdma.wait_strategy),
        senders: WakerList::default(),
        flushers: WakerList::default(),
        error: None,
        peer_closed: false,
        closing: false,
        need_memory: false,
        solicited_armed: false,
        sent_since_tick: false,
        sent_last_period: false,
        sends_deferred: 0,
        reads_waiting: false,
        reads_holds: 0,
        tick_round: false,
        takes_since_send: ANSWER_TAKES + 1,
        scratch: Vec::with_capacity(64),
        batch: Vec::with_capacity(64),
    };
    Ok(crate::conn::start(Started {
        state,
        id: est.id,
        device: est.device,
        fallback_addr: est.fallback_addr,
        linger: cfg.rdma.linger,
        keepalive: cfg.rdma.keepalive,
        port_grace: cfg.rdma.retry_bound(),
        kind: "message",
    }))
}

#[cfg(test)]
mod tests {
    use super::{ANSWER_TAKES, POST_AT_ONCE_BELOW, may_hold_reads, send_posts_at_once};

    #[test]
    fn a_rendezvous_send_posts_at_once_and_an_eager_one_below_the_bound() {
        let below = POST_AT_ONCE_BELOW - 1;
        // send(), eager: at once only below the bound.
        assert!(send_posts_at_once(false, false, 0));
        assert!(send_posts_at_once(false, false, below));
        assert!(!send_posts_at_once(false, false, POST_AT_ONCE_BELOW));
        assert!(!send_posts_at_once(false, false, 200));
        // send(), rendezvous: always.
        assert!(send_posts_at_once(false, true, 0));
        assert!(send_posts_at_once(false, true, POST_AT_ONCE_BELOW));
        assert!(send_posts_at_once(false, true, 200));
        // A Sink feed never does (its flush or FEED_BATCH posts).
        for (rendezvous, outstanding) in [(false, 0), (true, 0), (true, 200)] {
            assert!(!send_posts_at_once(true, rendezvous, outstanding));
        }
    }

    #[test]
    fn reads_are_held_for_an_endpoint_that_answers_what_it_takes() {
        let no_send_yet = ANSWER_TAKES + 1;
        // Sent in this tick period or the last: held, however many taken.
        assert!(may_hold_reads(false, true, no_send_yet));
        assert!(may_hold_reads(false, true, u32::MAX));
        // Sent within its last ANSWER_TAKES takes, long ago in time.
        assert!(may_hold_reads(false, false, 0));
        assert!(may_hold_reads(false, false, 1));
        assert!(may_hold_reads(false, false, ANSWER_TAKES));
        // A receiver that only takes (or has not sent yet): posts as before.
        assert!(!may_hold_reads(false, false, no_send_yet));
        assert!(!may_hold_reads(false, false, u32::MAX));
        // The driver's tick round lets held READs go, whoever sent.
        assert!(!may_hold_reads(true, true, 0));
        assert!(!may_hold_reads(true, false, 0));
    }
}
