//! `broker`: one node of the cluster.
//!
//! ```text
//! broker --config broker.toml
//! ```
//! Reads and validates the TOML configuration (an invalid file stops the node with a message
//! naming the field), then runs the node until SIGTERM or SIGINT. Logs go to `log.file` when set,
//! else to stderr; `RUST_LOG` overrides `log.level`.

use std::path::PathBuf;

use anyhow::Context;
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

fn init_logging(config: &BrokerConfig) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&config.log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    match &config.log.file {
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
            builder
                .with_ansi(false)
                .with_writer(std::sync::Mutex::new(file))
                .init();
        }
        None => builder.with_writer(std::io::stderr).init(),
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    let result = (|| -> anyhow::Result<()> {
        let config = BrokerConfig::load(&args.config)?;
        config
            .validate()
            .with_context(|| format!("invalid configuration {}", args.config.display()))?;
        init_logging(&config)?;
        let system = actix_rt::System::new();
        system.block_on(bmq_broker::node::run(config))
    })();
    if let Err(e) = result {
        tracing::error!("{e:#}");
        eprintln!("broker: error: {e:#}");
        std::process::exit(1);
    }
}
