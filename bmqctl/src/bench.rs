//! `bmqctl bench`: load generators and latency meters, in the manner of `nats bench` and
//! RabbitMQ's perf-test.
//!
//! - `bmqctl bench messages`: P producers and C consumers over Q fresh queues (producer `i`
//!   writes to queue `i % Q`, consumer `j` reads queue `j % Q`), each with its own client
//!   connection on a thread of its own (a current-thread tokio runtime). Producers send
//!   `--size`-byte payloads, unthrottled or at `--rate` messages per second in total, for
//!   `--count` messages in total or for `--duration-secs`; at most `--window` PUTs per producer
//!   are unacknowledged at once. Measured: messages and bytes produced (ACKed) and consumed
//!   per second, ACK latency (PUT handed to the client library -> ACK), end-to-end latency
//!   (PUT -> PUSH received by a consumer; producer and consumers share this process's
//!   monotonic clock, so there is no clock skew), errors, NACKs by status and redeliveries.
//!   Percentiles come from HDR histograms (microsecond resolution, 3 significant digits).
//! - `bmqctl bench metadata`: opens N fresh queues for writing, `--parallel` at a time. Opening a
//!   queue nobody opened before waits for the leader to commit its `QueueAssignmentAdvisory`
//!   (DESIGN.md §7), so the open latency is the assignment's commit latency seen by a client,
//!   and opens per second are committed assignments per second. With `--admin` (the leader's
//!   admin address) it also reads the leader's own commit latency (propose -> quorum commit,
//!   `bmq_metadata_commit_latency_seconds`, compared before and after the run) and how many
//!   queues the cluster had assigned before the run (`bmq_cluster_queues`).
//!
//! - `bmqctl bench first-open`: a fault (`--kill-pid`), then the open of a fresh queue every
//!   `--interval-ms` through clients of the given brokers -> the first open that succeeds
//!   (module `bench_first_open`).
//!
//! Both print a table, or a JSON report with `--json`; a progress bar on standard error while
//! running (hidden with `--quiet` or when standard error is not a terminal). Benchmarks measure;
//! they do not judge: the command fails only on errors (no broker, refused queue, nothing
//! consumed in time), never on a slow figure.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bmq_proto::client::{AckStatus, ConsumerOptions};
use bytes::{BufMut, Bytes, BytesMut};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use tokio::sync::{mpsc, watch};

use crate::client_thread::{client_ready, finished, on_own_thread, wait_for_start};
use crate::connect::{connect, resolve_brokers};
use crate::credentials::ClientSecurityArgs;
use bmq_client::{Client, OpenOptions, PendingAck};
use bmq_proto::uri::QueueUri;

/// First bytes of every benchmark payload.
const MAGIC: &[u8; 4] = b"BMQB";
/// Magic + send time (u64 nanoseconds since the run's start, big-endian).
pub const BENCH_HEADER_LEN: usize = 12;
/// Highest latency the histograms hold, microseconds (1 hour); larger values are clamped.
const LATENCY_MAX_US: u64 = 3_600_000_000;

/// `bmqctl bench` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum BenchCommand {
    /// Message throughput and ACK / end-to-end latency with P producers and C consumers.
    Messages(MessagesArgs),
    /// Queue assignments committed per second and their commit latency seen by a client.
    Metadata(MetadataArgs),
    /// A fault (`--kill-pid`) -> the first successful open of a never-opened queue, opens
    /// started every `--interval-ms` (`bench_first_open`).
    FirstOpen(crate::bench_first_open::FirstOpenArgs),
}

/// A run id given in hexadecimal, as the queue names show it.
pub(crate) fn parse_run_id(text: &str) -> Result<u32, String> {
    u32::from_str_radix(text, 16).map_err(|e| format!("{text:?} is not a hexadecimal u32: {e}"))
}

/// Arguments of `bmqctl bench messages`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Examples:\n  \
        bmqctl bench messages --count 200000 --size 1024\n  \
        bmqctl bench messages --producers 4 --consumers 4 --queues 4 --duration-secs 30\n  \
        bmqctl bench messages --rate 20000 --duration-secs 60 --json > run.json")]
