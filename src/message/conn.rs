//! The message endpoint's runtime: state shared by the application's
//! handles and a driver task, around a [`MessageCore`].
//!
//! Whoever holds the lock makes progress: it drains the completion queue,
//! reposts receive buffers (a fresh pool buffer for one kept by an EAGER
//! message, the same buffer otherwise), allocates rendezvous destinations,
//! handles the core's events and posts what the core has ready. The driver
//! task does the same whenever the completion channel fires, so receive
//! progress, credit and rendezvous READs never wait for the application.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::Notify;
use tracing::{Instrument, debug, trace, warn};

use super::{MessageConfig, PreparedQp};
use crate::error::{Error, Result};
use crate::pool::{ExhaustedPolicy, MemoryPool, OutgoingMessage, PoolBuf, PoolBytes, PoolError};
use crate::proto::message::{
    ABORT_CODE_APPLICATION, Delivery, MessageCore, MessageError, MessageStats, MsgEvent,
    MsgTransmit, OutboundMessage, RecvDisposition, SendError, abort_code_reason,
};
use crate::stream::conn::{ConnError, Counted, Established};

/// One application handle on a message endpoint.
pub(crate) type Handle = crate::stream::conn::Handle<MsgConn>;
use crate::verbs::cm::{CmEventKind, CmId};
use crate::verbs::msg::{MessageQp, PostedSge};
use crate::verbs::rc::{Completion, RECV_WR_FLAG};

const WC_SUCCESS: u32 = 0;
const WC_WR_FLUSH_ERR: u32 = 5;
const WC_REM_ACCESS_ERR: u32 = 10;

/// How often a driver waiting for pool memory looks again even without a
/// notification (a return can race with the waiter's registration).
const MEMORY_RETRY: Duration = Duration::from_millis(5);

/// Messages fed through `Sink::start_send` are posted together once this
/// many are queued (or at `poll_flush`).
const FEED_BATCH: usize = 32;

pub(crate) struct State {
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
    send_queue_limit: usize,
    recv_waker: Option<Waker>,
    send_waker: Option<Waker>,
    flush_waker: Option<Waker>,
    error: Option<ConnError>,
    /// The peer disconnected (rdma_cm DISCONNECTED).
    peer_closed: bool,
    /// This side disconnected.
    closing: bool,
    /// Waiting for the pool to have memory again.
    need_memory: bool,
    handles: usize,
    scratch: Vec<Completion>,
    /// Reused list of WRs posted together.
    batch: Vec<MsgTransmit>,
}

impl State {
    fn token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    fn wake_all(&mut self) {
        for w in [
            self.recv_waker.take(),
            self.send_waker.take(),
            self.flush_waker.take(),
        ]
        .into_iter()
        .flatten()
        {
            w.wake();
        }
    }

    fn fail(&mut self, err: ConnError) {
        if self.error.is_none() {
            debug!(error = ?err.to_io(), "message endpoint failed");
            self.error = Some(err);
        }
        self.wake_all();
    }

    fn fail_with(&mut self, e: Error) {
        let kind = e.kind();
        self.fail(ConnError::new(kind, e.to_string()));
    }

    fn dead(&self) -> bool {
        self.error.is_some() || self.peer_closed || self.closing
    }

    /// The connection failed underneath: stop the QP, give every buffer
    /// back.
    fn lost(&mut self, err: ConnError) {
        self.fail(err);
        self.qp.as_mut().set_error();
        self.core.on_connection_lost();
    }

    fn protocol_error(&mut self, e: MessageError) {
        warn!(error = %e, "peer violated the message protocol; aborting");
        self.fail_with(Error::Message(e));
    }

