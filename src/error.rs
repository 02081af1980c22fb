//! The crate's error type and its mapping onto [`std::io::Error`].
//!
//! hyper, tonic and axum only ever see `io::Error`, so every variant maps onto
//! a deliberate [`io::ErrorKind`] (see [`From<Error> for io::Error`](#impl-From<Error>-for-Error)).

use std::io;
use std::net::{IpAddr, SocketAddr};

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in tokio-rdma.
///
/// `#[non_exhaustive]`: new variants are added as the crate grows. Each
/// variant names what failed and where; converting into [`io::Error`] keeps
/// the variant as the source so callers can downcast it back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `libibverbs.so.1` (or `librdmacm.so.1`) could not be loaded at run
    /// time. Install rdma-core (`apt-get install rdma-core ibverbs-providers
    /// librdmacm1`). Maps to [`io::ErrorKind::Unsupported`].
    #[error("RDMA library {library} is not installed or could not be loaded")]
    LibraryUnavailable {
        /// The shared object that failed to load, for example `libibverbs.so.1`.
        library: &'static str,
    },

    /// libibverbs loaded but reports no RDMA device on this host.
    /// Maps to [`io::ErrorKind::NotFound`].
    #[error("no RDMA device found on this host")]
    NoDevice,

    /// RDMA devices exist, but none of them has a port with a GID that maps
    /// the given local IP address. Maps to [`io::ErrorKind::AddrNotAvailable`].
    #[error("no RDMA device has a GID for local address {addr}")]
    NoDeviceForAddress {
        /// The local IP address that was looked up.
        addr: IpAddr,
    },

    /// The named device (from a configuration override) does not exist.
    /// Maps to [`io::ErrorKind::NotFound`].
    #[error("RDMA device {name:?} not found")]
    DeviceNotFound {
        /// The requested device name, for example `mlx5_0` or `rxe0`.
        name: String,
    },

    /// A verbs or rdma_cm call failed. `op` is the C function (for example
    /// `ibv_reg_mr`), `source` the OS error it reported. Maps to the kind of
    /// `source`.
    #[error("{op} failed: {source}")]
    Verbs {
        /// The libibverbs/librdmacm function that failed.
        op: &'static str,
        /// The errno it reported.
        #[source]
        source: io::Error,
    },

    /// The server answered the handshake with a reject naming `reason`
    /// (for example a protocol version it does not speak). Maps to
    /// [`io::ErrorKind::ConnectionRefused`].
    #[error("{addr} rejected the handshake: {reason:?} (server protocol version {server_version})")]
    HandshakeRejected {
        /// The address that was dialled.
        addr: SocketAddr,
        /// The reason the server gave.
        reason: crate::proto::handshake::RejectReason,
        /// The protocol version the server speaks.
        server_version: u16,
    },

    /// The peer's handshake private data was invalid (not tokio-rdma, another
    /// protocol version, truncated). Maps to [`io::ErrorKind::InvalidData`].
    #[error("invalid handshake from peer: {0}")]
    Handshake(#[from] crate::proto::handshake::HandshakeError),

    /// The peer broke the stream protocol (bad immediate data, overran its
    /// credit). The connection is aborted. Maps to
    /// [`io::ErrorKind::InvalidData`].
    #[error("protocol violation by peer: {0}")]
    Protocol(#[from] crate::proto::ProtocolError),

    /// The peer of a message endpoint broke the message protocol (see
    /// [`MessageError`](crate::proto::message::MessageError) for each case:
    /// an oversized announcement, a bad sequence number, credit overflow).
    /// The endpoint sent an ABORT and is unusable. Maps to
    /// [`io::ErrorKind::InvalidData`].
    #[error("message protocol violation by peer: {0}")]
    Message(#[from] crate::proto::message::MessageError),

    /// The peer of a message endpoint aborted it with `code` (0: its
    /// application; 1 and up: it found a protocol error of ours, named by
    /// [`MessageError::abort_code`](crate::proto::message::MessageError::abort_code)).
    /// Maps to [`io::ErrorKind::ConnectionReset`].
    #[error("message endpoint aborted by peer with code {code} ({reason})")]
    PeerAborted {
        /// The ABORT code.
        code: u32,
        /// What the code means.
        reason: &'static str,
    },

    /// Connecting to `addr` took longer than the configured connect timeout.
    /// Maps to [`io::ErrorKind::TimedOut`].
    #[error("connecting to {addr} timed out")]
    TimedOut {
        /// The address that was dialled.
        addr: SocketAddr,
    },

    /// rdma_cm could not resolve an address or route to `addr` (status is
    /// the negative errno of the ADDR_ERROR/ROUTE_ERROR event). Maps to
    /// [`io::ErrorKind::HostUnreachable`], or `NotFound` when no RDMA device
    /// routes to it (ENODEV).
    #[error("no RDMA route to {addr}: {source}")]
    Unreachable {
        /// The address that was dialled.
        addr: SocketAddr,
        /// The errno rdma_cm reported.
        #[source]
        source: io::Error,
    },

    /// An [`RdmaConfig`](crate::RdmaConfig) value is out of range; raised by
    /// `bind_with`/`connect_with` before anything is allocated or sent.
    /// Maps to [`io::ErrorKind::InvalidInput`].
    #[error("invalid RdmaConfig: {field} = {value} (allowed: {allowed})")]
    InvalidConfig {
        /// The setter's name, for example `signal_interval`.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The allowed range.
        allowed: &'static str,
    },

    /// A registered-memory pool operation failed (exhausted, too large,
    /// registration failed). Maps to the pool error's own kind
    /// ([`PoolError::kind`](crate::pool::PoolError::kind)).
    #[error(transparent)]
    Pool(#[from] crate::pool::PoolError),

    /// The peer actively refused the connection (no RDMA listener on that
    /// port: rdma_cm `REJECTED` with the IB CM "consumer reject" reason, or
    /// `UNREACHABLE`). Maps to [`io::ErrorKind::ConnectionRefused`].
    #[error("connection to {addr} refused")]
    ConnectionRefused {
        /// The address that was dialled.
        addr: SocketAddr,
    },
}

impl Error {
    /// The [`io::ErrorKind`] this error maps onto.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            Error::LibraryUnavailable { .. } => io::ErrorKind::Unsupported,
            Error::NoDevice | Error::DeviceNotFound { .. } => io::ErrorKind::NotFound,
            Error::NoDeviceForAddress { .. } => io::ErrorKind::AddrNotAvailable,
            Error::Verbs { source, .. } => source.kind(),
            Error::ConnectionRefused { .. } | Error::HandshakeRejected { .. } => {
                io::ErrorKind::ConnectionRefused
            }
            Error::Handshake(_) | Error::Protocol(_) | Error::Message(_) => {
                io::ErrorKind::InvalidData
            }
            Error::PeerAborted { .. } => io::ErrorKind::ConnectionReset,
            Error::TimedOut { .. } => io::ErrorKind::TimedOut,
            Error::Pool(e) => e.kind(),
            Error::InvalidConfig { .. } => io::ErrorKind::InvalidInput,
            Error::Unreachable { source, .. } => match source.raw_os_error() {
                Some(libc::ENODEV) => io::ErrorKind::NotFound,
                _ => io::ErrorKind::HostUnreachable,
            },
        }
    }
}

impl From<Error> for io::Error {
    fn from(err: Error) -> Self {
        io::Error::new(err.kind(), err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_error_keeps_kind_and_source() {
        let err: io::Error = Error::NoDevice.into();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        let inner = err.get_ref().unwrap().downcast_ref::<Error>().unwrap();
        assert!(matches!(inner, Error::NoDevice));

        let err: io::Error = Error::Verbs {
            op: "ibv_reg_mr",
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        }
        .into();
        assert_eq!(err.kind(), io::ErrorKind::OutOfMemory);
        assert_eq!(
            err.to_string(),
            format!(
                "ibv_reg_mr failed: {}",
                io::Error::from_raw_os_error(libc::ENOMEM)
            )
        );
    }
}
