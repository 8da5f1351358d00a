//! The peer links' encoding of forwarded client messages (docs/bench/JOURNAL.md "Replicas
//! read frames in place, and fewer calls per frame"): `FrameWriter::push` (prost's encoding, which
//! computes a nested message's length again at every level) against `FrameWriter::push_peer`
//! (the two envelopes written by hand), in one process, alternating rounds, on the frames a
//! primary sends a proxy (an ACK and a 1 KiB PUSH per message).
//!
//!     cargo run --release -p bmq-proto --example bench_peer_encode
//!
//! Prints ns per frame for each and their ratio per round; compare within a run.
use std::time::Instant;

use bmq_proto::client::{client_message::Kind, Ack, ClientMessage, Push};
use bmq_proto::peer::{peer_message::Kind as PeerKind, ForwardedClientMessage, PeerMessage};
use bmq_proto::FrameWriter;
use bytes::Bytes;

fn forwarded(inner: ClientMessage) -> PeerMessage {
    PeerMessage {
        kind: Some(PeerKind::Forwarded(ForwardedClientMessage {
            origin_node_id: 2,
            session_id: 17,
            inner: Some(inner),
            partition_id: None,
        })),
    }
}

fn main() {
    let uri = bmq_proto::uri_bytes("bmq://bmq.test/bench-tp-000000b7-0");
    let frames: Vec<PeerMessage> = (0..256u64)
        .flat_map(|i| {
            let guid = Bytes::from(i.to_be_bytes().repeat(2));
            [
                forwarded(ClientMessage {
                    kind: Some(Kind::Ack(Ack {
                        uri: uri.clone(),
                        guid: guid.clone(),
                        status: 0,
                        message: String::new(),
                    })),
                }),
                forwarded(ClientMessage {
                    kind: Some(Kind::Push(Push {
                        uri: uri.clone(),
                        guid,
                        payload: Bytes::from(vec![7u8; 1024]),
                        properties: vec![],
                        delivery_attempt: 1,
                        out_of_order: false,
                        ..Default::default()
                    })),
                }),
            ]
        })
        .collect();
    let mut w = FrameWriter::new(1 << 20, usize::MAX);
    let mut run = |peer: bool| {
        let start = Instant::now();
        let mut n = 0u64;
        for _ in 0..2_000 {
            for f in &frames {
                if peer {
                    w.push_peer(f).unwrap();
                } else {
                    w.push(f).unwrap();
                }
                n += 1;
            }
            w = FrameWriter::new(1 << 20, usize::MAX);
        }
        start.elapsed().as_nanos() as f64 / n as f64
    };
    println!("round  push ns/frame  push_peer ns/frame  ratio");
    for round in 1..=5 {
        let a = run(false);
        let b = run(true);
        println!("{round:5}  {a:13.1}  {b:18.1}  {:.2}", b / a);
    }
}
