//! The node-wide sections of the configuration: `[[members]]`, `[elector]`, `[link]`,
//! `[metadata]`, `[limits]`, `[replication]`, `[storage]`, `[log]`. Each section validates itself and names
//! the offending field in its error.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

const MIB: u64 = 1024 * 1024;

/// Smallest accepted `metadata.ledger_max_file_size_bytes` (64 KiB): below that, rollover would
/// happen on nearly every record.
pub const LEDGER_FILE_SIZE_MIN_BYTES: u64 = 64 * 1024;
/// Smallest accepted `limits.frame_size_max_bytes` (4 KiB): a frame must at least hold the
/// protocol's control messages.
pub const FRAME_SIZE_MIN_BYTES: u64 = 4 * 1024;
/// Largest accepted `limits.frame_size_max_bytes` (1 GiB).
pub const FRAME_SIZE_MAX_BYTES: u64 = 1024 * 1024 * 1024;

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
    /// Port for applications written with BlazingMQ's own SDKs (the `bmqp` protocol, plain
    /// TCP; BlazingMQ's default is 30114). None (the field left out): no such listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bmqp_port: Option<u16>,
}

impl MemberConfig {
    /// Checks the id, the host and the three ports of `members[index]`.
    ///
    /// Errors: [`ConfigError::Invalid`] on `members[index].<field>`.
    pub fn validate(&self, index: usize) -> Result<(), ConfigError> {
        if self.id == 0 {
            return Err(ConfigError::invalid(
                format!("members[{index}].id"),
                "0 is not a valid node id (ids start at 1)",
            ));
        }
        if !is_valid_host(&self.host) {
            return Err(ConfigError::invalid(
                format!("members[{index}].host"),
                format!("{:?} is not a valid host", self.host),
            ));
        }
        for (name, port) in [
            ("client_port", self.client_port),
            ("peer_port", self.peer_port),
            ("admin_port", self.admin_port),
            ("bmqp_port", self.bmqp_port.unwrap_or(1)),
        ] {
            if port == 0 {
                return Err(ConfigError::invalid(
                    format!("members[{index}].{name}"),
                    "0 is not a valid port",
                ));
            }
        }
        Ok(())
    }

    /// `host:port` with this member's host (bracketed when it is an IPv6 literal).
    pub fn addr_of(&self, port: u16) -> String {
        self.addr(port)
    }

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

    /// The bmqp (BlazingMQ SDK) address, `host:port`, when the member has one.
    pub fn bmqp_addr(&self) -> Option<String> {
        self.bmqp_port.map(|p| self.addr(p))
    }
}

/// Leader election timings, in milliseconds (DESIGN.md §4, BlazingMQ's elector settings with
/// defaults tuned for sub-second failover).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ElectorSettings {
    /// Time a starting node waits to discover an existing leader before scouting (ms). Default 500.
    pub initial_wait_ms: u64,
    /// Upper bound of the random wait before an ElectionScouting round (ms). Default 300. After
    /// a leader's loss the survivors wait in node-id order within it (the lowest id 10-30 ms).
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

    /// Checks the timeouts and their relations.
    ///
    /// Errors: [`ConfigError::Invalid`] on `elector.<field>`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            (
                "scouting_result_timeout_ms",
                self.scouting_result_timeout_ms,
            ),
            (
                "election_result_timeout_ms",
                self.election_result_timeout_ms,
            ),
            ("heartbeat_period_ms", self.heartbeat_period_ms),
            ("heartbeat_check_period_ms", self.heartbeat_check_period_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(
                    format!("elector.{name}"),
                    "must be at least 1",
                ));
            }
        }
        if self.heartbeat_check_period_ms > self.heartbeat_period_ms {
            return Err(ConfigError::invalid(
                "elector.heartbeat_check_period_ms",
                format!(
                    "{} must not exceed elector.heartbeat_period_ms ({})",
                    self.heartbeat_check_period_ms, self.heartbeat_period_ms
                ),
            ));
        }
        if self.heartbeat_miss_count == 0 {
            return Err(ConfigError::invalid(
                "elector.heartbeat_miss_count",
                "must be at least 1",
            ));
        }
        Ok(())
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

    /// Checks the periods and their relations.
    ///
    /// Errors: [`ConfigError::Invalid`] on `link.<field>`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.heartbeat_period_ms == 0 {
            return Err(ConfigError::invalid(
                "link.heartbeat_period_ms",
                "must be at least 1",
            ));
        }
        if self.heartbeat_timeout_ms <= self.heartbeat_period_ms {
            return Err(ConfigError::invalid(
                "link.heartbeat_timeout_ms",
                format!(
                    "{} must exceed link.heartbeat_period_ms ({})",
                    self.heartbeat_timeout_ms, self.heartbeat_period_ms
                ),
            ));
        }
        if self.reconnect_backoff_min_ms == 0 {
            return Err(ConfigError::invalid(
                "link.reconnect_backoff_min_ms",
                "must be at least 1",
            ));
        }
        if self.reconnect_backoff_max_ms < self.reconnect_backoff_min_ms {
            return Err(ConfigError::invalid(
                "link.reconnect_backoff_max_ms",
                format!(
                    "{} must not be below link.reconnect_backoff_min_ms ({})",
                    self.reconnect_backoff_max_ms, self.reconnect_backoff_min_ms
                ),
            ));
        }
        Ok(())
    }
}

