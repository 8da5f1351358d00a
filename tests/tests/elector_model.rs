//! Exhaustive model checking of the REAL elector core (DESIGN.md §4) with `stateright`:
//! three (or, in the longer runs, four and five) [`Elector`]s — the production
//! `elector/src/core.rs`, not a re-implementation of its rules — explored in every interleaving
//! of message deliveries, timer firings, term writes, crashes, restarts, cessions and
//! membership changes, up to bounds.
//!
//! **The model.** A state holds the three cores (`None` while crashed), each node's durable term
//! and its term writes in flight, the network and the history the properties need. Actions,
//! each enabled whenever it applies:
//! - `Deliver` any message in the network to its running destination (it stays in the network:
//!   see below);
//! - `Timeout`: a node's [`Elector::handle_timeout`] at its [`Elector::poll_timeout`] deadline;
//! - `Persisted`: the oldest term write of a node completes ([`Elector::on_term_persisted`]), a
//!   separate action so that a crash between the `PersistTerm` request and its completion is
//!   explored;
//! - `Crash` (bounded; writes in flight are lost, the durable term survives) and `Restart` (a new
//!   core from the durable term only, like a new process). Peers learn of a crash or a restart
//!   at once ([`Elector::handle_peer_available`]), and a restarted core learns which peers are
//!   down;
//! - `Cede`: a leader's graceful hand-off ([`Elector::cede_leadership`], bounded).
//! - `Commit` and `Apply` (DESIGN.md §5a, where [`Bounds::changes`] is not empty): a leader
//!   commits the next voter set of the script and applies it at once; any other node applies
//!   committed sets later, one at a time, at any point ([`Elector::set_membership`]; a node's
//!   applied epoch survives its crashes, as the ledger does). A commit needs what the metadata
//!   leader's commit needs: a majority of the old voters and of the new ones following the
//!   leader in its term; and the metadata leader's rule: a majority of the current voters
//!   applied the current set. Every node stays a member, so a removed node that has not applied
//!   its removal keeps scouting and voting with its old set.
//!
//! **Properties** (`always`), checked in every reachable state:
//! - *election safety*: never two leaders in one term, over the whole history — every
//!   `(term, leader)` ever published is kept in the state (Raft §5.2);
//! - *single vote*: a node supports at most one candidate per term, itself included, across
//!   restarts; an `ElectionResponse` to the already elected leader of the term is a follow
//!   acknowledgment (DESIGN.md §4, "unsolicited ElectionResponse"), not a vote;
//! - *terms never go back*: within one incarnation a node's term never decreases, its durable
//!   term never decreases, and a node restarts with a term at least as high as every term it
//!   voted or proposed in. A term adopted but not yet on disk may be forgotten by a crash (the
//!   node restarts below it): by design, since the node never voted in it;
//! - *persist before vote*: a vote or a candidacy for term T only happens with T on disk;
//! - *no core panic*: the core's own assertions (a term going back, a term persisted that was
//!   not asked for, ...) never fail; a panic ends the path and becomes its counterexample.
//!
//! And `sometimes`, so that the model is shown not to be vacuous (each only where the bounds
//! make it reachable): a leader is elected; leaders are elected in two different terms; after a
//! crash and a restart, all nodes are up and one leads.
//!
//! **Making the state space finite, and small enough.** Measured on terms up to 1 without
//! crashes: 8.7 million states when every message sent is kept, 15 thousand once the messages
//! that can no longer change anything are dropped (below), with the same node behaviours.
//! - Time: every node has its own virtual clock that only its own timers move (jumping to its
//!   `poll_timeout()` deadline); message handling does not advance it. The clock is not part of
//!   the state's identity: [`Elector::hash_behaviour`] hashes the core's instants relative to
//!   it, and with every timing equal to one [`TICK`] the offsets take a few values. Clocks are
//!   otherwise unrelated, so any relative speed of nodes is explored: a fully asynchronous
//!   model, right for safety (which must not depend on timing), not for liveness.
//! - Randomness: `random_wait_max = 0` and `initial_wait = 0`, so the core's RNG is never drawn
//!   from; random waits only spread events in time, and the model explores every order anyway.
//! - Network: the set of every message ever sent, `(from, to, message)` once each; delivering a
//!   message does not remove it. So every message may be delivered any number of times
//!   (unbounded duplication), late (reordering) or never (loss): every behaviour of a network
//!   that loses, duplicates and reorders, with no budget. Messages survive crashes and may reach
//!   a restarted node, which TCP would not allow.
//! - Messages that cannot change anything any more are not kept (each case relies on one rule of
//!   the core, named in [`is_dead`] and [`ElectorModel::send`]): `will_vote = false` answers
//!   (the core only counts `true`); messages for a term above the bound (they could only lead
//!   above it); and stale messages that the receiver, whose term can no longer go below its
//!   durable term, will drop whatever happens.
//! - Terms: an action that would raise any node's term above `max_term` is not explored.
//! - Crashes and cessions have budgets in the state; [`Start::StableLeader`] starts from a
//!   clean first election so that the term budget is spent on a leader's loss.
//!
//! **Abstracted away**: real time and timing bounds (liveness is the simulator's job,
//! `elector_sim.rs`); more than three nodes in CI; the metadata's own replication (the commit
//! is one step; the metadata simulator checks the ledger); connection drops without a crash (a cut link is
//! modelled by messages never delivered), and delays before a node learns of a crash or a
//! restart; runtime quorum changes (`set_quorum`); a heartbeat check so late that two of a
//! node's deadlines fire in one `handle_timeout` call (the core arms one deadline at a time).
//!
//! Negative tests show that the checker finds real counterexamples: a quorum of one on three
//! nodes, and restarts that forget the durable term (BlazingMQ's behaviour, which DESIGN.md §4
//! goes beyond), both elect two leaders in one term; so do membership changes without the
//! metadata leader's applied-by-a-majority rule, and voters without the epoch check
//! ([`Elector::set_membership_check`]), on {1,2,3} -> {1,2} -> {1}.
//!
//! CI runs [`COLD_CI`] and [`STABLE_CI`] in debug mode; `scripts/soak-sim.sh elector` runs the
//! `#[ignore]`d [`COLD_LARGER`] and [`STABLE_LARGER`] in release mode (`BMQ_MODEL_MAX_TERM`,
//! `BMQ_MODEL_CRASHES`, `BMQ_MODEL_CESSIONS`, `BMQ_MODEL_MISS_COUNT` change their bounds). Each
//! run prints its bounds and the states explored; figures are in docs/ELECTOR_VERIFICATION.md.
//! The search is depth first (a stack, not a frontier, in memory); a counterexample is printed
//! action by action with its last state, and `BMQ_MODEL_BFS=1` searches breadth first for the
//! shortest one.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bmq_elector::{Elector, ElectorConfig, ElectorOutput, ElectorState, Membership};
use bmq_proto::peer::elector_message::Kind;
use bmq_proto::peer::{
    ElectionProposal, ElectionResponse, ElectionScoutingRequest, ElectionScoutingResponse,
    ElectorMessage, ElectorNodeStatus, HeartbeatResponse, LeaderHeartbeat, LeadershipCession,
};
use bmq_proto::{NodeId, Term};
use stateright::{Checker, Expectation, HasDiscoveries, Model, Path, Property};

/// The voters of the models without membership changes.
const THREE_VOTERS: &[u32] = &[1, 2, 3];
/// Every timing of the model's elector config. The core arms one deadline at a time, so their
/// values only matter to the heartbeat check (how long since the last heartbeat).
const TICK: Duration = Duration::from_millis(100);

const ELECTION_SAFETY: &str =
    "election safety: at most one leader per term, over the whole history";
