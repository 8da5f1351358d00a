//! Multi-process tests of what a consumer may read and what a stop may do (DESIGN.md §7): real
//! `broker` processes on loopback, real clients.
//!
//! - no dirty read: while both replicas of a strong queue's partition are paused (SIGSTOP), a
//!   PUT is neither ACKed nor delivered; both come once a replica resumes;
//! - routine maintenance drops nothing: the primary of a queue whose consumer holds a message
//!   unconfirmed is restarted gracefully more times than `max_delivery_attempts`; the message
//!   stays, its delivery attempt stays 1, nothing is removed;
//! - a graceful stop drains: `POST /admin/stop` of the primary while its consumer holds 10
//!   unconfirmed messages; the consumer confirms them during the drain, the node exits 0, and no
//!   message is delivered twice;
//! - Ctrl-C of `bmqctl cluster up` stops every node with exit code 0, none killed.
//!
//! (The same dirty-read rule under a kernel-made network cut is the chaos scenario
//! `isolated_primary_no_dirty_read`.)

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use bmq_client::{Client, ClientConfig, Message, OpenOptions};
use bmq_proto::client::{AckStatus, ConsumerOptions};
use bmq_tests::{broker_binary, metric, primary_of_queue, Cluster};
use bytes::Bytes;

const TIMEOUT: Duration = Duration::from_secs(30);

fn client(addr: String, id: &str) -> ClientConfig {
    let mut config = ClientConfig::new(vec![addr]);
    config.client_id = id.to_string();
    config.request_timeout = Duration::from_secs(20);
    config
}

/// A consumer of `uri` on the node at `addr`, allowed `max_unconfirmed` messages at a time.
async fn consumer(addr: String, uri: &str, max_unconfirmed: u32) -> anyhow::Result<Client> {
    let c = Client::connect(client(addr, "consumer")).await?;
    c.open_queue(
        uri,
        OpenOptions::read(ConsumerOptions {
            max_unconfirmed_messages: max_unconfirmed,
            ..Default::default()
        }),
    )
    .await?;
    Ok(c)
}

async fn next(c: &Client, within: Duration) -> Option<Message> {
    tokio::time::timeout(within, c.next_message())
        .await
        .ok()
        .flatten()
}

/// Both replicas of a strong queue's partition paused: a PUT is not ACKed and not delivered;
/// once one replica resumes, the ACK and the PUSH both come (DESIGN.md §7: delivered only once
/// a quorum holds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_delivery_before_a_quorum_holds_the_message() {
    let mut cluster = Cluster::start(3).expect("start cluster");
    if let Err(e) = dirty_read_scenario(&mut cluster).await {
        // Never leave a stopped process behind for the next test's ports.
        for id in 1..=3 {
            let _ = cluster.signal_node(id, libc::SIGCONT);
        }
        panic!("{e:#}\n{}", cluster.log_tails(40));
    }
}

