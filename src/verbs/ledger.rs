//! The ledger of posted work: which memory each work request (WR) on a
//! send queue may still make the NIC read or write, held until the NIC is
//! done with it.
//!
//! A WR names memory by scatter/gather elements (SGEs). From the post until
//! the WR's completion the NIC may read that memory (a SEND's payload, an
//! RDMA WRITE's source) or write it (an RDMA READ's destination), whatever
//! the program decided in the meantime: an aborted message, a dropped
//! future, a receiver that gave a destination up. So the owner of such
//! memory (a pool buffer, a message) cannot be freed when the program gives
//! it up, only when the WRs that name it are done:
//!
//! - **completion**: a send-queue completion of a WR means that WR and
//!   every WR posted before it on the same send queue are done (a reliable
//!   connected QP completes its send queue in order: IBTA vol. 1, 10.8.3 and
//!   11.4.1.1; with selective signaling only some WRs report, and their
//!   completion covers the unsignaled ones before them);
//! - **flush**: after the QP reached the error state every outstanding WR
//!   completes with `IBV_WC_WR_FLUSH_ERR`, which is a completion like any
//!   other here: the NIC no longer touches its memory;
//! - **QP destruction**: whatever the ledger still holds is freed after
//!   the QP is destroyed; its owner places the ledger after the QP (field
//!   order) for that.
//!
//! Giving an owner up ([`Ledger::release`]) never frees memory a WR still
//! names: the ledger keeps it ("retired") until the last such WR is done.
//! Abort and reclaim in the protocol core only mark; this is where memory
//! is actually let go.
//!
//! The ledger is plain data (no verbs call, no `unsafe`): the QP adapter
//! that posts records each WR here right after posting it (all of a batch,
//! partial posts included) and reports each completion.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// What a posted send-queue WR does to the memory its SGE names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PostedOp {
    /// SEND (with or without immediate data): the NIC reads the SGE.
    Send,
    /// RDMA READ: the NIC writes the SGE (the local destination).
    Read,
    /// RDMA WRITE: the NIC reads the SGE (the local source).
    Write,
    /// ATOMIC compare-and-swap or fetch-and-add: the NIC writes the
    /// original value into the SGE (8 bytes).
    Atomic,
}

/// One posted WR not known complete.
#[derive(Debug)]
struct Posted<K> {
    wr_id: u64,
    op: PostedOp,
    /// The owner of the memory the WR's SGE names (`None`: no SGE, inline
    /// data, or memory the QP itself owns for its whole life).
    pin: Option<K>,
}

/// The posted WRs of one send queue and the owners whose memory they name,
/// keyed by `K` (a token of the runtime).
///
/// An owner `O` given up while pinned is kept until its last WR completes
/// (or the ledger is dropped, after the QP).
pub(crate) struct Ledger<K, O> {
    /// Posted WRs not known complete, in post order.
    posted: VecDeque<Posted<K>>,
    /// Outstanding WRs per owner that some WR names.
    pins: HashMap<K, u32>,
    /// Owners given up while a WR still names their memory.
    retired: HashMap<K, O>,
}

impl<K: Copy + Eq + Hash, O> Default for Ledger<K, O> {
    fn default() -> Self {
        Ledger {
            posted: VecDeque::new(),
            pins: HashMap::new(),
            retired: HashMap::new(),
        }
    }
}

impl<K: Copy + Eq + Hash, O> Ledger<K, O> {
    /// Records a WR just posted (or handed to a post call that failed part
    /// way: the NIC may have taken it, so it counts as posted until a later
    /// completion or the QP's destruction). `pin` names the owner of the
    /// memory its SGE names.
    pub(crate) fn record(&mut self, wr_id: u64, op: PostedOp, pin: Option<K>) {
        if let Some(key) = pin {
            *self.pins.entry(key).or_insert(0) += 1;
        }
        self.posted.push_back(Posted { wr_id, op, pin });
    }

