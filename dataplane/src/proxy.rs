//! `Proxy`: what a client session decides on the node the client is connected to (DESIGN.md
//! §7, "Proxying"), as a pure core.
//!
//! For each open queue it knows the route: the queue's partition (once the leader assigned it)
//! and the primary and lease it was last opened on. It sends OpenQueue, PUT, CONFIRM and
//! CloseQueue there, and keeps every PUT that is not yet ACKed in a bounded retransmission
//! buffer (in arrival order, found by GUID). When the committed state names a new primary for
//! one of its partitions, when the link to the primary comes back, or when a PUT got
//! `NOT_READY`, it reopens the queue on the partition's current *active* primary and resends
//! the buffered PUTs in arrival order (the primary drops duplicate GUIDs); PUTs and opens
//! that got no answer within the retransmission interval are sent again too (every request
//! has a timeout; a request lost with a peer's data link is sent again sooner, when the link
//! comes back). So an ACKed message is never lost, duplicates are possible, a producer's order
//! is kept, and an open is answered once its primary can be reached.
//!
//! A PUT for a peer also waits while the data link to that peer was interrupted since this
//! session last synchronised with it ([`Proxy::handle_link_generation`]): it stays in the
//! buffer and goes again, in order, after the reopen, instead of overtaking on the new
//! connection the PUTs the interruption lost (ARCHITECTURE "Invariants": PUT order across a
//! lost DATA connection).
//!
//! Inputs: `handle_*` (client requests after the shell authorised them, answers from
//! primaries, resolved assignments, cluster changes, peer links coming back with their
//! generation, the retransmission tick). Outputs, drained with [`Proxy::poll_output`] (which
//! takes the data links' current generations): [`ProxyOutput`].
//! The shell (the session task) owns the socket, authenticates the client at Hello and
//! authorises each OpenQueue; it executes the outputs and publishes [`ProxyCounters`].

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bmq_proto::client::{
    client_message::Kind, Ack, AckStatus, ClientMessage, CloseQueue, CloseQueueResponse, Confirm,
    OpenQueue, OpenQueueResponse, Put, Status, StatusCode,
};
use bmq_proto::{uri_str, LeaseId, NodeId, PartitionId};
use bytes::Bytes;
use tracing::info;

/// Where a partition is served from, as the committed cluster state says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrimaryRoute {
    /// The partition's primary.
    pub primary: NodeId,
    /// Its `primary_lease_id`.
    pub lease: LeaseId,
    /// Whether the primary finished healing (status ACTIVE); only an active primary serves.
    pub active: bool,
}

/// What the shell must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum ProxyOutput {
    /// Send `message` to the primary `primary` of `partition` (this node or a peer).
    ToPrimary {
        /// The queue's partition.
        partition: PartitionId,
        /// Its primary.
        primary: NodeId,
        /// OpenQueue, Put, Confirm or CloseQueue.
        message: ClientMessage,
    },
    /// Send `message` to the client.
    ToClient(ClientMessage),
    /// Find the partition of queue `uri` (asking the leader to assign it), then call
    /// [`Proxy::handle_resolved`] with `request_id`.
    Resolve {
        /// The client's OpenQueue request id.
        request_id: u64,
        /// The queue.
        uri: String,
    },
    /// A PUT was acknowledged `latency` after the client sent it (for the latency histogram).
    Acked {
        /// From the PUT's arrival here to its ACK.
        latency: Duration,
    },
}

/// Counts since the last [`Proxy::take_counters`], for the node's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyCounters {
    /// PUTs for a queue not open in this session (NACKed `UNKNOWN_QUEUE`).
    pub nacks_not_open: u64,
    /// PUTs refused because the retransmission buffer is full (NACKed `LIMIT_REACHED`).
    pub nacks_buffer_full: u64,
    /// PUTs sent again after the retransmission interval.
    pub retransmissions: u64,
    /// OpenQueues sent again to the same primary after the retransmission interval without an
    /// answer.
    pub open_retransmissions: u64,
    /// Requests that named a queue not open in this session (CONFIRM), dropped.
    pub invalid_requests: u64,
    /// PUTs held back (kept in the buffer, not sent) because the data link to their primary
    /// was interrupted since this session last synchronised with it.
    pub puts_held: u64,
}

