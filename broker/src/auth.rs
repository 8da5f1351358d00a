//! Authentication and authorisation of clients, built from the `[[auth.tokens]]`
//! section of the configuration ([`bmq_config::AuthSettings`]).
//!
//! When at least one token is configured, a client's `Hello.token` must match one of them (else
//! the Hello is refused with `NOT_AUTHORIZED`) and each OpenQueue is checked: `write` needs
//! `produce`, `read` needs `consume` on the queue's domain. A client with no token is anonymous
//! and may open nothing. With no token configured, every client may do everything.
//!
//! Secrets are compared in constant time ([`bmq_config::constant_time_eq`]). The admin HTTP
//! token is checked in `admin.rs`.
//!
//! The tokens in force are a [`LiveAuth`]: read at every Hello and admin request, replaced by a
//! reload (`crate::reload`), which also ends the sessions of tokens it removes or narrows.

use std::sync::{Arc, RwLock};

use bmq_config::{AuthSettings, BrokerConfig, Permission, TokenConfig, TOKEN_LEN_MAX};

/// The client tokens and the admin token in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthInForce {
    /// `[auth]`: the client tokens.
    pub client: AuthSettings,
    /// `[admin] token`.
    pub admin_token: Option<String>,
}

/// The tokens in force on this node, shared by the listeners, the sessions' handshakes and the
/// admin server; replaced whole by a reload.
#[derive(Debug)]
pub struct LiveAuth {
    current: RwLock<Arc<AuthInForce>>,
}

impl LiveAuth {
    /// The tokens of `config`.
    pub fn from_config(config: &BrokerConfig) -> LiveAuth {
        LiveAuth {
            current: RwLock::new(Arc::new(AuthInForce {
                client: config.auth.clone(),
                admin_token: config.admin.token.clone(),
            })),
        }
    }

