//! Multi-process failover tests (DESIGN.md §7): the primary of a queue's partition dies (or
//! stops) while producers and a consumer keep working through the other nodes; every
//! acknowledged message must still be delivered.
//!
//! The failover time is printed (wall clock from the signal until `/status` shows a new primary
//! as active, and the longest gap between ACKs after the signal) so runs can record it; it is
//! not asserted.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use bmq_client::{Client, ClientConfig, OpenOptions};
use bmq_proto::client::{AckStatus, ConsumerOptions};
use bmq_tests::{primary_of_queue, Cluster};
use bmqctl::payload;

const QUEUE: &str = "bmq://bmq.test/failover";
/// Messages per producer.
const PER_PRODUCER: u64 = 3_000;
/// PUTs a producer keeps unacknowledged.
const PRODUCER_WINDOW: usize = 200;
/// The signal is sent once this many messages of producer 1 are acknowledged.
const SIGNAL_AFTER_ACKS: u64 = 1_000;

fn client_config(brokers: Vec<String>, id: &str) -> ClientConfig {
    let mut config = ClientConfig::new(brokers);
    config.client_id = id.to_string();
    config.request_timeout = Duration::from_secs(30);
    config
}

/// A client of `brokers` (tried in order) with `QUEUE` open for writing.
async fn connect_producer(brokers: Vec<String>, id: &str) -> anyhow::Result<Client> {
    let client = Client::connect(client_config(brokers, id)).await?;
    client.open_queue(QUEUE, OpenOptions::write()).await?;
    Ok(client)
}

/// A client of `brokers` (tried in order) with `QUEUE` open for reading, at most
/// `max_unconfirmed` messages pushed and not confirmed.
async fn connect_consumer(
    brokers: Vec<String>,
    id: &str,
    max_unconfirmed: u32,
) -> anyhow::Result<Client> {
    let client = Client::connect(client_config(brokers, id)).await?;
    client
        .open_queue(
            QUEUE,
            OpenOptions::read(ConsumerOptions {
                max_unconfirmed_messages: max_unconfirmed,
                ..Default::default()
            }),
        )
        .await
        .with_context(|| format!("{id} open"))?;
    Ok(client)
}

/// Every ACK a producer saw: sequence -> when.
type AckLog = Arc<Mutex<BTreeMap<u64, Instant>>>;

/// Produces `count` messages, keeping `PRODUCER_WINDOW` in flight; logs each success.
/// A NACK or an error ends it with an error (a client should see at most a reconnect).
async fn produce(
    client: Client,
    producer_id: u64,
    count: u64,
    acks: AckLog,
    counter: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let mut in_flight = VecDeque::new();
    let settle = |seq: u64, ack: Result<bmq_proto::client::Ack, _>| -> anyhow::Result<()> {
        let ack: bmq_proto::client::Ack =
            ack.map_err(|e| anyhow::anyhow!("producer {producer_id} seq {seq}: {e}"))?;
        ensure!(
            ack.status == AckStatus::Success as i32,
            "producer {producer_id} seq {seq}: NACK {ack:?}"
        );
        acks.lock().unwrap().insert(seq, Instant::now());
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(())
    };
    for seq in 0..count {
        let pending = client
            .put(QUEUE, payload::encode(producer_id, seq, 512), vec![])
            .await
            .with_context(|| format!("producer {producer_id} put {seq}"))?;
        in_flight.push_back((seq, pending));
        if in_flight.len() >= PRODUCER_WINDOW {
            let (s, p) = in_flight.pop_front().expect("non-empty");
            settle(s, p.await)?;
        }
    }
    while let Some((s, p)) = in_flight.pop_front() {
        settle(s, p.await)?;
    }
    Ok(())
}

/// What the consumer saw: (producer, sequence) -> highest delivery attempt.
/// Every delivery of each message: (producer, sequence) -> the delivery attempt of each push.
type Seen = Arc<Mutex<BTreeMap<(u64, u64), Vec<u32>>>>;

