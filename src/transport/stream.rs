//! [`Stream`]: one byte-stream type over TCP or RDMA.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tracing::{debug, warn};

use super::ConnectionInfo;
use super::addr::{ToTransportAddr, Transport, TransportAddr};
use crate::{RdmaConfig, RdmaStream};

/// A connection over TCP or RDMA, used like [`tokio::net::TcpStream`].
///
/// Implements [`AsyncRead`] and [`AsyncWrite`] (forwarding every method,
/// including `poll_write_vectored` and `is_write_vectored`), so it drops into
/// hyper (`hyper_util::rt::TokioIo`), tonic, tokio-rustls and tokio-util
/// codecs. [`transport`](Self::transport) says which transport it runs on.
///
/// `#[non_exhaustive]`: match with a wildcard arm.
#[derive(Debug)]
#[non_exhaustive]
pub enum Stream {
    /// A kernel TCP connection.
    Tcp(TcpStream),
    /// An RDMA reliable-connected queue pair.
    Rdma(RdmaStream),
}

impl Stream {
    /// Connects to `addr` (`tcp://`, `rdma://` or `auto://host:port`) with
    /// the default [`RdmaConfig`]. See [`connect_with`](Self::connect_with).
    pub async fn connect(addr: impl ToTransportAddr) -> io::Result<Stream> {
        Self::connect_with(addr, &RdmaConfig::default()).await
    }

    /// Connects to `addr`; RDMA connections use `config`.
    ///
    /// - `tcp://`: [`TcpStream::connect`].
    /// - `rdma://`: [`RdmaStream::connect_with`].
    /// - `auto://`: RDMA first. It falls back to TCP only when the path has
    ///   no RDMA: no RDMA library or device here
    ///   ([`crate::Error::LibraryUnavailable`], [`crate::Error::NoDevice`]),
    ///   no RDMA device or route for the address
    ///   ([`crate::Error::NoDeviceForAddress`], [`crate::Error::Unreachable`]),
    ///   no RDMA listener at the peer ([`crate::Error::ConnectionRefused`]),
    ///   or a process that cannot pin memory (`ENOMEM` from registration:
    ///   RLIMIT_MEMLOCK). Each fallback is counted
    ///   ([`fallback_count`](super::fallback_count)) and logged with
    ///   `tracing::warn!` the first time per peer and cause (at `debug`
    ///   after). A misconfiguration ([`crate::Error::DeviceNotFound`],
    ///   [`crate::Error::InvalidConfig`]) or a handshake the RDMA listener
    ///   rejected ([`crate::Error::HandshakeRejected`]: another protocol
    ///   version, the wrong endpoint kind, a full backlog) is returned, never
    ///   hidden by a fallback.
    ///
    /// # Errors
    /// `InvalidInput` for a string that is not a transport address
    /// (its payload, `get_ref()`, is an [`AddrParseError`](super::AddrParseError),
    /// not a `tokio_rdma::Error`); otherwise
    /// the error of the transport tried last: for `auto://`, any RDMA error
    /// not listed above (for example `TimedOut`, `InvalidData`) is returned
    /// without trying TCP; after a fallback that failed too,
    /// [`crate::Error::FallbackFailed`] (TCP's kind, both attempts named). A
    /// TCP error is [`crate::Error::Tcp`]: the OS error's kind, a message
    /// naming the operation and address (`connect tcp://10.0.0.5:8080:
    /// Connection refused (os error 111)`), and the OS error with its errno
    /// as its `source`.
    pub async fn connect_with(
        addr: impl ToTransportAddr,
        config: &RdmaConfig,
    ) -> io::Result<Stream> {
        let addr = addr.to_transport_addr()?;
        let target = addr.host_port();
        match addr.transport() {
            Transport::Tcp => Ok(Stream::Tcp(
                TcpStream::connect(target)
                    .await
                    .map_err(|e| super::tcp_error("connect", &addr, e))?,
            )),
            Transport::Rdma => Ok(Stream::Rdma(
                RdmaStream::connect_with(target, config).await?,
            )),
            Transport::Auto => connect_auto(&addr, config).await,
        }
    }

    /// The transport this connection runs on: [`Transport::Tcp`] or
    /// [`Transport::Rdma`] (never `Auto`).
    pub fn transport(&self) -> Transport {
        match self {
            Stream::Tcp(_) => Transport::Tcp,
            Stream::Rdma(_) => Transport::Rdma,
        }
    }