pub struct MessagesArgs {
    /// Domain of the benchmark queues (its consistency, strong or eventual, applies).
    #[arg(long, default_value = "bmq.test")]
    pub domain: String,
    /// Prefix of the queue names; a random run id and the queue index are appended, so every
    /// run starts from empty queues.
    #[arg(long, default_value = "bench")]
    pub queue_prefix: String,
    /// The run id in the queue names (hexadecimal, default random): give the same one to runs
    /// that should reuse their queues, e.g. to measure with the queue's primary known.
    #[arg(long, value_parser = parse_run_id)]
    pub run_id: Option<u32>,
    /// Number of queues.
    #[arg(long, default_value_t = 1)]
    pub queues: usize,
    /// Number of producers (one client connection each).
    #[arg(long, default_value_t = 1)]
    pub producers: usize,
    /// Number of consumers (one client connection each); 0 = produce only. When not 0, at
    /// least one per queue.
    #[arg(long, default_value_t = 1)]
    pub consumers: usize,
    /// Payload size, bytes (at least 12: magic and send time).
    #[arg(long, value_name = "BYTES", default_value_t = 1024)]
    pub size: usize,
    /// Messages in total, shared among the producers (ignored with --duration-secs).
    #[arg(long, default_value_t = 100_000)]
    pub count: u64,
    /// Produce for this many seconds instead of --count messages.
    #[arg(long, value_name = "SECS")]
    pub duration_secs: Option<u64>,
    /// Target rate in messages per second, all producers together; 0 = unthrottled.
    #[arg(long, value_name = "MSGS_PER_SEC", default_value_t = 0)]
    pub rate: u64,
    /// Most unacknowledged PUTs per producer.
    #[arg(long, default_value_t = 1000)]
    pub window: usize,
    /// Most delivered-but-unconfirmed messages per consumer.
    #[arg(long, default_value_t = 1000)]
    pub max_unconfirmed: u32,
    /// Client address of a broker, host:port; repeat or separate with commas
    /// [default: $BMQ_BROKERS, else the local cluster].
    #[arg(long = "broker", value_name = "HOST:PORT", value_delimiter = ',')]
    pub broker: Vec<String>,
    /// Give up waiting for ACKs and deliveries this many seconds after producing ended.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub drain_timeout_secs: u64,
    /// Print a JSON report instead of the table.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// TLS and token.
    #[command(flatten)]
    pub security: ClientSecurityArgs,
}

/// Arguments of `bmqctl bench metadata`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Example:\n  bmqctl bench metadata --queues 500 --parallel 8")]
pub struct MetadataArgs {
    /// Domain of the new queues.
    #[arg(long, default_value = "bmq.test")]
    pub domain: String,
    /// Number of new queues to open (each needs one committed assignment).
    #[arg(long, default_value_t = 200)]
    pub queues: usize,
    /// Opens in flight at once (one client connection each).
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Client address of a broker, host:port; repeat or separate with commas
    /// [default: $BMQ_BROKERS, else the local cluster].
    #[arg(long = "broker", value_name = "HOST:PORT", value_delimiter = ',')]
    pub broker: Vec<String>,
    /// Per-open timeout, seconds.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub timeout_secs: u64,
    /// Admin HTTP address (host:port) of the leader, to report its commit latency and the
    /// queues assigned before the run; repeat or separate with commas (only the leader
    /// commits, so the nodes' histograms add up).
    #[arg(long = "admin", value_name = "HOST:PORT", value_delimiter = ',')]
    pub admin: Vec<String>,
    /// Print a JSON report instead of the table.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// TLS and token.
    #[command(flatten)]
    pub security: ClientSecurityArgs,
}

/// The leader's view of a `bmqctl bench metadata` run (`--admin`), from its `/metrics`.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct LeaderCommits {
    /// Queues assigned in the cluster before the run (`bmq_cluster_queues`, the largest of
    /// the nodes asked).
    pub queues_before: u64,
    /// Advisories committed during the run (`bmq_metadata_commit_latency_seconds_count`).
    pub commits: u64,
    /// Upper bounds (microseconds) of the histogram buckets holding the 50th, 90th and 99th
    /// percentile of the commit latency (propose -> quorum commit on the leader); the
    /// buckets are 0.1, 0.25, 0.5, 1, 2.5, 5, 10 ... ms, so these are bounds, not values.
    pub p50_le_us: u64,
    /// See `p50_le_us`.
    pub p90_le_us: u64,
    /// See `p50_le_us`.
    pub p99_le_us: u64,
}

/// The commit latency buckets and queue count read from one `/metrics` page.
#[derive(Debug, Clone, Default, PartialEq)]
struct MetricsSample {
    /// `(le in seconds, cumulative count)`, `+Inf` as `f64::INFINITY`.
    buckets: Vec<(f64, u64)>,
    queues: u64,
}

/// Reads `bmq_metadata_commit_latency_seconds_bucket` and `bmq_cluster_queues` from a
/// Prometheus text page (other lines are ignored).
fn parse_metrics(text: &str) -> MetricsSample {
    let mut sample = MetricsSample::default();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("bmq_metadata_commit_latency_seconds_bucket{le=\"") {
            let Some((le, count)) = rest.split_once("\"} ") else {
                continue;
            };
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::NAN)
            };
            if let (false, Ok(count)) = (le.is_nan(), count.trim().parse::<f64>()) {
                sample.buckets.push((le, count as u64));
            }
        } else if let Some(rest) = line.strip_prefix("bmq_cluster_queues ") {
            sample.queues = rest.trim().parse::<f64>().map_or(0, |q| q as u64);
        }
    }
    sample
}

/// Adds the samples of several nodes (same bucket bounds).
fn sum_samples(samples: &[MetricsSample]) -> MetricsSample {
    let mut total = MetricsSample::default();
    for s in samples {
        total.queues = total.queues.max(s.queues);
        for (le, count) in &s.buckets {
            match total.buckets.iter_mut().find(|(l, _)| l == le) {
                Some((_, c)) => *c += count,
                None => total.buckets.push((*le, *count)),
            }
        }
    }
    total
        .buckets
        .sort_by(|a, b| a.0.partial_cmp(&b.0).expect("no NaN bounds"));
    total
}

