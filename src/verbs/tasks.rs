//! The crate's own background tasks, counted, so that a waiting task can
//! tell whether its runtime has other work that a long spin would hold up.
//! At the bottom with the verbs layer, whose completion-channel
//! dispatchers are such tasks too; it imports nothing of the crate.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The crate's own tasks alive in this process (all runtimes): connection
/// drivers, listener loops and completion-channel dispatchers.
static OWN_TASKS: AtomicUsize = AtomicUsize::new(0);

/// Counts one of the crate's own tasks (a connection driver, a listener
/// loop, a completion-channel dispatcher) while it lives (see
/// [`other_tasks_on_runtime`]).
#[derive(Debug)]
pub(crate) struct OwnTask(());

impl OwnTask {
    pub(crate) fn new() -> Self {
        OWN_TASKS.fetch_add(1, Ordering::Relaxed);
        OwnTask(())
    }
}

impl Drop for OwnTask {
    fn drop(&mut self) {
        OWN_TASKS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether the runtime the caller runs on has tasks other than the
/// crate's own and the caller's (tokio's
/// `RuntimeMetrics::num_alive_tasks`, alive, not necessarily ready: tokio
/// does not say which are ready). Then a long spin may hold up a task
/// the answer waits for: on a `current_thread` runtime every other task,
/// and on the multi-thread runtime a task the spinner woke, which waits
/// in the worker's LIFO slot that no other worker steals from. The
/// pipelined echo of `echo_bench` (8 requests in flight, its writer a
/// task of its own) ran 0.73-0.76x as many requests per second when its
/// reader spun to the limit (benches/history/echo-2026-12-05.md, "A long spin holds up
/// the writer of a pipelined exchange"). The crate's tasks are counted
/// per process, so with connections on several runtimes this undercounts
/// other tasks (and spins longer). `false` outside a runtime.
pub(crate) fn other_tasks_on_runtime() -> bool {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    let own = usize::from(tokio::task::try_id().is_some());
    handle.metrics().num_alive_tasks() > OWN_TASKS.load(Ordering::Relaxed) + own
}