/// Consumes until stopped, holding up to 50 messages unconfirmed so some are in flight when
/// the primary goes away (after a crash they come back, with the same delivery attempt: no
/// consumer failed).
async fn consume(client: Client, seen: Seen, stop: Arc<AtomicU64>) -> anyhow::Result<()> {
    let mut unconfirmed = VecDeque::new();
    while stop.load(Ordering::Relaxed) == 0 {
        match tokio::time::timeout(Duration::from_millis(300), client.next_message()).await {
            Ok(Some(msg)) => {
                let (pid, seq) = payload::verify(&msg.payload)
                    .map_err(|e| anyhow::anyhow!("corrupt payload: {e}"))?;
                seen.lock()
                    .unwrap()
                    .entry((pid, seq))
                    .or_default()
                    .push(msg.delivery_attempt);
                unconfirmed.push_back((msg.uri, msg.guid));
                if unconfirmed.len() > 50 {
                    let (uri, guid) = unconfirmed.pop_front().expect("non-empty");
                    client.confirm(&uri, guid).await.ok();
                }
            }
            Ok(None) => bail!("consumer stream ended"),
            Err(_) => {
                // Quiet: confirm what we hold.
                while let Some((uri, guid)) = unconfirmed.pop_front() {
                    client.confirm(&uri, guid).await.ok();
                }
            }
        }
    }
    Ok(())
}

/// Produces `count` messages to the queue (producer id 9) and consumes and confirms every one
/// of them before returning, so that the queue's partition closes, deletes and recycles
/// journal segments on every node before a scenario starts.
async fn warm_up(cluster: &Cluster, count: u64) -> anyhow::Result<()> {
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let addrs = cluster.client_addrs();
    let producer = connect_producer(addrs.clone(), "warm-up-producer").await?;
    let consumer = connect_consumer(addrs, "warm-up-consumer", 1000).await?;
    let consumed = tokio::spawn(async move {
        for _ in 0..count {
            let msg = tokio::time::timeout(Duration::from_secs(30), consumer.next_message())
                .await
                .context("warm-up consumer waited 30 s")?
                .context("warm-up consumer stream ended")?;
            consumer.confirm(&msg.uri, msg.guid).await?;
        }
        consumer.disconnect().await.ok();
        anyhow::Ok(())
    });
    produce(
        producer.clone(),
        9,
        count,
        AckLog::default(),
        Arc::default(),
    )
    .await?;
    producer.disconnect().await.ok();
    tokio::time::timeout(Duration::from_secs(120), consumed)
        .await
        .context("warm-up consumer timed out")???;
    Ok(())
}

