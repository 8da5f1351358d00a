//! `Partition`: one partition on one node, primary or replica (DESIGN.md §7), as a core the
//! shell drives (no sockets, no clock; its journal is the one file I/O it does).
//!
//! It owns the partition's [`ReplicationCore`] (and through it the journal, a [`Store`]) and,
//! while this node is the partition's *active* primary, its queues: one [`QueueCore`] per
//! queue (per app id in a fanout domain, each app holding its own copy of every message),
//! rebuilt from the journal's outstanding messages when the node becomes active
//! ([`restore_queues`]). Queues hold no payloads: a push reads its message back from the
//! journal (recent records come from the store's cache).
//!
//! Inputs, each `handle_*(now, ..)`:
//! - [`Partition::handle_request`]: OpenQueue, PUT, CONFIRM, CloseQueue from a session (local or
//!   proxied). A node that is not the active primary answers `NOT_READY` (the proxy keeps its
//!   PUTs and reopens later).
//! - [`Partition::handle_session_gone`], [`Partition::handle_node_gone`]: consumers went away;
//!   their unconfirmed messages are redelivered (with the next delivery attempt).
//! - [`Partition::handle_peer`]: replication traffic; [`Partition::handle_role`]: the committed
//!   primary, lease and status (a node no longer primary steps down to replica).
//! - [`Partition::handle_flush`]: the shell's group-commit point, once per batch of inputs
//!   when [`Partition::needs_sync`]: the journal's buffer is written and the fsync of what
//!   was written comes out as [`PartitionOutput::Sync`];
//!   [`Partition::handle_synced`] and [`Partition::handle_compacted`] bring the storage
//!   requests' outcomes back; [`Partition::handle_timeout`] at [`Partition::poll_timeout`].
//!
//! Outputs, drained in order with [`Partition::poll_output`]: [`PartitionOutput`] — messages
//! to peers, answers and pushes to sessions, the announcement that this node healed the
//! partition and is its active primary (repeated every [`ANNOUNCE_PERIOD`] until the leader
//! has committed it), the request for a new lease of a primary named again at a lease it
//! served before a restart, and a journal failure that must stop the node; and the journal's
//! storage requests, which the shell runs off the partition's thread — an fsync
//! ([`PartitionOutput::Sync`], at most one in flight), the files of deleted segments to close
//! ([`PartitionOutput::Close`]) and a compaction's copy ([`PartitionOutput::Compact`]) — as
//! openraft's engine emits its storage commands. Nothing an fsync covers counts as durable
//! (no receipt, ACK or push) before its outcome is back. Counts for the node's metrics
//! accumulate in [`PartitionCounters`] ([`Partition::take_counters`]).
//!
//! Request rules:
//! - a queue's domain is resolved once against [`DomainPolicies`]; an unknown domain or a
//!   malformed URI is answered `UNKNOWN_DOMAIN` (open) or `UNKNOWN_QUEUE` (PUT);
//! - **broadcast**: a PUT is pushed to the consumers attached now and ACKed at once; nothing is
//!   stored (at-most-once);
//! - a PUT whose GUID is outstanding in the journal, or in the replication core's recent-GUID
//!   window, is a resend: it is not stored again and is ACKed with the first copy;
//! - otherwise every app copy must have room: a depth limit refusing any copy NACKs the PUT
//!   `LIMIT_REACHED` with the reason and nothing is stored; an
//!   accepted PUT is journaled and replicated, and ACKed once a quorum holds it (strong) or the
//!   primary does (eventual); a PUT the partition's journal quota cannot take is NACKed
//!   `LIMIT_REACHED`, one its full disk cannot take `STORAGE_FAILURE` (nothing stored, the
//!   partition takes PUTs again once a write succeeds); a GUID that is not 16 bytes is
//!   NACKed `INVALID`;
//! - a message is **delivered only once it is safe**: once a quorum holds its record (strong
//!   consistency) or the primary does (eventual), the same points at which the PUT is ACKed, so
//!   no consumer reads what a failover can lose (BlazingMQ does the same);
//! - after every request the queues push what they can; a confirm, a consumer failure (a
//!   consumer that went away holding a message) and a removal without a confirm (TTL, attempts
//!   exhausted, purge) are journal records, so a new primary knows what was confirmed, how often
//!   each message failed, and what is gone. A primary move or a graceful stop is not a failure:
//!   the message is redelivered with the same attempt number;
//! - every removal without a confirm is logged (queue, app, GUID, reason) and counted;
//! - a fanout domain's app ids change under its open queues ([`Partition::handle_domains`]):
//!   the change is journaled (`StoredQueueApps`) before the queue's next PUT, so replicas and
//!   restarts follow it; an added app's copies start with that PUT, a removed app's copies are
//!   dropped (one line per app with their count, counted as `app_removed`: the journal record
//!   removes them all, no record per message) and its consumers closed with an
//!   `ErrorResponse` `NOT_OPEN` naming the app — as are the consumers of a deleted domain;
//! - while the node stops gracefully ([`Partition::handle_stop_delivering`]) it pushes nothing
//!   new, so its consumers can confirm what they hold before the partition moves.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bmq_proto::client::{
    client_message::Kind, Ack, AckStatus, ClientMessage, CloseQueue, CloseQueueResponse, Confirm,
    ConsumerOptions as ProtoConsumerOptions, ErrorResponse, OpenQueue, OpenQueueResponse, Push,
    Put, Status, StatusCode,
};
use bmq_proto::peer::{
    journal_record::Kind as RecordKind, PartitionMessage, StoredConfirm, StoredFailure,
    StoredQueueApps, StoredRemoval,
};
use bmq_proto::{uri_bytes, uri_str, LeaseId, NodeId, PartitionId, SessionAddr, UriBytes};
use bytes::Bytes;
use tracing::{info, warn};

use crate::policy::{refusal, ConsumerDefaults, DeliveryMode, DomainPolicies, DomainPolicy};
use crate::queue::{ConsumerOptions, PutOutcome, QueueCore, QueueEvent, RemovalReason};
use crate::replication::{Output, PrimaryPhase, PutResult, ReplicationConfig, ReplicationCore};
use crate::store::{
    guid_key, ClosedFiles, CompactionDone, CompactionTicket, Store, StoreError, StoreStats,
    SyncTicket,
};
use bmq_proto::expression::Expression;

/// Old defects the replication simulator must find, put back on purpose; compiled
/// only with the `defect-injection` feature (see `docs/REPLICATION_VERIFICATION.md`).
#[cfg(feature = "defect-injection")]
pub mod defects {
    use std::sync::atomic::{AtomicU8, Ordering};

    /// No defect.
    pub const NONE: u8 = 0;
    /// Defect 1: under strong consistency the primary delivers a message as soon as it is
    /// appended, before its own fsync and a quorum's receipts (a dirty read).
    pub const DIRTY_READ: u8 = 1;
    /// Defect 2: a new primary rebuilds its queues with one more delivery attempt per
    /// message, so primary moves and graceful stops raise attempts (and exhaust them).
    pub const ATTEMPTS_ON_MOVE: u8 = 2;

    static ACTIVE: AtomicU8 = AtomicU8::new(NONE);

    /// Puts `defect` back (process-wide).
    pub fn set(defect: u8) {
        ACTIVE.store(defect, Ordering::SeqCst);
    }

    pub(crate) fn on(defect: u8) -> bool {
        ACTIVE.load(Ordering::Relaxed) == defect
    }
}

#[cfg(not(feature = "defect-injection"))]
mod defects {
    pub const DIRTY_READ: u8 = 1;
    pub const ATTEMPTS_ON_MOVE: u8 = 2;
    #[inline(always)]
    pub(crate) fn on(_: u8) -> bool {
        false
    }
}

/// How often a healed primary repeats its ACTIVE announcement until the leader commits it.
pub const ANNOUNCE_PERIOD: Duration = Duration::from_millis(500);

/// How often a primary named at a lease it served before a restart repeats its request for a
/// new lease ([`PartitionOutput::RequestNewLease`]). Shorter than [`ANNOUNCE_PERIOD`]: the
/// partition serves nothing until the new lease comes, and right after a restart the first
/// request often reaches a leader that is not active yet. Rare, so the traffic is nothing.
pub const RENEW_PERIOD: Duration = Duration::from_millis(100);

/// What a partition repeats to the leader until the committed state answers it: at most one
/// at a time (a primary is either healed at its lease or refusing it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Notice {
    /// Healed and serving at the lease: commit ACTIVE ([`PartitionOutput::AnnounceActive`]).
    Active(LeaseId),
    /// Named at a lease served before a restart: name a higher one
    /// ([`PartitionOutput::RequestNewLease`]).
    RenewLease(LeaseId),
}

impl Notice {
    /// Whether the notice must still be repeated: the role it speaks for is still this node's.
    fn still_due(self, replication: &ReplicationCore) -> bool {
        match self {
            Notice::Active(lease) => {
                replication.is_active_primary() && replication.lease() == lease
            }
            Notice::RenewLease(lease) => {
                replication.phase().is_none() && replication.lease() == lease
            }
        }
    }
}

