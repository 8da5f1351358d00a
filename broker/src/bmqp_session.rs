//! The bmqp listener: applications written with BlazingMQ's own SDKs (C++ libbmq, Java, Python
//! `blazingmq`) connect to `[[members]] bmqp_port` and produce and consume through the cluster
//! unchanged (issue 19).
//!
//! A connection negotiates first (the SDK's `ClientIdentity`, answered with a
//! `BrokerResponse` in the client's encoding), then becomes an ordinary client session: this
//! file is only a [`ClientWire`] that translates BlazingMQ's events to and from our
//! [`ClientMessage`]s, so the session's proxy, retransmission to moved primaries, GUID
//! de-duplication, authorisation and metrics are the same as for our own clients
//! ([`crate::session`]). What the translation keeps per connection:
//!
//! - the queue ids the client chose (`qId` ↔ URI), and for each open reader the stream
//!   parameters it configured: deliveries wait until the reader's ConfigureQueueStream, stop at
//!   its "deconfigure" (priority `i32::MIN`) and respect its `maxUnconfirmedMessages/Bytes`
//!   (messages past them are held here, and go back to the queue if the reader closes);
//! - the control requests in flight (`rId`, echoed in each response); an OpenQueue answered
//!   NOT_READY (no active primary yet, as during a failover) is asked again every 250 ms until
//!   `limits.request_timeout_ms`, as BlazingMQ holds an open until the queue is ready — libbmq
//!   gives a queue up if its reopen after a reconnection fails;
//! - the GUIDs of PUTs sent without `ACK_REQUESTED`: a success is not reported to them, a
//!   failure is (as BlazingMQ does).
//!
//! Properties: bmqp's typed properties travel in our `Property` with their type
//! (`PropertyType`), so an SDK consumer gets back the types an SDK producer sent; our own
//! clients' string properties arrive as strings. PUSHes use the new-style properties area
//! (`MESSAGE_PROPERTIES_EX`) for clients that advertise it, the old style otherwise.
//! zlib-compressed PUTs are inflated (at most `frame_size_max_bytes`).
//!
//! Authorisation: bmqp 1.2 carries no credentials, so an SDK client gets the permissions of
//! the token that `[auth] bmqp_identity` names (`bmqctl cluster up` names one allowed to
//! produce and consume everywhere); without it, an anonymous client opens no queue while
//! tokens are configured, and everything without tokens. The listener is plain TCP: the SDKs of this protocol version have no TLS.
//!
//! Bad input — a malformed or oversized event, malformed BER or JSON, an event type a client
//! never sends, a PUT or CONFIRM for a queue id that is not open — closes this connection
//! with a logged reason and `bmq_bmqp_errors_total{reason}`; a PUT whose CRC32-C does not
//! match its data, whose properties are malformed or whose compression does not inflate is
//! NACKed (status 5, "unknown") and counted. Nothing here panics on input, and nothing here
//! affects another connection. Never is an ACK or PUSH sent for a queue id the client does not
//! have open (libbmq does not check, BRIEF.md §1.6).
//!
//! Heartbeats: every `HEARTBEAT_REQ` is answered; none is sent (the Java SDK cannot decode
//! one, and libbmq 1.2 does not need them).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bmq_bmqp::control::{
    self, broker_response, queue_flags, BrokerIdentity, ClientIdentity as SdkIdentity,
    ControlRequest, Request, Response, StatusCategory, StreamParameters, BROKER_FEATURES,
};
use bmq_bmqp::event::{heartbeat, ControlEncoding, EventDecoder, EventType, RawEvent};
use bmq_bmqp::message::{
    ack_status, decode_confirms, decode_puts, decompress, encode_acks, encode_pushes,
    sub_queue_infos_option, AckMessage, PushMessage, MESSAGE_PROPERTIES, PUT_ACK_REQUESTED,
};
use bmq_bmqp::properties::{self, PropertyValue};
use bmq_proto::client::{
    client_message::Kind, AckStatus, ClientMessage, CloseQueue, Confirm, ConsumerOptions,
    Disconnect, OpenQueue, Property, PropertyType, Put, StatusCode,
};
use bmq_proto::{uri_bytes, uri_str, uri_text, UriBytes};
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

use crate::auth::bmqp_identity;
use crate::router::Router;
use crate::session::{run, ClientWire, WireInput, HELLO_TIMEOUT};

