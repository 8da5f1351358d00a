//! `bmqctl domain`: the cluster's domains, changed at run time (committed cluster state,
//! DESIGN.md §5a) through any node's admin port, which redirects a change to the leader:
//!
//! - `bmqctl domain create NAME [--mode priority|fanout|broadcast] [--app-ids a,b]
//!   [--consistency strong|eventual] [--max-queue-messages N] [--max-queue-bytes B]
//!   [--message-ttl-ms T] [--max-delivery-attempts K] [--set key=value ...]`
//! - `bmqctl domain update NAME --set key=value ... [--if-version T:S]`
//! - `bmqctl domain delete NAME [--purge] [--if-version T:S]`
//! - `bmqctl domain list [--json]`, `bmqctl domain show NAME`
//!
//! Each prints the node's answer; a refusal (unknown key, invalid value, name in use, a
//! version that moved, queues that forbid the change) is an error naming the reason.

use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::{Args, Subcommand};

use crate::admin::percent_encode;

/// `bmqctl domain ...`.
#[derive(Debug, Subcommand)]
pub enum DomainCommand {
    /// Create a domain (defaults for the settings not given).
    Create(CreateArgs),
    /// Change settings of a domain: limits, TTL and delivery attempts apply to its open
    /// queues at once.
    Update(UpdateArgs),
    /// Delete a domain; refused while it has queues unless --purge.
    Delete(DeleteArgs),
    /// List the domains.
    List(ListArgs),
    /// Show one domain as JSON.
    Show(ShowArgs),
}

/// `bmqctl domain create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// The domain's name (1 to 128 of A-Z a-z 0-9 . _ -).
    pub name: String,
    /// Delivery mode.
    #[arg(long, value_name = "priority|fanout|broadcast")]
    pub mode: Option<String>,
    /// The app ids of a fanout domain, comma-separated.
    #[arg(long, value_name = "A,B")]
    pub app_ids: Option<String>,
    /// When a PUT is acknowledged.
    #[arg(long, value_name = "strong|eventual")]
    pub consistency: Option<String>,
    /// Messages a queue may hold before PUTs are refused.
    #[arg(long, value_name = "N")]
    pub max_queue_messages: Option<u64>,
    /// Payload bytes a queue may hold before PUTs are refused.
    #[arg(long, value_name = "BYTES")]
    pub max_queue_bytes: Option<u64>,
    /// Time to live of a message, milliseconds (0: none).
    #[arg(long, value_name = "MS")]
    pub message_ttl_ms: Option<u64>,
    /// Deliveries of a message before it is dropped (0: unlimited).
    #[arg(long, value_name = "K")]
    pub max_delivery_attempts: Option<u32>,
    /// Any other setting, as the file's [[domains]] names it.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Any node; a change goes to the leader.
    #[command(flatten)]
    pub target: ClusterTarget,
}

/// `bmqctl domain update`.
#[derive(Debug, Args)]
pub struct UpdateArgs {
    /// The domain.
    pub name: String,
    /// A setting to change, as the file's [[domains]] names it (app_ids comma-separated).
    #[arg(long = "set", value_name = "KEY=VALUE", required = true)]
    pub set: Vec<String>,
    /// Apply only if the domain is still at this version (`term:seq`, from `domain show`).
    #[arg(long, value_name = "T:S")]
    pub if_version: Option<String>,
    /// Any node; a change goes to the leader.
    #[command(flatten)]
    pub target: ClusterTarget,
}

/// `bmqctl domain delete`.
#[derive(Debug, Args)]
pub struct DeleteArgs {
    /// The domain.
    pub name: String,
    /// Also unassign its queues and remove their messages (counted as purged).
    #[arg(long)]
    pub purge: bool,
    /// Apply only if the domain is still at this version (`term:seq`).
    #[arg(long, value_name = "T:S")]
    pub if_version: Option<String>,
    /// Any node; a change goes to the leader.
    #[command(flatten)]
    pub target: ClusterTarget,
}

