//! `RecordFacts`: what the journal's index needs of a record — its position, lease and kind,
//! the GUID, queue URI and payload size of a message, the GUID and app of a confirm, removal or
//! failure — read from wherever the record is: a decoded [`JournalRecord`] ([`facts_of`]) or
//! the body of its frame, borrowed ([`parse_facts`]).
//!
//! Why a reader of our own beside prost: a replica receives its primary's records as journal
//! frames and writes them as they are; it reads each only to index it. Decoding a frame with
//! prost made a `Bytes` of every byte field — an atomic reference count on the peer link's read
//! buffer, taken and given back — and built and dropped a `JournalRecord`: a good part of the
//! reference-count operations per message in a cluster (docs/bench/JOURNAL.md, "Replicas read
//! frames in place, and fewer calls per frame"). [`parse_facts`] reads the
//! protobuf wire format (<https://protobuf.dev/programming-guides/encoding/>) in place: no
//! allocation, no reference count.
//!
//! It accepts the same bodies as `JournalRecord::decode` and reads the same values from them
//! (tested against prost on random and on mutated records): a known field of the wrong wire
//! type, a truncated field, a varint over 10 bytes, field number 0, wire types 6 and 7, an
//! unmatched end-group, and a `string` field that is not UTF-8 are errors; unknown fields
//! (groups too) are skipped; of a scalar field given twice the last counts; a oneof member
//! given twice is merged, and a different member replaces it, as prost's generated code does.

use bmq_proto::client::Property;
use bmq_proto::peer::{journal_record::Kind as RecordKind, JournalRecord, StoredQueueApps};
use prost::Message;

/// How deep unknown groups may nest before a body is refused (prost's default recursion
/// limit).
const DEPTH_MAX: u32 = 100;

/// What the journal's index needs of one record (see the module doc). Slices borrow the
/// record's own bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RecordFacts<'a> {
    /// `JournalRecord.sequence`.
    pub sequence: u64,
    /// `JournalRecord.lease`.
    pub lease: u64,
    /// The record's kind and the fields of it the index reads.
    pub kind: FactKind<'a>,
}

/// The kind of a record, with the fields the index reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FactKind<'a> {
    /// No kind set.
    None,
    /// `StoredMessage`: the queue's URI, the GUID and the payload's length in bytes.
    Message {
        uri: &'a [u8],
        guid: &'a [u8],
        payload_len: usize,
    },
    /// `StoredConfirm` (`failures` `None`), `StoredRemoval` (`None`) or `StoredFailure`
    /// (`Some`): the message's GUID and the app it settles.
    Subject {
        guid: &'a [u8],
        app_id: &'a str,
        failures: Option<u32>,
    },
    /// `StoredDelivery` (written by earlier versions, read and ignored).
    Delivery,
    /// `StoredMarker` (the file's own bookkeeping).
    Marker,
    /// `StoredLeaseStart` (a primary's first record of its lease; nothing to index).
    LeaseStart,
    /// `StoredQueueApps`: a fanout queue's app ids change (rare: read in full when indexed).
    QueueApps(QueueAppsRef<'a>),
}

/// Where a `StoredQueueApps` is: decoded, or in the body of its record's frame (decoded with
/// prost when indexed: an operator's change, not worth a reader of its own). Compared and
/// shown as the record it holds.
#[derive(Clone, Copy)]
pub(crate) enum QueueAppsRef<'a> {
    /// A decoded record's.
    Decoded(&'a StoredQueueApps),
    /// The whole `JournalRecord` body it is the member of.
    Body(&'a [u8]),
}

impl QueueAppsRef<'_> {
    /// The record, decoded (a body was checked by [`parse_facts`], so it decodes).
    pub(crate) fn get(&self) -> StoredQueueApps {
        match self {
            QueueAppsRef::Decoded(q) => (*q).clone(),
            QueueAppsRef::Body(body) => match JournalRecord::decode(*body).map(|r| r.kind) {
                Ok(Some(RecordKind::QueueApps(q))) => q,
                _ => StoredQueueApps::default(),
            },
        }
    }
}

impl PartialEq for QueueAppsRef<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Eq for QueueAppsRef<'_> {}

impl std::fmt::Debug for QueueAppsRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

