//! `bmqctl admin`: operator actions on one node through its admin HTTP endpoint.
//!
//! - `bmqctl admin stop --admin HOST:PORT`: graceful stop (`POST /admin/stop`): the node cedes
//!   leadership and its primaries, then exits within its `limits.graceful_stop_timeout_ms`.
//! - `bmqctl admin cede-leadership --admin HOST:PORT`: the node gives up leadership if it holds
//!   it (`POST /admin/cede-leadership`).
//!
//! When the node has an admin token configured, pass it with `--token` or the
//! `BMQ_ADMIN_TOKEN` environment variable; without either, the local cluster's
//! `CLUSTER_DIR/security/admin.token` is used when it exists ([`crate::cli::credentials`]).
//! It is sent as `Authorization: Bearer <token>`.

use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::{Args, Subcommand};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest admin answer read, bytes.
const ADMIN_RESPONSE_MAX_BYTES: u64 = 64 * 1024;

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
            let file = crate::cli::credentials::cluster_dir()
                .join(crate::cli::credentials::SECURITY_DIR)
                .join(crate::cli::credentials::ADMIN_TOKEN_FILE);
            std::fs::read_to_string(&file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        }
    };
    let body = tokio::time::timeout(
        timeout,
        http_post_with_token(&target.admin, path, token.as_deref()),
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

/// One HTTP/1.1 POST without a body; returns the body of a 200 answer.
pub async fn http_post(addr: &str, path: &str) -> anyhow::Result<String> {
    http_post_with_token(addr, path, None).await
}

/// [`http_post`] with `Authorization: Bearer <token>` when `token` is given. Errors: the
/// connection fails, or the answer is not 200 (a 401 names the missing or invalid token).
pub async fn http_post_with_token(
    addr: &str,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<String> {
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let mut stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\n{authorization}\
         User-Agent: bmqctl/{}\r\nConnection: close\r\n\r\n",
        env!("CARGO_PKG_VERSION")
    );
    stream
        .write_all(request.as_bytes())
        .await
        .context("cannot send request")?;
    let mut response = Vec::new();
    (&mut stream)
        .take(ADMIN_RESPONSE_MAX_BYTES)
        .read_to_end(&mut response)
        .await
        .context("cannot read response")?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("malformed HTTP response from {addr}"))?;
    let status = head.lines().next().unwrap_or_default();
    if !status.split(' ').nth(1).is_some_and(|c| c == "200") {
        bail!("{addr}{path} answered {status:?}: {}", body.trim());
    }
    Ok(body.to_string())
}