    /// What WR `wr_id` does, if it is posted and not known complete.
    pub(crate) fn op(&self, wr_id: u64) -> Option<PostedOp> {
        self.posted.iter().find(|p| p.wr_id == wr_id).map(|p| p.op)
    }

    /// Whether a posted WR not known complete names `key`'s memory.
    pub(crate) fn pinned(&self, key: K) -> bool {
        self.pins.contains_key(&key)
    }

    /// The holder gives `owner` (of `key`) up. Returns it if no posted WR
    /// names its memory, so the caller may free or reuse it at once;
    /// otherwise the ledger keeps it until those WRs are done and returns
    /// `None`.
    #[must_use = "a returned owner is the caller's to free"]
    pub(crate) fn release(&mut self, key: K, owner: O) -> Option<O> {
        if self.pinned(key) {
            self.retired.insert(key, owner);
            None
        } else {
            Some(owner)
        }
    }

    /// WR `wr_id` completed, successfully or flushed: it and every WR
    /// posted before it are done. Frees the retired owners no remaining WR
    /// names and returns how many. A `wr_id` the ledger does not hold (a WR
    /// it never recorded, or one already covered by a later completion)
    /// changes nothing. WRs posted together as one (a NOTIFY's WRITE and
    /// SEND without immediate data) may share a `wr_id`: the completion
    /// covers the last one recorded.
    pub(crate) fn complete(&mut self, wr_id: u64) -> usize {
        let Some(at) = self.posted.iter().rposition(|p| p.wr_id == wr_id) else {
            return 0;
        };
        let mut freed = 0;
        for done in self.posted.drain(..=at) {
            let Some(key) = done.pin else { continue };
            let Some(n) = self.pins.get_mut(&key) else {
                continue;
            };
            *n -= 1;
            if *n == 0 {
                self.pins.remove(&key);
                if self.retired.remove(&key).is_some() {
                    freed += 1;
                }
            }
        }
        freed
    }

    /// Whether an RDMA READ posted before WR `wr_id` is not known
    /// complete (false when `wr_id` is not posted).
    pub(crate) fn read_before(&self, wr_id: u64) -> bool {
        let mut reads = false;
        for p in &self.posted {
            if p.wr_id == wr_id {
                return reads;
            }
            reads |= p.op == PostedOp::Read;
        }
        false
    }

    /// Posted WRs not known complete.
    #[cfg(test)]
    pub(crate) fn outstanding(&self) -> usize {
        self.posted.len()
    }

    /// Owners given up and still held for a posted WR.
    pub(crate) fn retired(&self) -> usize {
        self.retired.len()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::*;

    /// A fake owner of NIC-visible memory that logs when it is freed.
    struct Owner {
        name: &'static str,
        freed: Rc<RefCell<Vec<&'static str>>>,
    }

    impl Drop for Owner {
        fn drop(&mut self) {
            self.freed.borrow_mut().push(self.name);
        }
    }

    /// A fake send queue over a ledger: posts WRs in order, and completes
    /// (or, after `set_error`, flushes) them the way an RC QP does.
    struct FakeQp {
        ledger: Ledger<u64, Owner>,
        next_wr: u64,
        in_error: bool,
        freed: Rc<RefCell<Vec<&'static str>>>,
    }

    impl FakeQp {
        fn new() -> Self {
            FakeQp {
                ledger: Ledger::default(),
                next_wr: 1,
                in_error: false,
                freed: Rc::default(),
            }
        }

        fn owner(&self, name: &'static str) -> Owner {
            Owner {
                name,
                freed: Rc::clone(&self.freed),
            }
        }

        fn post(&mut self, op: PostedOp, pin: Option<u64>) -> u64 {
            let id = self.next_wr;
            self.next_wr += 1;
            self.ledger.record(id, op, pin);
            id
        }

        /// The QP goes to the error state: every outstanding WR is flushed
        /// (a completion each, in order).
        fn set_error_and_flush(&mut self) -> usize {
            self.in_error = true;
            let ids: Vec<u64> = self.ledger.posted.iter().map(|p| p.wr_id).collect();
            ids.into_iter().map(|id| self.ledger.complete(id)).sum()
        }

        fn freed(&self) -> Vec<&'static str> {
            self.freed.borrow().clone()
        }
    }

