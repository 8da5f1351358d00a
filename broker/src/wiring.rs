//! The glue between the node's actors, each built with everything it needs (no late binding).
//!
//! - [`ControlSender`]: sends the elector's and the metadata actor's outbound messages over the
//!   peer CONTROL channel.
//! - [`CommitFanout`]: relays leadership changes to the metadata actor, and every committed
//!   cluster state to the router (partition roles; opens waiting for a queue's assignment),
//!   the state watch (sessions, admin) and the health actor. What it does per commit is
//!   O(changes), never O(state): its cost per commit does not grow with the number of queues.
//! - [`PeerDemux`]: routes each frame from a peer to the actor that owns it (elector, metadata,
//!   health, router); peer availability to the elector and the health actor, and the data
//!   link's losses and returns to the router.

use std::sync::Arc;

use actix::{Actor, Addr, AsyncContext, Context, Handler};
use bmq_metadata::{ClusterMembership, ClusterState, MemberRole};
use bmq_proto::peer::{
    metadata_message::Kind as MetadataKind, peer_message::Kind, Channel, NodeStatusKind,
    PeerMessage,
};
use bmq_proto::NodeId;
use tokio::sync::watch;

use crate::actors::elector::{
    ElectorActor, ElectorInbound, ElectorOutbound, LeadershipChanged, PeerAvailability, Retire,
    SetMembership,
};
use crate::actors::health::{HealthActor, NodeStopping, PeersChanged};
use crate::actors::metadata::{
    ClusterStateCommitted, LeaderChanged, LearnMembers, MetadataActor, MetadataInbound,
    MetadataOutbound,
};
use crate::net::peers::{PeerHub, PeerInbound};
use crate::router::Router;
use bmq_elector::Membership;
use tracing::info;

/// Sends the elector's and the metadata actor's outbound messages over the CONTROL channel.
pub struct ControlSender {
    /// The peer links.
    pub hub: Arc<PeerHub>,
}

impl ControlSender {
    fn send(&self, to: Option<NodeId>, message: PeerMessage) {
        match to {
            Some(to) => {
                self.hub.send(to, Channel::Control, message);
            }
            None => self.hub.broadcast(Channel::Control, message),
        }
    }
}

impl Actor for ControlSender {
    type Context = Context<Self>;
}

impl Handler<ElectorOutbound> for ControlSender {
    type Result = ();

    fn handle(&mut self, msg: ElectorOutbound, _ctx: &mut Self::Context) {
        let message = PeerMessage {
            kind: Some(Kind::Elector(msg.message)),
        };
        self.send(msg.to, message);
    }
}

impl Handler<MetadataOutbound> for ControlSender {
    type Result = ();

    fn handle(&mut self, msg: MetadataOutbound, _ctx: &mut Self::Context) {
        let message = PeerMessage {
            kind: Some(Kind::Metadata(msg.message)),
        };
        self.send(msg.to, message);
    }
}

/// Relays state changes between actors (see the module doc).
pub struct CommitFanout {
    /// The metadata actor (told about leadership changes).
    pub metadata: Addr<MetadataActor>,
    /// The health actor (told every commit).
    pub health: Addr<HealthActor>,
    /// The router (starts and informs the partition actors on every commit).
    pub router: Arc<Router>,
    /// The committed state, for sessions and the admin server.
    pub state_tx: watch::Sender<Arc<ClusterState>>,
    /// The elector (told each committed membership).
    pub elector: Addr<ElectorActor>,
    /// The peer links (members added and removed with the committed membership).
    pub peers: Arc<PeerHub>,
    /// This node.
    pub self_id: NodeId,
    /// Notified when the committed membership removed this node: it exits.
    pub removed: Arc<tokio::sync::Notify>,
}

/// Counts the change from `old` to `new` in `bmq_cluster_membership_changes_total{kind}`.
fn count_membership_change(old: &ClusterMembership, new: &ClusterMembership) {
    for id in old.ids().union(&new.ids()) {
        let kind = match (old.members.get(id), new.members.get(id)) {
            (None, Some(_)) => "added",
            (Some(_), None) => "removed",
            (Some(a), Some(b)) if a.role != b.role => match b.role {
                MemberRole::Voter => "promoted",
                MemberRole::Leaving => "leaving",
                MemberRole::Learner => "demoted",
            },
            (Some(a), Some(b)) if a != b => "moved",
            _ => continue,
        };
        metrics::counter!("bmq_cluster_membership_changes_total", "kind" => kind).increment(1);
    }
}

