//! Domains as committed cluster state (DESIGN.md §5a): every domain's settings, created,
//! updated and deleted by `DomainAdvisory`s that the leader stamps with their LSN and every
//! node applies on commit, so no two nodes ever disagree about a domain at one LSN.
//!
//! - [`DomainState`]: the domains and the version (LSN of the last change) of each and of
//!   the whole; seeded from the files' `[[domains]]` by the cluster's first leader (or, on a
//!   ledger written before domains were cluster state, by the first leader that finds none).
//! - The rules a change must pass ([`DomainState::applied`]): a create needs an unused valid
//!   name, an update or a delete an existing domain still at the version the change was
//!   computed against (compare-and-set), settings that pass
//!   [`bmq_config::validate_domains`]; a change of mode or consistency, or a delete without
//!   purge, is refused while queues of the domain are assigned. The app ids of a fanout
//!   domain may change with queues: each queue's primary journals the change before the
//!   queue's next message (an added app gets copies from there on, a removed app's copies
//!   are dropped), as BlazingMQ adds and removes the apps of a live fanout queue.
//! - [`apply_settings`]: the `key=value` settings of the admin interface applied to a
//!   domain's configuration, naming the key that is unknown or the value that is invalid.
//! - [`audit`]: the line (and the counter) every node writes when it commits a change.

use std::collections::BTreeMap;
use std::fmt;

use bmq_config::{validate_domains, Consistency, DomainConfig, DomainMode};
use bmq_proto::peer;
use thiserror::Error;
use tracing::info;

use crate::lsn::Lsn;

/// The keys [`apply_settings`] takes, as the file's `[[domains]]` names them.
pub const SETTING_KEYS: [&str; 7] = [
    "mode",
    "consistency",
    "app_ids",
    "max_delivery_attempts",
    "message_ttl_ms",
    "max_queue_messages",
    "max_queue_bytes",
];

/// Why a domain change (or a wire form of the domains) is refused. The state is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DomainError {
    /// No domain state is committed yet (the first leader seeds it).
    #[error("no domain state is committed yet; retry once a leader is active")]
    NotSeeded,
    /// A create names a domain that exists.
    #[error("domain {name:?} exists already")]
    Exists {
        /// The domain.
        name: String,
    },
    /// An update or delete names a domain that does not exist.
    #[error("unknown domain {name:?}")]
    Unknown {
        /// The domain.
        name: String,
    },
    /// A setting is invalid (the rule of `[[domains]]`, [`bmq_config::validate_domains`]).
    #[error("{field}: {message}")]
    Invalid {
        /// The setting, e.g. `max_queue_messages` or `app_ids[1]`.
        field: String,
        /// What is wrong with its value.
        message: String,
    },
    /// A setting key that domains do not have.
    #[error("unknown setting {key:?} (known: {})", SETTING_KEYS.join(", "))]
    UnknownKey {
        /// The key.
        key: String,
    },
    /// The domain changed since the change was computed (another change came first).
    #[error(
        "domain {name:?} is at version {current}, not {expected}: it changed meanwhile; retry"
    )]
    VersionConflict {
        /// The domain.
        name: String,
        /// The version the change was computed against.
        expected: Lsn,
        /// The domain's version now.
        current: Lsn,
    },
    /// A change stamped with an LSN not above the domain state's version (programmer error
    /// of a leader, or a replayed record).
    #[error("domain change at {lsn} is not after the domain state's version {version}")]
    LsnNotAfter {
        /// The change's LSN.
        lsn: Lsn,
        /// The state's version.
        version: Lsn,
    },
    /// A change of how messages are stored or delivered while the domain has queues (a
    /// fanout domain's app ids excepted).
    #[error(
        "domain {name:?} has {queues} queue(s): its {field} cannot change while it has queues \
         (delete it with --purge and create it again)"
    )]
    ChangeWithQueues {
        /// The domain.
        name: String,
        /// `mode`, `consistency`, or `app_ids` of a domain that is not in fanout mode.
        field: &'static str,
        /// Its queues assigned.
        queues: usize,
    },
    /// A delete without purge while the domain has queues.
    #[error(
        "domain {name:?} has {queues} queue(s); delete it with --purge to drop their messages"
    )]
    HasQueues {
        /// The domain.
        name: String,
        /// Its queues assigned.
        queues: usize,
    },
    /// The advisory or a wire domain misses a part.
    #[error("domain advisory is missing {what}")]
    Missing {
        /// The missing part.
        what: &'static str,
    },
    /// A wire domain has an unknown enum value or repeats a name.
    #[error("invalid domain state: {reason}")]
    BadWire {
        /// What is wrong.
        reason: String,
    },
}

