//! Per-connection counters.

/// How a connection's registered memory is opened to its peer (see the
/// README's trust model). Never a key that another connection's QP could
/// use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RemoteAccess {
    /// Type-2 memory windows bound on this connection's QP: the stream's
    /// receive ring (RDMA WRITE, for the connection's life), a message
    /// endpoint's rendezvous sources (RDMA READ of exactly one message,
    /// until its DONE). The memory regions themselves have no remote
    /// access.
    #[default]
    MemoryWindow,
    /// A device without memory windows: the stream's QP and its buffers
    /// live on a protection domain of their own, so the ring's key is
    /// useless from any other QP. Costs one PD per connection. (Message
    /// endpoints refuse such devices: `Error::NoMemoryWindows`.)
    OwnProtectionDomain,
}

/// A snapshot of one connection's counters, from
/// [`RdmaStream::stats`](crate::RdmaStream::stats). All counts start at zero
/// when the connection is established (`spin_limit_us` is a level, not a
/// count).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionStats {
    /// Payload bytes posted in RDMA WRITE WITH IMM work requests.
    pub bytes_sent: u64,
    /// Payload bytes that arrived in the receive ring.
    pub bytes_received: u64,
    /// Work requests posted (data and control messages).
    pub wrs_sent: u64,
    /// Receive completions (data and control messages from the peer).
    pub wrs_received: u64,
    /// Work completions polled from the completion queue.
    pub completions: u64,
    /// Times a write found no room (send buffer full or no peer credit).
    pub credit_stalls: u64,
    /// Data work requests posted with inline payload.
    pub inline_sends: u64,
    /// Errors that ended the connection (at most 1 per connection).
    pub errors: u64,
    /// How the receive ring is opened to the peer.
    pub remote_access: RemoteAccess,
    /// Payload bytes moved out of the receive ring into process memory
    /// (the backlog, up to `RdmaConfig::recv_buffer_limit`; mostly by the
    /// connection's driver) because no read was taking them straight from
    /// the ring, which returns their ring space to the peer: each of these
    /// bytes is copied twice (ring, backlog, the reader's buffer). The
    /// others of `bytes_received` went straight from the ring into a
    /// reader's buffer, or are still in the ring.
    pub bytes_buffered: u64,
    /// Registered memory this connection holds, bytes (receive rings plus
    /// send buffer; while a grown ring replaces the previous one, both).
    pub registered_bytes: u64,
    /// Length of the receive ring the peer writes into now, bytes: the
    /// configured `ring_size`, doubled per growth (see
    /// `RdmaConfig::max_ring_size`).
    pub ring_size: u32,
    /// Times the receive ring grew.
    pub rings_grown: u64,
    /// Length of the send buffer writes are copied into, bytes: the
    /// configured `send_buffer_size`, or the peer's ring once that grew
    /// larger, up to `RdmaConfig::max_ring_size` (the buffer is held only
    /// while there is data to send).
    pub send_buffer_size: u32,
    /// Reads that found nothing and were answered while spinning on the
    /// completion queue (see `RdmaConfig::wait_strategy`).
    pub spin_hits: u64,
    /// Times a read found nothing and parked: armed the completion queue
    /// and returned `Pending` (again after each wake-up that brought
    /// nothing).
    pub read_parks: u64,
    /// The spin limit the connection has learnt, in microseconds
    /// (`WaitStrategy::Adaptive`: from 100 us, or `max` if lower, up to
    /// its `max`, see there;
    /// the fixed budget of `WaitStrategy::Spin`; 0 for
    /// `WaitStrategy::Park`).
    pub spin_limit_us: u64,
    /// Completion events the connection's driver task left to a reader
    /// parked on the completion queue instead of waking for them too (on
    /// a completion channel of the connection's own; see the README's
    /// design notes on the driver task).
    pub events_left_to_reader: u64,
    /// Times a task (an application call or the driver) found the
    /// connection's lock held by another thread and waited for it: on the
    /// multi-thread runtime, two workers working on one connection at once.
    pub lock_waits: u64,
    /// Times the connection's driver task woke up (a completion event it
    /// did not leave to a reader, an rdma_cm event, a timer, a nudge from
    /// an application task).
    pub driver_wakeups: u64,
}

