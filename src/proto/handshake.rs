//! The connection handshake carried in rdma_cm private data.
//!
//! The client sends a [`Hello`] in the `CONNECT_REQUEST` private data and the
//! server answers with its own [`Hello`] in the `ESTABLISHED`/accept private
//! data. Each side learns where the other's receive ring lives (virtual
//! address, rkey, length in bytes) and how many receive work requests (WRs)
//! the other keeps posted. A server that refuses a request answers with
//! [`encode_reject`] in the `rdma_reject` private data, which the client
//! reads back with [`decode_reject`].
//!
//! # Wire layout of [`Hello`] (big-endian, [`HELLO_LEN`] = 32 bytes)
//!
//! | offset | size | field        | value                                              |
//! |-------:|-----:|--------------|----------------------------------------------------|
//! | 0      | 4    | magic        | [`MAGIC`] = `0x544B_5244` (`"TKRD"`)               |
//! | 4      | 2    | version      | [`VERSION`] = 12                                   |
//! | 6      | 1    | kind         | [`EndpointKind`]: 1 = byte stream, 2 = message     |
//! | 7      | 1    | flags        | the sender's missing [`Capabilities`]: bit 0 no immediate data, bit 1 no memory windows, bit 2 no atomics; bits 3..7 0 (ignored on receipt) |
//! | 8      | 8    | ring_addr    | byte stream: virtual address of the sender's receive ring; message endpoint: `max_message_len`, bytes, `1..=2^48` |
//! | 16     | 4    | ring_rkey    | byte stream: the key of the ring's memory window (bound on the sender's QP only); message endpoint: 0 |
//! | 20     | 4    | ring_len     | ring length in bytes, `1..=`[`MAX_RING_LEN`] (message endpoint: its receive buffers' length) |
//! | 24     | 2    | recv_depth   | receive WRs kept posted, [`MIN_RECV_DEPTH`]`..=`[`MAX_RECV_DEPTH`] |
//! | 26     | 2    | max_rendezvous_in_flight | message endpoint: rendezvous the sender accepts outstanding, at least 1; byte stream: 0 (ignored) |
//! | 28     | 1    | path_mtu     | the largest path MTU the sender's port carries, as `ibv_mtu` codes it: 1..=5 for 256, 512, 1024, 2048, 4096 bytes; 0 where the transport has none (iWARP: TCP segments) |
//! | 29     | 3    | reserved     | 0 (ignored on receipt)                             |
//!
//! Capabilities are announced as what the sender's device lacks, so 0 is
//! a full InfiniBand/RoCE device. Both sides must agree on immediate data
//! (a stream's every message carries a 32-bit immediate, as RDMA WRITE WITH
//! IMM or, without immediate data, in a 4-byte SEND: the two cannot be
//! mixed; on real links they never differ, since iWARP talks only to
//! iWARP): [`Hello::expect_compatible`] refuses a mismatch. Windows and
//! atomics are the sender's own business and its peer's information.
//!
//! Limits that bind both sides are agreed here: a message endpoint uses the
//! smaller of the two `max_message_len` and `max_rendezvous_in_flight`
//! values, so a sender never exceeds what the receiver accepts (a `send`
//! above the agreed length fails locally with `InvalidInput`).
//!
//! So is the path MTU, the RDMA payload of every packet but a message's
//! last: InfiniBand and RoCE require the first and middle packets of a
//! message to carry exactly the responder QP's path MTU (IBTA vol. 1,
//! 9.7.6.1.2 C9-86), so both QPs of a connection must use the same one, and
//! a RoCE packet larger than either host's netdev MTU does not cross the
//! wire. rdma_cm gives the passive side the active side's path MTU (the
//! active host's netdev MTU, in the connect request), which can exceed what
//! the passive host sends or receives; each side therefore announces its
//! port's active MTU and both use [`agree_path_mtu`]: the smallest of the
//! two and rdma_cm's.
//!
//! rdma_cm pads private data with zeros up to the transport's limit (56 bytes
//! for a RoCE/IB `CONNECT_REQUEST`), so bytes after the first 32 are ignored.
//!
//! # Wire layout of a reject (big-endian, [`REJECT_LEN`] = 8 bytes)
//!
//! magic u32 | version u16 (the rejecting side's) | reason u8 ([`RejectReason`]) | reserved u8 (0).

use std::fmt;

/// `"TKRD"`: the first four bytes of every [`Hello`] and reject message.
pub const MAGIC: u32 = 0x544B_5244;

