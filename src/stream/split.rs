//! Read and write halves, mirroring `tokio::net::tcp::{ReadHalf, WriteHalf,
//! OwnedReadHalf, OwnedWriteHalf}`.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::{Handle, RdmaStream};

/// Borrowed read half of an [`RdmaStream`], from [`RdmaStream::split`].
#[derive(Debug)]
pub struct ReadHalf<'a>(&'a RdmaStream);

/// Borrowed write half of an [`RdmaStream`], from [`RdmaStream::split`].
/// `poll_shutdown` half-closes the whole stream's write side.
#[derive(Debug)]
pub struct WriteHalf<'a>(&'a RdmaStream);

/// Owned read half, from [`RdmaStream::into_split`].
pub struct OwnedReadHalf {
    conn: Handle,
}

/// Owned write half, from [`RdmaStream::into_split`]. Like tokio's,
/// dropping it half-closes the stream's write side (the peer reads EOF once
/// everything written is delivered) unless [`forget`](Self::forget) is
/// called; the connection itself closes when both halves are gone.
pub struct OwnedWriteHalf {
    conn: Handle,
    shutdown_on_drop: bool,
}

impl std::fmt::Debug for OwnedReadHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedReadHalf")
            .field("qp_num", &self.conn.qp_num)
            .finish()
    }
}
impl std::fmt::Debug for OwnedWriteHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedWriteHalf")
            .field("qp_num", &self.conn.qp_num)
            .finish()
    }
}

/// Error from [`OwnedReadHalf::reunite`] when the halves came from different
/// streams; carries both halves back.
#[derive(Debug)]
pub struct ReuniteError(pub OwnedReadHalf, pub OwnedWriteHalf);

impl std::fmt::Display for ReuniteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("tried to reunite halves that are not from the same stream")
    }
}
impl std::error::Error for ReuniteError {}

pub(super) fn split(stream: &mut RdmaStream) -> (ReadHalf<'_>, WriteHalf<'_>) {
    (ReadHalf(stream), WriteHalf(stream))
}

pub(super) fn into_split(stream: RdmaStream) -> (OwnedReadHalf, OwnedWriteHalf) {
    let write = OwnedWriteHalf {
        conn: stream.conn.another(),
        shutdown_on_drop: true,
    };
    (OwnedReadHalf { conn: stream.conn }, write)
}

impl OwnedReadHalf {
    /// Puts the halves back together into the stream they came from.
    ///
    /// # Errors
    /// [`ReuniteError`] (with both halves) if they belong to different streams.
    pub fn reunite(self, other: OwnedWriteHalf) -> Result<RdmaStream, ReuniteError> {
        if !self.conn.same_conn(&other.conn) {
            return Err(ReuniteError(self, other));
        }
        // Two handles become one; reuniting is not a half-close.
        let mut other = other;
        other.shutdown_on_drop = false;
        drop(other);
        Ok(RdmaStream { conn: self.conn })
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<std::net::SocketAddr> {
        Ok(self.conn.peer_addr)
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        Ok(self.conn.local_addr)
    }
}

impl Drop for OwnedWriteHalf {
    fn drop(&mut self) {
        if self.shutdown_on_drop {
            self.conn.shutdown_write();
        }
    }
}

impl OwnedWriteHalf {
    /// Drops the write half without half-closing the stream (tokio's
    /// `OwnedWriteHalf::forget`).
    pub fn forget(mut self) {
        self.shutdown_on_drop = false;
    }

    /// Puts the halves back together; see [`OwnedReadHalf::reunite`].
    ///
    /// # Errors
    /// [`ReuniteError`] if they belong to different streams.
    pub fn reunite(self, other: OwnedReadHalf) -> Result<RdmaStream, ReuniteError> {
        other.reunite(self)
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<std::net::SocketAddr> {
        Ok(self.conn.peer_addr)
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        Ok(self.conn.local_addr)
    }
}

impl AsyncRead for ReadHalf<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.0.conn.poll_read(cx, buf)
    }
}

impl AsyncRead for OwnedReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.conn.poll_read(cx, buf)
    }
}

macro_rules! impl_write {
    ($t:ty, $c:ident => $conn:expr) => {
        impl AsyncWrite for $t {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                let $c = &*self;
                $conn.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
            }
            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                let $c = &*self;
                $conn.poll_write_vectored(cx, bufs)
            }
            fn is_write_vectored(&self) -> bool {
                true
            }
            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                let $c = &*self;
                $conn.poll_flush(cx)
            }
            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                let $c = &*self;
                $conn.poll_shutdown(cx)
            }
        }
    };
}

impl_write!(WriteHalf<'_>, s => s.0.conn);
impl_write!(OwnedWriteHalf, s => s.conn);
