//! Broker configuration: one TOML file per node.
//!
//! Every node reads a [`BrokerConfig`]: who it is (`node_id`), who the cluster members are (every
//! node, itself included, with its client, peer and admin ports), and the tunables of the elector,
//! the peer links, the metadata ledger, the limits and the domains. Every section is optional in
//! the file and falls back to the defaults documented on each field (DESIGN.md §4 for the
//! elector); unknown fields are errors, so a typo never silently falls back to a default.
//!
//! [`BrokerConfig::load`] reads, parses and validates a file; [`BrokerConfig::validate`] names the
//! offending field path and value in its error (`members[2].peer_port: 0 is not a valid port`).
//!
//! The commented default, `broker/config/local-cluster.toml`, is embedded as
//! [`LOCAL_CLUSTER_TOML`]; [`local_cluster`] derives from it one configuration per node of a
//! cluster on this machine (what `bmqctl cluster up` starts).

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize, Serializer};

/// The commented default configuration (node 1 of a 3-node cluster on 127.0.0.1), embedded at
/// build time from `broker/config/local-cluster.toml`.
pub const LOCAL_CLUSTER_TOML: &str = include_str!("../config/local-cluster.toml");

/// Smallest cluster: a single node.
pub const MEMBERS_MIN: usize = 1;
/// Largest cluster supported (DESIGN.md §1: 3 to 7 nodes; 1 and 2 are allowed for tests).
pub const MEMBERS_MAX: usize = 7;
/// Largest `partition_count`.
pub const PARTITION_COUNT_MAX: u32 = 1024;
/// Longest domain name, in bytes.
pub const DOMAIN_NAME_LEN_MAX: usize = 128;
/// Smallest accepted `metadata.ledger_max_file_size_bytes` (64 KiB): below that, rollover would
/// happen on nearly every record.
pub const LEDGER_FILE_SIZE_MIN_BYTES: u64 = 64 * 1024;
/// Smallest accepted `limits.frame_size_max_bytes` (4 KiB): a frame must at least hold the
/// protocol's control messages.
pub const FRAME_SIZE_MIN_BYTES: u64 = 4 * 1024;
/// Largest accepted `limits.frame_size_max_bytes` (1 GiB).
pub const FRAME_SIZE_MAX_BYTES: u64 = 1024 * 1024 * 1024;

const MIB: u64 = 1024 * 1024;
const GIB: u64 = 1024 * MIB;

/// Errors of loading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read configuration file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not valid TOML or does not match the schema (unknown field, wrong type).
    #[error("cannot parse configuration {}: {message}", path.display())]
    Parse {
        /// The file; `<string>` when parsed from a string by [`BrokerConfig::from_toml_str`].
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A value is out of range or inconsistent with another one.
    #[error("{field}: {message}")]
    Invalid {
        /// Path of the offending field, e.g. `members[2].peer_port`.
        field: String,
        /// What is wrong, naming the value, e.g. `0 is not a valid port`.
        message: String,
    },
    /// A file parsed but did not validate ([`BrokerConfig::load`]).
    #[error("invalid configuration {}: {field}: {message}", path.display())]
    InvalidFile {
        /// The file.
        path: PathBuf,
        /// Path of the offending field, e.g. `members[2].peer_port`.
        field: String,
        /// What is wrong, naming the value.
        message: String,
    },
}

impl ConfigError {
    /// The offending field path of a validation error (`Invalid` or `InvalidFile`).
    pub fn field(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { field, .. } | ConfigError::InvalidFile { field, .. } => {
                Some(field)
            }
            _ => None,
        }
    }

    fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            message: message.into(),
        }
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
    /// Every node of the cluster, this one included (1 to 7).
    pub members: Vec<MemberConfig>,
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
    /// The domains queues can be opened in (`bmq://<domain>/<queue>`).
    #[serde(default)]
    pub domains: Vec<DomainConfig>,
    /// Logging.
    #[serde(default)]
    pub log: LogSettings,
    /// The admin HTTP listener: bind host and admin token ([`crate::auth::AdminSettings`]).
    #[serde(
        default,
        skip_serializing_if = "crate::auth::AdminSettings::is_default"
    )]
    pub admin: crate::auth::AdminSettings,
    /// TLS on the peer links (mutual) and the client listener; absent = plain TCP
    /// ([`crate::tls::TlsSettings`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<crate::tls::TlsSettings>,
    /// Client tokens and their per-domain permissions; no token configured = no client
    /// authentication ([`crate::auth::AuthSettings`]).
    #[serde(default, skip_serializing_if = "crate::auth::AuthSettings::is_empty")]
    pub auth: crate::auth::AuthSettings,
}

fn default_partition_count() -> u32 {
    4
}

/// One cluster member and its three listening ports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemberConfig {
    /// Node id, at least 1, unique in the cluster.
    pub id: u32,
    /// Host name or IP address the node listens on and peers connect to.
    pub host: String,
    /// Port for client sessions (producers and consumers).
    pub client_port: u16,
    /// Port for peer connections (control and data channels).
    pub peer_port: u16,
    /// Port of the admin HTTP server (`/metrics`, `/status`, `/healthz`, `/readyz`).
    pub admin_port: u16,
}

impl MemberConfig {
    fn addr(&self, port: u16) -> String {
        // An IPv6 literal must be bracketed to be followed by a port.
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("[{}]:{}", self.host, port)
        } else {
            format!("{}:{}", self.host, port)
        }
    }

    /// Client address, `host:port`.
    pub fn client_addr(&self) -> String {
        self.addr(self.client_port)
    }

    /// Peer address, `host:port`.
    pub fn peer_addr(&self) -> String {
        self.addr(self.peer_port)
    }

    /// Admin HTTP address, `host:port`.
    pub fn admin_addr(&self) -> String {
        self.addr(self.admin_port)
    }
}

