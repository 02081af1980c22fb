//! The connection core shared by both endpoint kinds (byte streams and
//! message endpoints):
//! - [`setup`]: the rdma_cm handshake, active and passive, with what a kind
//!   adds to it behind the [`Setup`](setup::Setup) trait;
//! - [`listener`]: the listening id, its backlog and the background task that
//!   runs handshakes so `accept` is cancel-safe;
//! - [`shared`]: the connection behind one mutex, its handles, the
//!   [`Driven`](shared::Driven) trait a kind's state implements, the one
//!   driver loop (completions, rdma_cm events, linger, teardown) and the
//!   waiter lists that a failure wakes all at once.
//!
//! `stream/` and `message/` hold only what differs between the kinds.

pub(crate) mod listener;
pub(crate) mod setup;
pub(crate) mod shared;
pub(crate) mod spin;

pub(crate) use listener::Listener;
pub(crate) use setup::{Established, Setup, connect_any, device_caps};
pub(crate) use shared::{Driven, Handle, Started, WakerList, start};
pub(crate) use spin::SpinWait;
