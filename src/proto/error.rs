//! Errors of the protocol core: what a peer (or the runtime) did wrong, and
//! why a write is refused.

/// The peer broke the stream protocol, or the runtime fed the core something
/// inconsistent.
///
/// Returned by `Imm::decode`,
/// `StreamCore::on_recv`,
/// `StreamCore::on_send_complete`
/// and `StreamCore::new`. Every
/// variant names the numbers involved. After `on_recv` returns one, the core
/// has aborted the connection itself and queued an ABORT carrying
/// [`ProtocolError::abort_code`] for the peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The 32-bit immediate data is not a valid message: a DATA of length 0,
    /// or a FIN whose low 30 bits are not zero.
    #[error("invalid immediate data {imm:#010x}: {reason}")]
    BadImm {
        /// The immediate data as received.
        imm: u32,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A DATA message would extend past the end of the local receive ring
    /// (the sender must split writes at the ring end).
    #[error("peer wrote {len} bytes at ring offset {offset}, past the ring end ({ring_len} bytes)")]
    RingWrap {
        /// Ring offset the data starts at (the core's receive tail).
        offset: u32,
        /// Length of the DATA message in bytes.
        len: u32,
        /// Length of the local receive ring in bytes.
        ring_len: u32,
    },
    /// A DATA message is larger than the ring space the peer had credit for.
    #[error("peer wrote {len} bytes with only {free} bytes of ring credit")]
    RingOverrun {
        /// Length of the DATA message in bytes.
        len: u32,
        /// Ring bytes the peer was allowed to write (advertised minus
        /// unreturned).
        free: u32,
    },
    /// The peer sent more messages than it had receive-WR credit for.
    #[error("peer consumed {consumed} receive WRs without credit; only {recv_depth} are posted")]
    WrOverrun {
        /// Receive WRs consumed and not yet returned, including this one.
        consumed: u32,
        /// Receive WRs this side keeps posted.
        recv_depth: u16,
    },
    /// A CREDIT message returned more receive WRs or ring bytes than this
    /// side had outstanding at the peer.
    #[error(
        "peer returned {wrs} receive WRs and {bytes} ring bytes, but only {outstanding_wrs} WRs and {outstanding_bytes} bytes were outstanding"
    )]
    CreditOverflow {
        /// Receive WRs returned by the CREDIT.
        wrs: u16,
        /// Ring bytes returned by the CREDIT.
        bytes: u32,
        /// Receive WRs this side had consumed at the peer and not got back.
        outstanding_wrs: u16,
        /// Ring bytes this side had written at the peer and not got back.
        outstanding_bytes: u32,
    },
    /// A DATA message arrived after the peer's FIN.
    #[error("peer sent {len} bytes after its FIN")]
    DataAfterFin {
        /// Length of the DATA message in bytes.
        len: u32,
    },
    /// A SEND arrived where a stream takes only RDMA WRITE WITH IMM (or,
    /// on a device without immediate data, a SEND of exactly the 4-byte
    /// immediate).
    #[error(
        "peer sent a SEND of {len} bytes; a stream takes RDMA WRITE WITH IMM, or a 4-byte SEND of the immediate without immediate data"
    )]
    UnexpectedSend {
        /// Bytes the SEND carried.
        len: u32,
    },
    /// A second FIN arrived.
    #[error("peer sent a second FIN")]
    DuplicateFin,
    /// A message arrived after the peer's ABORT.
    #[error("peer sent immediate data {imm:#010x} after its ABORT")]
    MessageAfterAbort {
        /// The immediate data of the late message.
        imm: u32,
    },
    /// The runtime reported a send completion for a work request id that is
    /// not outstanding (never posted, or already completed).
    #[error("send completion for unknown wr_id {wr_id} (outstanding first/last: {outstanding:?})")]
    UnknownWrId {
        /// The wr_id reported.
        wr_id: u64,
        /// The oldest and newest outstanding wr_ids, `None` if nothing was
        /// outstanding.
        outstanding: Option<(u64, u64)>,
    },
    /// A ring-growth message out of turn: a GRANT chunk out of order, a
    /// new offer before the last one was taken, an offer beyond the
    /// largest ring (2^30 bytes) or whose address range passes 2^64, or a
    /// SWITCH without an offer.
    #[error("ring growth out of turn: {reason}")]
    RingGrowth {
        /// What was out of turn.
        reason: &'static str,
    },
    /// A `StreamParams` field is out of
    /// range.
    #[error("invalid stream parameter {name} = {value}: {allowed}")]
    InvalidParams {
        /// The field name.
        name: &'static str,
        /// The value given.
        value: u64,
        /// The allowed range.
        allowed: &'static str,
    },
}

impl ProtocolError {
    /// The code sent in the ABORT immediate when this error makes the core
    /// abort the connection: `BadImm` 1, `RingWrap` 2, `RingOverrun` 3,
    /// `WrOverrun` 4, `CreditOverflow` 5, `DataAfterFin` 6, `DuplicateFin` 7,
    /// `MessageAfterAbort` 8, `UnknownWrId` 9, `InvalidParams` 10,
    /// `RingGrowth` 11, `UnexpectedSend` 12. Code 0 is
    /// left for aborts requested by the application
    /// (`ABORT_CODE_APPLICATION`).
    pub fn abort_code(&self) -> u32 {
        match self {
            ProtocolError::BadImm { .. } => 1,
            ProtocolError::RingWrap { .. } => 2,
            ProtocolError::RingOverrun { .. } => 3,
            ProtocolError::WrOverrun { .. } => 4,
            ProtocolError::CreditOverflow { .. } => 5,
            ProtocolError::DataAfterFin { .. } => 6,
            ProtocolError::DuplicateFin => 7,
            ProtocolError::MessageAfterAbort { .. } => 8,
            ProtocolError::UnknownWrId { .. } => 9,
            ProtocolError::InvalidParams { .. } => 10,
            ProtocolError::RingGrowth { .. } => 11,
            ProtocolError::UnexpectedSend { .. } => 12,
        }
    }
}

/// Why [`StreamCore::write_capacity`](crate::proto::stream::StreamCore::write_capacity)
/// refuses writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// The write side was shut down locally
    /// ([`StreamCore::shutdown`](crate::proto::stream::StreamCore::shutdown)).
    /// The runtime maps this to `io::ErrorKind::BrokenPipe`.
    #[error("stream was shut down for writing")]
    Shutdown,
    /// The peer aborted the connection (ABORT received), or the runtime
    /// reported the connection lost
    /// ([`StreamCore::on_connection_lost`](crate::proto::stream::StreamCore::on_connection_lost)).
    /// The runtime maps this to `io::ErrorKind::ConnectionReset`.
    #[error("connection reset by peer")]
    Reset,
    /// This side aborted the connection
    /// ([`StreamCore::abort`](crate::proto::stream::StreamCore::abort), or a
    /// protocol error from the peer). The runtime maps this to
    /// `io::ErrorKind::ConnectionAborted`.
    #[error("connection aborted")]
    Aborted,
}
