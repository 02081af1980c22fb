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
//! | `10`        | FIN    | must be 0                                                          |
//! | `11`        | ABORT  | an error code (0..=[`MAX_ABORT_CODE`])                             |
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
    /// [`ProtocolError::BadImm`] for a DATA with length 0 or a FIN with
    /// non-zero low 30 bits. Every CREDIT and ABORT bit pattern is valid.
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
            TYPE_FIN if low != 0 => Err(ProtocolError::BadImm {
                imm,
                reason: "FIN with non-zero low 30 bits",
            }),
            TYPE_FIN => Ok(Imm::Fin),
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
                    assert!(x == 0 || (x >> 30 == 0b10 && x & LOW_MASK != 0), "{x:#x}");
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
        assert_eq!(
            Imm::decode(0x8000_0001),
            Err(ProtocolError::BadImm {
                imm: 0x8000_0001,
                reason: "FIN with non-zero low 30 bits"
            })
        );
        assert_eq!(
            Imm::decode(0xBFFF_FFFF),
            Err(ProtocolError::BadImm {
                imm: 0xBFFF_FFFF,
                reason: "FIN with non-zero low 30 bits"
            })
        );
    }
}
