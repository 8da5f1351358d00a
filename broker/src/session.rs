//! Client sessions: one task per client connection, on whichever node the client chose.
//!
//! A session speaks the client protocol (DESIGN.md §8): `Hello` first ([`handshake`]: protocol
//! version, token), then OpenQueue, Put, Confirm, CloseQueue, Disconnect. Its decisions are the
//! data plane's [`Proxy`] core (routes, the retransmission buffer, resends after a failover);
//! this file owns the socket, authenticates the client, authorises each OpenQueue, and
//! executes the proxy's outputs: requests to primaries through the [`Router`], answers to the
//! client, queue resolution in the background.
//!
//! Bad input: a frame that is oversized or does not decode closes this connection only, with
//! a logged reason and `bmq_client_frame_errors_total`; a malformed URI or unknown domain is
//! answered with a status naming the problem.
//!
//! A client that reads nothing while its session has frames for it, for the request timeout
//! (`limits.request_timeout_ms`), is closed (`bmq_client_write_timeouts_total`): its session
//! ends like any other, so the messages pushed to it and not confirmed go to other consumers
//! instead of waiting on it for as long as the connection stays open.
//!
//! Security: with `[tls] client_listener`, the connection is TLS from the first byte
//! (a failed handshake is logged with the remote address and counted in
//! `bmq_client_tls_failures_total`). `Hello.token` is checked against `[[auth.tokens]]`
//! ([`crate::auth`]): an unknown token is answered `NOT_AUTHORIZED` and the connection closed
//! (`bmq_client_auth_failures_total`); each OpenQueue needs `produce` (write) and `consume`
//! (read) on the queue's domain, else `NOT_AUTHORIZED` naming the missing permission
//! (`bmq_client_unauthorized_total`). A reload that removes or narrows the session's token
//! ends it: the client gets an `ErrorResponse` `NOT_AUTHORIZED` with the reason, then the
//! connection closes (`crate::reload`).
//!
//! Thread: every session is a tokio task on the node's main (actix System) thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bmq_dataplane::{PrimaryRoute, Proxy, ProxyConfig, ProxyOutput};
use bmq_metadata::{ClusterState, PrimaryStatus};
use bmq_proto::client::{
    client_message::Kind, ClientMessage, DisconnectResponse, ErrorResponse, Hello, HelloResponse,
    OpenQueue, OpenQueueResponse, Status, StatusCode,
};
use bmq_proto::uri::QueueUri;
use bmq_proto::{BoxedStream, FrameCodec, FrameWriter, LeaseId, PartitionId, PROTOCOL_VERSION};
use futures::{FutureExt, StreamExt};
use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpListener;
use tokio::sync::broadcast::error::RecvError;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::auth::{authenticate, ClientIdentity};
use crate::router::{
    Dispatch, Revocation, Router, SessionEvent, SessionRegistration, SessionSettings,
};

/// A buffered PUT with no answer for this long is sent again.
const RETRANSMIT_INTERVAL: Duration = Duration::from_millis(1_000);
/// How often the session looks for PUTs to retransmit.
const RETRANSMIT_CHECK_PERIOD: Duration = Duration::from_millis(250);
/// How long a client has to send its Hello (or a BlazingMQ SDK its negotiation).
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client's TLS handshake may take.
pub(crate) const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most client connections in their TLS handshake at once; beyond that new connections are
/// closed at once and counted in `bmq_client_connections_refused_total`.
pub(crate) const TLS_HANDSHAKES_MAX: usize = 256;
/// Most frames written per flush: one flush per loop turn carries many frames.
const FRAMES_PER_FLUSH_MAX: usize = 1024;
/// Why a session whose inbox overflowed ended (`Router::to_local_session`).
const INBOX_OVERFLOWED: &str = "its inbox overflowed: the client read too slowly";
/// Bytes a session gathers for its client before it must write them (it writes once per loop
/// turn anyway).
const WRITE_BATCH_BYTES: usize = 256 * 1024;

type Source = FramedRead<ReadHalf<BoxedStream>, FrameCodec<ClientMessage>>;

/// The write side of a client connection: frames gathered by a [`FrameWriter`] and written
/// with vectored writes (a PUSH's payload is written from the buffer it arrived in).
struct Sink {
    io: WriteHalf<BoxedStream>,
    out: FrameWriter,
}

