//! Connection configuration shared by streams and listeners.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::proto::ProtocolError;
use crate::proto::stream::{StreamCore, StreamParams};
use crate::verbs::rc::RcSizes;

/// Per-connection settings. `Default` gives the values documented on each
/// setter; pass a config with [`RdmaStream::connect_with`] or
/// [`RdmaListener::bind_with`].
///
/// Registered memory per stream connection is `ring_size` (default 64 KiB)
/// while it is idle, plus `send_buffer_size` (default 64 KiB) while it has
/// data to send: the send buffer is taken from the device's cache when a
/// write arrives and given back once every byte of it completed (README,
/// design notes: thousands of connections). Under bulk both grow, the
/// receive ring to at most `max_ring_size` (default 256 KiB) and the send
/// buffer to the peer's ring, at most `max(send_buffer_size,
/// max_ring_size)`.
///
/// [`RdmaStream::connect_with`]: crate::RdmaStream::connect_with
/// [`RdmaListener::bind_with`]: crate::RdmaListener::bind_with
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    pub(crate) ring_size: u32,
    pub(crate) max_ring_size: u32,
    pub(crate) send_buffer_size: u32,
    pub(crate) send_queue_depth: u16,
    pub(crate) recv_queue_depth: u16,
    pub(crate) inline_threshold: u32,
    pub(crate) signal_interval: u16,
    pub(crate) max_write_size: u32,
    pub(crate) wait_strategy: WaitStrategy,
    pub(crate) connect_timeout: Duration,
    pub(crate) resolve_timeout: Duration,
    pub(crate) recv_buffer_limit: usize,
    pub(crate) device: Option<String>,
    pub(crate) backlog: i32,
    pub(crate) linger: Duration,
    pub(crate) keepalive: Option<Duration>,
    pub(crate) ack_timeout: u8,
    pub(crate) retry_count: u8,
    pub(crate) share_completion_queue: bool,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            ring_size: 64 * 1024,
            max_ring_size: DEFAULT_MAX_RING_SIZE,
            send_buffer_size: 64 * 1024,
            send_queue_depth: 128,
            recv_queue_depth: 128,
            inline_threshold: 64,
            signal_interval: 16,
            max_write_size: 64 * 1024,
            wait_strategy: WaitStrategy::default(),
            connect_timeout: Duration::from_secs(10),
            resolve_timeout: Duration::from_secs(2),
            recv_buffer_limit: 8 * 1024 * 1024,
            device: None,
            backlog: 128,
            linger: Duration::from_secs(60),
            keepalive: Some(Duration::from_secs(30)),
            ack_timeout: 14,
            retry_count: 6,
            share_completion_queue: false,
        }
    }
}

/// Default [`RdmaConfig::max_ring_size`]: 262144 bytes (256 KiB). Four
/// times the default ring: in the Soft-RoCE guest a 256 KiB ring moved
/// 64 KiB writes 1.22-1.73x as fast as 64 KiB did (benches/history/echo-2026-12-04.md,
/// "the ring size is the bulk lever"); on a NIC it covers the
/// bandwidth-delay product of 100 Gb/s at 20 us.
pub const DEFAULT_MAX_RING_SIZE: u32 = 256 * 1024;

