//! `ReplicationCore`: the replication state machine of one partition (DESIGN.md §7).
//!
//! No sockets, no clock: inputs are `handle_*(now, ..)`, outputs are drained with
//! [`ReplicationCore::poll_output`], and [`ReplicationCore::poll_timeout`] says when to call
//! [`ReplicationCore::handle_timeout`] next. The core owns the partition's [`Store`] and writes
//! records to it as it accepts them (plain, synchronous file writes on the partition's own
//! thread); durability is the shell's: it calls [`ReplicationCore::sync`] (fsync, then
//! receipts and ACKs are released) when [`ReplicationCore::needs_sync`] says so, once per batch
//! of inputs (group commit).
//!
//! **The journal** is a sequence of positions (1, 2, ...), each a record stamped with the
//! primary lease it was written in; the leases form runs that only increase (a
//! [`JournalShape`]). Two journals that hold the same lease at the same position hold the same
//! records up to there (each lease has one primary, which only appends, and a replica accepts
//! a lease's records only after that lease's primary has synchronised it). One primary also
//! means one run of the process: no record of a lease leaves the primary before the first one
//! is durable in its own journal, so a primary that restarts having lost what it wrote since
//! (a power loss, a failed fsync) finds the lease in its journal and asks for a new one
//! ([`Output::LeaseReused`]) instead of writing other records under it. Positions up to the
//! store's *floor* may be absent: dead records (confirmed, removed) compacted away.
//!
//! **Primary, normal operation**: a PUT becomes a record, is appended to the store and
//! streamed to every replica in order (`ReplicateRecords`); replicas append and, once fsynced,
//! answer `Receipt{sequence}`. The record is *committed* once a quorum of members (the primary
//! included) holds it; a strong-consistency PUT is ACKed then, an eventual one as soon as the
//! primary holds it. A PUT whose GUID is outstanding, or in the recent-GUID window, is not
//! stored again: it is ACKed when the first copy is. The primary *settles* positions up to
//! what is committed and held by every in-sync replica (one that receipted progress within
//! `in_sync_timeout`, or is caught up) and tells replicas (`settled_through`): settled dead
//! records may be removed from disk on every node ([`Store::maintain`]).
//!
//! **Primary, healing** (a new lease): the primary is *passive*. (1) It asks every member for
//! its journal shape (`ReplicaStateQuery`; a member that answers promises to ignore older
//! leases) and waits for a quorum of answers, itself included. (2) If an answering member is
//! more advanced — higher `(lease of last record, last sequence)` — it pulls from the most
//! advanced one (`PullRecords` -> `SyncRecords`) until it holds the same journal. (3) It
//! brings every answering member to its journal with `SyncRecords{truncate_after, records}`:
//! the member drops records after the common prefix — records of an older lease that the
//! healing quorum does not hold, so no quorum ever acknowledged them — and appends the rest.
//! (4) It appends its lease's first record (`StoredLeaseStart`, which carries nothing) and,
//! once a quorum holds its whole journal with it, goes *active* ([`Output::Active`]): the
//! shell rebuilds the queues from [`Store::outstanding`]. The lease's record is Raft's no-op
//! at the start of a term (§5.4.2): records of older leases are committed by this primary
//! only together with one of its own, so a quorum's journals end in its lease — without it,
//! a later primary holding another older lease's records at those positions could count its
//! journal the more advanced one. Why no ACKed record is lost: an ACKed
//! record is on a quorum; the healing quorum intersects it; the most advanced member of the
//! healing quorum therefore holds it (same-lease journals are prefixes of each other, and a
//! member with a later lease was synchronised by that lease's primary, which held it by the
//! same argument).
//!
//! **Install**: a member whose journal ends below the sender's floor cannot be sent the
//! history (part of it was compacted away); it is sent the live state instead — the live
//! records up to the floor, then every record above it — into a staged journal that replaces
//! its own only once complete ([`Store::begin_install`]), as a Raft follower receives a
//! snapshot (Raft §7). A crash in the middle leaves its old journal. An install never replaces
//! a journal that agrees with the sender's at the floor: a member that holds the sender's
//! floor position under the same lease holds the same records up to there, so it keeps its
//! journal and answers with its shape (as a Raft follower keeps the log after a snapshot's
//! last entry that it holds), and is synchronised from the common prefix — what it holds above
//! the floor may be a committed record that the quorum holding it counts on. (A journal whose
//! lease at the floor differs holds from there on records that the primary's journal does
//! not, so none of them was committed: see the healing argument above.)
//!
//! **A journal lost to corruption**: a node whose journal was found corrupt at open starts
//! with an empty one that [`Store::needs_install`] — it may lack records it receipted, which
//! a quorum counted on. Counted in a healing quorum it could hide a committed record (the
//! healing quorum must intersect every commit quorum in a member that still holds it), so
//! it answers shape queries marked `needs_install` and the primary does not count it (nor
//! itself, when it is the one); it serves no pull (a sync from its shorter journal would cut
//! the puller's), and a primary pulling from it when it lost its journal chooses again. It
//! counts again once it durably holds what a primary had when it began bringing it up to
//! date (that primary's journal holds every committed record: it healed from a quorum that
//! did not count this node), or, as primary, once it goes active. Since its journal no
//! longer tells which leases it served, the highest one it served is kept beside the journal
//! ([`Store::primary_lease_mark`]), and named primary at a lease up to it, it asks for a new
//! one ([`Output::LeaseReused`]). This is the rule of a Raft server that lost its log: it
//! must not vote as if it held what it acknowledged.
//!
//! **Replica**: accepts `SyncRecords` from a primary with a lease at least its own, and then
//! `ReplicateRecords` of that lease that follow its last record; anything else from a current
//! primary is answered with its shape (the primary then synchronises it). Stale leases are
//! dropped. A sync never cuts a record that matches the sender's journal (the same lease at the
//! same position; the sync carries the sender's lease runs), as Raft's AppendEntries deletes
//! only from a conflict (§5.3): a sync may answer an older shape, and what the replica holds
//! beyond it may already be receipted, and counted towards a quorum.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use bmq_proto::client::Property;
use bmq_proto::peer::{
    journal_record::Kind as RecordKind, partition_message::Kind as MsgKind, JournalRecord,
    JournalShape, PartitionMessage, PullRecords, Receipt, ReplicaStateQuery, ReplicaStateResponse,
    ReplicateRecords, StoredLeaseStart, StoredMessage, SyncRecords,
};
use bmq_proto::{LeaseId, NodeId, PartitionId, SessionAddr, UriBytes};
use bytes::Bytes;
use tracing::{error, info, warn};

use crate::store::{
    guid_key, Appending, ClosedFiles, CompactionDone, CompactionTicket, FramedBatch, Maintenance,
    Store, StoreError, SyncTicket,
};
use bmq_storage::GuidWindow;

/// Most payload bytes in one `ReplicateRecords`/`SyncRecords` message (at least one record).
pub const BATCH_BYTES_MAX: u64 = 1024 * 1024;

/// Settings of a partition's replication.
#[derive(Debug, Clone)]
pub struct ReplicationConfig {
    /// This node.
    pub self_id: NodeId,
    /// The partition.
    pub partition: PartitionId,
    /// The replicas this node counts as primary until a lease names its own
    /// ([`ReplicationCore::handle_role`]): the configured members, this node included.
    pub members: Vec<NodeId>,
    /// Members that must hold a record before it is committed (this node included); 0 means a
    /// majority of the lease's replicas.
    pub quorum: usize,
    /// Most records in one `ReplicateRecords`/`SyncRecords` message.
    pub batch_records_max: usize,
    /// Most records sent to a replica and not yet receipted.
    pub in_flight_records_max: u64,
    /// Unanswered queries, pulls and replications are resent after this long.
    pub resend_after: Duration,
    /// Most GUIDs of finished messages remembered for duplicate detection (outstanding ones
    /// are always known from the journal's index).
    pub guid_window_max: usize,
    /// How long the GUID of a finished message is remembered for duplicate detection.
    pub guid_window_age: Duration,
    /// A replica that is behind and has receipted no progress for this long is not waited
    /// for before positions are settled (and dead records removed); it receives an install if
    /// it falls below the floor.
    pub in_sync_timeout: Duration,
}

/// What the shell must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Send a message to a peer over the DATA channel.
    Send {
        /// The peer.
        to: NodeId,
        /// The message.
        message: PartitionMessage,
    },
    /// Acknowledge a PUT to its producer (success).
    Ack {
        /// The producer's session.
        producer: SessionAddr,
        /// The queue.
        uri: UriBytes,
        /// The message's GUID.
        guid: Bytes,
    },
    /// This node finished healing and is the active primary of `lease`: rebuild the queues
    /// from [`Store::outstanding`].
    Active {
        /// The lease.
        lease: LeaseId,
    },
    /// The committed state names this node primary at `lease`, but its journal already holds
    /// records of `lease` that an earlier run of this process wrote (the node restarted before
    /// the leader moved the partition): it does not heal at that lease and asks the leader for
    /// a higher one. Healing again at the same lease could append, at positions a replica
    /// already holds durably under that lease, records other than the replica's — and
    /// same-lease journals must be prefixes of each other (see the module doc).
    LeaseReused {
        /// The lease it will not serve again.
        lease: LeaseId,
    },
    /// The journal failed in a way that is not a full disk (an I/O error, corruption): the
    /// node must stop (never retry an fsync).
    Fatal {
        /// What failed.
        error: String,
    },
}

