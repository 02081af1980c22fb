//! The byte-stream state machine: ring cursors, credits, selective
//! signaling, half-close and abort.
//!
//! [`StreamCore`] does offset and credit arithmetic only; the runtime owns
//! the memory, posts the work requests (WRs) it is told to, and feeds back
//! completions. Three regions are involved:
//!
//! - the **send buffer** (`send_buf_len` bytes, registered, local), used as a
//!   ring: the application's bytes are copied in at the places
//!   [`StreamCore::accept_write`] names, then posted from there;
//! - the **local receive ring** (`ring_len` bytes, advertised in our
//!   [`Hello`](crate::proto::handshake::Hello)) that the peer writes into;
//! - the **peer receive ring** (`peer_ring_len` bytes, from the peer's
//!   `Hello`) that we write into.
//!
//! # Messages and credits
//!
//! Every message is one RDMA WRITE WITH IMMEDIATE (see
//! [`imm`](crate::proto::imm)) and consumes exactly one receive WR at the
//! peer, which the peer's runtime reposts at once. Two credits limit a
//! sender:
//!
//! - **byte credit**: ring bytes the peer's reader has consumed and returned.
//!   The sender's view is `peer_ring_len - written + returned`; DATA never
//!   exceeds it, so unread bytes are never overwritten.
//! - **WR credit**: receive WRs the peer has returned. The sender's view is
//!   `peer_recv_depth - sent + returned`. DATA may only use credit above
//!   [`CONTROL_RESERVE`] (2); FIN needs at least 2; a CREDIT may use the
//!   last one only if it returns at least one WR; ABORT needs 1.
//!
//! The receiver returns credit in CREDIT messages when its unreturned
//! consumed bytes reach `T_b = max(1, min(ring_len / 4, 2^20 - 1))` or its
//! unreturned receive WRs reach `T_w = max(2, recv_depth / 4)`. Credits are
//! returned from [`StreamCore::on_recv`] (WRs) and [`StreamCore::consume`]
//! (bytes) alone, so WR credit flows even while the application does not
//! read.
//!
//! # Why this cannot deadlock
//!
//! Call a state *quiescent* when no message is in flight and every
//! signaled WR has completed. Let `c_X` be X's WR credit at its peer Y and
//! `u_Y` the WRs Y has received from X and not returned. In a quiescent
//! state `c_X + u_Y = depth_Y` (depth_Y is Y's `recv_depth`, at least
//! [`MIN_RECV_DEPTH`] = 4).
//!
//! 1. *Not both WR credits are zero.* A message that takes a credit from 1 to
//!    0 is a CREDIT returning at least one WR (or a terminal ABORT). Take the
//!    last such messages `a` (from A) and `b` (from B), `a` sent first. If
//!    `a` reached B before `b` was sent, `b` returns `a`'s WR, so A's credit
//!    is at least 1 afterwards and A never spends it to 0 again (`a` was its
//!    last such message). Otherwise `b` was sent before `a` arrived, and `a`
//!    gives B at least 1 credit that B never spends to 0 again.
//! 2. *A sender blocked on WR credit gets it.* A blocks data when
//!    `c_A <= 2`, so `u_B >= depth_B - 2 >= T_w(depth_B)` (true for every
//!    depth >= 4), and B wants to send a CREDIT. (FIN blocks at
//!    `c_A <= 1`, a stronger condition.) B can send it unless `c_B = 0`, or
//!    `c_B = 1` and `u_B = 0`; the latter contradicts `u_B >= 2`. If
//!    `c_B = 0` then `u_A = depth_A >= T_w` so A wants to send a CREDIT, and
//!    by 1. `c_A >= 1` with `u_A >= 1`, so A can; that gives B credit and
//!    B's CREDIT follows.
//! 3. *A sender blocked on byte credit gets it once the reader has read.*
//!    `c_bytes_A = 0` means B's ring holds `ring_len_B` bytes that are
//!    unread or unreturned. Once B's reader has consumed everything, B's
//!    unreturned bytes are `ring_len_B >= T_b`, so B wants to send a CREDIT
//!    and can by the same reasoning as 2. A reader that does not read
//!    stalls its peer: that is flow control, not deadlock.
//! 4. *Credits do not ping-pong forever.* A CREDIT sent because of WRs
//!    returns at least `T_w >= 2` WRs, so each side sends at most one such
//!    CREDIT per two messages it receives; with data finite the exchange
//!    dies out geometrically. (With `T_w = 1`, two idle peers would bounce
//!    CREDITs forever; hence the minimum of 2 and the minimum depth of 4.)
//! 5. *Send-queue slots come back.* A WR is signaled when it is the last one
//!    [`StreamCore::poll_transmit`] can produce now, so whenever
//!    `poll_transmit` returns `None` the newest posted WR is signaled and
//!    its completion frees every slot and send-buffer byte before it.
//!
//! The tests in `src/proto/tests.rs` check this exhaustively on small
//! configurations and on many random schedules.
//!
//! # Ring growth (protocol version 6)
//!
//! A receiver R whose ring filled to half or more and was then drained to a
//! quarter by its reader [`GROW_AFTER_FILLS`] times asks its runtime for a ring
//! twice as large ([`StreamCore::ring_wanted`], bounded by
//! `max_ring_len`), and [`StreamCore::offer_ring`] sends its address and
//! key in four GRANT chunks ([`Imm::Grant`]). The sender S takes the offer
//! when the last chunk arrives: its byte credit becomes the new ring's
//! length, its writes start at offset 0 of the new ring, and it sends
//! SWITCH before the first of them.
//!
//! - *No byte is overwritten or credited twice.* R stops returning bytes of
//!   the current ring the moment the last chunk is posted (they are
//!   *abandoned*), so every CREDIT S receives after the offer counts bytes of
//!   the new ring only; CREDITs R posted before it precede it on the wire and
//!   apply to the old ring. S writes the old ring only within the credit it
//!   had before the offer arrived, which never covered unread bytes.
//! - *R knows where each DATA lies.* RC delivers in order: DATA before S's
//!   SWITCH lands in the old ring, DATA after it in the new ring at offset
//!   0 ([`RecvEvent::Data`]'s `ring`). Bytes left in the old ring are read
//!   first; once they are read and SWITCH has arrived, S can no longer write
//!   there and [`StreamCore::oldest_ring`] lets the runtime free it. One
//!   offer is outstanding at a time and none while an old ring is read out.
//! - *No deadlock.* GRANT chunks and SWITCH use WR credit as DATA does (above
//!   [`CONTROL_RESERVE`]), a finite number of times, so arguments 1-4 above
//!   hold as for DATA; a sender blocked on byte credit of the old ring gets
//!   the new ring's credit with the offer, which R has posted whole before it
//!   stopped returning bytes. A SWITCH not yet sent when S sends its FIN is
//!   dropped (no DATA follows); R then keeps reading its current ring.

use std::ops::Range;

