//! The verbs layer: the only code in the crate that calls libibverbs and
//! librdmacm.
//!
//! Built on [`sideway`] 0.4 for devices, protection domains (PD), completion
//! queues (CQ), queue pairs (QP) and memory regions (MR); `rdma-mummy-sys`
//! (the FFI crate under sideway) is used directly only where sideway has no
//! call: completion-event arm/get/ack and the rdma_cm calls that carry
//! private data. Both load `libibverbs.so.1`/`librdmacm.so.1` with `dlopen`
//! at run time, so a binary starts on a host without RDMA and reports
//! [`Error::NoDevice`](crate::Error::NoDevice) or
//! [`Error::LibraryUnavailable`](crate::Error::LibraryUnavailable) instead of
//! failing to link.
//!
//! Every `unsafe` block in this module carries a `SAFETY:` comment.

/// The errno of a failed verbs object creation (sideway wraps libibverbs'
/// `io::Error` in a kind enum whose `Display` is transparent but whose
/// source chain skips it), so `EMFILE` (out of file descriptors) or
/// `ENOMEM` survive as such. Defined before the modules that use it
/// (`events`, `rc`).
macro_rules! errno_of {
    ($e:expr, $kind:path) => {
        match $e.0 {
            $kind(io) => io,
            #[allow(unreachable_patterns)]
            other => std::io::Error::other(other),
        }
    };
}

pub(crate) mod cm;
pub(crate) mod count;
pub mod device;
pub(crate) mod events;
#[allow(unsafe_code)]
pub(crate) mod fork;
pub(crate) mod ledger;
#[allow(unsafe_code)]
pub(crate) mod mw;
pub(crate) mod rc;
pub(crate) mod routes;
pub(crate) mod tasks;
#[allow(unsafe_code)]
pub(crate) mod watch;

pub use device::{
    Device, DeviceAddress, Gid, GidType, LinkLayer, Port, PortState, devices, select_device,
};

/// The synchronisation [`routes`] is built on: std's here, loom's in
/// `tests/loom_cm_routes.rs`, which compiles that file on its own.
mod routes_sync {
    pub(crate) use std::sync::Mutex;
    pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
}