/// The protocol version this crate speaks (and the only one it accepts).
/// Version 2 added the message endpoint's limits and keys the stream ring by
/// a memory window; version 3 makes a message endpoint post only
/// `min(recv_depth, 15)` receive buffers at first, so its peer's initial
/// credit is that, not `recv_depth`
/// ([`initial_recv_posted`](crate::proto::message::initial_recv_posted));
/// version 4 adds the message endpoint's CLOSE
/// ([`MsgImm::Close`](crate::proto::message::MsgImm::Close)), so a peer's
/// close is told from a lost connection; version 5 posts every WR that
/// consumes a receive WR at the peer (stream data and control, message
/// SENDs) with the solicited-event bit, so a receiver may arm its CQ for
/// solicited completions only and its own send completions wake nobody;
/// version 6 lets a byte stream's receive ring grow (the GRANT and SWITCH
/// messages, [`Imm::Grant`](crate::proto::imm::Imm::Grant)); version 7
/// returns a message endpoint's credit with its EAGER messages (the
/// immediate's low bits, [`MsgImm::Eager`](crate::proto::message::MsgImm::Eager));
/// version 8 posts a message endpoint's CREDIT without the solicited-event
/// bit (a peer that waits for credit arms its CQ for every completion:
/// [`MessageCore::credit_low`](crate::proto::message::MessageCore::credit_low));
/// version 9 announces the sender's missing [`Capabilities`] in the flags
/// byte (iWARP: no immediate data, no windows, no atomics); version 10
/// lets an iWARP initiator open with an empty CREDIT (a message
/// endpoint's CREDIT of 0 is valid: MPA's initiator sends the first
/// frame, [`MessageCore::speak_first`](crate::proto::message::MessageCore::speak_first));
/// version 11 adds a message endpoint's NOTIFY (immediate type `110`: an
/// RDMA WRITE WITH IMMEDIATE into a grant,
/// [`MsgImm::Notify`](crate::proto::message::MsgImm::Notify)); version 12
/// announces the sender's port MTU ([`Hello::path_mtu`]) and both sides use
/// the smaller ([`agree_path_mtu`]).
pub const VERSION: u16 = 12;

/// What the sender's device offers, announced in a [`Hello`]'s flags byte
/// as what it lacks (bit 0 no immediate data, bit 1 no memory windows,
/// bit 2 no atomics), so [`Capabilities::FULL`] encodes as 0.
///
/// InfiniBand and RoCE devices have immediate data; iWARP (RFC 5040) has
/// none, and Soft-iWARP (`siw`) has neither memory windows nor atomics
/// (`ibv_devinfo -v`: `max_mw` 0, `ATOMIC_NONE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// RDMA WRITE WITH IMM and SEND WITH IMM. Both sides must agree
    /// ([`Hello::expect_compatible`]).
    pub immediate_data: bool,
    /// Type-2 memory windows (`max_mw > 0`).
    pub memory_windows: bool,
    /// RDMA atomics (compare-and-swap, fetch-and-add) executed on the
    /// sender's memory.
    pub atomics: bool,
}

impl Capabilities {
    /// Everything an InfiniBand or RoCE device offers: flags byte 0.
    pub const FULL: Capabilities = Capabilities {
        immediate_data: true,
        memory_windows: true,
        atomics: true,
    };

    const NO_IMMEDIATE: u8 = 1 << 0;
    const NO_WINDOWS: u8 = 1 << 1;
    const NO_ATOMICS: u8 = 1 << 2;

    /// The flags byte of a [`Hello`]: one bit per missing capability.
    pub fn to_flags(self) -> u8 {
        let mut f = 0;
        if !self.immediate_data {
            f |= Self::NO_IMMEDIATE;
        }
        if !self.memory_windows {
            f |= Self::NO_WINDOWS;
        }
        if !self.atomics {
            f |= Self::NO_ATOMICS;
        }
        f
    }

    /// Reads a flags byte; bits 3..7 are ignored (reserved for later
    /// capabilities, which an older peer then reports as present).
    pub fn from_flags(flags: u8) -> Capabilities {
        Capabilities {
            immediate_data: flags & Self::NO_IMMEDIATE == 0,
            memory_windows: flags & Self::NO_WINDOWS == 0,
            atomics: flags & Self::NO_ATOMICS == 0,
        }
    }
}

impl Default for Capabilities {
    /// [`Capabilities::FULL`].
    fn default() -> Self {
        Capabilities::FULL
    }
}

/// Length in bytes of an encoded [`Hello`].
pub const HELLO_LEN: usize = 32;

/// Length in bytes of an encoded reject message ([`encode_reject`]).
pub const REJECT_LEN: usize = 8;

/// Largest receive ring a peer may advertise: 1 GiB (2^30 bytes).
///
/// A DATA immediate carries at most 2^30 - 1 bytes, and ring offsets must fit
/// in a `u32`; 1 GiB keeps every ring offset and length comfortably in range.
pub const MAX_RING_LEN: u32 = 1 << 30;

/// Smallest `recv_depth` a peer may advertise: 4 receive WRs.
///
/// Two receive WRs are held back for control messages
/// ([`CONTROL_RESERVE`](crate::proto::stream::CONTROL_RESERVE)), data needs at
/// least one more, and the credit-return threshold must be at least 2 for the
/// credit exchange to terminate (see the deadlock argument in
/// [`stream`](crate::proto::stream)); 4 is the smallest depth for which all
/// of these hold.
pub const MIN_RECV_DEPTH: u16 = 4;

/// Largest `recv_depth` a peer may advertise: 1023 receive WRs, the most a
/// single CREDIT immediate can return (10 bits).
pub const MAX_RECV_DEPTH: u16 = 1023;

