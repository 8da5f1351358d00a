//! Authentication and authorisation of clients and admin actions (issue 10).
//!
//! - **Admin HTTP** ([`AdminSettings`]): the listener binds to loopback unless
//!   `admin.listen_host` says otherwise. When `admin.token` is set, the state-changing actions
//!   (`POST /admin/quorum/{n}`, `/admin/cede-leadership`, `/admin/stop`) require
//!   `Authorization: Bearer <token>`; a client token with the `admin` permission is accepted
//!   too. `/metrics`, `/status`, `/healthz` and `/readyz` stay readable.
//! - **Client tokens** ([`AuthSettings`]): each `[[auth.tokens]]` entry names a secret, the
//!   domains it covers (`"*"` = every domain) and its permissions (`produce`, `consume`,
//!   `admin`). When at least one token is configured, a client's `Hello.token` must match one of
//!   them (else the Hello is refused with `NOT_AUTHORIZED`) and each OpenQueue is checked:
//!   `write` needs `produce`, `read` needs `consume` on the queue's domain. A client with no
//!   token is anonymous and may open nothing. With no token configured, every client may do
//!   everything (the behaviour before issue 10).
//!
//! Secrets are compared in constant time ([`constant_time_eq`]). The configuration file holds
//! them: keep it readable by the broker's user only (`bmqctl cluster up` writes it mode 0600).

use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, DomainConfig};

/// Shortest accepted secret (admin or client token), bytes: a shorter one is guessable.
pub const TOKEN_LEN_MIN: usize = 16;
/// Longest accepted secret, bytes (a Hello carrying more is refused before any comparison).
pub const TOKEN_LEN_MAX: usize = 1024;
/// Most client tokens in `[[auth.tokens]]`.
pub const TOKENS_MAX: usize = 1024;

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
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
            if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c == '/') {
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
        Ok(())
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

/// Who a client session is, decided at Hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientIdentity {
    /// Client authentication is off: every action is allowed.
    Unrestricted,
    /// Authentication is on and the client sent no token: nothing is allowed.
    Anonymous,
    /// The client presented this configured token.
    Token(TokenConfig),
}

/// Why a Hello is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The token matches no configured token (or is longer than [`TOKEN_LEN_MAX`]).
    #[error("authentication failed: the token is not valid on this cluster")]
    UnknownToken,
}

impl AuthSettings {
    /// Decides a session's identity from `Hello.token` (empty = none presented).
    ///
    /// Errors: [`AuthError::UnknownToken`] when authentication is on and a non-empty token
    /// matches none.
    pub fn authenticate(&self, token: &str) -> Result<ClientIdentity, AuthError> {
        if self.is_empty() {
            return Ok(ClientIdentity::Unrestricted);
        }
        if token.is_empty() {
            return Ok(ClientIdentity::Anonymous);
        }
        if token.len() > TOKEN_LEN_MAX {
            return Err(AuthError::UnknownToken);
        }
        self.find(token)
            .cloned()
            .map(ClientIdentity::Token)
            .ok_or(AuthError::UnknownToken)
    }
}

impl ClientIdentity {
    /// Checks an OpenQueue of `domain` with `read`/`write`. `Err` carries the message the
    /// client sees with `NOT_AUTHORIZED`, naming the missing permission and the domain.
    pub fn authorize_open(&self, domain: &str, read: bool, write: bool) -> Result<(), String> {
        let token = match self {
            ClientIdentity::Unrestricted => return Ok(()),
            ClientIdentity::Anonymous => {
                return Err(format!(
                    "not authorized: this cluster requires a token (none was presented) to open queues of domain {domain:?}"
                ))
            }
            ClientIdentity::Token(t) => t,
        };
        for (wanted, permission) in [(write, Permission::Produce), (read, Permission::Consume)] {
            if wanted && !token.allows(permission, domain) {
                return Err(format!(
                    "not authorized: token {:?} lacks the {} permission on domain {domain:?}",
                    token.name,
                    permission.as_str()
                ));
            }
        }
        Ok(())
    }

