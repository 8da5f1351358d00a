//! `HealthActor`: turns node failures into new partition primaries (DESIGN.md §6).
//!
//! Receives every `ClusterStateCommitted` from the metadata actor (role + committed state) and
//! [`PeersChanged`] when a peer's availability changes, and reads peer availability from the
//! [`PeerHub`]. On the **active leader** only, it asks [`bmq_metadata::plan_primaries`] (the
//! pure decision: which partitions need a new primary, which node gets each, whether to
//! rebalance) with the nodes that are available and those still draining, and proposes the
//! resulting `PartitionPrimaryAdvisory` (lease + 1 for each moved partition) through the
//! metadata actor: at once on each commit and each availability change (a primary's loss is
//! acted on without waiting for a timer), and every `CHECK_PERIOD` as a fallback. One proposal
//! is in flight at a time; it is considered settled at the next commit, or retried after
//! `PROPOSAL_TIMEOUT`.
//!
//! A node that announces it is stopping (`NodeStopping`, from its `NodeStatusAdvisory
//! { STOPPING }` or from this node's own graceful stop) is never chosen as a new primary. It
//! keeps the primaries it has while it drains (its consumers confirm what they hold, its
//! journals reach a quorum); once it announces `DRAINED` (or its links drop) the leader moves
//! them to nodes that are up and not stopping, while it still runs and serves as a replica
//! during the new primaries' healing (graceful stop, DESIGN.md §7).
//!
//! When every partition has a live, healed (ACTIVE) primary, the plan rebalances primaries
//! gradually ([`bmq_metadata::plan_rebalance`]): one partition at a time moves from the node
//! with the most primaries to the one with the fewest, and only while they differ by two or
//! more — a node that returns gets its share back without a burst of moves, and a balanced
//! cluster never moves a primary. Safe because the journals are replicated: the new primary
//! heals from a quorum before serving.
//!
//! Receives: `ClusterStateCommitted` (role and committed state), [`PrimaryActive`] (a healed
//! primary's notice, or its request for a higher lease), [`NodeStopping`], [`PeersChanged`],
//! [`GetStoppingPeers`] (for the graceful stop).
//!
//! Sends: [`Propose`] to the metadata actor (a `PartitionPrimaryAdvisory` or a
//! `PrimaryStatusAdvisory { ACTIVE }`).
//!
//! Timers: the check every `CHECK_PERIOD` (`run_interval`, never cancelled), besides the checks
//! that commits and availability changes prompt. No disk work.
//!
//! Thread: the node's main thread, beside the metadata actor. Supervisor: none; the node
//! starts it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, ActorFutureExt, AsyncContext, Context, Handler, Message, WrapFuture};
use bmq_metadata::{lease_replicas_now, plan_primaries, ClusterState, MemberRole, MetadataRole};
use bmq_proto::peer::{
    advisory::Kind as AdvisoryKind, Advisory, PartitionPrimaryAdvisory, PrimaryStatusAdvisory,
};
use bmq_proto::{LeaseId, NodeId};
use tracing::{info, warn};

use crate::actors::metadata::{ClusterStateCommitted, MetadataActor, Propose};
use crate::net::peers::PeerHub;

/// How often the active leader re-evaluates primary assignments when nothing prompts it (a
/// commit or an availability change does at once).
const CHECK_PERIOD: Duration = Duration::from_millis(50);
/// A proposal not committed within this time is considered lost and may be made again.
const PROPOSAL_TIMEOUT: Duration = Duration::from_secs(2);

/// `node` healed `partition` at `lease` and asks for `PrimaryStatusAdvisory { ACTIVE }`; or,
/// with `renew_lease`, `node` is named primary at `lease` but served that lease before a
/// restart and asks to be named at a higher one (`PrimaryActiveNotice.renew_lease`).
#[derive(Message)]
#[rtype(result = "()")]
pub struct PrimaryActive {
    /// The primary.
    pub node: NodeId,
    /// The partition.
    pub partition: bmq_proto::PartitionId,
    /// Its `primary_lease_id`.
    pub lease: LeaseId,
    /// Asks for a higher lease instead of ACTIVE.
    pub renew_lease: bool,
}

/// `node` announced a graceful stop: never give it a primary; once `drained`, move its
/// primaries away.
#[derive(Message)]
#[rtype(result = "()")]
pub struct NodeStopping {
    /// The stopping node.
    pub node: NodeId,
    /// It has drained: move its primaries now.
    pub drained: bool,
}

/// A peer's availability changed (from the peer links' monitor): re-evaluate at once.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PeersChanged;

/// Asks which peers announced a graceful stop and are still connected (this node excluded).
#[derive(Message)]
#[rtype(result = "BTreeSet<NodeId>")]
pub struct GetStoppingPeers;

