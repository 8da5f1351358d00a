//! The data plane's router: where client traffic goes between sessions and partition primaries.
//!
//! A client may attach to any node (its *proxy*). The proxy's session sends OPEN/PUT/CONFIRM/
//! CLOSE to the primary of the queue's partition — to the local [`PartitionActor`] when this
//! node is that primary, otherwise as a `ForwardedClientMessage` over the peer DATA channel. The
//! primary answers (OpenQueueResponse, ACK, PUSH) to the `(origin node, session id)` that
//! asked, by the same two routes in reverse (DESIGN.md §7, "Proxying").
//!
//! The router also keeps this node's partition actors in step with the committed cluster state:
//! every partition has an actor on every node (primary or replica, each with its journal), told
//! the committed primary and `primary_lease_id` on every commit; a node that is no longer a
//! partition's primary steps down to replica, it does not exit. Replication traffic
//! (`PartitionMessage` on the DATA channel) goes to the partition's actor.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use actix::{Actor, Addr};
use bmq_metadata::ClusterState;
use bmq_proto::client::{
    client_message::Kind as ClientKind, Ack, AckStatus, ClientMessage, OpenQueueResponse, Status,
    StatusCode,
};
use bmq_proto::peer::{
    peer_message::Kind as PeerKind, Channel, ForwardedClientMessage, PeerMessage,
};
use bmq_proto::{NodeId, PartitionId};
use tokio::sync::{mpsc, watch};
use tracing::{debug, error};

use crate::config::BrokerConfig;
use crate::health::PrimaryActive;
use crate::partition::{
    PartitionActor, PartitionNodeGone, PartitionPeerMessage, PartitionRequest,
    PartitionRoleChanged, PartitionSessionGone,
};
use crate::peers::PeerHub;
use crate::queue::ConsumerKey;

/// What a session's inbox receives from the rest of the node.
#[derive(Debug)]
pub enum SessionEvent {
    /// A response or delivery from a primary (OpenQueueResponse, Ack, Push, CloseQueueResponse).
    FromPrimary(ClientMessage),
    /// A queue the session asked to open now has a partition with a primary (or not, on timeout).
    OpenResolved {
        /// The client's request id.
        request_id: u64,
        /// The queue.
        uri: String,
        /// The partition, or the status to answer the client with.
        outcome: Result<PartitionId, Status>,
    },
}

/// The router shared by sessions, partition actors and the peer inbound path.
pub struct DataPlane {
    /// This node.
    pub self_id: NodeId,
    /// The node configuration.
    pub config: Arc<BrokerConfig>,
    /// The peer links.
    pub peers: Arc<PeerHub>,
    /// The latest committed cluster state.
    pub cluster: watch::Receiver<Arc<ClusterState>>,
    sessions: dashmap::DashMap<u64, mpsc::Sender<SessionEvent>>,
    partitions: Mutex<HashMap<PartitionId, Addr<PartitionActor>>>,
    next_session_id: AtomicU64,
    /// "A peer link came back" notifications for sessions.
    peer_back: tokio::sync::broadcast::Sender<NodeId>,
    /// Where `PrimaryActiveNotice`s go on this node (the health actor); set once at start.
    pub primary_active_sink: std::sync::OnceLock<actix::Recipient<PrimaryActive>>,
    /// Asks the metadata actor to have the leader assign a queue (fire and forget; the caller
    /// waits for the assignment to appear in the committed state and asks again if not).
    pub request_assignment: Box<dyn Fn(String) + Send + Sync>,
}

impl DataPlane {
    /// A router for this node. Partition actors are started by [`DataPlane::sync_partitions`].
    pub fn new(
        config: Arc<BrokerConfig>,
        peers: Arc<PeerHub>,
        cluster: watch::Receiver<Arc<ClusterState>>,
        request_assignment: Box<dyn Fn(String) + Send + Sync>,
    ) -> Arc<DataPlane> {
        Arc::new(DataPlane {
            self_id: NodeId(config.node_id),
            config,
            peers,
            cluster,
            sessions: dashmap::DashMap::new(),
            partitions: Mutex::new(HashMap::new()),
            next_session_id: AtomicU64::new(1),
            peer_back: tokio::sync::broadcast::channel(64).0,
            primary_active_sink: std::sync::OnceLock::new(),
            request_assignment,
        })
    }

