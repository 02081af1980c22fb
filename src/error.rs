//! The crate's error type and its mapping onto [`std::io::Error`].
//!
//! hyper, tonic and axum only ever see `io::Error`, so every variant maps onto
//! a deliberate [`io::ErrorKind`] (see [`From<Error> for io::Error`](#impl-From<Error>-for-Error)).

use std::io;
use std::net::{IpAddr, SocketAddr};

pub use crate::proto::ProtocolError;
pub use crate::proto::handshake::{HandshakeError, RejectReason};
pub use crate::proto::message::MessageError;

/// `std::result::Result` with this crate's [`Error`] as the default error
/// type, for code that calls the crate's non-I/O functions.
///
/// Which error a public function returns, spelled out in every signature:
/// the stream, listener and message APIs (what tokio code awaits) return
/// `std::io::Result` whose payload is an [`Error`] ([`Error::from_io`]);
/// device queries and config checks ([`crate::verbs::devices`],
/// [`crate::RdmaConfig::validate`]) return `Result<T, Error>`; the pool
/// returns `Result<T, PoolError>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in tokio-rdma.
///
/// `#[non_exhaustive]`: new variants are added as the crate grows. Each
/// variant names what failed and where; converting into [`io::Error`] keeps
/// the variant as its payload (`io::Error::get_ref`, not `source()`), so callers
/// get it back with [`Error::from_io`] or [`Error::find`].
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
    #[error(
        "no RDMA device found on this host (`rdma link` or `ibv_devices` lists them; Soft-RoCE: `rdma link add rxe0 type rxe netdev IFACE`)"
    )]
    NoDevice,

    /// A TCP connect or bind of the transport switch failed (`tcp://`, or
    /// the TCP side of an `auto://` listener). Maps to the OS error's kind;
    /// `source` is the OS error itself, with its errno
    /// (`source.raw_os_error()`).
    #[error("{op} {addr}: {source}")]
    Tcp {
        /// `"connect"` or `"bind"`.
        op: &'static str,
        /// The address as given, for example `tcp://10.0.0.5:8080`.
        addr: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// An `auto://` connect found no RDMA path (`rdma`: why), fell back to
    /// TCP, and TCP failed too (`tcp`). Maps to TCP's kind.
    #[error("connect {addr}: RDMA failed ({rdma}), then TCP failed: {tcp}")]
    FallbackFailed {
        /// The address as given, for example `auto://10.0.0.5:8080`.
        addr: String,
        /// Why RDMA was not used.
        rdma: Box<Error>,
        /// TCP's error (with its errno).
        #[source]
        tcp: io::Error,
    },

    /// RDMA devices exist, but none of them has a port with a GID that maps
    /// the given local IP address; also a listener's bind to an address no
    /// interface has (or no longer has), to the address of an interface
    /// without an RDMA device, or to a loopback address. Maps to
    /// [`io::ErrorKind::AddrNotAvailable`].
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

    /// A limit of this process or of the device was reached while creating
    /// a connection's verbs objects (at connect or accept; the listener
    /// keeps serving others). `resource` names it, `limit` is its value
    /// when known (bytes for locked memory, a count otherwise), `op` the
    /// call that failed and `source` its errno. The message says how to
    /// raise it. Maps to the kind of `source` (`OutOfMemory` for `ENOMEM`).
    #[error("{op} failed: {resource} exhausted ({}): {source}; {}", limit_text(*resource, *limit), resource.hint())]
    ResourceLimit {
        /// Which resource ran out.
        resource: Resource,
        /// Its limit, when known.
        limit: Option<u64>,
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
        reason: RejectReason,
        /// The protocol version the server speaks.
        server_version: u16,
    },

    /// The peer's handshake private data was invalid (not tokio-rdma, another
    /// protocol version, truncated). Maps to [`io::ErrorKind::InvalidData`].
    #[error("invalid handshake from peer: {0}")]
    Handshake(#[from] HandshakeError),

    /// The peer broke the stream protocol (bad immediate data, overran its
    /// credit). The connection is aborted. Maps to
    /// [`io::ErrorKind::InvalidData`].
    #[error("protocol violation by peer: {0}")]
    Protocol(#[from] ProtocolError),

    /// The peer of a message endpoint broke the message protocol (see
    /// `MessageError` for each case:
    /// an oversized announcement, a bad sequence number, credit overflow).
    /// The endpoint sent an ABORT and is unusable. Maps to
    /// [`io::ErrorKind::InvalidData`].
    #[error("message protocol violation by peer: {0}")]
    Message(#[from] MessageError),

    /// The peer of a message endpoint aborted it with `code` (0: its
    /// application; 1 and up: it found a protocol error of ours, named by
    /// [`MessageError::abort_code`](MessageError::abort_code)).
    /// Maps to [`io::ErrorKind::ConnectionReset`].
    #[error("message endpoint aborted by peer with code {code} ({reason})")]
    PeerAborted {
        /// The ABORT code.
        code: u32,
        /// What the code means.
        reason: &'static str,
    },

    /// The handshake with `addr` did not finish within the configured
    /// connect timeout (`RdmaConfig::connect_timeout`), or the kernel's
    /// rdma_cm gave up retrying the connect request (CM REQ) because no
    /// reply came (`RDMA_CM_EVENT_UNREACHABLE` with `ETIMEDOUT`: the peer
    /// host is down or partitioned away). `stage` names the step that was
    /// waiting. Maps to [`io::ErrorKind::TimedOut`].
    #[error("connection with {addr} timed out {stage}")]
    TimedOut {
        /// The address that was dialled (on the passive side: the client's).
        addr: SocketAddr,
        /// The handshake step that did not finish.
        stage: ConnectStage,
    },

    /// rdma_cm could not resolve an address or route to `addr` (status is
    /// the negative errno of the ADDR_ERROR/ROUTE_ERROR event), or, on
    /// iWARP, the TCP connect inside rdma_connect lost its neighbour or
    /// route (`EHOSTUNREACH`, `ENETUNREACH`). Maps to
    /// [`io::ErrorKind::HostUnreachable`], `NetworkUnreachable` for
    /// `ENETUNREACH` (as `TcpStream::connect`), or `NotFound` when no RDMA
    /// device routes to it (ENODEV).
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
    /// ([`PoolError::kind`]).
    #[error(transparent)]
    Pool(#[from] PoolError),

    /// The peer actively refused the connection (no RDMA listener on that
    /// port: rdma_cm `REJECTED` with the IB CM "consumer reject" reason, or
    /// `UNREACHABLE`). Maps to [`io::ErrorKind::ConnectionRefused`].
    #[error("connection to {addr} refused")]
    ConnectionRefused {
        /// The address that was dialled.
        addr: SocketAddr,
    },

    /// A work request completed with an error status (`ibv_wc_status`,
    /// libibverbs' `enum ibv_wc_status`; [`wc_status_name`](Self::wc_status_name)
    /// names it). `op` is the work the request did (`"RDMA WRITE WITH
    /// IMM"`, `"SEND"`, `"RDMA READ"`, `"receive"`). Maps to
    /// [`io::ErrorKind::InvalidData`] for REM_ACCESS_ERR (10) on an RDMA
    /// READ (the peer's announced range or key does not allow it: a bogus
    /// rendezvous announcement, or memory the peer deregistered),
    /// [`io::ErrorKind::ConnectionReset`] for the statuses that mean the peer
    /// is gone (WR_FLUSH_ERR 5, REM_ACCESS_ERR 10 on a WRITE into a ring the
    /// dying peer deregistered, RETRY_EXC_ERR 12, RNR_RETRY_EXC_ERR 13,
    /// RESP_TIMEOUT_ERR 20) and [`io::ErrorKind::ConnectionAborted`] for
    /// every other status.
    #[error("{op} work request failed: ibv_wc_status {status} ({}{})", Error::wc_status_name(*status), if *status == 10 { ", a remote access error: the peer's memory key or range does not allow it" } else { "" })]
    WorkCompletion {
        /// What the work request did.
        op: &'static str,
        /// The `ibv_wc_status` value.
        status: u32,
    },

    /// A one-sided operation on remote memory ([`crate::remote`]) failed:
    /// `op` is `"RDMA READ"`, `"RDMA WRITE"`, `"ATOMIC compare-and-swap"`
    /// or `"ATOMIC fetch-and-add"`, `status` the `ibv_wc_status`. The
    /// peer's NIC refused it (REM_ACCESS_ERR 10: the key was revoked, was
    /// granted to another connection, or does not allow this access or
    /// range; REM_INV_REQ_ERR 9, REM_OP_ERR 11) or the connection failed
    /// under it. A reliable-connected QP goes to the error state on any
    /// such failure (IBTA vol. 1, 11.6.2), so the message endpoint fails
    /// with it. Maps to [`io::ErrorKind::PermissionDenied`] for 9, 10 and
    /// 11, to [`io::ErrorKind::ConnectionReset`] otherwise.
    #[error("{op} on remote memory failed: ibv_wc_status {status} ({}{})", Error::wc_status_name(*status), if matches!(*status, 9..=11) { ", refused by the peer's NIC: the grant does not allow it, was revoked, or belongs to another connection" } else { "" })]
    RemoteAccess {
        /// The one-sided operation.
        op: &'static str,
        /// The `ibv_wc_status` value.
        status: u32,
    },

    /// The peer went away without closing the connection (rdma_cm
    /// `DISCONNECTED` before its FIN, or in the middle of a message): the
    /// TCP analogue is a reset. Maps to [`io::ErrorKind::ConnectionReset`].
    #[error("the peer disconnected without closing the connection")]
    PeerDisconnected,

    /// rdma_cm reported `DEVICE_REMOVAL` for the connection's device. Maps
    /// to [`io::ErrorKind::ConnectionAborted`].
    #[error("the RDMA device of the connection was removed")]
    DeviceRemoved,

    /// The port the connection runs on went down (the verbs async event
    /// `PORT_ERR`, for example its netdev set down or its cable pulled)
    /// and stayed down for `after`, the connection's RC retry bound
    /// ([`RdmaConfig::retry_bound`](crate::RdmaConfig::retry_bound): what
    /// the transport itself waits before it gives a path up). A port that
    /// comes back sooner fails nothing. A connect while the port is down
    /// fails with it at once, and so does a connection whose work request
    /// failed while the port is down (Soft-RoCE fails a send at once while
    /// its netdev is down); `after` is then how long it has been down. Like
    /// TCP's `ENETDOWN`, maps to [`io::ErrorKind::NetworkDown`].
    #[error("port {port} of RDMA device {device} went down and stayed down for {after:?}")]
    PortDown {
        /// The device, for example `rxe0`.
        device: String,
        /// The port number (1-based).
        port: u8,
        /// How long the port had been down when the connection failed.
        after: std::time::Duration,
    },

    /// The device reported the connection's queue pair failed (the verbs
    /// async events `QP_FATAL`, `QP_REQ_ERR` or `QP_ACCESS_ERR`: a
    /// transport or access error the QP could not report through a work
    /// completion) and draining its CQ did not fail the connection with a
    /// work completion's own error. The QP is in the error state. Never on
    /// iWARP, where Soft-iWARP raises `QP_REQ_ERR` in a normal close. Maps
    /// to [`io::ErrorKind::ConnectionAborted`].
    #[error("RDMA device {device} reported the queue pair failed ({event})")]
    QueuePairFatal {
        /// The device, for example `rxe0`.
        device: String,
        /// The event's name, for example `QP_FATAL`.
        event: &'static str,
    },

    /// A write after [`poll_shutdown`](tokio::io::AsyncWrite::poll_shutdown)
    /// (or after the write half was dropped). Maps to
    /// [`io::ErrorKind::BrokenPipe`], as a TCP socket after `shutdown(Write)`.
    #[error("the stream was shut down for writing")]
    WriteAfterShutdown,

    /// The peer closed the connection cleanly, so nothing more can be sent
    /// (a message endpoint whose peer closed, a stream write after the peer
    /// disconnected). Maps to [`io::ErrorKind::BrokenPipe`].
    #[error("the peer closed the connection")]
    PeerClosed,

    /// `shutdown` on a stream whose peer vanished without closing (the TCP
    /// analogue is `shutdown(2)` on a reset socket). Maps to
    /// [`io::ErrorKind::NotConnected`].
    #[error("the peer disconnected before the stream was shut down")]
    NotConnected,

    /// This side aborted the connection
    /// ([`MessageEndpoint::abort`](crate::MessageEndpoint::abort)). Maps to
    /// [`io::ErrorKind::ConnectionAborted`].
    #[error("the connection was aborted locally")]
    LocalAbort,

    /// Waiting on the peer took longer than the bound: the linger timeout
    /// ([`RdmaConfig::linger`](crate::RdmaConfig::linger)) after the last
    /// handle dropped or during `close`, with data the peer never took.
    /// Maps to [`io::ErrorKind::TimedOut`].
    #[error("the peer did not take the remaining data within {timeout:?}")]
    LingerTimeout {
        /// The bound that ran out.
        timeout: std::time::Duration,
    },

    /// A keepalive probe, posted after `idle` without traffic, was still
    /// neither acknowledged nor failed when the next one was due: the queue
    /// pair stopped making progress without the RC transport reporting an
    /// error (the RC retries fail a dead peer much sooner, with
    /// [`Error::WorkCompletion`]; seen on rxe when the retry of an RDMA READ
    /// under packet loss wedges the requester). Like TCP keepalive's
    /// `ETIMEDOUT`, maps to [`io::ErrorKind::TimedOut`].
    #[error(
        "keepalive: a probe was neither acknowledged nor failed within {idle:?} (the queue pair stopped making progress)"
    )]
    KeepaliveTimeout {
        /// The keepalive idle time ([`RdmaConfig::keepalive`](crate::RdmaConfig::keepalive)).
        idle: std::time::Duration,
    },

    /// The pool has no memory for a message the peer announced (`len`
    /// bytes; `source` says why: larger than the largest size class, or
    /// exhausted under [`ExhaustedPolicy::Error`](crate::pool::ExhaustedPolicy::Error)).
    /// The endpoint aborts. Maps to [`io::ErrorKind::OutOfMemory`].
    #[error("no pool memory for an incoming message of {len} bytes: {source}")]
    IncomingMessageMemory {
        /// The announced length in bytes.
        len: u64,
        /// The pool's refusal.
        #[source]
        source: PoolError,
    },

    /// An `auto://` listener cannot serve TCP and RDMA on one port number
    /// over iWARP: iWARP is RDMA over TCP, and its listener takes the TCP
    /// port itself (`rdma_listen` answers `EADDRINUSE` for a port the TCP
    /// listener holds, and a TCP listener could not take the iWARP one).
    /// Bind `rdma://` and `tcp://` listeners on two ports instead. Maps to
    /// [`io::ErrorKind::Unsupported`].
    #[error(
        "{addr}: iWARP shares TCP's port space, so one port cannot serve both TCP and RDMA; bind rdma:// and tcp:// on two ports"
    )]
    AutoPortOnIwarp {
        /// The address the listener was asked for (`auto://host:port`).
        addr: String,
    },

    /// The device has no RDMA atomics (`ibv_device_attr::atomic_cap` is
    /// `IBV_ATOMIC_NONE`, as on Soft-iWARP, whose protocol has none):
    /// [`MessageEndpoint::compare_swap`](crate::MessageEndpoint::compare_swap),
    /// [`fetch_add`](crate::MessageEndpoint::fetch_add) and grants with
    /// [`GrantAccess::ATOMIC`](crate::remote::GrantAccess::ATOMIC) are
    /// refused before anything is posted; the endpoint stays usable. Maps
    /// to [`io::ErrorKind::Unsupported`].
    #[error("RDMA device {device} has no atomic operations (atomic_cap NONE)")]
    NoAtomics {
        /// The device name.
        device: String,
    },

    /// The caller runs in a child made by `fork()` from process `parent`,
    /// which opened the RDMA resources `op` would use. They live in the
    /// parent's verbs and rdma_cm file descriptors, which the child shares:
    /// using them would post to, poll, or destroy the parent's queue pairs
    /// and memory regions, so every operation on them is refused (and a
    /// dropped one is leaked, not destroyed). A child that needs RDMA runs
    /// a new program (`exec`, as `std::process::Command` does). Maps to
    /// [`io::ErrorKind::Unsupported`].
    #[error(
        "{op}: RDMA resources of process {parent} cannot be used in a child it forked (they live in the parent's verbs and rdma_cm file descriptors); exec a new program to use RDMA in the child"
    )]
    InheritedAfterFork {
        /// The refused operation.
        op: &'static str,
        /// The process that opened the resources.
        parent: u32,
    },

    /// A broken internal invariant (a bug in tokio-rdma, never the peer's
    /// doing). Maps to [`io::ErrorKind::Other`].
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// The name of an `ibv_wc_status` value (libibverbs' `verbs.h`), for
    /// example `"RETRY_EXC_ERR"` for 12; `"unknown"` for values it does not
    /// define.
    pub fn wc_status_name(status: u32) -> &'static str {
        const NAMES: [&str; 22] = [
            "SUCCESS",
            "LOC_LEN_ERR",
            "LOC_QP_OP_ERR",
            "LOC_EEC_OP_ERR",
            "LOC_PROT_ERR",
            "WR_FLUSH_ERR",
            "MW_BIND_ERR",
            "BAD_RESP_ERR",
            "LOC_ACCESS_ERR",
            "REM_INV_REQ_ERR",
            "REM_ACCESS_ERR",
            "REM_OP_ERR",
            "RETRY_EXC_ERR",
            "RNR_RETRY_EXC_ERR",
            "LOC_RDD_VIOL_ERR",
            "REM_INV_RD_REQ_ERR",
            "REM_ABORT_ERR",
            "INV_EECN_ERR",
            "INV_EEC_STATE_ERR",
            "FATAL_ERR",
            "RESP_TIMEOUT_ERR",
            "GENERAL_ERR",
        ];
        NAMES.get(status as usize).copied().unwrap_or("unknown")
    }

    /// The `tokio_rdma::Error` inside `e`, a `std::io::Error` returned by this crate,
    /// if it has one: `e.get_ref()` downcast (note that
    /// [`io::Error::source`](std::error::Error::source) skips it: std's
    /// `io::Error` reports the *inner* error's source, not the inner error).
    ///
    /// ```
    /// let e: std::io::Error = tokio_rdma::Error::NoDevice.into();
    /// assert!(matches!(tokio_rdma::Error::from_io(&e), Some(tokio_rdma::Error::NoDevice)));
    /// ```
    pub fn from_io(e: &io::Error) -> Option<&Error> {
        e.get_ref().and_then(|inner| inner.downcast_ref::<Error>())
    }

    /// Walks an error's source chain (through `io::Error`s, as hyper and
    /// tonic wrap them) and returns the first `tokio_rdma::Error` found.
    ///
    /// `e` is any error by reference; for a `Box<dyn std::error::Error>` (or
    /// `+ Send + Sync`) pass `&*err` (the box itself is not an `Error`).
    ///
    /// ```
    /// let io: std::io::Error = tokio_rdma::Error::NoDevice.into();
    /// let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(io);
    /// assert!(matches!(tokio_rdma::Error::find(&*boxed), Some(tokio_rdma::Error::NoDevice)));
    /// ```
    pub fn find<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a Error> {
        let mut cur: Option<&'a (dyn std::error::Error + 'static)> = Some(e);
        while let Some(err) = cur {
            if let Some(found) = err.downcast_ref::<Error>() {
                return Some(found);
            }
            if let Some(found) = err.downcast_ref::<io::Error>().and_then(Error::from_io) {
                return Some(found);
            }
            cur = err.source();
        }
        None
    }

    /// The [`io::ErrorKind`] this error maps onto.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            Error::LibraryUnavailable { .. } => io::ErrorKind::Unsupported,
            Error::NoDevice | Error::DeviceNotFound { .. } => io::ErrorKind::NotFound,
            Error::NoDeviceForAddress { .. } => io::ErrorKind::AddrNotAvailable,
            Error::Tcp { source, .. } => source.kind(),
            Error::ResourceLimit { source, .. } => source.kind(),
            Error::FallbackFailed { tcp, .. } => tcp.kind(),
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
                Some(libc::ENETUNREACH) => io::ErrorKind::NetworkUnreachable,
                _ => io::ErrorKind::HostUnreachable,
            },
            Error::RemoteAccess { status, .. } => match status {
                9..=11 => io::ErrorKind::PermissionDenied,
                _ => io::ErrorKind::ConnectionReset,
            },
            Error::WorkCompletion { status, op } => match status {
                10 if *op == "RDMA READ" => io::ErrorKind::InvalidData,
                5 | 10 | 12 | 13 | 20 => io::ErrorKind::ConnectionReset,
                _ => io::ErrorKind::ConnectionAborted,
            },
            Error::IncomingMessageMemory { .. } => io::ErrorKind::OutOfMemory,
            Error::NoAtomics { .. }
            | Error::AutoPortOnIwarp { .. }
            | Error::InheritedAfterFork { .. } => io::ErrorKind::Unsupported,
            Error::PeerDisconnected => io::ErrorKind::ConnectionReset,
            Error::DeviceRemoved | Error::LocalAbort | Error::QueuePairFatal { .. } => {
                io::ErrorKind::ConnectionAborted
            }
            Error::PortDown { .. } => io::ErrorKind::NetworkDown,
            Error::WriteAfterShutdown | Error::PeerClosed => io::ErrorKind::BrokenPipe,
            Error::NotConnected => io::ErrorKind::NotConnected,
            Error::LingerTimeout { .. } | Error::KeepaliveTimeout { .. } => io::ErrorKind::TimedOut,
            Error::Internal(_) => io::ErrorKind::Other,
        }
    }
}

