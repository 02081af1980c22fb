//! The connection shared by an endpoint's handles and its driver task, for
//! every endpoint kind: [`Shared`] (state behind one mutex, the handle count,
//! the addresses), [`Handle`] (one application handle), the [`Driven`]
//! trait a kind's state implements, and the one driver loop.
//!
//! The model is quinn's `ConnectionRef`/`ConnectionDriver`: whoever holds the
//! lock makes progress (drains the CQ, reposts receives, returns credit,
//! posts what is ready); the driver does the same whenever the completion
//! channel or the rdma_cm channel fires, so receive progress never waits for
//! the application. A failure is recorded once ([`Driven::fail`]) and wakes
//! every waiter of every kind, each registered in a [`WakerList`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::{Duration, Instant};

use tokio::sync::{Notify, watch};
use tracing::{Instrument, Span, debug, trace};

use crate::error::Error;
use crate::pool::MemoryPool;
use crate::verbs::cm::{CmEventKind, CmId};
use crate::verbs::events::DELEGATION_TICK;
use crate::verbs::rc::{OpenDevice, RcQueuePair};
use crate::verbs::watch::{Registration, Watched};

use super::SpinWait;
use super::spin::SpinDeadline;

/// How often a driver waiting for pool memory looks again even without a
/// notification (a return can race with the waiter's registration).
const MEMORY_RETRY: Duration = Duration::from_millis(5);

/// How long a failed connection waits for its ABORT to reach the peer
/// before it disconnects anyway.
pub(crate) const ABORT_GRACE: Duration = Duration::from_secs(1);

/// The wakers of every task waiting for one kind of event. Unlike a single
/// `Option<Waker>`, a second task's registration never evicts the first's:
/// both are woken. A task that polls again is registered once
/// (`Waker::will_wake`).
#[derive(Debug, Default)]
pub(crate) struct WakerList(Vec<Waker>);

impl WakerList {
    /// Adds `waker` unless it is registered already.
    pub(crate) fn register(&mut self, waker: &Waker) {
        if !self.0.iter().any(|w| w.will_wake(waker)) {
            self.0.push(waker.clone());
        }
    }

    /// Wakes and forgets every registered task.
    pub(crate) fn wake_all(&mut self) {
        for w in self.0.drain(..) {
            w.wake();
        }
    }

    /// Registered wakers.
    #[cfg(any(test, tokio_rdma_guest))]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no task is registered.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What a kind of endpoint (byte stream, message endpoint) gives the
/// driver: its state behind the connection's mutex.
pub(crate) trait Driven: Send + 'static {
    /// The queue pair (and its CQ).
    fn qp(&self) -> &RcQueuePair;
    /// The queue pair, mutably.
    fn qp_mut(&mut self) -> &mut RcQueuePair;
    /// Drains the CQ and does every follow-up (reposting, credit, posting
    /// what is ready, waking whoever can go on).
    fn progress(&mut self);
    /// Records `err` as the connection's error (the first one wins) and
    /// wakes every waiter.
    fn fail(&mut self, err: Error);
    /// Every application handle is gone: start closing (a stream queues its
    /// FIN after the buffered bytes).
    fn on_last_handle(&mut self);
    /// Nothing is left to deliver to the peer, or the connection is dead:
    /// with no handle left the driver disconnects.
    fn finished(&self) -> bool;
    /// rdma_cm reported `DISCONNECTED`: the peer is gone (after its FIN, or
    /// without one).
    fn on_disconnected(&mut self);
    /// The driver has disconnected: nothing more is sent or received; wake
    /// every waiter.
    fn on_closed(&mut self);
    /// Whether the connection is usable (no error, peer not gone, not
    /// closing): only then does the driver probe it.
    fn alive(&self) -> bool;
    /// Whether the peer can still answer a probe: no error recorded, and
    /// the peer neither disconnected nor closed (this side may be
    /// closing).
    fn peer_connected(&self) -> bool;

    /// Whether the connection failed: `None` while healthy; `Some(true)`
    /// once an error is recorded and any ABORT owed to the peer is out;
    /// `Some(false)` while that ABORT is still being delivered. The driver
    /// then disconnects (at once, or after [`ABORT_GRACE`]), handles or
    /// not, so the peer learns of the failure (rdma_cm DISCONNECTED, TCP's
    /// RST) instead of retrying into a QP in the error state.
    fn failure(&self) -> Option<bool>;