/// The run's commits from two cumulative samples (see [`LeaderCommits`]).
fn leader_commits(before: &MetricsSample, after: &MetricsSample) -> LeaderCommits {
    let delta: Vec<(f64, u64)> = after
        .buckets
        .iter()
        .map(|(le, count)| {
            let was = before
                .buckets
                .iter()
                .find(|(l, _)| l == le)
                .map_or(0, |(_, c)| *c);
            (*le, count.saturating_sub(was))
        })
        .collect();
    let commits = delta.last().map_or(0, |(_, c)| *c);
    let bound = |q: f64| -> u64 {
        let rank = (q * commits as f64).ceil() as u64;
        delta
            .iter()
            .find(|(_, c)| *c >= rank.max(1))
            .map_or(0, |(le, _)| {
                if le.is_finite() {
                    (le * 1e6).round() as u64
                } else {
                    u64::MAX
                }
            })
    };
    LeaderCommits {
        queues_before: before.queues,
        commits,
        p50_le_us: if commits == 0 { 0 } else { bound(0.50) },
        p90_le_us: if commits == 0 { 0 } else { bound(0.90) },
        p99_le_us: if commits == 0 { 0 } else { bound(0.99) },
    }
}

async fn sample_metrics(admin: &[String]) -> anyhow::Result<MetricsSample> {
    let mut samples = Vec::new();
    for addr in admin {
        let body = crate::http::get(addr, "/metrics")
            .await
            .with_context(|| format!("cannot read /metrics of {addr}"))?;
        samples.push(parse_metrics(&String::from_utf8_lossy(&body)));
    }
    Ok(sum_samples(&samples))
}

/// Latency percentiles of one histogram, microseconds.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Percentiles {
    /// Samples recorded.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 90th percentile.
    pub p90_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// 99.9th percentile.
    pub p999_us: u64,
    /// Largest sample.
    pub max_us: u64,
}

impl Percentiles {
    /// Reads the percentiles of `h` (all zero when it is empty).
    pub fn of(h: &Histogram<u64>) -> Percentiles {
        if h.is_empty() {
            return Percentiles::default();
        }
        Percentiles {
            count: h.len(),
            p50_us: h.value_at_quantile(0.50),
            p90_us: h.value_at_quantile(0.90),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            max_us: h.max(),
        }
    }
}

/// Throughput of one side (produced = ACKed with SUCCESS; consumed = received).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Throughput {
    /// Messages.
    pub messages: u64,
    /// Payload bytes.
    pub bytes: u64,
    /// Seconds from the first PUT to the last ACK (produced) or last PUSH (consumed).
    pub elapsed_secs: f64,
    /// `messages / elapsed_secs`.
    pub msgs_per_sec: f64,
    /// `bytes / elapsed_secs / 10^6`.
    pub mb_per_sec: f64,
}

impl Throughput {
    fn new(messages: u64, bytes: u64, elapsed: Duration) -> Throughput {
        let secs = elapsed.as_secs_f64();
        let per_sec = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        Throughput {
            messages,
            bytes,
            elapsed_secs: secs,
            msgs_per_sec: per_sec(messages),
            mb_per_sec: per_sec(bytes) / 1e6,
        }
    }
}

/// What `bmqctl bench messages` measured.
#[derive(Debug, Clone, Serialize)]
pub struct MessagesReport {
    /// The queues used.
    pub queues: Vec<String>,
    /// Producers, consumers, size, target rate (0 = unthrottled), window.
    pub producers: usize,
    /// Consumers.
    pub consumers: usize,
    /// Payload size, bytes.
    pub size: usize,
    /// Target rate, messages per second (0 = unthrottled).
    pub rate: u64,
    /// Unacknowledged PUTs per producer at most.
    pub window: usize,
    /// PUTs handed to the client library.
    pub sent: u64,
    /// ACKed with SUCCESS.
    pub produced: Throughput,
    /// Received by the consumers (redeliveries included).
    pub consumed: Throughput,
    /// PUT -> ACK, microseconds.
    pub ack_latency: Percentiles,
    /// The longest time between two consecutive ACKs of one producer, milliseconds (ACKs
    /// arrive in PUT order): what a paced producer notices of a failover or a membership
    /// change. 0 with fewer than two ACKs.
    pub ack_gap_max_ms: f64,
    /// PUT -> PUSH at a consumer, microseconds.
    pub e2e_latency: Percentiles,
    /// NACKs by status name.
    pub nacks: BTreeMap<String, u64>,
    /// PUTs the client library failed (disconnected, not open) and payloads that did not parse.
    pub errors: u64,
    /// Deliveries with `delivery_attempt > 1`.
    pub redeliveries: u64,
    /// ACKed messages not consumed before the drain timeout (0 when consumers = 0 is not the
    /// case and all arrived).
    pub missing: u64,
}

