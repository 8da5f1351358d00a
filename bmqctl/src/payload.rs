//! Self-checking payloads for `bmqctl produce` / `consume` and benchmarks: a consumer can verify
//! every byte of a message and learn who produced it, with which sequence number.
//!
//! Layout (all integers big-endian), [`HEADER_LEN`] = 32 bytes:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `"BMQP"` |
//! | 4 | 8 | producer_id |
//! | 12 | 8 | sequence |
//! | 20 | 4 | total payload length, header included |
//! | 24 | 8 | check: FNV-1a 64 of bytes 0..24 |
//! | 32 | .. | filler: a pseudo-random stream seeded by `(producer_id, sequence)` |
//!
//! The filler is fully determined by the header, so [`verify`] recomputes and compares every
//! byte: any corruption, truncation or mix-up of two messages is detected.

use bytes::{BufMut, Bytes, BytesMut};

/// Bytes before the filler; the smallest payload [`encode`] makes.
pub const HEADER_LEN: usize = 32;
/// Largest payload [`encode`] makes, bytes (the length field is 32 bits).
pub const PAYLOAD_LEN_MAX: usize = u32::MAX as usize;

const MAGIC: &[u8; 4] = b"BMQP";

/// Why a payload does not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// Shorter than the header.
    #[error("payload of {length} bytes is shorter than the {HEADER_LEN}-byte header")]
    TooShort {
        /// The payload's length.
        length: usize,
    },
    /// The first 4 bytes are not `"BMQP"`: not a self-checking payload.
    #[error("payload does not start with the BMQP magic")]
    BadMagic,
    /// The header's check value does not match its fields.
    #[error("payload header is corrupt")]
    BadHeader,
    /// The length in the header differs from the payload's.
    #[error("payload header says {expected} bytes, payload has {actual}")]
    LengthMismatch {
        /// Length written in the header.
        expected: usize,
        /// Actual length.
        actual: usize,
    },
    /// A filler byte differs from the expected one.
    #[error("payload of producer {producer_id} sequence {sequence} is corrupt at byte {offset}")]
    Corrupt {
        /// The header's producer id.
        producer_id: u64,
        /// The header's sequence.
        sequence: u64,
        /// Offset of the first wrong byte.
        offset: usize,
    },
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The filler stream of `(producer_id, sequence)`: splitmix64, 8 bytes per step.
struct Filler(u64);

impl Filler {
    fn new(producer_id: u64, sequence: u64) -> Self {
        Filler(producer_id ^ sequence.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15)
    }

    fn next_word(&mut self) -> [u8; 8] {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)).to_le_bytes()
    }
}

/// A payload of `max(size, HEADER_LEN)` bytes for message `sequence` of `producer_id`.
///
/// Panics if `size` exceeds [`PAYLOAD_LEN_MAX`] (a programmer error: the CLI bounds it).
pub fn encode(producer_id: u64, sequence: u64, size: usize) -> Bytes {
    assert!(
        size <= PAYLOAD_LEN_MAX,
        "payload size {size} exceeds the maximum"
    );
    let size = size.max(HEADER_LEN);
    let mut out = BytesMut::with_capacity(size);
    out.put_slice(MAGIC);
    out.put_u64(producer_id);
    out.put_u64(sequence);
    out.put_u32(size as u32);
    let check = fnv1a64(&out[..24]);
    out.put_u64(check);
    let mut filler = Filler::new(producer_id, sequence);
    while out.len() < size {
        let word = filler.next_word();
        let n = (size - out.len()).min(8);
        out.put_slice(&word[..n]);
    }
    out.freeze()
}

/// Checks every byte of `payload`; returns its `(producer_id, sequence)`.
///
/// Errors: [`PayloadError`] saying what is wrong (and where, for filler corruption).
pub fn verify(payload: &[u8]) -> Result<(u64, u64), PayloadError> {
    if payload.len() < HEADER_LEN {
        return Err(PayloadError::TooShort {
            length: payload.len(),
        });
    }
    if &payload[..4] != MAGIC {
        return Err(PayloadError::BadMagic);
    }
    let u64_at = |i: usize| u64::from_be_bytes(payload[i..i + 8].try_into().expect("8 bytes"));
    if u64_at(24) != fnv1a64(&payload[..24]) {
        return Err(PayloadError::BadHeader);
    }
    let producer_id = u64_at(4);
    let sequence = u64_at(12);
    let expected = u32::from_be_bytes(payload[20..24].try_into().expect("4 bytes")) as usize;
    if expected != payload.len() {
        return Err(PayloadError::LengthMismatch {
            expected,
            actual: payload.len(),
        });
    }
    let mut filler = Filler::new(producer_id, sequence);
    for (chunk_index, chunk) in payload[HEADER_LEN..].chunks(8).enumerate() {
        let word = filler.next_word();
        if chunk != &word[..chunk.len()] {
            let within = chunk
                .iter()
                .zip(word.iter())
                .position(|(a, b)| a != b)
                .expect("chunks differ");
            return Err(PayloadError::Corrupt {
                producer_id,
                sequence,
                offset: HEADER_LEN + chunk_index * 8 + within,
            });
        }
    }
    Ok((producer_id, sequence))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_at_many_sizes() {
        // Payloads of every size around the header and word boundaries verify and carry their ids.
        for size in [0, 1, 31, 32, 33, 39, 40, 41, 1024, 65_537] {
            let p = encode(42, 7, size);
            assert_eq!(p.len(), size.max(HEADER_LEN));
            assert_eq!(verify(&p), Ok((42, 7)));
        }
    }

    #[test]
    fn different_messages_have_different_fillers() {
        // Two sequences of one producer, and two producers, give different bytes after the header.
        let a = encode(1, 1, 100);
        let b = encode(1, 2, 100);
        let c = encode(2, 1, 100);
        assert_ne!(a[HEADER_LEN..], b[HEADER_LEN..]);
        assert_ne!(a[HEADER_LEN..], c[HEADER_LEN..]);
        assert_eq!(encode(1, 1, 100), a);
    }

    #[test]
    fn every_corruption_is_detected() {
        // Flipping any single byte, truncating, extending or swapping bodies fails verification.
        let p = encode(9, 3, 80);
        for i in 0..p.len() {
            let mut q = p.to_vec();
            q[i] ^= 0x01;
            assert!(verify(&q).is_err(), "flip at {i} not detected");
        }
        let mut q = p.to_vec();
        q[50] ^= 0x80;
        assert_eq!(
            verify(&q),
            Err(PayloadError::Corrupt {
                producer_id: 9,
                sequence: 3,
                offset: 50
            })
        );
        assert_eq!(
            verify(&p[..79]),
            Err(PayloadError::LengthMismatch {
                expected: 80,
                actual: 79
            })
        );
        assert_eq!(verify(&p[..10]), Err(PayloadError::TooShort { length: 10 }));
        assert_eq!(verify(&[0u8; 40]), Err(PayloadError::BadMagic));
        let mut swapped = encode(9, 4, 80).to_vec();
        swapped[HEADER_LEN..].copy_from_slice(&p[HEADER_LEN..]);
        assert!(matches!(
            verify(&swapped),
            Err(PayloadError::Corrupt { .. })
        ));
    }
}
