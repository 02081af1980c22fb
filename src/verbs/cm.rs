//! rdma_cm (librdmacm) connection management on tokio.
//!
//! sideway 0.4's rdma_cm wrapper has no way to send or read private data,
//! reject a request or migrate an id, all of which the handshake needs, so
//! this module calls librdmacm through `rdma-mummy-sys` directly.
//!
//! Every event is copied (type, status, private data) and acknowledged at
//! once, so `rdma_destroy_id` and `rdma_migrate_id` never block waiting for
//! an unacknowledged event.
//!
//! Two kinds of channel: a listener owns one, non-blocking and driven by
//! [`tokio::io::unix::AsyncFd`] (its connect requests are the only frequent
//! rdma_cm events); every other id (a connect's, an accepted connection's)
//! lives on one channel shared by the whole process, read by one thread
//! that routes each event by the id's context (a token that is never
//! reused) to that id's queue. So a connection costs no rdma_cm fd of its
//! own, and ids on any tokio runtime can share it (an `AsyncFd` is tied to
//! the runtime that registered it; a thread and tokio channels are not).

use std::ffi::CStr;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use os_socketaddr::OsSocketAddr;
use rdma_mummy_sys::{
    ibv_qp_attr, rdma_accept, rdma_ack_cm_event, rdma_bind_addr, rdma_cm_event, rdma_cm_event_type,
    rdma_cm_id, rdma_conn_param, rdma_connect, rdma_create_event_channel, rdma_create_id,
    rdma_destroy_event_channel, rdma_destroy_id, rdma_disconnect, rdma_establish,
    rdma_event_channel, rdma_get_cm_event, rdma_init_qp_attr, rdma_listen, rdma_migrate_id,
    rdma_port_space, rdma_reject, rdma_resolve_addr, rdma_resolve_route,
};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use super::count::{Counted, DeviceLimits, Kind, classify};
use super::fork::ParentOnly;
use super::routes::Routes;
use crate::error::{Error, Result};

/// The rdma_cm event types this crate acts on (`enum rdma_cm_event_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CmEventKind {
    AddrResolved,
    AddrError,
    RouteResolved,
    RouteError,
    ConnectRequest,
    ConnectResponse,
    ConnectError,
    Unreachable,
    Rejected,
    Established,
    Disconnected,
    DeviceRemoval,
    TimewaitExit,
    Other(u32),
}

impl From<u32> for CmEventKind {
    fn from(v: u32) -> Self {
        use rdma_cm_event_type::*;
        match v {
            RDMA_CM_EVENT_ADDR_RESOLVED => Self::AddrResolved,
            RDMA_CM_EVENT_ADDR_ERROR => Self::AddrError,
            RDMA_CM_EVENT_ROUTE_RESOLVED => Self::RouteResolved,
            RDMA_CM_EVENT_ROUTE_ERROR => Self::RouteError,
            RDMA_CM_EVENT_CONNECT_REQUEST => Self::ConnectRequest,
            RDMA_CM_EVENT_CONNECT_RESPONSE => Self::ConnectResponse,
            RDMA_CM_EVENT_CONNECT_ERROR => Self::ConnectError,
            RDMA_CM_EVENT_UNREACHABLE => Self::Unreachable,
            RDMA_CM_EVENT_REJECTED => Self::Rejected,
            RDMA_CM_EVENT_ESTABLISHED => Self::Established,
            RDMA_CM_EVENT_DISCONNECTED => Self::Disconnected,
            RDMA_CM_EVENT_DEVICE_REMOVAL => Self::DeviceRemoval,
            RDMA_CM_EVENT_TIMEWAIT_EXIT => Self::TimewaitExit,
            other => Self::Other(other),
        }
    }
}

struct RawChannel(NonNull<rdma_event_channel>);

// SAFETY: an rdma_event_channel is a heap object holding an fd; librdmacm
// allows its use from any thread (calls on it are independent syscalls).
unsafe impl Send for RawChannel {}
// SAFETY: see `Send`; shared access only reads the fd or makes syscalls.
unsafe impl Sync for RawChannel {}

impl AsRawFd for RawChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the pointer is valid until Drop (we own the channel).
        unsafe { self.0.as_ref().fd }
    }
}

