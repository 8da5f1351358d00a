//! `Router`: client traffic between sessions and partition primaries (DESIGN.md §7). A session's
//! request goes to the local [`PartitionActor`] when this node is its partition's primary, else
//! as a `ForwardedClientMessage` over the peer DATA channel; answers and pushes come back the
//! same two ways (the router is the partitions' [`PartitionOutbox`]), one hand-off per
//! destination ([`Dispatch`]). Its other roles: `sessions`, `partitions`, `links`, `assignments`.
//! Threads: called from the main thread and from every partition thread; no lock across an await.

mod assignments;
mod links;
mod partitions;
mod sessions;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};

use actix::{Addr, Recipient};
use bmq_config::BrokerConfig;
use bmq_dataplane::refusal;

use crate::domains::DomainCache;
use bmq_metadata::ClusterState;
use bmq_proto::client::{client_message::Kind as ClientKind, ClientMessage, StatusCode};
use bmq_proto::peer::{
    peer_message::Kind as PeerKind, Channel, ForwardedClientMessage, PartitionMessage, PeerMessage,
    PrimaryActiveNotice,
};
use bmq_proto::{uri_str, LeaseId, NodeId, PartitionId, SessionAddr};
use tokio::sync::{broadcast, oneshot, watch};
use tracing::debug;

use crate::actors::health::PrimaryActive;
use crate::actors::metadata::RequestQueueAssignment;
use crate::actors::partition::{
    PartitionActor, PartitionOutbox, PartitionPeerMessages, PartitionRequests,
};
use crate::net::peers::PeerHub;

pub use partitions::{journals_following, DrainStatus};
pub use sessions::{Revocation, SessionEvent, SessionRegistration, SessionSettings};

use partitions::RoleTold;
use sessions::SessionInbox;

/// Traffic gathered during one turn — a session's read of its client, a read of a peer
/// connection, a partition's outputs — and handed over per destination by
/// [`Router::dispatch`]: one mailbox message per partition, one inbox event per session and one
/// queue item per peer link, however many messages, so a batch of PUTs costs one thread
/// hand-off and one socket write per hop instead of one per message. Order is kept per
/// destination.
#[derive(Debug, Default)]
pub struct Dispatch {
    /// Client requests for local partitions, with the session that sent each.
    requests: Vec<(PartitionId, Vec<(SessionAddr, ClientMessage)>)>,
    /// Replication traffic for local partitions, by sender.
    replication: Vec<((PartitionId, NodeId), Vec<PartitionMessage>)>,
    /// Answers and deliveries for local sessions.
    sessions: Vec<(u64, Vec<ClientMessage>)>,
    /// Frames for peers' DATA channels.
    peers: Vec<(NodeId, Vec<PeerMessage>)>,
}

/// The list for `key` in `lists`, added at the end if absent (few destinations per turn, so a
/// scan beats a map).
fn list_for<K: PartialEq, T>(lists: &mut Vec<(K, Vec<T>)>, key: K) -> &mut Vec<T> {
    match lists.iter().position(|(k, _)| *k == key) {
        Some(i) => &mut lists[i].1,
        None => {
            lists.push((key, Vec::new()));
            &mut lists.last_mut().expect("pushed").1
        }
    }
}

impl Dispatch {
    fn request(&mut self, partition: PartitionId, from: SessionAddr, message: ClientMessage) {
        list_for(&mut self.requests, partition).push((from, message));
    }

    fn replication(&mut self, partition: PartitionId, from: NodeId, message: PartitionMessage) {
        list_for(&mut self.replication, (partition, from)).push(message);
    }

    fn session(&mut self, session_id: u64, message: ClientMessage) {
        list_for(&mut self.sessions, session_id).push(message);
    }

    fn peer(&mut self, node: NodeId, message: PeerMessage) {
        list_for(&mut self.peers, node).push(message);
    }

    fn is_empty(&self) -> bool {
        self.requests.is_empty()
            && self.replication.is_empty()
            && self.sessions.is_empty()
            && self.peers.is_empty()
    }
}

/// What the router is built from.
pub struct RouterParts {
    /// The node configuration.
    pub config: Arc<BrokerConfig>,
    /// The peer links.
    pub peers: Arc<PeerHub>,
    /// The latest committed cluster state.
    pub cluster: watch::Receiver<Arc<ClusterState>>,
    /// The domains as this node resolves them (committed, or the file's before the seed).
    pub domains: Arc<DomainCache>,
    /// Where `PrimaryActiveNotice`s go on this node (the health actor).
    pub primary_active: Recipient<PrimaryActive>,
    /// Where queue assignment requests go (the metadata actor, which forwards to the leader).
    pub assignments: Recipient<RequestQueueAssignment>,
    /// The quorum every partition starts with: `elector.quorum`, 0 for a majority of each
    /// lease's replicas.
    pub quorum: usize,
}

