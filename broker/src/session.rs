//! Client sessions: one task per client connection, on whichever node the client chose.
//!
//! A session speaks the client protocol (DESIGN.md §8): `Hello` first, then OpenQueue, Put,
//! Confirm, CloseQueue, Disconnect. It acts as the *proxy* of DESIGN.md §7: for each open queue
//! it knows the partition and the partition's current primary (from the committed cluster
//! state) and routes requests there through the [`DataPlane`]. Answers and deliveries come back
//! in its inbox.
//!
//! Failover: the session keeps every PUT that is not yet ACKed in a bounded retransmission
//! buffer. When the committed state names a new primary for one of its partitions, it reopens
//! its queues there and resends the buffered PUTs (the primary drops duplicate GUIDs); PUTs
//! that got no answer within the retransmission interval are resent too. An ACK with
//! `NOT_READY` from a node that is not (yet) primary keeps the PUT buffered.
//!
//! Bad input: a frame that is oversized or does not decode closes this connection only, with
//! a logged reason and `bmq_client_frame_errors_total`; a malformed URI or unknown domain is
//! answered with a status naming the problem.
//!
//! Security (issue 10): with `[tls] client_listener`, the connection is TLS from the first byte
//! (a failed handshake is logged with the remote address and counted in
//! `bmq_client_tls_failures_total`). `Hello.token` is checked against `[[auth.tokens]]`
//! ([`crate::auth`]): an unknown token is answered `NOT_AUTHORIZED` and the connection closed
//! (`bmq_client_auth_failures_total`); each OpenQueue needs `produce` (write) and `consume`
//! (read) on the queue's domain, else `NOT_AUTHORIZED` naming the missing permission
//! (`bmq_client_unauthorized_total`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bmq_metadata::{ClusterState, PrimaryStatus};
use bmq_proto::client::{
    client_message::Kind, Ack, AckStatus, ClientMessage, CloseQueueResponse, DisconnectResponse,
    ErrorResponse, HelloResponse, OpenQueue, OpenQueueResponse, Put, Status, StatusCode,
};
use bmq_proto::{FrameCodec, NodeId, PartitionId, PROTOCOL_VERSION};
use futures::{SinkExt, StreamExt};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::auth::ClientIdentity;
use crate::dataplane::{DataPlane, SessionEvent};
use crate::tls::BoxedStream;
use crate::uri::QueueUri;

/// A session's inbox capacity, messages.
const SESSION_INBOX_CAPACITY: usize = 65_536;
/// A buffered PUT with no answer for this long is sent again.
const RETRANSMIT_INTERVAL: Duration = Duration::from_millis(1_000);
/// How often the session looks for PUTs to retransmit.
const RETRANSMIT_CHECK_PERIOD: Duration = Duration::from_millis(250);

/// How long a client's TLS handshake may take.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most client connections in their TLS handshake at once; beyond that new connections are
/// closed at once and counted in `bmq_client_connections_refused_total`.
const TLS_HANDSHAKES_MAX: usize = 256;

