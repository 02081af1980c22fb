//! Completion handling: a CQ and a completion channel of the connection's
//! own while there are few connections, one channel per tokio runtime and
//! device beyond that, and CQs shared by many connections where asked for
//! or where the device's CQs run short.
//!
//! The first [`DEDICATED_CHANNELS`] live connections of a process (fewer
//! under a small `ulimit -n`) each get a CQ and a completion channel
//! (`ibv_comp_channel`, one fd) of their own, registered with the
//! runtime's reactor, which wakes the connection's tasks directly (a reader
//! waiting in `poll_read` first, the driver after it): the lowest latency.
//! Every further connection (and any whose own channel cannot be created,
//! for example out of file descriptors) reports to its runtime's
//! [`CqHub`] for that device: one channel and one task that reads each
//! event, acknowledges it at once and routes it by the CQ's address. By
//! default such a connection still has a CQ of its own, which the hub's
//! task answers by firing that CQ's [`CqSignal`] (the connection's tasks
//! then poll, arm and wait as on a channel of their own).
//!
//! A connection that asks for it (`RdmaConfig::share_completion_queue`),
//! and any connection once the process holds half the device's `max_cq`
//! CQs of their own, takes a [`Seat`] on a [`SharedCq`] instead: a CQ of
//! [`SHARED_CQ_ENTRIES`] entries that several QPs use as their send and
//! receive CQ (60 with the default depths), on the hub's channel. Whoever
//! polls a shared CQ (a connection's task polling for itself, or the hub's
//! task on an event) hands each work completion to the [`Inbox`] of its QP
//! (looked up by the completion's QP number) and wakes that QP's tasks; a
//! QP's own poll waits for a poll in progress and then takes its inbox, so
//! it sees every completion that arrived before it. The hub keeps a shared
//! CQ armed (it arms after every event, then polls), as it must while any
//! connection on it waits: so a busy connection on a shared CQ raises an
//! event per completion burst, where a CQ of its own stays unarmed while
//! its tasks run. Measured in the Soft-RoCE guest (benches/history/echo-2026-12-01-to-03.md,
//! "Shared completion queues"), a parked 64 B round trip took 1.6-2.8x
//! the mean; hence opt-in (and automatic only near the device's `max_cq`).
//!
//! A shared CQ never overflows: each QP reserves its send depth plus its
//! receive depth plus 16 entries (at most that many of its completions can
//! be queued, flushes on error included), and a CQ takes no QP beyond its
//! entries. A QP's route is removed only after the QP is destroyed and
//! the CQ polled once more, so a later QP with the same number never gets
//! an earlier one's completion.
//!
//! A hub belongs to one runtime because an `AsyncFd` does: it is keyed by
//! `tokio::runtime::Id` and the device, and a hub whose runtime shut down
//! (its task gone) is never handed out again, even if a later runtime gets
//! the same id. A hub lives as long as its runtime (its task holds it) or
//! as long as a CQ on it, whichever is longer; a shared CQ lives as long as
//! a QP seated on it.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};

use rdma_mummy_sys::{
    ibv_ack_cq_events, ibv_cq, ibv_get_cq_event, ibv_poll_cq, ibv_req_notify_cq, ibv_wc,
};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue as _,
    CreateCompletionChannelErrorKind, CreateCompletionQueueErrorKind,
};
use tokio::io::unix::AsyncFd;

use super::count::{Counted, Kind, classify, live, rlimit};
use super::fork::ParentOnly;
use super::rc::{Completion, OpenDevice};
use crate::error::{Error, Result};

