//! The 32-bit immediate data of an RDMA WRITE WITH IMMEDIATE.
//!
//! Every message of a byte stream, data or control, is one RDMA WRITE WITH
//! IMMEDIATE and consumes exactly one posted receive WR at the peer. Control
//! messages are zero-length writes; their meaning is entirely in the
//! immediate data. The top two bits select the type:
//!
//! | bits 31..30 | type   | bits 29..0                                                        |
//! |-------------|--------|-------------------------------------------------------------------|
//! | `00`        | DATA   | payload length in bytes, `1..=`[`MAX_DATA_LEN`]                    |
//! | `01`        | CREDIT | bits 29..20: receive WRs returned (0..=1023); bits 19..0: ring bytes returned (0..=[`MAX_CREDIT_BYTES`]) |
//! | `10`        | FIN and ring growth | 0: FIN; otherwise bits 29..26 pick GRANT (`0001`) or SWITCH (`0010`), below |
//! | `11`        | ABORT  | an error code (0..=[`MAX_ABORT_CODE`])                             |
//!
//! Ring growth (protocol version 6) rides in the FIN type's spare bits:
//!
//! | bits 29..26 | message | bits 25..24 | bits 23..0 |
//! |-------------|---------|-------------|------------|
//! | `0001`      | GRANT chunk | chunk index 0..=3 | 24 bits of the 96-bit descriptor: ring address (u64) then rkey (u32), big-endian, chunk 0 first |
//! | `0010`      | SWITCH  | 0           | 0          |
//!
//! A receiver offers a ring twice as large as its current one in four
//! GRANT chunks (every message is a WRITE WITH IMMEDIATE that carries no
//! receive buffer, so a 16-byte record has no other place to ride; a ring
//! grows at most a few times per connection). The sender answers SWITCH
//! before its first write into the new ring; see
//! [`stream`](crate::proto::stream) for the protocol.
//!
//! The immediate is carried in network byte order by the NIC; the runtime
//! hands the core the host-order `u32` value (`u32::from_be` of the
//! completion's `imm_data`).

use crate::proto::error::ProtocolError;

/// Largest payload of one DATA message: 2^30 - 1 bytes.
pub const MAX_DATA_LEN: u32 = (1 << 30) - 1;

/// Most receive WRs one CREDIT returns: 1023.
pub const MAX_CREDIT_WRS: u16 = (1 << 10) - 1;

/// Most ring bytes one CREDIT returns: 2^20 - 1 bytes.
pub const MAX_CREDIT_BYTES: u32 = (1 << 20) - 1;

/// Largest ABORT code: 2^30 - 1.
pub const MAX_ABORT_CODE: u32 = (1 << 30) - 1;

const TYPE_SHIFT: u32 = 30;
const LOW_MASK: u32 = (1 << 30) - 1;
const TYPE_DATA: u32 = 0b00;
const TYPE_CREDIT: u32 = 0b01;
const TYPE_FIN: u32 = 0b10;
const TYPE_ABORT: u32 = 0b11;
const CREDIT_WRS_SHIFT: u32 = 20;
const SUBTYPE_SHIFT: u32 = 26;
const SUBTYPE_GRANT: u32 = 0b0001;
const SUBTYPE_SWITCH: u32 = 0b0010;
const CHUNK_SHIFT: u32 = 24;

/// Bits of the ring descriptor one GRANT chunk carries: 24.
pub const GRANT_CHUNK_BITS: u32 = 24;

/// GRANT chunks in one ring offer: 4 (96 bits: address u64, rkey u32).
pub const GRANT_CHUNKS: u8 = 4;

/// Splits a ring descriptor (address, rkey) into the payloads of its
/// [`GRANT_CHUNKS`] GRANT chunks, chunk 0 first.
pub fn grant_chunks(addr: u64, rkey: u32) -> [u32; 4] {
    let d = (u128::from(addr) << 32) | u128::from(rkey);
    let mask = (1u128 << GRANT_CHUNK_BITS) - 1;
    [3u32, 2, 1, 0].map(|i| ((d >> (i * GRANT_CHUNK_BITS)) & mask) as u32)
}

/// Joins the payloads of the four GRANT chunks, chunk 0 first, back into
/// (address, rkey).
pub fn grant_descriptor(chunks: [u32; 4]) -> (u64, u32) {
    let d = chunks
        .iter()
        .fold(0u128, |d, &c| (d << GRANT_CHUNK_BITS) | u128::from(c));
    ((d >> 32) as u64, d as u32)
}

