//! The send queue as a protocol core sees it: the work requests (WRs) it
//! handed out and does not know complete yet, and which of them are
//! signaled. Shared by [`StreamCore`](super::stream::StreamCore) and
//! [`MessageCore`](super::message::MessageCore).
//!
//! Selective signaling: only some WRs ask for a completion. A reliable
//! connected QP completes its send queue in order, so the completion of a
//! signaled WR means it and every WR posted before it are done (IBTA vol.
//! 1, 10.8.3 and 11.4.1.1). A WR is signaled when its core says it must be
//! (the last of a burst, an ABORT, a CLOSE) or when `interval - 1`
//! unsignaled WRs came before it, so at most `interval` WRs wait on one
//! completion.

use std::collections::VecDeque;

/// One WR handed out and not known complete, with what the core attached
/// to it (`T`: the send-buffer bytes it holds, the message it sends).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Posted<T> {
    wr_id: u64,
    item: T,
}

/// The WRs a core handed out and does not know complete, oldest first;
/// their ids are consecutive, from 1.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct SendQueue<T> {
    next_wr_id: u64,
    posted: VecDeque<Posted<T>>,
    /// Unsignaled WRs handed out since the last signaled one.
    unsignaled_run: u16,
}

impl<T> Default for SendQueue<T> {
    fn default() -> Self {
        SendQueue {
            next_wr_id: 1,
            posted: VecDeque::new(),
            unsignaled_run: 0,
        }
    }
}

impl<T> SendQueue<T> {
    /// WRs handed out and not known complete.
    pub(crate) fn len(&self) -> usize {
        self.posted.len()
    }

    /// Whether every WR handed out is known complete.
    pub(crate) fn is_empty(&self) -> bool {
        self.posted.is_empty()
    }

    /// Numbers the next WR, which carries `item`, and returns its wr_id.
    /// The core then decides whether it is signaled (it must be when
    /// [`signal_due`](Self::signal_due), and may be for reasons of its
    /// own) and says so with [`signaled`](Self::signaled).
    pub(crate) fn push(&mut self, item: T) -> u64 {
        let wr_id = self.next_wr_id;
        self.next_wr_id += 1;
        self.posted.push_back(Posted { wr_id, item });
        wr_id
    }

    /// Whether the WR just pushed is the `interval`-th since the last
    /// signaled one (`interval - 1` unsignaled WRs came before it), so it
    /// must be signaled. An `interval` of 0 or 1 signals every WR.
    pub(crate) fn signal_due(&self, interval: u16) -> bool {
        self.unsignaled_run + 1 >= interval
    }

    /// Whether the WR just pushed is signaled; returns `signaled`.
    pub(crate) fn signaled(&mut self, signaled: bool) -> bool {
        if signaled {
            self.unsignaled_run = 0;
        } else {
            self.unsignaled_run += 1;
        }
        signaled
    }

    /// `Ok` if `wr_id` is handed out and not known complete; otherwise the
    /// oldest and newest such wr_ids (`None` if there are none), for the
    /// core's error.
    pub(crate) fn check(&self, wr_id: u64) -> Result<(), Option<(u64, u64)>> {
        let (Some(first), Some(last)) = (self.posted.front(), self.posted.back()) else {
            return Err(None);
        };
        let (first, last) = (first.wr_id, last.wr_id);
        if wr_id < first || wr_id > last {
            return Err(Some((first, last)));
        }
        Ok(())
    }

    /// The oldest WR, if its wr_id is at most `through`: taken out and
    /// its item returned. A completion of `through` means every WR up to
    /// and including it is done (RC ordering): calling this until `None`
    /// hands out their items, oldest first.
    pub(crate) fn pop_done(&mut self, through: u64) -> Option<T> {
        if self.posted.front()?.wr_id > through {
            return None;
        }
        self.posted.pop_front().map(|p| p.item)
    }

    /// The items of the WRs not known complete, oldest first.
    pub(crate) fn items_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.posted.iter_mut().map(|p| &mut p.item)
    }
}

#[cfg(test)]
mod tests {
    use super::SendQueue;

    /// Pushes `item` and signals it when due or `must`.
    fn push(q: &mut SendQueue<u32>, item: u32, interval: u16, must: bool) -> (u64, bool) {
        let wr_id = q.push(item);
        let due = q.signal_due(interval);
        (wr_id, q.signaled(must || due))
    }

    #[test]
    fn every_interval_th_wr_is_signaled_and_completions_cover_the_earlier_ones() {
        let mut q = SendQueue::default();
        let got: Vec<(u64, bool)> = (0..7).map(|i| push(&mut q, i, 3, false)).collect();
        assert_eq!(
            got,
            [
                (1, false),
                (2, false),
                (3, true),
                (4, false),
                (5, false),
                (6, true),
                (7, false)
            ]
        );
        assert_eq!(push(&mut q, 7, 3, true), (8, true), "must_signal");
        assert_eq!(push(&mut q, 8, 3, false), (9, false), "the run starts over");
        assert_eq!(q.check(0), Err(Some((1, 9))));
        assert_eq!(q.check(10), Err(Some((1, 9))));
        let mut done = Vec::new();
        while let Some(i) = q.pop_done(3) {
            done.push(i);
        }
        assert_eq!(done, [0, 1, 2]);
        assert_eq!(q.check(3), Err(Some((4, 9))));
        assert_eq!(q.len(), 6);
        while q.pop_done(9).is_some() {}
        assert!(q.is_empty());
        assert_eq!(q.check(9), Err(None));
    }

    #[test]
    fn an_interval_of_one_signals_every_wr() {
        let mut q = SendQueue::default();
        assert!((0..5).all(|i| push(&mut q, i, 1, false).1));
        assert!((0..5).all(|i| push(&mut q, i, 0, false).1));
    }
}
