//! Zero-copy messages over RC queue pairs: [`MessageEndpoint`] and
//! [`MessageListener`].
//!
//! Payloads travel between registered buffers only. A message of at most
//! `eager_max` bytes (the smaller of the two sides' [`MessageConfig::eager_buf_len`])
//! is one SEND WITH IMMEDIATE from the sender's buffer (inline under the
//! inline threshold) into a pool buffer the receiver pre-posted; a larger one
//! goes by rendezvous: the sender announces its buffer (address, length,
//! rkey) and the receiver RDMA READs it straight into a destination it
//! allocated from its [`MemoryPool`], so a message is limited only by memory.
//! [`MessageEndpoint::recv`] hands out that very buffer as a [`PoolBytes`]
//! (derefs to `[u8]`, converts into [`bytes::Bytes`] without copying).
//! The wire protocol (src/proto/message.rs) documents the credits and the
//! argument for why they cannot deadlock.
//!
//! A receiver READs the rendezvous it was announced as destinations allow
//! (its [`MessageConfig::pool_quota`]). An endpoint that also sends (in the
//! last 5-10 ms, or within its last 16 messages taken) holds READs back
//! while a complete message waits to be taken: the READs of rendezvous
//! announced since then wait until the application takes it (`recv`), or
//! for the connection driver's next tick (5 ms) when it does not
//! ([`MessageStats::reads_held`] counts these holds), and it posts one
//! message's READs per doorbell. On rxe a READ between two ends of one
//! device runs inside its post, so reading every announced rendezvous
//! before handing out the first held an echo's answers back by all of
//! their transfers (benches/history/echo-2026-12-05.md, "A message delivered before more is
//! read"); on a NIC a READ completes after its post returns, so the READs
//! of rendezvous announced together still go in one drain.
//!
//! # Remote memory on the same connection
//!
//! The endpoint also carries the one-sided operations of
//! [`crate::remote`] (grants, READ, WRITE, atomics, batches of up to
//! [`MAX_TRANSFER_BATCH`] with one doorbell), on send-queue slots of
//! their own (32), so they never wait for message credit. One of them
//! is part of the message stream:
//! [`write_notify`](MessageEndpoint::write_notify) is an RDMA WRITE WITH
//! IMMEDIATE into a grant that the peer takes as an
//! [`Incoming::Notification`] in send order with the messages
//! ([`MessageEndpoint::recv_incoming`]); it uses a receive buffer and
//! credit like a message (the protocol's NOTIFY).
//!
//! # iWARP
//!
//! On a device without immediate data and memory windows (iWARP; Soft-iWARP
//! in the test bed) the same protocol runs with three changes. Each message
//! is a plain SEND whose last 4 bytes carry its immediate (a second SGE
//! from registered scratch, or inline), so `eager_max` is 4 bytes less.
//! The QP is on a protection domain of its own, and so is the endpoint's
//! pool ([`MessageEndpoint::pool`]: a pool of the connection's own with
//! the configured pool's settings); an eager message in other memory is
//! copied into it once, and a rendezvous source is reached wherever it
//! lies. Every key the peer learns is a memory region over exactly the
//! bytes it may touch, with exactly that access, on that PD: a rendezvous
//! source (remote read) from its RTS until the DONE, an RDMA READ's sink
//! (remote write: iWARP's READ response is a tagged write, RFC 5040
//! section 4.4) until the READs completed, a grant until it is revoked.
//! And since Soft-iWARP completes a SEND before an earlier READ whose
//! response is still coming, READs are always signaled there and a
//! completion that overtook an earlier READ's is held back until that READ
//! completed, so the core sees completions in post order. (A fence,
//! `IBV_SEND_FENCE`, deadlocked two ends reading each other on siw: its
//! fenced WQE holds the transmit slot the peer's READ responses need.)
//! MPA's initiator sends the first frame: the connecting endpoint sends a
//! CREDIT at once (`MessageCore::speak_first`) and the accepting one posts
//! nothing before its first receive. A completion there only means the WR
//! was handed to TCP, so a closing endpoint waits for a zero-length RDMA
//! READ before it disconnects.
//!
//! # Ports
//!
//! A message listener has a port of its own, like a second `TcpListener`:
//! the handshake carries the endpoint kind, and a stream client that reaches
//! a message listener (or the reverse) is rejected with
//! [`RejectReason::WrongKind`](crate::error::RejectReason::WrongKind),
//! so a mix-up is a clear error rather than garbage. Sharing one port would
//! need one listener to hand out two kinds of connection, which neither
//! `TcpListener`-style API can express.
//!
//! # Closing
//!
//! Dropping every handle (or [`MessageEndpoint::close`] on the last one)
//! waits (up to [`RdmaConfig::linger`](crate::RdmaConfig::linger)) until
//! every message sent was taken by the peer's NIC (an eager SEND
//! acknowledged, a rendezvous READ by the peer), sends a CLOSE and
//! disconnects once the peer's QP received it. The peer's `recv` then
//! returns what arrived and `None` (end of stream), and its `send` fails
//! with `BrokenPipe` ([`Error::PeerClosed`]), as a write after a TCP peer's
//! close would. Because the peer learns of the close from the CLOSE, before
//! the disconnect, its own control traffic still in flight (a credit
//! return into the closed QP) is not mistaken for a lost connection. A peer
//! that vanishes without CLOSE in the middle of a rendezvous is an error,
//! not an end.

mod conn;
#[allow(unsafe_code)]
mod qp;
mod quota;

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use futures::{Sink, Stream};
use tokio::net::ToSocketAddrs;

use crate::config::RdmaConfig;
use crate::conn::{Established, Handle, Listener, Setup, device_caps};
use crate::error::{Error, Result};
use crate::pool::{MemoryPool, OutgoingMessage, PoolBuf, PoolBytes, PoolConfig};
use crate::proto::handshake::{EndpointKind, Hello};
use crate::proto::message::{
    MAX_IMM_VALUE, MAX_MESSAGE_LEN, MAX_NOTIFY_LEN, MessageCore, MessageError, MessageParams,
    NotifyWrite, RTS_HEADER_LEN, TRAILER_LEN, initial_recv_posted,
};
use crate::remote::{
    Grant, GrantAccess, LocalRegion, LocalSge, MAX_TRANSFER_BATCH, Notification, RemoteRegion,
    Transfer,
};
use crate::verbs::cm::CmId;
use crate::verbs::rc::{OpenDevice, RcQueuePair, RcSizes};

pub use crate::proto::message::MessageStats;
pub(crate) use conn::MsgState;
#[cfg(tokio_rdma_guest)]
#[doc(hidden)]
pub use qp::PostedSge;
use qp::{Local, MessageQp, REMOTE_SLOTS, RemoteWr};

// A batch takes every remote slot at most.
const _: () = assert!(MAX_TRANSFER_BATCH == REMOTE_SLOTS as usize);

/// The length of a one-sided WR moving `len` bytes: at most
/// [`MAX_NOTIFY_LEN`] (2 GiB, the largest RC message; IBTA `max_msg_sz`).
///
/// # Errors
/// `InvalidInput` naming `op` above it.
fn wr_len(op: &str, len: usize) -> io::Result<u32> {
    u32::try_from(len)
        .ok()
        .filter(|&l| u64::from(l) <= MAX_NOTIFY_LEN)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{op} of more than 2 GiB"),
            )
        })
}

/// The name of a one-sided READ (`read`) or WRITE, for errors.
fn rw_name(read: bool) -> &'static str {
    if read { "RDMA READ" } else { "RDMA WRITE" }
}