/// See the module doc.
pub struct HealthActor {
    self_id: NodeId,
    metadata: actix::Addr<MetadataActor>,
    peers: Arc<PeerHub>,
    active_leader: bool,
    state: Arc<ClusterState>,
    in_flight_since: Option<Instant>,
    /// Nodes that announced a graceful stop and are still connected, and whether each drained.
    stopping: std::collections::BTreeMap<NodeId, bool>,
    mailbox_capacity: usize,
    /// The nodes that replicate partitions before a membership is committed (the files'
    /// members).
    partition_hosts: BTreeSet<NodeId>,
}

impl HealthActor {
    /// A health actor for this node; `mailbox_capacity` is `limits.mailbox_capacity`;
    /// `partition_hosts` the nodes that replicate partitions (the files' members).
    pub fn new(
        self_id: NodeId,
        metadata: actix::Addr<MetadataActor>,
        peers: Arc<PeerHub>,
        mailbox_capacity: usize,
        partition_hosts: BTreeSet<NodeId>,
    ) -> Self {
        HealthActor {
            partition_hosts,
            self_id,
            metadata,
            peers,
            mailbox_capacity,
            active_leader: false,
            state: Arc::new(ClusterState::new(0)),
            in_flight_since: None,
            stopping: std::collections::BTreeMap::new(),
        }
    }

    /// The nodes that are up (this one included). A stopping node that has gone is forgotten
    /// here: when it comes back it is an ordinary node.
    fn up(&mut self) -> BTreeSet<NodeId> {
        let mut up: BTreeSet<NodeId> = self
            .peers
            .peer_availability()
            .into_iter()
            .filter_map(|(id, up)| up.then_some(id))
            .collect();
        up.insert(self.self_id);
        let self_id = self.self_id;
        self.stopping.retain(|n, _| *n == self_id || up.contains(n));
        up
    }

    /// The nodes that may be given a primary: up, not stopping, and voters of the committed
    /// membership (a learner holds no primary; a leaving member gives its primaries up): the
    /// replicas of every lease assigned now. Before a membership is committed: the files'
    /// members.
    fn available(&mut self) -> BTreeSet<NodeId> {
        let mut available = self.up();
        for n in self.stopping.keys() {
            available.remove(n);
        }
        match &self.state.membership {
            Some(membership) => {
                available.retain(|n| membership.role(*n) == Some(MemberRole::Voter));
            }
            None => available.retain(|n| self.partition_hosts.contains(n)),
        }
        available
    }

    /// On the active leader, with no proposal in flight: proposes what
    /// [`plan_primaries`] decides, if anything.
    fn check(&mut self, ctx: &mut Context<Self>) {
        if !self.active_leader {
            return;
        }
        if self
            .in_flight_since
            .is_some_and(|t| t.elapsed() < PROPOSAL_TIMEOUT)
        {
            return;
        }
        let available = self.available();
        // Stopping nodes that have not drained yet keep their primaries for now.
        let draining: BTreeSet<NodeId> = self
            .stopping
            .iter()
            .filter(|(_, drained)| !**drained)
            .map(|(n, _)| *n)
            .collect();
        let Some(plan) = plan_primaries(&self.state, &available, &draining) else {
            self.in_flight_since = None;
            return;
        };
        for p in &plan {
            info!(
                partition = p.partition_id,
                primary = ?p.primary_node_id,
                lease = p.primary_lease_id,
                "proposing new partition primary"
            );
        }
        self.in_flight_since = Some(Instant::now());
        let advisory = Advisory {
            kind: Some(AdvisoryKind::PartitionPrimary(PartitionPrimaryAdvisory {
                partitions: plan,
            })),
        };
        ctx.spawn(
            self.metadata
                .send(Propose { advisory })
                .into_actor(self)
                .map(|result, actor, _ctx| match result {
                    Ok(Ok(_lsn)) => {}
                    Ok(Err(e)) => {
                        warn!(error = %e, "primary assignment proposal refused");
                        actor.in_flight_since = None;
                    }
                    Err(e) => {
                        warn!(error = %e, "metadata actor unreachable");
                        actor.in_flight_since = None;
                    }
                }),
        );
    }

