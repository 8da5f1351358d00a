//! `ElectorActor`: the actix shell around the pure [`Elector`] core (`bmq-elector`).
//!
//! Role: runs one node's elector. It owns the core and the [`TermStore`]; it has no protocol
//! logic of its own (every decision is in `core.rs`).
//!
//! Receives:
//! - [`ElectorInbound`]: an elector message from a peer (from the control-channel PeerLink);
//! - [`PeerAvailability`]: a peer's control connection went up or down;
//! - [`SubscribeLeadership`]: register for [`LeadershipChanged`] (the current status is sent at
//!   once);
//! - [`SetQuorum`], [`CedeLeadership`]: admin actions (runtime quorum, transfer);
//! - [`Retire`]: graceful stop (cede, and never stand again);
//! - [`GetElectorStatus`]: answers an [`ElectorSnapshot`] (for `/status` and metrics).
//!
//! Sends:
//! - [`ElectorOutbound`] to the transport recipient given at construction (`to: None` means
//!   every peer);
//! - [`LeadershipChanged`] to every subscriber on each state change.
//!
//! Timers: one [`Timer`], re-armed after every input from the core's `poll_timeout()`, never
//! cancelled.
//!
//! Durability: `PersistTerm` is executed synchronously on the actor (write + fsync + rename +
//! directory fsync), with no disk worker and no group commit: term changes are rare (a few per
//! election), and the core must not release a vote before the write anyway. A failed write
//! stops the actix system with exit code 1 (STYLE.md: a failed fsync stops the node, never
//! retried).
//!
//! Thread: its own arbiter. The leader's heartbeats are timer outputs of this actor; a term
//! fsync happens only when the term changes (scouting won, a proposal supported, a higher term
//! seen), never while this node is a leader sending heartbeats, so the fsync cannot delay them.
//! Metadata ledger fsyncs run on the metadata actor's own thread.
//!
//! Supervisor: none; the node starts it and stops the system if it stops.

use std::time::Instant;

use actix::prelude::*;
use bmq_proto::peer::ElectorMessage;
use bmq_proto::NodeId;
use tracing::{error, info};

use super::shell::Timer;

use bmq_elector::{
    Elector, ElectorCounters, ElectorOutput, ElectorState, ElectorStatus, Membership, TermStore,
};

/// Mailbox capacity of the elector actor. Elector traffic is a few messages per heartbeat
/// period per peer; 1024 absorbs bursts at reconnection without unbounded queueing.
pub const ELECTOR_MAILBOX_CAPACITY: usize = 1024;

/// An elector message received from peer `from`.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct ElectorInbound {
    /// The sending peer (as authenticated by the connection's PeerHello).
    pub from: NodeId,
    /// The decoded message.
    pub message: ElectorMessage,
}

/// The control connection to `peer` went up (`available = true`) or down.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct PeerAvailability {
    /// The peer.
    pub peer: NodeId,
    /// Whether it is now reachable.
    pub available: bool,
}

/// Subscribe to leadership changes; the current status is sent to `subscriber` at once.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SubscribeLeadership {
    /// Receives a [`LeadershipChanged`] for the current status, then one per change.
    pub subscriber: Recipient<LeadershipChanged>,
}

/// Set the quorum at run time (`0` = `N/2 + 1`; above `N` forbids leadership).
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct SetQuorum {
    /// The new quorum, self included.
    pub quorum: usize,
}

/// The metadata state committed a membership (or held one at start): the elector counts its
/// voters from now on ([`Elector::set_membership`]). An older epoch than the one in use is
/// ignored.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct SetMembership {
    /// The committed membership.
    pub membership: Membership,
}

/// Cede leadership now (graceful stop, leadership transfer). A no-op on a non-leader.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct CedeLeadership;

/// Graceful stop: cede leadership if held, and never stand for election again
/// ([`Elector::retire`]).
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct Retire;

/// Ask for the elector's current status and effective quorum.
#[derive(Message, Debug, Clone)]
#[rtype(result = "ElectorSnapshot")]
pub struct GetElectorStatus;

/// Answer to [`GetElectorStatus`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectorSnapshot {
    /// The current status.
    pub status: ElectorStatus,
    /// The effective quorum, self included.
    pub quorum: usize,
}

/// An elector message to send: to one peer (`to: Some(id)`) or to every peer (`to: None`).
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct ElectorOutbound {
    /// The destination peer, or `None` for every peer.
    pub to: Option<NodeId>,
    /// The message.
    pub message: ElectorMessage,
}