/// Leader election timings, in milliseconds (DESIGN.md §4, BlazingMQ's elector settings with
/// defaults tuned for sub-second failover).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ElectorSettings {
    /// Time a starting node waits to discover an existing leader before scouting (ms). Default 500.
    pub initial_wait_ms: u64,
    /// Upper bound of the random wait before an ElectionScouting round (ms). Default 300.
    pub random_wait_max_ms: u64,
    /// How long a scouting node waits for ElectionScouting responses (ms, at least 1). Default 500.
    pub scouting_result_timeout_ms: u64,
    /// How long a candidate waits for election responses (ms, at least 1). Default 500.
    pub election_result_timeout_ms: u64,
    /// Period of the leader's heartbeats (ms, at least 1). Default 100.
    pub heartbeat_period_ms: u64,
    /// How often a follower checks for missed heartbeats (ms, 1 to `heartbeat_period_ms`).
    /// Default 50.
    pub heartbeat_check_period_ms: u64,
    /// Missed heartbeats after which a follower drops its leader (at least 1); leader loss is
    /// detected after `heartbeat_miss_count * heartbeat_period_ms`. Default 8 (800 ms).
    pub heartbeat_miss_count: u32,
    /// Supporters needed to win an election, the candidate included; 0 means `N/2 + 1`. A value
    /// above N is accepted so tests can forbid leadership. Default 0.
    pub quorum: u32,
}

impl Default for ElectorSettings {
    fn default() -> Self {
        ElectorSettings {
            initial_wait_ms: 500,
            random_wait_max_ms: 300,
            scouting_result_timeout_ms: 500,
            election_result_timeout_ms: 500,
            heartbeat_period_ms: 100,
            heartbeat_check_period_ms: 50,
            heartbeat_miss_count: 8,
            quorum: 0,
        }
    }
}

impl ElectorSettings {
    /// `initial_wait_ms` as a duration.
    pub fn initial_wait(&self) -> Duration {
        Duration::from_millis(self.initial_wait_ms)
    }
    /// `random_wait_max_ms` as a duration.
    pub fn random_wait_max(&self) -> Duration {
        Duration::from_millis(self.random_wait_max_ms)
    }
    /// `scouting_result_timeout_ms` as a duration.
    pub fn scouting_result_timeout(&self) -> Duration {
        Duration::from_millis(self.scouting_result_timeout_ms)
    }
    /// `election_result_timeout_ms` as a duration.
    pub fn election_result_timeout(&self) -> Duration {
        Duration::from_millis(self.election_result_timeout_ms)
    }
    /// `heartbeat_period_ms` as a duration.
    pub fn heartbeat_period(&self) -> Duration {
        Duration::from_millis(self.heartbeat_period_ms)
    }
    /// `heartbeat_check_period_ms` as a duration.
    pub fn heartbeat_check_period(&self) -> Duration {
        Duration::from_millis(self.heartbeat_check_period_ms)
    }
    /// Silence after which a follower drops its leader:
    /// `heartbeat_miss_count * heartbeat_period`.
    pub fn leader_loss_timeout(&self) -> Duration {
        self.heartbeat_period()
            .saturating_mul(self.heartbeat_miss_count)
    }
    /// The effective quorum for a cluster of `members` nodes: `quorum`, or `members/2 + 1` when
    /// `quorum` is 0.
    pub fn effective_quorum(&self, members: usize) -> usize {
        if self.quorum == 0 {
            members / 2 + 1
        } else {
            self.quorum as usize
        }
    }
}

/// Peer connection settings, in milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LinkSettings {
    /// Period of the per-connection heartbeat (ms, at least 1). Default 100.
    pub heartbeat_period_ms: u64,
    /// Silence after which a peer connection is considered hung and closed (ms, above
    /// `heartbeat_period_ms`). Default 1000.
    pub heartbeat_timeout_ms: u64,
    /// First reconnection delay (ms, at least 1). Default 50.
    pub reconnect_backoff_min_ms: u64,
    /// Largest reconnection delay; the delay doubles up to it, with jitter (ms, at least
    /// `reconnect_backoff_min_ms`). Default 1000.
    pub reconnect_backoff_max_ms: u64,
}

impl Default for LinkSettings {
    fn default() -> Self {
        LinkSettings {
            heartbeat_period_ms: 100,
            heartbeat_timeout_ms: 1000,
            reconnect_backoff_min_ms: 50,
            reconnect_backoff_max_ms: 1000,
        }
    }
}

impl LinkSettings {
    /// `heartbeat_period_ms` as a duration.
    pub fn heartbeat_period(&self) -> Duration {
        Duration::from_millis(self.heartbeat_period_ms)
    }
    /// `heartbeat_timeout_ms` as a duration.
    pub fn heartbeat_timeout(&self) -> Duration {
        Duration::from_millis(self.heartbeat_timeout_ms)
    }
    /// `reconnect_backoff_min_ms` as a duration.
    pub fn reconnect_backoff_min(&self) -> Duration {
        Duration::from_millis(self.reconnect_backoff_min_ms)
    }
    /// `reconnect_backoff_max_ms` as a duration.
    pub fn reconnect_backoff_max(&self) -> Duration {
        Duration::from_millis(self.reconnect_backoff_max_ms)
    }
}

/// When the metadata ledger calls fsync.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsyncSetting {
    /// fsync after each record, before acking or committing it (`every_record`, the default:
    /// metadata writes are rare and a lost committed advisory is a safety violation).
    #[default]
    EveryRecord,
    /// Never fsync (`never`): for tests and benchmarks only; a power loss can lose committed
    /// metadata.
    Never,
}

/// Metadata ledger settings (DESIGN.md §5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetadataSettings {
    /// Size after which the ledger rolls over to a new file (bytes, at least 64 KiB).
    /// Default 64 MiB.
    pub ledger_max_file_size_bytes: u64,
    /// fsync policy. Default `every_record`.
    pub fsync: FsyncSetting,
}

