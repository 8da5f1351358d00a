//! `PartitionActor`: the actix shell around one partition's pure core
//! ([`bmq_dataplane::Partition`]) on this node, primary or replica (DESIGN.md §7).
//!
//! Role: opens the partition's journal (`<data_dir>/partitions/<id>/`, a [`Store`]) on its
//! own thread when it starts, builds the core around it and executes the core's outputs.
//! Every rule — replication, healing, queues, fanout, broadcast, NACKs, duplicates, space
//! reclamation — is in the core; this file only does I/O and metrics.
//!
//! Receives:
//! - [`PartitionRequests`]: OpenQueue, PUT, CONFIRM, CloseQueue from sessions (local or
//!   proxied through a peer), as many as one turn of the sender had;
//! - [`PartitionSessionGone`], [`PartitionNodeGone`]: consumers went away;
//! - [`StopDelivering`]: the node is stopping gracefully, push nothing new;
//! - [`PartitionPeerMessages`]: replication traffic from a peer;
//! - [`PartitionRoleChanged`]: the committed primary, lease and status (on every commit);
//! - [`SetPartitionDomains`]: the committed domains changed;
//! - [`SetPartitionQuorum`]: the effective quorum changed (`POST /admin/quorum/{n}`);
//! - [`PurgeQueue`]: an operator's purge of a queue (`POST /admin/purge`);
//! - [`GetPartitionStats`]: answers a [`PartitionStats`] (for `/status` and the gauges).
//!
//! Sends, through its [`PartitionOutbox`] (the router): answers and pushes to sessions,
//! replication messages to peers over the DATA channel, and the ACTIVE announcement of a
//! healed primary to every node. What one input produced is handed over together (one
//! hand-off per destination, not one per message).
//!
//! Journal and fsync (group commit): the core writes records as it accepts them; when it
//! needs an fsync the actor sends itself a [`FlushJournal`], so every request already in the
//! mailbox is written first, then one fsync covers them all and releases receipts, ACKs and
//! deliveries. The fsync is one of the core's outputs ([`Partition::handle_flush`] gives a
//! [`PartitionOutput::Sync`] with its [`SyncTicket`]), run on the partition's *sync thread*,
//! which answers [`JournalSynced`], then [`Partition::handle_synced`]; the deleted segments'
//! files ([`PartitionOutput::Close`]) and a compaction's copy ([`PartitionOutput::Compact`])
//! are outputs too, run on their own threads. While the disk works, the partition goes on
//! taking PUTs, replicating them and counting receipts, and the next fsync covers everything
//! written meanwhile. At most one fsync is in flight per partition. A journal failure other than a
//! full disk stops the node (never retry an fsync); a full disk makes the partition refuse
//! PUTs until writes succeed again.
//!
//! Timers: one [`Timer`], re-armed from the core's `poll_timeout` after every input.
//!
//! Threads: each partition actor runs on its own arbiter thread (started by the router), so
//! its work never delays heartbeats, sessions or another partition; its fsyncs run on its own
//! sync thread (`bmq-sync-<id>`), so they delay nothing but what waits for durability; the
//! files of deleted segments are closed on `bmq-close-<id>`, and the copy of a compaction
//! (reading, writing and fsyncing a sparse segment's live records) runs on `bmq-compact-<id>`
//! ([`JournalCompacted`] brings it back; the partition puts it in place). Each is a
//! [`DiskWorker`]; one that could not start leaves its work to the partition's thread.

use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, AsyncContext, Context, Handler, Message, MessageResult};
use bmq_dataplane::{
    AppsOf, ClosedFiles, CompactionDone, CompactionTicket, DomainPolicies, Partition,
    PartitionConfig, PartitionGauges, PartitionOutput, PartitionStats, Store, StoreConfig,
    SyncTicket,
};
use bmq_proto::client::ClientMessage;
use bmq_proto::peer::PartitionMessage;
use bmq_proto::{LeaseId, NodeId, PartitionId, SessionAddr};
use tracing::{debug, error};