/// What kind of endpoint sent a [`Hello`]. Both ends of a connection must be
/// the same kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum EndpointKind {
    /// A byte stream (`RdmaStream`), wire value 1.
    ByteStream = 1,
    /// A zero-copy message endpoint, wire value 2.
    Message = 2,
}

impl EndpointKind {
    /// The wire value (1 or 2).
    pub fn to_u8(self) -> u8 {
        self as u8
    }

    /// Parses a wire value; `None` for anything but 1 or 2.
    pub fn from_u8(value: u8) -> Option<Self> {
        match value {
            1 => Some(EndpointKind::ByteStream),
            2 => Some(EndpointKind::Message),
            _ => None,
        }
    }
}

impl fmt::Display for EndpointKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndpointKind::ByteStream => f.write_str("byte stream"),
            EndpointKind::Message => f.write_str("message endpoint"),
        }
    }
}

/// One side's half of the handshake: where its receive ring is and how many
/// receive WRs it keeps posted.
///
/// Encoded with [`Hello::encode`] into exactly [`HELLO_LEN`] (32) bytes, and
/// decoded (with validation) by [`Hello::decode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Hello {
    /// The kind of endpoint (byte stream or message endpoint).
    pub kind: EndpointKind,
    /// Virtual address of the sender's registered receive ring (the address
    /// the peer uses in its RDMA WRITEs).
    pub ring_addr: u64,
    /// rkey of the memory region that holds the ring.
    pub ring_rkey: u32,
    /// Length of the ring in bytes, `1..=`[`MAX_RING_LEN`].
    pub ring_len: u32,
    /// Number of receive WRs the sender keeps posted,
    /// [`MIN_RECV_DEPTH`]`..=`[`MAX_RECV_DEPTH`].
    pub recv_depth: u16,
    /// Message endpoint: the largest message it accepts, bytes (0 for a
    /// byte stream).
    pub max_message_len: u64,
    /// Message endpoint: the rendezvous it accepts outstanding (0 for a
    /// byte stream).
    pub max_rendezvous_in_flight: u16,
    /// What the sender's device offers (the flags byte).
    pub caps: Capabilities,
    /// The largest path MTU the sender's port carries, bytes: 256, 512,
    /// 1024, 2048 or 4096 (its `active_mtu`); 0 where the transport has no
    /// path MTU (iWARP).
    pub path_mtu: u32,
}

/// The `ibv_mtu` code of a path MTU in bytes (256 → 1, ..., 4096 → 5), 0
/// for 0; `None` for any other length.
pub fn mtu_code(bytes: u32) -> Option<u8> {
    match bytes {
        0 => Some(0),
        256 => Some(1),
        512 => Some(2),
        1024 => Some(3),
        2048 => Some(4),
        4096 => Some(5),
        _ => None,
    }
}

/// The path MTU in bytes of an `ibv_mtu` code (1 → 256, ..., 5 → 4096), 0
/// for 0; `None` for codes above 5.
pub fn mtu_bytes(code: u8) -> Option<u32> {
    match code {
        0 => Some(0),
        1..=5 => Some(128 << code),
        _ => None,
    }
}

/// The path MTU both QPs of a connection use, bytes: the smallest of
/// rdma_cm's (`route`: the active host's, from its path record), this
/// side's port `active_mtu` and the peer's announced
/// [`Hello::path_mtu`], leaving out those that are 0 (not known); 0 if all
/// are. Both sides compute the same value from the same three numbers.
pub fn agree_path_mtu(route: u32, ours: u32, peer: u32) -> u32 {
    [route, ours, peer]
        .into_iter()
        .filter(|&m| m != 0)
        .min()
        .unwrap_or(0)
}

