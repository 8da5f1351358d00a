//! The cluster's membership as committed cluster state (DESIGN.md §5a): who the members are,
//! where they listen, and which of them count in quorums.
//!
//! A membership changes only through a committed `MembershipAdvisory` carrying the whole new
//! set at `epoch + 1`, and the new set differs from the current one in at most one voter
//! (single-server changes, Raft dissertation §4.1: any majority of the old voters and any
//! majority of the new ones intersect). The epoch is what the elector compares to refuse a
//! candidate that has not applied the latest change (`bmq_elector::Membership`). The nodes'
//! `[[members]]` files seed the first membership, in the first leader's `LeaderAdvisory`;
//! afterwards the ledger wins.

use std::collections::{BTreeMap, BTreeSet};

use bmq_proto::{peer, NodeId};
use serde::Serialize;
use thiserror::Error;

/// The most voters a membership may have: the elector's and the ledger's quorums are sized
/// for the 3-7 voters DESIGN.md §1 names.
pub const MAX_VOTERS: usize = 7;

/// A member's part in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberRole {
    /// Counts in every quorum: the elector's, the metadata ledger's and the partitions'.
    Voter,
    /// Receives the ledger and the journals but counts in no quorum and never stands for
    /// leader; promoted to voter once it has caught up (etcd's learners).
    Learner,
    /// About to be removed: still counts in the elector's and the ledger's quorums (its removal
    /// is the voter change), but holds no primary and no place in partition quorums.
    Leaving,
}

impl MemberRole {
    /// Reads the wire enum; unspecified and unknown values are `None`.
    pub fn from_wire(value: i32) -> Option<Self> {
        match peer::MemberRole::try_from(value).ok()? {
            peer::MemberRole::Voter => Some(MemberRole::Voter),
            peer::MemberRole::Learner => Some(MemberRole::Learner),
            peer::MemberRole::Leaving => Some(MemberRole::Leaving),
            peer::MemberRole::Unspecified => None,
        }
    }

    /// The wire enum value.
    pub fn to_wire(self) -> i32 {
        match self {
            MemberRole::Voter => peer::MemberRole::Voter as i32,
            MemberRole::Learner => peer::MemberRole::Learner as i32,
            MemberRole::Leaving => peer::MemberRole::Leaving as i32,
        }
    }

    /// Whether the role counts in the elector's and the metadata ledger's quorums.
    pub fn votes(self) -> bool {
        matches!(self, MemberRole::Voter | MemberRole::Leaving)
    }
}

/// One member: its id, where it listens, its role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Member {
    /// The node id (unique, never reused once removed).
    #[serde(serialize_with = "node_id")]
    pub id: NodeId,
    /// Host name or address the other nodes and clients reach it at.
    pub host: String,
    /// Peer (cluster) port.
    pub peer_port: u16,
    /// Client (native protocol) port.
    pub client_port: u16,
    /// Admin HTTP port.
    pub admin_port: u16,
    /// BlazingMQ (bmqp) port, if it serves one.
    pub bmqp_port: Option<u16>,
    /// Its part in quorums.
    pub role: MemberRole,
}

impl Member {
    /// The wire form.
    pub fn to_wire(&self) -> peer::MemberInfo {
        peer::MemberInfo {
            node_id: self.id.0,
            host: self.host.clone(),
            peer_port: u32::from(self.peer_port),
            client_port: u32::from(self.client_port),
            admin_port: u32::from(self.admin_port),
            bmqp_port: self.bmqp_port.map_or(0, u32::from),
            role: self.role.to_wire(),
        }
    }

    /// `host:peer_port`, where the other nodes dial it.
    pub fn peer_addr(&self) -> String {
        format!("{}:{}", self.host, self.peer_port)
    }

    /// `host:admin_port`, its admin HTTP server.
    pub fn admin_addr(&self) -> String {
        format!("{}:{}", self.host, self.admin_port)
    }

    /// The same member at the same addresses (roles aside).
    pub fn same_place(&self, other: &Member) -> bool {
        self.host == other.host
            && self.peer_port == other.peer_port
            && self.client_port == other.client_port
            && self.admin_port == other.admin_port
            && self.bmqp_port == other.bmqp_port
    }
}