    #[test]
    fn a_completion_covers_every_wr_recorded_with_its_wr_id() {
        // A NOTIFY without immediate data: an unsignaled WRITE of the
        // message and a SEND of its length, both numbered 5.
        let mut qp = FakeQp::new();
        qp.ledger.record(5, PostedOp::Write, Some(9));
        qp.ledger.record(5, PostedOp::Send, None);
        let later = qp.post(PostedOp::Send, None);
        assert_eq!(qp.ledger.op(5), Some(PostedOp::Write));
        assert!(qp.ledger.release(9, qp.owner("write")).is_none());
        assert_eq!(qp.ledger.complete(5), 1);
        assert_eq!(qp.freed(), vec!["write"]);
        assert_eq!(qp.ledger.op(5), None);
        assert_eq!(qp.ledger.posted.len(), 1);
        assert_eq!(qp.ledger.op(later), Some(PostedOp::Send));
    }

    #[test]
    fn an_owner_given_up_while_unposted_is_returned_at_once() {
        let mut qp = FakeQp::new();
        let a = qp.owner("a");
        let back = qp.ledger.release(7, a).expect("nothing names 7");
        assert_eq!(back.name, "a");
        assert_eq!(qp.ledger.retired(), 0);
        drop(back);
        assert_eq!(qp.freed(), vec!["a"]);
    }

    #[test]
    fn an_owner_given_up_while_posted_is_freed_by_its_completion_only() {
        let mut qp = FakeQp::new();
        let wr = qp.post(PostedOp::Send, Some(1));
        // The abort: the protocol core reclaims message 1, its holder gives
        // it up while its SEND is still posted.
        let a = qp.owner("a");
        assert!(qp.ledger.release(1, a).is_none());
        assert_eq!(qp.ledger.retired(), 1);
        assert!(qp.ledger.pinned(1));
        assert_eq!(qp.freed(), Vec::<&str>::new());
        // A completion of a WR the ledger does not hold changes nothing.
        assert_eq!(qp.ledger.complete(wr + 100), 0);
        assert_eq!(qp.freed(), Vec::<&str>::new());
        assert_eq!(qp.ledger.complete(wr), 1);
        assert_eq!(qp.freed(), vec!["a"]);
        assert!(!qp.ledger.pinned(1));
        assert_eq!(qp.ledger.outstanding(), 0);
    }

    #[test]
    fn a_signaled_completion_covers_the_unsignaled_wrs_before_it() {
        let mut qp = FakeQp::new();
        let _w1 = qp.post(PostedOp::Send, Some(1));
        let _w2 = qp.post(PostedOp::Send, Some(2));
        let w3 = qp.post(PostedOp::Send, None);
        let w4 = qp.post(PostedOp::Read, Some(4));
        for (k, n) in [(1, "m1"), (2, "m2"), (4, "d4")] {
            let o = qp.owner(n);
            assert!(qp.ledger.release(k, o).is_none());
        }
        assert_eq!(qp.ledger.op(w4), Some(PostedOp::Read));
        // WR 3 is signaled: 1, 2 and 3 are done; the READ is not.
        assert_eq!(qp.ledger.complete(w3), 2);
        assert_eq!(qp.freed(), vec!["m1", "m2"]);
        assert_eq!(qp.ledger.outstanding(), 1);
        assert!(qp.ledger.pinned(4));
        assert_eq!(qp.ledger.complete(w4), 1);
        assert_eq!(qp.freed(), vec!["m1", "m2", "d4"]);
        assert_eq!(qp.ledger.op(w4), None);
    }