/// What a partition needs to know at creation.
#[derive(Debug, Clone)]
pub struct PartitionConfig {
    /// Replication settings (this node, members, quorum, batch and resend limits).
    pub replication: ReplicationConfig,
    /// The domains' policies.
    pub policies: Arc<DomainPolicies>,
    /// Flow control of consumers that set none.
    pub consumer_defaults: ConsumerDefaults,
    /// A monotonic instant and the wall-clock time (ms since the Unix epoch) at that instant,
    /// read once by the shell; journal records are stamped from it.
    pub wall_clock_anchor: (Instant, u64),
}

/// What the shell must do, in order.
///
/// Equality compares the messages and announcements; a storage request
/// ([`PartitionOutput::Sync`], [`PartitionOutput::Close`], [`PartitionOutput::Compact`])
/// holds open files and equals nothing, itself included.
#[derive(Debug)]
pub enum PartitionOutput {
    /// Send a replication message to a peer over the DATA channel.
    SendPeer {
        /// The peer.
        to: NodeId,
        /// The message.
        message: PartitionMessage,
    },
    /// Send an answer (OpenQueueResponse, Ack, CloseQueueResponse) or a Push to a session,
    /// wherever it lives.
    Reply {
        /// The session.
        to: SessionAddr,
        /// The message.
        message: ClientMessage,
    },
    /// This node healed the partition and serves it at `lease`: tell every node (the leader
    /// commits `PrimaryStatusAdvisory { ACTIVE }`).
    AnnounceActive {
        /// The lease served.
        lease: LeaseId,
    },
    /// This node is named primary at `lease` but its journal holds records of `lease` from
    /// before a restart ([`crate::replication::Output::LeaseReused`]): tell every node (the
    /// leader names this node again at a higher lease). Repeated every [`RENEW_PERIOD`]
    /// while the role stays at `lease`.
    RequestNewLease {
        /// The lease this node will not serve again.
        lease: LeaseId,
    },
    /// The journal failed (an I/O error or corruption, not a full disk): stop the node.
    Fatal {
        /// What failed.
        error: String,
    },
    /// Run this fsync ([`SyncTicket::run`], on any thread) and give its outcome to
    /// [`Partition::handle_synced`]. At most one is in flight; until its outcome is back,
    /// nothing it covers counts as durable. A failed fsync is never retried: it is fatal.
    Sync {
        /// The fsync.
        ticket: SyncTicket,
    },
    /// Close the files of these deleted journal segments ([`ClosedFiles::finish`], on any
    /// thread: the kernel frees their blocks there). Nothing comes back.
    Close {
        /// The files.
        files: ClosedFiles,
    },
    /// Run this compaction's copy ([`CompactionTicket::run`], on any thread) and give its
    /// outcome to [`Partition::handle_compacted`].
    Compact {
        /// The copy.
        ticket: CompactionTicket,
    },
}

impl PartialEq for PartitionOutput {
    fn eq(&self, other: &Self) -> bool {
        use PartitionOutput as O;
        match (self, other) {
            (O::SendPeer { to: a, message: m }, O::SendPeer { to: b, message: n }) => {
                a == b && m == n
            }
            (O::Reply { to: a, message: m }, O::Reply { to: b, message: n }) => a == b && m == n,
            (O::AnnounceActive { lease: a }, O::AnnounceActive { lease: b })
            | (O::RequestNewLease { lease: a }, O::RequestNewLease { lease: b }) => a == b,
            (O::Fatal { error: a }, O::Fatal { error: b }) => a == b,
            _ => false,
        }
    }
}

/// This node's role in a partition, as `/status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionRole {
    /// Not the primary.
    Replica,
    /// Primary, collecting journal shapes from a quorum.
    Collecting,
    /// Primary, pulling records from a more advanced member.
    Pulling,
    /// Primary, bringing replicas up to date.
    Syncing,
    /// Primary, serving.
    Active,
}

impl PartitionRole {
    /// `replica`, `collecting`, `pulling`, `syncing` or `active`.
    pub fn as_str(self) -> &'static str {
        match self {
            PartitionRole::Replica => "replica",
            PartitionRole::Collecting => "collecting",
            PartitionRole::Pulling => "pulling",
            PartitionRole::Syncing => "syncing",
            PartitionRole::Active => "active",
        }
    }
}

/// The figures of a partition on this node that cost O(1) to read, whatever the number of
/// its queues: what the partition's actor publishes as gauges on every timer tick (10 times a
/// second on a primary). [`PartitionStats`] adds the totals over the queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionGauges {
    /// This node's role.
    pub role: PartitionRole,
    /// The highest lease known.
    pub lease: LeaseId,
    /// Last journal sequence held.
    pub last_sequence: u64,
    /// Highest sequence held by a quorum (primary only; 0 on a replica).
    pub committed: u64,
    /// Records the slowest replica lacks (primary only; 0 on a replica).
    pub replication_lag: u64,
    /// The journal's figures (bytes, segments, outstanding messages, base, floor).
    pub store: StoreStats,
    /// The last journal write failed for a full disk.
    pub disk_full: bool,
    /// The journal was found corrupt, set aside, and is not re-installed yet
    /// ([`crate::store::Store::needs_install`]).
    pub needs_install: bool,
    /// Not the primary, and caught up with the primary of the highest lease known
    /// ([`crate::replication::ReplicationCore::follows_primary`]).
    pub follows_primary: bool,
}

/// What `/status` shows of a partition on this node: the [`PartitionGauges`] and the totals
/// over its queues, which cost O(queues) to add up (read on demand, never per tick).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionStats {
    /// The O(1) figures: role, lease, sequences, replication lag, journal.
    pub gauges: PartitionGauges,
    /// Messages held (not yet confirmed), all queues (active primary only).
    pub messages: u64,
    /// Messages pushed and not yet confirmed, all queues (active primary only).
    pub unconfirmed: u64,
    /// Queues the partition serves: a consumer attached or a message held (active primary
    /// only; an idle queue is dropped, see `Partition::deliver`).
    pub queues: usize,
}

/// Counts since the last [`Partition::take_counters`], for the node's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PartitionCounters {
    /// PUTs received while active.
    pub puts: u64,
    /// PUTs whose GUID was already stored (resends).
    pub put_duplicates: u64,
    /// Successful ACKs sent.
    pub acks: u64,
    /// PUTs refused by a queue's limit (`LIMIT_REACHED`).
    pub nacks_limit_reached: u64,
    /// PUTs of an unknown domain or malformed URI (`UNKNOWN_QUEUE`).
    pub nacks_unknown_queue: u64,
    /// PUTs refused by the partition's journal quota (`LIMIT_REACHED`).
    pub nacks_quota: u64,
    /// PUTs refused because the journal's disk is full (`STORAGE_FAILURE`).
    pub nacks_storage_failure: u64,
    /// PUTs with a GUID that is not 16 bytes (`INVALID`).
    pub nacks_invalid: u64,
    /// PUTs with the GUID of another message the partition holds, with another queue or
    /// payload (`INVALID`): not a resend, and never ACKed for the other message.
    pub nacks_guid_conflict: u64,
    /// Pushes sent (first deliveries and redeliveries).
    pub pushes: u64,
    /// Pushes with `delivery_attempt > 1`.
    pub redeliveries: u64,
    /// Consumer failures: a consumer went away holding a message (one per message).
    pub consumer_failures: u64,
    /// Messages removed without a confirm because of their TTL.
    pub removed_ttl: u64,
    /// Messages removed without a confirm because their attempts were exhausted.
    pub removed_attempts_exhausted: u64,
    /// Messages removed without a confirm by a purge.
    pub removed_purged: u64,
    /// Copies dropped without a confirm because their app was removed from the queue's
    /// fanout domain (one per message the app held).
    pub removed_app_removed: u64,
    /// Consumers closed by the broker: their app was removed from the fanout domain, or the
    /// domain deleted (each told with an `ErrorResponse`).
    pub consumers_closed: u64,
    /// Confirms that matched an unconfirmed message.
    pub confirms: u64,
    /// Requests of an unexpected kind.
    pub invalid_requests: u64,
}

/// One queue on the active primary: its domain's policy and one core per app.
#[derive(Debug)]
struct QueueEntry {
    policy: DomainPolicy,
    /// `(app id, core)`: the fanout app ids in order, or the single app `""`.
    apps: Vec<(String, QueueCore)>,
    /// The journal sequence of the last message PUT to the queue (0: none): the queue holds
    /// messages its deliverable mark does not cover yet while this is above the mark.
    last_put: u64,
    /// The queue is in [`Partition::awaiting_marks`].
    awaiting_marks: bool,
    /// Fanout: the journal's app ids for the queue were compared with `apps` (and a
    /// `StoredQueueApps` written where they differed) since the entry was created or its apps
    /// changed; checked before its next PUT ([`Partition::state_apps`]).
    apps_stated: bool,
}