    /// The tokens in force now.
    pub fn current(&self) -> Arc<AuthInForce> {
        // A poisoned lock still holds a whole `Arc` (it is only ever replaced whole).
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Puts `next` in force for every Hello and admin request from now on.
    pub fn replace(&self, next: AuthInForce) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(next);
    }
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

/// Decides a session's identity from `Hello.token` (empty = none presented), against the
/// configured tokens.
///
/// Errors: [`AuthError::UnknownToken`] when authentication is on and a non-empty token
/// matches none.
pub fn authenticate(settings: &AuthSettings, token: &str) -> Result<ClientIdentity, AuthError> {
    if settings.is_empty() {
        return Ok(ClientIdentity::Unrestricted);
    }
    if token.is_empty() {
        return Ok(ClientIdentity::Anonymous);
    }
    if token.len() > TOKEN_LEN_MAX {
        return Err(AuthError::UnknownToken);
    }
    settings
        .find(token)
        .cloned()
        .map(ClientIdentity::Token)
        .ok_or(AuthError::UnknownToken)
}

/// The identity of a client of the bmqp listener (BlazingMQ's SDKs present no token): the
/// token named by `[auth] bmqp_identity`, else anonymous; unrestricted without tokens.
pub fn bmqp_identity(settings: &AuthSettings) -> ClientIdentity {
    if settings.is_empty() {
        return ClientIdentity::Unrestricted;
    }
    settings
        .bmqp_identity
        .as_deref()
        .and_then(|name| settings.named(name))
        .cloned()
        .map_or(ClientIdentity::Anonymous, ClientIdentity::Token)
}

/// The identity of a bmqp client that authenticated with BlazingMQ's AUTHENTICATION event:
/// mechanism `BASIC` with `data` = `name:secret` of a configured token (the name must be that
/// token's), or `ANONYMOUS` (the identity [`bmqp_identity`] gives). Without tokens configured
/// every client is unrestricted.
///
/// Errors: the reason, for the client and the log: an unknown mechanism, malformed data, or
/// credentials that match no token.
pub fn bmqp_authenticate(
    settings: &AuthSettings,
    mechanism: &str,
    data: &[u8],
) -> Result<ClientIdentity, String> {
    if settings.is_empty() {
        return Ok(ClientIdentity::Unrestricted);
    }
    match mechanism.to_ascii_uppercase().as_str() {
        "ANONYMOUS" => Ok(bmqp_identity(settings)),
        "BASIC" => {
            let text = std::str::from_utf8(data).map_err(|_| "BASIC data is not UTF-8")?;
            let (name, secret) = text
                .split_once(':')
                .ok_or("BASIC data must be 'name:secret' (a token's name and secret)")?;
            match authenticate(settings, secret) {
                Ok(ClientIdentity::Token(t)) if t.name == name => Ok(ClientIdentity::Token(t)),
                _ => Err(format!("invalid name or secret for token {name:?}")),
            }
        }
        other => Err(format!(
            "authentication mechanism {other:?} is not supported (BASIC, ANONYMOUS)"
        )),
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

    /// Why a session of this identity may not go on under the tokens `now` in force (after a
    /// reload), if it may not: its token was removed, or lost its secret, a permission or a
    /// domain ([`bmq_config::diff::token_revocation`]); or it was let in without a token and
    /// tokens are now required. `None`: it goes on (a token that gained permissions keeps
    /// those it had at Hello until the client reconnects).
    pub fn revoked_by(&self, now: &AuthSettings) -> Option<String> {
        match self {
            ClientIdentity::Token(t) => match now.named(&t.name) {
                None => Some(format!("token {:?} was removed", t.name)),
                Some(n) => bmq_config::diff::token_revocation(t, n)
                    .map(|why| format!("token {:?}: {why}", t.name)),
            },
            ClientIdentity::Unrestricted if !now.is_empty() => {
                Some("this node now requires a client token".to_string())
            }
            _ => None,
        }
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
            bmqp_identity: None,
        }
    }

    #[test]
    fn bmqp_clients_get_the_named_token_or_nothing() {
        // SDK clients present no token: the configured name decides their permissions.
        let mut s = settings();
        assert!(bmqp_identity(&s)
            .authorize_open("bmq.test", false, true)
            .is_err());
        s.bmqp_identity = Some("writer".into());
        let sdk = bmqp_identity(&s);
        assert_eq!(sdk.name(), "writer");
        assert!(sdk.authorize_open("bmq.test", false, true).is_ok());
        assert!(sdk.authorize_open("bmq.test", true, false).is_err());
        assert!(bmqp_identity(&AuthSettings::default())
            .authorize_open("any", true, true)
            .is_ok());
    }

    #[test]
    fn bmqp_authentication_maps_basic_credentials_onto_tokens() {
        // BlazingMQ's AUTHENTICATION: BASIC name:secret of a token, ANONYMOUS, nothing else.
        let mut s = settings();
        s.bmqp_identity = Some("ops".into());
        let who = bmqp_authenticate(&s, "BASIC", b"writer:writer-secret-0123456789").unwrap();
        assert_eq!(who.name(), "writer");
        assert!(bmqp_authenticate(&s, "BASIC", b"ops:writer-secret-0123456789").is_err());
        assert!(bmqp_authenticate(&s, "BASIC", b"writer:wrong").is_err());
        assert!(bmqp_authenticate(&s, "BASIC", b"no-colon").is_err());
        assert_eq!(
            bmqp_authenticate(&s, "ANONYMOUS", b"").unwrap().name(),
            "ops"
        );
        let err = bmqp_authenticate(&s, "KERBEROS", b"").unwrap_err();
        assert!(err.contains("not supported"), "{err}");
        assert_eq!(
            bmqp_authenticate(&AuthSettings::default(), "BASIC", b"x:y").unwrap(),
            ClientIdentity::Unrestricted
        );
    }

    #[test]
    fn tokens_grant_only_their_permissions_on_their_domains() {
        // A producer token writes its domain only; a wildcard consumer reads any domain.
        let s = settings();
        let writer = authenticate(&s, "writer-secret-0123456789").unwrap();
        assert_eq!(writer.name(), "writer");
        assert!(writer.authorize_open("bmq.test", false, true).is_ok());
        let err = writer.authorize_open("bmq.test", true, false).unwrap_err();
        assert!(err.contains("consume") && err.contains("bmq.test"), "{err}");
        assert!(writer
            .authorize_open("other", false, true)
            .unwrap_err()
            .contains("produce"));
        let ops = authenticate(&s, "ops-secret-0123456789abc").unwrap();
        assert!(ops.authorize_open("anything", true, false).is_ok());
        assert!(ops.authorize_open("anything", true, true).is_err());
    }

    #[test]
    fn sessions_end_when_their_token_goes_or_narrows() {
        // Removal, a new secret, a lost permission, and tokens turned on end a session.
        let s = settings();
        let writer = authenticate(&s, "writer-secret-0123456789").unwrap();
        assert_eq!(writer.revoked_by(&s), None);
        let mut gained = s.clone();
        gained.tokens[0].permissions.push(Permission::Consume);
        assert_eq!(writer.revoked_by(&gained), None);
        let mut removed = s.clone();
        removed.tokens.remove(0);
        assert_eq!(
            writer.revoked_by(&removed).as_deref(),
            Some("token \"writer\" was removed")
        );
        let mut narrowed = s.clone();
        narrowed.tokens[0].permissions.clear();
        assert!(writer
            .revoked_by(&narrowed)
            .is_some_and(|why| why.contains("lost the produce permission")));
        let open = authenticate(&AuthSettings::default(), "").unwrap();
        assert_eq!(open.revoked_by(&AuthSettings::default()), None);
        assert!(open.revoked_by(&s).is_some());
        let anonymous = authenticate(&s, "").unwrap();
        assert_eq!(anonymous.revoked_by(&s), None);
    }

    #[test]
    fn unknown_missing_and_disabled_tokens() {
        // A wrong token is refused, a missing one is anonymous, and no config means no checks.
        let s = settings();
        assert_eq!(
            authenticate(&s, "writer-secret-012345678X"),
            Err(AuthError::UnknownToken)
        );
        assert_eq!(
            authenticate(&s, &"x".repeat(TOKEN_LEN_MAX + 1)),
            Err(AuthError::UnknownToken)
        );
        let anon = authenticate(&s, "").unwrap();
        assert!(anon
            .authorize_open("bmq.test", true, false)
            .unwrap_err()
            .contains("requires a token"));
        let open = authenticate(&AuthSettings::default(), "whatever").unwrap();
        assert!(open.authorize_open("bmq.test", true, true).is_ok());
    }
}
