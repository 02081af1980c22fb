//! The connection runtime: shared state between the application's
//! [`RdmaStream`](super::RdmaStream) handles and a background driver task.
//!
//! The driver owns receive progress: it drains the completion queue,
//! reposts receive WRs, moves arrived bytes out of the ring (up to
//! `recv_buffer_limit`), returns credit and posts what the application wrote
//! while credit was short. None of it waits for `poll_read`. The application
//! side copies into the registered send buffer and posts directly from
//! `poll_write` (no task hop on the fast path).

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::sync::Notify;
use tracing::{Instrument, debug, trace, warn};

use crate::config::RdmaConfig;
use crate::error::{Error, Result};
use crate::proto::handshake::{EndpointKind, Hello};
use crate::proto::stream::{RecvEvent, StreamCore, Transmit, TransmitKind};
use crate::proto::{ProtocolError, WriteError};
use crate::stats::ConnectionStats;
use crate::verbs::cm::{CmEventKind, CmId};
use crate::verbs::rc::{Completion, OpenDevice, RcQueuePair, RcSizes, WcKind};

/// `ibv_wc_status` values the driver distinguishes.
const WC_SUCCESS: u32 = 0;
const WC_WR_FLUSH_ERR: u32 = 5;
const WC_RETRY_EXC_ERR: u32 = 12;
const WC_RNR_RETRY_EXC_ERR: u32 = 13;

/// Why the connection is unusable, kept to build fresh `io::Error`s.
#[derive(Debug, Clone)]
pub(crate) struct ConnError {
    kind: io::ErrorKind,
    msg: String,
}

impl ConnError {
    pub(crate) fn new(kind: io::ErrorKind, msg: impl Into<String>) -> Self {
        ConnError {
            kind,
            msg: msg.into(),
        }
    }
    pub(crate) fn to_io(&self) -> io::Error {
        io::Error::new(self.kind, self.msg.clone())
    }
}

/// Everything behind the connection's mutex.
pub(crate) struct State {
    core: StreamCore,
    qp: RcQueuePair,
    peer_ring_addr: u64,
    peer_rkey: u32,
    /// Bytes already moved out of the ring, oldest first.
    backlog: VecDeque<Bytes>,
    backlog_len: usize,
    /// Arrived ring segments (offset, len) not yet moved or read, in order.
    ring_pending: VecDeque<(u32, u32)>,
    recv_buffer_limit: usize,
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
    error: Option<ConnError>,
    /// The peer disconnected (rdma_cm DISCONNECTED) or the QP failed.
    peer_gone: bool,
    /// Number of live application handles (stream or halves).
    handles: usize,
    pub(crate) stats: ConnectionStats,
    /// Reused buffer for polled completions.
    scratch: Vec<Completion>,
}

impl State {
    fn wake_all(&mut self) {
        if let Some(w) = self.read_waker.take() {
            w.wake();
        }
        if let Some(w) = self.write_waker.take() {
            w.wake();
        }
    }

    fn fail(&mut self, err: ConnError) {
        if self.error.is_none() {
            debug!(kind = ?err.kind, msg = %err.msg, "connection failed");
            self.stats.errors += 1;
            self.error = Some(err);
        }
        self.wake_all();
    }

    /// Posts every work request the core has ready.
    fn transmit(&mut self) {
        while let Some(t) = self.core.poll_transmit() {
            if let Err(e) = self.post(&t) {
                self.fail(ConnError::new(
                    io::ErrorKind::ConnectionAborted,
                    e.to_string(),
                ));
                return;
            }
        }
    }