/// What `bmqctl bench metadata` measured.
#[derive(Debug, Clone, Serialize)]
pub struct MetadataReport {
    /// Queues opened successfully (each a committed assignment).
    pub opened: u64,
    /// Opens that failed.
    pub errors: u64,
    /// Opens in flight at once.
    pub parallel: usize,
    /// Seconds for all opens.
    pub elapsed_secs: f64,
    /// `opened / elapsed_secs`.
    pub assignments_per_sec: f64,
    /// Open latency of a new queue, microseconds.
    pub open_latency: Percentiles,
    /// The leader's commits during the run (with `--admin`).
    pub leader: Option<LeaderCommits>,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, LATENCY_MAX_US, 3).expect("valid histogram bounds")
}

fn record(h: &mut Histogram<u64>, d: Duration) {
    let us = (d.as_micros() as u64).clamp(1, LATENCY_MAX_US);
    h.record(us).expect("value within the histogram's bounds");
}

/// A payload of `size` bytes carrying `sent` (nanoseconds since the run's start).
fn encode(filler: &[u8], sent: Duration) -> Bytes {
    let mut b = BytesMut::with_capacity(filler.len());
    b.put_slice(MAGIC);
    b.put_u64(sent.as_nanos() as u64);
    b.put_slice(&filler[BENCH_HEADER_LEN..]);
    b.freeze()
}

/// The send time of a benchmark payload, or `None` if it is not one.
fn decode(payload: &[u8]) -> Option<Duration> {
    if payload.len() < BENCH_HEADER_LEN || &payload[..4] != MAGIC {
        return None;
    }
    let nanos = u64::from_be_bytes(payload[4..12].try_into().ok()?);
    Some(Duration::from_nanos(nanos))
}

fn progress(quiet: bool, len: u64, unit: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(len),
        if quiet {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        },
    );
    let template = format!("{{elapsed_precise}} [{{bar:40}}] {{pos}}/{{len}} {unit} {{msg}}");
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Runs a `bmqctl bench` subcommand and prints its report.
pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Messages(args) => {
            let json = args.json;
            let report = run_messages(args).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print_messages(&report);
            }
            if report.missing > 0 {
                bail!(
                    "{} acknowledged messages were not consumed before the drain timeout",
                    report.missing
                );
            }
        }
        BenchCommand::Metadata(args) => {
            let json = args.json;
            let report = run_metadata(args).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print_metadata(&report);
            }
            if report.errors > 0 {
                bail!("{} queue opens failed", report.errors);
            }
        }
        BenchCommand::FirstOpen(args) => {
            let json = args.json;
            let report = crate::bench_first_open::run(args).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                crate::bench_first_open::print(&report);
            }
        }
    }
    Ok(())
}

/// Counters shared by the producer, collector and consumer tasks.
#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    acked: AtomicU64,
    acked_bytes: AtomicU64,
    errors: AtomicU64,
    received: AtomicU64,
    received_bytes: AtomicU64,
    redeliveries: AtomicU64,
    /// Nanoseconds since the start of the last ACK / PUSH.
    last_ack_ns: AtomicU64,
    last_push_ns: AtomicU64,
}

