//! `RdmaListener`: the passive side, with the handshake run in the
//! background so `accept` is cancel-safe.

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::net::ToSocketAddrs;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::{Instrument, debug, warn};

use super::RdmaStream;
use super::conn::{self, Conn, Established};
use crate::config::RdmaConfig;
use crate::error::{Error, Result};
use crate::proto::handshake::{EndpointKind, Hello, RejectReason, encode_reject};
use crate::verbs::cm::{CmEventKind, CmId, EventChannel};

/// A listener for RDMA stream connections, used like
/// [`tokio::net::TcpListener`].
///
/// rdma_cm connection requests are handled by a background task: it checks
/// the peer's handshake (rejecting other magics and versions with a reason
/// the client sees), creates the queue pair, accepts, and queues the
/// established connection. [`accept`](Self::accept) only pops that queue, so
/// it is cancel-safe: dropping an `accept` future (for example in
/// `tokio::select!`) loses no connection.
pub struct RdmaListener {
    local_addr: SocketAddr,
    incoming: Mutex<mpsc::Receiver<Queued>>,
    task: tokio::task::JoinHandle<()>,
    /// Destroyed in `drop`, so the port is free again when `drop` returns
    /// (as with `TcpListener`).
    _listen_id: CmId,
}

/// An established connection waiting for `accept`, with its backlog slot.
type Queued = io::Result<(RdmaStream, SocketAddr, Option<OwnedSemaphorePermit>)>;

impl std::fmt::Debug for RdmaListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaListener")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

impl RdmaListener {
    /// Binds to `addr` (an IP address of an RDMA device, or `0.0.0.0`; port
    /// 0 picks a free rdma_cm port) with the default [`RdmaConfig`].
    ///
    /// # Errors
    /// `NotFound` ([`Error::NoDevice`]) without an RDMA device,
    /// `AddrInUse`/`AddrNotAvailable` from `rdma_bind_addr`.
    pub async fn bind<A: ToSocketAddrs>(addr: A) -> io::Result<RdmaListener> {
        Self::bind_with(addr, &RdmaConfig::default()).await
    }

    /// Binds with `config`, which every accepted connection uses.
    /// Errors as for [`bind`](Self::bind).
    pub async fn bind_with<A: ToSocketAddrs>(
        addr: A,
        config: &RdmaConfig,
    ) -> io::Result<RdmaListener> {
        config.validate()?;
        let mut last = None;
        for a in tokio::net::lookup_host(addr).await? {
            match Self::bind_one(a, config) {
                Ok(l) => return Ok(l),
                Err(e) => last = Some(e),
            }
        }
        Err(last.map(io::Error::from).unwrap_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "could not resolve to any address",
            )
        }))
    }

    fn bind_one(addr: SocketAddr, cfg: &RdmaConfig) -> Result<RdmaListener> {
        crate::verbs::devices()?;
        let channel = EventChannel::new()?;
        let id = CmId::new(&channel)?;
        id.bind(addr)?;
        id.listen(cfg.backlog)?;
        let local_addr = id.local_addr().unwrap_or(addr);
        // Handshakes in flight plus established connections not yet
        // accepted never exceed the backlog; requests beyond it are rejected
        // (`RejectReason::ServerResources`) instead of each taking a queue
        // pair and registered memory.
        let backlog = cfg.backlog.max(1) as usize;
        let slots = Arc::new(Semaphore::new(backlog));
        let (tx, rx) = mpsc::channel(backlog + 1);
        let span = tracing::debug_span!("rdma_listener", local = %local_addr);
        let task = tokio::spawn(listen_loop(channel, cfg.clone(), tx, slots).instrument(span));
        Ok(RdmaListener {
            local_addr,
            incoming: Mutex::new(rx),
            task,
            _listen_id: id,
        })
    }

    /// Waits for the next established connection.
    ///
    /// Cancel-safe. Returns the stream and the peer's address.
    ///
    /// # Errors
    /// An error of the listening rdma_cm id itself (the listener is then
    /// unusable); failed handshakes of single peers are logged, not returned.
    pub async fn accept(&self) -> io::Result<(RdmaStream, SocketAddr)> {
        std::future::poll_fn(|cx| self.poll_accept(cx)).await
    }

    /// Polls for an established connection (the building block of
    /// [`accept`](Self::accept), for hyper/axum style accept loops). Only the
    /// task that polled last is woken, as with tokio's `poll_accept`.
    pub fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(RdmaStream, SocketAddr)>> {
        let mut rx = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        match rx.poll_recv(cx) {
            // Dropping the permit frees the backlog slot.
            Poll::Ready(Some(r)) => Poll::Ready(r.map(|(s, a, _slot)| (s, a))),
            Poll::Ready(None) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the listener's background task ended",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    /// The local address the listener is bound to, with the actual port.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local_addr)
    }
}

