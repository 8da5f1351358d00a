//! The bmqp listener: applications written with BlazingMQ's own SDKs (C++ libbmq, Java, Python
//! `blazingmq`) connect to `[[members]] bmqp_port` and produce and consume through the cluster
//! unchanged.
//!
//! A connection negotiates first (the SDK's `ClientIdentity`, answered with a
//! `BrokerResponse` in the client's encoding), then becomes an ordinary client session: this
//! file is only a [`ClientWire`] that translates BlazingMQ's events to and from our
//! [`ClientMessage`]s, so the session's proxy, retransmission to moved primaries, GUID
//! de-duplication, authorisation and metrics are the same as for our own clients
//! ([`crate::session`]). What the translation keeps per connection:
//!
//! - the queue ids the client chose (`qId` ↔ URI). The SDKs give every handle of one queue
//!   the same `qId` — a writer, a reader, the readers of several fanout apps — each a
//!   sub-queue (`subQueueId`, BlazingMQ's sub-stream) with its open counts: all of them are
//!   one open queue of our session (read if any handle reads, write if any writes, one
//!   consumer per app read), changed by a second OpenQueue as each handle opens, configures
//!   or closes, and closed when the last one goes;
//! - each reader's subscriptions (ConfigureStream's, with their ids, priorities and limits,
//!   or the one of an older SDK's ConfigureQueueStream, whose id is the sub-queue id): the
//!   primary delivers under them, so a reader's priority and `maxUnconfirmedMessages/Bytes`
//!   are honoured cluster-wide, a reader gets nothing before its first configure or after its
//!   "deconfigure", and every PUSH carries the `SUB_QUEUE_INFOS` option naming the
//!   subscription it went to (the SDKs route a PUSH by it);
//! - the control requests in flight (`rId`, echoed in each response), one at a time per
//!   queue id; an open answered NOT_READY (no active primary yet, as during a failover) is
//!   asked again every 250 ms until `limits.request_timeout_ms`, as BlazingMQ holds an open
//!   until the queue is ready — libbmq gives a queue up if its reopen after a reconnection
//!   fails;
//! - the GUIDs of PUTs sent without `ACK_REQUESTED`: a success is not reported to them, a
//!   failure is (as BlazingMQ does);
//! - for a legacy client (no `guidInfo` in its identity: the Java SDK), the GUID of each of its
//!   messages, made here, and the correlation id it put in the PUT's GUID field, returned in
//!   the ACK (BlazingMQ's first hop does the same).
//!
//! After the DisconnectResponse the client closes the connection (BlazingMQ's order; an SDK
//! takes a close by the broker for a lost connection); the broker closes it after
//! [`DISCONNECT_LINGER`] if the client does not.
//!
//! Properties: bmqp's typed properties travel in our `Property` with their type
//! (`PropertyType`), so an SDK consumer gets back the types an SDK producer sent; our own
//! clients' string properties arrive as strings. PUSHes use the new-style properties area
//! (`MESSAGE_PROPERTIES_EX`) for clients that advertise it, the old style otherwise.
//! zlib-compressed PUTs are inflated (at most `frame_size_max_bytes`).
//!
//! Security, as on our own client listener: with `[tls] client_listener` the port speaks TLS
//! (the same certificate) to a client that opens with a TLS handshake (libbmq since 2025);
//! one that opens in plain bmqp (the Python SDK 1.2, the Java SDK) is refused with a log line
//! naming `[bmqp] allow_plaintext`, unless that is set (`bmqctl cluster up` sets it). A client
//! may authenticate with BlazingMQ's AUTHENTICATION event before its negotiation: `BASIC`
//! with `name:secret` of a configured token gives it that token's permissions (wrong
//! credentials: refused, closed, `bmq_client_auth_failures_total`). Without it, the client
//! gets the permissions of the token `[auth] bmqp_identity` names (`bmqctl cluster up` names
//! one allowed to produce and consume everywhere); without that, an anonymous client opens no
//! queue while tokens are configured, and everything without tokens.
//!
//! Bad input — a malformed or oversized event, malformed BER or JSON, an event type a client
//! never sends, a PUT or CONFIRM for a queue id that is not open — closes this connection
//! with a logged reason and `bmq_bmqp_errors_total{reason}`; a PUT whose CRC32-C does not
//! match its data, whose properties are malformed or whose compression does not inflate is
//! NACKed (status 5, "unknown") and counted. Nothing here panics on input, and nothing here
//! affects another connection. Never is an ACK or PUSH sent for a queue id the client does not
//! have open (libbmq does not check, BRIEF.md §1.6).
//!
//! Heartbeats: every `HEARTBEAT_REQ` is answered. The broker sends one after
//! `[bmqp] heartbeat_interval_ms` without anything from the client, and drops a client silent
//! for `max_missed_heartbeats` intervals (`bmq_bmqp_heartbeat_timeouts_total`): its session
//! ends, and what it held unconfirmed goes to other consumers (BlazingMQ's defaults, 3 s and
//! 10). None goes to the Java SDK, which cannot decode one. The BrokerResponse tells clients
//! the same values, so the newer libbmq that watches the broker uses them.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bmq_bmqp::control::{
    self, broker_response, queue_flags, BrokerIdentity, ClientIdentity as SdkIdentity,
    ControlRequest, Request, Response, StatusCategory, BROKER_FEATURES,
};
use bmq_bmqp::event::{heartbeat, ControlEncoding, EventDecoder, EventType, RawEvent};
use bmq_bmqp::message::{
    ack_status, decode_confirms, decode_puts, decompress, encode_acks, encode_pushes,
    sub_queue_infos_option, AckMessage, PushMessage, MESSAGE_PROPERTIES, PUSH_OUT_OF_ORDER,
    PUT_ACK_REQUESTED,
};
use bmq_bmqp::properties::{self, PropertyValue};
use bmq_config::AuthSettings;
use bmq_proto::client::{
    client_message::Kind, AckStatus, ClientMessage, CloseQueue, Confirm, ConsumerOptions,
    Disconnect, OpenQueue, Property, PropertyType, Put, Status, StatusCode, Subscription,
};
use bmq_proto::{uri_bytes, uri_str, uri_text, UriBytes};
use bytes::{Bytes, BytesMut};
use std::os::fd::{AsRawFd, RawFd};

