//! What the examples and the guest tests share: size arguments and the
//! deterministic payload pattern both sides of a transfer can regenerate.

/// Parses a size argument: `4096`, `64KiB`, `1MiB`, `1GiB`, `1.5 MB`
/// (binary and decimal units, as the `bytesize` crate reads them).
pub fn parse_size(s: &str) -> Result<u64, String> {
    s.trim()
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("not a size: {s:?} ({e})"))
}

/// Word `j` of the pattern: byte `o` of the endless stream is byte `o % 8`
/// (little-endian) of word `o / 8`; message `i` of size `n` is the bytes
/// at offset `i * n`.
pub fn word(j: u64) -> u64 {
    let x = j.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 31)
}

/// Byte `i` of stream `seed` (a connection, a request): byte `i % 8` of
/// word `(i / 8) ^ (seed * K)`. Words are a multiplicative hash, so the
/// pattern has no period shorter than 2^64 bytes: bytes from a stale lap of
/// a ring never match.
#[allow(dead_code)] // used by echo, hyper_client and the guest tests
pub fn pattern_byte(seed: u64, i: u64) -> u8 {
    (word((i / 8) ^ seed_key(seed)) >> (8 * (i % 8))) as u8
}

/// Bytes `0..len` of stream `seed` ([`pattern_byte`] for each index,
/// built a word at a time by [`fill_pattern`]: a 1 GiB message takes 8x
/// fewer hashes than byte by byte).
#[allow(dead_code)] // used by the guest message tests
pub fn pattern_vec(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    fill_pattern(&mut v, seed, 0);
    v
}

fn seed_key(seed: u64) -> u64 {
    seed.wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

/// Fills `buf` with the bytes of stream `seed` starting at offset `off`
/// (byte `k` of `buf` is `pattern_byte(seed, off + k)`).
pub fn fill_pattern(buf: &mut [u8], seed: u64, mut off: u64) {
    let key = seed_key(seed);
    let mut i = 0;
    while i < buf.len() && off % 8 != 0 {
        buf[i] = pattern_byte(seed, off);
        i += 1;
        off += 1;
    }
    let mut words = buf[i..].chunks_exact_mut(8);
    for w in words.by_ref() {
        w.copy_from_slice(&word((off / 8) ^ key).to_le_bytes());
        off += 8;
    }
    for b in words.into_remainder() {
        *b = pattern_byte(seed, off);
        off += 1;
    }
}