    /// Registers a new local session and returns its id and inbox.
    pub fn register_session(&self, inbox_capacity: usize) -> (u64, mpsc::Receiver<SessionEvent>) {
        let id = self.next_session_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(inbox_capacity);
        self.sessions.insert(id, tx);
        metrics::gauge!("bmq_client_sessions").set(self.sessions.len() as f64);
        (id, rx)
    }

    /// Removes a local session and tells every primary to release its consumers.
    pub fn unregister_session(&self, session_id: u64, primaries: impl IntoIterator<Item = NodeId>) {
        self.sessions.remove(&session_id);
        metrics::gauge!("bmq_client_sessions").set(self.sessions.len() as f64);
        let key = ConsumerKey {
            origin_node: self.self_id,
            session_id,
        };
        let mut told = std::collections::BTreeSet::new();
        for primary in primaries {
            if !told.insert(primary) {
                continue;
            }
            if primary == self.self_id {
                for addr in self.partitions.lock().expect("partitions lock").values() {
                    let _ = addr.try_send(PartitionSessionGone { key });
                }
            } else {
                let msg = PeerMessage {
                    kind: Some(PeerKind::SessionGone(bmq_proto::peer::SessionGone {
                        origin_node_id: self.self_id.0,
                        session_id,
                    })),
                };
                self.peers.send(primary, Channel::Data, msg);
            }
        }
    }

    /// Number of local client sessions.
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Delivers `message` to a local session's inbox. Returns false when the session is gone or
    /// its inbox is full (the message is dropped and counted; PUTs are retransmitted and
    /// unconfirmed PUSHes redelivered, so nothing acknowledged is lost).
    pub fn to_local_session(&self, session_id: u64, event: SessionEvent) -> bool {
        let Some(tx) = self.sessions.get(&session_id).map(|s| s.clone()) else {
            return false;
        };
        if tx.try_send(event).is_err() {
            metrics::counter!("bmq_session_inbox_dropped_total").increment(1);
            return false;
        }
        true
    }

    /// Sends a primary's answer or delivery to the session identified by `key`, wherever it is.
    pub fn to_session(&self, key: ConsumerKey, message: ClientMessage) -> bool {
        if key.origin_node == self.self_id {
            self.to_local_session(key.session_id, SessionEvent::FromPrimary(message))
        } else {
            self.peers
                .send(key.origin_node, Channel::Data, forwarded(key, message))
        }
    }

    /// Sends a session's request to the primary `primary` of `partition`.
    pub fn to_primary(
        &self,
        partition: PartitionId,
        primary: NodeId,
        session_id: u64,
        message: ClientMessage,
    ) -> bool {
        let key = ConsumerKey {
            origin_node: self.self_id,
            session_id,
        };
        if primary == self.self_id {
            self.to_local_partition(partition, key, message)
        } else {
            self.peers
                .send(primary, Channel::Data, forwarded(key, message))
        }
    }

    fn to_local_partition(
        &self,
        partition: PartitionId,
        key: ConsumerKey,
        message: ClientMessage,
    ) -> bool {
        let addr = self
            .partitions
            .lock()
            .expect("partitions lock")
            .get(&partition)
            .cloned();
        match addr {
            Some(addr) => {
                if addr
                    .try_send(PartitionRequest {
                        key,
                        message: message.clone(),
                    })
                    .is_ok()
                {
                    return true;
                }
                metrics::counter!("bmq_partition_overloaded_total").increment(1);
                self.refuse(
                    key,
                    &message,
                    StatusCode::Overloaded,
                    "partition overloaded",
                );
                false
            }
            None => {
                self.refuse(
                    key,
                    &message,
                    StatusCode::NotReady,
                    "this node does not know this partition yet",
                );
                false
            }
        }
    }

    /// Answers a request that cannot be served here so the proxy retries elsewhere or later.
    fn refuse(&self, key: ConsumerKey, message: &ClientMessage, code: StatusCode, reason: &str) {
        let answer = match &message.kind {
            Some(ClientKind::OpenQueue(o)) => ClientKind::OpenQueueResponse(OpenQueueResponse {
                request_id: o.request_id,
                uri: o.uri.clone(),
                status: Some(Status {
                    code: code as i32,
                    message: reason.to_string(),
                }),
                partition_id: 0,
            }),
            Some(ClientKind::Put(p)) => ClientKind::Ack(Ack {
                uri: p.uri.clone(),
                guid: p.guid.clone(),
                status: if code == StatusCode::Overloaded {
                    AckStatus::LimitReached as i32
                } else {
                    AckStatus::NotReady as i32
                },
                message: reason.to_string(),
            }),
            _ => return,
        };
        self.to_session(key, ClientMessage { kind: Some(answer) });
    }