    fn post(&mut self, t: &Transmit) -> Result<()> {
        let (local_offset, len, remote_offset, imm, inline) = match t.kind {
            TransmitKind::Data {
                local_offset,
                len,
                remote_offset,
                imm,
                inline,
            } => (local_offset, len, remote_offset, imm, inline),
            TransmitKind::Control { imm } => (0, 0, 0, imm, false),
        };
        self.qp.post_write_imm(
            t.wr_id,
            local_offset,
            len,
            self.peer_ring_addr + u64::from(remote_offset),
            self.peer_rkey,
            imm,
            t.signaled,
            inline,
        )?;
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
            let Some((off, len)) = self.ring_pending.pop_front() else {
                break;
            };
            let mut buf = BytesMut::zeroed(len as usize);
            if let Err(e) = self.qp.recv_ring.read_at(off as usize, &mut buf) {
                self.fail(ConnError::new(
                    io::ErrorKind::ConnectionAborted,
                    e.to_string(),
                ));
                return;
            }
            self.core.consume(len as usize);
            self.backlog_len += len as usize;
            self.backlog.push_back(buf.freeze());
        }
    }

    /// Handles one completion. Returns the number of receive WRs to repost.
    fn on_completion(&mut self, wc: &Completion) -> u32 {
        self.stats.completions += 1;
        if wc.status != WC_SUCCESS {
            if wc.status == WC_WR_FLUSH_ERR && (self.peer_gone || self.error.is_some()) {
                return 0;
            }
            let kind = match wc.status {
                WC_RETRY_EXC_ERR | WC_RNR_RETRY_EXC_ERR | WC_WR_FLUSH_ERR => {
                    io::ErrorKind::ConnectionReset
                }
                _ => io::ErrorKind::ConnectionAborted,
            };
            self.peer_gone = true;
            self.fail(ConnError::new(
                kind,
                format!(
                    "work request failed with ibv_wc_status {} (peer gone?)",
                    wc.status
                ),
            ));
            return 0;
        }
        match wc.kind {
            WcKind::Send => {
                if let Err(e) = self.core.on_send_complete(wc.wr_id) {
                    self.protocol_error(e);
                }
                if let Some(w) = self.write_waker.take() {
                    w.wake();
                }
                0
            }
            WcKind::RecvImm => {
                self.stats.wrs_received += 1;
                match self.core.on_recv(wc.imm) {
                    Ok(RecvEvent::Data { offset, len }) => {
                        self.stats.bytes_received += u64::from(len);
                        self.ring_pending.push_back((offset, len));
                        if let Some(w) = self.read_waker.take() {
                            w.wake();
                        }
                    }
                    Ok(RecvEvent::Fin) => {
                        if let Some(w) = self.read_waker.take() {
                            w.wake();
                        }
                    }
                    Ok(RecvEvent::Abort { code }) => {
                        self.fail(ConnError::new(
                            io::ErrorKind::ConnectionReset,
                            format!("connection aborted by peer (code {code})"),
                        ));
                    }
                    Ok(_) => {}
                    Err(e) => self.protocol_error(e),
                }
                1
            }
            WcKind::Recv | WcKind::Other => 0,
        }
    }

    fn protocol_error(&mut self, e: ProtocolError) {
        warn!(error = %e, "peer violated the stream protocol; aborting");
        self.fail(ConnError::new(
            io::ErrorKind::InvalidData,
            Error::Protocol(e).to_string(),
        ));
        self.transmit(); // best-effort ABORT queued by the core
    }

    /// Drains the CQ and does all follow-up work. Returns completions seen.
    /// Drain, arm, drain again: completion channels are edge triggered, so
    /// a completion that lands between the drain and the arm would otherwise
    /// never raise an event.
    pub(crate) fn progress_and_arm(&mut self) -> usize {
        let mut n = self.progress();
        if let Err(e) = self.qp.arm() {
            self.fail(ConnError::new(
                io::ErrorKind::ConnectionAborted,
                e.to_string(),
            ));
        }
        n += self.progress();
        n
    }

    /// Whether `poll_read` has something to return (data, EOF or an error).
    fn read_ready(&self) -> bool {
        !self.backlog.is_empty()
            || !self.ring_pending.is_empty()
            || self.core.readable_eof()
            || self.error.is_some()
            || self.peer_gone
    }

    pub(crate) fn progress(&mut self) -> usize {
        let mut scratch = std::mem::take(&mut self.scratch);
        let n = self.progress_with(&mut scratch);
        self.scratch = scratch;
        n
    }

    fn progress_with(&mut self, scratch: &mut Vec<Completion>) -> usize {
        scratch.clear();
        if let Err(e) = self.qp.poll(scratch) {
            self.fail(ConnError::new(
                io::ErrorKind::ConnectionAborted,
                e.to_string(),
            ));
            return 0;
        }
        let n = scratch.len();
        let mut repost = 0;
        for wc in scratch.iter() {
            repost += self.on_completion(wc);
        }
        if repost > 0 && self.error.is_none() && !self.peer_gone {
            if let Err(e) = self.qp.post_recvs(repost) {
                self.fail(ConnError::new(
                    io::ErrorKind::ConnectionAborted,
                    e.to_string(),
                ));
            }
        }
        self.drain_ring();
        if self.error.is_none() {
            self.transmit();
        }
        n
    }
}

