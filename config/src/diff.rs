//! What changes between the running configuration and the file as it is now: the input of a
//! live reload (`bmqctl admin reload`, `POST /admin/reload`, SIGHUP).
//!
//! A few settings can change while the node runs: the client tokens (`[auth]`), the admin
//! token (`[admin] token`), the TLS files (`[tls] ca_file`, `cert_file`, `key_file`) and
//! `log.level`. [`diff`] describes how each of those changed — never with a secret: a
//! token is named, and its secret shows only as a fingerprint — and names every other field
//! that differs ([`ConfigDiff::needs_restart`]), which a reload does not apply.
//!
//! The contents of the TLS files are not compared here (this crate reads no files); the node
//! compares the certificates' fingerprints itself.

use std::collections::BTreeMap;

use crate::security::{AuthSettings, Permission, TokenConfig};
use crate::BrokerConfig;

/// How one client token changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenChangeKind {
    /// A token with a new name.
    Added,
    /// A name no longer in the file.
    Removed,
    /// The same name with another secret, permissions or domains.
    Changed,
}

impl TokenChangeKind {
    /// `added`, `removed` or `changed`.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenChangeKind::Added => "added",
            TokenChangeKind::Removed => "removed",
            TokenChangeKind::Changed => "changed",
        }
    }
}

/// One client token's change, described without its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenChange {
    /// The token's name.
    pub name: String,
    /// Added, removed or changed.
    pub kind: TokenChangeKind,
    /// The token as it was (`None` when added): `secret <fingerprint>, permissions [..],
    /// domains [..]`.
    pub before: Option<String>,
    /// The token as it is now (`None` when removed).
    pub after: Option<String>,
    /// Why the sessions that authenticated with the token as it was must end (`None`: they
    /// may go on): removed, its secret changed (the old one is no longer valid), or it lost a
    /// permission or a domain.
    pub revokes: Option<String>,
}

/// What differs between two configurations (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigDiff {
    /// Client tokens added, removed or changed, in name order.
    pub tokens: Vec<TokenChange>,
    /// Client authentication goes from off (no token) to on: the sessions that were let in
    /// without a token must end.
    pub auth_turned_on: bool,
    /// `auth.bmqp_identity`, before and after, when it changed.
    pub bmqp_identity: Option<(Option<String>, Option<String>)>,
    /// `admin.token` as fingerprints (`none` when unset), before and after, when it changed.
    pub admin_token: Option<(String, String)>,
    /// `log.level`, before and after, when it changed.
    pub log_level: Option<(String, String)>,
    /// `[tls]` paths that changed: (field, before, after), e.g.
    /// `("tls.cert_file", "/etc/bmq/old.pem", "/etc/bmq/new.pem")`.
    pub tls_paths: Vec<(String, String, String)>,
    /// Field paths that differ and cannot change while the node runs, in the order of
    /// [`BrokerConfig`]'s fields (`partition_count`, `elector.heartbeat_period_ms`, `members`,
    /// `tls`); an array differs as a whole (`members`, `domains`), and so does a section
    /// that one side leaves out (`tls`, `admin` for `admin.listen_host`, `bmqp`).
    pub needs_restart: Vec<String>,
    /// Settings that differ but are cluster state, which the file only seeds at the cluster's
    /// first start ([`SEED_ONLY`]: `members`, `domains`, `join`): neither a reload nor a restart
    /// applies them; the committed state is changed through the leader instead.
    pub seed_only: Vec<String>,
}

/// Top-level settings that seed the cluster state at the first start only (DESIGN.md §5a):
/// the committed membership and domains win afterwards.
pub const SEED_ONLY: [&str; 3] = ["members", "domains", "join"];

impl ConfigDiff {
    /// Whether any live setting changed (what a reload applies).
    pub fn has_live_changes(&self) -> bool {
        !self.tokens.is_empty()
            || self.auth_turned_on
            || self.bmqp_identity.is_some()
            || self.admin_token.is_some()
            || self.log_level.is_some()
            || !self.tls_paths.is_empty()
    }
}