use crate::proto::error::{ProtocolError, WriteError};
use crate::proto::handshake::{MAX_RECV_DEPTH, MAX_RING_LEN, MIN_RECV_DEPTH};
use crate::proto::imm::{
    GRANT_CHUNKS, Imm, MAX_CREDIT_BYTES, MAX_CREDIT_WRS, MAX_DATA_LEN, grant_chunks,
    grant_descriptor,
};
use crate::proto::sendq::SendQueue;

/// Receive-WR credits at the peer that data may not use: 2. They are kept
/// for control messages (CREDIT, FIN), so credit can always flow back.
pub const CONTROL_RESERVE: u16 = 2;

/// Fill cycles after which a receive ring asks to grow: 4. A cycle is the
/// ring filling to half its length or more, counting bytes read and not
/// yet returned (byte credit is what holds the peer's writer back), and
/// the reader then draining it to a quarter or less (the reader keeps up,
/// so a larger ring lets more bytes fly). A reader slower than its writer
/// keeps the ring nearly full and never grows it; an idle or
/// request/response connection with small messages never fills it. The
/// count starts again after each growth. (In the Soft-RoCE guest a
/// stricter rule, within a quarter of full and then empty, stopped one
/// step short: one-way bulk settled at 128 KiB where 256 KiB was faster on
/// the multi-thread runtime; benches/history/echo-2026-12-04.md,
/// "Receive rings that grow under bulk".)
pub const GROW_AFTER_FILLS: u16 = 4;

/// Configuration of one byte stream, validated by [`StreamCore::new`].
///
/// `ring_len`/`recv_depth` are what this side advertised in its `Hello`;
/// `peer_ring_len`/`peer_recv_depth` come from the peer's `Hello`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamParams {
    /// Length of the local registered send buffer in bytes,
    /// `1..=`[`MAX_RING_LEN`] (1 GiB).
    pub send_buf_len: u32,
    /// Length of the local receive ring in bytes, `1..=`[`MAX_RING_LEN`].
    /// After a ring growth, [`StreamCore::params`] reports the current
    /// ring's length here.
    pub ring_len: u32,
    /// Largest length in bytes the local receive ring may grow to,
    /// `ring_len..=`[`MAX_RING_LEN`]: the ring doubles (see
    /// [`StreamCore::ring_wanted`]) while the double is at most this.
    /// Equal to `ring_len`: the ring never grows.
    pub max_ring_len: u32,
    /// Receive WRs this side keeps posted,
    /// [`MIN_RECV_DEPTH`]`..=`[`MAX_RECV_DEPTH`] (4..=1023).
    pub recv_depth: u16,
    /// Length of the peer's receive ring in bytes, `1..=`[`MAX_RING_LEN`].
    /// After the peer's ring grew, [`StreamCore::params`] reports the
    /// current peer ring's length here.
    pub peer_ring_len: u32,
    /// Receive WRs the peer keeps posted, [`MIN_RECV_DEPTH`]`..=`[`MAX_RECV_DEPTH`].
    pub peer_recv_depth: u16,
    /// Send-queue slots available to this stream; at most this many WRs are
    /// posted and not yet completed. At least 1.
    pub send_queue_depth: u16,
    /// Data WRs of at most this many bytes are posted inline
    /// (`IBV_SEND_INLINE`). 0 disables inline data.
    pub inline_threshold: u32,
    /// Every `signal_interval`-th WR is signaled (1 signals every WR). At
    /// least 1. Independently of it, the last WR of a burst and every FIN
    /// and ABORT are signaled.
    pub signal_interval: u16,
    /// Largest payload of one data WR in bytes (for example 1 MiB),
    /// `1..=`[`MAX_DATA_LEN`].
    pub max_write_len: u32,
}

/// A work request the runtime must post next, from
/// [`StreamCore::poll_transmit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transmit {
    /// The WR id to post with; ids count up by one per transmit, starting
    /// at 1.
    pub wr_id: u64,
    /// What to post.
    pub kind: TransmitKind,
    /// Post with `IBV_SEND_SIGNALED`; unsignaled WRs produce no completion.
    pub signaled: bool,
}

/// The shape of a [`Transmit`]. Both kinds are an RDMA WRITE WITH IMMEDIATE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransmitKind {
    /// Write `len` bytes from `send_buf[local_offset..local_offset + len]`
    /// to `peer_ring[remote_offset..remote_offset + len]` of the peer ring
    /// of generation `ring` (the address and rkey of the last
    /// [`RecvEvent::Grant`], or the handshake's for generation 0). Neither
    /// range wraps; `1 <= len <= max_write_len`.
    Data {
        /// Generation of the peer ring: 0 for the handshake's, one more per
        /// [`RecvEvent::Grant`].
        ring: u32,
        /// Offset in the local send buffer, bytes.
        local_offset: u32,
        /// Payload length, bytes.
        len: u32,
        /// Offset in the peer's receive ring, bytes.
        remote_offset: u32,
        /// Immediate data (host order): an encoded [`Imm::Data`].
        imm: u32,
        /// Post with `IBV_SEND_INLINE` (`len <= inline_threshold`).
        inline: bool,
    },
    /// A zero-length write carrying only `imm`: an encoded [`Imm::Credit`],
    /// [`Imm::Fin`], [`Imm::Abort`], [`Imm::Grant`] or [`Imm::Switch`].
    Control {
        /// Immediate data (host order).
        imm: u32,
    },
}

impl TransmitKind {
    #[cfg(test)]
    /// The immediate data to post (host order).
    pub fn imm(&self) -> u32 {
        match *self {
            TransmitKind::Data { imm, .. } | TransmitKind::Control { imm } => imm,
        }
    }
}

/// What one receive completion meant, from [`StreamCore::on_recv`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecvEvent {
    /// `len` new bytes lie at `ring[offset..offset + len]` of the local
    /// receive ring of generation `ring` (never wrapping), right after the
    /// previous data.
    Data {
        /// Generation of the local ring: 0 for the handshake's, one more per
        /// [`RecvEvent::Switch`].
        ring: u32,
        /// Ring offset, bytes.
        offset: u32,
        /// Length, bytes (at least 1).
        len: u32,
    },
    /// The peer returned `wrs` receive WRs and `bytes` ring bytes of credit;
    /// writes blocked on credit may proceed.
    Credit {
        /// Receive WRs returned.
        wrs: u16,
        /// Ring bytes returned.
        bytes: u32,
    },
    /// The peer half-closed: after the bytes already received, reads reach
    /// end-of-file.
    Fin,
    /// One chunk (index 0..=2) of the peer's ring offer arrived; nothing
    /// for the runtime to do.
    GrantChunk {
        /// The chunk's index.
        index: u8,
    },
    /// The peer offered a receive ring of `len` bytes at `addr`, opened
    /// with `rkey` (its last GRANT chunk arrived). From now on DATA WRs
    /// write there ([`TransmitKind::Data`]'s `ring` counts up by one); the
    /// runtime must use `addr` and `rkey` for them.
    Grant {
        /// Virtual address of the new ring at the peer.
        addr: u64,
        /// Remote key of the new ring.
        rkey: u32,
        /// Length of the new ring in bytes (twice the previous one).
        len: u32,
    },
    /// The peer took this side's ring offer: DATA from now on lands in the
    /// ring offered last (generation one more). The previous ring is still
    /// read out first; [`StreamCore::oldest_ring`] says when it may go.
    Switch,
    /// The peer aborted the connection with `code`; writes now fail with
    /// [`WriteError::Reset`].
    Abort {
        /// The peer's abort code.
        code: u32,
    },
}