/// The connection shared by handles and the driver.
pub(crate) struct Conn {
    pub(crate) state: Mutex<State>,
    /// Wakes the driver (handle dropped, or work to re-check).
    notify: Notify,
    pub(crate) local_addr: SocketAddr,
    pub(crate) peer_addr: SocketAddr,
    pub(crate) qp_num: u32,
    pub(crate) device: String,
    busy_poll: std::time::Duration,
    nodelay: std::sync::atomic::AtomicBool,
}

static CONN_IDS: AtomicU64 = AtomicU64::new(1);

impl Conn {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// With nothing to read: poll the CQ ourselves (spinning up to the
    /// busy-poll budget), and register this task on the completion channel
    /// directly, so an arriving completion wakes the reader without a hop
    /// through the driver task.
    fn wait_readable<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        cx: &mut Context<'_>,
    ) -> MutexGuard<'a, State> {
        st.progress();
        if !self.busy_poll.is_zero() && !st.read_ready() {
            let start = Instant::now();
            while !st.read_ready() && start.elapsed() < self.busy_poll {
                drop(st);
                std::hint::spin_loop();
                st = self.lock();
                st.progress();
            }
        }
        let events = st.qp.cq_events();
        while !st.read_ready() {
            st.progress_and_arm();
            if st.read_ready() {
                break;
            }
            match events.poll_read_ready(cx) {
                Poll::Ready(Ok(mut guard)) => {
                    st.qp.take_events();
                    guard.clear_ready();
                }
                // Pending: registered; an error: leave it to the driver.
                _ => break,
            }
        }
        st
    }

    pub(crate) fn set_nodelay(&self, v: bool) {
        self.nodelay.store(v, Ordering::Relaxed);
    }
    pub(crate) fn nodelay(&self) -> bool {
        self.nodelay.load(Ordering::Relaxed)
    }

    pub(crate) fn poll_read(
        &self,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut st = self.lock();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if !st.read_ready() {
            st = self.wait_readable(st, cx);
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
            let Some(&(off, len)) = st.ring_pending.front() else {
                break;
            };
            let n = (len as usize).min(buf.remaining());
            let dst = buf.initialize_unfilled_to(n);
            if let Err(e) = st.qp.recv_ring.read_at(off as usize, &mut dst[..n]) {
                return Poll::Ready(Err(io::Error::other(e)));
            }
            buf.advance(n);
            st.core.consume(n);
            let front = st.ring_pending.front_mut().expect("checked above");
            if n == len as usize {
                st.ring_pending.pop_front();
            } else {
                *front = (off + n as u32, len - n as u32);
            }
            copied += n;
        }
        if copied > 0 {
            // Space freed: move more ring data and return credit.
            st.drain_ring();
            if st.error.is_none() {
                st.transmit();
            }
            return Poll::Ready(Ok(()));
        }
        if st.core.readable_eof() {
            return Poll::Ready(Ok(()));
        }
        if let Some(e) = &st.error {
            return Poll::Ready(Err(e.to_io()));
        }
        if st.peer_gone {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "peer disconnected without closing the stream",
            )));
        }
        st.read_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn write_error(st: &State, e: WriteError) -> io::Error {
        match e {
            WriteError::Shutdown => io::Error::new(
                io::ErrorKind::BrokenPipe,
                "stream was shut down for writing",
            ),
            _ => {
                st.error.as_ref().map(ConnError::to_io).unwrap_or_else(|| {
                    io::Error::new(io::ErrorKind::ConnectionReset, e.to_string())
                })
            }
        }
    }

    pub(crate) fn poll_write_vectored(
        &self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut st = self.lock();
        let cap = match st.core.write_capacity() {
            Ok(c) => c,
            Err(e) => return Poll::Ready(Err(Self::write_error(&st, e))),
        };
        if let Some(e) = &st.error {
            return Poll::Ready(Err(e.to_io()));
        }
        if st.peer_gone {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "peer disconnected",
            )));
        }
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        if cap == 0 {
            st.stats.credit_stalls += 1;
            st.write_waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = cap.min(total);
        let ranges = st.core.accept_write(n);
        // Copy the first n bytes of `bufs` into the ranges, in order.
        let mut src = bufs
            .iter()
            .flat_map(|b| b.chunks(usize::MAX))
            .filter(|c| !c.is_empty());
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
                if let Err(e) = st.qp.send_buf.write_at(at, &cur[..k]) {
                    return Poll::Ready(Err(io::Error::other(e)));
                }
                at += k;
                cur = &cur[k..];
            }
        }
        st.transmit();
        Poll::Ready(Ok(n))
    }

    /// Ready once every accepted byte has been posted to the NIC.
    pub(crate) fn poll_flush(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut st = self.lock();
        if let Some(e) = &st.error {
            return Poll::Ready(Err(e.to_io()));
        }
        if st.core.unposted_len() == 0 {
            return Poll::Ready(Ok(()));
        }
        if st.peer_gone {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "peer disconnected",
            )));
        }
        st.write_waker = Some(cx.waker().clone());
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

    /// Half-close: queue a FIN after the buffered bytes; ready once posted.
    pub(crate) fn poll_shutdown(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        {
            let mut st = self.lock();
            if st.peer_gone && !st.core.fin_received() {
                // The peer vanished without closing: like shutdown(2) on a
                // reset TCP socket.
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    "the peer disconnected without closing the stream",
                )));
            }
            if st.error.is_none() {
                st.core.shutdown();
                st.transmit();
            }
        }
        self.poll_flush(cx)
    }

    pub(crate) fn stats(&self) -> ConnectionStats {
        let st = self.lock();
        let mut s = st.stats.clone();
        s.credit_stalls += st.core.stats().credit_stalls;
        s
    }
}