    fn on_completion(&mut self, wc: &Completion) {
        trace!(
            wr_id = wc.wr_id,
            status = wc.status,
            imm = wc.imm,
            byte_len = wc.byte_len,
            "completion"
        );
        let is_recv = wc.wr_id & RECV_WR_FLAG != 0;
        if wc.status != WC_SUCCESS {
            if is_recv {
                drop(self.qp.take_recv(wc.wr_id, 0));
            } else {
                self.qp.send_completed(wc.wr_id);
            }
            if wc.status == WC_WR_FLUSH_ERR && self.dead() {
                return;
            }
            let err = if wc.status == WC_REM_ACCESS_ERR && !is_recv {
                ConnError::new(
                    io::ErrorKind::InvalidData,
                    "RDMA READ of the peer's announced buffer failed with a remote access \
                     error (ibv_wc_status 10): the range or rkey is not (or no longer) \
                     registered for remote read at the peer: a bogus announcement, or a \
                     peer that deregistered it, for example by exiting",
                )
            } else {
                ConnError::new(
                    io::ErrorKind::ConnectionReset,
                    format!(
                        "work request failed with ibv_wc_status {} (peer gone?)",
                        wc.status
                    ),
                )
            };
            self.lost(err);
            return;
        }
        if is_recv {
            let Some((token, buf)) = self.qp.take_recv(wc.wr_id, wc.byte_len) else {
                self.fail_with(Error::Verbs {
                    op: "message receive",
                    source: io::Error::other(format!("completion for unknown wr_id {}", wc.wr_id)),
                });
                return;
            };
            match self.core.on_recv(wc.imm, wc.byte_len, token, &buf) {
                Ok(RecvDisposition::Keep) => {
                    self.kept.insert(token, buf);
                    self.unposted += 1;
                }
                Ok(RecvDisposition::Release) => {
                    if !self.dead() {
                        if let Err(e) = self.qp.post_recvs(vec![(token, buf)]) {
                            self.fail_with(e);
                        }
                    }
                }
                Err(e) => self.protocol_error(e),
            }
            // A message arrived, or credit for blocked sends.
            for w in [self.recv_waker.take(), self.send_waker.take()]
                .into_iter()
                .flatten()
            {
                w.wake();
            }
        } else {
            self.qp.send_completed(wc.wr_id);
            if let Err(e) = self.core.on_send_complete(wc.wr_id) {
                self.fail_with(Error::Message(e));
            }
            // A completed READ may have finished a message for the reader.
            for w in [self.send_waker.take(), self.recv_waker.take()]
                .into_iter()
                .flatten()
            {
                w.wake();
            }
        }
    }