/// Counters of one stream, from [`StreamCore::stats`]. All start at 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct StreamStats {
    /// Payload bytes posted in data WRs.
    pub bytes_sent: u64,
    /// Payload bytes received in DATA messages.
    pub bytes_received: u64,
    /// WRs handed out by `poll_transmit` (data and control).
    pub wrs_posted: u64,
    /// Data WRs among them.
    pub data_wrs: u64,
    /// Signaled WRs among them.
    pub signaled: u64,
    /// Inline data WRs among them.
    pub inline: u64,
    /// Control messages sent (CREDIT, FIN, ABORT).
    pub control_sent: u64,
    /// CREDIT messages among them.
    pub credits_sent: u64,
    /// Control messages received (CREDIT, FIN, ABORT).
    pub control_received: u64,
    /// Times the sender became blocked on peer credit: `poll_transmit` found
    /// buffered data but no byte credit or no WR credit above the reserve,
    /// counted once per blocked period.
    pub credit_stalls: u64,
    /// Times the sender became blocked on a full send queue, counted once per
    /// blocked period.
    pub send_queue_stalls: u64,
    /// Times the local receive ring grew (the peer's SWITCH arrived).
    pub rings_grown: u64,
    /// Times this side moved its writes to a larger peer ring (a whole
    /// ring offer arrived).
    pub peer_rings_grown: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct LocalAbort {
    code: u32,
    sent: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Abort(u32),
    Credit { wrs: u16, bytes: u32 },
    Grant { index: u8, bits: u32 },
    Switch,
    Data { len: u32 },
    Fin,
}

/// Where the local ring's growth stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Growth {
    /// Counting fill cycles ([`GROW_AFTER_FILLS`]): `fills` completed,
    /// `nearly_full` once the ring filled since it last emptied.
    Watching { fills: u16, nearly_full: bool },
    /// The runtime offered a ring; chunks `next..` are still to send.
    Offering { chunks: [u32; 4], next: u8 },
    /// Every chunk sent: the peer writes the new ring after its SWITCH.
    /// Bytes consumed from the current ring are never returned from now
    /// on (the peer's credit starts anew with the new ring).
    Offered,
}

impl Growth {
    /// A ring that has just started (or just grown): no fill cycle yet.
    const FRESH: Growth = Growth::Watching {
        fills: 0,
        nearly_full: false,
    };
}

/// A previous local ring still holding unread bytes after a SWITCH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct OldRing {
    generation: u32,
    len: u32,
    read_pos: u32,
    unconsumed: u32,
}

/// The sans-IO state machine of one byte stream.
///
/// Driven by the runtime: copy application bytes in ([`write_capacity`],
/// [`accept_write`]), post what [`poll_transmit`] returns until it returns
/// `None`, report signaled send completions ([`on_send_complete`]) and every
/// receive completion ([`on_recv`]), and report bytes the reader copied out of
/// the ring ([`consume`]). After any of these calls, call `poll_transmit`
/// again. See the [module docs](self) for the protocol and the deadlock
/// argument.
///
/// [`write_capacity`]: StreamCore::write_capacity
/// [`accept_write`]: StreamCore::accept_write
/// [`poll_transmit`]: StreamCore::poll_transmit
/// [`on_send_complete`]: StreamCore::on_send_complete
/// [`on_recv`]: StreamCore::on_recv
/// [`consume`]: StreamCore::consume
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StreamCore {
    p: StreamParams,
    credit_bytes_threshold: u32,
    credit_wrs_threshold: u16,
    /// [`StreamCore::speak_first`]: a CREDIT goes out before anything
    /// else, due or not.
    opening_credit: bool,

    // Send buffer (ring of p.send_buf_len bytes).
    /// Where `accept_write` copies next.
    sb_write_pos: u32,
    /// Where the next data WR reads from.
    sb_post_pos: u32,
    /// Bytes buffered and not yet posted.
    sb_unposted: u32,
    /// Bytes posted and not yet completed.
    sb_inflight: u32,

    // Peer ring and credits.
    /// Where the next data WR writes in the peer ring.
    remote_pos: u32,
    /// Ring bytes we may still write at the peer.
    peer_bytes_credit: u32,
    /// Receive WRs we may still consume at the peer.
    peer_wr_credit: u16,

    /// Posted and not completed, oldest first, with the send-buffer bytes
    /// each holds (0 for control messages).
    sendq: SendQueue<u32>,

    // Write-side lifecycle.
    fin_requested: bool,
    fin_sent: bool,
    local_abort: Option<LocalAbort>,
    credit_stalled: bool,
    sq_stalled: bool,

    // Growth of the peer's ring.
    /// Generation of the peer ring DATA is written into.
    peer_ring_gen: u32,
    /// Chunks of the peer's ring offer received so far, and their bits.
    grant_rx: (u8, [u32; 4]),
    /// An offer was taken: SWITCH goes out before the next DATA.
    switch_pending: bool,

    // Growth of the local ring.
    /// Generation of the local ring DATA arrives in.
    ring_gen: u32,
    growth: Growth,
    /// Bytes of the current ring consumed after the last offer went out:
    /// never returned, and not free until the SWITCH.
    abandoned: u32,
    /// The previous ring, read before the current one.
    old_ring: Option<OldRing>,

    // Receive side (local ring of p.ring_len bytes).
    /// Ring offset where the next DATA lands.
    recv_tail: u32,
    /// Ring offset of the oldest unconsumed byte.
    read_pos: u32,
    /// Bytes received and not consumed.
    unconsumed: u32,
    /// Bytes consumed and not yet returned to the peer.
    bytes_to_return: u32,
    /// Receive WRs consumed and not yet returned to the peer.
    wrs_to_return: u16,
    fin_received: bool,
    peer_abort: Option<u32>,
    lost: bool,

    stats: StreamStats,
}

fn check(
    name: &'static str,
    value: u64,
    range: Range<u64>,
    allowed: &'static str,
) -> Result<(), ProtocolError> {
    if range.contains(&value) {
        Ok(())
    } else {
        Err(ProtocolError::InvalidParams {
            name,
            value,
            allowed,
        })
    }
}

/// `T_b`: unreturned consumed bytes of a `ring_len`-byte ring that make a
/// CREDIT due (a quarter of the ring, 1..=[`MAX_CREDIT_BYTES`]).
fn credit_bytes_threshold(ring_len: u32) -> u32 {
    (ring_len / 4).clamp(1, MAX_CREDIT_BYTES)
}