const SINGLE_VOTE: &str = "single vote: a node supports at most one candidate per term";
const TERMS_NEVER_GO_BACK: &str =
    "terms never go back: live term, durable term, restart above every term voted in";
const PERSIST_BEFORE_VOTE: &str = "persist before vote: a vote or candidacy for T with T on disk";
const NO_CORE_PANIC: &str = "the core never panics: its assertions hold";
const LEADER_ELECTED: &str = "a leader is elected";
const LEADERS_IN_TWO_TERMS: &str = "leaders are elected in two different terms";
const LEADER_AFTER_RESTART: &str = "after a crash and a restart, all nodes are up and one leads";
const LEADER_OF_LAST_MEMBERSHIP: &str =
    "every membership change committed, and a node that applied them all leads";

/// Where the exploration starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// Every node just started, term 0, nothing on disk.
    Cold,
    /// Node 1 leads term 1, followed by nodes 2 and 3, all with term 1 on disk: the state
    /// after a clean first election (reached from `Cold` by [`stable_election`]), so that the
    /// term budget is spent on what follows a leader's loss.
    StableLeader,
}

/// How far the exploration goes.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    start: Start,
    /// No action may raise a node's term above this.
    max_term: u64,
    /// Crashes over the whole run (a crashed node may always restart).
    crashes: u8,
    /// Graceful leadership cessions.
    cessions: u8,
    /// The config's `heartbeat_miss_count`: 1 drops the leader at the first check after a
    /// silent period; 2 also explores a check that keeps the leader.
    heartbeat_miss_count: u32,
    /// Nodes in the model: `1..=nodes` (3 unless membership changes need more).
    nodes: u32,
    /// The voters at the start (membership epoch 0), node 1 and 2 among them; the other nodes
    /// start as learners (members that do not vote).
    initial: &'static [u32],
    /// The voter sets that membership changes commit, in order (empty: no change). Each is
    /// one server away from the one before (Raft dissertation §4.1).
    changes: &'static [&'static [u32]],
    /// Steps explored from the initial state (0: no bound). With a bound the search is
    /// breadth first, so that every state within that many steps is checked (a depth-first
    /// search would mark a state seen at a deep level and skip it at a shallower one).
    max_depth: usize,
}

/// CI, from a cold start: the first election under every interleaving, with crashes at any
/// point (between a term write request and its completion too) and a cession.
const COLD_CI: Bounds = Bounds {
    start: Start::Cold,
    max_term: 1,
    crashes: 2,
    cessions: 1,
    heartbeat_miss_count: 2,
    nodes: 3,
    initial: THREE_VOTERS,
    changes: &[],
    max_depth: 0,
};

/// CI, from a stable leader: its loss (silence, crash or cession) and the election of term 2.
const STABLE_CI: Bounds = Bounds {
    start: Start::StableLeader,
    max_term: 2,
    crashes: 1,
    cessions: 1,
    heartbeat_miss_count: 1,
    nodes: 3,
    initial: THREE_VOTERS,
    changes: &[],
    max_depth: 0,
};

/// `#[ignore]`d, release build (`scripts/soak-sim.sh elector`): two terms from a cold start,
/// contention for the first election included, with a crash.
const COLD_LARGER: Bounds = Bounds {
    start: Start::Cold,
    max_term: 2,
    crashes: 1,
    cessions: 0,
    heartbeat_miss_count: 1,
    nodes: 3,
    initial: THREE_VOTERS,
    changes: &[],
    max_depth: 0,
};

/// `#[ignore]`d, release build: two more terms after a stable leader, with a crash.
const STABLE_LARGER: Bounds = Bounds {
    start: Start::StableLeader,
    max_term: 3,
    crashes: 1,
    cessions: 0,
    heartbeat_miss_count: 1,
    nodes: 3,
    initial: THREE_VOTERS,
    changes: &[],
    max_depth: 0,
};

/// CI, membership: from a stable leader of {1,2,3} (terms up to 2, one cession), two
/// removals, {1,2,3} -> {1,2} -> {1}:
/// the first and last sets are two changes apart and have disjoint majorities ({2,3} and
/// {1}), the smallest cluster where one membership can elect a leader beside another. Changes
/// commit and nodes apply them at any point, with the terms, crashes and cessions around
/// them; a removed node keeps exchanging messages (it may not have applied its removal).
const SHRINK_CI: Bounds = Bounds {
    start: Start::StableLeader,
    max_term: 2,
    crashes: 0,
    cessions: 1,
    heartbeat_miss_count: 1,
    nodes: 3,
    initial: THREE_VOTERS,
    changes: &[&[1, 2], &[1]],
    max_depth: 0,
};

/// CI, membership: from a stable leader of {1,2} with node 3 a learner (terms up to 2, one
/// crash), node 3 added and the leader removed, {1,2} -> {1,2,3} -> {2,3}.
const ADD_REMOVE_CI: Bounds = Bounds {
    start: Start::StableLeader,
    max_term: 2,
    crashes: 1,
    cessions: 0,
    heartbeat_miss_count: 1,
    nodes: 3,
    initial: &[1, 2],
    changes: &[&[1, 2, 3], &[2, 3]],
    max_depth: 0,
};

/// `#[ignore]`d, release build: from a stable leader of {1,2,3} with node 4 a learner, node 4
/// is added and node 1 (the leader) removed, {1,2,3} -> {1,2,3,4} -> {2,3,4} ({1,2} and {3,4}
/// are disjoint majorities of the first and last sets).
const CHANGE_LARGER: Bounds = Bounds {
    start: Start::StableLeader,
    max_term: 2,
    crashes: 0,
    cessions: 0,
    heartbeat_miss_count: 1,
    nodes: 4,
    initial: THREE_VOTERS,
    changes: &[&[1, 2, 3, 4], &[2, 3, 4]],
    max_depth: 0,
};

/// `#[ignore]`d, release build: growth {1,2,3} -> {1,2,3,4} -> {1,2,3,4,5} with nodes 4 and 5
/// learners at first ({1,2} and {3,4,5} are disjoint majorities of the first and last sets).
const GROW_LARGER: Bounds = Bounds {
    start: Start::StableLeader,
    max_term: 2,
    crashes: 0,
    cessions: 0,
    heartbeat_miss_count: 1,
    nodes: 5,
    initial: THREE_VOTERS,
    changes: &[&[1, 2, 3, 4], &[1, 2, 3, 4, 5]],
    max_depth: 0,
};

/// CI, membership on four nodes: [`CHANGE_LARGER`] ({1,2,3} -> {1,2,3,4} -> {2,3,4}, the
/// leader removed) explored exhaustively to a bounded number of steps (`BMQ_MODEL_MAX_DEPTH`
/// overrides): both changes committed and applied in every order with the messages and
/// timeouts around them (the election after the leader's removal lies deeper: the
/// three-node [`ADD_REMOVE_CI`] explores it whole).
const CHANGE_CI: Bounds = Bounds {
    max_depth: 12,
    ..CHANGE_LARGER
};

/// CI, growth on five nodes: [`GROW_LARGER`] ({1,2,3} -> {1,2,3,4} -> {1,2,3,4,5}) explored
/// exhaustively to a bounded number of steps, as [`CHANGE_CI`].
const GROW_CI: Bounds = Bounds {
    max_depth: 11,
    ..GROW_LARGER
};

/// What a restarted node starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RestartFrom {
    /// The term on disk (DESIGN.md §4: persisted before any vote or candidacy).
    PersistedTerm,
    /// Term 0, as if the elector term were not persisted (BlazingMQ restarts from the ledger's
    /// last term, here an empty ledger): for the negative test only.
    TermZero,
}

