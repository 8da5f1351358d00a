//! `Router`: where client traffic goes between sessions and partition primaries (DESIGN.md §7).
//!
//! A client may attach to any node (its *proxy*). The proxy's session sends OPEN/PUT/CONFIRM/
//! CLOSE to the primary of the queue's partition — to the local [`PartitionActor`] when this
//! node is that primary, otherwise as a `ForwardedClientMessage` (naming the partition) over the
//! peer DATA channel. The primary answers (OpenQueueResponse, ACK, PUSH) to the session address
//! that asked, by the same two routes in reverse: the router is the partitions'
//! [`PartitionOutbox`].
//!
//! The router also keeps this node's partition actors in step with the committed cluster state:
//! every partition has an actor on every node (primary or replica, each with its journal, each
//! on its own thread), told the committed primary and `primary_lease_id` whenever they change; a
//! node that is no longer a partition's primary steps down to replica, it does not exit. Opens
//! waiting for a queue's assignment register here and are woken by the commit that assigns it.
//! Replication traffic (`PartitionMessage` on the DATA channel) goes to the partition's actor.
//!
//! Built with everything it needs; it never reaches into other actors' state. Answers to
//! requests that cannot be served here (unknown partition, full mailbox) are the data plane's
//! [`refusal`]s.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use actix::{Actor, Addr, Recipient};
use bmq_config::BrokerConfig;
use bmq_dataplane::{
    refusal, ConsumerDefaults, DomainPolicies, PartitionConfig, ReplicationConfig, StoreConfig,
};
use bmq_metadata::{ClusterState, PrimaryStatus};
use bmq_proto::client::{client_message::Kind as ClientKind, ClientMessage, Status, StatusCode};
use bmq_proto::peer::{
    peer_message::Kind as PeerKind, Channel, ConsumersReleased, ForwardedClientMessage,
    PartitionMessage, PeerMessage, PrimaryActiveNotice, SessionGone,
};
use bmq_proto::{uri_str, LeaseId, NodeId, PartitionId, SessionAddr};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::actors::health::PrimaryActive;
use crate::actors::metadata::{ProposalWatcher, RequestQueueAssignment};
use crate::actors::partition::{
    wall_clock_ms, GetPartitionStats, PartitionActor, PartitionNodeGone, PartitionOutbox,
    PartitionPeerMessages, PartitionRequests, PartitionRoleChanged, PartitionSessionGone,
    SetPartitionQuorum, StopDelivering,
};
use crate::net::peers::PeerHub;

/// What a session's inbox receives from the rest of the node.
#[derive(Debug)]
pub enum SessionEvent {
    /// Responses and deliveries from a primary (OpenQueueResponse, Ack, Push,
    /// CloseQueueResponse), in order: everything one turn of the primary had for the session.
    FromPrimary(Vec<ClientMessage>),
    /// The leader proposed a partition for a queue the session asked to open (not yet
    /// committed: `Proxy::handle_proposed`).
    OpenProposed {
        /// The client's request id.
        request_id: u64,
        /// The queue.
        uri: String,
        /// The proposed partition.
        partition: PartitionId,
    },
    /// A queue the session asked to open now has a partition (or not, on timeout).
    OpenResolved {
        /// The client's request id.
        request_id: u64,
        /// The queue.
        uri: String,
        /// The partition, or the status to answer the client with.
        outcome: Result<PartitionId, Status>,
    },
}

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

/// What a graceful stop waits for before the primaries move ([`Router::drain_status`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainStatus {
    /// Messages pushed to consumers and not yet confirmed.
    pub unconfirmed: u64,
    /// Journal records not yet held by a quorum: once they are, a new primary knows every
    /// confirm given during the drain.
    pub uncommitted: u64,
}

