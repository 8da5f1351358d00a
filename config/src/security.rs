//! The security sections: `[admin]` (bind host, admin token), `[tls]` (CA, node certificate
//! and key) and `[[auth.tokens]]` (client tokens with per-domain permissions), with their
//! validation and the constant-time token lookup. The behaviour — TLS handshakes, Hello
//! authentication, OpenQueue authorisation — lives in the broker (`auth.rs`, `net/tls.rs`) and
//! in the client library; this module is only the data they are built from.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::domains::DomainConfig;
use crate::error::ConfigError;
use crate::sections::is_valid_host;
/// Shortest accepted secret (admin or client token), bytes: a shorter one is guessable.
pub const TOKEN_LEN_MIN: usize = 16;
/// Longest accepted secret, bytes (a Hello carrying more is refused before any comparison).
pub const TOKEN_LEN_MAX: usize = 1024;
/// Most client tokens in `[[auth.tokens]]`.
pub const TOKENS_MAX: usize = 1024;

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::invalid(field, message)
}

/// `[admin]`: where the admin HTTP server binds and the token its actions require.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminSettings {
    /// Host the admin HTTP server binds to (with this node's `admin_port`). When absent: this
    /// node's `members[].host` if that is a loopback address (`127.0.0.0/8`, `::1`,
    /// `localhost`), else `127.0.0.1`, so that the admin port is never exposed by default. Set
    /// it (e.g. `0.0.0.0`) for a Prometheus on another host, and then also set `token`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen_host: Option<String>,
    /// Bearer token the state-changing admin actions require (at least
    /// [`TOKEN_LEN_MIN`] bytes). Absent: those actions are open to whoever reaches the port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

impl AdminSettings {
    /// Whether every field has its default (then the section is not written out).
    pub fn is_default(&self) -> bool {
        self == &AdminSettings::default()
    }

    /// Checks the bind host and the token's length.
    ///
    /// Errors: [`ConfigError::Invalid`] on `admin.listen_host` or `admin.token`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(host) = &self.listen_host {
            if !is_valid_host(host) {
                return Err(invalid(
                    "admin.listen_host",
                    format!("{host:?} is not a valid host"),
                ));
            }
        }
        if let Some(token) = &self.token {
            check_secret("admin.token", token)?;
        }
        Ok(())
    }

    /// The host the admin server binds, given this node's member host (see `listen_host`).
    pub fn bind_host(&self, member_host: &str) -> String {
        match &self.listen_host {
            Some(h) => h.clone(),
            None if is_loopback_host(member_host) => member_host.to_string(),
            None => "127.0.0.1".to_string(),
        }
    }
}

/// Whether `host` names this machine's loopback interface: `localhost`, `127.0.0.0/8`, `::1`
/// (bracketed or not).
pub fn is_loopback_host(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost")
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn check_secret(field: &str, secret: &str) -> Result<(), ConfigError> {
    if secret.len() < TOKEN_LEN_MIN || secret.len() > TOKEN_LEN_MAX {
        return Err(invalid(
            field,
            format!(
                "a token has {TOKEN_LEN_MIN} to {TOKEN_LEN_MAX} bytes, this one {}",
                secret.len()
            ),
        ));
    }
    if secret.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid(
            field,
            "a token has no whitespace or control characters",
        ));
    }
    Ok(())
}

/// What a client token allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Permission {
    /// Open queues of the token's domains for writing (PUT).
    Produce,
    /// Open queues of the token's domains for reading (PUSH, CONFIRM).
    Consume,
    /// The state-changing admin HTTP actions (cluster-wide; the token's domains do not apply).
    Admin,
}

impl Permission {
    /// `produce`, `consume` or `admin`.
    pub fn as_str(self) -> &'static str {
        match self {
            Permission::Produce => "produce",
            Permission::Consume => "consume",
            Permission::Admin => "admin",
        }
    }
}

/// One `[[auth.tokens]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// Who holds the token (shows in the broker's logs, never the secret): 1 to 64 of
    /// `A-Z a-z 0-9 . _ -`, unique.
    pub name: String,
    /// The secret the client sends in `Hello.token`, [`TOKEN_LEN_MIN`] to [`TOKEN_LEN_MAX`]
    /// bytes without whitespace.
    pub secret: String,
    /// Domains the `produce` and `consume` permissions apply to; `"*"` = every domain.
    #[serde(default)]
    pub domains: Vec<String>,
    /// What the token allows.
    #[serde(default)]
    pub permissions: Vec<Permission>,
}

