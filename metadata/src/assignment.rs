//! Pure decisions about placement (DESIGN.md §6, §7): which partition a new queue goes to, and
//! which node is primary for each partition. The active leader applies them by proposing
//! advisories; they never touch the state themselves.

use std::collections::{BTreeMap, BTreeSet};

use bmq_proto::{peer, NodeId, PartitionId};

use crate::state::{ClusterState, PrimaryStatus};

/// The partition a new queue is assigned to: among partitions that have a primary, the one with
/// the fewest queues; ties go to the lowest partition id. `None` when no partition has a primary
/// (the caller retries once primaries are assigned).
pub fn pick_partition_for_queue(state: &ClusterState) -> Option<PartitionId> {
    state
        .partitions
        .iter()
        .filter(|(_, p)| p.primary.is_some())
        .map(|(id, _)| (state.queue_count(*id), *id))
        .min()
        .map(|(_, id)| id)
}

/// The primary changes the active leader should propose, as `PartitionPrimaryAdvisory` entries.
///
/// - Every partition whose primary is `None` or not in `available` goes to the available node with
///   the fewest primaries, counting the assignments made earlier in this plan (ties: lowest node
///   id), with `primary_lease_id + 1` and status `ACTIVE`. BlazingMQ documents this "least
///   assigned" policy.
/// - A partition whose primary is available keeps it: a healthy primary is never moved to fill a
///   gap.
/// - When nothing needs reassignment but the primary counts of the available nodes differ by 2 or
///   more, ONE partition (the lowest id) moves from the most loaded node (ties: lowest id) to the
///   least loaded (ties: lowest id), lease + 1. Calling the plan again after each commit
///   rebalances gradually, one partition at a time.
/// - An empty `available` set gives an empty plan.
pub fn plan_primary_assignment(
    state: &ClusterState,
    available: &BTreeSet<NodeId>,
) -> Vec<peer::PartitionInfo> {
    if available.is_empty() {
        return Vec::new();
    }
    let mut load: BTreeMap<NodeId, usize> = available.iter().map(|n| (*n, 0)).collect();
    let mut orphans = Vec::new();
    for (id, p) in &state.partitions {
        match p.primary {
            Some(node) if available.contains(&node) => *load.entry(node).or_default() += 1,
            _ => orphans.push(*id),
        }
    }
    let replicas = lease_replicas_now(state);
    let info = |id: PartitionId, node: NodeId| peer::PartitionInfo {
        partition_id: id.0,
        primary_node_id: Some(node.0),
        primary_lease_id: state.partitions[&id].primary_lease_id + 1,
        status: PrimaryStatus::Active.to_wire(),
        replicas: replicas.clone(),
    };
    if !orphans.is_empty() {
        let mut plan = Vec::with_capacity(orphans.len());
        for id in orphans {
            let node = least_loaded(&load);
            *load.get_mut(&node).expect("node is available") += 1;
            plan.push(info(id, node));
        }
        return plan;
    }
    let least = least_loaded(&load);
    let (most, most_count) = load
        .iter()
        .map(|(n, c)| (*n, *c))
        .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
        .expect("available is not empty");
    if most_count < load[&least] + 2 {
        return Vec::new();
    }
    let id = state
        .partitions
        .iter()
        .find(|(_, p)| p.primary == Some(most))
        .map(|(id, _)| *id)
        .expect("the most loaded node is primary somewhere");
    vec![info(id, least)]
}

fn least_loaded(load: &BTreeMap<NodeId, usize>) -> NodeId {
    load.iter()
        .map(|(n, c)| (*c, *n))
        .min()
        .map(|(_, n)| n)
        .expect("load is not empty")
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
        if !available.contains(&primary) || p.status != PrimaryStatus::Active {
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
        replicas: lease_replicas_now(state),
    })
}

/// The replica list a lease assigned now carries (`PartitionInfo.replicas`): the committed
/// membership's [`ClusterMembership::partition_voters`](crate::ClusterMembership::partition_voters),
/// in id order; empty before a membership is committed (the configured members replicate).
pub fn lease_replicas_now(state: &ClusterState) -> Vec<u32> {
    state
        .membership
        .as_deref()
        .map(|m| m.partition_voters().into_iter().map(|n| n.0).collect())
        .unwrap_or_default()
}

/// The partitions whose live primary should start a new lease with the current voters as its
/// replicas (a membership change promoted or retired a voter): the same primary at lease + 1,
/// PASSIVE until it heals from a majority of the new replicas. A partition whose primary is
/// not in `available` is left to the failure path (or, draining, to its drain).
pub fn plan_replica_change(
    state: &ClusterState,
    available: &BTreeSet<NodeId>,
) -> Vec<peer::PartitionInfo> {
    let Some(membership) = state.membership.as_deref() else {
        return Vec::new();
    };
    let voters = membership.partition_voters();
    let replicas = lease_replicas_now(state);
    state
        .partitions
        .iter()
        .filter(|(id, p)| {
            p.primary.is_some_and(|n| available.contains(&n))
                && state.lease_replicas(**id).as_ref() != Some(&voters)
        })
        .map(|(id, p)| peer::PartitionInfo {
            partition_id: id.0,
            primary_node_id: p.primary.map(|n| n.0),
            primary_lease_id: p.primary_lease_id + 1,
            status: peer::PrimaryStatus::Passive as i32,
            replicas: replicas.clone(),
        })
        .collect()
}

