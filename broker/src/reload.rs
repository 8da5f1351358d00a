//! Live reload of the node's own configuration file: `POST /admin/reload` (`bmqctl admin
//! reload`, [`crate::admin_reload`]) and SIGHUP ([`serve_sighup`]) both call
//! [`Reloader::reload`].
//!
//! A reload reads and validates the file as at start ([`BrokerConfig::load`]); a file that
//! cannot be read or does not validate is refused with the loader's error, naming the field,
//! and changes nothing. Otherwise it compares the file with the running configuration
//! ([`bmq_config::diff`]) and applies the live settings, in this order, each only if the ones
//! before succeeded:
//!
//! 1. TLS (`[tls] ca_file`, `cert_file`, `key_file`): the files are read again even when
//!    their paths did not change, so a certificate renewed in place is picked up. New
//!    connections, on the client, bmqp and peer listeners and the peer dialers, use the new
//!    certificate and CA; established ones go on ([`PeerTls::reload`]). Unusable files refuse
//!    the whole reload;
//! 2. `log.level` (checked as a filter before anything is applied; it applies even when
//!    `RUST_LOG` set the level at start: a reload that changes it is an explicit request);
//! 3. the client tokens (`[auth]`) and `[admin] token`: new Hellos and admin requests see the
//!    new tokens; every open session whose token was removed, or lost its secret, a
//!    permission or a domain, is told `NOT_AUTHORIZED` with the reason and closed
//!    ([`crate::router::Router::revoke_sessions`]), counted in
//!    `bmq_client_sessions_revoked_total`.
//!
//! Settings that cannot change live are named in the answer ([`ReloadDoc::needs_restart`])
//! and stay as they run; they are named again at every reload until the node restarts.
//!
//! Audit: every reload is logged at `info` (`warn` when refused) with who asked and each
//! change before and after — tokens by name and secret fingerprint (the first 12 hex digits
//! of its SHA-256), certificates by fingerprint, never a secret — and counted in
//! `bmq_config_changes_total{kind="reload"}` (accepted, whether or not it changed anything) or
//! `{kind="reload_refused"}`. `/status` shows the last reload (`config_reload`).
//!
//! One reload runs at a time (a lock around the whole of it).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bmq_client::tls::TlsError;
use bmq_config::diff::{apply_live, diff, ConfigDiff};
use bmq_config::BrokerConfig;
use bmq_proto::admin_doc::{ConfigReloadStatusDoc, ReloadDoc, SettingChangeDoc};
use tracing::{info, warn};

use crate::auth::{AuthInForce, LiveAuth};
use crate::net::tls::{sha256_hex, PeerTls, TlsFingerprints};
use crate::router::Router;

/// Hex digits of a secret's SHA-256 shown in logs and answers: enough to tell two secrets
/// apart, too few to stand for the secret.
const SECRET_FINGERPRINT_DIGITS: usize = 12;

/// Replaces the filter of the process's log subscriber (`log.level`'s syntax); `Err` with
/// the reason. Given by the binary, which owns the subscriber.
pub type LogFilterReload = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// What a [`Reloader`] acts on.
pub struct ReloaderParts {
    /// The node's configuration file; `None` when the node was started from a configuration
    /// in memory (then every reload is refused).
    pub path: Option<PathBuf>,
    /// The configuration as the node read it at start (before a joining node adopted the
    /// members it learned).
    pub running: BrokerConfig,
    /// The tokens in force, shared with the listeners and the admin server.
    pub auth: Arc<LiveAuth>,
    /// The node's TLS, when `[tls]` is set.
    pub tls: Option<PeerTls>,
    /// How to change the log filter; `None`: `log.level` changes are named as not applied.
    pub log_filter: Option<LogFilterReload>,
    /// The sessions to revoke.
    pub router: Arc<Router>,
}

/// The running configuration and what the last reloads did.
struct ReloadState {
    running: BrokerConfig,
    last: Option<ReloadDoc>,
    last_applied_unix_ms: Option<u64>,
}

/// Applies the live settings of the node's configuration file (see the module doc).
pub struct Reloader {
    path: Option<PathBuf>,
    auth: Arc<LiveAuth>,
    tls: Option<PeerTls>,
    log_filter: Option<LogFilterReload>,
    router: Arc<Router>,
    state: Mutex<ReloadState>,
}

/// Why a reload was refused: the message and the field it names.
struct Refusal {
    message: String,
    field: Option<String>,
}