    fn handle_events(&mut self) -> bool {
        let mut any = false;
        while let Some(ev) = self.core.poll_event() {
            any = true;
            match ev {
                MsgEvent::SendDone { token } => {
                    self.qp.release_send(token);
                    if let Some(w) = self.flush_waker.take() {
                        w.wake();
                    }
                }
                MsgEvent::AllocateDestination { len } => self.allocs.push_back(len),
                MsgEvent::Aborted { code } => {
                    self.fail_with(Error::PeerAborted {
                        code,
                        reason: abort_code_reason(code),
                    });
                }
                MsgEvent::Reclaim { token } => {
                    if !self.qp.release_send(token) && self.kept.remove(&token).is_none() {
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
        let mut bufs = Vec::new();
        while self.unposted > 0 {
            match self.pool.try_alloc(self.eager_buf_len) {
                Ok(b) => {
                    let t = self.token();
                    bufs.push((t, b));
                    self.unposted -= 1;
                }
                Err(PoolError::Exhausted { .. }) => {
                    // The core returns no credit for these slots, so the
                    // peer stalls instead of meeting an empty receive queue.
                    self.need_memory = true;
                    break;
                }
                Err(e) => {
                    self.fail_with(e.into());
                    break;
                }
            }
        }
        if !bufs.is_empty() {
            if let Err(e) = self.qp.post_recvs(bufs) {
                self.fail_with(e);
            }
        }
        self.core.set_unposted_recvs(self.unposted);
    }

    /// Allocates rendezvous destinations, in order.
    fn allocate(&mut self) {
        while let Some(&len) = self.allocs.front() {
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
                    self.qp.add_dest(t, buf);
                    if let Err(e) = self.core.destination_ready(t) {
                        self.fail_with(Error::Message(e));
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
                    self.fail(ConnError::new(
                        io::ErrorKind::OutOfMemory,
                        format!("could not allocate {len} bytes for an incoming message: {e}"),
                    ));
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
                self.allocate();
            }
            let mut posted = false;
            if !self.peer_closed && !self.closing {
                let mut batch = std::mem::take(&mut self.batch);
                batch.clear();
                while let Some(t) = self.core.poll_transmit() {
                    trace!(?t, "post");
                    batch.push(t);
                }
                posted = !batch.is_empty();
                if let Err(e) = self.qp.post(&batch) {
                    self.lost(ConnError::new(
                        io::ErrorKind::ConnectionAborted,
                        e.to_string(),
                    ));
                }
                self.batch = batch;
            }
            if !posted && !self.handle_events() {
                break;
            }
        }
    }

    /// Drains the CQ and does the follow-up work; returns completions seen.
    pub(crate) fn progress(&mut self) -> usize {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        if let Err(e) = self.qp.qp_ref().poll(&mut scratch) {
            self.fail_with(e);
        }
        for wc in &scratch {
            self.on_completion(wc);
        }
        let n = scratch.len();
        self.scratch = scratch;
        self.settle();
        n
    }

    /// Drain, arm, drain again (the channel is edge triggered).
    fn progress_and_arm(&mut self) {
        self.progress();
        if let Err(e) = self.qp.qp_ref().arm() {
            self.fail_with(e);
        }
        self.progress();
    }

    fn error_io(&self) -> Option<io::Error> {
        self.error.as_ref().map(ConnError::to_io)
    }
}

/// The endpoint shared by handles and the driver.
pub(crate) struct MsgConn {
    state: Mutex<State>,
    notify: Notify,
    /// Set (`true`) by the driver once it disconnected.
    closed: tokio::sync::watch::Sender<bool>,
    pub(crate) pool: MemoryPool,
    pub(crate) local_addr: SocketAddr,
    pub(crate) peer_addr: SocketAddr,
    pub(crate) qp_num: u32,
    pub(crate) device: String,
}

static ENDPOINT_IDS: AtomicU64 = AtomicU64::new(1);

impl MsgConn {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `poll_recv` has something to return.
    fn recv_ready(st: &State) -> bool {
        st.core.has_deliverable() || st.error.is_some() || st.peer_closed
    }

    /// With nothing to deliver: arm the CQ and register this task on the
    /// completion channel itself, so an arriving message wakes the reader
    /// without a hop through the driver task.
    fn wait_recv<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        cx: &mut Context<'_>,
    ) -> MutexGuard<'a, State> {
        let events = st.qp.qp_ref().cq_events();
        while !Self::recv_ready(&st) {
            st.progress_and_arm();
            if Self::recv_ready(&st) {
                break;
            }
            match events.poll_read_ready(cx) {
                Poll::Ready(Ok(mut guard)) => {
                    st.qp.as_mut().take_events();
                    guard.clear_ready();
                }
                // Pending: registered; an error: left to the driver.
                _ => break,
            }
        }
        st
    }

    pub(crate) fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<io::Result<Option<PoolBytes>>> {
        let mut st = self.lock();
        st.progress();
        if !Self::recv_ready(&st) {
            st = self.wait_recv(st, cx);
        }
        if let Some(d) = st.core.poll_recv() {
            let msg = match d {
                Delivery::Eager { recv_buf_token, .. } => st.kept.remove(&recv_buf_token),
                Delivery::Rendezvous { dest_token, len } => {
                    st.qp.take_dest(dest_token).map(|mut b| {
                        b.set_len(len as usize);
                        b
                    })
                }
            };
            // Taking the message made its slot returnable: credit may be due.
            st.settle();
            return Poll::Ready(match msg {
                Some(buf) => Ok(Some(buf.freeze())),
                None => Err(io::Error::other(format!(
                    "message buffer {} missing",
                    d.token()
                ))),
            });
        }
        if let Some(e) = st.error_io() {
            return Poll::Ready(Err(e));
        }
        if st.peer_closed {
            if st.core.pending_recv() > 0 {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "the peer disconnected in the middle of a rendezvous",
                )));
            }
            return Poll::Ready(Ok(None));
        }
        st.recv_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn send_error(st: &State) -> Option<io::Error> {
        if let Some(e) = st.error_io() {
            return Some(e);
        }
        if st.peer_closed || st.closing {
            return Some(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the peer closed the message endpoint",
            ));
        }
        None
    }

    pub(crate) fn poll_send_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut st = self.lock();
        if let Some(e) = Self::send_error(&st) {
            return Poll::Ready(Err(e));
        }
        if st.core.queued() < st.send_queue_limit {
            return Poll::Ready(Ok(()));
        }
        st.progress();
        if let Some(e) = Self::send_error(&st) {
            return Poll::Ready(Err(e));
        }
        if st.core.queued() < st.send_queue_limit {
            return Poll::Ready(Ok(()));
        }
        st.send_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Queues `msg`; posts at once unless `defer` (the `Sink` path, whose
    /// `poll_flush` posts the batch with one doorbell; a long batch is
    /// posted every [`FEED_BATCH`] messages).
    pub(crate) fn start_send(&self, msg: OutgoingMessage, defer: bool) -> io::Result<()> {
        let mut st = self.lock();
        if let Some(e) = Self::send_error(&st) {
            return Err(e);
        }
        let token = st.token();
        let out = OutboundMessage {
            token,
            len: msg.len() as u64,
            addr: msg.addr(),
            rkey: msg.rkey(),
        };
        st.qp.add_send(token, msg);
        if let Err(e) = st.core.send(out) {
            st.qp.release_send(token);
            return Err(match e {
                SendError::TooLong { .. } => io::Error::new(io::ErrorKind::InvalidInput, e),
                _ => st
                    .error_io()
                    .unwrap_or_else(|| io::Error::new(io::ErrorKind::ConnectionReset, e)),
            });
        }
        if !defer || st.core.queued() >= FEED_BATCH {
            st.settle();
        }
        Ok(())
    }

    /// Ready once every queued message is posted to the NIC (the `Sink`
    /// flush: like a socket write, not an acknowledgement).
    pub(crate) fn poll_posted(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut st = self.lock();
        st.progress();
        if let Some(e) = Self::send_error(&st) {
            return Poll::Ready(Err(e));
        }
        if st.core.queued() == 0 {
            return Poll::Ready(Ok(()));
        }
        st.send_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    pub(crate) fn poll_flush(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut st = self.lock();
        st.progress();
        if let Some(e) = st.error_io() {
            return Poll::Ready(Err(e));
        }
        if st.core.all_sent() && st.qp.sends_held() == 0 {
            return Poll::Ready(Ok(()));
        }
        if st.peer_closed {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the peer closed before taking every message",
            )));
        }
        st.flush_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    pub(crate) fn abort(&self) {
        let mut st = self.lock();
        st.core.abort(ABORT_CODE_APPLICATION);
        st.settle();
        st.fail(ConnError::new(
            io::ErrorKind::ConnectionAborted,
            "the message endpoint was aborted locally",
        ));
    }

    pub(crate) fn stats(&self) -> MessageStats {
        self.lock().core.stats()
    }

    pub(crate) fn last_sge(&self) -> Option<PostedSge> {
        self.lock().qp.last_sge()
    }

    /// Queues a rendezvous announcement for memory this side does not own
    /// (test hook for a misbehaving peer).
    #[cfg(feature = "guest-tests")]
    pub(crate) fn send_forged_rts(&self, len: u64, addr: u64, rkey: u32) -> io::Result<()> {
        let mut st = self.lock();
        let token = st.token();
        st.core
            .send(OutboundMessage {
                token,
                len,
                addr,
                rkey,
            })
            .map_err(io::Error::other)?;
        st.settle();
        Ok(())
    }

    /// Resolves once the driver has disconnected (every handle dropped
    /// and every message taken, or the connection failed).
    pub(crate) fn wait_closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.closed.subscribe();
        async move {
            let _ = rx.wait_for(|closed| *closed).await;
        }
    }

    /// Live application handles.
    pub(crate) fn handles(&self) -> usize {
        self.lock().handles
    }
}

