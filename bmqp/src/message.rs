//! The data messages inside PUT, PUSH, ACK and CONFIRM events (bodies after the event header),
//! all big-endian.
//!
//! - PUT (protocol.h:1374-1540, 36-byte `PutHeader`, 9 words): word 0 = flags (bits 31-28) |
//!   message words (27-0: header + options + application data + padding); word 1 = options
//!   words (31-8) | compression (7-5) | header words (4-0); word 2 = queue id; words 3-6 = GUID;
//!   word 7 = CRC32-C of the application data as sent; word 8 = schema id (16) | reserved. Then
//!   the options, the application data (properties area, if flagged, then payload) and 1-4 pad
//!   bytes. Several messages may share one event.
//! - PUSH (protocol.h:2008-2140, 32-byte `PushHeader`, 8 words): as PUT without the CRC word.
//! - ACK (protocol.h:1766-1960): a 4-byte header (`0x16`: 1 header word, 6 words per message),
//!   then 24-byte messages: reserved (4 bits) | status (4) | correlation id (24); GUID; queue id.
//! - CONFIRM (protocol.h:2345-2470): the same 4-byte header, then 24-byte messages: queue id;
//!   GUID; sub-queue id.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use thiserror::Error;

use crate::event::{pad, unpadded_len};

/// PUT flag: the producer wants an ACK (protocol.h:1645-1660).
pub const PUT_ACK_REQUESTED: u8 = 1;
/// PUT/PUSH flag: the application data opens with a message properties area.
pub const MESSAGE_PROPERTIES: u8 = 2;
/// PUSH flag: a redelivery, out of the order of first deliveries (protocol.h:2226-2235).
pub const PUSH_OUT_OF_ORDER: u8 = 4;
/// PUT header size in words.
pub const PUT_HEADER_WORDS: u8 = 9;
/// PUSH header size in words.
pub const PUSH_HEADER_WORDS: u8 = 8;

/// ACK status codes on the wire (bmqp_protocolutil.cpp:160-215).
pub mod ack_status {
    /// Stored (and replicated as the queue's consistency requires).
    pub const SUCCESS: u8 = 0;
    /// The queue holds its maximum number of messages.
    pub const LIMIT_MESSAGES: u8 = 1;
    /// The queue holds its maximum number of bytes.
    pub const LIMIT_BYTES: u8 = 2;
    /// Any other failure ("unknown").
    pub const UNKNOWN: u8 = 5;
    /// The broker could not store the message.
    pub const STORAGE_FAILURE: u8 = 6;
    /// The queue is not ready (no active primary); the SDK may retry.
    pub const NOT_READY: u8 = 7;
}

/// Why an event body does not hold well-formed messages.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MessageError {
    /// The body ends inside a header or a message.
    #[error("truncated: {0}")]
    Truncated(&'static str),
    /// A header declares sizes that do not fit (header words below the minimum, options or
    /// application data beyond the message).
    #[error("bad message header: {0}")]
    BadHeader(&'static str),
    /// The padding after the application data is not 1-4 bytes each equal to the count.
    #[error("bad padding after the application data")]
    BadPadding,
    /// Compressed application data that does not inflate (bad zlib stream, an unknown
    /// algorithm, or more than the allowed size).
    #[error("cannot decompress: {0}")]
    Compression(String),
}

/// Option type of `SUB_QUEUE_INFOS` (protocol.h:671-693): which sub-queues (fanout app
/// readers, by the sub-queue id the client chose) a PUSH is for.
pub const OPTION_SUB_QUEUE_INFOS: u32 = 3;
/// Bit of a `SubQueueInfo`'s RDA byte: unlimited remaining delivery attempts.
pub const RDA_UNLIMITED: u8 = 0x80;

/// The `SUB_QUEUE_INFOS` option, not packed, naming `sub_queue_ids`, each with unlimited
/// remaining delivery attempts. Layout (protocol.h, `OptionHeader` and `SubQueueInfo`): one
/// option header word — type (bits 31-26) | packed (25) = 0 | type-specific (24-21) = the size
/// of one item in words (2) | option words (20-0), header included — then per sub-queue 8
/// bytes: the id (u32), the RDA byte, 3 reserved.
pub fn sub_queue_infos_option(sub_queue_ids: &[u32]) -> Bytes {
    let words = 1 + 2 * sub_queue_ids.len() as u32;
    let mut out = BytesMut::with_capacity(4 * words as usize);
    out.put_u32(OPTION_SUB_QUEUE_INFOS << 26 | 2 << 21 | words);
    for id in sub_queue_ids {
        out.put_u32(*id);
        out.put_u8(RDA_UNLIMITED);
        out.put_bytes(0, 3);
    }
    out.freeze()
}

/// The sub-queue (or subscription) ids a PUSH's options name, in order: those of its
/// `SUB_QUEUE_INFOS` option, packed (the default id 0 alone) or not; empty without one.
/// Other options are skipped.
///
/// Errors: [`MessageError::BadHeader`] for an option whose size runs past the options.
pub fn decode_sub_queue_ids(options: &[u8]) -> Result<Vec<u32>, MessageError> {
    let mut ids = Vec::new();
    let mut rest = options;
    while rest.len() >= 4 {
        let word = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]);
        let kind = word >> 26;
        let packed = word >> 25 & 1 == 1;
        if kind == OPTION_SUB_QUEUE_INFOS && packed {
            // The header alone; its size bits hold the remaining delivery attempts.
            ids.push(0);
            rest = &rest[4..];
            continue;
        }
        let words = (word & 0x1f_ffff) as usize;
        if words == 0 || 4 * words > rest.len() {
            return Err(MessageError::BadHeader("option size past the options"));
        }
        if kind == OPTION_SUB_QUEUE_INFOS {
            let item_words = ((word >> 21) & 0xf).max(1) as usize;
            for item in rest[4..4 * words].chunks_exact(4 * item_words) {
                ids.push(u32::from_be_bytes([item[0], item[1], item[2], item[3]]));
            }
        }
        rest = &rest[4 * words..];
    }
    Ok(ids)
}