/// The WR of an RDMA READ (`read`) or WRITE of `len` bytes at `offset` of
/// `remote`, checked against the grant (range, READ or WRITE access) and
/// the 2 GiB bound.
///
/// # Errors
/// `InvalidInput` (nothing posted) from either check.
fn remote_rw(read: bool, remote: &RemoteRegion, offset: u64, len: usize) -> io::Result<RemoteWr> {
    let op = rw_name(read);
    let want = if read {
        GrantAccess::READ
    } else {
        GrantAccess::WRITE
    };
    let addr = remote.check(op, offset, len as u64, want)?;
    let len = wr_len(op, len)?;
    let rkey = remote.rkey();
    Ok(if read {
        RemoteWr::Read { addr, rkey, len }
    } else {
        RemoteWr::Write { addr, rkey, len }
    })
}

/// What [`MessageEndpoint::recv_incoming`] hands out, in the peer's send
/// order.
#[derive(Debug, Clone)]
pub enum Incoming {
    /// A message, as [`MessageEndpoint::recv`] returns it.
    Message(PoolBytes),
    /// The peer wrote into memory this side granted
    /// ([`MessageEndpoint::write_notify`]).
    Notification(Notification),
}

/// Settings of a message endpoint. `Default` gives the values documented
/// on each setter.
#[derive(Debug, Clone)]
pub struct MessageConfig {
    pub(crate) rdma: RdmaConfig,
    pub(crate) eager_buf_len: u32,
    pub(crate) max_message_len: u64,
    pub(crate) max_read_len: u32,
    pub(crate) max_rendezvous_in_flight: u16,
    pub(crate) send_queue_limit: usize,
    pub(crate) send_queue_bytes: u64,
    pub(crate) pool: Option<MemoryPool>,
    pub(crate) pool_quota: Option<u64>,
    pub(crate) max_sge: u16,
}

/// Scatter-gather entries per one-sided WR a message endpoint asks for by
/// default ([`MessageConfig::max_sge`]): 4, whose 64 bytes of SGEs fit in
/// the send WQE's room for the default 64-byte inline data on rxe and
/// mlx5 alike (a WQE is sized for the larger of the two), so the default
/// costs no memory.
pub const DEFAULT_MAX_SGE: u16 = 4;

/// The most scatter-gather entries [`MessageConfig::max_sge`] accepts (a
/// device grants at most its `max_sge`: 32 on Soft-RoCE, 6 on
/// Soft-iWARP, 30 on ConnectX-5).
pub const MAX_SGE: u16 = 64;

impl Default for MessageConfig {
    fn default() -> Self {
        MessageConfig {
            rdma: RdmaConfig::default(),
            eager_buf_len: 4096,
            max_message_len: 128 << 20,
            max_read_len: 64 * 1024,
            max_rendezvous_in_flight: 8,
            send_queue_limit: 256,
            send_queue_bytes: 4 << 20,
            pool: None,
            pool_quota: None,
            max_sge: DEFAULT_MAX_SGE,
        }
    }
}

impl MessageConfig {
    /// A config with the default values.
    pub fn new() -> Self {
        Self::default()
    }

    /// Connection settings shared with streams: timeouts, device, backlog,
    /// linger, `send_queue_depth` (send WRs), `recv_queue_depth` (the most
    /// receive buffers kept posted, 4..=1023: 15 at first, doubled each
    /// time the peer is about to run out of credit), `inline_threshold`
    /// (eager messages of
    /// at most this many bytes are copied into the WQE) and
    /// `signal_interval`. The ring and send-buffer sizes are not used.
    pub fn connection(mut self, rdma: RdmaConfig) -> Self {
        self.rdma = rdma;
        self
    }

    /// Bytes of each pre-posted receive buffer (default 4096). Messages up
    /// to the smaller of both sides' value go eagerly; larger ones by
    /// rendezvous. At least 20 (an RTS header) and at most the pool's
    /// largest class. Receive memory per connection is `eager_buf_len`
    /// times the buffers posted: 15 at first (60 KiB by default, what an
    /// idle endpoint keeps), up to `recv_queue_depth` (128, 512 KiB) while
    /// the peer sends faster than credit comes back (see
    /// `MessageStats::recv_buffers_posted`). A busy endpoint keeps what it
    /// grew to until it closes.
    pub fn eager_buf_len(mut self, bytes: u32) -> Self {
        self.eager_buf_len = bytes;
        self
    }

    /// Largest message sent or accepted, bytes (default 128 MiB, at most
    /// 2^48). A larger send fails with `InvalidInput`; a peer announcing a
    /// larger one is a protocol error (the endpoint aborts). The default is
    /// half the default pool's bound (256 MiB), so a message of this size
    /// always fits beside the receive buffers; for larger messages give
    /// both sides a [`pool`](Self::pool) whose `max_registered_bytes` holds
    /// them (a destination that can never fit waits, under the Wait policy,
    /// like any allocation from an exhausted pool).
    pub fn max_message_len(mut self, bytes: u64) -> Self {
        self.max_message_len = bytes;
        self
    }

    /// Largest RDMA READ of a rendezvous, bytes (default 64 KiB, at most
    /// 2^31); larger messages are read in chunks of this size. A lost
    /// packet of a READ response makes the reader re-request the rest of
    /// that READ after the ACK timeout, so on a wire that drops packets
    /// smaller READs recover for less: across two hosts with 1 % loss, one
    /// way 1 MiB messages moved 6.73 MB/s with 64 KiB READs, 1.84 with
    /// 256 KiB and 1.15 with 1 MiB; on the clean wire 25.1 vs 25.7 MB/s
    /// (benches/history/two-hosts.md, "Rendezvous READ size across the wire").
    pub fn max_read_len(mut self, bytes: u32) -> Self {
        self.max_read_len = bytes;
        self
    }

    /// Rendezvous outstanding per direction (default 8).
    pub fn max_rendezvous_in_flight(mut self, n: u16) -> Self {
        self.max_rendezvous_in_flight = n;
        self
    }

    /// Messages queued behind credit before `send` waits (default 256; at
    /// least 1).
    pub fn send_queue_limit(mut self, messages: usize) -> Self {
        self.send_queue_limit = messages;
        self
    }

    /// Bytes of messages queued behind credit or a rendezvous slot before
    /// `send` (and the `Sink`'s `poll_ready`) waits, like a socket's send
    /// buffer (default 4 MiB, Linux's largest `tcp_wmem`; at least 1). A
    /// message is queued whenever the queue holds less, so one larger than
    /// this still goes. The [`send_queue_limit`](Self::send_queue_limit)
    /// in messages applies as well. Rendezvous in flight
    /// ([`max_rendezvous_in_flight`](Self::max_rendezvous_in_flight)) are
    /// not queued: they already keep the wire busy, and a deeper queue
    /// only holds more of the application's buffers. With only the 256
    /// messages bound, a sender of 1 MiB messages that fills a fresh
    /// buffer per message grew its pool by a slab per message (page
    /// faults, zeroing, registration) and sent one way on the
    /// current_thread runtime at 0.72-0.77x the rate it reaches with this
    /// bound (benches/history/echo-2026-12-06.md, "A send queue bounded in bytes").
    pub fn send_queue_bytes(mut self, bytes: u64) -> Self {
        self.send_queue_bytes = bytes;
        self
    }