impl Counted for MsgConn {
    fn add_handle(&self) {
        self.lock().handles += 1;
    }

    fn drop_handle(&self) {
        let last = {
            let mut st = self.lock();
            st.handles -= 1;
            st.handles == 0
        };
        if last {
            self.notify.notify_one();
        }
    }
}

/// Builds the shared endpoint and starts its driver task.
pub(crate) fn spawn(
    est: Established<PreparedQp>,
    core: MessageCore,
    cfg: &MessageConfig,
) -> Result<Arc<MsgConn>> {
    let local_addr = est.id.local_addr().unwrap_or(est.fallback_addr);
    let peer_addr = est.id.peer_addr().unwrap_or(est.fallback_addr);
    let PreparedQp { qp, pool, .. } = est.qp;
    let qp_num = qp.qp_ref().qp_num();
    let next_token = u64::from(cfg.rdma.recv_queue_depth) + 1;
    let state = State {
        core,
        qp,
        pool: pool.clone(),
        eager_buf_len: cfg.eager_buf_len as usize,
        next_token,
        kept: HashMap::new(),
        unposted: 0,
        allocs: VecDeque::new(),
        send_queue_limit: cfg.send_queue_limit,
        recv_waker: None,
        send_waker: None,
        flush_waker: None,
        error: None,
        peer_closed: false,
        closing: false,
        need_memory: false,
        handles: 1,
        scratch: Vec::with_capacity(64),
        batch: Vec::with_capacity(64),
    };
    let conn = Arc::new(MsgConn {
        state: Mutex::new(state),
        notify: Notify::new(),
        closed: tokio::sync::watch::Sender::new(false),
        pool,
        local_addr,
        peer_addr,
        qp_num,
        device: est.device,
    });
    let span = tracing::debug_span!(
        "rdma_msg",
        id = ENDPOINT_IDS.fetch_add(1, Ordering::Relaxed),
        local = %local_addr,
        peer = %peer_addr,
        qp = qp_num
    );
    tokio::spawn(driver(Arc::clone(&conn), est.id, cfg.rdma.linger).instrument(span));
    Ok(conn)
}