/// Largest PUSH or ACK event this listener writes; more messages go into further events.
const EVENT_BYTES_MAX: usize = 1 << 20;
/// Delay before an OpenQueue answered NOT_READY is asked again.
const OPEN_RETRY_DELAY: std::time::Duration = std::time::Duration::from_millis(250);
/// Most requests one [`ClientWire::recv`] hands to the session at once.
const EVENTS_PER_TURN_MAX: usize = 1024;
/// Read buffer size.
const READ_CHUNK: usize = 64 * 1024;
/// This broker's version as the SDKs see it (`brokerVersion`; they do not check it).
const BROKER_VERSION: i64 = 1;

/// Counts a bad input and says why, for the connection's end.
fn bad(reason: &'static str, detail: impl std::fmt::Display) -> String {
    metrics::counter!("bmq_bmqp_errors_total", "reason" => reason).increment(1);
    format!("{reason}: {detail}")
}

/// Accepts BlazingMQ SDK connections on `listener` until the process ends.
pub async fn serve_bmqp_clients(listener: TcpListener, router: Arc<Router>) {
    info!(addr = ?listener.local_addr().ok(), "bmqp listener (BlazingMQ SDK clients) ready");
    loop {
        let (stream, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "bmqp listener accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        if router.session_count() >= router.config().limits.client_sessions_max as usize {
            metrics::counter!("bmq_client_connections_refused_total").increment(1);
            warn!(%remote, "bmqp connection refused: client_sessions_max reached");
            continue;
        }
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        tokio::spawn(async move {
            metrics::counter!("bmq_bmqp_connections_total").increment(1);
            serve_connection(stream, remote.to_string(), router).await;
        });
    }
}

/// Negotiation, then the session.
async fn serve_connection(stream: TcpStream, remote: String, router: Arc<Router>) {
    let max_event = router.config().limits.frame_size_max_bytes as usize;
    let (read, write) = stream.into_split();
    let mut wire = BmqpWire {
        read,
        write,
        decoder: EventDecoder::new(max_event),
        read_buf: BytesMut::with_capacity(READ_CHUNK),
        out: BytesMut::new(),
        acks: Vec::new(),
        pushes: Vec::new(),
        encoding: ControlEncoding::Ber,
        properties_ex: false,
        max_app_data: max_event,
        queues: HashMap::new(),
        by_uri: HashMap::new(),
        requests: HashMap::new(),
        next_request_id: 1,
        disconnect: None,
        unacked_silent: HashSet::new(),
        open_retries: Vec::new(),
        open_timeout: router.config().limits.request_timeout(),
        deduplication_ms: i64::try_from(router.config().limits.duplicate_guid_window_ms)
            .unwrap_or(i64::MAX),
    };
    let negotiated = tokio::time::timeout(HELLO_TIMEOUT, wire.next_event()).await;
    let event = match negotiated {
        Ok(Ok(Some(event))) => event,
        Ok(Ok(None)) => return,
        Ok(Err(reason)) => {
            warn!(%remote, %reason, "bmqp connection closed before negotiation");
            return;
        }
        Err(_) => {
            let _ = bad("negotiation_timeout", "no negotiation message");
            warn!(%remote, "bmqp client sent no negotiation in time; closed");
            return;
        }
    };
    let sdk = match (event.header.event_type, control::decode_negotiation(&event)) {
        (EventType::Control, Ok(sdk)) => sdk,
        (t, outcome) => {
            let detail = match outcome {
                Err(e) => e.to_string(),
                Ok(_) => format!("event type {t:?}"),
            };
            let reason = bad("negotiation", detail);
            warn!(%remote, %reason, "bad bmqp negotiation; closed");
            return;
        }
    };
    wire.encoding = sdk.best_encoding();
    wire.properties_ex = sdk.has_feature("MPS", "MESSAGE_PROPERTIES_EX");
    let me = router.config().self_member();
    let broker = BrokerIdentity {
        version: BROKER_VERSION,
        process_name: "bmq-broker".into(),
        pid: i64::from(std::process::id()),
        host_name: me.host.clone(),
        cluster_name: router.config().cluster_name.clone(),
        node_id: i64::from(me.id),
        features: BROKER_FEATURES.into(),
    };
    let client_id = describe(&sdk);
    let identity = bmqp_identity(&router.config().auth);
    wire.out.extend_from_slice(&broker_response(
        wire.encoding,
        StatusCategory::Success,
        "",
        &broker,
    ));
    info!(%remote, client = %client_id, encoding = ?wire.encoding, "BlazingMQ SDK client negotiated");
    run(wire, identity, &client_id, remote, router).await;
}