impl From<Error> for io::Error {
    fn from(err: Error) -> Self {
        io::Error::new(err.kind(), err)
    }
}

/// The step of the rdma_cm handshake that [`Error::TimedOut`] was waiting
/// for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConnectStage {
    /// `rdma_resolve_addr`: choosing the local RDMA device and learning the
    /// peer's hardware address (ARP or neighbour discovery on RoCE).
    ResolveAddress,
    /// `rdma_resolve_route`: the path to the peer.
    ResolveRoute,
    /// The connect request (CM REQ) went out and the listener's host never
    /// answered: it is down, partitioned away, or drops RoCE traffic
    /// (UDP port 4791). A host that is up but has no listener on the port
    /// answers at once ([`Error::ConnectionRefused`]).
    AwaitingReply,
    /// Setting up this side: on the process's first connect, loading
    /// libibverbs' providers, opening the devices and starting the rdma_cm
    /// thread; then the queue pair and buffers (for example waiting for
    /// pool memory) or, once the listener answered, moving the queue pair
    /// to ready-to-send.
    LocalSetup,
    /// Passive side: the accept (CM REP) went out and the connecting side
    /// never confirmed it (CM RTU).
    AwaitingEstablished,
}

impl std::fmt::Display for ConnectStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConnectStage::ResolveAddress => {
                "resolving the address (rdma_resolve_addr: no ARP answer from the peer?)"
            }
            ConnectStage::ResolveRoute => "resolving the route (rdma_resolve_route)",
            ConnectStage::AwaitingReply => {
                "waiting for the listener's reply to the connect request (the peer host is \
                 down, partitioned away or drops RoCE traffic on UDP 4791)"
            }
            ConnectStage::LocalSetup => {
                "setting up this side (the devices on the first connect, the queue pair)"
            }
            ConnectStage::AwaitingEstablished => {
                "waiting for the client to confirm the accept (CM RTU)"
            }
        })
    }
}