/// Compares the `running` configuration with the `file`'s (both valid).
///
/// `fingerprint` turns a secret into what may be shown of it (the node uses a prefix of its
/// SHA-256); it is called on secrets only.
pub fn diff(
    running: &BrokerConfig,
    file: &BrokerConfig,
    fingerprint: &dyn Fn(&str) -> String,
) -> ConfigDiff {
    let mut out = ConfigDiff {
        tokens: token_changes(&running.auth, &file.auth, fingerprint),
        auth_turned_on: running.auth.is_empty() && !file.auth.is_empty(),
        ..ConfigDiff::default()
    };
    if running.auth.bmqp_identity != file.auth.bmqp_identity {
        out.bmqp_identity = Some((
            running.auth.bmqp_identity.clone(),
            file.auth.bmqp_identity.clone(),
        ));
    }
    if running.admin.token != file.admin.token {
        let show = |t: &Option<String>| t.as_deref().map_or("none".to_string(), fingerprint);
        out.admin_token = Some((show(&running.admin.token), show(&file.admin.token)));
    }
    if running.log.level != file.log.level {
        out.log_level = Some((running.log.level.clone(), file.log.level.clone()));
    }
    if let (Some(a), Some(b)) = (&running.tls, &file.tls) {
        for (name, x, y) in [
            ("tls.ca_file", &a.ca_file, &b.ca_file),
            ("tls.cert_file", &a.cert_file, &b.cert_file),
            ("tls.key_file", &a.key_file, &b.key_file),
        ] {
            if x != y {
                out.tls_paths.push((
                    name.to_string(),
                    x.display().to_string(),
                    y.display().to_string(),
                ));
            }
        }
    }
    let (seed_only, needs_restart): (Vec<String>, Vec<String>) = restart_fields(running, file)
        .into_iter()
        .partition(|f| SEED_ONLY.contains(&f.as_str()));
    out.needs_restart = needs_restart;
    out.seed_only = seed_only;
    out
}

/// `running` with the live settings of `file` (what the node runs after a reload that
/// applied them): the settings that need a restart stay as they are.
pub fn apply_live(running: &BrokerConfig, file: &BrokerConfig) -> BrokerConfig {
    let mut next = running.clone();
    next.auth = file.auth.clone();
    next.admin.token = file.admin.token.clone();
    next.log.level = file.log.level.clone();
    if let (Some(tls), Some(new)) = (next.tls.as_mut(), &file.tls) {
        tls.ca_file = new.ca_file.clone();
        tls.cert_file = new.cert_file.clone();
        tls.key_file = new.key_file.clone();
    }
    next
}

/// The fields that differ once the live settings are made equal (see
/// [`ConfigDiff::needs_restart`]).
fn restart_fields(running: &BrokerConfig, file: &BrokerConfig) -> Vec<String> {
    let file = apply_live(file, running);
    let (Ok(a), Ok(b)) = (toml::Value::try_from(running), toml::Value::try_from(&file)) else {
        // Every field serializes (see `BrokerConfig::to_toml_string`); should that ever fail,
        // claiming a difference is the safe answer: nothing is applied silently.
        return vec!["(the configurations cannot be compared)".to_string()];
    };
    let mut fields = Vec::new();
    differing_paths("", &a, &b, &mut fields);
    fields
}

/// Appends to `out` the paths under `prefix` where `a` and `b` differ: tables are compared
/// key by key, anything else (arrays included) as a whole.
fn differing_paths(prefix: &str, a: &toml::Value, b: &toml::Value, out: &mut Vec<String>) {
    match (a, b) {
        (toml::Value::Table(x), toml::Value::Table(y)) => {
            let mut keys: Vec<&String> = x.keys().collect();
            keys.extend(y.keys().filter(|k| !x.contains_key(*k)));
            for key in keys {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                match (x.get(key), y.get(key)) {
                    (Some(v), Some(w)) => differing_paths(&path, v, w, out),
                    _ => out.push(path),
                }
            }
        }
        _ if a != b => out.push(prefix.to_string()),
        _ => {}
    }
}

/// `secret <fp>, permissions [produce, consume], domains [bmq.test]`.
fn describe(token: &TokenConfig, fingerprint: &dyn Fn(&str) -> String) -> String {
    let permissions: Vec<&str> = token.permissions.iter().map(|p| p.as_str()).collect();
    format!(
        "secret {}, permissions [{}], domains [{}]",
        fingerprint(&token.secret),
        permissions.join(", "),
        token.domains.join(", ")
    )
}

/// Why the sessions that authenticated with the token `old` must end now that the token of
/// that name is `new`, if they must: its secret changed (the old one is no longer valid), or
/// it lost a permission or (for `produce` and `consume`) a domain. Gains never end a session.
pub fn token_revocation(old: &TokenConfig, new: &TokenConfig) -> Option<String> {
    if old.secret != new.secret {
        return Some("its secret changed".to_string());
    }
    let lost: Vec<&str> = old
        .permissions
        .iter()
        .filter(|p| !new.permissions.contains(p))
        .map(|p| p.as_str())
        .collect();
    if !lost.is_empty() {
        return Some(format!("it lost the {} permission", lost.join(", ")));
    }
    // Domains matter only for produce and consume.
    let scoped = old
        .permissions
        .iter()
        .any(|p| matches!(p, Permission::Produce | Permission::Consume));
    let everything = new.domains.iter().any(|d| d == "*");
    if scoped && !everything {
        let lost: Vec<&str> = old
            .domains
            .iter()
            .filter(|d| !new.domains.contains(d))
            .map(String::as_str)
            .collect();
        if !lost.is_empty() {
            return Some(format!("it lost the domain {}", lost.join(", ")));
        }
    }
    None
}

