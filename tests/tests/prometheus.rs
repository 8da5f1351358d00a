//! The shipped dashboards and alert rules against a real Prometheus server scraping a real
//! 3-node cluster.
//!
//! Needs Debian's `prometheus` package (`prometheus` and `promtool` on `PATH`); `.ci/run`
//! installs it when missing. Without it these tests fail with that instruction: they are never
//! skipped.
//!
//! Grafana variables are substituted before Prometheus evaluates a panel's expression:
//! `$__rate_interval` -> `15s` (Grafana's value is at least 4 x the 1 s scrape interval; 15 s
//! keeps several samples per window), `$node` -> `.*` (the dashboards' "All"). Each panel
//! target is evaluated as Grafana does, as a range query over the whole test (1 s step), and must
//! return at least one series with at least one finite value.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context};
use bmq_client::{Client, ClientConfig, OpenOptions};
use bmq_proto::client::{
    client_message::Kind, AckStatus, ClientMessage, ConsumerOptions, Hello, Put,
};
use bmq_proto::FrameCodec;
use bmq_tests::prometheus::{http_get, tool, PrometheusServer};
use bmq_tests::{repo_root, Cluster};
use bmqctl::prometheus::{self, ScrapeTarget};
use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

/// Grafana's `$__rate_interval`, as substituted for evaluation (see the module doc).
const RATE_INTERVAL: &str = "15s";

/// Metrics the dashboards show that no component emits yet. A panel whose every target uses
/// only these must still parse, but need not return data; once such a metric appears in a
/// scrape, the test fails until it is removed from this list, so the exemption cannot outlive
/// its reason.
const PENDING_METRICS: &[(&str, &str)] = &[];

/// Panels whose data must show traffic this test caused (a value above 0 at some point), by
/// dashboard uid and panel title.
const MUST_BE_POSITIVE: &[(&str, &str)] = &[
    ("bmq-queues", "PUT rate"),
    ("bmq-queues", "ACK rate"),
    ("bmq-queues", "PUSH rate"),
    ("bmq-queues", "CONFIRM rate"),
    ("bmq-queues", "Redeliveries"),
    ("bmq-queues", "NACKs by reason"),
    ("bmq-queues", "Depth per partition"),
    ("bmq-queues", "Unconfirmed per partition"),
    ("bmq-queues", "ACK latency"),
    ("bmq-queues", "Journal fsync latency"),
    ("bmq-node", "Rejected client input"),
    ("bmq-node", "Client sessions"),
    ("bmq-cluster", "Elections"),
    ("bmq-cluster", "Commit latency (leader)"),
    ("bmq-storage", "Commits per second"),
    ("bmq-storage", "Journal size"),
    ("bmq-storage", "Journal writes"),
    ("bmq-storage", "Outstanding messages"),
    ("bmq-node", "Data link losses"),
];

