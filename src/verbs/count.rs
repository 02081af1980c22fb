//! Process-wide counts of the verbs objects this crate holds, for
//! [`crate::stats::resources`].
//!
//! Each object carries a [`Counted`] that adds itself on creation and
//! subtracts itself when dropped, so the counts are the live objects.

use std::sync::atomic::{AtomicU64, Ordering};

/// The verbs and rdma_cm objects this process holds through tokio-rdma
/// right now, from [`resources`](crate::stats::resources): every connection, listener, memory pool
/// and device it opened, all devices together.
///
/// A stream connection holds one QP, one CQ, one rdma_cm id, its receive
/// ring's memory region and memory window, and a send buffer's memory
/// region while it has unsent data (see the README's design notes); no
/// file descriptor of its own (see `shared_event_channels`). Each opened
/// device holds one PD for the process.
/// Compare with the device's limits (`ibv_devinfo -v`: `max_qp`, `max_cq`,
/// `max_mr`, `max_mw`) and with `RLIMIT_MEMLOCK` (`ulimit -l`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ResourceSnapshot {
    /// Queue pairs (`ibv_create_qp`).
    pub queue_pairs: u64,
    /// Completion queues (`ibv_create_cq`): one of its own per connection
    /// end, plus the shared ones (`shared_completion_queues`) that
    /// connections with `RdmaConfig::share_completion_queue` (and any
    /// connection once the process holds half the device's `max_cq` CQs of
    /// their own) take a seat on.
    pub completion_queues: u64,
    /// Completion channels (`ibv_create_comp_channel`; one fd each) held
    /// by connections: one per connection end with a CQ of its own among
    /// the first 64 live ones of the process (at most a sixteenth of
    /// `RLIMIT_NOFILE`). Every other CQ reports to its tokio runtime's
    /// completion channel for the device, counted in
    /// `shared_event_channels`.
    pub completion_channels: u64,
    /// Memory regions (`ibv_reg_mr`): receive rings, send buffers, pool
    /// slabs, registered user regions.
    pub memory_regions: u64,
    /// Bytes of all those memory regions (the lengths passed to
    /// `ibv_reg_mr`; the kernel pins whole pages, so at most 4095 bytes
    /// more per region).
    pub registered_bytes: u64,
    /// Type-2 memory windows (`ibv_alloc_mw`).
    pub memory_windows: u64,
    /// Protection domains (`ibv_alloc_pd`): one per opened device, plus one
    /// per stream on a device without memory windows.
    pub protection_domains: u64,
    /// rdma_cm ids (`rdma_create_id`, and one per connect request a
    /// listener received until it is accepted or rejected).
    pub cm_ids: u64,
    /// rdma_cm event channels (`rdma_create_event_channel`; one fd each)
    /// of listeners, one per listener. Connections hold none: their events
    /// go to one channel the whole process shares (counted in
    /// `shared_event_channels`).
    pub cm_event_channels: u64,
    /// Idle stream send buffers each opened device keeps registered for
    /// the next stream with data to send (included in `memory_regions` and
    /// `registered_bytes`; at most 4 MiB per device).
    pub idle_send_buffers: u64,
    /// Bytes of those idle send buffers (included in `registered_bytes`):
    /// a buffer is `send_buffer_size` long, or longer when its stream's
    /// send buffer had grown to the peer's ring.
    pub idle_send_buffer_bytes: u64,
    /// Event channels shared by connections (one fd each): the process's
    /// rdma_cm event channel (read by the `tokio-rdma-cm` thread, created
    /// on the first connect or accept, kept until the process exits), and
    /// one completion channel per tokio runtime and device (read by a task
    /// on that runtime, created with the runtime's first connection there,
    /// kept while the runtime or any CQ on it lives). They do not grow with
    /// the number of connections.
    pub shared_event_channels: u64,
    /// CQs shared by connections (included in `completion_queues`): each
    /// holds up to 16,384 entries (the device's `max_cqe` if smaller) and
    /// seats the QPs whose send plus receive depth, plus 16, fit in them:
    /// 60 stream ends with the default depths (129 + 128), 53 message
    /// endpoints. One is destroyed when the last connection on it closes.
    pub shared_completion_queues: u64,
}

/// The kinds of verbs and rdma_cm objects counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    QueuePair = 0,
    CompletionQueue = 1,
    CompletionChannel = 2,
    MemoryRegion = 3,
    MemoryWindow = 4,
    ProtectionDomain = 5,
    CmId = 6,
    CmEventChannel = 7,
    /// A stream send buffer kept registered for reuse (also counted as a
    /// memory region).
    IdleSendBuffer = 8,
    /// An event channel shared by connections: the process's rdma_cm
    /// channel, a runtime's completion channel on a device.
    SharedChannel = 9,
    /// A CQ shared by connections (also counted as a completion queue).
    SharedCompletionQueue = 10,
}

const KINDS: usize = 11;