use bmq_proto::BoxedStream;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tracing::{info, warn};

use crate::auth::{bmqp_authenticate, bmqp_identity};
use crate::router::{Router, SessionSettings};
use crate::session::{
    run, ClientWire, WireInput, HELLO_TIMEOUT, TLS_HANDSHAKES_MAX, TLS_HANDSHAKE_TIMEOUT,
};

/// Largest PUSH or ACK event this listener writes; more messages go into further events.
const EVENT_BYTES_MAX: usize = 1 << 20;
/// Delay before an OpenQueue answered NOT_READY is asked again.
const OPEN_RETRY_DELAY: std::time::Duration = std::time::Duration::from_millis(250);
/// Most requests one [`ClientWire::recv`] hands to the session at once.
const EVENTS_PER_TURN_MAX: usize = 1024;
/// How long a client that disconnected has to close its connection before this broker does.
const DISCONNECT_LINGER: std::time::Duration = std::time::Duration::from_secs(5);
/// Read buffer size.
const READ_CHUNK: usize = 64 * 1024;
/// This broker's version as the SDKs see it (`brokerVersion`; they do not check it).
const BROKER_VERSION: i64 = 1;

/// Counts a bad input and says why, for the connection's end.
fn bad(reason: &'static str, detail: impl std::fmt::Display) -> String {
    metrics::counter!("bmq_bmqp_errors_total", "reason" => reason).increment(1);
    format!("{reason}: {detail}")
}

/// Accepts BlazingMQ SDK connections on `listener` until the process ends; with `tls` (the
/// client listener's acceptor, `[tls] client_listener`), a connection that opens with a TLS
/// handshake is TLS, and one that opens in plain bmqp is served only with
/// `[bmqp] allow_plaintext` (else refused, logged, counted).
pub async fn serve_bmqp_clients(
    listener: TcpListener,
    router: Arc<Router>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    info!(addr = ?listener.local_addr().ok(), tls = tls.is_some(), "bmqp listener (BlazingMQ SDK clients) ready");
    let handshakes = Arc::new(tokio::sync::Semaphore::new(TLS_HANDSHAKES_MAX));
    let settings = router.session_settings();
    loop {
        let (stream, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "bmqp listener accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        if router.session_count() >= settings.client_sessions_max {
            metrics::counter!("bmq_client_connections_refused_total").increment(1);
            warn!(%remote, "bmqp connection refused: client_sessions_max reached");
            continue;
        }
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let settings = settings.clone();
        let tls = tls.clone();
        let handshakes = handshakes.clone();
        tokio::spawn(async move {
            metrics::counter!("bmq_bmqp_connections_total").increment(1);
            let remote = remote.to_string();
            let Some((stream, fd)) = secure(stream, &remote, tls, &handshakes, &settings).await
            else {
                return;
            };
            serve_connection(stream, fd, remote, router, &settings).await;
        });
    }
}

/// The first byte of a TLS handshake record (RFC 8446 §5.1, `ContentType.handshake`); a bmqp
/// event opens with the high byte of its length, 0 for any event under 16 MiB.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// The connection as it is to be served: TLS when it opens with a TLS handshake on a TLS
/// listener, plain when there is no TLS or plaintext is allowed; `None` (logged, counted)
/// when it is refused or its handshake fails.
async fn secure(
    stream: TcpStream,
    remote: &str,
    tls: Option<tokio_rustls::TlsAcceptor>,
    handshakes: &tokio::sync::Semaphore,
    settings: &SessionSettings,
) -> Option<(BoxedStream, RawFd)> {
    let fd = stream.as_raw_fd();
    let Some(acceptor) = tls else {
        return Some((Box::new(stream), fd));
    };
    let mut first = [0u8; 1];
    match tokio::time::timeout(HELLO_TIMEOUT, stream.peek(&mut first)).await {
        Ok(Ok(1)) => {}
        _ => return None,
    }
    if first[0] != TLS_HANDSHAKE_RECORD {
        if settings.bmqp.allow_plaintext {
            return Some((Box::new(stream), fd));
        }
        metrics::counter!("bmq_client_connections_refused_total").increment(1);
        warn!(%remote, "bmqp connection refused: this listener speaks TLS ([tls] client_listener) and the client started in plain bmqp (an SDK without TLS); set [bmqp] allow_plaintext = true to admit such clients");
        return None;
    }
    let Ok(_permit) = handshakes.try_acquire() else {
        metrics::counter!("bmq_client_connections_refused_total").increment(1);
        warn!(%remote, "bmqp connection refused: too many TLS handshakes in progress");
        return None;
    };
    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(s)) => Some((Box::new(s), fd)),
        outcome => {
            metrics::counter!("bmq_client_tls_failures_total").increment(1);
            let reason = match outcome {
                Ok(Err(e)) => e.to_string(),
                _ => "timed out".to_string(),
            };
            warn!(%remote, %reason, "bmqp TLS handshake failed; closed");
            None
        }
    }
}