    /// The pool receive buffers and rendezvous destinations come from
    /// (default: one pool per device with [`PoolConfig::default`], shared by
    /// every endpoint on it: [`MessageEndpoint::pool`] returns it). Must be
    /// on the device the connection runs on. On a device without memory
    /// windows (iWARP) each connection gets a pool of its own on its own
    /// protection domain, with this pool's settings (see the
    /// [module docs](self), "iWARP").
    pub fn pool(mut self, pool: MemoryPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Most bytes of the shared pool one endpoint may hold for incoming
    /// messages: rendezvous destinations being read plus received messages
    /// the application has not taken (default: an eighth of the pool's
    /// `max_registered_bytes`, 32 MiB for the default 256 MiB pool). At the
    /// quota, this endpoint's further RDMA READs wait (back pressure on
    /// that peer only: its rendezvous stay outstanding) until the
    /// application takes messages; they do not fail and other endpoints on
    /// the pool are not held up. A single message larger than the quota is
    /// still admitted when the endpoint holds nothing. Eager receive
    /// buffers are bounded separately (at most `recv_queue_depth *
    /// eager_buf_len`).
    /// The idea comes from brpc's shared block pool, where one peer could
    /// fill the pool for every connection (brpc issue 3431).
    pub fn pool_quota(mut self, bytes: u64) -> Self {
        self.pool_quota = Some(bytes);
        self
    }

    /// Scatter-gather entries one one-sided WR may carry (default
    /// [`DEFAULT_MAX_SGE`], 4; 1..=[`MAX_SGE`]): the longest list of a
    /// [`Transfer::ReadScatter`] or [`Transfer::WriteGather`]. The QP is
    /// created with this many send SGEs, at most the device's `max_sge`
    /// (`ibv_devinfo -v`); an RDMA READ takes at most the device's
    /// `max_sge_rd` as well (1 on Soft-iWARP).
    /// [`MessageEndpoint::max_sge`] and [`MessageEndpoint::max_read_sge`]
    /// give what the connection got. Each entry costs 16 bytes of every
    /// send WQE beyond the inline data's room.
    pub fn max_sge(mut self, entries: u16) -> Self {
        self.max_sge = entries;
        self
    }

    /// The quota in bytes for an endpoint on `pool`.
    pub(crate) fn quota_for(&self, pool: &MemoryPool) -> u64 {
        self.pool_quota
            .unwrap_or_else(|| pool.config().max_bytes() / 8)
            .max(1)
    }

    fn params(
        &self,
        peer_eager_buf_len: u32,
        peer_recv_depth: u16,
        max_inline: u32,
    ) -> MessageParams {
        MessageParams {
            recv_depth: self.rdma.recv_queue_depth,
            peer_recv_depth,
            recv_initial: initial_recv_posted(self.rdma.recv_queue_depth),
            peer_recv_initial: initial_recv_posted(peer_recv_depth),
            eager_buf_len: self.eager_buf_len,
            peer_eager_buf_len,
            eager_max: self.eager_buf_len.min(peer_eager_buf_len),
            inline_threshold: self.rdma.inline_threshold.min(max_inline),
            send_queue_depth: self.rdma.send_queue_depth,
            max_read_len: self.max_read_len,
            max_message_len: self.max_message_len,
            max_rendezvous_in_flight: self.max_rendezvous_in_flight,
            signal_interval: self.rdma.signal_interval,
        }
    }

    /// Checks every value (as if the peer used the same ones).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first value out of range.
    pub fn validate(&self) -> Result<(), Error> {
        self.rdma.validate()?;
        if self.eager_buf_len < RTS_HEADER_LEN as u32 {
            return Err(Error::InvalidConfig {
                field: "eager_buf_len",
                value: self.eager_buf_len.into(),
                allowed: "20..=the pool's largest class, bytes",
            });
        }
        if self.max_message_len > MAX_MESSAGE_LEN {
            return Err(Error::InvalidConfig {
                field: "max_message_len",
                value: self.max_message_len,
                allowed: "1..=2^48 bytes",
            });
        }
        if self.send_queue_limit == 0 {
            return Err(Error::InvalidConfig {
                field: "send_queue_limit",
                value: 0,
                allowed: "at least 1 message",
            });
        }
        if self.max_sge == 0 || self.max_sge > MAX_SGE {
            return Err(Error::InvalidConfig {
                field: "max_sge",
                value: self.max_sge.into(),
                allowed: "1..=64 scatter-gather entries",
            });
        }
        if self.send_queue_bytes == 0 {
            return Err(Error::InvalidConfig {
                field: "send_queue_bytes",
                value: 0,
                allowed: "at least 1 byte",
            });
        }
        let p = self.params(
            self.eager_buf_len,
            self.rdma.recv_queue_depth,
            self.rdma.inline_threshold,
        );
        match MessageCore::new(p) {
            Ok(_) => Ok(()),
            Err(MessageError::InvalidParams {
                name,
                value,
                allowed,
            }) => Err(Error::InvalidConfig {
                field: name,
                value,
                allowed,
            }),
            Err(e) => Err(Error::Message(e)),
        }
    }
}

/// The default pool of each device (see [`MessageConfig::pool`]).
fn device_pool(device: &Arc<OpenDevice>) -> Result<MemoryPool> {
    static POOLS: crate::verbs::watch::DeviceCache<MemoryPool> = OnceLock::new();
    Ok(crate::verbs::watch::cached(&POOLS, device, || {
        MemoryPool::for_open_device(Arc::clone(device), PoolConfig::default())
    })?)
}

/// The message endpoint's [`Setup`] for the shared handshake.
#[derive(Clone)]
struct MessageSetup(MessageConfig);

/// The QP (owning its posted receive buffers) and the pool they came from.
struct PreparedQp {
    qp: MessageQp,
    pool: MemoryPool,
    /// Receive buffers to post once the QP is in INIT.
    recv: Vec<PoolBuf>,
}

impl AsMut<RcQueuePair> for PreparedQp {
    fn as_mut(&mut self) -> &mut RcQueuePair {
        self.qp.as_mut()
    }
}

impl Setup for MessageSetup {
    type Out = (Handle<MsgState>, MemoryPool);
    type Qp = PreparedQp;
    const KIND: EndpointKind = EndpointKind::Message;

    fn rdma(&self) -> &RdmaConfig {
        &self.0.rdma
    }

    fn sizes(&self) -> RcSizes {
        let r = &self.0.rdma;
        RcSizes {
            // Beyond the core's WRs: a window bind per rendezvous announced
            // and an invalidation per rendezvous done, neither counted by
            // the core (unsignaled binds retire with the next signaled WR);
            // remote-memory operations, grant binds and revocations
            // (REMOTE_SLOTS at once; more wait, or queue).
            send_depth: u32::from(r.send_queue_depth)
                + 2 * u32::from(self.0.max_rendezvous_in_flight)
                + 4
                + u32::from(REMOTE_SLOTS),
            recv_depth: r.recv_queue_depth.into(),
            max_inline: r.inline_threshold,
            // Without windows, a rendezvous source, a READ's sink and a
            // grant are opened by keys of memory regions registered on
            // this PD, which reach nothing from another connection's QP.
            own_pd_without_windows: true,
            share_cq: r.share_completion_queue,
            imm_in_send_without_immediate: false,
            trailer_without_immediate: true,
            max_send_sge: u32::from(self.0.max_sge),
        }
    }

    fn read_depth(&self) -> u8 {
        CmId::READ_DEPTH_MAX
    }

    async fn prepare(&self, device: &Arc<OpenDevice>, qp: RcQueuePair) -> Result<PreparedQp> {
        let pool = if qp.has_own_pd() {
            // A device without memory windows: the QP is on a PD of its
            // own, and so is the memory its SGEs name. The connection
            // gets a pool of its own on that PD (with the configured
            // pool's sizes); a message in other memory is copied into it
            // when sent ([`MessageEndpoint::send`]).
            let config = match &self.0.pool {
                Some(p) => p.config().clone(),
                None => PoolConfig::default(),
            };
            MemoryPool::for_connection_pd(Arc::clone(device), Arc::clone(qp.pd()), config)?
        } else {
            match &self.0.pool {
                Some(p) => {
                    if !p.is_on_device(device) {
                        return Err(Error::InvalidConfig {
                            field: "pool",
                            value: 0,
                            allowed: "a MemoryPool on the connection's device",
                        });
                    }
                    p.clone()
                }
                None => device_pool(device)?,
            }
        };
        let len = self.0.eager_buf_len as usize;
        if pool.class_size(len).is_err() {
            return Err(Error::InvalidConfig {
                field: "eager_buf_len",
                value: len as u64,
                allowed: "20..=the pool's largest class, bytes",
            });
        }
        // The first receive buffers; the rest of `recv_queue_depth` is
        // posted while the peer's traffic needs it (`wants_more_recv`).
        let initial = initial_recv_posted(self.0.rdma.recv_queue_depth);
        let mut recv = Vec::with_capacity(initial.into());
        for _ in 0..initial {
            recv.push(pool.alloc(len).await?);
        }
        Ok(PreparedQp {
            // RTS headers (20 bytes) go inline unless inline_threshold is
            // below that; only then do they need registered scratch (32
            // bytes per send-queue slot). The QP is created with this
            // inline size (creation fails on a device that cannot), so
            // an inline RTS always fits.
            qp: MessageQp::new(
                qp,
                self.0.rdma.send_queue_depth,
                self.0.rdma.inline_threshold >= RTS_HEADER_LEN as u32,
            )?,
            pool,
            recv,
        })
    }

