//! The zero-copy message state machine: eager sends, rendezvous by RDMA
//! READ, in-order delivery, credits and abort.
//!
//! [`MessageCore`] does bookkeeping only. The runtime owns every buffer and
//! names it to the core by an opaque `u64` *token* (its handle for a pool
//! buffer or registered region: address, lkey and rkey are known to the
//! runtime); it posts the work requests (WRs) the core returns and feeds back
//! completions.
//!
//! # Messages
//!
//! Every message on the queue pair (QP) is one SEND WITH IMMEDIATE into a
//! receive buffer the receiver pre-posted (a pool buffer of `eager_buf_len`
//! bytes); only rendezvous payloads travel differently: the **receiver**
//! pulls them with RDMA READ. The top 3 bits of the immediate select the type
//! ([`MsgImm`]):
//!
//! | bits 31..29 | type   | bits 28..0                                    | payload                   |
//! |-------------|--------|-----------------------------------------------|---------------------------|
//! | `000`       | EAGER  | receive buffers returned with it, `0..=2^29-1` | the whole message, `0..=eager_max` bytes |
//! | `001`       | RTS    | rendezvous sequence number (mod 2^29)         | [`RTS_HEADER_LEN`] = 20 bytes: length u64, address u64, rkey u32, big-endian |
//! | `010`       | DONE   | sequence number of the RTS it completes       | none                      |
//! | `011`       | CREDIT | receive buffers returned, `1..=2^29-1`        | none                      |
//! | `100`       | ABORT  | error code, `0..=2^29-1`                      | none                      |
//! | `101`       | CLOSE  | must be 0                                     | none                      |
//! | `110`       | NOTIFY | the application's value, `0..=2^29-1`         | none: an RDMA WRITE WITH IMMEDIATE into the receiver's grant; `byte_len` is the bytes written |
//! | `111`       | —      | unknown: a protocol error                     |                           |
//!
//! On a device without immediate data (iWARP, RFC 5040) every message is
//! a plain SEND whose last [`TRAILER_LEN`] (4) bytes carry the immediate,
//! big-endian ([`encode_trailer`], [`split_trailer`]): the payload then
//! ends 4 bytes earlier, so `eager_max` is 4 less than the buffers, and a
//! SEND shorter than the trailer is [`MessageError::MissingTrailer`].
//! Everything else is the same on every transport. A NOTIFY there is an
//! RDMA WRITE followed by a SEND of the written length (4 bytes,
//! big-endian) and the trailer: the runtime turns that length back into
//! the completion's `byte_len` before the core sees it.
//!
//! # Notifications
//!
//! A NOTIFY ([`MessageCore::send_notify`]) writes into memory the
//! receiver granted (a [`RemoteRegion`](crate::RemoteRegion)) and
//! consumes a receive buffer there, whose completion carries the
//! application's 29-bit value and the written length; the buffer itself
//! is untouched and released at once. For flow control and order it is a
//! data message: it needs more than [`CONTROL_RESERVE`] credits, is queued
//! behind the messages sent before it, is handed to the application in
//! send order ([`Delivery::Notify`]), and its slot becomes returnable when
//! the application takes it. RC ordering places the written bytes before
//! the completion that reports them (IBTA 9.5; on iWARP, RFC 5040 section
//! 5.5: a SEND is delivered after every earlier message was placed).
//!
//! A message of at most `eager_max` bytes goes EAGER (inline when at most
//! `inline_threshold` bytes). A larger one goes by rendezvous: the sender
//! posts an RTS naming its registered buffer; the receiver asks the runtime
//! for a destination of exactly the announced length
//! ([`MsgEvent::AllocateDestination`], answered by
//! [`MessageCore::destination_ready`]), READs the payload in chunks of at
//! most `max_read_len` bytes, and once every READ completed sends DONE; the
//! sender then releases its buffer ([`MsgEvent::SendDone`]). RTS and DONE
//! pair up first-in first-out (RC ordering); both carry the rendezvous
//! sequence number so a confused peer is caught rather than believed.
//!
//! # Order
//!
//! Messages are handed to the application ([`MessageCore::poll_recv`]) in
//! send order: an eager message that arrives behind an unfinished rendezvous
//! waits for it. At most `max_rendezvous_in_flight` rendezvous are
//! outstanding: the sender counts an RTS from posting to its DONE, and the
//! receiver rejects an RTS that would exceed the bound (it counts from
//! receipt to posting the DONE, never more than the sender's count).
//!
//! # Credits and flow control
//!
//! Every message, of any type, consumes one pre-posted receive buffer at the
//! peer. The runtime reposts a fresh pool buffer at once for every receive
//! completion, so the core has no `release_recv_buffer`: the buffer that
//! completed either stays with the message (EAGER, until the application
//! takes it and drops it) or goes straight back to the pool
//! ([`RecvDisposition`]).
//!
//! The sender's credit is `peer_recv_depth - sent + returned`. EAGER and RTS
//! need more than [`CONTROL_RESERVE`] (2) credits; DONE needs at least 2;
//! CREDIT (which always returns at least one buffer) and ABORT need 1.
//! A control message's (CREDIT, DONE, ABORT) slot counts as returnable when
//! it is received; a data message's (EAGER, RTS) slot when the application
//! takes the message ([`MessageCore::poll_recv`]). So the messages waiting
//! for the application are bounded by `recv_depth`, and an application that
//! stops taking messages stalls its peer's sender after its credit is spent:
//! flow control, with nothing lost. Control traffic (CREDIT, DONE) and the
//! rendezvous READs never depend on the application (a runtime may hold
//! READs back for a while, [`MessageCore::set_reads_held`], and must let
//! them go on its own: the endpoint's driver does at its next tick).
//!
//! Credit returns with the next EAGER (every returnable slot, in its
//! immediate's low bits), or by CREDIT when the returnable slots reach
//! `T = max(2, recv_depth / 4)` and no EAGER can go now. So requests and
//! responses carry each other's credit and a ping-pong sends no CREDIT:
//! each CREDIT consumed a receive buffer that had to be returned too, and
//! with `T = 3` (15 buffers posted) each side sent one CREDIT per two
//! messages (benches/history/echo-2026-12-05.md, "Credit with the next EAGER").
//!
//! # Why this cannot deadlock
//!
//! The argument of the [stream core](crate::proto::stream) carries over,
//! with "the reader has read" replaced by "the application has taken every
//! complete message". In a quiescent state (nothing in flight) let `c_X` be
//! X's credit at Y and `u_Y` the slots Y holds for X (returnable or held by
//! untaken messages): `c_X + u_Y = depth_Y >= 4`.
//!
//! 1. *Not both credits are zero:* a message that takes a credit from 1 to 0
//!    is a CREDIT returning at least one slot (or a terminal ABORT); the
//!    stream core's argument applies unchanged.
//! 2. *A sender blocked on credit gets it once the application took what
//!    arrived:* A blocks data at `c_A <= 2`, so `u_B >= depth_B - 2 >= T`,
//!    all returnable, and B wants to send a CREDIT; it can unless `c_B = 0`,
//!    in which case `u_A = depth_A >= T` and A (with `c_A >= 1` by 1.) sends
//!    a CREDIT first. DONE blocks at `c <= 1`, a stronger condition, and is
//!    unblocked the same way.
//! 3. *A rendezvous completes without the application:* the READs need only
//!    send-queue slots, the runtime's destination and, when the runtime
//!    holds them back, its letting them go; the DONE needs 2
//!    credits, which 2. provides. So an eager message held behind a
//!    rendezvous is released, and a sender blocked on
//!    `max_rendezvous_in_flight` gets its DONE.
//! 4. *Credits do not ping-pong forever:* a CREDIT returns at least `T >= 2`
//!    slots, so each side sends at most one per two messages received; an
//!    EAGER carrying credit is a message the application sent, not one the
//!    credit caused.
//! 5. *Send-queue slots come back:* the last WR [`MessageCore::poll_transmit`]
//!    can produce now is signaled, so every burst ends with a completion that
//!    releases it.
//!
//! CLOSE, like ABORT, is terminal and needs one credit: it may take a
//! credit from 1 to 0 (point 1 counts it with ABORT).
//!
//! # Closing
//!
//! A side whose application let go of the endpoint ([`MessageCore::close`])
//! sends CLOSE once everything of its own is done: every queued message
//! posted, every rendezvous of its own DONE'd, every rendezvous of the
//! peer's read and DONE'd. CLOSE goes ahead of a CREDIT then (a closing
//! side needs no more messages) and is the last WR that side posts. The
//! peer, on CLOSE, posts nothing more either (no CREDIT, no message: its
//! later sends fail with [`SendError::PeerClosed`]), delivers what arrived
//! and then reports the end ([`MessageCore::peer_closed`]). The closing
//! side disconnects once its CLOSE completed: the peer's QP acknowledged
//! it, so the peer knows the close was clean before the disconnect can
//! reach it, and a failure of one of the peer's own WRs posted before the
//! CLOSE arrived (a CREDIT into the closed QP) is not mistaken for a lost
//! connection. Without a credit for CLOSE
//! ([`MessageCore::close_blocked`]), the runtime disconnects without it.
//! Both sides may close at once: each takes the other's CLOSE as the end.
//!
//! `src/proto/message_tests.rs` checks this on many random schedules and
//! exhaustively on small configurations.

use std::collections::VecDeque;
use std::ops::Range;

use crate::proto::handshake::{MAX_RECV_DEPTH, MIN_RECV_DEPTH};
use crate::proto::sendq::SendQueue;

/// Receive-buffer credits at the peer that EAGER and RTS may not use: 2.
/// They are kept for CREDIT and DONE, so credit can always flow back.
pub const CONTROL_RESERVE: u16 = 2;

/// Receive buffers an endpoint posts when it connects, at most its
/// `recv_depth`: [`initial_recv_posted`]. Both sides derive it from the
/// depth the other advertised, so the handshake carries no extra field. 15
/// buffers of the default 4 KiB are 60 KiB, which keeps an idle endpoint
/// under 64 KiB of registered memory with the pool's slab rounding.
pub const INITIAL_RECV_POSTED: u16 = 15;

/// The receive buffers an endpoint with `recv_depth` slots posts at first
/// (and the credit its peer starts with): `min(recv_depth, 15)`. More are
/// posted while the peer's traffic needs them ([`MessageCore::wants_more_recv`]).
pub const fn initial_recv_posted(recv_depth: u16) -> u16 {
    if recv_depth < INITIAL_RECV_POSTED {
        recv_depth
    } else {
        INITIAL_RECV_POSTED
    }
}

/// Length of an RTS payload: 20 bytes (message length u64, remote address
/// u64, rkey u32, all big-endian).
pub const RTS_HEADER_LEN: usize = 20;

/// Largest value of the low 29 bits of an immediate: 2^29 - 1. Bounds
/// ABORT codes and CREDIT counts; RTS/DONE sequence numbers wrap modulo
/// 2^29.
pub const MAX_IMM_VALUE: u32 = (1 << 29) - 1;

/// Largest `max_message_len` accepted: 2^48 bytes (256 TiB).
pub const MAX_MESSAGE_LEN: u64 = 1 << 48;

/// Largest `max_read_len`: 2^31 bytes, the InfiniBand message size limit.
pub const MAX_READ_LEN: u32 = 1 << 31;

/// Largest `eager_buf_len`: 2^30 bytes.
pub const MAX_EAGER_BUF_LEN: u32 = 1 << 30;

