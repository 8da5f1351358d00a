//! The broker node's configuration: one TOML file per node (`bmq-config`).
//!
//! Every node reads a [`BrokerConfig`]: who it is (`node_id`), who the cluster members are (every
//! node, itself included, with its client, peer and admin ports), and the tunables of the elector,
//! the peer links, the metadata ledger, replication, the limits and the domains. Every section is
//! optional in the file and falls back to the defaults documented on each field (DESIGN.md §4 for
//! the elector); unknown fields are errors, so a typo never silently falls back to a default.
//!
//! [`BrokerConfig::load`] reads, parses and validates a file; [`BrokerConfig::validate`] names the
//! offending field path and value in its error (`members[2].peer_port: 0 is not a valid port`).
//! Each section validates itself ([`sections`], [`domains`], [`security`]). [`diff`] compares two
//! configurations for a live reload: what it applies, and what needs a restart.
//!
//! The commented default, `config/local-cluster.toml`, is embedded as [`LOCAL_CLUSTER_TOML`];
//! [`local_cluster`] derives from it one configuration per node of a cluster on this machine
//! (what `bmqctl cluster up` starts).
//!
//! This crate is data only (serde + toml): the node, `bmqctl` and the tests share it without
//! compiling the node.
#![warn(missing_docs)]

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize, Serializer};

pub mod diff;
pub mod domains;
pub mod error;
mod local;
pub mod sections;
pub mod security;

pub use domains::{validate_domains, Consistency, DomainConfig, DomainMode};
pub use error::ConfigError;
pub use local::{local_cluster, BMQP_PORT_OFFSET, LOCAL_CLUSTER_BASE_PORT, LOCAL_CLUSTER_TOML};
pub use sections::{
    is_valid_host, BmqpSettings, CpuScheduling, ElectorSettings, FsyncSetting, LimitsSettings,
    LinkSettings, LogSettings, MemberConfig, MetadataSettings, ProcessSettings,
    ReplicationSettings, StorageSettings, FRAME_SIZE_MAX_BYTES, FRAME_SIZE_MIN_BYTES,
    LEDGER_FILE_SIZE_MIN_BYTES,
};
pub use security::{
    constant_time_eq, is_loopback_host, AdminSettings, AuthSettings, Permission, TlsSettings,
    TokenConfig, TOKENS_MAX, TOKEN_LEN_MAX, TOKEN_LEN_MIN,
};

/// Smallest cluster: a single node.
pub const MEMBERS_MIN: usize = 1;
/// Largest cluster supported (DESIGN.md §1: 3 to 7 nodes; 1 and 2 are allowed for tests).
pub const MEMBERS_MAX: usize = 7;
/// Largest `partition_count`.
pub const PARTITION_COUNT_MAX: u32 = 1024;

/// The quorum rule (see [`BrokerConfig::effective_quorum`]): `configured`, or a majority
/// `members / 2 + 1` when `configured` is 0. A value above `members` is kept, so that tests can
/// forbid leadership and commits.
pub fn effective_quorum(configured: u32, members: usize) -> usize {
    if configured == 0 {
        members / 2 + 1
    } else {
        configured as usize
    }
}

/// A node's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerConfig {
    /// Name of the cluster; every member must use the same one.
    pub cluster_name: String,
    /// This node's id; must be one of `members`.
    pub node_id: u32,
    /// Directory of this node's ledger, journals and elector state. A relative path is relative
    /// to the broker's working directory.
    #[serde(serialize_with = "serialize_path")]
    pub data_dir: PathBuf,
    /// Address this node's three listeners bind to, e.g. `0.0.0.0` in a container; when absent
    /// they bind to this node's own `members[].host`. Peers always dial `members[].host`, so a
    /// node may listen on every interface while the others reach it by host name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen_host: Option<String>,
    /// Every node of the cluster, this one included (1 to 7): the membership the cluster's
    /// first leader seeds the ledger with. A node joining a running cluster lists itself
    /// alone and names the members it contacts in `join`.
    pub members: Vec<MemberConfig>,
    /// Peer addresses (`host:peer_port`) of current members of a running cluster this node
    /// joins. At its first start (a ledger with no membership yet) the node asks them for the
    /// committed membership over the peer protocol (mutual TLS under `[tls]`), dials its
    /// members, and waits to be added (`bmqctl admin add-member`): it never seeds a
    /// membership of its own and never stands for election before it is a voter. Ignored
    /// once its ledger holds the membership. Empty (the default): the node is one of the
    /// cluster's first `members`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub join: Vec<String>,
    /// Number of queue-data partitions (1 to 1024). Default 4.
    #[serde(default = "default_partition_count")]
    pub partition_count: u32,
    /// Leader election timings (DESIGN.md §4).
    #[serde(default)]
    pub elector: ElectorSettings,
    /// Peer connection heartbeats and reconnection.
    #[serde(default)]
    pub link: LinkSettings,
    /// The metadata ledger (DESIGN.md §5).
    #[serde(default)]
    pub metadata: MetadataSettings,
    /// Limits on frames, sessions, buffers and mailboxes.
    #[serde(default)]
    pub limits: LimitsSettings,
    /// Partition replication: batch size, in-flight window, resend interval (DESIGN.md §7).
    #[serde(default)]
    pub replication: ReplicationSettings,
    /// Partition journals on disk: segment size, cache, quota (DESIGN.md §7).
    #[serde(default)]
    pub storage: StorageSettings,
    /// The domains queues can be opened in (`bmq://<domain>/<queue>`).
    #[serde(default)]
    pub domains: Vec<DomainConfig>,
    /// Logging.
    #[serde(default)]
    pub log: LogSettings,
    /// How the process runs on its machine: the CPU scheduling policy ([`ProcessSettings`]).
    #[serde(default)]
    pub process: ProcessSettings,
    /// The admin HTTP listener: bind host and admin token ([`AdminSettings`]).
    #[serde(default, skip_serializing_if = "AdminSettings::is_default")]
    pub admin: AdminSettings,
    /// TLS on the peer links (mutual) and the client listener; absent = plain TCP
    /// ([`TlsSettings`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSettings>,
    /// Client tokens and their per-domain permissions; no token configured = no client
    /// authentication ([`AuthSettings`]).
    #[serde(default, skip_serializing_if = "AuthSettings::is_empty")]
    pub auth: AuthSettings,
    /// The bmqp listener for BlazingMQ's SDKs: heartbeats, plaintext under TLS
    /// ([`BmqpSettings`]).
    #[serde(default, skip_serializing_if = "BmqpSettings::is_default")]
    pub bmqp: BmqpSettings,
}