fn ranges(start: u32, len: u32, ring: u32) -> [Range<usize>; 2] {
    let start = start as usize;
    let len = len as usize;
    let ring = ring as usize;
    let first = len.min(ring - start);
    [start..start + first, 0..len - first]
}

impl StreamCore {
    /// Creates the state machine of a freshly connected stream: empty
    /// buffers, full credit (`peer_ring_len` bytes, `peer_recv_depth` WRs).
    ///
    /// # Errors
    ///
    /// [`ProtocolError::InvalidParams`] naming the first field out of range
    /// (see [`StreamParams`]).
    pub fn new(params: StreamParams) -> Result<StreamCore, ProtocolError> {
        let ring = 1..u64::from(MAX_RING_LEN) + 1;
        let depth = u64::from(MIN_RECV_DEPTH)..u64::from(MAX_RECV_DEPTH) + 1;
        check(
            "send_buf_len",
            params.send_buf_len.into(),
            ring.clone(),
            "1..=2^30 bytes",
        )?;
        check(
            "ring_len",
            params.ring_len.into(),
            ring.clone(),
            "1..=2^30 bytes",
        )?;
        check(
            "max_ring_len",
            params.max_ring_len.into(),
            u64::from(params.ring_len)..u64::from(MAX_RING_LEN) + 1,
            "ring_len..=2^30 bytes",
        )?;
        check(
            "recv_depth",
            params.recv_depth.into(),
            depth.clone(),
            "4..=1023",
        )?;
        check(
            "peer_ring_len",
            params.peer_ring_len.into(),
            ring,
            "1..=2^30 bytes",
        )?;
        check(
            "peer_recv_depth",
            params.peer_recv_depth.into(),
            depth,
            "4..=1023",
        )?;
        check(
            "send_queue_depth",
            params.send_queue_depth.into(),
            1..1 << 16,
            "at least 1",
        )?;
        check(
            "signal_interval",
            params.signal_interval.into(),
            1..1 << 16,
            "at least 1",
        )?;
        check(
            "max_write_len",
            params.max_write_len.into(),
            1..u64::from(MAX_DATA_LEN) + 1,
            "1..=2^30-1 bytes",
        )?;
        Ok(StreamCore {
            p: params,
            credit_bytes_threshold: credit_bytes_threshold(params.ring_len),
            credit_wrs_threshold: (params.recv_depth / 4).max(2),
            opening_credit: false,
            sb_write_pos: 0,
            sb_post_pos: 0,
            sb_unposted: 0,
            sb_inflight: 0,
            remote_pos: 0,
            peer_bytes_credit: params.peer_ring_len,
            peer_wr_credit: params.peer_recv_depth,
            sendq: SendQueue::default(),
            fin_requested: false,
            fin_sent: false,
            local_abort: None,
            credit_stalled: false,
            sq_stalled: false,
            peer_ring_gen: 0,
            grant_rx: (0, [0; 4]),
            switch_pending: false,
            ring_gen: 0,
            growth: Growth::FRESH,
            abandoned: 0,
            old_ring: None,
            recv_tail: 0,
            read_pos: 0,
            unconsumed: 0,
            bytes_to_return: 0,
            wrs_to_return: 0,
            fin_received: false,
            peer_abort: None,
            lost: false,
            stats: StreamStats::default(),
        })
    }

    /// The parameters this core was created with.
    pub fn params(&self) -> &StreamParams {
        &self.p
    }

    // ----- send side -------------------------------------------------------

    fn write_state(&self) -> Result<(), WriteError> {
        if self.local_abort.is_some() {
            Err(WriteError::Aborted)
        } else if self.peer_abort.is_some() || self.lost {
            Err(WriteError::Reset)
        } else if self.fin_requested {
            Err(WriteError::Shutdown)
        } else {
            Ok(())
        }
    }

    /// Free bytes in the send buffer now: how many bytes
    /// [`accept_write`](StreamCore::accept_write) takes.
    ///
    /// # Errors
    ///
    /// [`WriteError::Aborted`] after [`abort`](StreamCore::abort) or a
    /// protocol error from the peer; [`WriteError::Reset`] after the peer's
    /// ABORT or [`on_connection_lost`](StreamCore::on_connection_lost);
    /// [`WriteError::Shutdown`] after [`shutdown`](StreamCore::shutdown).
    pub fn write_capacity(&self) -> Result<usize, WriteError> {
        self.write_state()?;
        Ok((self.p.send_buf_len - self.sb_unposted - self.sb_inflight) as usize)
    }

    /// Reserves the next `n` bytes of the send buffer and returns where the
    /// runtime must copy them: `ranges[0]` then `ranges[1]` (empty unless the
    /// bytes wrap at the end of the buffer), offsets in bytes. The bytes
    /// count as buffered from now on and are posted by
    /// [`poll_transmit`](StreamCore::poll_transmit), so copy them before the
    /// next `poll_transmit`.
    ///
    /// `n` must not exceed [`write_capacity`](StreamCore::write_capacity);
    /// a larger `n` is cut down to it (debug builds assert), and nothing is
    /// reserved when writes are refused. The two ranges' lengths always add
    /// up to the bytes actually reserved.
    pub fn accept_write(&mut self, n: usize) -> [Range<usize>; 2] {
        let capacity = self.write_capacity().unwrap_or(0);
        debug_assert!(n <= capacity, "accept_write({n}) with capacity {capacity}");
        // capacity <= send_buf_len <= 2^30, so this fits in u32.
        let n = n.min(capacity) as u32;
        let out = ranges(self.sb_write_pos, n, self.p.send_buf_len);
        self.sb_write_pos = advance(self.sb_write_pos, n, self.p.send_buf_len);
        self.sb_unposted += n;
        out
    }

    /// Half-closes the write side: a FIN is sent after every buffered byte.
    /// Later writes fail with [`WriteError::Shutdown`]. Idempotent; reads are
    /// unaffected.
    pub fn shutdown(&mut self) {
        self.fin_requested = true;
    }

    /// Aborts the connection: buffered bytes that were not posted are
    /// dropped, no FIN is sent, and the next
    /// [`poll_transmit`](StreamCore::poll_transmit) returns an ABORT carrying
    /// `code` (bits above the 30th are dropped) as soon as one receive-WR
    /// credit is available; nothing is sent after it. Writes fail with
    /// [`WriteError::Aborted`].
    ///
    /// Best effort: after the peer's ABORT or
    /// [`on_connection_lost`](StreamCore::on_connection_lost) nothing is
    /// sent. Only the first call's code is used.
    pub fn abort(&mut self, code: u32) {
        if self.local_abort.is_some() {
            return;
        }
        self.local_abort = Some(LocalAbort {
            code: code & crate::proto::imm::MAX_ABORT_CODE,
            sent: self.peer_abort.is_some() || self.lost,
        });
        self.sb_write_pos = self.sb_post_pos;
        self.sb_unposted = 0;
    }