async fn driver(conn: Arc<MsgConn>, id: CmId, linger: Duration) {
    debug!("message endpoint established");
    let channel = Arc::clone(id.channel());
    let cq_events = conn.lock().qp.qp_ref().cq_events();
    let mut linger_deadline: Option<tokio::time::Instant> = None;
    loop {
        let (done, need_memory) = {
            let mut st = conn.lock();
            st.progress_and_arm();
            if st.handles == 0 && linger_deadline.is_none() {
                linger_deadline = Some(tokio::time::Instant::now() + linger);
            }
            let finished = st.error.is_some() || st.peer_closed || st.core.all_sent();
            (st.handles == 0 && finished, st.need_memory)
        };
        if done {
            break;
        }
        let pool = conn.pool.clone();
        tokio::select! {
            r = cq_events.readable() => {
                let Ok(mut guard) = r else { break };
                conn.lock().qp.as_mut().take_events();
                guard.clear_ready();
            }
            ev = channel.next() => match ev {
                Ok(ev) => {
                    trace!(kind = ?ev.kind, "rdma_cm event");
                    if matches!(ev.kind, CmEventKind::Disconnected | CmEventKind::DeviceRemoval) {
                        let mut st = conn.lock();
                        st.progress();
                        st.peer_closed = true;
                        st.qp.as_mut().set_error();
                        st.wake_all();
                    }
                }
                Err(e) => conn.lock().fail(ConnError::new(io::ErrorKind::ConnectionAborted, e.to_string())),
            },
            _ = conn.notify.notified() => {}
            _ = async {
                if need_memory {
                    let _ = tokio::time::timeout(MEMORY_RETRY, pool.memory_returned()).await;
                } else {
                    std::future::pending::<()>().await;
                }
            } => {}
            _ = async {
                match linger_deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => {
                debug!("linger timeout: the peer did not take the remaining messages");
                conn.lock().fail(ConnError::new(io::ErrorKind::TimedOut, "linger timeout"));
            }
        }
    }
    debug!("message endpoint closing");
    let _ = id.disconnect();
    conn.closed.send_replace(true);
    {
        let mut st = conn.lock();
        st.closing = true;
        st.qp.as_mut().set_error();
        st.core.on_connection_lost();
        st.handle_events();
        st.wake_all();
    }
    // Buffers go back to the pool when the last handle's Arc drops (the QP
    // is destroyed first); rdma_destroy_id may block, so off the runtime.
    tokio::task::spawn_blocking(move || drop(id));
}