/// Limits of a proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyConfig {
    /// Most unacknowledged PUTs kept (`limits.retransmit_buffer_max`).
    pub retransmit_buffer_max: usize,
    /// A buffered PUT with no answer for this long is sent again.
    pub retransmit_interval: Duration,
}

/// Where an open queue is served from.
#[derive(Debug, Clone, PartialEq)]
enum QueueRoute {
    /// Waiting for the leader to assign the queue to a partition.
    Resolving,
    /// The leader proposed `partition` for the queue and the open went to that partition's
    /// primary before the assignment committed (see [`Proxy::handle_proposed`]); nothing else
    /// is sent there, and the client is answered only once the assignment commits to the same
    /// partition and primary.
    Proposed {
        partition: PartitionId,
        /// The active primary and lease the open went to.
        sent_to: (NodeId, LeaseId),
        /// Its answer, once it came.
        response: Option<OpenQueueResponse>,
    },
    /// Assigned to `partition`.
    Assigned {
        partition: PartitionId,
        /// The primary and lease the queue was last opened on; `None` while the partition has
        /// no active primary (or the last open was refused).
        attached: Option<(NodeId, LeaseId)>,
        /// A PUT was refused with NOT_READY: later PUTs wait in the buffer until the next
        /// reattach resends them all in arrival order (so a producer's order holds).
        blocked: bool,
    },
}

#[derive(Debug, Clone)]
struct OpenQueueState {
    request: OpenQueue,
    /// While a second open of the queue (a change of how it is open) waits for its answer:
    /// the request it replaced, restored if the change is refused (the primary then keeps
    /// the queue open as before).
    replaced: Option<OpenQueue>,
    route: QueueRoute,
    /// When the last OpenQueue went to a primary, until its answer comes
    /// ([`Proxy::handle_tick`] sends it again after the retransmission interval).
    open_sent_at: Option<Instant>,
}

impl OpenQueueState {
    /// Partition and primary to send to now, unless blocked or detached.
    fn target(&self) -> Option<(PartitionId, NodeId)> {
        match self.route {
            QueueRoute::Assigned {
                partition,
                attached: Some((primary, _)),
                blocked: false,
            } => Some((partition, primary)),
            _ => None,
        }
    }

    /// Partition and primary an open was sent to ahead of the assignment's commit.
    fn proposed(&self) -> Option<(PartitionId, NodeId)> {
        match self.route {
            QueueRoute::Proposed {
                partition,
                sent_to: (primary, _),
                ..
            } => Some((partition, primary)),
            _ => None,
        }
    }

    /// Partition and primary the queue is attached to, blocked or not.
    fn attached(&self) -> Option<(PartitionId, NodeId)> {
        match self.route {
            QueueRoute::Assigned {
                partition,
                attached: Some((primary, _)),
                ..
            } => Some((partition, primary)),
            _ => None,
        }
    }
}

#[derive(Debug)]
struct PendingPut {
    put: Put,
    sent_at: Option<Instant>,
    /// When the client's PUT arrived: the ACK latency is measured from here.
    received_at: Instant,
}

/// Below this many slots the retransmission ring is never compacted.
const COMPACT_MIN: usize = 64;

/// The retransmission buffer: unacknowledged PUTs in arrival order, found by GUID. Resends walk
/// it in arrival order so a producer's messages reach a new primary in the order it sent them.
///
/// PUTs are kept in a ring indexed by arrival number (`slots[i]` holds arrival `first + i`); an
/// ACKed one leaves a hole, and holes at the front are dropped. ACKs come back nearly in
/// arrival order, so the ring stays about as long as what is unacknowledged, and insert, look-up
/// and removal are O(1) (a `BTreeMap` by arrival moved its nodes' entries on every insert and
/// removal: ~3% of a proxy's thread under load). The GUID map uses foldhash's keyed
/// `quality::RandomState` (GUIDs are chosen by the client).
#[derive(Debug, Default)]
struct RetransmitBuffer {
    slots: VecDeque<Option<PendingPut>>,
    /// Arrival number of `slots[0]`.
    first: u64,
    arrival_of: HashMap<Bytes, u64, foldhash::quality::RandomState>,
}

impl RetransmitBuffer {
    fn len(&self) -> usize {
        self.arrival_of.len()
    }

