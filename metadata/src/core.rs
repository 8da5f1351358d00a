//! The metadata replication state machine (DESIGN.md §5): pure, no I/O, no clock.
//!
//! Inputs are `handle_*(now, ..)`, [`MetadataCore::propose`], [`MetadataCore::on_persisted`];
//! outputs are drained with [`MetadataCore::poll_output`]; [`MetadataCore::poll_timeout`] says
//! when to call [`MetadataCore::handle_timeout`] next. Durability is an output: the shell writes
//! [`MetadataOutput::Persist`] records and then calls `on_persisted`, and acks (and the leader's
//! own vote towards a quorum) are released only after that.
//!
//! # Roles
//!
//! - **Follower**: accepts records only from the leader it follows, at its current term, in order:
//!   the sequence of a record (or commit) must be `last + 1` within the term. Older terms are stale,
//!   a smaller or equal LSN is a duplicate (re-acked if durable), a larger one is a gap (answered
//!   with `FollowerHello`; the leader replies with a `CatchUp`). Records of a term whose snapshot
//!   (the `LeaderAdvisory` at `(term, 1)`) has not been seen are gated (buffered, bounded) until it
//!   arrives. Acks go out after `on_persisted`: one ack, naming the highest durable record of
//!   the term, covers every record before it (the leader keeps acks as high-water marks), so a
//!   shell that syncs a group of records sends one ack. A leader sync query that arrives before
//!   the elector names its sender as leader of its (newer) term is kept and answered then.
//! - **Passive leader**: runs leader sync (below), then proposes the `LeaderAdvisory` at
//!   `(term, 1)` (the term start); it becomes **active** when that commits. Only an active
//!   leader accepts proposals and queue assignment requests.
//! - **Term start without the state**: when the new leader's own history is the most advanced
//!   of the sync quorum (the usual failover: the survivors hold the same records), the term
//!   start only names the last advisory of that history (`continues`) and carries no
//!   snapshot; the leader's uncommitted advisories of older terms stay pending and its commit
//!   commits them. A follower takes it only if its own last advisory is that LSN (it then
//!   holds exactly that history: within a term records are gap-free, and each term starts
//!   from a history named this way or whole); otherwise it says hello. A follower that
//!   announced another last advisory in the sync, or says hello, gets the same record whole
//!   (the snapshot). So a failover builds, writes and sends no copy of the state unless a
//!   follower lags (DESIGN.md §5a, failover flat in the state). The cluster's first term,
//!   which seeds the membership and the domains, and a leader that adopted another node's
//!   state, start whole.
//! - **Active leader**: stamps each advisory with the next LSN, persists it, broadcasts it, counts
//!   acks (its own after `on_persisted`), and at quorum persists a COMMIT record (its own LSN is
//!   the next sequence, naming the committed LSN) and broadcasts `AdvisoryCommit`. Committing an
//!   LSN commits every smaller one; state is applied **only** on commit.
//! - **Queue assignment requests** are kept by the node that got them until it sees them
//!   committed (see [`MetadataCore::request_queue_assignment`]), so none is lost to a failover.
//! - **Batches**: a [`peer::MetadataBatch`] is handled as its messages in order.
//!
//! Every step costs O(changes) in the size of the state: the states are persistent
//! maps (see `state.rs`), commits find the quorum in O(members log members + log pending).
//!
//! # Why leader sync keeps the most advanced node's uncommitted advisories
//!
//! BlazingMQ lets any node become leader (no Raft §5.4.1 election restriction), so a new leader
//! may lack committed advisories. It therefore asks a quorum for their last LSN and adopts the
//! state of the node with the highest one, uncommitted advisories included. This is safe (the
//! Raft §5.4 argument, moved from the election to the sync):
//!
//! 1. A committed advisory was acked, hence durably held, by a quorum Q1.
//! 2. The sync quorum Q2 intersects Q1 in some node n. A node answers the sync of term T only when
//!    it follows the term-T leader, and from then on refuses records of older terms; so n held the
//!    advisory (or a later term's snapshot, which by induction contains it) when it answered.
//! 3. Logs are gap-free per term (a follower accepts `(t, s)` only after `(t, s - 1)`, and the
//!    first record of a term is that term's snapshot). So the node m with the highest last LSN
//!    either shares n's last term and holds a superset of n's records in it, or has a later
//!    term's snapshot, which contains everything committed before that term's sync.
//! 4. Hence m's state with all its advisories applied contains every committed advisory, and so
//!    does the new leader's `LeaderAdvisory` — whole, or as the continuation of m's history
//!    when m is the leader itself (a quorum acks it only by holding that same history). Uncommitted advisories that survive this way are
//!    committed by the new term (that is allowed: no client was told they failed); those that do
//!    not survive were never committed.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bmq_proto::peer::{self, metadata_message::Kind as Msg};
use bmq_proto::{NodeId, PartitionId, Term};
use thiserror::Error;
use tracing::{debug, error, info};

use crate::assignment::pick_partition_for_queue;
use crate::domains::DomainState;
use crate::ledger::{is_leader_advisory, LedgerRecord, Recovered};
use crate::lsn::{lsn_of, Lsn};
use crate::membership::{ClusterMembership, MemberRole};
use crate::state::{ApplyError, ClusterState};
use bmq_config::DomainConfig;

/// Timers and limits of the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataConfig {
    /// Re-send interval of `LeaderSyncStateQuery` / `LeaderSyncDataQuery` until answered.
    pub sync_retry: Duration,
    /// A record not acked by a follower within this time is re-sent to it.
    pub record_resend: Duration,
    /// Interval between `FollowerHello`s of an out-of-sync follower.
    pub hello_retry: Duration,
    /// While no advisory follows its latest commit record, the active leader re-broadcasts
    /// that record this often, so a follower that lost the tail of the leader's commits (or
    /// got them out of order) sees the gap and catches up even when the leader is otherwise
    /// idle. Commit records are not acked, so nothing else would tell it; Raft's heartbeats
    /// carry the commit index for the same reason (Raft §5.3).
    pub commit_refresh: Duration,
    /// Data query attempts to the most advanced node before the leader drops its answer and
    /// collects a new quorum of sync responses without it.
    pub sync_data_attempts_max: u32,
    /// Uncommitted advisories the leader accepts before `propose` answers `Overloaded`.
    pub uncommitted_max: usize,
    /// Records a follower gates while waiting for its term's snapshot.
    pub gated_max: usize,
    /// Queue assignment requests a node keeps until it sees them committed (see
    /// [`MetadataCore::request_queue_assignment`]); more are dropped and counted.
    pub assignment_requests_max: usize,
    /// A kept queue assignment request older than this is forgotten (whoever asked has given
    /// up: the node's default request timeout is 10 s).
    pub assignment_request_ttl: Duration,
    /// How often kept queue assignment requests are sent again while none of them is
    /// committed: a request forwarded to the leader may be lost on the way, and an active
    /// leader with no partition primary yet defers them. This is the one place an open's
    /// assignment is asked again (the sessions ask once).
    pub assignment_request_resend: Duration,
    /// The active leader promotes a learner to voter as soon as it has applied the membership
    /// that made it a learner (it then holds the ledger up to that commit) and, with
    /// `promote_after_journals`, follows every partition's primary, one at a time, while
    /// the voters stay within [`crate::MAX_VOTERS`] (etcd's `member promote`, with no operator
    /// step); and it removes a leaving member once that member is primary of no partition
    /// (the second half of a voter's removal, finished by whichever leader is active).
    /// `false` leaves learners and leaving members as they are (tests).
    pub promote_learners: bool,
    /// The promotion also waits for the learner's journals: its latest [`LearnerProgress`]
    /// (`peer::LearnerProgress`, which a broker's learner sends its peers while it catches up)
    /// must be of the committed membership's epoch and show every partition with a primary
    /// followed. The learner then joins its first lease as a replica that already holds the
    /// journal instead of one the others outvote while it heals. `false`: the ledger alone
    /// (a core without a data plane: the simulator, unit tests).
    pub promote_after_journals: bool,
    /// Committed advisories each node keeps in memory, newest first out, to catch a follower
    /// up with the records it missed instead of the whole state (a node paused, cut off or
    /// restarted for a while: Raft's log, bounded). A follower further behind gets the state.
    pub catch_up_records_max: usize,
}

impl Default for MetadataConfig {
    fn default() -> Self {
        MetadataConfig {
            sync_retry: Duration::from_millis(200),
            record_resend: Duration::from_millis(500),
            hello_retry: Duration::from_millis(500),
            commit_refresh: Duration::from_millis(500),
            sync_data_attempts_max: 5,
            uncommitted_max: 1024,
            gated_max: 1024,
            assignment_requests_max: 4096,
            assignment_request_ttl: Duration::from_secs(10),
            assignment_request_resend: Duration::from_millis(500),
            promote_learners: true,
            promote_after_journals: true,
            catch_up_records_max: 4096,
        }
    }
}

/// How far a learner has caught up, as it last reported (`peer::LearnerProgress`; not
/// ledgered). Shown by `/status`; gates its promotion (see
/// [`MetadataConfig::promote_after_journals`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LearnerProgress {
    /// The committed membership epoch the learner had applied (it holds the ledger up to it).
    pub membership_epoch: u64,
    /// Partitions whose primary has synchronised the learner's journal.
    pub partitions_following: u32,
    /// Partitions with a primary in the learner's committed state.
    pub partitions: u32,
}

impl LearnerProgress {
    /// Every partition with a primary is followed.
    pub fn journals_caught_up(&self) -> bool {
        self.partitions_following >= self.partitions
    }
}

/// The metadata role of this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum MetadataRole {
    /// Follows the elector's leader (or has none).
    Follower,
    /// Elected leader, syncing; refuses proposals.
    PassiveLeader,
    /// Leader whose term snapshot is committed; accepts proposals.
    ActiveLeader,
}

/// A summary of the core's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetadataStatus {
    /// The role.
    pub role: MetadataRole,
    /// The current term (the elector's).
    pub term: Term,
    /// The current leader, if known.
    pub leader: Option<NodeId>,
    /// The LSN of the last record held.
    pub last_lsn: Lsn,
    /// The last committed LSN.
    pub committed_lsn: Lsn,
    /// The number of uncommitted advisories held.
    pub uncommitted: usize,
}

/// What the shell must do. Executed in order.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataOutput {
    /// Append this record to the ledger (fsync per policy), then call `on_persisted(lsn)`.
    Persist {
        /// The record.
        record: LedgerRecord,
    },
    /// Replace the ledger's history (`Ledger::reset_to`), then call `on_persisted` with the
    /// last LSN of it. The committed state changed wholesale: publish it.
    ResetLedger {
        /// The committed state.
        state: ClusterState,
        /// Its LSN.
        committed_lsn: Lsn,
        /// Uncommitted advisories after it.
        uncommitted: Vec<(Lsn, peer::Advisory)>,
    },
    /// Send to one peer.
    Send {
        /// The peer.
        to: NodeId,
        /// The message.
        message: peer::MetadataMessage,
    },
    /// Send to every peer.
    Broadcast {
        /// The message.
        message: peer::MetadataMessage,
    },
    /// This advisory is committed and applied to [`MetadataCore::state`].
    Committed {
        /// Its LSN.
        lsn: Lsn,
        /// The advisory.
        advisory: peer::Advisory,
    },
    /// The role, term or leader changed.
    RoleChanged {
        /// The new status.
        status: MetadataStatus,
    },
    /// Queue `uri` is proposed for `partition`: a `QueueAssignmentAdvisory` naming it was
    /// stamped (on the leader) or accepted (on a follower), and its record is the
    /// [`MetadataOutput::Persist`] just before this output (one per queue of the advisory, in
    /// its order). Only a hint: the assignment may still be lost to a failover until
    /// [`MetadataOutput::Committed`]. An open on this node can go to the proposed partition's
    /// primary while the commit is under way (DESIGN.md §7, "Proxying").
    AssignmentProposed {
        /// The queue URI.
        uri: String,
        /// The partition proposed for it.
        partition: PartitionId,
    },
}