    /// Tells the core the connection failed underneath it (a completion with
    /// an error status, the QP moved to the error state, or rdma_cm reported
    /// `DISCONNECTED` without a FIN first). Nothing is sent afterwards and
    /// writes fail with [`WriteError::Reset`].
    pub fn on_connection_lost(&mut self) {
        self.lost = true;
    }

    /// Makes this side's first transmit a CREDIT (returning what is due
    /// then, nothing at the start), whatever the application writes. An
    /// iWARP initiator must send the connection's first frame: MPA's
    /// responder may not send until it received one (RFC 5044, section
    /// 7.1.2; Soft-iWARP refuses the MPA reply when a frame follows it in
    /// the same read), so the accepting side holds its transmits until its
    /// first receive, and this CREDIT ends that wait even if the
    /// application on this side only reads (a protocol where the server
    /// speaks first). A CREDIT of zero is valid anywhere.
    pub fn speak_first(&mut self) {
        self.opening_credit = true;
    }

    fn credit_due(&self) -> Option<Action> {
        if self.opening_credit
            || self.bytes_to_return >= self.credit_bytes_threshold
            || self.wrs_to_return >= self.credit_wrs_threshold
        {
            Some(Action::Credit {
                wrs: self.wrs_to_return.min(MAX_CREDIT_WRS),
                bytes: self.bytes_to_return.min(MAX_CREDIT_BYTES),
            })
        } else {
            None
        }
    }

    fn data_blocked_on_credit(&self) -> bool {
        self.peer_bytes_credit == 0 || self.peer_wr_credit <= CONTROL_RESERVE
    }

    fn data_len(&self) -> u32 {
        self.sb_unposted
            .min(self.p.send_buf_len - self.sb_post_pos)
            .min(self.p.peer_ring_len - self.remote_pos)
            .min(self.peer_bytes_credit)
            .min(self.p.max_write_len)
    }

    /// The next action, ignoring the send-queue limit.
    fn next_action_any_slot(&self) -> Option<Action> {
        if self.lost || self.peer_abort.is_some() {
            return None;
        }
        if let Some(abort) = self.local_abort {
            return (!abort.sent && self.peer_wr_credit >= 1).then_some(Action::Abort(abort.code));
        }
        if let Some(credit @ Action::Credit { wrs, .. }) = self.credit_due() {
            if self.peer_wr_credit >= 2 || (self.peer_wr_credit == 1 && wrs >= 1) {
                return Some(credit);
            }
        }
        // Ring growth uses WR credit as DATA does (above the reserve).
        let above_reserve = self.peer_wr_credit > CONTROL_RESERVE;
        if let Growth::Offering { chunks, next } = self.growth {
            if above_reserve {
                return Some(Action::Grant {
                    index: next,
                    bits: chunks[usize::from(next)],
                });
            }
        }
        if self.switch_pending && above_reserve {
            return Some(Action::Switch);
        }
        if self.sb_unposted > 0 {
            if !self.data_blocked_on_credit() {
                return Some(Action::Data {
                    len: self.data_len(),
                });
            }
        } else if self.fin_requested && !self.fin_sent && self.peer_wr_credit >= CONTROL_RESERVE {
            return Some(Action::Fin);
        }
        None
    }

    fn next_action(&self) -> Option<Action> {
        if self.sendq.len() >= usize::from(self.p.send_queue_depth) {
            return None;
        }
        self.next_action_any_slot()
    }

    fn note_stalls(&mut self) {
        let open = self.local_abort.is_none() && self.peer_abort.is_none() && !self.lost;
        let credit_blocked = open && self.sb_unposted > 0 && self.data_blocked_on_credit();
        if credit_blocked && !self.credit_stalled {
            self.stats.credit_stalls += 1;
        }
        self.credit_stalled = credit_blocked;
        let sq_blocked = self.sendq.len() >= usize::from(self.p.send_queue_depth)
            && self.next_action_any_slot().is_some();
        if sq_blocked && !self.sq_stalled {
            self.stats.send_queue_stalls += 1;
        }
        self.sq_stalled = sq_blocked;
    }

