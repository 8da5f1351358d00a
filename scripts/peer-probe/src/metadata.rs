//! The metadata workload: `--count` durable, replicated writes, `--parallel` in flight (one
//! connection per writer; writer `k` talks to node `k % N`). Ours: the open of a queue nobody
//! opened before (it returns once the leader committed the queue's assignment on a quorum);
//! etcd: a put of a fresh key. Latency = the write's start -> its success.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::measure::{self, Percentiles};
use crate::systems::{self, MetaWriter, System};

/// Arguments of `peer-probe metadata`.
#[derive(Debug, Clone, clap::Args)]
pub struct MetadataArgs {
    /// The system to drive (bmq or etcd).
    #[arg(long, value_enum)]
    pub system: System,
    /// Client addresses of the nodes, host:port, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub servers: Vec<String>,
    /// A name for this run in the report.
    #[arg(long, default_value = "metadata")]
    pub label: String,
    /// Writes in total.
    #[arg(long, default_value_t = 500)]
    pub count: u64,
    /// Writes in flight at once (one connection each).
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Domain of our new queues.
    #[arg(long, default_value = "bmq.test")]
    pub domain: String,
    /// Per-write timeout, seconds.
    #[arg(long, default_value_t = 30)]
    pub timeout_secs: u64,
}

/// What one metadata run measured (one JSON line of the results file).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MetadataResult {
    /// Always `"metadata"`.
    pub kind: String,
    /// The system driven.
    pub system: System,
    /// The run's label.
    pub label: String,
    /// Writes in flight.
    pub parallel: usize,
    /// Successful writes.
    pub writes: u64,
    /// Failed or timed-out writes.
    pub errors: u64,
    /// Seconds for all writes.
    pub elapsed_secs: f64,
    /// Successful writes per second.
    pub writes_per_sec: f64,
    /// Start -> success of each write.
    pub latency: Percentiles,
    /// `/proc/loadavg` (1-minute) before and after the run.
    pub loadavg: (f64, f64),
}

/// Runs the metadata workload against `args.system` and returns what it measured.
///
/// Errors: bad arguments, no node reachable.
pub async fn run(args: MetadataArgs) -> anyhow::Result<MetadataResult> {
    if args.count == 0 || args.parallel == 0 {
        bail!("--count and --parallel must be at least 1");
    }
    let loadavg_start = crate::loadavg();
    let timeout = Duration::from_secs(args.timeout_secs.max(1));
    let run_id: u32 = rand::random();
    let mut writers = Vec::new();
    for k in 0..args.parallel {
        let first = systems::rotated(&args.servers, k);
        writers.push(match args.system {
            System::Bmq => MetaWriter::Bmq {
                client: systems::bmq_connect(first, 1, "metadata").await?,
                domain: args.domain.clone(),
            },
            System::Etcd => MetaWriter::etcd(&first[0], timeout)?,
            System::Nats => bail!("nats has no metadata workload here (use bmq or etcd)"),
        });
    }
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = writers
        .into_iter()
        .map(|w| {
            let next = next.clone();
            let total = args.count;
            tokio::spawn(async move {
                let mut h = measure::histogram();
                let mut errors = 0u64;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let key = format!("meta-{run_id:08x}-{i}");
                    let t = Instant::now();
                    match tokio::time::timeout(timeout, w.write(&key)).await {
                        Ok(Ok(())) => measure::record(&mut h, t.elapsed()),
                        Ok(Err(e)) => {
                            errors += 1;
                            if errors <= 3 {
                                eprintln!("peer-probe: write {key} failed: {e:#}");
                            }
                        }
                        Err(_) => {
                            errors += 1;
                            eprintln!("peer-probe: write {key} timed out");
                        }
                    }
                }
                w.close().await;
                (h, errors)
            })
        })
        .collect();
    let mut h = measure::histogram();
    let mut errors = 0;
    for t in tasks {
        let (th, te) = t.await.context("metadata writer panicked")?;
        h.add(&th).expect("same histogram bounds");
        errors += te;
    }
    let elapsed = start.elapsed();
    Ok(MetadataResult {
        kind: "metadata".into(),
        system: args.system,
        label: args.label,
        parallel: args.parallel,
        writes: h.len(),
        errors,
        elapsed_secs: elapsed.as_secs_f64(),
        writes_per_sec: measure::rate(h.len(), elapsed),
        latency: Percentiles::of(&h),
        loadavg: (loadavg_start, crate::loadavg()),
    })
}