    fn slot(&mut self, arrival: u64) -> Option<&mut Option<PendingPut>> {
        let i = usize::try_from(arrival.checked_sub(self.first)?).ok()?;
        self.slots.get_mut(i)
    }

    fn insert(&mut self, pending: PendingPut) {
        // A GUID sent again replaces its earlier copy, and takes its new place in the order.
        let _ = self.remove(&pending.put.guid);
        let arrival = self.first + self.slots.len() as u64;
        self.arrival_of.insert(pending.put.guid.clone(), arrival);
        self.slots.push_back(Some(pending));
    }

    fn get_mut(&mut self, guid: &[u8]) -> Option<&mut PendingPut> {
        let arrival = *self.arrival_of.get(guid)?;
        self.slot(arrival)?.as_mut()
    }

    fn remove(&mut self, guid: &[u8]) -> Option<PendingPut> {
        let arrival = self.arrival_of.remove(guid)?;
        let taken = self.slot(arrival)?.take();
        while matches!(self.slots.front(), Some(None)) {
            self.slots.pop_front();
            self.first += 1;
        }
        if self.slots.len() > COMPACT_MIN && self.slots.len() > 2 * self.arrival_of.len() {
            self.compact();
        }
        taken
    }

    /// Drops the holes behind an old unacknowledged PUT (more than half the ring), numbering
    /// the PUTs again from `first`, order kept: O(ring) once per as many removals, so the ring
    /// stays within twice what is unacknowledged.
    fn compact(&mut self) {
        let kept: VecDeque<Option<PendingPut>> = self.slots.drain(..).flatten().map(Some).collect();
        for (i, p) in kept.iter().flatten().enumerate() {
            if let Some(arrival) = self.arrival_of.get_mut(&p.put.guid) {
                *arrival = self.first + i as u64;
            }
        }
        self.slots = kept;
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut PendingPut> {
        self.slots.iter_mut().flatten()
    }
}

fn ok() -> Status {
    Status {
        code: StatusCode::Ok as i32,
        message: String::new(),
    }
}

fn ack(put: Put, status: AckStatus, message: &str) -> ClientMessage {
    ClientMessage {
        kind: Some(Kind::Ack(Ack {
            uri: put.uri,
            guid: put.guid,
            status: status as i32,
            message: message.to_string(),
        })),
    }
}

/// One client session's proxy (see the module doc).
#[derive(Debug)]
pub struct Proxy {
    cfg: ProxyConfig,
    self_id: NodeId,
    /// The session's open queues, by URI (foldhash: one look-up per PUT and per CONFIRM).
    queues: HashMap<String, OpenQueueState, foldhash::quality::RandomState>,
    /// Client request ids of opens sent to a primary and not yet answered, by uri.
    pending_opens: HashMap<String, u64>,
    pending_puts: RetransmitBuffer,
    /// Per peer, the data link generation this session's PUTs there are sent under: taken at
    /// the first PUT and at each return of the data link (when the queues there reopen and
    /// their PUTs are resent).
    link_generations: HashMap<NodeId, u64>,
    counters: ProxyCounters,
    outputs: VecDeque<ProxyOutput>,
}

impl Proxy {
    /// The proxy of a new session on node `self_id`.
    pub fn new(self_id: NodeId, cfg: ProxyConfig) -> Self {
        Proxy {
            cfg,
            self_id,
            queues: HashMap::default(),
            pending_opens: HashMap::new(),
            pending_puts: RetransmitBuffer::default(),
            link_generations: HashMap::new(),
            counters: ProxyCounters::default(),
            outputs: VecDeque::new(),
        }
    }

    /// The next output to execute, in order. `link_generation(peer)` is the current
    /// generation of the data link to `peer` (it grows at each interruption of the link; the
    /// shell's peer links count them). A PUT for a peer whose generation differs from the one
    /// this session sends under is held: dropped from the outputs and counted
    /// ([`ProxyCounters::puts_held`]), kept in the retransmission buffer for the resend that
    /// follows the link's return ([`Proxy::handle_link_generation`], then
    /// [`Proxy::handle_peer_back`]). Sent now, it could reach the primary ahead of PUTs the
    /// interruption lost, and be delivered before them. Asked at the moment of sending, not
    /// when the link's return is announced, because a PUT may go out on the new connection
    /// before the announcement reaches this session.
    pub fn poll_output(&mut self, link_generation: &dyn Fn(NodeId) -> u64) -> Option<ProxyOutput> {
        loop {
            let output = self.outputs.pop_front()?;
            if let ProxyOutput::ToPrimary {
                primary,
                message:
                    ClientMessage {
                        kind: Some(Kind::Put(_)),
                    },
                ..
            } = &output
            {
                if self.holds_put(*primary, link_generation) {
                    self.counters.puts_held += 1;
                    continue;
                }
            }
            return Some(output);
        }
    }

