//! What happens to a device underneath its connections: the verbs
//! asynchronous events (`ibv_get_async_event`) and the device's removal.
//!
//! Each opened device ([`super::rc::OpenDevice`]) has one [`DeviceWatch`]
//! and one thread (`tokio-rdma-watch`) that blocks in `poll(2)` on the
//! device context's async event fd: one fd per device, never one per
//! connection, read whatever runtime the connections run on. Every event
//! is read, acknowledged at once (`ibv_destroy_qp` and `ibv_destroy_cq`
//! wait for the acknowledgement of their events) and reported as a
//! `tracing` event; those that concern connections fail them with a typed
//! error through the [`Watched`] hook each connection registers:
//!
//! | event | what follows |
//! |---|---|
//! | `PORT_ERR` | the port is down: each connection on it fails with [`Error::PortDown`] once the port stayed down for the connection's RC retry bound (`RdmaConfig::retry_bound`, 0.47 s by default), unless `PORT_ACTIVE` came first; a connection with traffic in flight may fail earlier with the transport's retry-exceeded completion, as it would for any lost path |
//! | `PORT_ACTIVE` | the port is up again: nothing fails |
//! | `QP_FATAL`, `QP_REQ_ERR`, `QP_ACCESS_ERR` | that QP's connection drains its CQ at once (its flushed work completions fail it with their own error) and, if it is still alive, fails with [`Error::QueuePairFatal`]; on iWARP only the drain (Soft-iWARP raises `QP_REQ_ERR` in a normal close) |
//! | `DEVICE_FATAL` | the device is removed (below) |
//! | `CQ_ERR` | a `tracing` error (the crate sizes every CQ so it cannot overrun) |
//! | `GID_CHANGE`, `LID_CHANGE`, `PKEY_CHANGE`, `SM_CHANGE`, `CLIENT_REREGISTER`, others | a `tracing` event only: bind and connect read the GID table afresh |
//!
//! **Removal.** The kernel lets a device go (`rdma link delete`, a driver
//! unbound, a hot-unplugged NIC) only once every process closed it. A
//! device is known to be going when rdma_cm reports `DEVICE_REMOVAL` to
//! any connection or listener on it, when `DEVICE_FATAL` arrives, or when
//! its uverbs device (`ibv_device::dev_path` in sysfs) disappears, which
//! the thread looks at every [`REMOVAL_CHECK`]. Then [`DeviceWatch::removed`]
//! fails every connection on it with [`Error::DeviceRemoved`] and runs the
//! hooks that the process-wide caches registered ([`DeviceWatch::on_removed`]:
//! the open-device table, the runtimes' completion hubs, the stream send
//! buffer cache, the default message pool), so that once the application
//! drops its connections, listeners and pools on the device, the crate
//! holds nothing of it; the next connect or bind opens the device again if
//! it came back. librdmacm keeps a context of its own on the device,
//! which the thread then asks it to close ([`release_rdma_cm`]); it does
//! so only while another RDMA device is present, so with none left the
//! kernel finishes an `rdma link delete` only when the process exits.

use std::collections::HashMap;
use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use rdma_mummy_sys::{ibv_ack_async_event, ibv_async_event, ibv_event_type, ibv_get_async_event};
use sideway::ibverbs::device_context::DeviceContext;
use tracing::{debug, error, info, warn};

use super::rc::OpenDevice;
use crate::error::Error;

/// How often the watch thread looks whether the device's uverbs entry in
/// sysfs is still there (one `stat`): the bound on noticing a removal that
/// no event announced.
pub(crate) const REMOVAL_CHECK: Duration = Duration::from_secs(1);

/// A connection's side of the watch: how the thread fails it.
pub(crate) trait Watched: Send + Sync {
    /// Fails the connection with `err` (and wakes its tasks). Called from
    /// the watch thread, outside any runtime.
    fn fail_from_device(&self, err: Error);

    /// The device reported the connection's QP failed: drain its CQ (the
    /// QP's flushed work completions fail it with their own error) and,
    /// if `fail` and it is still alive after that, fail it with `err`.
    fn qp_failed(&self, err: Error, fail: bool);
}

/// One registered connection.
struct Conn {
    qp_num: u32,
    port: u8,
    /// How long its port may stay down before it fails (its RC retry
    /// bound).
    grace: Duration,
    hook: Weak<dyn Watched>,
}

