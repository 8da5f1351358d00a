//! `bmqctl bench first-open`: how long after a fault a client opens a never-opened queue
//! again (issue "failover flat in the size of the cluster state").
//!
//! One client per `--broker`, each connected to that broker only. Once all are connected, the
//! command SIGKILLs `--kill-pid` (if given; the run's clock starts there) and from then on starts
//! the open of a fresh queue (`bmq://<domain>/first-open-<run>-<i>`) every `--interval-ms`,
//! round robin over the clients, without waiting for earlier opens. An open of a queue nobody
//! opened before needs a committed `QueueAssignmentAdvisory` (a leader that synced its term) and
//! then the queue's partition primary (active), so the first open that succeeds says when both
//! were back. The figure is the time from the kill to the end of that open; opens started later
//! probe again every interval, so no client's retry backoff is measured.
//!
//! With `--partitions`, the command goes on until an open of a queue assigned to one of those
//! partitions (the broker names the partition in its answer) succeeded too: given the
//! partitions whose primary died with the leader, that open also waited for a new primary.
//! Queues are assigned round robin over the partitions (the fewest queues first), so the opens
//! started during an outage of 4 intervals or more cover every partition.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::connect::connect;
use crate::credentials::ClientSecurityArgs;
use bmq_client::OpenOptions;

/// Arguments of `bmqctl bench first-open`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Example (SIGKILL of node 1, opens through nodes 2 and 3):\n  bmqctl bench first-open --broker 127.0.0.1:30102,127.0.0.1:30103 --kill-pid 4242 --json"
)]
pub struct FirstOpenArgs {
    /// Domain of the new queues.
    #[arg(long, default_value = "bmq.test")]
    pub domain: String,
    /// Prefix of the queue names: the i-th open is of `<prefix>-<run id>-<i>`, the names
    /// `bmqctl bench messages` uses, so a run with `--opens 1` assigns the queue of a later
    /// `bench messages --queue-prefix <prefix> --run-id <run id>` and says its partition.
    #[arg(long, default_value = "first-open")]
    pub queue_prefix: String,
    /// The run id in the queue names (hexadecimal, default random).
    #[arg(long, value_parser = crate::bench::parse_run_id)]
    pub run_id: Option<u32>,
    /// Start at most this many opens (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub opens: u64,
    /// Client address of a broker, host:port; one client per broker, connected to it only
    /// (repeat or separate with commas).
    #[arg(
        long = "broker",
        value_name = "HOST:PORT",
        value_delimiter = ',',
        required = true
    )]
    pub broker: Vec<String>,
    /// A new open every this many milliseconds.
    #[arg(long, default_value_t = 10)]
    pub interval_ms: u64,
    /// Give up after this many seconds from the start (the kill).
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub timeout_secs: u64,
    /// SIGKILL this process once every client is connected; the clock starts there.
    #[arg(long, value_name = "PID")]
    pub kill_pid: Option<i32>,
    /// Also wait for a successful open of a queue on one of these partitions.
    #[arg(long, value_delimiter = ',')]
    pub partitions: Vec<u32>,
    /// Print a JSON report instead of text.
    #[arg(long)]
    pub json: bool,
    /// TLS and token.
    #[command(flatten)]
    pub security: ClientSecurityArgs,
}

/// One successful open of the run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct OpenDone {
    /// Milliseconds from the start (the kill) to the open's success.
    pub done_ms: f64,
    /// Milliseconds from the start to when the open was started.
    pub started_ms: f64,
    /// Index of the `--broker` whose client opened it.
    pub broker: usize,
    /// The queue's URI.
    pub uri: String,
    /// The partition the queue is assigned to.
    pub partition: u32,
}

/// The report of `bmqctl bench first-open`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FirstOpenReport {
    /// The first open that succeeded, whatever its partition.
    pub first: Option<OpenDone>,
    /// The first that succeeded of a queue on `--partitions` (None when not asked).
    pub first_on_partitions: Option<OpenDone>,
    /// Opens started.
    pub opens_started: u64,
    /// Opens that failed (refused or timed out) before the report.
    pub opens_failed: u64,
}

/// Which firsts a successful open settles, given what the run has seen so far: whether it is
/// the first success at all, and whether it is the first on one of `partitions`.
fn settles(report: &FirstOpenReport, partitions: &[u32], partition: u32) -> (bool, bool) {
    (
        report.first.is_none(),
        !partitions.is_empty()
            && report.first_on_partitions.is_none()
            && partitions.contains(&partition),
    )
}

/// Whether the run has what it waits for.
fn complete(report: &FirstOpenReport, partitions: &[u32]) -> bool {
    report.first.is_some() && (partitions.is_empty() || report.first_on_partitions.is_some())
}