/// ABORT code of aborts requested by the application; codes 1 and up are
/// protocol errors ([`MessageError::abort_code`]).
pub const ABORT_CODE_APPLICATION: u32 = 0;

const TYPE_SHIFT: u32 = 29;
const TYPE_EAGER: u32 = 0b000;
const TYPE_RTS: u32 = 0b001;
const TYPE_DONE: u32 = 0b010;
const TYPE_CREDIT: u32 = 0b011;
const TYPE_ABORT: u32 = 0b100;
const TYPE_CLOSE: u32 = 0b101;
const TYPE_NOTIFY: u32 = 0b110;

/// A decoded message immediate (see the [module docs](self) for the table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgImm {
    /// The receive buffer holds the whole message; its length is the
    /// completion's `byte_len`. It returns `credit` receive buffers
    /// (`0..=`[`MAX_IMM_VALUE`]) as a CREDIT would.
    Eager {
        /// Receive buffers returned with the message.
        credit: u32,
    },
    /// A rendezvous announcement; the payload is the 20-byte RTS header.
    Rts {
        /// Rendezvous sequence number modulo 2^29, counting from 0.
        seq: u32,
    },
    /// The receiver finished READing the RTS with sequence number `seq`
    /// (the oldest outstanding one); its buffer may be released.
    Done {
        /// Sequence number of the completed RTS, modulo 2^29.
        seq: u32,
    },
    /// `count` receive buffers (`1..=`[`MAX_IMM_VALUE`]) are returned.
    Credit {
        /// Receive buffers returned.
        count: u32,
    },
    /// The sender aborted with `code` (`0..=`[`MAX_IMM_VALUE`]); nothing
    /// follows.
    Abort {
        /// The abort code.
        code: u32,
    },
    /// The sender closed: everything of its own is done and it posts
    /// nothing after this (see [Closing](self#closing)).
    Close,
    /// An RDMA WRITE WITH IMMEDIATE into memory this side granted
    /// ([Notifications](self#notifications)); the completion's `byte_len`
    /// is the number of bytes written.
    Notify {
        /// The sender's value, `0..=`[`MAX_IMM_VALUE`].
        value: u32,
    },
}

impl MsgImm {
    /// Encodes into the 32-bit immediate (host order). Values wider than 29
    /// bits are truncated to 29 bits, so they never reach the type bits.
    pub fn encode(self) -> u32 {
        let (ty, low) = match self {
            MsgImm::Eager { credit } => (TYPE_EAGER, credit),
            MsgImm::Rts { seq } => (TYPE_RTS, seq),
            MsgImm::Done { seq } => (TYPE_DONE, seq),
            MsgImm::Credit { count } => (TYPE_CREDIT, count),
            MsgImm::Abort { code } => (TYPE_ABORT, code),
            MsgImm::Close => (TYPE_CLOSE, 0),
            MsgImm::Notify { value } => (TYPE_NOTIFY, value),
        };
        (ty << TYPE_SHIFT) | (low & MAX_IMM_VALUE)
    }

    /// Decodes a 32-bit immediate (host order).
    ///
    /// # Errors
    ///
    /// [`MessageError::UnknownType`] for type `111`;
    /// [`MessageError::BadImm`] for a CLOSE with non-zero low bits. (A
    /// CREDIT of 0 is valid since protocol version 10: an iWARP
    /// initiator's opening frame, [`MessageCore::speak_first`].)
    pub fn decode(imm: u32) -> Result<MsgImm, MessageError> {
        let low = imm & MAX_IMM_VALUE;
        match imm >> TYPE_SHIFT {
            TYPE_EAGER => Ok(MsgImm::Eager { credit: low }),
            TYPE_RTS => Ok(MsgImm::Rts { seq: low }),
            TYPE_DONE => Ok(MsgImm::Done { seq: low }),
            TYPE_CREDIT => Ok(MsgImm::Credit { count: low }),
            TYPE_ABORT => Ok(MsgImm::Abort { code: low }),
            TYPE_CLOSE if low != 0 => Err(MessageError::BadImm {
                imm,
                reason: "CLOSE with non-zero low 29 bits",
            }),
            TYPE_CLOSE => Ok(MsgImm::Close),
            TYPE_NOTIFY => Ok(MsgImm::Notify { value: low }),
            _ => Err(MessageError::UnknownType { imm }),
        }
    }
}

/// The 20-byte payload of an RTS: where the receiver READs the message from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RtsHeader {
    /// Message length in bytes.
    pub len: u64,
    /// Virtual address of the sender's registered buffer.
    pub addr: u64,
    /// rkey of the memory region holding it.
    pub rkey: u32,
}

impl RtsHeader {
    /// The wire form: `len`, `addr`, `rkey`, big-endian, 20 bytes.
    pub fn encode(&self) -> [u8; RTS_HEADER_LEN] {
        let mut out = [0u8; RTS_HEADER_LEN];
        out[0..8].copy_from_slice(&self.len.to_be_bytes());
        out[8..16].copy_from_slice(&self.addr.to_be_bytes());
        out[16..20].copy_from_slice(&self.rkey.to_be_bytes());
        out
    }

    /// Parses the first 20 bytes of `bytes`; `None` if there are fewer.
    pub fn decode(bytes: &[u8]) -> Option<RtsHeader> {
        let b = bytes.get(..RTS_HEADER_LEN)?;
        let mut len = [0u8; 8];
        let mut addr = [0u8; 8];
        let mut rkey = [0u8; 4];
        len.copy_from_slice(&b[0..8]);
        addr.copy_from_slice(&b[8..16]);
        rkey.copy_from_slice(&b[16..20]);
        Some(RtsHeader {
            len: u64::from_be_bytes(len),
            addr: u64::from_be_bytes(addr),
            rkey: u32::from_be_bytes(rkey),
        })
    }
}

/// The peer broke the message protocol, or the runtime fed the core
/// something inconsistent.
///
/// After `MessageCore::on_recv` returns one, the core has aborted the
/// connection itself (as `MessageCore::abort` does) and queued an ABORT
/// carrying [`MessageError::abort_code`]. Errors of the runtime's own calls
/// (`UnknownWrId`, `NoDestinationRequested`, `InvalidParams`) change nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// A malformed immediate: a CLOSE with non-zero low bits.
    #[error("invalid message immediate {imm:#010x}: {reason}")]
    BadImm {
        /// The immediate as received (host order).
        imm: u32,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The top 3 bits of the immediate name no message type (`111`).
    #[error("unknown message type in immediate {imm:#010x}")]
    UnknownType {
        /// The immediate as received.
        imm: u32,
    },
    /// An EAGER message longer than the agreed `eager_max`.
    #[error("peer sent an eager message of {len} bytes; at most {eager_max} allowed")]
    EagerTooLong {
        /// The completion's byte length.
        len: u32,
        /// The largest eager message, bytes.
        eager_max: u32,
    },
    /// An RTS whose payload is not exactly `RTS_HEADER_LEN` bytes (or the
    /// runtime passed fewer bytes of it).
    #[error("RTS with a {byte_len}-byte payload ({available} bytes readable); 20 expected")]
    BadRtsHeader {
        /// The completion's byte length.
        byte_len: u32,
        /// Bytes of the payload the runtime passed.
        available: usize,
    },
    /// An RTS announcing 0 bytes or more than `max_message_len`. Nothing was
    /// allocated for it.
    #[error("RTS announces {len} bytes; allowed 1..={max}")]
    BadMessageLen {
        /// The announced length, bytes.
        len: u64,
        /// The configured `max_message_len`, bytes.
        max: u64,
    },
    /// An RTS whose buffer would wrap the 64-bit address space.
    #[error("RTS buffer at {addr:#x} of {len} bytes wraps the address space")]
    BadRtsAddress {
        /// The announced address.
        addr: u64,
        /// The announced length, bytes.
        len: u64,
    },
    /// An RTS beyond `max_rendezvous_in_flight` unfinished rendezvous.
    #[error("RTS with {in_flight} rendezvous already unfinished; at most {max} allowed")]
    RendezvousOverrun {
        /// Rendezvous received whose DONE was not posted yet.
        in_flight: u16,
        /// The configured `max_rendezvous_in_flight`.
        max: u16,
    },
    /// An RTS or DONE with the wrong sequence number.
    #[error("{what} with sequence number {got}; expected {expected}")]
    BadSequence {
        /// `"RTS"` or `"DONE"`.
        what: &'static str,
        /// The sequence number received.
        got: u32,
        /// The one expected.
        expected: u32,
    },
    /// A DONE while no RTS of ours is outstanding.
    #[error("peer sent DONE (sequence {seq}) with no rendezvous outstanding")]
    UnexpectedDone {
        /// The sequence number in the DONE.
        seq: u32,
    },
    /// A non-EAGER, non-RTS message with a payload.
    #[error("control message {imm:#010x} carries {byte_len} payload bytes")]
    UnexpectedPayload {
        /// The immediate.
        imm: u32,
        /// The completion's byte length.
        byte_len: u32,
    },
    /// A CREDIT returning more buffers than this side had consumed at the
    /// peer.
    #[error("peer returned {count} receive buffers; only {outstanding} were outstanding")]
    CreditOverflow {
        /// Buffers returned by the CREDIT.
        count: u32,
        /// Buffers consumed at the peer and not yet returned.
        outstanding: u16,
    },
    /// More messages than `recv_depth` without credit returned.
    #[error(
        "peer consumed {consumed} receive buffers without credit; only {recv_depth} are posted"
    )]
    RecvOverrun {
        /// Buffers consumed and not returned, including this one.
        consumed: u32,
        /// Receive buffers this side keeps posted.
        recv_depth: u16,
    },
    /// A message arrived after the peer's ABORT.
    #[error("peer sent immediate {imm:#010x} after its ABORT")]
    MessageAfterAbort {
        /// The late immediate.
        imm: u32,
    },
    /// A message arrived after the peer's CLOSE, which must be its last.
    #[error("peer sent immediate {imm:#010x} after its CLOSE")]
    MessageAfterClose {
        /// The late immediate.
        imm: u32,
    },
    /// The runtime reported a send-queue completion (SEND or READ) for a
    /// wr_id that is not outstanding.
    #[error("completion for unknown wr_id {wr_id} (outstanding first/last: {outstanding:?})")]
    UnknownWrId {
        /// The wr_id reported.
        wr_id: u64,
        /// The oldest and newest outstanding wr_ids, `None` if none.
        outstanding: Option<(u64, u64)>,
    },
    /// `MessageCore::destination_ready` with no
    /// `MsgEvent::AllocateDestination` unanswered.
    #[error("destination {token} offered but none was requested")]
    NoDestinationRequested {
        /// The token offered.
        token: u64,
    },
    /// On a device without immediate data: a SEND too short to carry the
    /// 4-byte trailer that carries its immediate (split off by the runtime).
    #[error("SEND of {byte_len} bytes without the 4-byte trailer of its immediate")]
    MissingTrailer {
        /// The completion's byte length.
        byte_len: u32,
    },
    /// A `MessageParams` field is out of range.
    #[error("invalid message parameter {name} = {value}: {allowed}")]
    InvalidParams {
        /// The field name.
        name: &'static str,
        /// The value given.
        value: u64,
        /// The allowed range.
        allowed: &'static str,
    },
}