pub use super::shell::wall_clock_ms;
use super::shell::{DiskWorker, GroupCommit, Timer};

/// Where a partition's outputs go: implemented by the router, which knows where sessions and
/// peers are. Every method is non-blocking (`try_send` into a bounded queue).
pub trait PartitionOutbox: Send + Sync + 'static {
    /// Answers and pushes for sessions, local or on other nodes, in order per session. What a
    /// full inbox or queue or a gone session cannot take is dropped and counted: PUTs are
    /// retransmitted by the proxy and unconfirmed pushes redelivered, so nothing acknowledged
    /// is lost.
    fn to_sessions(&self, messages: Vec<(SessionAddr, ClientMessage)>);
    /// Replication messages for peers' partitions, in order per peer.
    fn to_peers(&self, messages: Vec<(NodeId, PartitionMessage)>);
    /// This node healed `partition` and serves it at `lease`: tell every node.
    fn primary_active(&self, partition: PartitionId, lease: LeaseId);
    /// This node is named primary of `partition` at `lease` but served that lease before a
    /// restart: tell every node (the leader names a primary at a higher lease).
    fn request_new_lease(&self, partition: PartitionId, lease: LeaseId);
}

/// Client requests routed to this partition, in order, each with the session that sent it
/// (OpenQueue, Put, Confirm or CloseQueue).
#[derive(Message)]
#[rtype(result = "()")]
pub struct PartitionRequests {
    /// `(session, request)`.
    pub requests: Vec<(SessionAddr, ClientMessage)>,
}

/// A session ended (its client went away): release its consumers, counting a consumer failure
/// for every message they held.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PartitionSessionGone {
    /// The session.
    pub session: SessionAddr,
}

/// The node is stopping gracefully: push nothing new (see `node::graceful_stop`).
#[derive(Message)]
#[rtype(result = "()")]
pub struct StopDelivering;

/// A proxy node became unavailable: release every consumer it carried.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PartitionNodeGone {
    /// The node.
    pub node: NodeId,
}

/// Replication traffic from a peer, in order.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PartitionPeerMessages {
    /// The sender.
    pub from: NodeId,
    /// The messages.
    pub messages: Vec<PartitionMessage>,
}

/// The committed cluster state names `primary` at `lease` for this partition.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PartitionRoleChanged {
    /// The primary, if any.
    pub primary: Option<NodeId>,
    /// Its `primary_lease_id`.
    pub lease: LeaseId,
    /// Whether the committed status is ACTIVE.
    pub active: bool,
    /// The voters that replicate this lease (empty: the configured members).
    pub replicas: Vec<NodeId>,
}

/// The membership's learners changed: as primary, the partition streams its journal to them
/// without counting them in any quorum.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetPartitionLearners {
    /// The learners (members with the learner role).
    pub learners: Vec<NodeId>,
}

/// The quorum changed (members that must hold a record before it is committed).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetPartitionQuorum {
    /// The new quorum, this node included; 0 is a majority of each lease's replicas.
    pub quorum: usize,
}

/// The committed domains changed: the partition resolves queues against `policies` from now
/// on, and its open queues take their domain's new limits ([`Partition::handle_domains`]).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetPartitionDomains {
    /// Every domain's policy, as committed.
    pub policies: Arc<DomainPolicies>,
}

/// Removes every outstanding message of queue `uri` (an operator's purge); answers how many
/// copies were removed, or `None` when this node is not the partition's active primary.
#[derive(Message)]
#[rtype(result = "Option<usize>")]
pub struct PurgeQueue {
    /// The queue.
    pub uri: String,
}

/// Sent by the actor to itself: fsync what was written (group commit).
#[derive(Message)]
#[rtype(result = "()")]
struct FlushJournal;

/// Sent by the partition's sync thread: the fsync of `ticket` finished with `result`.
#[derive(Message)]
#[rtype(result = "()")]
struct JournalSynced {
    ticket: SyncTicket,
    result: std::io::Result<()>,
}