fn run_promtool(args: &[&std::ffi::OsStr]) -> anyhow::Result<()> {
    let output = Command::new(tool("promtool")?)
        .args(args)
        .output()
        .context("run promtool")?;
    ensure!(
        output.status.success(),
        "promtool {:?} failed: {}{}",
        args,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// The shipped configuration, a configuration rendered for other targets, and the shipped
/// alert rules all pass `promtool check`, and the rules pass their unit tests
/// (`dashboards/prometheus/alerts_test.yml`: synthetic series, the alerts each must and must
/// not raise, with their labels and annotations).
#[test]
fn promtool_accepts_the_shipped_config_and_rules() {
    let root = repo_root();
    let config = root.join("dashboards/prometheus/prometheus.yml");
    let rules = root.join("dashboards/prometheus/alerts.yml");
    let rule_tests = root.join("dashboards/prometheus/alerts_test.yml");
    run_promtool(&["check".as_ref(), "config".as_ref(), config.as_os_str()]).unwrap();
    run_promtool(&["check".as_ref(), "rules".as_ref(), rules.as_os_str()]).unwrap();
    run_promtool(&["test".as_ref(), "rules".as_ref(), rule_tests.as_os_str()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rendered = prometheus::write_config(
        dir.path(),
        &[ScrapeTarget {
            node_id: 4,
            admin_addr: "127.0.0.1:1".into(),
        }],
    )
    .unwrap();
    run_promtool(&["check".as_ref(), "config".as_ref(), rendered.as_os_str()]).unwrap();
}

fn client_config(brokers: Vec<String>, id: &str) -> ClientConfig {
    let mut config = ClientConfig::new(brokers);
    config.client_id = id.to_string();
    config.request_timeout = Duration::from_secs(20);
    config
}

fn reader(max_unconfirmed: u32) -> OpenOptions {
    OpenOptions::read(ConsumerOptions {
        max_unconfirmed_messages: max_unconfirmed,
        ..Default::default()
    })
}

/// Puts `count` messages on `uri` through `producer_brokers` and consumes (and confirms) them
/// through `consumer_brokers`.
async fn traffic(
    producer_brokers: Vec<String>,
    consumer_brokers: Vec<String>,
    uri: &str,
    count: usize,
) -> anyhow::Result<()> {
    let consumer = Client::connect(client_config(consumer_brokers, "prom-consumer")).await?;
    consumer.open_queue(uri, reader(1000)).await?;
    let producer = Client::connect(client_config(producer_brokers, "prom-producer")).await?;
    producer.open_queue(uri, OpenOptions::write()).await?;
    let produce = async {
        let mut acks = Vec::with_capacity(count);
        for i in 0..count {
            let payload = bytes::Bytes::from(format!("message {i}"));
            acks.push(producer.put(uri, payload, vec![]).await?);
        }
        for ack in acks {
            let ack = ack.await?;
            ensure!(ack.status == AckStatus::Success as i32, "nack: {ack:?}");
        }
        anyhow::Ok(())
    };
    let consume = async {
        for _ in 0..count {
            let msg = tokio::time::timeout(Duration::from_secs(30), consumer.next_message())
                .await
                .context("consumer timed out")?
                .context("consumer stream ended")?;
            consumer.confirm(&msg.uri, msg.guid.clone()).await?;
        }
        anyhow::Ok(())
    };
    tokio::try_join!(produce, consume)?;
    producer.disconnect().await.ok();
    consumer.disconnect().await.ok();
    Ok(())
}

/// A consumer takes `count` messages without confirming and disconnects; a second consumer gets
/// them again (delivery attempt 2) and confirms them.
async fn redelivery(brokers: Vec<String>, uri: &str, count: usize) -> anyhow::Result<()> {
    let producer = Client::connect(client_config(brokers.clone(), "prom-redeliver-p")).await?;
    producer.open_queue(uri, OpenOptions::write()).await?;
    let first = Client::connect(client_config(brokers.clone(), "prom-redeliver-1")).await?;
    first.open_queue(uri, reader(1000)).await?;
    for i in 0..count {
        let ack = producer
            .put(uri, bytes::Bytes::from(format!("again {i}")), vec![])
            .await?
            .await?;
        ensure!(ack.status == AckStatus::Success as i32, "nack: {ack:?}");
    }
    for _ in 0..count {
        tokio::time::timeout(Duration::from_secs(30), first.next_message())
            .await
            .context("first consumer timed out")?
            .context("first consumer stream ended")?;
    }
    first.disconnect().await.ok();
    let second = Client::connect(client_config(brokers, "prom-redeliver-2")).await?;
    second.open_queue(uri, reader(1000)).await?;
    let mut redelivered = 0;
    for _ in 0..count {
        let msg = tokio::time::timeout(Duration::from_secs(30), second.next_message())
            .await
            .context("second consumer timed out")?
            .context("second consumer stream ended")?;
        if msg.delivery_attempt > 1 {
            redelivered += 1;
        }
        second.confirm(&msg.uri, msg.guid.clone()).await?;
    }
    ensure!(
        redelivered == count,
        "{redelivered} of {count} were redeliveries"
    );
    producer.disconnect().await.ok();
    second.disconnect().await.ok();
    Ok(())
}

/// Bad client input that the node counts: an undecodable first frame, a PUT before Hello, and
/// a PUT on a queue the session has not opened (a NACK with reason `not_open`).
async fn bad_client_input(addr: &str) -> anyhow::Result<()> {
    for bytes in [
        &[0u8, 0, 0, 4, 0xff, 0xff, 0xff, 0xff][..],
        &encode(ClientMessage {
            kind: Some(Kind::Put(Put {
                uri: "bmq://bmq.test/early".into(),
                guid: vec![1u8; 16].into(),
                payload: "x".into(),
                properties: vec![],
            })),
        })?,
    ] {
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(bytes).await?;
        let mut buf = [0u8; 4096];
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while let Ok(n) = stream.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
    }
    let mut raw = Framed::new(
        TcpStream::connect(addr).await?,
        FrameCodec::<ClientMessage>::new(1 << 20),
    );
    raw.send(ClientMessage {
        kind: Some(Kind::Hello(Hello {
            client_id: "prom-raw".into(),
            protocol_version: bmq_proto::PROTOCOL_VERSION,
            token: String::new(),
        })),
    })
    .await?;
    raw.send(ClientMessage {
        kind: Some(Kind::Put(Put {
            uri: "bmq://bmq.test/never-opened".into(),
            guid: vec![2u8; 16].into(),
            payload: "x".into(),
            properties: vec![],
        })),
    })
    .await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(remaining, raw.next()).await {
            Ok(Some(Ok(ClientMessage {
                kind: Some(Kind::Ack(ack)),
            }))) => {
                ensure!(
                    ack.status != AckStatus::Success as i32,
                    "a PUT on an unopened queue was acknowledged"
                );
                return Ok(());
            }
            Ok(Some(Ok(_))) => continue,
            other => bail!("no NACK for a PUT on an unopened queue: {other:?}"),
        }
    }
}

fn encode(message: ClientMessage) -> anyhow::Result<Vec<u8>> {
    use tokio_util::codec::Encoder;
    let mut buf = bytes::BytesMut::new();
    FrameCodec::<ClientMessage>::new(1 << 20).encode(message, &mut buf)?;
    Ok(buf.to_vec())
}

/// A dashboard panel target, with the Grafana variables substituted.
struct PanelQuery {
    dashboard: String,
    panel: String,
    expr: String,
}

fn dashboard_queries() -> anyhow::Result<Vec<PanelQuery>> {
    let dir = repo_root().join("dashboards/grafana");
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    ensure!(
        files.len() == 4,
        "expected 4 dashboards in {}",
        dir.display()
    );
    for file in files {
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&file)?)
            .with_context(|| format!("{} is not JSON", file.display()))?;
        let uid = doc["uid"]
            .as_str()
            .context("dashboard without uid")?
            .to_string();
        let mut panels = 0;
        for panel in doc["panels"].as_array().context("no panels")? {
            if panel["type"] == "row" {
                continue;
            }
            panels += 1;
            let title = panel["title"].as_str().unwrap_or("?").to_string();
            let targets = panel["targets"]
                .as_array()
                .context("panel without targets")?;
            ensure!(!targets.is_empty(), "{uid}/{title}: no targets");
            for t in targets {
                let expr = t["expr"].as_str().context("target without expr")?;
                out.push(PanelQuery {
                    dashboard: uid.clone(),
                    panel: title.clone(),
                    expr: expr
                        .replace("$__rate_interval", RATE_INTERVAL)
                        .replace("$node", ".*"),
                });
            }
        }
        ensure!(panels > 0, "{uid}: no panels");
    }
    Ok(out)
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64()
}

/// Every finite sample value of a range query's matrix.
fn finite_values(result: &[Value]) -> Vec<f64> {
    result
        .iter()
        .flat_map(|series| series["values"].as_array().cloned().unwrap_or_default())
        .filter_map(|point| point[1].as_str()?.parse::<f64>().ok())
        .filter(|v| v.is_finite())
        .collect()
}

/// Checks every panel target of every dashboard; returns the failures, one line each.
async fn check_dashboards(prom: &PrometheusServer, start: f64) -> anyhow::Result<Vec<String>> {
    let end = unix_now();
    let (start, end) = (format!("{start:.3}"), format!("{end:.3}"));
    let mut failures = Vec::new();
    let mut positive: std::collections::HashMap<(String, String), bool> = Default::default();
    for q in dashboard_queries()? {
        let v = prom
            .get(
                "/api/v1/query_range",
                &[
                    ("query", &q.expr),
                    ("start", &start),
                    ("end", &end),
                    ("step", "1"),
                ],
            )
            .await?;
        let name = format!("{} / {}: {}", q.dashboard, q.panel, q.expr);
        if v["status"] != "success" {
            failures.push(format!("{name}: {}", v["error"]));
            continue;
        }
        let result = v["data"]["result"].as_array().cloned().unwrap_or_default();
        let values = finite_values(&result);
        let pending = PENDING_METRICS
            .iter()
            .find(|(metric, _)| q.expr.contains(metric));
        match (pending, values.is_empty()) {
            (Some((metric, why)), true) => {
                eprintln!("pending (no data required): {name} — {metric}: {why}");
            }
            (Some((metric, _)), false) => failures.push(format!(
                "{name}: {metric} now has data: remove it from PENDING_METRICS"
            )),
            (None, true) => failures.push(format!("{name}: no data")),
            (None, false) => {}
        }
        let key = (q.dashboard.clone(), q.panel.clone());
        let any_positive = values.iter().any(|v| *v > 0.0);
        *positive.entry(key).or_insert(false) |= any_positive;
    }
    for (uid, title) in MUST_BE_POSITIVE {
        match positive.get(&(uid.to_string(), title.to_string())) {
            Some(true) => {}
            Some(false) => failures.push(format!(
                "{uid} / {title}: never above 0 although the test caused that traffic"
            )),
            None => failures.push(format!("{uid} / {title}: no such panel")),
        }
    }
    Ok(failures)
}

/// Every alert rule is loaded, parses as an instant query, and evaluates without error.
async fn check_rules(prom: &PrometheusServer) -> anyhow::Result<Vec<String>> {
    let v = prom.get("/api/v1/rules", &[]).await?;
    ensure!(v["status"] == "success", "rules: {v}");
    let mut failures = Vec::new();
    let mut names = Vec::new();
    for group in v["data"]["groups"].as_array().context("no rule groups")? {
        for rule in group["rules"].as_array().context("no rules")? {
            let name = rule["name"].as_str().unwrap_or("?").to_string();
            let expr = rule["query"].as_str().unwrap_or("");
            if rule["health"] != "ok" {
                failures.push(format!(
                    "rule {name}: health {} {}",
                    rule["health"], rule["lastError"]
                ));
            }
            let q = prom.get("/api/v1/query", &[("query", expr)]).await?;
            if q["status"] != "success" {
                failures.push(format!("rule {name}: {expr}: {}", q["error"]));
            }
            names.push(name);
        }
    }
    names.sort();
    let expected = [
        "BmqJournalDiskFull",
        "BmqJournalWriteFailures",
        "BmqLeaderFlapping",
        "BmqMessagesRemovedWithoutConfirm",
        "BmqMetadataReplicationLag",
        "BmqNoLeader",
        "BmqNodeDown",
        "BmqPartitionReplicationStalled",
        "BmqPartitionThreadStalls",
        "BmqPartitionWithoutActivePrimary",
        "BmqPeerAuthFailures",
        "BmqQuorumLost",
    ];
    if names != expected {
        failures.push(format!("rules loaded: {names:?}, expected {expected:?}"));
    }
    Ok(failures)
}

/// Every metric family a node exports is in docs/METRICS.md with its type, and every metric a
/// dashboard or rule uses is documented there and exported by a node (a rule over a misspelt
/// name would evaluate without error and never fire).
async fn check_reference(cluster: &Cluster) -> anyhow::Result<Vec<String>> {
    let reference = std::fs::read_to_string(repo_root().join("docs/METRICS.md"))?;
    let mut failures = Vec::new();
    let mut exported = std::collections::HashSet::new();
    for node in cluster.nodes.iter().filter(|n| n.is_running()) {
        let (status, body) = http_get(&node.admin_addr(), "/metrics").await?;
        ensure!(status == 200, "/metrics of node {}: HTTP {status}", node.id);
        for line in body.lines().filter(|l| l.starts_with("# TYPE ")) {
            let mut parts = line.split_whitespace().skip(2);
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            exported.insert(name.to_string());
            let row = format!("| `{name}` | {kind} |");
            if !reference.contains(&row) && !failures.iter().any(|f: &String| f.contains(&row)) {
                failures.push(format!("docs/METRICS.md lacks the row starting {row}"));
            }
        }
    }
    let mut used = Vec::new();
    let rules = std::fs::read_to_string(repo_root().join("dashboards/prometheus/alerts.yml"))?;
    let exprs = dashboard_queries()?
        .into_iter()
        .map(|q| q.expr)
        .chain([rules]);
    for expr in exprs {
        for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("bmq_") || word.starts_with("process_") {
                // A histogram's series are documented under the histogram's name.
                let base = ["_bucket", "_count", "_sum"]
                    .iter()
                    .find_map(|suffix| word.strip_suffix(suffix))
                    .filter(|base| base.ends_with("_seconds"))
                    .unwrap_or(word);
                if !used.contains(&base.to_string()) {
                    used.push(base.to_string());
                }
            }
        }
    }
    for metric in used {
        if !reference.contains(&format!("| `{metric}` |")) {
            failures.push(format!(
                "{metric} is used by a dashboard or rule but not documented"
            ));
        }
        if !exported.contains(&metric) {
            failures.push(format!(
                "{metric} is used by a dashboard or rule but no node exports it"
            ));
        }
    }
    Ok(failures)
}

