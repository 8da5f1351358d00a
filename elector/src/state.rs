//! The elector's externally visible state: [`ElectorState`], [`TransitionReason`] and the
//! [`ElectorStatus`] published on every change.

use bmq_proto::{NodeId, Term};

/// The elector states of the BlazingMQ article ("Elector State Machine").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElectorState {
    /// Not started yet: ignores every input.
    Dormant,
    /// Not the leader and not proposing; may follow a leader or hold a tentative one.
    Follower,
    /// Has proposed an election (`ElectionProposal`) in its current term and awaits a quorum.
    Candidate,
    /// Elected for its current term; broadcasts `LeaderHeartbeat`.
    Leader,
}

impl ElectorState {
    /// Lowercase name for logs, metrics and JSON (`"dormant"`, `"follower"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ElectorState::Dormant => "dormant",
            ElectorState::Follower => "follower",
            ElectorState::Candidate => "candidate",
            ElectorState::Leader => "leader",
        }
    }
}

/// Why the elector last changed state (BlazingMQ's `ElectorTransitionReason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransitionReason {
    /// An ordinary step of the protocol: a leader discovered, an election won, a proposal
    /// supported (BlazingMQ's `e_NONE`).
    None,
    /// The elector was started.
    Started,
    /// The followed leader missed `heartbeat_miss_count` heartbeats.
    LeaderNoHeartbeat,
    /// The connection to the followed leader dropped.
    LeaderUnavailable,
    /// A leader stepped down because it saw a higher term, or a follower switched to a leader
    /// with a higher term.
    LeaderPreempted,
    /// A candidate gave up its election for a proposal or a leader of a higher or equal term.
    ElectionPreempted,
    /// A candidate did not get a quorum in time, or a leader's live supporters fell below it.
    QuorumNotAchieved,
    /// The leader gave up leadership on request (graceful stop, transfer), or the followed
    /// leader announced that it did (`LeadershipCession`).
    LeadershipCeded,
    /// A committed membership change made this node a non-voter (a leader steps down, a
    /// candidate gives up) or removed the followed leader (DESIGN.md §5a).
    MembershipChanged,
}

impl TransitionReason {
    /// snake_case name for logs, metric labels and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            TransitionReason::None => "none",
            TransitionReason::Started => "started",
            TransitionReason::LeaderNoHeartbeat => "leader_no_heartbeat",
            TransitionReason::LeaderUnavailable => "leader_unavailable",
            TransitionReason::LeaderPreempted => "leader_preempted",
            TransitionReason::ElectionPreempted => "election_preempted",
            TransitionReason::QuorumNotAchieved => "quorum_not_achieved",
            TransitionReason::LeadershipCeded => "leadership_ceded",
            TransitionReason::MembershipChanged => "membership_changed",
        }
    }
}

/// A snapshot of the elector, published on every change of state, term or leader.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ElectorStatus {
    /// The current state.
    pub state: ElectorState,
    /// The current term: the highest term this node has adopted or promised (never decreases).
    pub term: Term,
    /// The leader of `term` as this node sees it: itself when `Leader`, the followed node when
    /// a `Follower` following one, `None` otherwise.
    pub leader: Option<NodeId>,
    /// The candidate this node supported in `term` and whose first heartbeat it awaits.
    pub tentative_leader: Option<NodeId>,
    /// Why the last state change happened.
    pub reason: TransitionReason,
    /// Incremented with every published change, so that a subscriber can drop stale
    /// notifications (`age` of a newer status is always greater).
    pub age: u64,
}

impl ElectorStatus {
    /// Whether this node is the leader.
    pub fn is_leader(&self) -> bool {
        self.state == ElectorState::Leader
    }
}