/// How a task waits once its connection has nothing for it to receive
/// (`poll_read` of a stream, `recv` of a message endpoint). Set with
/// [`RdmaConfig::wait_strategy`](RdmaConfig::wait_strategy).
///
/// Spinning polls the completion queue in the waiting task's own poll,
/// holding its runtime worker thread for up to the budget: on a
/// `current_thread` runtime no other task of that runtime runs meanwhile
/// (tokio's rule of thumb allows 10 to 100 us between `.await`s, where
/// the default's limit starts; it grows past that, up to 1,600 us, only
/// where a park is measured to cost the connection more than the limit,
/// as in the Soft-RoCE guest, so other tasks of a `current_thread`
/// runtime may then wait that long).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStrategy {
    /// Arm the CQ and park at once: no CPU spent waiting, a completion
    /// event and a wake-up per wait.
    Park,
    /// Poll the CQ for up to this long (the fixed busy-poll budget of
    /// [`RdmaConfig::busy_poll`](RdmaConfig::busy_poll)), then park.
    Spin(Duration),
    /// Spin for a budget learnt from the connection's recent waits, at
    /// most a limit that is learnt too, then park (the default, with `max`
    /// = [`DEFAULT_SPIN_MAX`]), on either runtime flavour. On the
    /// multi-thread runtime this pays since the driver task of a
    /// connection with a completion channel of its own (the first 64 of a
    /// process) no longer wakes for the completions a parked reader takes:
    /// before, it competed with the spinner on the other worker and
    /// spinning gained nothing (benches/history/echo-2026-12-01-to-03.md, "Spin, then park" and
    /// "Events left to the reader"). A connection on the runtime's shared
    /// channel still wakes its driver for every event.
    ///
    /// The limit starts at [`ADAPTIVE_SPIN_START`] (100 us, or `max` if
    /// lower) and doubles, up to `max`, while parking costs the connection
    /// more than the limit: while its parked waits (those within `max`,
    /// and not parked for other connections' sake) end later, on their
    /// running mean, than its waits answered while spinning by more than
    /// the limit (spin as long as a park costs, the ski-rental rule of
    /// spin-then-block), and spins that ran past half the limit still
    /// caught answers. It halves again, not below its start, when that
    /// cost falls under half the limit; idle waits change nothing, so a
    /// connection that learnt 1,600 us and then goes idle keeps it, and
    /// its probes (below) spin 1.6 ms once per 8 waits (on a
    /// `current_thread` runtime holding its other tasks that long). On a
    /// NIC a park costs microseconds and the limit stays at 100 us unless
    /// the peer's answer times spread evenly up to `max` (the cost, measured
    /// as latency, then holds the peer's late answers too); in the
    /// Soft-RoCE guest a park costs 0.2-2 ms and the limit grows
    /// (benches/history/echo-2026-12-01-to-03.md, "A spin limit learnt from what a park costs").
    ///
    /// A wait answered while spinning sets the budget to the limit (the
    /// next wait spins for as long as a park costs; spinning only about
    /// twice the usual wait, as before, parked the waits between that and
    /// the limit, and in the Soft-RoCE guest the 64 B round trip's mean
    /// on current_thread was 1.06-1.27x and its p99 1.1-1.3x what it is
    /// now: benches/history/echo-2026-12-05.md, "A wait answered while spinning spins the
    /// limit next"), unless the runtime has tasks other than this crate's
    /// own and the waiting one: then it moves the budget toward twice
    /// that wait (up to it at once, or halfway down to it), so the wait
    /// parks and lets them run soon (a task the spinner woke, such as the
    /// writer half of a pipelined exchange, cannot run while it spins:
    /// the 8 KiB x 8 echo of `echo_bench` ran 0.73-0.76x as many requests
    /// per second spinning to the limit, benches/history/echo-2026-12-05.md, "A long spin
    /// holds up the writer of a pipelined exchange"); a parked wait that
    /// was answered within the limit raises it to twice that wait; a
    /// parked wait longer than the limit halves it, and
    /// below [`MIN_SPIN`] it is 0 (park at once) until a wait within the
    /// limit is seen again, except that one wait in 8 at random then spins
    /// the limit anyway (a probe): two ends of a ping-pong that both park
    /// see each other's slow parked answers and would otherwise never
    /// learn that both spinning answers within the limit. So a connection
    /// that goes idle spends about twice the limit of CPU time spinning
    /// (the limit, half of it, ... over its next waits), then the limit
    /// per 8 waits; a request/response connection whose peer answers
    /// within the limit spins until each answer, and a wait that outlasts
    /// the limit spins the limit before it parks. Waits of an idle
    /// peer (parked longer than `max`) never raise the limit. It does not
    /// spin at all while another connection of the process ended a wait
    /// within the last millisecond: with more than one connection at
    /// work, a spin would hold up the others on its thread (on a
    /// `current_thread` server, every request of every other connection),
    /// so those waits park at once.
    ///
    /// In a process that may run on one CPU only
    /// ([`std::thread::available_parallelism`] is 1: a one-CPU container
    /// or VM, a `taskset` to one core) it parks at once, as
    /// [`Park`](Self::Park): a spin there holds the CPU that the peer on
    /// the same host, the kernel's Soft-RoCE work and the runtime's other
    /// tasks need, and on one vCPU under QEMU icount the adaptive wait
    /// made the 64 B round trip of `examples/echo_bench.rs` 2.0-2.3x as
    /// long as parking (its spins caught 3 answers in 5,500 waits).
    /// [`Spin`](Self::Spin) still spins there.
    Adaptive {
        /// The largest limit, so the largest spin of one wait.
        max: Duration,
    },
}