/// An elector message as it travels in the model's network: the wire message in a form that
/// can be ordered (for the set of in-flight messages) and read in a counterexample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Wire {
    ScoutingRequest { term: u64, epoch: u64 },
    ScoutingResponse { term: u64, will_vote: bool },
    Proposal { term: u64, epoch: u64 },
    ElectionResponse { term: u64 },
    Heartbeat { term: u64 },
    HeartbeatResponse { term: u64 },
    Cession { term: u64 },
    NodeStatus { term: u64, available: bool },
}

impl Wire {
    fn term(self) -> u64 {
        match self {
            Wire::ScoutingRequest { term, .. }
            | Wire::ScoutingResponse { term, .. }
            | Wire::Proposal { term, .. }
            | Wire::ElectionResponse { term }
            | Wire::Heartbeat { term }
            | Wire::HeartbeatResponse { term }
            | Wire::Cession { term }
            | Wire::NodeStatus { term, .. } => term,
        }
    }

    fn from_message(message: ElectorMessage) -> Wire {
        match message.kind.expect("the core never sends an empty message") {
            Kind::ScoutingRequest(m) => Wire::ScoutingRequest {
                term: m.term,
                epoch: m.membership_epoch,
            },
            Kind::ScoutingResponse(m) => Wire::ScoutingResponse {
                term: m.term,
                will_vote: m.will_vote,
            },
            Kind::Proposal(m) => Wire::Proposal {
                term: m.term,
                epoch: m.membership_epoch,
            },
            Kind::ElectionResponse(m) => Wire::ElectionResponse { term: m.term },
            Kind::Heartbeat(m) => Wire::Heartbeat { term: m.term },
            Kind::HeartbeatResponse(m) => Wire::HeartbeatResponse { term: m.term },
            Kind::Cession(m) => Wire::Cession { term: m.term },
            Kind::NodeStatus(m) => Wire::NodeStatus {
                term: m.term,
                available: m.available,
            },
        }
    }

    fn to_message(self) -> ElectorMessage {
        let kind = match self {
            Wire::ScoutingRequest { term, epoch } => {
                Kind::ScoutingRequest(ElectionScoutingRequest {
                    term,
                    membership_epoch: epoch,
                })
            }
            Wire::ScoutingResponse { term, will_vote } => {
                Kind::ScoutingResponse(ElectionScoutingResponse { term, will_vote })
            }
            Wire::Proposal { term, epoch } => Kind::Proposal(ElectionProposal {
                term,
                membership_epoch: epoch,
            }),
            Wire::ElectionResponse { term } => Kind::ElectionResponse(ElectionResponse { term }),
            Wire::Heartbeat { term } => Kind::Heartbeat(LeaderHeartbeat { term }),
            Wire::HeartbeatResponse { term } => Kind::HeartbeatResponse(HeartbeatResponse { term }),
            Wire::Cession { term } => Kind::Cession(LeadershipCession { term }),
            Wire::NodeStatus { term, available } => {
                Kind::NodeStatus(ElectorNodeStatus { term, available })
            }
        };
        ElectorMessage { kind: Some(kind) }
    }
}

/// One message in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Envelope {
    from: NodeId,
    to: NodeId,
    message: Wire,
}

/// One node: its core while running, and what survives it.
#[derive(Clone)]
struct NodeModel {
    id: NodeId,
    /// `None` while crashed. Shared between states until an action changes it.
    core: Option<Arc<Elector>>,
    /// This node's virtual clock: only its own timers move it. Not part of the state's
    /// identity (the core's instants are hashed relative to it).
    now: Instant,
    /// [`Elector::hash_behaviour`] of `core` at `now`, kept up to date by
    /// [`ClusterState::refresh_fingerprints`]: the state's hash uses it instead of hashing
    /// three cores again for every state generated.
    fingerprint: u64,
    /// The term on disk: what survives a crash.
    durable: Term,
    /// Term writes requested and not yet completed, oldest first (they complete in order).
    writes: Vec<Term>,
    /// Membership changes this node has applied (its ledger's committed state: survives a
    /// crash, and a restarted core starts from it).
    applied: u8,
}

impl NodeModel {
    fn term(&self) -> Option<Term> {
        self.core.as_ref().map(|core| core.status().term)
    }

    /// The running core, for an input (cloned first if another state shares it).
    fn core_mut(&mut self) -> Option<&mut Elector> {
        self.core.as_mut().map(Arc::make_mut)
    }

    /// Feeds the core's behaviour (or its absence) to `state`.
    fn hash_core<H: Hasher>(&self, state: &mut H) {
        match &self.core {
            Some(core) => {
                true.hash(state);
                core.hash_behaviour(self.now, state);
            }
            None => false.hash(state),
        }
    }

    fn compute_fingerprint(&self) -> u64 {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.hash_core(&mut hasher);
        hasher.finish()
    }
}

/// A state of the model: the nodes, the network and the history the properties need.
#[derive(Clone)]
struct ClusterState {
    nodes: Vec<NodeModel>,
    /// Every message sent that can still change something, sorted, once each (a set that is
    /// cheap to clone and hash); delivering one does not remove it (module documentation).
    network: Vec<Envelope>,
    /// Every `(term, node)` ever published as Leader.
    leaders: BTreeSet<(Term, NodeId)>,
    /// Every vote ever cast: `(voter, term, candidate)`; a candidacy is a vote for oneself.
    votes: BTreeSet<(NodeId, Term, NodeId)>,
    /// Term regressions seen on transitions (empty unless a property fails).
    term_regressions: Vec<String>,
    /// Votes or candidacies made without the term on disk (empty unless a property fails).
    unpersisted_votes: Vec<String>,
    /// Panics of a core (a failed assertion), with the action (empty unless a property fails).
    core_panics: Vec<String>,
    crashes_left: u8,
    cessions_left: u8,
    /// Membership changes of [`Bounds::changes`] committed so far (the committed epoch).
    committed: u8,
}

impl ClusterState {
    fn node(&self, id: NodeId) -> &NodeModel {
        &self.nodes[(id.0 - 1) as usize]
    }

    fn node_mut(&mut self, id: NodeId) -> &mut NodeModel {
        &mut self.nodes[(id.0 - 1) as usize]
    }

    fn is_up(&self, id: NodeId) -> bool {
        self.node(id).core.is_some()
    }

    /// Recomputes the fingerprint of every node whose core or clock differs from `last`.
    fn refresh_fingerprints(&mut self, last: Option<&ClusterState>) {
        for (i, node) in self.nodes.iter_mut().enumerate() {
            let unchanged = last.is_some_and(|last| {
                let before = &last.nodes[i];
                before.now == node.now
                    && match (&before.core, &node.core) {
                        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                        (None, None) => true,
                        _ => false,
                    }
            });
            if !unchanged {
                node.fingerprint = node.compute_fingerprint();
            }
        }
    }

    /// Feeds everything that determines the future of the exploration to `state`: each core
    /// through its fingerprint, or (`exact`) through [`Elector::hash_behaviour`] itself.
    fn hash_identity<H: Hasher>(&self, state: &mut H, exact: bool) {
        for node in &self.nodes {
            node.id.hash(state);
            if exact {
                node.hash_core(state);
            } else {
                node.fingerprint.hash(state);
            }
            node.durable.hash(state);
            node.writes.hash(state);
            node.applied.hash(state);
        }
        self.network.hash(state);
        self.leaders.hash(state);
        self.votes.hash(state);
        self.term_regressions.hash(state);
        self.unpersisted_votes.hash(state);
        self.core_panics.hash(state);
        self.crashes_left.hash(state);
        self.cessions_left.hash(state);
        self.committed.hash(state);
    }