/// The router shared by sessions, partition actors and the peer inbound path (see the module
/// doc). Its fields are grouped by the file that uses them.
pub struct Router {
    self_id: NodeId,
    config: Arc<BrokerConfig>,
    peers: Arc<PeerHub>,
    cluster: watch::Receiver<Arc<ClusterState>>,
    primary_active_sink: Recipient<PrimaryActive>,
    // sessions.rs
    /// What sessions read of the configuration, taken from it once.
    session_settings: Arc<SessionSettings>,
    sessions: dashmap::DashMap<u64, SessionInbox>,
    next_session_id: AtomicU64,
    // partitions.rs
    domains: Arc<DomainCache>,
    quorum: AtomicUsize,
    partitions: Mutex<HashMap<PartitionId, Addr<PartitionActor>>>,
    /// The role last told to each partition actor ([`Router::sync_partitions`]).
    roles_told: Mutex<HashMap<PartitionId, RoleTold>>,
    /// The membership's learners, told to every partition actor
    /// ([`Router::set_partition_learners`]).
    learners: Mutex<Vec<NodeId>>,
    /// Some partition actor may not know its committed role (at start, or after its mailbox
    /// was full): [`Router::sync_partitions`] is due even if the partitions did not change.
    roles_stale: AtomicBool,
    // links.rs
    /// "A peer's data link came back" notifications for sessions: the peer and the data link's
    /// generation ([`PeerHub::data_generation`]) when it did.
    peer_back: broadcast::Sender<(NodeId, u64)>,
    // assignments.rs
    assignments: Recipient<RequestQueueAssignment>,
    /// Opens waiting for a queue's assignment to commit, by URI ([`Router::watch_assignment`]).
    assignment_waiters: Mutex<HashMap<String, Vec<oneshot::Sender<()>>>>,
    /// Opens waiting for a queue's assignment to be proposed, by URI
    /// ([`Router::watch_proposal`]).
    proposal_waiters: Mutex<HashMap<String, Vec<oneshot::Sender<PartitionId>>>>,
}

fn forwarded(
    key: SessionAddr,
    message: ClientMessage,
    partition: Option<PartitionId>,
) -> PeerMessage {
    PeerMessage {
        kind: Some(PeerKind::Forwarded(ForwardedClientMessage {
            origin_node_id: key.origin_node.0,
            session_id: key.session_id,
            inner: Some(message),
            partition_id: partition.map(|p| p.0),
        })),
    }
}

impl Router {
    /// A router for this node. Partition actors are started by [`Router::sync_partitions`].
    pub fn new(parts: RouterParts) -> Arc<Router> {
        Arc::new(Router {
            self_id: NodeId(parts.config.node_id),
            session_settings: Arc::new(SessionSettings::from_config(
                &parts.config,
                parts.domains.clone(),
            )),
            config: parts.config,
            peers: parts.peers,
            cluster: parts.cluster,
            domains: parts.domains,
            primary_active_sink: parts.primary_active,
            assignments: parts.assignments,
            quorum: AtomicUsize::new(parts.quorum),
            sessions: dashmap::DashMap::new(),
            partitions: Mutex::new(HashMap::new()),
            next_session_id: AtomicU64::new(1),
            peer_back: broadcast::channel(64).0,
            assignment_waiters: Mutex::new(HashMap::new()),
            proposal_waiters: Mutex::new(HashMap::new()),
            roles_told: Mutex::new(HashMap::new()),
            learners: Mutex::new(Vec::new()),
            roles_stale: AtomicBool::new(true),
        })
    }

    /// This node.
    pub fn self_id(&self) -> NodeId {
        self.self_id
    }

    /// A receiver of the committed cluster state.
    pub fn cluster(&self) -> watch::Receiver<Arc<ClusterState>> {
        self.cluster.clone()
    }

    /// Adds a session's request for the primary `primary` of `partition` to `dispatch`.
    pub fn to_primary(
        &self,
        dispatch: &mut Dispatch,
        partition: PartitionId,
        primary: NodeId,
        session_id: u64,
        message: ClientMessage,
    ) {
        let from = SessionAddr {
            origin_node: self.self_id,
            session_id,
        };
        if primary == self.self_id {
            dispatch.request(partition, from, message);
        } else {
            dispatch.peer(primary, forwarded(from, message, Some(partition)));
        }
    }

