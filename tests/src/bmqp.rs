//! A raw client of BlazingMQ's client protocol (bmqp) for the multi-process tests: a socket
//! and the `bmq-bmqp` codec, speaking BER as libbmq does or JSON as the Java SDK does. It
//! sends exactly what a test writes, so a test can be a well-behaved SDK or a broken one.

use std::time::Duration;

use anyhow::{bail, ensure, Context};
use bmq_bmqp::ber::{self, Tlv};
use bmq_bmqp::event::{pad, unpadded_len, EventDecoder, EventType, RawEvent};
use bmq_bmqp::message::{
    decode_acks, encode_confirms, encode_puts, AckMessage, ConfirmMessage, PutMessage,
    MESSAGE_PROPERTIES, PUT_ACK_REQUESTED,
};
use bmq_bmqp::properties::{self, PropertyValue};
use bmq_proto::BoxedStream;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a raw client waits for an event before it gives up.
pub const WAIT: Duration = Duration::from_secs(20);

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The first frame the Python SDK 1.2.2 sent (its BER `ClientIdentity`, with a `guidInfo`),
/// from the capture in `bmqp/tests/frames/captures.txt`.
pub fn sdk_negotiation() -> Vec<u8> {
    let captures = include_str!("../../bmqp/tests/frames/captures.txt");
    let line = captures
        .lines()
        .skip_while(|l| !l.starts_with("C->B CONTROL"))
        .nth(1)
        .expect("a captured negotiation");
    hex(line.trim())
}

/// A GUID of the shape BlazingMQ's generator makes (version bits `01`), numbered `n`.
pub fn guid(n: u8) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[0] = 0x40;
    g[15] = n;
    g
}

/// The GUID field of a PUT from a legacy client (the Java SDK): its 24-bit correlation id in
/// bytes 1-3, the rest zero.
pub fn legacy_guid_field(correlation_id: u32) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[1..4].copy_from_slice(&correlation_id.to_be_bytes()[1..]);
    g
}

/// The selection of the named choice a BER event holds (BrokerResponse in a
/// NegotiationMessage, AuthenticationResponse in an AuthenticationMessage).
fn choice_of(event: &RawEvent) -> anyhow::Result<Tlv> {
    let len = unpadded_len(&event.body).context("padding")?;
    let top = ber::decode(&event.body.slice(..len))?.0;
    top.member(0)
        .and_then(|w| w.members().first())
        .cloned()
        .context("a choice")
}

/// A raw bmqp client: a socket, an event decoder, and the events skipped while waiting for
/// another type.
pub struct RawClient {
    stream: BoxedStream,
    decoder: EventDecoder,
    skipped: Vec<RawEvent>,
}

impl RawClient {
    /// Connects to a bmqp listener.
    pub async fn connect(addr: &str) -> anyhow::Result<RawClient> {
        let tcp = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connect to {addr}"))?;
        Ok(RawClient::over(Box::new(tcp)))
    }

    /// Connects to a bmqp listener over TLS, trusting the CA of `ca_file` and verifying the
    /// listener's certificate names the address's host.
    pub async fn connect_tls(addr: &str, ca_file: &std::path::Path) -> anyhow::Result<RawClient> {
        let tcp = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connect to {addr}"))?;
        let connector = bmq_client::tls::client_connector(ca_file)?;
        let name = bmq_client::tls::server_name_of(addr).map_err(anyhow::Error::msg)?;
        let tls = connector
            .connect(name, tcp)
            .await
            .context("TLS handshake")?;
        Ok(RawClient::over(Box::new(tls)))
    }

    fn over(stream: BoxedStream) -> RawClient {
        RawClient {
            stream,
            decoder: EventDecoder::new(1 << 26),
            skipped: Vec::new(),
        }
    }

    /// Negotiates as the Python SDK does (BER) on a connected client; checks the answer.
    pub async fn negotiate(mut self) -> anyhow::Result<RawClient> {
        self.stream.write_all(&sdk_negotiation()).await?;
        let event = self.next_event().await?.context("closed at negotiation")?;
        ensure!(event.header.event_type == EventType::Control);
        let response = choice_of(&event)?;
        ensure!(
            response.tag == 1,
            "brokerResponse, not choice {}",
            response.tag
        );
        let category = response.member(0).and_then(|s| s.member(0));
        ensure!(category.and_then(Tlv::as_i64) == Some(0), "E_SUCCESS");
        Ok(self)
    }

