//! `PartitionActor`: one partition on one node, primary or replica (DESIGN.md §7).
//!
//! Every node runs one actor per partition; the [`DataPlane`] starts it with the partition's
//! journal (`<data_dir>/partitions/<id>/`) and tells it the committed primary and lease on
//! every commit. The replication protocol — quorum receipts, healing, truncation, duplicate
//! GUIDs — is the pure [`ReplicationCore`]; this actor writes the journal, sends the core's
//! messages, and, while this node is the *active* primary, runs the partition's queues
//! ([`QueueCore`], priority mode), rebuilt from the journal when it becomes active. A queue of
//! a fanout domain is one `QueueCore` per app id (key `uri#app`), each with its own copy of
//! every message; a consumer names its app id. A queue of a broadcast domain stores nothing: a
//! PUT is pushed to the consumers attached at that moment and ACKed at once (at-most-once).
//!
//! - Receives `PartitionRequest { key, message }` (OpenQueue, Put, Confirm, CloseQueue from a
//!   session, local or proxied); answers `NOT_READY` unless it is the active primary, so the
//!   proxy keeps PUTs buffered and reopens later. `PartitionSessionGone` /
//!   `PartitionNodeGone` release consumers (their unconfirmed messages are redelivered with an
//!   incremented delivery attempt). `PartitionPeerMessage` carries replication traffic,
//!   `PartitionRoleChanged` the committed primary, lease and status (a node no longer primary
//!   steps down to replica, it does not exit). A primary that finished healing announces it
//!   (`PrimaryActiveNotice` to every node; the leader commits `PrimaryStatusAdvisory
//!   { ACTIVE }`), every `ANNOUNCE_PERIOD` until the commit shows.
//! - Sends OpenQueueResponse, Ack and Push through the router, replication messages over the
//!   peer DATA channel.
//! - Journal: a PUT, a delivery (with its attempt number) and a confirm are each a record.
//!   Outputs are written in order; the fsync is a `FlushJournal` the actor sends itself, so
//!   every request already in the mailbox is written first (group commit), then
//!   `on_persisted`. A
//!   journal write or fsync failure stops the node (never retry an fsync).
//! - Timer: one, re-armed from the core's `poll_timeout` after every input.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use actix::{Actor, AsyncContext, Context, Handler, Message, MessageResult};
use bmq_proto::client::{
    client_message::Kind, Ack, AckStatus, ClientMessage, CloseQueueResponse, OpenQueueResponse,
    Push, Status, StatusCode,
};
use bmq_proto::peer::{
    journal_record::Kind as RecordKind, peer_message::Kind as PeerKind, Channel, PartitionMessage,
    PeerMessage, StoredConfirm, StoredDelivery,
};
use bmq_proto::{NodeId, PartitionId};
use bytes::Bytes;
use tracing::{debug, error, info};

use crate::config::{Consistency, DomainMode};
use crate::dataplane::DataPlane;
use crate::journal::Journal;
use crate::queue::{ConsumerKey, ConsumerOptions, PutOutcome, QueueCore, QueueLimits};
use crate::replication::{Output, PrimaryPhase, PutResult, ReplicationConfig, ReplicationCore};
use crate::uri::QueueUri;

/// Mailbox capacity of a partition actor, messages; a full mailbox answers "overloaded".
pub const PARTITION_MAILBOX_CAPACITY: usize = 65_536;
/// Size at which a journal segment is closed and a new one started, bytes.
pub const JOURNAL_SEGMENT_SIZE_MAX: u64 = 64 * 1024 * 1024;

/// How often a healed primary repeats its ACTIVE notice until it is committed.
const ANNOUNCE_PERIOD: Duration = Duration::from_millis(500);

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

/// Replication traffic from a peer.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PartitionPeerMessage {
    /// The sender.
    pub from: NodeId,
    /// The message.
    pub message: PartitionMessage,
}

/// The committed cluster state names `primary` at `lease` for this partition.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PartitionRoleChanged {
    /// The primary, if any.
    pub primary: Option<NodeId>,
    /// Its `primary_lease_id`.
    pub lease: u64,
    /// Whether the committed status is ACTIVE.
    pub active: bool,
}

