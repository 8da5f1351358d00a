//! `HealthActor`: turns node failures into new partition primaries (DESIGN.md §6).
//!
//! Receives every `ClusterStateCommitted` from the metadata actor (role + committed state) and
//! reads peer availability from the [`PeerHub`]. Every `CHECK_PERIOD`, on the **active leader**
//! only, it computes `plan_primary_assignment(state, available)` — the pure decision in
//! `bmq_metadata` — and proposes the resulting `PartitionPrimaryAdvisory` (lease + 1 for each
//! moved partition) through the metadata actor. One proposal is in flight at a time; it is
//! considered settled at the next commit, or retried after `PROPOSAL_TIMEOUT`.
//!
//! A node that announces it is stopping (`NodeStopping`, from its `NodeStatusAdvisory
//! { STOPPING }` or from this node's own graceful stop) counts as unavailable for primaries
//! until its links drop, so the leader moves its partitions away while it still runs and
//! serves as a replica during the new primaries' healing (graceful stop, DESIGN.md §7).
//!
//! When every partition has a live, healed (ACTIVE) primary, primaries are rebalanced
//! gradually ([`plan_rebalance`]): one partition at a time moves from the node with the most
//! primaries to the one with the fewest, and only while they differ by two or more — a node
//! that returns gets its share back without a burst of moves, and a balanced cluster never
//! moves a primary. Safe because the journals are replicated: the new primary heals from a
//! quorum before serving.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, ActorFutureExt, AsyncContext, Context, Handler, Message, WrapFuture};
use bmq_metadata::{
    plan_primary_assignment, ClusterState, ClusterStateCommitted, MetadataActor, MetadataRole,
    Propose,
};
use bmq_proto::peer::{
    advisory::Kind as AdvisoryKind, Advisory, PartitionPrimaryAdvisory, PrimaryStatusAdvisory,
};
use bmq_proto::NodeId;
use tracing::{info, warn};

use crate::peers::PeerHub;

/// How often the active leader re-evaluates primary assignments.
const CHECK_PERIOD: Duration = Duration::from_millis(50);
/// A proposal not committed within this time is considered lost and may be made again.
const PROPOSAL_TIMEOUT: Duration = Duration::from_secs(2);

/// `node` healed `partition` at `lease` and asks for `PrimaryStatusAdvisory { ACTIVE }`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PrimaryActive {
    /// The primary.
    pub node: NodeId,
    /// The partition.
    pub partition: bmq_proto::PartitionId,
    /// Its `primary_lease_id`.
    pub lease: u64,
}

/// `node` announced a graceful stop: move its primaries away.
#[derive(Message)]
#[rtype(result = "()")]
pub struct NodeStopping {
    /// The stopping node.
    pub node: NodeId,
}

/// See the module doc.
pub struct HealthActor {
    self_id: NodeId,
    metadata: actix::Addr<MetadataActor>,
    peers: Arc<PeerHub>,
    active_leader: bool,
    state: Arc<ClusterState>,
    in_flight_since: Option<Instant>,
    /// Nodes that announced a graceful stop and are still connected.
    stopping: BTreeSet<NodeId>,
}

impl HealthActor {
    /// A health actor for this node.
    pub fn new(self_id: NodeId, metadata: actix::Addr<MetadataActor>, peers: Arc<PeerHub>) -> Self {
        HealthActor {
            self_id,
            metadata,
            peers,
            active_leader: false,
            state: Arc::new(ClusterState::new(0)),
            in_flight_since: None,
            stopping: BTreeSet::new(),
        }
    }

    fn available(&mut self) -> BTreeSet<NodeId> {
        let mut available: BTreeSet<NodeId> = self
            .peers
            .peer_availability()
            .into_iter()
            .filter_map(|(id, up)| up.then_some(id))
            .collect();
        available.insert(self.self_id);
        // A stopping peer that has gone is forgotten: when it comes back it is available.
        let self_id = self.self_id;
        self.stopping
            .retain(|n| *n == self_id || available.contains(n));
        for n in &self.stopping {
            available.remove(n);
        }
        available
    }

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
        let plan: Vec<_> = plan_primary_assignment(&self.state, &available)
            .into_iter()
            .map(|mut p| {
                // A new primary is passive until it has healed and says so (PrimaryActive).
                p.status = bmq_proto::peer::PrimaryStatus::Passive as i32;
                p
            })
            .filter(|p| {
                // Only partitions without a live primary (see the module doc).
                self.state
                    .partitions
                    .get(&bmq_proto::PartitionId(p.partition_id))
                    .is_none_or(|cur| cur.primary.is_none_or(|n| !available.contains(&n)))
            })
            .collect();
        let plan = if plan.is_empty() {
            match plan_rebalance(&self.state, &available) {
                Some(step) => vec![step],
                None => {
                    self.in_flight_since = None;
                    return;
                }
            }
        } else {
            plan
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
}

/// One step of gradual rebalancing (DESIGN.md §6): when every partition has an `available`,
/// ACTIVE primary and the available node with the most primaries has at least two more than
/// the one with the fewest, moves the highest-numbered partition of the former to the latter
/// (lease + 1, passive until it heals). Otherwise `None`. Ties: the lowest node id is chosen as
/// the source among equals, and as the target among equals.
pub fn plan_rebalance(
    state: &ClusterState,
    available: &BTreeSet<NodeId>,
) -> Option<bmq_proto::peer::PartitionInfo> {
    let mut counts: std::collections::BTreeMap<NodeId, usize> =
        available.iter().map(|n| (*n, 0)).collect();
    for p in state.partitions.values() {
        let primary = p.primary?;
        if !available.contains(&primary) || p.status != bmq_metadata::PrimaryStatus::Active {
            return None;
        }
        *counts.get_mut(&primary).expect("available") += 1;
    }
    let (&from, &most) = counts
        .iter()
        .max_by_key(|(n, c)| (**c, std::cmp::Reverse(**n)))?;
    let (&to, &fewest) = counts.iter().min_by_key(|(n, c)| (**c, **n))?;
    if most < fewest + 2 {
        return None;
    }
    let (id, p) = state
        .partitions
        .iter()
        .rev()
        .find(|(_, p)| p.primary == Some(from))?;
    Some(bmq_proto::peer::PartitionInfo {
        partition_id: id.0,
        primary_node_id: Some(to.0),
        primary_lease_id: p.primary_lease_id + 1,
        status: bmq_proto::peer::PrimaryStatus::Passive as i32,
    })
}

impl Actor for HealthActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(1024);
        ctx.run_interval(CHECK_PERIOD, |actor, ctx| actor.check(ctx));
    }
}