/// Where the [`WaitStrategy::Adaptive`] limit starts, and its floor: 100
/// us, the upper end of tokio's rule of thumb for the time between two
/// `.await`s ("no more than 10 to 100 microseconds", tokio's docs on
/// blocking) and Linux's recommended `net.core.busy_poll` for several
/// hundred sockets (Documentation/admin-guide/sysctl/net.rst; 50 us for a
/// few). On a NIC, where a round trip takes a few microseconds, answers
/// end a spin long before the limit, which bounds only the spin of a wait
/// that outlasts it; in the
/// Soft-RoCE guest (a 64 B round trip of raw verbs: 90-180 us) a fixed 100
/// us limit took the 64 B round trip's mean on the current_thread runtime
/// to 0.5-0.9x the build that parked at once, where 50 us gave 0.8-1.5x
/// (benches/history/echo-2026-12-01-to-03.md, "Spin, then park").
pub const ADAPTIVE_SPIN_START: Duration = Duration::from_micros(100);

/// The default [`WaitStrategy::Adaptive`] `max`, the most the learnt limit
/// grows to: 1,600 us, four doublings of [`ADAPTIVE_SPIN_START`]. In the
/// Soft-RoCE guest on the multi-thread runtime a fixed 1,500 us limit gave
/// 0.47-0.55x the 64 B round trip's mean of a fixed 100 us, with less CPU
/// per round trip (a park there costs more CPU than the spin it replaces),
/// where 400 us gave 0.87-0.93x (benches/history/echo-2026-12-01-to-03.md, "Syscalls counted by
/// the kernel"). The limit reaches it only where parking is measured to
/// cost more than spinning (see [`WaitStrategy::Adaptive`]).
pub const DEFAULT_SPIN_MAX: Duration = Duration::from_micros(1600);

/// Budgets below this (1 us) are not worth a spin: the adaptive budget
/// drops to 0 instead.
pub const MIN_SPIN: Duration = Duration::from_micros(1);

impl Default for WaitStrategy {
    fn default() -> Self {
        WaitStrategy::Adaptive {
            max: DEFAULT_SPIN_MAX,
        }
    }
}

/// Largest inline threshold accepted (bytes). Providers grant at most a few
/// hundred bytes of inline data (rxe: 256 with the default WQE size; mlx5:
/// up to about 900); a larger request fails queue pair creation.
pub const MAX_INLINE_THRESHOLD: u32 = 1024;

