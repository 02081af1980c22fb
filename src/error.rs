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
    /// Wraps the current `errno` as a failure of the verbs call `op`.
    pub(crate) fn last_os(op: &'static str) -> Self {
        Error::Verbs {
            op,
            source: io::Error::last_os_error(),
        }
    }

    /// The [`io::ErrorKind`] this error maps onto.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            Error::LibraryUnavailable { .. } => io::ErrorKind::Unsupported,
            Error::NoDevice | Error::DeviceNotFound { .. } => io::ErrorKind::NotFound,
            Error::NoDeviceForAddress { .. } => io::ErrorKind::AddrNotAvailable,
            Error::Verbs { source, .. } => source.kind(),
            Error::ConnectionRefused { .. } => io::ErrorKind::ConnectionRefused,
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
            format!("ibv_reg_mr failed: {}", io::Error::from_raw_os_error(libc::ENOMEM))
        );
    }
}