/// The facts of a decoded record.
pub(crate) fn facts_of(record: &JournalRecord) -> RecordFacts<'_> {
    let kind = match &record.kind {
        None => FactKind::None,
        Some(RecordKind::Message(m)) => FactKind::Message {
            uri: &m.uri,
            guid: &m.guid,
            payload_len: m.payload.len(),
        },
        Some(RecordKind::Confirm(c)) => FactKind::Subject {
            guid: &c.guid,
            app_id: &c.app_id,
            failures: None,
        },
        Some(RecordKind::Removal(r)) => FactKind::Subject {
            guid: &r.guid,
            app_id: &r.app_id,
            failures: None,
        },
        Some(RecordKind::Failure(f)) => FactKind::Subject {
            guid: &f.guid,
            app_id: &f.app_id,
            failures: Some(f.failures),
        },
        Some(RecordKind::Delivery(_)) => FactKind::Delivery,
        Some(RecordKind::Marker(_)) => FactKind::Marker,
        Some(RecordKind::LeaseStart(_)) => FactKind::LeaseStart,
        Some(RecordKind::QueueApps(q)) => FactKind::QueueApps(QueueAppsRef::Decoded(q)),
    };
    RecordFacts {
        sequence: record.sequence,
        lease: record.lease,
        kind,
    }
}

/// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const START_GROUP: u8 = 3;
const END_GROUP: u8 = 4;
const FIXED32: u8 = 5;

/// A cursor over protobuf bytes.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// A base-128 varint of at most 10 bytes (the tenth at most 1), as prost reads it.
    fn varint(&mut self) -> Result<u64, String> {
        let mut value = 0u64;
        for i in 0..10 {
            let Some(&byte) = self.buf.get(i) else {
                return Err("invalid varint".into());
            };
            if i == 9 && byte > 1 {
                return Err("invalid varint".into());
            }
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte < 0x80 {
                self.buf = &self.buf[i + 1..];
                return Ok(value);
            }
        }
        Err("invalid varint".into())
    }

    /// A field key: (field number, wire type).
    fn key(&mut self) -> Result<(u32, u8), String> {
        let key = self.varint()?;
        let key = u32::try_from(key).map_err(|_| format!("invalid key value: {key}"))?;
        let wire = (key & 7) as u8;
        if wire > FIXED32 {
            return Err(format!("invalid wire type value: {wire}"));
        }
        let tag = key >> 3;
        if tag == 0 {
            return Err("invalid tag value: 0".into());
        }
        Ok((tag, wire))
    }

    /// `n` bytes.
    fn take(&mut self, n: u64) -> Result<&'a [u8], String> {
        match usize::try_from(n) {
            Ok(n) if n <= self.buf.len() => {
                let (head, rest) = self.buf.split_at(n);
                self.buf = rest;
                Ok(head)
            }
            _ => Err("buffer underflow".into()),
        }
    }

    /// The value of a length-delimited field.
    fn len_delimited(&mut self) -> Result<&'a [u8], String> {
        let n = self.varint()?;
        self.take(n)
    }

    /// Skips the value of an unknown field `tag` of wire type `wire` (a group up to its end).
    fn skip(&mut self, tag: u32, wire: u8, depth: u32) -> Result<(), String> {
        if depth == 0 {
            return Err("recursion limit reached".into());
        }
        match wire {
            VARINT => self.varint().map(drop),
            FIXED64 => self.take(8).map(drop),
            FIXED32 => self.take(4).map(drop),
            LEN => self.len_delimited().map(drop),
            START_GROUP => loop {
                let (inner, inner_wire) = self.key()?;
                if inner_wire == END_GROUP {
                    if inner != tag {
                        return Err("unexpected end group tag".into());
                    }
                    return Ok(());
                }
                self.skip(inner, inner_wire, depth - 1)?;
            },
            _ => Err("unexpected end group tag".into()),
        }
    }
}

/// Fails unless a known field has the wire type its declaration gives.
fn expect_wire(field: u32, wire: u8, expected: u8) -> Result<(), String> {
    if wire == expected {
        Ok(())
    } else {
        Err(format!(
            "invalid wire type for field {field}: {wire} where {expected} was expected"
        ))
    }
}

/// A `string` field's value: fails unless UTF-8.
fn utf8(field: u32, bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes)
        .map_err(|_| format!("invalid string value in field {field}: data is not UTF-8 encoded"))
}

