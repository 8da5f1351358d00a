//! Domains as committed cluster state with real processes (DESIGN.md §5a): domains are
//! created, changed and deleted through any node's admin port while the cluster runs,
//! applied by every node at one LSN, and used by clients without a restart; bad requests are
//! refused with their reason and change nothing; a change during a leader failover is
//! applied on every node or on none; a fanout domain's app ids change under a running
//! producer (an added app gets the messages PUT after the change, a removed one's copies are
//! dropped and counted).

use std::time::Duration;

use anyhow::{ensure, Context};
use bmq_proto::admin_doc::NodeStatusDoc;
use bmq_proto::client::AckStatus;
use bmq_tests::{broker_binary, metric, open_producer, round_trip, run_checked, Cluster};

/// `method path` on node `via`'s admin port (no token: the test clusters configure none).
async fn admin(cluster: &Cluster, via: u32, method: &str, path: &str) -> anyhow::Result<String> {
    bmqctl::http::request(&cluster.node(via).admin_addr(), method, path, None).await
}

/// The committed domains version every running node reports, once they agree.
async fn agreed_version(cluster: &Cluster) -> anyhow::Result<String> {
    cluster
        .wait_for_agreement(Duration::from_secs(20), "the domains version", |s| {
            s.domains.as_ref().map(|d| d.version.clone())
        })
        .await?
        .context("no domain state on the nodes")
}

/// `GET /admin/domains/{name}` on node `via`, as JSON.
async fn show(cluster: &Cluster, via: u32, name: &str) -> anyhow::Result<serde_json::Value> {
    let body = admin(cluster, via, "GET", &format!("/admin/domains/{name}")).await?;
    Ok(serde_json::from_str(&body)?)
}