/// Sent by the partition's compaction thread: a journal compaction's copy finished.
#[derive(Message)]
#[rtype(result = "()")]
struct JournalCompacted {
    done: CompactionDone,
}

/// Asks for the partition's figures (for `/status` and the gauges); `None` while its journal
/// is not open.
#[derive(Message)]
#[rtype(result = "Option<PartitionStats>")]
pub struct GetPartitionStats;

/// Asks for the partition's O(1) figures ([`Partition::gauges`]: role, lease, sequences,
/// whether it follows its primary), without the per-queue totals of [`GetPartitionStats`];
/// `None` while its journal is not open.
#[derive(Message)]
#[rtype(result = "Option<PartitionGauges>")]
pub struct GetPartitionGauges;

/// The shell around one partition's core (see the module doc).
pub struct PartitionActor {
    id: PartitionId,
    /// Built in `started` (on the partition's thread) once the journal is open.
    core: Option<Partition>,
    /// What `started` opens: the journal's directory and settings, and the core's settings.
    opening: Option<(std::path::PathBuf, StoreConfig, PartitionConfig)>,
    /// The app ids each queue's messages are stored for, as the node's domains say now
    /// (`crate::domains::DomainCache::apps_of`).
    apps_of: AppsOf,
    outbox: Arc<dyn PartitionOutbox>,
    mailbox_capacity: usize,
    /// The core's next deadline.
    timer: Timer,
    /// A [`FlushJournal`] is in the mailbox.
    group_commit: GroupCommit,
    /// The sync thread (one fsync at a time: the core hands out the next one only after the
    /// last one's outcome is back).
    syncer: DiskWorker<SyncTicket>,
    /// The closer thread: files of deleted journal segments, to remove and close (the last
    /// close frees their pages and blocks, which can hold the thread).
    closer: DiskWorker<ClosedFiles>,
    /// The compaction thread: copies of compacted journal segments (reading, writing and
    /// fsyncing a segment's live records), one at a time.
    compactor: DiskWorker<CompactionTicket>,
    /// A journal write or fsync failed: the node is stopping; nothing more is written or sent.
    failed: bool,
    /// `bmq_partition_turn_seconds{partition}`: how long each input held the thread.
    turn_seconds: metrics::Histogram,
}

/// Records, when dropped, how long the partition's thread has spent since it was made: one
/// turn, the handling of one input with what it set off (journal writes, maintenance —
/// deletions, putting a compacted segment in place —, replication, answers). Every request of
/// the partition waits behind a long one, so a stall (a table resize, a slow disk call) shows
/// here before it shows in the ACK latency.
struct Turn {
    started: Instant,
    histogram: metrics::Histogram,
}

impl Turn {
    fn start(histogram: &metrics::Histogram) -> Self {
        Turn {
            started: Instant::now(),
            histogram: histogram.clone(),
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.histogram.record(self.started.elapsed().as_secs_f64());
    }
}

/// Runs the fsync of `ticket` and records its duration (`bmq_journal_fsync_seconds`).
fn run_ticket(ticket: &SyncTicket) -> std::io::Result<()> {
    let started = Instant::now();
    let result = ticket.run();
    metrics::histogram!("bmq_journal_fsync_seconds").record(started.elapsed().as_secs_f64());
    result
}

/// Removes and closes the files of deleted journal segments; a failure only delays the
/// reclaiming of their space (the next open removes what is left), so it is logged and counted.
fn finish_closed(partition: PartitionId, closed: ClosedFiles) {
    if let Err(e) = closed.finish() {
        metrics::counter!("bmq_journal_delete_errors_total").increment(1);
        tracing::warn!(%partition, error = %e, "cannot remove a deleted journal segment: its space returns at the next start");
    }
}

impl PartitionActor {
    /// An actor for partition `id` whose journal is in `dir`: the journal is opened (and the
    /// core built with `cfg`) when the actor starts, on its own thread; a journal that cannot
    /// be opened (I/O error, corruption) stops the node — serving without it could lose
    /// acknowledged messages.
    pub fn new(
        id: PartitionId,
        dir: std::path::PathBuf,
        store: StoreConfig,
        cfg: PartitionConfig,
        apps_of: AppsOf,
        outbox: Arc<dyn PartitionOutbox>,
        mailbox_capacity: usize,
    ) -> Self {
        PartitionActor {
            id,
            core: None,
            opening: Some((dir, store, cfg)),
            apps_of,
            outbox,
            mailbox_capacity,
            timer: Timer::new(),
            group_commit: GroupCommit::new(),
            syncer: DiskWorker::none(),
            closer: DiskWorker::none(),
            compactor: DiskWorker::none(),
            failed: false,
            turn_seconds: metrics::histogram!("bmq_partition_turn_seconds", "partition" => id.to_string()),
        }
    }