/// How long the links to a node removed from the membership stay after the removal commits.
const REMOVED_PEER_LINGER: std::time::Duration = std::time::Duration::from_millis(500);

/// The elector's view of a committed membership: every member, the voters (voter and leaving
/// roles), and the epoch. The files' static membership, before the ledger holds one, is the
/// elector's epoch 0; the ledger's seeded membership is epoch 1.
pub fn elector_membership(membership: &ClusterMembership) -> Membership {
    Membership {
        epoch: membership.epoch,
        members: membership.ids(),
        voters: membership.voters(),
    }
}

impl Actor for CommitFanout {
    type Context = Context<Self>;
}

impl Handler<LeadershipChanged> for CommitFanout {
    type Result = ();

    fn handle(&mut self, msg: LeadershipChanged, _ctx: &mut Self::Context) {
        // Leadership changes are rare (bounded by the elector's timers), so do_send is fine.
        self.metadata.do_send(LeaderChanged {
            term: msg.status.term,
            leader: msg.status.leader,
        });
    }
}

impl Handler<ClusterStateCommitted> for CommitFanout {
    type Result = ();

    fn handle(&mut self, msg: ClusterStateCommitted, ctx: &mut Self::Context) {
        let before = self.state_tx.borrow().clone();
        if let Some(membership) = &msg.state.membership {
            let epoch = before.membership.as_ref().map_or(0, |m| m.epoch);
            if membership.epoch > epoch {
                self.peers.follow_membership(membership);
                if let Some(old) = &before.membership {
                    count_membership_change(old, membership);
                }
                // A little later: the commit of its removal, queued for it by the metadata
                // actor just before this publication, goes out first (and it exits on it).
                let peers = self.peers.clone();
                let removed: Vec<NodeId> = membership.removed.iter().copied().collect();
                ctx.run_later(REMOVED_PEER_LINGER, move |_, _| {
                    for id in removed {
                        peers.remove_peer(id);
                    }
                });
                if membership.removed.contains(&self.self_id) {
                    self.removed.notify_one();
                }
                // Rare (one per membership change): do_send is fine.
                self.elector.do_send(SetMembership {
                    membership: elector_membership(membership),
                });
                self.router.set_partition_learners(learners_of(membership));
                if membership.role(self.self_id) == Some(MemberRole::Leaving) {
                    // A leaving member never leads again (it still votes): the active leader
                    // removes a leaving member once it holds no primary, never itself, so a
                    // leaving leader would keep itself for ever.
                    self.elector.do_send(Retire);
                }
            }
        }
        if msg
            .state
            .domains
            .as_ref()
            .is_some_and(|d| before.domains.as_ref().is_none_or(|b| !Arc::ptr_eq(b, d)))
        {
            self.router.sync_domains(&msg.state);
        }
        let partitions_changed = !before.same_partitions(&msg.state);
        if partitions_changed || self.router.partition_roles_stale() {
            self.router.sync_partitions(&msg.state);
        }
        // Every reader of the watch (admin, the router's forwarding, opens) sees the new state
        // at once; its waiters — every client session, which routes by partition — wake only
        // when the partitions changed, not for every queue assignment. (The value is always
        // replaced; `false` makes it what tokio's docs call a silent modification: visible to
        // `borrow`, without a change notification.)
        if !Arc::ptr_eq(&before, &msg.state) {
            self.state_tx.send_if_modified(|state| {
                *state = msg.state.clone();
                partitions_changed
            });
        }
        // Opens waiting for a queue: only the changed queues are looked at.
        self.router.assignments_committed(&before, &msg.state);
        // Commits are rate-bounded by the metadata quorum round trips (and published once per
        // turn of the metadata actor), so do_send is fine.
        self.health.do_send(msg);
    }
}

/// Routes peer frames to the actor that owns them (see the module doc). A full mailbox drops
/// the frame and counts it (`bmq_mailbox_full_total`): every peer protocol retries.
pub struct PeerDemux {
    /// The elector actor.
    pub elector: Addr<ElectorActor>,
    /// The metadata actor.
    pub metadata: Addr<MetadataActor>,
    /// The health actor (node status).
    pub health: Addr<HealthActor>,
    /// The router (DATA channel traffic).
    pub router: Arc<Router>,
    /// This node.
    pub self_id: NodeId,
    /// Notified when a peer's membership says this node was removed: it exits.
    pub removed: Arc<tokio::sync::Notify>,
}

