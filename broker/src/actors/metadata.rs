//! `MetadataActor`: the actix shell around [`MetadataCore`] and the [`Ledger`].
//!
//! - **Role**: one per node. Owns the metadata core and the ledger; executes the core's outputs
//!   in order (persist before the next output, so nothing that depends on durability leaves
//!   before the fsync); publishes the committed cluster state.
//! - **Receives**: [`MetadataInbound`] (peer messages, from the control-channel peer links),
//!   [`LeaderChanged`] (from the elector), [`Propose`] and [`RequestQueueAssignment`] (from the
//!   health actor, partitions, client sessions), [`SubscribeState`], [`GetMetadataStatus`]
//!   (admin `/status`), [`SetMetadataQuorum`] (admin).
//! - **Sends**: [`MetadataOutbound`] to the transport (`to: None` = every peer);
//!   [`ClusterStateCommitted`] to subscribers after each commit, role change or ledger reset.
//! - **Timers**: a single timer, re-armed after every input from the core's `poll_timeout`.
//! - **Failure**: a ledger write or fsync error is logged and stops the system with exit code 1
//!   (never retry an fsync). The node starts it and stops the system if it stops.
//! - **Thread**: its own arbiter, so ledger writes and fsyncs (one per record by default) and
//!   applying commits to a large cluster state never delay the peer links' heartbeats, the
//!   elector or the client sessions.
//! - **Metrics**: gauges `bmq_metadata_lsn_term`, `bmq_metadata_lsn_sequence`,
//!   `bmq_metadata_committed_lsn_term`, `bmq_metadata_committed_lsn_sequence`,
//!   `bmq_metadata_role` (0 follower, 1 passive leader, 2 active leader), `bmq_metadata_uncommitted_advisories`,
//!   `bmq_metadata_ledger_bytes`; counter `bmq_metadata_ledger_rollovers_total`; histogram
//!   `bmq_metadata_commit_latency_seconds` (propose to commit, on the leader).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use bmq_proto::{peer, NodeId, Term};
use tracing::{debug, error};