    /// Tells every node (the leader acts on it) that this node healed `partition` at `lease`.
    pub fn announce_primary_active(&self, partition: PartitionId, lease: u64) {
        for peer in self.config.peers() {
            let msg = PeerMessage {
                kind: Some(PeerKind::PrimaryActive(
                    bmq_proto::peer::PrimaryActiveNotice {
                        partition_id: partition.0,
                        lease,
                    },
                )),
            };
            self.peers.send(NodeId(peer.id), Channel::Data, msg);
        }
        self.primary_active(self.self_id, partition, lease);
    }

    fn primary_active(&self, node: NodeId, partition: PartitionId, lease: u64) {
        if let Some(sink) = self.primary_active_sink.get() {
            if sink
                .try_send(PrimaryActive {
                    node,
                    partition,
                    lease,
                })
                .is_err()
            {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "health").increment(1);
            }
        }
    }

    /// Handles a frame from a peer's DATA channel.
    pub fn handle_peer_data(&self, from: NodeId, message: PeerMessage) {
        match message.kind {
            Some(PeerKind::Forwarded(f)) => {
                let Some(inner) = f.inner else {
                    metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
                    return;
                };
                match &inner.kind {
                    // Primary -> proxy: answers and deliveries for one of our sessions.
                    Some(ClientKind::OpenQueueResponse(_))
                    | Some(ClientKind::Ack(_))
                    | Some(ClientKind::Push(_))
                    | Some(ClientKind::CloseQueueResponse(_)) => {
                        if f.origin_node_id != self.self_id.0 {
                            metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
                            return;
                        }
                        self.to_local_session(f.session_id, SessionEvent::FromPrimary(inner));
                    }
                    // Proxy -> primary: requests for one of our partitions.
                    Some(ClientKind::OpenQueue(_))
                    | Some(ClientKind::Put(_))
                    | Some(ClientKind::Confirm(_))
                    | Some(ClientKind::CloseQueue(_)) => {
                        let key = ConsumerKey {
                            origin_node: from,
                            session_id: f.session_id,
                        };
                        let uri = request_uri(&inner).unwrap_or_default().to_string();
                        let partition = self.cluster.borrow().queues.get(&uri).map(|q| q.partition);
                        match partition {
                            Some(p) => {
                                self.to_local_partition(p, key, inner);
                            }
                            None => self.refuse(
                                key,
                                &inner,
                                StatusCode::NotReady,
                                "queue not assigned yet",
                            ),
                        }
                    }
                    _ => {
                        metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
                        debug!(peer = %from, "unexpected forwarded message dropped");
                    }
                }
            }
            Some(PeerKind::PrimaryActive(n)) => {
                self.primary_active(from, PartitionId(n.partition_id), n.lease);
            }
            Some(PeerKind::Partition(m)) => {
                let partition = partition_of(&m);
                let addr = partition.and_then(|p| {
                    self.partitions
                        .lock()
                        .expect("partitions lock")
                        .get(&p)
                        .cloned()
                });
                match addr {
                    Some(addr) => {
                        if addr
                            .try_send(PartitionPeerMessage { from, message: m })
                            .is_err()
                        {
                            // Replication resends what gets no receipt, so a drop only delays.
                            metrics::counter!("bmq_mailbox_full_total", "actor" => "partition")
                                .increment(1);
                        }
                    }
                    None => {
                        metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
                        debug!(peer = %from, ?partition, "replication message for an unknown partition dropped");
                    }
                }
            }
            Some(PeerKind::SessionGone(g)) => {
                let key = ConsumerKey {
                    origin_node: NodeId(g.origin_node_id),
                    session_id: g.session_id,
                };
                for addr in self.partitions.lock().expect("partitions lock").values() {
                    let _ = addr.try_send(PartitionSessionGone { key });
                }
            }
            _ => {
                metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
            }
        }
    }

    /// A peer became available again: sessions attached to a primary there reopen their
    /// queues (the primary released their consumers when the link dropped).
    pub fn handle_node_back(&self, node: NodeId) {
        // No receiver (no session) is fine.
        let _ = self.peer_back.send(node);
    }

    /// Subscribes to "peer link came back" notifications (see [`DataPlane::handle_node_back`]).
    pub fn subscribe_peer_back(&self) -> tokio::sync::broadcast::Receiver<NodeId> {
        self.peer_back.subscribe()
    }

    /// A peer became unavailable: release every consumer it proxied (their unconfirmed
    /// messages are redelivered to other consumers).
    pub fn handle_node_gone(&self, node: NodeId) {
        for addr in self.partitions.lock().expect("partitions lock").values() {
            let _ = addr.try_send(PartitionNodeGone { node });
        }
    }

    /// Starts an actor (opening its journal) for every partition of `state` not yet running,
    /// and tells every actor its partition's committed primary and lease (an actor no longer
    /// primary steps down to replica). Called on every commit. A journal that cannot be opened
    /// (I/O error, corruption) stops the node: serving without it could lose acknowledged
    /// messages.
    pub fn sync_partitions(self: &Arc<Self>, state: &ClusterState) {
        let mut partitions = self.partitions.lock().expect("partitions lock");
        for (id, p) in &state.partitions {
            if !partitions.contains_key(id) {
                match PartitionActor::open(*id, self.clone()) {
                    Ok(actor) => {
                        // Each partition runs on its own thread, so journal fsyncs never
                        // delay the elector's heartbeats or another partition.
                        let arbiter = actix::Arbiter::new();
                        let addr =
                            PartitionActor::start_in_arbiter(&arbiter.handle(), move |_| actor);
                        partitions.insert(*id, addr);
                    }
                    Err(e) => {
                        error!(partition = %id, error = %e, "cannot open the partition journal: stopping the node");
                        actix::System::current().stop_with_code(1);
                        return;
                    }
                }
            }
            let addr = partitions.get(id).expect("inserted above");
            // Bounded by the commit rate; a full mailbox is caught up at the next commit.
            if addr
                .try_send(PartitionRoleChanged {
                    primary: p.primary,
                    lease: p.primary_lease_id,
                    active: p.status == bmq_metadata::PrimaryStatus::Active,
                })
                .is_err()
            {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "partition").increment(1);
            }
        }
    }

    /// The partition actors this node runs, for `/status`.
    pub fn local_partitions(&self) -> Vec<(PartitionId, Addr<PartitionActor>)> {
        self.partitions
            .lock()
            .expect("partitions lock")
            .iter()
            .map(|(id, a)| (*id, a.clone()))
            .collect()
    }
}