fn describe(sdk: &SdkIdentity) -> String {
    let language = match sdk.sdk_language {
        2 => "java",
        _ => "c++",
    };
    format!(
        "bmqp:{}:{}@{} (sdk {} {language})",
        sdk.process_name, sdk.pid, sdk.host_name, sdk.sdk_version
    )
}

/// One queue the client has open, by its `qId`.
struct QueueHandle {
    uri: String,
    /// `uri` as the per-message frames carry it (shared by every PUT and CONFIRM: a reference
    /// count each, not an allocation).
    uri_bytes: UriBytes,
    /// The reader's stream parameters; `None` until its first ConfigureQueueStream, or after
    /// a deconfigure: deliveries wait.
    stream: Option<StreamParameters>,
    /// Delivered and not confirmed by the client: GUID -> application data bytes.
    unconfirmed: HashMap<[u8; 16], usize>,
    unconfirmed_bytes: usize,
    /// Deliveries past the client's limits or before it configured, in order.
    held: VecDeque<PushMessage>,
    /// The `SUB_QUEUE_INFOS` option of this handle's PUSHes: a fanout app reader's sub-queue
    /// id (libbmq routes a PUSH without it to sub-queue 0, the default stream); empty for
    /// the default stream.
    push_options: Bytes,
}

impl QueueHandle {
    fn may_deliver(&self) -> bool {
        match &self.stream {
            None => false,
            Some(p) => {
                (self.unconfirmed.len() as i64) < p.max_unconfirmed_messages
                    && (p.max_unconfirmed_bytes <= 0
                        || (self.unconfirmed_bytes as i64) < p.max_unconfirmed_bytes)
            }
        }
    }
}

/// What a request in flight to the session was.
enum Pending {
    /// An OpenQueue: the request, the client's queue id, and until when a NOT_READY answer
    /// (no active primary yet, e.g. during a failover) is retried.
    Open(ControlRequest, u32, tokio::time::Instant),
    Close(ControlRequest, u32),
}

/// BlazingMQ's client protocol as a [`ClientWire`] (see the module doc).
struct BmqpWire {
    read: OwnedReadHalf,
    write: OwnedWriteHalf,
    decoder: EventDecoder,
    read_buf: BytesMut,
    /// Bytes to write, in order (control responses, heartbeats, sealed ACK/PUSH events).
    out: BytesMut,
    /// ACKs and PUSHes of this turn, batched into events before the next control response.
    acks: Vec<AckMessage>,
    pushes: Vec<PushMessage>,
    encoding: ControlEncoding,
    properties_ex: bool,
    max_app_data: usize,
    queues: HashMap<u32, QueueHandle>,
    by_uri: HashMap<String, u32>,
    requests: HashMap<u64, Pending>,
    next_request_id: u64,
    disconnect: Option<ControlRequest>,
    /// GUIDs of PUTs without ACK_REQUESTED still waiting for their outcome.
    unacked_silent: HashSet<[u8; 16]>,
    /// OpenQueues answered NOT_READY, to ask again at the given time: (when, request, queue
    /// id, deadline).
    open_retries: Vec<(
        tokio::time::Instant,
        ControlRequest,
        u32,
        tokio::time::Instant,
    )>,
    /// How long an OpenQueue is retried while the answer is NOT_READY:
    /// `limits.request_timeout_ms`.
    open_timeout: std::time::Duration,
    /// `deduplicationTimeMs` told to the SDK (how long it may resend an un-ACKed PUT): the
    /// primaries' duplicate window, `limits.duplicate_guid_window_ms`.
    deduplication_ms: i64,
}

impl BmqpWire {
    /// The next whole event, reading as needed (cancel-safe: bytes read stay in the decoder).
    /// `Ok(None)`: the client closed the connection.
    async fn next_event(&mut self) -> Result<Option<RawEvent>, String> {
        loop {
            match self.decoder.next_event() {
                Ok(Some(event)) => return Ok(Some(event)),
                Ok(None) => {}
                Err(e) => return Err(bad("event", e)),
            }
            self.read_buf.clear();
            match self.read.read_buf(&mut self.read_buf).await {
                Ok(0) => return Ok(None),
                Ok(_) => {
                    quick_ack(self.read.as_ref());
                    self.decoder.extend(&self.read_buf)
                }
                Err(e) => return Err(format!("read failed: {e}")),
            }
        }
    }

    /// Encodes this turn's ACKs and PUSHes into events after what `out` holds.
    fn seal(&mut self) {
        for chunk in batches(&self.acks, |_| 24) {
            self.out
                .extend_from_slice(&event(EventType::Ack, encode_acks(chunk)));
        }
        self.acks.clear();
        for chunk in batches(&self.pushes, |p| 40 + p.app_data.len() + p.options.len()) {
            self.out
                .extend_from_slice(&event(EventType::Push, encode_pushes(chunk)));
        }
        self.pushes.clear();
    }