/// Accepts client connections on `listener` until the process ends; with `tls`, each
/// connection is TLS (handshake in the connection's own task, bounded by
/// `TLS_HANDSHAKE_TIMEOUT`, 10 s).
pub async fn serve_clients(
    listener: TcpListener,
    router: Arc<Router>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let handshakes = Arc::new(tokio::sync::Semaphore::new(TLS_HANDSHAKES_MAX));
    let settings = router.session_settings();
    loop {
        let (stream, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "client listener accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if router.session_count() >= settings.client_sessions_max {
            metrics::counter!("bmq_client_connections_refused_total").increment(1);
            warn!(%remote, "client connection refused: client_sessions_max reached");
            continue;
        }
        let _ = stream.set_nodelay(true);
        let permit = match &tls {
            None => None,
            Some(_) => match handshakes.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    metrics::counter!("bmq_client_connections_refused_total").increment(1);
                    warn!(%remote, "client connection refused: too many TLS handshakes in progress");
                    continue;
                }
            },
        };
        let router = router.clone();
        let settings = settings.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            metrics::counter!("bmq_client_connections_total").increment(1);
            let stream: BoxedStream = match tls {
                None => Box::new(stream),
                Some(acceptor) => {
                    let accepted =
                        tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                    match accepted {
                        Ok(Ok(s)) => Box::new(s),
                        outcome => {
                            metrics::counter!("bmq_client_tls_failures_total").increment(1);
                            let reason = match outcome {
                                Ok(Err(e)) => e.to_string(),
                                _ => "timed out".to_string(),
                            };
                            warn!(%remote, %reason, "client TLS handshake failed; closed");
                            return;
                        }
                    }
                }
            };
            drop(permit);
            run_session(stream, remote.to_string(), router, &settings).await;
        });
    }
}

fn ok() -> Status {
    Status {
        code: StatusCode::Ok as i32,
        message: String::new(),
    }
}

fn error(code: StatusCode, message: &str) -> ClientMessage {
    ClientMessage {
        kind: Some(Kind::Error(ErrorResponse {
            status: Some(Status {
                code: code as i32,
                message: message.to_string(),
            }),
            ..Default::default()
        })),
    }
}

fn hello_response(router: &Router, settings: &SessionSettings, status: Status) -> ClientMessage {
    ClientMessage {
        kind: Some(Kind::HelloResponse(HelloResponse {
            status: Some(status),
            node_id: router.self_id().0,
            cluster_name: settings.cluster_name.clone(),
            protocol_version: PROTOCOL_VERSION,
        })),
    }
}

/// The first exchange: a `Hello` within [`HELLO_TIMEOUT`], the protocol version, the token.
/// Returns who the client is, or `None` after answering (or not) a refused client.
async fn handshake(
    sink: &mut Sink,
    stream: &mut Source,
    router: &Router,
    settings: &SessionSettings,
    remote: &str,
) -> Option<(Hello, ClientIdentity)> {
    let hello = match tokio::time::timeout(HELLO_TIMEOUT, stream.next()).await {
        Ok(Some(Ok(ClientMessage {
            kind: Some(Kind::Hello(h)),
        }))) => h,
        Ok(Some(Err(e))) => {
            metrics::counter!("bmq_client_frame_errors_total").increment(1);
            warn!(%remote, error = %e, "bad first frame from client; closing the connection");
            return None;
        }
        _ => {
            metrics::counter!("bmq_client_protocol_errors_total").increment(1);
            let why = "the first frame must be Hello";
            let message = error(StatusCode::ProtocolError, why);
            let _ = sink.out.send(&mut sink.io, &message).await;
            return None;
        }
    };
    if hello.protocol_version != PROTOCOL_VERSION {
        let status = Status {
            code: StatusCode::ProtocolError as i32,
            message: format!(
                "protocol version {} is not supported (this broker speaks {PROTOCOL_VERSION})",
                hello.protocol_version
            ),
        };
        let _ = sink
            .out
            .send(&mut sink.io, &hello_response(router, settings, status))
            .await;
        return None;
    }
    match authenticate(&settings.auth.current().client, &hello.token) {
        Ok(identity) => Some((hello, identity)),
        Err(e) => {
            metrics::counter!("bmq_client_auth_failures_total").increment(1);
            warn!(%remote, client = %hello.client_id, "client hello refused: unknown token");
            let status = Status {
                code: StatusCode::NotAuthorized as i32,
                message: e.to_string(),
            };
            let _ = sink
                .out
                .send(&mut sink.io, &hello_response(router, settings, status))
                .await;
            None
        }
    }
}