impl Drop for RdmaListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Incoming = mpsc::Sender<Queued>;

async fn listen_loop(
    channel: Arc<EventChannel>,
    cfg: RdmaConfig,
    tx: Incoming,
    slots: Arc<Semaphore>,
) {
    let mut handshakes = JoinSet::new();
    loop {
        tokio::select! {
            ev = channel.next() => {
                let ev = match ev {
                    Ok(ev) => ev,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                if ev.kind != CmEventKind::ConnectRequest {
                    debug!(kind = ?ev.kind, "ignoring listener event");
                    continue;
                }
                let Some(new_id) = ev.new_id else { continue };
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    warn!("listen backlog full; rejecting connection request");
                    let _ = new_id.reject(&encode_reject(RejectReason::ServerResources));
                    continue;
                };
                let cfg = cfg.clone();
                let tx = tx.clone();
                handshakes.spawn(async move {
                    match accept_one(new_id, ev.private_data, &cfg).await {
                        Ok(Some(c)) => {
                            let peer = c.peer_addr;
                            if tx.send(Ok((RdmaStream::from_conn(c), peer, Some(slot)))).await.is_err() {
                                debug!("listener dropped; closing accepted connection");
                            }
                        }
                        Ok(None) => {}
                        Err(e) => warn!(error = %e, "handshake failed"),
                    }
                });
            }
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => {}
        }
    }
}

/// Runs the passive handshake for one request. `Ok(None)`: rejected.
async fn accept_one(
    mut id: CmId,
    private_data: Vec<u8>,
    cfg: &RdmaConfig,
) -> Result<Option<Arc<Conn>>> {
    let peer =
        match Hello::decode(&private_data).and_then(|h| h.expect_kind(EndpointKind::ByteStream)) {
            Ok(h) => h,
            Err(e) => {
                warn!(error = %e, "rejecting connection request");
                id.reject(&encode_reject(e.reject_reason()))?;
                return Ok(None);
            }
        };
    // Each connection gets its own event channel (and driver).
    let channel = EventChannel::new()?;
    id.migrate(&channel)?;
    let (_dev, mut qp, device) = match conn::new_qp(&id, cfg) {
        Ok(x) => x,
        Err(e) => {
            let _ = id.reject(&encode_reject(RejectReason::ServerResources));
            return Err(e);
        }
    };
    qp.connect_from_cm(&id, false)?;
    let hello = conn::local_hello(&qp, cfg);
    id.accept(qp.qp_num(), &hello.encode())?;
    let ev = tokio::time::timeout(cfg.connect_timeout, channel.next())
        .await
        .map_err(|_| Error::TimedOut {
            addr: id.peer_addr().unwrap_or(([0, 0, 0, 0], 0).into()),
        })?
        .map_err(|source| Error::Verbs {
            op: "rdma_get_cm_event",
            source,
        })?;
    if ev.kind != CmEventKind::Established {
        debug!(kind = ?ev.kind, status = ev.status, "connection not established");
        return Ok(None);
    }
    conn::spawn(
        Established {
            id,
            qp,
            peer,
            device,
            fallback_addr: ([0, 0, 0, 0], 0).into(),
        },
        cfg,
    )
    .map(Some)
}