fn node_id<S: serde::Serializer>(id: &NodeId, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_u32(id.0)
}

/// The committed membership: members by id, the ids removed for ever, and the epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterMembership {
    /// Rises by one with every committed change; 1 for the seeded membership.
    pub epoch: u64,
    /// Every member, learners and leaving ones included.
    pub members: BTreeMap<NodeId, Member>,
    /// Ids removed from the cluster; none of them is a member again.
    pub removed: BTreeSet<NodeId>,
    /// The seeded voters: the replicas of a partition lease assigned with no replica list
    /// (before partitions followed the membership). No change alters it; later leases name
    /// their replicas ([`ClusterMembership::partition_voters`] when they were assigned).
    pub partition_hosts: BTreeSet<NodeId>,
}

/// Why a membership (from the wire, or as a change) is refused. Nothing changes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MembershipError {
    /// The same id appears twice.
    #[error("member {0} appears twice")]
    DuplicateMember(NodeId),
    /// Two members share a host and port.
    #[error("members {0} and {1} share the address {2}")]
    AddressInUse(NodeId, NodeId, String),
    /// A port is 0 or above 65535, or the host is empty.
    #[error("member {0}: {1}")]
    BadAddress(NodeId, &'static str),
    /// A role that is not voter, learner or leaving.
    #[error("member {0} has unknown role {1}")]
    UnknownRole(NodeId, i32),
    /// No voter would be left.
    #[error("a membership needs at least one voter")]
    NoVoter,
    /// More voters than the cluster supports.
    #[error("{0} voters is above the supported {MAX_VOTERS}")]
    TooManyVoters(usize),
    /// A removed id appears as a member.
    #[error("node {0} was removed from the cluster and cannot be a member again")]
    RemovedId(NodeId),
    /// The epoch of a change is not the current epoch + 1.
    #[error("membership epoch {received} does not follow the current epoch {current}")]
    EpochNotNext {
        /// The committed epoch.
        current: u64,
        /// The change's epoch.
        received: u64,
    },
    /// A change that touches more than one member, or more than one voter.
    #[error("a membership change changes one member at a time; this one changes {0}")]
    MoreThanOneChange(String),
    /// A change before any membership was seeded.
    #[error("no membership is committed yet (the first leader seeds it)")]
    NotSeeded,
    /// A change alters the partition hosts (partitions do not follow the membership yet).
    #[error("a membership change cannot change which members replicate partitions")]
    PartitionHostsChanged,
    /// A member's id in the `removed` list of a change disappeared (removals are for ever).
    #[error("node {0} was removed and the change forgets it")]
    RemovalForgotten(NodeId),
}

/// JSON form for `/status`: `{epoch, members: [{id, host, peer_port, client_port, admin_port,
/// bmqp_port, role}], removed: [id], partition_hosts: [id]}`.
impl Serialize for ClusterMembership {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let members: Vec<&Member> = self.members.values().collect();
        let removed: Vec<u32> = self.removed.iter().map(|n| n.0).collect();
        let hosts: Vec<u32> = self.partition_hosts.iter().map(|n| n.0).collect();
        let mut s = serializer.serialize_struct("ClusterMembership", 4)?;
        s.serialize_field("epoch", &self.epoch)?;
        s.serialize_field("members", &members)?;
        s.serialize_field("removed", &removed)?;
        s.serialize_field("partition_hosts", &hosts)?;
        s.end()
    }
}

impl ClusterMembership {
    /// Every member a voter at epoch 1: the seed from the nodes' files.
    pub fn seed(members: impl IntoIterator<Item = Member>) -> Result<Self, MembershipError> {
        let mut map = BTreeMap::new();
        for mut m in members {
            m.role = MemberRole::Voter;
            let id = m.id;
            if map.insert(id, m).is_some() {
                return Err(MembershipError::DuplicateMember(id));
            }
        }
        let seeded = ClusterMembership {
            epoch: 1,
            partition_hosts: map.keys().copied().collect(),
            members: map,
            removed: BTreeSet::new(),
        };
        seeded.validate()?;
        Ok(seeded)
    }