/// Wraps the completion channel for AsyncFd registration.
pub(crate) struct ChannelFd(Arc<CompletionChannel>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// One CQ's event flags and the tasks waiting for it, on a shared channel.
///
/// Application tasks (a reader, `recv`) are woken before the connection's
/// driver task, the order tokio's reactor uses for a channel of the
/// connection's own (its `poll_read_ready` slot before its `readable()`
/// waiters): the reader takes its data before the driver's round. The
/// driver has a flag of its own, so every event reaches it even when an
/// application task took the event first (as every event reaches the
/// `readable()` waiters of a channel of the connection's own): the driver
/// must see a failure to disconnect.
#[derive(Default)]
pub(crate) struct CqSignal {
    fired: AtomicBool,
    driver_fired: AtomicBool,
    waiters: Mutex<Waiters>,
}

#[derive(Default)]
struct Waiters {
    tasks: Vec<Waker>,
    driver: Option<Waker>,
}

impl CqSignal {
    /// Ready (and the flag taken) if an event came since the last take;
    /// otherwise `cx`'s task is registered (every registered task is woken
    /// by the next event, a task polled twice is kept once) and Pending.
    /// Application tasks share one flag (the first to look takes the
    /// event); the driver has its own.
    fn poll_take(&self, cx: &mut Context<'_>, driver: bool) -> Poll<()> {
        let flag = if driver {
            &self.driver_fired
        } else {
            &self.fired
        };
        if flag.swap(false, Ordering::AcqRel) {
            return Poll::Ready(());
        }
        {
            let mut w = lock(&self.waiters);
            if driver {
                w.driver = Some(cx.waker().clone());
            } else if !w.tasks.iter().any(|x| x.will_wake(cx.waker())) {
                w.tasks.push(cx.waker().clone());
            }
        }
        // An event between the swap and the registration set the flag
        // after or before the wake-up list was taken: look again.
        if flag.swap(false, Ordering::AcqRel) {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        self.driver_fired.store(true, Ordering::Release);
        let w = std::mem::take(&mut *lock(&self.waiters));
        for t in w.tasks {
            t.wake();
        }
        if let Some(d) = w.driver {
            d.wake();
        }
    }

    /// Wakes the driver only (an application task polling for itself took
    /// a failed completion: the driver must see the failure).
    fn fire_driver(&self) {
        self.driver_fired.store(true, Ordering::Release);
        let d = lock(&self.waiters).driver.take();
        if let Some(d) = d {
            d.wake();
        }
    }
}

/// Live connections with a completion channel of their own, at most
/// [`DEDICATED_CHANNELS`].
static DEDICATED: AtomicUsize = AtomicUsize::new(0);

/// How many live connections of a process get a completion channel (an
/// fd) of their own: at most 64, and at most a sixteenth of the process's
/// `RLIMIT_NOFILE` (64 with the default `ulimit -n` of 1024), so the
/// budget never takes the descriptors the application needs. Measured in
/// the Soft-RoCE guest (benches/history/echo-2026-12-01-to-03.md, "Completion events per
/// runtime"): a CQ on the shared channel adds a task hop to every parked
/// wake-up.
pub(crate) const DEDICATED_CHANNELS: usize = 64;

fn dedicated_budget() -> usize {
    let nofile = rlimit(libc::RLIMIT_NOFILE).unwrap_or(1024);
    DEDICATED_CHANNELS.min(usize::try_from(nofile / 16).unwrap_or(usize::MAX))
}

/// How the driver of a CQ with a channel of its own stays out of the
/// events an application task takes.
///
/// The reactor wakes every task registered on the channel for each event:
/// a reader parked in `poll_read` (or `recv`) and the driver. The reader
/// polls, arms and takes its data itself, so the driver's round after it
/// finds nothing to do; on a multi-thread runtime its wake-up even moves
/// one of the two tasks to another worker (a futex wake) and the two
/// contend for the connection's lock. So while an application task is
/// parked on the CQ, or spinning on it (`app_spinning`: it polls the CQ
/// itself), the driver's registration is woken through this gate,
/// which leaves the event to that task (`app_parked`) while
/// the driver filters ([`Delegation::set_filtering`]).
///
/// Filtering starts at an event that finds a reader parked or spinning
/// (the gate turns it on and still wakes the driver for that one, see
/// `Delegation::pass`), and while it is on the driver looks at the
/// connection every [`DELEGATION_TICK`] ([`Delegation::on_tick`]), taking
/// the events left since ([`CqEvents::take_left`]): it stops after a tick
/// in which no reader took an event and no read found data (the
/// connection went idle: no timer then). Left events that no reader took
/// mean a reader whose future was dropped while parked (it never takes
/// them; the tick's round polls the CQ), and the stale parked flag is
/// forgotten at that tick. So nothing waits on a reader that is gone for
/// longer than about two ticks.
///
/// While it filters and a reader is at work ([`Delegation::reader_active`]),
/// the driver's own rounds leave the CQ unarmed unless something waits on
/// a send completion (the reader arms before it parks, a blocked writer
/// for itself): an arm left over from a round made the completion that
/// lands while the reader is inside its next write raise an event that
/// woke the driver (benches/history/echo-2026-12-05.md, "Arms left over wake the driver").
/// The round after a tick without reads arms again.
#[derive(Default)]
pub(crate) struct Delegation {
    /// An application task is registered for the CQ's next event.
    app_parked: AtomicBool,
    /// Application tasks spinning on the CQ (polling it in a loop: they
    /// see a completion before the event could wake anyone); a count, as
    /// clones of a message endpoint can spin in `recv` at once.
    app_spinning: AtomicUsize,
    /// The driver leaves events to a parked application task.
    filtering: AtomicBool,
    /// An application task took an event since the driver's last tick.
    taken: AtomicBool,
    /// A reader found work without taking an event (it spun, or the data
    /// was there) since the driver's last tick.
    reading: AtomicBool,
    /// Events left to application tasks (the connection's statistics).
    left: AtomicU64,
    /// `left` at the driver's last tick ([`Delegation::on_tick`]): an
    /// event was left since if it differs.
    left_at_tick: AtomicU64,
    /// The driver task's own waker.
    driver: Mutex<Option<Waker>>,
}

/// A spin on the CQ in progress ([`Delegation::spinning`]); ends on drop,
/// unwinding included.
pub(crate) struct Spinning<'a>(&'a Delegation);

impl Drop for Spinning<'_> {
    fn drop(&mut self) {
        self.0.app_spinning.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How often a driver that leaves completion events to a parked reader
/// looks at the connection itself: about half the bound on how long
/// progress (draining the ring, returning credit, waking blocked writers)
/// can wait for a reader that stopped polling while parked, and the cost
/// of delegation on a busy connection (200 timer wake-ups per second,
/// where each event woke the driver before).
pub(crate) const DELEGATION_TICK: std::time::Duration = std::time::Duration::from_millis(5);

impl Delegation {
    /// Whether an application task is registered for the CQ's next event.
    #[cfg(test)]
    fn app_parked(&self) -> bool {
        self.app_parked.load(Ordering::Acquire)
    }

    /// A reader found work (with or without taking an event): it is not
    /// parked on the CQ (any more).
    pub(crate) fn unpark(&self) {
        self.app_parked.store(false, Ordering::Release);
        self.reading.store(true, Ordering::Release);
    }

    /// An application task took an event.
    fn took(&self) {
        self.taken.store(true, Ordering::Release);
        self.app_parked.store(false, Ordering::Release);
    }

    /// An application task spins on the CQ (`Shared::spin`) until the
    /// returned mark drops: an event that comes meanwhile is left to it as
    /// to a parked task, since it polls the CQ itself. A spin runs within
    /// one poll of the task (no await), so it cannot be dropped midway; an
    /// event left just after its last poll of the CQ is one the tick's
    /// round or the task's next call takes.
    pub(crate) fn spinning(&self) -> Spinning<'_> {
        self.app_spinning.fetch_add(1, Ordering::AcqRel);
        Spinning(self)
    }

    /// The driver leaves events to parked application tasks (`true`) or
    /// takes every event itself (`false`).
    pub(crate) fn set_filtering(&self, on: bool) {
        self.filtering.store(on, Ordering::Release);
    }

    /// Whether the driver leaves events to parked application tasks.
    pub(crate) fn filtering(&self) -> bool {
        self.filtering.load(Ordering::Acquire)
    }

    /// The driver's tick while filtering: it goes on filtering if an
    /// application task took one of the events left since the last tick,
    /// or a reader found work (a spin answered it: the connection is
    /// busy, and a spinning reader takes no event, it polls the CQ).
    /// Otherwise it stops (the next event wakes it again): after a tick
    /// in which nothing happened the connection is idle. Events left that
    /// nobody took mean a stale parked reader (its read was dropped while
    /// parked), which is forgotten either way.
    ///
    /// (Stopping whenever left events went untaken, as before, turned
    /// filtering off at every tick under a spinning reader: its next event
    /// woke the driver, which on the multi-thread runtime met the reader
    /// on the connection's lock, 0.13 driver wake-ups and 0.1 lock waits
    /// per 64 B round trip of a `block_on` client: benches/history/echo-2026-12-05.md,
    /// "The driver's wake-ups under a spinning reader".)
    pub(crate) fn on_tick(&self) {
        let now = self.left.load(Ordering::Acquire);
        let left = self.left_at_tick.swap(now, Ordering::AcqRel) != now;
        let taken = self.taken.swap(false, Ordering::AcqRel);
        let reading = self.reading.swap(false, Ordering::AcqRel);
        if left && !taken {
            self.app_parked.store(false, Ordering::Release);
        }
        if !(taken || reading) {
            self.set_filtering(false);
        }
    }

    /// Whether an application task took an event or a read found data
    /// since the driver's last tick: a reader is at work, not parked and
    /// gone.
    pub(crate) fn reader_active(&self) -> bool {
        self.taken.load(Ordering::Acquire) || self.reading.load(Ordering::Acquire)
    }

    /// Whether the CQ may stay unarmed after a drain, as far as event
    /// leaving goes: the driver leaves events to a reader at work (and
    /// therefore ticks). The caller adds that nothing waits on a send
    /// completion (`Driven::arm_unless_left_to_reader`).
    pub(crate) fn leaves_cq_unarmed(&self) -> bool {
        self.filtering() && self.reader_active()
    }

    /// Events left to application tasks so far.
    pub(crate) fn left(&self) -> u64 {
        self.left.load(Ordering::Acquire)
    }

    /// The gate's decision for one wake-up of the driver's registration:
    /// `true` to wake the driver.
    ///
    /// The first event that finds a reader parked while the driver does
    /// not filter yet still wakes the driver (which starts its tick) and
    /// turns filtering on here, at the event: on a multi-thread runtime
    /// the reader, woken on another worker, usually took the event (and
    /// was no longer parked) by the time the driver looked.
    fn pass(&self) -> bool {
        if self.app_parked.load(Ordering::Acquire) || self.app_spinning.load(Ordering::Acquire) > 0
        {
            if self.filtering.load(Ordering::Acquire) {
                self.left.fetch_add(1, Ordering::AcqRel);
                return false;
            }
            self.set_filtering(true);
        }
        true
    }
}

impl std::task::Wake for Delegation {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.pass() {
            let w = lock(&self.driver).take();
            if let Some(w) = w {
                w.wake();
            }
        }
    }
}