impl MessageError {
    /// The ABORT code sent when this error aborts the connection:
    /// `BadImm` 1, `UnknownType` 2, `EagerTooLong` 3, `BadRtsHeader` 4,
    /// `BadMessageLen` 5, `BadRtsAddress` 6, `RendezvousOverrun` 7,
    /// `BadSequence` 8, `UnexpectedDone` 9, `UnexpectedPayload` 10,
    /// `CreditOverflow` 11, `RecvOverrun` 12, `MessageAfterAbort` 13,
    /// `UnknownWrId` 14, `NoDestinationRequested` 15, `InvalidParams` 16,
    /// `MessageAfterClose` 17, `MissingTrailer` 18.
    /// Code 0 is `ABORT_CODE_APPLICATION`.
    pub fn abort_code(&self) -> u32 {
        match self {
            MessageError::BadImm { .. } => 1,
            MessageError::UnknownType { .. } => 2,
            MessageError::EagerTooLong { .. } => 3,
            MessageError::BadRtsHeader { .. } => 4,
            MessageError::BadMessageLen { .. } => 5,
            MessageError::BadRtsAddress { .. } => 6,
            MessageError::RendezvousOverrun { .. } => 7,
            MessageError::BadSequence { .. } => 8,
            MessageError::UnexpectedDone { .. } => 9,
            MessageError::UnexpectedPayload { .. } => 10,
            MessageError::CreditOverflow { .. } => 11,
            MessageError::RecvOverrun { .. } => 12,
            MessageError::MessageAfterAbort { .. } => 13,
            MessageError::UnknownWrId { .. } => 14,
            MessageError::NoDestinationRequested { .. } => 15,
            MessageError::InvalidParams { .. } => 16,
            MessageError::MessageAfterClose { .. } => 17,
            MessageError::MissingTrailer { .. } => 18,
        }
    }
}

/// What an ABORT code means: `"application"` for 0, the
/// [`MessageError`] variant's description for 1..=18 (see
/// [`MessageError::abort_code`]), `"unknown"` otherwise.
pub fn abort_code_reason(code: u32) -> &'static str {
    match code {
        ABORT_CODE_APPLICATION => "application",
        1 => "malformed immediate",
        2 => "unknown message type",
        3 => "eager message too long",
        4 => "malformed RTS",
        5 => "announced message length out of range",
        6 => "RTS buffer wraps the address space",
        7 => "too many rendezvous in flight",
        8 => "bad sequence number",
        9 => "unexpected DONE",
        10 => "control message with payload",
        11 => "credit overflow",
        12 => "receive overrun",
        13 => "message after abort",
        14 => "completion for unknown work request",
        15 => "destination not requested",
        16 => "invalid parameters",
        17 => "message after close",
        18 => "SEND without its immediate's trailer",
        _ => "unknown",
    }
}

/// Bytes at the end of every SEND that carry its immediate on a device
/// without immediate data (see the [module docs](self)): 4.
pub const TRAILER_LEN: usize = 4;

/// The trailer carrying `imm` (big-endian, as the wire carries immediate
/// data).
pub fn encode_trailer(imm: u32) -> [u8; TRAILER_LEN] {
    imm.to_be_bytes()
}

/// Splits a SEND of `byte_len` bytes that landed in `received` (the
/// receive buffer, at least `byte_len` bytes of it readable) into its
/// immediate and its payload's length (`byte_len - 4`).
///
/// # Errors
/// [`MessageError::MissingTrailer`] when `byte_len` is below 4 or beyond
/// `received`.
pub fn split_trailer(byte_len: u32, received: &[u8]) -> Result<(u32, u32), MessageError> {
    let missing = MessageError::MissingTrailer { byte_len };
    let len = byte_len
        .checked_sub(TRAILER_LEN as u32)
        .ok_or_else(|| missing.clone())?;
    let tail = received
        .get(len as usize..byte_len as usize)
        .ok_or(missing)?;
    let mut imm = [0u8; TRAILER_LEN];
    imm.copy_from_slice(tail);
    Ok((u32::from_be_bytes(imm), len))
}

/// Why [`MessageCore::send`] refuses a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// This side aborted ([`MessageCore::abort`] or a protocol error of the
    /// peer).
    #[error("message endpoint was aborted")]
    Aborted,
    /// The peer aborted, or the connection was lost.
    #[error("message endpoint was reset by the peer")]
    Reset,
    /// The peer closed (its CLOSE arrived): it takes no more messages.
    #[error("message endpoint was closed by the peer")]
    PeerClosed,
    /// This side closed ([`MessageCore::close`]).
    #[error("message endpoint is closed")]
    Closed,
    /// The message is longer than `max_message_len`.
    #[error("message of {len} bytes exceeds the maximum of {max} bytes")]
    TooLong {
        /// The message length, bytes.
        len: u64,
        /// The configured `max_message_len`, bytes.
        max: u64,
    },
}

/// Configuration of one message endpoint, validated by [`MessageCore::new`].
///
/// `recv_depth`/`eager_buf_len` are this side's (advertised in its `Hello`);
/// the `peer_*` fields come from the peer's. `eager_max` and
/// `max_message_len` are agreed by both sides (the same on both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MessageParams {
    /// Receive buffers this side keeps posted,
    /// [`MIN_RECV_DEPTH`]`..=`[`MAX_RECV_DEPTH`] (4..=1023).
    pub recv_depth: u16,
    /// Receive buffers the peer keeps posted, 4..=1023.
    pub peer_recv_depth: u16,
    /// Receive buffers this side posts at first, `4..=recv_depth` (the
    /// runtime uses [`initial_recv_posted`]); the other `recv_depth -
    /// recv_initial` slots are reserved until [`MessageCore::grow_recv`].
    pub recv_initial: u16,
    /// The peer's `recv_initial`: this side's initial credit,
    /// `4..=peer_recv_depth`.
    pub peer_recv_initial: u16,
    /// Length of each of this side's receive buffers, bytes,
    /// `1..=`[`MAX_EAGER_BUF_LEN`]. At least [`RTS_HEADER_LEN`].
    pub eager_buf_len: u32,
    /// Length of each of the peer's receive buffers, bytes; same range.
    pub peer_eager_buf_len: u32,
    /// Largest message sent (and accepted) EAGER, bytes; at most both
    /// buffer lengths. 0 sends everything but empty messages by rendezvous.
    pub eager_max: u32,
    /// EAGER messages of at most this many bytes are posted inline, as is
    /// the RTS header when this is at least 20. 0 disables inline data.
    pub inline_threshold: u32,
    /// Send-queue slots for this endpoint: at most this many WRs (SENDs and
    /// READs) are posted and not completed. At least 1.
    pub send_queue_depth: u16,
    /// Largest RDMA READ, bytes, `1..=`[`MAX_READ_LEN`].
    pub max_read_len: u32,
    /// Largest message, bytes, `1..=`[`MAX_MESSAGE_LEN`]; larger sends are
    /// refused and larger announcements are a protocol error.
    pub max_message_len: u64,
    /// Most rendezvous outstanding per direction, at least 1.
    pub max_rendezvous_in_flight: u16,
    /// Every `signal_interval`-th WR is signaled; at least 1. The last WR of
    /// a burst and every ABORT are signaled regardless.
    pub signal_interval: u16,
}

impl MessageParams {
    /// These parameters on a device without immediate data, where every
    /// SEND ends in the [`TRAILER_LEN`]-byte trailer of its immediate:
    /// `eager_max` leaves room for it in both sides' receive buffers.
    pub fn with_trailer(mut self) -> MessageParams {
        let room = |n: u32| n.saturating_sub(TRAILER_LEN as u32);
        self.eager_max = self
            .eager_max
            .min(room(self.eager_buf_len))
            .min(room(self.peer_eager_buf_len));
        self
    }
}

/// Bytes of the written length a NOTIFY's SEND carries on a device
/// without immediate data (big-endian, before the trailer).
pub const NOTIFY_LENGTH_LEN: usize = 4;

/// On a device without immediate data, the written length a NOTIFY's SEND
/// carries ([`NOTIFY_LENGTH_LEN`] bytes, big-endian), to hand to
/// [`MessageCore::on_recv`] as its `byte_len`; `None` for any other type
/// of immediate. `payload` is the SEND's bytes without the trailer.
///
/// # Errors
/// [`MessageError::UnexpectedPayload`] for a NOTIFY whose payload is not
/// exactly the length.
pub fn notify_length(imm: u32, payload: &[u8]) -> Result<Option<u32>, MessageError> {
    if imm >> TYPE_SHIFT != TYPE_NOTIFY {
        return Ok(None);
    }
    let bytes: [u8; NOTIFY_LENGTH_LEN] =
        payload
            .try_into()
            .map_err(|_| MessageError::UnexpectedPayload {
                imm,
                byte_len: payload.len() as u32,
            })?;
    Ok(Some(u32::from_be_bytes(bytes)))
}

/// What the sender wants to send: a buffer of the runtime's, named by token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OutboundMessage {
    /// The runtime's handle for the buffer; returned in
    /// [`MsgEvent::SendDone`] (or [`MsgEvent::Reclaim`]).
    pub token: u64,
    /// Message length, bytes, `0..=max_message_len`.
    pub len: u64,
    /// Virtual address of the buffer's first byte (used for rendezvous).
    pub addr: u64,
}

/// Where a NOTIFY writes: memory the peer granted (see
/// [Notifications](self#notifications)); checked against the grant by the
/// runtime before [`MessageCore::send_notify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NotifyWrite {
    /// Remote virtual address of the first byte written.
    pub remote_addr: u64,
    /// Remote key of the grant.
    pub rkey: u32,
    /// The value the peer receives, `0..=`[`MAX_IMM_VALUE`].
    pub value: u32,
}

/// Largest RDMA WRITE of a NOTIFY, bytes: 2^31, the largest message an RC
/// QP carries (IBTA: `max_msg_sz` is at most 2^31).
pub const MAX_NOTIFY_LEN: u64 = 1 << 31;

/// A queued message, or a NOTIFY's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Queued {
    msg: OutboundMessage,
    notify: Option<NotifyWrite>,
}

/// A WR to post, from [`MessageCore::poll_transmit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MsgTransmit {
    /// The WR id to post with; counts up by one from 1.
    pub wr_id: u64,
    /// What to post.
    pub kind: MsgTransmitKind,
    /// Post with `IBV_SEND_SIGNALED`.
    pub signaled: bool,
    /// Post with `IBV_SEND_SOLICITED`: every SEND except a CREDIT that
    /// leaves this side's credit above [`CONTROL_RESERVE`] (nothing at the
    /// peer waits on it then, unless the peer's own credit is low:
    /// [`MessageCore::credit_low`]); a READ consumes no receive WR and is
    /// never solicited.
    pub solicited: bool,
}

