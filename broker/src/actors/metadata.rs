//! `MetadataActor`: the actix shell around [`MetadataCore`] and the [`Ledger`].
//!
//! - **Role**: one per node. Owns the metadata core and the ledger; executes the core's outputs
//!   in order; publishes the committed cluster state.
//! - **Group commit** ([`GroupCommit`]): while handling the messages already in its
//!   mailbox, the actor only buffers — records into the ledger's buffer, peer messages into a
//!   [`PeerOutbox`]. The first of them to produce something sends the actor a `FlushLedger`,
//!   which lands behind them; that one *flush* sends every peer one frame (a
//!   `MetadataBatch` of everything for it), publishes the committed state once, writes the
//!   buffered records with one `write` and, if an advisory record is among them, hands one
//!   fsync to the ledger's *sync thread*; its completion (`LedgerSynced`) tells the core
//!   `on_persisted` — which releases the acks (a follower's) and the leader's own vote. At
//!   most one fsync runs at a time: records written meanwhile wait in the ledger's buffer,
//!   and the completion starts the next fsync, which covers them all. So a burst of proposals
//!   costs one fsync and one message per peer on the leader, and one fsync and one ack on each
//!   follower. While an fsync runs, peer messages wait for its completion and leave with the
//!   next fsync's start (one fsync's delay at most): under load the batches stay as large as
//!   when the fsync stopped the actor, and an idle node's first proposal leaves at once.
//!   Messages go out before the fsync so that the followers' fsyncs overlap the
//!   leader's: nothing that depends on durability is in them (acks are produced by
//!   `on_persisted`; a sync answer naming records not yet durable is checked by the new leader
//!   against what the node then sends, see `MetadataCore`). Commit records alone are written
//!   without an fsync: nobody waits for them, and the next fsync covers them. A ledger reset
//!   (a follower's history replaced) voids the fsync running at the time: its records are gone,
//!   so its completion releases nothing (`ledger_generation`).
//! - **Receives**: [`MetadataInbound`] (peer messages, from the control-channel peer links),
//!   [`LeaderChanged`] (from the elector), [`Propose`] and [`RequestQueueAssignment`] (from the
//!   health actor, partitions, client sessions), [`SubscribeState`], [`SubscribeProposals`],
//!   [`GetMetadataStatus`] (admin `/status`), [`SetMetadataQuorum`] (admin).
//! - **Sends**: [`MetadataOutbound`] to the transport (`to: None` = every peer);
//!   [`ClusterStateCommitted`] to subscribers after each commit, role change or ledger reset;
//!   each queue assignment the core reports proposed (`MetadataOutput::AssignmentProposed`,
//!   right after its record is written, before its commit) to the [`ProposalWatcher`]s (the
//!   router: an open goes to the proposed partition's primary while the commit is under way).
//! - **Timers**: a single [`Timer`], re-armed after every input from the core's
//!   `poll_timeout`, never cancelled.
//! - **Failure**: a ledger write or fsync error is logged (with why it is fatal) and stops the
//!   actor and the system with exit code 1 (never retry an fsync): the core is not told
//!   `on_persisted` for what the failed fsync covered, so no ack, vote or commit rests on it,
//!   and the ledger refuses every later write and sync. The node starts it and stops the
//!   system if it stops.
//! - **Clock**: the ledger reads none; the actor sets its wall clock
//!   (`Ledger::set_wall_clock_ms`) before writing, for the records' timestamps.
//! - **Threads**: the actor runs on the node's main thread, beside the peer links and the
//!   client sessions, so a proposal reaches the peers and an ack reaches the core without a
//!   hand-off between threads (each costs a thread wake-up; docs/bench/JOURNAL.md "Metadata
//!   without thread hand-offs"). The ledger's disk work has two [`DiskWorker`]s of its own,
//!   started when first needed: `bmq-ledger-sync` runs the fsyncs, a rollover's switch to its
//!   new file and a reset's new file; `bmq-ledger-rewrite` runs a rollover's snapshot (the
//!   whole state encoded, written and fsynced, while the fsyncs go on) and frees the blocks of
//!   the files the ledger let go of. A worker that is gone (or could not start) is a failed
//!   fsync: the node stops. What runs on the main thread: writing records (a `write` of a few
//!   hundred bytes), applying commits (O(log n) in the state's size), and, when a failover
//!   finds a follower whose history differs from the new leader's (or the new leader adopts
//!   another node's state), one whole copy of the state; the peer links' heartbeat tolerance
//!   covers that. The usual failover's term start names a history and copies nothing.
//! - **Metrics**: gauges `bmq_metadata_lsn_term`, `bmq_metadata_lsn_sequence`,
//!   `bmq_metadata_committed_lsn_term`, `bmq_metadata_committed_lsn_sequence`,
//!   `bmq_metadata_role` (0 follower, 1 passive leader, 2 active leader), `bmq_metadata_uncommitted_advisories`,
//!   `bmq_metadata_ledger_bytes`; counter `bmq_metadata_ledger_rollovers_total`; histogram
//!   `bmq_metadata_commit_latency_seconds` (propose to commit, on the leader).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use bmq_proto::{peer, NodeId, PartitionId, Term};
use tracing::{debug, error};

use super::shell::{wall_clock_ms, DiskWorker, GroupCommit, Timer};

use bmq_metadata::{
    ClusterState, LearnerProgress, Ledger, LedgerError, LedgerRecord, LedgerRelease,
    LedgerSnapshot, LedgerSync, Lsn, MetadataCore, MetadataOutput, MetadataRole, MetadataStatus,
    PeerOutbox, ProposeError, SnapshotWritten, SyncDone,
};

