//! Bad input on the bmqp listener (BlazingMQ's client protocol, issue 19), over real TCP to a
//! real 3-node cluster: garbage, a truncated event, an oversized length, an event type a client
//! never sends, malformed BER, a PUT for a queue id never opened — each closes that connection
//! only, counted in `bmq_bmqp_errors_total`; a PUT whose CRC32-C does not match is NACKed
//! (status 5) and the connection goes on; a HEARTBEAT_REQ is answered. A client negotiated
//! before all of this produces and consumes through it all.
//!
//! The raw client here speaks the protocol with the `bmq-bmqp` codec; its negotiation is the
//! first frame the Python SDK 1.2.2 sent (bmqp/tests/frames/captures.txt).

use std::time::Duration;

use anyhow::{bail, ensure, Context};
use bmq_bmqp::ber::{self, Tlv};
use bmq_bmqp::event::{pad, EventDecoder, EventType, RawEvent};
use bmq_bmqp::message::{
    decode_acks, decode_pushes, encode_confirms, encode_puts, ConfirmMessage, PutMessage,
    PUT_ACK_REQUESTED,
};
use bmq_tests::{metric, Cluster};
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(20);

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The SDK's first frame (its ClientIdentity), from the capture.
fn sdk_negotiation() -> Vec<u8> {
    let captures = include_str!("../../bmqp/tests/frames/captures.txt");
    let line = captures
        .lines()
        .skip_while(|l| !l.starts_with("C->B CONTROL"))
        .nth(1)
        .expect("a captured negotiation");
    hex(line.trim())
}

/// A raw bmqp client: a socket, an event decoder, and the events skipped while waiting for
/// another type.
struct Raw {
    stream: TcpStream,
    decoder: EventDecoder,
    skipped: Vec<RawEvent>,
}

impl Raw {
    async fn connect(addr: &str) -> anyhow::Result<Raw> {
        Ok(Raw {
            stream: TcpStream::connect(addr).await?,
            decoder: EventDecoder::new(1 << 26),
            skipped: Vec::new(),
        })
    }

    /// Connects and negotiates; checks the broker answered `brokerResponse` with success.
    async fn negotiated(addr: &str) -> anyhow::Result<Raw> {
        let mut raw = Raw::connect(addr).await?;
        raw.stream.write_all(&sdk_negotiation()).await?;
        let event = raw.next_event().await?.context("closed at negotiation")?;
        ensure!(event.header.event_type == EventType::Control);
        let top = ber::decode(&event.body)?.0;
        let response = top
            .member(0)
            .and_then(|w| w.members().first())
            .context("a choice")?;
        ensure!(
            response.tag == 1,
            "brokerResponse, not choice {}",
            response.tag
        );
        let category = response.member(0).and_then(|s| s.member(0));
        ensure!(category.and_then(Tlv::as_i64) == Some(0), "E_SUCCESS");
        Ok(raw)
    }

