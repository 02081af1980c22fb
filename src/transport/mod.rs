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
//!   `serve_with_incoming`, and `Connector` (or `channel`/`channel_with`) serves
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

use std::collections::HashSet;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, PoolError};

pub use addr::{AddrParseError, ToTransportAddr, Transport, TransportAddr};
#[cfg(feature = "hyper")]
#[cfg_attr(docsrs, doc(cfg(feature = "hyper")))]
pub use hyper::Connector;
pub use listener::{Incoming, Listener};
pub use stream::Stream;
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub use tonic::{channel, channel_with};

/// The addresses and transport of one connection: what hyper's
/// `Connected::extra` (response extensions), axum's `ConnectInfo` and tonic's
/// request extensions carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ConnectionInfo {
    /// This side's address (IP and TCP or rdma_cm port).
    pub local: SocketAddr,
    /// The other side's address.
    pub peer: SocketAddr,
    /// The transport the connection runs on: [`Transport::Tcp`] or
    /// [`Transport::Rdma`].
    pub transport: Transport,
}

/// Why RDMA cannot be used here for a listener: no library, no device, no
/// device with a GID for the address (ENODEV from rdma_cm). `None` for every
/// other error, a misconfiguration included (a wrong `RdmaConfig::device`,
/// an invalid config): those are returned, never hidden by a fallback.
fn rdma_unavailable_here(e: &io::Error) -> Option<&'static str> {
    match Error::from_io(e)? {
        Error::LibraryUnavailable { .. } => Some("no RDMA library on this host"),
        Error::NoDevice => Some("no RDMA device on this host"),
        Error::NoDeviceForAddress { .. } => Some("no RDMA device has this address"),
        Error::Verbs { source, .. } | Error::Unreachable { source, .. }
            if source.raw_os_error() == Some(libc::ENODEV) =>
        {
            Some("no RDMA device serves this address")
        }
        _ => None,
    }
}

/// Why an `auto://` client falls back to TCP after the RDMA attempt failed
/// with `e`, or `None` when it must not: the fallback covers a path without
/// RDMA (nothing here, no RDMA route to the peer, no RDMA listener there)
/// and a process that cannot pin memory (RLIMIT_MEMLOCK: `ENOMEM` from
/// registration). A misconfiguration (`DeviceNotFound`, `InvalidConfig`), a
/// handshake the peer rejected (another protocol version, the wrong endpoint
/// kind), a timeout or a protocol error is returned as it is.
fn fallback_cause(e: &io::Error) -> Option<&'static str> {
    if let Some(cause) = rdma_unavailable_here(e) {
        return Some(cause);
    }
    match Error::from_io(e)? {
        Error::Unreachable { .. } => Some("no RDMA route to the peer"),
        Error::ConnectionRefused { .. } => Some("no RDMA listener at the peer"),
        Error::ResourceLimit {
            resource: crate::error::Resource::LockedMemory,
            ..
        } => Some("cannot register memory (RLIMIT_MEMLOCK reached: raise `ulimit -l`)"),
        Error::Verbs { source, .. } | Error::Pool(PoolError::Registration { source, .. })
            if source.raw_os_error() == Some(libc::ENOMEM) =>
        {
            Some("cannot register memory (RLIMIT_MEMLOCK reached: raise `ulimit -l`)")
        }
        _ => None,
    }
}

/// A TCP error of `op` (`"connect"`, `"bind"`) on `addr` as an
/// [`Error::Tcp`]: the message names both, the kind stays the OS error's.
fn tcp_error(op: &'static str, addr: &TransportAddr, source: io::Error) -> io::Error {
    Error::Tcp {
        op,
        addr: addr.to_string(),
        source,
    }
    .into()
}

/// `auto://` connections that fell back to TCP in this process.
static FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// How many `auto://` connects in this process fell back to TCP (each is
/// also logged: the first per peer address and cause with
/// `tracing::warn!`, later ones at `debug`).
pub fn fallback_count() -> u64 {
    FALLBACKS.load(Ordering::Relaxed)
}