/// The CPU scheduling policy of the broker's threads (Linux; elsewhere ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuScheduling {
    /// `SCHED_BATCH` (`batch`, the default): a thread the broker wakes does not preempt the
    /// one that woke it; it runs when a core is free or at the waker's next scheduling point.
    /// The broker's threads hand work to each other all the time (a session to a partition, a
    /// partition to its fsync thread, a node to its peers over loopback): with wakeup
    /// preemption every hand-off on a busy machine is a context switch in the middle of the
    /// waker's batch. Measured (docs/bench/JOURNAL.md, "Fewer context switches"): 1.03-1.48x the
    /// metadata commits/s with 64 in flight (median 1.22x); at 50,000 msgs/s paced, a lower
    /// ACK p99 and CPU per message in 6 of 7 runs; no difference at 30,000 msgs/s or at the
    /// maximum rate. The elector's thread keeps `normal`: its timers decide failover.
    #[default]
    Batch,
    /// `SCHED_OTHER` (`normal`): the kernel's default, wakeup preemption on.
    Normal,
}

/// How the broker process runs on its machine.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProcessSettings {
    /// The scheduling policy of the broker's threads ([`CpuScheduling`]). Default `batch`.
    pub cpu_scheduling: CpuScheduling,
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
    /// Size after which the ledger rolls over to a new file (bytes, at least 64 KiB), or twice
    /// the size of the file as a rollover wrote it (its snapshot), if that is more. Default
    /// 64 MiB.
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

impl MetadataSettings {
    /// Checks the rollover size.
    ///
    /// Errors: [`ConfigError::Invalid`] on `metadata.ledger_max_file_size_bytes`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.ledger_max_file_size_bytes < LEDGER_FILE_SIZE_MIN_BYTES {
            return Err(ConfigError::invalid(
                "metadata.ledger_max_file_size_bytes",
                format!(
                    "{} is below the minimum of {LEDGER_FILE_SIZE_MIN_BYTES} bytes",
                    self.ledger_max_file_size_bytes
                ),
            ));
        }
        Ok(())
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
    /// Timeout of every request/response exchange (ms, at least 1), and how long a client
    /// session waits for its client to read what it has for it before closing the connection.
    /// Default 10 000.
    pub request_timeout_ms: u64,
    /// Capacity of each actor mailbox (messages, at least 1). Default 100 000.
    pub mailbox_capacity: u32,
    /// Graceful stop (SIGTERM, `bmqctl admin stop`): how long a stopping node gives the
    /// consumers of the partitions it leads to confirm what they hold, while it pushes nothing
    /// new, before its primaries move (ms; 0 = no drain). Default 5 000.
    pub graceful_stop_drain_ms: u64,
    /// Graceful stop: how long, from the stop signal, a stopping node waits in all (drain, then
    /// its primaries moving to other nodes) before it exits anyway (ms; 0 = exit at once).
    /// Default 10 000.
    pub graceful_stop_timeout_ms: u64,
    /// How long a partition primary remembers the GUID of a finished message (confirmed by
    /// every app, or removed) to drop resent duplicates (ms); an outstanding message's GUID is
    /// always known. Default 300 000 (5 minutes).
    pub duplicate_guid_window_ms: u64,
    /// Most GUIDs of finished messages a partition primary remembers for duplicate detection
    /// (about 50 bytes each). Default 1 000 000.
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
            graceful_stop_drain_ms: 5_000,
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

    /// `graceful_stop_drain_ms` as a duration.
    pub fn graceful_stop_drain(&self) -> Duration {
        Duration::from_millis(self.graceful_stop_drain_ms)
    }

    /// `graceful_stop_timeout_ms` as a duration.
    pub fn graceful_stop_timeout(&self) -> Duration {
        Duration::from_millis(self.graceful_stop_timeout_ms)
    }

    /// `duplicate_guid_window_ms` as a duration.
    pub fn duplicate_guid_window(&self) -> Duration {
        Duration::from_millis(self.duplicate_guid_window_ms)
    }

    /// `mailbox_capacity` as a `usize`, for the mailboxes and channels it sizes.
    pub fn mailbox_capacity(&self) -> usize {
        usize::try_from(self.mailbox_capacity).unwrap_or(usize::MAX)
    }

    /// Checks the frame size range and that every count and timeout is at least 1.
    ///
    /// Errors: [`ConfigError::Invalid`] on `limits.<field>`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(FRAME_SIZE_MIN_BYTES..=FRAME_SIZE_MAX_BYTES).contains(&self.frame_size_max_bytes) {
            return Err(ConfigError::invalid(
                "limits.frame_size_max_bytes",
                format!(
                    "{} is not between {FRAME_SIZE_MIN_BYTES} and {FRAME_SIZE_MAX_BYTES} bytes",
                    self.frame_size_max_bytes
                ),
            ));
        }
        for (name, v) in [
            ("client_sessions_max", u64::from(self.client_sessions_max)),
            (
                "max_unconfirmed_messages_default",
                self.max_unconfirmed_messages_default,
            ),
            (
                "max_unconfirmed_bytes_default",
                self.max_unconfirmed_bytes_default,
            ),
            ("retransmit_buffer_max", self.retransmit_buffer_max),
            ("request_timeout_ms", self.request_timeout_ms),
            ("mailbox_capacity", u64::from(self.mailbox_capacity)),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(
                    format!("limits.{name}"),
                    "must be at least 1",
                ));
            }
        }
        Ok(())
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
        serialize_with = "crate::serialize_opt_path"
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

