//! `bmqctl admin`: operator actions on one node through its admin HTTP endpoint.
//!
//! - `bmqctl admin stop --admin HOST:PORT`: graceful stop (`POST /admin/stop`): the node cedes
//!   leadership and its primaries, then exits within its `limits.graceful_stop_timeout_ms`.
//! - `bmqctl admin cede-leadership --admin HOST:PORT`: the node gives up leadership if it holds
//!   it (`POST /admin/cede-leadership`).
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
    let (target, path) = match &command {
        AdminCommand::Stop(t) => (t, "/admin/stop"),
        AdminCommand::CedeLeadership(t) => (t, "/admin/cede-leadership"),
    };
    let timeout = Duration::from_millis(target.timeout_ms);
    let token = match &target.token {
        Some(t) => Some(t.clone()),
        None => {
            let file = crate::credentials::cluster_dir()
                .join(crate::credentials::SECURITY_DIR)
                .join(crate::credentials::ADMIN_TOKEN_FILE);
            std::fs::read_to_string(&file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        }
    };
    let body = tokio::time::timeout(
        timeout,
        crate::http::post(&target.admin, path, token.as_deref()),
    )
    .await
    .map_err(|_| {
        anyhow!(
            "no answer from {} within {} ms",
            target.admin,
            timeout.as_millis()
        )
    })??;
    print!("{body}");
    Ok(())
}
