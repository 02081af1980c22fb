//! Process-wide counts of the verbs objects this crate holds, for
//! [`crate::stats::resources`].
//!
//! Each object carries a [`Counted`] that adds itself on creation and
//! subtracts itself when dropped, so the counts are the live objects.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::stats::ResourceSnapshot;

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
}

const KINDS: usize = 9;

static LIVE: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];
static REGISTERED_BYTES: AtomicU64 = AtomicU64::new(0);

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
        REGISTERED_BYTES.fetch_sub(self.bytes, Ordering::Relaxed);
    }
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_the_objects() {
        // Other tests of this binary create no verbs objects (there is no
        // device on the host), so the deltas are exact.
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
        drop((qp, mr2));
        assert_eq!(snapshot(), before);
    }
}
