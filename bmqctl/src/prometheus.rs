//! The shipped Prometheus configuration (`dashboards/prometheus/`), embedded, and how to run a
//! Prometheus server with it against a given set of nodes.
//!
//! `bmqctl cluster up` uses this to start Prometheus beside the cluster it launched, and the
//! Prometheus test (`tests/tests/prometheus.rs`) uses it to scrape its own cluster, so both run
//! exactly the shipped scrape configuration and alert rules; only the targets differ.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// `dashboards/prometheus/prometheus.yml`: the scrape configuration of the default local cluster.
pub const PROMETHEUS_CONFIG: &str = include_str!("../../dashboards/prometheus/prometheus.yml");

/// `dashboards/prometheus/alerts.yml`: the alert rules (loaded by the configuration as
/// `alerts.yml`, next to it).
pub const PROMETHEUS_ALERTS: &str = include_str!("../../dashboards/prometheus/alerts.yml");

/// The line of [`PROMETHEUS_CONFIG`] after which the per-node static configurations follow,
/// up to the end of the file.
const STATIC_CONFIGS_LINE: &str = "    static_configs:\n";

/// One scrape target: a node id (the `node` label) and its admin address (`host:port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeTarget {
    /// The node id, exported as the `node` label of every series of this target.
    pub node_id: u32,
    /// The node's admin HTTP address, `host:port`.
    pub admin_addr: String,
}

/// [`PROMETHEUS_CONFIG`] with its targets replaced by `targets` (one static configuration per
/// node, labelled `node: "<id>"`, as in the shipped file).
///
/// Errors: the embedded configuration lost its `static_configs:` section (a change of the
/// shipped file that this function must follow), or `targets` is empty.
pub fn render_config(targets: &[ScrapeTarget]) -> anyhow::Result<String> {
    if targets.is_empty() {
        bail!("a Prometheus configuration needs at least one target");
    }
    let Some(at) = PROMETHEUS_CONFIG.find(STATIC_CONFIGS_LINE) else {
        bail!("dashboards/prometheus/prometheus.yml has no `static_configs:` section at the end");
    };
    let mut out = PROMETHEUS_CONFIG[..at + STATIC_CONFIGS_LINE.len()].to_string();
    for t in targets {
        out.push_str(&format!(
            "      - targets: [\"{}\"]\n        labels:\n          node: \"{}\"\n",
            t.admin_addr, t.node_id
        ));
    }
    Ok(out)
}

/// Writes `prometheus.yml` (see [`render_config`]) and `alerts.yml` into `dir` (created if
/// missing) and returns the configuration's path.
///
/// Errors: `dir` or a file cannot be written; [`render_config`]'s errors.
pub fn write_config(dir: &Path, targets: &[ScrapeTarget]) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let config = dir.join("prometheus.yml");
    std::fs::write(&config, render_config(targets)?)
        .with_context(|| format!("cannot write {}", config.display()))?;
    let alerts = dir.join("alerts.yml");
    std::fs::write(&alerts, PROMETHEUS_ALERTS)
        .with_context(|| format!("cannot write {}", alerts.display()))?;
    Ok(config)
}

/// The arguments of a `prometheus` server using `config`, storing its data in `storage`, and
/// serving its UI and HTTP API on `listen` (`host:port`). Admin APIs stay off; the lifecycle API
/// is off too, so only a signal stops it.
pub fn server_args(config: &Path, storage: &Path, listen: &str) -> Vec<OsString> {
    let mut config_arg = OsString::from("--config.file=");
    config_arg.push(config);
    let mut storage_arg = OsString::from("--storage.tsdb.path=");
    storage_arg.push(storage);
    vec![
        config_arg,
        storage_arg,
        OsString::from(format!("--web.listen-address={listen}")),
        // Keep a local run small; a dashboard looks back at most a few hours.
        OsString::from("--storage.tsdb.retention.time=1d"),
        OsString::from("--log.level=warn"),
    ]
}

/// The `name` executable (`prometheus`, `promtool`) on `PATH`, if any.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_config_replaces_the_targets_only() {
        // The rendered configuration keeps the shipped globals and rule file and lists exactly
        // the given nodes with their node labels.
        let text = render_config(&[
            ScrapeTarget {
                node_id: 1,
                admin_addr: "127.0.0.1:40001".into(),
            },
            ScrapeTarget {
                node_id: 7,
                admin_addr: "10.0.0.7:30307".into(),
            },
        ])
        .unwrap();
        assert!(text.contains("scrape_interval: 1s"));
        assert!(text.contains("  - alerts.yml\n"));
        assert!(text.contains("job_name: bmq"));
        assert!(text.ends_with(
            "    static_configs:\n      - targets: [\"127.0.0.1:40001\"]\n        labels:\n          \
             node: \"1\"\n      - targets: [\"10.0.0.7:30307\"]\n        labels:\n          \
             node: \"7\"\n"
        ));
        assert!(!text.contains("30301"));
        assert!(render_config(&[]).is_err());
    }

    #[test]
    fn shipped_config_targets_the_default_local_cluster() {
        // The shipped file names the default cluster's admin ports, so it works unchanged with
        // `bmqctl cluster up`.
        let defaults: Vec<ScrapeTarget> = (1..=3)
            .map(|i| ScrapeTarget {
                node_id: i,
                admin_addr: format!("127.0.0.1:{}", 30300 + i),
            })
            .collect();
        assert_eq!(render_config(&defaults).unwrap(), PROMETHEUS_CONFIG);
    }
}