/// Where a primary is in its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrimaryPhase {
    /// Collecting journal shapes from a quorum.
    Collecting,
    /// Pulling missing records from the most advanced member.
    Pulling {
        /// The member pulled from.
        from: NodeId,
    },
    /// Bringing members up to date; active once a quorum holds the whole journal.
    Syncing,
    /// Serving PUTs.
    Active,
}

/// The result of [`ReplicationCore::handle_put`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutResult {
    /// Stored as record `sequence`; the ACK follows as an [`Output::Ack`].
    Appended {
        /// The record's sequence.
        sequence: u64,
    },
    /// This node is not an active primary: answer `NOT_READY` (the proxy retries).
    NotReady,
    /// The journal could not take the record (its disk is full): answer `STORAGE_FAILURE`.
    StorageFailure {
        /// Why, for the NACK.
        reason: String,
    },
}

#[derive(Debug, Clone)]
struct Waiter {
    producer: SessionAddr,
    uri: UriBytes,
    guid: Bytes,
}

/// Producers waiting for ACKs, in sequence order: a queue, since new PUTs append at ever
/// higher sequences and ACKs leave from the front (a `BTreeMap` of `Vec`s allocated twice per
/// PUT). A resent PUT waiting for an earlier record is inserted in its place.
#[derive(Debug, Default)]
struct AckWaiters(VecDeque<(u64, Waiter)>);

impl AckWaiters {
    /// Adds `waiter` for record `sequence`, after those already waiting for it, unless the
    /// same producer waits for the same GUID there already (a proxy resending a PUT again
    /// and again waits once).
    fn add(&mut self, sequence: u64, waiter: Waiter) {
        if self.0.back().is_none_or(|(s, _)| *s < sequence) {
            self.0.push_back((sequence, waiter));
            return;
        }
        let start = self.0.partition_point(|(s, _)| *s < sequence);
        let end = self.0.partition_point(|(s, _)| *s <= sequence);
        let waiting = self
            .0
            .range(start..end)
            .any(|(_, w)| w.producer == waiter.producer && w.guid == waiter.guid);
        if !waiting {
            self.0.insert(end, (sequence, waiter));
        }
    }

    /// Takes the waiters of records up to `through`, in order.
    fn take_through(&mut self, through: u64) -> impl Iterator<Item = Waiter> + '_ {
        let n = self.0.partition_point(|(s, _)| *s <= through);
        self.0.drain(..n).map(|(_, w)| w)
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

#[derive(Debug, Clone)]
struct ReplicaProgress {
    /// Next position to stream; `None` until the member's shape is known and it was synced.
    next: Option<u64>,
    /// Highest position the member holds durably at this lease.
    receipt: u64,
    /// When the last query, sync or batch was sent, or the last receipt arrived.
    last_activity: Option<Instant>,
    /// When the receipt last rose.
    last_progress: Option<Instant>,
    /// The member is receiving an install (the live state).
    install: bool,
    /// The maintenance epoch the install began at ([`Store::maintenance_epoch`]).
    install_epoch: u64,
    /// The settled position last sent to it.
    sent_settled: u64,
}

/// An install this node is receiving: the staged journal and where it completes.
struct Installing {
    from: NodeId,
    staged: Store,
    through: u64,
    /// The sender's lease and install id (its maintenance epoch when the install began): a
    /// restarted sender counts epochs from 0 again, under a new lease.
    id: (u64, u64),
}

impl std::fmt::Debug for Installing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Installing")
            .field("from", &self.from)
            .field("covered", &self.staged.last_sequence())
            .field("through", &self.through)
            .finish()
    }
}

/// The replication state machine of one partition (see the module doc).
#[derive(Debug)]
pub struct ReplicationCore {
    cfg: ReplicationConfig,
    /// The highest lease known for this partition.
    lease: LeaseId,
    /// The primary of `lease`, when known.
    primary: Option<NodeId>,
    /// The journal.
    store: Store,
    /// Highest position durable on this node (fsynced).
    persisted: u64,
    /// The lease whose primary has synchronised this replica (0: none).
    synced_lease: LeaseId,
    /// The primary's last position when it last synchronised this replica: once the journal
    /// holds it, the replica has caught up with the primary as of then.
    sync_target: u64,
    /// `Some` while this node is the primary of `lease`.
    phase: Option<PrimaryPhase>,
    /// Journal shapes collected while healing.
    shapes: BTreeMap<NodeId, JournalShape>,
    /// Members (this node among them) whose journal was set aside as corrupt and is not
    /// re-installed yet ([`Store::needs_install`]): their shapes are used, but they do not
    /// count towards the healing quorum.
    uncounted: BTreeSet<NodeId>,
    /// While this node's journal needs an install: the lease of the primary that began
    /// bringing it up to date and that primary's last position then. Once it holds that
    /// position durably it holds every record it can have acknowledged before it lost its
    /// journal, and counts again.
    reinstall_target: Option<(LeaseId, u64)>,
    /// The replicas of the lease (`cfg.members` but this node) and, as primary, its learners,
    /// with their progress.
    replicas: BTreeMap<NodeId, ReplicaProgress>,
    /// Nodes that receive the journal from this node as primary but count in no quorum (the
    /// membership's learners, [`ReplicationCore::set_learners`]); never a lease's replica.
    learners: BTreeSet<NodeId>,
    /// Highest position held by a quorum at this lease.
    committed: u64,
    /// Producers waiting for the ACK of a strong PUT, by sequence (released at `committed`).
    strong_waiters: AckWaiters,
    /// Producers waiting for the ACK of an eventual PUT, by sequence (released at `persisted`).
    eventual_waiters: AckWaiters,
    guids: GuidWindow,
    /// An install being received.
    installing: Option<Installing>,
    next_tick: Option<Instant>,
    pull_sent_at: Option<Instant>,
    /// The journal failed: nothing more is written or sent.
    failed: bool,
    /// The lease at which this core (this run of the process) last became primary: the only
    /// lease of its own journal's records it may heal at again (see [`Output::LeaseReused`]).
    primary_lease_this_run: Option<LeaseId>,
    /// The last append failed for a full disk (cleared by the next success).
    disk_full: bool,
    /// Inside a batch of inputs ([`ReplicationCore::begin_batch`]): appends leave the
    /// streaming to the batch's end.
    in_batch: bool,
    /// Something was appended in the current batch and not yet streamed.
    pump_due: bool,
    outputs: VecDeque<Output>,
}

/// How often a primary looks for lost messages to resend.
const TICK: Duration = Duration::from_millis(100);

impl ReplicationCore {
    /// A core over `store` (the journal as recovered from disk, all durable).
    pub fn new(cfg: ReplicationConfig, store: Store) -> Self {
        let lease = LeaseId(store.last_lease());
        let persisted = store.durable();
        ReplicationCore {
            cfg,
            lease,
            primary: None,
            store,
            persisted,
            synced_lease: LeaseId(0),
            sync_target: 0,
            phase: None,
            shapes: BTreeMap::new(),
            uncounted: BTreeSet::new(),
            reinstall_target: None,
            replicas: BTreeMap::new(),
            learners: BTreeSet::new(),
            committed: 0,
            strong_waiters: AckWaiters::default(),
            eventual_waiters: AckWaiters::default(),
            guids: GuidWindow::default(),
            installing: None,
            next_tick: None,
            pull_sent_at: None,
            failed: false,
            primary_lease_this_run: None,
            disk_full: false,
            in_batch: false,
            pump_due: false,
            outputs: VecDeque::new(),
        }
    }

    /// The files of journal segments removed since the last call, for the shell to close on
    /// another thread ([`Store::set_defer_close`], [`Store::take_closed_files`]).
    pub fn take_closed_files(&mut self) -> ClosedFiles {
        self.store.take_closed_files()
    }

    /// The copy of a journal compaction, for the shell to run on another thread
    /// ([`Store::set_background_compaction`], [`Store::take_compaction`]); its outcome goes to
    /// [`ReplicationCore::complete_compaction`].
    pub fn take_compaction(&mut self) -> Option<CompactionTicket> {
        self.store.take_compaction()
    }

    /// A compaction's copy finished ([`CompactionTicket::run`]): it replaces its segment now
    /// or after the next sync ([`Store::complete_compaction`]). A full disk gives it up for
    /// now; another failure is fatal ([`Output::Fatal`]).
    pub fn complete_compaction(&mut self, done: CompactionDone) -> Result<(), StoreError> {
        if self.failed {
            return Ok(());
        }
        let result = self.store.complete_compaction(done);
        self.reclaimed(result)
    }

    /// The journal.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The highest lease known.
    pub fn lease(&self) -> LeaseId {
        self.lease
    }

    /// The phase when this node is the primary, else `None`.
    pub fn phase(&self) -> Option<&PrimaryPhase> {
        self.phase.as_ref()
    }

    /// Whether this node is the active primary.
    pub fn is_active_primary(&self) -> bool {
        self.phase == Some(PrimaryPhase::Active)
    }

    /// Last position held, durable or not.
    pub fn last_sequence(&self) -> u64 {
        self.store.last_sequence()
    }

    /// Highest position held by a quorum (primary only; 0 otherwise).
    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// Highest position durable on this node (fsynced).
    pub fn persisted(&self) -> u64 {
        self.persisted
    }

    /// Whether the last write failed for a full disk (cleared by the next one that succeeds).
    pub fn disk_full(&self) -> bool {
        self.disk_full
    }