/// Runs `bmqctl bench messages` (see the module doc) and returns its report.
///
/// Errors: bad arguments, no broker reachable, a queue refused.
pub async fn run_messages(args: MessagesArgs) -> anyhow::Result<MessagesReport> {
    if args.size < BENCH_HEADER_LEN {
        bail!("--size must be at least {BENCH_HEADER_LEN} bytes");
    }
    if args.queues == 0 || args.producers == 0 || args.window == 0 {
        bail!("--queues, --producers and --window must be at least 1");
    }
    if args.consumers > 0 && args.consumers < args.queues {
        bail!(
            "--consumers {} must be 0 or at least --queues {}",
            args.consumers,
            args.queues
        );
    }
    if args.max_unconfirmed == 0 {
        bail!("--max-unconfirmed must be at least 1");
    }
    let run_id: u32 = args.run_id.unwrap_or_else(rand::random);
    let queues: Vec<String> = (0..args.queues)
        .map(|i| {
            format!(
                "bmq://{}/{}-{run_id:08x}-{i}",
                args.domain, args.queue_prefix
            )
        })
        .collect();
    for q in &queues {
        QueueUri::parse(q).with_context(|| format!("bad queue name {q}"))?;
    }
    let brokers = resolve_brokers(&args.broker);
    let drain = Duration::from_secs(args.drain_timeout_secs.max(1));
    let counters = Arc::new(Counters::default());

    // Every client runs on a thread of its own (`on_own_thread`). Consumers first, so no
    // message waits for its consumer to attach; nothing is sent before every client is ready.
    let (go_tx, go_rx) = watch::channel(None::<Instant>);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut consumers = Vec::new();
    for j in 0..args.consumers {
        let (brokers, security) = (brokers.clone(), args.security.clone());
        let uri = queues[j % queues.len()].clone();
        let options = ConsumerOptions {
            max_unconfirmed_messages: args.max_unconfirmed,
            ..Default::default()
        };
        let (counters, go, stop) = (counters.clone(), go_rx.clone(), stop_rx.clone());
        let (ready, thread) =
            on_own_thread(format!("bench-consumer-{j}"), move |ready| async move {
                let client = connect(brokers, 1, drain, "bench-consumer", &security).await?;
                client
                    .open_queue(&uri, OpenOptions::read(options))
                    .await
                    .with_context(|| format!("cannot open {uri} for reading"))?;
                let _ = ready.send(());
                let Some(start) = wait_for_start(go).await else {
                    let _ = client.disconnect().await;
                    return Ok(histogram());
                };
                Ok(consume(client, start, counters, stop).await)
            })?;
        client_ready(ready, &mut consumers, thread).await?;
    }

    let (bar, target) = match args.duration_secs {
        Some(secs) => (progress(args.quiet, secs, "s"), None),
        None => (progress(args.quiet, args.count, "acked"), Some(args.count)),
    };
    let filler = vec![0x5a_u8; args.size];
    let mut producers = Vec::new();
    let (producer_count, rate) = (args.producers, args.rate as f64);
    let duration = args.duration_secs.map(Duration::from_secs);
    for i in 0..args.producers {
        let (brokers, security) = (brokers.clone(), args.security.clone());
        let (uri, filler, window) = (
            queues[i % queues.len()].clone(),
            filler.clone(),
            args.window,
        );
        let (counters, go) = (counters.clone(), go_rx.clone());
        let (ready, thread) =
            on_own_thread(format!("bench-producer-{i}"), move |ready| async move {
                let client = connect(brokers, window, drain, "bench-producer", &security).await?;
                client
                    .open_queue(&uri, OpenOptions::write())
                    .await
                    .with_context(|| format!("cannot open {uri} for writing"))?;
                let _ = ready.send(());
                let Some(start) = wait_for_start(go).await else {
                    let _ = client.disconnect().await;
                    return Ok((histogram(), BTreeMap::new(), Duration::ZERO));
                };
                let run =
                    ProducerRun::new(i, producer_count, target, duration, rate, window, start);
                produce(client, uri, filler, run, counters).await
            })?;
        client_ready(ready, &mut producers, thread).await?;
    }
    let start = Instant::now();
    let _ = go_tx.send(Some(start));

    // Progress: ACKed messages (count mode) or seconds (duration mode).
    let ticker = {
        let counters = counters.clone();
        let bar = bar.clone();
        let by_time = args.duration_secs.is_some();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                let acked = counters.acked.load(Ordering::Relaxed);
                let received = counters.received.load(Ordering::Relaxed);
                let secs = start.elapsed().as_secs_f64().max(1e-3);
                if by_time {
                    bar.set_position(start.elapsed().as_secs());
                } else {
                    bar.set_position(acked);
                }
                bar.set_message(format!(
                    "acked {acked} ({:.0}/s), consumed {received} ({:.0}/s)",
                    acked as f64 / secs,
                    received as f64 / secs
                ));
            }
        })
    };

    let mut ack_hist = histogram();
    let mut nacks: BTreeMap<String, u64> = BTreeMap::new();
    let mut ack_gap_max = Duration::ZERO;
    for p in producers {
        let (h, n, gap) = finished(p).await?;
        ack_gap_max = ack_gap_max.max(gap);
        ack_hist.add(&h).expect("same histogram bounds");
        for (k, v) in n {
            *nacks.entry(k).or_default() += v;
        }
    }
    let acked = counters.acked.load(Ordering::Relaxed);

    // Wait for the consumers to receive every ACKed message, up to the drain timeout.
    let drain_deadline = Instant::now() + drain;
    if args.consumers > 0 {
        while counters.received.load(Ordering::Relaxed)
            - counters.redeliveries.load(Ordering::Relaxed)
            < acked
            && Instant::now() < drain_deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    ticker.abort();
    bar.finish_and_clear();
    let _ = stop_tx.send(true);
    let mut e2e = histogram();
    for c in consumers {
        e2e.add(&finished(c).await?).expect("same histogram bounds");
    }

    let ns = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
    let received = counters.received.load(Ordering::Relaxed);
    let first_deliveries = received - counters.redeliveries.load(Ordering::Relaxed);
    Ok(MessagesReport {
        queues,
        producers: args.producers,
        consumers: args.consumers,
        size: args.size,
        rate: args.rate,
        window: args.window,
        sent: counters.sent.load(Ordering::Relaxed),
        produced: Throughput::new(
            acked,
            counters.acked_bytes.load(Ordering::Relaxed),
            ns(&counters.last_ack_ns),
        ),
        consumed: Throughput::new(
            received,
            counters.received_bytes.load(Ordering::Relaxed),
            ns(&counters.last_push_ns),
        ),
        ack_latency: Percentiles::of(&ack_hist),
        ack_gap_max_ms: ack_gap_max.as_secs_f64() * 1e3,
        e2e_latency: Percentiles::of(&e2e),
        nacks,
        errors: counters.errors.load(Ordering::Relaxed),
        redeliveries: counters.redeliveries.load(Ordering::Relaxed),
        missing: if args.consumers > 0 {
            acked.saturating_sub(first_deliveries)
        } else {
            0
        },
    })
}