    /// Whether a PUT for `primary` waits for the data link's return (see
    /// [`Proxy::poll_output`]). The first PUT for a peer takes its current generation.
    fn holds_put(&mut self, primary: NodeId, link_generation: &dyn Fn(NodeId) -> u64) -> bool {
        if primary == self.self_id {
            return false;
        }
        let now = link_generation(primary);
        *self.link_generations.entry(primary).or_insert(now) != now
    }

    /// The data link to `peer` came back at `generation`: this session's PUTs there go under
    /// it from now on. Call before [`Proxy::handle_peer_back`] for the same return, whose
    /// reopen resends the held PUTs in order.
    pub fn handle_link_generation(&mut self, peer: NodeId, generation: u64) {
        self.link_generations.insert(peer, generation);
    }

    /// Outputs waiting to be executed.
    pub fn pending_outputs(&self) -> usize {
        self.outputs.len()
    }

    /// The counts since the last call (then zero).
    pub fn take_counters(&mut self) -> ProxyCounters {
        std::mem::take(&mut self.counters)
    }

    /// Unacknowledged PUTs held for retransmission.
    pub fn unacknowledged(&self) -> usize {
        self.pending_puts.len()
    }

    /// The primaries this session's queues are attached to (told when the session ends, so
    /// they release its consumers).
    pub fn attached_primaries(&self) -> Vec<NodeId> {
        self.queues
            .values()
            .filter_map(|q| q.attached().or(q.proposed()).map(|(_, n)| n))
            .collect()
    }

    fn reply(&mut self, message: ClientMessage) {
        self.outputs.push_back(ProxyOutput::ToClient(message));
    }

    fn forward(&mut self, partition: PartitionId, primary: NodeId, kind: Kind) {
        self.outputs.push_back(ProxyOutput::ToPrimary {
            partition,
            primary,
            message: ClientMessage { kind: Some(kind) },
        });
    }

    /// An OpenQueue the shell validated (URI, domain) and authorised: resolve the queue's
    /// partition. An open of a queue this session has open replaces its request (read, write,
    /// consumers): sent to the primary the queue is attached to, which answers it, or with
    /// the next attach. One open of a queue is in progress at a time: another one meanwhile
    /// is refused (`REFUSED`), changing nothing.
    pub fn handle_open(&mut self, now: Instant, open: OpenQueue) {
        let uri = open.uri.clone();
        let request_id = open.request_id;
        if let Some(q) = self.queues.get_mut(&uri) {
            let in_progress = self.pending_opens.contains_key(&uri)
                || !matches!(q.route, QueueRoute::Assigned { .. });
            if in_progress {
                self.counters.invalid_requests += 1;
                self.reply(ClientMessage {
                    kind: Some(Kind::OpenQueueResponse(OpenQueueResponse {
                        request_id,
                        uri,
                        status: Some(Status {
                            code: StatusCode::Refused as i32,
                            message: "an open of this queue is already in progress".into(),
                        }),
                        partition_id: 0,
                    })),
                });
                return;
            }
            q.replaced = Some(std::mem::replace(&mut q.request, open.clone()));
            self.pending_opens.insert(uri, request_id);
            if let Some((partition, primary)) = q.attached() {
                q.open_sent_at = Some(now);
                self.forward(partition, primary, Kind::OpenQueue(open));
            }
            return;
        }
        self.queues.insert(
            uri.clone(),
            OpenQueueState {
                request: open,
                replaced: None,
                route: QueueRoute::Resolving,
                open_sent_at: None,
            },
        );
        self.outputs
            .push_back(ProxyOutput::Resolve { request_id, uri });
    }

