//! Per-connection counters.

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
}
