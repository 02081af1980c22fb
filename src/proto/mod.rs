//! The sans-IO protocol core: handshake encoding and the stream state
//! machine. No I/O, no clock, no `unsafe`; driven by the runtime layer and
//! tested deterministically in memory.
#![forbid(unsafe_code)]

pub mod error;
pub mod handshake;
pub mod imm;
pub mod stream;

#[cfg(test)]
mod tests;

pub use error::{ProtocolError, WriteError};
pub use handshake::{EndpointKind, HandshakeError, Hello, RejectReason};
pub use imm::Imm;
pub use stream::{RecvEvent, StreamCore, StreamParams, StreamStats, Transmit, TransmitKind};
