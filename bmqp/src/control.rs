//! The control messages of a client session, typed over the BER tree of [`crate::ber`] (or a
//! JSON value), and the broker's responses.
//!
//! Schema: `src/groups/bmq/bmqp/bmqp_ctrlmsg.xsd` of BlazingMQ (cited `xsd:<line>`). Encoding
//! rules as BDE's `balber` writes them (shared/bmq-wire/BRIEF.md §3.2): the top-level value is a
//! UNIVERSAL SEQUENCE; sequence members are context tags numbered in declaration order;
//! constructed values use the indefinite length; the anonymous choice of `ControlMessage` is
//! member `[1]` holding `[selectionId]`; the named choice `NegotiationMessage` is an extra `[0]`
//! wrapper holding `[selectionId]`. Unknown members are skipped (BDE's decoders do the same),
//! so newer SDKs that add fields still parse.
//!
//! - [`decode_negotiation`]: the first CONTROL event of a session, `NegotiationMessage` choice
//!   `clientIdentity` (xsd:1643-1697), BER (libbmq) or JSON (the Java SDK).
//! - [`decode_request`]: a `ControlMessage` (xsd:85-120) with its `rId` and one of OpenQueue,
//!   CloseQueue, ConfigureQueueStream, ConfigureStream, Disconnect.
//! - [`broker_response`] and [`ControlRequest::respond`]: the answers, as whole CONTROL events
//!   in the encoding the client used. A response echoes its request where the schema says so
//!   (OpenQueueResponse.originalRequest, Configure*Response.request): the request's own tree
//!   is written back, so unknown fields survive the round trip.

use bytes::{BufMut, Bytes, BytesMut};
use serde_json::{json, Map, Value as Json};
use thiserror::Error;

use crate::ber::{self, class, Tlv, Value};
use crate::event::{pad, unpadded_len, ControlEncoding, EventType, RawEvent};

/// Queue flags of `QueueHandleParameters.flags` (bmqt_queueflags.h:47-54).
pub mod queue_flags {
    /// Admin access.
    pub const ADMIN: u64 = 1;
    /// The handle consumes.
    pub const READ: u64 = 2;
    /// The handle produces.
    pub const WRITE: u64 = 4;
    /// The producer wants ACKs.
    pub const ACK: u64 = 8;
}

/// `StatusCategory` (xsd:36): the category of a `Status` response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum StatusCategory {
    /// Success.
    Success = 0,
    /// Unknown failure.
    Unknown = -1,
    /// Timed out.
    Timeout = -2,
    /// Not connected.
    NotConnected = -3,
    /// Canceled.
    Canceled = -4,
    /// Not supported.
    NotSupported = -5,
    /// Refused (the SDK prints `REFUSED: <message>`).
    Refused = -6,
    /// Invalid argument.
    InvalidArgument = -7,
    /// Not ready; retry later.
    NotReady = -8,
}

impl StatusCategory {
    /// The enumerator's name in the schema (used by JSON).
    pub fn name(self) -> &'static str {
        match self {
            StatusCategory::Success => "E_SUCCESS",
            StatusCategory::Unknown => "E_UNKNOWN",
            StatusCategory::Timeout => "E_TIMEOUT",
            StatusCategory::NotConnected => "E_NOT_CONNECTED",
            StatusCategory::Canceled => "E_CANCELED",
            StatusCategory::NotSupported => "E_NOT_SUPPORTED",
            StatusCategory::Refused => "E_REFUSED",
            StatusCategory::InvalidArgument => "E_INVALID_ARGUMENT",
            StatusCategory::NotReady => "E_NOT_READY",
        }
    }
}

/// Why a CONTROL event is not a control message this codec understands.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ControlError {
    /// The event header names an encoding other than BER (0) or JSON (1).
    #[error("unknown control encoding {0}")]
    UnknownEncoding(u8),
    /// The padding after the payload is invalid.
    #[error("bad padding after the control payload")]
    BadPadding,
    /// The payload is not one BER value.
    #[error("malformed BER: {0}")]
    Ber(#[from] ber::BerError),
    /// The payload is not JSON.
    #[error("malformed JSON: {0}")]
    Json(String),
    /// The value does not have the schema's shape (names the first missing or wrong field).
    #[error("not a valid {0}")]
    Schema(&'static str),
}

/// What the client says of itself in its first message (`ClientIdentity`, xsd:1643-1697).
/// Fields this broker does not use are skipped.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClientIdentity {
    /// `protocolVersion` (1).
    pub protocol_version: i64,
    /// `sdkVersion` (the Python wheel 1.2.2 sends 999999).
    pub sdk_version: i64,
    /// `processName`.
    pub process_name: String,
    /// `pid`.
    pub pid: i64,
    /// `hostName`.
    pub host_name: String,
    /// `features`, `FIELD:v1,v2;FIELD2:v3` (bmqp_protocolutil.cpp:217-265).
    pub features: String,
    /// `sdkLanguage` (1 = C++, 2 = Java).
    pub sdk_language: i64,
    /// `guidInfo.clientId`: non-empty when the client generates message GUIDs.
    pub guid_client_id: String,
}