/// What the watch knows of one port (from its events; a port never
/// reported is taken as active).
#[derive(Clone, Copy, Debug)]
struct PortInfo {
    active: bool,
    /// When the port last changed state.
    since: Instant,
    /// State changes reported so far.
    changes: u64,
}

#[derive(Default)]
struct Inner {
    conns: HashMap<u64, Conn>,
    next_token: u64,
    ports: HashMap<u8, PortInfo>,
}

/// Hooks run once when the device goes.
type RemovalHook = Box<dyn FnOnce() + Send>;

/// The watch of one opened device (see the module docs).
pub(crate) struct DeviceWatch {
    name: String,
    inner: Mutex<Inner>,
    /// Shared with the thread, which outlives the watch after a removal.
    removed: Arc<AtomicBool>,
    on_removed: Mutex<Vec<RemovalHook>>,
    /// Written to stop the thread (an eventfd), once the device is dropped.
    stop: Option<OwnedFd>,
    /// When the device was opened.
    opened: Instant,
    /// Whether a QP event fails a connection that its completions left
    /// alive: not on iWARP, where Soft-iWARP raises `QP_REQ_ERR` on a QP
    /// whose peer closed its TCP connection, a normal close that rdma_cm's
    /// DISCONNECTED reports too (failing there lost bytes the peer had
    /// sent before it).
    fail_on_qp_events: bool,
    /// Bumped at every port change and at the removal, for tasks waiting
    /// for a port to come back ([`DeviceWatch::port_back`]).
    changed: tokio::sync::watch::Sender<u64>,
}

/// A process-wide cache of one value per device (by name) that holds the
/// device open: a stale entry (of a device that went) is never handed out,
/// and the entry is dropped when its device goes.
pub(crate) type DeviceCache<V> = OnceLock<Mutex<HashMap<String, (usize, V)>>>;

/// The value `cache` holds for `device`, made by `make` (and its removal
/// hook registered) on first use.
///
/// # Errors
/// `make`'s.
pub(crate) fn cached<V: Clone + Send + 'static, E>(
    cache: &'static DeviceCache<V>,
    device: &Arc<OpenDevice>,
    make: impl FnOnce() -> std::result::Result<V, E>,
) -> std::result::Result<V, E> {
    let ptr = Arc::as_ptr(device) as usize;
    let mut map = lock(cache.get_or_init(Default::default));
    if let Some((p, v)) = map.get(&device.name)
        && *p == ptr
    {
        return Ok(v.clone());
    }
    let v = make()?;
    map.insert(device.name.clone(), (ptr, v.clone()));
    drop(map);
    let name = device.name.clone();
    device.watch.on_removed(move || {
        let mut map = lock(cache.get_or_init(Default::default));
        if map.get(&name).is_some_and(|(p, _)| *p == ptr) {
            map.remove(&name);
        }
    });
    Ok(v)
}

/// A port's state as the watch saw it: [`crate::stats::ports`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortStatus {
    /// The device, for example `rxe0`.
    pub device: String,
    /// The port number (1-based, as `ibv_query_port` numbers them).
    pub port: u8,
    /// Whether the port is active: the last event for it was
    /// `PORT_ACTIVE`, or none came since the device was opened.
    pub active: bool,
    /// How long ago the port last changed state (from the device's open
    /// if it never did).
    pub for_time: Duration,
    /// `PORT_ERR` and `PORT_ACTIVE` events seen since the device was
    /// opened.
    pub changes: u64,
    /// Connections on the port now.
    pub connections: usize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every device watch alive, for [`crate::stats::ports`].
static WATCHES: Mutex<Vec<Weak<DeviceWatch>>> = Mutex::new(Vec::new());

/// The state of every port of every device this process has open.
pub(crate) fn ports() -> Vec<PortStatus> {
    let watches: Vec<Arc<DeviceWatch>> = lock(&WATCHES).iter().filter_map(Weak::upgrade).collect();
    let now = Instant::now();
    let mut out = Vec::new();
    for w in watches {
        let inner = lock(&w.inner);
        let mut ports: Vec<u8> = inner.ports.keys().copied().collect();
        for c in inner.conns.values() {
            if !ports.contains(&c.port) {
                ports.push(c.port);
            }
        }
        ports.sort_unstable();
        for port in ports {
            let info = inner.ports.get(&port).copied().unwrap_or(PortInfo {
                active: true,
                since: w.opened,
                changes: 0,
            });
            out.push(PortStatus {
                device: w.name.clone(),
                port,
                active: info.active,
                for_time: now.saturating_duration_since(info.since),
                changes: info.changes,
                connections: inner.conns.values().filter(|c| c.port == port).count(),
            });
        }
    }
    out
}

