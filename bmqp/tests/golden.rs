//! Frames captured from the official Python SDK 1.2.2 (libbmq 0.92.5) talking to a throwaway
//! broker (`shared/bmq-wire/captures.txt` and `appendix_frames.txt`, copied into
//! `tests/frames/`): every frame reads as one event; data messages decode to the values the
//! capture shows and encode back to the same bytes; every CONTROL payload reads as one BER
//! value and writes back to the same bytes.

use bmq_bmqp::ber;
use bmq_bmqp::event::{unpadded_len, ControlEncoding, EventDecoder, EventType, RawEvent};
use bmq_bmqp::message::{
    decode_acks, decode_confirms, decode_pushes, decode_puts, encode_acks, encode_confirms,
    encode_pushes, encode_puts, MESSAGE_PROPERTIES, PUT_ACK_REQUESTED,
};
use bytes::{Bytes, BytesMut};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Every captured frame (the hex lines of both files).
fn frames() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for text in [
        include_str!("frames/captures.txt"),
        include_str!("frames/appendix_frames.txt"),
    ] {
        for line in text.lines() {
            let l = line.trim();
            if !l.is_empty() && l.len() % 2 == 0 && l.chars().all(|c| c.is_ascii_hexdigit()) {
                out.push(hex(l));
            }
        }
    }
    out
}

fn read_one(frame: &[u8]) -> RawEvent {
    let mut d = EventDecoder::new(1 << 26);
    d.extend(frame);
    let e = d
        .next_event()
        .expect("valid event")
        .expect("complete event");
    assert_eq!(d.buffered(), 0, "one event per frame");
    assert_eq!(e.header.length as usize, frame.len());
    e
}

#[test]
fn every_captured_frame_is_one_event() {
    let frames = frames();
    assert!(frames.len() >= 40, "{} frames", frames.len());
    for f in &frames {
        let e = read_one(f);
        assert_eq!(e.to_bytes().as_ref(), &f[..], "header re-encodes");
    }
}

#[test]
fn control_payloads_are_ber_and_write_back_identically() {
    let mut n = 0;
    for f in frames() {
        let e = read_one(&f);
        if e.header.event_type != EventType::Control {
            continue;
        }
        assert_eq!(e.header.control_encoding(), ControlEncoding::Ber);
        let len = unpadded_len(&e.body).expect("padded control payload");
        let payload = e.body.slice(..len);
        let (tlv, used) = ber::decode(&payload).expect("one BER value");
        // Anything after the value within the unpadded payload would be a second value.
        assert_eq!(used, payload.len(), "{}", hex_of(&payload));
        let mut out = BytesMut::new();
        ber::encode(&tlv, &mut out);
        assert_eq!(&out[..], &payload[..]);
        n += 1;
    }
    assert!(n >= 30, "{n} control frames");
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn the_captured_put_ack_push_and_confirm() {
    let frames = frames();
    let find = |t: EventType| {
        frames
            .iter()
            .map(|f| read_one(f))
            .find(|e| e.header.event_type == t)
            .unwrap_or_else(|| panic!("a {t:?} frame"))
    };
    let guid: [u8; 16] = hex("400000000000009b64f163e3dd65fc95").try_into().unwrap();

    let put = find(EventType::Put);
    let puts = decode_puts(&put.body).unwrap();
    assert_eq!(puts.len(), 1);
    let p = &puts[0];
    assert_eq!(p.flags, PUT_ACK_REQUESTED | MESSAGE_PROPERTIES);
    assert_eq!((p.queue_id, p.guid), (0, guid));
    assert!(p.crc_ok(), "CRC32-C of the application data");
    assert!(p.app_data.ends_with(b"hello-bmq"));
    assert_eq!(encode_puts(&puts), put.body);

    let ack = find(EventType::Ack);
    let acks = decode_acks(&ack.body).unwrap();
    assert_eq!(acks.len(), 1);
    assert_eq!(
        (
            acks[0].status,
            acks[0].correlation_id,
            acks[0].guid,
            acks[0].queue_id
        ),
        (0, 0, guid, 0)
    );
    assert_eq!(encode_acks(&acks), ack.body);

    let push = find(EventType::Push);
    let pushes = decode_pushes(&push.body).unwrap();
    assert_eq!(pushes.len(), 1);
    assert_eq!(pushes[0].guid, guid);
    assert_eq!(
        pushes[0].app_data, p.app_data,
        "the PUT's application data, unchanged"
    );
    assert_eq!(encode_pushes(&pushes), push.body);

    let confirm = find(EventType::Confirm);
    let confirms = decode_confirms(&confirm.body).unwrap();
    assert_eq!(confirms.len(), 1);
    assert_eq!(
        (
            confirms[0].queue_id,
            confirms[0].guid,
            confirms[0].sub_queue_id
        ),
        (0, guid, 0)
    );
    assert_eq!(encode_confirms(&confirms), confirm.body);
}

#[test]
fn a_stream_of_every_frame_reads_back_in_order() {
    let frames = frames();
    let stream: Vec<u8> = frames.iter().flatten().copied().collect();
    let mut d = EventDecoder::new(1 << 26);
    let mut got = Vec::new();
    // Seven-byte reads: headers and bodies split everywhere.
    for chunk in stream.chunks(7) {
        d.extend(chunk);
        while let Some(e) = d.next_event().unwrap() {
            got.push(e.to_bytes());
        }
    }
    let want: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
    assert_eq!(got, want);
}

/// The frames of `captures.txt` in order, each with its direction line (`C->B ...` or
/// `B->C ...`).
fn labelled_captures() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut label = String::new();
    for line in include_str!("frames/captures.txt").lines() {
        let l = line.trim();
        if l.starts_with("C->B") || l.starts_with("B->C") {
            label = l.to_string();
        } else if !l.is_empty() && l.chars().all(|c| c.is_ascii_hexdigit()) {
            out.push((label.clone(), hex(l)));
        }
    }
    out
}