/// Runs `bmqctl bench first-open` (see the module doc).
///
/// Errors: a broker not reachable before the start, nothing opened within `--timeout-secs`.
pub async fn run(args: FirstOpenArgs) -> anyhow::Result<FirstOpenReport> {
    if args.interval_ms == 0 {
        bail!("--interval-ms must be at least 1");
    }
    let timeout = Duration::from_secs(args.timeout_secs.max(1));
    let mut clients = Vec::new();
    for broker in &args.broker {
        clients.push(
            connect(
                vec![broker.clone()],
                1,
                timeout,
                "first-open",
                &args.security,
            )
            .await
            .with_context(|| format!("cannot connect to {broker}"))?,
        );
    }
    let run_id: u32 = args.run_id.unwrap_or_else(rand::random);
    let start = Instant::now();
    if let Some(pid) = args.kill_pid {
        // SAFETY: kill(2) with a pid and a signal number; no memory is shared.
        if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
            bail!("cannot SIGKILL {pid}: {}", std::io::Error::last_os_error());
        }
    }
    let ms = |t: Instant| t.duration_since(start).as_secs_f64() * 1000.0;
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let mut ticker = tokio::time::interval(Duration::from_millis(args.interval_ms));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let deadline = tokio::time::Instant::from_std(start + timeout);
    let mut report = FirstOpenReport {
        first: None,
        first_on_partitions: None,
        opens_started: 0,
        opens_failed: 0,
    };
    while !complete(&report, &args.partitions) {
        tokio::select! {
            _ = ticker.tick(), if args.opens == 0 || report.opens_started < args.opens => {
                let i = report.opens_started;
                report.opens_started += 1;
                let broker = (i as usize) % clients.len();
                let client = clients[broker].clone();
                let uri = format!("bmq://{}/{}-{run_id:08x}-{i}", args.domain, args.queue_prefix);
                let started = Instant::now();
                let done_tx = done_tx.clone();
                tokio::spawn(async move {
                    let result = client.open_queue_partition(&uri, OpenOptions::write()).await;
                    let _ = done_tx.send((broker, uri, started, Instant::now(), result));
                });
            }
            Some((broker, uri, started, done, result)) = done_rx.recv() => match result {
                Ok(partition) => {
                    let open = OpenDone {
                        done_ms: ms(done),
                        started_ms: ms(started),
                        broker,
                        uri,
                        partition,
                    };
                    let (first, on_partitions) = settles(&report, &args.partitions, partition);
                    if on_partitions {
                        report.first_on_partitions = Some(open.clone());
                    }
                    if first {
                        report.first = Some(open);
                    }
                }
                Err(e) => {
                    report.opens_failed += 1;
                    tracing::debug!(error = %e, "open failed");
                }
            },
            _ = tokio::time::sleep_until(deadline) => {
                // Also the end of a run whose `--opens` all failed.
                bail!("no open succeeded within {} s (report so far: {report:?})", args.timeout_secs);
            }
        }
    }
    Ok(report)
}

/// Prints the report as text.
pub fn print(report: &FirstOpenReport) {
    let line = |name: &str, open: &Option<OpenDone>| match open {
        Some(o) => crate::outln!(
            "{name}: {:.1} ms ({}, started at {:.1} ms through broker {}, partition {})",
            o.done_ms,
            o.uri,
            o.started_ms,
            o.broker,
            o.partition
        ),
        None => crate::outln!("{name}: -"),
    };
    line("first open", &report.first);
    line("first open on the partitions", &report.first_on_partitions);
    crate::outln!(
        "opens started {}, failed {}",
        report.opens_started,
        report.opens_failed
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(partition: u32) -> OpenDone {
        OpenDone {
            done_ms: 1.0,
            started_ms: 0.0,
            broker: 0,
            uri: String::new(),
            partition,
        }
    }

    #[test]
    fn the_first_success_and_the_first_on_the_partitions_are_kept_apart() {
        // A run that waits for partition 2: an open on partition 1 settles only the first
        // success, a later one on partition 2 only the partitions' first.
        let mut report = FirstOpenReport {
            first: None,
            first_on_partitions: None,
            opens_started: 3,
            opens_failed: 0,
        };
        assert_eq!(settles(&report, &[2], 1), (true, false));
        report.first = Some(open(1));
        assert!(!complete(&report, &[2]));
        assert_eq!(settles(&report, &[2], 3), (false, false));
        assert_eq!(settles(&report, &[2], 2), (false, true));
        report.first_on_partitions = Some(open(2));
        assert!(complete(&report, &[2]));
        assert_eq!(settles(&report, &[2], 2), (false, false));
        // Without partitions the first success is all it waits for.
        report.first_on_partitions = None;
        assert!(complete(&report, &[]));
        assert_eq!(settles(&report, &[], 2), (false, false));
    }
}