impl ClientIdentity {
    /// Whether `features` lists `value` under `field` (e.g. `PROTOCOL_ENCODING`, `BER`).
    pub fn has_feature(&self, field: &str, value: &str) -> bool {
        self.features.split(';').any(|f| {
            f.split_once(':')
                .is_some_and(|(k, vs)| k == field && vs.split(',').any(|v| v == value))
        })
    }

    /// The encoding to answer this client in: BER if it lists it (what the real broker does,
    /// bmqp_schemaeventbuilder.cpp:35-70), else JSON.
    pub fn best_encoding(&self) -> ControlEncoding {
        if self.has_feature("PROTOCOL_ENCODING", "BER") || self.features.is_empty() {
            ControlEncoding::Ber
        } else {
            ControlEncoding::Json
        }
    }
}

/// The app id of the default stream (a reader outside fanout), as the SDKs name it.
pub const DEFAULT_APP_ID: &str = "__default";

/// `SubQueueIdInfo` (xsd): the sub-queue of a fanout consumer (`uri?id=<appId>`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SubQueueIdInfo {
    /// `subId`, chosen by the client; carried back in CONFIRM.
    pub sub_id: u32,
    /// `appId`.
    pub app_id: String,
}

/// `QueueHandleParameters` (xsd:304).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QueueHandleParameters {
    /// `uri`, `bmq://<domain>/<queue>`.
    pub uri: String,
    /// `qId`, chosen by the client; every PUT, PUSH, ACK and CONFIRM carries it.
    pub q_id: u32,
    /// `subIdInfo`, present for fanout consumers.
    pub sub_id_info: Option<SubQueueIdInfo>,
    /// `flags` ([`queue_flags`]).
    pub flags: u64,
    /// `readCount`.
    pub read_count: i64,
    /// `writeCount`.
    pub write_count: i64,
}

/// A consumer's stream parameters: `QueueStreamParameters` (xsd:334) of ConfigureQueueStream,
/// or the first consumer of the first subscription of ConfigureStream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StreamParameters {
    /// `subIdInfo` / the app id of ConfigureStream.
    pub sub_id_info: Option<SubQueueIdInfo>,
    /// `maxUnconfirmedMessages` (0 with priority `i32::MIN`: stop delivering).
    pub max_unconfirmed_messages: i64,
    /// `maxUnconfirmedBytes`.
    pub max_unconfirmed_bytes: i64,
    /// `consumerPriority` (`i32::MIN` = deconfigured).
    pub consumer_priority: i64,
    /// `consumerPriorityCount`.
    pub consumer_priority_count: i64,
}

impl StreamParameters {
    /// Whether these parameters stop deliveries (the SDK "deconfigures" a reader before
    /// closing it: 0 messages, priority `i32::MIN`).
    pub fn is_deconfigure(&self) -> bool {
        self.max_unconfirmed_messages <= 0 || self.consumer_priority == i64::from(i32::MIN)
    }
}

/// One `ConsumerInfo` of a subscription (xsd:429).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConsumerInfo {
    /// `maxUnconfirmedMessages`.
    pub max_unconfirmed_messages: i64,
    /// `maxUnconfirmedBytes`.
    pub max_unconfirmed_bytes: i64,
    /// `consumerPriority` (`i32::MIN` when absent: the schema's default).
    pub consumer_priority: i64,
    /// `consumerPriorityCount`.
    pub consumer_priority_count: i64,
}

/// One `Subscription` of ConfigureStream (xsd:456): its id, expression and consumers (the
/// first is the highest priority, `bmqp_conversionutil.h`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SubscriptionParameters {
    /// `sId`, chosen by the client; every PUSH of this subscription carries it in its
    /// `SUB_QUEUE_INFOS` option.
    pub s_id: u32,
    /// `expression.text` (empty: every message).
    pub expression: String,
    /// `expression.version`: 0 `E_UNDEFINED`, 1 `E_VERSION_1`.
    pub expression_version: i64,
    /// `consumers`.
    pub consumers: Vec<ConsumerInfo>,
}

/// The request inside a [`ControlRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// `openQueue` (choice id 10).
    OpenQueue(QueueHandleParameters),
    /// `closeQueue` (12).
    CloseQueue {
        /// The handle being closed.
        params: QueueHandleParameters,
        /// `isFinal`.
        is_final: bool,
    },
    /// `configureQueueStream` (14).
    ConfigureQueueStream {
        /// `qId`.
        q_id: u32,
        /// `streamParameters`.
        params: StreamParameters,
    },
    /// `configureStream` (16): the subscriptions of one stream (app) of the queue; none at
    /// all is a "deconfigure" (the reader stops receiving).
    ConfigureStream {
        /// `qId`.
        q_id: u32,
        /// `streamParameters.appId` (`__default` outside fanout).
        app_id: String,
        /// `streamParameters.subscriptions`, in order.
        subscriptions: Vec<SubscriptionParameters>,
    },
    /// `disconnect` (1).
    Disconnect,
    /// Any other choice (admin commands, cluster messages): answered with a status.
    Unsupported(String),
}