/// A process or device limit named by [`Error::ResourceLimit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Resource {
    /// Memory the process may pin (`RLIMIT_MEMLOCK`, `ulimit -l`); every
    /// memory region counts against it unless the process has
    /// `CAP_IPC_LOCK`.
    LockedMemory,
    /// File descriptors (`RLIMIT_NOFILE`, `ulimit -n`); a stream connection
    /// holds two.
    FileDescriptors,
    /// The device's queue pairs (`max_qp` in `ibv_devinfo -v`).
    QueuePairs,
    /// The device's completion queues (`max_cq`).
    CompletionQueues,
    /// The device's memory regions (`max_mr`).
    MemoryRegions,
    /// The device's memory windows (`max_mw`).
    MemoryWindows,
}

impl Resource {
    /// How to raise the limit, in one sentence.
    pub fn hint(self) -> &'static str {
        match self {
            Resource::LockedMemory => {
                "raise RLIMIT_MEMLOCK (`ulimit -l unlimited`, `LimitMEMLOCK=infinity` for a systemd unit, `memlock` in /etc/security/limits.conf, `--ulimit memlock=-1` for docker)"
            }
            Resource::FileDescriptors => {
                "raise RLIMIT_NOFILE (`ulimit -n 65536`, `LimitNOFILE=` for a systemd unit)"
            }
            Resource::QueuePairs
            | Resource::CompletionQueues
            | Resource::MemoryRegions
            | Resource::MemoryWindows => {
                "the device's own limit (`ibv_devinfo -v`): spread connections over more devices or processes"
            }
        }
    }
}