/// Why a proposal was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProposeError {
    /// This node is not the leader; try `leader`.
    #[error("not the leader (leader is {leader:?})")]
    NotLeader {
        /// The leader, if known.
        leader: Option<NodeId>,
    },
    /// The leader has not finished leader sync yet.
    #[error("leader is not active yet")]
    NotActive,
    /// A membership change is proposed while another is uncommitted (single-server changes go
    /// one at a time, Raft dissertation §4.1).
    #[error(
        "membership change to epoch {pending_epoch} is not committed yet; one change at a time"
    )]
    MembershipChangeInFlight {
        /// The epoch of the uncommitted change.
        pending_epoch: u64,
    },
    /// A membership change is proposed before a majority of the current voters has applied the
    /// current membership (otherwise a voter still on an older set could help elect a second
    /// leader: the rule the elector's model checker found necessary). Retry shortly.
    #[error("membership epoch {epoch} is applied by {applied} of {voters} voters; a majority must apply it first")]
    MembershipNotApplied {
        /// The committed epoch.
        epoch: u64,
        /// Voters known to have applied it.
        applied: usize,
        /// Voters in all.
        voters: usize,
    },
    /// A membership change is proposed before every partition follows the committed one
    /// ([`ClusterState::partition_lagging_membership`]: its primary ACTIVE at a lease whose
    /// replicas are the current voters). The health actor re-leases the partitions after each
    /// change; retry shortly.
    #[error("partition {partition} does not follow membership epoch {epoch} yet: {reason}")]
    PartitionsNotFollowing {
        /// The committed epoch.
        epoch: u64,
        /// The first partition that lags.
        partition: PartitionId,
        /// Why it lags.
        reason: &'static str,
    },
    /// Too many uncommitted advisories; retry later.
    #[error("{uncommitted} advisories uncommitted; retry later")]
    Overloaded {
        /// The number of uncommitted advisories.
        uncommitted: usize,
    },
    /// The advisory does not apply to the state as it will be after the pending advisories.
    #[error("invalid advisory: {0}")]
    Invalid(#[from] ApplyError),
}

/// Bad or stale peer input, dropped and counted (never an error, never a panic).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetadataCounters {
    /// Messages from a node that is not a member (or from self).
    pub unknown_sender: u64,
    /// Records or leader messages from a node we do not follow, or while not a follower.
    pub wrong_leader: u64,
    /// Messages of an older term.
    pub stale_term: u64,
    /// Records of a newer term than ours (the elector has not told us yet).
    pub future_term: u64,
    /// Records or commits already held.
    pub duplicate: u64,
    /// Records or commits that skip sequences.
    pub gap: u64,
    /// Records gated until the term's snapshot arrives.
    pub gated: u64,
    /// Gated records dropped because the gate was full.
    pub gated_overflow: u64,
    /// Malformed messages (missing fields, invalid snapshots, impossible LSNs).
    pub invalid: u64,
    /// Leader-only requests received while not an active leader.
    pub not_active: u64,
    /// Leadership notifications for an older term, or a term we already hold records of.
    pub stale_leadership: u64,
    /// Committed advisories that did not apply (a bug elsewhere; the state skipped them).
    pub apply_failures: u64,
    /// Records re-sent to followers that had not acked them in time.
    pub records_resent: u64,
    /// CatchUps sent by this node as leader.
    pub catch_ups_sent: u64,
    /// Of those, the ones that carried the whole committed state (the follower's last
    /// advisory was not one this leader holds).
    pub whole_catch_ups_sent: u64,
    /// CatchUps without the state that did not continue this follower's history (it then
    /// asks for the whole state).
    pub catch_ups_refused: u64,
    /// Latest commit records re-broadcast by this node as idle leader
    /// ([`MetadataConfig::commit_refresh`]).
    pub commits_refreshed: u64,
    /// FollowerHellos sent by this node.
    pub hellos_sent: u64,
    /// Leader sync queries from a node not yet known as the leader of their (newer) term, kept
    /// and answered once the elector names it (instead of the leader retrying later).
    pub sync_queries_deferred: u64,
    /// Sync data responses that held less than the node had announced (it lost unsynced
    /// records in between): dropped, and the node asked again.
    pub sync_data_behind: u64,
    /// Term starts that only continue a history (a `LeaderAdvisory` without a snapshot) whose
    /// last advisory is not this node's: dropped, and the leader asked for the whole state.
    pub continuation_mismatches: u64,
    /// Term starts sent whole (with the snapshot) to a follower whose history differs from the
    /// new leader's, by this node as leader.
    pub term_snapshots_sent: u64,
    /// Queue assignment requests dropped because [`MetadataConfig::assignment_requests_max`]
    /// were already kept.
    pub assignment_requests_dropped: u64,
    /// Times the kept queue assignment requests were sent again for want of a commit
    /// ([`MetadataConfig::assignment_request_resend`]).
    pub assignment_resends: u64,
    /// Batches received that contained a batch (dropped).
    pub nested_batches: u64,
    /// Learners this node promoted to voter as active leader.
    pub learners_promoted: u64,
    /// Leaving members this node removed as active leader once their primaries moved.
    pub leaving_removed: u64,
}

#[derive(Debug, Clone)]
struct Pending {
    lsn: Lsn,
    advisory: peer::Advisory,
    /// Leader: when the record was last sent (for re-sending).
    sent_at: Option<Instant>,
}

#[derive(Debug, Clone)]
enum Gated {
    Record(Lsn, peer::Advisory),
    Commit(Lsn, Lsn),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeferredQuery {
    State,
    /// `after`: the asking leader's last advisory (see [`MetadataCore::answer_sync_query`]).
    Data {
        after: Option<Lsn>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum SyncPhase {
    /// Collecting `LeaderSyncStateResponse`s.
    Collecting,
    /// Waiting for `LeaderSyncDataResponse` from `from`.
    Fetching { from: NodeId, attempts: u32 },
    /// The term's `LeaderAdvisory` is proposed at `lsn`; waiting for its commit.
    Proposed { lsn: Lsn },
}

#[derive(Debug, Clone)]
struct LeaderSync {
    /// Node -> the LSN of its last advisory (self included).
    responses: BTreeMap<NodeId, Lsn>,
    phase: SyncPhase,
    next_retry: Instant,
    /// The proposed term start only continues the history whose last advisory is this LSN
    /// (no snapshot): followers that announced another get the whole state instead.
    continues: Option<Lsn>,
    /// The term start with the snapshot, built when a follower first needs it.
    whole: Option<peer::Advisory>,
    /// Followers that asked (with a hello) for the whole term start.
    wants_whole: BTreeSet<NodeId>,
}

/// The replication state machine of one node. See the module documentation for the rules.
#[derive(Debug)]
pub struct MetadataCore {
    self_id: NodeId,
    members: BTreeSet<NodeId>,
    quorum_setting: usize,
    config: MetadataConfig,
    term: Term,
    leader: Option<NodeId>,
    role: MetadataRole,
    committed_state: ClusterState,
    committed_lsn: Lsn,
    /// Uncommitted advisories in LSN order.
    pending: VecDeque<Pending>,
    /// The latest committed advisories, in LSN order, at most
    /// [`MetadataConfig::catch_up_records_max`]: what a CatchUp without the state sends a
    /// follower whose last advisory is one of them (or the one before the first).
    recent: VecDeque<(Lsn, peer::Advisory)>,
    /// The committed advisory just before `recent`'s first (the history `recent` continues).
    recent_base: Lsn,
    /// `committed_state` with every pending advisory applied.
    tip_state: ClusterState,
    last_lsn: Lsn,
    persisted_lsn: Lsn,
    /// Queue assignments asked on or through this node and not yet seen committed, with when
    /// they were asked (see [`MetadataCore::request_queue_assignment`]).
    assignment_requests: BTreeMap<String, Instant>,
    /// When kept assignment requests go out again (while any is kept): one timer for all.
    assignment_resend_at: Option<Instant>,
    // Follower.
    /// The highest LSN acked to the leader: an ack covers every record of the term up to it.
    ack_sent: Lsn,
    /// The membership epoch the last ack carried.
    epoch_reported: u64,
    /// Leader sync queries (state, data) from a node this follower does not follow yet at
    /// their newer term, answered once the elector names that leader.
    deferred_queries: Vec<(NodeId, Term, DeferredQuery)>,
    snapshot_seen: bool,
    out_of_sync: bool,
    /// A CatchUp without the state did not fit this node's history: the next hello asks for
    /// the whole state.
    wants_whole_catch_up: bool,
    gated: BTreeMap<u64, Gated>,
    hello_deadline: Option<Instant>,
    last_hello: Option<Instant>,
    /// After a CatchUp: the committed LSN a resync `AdvisoryCommit` must name.
    resync: Option<Lsn>,
    // Leader.
    /// The latest commit record `(lsn, committed)` of this term and when it was last
    /// broadcast, while it is the last record (see `MetadataConfig::commit_refresh`).
    commit_tail: Option<(Lsn, Lsn, Instant)>,
    matched: BTreeMap<NodeId, Lsn>,
    /// The membership epoch each node last reported applied (in its acks; self included).
    applied_epoch: BTreeMap<NodeId, u64>,
    /// Each learner's latest report of its catch-up (any role keeps them, for `/status`;
    /// dropped for a node that is no longer a learner).
    learner_progress: BTreeMap<NodeId, LearnerProgress>,
    /// Members learned from a peer's newer committed membership (its `PeerHello`) before this
    /// node's ledger holds it: their messages are accepted, so a leader this node never heard
    /// of can catch it up ([`MetadataCore::learn_members`]).
    learned: BTreeSet<NodeId>,
    /// The members the latest committed change removed: they still get the ledger's messages
    /// (the commit of their own removal, which makes them exit) until the next change.
    just_removed: BTreeSet<NodeId>,
    /// The membership the first leader writes into its snapshot when the ledger holds none:
    /// the nodes' `[[members]]` (see [`MetadataCore::set_seed_membership`]).
    seed_membership: Option<Arc<ClusterMembership>>,
    /// The domains the first leader writes into its snapshot when the ledger holds none:
    /// the node's `[[domains]]` (see [`MetadataCore::set_seed_domains`]).
    seed_domains: Option<Arc<Vec<DomainConfig>>>,
    sync: Option<LeaderSync>,
    last_status: Option<MetadataStatus>,
    /// The latest `now` seen, for inputs that carry no time (`set_quorum`).
    last_now: Option<Instant>,
    outputs: VecDeque<MetadataOutput>,
    counters: MetadataCounters,
}

impl MetadataCore {
    /// A core for `self_id` among `members` (self included), starting from what the ledger held.
    /// `quorum` 0 means `members.len() / 2 + 1`. The node starts as a follower with no leader at
    /// the term of its last LSN.
    pub fn new(self_id: NodeId, members: &[NodeId], quorum: usize, recovered: Recovered) -> Self {
        Self::with_config(
            self_id,
            members,
            quorum,
            recovered,
            MetadataConfig::default(),
        )
    }

    /// [`MetadataCore::new`] with explicit timers and limits.
    pub fn with_config(
        self_id: NodeId,
        members: &[NodeId],
        quorum: usize,
        recovered: Recovered,
        config: MetadataConfig,
    ) -> Self {
        let mut members: BTreeSet<NodeId> = members.iter().copied().collect();
        members.insert(self_id);
        let mut tip_state = recovered.committed_state.clone();
        let mut pending = VecDeque::new();
        for (lsn, advisory) in recovered.uncommitted {
            if let Err(error) = tip_state.apply(&advisory) {
                debug!(lsn = %lsn, error = %error, "recovered uncommitted advisory does not apply");
            }
            pending.push_back(Pending {
                lsn,
                advisory,
                sent_at: None,
            });
        }
        MetadataCore {
            self_id,
            members,
            quorum_setting: quorum,
            config,
            term: recovered.last_lsn.term,
            leader: None,
            role: MetadataRole::Follower,
            committed_state: recovered.committed_state,
            committed_lsn: recovered.committed_lsn,
            recent: VecDeque::new(),
            recent_base: recovered.committed_lsn,
            pending,
            tip_state,
            last_lsn: recovered.last_lsn,
            persisted_lsn: recovered.last_lsn,
            assignment_requests: BTreeMap::new(),
            assignment_resend_at: None,
            // Recovered records are never acked again unprompted: a leader that still needs
            // them re-sends, and a duplicate is re-acked.
            ack_sent: recovered.last_lsn,
            epoch_reported: 0,
            deferred_queries: Vec::new(),
            // A recovered history that holds records of its last term holds that term's start
            // (a term's records are gap-free from it): a restart within the same term needs
            // no new term start, only what it missed.
            snapshot_seen: recovered.last_lsn.sequence > 0,
            out_of_sync: false,
            wants_whole_catch_up: false,
            gated: BTreeMap::new(),
            hello_deadline: None,
            last_hello: None,
            resync: None,
            commit_tail: None,
            matched: BTreeMap::new(),
            applied_epoch: BTreeMap::new(),
            learner_progress: BTreeMap::new(),
            seed_membership: None,
            seed_domains: None,
            just_removed: BTreeSet::new(),
            learned: BTreeSet::new(),
            sync: None,
            last_status: None,
            last_now: None,
            outputs: VecDeque::new(),
            counters: MetadataCounters::default(),
        }
    }

    /// The other members of the cluster (every node but this one), in id order: the
    /// configured members until a membership is committed, then the committed and the
    /// proposed members (learners included).
    pub fn peers(&self) -> impl Iterator<Item = NodeId> + '_ {
        let self_id = self.self_id;
        self.targets().into_iter().filter(move |m| *m != self_id)
    }

    /// Every node that receives the ledger, self included (see [`MetadataCore::peers`]).
    fn targets(&self) -> BTreeSet<NodeId> {
        self.target_ids().collect()
    }

    /// The nodes of [`MetadataCore::targets`], a node possibly more than once; no allocation
    /// (the leader's `poll_timeout` walks them on every turn).
    fn target_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        let memberships = [&self.committed_state, &self.tip_state]
            .map(|s| s.membership.as_deref())
            .into_iter()
            .flatten();
        // Before any membership: the configured members.
        let none = self.committed_state.membership.is_none() && self.tip_state.membership.is_none();
        let configured = self.members.iter().copied().filter(move |_| none);
        memberships
            .flat_map(|m| m.members.keys().copied())
            .chain(self.just_removed.iter().copied())
            .chain(configured)
    }

    /// Whether `from` may send metadata messages: a member of the committed or the proposed
    /// membership, or, before either exists, a configured member (a removed node that is still
    /// in the files is not).
    fn is_known(&self, from: NodeId) -> bool {
        let memberships = [&self.committed_state, &self.tip_state].map(|s| s.membership.as_deref());
        if self.learned.contains(&from)
            && !memberships
                .iter()
                .flatten()
                .any(|m| m.removed.contains(&from))
        {
            return true;
        }
        if memberships.iter().all(Option::is_none) {
            return self.members.contains(&from);
        }
        memberships
            .iter()
            .flatten()
            .any(|m| m.members.contains_key(&from))
    }

    /// Accepts messages from `members` from now on: they are members of a newer committed
    /// membership than this node's, as a peer told (the node's ledger learns it from the
    /// leader, which may be one of them).
    pub fn learn_members(&mut self, members: impl IntoIterator<Item = NodeId>) {
        self.learned.extend(members);
        self.learned.remove(&self.self_id);
    }

    /// The voter sets whose majorities a commit or a leader sync needs: the committed voters
    /// (the configured members before any membership is committed), and the proposed voters
    /// too while a change is uncommitted. Not Raft's rule (the newest set alone, from its
    /// append): the elector counts a set from its commit on, and with the newest set alone the
    /// elector's model finds two leaders in one term ({1,2,3} -> {1,2} -> {1}: the second
    /// change committed by node 1 alone while node 2, not yet on {1,2}, was elected by 2 and 3
    /// under {1,2,3}). Empty with an explicit quorum setting.
    fn voter_sets(&self) -> Vec<BTreeSet<NodeId>> {
        if self.quorum_setting != 0 {
            return Vec::new();
        }
        let committed = self
            .committed_state
            .voters()
            .unwrap_or_else(|| self.members.clone());
        let mut sets = vec![committed];
        if let Some(tip) = self.tip_state.voters() {
            if tip != sets[0] {
                sets.push(tip);
            }
        }
        sets
    }

    /// The quorum in effect: a majority of the committed voters (of the configured members
    /// before a membership is committed), or the explicit setting.
    pub fn quorum(&self) -> usize {
        if self.quorum_setting == 0 {
            self.committed_state
                .voters()
                .map_or(self.members.len(), |v| v.len())
                / 2
                + 1
        } else {
            self.quorum_setting
        }
    }

    /// Whether the nodes in `held` include a quorum: a majority of every voter set of
    /// [`MetadataCore::voter_sets`], or `quorum_setting` of them.
    fn is_quorum<'a>(&self, held: impl Iterator<Item = &'a NodeId> + Clone) -> bool {
        if self.quorum_setting != 0 {
            return held.count() >= self.quorum_setting;
        }
        self.voter_sets()
            .iter()
            .all(|voters| held.clone().filter(|n| voters.contains(n)).count() > voters.len() / 2)
    }