/// Where one CQ's completion events arrive (see the module docs).
pub(crate) enum CqEvents {
    /// A channel of the CQ's own on the reactor.
    Own {
        fd: ParentOnly<AsyncFd<ChannelFd>>,
        delegation: Arc<Delegation>,
        _slot: DedicatedSlot,
        _counted: Counted,
    },
    /// The runtime's shared channel for the device.
    Shared {
        hub: Arc<CqHub>,
        signal: Arc<CqSignal>,
    },
}

/// A taken place in the [`DEDICATED_CHANNELS`] budget, given back on drop.
pub(crate) struct DedicatedSlot(());

impl DedicatedSlot {
    fn take() -> Option<DedicatedSlot> {
        let budget = dedicated_budget();
        DEDICATED
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < budget).then_some(n + 1)
            })
            .ok()
            .map(|_| DedicatedSlot(()))
    }
}

impl Drop for DedicatedSlot {
    fn drop(&mut self) {
        DEDICATED.fetch_sub(1, Ordering::AcqRel);
    }
}

impl CqEvents {
    /// Where a new CQ on `device` reports: a channel of its own while the
    /// budget and the fd limit allow (and the QP does not ask for a shared
    /// CQ, `shared_cq`), else the current runtime's hub. The
    /// hub is opened first, with the runtime's first connection on the
    /// device, so a process out of descriptors still has it. Errors: the
    /// hub's ([`CqHub::for_current`]).
    pub(crate) fn new(device: &Arc<OpenDevice>, shared_cq: bool) -> Result<CqEvents> {
        let hub = CqHub::for_current(device)?;
        if let Some(slot) = (!shared_cq).then(DedicatedSlot::take).flatten() {
            match own_channel(device) {
                Ok(fd) => {
                    return Ok(CqEvents::Own {
                        fd: ParentOnly::new(fd),
                        delegation: Arc::default(),
                        _slot: slot,
                        _counted: Counted::new(Kind::CompletionChannel),
                    });
                }
                Err(e) => {
                    tracing::debug!(error = %e, "no completion channel of its own; using the runtime's");
                }
            }
        }
        Ok(CqEvents::Shared {
            signal: Arc::new(CqSignal::default()),
            hub,
        })
    }

    /// The driver's wait for the next event (woken after the application
    /// tasks). `ticking`: the driver waits with its tick. Errors: the
    /// channel left the reactor (its runtime is gone).
    ///
    /// Returns without taking an event when filtering began after the
    /// driver decided not to tick: a gate wake-up the reactor had taken
    /// before the driver last looked runs [`Delegation::pass`] late, which
    /// turns filtering on and wakes the driver, but finds the driver's
    /// wait already registered again. Without this the driver would wait
    /// without its tick while events are left, and a stale parked reader
    /// (its read dropped while parked) would keep every later event from
    /// it. Back at the top of its loop the driver starts the tick.
    pub(crate) async fn take_as_driver(&self, ticking: bool) -> io::Result<()> {
        match self {
            // The reactor's waiter list, not the `poll_read_ready` slot,
            // which keeps one task: the reader's.
            CqEvents::Own { fd, delegation, .. } => {
                // Registered through the gate (see [`Delegation`]).
                let gate = Waker::from(Arc::clone(delegation));
                let mut readable = std::pin::pin!(fd.readable());
                let ready = std::future::poll_fn(|cx| {
                    *lock(&delegation.driver) = Some(cx.waker().clone());
                    if !ticking && delegation.filtering() {
                        return Poll::Ready(Ok(None));
                    }
                    readable
                        .as_mut()
                        .poll(&mut Context::from_waker(&gate))
                        .map(|r| r.map(Some))
                })
                .await?;
                if let Some(guard) = ready {
                    take_events(guard);
                }
                Ok(())
            }
            CqEvents::Shared { signal, .. } => {
                std::future::poll_fn(|cx| signal.poll_take(cx, true)).await;
                Ok(())
            }
        }
    }

    /// For the driver's tick: takes the events left to application tasks
    /// since (they announce nothing the tick's round does not poll for),
    /// so the driver's next wait does not return at once for them and run
    /// a second round. A no-op on the runtime's shared channel.
    pub(crate) fn take_left(&self) {
        if let CqEvents::Own { fd, .. } = self
            && let Some(Ok(guard)) = futures::FutureExt::now_or_never(fd.readable())
        {
            take_events(guard);
        }
    }

    /// The driver's gate on a channel of the CQ's own (`None` on the
    /// runtime's shared channel, whose driver takes every event).
    pub(crate) fn delegation(&self) -> Option<&Arc<Delegation>> {
        match self {
            CqEvents::Own { delegation, .. } => Some(delegation),
            CqEvents::Shared { .. } => None,
        }
    }

    /// An application task found work without taking an event: it is not
    /// parked on the CQ (any more).
    pub(crate) fn unpark(&self) {
        if let Some(d) = self.delegation() {
            d.unpark();
        }
    }

    /// For an application task: Ready once an event came (taken and
    /// acknowledged), else registered and Pending. An error (the channel
    /// left the reactor) is the driver's to report.
    pub(crate) fn poll_take(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            CqEvents::Own { fd, delegation, .. } => match fd.poll_read_ready(cx) {
                Poll::Ready(Ok(guard)) => {
                    delegation.took();
                    take_events(guard);
                    Poll::Ready(Ok(()))
                }
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Pending => {
                    delegation.app_parked.store(true, Ordering::Release);
                    Poll::Pending
                }
            },
            CqEvents::Shared { signal, .. } => signal.poll_take(cx, false).map(Ok),
        }
    }
}

/// Reads and acknowledges every event queued on a channel of the CQ's own
/// that the reactor reported readable, then clears the readiness, so the
/// next wait sleeps until a new event.
fn take_events(mut guard: tokio::io::unix::AsyncFdReadyGuard<'_, ChannelFd>) {
    drain(guard.get_inner().0.as_ref(), |_| {});
    guard.clear_ready();
}