    /// The next event, or `None` when the broker closed the connection (bounded by WAIT).
    async fn next_event(&mut self) -> anyhow::Result<Option<RawEvent>> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(e) = self.decoder.next_event()? {
                return Ok(Some(e));
            }
            let mut buf = vec![0u8; 65536];
            let n = tokio::time::timeout_at(deadline, self.stream.read(&mut buf))
                .await
                .context("no event within the wait")?;
            match n {
                Ok(0) | Err(_) => return Ok(None),
                Ok(n) => self.decoder.extend(&buf[..n]),
            }
        }
    }

    /// The next event of `wanted` type, skipping others (e.g. PUSH while waiting for an ACK).
    async fn next_of(&mut self, wanted: EventType) -> anyhow::Result<RawEvent> {
        if let Some(i) = self
            .skipped
            .iter()
            .position(|e| e.header.event_type == wanted)
        {
            return Ok(self.skipped.remove(i));
        }
        loop {
            let e = self.next_event().await?.context("connection closed")?;
            if e.header.event_type == wanted {
                return Ok(e);
            }
            self.skipped.push(e);
        }
    }

    /// Whether the broker closes the connection (rather than answering) within the wait.
    async fn closed(&mut self) -> anyhow::Result<bool> {
        loop {
            match self.next_event().await {
                Ok(None) | Err(_) => return Ok(true),
                Ok(Some(_)) => continue,
            }
        }
    }

    /// Sends `v` as a JSON-encoded CONTROL event.
    async fn json(&mut self, v: serde_json::Value) {
        let mut body = BytesMut::from(v.to_string().as_bytes());
        pad(&mut body);
        self.send(EventType::Control, 1 << 5, body.freeze()).await;
    }

    async fn send(&mut self, event_type: EventType, type_specific: u8, body: Bytes) {
        let bytes = RawEvent::new(event_type, type_specific, body).to_bytes();
        let _ = self.stream.write_all(&bytes).await;
    }

    /// Opens `uri` as queue id `q_id` for reading and writing (rId = q_id + 1) and configures
    /// the reader; checks both answers.
    async fn open(&mut self, q_id: u32, uri: &str) -> anyhow::Result<()> {
        let handle = Tlv::context_seq(
            0,
            vec![
                Tlv::context(0, uri.as_bytes()),
                Tlv::context_int(1, i64::from(q_id)),
                Tlv::context_int(3, 6),
                Tlv::context_int(4, 1),
                Tlv::context_int(5, 1),
                Tlv::context_int(6, 0),
            ],
        );
        self.control(i64::from(q_id) + 1, Tlv::context_seq(10, vec![handle]))
            .await;
        let answer = self.control_answer().await?;
        ensure!(
            answer == 11,
            "openQueueResponse expected, got choice {answer}"
        );
        let stream = Tlv::context_seq(
            1,
            vec![
                Tlv::context_int(1, 1000),
                Tlv::context_int(2, 1 << 25),
                Tlv::context_int(3, 0),
                Tlv::context_int(4, 1),
            ],
        );
        self.control(
            100 + i64::from(q_id),
            Tlv::context_seq(14, vec![Tlv::context_int(0, i64::from(q_id)), stream]),
        )
        .await;
        let answer = self.control_answer().await?;
        ensure!(
            answer == 15,
            "configureQueueStreamResponse expected, got {answer}"
        );
        Ok(())
    }

    async fn control(&mut self, r_id: i64, selection: Tlv) {
        let top = Tlv::sequence(vec![
            Tlv::context_int(0, r_id),
            Tlv::context_seq(1, vec![selection]),
        ]);
        let mut body = BytesMut::new();
        ber::encode(&top, &mut body);
        pad(&mut body);
        self.send(EventType::Control, 0, body.freeze()).await;
    }

    /// The choice id of the next control answer.
    async fn control_answer(&mut self) -> anyhow::Result<u32> {
        let e = self.next_of(EventType::Control).await?;
        let top = ber::decode(&e.body)?.0;
        let choice = top
            .member(1)
            .and_then(|w| w.members().first())
            .context("a choice")?;
        if choice.tag == 0 {
            bail!(
                "status answer: {:?}",
                choice.member(2).and_then(Tlv::as_str)
            );
        }
        Ok(choice.tag)
    }

    /// Posts `data` on `q_id`; a wrong CRC when `bad_crc`. Returns the ACK status.
    async fn post(
        &mut self,
        q_id: u32,
        guid: [u8; 16],
        data: &[u8],
        bad_crc: bool,
    ) -> anyhow::Result<u8> {
        let crc = crc32c::crc32c(data) ^ u32::from(bad_crc);
        let put = PutMessage {
            flags: PUT_ACK_REQUESTED,
            queue_id: q_id as i32,
            guid,
            crc32c: crc,
            schema_wire: 0,
            compression: 0,
            options: Bytes::new(),
            app_data: Bytes::copy_from_slice(data),
        };
        self.send(EventType::Put, 0, encode_puts(&[put])).await;
        let acks = decode_acks(&self.next_of(EventType::Ack).await?.body)?;
        let ack = acks.iter().find(|a| a.guid == guid).context("our ACK")?;
        ensure!(ack.queue_id == q_id as i32);
        Ok(ack.status)
    }
}

