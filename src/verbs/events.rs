//! Completion events: a channel of the connection's own while there are
//! few connections, one channel per tokio runtime and device beyond that.
//!
//! A CQ reports its events to a completion channel (`ibv_comp_channel`,
//! one fd). The first [`DEDICATED_CHANNELS`] live connections of a process
//! (fewer under a small `ulimit -n`) each get a channel of their own,
//! registered with the runtime's reactor,
//! which wakes the connection's tasks directly (a reader waiting in
//! `poll_read` first, the driver after it): the lowest latency. Every
//! further CQ (and any whose own channel cannot be created, for example
//! out of file descriptors) reports to its runtime's [`CqHub`] for that
//! device: one fd and one task that reads each event (`ibv_get_cq_event`
//! names the CQ), acknowledges it at once and fires that CQ's
//! [`CqSignal`], which wakes the tasks waiting on that CQ (application
//! tasks first, then the driver). So thousands of connections cost a few
//! dozen fds, and none beyond the budget; each keeps its own CQ, arming
//! (`ibv_req_notify_cq`) and polling, and a reader still polls its CQ
//! itself. The hub's task is one more hop per parked wake-up; the budget
//! keeps it off the connections of a process that has few.
//!
//! A hub belongs to one runtime because an `AsyncFd` does: it is keyed by
//! `tokio::runtime::Id` and the device, and a hub whose runtime shut down
//! (its task gone) is never handed out again, even if a later runtime gets
//! the same id. A hub lives as long as its runtime (its task holds it) or
//! as long as a CQ on it, whichever is longer.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};

use rdma_mummy_sys::{ibv_ack_cq_events, ibv_cq, ibv_get_cq_event};
use sideway::ibverbs::completion::{CompletionChannel, CreateCompletionChannelErrorKind};
use tokio::io::unix::AsyncFd;

use super::count::{Counted, Kind, classify, rlimit};
use super::rc::OpenDevice;
use crate::error::{Error, Result};

