//! `ReplicationCore`: the pure replication state machine of one partition (DESIGN.md §7).
//!
//! No I/O, no clock: inputs are `handle_*(now, ..)`, outputs are drained with
//! [`ReplicationCore::poll_output`], and [`ReplicationCore::poll_timeout`] says when to call
//! [`ReplicationCore::handle_timeout`] next. Durability is an output: the shell writes
//! [`Output::Persist`] to the journal, fsyncs, and then calls
//! [`ReplicationCore::on_persisted`]; receipts and ACKs are released only after that.
//!
//! **The journal** is a sequence of records with consecutive sequences (1, 2, ...), each
//! stamped with the primary lease it was written in; the leases form runs that only increase
//! (a [`JournalShape`]). Two journals that hold the same lease at the same sequence hold the
//! same records up to there (each lease has one primary, which only appends, and a replica
//! accepts a lease's records only after that lease's primary has synchronised it).
//!
//! **Primary, normal operation**: a PUT becomes a record, is appended locally (Persist) and
//! streamed to every replica in order (`ReplicateRecords`); replicas persist and answer
//! `Receipt{sequence}`. The record is *committed* once a quorum of members (the primary
//! included) holds it; a strong-consistency PUT is ACKed then, an eventual one as soon as the
//! primary holds it. A PUT whose GUID is in the recent-GUID window is not stored again: it is
//! ACKed when the first copy is.
//!
//! **Primary, healing** (a new lease): the primary is *passive*. (1) It asks every member for
//! its journal shape (`ReplicaStateQuery`; a member that answers promises to ignore older
//! leases) and waits for a quorum of answers, itself included. (2) If an answering member is
//! more advanced — higher `(lease of last record, last sequence)` — it pulls from the most
//! advanced one (`PullRecords` -> `SyncRecords`) until it holds the same journal. (3) It
//! brings every answering member to its journal with `SyncRecords{truncate_after, records}`:
//! the member drops records after the common prefix — records of an older lease that the
//! healing quorum does not hold, so no quorum ever acknowledged them — and appends the rest.
//! (4) Once a quorum holds its whole journal, it goes *active* ([`Output::Active`]): the shell
//! rebuilds the queues from [`ReplicationCore::records`]. Why no ACKed record is lost: an ACKed
//! record is on a quorum; the healing quorum intersects it; the most advanced member of the
//! healing quorum therefore holds it (same-lease journals are prefixes of each other, and a
//! member with a later lease was synchronised by that lease's primary, which held it by the
//! same argument).
//!
//! **Replica**: accepts `SyncRecords` from a primary with a lease at least its own, and then
//! `ReplicateRecords` of that lease that follow its last record; anything else from a current
//! primary is answered with its shape (the primary then synchronises it). Stale leases are
//! dropped.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use bmq_proto::client::Property;
use bmq_proto::peer::{
    journal_record::Kind as RecordKind, partition_message::Kind as MsgKind, JournalRecord,
    JournalShape, LeaseRun, PartitionMessage, PullRecords, Receipt, ReplicaStateQuery,
    ReplicaStateResponse, ReplicateRecords, StoredMessage, SyncRecords,
};
use bmq_proto::{LeaseId, NodeId, PartitionId, SessionAddr};
use bytes::Bytes;

/// Settings of a partition's replication.
#[derive(Debug, Clone)]
pub struct ReplicationConfig {
    /// This node.
    pub self_id: NodeId,
    /// The partition.
    pub partition: PartitionId,
    /// Every member of the cluster, this node included.
    pub members: Vec<NodeId>,
    /// Members that must hold a record before it is committed (this node included).
    pub quorum: usize,
    /// Most records in one `ReplicateRecords`/`SyncRecords` message.
    pub batch_records_max: usize,
    /// Most records sent to a replica and not yet receipted.
    pub in_flight_records_max: u64,
    /// Unanswered queries, pulls and replications are resent after this long.
    pub resend_after: Duration,
    /// Most GUIDs remembered for duplicate detection.
    pub guid_window_max: usize,
    /// How long a GUID is remembered for duplicate detection.
    pub guid_window_age: Duration,
}

