//! Transport switch: TCP or RDMA chosen by address, so a TCP service moves
//! to InfiniBand/RoCE by changing an address string.
//!
//! - [`TransportAddr`]: `tcp://host:port`, `rdma://host:port` or
//!   `auto://host:port` (RDMA where it works, TCP otherwise).
//! - [`Stream`]: one stream type over [`tokio::net::TcpStream`] and
//!   [`RdmaStream`](crate::RdmaStream); [`Stream::transport`] tells which.
//! - [`Listener`]: accepts TCP, RDMA, or both on the same port number.
//!
//! Integrations, each behind a Cargo feature (all off by default):
//! - `hyper`: `Connector`, a `tower_service::Service<http::Uri>` for
//!   `hyper_util`'s pooled client; `Stream` implements hyper_util's
//!   `Connection` with a [`ConnectionInfo`] in `Connected::extra`.
//! - `axum`: [`Listener`] implements `axum::serve::Listener`;
//!   `ConnectInfo<ConnectionInfo>` gives handlers the peer and transport.
//! - `tonic`: `Stream` implements tonic's server `Connected` (request
//!   extension [`ConnectionInfo`]), [`Listener::into_incoming`] feeds
//!   `serve_with_incoming`, and `Connector` (or `channel`) serves
//!   `Endpoint::connect_with_connector`.
//!
//! ```no_run
//! # async fn run() -> std::io::Result<()> {
//! use tokio::io::AsyncWriteExt;
//! use tokio_rdma::transport::{Listener, Stream};
//!
//! // The same code over TCP, RDMA or either: only the string changes.
//! let listener = Listener::bind("auto://0.0.0.0:7000").await?;
//! let mut client = Stream::connect("auto://10.11.0.1:7000").await?;
//! println!("client runs on {}", client.transport());
//! client.write_all(b"hello").await?;
//! let (server, peer) = listener.accept().await?;
//! # Ok(()) }
//! ```

mod addr;
mod listener;
mod stream;

#[cfg(feature = "axum")]
mod axum;
#[cfg(feature = "hyper")]
mod hyper;
#[cfg(feature = "tonic")]
mod tonic;

use std::io;
use std::net::SocketAddr;

pub use addr::{AddrParseError, ToTransportAddr, Transport, TransportAddr};
#[cfg(feature = "hyper")]
pub use hyper::Connector;
pub use listener::{Incoming, Listener};
pub use stream::Stream;
#[cfg(feature = "tonic")]
pub use tonic::channel;

/// The addresses and transport of one connection: what hyper's
/// `Connected::extra` (response extensions), axum's `ConnectInfo` and tonic's
/// request extensions carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectionInfo {
    /// This side's address (IP and TCP or rdma_cm port).
    pub local: SocketAddr,
    /// The other side's address.
    pub peer: SocketAddr,
    /// The transport the connection runs on: [`Transport::Tcp`] or
    /// [`Transport::Rdma`].
    pub transport: Transport,
}

/// The inner [`crate::Error`] of an `io::Error`, if it has one.
fn crate_error(e: &io::Error) -> Option<&crate::Error> {
    e.get_ref().and_then(|e| e.downcast_ref::<crate::Error>())
}

/// RDMA cannot be used on this host or for this local address: no library,
/// no device, no device with a GID for the address (ENODEV from rdma_cm).
fn rdma_unavailable_here(e: &io::Error) -> bool {
    if let Some(crate::Error::Verbs { source, .. }) = crate_error(e) {
        if source.raw_os_error() == Some(libc::ENODEV) {
            return true;
        }
    }
    matches!(
        e.kind(),
        io::ErrorKind::NotFound | io::ErrorKind::Unsupported | io::ErrorKind::AddrNotAvailable
    )
}

/// An RDMA connect error after which `auto://` tries TCP: RDMA unusable
/// here, no RDMA route to the peer, or no RDMA listener there.
fn falls_back_to_tcp(e: &io::Error) -> bool {
    rdma_unavailable_here(e)
        || matches!(
            e.kind(),
            io::ErrorKind::HostUnreachable
                | io::ErrorKind::NetworkUnreachable
                | io::ErrorKind::ConnectionRefused
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn fallback_decisions() {
        let addr: SocketAddr = ([10, 11, 0, 1], 1).into();
        let yes: Vec<io::Error> = vec![
            Error::NoDevice.into(),
            Error::LibraryUnavailable {
                library: "libibverbs.so.1",
            }
            .into(),
            Error::NoDeviceForAddress { addr: addr.ip() }.into(),
            Error::Unreachable {
                addr,
                source: io::Error::from_raw_os_error(libc::ETIMEDOUT),
            }
            .into(),
            Error::ConnectionRefused { addr }.into(),
            Error::Verbs {
                op: "rdma_bind_addr",
                source: io::Error::from_raw_os_error(libc::ENODEV),
            }
            .into(),
        ];
        for e in &yes {
            assert!(falls_back_to_tcp(e), "{e}");
        }
        let no: Vec<io::Error> = vec![
            Error::TimedOut { addr }.into(),
            Error::Verbs {
                op: "ibv_reg_mr",
                source: io::Error::from_raw_os_error(libc::ENOMEM),
            }
            .into(),
            io::Error::new(io::ErrorKind::InvalidData, "garbage"),
        ];
        for e in &no {
            assert!(!falls_back_to_tcp(e), "{e}");
        }
        assert!(!rdma_unavailable_here(
            &Error::ConnectionRefused { addr }.into()
        ));
    }
}
