//! `RdmaListener`: the stream kind of the connection core's listener, and
//! the stream's [`Setup`] for the shared handshake.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::net::ToSocketAddrs;

use super::RdmaStream;
use super::conn::{self, StreamState};
use super::qp::StreamQp;
use crate::config::RdmaConfig;
use crate::conn::{Established, Handle, Listener, Setup};
use crate::error::Result;
use crate::proto::handshake::{EndpointKind, Hello};
use crate::verbs::rc::{OpenDevice, RcQueuePair, RcSizes};

/// The byte stream's [`Setup`].
#[derive(Clone)]
pub(crate) struct StreamSetup(pub(crate) RdmaConfig);

impl Setup for StreamSetup {
    type Out = Handle<StreamState>;
    type Qp = StreamQp;
    const KIND: EndpointKind = EndpointKind::ByteStream;
    fn rdma(&self) -> &RdmaConfig {
        &self.0
    }
    fn sizes(&self) -> RcSizes {
        self.0.stream_sizes()
    }
    async fn prepare(&self, _device: &Arc<OpenDevice>, qp: RcQueuePair) -> Result<StreamQp> {
        StreamQp::new(qp, &self.0)
    }
    fn on_init(&self, qp: &mut StreamQp) -> Result<Hello> {
        qp.post_recvs(self.0.recv_queue_depth.into())?;
        Ok(conn::local_hello(qp, &self.0))
    }
    async fn on_rts(&self, qp: &mut StreamQp) -> Result<()> {
        qp.bind_ring_window().await
    }
    fn finish(&self, est: Established<StreamQp>) -> Result<Handle<StreamState>> {
        conn::start(est, &self.0)
    }
}

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

impl std::fmt::Debug for RdmaListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaListener")
            .field("local_addr", &self.inner.local_addr())
            .finish()
    }
}

impl RdmaListener {
    /// Binds to `addr` (an IP address of an RDMA device, or `0.0.0.0`; port
    /// 0 picks a free rdma_cm port) with the default [`RdmaConfig`].
    ///
    /// # Errors
    /// `NotFound` (`Error::NoDevice`) without an RDMA device,
    /// `AddrInUse` from `rdma_bind_addr`, `AddrNotAvailable`
    /// ([`Error::NoDeviceForAddress`](crate::Error::NoDeviceForAddress),
    /// naming it) for an address no interface has (or no longer has), an
    /// interface without an RDMA device, or a loopback address.
    pub async fn bind<A: ToSocketAddrs>(addr: A) -> io::Result<RdmaListener> {
        Self::bind_with(addr, &RdmaConfig::default()).await
    }

    /// Binds with `config`, which every accepted connection uses.
    /// Errors as for [`bind`](Self::bind).
    pub async fn bind_with<A: ToSocketAddrs>(
        addr: A,
        config: &RdmaConfig,
    ) -> io::Result<RdmaListener> {
        crate::verbs::fork::check_io("RdmaListener::bind")?;
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
        Ok(self.inner.local_addr())
    }
}