    /// No completion came for the keepalive time (`idle`; the driver's
    /// wake-ups and ticks do not count, so a send outstanding on a queue
    /// pair that stopped making progress is probed too): probe the
    /// peer (a zero-length RDMA WRITE, a READ on iWARP:
    /// [`RcQueuePair::post_probe`]; a peer that is gone fails it after
    /// the retry bound, which fails the connection). A previous probe
    /// still neither acknowledged nor failed a whole idle period later
    /// means the queue pair stopped making progress without an error (rxe
    /// does this when an RDMA READ's retry wedges its requester, and to a
    /// busy queue pair now and then when its link went down and came back
    /// within the retry bound): that
    /// fails the connection with [`Error::KeepaliveTimeout`].
    fn probe(&mut self, idle: Duration) {
        if !self.alive() {
            return;
        }
        self.progress();
        if self.qp().probe_outstanding() {
            self.fail(Error::KeepaliveTimeout { idle });
            return;
        }
        if let Err(e) = self.qp_mut().post_probe() {
            self.fail(e);
        }
    }

    /// Whether the CQ may be armed for solicited completions only (see
    /// [`RcQueuePair::arm`]): no application task waits for one of this
    /// side's send completions, and the driver does not either (closing,
    /// a failure, a keepalive probe in flight). Then the peer's data and
    /// control messages wake a parked reader, and its own send
    /// completions, polled with the next receive, wake nobody (on a
    /// parked ping-pong they were one extra wake-up per round trip, see
    /// benches/history/echo-2026-12-01-to-03.md, "Solicited events, and
    /// where the multi-thread runtime's round trip goes"). Default: every
    /// completion raises the event.
    fn solicited_events_suffice(&self) -> bool {
        false
    }

    /// Work is due that no completion event will announce, so the driver
    /// looks again after [`DELEGATION_TICK`]: send completions a CQ armed
    /// for solicited events only does not announce, which free something
    /// (an idle stream gives back its send buffer then), or arrived bytes
    /// a reader left in a stream's ring (moved out after a tick without
    /// reads, see [`Driven::on_tick`]). An application task that posts or
    /// leaves such bytes calls [`Shared::ensure_tick`].
    fn needs_tick(&self) -> bool {
        false
    }

    /// Whether the tick is due on schedule however often other wake-ups
    /// come (a deadline kept across them), because the peer may be waiting
    /// for what it does: a stream's bytes a reader left in the ring. Other
    /// ticks start again at every wake-up, which already looked at the
    /// connection (on the multi-thread runtime ticks on schedule in a
    /// 64 B ping-pong measured slower: benches/history/echo-2026-12-04.md, "Small reads
    /// copy once").
    fn tick_on_schedule(&self) -> bool {
        false
    }

    /// The driver's tick fired (it was waiting with its tick, see
    /// [`Driven::needs_tick`]); called before the tick's progress.
    fn on_tick(&mut self) {}

    /// The pool whose returned memory progress is waiting for, if any.
    fn waiting_for_memory(&self) -> Option<MemoryPool> {
        None
    }

    /// Drain, arm, drain again: the completion channel is edge triggered, so
    /// a completion that lands between the drain and the arm would otherwise
    /// never raise an event.
    fn progress_and_arm(&mut self)
    where
        Self: Sized,
    {
        self.progress_and_arm_with(Self::progress);
    }

    /// [`progress_and_arm`](Self::progress_and_arm) with another way to
    /// drain (a stream reader's, which leaves arrived bytes in the ring).
    fn progress_and_arm_with(&mut self, progress: fn(&mut Self))
    where
        Self: Sized,
    {
        progress(self);
        self.arm_and_progress_with(progress);
    }

    /// The second half of
    /// [`progress_and_arm_with`](Self::progress_and_arm_with), for a
    /// caller that has just drained: arm, then drain again.
    fn arm_and_progress_with(&mut self, progress: fn(&mut Self))
    where
        Self: Sized,
    {
        let solicited_only = self.solicited_events_suffice();
        match self.qp().arm(solicited_only) {
            Ok(()) => self.on_armed(solicited_only),
            Err(e) => self.fail(e),
        }
        progress(self);
    }