/// The request's own value, kept to echo it in the response.
#[derive(Debug, Clone, PartialEq)]
enum Echo {
    Ber(Tlv),
    Json(Json),
}

/// A decoded `ControlMessage`: its `rId`, the request, and the encoding to answer in.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlRequest {
    /// `rId`, echoed in the response (`None`: the client expects no answer).
    pub r_id: Option<i64>,
    /// The request.
    pub request: Request,
    /// The encoding the request came in (the response uses it).
    pub encoding: ControlEncoding,
    echo: Echo,
}

/// A response to a [`ControlRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// The `status` choice (0): a failure with its category, code and message.
    Status {
        /// Category.
        category: StatusCategory,
        /// Code (free; shown by the SDK).
        code: i32,
        /// Message (shown by the SDK).
        message: String,
    },
    /// `openQueueResponse` (11), echoing the request, with the duplicate-detection window the
    /// SDK uses to bound its PUT retransmissions (`deduplicationTimeMs`).
    OpenQueue {
        /// `deduplicationTimeMs`.
        deduplication_ms: i64,
    },
    /// `closeQueueResponse` (13).
    CloseQueue,
    /// `configureQueueStreamResponse` (15) or `configureStreamResponse` (17), whichever the
    /// request was, echoing it.
    Configure,
    /// `disconnectResponse` (2).
    Disconnect,
}

/// What the broker says of itself in its [`broker_response`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerIdentity {
    /// `brokerVersion` / `sdkVersion` (a number; the SDKs do not check it).
    pub version: i64,
    /// `processName`.
    pub process_name: String,
    /// `pid`.
    pub pid: i64,
    /// `hostName`.
    pub host_name: String,
    /// `clusterName`.
    pub cluster_name: String,
    /// `clusterNodeId`.
    pub node_id: i64,
    /// `features`; see [`BROKER_FEATURES`].
    pub features: String,
    /// `BrokerResponse.heartbeatIntervalMs`: how often a client that monitors the broker
    /// expects to hear from it (libbmq since 2025 sends HEARTBEAT_REQ after one silent
    /// interval); 0 disables.
    pub heartbeat_interval_ms: i64,
    /// `BrokerResponse.maxMissedHeartbeats`: silent intervals before such a client drops
    /// the connection.
    pub max_missed_heartbeats: i64,
}

/// The features this broker advertises: both encodings, the new-style message properties, and
/// subscriptions (`SUBSCRIPTIONS:CONFIGURE_STREAM`: libbmq then configures readers with
/// ConfigureStream, as the Java SDK always does; bmqp_protocol.cpp `SubscriptionsFeatures`).
pub const BROKER_FEATURES: &str =
    "PROTOCOL_ENCODING:BER,JSON;MPS:MESSAGE_PROPERTIES_EX;SUBSCRIPTIONS:CONFIGURE_STREAM";

// ---------------------------------------------------------------------------------------------
// Reading

/// The payload of a CONTROL event body (padding stripped), with its encoding.
fn payload(event: &RawEvent) -> Result<(Bytes, ControlEncoding), ControlError> {
    let encoding = event.header.control_encoding();
    if let ControlEncoding::Unknown(v) = encoding {
        return Err(ControlError::UnknownEncoding(v));
    }
    let len = unpadded_len(&event.body).ok_or(ControlError::BadPadding)?;
    Ok((event.body.slice(..len), encoding))
}

fn parse_json(bytes: &Bytes) -> Result<Json, ControlError> {
    // A JSON writer may pad with NULs or spaces before the bmqp padding: trim them.
    let end = bytes
        .iter()
        .rposition(|b| !matches!(b, 0 | b' ' | b'\n' | b'\r' | b'\t'))
        .map_or(0, |i| i + 1);
    serde_json::from_slice(&bytes[..end]).map_err(|e| ControlError::Json(e.to_string()))
}

fn top_sequence(bytes: &Bytes) -> Result<Tlv, ControlError> {
    let (tlv, _) = ber::decode(bytes)?;
    if tlv.class != class::UNIVERSAL || tlv.tag != 16 || !matches!(tlv.value, Value::Constructed(_))
    {
        return Err(ControlError::Schema("message: not a SEQUENCE"));
    }
    Ok(tlv)
}

fn ber_int(t: &Tlv, tag: u32) -> Option<i64> {
    t.member(tag).and_then(Tlv::as_i64)
}

fn ber_str(t: &Tlv, tag: u32) -> Option<String> {
    t.member(tag).and_then(Tlv::as_str).map(str::to_string)
}

fn ber_bool(t: &Tlv, tag: u32) -> Option<bool> {
    ber_int(t, tag).map(|v| v != 0)
}

fn json_int(v: &Json, key: &str) -> Option<i64> {
    match v.get(key)? {
        Json::Number(n) => n.as_i64().or_else(|| n.as_u64().map(|u| u as i64)),
        Json::String(s) => s.parse().ok(),
        _ => None,
    }
}

fn json_str(v: &Json, key: &str) -> Option<String> {
    v.get(key)?.as_str().map(str::to_string)
}

