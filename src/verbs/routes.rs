//! The hand-off of rdma_cm events from the process's one event thread to
//! the task that waits for its id's events ([`Routes`]).
//!
//! Kept free of verbs so that `tests/loom_cm_routes.rs` compiles this file
//! with loom's `Mutex` and atomics (through `super::routes_sync`) and
//! checks every interleaving of registering, routing, unregistering and a
//! receiver going away.

use std::collections::HashMap;

use super::routes_sync::{AtomicU64, Mutex, Ordering};

/// An id's queue, as the event thread sees it: `push` hands one event over
/// and is false when the receiving side is gone.
pub(crate) trait Queue<E> {
    /// Hands `ev` to the receiver; false if it is gone.
    fn push(&self, ev: E) -> bool;
}

impl<E> Queue<E> for tokio::sync::mpsc::UnboundedSender<E> {
    fn push(&self, ev: E) -> bool {
        self.send(ev).is_ok()
    }
}

/// The queue of each id on the shared channel, by token: the hand-off from
/// the event thread to the task that waits for its id's events. A token
/// is registered before its id exists (so no event can come before it) and
/// never reused; an event for a token no longer registered (its id was
/// destroyed, which waits for the ack of each of its events) is dropped
/// and counted.
pub(crate) struct Routes<Q> {
    map: Mutex<HashMap<u64, Q>>,
    next_token: AtomicU64,
    /// Events whose token had no queue.
    unrouted: AtomicU64,
}

impl<Q> Routes<Q> {
    pub(crate) fn new() -> Routes<Q> {
        Routes {
            map: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            unrouted: AtomicU64::new(0),
        }
    }

    /// A fresh token (never reused) whose events go to `queue`.
    pub(crate) fn register(&self, queue: Q) -> u64 {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, queue);
        token
    }

    /// `token`'s queue goes; its later events are counted as unrouted.
    pub(crate) fn unregister(&self, token: u64) {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&token);
    }

    /// Hands `ev` to `token`'s queue; false (and counted) when the token
    /// has none any more, or its receiver is gone.
    pub(crate) fn route<E>(&self, token: u64, ev: E) -> bool
    where
        Q: Queue<E>,
    {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let sent = map.get(&token).is_some_and(|q| q.push(ev));
        drop(map);
        if !sent {
            self.unrouted.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(token, "rdma_cm event for an id that is gone; dropped");
        }
        sent
    }

    /// Tokens registered now.
    #[cfg(test)]
    pub(crate) fn registered(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Events dropped so far because their token had no queue.
    #[cfg(test)]
    pub(crate) fn unrouted(&self) -> u64 {
        self.unrouted.load(Ordering::Relaxed)
    }
}
