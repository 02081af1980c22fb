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

use rdma_mummy_sys::ibv_qp_state;

use super::RdmaStream;
use super::conn::{self, Established};
use super::connect::{Setup, StreamSetup, first_resolved};
use crate::config::RdmaConfig;
use crate::error::{Error, Result};
use crate::proto::handshake::{Hello, RejectReason, encode_reject};
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
    inner: Listener<StreamSetup>,
}

/// The listening side shared by every endpoint kind: the rdma_cm listen id,
/// the background task that runs handshakes, and the queue of established
/// connections.
pub(crate) struct Listener<S: Setup> {
    local_addr: SocketAddr,
    incoming: Mutex<mpsc::Receiver<Queued<S::Out>>>,
    task: tokio::task::JoinHandle<()>,
    /// Destroyed in `drop`, so the port is free again when `drop` returns
    /// (as with `TcpListener`).
    _listen_id: CmId,
}

/// An established connection waiting for `accept`, with its backlog slot.
type Queued<T> = io::Result<(T, SocketAddr, Option<OwnedSemaphorePermit>)>;

impl std::fmt::Debug for RdmaListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaListener")
            .field("local_addr", &self.inner.local_addr)
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
        let inner = Listener::bind(addr, StreamSetup(config.clone())).await?;
        Ok(RdmaListener { inner })
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
        self.inner
            .poll_accept(cx)
            .map_ok(|(c, a)| (RdmaStream::from_conn(c), a))
    }

    /// The local address the listener is bound to, with the actual port.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.inner.local_addr)
    }
}

impl<S: Setup> Listener<S> {
    /// Binds to the first address `addr` resolves to that works.
    pub(crate) async fn bind<A: ToSocketAddrs>(addr: A, setup: S) -> io::Result<Listener<S>> {
        first_resolved(addr, |a| {
            std::future::ready(Self::bind_one(a, setup.clone()))
        })
        .await
    }

    fn bind_one(addr: SocketAddr, setup: S) -> Result<Listener<S>> {
        crate::verbs::devices()?;
        let cfg = setup.rdma();
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
        let span = tracing::debug_span!("rdma_listener", local = %local_addr, kind = %S::KIND);
        let task = tokio::spawn(listen_loop(channel, setup, tx, slots).instrument(span));
        Ok(Listener {
            local_addr,
            incoming: Mutex::new(rx),
            task,
            _listen_id: id,
        })
    }

    /// Polls for an established connection; only the task that polled last
    /// is woken.
    pub(crate) fn poll_accept(
        &self,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<(S::Out, SocketAddr)>> {
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

    /// The local address, with the actual port.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl<S: Setup> Drop for Listener<S> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Incoming<T> = mpsc::Sender<Queued<T>>;

async fn listen_loop<S: Setup>(
    channel: Arc<EventChannel>,
    setup: S,
    tx: Incoming<S::Out>,
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
                let setup = setup.clone();
                let tx = tx.clone();
                handshakes.spawn(async move {
                    match accept_one(new_id, ev.private_data, &setup).await {
                        Ok(Some((c, peer))) => {
                            if tx.send(Ok((c, peer, Some(slot)))).await.is_err() {
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
async fn accept_one<S: Setup>(
    mut id: CmId,
    private_data: Vec<u8>,
    setup: &S,
) -> Result<Option<(S::Out, SocketAddr)>> {
    let cfg = setup.rdma();
    let peer = match Hello::decode(&private_data).and_then(|h| h.expect_kind(S::KIND)) {
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
    let prepared = match conn::new_qp(&id, cfg, setup.sizes()) {
        Ok((dev, qp, device)) => setup.prepare(&dev, qp).await.map(|qp| (qp, device)),
        Err(e) => Err(e),
    };
    let (mut qp, device) = match prepared {
        Ok(x) => x,
        Err(e) => {
            let _ = id.reject(&encode_reject(RejectReason::ServerResources));
            return Err(e);
        }
    };
    qp.as_mut()
        .modify_from_cm(&id, ibv_qp_state::IBV_QPS_INIT)?;
    let hello = setup.on_init(&mut qp)?;
    qp.as_mut().modify_from_cm(&id, ibv_qp_state::IBV_QPS_RTR)?;
    qp.as_mut().modify_from_cm(&id, ibv_qp_state::IBV_QPS_RTS)?;
    id.accept(qp.as_mut().qp_num(), &hello.encode(), setup.read_depth())?;
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
    let peer_addr = id.peer_addr().unwrap_or(([0, 0, 0, 0], 0).into());
    setup
        .finish(Established {
            id,
            qp,
            peer,
            device,
            fallback_addr: ([0, 0, 0, 0], 0).into(),
        })
        .map(|out| Some((out, peer_addr)))
}
