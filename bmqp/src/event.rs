//! Event framing (protocol.h:746-939): a TCP stream of events, each opening with an 8-byte
//! big-endian [`EventHeader`] whose length covers the whole event; every event length is a
//! multiple of 4.
//!
//! Header layout: bytes 0-3 = fragment bit (bit 31, always 0) and length (bits 30-0); byte 4 =
//! protocol version (bits 7-6, [`PROTOCOL_VERSION`]) and [`EventType`] (bits 5-0); byte 5 =
//! header size in 4-byte words (2; readers honour larger values); byte 6 = type-specific (for
//! CONTROL: bits 7-5 = encoding, 0 BER, 1 JSON); byte 7 reserved.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use thiserror::Error;

/// The protocol version every event carries (`Protocol::k_VERSION`, protocol.h:370).
pub const PROTOCOL_VERSION: u8 = 1;
/// Size of the event header this codec writes: 8 bytes, 2 words.
pub const HEADER_SIZE: usize = 8;
/// The smallest header a reader accepts (`EventHeader::k_MIN_HEADER_SIZE`, 6 bytes).
pub const MIN_HEADER_SIZE: usize = 6;
/// Largest event length the format can carry (31 bits).
pub const LENGTH_MAX: usize = (1 << 31) - 1;

/// Event types (protocol.h:463-497). A client session uses CONTROL, PUT, CONFIRM, PUSH, ACK and
/// the heartbeats; the others are broker-to-broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// Control messages (negotiation, open/configure/close queue, disconnect), BER or JSON.
    Control,
    /// Messages posted by a producer.
    Put,
    /// Consumer confirmations.
    Confirm,
    /// Messages delivered to a consumer.
    Push,
    /// Acknowledgements of PUTs.
    Ack,
    /// Heartbeat request: answer with [`EventType::HeartbeatRsp`].
    HeartbeatReq,
    /// Heartbeat response.
    HeartbeatRsp,
    /// Authentication (BlazingMQ since 2025): the client's credentials before its
    /// negotiation, and the broker's answer; BER or JSON as CONTROL.
    Authentication,
    /// Any other type value (broker-to-broker types 6-10, 13-14, or unknown): carried through,
    /// never interpreted.
    Other(u8),
}

impl EventType {
    /// The wire value (6 bits).
    pub fn code(self) -> u8 {
        match self {
            EventType::Control => 1,
            EventType::Put => 2,
            EventType::Confirm => 3,
            EventType::Push => 4,
            EventType::Ack => 5,
            EventType::HeartbeatReq => 11,
            EventType::HeartbeatRsp => 12,
            EventType::Authentication => 15,
            EventType::Other(c) => c & 0x3f,
        }
    }

    /// The type of wire value `code` (6 bits).
    pub fn from_code(code: u8) -> EventType {
        match code & 0x3f {
            1 => EventType::Control,
            2 => EventType::Put,
            3 => EventType::Confirm,
            4 => EventType::Push,
            5 => EventType::Ack,
            11 => EventType::HeartbeatReq,
            12 => EventType::HeartbeatRsp,
            15 => EventType::Authentication,
            c => EventType::Other(c),
        }
    }
}

/// How a CONTROL event's payload is encoded (the event header's type-specific bits 7-5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlEncoding {
    /// BER (X.690), what the SDKs send.
    Ber,
    /// JSON, which the SDKs accept in responses.
    Json,
    /// Another value (the event is refused by a reader that needs the payload).
    Unknown(u8),
}

/// The 8-byte header of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventHeader {
    /// Total event size in bytes, header included.
    pub length: u32,
    /// Protocol version (2 bits); [`PROTOCOL_VERSION`] for every event this codec writes.
    pub version: u8,
    /// The event type.
    pub event_type: EventType,
    /// Header size in 4-byte words (at least 2 as written here).
    pub header_words: u8,
    /// Type-specific byte (CONTROL: encoding in bits 7-5).
    pub type_specific: u8,
}

impl EventHeader {
    /// A header for an event of `event_type` whose body (after the header) is `body_len`
    /// bytes; `type_specific` as given.
    pub fn new(event_type: EventType, body_len: usize, type_specific: u8) -> EventHeader {
        EventHeader {
            length: (HEADER_SIZE + body_len) as u32,
            version: PROTOCOL_VERSION,
            event_type,
            header_words: (HEADER_SIZE / 4) as u8,
            type_specific,
        }
    }

    /// The encoding of a CONTROL event's payload.
    pub fn control_encoding(&self) -> ControlEncoding {
        match self.type_specific >> 5 {
            0 => ControlEncoding::Ber,
            1 => ControlEncoding::Json,
            v => ControlEncoding::Unknown(v),
        }
    }