impl Default for MetadataSettings {
    fn default() -> Self {
        MetadataSettings {
            ledger_max_file_size_bytes: 64 * MIB,
            fsync: FsyncSetting::EveryRecord,
        }
    }
}

/// Limits (STYLE.md: a limit on everything).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsSettings {
    /// Largest frame accepted on a client or peer connection (bytes, 4 KiB to 1 GiB); a larger
    /// frame closes the connection. Default 64 MiB.
    pub frame_size_max_bytes: u64,
    /// Client sessions a node accepts at once (at least 1). Default 1024.
    pub client_sessions_max: u32,
    /// Unconfirmed messages per consumer when the consumer does not say (at least 1).
    /// Default 1000.
    pub max_unconfirmed_messages_default: u64,
    /// Unconfirmed bytes per consumer when the consumer does not say (bytes, at least 1).
    /// Default 32 MiB.
    pub max_unconfirmed_bytes_default: u64,
    /// Unacknowledged PUTs a proxying node keeps for retransmission after failover (messages,
    /// at least 1). Default 100 000.
    pub retransmit_buffer_max: u64,
    /// Timeout of every request/response exchange (ms, at least 1). Default 10 000.
    pub request_timeout_ms: u64,
    /// Capacity of each actor mailbox (messages, at least 1). Default 100 000.
    pub mailbox_capacity: u32,
    /// Graceful stop (SIGTERM, `bmqctl admin stop`): how long a stopping node waits for its
    /// primaries to move to other nodes before it exits anyway (ms; 0 = exit at once).
    /// Default 10 000.
    pub graceful_stop_timeout_ms: u64,
    /// How long a partition primary remembers a PUT's GUID to drop resent duplicates (ms).
    /// Default 300 000 (5 minutes).
    pub duplicate_guid_window_ms: u64,
    /// Most GUIDs a partition primary remembers for duplicate detection. Default 1 000 000.
    pub duplicate_guid_window_max: u64,
}

impl Default for LimitsSettings {
    fn default() -> Self {
        LimitsSettings {
            frame_size_max_bytes: 64 * MIB,
            client_sessions_max: 1024,
            max_unconfirmed_messages_default: 1000,
            max_unconfirmed_bytes_default: 32 * MIB,
            retransmit_buffer_max: 100_000,
            request_timeout_ms: 10_000,
            mailbox_capacity: 100_000,
            graceful_stop_timeout_ms: 10_000,
            duplicate_guid_window_ms: 300_000,
            duplicate_guid_window_max: 1_000_000,
        }
    }
}

impl LimitsSettings {
    /// `request_timeout_ms` as a duration.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

/// When a PUT is acknowledged (DESIGN.md §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Consistency {
    /// ACK once a quorum of nodes holds the message (`strong`, the default).
    #[default]
    Strong,
    /// ACK once the primary holds the message (`eventual`).
    Eventual,
}

/// How a queue delivers messages to its consumers (DESIGN.md §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DomainMode {
    /// Round-robin among the highest-priority consumers (`priority`, the default).
    #[default]
    Priority,
    /// Every consumer attached when a PUT arrives gets it (`broadcast`): at-most-once, nothing
    /// is stored or journaled, the PUT is ACKed at once.
    Broadcast,
    /// Every app id of the domain (`app_ids`) gets its own copy of each message (`fanout`);
    /// consumers name their app id, and each app's copies go round-robin among that app's
    /// highest-priority consumers as in `priority` mode.
    Fanout,
}

/// A domain: the settings shared by its queues `bmq://<name>/<queue>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DomainConfig {
    /// Domain name: 1 to 128 of `A-Z a-z 0-9 . _ -`, unique.
    pub name: String,
    /// Acknowledgement policy. Default `strong`.
    #[serde(default)]
    pub consistency: Consistency,
    /// Delivery mode. Default `priority`.
    #[serde(default)]
    pub mode: DomainMode,
    /// The applications of a `fanout` domain (at least one there; unused otherwise), each
    /// 1 to 64 of `A-Z a-z 0-9 . _ -`.
    #[serde(default)]
    pub app_ids: Vec<String>,
    /// Deliveries of one message before it is dropped; 0 means unlimited. Default 5.
    #[serde(default = "default_max_delivery_attempts")]
    pub max_delivery_attempts: u32,
    /// Time to live of a message (ms); 0 means no expiry. Default 0.
    #[serde(default)]
    pub message_ttl_ms: u64,
    /// Messages a queue may hold before PUTs are rejected (at least 1). Default 1 000 000.
    #[serde(default = "default_max_queue_messages")]
    pub max_queue_messages: u64,
    /// Payload bytes a queue may hold before PUTs are rejected (bytes, at least 1).
    /// Default 1 GiB.
    #[serde(default = "default_max_queue_bytes")]
    pub max_queue_bytes: u64,
}

fn default_max_delivery_attempts() -> u32 {
    5
}
fn default_max_queue_messages() -> u64 {
    1_000_000
}
fn default_max_queue_bytes() -> u64 {
    GIB
}

impl DomainConfig {
    /// A domain with the given name and default settings.
    pub fn new(name: impl Into<String>) -> Self {
        DomainConfig {
            name: name.into(),
            consistency: Consistency::default(),
            mode: DomainMode::default(),
            app_ids: Vec::new(),
            max_delivery_attempts: default_max_delivery_attempts(),
            message_ttl_ms: 0,
            max_queue_messages: default_max_queue_messages(),
            max_queue_bytes: default_max_queue_bytes(),
        }
    }

    /// `message_ttl_ms` as a duration; `None` when messages never expire.
    pub fn message_ttl(&self) -> Option<Duration> {
        (self.message_ttl_ms > 0).then(|| Duration::from_millis(self.message_ttl_ms))
    }