/// What the handshake hands to [`spawn`].
pub(crate) struct Established<Q = RcQueuePair> {
    pub id: CmId,
    pub qp: Q,
    pub peer: Hello,
    pub device: String,
    /// Reported as the local/peer address if rdma_cm cannot say.
    pub fallback_addr: SocketAddr,
}

pub(crate) fn rc_sizes(cfg: &RdmaConfig) -> RcSizes {
    RcSizes {
        send_depth: u32::from(cfg.send_queue_depth),
        recv_depth: u32::from(cfg.recv_queue_depth),
        max_inline: cfg.inline_threshold,
        send_buf: cfg.send_buffer_size as usize,
        recv_ring: cfg.ring_size as usize,
    }
}

/// Our half of the handshake for a QP.
pub(crate) fn local_hello(qp: &RcQueuePair, cfg: &RdmaConfig) -> Hello {
    Hello {
        kind: EndpointKind::ByteStream,
        ring_addr: qp.recv_ring.addr(),
        ring_rkey: qp.recv_ring.rkey(),
        ring_len: cfg.ring_size,
        recv_depth: cfg.recv_queue_depth,
    }
}

/// Creates a QP (in RESET) for `id`'s device. Receive WRs are posted by
/// [`RcQueuePair::connect_from_cm`] once the QP is in INIT.
pub(crate) fn new_qp(
    id: &CmId,
    cfg: &RdmaConfig,
    sizes: RcSizes,
) -> Result<(Arc<OpenDevice>, RcQueuePair, String)> {
    let name = id.device_name().ok_or(Error::NoDevice)?;
    if let Some(want) = &cfg.device {
        if *want != name {
            return Err(Error::DeviceNotFound { name: want.clone() });
        }
    }
    let dev = crate::verbs::rc::open_device(&name)?;
    let qp = RcQueuePair::new(Arc::clone(&dev), sizes)?;
    Ok((dev, qp, name))
}

/// Builds the shared connection and starts its driver task.
pub(crate) fn spawn(est: Established, cfg: &RdmaConfig) -> Result<Arc<Conn>> {
    let local_addr = est.id.local_addr().unwrap_or(est.fallback_addr);
    let peer_addr = est.id.peer_addr().unwrap_or(est.fallback_addr);
    let max_inline = est.qp.max_inline();
    let core =
        StreamCore::new(cfg.stream_params(est.peer.ring_len, est.peer.recv_depth, max_inline))?;
    let conn_id = CONN_IDS.fetch_add(1, Ordering::Relaxed);
    let qp_num = est.qp.qp_num();
    let state = State {
        core,
        qp: est.qp,
        peer_ring_addr: est.peer.ring_addr,
        peer_rkey: est.peer.ring_rkey,
        backlog: VecDeque::new(),
        backlog_len: 0,
        ring_pending: VecDeque::new(),
        recv_buffer_limit: cfg.recv_buffer_limit,
        read_waker: None,
        write_waker: None,
        error: None,
        peer_gone: false,
        handles: 1,
        stats: ConnectionStats::default(),
        scratch: Vec::with_capacity(64),
    };
    let conn = Arc::new(Conn {
        state: Mutex::new(state),
        notify: Notify::new(),
        local_addr,
        peer_addr,
        qp_num,
        device: est.device,
        busy_poll: cfg.busy_poll,
        nodelay: std::sync::atomic::AtomicBool::new(true),
    });
    let span = tracing::debug_span!(
        "rdma_conn",
        id = conn_id,
        local = %local_addr,
        peer = %peer_addr,
        qp = qp_num
    );
    let driver = Driver {
        conn: Arc::clone(&conn),
        id: est.id,
        linger: cfg.linger,
    };
    tokio::spawn(driver.run().instrument(span));
    Ok(conn)
}

