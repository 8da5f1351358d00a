//! The cluster's membership as the elector uses it (DESIGN.md §5a): who it talks to, who votes,
//! and how many membership changes have been applied.

use std::collections::BTreeSet;

use bmq_proto::NodeId;

/// A committed membership, handed to [`crate::Elector::set_membership`] by the node each time
/// the metadata state applies a membership change (on commit, never on append).
///
/// - `epoch`: the number of membership changes committed before this one took effect; the
///   files' static membership, before the ledger holds one, is epoch 0; the ledger's first
///   membership, seeded from the files with the same voters, is epoch 1. Changes are committed
///   one at a time in one linear history, so an epoch names exactly one voter set.
/// - `members`: every node the elector exchanges messages with (voters, learners and leaving
///   members); messages from other nodes are dropped.
/// - `voters`: the members whose votes, election responses and heartbeat support count, a
///   subset of `members`. Quorums are majorities of `voters`. A node that is not a voter never
///   scouts or stands for election; a leader that stops being a voter steps down.
///
/// Why the epoch is carried in `ElectionScoutingRequest` and `ElectionProposal`: unlike Raft,
/// a voter does not compare ledgers before it votes, so "only an up-to-date candidate wins"
/// does not protect a cluster whose voter sets are two changes apart ({1,2,3} and {2,3,4} have
/// the disjoint majorities {1,2} and {3,4}). A voter therefore refuses a candidate that has
/// applied fewer changes than itself. Together with the rule the metadata leader follows (a
/// change is proposed only once a majority of the current voters have applied the previous
/// one), every majority of an older voter set contains a node that refuses the older
/// candidate. Both rules are checked by the elector's model (`tests/tests/elector_model.rs`),
/// which finds two leaders in one term when either is dropped. Raft dissertation §4.1
/// (single-server changes) gives the intersection of consecutive sets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Membership {
    /// Membership changes applied so far (0: the files' membership, 1: the ledger's seed).
    pub epoch: u64,
    /// Every member the elector talks to, self included or not (ignored if present).
    pub members: BTreeSet<NodeId>,
    /// The voting members, a subset of `members` (a voter missing from `members` is added).
    pub voters: BTreeSet<NodeId>,
}

impl Membership {
    /// Epoch 0 with every node of `nodes` a voter: the static membership of a cluster that never
    /// changed.
    pub fn all_voters(nodes: impl IntoIterator<Item = NodeId>) -> Membership {
        let voters: BTreeSet<NodeId> = nodes.into_iter().collect();
        Membership {
            epoch: 0,
            members: voters.clone(),
            voters,
        }
    }

    /// The number of voters whose support makes or keeps a leader: `voters / 2 + 1`.
    pub fn majority(&self) -> usize {
        self.voters.len() / 2 + 1
    }
}