impl Hello {
    /// Encodes into the 32-byte big-endian layout described in the
    /// [module docs](self). Does not validate: a `Hello` with a zero
    /// `ring_len` encodes fine and is rejected by the peer's
    /// [`decode`](Hello::decode).
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&VERSION.to_be_bytes());
        out[6] = self.kind.to_u8();
        out[7] = self.caps.to_flags();
        let addr_or_len = match self.kind {
            EndpointKind::ByteStream => self.ring_addr,
            EndpointKind::Message => self.max_message_len,
        };
        out[8..16].copy_from_slice(&addr_or_len.to_be_bytes());
        out[16..20].copy_from_slice(&self.ring_rkey.to_be_bytes());
        out[20..24].copy_from_slice(&self.ring_len.to_be_bytes());
        out[24..26].copy_from_slice(&self.recv_depth.to_be_bytes());
        if self.kind == EndpointKind::Message {
            out[26..28].copy_from_slice(&self.max_rendezvous_in_flight.to_be_bytes());
        }
        // A length that is no MTU announces none (the peer then keeps
        // rdma_cm's); `Hello`s are built from the port's `active_mtu`.
        out[28] = mtu_code(self.path_mtu).unwrap_or(0);
        // 29..32 reserved, zero.
        out
    }

    /// Decodes and validates a `Hello` from rdma_cm private data.
    ///
    /// `bytes` must hold at least [`HELLO_LEN`] bytes; anything after them
    /// (rdma_cm's zero padding) is ignored, as are the reserved field and
    /// the flags' reserved bits.
    ///
    /// # Errors
    ///
    /// Checked in this order:
    /// - [`HandshakeError::Truncated`] if `bytes.len() < 32`;
    /// - [`HandshakeError::BadMagic`] if the first four bytes are not [`MAGIC`];
    /// - [`HandshakeError::UnsupportedVersion`] if the version is not [`VERSION`];
    /// - [`HandshakeError::UnknownKind`] if the kind byte is not 1 or 2;
    /// - [`HandshakeError::InvalidRing`] if `ring_len` is 0 or above
    ///   [`MAX_RING_LEN`], or `recv_depth` is outside
    ///   [`MIN_RECV_DEPTH`]`..=`[`MAX_RECV_DEPTH`];
    /// - [`HandshakeError::InvalidPathMtu`] if the path MTU code is above 5.
    ///
    /// Whether the kind is the one the receiver expects is checked separately
    /// by [`Hello::expect_kind`].
    pub fn decode(bytes: &[u8]) -> Result<Hello, HandshakeError> {
        let Some(b) = bytes.first_chunk::<HELLO_LEN>() else {
            return Err(HandshakeError::Truncated { len: bytes.len() });
        };
        let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        if magic != MAGIC {
            return Err(HandshakeError::BadMagic { found: magic });
        }
        let version = u16::from_be_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(HandshakeError::UnsupportedVersion {
                found: version,
                supported: VERSION,
            });
        }
        let kind =
            EndpointKind::from_u8(b[6]).ok_or(HandshakeError::UnknownKind { found: b[6] })?;
        let ring_addr = u64::from_be_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
        let ring_rkey = u32::from_be_bytes([b[16], b[17], b[18], b[19]]);
        let ring_len = u32::from_be_bytes([b[20], b[21], b[22], b[23]]);
        let recv_depth = u16::from_be_bytes([b[24], b[25]]);
        if ring_len == 0 {
            return Err(HandshakeError::InvalidRing {
                reason: "ring_len is 0",
            });
        }
        if ring_len > MAX_RING_LEN {
            return Err(HandshakeError::InvalidRing {
                reason: "ring_len is larger than 1 GiB",
            });
        }
        if recv_depth < MIN_RECV_DEPTH {
            return Err(HandshakeError::InvalidRing {
                reason: "recv_depth is below 4",
            });
        }
        if recv_depth > MAX_RECV_DEPTH {
            return Err(HandshakeError::InvalidRing {
                reason: "recv_depth is above 1023",
            });
        }
        let (ring_addr, max_message_len, max_rendezvous_in_flight) = match kind {
            EndpointKind::ByteStream => (ring_addr, 0, 0),
            EndpointKind::Message => {
                let rdv = u16::from_be_bytes([b[26], b[27]]);
                if ring_addr == 0 {
                    return Err(HandshakeError::InvalidRing {
                        reason: "max_message_len is 0",
                    });
                }
                if rdv == 0 {
                    return Err(HandshakeError::InvalidRing {
                        reason: "max_rendezvous_in_flight is 0",
                    });
                }
                (0, ring_addr, rdv)
            }
        };
        let path_mtu = mtu_bytes(b[28]).ok_or(HandshakeError::InvalidPathMtu { found: b[28] })?;
        Ok(Hello {
            kind,
            ring_addr,
            ring_rkey,
            ring_len,
            recv_depth,
            max_message_len,
            max_rendezvous_in_flight,
            caps: Capabilities::from_flags(b[7]),
            path_mtu,
        })
    }

    /// Returns `self` (the peer's) if a connection between it and `ours`
    /// can carry the protocol: both with immediate data, or both without.
    ///
    /// # Errors
    ///
    /// [`HandshakeError::ImmediateDataMismatch`] otherwise.
    pub fn expect_compatible(self, ours: &Hello) -> Result<Hello, HandshakeError> {
        if self.caps.immediate_data == ours.caps.immediate_data {
            Ok(self)
        } else {
            Err(HandshakeError::ImmediateDataMismatch {
                ours: ours.caps.immediate_data,
                peer: self.caps.immediate_data,
            })
        }
    }

    /// Returns `self` if its kind is `expected`.
    ///
    /// # Errors
    ///
    /// [`HandshakeError::WrongKind`] if a byte stream met a message endpoint
    /// or the other way round.
    pub fn expect_kind(self, expected: EndpointKind) -> Result<Hello, HandshakeError> {
        if self.kind == expected {
            Ok(self)
        } else {
            Err(HandshakeError::WrongKind {
                expected,
                found: self.kind,
            })
        }
    }
}

