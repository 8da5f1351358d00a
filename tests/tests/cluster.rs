//! Multi-process tests: real `broker` processes on loopback, real clients over TCP.

use std::time::Duration;

use anyhow::{ensure, Context};
use bmq_tests::{primary_of_queue, round_trip, Cluster};

const QUEUE: &str = "bmq://bmq.test/orders";

/// Three nodes elect a leader, carry 10,000 messages from a producer on one node to a consumer
/// on another, survive a SIGKILL of the leader (a new leader with a higher term; traffic keeps
/// flowing), and keep their queue assignments across a full restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_round_trip_failover_and_restart() {
    let mut cluster = Cluster::start(3).expect("start cluster");
    let result = async {
        let (leader, term) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let addrs = cluster.client_addrs();
        // Producer on one node, consumer on another: the proxy path is exercised both ways.
        let producer_brokers = vec![addrs[0].clone(), addrs[1].clone(), addrs[2].clone()];
        let consumer_brokers = vec![addrs[1].clone(), addrs[2].clone(), addrs[0].clone()];
        round_trip(
            QUEUE,
            producer_brokers.clone(),
            consumer_brokers.clone(),
            1,
            10_000,
        )
        .await
        .context("first round trip")?;

        let before = cluster
            .wait_for_all(Duration::from_secs(10), "queue assigned everywhere", |s| {
                s.queues.iter().any(|q| q.uri == QUEUE)
            })
            .await?;
        let assignments = before[0].queues.clone();

        // `/status` of the queue's partition once the traffic stopped: every node's journal
        // ends at the same sequence; the primary has all of it committed and no replica
        // behind; a replica reports no primary figures.
        let (partition, primary) =
            primary_of_queue(&cluster, QUEUE, Duration::from_secs(10)).await?;
        let of = |s: &bmq_proto::admin_doc::NodeStatusDoc| {
            s.partitions
                .iter()
                .find(|p| p.partition_id == partition)
                .cloned()
        };
        let last = cluster
            .wait_for_agreement(Duration::from_secs(10), "the last journal sequence", |s| {
                of(s).map(|p| p.journal_last_sequence)
            })
            .await?
            .context("the partition is listed")?;
        ensure!(
            last >= 10_000,
            "10,000 messages, last journal sequence {last}"
        );
        cluster
            .wait_for_all(
                Duration::from_secs(10),
                "the primary's figures in /status",
                |s| {
                    of(s).is_some_and(|p| {
                        p.journal_bytes > 0
                            && !p.disk_full
                            && p.replication_lag == 0
                            && p.committed_sequence == if s.node_id == primary { last } else { 0 }
                    })
                },
            )
            .await?;

        cluster.kill_node(leader)?;
        let (new_leader, new_term) = cluster
            .wait_for_leader(Duration::from_secs(20))
            .await
            .context("new leader after SIGKILL")?;
        ensure!(
            new_leader != leader,
            "the killed node {leader} cannot still lead"
        );
        ensure!(new_term > term, "new term {new_term} must exceed {term}");
        // Every partition gets a live primary again.
        cluster
            .wait_for_all(
                Duration::from_secs(20),
                "every partition has a live primary",
                |s| {
                    s.partitions
                        .iter()
                        .all(|p| p.primary.is_some_and(|n| n != leader))
                },
            )
            .await?;
        round_trip(
            QUEUE,
            producer_brokers.clone(),
            consumer_brokers.clone(),
            2,
            10_000,
        )
        .await
        .context("round trip after failover")?;

        // Full restart: the queue assignments come back from the ledger.
        for id in 1..=3 {
            if cluster.node(id).is_running() {
                cluster.stop_node(id)?;
            }
        }
        for id in 1..=3 {
            cluster.start_node(id)?;
        }
        cluster
            .wait_for_leader(Duration::from_secs(20))
            .await
            .context("leader after full restart")?;
        cluster
            .wait_for_all(
                Duration::from_secs(20),
                "assignments restored on every node",
                |s| s.queues == assignments,
            )
            .await?;
        // The new leader goes on committing (primaries, their ACTIVE status): the followers
        // reach its committed LSN a moment later.
        cluster
            .wait_for_agreement(Duration::from_secs(20), "the committed LSN", |s| {
                s.metadata.committed_lsn.clone()
            })
            .await?;
        round_trip(QUEUE, producer_brokers, consumer_brokers, 3, 1_000)
            .await
            .context("round trip after restart")?;
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", cluster.log_tails(40));
    }
}