    /// Whether an install is being received.
    pub fn is_installing(&self) -> bool {
        self.installing.is_some()
    }

    /// Whether this node, not the primary, has caught up with the primary of the highest lease
    /// known: that primary synchronised it, no install is under way, and the journal holds at
    /// least the primary's last position as of that sync (what it streams afterwards arrives
    /// as it is written). A learner reports it for every partition before the leader promotes
    /// it, so that it joins its first lease as a replica that already holds the journal.
    pub fn follows_primary(&self) -> bool {
        self.phase.is_none()
            && self.primary.is_some_and(|p| p != self.cfg.self_id)
            && self.synced_lease == self.lease
            && self.installing.is_none()
            && !self.store.needs_install()
            && self.store.last_sequence() >= self.sync_target
    }

    /// Per replica: the highest position it has receipted (primary only).
    pub fn replica_receipts(&self) -> Vec<(NodeId, u64)> {
        self.replicas.iter().map(|(n, p)| (*n, p.receipt)).collect()
    }

    /// The last position this primary may send to replicas. No record of its lease leaves
    /// it before the first one is durable in its own journal: a replica can then hold a
    /// record of the lease only if this journal holds the lease durably, so a restart that
    /// lost everything written since (a power loss, a failed fsync) still finds the lease
    /// and asks for another ([`Output::LeaseReused`]) instead of writing other records at
    /// positions a replica holds under the same lease. Raft's rule of persisting the term
    /// before acting in it; it costs one local fsync before the first records of a lease.
    fn send_horizon(&self) -> u64 {
        match self.store.last_run() {
            Some((lease, first)) if lease == self.lease.0 && self.persisted < first => first - 1,
            _ => self.store.last_sequence(),
        }
    }

    /// Drops from a read of `records` covering positions through `covered` what lies beyond
    /// [`ReplicationCore::send_horizon`].
    fn within_horizon(
        &self,
        mut records: Vec<JournalRecord>,
        covered: u64,
    ) -> (Vec<JournalRecord>, u64) {
        let horizon = self.send_horizon();
        if covered > horizon {
            records.retain(|r| r.sequence <= horizon);
            return (records, horizon);
        }
        (records, covered)
    }

    /// Whether an earlier run of this node may have acted as primary of `lease`: its journal
    /// holds the lease, or its durable primary-lease mark reaches it (made durable before any
    /// sync of the lease leaves, and kept when a corrupt journal is set aside).
    fn may_have_served(&self, lease: LeaseId) -> bool {
        self.journal_holds_lease(lease) || self.store.primary_lease_mark() >= lease.0
    }

    /// Whether this primary's lease is in its durable primary-lease mark: until then it
    /// changes no replica's journal (no sync, no records), so a restart that lost what it
    /// did since still knows it served the lease.
    fn lease_marked(&self) -> bool {
        self.store.primary_lease_mark() >= self.lease.0
    }

    /// Whether the journal holds (or held: lease runs cover compacted positions too) a
    /// position written under `lease`.
    fn journal_holds_lease(&self, lease: LeaseId) -> bool {
        self.store.runs().iter().any(|run| run.lease == lease.0)
    }

    /// The shape of this node's journal.
    pub fn shape(&self) -> JournalShape {
        JournalShape {
            runs: self.store.runs(),
            last_sequence: self.store.last_sequence(),
            floor: self.store.floor(),
        }
    }

    /// Whether outputs are waiting for [`ReplicationCore::poll_output`].
    pub fn has_output(&self) -> bool {
        !self.outputs.is_empty()
    }

