//! `bmqctl cluster add-node` and `bmqctl cluster remove-node`: grow and shrink the local
//! cluster that `bmqctl cluster up` runs, while it runs (DESIGN.md §5a).
//!
//! - `add-node [--dir .cluster]` writes node N+1's configuration (N: the highest node id in
//!   DIR; itself as its one member, the others' peer addresses in `join`) beside the others,
//!   `DIR/node-<N+1>/broker.toml`, on the local cluster's port plan
//!   (client BASE+i, peer BASE+100+i, admin BASE+200+i, bmqp BASE+13+i), with a certificate
//!   from the cluster's development CA when it runs with security; starts its broker detached
//!   (its log in `DIR/node-<N+1>/broker.log`; `cluster up` does not supervise it); adds it as a
//!   learner through a running member's admin port and waits until the leader promoted it to
//!   voter.
//! - `remove-node --id N [--dir .cluster]` removes member N (a voter leaves first: its
//!   primaries move) and waits until its admin port stops answering (a removed node exits).
//!
//! The admin token is `DIR/security/admin.token` when it exists.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bmq_config::{BrokerConfig, MemberConfig, BMQP_PORT_OFFSET};
use clap::Args;

use crate::cluster::{absolute, write_node_config};
use crate::credentials::{ADMIN_TOKEN_FILE, SECURITY_DIR};

/// `bmqctl cluster add-node`.
#[derive(Debug, Args)]
pub struct AddNodeArgs {
    /// Directory of the local cluster (as given to `cluster up`).
    #[arg(long, default_value = ".cluster")]
    pub dir: PathBuf,
    /// The broker binary [default: `broker` next to this bmqctl executable].
    #[arg(long, value_name = "PATH")]
    pub broker_bin: Option<PathBuf>,
    /// How long to wait for the new node to become a voter, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 60_000)]
    pub timeout_ms: u64,
}

/// `bmqctl cluster remove-node`.
#[derive(Debug, Args)]
pub struct RemoveNodeArgs {
    /// The node to remove.
    #[arg(long)]
    pub id: u32,
    /// Directory of the local cluster (as given to `cluster up`).
    #[arg(long, default_value = ".cluster")]
    pub dir: PathBuf,
    /// How long to wait for the removal, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 60_000)]
    pub timeout_ms: u64,
}

/// Every node configuration in `dir` (`node-<i>/broker.toml`), by node id.
fn node_configs(dir: &Path) -> anyhow::Result<Vec<BrokerConfig>> {
    let mut configs = Vec::new();
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("no local cluster in {}", dir.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(id) = name.to_str().and_then(|n| n.strip_prefix("node-")) else {
            continue;
        };
        if id.parse::<u32>().is_err() {
            continue;
        }
        let path = entry.path().join("broker.toml");
        if path.is_file() {
            configs.push(
                BrokerConfig::load(&path)
                    .with_context(|| format!("cannot read {}", path.display()))?,
            );
        }
    }
    if configs.is_empty() {
        bail!(
            "no node configuration in {} (start the cluster with `bmqctl cluster up` first)",
            dir.display()
        );
    }
    configs.sort_by_key(|c| c.node_id);
    Ok(configs)
}

/// Every member any of the files lists (the added nodes' files list the newer ones), by id.
fn all_members(configs: &[BrokerConfig]) -> Vec<MemberConfig> {
    let mut members: Vec<MemberConfig> = Vec::new();
    for m in configs.iter().flat_map(|c| &c.members) {
        if !members.iter().any(|x| x.id == m.id) {
            members.push(m.clone());
        }
    }
    members.sort_by_key(|m| m.id);
    members
}

fn admin_token(dir: &Path) -> Option<String> {
    std::fs::read_to_string(dir.join(SECURITY_DIR).join(ADMIN_TOKEN_FILE))
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
}