fn own_channel(device: &Arc<OpenDevice>) -> Result<AsyncFd<ChannelFd>> {
    let chan = new_channel(device)?;
    // SAFETY: the channel's fd stays open for as long as the Arc we hand to
    // AsyncFd lives, and AsyncFd owns that Arc.
    unsafe { AsyncFd::register_with_interest(ChannelFd(chan), tokio::io::Interest::READABLE) }
        .map_err(|e| Error::Verbs {
            op: "AsyncFd::register",
            source: e.into(),
        })
}

fn new_channel(device: &Arc<OpenDevice>) -> Result<Arc<CompletionChannel>> {
    crate::verbs::fork::check("ibv_create_comp_channel")?;
    let chan = CompletionChannel::new(&device.ctx).map_err(|e| {
        classify(
            "ibv_create_comp_channel",
            Kind::CompletionChannel,
            &device.limits,
            errno_of!(e, CreateCompletionChannelErrorKind::Ibverbs),
        )
    })?;
    chan.set_nonblocking(true).map_err(|source| Error::Verbs {
        op: "fcntl(O_NONBLOCK)",
        source,
    })?;
    Ok(chan)
}

/// Entries of a CQ shared by connections: 16,384 (or the device's
/// `max_cqe` if smaller), so with the default depths (128 send + 128
/// receive WRs, plus 16) one shared CQ serves 60 QPs. A CQ entry is 32-64
/// bytes of pinned kernel memory on most providers, so a shared CQ is about
/// what its 60 QPs' own CQs were.
pub(crate) const SHARED_CQ_ENTRIES: u32 = 16384;

/// Creates a CQ of `entries` entries reporting to `channel`.
fn create_cq(
    device: &OpenDevice,
    channel: &Arc<CompletionChannel>,
    entries: u32,
) -> Result<Arc<BasicCompletionQueue>> {
    device
        .ctx
        .create_cq_builder()
        .setup_cqe(entries)
        .setup_comp_channel(channel, 0)
        .build()
        .map_err(|e| {
            classify(
                "ibv_create_cq",
                Kind::CompletionQueue,
                &device.limits,
                errno_of!(e, CreateCompletionQueueErrorKind::Ibverbs),
            )
        })
}

fn raw_cq(cq: &BasicCompletionQueue) -> *mut ibv_cq {
    // SAFETY: only the address is taken; callers use it while `cq` lives.
    unsafe { cq.cq().as_ptr() }
}

/// Requests a completion event for the next completion on `cq`, or the
/// next solicited one (`ibv_req_notify_cq`).
fn arm_cq(cq: &BasicCompletionQueue, solicited_only: bool) -> Result<()> {
    crate::verbs::fork::check("ibv_req_notify_cq")?;
    // SAFETY: `cq` is a live CQ (borrowed for the call).
    let ret = unsafe { ibv_req_notify_cq(raw_cq(cq), i32::from(solicited_only)) };
    if ret != 0 {
        return Err(Error::Verbs {
            op: "ibv_req_notify_cq",
            source: io::Error::from_raw_os_error(ret),
        });
    }
    Ok(())
}

/// Work completions per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// The array `ibv_poll_cq` fills: zeroed once, and afterwards only the
/// entries the last poll filled (`dirty`), before the next poll. A
/// provider leaves fields of a completion unwritten (mlx5 the opcode of a
/// failed one, `imm_data` without immediate data), which then read as 0
/// as with a fresh zeroed array; zeroing all 32 entries (1,536 bytes) per
/// poll was 1.3 % of a 64 B ping-pong client's CPU samples under icount
/// (benches/history/copies-under-icount-2026-12-07.md).
struct WcArray {
    wcs: [ibv_wc; POLL_BATCH],
    dirty: usize,
}

impl WcArray {
    fn new() -> WcArray {
        WcArray {
            // SAFETY: `ibv_wc` is plain data (integers and a union of
            // integers); all-zero is a valid value.
            wcs: unsafe { std::mem::zeroed() },
            dirty: 0,
        }
    }

    /// Polls every work completion queued on `cq` and hands each to `each`.
    fn poll(&mut self, cq: &BasicCompletionQueue, each: &mut impl FnMut(&ibv_wc)) -> Result<()> {
        loop {
            // SAFETY: the first `dirty` entries lie inside `wcs`, and
            // all-zero is a valid `ibv_wc` (see `new`).
            unsafe { std::ptr::write_bytes(self.wcs.as_mut_ptr(), 0, self.dirty) };
            self.dirty = 0;
            // SAFETY: `cq` is live (borrowed for the call) and `wcs` has
            // room for POLL_BATCH entries. Polls of one CQ are serialised
            // by its owner (a connection's lock for its own CQ, the routes
            // lock for a shared one), as libibverbs expects of one poller
            // per CQ.
            let n = unsafe { ibv_poll_cq(raw_cq(cq), POLL_BATCH as i32, self.wcs.as_mut_ptr()) };
            let Ok(n) = usize::try_from(n) else {
                return Err(Error::Verbs {
                    op: "ibv_poll_cq",
                    source: io::Error::from_raw_os_error(n.saturating_neg()),
                });
            };
            let n = n.min(POLL_BATCH);
            // Recorded before `each` runs: zeroed at the next poll even if
            // `each` unwinds.
            self.dirty = n;
            for wc in &self.wcs[..n] {
                each(wc);
            }
            if n < POLL_BATCH {
                return Ok(());
            }
        }
    }
}

thread_local! {
    /// This thread's [`WcArray`]: no allocation and no zeroing of the
    /// whole array per poll.
    static WC_ARRAY: std::cell::RefCell<WcArray> = std::cell::RefCell::new(WcArray::new());
}

/// Polls every work completion queued on `cq` (`ibv_poll_cq`, 32 at a
/// time into this thread's [`WcArray`]: no allocation) and hands each to
/// `each`.
fn poll_cq(cq: &BasicCompletionQueue, mut each: impl FnMut(&ibv_wc)) -> Result<()> {
    crate::verbs::fork::check("ibv_poll_cq")?;
    WC_ARRAY.with(|array| match array.try_borrow_mut() {
        Ok(mut array) => array.poll(cq, &mut each),
        // A poll from inside `each` (none does that today): an array of
        // its own.
        Err(_) => WcArray::new().poll(cq, &mut each),
    })
}

/// The CQ of one QP: its own, or a seat on a CQ its runtime's connections
/// share (see the module docs).
pub(crate) enum QpCq {
    /// A CQ of the QP's own, on the channel of [`CqEvents::Own`], or on
    /// the hub's channel (`hub`: routed there by its address until the QP
    /// is destroyed).
    Own {
        cq: ParentOnly<Arc<BasicCompletionQueue>>,
        hub: Option<Arc<CqHub>>,
        _counted: Counted,
    },
    /// A seat on a shared CQ and the inbox its completions are handed to.
    Shared { seat: Seat, inbox: Arc<Inbox> },
}

