//! `peer-probe`: the same workloads, timed by the same code, against our cluster, NATS
//! JetStream and etcd (scripts/bench-peers.sh runs it, BENCHMARKS.md has the method).
//!
//! ```text
//! peer-probe messages --system bmq|nats --servers h:p,h:p,h:p [--producers 1 --consumers 1
//!     --queues 1 --size 1024 --window 256 --count N | --duration-secs S] [--rate R]
//!     [--out results.jsonl]
//! peer-probe metadata --system bmq|etcd --servers ... --count N --parallel K [--out ...]
//! peer-probe failover --system bmq|nats|etcd --scenario leader-stop|leader-kill|primary-kill
//!     --servers ... --status ... --pids ... [--killed-file F] [--out ...]
//! peer-probe report results.jsonl          # Markdown table: ours, peer, ours / peer
//! ```
//!
//! Every run prints a one-line summary and, with `--out`, appends its result as one JSON line.
//! A benchmark measures; it does not judge: the exit status is non-zero only when a run could
//! not be made (no cluster, a refused queue), never for a slow figure.

mod failover;
mod measure;
mod messages;
mod metadata;
mod report;
mod systems;

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Same workloads, same measurement, against bmq, NATS JetStream and etcd")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Message throughput and ACK / end-to-end latency (bmq or nats).
    Messages {
        #[command(flatten)]
        args: messages::MessagesArgs,
        /// Append the result as a JSON line to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Durable replicated metadata writes per second and their latency (bmq or etcd).
    Metadata {
        #[command(flatten)]
        args: metadata::MetadataArgs,
        /// Append the result as a JSON line to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// One failover run: signal a node, time the recovery.
    Failover {
        #[command(flatten)]
        args: failover::FailoverArgs,
        /// Append the result as a JSON line to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Print the comparison table of a results file.
    Report {
        /// The JSON-lines file the runs appended to.
        file: PathBuf,
    },
}

/// The 1-minute load average (`/proc/loadavg`), 0 where it cannot be read.
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn append(out: &Option<PathBuf>, value: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(path) = out {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        writeln!(f, "{}", serde_json::to_string(value)?)?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Messages { args, out } => {
            let r = messages::run(args).await?;
            println!(
                "{} messages [{}]: consumed {:.0} msgs/s (produced {:.0}), ACK p50/p90/p99/max \
                 {:.2}/{:.2}/{:.2}/{:.2} ms, end-to-end p50/p99 {:.2}/{:.2} ms, sent {} acked {} \
                 received {} errors {} missing {} redeliveries {} duplicates {}, queues {}/{} \
                 delivered, load {:.2} -> {:.2}",
                r.system.name(),
                r.label,
                r.consumed_per_sec,
                r.produced_per_sec,
                r.ack.p50_ms,
                r.ack.p90_ms,
                r.ack.p99_ms,
                r.ack.max_ms,
                r.e2e.p50_ms,
                r.e2e.p99_ms,
                r.sent,
                r.acked,
                r.received,
                r.errors,
                r.missing,
                r.redeliveries,
                r.duplicates,
                r.queues_delivered,
                r.queues,
                r.loadavg.0,
                r.loadavg.1
            );
            append(&out, &r)?;
        }
        Command::Metadata { args, out } => {
            let r = metadata::run(args).await?;
            println!(
                "{} metadata [{}]: {} writes, {:.1}/s with {} in flight, latency p50/p90/p99/max \
                 {:.2}/{:.2}/{:.2}/{:.2} ms, errors {}, load {:.2} -> {:.2}",
                r.system.name(),
                r.label,
                r.writes,
                r.writes_per_sec,
                r.parallel,
                r.latency.p50_ms,
                r.latency.p90_ms,
                r.latency.p99_ms,
                r.latency.max_ms,
                r.errors,
                r.loadavg.0,
                r.loadavg.1
            );
            append(&out, &r)?;
        }
        Command::Failover { args, out } => {
            let r = failover::run(args).await?;
            println!(
                "{} failover [{}]: node index {}, {}, errors {}, load {:.2} -> {:.2}",
                r.system.name(),
                r.scenario,
                r.node_index,
                match r.gap_ms {
                    Some(ms) => format!("{ms:.1} ms"),
                    None => "NOT recovered within the timeout".into(),
                },
                r.errors,
                r.loadavg.0,
                r.loadavg.1
            );
            append(&out, &r)?;
        }
        Command::Report { file } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            print!("{}", report::render(&text)?);
        }
    }
    Ok(())
}