    fn respond(&mut self, request: &ControlRequest, response: Response) {
        self.seal();
        self.out.extend_from_slice(&request.respond(&response));
    }

    fn refuse(&mut self, request: &ControlRequest, category: StatusCategory, message: String) {
        self.respond(
            request,
            Response::Status {
                category,
                code: -1,
                message,
            },
        );
    }

    fn request_id(&mut self) -> u64 {
        let id = self.next_request_id;
        self.next_request_id += 1;
        id
    }

    /// Translates one event from the client; `Err` ends the connection.
    fn handle_event(
        &mut self,
        event: RawEvent,
        into: &mut Vec<ClientMessage>,
    ) -> Result<(), String> {
        match event.header.event_type {
            EventType::Control => self.handle_control(&event, into),
            EventType::Put => self.handle_puts(&event, into),
            EventType::Confirm => {
                let confirms = decode_confirms(&event.body).map_err(|e| bad("confirm", e))?;
                for c in confirms {
                    let q_id = c.queue_id as u32;
                    let Some(handle) = self.queues.get_mut(&q_id) else {
                        return Err(bad("unknown_queue", format!("CONFIRM for queue id {q_id}")));
                    };
                    if let Some(size) = handle.unconfirmed.remove(&c.guid) {
                        handle.unconfirmed_bytes -= size;
                    }
                    into.push(ClientMessage {
                        kind: Some(Kind::Confirm(Confirm {
                            uri: handle.uri_bytes.clone(),
                            guid: Bytes::copy_from_slice(&c.guid),
                        })),
                    });
                    self.release(q_id);
                }
                Ok(())
            }
            EventType::HeartbeatReq => {
                self.seal();
                self.out
                    .extend_from_slice(&heartbeat(EventType::HeartbeatRsp));
                Ok(())
            }
            EventType::HeartbeatRsp => Ok(()),
            other => Err(bad("event_type", format!("{other:?} from a client"))),
        }
    }

    fn handle_control(
        &mut self,
        event: &RawEvent,
        into: &mut Vec<ClientMessage>,
    ) -> Result<(), String> {
        let request = control::decode_request(event).map_err(|e| bad("control", e))?;
        match request.request.clone() {
            Request::OpenQueue(h) => {
                if self.queues.contains_key(&h.q_id) {
                    let why = format!("queue id {} is already open", h.q_id);
                    self.refuse(&request, StatusCategory::InvalidArgument, why);
                    return Ok(());
                }
                let uri = h.uri.split('?').next().unwrap_or_default().to_string();
                if self.by_uri.contains_key(&uri) {
                    let why = format!("{uri} is already open in this session");
                    self.refuse(&request, StatusCategory::InvalidArgument, why);
                    return Ok(());
                }
                let request_id = self.request_id();
                into.push(our_open(request_id, &h));
                let deadline = tokio::time::Instant::now() + self.open_timeout;
                self.requests
                    .insert(request_id, Pending::Open(request, h.q_id, deadline));
            }
            Request::ConfigureQueueStream { q_id, params } => {
                self.configure(&request, q_id, Some(params));
            }
            Request::ConfigureStream { q_id, params } => self.configure(&request, q_id, params),
            Request::CloseQueue { params, .. } => {
                let Some(uri) = self.queues.get(&params.q_id).map(|h| h.uri.clone()) else {
                    let why = format!("queue id {} is not open", params.q_id);
                    self.refuse(&request, StatusCategory::InvalidArgument, why);
                    return Ok(());
                };
                let request_id = self.request_id();
                into.push(ClientMessage {
                    kind: Some(Kind::CloseQueue(CloseQueue { request_id, uri })),
                });
                self.requests
                    .insert(request_id, Pending::Close(request, params.q_id));
            }
            Request::Disconnect => {
                self.disconnect = Some(request);
                into.push(ClientMessage {
                    kind: Some(Kind::Disconnect(Disconnect {})),
                });
            }
            Request::Unsupported(what) => {
                metrics::counter!("bmq_bmqp_errors_total", "reason" => "unsupported").increment(1);
                let why = format!("{what} is not supported by this broker");
                self.refuse(&request, StatusCategory::NotSupported, why);
            }
        }
        Ok(())
    }