/// The shape of a [`MsgTransmit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgTransmitKind {
    /// SEND WITH IMMEDIATE of the first `len` bytes of buffer `token`.
    Eager {
        /// The buffer's token.
        token: u64,
        /// Payload length, bytes, `0..=eager_max`.
        len: u32,
        /// Immediate data (host order): [`MsgImm::Eager`].
        imm: u32,
        /// Post with `IBV_SEND_INLINE` (`len <= inline_threshold`).
        inline: bool,
    },
    /// SEND WITH IMMEDIATE of a 20-byte [`RtsHeader`] announcing `len`
    /// bytes at `addr`: the runtime binds a memory window over the message
    /// and sends the header with the window's key; when not `inline` it
    /// copies the header into registered scratch memory first.
    Rts {
        /// The message's token.
        token: u64,
        /// Message length in bytes.
        len: u64,
        /// Virtual address of the message's first byte.
        addr: u64,
        /// Immediate data (host order): [`MsgImm::Rts`].
        imm: u32,
        /// Post with `IBV_SEND_INLINE` (`inline_threshold >= 20`).
        inline: bool,
    },
    /// Zero-length SEND WITH IMMEDIATE: CREDIT, DONE, ABORT or CLOSE.
    Control {
        /// Immediate data (host order).
        imm: u32,
    },
    /// RDMA WRITE WITH IMMEDIATE of the first `len` bytes of buffer
    /// `token` to `remote_addr` (a NOTIFY): consumes one receive buffer at
    /// the peer, like a SEND.
    WriteNotify {
        /// The buffer's token.
        token: u64,
        /// Bytes written, `0..=`[`MAX_NOTIFY_LEN`].
        len: u32,
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data (host order): [`MsgImm::Notify`].
        imm: u32,
        /// Post with `IBV_SEND_INLINE` (`len <= inline_threshold`).
        inline: bool,
    },
    /// RDMA READ of `len` bytes from `remote_addr` (rkey `rkey`) into
    /// destination `local_token` at byte offset `local_offset`.
    Read {
        /// The destination's token (from
        /// [`MessageCore::destination_ready`]).
        local_token: u64,
        /// Offset in the destination, bytes.
        local_offset: u64,
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Bytes, `1..=max_read_len`.
        len: u32,
    },
}

/// What [`MessageCore::on_recv`] did with the receive buffer that completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecvDisposition {
    /// The buffer holds an EAGER message: keep it until the application
    /// takes the message ([`Delivery`]) and drops it.
    Keep,
    /// Release the buffer to the pool now (control messages, RTS, errors).
    Release,
}

/// A runtime-level event, from [`MessageCore::poll_event`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgEvent {
    /// The sender's buffer `token` is no longer needed: its EAGER SEND or
    /// NOTIFY's WRITE completed, or the peer's DONE arrived for its
    /// rendezvous.
    SendDone {
        /// The buffer's token.
        token: u64,
    },
    /// An RTS arrived: allocate a destination of exactly `len` bytes,
    /// registered for local write, and answer with
    /// [`MessageCore::destination_ready`]. Requests are answered in order.
    AllocateDestination {
        /// Bytes to allocate, `1..=max_message_len`.
        len: u64,
    },
    /// The peer aborted with `code`.
    Aborted {
        /// The peer's abort code.
        code: u32,
    },
    /// After an abort (either side) or a lost connection the core gives up
    /// buffer `token` (a queued or unfinished send, a received message not
    /// yet taken, a rendezvous destination). Free it once the QP is in the
    /// error state (no WR can still touch it).
    Reclaim {
        /// The buffer's token.
        token: u64,
    },
}

/// A complete message, handed out in send order by
/// [`MessageCore::poll_recv`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Delivery {
    /// The message is the first `len` bytes of receive buffer
    /// `recv_buf_token`.
    Eager {
        /// The receive buffer's token (as given to `on_recv`).
        recv_buf_token: u64,
        /// Message length, bytes.
        len: u32,
    },
    /// The message fills destination `dest_token` (`len` bytes).
    Rendezvous {
        /// The destination's token (as given to `destination_ready`).
        dest_token: u64,
        /// Message length, bytes.
        len: u64,
    },
    /// The peer wrote `len` bytes into memory this side granted and sent
    /// `value` with them ([Notifications](self#notifications)); no buffer.
    Notify {
        /// The peer's value, `0..=`[`MAX_IMM_VALUE`].
        value: u32,
        /// Bytes written.
        len: u32,
    },
}

impl Delivery {
    /// The message length (for a NOTIFY: the bytes written), bytes.
    pub fn len(&self) -> u64 {
        match *self {
            Delivery::Eager { len, .. } | Delivery::Notify { len, .. } => len.into(),
            Delivery::Rendezvous { len, .. } => len,
        }
    }

    /// The token of the buffer holding the message; `None` for a NOTIFY.
    pub fn token(&self) -> Option<u64> {
        match *self {
            Delivery::Eager { recv_buf_token, .. } => Some(recv_buf_token),
            Delivery::Rendezvous { dest_token, .. } => Some(dest_token),
            Delivery::Notify { .. } => None,
        }
    }
}

/// Counters of one message endpoint, from
/// [`MessageEndpoint::stats`](crate::MessageEndpoint::stats); all start at 0
/// (`spin_limit_us` is a level, not a count).
/// `#[non_exhaustive]`: counters are added as the endpoint grows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct MessageStats {
    /// Messages posted (EAGER or RTS).
    pub messages_sent: u64,
    /// Payload bytes of those messages.
    pub bytes_sent: u64,
    /// EAGER messages posted.
    pub eager_sent: u64,
    /// RTS posted.
    pub rendezvous_sent: u64,
    /// EAGER messages posted inline.
    pub inline_sent: u64,
    /// Messages handed to the application by `poll_recv`.
    pub messages_received: u64,
    /// Payload bytes of those messages.
    pub bytes_received: u64,
    /// EAGER messages received.
    pub eager_received: u64,
    /// RTS received.
    pub rendezvous_received: u64,
    /// RDMA READ WRs posted.
    pub read_wrs: u64,
    /// Bytes requested by them.
    pub read_bytes: u64,
    /// WRs handed out by `poll_transmit` (all kinds).
    pub wrs_posted: u64,
    /// Signaled WRs among them.
    pub signaled: u64,
    /// Control messages posted (CREDIT, DONE, ABORT, CLOSE).
    pub control_sent: u64,
    /// CREDIT messages among them.
    pub credits_sent: u64,
    /// EAGER messages that carried credit back (no CREDIT needed for it).
    pub credits_piggybacked: u64,
    /// Control messages received.
    pub control_received: u64,
    /// NOTIFY writes posted (not counted as messages).
    pub notifications_sent: u64,
    /// NOTIFYs handed to the application by `poll_recv` (not counted as
    /// messages).
    pub notifications_received: u64,
    /// Times a queued message became blocked on peer credit (at most
    /// `CONTROL_RESERVE` left), once per blocked period.
    pub credit_stalls: u64,
    /// Times a queued rendezvous became blocked on
    /// `max_rendezvous_in_flight`, once per blocked period.
    pub rendezvous_stalls: u64,
    /// Times work was blocked on a full send queue, once per blocked period.
    pub send_queue_stalls: u64,
    /// `send()` calls that left their message queued for a later doorbell:
    /// an eager message with at least 4 WRs outstanding, or any message
    /// behind credit or `max_rendezvous_in_flight` (filled by the
    /// endpoint).
    pub sends_deferred: u64,
    /// Times this endpoint held RDMA READs back because a complete message
    /// waited to be taken, once per held period (they go when the
    /// application takes it or at the connection driver's next tick;
    /// filled by the endpoint).
    pub reads_held: u64,
    /// Memory-window binds posted: one per rendezvous announced (filled by
    /// the endpoint; 0 from the core alone).
    pub window_binds: u64,
    /// Memory windows the endpoint's QP holds now (free, bound, being
    /// invalidated; filled by the endpoint).
    pub windows_held: u64,
    /// On a device without memory windows (iWARP): memory regions
    /// registered on the connection's own PD over exactly what the peer
    /// may reach (a rendezvous source, an RDMA READ's sink, a grant), over
    /// the endpoint's life; 0 on a device with windows (filled by the
    /// endpoint).
    pub scoped_registrations: u64,
    /// Such memory regions registered now; each is deregistered as soon
    /// as the peer is done with it (filled by the endpoint).
    pub scoped_keys_live: u64,
    /// Pool bytes this endpoint holds now for rendezvous destinations and
    /// received messages the application has not taken (what its quota
    /// bounds; filled by the endpoint).
    pub quota_bytes_held: u64,
    /// Times a rendezvous destination waited because the endpoint was at
    /// its pool quota (filled by the endpoint).
    pub quota_stalls: u64,
    /// Receive buffers the endpoint keeps posted now: 15 at first (or
    /// `recv_queue_depth` if smaller), doubled while the peer's traffic needs
    /// more, up to `recv_queue_depth`; each is `eager_buf_len` bytes of pool
    /// memory.
    pub recv_buffers_posted: u64,
    /// `recv` calls that found nothing and were answered while spinning on
    /// the completion queue (see `RdmaConfig::wait_strategy`; filled by
    /// the endpoint, as `ConnectionStats::spin_hits`).
    pub spin_hits: u64,
    /// Times a `recv` found nothing and parked: armed the completion queue
    /// and returned `Pending` (again after each wake-up that brought
    /// nothing; filled by the endpoint, as `ConnectionStats::read_parks`).
    pub recv_parks: u64,
    /// The spin limit the endpoint has learnt, in microseconds (filled by
    /// the endpoint, as `ConnectionStats::spin_limit_us`).
    pub spin_limit_us: u64,
    /// Completion events the driver task left to a parked `recv` (filled
    /// by the endpoint, as `ConnectionStats::events_left_to_reader`).
    pub events_left_to_reader: u64,
    /// Times a task found the endpoint's lock held by another thread and
    /// waited (filled by the endpoint, as `ConnectionStats::lock_waits`).
    pub lock_waits: u64,
    /// Times the endpoint's driver task woke up (filled by the endpoint,
    /// as `ConnectionStats::driver_wakeups`).
    pub driver_wakeups: u64,
    /// Buffers (messages being sent, rendezvous destinations) the endpoint
    /// gave up while a posted work request still names them, so the NIC
    /// may still read or write them: held until that WR completes or is
    /// flushed, never freed or reused before (after an abort, for
    /// example; filled by the endpoint).
    pub buffers_held_for_nic: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum WrKind {
    /// Nothing to do on completion.
    Plain,
    /// An EAGER SEND of buffer `token`.
    Eager { token: u64 },
    /// A READ of `len` bytes for rendezvous `seq`.
    Read { seq: u64, len: u32 },
    /// This side's CLOSE.
    Close,
}

/// A received data message, waiting for the application.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Inbound {
    Eager {
        token: u64,
        len: u32,
    },
    /// `dest` is set once every READ completed.
    Rendezvous {
        len: u64,
        dest: Option<u64>,
    },
    Notify {
        value: u32,
        len: u32,
    },
}

/// A rendezvous being read, oldest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Reading {
    /// Index in the inbox sequence (see `inbox_base`).
    seq: u64,
    header: RtsHeader,
    dest: Option<u64>,
    issued: u64,
    completed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Abort(u32),
    Close,
    Credit(u32),
    Done,
    Read,
    Eager,
    Rts,
}