/// Runs the scenario: the primary of the queue's partition gets `signal` mid-production, once
/// producer 1 has `signal_after_acks` ACKs. Producer 1 and the consumer are attached to the
/// two other nodes (the proxy path); producer 2 is attached to the primary itself (the client
/// library must reconnect).
async fn scenario(
    cluster: &mut Cluster,
    signal: i32,
    signal_after_acks: u64,
) -> anyhow::Result<()> {
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let addrs = cluster.client_addrs();
    // Assign the queue and learn its primary.
    let opener = connect_producer(addrs.clone(), "opener").await?;
    let (partition, primary) = primary_of_queue(cluster, QUEUE, Duration::from_secs(20)).await?;
    opener.disconnect().await.ok();
    let others: Vec<u32> = (1..=3).filter(|n| *n != primary).collect();
    let addr = |n: u32| addrs[(n - 1) as usize].clone();
    eprintln!("queue {QUEUE} is on partition {partition}, primary node {primary}");

    let consumer =
        connect_consumer(vec![addr(others[1]), addr(others[0])], "consumer", 100).await?;
    let p1 = connect_producer(vec![addr(others[0]), addr(others[1])], "producer-1").await?;
    let p2 = connect_producer(
        vec![addr(primary), addr(others[1]), addr(others[0])],
        "producer-2",
    )
    .await?;

    let seen: Seen = Arc::default();
    let stop = Arc::new(AtomicU64::new(0));
    let consumer_task = tokio::spawn(consume(consumer.clone(), seen.clone(), stop.clone()));
    let acks1: AckLog = Arc::default();
    let acks2: AckLog = Arc::default();
    let count1 = Arc::new(AtomicU64::new(0));
    let t1 = tokio::spawn(produce(
        p1.clone(),
        1,
        PER_PRODUCER,
        acks1.clone(),
        count1.clone(),
    ));
    let t2 = tokio::spawn(produce(
        p2.clone(),
        2,
        PER_PRODUCER,
        acks2.clone(),
        Arc::default(),
    ));

    let deadline = Instant::now() + Duration::from_secs(60);
    while count1.load(Ordering::Relaxed) < signal_after_acks {
        ensure!(
            Instant::now() < deadline,
            "producer 1 too slow before the signal"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let signalled_at = Instant::now();
    cluster.signal_node(primary, signal)?;
    eprintln!("signal {signal} sent to node {primary} (primary of partition {partition})");
    if signal == libc::SIGTERM {
        // A graceful stop hands the primaries over before the process exits.
        let log = std::fs::read_to_string(cluster.node(primary).log_path())?;
        ensure!(
            log.contains("no partition left on this node: stopping"),
            "node {primary} exited without handing over its primaries"
        );
    }

    let new_primary = cluster
        .wait_for_all(
            Duration::from_secs(30),
            "a new live primary, healed (active)",
            |s| {
                s.partitions.iter().any(|p| {
                    p.partition_id == partition
                        && p.primary.is_some_and(|n| n != primary)
                        && p.status == "active"
                })
            },
        )
        .await?;
    let reassigned_after = signalled_at.elapsed();
    let new_primary = new_primary[0]
        .partitions
        .iter()
        .find(|p| p.partition_id == partition)
        .and_then(|p| p.primary);

    let r1 = tokio::time::timeout(Duration::from_secs(120), t1).await;
    let r2 = tokio::time::timeout(Duration::from_secs(120), t2).await;
    r1.context("producer 1 timed out")??.context("producer 1")?;
    r2.context("producer 2 timed out")??.context("producer 2")?;

    // The stall the producers saw: the longest gap between consecutive ACKs from the signal on.
    let mut times: Vec<Instant> = acks1
        .lock()
        .unwrap()
        .values()
        .chain(acks2.lock().unwrap().values())
        .copied()
        .filter(|t| *t > signalled_at)
        .collect();
    times.sort();
    let mut longest_gap = Duration::ZERO;
    let mut prev = signalled_at;
    for t in &times {
        longest_gap = longest_gap.max(t.duration_since(prev));
        prev = *t;
    }
    eprintln!(
        "FAILOVER signal={signal} partition={partition} old_primary={primary} new_primary={new_primary:?} \
         new_primary_active_in_status_after_ms={} longest_ack_gap_after_signal_ms={} acks_after_signal={}",
        reassigned_after.as_millis(),
        longest_gap.as_millis(),
        times.len()
    );

    // Every acknowledged message must be delivered at least once.
    let mut acked: BTreeSet<(u64, u64)> = BTreeSet::new();
    acked.extend(acks1.lock().unwrap().keys().map(|s| (1, *s)));
    acked.extend(acks2.lock().unwrap().keys().map(|s| (2, *s)));
    ensure!(
        acked.len() as u64 == 2 * PER_PRODUCER,
        "only {} of {} PUTs were acknowledged",
        acked.len(),
        2 * PER_PRODUCER
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let missing: Vec<(u64, u64)> = {
            let seen = seen.lock().unwrap();
            acked
                .iter()
                .filter(|k| !seen.contains_key(k))
                .copied()
                .collect()
        };
        if missing.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "{} acknowledged messages never delivered, e.g. {:?}",
                missing.len(),
                &missing[..missing.len().min(10)]
            );
        }
        ensure!(!consumer_task.is_finished(), "consumer stopped early");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(1, Ordering::Relaxed);
    consumer_task.await??;
    let seen = seen.lock().unwrap().clone();
    for key in seen.keys() {
        ensure!(
            (key.0 == 1 || key.0 == 2) && key.1 < PER_PRODUCER,
            "delivered a message that was never sent: {key:?}"
        );
    }
    let redelivered = seen.values().filter(|a| a.len() > 1).count();
    let raised = seen.values().flatten().filter(|a| **a > 1).count();
    eprintln!(
        "delivered {} distinct messages, {redelivered} more than once, {raised} pushes with a delivery attempt > 1",
        seen.len()
    );
    // No consumer failed: a primary's crash or stop never raises the delivery attempt
    // (DESIGN.md §7).
    ensure!(
        raised == 0,
        "{raised} pushes carried a delivery attempt > 1 although no consumer failed"
    );
    if signal == libc::SIGKILL {
        ensure!(
            redelivered > 0,
            "no message was redelivered after the primary's crash although up to 50 were unconfirmed"
        );
    } else {
        // A graceful stop pushes nothing new and gives the consumer time to confirm what it
        // holds before the partition moves: nothing is delivered twice.
        ensure!(
            redelivered == 0,
            "{redelivered} messages were delivered twice across a graceful stop"
        );
    }
    p1.disconnect().await.ok();
    p2.disconnect().await.ok();
    consumer.disconnect().await.ok();

    // The old primary comes back: it recovers its journal, is brought up to date (its
    // unacknowledged tail dropped), and gradual rebalancing gives it a primary again.
    cluster.start_node(primary)?;
    let restarted_at = Instant::now();
    cluster
        .wait_for_all(
            Duration::from_secs(30),
            "the returning node is primary of a healed partition",
            |s| {
                s.partitions.iter().all(|p| p.status == "active")
                    && s.partitions.iter().any(|p| p.primary == Some(primary))
            },
        )
        .await?;
    eprintln!(
        "node {primary} restarted and holds a healed primary again after {} ms",
        restarted_at.elapsed().as_millis()
    );
    Ok(())
}

/// SIGKILL of the queue's primary mid-production with strong consistency: every ACKed
/// message is delivered, nothing unknown is delivered, unconfirmed ones come back (with the
/// same delivery attempt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_messages_survive_primary_sigkill() {
    let mut cluster = Cluster::start(3).expect("start cluster");
    if let Err(e) = scenario(&mut cluster, libc::SIGKILL, SIGNAL_AFTER_ACKS).await {
        panic!("{e:#}\n{}", cluster.log_tails(60));
    }
}