static LIVE: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];
static REGISTERED_BYTES: AtomicU64 = AtomicU64::new(0);
static IDLE_SEND_BUFFER_BYTES: AtomicU64 = AtomicU64::new(0);

/// One live object of `kind` (and, for a memory region, its bytes).
#[derive(Debug)]
pub(crate) struct Counted {
    kind: Kind,
    bytes: u64,
}

impl Counted {
    /// Counts one object of `kind`.
    pub(crate) fn new(kind: Kind) -> Counted {
        LIVE[kind as usize].fetch_add(1, Ordering::Relaxed);
        Counted { kind, bytes: 0 }
    }

    /// Counts one idle send buffer of `bytes` bytes kept for reuse (its
    /// memory region is counted apart).
    pub(crate) fn idle_send_buffer(bytes: usize) -> Counted {
        let bytes = bytes as u64;
        IDLE_SEND_BUFFER_BYTES.fetch_add(bytes, Ordering::Relaxed);
        LIVE[Kind::IdleSendBuffer as usize].fetch_add(1, Ordering::Relaxed);
        Counted {
            kind: Kind::IdleSendBuffer,
            bytes,
        }
    }

    /// Counts one memory region of `bytes` bytes.
    pub(crate) fn memory_region(bytes: usize) -> Counted {
        let bytes = bytes as u64;
        REGISTERED_BYTES.fetch_add(bytes, Ordering::Relaxed);
        LIVE[Kind::MemoryRegion as usize].fetch_add(1, Ordering::Relaxed);
        Counted {
            kind: Kind::MemoryRegion,
            bytes,
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        LIVE[self.kind as usize].fetch_sub(1, Ordering::Relaxed);
        let bytes = match self.kind {
            Kind::IdleSendBuffer => &IDLE_SEND_BUFFER_BYTES,
            _ => &REGISTERED_BYTES,
        };
        bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Live objects of `kind` in this process now.
pub(crate) fn live(kind: Kind) -> u64 {
    LIVE[kind as usize].load(Ordering::Relaxed)
}

/// The counts now.
pub(crate) fn snapshot() -> ResourceSnapshot {
    let live = |k: Kind| LIVE[k as usize].load(Ordering::Relaxed);
    ResourceSnapshot {
        queue_pairs: live(Kind::QueuePair),
        completion_queues: live(Kind::CompletionQueue),
        completion_channels: live(Kind::CompletionChannel),
        memory_regions: live(Kind::MemoryRegion),
        registered_bytes: REGISTERED_BYTES.load(Ordering::Relaxed),
        memory_windows: live(Kind::MemoryWindow),
        protection_domains: live(Kind::ProtectionDomain),
        cm_ids: live(Kind::CmId),
        cm_event_channels: live(Kind::CmEventChannel),
        idle_send_buffers: live(Kind::IdleSendBuffer),
        idle_send_buffer_bytes: IDLE_SEND_BUFFER_BYTES.load(Ordering::Relaxed),
        shared_event_channels: live(Kind::SharedChannel),
        shared_completion_queues: live(Kind::SharedCompletionQueue),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tests that count objects run one at a time.
    pub(super) static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn counts_follow_the_objects() {
        // Other tests of this binary create no verbs objects (there is no
        // device on the host), and the ones that count run one at a time,
        // so the deltas are exact.
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let before = snapshot();
        let qp = Counted::new(Kind::QueuePair);
        let mr = Counted::memory_region(65536);
        let mr2 = Counted::memory_region(4096);
        let now = snapshot();
        assert_eq!(now.queue_pairs, before.queue_pairs + 1);
        assert_eq!(now.memory_regions, before.memory_regions + 2);
        assert_eq!(now.registered_bytes, before.registered_bytes + 69632);
        drop(mr);
        assert_eq!(snapshot().registered_bytes, before.registered_bytes + 4096);
        let idle = Counted::idle_send_buffer(131072);
        let now = snapshot();
        assert_eq!(now.idle_send_buffers, before.idle_send_buffers + 1);
        assert_eq!(
            now.idle_send_buffer_bytes,
            before.idle_send_buffer_bytes + 131072
        );
        assert_eq!(now.registered_bytes, before.registered_bytes + 4096);
        drop((qp, mr2, idle));
        assert_eq!(snapshot(), before);
    }
}

/// The device limits [`classify`] compares the live counts with
/// (`ibv_device_attr`; 0 where unknown).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DeviceLimits {
    pub max_qp: u64,
    pub max_cq: u64,
    pub max_mr: u64,
    pub max_mw: u64,
}

/// The soft limit of `resource` for this process (`getrlimit`);
/// `u64::MAX` for unlimited, `None` if it cannot be read.
pub(crate) fn rlimit(resource: libc::__rlimit_resource_t) -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit for the call's duration.
    let ok = unsafe { libc::getrlimit(resource, &mut r) } == 0;
    let cur = if r.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        r.rlim_cur
    };
    ok.then_some(cur)
}

/// The error for a failed creation of `kind` by `op`: a typed
/// [`Error::ResourceLimit`] when the errno says a process or device limit
/// was reached, [`Error::Verbs`] otherwise.
///
/// `EMFILE`/`ENFILE` are file descriptors. `ENOMEM` from `ibv_reg_mr` is
/// the device's `max_mr` when that many regions are live, else
/// `RLIMIT_MEMLOCK` (the usual cause). `ENOMEM`, `ENOSPC` or `EINVAL` from
/// creating a QP, CQ or window is the device's limit when that many are
/// live; otherwise the errno stands as it is.
pub(crate) fn classify(
    op: &'static str,
    kind: Kind,
    limits: &DeviceLimits,
    source: std::io::Error,
) -> crate::error::Error {
    use crate::error::{Error, Resource};
    let errno = source.raw_os_error();
    let live = LIVE[kind as usize].load(Ordering::Relaxed);
    let device =
        |resource: Resource, max: u64| (max > 0 && live >= max).then_some((resource, Some(max)));
    let found = match (errno, kind) {
        (Some(libc::EMFILE | libc::ENFILE), _) => {
            Some((Resource::FileDescriptors, rlimit(libc::RLIMIT_NOFILE)))
        }
        (Some(libc::ENOMEM | libc::EAGAIN), Kind::MemoryRegion) => {
            device(Resource::MemoryRegions, limits.max_mr)
                .or(Some((Resource::LockedMemory, rlimit(libc::RLIMIT_MEMLOCK))))
        }
        (Some(libc::ENOMEM | libc::ENOSPC | libc::EINVAL), Kind::QueuePair) => {
            device(Resource::QueuePairs, limits.max_qp)
        }
        (Some(libc::ENOMEM | libc::ENOSPC | libc::EINVAL), Kind::CompletionQueue) => {
            device(Resource::CompletionQueues, limits.max_cq)
        }
        (Some(libc::ENOMEM | libc::ENOSPC | libc::EINVAL), Kind::MemoryWindow) => {
            device(Resource::MemoryWindows, limits.max_mw)
        }
        _ => None,
    };
    match found {
        Some((resource, limit)) => Error::ResourceLimit {
            resource,
            limit,
            op,
            source,
        },
        None => Error::Verbs { op, source },
    }
}

#[cfg(test)]
mod classify_tests {
    use super::*;
    use crate::error::{Error, Resource};
    use std::io;

