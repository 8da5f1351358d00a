//! `[[domains]]`: the settings shared by the queues `bmq://<name>/<queue>` of a domain
//! (consistency, delivery mode, app ids, limits, TTL) and their validation.

use std::time::Duration;

use bmq_proto::uri::{is_valid_domain_name, DOMAIN_LEN_MAX};
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

const GIB: u64 = 1024 * 1024 * 1024;

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

/// Longest app id of a fanout domain, bytes.
pub const APP_ID_LEN_MAX: usize = 64;

/// Checks every domain: a valid unique name, non-zero limits, app ids for fanout.
///
/// Errors: [`ConfigError::Invalid`] on `domains[i].<field>`.
pub fn validate_domains(domains: &[DomainConfig]) -> Result<(), ConfigError> {
    let mut names = std::collections::HashSet::new();
    for (i, d) in domains.iter().enumerate() {
        let field = |name: &str| format!("domains[{i}].{name}");
        if !is_valid_domain_name(&d.name) {
            return Err(ConfigError::invalid(
                field("name"),
                format!(
                    "{:?} is not a valid domain name (1 to {DOMAIN_LEN_MAX} of A-Z a-z 0-9 . _ -)",
                    d.name
                ),
            ));
        }
        if !names.insert(d.name.as_str()) {
            return Err(ConfigError::invalid(
                field("name"),
                format!("duplicate domain {:?}", d.name),
            ));
        }
        if d.max_queue_messages == 0 {
            return Err(ConfigError::invalid(
                field("max_queue_messages"),
                "must be at least 1",
            ));
        }
        if d.max_queue_bytes == 0 {
            return Err(ConfigError::invalid(
                field("max_queue_bytes"),
                "must be at least 1",
            ));
        }
        if d.mode == DomainMode::Fanout && d.app_ids.is_empty() {
            return Err(ConfigError::invalid(
                field("app_ids"),
                "a fanout domain needs at least one app id",
            ));
        }
        // The journal's index tracks a message's apps in a 64-bit mask.
        if d.app_ids.len() > 64 {
            return Err(ConfigError::invalid(
                field("app_ids"),
                format!(
                    "{} app ids; a fanout domain has at most 64",
                    d.app_ids.len()
                ),
            ));
        }
        for (j, app) in d.app_ids.iter().enumerate() {
            let valid = !app.is_empty()
                && app.len() <= APP_ID_LEN_MAX
                && app
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
            if !valid {
                return Err(ConfigError::invalid(
                    format!("domains[{i}].app_ids[{j}]"),
                    format!("must be 1 to {APP_ID_LEN_MAX} of A-Z a-z 0-9 . _ -"),
                ));
            }
        }
    }
    Ok(())
}