    /// The next output to execute, in order.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// When [`ReplicationCore::handle_timeout`] should be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_tick
    }

    /// Whether [`ReplicationCore::sync`] has work: records written since the last one, or a
    /// settled position that rose since the last reclaim (the last confirms of a burst settle
    /// after its last write; their space is reclaimed without waiting for more traffic).
    pub fn needs_sync(&self) -> bool {
        self.writes_pending()
            || (!self.failed && (self.store.maintenance_due() || self.durable_unreleased()))
    }

    /// Whether the journal holds positions durably that this core has not released yet: a
    /// truncation syncs in place (healing), and may do so while no fsync of the core's own is
    /// due (found by the replication simulator once fsyncs ran off the core: a new primary
    /// stayed passive with its journal durable to the end).
    fn durable_unreleased(&self) -> bool {
        self.store.durable().min(self.store.last_sequence()) > self.persisted
    }

    /// Whether records were written and not yet made durable.
    fn writes_pending(&self) -> bool {
        !self.failed
            && (self.store.needs_sync()
                || self
                    .installing
                    .as_ref()
                    .is_some_and(|i| i.staged.needs_sync()))
    }

    /// Makes what was written durable (fsync), then releases what waited for it (receipts,
    /// eventual ACKs, commits), and removes settled dead records ([`Store::maintain`]). An
    /// error is also reported as [`Output::Fatal`].
    pub fn sync(&mut self, now: Instant) -> Result<(), StoreError> {
        match self.begin_sync(now)? {
            None => Ok(()),
            Some(ticket) => {
                let result = ticket.run();
                self.complete_sync(now, ticket, result)
            }
        }
    }

    /// [`ReplicationCore::sync`] in two steps, so the fsync can run on another thread while
    /// this core takes more inputs: writes what waits in the journal's buffer and returns the
    /// fsync still to run ([`SyncTicket::run`]), whose outcome goes to
    /// [`ReplicationCore::complete_sync`]; until then nothing it covers counts as durable (no
    /// receipt, no ACK). `None`: nothing needed an fsync, and what waited for durability has
    /// been released already. Issue at most one ticket at a time. An error is also reported
    /// as [`Output::Fatal`].
    pub fn begin_sync(&mut self, now: Instant) -> Result<Option<SyncTicket>, StoreError> {
        if self.failed {
            return Ok(None);
        }
        self.remember_retired(now);
        if !self.writes_pending() {
            // No fsync to run: release what is durable already, reclaim settled dead records.
            if self.durable_unreleased() {
                self.on_persisted(now, self.store.durable());
            }
            self.maintain_store()?;
            return Ok(None);
        }
        if let Some(i) = self.installing.as_mut() {
            // An install's staged journal (rare: a replica far behind) syncs in place.
            if let Err(e) = i.staged.sync() {
                return Err(self.fail(e));
            }
        }
        match self.store.begin_sync() {
            Ok(Some(ticket)) => Ok(Some(ticket)),
            Ok(None) => {
                self.on_persisted(now, self.store.durable());
                self.maintain_store()?;
                Ok(None)
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// The fsync of `ticket` ([`ReplicationCore::begin_sync`]) finished with `result`: what it
    /// made durable is released (receipts, ACKs, commits) and settled dead records removed. A
    /// failed fsync is fatal ([`Output::Fatal`]); it is never retried.
    pub fn complete_sync(
        &mut self,
        now: Instant,
        ticket: SyncTicket,
        result: std::io::Result<()>,
    ) -> Result<(), StoreError> {
        if self.failed {
            return Ok(());
        }
        let durable = match self.store.complete_sync(ticket, result) {
            Ok(d) => d,
            Err(e) => return Err(self.fail(e)),
        };
        self.on_persisted(now, durable);
        self.maintain_store()
    }

    /// Every node remembers the GUIDs of messages that stopped being outstanding in its
    /// duplicate window (an outstanding GUID is known from the index, so the window holds only
    /// finished messages: no memory for it while messages stay outstanding). Replicas keep it
    /// too, and no role change clears it: a finished message is settled, so committed, and a
    /// producer that resends it to the next primary after its ACK died with the last one gets
    /// an ACK instead of a second copy. Every rise of the base leads here (it makes
    /// [`ReplicationCore::needs_sync`] true).
    fn remember_retired(&mut self, now: Instant) {
        self.guids.insert_all(now, self.store.take_retired());
        // Bounded on every node, whether or not PUTs ever ask it.
        self.guids
            .expire(now, self.cfg.guid_window_max, self.cfg.guid_window_age);
    }

    /// Removes settled dead records ([`Store::maintain`]); a full disk defers it, another
    /// error is fatal.
    fn maintain_store(&mut self) -> Result<(), StoreError> {
        let result = self.store.maintain();
        self.reclaimed(result)
    }

    /// Logs what a maintenance reclaimed; a full disk defers it, another error is fatal.
    fn reclaimed(&mut self, result: Result<Maintenance, StoreError>) -> Result<(), StoreError> {
        match result {
            Ok(m) if m.deleted + m.compacted > 0 => {
                info!(partition = %self.cfg.partition, deleted = m.deleted, compacted = m.compacted, freed_bytes = m.freed_bytes, floor = self.store.floor(), "journal space reclaimed");
            }
            Ok(_) => {}
            // Nothing was lost: the next sync tries again once space returns.
            Err(e) if e.is_no_space() => {
                warn!(partition = %self.cfg.partition, error = %e, "journal maintenance deferred: disk full")
            }
            Err(e) => return Err(self.fail(e)),
        }
        Ok(())
    }

    /// Records a journal failure: the node must stop.
    fn fail(&mut self, e: StoreError) -> StoreError {
        if !self.failed {
            self.failed = true;
            error!(partition = %self.cfg.partition, error = %e, "journal failed");
            self.outputs.push_back(Output::Fatal {
                error: e.to_string(),
            });
        }
        e
    }

    /// Handles the result of a write: a full disk is remembered (and logged once), other
    /// errors are fatal. Returns whether the write succeeded.
    fn wrote(&mut self, result: Result<(), StoreError>) -> bool {
        match result {
            Ok(()) => {
                if self.disk_full {
                    info!(partition = %self.cfg.partition, "journal writes succeed again");
                }
                self.disk_full = false;
                true
            }
            Err(e) if e.is_no_space() => {
                if !self.disk_full {
                    warn!(partition = %self.cfg.partition, error = %e, "journal disk full: refusing new messages until space returns");
                }
                metrics::counter!("bmq_journal_write_failures_total", "reason" => "no_space")
                    .increment(1);
                self.disk_full = true;
                false
            }
            Err(e) => {
                self.fail(e);
                false
            }
        }
    }

    fn msg(&self, kind: MsgKind) -> PartitionMessage {
        PartitionMessage { kind: Some(kind) }
    }

    fn send(&mut self, to: NodeId, kind: MsgKind) {
        if self.failed {
            return;
        }
        let message = self.msg(kind);
        self.outputs.push_back(Output::Send { to, message });
    }

    fn others(&self) -> Vec<NodeId> {
        self.cfg
            .members
            .iter()
            .copied()
            .filter(|n| *n != self.cfg.self_id)
            .collect()
    }

    /// Members that must hold a record before it is committed, this node included: the
    /// configured number, or a majority of the lease's replicas (never 0).
    pub fn quorum(&self) -> usize {
        if self.cfg.quorum == 0 {
            self.cfg.members.len() / 2 + 1
        } else {
            self.cfg.quorum
        }
    }

    /// The replicas of the current lease (those this node counts as primary), this node
    /// included when it replicates.
    pub fn replicas(&self) -> &[NodeId] {
        &self.cfg.members
    }

    /// Changes the quorum at run time (`POST /admin/quorum/{n}`; 0 = a majority of the
    /// lease's replicas). A primary re-evaluates what is committed (and may release ACKs or
    /// finish healing) with the new number.
    pub fn set_quorum(&mut self, now: Instant, quorum: usize) {
        self.cfg.quorum = quorum;
        match self.phase {
            Some(PrimaryPhase::Collecting) | Some(PrimaryPhase::Pulling { .. }) => {
                self.advance_healing(now)
            }
            Some(_) => {
                self.update_commit(now);
                self.pump(now);
            }
            None => {}
        }
    }

    /// The committed cluster state names `primary` for this partition at `lease`, replicated
    /// by `replicas` (`PartitionInfo.replicas`; empty: the configured members, or those of the
    /// lease before). A lease's replicas are fixed: they are taken only with a higher lease, and
    /// a primary heals from and counts a majority of them alone.
    pub fn handle_role(
        &mut self,
        now: Instant,
        primary: Option<NodeId>,
        lease: LeaseId,
        replicas: &[NodeId],
    ) {
        if lease < self.lease {
            return;
        }
        if (lease > self.lease || self.phase.is_none()) && !replicas.is_empty() {
            self.cfg.members = replicas.to_vec();
        }
        let me = self.cfg.self_id;
        if primary == Some(me) {
            if self.phase.is_some() && self.lease == lease {
                return;
            }
            if self.primary_lease_this_run != Some(lease) && self.may_have_served(lease) {
                // Written by an earlier run of this node as primary of `lease`: ask for a new
                // lease instead of healing at this one (see `Output::LeaseReused`).
                warn!(partition = %self.cfg.partition, %lease, "named primary at a lease this node's journal already holds from before a restart: asking the leader for a new lease");
                self.step_down(lease, primary);
                self.outputs.push_back(Output::LeaseReused { lease });
                return;
            }
            self.primary_lease_this_run = Some(lease);
            self.become_primary(now, lease);
        } else {
            if self.lease == lease && self.primary == primary && self.phase.is_none() {
                return;
            }
            self.step_down(lease, primary);
            self.ask_for_install(now);
        }
    }

    /// A replica whose journal was set aside shows its (empty) shape to the primary until a
    /// sync begins its re-install: an idle primary that saw it caught up before would
    /// otherwise send it nothing.
    fn ask_for_install(&mut self, now: Instant) {
        if !self.store.needs_install() || self.reinstall_target.is_some() || self.failed {
            return;
        }
        if let Some(primary) = self.primary.filter(|p| *p != self.cfg.self_id) {
            self.answer_shape(primary);
            self.next_tick = Some(now + self.cfg.resend_after);
        }
    }

    fn step_down(&mut self, lease: LeaseId, primary: Option<NodeId>) {
        // Waiting producers get no ACK from here: their proxies resend to the new primary,
        // which drops duplicates.
        if lease != self.lease {
            // An install from an older lease's primary stops here (its staged journal is
            // dropped; the new primary starts over).
            self.installing = None;
        }
        self.phase = None;
        self.lease = lease;
        self.primary = primary;
        self.shapes.clear();
        self.uncounted.clear();
        self.replicas.clear();
        self.strong_waiters.clear();
        self.eventual_waiters.clear();
        self.committed = 0;
        self.next_tick = None;
    }

    fn become_primary(&mut self, now: Instant, lease: LeaseId) {
        self.step_down(lease, Some(self.cfg.self_id));
        self.installing = None;
        self.phase = Some(PrimaryPhase::Collecting);
        self.synced_lease = lease;
        self.store.note_primary_lease(lease.0);
        if self.store.needs_install() {
            self.uncounted.insert(self.cfg.self_id);
        }
        self.shapes.insert(self.cfg.self_id, self.shape());
        let members: BTreeSet<NodeId> = self.cfg.members.iter().copied().collect();
        self.learners.retain(|n| !members.contains(n));
        let learners: Vec<NodeId> = self.learners.iter().copied().collect();
        for n in self.others().into_iter().chain(learners) {
            self.track_replica(now, n);
        }
        self.next_tick = Some(now + TICK);
        self.advance_healing(now);
    }

    /// Starts streaming to `n` as primary: its progress from nothing, and its shape asked for.
    fn track_replica(&mut self, now: Instant, n: NodeId) {
        self.replicas.insert(
            n,
            ReplicaProgress {
                next: None,
                receipt: 0,
                last_activity: Some(now),
                last_progress: None,
                install: false,
                install_epoch: 0,
                sent_settled: 0,
            },
        );
        self.query_shape(n);
    }

    /// The nodes that receive this partition's journal without counting in any quorum (the
    /// membership's learners, etcd's non-voting members): as primary, this node streams to
    /// them as to its replicas — syncs, installs and new records — but their receipts count
    /// towards no commit and their shapes towards no healing, so they may change at any time.
    /// A lease's replica is never a learner (ignored here). Takes effect at once.
    pub fn set_learners(&mut self, now: Instant, learners: &[NodeId]) {
        let members: BTreeSet<NodeId> = self.cfg.members.iter().copied().collect();
        let next: BTreeSet<NodeId> = learners
            .iter()
            .copied()
            .filter(|n| !members.contains(n) && *n != self.cfg.self_id)
            .collect();
        if next == self.learners {
            return;
        }
        let gone: Vec<NodeId> = self.learners.difference(&next).copied().collect();
        let new: Vec<NodeId> = next.difference(&self.learners).copied().collect();
        self.learners = next;
        if self.phase.is_none() || self.failed {
            return;
        }
        for n in gone {
            self.replicas.remove(&n);
            self.shapes.remove(&n);
        }
        for n in new {
            self.track_replica(now, n);
        }
        self.pump(now);
    }

    /// The learners this node streams to as primary ([`ReplicationCore::set_learners`]).
    pub fn learners(&self) -> &BTreeSet<NodeId> {
        &self.learners
    }

    /// Asks member `to` for its journal shape at this node's lease (`ReplicaStateQuery`); the
    /// answer goes to [`ReplicationCore::on_state_response`].
    fn query_shape(&mut self, to: NodeId) {
        let q = ReplicaStateQuery {
            partition_id: self.cfg.partition.0,
            lease: self.lease.0,
        };
        self.send(to, MsgKind::StateQuery(q));
    }

    /// A message from `from` over the DATA channel.
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: PartitionMessage) {
        if self.failed {
            return;
        }
        match message.kind {
            Some(MsgKind::StateQuery(q)) => self.on_state_query(now, from, LeaseId(q.lease)),
            Some(MsgKind::StateResponse(r)) => self.on_state_response(now, from, r),
            Some(MsgKind::Pull(p)) => self.on_pull(from, p),
            Some(MsgKind::Sync(s)) => self.on_sync(now, from, s),
            Some(MsgKind::Replicate(r)) => self.on_replicate(now, from, r),
            Some(MsgKind::Receipt(r)) => self.on_receipt(now, from, r),
            None => {}
        }
    }

    /// Adopts a higher lease announced by `from`; returns false when `lease` is stale.
    fn observe_lease(&mut self, lease: LeaseId, from: NodeId) -> bool {
        if lease < self.lease {
            return false;
        }
        if lease > self.lease || (self.phase.is_some() && from != self.cfg.self_id) {
            if lease == self.lease && self.phase.is_some() {
                // Two primaries claim one lease: not possible with a correct leader; ignore.
                return false;
            }
            self.step_down(lease, Some(from));
        }
        if self.primary.is_none() {
            self.primary = Some(from);
        }
        true
    }

    fn on_state_query(&mut self, _now: Instant, from: NodeId, lease: LeaseId) {
        self.observe_lease(lease, from);
        self.answer_shape(from);
    }

    fn on_state_response(&mut self, now: Instant, from: NodeId, r: ReplicaStateResponse) {
        if LeaseId(r.lease) > self.lease {
            self.step_down(LeaseId(r.lease), None);
            return;
        }
        if LeaseId(r.lease) != self.lease
            || self.phase.is_none()
            || !self.replicas.contains_key(&from)
        {
            return;
        }
        let shape = r.shape.unwrap_or_default();
        match self.phase.clone().expect("checked") {
            phase @ (PrimaryPhase::Collecting | PrimaryPhase::Pulling { .. }) => {
                if r.needs_install {
                    self.uncounted.insert(from);
                } else {
                    self.uncounted.remove(&from);
                }
                self.shapes.insert(from, shape);
                if phase == (PrimaryPhase::Pulling { from }) {
                    // The member pulled from answers with its shape instead (it lost its
                    // journal): choose again.
                    self.phase = Some(PrimaryPhase::Collecting);
                    self.pull_sent_at = None;
                }
                self.advance_healing(now);
            }
            PrimaryPhase::Syncing | PrimaryPhase::Active => {
                self.sync_replica(now, from, &shape);
                self.pump(now);
            }
        }
    }

    fn on_pull(&mut self, from: NodeId, p: PullRecords) {
        if !self.observe_lease(LeaseId(p.lease), from) {
            return;
        }
        if self.store.needs_install() {
            // A journal set aside since the puller saw our shape holds less than it did, and
            // a sync from it would cut the puller's journal to what we hold: show our shape
            // instead (marked), and the puller chooses again.
            self.answer_shape(from);
            return;
        }
        let shape = p.shape.unwrap_or_default();
        let message = if p.install_covered > 0 {
            self.install_message(p.install_covered)
        } else {
            let prefix = common_prefix(&self.shape(), &shape);
            if prefix < self.store.floor() {
                self.install_message(0)
            } else {
                self.sync_message(prefix)
            }
        };
        if let Some(s) = message {
            self.send(from, MsgKind::Sync(s));
        }
    }

    /// Records after `prefix` to bring a member whose journal agrees with ours up to there
    /// (at or above our floor); `None` when the journal cannot be read (fatal).
    fn sync_message(&mut self, prefix: u64) -> Option<SyncRecords> {
        let read = self
            .store
            .read_from(prefix, self.cfg.batch_records_max, BATCH_BYTES_MAX, false);
        let (records, covered) = match read {
            Ok((records, covered)) => self.within_horizon(records, covered),
            Err(e) => {
                self.fail(e);
                return None;
            }
        };
        Some(SyncRecords {
            partition_id: self.cfg.partition.0,
            lease: self.lease.0,
            truncate_after: prefix,
            records,
            sender_last_sequence: self.store.last_sequence(),
            install: false,
            install_through: 0,
            covered_through: covered,
            settled_through: self.store.base(),
            // Our whole shape, so that a receiver holding more than these records keeps what
            // matches ours beyond them (see `on_sync`).
            runs: self.store.runs(),
            install_id: 0,
            install_through_lease: 0,
        })
    }

    /// A batch of the live state after `after` (0 starts an install): see the module doc.
    fn install_message(&mut self, after: u64) -> Option<SyncRecords> {
        let read = self
            .store
            .read_from(after, self.cfg.batch_records_max, BATCH_BYTES_MAX, true);
        let (records, covered) = match read {
            Ok((records, covered)) => self.within_horizon(records, covered),
            Err(e) => {
                self.fail(e);
                return None;
            }
        };
        let runs = self
            .store
            .runs()
            .into_iter()
            .filter(|r| r.first_sequence <= covered)
            .collect();
        Some(SyncRecords {
            partition_id: self.cfg.partition.0,
            lease: self.lease.0,
            truncate_after: after,
            records,
            sender_last_sequence: self.store.last_sequence(),
            install: true,
            install_through: self.store.floor(),
            covered_through: covered,
            settled_through: self.store.base(),
            runs,
            install_id: self.store.maintenance_epoch(),
            install_through_lease: lease_at(&self.shape(), self.store.floor()).unwrap_or(0),
        })
    }

    /// Applies a (non-install) sync or replication to the journal: drop positions after
    /// `truncate_after` (when below the last), append `records` (decoded, or a replica's frames
    /// as received), account positions up to `covered` and settle up to `settled`. Returns
    /// false when they do not follow.
    fn apply_sync(
        &mut self,
        truncate_after: u64,
        records: Appending<'_, '_>,
        covered: u64,
        settled: u64,
    ) -> bool {
        if truncate_after > self.store.last_sequence()
            || (!records.is_empty() && records.position(0).0 != truncate_after + 1)
        {
            return false;
        }
        if truncate_after < self.store.last_sequence() {
            if let Err(e) = self.store.truncate_after(truncate_after) {
                self.fail(e);
                return false;
            }
            self.persisted = self.persisted.min(self.store.last_sequence());
        }
        // Records at or below what the truncation kept (settled ones) are already held.
        let last = self.store.last_sequence();
        let records = records.skip(records.first_above(last));
        let (covered, settled) = Self::accounted(last, covered, settled);
        let result = self.store.append_with(records, covered, settled, None);
        self.wrote(result)
    }

    /// What a sync or replication that appends after `last` accounts for: positions up to
    /// `covered` (0 when not above `last`: the last record's) and settled ones up to `settled`
    /// (at most what is then held).
    fn accounted(last: u64, covered: u64, settled: u64) -> (u64, u64) {
        let covered = if covered > last { covered } else { 0 };
        (covered, settled.min(covered.max(last)))
    }

    /// Whether this journal holds position `sequence` under `lease` (neither 0): then it holds
    /// the same records up to there as any journal that does (see the module doc).
    fn holds_position(&self, sequence: u64, lease: u64) -> bool {
        sequence > 0 && lease > 0 && lease_at(&self.shape(), sequence) == Some(lease)
    }

    /// Applies one message of an install (see the module doc); finishes it once complete.
    fn apply_install(&mut self, from: NodeId, s: &SyncRecords) -> bool {
        if s.truncate_after == 0
            && self.store.last_lease() == s.lease
            && self.store.last_sequence() >= s.install_through
        {
            // A late copy of an install's first chunk: this journal already follows the
            // primary past the install's floor (it may have receipted more than the install
            // would hold). Starting over would move it backwards.
            return true;
        }
        if s.truncate_after == 0 && self.holds_position(s.install_through, s.install_through_lease)
        {
            // Our journal holds the install's last position under the same lease, so the same
            // records up to there (the module doc): the live state would replace a journal
            // that already has it, and cut what we hold above it — possibly a committed record
            // a quorum counts on (replication simulator, 3 nodes, seed 831). As a Raft follower
            // keeps the log that follows a snapshot's last entry when it holds that entry
            // (Raft §7), we keep ours and answer with our shape: the primary synchronises us
            // from the common prefix, which is at or above its floor.
            info!(partition = %self.cfg.partition, from = %from, through = s.install_through, "install not needed: the journal holds the primary's floor position");
            self.installing = None;
            return false;
        }
        if s.truncate_after == 0 {
            let staged = match self.store.begin_install() {
                Ok(staged) => staged,
                Err(e) => {
                    let _ = self.wrote(Err(e));
                    return false;
                }
            };
            info!(partition = %self.cfg.partition, from = %from, through = s.install_through, "journal behind the primary's floor: receiving its live state");
            self.installing = Some(Installing {
                from,
                staged,
                through: s.install_through,
                id: (s.lease, s.install_id),
            });
        }
        let Some(installing) = self.installing.as_mut() else {
            return false;
        };
        if installing.from == from && installing.id != (s.lease, s.install_id) {
            // The sender removed dead records since this install began: its chunks no longer
            // make one state. Start over (the next pull, or the primary's restart, asks from 0).
            self.installing = None;
            return false;
        }
        if installing.from != from || s.truncate_after > installing.staged.last_sequence() {
            return false;
        }
        installing.through = installing.through.max(s.install_through);
        let last = installing.staged.last_sequence();
        let fresh: Vec<JournalRecord> = s
            .records
            .iter()
            .filter(|r| r.sequence > last)
            .cloned()
            .collect();
        let covered = s.covered_through.max(last);
        let result = installing.staged.append(
            &fresh,
            covered,
            s.settled_through.min(covered),
            Some(&s.runs),
        );
        if !self.wrote(result) {
            return false;
        }
        let installing = self.installing.as_ref().expect("present");
        if installing.staged.last_sequence() >= installing.through {
            let installing = self.installing.take().expect("present");
            let result = self.store.finish_install(installing.staged);
            if !self.wrote(result) {
                return false;
            }
            self.persisted = self.store.durable();
        }
        true
    }

    fn on_sync(&mut self, now: Instant, from: NodeId, s: SyncRecords) {
        if let Some(PrimaryPhase::Pulling { from: source }) = self.phase.clone() {
            if LeaseId(s.lease) == self.lease && from == source {
                // The answer to our pull.
                let applied = if s.install {
                    self.apply_install(from, &s)
                } else {
                    self.apply_sync(
                        s.truncate_after,
                        Appending::Records(&s.records),
                        s.covered_through,
                        s.settled_through,
                    )
                };
                if applied {
                    self.shapes.insert(self.cfg.self_id, self.shape());
                }
                self.pull_sent_at = None;
                self.advance_healing(now);
                return;
            }
        }
        if !self.observe_lease(LeaseId(s.lease), from) || self.phase.is_some() {
            return;
        }
        self.primary = Some(from);
        let applied = if s.install {
            self.apply_install(from, &s)
        } else {
            self.installing = None;
            // A sync may be late (it answers an older shape of ours, and records that followed
            // it arrived first): cut nothing that matches the primary, as Raft's AppendEntries
            // keeps matching entries — a record we hold may already be receipted as durable,
            // and a quorum's durability rests on that receipt. Records match when their lease
            // is the same at the same position (a lease has one primary); settled positions
            // the message leaves out are committed, so identical everywhere.
            let last = self.store.last_sequence();
            let (truncate_after, records) = if s.truncate_after < last {
                let shape = self.shape();
                let overlap = s.records.partition_point(|r| r.sequence <= last);
                let conflict = s.records[..overlap]
                    .iter()
                    .position(|r| lease_at(&shape, r.sequence) != Some(r.lease));
                match conflict {
                    Some(i) => (s.records[i].sequence - 1, &s.records[i..]),
                    None => {
                        let end = s
                            .records
                            .last()
                            .map_or(s.truncate_after, |r| r.sequence)
                            .max(s.covered_through);
                        if last <= end || self.store.last_lease() == s.lease {
                            (last, &s.records[overlap..])
                        } else {
                            // We hold more than the message accounts for, of an older lease:
                            // what follows its end is kept as far as it matches the sender's
                            // journal (its lease runs, which the message carries), and may
                            // diverge beyond. Cutting a matching record there dropped one a
                            // quorum counted on: a late sync of lease 4 cut records 528-545
                            // of lease 3 that the replica had receipted (replication
                            // simulator, 3 nodes, seed 10021). From a sender that sends no
                            // runs (an older version), what follows the end is cut, as before.
                            let keep = if s.runs.is_empty() {
                                end
                            } else {
                                let sender = JournalShape {
                                    runs: s.runs.clone(),
                                    last_sequence: s.sender_last_sequence,
                                    floor: 0,
                                };
                                common_prefix(&shape, &sender).max(end).min(last)
                            };
                            (keep, &s.records[overlap..])
                        }
                    }
                }
            } else {
                (s.truncate_after, &s.records[..])
            };
            self.apply_sync(
                truncate_after,
                Appending::Records(records),
                s.covered_through,
                s.settled_through,
            )
        };
        if applied {
            self.synced_lease = LeaseId(s.lease);
            self.sync_target = s.sender_last_sequence;
            if self.store.needs_install()
                && self
                    .reinstall_target
                    .is_none_or(|(l, _)| l != LeaseId(s.lease))
            {
                self.reinstall_target = Some((LeaseId(s.lease), s.sender_last_sequence));
            }
            // An install may have made it durable already.
            self.check_reinstalled();
            if !self.writes_pending() {
                // Nothing new to write: what we hold is durable already.
                self.send_receipt();
            }
        } else if !self.disk_full && !self.failed && (!s.install || self.installing.is_none()) {
            // A sync that does not follow, or an install chunk with no install of ours to
            // continue (its start was lost, or it was started over): show our journal, and the
            // primary synchronises us again. (A chunk after a gap in a running install waits
            // for the primary's resend from our receipt.)
            self.answer_shape(from);
        }
    }

    fn answer_shape(&mut self, to: NodeId) {
        let r = ReplicaStateResponse {
            partition_id: self.cfg.partition.0,
            lease: self.lease.0,
            shape: Some(self.shape()),
            needs_install: self.store.needs_install(),
        };
        self.send(to, MsgKind::StateResponse(r));
    }

    fn on_replicate(&mut self, _now: Instant, from: NodeId, r: ReplicateRecords) {
        if !self.observe_lease(LeaseId(r.lease), from) || self.phase.is_some() {
            return;
        }
        // Records sent as journal frames: split (each checksum checked, each record read in
        // place), then written as received. A message whose frames do not check is dropped:
        // it is resent.
        let batch;
        let incoming = if r.framed_records.is_empty() {
            Appending::Records(&r.records)
        } else if !r.records.is_empty() {
            metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
            warn!(partition = %self.cfg.partition, peer = %from, "replication message with both records and frames dropped");
            return;
        } else {
            batch = match FramedBatch::split(&r.framed_records) {
                Ok(batch) => batch,
                Err(why) => {
                    metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
                    warn!(partition = %self.cfg.partition, peer = %from, %why, "replication message with bad frames dropped");
                    return;
                }
            };
            Appending::Frames(&batch, 0)
        };
        if LeaseId(r.lease) != self.synced_lease || self.installing.is_some() {
            if incoming.is_empty() {
                return;
            }
            // Not synchronised with this primary yet: show it our journal.
            self.answer_shape(from);
            return;
        }
        let last = self.store.last_sequence();
        if incoming.is_empty() {
            // Only a new settled position.
            if r.prev_sequence <= last {
                self.store.set_base(r.settled_through.min(last));
            }
            return;
        }
        if r.prev_sequence > last {
            // A gap: show it our journal.
            self.answer_shape(from);
            return;
        }
        // Records at or below `last` are held already (a partial resend).
        let stale = incoming.first_above(last);
        if stale == incoming.len() {
            // A resend of what we hold: receipt it again.
            self.store.set_base(r.settled_through.min(last));
            self.send_receipt();
            return;
        }
        let applied = self.apply_sync(
            last,
            incoming.skip(stale),
            r.covered_through,
            r.settled_through,
        );
        if !applied && !self.disk_full && !self.failed {
            self.answer_shape(from);
        }
    }

    fn send_receipt(&mut self) {
        let Some(primary) = self.primary else {
            return;
        };
        if self.phase.is_some() || self.synced_lease != self.lease || primary == self.cfg.self_id {
            return;
        }
        // While installing, the live state held so far (all of it settled at the primary).
        let sequence = match &self.installing {
            Some(i) => i.staged.durable(),
            None => self.persisted,
        };
        let r = Receipt {
            partition_id: self.cfg.partition.0,
            lease: self.lease.0,
            sequence,
        };
        self.send(primary, MsgKind::Receipt(r));
    }

    fn on_receipt(&mut self, now: Instant, from: NodeId, r: Receipt) {
        if LeaseId(r.lease) != self.lease || self.phase.is_none() {
            return;
        }
        let last = self.store.last_sequence();
        let Some(p) = self.replicas.get_mut(&from) else {
            return;
        };
        p.last_activity = Some(now);
        if r.sequence > p.receipt && r.sequence <= last {
            p.receipt = r.sequence;
            p.last_progress = Some(now);
            if p.next.is_some_and(|n| n <= r.sequence) {
                p.next = Some(r.sequence + 1);
            }
        }
        self.update_commit(now);
        self.pump(now);
    }

    /// The journal is durable up to `sequence` (fsync done).
    fn on_persisted(&mut self, now: Instant, sequence: u64) {
        self.persisted = sequence.min(self.store.last_sequence()).max(self.persisted);
        self.check_reinstalled();
        if matches!(
            self.phase,
            Some(PrimaryPhase::Collecting | PrimaryPhase::Pulling { .. })
        ) {
            // Healing may have waited for the primary-lease mark.
            self.advance_healing(now);
        }
        if self.phase.is_some() {
            self.update_commit(now);
            self.pump(now);
        } else {
            self.send_receipt();
        }
    }

    /// Clears [`Store::needs_install`] once this journal durably holds the position its
    /// re-install aims at (`reinstall_target`) under the same lease.
    fn check_reinstalled(&mut self) {
        let Some((lease, through)) = self.reinstall_target else {
            return;
        };
        if !self.store.needs_install() {
            self.reinstall_target = None;
            return;
        }
        if lease != self.lease || self.persisted < through || self.installing.is_some() {
            return;
        }
        match self.store.clear_needs_install() {
            Ok(()) => {
                self.reinstall_target = None;
                info!(partition = %self.cfg.partition, %lease, through, "journal re-installed: counts in healing quorums again");
            }
            Err(e) => {
                self.fail(e);
            }
        }
    }

    /// Whether `n`'s shape counts towards the healing quorum: not a journal set aside and not
    /// re-installed yet, not a learner.
    fn counts_in_healing(&self, n: &NodeId) -> bool {
        !self.uncounted.contains(n) && !self.learners.contains(n)
    }

    fn quorum_position(&self) -> u64 {
        let mut positions: Vec<u64> = vec![self.persisted];
        positions.extend(
            self.replicas
                .iter()
                .filter(|(n, _)| !self.learners.contains(n))
                .map(|(_, p)| p.receipt),
        );
        positions.sort_unstable_by(|a, b| b.cmp(a));
        let q = self.quorum();
        positions.get(q - 1).copied().unwrap_or(0)
    }

    /// Whether replica `p` is waited for before positions are settled (see the module doc).
    fn in_sync(&self, now: Instant, p: &ReplicaProgress) -> bool {
        p.receipt >= self.store.last_sequence()
            || p.last_progress
                .is_some_and(|t| now.saturating_duration_since(t) < self.cfg.in_sync_timeout)
    }

    /// The position every node may settle: committed, and held by every in-sync replica.
    fn settle(&mut self, now: Instant) {
        let mut through = self.committed.min(self.persisted);
        for p in self.replicas.values() {
            if self.in_sync(now, p) {
                through = through.min(p.receipt);
            }
        }
        self.store.set_base(through);
    }

    fn update_commit(&mut self, now: Instant) {
        self.committed = self.committed.max(self.quorum_position());
        match self.phase {
            Some(PrimaryPhase::Syncing) => {
                let last = self.store.last_sequence();
                let started = self.store.last_lease() == self.lease.0;
                if started && self.persisted == last && self.committed >= last {
                    self.phase = Some(PrimaryPhase::Active);
                    if self.store.needs_install() {
                        // Healed from a quorum that did not count this node: its journal
                        // holds every committed record.
                        self.reinstall_target = Some((self.lease, last));
                        self.check_reinstalled();
                    }
                    self.settle(now);
                    self.outputs.push_back(Output::Active { lease: self.lease });
                }
            }
            Some(PrimaryPhase::Active) => {
                self.release_acks();
                self.settle(now);
            }
            _ => {}
        }
    }

    /// Turns the waiters whose PUT is now safe into `Ack` outputs: strong ones up to the quorum
    /// mark (`committed`), eventual ones up to this node's own fsync mark (`persisted`). Each
    /// kind has its own queue in sequence order, so a release drains the front of each and
    /// never rescans PUTs that are still in flight (a rescan per receipt showed in a profile).
    fn release_acks(&mut self) {
        let strong = self.strong_waiters.take_through(self.committed);
        let eventual = self.eventual_waiters.take_through(self.persisted);
        for w in strong.chain(eventual) {
            self.outputs.push_back(Output::Ack {
                producer: w.producer,
                uri: w.uri,
                guid: w.guid,
            });
        }
    }

    /// The waiters of PUTs with `strong` consistency, or of the eventual ones.
    fn waiters_mut(&mut self, strong: bool) -> &mut AckWaiters {
        if strong {
            &mut self.strong_waiters
        } else {
            &mut self.eventual_waiters
        }
    }

    fn advance_healing(&mut self, now: Instant) {
        loop {
            match self.phase.clone() {
                Some(PrimaryPhase::Collecting) => {
                    let counted = self
                        .shapes
                        .keys()
                        .filter(|n| self.counts_in_healing(n))
                        .count();
                    if counted < self.quorum() {
                        return;
                    }
                    let mine = shape_position(&self.shape());
                    // Pulled from a counted member (or this one): one whose journal was set
                    // aside serves no pull, and a counted member holds every committed record
                    // (the counted members are a quorum, and each holds what it receipted).
                    let me = self.cfg.self_id;
                    let best = self
                        .shapes
                        .iter()
                        .filter(|(n, _)| **n == me || self.counts_in_healing(n))
                        .max_by_key(|(n, s)| (shape_position(s), **n == self.cfg.self_id))
                        .map(|(n, s)| (*n, shape_position(s)))
                        .expect("at least our own shape");
                    if best.1 > mine {
                        self.phase = Some(PrimaryPhase::Pulling { from: best.0 });
                        self.send_pull(now, best.0);
                        return;
                    }
                    if !self.lease_marked() {
                        // Resumed once the mark is durable (`on_persisted`).
                        return;
                    }
                    self.phase = Some(PrimaryPhase::Syncing);
                }
                Some(PrimaryPhase::Pulling { from }) => {
                    let target = self
                        .shapes
                        .get(&from)
                        .map(shape_position)
                        .unwrap_or_default();
                    if shape_position(&self.shape()) < target {
                        if self.pull_sent_at.is_none() {
                            self.send_pull(now, from);
                        }
                        return;
                    }
                    if !self.lease_marked() {
                        return;
                    }
                    self.phase = Some(PrimaryPhase::Syncing);
                }
                Some(PrimaryPhase::Syncing) => {
                    self.start_lease(now);
                    let shapes = std::mem::take(&mut self.shapes);
                    for (n, shape) in &shapes {
                        if *n != self.cfg.self_id {
                            self.sync_replica(now, *n, shape);
                        }
                    }
                    self.update_commit(now);
                    self.pump(now);
                    return;
                }
                _ => return,
            }
        }
    }

    /// Appends the lease's first record once the journal is whole (`StoredLeaseStart`, as
    /// Raft's leader appends a no-op at the start of its term, §5.4.2): until a quorum holds a
    /// record of this lease, the records of older leases it holds are not committed by this
    /// primary's count, since a later healing could prefer a journal whose last lease is
    /// higher than theirs. A full disk leaves it to the next tick; the primary goes active
    /// only with it.
    fn start_lease(&mut self, now: Instant) {
        if self.store.last_lease() != self.lease.0 {
            self.append(now, RecordKind::LeaseStart(StoredLeaseStart {}), 0);
        }
    }

    fn send_pull(&mut self, now: Instant, from: NodeId) {
        self.pull_sent_at = Some(now);
        let install_covered = self
            .installing
            .as_ref()
            .filter(|i| i.from == from)
            .map_or(0, |i| i.staged.last_sequence());
        let p = PullRecords {
            partition_id: self.cfg.partition.0,
            lease: self.lease.0,
            shape: Some(self.shape()),
            install_covered,
        };
        self.send(from, MsgKind::Pull(p));
    }

    /// Brings `node`, whose journal has `shape`, to this primary's journal: the records after
    /// the common prefix, or an install when that is below our floor.
    fn sync_replica(&mut self, now: Instant, node: NodeId, shape: &JournalShape) {
        let prefix = common_prefix(&self.shape(), shape);
        let install = prefix < self.store.floor();
        let message = if install {
            self.install_message(0)
        } else {
            self.sync_message(prefix)
        };
        let Some(s) = message else { return };
        // An install's chunks continue its staged journal, which the first one covers through
        // `covered_through` whatever the member held (a next of `prefix + 1` sent a second
        // chunk after a gap the member could not fill, and the install began again forever:
        // replication simulator, 5 nodes, seed 4294968040).
        let next = if install {
            s.covered_through + 1
        } else {
            s.covered_through.max(prefix) + 1
        };
        let settled = s.settled_through;
        let epoch = s.install_id;
        if let Some(p) = self.replicas.get_mut(&node) {
            p.next = Some(next);
            p.receipt = 0;
            p.last_activity = Some(now);
            p.install = install;
            p.install_epoch = epoch;
            p.sent_settled = settled;
        }
        self.send(node, MsgKind::Sync(s));
    }

    /// Streams what each synchronised replica lacks, within the in-flight limit, and tells
    /// caught-up replicas a new settled position.
    fn pump(&mut self, now: Instant) {
        if !matches!(
            self.phase,
            Some(PrimaryPhase::Syncing | PrimaryPhase::Active)
        ) || self.failed
        {
            return;
        }
        // Not past the horizon: what lies beyond goes once the lease's first record is
        // durable here (`on_persisted` pumps again).
        let last = self.send_horizon();
        let base = self.store.base();
        let nodes: Vec<NodeId> = self.replicas.keys().copied().collect();
        // The frames last read (after which position, and what they cover through): the next
        // replica at the same position gets the same bytes.
        let mut shared: Option<(u64, Bytes, u64)> = None;
        for n in nodes {
            loop {
                let p = self.replicas.get(&n).expect("listed");
                let Some(next) = p.next else { break };
                if next > last {
                    if p.sent_settled < base && !p.install {
                        // Nothing to send but the settled position.
                        let r = ReplicateRecords {
                            partition_id: self.cfg.partition.0,
                            lease: self.lease.0,
                            prev_sequence: next - 1,
                            records: Vec::new(),
                            covered_through: 0,
                            settled_through: base,
                            framed_records: Bytes::new(),
                        };
                        self.replicas.get_mut(&n).expect("listed").sent_settled = base;
                        self.send(n, MsgKind::Replicate(r));
                    }
                    break;
                }
                if next.saturating_sub(p.receipt + 1) >= self.cfg.in_flight_records_max {
                    break;
                }
                if p.install || next - 1 < self.store.floor() {
                    // Receiving the live state, or fell below the floor (it was not in sync
                    // while dead records were removed): continue or start an install. An
                    // install during which dead records were removed starts over: its chunks
                    // would not make one state (a message sent earlier could miss its confirm).
                    let continuing = p.install && p.install_epoch == self.store.maintenance_epoch();
                    let after = if continuing { next - 1 } else { 0 };
                    let Some(s) = self.install_message(after) else {
                        return;
                    };
                    let p = self.replicas.get_mut(&n).expect("listed");
                    if !continuing {
                        p.receipt = 0;
                        p.install_epoch = s.install_id;
                    }
                    p.install = true;
                    p.next = Some(s.covered_through + 1);
                    p.last_activity = Some(now);
                    p.sent_settled = s.settled_through;
                    // Complete once it covers the floor: from there on it is a normal replica.
                    if s.covered_through >= s.install_through {
                        p.install = false;
                    }
                    self.send(n, MsgKind::Sync(s));
                    continue;
                }
                // Recent records go as the journal holds them (read once for every replica at
                // the same position); older ones are read back from disk and encoded.
                let framed = match &shared {
                    Some((after, frames, covered)) if *after == next - 1 => {
                        Some((frames.clone(), *covered))
                    }
                    _ => {
                        // Positions at or above the floor are contiguous: a count keeps the
                        // read within `last`.
                        let read = self.store.read_frames_from(
                            next - 1,
                            self.cfg.batch_records_max.min((last - (next - 1)) as usize),
                            BATCH_BYTES_MAX,
                        );
                        if let Some((frames, covered)) = &read {
                            shared = Some((next - 1, frames.clone(), *covered));
                        }
                        read
                    }
                };
                let (records, framed_records, covered) = match framed {
                    Some((frames, covered)) => (Vec::new(), frames, covered),
                    None => {
                        let read = self.store.read_from(
                            next - 1,
                            self.cfg.batch_records_max.min((last - (next - 1)) as usize),
                            BATCH_BYTES_MAX,
                            false,
                        );
                        match read {
                            Ok((records, covered)) => (records, Bytes::new(), covered),
                            Err(e) => {
                                self.fail(e);
                                return;
                            }
                        }
                    }
                };
                let r = ReplicateRecords {
                    partition_id: self.cfg.partition.0,
                    lease: self.lease.0,
                    prev_sequence: next - 1,
                    records,
                    covered_through: covered,
                    settled_through: base,
                    framed_records,
                };
                let p = self.replicas.get_mut(&n).expect("listed");
                p.next = Some(covered + 1);
                p.last_activity = Some(now);
                p.sent_settled = base;
                self.send(n, MsgKind::Replicate(r));
            }
        }
    }

    /// Resends what got no answer within `resend_after`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.next_tick.is_none_or(|t| now < t) {
            return;
        }
        self.next_tick = self.phase.as_ref().map(|_| now + TICK);
        let Some(phase) = self.phase.clone() else {
            self.ask_for_install(now);
            return;
        };
        let resend = self.cfg.resend_after;
        let stale =
            |t: Option<Instant>| t.is_none_or(|t| now.saturating_duration_since(t) >= resend);
        if let PrimaryPhase::Pulling { from } = phase {
            if stale(self.pull_sent_at) {
                self.send_pull(now, from);
            }
        }
        if phase == PrimaryPhase::Syncing {
            self.start_lease(now);
        }
        let last = self.store.last_sequence();
        let nodes: Vec<NodeId> = self.replicas.keys().copied().collect();
        for n in nodes {
            let p = self.replicas.get(&n).expect("listed").clone();
            let in_collect = matches!(
                phase,
                PrimaryPhase::Collecting | PrimaryPhase::Pulling { .. }
            );
            if p.next.is_none() || in_collect {
                if (!in_collect || !self.shapes.contains_key(&n)) && stale(p.last_activity) {
                    self.replicas.get_mut(&n).expect("listed").last_activity = Some(now);
                    self.query_shape(n);
                }
            } else if p.receipt < last && stale(p.last_activity) {
                if !p.install && p.receipt < self.store.floor() {
                    // Nothing receipted at this lease above the floor, and no install under
                    // way: its sync (or the receipt) was lost. Streaming from the receipt would
                    // start an install, which replaces the replica's journal with the live
                    // state through our floor — shorter than the history it may hold, and
                    // what it held above the floor may be a committed record that a quorum
                    // needs (replication simulator, 3 nodes, seed 831). Ask for its shape
                    // again instead: it is synchronised from the common prefix, and installed
                    // only if that is below the floor.
                    let p = self.replicas.get_mut(&n).expect("listed");
                    p.next = None;
                    p.last_activity = Some(now);
                    self.query_shape(n);
                    continue;
                }
                // Lost batches or a replica that restarted: stream again from its receipt; a
                // replica that cannot follow answers with its shape and is synchronised.
                let p = self.replicas.get_mut(&n).expect("listed");
                p.next = Some(p.receipt + 1);
                self.pump(now);
            }
        }
        if phase == PrimaryPhase::Active {
            // Replicas leave the in-sync set with time alone.
            self.settle(now);
            self.pump(now);
        }
    }

    /// Starts loading what [`ReplicationCore::duplicate_of`] (and a confirm's look-up) of
    /// `guid` reads — the index's bucket and the duplicate window's — so that a batch's cache
    /// misses overlap; returns a value to fold into `std::hint::black_box`.
    pub fn prefetch_guid(&self, guid: &[u8]) -> u32 {
        let key = guid_key(guid);
        self.store.prefetch_outstanding(key) ^ self.guids.prefetch(key)
    }

    /// The sequence of the stored copy of `guid` when a PUT of it is a resend: the
    /// outstanding message's, or 0 for one already confirmed within the duplicate window
    /// (committed, so its ACK is due at once). `None` for a new message.
    pub fn duplicate_of(&mut self, now: Instant, guid: &[u8]) -> Option<u64> {
        // GUIDs that left the index since the last sync are not in the window yet.
        self.remember_retired(now);
        self.guids
            .expire(now, self.cfg.guid_window_max, self.cfg.guid_window_age);
        let key = guid_key(guid);
        self.store
            .outstanding_sequence(key)
            .or_else(|| self.guids.contains(key).then_some(0))
    }

    /// A resent PUT of a message stored as record `sequence`: its ACK is released with that
    /// record's (`strong`: at quorum, else once persisted here), at once if that is so.
    pub fn wait_for_stored(
        &mut self,
        producer: SessionAddr,
        uri: UriBytes,
        guid: Bytes,
        strong: bool,
        sequence: u64,
    ) {
        let waiter = Waiter {
            producer,
            uri,
            guid,
        };
        self.waiters_mut(strong).add(sequence, waiter);
        self.release_acks();
    }

    /// A new PUT from `producer` (active primary only; the caller checked it is not a resend
    /// with [`ReplicationCore::duplicate_of`]). `strong`: ACK at quorum, else once persisted
    /// here.
    #[allow(clippy::too_many_arguments)]
    pub fn handle_put(
        &mut self,
        now: Instant,
        producer: SessionAddr,
        uri: UriBytes,
        guid: Bytes,
        payload: Bytes,
        properties: Vec<Property>,
        strong: bool,
        timestamp_ms: u64,
    ) -> PutResult {
        if !self.is_active_primary() || self.failed {
            return PutResult::NotReady;
        }
        let waiter = Waiter {
            producer,
            uri: uri.clone(),
            guid: guid.clone(),
        };
        let kind = RecordKind::Message(StoredMessage {
            uri,
            guid,
            payload,
            properties,
        });
        let Some(sequence) = self.append(now, kind, timestamp_ms) else {
            return if self.failed {
                PutResult::NotReady
            } else {
                PutResult::StorageFailure {
                    reason: format!(
                        "partition {} cannot write its journal: the disk is full",
                        self.cfg.partition
                    ),
                }
            };
        };
        self.waiters_mut(strong).add(sequence, waiter);
        PutResult::Appended { sequence }
    }

    /// Appends a record that no producer waits for (a confirm, a failure, a removal); active
    /// primary only. Returns its sequence, or `None` when not the active primary or the
    /// journal could not take it (a full disk: the effect stays in memory only, so a new
    /// primary may redeliver — at-least-once).
    pub fn handle_record(
        &mut self,
        now: Instant,
        kind: RecordKind,
        timestamp_ms: u64,
    ) -> Option<u64> {
        if !self.is_active_primary() {
            return None;
        }
        self.append(now, kind, timestamp_ms)
    }

    fn append(&mut self, now: Instant, kind: RecordKind, timestamp_ms: u64) -> Option<u64> {
        if self.failed {
            return None;
        }
        let sequence = self.store.last_sequence() + 1;
        let record = JournalRecord {
            lease: self.lease.0,
            sequence,
            timestamp_ms,
            kind: Some(kind),
        };
        let result = self.store.append_one(&record);
        if !self.wrote(result) {
            return None;
        }
        if self.in_batch {
            self.pump_due = true;
        } else {
            self.pump(now);
        }
        Some(sequence)
    }

    /// Starts a batch of inputs (the PUTs and confirms of one turn): what they append is
    /// streamed to the replicas once, at [`ReplicationCore::end_batch`], as one
    /// `ReplicateRecords` per replica instead of one per record.
    pub fn begin_batch(&mut self) {
        self.in_batch = true;
    }

    /// Ends a batch: streams what it appended (see [`ReplicationCore::begin_batch`]).
    pub fn end_batch(&mut self, now: Instant) {
        self.in_batch = false;
        if std::mem::take(&mut self.pump_due) {
            self.pump(now);
        }
    }
}