/// `[process] cpu_scheduling` (broker `scheduling` module): by default every thread of a node
/// runs `SCHED_BATCH` but the elector's, which keeps `SCHED_OTHER`; `normal` leaves every
/// thread on `SCHED_OTHER`. Node 3 is configured `normal`; the cluster elects a leader either
/// way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threads_run_the_configured_scheduling_policy() {
    const OTHER: u32 = 0;
    const BATCH: u32 = 3;
    let mut cluster = Cluster::configure(3, |c| {
        if c.node_id == 3 {
            c.process.cpu_scheduling = bmq_config::CpuScheduling::Normal;
        }
    })
    .expect("configure cluster");
    for id in 1..=3 {
        cluster.start_node(id).expect("start node");
    }
    let result = async {
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        for id in 1..=2 {
            let threads = cluster.node(id).thread_policies()?;
            ensure!(
                threads[0].1 == BATCH,
                "node {id}'s main thread: {threads:?}"
            );
            let normal = threads.iter().filter(|(_, p)| *p == OTHER).count();
            let batch = threads.iter().filter(|(_, p)| *p == BATCH).count();
            // The elector's thread alone keeps the default; the others are the main thread,
            // the metadata and partition arbiters and the partitions' worker threads.
            ensure!(normal == 1, "node {id}: {threads:?}");
            ensure!(batch + normal == threads.len(), "node {id}: {threads:?}");
            ensure!(batch > 10, "node {id}: {threads:?}");
        }
        let threads = cluster.node(3).thread_policies()?;
        ensure!(
            threads.iter().all(|(_, p)| *p == OTHER),
            "node 3 (normal): {threads:?}"
        );
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", cluster.log_tails(30));
    }
}

/// A 1 MiB message (and one of 4 MiB) round trips with the embedded defaults: produced through
/// one node, consumed through another (a proxy hop each way, the replicas' journals in
/// between), delivered byte for byte. The limit in the way would be `limits.frame_size_max_bytes`
/// (64 MiB by default) on the client, the session and the peer links.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mib_message_round_trips() {
    const LARGE: &str = "bmq://bmq.test/large";
    let cluster = Cluster::start(3).expect("start cluster");
    let result = async {
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let addrs = cluster.client_addrs();
        let consumer = bmq_tests::open_consumer(LARGE, vec![addrs[1].clone()], "large-c").await?;
        let producer = bmq_tests::open_producer(LARGE, vec![addrs[0].clone()], "large-p").await?;
        for (i, size) in [1024 * 1024, 4 * 1024 * 1024].into_iter().enumerate() {
            let body: Vec<u8> = (0..size).map(|k| (k * 31 + i) as u8).collect();
            let ack = producer
                .put(LARGE, bytes::Bytes::from(body.clone()), vec![])
                .await?
                .await?;
            ensure!(
                ack.status == bmq_proto::client::AckStatus::Success as i32,
                "{size} bytes: {ack:?}"
            );
            let m = tokio::time::timeout(Duration::from_secs(30), consumer.next_message())
                .await
                .with_context(|| format!("no delivery of the {size}-byte message"))?
                .context("the consumer's connection ended")?;
            ensure!(
                m.payload.len() == size,
                "{} bytes delivered",
                m.payload.len()
            );
            ensure!(m.payload[..] == body[..], "the {size}-byte message changed");
            consumer.confirm(LARGE, m.guid).await?;
        }
        producer.disconnect().await.ok();
        consumer.disconnect().await.ok();
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", cluster.log_tails(30));
    }
}