    fn on_init(&self, qp: &mut PreparedQp) -> Result<Hello> {
        let bufs = std::mem::take(&mut qp.recv);
        // Tokens from 1 (at most recv_queue_depth of them); the runtime
        // counts on from recv_queue_depth + 1.
        qp.qp
            .post_recvs(bufs.into_iter().zip(1u64..).map(|(b, t)| (t, b)).collect())?;
        Ok(Hello {
            kind: EndpointKind::Message,
            ring_addr: 0,
            ring_rkey: 0,
            ring_len: self.0.eager_buf_len,
            recv_depth: self.0.rdma.recv_queue_depth,
            max_message_len: self.0.max_message_len,
            max_rendezvous_in_flight: self.0.max_rendezvous_in_flight,
            caps: device_caps(qp.qp.qp_ref().device()),
            // Filled in by the handshake (`conn::setup`).
            path_mtu: 0,
        })
    }

    fn finish(&self, est: Established<PreparedQp>) -> Result<(Handle<MsgState>, MemoryPool)> {
        let trailer = est.qp.qp.trailer();
        let max_inline = est.qp.qp.qp_ref().max_inline();
        // Without immediate data an inline EAGER carries its 4-byte
        // trailer too.
        let max_inline = if trailer {
            max_inline.saturating_sub(TRAILER_LEN as u32)
        } else {
            max_inline
        };
        let mut params = self
            .0
            .params(est.peer.ring_len, est.peer.recv_depth, max_inline);
        if trailer {
            params = params.with_trailer();
        }
        // Limits that bind both sides: the smaller of the two, so neither
        // side sends what the other refuses.
        params.max_message_len = params.max_message_len.min(est.peer.max_message_len);
        params.max_rendezvous_in_flight = params
            .max_rendezvous_in_flight
            .min(est.peer.max_rendezvous_in_flight);
        let mut core = MessageCore::new(params)?;
        if est.qp.qp.qp_ref().speaks_first() {
            core.speak_first();
        }
        let pool = est.qp.pool.clone();
        Ok((conn::start(est, core, &self.0)?, pool))
    }
}

/// A connected zero-copy message endpoint (see the [module docs](self)).
///
/// Cheap to clone: clones share the connection, which closes when the last
/// one drops. [`send`](Self::send) and [`recv`](Self::recv) take `&self`, so
/// one task may send while another receives. Implements [`Stream`] of
/// received messages and [`Sink`] of [`OutgoingMessage`]s.
pub struct MessageEndpoint {
    conn: Handle<MsgState>,
    pool: MemoryPool,
    /// The QP is on a PD of its own (a device without memory windows).
    own_pd: bool,
}

impl std::fmt::Debug for MessageEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageEndpoint")
            .field("local_addr", &self.conn.local_addr)
            .field("peer_addr", &self.conn.peer_addr)
            .field("qp_num", &self.conn.qp_num)
            .finish()
    }
}

impl Clone for MessageEndpoint {
    fn clone(&self) -> Self {
        MessageEndpoint {
            conn: self.conn.another(),
            pool: self.pool.clone(),
            own_pd: self.own_pd,
        }
    }
}

impl MessageEndpoint {
    fn new(conn: Handle<MsgState>, pool: MemoryPool) -> MessageEndpoint {
        let own_pd = conn.own_pd();
        MessageEndpoint { conn, pool, own_pd }
    }

    /// Connects to a [`MessageListener`] at `addr` with the default
    /// [`MessageConfig`].
    ///
    /// # Errors
    /// As [`RdmaStream::connect`](crate::RdmaStream::connect); a stream
    /// listener at `addr` rejects the handshake (`ConnectionRefused`,
    /// [`Error::HandshakeRejected`] with `WrongKind`).
    pub async fn connect<A: ToSocketAddrs>(addr: A) -> io::Result<MessageEndpoint> {
        Self::connect_with(addr, &MessageConfig::default()).await
    }

    /// Connects with `config`. Errors as for [`connect`](Self::connect), and
    /// `InvalidInput` ([`Error::InvalidConfig`]) for a bad config.
    pub async fn connect_with<A: ToSocketAddrs>(
        addr: A,
        config: &MessageConfig,
    ) -> io::Result<MessageEndpoint> {
        crate::verbs::fork::check_io("MessageEndpoint::connect")?;
        config.validate()?;
        let (conn, pool) = crate::conn::connect_any(addr, &MessageSetup(config.clone())).await?;
        Ok(MessageEndpoint::new(conn, pool))
    }

    /// Queues `msg` for sending, without copying its payload: the NIC reads
    /// it from its registered memory (an eager SEND, or the peer's RDMA READ
    /// for a rendezvous). Waits while `send_queue_limit` messages or
    /// `send_queue_bytes` bytes are queued behind the peer's credit or the
    /// rendezvous in flight ([`MessageConfig::send_queue_bytes`]). The
    /// message's memory is released once the peer has it.
    ///
    /// Posted at once while fewer than 4 work requests are outstanding (a
    /// lone request waits for nothing); with more in flight it is posted
    /// later together with everything queued since (one doorbell for the
    /// batch: what a `Sink` does by hand): with the next completion in a
    /// short burst; in a sustained stream (sending through more than one
    /// 5 ms tick of the connection's driver, no task parked on the
    /// endpoint) with this endpoint's next post (32 queued) or wait
    /// (`recv`, `flush`, a `send` blocked on credit), or at the driver's
    /// next tick, so a stream's last messages wait at most 5 ms when
    /// nothing is called on the endpoint after them. Measured in guest
    /// runs, 64 B messages with `send()` each went from 0.38-0.49 to
    /// 0.61-0.68 of `ib_send_bw -s 64`'s message rate with the batching,
    /// and on the multi-thread runtime by 1.06-1.61x more with the
    /// sustained stream posting its own queue.
    ///
    /// # Errors
    /// `InvalidInput` for a message longer than `max_message_len`;
    /// `ConnectionReset` / `BrokenPipe` once the connection failed or the
    /// peer closed; `InvalidData` after a protocol violation.
    pub async fn send(&self, msg: impl Into<OutgoingMessage>) -> io::Result<()> {
        crate::verbs::fork::check_io("MessageEndpoint::send")?;
        let mut msg = msg.into();
        if self.needs_copy(&msg) {
            msg = self.copy_to_pool(&msg, self.pool.alloc_any(msg.len()).await?);
        }
        std::future::poll_fn(|cx| self.conn.poll_send_ready(cx)).await?;
        self.conn.start_send(msg, false)
    }