/// The queue URI a client request names.
pub fn request_uri(message: &ClientMessage) -> Option<&str> {
    match &message.kind {
        Some(ClientKind::OpenQueue(m)) => Some(&m.uri),
        Some(ClientKind::Put(m)) => Some(&m.uri),
        Some(ClientKind::Confirm(m)) => Some(&m.uri),
        Some(ClientKind::CloseQueue(m)) => Some(&m.uri),
        Some(ClientKind::OpenQueueResponse(m)) => Some(&m.uri),
        Some(ClientKind::Ack(m)) => Some(&m.uri),
        Some(ClientKind::Push(m)) => Some(&m.uri),
        Some(ClientKind::CloseQueueResponse(m)) => Some(&m.uri),
        _ => None,
    }
}

/// The partition a replication message is about.
fn partition_of(m: &bmq_proto::peer::PartitionMessage) -> Option<PartitionId> {
    use bmq_proto::peer::partition_message::Kind as K;
    let id = match m.kind.as_ref()? {
        K::StateQuery(x) => x.partition_id,
        K::StateResponse(x) => x.partition_id,
        K::Pull(x) => x.partition_id,
        K::Sync(x) => x.partition_id,
        K::Replicate(x) => x.partition_id,
        K::Receipt(x) => x.partition_id,
    };
    Some(PartitionId(id))
}

fn forwarded(key: ConsumerKey, message: ClientMessage) -> PeerMessage {
    PeerMessage {
        kind: Some(PeerKind::Forwarded(ForwardedClientMessage {
            origin_node_id: key.origin_node.0,
            session_id: key.session_id,
            inner: Some(message),
        })),
    }
}