    fn configure(&mut self, request: &ControlRequest, q_id: u32, params: Option<StreamParameters>) {
        let Some(handle) = self.queues.get_mut(&q_id) else {
            let why = format!("queue id {q_id} is not open");
            self.refuse(request, StatusCategory::InvalidArgument, why);
            return;
        };
        handle.stream = params.filter(|p| !p.is_deconfigure());
        self.respond(request, Response::Configure);
        self.release(q_id);
    }

    /// The OpenQueues whose retry time has come, sent again under new request ids.
    fn due_open_retries(&mut self) -> Vec<ClientMessage> {
        let now = tokio::time::Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.open_retries)
            .into_iter()
            .partition(|r| r.0 <= now);
        self.open_retries = later;
        let mut out = Vec::with_capacity(due.len());
        for (_, request, q_id, deadline) in due {
            let Request::OpenQueue(h) = &request.request else {
                continue;
            };
            let request_id = self.request_id();
            out.push(our_open(request_id, h));
            self.requests
                .insert(request_id, Pending::Open(request, q_id, deadline));
        }
        out
    }

    /// Delivers held messages of `q_id` while the client's limits allow.
    fn release(&mut self, q_id: u32) {
        let Some(handle) = self.queues.get_mut(&q_id) else {
            return;
        };
        while handle.may_deliver() {
            let Some(push) = handle.held.pop_front() else {
                break;
            };
            handle.unconfirmed.insert(push.guid, push.app_data.len());
            handle.unconfirmed_bytes += push.app_data.len();
            self.pushes.push(push);
        }
    }

    fn handle_puts(
        &mut self,
        event: &RawEvent,
        into: &mut Vec<ClientMessage>,
    ) -> Result<(), String> {
        let puts = decode_puts(&event.body).map_err(|e| bad("put", e))?;
        for put in puts {
            let q_id = put.queue_id as u32;
            let Some(handle) = self.queues.get(&q_id) else {
                return Err(bad("unknown_queue", format!("PUT for queue id {q_id}")));
            };
            let uri = handle.uri_bytes.clone();
            let nack = |reason: &'static str, detail: String| {
                metrics::counter!("bmq_bmqp_errors_total", "reason" => reason).increment(1);
                warn!(uri = %uri_text(&uri), %detail, "bmqp PUT refused");
                AckMessage {
                    status: ack_status::UNKNOWN,
                    correlation_id: 0,
                    guid: put.guid,
                    queue_id: put.queue_id,
                }
            };
            if !put.crc_ok() {
                let detail = format!("CRC32-C {:#010x} does not match the data", put.crc32c);
                self.acks.push(nack("crc", detail));
                continue;
            }
            let decoded = decode_app_data(
                &put.app_data,
                put.flags & MESSAGE_PROPERTIES != 0,
                put.schema_wire != 0,
                put.compression,
                self.max_app_data,
            );
            let (properties, payload) = match decoded {
                Ok(d) => d,
                Err(detail) => {
                    self.acks.push(nack("put_data", detail));
                    continue;
                }
            };
            if put.compression != 0 {
                metrics::counter!("bmq_bmqp_puts_decompressed_total").increment(1);
            }
            if put.flags & PUT_ACK_REQUESTED == 0 {
                self.unacked_silent.insert(put.guid);
            }
            into.push(ClientMessage {
                kind: Some(Kind::Put(Put {
                    uri,
                    guid: Bytes::copy_from_slice(&put.guid),
                    payload,
                    properties,
                })),
            });
        }
        Ok(())
    }

    /// Translates one answer of the session for the client.
    fn translate(&mut self, message: ClientMessage) {
        match message.kind {
            Some(Kind::OpenQueueResponse(r)) => {
                let Some(Pending::Open(request, q_id, deadline)) =
                    self.requests.remove(&r.request_id)
                else {
                    return;
                };
                let status = r.status.unwrap_or_default();
                let now = tokio::time::Instant::now();
                if status.code == StatusCode::NotReady as i32 && now + OPEN_RETRY_DELAY < deadline {
                    // BlazingMQ holds an open until the queue's primary is there; libbmq does
                    // not retry a failed reopen after a reconnection. Ask again shortly.
                    self.open_retries
                        .push((now + OPEN_RETRY_DELAY, request, q_id, deadline));
                    return;
                }
                if status.code == StatusCode::Ok as i32 {
                    let push_options = match &request.request {
                        Request::OpenQueue(h) => h
                            .sub_id_info
                            .as_ref()
                            .filter(|s| s.sub_id != 0)
                            .map(|s| sub_queue_infos_option(&[s.sub_id]))
                            .unwrap_or_default(),
                        _ => Bytes::new(),
                    };
                    self.by_uri.insert(r.uri.clone(), q_id);
                    self.queues.insert(
                        q_id,
                        QueueHandle {
                            uri_bytes: uri_bytes(&r.uri),
                            uri: r.uri,
                            stream: None,
                            unconfirmed: HashMap::new(),
                            unconfirmed_bytes: 0,
                            held: VecDeque::new(),
                            push_options,
                        },
                    );
                    self.respond(
                        &request,
                        Response::OpenQueue {
                            deduplication_ms: self.deduplication_ms,
                        },
                    );
                } else {
                    let (category, message) = status_of(status.code, status.message);
                    self.refuse(&request, category, message);
                }
            }
            Some(Kind::CloseQueueResponse(r)) => {
                let Some(Pending::Close(request, q_id)) = self.requests.remove(&r.request_id)
                else {
                    return;
                };
                // Held deliveries go back to the queue with the close (our session's proxy
                // counts them as the consumer's, as it does for any consumer that leaves).
                if let Some(handle) = self.queues.remove(&q_id) {
                    self.by_uri.remove(&handle.uri);
                    let n = handle.held.len();
                    if n > 0 {
                        debug!(uri = %handle.uri, held = n, "bmqp reader closed with held deliveries");
                    }
                }
                self.pushes.retain(|p| p.queue_id as u32 != q_id);
                self.respond(&request, Response::CloseQueue);
            }
            Some(Kind::Ack(ack)) => {
                let Some(&q_id) = uri_str(&ack.uri).and_then(|u| self.by_uri.get(u)) else {
                    metrics::counter!("bmq_bmqp_errors_total", "reason" => "ack_after_close")
                        .increment(1);
                    return;
                };
                let Ok(guid) = <[u8; 16]>::try_from(&ack.guid[..]) else {
                    return;
                };
                let status = match AckStatus::try_from(ack.status) {
                    Ok(AckStatus::Success) => ack_status::SUCCESS,
                    Ok(AckStatus::LimitReached) => ack_status::LIMIT_MESSAGES,
                    Ok(AckStatus::NotReady) => ack_status::NOT_READY,
                    Ok(AckStatus::StorageFailure) => ack_status::STORAGE_FAILURE,
                    _ => ack_status::UNKNOWN,
                };
                if self.unacked_silent.remove(&guid) && status == ack_status::SUCCESS {
                    return;
                }
                self.acks.push(AckMessage {
                    status,
                    correlation_id: 0,
                    guid,
                    queue_id: q_id as i32,
                });
            }
            Some(Kind::Push(push)) => {
                let Some(&q_id) = uri_str(&push.uri).and_then(|u| self.by_uri.get(u)) else {
                    // The reader closed meanwhile: the session's close puts it back.
                    metrics::counter!("bmq_bmqp_errors_total", "reason" => "push_after_close")
                        .increment(1);
                    return;
                };
                let Ok(guid) = <[u8; 16]>::try_from(&push.guid[..]) else {
                    return;
                };
                let (flags, schema_wire, app_data) = match encode_app_data(
                    &push.properties,
                    push.payload,
                    self.properties_ex,
                ) {
                    Ok(d) => d,
                    Err(e) => {
                        warn!(uri = %uri_text(&push.uri), error = %e, "PUSH properties do not fit bmqp; delivered without them");
                        (0, 0, Bytes::new())
                    }
                };
                let Some(handle) = self.queues.get_mut(&q_id) else {
                    return;
                };
                handle.held.push_back(PushMessage {
                    flags,
                    queue_id: q_id as i32,
                    guid,
                    schema_wire,
                    compression: 0,
                    options: handle.push_options.clone(),
                    app_data,
                });
                self.release(q_id);
            }
            Some(Kind::DisconnectResponse(_)) => {
                if let Some(request) = self.disconnect.take() {
                    self.respond(&request, Response::Disconnect);
                }
            }
            Some(Kind::Error(e)) => {
                let status = e.status.unwrap_or_default();
                warn!(code = status.code, message = %status.message, "session error for a bmqp client");
            }
            _ => {}
        }
    }
}