/// The route of every partition, from a committed cluster state.
fn route_in(state: &ClusterState) -> impl Fn(PartitionId) -> Option<PrimaryRoute> + '_ {
    move |p| {
        let p = state.partitions.get(&p)?;
        Some(PrimaryRoute {
            primary: p.primary?,
            lease: LeaseId(p.primary_lease_id),
            active: p.status == PrimaryStatus::Active,
        })
    }
}

async fn run_session(
    stream: BoxedStream,
    remote: String,
    router: Arc<Router>,
    settings: &SessionSettings,
) {
    let frame_size_max = settings.frame_size_max;
    let codec = FrameCodec::<ClientMessage>::new(frame_size_max);
    let (reader, writer) = tokio::io::split(stream);
    let mut stream = FramedRead::new(reader, codec);
    // One write per loop turn (the session flushes after each), or sooner past
    // `WRITE_BATCH_BYTES`.
    let mut sink = Sink {
        io: writer,
        out: FrameWriter::new(frame_size_max, WRITE_BATCH_BYTES),
    };
    let Some((hello, identity)) =
        handshake(&mut sink, &mut stream, &router, settings, &remote).await
    else {
        return;
    };
    let mut wire = ProtoWire {
        sink,
        stream,
        out: Vec::new(),
        closed: None,
    };
    wire.push(hello_response(&router, settings, ok()));
    run(wire, identity, &hello.client_id, remote, router).await;
}

/// What a [`ClientWire`] read from its client.
pub(crate) enum WireInput {
    /// One request.
    One(ClientMessage),
    /// Several requests (possibly none: the wire answered the client itself, e.g. a
    /// heartbeat), in order.
    Many(Vec<ClientMessage>),
    /// The client left or the connection failed; the session ends, for this reason.
    Closed(String),
}

/// The client-facing side of a session: one per client protocol. Ours
/// ([`ProtoWire`]: protobuf frames) and BlazingMQ's (`bmqp`, [`crate::bmqp_session`]) both
/// translate to and from [`ClientMessage`], so every session runs the same [`Session`] logic
/// (proxy, retransmission, authorisation, metrics).
pub(crate) trait ClientWire {
    /// Waits for the client's next requests. Must be cancel-safe (it races other events in a
    /// `select!`): bytes read are kept in the wire until a whole request is in.
    async fn recv(&mut self) -> WireInput;
    /// Queues one answer for the client; written by [`ClientWire::flush`].
    fn push(&mut self, message: ClientMessage);
    /// Whether anything waits to be written.
    fn has_output(&self) -> bool;
    /// Writes everything queued. Errors: the write failed (the session ends).
    async fn flush(&mut self) -> Result<(), String>;
    /// After the client disconnected and was answered: waits (bounded) for it to close the
    /// connection, for protocols whose clients expect to close it themselves.
    async fn linger(&mut self) {}
}

/// Our own client protocol: length-delimited protobuf [`ClientMessage`]s (DESIGN.md §8).
struct ProtoWire {
    sink: Sink,
    stream: Source,
    out: Vec<ClientMessage>,
    /// How the connection ended, found while taking frames already read: reported by the next
    /// [`ClientWire::recv`], after the frames before it.
    closed: Option<String>,
}

/// Most client frames one turn of a session takes (what one read of the socket brought in).
const FRAMES_PER_READ_MAX: usize = 256;

impl ProtoWire {
    /// What one frame (or the end of the stream) means for the session.
    fn input(frame: Option<Result<ClientMessage, bmq_proto::FrameError>>) -> WireInput {
        match frame {
            None => WireInput::Closed("client closed the connection".into()),
            Some(Err(e)) if bmq_client::tls::is_unclean_close(&e) => {
                WireInput::Closed("client closed the connection (without TLS close_notify)".into())
            }
            Some(Err(e)) => {
                metrics::counter!("bmq_client_frame_errors_total").increment(1);
                WireInput::Closed(format!("bad frame: {e}"))
            }
            Some(Ok(msg)) => WireInput::One(msg),
        }
    }
}