/// What one benchmark producer sends (`bench messages`, and scripts/peer-probe for every system
/// it drives).
#[derive(Debug, Clone, Copy)]
pub struct ProducerRun {
    /// Messages to send; `None`: until `deadline`.
    pub share: Option<u64>,
    /// When to stop, for a run of a set duration.
    pub deadline: Option<Instant>,
    /// Messages per second; 0: unpaced.
    pub rate: f64,
    /// Most unacknowledged PUTs.
    pub window: usize,
    /// The run's start, from which send times and pacing count.
    pub start: Instant,
}

impl ProducerRun {
    /// Producer `i` of `producers` (at least 1) in a run that starts at `start`: its share of
    /// `count` messages in all (the first producers take the remainder), or with `count` `None`
    /// until `duration` has passed; paced at its share of `rate` messages per second, all
    /// producers together (0: unpaced); at most `window` unacknowledged.
    pub fn new(
        i: usize,
        producers: usize,
        count: Option<u64>,
        duration: Option<Duration>,
        rate: f64,
        window: usize,
        start: Instant,
    ) -> Self {
        let n = producers.max(1) as u64;
        ProducerRun {
            share: count.map(|c| c / n + u64::from((i as u64) < c % n)),
            deadline: duration.map(|d| start + d),
            rate: rate / n as f64,
            window,
            start,
        }
    }
}