    /// The voters (voter and leaving members), in id order.
    pub fn voters(&self) -> BTreeSet<NodeId> {
        self.members
            .values()
            .filter(|m| m.role.votes())
            .map(|m| m.id)
            .collect()
    }

    /// The members that replicate partitions: those with the voter role. A learner holds
    /// journals only once promoted; a leaving member has lost its place already, so that its
    /// removal changes no partition's replicas (one change of a partition's replicas per
    /// membership change, as for the voters: the Raft dissertation's §4.1 single-server rule).
    pub fn partition_voters(&self) -> BTreeSet<NodeId> {
        self.members
            .values()
            .filter(|m| m.role == MemberRole::Voter)
            .map(|m| m.id)
            .collect()
    }

    /// Every member id, in id order.
    pub fn ids(&self) -> BTreeSet<NodeId> {
        self.members.keys().copied().collect()
    }

    /// The smallest number of voters that is a majority of them.
    pub fn quorum(&self) -> usize {
        self.voters().len() / 2 + 1
    }

    /// The role of `id`, if a member.
    pub fn role(&self, id: NodeId) -> Option<MemberRole> {
        self.members.get(&id).map(|m| m.role)
    }

    /// The wire form (members by id, removed ids ascending).
    pub fn to_wire(&self) -> peer::Membership {
        peer::Membership {
            epoch: self.epoch,
            members: self.members.values().map(Member::to_wire).collect(),
            removed: self.removed.iter().map(|n| n.0).collect(),
            partition_hosts: self.partition_hosts.iter().map(|n| n.0).collect(),
        }
    }

    /// The `MembershipAdvisory` that proposes this membership (a change of the committed one).
    pub fn to_advisory(&self) -> peer::Advisory {
        peer::Advisory {
            kind: Some(peer::advisory::Kind::Membership(peer::MembershipAdvisory {
                membership: Some(self.to_wire()),
            })),
        }
    }

