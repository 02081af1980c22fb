//! In-memory tests of the stream core: a `Pair` of [`StreamCore`]s joined
//! by a simulated RC queue pair (in the style of quinn-proto's
//! `tests/util.rs`).
//!
//! The wire executes [`Transmit`]s the way a NIC would: a data WR's bytes are
//! read from the sender's send buffer when the WR is *delivered* (not when it
//! is posted; inline WRs are copied at post time) and written into the peer's
//! ring at `remote_offset`; immediates are delivered to the peer's
//! `on_recv` in posting order; a signaled WR's completion becomes available
//! to the sender only after the WR was delivered. The harness keeps its own
//! shadow of which ring bytes are unread, so an overwrite of unread data is
//! caught independently of the core's own checks.

use std::collections::{HashSet, VecDeque};
use std::hash::{Hash, Hasher};

use super::error::{ProtocolError, WriteError};
use super::handshake::MAX_RING_LEN;
use super::imm::Imm;
use super::stream::{
    CONTROL_RESERVE, RecvEvent, StreamCore, StreamParams, StreamStats, Transmit, TransmitKind,
};

// ----- deterministic randomness ---------------------------------------------

/// xorshift64*: small, seeded, good enough to pick schedules.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform-ish in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// The byte at stream position `i` of side `side` (0 = A, 1 = B): a pattern
/// that makes misplaced, duplicated or lost bytes visible.
fn pattern(side: usize, i: usize) -> u8 {
    let x = (i as u64)
        .wrapping_mul(2_654_435_761)
        .wrapping_add(side as u64 * 97);
    (x ^ (x >> 13) ^ (x >> 27)) as u8
}

// ----- the harness -------------------------------------------------------------

/// One endpoint's local settings; the pair derives the `peer_*` fields.
#[derive(Debug, Clone, Copy)]
struct Cfg {
    send_buf_len: u32,
    ring_len: u32,
    recv_depth: u16,
    send_queue_depth: u16,
    inline_threshold: u32,
    signal_interval: u16,
    max_write_len: u32,
    /// Largest ring the local ring grows to; at or below `ring_len`: no
    /// growth.
    max_ring_len: u32,
}

impl Default for Cfg {
    fn default() -> Cfg {
        Cfg {
            send_buf_len: 1 << 16,
            ring_len: 1 << 16,
            recv_depth: 64,
            send_queue_depth: 128,
            inline_threshold: 64,
            signal_interval: 16,
            max_write_len: 1 << 20,
            max_ring_len: 0,
        }
    }
}

/// The fake address and key side `side` offers for its ring `generation`.
fn fake_ring(side: usize, generation: usize) -> (u64, u32) {
    (
        0x7F00_0000_0000 + ((generation as u64) << 32) + side as u64 * 4096,
        0xAB00_0000 | ((generation as u32) << 8) | side as u32,
    )
}

fn params(local: Cfg, peer: Cfg) -> StreamParams {
    StreamParams {
        send_buf_len: local.send_buf_len,
        ring_len: local.ring_len,
        max_ring_len: local.max_ring_len.max(local.ring_len),
        recv_depth: local.recv_depth,
        peer_ring_len: peer.ring_len,
        peer_recv_depth: peer.recv_depth,
        send_queue_depth: local.send_queue_depth,
        inline_threshold: local.inline_threshold,
        signal_interval: local.signal_interval,
        max_write_len: local.max_write_len,
    }
}

/// A posted WR travelling to the peer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct InFlight {
    t: Transmit,
    /// Inline payload, copied when posted.
    inline: Option<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Side {
    id: usize,
    core: StreamCore,
    send_buf: Vec<u8>,
    /// The local rings by generation (grown ones appended when offered).
    rings: Vec<Vec<u8>>,
    /// Shadow of the rings: true where an unread byte lies.
    live: Vec<Vec<bool>>,
    /// Bytes accepted from the application so far (content is `pattern`).
    written: usize,
    /// Bytes read out of the ring so far (checked against the peer's pattern).
    read: usize,
    /// WRs posted so far.
    posted: u64,
    /// Posted WRs not yet delivered, oldest first.
    wire: VecDeque<InFlight>,
    /// Signaled WRs delivered, awaiting `on_send_complete`.
    completions: VecDeque<u64>,
    /// Every transmit posted, in order (kept out of the exhaustive search's
    /// state by clearing it there).
    log: Vec<Transmit>,
    /// Events from `on_recv`, in order.
    events: Vec<RecvEvent>,
    /// Whether the application reads during `drive`.
    reading: bool,
    /// Times the send buffer was swapped for one of another length.
    resizes: u64,
}

impl Side {
    fn new(id: usize, local: Cfg, peer: Cfg) -> Side {
        Side {
            id,
            core: StreamCore::new(params(local, peer)).expect("valid params"),
            send_buf: vec![0; local.send_buf_len as usize],
            rings: vec![vec![0; local.ring_len as usize]],
            live: vec![vec![false; local.ring_len as usize]],
            written: 0,
            read: 0,
            posted: 0,
            wire: VecDeque::new(),
            completions: VecDeque::new(),
            log: Vec::new(),
            events: Vec::new(),
            reading: true,
            resizes: 0,
        }
    }

    /// Writes up to `n` more pattern bytes; returns how many were accepted.
    fn write(&mut self, n: usize) -> usize {
        let n = n.min(self.core.write_capacity().expect("writable"));
        let ranges = self.core.accept_write(n);
        assert_eq!(ranges[0].len() + ranges[1].len(), n);
        assert!(ranges[1].is_empty() || ranges[0].end == self.send_buf.len());
        for range in ranges {
            for slot in &mut self.send_buf[range] {
                *slot = pattern(self.id, self.written);
                self.written += 1;
            }
        }
        n
    }

    /// Swaps the send buffer for one of `len` bytes when the core allows
    /// it (nothing in use), as the runtime does; returns the core's answer.
    fn resize_send_buf(&mut self, len: u32) -> bool {
        let resized = self.core.resize_send_buf(len);
        if resized {
            self.send_buf = vec![0; len as usize];
        }
        resized
    }

    /// Offers a larger ring when the core wants one, as the runtime does
    /// before posting.
    fn maybe_offer(&mut self) {
        if let Some(len) = self.core.ring_wanted() {
            let generation = self.rings.len();
            assert_eq!(generation as u32, self.core.ring_generation() + 1);
            assert_eq!(len as usize, 2 * self.rings[generation - 1].len());
            self.rings.push(vec![0; len as usize]);
            self.live.push(vec![false; len as usize]);
            let (addr, rkey) = fake_ring(self.id, generation);
            assert!(self.core.offer_ring(addr, rkey));
        }
    }

    /// Posts one WR if the core has one; checks its shape.
    fn post_one(&mut self, peer_ring_lens: &[usize]) -> Option<Transmit> {
        self.maybe_offer();
        let t = self.core.poll_transmit()?;
        let p = *self.core.params();
        self.posted += 1;
        assert_eq!(t.wr_id, self.posted, "wr_ids count up from 1");
        let inline = match t.kind {
            TransmitKind::Data {
                ring,
                local_offset,
                len,
                remote_offset,
                imm,
                inline,
            } => {
                assert!(len >= 1 && len <= p.max_write_len, "{t:?}");
                let peer_ring_len = peer_ring_lens[ring as usize];
                assert_eq!(peer_ring_len, p.peer_ring_len as usize, "{t:?}");
                assert!(
                    local_offset as usize + len as usize <= self.send_buf.len(),
                    "{t:?}"
                );
                assert!(
                    remote_offset as usize + len as usize <= peer_ring_len,
                    "{t:?}"
                );
                assert_eq!(Imm::decode(imm), Ok(Imm::Data { len }));
                assert_eq!(inline, len <= p.inline_threshold);
                inline.then(|| self.send_buf[local_offset as usize..][..len as usize].to_vec())
            }
            TransmitKind::Control { imm } => {
                assert!(
                    !matches!(Imm::decode(imm), Ok(Imm::Data { .. }) | Err(_)),
                    "{t:?}"
                );
                None
            }
        };
        self.log.push(t);
        self.wire.push_back(InFlight { t, inline });
        Some(t)
    }

    fn post_all(&mut self, peer_ring_lens: &[usize]) -> usize {
        let mut n = 0;
        while self.post_one(peer_ring_lens).is_some() {
            n += 1;
        }
        n
    }

    fn complete_one(&mut self) -> bool {
        let Some(wr_id) = self.completions.pop_front() else {
            return false;
        };
        self.core
            .on_send_complete(wr_id)
            .expect("completion of an outstanding WR");
        true
    }

    /// Reads up to `max` bytes out of the ring; checks them.
    /// Reads up to `max` bytes out of the rings, oldest ring first;
    /// checks them.
    fn read_some(&mut self, max: usize) -> usize {
        let mut total = 0;
        while total < max && self.core.readable_len() > 0 {
            let g = self.core.readable_generation() as usize;
            let readable = self.core.readable();
            let in_ring = readable[0].len() + readable[1].len();
            assert!(in_ring > 0 && in_ring <= self.core.readable_len());
            let mut n = 0;
            for range in readable {
                for i in range {
                    if total + n == max {
                        break;
                    }
                    assert!(
                        self.live[g][i],
                        "reading a byte that never arrived at offset {i} of ring {g}"
                    );
                    assert_eq!(
                        self.rings[g][i],
                        pattern(1 - self.id, self.read),
                        "byte {} of side {}'s stream (offset {i} of ring {g})",
                        self.read,
                        1 - self.id
                    );
                    self.live[g][i] = false;
                    self.read += 1;
                    n += 1;
                }
            }
            self.core.consume(n);
            total += n;
        }
        total
    }
}

/// Two cores joined by a simulated RC queue pair.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Pair {
    s: [Side; 2],
}

const A: usize = 0;
const B: usize = 1;