    /// Appends the 8-byte header to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        out.put_u32(self.length & 0x7fff_ffff);
        out.put_u8((self.version & 0x3) << 6 | self.event_type.code());
        out.put_u8(self.header_words);
        out.put_u8(self.type_specific);
        out.put_u8(0);
    }
}

/// Why bytes are not a valid event stream. Each is fatal for the connection: the stream cannot
/// be resynchronised after a bad header.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EventError {
    /// The fragment bit is set (never used by clients, protocol.h:756).
    #[error("event header has the fragment bit set")]
    Fragment,
    /// The protocol version is not [`PROTOCOL_VERSION`].
    #[error("event protocol version {0}, expected {PROTOCOL_VERSION}")]
    Version(u8),
    /// The length is shorter than the header, or not a multiple of 4.
    #[error("event length {0} is shorter than its header or not a multiple of 4")]
    Length(u32),
    /// The header words claim a header shorter than the minimum or longer than the event.
    #[error("event header of {words} words in an event of {length} bytes")]
    HeaderWords {
        /// The header size claimed, in words.
        words: u8,
        /// The event length.
        length: u32,
    },
    /// The event is larger than the reader's limit.
    #[error("event of {length} bytes over the limit of {max} bytes")]
    TooLarge {
        /// The event length.
        length: u32,
        /// The limit.
        max: usize,
    },
}

/// One event as read off the stream: its header and its body (the bytes after the header,
/// `length - 4 * header_words` of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawEvent {
    /// The header.
    pub header: EventHeader,
    /// The bytes after the header.
    pub body: Bytes,
}

impl RawEvent {
    /// The event with `body` after a fresh header of `event_type`.
    pub fn new(event_type: EventType, type_specific: u8, body: Bytes) -> RawEvent {
        RawEvent {
            header: EventHeader::new(event_type, body.len(), type_specific),
            body,
        }
    }

    /// The whole event as bytes (header then body).
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(HEADER_SIZE + self.body.len());
        self.header.encode(&mut out);
        out.extend_from_slice(&self.body);
        out.freeze()
    }
}

/// An incremental event reader: feed it bytes as they arrive ([`EventDecoder::extend`]), take
/// complete events out ([`EventDecoder::next_event`]). It checks each header before waiting for
/// the body, so an oversized or malformed length is refused as soon as its 8 bytes are in.
#[derive(Debug)]
pub struct EventDecoder {
    buf: BytesMut,
    max_event: usize,
}

impl EventDecoder {
    /// A reader refusing events larger than `max_event` bytes (BlazingMQ's soft limit is 66 MiB
    /// in 0.92.5 and 512 MiB at HEAD; a broker picks its own).
    pub fn new(max_event: usize) -> EventDecoder {
        EventDecoder {
            buf: BytesMut::new(),
            max_event: max_event.min(LENGTH_MAX),
        }
    }

    /// Appends bytes read from the stream.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes buffered and not yet returned as an event.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete event, `Ok(None)` when more bytes are needed, or the reason the
    /// stream is invalid (the caller closes the connection).
    pub fn next_event(&mut self) -> Result<Option<RawEvent>, EventError> {
        if self.buf.len() < HEADER_SIZE {
            return Ok(None);
        }
        let header = parse_header(&self.buf[..HEADER_SIZE])?;
        let length = header.length as usize;
        if length > self.max_event {
            return Err(EventError::TooLarge {
                length: header.length,
                max: self.max_event,
            });
        }
        if self.buf.len() < length {
            return Ok(None);
        }
        let mut event = self.buf.split_to(length).freeze();
        event.advance(4 * header.header_words as usize);
        Ok(Some(RawEvent {
            header,
            body: event,
        }))
    }
}

/// Parses and checks an event header from its first 8 bytes.
pub fn parse_header(bytes: &[u8]) -> Result<EventHeader, EventError> {
    let mut b = &bytes[..HEADER_SIZE];
    let word = b.get_u32();
    if word & 0x8000_0000 != 0 {
        return Err(EventError::Fragment);
    }
    let length = word & 0x7fff_ffff;
    let byte4 = b.get_u8();
    let version = byte4 >> 6;
    if version != PROTOCOL_VERSION {
        return Err(EventError::Version(version));
    }
    let header_words = b.get_u8();
    let type_specific = b.get_u8();
    if (length as usize) < HEADER_SIZE || !length.is_multiple_of(4) {
        return Err(EventError::Length(length));
    }
    let header_size = 4 * header_words as usize;
    if header_size < MIN_HEADER_SIZE.next_multiple_of(4) || header_size > length as usize {
        return Err(EventError::HeaderWords {
            words: header_words,
            length,
        });
    }
    Ok(EventHeader {
        length,
        version,
        event_type: EventType::from_code(byte4),
        header_words,
        type_specific,
    })
}