impl LogSettings {
    /// Checks that the filter and the file are not empty.
    ///
    /// Errors: [`ConfigError::Invalid`] on `log.<field>`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.level.trim().is_empty() {
            return Err(ConfigError::invalid("log.level", "must not be empty"));
        }
        if self.file.as_ref().is_some_and(|f| f.as_os_str().is_empty()) {
            return Err(ConfigError::invalid(
                "log.file",
                "must not be empty (omit it to log to standard error)",
            ));
        }
        Ok(())
    }
}

/// Replication of partition journals from a primary to its replicas (DESIGN.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicationSettings {
    /// Most journal records in one replication or synchronisation message (at least 1).
    /// Default 256.
    pub batch_records_max: u32,
    /// Most records sent to one replica and not yet receipted; the primary waits for receipts
    /// beyond that (at least `batch_records_max`). Default 8192.
    pub in_flight_records_max: u64,
    /// A replica that answered nothing for this long is sent the unreceipted records again
    /// (and unanswered healing queries and pulls are repeated) (ms, at least 1). Default 500.
    pub resend_after_ms: u64,
}

impl Default for ReplicationSettings {
    fn default() -> Self {
        ReplicationSettings {
            batch_records_max: 256,
            in_flight_records_max: 8192,
            resend_after_ms: 500,
        }
    }
}

impl ReplicationSettings {
    /// `resend_after_ms` as a duration.
    pub fn resend_after(&self) -> Duration {
        Duration::from_millis(self.resend_after_ms)
    }

    /// Checks that every limit is at least 1 and the in-flight window holds a batch.
    ///
    /// Errors: [`ConfigError::Invalid`] on `replication.<field>`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("batch_records_max", u64::from(self.batch_records_max)),
            ("in_flight_records_max", self.in_flight_records_max),
            ("resend_after_ms", self.resend_after_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(
                    format!("replication.{name}"),
                    "must be at least 1",
                ));
            }
        }
        if self.in_flight_records_max < u64::from(self.batch_records_max) {
            return Err(ConfigError::invalid(
                "replication.in_flight_records_max",
                format!(
                    "{} must not be below replication.batch_records_max ({})",
                    self.in_flight_records_max, self.batch_records_max
                ),
            ));
        }
        Ok(())
    }
}

/// Partition journals on disk (DESIGN.md §7, "Storage for months"): segment size, the
/// in-memory cache of recent records, a disk quota, and when a silent replica stops holding
/// back space reclamation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StorageSettings {
    /// Size at which a partition's journal segment is closed and a new one started (MiB, 1 to
    /// 1024). Disk use stays within about two segments of the outstanding data. Default 32.
    pub segment_size_mb: u64,
    /// Bytes of recent journal records each partition keeps in memory on its primary, counted
    /// as framed on disk (record header, GUID, properties and payload, plus a small per-record
    /// entry), so deliveries and replication of fresh messages need no disk read (MiB, 0 to
    /// 4096; a replica caches nothing). Default 8.
    pub cache_mb: u64,
    /// Most disk space one partition's journal may take (MiB; 0 = no quota). A PUT that would
    /// pass it is refused with `LIMIT_REACHED`. Default 0.
    pub partition_quota_mb: u64,
    /// A replica that is behind and has receipted no progress for this long no longer holds
    /// back the removal of confirmed messages from disk; if it falls below what was removed
    /// it receives the live state when it returns (ms, at least 1). Default 10000.
    pub in_sync_timeout_ms: u64,
    /// Whether a deleted full segment is kept as a spare that the next segment is written
    /// over, so a journal fsync does not also write the file's inode (one disk write fewer per
    /// fsync; up to one segment more disk per partition). In the newest segment of a recycled
    /// file the records end at the first one that is not this segment's (an earlier life's
    /// bytes follow them); a damaged record followed by one of its own is still found as
    /// corruption. Default true.
    pub recycle_segments: bool,
}