impl ClientWire for BmqpWire {
    async fn recv(&mut self) -> WireInput {
        loop {
            let next_retry = self.open_retries.iter().map(|r| r.0).min();
            let event = match next_retry {
                None => self.next_event().await,
                Some(at) => {
                    let woke = tokio::select! {
                        event = self.next_event() => Some(event),
                        _ = tokio::time::sleep_until(at) => None,
                    };
                    match woke {
                        Some(event) => event,
                        None => {
                            let due = self.due_open_retries();
                            if due.is_empty() {
                                continue;
                            }
                            return WireInput::Many(due);
                        }
                    }
                }
            };
            match event {
                Ok(Some(event)) => {
                    // The SDKs write one event per post: take every event already read, so one
                    // loop turn (one hop to each primary, one write back) serves many.
                    let mut into = Vec::new();
                    let mut next = Some(event);
                    while let Some(event) = next.take() {
                        if let Err(reason) = self.handle_event(event, &mut into) {
                            return WireInput::Closed(reason);
                        }
                        if into.len() >= EVENTS_PER_TURN_MAX {
                            break;
                        }
                        match self.decoder.next_event() {
                            Ok(event) => next = event,
                            Err(e) => return WireInput::Closed(bad("event", e)),
                        }
                    }
                    if !into.is_empty() || self.has_output() {
                        return WireInput::Many(into);
                    }
                }
                Ok(None) => return WireInput::Closed("client closed the connection".into()),
                Err(reason) => return WireInput::Closed(reason),
            }
        }
    }

