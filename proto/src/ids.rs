//! Newtypes for identifiers and counters shared by every crate (STYLE.md: "Newtypes for ids and
//! counters"). Sized integers, as on the wire.

use std::fmt;

/// A broker node's id, unique in the cluster, as configured (`members[].id`). Ids are small
/// positive integers; `0` is never a valid node id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A partition's id, `0..partition_count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PartitionId(pub u32);

impl fmt::Display for PartitionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// An election term (the article's "term"; Raft §5.1). Monotonically increasing on every node,
/// across restarts too; every leader has a unique term.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Term(pub u64);

impl Term {
    /// The next term (`self + 1`), as proposed by ElectionScouting.
    pub fn next(self) -> Term {
        Term(self.0 + 1)
    }
}

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A partition's primary lease (`primary_lease_id`, DESIGN.md §5-§7): every change of a
/// partition's primary carries a strictly higher lease, so at most one primary serves a lease.
/// `LeaseId(0)` means "no primary yet". Journal records are stamped with the lease they were
/// written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct LeaseId(pub u64);

impl LeaseId {
    /// The next lease (`self + 1`), as the leader assigns it to a new primary.
    pub fn next(self) -> LeaseId {
        LeaseId(self.0 + 1)
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The address of one client session in the cluster: the session `session_id` on the node
/// `origin_node` that carries it (the node the client is connected to, which proxies for it).
/// Producers and consumers are both named by their session's address; a primary sends ACKs and
/// PUSHes to it, locally or over the DATA channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionAddr {
    /// The node the session lives on.
    pub origin_node: NodeId,
    /// The session's id, unique on `origin_node` for the life of that process.
    pub session_id: u64,
}

impl fmt::Display for SessionAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.origin_node, self.session_id)
    }
}

/// The name a node's certificate carries (DNS subject alternative name) and peers check against
/// the member id in its hello: `node-<id>`.
pub fn member_name(id: NodeId) -> String {
    format!("node-{}", id.0)
}