/// Sent by the actor to itself: fsync what was written (group commit).
#[derive(Message)]
#[rtype(result = "()")]
struct FlushJournal;

/// Asks for the partition's counters (for `/status`).
#[derive(Message)]
#[rtype(result = "PartitionStats")]
pub struct GetPartitionStats;

/// What `/status` shows of a partition on this node.
#[derive(Debug, Clone, Default)]
pub struct PartitionStats {
    /// Messages held (not yet confirmed), all queues (active primary only).
    pub messages: u64,
    /// Messages pushed and not yet confirmed, all queues (active primary only).
    pub unconfirmed: u64,
    /// Queues open on this partition (active primary only).
    pub queues: usize,
    /// `replica`, or the primary's phase: `collecting`, `pulling`, `syncing`, `active`.
    pub role: String,
    /// Last journal sequence held.
    pub last_sequence: u64,
}

/// One partition on this node (see the module doc).
pub struct PartitionActor {
    id: PartitionId,
    router: Arc<DataPlane>,
    core: ReplicationCore,
    journal: Journal,
    queues: HashMap<String, QueueCore>,
    /// When the pending timer fires, if one is pending.
    timer_at: Option<Instant>,
    /// A `FlushJournal` is in the mailbox.
    flush_queued: bool,
    /// The lease this node healed and announces ACTIVE for, until the commit shows it.
    announcing: Option<u64>,
    /// A journal write or fsync failed: the node is stopping; nothing more is written or sent.
    failed: bool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl PartitionActor {
    /// Opens the journal of partition `id` under `<data_dir>/partitions/<id>` and builds the
    /// actor. Errors name the journal file (and offset, for corruption).
    pub fn open(
        id: PartitionId,
        router: Arc<DataPlane>,
    ) -> Result<Self, crate::journal::JournalError> {
        let dir = router
            .config
            .data_dir
            .join("partitions")
            .join(id.0.to_string());
        let (journal, records) = Journal::open(&dir, JOURNAL_SEGMENT_SIZE_MAX)?;
        info!(partition = %id, records = records.len(), bytes = journal.bytes(), "partition journal recovered");
        let members: Vec<NodeId> = router.config.members.iter().map(|m| NodeId(m.id)).collect();
        let quorum = members.len() / 2 + 1;
        let cfg = ReplicationConfig {
            self_id: router.self_id,
            partition: id,
            members,
            quorum,
            batch_records_max: 256,
            in_flight_records_max: 8192,
            resend_after: Duration::from_millis(500),
            guid_window_max: usize::try_from(router.config.limits.duplicate_guid_window_max)
                .unwrap_or(usize::MAX),
            guid_window_age: Duration::from_millis(router.config.limits.duplicate_guid_window_ms),
        };
        Ok(PartitionActor {
            id,
            router,
            core: ReplicationCore::new(cfg, records),
            journal,
            queues: HashMap::new(),
            timer_at: None,
            flush_queued: false,
            announcing: None,
            failed: false,
        })
    }

    /// The keys of `uri`'s queues in `self.queues`: `uri` itself, or in a fanout domain one
    /// per app id (`uri#app`), each holding that app's copy of every message.
    fn queue_keys(&self, uri: &str) -> Vec<String> {
        let domain = QueueUri::parse(uri)
            .ok()
            .and_then(|u| self.router.config.domain(&u.domain).cloned());
        match domain {
            Some(d) if d.mode == DomainMode::Fanout => {
                d.app_ids.iter().map(|a| app_key(uri, a)).collect()
            }
            _ => vec![uri.to_string()],
        }
    }

    /// Whether `uri`'s domain is in broadcast mode.
    fn is_broadcast(&self, uri: &str) -> bool {
        QueueUri::parse(uri)
            .ok()
            .and_then(|u| self.router.config.domain(&u.domain).map(|d| d.mode))
            == Some(DomainMode::Broadcast)
    }

    /// Broadcast mode: pushes `put` to every consumer attached now and ACKs it; nothing is
    /// stored (at-most-once, DESIGN.md §7).
    fn broadcast(&mut self, key: ConsumerKey, limits: QueueLimits, put: bmq_proto::client::Put) {
        let queue = self
            .queues
            .entry(put.uri.clone())
            .or_insert_with(|| QueueCore::new(put.uri.clone(), limits));
        for consumer in queue.consumer_keys() {
            metrics::counter!("bmq_queue_push_total").increment(1);
            self.router.to_session(
                consumer,
                ClientMessage {
                    kind: Some(Kind::Push(Push {
                        uri: put.uri.clone(),
                        guid: put.guid.clone(),
                        payload: put.payload.clone(),
                        properties: put.properties.clone(),
                        delivery_attempt: 1,
                    })),
                },
            );
        }
        metrics::counter!("bmq_queue_ack_total").increment(1);
        self.reply(
            key,
            Kind::Ack(Ack {
                uri: put.uri,
                guid: put.guid,
                status: AckStatus::Success as i32,
                message: String::new(),
            }),
        );
    }

    fn queue_limits(&self, uri: &str) -> Option<(QueueLimits, bool)> {
        let parsed = QueueUri::parse(uri).ok()?;
        let domain = self.router.config.domain(&parsed.domain)?;
        Some((
            QueueLimits {
                max_messages: domain.max_queue_messages,
                max_bytes: domain.max_queue_bytes,
                max_delivery_attempts: domain.max_delivery_attempts,
                message_ttl: (domain.message_ttl_ms > 0)
                    .then(|| Duration::from_millis(domain.message_ttl_ms)),
            },
            domain.consistency == Consistency::Strong,
        ))
    }

    fn reply(&self, key: ConsumerKey, kind: Kind) {
        self.router
            .to_session(key, ClientMessage { kind: Some(kind) });
    }

    /// Executes the core's outputs: journal writes, sends, ACKs. The writes of one drain are
    /// fsynced together, and only then does the core hear `on_persisted`.
    fn drive(&mut self, ctx: &mut Context<Self>) {
        if self.failed {
            return;
        }
        let mut wrote = false;
        while let Some(output) = self.core.poll_output() {
            match output {
                Output::Persist {
                    truncate_after,
                    records,
                } => {
                    let result = match truncate_after {
                        Some(t) => self.journal.truncate_after(t),
                        None => Ok(()),
                    }
                    .and_then(|_| self.journal.append(&records));
                    if let Err(e) = result {
                        self.fatal(&e);
                        return;
                    }
                    wrote = true;
                }
                Output::Send { to, message } => {
                    self.router.peers.send(
                        to,
                        Channel::Data,
                        PeerMessage {
                            kind: Some(PeerKind::Partition(message)),
                        },
                    );
                }
                Output::Ack {
                    producer,
                    uri,
                    guid,
                } => {
                    metrics::counter!("bmq_queue_ack_total").increment(1);
                    self.reply(
                        producer,
                        Kind::Ack(Ack {
                            uri,
                            guid,
                            status: AckStatus::Success as i32,
                            message: String::new(),
                        }),
                    );
                }
                Output::Active { lease } => {
                    self.rebuild_queues();
                    info!(partition = %self.id, lease, last_sequence = self.core.last_sequence(), queues = self.queues.len(), "partition primary healed: active");
                    metrics::gauge!("bmq_partition_primary_active", "partition" => self.id.to_string()).set(1.0);
                    self.deliver_all();
                    self.announcing = Some(lease);
                    self.router.announce_primary_active(self.id, lease);
                }
            }
        }
        if wrote && !self.flush_queued {
            // Group commit: the flush goes to the back of the mailbox, so every request
            // already waiting is written before the one fsync. A full mailbox flushes now.
            if ctx.address().try_send(FlushJournal).is_ok() {
                self.flush_queued = true;
            } else {
                self.flush(ctx);
                return;
            }
        }
        // Arm the timer only when none is pending for an earlier time: cancelling actix
        // futures on every message starves them while the mailbox stays busy.
        if let Some(at) = self.core.poll_timeout() {
            if self.timer_at.is_none_or(|t| at < t) {
                self.timer_at = Some(at);
                let wait = at.saturating_duration_since(Instant::now());
                ctx.run_later(wait, |actor, ctx| {
                    actor.timer_at = None;
                    actor.core.handle_timeout(Instant::now());
                    actor.report_lag();
                    actor.drive(ctx);
                });
            }
        }
    }

    /// Primary only: records the slowest replica is behind, as a gauge.
    fn report_lag(&self) {
        if self.core.phase().is_none() {
            return;
        }
        let last = self.core.last_sequence();
        let slowest = self
            .core
            .replica_receipts()
            .iter()
            .map(|(_, r)| *r)
            .min()
            .unwrap_or(last);
        metrics::gauge!("bmq_partition_replication_lag_records", "partition" => self.id.to_string())
            .set(last.saturating_sub(slowest) as f64);
        metrics::gauge!("bmq_partition_committed_sequence", "partition" => self.id.to_string())
            .set(self.core.committed() as f64);
    }

    /// fsyncs what was written, then tells the core (which may release receipts and ACKs).
    fn flush(&mut self, ctx: &mut Context<Self>) {
        self.flush_queued = false;
        if self.failed {
            return;
        }
        if let Err(e) = self.journal.sync() {
            self.fatal(&e);
            return;
        }
        metrics::gauge!("bmq_journal_bytes", "partition" => self.id.to_string())
            .set(self.journal.bytes() as f64);
        self.core
            .on_persisted(Instant::now(), self.journal.last_sequence());
        self.drive(ctx);
    }

    fn fatal(&mut self, e: &crate::journal::JournalError) {
        self.failed = true;
        error!(partition = %self.id, error = %e, "journal write failed: stopping the node");
        actix::System::current().stop_with_code(1);
    }

    /// Rebuilds the queues from the journal: messages not confirmed, with their delivery
    /// counts, in journal order.
    fn rebuild_queues(&mut self) {
        let layouts: HashMap<String, Option<(QueueLimits, Vec<String>)>> = self
            .core
            .records()
            .iter()
            .filter_map(|r| match &r.kind {
                Some(RecordKind::Message(m)) => Some(m.uri.clone()),
                _ => None,
            })
            .collect::<HashSet<String>>()
            .into_iter()
            .map(|uri| {
                let layout = self
                    .queue_limits(&uri)
                    .map(|(limits, _)| (limits, self.queue_keys(&uri)));
                (uri, layout)
            })
            .collect();
        self.queues = rebuild_queues(self.core.records(), Instant::now(), |uri| {
            layouts.get(uri).cloned().flatten()
        });
    }

    fn append_record(&mut self, kind: RecordKind) {
        self.core.handle_record(Instant::now(), kind, now_ms());
    }

    /// Pushes whatever `uri`'s queue can deliver now, journaling each delivery.
    fn deliver(&mut self, uri: &str) {
        for key in self.queue_keys(uri) {
            self.deliver_key(&key);
        }
    }

    /// Pushes whatever the queue at `key` (see `queue_keys`) can deliver now.
    fn deliver_key(&mut self, key: &str) {
        let now = Instant::now();
        let (uri, app_id) = split_key(key);
        let Some(queue) = self.queues.get_mut(key) else {
            return;
        };
        let mut deliveries = Vec::new();
        while let Some(d) = queue.poll_delivery(now) {
            deliveries.push(d);
        }
        for d in deliveries {
            metrics::counter!("bmq_queue_push_total").increment(1);
            if d.delivery_attempt > 1 {
                metrics::counter!("bmq_queue_redeliveries_total").increment(1);
            }
            self.append_record(RecordKind::Delivery(StoredDelivery {
                uri: uri.to_string(),
                guid: d.guid.clone(),
                attempt: d.delivery_attempt,
                app_id: app_id.to_string(),
            }));
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
        let keys: Vec<String> = self.queues.keys().cloned().collect();
        for key in keys {
            self.deliver_key(&key);
        }
    }

    fn status(code: StatusCode, message: &str) -> Option<Status> {
        Some(Status {
            code: code as i32,
            message: message.to_string(),
        })
    }

    fn not_ready(&self, key: ConsumerKey, message: &ClientMessage) {
        let reason = "this node is not the partition's active primary";
        match &message.kind {
            Some(Kind::OpenQueue(o)) => self.reply(
                key,
                Kind::OpenQueueResponse(OpenQueueResponse {
                    request_id: o.request_id,
                    uri: o.uri.clone(),
                    status: Self::status(StatusCode::NotReady, reason),
                    partition_id: self.id.0,
                }),
            ),
            Some(Kind::Put(p)) => self.reply(
                key,
                Kind::Ack(Ack {
                    uri: p.uri.clone(),
                    guid: p.guid.clone(),
                    status: AckStatus::NotReady as i32,
                    message: reason.into(),
                }),
            ),
            _ => {}
        }
    }

    fn handle_request(&mut self, key: ConsumerKey, message: ClientMessage) {
        if !self.core.is_active_primary() {
            self.not_ready(key, &message);
            return;
        }
        match message.kind {
            Some(Kind::OpenQueue(open)) => {
                let Some((limits, _)) = self.queue_limits(&open.uri) else {
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
                let keys = self.queue_keys(&open.uri);
                for k in &keys {
                    self.queues
                        .entry(k.clone())
                        .or_insert_with(|| QueueCore::new(k.clone(), limits));
                }
                if open.read {
                    let c = open.consumer.clone().unwrap_or_default();
                    let target = if keys.len() == 1 && keys[0] == open.uri {
                        open.uri.clone()
                    } else {
                        app_key(&open.uri, &c.app_id)
                    };
                    let known = keys.contains(&target);
                    let Some(queue) = self.queues.get_mut(&target).filter(|_| known) else {
                        self.reply(
                            key,
                            Kind::OpenQueueResponse(OpenQueueResponse {
                                request_id: open.request_id,
                                uri: open.uri,
                                status: Self::status(
                                    StatusCode::Refused,
                                    &format!(
                                        "app id {:?} is not one of this fanout domain's app ids",
                                        c.app_id
                                    ),
                                ),
                                partition_id: self.id.0,
                            }),
                        );
                        return;
                    };
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
                let Some((limits, strong)) = self.queue_limits(&put.uri) else {
                    metrics::counter!("bmq_queue_nack_total", "reason" => "unknown_queue")
                        .increment(1);
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
                };
                let uri = put.uri.clone();
                if self.is_broadcast(&uri) {
                    self.broadcast(key, limits, put);
                    return;
                }
                if self.core.is_duplicate(now, &put.guid) {
                    // Resent by a proxy: ACKed with the stored copy, not stored again.
                    metrics::counter!("bmq_queue_put_duplicates_total").increment(1);
                    self.core.handle_put(
                        now,
                        key,
                        put.uri,
                        put.guid,
                        put.payload,
                        put.properties,
                        strong,
                        0,
                    );
                    return;
                }
                // One copy per app id in a fanout domain, else one. A refusal by any copy
                // NACKs the PUT (copies already taken stay: at-least-once, never lost).
                let mut outcome = PutOutcome::Duplicate;
                for k in self.queue_keys(&uri) {
                    let queue = self
                        .queues
                        .entry(k.clone())
                        .or_insert_with(|| QueueCore::new(k.clone(), limits));
                    match queue.put(
                        now,
                        put.guid.clone(),
                        put.payload.clone(),
                        put.properties.clone(),
                    ) {
                        PutOutcome::Duplicate => {}
                        PutOutcome::Accepted => {
                            if outcome == PutOutcome::Duplicate {
                                outcome = PutOutcome::Accepted;
                            }
                        }
                        refused @ PutOutcome::Refused { .. } => {
                            outcome = refused;
                            break;
                        }
                    }
                }
                match outcome {
                    PutOutcome::Accepted => {
                        let r = self.core.handle_put(
                            now,
                            key,
                            put.uri,
                            put.guid,
                            put.payload,
                            put.properties,
                            strong,
                            now_ms(),
                        );
                        debug_assert!(matches!(r, PutResult::Appended { .. }));
                    }
                    PutOutcome::Duplicate => {
                        // Held by the queue but older than the GUID window: already stored.
                        metrics::counter!("bmq_queue_put_duplicates_total").increment(1);
                        self.reply(
                            key,
                            Kind::Ack(Ack {
                                uri: put.uri,
                                guid: put.guid,
                                status: AckStatus::Success as i32,
                                message: String::new(),
                            }),
                        );
                    }
                    PutOutcome::Refused { status, reason } => {
                        metrics::counter!("bmq_queue_nack_total", "reason" => "limit_reached")
                            .increment(1);
                        self.reply(
                            key,
                            Kind::Ack(Ack {
                                uri: put.uri,
                                guid: put.guid,
                                status: status as i32,
                                message: reason,
                            }),
                        );
                    }
                }
                self.deliver(&uri);
            }
            Some(Kind::Confirm(confirm)) => {
                let keys = self.queue_keys(&confirm.uri);
                let confirmed = keys.into_iter().find(|k| {
                    self.queues
                        .get_mut(k)
                        .is_some_and(|q| q.confirm(key, &confirm.guid))
                });
                if let Some(k) = confirmed {
                    metrics::counter!("bmq_queue_confirm_total").increment(1);
                    self.append_record(RecordKind::Confirm(StoredConfirm {
                        uri: confirm.uri.clone(),
                        guid: confirm.guid,
                        app_id: split_key(&k).1.to_string(),
                    }));
                }
                self.deliver(&confirm.uri);
            }
            Some(Kind::CloseQueue(close)) => {
                for k in self.queue_keys(&close.uri) {
                    if let Some(queue) = self.queues.get_mut(&k) {
                        queue.remove_consumer(key);
                    }
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

/// Rebuilds a partition's queues from its journal (a new primary going active): every message
/// not confirmed, in journal order, with the deliveries already made (so its next push carries
/// the next attempt number), one copy per queue key that `layout(uri)` names (the URI itself,
/// or `uri#app` per app id in fanout domains) with that domain's limits. Messages of a URI
/// without a layout (a domain no longer configured) are skipped.
pub fn rebuild_queues(
    records: &[bmq_proto::peer::JournalRecord],
    now: Instant,
    layout: impl Fn(&str) -> Option<(QueueLimits, Vec<String>)>,
) -> HashMap<String, QueueCore> {
    // Keyed by queue key and GUID.
    let mut confirmed: HashSet<(String, &Bytes)> = HashSet::new();
    let mut attempts: HashMap<(String, &Bytes), u32> = HashMap::new();
    for r in records {
        match &r.kind {
            Some(RecordKind::Confirm(c)) => {
                confirmed.insert((app_key(&c.uri, &c.app_id), &c.guid));
            }
            Some(RecordKind::Delivery(d)) => {
                let a = attempts
                    .entry((app_key(&d.uri, &d.app_id), &d.guid))
                    .or_default();
                *a = (*a).max(d.attempt);
            }
            _ => {}
        }
    }
    let mut rebuilt: HashMap<String, QueueCore> = HashMap::new();
    for r in records {
        let Some(RecordKind::Message(m)) = &r.kind else {
            continue;
        };
        let Some((limits, keys)) = layout(&m.uri) else {
            continue;
        };
        for key in keys {
            let id = (key.clone(), &m.guid);
            if confirmed.contains(&id) {
                continue;
            }
            let deliveries = attempts.get(&id).copied().unwrap_or(0);
            rebuilt
                .entry(key.clone())
                .or_insert_with(|| QueueCore::new(key.clone(), limits))
                .restore(
                    now,
                    m.guid.clone(),
                    m.payload.clone(),
                    m.properties.clone(),
                    deliveries,
                );
        }
    }
    rebuilt
}

/// The key of `uri`'s queue for `app_id` (fanout), or of `uri` itself when `app_id` is empty.
/// `#` cannot appear in a queue URI, so keys never collide.
fn app_key(uri: &str, app_id: &str) -> String {
    if app_id.is_empty() {
        uri.to_string()
    } else {
        format!("{uri}#{app_id}")
    }
}

/// `(uri, app id)` of a queue key (`""` when not fanout).
fn split_key(key: &str) -> (&str, &str) {
    key.split_once('#').unwrap_or((key, ""))
}

impl Actor for PartitionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(PARTITION_MAILBOX_CAPACITY);
        // Resend the ACTIVE notice until the leader has committed it.
        ctx.run_interval(ANNOUNCE_PERIOD, |actor, _ctx| {
            if let Some(lease) = actor.announcing {
                if actor.core.is_active_primary() && actor.core.lease() == lease {
                    actor.router.announce_primary_active(actor.id, lease);
                } else {
                    actor.announcing = None;
                }
            }
        });
        debug!(partition = %self.id, "partition actor started");
    }
}

impl Handler<PartitionRequest> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionRequest, ctx: &mut Self::Context) {
        self.handle_request(msg.key, msg.message);
        self.drive(ctx);
    }
}

impl Handler<PartitionSessionGone> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionSessionGone, ctx: &mut Self::Context) {
        for queue in self.queues.values_mut() {
            queue.remove_consumer(msg.key);
        }
        self.deliver_all();
        self.drive(ctx);
    }
}

impl Handler<PartitionNodeGone> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionNodeGone, ctx: &mut Self::Context) {
        for queue in self.queues.values_mut() {
            queue.remove_consumers_of_node(msg.node);
        }
        self.deliver_all();
        self.drive(ctx);
    }
}

impl Handler<PartitionPeerMessage> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionPeerMessage, ctx: &mut Self::Context) {
        self.core
            .handle_message(Instant::now(), msg.from, msg.message);
        if !self.core.is_active_primary() && !self.queues.is_empty() {
            info!(partition = %self.id, lease = self.core.lease(), "a higher lease was seen: stepping down to replica");
            self.queues.clear();
        }
        self.drive(ctx);
    }
}