/// The selection of a named choice at the top of a BER message (NegotiationMessage,
/// AuthenticationMessage): a `[0]` wrapper holding `[selection]`, which must be `selection`.
fn named_choice<'a>(
    top: &'a Tlv,
    selection: u32,
    what: &'static str,
) -> Result<&'a Tlv, ControlError> {
    let chosen = top
        .member(0)
        .and_then(|w| w.members().first())
        .ok_or(ControlError::Schema(what))?;
    if chosen.class != class::CONTEXT || chosen.tag != selection {
        return Err(ControlError::Schema(what));
    }
    Ok(chosen)
}

/// Reads the first CONTROL event of a session: `NegotiationMessage` with `clientIdentity`.
///
/// Errors: [`ControlError`] when it is not one (another choice, a malformed payload).
pub fn decode_negotiation(event: &RawEvent) -> Result<ClientIdentity, ControlError> {
    const WHAT: &str = "NegotiationMessage.clientIdentity";
    let (bytes, encoding) = payload(event)?;
    if encoding == ControlEncoding::Json {
        let v = parse_json(&bytes)?;
        let c = v.get("clientIdentity").ok_or(ControlError::Schema(WHAT))?;
        return Ok(ClientIdentity {
            protocol_version: json_int(c, "protocolVersion").unwrap_or(1),
            sdk_version: json_int(c, "sdkVersion").unwrap_or(0),
            process_name: json_str(c, "processName").unwrap_or_default(),
            pid: json_int(c, "pid").unwrap_or(0),
            host_name: json_str(c, "hostName").unwrap_or_default(),
            features: json_str(c, "features").unwrap_or_default(),
            sdk_language: match c.get("sdkLanguage").and_then(Json::as_str) {
                Some("E_JAVA") => 2,
                _ => 1,
            },
            guid_client_id: c
                .get("guidInfo")
                .and_then(|g| json_str(g, "clientId"))
                .unwrap_or_default(),
        });
    }
    let top = top_sequence(&bytes)?;
    // clientIdentity is selection 0.
    let c = named_choice(&top, 0, WHAT)?;
    Ok(ClientIdentity {
        protocol_version: ber_int(c, 0).unwrap_or(1),
        sdk_version: ber_int(c, 1).unwrap_or(0),
        process_name: ber_str(c, 3).unwrap_or_default(),
        pid: ber_int(c, 4).unwrap_or(0),
        host_name: ber_str(c, 6).unwrap_or_default(),
        features: ber_str(c, 7).unwrap_or_default(),
        sdk_language: ber_int(c, 10).unwrap_or(1),
        guid_client_id: c.member(11).and_then(|g| ber_str(g, 0)).unwrap_or_default(),
    })
}

/// A client's credentials: `AuthenticationRequest` (xsd:1755) of an AUTHENTICATION event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthenticationRequest {
    /// `mechanism`, e.g. `BASIC` (data `name:password`) or `ANONYMOUS`.
    pub mechanism: String,
    /// `data` (base64 in JSON, raw octets in BER).
    pub data: Vec<u8>,
    /// The encoding it came in (the answer uses it).
    pub encoding: ControlEncoding,
}

/// Reads an AUTHENTICATION event: `AuthenticationMessage` choice `authenticationRequest`
/// (xsd:1735-1771), BER or JSON as its header says.
///
/// Errors: [`ControlError`] when it is not one.
pub fn decode_authentication(event: &RawEvent) -> Result<AuthenticationRequest, ControlError> {
    const WHAT: &str = "AuthenticationMessage.authenticationRequest";
    let (bytes, encoding) = payload(event)?;
    if encoding == ControlEncoding::Json {
        use base64::Engine;
        let v = parse_json(&bytes)?;
        let r = v
            .get("authenticationRequest")
            .ok_or(ControlError::Schema(WHAT))?;
        let data = match json_str(r, "data") {
            Some(d) => base64::engine::general_purpose::STANDARD
                .decode(d)
                .map_err(|_| ControlError::Schema(WHAT))?,
            None => Vec::new(),
        };
        return Ok(AuthenticationRequest {
            mechanism: json_str(r, "mechanism").ok_or(ControlError::Schema(WHAT))?,
            data,
            encoding,
        });
    }
    let top = top_sequence(&bytes)?;
    // authenticationRequest is selection 0.
    let selection = named_choice(&top, 0, WHAT)?;
    let data = match selection.member(1).map(|t| &t.value) {
        Some(Value::Primitive(b)) => b.to_vec(),
        _ => Vec::new(),
    };
    Ok(AuthenticationRequest {
        mechanism: ber_str(selection, 0).ok_or(ControlError::Schema(WHAT))?,
        data,
        encoding,
    })
}