impl ClientWire for ProtoWire {
    async fn recv(&mut self) -> WireInput {
        if let Some(reason) = self.closed.take() {
            return WireInput::Closed(reason);
        }
        let first = match Self::input(self.stream.next().await) {
            WireInput::One(msg) => msg,
            other => return other,
        };
        // Every frame already read goes with it: the session forwards them as one batch.
        let mut batch = vec![first];
        while batch.len() < FRAMES_PER_READ_MAX {
            let Some(frame) = self.stream.next().now_or_never() else {
                break;
            };
            match Self::input(frame) {
                WireInput::One(msg) => batch.push(msg),
                WireInput::Closed(reason) => {
                    self.closed = Some(reason);
                    break;
                }
                WireInput::Many(_) => unreachable!("input() yields one frame"),
            }
        }
        if batch.len() == 1 {
            WireInput::One(batch.pop().expect("one"))
        } else {
            WireInput::Many(batch)
        }
    }

    fn push(&mut self, message: ClientMessage) {
        self.out.push(message);
    }

    fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    async fn flush(&mut self) -> Result<(), String> {
        let sink = &mut self.sink;
        for m in self.out.drain(..) {
            sink.out
                .feed(&mut sink.io, &m)
                .await
                .map_err(|e| format!("write to client failed: {e}"))?;
        }
        sink.out
            .flush_to(&mut sink.io)
            .await
            .map_err(|e| format!("write to client failed: {e}"))
    }
}

/// Runs one authenticated client session over `wire` until the client leaves: registers it
/// with the router, writes what the wire already holds (the handshake's answer), runs the
/// event loop, unregisters.
pub(crate) async fn run<W: ClientWire>(
    mut wire: W,
    identity: ClientIdentity,
    client_id: &str,
    remote: String,
    router: Arc<Router>,
) {
    let SessionRegistration {
        id,
        mut inbox,
        overflowed,
        settings,
        revoked,
    } = router.register_session(&identity);
    debug!(%remote, session = id, client = %client_id, "client session started");
    // A reload between this client's Hello and its registration swept the sessions without
    // it: it is held to the tokens in force now.
    if let Some(reason) = identity.revoked_by(&settings.auth.current().client) {
        revoked.revoke(reason);
    }
    if wire.flush().await.is_err() {
        router.unregister_session(id, []);
        return;
    }
    let mut session = Session {
        id,
        router: router.clone(),
        cluster: router.cluster(),
        proxy: Proxy::new(
            router.self_id(),
            ProxyConfig {
                retransmit_buffer_max: settings.retransmit_buffer_max,
                retransmit_interval: RETRANSMIT_INTERVAL,
            },
        ),
        identity,
        settings,
        out: Vec::new(),
        ack_latency: metrics::histogram!("bmq_queue_ack_latency_seconds"),
        overflowed,
        revoked,
    };
    let reason = session.event_loop(&mut wire, &mut inbox).await;
    info!(%remote, session = id, %reason, "client session ended");
    router.unregister_session(id, session.proxy.attached_primaries());
    if reason == DISCONNECTED {
        wire.linger().await;
    }
}

/// Why a session that the client ended with a Disconnect ended.
const DISCONNECTED: &str = "client disconnected";

/// One client session (see the module doc).
struct Session {
    id: u64,
    router: Arc<Router>,
    cluster: tokio::sync::watch::Receiver<Arc<ClusterState>>,
    proxy: Proxy,
    /// Who the client authenticated as at Hello; checked on every OpenQueue.
    identity: ClientIdentity,
    /// What the session reads of the configuration, given at registration.
    settings: Arc<SessionSettings>,
    /// Frames for the client, handed to the wire (and flushed once) at the end of each loop
    /// turn.
    out: Vec<ClientMessage>,
    /// `bmq_queue_ack_latency_seconds`, registered once: looking it up per ACK (a registry
    /// look-up and an allocation) showed in the brokers' CPU profile.
    ack_latency: metrics::Histogram,
    /// Cancelled by the router when this session's inbox overflowed (an event was dropped):
    /// the session ends at once, even in the middle of a write.
    overflowed: CancellationToken,
    /// Set when a reload removed or narrowed this session's token: the client is told
    /// `NOT_AUTHORIZED` with the reason and the session ends.
    revoked: Revocation,
}