/// Wraps the completion channel for AsyncFd registration.
pub(crate) struct ChannelFd(Arc<CompletionChannel>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// One CQ's event flag and the tasks waiting for it, on a shared channel.
///
/// Application tasks (a reader, `recv`) are woken before the connection's
/// driver task, the order tokio's reactor uses for a channel of the
/// connection's own (its `poll_read_ready` slot before its `readable()`
/// waiters): the reader takes its data before the driver's round.
#[derive(Default)]
pub(crate) struct CqSignal {
    fired: AtomicBool,
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
    fn poll_take(&self, cx: &mut Context<'_>, driver: bool) -> Poll<()> {
        if self.fired.swap(false, Ordering::AcqRel) {
            return Poll::Ready(());
        }
        {
            let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
            if driver {
                w.driver = Some(cx.waker().clone());
            } else if !w.tasks.iter().any(|x| x.will_wake(cx.waker())) {
                w.tasks.push(cx.waker().clone());
            }
        }
        // An event between the swap and the registration set the flag
        // after or before the wake-up list was taken: look again.
        if self.fired.swap(false, Ordering::AcqRel) {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        let w = std::mem::take(&mut *self.waiters.lock().unwrap_or_else(|p| p.into_inner()));
        for t in w.tasks {
            t.wake();
        }
        if let Some(d) = w.driver {
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
/// the Soft-RoCE guest (benches/README.md, "Completion events per
/// runtime"): a CQ on the shared channel adds a task hop to every parked
/// wake-up.
pub(crate) const DEDICATED_CHANNELS: usize = 64;

fn dedicated_budget() -> usize {
    let nofile = rlimit(libc::RLIMIT_NOFILE).unwrap_or(1024);
    DEDICATED_CHANNELS.min(usize::try_from(nofile / 16).unwrap_or(usize::MAX))
}

/// Where one CQ's completion events arrive (see the module docs).
pub(crate) enum CqEvents {
    /// A channel of the CQ's own on the reactor.
    Own {
        fd: AsyncFd<ChannelFd>,
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
    /// budget and the fd limit allow, else the current runtime's hub. The
    /// hub is opened first, with the runtime's first connection on the
    /// device, so a process out of descriptors still has it. Errors: the
    /// hub's ([`CqHub::for_current`]).
    pub(crate) fn new(device: &Arc<OpenDevice>) -> Result<CqEvents> {
        let hub = CqHub::for_current(device)?;
        if let Some(slot) = DedicatedSlot::take() {
            match own_channel(device) {
                Ok(fd) => {
                    return Ok(CqEvents::Own {
                        fd,
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

    /// The channel to create the CQ on.
    pub(crate) fn channel(&self) -> &Arc<CompletionChannel> {
        match self {
            CqEvents::Own { fd, .. } => &fd.get_ref().0,
            CqEvents::Shared { hub, .. } => hub.channel(),
        }
    }

    /// Starts routing the events of the CQ at `cq` (created on
    /// [`channel`](Self::channel)).
    pub(crate) fn attach(&self, cq: *mut ibv_cq) {
        if let CqEvents::Shared { hub, signal } = self {
            hub.routes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(cq as usize, Arc::clone(signal));
        }
    }

    /// Stops routing the CQ at `cq`; called before the CQ is destroyed, so
    /// a later CQ at the same address is never confused with it (its
    /// remaining events are still acknowledged, then dropped).
    pub(crate) fn detach(&self, cq: *mut ibv_cq) {
        if let CqEvents::Shared { hub, .. } = self {
            hub.routes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(cq as usize));
        }
    }

    /// The driver's wait for the next event (woken after the application
    /// tasks). Errors: the channel left the reactor (its runtime is gone).
    pub(crate) async fn take_as_driver(&self) -> io::Result<()> {
        match self {
            // The reactor's waiter list, not the `poll_read_ready` slot,
            // which keeps one task: the reader's.
            CqEvents::Own { fd, .. } => {
                let mut guard = fd.readable().await?;
                drain(fd.get_ref().0.as_ref(), |_| {});
                guard.clear_ready();
                Ok(())
            }
            CqEvents::Shared { signal, .. } => {
                std::future::poll_fn(|cx| signal.poll_take(cx, true)).await;
                Ok(())
            }
        }
    }

    /// For an application task: Ready once an event came (taken and
    /// acknowledged), else registered and Pending. An error (the channel
    /// left the reactor) is the driver's to report.
    pub(crate) fn poll_take(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            CqEvents::Own { fd, .. } => match fd.poll_read_ready(cx) {
                Poll::Ready(Ok(mut guard)) => {
                    drain(fd.get_ref().0.as_ref(), |_| {});
                    guard.clear_ready();
                    Poll::Ready(Ok(()))
                }
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            },
            CqEvents::Shared { signal, .. } => signal.poll_take(cx, false).map(Ok),
        }
    }
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

/// Reads every queued event of `channel` (non-blocking), acknowledges each
/// at once and hands its CQ's address to `each`.
fn drain(channel: &CompletionChannel, mut each: impl FnMut(*mut ibv_cq)) {
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
    fd: AsyncFd<ChannelFd>,
    /// By the CQ's address (`ibv_get_cq_event` returns it).
    routes: Mutex<HashMap<usize, Arc<CqSignal>>>,
    /// Cleared when the hub's task ends (its runtime shut down).
    alive: AtomicBool,
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
        let mut hubs = HUBS.lock().unwrap_or_else(|p| p.into_inner());
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
            fd,
            routes: Mutex::new(HashMap::new()),
            alive: AtomicBool::new(true),
            _device: Arc::clone(device),
            _counted: Counted::new(Kind::SharedChannel),
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

    /// Reads every queued event: acknowledges it and fires its CQ's signal
    /// (looked up before the acknowledgement, while the CQ surely lives).
    fn drain(&self) {
        drain(self.channel(), |cq| {
            let signal = self
                .routes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&(cq as usize))
                .cloned();
            if let Some(s) = signal {
                s.fire();
            }
        });
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
    let guard = AliveGuard(hub);
    let hub = &guard.0;
    loop {
        let Ok(mut ready) = hub.fd.readable().await else {
            tracing::warn!("a completion channel left the reactor");
            return;
        };
        hub.drain();
        ready.clear_ready();
    }
}

#[cfg(test)]
mod tests {
    use super::CqSignal;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, Wake, Waker};

    /// Records its name in `order` when woken.
    struct Named(&'static str, Arc<Mutex<Vec<&'static str>>>);
    impl Wake for Named {
        fn wake(self: Arc<Self>) {
            self.1.lock().unwrap().push(self.0);
        }
    }

    fn waker(name: &'static str, order: &Arc<Mutex<Vec<&'static str>>>) -> Waker {
        Waker::from(Arc::new(Named(name, Arc::clone(order))))
    }

    #[test]
    fn an_event_wakes_every_waiter_once_application_tasks_before_the_driver() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let (reader, writer, driver) = (
            waker("reader", &order),
            waker("writer", &order),
            waker("driver", &order),
        );
        let s = CqSignal::default();
        // The driver registers first, as it usually does.
        assert_eq!(
            s.poll_take(&mut Context::from_waker(&driver), true),
            Poll::Pending
        );
        assert_eq!(
            s.poll_take(&mut Context::from_waker(&reader), false),
            Poll::Pending
        );
        assert_eq!(
            s.poll_take(&mut Context::from_waker(&reader), false),
            Poll::Pending
        );
        assert_eq!(
            s.poll_take(&mut Context::from_waker(&writer), false),
            Poll::Pending
        );
        s.fire();
        assert_eq!(*order.lock().unwrap(), ["reader", "writer", "driver"]);
        // The first to look takes the event; the others wait for the next.
        assert_eq!(
            s.poll_take(&mut Context::from_waker(&reader), false),
            Poll::Ready(())
        );
        assert_eq!(
            s.poll_take(&mut Context::from_waker(&driver), true),
            Poll::Pending
        );
        s.fire();
        assert_eq!(order.lock().unwrap().len(), 4);
        assert_eq!(order.lock().unwrap()[3], "driver");
        // An event with nobody waiting is kept for the next look.
        s.fire();
        assert_eq!(order.lock().unwrap().len(), 4);
        assert_eq!(
            s.poll_take(&mut Context::from_waker(&writer), false),
            Poll::Ready(())
        );
        assert_eq!(
            s.poll_take(&mut Context::from_waker(&writer), false),
            Poll::Pending
        );
    }
}
