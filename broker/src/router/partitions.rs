//! The router's partition actors: one per partition on every node (primary or replica, each
//! with its journal, each on its own arbiter thread), started and told their committed role
//! and lease as the cluster state changes; a node no longer primary steps down, it does not
//! exit. Also the effective quorum and the graceful stop's drain. Locks: `roles_told` then
//! `partitions` in [`Router::sync_partitions`] (main thread, per commit); everywhere else
//! `partitions` alone, held for non-blocking sends (main thread and every partition thread).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, Addr};
use bmq_dataplane::{ConsumerDefaults, PartitionConfig, ReplicationConfig, StoreConfig};
use bmq_metadata::{ClusterState, PrimaryStatus};
use bmq_proto::{LeaseId, NodeId, PartitionId};

use super::Router;
use crate::actors::partition::{
    wall_clock_ms, GetPartitionGauges, GetPartitionStats, PartitionActor, PartitionOutbox,
    PartitionRoleChanged, SetPartitionDomains, SetPartitionLearners, SetPartitionQuorum,
    StopDelivering,
};

/// What a graceful stop waits for before the primaries move ([`Router::drain_status`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainStatus {
    /// Messages pushed to consumers and not yet confirmed.
    pub unconfirmed: u64,
    /// Journal records not yet held by a quorum: once they are, a new primary knows every
    /// confirm given during the drain.
    pub uncommitted: u64,
}

impl DrainStatus {
    /// Nothing left to wait for.
    pub fn is_done(&self) -> bool {
        self.unconfirmed == 0 && self.uncommitted == 0
    }
}

/// How far this node's journals follow their primaries, as a learner reports it:
/// `(following, partitions)` over the partitions of `state` whose primary is another node;
/// `follows(p)` says whether this node's journal of `p` is synchronised by that primary
/// ([`bmq_dataplane::PartitionGauges::follows_primary`]).
pub fn journals_following(
    state: &ClusterState,
    self_id: NodeId,
    follows: impl Fn(PartitionId) -> bool,
) -> (u32, u32) {
    let mut following = 0;
    let mut partitions = 0;
    for (id, p) in &state.partitions {
        if p.primary.is_none_or(|primary| primary == self_id) {
            continue;
        }
        partitions += 1;
        if follows(*id) {
            following += 1;
        }
    }
    (following, partitions)
}

/// A partition's committed role as told to its actor: primary, lease, ACTIVE.
pub(super) type RoleTold = (Option<NodeId>, LeaseId, bool);