    /// Executes the core's outputs: journal writes, sends, answers. The writes of one drain
    /// are fsynced together, and only then does the core hear `on_persisted`.
    fn drive(&mut self, ctx: &mut Context<Self>) {
        if self.failed {
            return;
        }
        let Some(core) = self.core.as_mut() else {
            return;
        };
        let mut fatal = None;
        let mut replies = Vec::new();
        let mut sends = Vec::new();
        while let Some(output) = core.poll_output() {
            match output {
                PartitionOutput::SendPeer { to, message } => sends.push((to, message)),
                PartitionOutput::Reply { to, message } => replies.push((to, message)),
                PartitionOutput::AnnounceActive { lease } => {
                    self.outbox.primary_active(self.id, lease);
                }
                PartitionOutput::RequestNewLease { lease } => {
                    self.outbox.request_new_lease(self.id, lease);
                }
                PartitionOutput::Fatal { error } => {
                    fatal = Some(error);
                    break;
                }
                PartitionOutput::Sync { ticket } => Self::run_sync(&self.syncer, core, ticket),
                PartitionOutput::Close { files } => {
                    // Without the closer thread they close here.
                    if let Err(files) = self.closer.send(files) {
                        finish_closed(self.id, files);
                    }
                }
                PartitionOutput::Compact { ticket } => {
                    // Only issued with the compaction thread running; should it have ended,
                    // the copy runs here and its outcome comes back like the thread's.
                    if let Err(ticket) = self.compactor.send(ticket) {
                        ctx.address()
                            .do_send(JournalCompacted { done: ticket.run() });
                    }
                }
            }
        }
        if let Some(error) = fatal {
            self.fatal(&error);
            return;
        }
        if !sends.is_empty() {
            self.outbox.to_peers(sends);
        }
        if !replies.is_empty() {
            self.outbox.to_sessions(replies);
        }
        let needs_sync = core.needs_sync();
        let timeout = core.poll_timeout();
        self.publish_counters();
        // Group commit: every request already waiting is written before the one fsync.
        if needs_sync && self.group_commit.request(ctx, FlushJournal) {
            self.flush(ctx);
            return;
        }
        self.timer
            .arm(ctx, timeout, |actor| &mut actor.timer, Self::on_timer);
    }

    /// The timer fired: the core handles what is due, then `drive` re-arms it.
    fn on_timer(&mut self, ctx: &mut Context<Self>) {
        let _turn = Turn::start(&self.turn_seconds);
        if let Some(core) = self.core.as_mut() {
            core.handle_timeout(Instant::now());
        }
        self.publish_gauges();
        self.drive(ctx);
    }

