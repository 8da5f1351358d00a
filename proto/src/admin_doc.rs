//! The JSON shape served by a node's `/status` endpoint and read by `bmqctl status`.
//!
//! One document per node; `bmqctl status` gathers the documents of every configured node and
//! prints them as a table, or as a JSON array with `--json`.

use serde::{Deserialize, Serialize};

/// A node's view of itself and of the cluster (`GET /status`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NodeStatusDoc {
    /// This node's id.
    pub node_id: u32,
    /// The configured cluster name.
    pub cluster_name: String,
    /// Broker version (`CARGO_PKG_VERSION`).
    pub version: String,
    /// The elector's view: state, term, leader.
    pub elector: ElectorDoc,
    /// The metadata replica's view: role, LSNs.
    pub metadata: MetadataDoc,
    /// Committed partition table.
    pub partitions: Vec<PartitionDoc>,
    /// Committed queue assignments.
    pub queues: Vec<QueueDoc>,
    /// Peer connectivity as this node sees it.
    pub peers: Vec<PeerDoc>,
    /// Number of client sessions attached to this node.
    pub client_sessions: u64,
    /// True when the node has a leader and an active metadata state, and every partition's journal
    /// on this node is open (what `/readyz` answers).
    pub ready: bool,
    /// The committed membership (absent before the first leader seeded it from the files, and
    /// from nodes of earlier versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership: Option<MembershipDoc>,
    /// The configuration reloads of this node since it started (absent before the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_reload: Option<ConfigReloadStatusDoc>,
    /// The committed domains (absent before a leader seeded them from its file, and from
    /// nodes of earlier versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domains: Option<DomainsDoc>,
}

/// The committed domain state (DESIGN.md §5a) as this node holds it; the domains themselves
/// are listed by `GET /admin/domains`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DomainsDoc {
    /// The LSN of the last change (`term:seq`; the seed's LeaderAdvisory before any change).
    pub version: String,
    /// How many domains exist.
    pub count: usize,
    /// Why this node's file `[[domains]]` differs from the committed domains, if it does (the
    /// committed domains apply; the file only seeds the first start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_disagrees: Option<String>,
}

/// The committed membership (DESIGN.md §5a) as this node holds it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MembershipDoc {
    /// Rises by one with every committed change (1: seeded from the files).
    pub epoch: u64,
    /// Every member, in id order.
    pub members: Vec<MemberDoc>,
    /// Ids removed from the cluster for ever.
    pub removed: Vec<u32>,
    /// Why this node's file `[[members]]` differs from the committed membership, if it does (the
    /// ledger wins; the file only seeds the first start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_disagrees: Option<String>,
}

/// One member of [`MembershipDoc`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MemberDoc {
    /// Node id.
    pub node_id: u32,
    /// Host name or address.
    pub host: String,
    /// Peer port.
    pub peer_port: u16,
    /// Client port.
    pub client_port: u16,
    /// Admin HTTP port.
    pub admin_port: u16,
    /// BlazingMQ (bmqp) port, if served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bmqp_port: Option<u16>,
    /// `voter`, `learner` or `leaving`.
    pub role: String,
    /// A learner's catch-up: on the learner itself as it stands, elsewhere as it last
    /// reported (absent for voters, and for a learner that has not reported to this node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catch_up: Option<CatchUpDoc>,
}

/// How far a learner has caught up (the leader promotes it once `partitions_following` reaches
/// `partitions` at the committed membership's epoch).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CatchUpDoc {
    /// The committed membership epoch the learner had applied (it holds the ledger up to it).
    pub membership_epoch: u64,
    /// Partitions whose primary has synchronised the learner's journal.
    pub partitions_following: u32,
    /// Partitions with a primary.
    pub partitions: u32,
}

/// Elector state (DESIGN.md §4).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ElectorDoc {
    /// `dormant`, `follower`, `candidate` or `leader`.
    pub state: String,
    /// Current term.
    pub term: u64,
    /// The leader this node follows (or itself), if any.
    pub leader: Option<u32>,
    /// Reason of the last transition, snake_case.
    pub reason: String,
    /// Effective quorum.
    pub quorum: usize,
}

/// Metadata replica state (DESIGN.md §5).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MetadataDoc {
    /// `follower`, `passive_leader` or `active_leader`.
    pub role: String,
    /// Term the metadata replica works in.
    pub term: u64,
    /// Last LSN in the ledger, printed `term:seq`.
    pub last_lsn: String,
    /// Last committed LSN, printed `term:seq`.
    pub committed_lsn: String,
    /// Advisories written but not yet committed.
    pub uncommitted: usize,
}