/// Whether the process holds half the device's `max_cq` CQs of their own
/// (the other half left to other processes and to shared CQs); unknown
/// limits (0) never count as reached.
fn own_cqs_at_limit(device: &OpenDevice) -> bool {
    let own = live(Kind::CompletionQueue).saturating_sub(live(Kind::SharedCompletionQueue));
    at_half(own, device.limits.max_cq)
}

/// Whether `own` CQs reach half of `max_cq` (never for an unknown 0).
fn at_half(own: u64, max_cq: u64) -> bool {
    max_cq > 0 && own >= max_cq / 2
}

impl QpCq {
    /// A CQ for a QP whose completions go to `events`, sized for `entries`
    /// outstanding completions (send plus receive depth, plus slack): a CQ
    /// of its own, or a seat on one of the hub's shared CQs when `share`
    /// asks for one or the process holds half the device's `max_cq` CQs of
    /// their own.
    ///
    /// # Errors
    /// `ibv_create_cq`'s (`Error::ResourceLimit` at the device's `max_cq`)
    /// when a new CQ is needed and cannot be created.
    pub(crate) fn new(
        device: &OpenDevice,
        events: &CqEvents,
        entries: u32,
        share: bool,
    ) -> Result<QpCq> {
        match events {
            CqEvents::Own { fd, .. } => Ok(QpCq::Own {
                cq: ParentOnly::new(create_cq(device, &fd.get_ref().0, entries)?),
                hub: None,
                _counted: Counted::new(Kind::CompletionQueue),
            }),
            CqEvents::Shared { hub, signal } if !share && !own_cqs_at_limit(device) => {
                let cq = create_cq(device, hub.channel(), entries)?;
                // An entry still there can only be a destroyed shared CQ's
                // (those are removed lazily): a live CQ has another address.
                let earlier =
                    lock(&hub.routes).insert(raw_cq(&cq) as usize, Route::Cq(Arc::clone(signal)));
                debug_assert!(
                    match &earlier {
                        None => true,
                        Some(Route::Shared(e)) => e.cq.strong_count() == 0,
                        Some(Route::Cq(_)) => false,
                    },
                    "a live CQ's address routed twice"
                );
                Ok(QpCq::Own {
                    cq: ParentOnly::new(cq),
                    hub: Some(Arc::clone(hub)),
                    _counted: Counted::new(Kind::CompletionQueue),
                })
            }
            CqEvents::Shared { hub, signal } => Ok(QpCq::Shared {
                seat: hub.seat(device, entries)?,
                inbox: Arc::new(Inbox {
                    wcs: Mutex::new(Vec::new()),
                    signal: Arc::clone(signal),
                }),
            }),
        }
    }

    /// The CQ to create the QP with (as its send and receive CQ).
    pub(crate) fn completion_queue(&self) -> &Arc<BasicCompletionQueue> {
        match self {
            QpCq::Own { cq, .. } => cq,
            QpCq::Shared { seat, .. } => &seat.cq.cq,
        }
    }

    /// Starts handing the shared CQ's completions of QP `qp_num` to this
    /// QP (no-op for a CQ of its own). Called once the QP exists.
    pub(crate) fn route(&self, qp_num: u32) {
        if let QpCq::Shared { seat, inbox } = self {
            let earlier = lock(&seat.cq.routes).insert(qp_num, Arc::clone(inbox));
            debug_assert!(earlier.is_none(), "QP {qp_num} routed twice");
        }
    }

