//! Message properties: the typed name/value area at the start of a PUT's or PUSH's application
//! data when the `MESSAGE_PROPERTIES` flag is set (protocol.h:1101-1345,
//! bmqp_messageproperties.cpp:590-672 in 0.92.5).
//!
//! Layout (big-endian): a 6-byte `MessagePropertiesHeader` — byte 0 = reserved (2 bits) |
//! this header's size / 2 (3 bits) | a property header's size / 2 (3 bits); bytes 1-3 = the
//! area's size in words, padding included; byte 4 reserved; byte 5 = the number of
//! properties. Then one 6-byte `MessagePropertyHeader` per property — bits: reserved (1) |
//! type (5) | value length or offset (26) | reserved (4) | name length (12). Then the names
//! and values, then 1-4 pad bytes (each equal to the count) to a word boundary.
//!
//! Two styles: the old one (schema id 0 on the wire) stores each value's length in its
//! header and the data as name, value, name, value; the new one, "MPS-EX" (schema wire id
//! non-zero, used when the broker advertises `MPS:MESSAGE_PROPERTIES_EX`), stores instead the
//! offset of each name in the data section (the first 0), each value's length being what lies
//! between its name and the next name (the last: up to the end of the data).
//!
//! Types (bmqt_propertytype.h:61-70): 1 bool, 2 char, 3 short, 4 int32, 5 int64, 6 string,
//! 7 binary.

use bytes::{BufMut, Bytes, BytesMut};
use thiserror::Error;

use crate::event::{pad, unpadded_len};

/// Size of the area header and of each property header, bytes.
const HEADER: usize = 6;
/// Longest property name (12 bits).
pub const NAME_LEN_MAX: usize = 0xfff;
/// Most properties in one message (one byte).
pub const PROPERTIES_MAX: usize = 255;

/// A property's typed value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PropertyValue {
    /// Type 1, one byte.
    Bool(bool),
    /// Type 2, one byte.
    Char(i8),
    /// Type 3, two bytes.
    Short(i16),
    /// Type 4, four bytes.
    Int32(i32),
    /// Type 5, eight bytes.
    Int64(i64),
    /// Type 6, UTF-8 text.
    String(String),
    /// Type 7, raw bytes.
    Binary(Bytes),
}

impl PropertyValue {
    /// The type code on the wire.
    pub fn type_code(&self) -> u8 {
        match self {
            PropertyValue::Bool(_) => 1,
            PropertyValue::Char(_) => 2,
            PropertyValue::Short(_) => 3,
            PropertyValue::Int32(_) => 4,
            PropertyValue::Int64(_) => 5,
            PropertyValue::String(_) => 6,
            PropertyValue::Binary(_) => 7,
        }
    }

    fn from_wire(code: u8, b: &[u8]) -> Result<PropertyValue, PropertyError> {
        let fixed = |n: usize| -> Result<&[u8], PropertyError> {
            if b.len() == n {
                Ok(b)
            } else {
                Err(PropertyError::Malformed(
                    "value length does not fit its type",
                ))
            }
        };
        Ok(match code {
            1 => PropertyValue::Bool(fixed(1)?[0] != 0),
            2 => PropertyValue::Char(fixed(1)?[0] as i8),
            3 => PropertyValue::Short(i16::from_be_bytes(fixed(2)?.try_into().expect("2"))),
            4 => PropertyValue::Int32(i32::from_be_bytes(fixed(4)?.try_into().expect("4"))),
            5 => PropertyValue::Int64(i64::from_be_bytes(fixed(8)?.try_into().expect("8"))),
            6 => match std::str::from_utf8(b) {
                Ok(s) => PropertyValue::String(s.to_string()),
                // Not UTF-8: keep the bytes rather than lose them.
                Err(_) => PropertyValue::Binary(Bytes::copy_from_slice(b)),
            },
            7 => PropertyValue::Binary(Bytes::copy_from_slice(b)),
            _ => return Err(PropertyError::Malformed("unknown property type")),
        })
    }