    fn push(&mut self, message: ClientMessage) {
        self.translate(message);
    }

    fn has_output(&self) -> bool {
        !self.out.is_empty() || !self.acks.is_empty() || !self.pushes.is_empty()
    }

    async fn flush(&mut self) -> Result<(), String> {
        self.seal();
        let out = self.out.split();
        self.write
            .write_all(&out)
            .await
            .map_err(|e| format!("write to client failed: {e}"))
    }
}

/// Acknowledges received segments at once instead of after the kernel's delayed-ACK timer
/// (Linux `TCP_QUICKACK`, which the kernel clears again, so it is set after every read).
///
/// Why: libbmq does not disable Nagle's algorithm on its socket, so an SDK producer sends its
/// next small PUT only once the previous segment is acknowledged; with delayed ACKs every
/// producer waits up to 40 ms per round trip (measured: 4,600 msg/s whatever the window).
fn quick_ack(stream: &TcpStream) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let one: libc::c_int = 1;
        // SAFETY: a valid socket descriptor for the life of `stream`, and a c_int option value
        // of the size given; a failure only leaves delayed ACKs on.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_QUICKACK,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = stream;
}

/// Our OpenQueue for the SDK's handle parameters: the URI without `?id=`, read and write from
/// the flags, a reader's app id from `subIdInfo` or the URI (fanout).
fn our_open(request_id: u64, h: &control::QueueHandleParameters) -> ClientMessage {
    let app_id = h
        .sub_id_info
        .as_ref()
        .map(|s| s.app_id.clone())
        .filter(|a| a != "__default")
        .or_else(|| app_of(&h.uri).map(str::to_string))
        .unwrap_or_default();
    let read = h.flags & queue_flags::READ != 0;
    ClientMessage {
        kind: Some(Kind::OpenQueue(OpenQueue {
            request_id,
            uri: h.uri.split('?').next().unwrap_or_default().to_string(),
            read,
            write: h.flags & queue_flags::WRITE != 0,
            consumer: read.then(|| ConsumerOptions {
                app_id,
                ..Default::default()
            }),
        })),
    }
}

/// `uri?id=<app>` -> the app id.
fn app_of(uri: &str) -> Option<&str> {
    let query = uri.split_once('?')?.1;
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix("id="))
        .filter(|a| !a.is_empty())
}