impl Router {
    /// Starts an actor (opening its journal) for every partition of `state` not yet running,
    /// each on its own arbiter thread, and tells each actor its partition's committed primary
    /// and lease when they differ from what it was last told (an actor no longer primary steps
    /// down to replica). Called when the committed partitions change. A journal that cannot
    /// be opened (I/O error, corruption) stops the node: serving without it could lose
    /// acknowledged messages. An actor whose mailbox was full is told at the next call
    /// ([`Router::partition_roles_stale`] says one is due).
    pub fn sync_partitions(self: &Arc<Self>, state: &ClusterState) {
        let mut all_told = true;
        let mut told = self.roles_told.lock().expect("roles lock");
        let mut partitions = self.partitions.lock().expect("partitions lock");
        for (id, p) in &state.partitions {
            if !partitions.contains_key(id) {
                let cfg = self.partition_config(*id);
                let outbox: Arc<dyn PartitionOutbox> = self.clone();
                let actor = PartitionActor::new(
                    *id,
                    self.journal_dir(*id),
                    self.store_config(),
                    cfg,
                    self.domains.apps_of(),
                    outbox,
                    self.config.limits.mailbox_capacity(),
                );
                // Each partition runs on its own thread (its journal is opened there, so the
                // partitions of a restarting node are read in parallel), so journal fsyncs
                // never delay the peer links, the sessions or another partition.
                let arbiter = actix::Arbiter::new();
                let addr = PartitionActor::start_in_arbiter(&arbiter.handle(), move |_| actor);
                let learners = self.learners.lock().expect("learners lock").clone();
                if !learners.is_empty() {
                    // Rare (a partition's first start); a full mailbox is reported.
                    if addr.try_send(SetPartitionLearners { learners }).is_err() {
                        metrics::counter!("bmq_mailbox_full_total", "actor" => "partition")
                            .increment(1);
                    }
                }
                partitions.insert(*id, addr);
            }
            let addr = partitions.get(id).expect("inserted above");
            let role = (
                p.primary,
                LeaseId(p.primary_lease_id),
                p.status == PrimaryStatus::Active,
            );
            if told.get(id) == Some(&role) {
                continue;
            }
            // Bounded by the commit rate; a full mailbox is caught up at the next commit. A
            // lease's replicas change only with the lease, so `role` tells when they are due.
            let message = PartitionRoleChanged {
                primary: role.0,
                lease: role.1,
                active: role.2,
                replicas: state
                    .lease_replicas(*id)
                    .map(|r| r.into_iter().collect())
                    .unwrap_or_default(),
            };
            if addr.try_send(message).is_err() {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "partition").increment(1);
                told.remove(id);
                all_told = false;
            } else {
                told.insert(*id, role);
            }
        }
        self.roles_stale.store(!all_told, Ordering::Relaxed);
    }

    /// Whether a partition actor may not know its committed role yet, so that
    /// [`Router::sync_partitions`] is due at the next commit even if no partition changed.
    pub fn partition_roles_stale(&self) -> bool {
        self.roles_stale.load(Ordering::Relaxed)
    }

    /// The partition actors this node runs, for `/status`.
    pub fn local_partitions(&self) -> Vec<(PartitionId, Addr<PartitionActor>)> {
        self.partitions
            .lock()
            .expect("partitions lock")
            .iter()
            .map(|(id, a)| (*id, a.clone()))
            .collect()
    }

    /// The partition core of `id` on this node, built from the configuration.
    fn partition_config(&self, id: PartitionId) -> PartitionConfig {
        let c = &self.config;
        PartitionConfig {
            replication: ReplicationConfig {
                self_id: self.self_id,
                partition: id,
                members: c.members.iter().map(|m| NodeId(m.id)).collect(),
                quorum: self.quorum.load(Ordering::SeqCst),
                batch_records_max: c.replication.batch_records_max as usize,
                in_flight_records_max: c.replication.in_flight_records_max,
                resend_after: c.replication.resend_after(),
                guid_window_max: usize::try_from(c.limits.duplicate_guid_window_max)
                    .unwrap_or(usize::MAX),
                guid_window_age: c.limits.duplicate_guid_window(),
                in_sync_timeout: c.storage.in_sync_timeout(),
            },
            policies: self.domains.policies(),
            consumer_defaults: ConsumerDefaults {
                max_unconfirmed_messages: u32::try_from(c.limits.max_unconfirmed_messages_default)
                    .unwrap_or(u32::MAX),
                max_unconfirmed_bytes: c.limits.max_unconfirmed_bytes_default,
            },
            wall_clock_anchor: (Instant::now(), wall_clock_ms()),
        }
    }

    /// The journal settings of every partition on this node (`[storage]`).
    fn store_config(&self) -> StoreConfig {
        let s = &self.config.storage;
        StoreConfig {
            segment_size_max: s.segment_size_bytes(),
            cache_bytes_max: s.cache_bytes(),
            quota_bytes: s.partition_quota_bytes(),
            fsync: true,
            recycle: s.recycle_segments,
        }
    }

    fn journal_dir(&self, id: PartitionId) -> PathBuf {
        self.config
            .data_dir
            .join("partitions")
            .join(id.0.to_string())
    }

    /// Tells every partition (and those started later) the membership's learners: as primary
    /// it streams its journal to them, counting them in no quorum. Called with each committed
    /// membership.
    pub fn set_partition_learners(&self, learners: Vec<NodeId>) {
        {
            let mut told = self.learners.lock().expect("learners lock");
            if *told == learners {
                return;
            }
            told.clone_from(&learners);
        }
        self.each_partition(|addr| {
            // Rare (one per membership change); a full mailbox is counted.
            if addr
                .try_send(SetPartitionLearners {
                    learners: learners.clone(),
                })
                .is_err()
            {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "partition").increment(1);
            }
        });
    }

    /// Takes the domains of a committed `state` ([`DomainCache::update`]) and, if they
    /// changed, tells every partition (partitions started later read the cache).
    pub fn sync_domains(&self, state: &ClusterState) {
        let Some(policies) = self.domains.update(state) else {
            return;
        };
        self.each_partition(|addr| {
            // Rate-bounded by operators' domain changes (one message per change and
            // partition), and it must not be lost to a full mailbox: do_send.
            addr.do_send(SetPartitionDomains {
                policies: policies.clone(),
            });
        });
    }

    /// How this node's `[[domains]]` differ from the committed domains, if they do.
    pub fn domains_file_disagreement(&self, state: &ClusterState) -> Option<String> {
        self.domains.file_disagreement(state)
    }

    /// Sets the quorum of every partition (and of partitions started later); 0 is a majority
    /// of each lease's replicas.
    pub fn set_partition_quorum(&self, quorum: usize) {
        self.quorum.store(quorum, Ordering::SeqCst);
        self.each_partition(|addr| {
            // Rare (an operator action); a full mailbox is reported to the caller's log.
            if addr.try_send(SetPartitionQuorum { quorum }).is_err() {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "partition").increment(1);
            }
        });
    }

    /// Graceful stop: every local partition pushes nothing new from now on.
    pub fn stop_delivering(&self) {
        self.each_partition(|addr| {
            // Once per stop; a partition that misses it keeps delivering until the move.
            if addr.try_send(StopDelivering).is_err() {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "partition").increment(1);
            }
        });
    }

    /// [`journals_following`] over this node's partition actors (their O(1) gauges, cheap
    /// enough to ask every few hundred milliseconds); one that does not answer
    /// within `timeout` counts as not following.
    pub async fn journals_following(
        &self,
        state: &ClusterState,
        timeout: std::time::Duration,
    ) -> (u32, u32) {
        let mut follows = std::collections::BTreeSet::new();
        for (id, addr) in self.local_partitions() {
            if let Ok(Ok(Some(gauges))) =
                tokio::time::timeout(timeout, addr.send(GetPartitionGauges)).await
            {
                if gauges.follows_primary {
                    follows.insert(id);
                }
            }
        }
        journals_following(state, self.self_id, |p| follows.contains(&p))
    }

    /// What a graceful stop still waits for on the partitions this node is the active
    /// primary of: messages pushed and not yet confirmed, and journal records (confirms among
    /// them) not yet held by a quorum. A partition that does not answer within `timeout`
    /// counts as having nothing left.
    pub async fn drain_status(&self, timeout: std::time::Duration) -> DrainStatus {
        let mut status = DrainStatus::default();
        for (_, addr) in self.local_partitions() {
            if let Ok(Ok(Some(stats))) =
                tokio::time::timeout(timeout, addr.send(GetPartitionStats)).await
            {
                let g = &stats.gauges;
                if g.role == bmq_dataplane::PartitionRole::Active {
                    status.unconfirmed += stats.unconfirmed;
                    status.uncommitted += g.last_sequence.saturating_sub(g.committed);
                }
            }
        }
        status
    }

    /// Hands `message` to partition `id`'s actor, through its address where the router keeps
    /// it: cloning an actix `Addr` allocates two `Arc`s and updates the mailbox's sender
    /// count. `Err((message, known))`: `known` false when this node has no actor for `id`,
    /// true when its mailbox is full or closed.
    pub(super) fn send_to_partition<M>(&self, id: PartitionId, message: M) -> Result<(), (M, bool)>
    where
        M: actix::Message + Send + 'static,
        M::Result: Send,
        PartitionActor: actix::Handler<M>,
    {
        let partitions = self.partitions.lock().expect("partitions lock");
        let Some(addr) = partitions.get(&id) else {
            return Err((message, false));
        };
        addr.try_send(message).map_err(|e| match e {
            actix::prelude::SendError::Full(m) | actix::prelude::SendError::Closed(m) => (m, true),
        })
    }

    /// Calls `f` with every local partition actor's address, under the `partitions` lock.
    pub(super) fn each_partition(&self, f: impl Fn(&Addr<PartitionActor>)) {
        for addr in self.partitions.lock().expect("partitions lock").values() {
            f(addr);
        }
    }
}