/// Appends 1 to 4 padding bytes to `out` so its length becomes a multiple of 4, each byte equal
/// to the pad count; data already aligned gets 4 bytes of `4` (bmqp_protocolutil.h:29-36).
pub fn pad(out: &mut BytesMut) {
    let n = 4 - out.len() % 4;
    for _ in 0..n {
        out.put_u8(n as u8);
    }
}

/// The length of `data` without its trailing padding (read from its last byte), or `None`
/// when the padding is invalid (0, over 4, or longer than the data).
pub fn unpadded_len(data: &[u8]) -> Option<usize> {
    let n = *data.last()? as usize;
    (1..=4).contains(&n).then_some(())?;
    data.len().checked_sub(n)
}

/// A heartbeat request or response: a bare header (`00000008 4b020000` / `4c020000`).
pub fn heartbeat(event_type: EventType) -> Bytes {
    RawEvent::new(event_type, 0, Bytes::new()).to_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn heartbeats_are_bare_headers() {
        assert_eq!(
            heartbeat(EventType::HeartbeatReq).as_ref(),
            [0, 0, 0, 8, 0x4b, 2, 0, 0]
        );
        assert_eq!(
            heartbeat(EventType::HeartbeatRsp).as_ref(),
            [0, 0, 0, 8, 0x4c, 2, 0, 0]
        );
    }

    #[test]
    fn padding_round_trips() {
        for len in 0..9 {
            let mut b = BytesMut::from(&vec![7u8; len][..]);
            pad(&mut b);
            assert_eq!(b.len() % 4, 0);
            assert!(b.len() > len && b.len() <= len + 4);
            assert_eq!(unpadded_len(&b), Some(len));
        }
        assert_eq!(unpadded_len(&[1, 2, 0]), None);
        assert_eq!(unpadded_len(&[5, 5, 5, 5, 5]), None);
        assert_eq!(unpadded_len(&[3, 3]), None);
        assert_eq!(unpadded_len(&[]), None);
    }

    #[test]
    fn bad_headers_are_refused() {
        let mut d = EventDecoder::new(1 << 20);
        d.extend(&[0x80, 0, 0, 8, 0x41, 2, 0, 0]);
        assert_eq!(d.next_event(), Err(EventError::Fragment));
        let mut d = EventDecoder::new(1 << 20);
        d.extend(&[0, 0, 0, 8, 0x81, 2, 0, 0]);
        assert_eq!(d.next_event(), Err(EventError::Version(2)));
        let mut d = EventDecoder::new(1 << 20);
        d.extend(&[0, 0, 0, 9, 0x41, 2, 0, 0]);
        assert_eq!(d.next_event(), Err(EventError::Length(9)));
        let mut d = EventDecoder::new(1 << 20);
        d.extend(&[0, 0, 0, 8, 0x41, 3, 0, 0]);
        assert!(matches!(
            d.next_event(),
            Err(EventError::HeaderWords { .. })
        ));
        let mut d = EventDecoder::new(64);
        d.extend(&[0, 0, 1, 0, 0x42, 2, 0, 0]);
        assert_eq!(
            d.next_event(),
            Err(EventError::TooLarge {
                length: 256,
                max: 64
            })
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut d = EventDecoder::new(4096);
            d.extend(&data);
            for _ in 0..200 {
                match d.next_event() {
                    Ok(Some(e)) => prop_assert_eq!(e.body.len() + 4 * e.header.header_words as usize, e.header.length as usize),
                    Ok(None) | Err(_) => break,
                }
            }
        }

        #[test]
        fn events_survive_any_split(bodies in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 1..6), cut in 0usize..400) {
            let mut stream = Vec::new();
            let mut events = Vec::new();
            for b in &bodies {
                let mut body = BytesMut::from(&b[..]);
                pad(&mut body);
                let e = RawEvent::new(EventType::Put, 0, body.freeze());
                stream.extend_from_slice(&e.to_bytes());
                events.push(e);
            }
            let cut = cut.min(stream.len());
            let mut d = EventDecoder::new(1 << 20);
            let mut got = Vec::new();
            for part in [&stream[..cut], &stream[cut..]] {
                d.extend(part);
                while let Some(e) = d.next_event().unwrap() {
                    got.push(e);
                }
            }
            prop_assert_eq!(got, events);
            prop_assert_eq!(d.buffered(), 0);
        }
    }
}