impl Session {
    /// Runs until the client leaves or the connection fails; returns why.
    async fn event_loop<W: ClientWire>(
        &mut self,
        wire: &mut W,
        inbox: &mut tokio::sync::mpsc::Receiver<SessionEvent>,
    ) -> String {
        let mut retransmit = tokio::time::interval(RETRANSMIT_CHECK_PERIOD);
        let mut peer_back = self.router.subscribe_peer_back();
        loop {
            tokio::select! {
                input = wire.recv() => {
                    let disconnected = match input {
                        WireInput::Closed(reason) => return reason,
                        WireInput::One(msg) => !self.handle_client(msg),
                        WireInput::Many(msgs) => {
                            let mut disconnected = false;
                            for msg in msgs {
                                if !self.handle_client(msg) {
                                    disconnected = true;
                                    break;
                                }
                            }
                            disconnected
                        }
                    };
                    if disconnected {
                        self.execute();
                        for m in self.out.drain(..) {
                            wire.push(m);
                        }
                        let bye = Kind::DisconnectResponse(DisconnectResponse {});
                        wire.push(ClientMessage { kind: Some(bye) });
                        let _ = self.flush(wire).await;
                        return DISCONNECTED.into();
                    }
                },
                event = inbox.recv() => match event {
                    Some(event) => {
                        self.handle_event(event);
                        // Drain what else is ready so one flush carries many frames.
                        while self.out.len() + self.proxy.pending_outputs() < FRAMES_PER_FLUSH_MAX {
                            match inbox.try_recv() {
                                Ok(event) => self.handle_event(event),
                                Err(_) => break,
                            }
                        }
                    }
                    None => return "session inbox closed".into(),
                },
                changed = self.cluster.changed() => {
                    if changed.is_err() {
                        return "node stopping".into();
                    }
                    let state = self.cluster.borrow_and_update().clone();
                    self.proxy.handle_cluster_change(&route_in(&state), Instant::now());
                }
                back = peer_back.recv() => {
                    let node = match back {
                        Ok((node, generation)) => {
                            self.proxy.handle_link_generation(node, generation);
                            Some(node)
                        }
                        // Which links came back is unknown: every queue reopens, and each
                        // peer's generation is taken afresh at the next PUT.
                        Err(RecvError::Lagged(_)) => None,
                        Err(RecvError::Closed) => return "node stopping".into(),
                    };
                    let state = self.cluster.borrow().clone();
                    self.proxy.handle_peer_back(node, &route_in(&state), Instant::now());
                }
                _ = retransmit.tick() => {
                    let state = self.cluster.borrow().clone();
                    self.proxy.handle_tick(Instant::now(), &route_in(&state));
                }
                reason = self.revoked.revoked() => {
                    warn!(session = self.id, token = %self.identity.name(), %reason, "client session closed: not authorized any more");
                    self.execute();
                    for m in self.out.drain(..) {
                        wire.push(m);
                    }
                    wire.push(error(StatusCode::NotAuthorized, &reason));
                    let _ = self.flush(wire).await;
                    return format!("not authorized: {reason}");
                }
            }
            // An overflow while the session was busy (not blocked in a write, which watches
            // for it): an atomic load per turn, not a waiter registered per turn.
            if self.overflowed.is_cancelled() {
                return INBOX_OVERFLOWED.into();
            }
            self.execute();
            for m in self.out.drain(..) {
                wire.push(m);
            }
            if wire.has_output() {
                if let Err(reason) = self.flush(wire).await {
                    return reason;
                }
            }
        }
    }