/// Compression algorithm ids (bmqt_compressionalgorithmtype.h:46).
pub mod compression {
    /// Not compressed.
    pub const NONE: u8 = 0;
    /// zlib (RFC 1950).
    pub const ZLIB: u8 = 1;
}

/// Inflates `data` compressed with `algorithm` ([`compression`]), refusing output over `max`
/// bytes (a small compressed PUT must not become gigabytes in the broker).
///
/// Errors: [`MessageError::Compression`] for an unknown algorithm, a bad stream or output
/// over `max`.
pub fn decompress(algorithm: u8, data: &[u8], max: usize) -> Result<Bytes, MessageError> {
    use std::io::Read;
    match algorithm {
        compression::NONE => Ok(Bytes::copy_from_slice(data)),
        compression::ZLIB => {
            let mut out = Vec::new();
            let mut reader = flate2::read::ZlibDecoder::new(data).take(max as u64 + 1);
            reader
                .read_to_end(&mut out)
                .map_err(|e| MessageError::Compression(format!("zlib: {e}")))?;
            if out.len() > max {
                return Err(MessageError::Compression(format!(
                    "inflates to more than {max} bytes"
                )));
            }
            Ok(Bytes::from(out))
        }
        other => Err(MessageError::Compression(format!(
            "unknown compression algorithm {other}"
        ))),
    }
}

/// One PUT message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutMessage {
    /// Flags ([`PUT_ACK_REQUESTED`], [`MESSAGE_PROPERTIES`]).
    pub flags: u8,
    /// The queue id the client chose when it opened the queue.
    pub queue_id: i32,
    /// The message GUID, generated by the client.
    pub guid: [u8; 16],
    /// CRC32-C of `app_data` as the client computed it.
    pub crc32c: u32,
    /// Schema id in its wire form (id << 1 | recycled).
    pub schema_wire: u16,
    /// Compression of the application data (0 none, 1 zlib).
    pub compression: u8,
    /// The options area, raw (each option opens with a 4-byte option header).
    pub options: Bytes,
    /// The application data, unpadded: properties area (if flagged) then payload.
    pub app_data: Bytes,
}

impl PutMessage {
    /// Whether `crc32c` matches the application data (Castagnoli).
    pub fn crc_ok(&self) -> bool {
        crc32c::crc32c(&self.app_data) == self.crc32c
    }
}

/// One PUSH message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushMessage {
    /// Flags ([`MESSAGE_PROPERTIES`], [`PUSH_OUT_OF_ORDER`]).
    pub flags: u8,
    /// The consumer's queue id.
    pub queue_id: i32,
    /// The message GUID.
    pub guid: [u8; 16],
    /// Schema id in its wire form.
    pub schema_wire: u16,
    /// Compression of the application data.
    pub compression: u8,
    /// The options area, raw (empty: subscription 0, protocol.h:970).
    pub options: Bytes,
    /// The application data, unpadded.
    pub app_data: Bytes,
}