    fn os(code: i32) -> io::Error {
        io::Error::from_raw_os_error(code)
    }

    #[test]
    fn errnos_become_typed_resource_errors() {
        let limits = DeviceLimits {
            max_qp: 1,
            max_cq: 1,
            max_mr: 1 << 40,
            max_mw: 1,
        };
        let memlock = rlimit(libc::RLIMIT_MEMLOCK);
        match classify("ibv_reg_mr", Kind::MemoryRegion, &limits, os(libc::ENOMEM)) {
            Error::ResourceLimit {
                resource: Resource::LockedMemory,
                limit,
                op: "ibv_reg_mr",
                source,
            } => {
                assert_eq!(limit, memlock);
                assert_eq!(source.raw_os_error(), Some(libc::ENOMEM));
            }
            other => panic!("{other:?}"),
        }
        let e = classify(
            "ibv_create_comp_channel",
            Kind::CompletionChannel,
            &limits,
            os(libc::EMFILE),
        );
        assert!(
            matches!(e, Error::ResourceLimit { resource: Resource::FileDescriptors, limit, .. } if limit == rlimit(libc::RLIMIT_NOFILE)),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.starts_with(
                "ibv_create_comp_channel failed: file descriptors (RLIMIT_NOFILE) exhausted"
            ),
            "{text}"
        );
        assert!(text.contains("ulimit -n"), "{text}");
        assert_eq!(io::Error::from(e).raw_os_error(), None);

        // One QP live against a device limit of 1: the device's limit.
        let _serial = super::tests::SERIAL
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let _qp = Counted::new(Kind::QueuePair);
        let e = classify("ibv_create_qp", Kind::QueuePair, &limits, os(libc::ENOMEM));
        assert!(
            matches!(
                e,
                Error::ResourceLimit {
                    resource: Resource::QueuePairs,
                    limit: Some(1),
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "ibv_create_qp failed: device queue pairs exhausted (limit 1): {}; {}",
                os(libc::ENOMEM),
                Resource::QueuePairs.hint()
            )
        );
        // Below the device's limit an errno is not guessed at.
        let roomy = DeviceLimits {
            max_qp: 1 << 20,
            ..limits
        };
        assert!(matches!(
            classify("ibv_create_qp", Kind::QueuePair, &roomy, os(libc::EINVAL)),
            Error::Verbs {
                op: "ibv_create_qp",
                ..
            }
        ));
        assert!(matches!(
            classify("ibv_reg_mr", Kind::MemoryRegion, &limits, os(libc::EFAULT)),
            Error::Verbs {
                op: "ibv_reg_mr",
                ..
            }
        ));
    }
}
