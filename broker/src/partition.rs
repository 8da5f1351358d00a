//! `PartitionActor`: the primary's side of one partition (DESIGN.md §7).
//!
//! Runs on the node that is the partition's primary, for one `primary_lease_id`; the
//! [`DataPlane`] starts it when the committed state names this node primary and drops it when
//! the partition moves away (step down to replica). It owns the partition's queues
//! ([`QueueCore`], priority mode) and:
//! - receives `PartitionRequest { key, message }`: OpenQueue, Put, Confirm, CloseQueue from a
//!   session (local or proxied, identified by its [`ConsumerKey`]);
//! - receives `PartitionSessionGone` / `PartitionNodeGone`: release those consumers, whose
//!   unconfirmed messages are redelivered with an incremented delivery attempt;
//! - sends OpenQueueResponse, Ack and Push back through the router.
//!
//! Messages are held in memory on the primary only and ACKed once stored; replicated journals
//! with quorum ACKs are the next step of DESIGN.md §7. Duplicate PUTs (same GUID, resent by a
//! proxy after a failover or a retransmission timeout) are ACKed again but stored once, within
//! a bounded window of recent GUIDs.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, Context, Handler, Message, MessageResult};
use bmq_proto::client::{
    client_message::Kind, Ack, AckStatus, ClientMessage, CloseQueueResponse, OpenQueueResponse,
    Push, Status, StatusCode,
};
use bmq_proto::{NodeId, PartitionId};
use bytes::Bytes;
use tracing::debug;

use crate::dataplane::DataPlane;
use crate::queue::{ConsumerKey, ConsumerOptions, PutOutcome, QueueCore, QueueLimits};
use crate::uri::QueueUri;

/// Mailbox capacity of a partition actor, messages; a full mailbox answers "overloaded".
pub const PARTITION_MAILBOX_CAPACITY: usize = 65_536;

/// How many recent PUT GUIDs a partition remembers to drop duplicates.
const GUID_WINDOW_MAX: usize = 1_000_000;
/// How long a PUT GUID is remembered.
const GUID_WINDOW_AGE: Duration = Duration::from_secs(300);

/// A client request routed to this partition.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PartitionRequest {
    /// The session that sent it.
    pub key: ConsumerKey,
    /// OpenQueue, Put, Confirm or CloseQueue.
    pub message: ClientMessage,
}

/// A session ended: release its consumers.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PartitionSessionGone {
    /// The session.
    pub key: ConsumerKey,
}

/// A proxy node became unavailable: release every consumer it carried.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PartitionNodeGone {
    /// The node.
    pub node: NodeId,
}

/// Asks for the partition's counters (for `/status`).
#[derive(Message)]
#[rtype(result = "PartitionStats")]
pub struct GetPartitionStats;

/// What `/status` shows of a partition on its primary.
#[derive(Debug, Clone, Default)]
pub struct PartitionStats {
    /// Messages held (not yet confirmed), all queues.
    pub messages: u64,
    /// Messages pushed and not yet confirmed, all queues.
    pub unconfirmed: u64,
    /// Queues open on this partition.
    pub queues: usize,
}

/// Recently seen PUT GUIDs, bounded by count and age.
#[derive(Default)]
struct GuidWindow {
    order: VecDeque<(Instant, Bytes)>,
    seen: HashSet<Bytes>,
}

impl GuidWindow {
    /// Whether `guid` is in the window (after expiring what is too old at `now`).
    fn contains(&mut self, now: Instant, guid: &Bytes) -> bool {
        while let Some((t, g)) = self.order.front() {
            if self.order.len() < GUID_WINDOW_MAX && now.duration_since(*t) < GUID_WINDOW_AGE {
                break;
            }
            self.seen.remove(g);
            self.order.pop_front();
        }
        self.seen.contains(guid)
    }

    /// Records a stored message's `guid`.
    fn insert(&mut self, now: Instant, guid: &Bytes) {
        if self.seen.insert(guid.clone()) {
            self.order.push_back((now, guid.clone()));
        }
    }
}

/// The primary's side of one partition (see the module doc).
pub struct PartitionActor {
    id: PartitionId,
    lease: u64,
    router: Arc<DataPlane>,
    queues: HashMap<String, QueueCore>,
    recent_guids: GuidWindow,
}