/// The sans-IO state machine of one zero-copy message endpoint.
///
/// Driven by the runtime: queue messages ([`send`]); post what
/// [`poll_transmit`] returns until `None`; report signaled send-queue
/// completions, SENDs and READs alike ([`on_send_complete`]), and every
/// receive completion ([`on_recv`]); answer
/// [`MsgEvent::AllocateDestination`] ([`destination_ready`]); handle
/// [`poll_event`]; hand [`poll_recv`]'s messages to the application when it
/// asks. After any call, call `poll_transmit` and `poll_event` again. See
/// the [module docs](self) for the protocol and the deadlock argument.
///
/// [`send`]: MessageCore::send
/// [`poll_transmit`]: MessageCore::poll_transmit
/// [`on_send_complete`]: MessageCore::on_send_complete
/// [`on_recv`]: MessageCore::on_recv
/// [`destination_ready`]: MessageCore::destination_ready
/// [`poll_event`]: MessageCore::poll_event
/// [`poll_recv`]: MessageCore::poll_recv
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageCore {
    p: MessageParams,
    /// [`MessageCore::speak_first`]: something goes out at once (a CREDIT
    /// if nothing else).
    opening_credit: bool,

    // Send side.
    queue: VecDeque<Queued>,
    /// Bytes of the messages on `queue`.
    queued_bytes: u64,
    /// RTS posted whose DONE has not arrived: (sequence number, token).
    rts_outstanding: VecDeque<(u32, u64)>,
    next_rts_seq: u32,
    peer_credit: u16,
    /// Posted send-queue WRs not known complete, with what each one's
    /// completion means.
    sendq: SendQueue<WrKind>,

    // Receive side.
    /// Data messages received and not taken, arrival order.
    inbox: VecDeque<Inbound>,
    /// Inbox sequence number of `inbox[0]`.
    inbox_base: u64,
    reading: VecDeque<Reading>,
    /// AllocateDestination events not answered yet.
    allocs_pending: u16,
    /// Rendezvous fully read whose DONE is not posted yet.
    dones_owed: u16,
    next_done_seq: u32,
    /// Expected sequence number of the next RTS received.
    next_rts_seq_in: u32,
    /// Rendezvous received whose DONE is not posted (receiver's bound).
    rdv_in: u16,
    /// Receive slots returnable to the peer.
    to_return: u16,
    /// Receive slots the runtime could not repost yet (no free buffer).
    unposted: u16,
    /// Receive slots without a buffer by policy: the peer has not needed
    /// them yet ([`MessageCore::grow_recv`] posts them).
    reserved: u16,

    // Lifecycle.
    local_abort: Option<(u32, bool)>,
    /// This side's close: wanted, posted, completed.
    close: CloseState,
    /// The peer's CLOSE arrived.
    peer_closed: bool,
    peer_abort: Option<u32>,
    lost: bool,
    events: VecDeque<MsgEvent>,
    credit_stalled: bool,
    rdv_stalled: bool,
    sq_stalled: bool,
    /// READs held back by the runtime ([`MessageCore::set_reads_held`]).
    reads_held: bool,

    stats: MessageStats,
}

/// Where this side's close stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum CloseState {
    Open,
    /// [`MessageCore::close`] was called; CLOSE goes out once everything
    /// else is done.
    Wanted,
    /// CLOSE is posted; nothing follows it.
    Posted,
    /// CLOSE completed: the peer's QP received it.
    Completed,
}

fn check(
    name: &'static str,
    value: u64,
    range: Range<u64>,
    allowed: &'static str,
) -> Result<(), MessageError> {
    if range.contains(&value) {
        Ok(())
    } else {
        Err(MessageError::InvalidParams {
            name,
            value,
            allowed,
        })
    }
}

impl MessageCore {
    /// Creates the state machine of a freshly connected endpoint: nothing
    /// queued, credit `peer_recv_initial`.
    ///
    /// # Errors
    ///
    /// [`MessageError::InvalidParams`] naming the first field out of range
    /// (see [`MessageParams`]).
    pub fn new(params: MessageParams) -> Result<MessageCore, MessageError> {
        let depth = u64::from(MIN_RECV_DEPTH)..u64::from(MAX_RECV_DEPTH) + 1;
        let buf = RTS_HEADER_LEN as u64..u64::from(MAX_EAGER_BUF_LEN) + 1;
        let p = params;
        check("recv_depth", p.recv_depth.into(), depth.clone(), "4..=1023")?;
        check(
            "peer_recv_depth",
            p.peer_recv_depth.into(),
            depth,
            "4..=1023",
        )?;
        check(
            "recv_initial",
            p.recv_initial.into(),
            u64::from(MIN_RECV_DEPTH)..u64::from(p.recv_depth) + 1,
            "4..=recv_depth",
        )?;
        check(
            "peer_recv_initial",
            p.peer_recv_initial.into(),
            u64::from(MIN_RECV_DEPTH)..u64::from(p.peer_recv_depth) + 1,
            "4..=peer_recv_depth",
        )?;
        check(
            "eager_buf_len",
            p.eager_buf_len.into(),
            buf.clone(),
            "20..=2^30 bytes",
        )?;
        check(
            "peer_eager_buf_len",
            p.peer_eager_buf_len.into(),
            buf,
            "20..=2^30 bytes",
        )?;
        check(
            "eager_max",
            p.eager_max.into(),
            0..u64::from(p.eager_buf_len.min(p.peer_eager_buf_len)) + 1,
            "0..=min(eager_buf_len, peer_eager_buf_len) bytes",
        )?;
        check(
            "send_queue_depth",
            p.send_queue_depth.into(),
            1..1 << 16,
            "at least 1",
        )?;
        check(
            "max_read_len",
            p.max_read_len.into(),
            1..u64::from(MAX_READ_LEN) + 1,
            "1..=2^31 bytes",
        )?;
        check(
            "max_message_len",
            p.max_message_len,
            1..MAX_MESSAGE_LEN + 1,
            "1..=2^48 bytes",
        )?;
        check(
            "max_rendezvous_in_flight",
            p.max_rendezvous_in_flight.into(),
            1..1 << 16,
            "at least 1",
        )?;
        check(
            "signal_interval",
            p.signal_interval.into(),
            1..1 << 16,
            "at least 1",
        )?;
        Ok(MessageCore {
            p,
            opening_credit: false,
            queue: VecDeque::new(),
            queued_bytes: 0,
            rts_outstanding: VecDeque::new(),
            next_rts_seq: 0,
            peer_credit: p.peer_recv_initial,
            sendq: SendQueue::default(),
            reads_held: false,
            inbox: VecDeque::new(),
            inbox_base: 0,
            reading: VecDeque::new(),
            allocs_pending: 0,
            dones_owed: 0,
            next_done_seq: 0,
            next_rts_seq_in: 0,
            rdv_in: 0,
            // The reserved slots count as held back from the peer: they
            // are "returnable" only once a buffer backs them.
            to_return: p.recv_depth - p.recv_initial,
            unposted: 0,
            reserved: p.recv_depth - p.recv_initial,
            local_abort: None,
            close: CloseState::Open,
            peer_closed: false,
            peer_abort: None,
            lost: false,
            events: VecDeque::new(),
            credit_stalled: false,
            rdv_stalled: false,
            sq_stalled: false,
            stats: MessageStats::default(),
        })
    }

    /// The parameters this core was created with.
    pub fn params(&self) -> &MessageParams {
        &self.p
    }

    // ----- send side -------------------------------------------------------

    fn send_state(&self) -> Result<(), SendError> {
        if self.local_abort.is_some() {
            Err(SendError::Aborted)
        } else if self.peer_abort.is_some() || self.lost {
            Err(SendError::Reset)
        } else if self.peer_closed {
            Err(SendError::PeerClosed)
        } else if self.close != CloseState::Open {
            Err(SendError::Closed)
        } else {
            Ok(())
        }
    }

    /// Queues a message. It goes EAGER if `len <= eager_max`, else by
    /// rendezvous; messages are posted in the order queued. The runtime
    /// keeps the buffer untouched until [`MsgEvent::SendDone`] (or
    /// [`MsgEvent::Reclaim`]) names its token. The queue is unbounded; the
    /// runtime applies back-pressure with [`queued`](MessageCore::queued)
    /// and [`queued_bytes`](MessageCore::queued_bytes).
    ///
    /// # Errors
    ///
    /// [`SendError::TooLong`] above `max_message_len`;
    /// [`SendError::Aborted`] / [`SendError::Reset`] after an abort or a
    /// lost connection; [`SendError::PeerClosed`] after the peer's CLOSE;
    /// [`SendError::Closed`] after [`close`](MessageCore::close). Nothing
    /// is queued then.
    pub fn send(&mut self, msg: OutboundMessage) -> Result<(), SendError> {
        self.send_state()?;
        if msg.len > self.p.max_message_len {
            return Err(SendError::TooLong {
                len: msg.len,
                max: self.p.max_message_len,
            });
        }
        self.queued_bytes += msg.len;
        self.queue.push_back(Queued { msg, notify: None });
        Ok(())
    }

    /// Queues a NOTIFY: an RDMA WRITE WITH IMMEDIATE of `msg` (its buffer
    /// named by token, as for [`send`](MessageCore::send)) to `target`, in
    /// order with the messages queued before and after it (see
    /// [Notifications](self#notifications)). Its buffer comes back with
    /// [`MsgEvent::SendDone`] once the WRITE completed. `target.value`
    /// wider than 29 bits is truncated.
    ///
    /// # Errors
    ///
    /// [`SendError::TooLong`] above [`MAX_NOTIFY_LEN`]; otherwise as
    /// [`send`](MessageCore::send). Nothing is queued then.
    pub fn send_notify(
        &mut self,
        msg: OutboundMessage,
        target: NotifyWrite,
    ) -> Result<(), SendError> {
        self.send_state()?;
        if msg.len > MAX_NOTIFY_LEN {
            return Err(SendError::TooLong {
                len: msg.len,
                max: MAX_NOTIFY_LEN,
            });
        }
        self.queued_bytes += msg.len;
        self.queue.push_back(Queued {
            msg,
            notify: Some(target),
        });
        Ok(())
    }

    /// Whether this side's progress waits on one of its own send-queue
    /// completions, which a CQ armed for solicited events only does not
    /// announce: a WR ready to go that finds every send-queue slot taken,
    /// an RDMA READ in flight (its completion finishes a rendezvous and
    /// owes a DONE), or a close or abort under way (the runtime disconnects
    /// once its CLOSE or ABORT completed). A message queued behind the
    /// peer's credit or a rendezvous slot waits for the peer's CREDIT or
    /// DONE instead, which are receives.
    pub fn awaits_send_completion(&self) -> bool {
        let slot_bound = self.sendq.len() >= usize::from(self.p.send_queue_depth)
            && self.next_action_any_slot().is_some();
        let reads = self.reading.iter().any(|r| r.issued > r.completed);
        slot_bound || reads || self.close != CloseState::Open || self.local_abort.is_some()
    }

    /// The peer's credit is at most [`CONTROL_RESERVE`]: a message, DONE,
    /// CREDIT or CLOSE may be waiting for the peer's CREDIT, which goes
    /// without the solicited-event bit while it leaves the peer's own
    /// credit above the reserve ([`MsgTransmit::solicited`]), so a CQ armed
    /// for solicited events only would not announce it.
    pub fn credit_low(&self) -> bool {
        self.peer_credit <= CONTROL_RESERVE
    }

    /// Messages queued and not yet posted.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Takes the next queued message off the queue, keeping
    /// `queued_bytes` in step (the one place besides `send` and
    /// `reclaim_all` that changes the queue).
    fn dequeue(&mut self) -> Option<Queued> {
        let m = self.queue.pop_front()?;
        self.queued_bytes -= m.msg.len;
        Some(m)
    }

    /// Whether queued item `q` goes in one WR without a rendezvous (an
    /// EAGER message or a NOTIFY).
    fn is_direct(&self, q: &Queued) -> bool {
        q.notify.is_some() || q.msg.len <= u64::from(self.p.eager_max)
    }