impl Handler<PartitionRoleChanged> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionRoleChanged, ctx: &mut Self::Context) {
        let was_primary = self.core.phase().is_some();
        self.core
            .handle_role(Instant::now(), msg.primary, msg.lease);
        let is_primary = self.core.phase().is_some();
        if msg.active
            && msg.primary == Some(self.router.self_id)
            && self.announcing == Some(msg.lease)
        {
            self.announcing = None;
        }
        if was_primary && !is_primary {
            info!(partition = %self.id, lease = msg.lease, "no longer primary: stepping down to replica");
            self.queues.clear();
            metrics::gauge!("bmq_partition_primary_active", "partition" => self.id.to_string())
                .set(0.0);
        } else if !was_primary && is_primary {
            info!(partition = %self.id, lease = msg.lease, "became primary: healing");
        }
        metrics::gauge!("bmq_partition_is_primary", "partition" => self.id.to_string())
            .set(if is_primary { 1.0 } else { 0.0 });
        metrics::gauge!("bmq_partition_primary_lease_id", "partition" => self.id.to_string())
            .set(self.core.lease() as f64);
        self.drive(ctx);
    }
}

impl Handler<FlushJournal> for PartitionActor {
    type Result = ();

    fn handle(&mut self, _msg: FlushJournal, ctx: &mut Self::Context) {
        if self.flush_queued {
            self.flush(ctx);
        }
    }
}

