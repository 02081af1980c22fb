//! Guides: how to use the crate beyond the README's quick start, and how
//! it is built. Each page is also a markdown file under `src/guide/`.

/// Moving a TCP service: the address switch, hyper, axum and tonic.
///
#[doc = include_str!("migration.md")]
pub mod migration {}

/// TCP parity: what shutdown, drop and close wait for; dead peers; connecting.
///
#[doc = include_str!("tcp_parity.md")]
pub mod tcp_parity {}

/// Errors: the `io::Error` payload, the variants, the TCP side.
///
#[doc = include_str!("errors.md")]
pub mod errors {}

/// Configuration and tuning: waiting, rings, message flow control, many connections.
///
#[doc = include_str!("tuning.md")]
pub mod tuning {}

/// Requirements, connection setup costs and failure modes.
///
#[doc = include_str!("setup.md")]
pub mod setup {}

/// On real hardware: trying the examples, tuning the wait on a NIC.
///
#[doc = include_str!("hardware.md")]
pub mod hardware {}

/// The Soft-RoCE guest, the main job (`scripts/demo`) and the test suite.
///
#[doc = include_str!("softroce.md")]
pub mod softroce {}

/// The programs under `examples/` and what each shows.
///
#[doc = include_str!("examples.md")]
pub mod examples {}

/// Design notes: layers, protocols, completion events, memory ownership.
///
#[doc = include_str!("design.md")]
pub mod design {}

/// Architecture: the layers, which module may use which, the path of a
/// stream write and of a message function by function, where `unsafe`
/// lives and why.
///
#[doc = include_str!("architecture.md")]
pub mod architecture {}