impl RdmaConfig {
    /// Checks every value against what the protocol core and the verbs
    /// layer accept, so a bad value is an [`Error::InvalidConfig`] at
    /// `bind_with`/`connect_with`, not a failure after the handshake.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first setter out of range.
    pub fn validate(&self) -> Result<(), Error> {
        if !(1..=31).contains(&self.ack_timeout) {
            return Err(Error::InvalidConfig {
                field: "ack_timeout",
                value: self.ack_timeout.into(),
                allowed: "1..=31 (4.096 us x 2^n)",
            });
        }
        if self.retry_count > 7 {
            return Err(Error::InvalidConfig {
                field: "retry_count",
                value: self.retry_count.into(),
                allowed: "0..=7",
            });
        }
        if self.keepalive.is_some_and(|d| d.is_zero()) {
            return Err(Error::InvalidConfig {
                field: "keepalive",
                value: 0,
                allowed: "a non-zero idle time, or None",
            });
        }
        if self.inline_threshold > MAX_INLINE_THRESHOLD {
            return Err(Error::InvalidConfig {
                field: "inline_threshold",
                value: self.inline_threshold.into(),
                allowed: "0..=1024 bytes",
            });
        }
        // The core validates its parameters; check ours as if the peer used
        // the same values.
        let params =
            self.stream_params(self.ring_size, self.recv_queue_depth, self.inline_threshold);
        match StreamCore::new(params) {
            Ok(_) => Ok(()),
            Err(ProtocolError::InvalidParams {
                name,
                value,
                allowed,
            }) => Err(Error::InvalidConfig {
                field: match name {
                    "send_buf_len" => "send_buffer_size",
                    "ring_len" | "peer_ring_len" => "ring_size",
                    "max_ring_len" => "max_ring_size",
                    "recv_depth" | "peer_recv_depth" => "recv_queue_depth",
                    "max_write_len" => "max_write_size",
                    other => other,
                },
                value,
                allowed,
            }),
            Err(e) => Err(Error::Protocol(e)),
        }
    }

    /// The protocol core's parameters for a connection with this config, a
    /// peer advertising `peer_ring_len` bytes and `peer_recv_depth` receive
    /// WRs, and a QP granting `max_inline` bytes of inline data.
    pub(crate) fn stream_params(
        &self,
        peer_ring_len: u32,
        peer_recv_depth: u16,
        max_inline: u32,
    ) -> StreamParams {
        StreamParams {
            send_buf_len: self.send_buffer_size,
            ring_len: self.ring_size,
            max_ring_len: self.max_ring_size.max(self.ring_size),
            recv_depth: self.recv_queue_depth,
            peer_ring_len,
            peer_recv_depth,
            send_queue_depth: self.send_queue_depth,
            inline_threshold: self.inline_threshold.min(max_inline),
            signal_interval: self.signal_interval,
            max_write_len: self.max_write_size,
        }
    }

    /// Sizes of a byte stream's QP with this config (its registered
    /// buffers are the stream QP adapter's: `stream::qp`).
    pub(crate) fn stream_sizes(&self) -> RcSizes {
        RcSizes {
            // Two slots beyond the core's WRs: the keepalive probe and the
            // window bind of a grown ring.
            send_depth: u32::from(self.send_queue_depth) + 2,
            recv_depth: u32::from(self.recv_queue_depth),
            max_inline: self.inline_threshold,
            // The ring is opened by the MR's own key where windows are
            // missing: only this QP may use it.
            own_pd_without_windows: true,
            share_cq: self.share_completion_queue,
            imm_in_send_without_immediate: true,
            trailer_without_immediate: false,
            max_send_sge: 1,
        }
    }

    /// A config with the default values.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of the registered receive ring the peer writes into
    /// (default 65536 = 64 KiB; 4096..=1 GiB). It is all an idle
    /// connection keeps registered, and it bounds the bytes in flight
    /// towards this side: on rxe 64 KiB moves as much as 128 KiB
    /// (benches/history/echo-2026-12-04.md, "Small reads copy once; the
    /// ring size is the bulk lever"); on a fast NIC raise it towards the
    /// bandwidth-delay product for bulk (100 Gb/s x 10 us = 125 KB).
    pub fn ring_size(mut self, bytes: u32) -> Self {
        self.ring_size = bytes;
        self
    }

