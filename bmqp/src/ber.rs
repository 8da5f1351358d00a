//! A BER (ITU-T X.690) TLV reader and writer, enough for the control messages the SDKs send
//! BER-encoded (`NegotiationMessage`, `ControlMessage` of `bmqp_ctrlmsg.xsd`, written by BDE's
//! `balber` with indefinite lengths for constructed values).
//!
//! [`decode`] reads one value into a [`Tlv`] tree: identifier octets (class, constructed,
//! tag number, high-tag-number form), length octets (short, long up to 4 octets, or
//! indefinite ending with the end-of-contents octets `00 00`), and contents — primitive bytes or
//! nested values. Unknown tags are kept as they are (a schema layer skips what it does not
//! know). [`encode`] writes a tree back, in the same length forms it was read with, so a frame
//! read and written again is the same bytes. Nesting is limited to [`DEPTH_MAX`] levels and
//! every length is checked against the input: arbitrary bytes give an error, never a panic.

use bytes::{BufMut, Bytes, BytesMut};
use thiserror::Error;

/// Deepest nesting accepted.
pub const DEPTH_MAX: usize = 64;

/// Identifier class (bits 8-7 of the first identifier octet).
pub mod class {
    /// Universal.
    pub const UNIVERSAL: u8 = 0;
    /// Application.
    pub const APPLICATION: u8 = 1;
    /// Context-specific (what `balber` uses for sequence and choice members).
    pub const CONTEXT: u8 = 2;
    /// Private.
    pub const PRIVATE: u8 = 3;
}

/// How a value's length was (and is) written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LengthForm {
    /// Definite, in `octets` length octets after the first (0: the short form, length < 128).
    Definite {
        /// Extra length octets (0-4).
        octets: u8,
    },
    /// Indefinite (constructed only): contents end with `00 00`.
    Indefinite,
}

/// A value's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// A primitive value's bytes.
    Primitive(Bytes),
    /// A constructed value's members, in order.
    Constructed(Vec<Tlv>),
}

/// One BER value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tlv {
    /// Identifier class ([`class`]).
    pub class: u8,
    /// Tag number.
    pub tag: u32,
    /// How its length is written.
    pub length: LengthForm,
    /// Contents.
    pub value: Value,
}

impl Tlv {
    /// The members of a constructed value (empty for a primitive one).
    pub fn members(&self) -> &[Tlv] {
        match &self.value {
            Value::Constructed(m) => m,
            Value::Primitive(_) => &[],
        }
    }

    /// The first member with context-specific tag `tag`.
    pub fn member(&self, tag: u32) -> Option<&Tlv> {
        self.members()
            .iter()
            .find(|m| m.class == class::CONTEXT && m.tag == tag)
    }

    /// A primitive value's contents as a big-endian two's-complement integer (1-8 octets).
    pub fn as_i64(&self) -> Option<i64> {
        let Value::Primitive(b) = &self.value else {
            return None;
        };
        if b.is_empty() || b.len() > 8 {
            return None;
        }
        let mut v: i64 = if b[0] & 0x80 != 0 { -1 } else { 0 };
        for &byte in b.iter() {
            v = (v << 8) | i64::from(byte);
        }
        Some(v)
    }

    /// A context-specific primitive `[tag]` holding `bytes` (definite length), as `balber`
    /// writes strings and integers.
    pub fn context(tag: u32, bytes: &[u8]) -> Tlv {
        Tlv {
            class: class::CONTEXT,
            tag,
            length: LengthForm::Definite { octets: 0 },
            value: Value::Primitive(Bytes::copy_from_slice(bytes)),
        }
    }

    /// A context-specific integer `[tag]` in the fewest two's-complement octets (how
    /// `balber` writes ints, enums by their id, and bools as 0/1).
    pub fn context_int(tag: u32, v: i64) -> Tlv {
        let b = v.to_be_bytes();
        let mut start = 0;
        // Drop a leading 0x00 (0xff) while the next octet keeps the sign.
        while start < 7
            && ((b[start] == 0 && b[start + 1] & 0x80 == 0)
                || (b[start] == 0xff && b[start + 1] & 0x80 != 0))
        {
            start += 1;
        }
        Tlv::context(tag, &b[start..])
    }

    /// A context-specific constructed `[tag]` with `members`, indefinite length (how `balber`
    /// writes every sequence and choice).
    pub fn context_seq(tag: u32, members: Vec<Tlv>) -> Tlv {
        Tlv {
            class: class::CONTEXT,
            tag,
            length: LengthForm::Indefinite,
            value: Value::Constructed(members),
        }
    }