    /// Records that `voter` supported `candidate` in `term` (an `ElectionResponse`, or its own
    /// candidacy), checking that the term is on disk.
    fn record_vote(&mut self, voter: NodeId, term: Term, candidate: NodeId) {
        if voter != candidate && self.leaders.contains(&(term, candidate)) {
            return; // acknowledging the elected leader of the term, not a vote
        }
        let durable = self.node(voter).durable;
        if durable < term {
            self.unpersisted_votes.push(format!(
                "{voter} supports {candidate} in term {term} with only term {durable} on disk"
            ));
        }
        self.votes.insert((voter, term, candidate));
    }
}

/// Hashes what determines the future of the exploration (cores relative to their node's
/// clock, by their fingerprints).
impl Hash for ClusterState {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.hash_identity(state, false);
    }
}

/// A hasher that keeps every byte it is fed: equal byte streams mean equal states.
#[derive(Default)]
struct Recorder(Vec<u8>);

impl Hasher for Recorder {
    fn finish(&self) -> u64 {
        0
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
}

/// Two states are equal when they hash the same bytes (the checker itself only compares
/// fingerprints; this serves path reconstruction).
impl PartialEq for ClusterState {
    fn eq(&self, other: &Self) -> bool {
        let (mut a, mut b) = (Recorder::default(), Recorder::default());
        self.hash_identity(&mut a, true);
        other.hash_identity(&mut b, true);
        a.0 == b.0
    }
}

/// A compact view for counterexamples: one line per node, then the network and the history.
impl fmt::Debug for ClusterState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f)?;
        for node in &self.nodes {
            match &node.core {
                Some(core) => {
                    let s = core.status();
                    writeln!(
                        f,
                        "  {}: {:?} term {} leader {:?} tentative {:?} reason {:?}; durable {}, \
                         writes {:?}, epoch {} voters {:?}",
                        node.id,
                        s.state,
                        s.term,
                        s.leader.map(|l| l.0),
                        s.tentative_leader.map(|l| l.0),
                        s.reason,
                        node.durable,
                        node.writes.iter().map(|t| t.0).collect::<Vec<_>>(),
                        node.applied,
                        core.voters().iter().map(|v| v.0).collect::<Vec<_>>()
                    )?;
                }
                None => writeln!(
                    f,
                    "  {}: crashed; durable {}, epoch {}",
                    node.id, node.durable, node.applied
                )?,
            }
        }
        for e in &self.network {
            writeln!(f, "  network {} -> {}: {:?}", e.from, e.to, e.message)?;
        }
        let leaders: Vec<_> = self.leaders.iter().map(|(t, n)| (t.0, n.0)).collect();
        let votes: Vec<_> = self.votes.iter().map(|(v, t, c)| (v.0, t.0, c.0)).collect();
        writeln!(f, "  leaders (term, node): {leaders:?}")?;
        writeln!(f, "  votes (voter, term, candidate): {votes:?}")?;
        let violations = self.term_regressions.iter().chain(&self.unpersisted_votes);
        for v in violations.chain(&self.core_panics) {
            writeln!(f, "  VIOLATION: {v}")?;
        }
        write!(
            f,
            "  committed epoch {}; budgets: crashes {}, cessions {}",
            self.committed, self.crashes_left, self.cessions_left
        )
    }
}

/// One step of the model.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Action {
    /// Deliver a message (once more: it stays in the network).
    Deliver(Envelope),
    /// The node's earliest deadline fires.
    Timeout(NodeId),
    /// The node's oldest term write completes.
    Persisted(NodeId),
    Crash(NodeId),
    Restart(NodeId),
    /// The leader cedes leadership.
    Cede(NodeId),
    /// The node, a leader that has applied every committed change, commits the next change of
    /// [`Bounds::changes`] and applies it: the metadata leader, abstracted to what its commit
    /// needs, a majority of the old voters and of the new ones following it in its term
    /// (followers only accept the records of the leader they follow, in its term).
    Commit(NodeId),
    /// The node applies the next committed membership change it has not applied
    /// ([`Elector::set_membership`]).
    Apply(NodeId),
}

/// Tells a running core that `peer`'s connection went up or down.
fn tell_availability(node: &mut NodeModel, peer: NodeId, available: bool) {
    let now = node.now;
    if let Some(core) = node.core_mut() {
        core.handle_peer_available(now, peer, available);
    }
}

/// Whether a message in the network can no longer change anything, whatever happens next, so that
/// keeping it would only multiply states. Relies on the durable term never decreasing and a
/// restart resuming from it (so a node's term stays at or above its durable term), and on the
/// core's rule that a message with a term below the receiver's is dropped, except a heartbeat
/// or a scouting request, which are answered (DESIGN.md §4):
/// - a scouting request for `t` only produces answers to its sender, and a scouting answer for
///   `t` only counts in its receiver's scouting for `t`, always for its term + 1: dead once
///   the scouting node's durable term is `t` or more;
/// - a proposal for `t` is supported only above the receiver's term: dead once the receiver's
///   durable term is `t` or more;
/// - an election response, a cession or a heartbeat response for `t` only acts on a receiver
///   whose term is `t` (a heartbeat response: below `t`): dead once the receiver's durable term
///   is above `t`.
fn is_dead(s: &ClusterState, e: &Envelope) -> bool {
    let durable = |id: NodeId| s.node(id).durable.0;
    match e.message {
        Wire::ScoutingRequest { term, .. } => term <= durable(e.from),
        Wire::ScoutingResponse { term, .. } | Wire::Proposal { term, .. } => term <= durable(e.to),
        Wire::ElectionResponse { term }
        | Wire::Cession { term }
        | Wire::HeartbeatResponse { term } => term < durable(e.to),
        Wire::Heartbeat { .. } | Wire::NodeStatus { .. } => false,
    }
}

/// Three real elector cores under an adversarial scheduler.
struct ElectorModel {
    bounds: Bounds,
    /// The config's quorum (`0` = majority).
    quorum: usize,
    restart_from: RestartFrom,
    /// Every node's clock starts here.
    base: Instant,
    /// The metadata leader's rule (DESIGN.md §5a): a change is committed only once a majority
    /// of the current voters have applied the change before it. `false` for a negative test.
    applied_by_majority_first: bool,
    /// The cores' refusal of a candidate of an older membership epoch
    /// ([`Elector::set_membership_check`]). `false` for a negative test.
    epoch_check: bool,
}

impl ElectorModel {
    fn new(bounds: Bounds) -> ElectorModel {
        ElectorModel {
            bounds,
            quorum: 0,
            restart_from: RestartFrom::PersistedTerm,
            base: Instant::now(),
            applied_by_majority_first: true,
            epoch_check: true,
        }
    }

    fn ids(&self) -> impl Iterator<Item = NodeId> {
        (1..=self.bounds.nodes).map(NodeId)
    }

    /// The membership after `epoch` changes: every node a member, the voters of that epoch.
    fn membership(&self, epoch: u8) -> Membership {
        let voters = match epoch {
            0 => self.bounds.initial,
            e => self.bounds.changes[usize::from(e) - 1],
        };
        Membership {
            epoch: u64::from(epoch),
            members: self.ids().collect(),
            voters: voters.iter().copied().map(NodeId).collect(),
        }
    }

    fn config(&self) -> ElectorConfig {
        ElectorConfig {
            initial_wait: Duration::ZERO,
            random_wait_max: Duration::ZERO,
            scouting_result_timeout: TICK,
            election_result_timeout: TICK,
            heartbeat_period: TICK,
            heartbeat_check_period: TICK,
            heartbeat_miss_count: self.bounds.heartbeat_miss_count,
            quorum: self.quorum,
        }
    }

    /// A started core for `id` with `term` and the membership after `applied` changes, as a
    /// (re)started process has it.
    fn boot(&self, id: NodeId, term: Term, applied: u8, now: Instant) -> Elector {
        let peers: Vec<NodeId> = self.ids().filter(|p| *p != id).collect();
        // The seed is irrelevant (no random wait is ever drawn) but fixed, so that a restarted
        // core is the same state as a fresh one.
        let mut core = Elector::new(id, &peers, self.config(), term, u64::from(id.0));
        core.set_membership_check(self.epoch_check);
        core.set_membership(now, self.membership(applied));
        core.start(now);
        core
    }