    /// `max_delivery_attempts`; `None` when unlimited.
    pub fn max_delivery_attempts(&self) -> Option<u32> {
        (self.max_delivery_attempts > 0).then_some(self.max_delivery_attempts)
    }
}

/// Logging settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSettings {
    /// A `tracing` filter: a level (`error`, `warn`, `info`, `debug`, `trace`) or directives such
    /// as `info,bmq_elector=debug`. `RUST_LOG` overrides it. Default `info`.
    pub level: String,
    /// Log file, appended to; standard error when absent.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_opt_path"
    )]
    pub file: Option<PathBuf>,
}

impl Default for LogSettings {
    fn default() -> Self {
        LogSettings {
            level: "info".to_string(),
            file: None,
        }
    }
}

// Paths are written lossily so that `to_toml_string` cannot fail on a non-UTF-8 path.
fn serialize_path<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&path.to_string_lossy())
}

fn serialize_opt_path<S: Serializer>(path: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
    match path {
        Some(p) => s.serialize_str(&p.to_string_lossy()),
        None => s.serialize_none(),
    }
}

/// True for a valid domain name: 1 to [`DOMAIN_NAME_LEN_MAX`] bytes of `A-Z a-z 0-9 . _ -`.
pub fn is_valid_domain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= DOMAIN_NAME_LEN_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
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

    /// Checks every value and the relations between values.
    ///
    /// Errors: the first [`ConfigError::Invalid`] found, naming the field path and the value,
    /// e.g. `members[2].peer_port: 0 is not a valid port` or
    /// `node_id: 9 is not among members (1, 2, 3)`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
            ConfigError::invalid(field, message)
        }

        if self.cluster_name.is_empty()
            || !self
                .cluster_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(invalid(
                "cluster_name",
                format!(
                    "{:?} is not a valid cluster name (use A-Z a-z 0-9 . _ -)",
                    self.cluster_name
                ),
            ));
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err(invalid("data_dir", "must not be empty"));
        }
        if let Some(host) = &self.listen_host {
            if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c == '/') {
                return Err(invalid(
                    "listen_host",
                    format!("{host:?} is not a valid host"),
                ));
            }
        }

        // Members.
        let n = self.members.len();
        if !(MEMBERS_MIN..=MEMBERS_MAX).contains(&n) {
            return Err(invalid(
                "members",
                format!("{n} members; a cluster has between {MEMBERS_MIN} and {MEMBERS_MAX}"),
            ));
        }
        let mut ids = HashSet::new();
        let mut addrs = HashSet::new();
        for (i, m) in self.members.iter().enumerate() {
            if m.id == 0 {
                return Err(invalid(
                    format!("members[{i}].id"),
                    "0 is not a valid node id (ids start at 1)",
                ));
            }
            if m.host.is_empty() || m.host.chars().any(|c| c.is_whitespace() || c == '/') {
                return Err(invalid(
                    format!("members[{i}].host"),
                    format!("{:?} is not a valid host", m.host),
                ));
            }
            for (name, port) in [
                ("client_port", m.client_port),
                ("peer_port", m.peer_port),
                ("admin_port", m.admin_port),
            ] {
                if port == 0 {
                    return Err(invalid(
                        format!("members[{i}].{name}"),
                        "0 is not a valid port",
                    ));
                }
            }
            if !ids.insert(m.id) {
                return Err(invalid("members", format!("duplicate id {}", m.id)));
            }
            for addr in [m.client_addr(), m.peer_addr(), m.admin_addr()] {
                if !addrs.insert(addr.clone()) {
                    return Err(invalid("members", format!("duplicate address {addr}")));
                }
            }
        }
        if !ids.contains(&self.node_id) {
            let sorted: BTreeSet<u32> = ids.iter().copied().collect();
            let list: Vec<String> = sorted.iter().map(u32::to_string).collect();
            return Err(invalid(
                "node_id",
                format!(
                    "{} is not among members ({})",
                    self.node_id,
                    list.join(", ")
                ),
            ));
        }

        if !(1..=PARTITION_COUNT_MAX).contains(&self.partition_count) {
            return Err(invalid(
                "partition_count",
                format!(
                    "must be between 1 and {PARTITION_COUNT_MAX}, got {}",
                    self.partition_count
                ),
            ));
        }

        // Elector.
        let e = &self.elector;
        for (name, v) in [
            ("scouting_result_timeout_ms", e.scouting_result_timeout_ms),
            ("election_result_timeout_ms", e.election_result_timeout_ms),
            ("heartbeat_period_ms", e.heartbeat_period_ms),
            ("heartbeat_check_period_ms", e.heartbeat_check_period_ms),
        ] {
            if v == 0 {
                return Err(invalid(format!("elector.{name}"), "must be at least 1"));
            }
        }
        if e.heartbeat_check_period_ms > e.heartbeat_period_ms {
            return Err(invalid(
                "elector.heartbeat_check_period_ms",
                format!(
                    "{} must not exceed elector.heartbeat_period_ms ({})",
                    e.heartbeat_check_period_ms, e.heartbeat_period_ms
                ),
            ));
        }
        if e.heartbeat_miss_count == 0 {
            return Err(invalid(
                "elector.heartbeat_miss_count",
                "must be at least 1",
            ));
        }

        // Links.
        let l = &self.link;
        if l.heartbeat_period_ms == 0 {
            return Err(invalid("link.heartbeat_period_ms", "must be at least 1"));
        }
        if l.heartbeat_timeout_ms <= l.heartbeat_period_ms {
            return Err(invalid(
                "link.heartbeat_timeout_ms",
                format!(
                    "{} must exceed link.heartbeat_period_ms ({})",
                    l.heartbeat_timeout_ms, l.heartbeat_period_ms
                ),
            ));
        }
        if l.reconnect_backoff_min_ms == 0 {
            return Err(invalid(
                "link.reconnect_backoff_min_ms",
                "must be at least 1",
            ));
        }
        if l.reconnect_backoff_max_ms < l.reconnect_backoff_min_ms {
            return Err(invalid(
                "link.reconnect_backoff_max_ms",
                format!(
                    "{} must not be below link.reconnect_backoff_min_ms ({})",
                    l.reconnect_backoff_max_ms, l.reconnect_backoff_min_ms
                ),
            ));
        }

        // Metadata.
        if self.metadata.ledger_max_file_size_bytes < LEDGER_FILE_SIZE_MIN_BYTES {
            return Err(invalid(
                "metadata.ledger_max_file_size_bytes",
                format!(
                    "{} is below the minimum of {LEDGER_FILE_SIZE_MIN_BYTES} bytes",
                    self.metadata.ledger_max_file_size_bytes
                ),
            ));
        }

        // Limits.
        let lim = &self.limits;
        if !(FRAME_SIZE_MIN_BYTES..=FRAME_SIZE_MAX_BYTES).contains(&lim.frame_size_max_bytes) {
            return Err(invalid(
                "limits.frame_size_max_bytes",
                format!(
                    "{} is not between {FRAME_SIZE_MIN_BYTES} and {FRAME_SIZE_MAX_BYTES} bytes",
                    lim.frame_size_max_bytes
                ),
            ));
        }
        for (name, v) in [
            ("client_sessions_max", u64::from(lim.client_sessions_max)),
            (
                "max_unconfirmed_messages_default",
                lim.max_unconfirmed_messages_default,
            ),
            (
                "max_unconfirmed_bytes_default",
                lim.max_unconfirmed_bytes_default,
            ),
            ("retransmit_buffer_max", lim.retransmit_buffer_max),
            ("request_timeout_ms", lim.request_timeout_ms),
            ("mailbox_capacity", u64::from(lim.mailbox_capacity)),
        ] {
            if v == 0 {
                return Err(invalid(format!("limits.{name}"), "must be at least 1"));
            }
        }

        // Domains.
        let mut names = HashSet::new();
        for (i, d) in self.domains.iter().enumerate() {
            if !is_valid_domain_name(&d.name) {
                return Err(invalid(
                    format!("domains[{i}].name"),
                    format!("{:?} is not a valid domain name (1 to {DOMAIN_NAME_LEN_MAX} of A-Z a-z 0-9 . _ -)", d.name),
                ));
            }
            if !names.insert(d.name.as_str()) {
                return Err(invalid(
                    format!("domains[{i}].name"),
                    format!("duplicate domain {:?}", d.name),
                ));
            }
            if d.max_queue_messages == 0 {
                return Err(invalid(
                    format!("domains[{i}].max_queue_messages"),
                    "must be at least 1",
                ));
            }
            if d.max_queue_bytes == 0 {
                return Err(invalid(
                    format!("domains[{i}].max_queue_bytes"),
                    "must be at least 1",
                ));
            }
            if d.mode == DomainMode::Fanout && d.app_ids.is_empty() {
                return Err(invalid(
                    format!("domains[{i}].app_ids"),
                    "a fanout domain needs at least one app id",
                ));
            }
            for (j, app) in d.app_ids.iter().enumerate() {
                let valid = !app.is_empty()
                    && app.len() <= 64
                    && app
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
                if !valid {
                    return Err(invalid(
                        format!("domains[{i}].app_ids[{j}]"),
                        "must be 1 to 64 of A-Z a-z 0-9 . _ -",
                    ));
                }
            }
        }

        if self.log.level.trim().is_empty() {
            return Err(invalid("log.level", "must not be empty"));
        }
        if let Some(file) = &self.log.file {
            if file.as_os_str().is_empty() {
                return Err(invalid(
                    "log.file",
                    "must not be empty (omit it to log to standard error)",
                ));
            }
        }
        self.admin.validate()?;
        if let Some(tls) = &self.tls {
            tls.validate()?;
        }
        self.auth.validate(&self.domains)?;
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

    /// Every member except this node.
    pub fn peers(&self) -> impl Iterator<Item = &MemberConfig> {
        let me = self.node_id;
        self.members.iter().filter(move |m| m.id != me)
    }

    /// The domain named `name`, if configured.
    pub fn domain(&self, name: &str) -> Option<&DomainConfig> {
        self.domains.iter().find(|d| d.name == name)
    }

    /// The effective elector quorum for this cluster (`elector.quorum`, or `N/2 + 1` when 0).
    pub fn effective_quorum(&self) -> usize {
        self.elector.effective_quorum(self.members.len())
    }
}