    /// Reads and validates a wire membership.
    ///
    /// # Errors
    /// [`MembershipError`] for a repeated id, a shared address, a bad port or role, no voter,
    /// more than [`MAX_VOTERS`] voters, or a removed id listed as a member.
    pub fn from_wire(wire: &peer::Membership) -> Result<Self, MembershipError> {
        let mut members = BTreeMap::new();
        for info in &wire.members {
            let id = NodeId(info.node_id);
            let role = MemberRole::from_wire(info.role)
                .ok_or(MembershipError::UnknownRole(id, info.role))?;
            let port = |value: u32, what: &'static str| {
                u16::try_from(value)
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or(MembershipError::BadAddress(id, what))
            };
            let member = Member {
                id,
                host: info.host.clone(),
                peer_port: port(info.peer_port, "peer port must be 1-65535")?,
                client_port: port(info.client_port, "client port must be 1-65535")?,
                admin_port: port(info.admin_port, "admin port must be 1-65535")?,
                bmqp_port: match info.bmqp_port {
                    0 => None,
                    p => Some(port(p, "bmqp port must be 0-65535")?),
                },
                role,
            };
            if members.insert(id, member).is_some() {
                return Err(MembershipError::DuplicateMember(id));
            }
        }
        let membership = ClusterMembership {
            epoch: wire.epoch,
            members,
            removed: wire.removed.iter().copied().map(NodeId).collect(),
            partition_hosts: wire.partition_hosts.iter().copied().map(NodeId).collect(),
        };
        membership.validate()?;
        Ok(membership)
    }

    fn validate(&self) -> Result<(), MembershipError> {
        let voters = self.voters().len();
        if voters == 0 {
            return Err(MembershipError::NoVoter);
        }
        if voters > MAX_VOTERS {
            return Err(MembershipError::TooManyVoters(voters));
        }
        let mut places: BTreeMap<(String, u16), NodeId> = BTreeMap::new();
        for m in self.members.values() {
            if m.host.is_empty() {
                return Err(MembershipError::BadAddress(m.id, "host is empty"));
            }
            if self.removed.contains(&m.id) {
                return Err(MembershipError::RemovedId(m.id));
            }
            let ports = [
                Some(m.peer_port),
                Some(m.client_port),
                Some(m.admin_port),
                m.bmqp_port,
            ];
            for port in ports.into_iter().flatten() {
                if let Some(other) = places.insert((m.host.clone(), port), m.id) {
                    if other != m.id {
                        return Err(MembershipError::AddressInUse(
                            other,
                            m.id,
                            format!("{}:{port}", m.host),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks that `next` is a valid single change of `self`: epoch + 1, at most one member
    /// added, removed or changed, and so at most one voter more or fewer. A removed member
    /// goes to `removed`, and nobody leaves `removed`. (A member's new addresses are one change,
    /// as etcd's `member update`.)
    ///
    /// # Errors
    /// [`MembershipError`] naming the rule `next` breaks.
    pub fn check_change(&self, next: &ClusterMembership) -> Result<(), MembershipError> {
        if next.epoch != self.epoch + 1 {
            return Err(MembershipError::EpochNotNext {
                current: self.epoch,
                received: next.epoch,
            });
        }
        next.validate()?;
        if let Some(forgotten) = self.removed.difference(&next.removed).next() {
            return Err(MembershipError::RemovalForgotten(*forgotten));
        }
        if next.partition_hosts != self.partition_hosts {
            return Err(MembershipError::PartitionHostsChanged);
        }
        let mut changed = Vec::new();
        for id in self.ids().union(&next.ids()) {
            match (self.members.get(id), next.members.get(id)) {
                (Some(a), Some(b)) if a == b => {}
                (Some(a), Some(b)) if !a.same_place(b) => {
                    changed.push(format!("node {id}'s addresses"))
                }
                (Some(_), Some(_)) => changed.push(format!("node {id}'s role")),
                (Some(_), None) => {
                    if !next.removed.contains(id) {
                        return Err(MembershipError::MoreThanOneChange(format!(
                            "node {id} dropped without being listed as removed"
                        )));
                    }
                    changed.push(format!("node {id} removed"));
                }
                (None, Some(_)) => changed.push(format!("node {id} added")),
                (None, None) => {}
            }
        }
        let newly_removed = next.removed.difference(&self.removed).count();
        let voters_changed = self.voters().symmetric_difference(&next.voters()).count();
        if changed.len() > 1 || newly_removed > 1 || voters_changed > 1 {
            return Err(MembershipError::MoreThanOneChange(changed.join(", ")));
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Member `id` on 127.0.0.1 with ports 7000+id (peer), 6000+id (client), 8000+id (admin).
    pub(crate) fn member(id: u32, role: MemberRole) -> Member {
        Member {
            id: NodeId(id),
            host: "127.0.0.1".into(),
            peer_port: 7000 + id as u16,
            client_port: 6000 + id as u16,
            admin_port: 8000 + id as u16,
            bmqp_port: None,
            role,
        }
    }

    fn with(base: &ClusterMembership, f: impl FnOnce(&mut ClusterMembership)) -> ClusterMembership {
        let mut next = base.clone();
        next.epoch += 1;
        f(&mut next);
        next
    }

    #[test]
    fn seeded_members_are_voters_at_epoch_one() {
        // Scenario: the files' members become voters of epoch 1; the wire form round-trips.
        let seeded =
            ClusterMembership::seed((1..=3).map(|i| member(i, MemberRole::Learner))).unwrap();
        assert_eq!(seeded.epoch, 1);
        assert_eq!(seeded.voters().len(), 3);
        assert_eq!(seeded.quorum(), 2);
        assert_eq!(
            ClusterMembership::from_wire(&seeded.to_wire()).unwrap(),
            seeded
        );
    }

    #[test]
    fn one_change_at_a_time() {
        // Scenario: adding a learner, promoting it, marking a voter leaving and removing it are
        // single changes; two at once, a skipped epoch or a forgotten removal are refused.
        let base = ClusterMembership::seed((1..=3).map(|i| member(i, MemberRole::Voter))).unwrap();
        let added = with(&base, |m| {
            m.members.insert(NodeId(4), member(4, MemberRole::Learner));
        });
        base.check_change(&added).unwrap();
        let promoted = with(&added, |m| {
            m.members.get_mut(&NodeId(4)).unwrap().role = MemberRole::Voter;
        });
        added.check_change(&promoted).unwrap();
        let leaving = with(&promoted, |m| {
            m.members.get_mut(&NodeId(1)).unwrap().role = MemberRole::Leaving;
        });
        promoted.check_change(&leaving).unwrap();
        let removed = with(&leaving, |m| {
            m.members.remove(&NodeId(1));
            m.removed.insert(NodeId(1));
        });
        leaving.check_change(&removed).unwrap();
        assert_eq!(
            removed.voters(),
            [2, 3, 4].map(NodeId).into_iter().collect()
        );

        // Two voters added at once.
        let two = with(&base, |m| {
            m.members.insert(NodeId(4), member(4, MemberRole::Voter));
            m.members.insert(NodeId(5), member(5, MemberRole::Voter));
        });
        assert!(matches!(
            base.check_change(&two),
            Err(MembershipError::MoreThanOneChange(_))
        ));
        // A voter added directly is one voter change: allowed by the rule (the leader adds
        // learners; the rule is what safety needs).
        let direct = with(&base, |m| {
            m.members.insert(NodeId(4), member(4, MemberRole::Voter));
        });
        base.check_change(&direct).unwrap();
        // Epoch skipped.
        let mut skipped = added.clone();
        skipped.epoch += 1;
        assert_eq!(
            base.check_change(&skipped),
            Err(MembershipError::EpochNotNext {
                current: 1,
                received: 3
            })
        );
        // Dropped without a removal, and a removed id coming back.
        let dropped = with(&base, |m| {
            m.members.remove(&NodeId(3));
        });
        assert!(base.check_change(&dropped).is_err());
        let back = with(&removed, |m| {
            m.members.insert(NodeId(1), member(1, MemberRole::Learner));
        });
        assert_eq!(
            removed.check_change(&back),
            Err(MembershipError::RemovedId(NodeId(1)))
        );
        let hosts = with(&base, |m| {
            m.partition_hosts.insert(NodeId(4));
        });
        assert_eq!(
            base.check_change(&hosts),
            Err(MembershipError::PartitionHostsChanged)
        );
        let forgotten = with(&removed, |m| {
            m.removed.clear();
        });
        assert_eq!(
            removed.check_change(&forgotten),
            Err(MembershipError::RemovalForgotten(NodeId(1)))
        );
    }

    #[test]
    fn bad_memberships_are_refused() {
        // Scenario: no voter, too many voters, a shared address, an unknown role, a zero port.
        let only_learner = ClusterMembership {
            epoch: 1,
            members: [(NodeId(1), member(1, MemberRole::Learner))].into(),
            removed: BTreeSet::new(),
            partition_hosts: BTreeSet::new(),
        };
        assert_eq!(
            ClusterMembership::from_wire(&only_learner.to_wire()),
            Err(MembershipError::NoVoter)
        );
        assert_eq!(
            ClusterMembership::seed((1..=8).map(|i| member(i, MemberRole::Voter))),
            Err(MembershipError::TooManyVoters(8))
        );
        let mut clash = member(2, MemberRole::Voter);
        clash.client_port = 7001;
        assert!(matches!(
            ClusterMembership::seed([member(1, MemberRole::Voter), clash]),
            Err(MembershipError::AddressInUse(..))
        ));
        let mut wire = ClusterMembership::seed([member(1, MemberRole::Voter)])
            .unwrap()
            .to_wire();
        wire.members[0].role = 9;
        assert_eq!(
            ClusterMembership::from_wire(&wire),
            Err(MembershipError::UnknownRole(NodeId(1), 9))
        );
        wire.members[0].role = peer::MemberRole::Voter as i32;
        wire.members[0].peer_port = 70000;
        assert!(matches!(
            ClusterMembership::from_wire(&wire),
            Err(MembershipError::BadAddress(..))
        ));
    }
}