    /// Executes every output of every core: messages into the network, term writes into the
    /// node's queue, published statuses into the history.
    ///
    /// Only cores that changed since `last` can have outputs: the others, still shared with
    /// `last`, were drained there.
    fn drain(&self, s: &mut ClusterState, last: Option<&ClusterState>) {
        for id in self.ids() {
            let shared = |last: &ClusterState| match (&last.node(id).core, &s.node(id).core) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            };
            if last.is_some_and(shared) {
                continue;
            }
            while let Some(output) = s
                .node_mut(id)
                .core_mut()
                .and_then(|core| core.poll_output())
            {
                match output {
                    ElectorOutput::Send { to, message } => {
                        let message = Wire::from_message(message);
                        if let Wire::ElectionResponse { term } = message {
                            s.record_vote(id, Term(term), to);
                        }
                        self.send(
                            s,
                            Envelope {
                                from: id,
                                to,
                                message,
                            },
                        );
                    }
                    ElectorOutput::Broadcast { message } => {
                        let message = Wire::from_message(message);
                        for to in self.ids().filter(|to| *to != id) {
                            self.send(
                                s,
                                Envelope {
                                    from: id,
                                    to,
                                    message,
                                },
                            );
                        }
                    }
                    ElectorOutput::PersistTerm { term } => s.node_mut(id).writes.push(term),
                    ElectorOutput::StateChanged { status } => match status.state {
                        ElectorState::Candidate => s.record_vote(id, status.term, id),
                        ElectorState::Leader => {
                            // A leader was a candidate of its term, possibly for no time at all
                            // (a quorum reached within one input).
                            s.record_vote(id, status.term, id);
                            s.leaders.insert((status.term, id));
                        }
                        ElectorState::Follower | ElectorState::Dormant => {}
                    },
                }
            }
        }
    }

    /// Puts a message into the network, except two kinds that cannot change anything:
    /// a `will_vote = false` scouting answer (the core only counts `will_vote = true`), and a
    /// message for a term above the bound: a scouting request for `max_term + 1` or its answer,
    /// whose only possible effect is a term above the bound (with a quorum of at most two, one
    /// `will_vote = true` completes the scouting).
    fn send(&self, s: &mut ClusterState, envelope: Envelope) {
        if let Wire::ScoutingResponse {
            will_vote: false, ..
        } = envelope.message
        {
            return;
        }
        if envelope.message.term() <= self.bounds.max_term {
            if let Err(at) = s.network.binary_search(&envelope) {
                s.network.insert(at, envelope);
            }
        }
    }

    fn deliver(&self, s: &mut ClusterState, envelope: Envelope) {
        let node = s.node_mut(envelope.to);
        let now = node.now;
        let core = node.core_mut().expect("delivered only to a running node");
        core.handle_message(now, envelope.from, envelope.message.to_message());
    }

    /// Runs the checker on all available threads and prints the bounds, the states explored
    /// and the wall time. Breadth-first search finds the shortest counterexamples but keeps a
    /// whole frontier of states in memory; depth-first search keeps only a stack.
    fn check(self, label: &str, search: Search, finish_when: HasDiscoveries) -> Outcome {
        let bounds = self.bounds;
        let (quorum, restart_from) = (self.quorum, self.restart_from);
        // `send` drops scouting answers above the term bound, which assumes that one answer
        // completes a scouting.
        assert!(quorum <= 2, "the model assumes a quorum of at most two");
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let properties: Vec<(&'static str, bool)> = self
            .properties()
            .iter()
            .map(|p| (p.name, p.expectation == Expectation::Always))
            .collect();
        let search = match std::env::var_os("BMQ_MODEL_BFS") {
            Some(_) => Search::BreadthFirst,
            None if bounds.max_depth > 0 => Search::BreadthFirst,
            None => search,
        };
        let started = Instant::now();
        let mut builder = self.checker().threads(threads).finish_when(finish_when);
        if bounds.max_depth > 0 {
            builder = builder.target_max_depth(bounds.max_depth);
        }
        let outcome = match search {
            Search::BreadthFirst => Outcome::of(builder.spawn_bfs().join(), properties),
            Search::DepthFirst => Outcome::of(builder.spawn_dfs().join(), properties),
        };
        println!(
            "elector_model {label}: {bounds:?}, quorum setting {quorum}, \
             restart from {restart_from:?}, {search:?}: {} unique states ({} generated), \
             max depth {}, {threads} threads, {:.1?} wall",
            outcome.unique_states,
            outcome.generated_states,
            outcome.max_depth,
            started.elapsed()
        );
        outcome
    }
}

/// How the checker walks the state graph.
#[derive(Debug, Clone, Copy)]
enum Search {
    BreadthFirst,
    DepthFirst,
}

/// What a finished check found.
struct Outcome {
    unique_states: usize,
    generated_states: usize,
    max_depth: usize,
    /// Whether the whole bounded state space was explored (no early stop).
    done: bool,
    /// The model's properties: name, and whether it is an `always` (else `sometimes`).
    properties: Vec<(&'static str, bool)>,
    /// Property name to the path that discovered it: a counterexample for `always`, an example
    /// for `sometimes`.
    discoveries: HashMap<&'static str, Path<ClusterState, Action>>,
}

impl Outcome {
    fn of(checker: impl Checker<ElectorModel>, properties: Vec<(&'static str, bool)>) -> Outcome {
        Outcome {
            unique_states: checker.unique_state_count(),
            generated_states: checker.state_count(),
            max_depth: checker.max_depth(),
            done: checker.is_done(),
            properties,
            discoveries: checker.discoveries(),
        }
    }

    /// Every `always` property holds and every `sometimes` property is reached; a failure
    /// prints the counterexample, action by action, and its last state.
    fn assert_safe(self) {
        self.assert_holds(true);
    }

    /// [`Outcome::assert_safe`], or with `reached == false` the `always` properties only: for
    /// a depth bound too short for the behaviours the `sometimes` properties ask for.
    fn assert_holds(mut self, reached: bool) {
        assert!(self.done, "the exploration stopped early");
        let mut violated = Vec::new();
        let mut never_reached = Vec::new();
        for (property, always) in std::mem::take(&mut self.properties) {
            match (always, self.discoveries.remove(property)) {
                (true, Some(path)) => {
                    print_path(property, path);
                    violated.push(property);
                }
                (false, None) if reached => never_reached.push(property),
                (true, None) | (false, _) => {}
            }
        }
        assert!(
            violated.is_empty(),
            "properties violated (counterexamples above; BMQ_MODEL_BFS=1 finds the shortest): \
             {violated:?}"
        );
        assert!(
            never_reached.is_empty(),
            "never reached, the model is vacuous within these bounds: {never_reached:?}"
        );
    }
}

impl ElectorModel {
    /// The initial state of [`Bounds::start`].
    fn initial_states(&self) -> Vec<ClusterState> {
        let mut state = self.cold_state();
        if self.bounds.start == Start::StableLeader {
            for action in stable_election(self.bounds.nodes) {
                let what = format!("{action:?}");
                state = self
                    .next_state(&state, action)
                    .unwrap_or_else(|| panic!("the scripted election cannot take {what}"));
            }
            let status: Vec<_> = state
                .nodes
                .iter()
                .map(|n| {
                    let s = n.core.as_ref().expect("all up").status();
                    (s.state, s.term.0, s.leader.map(|l| l.0), n.durable.0)
                })
                .collect();
            let expected: Vec<_> = self
                .ids()
                .map(|id| match id.0 {
                    1 => (ElectorState::Leader, 1, Some(1), 1),
                    _ => (ElectorState::Follower, 1, Some(1), 1),
                })
                .collect();
            assert_eq!(
                status, expected,
                "the scripted election must end with node 1 leading term 1"
            );
        }
        vec![state]
    }