    /// After a drain: arm the CQ again (then drain once more), unless
    /// `left_to_reader` (the driver leaves events to a reader at work,
    /// [`Delegation::leaves_cq_unarmed`]) and nothing waits on a send
    /// completion. Then the CQ stays unarmed: the reader arms before it
    /// parks (and a blocked writer or sender for itself), and the driver's
    /// tick looks at the connection. An arm that outlives its need made
    /// the completion that lands while the reader is inside its next write
    /// (neither parked nor spinning then) raise an event that woke the
    /// driver to meet the reader on the lock (benches/history/echo-2026-12-05.md, "Arms
    /// left over wake the driver"). An unarmed CQ counts as a narrow arm
    /// ([`on_armed`](Self::on_armed) with `true`): a task that starts
    /// waiting on a send completion arms for itself.
    ///
    /// [`Delegation::leaves_cq_unarmed`]: crate::verbs::events::Delegation::leaves_cq_unarmed
    fn arm_unless_left_to_reader(&mut self, left_to_reader: bool, progress: fn(&mut Self))
    where
        Self: Sized,
    {
        if left_to_reader && self.solicited_events_suffice() {
            self.on_armed(true);
        } else {
            self.arm_and_progress_with(progress);
        }
    }

    /// The CQ was armed, for solicited events only or for every
    /// completion (a kind that narrows its arm keeps track of it, to widen
    /// it again when a task starts waiting on a send completion). The
    /// driver also reports a round that left the CQ unarmed as `true`:
    /// a task that starts waiting on a send completion must arm then too.
    fn on_armed(&mut self, _solicited_only: bool) {}
}

/// One connection: the kind's state behind a mutex, shared by the
/// application's handles and the driver task.
pub(crate) struct Shared<D> {
    state: Mutex<D>,
    /// Wakes the driver (the last handle dropped, or work to re-check).
    notify: Notify,
    /// Set once an application task woke the driver for a failure.
    failure_nudged: AtomicBool,
    /// Live application handles (a stream or a half, an endpoint or a clone).
    handles: AtomicUsize,
    /// Times [`Shared::lock`] found the lock held and waited.
    lock_waits: AtomicU64,
    /// Times the driver woke up.
    driver_wakeups: AtomicU64,
    /// The driver waits with its tick (leaving events to a reader, send
    /// completions due that no event announces, or bytes a reader left in
    /// a stream's ring; see [`Driven::needs_tick`]).
    driver_ticking: AtomicBool,
    /// Set (`true`) once the driver has disconnected.
    closed: watch::Sender<bool>,
    /// The local address (IP and rdma_cm port).
    pub(crate) local_addr: SocketAddr,
    /// The peer's address.
    pub(crate) peer_addr: SocketAddr,
    /// The local QP number.
    pub(crate) qp_num: u32,
    /// The path MTU both QPs use, bytes (0 on iWARP).
    pub(crate) path_mtu: u32,
    /// The RDMA device, for example `rxe0`.
    pub(crate) device: String,
}

static CONN_IDS: AtomicU64 = AtomicU64::new(1);