impl Pair {
    fn new(a: Cfg, b: Cfg) -> Pair {
        Pair {
            s: [Side::new(A, a, b), Side::new(B, b, a)],
        }
    }

    fn symmetric(cfg: Cfg) -> Pair {
        Pair::new(cfg, cfg)
    }

    fn peer_ring_lens(&self, from: usize) -> Vec<usize> {
        self.s[1 - from].rings.iter().map(Vec::len).collect()
    }

    fn post_all(&mut self, from: usize) -> usize {
        let lens = self.peer_ring_lens(from);
        self.s[from].post_all(&lens)
    }

    fn post_one(&mut self, from: usize) -> Option<Transmit> {
        let lens = self.peer_ring_lens(from);
        self.s[from].post_one(&lens)
    }

    /// Delivers the oldest WR `from` posted; returns the peer's event.
    fn deliver(&mut self, from: usize) -> Option<Result<RecvEvent, ProtocolError>> {
        let [a, b] = &mut self.s;
        let (src, dst) = if from == A { (a, b) } else { (b, a) };
        let InFlight { t, inline } = src.wire.pop_front()?;
        if let TransmitKind::Data {
            ring,
            local_offset,
            len,
            remote_offset,
            ..
        } = t.kind
        {
            let payload = inline
                .unwrap_or_else(|| src.send_buf[local_offset as usize..][..len as usize].to_vec());
            let at = remote_offset as usize;
            let g = ring as usize;
            for (i, byte) in payload.into_iter().enumerate() {
                assert!(
                    !dst.live[g][at + i],
                    "{t:?} overwrites an unread byte at offset {} of ring {g}",
                    at + i
                );
                dst.rings[g][at + i] = byte;
                dst.live[g][at + i] = true;
            }
        }
        let result = dst.core.on_recv(t.kind.imm());
        if let Ok(event) = result {
            dst.events.push(event);
            match (event, t.kind) {
                (
                    RecvEvent::Data { ring, offset, len },
                    TransmitKind::Data {
                        ring: sent_ring,
                        remote_offset,
                        len: sent,
                        ..
                    },
                ) => assert_eq!((ring, offset, len), (sent_ring, remote_offset, sent)),
                (RecvEvent::Grant { addr, rkey, len }, _) => {
                    let g = src.rings.len() - 1;
                    assert_eq!((addr, rkey), fake_ring(src.id, g));
                    assert_eq!(len as usize, src.rings[g].len());
                }
                _ => {}
            }
        }
        if t.signaled {
            src.completions.push_back(t.wr_id);
        }
        Some(result)
    }

    fn deliver_all(&mut self, from: usize) -> usize {
        let mut n = 0;
        while let Some(result) = self.deliver(from) {
            result.expect("valid message");
            n += 1;
        }
        n
    }

    /// Runs everything that can run until nothing changes: post, deliver,
    /// complete, and read on sides whose reader is active. Returns the
    /// number of steps taken.
    fn drive(&mut self) -> usize {
        let mut steps = 0;
        loop {
            let mut progress = 0;
            for side in [A, B] {
                progress += self.post_all(side);
            }
            for side in [A, B] {
                progress += self.deliver_all(side);
            }
            for side in [A, B] {
                while self.s[side].complete_one() {
                    progress += 1;
                }
                if self.s[side].reading {
                    progress += self.s[side].read_some(usize::MAX);
                }
            }
            if progress == 0 {
                return steps;
            }
            steps += progress;
        }
    }

    /// Asserts the end state of a clean, fully shut down exchange.
    fn assert_done(&self) {
        for side in [A, B] {
            let me = &self.s[side];
            let peer = &self.s[1 - side];
            assert_eq!(
                me.read, peer.written,
                "side {side} read everything its peer wrote"
            );
            assert!(me.core.readable_eof(), "side {side} at EOF");
            assert!(me.core.all_sent(), "side {side} all sent");
            assert!(me.wire.is_empty() && me.completions.is_empty());
            assert_eq!(me.core.outstanding_wrs(), 0);
            assert_eq!(me.core.unposted_len(), 0);
            let stats = me.core.stats();
            assert_eq!(stats.bytes_sent, me.written as u64);
            assert_eq!(stats.bytes_received, peer.written as u64);
            assert_eq!(stats.wrs_posted, me.posted);
            assert_eq!(stats.wrs_posted, stats.data_wrs + stats.control_sent);
            assert_eq!(stats.control_received, peer.core.stats().control_sent);
        }
    }

    fn data_wrs(&self, side: usize) -> Vec<(u32, u32, u32)> {
        self.s[side]
            .log
            .iter()
            .filter_map(|t| match t.kind {
                TransmitKind::Data {
                    local_offset,
                    len,
                    remote_offset,
                    ..
                } => Some((local_offset, len, remote_offset)),
                TransmitKind::Control { .. } => None,
            })
            .collect()
    }

    fn controls(&self, side: usize) -> Vec<Imm> {
        self.s[side]
            .log
            .iter()
            .filter_map(|t| match t.kind {
                TransmitKind::Control { imm } => Some(Imm::decode(imm).unwrap()),
                TransmitKind::Data { .. } => None,
            })
            .collect()
    }
}

fn transfer_both_ways(pair: &mut Pair, total: [usize; 2], chunk: [usize; 2], read_chunk: usize) {
    loop {
        let mut progress = 0;
        for side in [A, B] {
            let left = total[side] - pair.s[side].written;
            if left > 0 {
                progress += pair.s[side].write(left.min(chunk[side]));
            } else if pair.s[side].core.write_capacity().is_ok() {
                pair.s[side].core.shutdown();
                progress += 1;
            }
            progress += pair.post_all(side);
        }
        for side in [A, B] {
            // Deliver one at a time so the two directions interleave.
            if pair.deliver(side).is_some() {
                progress += 1;
            }
            if pair.s[side].complete_one() {
                progress += 1;
            }
            progress += pair.s[side].read_some(read_chunk);
        }
        if progress == 0 {
            break;
        }
    }
    pair.drive();
}

// ----- basic flow --------------------------------------------------------------

#[test]
fn speaking_first_sends_an_empty_credit_before_the_data() {
    let mut pair = Pair::symmetric(Cfg::default());
    pair.s[A].core.speak_first();
    assert_eq!(pair.s[A].write(5), 5);
    assert_eq!(pair.post_all(A), 2);
    assert_eq!(pair.controls(A), vec![Imm::Credit { wrs: 0, bytes: 0 }]);
    assert!(matches!(
        pair.s[A].log[1].kind,
        TransmitKind::Data { len: 5, .. }
    ));
    assert_eq!(pair.deliver_all(A), 2);
    assert_eq!(pair.s[B].read_some(64), 5);
    // Only once: the next transmit is data alone.
    assert_eq!(pair.s[A].write(3), 3);
    assert_eq!(pair.post_all(A), 1);
    assert_eq!(pair.controls(A).len(), 1);
    assert_eq!(pair.deliver_all(A), 1);
    assert_eq!(pair.s[B].read_some(64), 3);
}

#[test]
fn hello_world_and_half_close() {
    let mut pair = Pair::symmetric(Cfg::default());
    assert_eq!(pair.s[A].write(5), 5);
    pair.s[A].core.shutdown();
    assert_eq!(pair.post_all(A), 2);
    let [data, fin] = [pair.s[A].log[0], pair.s[A].log[1]];
    assert_eq!(
        data,
        Transmit {
            wr_id: 1,
            kind: TransmitKind::Data {
                ring: 0,
                local_offset: 0,
                len: 5,
                remote_offset: 0,
                imm: 5,
                inline: true
            },
            signaled: false,
        }
    );
    assert_eq!(
        fin,
        Transmit {
            wr_id: 2,
            kind: TransmitKind::Control { imm: 0x8000_0000 },
            signaled: true,
        }
    );
    assert_eq!(
        pair.deliver(A),
        Some(Ok(RecvEvent::Data {
            ring: 0,
            offset: 0,
            len: 5
        }))
    );
    assert_eq!(pair.s[B].core.readable(), [0..5, 0..0]);
    assert!(!pair.s[B].core.readable_eof());
    assert_eq!(pair.deliver(A), Some(Ok(RecvEvent::Fin)));
    assert!(pair.s[B].core.fin_received());
    assert!(
        !pair.s[B].core.readable_eof(),
        "EOF only after the bytes are read"
    );
    assert_eq!(pair.s[B].read_some(usize::MAX), 5);
    assert!(pair.s[B].core.readable_eof());
    assert_eq!(pair.s[A].core.write_capacity(), Err(WriteError::Shutdown));
    assert!(!pair.s[A].core.all_sent(), "FIN not yet completed");
    assert!(pair.s[A].complete_one());
    assert!(pair.s[A].core.all_sent());
}

// ----- ring wrap-around --------------------------------------------------------

#[test]
fn wraparound_of_both_rings_with_odd_sizes() {
    let a = Cfg {
        send_buf_len: 3001,
        ring_len: 4099,
        max_write_len: 1000,
        ..Cfg::default()
    };
    let b = Cfg {
        send_buf_len: 2003,
        ring_len: 1009,
        max_write_len: 777,
        ..Cfg::default()
    };
    let mut pair = Pair::new(a, b);
    transfer_both_ways(&mut pair, [50_000, 30_011], [777, 1234], 500);
    pair.assert_done();
    // Every pass over a ring's end splits exactly one WR at that end.
    let ends = |side: usize, peer_ring: u32, send_buf: u32| {
        let wrs = pair.data_wrs(side);
        (
            wrs.iter()
                .filter(|(_, len, remote)| remote + len == peer_ring)
                .count(),
            wrs.iter()
                .filter(|(local, len, _)| local + len == send_buf)
                .count(),
        )
    };
    assert_eq!(ends(A, 1009, 3001), (50_000 / 1009, 50_000 / 3001));
    assert_eq!(ends(B, 4099, 2003), (30_011 / 4099, 30_011 / 2003));
    assert!(pair.data_wrs(A).iter().all(|(_, len, _)| *len <= 1000));
    assert!(pair.data_wrs(B).iter().all(|(_, len, _)| *len <= 777));
}