async fn dirty_read_scenario(cluster: &mut Cluster) -> anyhow::Result<()> {
    let uri = "bmq://bmq.test/no-dirty-read";
    cluster.wait_for_leader(TIMEOUT).await?;
    let addrs = cluster.client_addrs();
    let opener = Client::connect(client(addrs[0].clone(), "opener")).await?;
    opener.open_queue(uri, OpenOptions::write()).await?;
    let (_, primary) = primary_of_queue(cluster, uri, TIMEOUT).await?;
    let replicas: Vec<u32> = (1..=3).filter(|n| *n != primary).collect();
    let at_primary = addrs[(primary - 1) as usize].clone();
    let reader = consumer(at_primary.clone(), uri, 10).await?;
    let producer = Client::connect(client(at_primary, "producer")).await?;
    producer.open_queue(uri, OpenOptions::write()).await?;
    // Warm up: one message through, so the path is known to work.
    producer
        .put(uri, Bytes::from_static(b"warm-up"), vec![])
        .await?
        .await?;
    let warm = next(&reader, TIMEOUT).await.context("warm-up delivered")?;
    reader.confirm(&warm.uri, warm.guid).await?;

    for r in &replicas {
        cluster.signal_node(*r, libc::SIGSTOP)?;
    }
    let pending = producer
        .put(uri, Bytes::from_static(b"held by the primary only"), vec![])
        .await?;
    let early = next(&reader, Duration::from_millis(1500)).await;
    let resumed_at = Instant::now();
    cluster.signal_node(replicas[0], libc::SIGCONT)?;
    ensure!(
        early.is_none(),
        "dirty read: the consumer received {:?} while only the primary held it",
        early.map(|m| m.payload)
    );
    let ack = tokio::time::timeout(TIMEOUT, pending).await??;
    ensure!(ack.status == AckStatus::Success as i32, "NACK {ack:?}");
    let message = next(&reader, TIMEOUT)
        .await
        .context("delivered once a replica holds it")?;
    ensure!(message.payload == "held by the primary only");
    eprintln!(
        "ACK and PUSH {} ms after the replica resumed",
        resumed_at.elapsed().as_millis()
    );
    cluster.signal_node(replicas[1], libc::SIGCONT)?;
    Ok(())
}

/// Whichever node is the queue's primary is restarted gracefully seven times (more than the
/// domain's `max_delivery_attempts` of 5; the rebalancer spreads the partitions again after
/// each return) while a consumer holds one message unconfirmed: the message is never removed,
/// its delivery attempt stays 1 (a primary move, or the stop of the consumer's own node, is not a
/// consumer failure), and the consumer can confirm it at the end. The consumer starts on a node
/// that is not the primary; when the partition lands on its node, that node is the one restarted
/// and the client library moves the consumer to another node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_restarts_never_drop_a_held_message() {
    let mut cluster = Cluster::start(3).expect("start cluster");
    if let Err(e) = held_message_scenario(&mut cluster).await {
        panic!("{e:#}\n{}", cluster.log_tails(40));
    }
}

async fn held_message_scenario(cluster: &mut Cluster) -> anyhow::Result<()> {
    let uri = "bmq://bmq.test/held-across-restarts";
    cluster.wait_for_leader(TIMEOUT).await?;
    let addrs = cluster.client_addrs();
    let opener = Client::connect(client(addrs[0].clone(), "opener")).await?;
    opener.open_queue(uri, OpenOptions::write()).await?;
    let (partition, primary) = primary_of_queue(cluster, uri, TIMEOUT).await?;
    let first = (1..=3).find(|n| *n != primary).expect("3 nodes");
    let mut brokers = addrs.clone();
    brokers.rotate_left((first - 1) as usize);
    let mut config = client(brokers[0].clone(), "consumer");
    config.brokers = brokers.clone();
    let reader = Client::connect(config).await?;
    reader
        .open_queue(
            uri,
            OpenOptions::read(ConsumerOptions {
                max_unconfirmed_messages: 1,
                ..Default::default()
            }),
        )
        .await?;
    let mut config = client(brokers[0].clone(), "producer");
    config.brokers = brokers;
    let producer = Client::connect(config).await?;
    producer.open_queue(uri, OpenOptions::write()).await?;
    producer
        .put(uri, Bytes::from_static(b"held"), vec![])
        .await?
        .await?;
    let held = next(&reader, TIMEOUT).await.context("first delivery")?;
    ensure!(held.delivery_attempt == 1);

    let mut deliveries = vec![held.delivery_attempt];
    for round in 1..=7 {
        // Whichever node is the partition's primary now goes.
        let (_, now_primary) = primary_of_queue(cluster, uri, TIMEOUT).await?;
        cluster.stop_node(now_primary)?;
        cluster.start_node(now_primary)?;
        // Back to a healed primary (the returning node gets its share back by rebalancing).
        cluster
            .wait_for_all(TIMEOUT, "every partition active", |s| {
                s.partitions
                    .iter()
                    .all(|p| p.status == "active" && p.primary.is_some())
            })
            .await?;
        // A new primary redelivers the held message to the same consumer: same attempt.
        while let Some(m) = next(&reader, Duration::from_millis(1500)).await {
            ensure!(m.guid == held.guid, "an unexpected message {:?}", m.payload);
            deliveries.push(m.delivery_attempt);
        }
        eprintln!("round {round}: node {now_primary} restarted, deliveries so far {deliveries:?}");
    }
    ensure!(
        deliveries.iter().all(|a| *a == 1),
        "a graceful restart raised the delivery attempt: {deliveries:?}"
    );
    let mut removed = 0.0;
    for id in 1..=3 {
        removed += metric(&cluster.node(id).admin_addr(), "bmq_queue_removed_total").await?;
    }
    ensure!(
        removed == 0.0,
        "{removed} messages removed without a confirm"
    );
    let docs = cluster
        .wait_for_all(TIMEOUT, "the held message is still in the queue", |s| {
            s.partitions
                .iter()
                .filter(|p| p.partition_id == partition)
                .all(|p| p.primary.is_none() || p.messages <= 1)
        })
        .await?;
    let depth: u64 = docs
        .iter()
        .flat_map(|d| d.partitions.iter())
        .filter(|p| p.partition_id == partition)
        .map(|p| p.messages)
        .max()
        .unwrap_or(0);
    ensure!(
        depth == 1,
        "the partition holds {depth} messages, expected the held one"
    );
    reader.confirm(&held.uri, held.guid.clone()).await?;
    cluster
        .wait_for_all(TIMEOUT, "the queue is empty after the confirm", |s| {
            s.partitions
                .iter()
                .filter(|p| p.partition_id == partition)
                .all(|p| p.messages == 0)
        })
        .await?;
    Ok(())
}