/// Mailbox capacity of the metadata actor. Metadata traffic is small and rate-bounded by the
/// elector and by client queue opens.
pub const METADATA_MAILBOX_CAPACITY: usize = 1024;

/// Proposals tracked for the commit latency histogram (a limit: entries of proposals that never
/// commit are dropped beyond it).
const COMMIT_LATENCY_TRACKED_MAX: usize = 4096;

/// A metadata message from a peer.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct MetadataInbound {
    /// The sending node.
    pub from: NodeId,
    /// The message.
    pub message: peer::MetadataMessage,
}

/// The elector's leadership changed (`leader == Some(self)`: this node leads `term`).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct LeaderChanged {
    /// The term.
    pub term: Term,
    /// The leader of that term, if any.
    pub leader: Option<NodeId>,
}

/// Propose an advisory (active leader only). Answers its LSN or why it was refused.
#[derive(Debug, Message)]
#[rtype(result = "Result<Lsn, ProposeError>")]
pub struct Propose {
    /// The advisory.
    pub advisory: peer::Advisory,
}

/// Ask for a queue to be assigned to a partition (forwarded to the leader when not leading).
/// Fire and forget: subscribe to [`ClusterStateCommitted`] to see the result, retry if absent.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct RequestQueueAssignment {
    /// The queue URI.
    pub uri: String,
}

/// Subscribe to committed state changes; the current state is sent at once.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SubscribeState {
    /// Where to send [`ClusterStateCommitted`].
    pub subscriber: Recipient<ClusterStateCommitted>,
}

/// Told of each queue assignment this node's ledger takes in before it commits (on the leader
/// as it proposes, on a follower as it receives the proposal), so an open can go to the
/// proposed partition's primary while the commit is under way (`Router::watch_proposal`).
pub trait ProposalWatcher: Send + Sync {
    /// An uncommitted assignment of `uri` to `partition` was written to the ledger. Called on
    /// the actor's thread: must not block.
    fn assignment_proposed(&self, uri: &str, partition: PartitionId);
}

/// Subscribe to queue assignments as they are proposed (see [`ProposalWatcher`]).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SubscribeProposals {
    /// Who is told.
    pub watcher: Arc<dyn ProposalWatcher>,
}

/// Ask for the current status and committed state.
#[derive(Debug, Message)]
#[rtype(result = "MetadataSnapshot")]
pub struct GetMetadataStatus;

/// A peer told of a newer committed membership: accept messages from its members
/// ([`MetadataCore::learn_members`]).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct LearnMembers {
    /// The members of that membership.
    pub members: Vec<NodeId>,
}

/// Change the metadata quorum at runtime (`0` = majority).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SetMetadataQuorum {
    /// The new quorum.
    pub quorum: usize,
}

/// Answer to [`GetMetadataStatus`].
#[derive(Debug, Clone, MessageResponse)]
pub struct MetadataSnapshot {
    /// The core's position.
    pub status: MetadataStatus,
    /// The committed state.
    pub state: ClusterState,
    /// The epochs of the committed and of the proposed membership (they differ while a change
    /// is uncommitted; see [`MetadataCore::membership_epochs`]).
    pub membership_epochs: (u64, u64),
    /// Each learner's latest report of its catch-up ([`MetadataCore::learner_progress`]).
    pub learner_progress: Vec<(NodeId, LearnerProgress)>,
}

/// A metadata message for the transport: `to: None` means every peer.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct MetadataOutbound {
    /// The destination, or `None` for all peers.
    pub to: Option<NodeId>,
    /// The message.
    pub message: peer::MetadataMessage,
}

/// Published to subscribers: the committed state changed, or the role did.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct ClusterStateCommitted {
    /// The core's position.
    pub status: MetadataStatus,
    /// The committed state.
    pub state: Arc<ClusterState>,
}

/// The ledger's fsync of [`SyncJob::sync`] is done: [`MetadataCore::on_persisted`] for its
/// records, unless the ledger was reset since it started.
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct LedgerSynced {
    lsn: Option<Lsn>,
    generation: u64,
    result: Result<SyncDone, LedgerError>,
}

/// One fsync for the sync thread (`bmq-ledger-sync`), which runs one at a time and answers
/// [`LedgerSynced`]; the actor keeps at most one in flight.
struct SyncJob {
    sync: LedgerSync,
    /// The last record it covers (`None`: none this node waits for).
    lsn: Option<Lsn>,
    /// [`MetadataActor::ledger_generation`] when it started.
    generation: u64,
}

/// Sent by the actor to itself: the end of a turn (group commit, see [`GroupCommit`]).
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct FlushLedger;

/// Work for the ledger's rewrite thread.
enum RewriteJob {
    /// A rollover's snapshot; answered by [`SnapshotDone`].
    Snapshot(LedgerSnapshot),
    /// A file's blocks to free; no answer.
    Release(LedgerRelease),
}

/// A rollover's snapshot is written ([`Ledger::complete_snapshot`]).
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct SnapshotDone {
    result: Result<SnapshotWritten, LedgerError>,
}

/// The metadata actor's metrics (METRICS.md), registered when the actor is made.
struct MetadataMetrics {
    lsn_term: metrics::Gauge,
    lsn_sequence: metrics::Gauge,
    committed_lsn_term: metrics::Gauge,
    committed_lsn_sequence: metrics::Gauge,
    role: metrics::Gauge,
    uncommitted_advisories: metrics::Gauge,
    ledger_bytes: metrics::Gauge,
    ledger_rollovers: metrics::Counter,
    commit_latency: metrics::Histogram,
}