    /// Every node started with term 0, nothing on disk, nothing in flight.
    fn cold_state(&self) -> ClusterState {
        let nodes = self
            .ids()
            .map(|id| NodeModel {
                id,
                core: Some(Arc::new(self.boot(id, Term(0), 0, self.base))),
                fingerprint: 0,
                now: self.base,
                durable: Term(0),
                writes: Vec::new(),
                applied: 0,
            })
            .collect();
        let mut state = ClusterState {
            nodes,
            network: Vec::new(),
            leaders: BTreeSet::new(),
            votes: BTreeSet::new(),
            term_regressions: Vec::new(),
            unpersisted_votes: Vec::new(),
            core_panics: Vec::new(),
            crashes_left: self.bounds.crashes,
            cessions_left: self.bounds.cessions,
            committed: 0,
        };
        self.drain(&mut state, None);
        state.refresh_fingerprints(None);
        state
    }
}

/// The steps of a clean first election from [`Start::Cold`]: node 1 scouts, node 2 answers,
/// node 1 persists term 1 and proposes, nodes 2 and 3 support it once term 1 is on disk, node 1
/// leads and its heartbeat reaches both; learners beyond node 3 follow it (and send it their
/// support, which counts once they are voters).
fn stable_election(nodes: u32) -> Vec<Action> {
    let (n1, n2, n3) = (NodeId(1), NodeId(2), NodeId(3));
    let msg = |from, to, message| Action::Deliver(Envelope { from, to, message });
    let learners = (4..=nodes).map(NodeId).flat_map(|learner| {
        [
            msg(n1, learner, Wire::Heartbeat { term: 1 }),
            Action::Persisted(learner),
            msg(learner, n1, Wire::ElectionResponse { term: 1 }),
        ]
    });
    let voters = vec![
        Action::Timeout(n1),
        msg(n1, n2, Wire::ScoutingRequest { term: 1, epoch: 0 }),
        msg(
            n2,
            n1,
            Wire::ScoutingResponse {
                term: 1,
                will_vote: true,
            },
        ),
        Action::Persisted(n1),
        msg(n1, n2, Wire::Proposal { term: 1, epoch: 0 }),
        msg(n1, n3, Wire::Proposal { term: 1, epoch: 0 }),
        Action::Persisted(n2),
        Action::Persisted(n3),
        msg(n2, n1, Wire::ElectionResponse { term: 1 }),
        msg(n3, n1, Wire::ElectionResponse { term: 1 }),
        msg(n1, n2, Wire::Heartbeat { term: 1 }),
        msg(n1, n3, Wire::Heartbeat { term: 1 }),
    ];
    voters.into_iter().chain(learners).collect()
}

impl ElectorModel {
    /// Every action enabled in `s`, in a deterministic order; none once a core has panicked.
    fn enabled_actions(&self, s: &ClusterState, actions: &mut Vec<Action>) {
        if !s.core_panics.is_empty() {
            return;
        }
        for envelope in &s.network {
            if s.is_up(envelope.to) {
                actions.push(Action::Deliver(*envelope));
            }
        }
        for node in &s.nodes {
            let id = node.id;
            let Some(core) = node.core.as_ref() else {
                actions.push(Action::Restart(id));
                continue;
            };
            if core.poll_timeout().is_some() {
                actions.push(Action::Timeout(id));
            }
            if !node.writes.is_empty() {
                actions.push(Action::Persisted(id));
            }
            if s.crashes_left > 0 {
                actions.push(Action::Crash(id));
            }
            if s.cessions_left > 0 && core.status().is_leader() {
                actions.push(Action::Cede(id));
            }
            if node.applied < s.committed {
                actions.push(Action::Apply(id));
            }
        }
        if usize::from(s.committed) < self.bounds.changes.len() && self.may_commit(s) {
            for node in &s.nodes {
                let Some(status) = node.core.as_ref().map(|c| c.status()) else {
                    continue;
                };
                if !status.is_leader() || node.applied != s.committed {
                    continue;
                }
                let following = |m: &Membership| {
                    m.voters
                        .iter()
                        .filter(|v| {
                            s.node(**v).core.as_ref().is_some_and(|c| {
                                let f = c.status();
                                f.term == status.term && f.leader == Some(node.id)
                            })
                        })
                        .count()
                        >= m.majority()
                };
                let (old, new) = (
                    self.membership(s.committed),
                    self.membership(s.committed + 1),
                );
                if following(&old) && following(&new) {
                    actions.push(Action::Commit(node.id));
                }
            }
        }
    }

    /// Whether the next change may be committed: with [`Self::applied_by_majority_first`], only
    /// once a majority of the current voters have applied the current membership.
    fn may_commit(&self, s: &ClusterState) -> bool {
        if !self.applied_by_majority_first {
            return true;
        }
        let current = self.membership(s.committed);
        let applied = current
            .voters
            .iter()
            .filter(|v| s.node(**v).applied == s.committed)
            .count();
        applied >= current.majority()
    }

    /// `action` applied to `last`: `None` when it changes nothing or leads beyond the bounds.
    fn next(&self, last: &ClusterState, action: Action) -> Option<ClusterState> {
        // An assertion of the core that fails becomes a state that violates a property, so that
        // the checker prints the path to it.
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.step(last, action))) {
            Ok(next) => next,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|m| m.to_string()))
                    .unwrap_or_default();
                let mut s = last.clone();
                s.core_panics.push(format!("{action:?}: {message}"));
                Some(s)
            }
        }
    }

    fn step(&self, last: &ClusterState, action: Action) -> Option<ClusterState> {
        let mut s = last.clone();
        let mut restarted = None;
        match action {
            Action::Deliver(envelope) => self.deliver(&mut s, envelope),
            Action::Timeout(id) => {
                let node = s.node_mut(id);
                let at = node.core.as_ref()?.poll_timeout()?;
                node.now = node.now.max(at);
                let now = node.now;
                node.core_mut()?.handle_timeout(now);
            }
            Action::Persisted(id) => {
                let node = s.node_mut(id);
                let term = node.writes.remove(0);
                let durable = node.durable;
                node.durable = term;
                let now = node.now;
                node.core_mut()?.on_term_persisted(now, term);
                if term < durable {
                    s.term_regressions.push(format!(
                        "durable term of {id} went back: {durable} -> {term}"
                    ));
                }
            }
            Action::Crash(id) => {
                s.crashes_left -= 1;
                let node = s.node_mut(id);
                node.core = None;
                // A write in flight dies with the process. Messages to and from it stay in
                // flight (more than TCP allows, and fewer states than dropping them).
                node.writes.clear();
                // Its connections close: its peers learn it at once.
                for other in self.ids().filter(|o| *o != id) {
                    tell_availability(s.node_mut(other), id, false);
                }
            }
            Action::Restart(id) => {
                restarted = Some(id);
                let term = match self.restart_from {
                    RestartFrom::PersistedTerm => s.node(id).durable,
                    RestartFrom::TermZero => Term(0),
                };
                let voted = s.votes.iter().filter(|v| v.0 == id).map(|v| v.1).max();
                if let Some(voted) = voted.filter(|voted| *voted > term) {
                    s.term_regressions.push(format!(
                        "{id} restarts with term {term} below term {voted} it voted or proposed in"
                    ));
                }
                let now = s.node(id).now;
                let core = self.boot(id, term, s.node(id).applied, now);
                let node = s.node_mut(id);
                node.core = Some(Arc::new(core));
                node.durable = term;
                // The new core believes every peer up; it and its peers learn the truth at once.
                for other in self.ids().filter(|o| *o != id) {
                    let other_up = s.is_up(other);
                    tell_availability(s.node_mut(other), id, true);
                    if !other_up {
                        tell_availability(s.node_mut(id), other, false);
                    }
                }
            }
            Action::Cede(id) => {
                s.cessions_left -= 1;
                let node = s.node_mut(id);
                let now = node.now;
                node.core_mut()?.cede_leadership(now);
            }
            Action::Commit(id) | Action::Apply(id) => {
                if matches!(action, Action::Commit(_)) {
                    s.committed += 1;
                }
                let node = s.node_mut(id);
                node.applied += 1;
                let membership = self.membership(node.applied);
                let now = node.now;
                node.core_mut()?.set_membership(now, membership);
            }
        }
        // Within one incarnation, a node's term never decreases.
        for (before, after) in last.nodes.iter().zip(&s.nodes) {
            if restarted == Some(after.id) {
                continue;
            }
            if let (Some(was), Some(is)) = (before.term(), after.term()) {
                if is < was {
                    s.term_regressions
                        .push(format!("term of {} went back: {was} -> {is}", after.id));
                }
            }
        }
        self.drain(&mut s, Some(last));
        if self.restart_from == RestartFrom::PersistedTerm {
            let mut network = std::mem::take(&mut s.network);
            network.retain(|e| !is_dead(&s, e));
            s.network = network;
        }
        let max_term = Term(self.bounds.max_term);
        if s.nodes
            .iter()
            .any(|n| n.term().is_some_and(|t| t > max_term))
        {
            return None; // beyond the term bound: not explored
        }
        s.refresh_fingerprints(Some(last));
        Some(s)
    }
}

