//! What every client-side subcommand shares: which brokers to dial and how to connect.

use std::time::Duration;

use anyhow::Context;
use bmq_client::{Client, ClientConfig};
use serde::Serializer;

/// Client addresses of the default local cluster (`bmqctl cluster up` with default ports).
pub const DEFAULT_BROKERS: &str = "127.0.0.1:30101,127.0.0.1:30102,127.0.0.1:30103";

/// Serializes a duration as fractional seconds.
pub fn as_secs_f64<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// The brokers to use: `--broker` if given, else `$BMQ_BROKERS` (comma-separated), else
/// [`DEFAULT_BROKERS`].
pub fn resolve_brokers(flag: &[String]) -> Vec<String> {
    let split = |s: &str| -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    };
    let from_flag: Vec<String> = flag.iter().flat_map(|s| split(s)).collect();
    if !from_flag.is_empty() {
        return from_flag;
    }
    match std::env::var("BMQ_BROKERS") {
        Ok(v) if !split(&v).is_empty() => split(&v),
        _ => split(DEFAULT_BROKERS),
    }
}

/// A client for the CLI commands: `brokers`, requests bounded by `timeout` (at most 10 s), TLS
/// and token from `security` ([`crate::credentials`]).
pub async fn connect(
    brokers: Vec<String>,
    max_pending_puts: usize,
    timeout: Duration,
    role: &str,
    security: &crate::credentials::ClientSecurityArgs,
) -> anyhow::Result<Client> {
    let mut config = ClientConfig::new(brokers);
    security.apply(&mut config, &crate::credentials::cluster_dir())?;
    config.client_id = format!("bmqctl-{role}-{}", std::process::id());
    config.request_timeout = timeout.min(Duration::from_secs(10));
    config.max_pending_puts = max_pending_puts.max(1);
    config.reconnect_timeout = Some(timeout);
    Client::connect(config).await.context("cannot connect")
}