    #[test]
    fn memory_named_by_two_wrs_waits_for_both() {
        let mut qp = FakeQp::new();
        // Two READs into one destination (two chunks of one rendezvous).
        let r1 = qp.post(PostedOp::Read, Some(9));
        let r2 = qp.post(PostedOp::Read, Some(9));
        let d = qp.owner("dest");
        assert!(qp.ledger.release(9, d).is_none());
        assert_eq!(qp.ledger.complete(r1), 0);
        assert_eq!(qp.freed(), Vec::<&str>::new());
        assert!(qp.ledger.pinned(9));
        assert_eq!(qp.ledger.complete(r2), 1);
        assert_eq!(qp.freed(), vec!["dest"]);
    }

    #[test]
    fn after_the_error_state_the_flush_frees_and_nothing_before_it() {
        let mut qp = FakeQp::new();
        qp.post(PostedOp::Send, Some(1));
        qp.post(PostedOp::Send, Some(2));
        qp.post(PostedOp::Read, Some(3));
        for (k, n) in [(1, "m1"), (2, "m2"), (3, "d3")] {
            let o = qp.owner(n);
            assert!(qp.ledger.release(k, o).is_none());
        }
        // Abort marked everything; nothing is freed until the flush.
        assert_eq!(qp.freed(), Vec::<&str>::new());
        assert_eq!(qp.set_error_and_flush(), 3);
        assert!(qp.in_error);
        assert_eq!(qp.freed(), vec!["m1", "m2", "d3"]);
        assert_eq!(qp.ledger.outstanding(), 0);
        assert_eq!(qp.ledger.retired(), 0);
    }

    #[test]
    fn a_partial_post_counts_every_wr_handed_over_until_a_later_completion() {
        let mut qp = FakeQp::new();
        // A batch of three whose post failed at the second: all three are
        // recorded, since the NIC may have taken any of them.
        qp.post(PostedOp::Send, Some(1));
        qp.post(PostedOp::Read, Some(2));
        qp.post(PostedOp::Send, Some(3));
        for (k, n) in [(1, "m1"), (2, "d2"), (3, "m3")] {
            let o = qp.owner(n);
            assert!(qp.ledger.release(k, o).is_none());
        }
        // The connection fails; the QP's flush covers what was posted, and
        // no completion ever comes for the WRs the NIC did not take. The
        // ledger drops them with itself, after the QP (owner's field order).
        assert_eq!(qp.ledger.complete(1), 1);
        assert_eq!(qp.freed(), vec!["m1"]);
        drop(qp.ledger);
        assert_eq!(qp.freed.borrow().len(), 3);
    }

    #[test]
    fn a_key_reused_after_its_wrs_completed_starts_unpinned() {
        let mut qp = FakeQp::new();
        let w = qp.post(PostedOp::Send, Some(5));
        assert_eq!(qp.ledger.complete(w), 0);
        let o = qp.owner("again");
        assert!(qp.ledger.release(5, o).is_some());
        assert_eq!(qp.freed(), vec!["again"]);
    }

    #[test]
    fn read_before_sees_only_reads_posted_earlier_and_not_complete() {
        let mut l: Ledger<u64, Owner> = Ledger::default();
        l.record(1, PostedOp::Send, None);
        l.record(2, PostedOp::Read, Some(7));
        l.record(3, PostedOp::Send, None);
        l.record(4, PostedOp::Read, Some(8));
        l.record(5, PostedOp::Write, None);
        assert!(!l.read_before(1));
        assert!(!l.read_before(2));
        assert!(l.read_before(3));
        assert!(l.read_before(5));
        assert!(!l.read_before(9), "not posted");
        // The first READ completes: WR 3 has none before it any more.
        l.complete(2);
        assert!(!l.read_before(3));
        assert!(l.read_before(5));
        // The second READ's completion retires WR 3 with it.
        l.complete(4);
        assert_eq!(l.op(3), None);
        assert!(!l.read_before(5));
        assert_eq!(l.outstanding(), 1);
    }
}