/// A GUID in hex, for logs and answers.
fn hex_guid(guid: &[u8]) -> String {
    guid.iter().map(|b| format!("{b:02x}")).collect()
}

/// A consumer's subscriptions as the queue core takes them.
type Subscriptions = Vec<(ConsumerOptions, Option<Arc<Expression>>)>;

/// A consumer's subscriptions as the queue core takes them: the broker's defaults for zero
/// limits, none for a suspended consumer, one of every message with the consumer's own
/// priority and limits when it names none, and each expression compiled.
///
/// Errors: an expression that does not compile, in the words BlazingMQ's SDK uses for it
/// (`bmqt_queueoptions.cpp`).
fn subscriptions(
    c: &ProtoConsumerOptions,
    defaults: ConsumerDefaults,
) -> Result<Subscriptions, String> {
    if c.suspended {
        return Ok(Vec::new());
    }
    let options = |priority, messages: u32, bytes: u64, subscription_id| ConsumerOptions {
        priority,
        max_unconfirmed_messages: if messages == 0 {
            defaults.max_unconfirmed_messages
        } else {
            messages
        },
        max_unconfirmed_bytes: if bytes == 0 {
            defaults.max_unconfirmed_bytes
        } else {
            bytes
        },
        subscription_id,
    };
    if c.subscriptions.is_empty() {
        let o = options(
            c.priority,
            c.max_unconfirmed_messages,
            c.max_unconfirmed_bytes,
            0,
        );
        return Ok(vec![(o, None)]);
    }
    c.subscriptions
        .iter()
        .map(|s| {
            let expression = match s.expression.trim() {
                "" => None,
                text => Some(Arc::new(Expression::compile(text).map_err(|e| {
                    format!(
                        "Expression validation failed: [ expression: {text:?}, rc: {}, \
                         reason: \"{e}\" ]",
                        e.code()
                    )
                })?)),
            };
            let o = options(
                s.priority,
                s.max_unconfirmed_messages,
                s.max_unconfirmed_bytes,
                s.id,
            );
            Ok((o, expression))
        })
        .collect()
}

impl QueueEntry {
    /// Every app's queue is idle ([`QueueCore::is_idle`]).
    fn is_idle(&self) -> bool {
        self.apps.iter().all(|(_, q)| q.is_idle())
    }

    fn new(uri: &str, policy: &DomainPolicy) -> Self {
        let apps = policy
            .apps()
            .into_iter()
            .map(|app| {
                let core = QueueCore::new(queue_name(uri, &app), policy.limits);
                (app, core)
            })
            .collect();
        QueueEntry {
            policy: policy.clone(),
            apps,
            last_put: 0,
            awaiting_marks: false,
            apps_stated: !matches!(policy.mode, DeliveryMode::Fanout { .. }),
        }
    }
}

/// The name of `uri`'s copy for `app` (`uri#app`; `uri` itself when `app` is empty), as
/// limit messages show it. `#` cannot appear in a queue URI.
fn queue_name(uri: &str, app: &str) -> String {
    if app.is_empty() {
        uri.to_string()
    } else {
        format!("{uri}#{app}")
    }
}

/// How often an active primary sweeps the queues of domains with a message TTL for expired
/// messages ([`Partition::handle_timeout`]): O(queues with a TTL that hold a message or a
/// consumer) each time, idle queues being dropped.
pub const TTL_SWEEP_PERIOD: Duration = Duration::from_secs(1);

/// One partition on this node (see the module doc).
#[derive(Debug)]
pub struct Partition {
    id: PartitionId,
    self_id: NodeId,
    replication: ReplicationCore,
    policies: Arc<DomainPolicies>,
    consumer_defaults: ConsumerDefaults,
    wall_clock_anchor: (Instant, u64),
    /// By URI; ordered, so deliveries across queues happen in a deterministic order.
    queues: BTreeMap<String, QueueEntry>,
    /// The notice this node repeats to the leader until the committed state answers it, and
    /// when to repeat it next.
    notice: Option<(Notice, Instant)>,
    /// The deliverable marks last applied to the queues: (strong: committed, eventual:
    /// persisted).
    deliverable: (u64, u64),
    /// The queues a rise of the deliverable marks can serve, each once: those holding a
    /// message PUT above their mark, and those rebuilt by healing and not served yet. A
    /// rise visits these and no other queue, so a commit costs O(queues with messages in
    /// flight), not O(queues) — idle queues on a partition slowed every producer of it when
    /// every commit visited them all (docs/bench/JOURNAL.md, "Flat in the number of queues").
    awaiting_marks: Vec<String>,
    /// The queues each session consumes from (an open with read, until its close or the
    /// session's end): a session's end visits these, not every queue of the partition.
    consumer_queues: BTreeMap<SessionAddr, BTreeSet<String>>,
    /// When the queues with a message TTL are next swept ([`TTL_SWEEP_PERIOD`]).
    next_ttl_sweep: Option<Instant>,
    /// The node is stopping: no new pushes.
    stop_delivering: bool,
    counters: PartitionCounters,
    outputs: VecDeque<PartitionOutput>,
    /// A [`PartitionOutput::Sync`] was handed out and its outcome is not back.
    sync_in_flight: bool,
}

fn proto_status(code: StatusCode, message: &str) -> Option<Status> {
    Some(Status {
        code: code as i32,
        message: message.to_string(),
    })
}

fn ack(uri: UriBytes, guid: Bytes, status: AckStatus, message: String) -> ClientMessage {
    ClientMessage {
        kind: Some(Kind::Ack(Ack {
            uri,
            guid,
            status: status as i32,
            message,
        })),
    }
}

impl Partition {
    /// A partition over `store`, its journal as recovered from disk (all durable).
    pub fn new(cfg: PartitionConfig, store: Store) -> Self {
        Partition {
            id: cfg.replication.partition,
            self_id: cfg.replication.self_id,
            replication: ReplicationCore::new(cfg.replication, store),
            policies: cfg.policies,
            consumer_defaults: cfg.consumer_defaults,
            wall_clock_anchor: cfg.wall_clock_anchor,
            queues: BTreeMap::new(),
            notice: None,
            deliverable: (0, 0),
            awaiting_marks: Vec::new(),
            consumer_queues: BTreeMap::new(),
            next_ttl_sweep: None,
            stop_delivering: false,
            counters: PartitionCounters::default(),
            outputs: VecDeque::new(),
            sync_in_flight: false,
        }
    }

    /// The partition's id.
    pub fn id(&self) -> PartitionId {
        self.id
    }

    /// The replication core (read only: journal, shape, receipts).
    pub fn replication(&self) -> &ReplicationCore {
        &self.replication
    }

    /// This node's role.
    pub fn role(&self) -> PartitionRole {
        match self.replication.phase() {
            None => PartitionRole::Replica,
            Some(PrimaryPhase::Collecting) => PartitionRole::Collecting,
            Some(PrimaryPhase::Pulling { .. }) => PartitionRole::Pulling,
            Some(PrimaryPhase::Syncing) => PartitionRole::Syncing,
            Some(PrimaryPhase::Active) => PartitionRole::Active,
        }
    }

    /// The O(1) figures (see [`PartitionGauges`]).
    pub fn gauges(&self) -> PartitionGauges {
        let last = self.replication.last_sequence();
        let slowest = self
            .replication
            .replica_receipts()
            .iter()
            .map(|(_, r)| *r)
            .min()
            .unwrap_or(last);
        PartitionGauges {
            role: self.role(),
            lease: self.replication.lease(),
            last_sequence: last,
            committed: self.replication.committed(),
            replication_lag: if self.replication.phase().is_some() {
                last.saturating_sub(slowest)
            } else {
                0
            },
            store: self.replication.store().stats(),
            disk_full: self.replication.disk_full(),
            needs_install: self.replication.store().needs_install(),
            follows_primary: self.replication.follows_primary(),
        }
    }

    /// What `/status` shows: [`Partition::gauges`] and the totals over every queue of the
    /// partition, O(queues).
    pub fn stats(&self) -> PartitionStats {
        let cores = self.queues.values().flat_map(|q| q.apps.iter());
        let (messages, unconfirmed) = cores.fold((0, 0), |(m, u), (_, q)| {
            (m + q.depth() as u64, u + q.unconfirmed() as u64)
        });
        PartitionStats {
            gauges: self.gauges(),
            messages,
            unconfirmed,
            queues: self.queues.len(),
        }
    }

    /// The counts since the last call (then zero).
    pub fn take_counters(&mut self) -> PartitionCounters {
        std::mem::take(&mut self.counters)
    }

    /// The next output to execute, in order.
    pub fn poll_output(&mut self) -> Option<PartitionOutput> {
        self.outputs.pop_front()
    }