    /// Sends BlazingMQ's AUTHENTICATION (BER, `authenticationRequest {mechanism, data}`) and
    /// returns the answer's status category and message.
    pub async fn authenticate(
        &mut self,
        mechanism: &str,
        data: &[u8],
    ) -> anyhow::Result<(i64, String)> {
        let request = Tlv::context_seq(
            0,
            vec![Tlv::context(0, mechanism.as_bytes()), Tlv::context(1, data)],
        );
        let top = Tlv::sequence(vec![Tlv::context_seq(0, vec![request])]);
        let mut body = BytesMut::new();
        ber::encode(&top, &mut body);
        pad(&mut body);
        self.send(EventType::Authentication, 0, body.freeze()).await;
        let e = self.next_of(EventType::Authentication).await?;
        let response = choice_of(&e)?;
        ensure!(
            response.tag == 1,
            "authenticationResponse, not {}",
            response.tag
        );
        let status = response.member(0).context("a status")?;
        Ok((
            status
                .member(0)
                .and_then(Tlv::as_i64)
                .context("a category")?,
            status
                .member(2)
                .and_then(Tlv::as_str)
                .unwrap_or_default()
                .to_string(),
        ))
    }

    /// Connects and negotiates as the Python SDK does (BER); checks the broker answered
    /// `brokerResponse` with success.
    pub async fn negotiated(addr: &str) -> anyhow::Result<RawClient> {
        RawClient::connect(addr).await?.negotiate().await
    }

    /// Connects and negotiates in JSON as the Java SDK 7171c7c does (`TcpBrokerConnection`:
    /// `PROTOCOL_ENCODING:JSON`, `sdkLanguage` `E_JAVA`, and no `guidInfo`, so the broker
    /// makes the GUIDs), or with a `guidInfo` client id when `guid_client_id` is given.
    pub async fn negotiated_json(
        addr: &str,
        process_name: &str,
        guid_client_id: Option<&str>,
    ) -> anyhow::Result<RawClient> {
        let mut raw = RawClient::connect(addr).await?;
        let mut identity = serde_json::json!({
            "protocolVersion": 1, "sdkVersion": 999999, "clientType": "E_TCPCLIENT",
            "processName": process_name, "pid": 1, "sessionId": 1, "hostName": "localhost",
            "features": "PROTOCOL_ENCODING:JSON;MPS:MESSAGE_PROPERTIES_EX",
            "clusterName": "", "clusterNodeId": -1, "sdkLanguage": "E_JAVA"});
        if let Some(id) = guid_client_id {
            identity["guidInfo"] = serde_json::json!({"clientId": id, "nanoSecondsFromEpoch": 0});
        }
        raw.json(serde_json::json!({ "clientIdentity": identity }))
            .await;
        let v = raw.json_answer().await?;
        ensure!(
            v["brokerResponse"]["result"]["category"] == "E_SUCCESS",
            "negotiation: {v}"
        );
        Ok(raw)
    }

    /// The next event, or `None` when the broker closed the connection (bounded by [`WAIT`]).
    pub async fn next_event(&mut self) -> anyhow::Result<Option<RawEvent>> {
        self.next_event_within(WAIT)
            .await?
            .context("no event within the wait")
    }