impl MetadataMetrics {
    fn register() -> Self {
        MetadataMetrics {
            lsn_term: metrics::gauge!("bmq_metadata_lsn_term"),
            lsn_sequence: metrics::gauge!("bmq_metadata_lsn_sequence"),
            committed_lsn_term: metrics::gauge!("bmq_metadata_committed_lsn_term"),
            committed_lsn_sequence: metrics::gauge!("bmq_metadata_committed_lsn_sequence"),
            role: metrics::gauge!("bmq_metadata_role"),
            uncommitted_advisories: metrics::gauge!("bmq_metadata_uncommitted_advisories"),
            ledger_bytes: metrics::gauge!("bmq_metadata_ledger_bytes"),
            ledger_rollovers: metrics::counter!("bmq_metadata_ledger_rollovers_total"),
            commit_latency: metrics::histogram!("bmq_metadata_commit_latency_seconds"),
        }
    }
}

/// The metadata actor. See the module documentation.
pub struct MetadataActor {
    core: MetadataCore,
    ledger: Ledger,
    transport: Recipient<MetadataOutbound>,
    subscribers: Vec<Recipient<ClusterStateCommitted>>,
    /// Told of queue assignments as they are proposed ([`SubscribeProposals`]).
    proposal_watchers: Vec<Arc<dyn ProposalWatcher>>,
    /// The core's next deadline.
    timer: Timer,
    proposed_at: HashMap<Lsn, Instant>,
    rollovers_reported: u64,
    /// The actor's metrics, registered once (a registry look-up allocates, and the flush
    /// runs on every turn).
    metrics: MetadataMetrics,
    /// Peer messages of this turn, sent at the flush.
    outbox: PeerOutbox,
    /// The membership epochs (committed, proposed) the outbox's peers were taken at.
    outbox_epochs: (u64, u64),
    /// The last record written to the ledger's buffer since the last flush.
    written: Option<Lsn>,
    /// An advisory record is among them: the flush starts an fsync, whose completion
    /// (`LedgerSynced`) calls `on_persisted`.
    advisory_unsynced: bool,
    /// The ledger's fsync thread; started at the first sync.
    syncer: Option<DiskWorker<SyncJob>>,
    /// An fsync runs on the sync thread (at most one at a time).
    sync_in_flight: bool,
    /// The ledger's rewrite thread (the slow disk work that no fsync may wait behind: a
    /// rollover's snapshot, at most one at a time, and the files to release, at most one per
    /// rollover or reset); started at the first rollover.
    rewriter: Option<DiskWorker<RewriteJob>>,
    /// Raised by each ledger reset: an fsync started before it covered records of a history
    /// that is gone, so its completion releases nothing.
    ledger_generation: u64,
    /// The committed state or the role changed this turn: the flush publishes.
    changed: bool,
    /// A [`FlushLedger`] is in the mailbox.
    group_commit: GroupCommit,
}

impl MetadataActor {
    /// An actor driving `core`, writing to `ledger` (opened on the same history the core was
    /// built from), sending peer messages to `transport`.
    pub fn new(core: MetadataCore, ledger: Ledger, transport: Recipient<MetadataOutbound>) -> Self {
        let outbox = PeerOutbox::new(core.peers());
        let outbox_epochs = core.membership_epochs();
        MetadataActor {
            core,
            ledger,
            transport,
            subscribers: Vec::new(),
            proposal_watchers: Vec::new(),
            timer: Timer::new(),
            proposed_at: HashMap::new(),
            rollovers_reported: 0,
            metrics: MetadataMetrics::register(),
            outbox_epochs,
            outbox,
            written: None,
            advisory_unsynced: false,
            syncer: None,
            sync_in_flight: false,
            rewriter: None,
            ledger_generation: 0,
            changed: false,
            group_commit: GroupCommit::new(),
        }
    }

    fn publication(&self) -> ClusterStateCommitted {
        ClusterStateCommitted {
            status: self.core.status(),
            // O(1): the state's maps are persistent and shared with the core's.
            state: Arc::new(self.core.state().clone()),
        }
    }

    fn publish(&mut self) {
        let message = self.publication();
        // One copy of the committed state for the core, the ledger and the subscribers.
        self.ledger
            .share_committed_state(message.status.committed_lsn, &message.state);
        // do_send: commits are bounded by the leader's uncommitted limit; a closed subscriber is
        // dropped from the list.
        self.subscribers.retain(|s| s.connected());
        for s in &self.subscribers {
            s.do_send(message.clone());
        }
    }

    /// Stops the node after a ledger failure (never retry an fsync): the ledger refuses
    /// everything from then on, this actor stops (no more acks, votes or commits from this
    /// node) and the system stops with exit code 1. Nothing the failed write or fsync covered
    /// was reported to the core as persisted.
    fn fail(&mut self, ctx: &mut Context<Self>, what: &str, error: &bmq_metadata::LedgerError) {
        error!(
            error = %error,
            what,
            reason = "a ledger write or fsync failed: what it covered may not be on disk, and a \
                      failed fsync is never retried nor counted as durable",
            "metadata ledger failed; this node stops acting as a metadata member and stops \
             (exit code 1); restart it once the disk is sound: it replays what its ledger holds"
        );
        System::current().stop_with_code(1);
        ctx.stop();
    }