impl Model for ElectorModel {
    type State = ClusterState;
    type Action = Action;

    fn init_states(&self) -> Vec<ClusterState> {
        self.initial_states()
    }

    fn actions(&self, s: &ClusterState, actions: &mut Vec<Action>) {
        self.enabled_actions(s, actions);
    }

    fn next_state(&self, last: &ClusterState, action: Action) -> Option<ClusterState> {
        self.next(last, action)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(NO_CORE_PANIC, |_, s: &ClusterState| {
                s.core_panics.is_empty()
            }),
            Property::always(ELECTION_SAFETY, |_, s: &ClusterState| {
                // Sorted by term: two leaders of one term are neighbours.
                let leaders: Vec<_> = s.leaders.iter().collect();
                leaders.windows(2).all(|w| w[0].0 != w[1].0)
            }),
            Property::always(SINGLE_VOTE, |_, s: &ClusterState| {
                // Sorted by (voter, term): two candidates of one voter and term are neighbours.
                let votes: Vec<_> = s.votes.iter().collect();
                votes
                    .windows(2)
                    .all(|w| (w[0].0, w[0].1) != (w[1].0, w[1].1))
            }),
            Property::always(TERMS_NEVER_GO_BACK, |_, s: &ClusterState| {
                s.term_regressions.is_empty()
            }),
            Property::always(PERSIST_BEFORE_VOTE, |_, s: &ClusterState| {
                s.unpersisted_votes.is_empty()
            }),
            Property::sometimes(LEADER_ELECTED, |_, s: &ClusterState| !s.leaders.is_empty()),
        ];
        // Only what the bounds make reachable.
        if self.bounds.max_term >= 2 {
            properties.push(Property::sometimes(
                LEADERS_IN_TWO_TERMS,
                |_, s: &ClusterState| {
                    let first = s.leaders.first().map(|l| l.0);
                    s.leaders.iter().any(|l| Some(l.0) != first)
                },
            ));
        }
        if self.bounds.crashes >= 1 {
            properties.push(Property::sometimes(
                LEADER_AFTER_RESTART,
                |model: &ElectorModel, s: &ClusterState| {
                    s.crashes_left < model.bounds.crashes
                        && s.nodes.iter().all(|n| n.core.is_some())
                        && s.nodes
                            .iter()
                            .any(|n| n.core.as_ref().is_some_and(|c| c.status().is_leader()))
                },
            ));
        }
        if !self.bounds.changes.is_empty() {
            properties.push(Property::sometimes(
                LEADER_OF_LAST_MEMBERSHIP,
                |model: &ElectorModel, s: &ClusterState| {
                    let last = model.bounds.changes.len() as u8;
                    s.committed == last
                        && s.nodes.iter().any(|n| {
                            n.applied == last
                                && n.core.as_ref().is_some_and(|c| c.status().is_leader())
                        })
                },
            ));
        }
        properties
    }
}

/// `bounds` with the overrides given in the environment: `BMQ_MODEL_MAX_TERM`,
/// `BMQ_MODEL_CRASHES`, `BMQ_MODEL_CESSIONS`, `BMQ_MODEL_MISS_COUNT`.
fn bounds_from_env(bounds: Bounds) -> Bounds {
    fn var<T: std::str::FromStr>(name: &str, default: T) -> T {
        std::env::var(name).map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} must be an integer, got {v:?}"))
        })
    }
    Bounds {
        start: bounds.start,
        max_term: var("BMQ_MODEL_MAX_TERM", bounds.max_term),
        crashes: var("BMQ_MODEL_CRASHES", bounds.crashes),
        cessions: var("BMQ_MODEL_CESSIONS", bounds.cessions),
        heartbeat_miss_count: var("BMQ_MODEL_MISS_COUNT", bounds.heartbeat_miss_count),
        nodes: bounds.nodes,
        initial: bounds.initial,
        changes: bounds.changes,
        max_depth: var("BMQ_MODEL_MAX_DEPTH", bounds.max_depth),
    }
}

/// Prints a counterexample, action by action, then its last state; returns its actions.
fn print_path(name: &str, path: Path<ClusterState, Action>) -> (Vec<Action>, ClusterState) {
    let last = path.last_state().clone();
    let actions = path.into_actions();
    println!("counterexample for \"{name}\" ({} steps):", actions.len());
    for action in &actions {
        println!("- {action:?}");
    }
    println!("last state:{last:?}");
    (actions, last)
}

/// From a cold start (terms up to 1, two crashes, one cession, heartbeat checks that keep or
/// drop the leader), every property holds in every reachable state.
#[test]
fn cold_start_is_safe_within_ci_bounds() {
    ElectorModel::new(COLD_CI)
        .check(
            "cold start, CI",
            Search::DepthFirst,
            HasDiscoveries::AllFailures,
        )
        .assert_safe();
}

/// From a stable leader of term 1 (terms up to 2, one crash, one cession), every property holds
/// in every reachable state.
#[test]
fn failover_from_stable_leader_is_safe_within_ci_bounds() {
    ElectorModel::new(STABLE_CI)
        .check(
            "stable leader, CI",
            Search::DepthFirst,
            HasDiscoveries::AllFailures,
        )
        .assert_safe();
}

/// From a cold start with larger bounds (terms up to 2, one crash; `BMQ_MODEL_*` override),
/// every property holds. Run by `scripts/soak-sim.sh elector`, in release mode.
#[test]
#[ignore = "long: cargo test --release -p bmq-tests --test elector_model -- --ignored --nocapture"]
fn cold_start_is_safe_within_larger_bounds() {
    ElectorModel::new(bounds_from_env(COLD_LARGER))
        .check(
            "cold start, larger",
            Search::DepthFirst,
            HasDiscoveries::AllFailures,
        )
        .assert_safe();
}

/// From a stable leader with larger bounds (terms up to 3, one crash; `BMQ_MODEL_*` override),
/// every property holds. Run by `scripts/soak-sim.sh elector`, in release mode.
#[test]
#[ignore = "long: cargo test --release -p bmq-tests --test elector_model -- --ignored --nocapture"]
fn failover_from_stable_leader_is_safe_within_larger_bounds() {
    ElectorModel::new(bounds_from_env(STABLE_LARGER))
        .check(
            "stable leader, larger",
            Search::DepthFirst,
            HasDiscoveries::AllFailures,
        )
        .assert_safe();
}