/// A connection's registration; dropping it unregisters.
pub(crate) struct Registration {
    watch: Arc<DeviceWatch>,
    token: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        lock(&self.watch.inner).conns.remove(&self.token);
    }
}

impl DeviceWatch {
    /// The watch of a device just opened as `ctx`, with its thread. A
    /// watch whose thread cannot start (no eventfd, no thread) still
    /// works for removal by rdma_cm's event; the failure is logged.
    pub(crate) fn start(
        name: &str,
        ctx: &Arc<DeviceContext>,
        fail_on_qp_events: bool,
    ) -> Arc<DeviceWatch> {
        // SAFETY: eventfd(2) with valid flags; the fd is owned below.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        // SAFETY: a fresh fd that nothing else owns.
        let stop = (efd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(efd) });
        let stop_raw = stop.as_ref().map(|f| f.as_raw_fd());
        let watch = Arc::new(DeviceWatch {
            name: name.to_string(),
            inner: Mutex::new(Inner::default()),
            removed: Arc::new(AtomicBool::new(false)),
            on_removed: Mutex::new(Vec::new()),
            stop,
            opened: Instant::now(),
            fail_on_qp_events,
            changed: tokio::sync::watch::Sender::new(0),
        });
        {
            let mut watches = lock(&WATCHES);
            watches.retain(|w| w.strong_count() > 0);
            watches.push(Arc::downgrade(&watch));
        }
        let Some(stop_raw) = stop_raw else {
            warn!(
                device = name,
                "no eventfd: the device's async events are not read"
            );
            return watch;
        };
        let ctx = Arc::clone(ctx);
        let weak = Arc::downgrade(&watch);
        let removed = Arc::clone(&watch.removed);
        let device = name.to_string();
        let spawned = std::thread::Builder::new()
            .name("tokio-rdma-watch".into())
            .spawn(move || {
                run(ctx, weak, stop_raw);
                if removed.load(Ordering::Acquire) {
                    release_rdma_cm(&device);
                }
            });
        if let Err(e) = spawned {
            warn!(device = name, error = %e, "no watch thread: the device's async events are not read");
        }
        watch
    }

    /// A watch with no thread and no device (host tests).
    #[cfg(test)]
    fn detached(name: &str) -> Arc<DeviceWatch> {
        Arc::new(DeviceWatch {
            name: name.to_string(),
            inner: Mutex::new(Inner::default()),
            removed: Arc::new(AtomicBool::new(false)),
            on_removed: Mutex::new(Vec::new()),
            stop: None,
            opened: Instant::now(),
            fail_on_qp_events: true,
            changed: tokio::sync::watch::Sender::new(0),
        })
    }

    /// Registers a connection on `port` whose QP is `qp_num`, failed
    /// through `hook` by the device's events.
    pub(crate) fn register(
        self: &Arc<Self>,
        qp_num: u32,
        port: u8,
        grace: Duration,
        hook: Weak<dyn Watched>,
    ) -> Registration {
        let mut inner = lock(&self.inner);
        inner.next_token += 1;
        let token = inner.next_token;
        inner.conns.insert(
            token,
            Conn {
                qp_num,
                port,
                grace,
                hook,
            },
        );
        drop(inner);
        if self.is_removed() {
            // Removed while this connection was being set up.
            self.fail_all(Error::DeviceRemoved);
        }
        Registration {
            watch: Arc::clone(self),
            token,
        }
    }

    /// How long `port` has been down, if its last event was `PORT_ERR`.
    pub(crate) fn down_for(&self, port: u8) -> Option<Duration> {
        lock(&self.inner)
            .ports
            .get(&port)
            .filter(|p| !p.active)
            .map(|p| p.since.elapsed())
    }

    /// A receiver told of every port change and of the removal.
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Whether the device is known to be going.
    pub(crate) fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    /// Runs `hook` once when the device goes (at once if it went already).
    /// Hooks must hold nothing that holds the device (weak references).
    pub(crate) fn on_removed(&self, hook: impl FnOnce() + Send + 'static) {
        let mut hooks = lock(&self.on_removed);
        if self.is_removed() {
            drop(hooks);
            hook();
        } else {
            hooks.push(Box::new(hook));
        }
    }

    /// The device is going: fail every connection on it with
    /// [`Error::DeviceRemoved`] and let the caches go. Idempotent.
    pub(crate) fn removed(&self) {
        if self.removed.swap(true, Ordering::AcqRel) {
            return;
        }
        warn!(device = %self.name, "the RDMA device is going away");
        let hooks = std::mem::take(&mut *lock(&self.on_removed));
        for h in hooks {
            h();
        }
        self.fail_all(Error::DeviceRemoved);
        self.changed.send_modify(|g| *g += 1);
    }

    fn fail_all(&self, err: Error) {
        let hooks: Vec<_> = lock(&self.inner)
            .conns
            .drain()
            .filter_map(|(_, c)| c.hook.upgrade())
            .collect();
        for h in hooks {
            h.fail_from_device(err.clone());
        }
    }

    fn port_changed(&self, port: u8, active: bool) {
        let mut inner = lock(&self.inner);
        let info = inner.ports.entry(port).or_insert(PortInfo {
            active: true,
            since: Instant::now(),
            changes: 0,
        });
        info.changes += 1;
        if info.active != active {
            info.active = active;
            info.since = Instant::now();
        }
        drop(inner);
        self.changed.send_modify(|g| *g += 1);
    }

    /// Fails the connections whose port has been down for their grace;
    /// returns when the next one is due, if any.
    fn expire(&self, now: Instant) -> Option<Instant> {
        let mut due = Vec::new();
        let mut next: Option<Instant> = None;
        {
            let mut inner = lock(&self.inner);
            let ports = inner.ports.clone();
            inner.conns.retain(|_, c| {
                let Some(p) = ports.get(&c.port).filter(|p| !p.active) else {
                    return true;
                };
                let at = p.since + c.grace;
                if at <= now {
                    due.push((c.hook.clone(), c.port, now - p.since));
                    false
                } else {
                    next = Some(next.map_or(at, |n| n.min(at)));
                    true
                }
            });
        }
        for (hook, port, after) in due {
            if let Some(h) = hook.upgrade() {
                h.fail_from_device(Error::PortDown {
                    device: self.name.clone(),
                    port,
                    after,
                });
            }
        }
        next
    }

    fn qp_fatal(&self, qp_num: u32, event: &'static str) {
        let hooks: Vec<_> = lock(&self.inner)
            .conns
            .values()
            .filter(|c| c.qp_num == qp_num)
            .filter_map(|c| c.hook.upgrade())
            .collect();
        for h in hooks {
            h.qp_failed(
                Error::QueuePairFatal {
                    device: self.name.clone(),
                    event,
                },
                self.fail_on_qp_events,
            );
        }
    }
}