/// A 3-node cluster scraped by a real Prometheus with the shipped configuration: after traffic
/// (messages, a redelivery, a NACK, bad frames) and a SIGKILL of the leader, every dashboard
/// panel returns data, every alert rule evaluates, BmqNodeDown fires for the killed node, and
/// docs/METRICS.md documents every exported metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboards_and_alerts_work_against_a_live_cluster() {
    let mut cluster = Cluster::start(3).expect("start cluster");
    let targets: Vec<ScrapeTarget> = cluster
        .nodes
        .iter()
        .map(|n| ScrapeTarget {
            node_id: n.id,
            admin_addr: n.admin_addr(),
        })
        .collect();
    let prom = PrometheusServer::start(&targets).expect("start prometheus");
    let start = unix_now();
    let result = async {
        let (leader, _) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        prom.wait_for(
            "all targets up",
            "up{job=\"bmq\"} == 1",
            Duration::from_secs(30),
            |r| r.len() == 3,
        )
        .await?;
        let addrs = cluster.client_addrs();
        let rotate = |k: usize| -> Vec<String> {
            (0..addrs.len())
                .map(|i| addrs[(i + k) % addrs.len()].clone())
                .collect()
        };

        // Traffic through the proxy path (producer and consumer on different nodes).
        traffic(rotate(0), rotate(1), "bmq://bmq.test/prom-orders", 500).await?;
        redelivery(rotate(2), "bmq://bmq.test/prom-redeliver", 20).await?;
        for addr in &addrs {
            bad_client_input(addr).await?;
        }
        // Messages left unconfirmed in a queue, so depth and unconfirmed show.
        let holder = Client::connect(client_config(rotate(1), "prom-holder")).await?;
        let uri = "bmq://bmq.test/prom-backlog";
        holder.open_queue(uri, reader(5)).await?;
        let backlog_producer = Client::connect(client_config(rotate(0), "prom-backlog-p")).await?;
        backlog_producer
            .open_queue(uri, OpenOptions::write())
            .await?;
        for i in 0..20 {
            let ack = backlog_producer
                .put(uri, bytes::Bytes::from(format!("kept {i}")), vec![])
                .await?
                .await?;
            ensure!(ack.status == AckStatus::Success as i32, "nack: {ack:?}");
        }
        prom.wait_for(
            "the first traffic in Prometheus",
            "sum(bmq_queue_confirm_total{job=\"bmq\"}) >= 520 \
             and on() sum(bmq_partition_messages{job=\"bmq\"}) >= 20 \
             and on() sum(bmq_queue_nack_total{job=\"bmq\"}) >= 3",
            Duration::from_secs(30),
            |r| !r.is_empty(),
        )
        .await?;

        // The leader dies: an election, a new primary for its partitions, and a node down.
        cluster.kill_node(leader)?;
        let (new_leader, _) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        ensure!(
            new_leader != leader,
            "the killed node {leader} is still leader"
        );
        let alive: Vec<String> = cluster
            .nodes
            .iter()
            .filter(|n| n.is_running())
            .map(|n| n.client_addr())
            .collect();
        let reversed: Vec<String> = alive.iter().rev().cloned().collect();
        traffic(alive, reversed, "bmq://bmq.test/prom-after", 200).await?;

        let node_down = format!(
            "ALERTS{{alertname=\"BmqNodeDown\", alertstate=\"firing\", node=\"{leader}\"}}"
        );
        prom.wait_for(
            "BmqNodeDown firing",
            &node_down,
            Duration::from_secs(60),
            |r| r.len() == 1,
        )
        .await?;
        let v = prom.get("/api/v1/alerts", &[]).await?;
        // Label values are strings in Prometheus's JSON.
        let leader_label = leader.to_string();
        let firing = v["data"]["alerts"]
            .as_array()
            .context("no alerts")?
            .iter()
            .any(|a| {
                a["labels"]["alertname"] == "BmqNodeDown"
                    && a["labels"]["node"] == leader_label
                    && a["state"] == "firing"
            });
        ensure!(
            firing,
            "/api/v1/alerts does not list BmqNodeDown firing: {v}"
        );

        // BmqPartitionReplicationStalled's premise on the live cluster: once traffic stops,
        // every active primary's records are all committed (the alert fires on records left
        // uncommitted while the commits stand still). Every partition has an active primary.
        prom.wait_for(
            "every active primary's records committed",
            "(bmq_partition_journal_last_sequence{job=\"bmq\"} \
               - bmq_partition_committed_sequence{job=\"bmq\"}) \
             and on(instance, partition) (bmq_partition_primary_active{job=\"bmq\"} == 1)",
            Duration::from_secs(30),
            |r| {
                r.len() == cluster.node(new_leader).config.partition_count as usize
                    && r.iter().all(|s| s["value"][1] == "0")
            },
        )
        .await?;

        let mut failures = check_dashboards(&prom, start).await?;
        failures.extend(check_rules(&prom).await?);
        failures.extend(check_reference(&cluster).await?);
        drop(holder);
        ensure!(failures.is_empty(), "failures:\n{}", failures.join("\n"));
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!(
            "{e:#}\n--- logs ---\n{}\n--- prometheus ---\n{}",
            cluster.log_tails(30),
            prom.log()
        );
    }
}