    /// A rendezvous needs a memory window, which read-only memory (a
    /// `register_static` region in `.rodata`) cannot take: such a message,
    /// when too large to go eagerly, is copied into a pool buffer once. On
    /// a device without windows the QP is on a PD of its own: an eager
    /// message not in this endpoint's own pool (on that PD) is copied
    /// into it, while a rendezvous source is reached through a
    /// registration of its own, wherever it lies.
    fn needs_copy(&self, msg: &OutgoingMessage) -> bool {
        if self.own_pd {
            return !msg.is_empty()
                && msg.len() <= self.conn.eager_max()
                && !self.pool.owns(msg.as_slice().as_ptr(), msg.len());
        }
        !msg.can_bind_windows() && msg.len() > self.conn.eager_max()
    }

    fn copy_to_pool(&self, msg: &OutgoingMessage, mut buf: PoolBuf) -> OutgoingMessage {
        let data = msg.as_slice();
        buf.spare_mut()[..data.len()].copy_from_slice(data);
        buf.set_len(data.len());
        OutgoingMessage::from(buf)
    }

    /// Copies `data` into a pool buffer and sends it (for callers whose data
    /// is not in registered memory; the copy is the only one).
    ///
    /// # Errors
    /// Those of [`send`](Self::send) and of [`MemoryPool::alloc_any`].
    pub async fn send_copy(&self, data: &[u8]) -> io::Result<()> {
        crate::verbs::fork::check_io("MessageEndpoint::send_copy")?;
        let mut buf = self.pool().alloc_any(data.len()).await?;
        buf.spare_mut()[..data.len()].copy_from_slice(data);
        buf.set_len(data.len());
        self.send(buf).await
    }

    /// Waits until every message sent so far is done: taken by the peer's
    /// NIC (an eager message acknowledged, a rendezvous read and confirmed).
    ///
    /// # Errors
    /// As for [`send`](Self::send).
    pub async fn flush(&self) -> io::Result<()> {
        crate::verbs::fork::check_io("MessageEndpoint::flush")?;
        std::future::poll_fn(|cx| self.conn.poll_flush(cx)).await
    }

    /// The next message, in send order: `Ok(None)` once the peer closed and
    /// every message was taken. The message lies in pool memory the NIC
    /// wrote (no copy); dropping it returns that memory to the pool.
    /// Cancel-safe.
    ///
    /// # Errors
    /// `ConnectionReset` when the peer vanished or aborted (messages not yet
    /// complete are lost, those complete before were delivered);
    /// `InvalidData` when the peer broke the protocol (for example announced
    /// a message above `max_message_len`).
    pub async fn recv(&self) -> io::Result<Option<PoolBytes>> {
        crate::verbs::fork::check_io("MessageEndpoint::recv")?;
        std::future::poll_fn(|cx| self.conn.poll_recv(cx)).await
    }

    /// The next message or [`Notification`], in send order: `Ok(None)`
    /// once the peer closed and everything was taken. For endpoints whose
    /// peer uses [`write_notify`](Self::write_notify); otherwise the same
    /// as [`recv`](Self::recv). Cancel-safe.
    ///
    /// # Errors
    /// As [`recv`](Self::recv).
    pub async fn recv_incoming(&self) -> io::Result<Option<Incoming>> {
        crate::verbs::fork::check_io("MessageEndpoint::recv_incoming")?;
        std::future::poll_fn(|cx| self.conn.poll_incoming(cx)).await
    }

    /// Closes this handle gracefully: waits until every message sent was
    /// taken by the peer ([`flush`](Self::flush)), drops the handle and, if
    /// it was the last one, waits until the endpoint has disconnected (the
    /// peer's `recv` then returns `None`). With other clones alive the
    /// connection stays open for them. Dropping instead of closing does the
    /// same in the background.
    ///
    /// Bounded: waits at most [`RdmaConfig::linger`] (default 60 s) for the
    /// peer to take what was sent; at that bound it aborts the endpoint (the
    /// peer sees `ConnectionReset`) and returns `TimedOut`
    /// ([`Error::LingerTimeout`]). A peer that stopped reading or is stopped
    /// (SIGSTOP) never makes `close` hang.
    ///
    /// # Errors
    /// Those of [`flush`](Self::flush), and `TimedOut` at the bound; the
    /// handle is dropped either way.
    pub async fn close(self) -> io::Result<()> {
        crate::verbs::fork::check_io("MessageEndpoint::close")?;
        let linger = self.conn.lock().linger();
        let flushed = match tokio::time::timeout(linger, self.flush()).await {
            Ok(r) => r,
            Err(_) => {
                self.conn.abort();
                Err(Error::LingerTimeout { timeout: linger }.into())
            }
        };
        let closed = self.conn.wait_closed();
        let last = self.conn.handles() == 1;
        drop(self);
        if last {
            // Everything was taken or the endpoint failed: the driver
            // disconnects at once; the bound is only a safety net.
            let _ = tokio::time::timeout(linger, closed).await;
        }
        flushed
    }

    /// Aborts the endpoint: queued and unfinished messages are dropped and
    /// the peer sees `ConnectionReset` ([`Error::PeerAborted`], code 0).
    pub fn abort(&self) {
        if crate::verbs::fork::inherited() {
            return; // the parent's (abort)
        }
        self.conn.abort();
    }

    /// The pool this endpoint's receive buffers come from; allocate send
    /// buffers from it so they are registered on the right device.
    pub fn pool(&self) -> &MemoryPool {
        &self.pool
    }