/// The broker's answer to an [`AuthenticationRequest`]: `AuthenticationMessage` choice
/// `authenticationResponse` (xsd:1773) with its status and no `lifetimeMs` (no
/// re-authentication), as a whole AUTHENTICATION event in `encoding`.
pub fn authentication_response(
    encoding: ControlEncoding,
    category: StatusCategory,
    message: &str,
) -> Bytes {
    let event = if encoding == ControlEncoding::Json {
        control_event(encoding, |out| {
            let v = json!({"authenticationResponse": {
                "status": {"category": category.name(), "code": 0, "message": message}}});
            out.put_slice(v.to_string().as_bytes())
        })
    } else {
        let response = seq(1, vec![seq(0, ber_status(category, 0, message))]);
        let top = Tlv::sequence(vec![seq(0, vec![response])]);
        control_event(ControlEncoding::Ber, |out| ber::encode(&top, out))
    };
    // The same layout as a CONTROL event (encoding in the type-specific bits), type 15.
    let mut bytes = BytesMut::from(&event[..]);
    bytes[4] = (bytes[4] & 0xc0) | EventType::Authentication.code();
    bytes.freeze()
}

fn ber_sub_id_info(t: Option<&Tlv>) -> Option<SubQueueIdInfo> {
    let t = t?;
    Some(SubQueueIdInfo {
        sub_id: ber_int(t, 0).unwrap_or(0) as u32,
        app_id: ber_str(t, 1).unwrap_or_else(|| "__default".into()),
    })
}

fn ber_handle(t: &Tlv) -> Result<QueueHandleParameters, ControlError> {
    const WHAT: &str = "QueueHandleParameters";
    Ok(QueueHandleParameters {
        uri: ber_str(t, 0).ok_or(ControlError::Schema(WHAT))?,
        q_id: u32::try_from(ber_int(t, 1).ok_or(ControlError::Schema(WHAT))?)
            .map_err(|_| ControlError::Schema(WHAT))?,
        sub_id_info: ber_sub_id_info(t.member(2)),
        flags: ber_int(t, 3).unwrap_or(0) as u64,
        read_count: ber_int(t, 4).unwrap_or(0),
        write_count: ber_int(t, 5).unwrap_or(0),
    })
}

fn ber_stream(t: &Tlv) -> StreamParameters {
    StreamParameters {
        sub_id_info: ber_sub_id_info(t.member(0)),
        max_unconfirmed_messages: ber_int(t, 1).unwrap_or(0),
        max_unconfirmed_bytes: ber_int(t, 2).unwrap_or(0),
        consumer_priority: ber_int(t, 3).unwrap_or(0),
        consumer_priority_count: ber_int(t, 4).unwrap_or(0),
    }
}