/// Graceful stop (SIGTERM) of the queue's primary mid-production: clients see at most a
/// reconnect, every PUT is ACKed and every ACKed message delivered exactly once (the drain lets
/// the consumer confirm before the partition moves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_messages_survive_primary_graceful_stop() {
    let mut cluster = Cluster::start(3).expect("start cluster");
    if let Err(e) = scenario(&mut cluster, libc::SIGTERM, SIGNAL_AFTER_ACKS).await {
        panic!("{e:#}\n{}", cluster.log_tails(60));
    }
}

/// SIGKILL of the queue's primary with 1 MiB journal segments, soon after a warm-up of 8,000
/// messages consumed: segments were deleted and recycled (written over) on every node before
/// the crash, so the killed
/// primary restarts from journals whose newest segment may hold an earlier life's records
/// after its own, and the others go on recycling while they take over. Every ACKed message is
/// delivered, nothing unknown is, and the node comes back as a primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_messages_survive_primary_sigkill_with_recycled_segments() {
    let mut cluster = Cluster::configure(3, |c| c.storage.segment_size_mb = 1).expect("configure");
    for id in 1..=3 {
        cluster.start_node(id).expect("start node");
    }
    let result = async {
        // About five segments' worth, all consumed: segments deleted and recycled already.
        warm_up(&cluster, 8_000).await?;
        // Soon after it: the newest segments are recycled ones when the primary dies.
        scenario(&mut cluster, libc::SIGKILL, 200).await?;
        let mut recycled = 0.0;
        for node in &cluster.nodes {
            recycled +=
                bmq_tests::metric(&node.admin_addr(), "bmq_journal_segments_recycled_total")
                    .await?;
        }
        ensure!(recycled > 0.0, "no journal segment was recycled");
        eprintln!("{recycled} journal segments recycled since the nodes last started");
        // The restarted node read a recycled segment back (its earlier life's bytes cut).
        let mut reread = 0;
        for node in &cluster.nodes {
            let log = std::fs::read_to_string(node.log_path())?;
            reread += log.matches("recycled journal segment").count();
        }
        ensure!(
            reread > 0,
            "no node read a recycled journal segment back at a start"
        );
        eprintln!("{reread} recycled journal segments read back at a start");
        Ok::<_, anyhow::Error>(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", cluster.log_tails(60));
    }
}