    /// Moves the QP's completions into `out`, in the order the NIC
    /// completed them: every completion that arrived before the call.
    /// Polls its own CQ, or the shared CQ (handing the other QPs'
    /// completions to their inboxes and waking their waiters) and then
    /// takes its inbox.
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_poll_cq` fails.
    pub(crate) fn poll(&self, qp_num: u32, out: &mut Vec<Completion>) -> Result<()> {
        match self {
            QpCq::Own { cq, .. } => poll_cq(cq, |wc| out.push(Completion::from_wc(wc))),
            QpCq::Shared { seat, inbox } => {
                // Waits for a task polling it now rather than skipping: a
                // poll must return every completion that arrived before it
                // (a FIN read before the rdma_cm DISCONNECTED is an end of
                // file, not a reset).
                let polled = seat.cq.hand_out(&lock(&seat.cq.routes), Some(qp_num));
                out.append(&mut lock(&inbox.wcs));
                polled
            }
        }
    }

    /// Arms the CQ for the next completion event, or the next solicited
    /// one (a CQ of its own; a shared CQ is kept armed by its hub, so this
    /// does nothing).
    ///
    /// # Errors
    /// [`Error::Verbs`] if `ibv_req_notify_cq` fails.
    pub(crate) fn arm(&self, solicited_only: bool) -> Result<()> {
        match self {
            QpCq::Own { cq, .. } => arm_cq(cq, solicited_only),
            QpCq::Shared { .. } => Ok(()),
        }
    }

    /// Runs `destroy_qp` (which destroys QP `qp_num`), then stops handing
    /// completions to it. On a shared CQ both happen under the CQ's routes
    /// lock, and the CQ is polled once more in between, so the QP's last
    /// completions reach its own inbox, and a new QP that gets the same
    /// number (only possible once this one is destroyed) is routed only
    /// afterwards.
    pub(crate) fn unroute_after(&self, qp_num: u32, destroy_qp: impl FnOnce()) {
        match self {
            // Its hub route goes in Drop.
            QpCq::Own { .. } => destroy_qp(),
            QpCq::Shared { seat, inbox } => {
                let mut routes = lock(&seat.cq.routes);
                destroy_qp();
                if let Err(e) = seat.cq.hand_out(&routes, Some(qp_num)) {
                    tracing::warn!(error = %e, "polling a shared completion queue failed");
                }
                if routes.get(&qp_num).is_some_and(|r| Arc::ptr_eq(r, inbox)) {
                    routes.remove(&qp_num);
                }
            }
        }
    }
}

impl Drop for QpCq {
    fn drop(&mut self) {
        if crate::verbs::fork::inherited() {
            return; // the parent's route (its lock may be held by a thread the child lacks)
        }
        // Before the CQ is destroyed (the fields drop after this): a CQ
        // created later at the same address must not get this one's route.
        // Events still queued for it are acknowledged by the hub
        // (ibv_destroy_cq waits for that) and dropped. Also runs when the
        // QP's creation failed after the CQ was made.
        if let QpCq::Own {
            cq, hub: Some(hub), ..
        } = self
        {
            lock(&hub.routes).remove(&(raw_cq(cq) as usize));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One QP's completions taken off a shared CQ by whoever polled it, in
/// completion order, and the QP's [`CqSignal`] (the one its tasks wait on).
pub(crate) struct Inbox {
    wcs: Mutex<Vec<Completion>>,
    signal: Arc<CqSignal>,
}

/// A CQ shared by the QPs of one runtime on one device (see the module
/// docs); destroyed when the last QP seated on it is.
pub(crate) struct SharedCq {
    cq: ParentOnly<Arc<BasicCompletionQueue>>,
    /// The inbox of each seated QP by QP number; held while polling, so
    /// one task polls the CQ at a time.
    routes: Mutex<HashMap<u32, Arc<Inbox>>>,
    _counted: [Counted; 2],
}

impl SharedCq {
    /// Polls the CQ (the caller holds `routes`) and hands each completion
    /// to its QP's inbox, waking that QP's waiters except those of `me`
    /// (the caller takes its own inbox next; only `me`'s driver is woken,
    /// for a failed completion). A completion of a QP without
    /// a route (one being created) cannot arrive: a QP is routed before it
    /// is connected.
    fn hand_out(&self, routes: &HashMap<u32, Arc<Inbox>>, me: Option<u32>) -> Result<()> {
        let mut woken: Option<u32> = None;
        poll_cq(&self.cq, |wc| {
            let Some(inbox) = routes.get(&wc.qp_num) else {
                return;
            };
            lock(&inbox.wcs).push(Completion::from_wc(wc));
            // Consecutive completions of one QP wake it once. The poller's
            // own QP is not woken (it takes its inbox next), except its
            // driver for a failed completion, which it must act on.
            if Some(wc.qp_num) != me {
                if woken != Some(wc.qp_num) {
                    inbox.signal.fire();
                    woken = Some(wc.qp_num);
                }
            } else if wc.status != 0 {
                inbox.signal.fire_driver();
            }
        })
    }

    /// An event came for this CQ: re-arm it, then hand out what is queued
    /// (a completion after the arm raises the next event).
    fn on_event(&self) {
        if let Err(e) = arm_cq(&self.cq, false) {
            tracing::warn!(error = %e, "arming a shared completion queue failed");
        }
        if let Err(e) = self.hand_out(&lock(&self.routes), None) {
            tracing::warn!(error = %e, "polling a shared completion queue failed");
        }
    }
}

/// A QP's place on a [`SharedCq`]: its reserved entries, given back when
/// dropped (after the QP is destroyed).
pub(crate) struct Seat {
    cq: Arc<SharedCq>,
    hub: Arc<CqHub>,
    entries: u32,
}

impl Drop for Seat {
    fn drop(&mut self) {
        if crate::verbs::fork::inherited() {
            return; // as for `QpCq`
        }
        let key = raw_cq(&self.cq.cq) as usize;
        if let Some(Route::Shared(e)) = lock(&self.hub.routes).get_mut(&key) {
            e.free += self.entries;
        }
        // `self.cq` is released after the hub's lock: the last release
        // destroys the CQ, which must not happen under that lock (the hub's
        // task takes it before acknowledging events, which
        // `ibv_destroy_cq` waits for).
    }
}

/// Where the hub hands a CQ's events.
enum Route {
    /// A CQ of one QP's own: wake its tasks.
    Cq(Arc<CqSignal>),
    /// A shared CQ: re-arm it and hand out its completions.
    Shared(CqEntry),
}

/// A shared CQ as its hub sees it.
struct CqEntry {
    cq: Weak<SharedCq>,
    /// Entries not reserved by a seated QP.
    free: u32,
}

/// Reads every queued event of `channel` (non-blocking), acknowledges each
/// at once and hands its CQ's address to `each`.
fn drain(channel: &CompletionChannel, mut each: impl FnMut(*mut ibv_cq)) {
    if crate::verbs::fork::inherited() {
        return; // the parent's events
    }
    loop {
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: valid, non-blocking channel (its owner holds it for the
        // call); out-pointers are locals.
        let ret = unsafe { ibv_get_cq_event(channel.comp_channel().as_ptr(), &mut cq, &mut ctx) };
        if ret != 0 {
            return;
        }
        each(cq);
        // SAFETY: acknowledges the one event just read for `cq`, which is
        // still alive: ibv_destroy_cq waits until every event it reported
        // is acknowledged.
        unsafe { ibv_ack_cq_events(cq, 1) };
    }
}

/// A runtime's completion channel on one device and the CQs reporting to
/// it (see the module docs).
pub(crate) struct CqHub {
    fd: ParentOnly<AsyncFd<ChannelFd>>,
    /// The CQs on this hub's channel, by the CQ's address
    /// (`ibv_get_cq_event` returns it). A QP's own CQ is removed before it
    /// is destroyed; a shared CQ's entry whose CQ is gone is removed by the
    /// next [`seat`](Self::seat), and a CQ created later at the same
    /// address replaces it (the old one's events were all read and
    /// acknowledged before `ibv_destroy_cq` returned).
    routes: Mutex<HashMap<usize, Route>>,
    /// Cleared when the hub's task ends (its runtime shut down, or the
    /// device went).
    alive: AtomicBool,
    /// Notified when the device goes (`verbs::watch`): the task ends, so
    /// the hub's channel and device are let go once its CQs are.
    device_gone: tokio::sync::Notify,
    _device: Arc<OpenDevice>,
    _counted: Counted,
}

type HubKey = (tokio::runtime::Id, usize);

static HUBS: Mutex<Option<HashMap<HubKey, Weak<CqHub>>>> = Mutex::new(None);

impl CqHub {
    /// The current runtime's hub for `device`, created (channel, reactor
    /// registration, task) on first use. Errors: `ibv_create_comp_channel`'s
    /// (`Error::ResourceLimit` naming file descriptors on EMFILE), or
    /// `Error::Verbs` if the fd cannot be registered with the reactor.
    /// Outside a tokio runtime: `Error::Verbs`.
    pub(crate) fn for_current(device: &Arc<OpenDevice>) -> Result<Arc<CqHub>> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| Error::Verbs {
            op: "completion events outside a tokio runtime",
            source: io::Error::other(e),
        })?;
        let key = (runtime.id(), Arc::as_ptr(device) as usize);
        let mut hubs = lock(&HUBS);
        let hubs = hubs.get_or_insert_with(HashMap::new);
        if let Some(hub) = hubs.get(&key).and_then(Weak::upgrade)
            && hub.alive.load(Ordering::Acquire)
        {
            return Ok(hub);
        }
        let chan = new_channel(device)?;
        // SAFETY: the channel's fd stays open for as long as the Arc we
        // hand to AsyncFd lives, and AsyncFd owns that Arc.
        let fd = unsafe {
            AsyncFd::register_with_interest(ChannelFd(chan), tokio::io::Interest::READABLE)
        }
        .map_err(|e| Error::Verbs {
            op: "AsyncFd::register",
            source: e.into(),
        })?;
        let hub = Arc::new(CqHub {
            fd: ParentOnly::new(fd),
            routes: Mutex::new(HashMap::new()),
            alive: AtomicBool::new(true),
            device_gone: tokio::sync::Notify::new(),
            _device: Arc::clone(device),
            _counted: Counted::new(Kind::SharedChannel),
        });
        let weak = Arc::downgrade(&hub);
        device.watch.on_removed(move || {
            if let Some(h) = weak.upgrade() {
                h.device_gone.notify_one();
            }
        });
        // Drop hubs of runtimes that are gone.
        hubs.retain(|_, w| w.strong_count() > 0);
        hubs.insert(key, Arc::downgrade(&hub));
        runtime.spawn(dispatch(Arc::clone(&hub)));
        Ok(hub)
    }

    /// The channel CQs are created on.
    pub(crate) fn channel(&self) -> &Arc<CompletionChannel> {
        &self.fd.get_ref().0
    }

    /// A seat for a QP that needs `entries` CQ entries: on a shared CQ with
    /// room, or on a new one (created armed).
    ///
    /// # Errors
    /// `ibv_create_cq`'s, or `ibv_req_notify_cq`'s for a new CQ.
    fn seat(self: &Arc<Self>, device: &OpenDevice, entries: u32) -> Result<Seat> {
        let mut routes = lock(&self.routes);
        routes.retain(|_, r| !matches!(r, Route::Shared(e) if e.cq.strong_count() == 0));
        for r in routes.values_mut() {
            if let Route::Shared(e) = r
                && e.free >= entries
                && let Some(cq) = e.cq.upgrade()
            {
                e.free -= entries;
                return Ok(Seat {
                    cq,
                    hub: Arc::clone(self),
                    entries,
                });
            }
        }
        // A device that did not say its max_cqe (0) gets the default.
        let max_cqe = if device.max_cqe == 0 {
            SHARED_CQ_ENTRIES
        } else {
            device.max_cqe
        };
        let size = SHARED_CQ_ENTRIES.min(max_cqe).max(entries);
        let cq = create_cq(device, self.channel(), size)?;
        let counted = [
            Counted::new(Kind::CompletionQueue),
            Counted::new(Kind::SharedCompletionQueue),
        ];
        arm_cq(&cq, false)?;
        let shared = Arc::new(SharedCq {
            cq: ParentOnly::new(cq),
            routes: Mutex::new(HashMap::new()),
            _counted: counted,
        });
        routes.insert(
            raw_cq(&shared.cq) as usize,
            Route::Shared(CqEntry {
                cq: Arc::downgrade(&shared),
                free: size - entries,
            }),
        );
        Ok(Seat {
            cq: shared,
            hub: Arc::clone(self),
            entries,
        })
    }

    /// Reads every queued event and acknowledges it: fires the signal of a
    /// QP's own CQ, and re-arms and polls each shared CQ that had one
    /// (both looked up before the acknowledgement, while the CQ surely
    /// lives; a shared CQ is released after it, as its last release
    /// destroys the CQ).
    fn drain(&self) {
        let mut hit: Vec<Arc<SharedCq>> = Vec::new();
        drain(self.channel(), |cq| {
            let (signal, shared) = match lock(&self.routes).get(&(cq as usize)) {
                Some(Route::Cq(s)) => (Some(Arc::clone(s)), None),
                Some(Route::Shared(e)) => (None, e.cq.upgrade()),
                None => (None, None),
            };
            if let Some(s) = signal {
                s.fire();
            }
            if let Some(s) = shared
                && !hit.iter().any(|h| Arc::ptr_eq(h, &s))
            {
                hit.push(s);
            }
        });
        for s in hit {
            s.on_event();
        }
    }
}

/// Clears `alive` when the hub's task ends (returns or is dropped with its
/// runtime).
struct AliveGuard(Arc<CqHub>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
    }
}

/// The hub's task: drain on every readiness of the channel.
async fn dispatch(hub: Arc<CqHub>) {
    let _own = crate::verbs::tasks::OwnTask::new();
    let guard = AliveGuard(hub);
    let hub = &guard.0;
    loop {
        let ready = tokio::select! {
            r = hub.fd.readable() => r,
            _ = hub.device_gone.notified() => return,
        };
        let Ok(mut ready) = ready else {
            tracing::warn!("a completion channel left the reactor");
            return;
        };
        hub.drain();
        ready.clear_ready();
    }
}

#[cfg(test)]
mod tests {
    use super::{CqSignal, Delegation, at_half, lock};
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, Wake, Waker};

    #[test]
    fn connections_share_cqs_from_half_the_device_limit_on() {
        // A device with 16,384 CQs (rxe in the guest has 1,048,576).
        assert!(!at_half(8191, 16_384));
        assert!(at_half(8192, 16_384));
        assert!(at_half(9000, 16_384));
        // A device that reports no limit never forces sharing.
        assert!(!at_half(1 << 40, 0));
        assert!(at_half(0, 1));
    }

    /// Records its name in `order` when woken.
    struct Named(&'static str, Arc<Mutex<Vec<&'static str>>>);
    impl Wake for Named {
        fn wake(self: Arc<Self>) {
            self.1.lock().unwrap().push(self.0);
        }
    }

    /// The names of the wakers woken, in order.
    type Order = Arc<Mutex<Vec<&'static str>>>;

    fn waker(name: &'static str, order: &Order) -> Waker {
        Waker::from(Arc::new(Named(name, Arc::clone(order))))
    }

    /// One `poll_take` by the task of `waker` (the driver's if `driver`).
    fn take(s: &CqSignal, waker: &Waker, driver: bool) -> Poll<()> {
        s.poll_take(&mut Context::from_waker(waker), driver)
    }

    #[test]
    fn an_event_wakes_every_waiter_once_application_tasks_before_the_driver_which_sees_every_event()
    {
        let order = Arc::new(Mutex::new(Vec::new()));
        let (reader, writer, driver) = (
            waker("reader", &order),
            waker("writer", &order),
            waker("driver", &order),
        );
        let s = CqSignal::default();
        // The driver registers first, as it usually does.
        assert_eq!(take(&s, &driver, true), Poll::Pending);
        assert_eq!(take(&s, &reader, false), Poll::Pending);
        assert_eq!(take(&s, &reader, false), Poll::Pending);
        assert_eq!(take(&s, &writer, false), Poll::Pending);
        s.fire();
        assert_eq!(*order.lock().unwrap(), ["reader", "writer", "driver"]);
        // The first application task to look takes the event, the others
        // wait for the next; the driver sees every event (its own flag).
        assert_eq!(take(&s, &reader, false), Poll::Ready(()));
        assert_eq!(take(&s, &writer, false), Poll::Pending);
        assert_eq!(take(&s, &driver, true), Poll::Ready(()));
        assert_eq!(take(&s, &driver, true), Poll::Pending);
        s.fire();
        assert_eq!(
            *order.lock().unwrap(),
            ["reader", "writer", "driver", "writer", "driver"]
        );
        // An event with nobody waiting is kept for the next look.
        s.fire();
        assert_eq!(order.lock().unwrap().len(), 5);
        assert_eq!(take(&s, &writer, false), Poll::Ready(()));
        assert_eq!(take(&s, &writer, false), Poll::Pending);
        // The driver alone (a failed completion an application task took):
        // the waiting application task is not woken.
        assert_eq!(take(&s, &driver, true), Poll::Ready(()));
        assert_eq!(take(&s, &driver, true), Poll::Pending);
        s.fire_driver();
        assert_eq!(order.lock().unwrap().len(), 6);
        assert_eq!(order.lock().unwrap()[5], "driver");
        assert_eq!(take(&s, &driver, true), Poll::Ready(()));
        assert_eq!(take(&s, &writer, false), Poll::Pending);
    }

    /// A gate, the list of wake-ups its driver registrations got, and an
    /// event: the driver registers (as `take_as_driver` does), then the
    /// reactor wakes the gate.
    fn gate() -> (Order, Arc<Delegation>, impl Fn(&Arc<Delegation>)) {
        let order = Arc::new(Mutex::new(Vec::new()));
        let d = Arc::new(Delegation::default());
        let gate = Waker::from(Arc::clone(&d));
        let woken = Arc::clone(&order);
        let event = move |d: &Arc<Delegation>| {
            *lock(&d.driver) = Some(waker("driver", &woken));
            gate.wake_by_ref();
        };
        (order, d, event)
    }

    #[test]
    fn the_gate_leaves_an_event_to_a_parked_reader_only_while_the_driver_filters() {
        let (order, d, event) = gate();
        let park = |d: &Delegation| d.app_parked.store(true, Ordering::Release);
        // Not filtering, no reader parked: the driver is woken and does
        // not start filtering.
        event(&d);
        assert_eq!(order.lock().unwrap().len(), 1);
        assert!(!d.filtering());
        // Not filtering, a reader parked: this event still wakes the
        // driver, and filtering starts at it (the driver's tick follows).
        park(&d);
        event(&d);
        assert_eq!(order.lock().unwrap().len(), 2);
        assert!(d.filtering());
        assert_eq!(d.left(), 0);
        // Filtering, no reader parked: the driver is woken.
        d.unpark();
        event(&d);
        assert_eq!(order.lock().unwrap().len(), 3);
        assert_eq!(d.left(), 0);
        // Filtering with a parked reader: left to it and counted.
        park(&d);
        event(&d);
        event(&d);
        assert_eq!(order.lock().unwrap().len(), 3);
        assert_eq!(d.left(), 2);
        // The reader took an event: the tick goes on filtering, and the
        // next event (the reader not parked) wakes the driver.
        d.took();
        assert!(!d.app_parked());
        d.on_tick();
        assert!(d.filtering());
        event(&d);
        assert_eq!(*order.lock().unwrap(), ["driver"; 4]);
        // A tick that left nothing while the reader found its data (a
        // spin answered it): busy, the driver goes on filtering.
        d.unpark();
        d.on_tick();
        assert!(d.filtering());
        // A tick in which nothing happened: idle, the driver stops.
        d.on_tick();
        assert!(!d.filtering());
        park(&d);
        event(&d);
        assert_eq!(order.lock().unwrap().len(), 5);
        assert_eq!(d.left(), 2);
        assert!(d.filtering());
        // Events left that no reader took (its read was dropped while
        // parked): the tick forgets the parked reader and stops filtering.
        event(&d);
        assert_eq!((order.lock().unwrap().len(), d.left()), (5, 3));
        d.on_tick();
        assert!(!d.filtering());
        assert!(!d.app_parked());
        event(&d);
        assert_eq!(order.lock().unwrap().len(), 6);
        assert!(!d.filtering());
    }

    #[test]
    fn the_gate_leaves_an_event_to_a_spinning_reader_as_to_a_parked_one() {
        let (order, d, event) = gate();
        // A spin while not filtering: the first event still wakes the
        // driver and starts filtering (its tick follows).
        let first = d.spinning();
        event(&d);
        assert_eq!(order.lock().unwrap().len(), 1);
        assert!(d.filtering());
        // Later events of the spin are left to the spinner and counted.
        event(&d);
        event(&d);
        assert_eq!((order.lock().unwrap().len(), d.left()), (1, 2));
        // A second task spins too, and the first one's spin ends: the
        // second still polls the CQ, so the event is left to it.
        let second = d.spinning();
        drop(first);
        event(&d);
        assert_eq!((order.lock().unwrap().len(), d.left()), (1, 3));
        // The last spin ended (the reader returned with its data): the
        // next event wakes the driver again.
        drop(second);
        event(&d);
        assert_eq!((order.lock().unwrap().len(), d.left()), (2, 3));
        // Left events nobody took from the channel and no read found
        // work: the tick stops filtering, as for a parked reader that went
        // away.
        d.on_tick();
        assert!(!d.filtering());
        assert!(!d.app_parked());
    }

    #[test]
    fn a_reader_counts_as_active_from_its_take_or_read_to_the_next_tick() {
        let (order, d, event) = gate();
        assert!(!d.reader_active());
        // A parked reader turns filtering on; a parked reader is not yet
        // at work (one whose read was dropped never will be).
        d.app_parked.store(true, Ordering::Release);
        event(&d);
        assert!(d.filtering() && !d.reader_active());
        // It takes the event: at work until the tick.
        d.took();
        assert!(d.reader_active());
        d.on_tick();
        assert!(d.filtering() && !d.reader_active());
        // A read that found data (a spin, or data already there).
        d.unpark();
        assert!(d.reader_active());
        d.on_tick();
        assert!(d.filtering() && !d.reader_active());
        // A tick with no take and no read: idle, filtering stops.
        d.on_tick();
        assert!(!d.filtering() && !d.reader_active());
        assert_eq!((order.lock().unwrap().len(), d.left()), (1, 0));
    }

    #[test]
    fn a_tick_goes_on_filtering_while_spins_find_work_with_left_events_untaken() {
        let (order, d, event) = gate();
        let spin = d.spinning();
        event(&d);
        assert!(d.filtering());
        event(&d);
        event(&d);
        drop(spin);
        assert_eq!((order.lock().unwrap().len(), d.left()), (1, 2));
        // The spin found the reader's data (it polls the CQ and takes no
        // event): the connection is busy, the driver goes on filtering,
        // and the next spin's events are left to it without a wake-up.
        d.unpark();
        d.on_tick();
        assert!(d.filtering());
        let spin = d.spinning();
        event(&d);
        drop(spin);
        assert_eq!((order.lock().unwrap().len(), d.left()), (1, 3));
        // A stale parked flag is forgotten all the same.
        d.unpark();
        d.app_parked.store(true, Ordering::Release);
        d.on_tick();
        assert!(d.filtering());
        assert!(!d.app_parked());
        // A tick with nothing left, taken or read: idle, it stops.
        d.on_tick();
        assert!(!d.filtering());
        event(&d);
        assert_eq!((order.lock().unwrap().len(), d.left()), (2, 3));
    }
}