    /// The membership the first leader seeds the cluster state with when the ledger holds none
    /// (the nodes' `[[members]]`, every one a voter at epoch 1). A ledger that holds a
    /// membership ignores it: after the first start the ledger wins.
    pub fn set_seed_membership(&mut self, membership: ClusterMembership) {
        self.seed_membership = Some(Arc::new(membership));
    }

    /// The domains a leader seeds the cluster state with when it holds none (the cluster's
    /// first start, or a ledger written before domains were cluster state). A state with
    /// domains ignores it: after the seed the ledger wins.
    pub fn set_seed_domains(&mut self, domains: Vec<DomainConfig>) {
        self.seed_domains = Some(Arc::new(domains));
    }

    /// The committed membership, if one is.
    pub fn membership(&self) -> Option<&Arc<ClusterMembership>> {
        self.committed_state.membership.as_ref()
    }

    /// The epochs of the committed and of the proposed (tip) membership, 0 where none is: when
    /// they change, so may [`MetadataCore::peers`].
    pub fn membership_epochs(&self) -> (u64, u64) {
        (
            self.committed_state.membership_epoch(),
            self.tip_state.membership_epoch(),
        )
    }

    /// The epoch of the committed membership (0 before one is committed).
    fn committed_epoch(&self) -> u64 {
        self.committed_state.membership_epoch()
    }

    /// Changes the quorum at runtime (`0` = majority). A quorum above the member count forbids
    /// commits (tests use that).
    pub fn set_quorum(&mut self, quorum: usize) {
        info!(quorum, "metadata quorum changed");
        self.quorum_setting = quorum;
        if let Some(now) = self.last_now {
            if self.role != MetadataRole::Follower {
                self.try_advance_sync(now);
                self.try_commit(now);
            }
        }
    }

    /// The committed state.
    pub fn state(&self) -> &ClusterState {
        &self.committed_state
    }

    /// The committed state with every held advisory applied, committed or not.
    pub fn tip_state(&self) -> &ClusterState {
        &self.tip_state
    }

    /// The counters of dropped input.
    pub fn counters(&self) -> &MetadataCounters {
        &self.counters
    }

    /// The current position.
    pub fn status(&self) -> MetadataStatus {
        MetadataStatus {
            role: self.role,
            term: self.term,
            leader: self.leader,
            last_lsn: self.last_lsn,
            committed_lsn: self.committed_lsn,
            uncommitted: self.pending.len(),
        }
    }

    /// The next output, if any.
    pub fn poll_output(&mut self) -> Option<MetadataOutput> {
        self.outputs.pop_front()
    }