    /// Publishes what the core counted since the last call.
    fn publish_counters(&mut self) {
        let Some(core) = self.core.as_mut() else {
            return;
        };
        let c = core.take_counters();
        let counters = [
            ("bmq_queue_put_total", c.puts),
            ("bmq_queue_put_duplicates_total", c.put_duplicates),
            ("bmq_queue_ack_total", c.acks),
            ("bmq_queue_push_total", c.pushes),
            ("bmq_queue_redeliveries_total", c.redeliveries),
            ("bmq_queue_confirm_total", c.confirms),
            ("bmq_queue_consumer_failures_total", c.consumer_failures),
            ("bmq_partition_invalid_requests_total", c.invalid_requests),
        ];
        for (name, n) in counters {
            if n > 0 {
                metrics::counter!(name).increment(n);
            }
        }
        for (reason, n) in [
            ("limit_reached", c.nacks_limit_reached),
            ("unknown_queue", c.nacks_unknown_queue),
            ("quota", c.nacks_quota),
            ("storage_failure", c.nacks_storage_failure),
            ("invalid", c.nacks_invalid),
            ("guid_conflict", c.nacks_guid_conflict),
        ] {
            if n > 0 {
                metrics::counter!("bmq_queue_nack_total", "reason" => reason).increment(n);
            }
        }
        for (reason, n) in [
            ("ttl", c.removed_ttl),
            ("attempts_exhausted", c.removed_attempts_exhausted),
            ("purged", c.removed_purged),
            ("app_removed", c.removed_app_removed),
        ] {
            if n > 0 {
                metrics::counter!("bmq_queue_removed_total", "reason" => reason).increment(n);
            }
        }
        if c.consumers_closed > 0 {
            metrics::counter!("bmq_queue_consumers_closed_total").increment(c.consumers_closed);
        }
    }

    /// The partition's gauges (role, lease, replication lag, committed sequence, journal):
    /// O(1) in the number of queues, so cheap on every timer tick of a primary with 100,000
    /// queues (the totals over the queues are read only for [`GetPartitionStats`]).
    fn publish_gauges(&self) {
        if let Some(core) = self.core.as_ref() {
            self.publish(&core.gauges());
        }
    }

    /// Sets the gauges of [`PartitionActor::publish_gauges`] from `s`.
    fn publish(&self, s: &PartitionGauges) {
        let p = self.id.to_string();
        let primary = s.role != bmq_dataplane::PartitionRole::Replica;
        let active = s.role == bmq_dataplane::PartitionRole::Active;
        metrics::gauge!("bmq_partition_is_primary", "partition" => p.clone()).set(if primary {
            1.0
        } else {
            0.0
        });
        metrics::gauge!("bmq_partition_primary_active", "partition" => p.clone()).set(if active {
            1.0
        } else {
            0.0
        });
        metrics::gauge!("bmq_partition_primary_lease_id", "partition" => p.clone())
            .set(s.lease.0 as f64);
        // The primary's figures, 0 on a replica (the core's): set on every node, so that one
        // that stepped down does not keep showing the lag it had as primary.
        metrics::gauge!("bmq_partition_replication_lag_records", "partition" => p.clone())
            .set(s.replication_lag as f64);
        metrics::gauge!("bmq_partition_committed_sequence", "partition" => p.clone())
            .set(s.committed as f64);
        let j = &s.store;
        for (name, v) in [
            ("bmq_journal_bytes", j.bytes),
            ("bmq_journal_segments", j.segments as u64),
            ("bmq_journal_outstanding_messages", j.outstanding as u64),
            ("bmq_journal_live_bytes", j.live_bytes),
            ("bmq_journal_cache_bytes", j.cache_bytes),
            ("bmq_journal_settled_sequence", j.base),
            ("bmq_journal_floor_sequence", j.floor),
        ] {
            metrics::gauge!(name, "partition" => p.clone()).set(v as f64);
        }
        metrics::gauge!("bmq_journal_disk_full", "partition" => p.clone()).set(if s.disk_full {
            1.0
        } else {
            0.0
        });
        metrics::gauge!("bmq_journal_needs_install", "partition" => p).set(if s.needs_install {
            1.0
        } else {
            0.0
        });
    }

    /// The group-commit point: the core writes what waits in the journal's buffer and hands
    /// out the fsync ([`PartitionOutput::Sync`]), which `drive` gives the sync thread; when
    /// it answers ([`JournalSynced`]) the core releases what waited for it (receipts, ACKs,
    /// deliveries) and reclaims space. While one fsync runs, the core hands out no other.
    fn flush(&mut self, ctx: &mut Context<Self>) {
        self.group_commit.take();
        if self.failed {
            return;
        }
        if let Some(core) = self.core.as_mut() {
            core.handle_flush(Instant::now());
        }
        self.drive(ctx);
    }