    /// Bytes of the messages queued and not yet posted (a rendezvous
    /// counts its whole length until its RTS is posted).
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes
    }

    /// Whether a rendezvous has a destination and bytes left to READ
    /// (posted or held back by [`set_reads_held`](MessageCore::set_reads_held)).
    pub fn reads_due(&self) -> bool {
        self.read_target().is_some()
    }

    /// Holds RDMA READs back (`true`) or lets them go (`false`, the
    /// default): while held, [`poll_transmit`](MessageCore::poll_transmit)
    /// returns everything else (queued messages, CREDIT, DONE) and no READ,
    /// and the last WR it returns is signaled as if no READ were due. A
    /// close of this side ([`close`](MessageCore::close)) lets them go
    /// whatever is set, as it needs every rendezvous of the peer read.
    pub fn set_reads_held(&mut self, held: bool) {
        self.reads_held = held;
    }

    /// The destination token of the READ that
    /// [`poll_transmit`](MessageCore::poll_transmit) returns next, if its
    /// next WR is a READ.
    pub fn next_read_destination(&self) -> Option<u64> {
        match self.next_action() {
            Some(Action::Read) => self.read_target().and_then(|i| self.reading[i].dest),
            _ => None,
        }
    }

    #[cfg(test)]
    /// Rendezvous posted whose DONE has not arrived.
    pub fn rendezvous_outstanding(&self) -> usize {
        self.rts_outstanding.len()
    }

    #[cfg(test)]
    /// Receive-buffer credits at the peer (including the
    /// [`CONTROL_RESERVE`]).
    pub fn peer_credit(&self) -> u16 {
        self.peer_credit
    }

    /// WRs posted and not completed.
    pub fn outstanding_wrs(&self) -> usize {
        self.sendq.len()
    }

    /// Aborts the endpoint: queued messages are dropped (their tokens come
    /// back as [`MsgEvent::Reclaim`], as do every unfinished send, received
    /// message not yet taken and rendezvous destination), and the next
    /// [`poll_transmit`](MessageCore::poll_transmit) returns an ABORT
    /// carrying `code` (low 29 bits) once one credit is available; nothing
    /// follows it. Best effort after the peer's ABORT, a lost connection or
    /// a CLOSE either way (nothing is sent). Only the first call's code is
    /// used.
    pub fn abort(&mut self, code: u32) {
        if self.local_abort.is_some() {
            return;
        }
        // Nothing follows a CLOSE, ours or the peer's: the abort is local.
        let sent = self.peer_abort.is_some() || self.lost || self.any_close_sent();
        self.local_abort = Some((code & MAX_IMM_VALUE, sent));
        self.reclaim_all();
    }

    /// The connection failed underneath the core (a completion with an
    /// error status, the QP in the error state, a disconnect). Nothing is
    /// sent afterwards; every buffer comes back as [`MsgEvent::Reclaim`].
    pub fn on_connection_lost(&mut self) {
        if !self.lost {
            self.lost = true;
            self.reclaim_all();
        }
    }

    /// The application let go of the endpoint: once every queued message
    /// is posted, every rendezvous of ours DONE'd and every rendezvous of
    /// the peer's read and DONE'd, [`poll_transmit`](MessageCore::poll_transmit)
    /// returns a CLOSE (ahead of any CREDIT; it needs one credit), always
    /// signaled, and nothing after it. Later [`send`](MessageCore::send)s
    /// fail with [`SendError::Closed`]. Nothing is sent after an abort, a
    /// lost connection or the peer's CLOSE (the peer is closing already).
    pub fn close(&mut self) {
        if self.close == CloseState::Open {
            self.close = CloseState::Wanted;
        }
    }

    /// A CLOSE was posted, ours or the peer's: nothing may follow it.
    fn any_close_sent(&self) -> bool {
        self.peer_closed || matches!(self.close, CloseState::Posted | CloseState::Completed)
    }

    /// Everything of ours is done and CLOSE may go (credit permitting).
    fn close_ready(&self) -> bool {
        self.close == CloseState::Wanted
            && self.queue.is_empty()
            && self.rts_outstanding.is_empty()
            && self.dones_owed == 0
            && self.reading.is_empty()
    }

    /// True once this side's CLOSE completed: the peer received it, so the
    /// runtime may disconnect without the peer mistaking it for a failure.
    pub fn close_completed(&self) -> bool {
        self.close == CloseState::Completed
    }

    /// True while this side's CLOSE is due but cannot go for want of
    /// credit (the peer's last slot went to a CREDIT) and nothing else is
    /// outstanding: the runtime disconnects without it, as before CLOSE
    /// existed.
    pub fn close_blocked(&self) -> bool {
        self.close_ready() && self.peer_credit == 0 && self.sendq.is_empty()
    }

    /// True once the peer's CLOSE arrived: what arrived before it is
    /// delivered, then the peer's stream of messages has ended.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    fn reclaim_all(&mut self) {
        let mut tokens = Vec::new();
        tokens.extend(self.queue.drain(..).map(|m| m.msg.token));
        self.queued_bytes = 0;
        for kind in self.sendq.items_mut() {
            if let WrKind::Eager { token } = *kind {
                tokens.push(token);
            }
            *kind = WrKind::Plain;
        }
        tokens.extend(self.rts_outstanding.drain(..).map(|(_, t)| t));
        for m in self.inbox.drain(..) {
            match m {
                Inbound::Eager { token, .. } => tokens.push(token),
                Inbound::Rendezvous { dest: Some(t), .. } => tokens.push(t),
                Inbound::Rendezvous { dest: None, .. } | Inbound::Notify { .. } => {}
            }
        }
        tokens.extend(self.reading.drain(..).filter_map(|r| r.dest));
        self.dones_owed = 0;
        self.events
            .extend(tokens.into_iter().map(|token| MsgEvent::Reclaim { token }));
    }

    /// Slots that may be returned now: every returnable slot except those
    /// the runtime has not reposted a buffer for (see
    /// [`set_unposted_recvs`](MessageCore::set_unposted_recvs)).
    fn creditable(&self) -> u16 {
        // Slots not posted must be covered by slots still held back:
        // unposted <= held + (to_return - count).
        let held = u16::try_from(self.held()).unwrap_or(u16::MAX);
        let cover = held.saturating_add(self.to_return);
        self.to_return
            .min(cover.saturating_sub(self.unposted.saturating_add(self.reserved)))
    }

    /// CREDIT goes out once `max(2, posted / 4)` slots are creditable,
    /// `posted` being the slots backed by a buffer by policy.
    fn credit_threshold(&self) -> u16 {
        ((self.p.recv_depth - self.reserved) / 4).max(2)
    }

    fn credit_due(&self) -> Option<u32> {
        let n = self.creditable();
        (self.opening_credit || n >= self.credit_threshold()).then_some(u32::from(n))
    }

    /// Makes this side transmit at once: a CREDIT (returning what is due
    /// then, nothing at the start) unless a message goes first. An iWARP
    /// initiator must send the connection's first frame: MPA's responder
    /// may not send until it received one (RFC 5044, section 7.1.2;
    /// Soft-iWARP refuses the MPA reply when a frame follows it in the
    /// same read), so the accepting side holds its transmits until its
    /// first receive, and this CREDIT ends that wait even if the
    /// application on this side only receives. A CREDIT of zero is valid
    /// anywhere.
    pub fn speak_first(&mut self) {
        self.opening_credit = true;
    }

    /// Receive buffers the runtime should post beyond those it keeps
    /// posted: non-zero while slots are reserved and the peer's credit as
    /// this side can bound it (`recv_depth` minus the slots held here,
    /// messages in flight included) is at most one CREDIT's worth (the
    /// credit threshold, at least `CONTROL_RESERVE + 1`), that is the peer
    /// may block on credit before the next CREDIT reaches it. (Before
    /// credit rode on EAGERs, the sender's own CREDITs held slots here and
    /// made the bound `CONTROL_RESERVE + 1` trip; without them a sender
    /// whose batches outgrew the posted slots stalled on credit without the
    /// slots growing: benches/history/echo-2026-12-05.md, "Credit with the next EAGER".)
    /// Then the posted slots
    /// double (at most up to `recv_depth`). Post them, then call
    /// [`grow_recv`](MessageCore::grow_recv).
    pub fn wants_more_recv(&self) -> u16 {
        if self.reserved == 0 || self.lost || self.peer_abort.is_some() || self.peer_closed {
            return 0;
        }
        let peer = u32::from(self.p.recv_depth).saturating_sub(self.unreturned());
        if peer > u32::from(self.credit_threshold().max(CONTROL_RESERVE + 1)) {
            return 0;
        }
        self.reserved.min(self.p.recv_depth - self.reserved)
    }

    /// The runtime posted `n` more receive buffers (after
    /// [`wants_more_recv`](MessageCore::wants_more_recv)): that many
    /// reserved slots become creditable. At most the reserved slots count.
    pub fn grow_recv(&mut self, n: u16) {
        self.reserved -= n.min(self.reserved);
    }

    /// Receive slots backed by a buffer by policy (`recv_depth` less the
    /// reserved ones): what the runtime keeps posted.
    pub fn recv_posted(&self) -> u16 {
        self.p.recv_depth - self.reserved
    }

    #[cfg(test)]
    /// Receive slots still reserved (no buffer yet).
    pub fn recv_reserved(&self) -> u16 {
        self.reserved
    }

    /// Tells the core how many receive slots have no buffer posted right
    /// now (the runtime had no free pool buffer to replace one kept by an
    /// EAGER message). CREDIT never returns such a slot, so the peer cannot
    /// send into a receive queue that lacks a buffer (no RNR): the peer
    /// stalls on credit until the runtime reposts and sets this back.
    pub fn set_unposted_recvs(&mut self, n: u16) {
        self.unposted = n;
    }

    /// The first rendezvous with a destination and bytes left to READ.
    fn read_target(&self) -> Option<usize> {
        self.reading
            .iter()
            .position(|r| r.dest.is_some() && r.issued < r.header.len)
    }

    fn next_action_any_slot(&self) -> Option<Action> {
        if self.lost || self.peer_abort.is_some() {
            return None;
        }
        if let Some((code, sent)) = self.local_abort {
            return (!sent && self.peer_credit >= 1).then_some(Action::Abort(code));
        }
        if self.any_close_sent() {
            return None;
        }
        if self.close_ready() {
            return (self.peer_credit >= 1).then_some(Action::Close);
        }
        if let Some(count) = self.credit_due() {
            if self.eager_can_go() && self.queue.front().is_some_and(|q| q.notify.is_none()) {
                // It carries the credit.
                return Some(Action::Eager);
            }
            if self.peer_credit >= 1 {
                return Some(Action::Credit(count));
            }
        }
        if self.dones_owed > 0 && self.peer_credit >= 2 {
            return Some(Action::Done);
        }
        if self.read_target().is_some() && !self.reads_held_now() {
            return Some(Action::Read);
        }
        if self.eager_can_go() {
            return Some(Action::Eager);
        }
        // The front message, if any, is a rendezvous or short of credit.
        let rts_can_go = self.peer_credit > CONTROL_RESERVE
            && !self.queue.is_empty()
            && self.rts_outstanding.len() < usize::from(self.p.max_rendezvous_in_flight);
        rts_can_go.then_some(Action::Rts)
    }

    /// Whether READs wait now: held by the runtime, and no close of this
    /// side's wants them done.
    fn reads_held_now(&self) -> bool {
        self.reads_held && self.close == CloseState::Open
    }

    /// The next queued message is EAGER (or a NOTIFY) and the peer's
    /// credit lets it go.
    fn eager_can_go(&self) -> bool {
        self.peer_credit > CONTROL_RESERVE && self.queue.front().is_some_and(|q| self.is_direct(q))
    }

    fn next_action(&self) -> Option<Action> {
        if self.sendq.len() >= usize::from(self.p.send_queue_depth) {
            return None;
        }
        self.next_action_any_slot()
    }

    fn note_stalls(&mut self) {
        let open = self.send_state().is_ok();
        let front = self.queue.front().filter(|_| open);
        let credit = front.is_some() && self.peer_credit <= CONTROL_RESERVE;
        if credit && !self.credit_stalled {
            self.stats.credit_stalls += 1;
        }
        self.credit_stalled = credit;
        let rdv = front.is_some_and(|q| !self.is_direct(q))
            && self.rts_outstanding.len() >= usize::from(self.p.max_rendezvous_in_flight);
        if rdv && !self.rdv_stalled {
            self.stats.rendezvous_stalls += 1;
        }
        self.rdv_stalled = rdv;
        let sq = self.sendq.len() >= usize::from(self.p.send_queue_depth)
            && self.next_action_any_slot().is_some();
        if sq && !self.sq_stalled {
            self.stats.send_queue_stalls += 1;
        }
        self.sq_stalled = sq;
    }

    /// The next WR to post, or `None` when nothing can go now (call again
    /// after the next event).
    ///
    /// Order: ABORT (then nothing else); CLOSE once due (then nothing
    /// else; nothing either after the peer's CLOSE); CREDIT once `max(2, recv_depth/4)`
    /// slots are returnable, unless the next queued message is EAGER and
    /// can go: then it goes first and carries the credit (every EAGER
    /// returns every returnable slot); DONE (needs 2 credits); READs of rendezvous
    /// with a destination (no credit needed), in RTS order, in chunks of at
    /// most `max_read_len`; then the next queued message, EAGER or RTS
    /// (needs more than [`CONTROL_RESERVE`] credits; an RTS also a free
    /// rendezvous slot; a blocked message blocks those behind it). At most
    /// `send_queue_depth` WRs are outstanding. A WR is signaled every
    /// `signal_interval`-th time, for ABORT and CLOSE, and when it is the last one
    /// that can be posted now.
    pub fn poll_transmit(&mut self) -> Option<MsgTransmit> {
        self.note_stalls();
        let action = self.next_action()?;
        // Whatever goes first is the first frame (`speak_first`).
        self.opening_credit = false;
        let mut always_signal = false;
        let credit = matches!(action, Action::Credit(_));
        let (kind, wr_kind) = match action {
            Action::Abort(code) => {
                if let Some((_, sent)) = &mut self.local_abort {
                    *sent = true;
                }
                always_signal = true;
                let imm = MsgImm::Abort { code }.encode();
                (MsgTransmitKind::Control { imm }, WrKind::Plain)
            }
            Action::Close => {
                self.close = CloseState::Posted;
                always_signal = true;
                let imm = MsgImm::Close.encode();
                (MsgTransmitKind::Control { imm }, WrKind::Close)
            }
            Action::Credit(count) => {
                self.to_return -= count as u16;
                self.stats.credits_sent += 1;
                let imm = MsgImm::Credit { count }.encode();
                (MsgTransmitKind::Control { imm }, WrKind::Plain)
            }
            Action::Done => {
                self.dones_owed -= 1;
                self.rdv_in -= 1;
                let seq = self.next_done_seq;
                self.next_done_seq = (seq + 1) & MAX_IMM_VALUE;
                let imm = MsgImm::Done { seq }.encode();
                (MsgTransmitKind::Control { imm }, WrKind::Plain)
            }
            Action::Read => {
                let i = self.read_target()?;
                let max = u64::from(self.p.max_read_len);
                let r = &mut self.reading[i];
                let local_token = r.dest?;
                let len = (r.header.len - r.issued).min(max) as u32;
                let local_offset = r.issued;
                r.issued += u64::from(len);
                // The READ that finishes a message's reads is signaled:
                // the runtime may end a doorbell's batch after it.
                always_signal = r.issued == r.header.len;
                let kind = MsgTransmitKind::Read {
                    local_token,
                    local_offset,
                    remote_addr: r.header.addr + local_offset,
                    rkey: r.header.rkey,
                    len,
                };
                self.stats.read_wrs += 1;
                self.stats.read_bytes += u64::from(len);
                (kind, WrKind::Read { seq: r.seq, len })
            }
            Action::Eager => {
                let Queued { msg: m, notify } = self.dequeue()?;
                if let Some(target) = notify {
                    // len <= MAX_NOTIFY_LEN = 2^31.
                    let len = m.len as u32;
                    self.stats.notifications_sent += 1;
                    let kind = MsgTransmitKind::WriteNotify {
                        token: m.token,
                        len,
                        remote_addr: target.remote_addr,
                        rkey: target.rkey,
                        imm: MsgImm::Notify {
                            value: target.value,
                        }
                        .encode(),
                        inline: len <= self.p.inline_threshold,
                    };
                    (kind, WrKind::Eager { token: m.token })
                } else {
                    // len <= eager_max <= 2^30.
                    let len = m.len as u32;
                    let inline = len <= self.p.inline_threshold;
                    self.stats.messages_sent += 1;
                    self.stats.bytes_sent += m.len;
                    self.stats.eager_sent += 1;
                    self.stats.inline_sent += u64::from(inline);
                    // Every returnable slot goes back with it.
                    let credit = self.creditable();
                    self.to_return -= credit;
                    if credit > 0 {
                        self.stats.credits_piggybacked += 1;
                    }
                    let kind = MsgTransmitKind::Eager {
                        token: m.token,
                        len,
                        imm: MsgImm::Eager {
                            credit: u32::from(credit),
                        }
                        .encode(),
                        inline,
                    };
                    (kind, WrKind::Eager { token: m.token })
                }
            }
            Action::Rts => {
                let m = self.dequeue()?.msg;
                let seq = self.next_rts_seq;
                self.next_rts_seq = (seq + 1) & MAX_IMM_VALUE;
                self.rts_outstanding.push_back((seq, m.token));
                self.stats.messages_sent += 1;
                self.stats.bytes_sent += m.len;
                self.stats.rendezvous_sent += 1;
                let kind = MsgTransmitKind::Rts {
                    token: m.token,
                    len: m.len,
                    addr: m.addr,
                    imm: MsgImm::Rts { seq }.encode(),
                    inline: RTS_HEADER_LEN as u32 <= self.p.inline_threshold,
                };
                (kind, WrKind::Plain)
            }
        };
        if !matches!(kind, MsgTransmitKind::Read { .. }) {
            self.peer_credit -= 1;
        }
        // A CREDIT that leaves this side's credit at the reserve is
        // solicited: the peer, whose CQ may be armed for solicited events
        // only, must poll what this side sent to return credit for it.
        let solicited = match kind {
            MsgTransmitKind::Read { .. } => false,
            _ if credit => self.credit_low(),
            _ => true,
        };
        if matches!(kind, MsgTransmitKind::Control { .. }) {
            self.stats.control_sent += 1;
        }
        let wr_id = self.sendq.push(wr_kind);
        // Signaled when due, when the core must, and for the last WR of a
        // burst (asked after the push: a full send queue ends the burst).
        let signaled = self.sendq.signaled(
            always_signal
                || self.sendq.signal_due(self.p.signal_interval)
                || self.next_action().is_none(),
        );
        if signaled {
            self.stats.signaled += 1;
        }
        self.stats.wrs_posted += 1;
        Some(MsgTransmit {
            wr_id,
            kind,
            signaled,
            solicited,
        })
    }

    /// A signaled send-queue WR (SEND or READ) completed successfully. By
    /// RC ordering every earlier WR completed too: EAGER buffers among them
    /// are released ([`MsgEvent::SendDone`]) and READ bytes counted; a
    /// rendezvous whose READs all completed gets its DONE queued and becomes
    /// deliverable.
    ///
    /// # Errors
    ///
    /// [`MessageError::UnknownWrId`] if `wr_id` is not outstanding; nothing
    /// changes then.
    pub fn on_send_complete(&mut self, wr_id: u64) -> Result<(), MessageError> {
        self.sendq
            .check(wr_id)
            .map_err(|outstanding| MessageError::UnknownWrId { wr_id, outstanding })?;
        self.complete_through(wr_id);
        Ok(())
    }

    /// Send-queue WR `wr_id` failed (an error status other than a flush):
    /// it was the oldest WR not acknowledged (RC completes in order), so
    /// every WR posted before it, signaled or not, completed successfully
    /// and is handled as [`on_send_complete`](MessageCore::on_send_complete)
    /// would. The failed WR and those after it stay outstanding (the
    /// runtime then loses the connection, or after the peer's CLOSE ends
    /// it). Nothing happens if no earlier WR is outstanding.
    pub fn on_send_failed(&mut self, wr_id: u64) {
        if let Some(before) = wr_id.checked_sub(1) {
            self.complete_through(before);
        }
    }

    /// Completes every outstanding WR up to and including `wr_id`.
    fn complete_through(&mut self, wr_id: u64) {
        while let Some(kind) = self.sendq.pop_done(wr_id) {
            match kind {
                WrKind::Plain => {}
                WrKind::Eager { token } => self.events.push_back(MsgEvent::SendDone { token }),
                WrKind::Read { seq, len } => self.read_completed(seq, len),
                WrKind::Close => self.close = CloseState::Completed,
            }
        }
    }

    fn read_completed(&mut self, seq: u64, len: u32) {
        if let Some(r) = self.reading.iter_mut().find(|r| r.seq == seq) {
            r.completed += u64::from(len);
        }
        // READs complete in order, so finished rendezvous are at the front.
        while self
            .reading
            .front()
            .is_some_and(|r| r.completed >= r.header.len)
        {
            let Some(r) = self.reading.pop_front() else {
                break;
            };
            if let Some(slot) = r
                .seq
                .checked_sub(self.inbox_base)
                .and_then(|i| self.inbox.get_mut(i as usize))
            {
                *slot = Inbound::Rendezvous {
                    len: r.header.len,
                    dest: r.dest,
                };
            }
            self.dones_owed += 1;
        }
    }

    /// The next runtime event, oldest first.
    pub fn poll_event(&mut self) -> Option<MsgEvent> {
        self.events.pop_front()
    }

    // ----- receive side ----------------------------------------------------

    /// Processes one receive completion (`IBV_WC_RECV` with immediate):
    /// host-order `imm`, the completion's `byte_len`, the receive buffer's
    /// token, and `payload`, the buffer's first bytes (at least the first 20
    /// for an RTS; the core reads nothing else). The runtime has already
    /// reposted a fresh buffer.
    ///
    /// Returns whether the runtime keeps the buffer (an EAGER message, until
    /// the application takes it) or releases it now.
    ///
    /// # Errors
    ///
    /// In this order: [`MessageError::MessageAfterAbort`];
    /// [`MessageError::MessageAfterClose`]; [`MessageError::RecvOverrun`]; [`MessageError::UnknownType`] /
    /// [`MessageError::BadImm`]; for EAGER [`MessageError::EagerTooLong`];
    /// for RTS [`MessageError::BadRtsHeader`],
    /// [`MessageError::BadSequence`], [`MessageError::BadMessageLen`],
    /// [`MessageError::BadRtsAddress`], [`MessageError::RendezvousOverrun`]
    /// (nothing is allocated for a rejected RTS); for the others
    /// [`MessageError::UnexpectedPayload`], then for DONE
    /// [`MessageError::UnexpectedDone`] / [`MessageError::BadSequence`] and
    /// for CREDIT [`MessageError::CreditOverflow`]. On any error the core
    /// aborts with [`MessageError::abort_code`]; release the buffer.
    pub fn on_recv(
        &mut self,
        imm: u32,
        byte_len: u32,
        recv_buf_token: u64,
        payload: &[u8],
    ) -> Result<RecvDisposition, MessageError> {
        let result = self.on_recv_inner(imm, byte_len, recv_buf_token, payload);
        if let Err(err) = &result {
            self.abort(err.abort_code());
        }
        result
    }

    /// The peer returned `count` receive buffers (a CREDIT, or credit
    /// carried by an EAGER).
    fn take_credit(&mut self, count: u32) -> Result<(), MessageError> {
        let outstanding = self.p.peer_recv_depth - self.peer_credit;
        if count > u32::from(outstanding) {
            return Err(MessageError::CreditOverflow { count, outstanding });
        }
        self.peer_credit += count as u16;
        Ok(())
    }

    fn on_recv_inner(
        &mut self,
        imm: u32,
        byte_len: u32,
        token: u64,
        payload: &[u8],
    ) -> Result<RecvDisposition, MessageError> {
        if self.peer_abort.is_some() {
            return Err(MessageError::MessageAfterAbort { imm });
        }
        if self.peer_closed {
            return Err(MessageError::MessageAfterClose { imm });
        }
        let consumed = self.unreturned() + 1;
        if consumed > u32::from(self.p.recv_depth) {
            return Err(MessageError::RecvOverrun {
                consumed,
                recv_depth: self.p.recv_depth,
            });
        }
        let msg = MsgImm::decode(imm)?;
        if !matches!(
            msg,
            MsgImm::Eager { .. } | MsgImm::Rts { .. } | MsgImm::Notify { .. }
        ) && byte_len != 0
        {
            return Err(MessageError::UnexpectedPayload { imm, byte_len });
        }
        let aborted_here = self.local_abort.is_some() || self.lost;
        match msg {
            MsgImm::Eager { credit } => {
                if byte_len > self.p.eager_max {
                    return Err(MessageError::EagerTooLong {
                        len: byte_len,
                        eager_max: self.p.eager_max,
                    });
                }
                self.take_credit(credit)?;
                self.stats.eager_received += 1;
                if aborted_here {
                    self.to_return += 1;
                    return Ok(RecvDisposition::Release);
                }
                self.inbox.push_back(Inbound::Eager {
                    token,
                    len: byte_len,
                });
                Ok(RecvDisposition::Keep)
            }
            MsgImm::Rts { seq } => {
                let header = match RtsHeader::decode(payload) {
                    Some(h) if byte_len as usize == RTS_HEADER_LEN => h,
                    _ => {
                        return Err(MessageError::BadRtsHeader {
                            byte_len,
                            available: payload.len(),
                        });
                    }
                };
                if seq != self.next_rts_seq_in {
                    return Err(MessageError::BadSequence {
                        what: "RTS",
                        got: seq,
                        expected: self.next_rts_seq_in,
                    });
                }
                if header.len == 0 || header.len > self.p.max_message_len {
                    return Err(MessageError::BadMessageLen {
                        len: header.len,
                        max: self.p.max_message_len,
                    });
                }
                if header.addr.checked_add(header.len).is_none() {
                    return Err(MessageError::BadRtsAddress {
                        addr: header.addr,
                        len: header.len,
                    });
                }
                if self.rdv_in >= self.p.max_rendezvous_in_flight {
                    return Err(MessageError::RendezvousOverrun {
                        in_flight: self.rdv_in,
                        max: self.p.max_rendezvous_in_flight,
                    });
                }
                self.next_rts_seq_in = (seq + 1) & MAX_IMM_VALUE;
                self.stats.rendezvous_received += 1;
                if aborted_here {
                    self.to_return += 1;
                    return Ok(RecvDisposition::Release);
                }
                self.rdv_in += 1;
                let seq = self.inbox_base + self.inbox.len() as u64;
                self.inbox.push_back(Inbound::Rendezvous {
                    len: header.len,
                    dest: None,
                });
                self.reading.push_back(Reading {
                    seq,
                    header,
                    dest: None,
                    issued: 0,
                    completed: 0,
                });
                self.allocs_pending += 1;
                self.events
                    .push_back(MsgEvent::AllocateDestination { len: header.len });
                Ok(RecvDisposition::Release)
            }
            MsgImm::Done { seq } => {
                let Some(&(expected, token)) = self.rts_outstanding.front() else {
                    if aborted_here {
                        // Reclaimed already; the DONE is late, not wrong.
                        self.to_return += 1;
                        self.stats.control_received += 1;
                        return Ok(RecvDisposition::Release);
                    }
                    return Err(MessageError::UnexpectedDone { seq });
                };
                if seq != expected {
                    return Err(MessageError::BadSequence {
                        what: "DONE",
                        got: seq,
                        expected,
                    });
                }
                self.rts_outstanding.pop_front();
                self.events.push_back(MsgEvent::SendDone { token });
                self.to_return += 1;
                self.stats.control_received += 1;
                Ok(RecvDisposition::Release)
            }
            MsgImm::Credit { count } => {
                self.take_credit(count)?;
                self.to_return += 1;
                self.stats.control_received += 1;
                Ok(RecvDisposition::Release)
            }
            MsgImm::Abort { code } => {
                self.peer_abort = Some(code);
                self.to_return += 1;
                self.stats.control_received += 1;
                self.events.push_back(MsgEvent::Aborted { code });
                if !aborted_here {
                    self.reclaim_all();
                }
                Ok(RecvDisposition::Release)
            }
            MsgImm::Close => {
                self.peer_closed = true;
                self.to_return += 1;
                self.stats.control_received += 1;
                Ok(RecvDisposition::Release)
            }
            MsgImm::Notify { value } => {
                if aborted_here {
                    self.to_return += 1;
                } else {
                    self.inbox.push_back(Inbound::Notify {
                        value,
                        len: byte_len,
                    });
                }
                Ok(RecvDisposition::Release)
            }
        }
    }

    /// Data messages received and not taken by the application.
    fn held(&self) -> u32 {
        self.inbox.len() as u32
    }

    /// The runtime allocated `token` for the oldest unanswered
    /// [`MsgEvent::AllocateDestination`]; its READs can start. After an
    /// abort the token comes straight back as [`MsgEvent::Reclaim`].
    ///
    /// # Errors
    ///
    /// [`MessageError::NoDestinationRequested`] if no request is
    /// unanswered; nothing changes then.
    pub fn destination_ready(&mut self, token: u64) -> Result<(), MessageError> {
        if self.allocs_pending == 0 {
            return Err(MessageError::NoDestinationRequested { token });
        }
        self.allocs_pending -= 1;
        match self.reading.iter_mut().find(|r| r.dest.is_none()) {
            Some(r) => r.dest = Some(token),
            None => self.events.push_back(MsgEvent::Reclaim { token }),
        }
        Ok(())
    }

    /// Hands the next message, in send order, to the application, if it is
    /// complete. Taking it makes its receive slot returnable credit, so an
    /// application that stops calling this stalls the peer after
    /// `recv_depth - 2` messages. The application owns the buffer from now
    /// on. `None` after an abort.
    pub fn poll_recv(&mut self) -> Option<Delivery> {
        let delivery = match *self.inbox.front()? {
            Inbound::Eager { token, len } => Delivery::Eager {
                recv_buf_token: token,
                len,
            },
            Inbound::Rendezvous { len, dest: Some(t) } => {
                Delivery::Rendezvous { dest_token: t, len }
            }
            Inbound::Rendezvous { dest: None, .. } => return None,
            Inbound::Notify { value, len } => Delivery::Notify { value, len },
        };
        self.inbox.pop_front();
        self.inbox_base += 1;
        self.to_return += 1;
        if let Delivery::Notify { .. } = delivery {
            self.stats.notifications_received += 1;
        } else {
            self.stats.messages_received += 1;
            self.stats.bytes_received += delivery.len();
        }
        Some(delivery)
    }

    /// Whether the next delivery, complete or not, is a NOTIFY.
    pub fn next_is_notify(&self) -> bool {
        matches!(self.inbox.front(), Some(Inbound::Notify { .. }))
    }

    /// Whether [`poll_recv`](MessageCore::poll_recv) would return a message.
    pub fn has_deliverable(&self) -> bool {
        matches!(
            self.inbox.front(),
            Some(
                Inbound::Eager { .. }
                    | Inbound::Rendezvous { dest: Some(_), .. }
                    | Inbound::Notify { .. }
            )
        )
    }

    #[cfg(test)]
    /// Messages received (complete or not) and not yet taken.
    pub fn pending_recv(&self) -> usize {
        self.inbox.len()
    }

    /// Announced messages whose payload has not fully arrived (rendezvous
    /// not yet read to the end). A peer that disconnects while this is
    /// non-zero vanished in the middle of a message.
    pub fn incomplete_recv(&self) -> usize {
        self.inbox
            .iter()
            .filter(|m| matches!(m, Inbound::Rendezvous { dest: None, .. }))
            .count()
    }

    /// True once every queued message is posted, every rendezvous got its
    /// DONE, every DONE owed is posted and every WR completed (or, after an
    /// abort, the ABORT was posted and completed; after the peer's ABORT or
    /// a lost connection: always).
    pub fn all_sent(&self) -> bool {
        if self.lost || self.peer_abort.is_some() {
            return true;
        }
        let queued_done = match self.local_abort {
            Some((_, sent)) => sent,
            None => {
                self.queue.is_empty()
                    && self.rts_outstanding.is_empty()
                    && self.dones_owed == 0
                    && self.reading.is_empty()
            }
        };
        queued_done && self.sendq.is_empty()
    }

    #[cfg(test)]
    /// True after [`abort`](MessageCore::abort), a protocol error, or the
    /// peer's ABORT.
    pub fn is_aborted(&self) -> bool {
        self.local_abort.is_some() || self.peer_abort.is_some()
    }

    #[cfg(test)]
    /// This side's abort code, if it aborted.
    pub fn local_abort_code(&self) -> Option<u32> {
        self.local_abort.map(|(code, _)| code)
    }

    #[cfg(test)]
    /// The peer's abort code, if its ABORT arrived.
    pub fn peer_abort_code(&self) -> Option<u32> {
        self.peer_abort
    }

    /// The endpoint's counters.
    pub fn stats(&self) -> MessageStats {
        MessageStats {
            recv_buffers_posted: self.recv_posted().into(),
            ..self.stats
        }
    }

    /// Receive slots held for the peer: returnable plus held by untaken
    /// messages (reserved slots included).
    pub(crate) fn unreturned(&self) -> u32 {
        u32::from(self.to_return) + self.held()
    }

    /// Forgets the stall flags and counters (they depend on how often
    /// `poll_transmit` was called), for the exhaustive search.
    #[cfg(test)]
    pub(crate) fn forget_stalls(&mut self) {
        self.stats.credit_stalls = 0;
        self.stats.rendezvous_stalls = 0;
        self.stats.send_queue_stalls = 0;
        self.credit_stalled = false;
        self.rdv_stalled = false;
        self.sq_stalled = false;
    }
}