/// `bmqctl domain <args> --admin <node via>`: its standard output.
async fn bmqctl(cluster: &Cluster, via: u32, args: &[&str]) -> anyhow::Result<String> {
    let mut cmd = std::process::Command::new(broker_binary().with_file_name("bmqctl"));
    cmd.arg("domain").args(args).args([
        "--admin",
        &cluster.node(via).admin_addr(),
        "--timeout-ms",
        "20000",
    ]);
    let out = tokio::task::spawn_blocking(move || run_checked(&mut cmd)).await??;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A node other than `leader`.
fn follower(leader: u32) -> u32 {
    if leader == 1 {
        2
    } else {
        1
    }
}

/// Creates a domain through a follower and uses it at once; lowers its depth limit under a
/// producer (the next PUT is refused LIMIT_REACHED); two concurrent updates both apply;
/// refuses bad requests (unknown key, invalid value, name clash, invalid name, unknown
/// domain, a mode change of a domain with queues, a delete of a domain with queues) with
/// nothing changed; drives `bmqctl domain` create, list, show, update and delete; deletes an unused domain, then a used one with --purge, after which its
/// queue is gone and cannot be opened; every change is counted, and a node's file that
/// differs from the committed domains is reported in `/status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn domains_are_created_changed_and_deleted_while_the_cluster_runs() {
    let cluster = Cluster::start(3).expect("start cluster");
    let result = async {
        let (leader, _) = cluster.wait_for_leader(Duration::from_secs(30)).await?;
        let seeded = agreed_version(&cluster).await?;
        let list = admin(&cluster, 3, "GET", "/admin/domains").await?;
        ensure!(
            list.contains("bmq.test.mmap.fanout"),
            "seeded from the file: {list}"
        );
        let via = follower(leader);

        // Create through a follower, with a client that follows no redirect: the follower
        // forwards to the leader and relays its answer; every node applies it.
        let (code, created) = bmqctl::http::request_with_status(
            &cluster.node(via).admin_addr(),
            "PUT",
            "/admin/domains/bmq.rt?max_queue_messages=1000&message_ttl_ms=0",
            None,
        )
        .await?;
        let created = String::from_utf8_lossy(&created);
        ensure!(code == 200, "forwarded by the follower: {code} {created}");
        ensure!(created.contains("created at LSN"), "{created}");
        let v1 = agreed_version(&cluster).await?;
        ensure!(v1 != seeded, "the version moved: {seeded} -> {v1}");
        for id in 1..=3 {
            let d = show(&cluster, id, "bmq.rt").await?;
            ensure!(d["max_queue_messages"] == 1000, "node {id}: {d}");
        }
        // Every node's file now differs from the committed domains, and says so.
        cluster
            .wait_for_all(
                Duration::from_secs(10),
                "the file's disagreement reported",
                |s| {
                    s.domains
                        .as_ref()
                        .and_then(|d| d.file_disagrees.as_deref())
                        .is_some_and(|f| f.contains("bmq.rt is not in the file"))
                },
            )
            .await?;
        // Used at once, through a follower, without a restart.
        let brokers = vec![cluster.node(via).client_addr()];
        round_trip(
            "bmq://bmq.rt/first",
            brokers.clone(),
            brokers.clone(),
            1,
            20,
        )
        .await?;

        // Lower the depth limit under an open producer: its next PUT beyond it is refused.
        let queue = "bmq://bmq.rt/limited";
        let producer = open_producer(queue, brokers.clone(), "limited-producer").await?;
        let put = |seq: u64| {
            let producer = &producer;
            async move {
                let ack = producer
                    .put(queue, bmqctl::payload::encode(7, seq, 64), vec![])
                    .await?
                    .await?;
                anyhow::Ok(ack)
            }
        };
        ensure!(put(0).await?.status == AckStatus::Success as i32);
        let lowered = admin(
            &cluster,
            via,
            "PATCH",
            "/admin/domains/bmq.rt?max_queue_messages=2",
        )
        .await?;
        ensure!(lowered.contains("updated at LSN"), "{lowered}");
        agreed_version(&cluster).await?;
        ensure!(put(1).await?.status == AckStatus::Success as i32);
        let refused = put(2).await?;
        ensure!(
            refused.status == AckStatus::LimitReached as i32,
            "the third PUT over a limit of 2: {refused:?}"
        );
        producer.disconnect().await.ok();

        // Two concurrent updates of one domain: serialised by the leader, both apply.
        let (a, b) = tokio::join!(
            admin(
                &cluster,
                1,
                "PATCH",
                "/admin/domains/bmq.rt?max_queue_bytes=123456"
            ),
            admin(
                &cluster,
                2,
                "PATCH",
                "/admin/domains/bmq.rt?max_delivery_attempts=9"
            ),
        );
        a?;
        b?;
        agreed_version(&cluster).await?;
        let d = show(&cluster, 3, "bmq.rt").await?;
        ensure!(
            d["max_queue_bytes"] == 123456 && d["max_delivery_attempts"] == 9,
            "both concurrent updates apply: {d}"
        );

        // The operator tool: create a fanout domain through a follower, list, show, update,
        // delete it.
        let out = bmqctl(
            &cluster,
            via,
            &[
                "create",
                "bmq.cli",
                "--mode",
                "fanout",
                "--app-ids",
                "a,b",
                "--max-queue-messages",
                "50",
            ],
        )
        .await?;
        ensure!(out.contains("domain bmq.cli created"), "{out}");
        agreed_version(&cluster).await?;
        let table = bmqctl(&cluster, 3, &["list"]).await?;
        ensure!(
            table
                .lines()
                .any(|l| l.starts_with("bmq.cli ") && l.contains("fanout") && l.ends_with("a,b")),
            "{table}"
        );
        let json = bmqctl(&cluster, 3, &["list", "--json"]).await?;
        ensure!(
            serde_json::from_str::<serde_json::Value>(&json).is_ok(),
            "{json}"
        );
        let out = bmqctl(
            &cluster,
            via,
            &["update", "bmq.cli", "--set", "message_ttl_ms=60000"],
        )
        .await?;
        ensure!(out.contains("updated at LSN"), "{out}");
        agreed_version(&cluster).await?;
        let shown: serde_json::Value =
            serde_json::from_str(&bmqctl(&cluster, 3, &["show", "bmq.cli"]).await?)?;
        ensure!(
            shown["message_ttl_ms"] == 60000 && shown["max_queue_messages"] == 50,
            "{shown}"
        );
        let out = bmqctl(&cluster, via, &["delete", "bmq.cli"]).await?;
        ensure!(out.contains("deleted at LSN"), "{out}");
        let refused = bmqctl(
            &cluster,
            via,
            &["update", "bmq.cli", "--set", "mode=priority"],
        )
        .await;
        ensure!(
            format!("{refused:?}").contains("unknown domain"),
            "an update of a deleted domain: {refused:?}"
        );

        // Bad requests: refused with their reason, nothing changed.
        let before = agreed_version(&cluster).await?;
        let bad = [
            (
                "PATCH",
                "/admin/domains/bmq.rt?colour=red",
                "unknown setting \"colour\"",
            ),
            (
                "PATCH",
                "/admin/domains/bmq.rt?max_queue_messages=0",
                "max_queue_messages",
            ),
            (
                "PATCH",
                "/admin/domains/bmq.rt?max_queue_messages=many",
                "max_queue_messages",
            ),
            ("PATCH", "/admin/domains/bmq.rt?mode=fanout", "app_ids"),
            (
                "PATCH",
                "/admin/domains/bmq.rt?mode=broadcast",
                "mode cannot change while it has queues",
            ),
            ("PUT", "/admin/domains/bmq.rt", "exists already"),
            (
                "PUT",
                "/admin/domains/bad%20name",
                "not a valid domain name",
            ),
            (
                "PATCH",
                "/admin/domains/nope?max_queue_messages=5",
                "unknown domain",
            ),
            ("DELETE", "/admin/domains/bmq.rt", "--purge"),
            (
                "PATCH",
                "/admin/domains/bmq.rt?max_queue_bytes=1&if_version=1:1",
                "not 1:1",
            ),
        ];
        for (method, path, reason) in bad {
            let answer = admin(&cluster, via, method, path).await;
            let text = format!("{answer:?}");
            ensure!(
                answer.is_err() && text.contains(reason),
                "{method} {path}: {text}"
            );
        }
        ensure!(
            agreed_version(&cluster).await? == before,
            "refusals changed nothing"
        );

        // Delete an unused domain, then the used one with purge.
        admin(&cluster, via, "PUT", "/admin/domains/bmq.unused").await?;
        let deleted = admin(&cluster, via, "DELETE", "/admin/domains/bmq.unused").await?;
        ensure!(deleted.contains("deleted at LSN"), "{deleted}");
        let purged_before = total(&cluster, "bmq_queue_removed_total").await?;
        let purged = admin(&cluster, via, "DELETE", "/admin/domains/bmq.rt?purge=true").await?;
        ensure!(purged.contains("2 queue(s) unassigned"), "{purged}");
        agreed_version(&cluster).await?;
        let gone = admin(&cluster, 3, "GET", "/admin/domains/bmq.rt").await;
        ensure!(format!("{gone:?}").contains("404"), "{gone:?}");
        cluster
            .wait_for_all(
                Duration::from_secs(10),
                "the purged queues unassigned",
                |s| !s.queues.iter().any(|q| q.uri.starts_with("bmq://bmq.rt/")),
            )
            .await?;
        // The two messages left on the limited queue were removed, counted as purged.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while total(&cluster, "bmq_queue_removed_total").await? < purged_before + 2.0 {
            ensure!(
                std::time::Instant::now() < deadline,
                "the purge is not counted"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let reopen = open_producer(queue, brokers.clone(), "after-delete").await;
        ensure!(
            format!("{:?}", reopen.as_ref().err()).contains("unknown domain"),
            "a deleted domain cannot be opened: {:?}",
            reopen.err()
        );

        // Counted on every node; the domains are the file's again, and no node disagrees.
        for id in 1..=3 {
            let node = cluster.node(id);
            let count = metric(&node.admin_addr(), "bmq_config_changes_total").await?;
            ensure!(count >= 10.0, "node {id} counted {count} domain changes");
        }
        let docs: Vec<NodeStatusDoc> = cluster
            .wait_for_all(Duration::from_secs(5), "every node answers", |_| true)
            .await?;
        for s in docs {
            let d = s.domains.context("domains in /status")?;
            ensure!(
                d.file_disagrees.is_none(),
                "node {}: {:?}",
                s.node_id,
                d.file_disagrees
            );
        }
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}

/// The sum of metric `name` over every node.
async fn total(cluster: &Cluster, name: &str) -> anyhow::Result<f64> {
    let mut sum = 0.0;
    for id in 1..=3 {
        sum += metric(&cluster.node(id).admin_addr(), name).await?;
    }
    Ok(sum)
}

/// A change sent to the leader, which is SIGKILLed while it may be committing it: the
/// survivors elect a new leader and agree on the domain (changed or not), and the killed
/// node, restarted, agrees with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_during_a_leader_failover_applies_on_every_node_or_on_none() {
    let mut cluster = Cluster::start(3).expect("start cluster");
    let result = async {
        let (leader, _) = cluster.wait_for_leader(Duration::from_secs(30)).await?;
        agreed_version(&cluster).await?;
        let addr = cluster.node(leader).admin_addr();
        let change = tokio::spawn(async move {
            bmqctl::http::request(
                &addr,
                "PATCH",
                "/admin/domains/bmq.test?max_queue_messages=77",
                None,
            )
            .await
        });
        cluster.kill_node(leader)?;
        let answer = change.await?;
        let (new_leader, _) = cluster.wait_for_leader(Duration::from_secs(30)).await?;
        ensure!(new_leader != leader);
        let settle = |s: &NodeStatusDoc| s.domains.as_ref().map(|d| d.version.clone());
        cluster
            .wait_for_agreement(Duration::from_secs(20), "the domains version", settle)
            .await?;
        let survivors: Vec<u32> = (1..=3).filter(|id| *id != leader).collect();
        let mut values = Vec::new();
        for id in &survivors {
            values.push(show(&cluster, *id, "bmq.test").await?["max_queue_messages"].clone());
        }
        ensure!(values[0] == values[1], "the survivors disagree: {values:?}");
        if answer.is_ok() {
            ensure!(
                values[0] == 77,
                "answered as applied but not applied: {values:?}"
            );
        }
        cluster.start_node(leader)?;
        cluster.wait_for_leader(Duration::from_secs(30)).await?;
        cluster
            .wait_for_agreement(Duration::from_secs(20), "the domains version", settle)
            .await?;
        let restarted = show(&cluster, leader, "bmq.test").await?["max_queue_messages"].clone();
        ensure!(
            restarted == values[0],
            "the restarted node: {restarted} vs {values:?}"
        );
        // The cluster takes changes again.
        let again = admin(
            &cluster,
            leader,
            "PATCH",
            "/admin/domains/bmq.test?max_queue_messages=78",
        )
        .await?;
        ensure!(again.contains("updated at LSN"), "{again}");
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}

/// The sum over every node of the samples of `family` whose labels include `label`.
async fn total_labelled(cluster: &Cluster, family: &str, label: &str) -> anyhow::Result<f64> {
    let mut sum = 0.0;
    for id in 1..=3 {
        let body = bmqctl::http::get(&cluster.node(id).admin_addr(), "/metrics").await?;
        sum += String::from_utf8_lossy(&body)
            .lines()
            .filter(|l| {
                l.strip_prefix(family)
                    .is_some_and(|rest| rest.starts_with('{') && rest.contains(label))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    Ok(sum)
}

/// Waits up to `timeout` for `done()`, checking every 20 ms.
async fn wait_until(
    what: &str,
    timeout: Duration,
    mut done: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + timeout;
    while !done() {
        ensure!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Receives messages of producer 1 on `consumer` (confirming them when `confirm`) until every
/// sequence of `wanted` arrived, within 60 s; returns every sequence received.
async fn receive_sequences(
    consumer: &bmq_client::Client,
    wanted: std::ops::Range<u64>,
    confirm: bool,
) -> anyhow::Result<std::collections::BTreeSet<u64>> {
    let mut seen = std::collections::BTreeSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !wanted.clone().all(|s| seen.contains(&s)) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let msg = tokio::time::timeout(left, consumer.next_message())
            .await
            .with_context(|| {
                let missing = wanted.clone().filter(|s| !seen.contains(s)).count();
                format!("{missing} of {wanted:?} not received")
            })?
            .context("consumer stream ended")?;
        let (_, seq) = bmqctl::payload::verify(&msg.payload)
            .map_err(|e| anyhow::anyhow!("corrupt payload: {e}"))?;
        if confirm {
            consumer.confirm(&msg.uri, msg.guid.clone()).await?;
        }
        seen.insert(seq);
    }
    Ok(seen)
}

/// Add a fanout app id while producing: a producer PUTs without pause to a fanout queue of
/// apps foo and bar while `bmqctl domain update --set app_ids=foo,bar,qux` commits; a
/// consumer of qux then receives every message PUT after the change (and none PUT before
/// it was asked for), foo receives every ACKed message, and bar holds every one. Removing bar
/// then drops its copies: `bmq_queue_removed_total{reason="app_removed"}` rises by exactly
/// what bar held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_a_fanout_app_id_while_producing() {
    use bmq_client::{Client, OpenOptions};
    use bmq_proto::client::ConsumerOptions;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    const QUEUE: &str = "bmq://bmq.apps/live";
    let cluster = Cluster::start(3).expect("start cluster");
    let result = async {
        cluster.wait_for_leader(Duration::from_secs(30)).await?;
        agreed_version(&cluster).await?;
        let created = admin(
            &cluster,
            1,
            "PUT",
            "/admin/domains/bmq.apps?mode=fanout&app_ids=foo,bar&max_queue_messages=1000000",
        )
        .await?;
        ensure!(created.contains("created at LSN"), "{created}");
        agreed_version(&cluster).await?;
        let addrs = cluster.client_addrs();
        let reader = |app: &str| {
            OpenOptions::read(ConsumerOptions {
                app_id: app.to_string(),
                max_unconfirmed_messages: 1_000_000,
                max_unconfirmed_bytes: 1 << 30,
                ..Default::default()
            })
        };
        let connect = |node: usize, id: &str| {
            Client::connect(bmq_tests::client_config(vec![addrs[node].clone()], id))
        };
        let foo = connect(1, "consumer-foo").await?;
        foo.open_queue(QUEUE, reader("foo")).await?;

        // The producer: one PUT at a time, each ACKed before the next, until told to stop.
        let producer = open_producer(QUEUE, vec![addrs[0].clone()], "producer").await?;
        let acked = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let producing = tokio::spawn({
            let (acked, stop) = (acked.clone(), stop.clone());
            async move {
                let mut seq = 0;
                while !stop.load(Ordering::SeqCst) {
                    let payload = bmqctl::payload::encode(1, seq, 64);
                    let ack = producer.put(QUEUE, payload, vec![]).await?.await?;
                    ensure!(ack.status == AckStatus::Success as i32, "{ack:?}");
                    seq += 1;
                    acked.store(seq, Ordering::SeqCst);
                }
                producer.disconnect().await.ok();
                anyhow::Ok(seq)
            }
        });
        wait_until("100 messages ACKed", Duration::from_secs(30), || {
            acked.load(Ordering::SeqCst) >= 100
        })
        .await?;

        // Add qux while the producer runs.
        let asked_at = acked.load(Ordering::SeqCst);
        let out = bmqctl(
            &cluster,
            2,
            &["update", "bmq.apps", "--set", "app_ids=foo,bar,qux"],
        )
        .await?;
        ensure!(out.contains("updated at LSN"), "{out}");
        agreed_version(&cluster).await?;
        // Every node holds the change; its partitions take it right after.
        let applied = acked.load(Ordering::SeqCst) + 20;
        wait_until("100 more messages ACKed", Duration::from_secs(30), || {
            acked.load(Ordering::SeqCst) >= applied + 100
        })
        .await?;
        stop.store(true, Ordering::SeqCst);
        let end = producing.await??;

        let qux = connect(2, "consumer-qux").await?;
        qux.open_queue(QUEUE, reader("qux")).await?;
        let got = receive_sequences(&qux, applied..end, true).await?;
        let first = got.first().copied().unwrap_or(end);
        ensure!(
            first >= asked_at,
            "qux got message {first}, PUT before it was added (asked at {asked_at})"
        );
        receive_sequences(&foo, 0..end, true).await?;
        // bar received every ACKed message and holds them all (none confirmed).
        let bar = connect(0, "consumer-bar").await?;
        bar.open_queue(QUEUE, reader("bar")).await?;
        receive_sequences(&bar, 0..end, false).await?;

        // Remove bar: what it held is dropped, counted.
        let family = "bmq_queue_removed_total";
        let label = "reason=\"app_removed\"";
        let before = total_labelled(&cluster, family, label).await?;
        let out = bmqctl(
            &cluster,
            3,
            &["update", "bmq.apps", "--set", "app_ids=foo,qux"],
        )
        .await?;
        ensure!(out.contains("updated at LSN"), "{out}");
        agreed_version(&cluster).await?;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut removed = before;
        while removed < before + end as f64 {
            ensure!(
                std::time::Instant::now() < deadline,
                "app_removed counted {} of bar's {end} copies",
                removed - before
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
            removed = total_labelled(&cluster, family, label).await?;
        }
        ensure!(
            removed == before + end as f64,
            "app_removed counted {} for bar's {end} copies",
            removed - before
        );
        // foo and qux go on; bar is no app of the domain any more.
        let refused = connect(0, "consumer-bar-again")
            .await?
            .open_queue(QUEUE, reader("bar"))
            .await;
        ensure!(
            format!("{:?}", refused.as_ref().err()).contains("not one of this fanout domain"),
            "bar opened after its removal: {:?}",
            refused.err()
        );
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}