/// The client tokens added, removed or changed between `old` and `new`, by name.
fn token_changes(
    old: &AuthSettings,
    new: &AuthSettings,
    fingerprint: &dyn Fn(&str) -> String,
) -> Vec<TokenChange> {
    let before: BTreeMap<&str, &TokenConfig> =
        old.tokens.iter().map(|t| (t.name.as_str(), t)).collect();
    let after: BTreeMap<&str, &TokenConfig> =
        new.tokens.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut names: Vec<&str> = before.keys().chain(after.keys()).copied().collect();
    names.sort_unstable();
    names.dedup();
    let mut out = Vec::new();
    for name in names {
        let change = match (before.get(name), after.get(name)) {
            (Some(a), Some(b)) if a == b => continue,
            (Some(a), Some(b)) => TokenChange {
                name: name.to_string(),
                kind: TokenChangeKind::Changed,
                before: Some(describe(a, fingerprint)),
                after: Some(describe(b, fingerprint)),
                revokes: token_revocation(a, b),
            },
            (Some(a), None) => TokenChange {
                name: name.to_string(),
                kind: TokenChangeKind::Removed,
                before: Some(describe(a, fingerprint)),
                after: None,
                revokes: Some("it was removed".to_string()),
            },
            (None, Some(b)) => TokenChange {
                name: name.to_string(),
                kind: TokenChangeKind::Added,
                before: None,
                after: Some(describe(b, fingerprint)),
                revokes: None,
            },
            (None, None) => continue,
        };
        out.push(change);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DomainConfig, LOCAL_CLUSTER_TOML};

    fn base() -> BrokerConfig {
        let mut c = BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML).unwrap();
        c.domains = vec![DomainConfig::new("bmq.test"), DomainConfig::new("orders")];
        c.auth.tokens = vec![token("app", "app-secret-0123456789", &["bmq.test"])];
        c.validate().unwrap();
        c
    }

    fn token(name: &str, secret: &str, domains: &[&str]) -> TokenConfig {
        TokenConfig {
            name: name.into(),
            secret: secret.into(),
            domains: domains.iter().map(|d| d.to_string()).collect(),
            permissions: vec![Permission::Produce, Permission::Consume],
        }
    }

    /// A stand-in fingerprint that shows which secret it was made from in the test only.
    fn fp(secret: &str) -> String {
        format!("fp({})", &secret[..3])
    }

    #[test]
    fn equal_configurations_differ_in_nothing() {
        // A reload of an unchanged file changes nothing and names nothing.
        let d = diff(&base(), &base(), &fp);
        assert_eq!(d, ConfigDiff::default());
        assert!(!d.has_live_changes());
    }

    #[test]
    fn tokens_added_removed_and_changed_are_named_without_their_secrets() {
        // Each token shows by name and secret fingerprint; which changes end its sessions.
        let running = base();
        let mut file = base();
        file.auth.tokens = vec![token("ops", "ops-secret-0123456789", &["*"])];
        let d = diff(&running, &file, &fp);
        assert_eq!(d.tokens.len(), 2);
        let (app, ops) = (&d.tokens[0], &d.tokens[1]);
        assert_eq!(
            (app.name.as_str(), app.kind),
            ("app", TokenChangeKind::Removed)
        );
        assert_eq!(app.revokes.as_deref(), Some("it was removed"));
        assert_eq!(
            app.before.as_deref(),
            Some("secret fp(app), permissions [produce, consume], domains [bmq.test]")
        );
        assert_eq!(
            (ops.name.as_str(), ops.kind),
            ("ops", TokenChangeKind::Added)
        );
        assert_eq!(ops.revokes, None);
        let shown = format!("{d:?}");
        assert!(!shown.contains("secret-0123456789"), "{shown}");
        assert!(d.needs_restart.is_empty(), "{:?}", d.needs_restart);
        assert!(d.has_live_changes());
    }

    #[test]
    fn a_token_that_loses_a_permission_domain_or_secret_revokes_its_sessions() {
        // Gains go on; losses (or a new secret) end the sessions of the old token.
        let running = base();
        let changed = |edit: &dyn Fn(&mut TokenConfig)| {
            let mut file = base();
            edit(&mut file.auth.tokens[0]);
            diff(&running, &file, &fp).tokens[0].revokes.clone()
        };
        assert_eq!(changed(&|t| t.domains.push("orders".into())), None);
        assert_eq!(changed(&|t| t.domains = vec!["*".into()]), None);
        assert_eq!(changed(&|t| t.permissions.push(Permission::Admin)), None);
        assert_eq!(
            changed(&|t| t.domains = vec!["orders".into()]).as_deref(),
            Some("it lost the domain bmq.test")
        );
        assert_eq!(
            changed(&|t| t.permissions = vec![Permission::Produce]).as_deref(),
            Some("it lost the consume permission")
        );
        assert_eq!(
            changed(&|t| t.secret = "new-secret-0123456789".into()).as_deref(),
            Some("its secret changed")
        );
        // From a wildcard to one domain is a loss.
        let mut wide = base();
        wide.auth.tokens[0].domains = vec!["*".into()];
        let d = diff(&wide, &base(), &fp);
        assert_eq!(d.tokens[0].revokes.as_deref(), Some("it lost the domain *"));
    }

    #[test]
    fn turning_authentication_on_is_noticed() {
        // Sessions let in without a token must end once tokens exist.
        let mut open = base();
        open.auth = AuthSettings::default();
        assert!(diff(&open, &base(), &fp).auth_turned_on);
        assert!(!diff(&base(), &open, &fp).auth_turned_on);
    }

    #[test]
    fn live_settings_are_described_and_the_rest_needs_a_restart() {
        // log.level, the admin token and the TLS paths are live; everything else is named.
        let mut running = base();
        running.tls = Some(crate::TlsSettings {
            ca_file: "/etc/bmq/ca.pem".into(),
            cert_file: "/etc/bmq/node-1.pem".into(),
            key_file: "/etc/bmq/node-1-key.pem".into(),
            client_listener: true,
        });
        let mut file = running.clone();
        file.log.level = "debug".into();
        file.admin.token = Some("admin-secret-0123456789".into());
        file.tls.as_mut().unwrap().cert_file = "/etc/bmq/node-1-new.pem".into();
        file.partition_count = 8;
        file.elector.heartbeat_period_ms = 200;
        file.members[2].admin_port += 1;
        file.tls.as_mut().unwrap().client_listener = false;
        file.storage.cache_mb = 16;
        file.domains.push(DomainConfig::new("payments"));
        let d = diff(&running, &file, &fp);
        assert_eq!(d.log_level, Some(("info".into(), "debug".into())));
        assert_eq!(d.admin_token, Some(("none".into(), "fp(adm)".into())));
        assert_eq!(
            d.tls_paths,
            vec![(
                "tls.cert_file".to_string(),
                "/etc/bmq/node-1.pem".to_string(),
                "/etc/bmq/node-1-new.pem".to_string()
            )]
        );
        let mut restart = d.needs_restart.clone();
        restart.sort();
        assert_eq!(
            restart,
            [
                "elector.heartbeat_period_ms",
                "partition_count",
                "storage.cache_mb",
                "tls.client_listener"
            ]
        );
        // Cluster state: the file seeds it at the first start only, a restart applies
        // nothing either.
        assert_eq!(d.seed_only, ["domains", "members"]);
        // Applying keeps the restart settings as they run.
        let next = apply_live(&running, &file);
        assert_eq!(next.log.level, "debug");
        assert_eq!(next.partition_count, running.partition_count);
        assert_eq!(
            next.tls.as_ref().unwrap().cert_file,
            file.tls.as_ref().unwrap().cert_file
        );
        assert!(next.tls.as_ref().unwrap().client_listener);
        assert_eq!(diff(&next, &file, &fp).needs_restart, d.needs_restart);
        assert!(!diff(&next, &file, &fp).has_live_changes());
    }

    #[test]
    fn adding_or_removing_tls_needs_a_restart() {
        // The listeners are plain or TLS from the start: [tls] itself is not live.
        let running = base();
        let mut file = base();
        file.tls = Some(crate::TlsSettings {
            ca_file: "ca.pem".into(),
            cert_file: "c.pem".into(),
            key_file: "k.pem".into(),
            client_listener: true,
        });
        let d = diff(&running, &file, &fp);
        assert_eq!(d.needs_restart, ["tls"]);
        assert!(d.tls_paths.is_empty());
        assert_eq!(diff(&file, &running, &fp).needs_restart, ["tls"]);
    }
}