fn mailbox_full(actor: &'static str) {
    metrics::counter!("bmq_mailbox_full_total", "actor" => actor).increment(1);
}

impl PeerDemux {
    /// A metadata message: node status to the health actor (DESIGN.md §6), the rest to the
    /// metadata actor.
    fn metadata_message(&self, from: NodeId, m: bmq_proto::peer::MetadataMessage) {
        if let Some(MetadataKind::NodeStatus(ns)) = &m.kind {
            let drained = match NodeStatusKind::try_from(ns.status) {
                Ok(NodeStatusKind::NodeStatusStopping) => false,
                Ok(NodeStatusKind::NodeStatusDrained) => true,
                _ => return,
            };
            let stopping = NodeStopping {
                node: from,
                drained,
            };
            if ns.node_id == from.0 && self.health.try_send(stopping).is_err() {
                mailbox_full("health");
            }
            return;
        }
        if self
            .metadata
            .try_send(MetadataInbound { from, message: m })
            .is_err()
        {
            mailbox_full("metadata");
        }
    }
}

/// Whether a peer message belongs to the data plane (the router's), not the elector's or the
/// metadata core's.
fn is_data(kind: &Option<Kind>) -> bool {
    matches!(
        kind,
        Some(Kind::Forwarded(_))
            | Some(Kind::SessionGone(_))
            | Some(Kind::ConsumersReleased(_))
            | Some(Kind::Partition(_))
            | Some(Kind::PrimaryActive(_))
    )
}

impl PeerInbound for PeerDemux {
    fn on_membership(&self, from: NodeId, membership: &ClusterMembership) {
        info!(peer = %from, epoch = membership.epoch, "a peer holds a newer committed membership: following it");
        if membership.removed.contains(&self.self_id) {
            self.removed.notify_one();
            return;
        }
        // The elector ignores an epoch older than its own; the ledger learns the membership
        // from the leader, whose messages are accepted from now on.
        self.elector.do_send(SetMembership {
            membership: elector_membership(membership),
        });
        self.metadata.do_send(LearnMembers {
            members: membership.ids().into_iter().collect(),
        });
    }

    fn on_messages(&self, from: NodeId, _channel: Channel, messages: Vec<PeerMessage>) {
        // Data-plane traffic goes to the router as one batch, in order. A batch of nothing else
        // (every batch of a DATA connection) goes as it came, not moved into another vector.
        if messages.iter().all(|m| is_data(&m.kind)) {
            self.router.handle_peer_data(from, messages);
            return;
        }
        let mut data = Vec::new();
        for message in messages {
            match message.kind {
                Some(Kind::Elector(m)) => {
                    if self
                        .elector
                        .try_send(ElectorInbound { from, message: m })
                        .is_err()
                    {
                        mailbox_full("elector");
                    }
                }
                Some(Kind::Metadata(m)) => self.metadata_message(from, m),
                kind if is_data(&kind) => data.push(PeerMessage { kind }),
                _ => {
                    metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
                }
            }
        }
        if !data.is_empty() {
            self.router.handle_peer_data(from, data);
        }
    }

    fn on_availability(&self, peer: NodeId, available: bool) {
        if self
            .elector
            .try_send(PeerAvailability { peer, available })
            .is_err()
        {
            mailbox_full("elector");
        }
        // Availability changes are rare (a link going down or up): one message each.
        if self.health.try_send(PeersChanged).is_err() {
            mailbox_full("health");
        }
    }

    fn on_data_link(&self, peer: NodeId, up: bool) {
        // The data plane follows the data link, not availability alone: a DATA connection lost
        // while the CONTROL one stays up loses forwarded requests and pushes all the same.
        if up {
            self.router.handle_node_back(peer);
        } else {
            self.router.handle_node_gone(peer);
        }
    }
}

/// The learners of `membership`, in id order: the nodes every partition's primary streams its
/// journal to without counting them ([`Router::set_partition_learners`]).
pub(crate) fn learners_of(membership: &ClusterMembership) -> Vec<NodeId> {
    membership
        .members
        .values()
        .filter(|m| m.role == MemberRole::Learner)
        .map(|m| m.id)
        .collect()
}
