//! `bmqctl ready`: exit 0 when a node answers `GET /readyz` with 200, 1 otherwise.
//!
//! Made for container health checks (the broker image has no HTTP client): with `--config` it
//! reads the node's own configuration and asks its admin listener, so one command line serves
//! every node of a cluster.

use std::time::Duration;

use anyhow::{anyhow, Context};

use crate::http;
use bmq_config::BrokerConfig;

/// Admin address asked when neither `--admin` nor `--config` is given.
pub const DEFAULT_READY_ADMIN: &str = "127.0.0.1:30301";

/// Arguments of `bmqctl ready`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Exit 0 if a node is ready (GET /readyz answers 200: it follows an active leader)",
    after_help = "Examples:\n  \
        bmqctl ready --admin 127.0.0.1:30302\n  \
        bmqctl ready --config /etc/bmq/broker.toml   # the node of this configuration"
)]
pub struct ReadyArgs {
    /// Admin HTTP address of the node, host:port [default: 127.0.0.1:30301].
    #[arg(long, value_name = "HOST:PORT", conflicts_with = "config")]
    pub admin: Option<String>,
    /// A broker configuration file: ask the admin listener of its node (an unspecified listen
    /// address such as 0.0.0.0 is asked on loopback).
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// Timeout of the whole request, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub timeout_ms: u64,
}

/// The admin address a `--config` file designates: the node's admin bind address, with an
/// unspecified host (`0.0.0.0`, `::`) replaced by loopback.
pub fn admin_addr_of(config: &BrokerConfig) -> String {
    let me = config.self_member();
    match config.listen_host.as_deref() {
        Some("0.0.0.0") => format!("127.0.0.1:{}", me.admin_port),
        Some("::") | Some("[::]") => format!("[::1]:{}", me.admin_port),
        _ => config.listen_addrs()[2].clone(),
    }
}

/// Runs `bmqctl ready`: prints `ready` and returns Ok on a 200 answer.
///
/// Errors: an unreadable or invalid `--config`, no connection, a timeout, or a non-200 answer
/// (`HTTP 503 ...: not ready: no active leader`).
pub async fn run(args: ReadyArgs) -> anyhow::Result<()> {
    let addr = match (&args.admin, &args.config) {
        (Some(admin), _) => admin.clone(),
        (None, Some(path)) => admin_addr_of(&BrokerConfig::load(path)?),
        (None, None) => DEFAULT_READY_ADMIN.to_string(),
    };
    let timeout = Duration::from_millis(args.timeout_ms);
    tokio::time::timeout(timeout, http::get(&addr, "/readyz"))
        .await
        .map_err(|_| anyhow!("no answer within {} ms", timeout.as_millis()))?
        .with_context(|| format!("{addr} is not ready"))?;
    outln!("ready");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bmq_config::LOCAL_CLUSTER_TOML;

    #[test]
    fn admin_address_of_a_configuration() {
        // The bound admin address, with 0.0.0.0 and :: asked on loopback.
        let mut c = BrokerConfig::from_toml_str(LOCAL_CLUSTER_TOML).unwrap();
        assert_eq!(admin_addr_of(&c), "127.0.0.1:30301");
        c.members[0].host = "broker1".into();
        assert_eq!(admin_addr_of(&c), "broker1:30301");
        c.listen_host = Some("0.0.0.0".into());
        assert_eq!(admin_addr_of(&c), "127.0.0.1:30301");
        c.listen_host = Some("::".into());
        assert_eq!(admin_addr_of(&c), "[::1]:30301");
    }
}