/// Sends the request to the members' admin ports in turn until one answers (a node that is
/// not the leader redirects to it).
async fn to_any_member(
    members: &[MemberConfig],
    except: Option<u32>,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<String> {
    let mut last = None;
    for m in members.iter().filter(|m| Some(m.id) != except) {
        match crate::http::request(&m.admin_addr(), method, path, token).await {
            Ok(answer) => return Ok(answer),
            // A refusal from a reachable node is the answer; only a node that does not answer
            // passes the turn on.
            Err(e) if !format!("{e:#}").contains("cannot connect") => return Err(e),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no member to ask")))
}

/// Runs `bmqctl cluster add-node`: see the module doc.
///
/// Errors: no local cluster in DIR, ports in use, a missing broker binary, a node that does not
/// start, or the cluster's refusal (quoted).
pub async fn add_node(args: AddNodeArgs) -> anyhow::Result<()> {
    let dir = absolute(&args.dir)?;
    let configs = node_configs(&dir)?;
    let template = configs[0].clone();
    let members = all_members(&configs);
    let id = members
        .iter()
        .map(|m| m.id)
        .max()
        .unwrap_or(0)
        .max(configs.last().map_or(0, |c| c.node_id))
        + 1;
    let first = &members[0];
    let base = first
        .client_port
        .checked_sub(u16::try_from(first.id).unwrap_or(u16::MAX))
        .context("the cluster's ports do not follow the local port plan")?;
    let port = |offset: usize| -> anyhow::Result<u16> {
        u16::try_from(usize::from(base) + offset + id as usize)
            .context("the new node's ports would pass 65535")
    };
    let member = MemberConfig {
        id,
        host: first.host.clone(),
        client_port: port(0)?,
        peer_port: port(100)?,
        admin_port: port(200)?,
        bmqp_port: match first.bmqp_port {
            Some(_) => Some(port(BMQP_PORT_OFFSET)?),
            None => None,
        },
    };
    for (what, addr) in [
        ("client", member.client_addr()),
        ("peer", member.peer_addr()),
        ("admin", member.admin_addr()),
    ] {
        if let Err(e) = std::net::TcpListener::bind(&addr) {
            bail!("node {id}'s {what} port {addr} is not available ({e})");
        }
    }
    let mut config = template.clone();
    config.node_id = id;
    config.data_dir = dir.join(format!("node-{id}"));
    if config.log.file.is_some() {
        config.log.file = Some(config.data_dir.join("broker.log"));
    }
    // It joins: itself alone in its [[members]], and the members' peer addresses to ask
    // for the committed membership.
    config.members = vec![member.clone()];
    config.join = members.iter().map(MemberConfig::peer_addr).collect();
    if template.tls.is_some() {
        config.tls = Some(
            crate::dev_ca::issue_node_cert(&dir.join(SECURITY_DIR), id, &member.host)
                .context("cannot issue the new node's certificate")?,
        );
    }
    config
        .validate()
        .context("the new node's configuration is invalid")?;
    let config_path = write_node_config(&config)?;
    let broker_bin = match &args.broker_bin {
        Some(path) => path.clone(),
        None => std::env::current_exe()
            .context("cannot locate the bmqctl executable")?
            .with_file_name("broker"),
    };
    if !broker_bin.is_file() {
        bail!(
            "broker binary not found at {} (build it with `cargo build --release --bins`, or pass \
             --broker-bin)",
            broker_bin.display()
        );
    }
    let log_path = config.data_dir.join("broker.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("cannot open {}", log_path.display()))?;
    let log_err = log.try_clone()?;
    // Detached: its own process group, not killed with this command.
    let mut command = std::process::Command::new(&broker_bin);
    command
        .arg("--config")
        .arg(&config_path)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err);
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let child = command
        .spawn()
        .with_context(|| format!("cannot start {}", broker_bin.display()))?;
    outln!(
        "node {id}: started (pid {}), configuration {}, log {}",
        child.id(),
        config_path.display(),
        log_path.display()
    );
    let deadline = Instant::now() + Duration::from_millis(args.timeout_ms);
    while crate::http::get(&member.admin_addr(), "/healthz")
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            bail!("node {id} did not start; see {}", log_path.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut path = format!(
        "/admin/members?id={id}&host={}&client_port={}&peer_port={}&admin_port={}&timeout_ms={}",
        crate::admin::percent_encode(&member.host),
        member.client_port,
        member.peer_port,
        member.admin_port,
        args.timeout_ms.saturating_sub(1000)
    );
    if let Some(p) = member.bmqp_port {
        path.push_str(&format!("&bmqp_port={p}"));
    }
    let token = admin_token(&dir);
    let answer = tokio::time::timeout(
        Duration::from_millis(args.timeout_ms),
        to_any_member(&members, None, "POST", &path, token.as_deref()),
    )
    .await
    .context("no answer in time")??;
    out!("{answer}");
    outln!(
        "node {id}: client {}, admin {}; remove it with `bmqctl cluster remove-node --id {id}{}`",
        member.client_addr(),
        member.admin_addr(),
        if args.dir == Path::new(".cluster") {
            String::new()
        } else {
            format!(" --dir {}", args.dir.display())
        }
    );
    Ok(())
}

/// Runs `bmqctl cluster remove-node`: see the module doc.
///
/// Errors: no local cluster in DIR, the cluster's refusal (quoted), or a node still answering
/// after its removal.
pub async fn remove_node(args: RemoveNodeArgs) -> anyhow::Result<()> {
    let dir = absolute(&args.dir)?;
    let configs = node_configs(&dir)?;
    let members = all_members(&configs);
    let token = admin_token(&dir);
    let path = format!(
        "/admin/members/{}?timeout_ms={}",
        args.id,
        args.timeout_ms.saturating_sub(1000)
    );
    let answer = tokio::time::timeout(
        Duration::from_millis(args.timeout_ms),
        to_any_member(&members, Some(args.id), "DELETE", &path, token.as_deref()),
    )
    .await
    .context("no answer in time")??;
    out!("{answer}");
    if let Some(m) = members.iter().find(|m| m.id == args.id) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while crate::http::get(&m.admin_addr(), "/healthz").await.is_ok() {
            if Instant::now() > deadline {
                bail!(
                    "node {} still answers on {} after its removal",
                    args.id,
                    m.admin_addr()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        outln!("node {}: exited", args.id);
    }
    Ok(())
}
