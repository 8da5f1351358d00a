//! The elector's pure state machine: BlazingMQ's leader election with ElectionScouting
//! (the article "Leader Election and State Machine Replication in BlazingMQ"; Raft §5.2 and
//! §9.6 "PreVote"), plus a durable term (DESIGN.md §4).
//!
//! No I/O, no clock, no hidden randomness: inputs are `handle_*(now, ..)` and
//! [`Elector::on_term_persisted`], outputs are drained with [`Elector::poll_output`], and
//! [`Elector::poll_timeout`] says when [`Elector::handle_timeout`] must be called next
//! (quinn-proto's shape). The random waits come from a ChaCha8 RNG seeded by the caller.
//!
//! Architecture invariants:
//! - the term never decreases (asserted);
//! - a node supports at most one candidate per term, itself included: supporting or proposing
//!   needs a term strictly above the node's term, and the `ElectionResponse` or
//!   `ElectionProposal` is released only after [`ElectorOutput::PersistTerm`] for that term
//!   was confirmed with [`Elector::on_term_persisted`];
//! - network input never panics: unknown senders, empty or stale messages are dropped and
//!   counted in [`ElectorCounters::messages_dropped`];
//! - only voters of the committed [`Membership`] count towards a quorum, a non-voter never
//!   stands, and a voter refuses a candidate whose membership epoch is older than its own
//!   (DESIGN.md §5a; counted in [`ElectorCounters::older_membership_refused`]).
//!
//! Verification hooks: the core is `Clone`, and [`Elector::hash_behaviour`] hashes everything
//! that determines its future behaviour (instants relative to a caller's `now`), so that a model
//! checker can explore it; [`Elector::set_election_scouting`] switches ElectionScouting off to
//! show, in tests, what the mechanism buys.

use std::collections::{BTreeSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use bmq_proto::peer::{
    elector_message::Kind, ElectionProposal, ElectionResponse, ElectionScoutingRequest,
    ElectionScoutingResponse, ElectorMessage, HeartbeatResponse, LeaderHeartbeat,
    LeadershipCession,
};
use bmq_proto::{NodeId, Term};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tracing::debug;

use crate::config::ElectorConfig;
use crate::membership::Membership;
use crate::state::{ElectorState, ElectorStatus, TransitionReason};
use crate::successor::successor_wait_bounds;

/// What the elector asks its shell to do, drained with [`Elector::poll_output`] in order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ElectorOutput {
    /// Send `message` to peer `to` (best effort: the protocol tolerates loss).
    Send {
        /// The destination peer.
        to: NodeId,
        /// The elector message.
        message: ElectorMessage,
    },
    /// Send `message` to every peer.
    Broadcast {
        /// The elector message.
        message: ElectorMessage,
    },
    /// Durably store `term` (write + fsync), then call [`Elector::on_term_persisted`]. The
    /// elector withholds its vote or its proposal for `term` until then.
    PersistTerm {
        /// The term to store; never lower than a previously requested one.
        term: Term,
    },
    /// The state, term, leader or tentative leader changed; `status.age` grows by one each time.
    StateChanged {
        /// The new status.
        status: ElectorStatus,
    },
}

/// Monotonic event counters of one elector, for the shell to publish as metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ElectorCounters {
    /// ElectionScouting rounds started.
    pub scoutings_started: u64,
    /// Elections started (the node became Candidate).
    pub elections_started: u64,
    /// Elections won (the node became Leader).
    pub elections_won: u64,
    /// Heartbeat periods that elapsed without a heartbeat from the followed leader, as seen by
    /// the periodic check (a check exactly one period after the last heartbeat counts one).
    pub heartbeats_missed: u64,
    /// Messages dropped: unknown sender, empty, stale or not applicable in the current state.
    pub messages_dropped: u64,
    /// Scouting requests and proposals refused because the candidate has applied fewer
    /// membership changes than this node, or is not a voter of the same epoch.
    pub older_membership_refused: u64,
}

/// What is released once a term is on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Pending {
    /// Send `ElectionResponse { term }` to `to` (a candidate supported, or a leader discovered).
    Support { to: NodeId, term: Term },
    /// Become Candidate in `term` and broadcast `ElectionProposal`.
    Candidacy { term: Term },
}

/// An ElectionScouting round in progress.
#[derive(Debug, Clone)]
struct Scouting {
    /// The proposed term: own term + 1.
    term: Term,
    /// Peers that answered `will_vote = true`.
    supporters: BTreeSet<NodeId>,
    deadline: Instant,
}

/// The elector state machine of one node. See the module documentation.
///
/// `Clone` so that a model checker can branch on it; a clone continues with the same RNG stream.
#[derive(Debug, Clone)]
pub struct Elector {
    /// The node is stopping gracefully: it never stands for election again (it still answers
    /// and supports others), see [`Elector::retire`].
    retired: bool,
    self_id: NodeId,
    /// Every member but self: who messages are accepted from and broadcast to.
    peers: BTreeSet<NodeId>,
    /// The committed voters, self included if it votes: who counts towards a quorum.
    voters: BTreeSet<NodeId>,
    /// Membership changes applied ([`Membership::epoch`]).
    membership_epoch: u64,
    /// Peers whose connection is down; every peer starts available.
    unavailable: BTreeSet<NodeId>,
    config: ElectorConfig,
    quorum_setting: usize,
    rng: ChaCha8Rng,

    state: ElectorState,
    /// The highest term adopted or promised; `>= persisted_term`.
    term: Term,
    persisted_term: Term,
    /// The followed leader (Follower only).
    leader: Option<NodeId>,
    /// The supported candidate of `term` (Follower without leader only).
    tentative_leader: Option<NodeId>,
    reason: TransitionReason,
    age: u64,
    last_published: (ElectorState, Term, Option<NodeId>, Option<NodeId>),

