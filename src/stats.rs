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
    /// useless from any other QP. Costs one PD per connection. (A
    /// message endpoint does the same there: `MessageStats::scoped_registrations`.)
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
    /// `WaitStrategy::Park`, and for `WaitStrategy::Adaptive` in a process
    /// that may run on one CPU only, where it parks).
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

pub use crate::verbs::count::ResourceSnapshot;
pub use crate::verbs::watch::PortStatus;

/// What this process holds now through tokio-rdma (live objects; counts
/// go back down as connections, listeners and pools are dropped and their
/// drivers finish).
pub fn resources() -> ResourceSnapshot {
    crate::verbs::count::snapshot()
}

/// The state of each port of each RDMA device this process has open, as
/// the device's async events (`PORT_ERR`, `PORT_ACTIVE`) reported it,
/// with the connections on it now: ports that have connections or had an
/// event, sorted by device open order and port number. A port that stays
/// down fails its connections with [`Error::PortDown`](crate::Error::PortDown)
/// once it was down for their RC retry bound. Empty before the first
/// connection or pool opened a device.
pub fn ports() -> Vec<PortStatus> {
    crate::verbs::watch::ports()
}