impl Handler<GetPartitionStats> for PartitionActor {
    type Result = MessageResult<GetPartitionStats>;

    fn handle(&mut self, _msg: GetPartitionStats, _ctx: &mut Self::Context) -> Self::Result {
        let mut stats = PartitionStats {
            queues: self.queues.len(),
            role: match self.core.phase() {
                None => "replica",
                Some(PrimaryPhase::Collecting) => "collecting",
                Some(PrimaryPhase::Pulling { .. }) => "pulling",
                Some(PrimaryPhase::Syncing) => "syncing",
                Some(PrimaryPhase::Active) => "active",
            }
            .to_string(),
            last_sequence: self.core.last_sequence(),
            ..Default::default()
        };
        for q in self.queues.values() {
            stats.messages += q.depth() as u64;
            stats.unconfirmed += q.unconfirmed() as u64;
        }
        metrics::gauge!("bmq_partition_messages", "partition" => self.id.to_string())
            .set(stats.messages as f64);
        metrics::gauge!("bmq_partition_journal_last_sequence", "partition" => self.id.to_string())
            .set(stats.last_sequence as f64);
        MessageResult(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bmq_proto::peer::{JournalRecord, StoredMessage};

    fn record(sequence: u64, kind: RecordKind) -> JournalRecord {
        JournalRecord {
            lease: 1,
            sequence,
            timestamp_ms: 0,
            kind: Some(kind),
        }
    }

    fn guid(n: u8) -> Bytes {
        Bytes::from(vec![n; 16])
    }

    fn consumer() -> (ConsumerKey, ConsumerOptions) {
        (
            ConsumerKey {
                origin_node: NodeId(1),
                session_id: 1,
            },
            ConsumerOptions {
                priority: 0,
                max_unconfirmed_messages: 100,
                max_unconfirmed_bytes: 1 << 20,
            },
        )
    }

    const LIMITS: QueueLimits = QueueLimits {
        max_messages: 100,
        max_bytes: 1 << 20,
        max_delivery_attempts: 0,
        message_ttl: None,
    };

    #[test]
    fn rebuilt_queues_hold_unconfirmed_messages_with_their_attempts() {
        // Message 1 was pushed twice and not confirmed: its next push is attempt 3. Message 2
        // was confirmed: gone. Message 3 was never pushed: attempt 1.
        let uri = "bmq://d/q";
        let msg = |n: u8| {
            RecordKind::Message(StoredMessage {
                uri: uri.into(),
                guid: guid(n),
                payload: Bytes::from_static(b"x"),
                properties: vec![],
            })
        };
        let delivery = |n: u8, attempt| {
            RecordKind::Delivery(StoredDelivery {
                uri: uri.into(),
                guid: guid(n),
                attempt,
                app_id: String::new(),
            })
        };
        let records = vec![
            record(1, msg(1)),
            record(2, msg(2)),
            record(3, delivery(1, 1)),
            record(4, delivery(2, 1)),
            record(
                5,
                RecordKind::Confirm(StoredConfirm {
                    uri: uri.into(),
                    guid: guid(2),
                    app_id: String::new(),
                }),
            ),
            record(6, delivery(1, 2)),
            record(7, msg(3)),
        ];
        let now = Instant::now();
        let mut queues = rebuild_queues(&records, now, |u| Some((LIMITS, vec![u.to_string()])));
        let q = queues.get_mut(uri).expect("queue rebuilt");
        assert_eq!(q.depth(), 2);
        let (key, options) = consumer();
        q.add_consumer(key, options);
        let pushes: Vec<(Bytes, u32)> = std::iter::from_fn(|| q.poll_delivery(now))
            .map(|d| (d.guid, d.delivery_attempt))
            .collect();
        assert_eq!(pushes, vec![(guid(1), 3), (guid(3), 1)]);
    }

    #[test]
    fn fanout_copies_are_rebuilt_per_app() {
        // App a confirmed the message, app b did not: only b's queue holds it.
        let uri = "bmq://f/q";
        let records = vec![
            record(
                1,
                RecordKind::Message(StoredMessage {
                    uri: uri.into(),
                    guid: guid(1),
                    payload: Bytes::from_static(b"x"),
                    properties: vec![],
                }),
            ),
            record(
                2,
                RecordKind::Confirm(StoredConfirm {
                    uri: uri.into(),
                    guid: guid(1),
                    app_id: "a".into(),
                }),
            ),
        ];
        let queues = rebuild_queues(&records, Instant::now(), |u| {
            Some((LIMITS, vec![app_key(u, "a"), app_key(u, "b")]))
        });
        assert!(queues.get("bmq://f/q#a").is_none_or(|q| q.depth() == 0));
        assert_eq!(queues.get("bmq://f/q#b").map(|q| q.depth()), Some(1));
    }
}