    /// A top-level UNIVERSAL SEQUENCE with `members`, indefinite length (every control
    /// message).
    pub fn sequence(members: Vec<Tlv>) -> Tlv {
        Tlv {
            class: class::UNIVERSAL,
            tag: 16,
            length: LengthForm::Indefinite,
            value: Value::Constructed(members),
        }
    }

    /// A primitive value's contents as UTF-8 text.
    pub fn as_str(&self) -> Option<&str> {
        match &self.value {
            Value::Primitive(b) => std::str::from_utf8(b).ok(),
            Value::Constructed(_) => None,
        }
    }
}

/// Why bytes are not one BER value.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BerError {
    /// The input ends inside the value.
    #[error("truncated BER value")]
    Truncated,
    /// A length form that BER does not allow here (over 4 length octets, the reserved `0xff`,
    /// or indefinite on a primitive value).
    #[error("bad BER length")]
    BadLength,
    /// A tag number over 28 bits.
    #[error("BER tag number too large")]
    BadTag,
    /// Nested deeper than [`DEPTH_MAX`].
    #[error("BER value nested deeper than {DEPTH_MAX}")]
    TooDeep,
}

/// Reads one value from the start of `input`; returns it and the bytes it took (anything
/// after it — padding, say — is the caller's).
pub fn decode(input: &Bytes) -> Result<(Tlv, usize), BerError> {
    decode_at(input, 0, 0)
}

fn byte(input: &Bytes, at: usize) -> Result<u8, BerError> {
    input.get(at).copied().ok_or(BerError::Truncated)
}

fn decode_at(input: &Bytes, start: usize, depth: usize) -> Result<(Tlv, usize), BerError> {
    if depth > DEPTH_MAX {
        return Err(BerError::TooDeep);
    }
    let mut at = start;
    let first = byte(input, at)?;
    at += 1;
    let class = first >> 6;
    let constructed = first & 0x20 != 0;
    let mut tag = u32::from(first & 0x1f);
    if tag == 0x1f {
        tag = 0;
        loop {
            let b = byte(input, at)?;
            at += 1;
            if tag > (1 << 21) {
                return Err(BerError::BadTag);
            }
            tag = tag << 7 | u32::from(b & 0x7f);
            if b & 0x80 == 0 {
                break;
            }
        }
    }
    let l = byte(input, at)?;
    at += 1;
    let (length, len) = match l {
        0x80 => {
            if !constructed {
                return Err(BerError::BadLength);
            }
            (LengthForm::Indefinite, None)
        }
        l if l < 0x80 => (LengthForm::Definite { octets: 0 }, Some(l as usize)),
        0xff => return Err(BerError::BadLength),
        l => {
            let n = (l & 0x7f) as usize;
            if n > 4 {
                return Err(BerError::BadLength);
            }
            let mut v = 0usize;
            for _ in 0..n {
                v = v << 8 | byte(input, at)? as usize;
                at += 1;
            }
            (LengthForm::Definite { octets: n as u8 }, Some(v))
        }
    };
    let value = match (constructed, len) {
        (false, Some(len)) => {
            let end = at.checked_add(len).ok_or(BerError::Truncated)?;
            if end > input.len() {
                return Err(BerError::Truncated);
            }
            let v = Value::Primitive(input.slice(at..end));
            at = end;
            v
        }
        (true, Some(len)) => {
            let end = at.checked_add(len).ok_or(BerError::Truncated)?;
            if end > input.len() {
                return Err(BerError::Truncated);
            }
            let within = input.slice(..end);
            let mut members = Vec::new();
            while at < end {
                let (m, used) = decode_at(&within, at, depth + 1)?;
                members.push(m);
                at += used;
            }
            Value::Constructed(members)
        }
        (true, None) => {
            let mut members = Vec::new();
            loop {
                if byte(input, at)? == 0 && byte(input, at + 1)? == 0 {
                    at += 2;
                    break;
                }
                let (m, used) = decode_at(input, at, depth + 1)?;
                members.push(m);
                at += used;
            }
            Value::Constructed(members)
        }
        (false, None) => unreachable!("refused above"),
    };
    Ok((
        Tlv {
            class,
            tag,
            length,
            value,
        },
        at - start,
    ))
}

