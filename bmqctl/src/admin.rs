//! `bmqctl admin`: operator actions on one node through its admin HTTP endpoint.
//!
//! - `bmqctl admin stop --admin HOST:PORT`: graceful stop (`POST /admin/stop`): the node cedes
//!   leadership and its primaries, then exits within its `limits.graceful_stop_timeout_ms`.
//! - `bmqctl admin cede-leadership --admin HOST:PORT`: the node gives up leadership if it holds
//!   it (`POST /admin/cede-leadership`).
//! - `bmqctl admin purge --queue URI --admin HOST:PORT`: removes every outstanding message of
//!   the queue (`POST /admin/purge?queue=URI`, BlazingMQ's PURGE); any node takes it and
//!   redirects to the queue's primary. Each message removed is logged and counted
//!   (`bmq_queue_removed_total{reason="purged"}`) and journaled.
//!
//! - `bmqctl admin add-member --id N --host H --client-port P --peer-port P --admin-port P
//!   [--bmqp-port P] --admin HOST:PORT`: adds node N as a learner (`POST /admin/members`) and
//!   waits until the leader promoted it to voter; the node must be running (started with its
//!   own id and the members' addresses). Any node takes it and redirects to the leader.
//! - `bmqctl admin remove-member --id N --admin HOST:PORT`: removes node N
//!   (`DELETE /admin/members/N`): a voter leaves first (its primaries move), then is removed;
//!   the removed node exits.
//! - `bmqctl admin reload --admin HOST:PORT [--json]`: the node reads its configuration file
//!   again (`POST /admin/reload`, [`crate::reload`]).
//!
//! When the node has an admin token configured, pass it with `--token` or the
//! `BMQ_ADMIN_TOKEN` environment variable; without either, the local cluster's
//! `CLUSTER_DIR/security/admin.token` is used when it exists ([`crate::credentials`]).
//! It is sent as `Authorization: Bearer <token>`.

use std::time::Duration;

use anyhow::anyhow;
use clap::{Args, Subcommand};

/// The admin actions.
#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Stop a node gracefully: cede leadership and primaries, drain, exit.
    Stop(AdminTarget),
    /// Make a node give up leadership (if it leads).
    CedeLeadership(AdminTarget),
    /// Remove every outstanding message of a queue (all its app ids), logged and counted.
    Purge(PurgeArgs),
    /// Add a running node to the cluster: a learner, promoted to voter once caught up.
    AddMember(AddMemberArgs),
    /// Remove a member: it leaves (its primaries move), then is removed and exits.
    RemoveMember(RemoveMemberArgs),
    /// Make a node read its configuration file again: tokens, TLS files and log level apply
    /// at once; what needs a restart is named ([`crate::reload`]).
    Reload(crate::reload::ReloadArgs),
}

/// `bmqctl admin add-member`.
#[derive(Debug, Args)]
pub struct AddMemberArgs {
    /// The new node's id (unused so far: a removed id never returns).
    #[arg(long)]
    pub id: u32,
    /// Host name or address the members reach it at.
    #[arg(long)]
    pub host: String,
    /// Its client port.
    #[arg(long)]
    pub client_port: u16,
    /// Its peer port.
    #[arg(long)]
    pub peer_port: u16,
    /// Its admin HTTP port.
    #[arg(long)]
    pub admin_port: u16,
    /// Its BlazingMQ (bmqp) port, if it serves one.
    #[arg(long)]
    pub bmqp_port: Option<u16>,
    /// Answer once it is a learner instead of waiting for its promotion.
    #[arg(long)]
    pub learner_only: bool,
    /// Any current member; it redirects to the leader.
    #[command(flatten)]
    pub target: AdminTarget,
}

/// `bmqctl admin remove-member`.
#[derive(Debug, Args)]
pub struct RemoveMemberArgs {
    /// The member's id.
    #[arg(long)]
    pub id: u32,
    /// Any current member; it redirects to the leader.
    #[command(flatten)]
    pub target: AdminTarget,
}