/// One producer: sends what `run` says; a collector task awaits the ACKs in order and records
/// their latency. Returns the ACK latency histogram, the NACKs by status and the longest time
/// between two consecutive ACKs.
async fn produce(
    client: Client,
    uri: String,
    filler: Vec<u8>,
    run: ProducerRun,
    counters: Arc<Counters>,
) -> anyhow::Result<(Histogram<u64>, BTreeMap<String, u64>, Duration)> {
    let ProducerRun {
        share,
        deadline,
        rate,
        window,
        start,
    } = run;
    let size = filler.len() as u64;
    let (tx, mut rx) = mpsc::channel::<(Instant, PendingAck)>(window);
    let collector = {
        let counters = counters.clone();
        tokio::spawn(async move {
            let mut h = histogram();
            let mut nacks: BTreeMap<String, u64> = BTreeMap::new();
            let (mut last_ack, mut gap_max) = (None::<Instant>, Duration::ZERO);
            while let Some((sent_at, pending)) = rx.recv().await {
                match pending.await {
                    Ok(ack) if ack.status() == AckStatus::Success => {
                        let now = Instant::now();
                        if let Some(last) = last_ack {
                            gap_max = gap_max.max(now - last);
                        }
                        last_ack = Some(now);
                        record(&mut h, sent_at.elapsed());
                        counters.acked.fetch_add(1, Ordering::Relaxed);
                        counters.acked_bytes.fetch_add(size, Ordering::Relaxed);
                        counters
                            .last_ack_ns
                            .fetch_max(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    }
                    Ok(ack) => {
                        *nacks
                            .entry(ack.status().as_str_name().to_string())
                            .or_default() += 1
                    }
                    Err(_) => {
                        counters.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            (h, nacks, gap_max)
        })
    };
    let mut n: u64 = 0;
    loop {
        if share.is_some_and(|s| n >= s) || deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        if rate > 0.0 {
            let due = start + Duration::from_secs_f64(n as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let now = Instant::now();
        let body = encode(&filler, now - start);
        match client.put(&uri, body, vec![]).await {
            Ok(pending) => {
                counters.sent.fetch_add(1, Ordering::Relaxed);
                if tx.send((now, pending)).await.is_err() {
                    break;
                }
            }
            Err(e) => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "bench put failed");
                break;
            }
        }
        n += 1;
    }
    drop(tx);
    let result = collector.await.context("ack collector panicked")?;
    let _ = client.disconnect().await;
    Ok(result)
}

/// One consumer: records end-to-end latency and confirms every message until `stop` turns
/// true, then disconnects and returns its end-to-end latency histogram.
async fn consume(
    client: Client,
    start: Instant,
    counters: Arc<Counters>,
    mut stop: watch::Receiver<bool>,
) -> Histogram<u64> {
    let mut local = histogram();
    loop {
        let message = tokio::select! {
            m = client.next_message() => match m {
                Some(m) => m,
                None => break,
            },
            _ = stop.changed() => break,
        };
        let now = start.elapsed();
        match decode(&message.payload) {
            Some(sent) => record(&mut local, now.saturating_sub(sent)),
            None => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        counters.received.fetch_add(1, Ordering::Relaxed);
        counters
            .received_bytes
            .fetch_add(message.payload.len() as u64, Ordering::Relaxed);
        if message.delivery_attempt > 1 {
            counters.redeliveries.fetch_add(1, Ordering::Relaxed);
        }
        counters
            .last_push_ns
            .fetch_max(now.as_nanos() as u64, Ordering::Relaxed);
        let _ = client.confirm(&message.uri, message.guid).await;
    }
    let _ = client.disconnect().await;
    local
}

/// Runs `bmqctl bench metadata` (see the module doc) and returns its report.
///
/// Errors: bad arguments, no broker reachable.
pub async fn run_metadata(args: MetadataArgs) -> anyhow::Result<MetadataReport> {
    if args.queues == 0 || args.parallel == 0 {
        bail!("--queues and --parallel must be at least 1");
    }
    let timeout = Duration::from_secs(args.timeout_secs.max(1));
    let brokers = resolve_brokers(&args.broker);
    let metrics_before = if args.admin.is_empty() {
        None
    } else {
        Some(sample_metrics(&args.admin).await?)
    };
    let run_id: u32 = rand::random();
    let next = Arc::new(AtomicU64::new(0));
    let bar = progress(args.quiet, args.queues as u64, "queues");
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.parallel {
        let client = connect(
            brokers.clone(),
            1,
            timeout,
            "bench-metadata",
            &args.security,
        )
        .await?;
        let next = next.clone();
        let bar = bar.clone();
        let domain = args.domain.clone();
        let total = args.queues as u64;
        workers.push(tokio::spawn(async move {
            let mut h = histogram();
            let mut errors = 0u64;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let uri = format!("bmq://{domain}/meta-{run_id:08x}-{i}");
                let t = Instant::now();
                match tokio::time::timeout(timeout, client.open_queue(&uri, OpenOptions::write()))
                    .await
                {
                    Ok(Ok(())) => {
                        record(&mut h, t.elapsed());
                        // Close it so the benchmark leaves no writers attached.
                        let _ = client.close_queue(&uri).await;
                    }
                    Ok(Err(e)) => {
                        errors += 1;
                        tracing::warn!(queue = %uri, error = %e, "open failed");
                    }
                    Err(_) => {
                        errors += 1;
                        tracing::warn!(queue = %uri, "open timed out");
                    }
                }
                bar.inc(1);
            }
            let _ = client.disconnect().await;
            (h, errors)
        }));
    }
    let mut h = histogram();
    let mut errors = 0;
    for w in workers {
        let (wh, we) = w.await.context("metadata bench worker panicked")?;
        h.add(&wh).expect("same histogram bounds");
        errors += we;
    }
    let elapsed = start.elapsed();
    bar.finish_and_clear();
    let opened = h.len();
    let leader = match metrics_before {
        Some(before) => Some(leader_commits(&before, &sample_metrics(&args.admin).await?)),
        None => None,
    };
    Ok(MetadataReport {
        leader,
        opened,
        errors,
        parallel: args.parallel,
        elapsed_secs: elapsed.as_secs_f64(),
        assignments_per_sec: if elapsed.is_zero() {
            0.0
        } else {
            opened as f64 / elapsed.as_secs_f64()
        },
        open_latency: Percentiles::of(&h),
    })
}

fn ms(us: u64) -> String {
    format!("{:.3}", us as f64 / 1000.0)
}

fn latency_row(name: &str, p: &Percentiles) -> String {
    format!(
        "{name:<14} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
        ms(p.p50_us),
        ms(p.p90_us),
        ms(p.p99_us),
        ms(p.p999_us),
        ms(p.max_us),
        p.count
    )
}

/// The header of the latency rows ([`latency_row`]).
fn latency_header() -> String {
    let columns = ["p50", "p90", "p99", "p99.9", "max"].map(|c| format!("{c:>9}"));
    format!(
        "{:<14} {} {:>10}",
        "latency (ms)",
        columns.join(" "),
        "samples"
    )
}

fn print_messages(r: &MessagesReport) {
    outln!(
        "bench: {} producer(s), {} consumer(s), {} queue(s), {} B messages, rate {}, window {}",
        r.producers,
        r.consumers,
        r.queues.len(),
        r.size,
        if r.rate == 0 {
            "unthrottled".to_string()
        } else {
            format!("{} msg/s", r.rate)
        },
        r.window
    );
    outln!(
        "{:<14} {:>12} {:>12} {:>10} {:>10}",
        "",
        "messages",
        "msgs/s",
        "MB/s",
        "seconds"
    );
    for (name, t) in [("produced", &r.produced), ("consumed", &r.consumed)] {
        outln!(
            "{name:<14} {:>12} {:>12.0} {:>10.2} {:>10.2}",
            t.messages,
            t.msgs_per_sec,
            t.mb_per_sec,
            t.elapsed_secs
        );
    }
    outln!("{}", latency_header());
    outln!("{}", latency_row("ack", &r.ack_latency));
    outln!("{}", latency_row("end-to-end", &r.e2e_latency));
    outln!("longest gap between two ACKs: {:.1} ms", r.ack_gap_max_ms);
    let nacks: u64 = r.nacks.values().sum();
    outln!(
        "sent {}, nacks {} {:?}, errors {}, redeliveries {}, missing {}",
        r.sent,
        nacks,
        r.nacks,
        r.errors,
        r.redeliveries,
        r.missing
    );
}

fn print_metadata(r: &MetadataReport) {
    outln!(
        "metadata bench: {} queue assignments committed in {:.2} s ({:.1}/s), {} in parallel, {} errors",
        r.opened, r.elapsed_secs, r.assignments_per_sec, r.parallel, r.errors
    );
    outln!("{}", latency_header());
    outln!("{}", latency_row("open (commit)", &r.open_latency));
    if let Some(l) = &r.leader {
        let le = |us: u64| {
            if us == u64::MAX {
                "> 10 s".to_string()
            } else {
                format!("<= {}", ms(us))
            }
        };
        outln!(
            "leader: {} queues assigned before the run; {} commits, commit latency (ms) p50 {}, p90 {}, p99 {}",
            l.queues_before,
            l.commits,
            le(l.p50_le_us),
            le(l.p90_le_us),
            le(l.p99_le_us)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn producer_runs_split_the_count_and_the_rate() {
        // 10 messages over 3 producers: 4, 3, 3 (the first take the remainder); 900 msgs/s
        // in all, 300 each; no deadline without a duration, no share with one.
        let start = Instant::now();
        let runs: Vec<ProducerRun> = (0..3)
            .map(|i| ProducerRun::new(i, 3, Some(10), None, 900.0, 7, start))
            .collect();
        let shares: Vec<Option<u64>> = runs.iter().map(|r| r.share).collect();
        assert_eq!(shares, [Some(4), Some(3), Some(3)]);
        assert!(runs.iter().all(|r| r.rate == 300.0 && r.window == 7));
        assert!(runs
            .iter()
            .all(|r| r.deadline.is_none() && r.start == start));
        let timed = ProducerRun::new(2, 3, None, Some(Duration::from_secs(5)), 0.0, 7, start);
        assert_eq!(timed.share, None);
        assert_eq!(timed.deadline, Some(start + Duration::from_secs(5)));
        assert_eq!(timed.rate, 0.0);
    }

    #[test]
    fn leader_commit_latency_comes_from_the_bucket_deltas() {
        // Scenario: --admin reads the leader's histogram before and after a run; the run's
        // percentiles are the bounds of the buckets of the difference.
        let page = |counts: [u64; 4], queues: u64| {
            format!(
                "# TYPE bmq_metadata_commit_latency_seconds histogram\n\
                 bmq_metadata_commit_latency_seconds_bucket{{le=\"0.00025\"}} {}\n\
                 bmq_metadata_commit_latency_seconds_bucket{{le=\"0.0005\"}} {}\n\
                 bmq_metadata_commit_latency_seconds_bucket{{le=\"0.001\"}} {}\n\
                 bmq_metadata_commit_latency_seconds_bucket{{le=\"+Inf\"}} {}\n\
                 bmq_metadata_commit_latency_seconds_count {}\n\
                 bmq_cluster_queues {queues}\n",
                counts[0], counts[1], counts[2], counts[3], counts[3]
            )
        };
        let before = parse_metrics(&page([1, 2, 3, 10], 100));
        assert_eq!(before.queues, 100);
        assert_eq!(before.buckets.len(), 4);
        // 100 commits in the run: 10 <= 0.25 ms, 50 more <= 0.5 ms, 35 more <= 1 ms, 5 above.
        let after = parse_metrics(&page([11, 62, 98, 110], 200));
        let l = leader_commits(&before, &after);
        assert_eq!(
            l,
            LeaderCommits {
                queues_before: 100,
                commits: 100,
                p50_le_us: 500,
                p90_le_us: 1000,
                p99_le_us: u64::MAX,
            }
        );
        // Two nodes: only the leader committed; the follower's zeros add nothing.
        let follower = parse_metrics(&page([0, 0, 0, 0], 100));
        assert_eq!(
            leader_commits(
                &sum_samples(&[before.clone(), follower.clone()]),
                &sum_samples(&[after, follower])
            ),
            l
        );
        // Nothing committed: all zero.
        assert_eq!(leader_commits(&before, &before).commits, 0);
        assert_eq!(parse_metrics("garbage\n{le=}\n"), MetricsSample::default());
    }

    #[test]
    fn payload_round_trip_and_rejects() {
        // A benchmark payload carries its send time; other payloads are rejected.
        let filler = vec![0u8; 64];
        let body = encode(&filler, Duration::from_micros(1234));
        assert_eq!(body.len(), 64);
        assert_eq!(decode(&body), Some(Duration::from_micros(1234)));
        assert_eq!(decode(b"BMQB"), None);
        assert_eq!(decode(&[0u8; 64]), None);
    }

    #[test]
    fn percentiles_of_known_samples() {
        // Percentiles of 1..=1000 microseconds are read off the histogram.
        let mut h = histogram();
        for us in 1..=1000u64 {
            h.record(us).unwrap();
        }
        let p = Percentiles::of(&h);
        assert_eq!(p.count, 1000);
        assert_eq!(p.p50_us, 500);
        assert_eq!(p.p99_us, 990);
        assert_eq!(p.max_us, 1000);
        assert_eq!(Percentiles::of(&histogram()), Percentiles::default());
    }

    #[test]
    fn throughput_rates() {
        // Rates divide by the elapsed time; zero time gives zero rates, not infinities.
        let t = Throughput::new(1000, 1_000_000, Duration::from_secs(2));
        assert_eq!((t.msgs_per_sec, t.mb_per_sec), (500.0, 0.5));
        let z = Throughput::new(5, 5, Duration::ZERO);
        assert_eq!((z.msgs_per_sec, z.mb_per_sec), (0.0, 0.0));
    }
}