    /// Gives the fsync to the sync thread; without it (it failed to start) the fsync runs here
    /// and its outcome goes straight back to the core, whose new outputs `drive` goes on with.
    fn run_sync(syncer: &DiskWorker<SyncTicket>, core: &mut Partition, ticket: SyncTicket) {
        if let Err(ticket) = syncer.send(ticket) {
            let result = run_ticket(&ticket);
            core.handle_synced(Instant::now(), ticket, result);
        }
    }

    fn fatal(&mut self, error: &str) {
        self.failed = true;
        error!(partition = %self.id, %error, "journal failed: stopping the node");
        actix::System::current().stop_with_code(1);
    }
}

impl Actor for PartitionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox_capacity);
        // The sync thread: runs one fsync at a time and answers each. `do_send` is
        // rate-bounded: one answer per ticket, and a ticket is issued only after the previous
        // one was answered.
        let id = self.id;
        let addr = ctx.address();
        self.syncer = DiskWorker::start(format!("bmq-sync-{id}"), move |ticket: SyncTicket| {
            let result = run_ticket(&ticket);
            addr.do_send(JournalSynced { ticket, result });
        });
        // The closer thread: removes and closes the files of deleted journal segments, in
        // order, so the partition never waits while the kernel frees them.
        self.closer = DiskWorker::start(format!("bmq-close-{id}"), move |closed| {
            finish_closed(id, closed)
        });
        // The compaction thread: copies the live records of a segment being compacted while
        // the partition goes on; the copy is put in place on the partition's thread.
        let addr = ctx.address();
        self.compactor = DiskWorker::start(
            format!("bmq-compact-{id}"),
            move |ticket: CompactionTicket| {
                addr.do_send(JournalCompacted { done: ticket.run() });
            },
        );
        let Some((dir, store, cfg)) = self.opening.take() else {
            return;
        };
        let started = Instant::now();
        let disk = std::sync::Arc::new(bmq_storage::disk::RealDisk);
        match Store::open_or_quarantine(disk, &dir, store, self.apps_of.clone()) {
            Ok(mut store) => {
                store.set_defer_close(self.closer.is_running());
                store.set_background_compaction(self.compactor.is_running());
                let stats = store.stats();
                tracing::info!(
                    partition = %self.id,
                    outstanding = stats.outstanding,
                    bytes = stats.bytes,
                    segments = stats.segments,
                    last_sequence = stats.last_sequence,
                    took_ms = started.elapsed().as_millis() as u64,
                    "partition journal opened"
                );
                self.core = Some(Partition::new(cfg, store));
                self.publish_gauges();
            }
            Err(e) => {
                error!(partition = %self.id, error = %e, "cannot open the partition journal");
                self.fatal(&e.to_string());
            }
        }
        debug!(partition = %self.id, "partition actor started");
    }
}

impl Handler<PartitionRequests> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionRequests, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if let Some(core) = self.core.as_mut() {
            core.handle_requests(Instant::now(), msg.requests);
        }
        self.drive(ctx);
    }
}

impl Handler<PartitionSessionGone> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionSessionGone, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if let Some(core) = self.core.as_mut() {
            core.handle_session_gone(Instant::now(), msg.session);
        }
        self.drive(ctx);
    }
}

impl Handler<StopDelivering> for PartitionActor {
    type Result = ();

    fn handle(&mut self, _msg: StopDelivering, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if let Some(core) = self.core.as_mut() {
            core.handle_stop_delivering(Instant::now());
        }
        self.drive(ctx);
    }
}

impl Handler<PartitionNodeGone> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionNodeGone, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if let Some(core) = self.core.as_mut() {
            core.handle_node_gone(Instant::now(), msg.node);
        }
        self.drive(ctx);
    }
}