/// One committed domain.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Domain {
    /// Its settings, in the file's shape.
    #[serde(flatten)]
    pub config: DomainConfig,
    /// The LSN of its last change (its creation, or the seed).
    pub version: Lsn,
}

/// The committed domains, by name, and the LSN of the last change of any of them.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct DomainState {
    /// The LSN of the last change: the seed's `LeaderAdvisory`, or the last `DomainAdvisory`.
    pub version: Lsn,
    /// Every domain, by name.
    pub domains: BTreeMap<String, Domain>,
}

impl DomainState {
    /// The domains of the files' `[[domains]]` (validated with the file), each at `version`:
    /// the LSN of the `LeaderAdvisory` that seeds them.
    pub fn seed(configs: &[DomainConfig], version: Lsn) -> Self {
        DomainState {
            version,
            domains: configs
                .iter()
                .map(|c| {
                    let domain = Domain {
                        config: c.clone(),
                        version,
                    };
                    (c.name.clone(), domain)
                })
                .collect(),
        }
    }

    /// The domain named `name`.
    pub fn get(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// The wire form, domains by name.
    pub fn to_wire(&self) -> peer::Domains {
        peer::Domains {
            domains: self
                .domains
                .values()
                .map(|d| config_to_wire(&d.config, d.version))
                .collect(),
            version: Some(self.version.into()),
        }
    }

    /// Reads a wire form.
    ///
    /// # Errors
    /// [`DomainError::BadWire`] for an unknown mode or consistency or a repeated name,
    /// [`DomainError::Invalid`] for settings that do not validate.
    pub fn from_wire(wire: &peer::Domains) -> Result<Self, DomainError> {
        let mut state = DomainState {
            version: wire.version.map(Lsn::from).unwrap_or_default(),
            domains: BTreeMap::new(),
        };
        for info in &wire.domains {
            let config = config_from_wire(info)?;
            check_domain(&config)?;
            let version = info.version.map(Lsn::from).unwrap_or_default();
            let name = config.name.clone();
            if state
                .domains
                .insert(name.clone(), Domain { config, version })
                .is_some()
            {
                return Err(DomainError::BadWire {
                    reason: format!("domain {name:?} appears twice"),
                });
            }
        }
        Ok(state)
    }

    /// This state with `advisory` applied, all or nothing. `queues(name)` counts the queues
    /// of domain `name` assigned in the cluster state.
    ///
    /// # Errors
    /// [`DomainError`] naming the rule the change breaks (see the module doc).
    pub fn applied(
        &self,
        advisory: &peer::DomainAdvisory,
        queues: impl Fn(&str) -> usize,
    ) -> Result<DomainState, DomainError> {
        use peer::domain_advisory::Change;
        let lsn = Lsn::from(advisory.lsn.ok_or(DomainError::Missing { what: "lsn" })?);
        if lsn <= self.version {
            return Err(DomainError::LsnNotAfter {
                lsn,
                version: self.version,
            });
        }
        let change = advisory
            .change
            .as_ref()
            .ok_or(DomainError::Missing { what: "change" })?;
        let mut next = self.clone();
        match change {
            Change::Create(info) => {
                let config = config_from_wire(info)?;
                check_domain(&config)?;
                if self.domains.contains_key(&config.name) {
                    return Err(DomainError::Exists { name: config.name });
                }
                let domain = Domain {
                    config,
                    version: lsn,
                };
                next.domains.insert(domain.config.name.clone(), domain);
            }
            Change::Update(info) => {
                let config = config_from_wire(info)?;
                check_domain(&config)?;
                let current = self.current(&config.name, advisory)?;
                let held = queues(&config.name);
                if held > 0 {
                    let changed = if config.mode != current.config.mode {
                        Some("mode")
                    } else if config.consistency != current.config.consistency {
                        Some("consistency")
                    } else if config.mode != DomainMode::Fanout
                        && config.app_ids != current.config.app_ids
                    {
                        // Unused outside fanout; refused as before, so that no queue of
                        // another mode ever sees them change.
                        Some("app_ids")
                    } else {
                        None
                    };
                    if let Some(field) = changed {
                        return Err(DomainError::ChangeWithQueues {
                            name: config.name,
                            field,
                            queues: held,
                        });
                    }
                }
                let domain = Domain {
                    config,
                    version: lsn,
                };
                next.domains.insert(domain.config.name.clone(), domain);
            }
            Change::Delete(name) => {
                self.current(name, advisory)?;
                let held = queues(name);
                if held > 0 && !advisory.purge {
                    return Err(DomainError::HasQueues {
                        name: name.clone(),
                        queues: held,
                    });
                }
                next.domains.remove(name);
            }
        }
        next.version = lsn;
        Ok(next)
    }

    /// The domain an update or delete names, checked against its expected version.
    fn current(&self, name: &str, advisory: &peer::DomainAdvisory) -> Result<&Domain, DomainError> {
        let current = self.domains.get(name).ok_or_else(|| DomainError::Unknown {
            name: name.to_string(),
        })?;
        let expected = Lsn::from(advisory.expected_version.ok_or(DomainError::Missing {
            what: "expected_version",
        })?);
        if expected != current.version {
            return Err(DomainError::VersionConflict {
                name: name.to_string(),
                expected,
                current: current.version,
            });
        }
        Ok(current)
    }

    /// How the file's `[[domains]]` differ from this state, or `None` if they agree. The
    /// committed state wins: the file only seeds the first start.
    pub fn file_differences(&self, file: &[DomainConfig]) -> Option<String> {
        let mut differences = Vec::new();
        for d in file {
            match self.domains.get(&d.name) {
                None => differences.push(format!("domain {} is not in the cluster state", d.name)),
                Some(c) if c.config != *d => {
                    differences.push(format!("domain {} has other settings in the file", d.name))
                }
                Some(_) => {}
            }
        }
        for name in self.domains.keys() {
            if !file.iter().any(|d| d.name == *name) {
                differences.push(format!("domain {name} is not in the file"));
            }
        }
        (!differences.is_empty()).then(|| differences.join("; "))
    }
}

/// The wire form of one domain's settings at `version`.
pub fn config_to_wire(c: &DomainConfig, version: Lsn) -> peer::DomainInfo {
    peer::DomainInfo {
        name: c.name.clone(),
        mode: match c.mode {
            DomainMode::Priority => peer::DomainMode::Priority,
            DomainMode::Fanout => peer::DomainMode::Fanout,
            DomainMode::Broadcast => peer::DomainMode::Broadcast,
        } as i32,
        consistency: match c.consistency {
            Consistency::Strong => peer::DomainConsistency::Strong,
            Consistency::Eventual => peer::DomainConsistency::Eventual,
        } as i32,
        app_ids: c.app_ids.clone(),
        max_delivery_attempts: c.max_delivery_attempts,
        message_ttl_ms: c.message_ttl_ms,
        max_queue_messages: c.max_queue_messages,
        max_queue_bytes: c.max_queue_bytes,
        version: Some(version.into()),
    }
}

/// Reads one wire domain's settings (not validated: see [`check_domain`]).
///
/// # Errors
/// [`DomainError::BadWire`] for an unknown mode or consistency.
pub fn config_from_wire(info: &peer::DomainInfo) -> Result<DomainConfig, DomainError> {
    let mode = match peer::DomainMode::try_from(info.mode) {
        Ok(peer::DomainMode::Priority) => DomainMode::Priority,
        Ok(peer::DomainMode::Fanout) => DomainMode::Fanout,
        Ok(peer::DomainMode::Broadcast) => DomainMode::Broadcast,
        Err(_) => {
            return Err(DomainError::BadWire {
                reason: format!("domain {:?}: unknown mode {}", info.name, info.mode),
            })
        }
    };
    let consistency = match peer::DomainConsistency::try_from(info.consistency) {
        Ok(peer::DomainConsistency::Strong) => Consistency::Strong,
        Ok(peer::DomainConsistency::Eventual) => Consistency::Eventual,
        Err(_) => {
            return Err(DomainError::BadWire {
                reason: format!(
                    "domain {:?}: unknown consistency {}",
                    info.name, info.consistency
                ),
            })
        }
    };
    Ok(DomainConfig {
        name: info.name.clone(),
        consistency,
        mode,
        app_ids: info.app_ids.clone(),
        max_delivery_attempts: info.max_delivery_attempts,
        message_ttl_ms: info.message_ttl_ms,
        max_queue_messages: info.max_queue_messages,
        max_queue_bytes: info.max_queue_bytes,
    })
}

/// Checks one domain with the file's rule ([`validate_domains`]), naming the setting
/// (`max_queue_messages`, `app_ids[1]`) rather than the file's `domains[0].` path.
///
/// # Errors
/// [`DomainError::Invalid`].
pub fn check_domain(config: &DomainConfig) -> Result<(), DomainError> {
    validate_domains(std::slice::from_ref(config)).map_err(|e| {
        let field = e.field().unwrap_or("domain");
        let field = field
            .strip_prefix("domains[0].")
            .unwrap_or(field)
            .to_string();
        let message = match &e {
            bmq_config::ConfigError::Invalid { message, .. } => message.clone(),
            other => other.to_string(),
        };
        DomainError::Invalid { field, message }
    })
}

/// `base` with the `key=value` settings applied in order, then checked ([`check_domain`]).
/// Keys are [`SETTING_KEYS`]; `app_ids` is a comma-separated list (empty: none); `mode` is
/// `priority | fanout | broadcast`, `consistency` `strong | eventual`; the numbers are
/// decimal in the unit their name carries.
///
/// # Errors
/// [`DomainError::UnknownKey`], or [`DomainError::Invalid`] naming the key.
pub fn apply_settings(
    mut base: DomainConfig,
    settings: &[(String, String)],
) -> Result<DomainConfig, DomainError> {
    fn number<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, DomainError> {
        value.trim().parse().map_err(|_| DomainError::Invalid {
            field: key.to_string(),
            message: format!("{value:?} is not a non-negative integer"),
        })
    }
    for (key, value) in settings {
        match key.as_str() {
            "mode" => {
                base.mode = match value.as_str() {
                    "priority" => DomainMode::Priority,
                    "fanout" => DomainMode::Fanout,
                    "broadcast" => DomainMode::Broadcast,
                    _ => {
                        return Err(DomainError::Invalid {
                            field: key.clone(),
                            message: format!("{value:?}: expected priority, fanout or broadcast"),
                        })
                    }
                }
            }
            "consistency" => {
                base.consistency = match value.as_str() {
                    "strong" => Consistency::Strong,
                    "eventual" => Consistency::Eventual,
                    _ => {
                        return Err(DomainError::Invalid {
                            field: key.clone(),
                            message: format!("{value:?}: expected strong or eventual"),
                        })
                    }
                }
            }
            "app_ids" => {
                base.app_ids = value
                    .split(',')
                    .map(str::trim)
                    .filter(|a| !a.is_empty())
                    .map(String::from)
                    .collect()
            }
            "max_delivery_attempts" => base.max_delivery_attempts = number(key, value)?,
            "message_ttl_ms" => base.message_ttl_ms = number(key, value)?,
            "max_queue_messages" => base.max_queue_messages = number(key, value)?,
            "max_queue_bytes" => base.max_queue_bytes = number(key, value)?,
            _ => return Err(DomainError::UnknownKey { key: key.clone() }),
        }
    }
    check_domain(&base)?;
    Ok(base)
}

/// A domain advisory, not yet stamped (the leader sets `lsn` as it proposes it).
pub fn advisory(change: peer::domain_advisory::Change, requested_by: &str) -> peer::Advisory {
    peer::Advisory {
        kind: Some(peer::advisory::Kind::Domain(Box::new(
            peer::DomainAdvisory {
                change: Some(change),
                requested_by: requested_by.to_string(),
                ..Default::default()
            },
        ))),
    }
}

/// The kind of a change as `bmq_config_changes_total{kind}` counts it.
pub fn change_kind(advisory: &peer::DomainAdvisory) -> &'static str {
    use peer::domain_advisory::Change;
    match advisory.change {
        Some(Change::Create(_)) => "domain_create",
        Some(Change::Update(_)) => "domain_update",
        Some(Change::Delete(_)) | None => "domain_delete",
    }
}