    /// Leaderless follower: when to start the next ElectionScouting.
    scout_at: Option<Instant>,
    scouting: Option<Scouting>,
    /// Candidate: when the election fails.
    election_deadline: Option<Instant>,
    /// Candidate and Leader: peers that sent `ElectionResponse` for `term` and are available.
    supporters: BTreeSet<NodeId>,
    /// Candidate and Leader: peers whose `ElectionResponse` for `term` arrived while their link
    /// was still reported down. A (re)started follower answers the first heartbeat it gets,
    /// which can come before this node's link monitor reports it up; dropping that answer left
    /// the follower uncounted for the whole term, and the loss of another node then cost this
    /// leader its quorum (seen in the failover benchmark). Counted when the link is
    /// reported up, forgotten when it is reported down.
    support_while_unavailable: BTreeSet<NodeId>,
    /// Following: time of the last heartbeat from the leader.
    last_heartbeat: Option<Instant>,
    heartbeats_missed_reported: u64,
    heartbeat_check_at: Option<Instant>,
    /// Leader: next heartbeat broadcast.
    heartbeat_at: Option<Instant>,

    pending: Option<Pending>,
    outputs: VecDeque<ElectorOutput>,
    counters: ElectorCounters,
    /// Test/diagnostic switch, see [`Elector::set_election_scouting`]; `true` in production.
    scouting_enabled: bool,
    /// Test/diagnostic switch, see [`Elector::set_membership_check`]; `true` in production.
    membership_check_enabled: bool,
}

fn message(kind: Kind) -> ElectorMessage {
    ElectorMessage { kind: Some(kind) }
}

impl Elector {
    /// A dormant elector for node `self_id` among `peers` (self and duplicates are ignored),
    /// all of them voters at membership epoch 0 ([`Membership::all_voters`]); a later
    /// membership is given with [`Elector::set_membership`].
    ///
    /// `persisted_term` is the term read from the term store (DESIGN.md §4: the max of the
    /// elector term and the last ledger LSN's term); `rng_seed` seeds every random wait.
    ///
    /// # Panics
    /// If `config` does not pass [`ElectorConfig::validate`]: the shell validates at start-up.
    pub fn new(
        self_id: NodeId,
        peers: &[NodeId],
        config: ElectorConfig,
        persisted_term: Term,
        rng_seed: u64,
    ) -> Self {
        if let Err(e) = config.validate() {
            panic!("invalid elector config: {e}");
        }
        let peers: BTreeSet<NodeId> = peers.iter().copied().filter(|p| *p != self_id).collect();
        let mut voters = peers.clone();
        voters.insert(self_id);
        Elector {
            retired: false,
            self_id,
            peers,
            voters,
            membership_epoch: 0,
            unavailable: BTreeSet::new(),
            quorum_setting: config.quorum,
            config,
            rng: ChaCha8Rng::seed_from_u64(rng_seed),
            state: ElectorState::Dormant,
            term: persisted_term,
            persisted_term,
            leader: None,
            tentative_leader: None,
            reason: TransitionReason::None,
            age: 0,
            last_published: (ElectorState::Dormant, persisted_term, None, None),
            scout_at: None,
            scouting: None,
            election_deadline: None,
            supporters: BTreeSet::new(),
            support_while_unavailable: BTreeSet::new(),
            last_heartbeat: None,
            heartbeats_missed_reported: 0,
            heartbeat_check_at: None,
            heartbeat_at: None,
            pending: None,
            outputs: VecDeque::new(),
            counters: ElectorCounters::default(),
            scouting_enabled: true,
            membership_check_enabled: true,
        }
    }

    /// Test/diagnostic switch: with `false` this node runs the article's algorithm *before*
    /// ElectionScouting ("Updated Algorithm using Term"): where it would scout it proposes
    /// directly with `term + 1` (bumping and persisting its own term first), and it supports
    /// any proposal with a higher term whatever its role — a leader steps down
    /// (`LeadershipCession`, `LeaderPreempted`) and a follower drops its leader. This is the
    /// algorithm that suffers the article's "non-sticky leader" and "leader ping-pong"; the
    /// simulator's scenario tests switch it off to show that they do appear without
    /// ElectionScouting. Default `true`; never switch it off in production. Takes effect at the
    /// next scouting or proposal.
    pub fn set_election_scouting(&mut self, enabled: bool) {
        self.scouting_enabled = enabled;
    }

    /// Test/diagnostic switch: with `false` this node supports candidates whatever their
    /// membership epoch (the refusal described at [`Membership`] is skipped), so that the
    /// elector's model can show the two leaders in one term that the refusal prevents. Default
    /// `true`; never switch it off in production.
    pub fn set_membership_check(&mut self, enabled: bool) {
        self.membership_check_enabled = enabled;
    }