    /// Largest size in bytes the receive ring grows to while the connection
    /// moves bulk (default [`DEFAULT_MAX_RING_SIZE`] = 256 KiB; at most
    /// 1 GiB; a value at or below `ring_size` turns growth off).
    ///
    /// A ring starts at `ring_size` and doubles, while the double is at
    /// most this, after the peer's writer filled it to half or more and
    /// the reader drained it to a quarter again four times (the protocol
    /// core's `GROW_AFTER_FILLS`): the
    /// reader keeps up and byte credit holds the writer back, so more bytes
    /// in flight buy throughput. Idle and request/response connections with
    /// small messages never fill the ring and keep `ring_size`. Like TCP's
    /// receive-buffer autotuning (`tcp_rmem`'s maximum), this is the bound
    /// on what a busy connection pins: set it to `ring_size` for many
    /// connections that must stay small. The new ring is opened to the
    /// peer exactly as the first one (a memory window bound on the
    /// connection's QP, or its own PD) and the previous ring is freed once
    /// read out. A grown ring does not shrink back while the connection
    /// lives.
    ///
    /// It also bounds the send buffer: once the peer's ring grew (under
    /// bulk) past `send_buffer_size`, the send buffer grows to the peer's
    /// ring length, at most `max(send_buffer_size, max_ring_size)`, the
    /// next time it is empty (see
    /// [`send_buffer_size`](RdmaConfig::send_buffer_size)).
    pub fn max_ring_size(mut self, bytes: u32) -> Self {
        self.max_ring_size = bytes;
        self
    }

    /// Bytes of the registered send buffer writes are copied into before
    /// they are posted (default 65536 = 64 KiB). It bounds how much
    /// `poll_write` accepts ahead of the peer's credit, like `SO_SNDBUF`.
    /// Held only while there is unsent or unacknowledged data (from a
    /// per-device cache of idle buffers, at most 4 MiB).
    ///
    /// This is the starting size: after the peer's receive ring grew under
    /// bulk, the send buffer grows to the peer's ring (up to
    /// `max(send_buffer_size, max_ring_size)`) the next time every byte
    /// in it completed, so as many bytes can be in flight as byte credit
    /// allows (like TCP's send-buffer autotuning, `tcp_wmem`; a smaller
    /// buffer keeps one 64 KiB WR in flight against a 256 KiB ring:
    /// benches/history/echo-2026-12-06.md, "A send buffer that follows the peer's ring").
    /// [`ConnectionStats::send_buffer_size`](crate::ConnectionStats::send_buffer_size)
    /// reports the size in use. If the larger buffer cannot be
    /// registered, the buffer stays as it is.
    pub fn send_buffer_size(mut self, bytes: u32) -> Self {
        self.send_buffer_size = bytes;
        self
    }

    /// Send queue depth in work requests (default 128).
    pub fn send_queue_depth(mut self, wrs: u16) -> Self {
        self.send_queue_depth = wrs;
        self
    }

    /// Receive WRs kept posted (default 128, at most 1023: the CREDIT
    /// immediate carries 10 bits). A byte stream's receive WRs carry no
    /// buffer (they take WRITE-with-immediate notifications); a message
    /// endpoint posts an `eager_buf_len` buffer per WR, 15 at first and
    /// more, up to this depth, while its peer's traffic needs them.
    pub fn recv_queue_depth(mut self, wrs: u16) -> Self {
        self.recv_queue_depth = wrs;
        self
    }

    /// Writes of at most this many bytes are posted as inline data (copied
    /// into the work request; default 64 bytes; 0 disables inline).
    pub fn inline_threshold(mut self, bytes: u32) -> Self {
        self.inline_threshold = bytes;
        self
    }

    /// Selective signaling: at most this many unsignaled WRs between two
    /// signaled ones (default 16).
    pub fn signal_interval(mut self, wrs: u16) -> Self {
        self.signal_interval = wrs;
        self
    }

    /// Largest payload of one RDMA WRITE in bytes (default 65536).
    pub fn max_write_size(mut self, bytes: u32) -> Self {
        self.max_write_size = bytes;
        self
    }

    /// A fixed busy-poll budget: after the completion queue runs dry, keep
    /// polling it for up to this long before arming the CQ for an event and
    /// parking; `Duration::ZERO` parks at once. Shorthand for
    /// [`wait_strategy`](Self::wait_strategy) with
    /// [`WaitStrategy::Spin`] (or [`WaitStrategy::Park`] for zero); the
    /// default is [`WaitStrategy::Adaptive`]. Trades CPU for latency.
    pub fn busy_poll(mut self, budget: Duration) -> Self {
        self.wait_strategy = if budget.is_zero() {
            WaitStrategy::Park
        } else {
            WaitStrategy::Spin(budget)
        };
        self
    }