    /// Wall-clock milliseconds since the Unix epoch at `now`, derived from the anchor given at
    /// creation (the core reads no clock); stamped on journal records.
    fn wall_ms(&self, now: Instant) -> u64 {
        let (at, wall_ms) = self.wall_clock_anchor;
        wall_ms.saturating_add(now.saturating_duration_since(at).as_millis() as u64)
    }

    /// When [`Partition::handle_timeout`] should be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match (
            self.replication.poll_timeout(),
            self.notice.map(|(_, at)| at),
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Timers: replication resends, the repeated ACTIVE announcement and the repeated
    /// request for a new lease; on the active primary, every [`TTL_SWEEP_PERIOD`], the
    /// queues of domains with a message TTL drop what expired (a queue drops an expired
    /// message when it reaches the head, which otherwise happens only when the queue is served:
    /// a queue without consumers would keep its expired messages).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.replication.handle_timeout(now);
        if self.replication.is_active_primary() && self.next_ttl_sweep.is_none_or(|t| now >= t) {
            self.next_ttl_sweep = Some(now + TTL_SWEEP_PERIOD);
            let expiring: Vec<String> = self
                .queues
                .iter()
                .filter(|(_, e)| e.policy.limits.message_ttl.is_some())
                .map(|(uri, _)| uri.clone())
                .collect();
            for uri in expiring {
                self.deliver(now, &uri);
            }
        }
        if let Some((notice, _)) = self.notice.filter(|(_, at)| now >= *at) {
            if notice.still_due(&self.replication) {
                self.send_notice(now, notice);
            } else {
                self.notice = None;
            }
        }
        self.absorb_replication(now);
    }

    /// A compaction's copy ([`PartitionOutput::Compact`]) finished with `done`: it replaces
    /// its segment now or after the next fsync. A full disk gives it up for now; another
    /// failure is a [`PartitionOutput::Fatal`].
    pub fn handle_compacted(&mut self, now: Instant, done: CompactionDone) {
        // A failure is reported as a `Fatal` output.
        let _ = self.replication.complete_compaction(done);
        self.absorb_replication(now);
    }

    /// Whether the shell should call [`Partition::handle_flush`]: journal writes wait for an
    /// fsync and none is in flight (group commit: once per batch of inputs, not per input).
    pub fn needs_sync(&self) -> bool {
        !self.sync_in_flight && self.replication.needs_sync()
    }

    /// The group-commit point: writes what waits in the journal's buffer and hands out the
    /// fsync of everything written as a [`PartitionOutput::Sync`] (none while one is in
    /// flight: the next flush after its outcome covers what was written meanwhile). When no
    /// fsync is due, what waited for durability is released at once. A failure is a
    /// [`PartitionOutput::Fatal`].
    pub fn handle_flush(&mut self, now: Instant) {
        if self.sync_in_flight {
            return;
        }
        // A failure is reported as a `Fatal` output.
        if let Ok(Some(ticket)) = self.replication.begin_sync(now) {
            self.sync_in_flight = true;
            self.outputs.push_back(PartitionOutput::Sync { ticket });
        }
        self.absorb_replication(now);
    }

    /// The fsync of a [`PartitionOutput::Sync`] finished with `result`: what it made durable
    /// is released (receipts, ACKs, deliveries) and settled dead records are reclaimed. A
    /// failed fsync is a [`PartitionOutput::Fatal`] (never retried, never counted durable:
    /// PostgreSQL's fsync rule).
    pub fn handle_synced(&mut self, now: Instant, ticket: SyncTicket, result: std::io::Result<()>) {
        self.sync_in_flight = false;
        // A failure is reported as a `Fatal` output.
        let _ = self.replication.complete_sync(now, ticket, result);
        self.absorb_replication(now);
    }

    /// [`Partition::handle_flush`] with its fsync run here and its outcome handed back at once
    /// ([`ReplicationCore::sync`]), for tests and for a node's clean exit; nothing while an
    /// fsync handed out is in flight. Errors: the journal failed (also a
    /// [`PartitionOutput::Fatal`]).
    pub fn sync_now(&mut self, now: Instant) -> Result<(), StoreError> {
        if self.sync_in_flight {
            return Ok(());
        }
        let result = self.replication.sync(now);
        self.absorb_replication(now);
        result
    }

    /// Replication traffic from `from`.
    pub fn handle_peer(&mut self, now: Instant, from: NodeId, message: PartitionMessage) {
        self.replication.handle_message(now, from, message);
        if !self.replication.is_active_primary() && !self.queues.is_empty() {
            info!(partition = %self.id, lease = %self.replication.lease(), "a higher lease was seen: stepping down to replica");
            self.queues.clear();
            self.awaiting_marks.clear();
            self.consumer_queues.clear();
        }
        self.absorb_replication(now);
    }

    /// Changes the quorum at run time (this node included; 0 = a majority of the lease's
    /// replicas).
    pub fn set_quorum(&mut self, now: Instant, quorum: usize) {
        info!(partition = %self.id, quorum, "partition quorum changed");
        self.replication.set_quorum(now, quorum);
        self.absorb_replication(now);
    }

    /// The membership's learners: as primary, this node streams the journal to them without
    /// counting them in any quorum ([`ReplicationCore::set_learners`]).
    pub fn set_learners(&mut self, now: Instant, learners: &[NodeId]) {
        self.replication.set_learners(now, learners);
        self.absorb_replication(now);
    }

    /// The committed cluster state names `primary` at `lease` for this partition, `active`
    /// when its status is ACTIVE, replicated by `replicas` (empty: the configured members, or
    /// those of the lease before; see [`ReplicationCore::handle_role`]). A node no longer
    /// primary steps down to replica.
    pub fn handle_role(
        &mut self,
        now: Instant,
        primary: Option<NodeId>,
        lease: LeaseId,
        active: bool,
        replicas: &[NodeId],
    ) {
        let was_primary = self.replication.phase().is_some();
        self.replication.handle_role(now, primary, lease, replicas);
        let is_primary = self.replication.phase().is_some();
        if active
            && primary == Some(self.self_id)
            && self.notice.map(|(n, _)| n) == Some(Notice::Active(lease))
        {
            self.notice = None;
        }
        if was_primary && !is_primary {
            info!(partition = %self.id, %lease, "no longer primary: stepping down to replica");
            self.queues.clear();
            self.awaiting_marks.clear();
            self.consumer_queues.clear();
        } else if !was_primary && is_primary {
            info!(partition = %self.id, %lease, "became primary: healing");
        }
        self.absorb_replication(now);
    }

    /// A session ended (its client went away): its consumers go, and each message one of them
    /// held is redelivered with one more consumer failure. (A session lost with its node's link
    /// is [`Partition::handle_node_gone`], which counts no failure.)
    pub fn handle_session_gone(&mut self, now: Instant, session: SessionAddr) {
        for uri in self.consumer_queues.remove(&session).unwrap_or_default() {
            if let Some(entry) = self.queues.get_mut(&uri) {
                for (_, q) in entry.apps.iter_mut() {
                    q.remove_consumer(session, true);
                }
            }
            self.deliver(now, &uri);
        }
        self.absorb_replication(now);
    }

    /// The node is stopping gracefully: push nothing new from now on, so the consumers can
    /// confirm what they hold before the partition moves (DESIGN.md §7, graceful stop).
    pub fn handle_stop_delivering(&mut self, now: Instant) {
        if !self.stop_delivering {
            info!(partition = %self.id, unconfirmed = self.unconfirmed(), "stopping deliveries: draining");
        }
        self.stop_delivering = true;
        self.absorb_replication(now);
    }

    /// Messages pushed to consumers and not yet confirmed, all queues (active primary only).
    pub fn unconfirmed(&self) -> u64 {
        self.queues
            .values()
            .flat_map(|e| e.apps.iter())
            .map(|(_, q)| q.unconfirmed() as u64)
            .sum()
    }

    /// Removes every message of queue `uri` (all its apps), logged and counted as purged, with
    /// a removal record each. Returns how many copies were removed; 0 on a node that is not the
    /// active primary or for an unknown queue.
    pub fn handle_purge(&mut self, now: Instant, uri: &str) -> usize {
        if !self.replication.is_active_primary() {
            return 0;
        }
        let removed = match self.queues.get_mut(uri) {
            Some(entry) => entry.apps.iter_mut().map(|(_, q)| q.purge()).sum(),
            None => 0,
        };
        self.deliver(now, uri);
        self.absorb_replication(now);
        removed
    }

    /// The committed domains changed (DESIGN.md §5a): new opens resolve against `policies`;
    /// each open queue whose domain's limits changed takes them at once (a lower depth limit
    /// refuses the next PUT); a fanout queue whose domain's app ids changed follows them at
    /// once ([`Partition::change_apps`]: a `StoredQueueApps` is journaled before its next PUT,
    /// an added app starts empty, a removed app's copies are dropped — counted and logged —
    /// and its consumers closed with an `ErrorResponse`); an idle queue whose mode changed is
    /// dropped and rebuilt with it on its next use; a queue whose domain is gone (a purging
    /// delete) has every message removed — logged and counted as purged — and is dropped, its
    /// consumers told with an `ErrorResponse`. Returns the copies removed.
    pub fn handle_domains(&mut self, now: Instant, policies: Arc<DomainPolicies>) -> usize {
        self.policies = policies;
        let mut removed = 0;
        let mut gone = Vec::new();
        let mut apps_changed = Vec::new();
        for (uri, entry) in self.queues.iter_mut() {
            match self.policies.resolve(uri) {
                None => gone.push(uri.clone()),
                Some(p) if *p == entry.policy => {}
                Some(p)
                    if std::mem::discriminant(&p.mode)
                        == std::mem::discriminant(&entry.policy.mode)
                        && p.strong == entry.policy.strong =>
                {
                    if p.mode != entry.policy.mode {
                        apps_changed.push((uri.clone(), p.clone()));
                    }
                    if p.limits != entry.policy.limits {
                        for (_, q) in entry.apps.iter_mut() {
                            q.set_limits(p.limits);
                        }
                        entry.policy.limits = p.limits;
                        info!(partition = %self.id, queue = %uri, limits = ?p.limits, "queue limits changed with its domain");
                    }
                }
                Some(_) if entry.is_idle() => gone.push(uri.clone()),
                Some(_) => {
                    // The leader refuses such a change while the domain has queues; a queue
                    // opened meanwhile keeps its settings until it is idle.
                    warn!(partition = %self.id, queue = %uri, "domain mode changed under a busy queue; its settings stay until it is idle");
                }
            }
        }
        for (uri, policy) in apps_changed {
            removed += self.change_apps(now, &uri, policy);
        }
        for uri in gone {
            let Some(mut entry) = self.queues.remove(&uri) else {
                continue;
            };
            if self.policies.resolve(&uri).is_some() {
                // Idle, rebuilt with the new settings on its next use.
                continue;
            }
            let mut purged = 0;
            let mut consumers = BTreeSet::new();
            for (app, q) in entry.apps.iter_mut() {
                consumers.extend(q.consumer_keys());
                purged += q.purge();
                while let Some(event) = q.poll_event() {
                    self.record_event(now, &uri, app.clone(), event);
                }
            }
            for queues in self.consumer_queues.values_mut() {
                queues.remove(&uri);
            }
            self.consumer_queues.retain(|_, queues| !queues.is_empty());
            self.awaiting_marks.retain(|u| *u != uri);
            warn!(partition = %self.id, queue = %uri, purged, consumers = consumers.len(), "queue of a deleted domain dropped with its messages");
            let why = format!(
                "queue {uri} was closed: its domain was deleted (its {purged} messages purged)"
            );
            for consumer in consumers {
                self.close_consumer(consumer, &uri, "", &why);
            }
            removed += purged;
        }
        self.absorb_replication(now);
        removed
    }

    /// A consumer of queue `uri` (and `app`, fanout) this partition closed on its own (its app
    /// or its domain went): told with an `ErrorResponse` `NOT_OPEN` naming them and saying
    /// why, counted. The session's proxy stops reading `app`, so that a later reopen does not
    /// name it.
    fn close_consumer(&mut self, to: SessionAddr, uri: &str, app: &str, why: &str) {
        self.counters.consumers_closed += 1;
        self.reply(
            to,
            ClientMessage {
                kind: Some(Kind::Error(ErrorResponse {
                    status: proto_status(StatusCode::NotOpen, why),
                    uri: uri.to_string(),
                    app_id: app.to_string(),
                })),
            },
        );
    }

    /// Fanout queue `uri` takes the app ids of `policy` (same mode and consistency): an added
    /// app gets an empty queue core (its copies start with the next PUT); a removed app's
    /// core is dropped — the copies it held counted in
    /// [`PartitionCounters::removed_app_removed`] and logged, its consumers closed
    /// ([`Partition::close_consumer`]) — and the change is journaled before any later PUT of
    /// the queue ([`Partition::state_apps`]), so the replicas' and a restart's index drop the
    /// same copies (BlazingMQ journals a QueueOp with the app keys added or removed for the
    /// same reason). Returns the copies dropped.
    fn change_apps(&mut self, now: Instant, uri: &str, policy: DomainPolicy) -> usize {
        let Some(entry) = self.queues.get_mut(uri) else {
            return 0;
        };
        let mut old: Vec<(String, QueueCore)> = std::mem::take(&mut entry.apps);
        let mut apps = Vec::with_capacity(policy.apps().len());
        for app in policy.apps() {
            let core = match old.iter().position(|(a, _)| *a == app) {
                Some(i) => old.swap_remove(i).1,
                None => QueueCore::new(queue_name(uri, &app), policy.limits),
            };
            apps.push((app, core));
        }
        entry.apps = apps;
        entry.policy = policy;
        entry.apps_stated = false;
        let mut dropped = 0;
        let mut closed = Vec::new();
        for (app, mut core) in old {
            // What the core has not reported yet goes to the journal first.
            while let Some(event) = core.poll_event() {
                self.record_event(now, uri, app.clone(), event);
            }
            let held = core.depth();
            let consumers = core.consumer_keys();
            dropped += held;
            self.counters.removed_app_removed += held as u64;
            warn!(
                partition = %self.id,
                queue = %uri,
                app_id = %app,
                copies = held,
                consumers = consumers.len(),
                reason = RemovalReason::AppRemoved.as_str(),
                "app removed from its fanout domain: its copies dropped without a confirm"
            );
            let why = format!(
                "app id {app:?} of queue {uri} was removed from its domain: its consumer is \
                 closed and the {held} messages it held are dropped"
            );
            closed.extend(consumers.into_iter().map(|c| (c, app.clone(), why.clone())));
        }
        for (consumer, app, why) in closed {
            self.close_consumer(consumer, uri, &app, &why);
        }
        self.state_apps(now, uri);
        self.deliver(now, uri);
        dropped
    }

    /// Before fanout queue `uri`'s next PUT: when the journal's app ids for it
    /// ([`Store::queue_apps`]) are not the entry's, journals a `StoredQueueApps` with the
    /// entry's (and what it adds and removes), so that every replica's index, and a restart's,
    /// follows it from this position on (see "Apps of a queue" in the store's module doc).
    fn state_apps(&mut self, now: Instant, uri: &str) {
        let Some(entry) = self.queues.get_mut(uri) else {
            return;
        };
        if entry.apps_stated {
            return;
        }
        entry.apps_stated = true;
        let wanted: Vec<String> = entry.apps.iter().map(|(a, _)| a.clone()).collect();
        let journal = self.replication.store().queue_apps(uri);
        let (added, removed) = match &journal {
            None => (Vec::new(), Vec::new()),
            Some(have) => (
                wanted
                    .iter()
                    .filter(|a| !have.contains(a))
                    .cloned()
                    .collect(),
                have.iter()
                    .filter(|a| !wanted.contains(a))
                    .cloned()
                    .collect(),
            ),
        };
        if journal.is_some() && added.is_empty() && removed.is_empty() {
            return;
        }
        info!(partition = %self.id, queue = %uri, apps = ?wanted, ?added, ?removed, "queue app ids journaled");
        let record = RecordKind::QueueApps(StoredQueueApps {
            uri: uri_bytes(uri),
            app_ids: wanted,
            added,
            removed,
        });
        let wall_ms = self.wall_ms(now);
        if self
            .replication
            .handle_record(now, record, wall_ms)
            .is_none()
        {
            // Not written (the journal failed): checked again before the next PUT.
            if let Some(entry) = self.queues.get_mut(uri) {
                entry.apps_stated = false;
            }
        }
    }

    /// The link to a proxy node dropped (it crashed, stopped or was cut off): every consumer it
    /// carried goes, and their messages are redelivered without counting a failure.
    pub fn handle_node_gone(&mut self, now: Instant, node: NodeId) {
        // Rare (a node lost): every queue is visited.
        for (_, q) in self.queues.values_mut().flat_map(|e| e.apps.iter_mut()) {
            q.remove_consumers_of_node(node);
        }
        self.consumer_queues.retain(|s, _| s.origin_node != node);
        self.deliver_all(now);
    }

    /// Client requests, each with the session that sent it, handled in order as one batch:
    /// what they append is streamed to the replicas together at the end
    /// ([`ReplicationCore::begin_batch`]). The same as [`Partition::handle_request`] for each.
    ///
    /// The GUIDs of the batch's PUTs and CONFIRMs are looked up first in the index of
    /// outstanding messages and the duplicate window ([`ReplicationCore::prefetch_guid`]): with
    /// a full window (a million GUIDs) each look-up is a cache miss, and this way a batch's
    /// misses overlap instead of following one another.
    pub fn handle_requests(&mut self, now: Instant, requests: Vec<(SessionAddr, ClientMessage)>) {
        if self.replication.is_active_primary() {
            let loaded = requests
                .iter()
                .fold(0, |loaded, (_, message)| match &message.kind {
                    Some(Kind::Put(Put { guid, .. }))
                    | Some(Kind::Confirm(Confirm { guid, .. })) => {
                        loaded ^ self.replication.prefetch_guid(guid)
                    }
                    _ => loaded,
                });
            std::hint::black_box(loaded);
        }
        self.replication.begin_batch();
        for (from, message) in requests {
            self.handle_request(now, from, message);
        }
        self.replication.end_batch(now);
        self.absorb_replication(now);
    }

    /// Replication traffic from `from`, handled in order as one batch (see
    /// [`Partition::handle_requests`]). The same as [`Partition::handle_peer`] for each.
    pub fn handle_peers(
        &mut self,
        now: Instant,
        from: NodeId,
        messages: impl IntoIterator<Item = PartitionMessage>,
    ) {
        self.replication.begin_batch();
        for message in messages {
            self.handle_peer(now, from, message);
        }
        self.replication.end_batch(now);
        self.absorb_replication(now);
    }

    /// A client request from session `from`.
    pub fn handle_request(&mut self, now: Instant, from: SessionAddr, message: ClientMessage) {
        if !self.replication.is_active_primary() {
            let reason = "this node is not the partition's active primary";
            if let Some(answer) = refusal(&message, StatusCode::NotReady, reason, self.id) {
                self.reply(from, answer);
            }
            return;
        }
        match message.kind {
            Some(Kind::OpenQueue(open)) => self.handle_open(now, from, open),
            Some(Kind::Put(put)) => self.handle_put(now, from, put),
            Some(Kind::Confirm(confirm)) => self.handle_confirm(now, from, confirm),
            Some(Kind::CloseQueue(close)) => self.handle_close(now, from, close),
            _ => self.counters.invalid_requests += 1,
        }
        self.absorb_replication(now);
    }

    /// The journal cannot serve a held message: the node must stop (another node with a good
    /// copy takes the partition over).
    fn fatal(&mut self, error: String) {
        tracing::error!(partition = %self.id, %error, "journal read failed");
        self.outputs.push_back(PartitionOutput::Fatal { error });
    }

    fn reply(&mut self, to: SessionAddr, message: ClientMessage) {
        self.outputs
            .push_back(PartitionOutput::Reply { to, message });
    }

    fn open_response(&mut self, to: SessionAddr, open: &OpenQueue, code: StatusCode, why: &str) {
        self.reply(
            to,
            ClientMessage {
                kind: Some(Kind::OpenQueueResponse(OpenQueueResponse {
                    request_id: open.request_id,
                    uri: open.uri.clone(),
                    status: proto_status(code, why),
                    partition_id: self.id.0,
                })),
            },
        );
    }

    /// The queue `uri`, created on first use; `None` when its domain is unknown.
    fn queue(&mut self, uri: &str) -> Option<&mut QueueEntry> {
        if !self.queues.contains_key(uri) {
            let policy = self.policies.resolve(uri)?;
            let entry = QueueEntry::new(uri, policy);
            self.queues.insert(uri.to_string(), entry);
        }
        self.queues.get_mut(uri)
    }

    /// An OpenQueue, or a second one of a queue this session has open: the consumers it
    /// lists (one per app of a fanout domain) replace the session's consumers of the queue —
    /// an app it no longer reads is released as by a close — and a request that names an app
    /// the domain does not have, or one app twice, changes nothing and is refused.
    fn handle_open(&mut self, now: Instant, from: SessionAddr, open: OpenQueue) {
        let defaults = self.consumer_defaults;
        let Some(entry) = self.queue(&open.uri) else {
            let why = "unknown domain or invalid uri";
            self.open_response(from, &open, StatusCode::UnknownDomain, why);
            return;
        };
        let wanted = match (open.read, open.consumers.is_empty()) {
            (false, _) => Vec::new(),
            (true, true) => vec![open.consumer.clone().unwrap_or_default()],
            (true, false) => open.consumers.clone(),
        };
        let fanout = matches!(entry.policy.mode, DeliveryMode::Fanout { .. });
        let mut targets: Vec<(usize, Subscriptions)> = Vec::with_capacity(wanted.len());
        for c in &wanted {
            if !fanout && !c.app_id.is_empty() {
                // As BlazingMQ: only a fanout queue has apps to read.
                let why = format!(
                    "app id {:?} given for a queue whose domain is not in fanout mode",
                    c.app_id
                );
                self.open_response(from, &open, StatusCode::Refused, &why);
                return;
            }
            let Some(app) = entry
                .apps
                .iter()
                .position(|(app, _)| !fanout || *app == c.app_id)
            else {
                let why = format!(
                    "app id {:?} is not one of this fanout domain's app ids",
                    c.app_id
                );
                self.open_response(from, &open, StatusCode::Refused, &why);
                return;
            };
            if targets.iter().any(|(a, _)| *a == app) {
                let why = format!("app id {:?} is read twice in one open", c.app_id);
                self.open_response(from, &open, StatusCode::Refused, &why);
                return;
            }
            match subscriptions(c, defaults) {
                Ok(subs) => targets.push((app, subs)),
                Err(why) => {
                    self.open_response(from, &open, StatusCode::InvalidArgument, &why);
                    return;
                }
            }
        }
        let entry = self.queues.get_mut(&open.uri).expect("resolved above");
        // Checked for every app before any changes: a refused open changes nothing.
        let refused = targets
            .iter()
            .find_map(|(app, subs)| entry.apps[*app].1.subscriptions_fit(from, subs).err());
        if let Some(why) = refused {
            self.open_response(from, &open, StatusCode::InvalidArgument, &why);
            return;
        }
        for (i, (_, queue)) in entry.apps.iter_mut().enumerate() {
            match targets.iter_mut().find(|(app, _)| *app == i) {
                Some((_, subs)) => {
                    let set = queue.set_subscriptions(from, std::mem::take(subs));
                    debug_assert!(set.is_ok(), "checked above: {set:?}");
                }
                // Not (or no longer) read by this session: closing an app's reader while it
                // holds messages is a consumer failure, as a close is.
                None => queue.remove_consumer(from, true),
            }
        }
        if targets.is_empty() {
            if let Some(queues) = self.consumer_queues.get_mut(&from) {
                queues.remove(&open.uri);
                if queues.is_empty() {
                    self.consumer_queues.remove(&from);
                }
            }
        } else {
            self.consumer_queues
                .entry(from)
                .or_default()
                .insert(open.uri.clone());
        }
        self.open_response(from, &open, StatusCode::Ok, "");
        self.deliver(now, &open.uri);
    }

    /// Whether `put` is a resend of the message stored as record `sequence`: the same queue
    /// and payload. Read back from the journal (a duplicate is rare: a resend after a failover
    /// or a lost ACK). Errors: the record cannot be read (corrupt, an I/O error): the node
    /// must stop, and the PUT gets no answer — never an ACK for a copy it could not compare.
    fn is_resend_of(&self, sequence: u64, put: &Put) -> Result<bool, String> {
        match self.replication.store().read(sequence) {
            Ok(Some(record)) => Ok(match record.kind {
                Some(RecordKind::Message(m)) => m.uri == put.uri && m.payload == put.payload,
                _ => true,
            }),
            Ok(None) => Ok(true),
            Err(e) => Err(e.to_string()),
        }
    }

    fn handle_put(&mut self, now: Instant, from: SessionAddr, put: Put) {
        self.counters.puts += 1;
        if put.guid.len() != 16 {
            self.counters.nacks_invalid += 1;
            let why = format!("a message GUID is 16 bytes, not {}", put.guid.len());
            self.reply(from, ack(put.uri, put.guid, AckStatus::Invalid, why));
            return;
        }
        let uri = put.uri.clone();
        // A URI that is not UTF-8 becomes the empty name, which is no valid URI: UNKNOWN_QUEUE.
        let name = uri_str(&uri).unwrap_or_default();
        let Some(entry) = self.queue(name) else {
            self.counters.nacks_unknown_queue += 1;
            let why = "unknown domain or invalid uri".to_string();
            self.reply(from, ack(put.uri, put.guid, AckStatus::UnknownQueue, why));
            return;
        };
        if entry.policy.mode == DeliveryMode::Broadcast {
            self.broadcast(from, name, put);
            return;
        }
        let strong = entry.policy.strong;
        if let Some(sequence) = self.replication.duplicate_of(now, &put.guid) {
            // A GUID names one message: a PUT of a held message's GUID with another queue or
            // payload is no resend, and is refused — never ACKed for a copy that is not its
            // own. (A finished message's GUID in the duplicate window cannot be compared: its
            // payload is gone; the clients' GUIDs are unique by construction — random, the
            // SDKs' generator, or made by the bmqp listener for a legacy client.)
            let resend = match sequence {
                0 => true,
                _ => match self.is_resend_of(sequence, &put) {
                    Ok(resend) => resend,
                    Err(e) => {
                        self.fatal(e);
                        return;
                    }
                },
            };
            if !resend {
                self.counters.nacks_guid_conflict += 1;
                let why = format!(
                    "message GUID {} is the GUID of another message held in partition {}",
                    hex_guid(&put.guid),
                    self.id
                );
                warn!(uri = %name, %why, "PUT refused: GUID conflict");
                self.reply(from, ack(put.uri, put.guid, AckStatus::Invalid, why));
                return;
            }
            // Resent by a proxy: ACKed with the stored copy, not stored again.
            self.counters.put_duplicates += 1;
            self.replication
                .wait_for_stored(from, put.uri, put.guid, strong, sequence);
            return;
        }
        // Every copy (one per app id in a fanout domain) must have room, or nothing is stored.
        let size = put.payload.len() as u64;
        let entry = self.queues.get_mut(name).expect("resolved above");
        let refused = entry
            .apps
            .iter_mut()
            .find_map(|(_, queue)| queue.refusal(now, size));
        if let Some(reason) = refused {
            self.counters.nacks_limit_reached += 1;
            self.reply(
                from,
                ack(put.uri, put.guid, AckStatus::LimitReached, reason),
            );
            return;
        }
        let store = self.replication.store();
        // The record's size on disk is about the payload plus its URI and properties.
        let estimate = size + put.uri.len() as u64 + 64;
        if store.would_exceed_quota(estimate) {
            self.counters.nacks_quota += 1;
            let why = format!(
                "partition {} journal holds {} bytes; its quota is {} bytes",
                self.id,
                store.stats().bytes,
                store.config().quota_bytes
            );
            self.reply(from, ack(put.uri, put.guid, AckStatus::LimitReached, why));
            return;
        }
        if !entry.apps_stated {
            self.state_apps(now, name);
        }
        let Put {
            guid,
            payload,
            properties,
            ..
        } = put;
        let key = guid_key(&guid);
        let wall_ms = self.wall_ms(now);
        let result = self.replication.handle_put(
            now,
            from,
            uri.clone(),
            guid.clone(),
            payload,
            properties,
            strong,
            wall_ms,
        );
        match result {
            PutResult::Appended { sequence } => {
                let entry = self.queues.get_mut(name).expect("resolved above");
                for (_, queue) in entry.apps.iter_mut() {
                    let taken = queue.put(now, key, size as u32, sequence);
                    debug_assert_eq!(taken, PutOutcome::Accepted, "checked with refusal()");
                }
                entry.last_put = sequence;
                if !entry.awaiting_marks {
                    entry.awaiting_marks = true;
                    self.awaiting_marks.push(name.to_string());
                }
                self.deliver(now, name);
            }
            PutResult::StorageFailure { reason } => {
                self.counters.nacks_storage_failure += 1;
                self.reply(from, ack(uri, guid, AckStatus::StorageFailure, reason));
            }
            PutResult::NotReady => {
                let why = "this node is not the partition's active primary".to_string();
                self.reply(from, ack(uri, guid, AckStatus::NotReady, why));
            }
        }
    }

    /// Broadcast mode: pushes `put` to every consumer of queue `name` (its URI as text) attached
    /// now and ACKs it; nothing is stored (at-most-once, DESIGN.md §7).
    fn broadcast(&mut self, from: SessionAddr, name: &str, put: Put) {
        let consumers: Vec<SessionAddr> = self
            .queues
            .get(name)
            .map(|e| e.apps.iter().flat_map(|(_, q)| q.consumer_keys()).collect())
            .unwrap_or_default();
        for consumer in consumers {
            self.counters.pushes += 1;
            let push = Push {
                uri: put.uri.clone(),
                guid: put.guid.clone(),
                payload: put.payload.clone(),
                properties: put.properties.clone(),
                delivery_attempt: 1,
                out_of_order: false,
                ..Default::default()
            };
            self.reply(
                consumer,
                ClientMessage {
                    kind: Some(Kind::Push(push)),
                },
            );
        }
        self.counters.acks += 1;
        self.reply(
            from,
            ack(put.uri, put.guid, AckStatus::Success, String::new()),
        );
    }

    fn handle_confirm(&mut self, now: Instant, from: SessionAddr, c: Confirm) {
        let key = guid_key(&c.guid);
        let name = uri_str(&c.uri).unwrap_or_default();
        // The app's copy the confirm names, or (none named) the first this session holds.
        let confirmed_app = self.queues.get_mut(name).and_then(|entry| {
            entry
                .apps
                .iter_mut()
                .filter(|(app, _)| c.app_id.is_empty() || *app == c.app_id)
                .find_map(|(app, q)| q.confirm(from, key).then(|| app.clone()))
        });
        if let Some(app_id) = confirmed_app {
            self.counters.confirms += 1;
            let record = RecordKind::Confirm(StoredConfirm {
                uri: c.uri.clone(),
                guid: c.guid,
                app_id,
            });
            self.replication
                .handle_record(now, record, self.wall_ms(now));
        }
        self.deliver(now, name);
    }

    fn handle_close(&mut self, now: Instant, from: SessionAddr, close: CloseQueue) {
        if let Some(queues) = self.consumer_queues.get_mut(&from) {
            queues.remove(&close.uri);
            if queues.is_empty() {
                self.consumer_queues.remove(&from);
            }
        }
        if let Some(entry) = self.queues.get_mut(&close.uri) {
            for (_, queue) in entry.apps.iter_mut() {
                // Closing a queue while holding messages is a consumer failure, like leaving.
                queue.remove_consumer(from, true);
            }
        }
        self.reply(
            from,
            ClientMessage {
                kind: Some(Kind::CloseQueueResponse(CloseQueueResponse {
                    request_id: close.request_id,
                    uri: close.uri.clone(),
                    status: proto_status(StatusCode::Ok, ""),
                })),
            },
        );
        self.deliver(now, &close.uri);
    }

    /// Pushes whatever `uri`'s queues can deliver now (nothing while stopping), and journals
    /// and reports what their queues report (consumer failures, removals). A queue left idle
    /// (nothing held, no consumer) is dropped: created again on its next open or PUT, so the
    /// primary keeps no entry for a queue that was only opened to write, or drained and left
    /// (~0.65 KiB each): its memory stays flat in the number of queues.
    fn deliver(&mut self, now: Instant, uri: &str) {
        let Some(entry) = self.queues.get_mut(uri) else {
            return;
        };
        let mut pushes = Vec::new();
        let mut events = Vec::new();
        let delivering = !self.stop_delivering;
        let fanout = matches!(entry.policy.mode, DeliveryMode::Fanout { .. });
        // Subscription expressions read a message's properties back from the journal; the
        // message last read is kept, so that pushing the one just matched does not read it
        // again.
        let store = self.replication.store();
        let last_read = std::cell::RefCell::new(None);
        let mut properties = |sequence: u64| match store.read(sequence) {
            Ok(Some(record)) => match record.kind {
                Some(RecordKind::Message(m)) => {
                    let properties = m.properties.clone();
                    *last_read.borrow_mut() = Some((sequence, m));
                    Some(properties)
                }
                _ => None,
            },
            _ => None,
        };
        for (app, queue) in entry.apps.iter_mut() {
            if delivering {
                while let Some(d) = queue.poll_delivery_with(now, &mut properties) {
                    let app_id = if fanout { app.clone() } else { String::new() };
                    let read = last_read
                        .borrow_mut()
                        .take()
                        .filter(|(sequence, _)| *sequence == d.journal_sequence)
                        .map(|(_, m)| m);
                    pushes.push((app_id, d, read));
                }
            }
            while let Some(event) = queue.poll_event() {
                events.push((app.clone(), event));
            }
        }
        for (app_id, event) in events {
            self.record_event(now, uri, app_id, event);
        }
        // Idle, or left idle by what it removed (expired or exhausted messages, no consumer).
        if pushes.is_empty() && self.queues.get(uri).is_some_and(QueueEntry::is_idle) {
            self.queues.remove(uri);
        }
        for (app_id, d, read) in pushes {
            // The payload is read back from the journal (the cache holds recent records).
            let record = match read {
                Some(m) => Ok(Some(bmq_proto::peer::JournalRecord {
                    kind: Some(RecordKind::Message(m)),
                    ..Default::default()
                })),
                None => self.replication.store().read(d.journal_sequence),
            };
            let message = match record {
                Ok(Some(record)) => match record.kind {
                    Some(RecordKind::Message(m)) => m,
                    _ => {
                        self.fatal(format!(
                            "journal record {} of a held message is not a message",
                            d.journal_sequence
                        ));
                        return;
                    }
                },
                Ok(None) => {
                    self.fatal(format!(
                        "journal record {} of a held message is missing",
                        d.journal_sequence
                    ));
                    return;
                }
                Err(e) => {
                    self.fatal(e.to_string());
                    return;
                }
            };
            self.counters.pushes += 1;
            if d.delivery_attempt > 1 {
                self.counters.redeliveries += 1;
            }
            // A push that cannot be handed over stays unconfirmed and is redelivered when its
            // consumer goes away: at-least-once.
            let push = Push {
                uri: message.uri,
                guid: message.guid,
                payload: message.payload,
                properties: message.properties,
                delivery_attempt: d.delivery_attempt,
                out_of_order: d.out_of_order,
                app_id,
                subscription_id: d.subscription_id,
            };
            self.reply(
                d.consumer,
                ClientMessage {
                    kind: Some(Kind::Push(push)),
                },
            );
        }
    }

    /// Journals a queue event, and logs and counts a removal without a confirm.
    fn record_event(&mut self, now: Instant, uri: &str, app_id: String, event: QueueEvent) {
        let record = match event {
            QueueEvent::ConsumerFailed { guid, failures } => {
                self.counters.consumer_failures += 1;
                RecordKind::Failure(StoredFailure {
                    uri: uri_bytes(uri),
                    guid: guid_bytes(guid),
                    app_id,
                    failures,
                })
            }
            QueueEvent::Removed { guid, reason } => {
                match reason {
                    RemovalReason::Ttl => self.counters.removed_ttl += 1,
                    RemovalReason::AttemptsExhausted => {
                        self.counters.removed_attempts_exhausted += 1
                    }
                    RemovalReason::Purged => self.counters.removed_purged += 1,
                    RemovalReason::AppRemoved => self.counters.removed_app_removed += 1,
                }
                warn!(
                    partition = %self.id,
                    queue = %uri,
                    app_id = %app_id,
                    guid = %format!("{guid:032x}"),
                    reason = reason.as_str(),
                    "message removed without a confirm"
                );
                RecordKind::Removal(StoredRemoval {
                    uri: uri_bytes(uri),
                    guid: guid_bytes(guid),
                    app_id,
                    reason: reason.as_str().to_string(),
                })
            }
        };
        self.replication
            .handle_record(now, record, self.wall_ms(now));
    }

    /// Raises each queue's deliverable mark to what is now safe to deliver (a quorum holds it
    /// for strong consistency, this node for eventual) and pushes what became deliverable.
    fn refresh_deliverable(&mut self, now: Instant) {
        if !self.replication.is_active_primary() {
            return;
        }
        let strong_mark = if defects::on(defects::DIRTY_READ) {
            self.replication.last_sequence()
        } else {
            self.replication.committed()
        };
        let marks = (strong_mark, self.replication.persisted());
        if marks == self.deliverable {
            return;
        }
        self.deliverable = marks;
        for uri in std::mem::take(&mut self.awaiting_marks) {
            let Some(entry) = self.queues.get_mut(&uri) else {
                continue;
            };
            let mark = if entry.policy.strong {
                marks.0
            } else {
                marks.1
            };
            for (_, q) in entry.apps.iter_mut() {
                q.set_deliverable_through(mark);
            }
            entry.awaiting_marks = entry.last_put > mark;
            let awaiting = entry.awaiting_marks;
            self.deliver(now, &uri);
            if awaiting {
                self.awaiting_marks.push(uri);
            }
        }
    }

    fn deliver_all(&mut self, now: Instant) {
        let uris: Vec<String> = self.queues.keys().cloned().collect();
        for uri in uris {
            self.deliver(now, &uri);
        }
        self.absorb_replication(now);
    }

    /// Moves the replication core's outputs into this core's, in order, acting on ACKs and on
    /// the end of healing.
    fn absorb_replication(&mut self, now: Instant) {
        loop {
            self.absorb_replication_outputs(now);
            // Delivering may journal records (failures, removals): absorb those too.
            self.refresh_deliverable(now);
            if !self.replication.has_output() {
                break;
            }
        }
        // The journal's requests for other threads (only when the shell runs them there:
        // `Store::set_defer_close`, `Store::set_background_compaction`).
        let files = self.replication.take_closed_files();
        if !files.is_empty() {
            self.outputs.push_back(PartitionOutput::Close { files });
        }
        if let Some(ticket) = self.replication.take_compaction() {
            self.outputs.push_back(PartitionOutput::Compact { ticket });
        }
    }

    fn absorb_replication_outputs(&mut self, now: Instant) {
        while let Some(output) = self.replication.poll_output() {
            match output {
                Output::Fatal { error } => self.outputs.push_back(PartitionOutput::Fatal { error }),
                Output::Send { to, message } => self
                    .outputs
                    .push_back(PartitionOutput::SendPeer { to, message }),
                Output::Ack {
                    producer,
                    uri,
                    guid,
                } => {
                    self.counters.acks += 1;
                    self.reply(producer, ack(uri, guid, AckStatus::Success, String::new()));
                }
                Output::Active { lease } => self.become_active(now, lease),
                Output::LeaseReused { lease } => {
                    if self.notice.map(|(n, _)| n) != Some(Notice::RenewLease(lease)) {
                        self.send_notice(now, Notice::RenewLease(lease));
                    }
                }
            }
        }
    }

    /// Sends `notice` to the leader (through every node) and repeats it after its period
    /// until [`Notice::still_due`] says the committed state has answered it.
    fn send_notice(&mut self, now: Instant, notice: Notice) {
        let (output, period) = match notice {
            Notice::Active(lease) => (PartitionOutput::AnnounceActive { lease }, ANNOUNCE_PERIOD),
            Notice::RenewLease(lease) => (PartitionOutput::RequestNewLease { lease }, RENEW_PERIOD),
        };
        self.outputs.push_back(output);
        self.notice = Some((notice, now + period));
    }

    /// Healing finished: rebuild the queues from the journal, push what they hold, announce.
    fn become_active(&mut self, now: Instant, lease: LeaseId) {
        let policies = self.policies.clone();
        self.queues = restore_queues(self.replication.store(), now, |uri| {
            policies.resolve(uri).cloned()
        });
        info!(partition = %self.id, %lease, last_sequence = self.replication.last_sequence(), queues = self.queues.len(), "partition primary healed: active");
        // Served at the next rise of the marks (below), every rebuilt queue once.
        self.awaiting_marks = self.queues.keys().cloned().collect();
        for entry in self.queues.values_mut() {
            entry.awaiting_marks = true;
        }
        // A domain's app ids that changed while another node was primary (or before a
        // restart) and that the journal does not say yet: said now, so that a removed app's
        // copies leave the journal without waiting for the queue's next PUT.
        let fanout: Vec<String> = self
            .queues
            .iter()
            .filter(|(_, e)| !e.apps_stated)
            .map(|(uri, _)| uri.clone())
            .collect();
        for uri in fanout {
            self.state_apps(now, &uri);
        }
        self.send_notice(now, Notice::Active(lease));
        // Healing ended with the whole journal on a quorum: every rebuilt message is safe.
        self.deliverable = (0, 0);
    }
}