    /// The token's name for logs (`-` when none).
    pub fn name(&self) -> &str {
        match self {
            ClientIdentity::Token(t) => &t.name,
            _ => "-",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> AuthSettings {
        AuthSettings {
            tokens: vec![
                TokenConfig {
                    name: "writer".into(),
                    secret: "writer-secret-0123456789".into(),
                    domains: vec!["bmq.test".into()],
                    permissions: vec![Permission::Produce],
                },
                TokenConfig {
                    name: "ops".into(),
                    secret: "ops-secret-0123456789abc".into(),
                    domains: vec!["*".into()],
                    permissions: vec![Permission::Consume, Permission::Admin],
                },
            ],
        }
    }

    #[test]
    fn tokens_grant_only_their_permissions_on_their_domains() {
        // A producer token writes its domain only; a wildcard consumer reads any domain.
        let s = settings();
        let writer = s.authenticate("writer-secret-0123456789").unwrap();
        assert_eq!(writer.name(), "writer");
        assert!(writer.authorize_open("bmq.test", false, true).is_ok());
        let err = writer.authorize_open("bmq.test", true, false).unwrap_err();
        assert!(err.contains("consume") && err.contains("bmq.test"), "{err}");
        assert!(writer
            .authorize_open("other", false, true)
            .unwrap_err()
            .contains("produce"));
        let ops = s.authenticate("ops-secret-0123456789abc").unwrap();
        assert!(ops.authorize_open("anything", true, false).is_ok());
        assert!(ops.authorize_open("anything", true, true).is_err());
    }

    #[test]
    fn unknown_missing_and_disabled_tokens() {
        // A wrong token is refused, a missing one is anonymous, and no config means no checks.
        let s = settings();
        assert_eq!(
            s.authenticate("writer-secret-012345678X"),
            Err(AuthError::UnknownToken)
        );
        assert_eq!(
            s.authenticate(&"x".repeat(TOKEN_LEN_MAX + 1)),
            Err(AuthError::UnknownToken)
        );
        let anon = s.authenticate("").unwrap();
        assert!(anon
            .authorize_open("bmq.test", true, false)
            .unwrap_err()
            .contains("requires a token"));
        let open = AuthSettings::default().authenticate("whatever").unwrap();
        assert!(open.authorize_open("bmq.test", true, true).is_ok());
    }

    #[test]
    fn validation_names_the_field() {
        // Short secrets, duplicate names and unknown domains are configuration errors.
        let domains = vec![DomainConfig::new("bmq.test")];
        let mut s = settings();
        assert!(s.validate(&domains).is_ok());
        s.tokens[0].secret = "short".into();
        assert_eq!(
            s.validate(&domains).unwrap_err().field(),
            Some("auth.tokens[0].secret")
        );
        let mut s = settings();
        s.tokens[1].name = "writer".into();
        assert_eq!(
            s.validate(&domains).unwrap_err().field(),
            Some("auth.tokens[1].name")
        );
        let mut s = settings();
        s.tokens[0].domains = vec!["nope".into()];
        assert_eq!(
            s.validate(&domains).unwrap_err().field(),
            Some("auth.tokens[0].domains[0]")
        );
        let a = AdminSettings {
            listen_host: None,
            token: Some("tiny".into()),
        };
        assert_eq!(a.validate().unwrap_err().field(), Some("admin.token"));
    }

    #[test]
    fn the_commented_security_example_parses_and_validates() {
        // The [admin], [tls] and [[auth.tokens]] example of local-cluster.toml, uncommented,
        // is a valid configuration.
        let text = crate::config::LOCAL_CLUSTER_TOML;
        let start = text.find("# Security (issue 10").expect("security block");
        let (head, block) = text.split_at(start);
        let mut uncommented = head.to_string();
        for line in block.lines() {
            let l = line.strip_prefix("# ").unwrap_or(line);
            // Only TOML lines: table headers and key = value pairs.
            let is_pair = l.split_once(" = ").is_some_and(|(k, _)| {
                !k.is_empty() && k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
            });
            if l.starts_with("[admin]")
                || l.starts_with("[tls]")
                || l.starts_with("[[auth")
                || is_pair
            {
                uncommented.push_str(l);
                uncommented.push('\n');
            }
        }
        let c = crate::config::BrokerConfig::from_toml_str(&uncommented).unwrap();
        c.validate().unwrap();
        assert_eq!(c.admin.listen_host.as_deref(), Some("0.0.0.0"));
        assert!(c.tls.as_ref().is_some_and(|t| t.client_listener));
        assert_eq!(
            c.auth.tokens[0].permissions,
            vec![Permission::Produce, Permission::Consume]
        );
    }

    #[test]
    fn admin_binds_loopback_unless_told() {
        // A non-loopback member host still gets a loopback admin bind by default.
        let a = AdminSettings::default();
        assert_eq!(a.bind_host("10.1.2.3"), "127.0.0.1");
        assert_eq!(a.bind_host("127.0.0.1"), "127.0.0.1");
        assert_eq!(a.bind_host("::1"), "::1");
        assert_eq!(a.bind_host("localhost"), "localhost");
        let a = AdminSettings {
            listen_host: Some("0.0.0.0".into()),
            token: None,
        };
        assert_eq!(a.bind_host("10.1.2.3"), "0.0.0.0");
    }
}