/// The `PartitionPrimaryAdvisory` entries the active leader proposes now, or `None` when
/// nothing should move (DESIGN.md §6, §7: the health actor applies it).
///
/// - `available`: the nodes that may be given a primary (up and not stopping).
/// - `draining`: the nodes that announced a graceful stop and have not drained yet; they are
///   never in `available`, and they keep their primaries until they drain (their consumers
///   confirm what they hold, their journals reach a quorum).
///
/// First the failure path: [`plan_primary_assignment`]'s entries for the partitions whose
/// primary is neither available nor draining (a live primary is never moved to fill a gap),
/// each PASSIVE, since a new primary serves only once it has healed from a quorum and says so.
/// When none needs a new primary, the new leases of [`plan_replica_change`] (the voters
/// changed); then one step of [`plan_rebalance`]. `None` when none has anything to do, and
/// when no node is available.
pub fn plan_primaries(
    state: &ClusterState,
    available: &BTreeSet<NodeId>,
    draining: &BTreeSet<NodeId>,
) -> Option<Vec<peer::PartitionInfo>> {
    let plan: Vec<peer::PartitionInfo> = plan_primary_assignment(state, available)
        .into_iter()
        .map(|mut p| {
            p.status = peer::PrimaryStatus::Passive as i32;
            p
        })
        .filter(|p| {
            state
                .partitions
                .get(&PartitionId(p.partition_id))
                .is_none_or(|cur| {
                    cur.primary
                        .is_none_or(|n| !available.contains(&n) && !draining.contains(&n))
                })
        })
        .collect();
    if !plan.is_empty() {
        return Some(plan);
    }
    let plan = plan_replica_change(state, available);
    if !plan.is_empty() {
        return Some(plan);
    }
    plan_rebalance(state, available).map(|step| vec![step])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tests::{assign, primaries};

    fn nodes(ids: &[u32]) -> BTreeSet<NodeId> {
        ids.iter().map(|n| NodeId(*n)).collect()
    }

    fn plan(entries: &[(u32, u32, u64)]) -> Vec<peer::PartitionInfo> {
        entries
            .iter()
            .map(|(p, n, lease)| peer::PartitionInfo {
                partition_id: *p,
                primary_node_id: Some(*n),
                primary_lease_id: *lease,
                status: peer::PrimaryStatus::Active as i32,
                replicas: vec![],
            })
            .collect()
    }

    #[test]
    fn queue_goes_to_the_partition_with_fewest_queues() {
        // Scenario: only partitions with a primary are candidates; fewest queues wins, then lowest id.
        let mut s = ClusterState::new(3);
        assert_eq!(pick_partition_for_queue(&s), None);
        s.apply(&primaries(&[(1, Some(1), 1), (2, Some(2), 1)]))
            .unwrap();
        assert_eq!(pick_partition_for_queue(&s), Some(PartitionId(1)));
        s.apply(&assign("a", 1, 0)).unwrap();
        assert_eq!(pick_partition_for_queue(&s), Some(PartitionId(2)));
        s.apply(&assign("b", 2, 1)).unwrap();
        assert_eq!(pick_partition_for_queue(&s), Some(PartitionId(1)));
        // Partition 0 has no primary: never chosen even with zero queues.
        s.apply(&assign("c", 1, 2)).unwrap();
        assert_eq!(pick_partition_for_queue(&s), Some(PartitionId(2)));
    }

    #[test]
    fn fresh_cluster_spreads_primaries_round_robin() {
        // Scenario: no partition has a primary; each goes to the least loaded node, lease 1.
        let s = ClusterState::new(4);
        assert_eq!(
            plan_primary_assignment(&s, &nodes(&[1, 2, 3])),
            plan(&[(0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 1, 1)])
        );
        assert!(plan_primary_assignment(&s, &BTreeSet::new()).is_empty());
    }

    #[test]
    fn failed_node_partitions_go_to_least_loaded_and_healthy_ones_stay() {
        // Scenario: node 3 dies; only its partitions move, to the nodes with fewest primaries.
        let mut s = ClusterState::new(5);
        s.apply(&primaries(&[
            (0, Some(1), 1),
            (1, Some(2), 1),
            (2, Some(3), 4),
            (3, Some(1), 1),
            (4, Some(3), 2),
        ]))
        .unwrap();
        // Node 1 has 2, node 2 has 1: partition 2 -> node 2, then partition 4 -> node 1 (tie 2/2, lowest id).
        assert_eq!(
            plan_primary_assignment(&s, &nodes(&[1, 2])),
            plan(&[(2, 2, 5), (4, 1, 3)])
        );
        // All primaries alive and balanced: nothing to do.
        assert!(plan_primary_assignment(&s, &nodes(&[1, 2, 3])).is_empty());
    }

    #[test]
    fn returning_node_gets_one_partition_at_a_time() {
        // Scenario: node 3 returns empty while 1 and 2 hold everything; exactly one partition moves.
        let mut s = ClusterState::new(4);
        s.apply(&primaries(&[
            (0, Some(1), 1),
            (1, Some(2), 1),
            (2, Some(1), 1),
            (3, Some(2), 1),
        ]))
        .unwrap();
        let step = plan_primary_assignment(&s, &nodes(&[1, 2, 3]));
        assert_eq!(step, plan(&[(0, 3, 2)]));
        s.apply(&peer::Advisory {
            kind: Some(peer::advisory::Kind::PartitionPrimary(
                peer::PartitionPrimaryAdvisory { partitions: step },
            )),
        })
        .unwrap();
        // Now 1:1, 2:2, 3:1 -> max-min is 1: balanced enough, nothing moves.
        assert!(plan_primary_assignment(&s, &nodes(&[1, 2, 3])).is_empty());
        // A node with no primaries among two with 1 each: difference 1, nothing moves.
        let mut s = ClusterState::new(2);
        s.apply(&primaries(&[(0, Some(1), 1), (1, Some(2), 1)]))
            .unwrap();
        assert!(plan_primary_assignment(&s, &nodes(&[1, 2, 3])).is_empty());
    }
}

