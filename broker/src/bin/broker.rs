//! `broker`: one node of the cluster.
//!
//! ```text
//! broker --config broker.toml
//! ```
//! Reads and validates the TOML configuration (an invalid file stops the node with a message
//! naming the field), then runs the node until SIGTERM or SIGINT. Logs go to `log.file` when set,
//! else to stderr; `RUST_LOG` overrides `log.level` at start. SIGHUP (like `bmqctl admin
//! reload`) reads the file again and applies its tokens, TLS files and log level
//! (`bmq_broker::reload`).

use std::path::PathBuf;

use anyhow::Context;
use bmq_broker::node::NodeOptions;
use bmq_broker::reload::LogFilterReload;
use bmq_config::BrokerConfig;
use clap::Parser;

/// One broker node of the cluster.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    /// Path of the node's TOML configuration.
    #[arg(long, short)]
    config: PathBuf,
}

/// Installs the log subscriber; returns how a reload changes its filter.
fn init_logging(config: &BrokerConfig) -> anyhow::Result<LogFilterReload> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&config.log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    // The reload handle's type names the writer: one expansion per writer.
    macro_rules! install {
        ($builder:expr) => {{
            let builder = $builder.with_filter_reloading();
            let handle = builder.reload_handle();
            builder.init();
            let reload: LogFilterReload = Box::new(move |level: &str| {
                let filter =
                    tracing_subscriber::EnvFilter::try_new(level).map_err(|e| e.to_string())?;
                handle.reload(filter).map_err(|e| e.to_string())
            });
            reload
        }};
    }
    Ok(match &config.log.file {
        Some(path) => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
            }
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("cannot open the log file {}", path.display()))?;
            install!(builder
                .with_ansi(false)
                .with_writer(std::sync::Mutex::new(file)))
        }
        None => install!(builder.with_writer(std::io::stderr)),
    })
}

/// How often the node looks at the heap memory glibc keeps free.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const HEAP_TRIM_PERIOD: std::time::Duration = std::time::Duration::from_secs(10);

/// Free heap bytes (glibc's `mallinfo2().fordblks`) from which they are handed back.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const HEAP_TRIM_FREE_MIN: usize = 32 << 20;

/// Starts the `heap-trim` thread: every [`HEAP_TRIM_PERIOD`], when glibc holds at least
/// [`HEAP_TRIM_FREE_MIN`] bytes free, it calls `malloc_trim(0)`, which returns the free pages
/// of every arena to the system (`madvise`), not only the top of the main heap. glibc keeps
/// freed memory for reuse: after 1,000,000 outstanding messages were drained a node kept 60-75
/// MB free in its arenas (`malloc_stats`: 157 MB held, 83 MB in use), and a partition that
/// was busy once would hold its peak for good. The floor keeps a node under steady traffic,
/// which reuses what it frees, from giving pages back only to fault them in again (trimming at
/// every period cost measurably more broker CPU per message; with the floor the cost is within
/// the run-to-run spread).
/// Figures with and without, memory and throughput, in docs/bench/JOURNAL.md "Storage for
/// months" (mimalloc was measured as the other way: higher peaks with 1,000,000 outstanding,
/// the same idle RSS).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn start_heap_trim() {
    let spawned = std::thread::Builder::new()
        .name("heap-trim".into())
        .spawn(|| loop {
            std::thread::sleep(HEAP_TRIM_PERIOD);
            // SAFETY: mallinfo2 and malloc_trim take no pointer; they lock and walk glibc's
            // own arenas.
            let free = unsafe { libc::mallinfo2() }.fordblks;
            if free >= HEAP_TRIM_FREE_MIN {
                // SAFETY: as above.
                let released = unsafe { libc::malloc_trim(0) } == 1;
                tracing::debug!(free_bytes = free, released, "heap trimmed");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "heap-trim thread not started: freed heap memory stays with the process");
    }
}

fn main() {
    let args = Args::parse();
    let result = (|| -> anyhow::Result<()> {
        let config = BrokerConfig::load(&args.config)?;
        config
            .validate()
            .with_context(|| format!("invalid configuration {}", args.config.display()))?;
        let log_filter = init_logging(&config)?;
        // Before any thread starts: every thread inherits the policy (bmq_broker::scheduling).
        let policy = config.process.cpu_scheduling;
        if let Err(e) = bmq_broker::scheduling::apply_to_process(policy) {
            tracing::warn!(error = %e, ?policy, "process.cpu_scheduling not applied; the threads keep the default policy");
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        start_heap_trim();
        let system = actix_rt::System::new();
        // An actor that meets a fatal error (a failed ledger, journal or term fsync) stops the
        // system with a non-zero code after logging why; `block_on` would go on running the
        // node without it, so the node also ends when the system stops, and exits.
        let stopped = system.stop_future();
        system.block_on(async move {
            tokio::select! {
                result = bmq_broker::node::run_with(config, NodeOptions {
                    config_path: Some(args.config),
                    log_filter: Some(log_filter),
                }) => result,
                code = stopped => match code {
                    Ok(0) => Ok(()),
                    Ok(code) => Err(anyhow::anyhow!(
                        "the node stopped after a fatal error (code {code}; the error is logged above)"
                    )),
                    Err(e) => Err(anyhow::anyhow!("the node's system stopped: {e}")),
                },
            }
        })
    })();
    if let Err(e) = result {
        tracing::error!("{e:#}");
        eprintln!("broker: error: {e:#}");
        std::process::exit(1);
    }
}