/// One ACK message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckMessage {
    /// Status ([`ack_status`]), 4 bits.
    pub status: u8,
    /// Correlation id, 24 bits; 0 for clients that generate GUIDs (matched by GUID).
    pub correlation_id: u32,
    /// The PUT's GUID.
    pub guid: [u8; 16],
    /// The producer's queue id.
    pub queue_id: i32,
}

/// One CONFIRM message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfirmMessage {
    /// The consumer's queue id.
    pub queue_id: i32,
    /// The confirmed message's GUID.
    pub guid: [u8; 16],
    /// The sub-queue (0 for the default stream).
    pub sub_queue_id: u32,
}

/// A message header and its areas, shared by PUT and PUSH.
struct Framed<'a> {
    flags: u8,
    compression: u8,
    options: Bytes,
    app_data: Bytes,
    header: &'a [u8],
}

/// Splits the next PUT/PUSH message off `body` (whose header has at least `min_words` words).
fn next_framed<'a>(
    body: &'a Bytes,
    at: &mut usize,
    min_words: usize,
) -> Result<Framed<'a>, MessageError> {
    let rest = &body[*at..];
    if rest.len() < 4 * min_words {
        return Err(MessageError::Truncated("message header"));
    }
    let mut h = &rest[..8];
    let w0 = h.get_u32();
    let w1 = h.get_u32();
    let flags = (w0 >> 28) as u8;
    let message_len = 4 * (w0 & 0x0fff_ffff) as usize;
    let options_len = 4 * (w1 >> 8) as usize;
    let compression = ((w1 >> 5) & 0x7) as u8;
    let header_words = (w1 & 0x1f) as usize;
    if header_words < min_words {
        return Err(MessageError::BadHeader("header words below the minimum"));
    }
    let header_len = 4 * header_words;
    if message_len > rest.len() {
        return Err(MessageError::Truncated("message"));
    }
    if header_len + options_len >= message_len {
        return Err(MessageError::BadHeader("no room for the application data"));
    }
    let data_start = *at + header_len + options_len;
    let padded = &body[data_start..*at + message_len];
    let data_len = unpadded_len(padded).ok_or(MessageError::BadPadding)?;
    let framed = Framed {
        flags,
        compression,
        options: body.slice(*at + header_len..data_start),
        app_data: body.slice(data_start..data_start + data_len),
        header: &body[*at..*at + header_len],
    };
    *at += message_len;
    Ok(framed)
}

fn guid_at(b: &[u8]) -> [u8; 16] {
    b[..16].try_into().expect("16 bytes")
}

/// Every PUT message of a PUT event's body, in order.
pub fn decode_puts(body: &Bytes) -> Result<Vec<PutMessage>, MessageError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let f = next_framed(body, &mut at, PUT_HEADER_WORDS as usize)?;
        let mut h = &f.header[8..];
        let queue_id = h.get_i32();
        let guid = guid_at(h);
        h.advance(16);
        let crc32c = h.get_u32();
        let schema_wire = h.get_u16();
        out.push(PutMessage {
            flags: f.flags,
            queue_id,
            guid,
            crc32c,
            schema_wire,
            compression: f.compression,
            options: f.options,
            app_data: f.app_data,
        });
    }
    Ok(out)
}

fn put_framing(
    out: &mut BytesMut,
    flags: u8,
    header_words: u8,
    compression: u8,
    options: &[u8],
    app_data: &[u8],
) -> usize {
    let padded = app_data.len() + (4 - app_data.len() % 4);
    let words = header_words as usize + options.len() / 4 + padded / 4;
    out.put_u32((u32::from(flags) << 28) | (words as u32 & 0x0fff_ffff));
    out.put_u32(
        ((options.len() / 4) as u32) << 8
            | u32::from(compression & 0x7) << 5
            | u32::from(header_words),
    );
    words
}

fn put_areas(out: &mut BytesMut, options: &[u8], app_data: &[u8]) {
    out.extend_from_slice(options);
    let mut data = BytesMut::from(app_data);
    pad(&mut data);
    out.extend_from_slice(&data);
}