/// `bmqctl admin purge`.
#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// The queue, `bmq://domain/name`.
    #[arg(long, value_name = "URI")]
    pub queue: String,
    /// Any node; it redirects to the queue's primary.
    #[command(flatten)]
    pub target: AdminTarget,
}

/// Which node to act on.
#[derive(Debug, Args)]
pub struct AdminTarget {
    /// Admin HTTP address of the node, host:port.
    #[arg(long = "admin", value_name = "HOST:PORT")]
    pub admin: String,
    /// Timeout of the request, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub timeout_ms: u64,
    /// Admin token of the node (`admin.token`), sent as a bearer token; without it (and
    /// without $BMQ_ADMIN_TOKEN), CLUSTER_DIR/security/admin.token if it exists (CLUSTER_DIR is
    /// $BMQ_CLUSTER_DIR, else .cluster).
    #[arg(
        long,
        env = "BMQ_ADMIN_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
}

/// Runs an admin action and prints the node's answer.
pub async fn run(command: AdminCommand) -> anyhow::Result<()> {
    let (target, method, path) = match &command {
        AdminCommand::Stop(t) => (t, "POST", "/admin/stop".to_string()),
        AdminCommand::CedeLeadership(t) => (t, "POST", "/admin/cede-leadership".to_string()),
        AdminCommand::Purge(p) => (
            &p.target,
            "POST",
            format!("/admin/purge?queue={}", percent_encode(&p.queue)),
        ),
        AdminCommand::AddMember(a) => (&a.target, "POST", add_member_path(a)),
        AdminCommand::Reload(r) => return crate::reload::run(r).await,
        AdminCommand::RemoveMember(r) => (
            &r.target,
            "DELETE",
            format!(
                "/admin/members/{}?timeout_ms={}",
                r.id,
                r.target.timeout_ms.saturating_sub(500)
            ),
        ),
    };
    let timeout = Duration::from_millis(target.timeout_ms);
    let token = admin_token(target);
    let body = tokio::time::timeout(
        timeout,
        crate::http::request(&target.admin, method, &path, token.as_deref()),
    )
    .await
    .map_err(|_| {
        anyhow!(
            "no answer from {} within {} ms",
            target.admin,
            timeout.as_millis()
        )
    })??;
    out!("{body}");
    Ok(())
}

/// The admin token to send: `--token` / `$BMQ_ADMIN_TOKEN`, else the local cluster's
/// `CLUSTER_DIR/security/admin.token` when it exists, else none.
pub fn admin_token(target: &AdminTarget) -> Option<String> {
    given_or_cluster_token(target.token.as_deref())
}

/// `given`, else the local cluster's `CLUSTER_DIR/security/admin.token` when it exists and
/// is not empty, else none (what every admin-token option of bmqctl falls back to).
pub fn given_or_cluster_token(given: Option<&str>) -> Option<String> {
    match given {
        Some(t) => Some(t.to_string()),
        None => {
            let file = crate::credentials::cluster_dir()
                .join(crate::credentials::SECURITY_DIR)
                .join(crate::credentials::ADMIN_TOKEN_FILE);
            std::fs::read_to_string(&file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        }
    }
}

/// The request of `bmqctl admin add-member`: the node's addresses as query parameters, and
/// the server-side wait a little shorter than ours, so its answer arrives.
fn add_member_path(a: &AddMemberArgs) -> String {
    let mut path = format!(
        "/admin/members?id={}&host={}&client_port={}&peer_port={}&admin_port={}&timeout_ms={}",
        a.id,
        percent_encode(&a.host),
        a.client_port,
        a.peer_port,
        a.admin_port,
        a.target.timeout_ms.saturating_sub(500)
    );
    if let Some(p) = a.bmqp_port {
        path.push_str(&format!("&bmqp_port={p}"));
    }
    if a.learner_only {
        path.push_str("&wait=learner");
    }
    path
}

/// `s` with every byte outside RFC 3986's unreserved set percent-encoded (for a query value).
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn queue_uris_are_percent_encoded() {
        assert_eq!(
            super::percent_encode("bmq://d.x/q-1"),
            "bmq%3A%2F%2Fd.x%2Fq-1"
        );
    }
}