    /// How a task that found nothing to receive (a stream's `poll_read`, a
    /// message endpoint's `recv`) waits: park on the completion event at
    /// once, spin a fixed budget first, or (default)
    /// [`WaitStrategy::Adaptive`]: spin up to a learnt limit while the
    /// connection's waits end within it (100 us,
    /// [`ADAPTIVE_SPIN_START`], growing up to 1,600 us,
    /// [`DEFAULT_SPIN_MAX`], where parking is measured to cost more) and
    /// no other connection of the process is at work, otherwise park at
    /// once. A spin holds the task's worker thread (on a `current_thread`
    /// runtime, every other task of it) for up to the budget; an idle
    /// connection spends about twice the limit of CPU time spinning, then
    /// the limit once per 8 waits (a probe, [`WaitStrategy::Adaptive`]).
    /// Measured in the Soft-RoCE guest: benches/history/echo-2026-12-01-to-03.md, "Spin, then
    /// park" and "A spin limit learnt from what a park costs".
    pub fn wait_strategy(mut self, strategy: WaitStrategy) -> Self {
        self.wait_strategy = strategy;
        self
    }

    /// Put this connection's work completions on a completion queue (CQ)
    /// shared with other connections of the same tokio runtime and device
    /// (up to 60 with the default depths) instead of a CQ of its own
    /// (default `false`). A shared CQ saves device CQs (a device has
    /// `max_cq` of them; rxe in the Soft-RoCE guest allows 1,048,576) but
    /// not memory (each connection reserves its send plus receive depth,
    /// plus 16 entries, in it), and it must stay armed while any connection
    /// on it waits, so a busy connection on it raises a completion event
    /// per completion burst: in the Soft-RoCE guest a parked 64 B round
    /// trip took 1.6-2.8x as long in mean (benches/history/echo-2026-12-01-to-03.md, "Shared
    /// completion queues"). Meant for many mostly idle connections on a
    /// device with few CQs. Without it a connection still gets a shared CQ
    /// once the process holds half the device's `max_cq` CQs of their own,
    /// rather than failing at the limit.
    pub fn share_completion_queue(mut self, share: bool) -> Self {
        self.share_completion_queue = share;
        self
    }

    /// Overall limit for `connect` (address and route resolution plus the
    /// handshake; default 10 s). Exceeding it fails with `TimedOut`. A
    /// listener (`bind_with`) does not give up on a request it answered
    /// within this time: it waits for the kernel connection manager's
    /// verdict (the client's confirmation or reject, or the CM's give-up
    /// on a client that vanished), for at most this value or 60 s,
    /// whichever is longer (TCP's SYN-RECEIVED lasts about 63 s). A client
    /// that counts itself connected is not disconnected because the
    /// listener was slow, as with TCP's `accept`.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Limit for each of rdma_cm's address and route resolution steps
    /// (default 2 s).
    pub fn resolve_timeout(mut self, timeout: Duration) -> Self {
        self.resolve_timeout = timeout;
        self
    }

    /// Bytes of received data held in process memory when the application
    /// does not read (default 8 MiB). Incoming data is moved out of the ring
    /// in the background up to this limit, so receive credit keeps flowing
    /// while the application is busy writing (what h2 needs); past it the
    /// ring fills and the peer's writes wait, like a full TCP window. Bytes
    /// that a read smaller than what arrived left in the ring stay there
    /// for the next read, and are moved out only if none comes within two
    /// of the driver's 5 ms ticks (`ConnectionStats::bytes_buffered`
    /// counts what was moved).
    pub fn recv_buffer_limit(mut self, bytes: usize) -> Self {
        self.recv_buffer_limit = bytes;
        self
    }