fn guid(n: u8) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[0] = 0x40;
    g[15] = n;
    g
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bmqp_input_closes_only_that_connection() -> anyhow::Result<()> {
    let cluster = Cluster::start(3)?;
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let run = async {
        let node = cluster.node(1);
        let (addr, admin) = (node.bmqp_addr(), node.admin_addr());
        let uri = "bmq://bmq.test/bmqp-bad-input";

        // A good client, negotiated before the bad ones and used after them.
        let mut good = Raw::negotiated(&addr).await?;
        good.open(0, uri).await?;
        ensure!(
            good.post(0, guid(1), b"before", false).await? == 0,
            "ACK SUCCESS"
        );

        let errors = |admin: String| async move { metric(&admin, "bmq_bmqp_errors_total").await };
        let mut counted = errors(admin.clone()).await?;
        let mut expect_counted = |now: f64, what: &str| -> anyhow::Result<()> {
            ensure!(
                now > counted,
                "{what} was not counted in bmq_bmqp_errors_total"
            );
            counted = now;
            Ok(())
        };

        // Garbage instead of an event: its "length" is far over the limit.
        let mut raw = Raw::connect(&addr).await?;
        raw.stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await?;
        ensure!(raw.closed().await?, "garbage: connection not closed");
        expect_counted(errors(admin.clone()).await?, "garbage")?;

        // An oversized length, after negotiation.
        let mut raw = Raw::negotiated(&addr).await?;
        raw.stream.write_all(&hex("7fffffff41020000")).await?;
        ensure!(raw.closed().await?, "oversized: connection not closed");
        expect_counted(errors(admin.clone()).await?, "an oversized event")?;

        // A truncated event, then the client goes away: nothing to count, nothing breaks.
        let mut raw = Raw::negotiated(&addr).await?;
        raw.stream.write_all(&hex("0000004c4102")).await?;
        drop(raw);

        // An event type clients never send (RECOVERY).
        let mut raw = Raw::negotiated(&addr).await?;
        raw.send(EventType::from_code(9), 0, Bytes::from_static(b"\0\0\0\0"))
            .await;
        ensure!(raw.closed().await?, "RECOVERY: connection not closed");
        expect_counted(errors(admin.clone()).await?, "an unknown event type")?;

        // Malformed BER in a CONTROL event.
        let mut raw = Raw::negotiated(&addr).await?;
        raw.send(
            EventType::Control,
            0,
            Bytes::from_static(b"\x30\x80\xa1\x85\x01\x02\x02"),
        )
        .await;
        ensure!(raw.closed().await?, "malformed BER: connection not closed");
        expect_counted(errors(admin.clone()).await?, "malformed BER")?;

        // A PUT for a queue id never opened.
        let mut raw = Raw::negotiated(&addr).await?;
        let put = PutMessage {
            flags: PUT_ACK_REQUESTED,
            queue_id: 7,
            guid: guid(2),
            crc32c: crc32c::crc32c(b"x"),
            schema_wire: 0,
            compression: 0,
            options: Bytes::new(),
            app_data: Bytes::from_static(b"x"),
        };
        raw.send(EventType::Put, 0, encode_puts(&[put])).await;
        ensure!(
            raw.closed().await?,
            "PUT for an unknown queue id: connection not closed"
        );
        expect_counted(
            errors(admin.clone()).await?,
            "a PUT for an unknown queue id",
        )?;

        // A CRC mismatch is NACKed; the connection goes on; a heartbeat is answered.
        let mut raw = Raw::negotiated(&addr).await?;
        raw.open(3, "bmq://bmq.test/bmqp-bad-crc").await?;
        let status = raw.post(3, guid(3), b"damaged", true).await?;
        ensure!(
            status == 5,
            "CRC mismatch: status {status}, want 5 (unknown)"
        );
        expect_counted(errors(admin.clone()).await?, "a CRC mismatch")?;
        ensure!(
            raw.post(3, guid(4), b"intact", false).await? == 0,
            "intact PUT ACKed"
        );
        raw.send(EventType::HeartbeatReq, 0, Bytes::new()).await;
        raw.next_of(EventType::HeartbeatRsp).await?;

        // The good client still produces, and receives and confirms both of its messages.
        ensure!(
            good.post(0, guid(5), b"after", false).await? == 0,
            "ACK SUCCESS after"
        );
        let mut got = Vec::new();
        while got.len() < 2 {
            let e = good.next_of(EventType::Push).await?;
            for p in decode_pushes(&e.body)? {
                got.push(p.app_data.clone());
                let confirm = ConfirmMessage {
                    queue_id: p.queue_id,
                    guid: p.guid,
                    sub_queue_id: 0,
                };
                good.send(EventType::Confirm, 0, encode_confirms(&[confirm]))
                    .await;
            }
        }
        got.sort();
        ensure!(
            got == vec![Bytes::from_static(b"after"), Bytes::from_static(b"before")],
            "{got:?}"
        );
        let (leader, _) = cluster.wait_for_leader(Duration::from_secs(10)).await?;
        ensure!(leader >= 1, "a leader after the bad input");
        Ok::<_, anyhow::Error>(())
    };
    Box::pin(run).await.with_context(|| cluster.log_tails(30))
}