    /// The queue `uri` of open request `request_id` is assigned to a partition (`Ok`), or
    /// could not be (`Err`, answered to the client). `routes` gives each partition's primary.
    pub fn handle_resolved(
        &mut self,
        request_id: u64,
        uri: String,
        outcome: Result<PartitionId, Status>,
        routes: &dyn Fn(PartitionId) -> Option<PrimaryRoute>,
        now: Instant,
    ) {
        let Some(q) = self.queues.get_mut(&uri) else {
            return;
        };
        if q.request.request_id != request_id {
            return;
        }
        let early = std::mem::replace(&mut q.route, QueueRoute::Resolving);
        match outcome {
            Ok(partition) => {
                if let QueueRoute::Proposed {
                    partition: proposed,
                    sent_to,
                    response,
                } = early
                {
                    let current = routes(partition)
                        .filter(|r| r.active)
                        .map(|r| (r.primary, r.lease));
                    if proposed == partition && current == Some(sent_to) {
                        // The open already went where the commit says: answer with its
                        // response, or when it comes.
                        q.route = QueueRoute::Assigned {
                            partition,
                            attached: Some(sent_to),
                            blocked: false,
                        };
                        self.pending_opens.insert(uri.clone(), request_id);
                        if let Some(resp) = response {
                            self.on_open_response(resp);
                        }
                        // PUTs the client sent meanwhile follow the open (unless it was
                        // refused: the queue is gone, as after any refused open).
                        if self.queues.contains_key(&uri) {
                            self.resend_buffered(&uri, partition, sent_to.0, now);
                        }
                        return;
                    }
                    // Another partition or primary: withdraw that open, then as usual.
                    self.withdraw(&uri, proposed, sent_to.0);
                }
                let Some(q) = self.queues.get_mut(&uri) else {
                    return;
                };
                q.route = QueueRoute::Assigned {
                    partition,
                    attached: None,
                    blocked: false,
                };
                self.pending_opens.insert(uri.clone(), request_id);
                self.attach(&uri, routes, now);
            }
            Err(status) => {
                if let QueueRoute::Proposed {
                    partition, sent_to, ..
                } = early
                {
                    self.withdraw(&uri, partition, sent_to.0);
                }
                self.queues.remove(&uri);
                self.reply(ClientMessage {
                    kind: Some(Kind::OpenQueueResponse(OpenQueueResponse {
                        request_id,
                        uri,
                        status: Some(status),
                        partition_id: 0,
                    })),
                });
            }
        }
    }

    /// The leader proposed `partition` for queue `uri` of open request `request_id` (the
    /// assignment is in the ledger, not yet committed): the open goes to that partition's
    /// active primary now, so its answer can be back by the time the assignment commits
    /// ([`Proxy::handle_resolved`] then answers the client) instead of one round trip later.
    /// Nothing but the open goes there before the commit — a PUT could land in a partition the
    /// queue does not end up in — and an open sent ahead to a partition or primary that the
    /// commit does not confirm is withdrawn (CloseQueue). Ignored unless the queue is still
    /// resolving, and when the partition has no active primary.
    pub fn handle_proposed(
        &mut self,
        request_id: u64,
        uri: &str,
        partition: PartitionId,
        routes: &dyn Fn(PartitionId) -> Option<PrimaryRoute>,
        now: Instant,
    ) {
        let Some(q) = self.queues.get_mut(uri) else {
            return;
        };
        if q.request.request_id != request_id || q.route != QueueRoute::Resolving {
            return;
        }
        let Some(route) = routes(partition).filter(|r| r.active) else {
            return;
        };
        q.route = QueueRoute::Proposed {
            partition,
            sent_to: (route.primary, route.lease),
            response: None,
        };
        q.open_sent_at = Some(now);
        let open = q.request.clone();
        self.forward(partition, route.primary, Kind::OpenQueue(open));
    }

    /// Closes on `primary` an open of `uri` sent ahead of a commit that did not confirm it.
    fn withdraw(&mut self, uri: &str, partition: PartitionId, primary: NodeId) {
        let close = CloseQueue {
            request_id: 0,
            uri: uri.to_string(),
        };
        self.forward(partition, primary, Kind::CloseQueue(close));
    }