impl Drop for RawChannel {
    fn drop(&mut self) {
        if crate::verbs::fork::inherited() {
            return; // the parent's channel: leaked
        }
        // SAFETY: we own the channel; every id created on it holds an Arc to
        // the `EventChannel`, so no id outlives it.
        unsafe { rdma_destroy_event_channel(self.0.as_ptr()) };
    }
}

/// An rdma_cm event channel with a non-blocking fd registered with tokio.
pub(crate) struct EventChannel {
    /// Leaked in a forked child: deregistering it would delete it from the
    /// epoll set the child shares with its parent.
    fd: ParentOnly<AsyncFd<RawChannel>>,
    _counted: Counted,
}

/// One rdma_cm event, copied out of librdmacm's struct and already acked.
pub(crate) struct CmEvent {
    pub kind: CmEventKind,
    /// `status` of the event: a negative errno, or for REJECTED the IB CM
    /// reject reason (28 = consumer reject).
    pub status: i32,
    /// For CONNECT_REQUEST: the new id for that request (owned by the caller).
    pub new_id: Option<CmId>,
    /// Private data of CONNECT_REQUEST/CONNECT_RESPONSE/REJECTED/ESTABLISHED.
    pub private_data: Vec<u8>,
}

/// `rdma_create_event_channel` with its errors classified.
fn create_raw_channel() -> Result<RawChannel> {
    crate::verbs::fork::check("rdma_create_event_channel")?;
    crate::verbs::fork::watch();
    // SAFETY: plain constructor; NULL is checked below.
    let raw = unsafe { rdma_create_event_channel() };
    let Some(raw) = NonNull::new(raw) else {
        let source = io::Error::last_os_error();
        return Err(match source.raw_os_error() {
            Some(libc::EOPNOTSUPP) => Error::LibraryUnavailable {
                library: "librdmacm.so.1",
            },
            Some(libc::ENODEV) | Some(libc::ENOENT) | Some(libc::ENOSYS) => Error::NoDevice,
            _ => classify(
                "rdma_create_event_channel",
                Kind::CmEventChannel,
                &DeviceLimits::default(),
                source,
            ),
        });
    };
    Ok(RawChannel(raw))
}

/// An event copied out of librdmacm's struct, before it is acked.
struct Copied {
    kind: CmEventKind,
    status: i32,
    id: *mut rdma_cm_id,
    private_data: Vec<u8>,
}

/// Copies the event `ev` points to and acknowledges it.
///
/// # Safety
/// `ev` must come from a successful `rdma_get_cm_event` and not be acked yet.
unsafe fn copy_and_ack(ev: *mut rdma_cm_event) -> Copied {
    // SAFETY: guaranteed by the caller: `ev` is valid until the ack below.
    let copied = unsafe {
        let e = &*ev;
        let conn: &rdma_conn_param = &e.param.conn;
        let private_data = if !conn.private_data.is_null() && conn.private_data_len > 0 {
            std::slice::from_raw_parts(
                conn.private_data.cast::<u8>(),
                conn.private_data_len as usize,
            )
            .to_vec()
        } else {
            Vec::new()
        };
        Copied {
            kind: CmEventKind::from(e.event),
            status: e.status,
            id: e.id,
            private_data,
        }
    };
    // SAFETY: acknowledges the event exactly once (the caller does not use
    // `ev` again). The id of a CONNECT_REQUEST stays valid (only the event
    // is freed).
    unsafe { rdma_ack_cm_event(ev) };
    copied
}

impl EventChannel {
    /// Creates a channel and registers its fd with the current tokio reactor.
    pub(crate) fn new() -> Result<Arc<Self>> {
        let chan = create_raw_channel()?;
        set_nonblocking(chan.as_raw_fd()).map_err(|source| Error::Verbs {
            op: "fcntl(O_NONBLOCK)",
            source,
        })?;
        // SAFETY: the fd belongs to `chan`, stays open until `chan` drops,
        // and `chan` is owned by the AsyncFd for its whole life.
        let fd = unsafe { AsyncFd::register_with_interest(chan, tokio::io::Interest::READABLE) }
            .map_err(|e| Error::Verbs {
                op: "AsyncFd::register",
                source: e.into(),
            })?;
        Ok(Arc::new(EventChannel {
            fd: ParentOnly::new(fd),
            _counted: Counted::new(Kind::CmEventChannel),
        }))
    }

    fn raw(&self) -> *mut rdma_event_channel {
        self.fd.get_ref().0.as_ptr()
    }