use bmq_metadata::{
    ClusterState, Ledger, LedgerRecord, Lsn, MetadataCore, MetadataOutput, MetadataRole,
    MetadataStatus, ProposeError,
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

/// Ask for the current status and committed state.
#[derive(Debug, Message)]
#[rtype(result = "MetadataSnapshot")]
pub struct GetMetadataStatus;

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

/// The metadata actor. See the module documentation.
pub struct MetadataActor {
    core: MetadataCore,
    ledger: Ledger,
    transport: Recipient<MetadataOutbound>,
    subscribers: Vec<Recipient<ClusterStateCommitted>>,
    timer: Option<(Instant, SpawnHandle)>,
    proposed_at: HashMap<Lsn, Instant>,
    rollovers_reported: u64,
}

impl MetadataActor {
    /// An actor driving `core`, writing to `ledger` (opened on the same history the core was
    /// built from), sending peer messages to `transport`.
    pub fn new(core: MetadataCore, ledger: Ledger, transport: Recipient<MetadataOutbound>) -> Self {
        MetadataActor {
            core,
            ledger,
            transport,
            subscribers: Vec::new(),
            timer: None,
            proposed_at: HashMap::new(),
            rollovers_reported: 0,
        }
    }

    fn publication(&self) -> ClusterStateCommitted {
        ClusterStateCommitted {
            status: self.core.status(),
            state: Arc::new(self.core.state().clone()),
        }
    }

    fn publish(&mut self) {
        let message = self.publication();
        // do_send: commits are bounded by the leader's uncommitted limit; a closed subscriber is
        // dropped from the list.
        self.subscribers.retain(|s| s.connected());
        for s in &self.subscribers {
            s.do_send(message.clone());
        }
    }

    /// Drains the core's outputs, then re-arms the timer.
    fn drive(&mut self, ctx: &mut Context<Self>) {
        let mut changed = false;
        while let Some(output) = self.core.poll_output() {
            match output {
                MetadataOutput::Persist { record } => {
                    let lsn = record.lsn();
                    if let Err(e) = self.ledger.append(&record) {
                        error!(error = %e, lsn = %lsn, "metadata ledger write failed; stopping the node");
                        System::current().stop_with_code(1);
                        ctx.stop();
                        return;
                    }
                    // Commit latency covers every advisory this node stamps as leader (proposals
                    // from the health actor, queue assignments, the leader's snapshot), from
                    // `Propose` when there was one, else from this first write.
                    let status = self.core.status();
                    if matches!(record, LedgerRecord::Update { .. })
                        && status.role != MetadataRole::Follower
                        && lsn.term == status.term
                        && self.proposed_at.len() < COMMIT_LATENCY_TRACKED_MAX
                    {
                        self.proposed_at.entry(lsn).or_insert_with(Instant::now);
                    }
                    self.core.on_persisted(Instant::now(), lsn);
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
                    if let Err(e) = self.ledger.reset_to(&state, committed_lsn, &uncommitted) {
                        error!(error = %e, "metadata ledger reset failed; stopping the node");
                        System::current().stop_with_code(1);
                        ctx.stop();
                        return;
                    }
                    self.core.on_persisted(Instant::now(), last);
                    changed = true;
                }
                MetadataOutput::Send { to, message } => {
                    // do_send: the transport's mailbox is bounded; metadata traffic is bounded by
                    // the core's limits (uncommitted records, retry periods).
                    self.transport.do_send(MetadataOutbound {
                        to: Some(to),
                        message,
                    });
                }
                MetadataOutput::Broadcast { message } => {
                    self.transport
                        .do_send(MetadataOutbound { to: None, message });
                }
                MetadataOutput::Committed { lsn, advisory: _ } => {
                    if let Some(at) = self.proposed_at.remove(&lsn) {
                        metrics::histogram!("bmq_metadata_commit_latency_seconds")
                            .record(at.elapsed().as_secs_f64());
                    }
                    changed = true;
                }
                MetadataOutput::RoleChanged { status } => {
                    debug!(role = ?status.role, term = %status.term, "metadata role changed");
                    if status.role != MetadataRole::ActiveLeader {
                        self.proposed_at.clear();
                    }
                    changed = true;
                }
            }
        }
        if changed {
            self.publish();
        }
        self.update_metrics();
        self.arm_timer(ctx);
    }

    fn update_metrics(&mut self) {
        let status = self.core.status();
        metrics::gauge!("bmq_metadata_lsn_term").set(status.last_lsn.term.0 as f64);
        metrics::gauge!("bmq_metadata_lsn_sequence").set(status.last_lsn.sequence as f64);
        metrics::gauge!("bmq_metadata_committed_lsn_term").set(status.committed_lsn.term.0 as f64);
        metrics::gauge!("bmq_metadata_committed_lsn_sequence")
            .set(status.committed_lsn.sequence as f64);
        let role = match status.role {
            MetadataRole::Follower => 0.0,
            MetadataRole::PassiveLeader => 1.0,
            MetadataRole::ActiveLeader => 2.0,
        };
        metrics::gauge!("bmq_metadata_role").set(role);
        metrics::gauge!("bmq_metadata_uncommitted_advisories").set(status.uncommitted as f64);
        metrics::gauge!("bmq_metadata_ledger_bytes").set(self.ledger.file_size() as f64);
        let rollovers = self.ledger.rollovers();
        if rollovers > self.rollovers_reported {
            metrics::counter!("bmq_metadata_ledger_rollovers_total")
                .increment(rollovers - self.rollovers_reported);
            self.rollovers_reported = rollovers;
        }
    }

    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        let deadline = self.core.poll_timeout();
        if self.timer.as_ref().map(|(d, _)| *d) == deadline {
            return;
        }
        if let Some((_, handle)) = self.timer.take() {
            ctx.cancel_future(handle);
        }
        if let Some(deadline) = deadline {
            let delay = deadline.saturating_duration_since(Instant::now());
            let handle = ctx.run_later(delay, |actor, ctx| {
                actor.timer = None;
                actor.core.handle_timeout(Instant::now());
                actor.drive(ctx);
            });
            self.timer = Some((deadline, handle));
        }
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

impl Handler<GetMetadataStatus> for MetadataActor {
    type Result = MetadataSnapshot;

    fn handle(&mut self, _msg: GetMetadataStatus, _ctx: &mut Self::Context) -> MetadataSnapshot {
        MetadataSnapshot {
            status: self.core.status(),
            state: self.core.state().clone(),
        }
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
        actor
            .send(LeaderChanged {
                term: Term(1),
                leader: Some(NodeId(1)),
            })
            .await
            .unwrap();
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
        // Broadcasts of a single node go to the transport too (it has no peers to deliver to).
        assert!(!outbound.lock().unwrap().is_empty());
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
}