    /// The next event within `wait`: `Ok(None)` if none came in time, `Ok(Some(None))` if the
    /// broker closed the connection.
    pub async fn next_event_within(
        &mut self,
        wait: Duration,
    ) -> anyhow::Result<Option<Option<RawEvent>>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(e) = self.decoder.next_event()? {
                return Ok(Some(Some(e)));
            }
            let mut buf = vec![0u8; 65536];
            let Ok(n) = tokio::time::timeout_at(deadline, self.stream.read(&mut buf)).await else {
                return Ok(None);
            };
            match n {
                Ok(0) | Err(_) => return Ok(Some(None)),
                Ok(n) => self.decoder.extend(&buf[..n]),
            }
        }
    }

    /// The next event of `wanted` type, skipping others (e.g. PUSH while waiting for an ACK).
    pub async fn next_of(&mut self, wanted: EventType) -> anyhow::Result<RawEvent> {
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
    pub async fn closed(&mut self) -> anyhow::Result<bool> {
        loop {
            match self.next_event_within(WAIT).await {
                Ok(Some(None)) | Err(_) => return Ok(true),
                Ok(None) => return Ok(false),
                Ok(Some(Some(_))) => continue,
            }
        }
    }

    /// Sends `v` as a JSON-encoded CONTROL event.
    pub async fn json(&mut self, v: serde_json::Value) {
        let mut body = BytesMut::from(v.to_string().as_bytes());
        pad(&mut body);
        self.send(EventType::Control, 1 << 5, body.freeze()).await;
    }

    /// The next CONTROL event, which must be JSON, as a value.
    pub async fn json_answer(&mut self) -> anyhow::Result<serde_json::Value> {
        let e = self.next_of(EventType::Control).await?;
        ensure!(e.header.type_specific == 1 << 5, "answered in JSON");
        let len = unpadded_len(&e.body).context("padding")?;
        Ok(serde_json::from_slice(&e.body[..len])?)
    }

    /// Sends `v` (a JSON ControlMessage with an `rId`) and returns its answer, checking the
    /// answer echoes the `rId`.
    pub async fn json_request(
        &mut self,
        v: serde_json::Value,
    ) -> anyhow::Result<serde_json::Value> {
        let r_id = v["rId"].clone();
        self.json(v).await;
        let answer = self.json_answer().await?;
        ensure!(answer["rId"] == r_id, "answer to rId {r_id}: {answer}");
        Ok(answer)
    }

    /// Writes one event.
    pub async fn send(&mut self, event_type: EventType, type_specific: u8, body: Bytes) {
        let bytes = RawEvent::new(event_type, type_specific, body).to_bytes();
        let _ = self.stream.write_all(&bytes).await;
    }

    /// Writes raw bytes.
    pub async fn send_bytes(&mut self, bytes: &[u8]) {
        let _ = self.stream.write_all(bytes).await;
    }

    /// Opens `uri` as queue id `q_id` for reading and writing in BER (rId = q_id + 1) and
    /// configures the reader with ConfigureQueueStream; checks both answers.
    pub async fn open(&mut self, q_id: u32, uri: &str) -> anyhow::Result<()> {
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

    /// Sends a BER ControlMessage with `r_id` and the choice `selection`.
    pub async fn control(&mut self, r_id: i64, selection: Tlv) {
        let top = Tlv::sequence(vec![
            Tlv::context_int(0, r_id),
            Tlv::context_seq(1, vec![selection]),
        ]);
        let mut body = BytesMut::new();
        ber::encode(&top, &mut body);
        pad(&mut body);
        self.send(EventType::Control, 0, body.freeze()).await;
    }

    /// The choice id of the next BER control answer (an error for a status answer).
    pub async fn control_answer(&mut self) -> anyhow::Result<u32> {
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

    /// Sends one PUT of `data` on `q_id` with `guid` (a GUID, or a legacy client's
    /// correlation id field) and `flags`, its CRC32-C wrong when `bad_crc`.
    pub async fn put(&mut self, q_id: u32, guid: [u8; 16], data: &[u8], flags: u8, bad_crc: bool) {
        let crc = crc32c::crc32c(data) ^ u32::from(bad_crc);
        let put = PutMessage {
            flags,
            queue_id: q_id as i32,
            guid,
            crc32c: crc,
            schema_wire: 0,
            compression: 0,
            options: Bytes::new(),
            app_data: Bytes::copy_from_slice(data),
        };
        self.send(EventType::Put, 0, encode_puts(&[put])).await;
    }

    /// Sends one PUT of `data` with typed `properties` (the new-style properties area, as the
    /// SDKs write it) on `q_id` with `guid` and ACK_REQUESTED.
    pub async fn put_with_properties(
        &mut self,
        q_id: u32,
        guid: [u8; 16],
        properties: &[(String, PropertyValue)],
        data: &[u8],
    ) -> anyhow::Result<()> {
        let mut app_data = BytesMut::new();
        properties::encode(properties, true, &mut app_data)?;
        app_data.extend_from_slice(data);
        let app_data = app_data.freeze();
        let put = PutMessage {
            flags: PUT_ACK_REQUESTED | MESSAGE_PROPERTIES,
            queue_id: q_id as i32,
            guid,
            crc32c: crc32c::crc32c(&app_data),
            // Schema wire id 1: the new style without a schema.
            schema_wire: 1,
            compression: 0,
            options: Bytes::new(),
            app_data,
        };
        self.send(EventType::Put, 0, encode_puts(&[put])).await;
        Ok(())
    }

    /// The ACK messages of the next ACK event.
    pub async fn acks(&mut self) -> anyhow::Result<Vec<AckMessage>> {
        Ok(decode_acks(&self.next_of(EventType::Ack).await?.body)?)
    }

    /// Posts `data` on `q_id` with ACK_REQUESTED; a wrong CRC when `bad_crc`. Returns the ACK
    /// status.
    pub async fn post(
        &mut self,
        q_id: u32,
        guid: [u8; 16],
        data: &[u8],
        bad_crc: bool,
    ) -> anyhow::Result<u8> {
        self.put(q_id, guid, data, PUT_ACK_REQUESTED, bad_crc).await;
        let acks = self.acks().await?;
        let ack = acks.iter().find(|a| a.guid == guid).context("our ACK")?;
        ensure!(ack.queue_id == q_id as i32);
        Ok(ack.status)
    }

    /// Confirms `guid` of queue id `q_id`, sub-queue `sub_queue_id`.
    pub async fn confirm(&mut self, q_id: u32, guid: [u8; 16], sub_queue_id: u32) {
        let confirm = ConfirmMessage {
            queue_id: q_id as i32,
            guid,
            sub_queue_id,
        };
        self.send(EventType::Confirm, 0, encode_confirms(&[confirm]))
            .await;
    }
}