    /// Takes one event if one is queued.
    fn try_next(self: &Arc<Self>) -> io::Result<Option<CmEvent>> {
        crate::verbs::fork::check_io("rdma_get_cm_event")?;
        let mut ev: *mut rdma_cm_event = ptr::null_mut();
        // SAFETY: valid channel; `ev` is written on success only.
        let ret = unsafe { rdma_get_cm_event(self.raw(), &mut ev) };
        if ret != 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(err);
        }
        // SAFETY: rdma_get_cm_event succeeded and `ev` is not used again.
        let c = unsafe { copy_and_ack(ev) };
        let new_id = match (c.kind, NonNull::new(c.id)) {
            (CmEventKind::ConnectRequest, Some(raw)) => Some(CmId {
                raw,
                home: Home::Own(Arc::clone(self)),
                _counted: Counted::new(Kind::CmId),
            }),
            _ => None,
        };
        Ok(Some(CmEvent {
            kind: c.kind,
            status: c.status,
            new_id,
            private_data: c.private_data,
        }))
    }

    /// Waits for the next event on this channel.
    pub(crate) async fn next(self: &Arc<Self>) -> io::Result<CmEvent> {
        loop {
            let mut guard = self.fd.readable().await?;
            match self.try_next() {
                Ok(Some(ev)) => return Ok(ev),
                Ok(None) => guard.clear_ready(),
                Err(e) => return Err(e),
            }
        }
    }
}

/// The process's shared event channel (see the module docs): a blocking
/// channel read by one thread, and the queue of each id on it by token.
pub(crate) struct SharedChannel {
    raw: RawChannel,
    routes: Routes<mpsc::UnboundedSender<CmEvent>>,
    _counted: Counted,
}

/// Created with its thread on the first connect or accept; lives until the
/// process exits (one fd and one thread for the whole process). Counted in
/// [`crate::stats::resources`]' `shared_event_channels`.
static SHARED: Mutex<Option<Arc<SharedChannel>>> = Mutex::new(None);

/// Creates the process's shared rdma_cm channel and its thread if they do
/// not exist yet (librdmacm's own initialisation opens every device
/// again). Errors: those of [`SharedChannel::get`].
pub(crate) fn warm_shared_channel() -> Result<()> {
    SharedChannel::get().map(drop)
}

impl SharedChannel {
    /// The process's shared channel, created (with its thread) on first use.
    /// Errors: those of `rdma_create_event_channel` (for example
    /// `Error::ResourceLimit` out of file descriptors), or `Error::Verbs`
    /// when the thread cannot be started; a later call tries again.
    fn get() -> Result<Arc<SharedChannel>> {
        let mut slot = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = slot.as_ref() {
            return Ok(Arc::clone(s));
        }
        let shared = Arc::new(SharedChannel {
            raw: create_raw_channel()?,
            routes: Routes::new(),
            _counted: Counted::new(Kind::SharedChannel),
        });
        let reader = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("tokio-rdma-cm".into())
            .spawn(move || reader.run())
            .map_err(|source| Error::Verbs {
                op: "start the rdma_cm event thread",
                source,
            })?;
        *slot = Some(Arc::clone(&shared));
        Ok(shared)
    }

    fn raw(&self) -> *mut rdma_event_channel {
        self.raw.0.as_ptr()
    }

    fn register(&self) -> (u64, mpsc::UnboundedReceiver<CmEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (self.routes.register(tx), rx)
    }

    fn unregister(&self, token: u64) {
        self.routes.unregister(token);
    }

