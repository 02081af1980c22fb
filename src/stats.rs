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
/// when the connection is established.
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
    /// Registered memory this connection holds, bytes (receive ring plus
    /// send buffer).
    pub registered_bytes: u64,
}