/// The fields of one oneof member's body the index reads, merged over `prev` (the same member
/// given earlier in the record) as prost merges.
#[derive(Default, Clone, Copy)]
struct Member<'a> {
    uri: &'a [u8],
    guid: &'a [u8],
    payload_len: usize,
    app_id: &'a str,
    failures: u32,
}

/// Reads the body of oneof member `tag` (4 to 10 of `JournalRecord`) over `merged`.
fn read_member<'a>(tag: u32, body: &'a [u8], merged: &mut Member<'a>) -> Result<(), String> {
    let mut r = Reader { buf: body };
    while !r.is_empty() {
        let (field, wire) = r.key()?;
        match (tag, field) {
            // uri and guid: `bytes` in every member but the marker.
            (4..=8, 1) => {
                expect_wire(field, wire, LEN)?;
                merged.uri = r.len_delimited()?;
            }
            (4..=8, 2) => {
                expect_wire(field, wire, LEN)?;
                merged.guid = r.len_delimited()?;
            }
            // StoredMessage: payload (bytes), properties (repeated Property).
            (4, 3) => {
                expect_wire(field, wire, LEN)?;
                merged.payload_len = r.len_delimited()?.len();
            }
            (4, 4) => {
                expect_wire(field, wire, LEN)?;
                Property::decode(r.len_delimited()?).map_err(|e| e.to_string())?;
            }
            // StoredConfirm, StoredFailure, StoredRemoval: app_id (string).
            (5 | 7 | 8, 3) => {
                expect_wire(field, wire, LEN)?;
                merged.app_id = utf8(field, r.len_delimited()?)?;
            }
            // StoredFailure: failures (uint32, truncated as prost does).
            (7, 4) => {
                expect_wire(field, wire, VARINT)?;
                merged.failures = r.varint()? as u32;
            }
            // StoredRemoval: reason (string).
            (8, 4) => {
                expect_wire(field, wire, LEN)?;
                utf8(field, r.len_delimited()?)?;
            }
            // StoredDelivery: attempt (uint32), app_id (string).
            (6, 3) => {
                expect_wire(field, wire, VARINT)?;
                r.varint()?;
            }
            (6, 4) => {
                expect_wire(field, wire, LEN)?;
                utf8(field, r.len_delimited()?)?;
            }
            // StoredMarker: base, covered_through (uint64), runs (repeated LeaseRun), segment
            // (uint32).
            (9, 1 | 2 | 4) => {
                expect_wire(field, wire, VARINT)?;
                r.varint()?;
            }
            (9, 3) => {
                expect_wire(field, wire, LEN)?;
                read_lease_run(r.len_delimited()?)?;
            }
            _ => r.skip(field, wire, DEPTH_MAX - 1)?,
        }
    }
    Ok(())
}

/// Checks the body of a `LeaseRun` (lease, first_sequence: uint64).
fn read_lease_run(body: &[u8]) -> Result<(), String> {
    let mut r = Reader { buf: body };
    while !r.is_empty() {
        let (field, wire) = r.key()?;
        match field {
            1 | 2 => {
                expect_wire(field, wire, VARINT)?;
                r.varint()?;
            }
            _ => r.skip(field, wire, DEPTH_MAX - 2)?,
        }
    }
    Ok(())
}