impl Handler<PrimaryActive> for HealthActor {
    type Result = ();

    fn handle(&mut self, msg: PrimaryActive, ctx: &mut Self::Context) {
        if !self.active_leader {
            return;
        }
        let current = self.state.partitions.get(&msg.partition).is_some_and(|p| {
            p.primary == Some(msg.node)
                && p.primary_lease_id == msg.lease
                && p.status != bmq_metadata::PrimaryStatus::Active
        });
        if !current {
            return;
        }
        info!(partition = %msg.partition, primary = %msg.node, lease = msg.lease, "primary healed: committing ACTIVE");
        let advisory = Advisory {
            kind: Some(AdvisoryKind::PrimaryStatus(PrimaryStatusAdvisory {
                partition_id: msg.partition.0,
                primary_node_id: msg.node.0,
                primary_lease_id: msg.lease,
                status: bmq_proto::peer::PrimaryStatus::Active as i32,
            })),
        };
        // The primary resends its notice until the commit shows; a lost proposal is retried.
        ctx.spawn(
            self.metadata
                .send(Propose { advisory })
                .into_actor(self)
                .map(|_, _, _| ()),
        );
    }
}

impl Handler<NodeStopping> for HealthActor {
    type Result = ();

    fn handle(&mut self, msg: NodeStopping, ctx: &mut Self::Context) {
        if self.stopping.insert(msg.node) {
            info!(node = %msg.node, "node stopping: its primaries will move");
            self.in_flight_since = None;
            self.check(ctx);
        }
    }
}

impl Handler<ClusterStateCommitted> for HealthActor {
    type Result = ();

    fn handle(&mut self, msg: ClusterStateCommitted, _ctx: &mut Self::Context) {
        let was_active = self.active_leader;
        self.active_leader = msg.status.role == MetadataRole::ActiveLeader;
        if !Arc::ptr_eq(&self.state, &msg.state) || was_active != self.active_leader {
            self.in_flight_since = None;
        }
        self.state = msg.state;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bmq_metadata::PrimaryStatus;
    use bmq_proto::PartitionId;

    fn state(primaries: &[(u32, PrimaryStatus)]) -> ClusterState {
        let mut s = ClusterState::new(primaries.len() as u32);
        for (i, (node, status)) in primaries.iter().enumerate() {
            let p = s.partitions.get_mut(&PartitionId(i as u32)).unwrap();
            p.primary = Some(NodeId(*node));
            p.primary_lease_id = 3;
            p.status = *status;
        }
        s
    }

    fn nodes(ids: &[u32]) -> BTreeSet<NodeId> {
        ids.iter().map(|n| NodeId(*n)).collect()
    }

    #[test]
    fn a_returning_node_gets_one_partition_at_a_time() {
        // Node 1 came back with no primaries; node 2 holds three: one moves, lease + 1.
        use PrimaryStatus::Active;
        let s = state(&[(2, Active), (3, Active), (2, Active), (2, Active)]);
        let step = plan_rebalance(&s, &nodes(&[1, 2, 3])).expect("a move");
        assert_eq!(
            step,
            bmq_proto::peer::PartitionInfo {
                partition_id: 3,
                primary_node_id: Some(1),
                primary_lease_id: 4,
                status: bmq_proto::peer::PrimaryStatus::Passive as i32,
            }
        );
    }

    #[test]
    fn a_balanced_cluster_never_moves_a_primary() {
        // Counts 2/1/1 differ by one: nothing moves.
        use PrimaryStatus::Active;
        let s = state(&[(1, Active), (2, Active), (3, Active), (1, Active)]);
        assert_eq!(plan_rebalance(&s, &nodes(&[1, 2, 3])), None);
    }

    #[test]
    fn no_move_while_a_primary_heals_or_is_missing() {
        // One move at a time: wait until the last moved partition is ACTIVE; and a partition
        // without a live primary is the failure path's business, not rebalancing's.
        use PrimaryStatus::{Active, Passive};
        let healing = state(&[(2, Active), (2, Passive), (2, Active), (3, Active)]);
        assert_eq!(plan_rebalance(&healing, &nodes(&[1, 2, 3])), None);
        let dead = state(&[(2, Active), (2, Active), (2, Active), (4, Active)]);
        assert_eq!(plan_rebalance(&dead, &nodes(&[1, 2, 3])), None);
    }
}