struct Driver {
    conn: Arc<Conn>,
    id: CmId,
    /// Bound on delivering after the last handle dropped.
    linger: std::time::Duration,
}

impl Driver {
    async fn run(self) {
        let Driver { conn, id, linger } = self;
        debug!("connection established");
        let channel = Arc::clone(id.channel());
        let cq_events = conn.lock().qp.cq_events();
        let mut fin_requested = false;
        // Set once every handle is gone and data is still being delivered.
        let mut linger_deadline: Option<tokio::time::Instant> = None;
        loop {
            let done = {
                let mut st = conn.lock();
                st.progress_and_arm();
                if st.handles == 0 && !fin_requested && st.error.is_none() && !st.peer_gone {
                    // All handles dropped: close like TCP, FIN after the data.
                    fin_requested = true;
                    linger_deadline = Some(tokio::time::Instant::now() + linger);
                    st.core.shutdown();
                    st.transmit();
                }
                let lingering = st.error.is_none() && !st.peer_gone && !st.core.all_sent();
                st.handles == 0 && !lingering
            };
            if done {
                break;
            }
            tokio::select! {
                r = cq_events.readable() => {
                    let Ok(mut guard) = r else { break };
                    conn.lock().qp.take_events();
                    guard.clear_ready();
                }
                ev = channel.next() => {
                    match ev {
                        Ok(ev) => {
                            trace!(kind = ?ev.kind, "rdma_cm event");
                            if matches!(ev.kind, CmEventKind::Disconnected | CmEventKind::DeviceRemoval) {
                                let mut st = conn.lock();
                                st.progress();
                                st.peer_gone = true;
                                st.core.on_connection_lost();
                                st.qp.set_error();
                                st.wake_all();
                            }
                        }
                        Err(e) => {
                            conn.lock().fail(ConnError::new(io::ErrorKind::ConnectionAborted, e.to_string()));
                        }
                    }
                }
                _ = conn.notify.notified() => {}
                _ = async {
                    match linger_deadline {
                        Some(d) => tokio::time::sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                } => {
                    debug!("linger timeout: the peer did not take the remaining data");
                    conn.lock().fail(ConnError::new(io::ErrorKind::TimedOut, "linger timeout"));
                }
            }
        }
        debug!("connection closing");
        let _ = id.disconnect();
        {
            let mut st = conn.lock();
            st.qp.set_error();
            st.wake_all();
        }
        // The QP and its memory are freed when the last handle's Arc drops;
        // rdma_destroy_id may block in the kernel, so it runs off the runtime.
        tokio::task::spawn_blocking(move || drop(id));
    }
}

/// A connection that counts its application handles (a stream or a half,
/// a message endpoint or a clone of it).
pub(crate) trait Counted {
    /// One more handle.
    fn add_handle(&self);
    /// One handle less; the last one wakes the driver to close.
    fn drop_handle(&self);
}

impl Counted for Conn {
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

/// One application handle on a connection. The connection closes (for a
/// stream: FIN after the buffered data) when the last one drops.
pub(crate) struct Handle<C: Counted = Conn>(Arc<C>);

impl<C: Counted> Handle<C> {
    /// Wraps the first handle (`spawn` counts it already).
    pub(crate) fn first(conn: Arc<C>) -> Self {
        Handle(conn)
    }

    /// Another handle on the same connection.
    pub(crate) fn another(&self) -> Self {
        self.0.add_handle();
        Handle(Arc::clone(&self.0))
    }

    pub(crate) fn same_conn(&self, other: &Handle<C>) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl<C: Counted> std::ops::Deref for Handle<C> {
    type Target = C;
    fn deref(&self) -> &C {
        &self.0
    }
}

impl<C: Counted> Drop for Handle<C> {
    fn drop(&mut self) {
        self.0.drop_handle();
    }
}