    /// Drains the core's outputs into the ledger's buffer, the outbox and the publication
    /// flag, then asks for the flush (after the messages already in the mailbox; at once when
    /// the mailbox is full) and re-arms the timer. Returns false when the node is stopping.
    fn drive(&mut self, ctx: &mut Context<Self>) -> bool {
        if !self.drain_outputs(ctx) {
            return false;
        }
        let pending = !self.outbox.is_empty()
            || self.written.is_some()
            || self.changed
            || self.ledger.rewrite_due();
        if pending && self.group_commit.request(ctx, FlushLedger) {
            self.flush(ctx);
        }
        self.arm_timer(ctx);
        true
    }

    fn drain_outputs(&mut self, ctx: &mut Context<Self>) -> bool {
        // The ledger reads no clock: the records written now carry this time.
        self.ledger.set_wall_clock_ms(wall_clock_ms());
        // Broadcasts go to the members of the committed and the proposed membership (a
        // learner receives the ledger from the record that adds it on).
        let epochs = self.core.membership_epochs();
        if epochs != self.outbox_epochs {
            self.outbox_epochs = epochs;
            self.outbox.set_peers(self.core.peers());
        }
        while let Some(output) = self.core.poll_output() {
            match output {
                MetadataOutput::Persist { record } => {
                    let lsn = record.lsn();
                    if let Err(e) = self.ledger.write(&record) {
                        self.fail(ctx, "write", &e);
                        return false;
                    }
                    self.written = Some(lsn);
                    if matches!(record, LedgerRecord::Update { .. }) {
                        self.advisory_unsynced = true;
                        // Commit latency covers every advisory this node stamps as leader
                        // (proposals from the health actor, queue assignments, the leader's
                        // snapshot), from `Propose` when there was one, else from this write.
                        let status = self.core.status();
                        if status.role != MetadataRole::Follower
                            && lsn.term == status.term
                            && self.proposed_at.len() < COMMIT_LATENCY_TRACKED_MAX
                        {
                            self.proposed_at.entry(lsn).or_insert_with(Instant::now);
                        }
                    }
                }
                MetadataOutput::ResetLedger {
                    state,
                    committed_lsn,
                    uncommitted,
                } => {
                    let last = uncommitted
                        .iter()
                        .map(|(l, _)| *l)
                        .fold(committed_lsn, Lsn::max);
                    // Replaces whatever was buffered; the new file is written by the next
                    // sync's work (on the sync thread), whose completion releases `last`. A
                    // sync running now covered the old history: it releases nothing.
                    if let Err(e) = self.ledger.reset_to(&state, committed_lsn, &uncommitted) {
                        self.fail(ctx, "reset", &e);
                        return false;
                    }
                    self.written = Some(last);
                    self.advisory_unsynced = true;
                    self.ledger_generation += 1;
                    self.changed = true;
                }
                MetadataOutput::Send { to, message } => self.outbox.push(Some(to), message),
                MetadataOutput::Broadcast { message } => self.outbox.push(None, message),
                MetadataOutput::Committed { lsn, advisory: _ } => {
                    if let Some(at) = self.proposed_at.remove(&lsn) {
                        self.metrics
                            .commit_latency
                            .record(at.elapsed().as_secs_f64());
                    }
                    self.changed = true;
                }
                MetadataOutput::AssignmentProposed { uri, partition } => {
                    for w in &self.proposal_watchers {
                        w.assignment_proposed(&uri, partition);
                    }
                }
                MetadataOutput::RoleChanged { status } => {
                    debug!(role = ?status.role, term = %status.term, "metadata role changed");
                    if status.role != MetadataRole::ActiveLeader {
                        self.proposed_at.clear();
                    }
                    self.changed = true;
                }
            }
        }
        true
    }

    /// The end of a turn (see the module doc): send, publish, write, and start the fsync on
    /// the sync thread (its completion, [`LedgerSynced`], lets the core release what waited
    /// for durability), until nothing is left.
    fn flush(&mut self, ctx: &mut Context<Self>) {
        self.group_commit.take();
        loop {
            // While an fsync runs, peer messages wait for its completion and leave together
            // with the next fsync's start: under load the batches stay as large as when the
            // fsync stopped the actor, and an idle node's first proposal leaves at once.
            let outgoing = if self.sync_in_flight {
                Vec::new()
            } else {
                self.outbox.drain()
            };
            for (to, message) in outgoing {
                // do_send: the transport's mailbox is bounded; metadata traffic is bounded by
                // the core's limits (uncommitted records, retry periods), and batched here.
                self.transport.do_send(MetadataOutbound {
                    to: Some(to),
                    message,
                });
            }
            if std::mem::take(&mut self.changed) {
                self.publish();
            }
            if let Some(snapshot) = self.ledger.begin_snapshot() {
                if !self.start_rewrite(ctx, RewriteJob::Snapshot(snapshot)) {
                    return;
                }
            }
            // A rollover's switch or a reset due is written even when only commit records
            // wait: until its new file exists they stay in memory.
            if self.advisory_unsynced || self.ledger.rewrite_due() {
                if self.sync_in_flight {
                    // The records wait in the ledger's buffer; the completion of the running
                    // fsync starts the next one, which covers them (group commit).
                    break;
                }
                self.advisory_unsynced = false;
                let lsn = self.written.take();
                match self.ledger.begin_sync() {
                    Err(e) => return self.fail(ctx, "write", &e),
                    Ok(Some(sync)) => {
                        self.start_sync(ctx, sync, lsn);
                        break;
                    }
                    // No fsync due (policy `never`): persisted once written.
                    Ok(None) => {
                        if let Some(lsn) = lsn {
                            self.core.on_persisted(Instant::now(), lsn);
                        }
                        if !self.drain_outputs(ctx) {
                            return;
                        }
                    }
                }
            } else if self.written.take().is_some() {
                // Only commit records: no one waits for their fsync.
                if let Err(e) = self.ledger.flush() {
                    return self.fail(ctx, "write", &e);
                }
            }
            // (Messages held while an fsync runs leave at its completion.)
            let sent_all = self.outbox.is_empty() || self.sync_in_flight;
            if sent_all && !self.changed && self.written.is_none() {
                break;
            }
        }
        self.update_metrics();
        self.arm_timer(ctx);
    }