    /// When to call [`MetadataCore::handle_timeout`] next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut deadline: Option<Instant> = None;
        let mut consider = |t: Instant| deadline = Some(deadline.map_or(t, |d| d.min(t)));
        if !self.assignment_requests.is_empty() {
            if let Some(t) = self.assignment_resend_at {
                consider(t);
            }
        }
        match self.role {
            MetadataRole::Follower => {
                if self.needs_hello() {
                    if let Some(t) = self.hello_deadline {
                        consider(t);
                    }
                }
            }
            MetadataRole::PassiveLeader | MetadataRole::ActiveLeader => {
                if let Some(sync) = &self.sync {
                    if !matches!(sync.phase, SyncPhase::Proposed { .. }) {
                        consider(sync.next_retry);
                    }
                }
                let lagging = self.least_matched();
                for p in self.pending.iter().filter(|p| p.lsn > lagging) {
                    if let Some(sent_at) = p.sent_at {
                        if p.lsn.term == self.term {
                            consider(sent_at + self.config.record_resend);
                        }
                    }
                }
                if let Some(at) = self.commit_refresh_due() {
                    consider(at);
                }
            }
        }
        deadline
    }

    /// The elector's view changed: `leader` leads `term` (`Some(self_id)`: this node does).
    pub fn handle_leadership(&mut self, now: Instant, term: Term, leader: Option<NodeId>) {
        self.last_now = Some(now);
        if term < self.term {
            self.counters.stale_leadership += 1;
            debug!(term = %term, current = %self.term, "stale leadership notification dropped");
            return;
        }
        if term == self.term && leader == self.leader {
            return;
        }
        if term > self.term {
            self.snapshot_seen = false;
            self.out_of_sync = false;
            self.gated.clear();
            self.resync = None;
        }
        let refollowing = term == self.term && self.leader.is_none() && leader.is_some();
        self.term = term;
        self.leader = leader;
        self.matched.clear();
        // A new leader (or the same one again) learns the epoch from our next ack.
        self.epoch_reported = 0;
        self.sync = None;
        self.commit_tail = None;
        if leader == Some(self.self_id) {
            self.role = MetadataRole::PassiveLeader;
            self.deferred_queries.retain(|(_, t, _)| *t > term);
            self.emit_role_changed();
            if self.last_lsn.term >= term {
                // We hold records of this term from another leader: two leaders in one term. The
                // elector prevents it; refuse to sync rather than fork the history.
                self.counters.stale_leadership += 1;
                error!(term = %term, last_lsn = %self.last_lsn, "elected for a term we already hold records of");
                return;
            }
            info!(term = %term, "metadata leader sync started");
            let mut responses = BTreeMap::new();
            responses.insert(self.self_id, self.last_advisory_lsn());
            self.sync = Some(LeaderSync {
                responses,
                phase: SyncPhase::Collecting,
                next_retry: now + self.config.sync_retry,
                continues: None,
                whole: None,
                wants_whole: BTreeSet::new(),
            });
            self.broadcast(Msg::SyncStateQuery(peer::LeaderSyncStateQuery {
                term: term.0,
            }));
            self.try_advance_sync(now);
        } else {
            self.role = MetadataRole::Follower;
            self.hello_deadline = leader.map(|_| self.first_hello_at(now));
            if refollowing && self.snapshot_seen {
                // We had lost the leader of this term (a cut-off link or a partition) and found
                // it again: records committed meanwhile may be missing, and no later record
                // need come to show us the gap. Ask with a hello, at once (a restarted node
                // is ready only once in step); a CatchUp that shows we are already in step
                // clears this without touching the ledger.
                self.out_of_sync = true;
                self.send_hello(now);
            }
            self.emit_role_changed();
            self.answer_deferred_queries();
            if leader.is_some() {
                self.dispatch_assignments(now);
            }
        }
    }

    /// A metadata message from peer `from`. A [`peer::MetadataBatch`] is handled as its
    /// messages in order (a batch inside a batch is dropped and counted).
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: peer::MetadataMessage) {
        self.last_now = Some(now);
        if from == self.self_id || !self.is_known(from) {
            self.counters.unknown_sender += 1;
            debug!(from = %from, "metadata message from a non-member dropped");
            return;
        }
        match message.kind {
            Some(Msg::Batch(batch)) => {
                for message in batch.messages {
                    match message.kind {
                        Some(Msg::Batch(_)) => self.counters.nested_batches += 1,
                        Some(kind) => self.handle_kind(now, from, kind),
                        None => self.counters.invalid += 1,
                    }
                }
            }
            Some(kind) => self.handle_kind(now, from, kind),
            None => self.counters.invalid += 1,
        }
    }

    fn handle_kind(&mut self, now: Instant, from: NodeId, kind: Msg) {
        match kind {
            Msg::Record(record) => self.on_record(now, from, record),
            Msg::Ack(ack) => self.on_ack(now, from, ack),
            Msg::Commit(commit) => self.on_commit(now, from, commit),
            Msg::NodeStatus(_) => {
                // Node status is the health actor's business; it is not ledgered.
                debug!(from = %from, "node status ignored by the metadata core");
            }
            Msg::SyncStateQuery(query) => {
                self.on_sync_query(from, Term(query.term), DeferredQuery::State)
            }
            Msg::SyncStateResponse(response) => self.on_sync_state_response(now, from, response),
            Msg::SyncDataQuery(query) => {
                let after = query.after.map(Lsn::from);
                self.on_sync_query(from, Term(query.term), DeferredQuery::Data { after })
            }
            Msg::SyncDataResponse(response) => self.on_sync_data_response(now, from, response),
            Msg::FollowerHello(hello) => {
                if self.role == MetadataRole::ActiveLeader && Term(hello.term) == self.term {
                    self.send_catch_up(from, hello.last_advisory_lsn.map(Lsn::from));
                } else if self.role == MetadataRole::PassiveLeader
                    && Term(hello.term) == self.term
                    && self.sync.as_ref().is_some_and(|s| {
                        matches!(s.phase, SyncPhase::Proposed { .. }) && s.continues.is_some()
                    })
                {
                    // A follower whose history is not the one the term start continues (it
                    // lost records in a crash after it answered the sync): it gets the whole
                    // state, as the term start, and counts towards the commit with it.
                    self.sync
                        .as_mut()
                        .expect("proposed")
                        .wants_whole
                        .insert(from);
                    self.send_term_start(from);
                } else {
                    self.counters.not_active += 1;
                    debug!(from = %from, term = hello.term, "follower hello dropped: not the active leader of that term");
                }
            }
            Msg::CatchUp(catch_up) => self.on_catch_up(now, from, catch_up),
            Msg::QueueAssignmentRequest(request) => {
                if self.role == MetadataRole::Follower {
                    // Only a leader takes requests from peers (a follower forwards its own), so
                    // a request never travels in a circle.
                    self.counters.not_active += 1;
                    debug!(from = %from, uri = %request.uri, "queue assignment request dropped: not the leader");
                } else {
                    self.ask_assignment(now, request.uri);
                }
            }
            Msg::LearnerProgress(progress) => {
                self.on_learner_progress(now, from, progress);
            }
            Msg::Batch(_) => self.counters.nested_batches += 1,
        }
    }

    /// A learner's report of its catch-up: kept while `from` is a learner of the committed
    /// membership (a report of an older epoch too: `/status` shows it, the promotion does not
    /// count it); the active leader may promote it now.
    fn on_learner_progress(&mut self, now: Instant, from: NodeId, p: peer::LearnerProgress) {
        let is_learner = self
            .committed_state
            .membership
            .as_ref()
            .is_some_and(|m| m.role(from) == Some(MemberRole::Learner));
        if !is_learner {
            self.learner_progress.remove(&from);
            debug!(from = %from, "learner progress of a node that is no learner dropped");
            return;
        }
        self.learner_progress.insert(
            from,
            LearnerProgress {
                membership_epoch: p.membership_epoch,
                partitions_following: p.partitions_following,
                partitions: p.partitions,
            },
        );
        self.promote_caught_up_learner(now);
    }

    /// The latest report of its catch-up of each learner of the committed membership that
    /// sent one, by node (see [`LearnerProgress`]).
    pub fn learner_progress(&self) -> Vec<(NodeId, LearnerProgress)> {
        let Some(membership) = self.committed_state.membership.as_ref() else {
            return Vec::new();
        };
        self.learner_progress
            .iter()
            .filter(|(id, _)| membership.role(**id) == Some(MemberRole::Learner))
            .map(|(id, p)| (*id, *p))
            .collect()
    }

    /// A leader sync query (step 1 or 2 of DESIGN.md §5) from `from` for `term`. Answered if
    /// this node follows `from` at `term`; kept (the latest per kind) if `term` is newer than
    /// ours or ours has no leader yet — the query often overtakes the elector's news of the
    /// new leader, and answering when that news comes saves the leader a `sync_retry`; else
    /// dropped.
    fn on_sync_query(&mut self, from: NodeId, term: Term, kind: DeferredQuery) {
        if self.follows(from, term) {
            self.answer_sync_query(from, term, kind);
            return;
        }
        let later = term > self.term
            || (term == self.term && self.leader.is_none() && self.role == MetadataRole::Follower);
        if later {
            self.counters.sync_queries_deferred += 1;
            debug!(from = %from, term = %term, ?kind, "sync query kept until the elector names its sender");
            let same =
                |k: &DeferredQuery| std::mem::discriminant(k) == std::mem::discriminant(&kind);
            self.deferred_queries.retain(|(_, _, k)| !same(k));
            self.deferred_queries.push((from, term, kind));
        } else {
            self.drop_not_following(from, term, "sync query");
        }
    }

    fn answer_sync_query(&mut self, from: NodeId, term: Term, kind: DeferredQuery) {
        let message = match kind {
            DeferredQuery::State => Msg::SyncStateResponse(peer::LeaderSyncStateResponse {
                term: term.0,
                last_lsn: Some(self.last_lsn.into()),
                committed_lsn: Some(self.committed_lsn.into()),
                last_advisory_lsn: Some(self.last_advisory_lsn().into()),
            }),
            DeferredQuery::Data { after } => {
                // The leader holds the advisory `after`: if this node holds it too, both hold
                // the same history up to it (one leader per term, gap-free terms), and the
                // advisories after it are all the leader lacks — O(them), not O(state).
                let (state, records) = match after.and_then(|a| self.records_after(a)) {
                    Some(records) => (None, records),
                    None => (Some(self.tip_state.to_snapshot()), Vec::new()),
                };
                Msg::SyncDataResponse(peer::LeaderSyncDataResponse {
                    term: term.0,
                    last_lsn: Some(self.last_advisory_lsn().into()),
                    state,
                    records,
                })
            }
        };
        self.send(from, message);
    }

    /// After a leadership change: answers the kept sync queries of the leader this node now
    /// follows, forgets those that can no longer be answered.
    fn answer_deferred_queries(&mut self) {
        let deferred = std::mem::take(&mut self.deferred_queries);
        for (from, term, kind) in deferred {
            if self.follows(from, term) {
                self.answer_sync_query(from, term, kind);
            } else if term > self.term {
                self.deferred_queries.push((from, term, kind));
            }
        }
    }

    /// Re-sends what has not been answered in time.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.last_now = Some(now);
        self.resend_assignment_requests(now);
        match self.role {
            MetadataRole::Follower => {
                if self.needs_hello() && self.hello_deadline.is_some_and(|d| d <= now) {
                    self.send_hello(now);
                }
            }
            MetadataRole::PassiveLeader | MetadataRole::ActiveLeader => {
                self.retry_sync(now);
                self.resend_records(now);
                self.refresh_commit(now);
            }
        }
    }

    /// Proposes an advisory (active leader only). Returns its LSN; [`MetadataOutput::Committed`]
    /// follows once a quorum holds it.
    ///
    /// # Errors
    /// `NotLeader`, `NotActive`, `Overloaded`, or `Invalid` when it does not apply to the state
    /// as it will be after the pending advisories.
    pub fn propose(
        &mut self,
        now: Instant,
        mut advisory: peer::Advisory,
    ) -> Result<Lsn, ProposeError> {
        self.last_now = Some(now);
        match self.role {
            MetadataRole::Follower => {
                return Err(ProposeError::NotLeader {
                    leader: self.leader,
                })
            }
            MetadataRole::PassiveLeader => return Err(ProposeError::NotActive),
            MetadataRole::ActiveLeader => {}
        }
        if self.pending.len() >= self.config.uncommitted_max {
            return Err(ProposeError::Overloaded {
                uncommitted: self.pending.len(),
            });
        }
        if matches!(advisory.kind, Some(peer::advisory::Kind::Membership(_))) {
            self.check_membership_change()?;
        }
        if let Some(peer::advisory::Kind::Domain(domain)) = advisory.kind.as_mut() {
            // A domain change carries the LSN it is stamped with: every node versions the
            // domain with it as it applies the change.
            domain.lsn = Some(self.next_lsn().into());
        }
        // All or nothing: on error the tip state is unchanged.
        self.tip_state.apply(&advisory)?;
        Ok(self.append_own(now, advisory))
    }

    /// The rules a membership change must pass before it is proposed: none uncommitted, and
    /// the committed one applied by a majority of its voters. (The third rule, a committed
    /// entry of the leader's own term first, holds because only an active leader proposes:
    /// its term's `LeaderAdvisory` is committed.)
    fn check_membership_change(&self) -> Result<(), ProposeError> {
        let tip_epoch = self.tip_state.membership_epoch();
        let epoch = self.committed_epoch();
        if tip_epoch != epoch {
            return Err(ProposeError::MembershipChangeInFlight {
                pending_epoch: tip_epoch,
            });
        }
        let Some(voters) = self.committed_state.voters() else {
            // Nothing seeded yet: `ClusterState::apply` refuses the change (NotSeeded).
            return Ok(());
        };
        let applied = voters
            .iter()
            .filter(|v| self.applied_epoch.get(v).is_some_and(|e| *e >= epoch))
            .count();
        if applied <= voters.len() / 2 {
            return Err(ProposeError::MembershipNotApplied {
                epoch,
                applied,
                voters: voters.len(),
            });
        }
        if let Some((partition, reason)) = self.committed_state.partition_lagging_membership() {
            return Err(ProposeError::PartitionsNotFollowing {
                epoch,
                partition,
                reason,
            });
        }
        Ok(())
    }

    /// Asks for `uri` to be assigned to a partition (a client opened a queue on this node).
    ///
    /// Unless the queue is already assigned (or being assigned) in the tip state, the request
    /// is kept until this node sees the assignment committed, at most
    /// [`MetadataConfig::assignment_request_ttl`], and sent where it can be served: the active
    /// leader proposes a `QueueAssignmentAdvisory` (partition from
    /// [`pick_partition_for_queue`], key `next_queue_key`); a follower forwards it to its
    /// leader. A passive leader, or a follower without a leader, only keeps it; kept requests
    /// go out again when the node becomes the active leader or learns a (new) leader, so an
    /// open issued during a failover waits for the new leader, not for the caller's next retry;
    /// and every [`MetadataConfig::assignment_request_resend`] while any is kept (a forwarded
    /// request may be lost). The caller asks once and waits for the commit.
    pub fn request_queue_assignment(&mut self, now: Instant, uri: &str) {
        self.last_now = Some(now);
        self.ask_assignment(now, uri.to_owned());
    }

    fn ask_assignment(&mut self, now: Instant, uri: String) {
        if self.tip_state.queues.contains_key(&uri) {
            return;
        }
        if !self.assignment_requests.contains_key(&uri)
            && self.assignment_requests.len() >= self.config.assignment_requests_max
        {
            self.expire_assignment_requests(now);
            if self.assignment_requests.len() >= self.config.assignment_requests_max {
                self.counters.assignment_requests_dropped += 1;
                debug!(uri, "queue assignment request dropped: too many kept");
                return;
            }
        }
        if self.assignment_requests.is_empty() {
            // The first kept request: a deadline left by earlier ones, settled since, is stale.
            self.assignment_resend_at = Some(now + self.config.assignment_request_resend);
        }
        self.assignment_requests.insert(uri.clone(), now);
        self.dispatch_assignment(now, &uri);
    }

    /// Sends every kept request again once [`MetadataConfig::assignment_request_resend`] has
    /// passed since the last time (see `request_queue_assignment`).
    fn resend_assignment_requests(&mut self, now: Instant) {
        if !self.assignment_requests.is_empty()
            && self.assignment_resend_at.is_some_and(|at| at <= now)
        {
            self.counters.assignment_resends += 1;
            self.dispatch_assignments(now);
            self.assignment_resend_at = (!self.assignment_requests.is_empty())
                .then(|| now + self.config.assignment_request_resend);
        }
    }

    /// Sends one kept request where it can be served now (see `request_queue_assignment`).
    fn dispatch_assignment(&mut self, now: Instant, uri: &str) {
        match self.role {
            MetadataRole::ActiveLeader => {
                if self.tip_state.queues.contains_key(uri) {
                    return;
                }
                if !self.tip_state.has_domain_of(uri) {
                    // A queue of a domain that does not exist (deleted meanwhile: a session
                    // checked it when it opened) is never assigned.
                    debug!(uri, "queue assignment refused: unknown domain");
                    self.assignment_requests.remove(uri);
                    return;
                }
                let Some(partition) = pick_partition_for_queue(&self.tip_state) else {
                    debug!(uri, "no partition has a primary; queue assignment deferred");
                    return;
                };
                let advisory = peer::Advisory {
                    kind: Some(peer::advisory::Kind::QueueAssignment(
                        peer::QueueAssignmentAdvisory {
                            queues: vec![peer::QueueInfo {
                                uri: uri.to_owned(),
                                partition_id: partition.0,
                                queue_key: self.tip_state.next_queue_key,
                            }],
                        },
                    )),
                };
                if let Err(error) = self.propose(now, advisory) {
                    debug!(uri, error = %error, "queue assignment not proposed");
                }
            }
            MetadataRole::Follower => {
                if let Some(leader) = self.leader {
                    self.send(
                        leader,
                        Msg::QueueAssignmentRequest(peer::QueueAssignmentRequest {
                            uri: uri.to_owned(),
                        }),
                    );
                }
            }
            MetadataRole::PassiveLeader => {}
        }
    }

    /// Sends every kept request again (the node became the active leader or found a leader),
    /// forgetting expired ones. O(kept requests), once per leadership change.
    fn dispatch_assignments(&mut self, now: Instant) {
        self.expire_assignment_requests(now);
        let uris: Vec<String> = self.assignment_requests.keys().cloned().collect();
        for uri in uris {
            self.dispatch_assignment(now, &uri);
        }
    }

    fn expire_assignment_requests(&mut self, now: Instant) {
        let ttl = self.config.assignment_request_ttl;
        self.assignment_requests
            .retain(|_, asked| now.saturating_duration_since(*asked) < ttl);
    }

    /// The committed state was replaced wholesale: forget kept requests it settles.
    fn settle_assignment_requests(&mut self) {
        let state = &self.committed_state;
        self.assignment_requests
            .retain(|uri, _| !state.queues.contains_key(uri));
    }

    /// The record with `lsn`, and every one before it, is durable.
    pub fn on_persisted(&mut self, now: Instant, lsn: Lsn) {
        self.last_now = Some(now);
        if lsn > self.persisted_lsn {
            self.persisted_lsn = lsn;
        }
        match self.role {
            MetadataRole::Follower => {
                let Some(leader) = self.leader else { return };
                // One ack for everything that became durable: the follower's log of the term
                // is gap-free, so the highest durable record of the term stands for every one
                // before it (the leader counts acks as a high-water mark, as Raft's
                // matchIndex). O(log pending).
                let durable = self
                    .pending
                    .partition_point(|p| p.lsn <= self.persisted_lsn);
                let Some(highest) = durable.checked_sub(1).map(|i| self.pending[i].lsn) else {
                    self.report_epoch();
                    return;
                };
                if highest.term == self.term && highest > self.ack_sent {
                    self.ack_sent = highest;
                    self.send_ack(leader, highest);
                }
                self.report_epoch();
            }
            MetadataRole::PassiveLeader | MetadataRole::ActiveLeader => {
                self.matched.insert(self.self_id, self.persisted_lsn);
                self.applied_epoch
                    .insert(self.self_id, self.committed_epoch());
                self.try_commit(now);
            }
        }
    }

    // ---------------------------------------------------------------- follower

    fn follows(&self, from: NodeId, term: Term) -> bool {
        self.role == MetadataRole::Follower && self.leader == Some(from) && self.term == term
    }

    fn drop_not_following(&mut self, from: NodeId, term: Term, what: &str) {
        if term < self.term {
            self.counters.stale_term += 1;
        } else {
            self.counters.wrong_leader += 1;
        }
        debug!(from = %from, term = %term, current = %self.term, leader = ?self.leader, what, "dropped: not following the sender at that term");
    }

    /// Common checks for a record or commit from `from` stamped `lsn`. `false`: dropped.
    fn accept_from_leader(&mut self, from: NodeId, lsn: Lsn, what: &str) -> bool {
        if self.role != MetadataRole::Follower || self.leader != Some(from) {
            self.counters.wrong_leader += 1;
            debug!(from = %from, lsn = %lsn, leader = ?self.leader, what, "dropped: not from the leader we follow");
            return false;
        }
        if lsn.term < self.term {
            self.counters.stale_term += 1;
            debug!(from = %from, lsn = %lsn, term = %self.term, what, "dropped: stale term");
            return false;
        }
        if lsn.term > self.term {
            self.counters.future_term += 1;
            debug!(from = %from, lsn = %lsn, term = %self.term, what, "dropped: term not announced by the elector yet");
            return false;
        }
        true
    }

    fn on_record(&mut self, now: Instant, from: NodeId, record: peer::AdvisoryRecord) {
        let lsn = lsn_of(record.lsn);
        if !self.accept_from_leader(from, lsn, "record") {
            return;
        }
        let Some(advisory) = record.advisory else {
            self.counters.invalid += 1;
            return;
        };
        if lsn <= self.last_lsn {
            self.counters.duplicate += 1;
            debug!(lsn = %lsn, last_lsn = %self.last_lsn, "duplicate record");
            // The ack may have been lost: re-ack what is durable.
            // Within the term our log is gap-free, so a durable LSN of it is held.
            if self.snapshot_seen && lsn <= self.persisted_lsn {
                self.send_ack(from, lsn);
            }
            return;
        }
        if !self.snapshot_seen {
            if lsn.sequence == 1 {
                if self.accept_record(now, lsn, advisory) {
                    self.snapshot_seen = true;
                    self.drain_gated(now);
                }
            } else {
                self.gate(now, lsn.sequence, Gated::Record(lsn, advisory));
            }
            return;
        }
        if lsn.sequence != self.last_lsn.sequence + 1 {
            self.on_gap(now, lsn);
            return;
        }
        self.accept_record(now, lsn, advisory);
    }

    fn on_commit(&mut self, now: Instant, from: NodeId, commit: peer::AdvisoryCommit) {
        let lsn = lsn_of(commit.lsn);
        let committed = lsn_of(commit.committed);
        if !self.accept_from_leader(from, lsn, "commit") {
            return;
        }
        if self.resync == Some(committed) && self.snapshot_seen && lsn > self.last_lsn {
            // The leader's latest commit record, sent right after a CatchUp so that our next
            // expected sequence matches the leader's (commit records take sequences too).
            self.resync = None;
            self.accept_commit(lsn, committed);
            return;
        }
        if lsn == self.last_lsn && self.snapshot_seen {
            // The leader's periodic refresh of its latest commit: we are in step. Once a
            // membership exists, say again which one this node applied: an ack with the epoch
            // lost on the way would otherwise hold the next change back until the next record.
            if self.committed_epoch() > 0
                && self.ack_sent.term == self.term
                && self.ack_sent > Lsn::ZERO
            {
                self.send_ack(from, self.ack_sent);
            }
            return;
        }
        if lsn <= self.last_lsn {
            self.counters.duplicate += 1;
            debug!(lsn = %lsn, last_lsn = %self.last_lsn, "duplicate commit");
            return;
        }
        if !self.snapshot_seen {
            self.gate(now, lsn.sequence, Gated::Commit(lsn, committed));
            return;
        }
        if lsn.sequence != self.last_lsn.sequence + 1 {
            self.on_gap(now, lsn);
            return;
        }
        self.accept_commit(lsn, committed);
    }

    /// Accepts the next record in sequence. `false` if it is invalid (dropped).
    fn accept_record(&mut self, now: Instant, lsn: Lsn, advisory: peer::Advisory) -> bool {
        let leader_advisory = is_leader_advisory(&advisory);
        if (lsn.sequence == 1) != leader_advisory {
            // A term starts with its snapshot and has only one.
            self.counters.invalid += 1;
            debug!(lsn = %lsn, "dropped: a term's first record must be its LeaderAdvisory, and only it");
            return false;
        }
        let continues = crate::ledger::leader_continues(&advisory).flatten();
        if let Some(continues) = continues {
            let own = self.last_advisory_lsn();
            if continues != own {
                // The term continues a history that is not ours: ask the leader for the whole
                // state (it answers a hello with the term start carrying the snapshot, or a
                // CatchUp once active).
                self.counters.continuation_mismatches += 1;
                info!(lsn = %lsn, continues = %continues, last_advisory = %own, "term start continues another history; asking the leader for the whole state");
                self.out_of_sync = true;
                self.send_hello(now);
                return false;
            }
        }
        // `apply` is all or nothing: on error the tip state is unchanged.
        match self.tip_state.apply(&advisory) {
            Ok(()) => {}
            Err(error) if leader_advisory => {
                self.counters.invalid += 1;
                debug!(lsn = %lsn, error = %error, "dropped: invalid LeaderAdvisory");
                return false;
            }
            Err(error) => {
                // The leader validated it against the same history; only a bug gets here.
                self.counters.apply_failures += 1;
                error!(lsn = %lsn, error = %error, "replicated advisory does not apply to the tip state");
            }
        }
        if leader_advisory && continues.is_none() {
            // The new term's snapshot supersedes every older uncommitted advisory (a term
            // start that continues our history keeps them: its commit commits them).
            self.pending.retain(|p| p.lsn.term >= lsn.term);
        }
        self.advance_last(lsn);
        self.resync = None;
        self.pending.push_back(Pending {
            lsn,
            advisory: advisory.clone(),
            sent_at: None,
        });
        self.persist_update(lsn, advisory);
        true
    }

    fn accept_commit(&mut self, lsn: Lsn, committed: Lsn) {
        if committed > self.last_lsn || committed >= lsn {
            self.counters.invalid += 1;
            debug!(lsn = %lsn, committed = %committed, last_lsn = %self.last_lsn, "dropped: commit names a record we do not hold");
            return;
        }
        self.advance_last(lsn);
        self.outputs.push_back(MetadataOutput::Persist {
            record: LedgerRecord::Commit { lsn, committed },
        });
        if committed > self.committed_lsn {
            self.apply_committed(committed);
        }
    }

    fn gate(&mut self, now: Instant, sequence: u64, gated: Gated) {
        if self.gated.len() >= self.config.gated_max && !self.gated.contains_key(&sequence) {
            self.counters.gated_overflow += 1;
        } else {
            self.counters.gated += 1;
            self.gated.insert(sequence, gated);
        }
        if self.hello_deadline.is_none() {
            self.hello_deadline = Some(self.first_hello_at(now));
        }
    }

    /// When a follower without the term's snapshot first says hello: after
    /// [`MetadataConfig::hello_retry`] (the snapshot may still be on its way), or at once for a
    /// node joining the cluster — no ledger yet and the members learned from a peer — whose
    /// term began before it was a member: the snapshot never comes to it.
    fn first_hello_at(&self, now: Instant) -> Instant {
        let joining = self.committed_state.membership.is_none() && !self.learned.is_empty();
        if joining {
            now
        } else {
            now + self.config.hello_retry
        }
    }

    fn drain_gated(&mut self, now: Instant) {
        let gated = std::mem::take(&mut self.gated);
        for (sequence, item) in gated {
            if sequence <= self.last_lsn.sequence {
                continue;
            }
            if sequence != self.last_lsn.sequence + 1 {
                self.on_gap(now, Lsn::new(self.term, sequence));
                return;
            }
            match item {
                Gated::Record(lsn, advisory) => {
                    self.accept_record(now, lsn, advisory);
                }
                Gated::Commit(lsn, committed) => self.accept_commit(lsn, committed),
            }
        }
    }

    fn on_gap(&mut self, now: Instant, lsn: Lsn) {
        self.counters.gap += 1;
        debug!(lsn = %lsn, last_lsn = %self.last_lsn, "gap in the leader's records");
        self.out_of_sync = true;
        let recently = self
            .last_hello
            .is_some_and(|t| now < t + self.config.hello_retry);
        if !recently {
            self.send_hello(now);
        }
    }

    fn needs_hello(&self) -> bool {
        self.role == MetadataRole::Follower
            && self.leader.is_some()
            && (!self.snapshot_seen || self.out_of_sync)
    }

    fn send_hello(&mut self, now: Instant) {
        let Some(leader) = self.leader else { return };
        self.counters.hellos_sent += 1;
        self.last_hello = Some(now);
        self.hello_deadline = Some(now + self.config.hello_retry);
        let hello = peer::FollowerHello {
            term: self.term.0,
            last_lsn: Some(self.last_lsn.into()),
            last_advisory_lsn: (!self.wants_whole_catch_up)
                .then(|| self.last_advisory_lsn().into()),
        };
        self.send(leader, Msg::FollowerHello(hello));
    }

    fn on_catch_up(&mut self, now: Instant, from: NodeId, catch_up: peer::CatchUp) {
        let term = Term(catch_up.term);
        if !self.follows(from, term) {
            self.drop_not_following(from, term, "catch up");
            return;
        }
        let committed = lsn_of(catch_up.committed);
        if committed.term != term || committed < self.committed_lsn {
            self.counters.stale_term += 1;
            debug!(committed = %committed, own = %self.committed_lsn, "dropped: stale catch up");
            return;
        }
        if catch_up.state.is_none() {
            self.take_catch_up_records(now, committed, catch_up);
            return;
        }
        self.wants_whole_catch_up = false;
        let Some(state) = catch_up
            .state
            .as_ref()
            .and_then(|s| ClusterState::from_snapshot(s).ok())
        else {
            self.counters.invalid += 1;
            debug!("dropped: catch up with an invalid snapshot");
            return;
        };
        let mut uncommitted = Vec::with_capacity(catch_up.uncommitted.len());
        let mut tip = state.clone();
        let mut previous = committed;
        for record in catch_up.uncommitted {
            let lsn = lsn_of(record.lsn);
            let Some(advisory) = record.advisory else {
                self.counters.invalid += 1;
                return;
            };
            if lsn <= previous || lsn.term != term {
                self.counters.invalid += 1;
                debug!(lsn = %lsn, "dropped: catch up records out of order");
                return;
            }
            if let Err(error) = tip.apply(&advisory) {
                self.counters.apply_failures += 1;
                error!(lsn = %lsn, error = %error, "caught-up advisory does not apply to the tip state");
            }
            previous = lsn;
            uncommitted.push((lsn, advisory));
        }
        if committed == self.committed_lsn && previous <= self.last_lsn {
            // Nothing new: we already hold the leader's committed state and every record it
            // sent (a hello after finding the leader again). Keep the ledger as it is; the
            // leader's latest commit record, which follows, fills a tail of lost commits.
            self.out_of_sync = false;
            self.resync = Some(committed);
            debug!(committed = %committed, last_lsn = %self.last_lsn, "catch up: already in step");
            return;
        }
        if previous < self.last_lsn && self.last_lsn.term == term && committed <= self.last_lsn {
            // We hold more than the CatchUp lists: commit records after the leader's last
            // advisory (a CatchUp lists advisories, not commits). Our log of this term is a
            // gap-free prefix of the leader's, so we hold every record up to `committed`:
            // commit them and keep our log; the leader's latest commit record, which follows,
            // brings our next sequence in step. Dropping this CatchUp instead would leave us
            // out of sync for good once the leader goes quiet.
            self.apply_committed(committed);
            self.out_of_sync = false;
            self.gated.clear();
            self.resync = Some(committed);
            debug!(committed = %committed, last_lsn = %self.last_lsn, "catch up: committed from our own log");
            return;
        }
        if previous < self.last_lsn {
            // Our history would go backwards: the CatchUp predates records we already took.
            self.counters.stale_term += 1;
            debug!(last = %previous, own = %self.last_lsn, "dropped: catch up behind our last record");
            return;
        }
        info!(committed = %committed, last_lsn = %previous, uncommitted = uncommitted.len(), "caught up with the leader");
        self.advance_last(previous);
        self.committed_state = state.clone();
        self.committed_lsn = committed;
        // The history jumped: no record links what this node retained to the new state.
        self.recent.clear();
        self.recent_base = committed;
        self.tip_state = tip;
        self.pending = uncommitted
            .iter()
            .map(|(lsn, advisory)| Pending {
                lsn: *lsn,
                advisory: advisory.clone(),
                sent_at: None,
            })
            .collect();
        // The new history is durable only once the ledger is reset; acks wait for on_persisted.
        self.persisted_lsn = committed;
        self.ack_sent = committed;
        self.settle_assignment_requests();
        self.snapshot_seen = true;
        self.out_of_sync = false;
        self.gated.clear();
        self.resync = Some(committed);
        self.outputs.push_back(MetadataOutput::ResetLedger {
            state,
            committed_lsn: committed,
            uncommitted,
        });
    }

    /// A CatchUp without the state: taken if it continues this node's history (its last
    /// advisory is `continues`, so its history up to it is the leader's), the advisories
    /// after it appended as records in order, then committed up to `committed`. Anything
    /// else is refused, counted, and the next hello asks for the whole state.
    fn take_catch_up_records(&mut self, now: Instant, committed: Lsn, catch_up: peer::CatchUp) {
        let continues = catch_up.continues.map(Lsn::from);
        let own = self.last_advisory_lsn();
        let mut records = Vec::with_capacity(catch_up.uncommitted.len());
        let mut previous = self.last_lsn;
        let mut fits = continues == Some(own);
        for record in catch_up.uncommitted {
            let lsn = lsn_of(record.lsn);
            match record.advisory {
                Some(advisory) if fits && lsn > previous => {
                    previous = lsn;
                    records.push((lsn, advisory));
                }
                _ => fits = false,
            }
        }
        let last_advisory = records.last().map_or(own, |(l, _)| *l);
        if !fits || committed > last_advisory {
            self.counters.catch_ups_refused += 1;
            self.wants_whole_catch_up = true;
            info!(continues = ?continues, last_advisory = %own, committed = %committed, "catch up without the state does not continue our history; asking for the whole state");
            return;
        }
        debug!(continues = %own, records = records.len(), committed = %committed, "caught up from the records after our last advisory");
        for (lsn, advisory) in records {
            if let Err(error) = self.tip_state.apply(&advisory) {
                self.counters.apply_failures += 1;
                error!(lsn = %lsn, error = %error, "caught-up advisory does not apply to the tip state");
            }
            self.hold_uncommitted(lsn, advisory);
        }
        if committed > self.committed_lsn {
            self.apply_committed(committed);
        }
        self.settle_assignment_requests();
        self.snapshot_seen = true;
        self.out_of_sync = false;
        self.wants_whole_catch_up = false;
        self.resync = Some(committed);
        // The gated records, if any, follow what was just taken.
        self.drain_gated(now);
    }

    // ---------------------------------------------------------------- leader

    fn on_ack(&mut self, now: Instant, from: NodeId, ack: peer::AdvisoryAck) {
        let lsn = lsn_of(ack.lsn);
        if self.role == MetadataRole::Follower {
            self.counters.not_active += 1;
            return;
        }
        if lsn.term != self.term {
            self.counters.stale_term += 1;
            debug!(from = %from, lsn = %lsn, "stale ack dropped");
            return;
        }
        if lsn > self.last_lsn {
            self.counters.invalid += 1;
            return;
        }
        let entry = self.matched.entry(from).or_insert(Lsn::ZERO);
        if lsn > *entry {
            *entry = lsn;
        }
        let epoch = self.applied_epoch.entry(from).or_insert(0);
        *epoch = (*epoch).max(ack.membership_epoch);
        self.try_commit(now);
        self.promote_caught_up_learner(now);
        self.remove_leaving_member(now);
    }

    /// On the active leader, with no change in flight: proposes the promotion of the first
    /// learner (by id) that has applied the committed membership and (with
    /// [`MetadataConfig::promote_after_journals`]) reported every partition's journal followed,
    /// if the voters stay within [`crate::MAX_VOTERS`] (see
    /// [`MetadataConfig::promote_learners`]).
    fn promote_caught_up_learner(&mut self, now: Instant) {
        if !self.config.promote_learners || self.role != MetadataRole::ActiveLeader {
            return;
        }
        let Some(membership) = self.committed_state.membership.clone() else {
            return;
        };
        if membership.voters().len() >= crate::membership::MAX_VOTERS
            || self.check_membership_change().is_err()
            || self.pending.len() >= self.config.uncommitted_max
        {
            return;
        }
        let journals_followed = |id: &NodeId| {
            !self.config.promote_after_journals
                || self.learner_progress.get(id).is_some_and(|p| {
                    p.membership_epoch >= membership.epoch && p.journals_caught_up()
                })
        };
        let Some(learner) = membership.members.values().find(|m| {
            m.role == MemberRole::Learner
                && self
                    .applied_epoch
                    .get(&m.id)
                    .is_some_and(|e| *e >= membership.epoch)
                && journals_followed(&m.id)
        }) else {
            return;
        };
        let id = learner.id;
        let mut next = (*membership).clone();
        next.epoch += 1;
        if let Some(m) = next.members.get_mut(&id) {
            m.role = MemberRole::Voter;
        }
        let advisory = next.to_advisory();
        match self.tip_state.apply(&advisory) {
            Ok(()) => {
                self.counters.learners_promoted += 1;
                info!(node = %id, epoch = next.epoch, "learner caught up: promoting it to voter");
                self.append_own(now, advisory);
            }
            Err(error) => error!(node = %id, %error, "learner promotion does not apply"),
        }
    }

    /// On the active leader, with no change in flight: proposes the removal of the first
    /// leaving member (by id) that is primary of no partition any more (its primaries moved,
    /// DESIGN.md §5a), unless it is this node. The second half of a voter's removal is the
    /// leader's, not the request's that marked it leaving: a request lost with a failed leader
    /// would leave the member leaving for ever, so the next leader finishes the change. Runs
    /// with [`MetadataConfig::promote_learners`] (the leader completes changes on its own).
    fn remove_leaving_member(&mut self, now: Instant) {
        if !self.config.promote_learners || self.role != MetadataRole::ActiveLeader {
            return;
        }
        let Some(membership) = self.committed_state.membership.clone() else {
            return;
        };
        if self.check_membership_change().is_err()
            || self.pending.len() >= self.config.uncommitted_max
        {
            return;
        }
        let holds_primary = |id: NodeId| {
            self.committed_state
                .partitions
                .values()
                .any(|p| p.primary == Some(id))
        };
        let Some(id) = membership
            .members
            .values()
            .find(|m| m.role == MemberRole::Leaving && m.id != self.self_id && !holds_primary(m.id))
            .map(|m| m.id)
        else {
            return;
        };
        let mut next = (*membership).clone();
        next.epoch += 1;
        next.members.remove(&id);
        next.removed.insert(id);
        let advisory = next.to_advisory();
        match self.tip_state.apply(&advisory) {
            Ok(()) => {
                self.counters.leaving_removed += 1;
                info!(node = %id, epoch = next.epoch, "leaving member holds no primary: removing it");
                self.append_own(now, advisory);
            }
            Err(error) => error!(node = %id, %error, "removal of a leaving member does not apply"),
        }
    }

    fn on_sync_state_response(
        &mut self,
        now: Instant,
        from: NodeId,
        response: peer::LeaderSyncStateResponse,
    ) {
        let collecting = self.role == MetadataRole::PassiveLeader
            && Term(response.term) == self.term
            && self
                .sync
                .as_ref()
                .is_some_and(|s| s.phase == SyncPhase::Collecting);
        if !collecting {
            self.counters.not_active += 1;
            debug!(from = %from, term = response.term, "sync state response dropped");
            return;
        }
        // What the sync compares is the last advisory: commit records carry no state, and a
        // node that lacks only the latest commit record holds the same history.
        let last = lsn_of(response.last_advisory_lsn.or(response.last_lsn));
        self.sync
            .as_mut()
            .expect("collecting")
            .responses
            .insert(from, last);
        self.try_advance_sync(now);
    }

    fn on_sync_data_response(
        &mut self,
        now: Instant,
        from: NodeId,
        response: peer::LeaderSyncDataResponse,
    ) {
        let fetching = self.role == MetadataRole::PassiveLeader
            && Term(response.term) == self.term
            && self.sync.as_ref().is_some_and(
                |s| matches!(s.phase, SyncPhase::Fetching { from: f, .. } if f == from),
            );
        if !fetching {
            self.counters.not_active += 1;
            debug!(from = %from, term = response.term, "sync data response dropped");
            return;
        }
        let announced = self
            .sync
            .as_ref()
            .and_then(|s| s.responses.get(&from).copied())
            .unwrap_or(Lsn::ZERO);
        let last = lsn_of(response.last_lsn);
        if last < announced {
            // The node announced records it no longer holds (written but not yet synced when it
            // answered, then lost in a crash): its state may lack a committed advisory that the
            // node it outranked holds. Ask everyone again; its new answer is what it holds.
            self.counters.sync_data_behind += 1;
            info!(from = %from, announced = %announced, last_lsn = %last, "sync data response behind its announced LSN; collecting again");
            let sync = self.sync.as_mut().expect("fetching");
            sync.responses.remove(&from);
            sync.phase = SyncPhase::Collecting;
            sync.next_retry = now + self.config.sync_retry;
            self.send(
                from,
                Msg::SyncStateQuery(peer::LeaderSyncStateQuery { term: self.term.0 }),
            );
            return;
        }
        if response.state.is_none() {
            self.adopt_records(now, from, last, response.records);
            return;
        }
        let Some(state) = response
            .state
            .as_ref()
            .and_then(|s| ClusterState::from_snapshot(s).ok())
        else {
            self.counters.invalid += 1;
            debug!(from = %from, "sync data response with an invalid snapshot dropped");
            return;
        };
        info!(from = %from, last_lsn = %last, "leader sync adopted the most advanced state");
        self.propose_leader_advisory(now, state);
    }

    /// Leader sync's fetch answered with the advisories that follow this node's last one on
    /// the most advanced node: they are appended to this node's history (ledger and tip state,
    /// uncommitted, at their own LSNs), and the term starts as the continuation of it. Records
    /// out of order, not after this node's last record, or that do not apply are dropped and
    /// counted (the sync retries).
    fn adopt_records(
        &mut self,
        now: Instant,
        from: NodeId,
        last: Lsn,
        records: Vec<peer::AdvisoryRecord>,
    ) {
        let mut tip = self.tip_state.clone();
        let mut previous = self.last_lsn;
        let mut adopted = Vec::with_capacity(records.len());
        for record in records {
            let lsn = lsn_of(record.lsn);
            let valid = lsn > previous && lsn.term < self.term;
            let Some(advisory) = record.advisory.filter(|_| valid) else {
                self.counters.invalid += 1;
                debug!(from = %from, lsn = %lsn, "sync data records out of order dropped");
                return;
            };
            if let Err(error) = tip.apply(&advisory) {
                self.counters.invalid += 1;
                debug!(from = %from, lsn = %lsn, %error, "sync data record does not apply; dropped");
                return;
            }
            previous = lsn;
            adopted.push((lsn, advisory));
        }
        if adopted.last().map_or(self.last_advisory_lsn(), |(l, _)| *l) != last {
            self.counters.invalid += 1;
            debug!(from = %from, last_lsn = %last, "sync data records do not end at the announced LSN; dropped");
            return;
        }
        info!(from = %from, last_lsn = %last, records = adopted.len(), "leader sync adopted the most advanced node's advisories");
        self.tip_state = tip;
        for (lsn, advisory) in adopted {
            self.hold_uncommitted(lsn, advisory);
        }
        // The responses said which followers hold what: the most advanced one's history is
        // now ours.
        self.propose_continuation(now);
    }

    /// Moves leader sync forward once enough is known.
    fn try_advance_sync(&mut self, now: Instant) {
        let self_id = self.self_id;
        let enough = self.sync.as_ref().is_some_and(|s| {
            s.phase == SyncPhase::Collecting && self.is_quorum(s.responses.keys())
        });
        let Some(sync) = self.sync.as_mut() else {
            return;
        };
        if !enough {
            return;
        }
        // The highest last LSN; ties prefer self (no fetch), then the lowest id.
        let (&best, &best_lsn) = sync
            .responses
            .iter()
            .max_by(|a, b| {
                a.1.cmp(b.1)
                    .then((*a.0 == self_id).cmp(&(*b.0 == self_id)))
                    .then(b.0.cmp(a.0))
            })
            .expect("quorum >= 1 responses");
        info!(term = %self.term, best = %best, best_lsn = %best_lsn, responses = sync.responses.len(), "leader sync quorum reached");
        if best == self_id {
            self.propose_continuation(now);
        } else {
            sync.phase = SyncPhase::Fetching {
                from: best,
                attempts: 1,
            };
            sync.next_retry = now + self.config.sync_retry;
            let query = peer::LeaderSyncDataQuery {
                term: self.term.0,
                after: Some(self.last_advisory_lsn().into()),
            };
            self.send(best, Msg::SyncDataQuery(query));
        }
    }

    fn retry_sync(&mut self, now: Instant) {
        let Some(sync) = self.sync.as_mut() else {
            return;
        };
        if sync.next_retry > now {
            return;
        }
        sync.next_retry = now + self.config.sync_retry;
        match sync.phase.clone() {
            SyncPhase::Collecting => {}
            SyncPhase::Fetching { from, attempts }
                if attempts < self.config.sync_data_attempts_max =>
            {
                sync.phase = SyncPhase::Fetching {
                    from,
                    attempts: attempts + 1,
                };
                let query = peer::LeaderSyncDataQuery {
                    term: self.term.0,
                    after: Some(self.last_advisory_lsn().into()),
                };
                self.send(from, Msg::SyncDataQuery(query));
                return;
            }
            SyncPhase::Fetching { from, .. } => {
                // The most advanced node stopped answering: any other quorum of answers is as good.
                info!(from = %from, "most advanced node did not send its state; collecting again without it");
                sync.responses.remove(&from);
                sync.phase = SyncPhase::Collecting;
            }
            SyncPhase::Proposed { .. } => return,
        }
        let missing: Vec<NodeId> = self
            .targets()
            .iter()
            .filter(|m| {
                !self
                    .sync
                    .as_ref()
                    .expect("syncing")
                    .responses
                    .contains_key(m)
            })
            .copied()
            .collect();
        for to in missing {
            self.send(
                to,
                Msg::SyncStateQuery(peer::LeaderSyncStateQuery { term: self.term.0 }),
            );
        }
    }

    /// The term's start when this node's history is the most advanced of the sync quorum:
    /// a `LeaderAdvisory` that only names the last advisory of that history (no snapshot),
    /// so what a failover costs does not grow with the state (DESIGN.md §5a). This node's
    /// uncommitted advisories of older terms stay pending; the term start's commit commits
    /// them. Followers that announced another last advisory get the whole state instead
    /// ([`MetadataCore::send_term_start`]). The cluster's first term, whose snapshot seeds the
    /// membership and the domains, is sent whole.
    fn propose_continuation(&mut self, now: Instant) {
        let continues = self.last_advisory_lsn();
        let seeding = (self.tip_state.domains.is_none() && self.seed_domains.is_some())
            || (self.tip_state.membership.is_none() && self.seed_membership.is_some());
        if seeding || continues == Lsn::ZERO {
            let state = self.tip_state.clone();
            self.propose_leader_advisory(now, state);
            return;
        }
        let advisory = peer::Advisory {
            kind: Some(peer::advisory::Kind::Leader(peer::LeaderAdvisory {
                state: None,
                continues: Some(continues.into()),
            })),
        };
        let lsn = self.stamp_own(now, advisory);
        assert_eq!(
            lsn,
            Lsn::new(self.term, 1),
            "a term's start is its first record"
        );
        info!(term = %self.term, continues = %continues, pending = self.pending.len() - 1, "term start proposed: continues this node's history");
        if let Some(sync) = self.sync.as_mut() {
            sync.phase = SyncPhase::Proposed { lsn };
            sync.continues = Some(continues);
        }
        for to in self.targets() {
            if to != self.self_id {
                self.send_term_start(to);
            }
        }
    }

    /// Sends the proposed term start to `to`: as proposed when `to` announced the history it
    /// continues, else the whole state (built once) — the same record at the same LSN, as a
    /// follower with another history needs it.
    fn send_term_start(&mut self, to: NodeId) {
        let term_start = Lsn::new(self.term, 1);
        let Some(sync) = self.sync.as_mut() else {
            return;
        };
        let Some(continues) = sync.continues else {
            return;
        };
        // A node that did not answer the sync (down, or slow) gets the term start as proposed:
        // building the whole state for a node that may never read it would put O(state) on
        // the failover's path; if its history differs it says so with a hello.
        let same_history = sync.responses.get(&to).is_none_or(|l| *l == continues)
            && !sync.wants_whole.contains(&to);
        let advisory = if same_history {
            match self.pending.iter().find(|p| p.lsn == term_start) {
                Some(p) => p.advisory.clone(),
                None => return,
            }
        } else {
            self.counters.term_snapshots_sent += 1;
            let state = &self.tip_state;
            sync.whole
                .get_or_insert_with(|| peer::Advisory {
                    kind: Some(peer::advisory::Kind::Leader(peer::LeaderAdvisory {
                        state: Some(state.to_snapshot()),
                        continues: None,
                    })),
                })
                .clone()
        };
        self.send(to, Msg::Record(record_message(term_start, advisory)));
    }

    fn propose_leader_advisory(&mut self, now: Instant, mut state: ClusterState) {
        if state.domains.is_none() {
            if let Some(seed) = &self.seed_domains {
                info!(
                    domains = seed.len(),
                    "seeding the cluster's domains from the configured domains"
                );
                // Versioned with the snapshot's LSN: a term's snapshot is its first record.
                let version = Lsn::new(self.term, 1);
                state.domains = Some(Arc::new(DomainState::seed(seed, version)));
            }
        }
        if state.membership.is_none() {
            if let Some(seed) = &self.seed_membership {
                info!(
                    members = seed.members.len(),
                    "seeding the cluster's membership from the configured members"
                );
                state.membership = Some(seed.clone());
            }
        }
        // Older terms' uncommitted advisories are folded into the snapshot (or were never
        // committed): drop them.
        self.pending.retain(|p| p.lsn.term >= self.term);
        let advisory = peer::Advisory {
            kind: Some(peer::advisory::Kind::Leader(peer::LeaderAdvisory {
                state: Some(state.to_snapshot()),
                continues: None,
            })),
        };
        self.tip_state = state;
        let lsn = self.append_own(now, advisory);
        assert_eq!(
            lsn,
            Lsn::new(self.term, 1),
            "a term's snapshot is its first record"
        );
        if let Some(sync) = self.sync.as_mut() {
            sync.phase = SyncPhase::Proposed { lsn };
        }
    }

    fn next_lsn(&self) -> Lsn {
        if self.last_lsn.term == self.term {
            self.last_lsn.next()
        } else {
            Lsn::new(self.term, 1)
        }
    }

    fn advance_last(&mut self, lsn: Lsn) {
        assert!(
            lsn >= self.last_lsn,
            "LSN regressed: {lsn} after {}",
            self.last_lsn
        );
        self.last_lsn = lsn;
    }

    /// Stamps, persists and broadcasts an advisory (already applied to the tip state).
    fn append_own(&mut self, now: Instant, advisory: peer::Advisory) -> Lsn {
        let lsn = self.stamp_own(now, advisory.clone());
        self.broadcast(Msg::Record(record_message(lsn, advisory)));
        lsn
    }

    /// The LSN of the last advisory held, committed or not (commit records aside): what
    /// leader sync compares, and what a term start that continues a history names.
    fn last_advisory_lsn(&self) -> Lsn {
        self.pending
            .back()
            .map_or(self.committed_lsn, |p| p.lsn)
            .max(self.committed_lsn)
    }

    /// Holds another node's advisory `lsn` (already applied to the tip state) as the next
    /// uncommitted record of this node's history, and persists it.
    fn hold_uncommitted(&mut self, lsn: Lsn, advisory: peer::Advisory) {
        self.advance_last(lsn);
        self.pending.push_back(Pending {
            lsn,
            advisory: advisory.clone(),
            sent_at: None,
        });
        self.persist_update(lsn, advisory);
    }

    /// Stamps and persists an advisory (already applied to the tip state); sending is the
    /// caller's.
    fn stamp_own(&mut self, now: Instant, advisory: peer::Advisory) -> Lsn {
        let lsn = self.next_lsn();
        assert!(
            lsn > self.last_lsn,
            "LSN regressed: {lsn} after {}",
            self.last_lsn
        );
        self.last_lsn = lsn;
        self.pending.push_back(Pending {
            lsn,
            advisory: advisory.clone(),
            sent_at: Some(now),
        });
        self.persist_update(lsn, advisory);
        lsn
    }

    /// Persists an advisory record; then, for a queue assignment, reports each queue's
    /// proposed partition ([`MetadataOutput::AssignmentProposed`]): after the record, so that
    /// a shell whose write fails stops before it acts on the proposal.
    fn persist_update(&mut self, lsn: Lsn, advisory: peer::Advisory) {
        let proposed: Vec<MetadataOutput> = match &advisory.kind {
            Some(peer::advisory::Kind::QueueAssignment(a)) => a
                .queues
                .iter()
                .map(|q| MetadataOutput::AssignmentProposed {
                    uri: q.uri.clone(),
                    partition: PartitionId(q.partition_id),
                })
                .collect(),
            _ => Vec::new(),
        };
        self.outputs.push_back(MetadataOutput::Persist {
            record: LedgerRecord::Update { lsn, advisory },
        });
        self.outputs.extend(proposed);
    }

    /// Commits the highest own-term pending LSN that a quorum holds.
    fn try_commit(&mut self, now: Instant) {
        if self.role == MetadataRole::Follower {
            return;
        }
        // The highest LSN that a quorum holds is the quorum-th highest acked LSN (acks are
        // high-water marks); the commit is the highest own-term advisory at or below it.
        // O(members log members + log pending), whatever the number of records in flight.
        let Some(held) = self.quorum_held() else {
            return;
        };
        let below = self.pending.partition_point(|p| p.lsn <= held);
        let Some(committed) = below
            .checked_sub(1)
            .map(|i| self.pending[i].lsn)
            .filter(|l| l.term == self.term)
        else {
            return;
        };
        let lsn = self.next_lsn();
        assert!(
            lsn > self.last_lsn,
            "LSN regressed: {lsn} after {}",
            self.last_lsn
        );
        self.last_lsn = lsn;
        self.outputs.push_back(MetadataOutput::Persist {
            record: LedgerRecord::Commit { lsn, committed },
        });
        self.broadcast(Msg::Commit(peer::AdvisoryCommit {
            lsn: Some(lsn.into()),
            committed: Some(committed.into()),
        }));
        self.commit_tail = Some((lsn, committed, now));
        self.apply_committed(committed);
        if let Some(LeaderSync {
            phase: SyncPhase::Proposed { lsn: snapshot },
            ..
        }) = &self.sync
        {
            if *snapshot <= committed {
                self.sync = None;
                self.role = MetadataRole::ActiveLeader;
                info!(term = %self.term, "metadata leader active");
                self.emit_role_changed();
                self.dispatch_assignments(now);
            }
        }
    }

    /// The highest LSN a quorum holds ([`MetadataCore::is_quorum`]): for each voter set, the
    /// majority-th highest ack among its voters; the lowest of those. O(members log members).
    fn quorum_held(&self) -> Option<Lsn> {
        if self.quorum_setting != 0 {
            let quorum = self.quorum_setting;
            if self.matched.len() < quorum {
                return None;
            }
            let mut acked: Vec<Lsn> = self.matched.values().copied().collect();
            acked.sort_unstable_by(|a, b| b.cmp(a));
            return Some(acked[quorum - 1]);
        }
        let mut held: Option<Lsn> = None;
        for voters in self.voter_sets() {
            let mut acked: Vec<Lsn> = voters
                .iter()
                .filter_map(|v| self.matched.get(v).copied())
                .collect();
            let majority = voters.len() / 2 + 1;
            if acked.len() < majority {
                return None;
            }
            acked.sort_unstable_by(|a, b| b.cmp(a));
            let lsn = acked[majority - 1];
            held = Some(held.map_or(lsn, |h| h.min(lsn)));
        }
        held
    }

    /// Applies every pending advisory up to `committed` to the committed state.
    ///
    /// When `committed` covers every pending advisory, the committed state becomes the tip
    /// state (`tip_state` is the committed state with every pending advisory applied): a
    /// clone, O(1), that shares every node of its maps, instead of applying the advisories a
    /// second time. So once commits catch up with the tip — a quiet cluster, or a burst that
    /// drained — the node holds one copy of the state, not two (~300 bytes per queue each),
    /// and each advisory is applied once.
    fn apply_committed(&mut self, committed: Lsn) {
        let before = self.committed_state.membership.clone();
        self.apply_committed_records(committed);
        let epoch = self.committed_epoch();
        if epoch == before.as_ref().map_or(0, |m| m.epoch) {
            return;
        }
        self.just_removed = match (&before, &self.committed_state.membership) {
            (Some(a), Some(b)) => a.ids().difference(&b.ids()).copied().collect(),
            _ => BTreeSet::new(),
        };
        info!(epoch, voters = ?self.committed_state.voters(), "membership committed");
        match self.role {
            MetadataRole::Follower => self.report_epoch(),
            MetadataRole::PassiveLeader | MetadataRole::ActiveLeader => {
                self.applied_epoch.insert(self.self_id, epoch);
            }
        }
    }

    /// Follower: tells the leader at once which membership this node applied, when no ack has
    /// said it yet (an ack of what is durable, carrying the epoch): the next change waits for
    /// a majority of voters to have applied the current one, and a learner is promoted once it
    /// has (see `check_membership_change`, `promote_caught_up_learner`).
    fn report_epoch(&mut self) {
        let epoch = self.committed_epoch();
        let Some(leader) = self.leader else { return };
        let lsn = self.ack_sent;
        let durable = lsn.term == self.term && lsn > Lsn::ZERO && self.persisted_lsn >= lsn;
        if self.role != MetadataRole::Follower || epoch <= self.epoch_reported || !durable {
            return;
        }
        self.send_ack(leader, lsn);
    }

    /// Acks `lsn` to `to` with the epoch of the committed membership (what the leader's
    /// membership rules count), and remembers that epoch as reported.
    fn send_ack(&mut self, to: NodeId, lsn: Lsn) {
        let membership_epoch = self.committed_epoch();
        self.epoch_reported = membership_epoch;
        self.send(
            to,
            Msg::Ack(peer::AdvisoryAck {
                lsn: Some(lsn.into()),
                membership_epoch,
            }),
        );
    }

    fn apply_committed_records(&mut self, committed: Lsn) {
        assert!(
            committed >= self.committed_lsn,
            "committed LSN regressed: {committed} after {}",
            self.committed_lsn
        );
        let catches_up = self.pending.back().is_some_and(|p| p.lsn <= committed);
        while self.pending.front().is_some_and(|p| p.lsn <= committed) {
            let p = self.pending.pop_front().expect("front exists");
            // Debug builds (the simulators, the tests) apply anyway and check, below, that the
            // result is the tip state.
            if !catches_up || cfg!(debug_assertions) {
                if let Err(error) = self.committed_state.apply(&p.advisory) {
                    self.counters.apply_failures += 1;
                    error!(lsn = %p.lsn, error = %error, "committed advisory does not apply");
                }
            }
            if let Some(peer::advisory::Kind::Domain(domain)) = &p.advisory.kind {
                crate::domains::audit(p.lsn, domain);
            }
            if !self.assignment_requests.is_empty() {
                match &p.advisory.kind {
                    Some(peer::advisory::Kind::QueueAssignment(a)) => {
                        for q in &a.queues {
                            self.assignment_requests.remove(&q.uri);
                        }
                    }
                    Some(peer::advisory::Kind::Leader(_)) => self.settle_assignment_requests(),
                    _ => {}
                }
            }
            if crate::ledger::leader_continues(&p.advisory) == Some(None) {
                // A term start with the whole state replaces the history: the retained records
                // start after it (and it is not kept: it is the size of the state).
                self.recent.clear();
                self.recent_base = p.lsn;
            } else if self.config.catch_up_records_max > 0 {
                if self.recent.len() >= self.config.catch_up_records_max {
                    if let Some((first, _)) = self.recent.pop_front() {
                        self.recent_base = first;
                    }
                }
                self.recent.push_back((p.lsn, p.advisory.clone()));
            }
            self.outputs.push_back(MetadataOutput::Committed {
                lsn: p.lsn,
                advisory: p.advisory,
            });
        }
        if catches_up {
            debug_assert!(
                self.committed_state == self.tip_state,
                "the tip state is not the committed state with the pending advisories applied"
            );
            self.committed_state = self.tip_state.clone();
        }
        self.committed_lsn = committed;
    }

    /// The advisories after `a` — the retained committed ones, then the uncommitted ones — if
    /// this node holds the advisory `a` (its committed LSN, the one before its retained
    /// records, one of those, or an uncommitted one): then whoever also holds `a` holds this
    /// node's history up to it (one leader per term, gap-free terms), and these records are
    /// all it lacks. `None`: only the whole state can catch it up.
    fn records_after(&self, a: Lsn) -> Option<Vec<peer::AdvisoryRecord>> {
        let held = a == self.committed_lsn
            || a == self.recent_base
            || self.recent.iter().any(|(l, _)| *l == a)
            || self.pending.iter().any(|p| p.lsn == a);
        if !held {
            return None;
        }
        let from = self.recent.partition_point(|(l, _)| *l <= a);
        let committed = self
            .recent
            .range(from..)
            .map(|(l, adv)| record_message(*l, adv.clone()));
        let uncommitted = self
            .pending
            .iter()
            .filter(|p| p.lsn > a)
            .map(|p| record_message(p.lsn, p.advisory.clone()));
        Some(committed.chain(uncommitted).collect())
    }

    /// Answers a follower's hello. When the follower's last advisory (`theirs`) is one this
    /// leader holds — its committed LSN or an uncommitted advisory — the follower's history
    /// up to it is this leader's, and the CatchUp carries only the advisories after it (a
    /// restarted follower that missed nothing, or only uncommitted records, costs O(them));
    /// otherwise the committed state whole and every uncommitted advisory.
    fn send_catch_up(&mut self, to: NodeId, theirs: Option<Lsn>) {
        self.counters.catch_ups_sent += 1;
        let light = theirs.and_then(|a| Some((a, self.records_after(a)?)));
        let continues = light.as_ref().map(|(a, _)| *a);
        let uncommitted = match light {
            Some((_, records)) => records,
            None => {
                self.counters.whole_catch_ups_sent += 1;
                self.pending
                    .iter()
                    .map(|p| record_message(p.lsn, p.advisory.clone()))
                    .collect()
            }
        };
        let implied_last = self
            .pending
            .back()
            .map_or(self.committed_lsn, |p| p.lsn)
            .max(self.committed_lsn);
        let catch_up = peer::CatchUp {
            term: self.term.0,
            committed: Some(self.committed_lsn.into()),
            state: continues
                .is_none()
                .then(|| self.committed_state.to_snapshot()),
            uncommitted,
            continues: continues.map(Into::into),
        };
        debug!(to = %to, committed = %self.committed_lsn, "sending catch up");
        self.send(to, Msg::CatchUp(catch_up));
        if self.last_lsn > implied_last {
            // Only commit records follow; the last one names the current committed LSN.
            let commit = peer::AdvisoryCommit {
                lsn: Some(self.last_lsn.into()),
                committed: Some(self.committed_lsn.into()),
            };
            self.send(to, Msg::Commit(commit));
        }
    }

    /// When the latest commit record is due for a re-broadcast: it is still the last record,
    /// and the leader is active (see [`MetadataConfig::commit_refresh`]).
    fn commit_refresh_due(&self) -> Option<Instant> {
        match self.commit_tail {
            Some((lsn, _, at))
                if self.role == MetadataRole::ActiveLeader && lsn == self.last_lsn =>
            {
                Some(at + self.config.commit_refresh)
            }
            _ => None,
        }
    }

    fn refresh_commit(&mut self, now: Instant) {
        if self.commit_refresh_due().is_none_or(|at| at > now) {
            return;
        }
        let Some((lsn, committed, _)) = self.commit_tail else {
            return;
        };
        self.counters.commits_refreshed += 1;
        self.commit_tail = Some((lsn, committed, now));
        self.broadcast(Msg::Commit(peer::AdvisoryCommit {
            lsn: Some(lsn.into()),
            committed: Some(committed.into()),
        }));
    }

    /// The lowest LSN a follower acked in this term (`0:0` if one has acked nothing): records
    /// above it still wait for someone. O(members).
    fn least_matched(&self) -> Lsn {
        self.target_ids()
            .filter(|m| *m != self.self_id)
            .map(|m| self.matched.get(&m).copied().unwrap_or(Lsn::ZERO))
            .min()
            .unwrap_or(self.last_lsn)
    }

    fn resend_targets(&self, targets: &BTreeSet<NodeId>, lsn: Lsn) -> Vec<NodeId> {
        targets
            .iter()
            .filter(|m| **m != self.self_id && self.matched.get(m).is_none_or(|l| *l < lsn))
            .copied()
            .collect()
    }

    fn resend_records(&mut self, now: Instant) {
        let resend = self.config.record_resend;
        let lagging = self.least_matched();
        let members = self.targets();
        let mut sends = Vec::new();
        for i in self.pending.partition_point(|p| p.lsn <= lagging)..self.pending.len() {
            let p = &self.pending[i];
            let due = p.lsn.term == self.term && p.sent_at.is_some_and(|t| t + resend <= now);
            if !due {
                continue;
            }
            let targets = self.resend_targets(&members, p.lsn);
            if targets.is_empty() {
                continue;
            }
            let term_start = p.lsn.sequence == 1;
            for to in targets {
                sends.push((to, term_start, record_message(p.lsn, p.advisory.clone())));
            }
            self.pending[i].sent_at = Some(now);
        }
        let continuation = self.sync.as_ref().is_some_and(|s| s.continues.is_some());
        for (to, term_start, record) in sends {
            self.counters.records_resent += 1;
            if term_start && continuation {
                // Each follower gets the form of the term start its history needs.
                self.send_term_start(to);
            } else {
                self.send(to, Msg::Record(record));
            }
        }
    }

    // ---------------------------------------------------------------- outputs

    fn send(&mut self, to: NodeId, kind: Msg) {
        self.outputs.push_back(MetadataOutput::Send {
            to,
            message: peer::MetadataMessage { kind: Some(kind) },
        });
    }

    fn broadcast(&mut self, kind: Msg) {
        self.outputs.push_back(MetadataOutput::Broadcast {
            message: peer::MetadataMessage { kind: Some(kind) },
        });
    }

    fn emit_role_changed(&mut self) {
        let status = self.status();
        let changed = self.last_status.is_none_or(|s| {
            (s.role, s.term, s.leader) != (status.role, status.term, status.leader)
        });
        if changed {
            info!(role = ?status.role, term = %status.term, leader = ?status.leader, "metadata role changed");
            self.last_status = Some(status);
            self.outputs
                .push_back(MetadataOutput::RoleChanged { status });
        }
    }
}

fn record_message(lsn: Lsn, advisory: peer::Advisory) -> peer::AdvisoryRecord {
    // The core has no wall clock; the ledger stamps records with the time of writing.
    peer::AdvisoryRecord {
        lsn: Some(lsn.into()),
        advisory: Some(advisory),
        timestamp_ms: 0,
    }
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
