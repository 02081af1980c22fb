//! The listening side shared by every endpoint kind, with the handshake run
//! in the background so `accept` is cancel-safe.

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use tokio::net::ToSocketAddrs;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::{Instrument, debug, warn};

use super::setup::{Setup, accept_one, first_resolved};
use crate::error::{Error, Result};
use crate::proto::handshake::{RejectReason, encode_reject};
use crate::verbs::cm::{CmEventKind, CmId, EventChannel};

/// The listening side shared by every endpoint kind: the rdma_cm listen id,
/// the background task that runs handshakes, and the queue of established
/// connections.
pub(crate) struct Listener<S: Setup> {
    local_addr: SocketAddr,
    incoming: Mutex<mpsc::Receiver<Queued<S::Out>>>,
    task: tokio::task::JoinHandle<()>,
    /// Destroyed in `drop`, so the port is free again when `drop` returns
    /// (as with `TcpListener`); or by the task when the device goes, so
    /// the removal is not held up.
    listen_id: Arc<Mutex<Option<CmId>>>,
    /// Why the task ended, if it did for a reason every later accept
    /// reports (the device went).
    gone: Arc<OnceLock<Error>>,
}

/// The `rdma_listen` backlog: rdma_ucm's default `max_backlog`.
const KERNEL_LISTEN_BACKLOG: i32 = 1024;

/// An established connection waiting for `accept`, with its backlog slot.
type Queued<T> = io::Result<(T, SocketAddr, Option<OwnedSemaphorePermit>)>;

/// `rdma_bind_addr`'s error for `addr`: no interface has the address
/// (`EADDRNOTAVAIL`: never had it, or it was removed while the process
/// runs) or its interface has no RDMA device (`ENODEV`) is
/// [`Error::NoDeviceForAddress`], naming it; others unchanged.
fn bind_error(e: Error, addr: SocketAddr) -> Error {
    match &e {
        Error::Verbs { source, .. }
            if matches!(
                source.raw_os_error(),
                Some(libc::EADDRNOTAVAIL | libc::ENODEV)
            ) =>
        {
            Error::NoDeviceForAddress { addr: addr.ip() }
        }
        _ => e,
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
        crate::verbs::device::ensure_present()?;
        // rdma_cm binds a loopback address, but no RDMA device has one, so
        // no connect to it could ever succeed: refuse it here (an `auto://`
        // listener then serves TCP only there).
        if addr.ip().is_loopback() {
            return Err(Error::NoDeviceForAddress { addr: addr.ip() });
        }
        let cfg = setup.rdma();
        let channel = EventChannel::new()?;
        let id = CmId::new(&channel)?;
        id.bind(addr).map_err(|e| bind_error(e, addr))?;
        // The kernel's queue of connect requests not yet read from the
        // event channel is sized for bursts (rdma_ucm's own cap, its
        // `max_backlog`, is 1024): a request dropped there would be refused
        // without our reject reason, which clients cannot tell from "no
        // listener". The configured backlog is enforced below, with a
        // `ServerResources` reject that clients retry.
        id.listen(KERNEL_LISTEN_BACKLOG.max(cfg.backlog))?;
        let local_addr = id.local_addr().unwrap_or(addr);
        // Handshakes in flight plus established connections not yet
        // accepted never exceed the backlog; requests beyond it are rejected
        // (`RejectReason::ServerResources`) instead of each taking a queue
        // pair and registered memory.
        let backlog = cfg.backlog.max(1) as usize;
        let slots = Arc::new(Semaphore::new(backlog));
        let (tx, rx) = mpsc::channel(backlog + 1);
        let span = tracing::debug_span!("rdma_listener", local = %local_addr, kind = %S::KIND);
        let device = id.device_name();
        let listen_id = Arc::new(Mutex::new(Some(id)));
        let gone = Arc::new(OnceLock::new());
        let task = tokio::spawn(
            listen_loop(
                channel,
                setup,
                tx,
                slots,
                Removal {
                    device,
                    listen_id: Arc::clone(&listen_id),
                    gone: Arc::clone(&gone),
                },
            )
            .instrument(span),
        );
        Ok(Listener {
            local_addr,
            incoming: Mutex::new(rx),
            task,
            listen_id,
            gone,
        })
    }

    /// Polls for an established connection; only the task that polled last
    /// is woken.
    pub(crate) fn poll_accept(
        &self,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<(S::Out, SocketAddr)>> {
        if let Err(e) = crate::verbs::fork::check_io("accept") {
            return Poll::Ready(Err(e));
        }
        let mut rx = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        match rx.poll_recv(cx) {
            // Dropping the permit frees the backlog slot.
            Poll::Ready(Some(r)) => Poll::Ready(r.map(|(s, a, _slot)| (s, a))),
            Poll::Ready(None) => Poll::Ready(Err(match self.gone.get() {
                Some(e) => e.clone().into(),
                None => io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "the listener's background task ended",
                ),
            })),
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
        drop(
            self.listen_id
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
    }
}

/// What the listener's task needs when rdma_cm reports its device going.
struct Removal {
    /// The device the listen id is bound to (`None` for a wildcard
    /// address, whose per-device listens rdma_cm manages itself: it keeps
    /// listening on the other devices and on the device when it comes
    /// back).
    device: Option<String>,
    listen_id: Arc<Mutex<Option<CmId>>>,
    gone: Arc<OnceLock<Error>>,
}

type Incoming<T> = mpsc::Sender<Queued<T>>;

async fn listen_loop<S: Setup>(
    channel: Arc<EventChannel>,
    setup: S,
    tx: Incoming<S::Out>,
    slots: Arc<Semaphore>,
    removal: Removal,
) {
    let _own = crate::verbs::tasks::OwnTask::new();
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
                if ev.kind == CmEventKind::DeviceRemoval {
                    // Every later accept fails with DeviceRemoved; the id
                    // goes now, so the device is not held open for it.
                    warn!("the listener's RDMA device is going away");
                    let _ = removal.gone.set(Error::DeviceRemoved);
                    if let Some(d) = &removal.device {
                        crate::verbs::rc::device_removed(d);
                    }
                    let id = removal
                        .listen_id
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .take();
                    tokio::task::spawn_blocking(move || drop(id));
                    return;
                }
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