/// Accepts client connections on `listener` until the process ends; with `tls`, each
/// connection is TLS (handshake in the connection's own task, bounded by
/// `TLS_HANDSHAKE_TIMEOUT`, 10 s).
pub async fn serve_clients(
    listener: TcpListener,
    router: Arc<DataPlane>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let handshakes = Arc::new(tokio::sync::Semaphore::new(TLS_HANDSHAKES_MAX));
    loop {
        match listener.accept().await {
            Ok((stream, remote)) => {
                if router.session_count() >= router.config.limits.client_sessions_max as usize {
                    metrics::counter!("bmq_client_connections_refused_total").increment(1);
                    warn!(%remote, "client connection refused: client_sessions_max reached");
                    continue;
                }
                let _ = stream.set_nodelay(true);
                let router = router.clone();
                let tls = tls.clone();
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
                tokio::spawn(async move {
                    metrics::counter!("bmq_client_connections_total").increment(1);
                    let stream: BoxedStream = match tls {
                        None => Box::new(stream),
                        Some(acceptor) => {
                            match tokio::time::timeout(
                                TLS_HANDSHAKE_TIMEOUT,
                                acceptor.accept(stream),
                            )
                            .await
                            {
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
                    run_session(stream, remote.to_string(), router).await;
                });
            }
            Err(e) => {
                warn!(error = %e, "client listener accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Where an open queue is served from.
#[derive(Debug, Clone)]
struct OpenQueueState {
    request: OpenQueue,
    partition: PartitionId,
    /// The primary and lease the queue was last opened on.
    attached: Option<(NodeId, u64)>,
    /// A PUT of this queue was refused with NOT_READY: later PUTs wait in the buffer until
    /// the next reattach resends them all in arrival order (so a producer's order holds).
    blocked: bool,
}

struct PendingPut {
    put: Put,
    partition: PartitionId,
    sent_at: Option<Instant>,
    /// When the client's PUT arrived: the ACK latency is measured from here.
    received_at: Instant,
}

/// The retransmission buffer: unacknowledged PUTs in arrival order, found by GUID. Resends walk
/// it in arrival order so a producer's messages reach a new primary in the order it sent them.
#[derive(Default)]
struct RetransmitBuffer {
    by_arrival: std::collections::BTreeMap<u64, PendingPut>,
    arrival_of: HashMap<bytes::Bytes, u64>,
    next_arrival: u64,
}

impl RetransmitBuffer {
    fn len(&self) -> usize {
        self.by_arrival.len()
    }

    fn insert(&mut self, pending: PendingPut) {
        if let Some(old) = self.arrival_of.remove(&pending.put.guid) {
            self.by_arrival.remove(&old);
        }
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        self.arrival_of.insert(pending.put.guid.clone(), arrival);
        self.by_arrival.insert(arrival, pending);
    }

    fn get_mut(&mut self, guid: &[u8]) -> Option<&mut PendingPut> {
        let arrival = self.arrival_of.get(guid)?;
        self.by_arrival.get_mut(arrival)
    }

    fn remove(&mut self, guid: &[u8]) -> Option<PendingPut> {
        let arrival = self.arrival_of.remove(guid)?;
        self.by_arrival.remove(&arrival)
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut PendingPut> {
        self.by_arrival.values_mut()
    }
}

struct Session {
    id: u64,
    router: Arc<DataPlane>,
    cluster: watch::Receiver<Arc<ClusterState>>,
    queues: HashMap<String, OpenQueueState>,
    /// Client request ids of opens forwarded to a primary, by uri.
    pending_opens: HashMap<String, u64>,
    pending_puts: RetransmitBuffer,
    out: Vec<ClientMessage>,
    /// Who the client authenticated as at Hello; checked on every OpenQueue.
    identity: ClientIdentity,
}

async fn run_session(stream: BoxedStream, remote: String, router: Arc<DataPlane>) {
    let framed = tokio_util::codec::Framed::new(
        stream,
        FrameCodec::<ClientMessage>::new(router.config.limits.frame_size_max_bytes as usize),
    );
    let (mut sink, mut stream) = framed.split();

    // Hello first, within a bounded time.
    let hello = match tokio::time::timeout(Duration::from_secs(10), stream.next()).await {
        Ok(Some(Ok(ClientMessage {
            kind: Some(Kind::Hello(h)),
        }))) => h,
        Ok(Some(Err(e))) => {
            metrics::counter!("bmq_client_frame_errors_total").increment(1);
            warn!(%remote, error = %e, "bad first frame from client; closing the connection");
            return;
        }
        _ => {
            metrics::counter!("bmq_client_protocol_errors_total").increment(1);
            let _ = sink
                .send(error(
                    StatusCode::ProtocolError,
                    "the first frame must be Hello",
                ))
                .await;
            return;
        }
    };
    if hello.protocol_version != PROTOCOL_VERSION {
        let _ = sink
            .send(ClientMessage {
                kind: Some(Kind::HelloResponse(HelloResponse {
                    status: Some(Status {
                        code: StatusCode::ProtocolError as i32,
                        message: format!(
                            "protocol version {} is not supported (this broker speaks {PROTOCOL_VERSION})",
                            hello.protocol_version
                        ),
                    }),
                    node_id: router.self_id.0,
                    cluster_name: router.config.cluster_name.clone(),
                    protocol_version: PROTOCOL_VERSION,
                })),
            })
            .await;
        return;
    }
    let identity = match router.config.auth.authenticate(&hello.token) {
        Ok(identity) => identity,
        Err(e) => {
            metrics::counter!("bmq_client_auth_failures_total").increment(1);
            warn!(%remote, client = %hello.client_id, "client hello refused: unknown token");
            let _ = sink
                .send(ClientMessage {
                    kind: Some(Kind::HelloResponse(HelloResponse {
                        status: Some(Status {
                            code: StatusCode::NotAuthorized as i32,
                            message: e.to_string(),
                        }),
                        node_id: router.self_id.0,
                        cluster_name: router.config.cluster_name.clone(),
                        protocol_version: PROTOCOL_VERSION,
                    })),
                })
                .await;
            return;
        }
    };
    let (id, mut inbox) = router.register_session(SESSION_INBOX_CAPACITY);
    debug!(%remote, session = id, client = %hello.client_id, "client session started");
    if sink
        .send(ClientMessage {
            kind: Some(Kind::HelloResponse(HelloResponse {
                status: Some(ok()),
                node_id: router.self_id.0,
                cluster_name: router.config.cluster_name.clone(),
                protocol_version: PROTOCOL_VERSION,
            })),
        })
        .await
        .is_err()
    {
        router.unregister_session(id, []);
        return;
    }

    let mut session = Session {
        id,
        cluster: router.cluster.clone(),
        router: router.clone(),
        queues: HashMap::new(),
        pending_opens: HashMap::new(),
        pending_puts: RetransmitBuffer::default(),
        out: Vec::new(),
        identity,
    };
    let mut retransmit = tokio::time::interval(RETRANSMIT_CHECK_PERIOD);
    let mut peer_back = router.subscribe_peer_back();
    let reason: String = loop {
        tokio::select! {
            frame = stream.next() => match frame {
                None => break "client closed the connection".into(),
                Some(Err(e)) if crate::tls::is_unclean_close(&e) => {
                    break "client closed the connection (without TLS close_notify)".into()
                }
                Some(Err(e)) => {
                    metrics::counter!("bmq_client_frame_errors_total").increment(1);
                    break format!("bad frame: {e}");
                }
                Some(Ok(msg)) => {
                    if !session.handle_client(msg) {
                        let _ = sink.send(ClientMessage {
                            kind: Some(Kind::DisconnectResponse(DisconnectResponse {})),
                        }).await;
                        break "client disconnected".into();
                    }
                }
            },
            event = inbox.recv() => match event {
                Some(event) => {
                    session.handle_event(event);
                    // Drain what else is ready so one flush carries many frames.
                    while session.out.len() < 1024 {
                        match inbox.try_recv() {
                            Ok(event) => session.handle_event(event),
                            Err(_) => break,
                        }
                    }
                }
                None => break "session inbox closed".into(),
            },
            changed = session.cluster.changed() => {
                if changed.is_err() { break "node stopping".into(); }
                session.handle_cluster_change();
            }
            back = peer_back.recv() => match back {
                Ok(node) => session.handle_peer_back(Some(node)),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => session.handle_peer_back(None),
                Err(tokio::sync::broadcast::error::RecvError::Closed) => break "node stopping".into(),
            },
            _ = retransmit.tick() => session.retransmit(),
        }
        if !session.out.is_empty() {
            let mut failed = false;
            for m in session.out.drain(..) {
                if sink.feed(m).await.is_err() {
                    failed = true;
                    break;
                }
            }
            if failed || sink.flush().await.is_err() {
                break "write to client failed".into();
            }
        }
    };
    info!(%remote, session = id, %reason, "client session ended");
    let primaries: Vec<NodeId> = session
        .queues
        .values()
        .filter_map(|q| q.attached.map(|(n, _)| n))
        .collect();
    router.unregister_session(id, primaries);
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
        })),
    }
}

impl Session {
    /// Handles one client frame; returns false when the client asked to disconnect.
    fn handle_client(&mut self, msg: ClientMessage) -> bool {
        match msg.kind {
            Some(Kind::OpenQueue(open)) => self.open_queue(open),
            Some(Kind::Put(put)) => self.put(put),
            Some(Kind::Confirm(confirm)) => {
                if let Some(q) = self.queues.get(&confirm.uri) {
                    if let Some((primary, _)) = q.attached {
                        let partition = q.partition;
                        self.router.to_primary(
                            partition,
                            primary,
                            self.id,
                            ClientMessage {
                                kind: Some(Kind::Confirm(confirm)),
                            },
                        );
                    }
                } else {
                    metrics::counter!("bmq_client_invalid_requests_total").increment(1);
                }
            }
            Some(Kind::CloseQueue(close)) => {
                if let Some(q) = self.queues.remove(&close.uri) {
                    if let Some((primary, _)) = q.attached {
                        self.router.to_primary(
                            q.partition,
                            primary,
                            self.id,
                            ClientMessage {
                                kind: Some(Kind::CloseQueue(close.clone())),
                            },
                        );
                    }
                }
                self.out.push(ClientMessage {
                    kind: Some(Kind::CloseQueueResponse(CloseQueueResponse {
                        request_id: close.request_id,
                        uri: close.uri,
                        status: Some(ok()),
                    })),
                });
            }
            Some(Kind::Disconnect(_)) => return false,
            Some(Kind::Hello(_)) => {
                metrics::counter!("bmq_client_protocol_errors_total").increment(1);
                self.out.push(error(
                    StatusCode::ProtocolError,
                    "Hello was already received",
                ));
            }
            _ => {
                metrics::counter!("bmq_client_protocol_errors_total").increment(1);
                self.out.push(error(
                    StatusCode::ProtocolError,
                    "unexpected message from a client",
                ));
            }
        }
        true
    }

    fn open_response(&mut self, request_id: u64, uri: String, status: Status, partition: u32) {
        self.out.push(ClientMessage {
            kind: Some(Kind::OpenQueueResponse(OpenQueueResponse {
                request_id,
                uri,
                status: Some(status),
                partition_id: partition,
            })),
        });
    }

    fn open_queue(&mut self, open: OpenQueue) {
        let parsed = match QueueUri::parse(&open.uri) {
            Ok(u) => u,
            Err(e) => {
                let status = Status {
                    code: StatusCode::InvalidUri as i32,
                    message: e.to_string(),
                };
                self.open_response(open.request_id, open.uri, status, 0);
                return;
            }
        };
        if self.router.config.domain(&parsed.domain).is_none() {
            let status = Status {
                code: StatusCode::UnknownDomain as i32,
                message: format!("unknown domain {:?}", parsed.domain),
            };
            self.open_response(open.request_id, open.uri, status, 0);
            return;
        }
        if let Err(message) = self
            .identity
            .authorize_open(&parsed.domain, open.read, open.write)
        {
            metrics::counter!("bmq_client_unauthorized_total").increment(1);
            info!(session = self.id, token = %self.identity.name(), uri = %open.uri, read = open.read, write = open.write, "open queue refused: not authorized");
            let status = Status {
                code: StatusCode::NotAuthorized as i32,
                message,
            };
            self.open_response(open.request_id, open.uri, status, 0);
            return;
        }
        // Resolve the queue's partition and primary in the background: the first open of a
        // queue waits for the leader to commit its assignment.
        let router = self.router.clone();
        let session_id = self.id;
        let uri = open.uri.clone();
        let request_id = open.request_id;
        self.queues.remove(&open.uri);
        self.queues.insert(
            open.uri.clone(),
            OpenQueueState {
                request: open,
                partition: PartitionId(u32::MAX),
                attached: None,
                blocked: false,
            },
        );
        tokio::spawn(async move {
            let outcome = resolve_queue(&router, &uri).await;
            router.to_local_session(
                session_id,
                SessionEvent::OpenResolved {
                    request_id,
                    uri,
                    outcome,
                },
            );
        });
    }

    fn put(&mut self, put: Put) {
        let Some(q) = self.queues.get(&put.uri) else {
            metrics::counter!("bmq_queue_nack_total", "reason" => "not_open").increment(1);
            self.out.push(ClientMessage {
                kind: Some(Kind::Ack(Ack {
                    uri: put.uri,
                    guid: put.guid,
                    status: AckStatus::UnknownQueue as i32,
                    message: "the queue is not open in this session".into(),
                })),
            });
            return;
        };
        if !q.request.write {
            self.out.push(ClientMessage {
                kind: Some(Kind::Ack(Ack {
                    uri: put.uri,
                    guid: put.guid,
                    status: AckStatus::Refused as i32,
                    message: "the queue is not open for writing".into(),
                })),
            });
            return;
        }
        if put.guid.len() != 16 {
            self.out.push(ClientMessage {
                kind: Some(Kind::Ack(Ack {
                    uri: put.uri,
                    guid: put.guid,
                    status: AckStatus::Invalid as i32,
                    message: "a message guid must be 16 bytes".into(),
                })),
            });
            return;
        }
        if self.pending_puts.len() as u64 >= self.router.config.limits.retransmit_buffer_max {
            metrics::counter!("bmq_queue_nack_total", "reason" => "retransmit_buffer_full")
                .increment(1);
            self.out.push(ClientMessage {
                kind: Some(Kind::Ack(Ack {
                    uri: put.uri,
                    guid: put.guid,
                    status: AckStatus::LimitReached as i32,
                    message: "too many unacknowledged messages in this session".into(),
                })),
            });
            return;
        }
        let partition = q.partition;
        let attached = if q.blocked { None } else { q.attached };
        let mut pending = PendingPut {
            put,
            partition,
            sent_at: None,
            received_at: Instant::now(),
        };
        if let Some((primary, _)) = attached {
            pending.sent_at = Some(Instant::now());
            self.router.to_primary(
                partition,
                primary,
                self.id,
                ClientMessage {
                    kind: Some(Kind::Put(pending.put.clone())),
                },
            );
        }
        self.pending_puts.insert(pending);
    }

    fn handle_event(&mut self, event: SessionEvent) {
        match event {
            SessionEvent::FromPrimary(msg) => match msg.kind {
                Some(Kind::Ack(ack)) => {
                    if ack.status == AckStatus::NotReady as i32 {
                        // Not (or no longer, or not yet) the primary: keep the PUT, and hold
                        // the queue's later PUTs back, for an in-order resend.
                        if let Some(p) = self.pending_puts.get_mut(&ack.guid) {
                            p.sent_at = None;
                        }
                        if let Some(q) = self.queues.get_mut(&ack.uri) {
                            q.blocked = true;
                        }
                        return;
                    }
                    if let Some(pending) = self.pending_puts.remove(&ack.guid) {
                        if ack.status == AckStatus::Success as i32 {
                            metrics::histogram!("bmq_queue_ack_latency_seconds")
                                .record(pending.received_at.elapsed().as_secs_f64());
                        }
                        self.out.push(ClientMessage {
                            kind: Some(Kind::Ack(ack)),
                        });
                    }
                }
                Some(Kind::Push(push)) => {
                    if self.queues.get(&push.uri).is_some_and(|q| q.request.read) {
                        self.out.push(ClientMessage {
                            kind: Some(Kind::Push(push)),
                        });
                    }
                }
                Some(Kind::OpenQueueResponse(resp)) => {
                    let code = resp.status.as_ref().map(|s| s.code).unwrap_or(0);
                    if let Some(request_id) = self.pending_opens.remove(&resp.uri) {
                        if code != StatusCode::Ok as i32 {
                            self.queues.remove(&resp.uri);
                        }
                        self.out.push(ClientMessage {
                            kind: Some(Kind::OpenQueueResponse(OpenQueueResponse {
                                request_id,
                                ..resp
                            })),
                        });
                    } else if code != StatusCode::Ok as i32 {
                        // An internal reopen failed (the primary is not ready yet): try again
                        // at the next state change or retransmission tick.
                        if let Some(q) = self.queues.get_mut(&resp.uri) {
                            q.attached = None;
                        }
                    }
                }
                _ => {}
            },
            SessionEvent::OpenResolved {
                request_id,
                uri,
                outcome,
            } => {
                let Some(q) = self.queues.get_mut(&uri) else {
                    return;
                };
                if q.request.request_id != request_id {
                    return;
                }
                match outcome {
                    Ok(partition) => {
                        q.partition = partition;
                        self.pending_opens.insert(uri.clone(), request_id);
                        self.attach(&uri);
                    }
                    Err(status) => {
                        self.queues.remove(&uri);
                        self.open_response(request_id, uri, status, 0);
                    }
                }
            }
        }
    }

    /// Opens `uri` on its partition's current primary (if any) and resends its buffered PUTs.
    fn attach(&mut self, uri: &str) {
        let state = self.cluster.borrow().clone();
        let Some(q) = self.queues.get_mut(uri) else {
            return;
        };
        let Some(p) = state.partitions.get(&q.partition) else {
            return;
        };
        // Only an ACTIVE (healed) primary serves; a passive one would refuse with NOT_READY.
        let (Some(primary), PrimaryStatus::Active) = (p.primary, p.status) else {
            q.attached = None;
            return;
        };
        q.attached = Some((primary, p.primary_lease_id));
        q.blocked = false;
        let partition = q.partition;
        self.router.to_primary(
            partition,
            primary,
            self.id,
            ClientMessage {
                kind: Some(Kind::OpenQueue(q.request.clone())),
            },
        );
        let now = Instant::now();
        for pending in self.pending_puts.values_mut().filter(|p| p.put.uri == uri) {
            pending.sent_at = Some(now);
            self.router.to_primary(
                partition,
                primary,
                self.id,
                ClientMessage {
                    kind: Some(Kind::Put(pending.put.clone())),
                },
            );
        }
    }

    /// The committed state changed: reattach every queue whose primary or lease moved.
    fn handle_cluster_change(&mut self) {
        let state = self.cluster.borrow_and_update().clone();
        let moved: Vec<String> = self
            .queues
            .iter()
            .filter(|(_, q)| q.partition.0 != u32::MAX)
            .filter(|(_, q)| {
                let now = state
                    .partitions
                    .get(&q.partition)
                    .and_then(|p| p.primary.map(|n| (n, p.primary_lease_id)));
                now != q.attached
            })
            .map(|(uri, _)| uri.clone())
            .collect();
        for uri in moved {
            info!(session = self.id, %uri, "queue's primary changed: reopening on the new primary");
            self.attach(&uri);
        }
    }

    /// A peer link came back (`None`: some did, which is unknown). A primary on the other end
    /// released this session's consumers when the link dropped, and requests sent meanwhile
    /// were lost: reopen every queue attached there and resend its buffered PUTs.
    fn handle_peer_back(&mut self, node: Option<NodeId>) {
        let self_id = self.router.self_id;
        let affected: Vec<String> = self
            .queues
            .iter()
            .filter(|(_, q)| {
                q.attached.is_some_and(|(primary, _)| {
                    primary != self_id && node.is_none_or(|n| n == primary)
                })
            })
            .map(|(uri, _)| uri.clone())
            .collect();
        for uri in affected {
            info!(session = self.id, %uri, "link to the primary came back: reopening");
            self.attach(&uri);
        }
    }

    /// Resends PUTs without an answer for `RETRANSMIT_INTERVAL`, and reattaches queues whose
    /// last open was refused.
    fn retransmit(&mut self) {
        let unattached: Vec<String> = self
            .queues
            .iter()
            .filter(|(_, q)| q.partition.0 != u32::MAX && (q.attached.is_none() || q.blocked))
            .map(|(uri, _)| uri.clone())
            .collect();
        for uri in unattached {
            self.attach(&uri);
        }
        let now = Instant::now();
        for pending in self.pending_puts.values_mut() {
            if pending
                .sent_at
                .is_some_and(|t| now.duration_since(t) < RETRANSMIT_INTERVAL)
            {
                continue;
            }
            let Some((primary, _)) = self.queues.get(&pending.put.uri).and_then(|q| q.attached)
            else {
                continue;
            };
            pending.sent_at = Some(now);
            metrics::counter!("bmq_session_put_retransmissions_total").increment(1);
            self.router.to_primary(
                pending.partition,
                primary,
                self.id,
                ClientMessage {
                    kind: Some(Kind::Put(pending.put.clone())),
                },
            );
        }
    }
}

/// Waits until `uri` is assigned to a partition in the committed state, asking the leader to
/// assign it (again every 500 ms) until the request timeout.
async fn resolve_queue(router: &DataPlane, uri: &str) -> Result<PartitionId, Status> {
    let timeout = Duration::from_millis(router.config.limits.request_timeout_ms);
    let deadline = tokio::time::Instant::now() + timeout;
    let mut cluster = router.cluster.clone();
    let mut asked_at: Option<tokio::time::Instant> = None;
    loop {
        if let Some(q) = cluster.borrow_and_update().queues.get(uri) {
            return Ok(q.partition);
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(Status {
                code: StatusCode::NotReady as i32,
                message: format!(
                    "queue {uri} could not be assigned within {timeout:?}: no active leader?"
                ),
            });
        }
        if asked_at.is_none_or(|t| now.duration_since(t) >= Duration::from_millis(500)) {
            asked_at = Some(now);
            (router.request_assignment)(uri.to_string());
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), cluster.changed()).await;
    }
}