impl Drop for DeviceWatch {
    fn drop(&mut self) {
        // A forked child shares the eventfd with its parent: leave the
        // parent's thread alone.
        if crate::verbs::fork::inherited() {
            return;
        }
        if let Some(fd) = &self.stop {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
            let _ = unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
}

/// The name of an async event type, for errors and tracing.
fn event_name(t: ibv_event_type) -> &'static str {
    use ibv_event_type::*;
    match t {
        IBV_EVENT_CQ_ERR => "CQ_ERR",
        IBV_EVENT_QP_FATAL => "QP_FATAL",
        IBV_EVENT_QP_REQ_ERR => "QP_REQ_ERR",
        IBV_EVENT_QP_ACCESS_ERR => "QP_ACCESS_ERR",
        IBV_EVENT_COMM_EST => "COMM_EST",
        IBV_EVENT_SQ_DRAINED => "SQ_DRAINED",
        IBV_EVENT_PATH_MIG => "PATH_MIG",
        IBV_EVENT_PATH_MIG_ERR => "PATH_MIG_ERR",
        IBV_EVENT_DEVICE_FATAL => "DEVICE_FATAL",
        IBV_EVENT_PORT_ACTIVE => "PORT_ACTIVE",
        IBV_EVENT_PORT_ERR => "PORT_ERR",
        IBV_EVENT_LID_CHANGE => "LID_CHANGE",
        IBV_EVENT_PKEY_CHANGE => "PKEY_CHANGE",
        IBV_EVENT_SM_CHANGE => "SM_CHANGE",
        IBV_EVENT_SRQ_ERR => "SRQ_ERR",
        IBV_EVENT_SRQ_LIMIT_REACHED => "SRQ_LIMIT_REACHED",
        IBV_EVENT_QP_LAST_WQE_REACHED => "QP_LAST_WQE_REACHED",
        IBV_EVENT_CLIENT_REREGISTER => "CLIENT_REREGISTER",
        IBV_EVENT_GID_CHANGE => "GID_CHANGE",
        IBV_EVENT_WQ_FATAL => "WQ_FATAL",
        IBV_EVENT_DEVICE_SPEED_CHANGE => "DEVICE_SPEED_CHANGE",
    }
}

/// What one event said, read out of it before its acknowledgement.
enum Seen {
    Port { port: u8, active: bool },
    QpFatal { qp_num: u32, event: &'static str },
    DeviceFatal,
    Other { event: &'static str },
}

/// librdmacm keeps a context of its own on each device an id of the
/// process resolved to, and closes that of a removed device only when it
/// re-reads the device list (`rdma_get_devices`) with no id left on the
/// device; and rdma-core (44 to 65) skips that re-read while no
/// RDMA device is left at all. Until the context is closed the kernel
/// cannot finish the removal. So after a removal, once the crate itself let
/// go of the device (this thread dropped its context), ask librdmacm to
/// re-read every 500 ms, until the device is gone from sysfs
/// (`/sys/class/infiniband/NAME` goes last) or for a minute. With another
/// device present the removal then completes; with none, only when the
/// process exits. (`rdma_get_devices` opens a context of every device
/// present, as librdmacm does for any device an id uses.)
fn release_rdma_cm(name: &str) {
    let ib = PathBuf::from("/sys/class/infiniband").join(name);
    for _ in 0..120 {
        let mut n = 0;
        // SAFETY: `n` is writable; the list returned is freed once.
        unsafe {
            let list = rdma_mummy_sys::rdma_get_devices(&mut n);
            if !list.is_null() {
                rdma_mummy_sys::rdma_free_devices(list);
            }
        }
        if !ib.exists() {
            debug!(device = name, "the removed device is gone");
            return;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The watch thread: reads and acknowledges every async event of `ctx`,
/// expires ports down too long, looks for the device's removal; ends when
/// the watch is dropped (its eventfd `stop`), when the device is removed,
/// or when the event fd fails.
fn run(ctx: Arc<DeviceContext>, watch: Weak<DeviceWatch>, stop: RawFd) {
    // SAFETY: `ctx` keeps the context open for the whole thread.
    let raw = unsafe { ctx.context() }.as_ptr();
    // SAFETY: `raw` is a live context; its fields are plain data and the
    // device it points to lives as long as the context.
    let (async_fd, dev_path) = unsafe {
        let dev = (*raw).device;
        let path = if dev.is_null() {
            None
        } else {
            CStr::from_ptr((*dev).dev_path.as_ptr())
                .to_str()
                .ok()
                .filter(|p| !p.is_empty())
                .map(PathBuf::from)
        };
        ((*raw).async_fd, path)
    };
    // Non-blocking, so a read after a spurious wake-up returns EAGAIN
    // instead of blocking (libibverbs: change the fd's flags, ibv_get_async_event(3)).
    // SAFETY: fcntl on the context's own fd, which stays open.
    unsafe {
        let flags = libc::fcntl(async_fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(async_fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
    }
    let mut next_check = Instant::now() + REMOVAL_CHECK;
    let mut next_expiry: Option<Instant> = None;
    loop {
        let now = Instant::now();
        let until = next_expiry.map_or(next_check, |e| e.min(next_check));
        let timeout = until.saturating_duration_since(now);
        let mut fds = [
            libc::pollfd {
                fd: async_fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = i32::try_from(timeout.as_millis() + 1).unwrap_or(i32::MAX);
        // SAFETY: two valid pollfd entries in a live array.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            warn!(error = %std::io::Error::last_os_error(), "poll on the device's async events failed");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        let Some(w) = watch.upgrade() else { return };
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0
            && fds[0].revents & libc::POLLIN == 0
        {
            debug!(device = %w.name, "the device's async event fd closed");
            w.removed();
            return;
        }
        if fds[0].revents & libc::POLLIN != 0 {
            loop {
                // SAFETY: an all-zero ibv_async_event is a valid value to
                // be overwritten.
                let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
                // SAFETY: live context, `ev` writable; the fd is
                // non-blocking.
                if unsafe { ibv_get_async_event(raw, &mut ev) } != 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::WouldBlock {
                        break;
                    }
                    // EIO: the device was disassociated (removed).
                    debug!(device = %w.name, error = %e, "reading the device's async events failed");
                    w.removed();
                    return;
                }
                let name = event_name(ev.event_type);
                use ibv_event_type::*;
                // Read what the element says before the acknowledgement,
                // after which the QP may be destroyed.
                let seen = match ev.event_type {
                    IBV_EVENT_PORT_ERR | IBV_EVENT_PORT_ACTIVE => Seen::Port {
                        // SAFETY: port events carry the port number.
                        port: u8::try_from(unsafe { ev.element.port_num }).unwrap_or(0),
                        active: ev.event_type == IBV_EVENT_PORT_ACTIVE,
                    },
                    IBV_EVENT_QP_FATAL | IBV_EVENT_QP_REQ_ERR | IBV_EVENT_QP_ACCESS_ERR => {
                        // SAFETY: QP events carry the QP, alive until the
                        // acknowledgement below.
                        let qp = unsafe { ev.element.qp };
                        // SAFETY: as above; qp_num is plain data.
                        let qp_num = if qp.is_null() {
                            0
                        } else {
                            unsafe { (*qp).qp_num }
                        };
                        Seen::QpFatal {
                            qp_num,
                            event: name,
                        }
                    }
                    IBV_EVENT_DEVICE_FATAL => Seen::DeviceFatal,
                    _ => Seen::Other { event: name },
                };
                // SAFETY: `ev` was filled by ibv_get_async_event and is
                // acknowledged once.
                unsafe { ibv_ack_async_event(&mut ev) };
                match seen {
                    Seen::Port { port, active } => {
                        if active {
                            info!(device = %w.name, port, "port active");
                        } else {
                            warn!(device = %w.name, port, "port down");
                        }
                        w.port_changed(port, active);
                    }
                    Seen::QpFatal { qp_num, event } => {
                        error!(device = %w.name, qp = qp_num, event, "queue pair failed");
                        w.qp_fatal(qp_num, event);
                    }
                    Seen::DeviceFatal => {
                        error!(device = %w.name, "device fatal error");
                        w.removed();
                        return;
                    }
                    Seen::Other { event } if event == "CQ_ERR" => {
                        error!(device = %w.name, event, "completion queue error");
                    }
                    Seen::Other { event } => info!(device = %w.name, event, "device event"),
                }
            }
        }
        let now = Instant::now();
        next_expiry = w.expire(now);
        if now >= next_check {
            next_check = now + REMOVAL_CHECK;
            if dev_path.as_ref().is_some_and(|p| !p.exists()) {
                w.removed();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{DeviceWatch, Watched};
    use crate::error::Error;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex, Weak};
    use std::time::{Duration, Instant};

    /// Records the errors it was failed with.
    #[derive(Default)]
    struct Conn(Mutex<Vec<String>>);
    impl Watched for Conn {
        fn fail_from_device(&self, err: Error) {
            self.0.lock().unwrap().push(format!("{err:?}"));
        }
        fn qp_failed(&self, err: Error, fail: bool) {
            if fail {
                self.fail_from_device(err);
            }
        }
    }
    impl Conn {
        fn errors(&self) -> Vec<String> {
            self.0.lock().unwrap().clone()
        }
    }

    fn hook(c: &Arc<Conn>) -> Weak<dyn Watched> {
        Arc::downgrade(c) as Weak<dyn Watched>
    }

    #[test]
    fn a_port_down_fails_its_connections_after_their_grace_unless_it_comes_back() {
        let w = DeviceWatch::detached("dev0");
        let (a, b, c) = (Arc::default(), Arc::default(), Arc::default());
        let _ra = w.register(1, 1, Duration::from_millis(100), hook(&a));
        let _rb = w.register(2, 1, Duration::from_millis(300), hook(&b));
        let _rc = w.register(3, 2, Duration::from_millis(100), hook(&c));
        // Nothing is down: nothing expires, nothing is due.
        assert_eq!(w.expire(Instant::now() + Duration::from_secs(10)), None);
        w.port_changed(1, false);
        let since = w.inner.lock().unwrap().ports[&1].since;
        // Before the first grace: nothing fails; the first is due next.
        assert_eq!(
            w.expire(since + Duration::from_millis(50)),
            Some(since + Duration::from_millis(100))
        );
        assert!(a.errors().is_empty());
        // After it: the first fails, the second is due at its own grace,
        // port 2's connection is untouched.
        let next = w.expire(since + Duration::from_millis(150));
        assert_eq!(next, Some(since + Duration::from_millis(300)));
        assert_eq!(
            a.errors(),
            [format!(
                "{:?}",
                Error::PortDown {
                    device: "dev0".into(),
                    port: 1,
                    after: Duration::from_millis(150)
                }
            )]
        );
        assert!(b.errors().is_empty() && c.errors().is_empty());
        // The port comes back before the second's grace: it never fails.
        w.port_changed(1, true);
        assert_eq!(w.expire(since + Duration::from_secs(10)), None);
        assert!(b.errors().is_empty());
        let ports = super::ports();
        let p1 = ports
            .iter()
            .find(|p| p.device == "dev0" && p.port == 1)
            .cloned();
        // A detached watch is not listed (only started ones are).
        assert_eq!(p1, None);
        let inner = w.inner.lock().unwrap();
        assert_eq!(inner.ports[&1].changes, 2);
        assert!(inner.ports[&1].active);
        // The failed connection was unregistered; two are left.
        assert_eq!(inner.conns.len(), 2);
    }

    #[test]
    fn a_fatal_qp_event_fails_only_that_queue_pair() {
        let w = DeviceWatch::detached("dev0");
        let (a, b) = (Arc::default(), Arc::default());
        let _ra = w.register(7, 1, Duration::from_secs(1), hook(&a));
        let _rb = w.register(8, 1, Duration::from_secs(1), hook(&b));
        w.qp_fatal(8, "QP_FATAL");
        assert!(a.errors().is_empty());
        assert_eq!(
            b.errors(),
            [format!(
                "{:?}",
                Error::QueuePairFatal {
                    device: "dev0".into(),
                    event: "QP_FATAL"
                }
            )]
        );
        assert_eq!(
            Error::QueuePairFatal {
                device: "dev0".into(),
                event: "QP_FATAL"
            }
            .kind(),
            std::io::ErrorKind::ConnectionAborted
        );
        assert_eq!(
            Error::PortDown {
                device: "dev0".into(),
                port: 1,
                after: Duration::ZERO
            }
            .kind(),
            std::io::ErrorKind::NetworkDown
        );
    }

    #[test]
    fn removal_fails_every_connection_and_runs_each_hook_once() {
        let w = DeviceWatch::detached("dev0");
        let (a, b) = (Arc::<Conn>::default(), Arc::<Conn>::default());
        let ra = w.register(1, 1, Duration::from_secs(1), hook(&a));
        let _rb = w.register(2, 2, Duration::from_secs(1), hook(&b));
        drop(ra);
        let runs = Arc::new(AtomicUsize::new(0));
        for _ in 0..2 {
            let r = Arc::clone(&runs);
            w.on_removed(move || {
                r.fetch_add(1, Ordering::SeqCst);
            });
        }
        assert!(!w.is_removed());
        w.removed();
        w.removed();
        assert!(w.is_removed());
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        // The unregistered connection is not failed; the other once.
        assert!(a.errors().is_empty());
        assert_eq!(b.errors(), [format!("{:?}", Error::DeviceRemoved)]);
        // A hook registered afterwards runs at once; a connection
        // registered afterwards fails at once.
        let r = Arc::clone(&runs);
        w.on_removed(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        let late = Arc::<Conn>::default();
        let _rl = w.register(3, 1, Duration::from_secs(1), hook(&late));
        assert_eq!(late.errors(), [format!("{:?}", Error::DeviceRemoved)]);
    }
}