#[cfg(test)]
mod rebalance_tests {
    use super::*;
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
                replicas: vec![],
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

#[cfg(test)]
mod plan_primaries_tests {
    use super::*;
    use crate::state::tests::primaries;

    fn nodes(ids: &[u32]) -> BTreeSet<NodeId> {
        ids.iter().map(|n| NodeId(*n)).collect()
    }

    fn passive(partition: u32, node: u32, lease: u64) -> peer::PartitionInfo {
        peer::PartitionInfo {
            partition_id: partition,
            primary_node_id: Some(node),
            primary_lease_id: lease,
            status: peer::PrimaryStatus::Passive as i32,
            replicas: vec![],
        }
    }

    /// Every partition's primary set and ACTIVE at lease 1.
    fn active(owners: &[u32]) -> ClusterState {
        let mut s = ClusterState::new(owners.len() as u32);
        for (i, node) in owners.iter().enumerate() {
            let p = s.partitions.get_mut(&PartitionId(i as u32)).unwrap();
            p.primary = Some(NodeId(*node));
            p.primary_lease_id = 1;
            p.status = PrimaryStatus::Active;
        }
        s
    }

    #[test]
    fn a_failed_primary_goes_to_the_least_loaded_healthy_node() {
        // Node 3 is gone: its partition goes to node 2 (one primary against node 1's two),
        // lease + 1, passive until it heals; the live primaries stay where they are.
        let s = active(&[1, 1, 2, 3]);
        assert_eq!(
            plan_primaries(&s, &nodes(&[1, 2]), &BTreeSet::new()),
            Some(vec![passive(3, 2, 2)])
        );
    }

    #[test]
    fn a_draining_primary_keeps_its_partitions_until_it_drained() {
        // Node 3 is stopping: while it drains nothing moves (and nothing is rebalanced around
        // it); once drained (no longer draining, still not available) its partition moves.
        let s = active(&[1, 2, 3]);
        let available = nodes(&[1, 2]);
        assert_eq!(plan_primaries(&s, &available, &nodes(&[3])), None);
        assert_eq!(
            plan_primaries(&s, &available, &BTreeSet::new()),
            Some(vec![passive(2, 1, 2)])
        );
    }

    #[test]
    fn a_healthy_balanced_cluster_has_nothing_to_do() {
        // Every primary is live and ACTIVE and the counts differ by at most one.
        let s = active(&[1, 2, 3, 1]);
        assert_eq!(
            plan_primaries(&s, &nodes(&[1, 2, 3]), &BTreeSet::new()),
            None
        );
    }

    #[test]
    fn a_returning_node_gets_one_partition_by_rebalancing() {
        // Nothing failed and node 3 holds none of four: one partition moves to it (from the
        // most loaded node, its highest-numbered partition), passive.
        let s = active(&[1, 2, 1, 2]);
        assert_eq!(
            plan_primaries(&s, &nodes(&[1, 2, 3]), &BTreeSet::new()),
            Some(vec![passive(2, 3, 2)])
        );
    }

    #[test]
    fn no_healthy_node_keeps_every_primary() {
        // No node may be given a primary: nothing is proposed, whatever the state.
        let mut s = ClusterState::new(2);
        assert_eq!(plan_primaries(&s, &BTreeSet::new(), &BTreeSet::new()), None);
        s.apply(&primaries(&[(0, Some(1), 1), (1, Some(2), 1)]))
            .unwrap();
        assert_eq!(plan_primaries(&s, &BTreeSet::new(), &nodes(&[2])), None);
    }
}