    /// The local address (IP and rdma_cm port).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.conn.local_addr)
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.conn.peer_addr)
    }

    /// The local queue pair number.
    pub fn qp_num(&self) -> u32 {
        self.conn.qp_num
    }

    /// The path MTU of the connection, bytes: 256, 512, 1024, 2048 or
    /// 4096, the RDMA payload of every packet but a message's last. Both
    /// sides use the same one, the smallest of their ports' active MTUs
    /// (on RoCE, the netdev MTU less the RoCE headers, rounded down to
    /// one of those sizes: 1500 gives 1024, 9000 gives 4096) and rdma_cm's
    /// path record. 0 on iWARP, whose TCP segments by its own MSS.
    pub fn path_mtu(&self) -> u32 {
        self.conn.path_mtu
    }

    /// Scatter-gather entries one [`Transfer::WriteGather`] may have:
    /// [`MessageConfig::max_sge`], at most the device's `max_sge`.
    pub fn max_sge(&self) -> usize {
        self.conn.max_sge(false)
    }

    /// Scatter-gather entries one [`Transfer::ReadScatter`] may have:
    /// [`max_sge`](Self::max_sge), at most the device's `max_sge_rd` (1
    /// on Soft-iWARP).
    pub fn max_read_sge(&self) -> usize {
        self.conn.max_sge(true)
    }

    /// The RDMA device, for example `rxe0`.
    pub fn device(&self) -> &str {
        &self.conn.device
    }

    /// A snapshot of the endpoint's counters (see
    /// [`MessageStats`]).
    pub fn stats(&self) -> MessageStats {
        self.conn.stats()
    }

    #[cfg(tokio_rdma_guest)]
    pub(crate) fn last_window(&self) -> Option<(u64, u64, u32)> {
        self.conn.last_window()
    }

    #[cfg(tokio_rdma_guest)]
    pub(crate) fn forge_rts(&self, len: u64, addr: u64, rkey: u32) -> io::Result<()> {
        self.conn.send_forged_rts(len, addr, rkey)
    }

    /// Grants the peer `access` to exactly the bytes `range` of `region`
    /// (a memory window of type 2 bound on this connection's QP), once the
    /// NIC confirmed the bind. Hand [`Grant::remote`] to the peer. The
    /// region is a buffer of this endpoint's pool ([`LocalRegion::new`]),
    /// or memory registered with this endpoint's pool or, on a device with
    /// memory windows, another pool on the same device
    /// ([`MemoryPool::register_local`]). The grant keeps
    /// the region until it is revoked. See [`crate::remote`] for what the
    /// peer can do with it.
    ///
    /// # Errors
    /// `InvalidInput` for an empty range or access, a range past the
    /// region's end, or a region this endpoint cannot use (see above);
    /// `OutOfMemory` ([`Error::ResourceLimit`]) at this connection's quota
    /// of 64 grants or the device's memory windows; `Unsupported`
    /// ([`Error::NoAtomics`]) for ATOMIC access on a device without RDMA
    /// atomics; `ConnectionReset` / `BrokenPipe` once the endpoint failed
    /// or closed.
    pub async fn grant(
        &self,
        region: &LocalRegion,
        range: std::ops::Range<usize>,
        access: GrantAccess,
    ) -> io::Result<Grant> {
        crate::verbs::fork::check_io("MessageEndpoint::grant")?;
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        if access.is_empty() {
            return Err(invalid("a grant needs some access".into()));
        }
        if range.start >= range.end || range.end > region.len() {
            return Err(invalid(format!(
                "grant range {range:?} is empty or passes the region's {} bytes",
                region.len()
            )));
        }
        self.check_usable("grant", region)?;
        let (offset, len) = (range.start as u64, (range.end - range.start) as u64);
        let (wr_id, rkey) = self.conn.start_grant(region, offset, len, access).await?;
        // The grant exists from the post on: revoked if this wait is
        // dropped or fails.
        let grant = Grant {
            conn: self.conn.downgrade(),
            id: wr_id,
            remote: RemoteRegion::new(region.addr() + offset, len, rkey, access),
            revoked: false,
        };
        self.conn
            .wait_remote(wr_id, "memory window bind (grant)")
            .await?;
        Ok(grant)
    }

    /// Grants bound on this connection now (its quota is 64).
    pub fn grants(&self) -> usize {
        self.conn.grants_held()
    }

    /// Reads `len` bytes at `offset` of `remote` (a grant of the peer's)
    /// with one RDMA READ into a new pool buffer.
    ///
    /// # Errors
    /// `InvalidInput` (nothing posted) when the range passes the grant or
    /// the grant has no READ, or `len` exceeds 2 GiB;
    /// [`Error::RemoteAccess`] (`PermissionDenied`) when the peer's NIC
    /// refuses (revoked, another connection's grant), which fails the
    /// endpoint; the pool's errors; `ConnectionReset` once the endpoint
    /// failed. Cancel-safe: dropping the future leaves the buffer with
    /// the endpoint until the NIC is done with it.
    pub async fn read(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        len: usize,
    ) -> io::Result<PoolBytes> {
        crate::verbs::fork::check_io("MessageEndpoint::read")?;
        let wr = remote_rw(true, remote, offset, len)?;
        let buf = self.pool.alloc_any(len.max(1)).await?;
        let id = self.conn.start_remote(wr, Local::Buf(buf)).await?;
        let mut buf = self
            .conn
            .wait_remote(id, "RDMA READ")
            .await?
            .pop()
            .and_then(Local::into_buf)
            .ok_or_else(|| io::Error::from(Error::Internal("READ without its buffer".into())))?;
        buf.set_len(len);
        Ok(buf.freeze())
    }

    /// Reads `dst.len()` bytes at `offset` of `remote` into `dst`: one
    /// RDMA READ into a pool buffer, then a copy ([`read_to`](Self::read_to)
    /// reads in place, without the copy, into a registered region).
    ///
    /// # Errors
    /// As [`read`](Self::read). Cancel-safe: dropping the future leaves
    /// `dst` as it was and the pool buffer with the endpoint until the NIC
    /// is done with it.
    pub async fn read_into(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        dst: &mut [u8],
    ) -> io::Result<()> {
        let bytes = self.read(remote, offset, dst.len()).await?;
        dst.copy_from_slice(&bytes);
        Ok(())
    }

    /// Writes `data` at `offset` of `remote` (a grant of the peer's) with
    /// one RDMA WRITE, from a pool buffer it is copied into; returns once
    /// the write completed (the peer's NIC acknowledged it).
    ///
    /// # Errors
    /// As [`read`](Self::read), for WRITE access.
    pub async fn write(&self, remote: &RemoteRegion, offset: u64, data: &[u8]) -> io::Result<()> {
        crate::verbs::fork::check_io("MessageEndpoint::write")?;
        let wr = remote_rw(false, remote, offset, data.len())?;
        let buf = self.copied(data).await?;
        let id = self.conn.start_remote(wr, Local::Buf(buf)).await?;
        self.conn.wait_remote(id, "RDMA WRITE").await.map(drop)
    }

    /// Reads `len` bytes at `offset` of `remote` (a grant of the peer's)
    /// with one RDMA READ straight into `len` bytes at `at` of `dst`
    /// (zero-copy: no pool buffer); returns once they are in place.
    /// `dst` is a region this endpoint may use: a buffer of its pool, or
    /// memory registered with its pool or, on a device with memory
    /// windows, another pool on the device
    /// ([`MemoryPool::register_local`]).
    ///
    /// # Errors
    /// `InvalidInput` (nothing posted) when the range passes the grant or
    /// the grant has no READ, `len` exceeds 2 GiB, `at..at + max(len, 1)`
    /// passes `dst`'s end (a WR names at least one byte), or `dst` is not
    /// usable here; [`Error::RemoteAccess`] (`PermissionDenied`) when the
    /// peer's NIC refuses, which fails the endpoint; without memory
    /// windows, the READ's sink registration's errors ([`Error::Verbs`],
    /// [`Error::ResourceLimit`]); `ConnectionReset` once the endpoint
    /// failed. No pool buffer is used.
    /// Cancel-safe: dropping the future leaves `dst` (a clone) with the
    /// endpoint until the NIC is done writing it; its bytes in that range
    /// are unspecified until then.
    pub async fn read_to(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        dst: &LocalRegion,
        at: usize,
        len: usize,
    ) -> io::Result<()> {
        crate::verbs::fork::check_io("MessageEndpoint::read_to")?;
        self.in_place(true, remote, offset, dst, at, len).await
    }

    /// Writes `len` bytes at `at` of `src` at `offset` of `remote` (a
    /// grant of the peer's) with one RDMA WRITE straight from the region
    /// (zero-copy); returns once the write completed. `src` as `dst` of
    /// [`read_to`](Self::read_to).
    ///
    /// # Errors
    /// As [`read_to`](Self::read_to), for WRITE access. Cancel-safe: the
    /// region stays with the endpoint until the NIC is done reading it.
    pub async fn write_from(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        src: &LocalRegion,
        at: usize,
        len: usize,
    ) -> io::Result<()> {
        crate::verbs::fork::check_io("MessageEndpoint::write_from")?;
        self.in_place(false, remote, offset, src, at, len).await
    }

    /// One RDMA READ (`read`) or WRITE between `len` bytes at `offset` of
    /// `remote` and `len` bytes at `at` of `region`, checked, in place.
    async fn in_place(
        &self,
        read: bool,
        remote: &RemoteRegion,
        offset: u64,
        region: &LocalRegion,
        at: usize,
        len: usize,
    ) -> io::Result<()> {
        let wr = remote_rw(read, remote, offset, len)?;
        let local = self.region_range(rw_name(read), region, at, len)?;
        let id = self.conn.start_remote(wr, local).await?;
        self.conn.wait_remote(id, rw_name(read)).await.map(drop)
    }

    /// `InvalidInput` naming `op` unless this endpoint may use `region`
    /// (see [`LocalRegion::usable_with`]).
    fn check_usable(&self, op: &str, region: &LocalRegion) -> io::Result<()> {
        if region.usable_with(&self.pool) {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{op}: the region is neither a buffer of this endpoint's pool nor memory registered on its protection domain"
            ),
        ))
    }

    /// `len` bytes at `at` of `region` as a one-sided WR's local memory
    /// (at least one byte: a zero-length WR still names an SGE), checked.
    fn region_range(
        &self,
        op: &str,
        region: &LocalRegion,
        at: usize,
        len: usize,
    ) -> io::Result<Local> {
        region.check_range(op, at, len.max(1))?;
        self.check_usable(op, region)?;
        Ok(Local::Region {
            region: region.clone(),
            at,
            len: len.max(1),
        })
    }

    /// A scatter-gather list as one WR's local memory, checked: 1 to
    /// [`max_sge`](Self::max_sge) entries ([`max_read_sge`](Self::max_read_sge)
    /// for a READ), each at least 1 byte inside a region this endpoint
    /// may use; and the WR of its total length at `offset` of `remote`.
    ///
    /// # Errors
    /// `InvalidInput` naming what is wrong; nothing is posted.
    fn sge_list(
        &self,
        read: bool,
        remote: &RemoteRegion,
        offset: u64,
        list: &[LocalSge<'_>],
    ) -> io::Result<(RemoteWr, Local)> {
        let op = rw_name(read);
        let most = self.conn.max_sge(read);
        if list.is_empty() || list.len() > most {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{op}: a scatter-gather list of {} entries (this connection takes 1 to {most})",
                    list.len()
                ),
            ));
        }
        let mut total = 0usize;
        let mut locals = Vec::with_capacity(list.len());
        for (i, sge) in list.iter().enumerate() {
            if sge.len == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{op}: scatter-gather entry {i} is empty"),
                ));
            }
            locals.push(self.region_range(op, sge.region, sge.at, sge.len)?);
            total = total.checked_add(sge.len).ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{op}: the scatter-gather list's length overflows"),
                )
            })?;
        }
        Ok((remote_rw(read, remote, offset, total)?, Local::List(locals)))
    }

    /// Writes `data` at `offset` of `remote` (a grant of the peer's, with
    /// WRITE access) and tells the peer: it receives a
    /// [`Notification`] of `value` and `data.len()` from
    /// [`recv_incoming`](Self::recv_incoming), in order with this side's
    /// messages, once the bytes are in place. One RDMA WRITE WITH
    /// IMMEDIATE from a pool buffer `data` is copied into (on a device
    /// without immediate data, iWARP: an RDMA WRITE and a SEND of the
    /// length). Like a message it uses one of the peer's receive buffers
    /// and waits for credit behind earlier messages; returns once it is
    /// queued, as [`send`](Self::send) does: [`flush`](Self::flush) waits
    /// until the peer's NIC took it.
    ///
    /// # Errors
    /// `InvalidInput` (nothing posted) when `value` is `2^29` or more, the
    /// range passes the grant or the grant has no WRITE, or `data` is
    /// longer than 2 GiB; the pool's errors; `ConnectionReset` /
    /// `BrokenPipe` once the endpoint failed or the peer closed. A write
    /// the peer's NIC refuses (a revoked grant, another connection's)
    /// fails the endpoint with [`Error::RemoteAccess`] (`PermissionDenied`;
    /// RC: the QP goes to the error state), which the next call returns
    /// ([`flush`](Self::flush), for one); on iWARP, which acknowledges no
    /// WRITE (RFC 5040), the peer's TERMINATE fails it instead.
    pub async fn write_notify(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        data: &[u8],
        value: u32,
    ) -> io::Result<()> {
        crate::verbs::fork::check_io("MessageEndpoint::write_notify")?;
        if value > MAX_IMM_VALUE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("notification value {value} is wider than 29 bits"),
            ));
        }
        let op = "RDMA WRITE WITH IMMEDIATE";
        let addr = remote.check(op, offset, data.len() as u64, GrantAccess::WRITE)?;
        wr_len(op, data.len())?;
        let buf = self.copied(data).await?;
        std::future::poll_fn(|cx| self.conn.poll_send_ready(cx)).await?;
        let target = NotifyWrite {
            remote_addr: addr,
            rkey: remote.rkey(),
            value,
        };
        self.conn.start_notify(OutgoingMessage::from(buf), target)
    }

    /// Posts `ops` (up to [`MAX_TRANSFER_BATCH`] RDMA READs and WRITEs on
    /// grants of the peer's) with one doorbell, only the last WR signaled
    /// (RC completes in order: its completion says all are done; on
    /// iWARP every READ is signaled too), and returns once all completed:
    /// the bytes read, one buffer per [`Transfer::Read`], in `ops` order.
    /// A [`Transfer::Write`]'s data is copied into a pool buffer first;
    /// [`Transfer::ReadTo`] and [`Transfer::WriteFrom`] read into and write
    /// from a [`LocalRegion`] in place, and [`Transfer::ReadScatter`] and
    /// [`Transfer::WriteGather`] scatter over and gather from a list of
    /// region ranges, one WR with an SGE per entry (zero-copy; nothing is
    /// returned for them). The pattern of transfer engines and of
    /// perftest's `--post_list`.
    ///
    /// The WRs are not fenced (`IBV_SEND_FENCE`): a WRITE may reach the
    /// peer's memory before an earlier READ of the same bytes in the batch
    /// was answered (seen on Soft-iWARP; RFC 5040, section 5.5, lets the
    /// responder place it first), so a batch should not read bytes it also
    /// writes later; put those in a batch of their own.
    ///
    /// # Errors
    /// `InvalidInput` (nothing posted) for more than
    /// [`MAX_TRANSFER_BATCH`] operations, or any operation that
    /// [`read`](Self::read), [`write`](Self::write),
    /// [`read_to`](Self::read_to) or [`write_from`](Self::write_from)
    /// would refuse, and a scatter-gather list that is empty, longer than
    /// [`max_sge`](Self::max_sge) ([`max_read_sge`](Self::max_read_sge)
    /// for a READ), or has an empty entry; a
    /// refusal by the peer's NIC fails the endpoint with
    /// [`Error::RemoteAccess`] naming the first refused operation; the
    /// pool's errors; `ConnectionReset` once the endpoint failed.
    /// Cancel-safe as `read`.
    pub async fn transfer(&self, ops: &[Transfer<'_>]) -> io::Result<Vec<PoolBytes>> {
        crate::verbs::fork::check_io("MessageEndpoint::transfer")?;
        if ops.len() > MAX_TRANSFER_BATCH {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a transfer of {} operations (at most {MAX_TRANSFER_BATCH})",
                    ops.len()
                ),
            ));
        }
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        // Every operation is checked before anything is allocated or
        // posted: a bad one refuses the whole batch. In-place operations
        // get their local memory here; the others below.
        enum Pending<'d> {
            Ready(Local),
            Alloc(usize),
            Copy(&'d [u8]),
        }
        let mut checked = Vec::with_capacity(ops.len());
        for op in ops {
            checked.push(match *op {
                Transfer::Read {
                    remote,
                    offset,
                    len,
                } => (remote_rw(true, remote, offset, len)?, Pending::Alloc(len)),
                Transfer::Write {
                    remote,
                    offset,
                    data,
                } => (
                    remote_rw(false, remote, offset, data.len())?,
                    Pending::Copy(data),
                ),
                Transfer::ReadTo {
                    remote,
                    offset,
                    dst,
                    at,
                    len,
                } => {
                    let wr = remote_rw(true, remote, offset, len)?;
                    let local = self.region_range(rw_name(true), dst, at, len)?;
                    (wr, Pending::Ready(local))
                }
                Transfer::WriteFrom {
                    remote,
                    offset,
                    src,
                    at,
                    len,
                } => {
                    let wr = remote_rw(false, remote, offset, len)?;
                    let local = self.region_range(rw_name(false), src, at, len)?;
                    (wr, Pending::Ready(local))
                }
                Transfer::ReadScatter {
                    remote,
                    offset,
                    dst,
                } => {
                    let (wr, local) = self.sge_list(true, remote, offset, dst)?;
                    (wr, Pending::Ready(local))
                }
                Transfer::WriteGather {
                    remote,
                    offset,
                    src,
                } => {
                    let (wr, local) = self.sge_list(false, remote, offset, src)?;
                    (wr, Pending::Ready(local))
                }
            });
        }
        let mut batch = Vec::with_capacity(ops.len());
        for (wr, pending) in checked {
            let local = match pending {
                Pending::Ready(local) => local,
                Pending::Alloc(len) => Local::Buf(self.pool.alloc_any(len.max(1)).await?),
                Pending::Copy(data) => Local::Buf(self.copied(data).await?),
            };
            batch.push((wr, local));
        }
        let id = self.conn.start_remote_batch(batch).await?;
        let locals = self.conn.wait_remote(id, "RDMA READ/WRITE batch").await?;
        if locals.len() != ops.len() {
            return Err(Error::Internal(format!(
                "a batch of {} operations came back with {} buffers",
                ops.len(),
                locals.len()
            ))
            .into());
        }
        Ok(ops
            .iter()
            .zip(locals)
            .filter_map(|(op, local)| match *op {
                Transfer::Read { len, .. } => local.into_buf().map(|mut buf| {
                    buf.set_len(len);
                    buf.freeze()
                }),
                _ => None,
            })
            .collect())
    }

    /// Atomically compares the 8-byte word at `offset` of `remote` (8-byte
    /// aligned, host byte order as the NIC reports it) with `expect` and,
    /// if equal, replaces it with `new`; returns the word's value before
    /// (equal to `expect` when the swap happened). IBTA atomics are atomic
    /// among the NICs' operations, not against the owner's CPU writes.
    ///
    /// # Errors
    /// As [`read`](Self::read), for ATOMIC access and an aligned word;
    /// `Unsupported` ([`Error::NoAtomics`]) on a device without RDMA
    /// atomics, before anything is posted (the endpoint stays usable).
    pub async fn compare_swap(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        expect: u64,
        new: u64,
    ) -> io::Result<u64> {
        crate::verbs::fork::check_io("MessageEndpoint::compare_swap")?;
        let addr = remote.check("ATOMIC compare-and-swap", offset, 8, GrantAccess::ATOMIC)?;
        let wr = RemoteWr::CompareSwap {
            addr,
            rkey: remote.rkey(),
            compare: expect,
            swap: new,
        };
        self.atomic(wr, "ATOMIC compare-and-swap").await
    }

    /// Atomically adds `add` (wrapping) to the 8-byte word at `offset` of
    /// `remote` (8-byte aligned); returns the word's value before.
    ///
    /// # Errors
    /// As [`compare_swap`](Self::compare_swap).
    pub async fn fetch_add(&self, remote: &RemoteRegion, offset: u64, add: u64) -> io::Result<u64> {
        crate::verbs::fork::check_io("MessageEndpoint::fetch_add")?;
        let addr = remote.check("ATOMIC fetch-and-add", offset, 8, GrantAccess::ATOMIC)?;
        let wr = RemoteWr::FetchAdd {
            addr,
            rkey: remote.rkey(),
            add,
        };
        self.atomic(wr, "ATOMIC fetch-and-add").await
    }

    /// A pool buffer holding a copy of `data` (at least one byte of
    /// capacity: a WR's local buffer), the source of a one-sided WRITE.
    async fn copied(&self, data: &[u8]) -> io::Result<PoolBuf> {
        let mut buf = self.pool.alloc_any(data.len().max(1)).await?;
        buf.spare_mut()[..data.len()].copy_from_slice(data);
        buf.set_len(data.len());
        Ok(buf)
    }

    async fn atomic(&self, wr: RemoteWr, op: &'static str) -> io::Result<u64> {
        let buf = self.pool.alloc_any(8).await?;
        let id = self.conn.start_remote(wr, Local::Buf(buf)).await?;
        let mut buf = self
            .conn
            .wait_remote(id, op)
            .await?
            .pop()
            .and_then(Local::into_buf)
            .ok_or_else(|| io::Error::from(Error::Internal("atomic without its buffer".into())))?;
        buf.set_len(8);
        let mut word = [0u8; 8];
        word.copy_from_slice(&buf.as_slice()[..8]);
        Ok(u64::from_ne_bytes(word))
    }

    #[cfg(tokio_rdma_guest)]
    pub(crate) fn last_posted_sge(&self) -> Option<PostedSge> {
        self.conn.last_sge()
    }
}