/// `POST /admin/stop` of the primary while its consumer (on another node) holds 10 unconfirmed
/// messages: the stopping node pushes nothing new, the consumer confirms within the drain time,
/// the partition moves, the node exits 0, and every message is delivered exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_stop_drains_before_the_primary_moves() {
    let mut cluster = Cluster::start(3).expect("start cluster");
    if let Err(e) = drain_scenario(&mut cluster).await {
        panic!("{e:#}\n{}", cluster.log_tails(40));
    }
}

async fn drain_scenario(cluster: &mut Cluster) -> anyhow::Result<()> {
    let uri = "bmq://bmq.test/drained";
    cluster.wait_for_leader(TIMEOUT).await?;
    let addrs = cluster.client_addrs();
    let opener = Client::connect(client(addrs[0].clone(), "opener")).await?;
    opener.open_queue(uri, OpenOptions::write()).await?;
    let (_, primary) = primary_of_queue(cluster, uri, TIMEOUT).await?;
    let other = (1..=3).find(|n| *n != primary).expect("3 nodes");
    let addr = addrs[(other - 1) as usize].clone();
    let reader = consumer(addr.clone(), uri, 10).await?;
    let producer = Client::connect(client(addr, "producer")).await?;
    producer.open_queue(uri, OpenOptions::write()).await?;
    for i in 0..20u32 {
        producer
            .put(uri, Bytes::from(i.to_be_bytes().to_vec()), vec![])
            .await?
            .await?;
    }
    let mut seen: BTreeMap<Vec<u8>, u32> = BTreeMap::new();
    let mut held = Vec::new();
    while held.len() < 10 {
        let m = next(&reader, TIMEOUT).await.context("the first 10")?;
        *seen.entry(m.payload.to_vec()).or_default() += 1;
        held.push(m);
    }
    let stopped_at = Instant::now();
    let answer =
        bmqctl::http::post(&cluster.node(primary).admin_addr(), "/admin/stop", None).await?;
    eprintln!("admin stop: {}", answer.trim());
    // The stopping primary pushes nothing new while its consumer holds messages.
    let during = next(&reader, Duration::from_millis(300)).await;
    ensure!(
        during.is_none(),
        "the stopping primary pushed {:?} during its drain",
        during.map(|m| m.payload)
    );
    for m in held.drain(..) {
        reader.confirm(&m.uri, m.guid).await?;
    }
    // The other 10 arrive from the new primary; confirm them as they come.
    while seen.len() < 20 {
        let m = next(&reader, TIMEOUT).await.context("the last 10")?;
        *seen.entry(m.payload.to_vec()).or_default() += 1;
        reader.confirm(&m.uri, m.guid).await?;
    }
    let status = cluster
        .wait_for_exit(primary, Duration::from_secs(15))?
        .context("the stopped node did not exit")?;
    ensure!(status.success(), "node {primary} exited with {status}");
    eprintln!(
        "node {primary} exited {} ms after the stop request",
        stopped_at.elapsed().as_millis()
    );
    // Nothing more: every message exactly once.
    if let Some(extra) = next(&reader, Duration::from_millis(500)).await {
        *seen.entry(extra.payload.to_vec()).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    ensure!(twice.is_empty(), "delivered more than once: {twice:?}");
    Ok(())
}

/// Ctrl-C (SIGINT) of `bmqctl cluster up` on a healthy 3-node cluster with no unconfirmed
/// message: every node exits with code 0 on its own (the launcher's 5 s SIGKILL never comes).
#[test]
fn ctrl_c_of_cluster_up_stops_every_node_cleanly() {
    let bmqctl = broker_binary().with_file_name("bmqctl");
    let dir = tempfile::tempdir().expect("temp dir");
    // `cluster up` uses base+i (client), base+100+i (peer), base+200+i (admin): probe random
    // bases below the ephemeral range until all nine ports are free.
    let base = (0..200)
        .map(|_| 20_000 + (rand::random::<u16>() % 10_000))
        .find(|b| {
            (1..=3).all(|i| {
                [0, 100, 200]
                    .iter()
                    .all(|o| std::net::TcpListener::bind(("127.0.0.1", b + o + i)).is_ok())
            })
        })
        .expect("a free base port");
    let mut command = Command::new(&bmqctl);
    // As in a terminal: SIGINT handled by default (a test runner started in the background may
    // hand its children SIGINT ignored).
    // SAFETY: signal(2) is async-signal-safe, as pre_exec requires.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut up = command
        .args([
            "cluster",
            "up",
            "--no-prometheus",
            "--no-security",
            "--clean",
        ])
        .args(["--nodes", "3", "--base-port", &base.to_string()])
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start bmqctl cluster up");
    let mut out = BufReader::new(up.stdout.take().expect("stdout"));
    let mut lines = Vec::new();
    let ready = loop {
        let mut line = String::new();
        match out.read_line(&mut line) {
            Ok(0) | Err(_) => break false,
            Ok(_) => {
                let done = line.contains("Ctrl-C stops");
                lines.push(line);
                if done {
                    break true;
                }
            }
        }
    };
    if !ready {
        let _ = up.kill();
        let _ = up.wait();
        panic!("cluster up did not start:\n{}", lines.concat());
    }
    let interrupted = Instant::now();
    // SAFETY: kill(2) on the child we spawned and have not reaped.
    unsafe { libc::kill(up.id() as i32, libc::SIGINT) };
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut out, &mut rest);
    let status = up.wait().expect("wait for cluster up");
    let took = interrupted.elapsed();
    eprintln!("cluster up stopped in {} ms:\n{rest}", took.as_millis());
    assert!(status.success(), "cluster up exited with {status}:\n{rest}");
    for id in 1..=3 {
        assert!(
            rest.contains(&format!("node {id} stopped (exit code 0)")),
            "node {id} did not exit 0:\n{rest}"
        );
    }
    assert!(
        !rest.contains("killing it"),
        "a node had to be killed:\n{rest}"
    );
}