/// A decoded immediate: one message of the stream protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Imm {
    /// `len` bytes of payload were written at the receiver's ring tail.
    /// `len` is `1..=`[`MAX_DATA_LEN`].
    Data {
        /// Payload length in bytes.
        len: u32,
    },
    /// The sender returns credit: `wrs` receive WRs (`0..=`[`MAX_CREDIT_WRS`])
    /// it has reposted and `bytes` ring bytes (`0..=`[`MAX_CREDIT_BYTES`])
    /// its reader has consumed.
    Credit {
        /// Receive WRs returned.
        wrs: u16,
        /// Ring bytes returned.
        bytes: u32,
    },
    /// The sender half-closed: no DATA follows.
    Fin,
    /// Chunk `index` (`0..`[`GRANT_CHUNKS`]) of a ring offer: 24 bits
    /// (`bits < 2^24`) of the new ring's address and rkey
    /// ([`grant_chunks`]). The offered ring is twice the sender's current
    /// receive ring.
    Grant {
        /// Chunk index, 0..=3.
        index: u8,
        /// The chunk's 24 descriptor bits.
        bits: u32,
    },
    /// The sender took the receiver's last ring offer: its next DATA
    /// lands at offset 0 of the new ring.
    Switch,
    /// The sender aborted the connection with an error `code`
    /// (`0..=`[`MAX_ABORT_CODE`]); nothing follows.
    Abort {
        /// The abort code.
        code: u32,
    },
}

impl Imm {
    /// Encodes into the 32-bit immediate (host order).
    ///
    /// Field values must be in the ranges documented on each variant; the
    /// core never produces others. Out-of-range values are truncated to
    /// their field's width (a debug build asserts), so they can never spill
    /// into the type bits.
    pub fn encode(self) -> u32 {
        match self {
            Imm::Data { len } => {
                debug_assert!((1..=MAX_DATA_LEN).contains(&len), "DATA length {len}");
                (TYPE_DATA << TYPE_SHIFT) | (len & LOW_MASK)
            }
            Imm::Credit { wrs, bytes } => {
                debug_assert!(
                    wrs <= MAX_CREDIT_WRS && bytes <= MAX_CREDIT_BYTES,
                    "CREDIT {wrs} {bytes}"
                );
                (TYPE_CREDIT << TYPE_SHIFT)
                    | ((u32::from(wrs) & u32::from(MAX_CREDIT_WRS)) << CREDIT_WRS_SHIFT)
                    | (bytes & MAX_CREDIT_BYTES)
            }
            Imm::Fin => TYPE_FIN << TYPE_SHIFT,
            Imm::Grant { index, bits } => {
                debug_assert!(index < GRANT_CHUNKS && bits < 1 << GRANT_CHUNK_BITS);
                (TYPE_FIN << TYPE_SHIFT)
                    | (SUBTYPE_GRANT << SUBTYPE_SHIFT)
                    | ((u32::from(index) & 0b11) << CHUNK_SHIFT)
                    | (bits & ((1 << GRANT_CHUNK_BITS) - 1))
            }
            Imm::Switch => (TYPE_FIN << TYPE_SHIFT) | (SUBTYPE_SWITCH << SUBTYPE_SHIFT),
            Imm::Abort { code } => {
                debug_assert!(code <= MAX_ABORT_CODE, "ABORT code {code}");
                (TYPE_ABORT << TYPE_SHIFT) | (code & LOW_MASK)
            }
        }
    }