    /// Hands `sync` to the sync thread; its completion releases `lsn` (the last record it
    /// covers) unless the ledger was reset meanwhile.
    fn start_sync(&mut self, ctx: &mut Context<Self>, sync: LedgerSync, lsn: Option<Lsn>) {
        let syncer = self.syncer.get_or_insert_with(|| {
            // A weak address: the thread must not keep the actor alive; it ends with the actor,
            // which holds its queue.
            let actor = ctx.address().downgrade();
            DiskWorker::start("bmq-ledger-sync".into(), move |job: SyncJob| {
                let result = job.sync.run();
                if let Some(actor) = actor.upgrade() {
                    // do_send: one answer per job, and one job at a time.
                    actor.do_send(LedgerSynced {
                        lsn: job.lsn,
                        generation: job.generation,
                        result,
                    });
                }
            })
        });
        let job = SyncJob {
            sync,
            lsn,
            generation: self.ledger_generation,
        };
        if syncer.send(job).is_err() {
            // The thread is gone only after a panic in an fsync (or never started): treat it
            // as a failed fsync.
            let e = LedgerError::Io {
                path: self.ledger.file_path(),
                source: std::io::Error::other("the ledger's fsync thread is gone"),
            };
            return self.fail(ctx, "fsync", &e);
        }
        self.sync_in_flight = true;
    }

    /// Hands `job` to the rewrite thread; false when the node is stopping.
    fn start_rewrite(&mut self, ctx: &mut Context<Self>, job: RewriteJob) -> bool {
        let rewriter = self.rewriter.get_or_insert_with(|| {
            // A weak address, as for the sync thread.
            let actor = ctx.address().downgrade();
            DiskWorker::start("bmq-ledger-rewrite".into(), move |job| match job {
                RewriteJob::Snapshot(snapshot) => {
                    let result = snapshot.run();
                    if let Some(actor) = actor.upgrade() {
                        // do_send: at most one snapshot at a time.
                        actor.do_send(SnapshotDone { result });
                    }
                }
                RewriteJob::Release(release) => release.run(),
            })
        });
        if rewriter.send(job).is_err() {
            // The thread is gone only after a panic in its disk work (or never started): stop,
            // as after an error.
            let e = LedgerError::Io {
                path: self.ledger.file_path(),
                source: std::io::Error::other("the ledger's rewrite thread is gone"),
            };
            self.fail(ctx, "rollover", &e);
            return false;
        }
        true
    }

    /// Hands the files the ledger let go of to the rewrite thread, to free their blocks.
    fn release_files(&mut self, ctx: &mut Context<Self>) {
        while let Some(release) = self.ledger.take_release() {
            if !self.start_rewrite(ctx, RewriteJob::Release(release)) {
                return;
            }
        }
    }

    fn update_metrics(&mut self) {
        let status = self.core.status();
        let m = &self.metrics;
        m.lsn_term.set(status.last_lsn.term.0 as f64);
        m.lsn_sequence.set(status.last_lsn.sequence as f64);
        m.committed_lsn_term.set(status.committed_lsn.term.0 as f64);
        m.committed_lsn_sequence
            .set(status.committed_lsn.sequence as f64);
        let role = match status.role {
            MetadataRole::Follower => 0.0,
            MetadataRole::PassiveLeader => 1.0,
            MetadataRole::ActiveLeader => 2.0,
        };
        m.role.set(role);
        m.uncommitted_advisories.set(status.uncommitted as f64);
        m.ledger_bytes.set(self.ledger.file_size() as f64);
        let rollovers = self.ledger.rollovers();
        if rollovers > self.rollovers_reported {
            m.ledger_rollovers
                .increment(rollovers - self.rollovers_reported);
            self.rollovers_reported = rollovers;
        }
    }

    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        let deadline = self.core.poll_timeout();
        self.timer
            .arm(ctx, deadline, |actor| &mut actor.timer, Self::on_timer);
    }

    /// The timer fired: the core handles what is due, then `drive` re-arms it.
    fn on_timer(&mut self, ctx: &mut Context<Self>) {
        self.core.handle_timeout(Instant::now());
        self.drive(ctx);
    }
}

impl Actor for MetadataActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(METADATA_MAILBOX_CAPACITY);
        self.drive(ctx);
    }
}

impl Handler<MetadataInbound> for MetadataActor {
    type Result = ();

    fn handle(&mut self, msg: MetadataInbound, ctx: &mut Self::Context) {
        self.core
            .handle_message(Instant::now(), msg.from, msg.message);
        self.drive(ctx);
    }
}

impl Handler<LedgerSynced> for MetadataActor {
    type Result = ();