    /// Use this RDMA device (for example `mlx5_0`) instead of the one the
    /// route resolves to; the connection fails with
    /// [`crate::Error::DeviceNotFound`] if it does not
    /// match the device rdma_cm bound the address to.
    pub fn device(mut self, name: impl Into<String>) -> Self {
        self.device = Some(name.into());
        self
    }

    /// How long a dropped stream keeps delivering what was written before it
    /// was dropped (and its FIN) when the peer does not take it, before the
    /// connection is torn down (default 60 s). Like the kernel's socket
    /// buffer after `close`, delivery continues in the background; this
    /// bounds how long a peer that never reads can hold the queue pair and
    /// its registered memory.
    pub fn linger(mut self, timeout: Duration) -> Self {
        self.linger = timeout;
        self
    }

    /// Idle time before the connection probes its peer (default 30 s;
    /// `None` turns keepalive off), like TCP's `SO_KEEPALIVE` with
    /// `TCP_KEEPIDLE`. Idle means no work completion (no data, credit or
    /// probe sent or received), whether or not a task waits meanwhile. A
    /// probe is a zero-length RDMA WRITE (it carries no
    /// data, consumes no receive WR and no application credit; IBTA C9-88:
    /// a zero-length operation checks no key); on iWARP, where a WRITE
    /// completes once it is handed to TCP, a zero-length RDMA READ, which
    /// completes only with the peer's response. A peer host that is gone
    /// cannot acknowledge it: after the RC transport's retries (see
    /// [`ack_timeout`](Self::ack_timeout)) the connection fails and every
    /// waiter gets `ConnectionReset` (`Error::WorkCompletion` with
    /// RETRY_EXC_ERR, 12), never EOF, never a hang. A dead peer is so
    /// detected within `keepalive + 4.096 us x 2^ack_timeout x
    /// (retry_count + 1)` of the last traffic (defaults: 30 s + 0.47 s).
    /// A probe still neither acknowledged nor failed when the next is due
    /// (the queue pair stopped making progress without an error) fails the
    /// connection with `TimedOut` (`Error::KeepaliveTimeout`), so a wedged
    /// queue pair is an error within two keepalive periods. On iWARP that
    /// is also how a dead peer shows: its retransmission is TCP's, whose
    /// bound is many minutes (`tcp_retries2`), so the unanswered READ
    /// probe ends the connection with `KeepaliveTimeout` instead.
    pub fn keepalive(mut self, idle: Option<Duration>) -> Self {
        self.keepalive = idle;
        self
    }

    /// The RC transport's ACK timeout exponent (default 14, as perftest
    /// sets it; 1..=31): a packet not acknowledged within
    /// 4.096 us x 2^ack_timeout (14: 67 ms) is retransmitted. rdma_cm's
    /// own default is larger (about a second per retry on rxe), which makes
    /// each lost packet cost that much on a lossy wire.
    pub fn ack_timeout(mut self, exponent: u8) -> Self {
        self.ack_timeout = exponent;
        self
    }

    /// Retransmissions of an unacknowledged packet before the connection
    /// fails with RETRY_EXC_ERR (default 6; 0..=7). With the default
    /// timeout a peer that stopped answering is detected after
    /// 7 x 67 ms = 0.47 s of unacknowledged traffic. Not 7: rxe (Soft-RoCE)
    /// treats 7 as "retry for ever" (rxe_comp.c, the RNR-retry meaning), so
    /// a dead peer would never be detected there.
    pub fn retry_count(mut self, retries: u8) -> Self {
        self.retry_count = retries;
        self
    }

    /// The detection bound the retry settings give:
    /// 4.096 us x 2^ack_timeout x (retry_count + 1) (IBTA vol. 1, 9.7.6.1.3
    /// and 12.7.34).
    pub fn retry_bound(&self) -> Duration {
        let per_try_ns = 4096u64 << self.ack_timeout.min(31);
        Duration::from_nanos(per_try_ns.saturating_mul(u64::from(self.retry_count) + 1))
    }

