//! Completion events shared by the connections of one tokio runtime.
//!
//! Every CQ a runtime's connections create on a device reports to one
//! completion channel (`ibv_comp_channel`), the runtime's [`CqHub`] for
//! that device: one fd registered with the runtime's reactor and one task
//! that reads each event (`ibv_get_cq_event` names the CQ), acknowledges it
//! at once and fires that CQ's [`CqSignal`], which wakes every task waiting
//! on the CQ (a reader, a writer, the connection's driver). So a connection
//! holds no fd of its own; its CQ, arming (`ibv_req_notify_cq`) and polling
//! are its own as before, and a reader still polls its CQ itself.
//!
//! A hub belongs to one runtime because an `AsyncFd` does: it is keyed by
//! `tokio::runtime::Id` and the device, and a hub whose runtime shut down
//! (its task gone) is never handed out again, even if a later runtime gets
//! the same id. A hub lives as long as its runtime (its task holds it) or
//! as long as a CQ on it, whichever is longer.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};

use rdma_mummy_sys::{ibv_ack_cq_events, ibv_cq, ibv_get_cq_event};
use sideway::ibverbs::completion::{CompletionChannel, CreateCompletionChannelErrorKind};
use tokio::io::unix::AsyncFd;

use super::count::{Counted, Kind, classify};
use super::rc::OpenDevice;
use crate::error::{Error, Result};

/// Wraps the completion channel for AsyncFd registration.
struct ChannelFd(Arc<CompletionChannel>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// One CQ's event flag and the tasks waiting for it.
#[derive(Default)]
pub(crate) struct CqSignal {
    fired: AtomicBool,
    waiters: Mutex<Vec<Waker>>,
}

impl CqSignal {
    /// Ready (and the flag taken) if an event came since the last take;
    /// otherwise `cx`'s task is registered (every registered task is woken
    /// by the next event, a task polled twice is kept once) and Pending.
    pub(crate) fn poll_take(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.fired.swap(false, Ordering::AcqRel) {
            return Poll::Ready(());
        }
        {
            let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
            if !w.iter().any(|x| x.will_wake(cx.waker())) {
                w.push(cx.waker().clone());
            }
        }
        // An event between the swap and the registration set the flag
        // after or before the wake-up list was taken: look again.
        if self.fired.swap(false, Ordering::AcqRel) {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Waits for the next event (see [`poll_take`](Self::poll_take)).
    pub(crate) async fn take(&self) {
        std::future::poll_fn(|cx| self.poll_take(cx)).await
    }

    fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        let waiters = std::mem::take(&mut *self.waiters.lock().unwrap_or_else(|p| p.into_inner()));
        for w in waiters {
            w.wake();
        }
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
        let chan = CompletionChannel::new(&device.ctx).map_err(|e| {
            classify(
                "ibv_create_comp_channel",
                Kind::CompletionChannel,
                &device.limits,
                match e.0 {
                    CreateCompletionChannelErrorKind::Ibverbs(io) => io,
                    #[allow(unreachable_patterns)]
                    other => io::Error::other(other),
                },
            )
        })?;
        chan.set_nonblocking(true).map_err(|source| Error::Verbs {
            op: "fcntl(O_NONBLOCK)",
            source,
        })?;
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

    /// Routes the events of the CQ at `cq` to a new signal.
    pub(crate) fn register(&self, cq: *mut ibv_cq) -> Arc<CqSignal> {
        let signal = Arc::new(CqSignal::default());
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(cq as usize, Arc::clone(&signal));
        signal
    }

    /// Stops routing the CQ at `cq`; called before the CQ is destroyed, so
    /// a later CQ at the same address is never confused with it (its
    /// remaining events are still acknowledged, then dropped).
    pub(crate) fn unregister(&self, cq: *mut ibv_cq) {
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(cq as usize));
    }

    /// Reads every queued event: acknowledges it and fires its CQ's signal.
    fn drain(&self) {
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: valid, non-blocking channel owned by `self.fd`;
            // out-pointers are locals.
            let ret = unsafe {
                ibv_get_cq_event(self.channel().comp_channel().as_ptr(), &mut cq, &mut ctx)
            };
            if ret != 0 {
                return;
            }
            let signal = self
                .routes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&(cq as usize))
                .cloned();
            // SAFETY: acknowledges the one event just read for `cq`, which
            // is still alive: ibv_destroy_cq waits until every event it
            // reported is acknowledged.
            unsafe { ibv_ack_cq_events(cq, 1) };
            if let Some(s) = signal {
                s.fire();
            }
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