impl PartitionActor {
    /// A partition actor for `id` at `primary_lease_id` = `lease`.
    pub fn new(id: PartitionId, lease: u64, router: Arc<DataPlane>) -> Self {
        PartitionActor {
            id,
            lease,
            router,
            queues: HashMap::new(),
            recent_guids: GuidWindow::default(),
        }
    }

    fn queue_limits(&self, uri: &str) -> Option<QueueLimits> {
        let parsed = QueueUri::parse(uri).ok()?;
        let domain = self.router.config.domain(&parsed.domain)?;
        Some(QueueLimits {
            max_messages: domain.max_queue_messages,
            max_bytes: domain.max_queue_bytes,
            max_delivery_attempts: domain.max_delivery_attempts,
            message_ttl: (domain.message_ttl_ms > 0)
                .then(|| Duration::from_millis(domain.message_ttl_ms)),
        })
    }

    fn reply(&self, key: ConsumerKey, kind: Kind) {
        self.router
            .to_session(key, ClientMessage { kind: Some(kind) });
    }

    /// Pushes whatever `uri`'s queue can deliver now.
    fn deliver(&mut self, uri: &str) {
        let now = Instant::now();
        let Some(queue) = self.queues.get_mut(uri) else {
            return;
        };
        while let Some(d) = queue.poll_delivery(now) {
            metrics::counter!("bmq_queue_push_total").increment(1);
            if d.delivery_attempt > 1 {
                metrics::counter!("bmq_queue_redeliveries_total").increment(1);
            }
            let push = Push {
                uri: uri.to_string(),
                guid: d.guid,
                payload: d.payload,
                properties: d.properties,
                delivery_attempt: d.delivery_attempt,
            };
            // A push that cannot be handed over stays unconfirmed and is redelivered when its
            // consumer goes away: at-least-once.
            self.router.to_session(
                d.consumer,
                ClientMessage {
                    kind: Some(Kind::Push(push)),
                },
            );
        }
    }

    fn deliver_all(&mut self) {
        let uris: Vec<String> = self.queues.keys().cloned().collect();
        for uri in uris {
            self.deliver(&uri);
        }
    }

    fn status(code: StatusCode, message: &str) -> Option<Status> {
        Some(Status {
            code: code as i32,
            message: message.to_string(),
        })
    }
}

impl Actor for PartitionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(PARTITION_MAILBOX_CAPACITY);
        debug!(partition = %self.id, lease = self.lease, "partition actor started");
    }
}