/// A client that speaks JSON, as the Java SDK does (BRIEF.md §2: it sends its negotiation and
/// control messages JSON-encoded, lists only `PROTOCOL_ENCODING:JSON`, and configures readers
/// with ConfigureStream): every answer comes back in JSON with the request's `rId`, and a
/// message goes round trip. (No Java SDK runs here: this is our reading of its messages.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_client_negotiates_opens_and_round_trips() -> anyhow::Result<()> {
    let cluster = Cluster::start(3)?;
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let run = async {
        let mut raw = Raw::connect(&cluster.node(2).bmqp_addr()).await?;
        let answer = |e: RawEvent| -> anyhow::Result<serde_json::Value> {
            ensure!(e.header.type_specific == 1 << 5, "answered in JSON");
            let len = bmq_bmqp::event::unpadded_len(&e.body).context("padding")?;
            Ok(serde_json::from_slice(&e.body[..len])?)
        };
        raw.json(serde_json::json!({"clientIdentity": {
                "protocolVersion": 1, "sdkVersion": 1, "clientType": "E_TCPCLIENT",
                "processName": "json-client", "pid": 1, "sessionId": 1, "hostName": "test",
                "features": "PROTOCOL_ENCODING:JSON;MPS:MESSAGE_PROPERTIES_EX",
                "clusterName": "", "clusterNodeId": -1, "sdkLanguage": "E_JAVA",
                "guidInfo": {"clientId": "0A0B0C0D0E0F", "nanoSecondsFromEpoch": 0}}}))
            .await;
        let v = answer(raw.next_of(EventType::Control).await?)?;
        ensure!(
            v["brokerResponse"]["result"]["category"] == "E_SUCCESS",
            "negotiation: {v}"
        );
        let uri = "bmq://bmq.test/bmqp-json";
        raw.json(
            serde_json::json!({"rId": 1, "openQueue": {"handleParameters": {
                "uri": uri, "qId": 0, "flags": 6, "readCount": 1, "writeCount": 1,
                "adminCount": 0}}}),
        )
        .await;
        let v = answer(raw.next_of(EventType::Control).await?)?;
        ensure!(v["rId"] == 1, "{v}");
        ensure!(
            v["openQueueResponse"]["originalRequest"]["handleParameters"]["uri"] == uri,
            "open: {v}"
        );
        raw.json(
            serde_json::json!({"rId": 2, "configureStream": {"qId": 0, "streamParameters": {
                "appId": "__default", "subscriptions": [{"sId": 1,
                "expression": {"version": "E_UNDEFINED", "text": ""},
                "consumers": [{"maxUnconfirmedMessages": 10, "maxUnconfirmedBytes": 1048576,
                               "consumerPriority": 0, "consumerPriorityCount": 1}]}]}}}),
        )
        .await;
        let v = answer(raw.next_of(EventType::Control).await?)?;
        ensure!(
            v["rId"] == 2 && v["configureStreamResponse"]["request"]["qId"] == 0,
            "configure: {v}"
        );
        ensure!(
            raw.post(0, guid(9), b"json", false).await? == 0,
            "ACK SUCCESS"
        );
        let push = decode_pushes(&raw.next_of(EventType::Push).await?.body)?;
        ensure!(
            push.len() == 1 && &push[0].app_data[..] == b"json",
            "{push:?}"
        );
        raw.json(serde_json::json!({"rId": 3, "disconnect": {}}))
            .await;
        let v = answer(raw.next_of(EventType::Control).await?)?;
        ensure!(
            v["rId"] == 3 && v.get("disconnectResponse").is_some(),
            "disconnect: {v}"
        );
        Ok::<_, anyhow::Error>(())
    };
    Box::pin(run).await.with_context(|| cluster.log_tails(30))
}