    /// The thread: every event is copied, acked at once and sent to its
    /// id's queue (dropped if that id is gone).
    fn run(&self) {
        loop {
            let mut ev: *mut rdma_cm_event = ptr::null_mut();
            // SAFETY: the channel lives as long as `self` (never destroyed
            // while this thread runs: the thread holds an Arc); `ev` is
            // written on success only.
            if unsafe { rdma_get_cm_event(self.raw(), &mut ev) } != 0 {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    tracing::warn!(error = %err, "rdma_get_cm_event on the shared channel failed");
                    std::thread::sleep(Duration::from_millis(100));
                }
                continue;
            }
            // SAFETY: the event is valid until the ack in `copy_and_ack`,
            // and its id at least as long (rdma_destroy_id waits for the
            // ack of every event of the id); each id on this channel was
            // created or migrated here with a token as its context.
            let token = unsafe { (*(*ev).id).context.addr() as u64 };
            // SAFETY: rdma_get_cm_event succeeded; `ev` is not used again.
            let c = unsafe { copy_and_ack(ev) };
            if c.kind == CmEventKind::ConnectRequest {
                // Only listeners get connect requests, and no listener
                // lives on this channel; refuse rather than leak the id.
                if let Some(raw) = NonNull::new(c.id) {
                    // SAFETY: the request's new id is ours alone and has
                    // no events yet.
                    unsafe {
                        rdma_reject(raw.as_ptr(), ptr::null(), 0);
                        rdma_destroy_id(raw.as_ptr());
                    }
                }
                continue;
            }
            self.routes.route(
                token,
                CmEvent {
                    kind: c.kind,
                    status: c.status,
                    new_id: None,
                    private_data: c.private_data,
                },
            );
        }
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on an fd we own; no memory is passed.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// An rdma_cm identifier (`struct rdma_cm_id`), TCP port space.
pub(crate) struct CmId {
    raw: NonNull<rdma_cm_id>,
    home: Home,
    _counted: Counted,
}

/// Where an id's events arrive.
enum Home {
    /// A channel of its own (a listener's, or a connect request's new id
    /// until it moves to the shared channel).
    Own(Arc<EventChannel>),
    /// The process's shared channel, whose thread sends this id's events
    /// (routed by `token`, the id's context) to `events`.
    Shared {
        channel: Arc<SharedChannel>,
        token: u64,
        events: mpsc::UnboundedReceiver<CmEvent>,
    },
}

// SAFETY: librdmacm ids may be used from any thread; every method here is a
// syscall wrapper, and the id is destroyed once, in Drop.
unsafe impl Send for CmId {}
// SAFETY: see `Send`.
unsafe impl Sync for CmId {}

fn cm_err(op: &'static str) -> Error {
    Error::Verbs {
        op,
        source: io::Error::last_os_error(),
    }
}

impl CmId {
    /// Creates an id in the TCP port space on `channel` (a listener's).
    pub(crate) fn new(channel: &Arc<EventChannel>) -> Result<Self> {
        crate::verbs::fork::check("rdma_create_id")?;
        let mut id: *mut rdma_cm_id = ptr::null_mut();
        // SAFETY: valid channel; `id` is written on success.
        let ret = unsafe {
            rdma_create_id(
                channel.raw(),
                &mut id,
                ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        if ret != 0 {
            return Err(cm_err("rdma_create_id"));
        }
        let raw = NonNull::new(id).ok_or_else(|| cm_err("rdma_create_id"))?;
        Ok(CmId {
            raw,
            home: Home::Own(Arc::clone(channel)),
            _counted: Counted::new(Kind::CmId),
        })
    }

    /// Creates an id in the TCP port space on the process's shared channel
    /// (for a connect). Errors: those of [`SharedChannel::get`], or
    /// `Error::Verbs` for `rdma_create_id`.
    pub(crate) fn new_shared() -> Result<Self> {
        crate::verbs::fork::check("rdma_create_id")?;
        let channel = SharedChannel::get()?;
        let (token, events) = channel.register();
        let mut id: *mut rdma_cm_id = ptr::null_mut();
        // SAFETY: valid channel; `id` is written on success. The context is
        // the token, an integer the event thread reads back (never
        // dereferenced).
        let ret = unsafe {
            rdma_create_id(
                channel.raw(),
                &mut id,
                ptr::without_provenance_mut(token as usize),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        let Some(raw) = NonNull::new(id).filter(|_| ret == 0) else {
            let e = cm_err("rdma_create_id");
            channel.unregister(token);
            return Err(e);
        };
        Ok(CmId {
            raw,
            home: Home::Shared {
                channel,
                token,
                events,
            },
            _counted: Counted::new(Kind::CmId),
        })
    }

    /// Moves the id (and its future events) to the process's shared
    /// channel (an accepted connection, before `rdma_accept`). Errors: those
    /// of [`SharedChannel::get`], or `Error::Verbs` for `rdma_migrate_id`.
    pub(crate) fn migrate_to_shared(&mut self) -> Result<()> {
        if matches!(self.home, Home::Shared { .. }) {
            return Ok(());
        }
        let channel = SharedChannel::get()?;
        let (token, events) = channel.register();
        // SAFETY: we own the id. Its context is read only by the thread of
        // the channel its events arrive on, and until the migrate below
        // they arrive on a listener's channel, whose reader never reads it.
        unsafe { (*self.raw.as_ptr()).context = ptr::without_provenance_mut(token as usize) };
        // SAFETY: valid id and channel; every event of this id on the old
        // channel has been acked (we ack on receipt), so this cannot block.
        crate::verbs::fork::check("rdma_migrate_id")?;
        if unsafe { rdma_migrate_id(self.raw.as_ptr(), channel.raw()) } != 0 {
            let e = cm_err("rdma_migrate_id");
            channel.unregister(token);
            return Err(e);
        }
        self.home = Home::Shared {
            channel,
            token,
            events,
        };
        Ok(())
    }

    /// Waits for this id's next event (a listener's: the next event of its
    /// channel). Errors: the channel's read error, or `Other` if the
    /// shared channel's thread is gone.
    pub(crate) async fn next_event(&mut self) -> io::Result<CmEvent> {
        match &mut self.home {
            Home::Own(channel) => channel.next().await,
            Home::Shared { events, .. } => events
                .recv()
                .await
                .ok_or_else(|| io::Error::other("the rdma_cm event thread ended")),
        }
    }

    pub(crate) fn bind(&self, addr: SocketAddr) -> Result<()> {
        let mut sa = OsSocketAddr::from(addr);
        // SAFETY: `sa` is a valid sockaddr for the duration of the call.
        crate::verbs::fork::check("rdma_bind_addr")?;
        if unsafe { rdma_bind_addr(self.raw.as_ptr(), sa.as_mut_ptr()) } != 0 {
            return Err(cm_err("rdma_bind_addr"));
        }
        Ok(())
    }

    pub(crate) fn listen(&self, backlog: i32) -> Result<()> {
        // SAFETY: valid, bound id.
        crate::verbs::fork::check("rdma_listen")?;
        if unsafe { rdma_listen(self.raw.as_ptr(), backlog) } != 0 {
            return Err(cm_err("rdma_listen"));
        }
        Ok(())
    }

    pub(crate) fn resolve_addr(&self, dst: SocketAddr, timeout: Duration) -> Result<()> {
        let mut sa = OsSocketAddr::from(dst);
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: `sa` is valid for the call; librdmacm copies it.
        crate::verbs::fork::check("rdma_resolve_addr")?;
        if unsafe { rdma_resolve_addr(self.raw.as_ptr(), ptr::null_mut(), sa.as_mut_ptr(), ms) }
            != 0
        {
            return Err(cm_err("rdma_resolve_addr"));
        }
        Ok(())
    }

    pub(crate) fn resolve_route(&self, timeout: Duration) -> Result<()> {
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: valid id whose address was resolved.
        crate::verbs::fork::check("rdma_resolve_route")?;
        if unsafe { rdma_resolve_route(self.raw.as_ptr(), ms) } != 0 {
            return Err(cm_err("rdma_resolve_route"));
        }
        Ok(())
    }

    /// `RDMA_MAX_INIT_DEPTH` / `RDMA_MAX_RESP_RES` (librdmacm, rdma_cma.h).
    pub(crate) const READ_DEPTH_MAX: u8 = 0xFF;

    fn conn_param(qp_num: u32, private_data: &[u8], read_depth: u8) -> rdma_conn_param {
        rdma_conn_param {
            private_data: private_data.as_ptr().cast(),
            private_data_len: u8::try_from(private_data.len()).unwrap_or(u8::MAX),
            responder_resources: read_depth,
            initiator_depth: read_depth,
            flow_control: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: 0,
            qp_num,
        }
    }

    /// `rdma_connect` with our QP number and `private_data` (≤ 56 bytes).
    /// `read_depth` is both the RDMA READs this side may have in flight
    /// (initiator depth) and those it serves for the peer (responder
    /// resources); [`READ_DEPTH_MAX`] asks librdmacm for the device's
    /// maximum.
    pub(crate) fn connect(&self, qp_num: u32, private_data: &[u8], read_depth: u8) -> Result<()> {
        let mut p = Self::conn_param(qp_num, private_data, read_depth);
        // SAFETY: `p` and the private data it points to live across the call;
        // librdmacm copies them into the request.
        crate::verbs::fork::check("rdma_connect")?;
        if unsafe { rdma_connect(self.raw.as_ptr(), &mut p) } != 0 {
            return Err(cm_err("rdma_connect"));
        }
        Ok(())
    }

    /// `rdma_accept` with our QP number and `private_data` (≤ 196 bytes);
    /// `read_depth` as for [`connect`](Self::connect) (librdmacm lowers it to
    /// what the request offered).
    pub(crate) fn accept(&self, qp_num: u32, private_data: &[u8], read_depth: u8) -> Result<()> {
        let mut p = Self::conn_param(qp_num, private_data, read_depth);
        // SAFETY: as in `connect`.
        crate::verbs::fork::check("rdma_accept")?;
        if unsafe { rdma_accept(self.raw.as_ptr(), &mut p) } != 0 {
            return Err(cm_err("rdma_accept"));
        }
        Ok(())
    }

    /// `rdma_reject` carrying `private_data`.
    pub(crate) fn reject(&self, private_data: &[u8]) -> Result<()> {
        let len = u8::try_from(private_data.len()).unwrap_or(u8::MAX);
        // SAFETY: the private data outlives the call; librdmacm copies it.
        crate::verbs::fork::check("rdma_reject")?;
        if unsafe { rdma_reject(self.raw.as_ptr(), private_data.as_ptr().cast(), len) } != 0 {
            return Err(cm_err("rdma_reject"));
        }
        Ok(())
    }

    /// `rdma_establish`, after CONNECT_RESPONSE on an id without an rdma_cm QP.
    pub(crate) fn establish(&self) -> Result<()> {
        // SAFETY: valid id with a pending connect response.
        crate::verbs::fork::check("rdma_establish")?;
        if unsafe { rdma_establish(self.raw.as_ptr()) } != 0 {
            return Err(cm_err("rdma_establish"));
        }
        Ok(())
    }

    /// `rdma_disconnect`; errors are ignored by callers that tear down anyway.
    pub(crate) fn disconnect(&self) -> Result<()> {
        // SAFETY: valid id.
        crate::verbs::fork::check("rdma_disconnect")?;
        if unsafe { rdma_disconnect(self.raw.as_ptr()) } != 0 {
            return Err(cm_err("rdma_disconnect"));
        }
        Ok(())
    }

    /// The QP attributes rdma_cm computed for moving a QP to `state`
    /// (`IBV_QPS_INIT`, `IBV_QPS_RTR`, `IBV_QPS_RTS`), with their mask.
    pub(crate) fn init_qp_attr(&self, state: u32) -> Result<(ibv_qp_attr, i32)> {
        // SAFETY: ibv_qp_attr is plain C data; all-zero is a valid value.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = state;
        let mut mask = 0;
        // SAFETY: valid id and out-pointers.
        crate::verbs::fork::check("rdma_init_qp_attr")?;
        if unsafe { rdma_init_qp_attr(self.raw.as_ptr(), &mut attr, &mut mask) } != 0 {
            return Err(cm_err("rdma_init_qp_attr"));
        }
        Ok((attr, mask))
    }

    /// Name of the RDMA device the id is bound to (after address
    /// resolution or on a connect request), for example `rxe0`.
    pub(crate) fn device_name(&self) -> Option<String> {
        // SAFETY: `verbs` is set by librdmacm once bound and stays valid for
        // the id's life; the device name is a NUL-terminated C string.
        unsafe {
            let verbs = self.raw.as_ref().verbs;
            if verbs.is_null() || (*verbs).device.is_null() {
                return None;
            }
            let name = rdma_mummy_sys::ibv_get_device_name((*verbs).device);
            if name.is_null() {
                return None;
            }
            Some(CStr::from_ptr(name).to_string_lossy().into_owned())
        }
    }

    /// The device port the id is bound to (1-based; 0 before a bind
    /// resolved a device).
    pub(crate) fn port_num(&self) -> u8 {
        // SAFETY: a plain field of the id we own, set by librdmacm.
        unsafe { self.raw.as_ref().port_num }
    }

    /// Local address (`rdma_get_local_addr`), including the port.
    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the route's address storage is a sockaddr_storage inside
        // the id; we copy at most its size.
        unsafe {
            let sa = rdma_mummy_sys::rdma_get_local_addr(self.raw.as_ref());
            sockaddr_to_std(sa)
        }
    }

    /// Peer address (`rdma_get_peer_addr`), including the port.
    pub(crate) fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as in `local_addr`.
        unsafe {
            let sa = rdma_mummy_sys::rdma_get_peer_addr(self.raw.as_ref());
            sockaddr_to_std(sa)
        }
    }
}

/// # Safety
/// `sa` must point to a sockaddr of at least `sizeof(sockaddr_in6)` bytes.
unsafe fn sockaddr_to_std(sa: &libc::sockaddr) -> Option<SocketAddr> {
    let len = match i32::from(sa.sa_family) {
        libc::AF_INET => std::mem::size_of::<libc::sockaddr_in>(),
        libc::AF_INET6 => std::mem::size_of::<libc::sockaddr_in6>(),
        _ => return None,
    };
    // SAFETY: guaranteed by the caller; `len` matches the family.
    unsafe { OsSocketAddr::copy_from_raw(sa, len as libc::socklen_t) }.into_addr()
}

impl Drop for CmId {
    fn drop(&mut self) {
        if crate::verbs::fork::inherited() {
            return; // the parent's id: leaked
        }
        // SAFETY: we own the id; all of its events were acked on receipt.
        // Its QP (if any) is ours and destroyed separately.
        unsafe { rdma_destroy_id(self.raw.as_ptr()) };
        // Only now: until rdma_destroy_id returned, an event of this id
        // could still be routed (it is then dropped with the queue).
        if let Home::Shared { channel, token, .. } = &self.home {
            channel.unregister(*token);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token of `routes` and the receiver of its queue.
    fn register(
        routes: &Routes<mpsc::UnboundedSender<CmEvent>>,
    ) -> (u64, mpsc::UnboundedReceiver<CmEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (routes.register(tx), rx)
    }

    fn event(kind: CmEventKind, status: i32) -> CmEvent {
        CmEvent {
            kind,
            status,
            new_id: None,
            private_data: vec![],
        }
    }

    #[test]
    fn an_event_reaches_its_ids_queue_and_one_for_a_gone_id_is_counted() {
        let routes = Routes::new();
        let (a, mut rx_a) = register(&routes);
        let (b, mut rx_b) = register(&routes);
        assert_ne!(a, b);
        assert!(routes.route(a, event(CmEventKind::AddrResolved, 0)));
        assert!(routes.route(b, event(CmEventKind::AddrError, -110)));
        let got = rx_a.try_recv().expect("a's event");
        assert_eq!((got.kind, got.status), (CmEventKind::AddrResolved, 0));
        let got = rx_b.try_recv().expect("b's event");
        assert_eq!((got.kind, got.status), (CmEventKind::AddrError, -110));
        assert!(rx_a.try_recv().is_err());
        routes.unregister(a);
        assert!(!routes.route(a, event(CmEventKind::RouteResolved, 0)));
        // A receiver dropped before its token was unregistered.
        drop(rx_b);
        assert!(!routes.route(b, event(CmEventKind::RouteResolved, 0)));
        assert_eq!(routes.unrouted(), 2);
        // Tokens are never reused.
        let (c, _rx_c) = register(&routes);
        assert!(c > b);
    }

    /// The hand-off under concurrency: ids registered, routed to from
    /// another thread (the event thread's part) and awaited on a runtime,
    /// 10,000 times: every event arrives once, in order, at its own id.
    #[test]
    fn ten_thousand_ids_on_two_threads_lose_no_event() {
        let routes = Arc::new(Routes::new());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            for _ in 0..10_000 {
                let (token, mut rx) = register(&routes);
                let r = Arc::clone(&routes);
                let sender = std::thread::spawn(move || {
                    for (i, kind) in [
                        CmEventKind::AddrResolved,
                        CmEventKind::RouteResolved,
                        CmEventKind::ConnectResponse,
                    ]
                    .into_iter()
                    .enumerate()
                    {
                        assert!(r.route(token, event(kind, i as i32)));
                    }
                });
                for (i, want) in [
                    CmEventKind::AddrResolved,
                    CmEventKind::RouteResolved,
                    CmEventKind::ConnectResponse,
                ]
                .into_iter()
                .enumerate()
                {
                    let ev = rx.recv().await.expect("event");
                    assert_eq!((ev.kind, ev.status), (want, i as i32));
                }
                sender.join().unwrap();
                routes.unregister(token);
            }
        });
        assert_eq!(routes.unrouted(), 0);
        assert_eq!(routes.registered(), 0);
    }
}