/// Why a `Hello` could not be accepted.
///
/// Each variant maps onto the [`RejectReason`] a server sends back
/// ([`HandshakeError::reject_reason`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The private data held fewer than `HELLO_LEN` (32) bytes.
    #[error("handshake truncated: {len} bytes of private data, need {HELLO_LEN}")]
    Truncated {
        /// Number of bytes received.
        len: usize,
    },
    /// The first four bytes were not `MAGIC`: the peer is not tokio-rdma.
    #[error(
        "handshake has bad magic {found:#010x}, expected {MAGIC:#010x} (\"TKRD\"): peer is not tokio-rdma"
    )]
    BadMagic {
        /// The four bytes found, as a big-endian `u32`.
        found: u32,
    },
    /// The peer speaks a protocol version this crate does not.
    #[error("peer speaks tokio-rdma protocol version {found}, this side supports {supported}")]
    UnsupportedVersion {
        /// The peer's version.
        found: u16,
        /// The version this side speaks (`VERSION`).
        supported: u16,
    },
    /// The kind byte is neither 1 (byte stream) nor 2 (message endpoint).
    #[error("handshake has unknown endpoint kind {found}")]
    UnknownKind {
        /// The kind byte found.
        found: u8,
    },
    /// The peer is a valid endpoint of the other kind (for example a message
    /// endpoint dialled a byte-stream listener).
    #[error("peer is a {found}, this side is a {expected}")]
    WrongKind {
        /// The kind this side is.
        expected: EndpointKind,
        /// The kind the peer announced.
        found: EndpointKind,
    },
    /// The advertised ring length or receive depth is out of range.
    #[error("handshake advertises an invalid receive ring: {reason}")]
    InvalidRing {
        /// Which limit was violated.
        reason: &'static str,
    },
    /// The path MTU byte is not an `ibv_mtu` code (0..=5).
    #[error("handshake announces path MTU code {found}, expected 0..=5")]
    InvalidPathMtu {
        /// The byte found.
        found: u8,
    },
    /// One side's device carries immediate data and the other's does not
    /// (an iWARP device met an InfiniBand/RoCE one, which real links never
    /// join): the stream's messages cannot be exchanged.
    #[error(
        "this side's device {} immediate data and the peer's {}: no common transport",
        if *ours { "has" } else { "lacks" },
        if *peer { "has" } else { "lacks" }
    )]
    ImmediateDataMismatch {
        /// Whether this side's device has immediate data.
        ours: bool,
        /// Whether the peer's device has it.
        peer: bool,
    },
}

impl HandshakeError {
    /// The reason a server puts in its reject message for this error:
    /// `Truncated`, `InvalidRing` and `InvalidPathMtu` →
    /// [`RejectReason::Malformed`],
    /// `BadMagic` → [`RejectReason::BadMagic`], `UnsupportedVersion` →
    /// [`RejectReason::UnsupportedVersion`], `UnknownKind` and `WrongKind` →
    /// [`RejectReason::WrongKind`], `ImmediateDataMismatch` →
    /// [`RejectReason::Incompatible`].
    pub fn reject_reason(&self) -> RejectReason {
        match self {
            HandshakeError::Truncated { .. }
            | HandshakeError::InvalidRing { .. }
            | HandshakeError::InvalidPathMtu { .. } => RejectReason::Malformed,
            HandshakeError::BadMagic { .. } => RejectReason::BadMagic,
            HandshakeError::UnsupportedVersion { .. } => RejectReason::UnsupportedVersion,
            HandshakeError::UnknownKind { .. } | HandshakeError::WrongKind { .. } => {
                RejectReason::WrongKind
            }
            HandshakeError::ImmediateDataMismatch { .. } => RejectReason::Incompatible,
        }
    }
}

impl From<&HandshakeError> for RejectReason {
    fn from(err: &HandshakeError) -> Self {
        err.reject_reason()
    }
}

/// Why a server rejected a connection request; carried in the
/// `rdma_reject` private data (`encode_reject`, `decode_reject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectReason {
    /// The request's magic was wrong (wire code 1).
    BadMagic,
    /// The request's protocol version is not supported (wire code 2); the
    /// reject carries the server's version.
    UnsupportedVersion,
    /// The request was truncated or advertised an invalid ring (wire code 3).
    Malformed,
    /// The request came from the other kind of endpoint (wire code 4).
    WrongKind,
    /// The server could not allocate the connection's resources: ring,
    /// queue pair, memory registration (wire code 5).
    ServerResources,
    /// The two devices' capabilities cannot carry the protocol together:
    /// one has immediate data and the other not (wire code 6).
    Incompatible,
    /// A code this version does not know, from a newer peer.
    Unknown(u8),
}

impl RejectReason {
    /// The wire code (1..=6, or the unknown code itself).
    pub fn code(self) -> u8 {
        match self {
            RejectReason::BadMagic => 1,
            RejectReason::UnsupportedVersion => 2,
            RejectReason::Malformed => 3,
            RejectReason::WrongKind => 4,
            RejectReason::ServerResources => 5,
            RejectReason::Incompatible => 6,
            RejectReason::Unknown(code) => code,
        }
    }

