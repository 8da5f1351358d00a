//! The shipped Prometheus configuration (`dashboards/prometheus/`) and console pages
//! (`dashboards/consoles/`), embedded, and how to run a Prometheus server with them against a
//! given set of nodes.
//!
//! `bmqctl cluster up` uses this to start Prometheus beside the cluster it launched, and the
//! Prometheus tests (`tests/tests/prometheus.rs`, `tests/tests/consoles.rs`) use it to scrape
//! their own cluster, so all run exactly the shipped scrape configuration, alert rules and
//! console pages; only the targets differ.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// `dashboards/prometheus/prometheus.yml`: the scrape configuration of the default local cluster.
pub const PROMETHEUS_CONFIG: &str = include_str!("../../dashboards/prometheus/prometheus.yml");

/// `dashboards/prometheus/alerts.yml`: the alert rules (loaded by the configuration as
/// `alerts.yml`, next to it).
pub const PROMETHEUS_ALERTS: &str = include_str!("../../dashboards/prometheus/alerts.yml");

/// The console pages of `dashboards/consoles/` (written by `dashboards/generate.py`), by file
/// name: one per Grafana dashboard, served at `/consoles/<name>`.
pub const CONSOLE_PAGES: &[(&str, &str)] = &[
    (
        "bmq-cluster.html",
        include_str!("../../dashboards/consoles/bmq-cluster.html"),
    ),
    (
        "bmq-queues.html",
        include_str!("../../dashboards/consoles/bmq-queues.html"),
    ),
    (
        "bmq-storage.html",
        include_str!("../../dashboards/consoles/bmq-storage.html"),
    ),
    (
        "bmq-node.html",
        include_str!("../../dashboards/consoles/bmq-node.html"),
    ),
];

/// Where packages install the console libraries (`prom.lib`, which the pages of
/// [`CONSOLE_PAGES`] use). Debian's and Ubuntu's `prometheus` package ships them as an example
/// only, under `/usr/share/doc`; its `/etc/prometheus/console_libraries` is empty.
const CONSOLE_LIBRARY_DIRS: &[&str] = &[
    "/usr/share/doc/prometheus/examples/console_libraries",
    "/usr/share/prometheus/console_libraries",
    "/etc/prometheus/console_libraries",
];

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

/// Writes the pages of [`CONSOLE_PAGES`] into `dir` (created if missing), for
/// `--web.console.templates`.
///
/// Errors: `dir` or a page cannot be written.
pub fn write_consoles(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for (name, text) in CONSOLE_PAGES {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// The console libraries directory of the Prometheus installed as `binary`: the first of
/// `console_libraries/` next to the binary (the layout of the upstream release archives),
/// `../share/prometheus/console_libraries` and the packages' directories
/// ([`CONSOLE_LIBRARY_DIRS`]) that holds `prom.lib`. `None` if none does.
pub fn find_console_libraries(binary: &Path) -> Option<PathBuf> {
    let beside = binary.parent().map(|dir| {
        [
            dir.join("console_libraries"),
            dir.join("../share/prometheus/console_libraries"),
        ]
    });
    beside
        .into_iter()
        .flatten()
        .chain(CONSOLE_LIBRARY_DIRS.iter().map(PathBuf::from))
        .find(|dir| dir.join("prom.lib").is_file())
}

/// The arguments that make a `prometheus` server serve the console pages in `templates` (see
/// [`write_consoles`]) with the console libraries in `libraries` (see
/// [`find_console_libraries`]), at `/consoles/<page>`.
pub fn console_args(templates: &Path, libraries: &Path) -> Vec<OsString> {
    let mut templates_arg = OsString::from("--web.console.templates=");
    templates_arg.push(templates);
    let mut libraries_arg = OsString::from("--web.console.libraries=");
    libraries_arg.push(libraries);
    vec![templates_arg, libraries_arg]
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
    fn every_generated_console_page_is_embedded() {
        // A dashboard added to dashboards/generate.py writes a page that bmqctl must serve too.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dashboards/consoles");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".html"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = CONSOLE_PAGES.iter().map(|(n, _)| n.to_string()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded);
        let out = tempfile::tempdir().unwrap();
        write_consoles(out.path()).unwrap();
        assert!(out.path().join("bmq-cluster.html").is_file());
    }

    #[test]
    fn console_libraries_are_found_beside_the_binary() {
        // An upstream release archive unpacked anywhere: prometheus and console_libraries/.
        let root = tempfile::tempdir().unwrap();
        let binary = root.path().join("prometheus");
        assert_eq!(
            find_console_libraries(&binary).filter(|d| d.starts_with(root.path())),
            None
        );
        std::fs::create_dir(root.path().join("console_libraries")).unwrap();
        std::fs::write(root.path().join("console_libraries/prom.lib"), "").unwrap();
        assert_eq!(
            find_console_libraries(&binary),
            Some(root.path().join("console_libraries"))
        );
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
