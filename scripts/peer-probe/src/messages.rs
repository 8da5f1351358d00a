//! The message workload: P producers and C consumers on `--queues` Q fresh queues (ours) or
//! subjects of one fresh stream (NATS), each client with its own connection on a thread of its
//! own (a current-thread runtime, as `bmqctl bench messages` runs its clients). Producer `i`
//! dials node `i % N` first, consumer `j` node `(j + 1) % N`, so with 1/1 the producer and the
//! consumer sit on different nodes of either system.
//!
//! Queues are spread over the clients by [`assigned`]: with Q at least the clients, client `k`
//! of `n` takes queues `k, k + n, k + 2n, ..`; with fewer queues, client `k` takes queue
//! `k % Q`. So every queue has at least one producer and one consumer, and with Q >= C exactly
//! one consumer. A producer sends to its queues in turn. Ours: queue `q` is
//! `bmq://<domain>/peer-<run>-<q>`, every consumer opens its queues on its one connection.
//! NATS: one stream `PEER_<run>` on the subjects `peer.<run>.*`, queue `q` is the subject
//! `peer.<run>.<q>` with its own durable pull consumer `probe-<q>` filtered on it (a consumer
//! is what holds a queue's delivery state, as our queue does); a NATS client binds to all of its
//! queues' consumers and merges their messages. One stream with a subject per queue, not a
//! stream per queue: our queues share the cluster's 4 partitions (one replicated journal each),
//! as NATS subjects share one stream's Raft group; 10,000 R3 streams would be 10,000 Raft
//! groups more, which is not how NATS is meant to carry many small queues.
//!
//! Each producer sends payloads of `--size` bytes (its send time inside), unpaced or at
//! `--rate` messages per second in total, for `--count` messages in total or `--duration-secs`;
//! at most `--window` PUTs per producer are unacknowledged at once (the window is this module's
//! semaphore, the same for both systems). ACK latency = PUT handed to the client library -> ACK
//! future completed (each ACK is timed when it completes, not in sending order); end-to-end =
//! send time -> message received by a consumer (one process, one monotonic clock). Consumers
//! acknowledge every message. Throughput = messages received / (last receipt - start).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use async_nats::jetstream;
use bmqctl::bench::ProducerRun;
use bmqctl::client_thread::{client_ready, finished, on_own_thread, wait_for_start};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch, Semaphore};

use crate::measure::{self, Percentiles};
use crate::systems::{self, Consumer, Producer, System};

/// Arguments of `peer-probe messages`.
#[derive(Debug, Clone, clap::Args)]
pub struct MessagesArgs {
    /// The system to drive (bmq or nats).
    #[arg(long, value_enum)]
    pub system: System,
    /// Client addresses of the nodes, host:port, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub servers: Vec<String>,
    /// A name for this run in the report (the same workload has the same label on every
    /// system).
    #[arg(long, default_value = "messages")]
    pub label: String,
    /// Producers (one connection each).
    #[arg(long, default_value_t = 1)]
    pub producers: usize,
    /// Consumers (one connection each); 0 = produce only.
    #[arg(long, default_value_t = 1)]
    pub consumers: usize,
    /// Queues (ours) or subjects of the stream, each with its own consumer (NATS); the clients
    /// are spread over them (see the module's doc).
    #[arg(long, default_value_t = 1)]
    pub queues: usize,
    /// Payload size, bytes (at least 12).
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Messages in total, shared among the producers (ignored with --duration-secs).
    #[arg(long, default_value_t = 100_000)]
    pub count: u64,
    /// Produce for this many seconds instead of --count messages.
    #[arg(long)]
    pub duration_secs: Option<u64>,
    /// Messages per second, all producers together; 0 = unpaced.
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// Most unacknowledged PUTs per producer.
    #[arg(long, default_value_t = 256)]
    pub window: usize,
    /// Most delivered-but-unacknowledged messages per consumer (ours:
    /// max_unconfirmed_messages; NATS: the consumer's max_ack_pending, shared by its pullers).
    #[arg(long, default_value_t = 1000)]
    pub max_unconfirmed: u32,
    /// Domain of our queue (bmq.test is strong consistency).
    #[arg(long, default_value = "bmq.test")]
    pub domain: String,
    /// NATS stream replicas.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// NATS API request and publish-ACK timeout, seconds.
    #[arg(long, default_value_t = 10)]
    pub nats_timeout_secs: u64,
    /// NATS API request timeout while the stream and its consumers are made and bound,
    /// seconds (10,000 consumers of R3 are created at about 60 per second on 2 busy cores: a
    /// request queued behind 63 others can wait more than 10 s).
    #[arg(long, default_value_t = 120)]
    pub nats_setup_timeout_secs: u64,
    /// Give up waiting for deliveries this many seconds after producing ended.
    #[arg(long, default_value_t = 60)]
    pub drain_timeout_secs: u64,
}