    /// Writes what `wire` holds, within the request timeout: a client that reads nothing for
    /// that long is given up (`Err` with the reason; the session ends), and so is one whose
    /// inbox overflowed meanwhile.
    async fn flush<W: ClientWire>(&self, wire: &mut W) -> Result<(), String> {
        let timeout = self.settings.request_timeout;
        // `biased`: a write that completes at once is all that is polled (no timer is
        // registered, no waiter on the overflow signal); both only when the write blocks.
        let written = tokio::select! {
            biased;
            written = tokio::time::timeout(timeout, wire.flush()) => written,
            _ = self.overflowed.cancelled() => return Err(INBOX_OVERFLOWED.into()),
        };
        match written {
            Ok(result) => result,
            Err(_) => {
                metrics::counter!("bmq_client_write_timeouts_total").increment(1);
                Err(format!(
                    "the client read nothing for {timeout:?} while frames waited for it"
                ))
            }
        }
    }

    /// Executes the proxy's outputs (requests for primaries as one batch per destination) and
    /// publishes its counters. The proxy holds the PUTs that must wait for a data link's
    /// return itself, from the links' current generations.
    fn execute(&mut self) {
        let mut dispatch = Dispatch::default();
        let link_generation = |peer| self.router.data_generation(peer);
        while let Some(output) = self.proxy.poll_output(&link_generation) {
            match output {
                ProxyOutput::ToPrimary {
                    partition,
                    primary,
                    message,
                } => {
                    self.router
                        .to_primary(&mut dispatch, partition, primary, self.id, message);
                }
                ProxyOutput::ToClient(message) => self.out.push(message),
                ProxyOutput::Resolve { request_id, uri } => {
                    // Resolve the queue's partition in the background: the first open of a
                    // queue waits for the leader to commit its assignment.
                    let router = self.router.clone();
                    let session_id = self.id;
                    let timeout = self.settings.request_timeout;
                    tokio::spawn(async move {
                        let proposed = |partition| {
                            let event = SessionEvent::OpenProposed {
                                request_id,
                                uri: uri.clone(),
                                partition,
                            };
                            router.to_local_session(session_id, event);
                        };
                        let outcome = resolve_queue(&router, &uri, timeout, proposed).await;
                        let event = SessionEvent::OpenResolved {
                            request_id,
                            uri,
                            outcome,
                        };
                        router.to_local_session(session_id, event);
                    });
                }
                ProxyOutput::Acked { latency } => {
                    self.ack_latency.record(latency.as_secs_f64());
                }
            }
        }
        self.router.dispatch(&mut dispatch);
        let c = self.proxy.take_counters();
        for (name, reason, n) in [
            ("bmq_queue_nack_total", Some("not_open"), c.nacks_not_open),
            (
                "bmq_queue_nack_total",
                Some("retransmit_buffer_full"),
                c.nacks_buffer_full,
            ),
            (
                "bmq_session_put_retransmissions_total",
                None,
                c.retransmissions,
            ),
            (
                "bmq_session_open_retransmissions_total",
                None,
                c.open_retransmissions,
            ),
            (
                "bmq_client_invalid_requests_total",
                None,
                c.invalid_requests,
            ),
            ("bmq_proxy_puts_held_total", None, c.puts_held),
        ] {
            match (n, reason) {
                (0, _) => {}
                (n, Some(reason)) => metrics::counter!(name, "reason" => reason).increment(n),
                (n, None) => metrics::counter!(name).increment(n),
            }
        }
    }

    /// Handles one client frame; returns false when the client asked to disconnect.
    fn handle_client(&mut self, msg: ClientMessage) -> bool {
        match msg.kind {
            Some(Kind::OpenQueue(open)) => self.open_queue(open),
            Some(Kind::Put(put)) => self.proxy.handle_put(Instant::now(), put),
            Some(Kind::Confirm(confirm)) => self.proxy.handle_confirm(confirm),
            Some(Kind::CloseQueue(close)) => self.proxy.handle_close(close),
            Some(Kind::Disconnect(_)) => return false,
            Some(Kind::Hello(_)) => {
                metrics::counter!("bmq_client_protocol_errors_total").increment(1);
                let why = "Hello was already received";
                self.out.push(error(StatusCode::ProtocolError, why));
            }
            _ => {
                metrics::counter!("bmq_client_protocol_errors_total").increment(1);
                let why = "unexpected message from a client";
                self.out.push(error(StatusCode::ProtocolError, why));
            }
        }
        true
    }