/// A PUT event body holding `messages` (what an SDK sends; for tests and tools).
pub fn encode_puts(messages: &[PutMessage]) -> Bytes {
    let mut out = BytesMut::new();
    for m in messages {
        put_framing(
            &mut out,
            m.flags,
            PUT_HEADER_WORDS,
            m.compression,
            &m.options,
            &m.app_data,
        );
        out.put_i32(m.queue_id);
        out.extend_from_slice(&m.guid);
        out.put_u32(m.crc32c);
        out.put_u16(m.schema_wire);
        out.put_u16(0);
        put_areas(&mut out, &m.options, &m.app_data);
    }
    out.freeze()
}

/// A PUSH event body holding `messages`.
pub fn encode_pushes(messages: &[PushMessage]) -> Bytes {
    let mut out = BytesMut::new();
    for m in messages {
        put_framing(
            &mut out,
            m.flags,
            PUSH_HEADER_WORDS,
            m.compression,
            &m.options,
            &m.app_data,
        );
        out.put_i32(m.queue_id);
        out.extend_from_slice(&m.guid);
        out.put_u16(m.schema_wire);
        out.put_u16(0);
        put_areas(&mut out, &m.options, &m.app_data);
    }
    out.freeze()
}

/// Every PUSH message of a PUSH event's body.
pub fn decode_pushes(body: &Bytes) -> Result<Vec<PushMessage>, MessageError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let f = next_framed(body, &mut at, PUSH_HEADER_WORDS as usize)?;
        let mut h = &f.header[8..];
        let queue_id = h.get_i32();
        let guid = guid_at(h);
        h.advance(16);
        let schema_wire = h.get_u16();
        out.push(PushMessage {
            flags: f.flags,
            queue_id,
            guid,
            schema_wire,
            compression: f.compression,
            options: f.options,
            app_data: f.app_data,
        });
    }
    Ok(out)
}

/// The 4-byte header of ACK and CONFIRM events: 1 header word, 6 words per message.
const SHORT_HEADER: [u8; 4] = [0x16, 0, 0, 0];

/// Reads the ACK/CONFIRM header and returns the messages' bytes, one 24-byte slice each.
fn fixed_messages(body: &Bytes) -> Result<Vec<Bytes>, MessageError> {
    if body.len() < 4 {
        return Err(MessageError::Truncated("header"));
    }
    let header_len = 4 * (body[0] >> 4) as usize;
    let message_len = 4 * (body[0] & 0xf) as usize;
    if header_len < 4 || message_len < 24 || header_len > body.len() {
        return Err(MessageError::BadHeader("header or message words"));
    }
    let rest = body.slice(header_len..);
    if !rest.len().is_multiple_of(message_len) {
        return Err(MessageError::Truncated("message"));
    }
    Ok((0..rest.len() / message_len)
        .map(|i| rest.slice(i * message_len..i * message_len + 24))
        .collect())
}

/// An ACK event body holding `acks`.
pub fn encode_acks(acks: &[AckMessage]) -> Bytes {
    let mut out = BytesMut::with_capacity(4 + 24 * acks.len());
    out.extend_from_slice(&SHORT_HEADER);
    for a in acks {
        out.put_u32(u32::from(a.status & 0xf) << 24 | (a.correlation_id & 0x00ff_ffff));
        out.extend_from_slice(&a.guid);
        out.put_i32(a.queue_id);
    }
    out.freeze()
}

/// Every ACK of an ACK event's body.
pub fn decode_acks(body: &Bytes) -> Result<Vec<AckMessage>, MessageError> {
    fixed_messages(body)?
        .into_iter()
        .map(|m| {
            let mut b = &m[..];
            let w0 = b.get_u32();
            let guid = guid_at(b);
            b.advance(16);
            Ok(AckMessage {
                status: ((w0 >> 24) & 0xf) as u8,
                correlation_id: w0 & 0x00ff_ffff,
                guid,
                queue_id: b.get_i32(),
            })
        })
        .collect()
}

/// A CONFIRM event body holding `confirms`.
pub fn encode_confirms(confirms: &[ConfirmMessage]) -> Bytes {
    let mut out = BytesMut::with_capacity(4 + 24 * confirms.len());
    out.extend_from_slice(&SHORT_HEADER);
    for c in confirms {
        out.put_i32(c.queue_id);
        out.extend_from_slice(&c.guid);
        out.put_u32(c.sub_queue_id);
    }
    out.freeze()
}