impl std::fmt::Display for Resource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Resource::LockedMemory => "locked memory (RLIMIT_MEMLOCK)",
            Resource::FileDescriptors => "file descriptors (RLIMIT_NOFILE)",
            Resource::QueuePairs => "device queue pairs",
            Resource::CompletionQueues => "device completion queues",
            Resource::MemoryRegions => "device memory regions",
            Resource::MemoryWindows => "device memory windows",
        })
    }
}

fn limit_text(resource: Resource, limit: Option<u64>) -> String {
    match (resource, limit) {
        (_, None) => "limit unknown".into(),
        (Resource::LockedMemory, Some(u64::MAX)) => "limit unlimited".into(),
        (Resource::LockedMemory, Some(b)) => format!("limit {b} bytes"),
        (_, Some(n)) => format!("limit {n}"),
    }
}

/// A copy of an `io::Error` that keeps its errno (or its kind and message).
pub(crate) fn clone_io(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

/// Clones keep every field; an `io::Error` source keeps its errno, or its
/// kind and message where it has none. A failed connection hands a clone
/// to each waiter.
impl Clone for Error {
    fn clone(&self) -> Self {
        match self {
            Error::LibraryUnavailable { library } => Error::LibraryUnavailable { library },
            Error::NoDevice => Error::NoDevice,
            Error::NoDeviceForAddress { addr } => Error::NoDeviceForAddress { addr: *addr },
            Error::DeviceNotFound { name } => Error::DeviceNotFound { name: name.clone() },
            Error::Verbs { op, source } => Error::Verbs {
                op,
                source: clone_io(source),
            },
            Error::ResourceLimit {
                resource,
                limit,
                op,
                source,
            } => Error::ResourceLimit {
                resource: *resource,
                limit: *limit,
                op,
                source: clone_io(source),
            },
            Error::Tcp { op, addr, source } => Error::Tcp {
                op,
                addr: addr.clone(),
                source: clone_io(source),
            },
            Error::FallbackFailed { addr, rdma, tcp } => Error::FallbackFailed {
                addr: addr.clone(),
                rdma: rdma.clone(),
                tcp: clone_io(tcp),
            },
            Error::HandshakeRejected {
                addr,
                reason,
                server_version,
            } => Error::HandshakeRejected {
                addr: *addr,
                reason: *reason,
                server_version: *server_version,
            },
            Error::Handshake(e) => Error::Handshake(e.clone()),
            Error::Protocol(e) => Error::Protocol(e.clone()),
            Error::Message(e) => Error::Message(e.clone()),
            Error::PeerAborted { code, reason } => Error::PeerAborted {
                code: *code,
                reason,
            },
            Error::TimedOut { addr, stage } => Error::TimedOut {
                addr: *addr,
                stage: *stage,
            },
            Error::Unreachable { addr, source } => Error::Unreachable {
                addr: *addr,
                source: clone_io(source),
            },
            Error::InvalidConfig {
                field,
                value,
                allowed,
            } => Error::InvalidConfig {
                field,
                value: *value,
                allowed,
            },
            Error::Pool(e) => Error::Pool(e.clone()),
            Error::ConnectionRefused { addr } => Error::ConnectionRefused { addr: *addr },
            Error::WorkCompletion { op, status } => Error::WorkCompletion {
                op,
                status: *status,
            },
            Error::RemoteAccess { op, status } => Error::RemoteAccess {
                op,
                status: *status,
            },
            Error::PeerDisconnected => Error::PeerDisconnected,
            Error::DeviceRemoved => Error::DeviceRemoved,
            Error::PortDown {
                device,
                port,
                after,
            } => Error::PortDown {
                device: device.clone(),
                port: *port,
                after: *after,
            },
            Error::QueuePairFatal { device, event } => Error::QueuePairFatal {
                device: device.clone(),
                event,
            },
            Error::WriteAfterShutdown => Error::WriteAfterShutdown,
            Error::PeerClosed => Error::PeerClosed,
            Error::NotConnected => Error::NotConnected,
            Error::LocalAbort => Error::LocalAbort,
            Error::LingerTimeout { timeout } => Error::LingerTimeout { timeout: *timeout },
            Error::KeepaliveTimeout { idle } => Error::KeepaliveTimeout { idle: *idle },
            Error::IncomingMessageMemory { len, source } => Error::IncomingMessageMemory {
                len: *len,
                source: source.clone(),
            },
            Error::NoAtomics { device } => Error::NoAtomics {
                device: device.clone(),
            },
            Error::AutoPortOnIwarp { addr } => Error::AutoPortOnIwarp { addr: addr.clone() },
            Error::InheritedAfterFork { op, parent } => Error::InheritedAfterFork {
                op,
                parent: *parent,
            },
            Error::Internal(s) => Error::Internal(s.clone()),
        }
    }
}

impl Clone for PoolError {
    fn clone(&self) -> Self {
        match self {
            PoolError::TooLarge { len, max_class } => PoolError::TooLarge {
                len: *len,
                max_class: *max_class,
            },
            PoolError::Exhausted {
                class,
                max_registered_bytes,
            } => PoolError::Exhausted {
                class: *class,
                max_registered_bytes: *max_registered_bytes,
            },
            PoolError::Registration { len, source } => PoolError::Registration {
                len: *len,
                source: clone_io(source),
            },
            PoolError::InvalidConfig { reason } => PoolError::InvalidConfig { reason },
            PoolError::EmptyRegion => PoolError::EmptyRegion,
            PoolError::Device(e) => PoolError::Device(e.clone()),
        }
    }
}

/// An error from the memory pool or from registering user memory.
///
/// `#[non_exhaustive]`. Converts into [`io::Error`] with a deliberate
/// [`io::ErrorKind`] (listed on each variant), keeping this value as the
/// source so callers can downcast it back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// `len` bytes were requested but the largest size class is `max_class`
    /// bytes ([`PoolConfig::max_class_size`](crate::pool::PoolConfig::max_class_size)).
    /// Maps to [`io::ErrorKind::InvalidInput`].
    #[error(
        "a buffer of {len} bytes is larger than the pool's largest size class ({max_class} bytes)"
    )]
    TooLarge {
        /// The requested length in bytes.
        len: usize,
        /// The largest size class in bytes.
        max_class: usize,
    },

    /// No free buffer of size class `class` bytes is left and registering
    /// another slab would exceed `max_registered_bytes`. Returned by
    /// [`MemoryPool::try_alloc`](crate::pool::MemoryPool::try_alloc) always, and by
    /// [`MemoryPool::alloc`](crate::pool::MemoryPool::alloc) under
    /// [`ExhaustedPolicy::Error`](crate::pool::ExhaustedPolicy::Error).
    /// Maps to [`io::ErrorKind::OutOfMemory`].
    #[error(
        "memory pool exhausted: no free {class}-byte buffer and {max_registered_bytes} bytes already registered"
    )]
    Exhausted {
        /// The size class (bytes) that had no free buffer.
        class: usize,
        /// The configured bound on registered bytes.
        max_registered_bytes: u64,
    },

    /// Registering `len` bytes as a memory region failed (`ibv_reg_mr`, or
    /// the heap allocation of a slab before it). Maps to the kind of `source`
    /// (for example `OutOfMemory` for `ENOMEM`).
    #[error("registering {len} bytes of memory failed: {source}")]
    Registration {
        /// The number of bytes that were to be registered.
        len: usize,
        /// The OS error reported.
        #[source]
        source: io::Error,
    },

    /// The [`PoolConfig`](crate::pool::PoolConfig) is inconsistent; `reason` says
    /// which rule it breaks. Maps to [`io::ErrorKind::InvalidInput`].
    #[error("invalid memory pool configuration: {reason}")]
    InvalidConfig {
        /// The rule the configuration breaks.
        reason: &'static str,
    },

    /// User memory of zero bytes cannot be registered (libibverbs rejects
    /// empty memory regions). Maps to [`io::ErrorKind::InvalidInput`].
    #[error("cannot register an empty memory region")]
    EmptyRegion,

    /// Opening the RDMA device for [`MemoryPool::for_device`](crate::pool::MemoryPool::for_device)
    /// failed. Maps to the kind of the inner error.
    #[error("opening the RDMA device for the memory pool failed: {0}")]
    Device(#[source] Box<crate::Error>),
}