/// Negotiation, then the session. `fd`: the socket under `stream` (for its TCP options).
async fn serve_connection(
    stream: BoxedStream,
    fd: RawFd,
    remote: String,
    router: Arc<Router>,
    settings: &SessionSettings,
) {
    let max_event = settings.frame_size_max;
    let (read, write) = tokio::io::split(stream);
    let mut wire = BmqpWire {
        read,
        write,
        fd,
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
        legacy: None,
        heartbeat: None,
        last_received: tokio::time::Instant::now(),
        heartbeats_unanswered: 0,
        to_session: Vec::new(),
        open_retries: Vec::new(),
        open_timeout: settings.request_timeout,
        deduplication_ms: i64::try_from(settings.duplicate_guid_window.as_millis())
            .unwrap_or(i64::MAX),
    };
    let deadline = tokio::time::Instant::now() + HELLO_TIMEOUT;
    let Some(mut event) = first_event(&mut wire, deadline, &remote).await else {
        return;
    };
    // BlazingMQ's AUTHENTICATION comes before the negotiation: credentials mapped onto our
    // tokens. Without it, the client is who `[auth] bmqp_identity` says.
    let auth = settings.auth.current();
    let mut identity = bmqp_identity(&auth.client);
    if event.header.event_type == EventType::Authentication {
        match authenticated(&mut wire, &event, &auth.client, &remote).await {
            Some(who) => identity = who,
            None => return,
        }
        event = match first_event(&mut wire, deadline, &remote).await {
            Some(event) => event,
            None => return,
        };
    }
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
    if sdk.guid_client_id.is_empty() {
        wire.legacy = Some(LegacyGuids::new());
    }
    let bmqp = &settings.bmqp;
    let broker = BrokerIdentity {
        version: BROKER_VERSION,
        process_name: "bmq-broker".into(),
        pid: i64::from(std::process::id()),
        host_name: settings.host_name.clone(),
        cluster_name: settings.cluster_name.clone(),
        node_id: i64::from(router.self_id().0),
        features: BROKER_FEATURES.into(),
        heartbeat_interval_ms: i64::try_from(bmqp.heartbeat_interval_ms).unwrap_or(i64::MAX),
        max_missed_heartbeats: i64::from(bmqp.max_missed_heartbeats),
    };
    // The Java SDK knows event types 0-5 only: a HEARTBEAT_REQ would break its decoding.
    if sdk.sdk_language != 2 {
        wire.heartbeat = bmqp
            .heartbeat_interval()
            .map(|interval| (interval, bmqp.max_missed_heartbeats));
    }
    let client_id = describe(&sdk);
    wire.out.extend_from_slice(&broker_response(
        wire.encoding,
        StatusCategory::Success,
        "",
        &broker,
    ));
    info!(%remote, client = %client_id, encoding = ?wire.encoding, "BlazingMQ SDK client negotiated");
    run(wire, identity, &client_id, remote, router).await;
}

/// The next event before negotiation, by `deadline`; `None` (logged) when the client closed,
/// sent garbage, or nothing in time.
async fn first_event(
    wire: &mut BmqpWire,
    deadline: tokio::time::Instant,
    remote: &str,
) -> Option<RawEvent> {
    match tokio::time::timeout_at(deadline, wire.next_event()).await {
        Ok(Ok(Some(event))) => Some(event),
        Ok(Ok(None)) => None,
        Ok(Err(reason)) => {
            warn!(%remote, %reason, "bmqp connection closed before negotiation");
            None
        }
        Err(_) => {
            let _ = bad("negotiation_timeout", "no negotiation message");
            warn!(%remote, "bmqp client sent no negotiation in time; closed");
            None
        }
    }
}

