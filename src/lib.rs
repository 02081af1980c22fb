//! # tokio-rdma
//!
//! RDMA reliable-connected (RC) queue pairs (InfiniBand, RoCE) for tokio
//! programs: [`RdmaStream`]/[`RdmaListener`] behave like tokio's
//! `TcpStream`/`TcpListener`, so hyper, tonic, tokio-util codecs and
//! tokio-rustls run over them unchanged; [`MessageEndpoint`]/[`MessageListener`]
//! move messages between buffers of a shared [`MemoryPool`] of registered
//! memory without copying; [`remote`] grants a peer a window on your
//! memory and reads, writes and atomically updates what a peer granted
//! you (one-sided RDMA); [`transport`] switches between `rdma://` and
//! `tcp://` by address.
//!
//! Layers, bottom up (see [`guide::design`]):
//! - [`verbs`]: the only code that calls libibverbs/librdmacm (through
//!   `sideway` and `rdma-mummy-sys`): devices, PDs, CQs, QPs, MRs, rdma_cm.
//!   It imports nothing above it but the error type.
//! - `proto` (internal): the sans-IO protocol core (handshake, stream and
//!   message state machines): no I/O, no clock, no `unsafe`. Its error and
//!   statistics types are public through [`error`] and [`message`].
//! - [`pool`]: registered memory shared by the connections on a device.
//! - `conn` (internal): the connection core both endpoint kinds run on:
//!   connect/accept, the listener, handles, one driver task per connection,
//!   errors that reach every waiter.
//! - the kind runtimes (`stream`, [`message`]): only what differs between a
//!   byte stream and a message endpoint.
//! - [`transport`]: the `tcp://`/`rdma://`/`auto://` switch and its
//!   hyper/axum/tonic integrations.
//!
//! # Errors
//!
//! Errors are one [`Error`] enum that converts into [`std::io::Error`] with a
//! deliberate [`std::io::ErrorKind`]. Which type a function returns:
//! - streams, listeners, message endpoints and the transport switch (what
//!   tokio code awaits) return **`std::io::Result`**, which rustdoc shows as
//!   `Result<T>`; the `io::Error`'s payload is an [`Error`] (TCP failures of
//!   the switch included: [`Error::Tcp`]), reached with
//!   [`Error::from_io`], or [`Error::find`] through hyper's and tonic's
//!   wrappers;
//!   A string that is not a transport address is `InvalidInput` whose
//!   payload is an [`transport::AddrParseError`] instead; a failed
//!   `transport::channel` carries tonic's error, inside which
//!   [`Error::find`] reaches ours;
//! - device queries and config checks return `Result<T, Error>` (this
//!   crate's [`Error`]; [`error::Result`] is that alias);
//! - the pool returns `Result<T, PoolError>` ([`pool::PoolError`]).
//!
//! The crate has no `Result` alias at its root, so a bare `Result<T>` in
//! these pages is always `std::io::Result<T>`.
#![warn(missing_docs)]
#![deny(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod config;
mod conn;
pub mod error;
pub mod guide;
pub mod message;
#[allow(unsafe_code)]
pub mod pool;
pub(crate) mod proto;
#[allow(unsafe_code)]
pub mod remote;
pub mod stats;
mod stream;
pub mod transport;
#[allow(unsafe_code)]
pub mod verbs;

pub use config::{RdmaConfig, WaitStrategy};
pub use error::Error;
pub use message::{Incoming, MessageConfig, MessageEndpoint, MessageListener};
pub use pool::{MemoryPool, OutgoingMessage, PoolBuf, PoolBytes};
pub use stats::{ConnectionStats, RemoteAccess, ResourceSnapshot};
pub use stream::{
    OwnedReadHalf, OwnedWriteHalf, RdmaListener, RdmaStream, ReadHalf, ReuniteError, WriteHalf,
};

/// Hooks for the guest test suite, compiled only with `--cfg tokio_rdma_guest`
/// (set by `scripts/test`, never by a Cargo feature); not an API.
#[cfg(tokio_rdma_guest)]
#[doc(hidden)]
pub mod __testing {
    use std::net::SocketAddr;

    /// Sends an rdma_cm connect request carrying `private_data` verbatim
    /// (for example a bad handshake) and reports how the server answered.
    pub async fn connect_with_private_data(
        addr: SocketAddr,
        private_data: &[u8],
    ) -> crate::error::Result<()> {
        crate::conn::setup::raw_connect(addr, private_data).await
    }

    /// Makes `endpoint` announce a rendezvous of `len` bytes at `addr` with
    /// `rkey`, memory it does not own (a misbehaving peer).
    pub fn send_forged_rts(
        endpoint: &crate::MessageEndpoint,
        len: u64,
        addr: u64,
        rkey: u32,
    ) -> std::io::Result<()> {
        endpoint.forge_rts(len, addr, rkey)
    }

    pub use crate::message::PostedSge;

    /// The SGE of the last SEND with payload or READ `endpoint` posted
    /// (for zero-copy checks).
    pub fn last_posted_sge(endpoint: &crate::MessageEndpoint) -> Option<PostedSge> {
        endpoint.last_posted_sge()
    }

    /// The last memory window `endpoint` bound for a rendezvous it sent:
    /// (address, length, key).
    pub fn last_window(endpoint: &crate::MessageEndpoint) -> Option<(u64, u64, u32)> {
        endpoint.last_window()
    }

    /// The address of `stream`'s receive ring (the one its peer writes
    /// now, after any growth) and the key it announced to its peer.
    pub fn ring_key(stream: &crate::RdmaStream) -> (u64, u32) {
        stream.ring_key()
    }

    /// A view of `stream`'s connection that does not keep it open, for
    /// printing what a stream that stopped moving holds and waits on.
    pub fn probe(stream: &crate::RdmaStream) -> StreamProbe {
        StreamProbe(stream.debug_probe())
    }

    /// See [`probe`].
    pub struct StreamProbe(std::sync::Weak<crate::stream::DebugConn>);

    impl StreamProbe {
        /// The connection's state in words (queue pair state as queried,
        /// the protocol core, waiters, counters); `None` once the
        /// connection is gone.
        pub fn dump(&self) -> Option<String> {
            self.0.upgrade().map(|c| crate::stream::debug_state(&c))
        }
    }

    /// Makes `stream` post an RDMA WRITE WITH IMM of `len` bytes to
    /// `addr`/`rkey` at its peer (memory it was never granted).
    pub fn forge_ring_write(
        stream: &crate::RdmaStream,
        addr: u64,
        rkey: u32,
        len: u32,
    ) -> std::io::Result<()> {
        stream.forge_ring_write(addr, rkey, len)
    }
}