    fn handle(&mut self, msg: LedgerSynced, ctx: &mut Self::Context) {
        self.sync_in_flight = false;
        let done = match msg.result {
            Ok(done) => done,
            Err(e) => return self.fail(ctx, "fsync", &e),
        };
        self.ledger.complete_sync(done);
        self.release_files(ctx);
        if let Some(lsn) = msg.lsn.filter(|_| msg.generation == self.ledger_generation) {
            self.core.on_persisted(Instant::now(), lsn);
        }
        // Commit records written while a rewrite ran waited in the buffer: hand them to the
        // file now (no one waits for their fsync).
        if let Err(e) = self.ledger.flush() {
            return self.fail(ctx, "write", &e);
        }
        // Records written while it ran (`written` is set) wait for the next fsync, which the
        // flush that `drive` schedules starts.
        self.drive(ctx);
    }
}

impl Handler<FlushLedger> for MetadataActor {
    type Result = ();

    fn handle(&mut self, _msg: FlushLedger, ctx: &mut Self::Context) {
        if self.group_commit.take() {
            self.flush(ctx);
        }
    }
}

impl Handler<SnapshotDone> for MetadataActor {
    type Result = ();

    fn handle(&mut self, msg: SnapshotDone, ctx: &mut Self::Context) {
        match msg.result {
            Ok(written) => self.ledger.complete_snapshot(written),
            Err(e) => return self.fail(ctx, "rollover", &e),
        }
        // A snapshot of a history since reset is discarded: its file is released.
        self.release_files(ctx);
        // The switch is due: `drive` schedules the flush that starts it (after the running
        // fsync, if one runs).
        self.drive(ctx);
    }
}

impl Handler<LeaderChanged> for MetadataActor {
    type Result = ();

    fn handle(&mut self, msg: LeaderChanged, ctx: &mut Self::Context) {
        self.core
            .handle_leadership(Instant::now(), msg.term, msg.leader);
        self.drive(ctx);
    }
}

impl Handler<Propose> for MetadataActor {
    type Result = Result<Lsn, ProposeError>;

    fn handle(&mut self, msg: Propose, ctx: &mut Self::Context) -> Self::Result {
        let now = Instant::now();
        let result = self.core.propose(now, msg.advisory);
        if let Ok(lsn) = result {
            if self.proposed_at.len() < COMMIT_LATENCY_TRACKED_MAX {
                self.proposed_at.entry(lsn).or_insert(now);
            }
        }
        self.drive(ctx);
        result
    }
}

impl Handler<RequestQueueAssignment> for MetadataActor {
    type Result = ();

    fn handle(&mut self, msg: RequestQueueAssignment, ctx: &mut Self::Context) {
        self.core.request_queue_assignment(Instant::now(), &msg.uri);
        self.drive(ctx);
    }
}

impl Handler<SubscribeState> for MetadataActor {
    type Result = ();

    fn handle(&mut self, msg: SubscribeState, _ctx: &mut Self::Context) {
        msg.subscriber.do_send(self.publication());
        self.subscribers.push(msg.subscriber);
    }
}

impl Handler<SubscribeProposals> for MetadataActor {
    type Result = ();

    fn handle(&mut self, msg: SubscribeProposals, _ctx: &mut Self::Context) {
        self.proposal_watchers.push(msg.watcher);
    }
}

impl Handler<GetMetadataStatus> for MetadataActor {
    type Result = MetadataSnapshot;

    fn handle(&mut self, _msg: GetMetadataStatus, _ctx: &mut Self::Context) -> MetadataSnapshot {
        MetadataSnapshot {
            status: self.core.status(),
            state: self.core.state().clone(),
            membership_epochs: self.core.membership_epochs(),
            learner_progress: self.core.learner_progress(),
        }
    }
}

impl Handler<LearnMembers> for MetadataActor {
    type Result = ();

    fn handle(&mut self, msg: LearnMembers, _ctx: &mut Self::Context) {
        self.core.learn_members(msg.members);
    }
}

impl Handler<SetMetadataQuorum> for MetadataActor {
    type Result = ();

    fn handle(&mut self, msg: SetMetadataQuorum, ctx: &mut Self::Context) {
        self.core.set_quorum(msg.quorum);
        self.drive(ctx);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use bmq_metadata::FsyncPolicy;

    /// A queue assignment advisory of `uri` to `partition` with queue key `key`.
    fn assign(uri: &str, partition: u32, key: u64) -> peer::Advisory {
        peer::Advisory {
            kind: Some(peer::advisory::Kind::QueueAssignment(
                peer::QueueAssignmentAdvisory {
                    queues: vec![peer::QueueInfo {
                        uri: uri.into(),
                        partition_id: partition,
                        queue_key: key,
                    }],
                },
            )),
        }
    }

    /// Collects everything sent to it.
    struct Sink<M: Message<Result = ()> + Send> {
        seen: Arc<Mutex<Vec<M>>>,
    }

    impl<M: Message<Result = ()> + Send + Unpin + 'static> Actor for Sink<M> {
        type Context = Context<Self>;
    }