/// The verbs and rdma_cm objects this process holds through tokio-rdma
/// right now, from [`resources`]: every connection, listener, memory pool
/// and device it opened, all devices together.
///
/// A stream connection holds one QP, one CQ, one rdma_cm id, its receive
/// ring's memory region and memory window, and a send buffer's memory
/// region while it has unsent data (see the README's design notes); no
/// file descriptor of its own (see `shared_event_channels`). Each opened
/// device holds one PD for the process.
/// Compare with the device's limits (`ibv_devinfo -v`: `max_qp`, `max_cq`,
/// `max_mr`, `max_mw`) and with `RLIMIT_MEMLOCK` (`ulimit -l`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ResourceSnapshot {
    /// Queue pairs (`ibv_create_qp`).
    pub queue_pairs: u64,
    /// Completion queues (`ibv_create_cq`): one of its own per connection
    /// end, plus the shared ones (`shared_completion_queues`) that
    /// connections with `RdmaConfig::share_completion_queue` (and any
    /// connection once the process holds half the device's `max_cq` CQs of
    /// their own) take a seat on.
    pub completion_queues: u64,
    /// Completion channels (`ibv_create_comp_channel`; one fd each) held
    /// by connections: one per connection end with a CQ of its own among
    /// the first 64 live ones of the process (at most a sixteenth of
    /// `RLIMIT_NOFILE`). Every other CQ reports to its tokio runtime's
    /// completion channel for the device, counted in
    /// `shared_event_channels`.
    pub completion_channels: u64,
    /// Memory regions (`ibv_reg_mr`): receive rings, send buffers, pool
    /// slabs, registered user regions.
    pub memory_regions: u64,
    /// Bytes of all those memory regions (the lengths passed to
    /// `ibv_reg_mr`; the kernel pins whole pages, so at most 4095 bytes
    /// more per region).
    pub registered_bytes: u64,
    /// Type-2 memory windows (`ibv_alloc_mw`).
    pub memory_windows: u64,
    /// Protection domains (`ibv_alloc_pd`): one per opened device, plus one
    /// per stream on a device without memory windows.
    pub protection_domains: u64,
    /// rdma_cm ids (`rdma_create_id`, and one per connect request a
    /// listener received until it is accepted or rejected).
    pub cm_ids: u64,
    /// rdma_cm event channels (`rdma_create_event_channel`; one fd each)
    /// of listeners, one per listener. Connections hold none: their events
    /// go to one channel the whole process shares (counted in
    /// `shared_event_channels`).
    pub cm_event_channels: u64,
    /// Idle stream send buffers each opened device keeps registered for
    /// the next stream with data to send (included in `memory_regions` and
    /// `registered_bytes`; at most 4 MiB per device).
    pub idle_send_buffers: u64,
    /// Bytes of those idle send buffers (included in `registered_bytes`):
    /// a buffer is `send_buffer_size` long, or longer when its stream's
    /// send buffer had grown to the peer's ring.
    pub idle_send_buffer_bytes: u64,
    /// Event channels shared by connections (one fd each): the process's
    /// rdma_cm event channel (read by the `tokio-rdma-cm` thread, created
    /// on the first connect or accept, kept until the process exits), and
    /// one completion channel per tokio runtime and device (read by a task
    /// on that runtime, created with the runtime's first connection there,
    /// kept while the runtime or any CQ on it lives). They do not grow with
    /// the number of connections.
    pub shared_event_channels: u64,
    /// CQs shared by connections (included in `completion_queues`): each
    /// holds up to 16,384 entries (the device's `max_cqe` if smaller) and
    /// seats the QPs whose send plus receive depth, plus 16, fit in them:
    /// 60 stream ends with the default depths (129 + 128), 56 message
    /// endpoints. One is destroyed when the last connection on it closes.
    pub shared_completion_queues: u64,
}

/// What this process holds now through tokio-rdma (live objects; counts
/// go back down as connections, listeners and pools are dropped and their
/// drivers finish).
pub fn resources() -> ResourceSnapshot {
    crate::verbs::count::snapshot()
}