    fn put(&self, out: &mut BytesMut) {
        match self {
            PropertyValue::Bool(v) => out.put_u8(u8::from(*v)),
            PropertyValue::Char(v) => out.put_i8(*v),
            PropertyValue::Short(v) => out.put_i16(*v),
            PropertyValue::Int32(v) => out.put_i32(*v),
            PropertyValue::Int64(v) => out.put_i64(*v),
            PropertyValue::String(v) => out.put_slice(v.as_bytes()),
            PropertyValue::Binary(v) => out.put_slice(v),
        }
    }

    fn wire_len(&self) -> usize {
        match self {
            PropertyValue::Bool(_) | PropertyValue::Char(_) => 1,
            PropertyValue::Short(_) => 2,
            PropertyValue::Int32(_) => 4,
            PropertyValue::Int64(_) => 8,
            PropertyValue::String(v) => v.len(),
            PropertyValue::Binary(v) => v.len(),
        }
    }
}

/// Why a properties area cannot be read or written.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PropertyError {
    /// The area or a header is cut short, or sizes do not add up.
    #[error("malformed message properties: {0}")]
    Malformed(&'static str),
    /// Too many properties, or a name or value too long for the format.
    #[error("message properties too large: {0}")]
    TooLarge(&'static str),
}

/// Splits `app_data` into its properties and the payload after the area. `ex`: the new style
/// (the message's schema wire id is non-zero).
///
/// Errors: [`PropertyError::Malformed`] when the area does not fit `app_data` or its headers
/// do not add up.
pub fn decode(
    app_data: &Bytes,
    ex: bool,
) -> Result<(Vec<(String, PropertyValue)>, Bytes), PropertyError> {
    if app_data.len() < HEADER {
        return Err(PropertyError::Malformed("shorter than its header"));
    }
    let h = &app_data[..HEADER];
    let area_header = 2 * ((h[0] >> 3) & 0x7) as usize;
    let property_header = 2 * (h[0] & 0x7) as usize;
    if area_header < HEADER || property_header < HEADER {
        return Err(PropertyError::Malformed("header sizes below the minimum"));
    }
    let area_len = 4 * (usize::from(h[1]) << 16 | usize::from(h[2]) << 8 | usize::from(h[3]));
    let count = usize::from(h[5]);
    if area_len > app_data.len() || area_len < area_header + count * property_header {
        return Err(PropertyError::Malformed("area size"));
    }
    let area = &app_data[..area_len];
    let data_start = area_header + count * property_header;
    let data_end = unpadded_len(area)
        .filter(|&end| end >= data_start)
        .ok_or(PropertyError::Malformed("padding"))?;
    let data = &area[data_start..data_end];
    let mut headers = Vec::with_capacity(count);
    for i in 0..count {
        let p = &area[area_header + i * property_header..][..HEADER];
        let w = u32::from_be_bytes(p[..4].try_into().expect("4"));
        let code = ((w >> 26) & 0x1f) as u8;
        let len_or_offset = (w & 0x03ff_ffff) as usize;
        let name_len = (u16::from_be_bytes([p[4], p[5]]) & 0x0fff) as usize;
        headers.push((code, len_or_offset, name_len));
    }
    let mut out = Vec::with_capacity(count);
    let mut at = 0usize;
    for (i, &(code, len_or_offset, name_len)) in headers.iter().enumerate() {
        let (name_at, value_len) = if ex {
            let end = match headers.get(i + 1) {
                Some(&(_, next, _)) => next,
                None => data.len(),
            };
            let value_len = end
                .checked_sub(len_or_offset + name_len)
                .ok_or(PropertyError::Malformed("property offsets"))?;
            (len_or_offset, value_len)
        } else {
            (at, len_or_offset)
        };
        let value_at = name_at + name_len;
        if value_at + value_len > data.len() {
            return Err(PropertyError::Malformed("property beyond the area"));
        }
        at = value_at + value_len;
        let name = std::str::from_utf8(&data[name_at..value_at])
            .map_err(|_| PropertyError::Malformed("name is not UTF-8"))?
            .to_string();
        let value = PropertyValue::from_wire(code, &data[value_at..value_at + value_len])?;
        out.push((name, value));
    }
    Ok((out, app_data.slice(area_len..)))
}

/// Appends a properties area with `properties` to `out` (then the caller appends the
/// payload). `ex`: the new style (write the message with a non-zero schema wire id, e.g. 1,
/// "EX format, no schema").
///
/// Errors: [`PropertyError::TooLarge`] for over 255 properties, a name over 4095 bytes or a
/// value over the 26-bit length field.
pub fn encode(
    properties: &[(String, PropertyValue)],
    ex: bool,
    out: &mut BytesMut,
) -> Result<(), PropertyError> {
    if properties.len() > PROPERTIES_MAX {
        return Err(PropertyError::TooLarge("over 255 properties"));
    }
    let mut data = BytesMut::new();
    let mut headers = BytesMut::with_capacity(properties.len() * HEADER);
    for (name, value) in properties {
        if name.len() > NAME_LEN_MAX {
            return Err(PropertyError::TooLarge("name over 4095 bytes"));
        }
        let field = if ex { data.len() } else { value.wire_len() };
        if field > 0x03ff_ffff {
            return Err(PropertyError::TooLarge("value over 64 MiB"));
        }
        headers.put_u32(u32::from(value.type_code()) << 26 | field as u32);
        headers.put_u16(name.len() as u16);
        data.put_slice(name.as_bytes());
        value.put(&mut data);
    }
    let mut area = BytesMut::with_capacity(HEADER + headers.len() + data.len() + 4);
    area.put_bytes(0, HEADER);
    area.extend_from_slice(&headers);
    area.extend_from_slice(&data);
    pad(&mut area);
    let words = area.len() / 4;
    if words > 0x00ff_ffff {
        return Err(PropertyError::TooLarge("area over 64 MiB"));
    }
    area[0] = ((HEADER / 2) as u8) << 3 | (HEADER / 2) as u8;
    area[1] = (words >> 16) as u8;
    area[2] = (words >> 8) as u8;
    area[3] = words as u8;
    area[5] = properties.len() as u8;
    out.extend_from_slice(&area);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The area the Python SDK 1.2.2 wrote for `{'k': 'v'}` (new style), then the payload.
    const CAPTURED: &[u8] = b"\x1b\x00\x00\x04\x00\x01\x18\x00\x00\x00\x00\x01kv\x02\x02hello-bmq";

    #[test]
    fn captured_area_decodes_and_encodes_back() {
        let (props, payload) = decode(&Bytes::from_static(CAPTURED), true).unwrap();
        assert_eq!(
            props,
            vec![("k".to_string(), PropertyValue::String("v".into()))]
        );
        assert_eq!(&payload[..], b"hello-bmq");
        let mut out = BytesMut::new();
        encode(&props, true, &mut out).unwrap();
        out.extend_from_slice(&payload);
        assert_eq!(&out[..], CAPTURED);
    }

    fn value() -> impl Strategy<Value = PropertyValue> {
        prop_oneof![
            any::<bool>().prop_map(PropertyValue::Bool),
            any::<i8>().prop_map(PropertyValue::Char),
            any::<i16>().prop_map(PropertyValue::Short),
            any::<i32>().prop_map(PropertyValue::Int32),
            any::<i64>().prop_map(PropertyValue::Int64),
            ".{0,20}".prop_map(PropertyValue::String),
            proptest::collection::vec(any::<u8>(), 0..20)
                .prop_map(|v| PropertyValue::Binary(Bytes::from(v))),
        ]
    }

    proptest! {
        #[test]
        fn both_styles_round_trip(
            props in proptest::collection::vec(("[a-z]{1,12}", value()), 0..8),
            ex in any::<bool>(),
            payload in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let mut out = BytesMut::new();
            encode(&props, ex, &mut out).unwrap();
            prop_assert_eq!(out.len() % 4, 0);
            out.extend_from_slice(&payload);
            let (back, rest) = decode(&out.freeze(), ex).unwrap();
            prop_assert_eq!(back, props);
            prop_assert_eq!(&rest[..], &payload[..]);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64), ex in any::<bool>()) {
            let _ = decode(&Bytes::from(bytes), ex);
        }
    }
}