/// `bmqctl domain list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Print the node's JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Any node.
    #[command(flatten)]
    pub target: ClusterTarget,
}

/// `bmqctl domain show`.
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// The domain.
    pub name: String,
    /// Any node.
    #[command(flatten)]
    pub target: ClusterTarget,
}

/// `KEY=VALUE` as a pair; an error naming the argument otherwise.
fn setting(text: &str) -> anyhow::Result<(String, String)> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| anyhow!("--set {text:?}: expected KEY=VALUE"))?;
    if key.trim().is_empty() {
        bail!("--set {text:?}: empty key");
    }
    Ok((key.trim().to_string(), value.to_string()))
}

/// A query string of `pairs`, percent-encoded.
fn query(pairs: &[(String, String)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{}={}", percent_encode(k), percent_encode(v)))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

/// The settings `bmqctl domain create` names, in the file's keys.
pub fn create_settings(a: &CreateArgs) -> anyhow::Result<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    let mut push = |k: &str, v: Option<String>| {
        if let Some(v) = v {
            pairs.push((k.to_string(), v));
        }
    };
    push("mode", a.mode.clone());
    push("app_ids", a.app_ids.clone());
    push("consistency", a.consistency.clone());
    push(
        "max_queue_messages",
        a.max_queue_messages.map(|v| v.to_string()),
    );
    push("max_queue_bytes", a.max_queue_bytes.map(|v| v.to_string()));
    push("message_ttl_ms", a.message_ttl_ms.map(|v| v.to_string()));
    push(
        "max_delivery_attempts",
        a.max_delivery_attempts.map(|v| v.to_string()),
    );
    for s in &a.set {
        pairs.push(setting(s)?);
    }
    Ok(pairs)
}

/// The token of `target`: given, or CLUSTER_DIR/security/admin.token (as `bmqctl admin`).
fn token(target: &ClusterTarget) -> Option<String> {
    crate::admin::given_or_cluster_token(target.token.as_deref())
}

/// Which node to ask: domains are cluster state, so any node serves (a change is redirected
/// to the leader), and without `--admin` the first of `$BMQ_ADMIN`, else the local cluster's
/// node 1, as `bmqctl status` finds its nodes.
#[derive(Debug, Args)]
pub struct ClusterTarget {
    /// Admin HTTP address of any node, host:port (default: the first of $BMQ_ADMIN, else
    /// the local cluster's 127.0.0.1:30301).
    #[arg(long = "admin", value_name = "HOST:PORT")]
    pub admin: Option<String>,
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

impl ClusterTarget {
    /// The address asked: `--admin`, else the first of [`crate::status::resolve_admins`].
    fn address(&self) -> String {
        self.admin.clone().unwrap_or_else(|| {
            crate::status::resolve_admins(&[])
                .into_iter()
                .next()
                .unwrap_or_else(|| "127.0.0.1:30301".to_string())
        })
    }
}

/// One request to `target`, within its timeout.
async fn send(target: &ClusterTarget, method: &str, path: &str) -> anyhow::Result<String> {
    let timeout = Duration::from_millis(target.timeout_ms);
    let token = token(target);
    let admin = target.address();
    tokio::time::timeout(
        timeout,
        crate::http::request(&admin, method, path, token.as_deref()),
    )
    .await
    .map_err(|_| anyhow!("no answer from {admin} within {} ms", timeout.as_millis()))?
}

fn domain_path(name: &str) -> String {
    format!("/admin/domains/{}", percent_encode(name))
}

/// Runs `bmqctl domain ...` and prints the node's answer.
pub async fn run(command: DomainCommand) -> anyhow::Result<()> {
    match command {
        DomainCommand::Create(a) => {
            let mut pairs = create_settings(&a)?;
            pairs.push(server_timeout(&a.target));
            let path = format!("{}{}", domain_path(&a.name), query(&pairs));
            out!("{}", send(&a.target, "PUT", &path).await?);
        }
        DomainCommand::Update(a) => {
            let mut pairs = a
                .set
                .iter()
                .map(|s| setting(s))
                .collect::<anyhow::Result<Vec<_>>>()?;
            if let Some(v) = &a.if_version {
                pairs.push(("if_version".into(), v.clone()));
            }
            pairs.push(server_timeout(&a.target));
            let path = format!("{}{}", domain_path(&a.name), query(&pairs));
            out!("{}", send(&a.target, "PATCH", &path).await?);
        }
        DomainCommand::Delete(a) => {
            let mut pairs = Vec::new();
            if a.purge {
                pairs.push(("purge".to_string(), "true".to_string()));
            }
            if let Some(v) = &a.if_version {
                pairs.push(("if_version".into(), v.clone()));
            }
            pairs.push(server_timeout(&a.target));
            let path = format!("{}{}", domain_path(&a.name), query(&pairs));
            out!("{}", send(&a.target, "DELETE", &path).await?);
        }
        DomainCommand::List(a) => {
            let body = send(&a.target, "GET", "/admin/domains").await?;
            if a.json {
                out!("{body}");
            } else {
                let doc: serde_json::Value =
                    serde_json::from_str(&body).context("the node's domain list is not JSON")?;
                out!("{}", table(&doc));
            }
        }
        DomainCommand::Show(a) => {
            out!("{}", send(&a.target, "GET", &domain_path(&a.name)).await?);
        }
    }
    Ok(())
}

/// The server's wait for the commit, a little shorter than ours so its answer arrives.
fn server_timeout(target: &ClusterTarget) -> (String, String) {
    (
        "timeout_ms".into(),
        target.timeout_ms.saturating_sub(500).max(100).to_string(),
    )
}

/// The domain list as a table, one domain a line.
pub fn table(doc: &serde_json::Value) -> String {
    let mut out = format!(
        "domains at version {}\n{:<32} {:<9} {:<11} {:>10} {:>12} {:>8} {:>8} {:<10} APP_IDS\n",
        doc["version"].as_str().unwrap_or("?"),
        "NAME",
        "MODE",
        "CONSISTENCY",
        "MAX_MSGS",
        "MAX_BYTES",
        "TTL_MS",
        "ATTEMPTS",
        "VERSION"
    );
    for d in doc["domains"].as_array().into_iter().flatten() {
        let apps: Vec<&str> = d["app_ids"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str())
            .collect();
        out.push_str(&format!(
            "{:<32} {:<9} {:<11} {:>10} {:>12} {:>8} {:>8} {:<10} {}\n",
            d["name"].as_str().unwrap_or("?"),
            d["mode"].as_str().unwrap_or("?"),
            d["consistency"].as_str().unwrap_or("?"),
            // A JSON value's Display ignores the width: through a string it pads.
            d["max_queue_messages"].to_string(),
            d["max_queue_bytes"].to_string(),
            d["message_ttl_ms"].to_string(),
            d["max_delivery_attempts"].to_string(),
            d["version"].as_str().unwrap_or("?"),
            apps.join(",")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_key_value_pairs_and_a_bad_one_is_named() {
        // `--set` takes KEY=VALUE; a value may hold '=', a missing '=' is named.
        assert_eq!(
            setting("app_ids=a,b").unwrap(),
            ("app_ids".to_string(), "a,b".to_string())
        );
        assert_eq!(setting("k=a=b").unwrap().1, "a=b");
        let e = setting("max_queue_messages").unwrap_err().to_string();
        assert!(e.contains("expected KEY=VALUE"), "{e}");
        assert_eq!(
            query(&[("app_ids".into(), "a,b c".into())]),
            format!("?app_ids={}", percent_encode("a,b c"))
        );
    }
}