impl<D: Driven> Shared<D> {
    /// Locks the state (a poisoned lock is taken over: the state is kept
    /// consistent at every await-free step).
    pub(crate) fn lock(&self) -> MutexGuard<'_, D> {
        match self.state.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                self.lock_waits.fetch_add(1, Ordering::Relaxed);
                self.state.lock().unwrap_or_else(|p| p.into_inner())
            }
        }
    }

    /// Times a task found the lock held and waited, and times the driver
    /// woke up (`ConnectionStats::lock_waits`, `driver_wakeups`).
    pub(crate) fn contention(&self) -> (u64, u64) {
        (
            self.lock_waits.load(Ordering::Relaxed),
            self.driver_wakeups.load(Ordering::Relaxed),
        )
    }

    /// Live application handles.
    pub(crate) fn handles(&self) -> usize {
        self.handles.load(Ordering::Acquire)
    }

    /// Resolves once the driver has disconnected (every handle dropped and
    /// everything delivered, or the connection failed or lingered out).
    pub(crate) fn wait_closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.closed.subscribe();
        async move {
            let _ = rx.wait_for(|closed| *closed).await;
        }
    }

    /// The spin of a task that found nothing to receive, for what its
    /// [`SpinWait`] allows: polls the CQ (`progress`) until `ready` or the
    /// deadline, releasing the lock between polls so the driver and the
    /// other half can take it. The spin holds the task's thread: on a
    /// `current_thread` runtime every other task of it waits meanwhile
    /// (tokio's rule of thumb is 10 to 100 us between `.await`s; the
    /// adaptive limit starts at 100 us and grows past it only where a park
    /// is measured to cost more, see `WaitStrategy::Adaptive`).
    /// It reads the clock once per [`super::spin::POLLS_PER_CLOCK_READ`]
    /// polls, so it may overshoot the deadline by that many polls, and
    /// not when it finds the answer: the wait's end is estimated from its
    /// readings ([`super::spin::SpinWait::spin_ended`]).
    /// A cooperative spin (one poll per scheduler turn, the task waking
    /// itself) was measured and not kept: for a `block_on` future each turn
    /// costs an eventfd write and an `epoll_wait`, and in the guest it
    /// gained nothing over parking (benches/history/echo-2026-12-01-to-03.md, "Spin, then park").
    pub(crate) fn spin<'a>(
        &'a self,
        mut st: MutexGuard<'a, D>,
        ready: fn(&D) -> bool,
        progress: fn(&mut D),
        wait: fn(&mut D) -> &mut SpinWait,
    ) -> MutexGuard<'a, D> {
        let Some(deadline) = wait(&mut st).begin() else {
            return st;
        };
        // Events that come while this task polls the CQ are left to it
        // (see `Delegation`): the driver is not woken to find nothing.
        let events = st.qp().cq_events();
        let spinning = events.delegation().map(|d| d.spinning());
        let mut deadline = SpinDeadline::new(deadline);
        while !ready(&st) && !deadline.passed(Instant::now) {
            drop(st);
            std::hint::spin_loop();
            st = self.lock();
            progress(&mut st);
        }
        let found = ready(&st);
        wait(&mut st).spin_ended(&deadline, found);
        drop(spinning);
        st
    }

    /// After an application task posted or read: if `st` now has work due
    /// that no event announces (see [`Driven::needs_tick`]) and the driver
    /// waits without its tick, wake it so it starts ticking (once: the
    /// flag is set here until the driver's next wait).
    pub(crate) fn ensure_tick(&self, st: &D) {
        if st.needs_tick() && !self.driver_ticking.swap(true, Ordering::AcqRel) {
            self.notify.notify_one();
        }
    }

    /// Wakes the driver to look at the state again.
    pub(crate) fn nudge(&self) {
        self.notify.notify_one();
    }

    /// Wakes the driver once when `st` (this connection's state, locked by
    /// an application task that just polled the CQ itself) holds a
    /// failure: the driver disconnects, which tells the peer, and would
    /// otherwise see the failure only at its next completion event or
    /// keepalive probe (the task took the completion, and on a CQ polled
    /// before it was armed no event comes).
    pub(crate) fn nudge_if_failed(&self, st: &D) {
        if st.failure().is_some() && !self.failure_nudged.swap(true, Ordering::AcqRel) {
            self.notify.notify_one();
        }
    }
}

/// What the handshake established, to start a connection with.
pub(crate) struct Started<D> {
    /// The kind's state, owning the QP.
    pub state: D,
    /// The rdma_cm id (the driver disconnects and destroys it).
    pub id: CmId,
    /// The RDMA device.
    pub device: String,
    /// Reported as the local/peer address if rdma_cm cannot say.
    pub fallback_addr: SocketAddr,
    /// Bound on delivering after the last handle dropped.
    pub linger: Duration,
    /// Idle time before a keepalive probe (`None`: no keepalive).
    pub keepalive: Option<Duration>,
    /// How long the connection's port may stay down before it fails
    /// (`RdmaConfig::retry_bound`; see `verbs::watch`).
    pub port_grace: Duration,
    /// `"rdma_stream"` or `"rdma_msg"`, the tracing span's name part.
    pub kind: &'static str,
}