    /// Sends the PUTs buffered for `uri` (in arrival order) to `primary`.
    fn resend_buffered(
        &mut self,
        uri: &str,
        partition: PartitionId,
        primary: NodeId,
        now: Instant,
    ) {
        let mut resend = Vec::new();
        for pending in self.pending_puts.values_mut().filter(|p| p.put.uri == uri) {
            pending.sent_at = Some(now);
            resend.push(pending.put.clone());
        }
        for put in resend {
            self.forward(partition, primary, Kind::Put(put));
        }
    }

    /// A PUT from the client.
    pub fn handle_put(&mut self, now: Instant, put: Put) {
        let Some(q) = uri_str(&put.uri).and_then(|u| self.queues.get(u)) else {
            self.counters.nacks_not_open += 1;
            let why = "the queue is not open in this session";
            self.reply(ack(put, AckStatus::UnknownQueue, why));
            return;
        };
        if !q.request.write {
            let why = "the queue is not open for writing";
            self.reply(ack(put, AckStatus::Refused, why));
            return;
        }
        if put.guid.len() != 16 {
            let why = "a message guid must be 16 bytes";
            self.reply(ack(put, AckStatus::Invalid, why));
            return;
        }
        if self.pending_puts.len() >= self.cfg.retransmit_buffer_max {
            self.counters.nacks_buffer_full += 1;
            let why = "too many unacknowledged messages in this session";
            self.reply(ack(put, AckStatus::LimitReached, why));
            return;
        }
        let target = q.target();
        let mut pending = PendingPut {
            put,
            sent_at: None,
            received_at: now,
        };
        if let Some((partition, primary)) = target {
            pending.sent_at = Some(now);
            self.forward(partition, primary, Kind::Put(pending.put.clone()));
        }
        self.pending_puts.insert(pending);
    }

    /// A CONFIRM from the client: to the queue's primary (dropped and counted for a queue not
    /// open here; lost while detached, which only delays: the message is redelivered).
    pub fn handle_confirm(&mut self, confirm: Confirm) {
        match uri_str(&confirm.uri).and_then(|u| self.queues.get(u)) {
            Some(q) => {
                if let Some((partition, primary)) = q.attached() {
                    self.forward(partition, primary, Kind::Confirm(confirm));
                }
            }
            None => self.counters.invalid_requests += 1,
        }
    }

    /// A CloseQueue from the client: forwarded to the primary, answered here at once.
    pub fn handle_close(&mut self, close: CloseQueue) {
        if let Some(q) = self.queues.remove(&close.uri) {
            if let Some((partition, primary)) = q.attached().or(q.proposed()) {
                self.forward(partition, primary, Kind::CloseQueue(close.clone()));
            }
        }
        self.reply(ClientMessage {
            kind: Some(Kind::CloseQueueResponse(CloseQueueResponse {
                request_id: close.request_id,
                uri: close.uri,
                status: Some(ok()),
            })),
        });
    }

    /// An answer or delivery from a primary: Ack, Push, OpenQueueResponse, or an
    /// ErrorResponse (the primary closed a consumer of this session: its app or domain was
    /// removed), which goes to the client as it is.
    pub fn handle_from_primary(&mut self, now: Instant, message: ClientMessage) {
        match message.kind {
            Some(Kind::Ack(ack)) => self.on_ack(now, ack),
            Some(Kind::Push(push))
                if uri_str(&push.uri)
                    .and_then(|u| self.queues.get(u))
                    .is_some_and(|q| q.request.read) =>
            {
                self.reply(ClientMessage {
                    kind: Some(Kind::Push(push)),
                });
            }
            Some(Kind::OpenQueueResponse(resp)) => self.on_open_response(resp),
            Some(Kind::Error(error)) => {
                if !error.app_id.is_empty() {
                    self.stop_reading_app(&error.uri, &error.app_id);
                }
                self.reply(ClientMessage {
                    kind: Some(Kind::Error(error)),
                });
            }
            _ => {}
        }
    }

    /// The primary closed this session's consumer of `app` on queue `uri` (the app left its
    /// fanout domain): the open kept for reopens no longer names it, so a reopen after a
    /// failover is not refused for it (with the session's other apps and its PUTs held).
    fn stop_reading_app(&mut self, uri: &str, app: &str) {
        let Some(q) = self.queues.get_mut(uri) else {
            return;
        };
        let request = &mut q.request;
        if request.consumers.is_empty() {
            if request.consumer.as_ref().is_some_and(|c| c.app_id == app) {
                request.read = false;
                request.consumer = None;
            }
        } else {
            request.consumers.retain(|c| c.app_id != app);
            request.read = !request.consumers.is_empty();
        }
    }