/// The fingerprint of `secret` as logs and answers show it: `sha256:` and the first 12 hex
/// digits of its SHA-256.
pub fn secret_fingerprint(secret: &str) -> String {
    let mut hex = sha256_hex(secret.as_bytes());
    hex.truncate(SECRET_FINGERPRINT_DIGITS);
    format!("sha256:{hex}")
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The setting a TLS loading error is about: the file that could not be read, an unusable CA
/// certificate's `tls.ca_file`, else (a key that does not match its certificate)
/// `tls.key_file`.
fn tls_field(error: &TlsError) -> &'static str {
    match error {
        TlsError::Pem { what, .. } if what.contains("CA") => "tls.ca_file",
        TlsError::Pem { what, .. } if what.contains("key") => "tls.key_file",
        TlsError::Pem { .. } => "tls.cert_file",
        TlsError::Rustls(message) if message.contains("CA certificate") => "tls.ca_file",
        TlsError::Rustls(_) => "tls.key_file",
    }
}

impl Reloader {
    /// A reloader of `parts.path`; registers its counters at zero.
    pub fn new(parts: ReloaderParts) -> Reloader {
        for kind in ["reload", "reload_refused"] {
            metrics::counter!("bmq_config_changes_total", "kind" => kind).increment(0);
        }
        metrics::counter!("bmq_client_sessions_revoked_total").increment(0);
        Reloader {
            path: parts.path,
            auth: parts.auth,
            tls: parts.tls,
            log_filter: parts.log_filter,
            router: parts.router,
            state: Mutex::new(ReloadState {
                running: parts.running,
                last: None,
                last_applied_unix_ms: None,
            }),
        }
    }

    /// `/status`'s account of the reloads (`None` before the first).
    pub fn status(&self) -> Option<ConfigReloadStatusDoc> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.last.clone().map(|last| ConfigReloadStatusDoc {
            last_applied_unix_ms: state.last_applied_unix_ms,
            last,
        })
    }

    /// Reads the file and applies its live settings (see the module doc), for
    /// `requested_by` (an admin token's name, or `SIGHUP`). Blocks on file reads: call it
    /// off the threads that serve connections.
    pub fn reload(&self, requested_by: &str) -> ReloadDoc {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let file = self
            .path
            .as_ref()
            .map_or_else(|| "-".to_string(), |p| p.display().to_string());
        let mut doc = ReloadDoc {
            node_id: state.running.node_id,
            result: "refused".to_string(),
            requested_by: requested_by.to_string(),
            file,
            at_unix_ms: now_unix_ms(),
            changed: Vec::new(),
            needs_restart: Vec::new(),
            seed_only: Vec::new(),
            sessions_closed: 0,
            error: None,
            error_field: None,
        };
        match self.apply(&mut state, &mut doc) {
            Ok(()) => {
                doc.result = if doc.changed.is_empty() {
                    "unchanged"
                } else {
                    "applied"
                }
                .to_string();
                if !doc.changed.is_empty() {
                    state.last_applied_unix_ms = Some(doc.at_unix_ms);
                }
                metrics::counter!("bmq_config_changes_total", "kind" => "reload").increment(1);
                for c in &doc.changed {
                    info!(requested_by, setting = %c.setting, before = c.before.as_deref().unwrap_or("-"), after = c.after.as_deref().unwrap_or("-"), "configuration reload: setting changed");
                }
                info!(
                    requested_by,
                    file = %doc.file,
                    result = %doc.result,
                    changed = doc.changed.len(),
                    needs_restart = %doc.needs_restart.join(", "),
                    sessions_closed = doc.sessions_closed,
                    "configuration reloaded"
                );
            }
            Err(refusal) => {
                metrics::counter!("bmq_config_changes_total", "kind" => "reload_refused")
                    .increment(1);
                warn!(requested_by, file = %doc.file, error = %refusal.message, "configuration reload refused; nothing changed");
                doc.error = Some(refusal.message);
                doc.error_field = refusal.field;
            }
        }
        state.last = Some(doc.clone());
        doc
    }

    /// Reads, compares and applies (see the module doc); fills `doc.changed`,
    /// `doc.needs_restart` and `doc.sessions_closed`. `Err`: nothing was applied.
    fn apply(&self, state: &mut ReloadState, doc: &mut ReloadDoc) -> Result<(), Refusal> {
        let Some(path) = &self.path else {
            return Err(Refusal {
                message: "the node was not started from a configuration file".to_string(),
                field: None,
            });
        };
        let file = BrokerConfig::load(path).map_err(|e| Refusal {
            message: e.to_string(),
            field: e.field().map(str::to_string),
        })?;
        let running = &state.running;
        let changes = diff(running, &file, &secret_fingerprint);
        doc.needs_restart = changes.needs_restart.clone();
        doc.seed_only = changes.seed_only.clone();
        let level = match &changes.log_level {
            Some((_, level)) => Some(
                tracing_subscriber::EnvFilter::try_new(level)
                    .map(|_| level.clone())
                    .map_err(|e| Refusal {
                        message: format!("log.level: {level:?} is not a valid filter: {e}"),
                        field: Some("log.level".to_string()),
                    })?,
            ),
            None => None,
        };

        // 1. TLS, read again whether or not its paths changed (a renewal writes in place).
        if let (Some(tls), Some(settings), Some(_)) = (&self.tls, &file.tls, &running.tls) {
            let (before, after) = tls.reload(settings).map_err(|e| Refusal {
                message: e.to_string(),
                field: Some(tls_field(&e).to_string()),
            })?;
            tls_changes(&changes, &before, &after, &mut doc.changed);
        }
        // 2. The log filter.
        if let (Some((before, _)), Some(level)) = (&changes.log_level, level) {
            match &self.log_filter {
                Some(set) => match set(&level) {
                    Ok(()) => doc.changed.push(SettingChangeDoc {
                        setting: "log.level".to_string(),
                        before: Some(before.clone()),
                        after: Some(level),
                    }),
                    Err(e) => doc.needs_restart.push(format!("log.level ({e})")),
                },
                None => doc
                    .needs_restart
                    .push("log.level (this process cannot change its log filter)".to_string()),
            }
        }
        // 3. The tokens, then the sessions they no longer admit.
        token_changes(&changes, &mut doc.changed);
        let tokens_changed = changes.admin_token.is_some()
            || !changes.tokens.is_empty()
            || changes.bmqp_identity.is_some();
        if tokens_changed {
            self.auth.replace(AuthInForce {
                client: file.auth.clone(),
                admin_token: file.admin.token.clone(),
            });
            let revoked = self
                .router
                .revoke_sessions(|identity| identity.revoked_by(&file.auth));
            for (session, token) in &revoked {
                info!(session, %token, requested_by = %doc.requested_by, "configuration reload: closing the session of a token that no longer admits it");
            }
            doc.sessions_closed = revoked.len() as u64;
            metrics::counter!("bmq_client_sessions_revoked_total").increment(doc.sessions_closed);
        }
        let mut next = apply_live(running, &file);
        if doc.needs_restart.iter().any(|f| f.starts_with("log.level")) {
            // The level did not change: the next reload names it again.
            next.log.level = running.log.level.clone();
        }
        state.running = next;
        Ok(())
    }
}

