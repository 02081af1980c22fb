//! [`Listener`]: accepts TCP, RDMA, or both on one port number.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use tokio::net::TcpListener;
use tracing::{info, warn};

use super::addr::{ToTransportAddr, Transport, TransportAddr};
use super::{Stream, rdma_unavailable_here};
use crate::{RdmaConfig, RdmaListener};

/// How many TCP ports an auto listener asked for port 0 tries before giving
/// up when the rdma_cm port of the same number is taken.
const AUTO_BIND_ATTEMPTS: usize = 16;

/// A listener for [`Stream`]s, used like [`tokio::net::TcpListener`].
///
/// Bound with `tcp://`, `rdma://` or `auto://host:port`. An `auto://`
/// listener serves TCP and RDMA on the same port number (rdma_cm's port space
/// is separate from the kernel's TCP ports): the TCP socket is bound first,
/// so with port 0 the kernel picks the number, then an [`RdmaListener`] is
/// bound to that number. On a host where RDMA cannot be used (no library, no
/// device, no device for the address) an auto listener serves TCP only and
/// logs that once with `tracing::warn!` (a listener serving both logs at
/// `info`).
///
/// [`accept`](Self::accept) is cancel-safe (both underlying accepts are), so
/// it can race in `tokio::select!` as axum and tonic do.
#[derive(Debug)]
pub struct Listener {
    inner: Inner,
    /// Auto mode: which side `poll_accept` polls first next time, so a
    /// steady stream of connections on one transport cannot starve the
    /// other.
    rdma_first: AtomicBool,
}

#[derive(Debug)]
enum Inner {
    Tcp(TcpListener),
    Rdma(RdmaListener),
    Auto {
        tcp: TcpListener,
        /// `None`: RDMA is not available on this host; TCP only.
        rdma: Option<RdmaListener>,
    },
}

impl Listener {
    /// Binds to `addr` with the default [`RdmaConfig`]. See
    /// [`bind_with`](Self::bind_with).
    pub async fn bind(addr: impl ToTransportAddr) -> io::Result<Listener> {
        Self::bind_with(addr, &RdmaConfig::default()).await
    }

    /// Binds to `addr` (`tcp://`, `rdma://` or `auto://host:port`; port 0
    /// picks a free port). Accepted RDMA connections use `config`.
    ///
    /// # Errors
    /// `InvalidInput` for a string that is not a transport address; the
    /// errors of [`TcpListener::bind`] as [`crate::Error::Tcp`] (kind kept,
    /// message naming `bind` and the address, the OS error as its `source`)
    /// and [`RdmaListener::bind_with`]
    /// (`NotFound` without an RDMA device for `rdma://`, `AddrInUse`). An
    /// `auto://` listener only fails when TCP fails to bind, or when RDMA
    /// fails for a reason other than "no RDMA here" (for example the rdma_cm
    /// port of an explicitly given number is in use), and with
    /// `Unsupported` ([`crate::Error::AutoPortOnIwarp`]) on an iWARP
    /// device, whose RDMA listener is itself a TCP listener.
    pub async fn bind_with(
        addr: impl ToTransportAddr,
        config: &RdmaConfig,
    ) -> io::Result<Listener> {
        let addr = addr.to_transport_addr()?;
        let inner = match addr.transport() {
            Transport::Tcp => Inner::Tcp(
                TcpListener::bind(addr.host_port())
                    .await
                    .map_err(|e| super::tcp_error("bind", &addr, e))?,
            ),
            Transport::Rdma => {
                Inner::Rdma(RdmaListener::bind_with(addr.host_port(), config).await?)
            }
            Transport::Auto => bind_auto(&addr, config).await?,
        };
        Ok(Listener {
            inner,
            rdma_first: AtomicBool::new(true),
        })
    }