impl PoolError {
    /// The [`io::ErrorKind`] this error maps onto.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            PoolError::TooLarge { .. }
            | PoolError::InvalidConfig { .. }
            | PoolError::EmptyRegion => io::ErrorKind::InvalidInput,
            PoolError::Exhausted { .. } => io::ErrorKind::OutOfMemory,
            PoolError::Registration { source, .. } => source.kind(),
            PoolError::Device(e) => e.kind(),
        }
    }
}

impl From<PoolError> for io::Error {
    fn from(err: PoolError) -> Self {
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

    #[test]
    fn a_device_without_atomics_is_unsupported_and_named() {
        let err: io::Error = Error::NoAtomics {
            device: "siw0".into(),
        }
        .into();
        assert_eq!(err.kind(), io::ErrorKind::Unsupported);
        assert_eq!(
            err.to_string(),
            "RDMA device siw0 has no atomic operations (atomic_cap NONE)"
        );
        let inner = Error::from_io(&err).expect("the crate's error");
        assert!(matches!(inner.clone(), Error::NoAtomics { device } if device == "siw0"));
    }

    #[test]
    fn clones_keep_the_errno_and_every_field() {
        let e = Error::Pool(PoolError::Registration {
            len: 65536,
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        });
        let c = e.clone();
        assert_eq!(c.kind(), io::ErrorKind::OutOfMemory);
        match c {
            Error::Pool(PoolError::Registration { len, source }) => {
                assert_eq!(len, 65536);
                assert_eq!(source.raw_os_error(), Some(libc::ENOMEM));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(e.to_string(), e.clone().to_string());
    }

    #[test]
    fn a_keepalive_timeout_is_timed_out_and_names_the_idle_time() {
        let e = Error::KeepaliveTimeout {
            idle: std::time::Duration::from_secs(30),
        };
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(
            e.to_string(),
            "keepalive: a probe was neither acknowledged nor failed within 30s (the queue pair \
             stopped making progress)"
        );
        let io: io::Error = e.clone().into();
        assert!(matches!(
            Error::from_io(&io),
            Some(Error::KeepaliveTimeout { idle }) if idle.as_secs() == 30
        ));
    }

    #[test]
    fn work_completion_kinds_follow_the_status_and_operation() {
        let wc = |op, status| Error::WorkCompletion { op, status }.kind();
        assert_eq!(wc("RDMA READ", 10), io::ErrorKind::InvalidData);
        assert_eq!(
            wc("RDMA WRITE WITH IMM", 10),
            io::ErrorKind::ConnectionReset
        );
        assert_eq!(wc("SEND", 12), io::ErrorKind::ConnectionReset);
        assert_eq!(wc("SEND", 13), io::ErrorKind::ConnectionReset);
        assert_eq!(wc("receive", 5), io::ErrorKind::ConnectionReset);
        assert_eq!(wc("SEND", 4), io::ErrorKind::ConnectionAborted);
        assert_eq!(Error::wc_status_name(12), "RETRY_EXC_ERR");
        assert_eq!(Error::wc_status_name(99), "unknown");
        let msg = Error::WorkCompletion {
            op: "RDMA READ",
            status: 10,
        }
        .to_string();
        assert_eq!(
            msg,
            "RDMA READ work request failed: ibv_wc_status 10 (REM_ACCESS_ERR, a remote \
             access error: the peer's memory key or range does not allow it)"
        );
    }

    #[test]
    fn from_io_and_find_reach_the_error_through_wrappers() {
        let io_err: io::Error = Error::PeerDisconnected.into();
        assert_eq!(io_err.kind(), io::ErrorKind::ConnectionReset);
        assert!(matches!(
            Error::from_io(&io_err),
            Some(Error::PeerDisconnected)
        ));
        // As hyper wraps it: an error whose source is the io::Error.
        #[derive(Debug)]
        struct Wrapper(io::Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let w = Wrapper(io_err);
        assert!(matches!(Error::find(&w), Some(Error::PeerDisconnected)));
        let plain = io::Error::other("not ours");
        assert!(Error::from_io(&plain).is_none());
        assert!(Error::find(&plain).is_none());
    }
}