/// A partition and its primary (DESIGN.md §6).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PartitionDoc {
    /// Partition id.
    pub partition_id: u32,
    /// Primary node, if assigned.
    pub primary: Option<u32>,
    /// The primary's lease id; a new primary always has a strictly higher one.
    pub primary_lease_id: u64,
    /// `none`, `passive` or `active`.
    pub status: String,
    /// The voters that replicate the partition at this lease (its primary heals from and
    /// counts a majority of them); empty before a membership is committed (the configured
    /// members replicate).
    #[serde(default)]
    pub replicas: Vec<u32>,
    /// Messages held by this node for this partition (only meaningful on its primary).
    pub messages: u64,
    /// This node's last journal sequence for the partition (0 while its journal opens).
    #[serde(default)]
    pub journal_last_sequence: u64,
    /// On the partition's primary (this node): the highest journal sequence a quorum holds;
    /// `journal_last_sequence - committed_sequence` records wait for a quorum. 0 elsewhere.
    #[serde(default)]
    pub committed_sequence: u64,
    /// On the partition's primary (this node): records its slowest replica has not
    /// acknowledged. 0 elsewhere.
    #[serde(default)]
    pub replication_lag: u64,
    /// Bytes of this node's journal segments for the partition.
    #[serde(default)]
    pub journal_bytes: u64,
    /// Whether this node's last journal write for the partition failed for a full disk (its
    /// PUTs are NACKed `STORAGE_FAILURE` until a write succeeds).
    #[serde(default)]
    pub disk_full: bool,
    /// Whether this node's journal for the partition was found corrupt, set aside, and is
    /// not yet re-installed from the primary (it counts in no healing quorum until then).
    #[serde(default)]
    pub needs_install: bool,
}

/// A queue and the partition it lives in.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct QueueDoc {
    /// `bmq://<domain>/<queue>`.
    pub uri: String,
    /// The partition the leader assigned the queue to.
    pub partition_id: u32,
    /// Cluster-unique key assigned by the leader.
    pub queue_key: u64,
}

/// A peer as seen from this node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PeerDoc {
    /// Peer node id.
    pub node_id: u32,
    /// True when the control connections in both directions are up and heartbeating.
    pub connected: bool,
}

/// The answer of a configuration reload (`POST /admin/reload`, `bmqctl admin reload`, SIGHUP):
/// what the node applied from its file, what it did not, and why. Secrets never appear:
/// tokens show by name and a fingerprint of their secret, certificates by fingerprint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReloadDoc {
    /// The node that reloaded.
    pub node_id: u32,
    /// `applied` (something changed), `unchanged` (the file's live settings are those in
    /// force) or `refused` (the file is unreadable or invalid: nothing changed).
    pub result: String,
    /// Who asked: the name of the admin token used (`admin.token`, or a client token with
    /// the `admin` permission), `anonymous` when no admin token is configured, or `SIGHUP`.
    pub requested_by: String,
    /// The configuration file read.
    pub file: String,
    /// When the reload ran, milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// The settings changed, in the order applied.
    pub changed: Vec<SettingChangeDoc>,
    /// Field paths whose value in the file differs from the running one and that take a
    /// restart to change (`partition_count`, `members`, ...): not applied.
    pub needs_restart: Vec<String>,
    /// Settings of the file that differ but only seed the cluster state at its first start
    /// (`members`, `domains`, `join`): not applied; changed through `bmqctl admin
    /// add-member`/`remove-member` and `bmqctl domain` instead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub seed_only: Vec<String>,
    /// Client sessions closed with `NOT_AUTHORIZED` because their token was removed or lost
    /// a permission, a domain or its secret.
    pub sessions_closed: u64,
    /// Why the reload was refused (`refused` only): the loader's message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The field the refusal names, when it names one (`auth.tokens[1].secret`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_field: Option<String>,
}

/// One setting a reload changed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SettingChangeDoc {
    /// The setting: a field path (`log.level`), a token (`auth.tokens[orders]`), or a TLS
    /// file's contents (`tls.cert_file`).
    pub setting: String,
    /// Its value before (`None`: it did not exist).
    #[serde(default)]
    pub before: Option<String>,
    /// Its value after (`None`: it was removed).
    #[serde(default)]
    pub after: Option<String>,
}

/// `/status`'s account of the configuration reloads.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ConfigReloadStatusDoc {
    /// When a reload last applied a change, milliseconds since the Unix epoch (`None`: none
    /// has yet).
    #[serde(default)]
    pub last_applied_unix_ms: Option<u64>,
    /// The last reload, whatever its result.
    pub last: ReloadDoc,
}
