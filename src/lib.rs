//! # tokio-rdma
//!
//! RDMA reliable-connected (RC) queue pairs (InfiniBand, RoCE) for tokio
//! programs.
//!
//! Layers, bottom up (see the README's design notes):
//! - [`verbs`]: the only code that calls libibverbs/librdmacm (through
//!   `sideway`); device, port and GID discovery.
//! - [`proto`]: the sans-IO protocol core: no I/O, no clock, no `unsafe`.
//!
//! Errors are one [`Error`] enum that converts into [`std::io::Error`] with a
//! deliberate [`std::io::ErrorKind`].
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod error;
pub mod proto;
#[allow(unsafe_code)]
pub mod verbs;

pub use error::{Error, Result};