impl Handler<PartitionRequest> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionRequest, _ctx: &mut Self::Context) {
        let key = msg.key;
        match msg.message.kind {
            Some(Kind::OpenQueue(open)) => {
                let Some(limits) = self.queue_limits(&open.uri) else {
                    self.reply(
                        key,
                        Kind::OpenQueueResponse(OpenQueueResponse {
                            request_id: open.request_id,
                            uri: open.uri,
                            status: Self::status(
                                StatusCode::UnknownDomain,
                                "unknown domain or invalid uri",
                            ),
                            partition_id: self.id.0,
                        }),
                    );
                    return;
                };
                let queue = self
                    .queues
                    .entry(open.uri.clone())
                    .or_insert_with(|| QueueCore::new(open.uri.clone(), limits));
                if open.read {
                    let c = open.consumer.unwrap_or_default();
                    let limits = &self.router.config.limits;
                    queue.add_consumer(
                        key,
                        ConsumerOptions {
                            priority: c.priority,
                            max_unconfirmed_messages: if c.max_unconfirmed_messages == 0 {
                                u32::try_from(limits.max_unconfirmed_messages_default)
                                    .unwrap_or(u32::MAX)
                            } else {
                                c.max_unconfirmed_messages
                            },
                            max_unconfirmed_bytes: if c.max_unconfirmed_bytes == 0 {
                                limits.max_unconfirmed_bytes_default
                            } else {
                                c.max_unconfirmed_bytes
                            },
                        },
                    );
                }
                self.reply(
                    key,
                    Kind::OpenQueueResponse(OpenQueueResponse {
                        request_id: open.request_id,
                        uri: open.uri.clone(),
                        status: Self::status(StatusCode::Ok, ""),
                        partition_id: self.id.0,
                    }),
                );
                self.deliver(&open.uri);
            }
            Some(Kind::Put(put)) => {
                metrics::counter!("bmq_queue_put_total").increment(1);
                let now = Instant::now();
                let (status, message) = if self.recent_guids.contains(now, &put.guid) {
                    metrics::counter!("bmq_queue_put_duplicates_total").increment(1);
                    (AckStatus::Success, String::new())
                } else {
                    let queue = match self.queues.get_mut(&put.uri) {
                        Some(q) => q,
                        None => match self.queue_limits(&put.uri) {
                            Some(limits) => self
                                .queues
                                .entry(put.uri.clone())
                                .or_insert_with(|| QueueCore::new(put.uri.clone(), limits)),
                            None => {
                                metrics::counter!("bmq_queue_nack_total", "reason" => "unknown_queue").increment(1);
                                self.reply(
                                    key,
                                    Kind::Ack(Ack {
                                        uri: put.uri,
                                        guid: put.guid,
                                        status: AckStatus::UnknownQueue as i32,
                                        message: "unknown domain or invalid uri".into(),
                                    }),
                                );
                                return;
                            }
                        },
                    };
                    match queue.put(now, put.guid.clone(), put.payload, put.properties) {
                        PutOutcome::Accepted => {
                            self.recent_guids.insert(now, &put.guid);
                            (AckStatus::Success, String::new())
                        }
                        PutOutcome::Duplicate => (AckStatus::Success, String::new()),
                        PutOutcome::Refused { status, reason } => {
                            metrics::counter!("bmq_queue_nack_total", "reason" => "limit_reached")
                                .increment(1);
                            (status, reason)
                        }
                    }
                };
                if status == AckStatus::Success {
                    metrics::counter!("bmq_queue_ack_total").increment(1);
                }
                let uri = put.uri.clone();
                self.reply(
                    key,
                    Kind::Ack(Ack {
                        uri: put.uri,
                        guid: put.guid,
                        status: status as i32,
                        message,
                    }),
                );
                self.deliver(&uri);
            }
            Some(Kind::Confirm(confirm)) => {
                if let Some(queue) = self.queues.get_mut(&confirm.uri) {
                    if queue.confirm(key, &confirm.guid) {
                        metrics::counter!("bmq_queue_confirm_total").increment(1);
                    }
                }
                self.deliver(&confirm.uri);
            }
            Some(Kind::CloseQueue(close)) => {
                if let Some(queue) = self.queues.get_mut(&close.uri) {
                    queue.remove_consumer(key);
                }
                self.reply(
                    key,
                    Kind::CloseQueueResponse(CloseQueueResponse {
                        request_id: close.request_id,
                        uri: close.uri.clone(),
                        status: Self::status(StatusCode::Ok, ""),
                    }),
                );
                self.deliver(&close.uri);
            }
            _ => {
                metrics::counter!("bmq_partition_invalid_requests_total").increment(1);
            }
        }
    }
}

impl Handler<PartitionSessionGone> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionSessionGone, _ctx: &mut Self::Context) {
        for queue in self.queues.values_mut() {
            queue.remove_consumer(msg.key);
        }
        self.deliver_all();
    }
}

impl Handler<PartitionNodeGone> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionNodeGone, _ctx: &mut Self::Context) {
        for queue in self.queues.values_mut() {
            queue.remove_consumers_of_node(msg.node);
        }
        self.deliver_all();
    }
}

impl Handler<GetPartitionStats> for PartitionActor {
    type Result = MessageResult<GetPartitionStats>;

    fn handle(&mut self, _msg: GetPartitionStats, _ctx: &mut Self::Context) -> Self::Result {
        let mut stats = PartitionStats {
            queues: self.queues.len(),
            ..Default::default()
        };
        for q in self.queues.values() {
            stats.messages += q.depth() as u64;
            stats.unconfirmed += q.unconfirmed() as u64;
        }
        metrics::gauge!("bmq_partition_messages", "partition" => self.id.to_string())
            .set(stats.messages as f64);
        MessageResult(stats)
    }
}
