//! The metadata ledger across process restarts (DESIGN.md §5): real `broker`
//! processes, real clients. After a full restart, a follower's restart after missed updates, and
//! a restart from a ledger whose tail was cut mid-record, and a kill while 64 KiB ledgers roll
//! over again and again, every node's `/status` shows the same committed LSN and the same
//! partition and queue assignments. Corruption before the tail stops
//! the node with an error naming the file and the offset.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context};
use bmq_client::{Client, ClientConfig, OpenOptions};
use bmq_proto::admin_doc::{NodeStatusDoc, PartitionDoc, QueueDoc};
use bmq_tests::{metric, Cluster};

const TIMEOUT: Duration = Duration::from_secs(30);

/// Opens `names` for writing (each first open commits a queue assignment), then disconnects.
async fn open_queues(brokers: Vec<String>, names: impl AsRef<[String]>) -> anyhow::Result<()> {
    let mut config = ClientConfig::new(brokers);
    config.request_timeout = Duration::from_secs(20);
    let client = Client::connect(config).await.context("connect")?;
    for uri in names.as_ref() {
        client
            .open_queue(uri, OpenOptions::write())
            .await
            .with_context(|| format!("open {uri}"))?;
    }
    let _ = client.disconnect().await;
    Ok(())
}

/// `"term:sequence"` as a comparable pair.
fn parse_lsn(text: &str) -> anyhow::Result<(u64, u64)> {
    let (t, s) = text
        .split_once(':')
        .with_context(|| format!("bad LSN {text}"))?;
    Ok((t.parse()?, s.parse()?))
}

fn queue_names(prefix: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("bmq://bmq.test/{prefix}-{i}"))
        .collect()
}

/// What must be identical on every node: committed LSN, primaries with leases, assignments.
type Agreed = (
    String,
    Vec<(u32, Option<u32>, u64)>,
    Vec<(String, u32, u64)>,
);

fn agreed(s: &NodeStatusDoc) -> Agreed {
    let partitions = s
        .partitions
        .iter()
        .map(|p: &PartitionDoc| (p.partition_id, p.primary, p.primary_lease_id))
        .collect();
    let mut queues: Vec<(String, u32, u64)> = s
        .queues
        .iter()
        .map(|q: &QueueDoc| (q.uri.clone(), q.partition_id, q.queue_key))
        .collect();
    queues.sort();
    (s.metadata.committed_lsn.clone(), partitions, queues)
}

/// Waits until every running node reports the same committed LSN, partitions and queues, and
/// those queues include `expected`; returns the agreed view.
async fn wait_for_agreement(cluster: &Cluster, expected: &[String]) -> anyhow::Result<Agreed> {
    let docs = cluster
        .wait_for_all(TIMEOUT, "every node agrees on LSN and assignments", |s| {
            let held: BTreeSet<&str> = s.queues.iter().map(|q| q.uri.as_str()).collect();
            expected.iter().all(|uri| held.contains(uri.as_str()))
        })
        .await?;
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    let mut docs = docs;
    loop {
        let views: BTreeSet<Agreed> = docs.iter().map(agreed).collect();
        if views.len() == 1 {
            return Ok(views.into_iter().next().expect("one view"));
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "nodes disagree: {views:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        docs = cluster
            .wait_for_all(TIMEOUT, "every node answers", |_| true)
            .await?;
    }
}

/// The newest ledger file of node `id`.
fn newest_ledger(cluster: &Cluster, id: u32) -> anyhow::Result<PathBuf> {
    let dir = cluster.node(id).config.data_dir.join("ledger");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "bmql"))
        .collect();
    files.sort();
    files
        .pop()
        .with_context(|| format!("no ledger in {}", dir.display()))
}