/// Default first port of [`local_cluster`]: client ports are 30101.., peer ports 30201..,
/// admin ports 30301...
pub const LOCAL_CLUSTER_BASE_PORT: u16 = 30100;

/// Builds the configurations of an `nodes`-node cluster on 127.0.0.1 from the embedded default
/// ([`LOCAL_CLUSTER_TOML`]).
///
/// Node `i` (1-based) gets id `i`, client port `base_port + i`, peer port `base_port + 100 + i`,
/// admin port `base_port + 200 + i` (with the default base 30100: 30101.., 30201.., 30301..,
/// the ports of the embedded default and of `bmqctl status`), `data_dir` `dir/node-<i>` and log
/// file `dir/node-<i>/broker.log`. Every other setting is the embedded default's.
///
/// Errors: [`ConfigError::Invalid`] with field `nodes` when `nodes` is not in 1..=7, field
/// `base_port` when the ports would pass 65535, or whatever validation finds.
pub fn local_cluster(
    nodes: usize,
    base_port: u16,
    dir: &Path,
) -> Result<Vec<BrokerConfig>, ConfigError> {
    if !(MEMBERS_MIN..=MEMBERS_MAX).contains(&nodes) {
        return Err(ConfigError::invalid(
            "nodes",
            format!("{nodes} is not between {MEMBERS_MIN} and {MEMBERS_MAX}"),
        ));
    }
    let port = |offset: usize, i: usize| -> Result<u16, ConfigError> {
        u16::try_from(usize::from(base_port) + offset + i).map_err(|_| {
            ConfigError::invalid(
                "base_port",
                format!("{base_port} is too high: the ports of {nodes} nodes would pass 65535"),
            )
        })
    };
    let template = BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML)?;
    let mut members = Vec::with_capacity(nodes);
    for i in 1..=nodes {
        members.push(MemberConfig {
            id: i as u32,
            host: "127.0.0.1".to_string(),
            client_port: port(0, i)?,
            peer_port: port(100, i)?,
            admin_port: port(200, i)?,
        });
    }
    let mut configs = Vec::with_capacity(nodes);
    for i in 1..=nodes {
        let node_dir = dir.join(format!("node-{i}"));
        let mut config = template.clone();
        config.node_id = i as u32;
        config.members = members.clone();
        config.log.file = Some(node_dir.join("broker.log"));
        config.data_dir = node_dir;
        config.validate()?;
        configs.push(config);
    }
    Ok(configs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> BrokerConfig {
        let mut c = BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML).unwrap();
        c.validate().unwrap();
        c.domains = vec![DomainConfig::new("bmq.test")];
        c
    }

    fn field_of(c: &BrokerConfig) -> (String, String) {
        let err = c.validate().expect_err("configuration should be invalid");
        (err.field().unwrap().to_string(), err.to_string())
    }

    #[test]
    fn embedded_default_parses_and_validates() {
        // The embedded local-cluster.toml is node 1 of a 3-node cluster with the documented
        // defaults.
        let c = BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML).unwrap();
        c.validate().unwrap();
        assert_eq!(c.node_id, 1);
        assert_eq!(c.members.len(), 3);
        assert_eq!(c.self_member().client_addr(), "127.0.0.1:30101");
        assert_eq!(c.self_member().peer_addr(), "127.0.0.1:30201");
        assert_eq!(c.self_member().admin_addr(), "127.0.0.1:30301");
        assert_eq!(c.peers().map(|m| m.id).collect::<Vec<_>>(), vec![2, 3]);
        let d = c.domain("bmq.test").unwrap();
        assert_eq!(d.consistency, Consistency::Strong);
        assert_eq!(d.mode, DomainMode::Priority);
        assert!(c.domain("nope").is_none());
        // The file documents the defaults: its values equal the built-in ones.
        assert_eq!(c.elector, ElectorSettings::default());
        assert_eq!(c.link, LinkSettings::default());
        assert_eq!(c.metadata, MetadataSettings::default());
        assert_eq!(c.limits, LimitsSettings::default());
        assert_eq!(c.partition_count, 4);
        assert_eq!(*d, DomainConfig::new("bmq.test"));
        assert_eq!(c.effective_quorum(), 2);
    }

    #[test]
    fn minimal_file_gets_defaults() {
        // A file with only the required fields gets every documented default.
        let c = BrokerConfig::from_toml_str(
            r#"
            cluster_name = "c"
            node_id = 1
            data_dir = "/tmp/x"
            members = [{ id = 1, host = "localhost", client_port = 1, peer_port = 2, admin_port = 3 }]
            [[domains]]
            name = "d"
            "#,
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.partition_count, 4);
        assert_eq!(c.elector.heartbeat_period(), Duration::from_millis(100));
        assert_eq!(c.elector.leader_loss_timeout(), Duration::from_millis(800));
        assert_eq!(c.elector.initial_wait_ms, 500);
        assert_eq!(c.elector.random_wait_max_ms, 300);
        assert_eq!(c.elector.heartbeat_check_period_ms, 50);
        assert_eq!(c.link.heartbeat_timeout(), Duration::from_secs(1));
        assert_eq!(c.link.reconnect_backoff_min(), Duration::from_millis(50));
        assert_eq!(c.metadata.ledger_max_file_size_bytes, 64 * MIB);
        assert_eq!(c.metadata.fsync, FsyncSetting::EveryRecord);
        assert_eq!(c.limits.frame_size_max_bytes, 64 * MIB);
        assert_eq!(c.limits.max_unconfirmed_bytes_default, 32 * MIB);
        assert_eq!(c.limits.request_timeout(), Duration::from_secs(10));
        assert_eq!(c.limits.mailbox_capacity, 100_000);
        let d = &c.domains[0];
        assert_eq!(d.max_delivery_attempts(), Some(5));
        assert_eq!(d.message_ttl(), None);
        assert_eq!(d.max_queue_messages, 1_000_000);
        assert_eq!(d.max_queue_bytes, GIB);
        assert_eq!(c.log.level, "info");
        assert_eq!(c.log.file, None);
        assert_eq!(c.effective_quorum(), 1);
        assert_eq!(c.peers().count(), 0);
    }

    #[test]
    fn enums_use_snake_case() {
        // fsync, consistency and mode are written in snake_case.
        let mut c = base();
        c.metadata.fsync = FsyncSetting::Never;
        c.domains[0].consistency = Consistency::Eventual;
        let text = c.to_toml_string();
        assert!(text.contains(r#"fsync = "never""#), "{text}");
        assert!(text.contains(r#"consistency = "eventual""#), "{text}");
        assert!(text.contains(r#"mode = "priority""#), "{text}");
        let back = BrokerConfig::from_toml_str(&text).unwrap();
        assert_eq!(back, c);
        let text = text.replace(r#""never""#, r#""every_record""#);
        let back = BrokerConfig::from_toml_str(&text).unwrap();
        assert_eq!(back.metadata.fsync, FsyncSetting::EveryRecord);
    }

    #[test]
    fn unknown_fields_are_rejected() {
        // A typo, at the top level or in a section, is an error naming the field, not a silent
        // default.
        let text = LOCAL_CLUSTER_TOML.replace("heartbeat_miss_count", "heartbeat_mis_count");
        let err = BrokerConfig::from_toml_str(&text).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }));
        assert!(err.to_string().contains("heartbeat_mis_count"), "{err}");

        let text = format!("colour = \"blue\"\n{LOCAL_CLUSTER_TOML}");
        let err = BrokerConfig::from_toml_str(&text).unwrap_err();
        assert!(err.to_string().contains("colour"), "{err}");

        let text =
            format!("{LOCAL_CLUSTER_TOML}\n[[domains]]\nname = \"x\"\nmodee = \"priority\"\n");
        let err = BrokerConfig::from_toml_str(&text).unwrap_err();
        assert!(err.to_string().contains("modee"), "{err}");

        let text = LOCAL_CLUSTER_TOML.replace("\"every_record\"", "\"sometimes\"");
        assert_ne!(text, LOCAL_CLUSTER_TOML);
        let err = BrokerConfig::from_toml_str(&text).unwrap_err();
        assert!(err.to_string().contains("sometimes"), "{err}");
    }

    #[test]
    fn invalid_port_names_member_and_port() {
        // A zero port names the member index and the port field.
        let mut c = base();
        c.members[2].peer_port = 0;
        let (field, msg) = field_of(&c);
        assert_eq!(field, "members[2].peer_port");
        assert_eq!(msg, "members[2].peer_port: 0 is not a valid port");
    }

    #[test]
    fn node_id_must_be_a_member() {
        // A node id absent from members lists the members.
        let mut c = base();
        c.node_id = 9;
        let (field, msg) = field_of(&c);
        assert_eq!(field, "node_id");
        assert_eq!(msg, "node_id: 9 is not among members (1, 2, 3)");
    }

    #[test]
    fn duplicate_ids_and_addresses_are_rejected() {
        // Two members with one id, or two listeners on one address, are errors naming the value.
        let mut c = base();
        c.members[2].id = 2;
        assert_eq!(field_of(&c).1, "members: duplicate id 2");

        let mut c = base();
        c.members[2].peer_port = c.members[0].peer_port;
        assert_eq!(field_of(&c).1, "members: duplicate address 127.0.0.1:30201");

        // Same port on one member is a duplicate address too.
        let mut c = base();
        c.members[1].admin_port = c.members[1].client_port;
        assert_eq!(field_of(&c).1, "members: duplicate address 127.0.0.1:30102");
    }

    #[test]
    fn member_count_is_bounded() {
        // Zero members and more than seven are rejected.
        let mut c = base();
        c.members.clear();
        assert_eq!(field_of(&c).0, "members");
        let mut c = base();
        for i in 4..=8 {
            c.members.push(MemberConfig {
                id: i,
                host: "127.0.0.1".into(),
                client_port: 31000 + i as u16,
                peer_port: 32000 + i as u16,
                admin_port: 33000 + i as u16,
            });
        }
        let (field, msg) = field_of(&c);
        assert_eq!(field, "members");
        assert!(msg.contains("8 members"), "{msg}");
    }

    #[test]
    fn member_id_and_host_are_checked() {
        // Node id 0 and an empty host are rejected with their field paths.
        let mut c = base();
        c.members[1].id = 0;
        assert_eq!(field_of(&c).0, "members[1].id");
        let mut c = base();
        c.members[0].host = String::new();
        assert_eq!(field_of(&c).0, "members[0].host");
    }

    #[test]
    fn elector_relations_are_checked() {
        // The heartbeat check may not be slower than the heartbeat, and a miss count is needed.
        let mut c = base();
        c.elector.heartbeat_check_period_ms = 200;
        assert_eq!(
            field_of(&c).1,
            "elector.heartbeat_check_period_ms: 200 must not exceed elector.heartbeat_period_ms (100)"
        );
        let mut c = base();
        c.elector.heartbeat_miss_count = 0;
        assert_eq!(
            field_of(&c).1,
            "elector.heartbeat_miss_count: must be at least 1"
        );
        let mut c = base();
        c.elector.heartbeat_period_ms = 0;
        assert_eq!(field_of(&c).0, "elector.heartbeat_period_ms");
        // A quorum above N is allowed (tests use it to forbid leadership).
        let mut c = base();
        c.elector.quorum = 5;
        c.validate().unwrap();
        assert_eq!(c.effective_quorum(), 5);
    }

    #[test]
    fn partition_count_is_bounded() {
        // Zero partitions and more than 1024 are rejected.
        for bad in [0, 1025] {
            let mut c = base();
            c.partition_count = bad;
            let (field, msg) = field_of(&c);
            assert_eq!(field, "partition_count");
            assert!(
                msg.starts_with("partition_count: must be between 1 and 1024"),
                "{msg}"
            );
        }
    }

    #[test]
    fn domains_are_checked() {
        // Empty, malformed and duplicate domain names are rejected with their index.
        let mut c = base();
        c.domains[0].name = String::new();
        let (field, msg) = field_of(&c);
        assert_eq!(field, "domains[0].name");
        assert!(
            msg.starts_with(r#"domains[0].name: "" is not a valid domain name"#),
            "{msg}"
        );

        let mut c = base();
        c.domains[0].name = "a/b".into();
        assert_eq!(field_of(&c).0, "domains[0].name");

        let mut c = base();
        c.domains.push(DomainConfig::new("bmq.test"));
        let (field, msg) = field_of(&c);
        assert_eq!(field, "domains[1].name");
        assert!(msg.contains("duplicate"), "{msg}");

        let mut c = base();
        c.domains[0].max_queue_bytes = 0;
        assert_eq!(field_of(&c).0, "domains[0].max_queue_bytes");
    }

    #[test]
    fn link_metadata_and_limits_are_checked() {
        // Each section's values are range-checked with their field path.
        let mut c = base();
        c.link.heartbeat_timeout_ms = 100;
        assert_eq!(field_of(&c).0, "link.heartbeat_timeout_ms");
        let mut c = base();
        c.link.reconnect_backoff_max_ms = 10;
        assert_eq!(field_of(&c).0, "link.reconnect_backoff_max_ms");
        let mut c = base();
        c.metadata.ledger_max_file_size_bytes = 1000;
        assert_eq!(field_of(&c).0, "metadata.ledger_max_file_size_bytes");
        let mut c = base();
        c.limits.frame_size_max_bytes = 10;
        assert_eq!(field_of(&c).0, "limits.frame_size_max_bytes");
        let mut c = base();
        c.limits.mailbox_capacity = 0;
        assert_eq!(field_of(&c).0, "limits.mailbox_capacity");
        let mut c = base();
        c.log.level = " ".into();
        assert_eq!(field_of(&c).0, "log.level");
    }

    #[test]
    fn load_names_the_file() {
        // Read, parse and validation errors of load() all name the file.
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.toml");
        let err = BrokerConfig::load(&missing).unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }));
        assert!(err.to_string().contains("missing.toml"), "{err}");

        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "node_id = [").unwrap();
        let err = BrokerConfig::load(&bad).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }));
        assert!(err.to_string().contains("bad.toml"), "{err}");

        let invalid = dir.path().join("invalid.toml");
        std::fs::write(
            &invalid,
            LOCAL_CLUSTER_TOML.replace("node_id = 1", "node_id = 9"),
        )
        .unwrap();
        let err = BrokerConfig::load(&invalid).unwrap_err();
        assert_eq!(err.field(), Some("node_id"));
        assert!(err.to_string().contains("invalid.toml"), "{err}");
        assert!(
            err.to_string().contains("node_id: 9 is not among members"),
            "{err}"
        );

        let good = dir.path().join("good.toml");
        std::fs::write(&good, LOCAL_CLUSTER_TOML).unwrap();
        assert_eq!(
            BrokerConfig::load(&good).unwrap(),
            BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML).unwrap()
        );
    }

    #[test]
    fn local_cluster_has_distinct_ports_and_round_trips() {
        // Three local nodes share one member list with distinct ports and their own directories,
        // and each configuration survives a TOML round trip.
        let dir = Path::new("/tmp/bmq-cluster");
        let configs = local_cluster(3, LOCAL_CLUSTER_BASE_PORT, dir).unwrap();
        assert_eq!(configs.len(), 3);
        let mut ports = HashSet::new();
        for m in &configs[0].members {
            assert!(ports.insert(m.client_port));
            assert!(ports.insert(m.peer_port));
            assert!(ports.insert(m.admin_port));
        }
        assert_eq!(ports.len(), 9);
        assert_eq!(configs[1].members[1].client_port, 30102);
        assert_eq!(configs[1].members[1].peer_port, 30202);
        assert_eq!(configs[1].members[1].admin_port, 30302);
        for (i, c) in configs.iter().enumerate() {
            let id = i as u32 + 1;
            assert_eq!(c.node_id, id);
            assert_eq!(c.members, configs[0].members);
            assert_eq!(c.data_dir, dir.join(format!("node-{id}")));
            assert_eq!(
                c.log.file.as_deref(),
                Some(dir.join(format!("node-{id}/broker.log")).as_path())
            );
            let back = BrokerConfig::from_toml_str(&c.to_toml_string()).unwrap();
            assert_eq!(&back, c);
            back.validate().unwrap();
        }
    }

    #[test]
    fn local_cluster_bounds() {
        // Node counts outside 1..=7 and ports past 65535 are rejected; 1 and 7 nodes work.
        let dir = Path::new("/tmp/x");
        assert_eq!(
            local_cluster(0, 30100, dir).unwrap_err().field(),
            Some("nodes")
        );
        assert_eq!(
            local_cluster(8, 30100, dir).unwrap_err().field(),
            Some("nodes")
        );
        assert_eq!(
            local_cluster(3, 65400, dir).unwrap_err().field(),
            Some("base_port")
        );
        assert_eq!(local_cluster(1, 30100, dir).unwrap().len(), 1);
        let seven = local_cluster(7, 40000, dir).unwrap();
        assert_eq!(seven[6].self_member().admin_port, 40207);
    }

    #[test]
    fn ipv6_hosts_are_bracketed() {
        // An IPv6 literal host yields `[host]:port` addresses.
        let m = MemberConfig {
            id: 1,
            host: "::1".into(),
            client_port: 1,
            peer_port: 2,
            admin_port: 3,
        };
        assert_eq!(m.client_addr(), "[::1]:1");
        assert_eq!(m.admin_addr(), "[::1]:3");
    }

    #[test]
    fn listen_host_replaces_only_the_bound_host() {
        // Without listen_host a node binds its member addresses; with it, the same ports on the
        // listen host, while the member list (what peers dial) is unchanged.
        let mut c = BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML).unwrap();
        c.members[0].host = "broker1".into();
        assert_eq!(
            c.listen_addrs(),
            ["broker1:30101", "broker1:30201", "broker1:30301"].map(String::from)
        );
        c.listen_host = Some("0.0.0.0".into());
        c.validate().unwrap();
        assert_eq!(
            c.listen_addrs(),
            ["0.0.0.0:30101", "0.0.0.0:30201", "0.0.0.0:30301"].map(String::from)
        );
        assert_eq!(c.self_member().peer_addr(), "broker1:30201");
        let back = BrokerConfig::from_toml_str(&c.to_toml_string()).unwrap();
        assert_eq!(back, c);
        c.listen_host = Some(" ".into());
        assert_eq!(field_of(&c).0, "listen_host");
    }
}
