//! Property tests of the frame decoder and the wire messages (DESIGN.md §8):
//! arbitrary bytes from a socket give frames or errors, never a panic, and the way the bytes are
//! split into reads never changes what is decoded.

use bmq_proto::client::ClientMessage;
use bmq_proto::peer::PeerMessage;
use bmq_proto::{FrameCodec, FrameError};
use bytes::BytesMut;
use proptest::prelude::*;
use prost::Message;
use tokio_util::codec::{Decoder, Encoder};

/// Frame size limit of these tests, bytes: small, so the TooLarge path is exercised too.
const MAX: usize = 4096;

/// Feeds `chunks` to a fresh decoder one read at a time and returns what it produced: the
/// decoded messages, then `Some(error text)` if it stopped on an error (as a connection does).
fn decode_all<M: Message + Default>(chunks: &[Vec<u8>]) -> (Vec<M>, Option<String>) {
    let mut codec = FrameCodec::<M>::new(MAX);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(m)) => out.push(m),
                Ok(None) => break,
                Err(e) => return (out, Some(error_kind(&e))),
            }
        }
    }
    (out, None)
}

fn error_kind(e: &FrameError) -> String {
    match e {
        FrameError::TooLarge { length, max } => format!("too large {length} {max}"),
        FrameError::Decode(_) => "decode".to_string(),
        FrameError::Io(_) => "io".to_string(),
    }
}

/// Splits `bytes` at the given cut points (taken modulo the length).
fn split(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    if bytes.is_empty() {
        return vec![];
    }
    let mut points: Vec<usize> = cuts.iter().map(|c| c % bytes.len()).collect();
    points.push(0);
    points.push(bytes.len());
    points.sort_unstable();
    points.dedup();
    points
        .windows(2)
        .map(|w| bytes[w[0]..w[1]].to_vec())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_decode_the_same_whatever_the_reads(
        bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        cuts in proptest::collection::vec(any::<usize>(), 0..16),
    ) {
        // Scenario: garbage on a client or peer port, delivered in arbitrary reads: the decoder
        // returns frames or an error, never panics, and one read or many give the same result.
        let whole_client = decode_all::<ClientMessage>(std::slice::from_ref(&bytes));
        let split_client = decode_all::<ClientMessage>(&split(&bytes, &cuts));
        prop_assert_eq!(whole_client, split_client);
        let whole_peer = decode_all::<PeerMessage>(std::slice::from_ref(&bytes));
        let split_peer = decode_all::<PeerMessage>(&split(&bytes, &cuts));
        prop_assert_eq!(whole_peer, split_peer);
    }

    #[test]
    fn arbitrary_frame_bodies_give_a_message_or_a_decode_error(
        body in proptest::collection::vec(any::<u8>(), 0..1024),
    ) {
        // Scenario: a well-framed body holding arbitrary bytes: a message or a Decode error.
        let mut framed = (body.len() as u32).to_be_bytes().to_vec();
        framed.extend_from_slice(&body);
        for (n, err) in [
            { let (m, e) = decode_all::<ClientMessage>(&[framed.clone()]); (m.len(), e) },
            { let (m, e) = decode_all::<PeerMessage>(&[framed.clone()]); (m.len(), e) },
        ] {
            match err {
                None => prop_assert_eq!(n, 1),
                Some(kind) => {
                    prop_assert_eq!(n, 0);
                    prop_assert_eq!(kind, "decode");
                }
            }
        }
    }

    #[test]
    fn valid_frames_survive_any_split(
        payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..8),
        cuts in proptest::collection::vec(any::<usize>(), 0..16),
    ) {
        // Scenario: several valid frames arrive in arbitrary reads: all are decoded, in order.
        let mut codec = FrameCodec::<ClientMessage>::new(MAX);
        let mut wire = BytesMut::new();
        let mut sent = Vec::new();
        for p in &payloads {
            let m = ClientMessage {
                kind: Some(bmq_proto::client::client_message::Kind::Put(
                    bmq_proto::client::Put {
                        payload: p.clone().into(),
                        ..Default::default()
                    },
                )),
            };
            codec.encode(m.clone(), &mut wire).unwrap();
            sent.push(m);
        }
        let (got, err) = decode_all::<ClientMessage>(&split(&wire, &cuts));
        prop_assert_eq!(err, None);
        prop_assert_eq!(got, sent);
    }

    #[test]
    fn a_declared_length_over_the_limit_is_refused_before_reading_the_body(
        length in (MAX as u32 + 1)..,
    ) {
        // Scenario: a length prefix above the limit is an error at once; no body is awaited.
        let (got, err) = decode_all::<PeerMessage>(&[length.to_be_bytes().to_vec()]);
        prop_assert!(got.is_empty());
        prop_assert_eq!(err, Some(format!("too large {length} {MAX}")));
    }
}