/// The elector's status changed (state, term, leader or tentative leader). Subscribers drop a
/// notification whose `status.age` is not above the last one they saw.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct LeadershipChanged {
    /// The new status.
    pub status: ElectorStatus,
}

/// The elector actor. See the module documentation.
pub struct ElectorActor {
    core: Elector,
    /// When this node last broadcast a `LeaderHeartbeat` (while leader), for the send-interval
    /// histogram.
    last_heartbeat_sent: Option<Instant>,
    /// When the last `LeaderHeartbeat` arrived, and from whom, for the receive-interval
    /// histogram.
    last_heartbeat_received: Option<(NodeId, Instant)>,
    term_store: TermStore,
    transport: Recipient<ElectorOutbound>,
    subscribers: Vec<Recipient<LeadershipChanged>>,
    /// The core's next deadline.
    timer: Timer,
    /// Set once a term write failed: the system is stopping, the core is no longer driven.
    stopped: bool,
}

impl ElectorActor {
    /// An actor around a dormant `core` (started in `Actor::started`), persisting terms in
    /// `term_store` and sending peer messages to `transport`.
    pub fn new(
        core: Elector,
        term_store: TermStore,
        transport: Recipient<ElectorOutbound>,
    ) -> Self {
        ElectorActor {
            core,
            last_heartbeat_sent: None,
            last_heartbeat_received: None,
            term_store,
            transport,
            subscribers: Vec::new(),
            timer: Timer::new(),
            stopped: false,
        }
    }

    /// Executes every pending output of the core, then re-arms the single timer.
    fn drive(&mut self, ctx: &mut Context<Self>) {
        while !self.stopped {
            let Some(output) = self.core.poll_output() else {
                break;
            };
            match output {
                // do_send: the transport's mailbox is bounded and elector output is rate-bounded
                // by the protocol (a heartbeat per period, a few messages per election).
                ElectorOutput::Send { to, message } => self.transport.do_send(ElectorOutbound {
                    to: Some(to),
                    message,
                }),
                ElectorOutput::Broadcast { message } => {
                    if is_heartbeat(&message) {
                        let now = Instant::now();
                        if let Some(last) = self.last_heartbeat_sent.replace(now) {
                            metrics::histogram!("bmq_elector_heartbeat_send_interval_seconds")
                                .record(now.duration_since(last).as_secs_f64());
                        }
                    }
                    self.transport
                        .do_send(ElectorOutbound { to: None, message })
                }
                ElectorOutput::PersistTerm { term } => match self.term_store.persist(term) {
                    Ok(()) => self.core.on_term_persisted(Instant::now(), term),
                    Err(e) => {
                        error!(term = %term, error = %e, "elector term persist failed, stopping the node");
                        self.stopped = true;
                        System::current().stop_with_code(1);
                    }
                },
                ElectorOutput::StateChanged { status } => {
                    // Intervals are measured between heartbeats of one leadership only.
                    if status.state != ElectorState::Leader {
                        self.last_heartbeat_sent = None;
                    }
                    self.publish(status)
                }
            }
        }
        self.publish_counters(self.core.counters());
        if self.stopped {
            return;
        }
        let deadline = self.core.poll_timeout();
        self.timer
            .arm(ctx, deadline, |actor| &mut actor.timer, Self::on_timer);
    }

    /// The timer fired: the core handles what is due, then `drive` re-arms it. Once stopped,
    /// the core is no longer driven (a timer armed before is not cancelled, and fires here).
    fn on_timer(&mut self, ctx: &mut Context<Self>) {
        if self.stopped {
            return;
        }
        self.core.handle_timeout(Instant::now());
        self.drive(ctx);
    }

    fn publish(&mut self, status: ElectorStatus) {
        info!(
            state = status.state.as_str(),
            term = %status.term,
            leader = ?status.leader.map(|n| n.0),
            tentative_leader = ?status.tentative_leader.map(|n| n.0),
            reason = status.reason.as_str(),
            age = status.age,
            "elector state changed"
        );
        let state = match status.state {
            ElectorState::Dormant => 0.0,
            ElectorState::Follower => 1.0,
            ElectorState::Candidate => 2.0,
            ElectorState::Leader => 3.0,
        };
        metrics::gauge!("bmq_elector_state").set(state);
        metrics::gauge!("bmq_elector_term").set(status.term.0 as f64);
        metrics::gauge!("bmq_elector_leader_node_id")
            .set(status.leader.map_or(0.0, |n| f64::from(n.0)));
        metrics::counter!("bmq_elector_transitions_total", "reason" => status.reason.as_str())
            .increment(1);
        // do_send: one notification per state change, which the protocol rate-bounds.
        for subscriber in &self.subscribers {
            subscriber.do_send(LeadershipChanged {
                status: status.clone(),
            });
        }
    }