/// Every CONFIRM of a CONFIRM event's body.
pub fn decode_confirms(body: &Bytes) -> Result<Vec<ConfirmMessage>, MessageError> {
    fixed_messages(body)?
        .into_iter()
        .map(|m| {
            let mut b = &m[..];
            let queue_id = b.get_i32();
            let guid = guid_at(b);
            b.advance(16);
            Ok(ConfirmMessage {
                queue_id,
                guid,
                sub_queue_id: b.get_u32(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sub_queue_infos_option_layout() {
        // Type 3, not packed, items of 2 words, 3 words in all; sub-queue 1, unlimited RDA.
        let option = sub_queue_infos_option(&[1]);
        assert_eq!(&option[..], &[0x0c, 0x40, 0, 3, 0, 0, 0, 1, 0x80, 0, 0, 0]);
        assert_eq!(decode_sub_queue_ids(&option).unwrap(), vec![1]);
        assert_eq!(
            decode_sub_queue_ids(&sub_queue_infos_option(&[7, 9])).unwrap(),
            vec![7, 9]
        );
        // The packed form (the default id alone, BlazingMQ's pusheventbuilder), after an
        // option of another type (MSG_GROUP_ID, 2 words).
        let mut options = vec![0x08, 0, 0, 2, 1, 2, 3, 4];
        options.extend_from_slice(&[0x0e, 0, 0, 0x80]);
        assert_eq!(decode_sub_queue_ids(&options).unwrap(), vec![0]);
        assert!(decode_sub_queue_ids(&[]).unwrap().is_empty());
        assert!(decode_sub_queue_ids(&[0x0c, 0x40, 0, 9, 0, 0, 0, 1]).is_err());
    }

    fn put(n: u8, data: &[u8]) -> PutMessage {
        PutMessage {
            flags: PUT_ACK_REQUESTED,
            queue_id: i32::from(n),
            guid: [n; 16],
            crc32c: crc32c::crc32c(data),
            schema_wire: 0,
            compression: 0,
            options: Bytes::new(),
            app_data: Bytes::copy_from_slice(data),
        }
    }

    #[test]
    fn puts_round_trip_several_per_event() {
        let msgs = vec![put(1, b"a"), put(2, b"four"), put(3, b"")];
        let body = encode_puts(&msgs);
        let back = decode_puts(&body).unwrap();
        assert_eq!(back, msgs);
        assert!(back.iter().all(PutMessage::crc_ok));
    }

    #[test]
    fn malformed_bodies_are_errors() {
        let body = encode_puts(&[put(1, b"abc")]);
        assert!(decode_puts(&body.slice(..body.len() - 4)).is_err());
        assert!(decode_puts(&body.slice(..10)).is_err());
        let mut bad = BytesMut::from(&body[..]);
        let last = bad.len() - 1;
        bad[last] = 9; // padding count over 4
        assert_eq!(decode_puts(&bad.freeze()), Err(MessageError::BadPadding));
        assert!(decode_acks(&Bytes::from_static(&[0x16, 0, 0])).is_err());
        assert!(decode_confirms(&Bytes::from_static(&[0x16, 0, 0, 0, 1])).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bodies_never_panic(data in proptest::collection::vec(any::<u8>(), 0..300)) {
            let b = Bytes::from(data);
            let _ = decode_puts(&b);
            let _ = decode_pushes(&b);
            let _ = decode_acks(&b);
            let _ = decode_confirms(&b);
        }

        #[test]
        fn acks_and_confirms_round_trip(status in 0u8..16, corr in 0u32..(1 << 24), q in any::<i32>(), g in any::<[u8; 16]>(), s in any::<u32>()) {
            let a = AckMessage { status, correlation_id: corr, guid: g, queue_id: q };
            prop_assert_eq!(decode_acks(&encode_acks(&[a, a])).unwrap(), vec![a, a]);
            let c = ConfirmMessage { queue_id: q, guid: g, sub_queue_id: s };
            prop_assert_eq!(decode_confirms(&encode_confirms(&[c])).unwrap(), vec![c]);
        }

        #[test]
        fn pushes_round_trip(flags in 0u8..16, q in any::<i32>(), g in any::<[u8; 16]>(), data in proptest::collection::vec(any::<u8>(), 0..100)) {
            let m = PushMessage { flags, queue_id: q, guid: g, schema_wire: 0, compression: 0, options: Bytes::new(), app_data: Bytes::from(data) };
            prop_assert_eq!(decode_pushes(&encode_pushes(std::slice::from_ref(&m))).unwrap(), vec![m]);
        }
    }
}