fn default_partition_count() -> u32 {
    4
}

// Paths are written lossily so that `to_toml_string` cannot fail on a non-UTF-8 path.
fn serialize_path<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&path.to_string_lossy())
}

pub(crate) fn serialize_opt_path<S: Serializer>(
    path: &Option<PathBuf>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match path {
        Some(p) => s.serialize_str(&p.to_string_lossy()),
        None => s.serialize_none(),
    }
}

impl BrokerConfig {
    /// Parses a configuration from TOML text, without validating it (see [`Self::validate`]).
    ///
    /// Errors: [`ConfigError::Parse`] (with path `<string>`) on invalid TOML, a missing required
    /// field (`cluster_name`, `node_id`, `data_dir`, `members`), a wrong type or an unknown field.
    pub fn from_toml_str(s: &str) -> Result<Self, ConfigError> {
        Self::parse(s, Path::new("<string>"))
    }

    fn parse(s: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(s).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })
    }

    /// Reads, parses and validates a configuration file.
    ///
    /// Errors name the file: [`ConfigError::Read`], [`ConfigError::Parse`] and
    /// [`ConfigError::InvalidFile`].
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let config = Self::parse(&text, path)?;
        config.validate().map_err(|e| match e {
            ConfigError::Invalid { field, message } => ConfigError::InvalidFile {
                path: path.to_path_buf(),
                field,
                message,
            },
            other => other,
        })?;
        Ok(config)
    }

    /// Serializes to TOML, in a form [`Self::from_toml_str`] reads back to an equal value.
    pub fn to_toml_string(&self) -> String {
        // Every field is a string, an integer, an enum, a table or an array of tables, and paths
        // are written lossily, so serialization cannot fail.
        toml::to_string(self).expect("a BrokerConfig always serializes to TOML")
    }

    /// Checks every value and the relations between values, section by section.
    ///
    /// Errors: the first [`ConfigError::Invalid`] found, naming the field path and the value,
    /// e.g. `members[2].peer_port: 0 is not a valid port` or
    /// `node_id: 9 is not among members (1, 2, 3)`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_node()?;
        self.validate_members()?;
        self.elector.validate()?;
        self.link.validate()?;
        self.metadata.validate()?;
        self.limits.validate()?;
        self.replication.validate()?;
        self.storage.validate()?;
        validate_domains(&self.domains)?;
        self.log.validate()?;
        self.admin.validate()?;
        self.bmqp.validate()?;
        if let Some(tls) = &self.tls {
            tls.validate()?;
        }
        self.auth.validate(&self.domains)
    }

    /// `cluster_name`, `data_dir`, `listen_host`, `partition_count`.
    fn validate_node(&self) -> Result<(), ConfigError> {
        let valid_name = !self.cluster_name.is_empty()
            && self
                .cluster_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !valid_name {
            return Err(ConfigError::invalid(
                "cluster_name",
                format!(
                    "{:?} is not a valid cluster name (use A-Z a-z 0-9 . _ -)",
                    self.cluster_name
                ),
            ));
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err(ConfigError::invalid("data_dir", "must not be empty"));
        }
        if let Some(host) = self.listen_host.as_ref().filter(|h| !is_valid_host(h)) {
            return Err(ConfigError::invalid(
                "listen_host",
                format!("{host:?} is not a valid host"),
            ));
        }
        if !(1..=PARTITION_COUNT_MAX).contains(&self.partition_count) {
            return Err(ConfigError::invalid(
                "partition_count",
                format!(
                    "must be between 1 and {PARTITION_COUNT_MAX}, got {}",
                    self.partition_count
                ),
            ));
        }
        Ok(())
    }

    /// The member count, each member, unique ids and addresses, `node_id` among them, and
    /// every `join` address a `host:port` other than this node's own.
    fn validate_members(&self) -> Result<(), ConfigError> {
        for (i, addr) in self.join.iter().enumerate() {
            let valid = addr.rsplit_once(':').is_some_and(|(host, port)| {
                is_valid_host(host) && port.parse::<u16>().is_ok_and(|p| p != 0)
            });
            if !valid {
                return Err(ConfigError::invalid(
                    format!("join[{i}]"),
                    format!("{addr:?} is not a host:port peer address"),
                ));
            }
            if self
                .member(self.node_id)
                .is_some_and(|me| me.peer_addr() == *addr)
            {
                return Err(ConfigError::invalid(
                    format!("join[{i}]"),
                    format!("{addr} is this node's own peer address"),
                ));
            }
        }
        let n = self.members.len();
        if !(MEMBERS_MIN..=MEMBERS_MAX).contains(&n) {
            return Err(ConfigError::invalid(
                "members",
                format!("{n} members; a cluster has between {MEMBERS_MIN} and {MEMBERS_MAX}"),
            ));
        }
        let mut ids = BTreeSet::new();
        let mut addrs = HashSet::new();
        for (i, m) in self.members.iter().enumerate() {
            m.validate(i)?;
            if !ids.insert(m.id) {
                return Err(ConfigError::invalid(
                    "members",
                    format!("duplicate id {}", m.id),
                ));
            }
            for addr in [m.client_addr(), m.peer_addr(), m.admin_addr()] {
                if !addrs.insert(addr.clone()) {
                    return Err(ConfigError::invalid(
                        "members",
                        format!("duplicate address {addr}"),
                    ));
                }
            }
        }
        if !ids.contains(&self.node_id) {
            let list: Vec<String> = ids.iter().map(u32::to_string).collect();
            return Err(ConfigError::invalid(
                "node_id",
                format!(
                    "{} is not among members ({})",
                    self.node_id,
                    list.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// This node's entry in `members`.
    ///
    /// # Panics
    /// If `node_id` is not among `members`, which [`Self::validate`] rules out.
    pub fn self_member(&self) -> &MemberConfig {
        self.member(self.node_id)
            .expect("validated configuration: node_id is among members")
    }

    /// The member with id `id`, if any.
    pub fn member(&self, id: u32) -> Option<&MemberConfig> {
        self.members.iter().find(|m| m.id == id)
    }

    /// The addresses this node binds, `host:port` in the order client, peer, admin: this
    /// node's member addresses, with the host replaced by `listen_host` when it is set.
    pub fn listen_addrs(&self) -> [String; 3] {
        let me = self.self_member();
        match &self.listen_host {
            Some(host) => {
                let listen = MemberConfig {
                    host: host.clone(),
                    ..me.clone()
                };
                [
                    listen.client_addr(),
                    listen.peer_addr(),
                    listen.admin_addr(),
                ]
            }
            None => [me.client_addr(), me.peer_addr(), me.admin_addr()],
        }
    }

    /// The address this node's bmqp listener binds (BlazingMQ SDK clients), when it has one:
    /// its member's `bmqp_port` on `listen_host` or the member's host.
    pub fn bmqp_listen_addr(&self) -> Option<String> {
        let me = self.self_member();
        let port = me.bmqp_port?;
        Some(match &self.listen_host {
            Some(host) => MemberConfig {
                host: host.clone(),
                ..me.clone()
            }
            .addr_of(port),
            None => me.addr_of(port),
        })
    }

    /// Every member except this node.
    pub fn peers(&self) -> impl Iterator<Item = &MemberConfig> {
        let me = self.node_id;
        self.members.iter().filter(move |m| m.id != me)
    }

    /// The domain named `name`, if configured.
    pub fn domain(&self, name: &str) -> Option<&DomainConfig> {
        self.domains.iter().find(|d| d.name == name)
    }

    /// The effective quorum of this cluster: `elector.quorum`, or `N/2 + 1` when it is 0 (a
    /// majority of the N members, Raft §5.2; BlazingMQ's elector uses the same rule).
    ///
    /// This is the **one** quorum rule of the node: the elector (votes), the metadata core
    /// (advisory commits) and every partition (journal receipts before an ACK) are given this
    /// number, and `POST /admin/quorum/{n}` changes it for all three at once. The cores never
    /// interpret 0 themselves.
    pub fn effective_quorum(&self) -> usize {
        effective_quorum(self.elector.quorum, self.members.len())
    }
}

#[cfg(test)]
mod tests;