impl Default for StorageSettings {
    fn default() -> Self {
        StorageSettings {
            segment_size_mb: 32,
            cache_mb: 8,
            partition_quota_mb: 0,
            in_sync_timeout_ms: 10_000,
            recycle_segments: true,
        }
    }
}

impl StorageSettings {
    /// `segment_size_mb` in bytes.
    pub fn segment_size_bytes(&self) -> u64 {
        self.segment_size_mb * 1024 * 1024
    }

    /// `cache_mb` in bytes.
    pub fn cache_bytes(&self) -> u64 {
        self.cache_mb * 1024 * 1024
    }

    /// `partition_quota_mb` in bytes (0 = no quota).
    pub fn partition_quota_bytes(&self) -> u64 {
        self.partition_quota_mb * 1024 * 1024
    }

    /// `in_sync_timeout_ms` as a duration.
    pub fn in_sync_timeout(&self) -> Duration {
        Duration::from_millis(self.in_sync_timeout_ms)
    }

    /// Checks the ranges, and that a quota leaves room for at least two segments.
    ///
    /// Errors: [`ConfigError::Invalid`] on `storage.<field>`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=1024).contains(&self.segment_size_mb) {
            return Err(ConfigError::invalid(
                "storage.segment_size_mb",
                format!("{} is not between 1 and 1024", self.segment_size_mb),
            ));
        }
        if self.cache_mb > 4096 {
            return Err(ConfigError::invalid(
                "storage.cache_mb",
                format!("{} is over 4096", self.cache_mb),
            ));
        }
        if self.partition_quota_mb != 0 && self.partition_quota_mb < 2 * self.segment_size_mb {
            return Err(ConfigError::invalid(
                "storage.partition_quota_mb",
                format!(
                    "{} is below two segments (2 x storage.segment_size_mb = {})",
                    self.partition_quota_mb,
                    2 * self.segment_size_mb
                ),
            ));
        }
        if self.in_sync_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "storage.in_sync_timeout_ms",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Whether `host` can be a host name or address in a `host:port`: not empty, no whitespace,
/// no `/`.
pub fn is_valid_host(host: &str) -> bool {
    !host.is_empty() && !host.chars().any(|c| c.is_whitespace() || c == '/')
}

/// The bmqp listener (BlazingMQ's own client protocol, `[[members]] bmqp_port`): heartbeats
/// to SDK clients, and whether it admits SDKs without TLS when `[tls]` is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BmqpSettings {
    /// After this long without anything from an SDK client, the broker sends it a
    /// HEARTBEAT_REQ (ms; 0 = none; BlazingMQ's `heartbeatIntervalMs`, default 3000). Not sent
    /// to the Java SDK, which cannot decode one.
    pub heartbeat_interval_ms: u64,
    /// A client silent for this many heartbeat intervals is dropped, and what it held
    /// unconfirmed goes to other consumers (at least 1; BlazingMQ's `maxMissedHeartbeats`,
    /// default 10).
    pub max_missed_heartbeats: u32,
    /// With `[tls] client_listener`, the bmqp port speaks TLS to clients that start a TLS
    /// handshake; a client that starts in plain bmqp (the SDKs without TLS, e.g. the Python
    /// SDK 1.2 and the Java SDK) is refused with a log line naming this setting, unless it is
    /// true. Without `[tls]` the port is plain TCP whatever this says. Default false.
    pub allow_plaintext: bool,
}

impl Default for BmqpSettings {
    fn default() -> Self {
        BmqpSettings {
            heartbeat_interval_ms: 3000,
            max_missed_heartbeats: 10,
            allow_plaintext: false,
        }
    }
}

impl BmqpSettings {
    /// `heartbeat_interval_ms` as a duration (`None`: no heartbeats).
    pub fn heartbeat_interval(&self) -> Option<Duration> {
        (self.heartbeat_interval_ms > 0).then(|| Duration::from_millis(self.heartbeat_interval_ms))
    }

    /// Checks `max_missed_heartbeats` is at least 1.
    ///
    /// Errors: [`ConfigError::Invalid`] on `bmqp.max_missed_heartbeats`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_missed_heartbeats == 0 {
            return Err(ConfigError::invalid(
                "bmqp.max_missed_heartbeats",
                "must be at least 1",
            ));
        }
        Ok(())
    }

    /// Whether the settings are the defaults (then not written out).
    pub fn is_default(&self) -> bool {
        *self == BmqpSettings::default()
    }
}