    impl<M: Message<Result = ()> + Send + Unpin + 'static> Handler<M> for Sink<M> {
        type Result = ();
        fn handle(&mut self, msg: M, _ctx: &mut Self::Context) {
            self.seen.lock().unwrap().push(msg);
        }
    }

    #[actix_rt::test]
    async fn single_node_leads_commits_and_survives_a_restart() {
        // Scenario: a one-node cluster becomes active, commits a queue assignment through the
        // ledger, publishes it, and finds it again after a restart.
        let dir = tempfile::tempdir().unwrap();
        let outbound = Arc::new(Mutex::new(Vec::new()));
        let transport = Sink::<MetadataOutbound> {
            seen: outbound.clone(),
        }
        .start()
        .recipient();
        let published = Arc::new(Mutex::new(Vec::new()));
        let subscriber = Sink::<ClusterStateCommitted> {
            seen: published.clone(),
        }
        .start()
        .recipient();
        let (ledger, recovered) = Ledger::open(dir.path(), FsyncPolicy::Never, 2).unwrap();
        let core = MetadataCore::new(NodeId(1), &[NodeId(1)], 0, recovered);
        let actor = MetadataActor::new(core, ledger, transport).start();
        actor.send(SubscribeState { subscriber }).await.unwrap();
        lead_term_1(&actor).await;
        let snapshot = actor.send(GetMetadataStatus).await.unwrap();
        assert_eq!(snapshot.status.role, MetadataRole::ActiveLeader);
        let lsn = actor
            .send(Propose {
                advisory: assign("bmq://d/q", 0, 0),
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(lsn, Lsn::new(Term(1), 3));
        let snapshot = actor.send(GetMetadataStatus).await.unwrap();
        assert!(snapshot.state.queues.contains_key("bmq://d/q"));
        assert_eq!(snapshot.status.committed_lsn, lsn);
        // Let the sinks run.
        actix_rt::time::sleep(Duration::from_millis(20)).await;
        let published = published.lock().unwrap().clone();
        assert!(
            published.first().is_some_and(|p| p.state.queues.is_empty()),
            "current state sent on subscribe"
        );
        assert!(published
            .last()
            .is_some_and(|p| p.state.queues.contains_key("bmq://d/q")));
        // A single node has no peer: its broadcasts reach nobody.
        assert!(outbound.lock().unwrap().is_empty());
        assert_eq!(
            actor
                .send(Propose {
                    advisory: assign("bmq://d/q", 1, 0)
                })
                .await
                .unwrap()
                .map_err(|e| matches!(e, ProposeError::Invalid(_))),
            Err(true)
        );
        drop(actor);
        let (_, recovered) = Ledger::open(dir.path(), FsyncPolicy::Never, 2).unwrap();
        assert!(recovered.committed_state.queues.contains_key("bmq://d/q"));
        assert_eq!(recovered.committed_lsn, lsn);
    }

    #[actix_rt::test]
    async fn rollovers_run_beside_the_fsyncs_and_lose_nothing() {
        // Scenario: a one-node leader with a tiny ledger (400 bytes) commits 40 queue
        // assignments, each past the size, so the ledger rolls over again and again — each
        // snapshot written on the rewrite thread while the fsyncs go on, each switch on the
        // sync thread — and after a restart every assignment is there.
        let dir = tempfile::tempdir().unwrap();
        let transport = Sink::<MetadataOutbound> {
            seen: Arc::new(Mutex::new(Vec::new())),
        }
        .start()
        .recipient();
        let (mut ledger, recovered) =
            Ledger::open(dir.path(), FsyncPolicy::EveryRecord, 2).unwrap();
        ledger.set_max_file_size(400);
        let core = MetadataCore::new(NodeId(1), &[NodeId(1)], 0, recovered);
        let actor = MetadataActor::new(core, ledger, transport).start();
        lead_term_1(&actor).await;
        wait_until(&actor, |s| s.status.role == MetadataRole::ActiveLeader).await;
        // Proposals in the mailbox together, and one at a time.
        propose_together(&actor, 0..20).await;
        for key in 20..40u64 {
            actor
                .send(Propose {
                    advisory: assign(&format!("bmq://d/q{key}"), 1, key),
                })
                .await
                .unwrap()
                .unwrap();
            wait_until(&actor, |s| s.state.queues.len() as u64 == key + 1).await;
        }
        // One more, committed, so the commit records of the forty are on disk before it.
        actor
            .send(Propose {
                advisory: assign("bmq://d/last", 0, 40),
            })
            .await
            .unwrap()
            .unwrap();
        let snapshot = wait_until(&actor, |s| s.state.queues.len() == 41).await;
        assert_eq!(snapshot.state.queues.len(), 41);
        // Nothing left for the sync thread before the files are read.
        let idle = poll_until(async || actor.send(LedgerIdle).await.unwrap(), |idle| *idle).await;
        assert!(idle);
        let newest = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().into_string().unwrap();
                name.strip_prefix("ledger-")?
                    .strip_suffix(".bmql")?
                    .parse::<u64>()
                    .ok()
            })
            .max()
            .unwrap();
        // Each rollover comes past twice the size of the file it wrote (the snapshot grows
        // with the queues), so a few, not forty.
        assert!(newest >= 2, "rolled over {newest} times");
        drop(actor);
        let (_, recovered) = Ledger::open(dir.path(), FsyncPolicy::Never, 2).unwrap();
        for key in 0..40u64 {
            let uri = format!("bmq://d/q{key}");
            assert!(recovered.committed_state.queues.contains_key(&uri), "{uri}");
        }
        // The last may be committed or not (its commit record needs no fsync), never lost.
        assert!(
            recovered
                .committed_state
                .queues
                .contains_key("bmq://d/last")
                || recovered
                    .uncommitted
                    .iter()
                    .any(|(_, a)| *a == assign("bmq://d/last", 0, 40))
        );
    }

    /// Tells the actor that node 1 (itself) leads term 1.
    async fn lead_term_1(actor: &Addr<MetadataActor>) {
        actor
            .send(LeaderChanged {
                term: Term(1),
                leader: Some(NodeId(1)),
            })
            .await
            .unwrap();
    }

    /// Proposes the assignments of `bmq://d/q<key>` to partition 0 for every key, all in the
    /// actor's mailbox before it runs again, and waits for their LSNs.
    async fn propose_together(actor: &Addr<MetadataActor>, keys: std::ops::Range<u64>) {
        let proposals: Vec<_> = keys
            .map(|key| {
                actor.send(Propose {
                    advisory: assign(&format!("bmq://d/q{key}"), 0, key),
                })
            })
            .collect();
        for p in proposals {
            p.await.unwrap().unwrap();
        }
    }

    /// Asks whether the ledger has nothing to write or sync and no sync runs.
    #[derive(Message)]
    #[rtype(result = "bool")]
    struct LedgerIdle;

    impl Handler<LedgerIdle> for MetadataActor {
        type Result = bool;

        fn handle(&mut self, _msg: LedgerIdle, _ctx: &mut Self::Context) -> bool {
            !self.sync_in_flight
                && !self.advisory_unsynced
                && !self.ledger.rewrite_due()
                && !self.ledger.rollover_pending()
                && self.written.is_none()
        }
    }

    /// Waits (up to 5 s) until the actor's status and state satisfy `done`; the leader's own
    /// vote waits for its fsync, which completes on the ledger's sync thread.
    async fn wait_until(
        actor: &Addr<MetadataActor>,
        done: impl Fn(&MetadataSnapshot) -> bool,
    ) -> MetadataSnapshot {
        poll_until(async || actor.send(GetMetadataStatus).await.unwrap(), done).await
    }

    /// Asks `probe` every 2 ms until its answer satisfies `done` or 5 s have passed, and
    /// returns the last answer.
    async fn poll_until<T>(mut probe: impl AsyncFnMut() -> T, done: impl Fn(&T) -> bool) -> T {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let answer = probe().await;
            if done(&answer) || Instant::now() >= deadline {
                return answer;
            }
            actix_rt::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// The Records each outbound message to `peer` carries (a batch counts its records).
    fn records_in(outbound: &[MetadataOutbound], peer: NodeId) -> Vec<usize> {
        use bmq_proto::peer::metadata_message::Kind as Msg;
        outbound
            .iter()
            .filter(|o| o.to == Some(peer))
            .map(|o| match &o.message.kind {
                Some(Msg::Batch(b)) => b
                    .messages
                    .iter()
                    .filter(|m| matches!(m.kind, Some(Msg::Record(_))))
                    .count(),
                Some(Msg::Record(_)) => 1,
                _ => 0,
            })
            .filter(|n| *n > 0)
            .collect()
    }

    #[actix_rt::test]
    async fn proposals_that_arrive_together_go_out_in_one_message_per_peer_and_commit_together() {
        // Scenario: group commit — ten proposals already in the mailbox of a
        // three-node leader are handled in one turn (so written with one fsync) and sent as one
        // MetadataBatch per peer; one ack of the last record commits all ten.
        use bmq_proto::peer::metadata_message::Kind as Msg;
        let dir = tempfile::tempdir().unwrap();
        let outbound = Arc::new(Mutex::new(Vec::new()));
        let transport = Sink::<MetadataOutbound> {
            seen: outbound.clone(),
        }
        .start()
        .recipient();
        let (ledger, recovered) = Ledger::open(dir.path(), FsyncPolicy::EveryRecord, 2).unwrap();
        let members = [NodeId(1), NodeId(2), NodeId(3)];
        let core = MetadataCore::new(NodeId(1), &members, 0, recovered);
        let actor = MetadataActor::new(core, ledger, transport).start();
        let inbound = |kind: Msg| MetadataInbound {
            from: NodeId(2),
            message: peer::MetadataMessage { kind: Some(kind) },
        };
        lead_term_1(&actor).await;
        actor
            .send(inbound(Msg::SyncStateResponse(
                peer::LeaderSyncStateResponse {
                    term: 1,
                    last_lsn: None,
                    committed_lsn: None,
                    last_advisory_lsn: None,
                },
            )))
            .await
            .unwrap();
        actor
            .send(inbound(Msg::Ack(peer::AdvisoryAck {
                lsn: Some(Lsn::new(Term(1), 1).into()),
                membership_epoch: 0,
            })))
            .await
            .unwrap();
        let snapshot = wait_until(&actor, |s| s.status.role == MetadataRole::ActiveLeader).await;
        assert_eq!(snapshot.status.role, MetadataRole::ActiveLeader);
        outbound.lock().unwrap().clear();
        // Ten proposals in the mailbox before the actor runs again.
        propose_together(&actor, 0..10).await;
        actix_rt::time::sleep(Duration::from_millis(20)).await;
        let sent = outbound.lock().unwrap().clone();
        assert_eq!(records_in(&sent, NodeId(2)), vec![10], "{sent:?}");
        assert_eq!(records_in(&sent, NodeId(3)), vec![10], "{sent:?}");
        // Not committed yet (node 2 has not acked); one ack of the last record commits all.
        let last = Lsn::new(Term(1), 12);
        assert_eq!(
            actor.send(GetMetadataStatus).await.unwrap().status.last_lsn,
            last
        );
        actor
            .send(inbound(Msg::Ack(peer::AdvisoryAck {
                lsn: Some(last.into()),
                membership_epoch: 0,
            })))
            .await
            .unwrap();
        let snapshot = wait_until(&actor, |s| s.status.committed_lsn == last).await;
        assert_eq!(snapshot.status.committed_lsn, last);
        assert_eq!(snapshot.state.queues.len(), 10);
    }
}