impl Stream for MessageEndpoint {
    type Item = io::Result<PoolBytes>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Err(e) = crate::verbs::fork::check_io("MessageEndpoint::poll_next") {
            return Poll::Ready(Some(Err(e)));
        }
        self.conn.poll_recv(cx).map(Result::transpose)
    }
}

impl<M: Into<OutgoingMessage>> Sink<M> for MessageEndpoint {
    type Error = io::Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Err(e) = crate::verbs::fork::check_io("MessageEndpoint::poll_ready") {
            return Poll::Ready(Err(e));
        }
        self.conn.poll_send_ready(cx)
    }

    /// Queues the message; `poll_flush` posts what was fed with one
    /// doorbell (so `send_all` and `feed` batch).
    fn start_send(self: Pin<&mut Self>, item: M) -> io::Result<()> {
        let mut msg = item.into();
        if self.needs_copy(&msg) {
            let buf = self.pool.try_alloc_any(msg.len())?;
            msg = self.copy_to_pool(&msg, buf);
        }
        self.conn.start_send(msg, true)
    }

    /// Ready once every message fed so far is posted to the NIC (as a
    /// socket's flush hands bytes to the kernel).
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Err(e) = crate::verbs::fork::check_io("MessageEndpoint::poll_flush") {
            return Poll::Ready(Err(e));
        }
        self.conn.poll_posted(cx)
    }

    /// Ready once every message is taken by the peer, like
    /// [`MessageEndpoint::flush`]; the connection closes when the last
    /// handle drops.
    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Err(e) = crate::verbs::fork::check_io("MessageEndpoint::poll_close") {
            return Poll::Ready(Err(e));
        }
        match self.conn.poll_posted(cx) {
            Poll::Ready(Ok(())) => self.conn.poll_flush(cx),
            other => other,
        }
    }
}