    fn on_ack(&mut self, now: Instant, ack: Ack) {
        if ack.status == AckStatus::NotReady as i32 {
            // Not (or no longer, or not yet) the primary: keep the PUT, and hold the queue's
            // later PUTs back, for an in-order resend.
            if let Some(p) = self.pending_puts.get_mut(&ack.guid) {
                p.sent_at = None;
            }
            if let Some(QueueRoute::Assigned { blocked, .. }) = uri_str(&ack.uri)
                .and_then(|u| self.queues.get_mut(u))
                .map(|q| &mut q.route)
            {
                *blocked = true;
            }
            return;
        }
        if let Some(pending) = self.pending_puts.remove(&ack.guid) {
            if ack.status == AckStatus::Success as i32 {
                let latency = now.saturating_duration_since(pending.received_at);
                self.outputs.push_back(ProxyOutput::Acked { latency });
            }
            self.reply(ClientMessage {
                kind: Some(Kind::Ack(ack)),
            });
        }
    }

    fn on_open_response(&mut self, resp: OpenQueueResponse) {
        if let Some(q) = self.queues.get_mut(&resp.uri) {
            if let QueueRoute::Proposed { response, .. } = &mut q.route {
                // Sent ahead of the commit: kept until the commit says where the queue is.
                *response = Some(resp);
                q.open_sent_at = None;
                return;
            }
            if let QueueRoute::Assigned { partition, .. } = q.route {
                if partition.0 != resp.partition_id {
                    // The late answer of an open sent ahead to a partition the commit did not
                    // confirm (withdrawn): not the answer to this route's open.
                    return;
                }
            }
            q.open_sent_at = None;
        }
        let code = resp.status.as_ref().map(|s| s.code).unwrap_or(0);
        if let Some(request_id) = self.pending_opens.remove(&resp.uri) {
            let replaced = self
                .queues
                .get_mut(&resp.uri)
                .and_then(|q| q.replaced.take());
            match replaced {
                // A refused change: the queue stays open as it was.
                Some(previous) if code != StatusCode::Ok as i32 => {
                    if let Some(q) = self.queues.get_mut(&resp.uri) {
                        q.request = previous;
                    }
                }
                Some(_) => {}
                None if code != StatusCode::Ok as i32 => {
                    self.queues.remove(&resp.uri);
                }
                None => {}
            }
            self.reply(ClientMessage {
                kind: Some(Kind::OpenQueueResponse(OpenQueueResponse {
                    request_id,
                    ..resp
                })),
            });
        } else if code != StatusCode::Ok as i32 {
            // An internal reopen failed (the primary is not ready yet): try again at the next
            // state change or retransmission tick.
            if let Some(QueueRoute::Assigned { attached, .. }) =
                self.queues.get_mut(&resp.uri).map(|q| &mut q.route)
            {
                *attached = None;
            }
        }
    }

    /// Opens `uri` on its partition's current active primary (if any) and resends its
    /// buffered PUTs there in arrival order.
    fn attach(
        &mut self,
        uri: &str,
        routes: &dyn Fn(PartitionId) -> Option<PrimaryRoute>,
        now: Instant,
    ) {
        let Some(q) = self.queues.get_mut(uri) else {
            return;
        };
        let QueueRoute::Assigned { partition, .. } = q.route else {
            return;
        };
        // Only an ACTIVE (healed) primary serves; a passive one would refuse with NOT_READY.
        let route = routes(partition).filter(|r| r.active);
        q.route = QueueRoute::Assigned {
            partition,
            attached: route.map(|r| (r.primary, r.lease)),
            blocked: false,
        };
        let Some(route) = route else {
            return;
        };
        q.open_sent_at = Some(now);
        let open = q.request.clone();
        self.forward(partition, route.primary, Kind::OpenQueue(open));
        self.resend_buffered(uri, partition, route.primary, now);
    }