/// Builds the shared connection and spawns its driver; returns the first
/// handle.
pub(crate) fn start<D: Driven>(s: Started<D>) -> Handle<D> {
    let local_addr = s.id.local_addr().unwrap_or(s.fallback_addr);
    let peer_addr = s.id.peer_addr().unwrap_or(s.fallback_addr);
    let qp_num = s.state.qp().qp_num();
    let path_mtu = s.state.qp().path_mtu();
    let shared = Arc::new(Shared {
        state: Mutex::new(s.state),
        notify: Notify::new(),
        failure_nudged: AtomicBool::new(false),
        handles: AtomicUsize::new(1),
        lock_waits: AtomicU64::new(0),
        driver_wakeups: AtomicU64::new(0),
        driver_ticking: AtomicBool::new(false),
        closed: watch::Sender::new(false),
        local_addr,
        peer_addr,
        qp_num,
        path_mtu,
        device: s.device,
    });
    let span: Span = tracing::debug_span!(
        "rdma_conn",
        kind = s.kind,
        id = CONN_IDS.fetch_add(1, Ordering::Relaxed),
        local = %local_addr,
        peer = %peer_addr,
        qp = qp_num
    );
    let hook: std::sync::Weak<dyn Watched> = Arc::downgrade(&shared) as _;
    // The device first: registering on a device already gone fails the
    // connection at once, which takes the state's lock.
    let device = Arc::clone(shared.lock().qp().device());
    let watch = device
        .watch
        .register(qp_num, s.id.port_num(), s.port_grace, hook);
    tokio::spawn(drive(Arc::clone(&shared), s.id, s.linger, s.keepalive, watch).instrument(span));
    Handle(shared)
}

/// The device's watch thread fails the connection (its port stayed down,
/// its QP failed, the device went): record the failure, which wakes every
/// waiting task, and wake the driver, which disconnects.
impl<D: Driven> Watched for Shared<D> {
    fn fail_from_device(&self, err: Error) {
        self.lock().fail(err);
        self.notify.notify_one();
    }

    fn qp_failed(&self, err: Error, fail: bool) {
        {
            let mut st = self.lock();
            st.progress();
            if fail && st.alive() {
                st.fail(err);
            }
        }
        self.notify.notify_one();
    }
}