    /// Hands what `dispatch` gathered to its destinations (see [`Dispatch`]) and empties it.
    /// A partition whose mailbox is full refuses the requests with OVERLOADED (a PUT gets a
    /// `LIMIT_REACHED` NACK, which the proxy passes on to its producer: never ACKed, so
    /// nothing is lost and no later PUT overtakes an accepted one); one this node does not run
    /// yet with NOT_READY (the proxy keeps its PUTs, holds the queue's later ones, and
    /// resends in order once reopened: `bmq_dataplane::proxy`); replication
    /// traffic that finds a full mailbox is dropped and counted (replication resends what
    /// gets no receipt). Refusals are the data plane's [`refusal`]s.
    pub fn dispatch(&self, dispatch: &mut Dispatch) {
        if dispatch.is_empty() {
            return;
        }
        let mut refusals = Dispatch::default();
        for (partition, requests) in dispatch.requests.drain(..) {
            let sent = self.send_to_partition(partition, PartitionRequests { requests });
            let Err((PartitionRequests { requests }, known)) = sent else {
                continue;
            };
            let (code, why) = if known {
                metrics::counter!("bmq_partition_overloaded_total")
                    .increment(requests.len() as u64);
                (StatusCode::Overloaded, "partition overloaded")
            } else {
                let why = "this node does not know this partition yet";
                (StatusCode::NotReady, why)
            };
            for (from, message) in &requests {
                self.refuse_into(&mut refusals, *from, message, code, why, partition);
            }
        }
        for ((partition, from), messages) in dispatch.replication.drain(..) {
            match self.send_to_partition(partition, PartitionPeerMessages { from, messages }) {
                Ok(()) => {}
                // Replication resends what gets no receipt, so a drop only delays.
                Err((_, true)) => {
                    metrics::counter!("bmq_mailbox_full_total", "actor" => "partition")
                        .increment(1);
                }
                Err((PartitionPeerMessages { messages, .. }, false)) => {
                    metrics::counter!("bmq_peer_messages_invalid_total")
                        .increment(messages.len() as u64);
                    debug!(peer = %from, %partition, "replication messages for an unknown partition dropped");
                }
            }
        }
        for (session_id, messages) in dispatch.sessions.drain(..) {
            self.to_local_session(session_id, SessionEvent::FromPrimary(messages));
        }
        for (node, messages) in dispatch.peers.drain(..) {
            self.peers.send_many(node, Channel::Data, messages);
        }
        if !refusals.is_empty() {
            self.dispatch(&mut refusals);
        }
    }

    /// Answers (into `dispatch`) a request that cannot be served here, so the proxy retries
    /// elsewhere or later.
    fn refuse_into(
        &self,
        dispatch: &mut Dispatch,
        to: SessionAddr,
        message: &ClientMessage,
        code: StatusCode,
        reason: &str,
        partition: PartitionId,
    ) {
        if let Some(answer) = refusal(message, code, reason, partition) {
            self.session_into(dispatch, to, answer);
        }
    }

    /// Adds an answer or delivery for session `to`, local or on another node, to `dispatch`.
    fn session_into(&self, dispatch: &mut Dispatch, to: SessionAddr, message: ClientMessage) {
        if to.origin_node == self.self_id {
            dispatch.session(to.session_id, message);
        } else {
            dispatch.peer(to.origin_node, forwarded(to, message, None));
        }
    }

    /// Tells the local health actor that `node` healed `partition` at `lease` (or, with
    /// `renew_lease`, asks for a higher lease: see `PrimaryActiveNotice`).
    fn primary_active_seen(
        &self,
        node: NodeId,
        partition: PartitionId,
        lease: LeaseId,
        renew_lease: bool,
    ) {
        let msg = PrimaryActive {
            node,
            partition,
            lease,
            renew_lease,
        };
        if self.primary_active_sink.try_send(msg).is_err() {
            metrics::counter!("bmq_mailbox_full_total", "actor" => "health").increment(1);
        }
    }

    /// Sends every peer, and this node's health actor, a `PrimaryActiveNotice` for
    /// `partition` at `lease` (`renew_lease`: asking for a higher lease instead). Every peer
    /// of the committed membership (the peer links'), not only the file's members: the leader
    /// may be a member added at run time.
    fn notify_primary_status(&self, partition: PartitionId, lease: LeaseId, renew_lease: bool) {
        let msg = PeerMessage {
            kind: Some(PeerKind::PrimaryActive(PrimaryActiveNotice {
                partition_id: partition.0,
                lease: lease.0,
                renew_lease,
            })),
        };
        self.peers.broadcast(Channel::Data, msg);
        self.primary_active_seen(self.self_id, partition, lease, renew_lease);
    }