    /// The local address: the TCP socket's, or the RDMA connection's IP and
    /// rdma_cm port.
    ///
    /// # Errors
    /// As [`TcpStream::local_addr`] (RDMA never fails).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Stream::Tcp(s) => s.local_addr(),
            Stream::Rdma(s) => s.local_addr(),
        }
    }

    /// The peer's address (see [`local_addr`](Self::local_addr)).
    ///
    /// # Errors
    /// As [`TcpStream::peer_addr`] (RDMA never fails).
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Stream::Tcp(s) => s.peer_addr(),
            Stream::Rdma(s) => s.peer_addr(),
        }
    }

    /// Sets `TCP_NODELAY`; over RDMA writes are never delayed and the value
    /// is only recorded ([`RdmaStream::set_nodelay`]).
    ///
    /// # Errors
    /// As [`TcpStream::set_nodelay`].
    pub fn set_nodelay(&self, nodelay: bool) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nodelay(nodelay),
            Stream::Rdma(s) => s.set_nodelay(nodelay),
        }
    }

    /// The no-delay flag (see [`set_nodelay`](Self::set_nodelay)).
    ///
    /// # Errors
    /// As [`TcpStream::nodelay`].
    pub fn nodelay(&self) -> io::Result<bool> {
        match self {
            Stream::Tcp(s) => s.nodelay(),
            Stream::Rdma(s) => s.nodelay(),
        }
    }

    /// Both addresses and the transport, as handed to hyper, axum and tonic.
    ///
    /// # Errors
    /// As [`local_addr`](Self::local_addr) and [`peer_addr`](Self::peer_addr).
    pub fn connection_info(&self) -> io::Result<ConnectionInfo> {
        Ok(ConnectionInfo {
            local: self.local_addr()?,
            peer: self.peer_addr()?,
            transport: self.transport(),
        })
    }

    /// [`connection_info`](Self::connection_info) for trait impls that
    /// cannot fail: an address that cannot be read (a TCP socket already
    /// disconnected) is `0.0.0.0:0`.
    #[cfg_attr(not(any(feature = "hyper", feature = "axum")), allow(dead_code))]
    pub(crate) fn connection_info_lossy(&self) -> ConnectionInfo {
        let unspecified = SocketAddr::from(([0, 0, 0, 0], 0));
        ConnectionInfo {
            local: self.local_addr().unwrap_or(unspecified),
            peer: self.peer_addr().unwrap_or(unspecified),
            transport: self.transport(),
        }
    }
}

async fn connect_auto(addr: &TransportAddr, config: &RdmaConfig) -> io::Result<Stream> {
    let target = addr.host_port();
    match RdmaStream::connect_with(target, config).await {
        Ok(s) => {
            debug!(addr = %addr, peer = ?s.peer_addr().ok(), device = s.device(), "auto transport: connected over RDMA");
            Ok(Stream::Rdma(s))
        }
        Err(e) => {
            let Some(cause) = super::fallback_cause(&e) else {
                return Err(e);
            };
            if super::note_fallback(&addr.to_string(), cause) {
                warn!(addr = %addr, cause, error = %e, "auto transport: falling back to TCP (logged once per peer and cause)");
            } else {
                debug!(addr = %addr, cause, "auto transport: falling back to TCP");
            }
            match TcpStream::connect(target).await {
                Ok(s) => Ok(Stream::Tcp(s)),
                // Name both attempts; the kind is TCP's.
                Err(tcp) => Err(crate::Error::FallbackFailed {
                    addr: addr.to_string(),
                    rdma: Box::new(
                        crate::Error::from_io(&e)
                            .cloned()
                            .unwrap_or_else(|| crate::Error::Internal(e.to_string())),
                    ),
                    tcp,
                }
                .into()),
            }
        }
    }
}

impl From<TcpStream> for Stream {
    fn from(s: TcpStream) -> Self {
        Stream::Tcp(s)
    }
}

impl From<RdmaStream> for Stream {
    fn from(s: RdmaStream) -> Self {
        Stream::Rdma(s)
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Rdma(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Rdma(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Rdma(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Tcp(s) => s.is_write_vectored(),
            Stream::Rdma(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Rdma(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Rdma(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