impl DrainStatus {
    /// Nothing left to wait for.
    pub fn is_done(&self) -> bool {
        self.unconfirmed == 0 && self.uncommitted == 0
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
    /// The domains' policies, resolved once from the configuration.
    pub policies: Arc<DomainPolicies>,
    /// Where `PrimaryActiveNotice`s go on this node (the health actor).
    pub primary_active: Recipient<PrimaryActive>,
    /// Where queue assignment requests go (the metadata actor, which forwards to the leader).
    pub assignments: Recipient<RequestQueueAssignment>,
    /// The effective quorum every partition starts with.
    pub quorum: usize,
}

/// A local session's inbox as the router holds it ([`Router::to_local_session`]).
struct SessionInbox {
    tx: mpsc::Sender<SessionEvent>,
    /// Cancelled when the inbox overflowed: the session ends at once.
    overflowed: CancellationToken,
}

/// What [`Router::register_session`] gives a new local session.
pub struct SessionRegistration {
    /// The session's id, unique on this node.
    pub id: u64,
    /// Answers and deliveries for the session, in order; bounded by `limits.mailbox_capacity`.
    pub inbox: mpsc::Receiver<SessionEvent>,
    /// Cancelled when an event found the inbox full: the event was dropped, so the session
    /// must end (its consumers released, their messages redelivered) rather than go on.
    pub overflowed: CancellationToken,
}

/// A partition's committed role as told to its actor: primary, lease, ACTIVE.
type RoleTold = (Option<NodeId>, LeaseId, bool);

/// The router shared by sessions, partition actors and the peer inbound path (see the module
/// doc).
pub struct Router {
    self_id: NodeId,
    config: Arc<BrokerConfig>,
    peers: Arc<PeerHub>,
    cluster: watch::Receiver<Arc<ClusterState>>,
    policies: Arc<DomainPolicies>,
    primary_active_sink: Recipient<PrimaryActive>,
    assignments: Recipient<RequestQueueAssignment>,
    quorum: AtomicUsize,
    sessions: dashmap::DashMap<u64, SessionInbox>,
    partitions: Mutex<HashMap<PartitionId, Addr<PartitionActor>>>,
    next_session_id: AtomicU64,
    /// "A peer's data link came back" notifications for sessions: the peer and the data link's
    /// generation ([`PeerHub::data_generation`]) when it did.
    peer_back: broadcast::Sender<(NodeId, u64)>,
    /// Opens waiting for a queue's assignment to commit, by URI ([`Router::watch_assignment`]).
    assignment_waiters: Mutex<HashMap<String, Vec<oneshot::Sender<()>>>>,
    /// Opens waiting for a queue's assignment to be proposed, by URI
    /// ([`Router::watch_proposal`]).
    proposal_waiters: Mutex<HashMap<String, Vec<oneshot::Sender<PartitionId>>>>,
    /// The role last told to each partition actor ([`Router::sync_partitions`]).
    roles_told: Mutex<HashMap<PartitionId, RoleTold>>,
    /// Some partition actor may not know its committed role (at start, or after its mailbox
    /// was full): [`Router::sync_partitions`] is due even if the partitions did not change.
    roles_stale: AtomicBool,
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
            config: parts.config,
            peers: parts.peers,
            cluster: parts.cluster,
            policies: parts.policies,
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
            roles_stale: AtomicBool::new(true),
        })
    }

    /// This node.
    pub fn self_id(&self) -> NodeId {
        self.self_id
    }

    /// The node configuration.
    pub fn config(&self) -> &BrokerConfig {
        &self.config
    }

    /// A receiver of the committed cluster state.
    pub fn cluster(&self) -> watch::Receiver<Arc<ClusterState>> {
        self.cluster.clone()
    }

    /// Asks the leader, through the metadata actor, to assign `uri` to a partition (fire and
    /// forget: the caller waits for the assignment in the committed state and asks again).
    pub fn request_assignment(&self, uri: String) {
        if self
            .assignments
            .try_send(RequestQueueAssignment { uri })
            .is_err()
        {
            metrics::counter!("bmq_mailbox_full_total", "actor" => "metadata").increment(1);
        }
    }

    /// A receiver that fires once a committed state containing `uri` is published on this node
    /// (see [`Router::assignments_committed`]). Register before looking at the state, so that no
    /// commit falls in between. A receiver dropped unfired is cleaned up at the next
    /// registration or commit of the same URI, or by [`Router::forget_assignment_waiters`].
    pub fn watch_assignment(&self, uri: &str) -> oneshot::Receiver<()> {
        add_waiter(&self.assignment_waiters, uri)
    }

    /// A receiver that fires with the partition the leader proposes for `uri`, once an
    /// uncommitted assignment of it is written to this node's ledger (the router's
    /// [`ProposalWatcher::assignment_proposed`]): an open can be sent to that partition's primary ahead
    /// of the commit (`Proxy::handle_proposed`). A proposal made before the registration is not
    /// reported; the commit still is ([`Router::watch_assignment`]).
    pub fn watch_proposal(&self, uri: &str) -> oneshot::Receiver<PartitionId> {
        add_waiter(&self.proposal_waiters, uri)
    }

    /// Drops the abandoned waiters of `uri` (its opens gave up).
    pub fn forget_assignment_waiters(&self, uri: &str) {
        drop_closed_waiters(&self.proposal_waiters, uri);
        drop_closed_waiters(&self.assignment_waiters, uri);
    }

    /// The committed state went from `before` to `after`: wakes the opens waiting for a queue
    /// that is now assigned. O(changed queues) (see `ClusterState::queues_assigned_since`), and
    /// nothing at all while no open waits.
    pub fn assignments_committed(&self, before: &ClusterState, after: &ClusterState) {
        let mut waiters = self.assignment_waiters.lock().expect("waiters lock");
        if waiters.is_empty() {
            return;
        }
        for uri in after.queues_assigned_since(before) {
            for waiter in waiters.remove(uri).into_iter().flatten() {
                let _ = waiter.send(());
            }
        }
    }

    /// Registers a new local session: its id, its inbox and its overflow signal.
    pub fn register_session(&self) -> SessionRegistration {
        let id = self.next_session_id.fetch_add(1, Ordering::Relaxed);
        let (tx, inbox) = mpsc::channel(self.config.limits.mailbox_capacity());
        let overflowed = CancellationToken::new();
        let entry = SessionInbox {
            tx,
            overflowed: overflowed.clone(),
        };
        self.sessions.insert(id, entry);
        metrics::gauge!("bmq_client_sessions").set(self.sessions.len() as f64);
        SessionRegistration {
            id,
            inbox,
            overflowed,
        }
    }

    /// Removes a local session and tells every primary it used to release its consumers.
    pub fn unregister_session(&self, session_id: u64, primaries: impl IntoIterator<Item = NodeId>) {
        self.sessions.remove(&session_id);
        metrics::gauge!("bmq_client_sessions").set(self.sessions.len() as f64);
        let session = SessionAddr {
            origin_node: self.self_id,
            session_id,
        };
        let told: BTreeSet<NodeId> = primaries.into_iter().collect();
        for primary in told {
            if primary == self.self_id {
                // `do_send`: a release lost to a full mailbox would leave the session's
                // messages held by it for ever; one per session end and partition, so bounded
                // by the rate of client disconnections.
                self.each_partition(|addr| addr.do_send(PartitionSessionGone { session }));
            } else {
                let msg = PeerMessage {
                    kind: Some(PeerKind::SessionGone(SessionGone {
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

    /// Delivers `event` to a local session's inbox. Returns false when the session is gone or
    /// its inbox is full.
    ///
    /// A full inbox means the session fell `limits.mailbox_capacity` events behind (its client
    /// reads too slowly). The event is dropped and counted, and the session is *closed*: it is
    /// removed from the router (no further event reaches it) and its overflow signal ends it
    /// at once ([`SessionRegistration::overflowed`]). Ending it releases its consumers at
    /// their primaries, so a PUSH dropped here is redelivered, to another consumer or to the
    /// same client once it reconnects; going on instead would leave that message held by a
    /// consumer that never got it for as long as the session lives. A dropped ACK or open
    /// answer is covered anyway (the proxy resends PUTs and opens it has no answer for).
    pub fn to_local_session(&self, session_id: u64, event: SessionEvent) -> bool {
        let Some(tx) = self.sessions.get(&session_id).map(|s| s.tx.clone()) else {
            return false;
        };
        match tx.try_send(event) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(_)) => {
                metrics::counter!("bmq_session_inbox_dropped_total").increment(1);
                if let Some((_, inbox)) = self.sessions.remove(&session_id) {
                    inbox.overflowed.cancel();
                    metrics::counter!("bmq_session_inbox_overflows_total").increment(1);
                    warn!(
                        session = session_id,
                        capacity = self.config.limits.mailbox_capacity,
                        "session inbox full: closing the session, its consumers' messages go to others"
                    );
                }
                false
            }
        }
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
    /// gets no receipt).
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

    /// Hands `message` to partition `id`'s actor, through its address where the router keeps
    /// it: cloning an actix `Addr` allocates two `Arc`s and updates the mailbox's sender count
    /// (two of the ~110 allocations of a queue assignment). `Err((message, known))`:
    /// `known` false when this node has no actor for `id`, true when its mailbox is full or
    /// closed.
    fn send_to_partition<M>(&self, id: PartitionId, message: M) -> Result<(), (M, bool)>
    where
        M: actix::Message + Send + 'static,
        M::Result: Send,
        PartitionActor: actix::Handler<M>,
    {
        let partitions = self.partitions.lock().expect("partitions lock");
        let Some(addr) = partitions.get(&id) else {
            return Err((message, false));
        };
        addr.try_send(message).map_err(|e| match e {
            actix::prelude::SendError::Full(m) | actix::prelude::SendError::Closed(m) => (m, true),
        })
    }

    fn each_partition(&self, f: impl Fn(&Addr<PartitionActor>)) {
        for addr in self.partitions.lock().expect("partitions lock").values() {
            f(addr);
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
    /// `partition` at `lease` (`renew_lease`: asking for a higher lease instead).
    fn notify_primary_status(&self, partition: PartitionId, lease: LeaseId, renew_lease: bool) {
        for peer in self.config.peers() {
            let msg = PeerMessage {
                kind: Some(PeerKind::PrimaryActive(PrimaryActiveNotice {
                    partition_id: partition.0,
                    lease: lease.0,
                    renew_lease,
                })),
            };
            self.peers.send(NodeId(peer.id), Channel::Data, msg);
        }
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
                    // `from` lost its data link with us and released our sessions' consumers
                    // at its primaries. What its sessions sent us or we pushed them may have
                    // been lost with the link too: release their consumers here as well (after
                    // what arrived before the notice; their reopens follow it on this
                    // connection), then reopen ours there.
                    info!(peer = %from, "peer's data link came back: releasing its consumers, reopening ours");
                    self.dispatch(&mut dispatch);
                    self.handle_node_gone(from);
                    self.announce_peer_back(from);
                }
                Some(PeerKind::SessionGone(g)) => {
                    let session = SessionAddr {
                        origin_node: NodeId(g.origin_node_id),
                        session_id: g.session_id,
                    };
                    // What the session sent before it went comes first (a confirm must not
                    // turn into a redelivery).
                    self.dispatch(&mut dispatch);
                    // `do_send`, as for local sessions (`unregister_session`): one per session
                    // end at the peer and partition.
                    self.each_partition(|addr| addr.do_send(PartitionSessionGone { session }));
                }
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

    /// The data link with a peer came back (after [`Router::handle_node_gone`] released its
    /// sessions' consumers here). The peer may never have seen the link go (a connection lost
    /// on our side alone, a paused process), so it is told first ([`ConsumersReleased`], on
    /// the DATA connection, ahead of anything our sessions send it from now on): it releases
    /// our sessions' consumers at its primaries — whatever they had sent or been pushed may
    /// have been lost — and reopens its sessions' queues here. Then our sessions reopen their
    /// queues at its primaries and resend their buffered PUTs.
    pub fn handle_node_back(&self, node: NodeId) {
        let notice = PeerMessage {
            kind: Some(PeerKind::ConsumersReleased(ConsumersReleased {})),
        };
        self.peers.send(node, Channel::Data, notice);
        self.announce_peer_back(node);
    }

    /// Tells the sessions that the data link with `node` is back, with its generation now: they
    /// reopen their queues there and send their PUTs under it again.
    fn announce_peer_back(&self, node: NodeId) {
        // No receiver (no session) is fine.
        let _ = self
            .peer_back
            .send((node, self.peers.data_generation(node)));
    }

    /// Subscribes to "peer's data link came back" notifications (see
    /// [`Router::handle_node_back`]): the peer, and the data link's generation then.
    pub fn subscribe_peer_back(&self) -> broadcast::Receiver<(NodeId, u64)> {
        self.peer_back.subscribe()
    }

    /// The data link generation of `peer` now ([`PeerHub::data_generation`]).
    pub fn data_generation(&self, peer: NodeId) -> u64 {
        self.peers.data_generation(peer)
    }

    /// The data link with a peer was lost (or the peer told us it lost it): release every
    /// consumer it proxied (their unconfirmed messages are redelivered to other consumers, or
    /// to the same ones once they reopen, with the same delivery attempt).
    pub fn handle_node_gone(&self, node: NodeId) {
        // `do_send`: a release lost to a full mailbox would leave the messages pushed through
        // the lost link held for ever; one per data link loss and partition (a link returns
        // only after a reconnection or once its queue has drained to half, so losses are
        // rate-bounded by the peer links).
        self.each_partition(|addr| addr.do_send(PartitionNodeGone { node }));
    }

    /// Graceful stop: every local partition pushes nothing new from now on.
    pub fn stop_delivering(&self) {
        self.each_partition(|addr| {
            // Once per stop; a partition that misses it keeps delivering until the move.
            if addr.try_send(StopDelivering).is_err() {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "partition").increment(1);
            }
        });
    }

    /// What a graceful stop still waits for on the partitions this node is the active
    /// primary of: messages pushed and not yet confirmed, and journal records (confirms among
    /// them) not yet held by a quorum. A partition that does not answer within `timeout`
    /// counts as having nothing left.
    pub async fn drain_status(&self, timeout: std::time::Duration) -> DrainStatus {
        let mut status = DrainStatus::default();
        for (_, addr) in self.local_partitions() {
            if let Ok(Ok(Some(stats))) =
                tokio::time::timeout(timeout, addr.send(GetPartitionStats)).await
            {
                let g = &stats.gauges;
                if g.role == bmq_dataplane::PartitionRole::Active {
                    status.unconfirmed += stats.unconfirmed;
                    status.uncommitted += g.last_sequence.saturating_sub(g.committed);
                }
            }
        }
        status
    }

    /// Sets the effective quorum of every partition (and of partitions started later).
    pub fn set_partition_quorum(&self, quorum: usize) {
        self.quorum.store(quorum, Ordering::SeqCst);
        self.each_partition(|addr| {
            // Rare (an operator action); a full mailbox is reported to the caller's log.
            if addr.try_send(SetPartitionQuorum { quorum }).is_err() {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "partition").increment(1);
            }
        });
    }

    /// The partition core of `id` on this node, built from the configuration.
    fn partition_config(&self, id: PartitionId) -> PartitionConfig {
        let c = &self.config;
        PartitionConfig {
            replication: ReplicationConfig {
                self_id: self.self_id,
                partition: id,
                members: c.members.iter().map(|m| NodeId(m.id)).collect(),
                quorum: self.quorum.load(Ordering::SeqCst),
                batch_records_max: c.replication.batch_records_max as usize,
                in_flight_records_max: c.replication.in_flight_records_max,
                resend_after: c.replication.resend_after(),
                guid_window_max: usize::try_from(c.limits.duplicate_guid_window_max)
                    .unwrap_or(usize::MAX),
                guid_window_age: c.limits.duplicate_guid_window(),
                in_sync_timeout: c.storage.in_sync_timeout(),
            },
            policies: self.policies.clone(),
            consumer_defaults: ConsumerDefaults {
                max_unconfirmed_messages: u32::try_from(c.limits.max_unconfirmed_messages_default)
                    .unwrap_or(u32::MAX),
                max_unconfirmed_bytes: c.limits.max_unconfirmed_bytes_default,
            },
            wall_clock_anchor: (Instant::now(), wall_clock_ms()),
        }
    }

    /// The journal settings of every partition on this node (`[storage]`).
    fn store_config(&self) -> StoreConfig {
        let s = &self.config.storage;
        StoreConfig {
            segment_size_max: s.segment_size_bytes(),
            cache_bytes_max: s.cache_bytes(),
            quota_bytes: s.partition_quota_bytes(),
            fsync: true,
            recycle: s.recycle_segments,
        }
    }

    fn journal_dir(&self, id: PartitionId) -> PathBuf {
        self.config
            .data_dir
            .join("partitions")
            .join(id.0.to_string())
    }

    /// Starts an actor (opening its journal) for every partition of `state` not yet running,
    /// each on its own arbiter thread, and tells each actor its partition's committed primary
    /// and lease when they differ from what it was last told (an actor no longer primary steps
    /// down to replica). Called when the committed partitions change. A journal that cannot
    /// be opened (I/O error, corruption) stops the node: serving without it could lose
    /// acknowledged messages. An actor whose mailbox was full is told at the next call
    /// ([`Router::partition_roles_stale`] says one is due).
    pub fn sync_partitions(self: &Arc<Self>, state: &ClusterState) {
        let mut all_told = true;
        let mut told = self.roles_told.lock().expect("roles lock");
        let mut partitions = self.partitions.lock().expect("partitions lock");
        for (id, p) in &state.partitions {
            if !partitions.contains_key(id) {
                let cfg = self.partition_config(*id);
                let outbox: Arc<dyn PartitionOutbox> = self.clone();
                let actor = PartitionActor::new(
                    *id,
                    self.journal_dir(*id),
                    self.store_config(),
                    cfg,
                    outbox,
                    self.config.limits.mailbox_capacity(),
                );
                // Each partition runs on its own thread (its journal is opened there, so the
                // partitions of a restarting node are read in parallel), so journal fsyncs
                // never delay the peer links, the sessions or another partition.
                let arbiter = actix::Arbiter::new();
                let addr = PartitionActor::start_in_arbiter(&arbiter.handle(), move |_| actor);
                partitions.insert(*id, addr);
            }
            let addr = partitions.get(id).expect("inserted above");
            let role = (
                p.primary,
                LeaseId(p.primary_lease_id),
                p.status == PrimaryStatus::Active,
            );
            if told.get(id) == Some(&role) {
                continue;
            }
            // Bounded by the commit rate; a full mailbox is caught up at the next commit.
            let message = PartitionRoleChanged {
                primary: role.0,
                lease: role.1,
                active: role.2,
            };
            if addr.try_send(message).is_err() {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "partition").increment(1);
                told.remove(id);
                all_told = false;
            } else {
                told.insert(*id, role);
            }
        }
        self.roles_stale.store(!all_told, Ordering::Relaxed);
    }

    /// Whether a partition actor may not know its committed role yet, so that
    /// [`Router::sync_partitions`] is due at the next commit even if no partition changed.
    pub fn partition_roles_stale(&self) -> bool {
        self.roles_stale.load(Ordering::Relaxed)
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

/// A new waiter of `uri` (the abandoned ones dropped on the way); fires through the sender
/// kept in `waiters`.
fn add_waiter<T>(
    waiters: &Mutex<HashMap<String, Vec<oneshot::Sender<T>>>>,
    uri: &str,
) -> oneshot::Receiver<T> {
    let (tx, rx) = oneshot::channel();
    let mut waiters = waiters.lock().expect("waiters lock");
    let entry = waiters.entry(uri.to_owned()).or_default();
    entry.retain(|w| !w.is_closed());
    entry.push(tx);
    rx
}

/// Removes the waiters of `uri` whose receiver was dropped, and its entry once none is left.
fn drop_closed_waiters<T>(waiters: &Mutex<HashMap<String, Vec<oneshot::Sender<T>>>>, uri: &str) {
    let mut waiters = waiters.lock().expect("waiters lock");
    if let Some(entry) = waiters.get_mut(uri) {
        entry.retain(|w| !w.is_closed());
        if entry.is_empty() {
            waiters.remove(uri);
        }
    }
}

impl ProposalWatcher for Router {
    /// Wakes the opens waiting for the proposal of `uri` ([`Router::watch_proposal`]). O(1);
    /// nothing while no open waits.
    fn assignment_proposed(&self, uri: &str, partition: PartitionId) {
        let mut waiters = self.proposal_waiters.lock().expect("waiters lock");
        if waiters.is_empty() {
            return;
        }
        for waiter in waiters.remove(uri).into_iter().flatten() {
            let _ = waiter.send(partition);
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