    /// The committed state changed: reattach every queue whose primary or lease moved.
    pub fn handle_cluster_change(
        &mut self,
        routes: &dyn Fn(PartitionId) -> Option<PrimaryRoute>,
        now: Instant,
    ) {
        let moved: Vec<String> = self
            .queues
            .iter()
            .filter_map(|(uri, q)| match q.route {
                QueueRoute::Assigned {
                    partition,
                    attached,
                    ..
                } => {
                    let current = routes(partition).map(|r| (r.primary, r.lease));
                    (current != attached).then(|| uri.clone())
                }
                QueueRoute::Resolving | QueueRoute::Proposed { .. } => None,
            })
            .collect();
        for uri in moved {
            info!(%uri, "queue's primary changed: reopening on the new primary");
            self.attach(&uri, routes, now);
        }
    }

    /// A peer link came back (`None`: some did, which is unknown). A primary on the other end
    /// released this session's consumers when the link dropped, and requests sent meanwhile
    /// were lost: reopen every queue attached there and resend its buffered PUTs. With `None`
    /// every peer's link generation is forgotten, and taken afresh at the next PUT there.
    pub fn handle_peer_back(
        &mut self,
        node: Option<NodeId>,
        routes: &dyn Fn(PartitionId) -> Option<PrimaryRoute>,
        now: Instant,
    ) {
        if node.is_none() {
            self.link_generations.clear();
        }
        let self_id = self.self_id;
        let affected: Vec<String> = self
            .queues
            .iter()
            .filter(|(_, q)| {
                q.attached().is_some_and(|(_, primary)| {
                    primary != self_id && node.is_none_or(|n| n == primary)
                })
            })
            .map(|(uri, _)| uri.clone())
            .collect();
        for uri in affected {
            info!(%uri, "link to the primary came back: reopening");
            self.attach(&uri, routes, now);
        }
        // An open sent there ahead of its commit may have been released with the link: the
        // commit opens the queue again, as if no open had been sent ahead.
        for q in self.queues.values_mut() {
            if q.proposed()
                .is_some_and(|(_, primary)| primary != self_id && node.is_none_or(|n| n == primary))
            {
                q.route = QueueRoute::Resolving;
            }
        }
    }

    /// The retransmission tick: reattaches queues whose last open was refused, that are
    /// blocked, or whose open got no answer for the retransmission interval, and resends PUTs
    /// without an answer for it.
    pub fn handle_tick(
        &mut self,
        now: Instant,
        routes: &dyn Fn(PartitionId) -> Option<PrimaryRoute>,
    ) {
        let interval = self.cfg.retransmit_interval;
        // Reattached: queues whose last open was refused, that are blocked, or whose open got
        // no answer for the interval — lost, since a primary answers every open it gets (a
        // second open of the same session's queue only updates it there). An open lost with a
        // peer's data link is sent again when the link comes back (`handle_peer_back`); this
        // is the open's own timeout, for any other loss.
        let mut reattach = Vec::new();
        for (uri, q) in &self.queues {
            let QueueRoute::Assigned {
                attached, blocked, ..
            } = q.route
            else {
                continue;
            };
            let unanswered = attached.is_some()
                && q.open_sent_at
                    .is_some_and(|t| now.saturating_duration_since(t) >= interval);
            if unanswered {
                info!(%uri, "no answer to the open: sending it again");
                self.counters.open_retransmissions += 1;
            }
            if attached.is_none() || blocked || unanswered {
                reattach.push(uri.clone());
            }
        }
        for uri in reattach {
            self.attach(&uri, routes, now);
        }
        let mut resend = Vec::new();
        for pending in self.pending_puts.values_mut() {
            if pending
                .sent_at
                .is_some_and(|t| now.saturating_duration_since(t) < interval)
            {
                continue;
            }
            let Some((partition, primary)) = uri_str(&pending.put.uri)
                .and_then(|u| self.queues.get(u))
                .and_then(|q| q.attached())
            else {
                continue;
            };
            pending.sent_at = Some(now);
            resend.push((partition, primary, pending.put.clone()));
        }
        for (partition, primary, put) in resend {
            self.counters.retransmissions += 1;
            self.forward(partition, primary, Kind::Put(put));
        }
    }
}

#[cfg(test)]
#[path = "proxy_tests.rs"]
mod tests;