#[test]
fn data_wr_is_split_at_peer_ring_end_and_send_buffer_end() {
    let cfg = Cfg {
        send_buf_len: 10,
        ring_len: 7,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    assert_eq!(pair.s[A].write(6), 6);
    pair.drive(); // 0..6 of both
    assert_eq!(pair.s[A].write(10), 10);
    pair.drive();
    assert_eq!(pair.s[B].read, 16);
    // (local_offset, len, remote_offset): the second write wraps the ring at
    // 7 and the send buffer at 10, and waits for credit for the last 2 bytes.
    assert_eq!(
        pair.data_wrs(A),
        vec![
            (0, 6, 0),
            (6, 1, 6),
            (7, 3, 0),
            (0, 3, 3),
            (3, 1, 6),
            (4, 2, 0)
        ]
    );
}

/// The send buffer takes a new length only while it holds nothing (bytes
/// buffered or posted and not completed keep their offsets), never 0 or
/// beyond 1 GiB, and the first write after the change lands at offset 0
/// of the new buffer with the whole new length as capacity.
#[test]
fn send_buffer_resized_only_while_empty_and_refilled_from_offset_zero() {
    let cfg = Cfg {
        send_buf_len: 10,
        ring_len: 64,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    assert_eq!(pair.s[A].write(6), 6);
    assert!(!pair.s[A].resize_send_buf(32), "6 bytes buffered");
    assert_eq!(pair.s[A].post_all(&[64]), 1);
    assert_eq!(pair.s[A].core.send_buf_in_use(), 6);
    assert!(
        !pair.s[A].resize_send_buf(32),
        "6 bytes posted, not completed"
    );
    assert_eq!(pair.s[A].core.params().send_buf_len, 10);
    assert_eq!(pair.s[A].core.write_capacity(), Ok(4));
    pair.drive();
    assert_eq!(pair.s[A].core.send_buf_in_use(), 0);
    assert!(!pair.s[A].resize_send_buf(0));
    assert!(!pair.s[A].resize_send_buf(MAX_RING_LEN + 1));
    assert_eq!(pair.s[A].core.params().send_buf_len, 10);
    assert!(pair.s[A].resize_send_buf(32));
    assert_eq!(pair.s[A].core.params().send_buf_len, 32);
    assert_eq!(pair.s[A].core.write_capacity(), Ok(32));
    assert_eq!(pair.s[A].write(40), 32);
    pair.drive();
    assert_eq!(pair.s[B].read, 38);
    // (local_offset, len, remote_offset): the 32 bytes went out of the new
    // buffer from offset 0 in one WR, not wrapped at the old length.
    assert_eq!(pair.data_wrs(A), vec![(0, 6, 0), (0, 32, 6)]);
    pair.s[A].core.shutdown();
    pair.s[B].core.shutdown();
    pair.drive();
    pair.assert_done();
}

// ----- credits -----------------------------------------------------------------

#[test]
fn wr_credit_exhaustion_and_recovery() {
    let cfg = Cfg {
        recv_depth: 8,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    // Each 1-byte write becomes its own WR while WR credit lasts: 8 minus
    // the control reserve of 2.
    for i in 0..6 {
        assert_eq!(pair.s[A].write(1), 1);
        assert_eq!(pair.post_all(A), 1, "write {i}");
    }
    assert_eq!(pair.s[A].core.peer_wr_credit(), CONTROL_RESERVE);
    assert_eq!(pair.s[A].core.stats().credit_stalls, 0);
    for _ in 0..4 {
        assert_eq!(pair.s[A].write(1), 1);
        assert_eq!(pair.post_all(A), 0);
    }
    assert_eq!(
        pair.s[A].core.stats().credit_stalls,
        1,
        "one stall, however often polled"
    );
    assert_eq!(pair.s[A].core.unposted_len(), 4);
    // B receives the six; its reader does not read, yet WR credit flows.
    pair.s[B].reading = false;
    assert_eq!(pair.deliver_all(A), 6);
    assert_eq!(pair.post_all(B), 1);
    assert_eq!(pair.controls(B), vec![Imm::Credit { wrs: 6, bytes: 0 }]);
    assert_eq!(
        pair.deliver(B),
        Some(Ok(RecvEvent::Credit { wrs: 6, bytes: 0 }))
    );
    assert_eq!(pair.s[A].core.peer_wr_credit(), 8);
    // The four buffered bytes go as one WR.
    assert_eq!(pair.post_all(A), 1);
    assert_eq!(pair.data_wrs(A).last(), Some(&(6, 4, 6)));
    assert_eq!(pair.s[A].core.peer_wr_credit(), 7);
    pair.s[B].reading = true;
    pair.drive();
    assert_eq!(pair.s[B].read, 10);
    assert_eq!(pair.s[A].core.stats().credit_stalls, 1);
}

#[test]
fn byte_credit_exhaustion_and_recovery() {
    let cfg = Cfg {
        ring_len: 64, // credit threshold 16 bytes
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    pair.s[B].reading = false;
    assert_eq!(pair.s[A].write(100), 100);
    pair.drive();
    assert_eq!(pair.data_wrs(A), vec![(0, 64, 0)]);
    assert_eq!(pair.s[A].core.peer_bytes_credit(), 0);
    assert_eq!(pair.s[A].core.stats().credit_stalls, 1);
    assert_eq!(pair.s[B].core.readable_len(), 64);
    // 15 bytes read: below the threshold, no CREDIT yet.
    assert_eq!(pair.s[B].read_some(15), 15);
    assert_eq!(pair.post_all(B), 0);
    // The 16th byte reaches it: the CREDIT returns 16 bytes and the one WR.
    assert_eq!(pair.s[B].read_some(1), 1);
    assert_eq!(pair.post_all(B), 1);
    assert_eq!(pair.controls(B), vec![Imm::Credit { wrs: 1, bytes: 16 }]);
    pair.deliver_all(B);
    assert_eq!(pair.s[A].core.peer_bytes_credit(), 16);
    assert_eq!(pair.post_all(A), 1);
    assert_eq!(pair.data_wrs(A)[1], (64, 16, 0));
    assert_eq!(pair.s[A].core.stats().credit_stalls, 2);
    pair.s[B].reading = true;
    pair.drive();
    assert_eq!(pair.s[B].read, 100);
    assert_eq!(pair.s[A].core.peer_bytes_credit(), 64);
}

#[test]
fn credit_larger_than_one_message_is_split() {
    // A 4 MiB ring returns bytes in CREDITs of at most 2^20 - 1 bytes; the
    // threshold is capped there too.
    let cfg = Cfg {
        ring_len: 4 << 20,
        send_buf_len: 4 << 20,
        max_write_len: 1 << 20,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    pair.s[B].reading = false;
    assert_eq!(pair.s[A].write(3 << 20), 3 << 20);
    pair.drive();
    assert_eq!(pair.s[B].core.readable_len(), 3 << 20);
    assert_eq!(pair.s[B].read_some(3 << 20), 3 << 20);
    // 3 MiB = 3 * (2^20 - 1) + 3: three full CREDITs; the last 3 bytes are
    // below the threshold and wait for more.
    assert_eq!(pair.post_all(B), 3);
    let max = (1 << 20) - 1;
    assert_eq!(
        pair.controls(B),
        vec![
            Imm::Credit { wrs: 3, bytes: max },
            Imm::Credit { wrs: 0, bytes: max },
            Imm::Credit { wrs: 0, bytes: max },
        ]
    );
    assert_eq!(pair.s[B].read_some(usize::MAX), 0);
    pair.s[A].write(max as usize - 3);
    pair.s[B].reading = true;
    pair.drive();
    assert_eq!(pair.s[B].read, (3 << 20) + max as usize - 3);
    assert_eq!(pair.controls(B)[3], Imm::Credit { wrs: 1, bytes: max });
}

#[test]
fn reader_that_never_reads_stalls_the_sender_with_exact_counts() {
    let cfg = Cfg {
        ring_len: 4099,
        send_buf_len: 8192,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    pair.s[B].reading = false;
    let mut total = 0;
    for _ in 0..10 {
        total += pair.s[A].write(usize::MAX);
        pair.drive();
    }
    // B's ring is full, A's send buffer holds everything not yet posted.
    assert_eq!(pair.s[B].core.readable_len(), 4099);
    assert_eq!(pair.s[B].core.readable(), [0..4099, 0..0]);
    assert_eq!(pair.s[A].core.stats().bytes_sent, 4099);
    assert_eq!(pair.s[A].core.unposted_len(), 8192);
    assert_eq!(total, 8192 + 4099);
    assert_eq!(pair.s[A].core.write_capacity(), Ok(0));
    assert_eq!(pair.s[A].core.peer_bytes_credit(), 0);
    assert_eq!(pair.s[A].core.stats().credit_stalls, 1);
    assert_eq!(pair.s[A].core.stats().data_wrs, 1);
    assert_eq!(
        pair.s[B].core.stats().control_sent,
        0,
        "1 WR is below the return threshold"
    );
    // Now the reader reads, and everything flows.
    pair.s[B].reading = true;
    pair.drive();
    assert_eq!(pair.s[B].read, 8192 + 4099);
    assert_eq!(pair.s[A].core.write_capacity(), Ok(8192));
    pair.s[A].write(10_000);
    pair.s[A].core.shutdown();
    pair.s[B].core.shutdown();
    pair.drive();
    pair.assert_done();
    assert_eq!(pair.s[B].read, 8192 + 4099 + 8192);
}

#[test]
fn wr_credit_flows_while_the_reader_does_not_read() {
    // h2 stops reading while its writes are blocked: receive WRs must still
    // be returned, or 1-byte writes would stop after depth - 2 of them.
    let cfg = Cfg {
        recv_depth: 8,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    pair.s[B].reading = false;
    for _ in 0..100 {
        assert_eq!(pair.s[A].write(1), 1);
        pair.drive();
    }
    assert_eq!(pair.s[B].core.readable_len(), 100);
    assert_eq!(pair.s[A].core.stats().data_wrs, 100);
    assert_eq!(pair.s[A].core.stats().credit_stalls, 0);
    // B returns 2 WRs per CREDIT (threshold max(2, 8/4)); A returns the WRs
    // those CREDITs used two at a time, B returns those...
    assert_eq!(pair.s[B].core.stats().credits_sent, 66);
    assert_eq!(pair.s[A].core.stats().credits_sent, 33);
}

#[test]
fn interleaved_one_byte_and_large_writes() {
    let cfg = Cfg {
        max_write_len: 4096,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    for _ in 0..6 {
        assert_eq!(pair.s[A].write(1), 1);
        pair.drive();
        assert_eq!(pair.s[A].write(10_000), 10_000);
        pair.drive();
    }
    assert_eq!(pair.s[B].read, 6 * 10_001);
    let stats = pair.s[A].core.stats();
    assert_eq!(stats.data_wrs, 6 * (1 + 3));
    assert_eq!(stats.inline, 6);
    let lens: Vec<u32> = pair.data_wrs(A).iter().map(|w| w.1).take(4).collect();
    assert_eq!(lens, vec![1, 4096, 4096, 1808]);
    // 1- and 3000-byte writes without posting in between fill the
    // 65536-byte send buffer (21 pairs, 1 byte, then 2514 of 3000) and
    // coalesce: from stream position 60006 (same offset in the send buffer
    // and the peer ring, and full credit since B returned everything) they
    // become 4096 + 1434 up to both ends, then 14 * 4096 + 2662.
    let mut accepted = 0;
    for _ in 0..50 {
        accepted += pair.s[A].write(1);
        accepted += pair.s[A].write(3000);
    }
    assert_eq!(accepted, 65536);
    pair.drive();
    let lens: Vec<u32> = pair.data_wrs(A)[24..].iter().map(|w| w.1).collect();
    let mut expected = vec![4096, 1434];
    expected.extend([4096; 14]);
    expected.push(2662);
    assert_eq!(lens, expected);
    pair.s[A].core.shutdown();
    pair.s[B].core.shutdown();
    pair.drive();
    pair.assert_done();
}

// ----- selective signaling -----------------------------------------------------

#[test]
fn selective_signaling_counts() {
    let cfg = Cfg {
        signal_interval: 4,
        max_write_len: 10,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    assert_eq!(pair.s[A].write(100), 100);
    assert_eq!(pair.post_all(A), 10);
    let signaled: Vec<u64> = pair.s[A]
        .log
        .iter()
        .filter(|t| t.signaled)
        .map(|t| t.wr_id)
        .collect();
    assert_eq!(
        signaled,
        vec![4, 8, 10],
        "every 4th, and the last of the burst"
    );
    assert_eq!(pair.s[A].core.stats().signaled, 3);
    assert_eq!(pair.s[A].core.outstanding_wrs(), 10);
    // Completing 8 releases 1..=8 (80 bytes); 10 releases the rest.
    pair.deliver_all(A);
    assert_eq!(pair.s[A].completions, VecDeque::from(vec![4, 8, 10]));
    pair.s[A].completions.clear();
    pair.s[A].core.on_send_complete(8).unwrap();
    assert_eq!(pair.s[A].core.outstanding_wrs(), 2);
    assert_eq!(pair.s[A].core.write_capacity(), Ok((1 << 16) - 20));
    pair.s[A].core.on_send_complete(10).unwrap();
    assert_eq!(pair.s[A].core.outstanding_wrs(), 0);
    assert_eq!(pair.s[A].core.write_capacity(), Ok(1 << 16));
    assert_eq!(
        pair.s[A].core.on_send_complete(4),
        Err(ProtocolError::UnknownWrId {
            wr_id: 4,
            outstanding: None
        })
    );
}

#[test]
fn send_queue_full_signals_the_last_wr_and_resumes() {
    let cfg = Cfg {
        signal_interval: 100,
        send_queue_depth: 8,
        max_write_len: 10,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    assert_eq!(pair.s[A].write(100), 100);
    assert_eq!(pair.post_all(A), 8);
    assert_eq!(pair.post_all(A), 0);
    let signaled: Vec<u64> = pair.s[A]
        .log
        .iter()
        .filter(|t| t.signaled)
        .map(|t| t.wr_id)
        .collect();
    assert_eq!(
        signaled,
        vec![8],
        "the WR that fills the send queue is signaled"
    );
    assert_eq!(pair.s[A].core.stats().send_queue_stalls, 1);
    pair.deliver_all(A);
    assert!(pair.s[A].complete_one());
    assert_eq!(pair.post_all(A), 2);
    let signaled: Vec<u64> = pair.s[A]
        .log
        .iter()
        .filter(|t| t.signaled)
        .map(|t| t.wr_id)
        .collect();
    assert_eq!(signaled, vec![8, 10]);
    assert_eq!(pair.s[A].core.stats().send_queue_stalls, 1);
    pair.drive();
    assert_eq!(pair.s[B].read, 100);
}

#[test]
fn signal_interval_one_signals_every_wr() {
    let cfg = Cfg {
        signal_interval: 1,
        max_write_len: 10,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    pair.s[A].write(35);
    assert_eq!(pair.post_all(A), 4);
    assert!(pair.s[A].log.iter().all(|t| t.signaled));
    assert_eq!(pair.s[A].core.stats().signaled, 4);
}

#[test]
fn inline_threshold_decides_inline() {
    let cfg = Cfg {
        inline_threshold: 16,
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    for n in [1, 16, 17, 100, 16] {
        pair.s[A].write(n);
        pair.drive();
    }
    let inline: Vec<bool> = pair.s[A]
        .log
        .iter()
        .filter_map(|t| match t.kind {
            TransmitKind::Data { inline, .. } => Some(inline),
            TransmitKind::Control { .. } => None,
        })
        .collect();
    assert_eq!(inline, vec![true, true, false, false, true]);
    assert_eq!(pair.s[A].core.stats().inline, 3);
    assert_eq!(pair.s[B].read, 150);
}

// ----- half-close in every order -----------------------------------------------

fn fin_exchange(order: &str) -> Pair {
    let mut pair = Pair::symmetric(Cfg {
        ring_len: 1001,
        ..Cfg::default()
    });
    match order {
        "A then B" | "B then A" => {
            let (first, second) = if order == "A then B" { (A, B) } else { (B, A) };
            pair.s[first].write(3000);
            pair.s[first].core.shutdown();
            pair.drive();
            assert!(pair.s[second].core.readable_eof());
            assert_eq!(pair.s[second].read, 3000);
            assert!(pair.s[first].core.all_sent());
            // The other side still writes after receiving the FIN, and it
            // still arrives.
            pair.s[second].write(2500);
            pair.drive();
            assert_eq!(pair.s[first].read, 2500);
            assert!(!pair.s[first].core.readable_eof());
            pair.s[second].write(1);
            pair.s[second].core.shutdown();
            pair.drive();
            assert_eq!(pair.s[first].read, 2501);
            assert!(pair.s[first].core.readable_eof());
        }
        "simultaneous" => {
            // Both fit in the 1001-byte rings, so nothing waits for credit.
            pair.s[A].write(900);
            pair.s[B].write(700);
            pair.s[A].core.shutdown();
            pair.s[B].core.shutdown();
            // Both FINs are posted before either side receives anything.
            pair.post_all(A);
            pair.post_all(B);
            assert!(
                pair.s[A]
                    .wire
                    .iter()
                    .any(|w| w.t.kind.imm() == Imm::Fin.encode())
            );
            assert!(
                pair.s[B]
                    .wire
                    .iter()
                    .any(|w| w.t.kind.imm() == Imm::Fin.encode())
            );
            pair.drive();
        }
        _ => unreachable!(),
    }
    pair.assert_done();
    for side in [A, B] {
        assert_eq!(
            pair.s[side].core.write_capacity(),
            Err(WriteError::Shutdown)
        );
        assert_eq!(
            pair.s[side]
                .events
                .iter()
                .filter(|e| **e == RecvEvent::Fin)
                .count(),
            1
        );
    }
    pair
}

#[test]
fn fin_a_then_b() {
    let pair = fin_exchange("A then B");
    assert_eq!(pair.s[A].read, 2501);
    assert_eq!(pair.s[B].read, 3000);
}

#[test]
fn fin_b_then_a() {
    let pair = fin_exchange("B then A");
    assert_eq!(pair.s[A].read, 3000);
    assert_eq!(pair.s[B].read, 2501);
}

#[test]
fn fin_simultaneous() {
    let pair = fin_exchange("simultaneous");
    assert_eq!(pair.s[A].read, 700);
    assert_eq!(pair.s[B].read, 900);
}

#[test]
fn fin_waits_for_buffered_data_and_credit() {
    let mut pair = Pair::symmetric(Cfg {
        ring_len: 10,
        ..Cfg::default()
    });
    pair.s[B].reading = false;
    pair.s[A].write(25);
    pair.s[A].core.shutdown();
    pair.drive();
    // Only 10 bytes fit; the FIN must not overtake the other 15.
    assert!(pair.controls(A).is_empty());
    assert!(!pair.s[B].core.fin_received());
    assert!(!pair.s[A].core.all_sent());
    pair.s[B].reading = true;
    pair.drive();
    assert_eq!(pair.s[B].read, 25);
    assert!(pair.s[B].core.readable_eof());
    assert_eq!(pair.controls(A).last(), Some(&Imm::Fin));
    assert!(pair.s[A].core.all_sent());
}

#[test]
fn shutdown_is_idempotent() {
    let mut pair = Pair::symmetric(Cfg::default());
    pair.s[A].core.shutdown();
    pair.s[A].core.shutdown();
    pair.drive();
    pair.s[A].core.shutdown();
    pair.drive();
    assert_eq!(pair.controls(A), vec![Imm::Fin]);
    assert_eq!(pair.s[A].core.accept_write(0), [0..0, 0..0]);
}

// ----- abort -------------------------------------------------------------------

#[test]
fn abort_sends_abort_and_refuses_writes() {
    let mut pair = Pair::symmetric(Cfg::default());
    pair.s[A].write(10);
    pair.drive();
    pair.s[A].write(7); // buffered, not posted
    pair.s[A].core.abort(42);
    assert_eq!(pair.s[A].core.write_capacity(), Err(WriteError::Aborted));
    assert_eq!(
        pair.s[A].core.unposted_len(),
        0,
        "unposted bytes are dropped"
    );
    assert!(pair.s[A].core.is_aborted());
    assert_eq!(pair.s[A].core.local_abort_code(), Some(42));
    pair.s[A].core.shutdown();
    assert_eq!(
        pair.post_one(A).map(|t| (t.kind, t.signaled)),
        Some((TransmitKind::Control { imm: 0xC000_002A }, true))
    );
    assert_eq!(pair.post_one(A), None, "nothing after the ABORT");
    assert_eq!(pair.deliver(A), Some(Ok(RecvEvent::Abort { code: 42 })));
    let b = &pair.s[B].core;
    assert!(b.is_aborted());
    assert_eq!(b.peer_abort_code(), Some(42));
    assert_eq!(b.write_capacity(), Err(WriteError::Reset));
    assert!(b.all_sent());
    assert_eq!(pair.post_one(B), None);
    pair.s[A].complete_one();
    assert!(pair.s[A].core.all_sent());
    assert_eq!(pair.s[B].read, 10);
    // A second abort keeps the first code and sends nothing more.
    pair.s[A].core.abort(7);
    assert_eq!(pair.s[A].core.local_abort_code(), Some(42));
    assert_eq!(pair.post_one(A), None);
}

#[test]
fn abort_waits_for_wr_credit() {
    let cfg = Cfg {
        recv_depth: 4,
        ring_len: 4, // byte-credit threshold 1
        ..Cfg::default()
    };
    let mut pair = Pair::symmetric(cfg);
    // A: two data WRs (down to the reserve), then FIN (one more).
    for _ in 0..2 {
        pair.s[A].write(1);
        pair.post_all(A);
    }
    pair.s[A].core.shutdown();
    assert_eq!(pair.post_all(A), 1);
    assert_eq!(pair.s[A].core.peer_wr_credit(), 1);
    // B sends a byte; A reads it and returns credit with its last WR credit.
    pair.s[B].write(1);
    pair.post_all(B);
    pair.deliver_all(B);
    assert_eq!(pair.s[A].read_some(1), 1);
    assert_eq!(pair.post_all(A), 1);
    assert_eq!(
        pair.controls(A),
        vec![Imm::Fin, Imm::Credit { wrs: 1, bytes: 1 }]
    );
    assert_eq!(pair.s[A].core.peer_wr_credit(), 0);
    // No credit: the ABORT waits.
    pair.s[A].core.abort(5);
    assert_eq!(pair.post_one(A), None);
    assert!(!pair.s[A].core.all_sent());
    // B receives A's four messages and returns their WRs; the ABORT goes.
    assert_eq!(pair.deliver_all(A), 4);
    assert_eq!(pair.s[B].read_some(usize::MAX), 2);
    assert_eq!(pair.post_all(B), 1);
    assert_eq!(pair.controls(B), vec![Imm::Credit { wrs: 4, bytes: 2 }]);
    pair.deliver_all(B);
    assert_eq!(pair.s[A].core.peer_wr_credit(), 4);
    assert_eq!(
        pair.post_one(A).map(|t| (t.kind, t.signaled)),
        Some((TransmitKind::Control { imm: 0xC000_0005 }, true))
    );
    assert_eq!(pair.post_one(A), None);
    pair.deliver_all(A);
    assert_eq!(pair.s[B].events.last(), Some(&RecvEvent::Abort { code: 5 }));
    assert_eq!(pair.s[B].core.write_capacity(), Err(WriteError::Reset));
    while pair.s[A].complete_one() {}
    assert!(pair.s[A].core.all_sent());
}

#[test]
fn connection_lost_resets_writes_and_stops_sending() {
    let mut pair = Pair::symmetric(Cfg::default());
    pair.s[A].write(10);
    pair.s[A].core.on_connection_lost();
    assert_eq!(pair.s[A].core.write_capacity(), Err(WriteError::Reset));
    assert_eq!(pair.post_one(A), None);
    assert!(pair.s[A].core.all_sent());
    assert!(!pair.s[A].core.is_aborted());
    pair.s[A].core.abort(1);
    assert_eq!(pair.post_one(A), None, "no ABORT on a dead connection");
}

// ----- bad peer input ----------------------------------------------------------

/// A core as B sees it, fed raw immediates by a (misbehaving) peer.
fn lone(ring_len: u32, recv_depth: u16) -> StreamCore {
    let local = Cfg {
        ring_len,
        recv_depth,
        ..Cfg::default()
    };
    StreamCore::new(params(local, Cfg::default())).unwrap()
}

/// Asserts that `err` aborted the core with the matching ABORT code.
fn assert_aborted_with(core: &mut StreamCore, err: &ProtocolError) {
    assert_eq!(core.write_capacity(), Err(WriteError::Aborted));
    assert_eq!(core.local_abort_code(), Some(err.abort_code()));
    let t = core.poll_transmit().expect("ABORT queued");
    assert_eq!(
        Imm::decode(t.kind.imm()),
        Ok(Imm::Abort {
            code: err.abort_code()
        })
    );
}

#[test]
fn bad_imm_data_of_length_zero() {
    let mut core = lone(100, 8);
    let err = core.on_recv(0).unwrap_err();
    assert_eq!(
        err,
        ProtocolError::BadImm {
            imm: 0,
            reason: "DATA with length 0"
        }
    );
    assert_aborted_with(&mut core, &err);
}

#[test]
fn bad_imm_fin_with_payload_bits() {
    let mut core = lone(100, 8);
    let err = core.on_recv(0x8000_0010).unwrap_err();
    assert_eq!(
        err,
        ProtocolError::BadImm {
            imm: 0x8000_0010,
            reason: "FIN type that is no FIN, GRANT or SWITCH"
        }
    );
    assert_aborted_with(&mut core, &err);
}

#[test]
fn data_crossing_the_ring_end() {
    let mut core = lone(100, 8);
    assert_eq!(
        core.on_recv(60),
        Ok(RecvEvent::Data {
            ring: 0,
            offset: 0,
            len: 60
        })
    );
    core.consume(60);
    let err = core.on_recv(41).unwrap_err();
    assert_eq!(
        err,
        ProtocolError::RingWrap {
            offset: 60,
            len: 41,
            ring_len: 100
        }
    );
    assert_aborted_with(&mut core, &err);
    // A DATA larger than the whole ring is reported the same way.
    let mut core = lone(100, 8);
    assert_eq!(
        core.on_recv(0x3FFF_FFFF),
        Err(ProtocolError::RingWrap {
            offset: 0,
            len: 0x3FFF_FFFF,
            ring_len: 100
        })
    );
}

#[test]
fn data_beyond_byte_credit() {
    let mut core = lone(100, 8);
    assert_eq!(
        core.on_recv(50),
        Ok(RecvEvent::Data {
            ring: 0,
            offset: 0,
            len: 50
        })
    );
    assert_eq!(
        core.on_recv(50),
        Ok(RecvEvent::Data {
            ring: 0,
            offset: 50,
            len: 50
        })
    );
    assert_eq!(core.readable(), [0..100, 0..0]);
    // Consumed but not yet returned: still no room.
    core.consume(30);
    let mut probe = core.clone();
    assert_eq!(
        probe.on_recv(1),
        Err(ProtocolError::RingOverrun { len: 1, free: 0 })
    );
    assert_aborted_with(&mut probe, &ProtocolError::RingOverrun { len: 1, free: 0 });
    // Once the CREDIT for those 30 bytes is posted, 30 bytes may come.
    let t = core.poll_transmit().expect("CREDIT");
    assert_eq!(
        Imm::decode(t.kind.imm()),
        Ok(Imm::Credit { wrs: 2, bytes: 30 })
    );
    assert_eq!(
        core.on_recv(30),
        Ok(RecvEvent::Data {
            ring: 0,
            offset: 0,
            len: 30
        })
    );
    assert_eq!(core.readable(), [30..100, 0..30]);
    assert_eq!(
        core.on_recv(1),
        Err(ProtocolError::RingOverrun { len: 1, free: 0 })
    );
}

#[test]
fn more_messages_than_receive_wrs() {
    let mut core = lone(1000, 4);
    for i in 0..4 {
        assert_eq!(
            core.on_recv(1),
            Ok(RecvEvent::Data {
                ring: 0,
                offset: i,
                len: 1
            })
        );
    }
    let err = core.on_recv(1).unwrap_err();
    assert_eq!(
        err,
        ProtocolError::WrOverrun {
            consumed: 5,
            recv_depth: 4
        }
    );
    assert_aborted_with(&mut core, &err);
    // Control messages count too.
    let mut core = lone(1000, 4);
    core.on_recv(Imm::Fin.encode()).unwrap();
    for _ in 0..3 {
        core.on_recv(Imm::Credit { wrs: 0, bytes: 0 }.encode())
            .unwrap();
    }
    assert_eq!(
        core.on_recv(Imm::Credit { wrs: 0, bytes: 0 }.encode()),
        Err(ProtocolError::WrOverrun {
            consumed: 5,
            recv_depth: 4
        })
    );
}

#[test]
fn credit_returning_more_than_outstanding() {
    let mut core = lone(100, 8);
    let err = core
        .on_recv(Imm::Credit { wrs: 1, bytes: 0 }.encode())
        .unwrap_err();
    assert_eq!(
        err,
        ProtocolError::CreditOverflow {
            wrs: 1,
            bytes: 0,
            outstanding_wrs: 0,
            outstanding_bytes: 0
        }
    );
    assert_aborted_with(&mut core, &err);
    // After sending 5 bytes in one WR: returning 1 WR and 6 bytes is too much.
    let mut core = lone(100, 8);
    core.accept_write(5);
    assert!(matches!(
        core.poll_transmit().unwrap().kind,
        TransmitKind::Data { len: 5, .. }
    ));
    assert_eq!(
        core.on_recv(Imm::Credit { wrs: 1, bytes: 6 }.encode()),
        Err(ProtocolError::CreditOverflow {
            wrs: 1,
            bytes: 6,
            outstanding_wrs: 1,
            outstanding_bytes: 5
        })
    );
    let mut core = lone(100, 8);
    core.accept_write(5);
    core.poll_transmit().unwrap();
    assert_eq!(
        core.on_recv(Imm::Credit { wrs: 1, bytes: 5 }.encode()),
        Ok(RecvEvent::Credit { wrs: 1, bytes: 5 })
    );
    assert_eq!(core.peer_bytes_credit(), 1 << 16);
}

#[test]
fn data_after_fin() {
    let mut core = lone(100, 8);
    assert_eq!(core.on_recv(Imm::Fin.encode()), Ok(RecvEvent::Fin));
    let err = core.on_recv(5).unwrap_err();
    assert_eq!(err, ProtocolError::DataAfterFin { len: 5 });
    assert_aborted_with(&mut core, &err);
}

#[test]
fn duplicate_fin() {
    let mut core = lone(100, 8);
    assert_eq!(core.on_recv(Imm::Fin.encode()), Ok(RecvEvent::Fin));
    let err = core.on_recv(Imm::Fin.encode()).unwrap_err();
    assert_eq!(err, ProtocolError::DuplicateFin);
    assert_aborted_with(&mut core, &err);
}

#[test]
fn message_after_abort() {
    let mut core = lone(100, 8);
    assert_eq!(
        core.on_recv(Imm::Abort { code: 3 }.encode()),
        Ok(RecvEvent::Abort { code: 3 })
    );
    assert_eq!(
        core.on_recv(7),
        Err(ProtocolError::MessageAfterAbort { imm: 7 })
    );
    // The peer is gone: no ABORT is sent back, and writes report a reset.
    assert_eq!(core.poll_transmit(), None);
    assert_eq!(core.write_capacity(), Err(WriteError::Aborted));
    assert_eq!(core.peer_abort_code(), Some(3));
}

#[test]
fn completion_of_unknown_wr_id() {
    let mut core = lone(100, 8);
    assert_eq!(
        core.on_send_complete(7),
        Err(ProtocolError::UnknownWrId {
            wr_id: 7,
            outstanding: None
        })
    );
    core.accept_write(5);
    core.poll_transmit().unwrap();
    core.shutdown();
    core.poll_transmit().unwrap();
    assert_eq!(
        core.on_send_complete(3),
        Err(ProtocolError::UnknownWrId {
            wr_id: 3,
            outstanding: Some((1, 2))
        })
    );
    assert_eq!(
        core.on_send_complete(0),
        Err(ProtocolError::UnknownWrId {
            wr_id: 0,
            outstanding: Some((1, 2))
        })
    );
    assert_eq!(core.on_send_complete(2), Ok(()));
    assert_eq!(
        core.on_send_complete(2),
        Err(ProtocolError::UnknownWrId {
            wr_id: 2,
            outstanding: None
        })
    );
    // A local bug, not the peer's: the connection stays up.
    assert_eq!(core.write_capacity(), Err(WriteError::Shutdown));
    assert!(core.all_sent());
}

#[test]
fn invalid_params_name_the_field() {
    let good = params(Cfg::default(), Cfg::default());
    assert!(StreamCore::new(good).is_ok());
    let cases: [(&str, u64, StreamParams); 14] = [
        (
            "max_ring_len",
            100,
            StreamParams {
                max_ring_len: 100,
                ..good
            },
        ),
        (
            "max_ring_len",
            1 << 31,
            StreamParams {
                max_ring_len: 1 << 31,
                ..good
            },
        ),
        (
            "send_buf_len",
            0,
            StreamParams {
                send_buf_len: 0,
                ..good
            },
        ),
        (
            "send_buf_len",
            (1 << 30) + 1,
            StreamParams {
                send_buf_len: (1 << 30) + 1,
                ..good
            },
        ),
        (
            "ring_len",
            0,
            StreamParams {
                ring_len: 0,
                ..good
            },
        ),
        (
            "recv_depth",
            3,
            StreamParams {
                recv_depth: 3,
                ..good
            },
        ),
        (
            "recv_depth",
            1024,
            StreamParams {
                recv_depth: 1024,
                ..good
            },
        ),
        (
            "peer_ring_len",
            1 << 31,
            StreamParams {
                peer_ring_len: 1 << 31,
                ..good
            },
        ),
        (
            "peer_recv_depth",
            0,
            StreamParams {
                peer_recv_depth: 0,
                ..good
            },
        ),
        (
            "send_queue_depth",
            0,
            StreamParams {
                send_queue_depth: 0,
                ..good
            },
        ),
        (
            "signal_interval",
            0,
            StreamParams {
                signal_interval: 0,
                ..good
            },
        ),
        (
            "max_write_len",
            0,
            StreamParams {
                max_write_len: 0,
                ..good
            },
        ),
        (
            "max_write_len",
            1 << 30,
            StreamParams {
                max_write_len: 1 << 30,
                ..good
            },
        ),
        (
            "peer_ring_len",
            0,
            StreamParams {
                peer_ring_len: 0,
                ..good
            },
        ),
    ];
    for (name, value, p) in cases {
        match StreamCore::new(p) {
            Err(ProtocolError::InvalidParams {
                name: n, value: v, ..
            }) => assert_eq!((n, v), (name, value)),
            other => panic!("{name}: {other:?}"),
        }
    }
    let edge = StreamParams {
        send_buf_len: 1,
        ring_len: 1 << 30,
        max_ring_len: 1 << 30,
        recv_depth: 4,
        peer_ring_len: 1,
        peer_recv_depth: 1023,
        send_queue_depth: 1,
        inline_threshold: 0,
        signal_interval: u16::MAX,
        max_write_len: (1 << 30) - 1,
    };
    assert!(StreamCore::new(edge).is_ok());
}

// ----- conservation of credit --------------------------------------------------

impl Pair {
    /// Checks that credit is conserved in both directions, whatever is in
    /// flight: for the messages `from` sends,
    /// `credit + in flight + unreturned at the peer + returns in flight = depth`,
    /// and the same for ring bytes (with the peer's unread bytes).
    fn assert_conservation(&self) {
        for from in [A, B] {
            let (src, dst) = (&self.s[from], &self.s[1 - from]);
            let p = dst.core.params();
            let (wrs_owed, bytes_owed) = dst.core.to_return();
            let (mut wrs_back, mut bytes_back) = (0u64, 0u64);
            for w in &dst.wire {
                if let Ok(Imm::Credit { wrs, bytes }) = Imm::decode(w.t.kind.imm()) {
                    wrs_back += u64::from(wrs);
                    bytes_back += u64::from(bytes);
                }
            }
            // Byte credit is counted for the peer ring the sender writes
            // now (generation g); the receiver's share is in that ring
            // only once the SWITCH reached it.
            let g = src.core.peer_ring_generation();
            let (ring_gen, unread_now, abandoned) = dst.core.growth_view();
            let (ring_len, unread, owed) = if ring_gen == g {
                (p.ring_len, unread_now, bytes_owed + abandoned)
            } else {
                assert_eq!(ring_gen + 1, g, "side {from} writes a ring not offered");
                (p.ring_len * 2, 0, 0)
            };
            let data_in_flight: u64 = src
                .wire
                .iter()
                .map(|w| match w.t.kind {
                    TransmitKind::Data { ring, len, .. } if ring == g => u64::from(len),
                    _ => 0,
                })
                .sum();
            assert_eq!(
                u64::from(src.core.peer_wr_credit())
                    + src.wire.len() as u64
                    + u64::from(wrs_owed)
                    + wrs_back,
                u64::from(p.recv_depth),
                "WR credit of side {from}"
            );
            assert_eq!(
                u64::from(src.core.peer_bytes_credit())
                    + data_in_flight
                    + u64::from(unread)
                    + u64::from(owed)
                    + bytes_back,
                u64::from(ring_len),
                "byte credit of side {from}"
            );
        }
    }

    /// Checks the harness's own shadow of unread ring bytes against the
    /// core's count (O(ring length), so not after every step).
    fn assert_shadow(&self) {
        for side in [A, B] {
            let me = &self.s[side];
            assert_eq!(
                me.live.iter().flatten().filter(|l| **l).count(),
                me.core.readable_len(),
                "unread bytes of side {side}"
            );
        }
    }

    fn blocked_on_credit(&self, side: usize) -> bool {
        let core = &self.s[side].core;
        core.write_capacity().is_ok()
            && core.unposted_len() > 0
            && (core.peer_bytes_credit() == 0 || core.peer_wr_credit() <= CONTROL_RESERVE)
    }

    fn can_post(&self, side: usize) -> bool {
        self.s[side].core.clone().poll_transmit().is_some()
    }

    /// The no-deadlock property, checked in a quiescent state (nothing in
    /// flight, no completion pending): if a side is blocked on credit and its
    /// peer has read everything, one of the two can post something now.
    fn assert_blocked_side_can_be_unblocked(&self) {
        let quiet = self
            .s
            .iter()
            .all(|s| s.wire.is_empty() && s.completions.is_empty());
        if !quiet {
            return;
        }
        for side in [A, B] {
            if self.blocked_on_credit(side) && self.s[1 - side].core.readable_len() == 0 {
                assert!(
                    self.can_post(A) || self.can_post(B),
                    "side {side} is blocked on credit and nobody can send: {self:#?}"
                );
            }
        }
    }
}

// ----- random schedules --------------------------------------------------------

fn random_cfg(rng: &mut Rng) -> Cfg {
    Cfg {
        send_buf_len: rng.range(1, 5000) as u32,
        ring_len: rng.range(1, 5000) as u32,
        recv_depth: rng.range(4, 12) as u16,
        send_queue_depth: rng.range(1, 16) as u16,
        inline_threshold: rng.range(0, 64) as u32,
        signal_interval: rng.range(1, 8) as u16,
        max_write_len: rng.range(1, 3000) as u32,
        // A third of the rings may double twice.
        max_ring_len: rng.range(0, 3) as u32 * 10_000,
    }
}

/// Runs one random schedule; returns the pair at the end (all delivered).
fn random_schedule(seed: u64) -> Pair {
    let mut rng = Rng::new(seed);
    let (a, b) = (random_cfg(&mut rng), random_cfg(&mut rng));
    let mut pair = Pair::new(a, b);
    // Every fourth schedule opens as an iWARP initiator does.
    if seed % 4 == 0 {
        pair.s[A].core.speak_first();
    }
    let total = [rng.range(0, 20_000) as usize, rng.range(0, 20_000) as usize];
    let max_chunk = [rng.range(1, 6000) as usize, rng.range(1, 6000) as usize];
    for step in 0..4000 {
        let side = (rng.next() % 2) as usize;
        match rng.next() % 10 {
            0 | 1 => {
                let left = total[side] - pair.s[side].written;
                // An empty send buffer is sometimes swapped for one of
                // another length, as the runtime does when the peer's ring
                // grew (shorter ones too: the core takes any length).
                if pair.s[side].core.send_buf_in_use() == 0 && rng.chance(20) {
                    let len = rng.range(1, 5000) as u32;
                    assert!(pair.s[side].resize_send_buf(len), "seed {seed}");
                    pair.s[side].resizes += 1;
                }
                if left > 0 {
                    let n = rng.range(1, max_chunk[side] as u64) as usize;
                    pair.s[side].write(left.min(n));
                } else if rng.chance(30) {
                    pair.s[side].core.shutdown();
                }
            }
            2 => {
                pair.post_one(side);
            }
            3 => {
                pair.post_all(side);
            }
            4 | 5 => {
                if let Some(result) = pair.deliver(side) {
                    result.expect("valid message");
                }
            }
            6 => {
                pair.s[side].complete_one();
            }
            7 | 8 => {
                if pair.s[side].reading {
                    let n = rng.range(1, 5000) as usize;
                    pair.s[side].read_some(n);
                }
            }
            _ => {
                // Readers pause and resume.
                pair.s[side].reading = rng.chance(70);
            }
        }
        pair.assert_conservation();
        pair.assert_blocked_side_can_be_unblocked();
        if step % 500 == 0 {
            // Occasionally run everything to quiescence mid-way.
            pair.assert_shadow();
            pair.drive();
            pair.assert_shadow();
            pair.assert_conservation();
            pair.assert_blocked_side_can_be_unblocked();
        }
    }
    // Finish: readers read, writers write the rest and shut down.
    pair.s[A].reading = true;
    pair.s[B].reading = true;
    loop {
        let mut progress = pair.drive();
        for side in [A, B] {
            let left = total[side] - pair.s[side].written;
            if left > 0 {
                progress += pair.s[side].write(left);
            } else if pair.s[side].core.write_capacity().is_ok() {
                pair.s[side].core.shutdown();
                progress += 1;
            }
        }
        pair.assert_conservation();
        if progress == 0 {
            break;
        }
    }
    assert_eq!([pair.s[A].written, pair.s[B].written], total, "seed {seed}");
    pair.assert_done();
    pair
}

#[test]
fn random_schedules_deliver_every_byte_once_in_order() {
    let mut totals = StreamStats::default();
    let mut resizes = 0;
    for seed in 1..=1000 {
        let pair = random_schedule(seed);
        for side in [A, B] {
            let s = pair.s[side].core.stats();
            totals.bytes_sent += s.bytes_sent;
            totals.credit_stalls += s.credit_stalls;
            totals.send_queue_stalls += s.send_queue_stalls;
            totals.credits_sent += s.credits_sent;
            totals.rings_grown += s.rings_grown;
            totals.peer_rings_grown += s.peer_rings_grown;
            resizes += pair.s[side].resizes;
            // Every offer the peer took was switched to, but the last one
            // when the peer's FIN went before its SWITCH.
            let taken = pair.s[1 - side].core.stats().peer_rings_grown;
            assert!(
                s.rings_grown == taken || s.rings_grown + 1 == taken,
                "seed {seed}: grown {} taken {taken}",
                s.rings_grown
            );
        }
    }
    // The schedules do exercise the stalls they are meant to, and grow
    // rings (both doublings included).
    assert!(totals.credit_stalls > 1000, "{totals:?}");
    assert!(totals.send_queue_stalls > 100, "{totals:?}");
    assert!(totals.rings_grown > 100, "{totals:?}");
    assert!(resizes > 1000, "{resizes} send buffers resized");
}

#[test]
fn random_schedule_is_deterministic() {
    let a = random_schedule(7);
    let b = random_schedule(7);
    assert_eq!(a, b);
    assert_ne!(random_schedule(8).s[A].log, a.s[A].log);
}

// ----- exhaustive exploration of small configurations -------------------------

/// Explores every interleaving of the actions of both sides (write a byte,
/// shut down, post a WR, deliver a WR, complete a WR, read a byte) from a
/// fresh pair, deduplicating states. Asserts at every state that credit is
/// conserved and that a blocked side can be unblocked, and at every state
/// without a successor that the exchange is complete. Every action makes
/// progress on a bounded measure (bytes written/read, WRs posted, delivered,
/// completed), so the graph is finite and acyclic: every schedule ends, and
/// it ends with every byte delivered and both FINs received.
fn explore(a: Cfg, b: Cfg, total: [usize; 2]) -> usize {
    let start = Pair::new(a, b);
    // States are remembered by a 64-bit hash: a collision could only hide a
    // state (p < 10^-6 for these sizes), never report a false failure.
    let mut seen: HashSet<u64> = HashSet::new();
    let mut stack = vec![start];
    let mut terminal = 0;
    while let Some(pair) = stack.pop() {
        let mut hasher = std::hash::DefaultHasher::new();
        pair.hash(&mut hasher);
        if !seen.insert(hasher.finish()) {
            continue;
        }
        assert!(seen.len() < 3_000_000, "state space unexpectedly large");
        pair.assert_conservation();
        pair.assert_shadow();
        pair.assert_blocked_side_can_be_unblocked();
        let mut successors = 0;
        let mut push = |mut next: Pair| {
            for side in &mut next.s {
                side.log.clear();
                side.events.clear();
                side.core.forget_stalls();
            }
            successors += 1;
            stack.push(next);
        };
        for side in [A, B] {
            let me = &pair.s[side];
            if me.written < total[side] {
                if me.core.write_capacity() != Ok(0) {
                    let mut next = pair.clone();
                    assert_eq!(next.s[side].write(1), 1);
                    push(next);
                }
            } else if me.core.write_capacity().is_ok() {
                let mut next = pair.clone();
                next.s[side].core.shutdown();
                push(next);
            }
            let mut next = pair.clone();
            if next.post_one(side).is_some() {
                push(next);
            }
            if !me.wire.is_empty() {
                let mut next = pair.clone();
                next.deliver(side).unwrap().expect("valid message");
                push(next);
            }
            if !me.completions.is_empty() {
                let mut next = pair.clone();
                next.s[side].complete_one();
                push(next);
            }
            if me.core.readable_len() > 0 {
                let mut next = pair.clone();
                assert_eq!(next.s[side].read_some(1), 1);
                push(next);
            }
        }
        if successors == 0 {
            terminal += 1;
            assert_eq!([pair.s[A].written, pair.s[B].written], total);
            pair.assert_done();
        }
    }
    assert!(terminal >= 1);
    seen.len()
}

const TINY: Cfg = Cfg {
    send_buf_len: 2,
    ring_len: 2,
    recv_depth: 4,
    send_queue_depth: 2,
    inline_threshold: 1,
    signal_interval: 2,
    max_write_len: 2,
    max_ring_len: 0,
};

/// Ring of 1 byte: every byte is its own WR and returns its own CREDIT.
const ONE: Cfg = Cfg {
    ring_len: 1,
    ..TINY
};

#[test]
fn exhaustive_small_configurations_never_deadlock() {
    // The smallest legal receive depth (4: the reserve of 2, one for data,
    // a return threshold of 2) with 1- and 2-byte rings, so that both WR
    // credit and byte credit run out, in one and in both directions.
    let sq1 = Cfg {
        send_queue_depth: 1,
        signal_interval: 1,
        ..TINY
    };

    let cases = [
        (TINY, TINY, [1, 1], 49_992),
        (ONE, TINY, [0, 3], 19_682),
        (ONE, ONE, [4, 0], 63_760),
        (sq1, ONE, [2, 1], 57_818),
    ];
    for (a, b, total, states) in cases {
        assert_eq!(explore(a, b, total), states, "{a:?} {b:?} {total:?}");
    }
}

/// The same over larger state spaces (1.6 million states; about 30 s in a
/// release build): `cargo test --release --lib proto -- --ignored`.
#[test]
#[ignore = "slow in debug builds; run with --release -- --ignored"]
fn exhaustive_larger_configurations_never_deadlock() {
    let deep = Cfg {
        recv_depth: 5,
        ..TINY
    };
    let cases = [
        (TINY, TINY, [2, 1], 766_052),
        (TINY, TINY, [3, 0], 183_518),
        (ONE, ONE, [2, 1], 238_154),
        (ONE, TINY, [3, 0], 183_518),
        (deep, ONE, [2, 1], 260_962),
    ];
    for (a, b, total, states) in cases {
        assert_eq!(explore(a, b, total), states, "{a:?} {b:?} {total:?}");
    }
}

// ----- arbitrary peer input ----------------------------------------------------

/// A peer sending arbitrary immediates, valid-looking or not: every one is
/// either accepted with the core's bookkeeping staying in range, or rejected
/// with an error after which the core is aborted with that error's code and
/// rejects or ignores nothing silently.
#[test]
fn arbitrary_immediates_are_accepted_or_rejected_with_the_right_abort() {
    let mut rejected_by_kind = [0u32; 12];
    for seed in 1..=2000 {
        let mut rng = Rng::new(seed);
        let ring_len = rng.range(1, 300) as u32;
        let depth = rng.range(4, 10) as u16;
        let mut core = lone(ring_len, depth);
        core.accept_write(rng.range(0, 500) as usize);
        let mut first_error: Option<ProtocolError> = None;
        for _ in 0..rng.range(1, 60) {
            // Mostly plausible DATA, so that overruns get their turn.
            let imm = match rng.next() % 20 {
                0..=13 => rng.range(0, u64::from(ring_len) / 3 + 1) as u32,
                14 | 15 => Imm::Credit {
                    wrs: rng.range(0, 2) as u16,
                    bytes: rng.range(0, 100) as u32,
                }
                .encode(),
                16 => (0b10 << 30) | (rng.chance(80) as u32 * rng.range(0, 4) as u32),
                17 => (0b11 << 30) | rng.range(0, 5) as u32,
                _ => rng.next() as u32,
            };
            let result = core.on_recv(imm);
            if let (Err(err), None) = (&result, &first_error) {
                rejected_by_kind[err.abort_code() as usize] += 1;
                first_error = Some(err.clone());
            }
            if let Some(err) = &first_error {
                assert!(core.is_aborted());
                assert_eq!(core.write_capacity(), Err(WriteError::Aborted));
                if core.peer_abort_code().is_none() {
                    assert_eq!(core.local_abort_code(), Some(err.abort_code()));
                }
            }
            let p = *core.params();
            assert!(core.readable_len() <= ring_len as usize);
            assert!(core.peer_wr_credit() <= p.peer_recv_depth);
            assert!(core.peer_bytes_credit() <= p.peer_ring_len);
            let (wrs, bytes) = core.to_return();
            assert!(wrs <= depth);
            assert!(core.readable_len() as u64 + u64::from(bytes) <= u64::from(ring_len));
            if rng.chance(30) {
                let n = rng.range(0, core.readable_len() as u64) as usize;
                core.consume(n);
            }
            // Sometimes this side returns no credit for a while.
            while rng.chance(60) {
                let Some(t) = core.poll_transmit() else { break };
                if t.signaled {
                    core.on_send_complete(t.wr_id).unwrap();
                }
            }
        }
    }
    // Every kind of peer error was produced and caught.
    for (code, count) in rejected_by_kind.iter().enumerate().take(9).skip(1) {
        assert!(
            *count > 0,
            "no error with abort code {code}: {rejected_by_kind:?}"
        );
    }
}

// ----- ring growth ---------------------------------------------------------------

#[test]
fn a_ring_that_fills_and_empties_doubles_up_to_its_max() {
    let b = Cfg {
        ring_len: 100,
        max_ring_len: 400,
        ..Cfg::default()
    };
    let mut pair = Pair::new(Cfg::default(), b);
    let mut lens = Vec::new();
    for round in 0..12 {
        // Each write fills B's ring; B's reader empties it.
        let len = pair.s[B].core.params().ring_len as usize;
        assert_eq!(pair.s[A].write(len), len, "round {round}");
        pair.drive();
        lens.push(pair.s[B].core.params().ring_len);
    }
    // Four fill cycles per doubling; then the max holds.
    assert_eq!(
        lens,
        [100, 100, 100, 200, 200, 200, 200, 400, 400, 400, 400, 400]
    );
    assert_eq!(pair.s[B].core.stats().rings_grown, 2);
    assert_eq!(pair.s[A].core.stats().peer_rings_grown, 2);
    assert_eq!(pair.s[A].core.params().peer_ring_len, 400);
    assert_eq!(pair.s[B].core.ring_generation(), 2);
    assert_eq!(pair.s[B].core.oldest_ring(), 2);
    let grants: Vec<Imm> = pair
        .controls(B)
        .into_iter()
        .filter(|c| matches!(c, Imm::Grant { .. }))
        .collect();
    let chunks = |g| crate::proto::imm::grant_chunks(fake_ring(B, g).0, fake_ring(B, g).1);
    let expected: Vec<Imm> = [chunks(1), chunks(2)]
        .iter()
        .flat_map(|c| {
            (0..4).map(|i| Imm::Grant {
                index: i as u8,
                bits: c[i],
            })
        })
        .collect();
    assert_eq!(grants, expected);
    let switches = pair
        .controls(A)
        .into_iter()
        .filter(|c| *c == Imm::Switch)
        .count();
    assert_eq!(switches, 2);
    let offers: Vec<RecvEvent> = pair.s[A]
        .events
        .iter()
        .copied()
        .filter(|e| matches!(e, RecvEvent::Grant { .. }))
        .collect();
    assert_eq!(
        offers,
        [
            RecvEvent::Grant {
                addr: fake_ring(B, 1).0,
                rkey: fake_ring(B, 1).1,
                len: 200
            },
            RecvEvent::Grant {
                addr: fake_ring(B, 2).0,
                rkey: fake_ring(B, 2).1,
                len: 400
            },
        ]
    );
    // Every byte arrived once, in order (checked by read_some), and the
    // new rings' data landed at their start.
    assert_eq!(pair.s[B].read, pair.s[A].written);
    assert_eq!(pair.s[A].written, 100 * 4 + 200 * 4 + 400 * 4);
    pair.s[A].core.shutdown();
    pair.s[B].core.shutdown();
    pair.drive();
    pair.assert_done();
}

#[test]
fn bytes_left_in_the_old_ring_are_read_before_the_new_rings() {
    let b = Cfg {
        ring_len: 100,
        max_ring_len: 200,
        ..Cfg::default()
    };
    let mut pair = Pair::new(Cfg::default(), b);
    for _ in 0..3 {
        pair.s[A].write(100);
        pair.drive();
    }
    // The fourth fill: B reads only part of it, so no offer yet.
    pair.s[B].reading = false;
    pair.s[A].write(100);
    pair.drive();
    assert_eq!(pair.s[B].read_some(100), 100);
    assert_eq!(pair.s[B].core.ring_wanted(), Some(200));
    // The offer goes out and is taken; B's reader pauses while A writes
    // into the old ring's freed space and, after the SWITCH, the new one.
    pair.s[A].write(150);
    pair.drive();
    assert_eq!(pair.s[B].core.ring_generation(), 1);
    assert_eq!(pair.s[B].core.readable_len(), 150);
    assert_eq!(pair.s[B].core.readable_generation(), 1);
    assert_eq!(pair.s[B].core.oldest_ring(), 1);
    assert_eq!(pair.s[B].read_some(150), 150);
    assert_eq!(pair.s[B].read, pair.s[A].written);
}

#[test]
fn ring_growth_out_of_turn_is_a_protocol_error() {
    let chunk = |index: u8| Imm::Grant { index, bits: 7 }.encode();
    let cases: [(&[u32], &str); 3] = [
        (&[Imm::Switch.encode()], "SWITCH without a ring offer"),
        (&[chunk(0), chunk(2)], "GRANT chunk out of order"),
        (
            &[chunk(0), chunk(1), chunk(2), chunk(3), chunk(0)],
            "a new ring offer before the last one was taken",
        ),
    ];
    for (imms, reason) in cases {
        let mut core = lone(100, 8);
        let (last, first) = imms.split_last().unwrap();
        for imm in first {
            assert!(core.on_recv(*imm).is_ok(), "{reason}");
        }
        let err = core.on_recv(*last).unwrap_err();
        assert_eq!(err, ProtocolError::RingGrowth { reason }, "{reason}");
        assert_eq!(err.abort_code(), 11);
        assert_aborted_with(&mut core, &err);
    }
    // An offer whose ring would end past 2^64.
    let mut core = lone(100, 8);
    let top = crate::proto::imm::grant_chunks(u64::MAX - 1000, 7);
    for (index, bits) in top.iter().take(3).enumerate() {
        let index = index as u8;
        let imm = Imm::Grant { index, bits: *bits }.encode();
        assert_eq!(core.on_recv(imm), Ok(RecvEvent::GrantChunk { index }));
    }
    let last = Imm::Grant {
        index: 3,
        bits: top[3],
    };
    let err = core.on_recv(last.encode()).unwrap_err();
    assert_eq!(
        err,
        ProtocolError::RingGrowth {
            reason: "a ring offer whose address range passes 2^64"
        }
    );
    assert_aborted_with(&mut core, &err);
    // An offer would double a peer ring of 2^30 bytes, the largest.
    let peer = Cfg {
        ring_len: 1 << 30,
        ..Cfg::default()
    };
    let mut core = StreamCore::new(params(Cfg::default(), peer)).unwrap();
    for index in 0..3 {
        assert_eq!(
            core.on_recv(chunk(index)),
            Ok(RecvEvent::GrantChunk { index })
        );
    }
    assert_eq!(
        core.on_recv(chunk(3)),
        Err(ProtocolError::RingGrowth {
            reason: "a ring offer beyond the largest ring (2^30 bytes)"
        })
    );
}