/// Slices of `items` whose summed size (by `size`) stays under [`EVENT_BYTES_MAX`] (one item at
/// least per slice).
fn batches<T>(items: &[T], size: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, item) in items.iter().enumerate() {
        let s = size(item);
        if i > start && bytes + s > EVENT_BYTES_MAX {
            out.push(&items[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += s;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

fn event(event_type: EventType, body: Bytes) -> Bytes {
    RawEvent::new(event_type, 0, body).to_bytes()
}

/// Our status code -> the SDK's status category and message.
fn status_of(code: i32, message: String) -> (StatusCategory, String) {
    let category = match StatusCode::try_from(code) {
        Ok(StatusCode::UnknownDomain | StatusCode::InvalidUri) => StatusCategory::InvalidArgument,
        Ok(StatusCode::NotReady) => StatusCategory::NotReady,
        Ok(StatusCode::Timeout) => StatusCategory::Timeout,
        Ok(StatusCode::NotAuthorized | StatusCode::Refused | StatusCode::LimitReached) => {
            StatusCategory::Refused
        }
        _ => StatusCategory::Unknown,
    };
    (category, message)
}

/// A PUT's application data -> our properties and payload (inflated). Errors name the fault.
fn decode_app_data(
    app_data: &Bytes,
    has_properties: bool,
    ex: bool,
    compression: u8,
    max: usize,
) -> Result<(Vec<Property>, Bytes), String> {
    if !has_properties {
        let payload = decompress(compression, app_data, max).map_err(|e| e.to_string())?;
        return Ok((Vec::new(), payload));
    }
    // New style compresses only the payload; the old style the whole application data.
    let (props, payload) = if ex {
        let (props, rest) = properties::decode(app_data, true).map_err(|e| e.to_string())?;
        let payload = decompress(compression, &rest, max).map_err(|e| e.to_string())?;
        (props, payload)
    } else {
        let inflated = decompress(compression, app_data, max).map_err(|e| e.to_string())?;
        properties::decode(&inflated, false).map_err(|e| e.to_string())?
    };
    Ok((props.into_iter().map(to_property).collect(), payload))
}

fn to_property((key, value): (String, PropertyValue)) -> Property {
    let (value_type, value) = match value {
        PropertyValue::Bool(v) => (PropertyType::Bool, v.to_string()),
        PropertyValue::Char(v) => (PropertyType::Char, v.to_string()),
        PropertyValue::Short(v) => (PropertyType::Short, v.to_string()),
        PropertyValue::Int32(v) => (PropertyType::Int32, v.to_string()),
        PropertyValue::Int64(v) => (PropertyType::Int64, v.to_string()),
        PropertyValue::String(v) => (PropertyType::String, v),
        PropertyValue::Binary(v) => (PropertyType::Binary, hex(&v)),
    };
    Property {
        key,
        value,
        value_type: value_type as i32,
    }
}

/// Our property -> a typed bmqp value; a value that does not parse as its type (a foreign
/// client's) travels as a string.
fn from_property(p: &Property) -> (String, PropertyValue) {
    let typed = match PropertyType::try_from(p.value_type).unwrap_or(PropertyType::String) {
        PropertyType::String => None,
        PropertyType::Bool => p.value.parse().ok().map(PropertyValue::Bool),
        PropertyType::Char => p.value.parse().ok().map(PropertyValue::Char),
        PropertyType::Short => p.value.parse().ok().map(PropertyValue::Short),
        PropertyType::Int32 => p.value.parse().ok().map(PropertyValue::Int32),
        PropertyType::Int64 => p.value.parse().ok().map(PropertyValue::Int64),
        PropertyType::Binary => unhex(&p.value).map(|b| PropertyValue::Binary(Bytes::from(b))),
    };
    (
        p.key.clone(),
        typed.unwrap_or_else(|| PropertyValue::String(p.value.clone())),
    )
}

/// Our properties and payload -> PUSH flags, schema wire id and application data.
fn encode_app_data(
    props: &[Property],
    payload: Bytes,
    ex: bool,
) -> Result<(u8, u16, Bytes), properties::PropertyError> {
    if props.is_empty() {
        return Ok((0, 0, payload));
    }
    let typed: Vec<_> = props.iter().map(from_property).collect();
    let mut data = BytesMut::new();
    properties::encode(&typed, ex, &mut data)?;
    data.extend_from_slice(&payload);
    // Schema wire id 1: "new style, no schema" (protocol.h:3412ff).
    Ok((MESSAGE_PROPERTIES, u16::from(ex), data.freeze()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_properties_survive_our_representation() {
        let values = [
            PropertyValue::Bool(true),
            PropertyValue::Char(-3),
            PropertyValue::Short(-300),
            PropertyValue::Int32(70_000),
            PropertyValue::Int64(-(1 << 40)),
            PropertyValue::String("text".into()),
            PropertyValue::Binary(Bytes::from_static(&[0, 255, 16])),
        ];
        for v in values {
            let ours = to_property(("k".into(), v.clone()));
            assert_eq!(from_property(&ours), ("k".to_string(), v));
        }
        // Our own clients' properties are strings.
        let plain = Property {
            key: "a".into(),
            value: "42".into(),
            value_type: 0,
        };
        assert_eq!(from_property(&plain).1, PropertyValue::String("42".into()));
    }

    #[test]
    fn app_ids_and_batches() {
        assert_eq!(app_of("bmq://d/q?id=foo"), Some("foo"));
        assert_eq!(app_of("bmq://d/q"), None);
        let sizes = vec![EVENT_BYTES_MAX / 2; 5];
        let b = batches(&sizes, |s| *s);
        assert_eq!(b.iter().map(|c| c.len()).collect::<Vec<_>>(), vec![2, 2, 1]);
        assert!(batches(&Vec::<usize>::new(), |s| *s).is_empty());
    }
}