impl Handler<PartitionPeerMessages> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionPeerMessages, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if let Some(core) = self.core.as_mut() {
            core.handle_peers(Instant::now(), msg.from, msg.messages);
        }
        self.drive(ctx);
    }
}

impl Handler<PartitionRoleChanged> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: PartitionRoleChanged, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if let Some(core) = self.core.as_mut() {
            core.handle_role(
                Instant::now(),
                msg.primary,
                msg.lease,
                msg.active,
                &msg.replicas,
            );
        }
        self.publish_gauges();
        self.drive(ctx);
    }
}

impl Handler<SetPartitionLearners> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: SetPartitionLearners, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if let Some(core) = self.core.as_mut() {
            core.set_learners(Instant::now(), &msg.learners);
        }
        self.drive(ctx);
    }
}

impl Handler<SetPartitionQuorum> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: SetPartitionQuorum, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if let Some(core) = self.core.as_mut() {
            core.set_quorum(Instant::now(), msg.quorum);
        }
        self.drive(ctx);
    }
}

impl Handler<SetPartitionDomains> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: SetPartitionDomains, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if let Some(core) = self.core.as_mut() {
            core.handle_domains(Instant::now(), msg.policies);
        } else if let Some((_, _, cfg)) = self.opening.as_mut() {
            cfg.policies = msg.policies;
        }
        self.drive(ctx);
    }
}

impl Handler<FlushJournal> for PartitionActor {
    type Result = ();

    fn handle(&mut self, _msg: FlushJournal, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if self.group_commit.take() {
            self.flush(ctx);
        }
    }
}

impl Handler<JournalSynced> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: JournalSynced, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if self.failed {
            return;
        }
        if let Some(core) = self.core.as_mut() {
            // A failure is a `Fatal` output, which `drive` acts on.
            core.handle_synced(Instant::now(), msg.ticket, msg.result);
        }
        // More may have been written meanwhile: `drive` queues the next flush.
        self.drive(ctx);
    }
}

impl Handler<JournalCompacted> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: JournalCompacted, ctx: &mut Self::Context) {
        let _turn = Turn::start(&self.turn_seconds);
        if self.failed {
            return;
        }
        if let Some(core) = self.core.as_mut() {
            // A failure is a `Fatal` output, which `drive` acts on.
            core.handle_compacted(Instant::now(), msg.done);
        }
        self.drive(ctx);
    }
}

impl Handler<GetPartitionStats> for PartitionActor {
    type Result = MessageResult<GetPartitionStats>;

    fn handle(&mut self, _msg: GetPartitionStats, _ctx: &mut Self::Context) -> Self::Result {
        let stats = self.core.as_ref().map(Partition::stats);
        if let Some(stats) = &stats {
            self.publish(&stats.gauges);
            let p = self.id.to_string();
            metrics::gauge!("bmq_partition_messages", "partition" => p.clone())
                .set(stats.messages as f64);
            metrics::gauge!("bmq_partition_journal_last_sequence", "partition" => p)
                .set(stats.gauges.last_sequence as f64);
        }
        MessageResult(stats)
    }
}

impl Handler<GetPartitionGauges> for PartitionActor {
    type Result = MessageResult<GetPartitionGauges>;

    fn handle(&mut self, _msg: GetPartitionGauges, _ctx: &mut Self::Context) -> Self::Result {
        MessageResult(self.core.as_ref().map(Partition::gauges))
    }
}

impl Handler<PurgeQueue> for PartitionActor {
    type Result = Option<usize>;

    fn handle(&mut self, msg: PurgeQueue, ctx: &mut Self::Context) -> Option<usize> {
        let _turn = Turn::start(&self.turn_seconds);
        let core = self.core.as_mut()?;
        if core.role() != bmq_dataplane::PartitionRole::Active {
            return None;
        }
        let removed = core.handle_purge(Instant::now(), &msg.uri);
        self.drive(ctx);
        Some(removed)
    }
}