/// What one message run measured (one JSON line of the results file).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MessagesResult {
    /// Always `"messages"`.
    pub kind: String,
    /// The system driven.
    pub system: System,
    /// The run's label.
    pub label: String,
    /// Producers.
    pub producers: usize,
    /// Consumers.
    pub consumers: usize,
    /// Queues (ours) or subjects with a consumer each (NATS).
    #[serde(default = "one")]
    pub queues: usize,
    /// Queues of which at least one message was received (all of them when every queue
    /// delivered).
    #[serde(default)]
    pub queues_delivered: usize,
    /// Payload size, bytes.
    pub size: usize,
    /// Window per producer.
    pub window: usize,
    /// Target rate, msgs/s (0 = unpaced).
    pub rate: u64,
    /// PUTs handed to the client library.
    pub sent: u64,
    /// ACKed.
    pub acked: u64,
    /// Failed PUTs (NACK, timeout, lost connection) and unparsable payloads.
    pub errors: u64,
    /// Messages received (redeliveries included).
    pub received: u64,
    /// Receipts of messages delivered before, as the system flagged them.
    pub redeliveries: u64,
    /// Receipts of a message (by its GUID or stream sequence) this run received before,
    /// flagged or not; `received - duplicates` messages were received at least once.
    #[serde(default)]
    pub duplicates: u64,
    /// ACKed messages never received before the drain timeout: ACKed minus the distinct
    /// messages received (a message stored but never ACKed, a NATS publish that timed out,
    /// can make up for one).
    pub missing: u64,
    /// ACKed messages per second (first PUT -> last ACK).
    pub produced_per_sec: f64,
    /// Received messages per second (first PUT -> last receipt).
    pub consumed_per_sec: f64,
    /// PUT -> ACK.
    pub ack: Percentiles,
    /// Send -> receipt.
    pub e2e: Percentiles,
    /// `/proc/loadavg` (1-minute) before and after the run.
    pub loadavg: (f64, f64),
}

/// NATS consumers created at once (fewer than our opens in flight: 64 made its meta group
/// answer 503 from about 3,500 consumers on).
const NATS_CREATES_IN_FLIGHT: usize = 16;

/// Tries of each NATS consumer creation before the run fails.
const NATS_CREATE_ATTEMPTS: u32 = 30;

fn one() -> usize {
    1
}

/// The queues (indices `0..queues`) client `k` of `clients` serves: every `clients`-th queue
/// from `k` when there are at least as many queues as clients, else queue `k % queues` alone.
pub fn assigned(k: usize, clients: usize, queues: usize) -> Vec<usize> {
    assert!(
        clients > 0 && queues > 0 && k < clients,
        "bad assignment input"
    );
    if queues >= clients {
        (k..queues).step_by(clients).collect()
    } else {
        vec![k % queues]
    }
}

/// The queue index at the end of a queue URI (`..-<q>`) or subject (`...<q>`).
fn queue_index(queue: &str) -> Option<usize> {
    queue.rsplit(['-', '.']).next()?.parse().ok()
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    acked: AtomicU64,
    errors: AtomicU64,
    received: AtomicU64,
    redeliveries: AtomicU64,
    last_ack_ns: AtomicU64,
    last_receipt_ns: AtomicU64,
}