/// `(lease of the last record, last sequence)`: how advanced a journal is.
pub fn shape_position(shape: &JournalShape) -> (u64, u64) {
    (
        shape.runs.last().map_or(0, |r| r.lease),
        shape.last_sequence,
    )
}

fn lease_at(shape: &JournalShape, sequence: u64) -> Option<u64> {
    if sequence == 0 || sequence > shape.last_sequence {
        return None;
    }
    shape
        .runs
        .iter()
        .rev()
        .find(|r| r.first_sequence <= sequence)
        .map(|r| r.lease)
}

/// The last position up to which two journals hold the same records: the end of the longest
/// prefix over which they have the same lease at every position.
pub fn common_prefix(a: &JournalShape, b: &JournalShape) -> u64 {
    let limit = a.last_sequence.min(b.last_sequence);
    let mut bounds: Vec<u64> = a
        .runs
        .iter()
        .chain(b.runs.iter())
        .map(|r| r.first_sequence)
        .filter(|s| *s >= 1 && *s <= limit)
        .collect();
    bounds.push(1);
    bounds.sort_unstable();
    bounds.dedup();
    let mut matched = 0;
    for (i, start) in bounds.iter().enumerate() {
        let end = bounds.get(i + 1).map_or(limit, |n| n - 1);
        if *start > limit {
            break;
        }
        if lease_at(a, *start) != lease_at(b, *start) {
            break;
        }
        matched = end;
    }
    matched
}

#[cfg(test)]
#[path = "replication_tests.rs"]
mod tests;