/// A quorum of one on three nodes (a misconfiguration): the checker finds two leaders in one
/// term, which shows that it can find a counterexample of election safety.
#[test]
fn quorum_of_one_elects_two_leaders_in_one_term() {
    let model = ElectorModel {
        quorum: 1,
        ..ElectorModel::new(Bounds {
            start: Start::Cold,
            max_term: 1,
            crashes: 0,
            cessions: 0,
            heartbeat_miss_count: 1,
            nodes: 3,
            initial: THREE_VOTERS,
            changes: &[],
            max_depth: 0,
        })
    };
    let (_, last) = two_leaders_in_one_term(model, "negative, quorum 1");
    assert!(
        last.leaders
            .iter()
            .any(|(t, n)| { last.leaders.iter().any(|(t2, n2)| t2 == t && n2 != n) }),
        "the counterexample must end with two leaders of one term: {last:?}"
    );
}

/// Checks `model` breadth first until it violates election safety, prints that counterexample
/// and returns its path; panics if the checker finds none (a negative test's failure).
fn two_leaders_in_one_term(model: ElectorModel, name: &str) -> (Vec<Action>, ClusterState) {
    let mut outcome = model.check(
        name,
        Search::BreadthFirst,
        HasDiscoveries::AnyOf([ELECTION_SAFETY].into()),
    );
    print_path(
        ELECTION_SAFETY,
        outcome
            .discoveries
            .remove(ELECTION_SAFETY)
            .expect("the checker must find two leaders in one term"),
    )
}

/// Restarts that forget the elector term (BlazingMQ restarts from the ledger's last term; here
/// an empty ledger): after node 1 was elected in term 1, two nodes that voted in term 1 crash
/// and restart at term 0 and one elects the other in term 1 again; the checker finds two
/// leaders in one term, which persisting the term before voting (DESIGN.md §4) prevents.
#[test]
fn restart_without_persisted_term_elects_two_leaders_in_one_term() {
    let model = ElectorModel {
        restart_from: RestartFrom::TermZero,
        ..ElectorModel::new(Bounds {
            start: Start::StableLeader,
            max_term: 1,
            crashes: 2,
            cessions: 0,
            heartbeat_miss_count: 1,
            nodes: 3,
            initial: THREE_VOTERS,
            changes: &[],
            max_depth: 0,
        })
    };
    let (actions, _) = two_leaders_in_one_term(model, "negative, restart from term 0");
    assert!(
        actions.iter().any(|a| matches!(a, Action::Restart(_))),
        "the counterexample must go through a restart"
    );
}

/// Two removals from a stable leader ({1,2,3} -> {1,2} -> {1}; terms up to 2, one crash, one
/// cession): every property holds in every reachable state, whatever the order of commits,
/// applies, elections and crashes.
#[test]
fn shrinking_is_safe_within_ci_bounds() {
    ElectorModel::new(bounds_from_env(SHRINK_CI))
        .check(
            "shrink 3 -> 2 -> 1, CI",
            Search::DepthFirst,
            HasDiscoveries::AllFailures,
        )
        .assert_safe();
}

/// A learner added and the leader removed ({1,2} -> {1,2,3} -> {2,3}; terms up to 2, one
/// crash, one cession): every property holds in every reachable state.
#[test]
fn adding_a_learner_and_removing_the_leader_is_safe_within_ci_bounds() {
    ElectorModel::new(bounds_from_env(ADD_REMOVE_CI))
        .check(
            "add 3, remove leader 1, CI",
            Search::DepthFirst,
            HasDiscoveries::AllFailures,
        )
        .assert_safe();
}

/// {1,2,3} -> {1,2,3,4} -> {2,3,4} on four nodes: every property holds. Not in
/// `scripts/soak-sim.sh`: without crashes or cessions it had not finished after 20 minutes in
/// release mode (1.3 GB RSS); run by hand to explore (`BMQ_MODEL_*` lower the bounds).
#[test]
#[ignore = "unfinished after 20 min: cargo test --release -p bmq-tests --test elector_model -- --ignored --exact add_and_remove_on_four_nodes_is_safe"]
fn add_and_remove_on_four_nodes_is_safe() {
    ElectorModel::new(bounds_from_env(CHANGE_LARGER))
        .check(
            "add 4, remove leader 1, larger",
            Search::DepthFirst,
            HasDiscoveries::AllFailures,
        )
        .assert_safe();
}

/// Growth {1,2,3} -> {1,2,3,4} -> {1,2,3,4,5}: every property holds. Larger still than the
/// four-node check, never run to its end; by hand only, like it.
#[test]
#[ignore = "never run to its end: cargo test --release -p bmq-tests --test elector_model -- --ignored --exact growth_to_five_is_safe"]
fn growth_to_five_is_safe() {
    ElectorModel::new(bounds_from_env(GROW_LARGER))
        .check(
            "growth to five, larger",
            Search::DepthFirst,
            HasDiscoveries::AllFailures,
        )
        .assert_safe();
}

/// {1,2,3} -> {1,2,3,4} -> {2,3,4} on four nodes, every state within [`CHANGE_CI`]'s bound
/// of steps: every `always` property holds there (the `sometimes` ones lie deeper).
#[test]
fn add_and_remove_on_four_nodes_is_safe_to_a_bounded_depth() {
    ElectorModel::new(bounds_from_env(CHANGE_CI))
        .check(
            "add 4, remove leader 1, bounded depth, CI",
            Search::BreadthFirst,
            HasDiscoveries::AllFailures,
        )
        .assert_holds(false);
}

/// Growth {1,2,3} -> {1,2,3,4} -> {1,2,3,4,5}, every state within [`GROW_CI`]'s bound of
/// steps: every property holds.
#[test]
fn growth_to_five_is_safe_to_a_bounded_depth() {
    ElectorModel::new(bounds_from_env(GROW_CI))
        .check(
            "growth to five, bounded depth, CI",
            Search::BreadthFirst,
            HasDiscoveries::AllFailures,
        )
        .assert_holds(false);
}

/// The removals of [`SHRINK_CI`], for the negative tests.
const SHRINK_NEGATIVE: Bounds = SHRINK_CI;

/// Without the metadata leader's rule (a change committed only once a majority of the current
/// voters applied the one before), {1} is committed while nodes 2 and 3 are still on {1,2,3}:
/// {2,3} and {1} elect two leaders in one term.
#[test]
fn changes_without_a_majority_applied_first_elect_two_leaders_in_one_term() {
    let model = ElectorModel {
        applied_by_majority_first: false,
        ..ElectorModel::new(SHRINK_NEGATIVE)
    };
    let (actions, _) = two_leaders_in_one_term(model, "negative, no applied-by-majority rule");
    assert_eq!(
        actions
            .iter()
            .filter(|a| matches!(a, Action::Commit(_)))
            .count(),
        2,
        "the counterexample must commit both changes"
    );
}

/// Without the voters' refusal of a candidate of an older membership epoch, node 2, which
/// applied {1,2}, still votes for node 3 on {1,2,3}, while node 1 alone elects itself on {1}:
/// two leaders in one term.
#[test]
fn voters_without_the_epoch_check_elect_two_leaders_in_one_term() {
    let model = ElectorModel {
        epoch_check: false,
        ..ElectorModel::new(SHRINK_NEGATIVE)
    };
    let (actions, _) = two_leaders_in_one_term(model, "negative, no epoch check");
    assert!(
        actions.iter().any(|a| matches!(a, Action::Commit(_))),
        "the counterexample must go through a membership change"
    );
}
