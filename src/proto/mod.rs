//! The sans-IO protocol core: handshake encoding and the stream state
//! machine. No I/O, no clock, no `unsafe`; driven by the runtime layer and
//! tested deterministically in memory.
//!
//! - [`handshake`]: the [`Hello`] exchanged in rdma_cm private data (where
//!   each side's receive ring is) and the reject message.
//! - [`imm`]: the 32-bit immediate data of every RDMA WRITE WITH IMMEDIATE
//!   (DATA, CREDIT, FIN, ABORT).
//! - [`stream`]: [`StreamCore`], the byte-stream state machine (ring
//!   cursors, credits, selective signaling, half-close, abort), with the
//!   argument for why its credit scheme cannot deadlock.
//! - [`sendq`]: [`SendQueue`](sendq::SendQueue), the posted work requests
//!   and selective signaling both state machines share.
//! - [`message`]: [`MessageCore`], the zero-copy message state machine
//!   (eager sends, rendezvous by RDMA READ, in-order delivery, credits,
//!   abort), with its own deadlock argument.
//! - [`error`]: [`ProtocolError`] (the peer broke the protocol) and
//!   [`WriteError`] (why a write is refused).
//!
//! Nothing here panics on input from the peer: every malformed handshake or
//! message is a typed error.
//!
//! The core is internal to the crate (its types change with the runtime);
//! what a user can meet of it, the error and statistics types, is re-exported
//! from [`crate::error`] and [`crate::message`]. Accessors only the
//! in-memory tests read are compiled for them alone (`#[cfg(test)]`).
#![forbid(unsafe_code)]

pub mod error;
pub mod handshake;
pub mod imm;
pub mod message;
pub mod sendq;
pub mod stream;

#[cfg(test)]
mod message_tests;
#[cfg(test)]
mod tests;

pub use error::{ProtocolError, WriteError};