fn ber_subscription(t: &Tlv) -> SubscriptionParameters {
    let expression = t.member(1);
    SubscriptionParameters {
        s_id: ber_int(t, 0).unwrap_or(0) as u32,
        expression: expression.and_then(|e| ber_str(e, 1)).unwrap_or_default(),
        expression_version: expression.and_then(|e| ber_int(e, 0)).unwrap_or(0),
        consumers: t
            .member(2)
            .map(|array| {
                array
                    .members()
                    .iter()
                    .map(|c| ConsumerInfo {
                        max_unconfirmed_messages: ber_int(c, 0).unwrap_or(0),
                        max_unconfirmed_bytes: ber_int(c, 1).unwrap_or(0),
                        consumer_priority: ber_int(c, 2).unwrap_or(i64::from(i32::MIN)),
                        consumer_priority_count: ber_int(c, 3).unwrap_or(0),
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

fn ber_request(selection: &Tlv) -> Result<Request, ControlError> {
    Ok(match selection.tag {
        1 => Request::Disconnect,
        10 => Request::OpenQueue(ber_handle(
            selection
                .member(0)
                .ok_or(ControlError::Schema("OpenQueue"))?,
        )?),
        12 => Request::CloseQueue {
            params: ber_handle(
                selection
                    .member(0)
                    .ok_or(ControlError::Schema("CloseQueue"))?,
            )?,
            is_final: ber_bool(selection, 1).unwrap_or(true),
        },
        14 => Request::ConfigureQueueStream {
            q_id: ber_int(selection, 0).ok_or(ControlError::Schema("ConfigureQueueStream"))? as u32,
            params: ber_stream(
                selection
                    .member(1)
                    .ok_or(ControlError::Schema("ConfigureQueueStream"))?,
            ),
        },
        16 => {
            // ConfigureStream {qId, streamParameters {appId, subscriptions [{sId, expression
            // {version, text}, consumers [{maxUnconfirmedMessages, maxUnconfirmedBytes,
            // consumerPriority, consumerPriorityCount}]}]}} (xsd:275, 383). An array is one
            // constructed member holding its elements under their UNIVERSAL tags (balber's
            // `encodeArrayImpl`); an empty one may be left out.
            let q_id = ber_int(selection, 0).ok_or(ControlError::Schema("ConfigureStream"))?;
            let sp = selection.member(1);
            let app_id = sp
                .and_then(|s| ber_str(s, 0))
                .unwrap_or_else(|| DEFAULT_APP_ID.into());
            let subscriptions = sp
                .and_then(|s| s.member(1))
                .map(|array| array.members().iter().map(ber_subscription).collect())
                .unwrap_or_default();
            Request::ConfigureStream {
                q_id: u32::try_from(q_id).map_err(|_| ControlError::Schema("ConfigureStream"))?,
                app_id,
                subscriptions,
            }
        }
        other => Request::Unsupported(format!("control message choice {other}")),
    })
}

fn json_sub_id_info(v: Option<&Json>) -> Option<SubQueueIdInfo> {
    let v = v?;
    Some(SubQueueIdInfo {
        sub_id: json_int(v, "subId").unwrap_or(0) as u32,
        app_id: json_str(v, "appId").unwrap_or_else(|| "__default".into()),
    })
}

fn json_handle(v: Option<&Json>) -> Result<QueueHandleParameters, ControlError> {
    const WHAT: &str = "QueueHandleParameters";
    let v = v.ok_or(ControlError::Schema(WHAT))?;
    Ok(QueueHandleParameters {
        uri: json_str(v, "uri").ok_or(ControlError::Schema(WHAT))?,
        q_id: u32::try_from(json_int(v, "qId").ok_or(ControlError::Schema(WHAT))?)
            .map_err(|_| ControlError::Schema(WHAT))?,
        sub_id_info: json_sub_id_info(v.get("subIdInfo")),
        flags: json_int(v, "flags").unwrap_or(0) as u64,
        read_count: json_int(v, "readCount").unwrap_or(0),
        write_count: json_int(v, "writeCount").unwrap_or(0),
    })
}

fn json_consumer(c: &Json, sub_id_info: Option<SubQueueIdInfo>) -> StreamParameters {
    StreamParameters {
        sub_id_info,
        max_unconfirmed_messages: json_int(c, "maxUnconfirmedMessages").unwrap_or(0),
        max_unconfirmed_bytes: json_int(c, "maxUnconfirmedBytes").unwrap_or(0),
        consumer_priority: json_int(c, "consumerPriority").unwrap_or(0),
        consumer_priority_count: json_int(c, "consumerPriorityCount").unwrap_or(0),
    }
}

fn json_subscription(v: &Json) -> SubscriptionParameters {
    let expression = v.get("expression");
    SubscriptionParameters {
        s_id: json_int(v, "sId").unwrap_or(0) as u32,
        expression: expression
            .and_then(|e| json_str(e, "text"))
            .unwrap_or_default(),
        expression_version: match expression.and_then(|e| e.get("version")) {
            Some(Json::String(s)) if s == "E_VERSION_1" => 1,
            Some(Json::Number(n)) => n.as_i64().unwrap_or(0),
            _ => 0,
        },
        consumers: v
            .get("consumers")
            .and_then(Json::as_array)
            .map(|cs| {
                cs.iter()
                    .map(|c| ConsumerInfo {
                        max_unconfirmed_messages: json_int(c, "maxUnconfirmedMessages")
                            .unwrap_or(0),
                        max_unconfirmed_bytes: json_int(c, "maxUnconfirmedBytes").unwrap_or(0),
                        consumer_priority: json_int(c, "consumerPriority")
                            .unwrap_or(i64::from(i32::MIN)),
                        consumer_priority_count: json_int(c, "consumerPriorityCount").unwrap_or(0),
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

fn json_request(name: &str, v: &Json) -> Result<Request, ControlError> {
    Ok(match name {
        "disconnect" => Request::Disconnect,
        "openQueue" => Request::OpenQueue(json_handle(v.get("handleParameters"))?),
        "closeQueue" => Request::CloseQueue {
            params: json_handle(v.get("handleParameters"))?,
            is_final: v.get("isFinal").and_then(Json::as_bool).unwrap_or(true),
        },
        "configureQueueStream" => {
            let sp = v
                .get("streamParameters")
                .ok_or(ControlError::Schema("ConfigureQueueStream"))?;
            Request::ConfigureQueueStream {
                q_id: json_int(v, "qId").ok_or(ControlError::Schema("ConfigureQueueStream"))?
                    as u32,
                params: json_consumer(sp, json_sub_id_info(sp.get("subIdInfo"))),
            }
        }
        "configureStream" => {
            let sp = v.get("streamParameters");
            let app_id = sp
                .and_then(|s| json_str(s, "appId"))
                .unwrap_or_else(|| DEFAULT_APP_ID.into());
            let subscriptions = sp
                .and_then(|s| s.get("subscriptions"))
                .and_then(Json::as_array)
                .map(|subs| subs.iter().map(json_subscription).collect())
                .unwrap_or_default();
            let q_id = json_int(v, "qId").ok_or(ControlError::Schema("ConfigureStream"))?;
            Request::ConfigureStream {
                q_id: u32::try_from(q_id).map_err(|_| ControlError::Schema("ConfigureStream"))?,
                app_id,
                subscriptions,
            }
        }
        other => Request::Unsupported(format!("control message {other:?}")),
    })
}

/// Reads a `ControlMessage` from a CONTROL event (BER or JSON, as its header says).
///
/// Errors: [`ControlError`] for a malformed payload or a value without the schema's shape; a
/// well-formed message of a kind clients do not send is [`Request::Unsupported`].
pub fn decode_request(event: &RawEvent) -> Result<ControlRequest, ControlError> {
    let (bytes, encoding) = payload(event)?;
    if encoding == ControlEncoding::Json {
        let v = parse_json(&bytes)?;
        let obj = v
            .as_object()
            .ok_or(ControlError::Schema("ControlMessage"))?;
        let r_id = json_int(&v, "rId");
        let (name, inner) = obj
            .iter()
            .find(|(k, _)| k.as_str() != "rId")
            .ok_or(ControlError::Schema("ControlMessage: no choice"))?;
        return Ok(ControlRequest {
            r_id,
            request: json_request(name, inner)?,
            encoding,
            echo: Echo::Json(inner.clone()),
        });
    }
    let top = top_sequence(&bytes)?;
    let r_id = ber_int(&top, 0);
    let selection = top
        .member(1)
        .and_then(|w| w.members().first())
        .ok_or(ControlError::Schema("ControlMessage: no choice"))?;
    Ok(ControlRequest {
        r_id,
        request: ber_request(selection)?,
        encoding,
        echo: Echo::Ber(selection.clone()),
    })
}

// ---------------------------------------------------------------------------------------------
// Writing

fn int(tag: u32, v: i64) -> Tlv {
    Tlv::context_int(tag, v)
}

fn string(tag: u32, s: &str) -> Tlv {
    Tlv::context(tag, s.as_bytes())
}

fn seq(tag: u32, members: Vec<Tlv>) -> Tlv {
    Tlv::context_seq(tag, members)
}

fn retag(t: &Tlv, tag: u32) -> Tlv {
    Tlv { tag, ..t.clone() }
}

fn control_event(encoding: ControlEncoding, write: impl FnOnce(&mut BytesMut)) -> Bytes {
    let mut body = BytesMut::new();
    write(&mut body);
    pad(&mut body);
    let specific = match encoding {
        ControlEncoding::Json => 1 << 5,
        _ => 0,
    };
    RawEvent::new(EventType::Control, specific, body.freeze()).to_bytes()
}

fn ber_event(members: Vec<Tlv>) -> Bytes {
    let top = Tlv::sequence(members);
    control_event(ControlEncoding::Ber, |out| ber::encode(&top, out))
}

fn json_event(v: &Json) -> Bytes {
    control_event(ControlEncoding::Json, |out| {
        out.put_slice(v.to_string().as_bytes())
    })
}

fn ber_status(category: StatusCategory, code: i32, message: &str) -> Vec<Tlv> {
    vec![
        int(0, category as i64),
        int(1, i64::from(code)),
        string(2, message),
    ]
}

/// `heartbeatIntervalMs` and `maxMissedHeartbeats` of a BER BrokerResponse: written only when
/// not the schema's defaults (3000 ms, 10), which a client assumes without them.
fn heartbeat_fields(broker: &BrokerIdentity) -> Vec<Tlv> {
    if (broker.heartbeat_interval_ms, broker.max_missed_heartbeats) == (3000, 10) {
        return Vec::new();
    }
    vec![
        int(5, broker.heartbeat_interval_ms),
        int(6, broker.max_missed_heartbeats),
    ]
}

/// The broker's answer to a client's negotiation (`NegotiationMessage` choice
/// `brokerResponse`, xsd:1698-1720), as a whole CONTROL event in `encoding`. libbmq checks
/// only `result.category` and the features (bmqimp_negotiatedchannelfactory.cpp:222-337).
pub fn broker_response(
    encoding: ControlEncoding,
    category: StatusCategory,
    message: &str,
    broker: &BrokerIdentity,
) -> Bytes {
    if encoding == ControlEncoding::Json {
        return json_event(&json!({"brokerResponse": {
            "result": {"category": category.name(), "code": 0, "message": message},
            "protocolVersion": 1,
            "brokerVersion": broker.version,
            "isDeprecatedSdk": false,
            "brokerIdentity": {
                "protocolVersion": 1,
                "sdkVersion": broker.version,
                "clientType": "E_TCPBROKER",
                "processName": broker.process_name,
                "pid": broker.pid,
                "sessionId": 1,
                "hostName": broker.host_name,
                "features": broker.features,
                "clusterName": broker.cluster_name,
                "clusterNodeId": broker.node_id,
                "sdkLanguage": "E_CPP",
                "guidInfo": {"clientId": "", "nanoSecondsFromEpoch": 0},
            },
            "heartbeatIntervalMs": broker.heartbeat_interval_ms,
            "maxMissedHeartbeats": broker.max_missed_heartbeats,
        }}));
    }
    let identity = vec![
        int(0, 1),
        int(1, broker.version),
        int(2, 2), // E_TCPBROKER
        string(3, &broker.process_name),
        int(4, broker.pid),
        int(5, 1),
        string(6, &broker.host_name),
        string(7, &broker.features),
        string(8, &broker.cluster_name),
        int(9, broker.node_id),
        int(10, 1), // E_CPP
        seq(11, vec![string(0, ""), int(1, 0)]),
    ];
    let response = seq(
        1,
        vec![
            seq(0, ber_status(category, 0, message)),
            int(1, 1),
            int(2, broker.version),
            int(3, 0),
            seq(4, identity),
        ]
        .into_iter()
        .chain(heartbeat_fields(broker))
        .collect(),
    );
    ber_event(vec![seq(0, vec![response])])
}

impl ControlRequest {
    /// The response to this request, as a whole CONTROL event in the request's encoding.
    pub fn respond(&self, response: &Response) -> Bytes {
        match &self.echo {
            Echo::Ber(request) => {
                let selection = match response {
                    Response::Status {
                        category,
                        code,
                        message,
                    } => seq(0, ber_status(*category, *code, message)),
                    Response::OpenQueue { deduplication_ms } => seq(
                        11,
                        vec![
                            retag(request, 0),
                            seq(1, vec![int(0, 0)]),
                            int(2, *deduplication_ms),
                        ],
                    ),
                    Response::CloseQueue => seq(13, vec![]),
                    Response::Configure => seq(request.tag + 1, vec![retag(request, 0)]),
                    Response::Disconnect => seq(2, vec![]),
                };
                let mut members = Vec::with_capacity(2);
                if let Some(r_id) = self.r_id {
                    members.push(int(0, r_id));
                }
                members.push(seq(1, vec![selection]));
                ber_event(members)
            }
            Echo::Json(request) => {
                let (name, value) = match response {
                    Response::Status {
                        category,
                        code,
                        message,
                    } => (
                        "status",
                        json!({"category": category.name(), "code": code, "message": message}),
                    ),
                    Response::OpenQueue { deduplication_ms } => (
                        "openQueueResponse",
                        json!({"originalRequest": request, "routingConfiguration": {"flags": 0},
                               "deduplicationTimeMs": deduplication_ms}),
                    ),
                    Response::CloseQueue => ("closeQueueResponse", json!({})),
                    Response::Configure => match self.request {
                        Request::ConfigureStream { .. } => {
                            ("configureStreamResponse", json!({"request": request}))
                        }
                        _ => ("configureQueueStreamResponse", json!({"request": request})),
                    },
                    Response::Disconnect => ("disconnectResponse", json!({})),
                };
                let mut obj = Map::new();
                if let Some(r_id) = self.r_id {
                    obj.insert("rId".into(), json!(r_id));
                }
                obj.insert(name.into(), value);
                json_event(&Json::Object(obj))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_integers() {
        for (v, want) in [
            (0i64, &[0u8][..]),
            (1, &[1]),
            (127, &[0x7f]),
            (128, &[0, 0x80]),
            (-1, &[0xff]),
            (-128, &[0x80]),
            (-129, &[0xff, 0x7f]),
            (300_000, &[0x04, 0x93, 0xe0]),
            (i64::from(i32::MIN), &[0x80, 0, 0, 0]),
        ] {
            let Value::Primitive(b) = int(0, v).value else {
                unreachable!()
            };
            assert_eq!(&b[..], want, "{v}");
            assert_eq!(int(0, v).as_i64(), Some(v));
        }
    }

    #[test]
    fn features_are_parsed_by_field() {
        let c = ClientIdentity {
            features: "PROTOCOL_ENCODING:BER,JSON;MPS:MESSAGE_PROPERTIES_EX".into(),
            ..Default::default()
        };
        assert!(c.has_feature("PROTOCOL_ENCODING", "JSON"));
        assert!(c.has_feature("MPS", "MESSAGE_PROPERTIES_EX"));
        assert!(!c.has_feature("MPS", "BER"));
        assert_eq!(c.best_encoding(), ControlEncoding::Ber);
        let java = ClientIdentity {
            features: "PROTOCOL_ENCODING:JSON;MPS:MESSAGE_PROPERTIES_EX".into(),
            ..Default::default()
        };
        assert_eq!(java.best_encoding(), ControlEncoding::Json);
    }

    #[test]
    fn json_requests_decode_and_echo() {
        let body = br#"{"rId":4,"openQueue":{"handleParameters":{"uri":"bmq://d/q","qId":3,"flags":6,"readCount":1,"writeCount":1,"adminCount":0}}}"#;
        let mut b = BytesMut::from(&body[..]);
        pad(&mut b);
        let event = RawEvent::new(EventType::Control, 1 << 5, b.freeze());
        let req = decode_request(&event).unwrap();
        assert_eq!(req.r_id, Some(4));
        let Request::OpenQueue(h) = &req.request else {
            panic!("{req:?}")
        };
        assert_eq!((h.uri.as_str(), h.q_id, h.flags), ("bmq://d/q", 3, 6));
        let out = req.respond(&Response::OpenQueue {
            deduplication_ms: 300_000,
        });
        let text = String::from_utf8_lossy(&out[8..]);
        assert!(text.contains(r#""rId":4"#), "{text}");
        assert!(
            text.contains(r#""originalRequest":{"handleParameters""#),
            "{text}"
        );
        assert_eq!(out[6], 0x20, "JSON encoding bit");
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for body in [
            &b"\x01"[..],
            b"\x30\x80\x04\x04\x04\x04",
            b"{not json}\x02\x02",
        ] {
            let event = RawEvent::new(EventType::Control, 0, Bytes::copy_from_slice(body));
            assert!(decode_request(&event).is_err());
            assert!(decode_negotiation(&event).is_err());
        }
    }
}