    /// Feeds `state` with everything that determines this elector's future behaviour, for a
    /// model checker's state fingerprint. Instants are hashed as signed offsets from `now` (the
    /// core never reads a clock, so two electors that differ by a uniform shift of time behave
    /// alike); the status `age` and the [`ElectorCounters`] are left out, since they only
    /// number what was already published. Two electors with equal hashes for their own `now`
    /// produce the same outputs for the same inputs at the same offsets.
    pub fn hash_behaviour<H: Hasher>(&self, now: Instant, state: &mut H) {
        let offset = |at: Option<Instant>| {
            at.map(|at| {
                if at >= now {
                    (at - now).as_nanos() as i128
                } else {
                    -((now - at).as_nanos() as i128)
                }
            })
        };
        self.retired.hash(state);
        self.self_id.hash(state);
        self.peers.hash(state);
        self.voters.hash(state);
        self.membership_epoch.hash(state);
        self.unavailable.hash(state);
        self.config.hash(state);
        self.quorum_setting.hash(state);
        self.rng.get_seed().hash(state);
        self.rng.get_stream().hash(state);
        self.rng.get_word_pos().hash(state);
        self.state.hash(state);
        self.term.hash(state);
        self.persisted_term.hash(state);
        self.leader.hash(state);
        self.tentative_leader.hash(state);
        self.reason.hash(state);
        self.last_published.hash(state);
        offset(self.scout_at).hash(state);
        self.scouting.as_ref().map(|s| s.term).hash(state);
        self.scouting.as_ref().map(|s| &s.supporters).hash(state);
        offset(self.scouting.as_ref().map(|s| s.deadline)).hash(state);
        offset(self.election_deadline).hash(state);
        self.supporters.hash(state);
        self.support_while_unavailable.hash(state);
        offset(self.last_heartbeat).hash(state);
        self.heartbeats_missed_reported.hash(state);
        offset(self.heartbeat_check_at).hash(state);
        offset(self.heartbeat_at).hash(state);
        self.pending.hash(state);
        self.outputs.len().hash(state);
        for output in &self.outputs {
            match output {
                // The age inside a queued status is left out, as above.
                ElectorOutput::StateChanged { status } => {
                    (
                        status.state,
                        status.term,
                        status.leader,
                        status.tentative_leader,
                    )
                        .hash(state);
                    status.reason.hash(state);
                }
                other => other.hash(state),
            }
        }
        self.scouting_enabled.hash(state);
        self.membership_check_enabled.hash(state);
    }

    /// Dormant -> Follower (`Started`), term = persisted term. Arms `initial_wait` plus a random
    /// wait to discover a leader before scouting (0 without other voters, so a single node
    /// elects itself at once). A node that is not a voter does not arm it: it only follows.
    /// A no-op if already started.
    pub fn start(&mut self, now: Instant) {
        if self.state != ElectorState::Dormant {
            return;
        }
        self.state = ElectorState::Follower;
        self.reason = TransitionReason::Started;
        // The article: after the initial wait, "some additional time (random interval)" so
        // that nodes started together do not scout together.
        if self.may_stand() {
            let wait = if self.voters.len() <= 1 {
                Duration::ZERO
            } else {
                self.config.initial_wait + self.random_wait()
            };
            self.scout_at = Some(now + wait);
        }
        self.publish_status();
    }