impl TokenConfig {
    /// Whether this token grants `permission` on `domain` (for `Admin`, `domain` is ignored).
    pub fn allows(&self, permission: Permission, domain: &str) -> bool {
        self.permissions.contains(&permission)
            && (permission == Permission::Admin
                || self.domains.iter().any(|d| d == "*" || d == domain))
    }
}

/// `[auth]`: the client tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthSettings {
    /// The tokens; empty = client authentication off.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<TokenConfig>,
    /// The name of one of `tokens` whose permissions the clients of the bmqp listener get
    /// (applications on BlazingMQ's SDKs, whose protocol carries no token). Unset: they are
    /// anonymous, and with tokens configured they can open no queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bmqp_identity: Option<String>,
}

impl AuthSettings {
    /// Whether no token is configured (client authentication off).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Checks names, secrets (length, uniqueness) and that each domain named exists.
    ///
    /// Errors: [`ConfigError::Invalid`] on `auth.tokens[i].<field>`.
    pub fn validate(&self, domains: &[DomainConfig]) -> Result<(), ConfigError> {
        if self.tokens.len() > TOKENS_MAX {
            return Err(invalid(
                "auth.tokens",
                format!("{} tokens; at most {TOKENS_MAX}", self.tokens.len()),
            ));
        }
        let mut names = std::collections::HashSet::new();
        let mut secrets = std::collections::HashSet::new();
        for (i, t) in self.tokens.iter().enumerate() {
            if t.name.is_empty()
                || t.name.len() > 64
                || !t
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            {
                return Err(invalid(
                    format!("auth.tokens[{i}].name"),
                    format!("{:?}: use 1 to 64 of A-Z a-z 0-9 . _ -", t.name),
                ));
            }
            if !names.insert(t.name.as_str()) {
                return Err(invalid(
                    format!("auth.tokens[{i}].name"),
                    format!("duplicate name {:?}", t.name),
                ));
            }
            check_secret(&format!("auth.tokens[{i}].secret"), &t.secret)?;
            if !secrets.insert(t.secret.as_str()) {
                return Err(invalid(
                    format!("auth.tokens[{i}].secret"),
                    "the same secret as an earlier token",
                ));
            }
            for (j, d) in t.domains.iter().enumerate() {
                if d != "*" && !domains.iter().any(|c| &c.name == d) {
                    return Err(invalid(
                        format!("auth.tokens[{i}].domains[{j}]"),
                        format!("unknown domain {d:?}"),
                    ));
                }
            }
        }
        if let Some(name) = &self.bmqp_identity {
            if self.named(name).is_none() {
                return Err(invalid(
                    "auth.bmqp_identity",
                    format!("{name:?} is not the name of a token of [[auth.tokens]]"),
                ));
            }
        }
        Ok(())
    }

    /// The token named `name`.
    pub fn named(&self, name: &str) -> Option<&TokenConfig> {
        self.tokens.iter().find(|t| t.name == name)
    }

    /// The token whose secret is `secret`, compared in constant time against every token.
    pub fn find(&self, secret: &str) -> Option<&TokenConfig> {
        let mut found = None;
        for t in &self.tokens {
            // No early exit: the time taken does not tell which token matched.
            if constant_time_eq(t.secret.as_bytes(), secret.as_bytes()) {
                found = Some(t);
            }
        }
        found
    }
}

/// Byte-string equality whose time depends only on the lengths, not on where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `[tls]`: the cluster CA and this node's certificate and key (PEM files).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM file with the cluster CA certificate(s) every peer certificate must chain to.
    pub ca_file: PathBuf,
    /// PEM file with this node's certificate (then any intermediates); it names `node-<id>`.
    pub cert_file: PathBuf,
    /// PEM file with this node's private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// Whether the client listener speaks TLS too (with the same certificate). Default true.
    #[serde(default = "default_true")]
    pub client_listener: bool,
}

fn default_true() -> bool {
    true
}

impl TlsSettings {
    /// Checks that no path is empty (the node reads the files at start).
    ///
    /// Errors: [`ConfigError::Invalid`] on `tls.<field>`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, p) in [
            ("ca_file", &self.ca_file),
            ("cert_file", &self.cert_file),
            ("key_file", &self.key_file),
        ] {
            if p.as_os_str().is_empty() {
                return Err(invalid(format!("tls.{name}"), "must not be empty"));
            }
        }
        Ok(())
    }
}
