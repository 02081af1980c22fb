//! The per-endpoint quota on the shared pool: how many bytes one message
//! endpoint may hold for incoming messages (rendezvous destinations being
//! read, and complete ones the application has not taken) before its
//! further destinations wait. Pure bookkeeping, host-tested.

use std::collections::HashMap;

/// Bytes held per destination token, against a bound.
#[derive(Debug)]
pub(crate) struct Quota {
    limit: u64,
    held: HashMap<u64, u64>,
    total: u64,
    blocked: bool,
    stalls: u64,
}

impl Quota {
    /// A quota of `limit` bytes (at least 1).
    pub(crate) fn new(limit: u64) -> Quota {
        Quota {
            limit: limit.max(1),
            held: HashMap::new(),
            total: 0,
            blocked: false,
            stalls: 0,
        }
    }

    /// Whether a destination of `len` bytes may be allocated now: always
    /// when nothing is held (so a message larger than the quota is still
    /// admitted), else only within the limit. A refusal starts a stall
    /// (counted once until the next admission).
    pub(crate) fn admit(&mut self, len: u64) -> bool {
        if self.total > 0 && self.total.saturating_add(len) > self.limit {
            if !self.blocked {
                self.blocked = true;
                self.stalls += 1;
            }
            return false;
        }
        self.blocked = false;
        true
    }

    /// Destination `token` of `bytes` was allocated.
    pub(crate) fn hold(&mut self, token: u64, bytes: u64) {
        if let Some(old) = self.held.insert(token, bytes) {
            self.total -= old;
        }
        self.total += bytes;
    }

    /// Destination `token` left the endpoint (taken or released).
    pub(crate) fn release(&mut self, token: u64) {
        if let Some(b) = self.held.remove(&token) {
            self.total -= b;
        }
    }

    /// Bytes held now.
    pub(crate) fn held(&self) -> u64 {
        self.total
    }

    /// Blocked periods so far.
    pub(crate) fn stalls(&self) -> u64 {
        self.stalls
    }
}

#[cfg(test)]
mod tests {
    use super::Quota;

    #[test]
    fn holds_up_to_the_limit_and_counts_each_stall_once() {
        let mut q = Quota::new(8 << 20);
        // Nothing held: even a message above the quota is admitted.
        assert!(q.admit(16 << 20));
        q.hold(1, 16 << 20);
        assert_eq!(q.held(), 16 << 20);
        assert!(!q.admit(4096));
        assert!(!q.admit(4096));
        assert_eq!(q.stalls(), 1, "one blocked period");
        q.release(1);
        assert_eq!(q.held(), 0);
        assert!(q.admit(4 << 20));
        q.hold(2, 4 << 20);
        assert!(q.admit(4 << 20), "exactly at the limit");
        q.hold(3, 4 << 20);
        assert_eq!(q.held(), 8 << 20);
        assert!(!q.admit(1));
        assert_eq!(q.stalls(), 2);
        q.release(2);
        q.release(2); // twice: no effect
        q.release(99); // unknown: no effect
        assert_eq!(q.held(), 4 << 20);
        assert!(q.admit(4 << 20));
    }
}