/// The driver: progress on every completion event, rdma_cm events, the last
/// handle's drop, returned pool memory and the linger bound; then
/// disconnect and free.
async fn drive<D: Driven>(
    shared: Arc<Shared<D>>,
    mut id: CmId,
    linger: Duration,
    keepalive: Option<Duration>,
    // Unregistered from the device's watch when the driver ends.
    _watch: Registration,
) {
    debug!("connection established");
    let _own = crate::verbs::tasks::OwnTask::new();
    let cq_events = shared.lock().qp().cq_events();
    // A CQ with a channel of its own: events a parked reader takes can be
    // left to it (see `Delegation`).
    let delegation = cq_events.delegation().cloned();
    // Set once every handle is gone: the bound on delivering what is left.
    let mut linger_deadline: Option<tokio::time::Instant> = None;
    // Set once the connection failed with an ABORT still on its way.
    let mut abort_deadline: Option<tokio::time::Instant> = None;
    let mut woken = false;
    let mut ticked = false;
    // When a tick on schedule fires (`Driven::tick_on_schedule`): one
    // deadline kept across wake-ups, so wake-ups less than a tick apart
    // (the peer's CREDITs while this side writes) do not put it off for
    // ever.
    let mut tick_at: Option<tokio::time::Instant> = None;
    // A clean close where a completion only means "handed to the
    // transport" (iWARP): the probe that confirms the peer processed
    // everything before the disconnect was posted.
    let mut delivery_probed = false;
    // The keepalive's clock: the idle time runs from the last completion
    // polled (by anyone), not from the driver's last wake-up, so ticks and
    // wake-ups that bring no completion (a send outstanding on a queue
    // pair that stopped making progress) do not put the probe off.
    let mut probe_at = keepalive.map(|idle| tokio::time::Instant::now() + idle);
    let mut completions_seen = 0u64;
    loop {
        if woken {
            shared.driver_wakeups.fetch_add(1, Ordering::Relaxed);
        }
        woken = true;
        let (done, memory, ticking, on_schedule, completions) = {
            let mut st = shared.lock();
            if std::mem::take(&mut ticked) {
                st.on_tick();
            }
            // The round's drain may post work of the driver's own (an
            // RDMA READ), so the arm is decided after it. A reader whose
            // read was dropped while parked never counts as at work: the
            // round after a tick arms, and the events then left to it mark
            // it stale at the next tick (`Delegation::on_tick`).
            st.progress();
            // The last handle's close (a FIN, a CLOSE) is posted before the
            // arm is decided, so the arm announces its completion.
            let orphaned = shared.handles() == 0;
            if orphaned && linger_deadline.is_none() {
                linger_deadline = Some(tokio::time::Instant::now() + linger);
                st.on_last_handle();
                st.progress();
            }
            let left_to_reader =
                shared.handles() > 0 && delegation.as_ref().is_some_and(|d| d.leaves_cq_unarmed());
            st.arm_unless_left_to_reader(left_to_reader, D::progress);
            let failed = match st.failure() {
                Some(true) => true,
                Some(false) => {
                    let d = *abort_deadline
                        .get_or_insert_with(|| tokio::time::Instant::now() + ABORT_GRACE);
                    tokio::time::Instant::now() >= d
                }
                None => false,
            };
            // With no handle left no reader will come: take every event
            // (this runs before every wait, so an event that turned
            // leaving on after the last handle dropped is undone before
            // the driver waits).
            if let Some(d) = &delegation
                && shared.handles() == 0
            {
                d.set_filtering(false);
            }
            let ticking = st.needs_tick() || delegation.as_ref().is_some_and(|d| d.filtering());
            // Stored under the lock: a task that makes a tick needed
            // after this (`Shared::ensure_tick`, under the lock too) sees
            // `false` and wakes the driver, whose permit the wait below
            // then takes.
            shared.driver_ticking.store(ticking, Ordering::Release);
            // Closing cleanly: where a completion only says a WR went to
            // the transport (iWARP), post a probe after everything else
            // and wait for it, so the peer has it all before the
            // disconnect (which Soft-iWARP turns into an immediate TCP
            // close). A peer already gone, a failed post and the linger
            // bound end the wait.
            let mut closed = orphaned && st.finished();
            if closed && !failed && st.peer_connected() && st.qp().completes_at_transmit() {
                if !delivery_probed {
                    delivery_probed = true;
                    if let Err(e) = st.qp_mut().post_probe() {
                        debug!(error = %e, "no delivery probe before the disconnect");
                    }
                }
                closed = !st.qp().probe_outstanding();
            }
            (
                closed || failed,
                st.waiting_for_memory(),
                ticking,
                st.tick_on_schedule(),
                st.qp().completions_polled(),
            )
        };
        if done {
            break;
        }
        if let Some(idle) = keepalive
            && completions != completions_seen
        {
            completions_seen = completions;
            probe_at = Some(tokio::time::Instant::now() + idle);
        }
        let next_tick = || tokio::time::Instant::now() + DELEGATION_TICK;
        let tick_deadline = match (ticking, on_schedule) {
            (true, true) => Some(*tick_at.get_or_insert_with(next_tick)),
            (true, false) => {
                tick_at = None;
                Some(next_tick())
            }
            (false, _) => {
                tick_at = None;
                None
            }
        };
        tokio::select! {
            // Completions: progress at the top of the loop. (An event that
            // came while a reader was parked on the CQ turned filtering on
            // at the gate: the next ones are left to the reader.)
            r = cq_events.take_as_driver(ticking) => {
                if r.is_err() {
                    shared.lock().fail(Error::Internal("the completion channel left the reactor".into()));
                    break;
                }
            },
            ev = id.next_event() => match ev {
                Ok(ev) => {
                    trace!(kind = ?ev.kind, "rdma_cm event");
                    match ev.kind {
                        CmEventKind::Disconnected => {
                            let mut st = shared.lock();
                            st.progress();
                            st.on_disconnected();
                        }
                        CmEventKind::DeviceRemoval => {
                            {
                                let mut st = shared.lock();
                                st.progress();
                                st.fail(Error::DeviceRemoved);
                                st.on_disconnected();
                            }
                            // Every other connection on it, and the
                            // caches that hold the device open.
                            crate::verbs::rc::device_removed(&shared.device);
                        }
                        _ => {}
                    }
                }
                Err(source) => shared.lock().fail(Error::Verbs { op: "rdma_get_cm_event", source }),
            },
            _ = shared.notify.notified() => {}
            // Leaving events to a parked or spinning reader, send
            // completions due that no event announces, or bytes a reader
            // left in the ring: look at the connection every tick
            // (progress at the top of the loop). Take every event again
            // after a tick in which no reader took an event and no read
            // found data (idle, or a read dropped while parked: no more
            // ticks).
            _ = async {
                match tick_deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending::<()>().await,
                }
            } => {
                ticked = true;
                tick_at = None;
                if let Some(d) = &delegation {
                    d.on_tick();
                    cq_events.take_left();
                }
            }
            _ = async {
                match &memory {
                    Some(pool) => {
                        let _ = tokio::time::timeout(MEMORY_RETRY, pool.memory_returned()).await;
                    }
                    None => std::future::pending::<()>().await,
                }
            } => {}
            // No completion for the keepalive time (see `probe_at`).
            idle = async {
                match (keepalive, probe_at) {
                    (Some(idle), Some(at)) => {
                        tokio::time::sleep_until(at).await;
                        idle
                    }
                    _ => std::future::pending().await,
                }
            } => {
                trace!("idle: keepalive probe");
                probe_at = Some(tokio::time::Instant::now() + idle);
                shared.lock().probe(idle);
            }
            _ = async {
                match abort_deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => {}
            _ = async {
                match linger_deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => {
                debug!("linger timeout: the peer did not take the remaining data");
                shared.lock().fail(Error::LingerTimeout { timeout: linger });
            }
        }
    }
    debug!("connection closing");
    // No rdma_cm message while the port is down: Soft-RoCE (Linux 6.1)
    // moves its GSI QP to the error state when a MAD (here the DREQ of a
    // disconnect or of destroying a connected id) cannot be sent because
    // its netdev is down, after which no connection on the device can be
    // made until it is re-created. The id waits for the port instead.
    let port = id.port_num();
    let device = Arc::clone(shared.lock().qp().device());
    let port_down = device.port_down(port);
    if !port_down {
        let _ = id.disconnect();
    }
    {
        let mut st = shared.lock();
        st.qp_mut().set_error();
        st.on_closed();
    }
    shared.closed.send_replace(true);
    // The QP and its memory are freed when the last handle's Arc drops;
    // rdma_destroy_id may block in the kernel, so it runs off the runtime.
    if port_down {
        debug!(port, "port down: the rdma_cm id waits for it to come back");
        tokio::spawn(async move {
            port_back(&device, port).await;
            tokio::task::spawn_blocking(move || {
                let _ = id.disconnect();
                drop(id);
            });
        });
    } else {
        tokio::task::spawn_blocking(move || drop(id));
    }
}

/// Returns once `port` of `device` is up again or the device is gone:
/// at each port event, and every [`PORT_POLL`] (the event may lag).
async fn port_back(device: &OpenDevice, port: u8) {
    let mut changed = device.watch.subscribe();
    while !device.watch.is_removed() && device.port_down(port) {
        let _ = tokio::time::timeout(PORT_POLL, changed.changed()).await;
    }
}

/// How often a closing connection waiting for its port looks at it.
const PORT_POLL: Duration = Duration::from_millis(100);

/// One application handle on a connection. The connection closes (a
/// stream: FIN after the buffered data) when the last one drops.
pub(crate) struct Handle<D: Driven>(Arc<Shared<D>>);

impl<D: Driven> Handle<D> {
    /// Another handle on the same connection.
    pub(crate) fn another(&self) -> Self {
        self.0.handles.fetch_add(1, Ordering::AcqRel);
        Handle(Arc::clone(&self.0))
    }

    /// A reference that does not keep the connection open (a grant's).
    pub(crate) fn downgrade(&self) -> std::sync::Weak<Shared<D>> {
        Arc::downgrade(&self.0)
    }

    /// Whether both handles are on one connection.
    pub(crate) fn same_conn(&self, other: &Handle<D>) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl<D: Driven> std::ops::Deref for Handle<D> {
    type Target = Shared<D>;
    fn deref(&self) -> &Shared<D> {
        &self.0
    }
}

impl<D: Driven> Drop for Handle<D> {
    fn drop(&mut self) {
        if self.0.handles.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.notify.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::WakerList;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Wake, Waker};

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn every_registered_task_is_woken_once() {
        let counts: Vec<Arc<Count>> = (0..16)
            .map(|_| Arc::new(Count(AtomicUsize::new(0))))
            .collect();
        let wakers: Vec<Waker> = counts.iter().map(|c| Waker::from(Arc::clone(c))).collect();
        let mut list = WakerList::default();
        for w in &wakers {
            list.register(w);
            list.register(w); // polled twice: still one entry
        }
        assert_eq!(list.len(), 16);
        list.wake_all();
        assert_eq!(list.len(), 0);
        for c in &counts {
            assert_eq!(c.0.load(Ordering::SeqCst), 1);
        }
        list.wake_all();
        for c in &counts {
            assert_eq!(c.0.load(Ordering::SeqCst), 1);
        }
    }
}