/// Appends `tlv` to `out` in its length forms (a definite length that no longer fits its
/// recorded octets is written in the smallest form that does).
pub fn encode(tlv: &Tlv, out: &mut BytesMut) {
    let constructed = matches!(tlv.value, Value::Constructed(_));
    let first = (tlv.class & 0x3) << 6 | if constructed { 0x20 } else { 0 };
    if tlv.tag < 0x1f {
        out.put_u8(first | tlv.tag as u8);
    } else {
        out.put_u8(first | 0x1f);
        let mut groups = Vec::new();
        let mut t = tlv.tag;
        loop {
            groups.push((t & 0x7f) as u8);
            t >>= 7;
            if t == 0 {
                break;
            }
        }
        for (i, g) in groups.iter().rev().enumerate() {
            out.put_u8(if i + 1 < groups.len() { g | 0x80 } else { *g });
        }
    }
    let mut contents = BytesMut::new();
    match &tlv.value {
        Value::Primitive(b) => contents.extend_from_slice(b),
        Value::Constructed(members) => {
            for m in members {
                encode(m, &mut contents);
            }
        }
    }
    match tlv.length {
        LengthForm::Indefinite if constructed => {
            out.put_u8(0x80);
            out.extend_from_slice(&contents);
            out.put_u16(0);
            return;
        }
        LengthForm::Definite { octets } => {
            let needed = (usize::BITS - contents.len().leading_zeros()).div_ceil(8) as u8;
            let octets = if octets == 0 && contents.len() < 0x80 {
                0
            } else {
                octets.max(needed).max(1)
            };
            if octets == 0 {
                out.put_u8(contents.len() as u8);
            } else {
                out.put_u8(0x80 | octets);
                for i in (0..octets).rev() {
                    out.put_u8((contents.len() >> (8 * i as usize)) as u8);
                }
            }
        }
        LengthForm::Indefinite => {
            // A primitive value cannot be indefinite: write it definite.
            out.put_u8(contents.len().min(0x7f) as u8);
        }
    }
    out.extend_from_slice(&contents);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip(hex: &[u8]) {
        let b = Bytes::copy_from_slice(hex);
        let (tlv, used) = decode(&b).unwrap();
        assert_eq!(used, b.len());
        let mut out = BytesMut::new();
        encode(&tlv, &mut out);
        assert_eq!(&out[..], hex);
    }

    #[test]
    fn forms_round_trip() {
        round_trip(&[0x80, 0x01, 0x05]); // [0] primitive, short length
        round_trip(&[0x30, 0x80, 0x80, 0x01, 0x05, 0x00, 0x00]); // indefinite sequence
        round_trip(&[0x04, 0x81, 0x02, 0xaa, 0xbb]); // long form kept
        round_trip(&[0x9f, 0x81, 0x00, 0x01, 0x07]); // high tag number 128
    }

    #[test]
    fn integers_and_strings() {
        let (t, _) = decode(&Bytes::from_static(&[0x02, 0x02, 0xff, 0x38])).unwrap();
        assert_eq!(t.as_i64(), Some(-200));
        let (t, _) = decode(&Bytes::from_static(&[0x0c, 0x02, b'h', b'i'])).unwrap();
        assert_eq!(t.as_str(), Some("hi"));
    }

    #[test]
    fn malformed_values_are_errors() {
        assert_eq!(decode(&Bytes::from_static(&[])), Err(BerError::Truncated));
        assert_eq!(
            decode(&Bytes::from_static(&[0x04, 0x05, 1])),
            Err(BerError::Truncated)
        );
        assert_eq!(
            decode(&Bytes::from_static(&[0x04, 0x80])),
            Err(BerError::BadLength)
        );
        assert_eq!(
            decode(&Bytes::from_static(&[0x04, 0x85, 0, 0, 0, 0, 1])),
            Err(BerError::BadLength)
        );
        assert_eq!(
            decode(&Bytes::from_static(&[0x30, 0x80, 0x04, 0x01])),
            Err(BerError::Truncated)
        );
        let deep: Vec<u8> = std::iter::repeat_n([0x30u8, 0x80], 100).flatten().collect();
        assert_eq!(decode(&Bytes::from(deep)), Err(BerError::TooDeep));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let b = Bytes::from(data);
            if let Ok((tlv, used)) = decode(&b) {
                prop_assert!(used <= b.len());
                let mut out = BytesMut::new();
                encode(&tlv, &mut out);
                // What was read once reads back the same.
                let (again, _) = decode(&out.freeze()).unwrap();
                prop_assert_eq!(again, tlv);
            }
        }
    }
}