    fn publish_counters(&self, counters: ElectorCounters) {
        metrics::counter!("bmq_elector_scoutings_started_total")
            .absolute(counters.scoutings_started);
        metrics::counter!("bmq_elector_elections_started_total")
            .absolute(counters.elections_started);
        metrics::counter!("bmq_elector_elections_won_total").absolute(counters.elections_won);
        metrics::counter!("bmq_elector_heartbeats_missed_total")
            .absolute(counters.heartbeats_missed);
        metrics::counter!("bmq_elector_messages_dropped_total").absolute(counters.messages_dropped);
        metrics::counter!("bmq_elector_older_membership_refused_total")
            .absolute(counters.older_membership_refused);
        metrics::gauge!("bmq_elector_membership_epoch").set(self.core.membership_epoch() as f64);
        metrics::gauge!("bmq_elector_voters").set(self.core.voters().len() as f64);
    }
}

/// Whether `message` is a leader's heartbeat (measured: its send and receive intervals show
/// whether anything delays the thread that carries it).
fn is_heartbeat(message: &ElectorMessage) -> bool {
    matches!(
        message.kind,
        Some(bmq_proto::peer::elector_message::Kind::Heartbeat(_))
    )
}

impl Actor for ElectorActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(ELECTOR_MAILBOX_CAPACITY);
        self.core.start(Instant::now());
        self.drive(ctx);
    }
}

impl Handler<ElectorInbound> for ElectorActor {
    type Result = ();

    fn handle(&mut self, msg: ElectorInbound, ctx: &mut Self::Context) {
        if is_heartbeat(&msg.message) {
            let now = Instant::now();
            if let Some((from, last)) = self.last_heartbeat_received.replace((msg.from, now)) {
                if from == msg.from {
                    metrics::histogram!("bmq_elector_heartbeat_receive_interval_seconds")
                        .record(now.duration_since(last).as_secs_f64());
                }
            }
        }
        self.core
            .handle_message(Instant::now(), msg.from, msg.message);
        self.drive(ctx);
    }
}

impl Handler<PeerAvailability> for ElectorActor {
    type Result = ();

    fn handle(&mut self, msg: PeerAvailability, ctx: &mut Self::Context) {
        self.core
            .handle_peer_available(Instant::now(), msg.peer, msg.available);
        self.drive(ctx);
    }
}

impl Handler<SubscribeLeadership> for ElectorActor {
    type Result = ();

    fn handle(&mut self, msg: SubscribeLeadership, _ctx: &mut Self::Context) {
        msg.subscriber.do_send(LeadershipChanged {
            status: self.core.status(),
        });
        self.subscribers.push(msg.subscriber);
    }
}

impl Handler<SetQuorum> for ElectorActor {
    type Result = ();

    fn handle(&mut self, msg: SetQuorum, ctx: &mut Self::Context) {
        info!(quorum = msg.quorum, "elector quorum set");
        self.core.set_quorum(Instant::now(), msg.quorum);
        self.drive(ctx);
    }
}

impl Handler<SetMembership> for ElectorActor {
    type Result = ();

    fn handle(&mut self, msg: SetMembership, ctx: &mut Self::Context) {
        let epoch = msg.membership.epoch;
        let voters = msg.membership.voters.len();
        if self.core.set_membership(Instant::now(), msg.membership) {
            info!(epoch, voters, "elector membership applied");
        }
        self.drive(ctx);
    }
}

impl Handler<CedeLeadership> for ElectorActor {
    type Result = ();

    fn handle(&mut self, _msg: CedeLeadership, ctx: &mut Self::Context) {
        self.core.cede_leadership(Instant::now());
        self.drive(ctx);
    }
}

impl Handler<Retire> for ElectorActor {
    type Result = ();

    fn handle(&mut self, _msg: Retire, ctx: &mut Self::Context) {
        info!("elector retired: this node will not lead again");
        self.core.retire(Instant::now());
        self.drive(ctx);
    }
}

impl Handler<GetElectorStatus> for ElectorActor {
    type Result = MessageResult<GetElectorStatus>;

    fn handle(&mut self, _msg: GetElectorStatus, _ctx: &mut Self::Context) -> Self::Result {
        MessageResult(ElectorSnapshot {
            status: self.core.status(),
            quorum: self.core.quorum(),
        })
    }
}