    /// Decodes a 32-bit immediate (host order).
    ///
    /// # Errors
    ///
    /// [`ProtocolError::BadImm`] for a DATA with length 0, or a FIN-type
    /// immediate that is neither FIN (low 30 bits 0), a GRANT chunk nor a
    /// SWITCH (no other bits set). Every CREDIT and ABORT bit pattern is
    /// valid.
    pub fn decode(imm: u32) -> Result<Imm, ProtocolError> {
        let low = imm & LOW_MASK;
        match imm >> TYPE_SHIFT {
            TYPE_DATA if low == 0 => Err(ProtocolError::BadImm {
                imm,
                reason: "DATA with length 0",
            }),
            TYPE_DATA => Ok(Imm::Data { len: low }),
            TYPE_CREDIT => Ok(Imm::Credit {
                // 10 bits: always fits in u16.
                wrs: (low >> CREDIT_WRS_SHIFT) as u16,
                bytes: low & MAX_CREDIT_BYTES,
            }),
            TYPE_FIN if low == 0 => Ok(Imm::Fin),
            TYPE_FIN => match low >> SUBTYPE_SHIFT {
                SUBTYPE_GRANT => Ok(Imm::Grant {
                    index: ((low >> CHUNK_SHIFT) & 0b11) as u8,
                    bits: low & ((1 << GRANT_CHUNK_BITS) - 1),
                }),
                SUBTYPE_SWITCH if low == SUBTYPE_SWITCH << SUBTYPE_SHIFT => Ok(Imm::Switch),
                _ => Err(ProtocolError::BadImm {
                    imm,
                    reason: "FIN type that is no FIN, GRANT or SWITCH",
                }),
            },
            _ => Ok(Imm::Abort { code: low }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imm_exact_encodings() {
        assert_eq!(Imm::Data { len: 1 }.encode(), 0x0000_0001);
        assert_eq!(Imm::Data { len: MAX_DATA_LEN }.encode(), 0x3FFF_FFFF);
        assert_eq!(Imm::Credit { wrs: 0, bytes: 0 }.encode(), 0x4000_0000);
        assert_eq!(Imm::Credit { wrs: 1, bytes: 2 }.encode(), 0x4010_0002);
        assert_eq!(
            Imm::Credit {
                wrs: MAX_CREDIT_WRS,
                bytes: MAX_CREDIT_BYTES
            }
            .encode(),
            0x7FFF_FFFF
        );
        assert_eq!(Imm::Fin.encode(), 0x8000_0000);
        assert_eq!(Imm::Grant { index: 0, bits: 1 }.encode(), 0x8400_0001);
        assert_eq!(
            Imm::Grant {
                index: 3,
                bits: 0xAB_CDEF
            }
            .encode(),
            0x87AB_CDEF
        );
        assert_eq!(Imm::Switch.encode(), 0x8800_0000);
        assert_eq!(Imm::Abort { code: 0 }.encode(), 0xC000_0000);
        assert_eq!(
            Imm::Abort {
                code: MAX_ABORT_CODE
            }
            .encode(),
            0xFFFF_FFFF
        );
    }

    #[test]
    fn imm_round_trips() {
        let samples = [
            Imm::Data { len: 1 },
            Imm::Data { len: 4099 },
            Imm::Data { len: MAX_DATA_LEN },
            Imm::Credit { wrs: 0, bytes: 0 },
            Imm::Credit { wrs: 17, bytes: 0 },
            Imm::Credit {
                wrs: 0,
                bytes: 1024,
            },
            Imm::Credit {
                wrs: MAX_CREDIT_WRS,
                bytes: MAX_CREDIT_BYTES,
            },
            Imm::Fin,
            Imm::Grant { index: 0, bits: 0 },
            Imm::Grant {
                index: 3,
                bits: 0xFF_FFFF,
            },
            Imm::Switch,
            Imm::Abort { code: 0 },
            Imm::Abort { code: 12345 },
            Imm::Abort {
                code: MAX_ABORT_CODE,
            },
        ];
        for imm in samples {
            assert_eq!(Imm::decode(imm.encode()), Ok(imm), "{imm:?}");
        }
    }

    #[test]
    fn imm_every_type_bit_pattern_decodes_or_errors_exactly() {
        // Walk a spread of values over the whole u32 space: decode then
        // encode must give back the same bits, except for the two invalid
        // shapes.
        let mut x: u32 = 0x9E37_79B9;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            match Imm::decode(x) {
                Ok(imm) => assert_eq!(imm.encode(), x),
                Err(ProtocolError::BadImm { imm, .. }) => {
                    assert_eq!(imm, x);
                    let subtype = (x & LOW_MASK) >> SUBTYPE_SHIFT;
                    // FIN-type patterns other than FIN, every GRANT chunk
                    // and the one SWITCH.
                    let bad_fin = x >> 30 == 0b10
                        && subtype != SUBTYPE_GRANT
                        && x != Imm::Fin.encode()
                        && x != Imm::Switch.encode();
                    assert!(x == 0 || bad_fin, "{x:#x}");
                }
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
    }

    #[test]
    fn imm_invalid() {
        assert_eq!(
            Imm::decode(0),
            Err(ProtocolError::BadImm {
                imm: 0,
                reason: "DATA with length 0"
            })
        );
        for imm in [
            0x8000_0001,
            0xBFFF_FFFF,
            0x8800_0001,
            0x8C00_0000,
            0x8300_0000,
        ] {
            assert_eq!(
                Imm::decode(imm),
                Err(ProtocolError::BadImm {
                    imm,
                    reason: "FIN type that is no FIN, GRANT or SWITCH"
                }),
                "{imm:#x}"
            );
        }
    }

    #[test]
    fn grant_descriptor_round_trips_through_four_chunks() {
        let addr = 0x0123_4567_89AB_CDEF;
        let rkey = 0xFEDC_BA98;
        let chunks = grant_chunks(addr, rkey);
        assert_eq!(chunks, [0x01_2345, 0x67_89AB, 0xCD_EFFE, 0xDC_BA98]);
        assert_eq!(grant_descriptor(chunks), (addr, rkey));
        assert_eq!(grant_descriptor(grant_chunks(u64::MAX, 0)), (u64::MAX, 0));
        assert_eq!(grant_descriptor(grant_chunks(0, u32::MAX)), (0, u32::MAX));
    }
}