#[test]
fn captured_requests_decode_and_our_responses_match_the_accepted_ones() {
    use bmq_bmqp::control::{decode_negotiation, decode_request, queue_flags, Request, Response};
    let frames = labelled_captures();
    let mut answered = 0;
    for pair in frames.windows(2) {
        let ((label, request), (next_label, accepted)) = (&pair[0], &pair[1]);
        if !label.starts_with("C->B CONTROL") {
            continue;
        }
        let event = read_one(request);
        if !label.contains("rId=") {
            let identity = decode_negotiation(&event).expect("negotiation");
            assert_eq!(identity.protocol_version, 1);
            assert_eq!(identity.sdk_version, 999_999);
            assert!(identity.has_feature("MPS", "MESSAGE_PROPERTIES_EX"));
            assert_eq!(identity.guid_client_id.len(), 12, "{identity:?}");
            continue;
        }
        let req = decode_request(&event).expect("control request");
        let response = match &req.request {
            Request::OpenQueue(h) => {
                assert_eq!(h.uri, "bmq://bmq.test.mem.priority/q1");
                assert!(h.flags & (queue_flags::READ | queue_flags::WRITE) != 0);
                Response::OpenQueue {
                    deduplication_ms: 300_000,
                }
            }
            Request::ConfigureQueueStream { q_id, params } => {
                assert_eq!(*q_id, 0);
                if params.is_deconfigure() {
                    assert_eq!(params.consumer_priority, i64::from(i32::MIN));
                } else {
                    assert_eq!(params.max_unconfirmed_messages, 1000);
                    assert_eq!(params.max_unconfirmed_bytes, 33_554_432);
                }
                Response::Configure
            }
            Request::CloseQueue { params, is_final } => {
                assert!(*is_final);
                assert_eq!(params.q_id, 0);
                Response::CloseQueue
            }
            Request::Disconnect => Response::Disconnect,
            other => panic!("unexpected {other:?}"),
        };
        assert!(next_label.starts_with("B->C CONTROL"), "{next_label}");
        let ours = req.respond(&response);
        assert_eq!(
            hex_of(&ours),
            hex_of(accepted),
            "our answer to {label} differs from the one the SDK accepted"
        );
        answered += 1;
    }
    assert_eq!(answered, 8);
}

#[test]
fn our_broker_response_matches_the_accepted_one() {
    use bmq_bmqp::control::{broker_response, BrokerIdentity, StatusCategory};
    // The identity the throwaway broker of the capture gave (its features, without
    // subscriptions; the heartbeat defaults); with it our encoder writes the very bytes the
    // SDK accepted.
    let identity = BrokerIdentity {
        version: 999_999,
        process_name: "fakebroker".into(),
        pid: 1,
        host_name: "localhost".into(),
        cluster_name: String::new(),
        node_id: -1,
        features: "PROTOCOL_ENCODING:BER,JSON;MPS:MESSAGE_PROPERTIES_EX".into(),
        heartbeat_interval_ms: 3000,
        max_missed_heartbeats: 10,
    };
    let ours = broker_response(ControlEncoding::Ber, StatusCategory::Success, "", &identity);
    let accepted = labelled_captures()
        .into_iter()
        .find(|(label, _)| label.starts_with("B->C CONTROL"))
        .expect("a broker response")
        .1;
    assert_eq!(hex_of(&ours), hex_of(&accepted));
}