    /// Parses a wire code; codes other than 1..=6 become
    /// [`RejectReason::Unknown`].
    pub fn from_code(code: u8) -> RejectReason {
        match code {
            1 => RejectReason::BadMagic,
            2 => RejectReason::UnsupportedVersion,
            3 => RejectReason::Malformed,
            4 => RejectReason::WrongKind,
            5 => RejectReason::ServerResources,
            6 => RejectReason::Incompatible,
            other => RejectReason::Unknown(other),
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::BadMagic => f.write_str("bad magic (not a tokio-rdma request)"),
            RejectReason::UnsupportedVersion => f.write_str("unsupported protocol version"),
            RejectReason::Malformed => f.write_str("malformed or truncated handshake"),
            RejectReason::WrongKind => f.write_str("wrong endpoint kind"),
            RejectReason::ServerResources => f.write_str("server out of resources"),
            RejectReason::Incompatible => {
                f.write_str("incompatible devices (immediate data on one side only)")
            }
            RejectReason::Unknown(code) => write!(f, "unknown reason code {code}"),
        }
    }
}

/// Encodes a reject message: [`MAGIC`] u32 | [`VERSION`] u16 | reason code u8
/// | 0 u8, big-endian, [`REJECT_LEN`] (8) bytes.
pub fn encode_reject(reason: RejectReason) -> [u8; REJECT_LEN] {
    let mut out = [0u8; REJECT_LEN];
    out[0..4].copy_from_slice(&MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&VERSION.to_be_bytes());
    out[6] = reason.code();
    out
}