/// The TLS files' changes: their paths, and their contents by fingerprint.
fn tls_changes(
    changes: &ConfigDiff,
    before: &TlsFingerprints,
    after: &TlsFingerprints,
    out: &mut Vec<SettingChangeDoc>,
) {
    for (setting, from, to) in &changes.tls_paths {
        out.push(SettingChangeDoc {
            setting: format!("{setting} (path)"),
            before: Some(from.clone()),
            after: Some(to.clone()),
        });
    }
    if before.certificate_sha256 != after.certificate_sha256 {
        out.push(SettingChangeDoc {
            setting: "tls.cert_file".to_string(),
            before: Some(format!("sha256:{}", before.certificate_sha256)),
            after: Some(format!("sha256:{}", after.certificate_sha256)),
        });
    }
    if before.ca_sha256 != after.ca_sha256 {
        let show = |f: &[String]| {
            f.iter()
                .map(|h| format!("sha256:{h}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push(SettingChangeDoc {
            setting: "tls.ca_file".to_string(),
            before: Some(show(&before.ca_sha256)),
            after: Some(show(&after.ca_sha256)),
        });
    }
}

/// The token changes as settings (`auth.tokens[<name>]`), without secrets.
fn token_changes(changes: &ConfigDiff, out: &mut Vec<SettingChangeDoc>) {
    for t in &changes.tokens {
        out.push(SettingChangeDoc {
            setting: format!("auth.tokens[{}]", t.name),
            before: t.before.clone(),
            after: t.after.clone(),
        });
    }
    if let Some((before, after)) = &changes.bmqp_identity {
        out.push(SettingChangeDoc {
            setting: "auth.bmqp_identity".to_string(),
            before: before.clone(),
            after: after.clone(),
        });
    }
    if let Some((before, after)) = &changes.admin_token {
        out.push(SettingChangeDoc {
            setting: "admin.token".to_string(),
            before: Some(before.clone()),
            after: Some(after.clone()),
        });
    }
}

/// Reloads on every SIGHUP until the process ends, as `bmqctl admin reload` does (requested
/// by `SIGHUP`). `signal` is installed by the caller as early as it can, since SIGHUP's
/// default action ends the process.
pub async fn serve_sighup(mut signal: tokio::signal::unix::Signal, reloader: Arc<Reloader>) {
    while signal.recv().await.is_some() {
        let reloader = reloader.clone();
        // File reads, off the main thread.
        let done = tokio::task::spawn_blocking(move || reloader.reload("SIGHUP")).await;
        if let Err(e) = done {
            warn!(error = %e, "configuration reload on SIGHUP failed to run");
        }
    }
}