    /// Accepts the next connection on any transport the listener serves.
    ///
    /// Cancel-safe. Returns the stream and the peer's address.
    ///
    /// # Errors
    /// As [`TcpListener::accept`] and [`RdmaListener::accept`]; in auto mode
    /// an error of either side is returned as is, and the other side keeps
    /// working.
    pub async fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        std::future::poll_fn(|cx| self.poll_accept(cx)).await
    }

    /// Polls for the next connection (the building block of
    /// [`accept`](Self::accept)). Only the task that polled last is woken.
    pub fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(Stream, SocketAddr)>> {
        fn tcp(l: &TcpListener, cx: &mut Context<'_>) -> Poll<io::Result<(Stream, SocketAddr)>> {
            l.poll_accept(cx).map_ok(|(s, a)| (Stream::Tcp(s), a))
        }
        fn rdma(l: &RdmaListener, cx: &mut Context<'_>) -> Poll<io::Result<(Stream, SocketAddr)>> {
            l.poll_accept(cx).map_ok(|(s, a)| (Stream::Rdma(s), a))
        }
        match &self.inner {
            Inner::Tcp(l) => tcp(l, cx),
            Inner::Rdma(l) => rdma(l, cx),
            Inner::Auto { tcp: t, rdma: None } => tcp(t, cx),
            Inner::Auto {
                tcp: t,
                rdma: Some(r),
            } => {
                // Both are polled (registering both wakers) unless the
                // first is ready; the first polled alternates.
                let rdma_first = self.rdma_first.fetch_xor(true, Ordering::Relaxed);
                if rdma_first {
                    if let Poll::Ready(x) = rdma(r, cx) {
                        return Poll::Ready(x);
                    }
                    tcp(t, cx)
                } else {
                    if let Poll::Ready(x) = tcp(t, cx) {
                        return Poll::Ready(x);
                    }
                    rdma(r, cx)
                }
            }
        }
    }

    /// The local address. In auto mode it is the TCP socket's; the RDMA
    /// listener has the same port number (see
    /// [`rdma_local_addr`](Self::rdma_local_addr)).
    ///
    /// # Errors
    /// As [`TcpListener::local_addr`].
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match &self.inner {
            Inner::Tcp(l) | Inner::Auto { tcp: l, .. } => l.local_addr(),
            Inner::Rdma(l) => l.local_addr(),
        }
    }

    /// The RDMA listener's local address, or `None` when the listener does
    /// not serve RDMA.
    pub fn rdma_local_addr(&self) -> Option<SocketAddr> {
        match &self.inner {
            Inner::Rdma(l) | Inner::Auto { rdma: Some(l), .. } => l.local_addr().ok(),
            _ => None,
        }
    }

    /// The transport the listener was bound with ([`Transport::Auto`] for an
    /// auto listener, even one that serves TCP only).
    pub fn transport(&self) -> Transport {
        match &self.inner {
            Inner::Tcp(_) => Transport::Tcp,
            Inner::Rdma(_) => Transport::Rdma,
            Inner::Auto { .. } => Transport::Auto,
        }
    }

    /// Whether connections over `transport` are accepted (`Tcp` or `Rdma`;
    /// `Auto` asks whether both are).
    pub fn serves(&self, transport: Transport) -> bool {
        match (&self.inner, transport) {
            (Inner::Tcp(_), t) => t == Transport::Tcp,
            (Inner::Rdma(_), t) => t == Transport::Rdma,
            (Inner::Auto { .. }, Transport::Tcp) => true,
            (Inner::Auto { rdma, .. }, _) => rdma.is_some(),
        }
    }

    /// A [`futures::Stream`] of accepted connections (for example for
    /// tonic's `serve_with_incoming`).
    pub fn into_incoming(self) -> Incoming {
        Incoming { listener: self }
    }
}

async fn bind_auto(addr: &TransportAddr, config: &RdmaConfig) -> io::Result<Inner> {
    let attempts = if addr.port() == 0 {
        AUTO_BIND_ATTEMPTS
    } else {
        1
    };
    let mut last = None;
    for _ in 0..attempts {
        let tcp = TcpListener::bind(addr.host_port())
            .await
            .map_err(|e| super::tcp_error("bind", addr, e))?;
        let port = tcp.local_addr()?.port();
        match RdmaListener::bind_with((addr.host(), port), config).await {
            Ok(rdma) => {
                info!(addr = %addr, port, "auto listener: serving TCP and RDMA");
                return Ok(Inner::Auto {
                    tcp,
                    rdma: Some(rdma),
                });
            }
            Err(e) => {
                if let Some(cause) = rdma_unavailable_here(&e) {
                    warn!(addr = %addr, port, cause, error = %e, "auto listener: RDMA unavailable, serving TCP only");
                    return Ok(Inner::Auto { tcp, rdma: None });
                }
                // The rdma_cm port of that number is taken: try another.
                if e.kind() == io::ErrorKind::AddrInUse {
                    last = Some(e);
                    continue;
                }
                return Err(e);
            }
        }
    }
    // Over iWARP every attempt collides: its listener is a TCP listener
    // (`Error::AutoPortOnIwarp`).
    if iwarp_serves(addr.host()) {
        return Err(crate::Error::AutoPortOnIwarp {
            addr: addr.to_string(),
        }
        .into());
    }
    Err(last.unwrap_or_else(|| io::Error::other("auto listener: no port free for TCP and RDMA")))
}

/// Whether an iWARP device serves `host`: the device rdma_cm binds the
/// address to (`verbs::select_device`), or for a wildcard or a name any
/// iWARP device present.
fn iwarp_serves(host: &str) -> bool {
    use crate::verbs::device::{RdmaTransport, devices, select_among};
    let Ok(devices) = devices() else {
        return false;
    };
    let is_iwarp = |name: &str| {
        devices
            .iter()
            .any(|d| d.name == name && d.transport == RdmaTransport::Iwarp)
    };
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) if !ip.is_unspecified() => {
            select_among(&devices, ip).is_ok_and(|a| is_iwarp(&a.device))
        }
        _ => devices.iter().any(|d| d.transport == RdmaTransport::Iwarp),
    }
}

/// The connections a [`Listener`] accepts, as a [`futures::Stream`] of
/// `io::Result<Stream>` (what tonic's `serve_with_incoming` takes). Made by
/// [`Listener::into_incoming`]; it never ends.
#[derive(Debug)]
pub struct Incoming {
    listener: Listener,
}

impl Incoming {
    /// The listener the connections come from.
    pub fn listener(&self) -> &Listener {
        &self.listener
    }
}

impl futures::Stream for Incoming {
    type Item = io::Result<Stream>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.listener
            .poll_accept(cx)
            .map(|r| Some(r.map(|(s, _)| s)))
    }
}