/// Decodes the private data of an rdma_cm `REJECTED` event.
///
/// Returns the rejecting side's protocol version and its reason, or `None`
/// if the data is shorter than [`REJECT_LEN`] bytes or does not start with
/// [`MAGIC`] (a reject from the IB CM itself or from a non-tokio-rdma
/// server, for example "no listener on that port"). Trailing bytes are
/// ignored.
pub fn decode_reject(bytes: &[u8]) -> Option<(u16, RejectReason)> {
    let b = bytes.first_chunk::<REJECT_LEN>()?;
    if u32::from_be_bytes([b[0], b[1], b[2], b[3]]) != MAGIC {
        return None;
    }
    let version = u16::from_be_bytes([b[4], b[5]]);
    Some((version, RejectReason::from_code(b[6])))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Hello {
        Hello {
            kind: EndpointKind::ByteStream,
            ring_addr: 0x0102_0304_0506_0708,
            ring_rkey: 0x1122_3344,
            ring_len: 4099,
            recv_depth: 64,
            max_message_len: 0,
            max_rendezvous_in_flight: 0,
            caps: Capabilities::FULL,
            path_mtu: 1024,
        }
    }

    fn sample_message() -> Hello {
        Hello {
            kind: EndpointKind::Message,
            ring_addr: 0,
            ring_rkey: 0,
            ring_len: 4096,
            recv_depth: 128,
            max_message_len: 128 << 20,
            max_rendezvous_in_flight: 8,
            caps: Capabilities::FULL,
            path_mtu: 4096,
        }
    }

    #[test]
    fn hello_encodes_exact_bytes() {
        let bytes = sample().encode();
        assert_eq!(
            bytes,
            [
                0x54, 0x4B, 0x52, 0x44, // magic "TKRD"
                0x00, 0x0C, // version
                0x01, // kind
                0x00, // flags
                0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // ring_addr
                0x11, 0x22, 0x33, 0x44, // rkey
                0x00, 0x00, 0x10, 0x03, // ring_len 4099
                0x00, 0x40, // recv_depth 64
                0x00, 0x00, // max_rendezvous_in_flight (byte stream: 0)
                0x03, // path_mtu 1024
                0x00, 0x00, 0x00, // reserved
            ]
        );
        assert_eq!(&bytes[0..4], b"TKRD");
        let m = sample_message().encode();
        assert_eq!(&m[8..16], &(128u64 << 20).to_be_bytes(), "max_message_len");
        assert_eq!(&m[26..28], &[0x00, 0x08], "max_rendezvous_in_flight");
        assert_eq!(m[28], 5, "path_mtu 4096");
        assert_eq!(Hello::decode(&m), Ok(sample_message()));
    }

    #[test]
    fn path_mtu_codes_are_ibv_mtu() {
        let all = [(0, 0), (256, 1), (512, 2), (1024, 3), (2048, 4), (4096, 5)];
        for (bytes, code) in all {
            assert_eq!(mtu_code(bytes), Some(code), "{bytes}");
            assert_eq!(mtu_bytes(code), Some(bytes), "{code}");
            let mut h = sample();
            h.path_mtu = bytes;
            let enc = h.encode();
            assert_eq!(enc[28], code);
            assert_eq!(Hello::decode(&enc).unwrap().path_mtu, bytes);
        }
        assert_eq!(mtu_code(1500), None);
        assert_eq!(mtu_code(9000), None);
        assert_eq!(mtu_bytes(6), None);
        // Not an MTU: announced as none.
        let mut h = sample();
        h.path_mtu = 1500;
        assert_eq!(h.encode()[28], 0);
    }

    #[test]
    fn an_unknown_path_mtu_code_is_malformed() {
        for code in [6u8, 7, 0x80, 0xFF] {
            let mut b = sample().encode();
            b[28] = code;
            let err = Hello::decode(&b).unwrap_err();
            assert_eq!(err, HandshakeError::InvalidPathMtu { found: code });
            assert_eq!(err.reject_reason(), RejectReason::Malformed);
        }
        // The reserved bytes after it stay ignored.
        let mut b = sample().encode();
        b[29..32].copy_from_slice(&[0xAA, 0xBB, 0xCC]);
        assert_eq!(Hello::decode(&b), Ok(sample()));
    }

    #[test]
    fn both_sides_agree_on_the_smallest_known_path_mtu() {
        // RoCE hosts with netdev MTU 9000 (active 4096) and 1500 (1024):
        // the active side's route says its own 4096, the passive side's
        // route says the active side's 4096; both end at 1024.
        assert_eq!(agree_path_mtu(4096, 4096, 1024), 1024);
        assert_eq!(agree_path_mtu(4096, 1024, 4096), 1024);
        // Active side at 1500: its route already says 1024.
        assert_eq!(agree_path_mtu(1024, 1024, 4096), 1024);
        assert_eq!(agree_path_mtu(1024, 4096, 1024), 1024);
        // A peer that announces none (0) or a route that says none.
        assert_eq!(agree_path_mtu(2048, 4096, 0), 2048);
        assert_eq!(agree_path_mtu(0, 4096, 0), 4096);
        assert_eq!(agree_path_mtu(0, 0, 0), 0);
        // An InfiniBand path record smaller than both ports.
        assert_eq!(agree_path_mtu(2048, 4096, 4096), 2048);
    }

    #[test]
    fn message_hello_needs_its_limits() {
        let mut m = sample_message().encode();
        m[26..28].copy_from_slice(&[0, 0]);
        assert_eq!(
            Hello::decode(&m),
            Err(HandshakeError::InvalidRing {
                reason: "max_rendezvous_in_flight is 0"
            })
        );
        let mut m = sample_message().encode();
        m[8..16].copy_from_slice(&[0; 8]);
        assert_eq!(
            Hello::decode(&m),
            Err(HandshakeError::InvalidRing {
                reason: "max_message_len is 0"
            })
        );
    }

    #[test]
    fn hello_round_trips_both_kinds_and_limits() {
        for base in [sample(), sample_message()] {
            for (ring_len, recv_depth) in [
                (1, MIN_RECV_DEPTH),
                (MAX_RING_LEN, MAX_RECV_DEPTH),
                (4099, 7),
            ] {
                let hello = Hello {
                    ring_len,
                    recv_depth,
                    ..base
                };
                assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
            }
        }
    }

    #[test]
    fn hello_ignores_padding_reserved_flags_and_reserved() {
        let mut padded = [0u8; 56];
        padded[..HELLO_LEN].copy_from_slice(&sample().encode());
        padded[7] = 0xF8; // the flags' reserved bits
        padded[26..28].copy_from_slice(&[9, 9]); // byte stream: not read
        padded[29..32].copy_from_slice(&[9, 9, 9]); // reserved
        padded[40] = 0xAB; // trailing garbage after the hello
        assert_eq!(Hello::decode(&padded), Ok(sample()));
    }

    #[test]
    fn hello_truncated() {
        let bytes = sample().encode();
        assert_eq!(
            Hello::decode(&bytes[..31]),
            Err(HandshakeError::Truncated { len: 31 })
        );
        assert_eq!(
            Hello::decode(&[]),
            Err(HandshakeError::Truncated { len: 0 })
        );
    }

    #[test]
    fn hello_bad_magic() {
        let mut bytes = sample().encode();
        bytes[0..4].copy_from_slice(b"HTTP");
        assert_eq!(
            Hello::decode(&bytes),
            Err(HandshakeError::BadMagic { found: 0x4854_5450 })
        );
    }

    #[test]
    fn hello_unsupported_version() {
        let mut bytes = sample().encode();
        for found in [0u16, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13] {
            bytes[4..6].copy_from_slice(&found.to_be_bytes());
            assert_eq!(
                Hello::decode(&bytes),
                Err(HandshakeError::UnsupportedVersion {
                    found,
                    supported: 12
                })
            );
        }
    }

    #[test]
    fn hello_unknown_and_wrong_kind() {
        for bad in [0u8, 3, 0xFF] {
            let mut bytes = sample().encode();
            bytes[6] = bad;
            assert_eq!(
                Hello::decode(&bytes),
                Err(HandshakeError::UnknownKind { found: bad })
            );
        }
        let message = sample_message();
        let decoded = Hello::decode(&message.encode()).unwrap();
        assert_eq!(
            decoded.expect_kind(EndpointKind::ByteStream),
            Err(HandshakeError::WrongKind {
                expected: EndpointKind::ByteStream,
                found: EndpointKind::Message
            })
        );
        assert_eq!(decoded.expect_kind(EndpointKind::Message), Ok(message));
    }

    #[test]
    fn hello_invalid_ring() {
        let cases: [(u32, u16, &str); 5] = [
            (0, 64, "ring_len is 0"),
            (MAX_RING_LEN + 1, 64, "ring_len is larger than 1 GiB"),
            (4096, 0, "recv_depth is below 4"),
            (4096, 3, "recv_depth is below 4"),
            (4096, 1024, "recv_depth is above 1023"),
        ];
        for (ring_len, recv_depth, reason) in cases {
            let hello = Hello {
                ring_len,
                recv_depth,
                ..sample()
            };
            assert_eq!(
                Hello::decode(&hello.encode()),
                Err(HandshakeError::InvalidRing { reason }),
                "ring_len {ring_len} recv_depth {recv_depth}"
            );
        }
    }

    #[test]
    fn handshake_errors_map_to_reject_reasons() {
        let cases = [
            (
                HandshakeError::Truncated { len: 3 },
                RejectReason::Malformed,
            ),
            (
                HandshakeError::BadMagic { found: 0 },
                RejectReason::BadMagic,
            ),
            (
                HandshakeError::UnsupportedVersion {
                    found: 9,
                    supported: 1,
                },
                RejectReason::UnsupportedVersion,
            ),
            (
                HandshakeError::UnknownKind { found: 7 },
                RejectReason::WrongKind,
            ),
            (
                HandshakeError::WrongKind {
                    expected: EndpointKind::ByteStream,
                    found: EndpointKind::Message,
                },
                RejectReason::WrongKind,
            ),
            (
                HandshakeError::InvalidRing { reason: "x" },
                RejectReason::Malformed,
            ),
            (
                HandshakeError::InvalidPathMtu { found: 6 },
                RejectReason::Malformed,
            ),
        ];
        for (err, reason) in cases {
            assert_eq!(err.reject_reason(), reason, "{err}");
            assert_eq!(RejectReason::from(&err), reason);
        }
    }

    #[test]
    fn reject_round_trip_and_exact_bytes() {
        assert_eq!(
            encode_reject(RejectReason::UnsupportedVersion),
            [0x54, 0x4B, 0x52, 0x44, 0x00, 0x0C, 0x02, 0x00]
        );
        for code in 0..=u8::MAX {
            let reason = RejectReason::from_code(code);
            assert_eq!(reason.code(), code);
            assert_eq!(
                decode_reject(&encode_reject(reason)),
                Some((VERSION, reason))
            );
        }
        assert_eq!(RejectReason::from_code(5), RejectReason::ServerResources);
        assert_eq!(RejectReason::from_code(6), RejectReason::Incompatible);
        assert_eq!(RejectReason::from_code(7), RejectReason::Unknown(7));
        // A newer server's version is reported as-is.
        let mut newer = encode_reject(RejectReason::UnsupportedVersion).to_vec();
        newer[4..6].copy_from_slice(&3u16.to_be_bytes());
        newer.extend_from_slice(&[0; 48]); // rdma_cm padding
        assert_eq!(
            decode_reject(&newer),
            Some((3, RejectReason::UnsupportedVersion))
        );
    }

    #[test]
    fn reject_not_ours() {
        assert_eq!(decode_reject(&[]), None);
        assert_eq!(
            decode_reject(&encode_reject(RejectReason::BadMagic)[..7]),
            None
        );
        assert_eq!(decode_reject(&[0u8; 56]), None);
        assert_eq!(decode_reject(b"HTTP/1.1 400"), None);
    }

    #[test]
    fn capabilities_ride_in_the_flags_byte() {
        // An iWARP device like siw: no immediate data, windows or atomics.
        let siw = Capabilities {
            immediate_data: false,
            memory_windows: false,
            atomics: false,
        };
        assert_eq!(Capabilities::FULL.to_flags(), 0);
        assert_eq!(siw.to_flags(), 0b111);
        let mut h = sample();
        h.caps = siw;
        let bytes = h.encode();
        assert_eq!(bytes[7], 0b111);
        assert_eq!(Hello::decode(&bytes), Ok(h));
        for flags in 0u8..=0xFF {
            let caps = Capabilities::from_flags(flags);
            // Bits 3..7 are reserved and ignored.
            assert_eq!(caps.to_flags(), flags & 0b111, "flags {flags:#010b}");
        }
        assert_eq!(
            Capabilities::from_flags(0b010),
            Capabilities {
                immediate_data: true,
                memory_windows: false,
                atomics: true,
            }
        );
        assert_eq!(Capabilities::default(), Capabilities::FULL);
    }

    #[test]
    fn immediate_data_must_match() {
        let ours = sample();
        let mut peer = sample();
        peer.caps.memory_windows = false;
        peer.caps.atomics = false;
        // Windows and atomics may differ.
        assert_eq!(peer.expect_compatible(&ours), Ok(peer));
        peer.caps.immediate_data = false;
        let err = peer.expect_compatible(&ours).unwrap_err();
        assert_eq!(
            err,
            HandshakeError::ImmediateDataMismatch {
                ours: true,
                peer: false
            }
        );
        assert_eq!(err.reject_reason(), RejectReason::Incompatible);
        assert_eq!(err.reject_reason().code(), 6);
        assert_eq!(
            err.to_string(),
            "this side's device has immediate data and the peer's lacks: no common transport"
        );
        // Both without: an iWARP pair.
        let mut ours_iwarp = ours;
        ours_iwarp.caps.immediate_data = false;
        assert_eq!(peer.expect_compatible(&ours_iwarp), Ok(peer));
    }
}