    /// The next work request to post, or `None` when nothing can go now
    /// (nothing to send, no credit, or the send queue is full; call again
    /// after the next event).
    ///
    /// Order: ABORT (after [`abort`](StreamCore::abort), and then nothing
    /// else), a CREDIT when returned-credit thresholds are reached, data,
    /// then FIN once every buffered byte is posted. A data WR never wraps the
    /// send buffer or the peer ring and is at most `max_write_len` bytes; it
    /// needs byte credit and more than [`CONTROL_RESERVE`] WR credits. At
    /// most `send_queue_depth` WRs are outstanding.
    ///
    /// `signaled` is set on every `signal_interval`-th WR, on FIN and ABORT,
    /// and on the last WR that can be posted now (the next call would return
    /// `None`), so every burst ends with a signaled WR whose completion
    /// releases the whole burst.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.note_stalls();
        let action = self.next_action()?;
        // Whatever goes first is the first frame (`speak_first`).
        self.opening_credit = false;
        let (kind, buf_bytes, always_signal) = match action {
            Action::Data { len } => {
                debug_assert!(!self.switch_pending, "DATA before SWITCH");
                let local_offset = self.sb_post_pos;
                let remote_offset = self.remote_pos;
                self.sb_post_pos = advance(self.sb_post_pos, len, self.p.send_buf_len);
                self.remote_pos = advance(self.remote_pos, len, self.p.peer_ring_len);
                self.sb_unposted -= len;
                self.sb_inflight += len;
                self.peer_bytes_credit -= len;
                let inline = len <= self.p.inline_threshold;
                self.stats.bytes_sent += u64::from(len);
                self.stats.data_wrs += 1;
                self.stats.inline += u64::from(inline);
                (
                    TransmitKind::Data {
                        ring: self.peer_ring_gen,
                        local_offset,
                        len,
                        remote_offset,
                        imm: Imm::Data { len }.encode(),
                        inline,
                    },
                    len,
                    false,
                )
            }
            Action::Credit { wrs, bytes } => {
                self.wrs_to_return -= wrs;
                self.bytes_to_return -= bytes;
                self.stats.credits_sent += 1;
                (
                    TransmitKind::Control {
                        imm: Imm::Credit { wrs, bytes }.encode(),
                    },
                    0,
                    false,
                )
            }
            Action::Grant { index, bits } => {
                if index + 1 == GRANT_CHUNKS {
                    // The peer takes the offer when this chunk arrives and
                    // counts credit for the new ring from then on.
                    self.growth = Growth::Offered;
                    self.abandoned += self.bytes_to_return;
                    self.bytes_to_return = 0;
                } else if let Growth::Offering { next, .. } = &mut self.growth {
                    *next = index + 1;
                }
                (
                    TransmitKind::Control {
                        imm: Imm::Grant { index, bits }.encode(),
                    },
                    0,
                    false,
                )
            }
            Action::Switch => {
                self.switch_pending = false;
                (
                    TransmitKind::Control {
                        imm: Imm::Switch.encode(),
                    },
                    0,
                    false,
                )
            }
            Action::Fin => {
                self.fin_sent = true;
                // No DATA follows, so no SWITCH is needed.
                self.switch_pending = false;
                (
                    TransmitKind::Control {
                        imm: Imm::Fin.encode(),
                    },
                    0,
                    true,
                )
            }
            Action::Abort(code) => {
                if let Some(abort) = &mut self.local_abort {
                    abort.sent = true;
                }
                (
                    TransmitKind::Control {
                        imm: Imm::Abort { code }.encode(),
                    },
                    0,
                    true,
                )
            }
        };
        self.peer_wr_credit -= 1;
        if matches!(kind, TransmitKind::Control { .. }) {
            self.stats.control_sent += 1;
        }
        let wr_id = self.sendq.push(buf_bytes);
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
        Some(Transmit {
            wr_id,
            kind,
            signaled,
        })
    }

    /// A signaled WR completed successfully. By RC ordering every earlier WR
    /// completed too, so the send-buffer bytes and send-queue slots of every
    /// WR up to and including `wr_id` are released.
    ///
    /// # Errors
    ///
    /// [`ProtocolError::UnknownWrId`] if `wr_id` is not outstanding (never
    /// handed out, or already released); nothing changes then.
    pub fn on_send_complete(&mut self, wr_id: u64) -> Result<(), ProtocolError> {
        self.sendq
            .check(wr_id)
            .map_err(|outstanding| ProtocolError::UnknownWrId { wr_id, outstanding })?;
        while let Some(buf_bytes) = self.sendq.pop_done(wr_id) {
            self.sb_inflight -= buf_bytes;
        }
        Ok(())
    }

    /// True when the write side has nothing left to do: no buffered bytes,
    /// the FIN posted if [`shutdown`](StreamCore::shutdown) was called, and
    /// every posted WR completed. After [`abort`](StreamCore::abort): the
    /// ABORT posted and completed. After the peer's ABORT or
    /// [`on_connection_lost`](StreamCore::on_connection_lost): always true.
    /// The runtime lingers on a dropped stream until this holds (bounded by
    /// a timeout, since an ABORT may never get credit).
    pub fn all_sent(&self) -> bool {
        if self.lost || self.peer_abort.is_some() {
            return true;
        }
        let queued_done = match self.local_abort {
            Some(abort) => abort.sent,
            None => self.sb_unposted == 0 && (!self.fin_requested || self.fin_sent),
        };
        queued_done && self.sendq.is_empty()
    }

    /// Send-buffer bytes holding data: accepted and not yet known complete
    /// (buffered, or posted in WRs that have not completed). While this is
    /// 0 no posted WR reads the send buffer, so the runtime may swap it for
    /// another buffer of the same length; offsets stay valid.
    pub fn send_buf_in_use(&self) -> usize {
        (self.sb_unposted + self.sb_inflight) as usize
    }

    /// Changes the send buffer's length to `len` bytes while it holds
    /// nothing ([`send_buf_in_use`](StreamCore::send_buf_in_use) is 0), so
    /// the runtime can swap in a buffer of another length: the next
    /// [`accept_write`](StreamCore::accept_write) copies to offset 0 and
    /// [`write_capacity`](StreamCore::write_capacity) is `len`. The
    /// runtime grows the buffer to the peer's ring after the peer's ring
    /// grew (`RdmaConfig::max_ring_size`): a send buffer smaller than the
    /// peer's ring holds fewer bytes in flight than byte credit allows.
    ///
    /// Returns whether the length is `len` now; `false` (nothing changes)
    /// while bytes are in use or when `len` is outside `1..=`[`MAX_RING_LEN`].
    pub fn resize_send_buf(&mut self, len: u32) -> bool {
        if self.send_buf_in_use() != 0 || len == 0 || len > MAX_RING_LEN {
            return false;
        }
        self.p.send_buf_len = len;
        self.sb_write_pos = 0;
        self.sb_post_pos = 0;
        true
    }

    /// Whether [`shutdown`](StreamCore::shutdown) was called (the FIN is
    /// queued, posted or completed).
    pub fn shutdown_requested(&self) -> bool {
        self.fin_requested
    }

    /// Bytes buffered and not yet posted.
    pub fn unposted_len(&self) -> usize {
        self.sb_unposted as usize
    }

    /// WRs posted and not yet completed.
    pub fn outstanding_wrs(&self) -> usize {
        self.sendq.len()
    }

    #[cfg(test)]
    /// Ring bytes this side may still write at the peer now (byte credit).
    pub fn peer_bytes_credit(&self) -> u32 {
        self.peer_bytes_credit
    }

    /// Generation of the peer ring DATA is written into now: 0 for the
    /// handshake's, one more per [`RecvEvent::Grant`].
    pub fn peer_ring_generation(&self) -> u32 {
        self.peer_ring_gen
    }

    #[cfg(test)]
    /// Receive WRs this side may still consume at the peer now (WR credit,
    /// including the [`CONTROL_RESERVE`]).
    pub fn peer_wr_credit(&self) -> u16 {
        self.peer_wr_credit
    }

    // ----- receive side ----------------------------------------------------

    /// Processes one receive completion (`IBV_WC_RECV_RDMA_WITH_IMM`) with
    /// host-order immediate `imm`. The completion consumed one posted
    /// receive WR; the runtime reposts it at once and the core counts it as
    /// WR credit to return.
    ///
    /// # Errors
    ///
    /// Checked in this order: [`ProtocolError::MessageAfterAbort`] after the
    /// peer's ABORT; [`ProtocolError::WrOverrun`] if more than `recv_depth`
    /// WRs are consumed without credit returned;
    /// [`ProtocolError::BadImm`] from [`Imm::decode`]; for DATA
    /// [`ProtocolError::DataAfterFin`], [`ProtocolError::RingWrap`] (crosses
    /// the ring end), [`ProtocolError::RingOverrun`] (more than the free
    /// ring space); for CREDIT [`ProtocolError::CreditOverflow`]; for FIN
    /// [`ProtocolError::DuplicateFin`]. On any error the core aborts the
    /// connection with [`ProtocolError::abort_code`] (as
    /// [`abort`](StreamCore::abort) does), so the peer is told.
    pub fn on_recv(&mut self, imm: u32) -> Result<RecvEvent, ProtocolError> {
        let result = self.on_recv_inner(imm);
        if let Err(err) = &result {
            self.abort(err.abort_code());
        }
        result
    }

    fn on_recv_inner(&mut self, imm: u32) -> Result<RecvEvent, ProtocolError> {
        if self.peer_abort.is_some() {
            return Err(ProtocolError::MessageAfterAbort { imm });
        }
        let consumed = u32::from(self.wrs_to_return) + 1;
        if consumed > u32::from(self.p.recv_depth) {
            return Err(ProtocolError::WrOverrun {
                consumed,
                recv_depth: self.p.recv_depth,
            });
        }
        let msg = Imm::decode(imm)?;
        // Validate before committing anything.
        match msg {
            Imm::Data { len } => {
                if self.fin_received {
                    return Err(ProtocolError::DataAfterFin { len });
                }
                if u64::from(self.recv_tail) + u64::from(len) > u64::from(self.p.ring_len) {
                    return Err(ProtocolError::RingWrap {
                        offset: self.recv_tail,
                        len,
                        ring_len: self.p.ring_len,
                    });
                }
                let free = self.ring_free();
                if len > free {
                    return Err(ProtocolError::RingOverrun { len, free });
                }
            }
            Imm::Credit { wrs, bytes } => {
                let outstanding_wrs = self.p.peer_recv_depth - self.peer_wr_credit;
                let outstanding_bytes = self.p.peer_ring_len - self.peer_bytes_credit;
                if wrs > outstanding_wrs || bytes > outstanding_bytes {
                    return Err(ProtocolError::CreditOverflow {
                        wrs,
                        bytes,
                        outstanding_wrs,
                        outstanding_bytes,
                    });
                }
            }
            Imm::Fin if self.fin_received => return Err(ProtocolError::DuplicateFin),
            Imm::Fin | Imm::Abort { .. } => {}
            Imm::Grant { index, bits } => {
                let reason = if self.switch_pending {
                    Some("a new ring offer before the last one was taken")
                } else if index != self.grant_rx.0 {
                    Some("GRANT chunk out of order")
                } else if index + 1 == GRANT_CHUNKS && self.p.peer_ring_len > MAX_RING_LEN / 2 {
                    Some("a ring offer beyond the largest ring (2^30 bytes)")
                } else if index + 1 == GRANT_CHUNKS && self.offered_range_overflows(bits) {
                    Some("a ring offer whose address range passes 2^64")
                } else {
                    None
                };
                if let Some(reason) = reason {
                    return Err(ProtocolError::RingGrowth { reason });
                }
            }
            Imm::Switch => {
                let reason = if self.growth != Growth::Offered {
                    Some("SWITCH without a ring offer")
                } else if self.fin_received {
                    Some("SWITCH after FIN")
                } else {
                    None
                };
                if let Some(reason) = reason {
                    return Err(ProtocolError::RingGrowth { reason });
                }
            }
        }
        self.wrs_to_return += 1;
        Ok(match msg {
            Imm::Data { len } => {
                let offset = self.recv_tail;
                self.recv_tail = advance(self.recv_tail, len, self.p.ring_len);
                self.unconsumed += len;
                self.stats.bytes_received += u64::from(len);
                if self.may_grow() {
                    // At least half full (unread, or read and not yet
                    // returned): byte credit is what holds the writer back.
                    let filled = u64::from(self.ring_free()) * 2 <= u64::from(self.p.ring_len);
                    if let Growth::Watching { nearly_full, .. } = &mut self.growth {
                        *nearly_full |= filled;
                    }
                }
                RecvEvent::Data {
                    ring: self.ring_gen,
                    offset,
                    len,
                }
            }
            Imm::Credit { wrs, bytes } => {
                self.peer_wr_credit += wrs;
                self.peer_bytes_credit += bytes;
                self.stats.control_received += 1;
                RecvEvent::Credit { wrs, bytes }
            }
            Imm::Fin => {
                self.fin_received = true;
                self.stats.control_received += 1;
                RecvEvent::Fin
            }
            Imm::Abort { code } => {
                self.peer_abort = Some(code);
                self.stats.control_received += 1;
                RecvEvent::Abort { code }
            }
            Imm::Grant { index, bits } => {
                self.stats.control_received += 1;
                self.grant_rx.1[usize::from(index)] = bits;
                if index + 1 < GRANT_CHUNKS {
                    self.grant_rx.0 = index + 1;
                    return Ok(RecvEvent::GrantChunk { index });
                }
                let (addr, rkey) = grant_descriptor(self.grant_rx.1);
                self.grant_rx = (0, [0; 4]);
                // Checked above: at most 2^30.
                let len = self.p.peer_ring_len * 2;
                self.p.peer_ring_len = len;
                self.peer_ring_gen += 1;
                self.remote_pos = 0;
                self.peer_bytes_credit = len;
                // A side that sent its FIN writes no more; nor does an
                // aborted one.
                self.switch_pending = !self.fin_sent && self.local_abort.is_none();
                self.stats.peer_rings_grown += 1;
                RecvEvent::Grant { addr, rkey, len }
            }
            Imm::Switch => {
                self.stats.control_received += 1;
                if self.unconsumed > 0 {
                    self.old_ring = Some(OldRing {
                        generation: self.ring_gen,
                        len: self.p.ring_len,
                        read_pos: self.read_pos,
                        unconsumed: self.unconsumed,
                    });
                }
                self.ring_gen += 1;
                // ring_wanted offered exactly the double.
                self.p.ring_len *= 2;
                self.credit_bytes_threshold = credit_bytes_threshold(self.p.ring_len);
                self.recv_tail = 0;
                self.read_pos = 0;
                self.unconsumed = 0;
                self.abandoned = 0;
                self.growth = Growth::FRESH;
                self.stats.rings_grown += 1;
                RecvEvent::Switch
            }
        })
    }

    /// Whether the local ring may still double within `max_ring_len`
    /// (fill cycles are counted only then).
    fn may_grow(&self) -> bool {
        self.p.ring_len <= self.p.max_ring_len / 2
    }

    /// Whether the peer's offer, completed by last chunk `bits`, names a
    /// ring (twice the current peer ring) that would end past 2^64.
    fn offered_range_overflows(&self, bits: u32) -> bool {
        let mut chunks = self.grant_rx.1;
        chunks[usize::from(GRANT_CHUNKS - 1)] = bits;
        let (addr, _) = grant_descriptor(chunks);
        addr.checked_add(2 * u64::from(self.p.peer_ring_len))
            .is_none()
    }

    /// Ring bytes of the current local ring the peer may still write:
    /// neither unread nor consumed-and-unreturned.
    fn ring_free(&self) -> u32 {
        self.p.ring_len - self.unconsumed - self.bytes_to_return - self.abandoned
    }

    // ----- ring growth -----------------------------------------------------

    /// Length in bytes of the receive ring the runtime should register and
    /// offer now ([`offer_ring`](StreamCore::offer_ring)), or `None`.
    ///
    /// Some after [`GROW_AFTER_FILLS`] fill cycles of the current ring,
    /// while twice its length is at most `max_ring_len`, no earlier offer
    /// is outstanding or still being read out, the peer has not half-closed
    /// and the connection is healthy. The answer is always twice the
    /// current ring (the peer derives the length from that: an offer
    /// carries only address and key).
    pub fn ring_wanted(&self) -> Option<u32> {
        let Growth::Watching { fills, .. } = self.growth else {
            return None;
        };
        if fills < GROW_AFTER_FILLS
            || !self.may_grow()
            || self.fin_received
            || self.old_ring.is_some()
            || self.is_aborted()
            || self.lost
        {
            return None;
        }
        // ring_len <= 2^30: the double fits, and may_grow bounds it.
        Some(self.p.ring_len * 2)
    }

    /// Offers the peer a new receive ring of
    /// [`ring_wanted`](StreamCore::ring_wanted) bytes at `addr`, opened with
    /// `rkey`: four GRANT chunks go out with the next
    /// [`poll_transmit`](StreamCore::poll_transmit) calls (using WR credit
    /// as DATA does). The ring must stay registered and open to the peer
    /// from now until [`oldest_ring`](StreamCore::oldest_ring) passes its
    /// generation (`ring_generation() + 1`) or the connection ends.
    ///
    /// Returns false, and does nothing, when `ring_wanted()` is `None`.
    pub fn offer_ring(&mut self, addr: u64, rkey: u32) -> bool {
        if self.ring_wanted().is_none() {
            return false;
        }
        self.growth = Growth::Offering {
            chunks: grant_chunks(addr, rkey),
            next: 0,
        };
        true
    }

    /// Generation of the local ring DATA arrives in now: 0 for the
    /// handshake's ring, one more per [`RecvEvent::Switch`]. A ring offered
    /// and not yet switched to is generation `ring_generation() + 1`.
    pub fn ring_generation(&self) -> u32 {
        self.ring_gen
    }

    /// The oldest local ring generation still in use (holding unread bytes,
    /// or receiving DATA): rings of older generations are no longer
    /// written by the peer nor read, and the runtime may free them.
    pub fn oldest_ring(&self) -> u32 {
        self.old_ring.map_or(self.ring_gen, |old| old.generation)
    }

    #[cfg(test)]
    /// Where the oldest received, unconsumed bytes lie, in arrival order:
    /// in the local ring of generation
    /// [`readable_generation`](StreamCore::readable_generation),
    /// `ranges[0]` then `ranges[1]` (empty unless they wrap), offsets in
    /// bytes. Their total is [`readable_len`](StreamCore::readable_len)
    /// unless a previous ring is still being read out (then it is that
    /// ring's share, read first).
    pub fn readable(&self) -> [Range<usize>; 2] {
        match self.old_ring {
            Some(old) => ranges(old.read_pos, old.unconsumed, old.len),
            None => ranges(self.read_pos, self.unconsumed, self.p.ring_len),
        }
    }

    #[cfg(test)]
    /// Generation of the ring [`readable`](StreamCore::readable) describes:
    /// the oldest ring in use ([`oldest_ring`](StreamCore::oldest_ring)),
    /// since the oldest ring is read first.
    pub fn readable_generation(&self) -> u32 {
        self.oldest_ring()
    }

    /// Bytes received and not yet consumed, in every ring.
    pub fn readable_len(&self) -> usize {
        (self.unconsumed + self.old_ring.map_or(0, |old| old.unconsumed)) as usize
    }

    /// The reader copied the next `n` bytes (in arrival order, starting at
    /// [`readable`](StreamCore::readable)`[0].start`) out of the ring. Frees
    /// that ring space and counts it as byte credit to return.
    ///
    /// `n` must not exceed [`readable_len`](StreamCore::readable_len); a
    /// larger `n` is cut down to it (debug builds assert).
    ///
    /// Bytes of a previous ring are read first and are never returned (the
    /// peer's credit started anew with the new ring); so are bytes of the
    /// current ring once a ring offer went out whole.
    pub fn consume(&mut self, n: usize) {
        debug_assert!(
            n <= self.readable_len(),
            "consume({n}) with {} readable",
            self.readable_len()
        );
        // readable_len() <= 2 * 2^30 - 1 when a previous ring is read out.
        let mut n = n.min(self.readable_len()) as u64;
        if let Some(old) = &mut self.old_ring {
            let k = n.min(u64::from(old.unconsumed)) as u32;
            old.read_pos = advance(old.read_pos, k, old.len);
            old.unconsumed -= k;
            n -= u64::from(k);
            if old.unconsumed == 0 {
                self.old_ring = None;
            }
        }
        // What is left is at most the current ring's unread bytes.
        let n = n as u32;
        self.read_pos = advance(self.read_pos, n, self.p.ring_len);
        self.unconsumed -= n;
        if self.growth == Growth::Offered {
            self.abandoned += n;
        } else {
            self.bytes_to_return += n;
        }
        if let Growth::Watching { fills, nearly_full } = &mut self.growth {
            // The reader drained it to a quarter or less: it keeps up.
            let drained = u64::from(self.unconsumed) * 4 <= u64::from(self.p.ring_len);
            if *nearly_full && drained && self.old_ring.is_none() {
                *fills = fills.saturating_add(1);
                *nearly_full = false;
            }
        }
    }

    /// True once the peer's FIN arrived and every byte before it has been
    /// consumed: a read now returns end-of-file.
    pub fn readable_eof(&self) -> bool {
        self.fin_received && self.readable_len() == 0
    }

    /// True once the peer's FIN arrived (there may still be unconsumed bytes).
    pub fn fin_received(&self) -> bool {
        self.fin_received
    }

    /// True after [`abort`](StreamCore::abort), a protocol error from the
    /// peer, or the peer's ABORT.
    pub fn is_aborted(&self) -> bool {
        self.local_abort.is_some() || self.peer_abort.is_some()
    }

    #[cfg(test)]
    /// The code of the peer's ABORT, if one arrived.
    pub fn peer_abort_code(&self) -> Option<u32> {
        self.peer_abort
    }

    #[cfg(test)]
    /// The code of this side's abort, if [`abort`](StreamCore::abort) was
    /// called or a protocol error aborted the connection.
    pub fn local_abort_code(&self) -> Option<u32> {
        self.local_abort.map(|abort| abort.code)
    }

    /// The stream's counters.
    pub fn stats(&self) -> StreamStats {
        self.stats
    }

    /// The local ring's generation, its unread bytes and the bytes consumed
    /// and never to be returned (for the tests' conservation checks).
    #[cfg(test)]
    pub(crate) fn growth_view(&self) -> (u32, u32, u32) {
        (self.ring_gen, self.unconsumed, self.abandoned)
    }

    /// Receive WRs and ring bytes consumed here and not yet returned to the
    /// peer (for the tests' conservation checks).
    #[cfg(test)]
    pub(crate) fn to_return(&self) -> (u16, u32) {
        (self.wrs_to_return, self.bytes_to_return)
    }

    /// Forgets the stall counters and flags, which depend on how often
    /// `poll_transmit` was called, so that the tests' exhaustive search sees
    /// states that differ only there as one.
    #[cfg(test)]
    pub(crate) fn forget_stalls(&mut self) {
        self.stats.credit_stalls = 0;
        self.stats.send_queue_stalls = 0;
        self.credit_stalled = false;
        self.sq_stalled = false;
    }
}

/// `pos + len` within a ring of `ring` bytes; `pos < ring`, `len <= ring`.
fn advance(pos: u32, len: u32, ring: u32) -> u32 {
    // pos + len <= 2^31: no overflow.
    let next = pos + len;
    if next >= ring { next - ring } else { next }
}