    /// `msg.node`, named primary of `msg.partition` at `msg.lease`, found records of that lease
    /// in its journal from before a restart and will not heal at it: name it again at the next
    /// lease (a `PartitionPrimaryAdvisory`, PASSIVE until it heals), so that records of one
    /// lease always come from one run of one primary. Ignored unless the committed state still
    /// names that node at that lease (the request is resent until the lease changes).
    fn renew_lease(&mut self, ctx: &mut Context<Self>, msg: PrimaryActive) {
        let current = self
            .state
            .partitions
            .get(&msg.partition)
            .is_some_and(|p| p.primary == Some(msg.node) && p.primary_lease_id == msg.lease.0);
        if !current {
            return;
        }
        let lease = msg.lease.0 + 1;
        info!(partition = %msg.partition, primary = %msg.node, from = %msg.lease, lease, "primary restarted at a lease it served before: proposing the next lease");
        let advisory = Advisory {
            kind: Some(AdvisoryKind::PartitionPrimary(PartitionPrimaryAdvisory {
                partitions: vec![bmq_proto::peer::PartitionInfo {
                    partition_id: msg.partition.0,
                    primary_node_id: Some(msg.node.0),
                    primary_lease_id: lease,
                    status: bmq_proto::peer::PrimaryStatus::Passive as i32,
                    replicas: lease_replicas_now(&self.state),
                }],
            })),
        };
        self.propose_answer(ctx, advisory);
    }

    /// Proposes `advisory`, the answer to a primary's notice, without tracking it: the primary
    /// resends its notice until the commit shows, so a lost proposal is made again.
    fn propose_answer(&mut self, ctx: &mut Context<Self>, advisory: Advisory) {
        ctx.spawn(
            self.metadata
                .send(Propose { advisory })
                .into_actor(self)
                .map(|_, _, _| ()),
        );
    }
}

impl Actor for HealthActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox_capacity);
        ctx.run_interval(CHECK_PERIOD, |actor, ctx| actor.check(ctx));
    }
}

impl Handler<ClusterStateCommitted> for HealthActor {
    type Result = ();

    fn handle(&mut self, msg: ClusterStateCommitted, ctx: &mut Self::Context) {
        let was_active = self.active_leader;
        self.active_leader = msg.status.role == MetadataRole::ActiveLeader;
        let changed = !Arc::ptr_eq(&self.state, &msg.state) || was_active != self.active_leader;
        if changed {
            self.in_flight_since = None;
        }
        self.state = msg.state;
        if changed {
            // A new active leader replaces the primaries of the nodes that are gone right after
            // its sync; a commit settles the proposal in flight, so the next step can go.
            self.check(ctx);
        }
    }
}

impl Handler<PrimaryActive> for HealthActor {
    type Result = ();

    fn handle(&mut self, msg: PrimaryActive, ctx: &mut Self::Context) {
        if !self.active_leader {
            return;
        }
        if msg.renew_lease {
            self.renew_lease(ctx, msg);
            return;
        }
        let current = self.state.partitions.get(&msg.partition).is_some_and(|p| {
            p.primary == Some(msg.node)
                && p.primary_lease_id == msg.lease.0
                && p.status != bmq_metadata::PrimaryStatus::Active
        });
        if !current {
            return;
        }
        info!(partition = %msg.partition, primary = %msg.node, lease = %msg.lease, "primary healed: committing ACTIVE");
        let advisory = Advisory {
            kind: Some(AdvisoryKind::PrimaryStatus(PrimaryStatusAdvisory {
                partition_id: msg.partition.0,
                primary_node_id: msg.node.0,
                primary_lease_id: msg.lease.0,
                status: bmq_proto::peer::PrimaryStatus::Active as i32,
            })),
        };
        self.propose_answer(ctx, advisory);
    }
}

impl Handler<NodeStopping> for HealthActor {
    type Result = ();

    fn handle(&mut self, msg: NodeStopping, ctx: &mut Self::Context) {
        let was = self.stopping.get(&msg.node).copied();
        let drained = msg.drained || was == Some(true);
        self.stopping.insert(msg.node, drained);
        match was {
            None if !drained => {
                info!(node = %msg.node, "node stopping: never a new primary; it keeps its primaries while it drains")
            }
            None | Some(false) if drained => {
                info!(node = %msg.node, "stopping node drained: its primaries move")
            }
            // A repeated announcement.
            _ => return,
        }
        self.in_flight_since = None;
        self.check(ctx);
    }
}

impl Handler<PeersChanged> for HealthActor {
    type Result = ();

    fn handle(&mut self, _msg: PeersChanged, ctx: &mut Self::Context) {
        self.check(ctx);
    }
}

impl Handler<GetStoppingPeers> for HealthActor {
    type Result = actix::MessageResult<GetStoppingPeers>;

    fn handle(&mut self, _msg: GetStoppingPeers, _ctx: &mut Self::Context) -> Self::Result {
        // `up` forgets stopping peers that have gone.
        self.up();
        let self_id = self.self_id;
        actix::MessageResult(
            self.stopping
                .keys()
                .copied()
                .filter(|n| *n != self_id)
                .collect(),
        )
    }
}