/// Runs `body` and, on failure, panics with the nodes' log tails.
async fn run(cluster: &mut Cluster, body: impl AsyncFnOnce(&mut Cluster) -> anyhow::Result<()>) {
    if let Err(e) = body(cluster).await {
        panic!("{e:#}\n{}", cluster.log_tails(40));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_restart_keeps_the_same_lsn_and_assignments_on_every_node() {
    // Scenario: open queues, stop every node, start them all again: the assignments come back
    // from the ledgers and every node agrees on one committed LSN.
    let mut cluster = Cluster::start(3).expect("cluster starts");
    run(&mut cluster, async |cluster| {
        cluster.wait_for_leader(TIMEOUT).await?;
        let names = queue_names("restart", 6);
        open_queues(cluster.client_addrs(), &names).await?;
        let (lsn_before, _, queues_before) = wait_for_agreement(cluster, &names).await?;
        for id in 1..=3 {
            cluster.stop_node(id)?;
        }
        for id in 1..=3 {
            cluster.start_node(id)?;
        }
        cluster.wait_for_leader(TIMEOUT).await?;
        let (lsn_after, _, queues_after) = wait_for_agreement(cluster, &names).await?;
        ensure!(
            queues_after == queues_before,
            "assignments changed: {queues_before:?} -> {queues_after:?}"
        );
        ensure!(
            parse_lsn(&lsn_after)? >= parse_lsn(&lsn_before)?,
            "committed LSN went back: {lsn_before} -> {lsn_after}"
        );
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_missed_updates_catches_up_after_restart() {
    // Scenario: a follower is killed, more queues are assigned while it is down, it restarts
    // and reaches the same LSN and assignments as the others.
    let mut cluster = Cluster::start(3).expect("cluster starts");
    run(&mut cluster, async |cluster| {
        let (leader, _) = cluster.wait_for_leader(TIMEOUT).await?;
        let first = queue_names("early", 3);
        open_queues(cluster.client_addrs(), &first).await?;
        wait_for_agreement(cluster, &first).await?;
        let follower = (1..=3).find(|&id| id != leader).expect("a follower");
        cluster.kill_node(follower)?;
        let later = queue_names("missed", 5);
        let brokers: Vec<String> = (1..=3)
            .filter(|&id| id != follower)
            .map(|id| cluster.node(id).client_addr())
            .collect();
        open_queues(brokers, &later).await?;
        cluster.start_node(follower)?;
        let all: Vec<String> = first.iter().chain(&later).cloned().collect();
        let (_, _, queues) = wait_for_agreement(cluster, &all).await?;
        ensure!(queues.len() >= all.len(), "queues missing: {queues:?}");
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_cut_mid_record_is_truncated_and_the_node_rejoins() {
    // Scenario: a node is killed, the last record of its ledger is cut in the middle (a torn
    // write), and it restarts: it truncates the torn tail (counted), rejoins, and agrees.
    let mut cluster = Cluster::start(3).expect("cluster starts");
    run(&mut cluster, async |cluster| {
        let (leader, _) = cluster.wait_for_leader(TIMEOUT).await?;
        let names = queue_names("torn", 4);
        open_queues(cluster.client_addrs(), &names).await?;
        wait_for_agreement(cluster, &names).await?;
        let victim = (1..=3).find(|&id| id != leader).expect("a follower");
        cluster.kill_node(victim)?;
        let ledger = newest_ledger(cluster, victim)?;
        // The file's length runs ahead of the records, zero-filled: the records end after the
        // last byte that is not zero (or up to three bytes later, if their checksum ends in
        // zeros).
        let bytes = std::fs::read(&ledger)?;
        let end = bytes
            .iter()
            .rposition(|b| *b != 0)
            .context("an empty ledger")?
            + 1;
        // A few bytes off the end: inside the last record (a record is far longer than 3 bytes).
        let file = std::fs::OpenOptions::new().write(true).open(&ledger)?;
        file.set_len(end as u64 - 3)?;
        drop(file);
        cluster.start_node(victim)?;
        wait_for_agreement(cluster, &names).await?;
        let truncations = metric(
            &cluster.node(victim).admin_addr(),
            "bmq_ledger_torn_tail_truncations_total",
        )
        .await?;
        ensure!(
            truncations >= 1.0,
            "the torn tail was not counted ({truncations})"
        );
        Ok(())
    })
    .await;
}

/// [`open_queues`] with `names` split among `clients` connections opening at the same time.
async fn open_queues_in_parallel(
    brokers: Vec<String>,
    names: &[String],
    clients: usize,
) -> anyhow::Result<()> {
    let mut tasks = Vec::new();
    for chunk in names.chunks(names.len().div_ceil(clients)) {
        tasks.push(tokio::spawn(open_queues(brokers.clone(), chunk.to_vec())));
    }
    for task in tasks {
        task.await.context("opening task")??;
    }
    Ok(())
}

/// The ledger files of node `id` (names), sorted.
fn ledger_files(cluster: &Cluster, id: u32) -> anyhow::Result<Vec<String>> {
    let dir = cluster.node(id).config.data_dir.join("ledger");
    let mut names: Vec<String> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    Ok(names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledgers_roll_over_under_load_and_a_node_killed_meanwhile_agrees_after_restart() {
    // Scenario: with the smallest ledger file size (64 KiB), 1,800 queue
    // assignments roll every node's ledger over at least twice — each rollover's snapshot
    // written beside the fsyncs, then switched to. A follower is SIGKILLed half-way (perhaps in
    // the middle of a rollover) and restarted after more assignments: every node agrees on
    // every assignment, each holds one ledger file, and the rollovers are counted.
    let mut cluster = Cluster::configure(3, |c| {
        c.metadata.ledger_max_file_size_bytes = 65_536;
    })
    .expect("cluster configured");
    run(&mut cluster, async |cluster| {
        for id in 1..=3 {
            cluster.start_node(id)?;
        }
        let (leader, _) = cluster.wait_for_leader(TIMEOUT).await?;
        let first = queue_names("roll-early", 1000);
        open_queues_in_parallel(cluster.client_addrs(), &first, 4).await?;
        let follower = (1..=3).find(|&id| id != leader).expect("a follower");
        cluster.kill_node(follower)?;
        let later = queue_names("roll-late", 800);
        let brokers: Vec<String> = (1..=3)
            .filter(|&id| id != follower)
            .map(|id| cluster.node(id).client_addr())
            .collect();
        open_queues_in_parallel(brokers, &later, 4).await?;
        cluster.start_node(follower)?;
        let all: Vec<String> = first.iter().chain(&later).cloned().collect();
        let (_, _, queues) = wait_for_agreement(cluster, &all).await?;
        ensure!(
            queues.len() >= all.len(),
            "queues missing: {}",
            queues.len()
        );
        for id in 1..=3 {
            let files = ledger_files(cluster, id)?;
            ensure!(
                files.len() == 1 && files[0] != "ledger-0.bmql",
                "node {id}: one rolled-over ledger file expected, found {files:?}"
            );
        }
        let rollovers = metric(
            &cluster.node(leader).admin_addr(),
            "bmq_metadata_ledger_rollovers_total",
        )
        .await?;
        ensure!(
            rollovers >= 2.0,
            "the leader's ledger rolled over {rollovers} times"
        );
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corruption_before_the_tail_stops_the_node_naming_file_and_offset() {
    // Scenario: a byte in the ledger's first record is damaged while the node is down; on
    // start the node refuses to run and says which file and which offset are corrupt.
    let mut cluster = Cluster::start(3).expect("cluster starts");
    run(&mut cluster, async |cluster| {
        let (leader, _) = cluster.wait_for_leader(TIMEOUT).await?;
        let names = queue_names("corrupt", 3);
        open_queues(cluster.client_addrs(), &names).await?;
        wait_for_agreement(cluster, &names).await?;
        let victim = (1..=3).find(|&id| id != leader).expect("a follower");
        cluster.kill_node(victim)?;
        let ledger = newest_ledger(cluster, victim)?;
        let mut bytes = std::fs::read(&ledger)?;
        // Byte 40: inside the first record's header or body (the file header is 16 bytes),
        // with later records after it, so this is not a torn tail.
        // (The file's length runs ahead of the records, zero-filled.)
        let records_end = bytes.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
        ensure!(
            records_end > 200,
            "ledger unexpectedly short: {records_end} bytes of records"
        );
        bytes[40] ^= 0xff;
        std::fs::write(&ledger, &bytes)?;
        cluster.start_node(victim)?;
        let status = cluster
            .wait_for_exit(victim, TIMEOUT)?
            .context("the node kept running on a corrupt ledger")?;
        ensure!(!status.success(), "the node exited successfully: {status}");
        let stderr =
            std::fs::read_to_string(cluster.node(victim).config.data_dir.join("stderr.log"))?;
        let file_name = ledger
            .file_name()
            .expect("a file")
            .to_string_lossy()
            .into_owned();
        ensure!(
            stderr.contains(&file_name) && stderr.contains("offset"),
            "stderr does not name {file_name} and the offset:\n{stderr}"
        );
        Ok(())
    })
    .await;
}