/// The facts of the record whose protobuf body is `body` (a journal frame without its
/// header), read in place. Errors: whatever `JournalRecord::decode` refuses (see the module
/// doc), with prost's wording where it has one.
pub(crate) fn parse_facts(body: &[u8]) -> Result<RecordFacts<'_>, String> {
    let mut r = Reader { buf: body };
    let (mut sequence, mut lease) = (0, 0);
    // The oneof member last given, and its fields merged so far.
    let mut member: Option<(u32, Member<'_>)> = None;
    while !r.is_empty() {
        let (field, wire) = r.key()?;
        match field {
            1..=3 => {
                expect_wire(field, wire, VARINT)?;
                let value = r.varint()?;
                match field {
                    1 => lease = value,
                    2 => sequence = value,
                    _ => {}
                }
            }
            11 => {
                // Rare: checked with prost, read with prost when indexed.
                expect_wire(field, wire, LEN)?;
                StoredQueueApps::decode(r.len_delimited()?).map_err(|e| e.to_string())?;
                member = Some((field, Member::default()));
            }
            4..=10 => {
                expect_wire(field, wire, LEN)?;
                let body = r.len_delimited()?;
                let mut merged = match member {
                    Some((tag, m)) if tag == field => m,
                    _ => Member::default(),
                };
                read_member(field, body, &mut merged)?;
                member = Some((field, merged));
            }
            _ => r.skip(field, wire, DEPTH_MAX)?,
        }
    }
    let kind = match member {
        None => FactKind::None,
        Some((4, m)) => FactKind::Message {
            uri: m.uri,
            guid: m.guid,
            payload_len: m.payload_len,
        },
        Some((5 | 8, m)) => FactKind::Subject {
            guid: m.guid,
            app_id: m.app_id,
            failures: None,
        },
        Some((7, m)) => FactKind::Subject {
            guid: m.guid,
            app_id: m.app_id,
            failures: Some(m.failures),
        },
        Some((6, _)) => FactKind::Delivery,
        Some((10, _)) => FactKind::LeaseStart,
        Some((11, _)) => FactKind::QueueApps(QueueAppsRef::Body(body)),
        Some(_) => FactKind::Marker,
    };
    Ok(RecordFacts {
        sequence,
        lease,
        kind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bmq_proto::client::PropertyType;
    use bmq_proto::peer::{
        LeaseRun, StoredConfirm, StoredDelivery, StoredFailure, StoredLeaseStart, StoredMarker,
        StoredMessage, StoredRemoval,
    };
    use bytes::Bytes;
    use proptest::prelude::*;

    fn bytes_of(max: usize) -> impl Strategy<Value = Bytes> {
        proptest::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
    }

    fn kind() -> impl Strategy<Value = Option<RecordKind>> {
        let property = (".{0,6}", ".{0,6}", 0i32..4).prop_map(|(key, value, t)| Property {
            key,
            value,
            value_type: t,
        });
        prop_oneof![
            Just(None),
            (
                bytes_of(40),
                bytes_of(20),
                bytes_of(300),
                proptest::collection::vec(property, 0..3)
            )
                .prop_map(|(uri, guid, payload, properties)| Some(
                    RecordKind::Message(StoredMessage {
                        uri,
                        guid,
                        payload,
                        properties,
                    })
                )),
            (bytes_of(40), bytes_of(20), ".{0,8}").prop_map(|(uri, guid, app_id)| Some(
                RecordKind::Confirm(StoredConfirm { uri, guid, app_id })
            )),
            (bytes_of(40), bytes_of(20), ".{0,8}", any::<u32>()).prop_map(
                |(uri, guid, app_id, failures)| Some(RecordKind::Failure(StoredFailure {
                    uri,
                    guid,
                    app_id,
                    failures,
                }))
            ),
            (bytes_of(40), bytes_of(20), ".{0,8}", ".{0,8}").prop_map(
                |(uri, guid, app_id, reason)| Some(RecordKind::Removal(StoredRemoval {
                    uri,
                    guid,
                    app_id,
                    reason,
                }))
            ),
            (bytes_of(40), bytes_of(20), any::<u32>(), ".{0,8}").prop_map(
                |(uri, guid, attempt, app_id)| Some(RecordKind::Delivery(StoredDelivery {
                    uri,
                    guid,
                    attempt,
                    app_id,
                }))
            ),
            (any::<u64>(), any::<u64>(), any::<u32>(), 0usize..3).prop_map(
                |(base, covered_through, segment, n)| Some(RecordKind::Marker(StoredMarker {
                    base,
                    covered_through,
                    runs: (0..n as u64)
                        .map(|i| LeaseRun {
                            lease: i + 1,
                            first_sequence: base.wrapping_add(i),
                        })
                        .collect(),
                    segment,
                }))
            ),
            Just(Some(RecordKind::LeaseStart(StoredLeaseStart {}))),
            (
                bytes_of(40),
                proptest::collection::vec(".{0,8}", 0..3),
                proptest::collection::vec(".{0,8}", 0..2)
            )
                .prop_map(|(uri, app_ids, added)| Some(RecordKind::QueueApps(
                    StoredQueueApps {
                        uri,
                        app_ids,
                        added,
                        removed: Vec::new(),
                    }
                ))),
        ]
    }

    fn record() -> impl Strategy<Value = JournalRecord> {
        (any::<u64>(), any::<u64>(), any::<u64>(), kind()).prop_map(
            |(lease, sequence, timestamp_ms, kind)| JournalRecord {
                lease,
                sequence,
                timestamp_ms,
                kind,
            },
        )
    }

    /// What prost makes of `body`, as facts (`None`: refused).
    fn prost_facts(body: &[u8]) -> Option<(u64, u64, String)> {
        let record = JournalRecord::decode(body).ok()?;
        let f = facts_of(&record);
        Some((f.sequence, f.lease, format!("{:?}", f.kind)))
    }

    fn our_facts(body: &[u8]) -> Option<(u64, u64, String)> {
        let f = parse_facts(body).ok()?;
        Some((f.sequence, f.lease, format!("{:?}", f.kind)))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn reads_what_prost_encodes(r in record()) {
            let body = r.encode_to_vec();
            let facts = parse_facts(&body).expect("a record prost encoded");
            prop_assert_eq!(facts, facts_of(&r));
        }

        #[test]
        fn accepts_and_reads_what_prost_does_in_mutated_bodies(
            r in record(),
            extra in proptest::collection::vec(any::<u8>(), 0..12),
            edits in proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..4), 1..4),
        ) {
            // Records followed by arbitrary bytes (unknown fields, garbage), then bytes
            // overwritten, inserted, removed or the body cut: both readers agree on whether it
            // is a record and on its facts.
            let mut body = r.encode_to_vec();
            body.extend_from_slice(&extra);
            for (at, byte, op) in edits {
                if body.is_empty() {
                    break;
                }
                let at = at % body.len();
                match op {
                    0 => body[at] = byte,
                    1 => body.insert(at, byte),
                    2 => { body.remove(at); }
                    _ => body.truncate(at),
                }
            }
            prop_assert_eq!(our_facts(&body), prost_facts(&body));
        }
    }

    #[test]
    fn merges_and_replaces_oneof_members_as_prost_does() {
        let confirm = |guid: &'static [u8], app: &str| {
            JournalRecord {
                lease: 1,
                sequence: 2,
                timestamp_ms: 0,
                kind: Some(RecordKind::Confirm(StoredConfirm {
                    uri: Bytes::from_static(b"bmq://d/q"),
                    guid: Bytes::from_static(guid),
                    app_id: app.into(),
                })),
            }
            .encode_to_vec()
        };
        let message = JournalRecord {
            lease: 3,
            sequence: 4,
            timestamp_ms: 0,
            kind: Some(RecordKind::Message(StoredMessage {
                uri: Bytes::from_static(b"bmq://d/q"),
                guid: Bytes::from_static(b"g"),
                payload: Bytes::from_static(b"payload"),
                properties: vec![Property {
                    key: "k".into(),
                    value: "v".into(),
                    value_type: PropertyType::String as i32,
                }],
            })),
        }
        .encode_to_vec();
        // The same member twice: merged (the second confirm's app, the first's GUID when the
        // second has none); another member: replaced; scalars: the last.
        let cases: [Vec<u8>; 4] = [
            [confirm(b"g1", "a"), confirm(b"", "b")].concat(),
            [confirm(b"g1", "a"), message.clone()].concat(),
            [message.clone(), confirm(b"g2", "")].concat(),
            [message.clone(), message].concat(),
        ];
        for body in cases {
            assert_eq!(our_facts(&body), prost_facts(&body));
            assert!(our_facts(&body).is_some());
        }
    }

    #[test]
    fn refuses_what_prost_refuses() {
        let cases: [&[u8]; 9] = [
            &[0x08],                         // lease without its varint
            &[0x00, 0x01],                   // field number 0
            &[0x0e, 0x01],                   // wire type 6
            &[0x0a, 0x00],                   // lease as a length-delimited field
            &[0x22, 0x05, 0x0a],             // a message longer than the body
            &[0x2a, 0x02, 0x1a, 0x01, 0xff], // a confirm's app_id not UTF-8 (cut short too)
            &[0x2a, 0x03, 0x1a, 0x01, 0xff], // a confirm's app_id not UTF-8
            &[0x64],                         // an end-group with no group (field 12)
            &[
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
            ], // 11 bytes
        ];
        for body in cases {
            assert!(JournalRecord::decode(body).is_err(), "{body:?}");
            assert!(parse_facts(body).is_err(), "{body:?}");
        }
        // Unknown fields, a group among them, are skipped (field 12: 11 is the queue apps).
        let body = [0x63, 0x08, 0x01, 0x64, 0x10, 0x07];
        assert_eq!(our_facts(&body), prost_facts(&body));
        assert_eq!(parse_facts(&body).unwrap().sequence, 7);
    }
}