    /// Listen backlog passed to `rdma_listen` (default 128): handshakes in
    /// flight plus connections not yet accepted. Requests beyond it are
    /// rejected (`ServerResources`), and a tokio-rdma client retries such a
    /// reject with backoff until its connect timeout, so a burst above the
    /// backlog still connects as the server accepts.
    pub fn backlog(mut self, backlog: i32) -> Self {
        self.backlog = backlog;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(cfg: RdmaConfig) -> (&'static str, u64) {
        match cfg.validate() {
            Err(Error::InvalidConfig { field, value, .. }) => (field, value),
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn max_ring_size_bounds_growth_and_a_lower_one_turns_it_off() {
        let p = RdmaConfig::new().stream_params(65536, 128, 64);
        assert_eq!((p.ring_len, p.max_ring_len), (65536, 262_144));
        let p = RdmaConfig::new()
            .ring_size(1 << 20)
            .stream_params(65536, 128, 64);
        assert_eq!((p.ring_len, p.max_ring_len), (1 << 20, 1 << 20));
        let p = RdmaConfig::new()
            .max_ring_size(65536)
            .stream_params(65536, 128, 64);
        assert_eq!((p.ring_len, p.max_ring_len), (65536, 65536));
        assert_eq!(RdmaConfig::new().stream_sizes().send_depth, 130);
    }

    #[test]
    fn defaults_are_valid() {
        RdmaConfig::default().validate().unwrap();
        RdmaConfig::new()
            .ring_size(1)
            .send_queue_depth(1)
            .validate()
            .unwrap();
    }

    #[test]
    fn out_of_range_values_name_the_setter() {
        assert_eq!(
            field_of(RdmaConfig::new().signal_interval(0)),
            ("signal_interval", 0)
        );
        assert_eq!(
            field_of(RdmaConfig::new().send_queue_depth(0)),
            ("send_queue_depth", 0)
        );
        assert_eq!(
            field_of(RdmaConfig::new().send_buffer_size(0)),
            ("send_buffer_size", 0)
        );
        assert_eq!(
            field_of(RdmaConfig::new().max_write_size(0)),
            ("max_write_size", 0)
        );
        assert_eq!(field_of(RdmaConfig::new().ring_size(0)), ("ring_size", 0));
        assert_eq!(
            field_of(RdmaConfig::new().max_ring_size(1 << 31)),
            ("max_ring_size", 1 << 31)
        );
        assert_eq!(
            field_of(RdmaConfig::new().ring_size(1 << 31)),
            ("ring_size", 1 << 31)
        );
        assert_eq!(
            field_of(RdmaConfig::new().recv_queue_depth(1)),
            ("recv_queue_depth", 1)
        );
        assert_eq!(
            field_of(RdmaConfig::new().recv_queue_depth(2000)),
            ("recv_queue_depth", 2000)
        );
        assert_eq!(
            field_of(RdmaConfig::new().inline_threshold(100_000)),
            ("inline_threshold", 100_000)
        );
        let io: std::io::Error = RdmaConfig::new()
            .signal_interval(0)
            .validate()
            .unwrap_err()
            .into();
        assert_eq!(io.kind(), std::io::ErrorKind::InvalidInput);
        assert_eq!(
            field_of(RdmaConfig::new().ack_timeout(0)),
            ("ack_timeout", 0)
        );
        assert_eq!(
            field_of(RdmaConfig::new().ack_timeout(32)),
            ("ack_timeout", 32)
        );
        assert_eq!(
            field_of(RdmaConfig::new().retry_count(8)),
            ("retry_count", 8)
        );
        assert_eq!(
            field_of(RdmaConfig::new().keepalive(Some(Duration::ZERO))),
            ("keepalive", 0)
        );
    }

    #[test]
    fn retry_bound_follows_the_ibta_formula() {
        // 4.096 us x 2^14 x 7 = 469.762048 ms.
        assert_eq!(
            RdmaConfig::new().retry_bound(),
            Duration::from_nanos(469_762_048)
        );
        assert_eq!(
            RdmaConfig::new()
                .ack_timeout(1)
                .retry_count(0)
                .retry_bound(),
            Duration::from_nanos(8192)
        );
    }
}