/// Counts a fallback; true the first time for this peer and cause (the
/// caller warns then, and logs at debug after).
fn note_fallback(peer: &str, cause: &'static str) -> bool {
    static SEEN: OnceLock<Mutex<HashSet<(String, &'static str)>>> = OnceLock::new();
    FALLBACKS.fetch_add(1, Ordering::Relaxed);
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    // Bounded: a process dialling ever new peers stops remembering them.
    if seen.len() >= 4096 {
        seen.clear();
    }
    seen.insert((peer.to_string(), cause))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_decisions() {
        let addr: SocketAddr = ([10, 11, 0, 1], 1).into();
        let yes: Vec<(io::Error, &str)> = vec![
            (Error::NoDevice.into(), "no RDMA device on this host"),
            (
                Error::LibraryUnavailable {
                    library: "libibverbs.so.1",
                }
                .into(),
                "no RDMA library on this host",
            ),
            (
                Error::NoDeviceForAddress { addr: addr.ip() }.into(),
                "no RDMA device has this address",
            ),
            (
                Error::Unreachable {
                    addr,
                    source: io::Error::from_raw_os_error(libc::ETIMEDOUT),
                }
                .into(),
                "no RDMA route to the peer",
            ),
            (
                Error::ConnectionRefused { addr }.into(),
                "no RDMA listener at the peer",
            ),
            (
                Error::Verbs {
                    op: "rdma_bind_addr",
                    source: io::Error::from_raw_os_error(libc::ENODEV),
                }
                .into(),
                "no RDMA device serves this address",
            ),
            (
                Error::Pool(PoolError::Registration {
                    len: 4096,
                    source: io::Error::from_raw_os_error(libc::ENOMEM),
                })
                .into(),
                "cannot register memory (RLIMIT_MEMLOCK reached: raise `ulimit -l`)",
            ),
        ];
        let yes: Vec<(io::Error, &str)> = yes
            .into_iter()
            .chain([(
                Error::ResourceLimit {
                    resource: crate::error::Resource::LockedMemory,
                    limit: Some(65536),
                    op: "ibv_reg_mr",
                    source: io::Error::from_raw_os_error(libc::ENOMEM),
                }
                .into(),
                "cannot register memory (RLIMIT_MEMLOCK reached: raise `ulimit -l`)",
            )])
            .collect();
        for (e, cause) in &yes {
            assert_eq!(fallback_cause(e), Some(*cause), "{e}");
        }
        let no: Vec<io::Error> = vec![
            Error::TimedOut {
                addr,
                stage: crate::error::ConnectStage::AwaitingReply,
            }
            .into(),
            Error::DeviceNotFound {
                name: "mlx5_9".into(),
            }
            .into(),
            Error::HandshakeRejected {
                addr,
                reason: crate::proto::handshake::RejectReason::UnsupportedVersion,
                server_version: 9,
            }
            .into(),
            Error::InvalidConfig {
                field: "ring_size",
                value: 0,
                allowed: "4096..=1 GiB",
            }
            .into(),
            Error::Verbs {
                op: "ibv_create_qp",
                source: io::Error::from_raw_os_error(libc::EINVAL),
            }
            .into(),
            Error::ResourceLimit {
                resource: crate::error::Resource::FileDescriptors,
                limit: Some(1024),
                op: "ibv_create_comp_channel",
                source: io::Error::from_raw_os_error(libc::EMFILE),
            }
            .into(),
            io::Error::new(io::ErrorKind::ConnectionRefused, "not ours"),
        ];
        for e in &no {
            assert_eq!(fallback_cause(e), None, "{e}");
        }
        assert_eq!(
            rdma_unavailable_here(&Error::ConnectionRefused { addr }.into()),
            None
        );
    }

    #[test]
    fn a_fallback_is_counted_each_time_and_warned_once_per_peer_and_cause() {
        let before = fallback_count();
        assert!(note_fallback(
            "auto://192.0.2.7:1",
            "no RDMA listener at the peer"
        ));
        assert!(!note_fallback(
            "auto://192.0.2.7:1",
            "no RDMA listener at the peer"
        ));
        assert!(note_fallback(
            "auto://192.0.2.7:1",
            "no RDMA route to the peer"
        ));
        assert!(note_fallback(
            "auto://192.0.2.8:1",
            "no RDMA listener at the peer"
        ));
        assert!(fallback_count() >= before + 4);
    }
}