    /// Handles one elector message from peer `from`. Unknown senders, empty messages and
    /// messages that do not apply are dropped (debug log + counter), never an error.
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: ElectorMessage) {
        let kind = match message.kind {
            Some(kind) if self.state != ElectorState::Dormant && self.peers.contains(&from) => kind,
            _ => {
                self.drop_message(from, "unknown sender, empty message or dormant");
                return;
            }
        };
        // "A node will always honor a message with a higher term" (the article), except
        // ElectionScouting (which never changes terms) and ElectionProposal, which a leader
        // ignores whatever its term (sticky leader, DESIGN.md §4).
        let mut preempted = false;
        if self.state == ElectorState::Leader {
            let higher = match &kind {
                Kind::ElectionResponse(m) => Some(m.term),
                Kind::Heartbeat(m) => Some(m.term),
                Kind::HeartbeatResponse(m) => Some(m.term),
                Kind::Cession(m) => Some(m.term),
                Kind::NodeStatus(m) => Some(m.term),
                Kind::ScoutingRequest(_) | Kind::ScoutingResponse(_) | Kind::Proposal(_) => None,
            }
            .map(Term)
            .filter(|t| *t > self.term);
            if let Some(term) = higher {
                self.step_down(now, TransitionReason::LeaderPreempted, Some(term));
                preempted = true;
            }
        }
        match kind {
            Kind::ScoutingRequest(m) => {
                self.on_scouting_request(from, Term(m.term), m.membership_epoch)
            }
            Kind::ScoutingResponse(m) => {
                self.on_scouting_response(now, from, Term(m.term), m.will_vote)
            }
            Kind::Proposal(m) => self.on_proposal(now, from, Term(m.term), m.membership_epoch),
            Kind::ElectionResponse(m) => self.on_election_response(now, from, Term(m.term)),
            Kind::Heartbeat(m) => self.on_heartbeat(now, from, Term(m.term), preempted),
            Kind::HeartbeatResponse(_) => {
                // Only meaningful to a leader with a lower term, handled above.
                if !preempted {
                    self.drop_message(from, "heartbeat response not applicable");
                }
            }
            Kind::Cession(m) => self.on_cession(now, from, Term(m.term)),
            // A peer announcing its own availability (e.g. `false` when it stops).
            Kind::NodeStatus(m) => self.set_peer_available(now, from, m.available),
        }
        self.publish_status();
    }

    /// The connection to `peer` went up (`true`) or down (`false`). Unknown peers are ignored.
    pub fn handle_peer_available(&mut self, now: Instant, peer: NodeId, available: bool) {
        if !self.peers.contains(&peer) {
            return;
        }
        self.set_peer_available(now, peer, available);
        self.publish_status();
    }

    /// Fires every expired deadline. Call when `now >= poll_timeout()`; calling earlier is
    /// harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.scout_at.is_some_and(|at| at <= now) {
            self.scout_at = None;
            self.start_scouting(now);
        }
        if self.scouting.as_ref().is_some_and(|s| s.deadline <= now) {
            // No quorum of `will_vote`: wait a random interval and scout again (the article).
            let scouting = self.scouting.take().expect("checked above");
            debug!(term = %scouting.term, supporters = scouting.supporters.len(), "elector scouting failed");
            let wait = self.random_wait();
            self.scout_at = Some(now + wait);
        }
        if self.election_deadline.is_some_and(|at| at <= now) {
            self.election_deadline = None;
            let wait = self.random_wait();
            self.become_leaderless_follower(now, TransitionReason::QuorumNotAchieved, wait);
        }
        if let Some(at) = self.heartbeat_check_at.filter(|at| *at <= now) {
            self.check_heartbeat(now, at);
        }
        if self.heartbeat_at.is_some_and(|at| at <= now) {
            self.broadcast(Kind::Heartbeat(LeaderHeartbeat { term: self.term.0 }));
            self.heartbeat_at = Some(now + self.config.heartbeat_period);
        }
        self.publish_status();
    }

    /// The shell has durably stored `term` (after [`ElectorOutput::PersistTerm`]). Releases the
    /// vote or the candidacy that waited for it, if still relevant.
    ///
    /// # Panics
    /// If `term` is above the elector's term: the shell persisted a term it was not asked for.
    pub fn on_term_persisted(&mut self, now: Instant, term: Term) {
        assert!(
            term <= self.term,
            "persisted term {term} above elector term {}",
            self.term
        );
        self.persisted_term = self.persisted_term.max(term);
        match self.pending {
            Some(Pending::Support { to, term }) if term <= self.persisted_term => {
                self.pending = None;
                let still_relevant = term == self.term
                    && self.state == ElectorState::Follower
                    && (self.leader == Some(to) || self.tentative_leader == Some(to));
                if still_relevant {
                    self.send(
                        to,
                        Kind::ElectionResponse(ElectionResponse { term: term.0 }),
                    );
                }
            }
            Some(Pending::Candidacy { term }) if term <= self.persisted_term => {
                self.pending = None;
                let still_relevant = term == self.term
                    && self.state == ElectorState::Follower
                    && self.leader.is_none()
                    && self.tentative_leader.is_none()
                    && self.may_stand();
                if still_relevant {
                    self.become_candidate(now);
                } else if self.state == ElectorState::Follower
                    && self.leader.is_none()
                    && self.scout_at.is_none()
                    && self.scouting.is_none()
                    && self.may_stand()
                {
                    let wait = self.random_wait();
                    self.scout_at = Some(now + wait);
                }
            }
            _ => {}
        }
        self.publish_status();
    }

    /// Sets the quorum at run time (`0` = `N/2 + 1`; above `N` forbids leadership). A leader
    /// whose live supporters fall below the new quorum steps down (`QuorumNotAchieved`); a
    /// candidate or a scouting node that now has enough support proceeds.
    pub fn set_quorum(&mut self, now: Instant, quorum: usize) {
        self.quorum_setting = quorum;
        match self.state {
            ElectorState::Leader => self.check_leader_quorum(now),
            ElectorState::Candidate => self.check_candidate_quorum(now),
            ElectorState::Follower => self.check_scouting_quorum(),
            ElectorState::Dormant => {}
        }
        self.publish_status();
    }

    /// Graceful leadership hand-off (DESIGN.md §4, beyond BlazingMQ): a leader broadcasts
    /// `LeadershipCession`, becomes a leaderless follower (`LeadershipCeded`) and waits
    /// `random_wait_max` plus a random wait before scouting, so that another node scouts
    /// first. A no-op on a non-leader.
    pub fn cede_leadership(&mut self, now: Instant) {
        if self.state != ElectorState::Leader {
            return;
        }
        let wait = self.config.random_wait_max + self.random_wait();
        self.broadcast(Kind::Cession(LeadershipCession { term: self.term.0 }));
        self.become_leaderless_follower(now, TransitionReason::LeadershipCeded, wait);
        self.publish_status();
    }

    /// Graceful stop (DESIGN.md §7): the node never stands for election again — no scouting,
    /// no candidacy — and a leader cedes at once ([`Elector::cede_leadership`]); a candidate
    /// gives up its candidacy. It keeps answering and supporting the other nodes, so the rest of
    /// the cluster elects a leader that is not stopping. Irreversible: the process exits.
    pub fn retire(&mut self, now: Instant) {
        if self.retired {
            return;
        }
        self.retired = true;
        match self.state {
            ElectorState::Leader => self.cede_leadership(now),
            ElectorState::Candidate => {
                let wait = self.random_wait();
                self.become_leaderless_follower(now, TransitionReason::LeadershipCeded, wait);
            }
            _ => {}
        }
        self.scout_at = None;
        self.scouting = None;
        if matches!(self.pending, Some(Pending::Candidacy { .. })) {
            self.pending = None;
        }
        self.publish_status();
    }

    /// Whether [`Elector::retire`] was called.
    pub fn is_retired(&self) -> bool {
        self.retired
    }

    /// The next output to execute, in order.
    pub fn poll_output(&mut self) -> Option<ElectorOutput> {
        self.outputs.pop_front()
    }

    /// The earliest deadline at which [`Elector::handle_timeout`] must be called, if any.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [
            self.scout_at,
            self.scouting.as_ref().map(|s| s.deadline),
            self.election_deadline,
            self.heartbeat_check_at,
            self.heartbeat_at,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The current status (its `age` is that of the last published change).
    pub fn status(&self) -> ElectorStatus {
        ElectorStatus {
            state: self.state,
            term: self.term,
            leader: self.status_leader(),
            tentative_leader: self.tentative_leader,
            reason: self.reason,
            age: self.age,
        }
    }

    /// The effective quorum, in voters: the configured value, or `V/2 + 1` with `V` the
    /// committed voters when it is 0.
    pub fn quorum(&self) -> usize {
        if self.quorum_setting == 0 {
            self.voters.len() / 2 + 1
        } else {
            self.quorum_setting
        }
    }

    /// Event counters since construction.
    pub fn counters(&self) -> ElectorCounters {
        self.counters
    }

    /// This node's id.
    pub fn self_id(&self) -> NodeId {
        self.self_id
    }

    /// The membership epoch in use ([`Membership::epoch`]).
    pub fn membership_epoch(&self) -> u64 {
        self.membership_epoch
    }

    /// The voters counted towards a quorum, self included if it votes.
    pub fn voters(&self) -> &BTreeSet<NodeId> {
        &self.voters
    }

    /// Whether this node is a voter of the membership in use.
    pub fn is_voter(&self) -> bool {
        self.voters.contains(&self.self_id)
    }

    /// Applies a committed membership (DESIGN.md §5a), called by the node each time its
    /// metadata state applies a membership change, and once at start with the membership the
    /// ledger holds. An epoch below the one in use is ignored (returns `false`): memberships
    /// only move forward. Effects, at once:
    /// - messages are accepted from, and broadcast to, `members` only; support already
    ///   received is kept but only voters' support counts;
    /// - a leader that is no longer a voter cedes ([`TransitionReason::MembershipChanged`]); a
    ///   leader whose voting supporters no longer make a quorum steps down
    ///   (`QuorumNotAchieved`); a candidacy or a scouting in progress is abandoned (support
    ///   gathered under one membership never completes an election under another) and a voter
    ///   scouts again, for the next term, after a random wait;
    /// - a follower whose leader is no longer a member drops it; a leaderless follower that
    ///   became a voter scouts after a random wait.
    pub fn set_membership(&mut self, now: Instant, membership: Membership) -> bool {
        if membership.epoch < self.membership_epoch {
            debug!(
                epoch = membership.epoch,
                own_epoch = self.membership_epoch,
                "elector membership older than the one in use ignored"
            );
            return false;
        }
        let Membership {
            epoch,
            mut members,
            voters,
        } = membership;
        members.extend(voters.iter().copied());
        members.remove(&self.self_id);
        self.membership_epoch = epoch;
        self.voters = voters;
        self.peers = members;
        let peers = &self.peers;
        self.unavailable.retain(|p| peers.contains(p));
        self.supporters.retain(|p| peers.contains(p));
        self.support_while_unavailable.retain(|p| peers.contains(p));
        if let Some(s) = self.scouting.as_mut() {
            s.supporters.retain(|p| peers.contains(p));
        }
        if self
            .tentative_leader
            .is_some_and(|t| !self.peers.contains(&t))
        {
            self.tentative_leader = None;
        }
        if self.state == ElectorState::Follower
            && self.leader.is_some_and(|l| !self.peers.contains(&l))
        {
            let wait = self.random_wait();
            self.become_leaderless_follower(now, TransitionReason::MembershipChanged, wait);
        }
        // Support gathered under one membership never completes an election under another:
        // a candidacy or a scouting in progress is abandoned, and the node scouts again for
        // the next term. Defence in depth: with changes committed at arbitrary moments, a
        // change applied mid-term let a candidate of term T win with the new, smaller quorum
        // after another node led T under the old one (the model checker, {1,2,3} -> {1,2} ->
        // {1}); with commits that need a majority following the leader, as the metadata's do,
        // neither the model nor the simulator found a violation without this rule.
        if self.state == ElectorState::Candidate {
            let wait = self.random_wait();
            self.become_leaderless_follower(now, TransitionReason::MembershipChanged, wait);
        }
        self.scouting = None;
        if matches!(self.pending, Some(Pending::Candidacy { .. })) {
            self.pending = None;
            self.scout_at = None;
        }
        if self.may_stand() {
            if self.state == ElectorState::Leader {
                self.check_leader_quorum(now);
            }
            let idle = self.state == ElectorState::Follower
                && self.leader.is_none()
                && self.tentative_leader.is_none()
                && self.scout_at.is_none()
                && self.scouting.is_none()
                && self.pending.is_none();
            if idle {
                let wait = self.random_wait();
                self.scout_at = Some(now + wait);
            }
        } else {
            if self.state == ElectorState::Leader {
                self.step_down(now, TransitionReason::MembershipChanged, None);
            }
            self.scout_at = None;
        }
        self.publish_status();
        true
    }

    /// Whether this node may scout and stand: a voter that is not retired.
    fn may_stand(&self) -> bool {
        !self.retired && self.is_voter()
    }

    /// Voters among `supporters`, plus self if it votes: the support a quorum is measured by.
    fn voting_support(&self, supporters: &BTreeSet<NodeId>) -> usize {
        supporters
            .iter()
            .filter(|p| self.voters.contains(p))
            .count()
            + usize::from(self.is_voter())
    }

    /// A candidate that has applied fewer membership changes than this node, or that is not a
    /// voter of the same epoch, gets no support (see [`Membership`]).
    fn refuses_membership(&mut self, from: NodeId, epoch: u64) -> bool {
        let refused = self.membership_check_enabled
            && (epoch < self.membership_epoch
                || (epoch == self.membership_epoch && !self.voters.contains(&from)));
        if refused {
            self.counters.older_membership_refused += 1;
            debug!(from = %from, epoch, own_epoch = self.membership_epoch, "elector candidate of an older membership refused");
        }
        refused
    }

    // ------------------------------------------------------------------ message handlers

    /// The article's ElectionScouting answer: `No` when a leader is known (sticky leader), else
    /// `Yes` iff the proposed term is above the own term and the sender's membership is not
    /// older ([`Membership`]). Never changes the own term.
    fn on_scouting_request(&mut self, from: NodeId, proposed: Term, membership_epoch: u64) {
        let has_leader = match self.state {
            ElectorState::Leader => true,
            ElectorState::Follower => self.leader.is_some(),
            ElectorState::Candidate | ElectorState::Dormant => false,
        };
        let will_vote =
            !has_leader && proposed > self.term && !self.refuses_membership(from, membership_epoch);
        self.send(
            from,
            Kind::ScoutingResponse(ElectionScoutingResponse {
                term: proposed.0,
                will_vote,
            }),
        );
    }

    fn on_scouting_response(&mut self, _now: Instant, from: NodeId, term: Term, will_vote: bool) {
        let available = self.is_available(from);
        match self.scouting.as_mut() {
            Some(s) if s.term == term && will_vote && available => {
                s.supporters.insert(from);
                self.check_scouting_quorum();
            }
            Some(s) if s.term == term => {}
            _ => self.drop_message(from, "scouting response not applicable"),
        }
    }

    /// Proposal rule (DESIGN.md §4): a leader or a follower with a leader ignores it; a
    /// leaderless follower or a candidate supports a strictly higher term.
    /// With ElectionScouting switched off ([`Elector::set_election_scouting`]), the article's
    /// earlier rule applies instead: any higher proposal is supported, a leader steps down.
    fn on_proposal(&mut self, now: Instant, from: NodeId, term: Term, membership_epoch: u64) {
        let may_support = match self.state {
            ElectorState::Follower => self.leader.is_none() || !self.scouting_enabled,
            ElectorState::Candidate => true,
            ElectorState::Leader => !self.scouting_enabled,
            ElectorState::Dormant => false,
        };
        if !may_support || term <= self.term {
            self.drop_message(from, "proposal not supported");
            return;
        }
        if self.refuses_membership(from, membership_epoch) {
            self.drop_message(from, "proposal from an older membership");
            return;
        }
        let reason = match self.state {
            ElectorState::Candidate => TransitionReason::ElectionPreempted,
            ElectorState::Leader => {
                self.broadcast(Kind::Cession(LeadershipCession { term: self.term.0 }));
                TransitionReason::LeaderPreempted
            }
            ElectorState::Follower if self.leader.is_some() => TransitionReason::LeaderPreempted,
            _ => TransitionReason::None,
        };
        self.clear_role();
        self.state = ElectorState::Follower;
        self.reason = reason;
        self.tentative_leader = Some(from);
        self.adopt_term(term);
        self.pending = Some(Pending::Support { to: from, term });
        // If the candidate never sends a heartbeat, scout after its election would have ended.
        let wait = self.config.election_result_timeout + self.random_wait();
        self.scout_at = Some(now + wait);
    }

    fn on_election_response(&mut self, now: Instant, from: NodeId, term: Term) {
        let applies = term == self.term
            && matches!(self.state, ElectorState::Candidate | ElectorState::Leader);
        if !applies {
            self.drop_message(from, "election response not applicable");
            return;
        }
        if !self.is_available(from) {
            // Counted once the link is reported up (see `support_while_unavailable`).
            self.support_while_unavailable.insert(from);
            return;
        }
        self.supporters.insert(from);
        if self.state == ElectorState::Candidate {
            self.check_candidate_quorum(now);
        }
    }

    /// `preempted`: this heartbeat has just made this leader step down (reported as the reason).
    fn on_heartbeat(&mut self, now: Instant, from: NodeId, term: Term, preempted: bool) {
        match self.state {
            ElectorState::Leader => {
                // Higher terms were handled by the step-down above: the sender is stale (or,
                // impossibly, a second leader of our term); our heartbeat makes it step down.
                self.send(from, Kind::Heartbeat(LeaderHeartbeat { term: self.term.0 }));
            }
            ElectorState::Candidate => {
                if term >= self.term {
                    self.follow(now, from, term, TransitionReason::ElectionPreempted, true);
                } else {
                    self.send_heartbeat_response(from);
                }
            }
            ElectorState::Follower => {
                if term < self.term {
                    self.send_heartbeat_response(from);
                    return;
                }
                match self.leader {
                    Some(leader) if leader == from && term == self.term => {
                        self.last_heartbeat = Some(now);
                        self.heartbeats_missed_reported = 0;
                    }
                    // Our leader was re-elected in a later term.
                    Some(leader) if leader == from => {
                        self.follow(now, from, term, TransitionReason::None, true)
                    }
                    Some(_) if term > self.term => {
                        self.follow(now, from, term, TransitionReason::LeaderPreempted, true)
                    }
                    Some(_) => self.drop_message(from, "heartbeat from a second leader"),
                    None => {
                        // The supported candidate won: its own ElectionResponse is (or will be,
                        // once persisted) sent already. Any other leader gets an unsolicited one.
                        let solicited = self.tentative_leader == Some(from) && term == self.term;
                        let reason = if preempted {
                            TransitionReason::LeaderPreempted
                        } else {
                            TransitionReason::None
                        };
                        self.follow(now, from, term, reason, !solicited);
                    }
                }
            }
            ElectorState::Dormant => {}
        }
    }

    fn on_cession(&mut self, now: Instant, from: NodeId, term: Term) {
        if self.state != ElectorState::Follower || term < self.term {
            self.drop_message(from, "cession not applicable");
            return;
        }
        if self.leader == Some(from) {
            let wait = self.successor_wait(from);
            self.become_leaderless_follower(now, TransitionReason::LeadershipCeded, wait);
        } else if self.tentative_leader == Some(from) {
            self.tentative_leader = None;
        } else {
            self.drop_message(from, "cession from a node we do not follow");
        }
    }

    fn set_peer_available(&mut self, now: Instant, peer: NodeId, available: bool) {
        if available {
            self.unavailable.remove(&peer);
            if self.support_while_unavailable.remove(&peer) {
                self.supporters.insert(peer);
                self.check_candidate_quorum(now);
            }
            match self.state {
                // Let a (re)connected peer discover us at once.
                ElectorState::Leader => {
                    self.send(peer, Kind::Heartbeat(LeaderHeartbeat { term: self.term.0 }))
                }
                // The leader dropped us from its supporters when the connection went down.
                ElectorState::Follower
                    if self.leader == Some(peer) && self.persisted_term >= self.term =>
                {
                    self.send(
                        peer,
                        Kind::ElectionResponse(ElectionResponse { term: self.term.0 }),
                    )
                }
                _ => {}
            }
            return;
        }
        self.unavailable.insert(peer);
        self.supporters.remove(&peer);
        self.support_while_unavailable.remove(&peer);
        if let Some(s) = self.scouting.as_mut() {
            s.supporters.remove(&peer);
        }
        match self.state {
            ElectorState::Follower if self.leader == Some(peer) => {
                let wait = self.successor_wait(peer);
                self.become_leaderless_follower(now, TransitionReason::LeaderUnavailable, wait);
            }
            ElectorState::Follower if self.tentative_leader == Some(peer) => {
                self.tentative_leader = None;
            }
            ElectorState::Leader => self.check_leader_quorum(now),
            _ => {}
        }
    }

    // ------------------------------------------------------------------ transitions

    fn start_scouting(&mut self, now: Instant) {
        if !self.may_stand() {
            return;
        }
        // A supported candidate that has not become leader by now (its election would have
        // ended) is given up: otherwise a successful scouting would raise the term but never
        // lead to a candidacy, round after round (found by the simulator, seed 22).
        self.tentative_leader = None;
        let term = self.term.next();
        if !self.scouting_enabled {
            // The article's algorithm before ElectionScouting: propose with `++selfTerm`.
            self.adopt_term(term);
            self.pending = Some(Pending::Candidacy { term });
            return;
        }
        self.counters.scoutings_started += 1;
        debug!(term = %term, "elector scouting");
        self.scouting = Some(Scouting {
            term,
            supporters: BTreeSet::new(),
            deadline: now + self.config.scouting_result_timeout,
        });
        self.broadcast(Kind::ScoutingRequest(ElectionScoutingRequest {
            term: term.0,
            membership_epoch: self.membership_epoch,
        }));
        self.check_scouting_quorum();
    }

    /// Scouting reached quorum: promise the term, and propose once it is on disk.
    fn check_scouting_quorum(&mut self) {
        let Some(s) = self.scouting.as_ref() else {
            return;
        };
        if self.voting_support(&s.supporters) < self.quorum() {
            return;
        }
        let term = s.term;
        self.scouting = None;
        // Scouting is cancelled whenever the term changes, so the proposed term is still next.
        assert_eq!(term, self.term.next(), "scouting for a stale term");
        self.adopt_term(term);
        self.pending = Some(Pending::Candidacy { term });
    }

    fn become_candidate(&mut self, now: Instant) {
        self.clear_role();
        self.state = ElectorState::Candidate;
        self.reason = TransitionReason::None;
        self.election_deadline = Some(now + self.config.election_result_timeout);
        self.counters.elections_started += 1;
        self.broadcast(Kind::Proposal(ElectionProposal {
            term: self.term.0,
            membership_epoch: self.membership_epoch,
        }));
        self.check_candidate_quorum(now);
    }

    fn check_candidate_quorum(&mut self, now: Instant) {
        if self.state == ElectorState::Candidate
            && self.voting_support(&self.supporters) >= self.quorum()
        {
            self.become_leader(now);
        }
    }

    fn become_leader(&mut self, now: Instant) {
        let supporters = std::mem::take(&mut self.supporters);
        let support_while_unavailable = std::mem::take(&mut self.support_while_unavailable);
        self.clear_role();
        self.supporters = supporters;
        self.support_while_unavailable = support_while_unavailable;
        self.state = ElectorState::Leader;
        self.reason = TransitionReason::None;
        self.counters.elections_won += 1;
        self.broadcast(Kind::Heartbeat(LeaderHeartbeat { term: self.term.0 }));
        self.heartbeat_at = Some(now + self.config.heartbeat_period);
    }

    fn check_leader_quorum(&mut self, now: Instant) {
        if self.state == ElectorState::Leader
            && self.voting_support(&self.supporters) < self.quorum()
        {
            self.step_down(now, TransitionReason::QuorumNotAchieved, None);
        }
    }

    /// Leader -> leaderless follower: broadcast `LeadershipCession` for the old term, then
    /// adopt `new_term` if given, then scout after a random wait.
    fn step_down(&mut self, now: Instant, reason: TransitionReason, new_term: Option<Term>) {
        self.broadcast(Kind::Cession(LeadershipCession { term: self.term.0 }));
        if let Some(term) = new_term {
            self.adopt_term(term);
        }
        let wait = self.random_wait();
        self.become_leaderless_follower(now, reason, wait);
    }

    fn become_leaderless_follower(
        &mut self,
        now: Instant,
        reason: TransitionReason,
        wait: Duration,
    ) {
        self.clear_role();
        self.state = ElectorState::Follower;
        self.reason = reason;
        self.scout_at = Some(now + wait);
    }

    /// Follow `leader` of `term` (`term >= self.term`); with `send_support`, send it an
    /// (unsolicited) `ElectionResponse`, after persisting the term if it is new.
    fn follow(
        &mut self,
        now: Instant,
        leader: NodeId,
        term: Term,
        reason: TransitionReason,
        send_support: bool,
    ) {
        self.clear_role();
        self.state = ElectorState::Follower;
        self.reason = reason;
        self.leader = Some(leader);
        self.last_heartbeat = Some(now);
        self.heartbeats_missed_reported = 0;
        self.heartbeat_check_at = Some(now + self.config.heartbeat_check_period);
        if term > self.term {
            self.adopt_term(term);
        }
        if send_support {
            if self.persisted_term >= term {
                self.send(
                    leader,
                    Kind::ElectionResponse(ElectionResponse { term: term.0 }),
                );
            } else {
                self.pending = Some(Pending::Support { to: leader, term });
            }
        }
    }

    fn check_heartbeat(&mut self, now: Instant, check_at: Instant) {
        let (Some(leader), Some(last)) = (self.leader, self.last_heartbeat) else {
            self.heartbeat_check_at = None;
            return;
        };
        let period = self.config.heartbeat_period;
        let silent = now.saturating_duration_since(last);
        let missed = (silent.as_nanos() / period.as_nanos()) as u64;
        if missed > self.heartbeats_missed_reported {
            self.counters.heartbeats_missed += missed - self.heartbeats_missed_reported;
            self.heartbeats_missed_reported = missed;
        }
        let leader_deadline = last + period * self.config.heartbeat_miss_count;
        if now >= leader_deadline {
            let wait = self.successor_wait(leader);
            self.become_leaderless_follower(now, TransitionReason::LeaderNoHeartbeat, wait);
            return;
        }
        let next = check_at + self.config.heartbeat_check_period;
        let next = if next > now {
            next
        } else {
            now + self.config.heartbeat_check_period
        };
        // The silent leader is dropped at its deadline itself, not at the first periodic check
        // after it (that cost up to one `heartbeat_check_period`, 50 ms by default).
        self.heartbeat_check_at = Some(next.min(leader_deadline));
    }

    /// Resets everything specific to a role; keeps term, persisted term and pending write.
    fn clear_role(&mut self) {
        self.leader = None;
        self.tentative_leader = None;
        self.scout_at = None;
        self.scouting = None;
        self.election_deadline = None;
        self.supporters.clear();
        self.support_while_unavailable.clear();
        self.last_heartbeat = None;
        self.heartbeats_missed_reported = 0;
        self.heartbeat_check_at = None;
        self.heartbeat_at = None;
    }

    /// Raises the term and asks for it to be persisted; whatever waited on a lower term is
    /// obsolete. Raft §5.1: terms only grow.
    fn adopt_term(&mut self, term: Term) {
        assert!(
            term > self.term,
            "elector term regressed: {} -> {term}",
            self.term
        );
        self.term = term;
        self.pending = None;
        self.scouting = None;
        self.outputs.push_back(ElectorOutput::PersistTerm { term });
    }

    // ------------------------------------------------------------------ helpers

    fn status_leader(&self) -> Option<NodeId> {
        match self.state {
            ElectorState::Leader => Some(self.self_id),
            ElectorState::Follower => self.leader,
            ElectorState::Candidate | ElectorState::Dormant => None,
        }
    }

    fn publish_status(&mut self) {
        let now = (
            self.state,
            self.term,
            self.status_leader(),
            self.tentative_leader,
        );
        if now != self.last_published {
            self.last_published = now;
            self.age += 1;
            self.outputs.push_back(ElectorOutput::StateChanged {
                status: self.status(),
            });
        }
    }

    /// The wait before scouting after losing `lost_leader`: drawn from this node's window in
    /// [`successor_wait_bounds`], ranked by node id among itself and its available voting peers
    /// other than the lost leader.
    fn successor_wait(&mut self, lost_leader: NodeId) -> Duration {
        let others: Vec<NodeId> = self
            .peers
            .iter()
            .copied()
            .filter(|p| *p != lost_leader && self.voters.contains(p) && self.is_available(*p))
            .collect();
        let rank = others.iter().filter(|p| **p < self.self_id).count();
        let (low, high) =
            successor_wait_bounds(rank, others.len() + 1, self.config.random_wait_max);
        let (low_ms, high_ms) = (low.as_millis() as u64, high.as_millis() as u64);
        if high_ms <= low_ms {
            return low;
        }
        Duration::from_millis(self.rng.gen_range(low_ms..=high_ms))
    }

    fn random_wait(&mut self) -> Duration {
        let max_ms = self.config.random_wait_max.as_millis() as u64;
        if max_ms == 0 {
            return Duration::ZERO;
        }
        Duration::from_millis(self.rng.gen_range(0..=max_ms))
    }

    fn is_available(&self, peer: NodeId) -> bool {
        !self.unavailable.contains(&peer)
    }

    fn send_heartbeat_response(&mut self, to: NodeId) {
        self.send(
            to,
            Kind::HeartbeatResponse(HeartbeatResponse { term: self.term.0 }),
        );
    }

    fn send(&mut self, to: NodeId, kind: Kind) {
        self.outputs.push_back(ElectorOutput::Send {
            to,
            message: message(kind),
        });
    }

    fn broadcast(&mut self, kind: Kind) {
        if !self.peers.is_empty() {
            self.outputs.push_back(ElectorOutput::Broadcast {
                message: message(kind),
            });
        }
    }

    fn drop_message(&mut self, from: NodeId, why: &'static str) {
        self.counters.messages_dropped += 1;
        debug!(from = %from, term = %self.term, state = self.state.as_str(), why, "elector message dropped");
    }
}