/// Rebuilds a partition's queues from the journal's outstanding messages (a new primary
/// going active): every message some app has neither confirmed nor had removed, in journal
/// order, with its consumer failures so far (its next push carries attempt `failures + 1`),
/// one copy per app still waiting for it (`policy(uri)` gives the apps). Messages of a URI
/// without a policy (a domain no longer configured) stay in the journal but are not served.
/// Every rebuilt message is deliverable: healing put the whole journal on a quorum.
fn restore_queues(
    store: &Store,
    now: Instant,
    policy: impl Fn(&str) -> Option<DomainPolicy>,
) -> BTreeMap<String, QueueEntry> {
    let healed_through = store.last_sequence();
    let mut rebuilt: BTreeMap<String, QueueEntry> = BTreeMap::new();
    let mut unknown: HashSet<String> = HashSet::new();
    store.for_each_outstanding(|o| {
        if unknown.contains(o.uri) {
            return;
        }
        if !rebuilt.contains_key(o.uri) {
            match policy(o.uri) {
                Some(p) => {
                    let mut entry = QueueEntry::new(o.uri, &p);
                    for (_, q) in entry.apps.iter_mut() {
                        // What the journal held when healing ended, never more: a message
                        // PUT from now on waits for its own quorum (or fsync) like any other.
                        q.set_deliverable_through(healed_through);
                    }
                    rebuilt.insert(o.uri.to_string(), entry);
                }
                None => {
                    unknown.insert(o.uri.to_string());
                    return;
                }
            }
        }
        let entry = rebuilt.get_mut(o.uri).expect("inserted above");
        for (app, failures) in o.apps {
            if let Some((_, queue)) = entry.apps.iter_mut().find(|(a, _)| a == app) {
                let failures = *failures + u32::from(defects::on(defects::ATTEMPTS_ON_MOVE));
                queue.restore(now, o.guid, o.size, failures, o.sequence);
            }
        }
    });
    rebuilt
}

/// A GUID key back as the 16 bytes the producer chose (PUTs carry 16-byte GUIDs).
fn guid_bytes(guid: u128) -> Bytes {
    Bytes::copy_from_slice(&guid.to_be_bytes())
}

#[cfg(test)]
#[path = "partition_tests.rs"]
mod tests;