/// Runs the message workload against `args.system` and returns what it measured.
///
/// Errors: bad arguments, no node reachable, the queue or stream refused.
pub async fn run(args: MessagesArgs) -> anyhow::Result<MessagesResult> {
    if args.size < measure::HEADER_LEN {
        bail!("--size must be at least {} bytes", measure::HEADER_LEN);
    }
    if args.producers == 0 || args.window == 0 || args.max_unconfirmed == 0 || args.queues == 0 {
        bail!("--producers, --queues, --window and --max-unconfirmed must be at least 1");
    }
    let loadavg_start = crate::loadavg();
    let run_id: u32 = rand::random();
    let timeout = Duration::from_secs(args.nats_timeout_secs.max(1));
    let setup_timeout = Duration::from_secs(args.nats_setup_timeout_secs.max(1));
    let drain = Duration::from_secs(args.drain_timeout_secs.max(1));
    let servers = &args.servers;

    // The queue or stream, and the consumers first so no message waits for its consumer.
    let queues = args.queues;
    let domain = args.domain.clone();
    let uri = move |q: usize| format!("bmq://{domain}/peer-{run_id:08x}-{q}");
    let stream = format!("PEER_{run_id:08x}");
    let subject = move |q: usize| format!("peer.{run_id:08x}.{q}");
    let durable = |q: usize| format!("probe-{q}");
    if args.system == System::Etcd {
        bail!("etcd has no message workload (use `metadata`)");
    }
    if args.system == System::Nats {
        let admin = systems::nats_connect(servers).await?;
        let js = systems::nats_js(admin.clone(), setup_timeout);
        let all = format!("peer.{run_id:08x}.*");
        let s = systems::nats_create_stream(&js, &stream, &all, args.replicas).await?;
        let mut creations = futures::stream::iter((0..queues).map(|q| {
            let s = &s;
            let subject = subject.clone();
            async move {
                // NATS answers 503 ("JetStream system temporarily unavailable") when its meta
                // group is behind (from about 3,500 consumers of R3 on 2 busy cores): retried
                // at most NATS_CREATE_ATTEMPTS times, 1 s apart.
                let mut attempt = 1;
                loop {
                    let r = s
                        .create_consumer(jetstream::consumer::pull::Config {
                            durable_name: Some(durable(q)),
                            filter_subject: subject(q),
                            ack_policy: jetstream::consumer::AckPolicy::Explicit,
                            max_ack_pending: i64::from(args.max_unconfirmed),
                            ..Default::default()
                        })
                        .await;
                    match r {
                        Ok(_) => return Ok(attempt - 1),
                        Err(e) if attempt < NATS_CREATE_ATTEMPTS => {
                            if attempt == 1 {
                                eprintln!("peer-probe: consumer {} (retrying): {e}", durable(q));
                            }
                            attempt += 1;
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(e) => {
                            anyhow::bail!("cannot create consumer {}: {e}", durable(q))
                        }
                    }
                }
            }
        }))
        .buffer_unordered(NATS_CREATES_IN_FLIGHT);
        let mut retries = 0;
        while let Some(r) = creations.next().await {
            retries += r?;
        }
        if retries > 0 {
            eprintln!("peer-probe: {queues} NATS consumers created after {retries} retries");
        }
        drop(creations);
        let _ = admin.drain().await;
    }

    // Every client on a thread of its own, for both systems (bmqctl's `client_thread`: a
    // current-thread runtime each); nothing is sent before every client is ready.
    let counters = Arc::new(Counters::default());
    let (go_tx, go_rx) = watch::channel(None::<Instant>);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut consumer_threads = Vec::new();
    for j in 0..args.consumers {
        let (system, servers) = (args.system, systems::rotated(servers, j + 1));
        let mine = assigned(j, args.consumers, queues);
        let uris: Vec<String> = mine.iter().map(|&q| uri(q)).collect();
        let durables: Vec<String> = mine.iter().map(|&q| durable(q)).collect();
        let (stream, max_unconfirmed) = (stream.clone(), args.max_unconfirmed);
        let (counters, go, stop) = (counters.clone(), go_rx.clone(), stop_rx.clone());
        let (ready, thread) =
            on_own_thread(format!("probe-consumer-{j}"), move |ready| async move {
                let consumer = match system {
                    System::Bmq => {
                        let c = systems::bmq_connect(servers, 1, "consumer").await?;
                        Consumer::bmq_queues(c, &uris, max_unconfirmed).await?
                    }
                    _ => {
                        let c = systems::nats_connect(&servers).await?;
                        Consumer::nats(c, setup_timeout, &stream, &durables).await?
                    }
                };
                let _ = ready.send(());
                let Some(start) = wait_for_start(go).await else {
                    consumer.close().await;
                    return Ok((measure::histogram(), vec![false; queues], Vec::new()));
                };
                Ok(consume(consumer, start, counters, stop, queues).await)
            })?;
        client_ready(ready, &mut consumer_threads, thread).await?;
    }
    let filler = vec![0x5a_u8; args.size];
    let mut producer_threads = Vec::new();
    let count = args.duration_secs.is_none().then_some(args.count);
    let duration = args.duration_secs.map(Duration::from_secs);
    let (producer_count, rate) = (args.producers, args.rate as f64);
    for i in 0..args.producers {
        let (system, first) = (args.system, systems::rotated(servers, i));
        let mine = assigned(i, args.producers, queues);
        let targets: Vec<String> = match system {
            System::Bmq => mine.iter().map(|&q| uri(q)).collect(),
            _ => mine.iter().map(|&q| subject(q)).collect(),
        };
        let window = args.window;
        let (filler, counters, go) = (filler.clone(), counters.clone(), go_rx.clone());
        let (ready, thread) =
            on_own_thread(format!("probe-producer-{i}"), move |ready| async move {
                let producer = match system {
                    System::Bmq => {
                        let client = systems::bmq_connect(first, window, "producer").await?;
                        let mut opens = futures::stream::iter(targets.iter().map(|uri| {
                            let client = &client;
                            async move {
                                client
                                    .open_queue(uri, bmq_client::OpenOptions::write())
                                    .await
                                    .with_context(|| format!("cannot open {uri} for writing"))
                            }
                        }))
                        .buffer_unordered(systems::OPENS_IN_FLIGHT);
                        while let Some(r) = opens.next().await {
                            r?;
                        }
                        drop(opens);
                        let uri = targets[0].clone();
                        Producer::Bmq { client, uri }
                    }
                    _ => Producer::Nats {
                        js: systems::nats_js(systems::nats_connect(&first).await?, timeout),
                        subject: targets[0].clone(),
                    },
                };
                let _ = ready.send(());
                let Some(start) = wait_for_start(go).await else {
                    producer.close().await;
                    return Ok(measure::histogram());
                };
                let run = ProducerRun::new(i, producer_count, count, duration, rate, window, start);
                Ok(produce(producer, &targets, filler, run, counters).await)
            })?;
        client_ready(ready, &mut producer_threads, thread).await?;
    }
    let start = Instant::now();
    let _ = go_tx.send(Some(start));
    let mut ack_hist = measure::histogram();
    for p in producer_threads {
        let h = finished(p).await?;
        ack_hist.add(&h).expect("same histogram bounds");
    }
    let acked = counters.acked.load(Ordering::Relaxed);
    let drain_deadline = Instant::now() + drain;
    let first_deliveries =
        |c: &Counters| c.received.load(Ordering::Relaxed) - c.redeliveries.load(Ordering::Relaxed);
    if args.consumers > 0 {
        while first_deliveries(&counters) < acked && Instant::now() < drain_deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let _ = stop_tx.send(true);
    let mut e2e = measure::histogram();
    let mut delivered = vec![false; queues];
    let mut ids = std::collections::HashSet::new();
    let mut receipts: u64 = 0;
    for c in consumer_threads {
        let (h, seen, got) = finished(c).await?;
        receipts += got.len() as u64;
        ids.extend(got);
        e2e.add(&h).expect("same histogram bounds");
        for (d, s) in delivered.iter_mut().zip(seen) {
            *d |= s;
        }
    }
    if args.system == System::Nats {
        // Free the stream's disk for the next runs (best effort).
        if let Ok(c) = systems::nats_connect(servers).await {
            let _ = systems::nats_js(c.clone(), timeout)
                .delete_stream(&stream)
                .await;
            let _ = c.drain().await;
        }
    }
    let ns = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
    let received = counters.received.load(Ordering::Relaxed);
    Ok(MessagesResult {
        kind: "messages".into(),
        system: args.system,
        label: args.label,
        producers: args.producers,
        consumers: args.consumers,
        queues,
        queues_delivered: delivered.iter().filter(|&&d| d).count(),
        size: args.size,
        window: args.window,
        rate: args.rate,
        sent: counters.sent.load(Ordering::Relaxed),
        acked,
        errors: counters.errors.load(Ordering::Relaxed),
        received,
        redeliveries: counters.redeliveries.load(Ordering::Relaxed),
        duplicates: receipts - ids.len() as u64,
        missing: if args.consumers > 0 {
            acked.saturating_sub(ids.len() as u64)
        } else {
            0
        },
        produced_per_sec: measure::rate(acked, ns(&counters.last_ack_ns)),
        consumed_per_sec: measure::rate(received, ns(&counters.last_receipt_ns)),
        ack: Percentiles::of(&ack_hist),
        e2e: Percentiles::of(&e2e),
        loadavg: (loadavg_start, crate::loadavg()),
    })
}

/// One producer: sends what `run` says; a collector times each ACK as it completes.
async fn produce(
    producer: Producer,
    targets: &[String],
    filler: Vec<u8>,
    run: ProducerRun,
    counters: Arc<Counters>,
) -> Histogram<u64> {
    let ProducerRun {
        share,
        deadline,
        rate,
        window,
        start,
    } = run;
    let window = Arc::new(Semaphore::new(window));
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, systems::AckFuture, _)>();
    let collector = {
        let counters = counters.clone();
        tokio::spawn(async move {
            let mut h = measure::histogram();
            let mut in_flight = FuturesUnordered::new();
            let mut open = true;
            loop {
                tokio::select! {
                    m = rx.recv(), if open => match m {
                        Some((sent_at, ack, permit)) => in_flight.push(async move {
                            let r: anyhow::Result<()> = ack.await;
                            (sent_at, r, permit)
                        }),
                        None => open = false,
                    },
                    Some((sent_at, r, permit)) = in_flight.next(), if !in_flight.is_empty() => {
                        let done = Instant::now();
                        drop(permit);
                        match r {
                            Ok(()) => {
                                measure::record(&mut h, done - sent_at);
                                counters.acked.fetch_add(1, Ordering::Relaxed);
                                counters.last_ack_ns.fetch_max((done - start).as_nanos() as u64, Ordering::Relaxed);
                            }
                            Err(e) => {
                                if counters.errors.fetch_add(1, Ordering::Relaxed) < 5 {
                                    eprintln!("peer-probe: a PUT failed: {e:#}");
                                }
                            }
                        }
                    }
                    else => break,
                }
            }
            h
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
        let permit = window
            .clone()
            .acquire_owned()
            .await
            .expect("window never closed");
        let now = Instant::now();
        let target = &targets[(n % targets.len() as u64) as usize];
        match producer
            .put_to(target, measure::encode(&filler, now - start))
            .await
        {
            Ok(ack) => {
                counters.sent.fetch_add(1, Ordering::Relaxed);
                let _ = tx.send((now, ack, permit));
            }
            Err(e) => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
                eprintln!("peer-probe: put failed, producer stops: {e:#}");
                break;
            }
        }
        n += 1;
    }
    drop(tx);
    let h = collector.await.unwrap_or_else(|_| measure::histogram());
    producer.close().await;
    h
}

/// One consumer: times and acknowledges every message until `stop` turns true, then closes
/// and returns its end-to-end latency histogram, per queue of the run's `queues` whether it
/// received a message from it, and the id of every message it received.
async fn consume(
    mut consumer: Consumer,
    start: Instant,
    counters: Arc<Counters>,
    mut stop: watch::Receiver<bool>,
    queues: usize,
) -> (Histogram<u64>, Vec<bool>, Vec<u128>) {
    let mut local = measure::histogram();
    let mut seen = vec![false; queues];
    let mut ids = Vec::new();
    loop {
        let next = tokio::select! {
            m = consumer.next() => m,
            _ = stop.changed() => break,
        };
        let r = match next {
            None => break,
            Some(Err(e)) => {
                eprintln!("peer-probe: consumer: {e:#}");
                counters.errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Some(Ok(r)) => r,
        };
        let now = start.elapsed();
        match measure::decode(&r.payload) {
            Some(sent) => measure::record(&mut local, now.saturating_sub(sent)),
            None => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Some(s) = queue_index(&r.queue).and_then(|q| seen.get_mut(q)) {
            *s = true;
        }
        ids.push(r.id);
        counters.received.fetch_add(1, Ordering::Relaxed);
        if r.redelivered {
            counters.redeliveries.fetch_add(1, Ordering::Relaxed);
        }
        counters
            .last_receipt_ns
            .fetch_max(now.as_nanos() as u64, Ordering::Relaxed);
        if let Err(e) = consumer.ack(r).await {
            eprintln!("peer-probe: ack failed: {e:#}");
        }
    }
    consumer.close().await;
    (local, seen, ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_queue_has_a_client_and_clients_share_them_evenly() {
        // 2 clients on 5 queues take every other queue; 8 clients on 3 queues share them.
        assert_eq!(assigned(0, 2, 5), vec![0, 2, 4]);
        assert_eq!(assigned(1, 2, 5), vec![1, 3]);
        assert_eq!(assigned(7, 8, 3), vec![1]);
        for (clients, queues) in [(1, 1), (8, 100), (64, 10_000), (64, 100), (8, 1)] {
            let mut count = vec![0; queues];
            for k in 0..clients {
                for q in assigned(k, clients, queues) {
                    count[q] += 1;
                }
            }
            assert!(
                count.iter().all(|&c| c >= 1),
                "{clients} clients, {queues} queues"
            );
            if queues >= clients {
                assert!(count.iter().all(|&c| c == 1));
            }
        }
    }

    #[test]
    fn queue_index_is_the_last_part_of_a_uri_or_subject() {
        // Ours ends in `-<q>`, a NATS subject in `.<q>`.
        assert_eq!(queue_index("bmq://bmq.test/peer-0a1b2c3d-42"), Some(42));
        assert_eq!(queue_index("peer.0a1b2c3d.7"), Some(7));
        assert_eq!(queue_index("peer"), None);
    }
}