    /// Handles frames from a peer's DATA channel, in order (see the module doc): client
    /// requests and replication traffic go to the partitions, answers and deliveries to the
    /// sessions, one hand-off per destination ([`Dispatch`]).
    pub fn handle_peer_data(&self, from: NodeId, messages: Vec<PeerMessage>) {
        let mut dispatch = Dispatch::default();
        for message in messages {
            match message.kind {
                Some(PeerKind::Forwarded(f)) => self.handle_forwarded(&mut dispatch, from, f),
                Some(PeerKind::PrimaryActive(n)) => {
                    self.primary_active_seen(
                        from,
                        PartitionId(n.partition_id),
                        LeaseId(n.lease),
                        n.renew_lease,
                    );
                }
                Some(PeerKind::Partition(m)) => match partition_of(&m) {
                    Some(partition) => dispatch.replication(partition, from, m),
                    None => {
                        metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
                        debug!(peer = %from, "replication message without a partition dropped");
                    }
                },
                Some(PeerKind::ConsumersReleased(_)) => {
                    self.handle_consumers_released(&mut dispatch, from);
                }
                Some(PeerKind::SessionGone(g)) => self.handle_session_gone(&mut dispatch, g),
                _ => {
                    metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
                }
            }
        }
        self.dispatch(&mut dispatch);
    }

    fn handle_forwarded(&self, dispatch: &mut Dispatch, from: NodeId, f: ForwardedClientMessage) {
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
                dispatch.session(f.session_id, inner);
            }
            // Proxy -> primary: requests for one of our partitions. The proxy names the
            // partition it routed to; an older proxy does not, and the queue is looked up.
            Some(ClientKind::OpenQueue(_))
            | Some(ClientKind::Put(_))
            | Some(ClientKind::Confirm(_))
            | Some(ClientKind::CloseQueue(_)) => {
                let session = SessionAddr {
                    origin_node: from,
                    session_id: f.session_id,
                };
                let partition = f.partition_id.map(PartitionId).or_else(|| {
                    let uri = request_uri(&inner)?;
                    self.cluster.borrow().queues.get(uri).map(|q| q.partition)
                });
                match partition {
                    Some(p) => dispatch.request(p, session, inner),
                    None => {
                        let why = "queue not assigned yet";
                        let p = PartitionId(0);
                        self.refuse_into(dispatch, session, &inner, StatusCode::NotReady, why, p);
                    }
                }
            }
            _ => {
                metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
                debug!(peer = %from, "unexpected forwarded message dropped");
            }
        }
    }
}

impl PartitionOutbox for Router {
    fn to_sessions(&self, messages: Vec<(SessionAddr, ClientMessage)>) {
        let mut dispatch = Dispatch::default();
        for (to, message) in messages {
            self.session_into(&mut dispatch, to, message);
        }
        self.dispatch(&mut dispatch);
    }

    fn to_peers(&self, messages: Vec<(NodeId, PartitionMessage)>) {
        let mut dispatch = Dispatch::default();
        for (to, message) in messages {
            let msg = PeerMessage {
                kind: Some(PeerKind::Partition(message)),
            };
            dispatch.peer(to, msg);
        }
        self.dispatch(&mut dispatch);
    }

    fn primary_active(&self, partition: PartitionId, lease: LeaseId) {
        self.notify_primary_status(partition, lease, false);
    }

    fn request_new_lease(&self, partition: PartitionId, lease: LeaseId) {
        self.notify_primary_status(partition, lease, true);
    }
}

/// The queue URI a client request names (`None` also for a per-message URI that is not
/// UTF-8: it names no queue).
pub fn request_uri(message: &ClientMessage) -> Option<&str> {
    match &message.kind {
        Some(ClientKind::OpenQueue(m)) => Some(&m.uri),
        Some(ClientKind::Put(m)) => uri_str(&m.uri),
        Some(ClientKind::Confirm(m)) => uri_str(&m.uri),
        Some(ClientKind::CloseQueue(m)) => Some(&m.uri),
        Some(ClientKind::OpenQueueResponse(m)) => Some(&m.uri),
        Some(ClientKind::Ack(m)) => uri_str(&m.uri),
        Some(ClientKind::Push(m)) => uri_str(&m.uri),
        Some(ClientKind::CloseQueueResponse(m)) => Some(&m.uri),
        _ => None,
    }
}

/// The partition a replication message is about.
fn partition_of(m: &PartitionMessage) -> Option<PartitionId> {
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