/// A domain's settings in one line, for the audit log.
struct Settings<'a>(Option<&'a peer::DomainInfo>);

impl fmt::Display for Settings<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(info) = self.0 else {
            return f.write_str("none");
        };
        match config_from_wire(info) {
            Ok(c) => write!(
                f,
                "mode={:?} consistency={:?} app_ids={:?} max_delivery_attempts={} \
                 message_ttl_ms={} max_queue_messages={} max_queue_bytes={}",
                c.mode,
                c.consistency,
                c.app_ids,
                c.max_delivery_attempts,
                c.message_ttl_ms,
                c.max_queue_messages,
                c.max_queue_bytes
            ),
            Err(e) => write!(f, "{e}"),
        }
    }
}

/// Logs a committed domain change (who asked, the settings before and after, the LSN) and
/// counts it in `bmq_config_changes_total{kind}`. Every node calls it once per change, as it
/// commits it.
pub fn audit(lsn: Lsn, advisory: &peer::DomainAdvisory) {
    use peer::domain_advisory::Change;
    let kind = change_kind(advisory);
    let (name, after) = match &advisory.change {
        Some(Change::Create(i)) | Some(Change::Update(i)) => (i.name.as_str(), Some(i)),
        Some(Change::Delete(name)) => (name.as_str(), None),
        None => ("", None),
    };
    info!(
        %lsn,
        kind,
        domain = name,
        by = %advisory.requested_by,
        purge = advisory.purge,
        before = %Settings(advisory.previous.as_ref()),
        after = %Settings(after),
        "domain change committed"
    );
    metrics::counter!("bmq_config_changes_total", "kind" => kind).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use bmq_proto::Term;
    use peer::domain_advisory::Change;

    fn lsn(term: u64, sequence: u64) -> Lsn {
        Lsn::new(Term(term), sequence)
    }

    fn stamped(change: Change, at: Lsn, expected: Option<Lsn>) -> peer::DomainAdvisory {
        peer::DomainAdvisory {
            change: Some(change),
            lsn: Some(at.into()),
            expected_version: expected.map(Into::into),
            requested_by: "ops".into(),
            ..Default::default()
        }
    }

    fn seeded() -> DomainState {
        DomainState::seed(&[DomainConfig::new("bmq.a")], lsn(1, 1))
    }

    #[test]
    fn create_update_delete_apply_in_order_and_version_each() {
        // A domain is created, updated and deleted; each change versions it and the state.
        let s = seeded();
        let created = DomainConfig::new("bmq.b");
        let s = s
            .applied(
                &stamped(
                    Change::Create(config_to_wire(&created, Lsn::ZERO)),
                    lsn(1, 2),
                    None,
                ),
                |_| 0,
            )
            .unwrap();
        assert_eq!(s.version, lsn(1, 2));
        assert_eq!(s.get("bmq.b").unwrap().version, lsn(1, 2));
        let mut updated = created.clone();
        updated.max_queue_messages = 3;
        let s = s
            .applied(
                &stamped(
                    Change::Update(config_to_wire(&updated, Lsn::ZERO)),
                    lsn(1, 3),
                    Some(lsn(1, 2)),
                ),
                |_| 5,
            )
            .unwrap();
        assert_eq!(s.get("bmq.b").unwrap().config.max_queue_messages, 3);
        let s = s
            .applied(
                &stamped(Change::Delete("bmq.b".into()), lsn(2, 4), Some(lsn(1, 3))),
                |_| 0,
            )
            .unwrap();
        assert!(s.get("bmq.b").is_none());
        assert_eq!(s.version, lsn(2, 4));
        assert!(s.get("bmq.a").is_some());
    }

    #[test]
    fn bad_changes_are_refused_with_the_rule() {
        // A name clash, an unknown domain, a stale version, an invalid value, an old LSN, a
        // mode change or a delete of a domain with queues: each refused, nothing changed.
        let s = seeded();
        let a = DomainConfig::new("bmq.a");
        let clash = stamped(
            Change::Create(config_to_wire(&a, Lsn::ZERO)),
            lsn(1, 2),
            None,
        );
        assert!(matches!(
            s.applied(&clash, |_| 0),
            Err(DomainError::Exists { .. })
        ));
        let unknown = stamped(Change::Delete("nope".into()), lsn(1, 2), Some(lsn(1, 1)));
        assert!(matches!(
            s.applied(&unknown, |_| 0),
            Err(DomainError::Unknown { .. })
        ));
        let stale = stamped(Change::Delete("bmq.a".into()), lsn(1, 2), Some(lsn(1, 0)));
        assert!(matches!(
            s.applied(&stale, |_| 0),
            Err(DomainError::VersionConflict { .. })
        ));
        let mut zero = a.clone();
        zero.max_queue_bytes = 0;
        let invalid = stamped(
            Change::Update(config_to_wire(&zero, Lsn::ZERO)),
            lsn(1, 2),
            Some(lsn(1, 1)),
        );
        match s.applied(&invalid, |_| 0) {
            Err(DomainError::Invalid { field, .. }) => assert_eq!(field, "max_queue_bytes"),
            other => panic!("{other:?}"),
        }
        let mut bad_name = DomainConfig::new("a/b");
        bad_name.max_queue_messages = 1;
        let bad = stamped(
            Change::Create(config_to_wire(&bad_name, Lsn::ZERO)),
            lsn(1, 2),
            None,
        );
        match s.applied(&bad, |_| 0) {
            Err(DomainError::Invalid { field, .. }) => assert_eq!(field, "name"),
            other => panic!("{other:?}"),
        }
        let old = stamped(Change::Delete("bmq.a".into()), lsn(1, 1), Some(lsn(1, 1)));
        assert!(matches!(
            s.applied(&old, |_| 0),
            Err(DomainError::LsnNotAfter { .. })
        ));
        let mut fanout = a.clone();
        fanout.mode = DomainMode::Fanout;
        fanout.app_ids = vec!["x".into()];
        let mode = stamped(
            Change::Update(config_to_wire(&fanout, Lsn::ZERO)),
            lsn(1, 2),
            Some(lsn(1, 1)),
        );
        assert!(matches!(
            s.applied(&mode, |_| 1),
            Err(DomainError::ChangeWithQueues { field: "mode", .. })
        ));
        assert!(s.applied(&mode, |_| 0).is_ok(), "allowed without queues");
        let delete = stamped(Change::Delete("bmq.a".into()), lsn(1, 2), Some(lsn(1, 1)));
        assert!(matches!(
            s.applied(&delete, |_| 2),
            Err(DomainError::HasQueues { queues: 2, .. })
        ));
        let mut purge = delete.clone();
        purge.purge = true;
        assert!(s.applied(&purge, |_| 2).is_ok());
        assert_eq!(s, seeded(), "refusals changed nothing");
    }

    #[test]
    fn a_fanout_domains_app_ids_change_with_queues_its_mode_and_consistency_do_not() {
        // A fanout domain with queues: its app ids change (the partitions follow), its mode
        // and consistency stay refused; a priority domain's app ids stay refused too.
        let mut fanout = DomainConfig::new("bmq.f");
        fanout.mode = DomainMode::Fanout;
        fanout.app_ids = vec!["foo".into(), "bar".into()];
        let s = DomainState::seed(&[fanout.clone(), DomainConfig::new("bmq.p")], lsn(1, 1));
        let update = |c: &DomainConfig| {
            stamped(
                Change::Update(config_to_wire(c, Lsn::ZERO)),
                lsn(1, 2),
                Some(lsn(1, 1)),
            )
        };
        let mut more = fanout.clone();
        more.app_ids.push("qux".into());
        let next = s
            .applied(&update(&more), |_| 3)
            .expect("app ids change with queues");
        assert_eq!(next.get("bmq.f").unwrap().config.app_ids, more.app_ids);
        let mut fewer = fanout.clone();
        fewer.app_ids = vec!["bar".into()];
        assert!(s.applied(&update(&fewer), |_| 3).is_ok());
        let mut mode = more.clone();
        mode.mode = DomainMode::Priority;
        assert!(matches!(
            s.applied(&update(&mode), |_| 3),
            Err(DomainError::ChangeWithQueues { field: "mode", .. })
        ));
        let mut consistency = more.clone();
        consistency.consistency = Consistency::Eventual;
        assert!(matches!(
            s.applied(&update(&consistency), |_| 3),
            Err(DomainError::ChangeWithQueues {
                field: "consistency",
                ..
            })
        ));
        let mut priority = DomainConfig::new("bmq.p");
        priority.app_ids = vec!["x".into()];
        assert!(matches!(
            s.applied(&update(&priority), |_| 1),
            Err(DomainError::ChangeWithQueues {
                field: "app_ids",
                ..
            })
        ));
    }

    #[test]
    fn settings_name_the_unknown_key_and_the_invalid_value() {
        // `key=value` settings: applied in order; an unknown key or a bad value is named.
        let set = |pairs: &[(&str, &str)]| {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            apply_settings(DomainConfig::new("d"), &pairs)
        };
        let c = set(&[
            ("mode", "fanout"),
            ("app_ids", "a, b"),
            ("message_ttl_ms", "50"),
        ])
        .unwrap();
        assert_eq!(c.mode, DomainMode::Fanout);
        assert_eq!(c.app_ids, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(c.message_ttl_ms, 50);
        assert!(matches!(
            set(&[("colour", "red")]),
            Err(DomainError::UnknownKey { .. })
        ));
        match set(&[("max_queue_messages", "-1")]) {
            Err(DomainError::Invalid { field, .. }) => assert_eq!(field, "max_queue_messages"),
            other => panic!("{other:?}"),
        }
        match set(&[("mode", "fanout")]) {
            Err(DomainError::Invalid { field, message }) => {
                assert_eq!(field, "app_ids");
                assert!(message.contains("at least one app id"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        match set(&[("mode", "fanout"), ("app_ids", "ok,not ok")]) {
            Err(DomainError::Invalid { field, .. }) => assert_eq!(field, "app_ids[1]"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_wire_form_round_trips_and_a_file_that_differs_is_described() {
        // The wire form reads back equal; the file's differences name each domain.
        let mut fanout = DomainConfig::new("bmq.f");
        fanout.mode = DomainMode::Fanout;
        fanout.app_ids = vec!["x".into(), "y".into()];
        fanout.consistency = Consistency::Eventual;
        let s = DomainState::seed(&[DomainConfig::new("bmq.a"), fanout.clone()], lsn(3, 1));
        assert_eq!(DomainState::from_wire(&s.to_wire()).unwrap(), s);
        assert_eq!(
            s.file_differences(&[DomainConfig::new("bmq.a"), fanout.clone()]),
            None
        );
        let mut other = fanout.clone();
        other.max_queue_messages = 7;
        let diff = s
            .file_differences(&[other, DomainConfig::new("bmq.new")])
            .unwrap();
        assert!(diff.contains("bmq.f has other settings"), "{diff}");
        assert!(
            diff.contains("bmq.new is not in the cluster state"),
            "{diff}"
        );
        assert!(diff.contains("bmq.a is not in the file"), "{diff}");
    }
}