/// Answers an AUTHENTICATION event: `BASIC` credentials `name:secret` of a configured token
/// (BlazingMQ's basic authenticator, `mqbauthn_basicauthenticator.cpp`) or `ANONYMOUS` (the
/// bmqp identity). The identity, or `None` once a refusal is written (logged, counted in
/// `bmq_client_auth_failures_total`).
async fn authenticated(
    wire: &mut BmqpWire,
    event: &RawEvent,
    auth: &AuthSettings,
    remote: &str,
) -> Option<crate::auth::ClientIdentity> {
    let request = match control::decode_authentication(event) {
        Ok(r) => r,
        Err(e) => {
            let reason = bad("authentication", e);
            warn!(%remote, %reason, "bad bmqp authentication; closed");
            return None;
        }
    };
    let outcome = bmqp_authenticate(auth, &request.mechanism, &request.data);
    let (category, message) = match &outcome {
        Ok(_) => (StatusCategory::Success, String::new()),
        Err(why) => (StatusCategory::Refused, why.clone()),
    };
    wire.out
        .extend_from_slice(&control::authentication_response(
            request.encoding,
            category,
            &message,
        ));
    let _ = wire.flush().await;
    match outcome {
        Ok(identity) => {
            info!(%remote, mechanism = %request.mechanism, token = %identity.name(), "bmqp client authenticated");
            Some(identity)
        }
        Err(why) => {
            metrics::counter!("bmq_client_auth_failures_total").increment(1);
            warn!(%remote, mechanism = %request.mechanism, %why, "bmqp authentication refused; closed");
            None
        }
    }
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

/// One handle of a queue in the client's session: a sub-stream (BlazingMQ's `subQueueId`): the
/// default stream (0) of a writer or of a reader outside fanout, or the reader of one app of a
/// fanout queue (`uri?id=<app>`, the sub-queue id the client chose).
#[derive(Debug, Clone, PartialEq)]
struct Stream {
    /// The app id it reads (empty: the default stream).
    app_id: String,
    /// Reader and writer handles the client opened on it, less those it closed.
    read_count: i64,
    write_count: i64,
    /// The reader's subscriptions as last configured (ConfigureStream's, or the one of a
    /// ConfigureQueueStream, with the sub-queue id as its id); empty until the first
    /// configure and after a "deconfigure": the reader receives nothing.
    subscriptions: Vec<Subscription>,
}

/// A bmqp request for a queue id that is being served: our request id in flight (or, after a
/// NOT_READY answer, waiting for its retry), and what to restore if it is refused.
#[derive(Debug)]
struct InFlight {
    /// Our request id; `None` while a retry waits.
    ours: Option<u64>,
    /// The client's request it answers.
    request: ControlRequest,
    /// The streams before the request, restored when it is refused.
    previous: BTreeMap<u32, Stream>,
    /// Until when NOT_READY answers are asked again (`limits.request_timeout_ms`): BlazingMQ
    /// holds an open until the queue's primary is there, and libbmq gives a queue up if its
    /// reopen after a reconnection fails.
    deadline: tokio::time::Instant,
}

/// One queue the client has open, by its `qId`: every handle the client has on it, served as
/// one open queue of our session (read if any handle reads, write if any writes, one
/// consumer per app read). BlazingMQ's SDKs give every handle of one queue the same `qId`.
struct QueueHandle {
    /// The queue's URI without `?id=`.
    uri: String,
    /// `uri` as the per-message frames carry it (shared by every PUT and CONFIRM: a reference
    /// count each, not an allocation).
    uri_bytes: UriBytes,
    /// By sub-queue id.
    streams: BTreeMap<u32, Stream>,
    /// Whether our session has the queue open (an open was answered OK).
    opened: bool,
    /// The request being served, one at a time per queue id.
    in_flight: Option<InFlight>,
    /// Requests for this queue id that came meanwhile, in order.
    waiting: VecDeque<ControlRequest>,
    /// Every subscription id configured on this queue, still routed to the client: a PUSH
    /// under an id the client replaced may still be on its way (the Java SDK keeps old ids,
    /// libbmq finds the queue by it). Bounded by [`SUBSCRIPTION_IDS_MAX`].
    known_ids: HashSet<u32>,
}

impl QueueHandle {
    /// The sub-queue of `app_id` (empty or `__default`: the default stream).
    fn stream_of_app(&self, app_id: &str) -> Option<u32> {
        let app = normal_app(app_id);
        self.streams
            .iter()
            .find(|(_, s)| s.app_id == app)
            .map(|(id, _)| *id)
    }

    /// Our OpenQueue for the handles as they are now.
    fn our_open(&self, request_id: u64) -> ClientMessage {
        let consumers: Vec<ConsumerOptions> = self
            .streams
            .values()
            .filter(|s| s.read_count > 0)
            .map(|s| ConsumerOptions {
                app_id: s.app_id.clone(),
                subscriptions: s.subscriptions.clone(),
                suspended: s.subscriptions.is_empty(),
                ..Default::default()
            })
            .collect();
        ClientMessage {
            kind: Some(Kind::OpenQueue(OpenQueue {
                request_id,
                uri: self.uri.clone(),
                read: !consumers.is_empty(),
                write: self.streams.values().any(|s| s.write_count > 0),
                consumer: None,
                consumers,
            })),
        }
    }
}

/// Most subscription ids remembered per queue for routing late PUSHes.
const SUBSCRIPTION_IDS_MAX: usize = 4096;

/// `__default` (the SDKs' name of the default stream) as our empty app id.
fn normal_app(app_id: &str) -> &str {
    if app_id == control::DEFAULT_APP_ID {
        ""
    } else {
        app_id
    }
}

/// bmqp's signed limits as ours (a negative value is 0: the broker's default).
fn limit(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// A ConfigureStream subscription as ours: its highest-priority consumer's priority and
/// limits (the first, `bmqp_conversionutil.h`); `None` for one that receives nothing (no
/// consumer, or a deconfigure's priority `i32::MIN` / no capacity).
fn our_subscription(s: &control::SubscriptionParameters) -> Option<Subscription> {
    let c = s.consumers.first()?;
    if c.max_unconfirmed_messages <= 0 || c.consumer_priority == i64::from(i32::MIN) {
        return None;
    }
    // As BlazingMQ's primary, an expression counts only in version 1 (`mqbblp_routers.cpp`):
    // an undefined version is every message.
    let expression = if s.expression_version == 1 {
        s.expression.clone()
    } else {
        String::new()
    };
    Some(Subscription {
        id: s.s_id,
        expression,
        priority: i32::try_from(c.consumer_priority).unwrap_or(i32::MAX),
        max_unconfirmed_messages: u32::try_from(c.max_unconfirmed_messages).unwrap_or(u32::MAX),
        max_unconfirmed_bytes: limit(c.max_unconfirmed_bytes),
    })
}

/// What a legacy client's PUT needs for its ACK: the correlation id it put in the GUID field
/// and whether it asked for an ACK.
#[derive(Debug, Clone, Copy)]
struct LegacyPut {
    correlation_id: u32,
    ack_requested: bool,
}

/// BlazingMQ's client protocol as a [`ClientWire`] (see the module doc).
struct BmqpWire {
    read: ReadHalf<BoxedStream>,
    write: WriteHalf<BoxedStream>,
    /// The TCP socket under the (possibly TLS) stream.
    fd: RawFd,
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
    /// Our requests in flight: request id -> the client's queue id.
    requests: HashMap<u64, u32>,
    next_request_id: u64,
    disconnect: Option<ControlRequest>,
    /// GUIDs of PUTs without ACK_REQUESTED still waiting for their outcome.
    unacked_silent: HashSet<[u8; 16]>,
    /// A legacy client (it sent no `guidInfo.clientId`): it puts a 24-bit correlation id in
    /// the GUID field of its PUTs, so this broker makes each message's GUID and returns the
    /// correlation id in the ACK (BlazingMQ's first hop does the same,
    /// `mqba_clientsession.cpp`). The Java SDK is one; its correlation ids start again at 1 in
    /// every process, so taking them for GUIDs would drop the next process's messages as
    /// duplicates of the last one's.
    legacy: Option<LegacyGuids>,
    /// Heartbeats to the client (`[bmqp] heartbeat_interval_ms`, `max_missed_heartbeats`):
    /// after an interval without anything from it, a HEARTBEAT_REQ; after the maximum of
    /// silent intervals, the connection is closed and what it held goes to other consumers.
    /// `None` for the Java SDK and when disabled.
    heartbeat: Option<(std::time::Duration, u32)>,
    /// When the client last sent anything.
    last_received: tokio::time::Instant,
    /// HEARTBEAT_REQs sent since the client last sent anything.
    heartbeats_unanswered: u32,
    /// Requests for the session made while translating its answers (the next request of a
    /// queue id, served once the one before it was answered), handed over by the next
    /// [`ClientWire::recv`].
    to_session: Vec<ClientMessage>,
    /// Queue ids whose NOT_READY answer is asked again at the given time.
    open_retries: Vec<(tokio::time::Instant, u32)>,
    /// How long an open is retried while the answer is NOT_READY:
    /// `limits.request_timeout_ms`.
    open_timeout: std::time::Duration,
    /// `deduplicationTimeMs` told to the SDK (how long it may resend an un-ACKed PUT): the
    /// primaries' duplicate window, `limits.duplicate_guid_window_ms`.
    deduplication_ms: i64,
}

/// The GUIDs this broker makes for a legacy client's messages, and what their ACKs need.
struct LegacyGuids {
    /// This connection's random 8 bytes (version bits `01` set, so never all zero, as
    /// BlazingMQ's GUIDs), then a counter: unique across connections and nodes.
    prefix: [u8; 8],
    next: u64,
    /// By GUID, until the ACK.
    puts: HashMap<[u8; 16], LegacyPut>,
}

impl LegacyGuids {
    fn new() -> LegacyGuids {
        let mut prefix: [u8; 8] = rand::random();
        prefix[0] = 0x40 | (prefix[0] & 0x3f);
        LegacyGuids {
            prefix,
            next: 0,
            puts: HashMap::new(),
        }
    }

    fn make(&mut self) -> [u8; 16] {
        self.next += 1;
        let mut guid = [0u8; 16];
        guid[..8].copy_from_slice(&self.prefix);
        guid[8..].copy_from_slice(&self.next.to_be_bytes());
        guid
    }
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
                    quick_ack(self.fd);
                    self.last_received = tokio::time::Instant::now();
                    self.heartbeats_unanswered = 0;
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
                    let Some(handle) = self.queues.get(&q_id) else {
                        return Err(bad("unknown_queue", format!("CONFIRM for queue id {q_id}")));
                    };
                    // The copy of the app the sub-queue reads; an unknown sub-queue names
                    // none (the primary takes the copy it gave this session).
                    let app_id = handle
                        .streams
                        .get(&c.sub_queue_id)
                        .map(|s| s.app_id.clone())
                        .unwrap_or_default();
                    into.push(ClientMessage {
                        kind: Some(Kind::Confirm(Confirm {
                            uri: handle.uri_bytes.clone(),
                            guid: Bytes::copy_from_slice(&c.guid),
                            app_id,
                        })),
                    });
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
            EventType::Authentication => Err(bad(
                "authentication",
                "a second AUTHENTICATION (this broker gives no lifetime to renew)",
            )),
            other => Err(bad("event_type", format!("{other:?} from a client"))),
        }
    }

    fn handle_control(
        &mut self,
        event: &RawEvent,
        into: &mut Vec<ClientMessage>,
    ) -> Result<(), String> {
        let request = control::decode_request(event).map_err(|e| bad("control", e))?;
        match &request.request {
            Request::OpenQueue(h) => self.queue_request(h.q_id, request.clone(), into),
            Request::ConfigureQueueStream { q_id, .. } | Request::ConfigureStream { q_id, .. } => {
                self.queue_request(*q_id, request.clone(), into)
            }
            Request::CloseQueue { params, .. } => {
                self.queue_request(params.q_id, request.clone(), into)
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

    /// A request for queue id `q_id`: served now, or after the one in flight for it.
    fn queue_request(&mut self, q_id: u32, request: ControlRequest, into: &mut Vec<ClientMessage>) {
        match self.queues.get_mut(&q_id) {
            Some(handle) if handle.in_flight.is_some() => handle.waiting.push_back(request),
            _ => self.serve(q_id, request, into),
        }
    }

    /// Serves one request for `q_id` (none in flight for it): changes the handles, then asks
    /// our session for the open that serves them (or the close), or answers at once when
    /// nothing changes for the session.
    fn serve(&mut self, q_id: u32, request: ControlRequest, into: &mut Vec<ClientMessage>) {
        if !self.queues.contains_key(&q_id) {
            let Request::OpenQueue(h) = &request.request else {
                let why = format!("queue id {q_id} is not open");
                return self.refuse(&request, StatusCategory::InvalidArgument, why);
            };
            let uri = h.uri.split('?').next().unwrap_or_default().to_string();
            if let Some(other) = self.by_uri.get(&uri) {
                let why = format!("{uri} is open in this session under queue id {other}");
                return self.refuse(&request, StatusCategory::InvalidArgument, why);
            }
            self.by_uri.insert(uri.clone(), q_id);
            self.queues.insert(
                q_id,
                QueueHandle {
                    uri_bytes: uri_bytes(&uri),
                    uri,
                    streams: BTreeMap::new(),
                    opened: false,
                    in_flight: None,
                    waiting: VecDeque::new(),
                    known_ids: HashSet::new(),
                },
            );
        }
        let handle = self.queues.get_mut(&q_id).expect("inserted above");
        let previous = handle.streams.clone();
        let before = handle.our_open(0);
        if let Err(why) = apply(handle, &request.request) {
            if !handle.opened {
                self.drop_handle(q_id);
            }
            return self.refuse(&request, StatusCategory::InvalidArgument, why);
        }
        let handle = self.queues.get_mut(&q_id).expect("present");
        for s in handle.streams.values() {
            handle
                .known_ids
                .extend(s.subscriptions.iter().map(|s| s.id));
        }
        if handle.known_ids.len() > SUBSCRIPTION_IDS_MAX {
            handle.known_ids.clear();
            for s in handle.streams.values() {
                handle
                    .known_ids
                    .extend(s.subscriptions.iter().map(|s| s.id));
            }
        }
        let closing = handle.streams.is_empty();
        if handle.opened && !closing && handle.our_open(0) == before {
            // Nothing changes for the session (another writer, a configure that repeats
            // the last one): answered at once.
            self.answer_ok(q_id, &request);
            return self.next_waiting(q_id, into);
        }
        let ours = self.request_id();
        let handle = self.queues.get_mut(&q_id).expect("present");
        let message = if closing {
            ClientMessage {
                kind: Some(Kind::CloseQueue(CloseQueue {
                    request_id: ours,
                    uri: handle.uri.clone(),
                })),
            }
        } else {
            handle.our_open(ours)
        };
        handle.in_flight = Some(InFlight {
            ours: Some(ours),
            request,
            previous,
            deadline: tokio::time::Instant::now() + self.open_timeout,
        });
        self.requests.insert(ours, q_id);
        into.push(message);
    }

    /// The success answer to `request` (the handles it changed are served).
    fn answer_ok(&mut self, q_id: u32, request: &ControlRequest) {
        let response = match &request.request {
            Request::OpenQueue(_) => Response::OpenQueue {
                deduplication_ms: self.deduplication_ms,
            },
            Request::CloseQueue { .. } => Response::CloseQueue,
            _ => Response::Configure,
        };
        if matches!(request.request, Request::CloseQueue { .. }) && !self.queues.contains_key(&q_id)
        {
            // Deliveries of this turn for the closed queue stay unsent: the close gave them
            // back to the queue (never a PUSH for a queue id the client does not have).
            self.pushes.retain(|p| p.queue_id as u32 != q_id);
        }
        self.respond(request, response);
    }

    /// Serves the next request waiting for `q_id`, if any and none is in flight.
    fn next_waiting(&mut self, q_id: u32, into: &mut Vec<ClientMessage>) {
        let next = match self.queues.get_mut(&q_id) {
            Some(h) if h.in_flight.is_none() => h.waiting.pop_front(),
            _ => None,
        };
        if let Some(request) = next {
            self.serve(q_id, request, into);
        }
    }

    fn drop_handle(&mut self, q_id: u32) -> Option<QueueHandle> {
        let handle = self.queues.remove(&q_id)?;
        self.by_uri.remove(&handle.uri);
        Some(handle)
    }

    /// At a heartbeat time: a HEARTBEAT_REQ queued for the client if it has been silent for
    /// an interval, or why the connection ends if it has been for the maximum of intervals.
    fn heartbeat_due(&mut self) -> Option<String> {
        let (interval, max_missed) = self.heartbeat?;
        let now = tokio::time::Instant::now();
        let silent = now.saturating_duration_since(self.last_received);
        if silent < interval * (self.heartbeats_unanswered + 1) {
            return None;
        }
        if self.heartbeats_unanswered + 1 >= max_missed {
            metrics::counter!("bmq_bmqp_heartbeat_timeouts_total").increment(1);
            return Some(format!(
                "nothing from the client for {silent:?} ({max_missed} heartbeat intervals of \
                 {interval:?}): dropped"
            ));
        }
        self.heartbeats_unanswered += 1;
        self.seal();
        self.out
            .extend_from_slice(&heartbeat(EventType::HeartbeatReq));
        None
    }

    /// The queues whose retry time has come, asked again under new request ids.
    fn due_open_retries(&mut self) -> Vec<ClientMessage> {
        let now = tokio::time::Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.open_retries)
            .into_iter()
            .partition(|r| r.0 <= now);
        self.open_retries = later;
        let mut out = Vec::with_capacity(due.len());
        for (_, q_id) in due {
            let ours = self.request_id();
            let Some(handle) = self.queues.get_mut(&q_id) else {
                continue;
            };
            let Some(in_flight) = handle.in_flight.as_mut() else {
                continue;
            };
            in_flight.ours = Some(ours);
            out.push(handle.our_open(ours));
            self.requests.insert(ours, q_id);
        }
        out
    }

    fn handle_puts(
        &mut self,
        event: &RawEvent,
        into: &mut Vec<ClientMessage>,
    ) -> Result<(), String> {
        let puts = decode_puts(&event.body).map_err(|e| bad("put", e))?;
        for mut put in puts {
            let q_id = put.queue_id as u32;
            let Some(handle) = self.queues.get(&q_id) else {
                return Err(bad("unknown_queue", format!("PUT for queue id {q_id}")));
            };
            let uri = handle.uri_bytes.clone();
            let mut ack_requested = put.flags & PUT_ACK_REQUESTED != 0;
            let mut correlation_id = 0;
            if let Some(legacy) = self.legacy.as_mut() {
                // BlazingMQ reads the correlation id before it overwrites the field with the
                // GUID it makes, and aligns ACK_REQUESTED with it (a PUT with a correlation
                // id wants its ACK, one without does not).
                correlation_id = u32::from_be_bytes([0, put.guid[1], put.guid[2], put.guid[3]]);
                ack_requested = correlation_id != 0;
                put.guid = legacy.make();
                legacy.puts.insert(
                    put.guid,
                    LegacyPut {
                        correlation_id,
                        ack_requested,
                    },
                );
            }
            let nack = |reason: &'static str, detail: String| {
                metrics::counter!("bmq_bmqp_errors_total", "reason" => reason).increment(1);
                warn!(uri = %uri_text(&uri), %detail, "bmqp PUT refused");
                AckMessage {
                    status: ack_status::UNKNOWN,
                    correlation_id,
                    guid: put.guid,
                    queue_id: put.queue_id,
                }
            };
            if !put.crc_ok() {
                let detail = format!("CRC32-C {:#010x} does not match the data", put.crc32c);
                self.acks.push(nack("crc", detail));
                self.forget_legacy(&put.guid);
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
                    self.forget_legacy(&put.guid);
                    continue;
                }
            };
            if put.compression != 0 {
                metrics::counter!("bmq_bmqp_puts_decompressed_total").increment(1);
            }
            if !ack_requested && self.legacy.is_none() {
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

    fn forget_legacy(&mut self, guid: &[u8; 16]) {
        if let Some(legacy) = self.legacy.as_mut() {
            legacy.puts.remove(guid);
        }
    }

    /// The answer of our session to the request in flight for a queue: serves the client's
    /// request (or retries a NOT_READY, or restores the handles of a refused change).
    fn on_answer(&mut self, ours: u64, status: Status, into: &mut Vec<ClientMessage>) {
        let Some(q_id) = self.requests.remove(&ours) else {
            return;
        };
        let Some(handle) = self.queues.get_mut(&q_id) else {
            return;
        };
        if handle.in_flight.as_ref().and_then(|f| f.ours) != Some(ours) {
            return;
        }
        let now = tokio::time::Instant::now();
        let in_flight = handle.in_flight.as_mut().expect("checked above");
        if status.code == StatusCode::NotReady as i32 && now + OPEN_RETRY_DELAY < in_flight.deadline
        {
            // BlazingMQ holds an open until the queue's primary is there; libbmq does not
            // retry a failed reopen after a reconnection. Ask again shortly.
            in_flight.ours = None;
            self.open_retries.push((now + OPEN_RETRY_DELAY, q_id));
            return;
        }
        let in_flight = handle.in_flight.take().expect("checked above");
        if status.code == StatusCode::Ok as i32 {
            if handle.streams.is_empty() {
                self.drop_handle(q_id);
            } else {
                handle.opened = true;
            }
            self.answer_ok(q_id, &in_flight.request);
        } else {
            handle.streams = in_flight.previous;
            let (category, message) = status_of(status.code, status.message);
            if !handle.opened {
                let waiting = self
                    .drop_handle(q_id)
                    .map(|h| h.waiting)
                    .unwrap_or_default();
                self.refuse(&in_flight.request, category, message);
                // Requests that waited on a queue id that never opened start afresh.
                for request in waiting {
                    self.queue_request(q_id, request, into);
                }
                return;
            }
            self.refuse(&in_flight.request, category, message);
        }
        self.next_waiting(q_id, into);
    }

    /// Translates one answer of the session for the client.
    fn translate(&mut self, message: ClientMessage, into: &mut Vec<ClientMessage>) {
        match message.kind {
            Some(Kind::OpenQueueResponse(r)) => {
                self.on_answer(r.request_id, r.status.unwrap_or_default(), into);
            }
            Some(Kind::CloseQueueResponse(r)) => {
                let waiting = self
                    .requests
                    .get(&r.request_id)
                    .and_then(|q_id| self.queues.get(q_id))
                    .map(|h| h.waiting.clone())
                    .unwrap_or_default();
                let q_id = self.requests.get(&r.request_id).copied();
                self.on_answer(r.request_id, r.status.unwrap_or_default(), into);
                // Requests that came after the close (a new open of the same queue id) are
                // served afresh once the queue id is free.
                if let Some(q_id) = q_id.filter(|q| !self.queues.contains_key(q)) {
                    for request in waiting {
                        self.queue_request(q_id, request, into);
                    }
                }
            }
            Some(Kind::Ack(ack)) => {
                let Some(&q_id) = uri_str(&ack.uri).and_then(|u| self.by_uri.get(u)) else {
                    metrics::counter!("bmq_bmqp_errors_total", "reason" => "ack_after_close")
                        .increment(1);
                    self.forget_legacy_bytes(&ack.guid);
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
                let mut correlation_id = 0;
                if let Some(legacy) = self.legacy.as_mut() {
                    match legacy.puts.remove(&guid) {
                        Some(p) if p.ack_requested => correlation_id = p.correlation_id,
                        // A success nobody asked for is not reported; a failure is, without a
                        // correlation id (as BlazingMQ does).
                        _ if status == ack_status::SUCCESS => return,
                        _ => {}
                    }
                } else if self.unacked_silent.remove(&guid) && status == ack_status::SUCCESS {
                    return;
                }
                self.acks.push(AckMessage {
                    status,
                    correlation_id,
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
                let Some(handle) = self.queues.get(&q_id) else {
                    return;
                };
                if !handle.known_ids.contains(&push.subscription_id)
                    || handle.stream_of_app(&push.app_id).is_none()
                {
                    // A subscription or app the client never configured: it would not find
                    // a queue for it. The message stays unconfirmed and goes back to the
                    // queue when the reader leaves.
                    metrics::counter!("bmq_bmqp_errors_total", "reason" => "push_unknown_subscription")
                        .increment(1);
                    return;
                }
                let options = sub_queue_infos_option(&[push.subscription_id]);
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
                let flags = if push.out_of_order {
                    flags | PUSH_OUT_OF_ORDER
                } else {
                    flags
                };
                self.pushes.push(PushMessage {
                    flags,
                    queue_id: q_id as i32,
                    guid,
                    schema_wire,
                    compression: 0,
                    options,
                    app_data,
                });
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

    fn forget_legacy_bytes(&mut self, guid: &[u8]) {
        if let Ok(guid) = <[u8; 16]>::try_from(guid) {
            self.forget_legacy(&guid);
        }
    }
}

/// Applies one client request to the handles of a queue: OpenQueue adds a handle (its read
/// and write counts to its sub-queue's), ConfigureQueueStream / ConfigureStream set a
/// reader's subscriptions, CloseQueue takes the counts it names away (a sub-queue without
/// handles left, or closed with `isFinal`, is gone). `Err` says why the request is invalid
/// (nothing changed).
fn apply(handle: &mut QueueHandle, request: &Request) -> Result<(), String> {
    match request {
        Request::OpenQueue(h) => {
            let uri = h.uri.split('?').next().unwrap_or_default();
            if uri != handle.uri {
                return Err(format!(
                    "queue id {} is open for {}, not {uri}",
                    h.q_id, handle.uri
                ));
            }
            let sub_id = h.sub_id_info.as_ref().map_or(0, |s| s.sub_id);
            let app_id = h
                .sub_id_info
                .as_ref()
                .map(|s| normal_app(&s.app_id).to_string())
                .filter(|a| !a.is_empty())
                .or_else(|| app_of(&h.uri).map(str::to_string))
                .unwrap_or_default();
            let read = h.flags & queue_flags::READ != 0;
            let write = h.flags & queue_flags::WRITE != 0;
            if !read && !write {
                return Err("an open must read or write".into());
            }
            let stream = handle.streams.entry(sub_id).or_insert_with(|| Stream {
                app_id: app_id.clone(),
                read_count: 0,
                write_count: 0,
                subscriptions: Vec::new(),
            });
            if stream.app_id != app_id {
                return Err(format!(
                    "sub-queue {sub_id} of queue id {} reads app {:?}, not {app_id:?}",
                    h.q_id, stream.app_id
                ));
            }
            if read {
                stream.read_count += h.read_count.max(1);
            }
            if write {
                stream.write_count += h.write_count.max(1);
            }
            Ok(())
        }
        Request::ConfigureQueueStream { q_id, params } => {
            let sub_id = params.sub_id_info.as_ref().map_or(0, |s| s.sub_id);
            let Some(stream) = handle.streams.get_mut(&sub_id) else {
                return Err(format!("sub-queue {sub_id} of queue id {q_id} is not open"));
            };
            stream.subscriptions = if params.is_deconfigure() {
                Vec::new()
            } else {
                vec![Subscription {
                    id: sub_id,
                    expression: String::new(),
                    priority: i32::try_from(params.consumer_priority).unwrap_or(i32::MAX),
                    max_unconfirmed_messages: u32::try_from(params.max_unconfirmed_messages)
                        .unwrap_or(u32::MAX),
                    max_unconfirmed_bytes: limit(params.max_unconfirmed_bytes),
                }]
            };
            Ok(())
        }
        Request::ConfigureStream {
            q_id,
            app_id,
            subscriptions,
        } => {
            let Some(sub_id) = handle.stream_of_app(app_id) else {
                return Err(format!("app {app_id:?} of queue id {q_id} is not open"));
            };
            let stream = handle.streams.get_mut(&sub_id).expect("found above");
            stream.subscriptions = subscriptions.iter().filter_map(our_subscription).collect();
            Ok(())
        }
        Request::CloseQueue { params, is_final } => {
            let sub_id = params.sub_id_info.as_ref().map_or(0, |s| s.sub_id);
            let Some(stream) = handle.streams.get_mut(&sub_id) else {
                return Err(format!(
                    "sub-queue {sub_id} of queue id {} is not open",
                    params.q_id
                ));
            };
            let read = params.flags & queue_flags::READ != 0;
            let write = params.flags & queue_flags::WRITE != 0;
            stream.read_count -= if read { params.read_count.max(1) } else { 0 };
            stream.write_count -= if write { params.write_count.max(1) } else { 0 };
            stream.read_count = stream.read_count.max(0);
            stream.write_count = stream.write_count.max(0);
            if stream.read_count == 0 && stream.write_count == 0 {
                handle.streams.remove(&sub_id);
            } else if stream.read_count == 0 {
                stream.subscriptions.clear();
            }
            if *is_final {
                // The SDKs set it on the close of a queue id's last sub-queue: nothing of the
                // queue id stays open.
                handle.streams.clear();
            }
            Ok(())
        }
        Request::Disconnect | Request::Unsupported(_) => Ok(()),
    }
}

impl ClientWire for BmqpWire {
    async fn recv(&mut self) -> WireInput {
        if !self.to_session.is_empty() {
            return WireInput::Many(std::mem::take(&mut self.to_session));
        }
        loop {
            let next_retry = self.open_retries.iter().map(|r| r.0).min();
            let next_heartbeat = self.heartbeat.map(|(interval, _)| {
                self.last_received + interval * (self.heartbeats_unanswered + 1)
            });
            let wake = match (next_retry, next_heartbeat) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let event = match wake {
                None => self.next_event().await,
                Some(at) => {
                    let woke = tokio::select! {
                        event = self.next_event() => Some(event),
                        _ = tokio::time::sleep_until(at) => None,
                    };
                    match woke {
                        Some(event) => event,
                        None => {
                            if let Some(reason) = self.heartbeat_due() {
                                return WireInput::Closed(reason);
                            }
                            let due = self.due_open_retries();
                            if due.is_empty() && !self.has_output() {
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
        let mut into = std::mem::take(&mut self.to_session);
        self.translate(message, &mut into);
        self.to_session = into;
    }

    async fn linger(&mut self) {
        // BlazingMQ lets the client close the connection after the DisconnectResponse; an SDK
        // takes a close by the broker for a lost connection and reconnects.
        let mut buf = [0u8; 1024];
        let end = tokio::time::Instant::now() + DISCONNECT_LINGER;
        loop {
            match tokio::time::timeout_at(end, self.read.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return,
                Ok(Ok(_)) => {}
            }
        }
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
/// producer waits up to 40 ms per round trip, whatever its window (docs/bench/JOURNAL.md
/// "BlazingMQ's Python SDK against our own client" has the figures).
fn quick_ack(fd: RawFd) {
    #[cfg(target_os = "linux")]
    {
        let one: libc::c_int = 1;
        // SAFETY: the socket of this connection, open while the connection is (the wire owns
        // the stream that owns it), and a c_int option value of the size given; a failure only
        // leaves delayed ACKs on.
        unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_QUICKACK,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = fd;
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
        Ok(StatusCode::UnknownDomain | StatusCode::InvalidUri | StatusCode::InvalidArgument) => {
            StatusCategory::InvalidArgument
        }
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