    fn refuse_open(&mut self, open: OpenQueue, code: StatusCode, message: String) {
        self.out.push(ClientMessage {
            kind: Some(Kind::OpenQueueResponse(OpenQueueResponse {
                request_id: open.request_id,
                uri: open.uri,
                status: Some(Status {
                    code: code as i32,
                    message,
                }),
                partition_id: 0,
            })),
        });
    }

    /// Checks the URI, the domain and the client's permissions, then hands the open to the
    /// proxy.
    fn open_queue(&mut self, open: OpenQueue) {
        let parsed = match QueueUri::parse(&open.uri) {
            Ok(u) => u,
            Err(e) => return self.refuse_open(open, StatusCode::InvalidUri, e.to_string()),
        };
        if !self.settings.has_domain(&parsed.domain) {
            let why = format!("unknown domain {:?}", parsed.domain);
            return self.refuse_open(open, StatusCode::UnknownDomain, why);
        }
        let allowed = self
            .identity
            .authorize_open(&parsed.domain, open.read, open.write);
        if let Err(message) = allowed {
            metrics::counter!("bmq_client_unauthorized_total").increment(1);
            info!(session = self.id, token = %self.identity.name(), uri = %open.uri, read = open.read, write = open.write, "open queue refused: not authorized");
            return self.refuse_open(open, StatusCode::NotAuthorized, message);
        }
        self.proxy.handle_open(Instant::now(), open);
    }

    fn handle_event(&mut self, event: SessionEvent) {
        match event {
            SessionEvent::FromPrimary(messages) => {
                let now = Instant::now();
                for msg in messages {
                    self.proxy.handle_from_primary(now, msg);
                }
            }
            SessionEvent::OpenProposed {
                request_id,
                uri,
                partition,
            } => {
                let state = self.cluster.borrow().clone();
                self.proxy.handle_proposed(
                    request_id,
                    &uri,
                    partition,
                    &route_in(&state),
                    Instant::now(),
                );
            }
            SessionEvent::OpenResolved {
                request_id,
                uri,
                outcome,
            } => {
                let state = self.cluster.borrow().clone();
                self.proxy.handle_resolved(
                    request_id,
                    uri,
                    outcome,
                    &route_in(&state),
                    Instant::now(),
                );
            }
        }
    }
}

/// Waits until `uri` is assigned to a partition in the committed state, having asked the
/// leader once to assign it, until `timeout`. The metadata core keeps the request and sends
/// it again (to each new leader, and while it is not committed), so the open does not ask
/// again. Woken by the commit that assigns it ([`Router::watch_assignment`]), not by polling.
/// Calls `proposed` once with the partition the leader proposes, if this node's ledger takes
/// the proposal in while it waits ([`Router::watch_proposal`]): the open can go there before
/// the commit.
async fn resolve_queue(
    router: &Router,
    uri: &str,
    timeout: Duration,
    proposed: impl FnOnce(PartitionId),
) -> Result<PartitionId, Status> {
    let deadline = tokio::time::Instant::now() + timeout;
    let cluster = router.cluster();
    let mut asked = false;
    let mut proposed = Some(proposed);
    let mut proposal = None;
    let outcome = loop {
        // Registered before the look-up, so the commit cannot fall in between.
        let committed = router.watch_assignment(uri);
        if let Some(q) = cluster.borrow().queues.get(uri) {
            break Ok(q.partition);
        }
        if proposed.is_some() && proposal.is_none() {
            proposal = Some(router.watch_proposal(uri));
        }
        if tokio::time::Instant::now() >= deadline {
            break Err(Status {
                code: StatusCode::NotReady as i32,
                message: format!(
                    "queue {uri} could not be assigned within {timeout:?}: no active leader?"
                ),
            });
        }
        if !asked {
            asked = true;
            router.request_assignment(uri.to_string());
        }
        let proposed_in = async {
            match proposal.as_mut() {
                Some(rx) => rx.await.ok(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::time::timeout_at(deadline, committed) => {}
            got = proposed_in => {
                // Fired, or dropped unfired (registered again at the next turn).
                proposal = None;
                if let Some(partition) = got {
                    if let Some(tell) = proposed.take() {
                        tell(partition);
                    }
                }
            }
        }
    };
    drop(proposal);
    router.forget_assignment_waiters(uri);
    outcome
}