/// What the shell must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Drop every journal record after `truncate_after` (when set), append `records`, fsync,
    /// then call [`ReplicationCore::on_persisted`].
    Persist {
        /// Keep records up to this sequence only.
        truncate_after: Option<u64>,
        /// Records to append, consecutive.
        records: Vec<JournalRecord>,
    },
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
        uri: String,
        /// The message's GUID.
        guid: Bytes,
    },
    /// This node finished healing and is the active primary of `lease`: rebuild the queues
    /// from [`ReplicationCore::records`].
    Active {
        /// The lease.
        lease: LeaseId,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutResult {
    /// Stored as record `sequence`; the ACK follows as an [`Output::Ack`].
    Appended {
        /// The record's sequence.
        sequence: u64,
    },
    /// The GUID is already stored; the ACK follows (at once if that copy is acknowledged).
    Duplicate,
    /// This node is not an active primary: answer `NOT_READY` (the proxy retries).
    NotReady,
}

#[derive(Debug, Clone)]
struct Waiter {
    producer: SessionAddr,
    uri: String,
    guid: Bytes,
}

#[derive(Debug, Clone)]
struct ReplicaProgress {
    /// Next sequence to stream; `None` until the member's shape is known and it was synced.
    next: Option<u64>,
    /// Highest sequence the member holds durably at this lease.
    receipt: u64,
    /// When the last query, sync or batch was sent, or the last receipt arrived.
    last_activity: Option<Instant>,
}

/// Recently stored GUIDs with their sequences, bounded by count and age.
#[derive(Debug, Default)]
struct GuidWindow {
    order: VecDeque<(Instant, Bytes)>,
    sequence: HashMap<Bytes, u64>,
}

impl GuidWindow {
    fn expire(&mut self, now: Instant, max: usize, age: Duration) {
        while let Some((t, _)) = self.order.front() {
            if self.order.len() <= max && now.saturating_duration_since(*t) < age {
                break;
            }
            let (_, g) = self.order.pop_front().expect("front exists");
            self.sequence.remove(&g);
        }
    }

    fn insert(&mut self, now: Instant, guid: Bytes, sequence: u64) {
        if self.sequence.insert(guid.clone(), sequence).is_none() {
            self.order.push_back((now, guid));
        }
    }

    fn clear(&mut self) {
        self.order.clear();
        self.sequence.clear();
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
    /// The journal, in memory: `records[i].sequence == i + 1`.
    records: Vec<JournalRecord>,
    /// Highest sequence durable on this node.
    persisted: u64,
    /// The lease whose primary has synchronised this replica (0: none).
    synced_lease: LeaseId,
    /// `Some` while this node is the primary of `lease`.
    phase: Option<PrimaryPhase>,
    /// Journal shapes collected while healing.
    shapes: BTreeMap<NodeId, JournalShape>,
    replicas: BTreeMap<NodeId, ReplicaProgress>,
    /// Highest sequence held by a quorum at this lease.
    committed: u64,
    /// Producers waiting for the ACK of a strong PUT, by sequence (released at `committed`).
    strong_waiters: BTreeMap<u64, Vec<Waiter>>,
    /// Producers waiting for the ACK of an eventual PUT, by sequence (released at `persisted`).
    eventual_waiters: BTreeMap<u64, Vec<Waiter>>,
    guids: GuidWindow,
    next_tick: Option<Instant>,
    pull_sent_at: Option<Instant>,
    outputs: VecDeque<Output>,
}

/// How often a primary looks for lost messages to resend.
const TICK: Duration = Duration::from_millis(100);

impl ReplicationCore {
    /// A core holding `recovered` (the journal as read from disk, all durable).
    pub fn new(cfg: ReplicationConfig, recovered: Vec<JournalRecord>) -> Self {
        assert!(
            recovered
                .iter()
                .enumerate()
                .all(|(i, r)| r.sequence == i as u64 + 1),
            "recovered journal must have consecutive sequences from 1"
        );
        let persisted = recovered.len() as u64;
        let lease = recovered.last().map_or(LeaseId(0), |r| LeaseId(r.lease));
        ReplicationCore {
            cfg,
            lease,
            primary: None,
            records: recovered,
            persisted,
            synced_lease: LeaseId(0),
            phase: None,
            shapes: BTreeMap::new(),
            replicas: BTreeMap::new(),
            committed: 0,
            strong_waiters: BTreeMap::new(),
            eventual_waiters: BTreeMap::new(),
            guids: GuidWindow::default(),
            next_tick: None,
            pull_sent_at: None,
            outputs: VecDeque::new(),
        }
    }

    /// The journal held (in memory), in order.
    pub fn records(&self) -> &[JournalRecord] {
        &self.records
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

    /// Last sequence held, durable or not.
    pub fn last_sequence(&self) -> u64 {
        self.records.len() as u64
    }

    /// Highest sequence held by a quorum (primary only; 0 otherwise).
    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// Highest sequence durable on this node (fsynced).
    pub fn persisted(&self) -> u64 {
        self.persisted
    }

    /// Per replica: the highest sequence it has receipted (primary only).
    pub fn replica_receipts(&self) -> Vec<(NodeId, u64)> {
        self.replicas.iter().map(|(n, p)| (*n, p.receipt)).collect()
    }

    /// The shape of this node's journal.
    pub fn shape(&self) -> JournalShape {
        let mut runs: Vec<LeaseRun> = Vec::new();
        for r in &self.records {
            if runs.last().is_none_or(|l| l.lease != r.lease) {
                runs.push(LeaseRun {
                    lease: r.lease,
                    first_sequence: r.sequence,
                });
            }
        }
        JournalShape {
            runs,
            last_sequence: self.last_sequence(),
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

    fn msg(&self, kind: MsgKind) -> PartitionMessage {
        PartitionMessage { kind: Some(kind) }
    }

    fn send(&mut self, to: NodeId, kind: MsgKind) {
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

    /// Members that must hold a record before it is committed, this node included.
    pub fn quorum(&self) -> usize {
        self.cfg.quorum
    }

    /// Changes the quorum at run time (`POST /admin/quorum/{n}`). A primary re-evaluates what
    /// is committed (and may release ACKs or finish healing) with the new number.
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

    /// The committed cluster state names `primary` for this partition at `lease`.
    pub fn handle_role(&mut self, now: Instant, primary: Option<NodeId>, lease: LeaseId) {
        if lease < self.lease {
            return;
        }
        let me = self.cfg.self_id;
        if primary == Some(me) {
            if self.phase.is_some() && self.lease == lease {
                return;
            }
            self.become_primary(now, lease);
        } else {
            if self.lease == lease && self.primary == primary && self.phase.is_none() {
                return;
            }
            self.step_down(lease, primary);
        }
    }

    fn step_down(&mut self, lease: LeaseId, primary: Option<NodeId>) {
        // Waiting producers get no ACK from here: their proxies resend to the new primary,
        // which drops duplicates.
        self.phase = None;
        self.lease = lease;
        self.primary = primary;
        self.shapes.clear();
        self.replicas.clear();
        self.strong_waiters.clear();
        self.eventual_waiters.clear();
        self.guids.clear();
        self.committed = 0;
        self.next_tick = None;
    }

    fn become_primary(&mut self, now: Instant, lease: LeaseId) {
        self.step_down(lease, Some(self.cfg.self_id));
        self.phase = Some(PrimaryPhase::Collecting);
        self.synced_lease = lease;
        self.shapes.insert(self.cfg.self_id, self.shape());
        for n in self.others() {
            self.replicas.insert(
                n,
                ReplicaProgress {
                    next: None,
                    receipt: 0,
                    last_activity: Some(now),
                },
            );
            let q = ReplicaStateQuery {
                partition_id: self.cfg.partition.0,
                lease: lease.0,
            };
            self.send(n, MsgKind::StateQuery(q));
        }
        self.next_tick = Some(now + TICK);
        self.advance_healing(now);
    }

    /// A message from `from` over the DATA channel.
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: PartitionMessage) {
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
        let r = ReplicaStateResponse {
            partition_id: self.cfg.partition.0,
            lease: self.lease.0,
            shape: Some(self.shape()),
        };
        self.send(from, MsgKind::StateResponse(r));
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
            PrimaryPhase::Collecting | PrimaryPhase::Pulling { .. } => {
                self.shapes.insert(from, shape);
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
        let shape = p.shape.unwrap_or_default();
        let prefix = common_prefix(&self.shape(), &shape);
        let s = self.sync_message(prefix);
        self.send(from, MsgKind::Sync(s));
    }

    fn sync_message(&self, prefix: u64) -> SyncRecords {
        let end = (prefix as usize + self.cfg.batch_records_max).min(self.records.len());
        SyncRecords {
            partition_id: self.cfg.partition.0,
            lease: self.lease.0,
            truncate_after: prefix,
            records: self.records[prefix as usize..end].to_vec(),
            sender_last_sequence: self.last_sequence(),
        }
    }

    /// Applies `truncate_after` + `records` to the in-memory journal and asks for persistence.
    fn apply_sync(&mut self, truncate_after: u64, records: Vec<JournalRecord>) -> bool {
        if truncate_after > self.last_sequence()
            || records
                .iter()
                .enumerate()
                .any(|(i, r)| r.sequence != truncate_after + 1 + i as u64)
        {
            return false;
        }
        let truncate = (truncate_after < self.last_sequence()).then_some(truncate_after);
        if let Some(t) = truncate {
            self.records.truncate(t as usize);
            self.persisted = self.persisted.min(t);
        }
        self.records.extend(records.iter().cloned());
        self.outputs.push_back(Output::Persist {
            truncate_after: truncate,
            records,
        });
        true
    }

    fn on_sync(&mut self, now: Instant, from: NodeId, s: SyncRecords) {
        if let Some(PrimaryPhase::Pulling { from: source }) = self.phase.clone() {
            if LeaseId(s.lease) == self.lease && from == source {
                // The answer to our pull.
                if self.apply_sync(s.truncate_after, s.records) {
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
        if self.apply_sync(s.truncate_after, s.records) {
            self.synced_lease = LeaseId(s.lease);
        } else {
            self.answer_shape(from);
        }
    }

    fn answer_shape(&mut self, to: NodeId) {
        let r = ReplicaStateResponse {
            partition_id: self.cfg.partition.0,
            lease: self.lease.0,
            shape: Some(self.shape()),
        };
        self.send(to, MsgKind::StateResponse(r));
    }

    fn on_replicate(&mut self, _now: Instant, from: NodeId, r: ReplicateRecords) {
        if !self.observe_lease(LeaseId(r.lease), from) || self.phase.is_some() {
            return;
        }
        if LeaseId(r.lease) != self.synced_lease || r.prev_sequence > self.last_sequence() {
            // Not synchronised with this primary yet, or a gap: show it our journal.
            self.answer_shape(from);
            return;
        }
        let last = self.last_sequence();
        let fresh: Vec<JournalRecord> = r
            .records
            .into_iter()
            .filter(|x| x.sequence > last)
            .collect();
        if fresh.is_empty() {
            // A resend of what we hold: receipt it again.
            self.send_receipt();
            return;
        }
        if !self.apply_sync(last, fresh) {
            self.answer_shape(from);
        }
    }

    fn send_receipt(&mut self) {
        if let Some(primary) = self.primary {
            if self.phase.is_none()
                && self.synced_lease == self.lease
                && primary != self.cfg.self_id
            {
                let r = Receipt {
                    partition_id: self.cfg.partition.0,
                    lease: self.lease.0,
                    sequence: self.persisted,
                };
                self.send(primary, MsgKind::Receipt(r));
            }
        }
    }

    fn on_receipt(&mut self, now: Instant, from: NodeId, r: Receipt) {
        if LeaseId(r.lease) != self.lease || self.phase.is_none() {
            return;
        }
        let last = self.last_sequence();
        let Some(p) = self.replicas.get_mut(&from) else {
            return;
        };
        if r.sequence > p.receipt && r.sequence <= last {
            p.receipt = r.sequence;
            p.last_activity = Some(now);
            if p.next.is_some_and(|n| n <= r.sequence) {
                p.next = Some(r.sequence + 1);
            }
        }
        self.update_commit(now);
        self.pump(now);
    }

    /// The shell persisted the journal up to `sequence` (fsync done).
    pub fn on_persisted(&mut self, now: Instant, sequence: u64) {
        self.persisted = sequence.min(self.last_sequence()).max(self.persisted);
        if self.phase.is_some() {
            self.update_commit(now);
        } else {
            self.send_receipt();
        }
    }

    fn quorum_position(&self) -> u64 {
        let mut positions: Vec<u64> = vec![self.persisted];
        positions.extend(self.replicas.values().map(|p| p.receipt));
        positions.sort_unstable_by(|a, b| b.cmp(a));
        let q = self.cfg.quorum.max(1);
        positions.get(q - 1).copied().unwrap_or(0)
    }

    fn update_commit(&mut self, now: Instant) {
        self.committed = self.committed.max(self.quorum_position());
        match self.phase {
            Some(PrimaryPhase::Syncing) => {
                if self.persisted == self.last_sequence() && self.committed >= self.last_sequence()
                {
                    self.phase = Some(PrimaryPhase::Active);
                    self.guids.clear();
                    for r in &self.records {
                        if let Some(RecordKind::Message(m)) = &r.kind {
                            self.guids.insert(now, m.guid.clone(), r.sequence);
                        }
                    }
                    self.guids
                        .expire(now, self.cfg.guid_window_max, self.cfg.guid_window_age);
                    self.outputs.push_back(Output::Active { lease: self.lease });
                }
            }
            Some(PrimaryPhase::Active) => self.release_acks(),
            _ => {}
        }
    }

    /// Turns the waiters whose PUT is now safe into `Ack` outputs: strong ones up to the quorum
    /// mark (`committed`), eventual ones up to this node's own fsync mark (`persisted`). Each
    /// kind has its own map, so a release takes one `split_off` per kind and never rescans
    /// PUTs that are still in flight (a rescan per receipt showed in a profile).
    fn release_acks(&mut self) {
        let strong_rest = self
            .strong_waiters
            .split_off(&self.committed.saturating_add(1));
        let strong_done = std::mem::replace(&mut self.strong_waiters, strong_rest);
        let eventual_rest = self
            .eventual_waiters
            .split_off(&self.persisted.saturating_add(1));
        let eventual_done = std::mem::replace(&mut self.eventual_waiters, eventual_rest);
        for (_, list) in strong_done.into_iter().chain(eventual_done) {
            for w in list {
                self.outputs.push_back(Output::Ack {
                    producer: w.producer,
                    uri: w.uri,
                    guid: w.guid,
                });
            }
        }
    }

    /// The waiters of PUTs with `strong` consistency, or of the eventual ones.
    fn waiters_mut(&mut self, strong: bool) -> &mut BTreeMap<u64, Vec<Waiter>> {
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
                    if self.shapes.len() < self.cfg.quorum {
                        return;
                    }
                    let mine = shape_position(&self.shape());
                    let best = self
                        .shapes
                        .iter()
                        .max_by_key(|(n, s)| (shape_position(s), **n == self.cfg.self_id))
                        .map(|(n, s)| (*n, shape_position(s)))
                        .expect("at least our own shape");
                    if best.1 > mine {
                        self.phase = Some(PrimaryPhase::Pulling { from: best.0 });
                        self.send_pull(now, best.0);
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
                    self.phase = Some(PrimaryPhase::Syncing);
                }
                Some(PrimaryPhase::Syncing) => {
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

    fn send_pull(&mut self, now: Instant, from: NodeId) {
        self.pull_sent_at = Some(now);
        let p = PullRecords {
            partition_id: self.cfg.partition.0,
            lease: self.lease.0,
            shape: Some(self.shape()),
        };
        self.send(from, MsgKind::Pull(p));
    }

    /// Brings `node`, whose journal has `shape`, to this primary's journal.
    fn sync_replica(&mut self, now: Instant, node: NodeId, shape: &JournalShape) {
        let prefix = common_prefix(&self.shape(), shape);
        let s = self.sync_message(prefix);
        let next = prefix + s.records.len() as u64 + 1;
        if let Some(p) = self.replicas.get_mut(&node) {
            p.next = Some(next);
            p.receipt = 0;
            p.last_activity = Some(now);
        }
        self.send(node, MsgKind::Sync(s));
    }

    /// Streams what each synchronised replica lacks, within the in-flight limit.
    fn pump(&mut self, now: Instant) {
        if !matches!(
            self.phase,
            Some(PrimaryPhase::Syncing | PrimaryPhase::Active)
        ) {
            return;
        }
        let last = self.last_sequence();
        let nodes: Vec<NodeId> = self.replicas.keys().copied().collect();
        for n in nodes {
            loop {
                let p = self.replicas.get(&n).expect("listed");
                let Some(next) = p.next else { break };
                if next > last
                    || next.saturating_sub(p.receipt + 1) >= self.cfg.in_flight_records_max
                {
                    break;
                }
                let end = (next - 1 + self.cfg.batch_records_max as u64).min(last);
                let r = ReplicateRecords {
                    partition_id: self.cfg.partition.0,
                    lease: self.lease.0,
                    prev_sequence: next - 1,
                    records: self.records[(next - 1) as usize..end as usize].to_vec(),
                };
                let p = self.replicas.get_mut(&n).expect("listed");
                p.next = Some(end + 1);
                p.last_activity = Some(now);
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
        let last = self.last_sequence();
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
                    let q = ReplicaStateQuery {
                        partition_id: self.cfg.partition.0,
                        lease: self.lease.0,
                    };
                    self.send(n, MsgKind::StateQuery(q));
                }
            } else if p.receipt < last && stale(p.last_activity) {
                // Lost batches or a replica that restarted: stream again from its receipt; a
                // replica that cannot follow answers with its shape and is synchronised.
                let p = self.replicas.get_mut(&n).expect("listed");
                p.next = Some(p.receipt + 1);
                self.pump(now);
            }
        }
    }

    /// Whether `guid` was stored recently (a resent PUT).
    pub fn is_duplicate(&mut self, now: Instant, guid: &Bytes) -> bool {
        self.guids
            .expire(now, self.cfg.guid_window_max, self.cfg.guid_window_age);
        self.guids.sequence.contains_key(guid)
    }

    /// A PUT from `producer` (active primary only). A duplicate GUID is not stored again; its
    /// ACK is released with the first copy's. `strong`: ACK at quorum, else once persisted here.
    #[allow(clippy::too_many_arguments)]
    pub fn handle_put(
        &mut self,
        now: Instant,
        producer: SessionAddr,
        uri: String,
        guid: Bytes,
        payload: Bytes,
        properties: Vec<Property>,
        strong: bool,
        timestamp_ms: u64,
    ) -> PutResult {
        if !self.is_active_primary() {
            return PutResult::NotReady;
        }
        let waiter = Waiter {
            producer,
            uri: uri.clone(),
            guid: guid.clone(),
        };
        if self.is_duplicate(now, &guid) {
            let seq = self.guids.sequence[&guid];
            let list = self.waiters_mut(strong).entry(seq).or_default();
            // A proxy resending the same PUT again and again waits once.
            if !list
                .iter()
                .any(|w| w.producer == waiter.producer && w.guid == waiter.guid)
            {
                list.push(waiter);
            }
            self.release_acks();
            return PutResult::Duplicate;
        }
        let kind = RecordKind::Message(StoredMessage {
            uri,
            guid: guid.clone(),
            payload,
            properties,
        });
        let sequence = self.append(now, kind, timestamp_ms);
        self.guids.insert(now, guid, sequence);
        self.waiters_mut(strong)
            .entry(sequence)
            .or_default()
            .push(waiter);
        PutResult::Appended { sequence }
    }

    /// Appends a record that no producer waits for (a confirm, a delivery); active primary
    /// only. Returns its sequence, or `None` when not the active primary.
    pub fn handle_record(
        &mut self,
        now: Instant,
        kind: RecordKind,
        timestamp_ms: u64,
    ) -> Option<u64> {
        self.is_active_primary()
            .then(|| self.append(now, kind, timestamp_ms))
    }

    fn append(&mut self, now: Instant, kind: RecordKind, timestamp_ms: u64) -> u64 {
        let sequence = self.last_sequence() + 1;
        let record = JournalRecord {
            lease: self.lease.0,
            sequence,
            timestamp_ms,
            kind: Some(kind),
        };
        self.records.push(record.clone());
        // Consecutive appends are persisted by the shell in one batch and one fsync.
        if let Some(Output::Persist {
            truncate_after: None,
            records,
        }) = self.outputs.back_mut()
        {
            records.push(record);
        } else {
            self.outputs.push_back(Output::Persist {
                truncate_after: None,
                records: vec![record],
            });
        }
        self.pump(now);
        sequence
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

/// The last sequence up to which two journals hold the same records: the end of the longest
/// prefix over which they have the same lease at every sequence.
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
