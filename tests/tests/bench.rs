//! `bmqctl bench` against real broker processes: the report's shape and counts (never its
//! speed: benchmarks measure, tests check behaviour).

use std::time::Duration;

use bmq_tests::Cluster;
use bmqctl::bench::{self, MessagesArgs, MetadataArgs};
use bmqctl::credentials::ClientSecurityArgs;

fn plain() -> ClientSecurityArgs {
    ClientSecurityArgs {
        no_tls: true,
        token: Some(String::new()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_bench_reports_every_message_produced_and_consumed() {
    // Two producers and two consumers over two queues of a 3-node cluster: every ACKed message
    // is consumed, nothing fails, and the JSON report has the documented fields.
    let cluster = Cluster::start(3).expect("cluster starts");
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .expect("a leader is elected");
    let report = bench::run_messages(MessagesArgs {
        domain: "bmq.test".into(),
        queue_prefix: "bench-test".into(),
        run_id: None,
        queues: 2,
        producers: 2,
        consumers: 2,
        size: 256,
        count: 2_000,
        duration_secs: None,
        rate: 0,
        window: 100,
        max_unconfirmed: 100,
        broker: cluster.client_addrs(),
        drain_timeout_secs: 60,
        json: true,
        quiet: true,
        security: plain(),
    })
    .await
    .expect("bench runs");
    assert_eq!(report.sent, 2_000);
    assert_eq!(report.produced.messages, 2_000, "{report:?}");
    assert_eq!(report.produced.bytes, 2_000 * 256);
    assert_eq!(report.missing, 0, "{report:?}");
    assert_eq!(
        report.consumed.messages - report.redeliveries,
        2_000,
        "{report:?}"
    );
    assert_eq!(report.errors, 0, "{report:?}");
    assert!(report.nacks.is_empty(), "{report:?}");
    assert_eq!(report.ack_latency.count, 2_000);
    assert!(report.e2e_latency.count >= 2_000);
    assert!(report.ack_latency.p50_us <= report.ack_latency.p99_us);
    assert!(report.ack_latency.p99_us <= report.ack_latency.max_us);
    // Some gap between the 2,000 ACKs, and none longer than the run.
    assert!(report.ack_gap_max_ms > 0.0, "{report:?}");
    assert!(
        report.ack_gap_max_ms <= report.produced.elapsed_secs * 1e3,
        "{report:?}"
    );

    let json = serde_json::to_value(&report).expect("serializes");
    for key in [
        "produced",
        "consumed",
        "ack_latency",
        "ack_gap_max_ms",
        "e2e_latency",
        "nacks",
        "errors",
    ] {
        assert!(json.get(key).is_some(), "missing {key} in {json}");
    }
    for key in ["p50_us", "p90_us", "p99_us", "p999_us", "max_us"] {
        assert!(json["ack_latency"].get(key).is_some(), "missing {key}");
    }
    assert!(json["produced"]["msgs_per_sec"].as_f64().unwrap() > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_bench_fails_with_the_clients_error_when_a_queue_is_refused() {
    // Each bench client runs on a thread of its own: a client whose queue is refused ends the
    // run with its error (not a hang, not a panic), and so does one whose broker is gone.
    let cluster = Cluster::start(1).expect("cluster starts");
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .expect("a leader is elected");
    let args = |domain: &str, broker: Vec<String>| MessagesArgs {
        domain: domain.into(),
        queue_prefix: "bench-refused".into(),
        run_id: None,
        queues: 1,
        producers: 1,
        consumers: 1,
        size: 64,
        count: 10,
        duration_secs: None,
        rate: 0,
        window: 10,
        max_unconfirmed: 10,
        broker,
        drain_timeout_secs: 5,
        json: true,
        quiet: true,
        security: plain(),
    };
    let refused = tokio::time::timeout(
        Duration::from_secs(60),
        bench::run_messages(args("no.such.domain", cluster.client_addrs())),
    )
    .await
    .expect("the run ends")
    .expect_err("an unknown domain is refused");
    assert!(
        format!("{refused:#}").contains("cannot open"),
        "{refused:#}"
    );
    drop(cluster);
    let gone = tokio::time::timeout(
        Duration::from_secs(60),
        bench::run_messages(args("bmq.test", vec!["127.0.0.1:1".into()])),
    )
    .await
    .expect("the run ends")
    .expect_err("nobody listens on port 1");
    assert!(format!("{gone:#}").contains("cannot connect"), "{gone:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_bench_commits_one_assignment_per_new_queue() {
    // Opening 20 new queues commits 20 assignments, visible in every node's cluster state.
    let cluster = Cluster::start(3).expect("cluster starts");
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .expect("a leader is elected");
    let report = bench::run_metadata(MetadataArgs {
        domain: "bmq.test".into(),
        queues: 20,
        parallel: 2,
        broker: cluster.client_addrs(),
        timeout_secs: 30,
        admin: cluster.nodes.iter().map(|n| n.admin_addr()).collect(),
        json: true,
        quiet: true,
        security: plain(),
    })
    .await
    .expect("bench runs");
    assert_eq!((report.opened, report.errors), (20, 0), "{report:?}");
    assert_eq!(report.open_latency.count, 20);
    // --admin: the leader's histogram counted (at least) the 20 commits.
    let leader = report.leader.as_ref().expect("--admin given");
    assert!(leader.commits >= 20, "{report:?}");
    assert!(leader.p50_le_us > 0, "{report:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let counts: Vec<usize> = cluster
            .statuses()
            .await
            .into_iter()
            .map(|(_, s)| s.map(|s| s.queues.len()).unwrap_or(0))
            .collect();
        if counts.iter().all(|&n| n >= 20) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "assignments not on every node: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_open_bench_names_the_partition_the_queue_is_assigned_to() {
    // `bench first-open --opens 1` (no fault) opens one new queue through node 1 and reports
    // the partition its answer named: the partition every node's committed state holds.
    let cluster = Cluster::start(3).expect("cluster starts");
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .expect("a leader is elected");
    let report = bmqctl::bench_first_open::run(bmqctl::bench_first_open::FirstOpenArgs {
        domain: "bmq.test".into(),
        queue_prefix: "probe".into(),
        run_id: Some(0xab),
        opens: 1,
        broker: vec![cluster.client_addrs()[0].clone()],
        interval_ms: 10,
        timeout_secs: 30,
        kill_pid: None,
        partitions: Vec::new(),
        json: true,
        security: plain(),
    })
    .await
    .expect("the open succeeds");
    let first = report.first.expect("one open succeeded");
    // /readyz (which leaves the queue list out) says ready while /status lists the queue.
    for node in &cluster.nodes {
        bmqctl::http::get(&node.admin_addr(), "/readyz")
            .await
            .expect("a node of a settled cluster is ready");
    }
    assert_eq!(first.uri, "bmq://bmq.test/probe-000000ab-0");
    assert_eq!((report.opens_started, report.opens_failed), (1, 0));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let partitions: Vec<Option<u32>> = cluster
            .statuses()
            .await
            .into_iter()
            .map(|(_, s)| {
                s.ok().and_then(|s| {
                    s.queues
                        .iter()
                        .find(|q| q.uri == first.uri)
                        .map(|q| q.partition_id)
                })
            })
            .collect();
        if partitions.iter().all(|p| p.is_some()) {
            assert!(
                partitions.iter().all(|p| *p == Some(first.partition)),
                "{partitions:?} against {first:?}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "assignment not on every node: {partitions:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
