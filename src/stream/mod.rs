//! `RdmaStream` and `RdmaListener`: byte streams over RC queue pairs that
//! behave like tokio's `TcpStream` and `TcpListener`.

mod conn;
mod listener;
#[allow(unsafe_code)]
mod qp;
mod split;

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::ToSocketAddrs;

pub use listener::RdmaListener;
pub use split::{OwnedReadHalf, OwnedWriteHalf, ReadHalf, ReuniteError, WriteHalf};

use crate::config::RdmaConfig;
use crate::stats::ConnectionStats;
use conn::StreamState;
#[cfg(tokio_rdma_guest)]
pub(crate) use conn::{Conn as DebugConn, debug_state};

type Handle = crate::conn::Handle<StreamState>;

/// A byte stream over an RDMA reliable-connected queue pair, used like
/// [`tokio::net::TcpStream`].
///
/// Data goes by RDMA WRITE WITH IMMEDIATE into a receive ring the peer
/// registered; the immediate data carries lengths, credit, FIN and abort
/// (see `crate::proto`). Semantics match TCP's:
/// - `poll_read` returns EOF only after the peer's FIN and every byte before
///   it; a peer that vanished is `ConnectionReset`, never EOF.
/// - `poll_shutdown` half-closes (reads keep working); later writes fail
///   with `BrokenPipe`.
/// - bytes accepted by `poll_write` are delivered even if the stream is
///   dropped at once (a background task lingers until they are sent).
/// - `poll_flush` means "posted to the NIC"; data goes out without it.
pub struct RdmaStream {
    conn: Handle,
}

impl std::fmt::Debug for RdmaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaStream")
            .field("local_addr", &self.conn.local_addr)
            .field("peer_addr", &self.conn.peer_addr)
            .field("qp_num", &self.conn.qp_num)
            .finish()
    }
}

impl RdmaStream {
    fn from_conn(conn: Handle) -> Self {
        RdmaStream { conn }
    }

    /// Opens a connection to `addr` with the default [`RdmaConfig`].
    ///
    /// Like `TcpStream::connect`, each resolved address is tried in turn and
    /// the last error is returned.
    ///
    /// # Errors
    /// `io::Error` whose payload (`get_ref()`, [`crate::Error::from_io`]) is a [`crate::Error`]: `ConnectionRefused`
    /// (no listener on that port, or the handshake was rejected), `TimedOut`,
    /// `NotFound` ([`crate::Error::NoDevice`]: no RDMA device on this host),
    /// `HostUnreachable` (no RDMA route), `InvalidData` (bad handshake reply).
    pub async fn connect<A: ToSocketAddrs>(addr: A) -> io::Result<RdmaStream> {
        Self::connect_with(addr, &RdmaConfig::default()).await
    }

    /// Opens a connection to `addr` with `config`. Errors as for
    /// [`connect`](Self::connect).
    pub async fn connect_with<A: ToSocketAddrs>(
        addr: A,
        config: &RdmaConfig,
    ) -> io::Result<RdmaStream> {
        crate::verbs::fork::check_io("RdmaStream::connect")?;
        config.validate()?;
        let conn = crate::conn::connect_any(addr, &listener::StreamSetup(config.clone())).await?;
        Ok(RdmaStream::from_conn(conn))
    }

    /// The local address (IP and rdma_cm port) of this connection.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.conn.local_addr)
    }

    /// The peer's address (IP and rdma_cm port).
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.conn.peer_addr)
    }

    /// Sets the no-delay flag. Writes are always posted at once (there is no
    /// Nagle-style coalescing), so this only records the value for
    /// [`nodelay`](Self::nodelay); it exists for `TcpStream` parity.
    pub fn set_nodelay(&self, nodelay: bool) -> io::Result<()> {
        self.conn.set_nodelay(nodelay);
        Ok(())
    }

    /// The value last set with [`set_nodelay`](Self::set_nodelay) (default
    /// `true`: writes are never delayed).
    pub fn nodelay(&self) -> io::Result<bool> {
        Ok(self.conn.nodelay())
    }

    /// The queue pair number of this connection's local QP.
    pub fn qp_num(&self) -> u32 {
        self.conn.qp_num
    }

    /// The path MTU of the connection, bytes: 256, 512, 1024, 2048 or
    /// 4096, the RDMA payload of every packet but a message's last. Both
    /// sides use the same one, the smallest of their ports' active MTUs
    /// (on RoCE, the netdev MTU less the RoCE headers, rounded down to
    /// one of those sizes: 1500 gives 1024, 9000 gives 4096) and rdma_cm's
    /// path record. 0 on iWARP, whose TCP segments by its own MSS.
    pub fn path_mtu(&self) -> u32 {
        self.conn.path_mtu
    }

    /// The RDMA device the connection runs on, for example `rxe0`.
    pub fn device(&self) -> &str {
        &self.conn.device
    }

    /// A snapshot of this connection's counters.
    pub fn stats(&self) -> ConnectionStats {
        self.conn.stats()
    }

    #[cfg(tokio_rdma_guest)]
    pub(crate) fn debug_probe(&self) -> std::sync::Weak<conn::Conn> {
        self.conn.downgrade()
    }

    #[cfg(tokio_rdma_guest)]
    pub(crate) fn ring_key(&self) -> (u64, u32) {
        self.conn.ring_key()
    }

    #[cfg(tokio_rdma_guest)]
    pub(crate) fn forge_ring_write(&self, addr: u64, rkey: u32, len: u32) -> io::Result<()> {
        self.conn.forge_ring_write(addr, rkey, len)
    }

    /// Splits into borrowed read and write halves (like
    /// `TcpStream::split`).
    pub fn split(&mut self) -> (ReadHalf<'_>, WriteHalf<'_>) {
        split::split(self)
    }

    /// Splits into owned halves that can move to different tasks (like
    /// `TcpStream::into_split`); [`OwnedReadHalf::reunite`] puts them back.
    pub fn into_split(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        split::into_split(self)
    }
}

impl AsyncRead for RdmaStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.conn.poll_read(cx, buf)
    }
}

impl AsyncWrite for RdmaStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.conn.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.conn.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.conn.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.conn.poll_shutdown(cx)
    }
}
