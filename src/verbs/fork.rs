//! RDMA resources belong to the process that made them. A child made by
//! `fork()` shares the parent's verbs and rdma_cm file descriptors (and
//! with them every QP, CQ, MR, window and rdma_cm id: the kernel keeps
//! those per open file, not per process), its epoll instance (tokio's),
//! and on Soft-RoCE the queues mapped from the kernel. A child that posts,
//! polls, destroys or deregisters through them acts on the parent's
//! objects. So the crate refuses, in a child, every operation on what it
//! inherited (`Error::InheritedAfterFork`), and leaks instead of
//! destroying what a child drops ([`ParentOnly`]): the kernel frees it
//! when the last process holding the files exits.
//!
//! The child is told apart by a `pthread_atfork` handler installed before
//! the process's first RDMA resource ([`watch`]); it only stores a flag,
//! which is async-signal-safe as such a handler must be. Since Linux 5.13
//! the memory side needs nothing: a fork copies pinned anonymous pages
//! into the child at once (`RDMA_NLDEV_SYS_ATTR_COPY_ON_FORK`), so the
//! parent keeps the pages its MRs map.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::error::Error;

/// Set in a child made by `fork()` after [`watch`] ran.
static INHERITED: AtomicBool = AtomicBool::new(false);
/// The process that installed the handler (the resources' owner).
static OWNER: AtomicU32 = AtomicU32::new(0);
static WATCH: Once = Once::new();

extern "C" fn in_child() {
    // Async-signal-safe: one atomic store.
    INHERITED.store(true, Ordering::Relaxed);
}

/// Installs the fork handler, once per process; called before the first
/// device is opened and the first rdma_cm channel is made.
pub(crate) fn watch() {
    WATCH.call_once(|| {
        OWNER.store(std::process::id(), Ordering::Relaxed);
        // SAFETY: `in_child` is an `extern "C" fn()` that lives for the
        // whole program and only stores to an atomic; pthread_atfork only
        // records the pointers.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        if rc != 0 {
            tracing::warn!(
                errno = rc,
                "pthread_atfork failed: a forked child is not told apart"
            );
        }
    });
}

/// Whether this process is a child made by `fork()` from a process that
/// had RDMA resources (which it inherited and must not touch).
pub(crate) fn inherited() -> bool {
    INHERITED.load(Ordering::Relaxed)
}

/// `Err(Error::InheritedAfterFork)` in a forked child, for `op`.
pub(crate) fn check(op: &'static str) -> Result<(), Error> {
    if inherited() {
        return Err(Error::InheritedAfterFork {
            op,
            parent: OWNER.load(Ordering::Relaxed),
        });
    }
    Ok(())
}

/// `check` as an `io::Result`, for the public operations.
pub(crate) fn check_io(op: &'static str) -> std::io::Result<()> {
    check(op).map_err(Into::into)
}

/// A value whose drop talks to the kernel (destroys, deregisters,
/// deallocates, deletes from an epoll set): dropped normally in the
/// process that made it, leaked in a forked child, where dropping it would
/// destroy the parent's object.
pub(crate) struct ParentOnly<T>(ManuallyDrop<T>);

impl<T> ParentOnly<T> {
    pub(crate) fn new(value: T) -> ParentOnly<T> {
        ParentOnly(ManuallyDrop::new(value))
    }
}

impl<T> Drop for ParentOnly<T> {
    fn drop(&mut self) {
        if !inherited() {
            // SAFETY: dropped exactly once, here; never used afterwards.
            unsafe { ManuallyDrop::drop(&mut self.0) }
        }
    }
}

impl<T> Deref for ParentOnly<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for ParentOnly<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for ParentOnly<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    static DROPS: AtomicUsize = AtomicUsize::new(0);

    struct Counts;
    impl Drop for Counts {
        fn drop(&mut self) {
            DROPS.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The parent drops and passes checks; a forked child is refused,
    /// names the parent, and leaks what it drops (reported through its
    /// exit status, as a forked child of the test harness can only
    /// `_exit`).
    #[test]
    fn a_forked_child_is_refused_and_leaks_while_the_parent_is_not() {
        watch();
        assert!(!inherited());
        assert!(check("op").is_ok());
        let before = DROPS.load(Ordering::SeqCst);
        drop(ParentOnly::new(Counts));
        assert_eq!(DROPS.load(Ordering::SeqCst), before + 1);

        let parent = std::process::id();
        let kept = ParentOnly::new(Counts);
        // SAFETY: the child only loads and stores atomics, builds one
        // error (no allocation) and leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let refused = matches!(
                check("op"),
                Err(Error::InheritedAfterFork { op: "op", parent: p }) if p == parent
            );
            let drops = DROPS.load(Ordering::SeqCst);
            drop(kept);
            let leaked = DROPS.load(Ordering::SeqCst) == drops;
            let code = i32::from(!inherited()) | i32::from(!refused) << 1 | i32::from(!leaked) << 2;
            // SAFETY: ends the child without running the harness's code.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child; `status` is a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status));
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "bit 0: flag, 1: refusal, 2: leak"
        );
        assert!(
            !inherited() && check("op").is_ok(),
            "the parent is not a child"
        );
        let drops = DROPS.load(Ordering::SeqCst);
        drop(kept);
        assert_eq!(DROPS.load(Ordering::SeqCst), drops + 1);
    }
}