/// Listens for [`MessageEndpoint`] connections, like
/// [`RdmaListener`](crate::RdmaListener) (same backlog, handshake and
/// cancel-safe `accept`).
pub struct MessageListener {
    inner: Listener<MessageSetup>,
}

impl std::fmt::Debug for MessageListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageListener")
            .field("local_addr", &self.inner.local_addr())
            .finish()
    }
}

impl MessageListener {
    /// Binds with the default [`MessageConfig`].
    ///
    /// # Errors
    /// As [`RdmaListener::bind`](crate::RdmaListener::bind).
    pub async fn bind<A: ToSocketAddrs>(addr: A) -> io::Result<MessageListener> {
        Self::bind_with(addr, &MessageConfig::default()).await
    }

    /// Binds with `config`, which every accepted endpoint uses. Errors as
    /// for [`bind`](Self::bind), and `InvalidInput` for a bad config.
    pub async fn bind_with<A: ToSocketAddrs>(
        addr: A,
        config: &MessageConfig,
    ) -> io::Result<MessageListener> {
        crate::verbs::fork::check_io("MessageListener::bind")?;
        config.validate()?;
        let inner = Listener::bind(addr, MessageSetup(config.clone())).await?;
        Ok(MessageListener { inner })
    }

    /// Waits for the next established endpoint and its peer's address.
    /// Cancel-safe.
    ///
    /// # Errors
    /// An error of the listening rdma_cm id itself.
    pub async fn accept(&self) -> io::Result<(MessageEndpoint, SocketAddr)> {
        crate::verbs::fork::check_io("MessageListener::accept")?;
        std::future::poll_fn(|cx| self.inner.poll_accept(cx))
            .await
            .map(|((conn, pool), a)| (MessageEndpoint::new(conn, pool), a))
    }

    /// The bound address, with the actual port.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.inner.local_addr())
    }
}
