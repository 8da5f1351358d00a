//! The container cluster of `docker/compose.yaml`, driven from the host as an operator would.
//!
//! Builds the images with `scripts/docker-build.sh` (from the binaries cargo built for this test
//! run; no Rust build inside a container), brings the 3 brokers and Prometheus up under a
//! project name and host ports of its own, and then, from the host:
//!
//! 1. waits for one leader that every node follows, and for Prometheus to scrape all 3 brokers
//!    and serve every dashboard's console page;
//! 2. round-trips messages with `bmqctl produce` / `bmqctl consume` through the published ports;
//! 3. `docker kill`s the leader's container: a new leader at a higher term, every partition with
//!    a live primary, and messages flow through the two survivors; the container is started
//!    again and rejoins from its volume;
//! 4. `docker network disconnect`s a follower that is a partition primary, changes the cluster
//!    state while it is away (its partitions get new primaries, a new queue), reconnects it, and checks that it rejoins with the same last and committed LSN as
//!    the others and the same partitions, then carries messages through it.
//!
//! `down -v` runs on every exit path (a guard's `Drop`), a panic included. Where no Docker
//! engine answers, the test prints why and passes without running (the only skip).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context};
use bmq_proto::admin_doc::NodeStatusDoc;
use bmq_tests::run_checked as run;
use bmq_tests::{broker_binary, docker_unavailable, free_ports, repo_root};
use bmqctl::status::fetch_status;

/// Image tags of this test, apart from the operator's `:local` ones.
const BROKER_IMAGE: &str = "bmq-broker:test";
const PROMETHEUS_IMAGE: &str = "bmq-prometheus:test";
/// The broker ids of the compose file (services broker1..3).
const NODES: [u32; 3] = [1, 2, 3];
/// Bound of every wait on the cluster (container starts and stops are slower than processes).
const WAIT: Duration = Duration::from_secs(90);

/// The Compose command: `docker compose` (v2 plugin) if present, else `docker-compose` (v1).
fn compose_command() -> anyhow::Result<Vec<String>> {
    let works = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if works("docker", &["compose", "version"]) {
        Ok(vec!["docker".into(), "compose".into()])
    } else if works("docker-compose", &["version"]) {
        Ok(vec!["docker-compose".into()])
    } else {
        bail!("a Docker engine answers but neither `docker compose` nor `docker-compose` works")
    }
}

/// One compose project: its name, host ports and the Compose command; `down -v` on drop.
struct Project {
    compose: Vec<String>,
    name: String,
    client_ports: Vec<u16>,
    admin_ports: Vec<u16>,
    prometheus_port: u16,
}

impl Project {
    fn command(&self, args: &[&str]) -> Command {
        let root = repo_root();
        let mut cmd = Command::new(&self.compose[0]);
        cmd.args(&self.compose[1..])
            .arg("-f")
            .arg(root.join("docker/compose.yaml"))
            .args(["-p", &self.name])
            .args(args)
            .env("BMQ_BROKER_IMAGE", BROKER_IMAGE)
            .env("BMQ_PROMETHEUS_IMAGE", PROMETHEUS_IMAGE)
            .env("BMQ_PUBLISH_IP", "127.0.0.1")
            .env("BMQ_PROMETHEUS_PORT", self.prometheus_port.to_string());
        for (i, id) in NODES.iter().enumerate() {
            cmd.env(
                format!("BMQ_BROKER{id}_CLIENT_PORT"),
                self.client_ports[i].to_string(),
            );
            cmd.env(
                format!("BMQ_BROKER{id}_ADMIN_PORT"),
                self.admin_ports[i].to_string(),
            );
        }
        cmd
    }

    fn compose(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = run(&mut self.command(args))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The container id of service `brokerN`.
    fn container(&self, id: u32) -> anyhow::Result<String> {
        let out = self.compose(&["ps", "-q", &format!("broker{id}")])?;
        let container = out.trim().to_string();
        ensure!(!container.is_empty(), "no container for broker{id}");
        Ok(container)
    }

    fn network(&self) -> String {
        format!("{}_bmq", self.name)
    }

    fn admin(&self, id: u32) -> String {
        format!("127.0.0.1:{}", self.admin_ports[(id - 1) as usize])
    }

    fn client(&self, id: u32) -> String {
        format!("127.0.0.1:{}", self.client_ports[(id - 1) as usize])
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Ok(out) = self
                .command(&["logs", "--no-color", "--tail", "60"])
                .output()
            {
                eprintln!(
                    "--- compose logs ---\n{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        match self
            .command(&["down", "-v", "--remove-orphans", "--timeout", "5"])
            .output()
        {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "compose down -v failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("compose down -v could not run: {e}"),
        }
    }
}

/// `/status` of each of `nodes` (an error per node that does not answer).
async fn statuses(p: &Project, nodes: &[u32]) -> Vec<(u32, anyhow::Result<NodeStatusDoc>)> {
    let mut out = Vec::new();
    for &id in nodes {
        out.push((id, fetch_status(&p.admin(id), Duration::from_secs(2)).await));
    }
    out
}

/// Waits until every node of `nodes` answers, all follow one leader at one term, all are
/// ready, the leader's metadata is active, and `extra` holds for the documents.
async fn wait_for_cluster(
    p: &Project,
    nodes: &[u32],
    what: &str,
    extra: impl Fn(&[NodeStatusDoc]) -> bool,
) -> anyhow::Result<Vec<NodeStatusDoc>> {
    let deadline = Instant::now() + WAIT;
    let mut last = String::new();
    loop {
        let mut docs = Vec::new();
        for (id, status) in statuses(p, nodes).await {
            match status {
                Ok(doc) => docs.push(doc),
                Err(e) => last = format!("node {id}: {e:#}"),
            }
        }
        if docs.len() == nodes.len() {
            let views: BTreeSet<(Option<u32>, u64)> = docs
                .iter()
                .map(|d| (d.elector.leader, d.elector.term))
                .collect();
            let leader_active = docs.iter().any(|d| d.metadata.role == "active_leader");
            let agreed = views.len() == 1 && views.iter().all(|(l, _)| l.is_some());
            if agreed && leader_active && docs.iter().all(|d| d.ready) && extra(&docs) {
                return Ok(docs);
            }
            last = format!(
                "{:?}",
                docs.iter()
                    .map(|d| (
                        d.node_id,
                        d.elector.leader,
                        d.elector.term,
                        d.ready,
                        d.metadata.last_lsn.clone(),
                        d.metadata.committed_lsn.clone()
                    ))
                    .collect::<Vec<_>>()
            );
        }
        if Instant::now() > deadline {
            bail!("timed out after {WAIT:?} waiting for {what}; last: {last}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn leader_of(docs: &[NodeStatusDoc]) -> (u32, u64) {
    let d = &docs[0];
    (d.elector.leader.expect("agreed leader"), d.elector.term)
}

/// `bmqctl produce` then `bmqctl consume` of `count` messages on `queue` through `brokers`
/// (host:port, published ports), checking the JSON reports.
fn round_trip(bmqctl: &Path, brokers: &[String], queue: &str, count: u64) -> anyhow::Result<()> {
    let brokers = brokers.join(",");
    let count_arg = count.to_string();
    let produced = run(Command::new(bmqctl).args([
        "produce",
        "--queue",
        queue,
        "--count",
        &count_arg,
        "--size",
        "512",
        "--broker",
        &brokers,
        "--timeout-secs",
        "60",
        "--json",
    ]))
    .context("bmqctl produce")?;
    let report: serde_json::Value = serde_json::from_slice(&produced.stdout)
        .context("bmqctl produce --json printed no JSON")?;
    ensure!(
        report["acked"] == count && report["nacked"] == 0,
        "produce report: {report}"
    );
    let consumed = run(Command::new(bmqctl).args([
        "consume",
        "--queue",
        queue,
        "--count",
        &count_arg,
        "--broker",
        &brokers,
        "--timeout-secs",
        "60",
        "--json",
    ]))
    .context("bmqctl consume")?;
    let report: serde_json::Value = serde_json::from_slice(&consumed.stdout)
        .context("bmqctl consume --json printed no JSON")?;
    ensure!(
        report["distinct"] == count && report["corrupt"] == 0,
        "consume report: {report}"
    );
    Ok(())
}

/// One HTTP/1.0 GET on loopback; the body of a 200 answer.
fn http_get(addr: &str, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = String::new();
    stream.take(4 << 20).read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("malformed HTTP response from {addr}"))?;
    ensure!(
        head.lines().next().is_some_and(|l| l.contains(" 200 ")),
        "GET {path}: {}",
        head.lines().next().unwrap_or_default()
    );
    Ok(body.to_string())
}

/// Prometheus serves every dashboard's console page from the image's console libraries and the
/// mounted pages: a template error or a missing library is an HTTP 500, a missing page a 404.
fn check_console_pages(p: &Project) -> anyhow::Result<()> {
    let addr = format!("127.0.0.1:{}", p.prometheus_port);
    for (name, _) in bmqctl::prometheus::CONSOLE_PAGES {
        let body = http_get(&addr, &format!("/consoles/{name}"))?;
        ensure!(
            body.contains("<h1>bmq / "),
            "/consoles/{name} is not a dashboard page: {body}"
        );
    }
    Ok(())
}

/// Waits until Prometheus reports the 3 broker targets up and has loaded the rule group.
async fn wait_for_prometheus(p: &Project) -> anyhow::Result<()> {
    let addr = format!("127.0.0.1:{}", p.prometheus_port);
    let deadline = Instant::now() + WAIT;
    loop {
        let targets = http_get(&addr, "/api/v1/targets").and_then(|body| {
            let v: serde_json::Value = serde_json::from_str(&body)?;
            let up: BTreeSet<String> = v["data"]["activeTargets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| t["labels"]["job"] == "bmq" && t["health"] == "up")
                .filter_map(|t| t["labels"]["instance"].as_str().map(String::from))
                .collect();
            Ok(up)
        });
        let rules = http_get(&addr, "/api/v1/rules");
        let last = match (targets, rules) {
            (Ok(up), Ok(rules))
                if up.len() == 3
                    && rules.contains("BmqNodeDown")
                    && rules.contains("BmqPartitionReplicationStalled") =>
            {
                // The brokers' own metrics arrive: every node reports its elector term.
                let q = http_get(&addr, "/api/v1/query?query=count(bmq_elector_term)")?;
                if q.contains("\"3\"") {
                    return Ok(());
                }
                format!("query: {q}")
            }
            (Ok(up), Ok(_)) => format!("targets up: {up:?}"),
            (Err(e), _) | (_, Err(e)) => format!("{e:#}"),
        };
        if Instant::now() > deadline {
            bail!("Prometheus did not scrape the 3 brokers within {WAIT:?}; last: {last}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[test]
fn compose_cluster_round_trip_leader_kill_and_network_partition() {
    if let Some(reason) = docker_unavailable() {
        println!("skipped compose_cluster test: {reason}");
        return;
    }
    let compose = compose_command().expect("compose tool");
    let root = repo_root();

    // Images from the binaries of this build profile (cargo builds them if needed).
    let broker = broker_binary();
    let bmqctl = broker.with_file_name("bmqctl");
    let profile = broker
        .parent()
        .and_then(|d| d.file_name())
        .and_then(|n| n.to_str())
        .expect("target/<profile>/broker")
        .to_string();
    let started = Instant::now();
    run(Command::new(root.join("scripts/docker-build.sh"))
        .args(["--profile", &profile, "--no-cargo"])
        .env("BMQ_BROKER_IMAGE", BROKER_IMAGE)
        .env("BMQ_PROMETHEUS_IMAGE", PROMETHEUS_IMAGE)
        .current_dir(&root))
    .expect("scripts/docker-build.sh");
    println!("images built in {:.1} s", started.elapsed().as_secs_f64());

    let ports = free_ports(7);
    let project = Project {
        compose,
        name: format!("bmqtest{}", std::process::id()),
        client_ports: ports[0..3].to_vec(),
        admin_ports: ports[3..6].to_vec(),
        prometheus_port: ports[6],
    };
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let result = runtime.block_on(scenario(&project, &bmqctl));
    if let Err(e) = result {
        panic!("{e:#}");
    }
}

async fn scenario(p: &Project, bmqctl: &Path) -> anyhow::Result<()> {
    p.compose(&["up", "-d"]).context("compose up")?;
    let all: Vec<String> = NODES.iter().map(|&id| p.client(id)).collect();

    // 1. One leader, every node ready; Prometheus scrapes every broker.
    let docs = wait_for_cluster(p, &NODES, "a leader followed by all 3 nodes", |_| true).await?;
    let (leader, term) = leader_of(&docs);
    wait_for_prometheus(p).await?;
    check_console_pages(p)?;

    // 2. Messages from the host through the published ports.
    round_trip(bmqctl, &all, "bmq://bmq.test/compose-1", 2_000).context("first round trip")?;

    // 3. The leader's container is killed (SIGKILL): a new leader, live primaries, traffic.
    let leader_container = p.container(leader)?;
    run(Command::new("docker").args(["kill", &leader_container]))?;
    let survivors: Vec<u32> = NODES.iter().copied().filter(|&id| id != leader).collect();
    let docs = wait_for_cluster(p, &survivors, "a new leader of the 2 survivors", |docs| {
        docs.iter().all(|d| {
            d.elector.term > term
                && d.partitions
                    .iter()
                    .all(|part| part.primary.is_some_and(|n| n != leader))
        })
    })
    .await
    .context("after docker kill of the leader")?;
    let (new_leader, new_term) = leader_of(&docs);
    ensure!(new_leader != leader && new_term > term);
    let survivor_brokers: Vec<String> = survivors.iter().map(|&id| p.client(id)).collect();
    round_trip(bmqctl, &survivor_brokers, "bmq://bmq.test/compose-2", 1_000)
        .context("round trip after the leader's death")?;

    // The killed node starts again from its volume and rejoins.
    p.compose(&["start", &format!("broker{leader}")])?;
    wait_for_cluster(p, &NODES, "the killed node back in step", in_step)
        .await
        .context("after restarting the killed node")?;

    // 4. A follower is cut off the network while the state changes, then reconnected.
    let docs = wait_for_cluster(p, &NODES, "a stable leader", in_step).await?;
    let (leader, _) = leader_of(&docs);
    // A follower that is the primary of a partition (the killed node came back with none): the
    // leader reassigns its partitions while it is away, so it has state to catch up on.
    let followers: Vec<u32> = NODES.iter().copied().filter(|&id| id != leader).collect();
    let is_primary = |id: u32| docs[0].partitions.iter().any(|p| p.primary == Some(id));
    let cut = followers
        .iter()
        .copied()
        .find(|&id| is_primary(id))
        .unwrap_or(followers[0]);
    let others: Vec<u32> = NODES.iter().copied().filter(|&id| id != cut).collect();
    let cut_container = p.container(cut)?;
    let before = docs
        .iter()
        .find(|d| d.node_id == cut)
        .map(|d| d.metadata.last_lsn.clone())
        .unwrap();
    run(Command::new("docker").args(["network", "disconnect", &p.network(), &cut_container]))?;
    let other_brokers: Vec<String> = others.iter().map(|&id| p.client(id)).collect();
    // A new queue is assigned while node `cut` is away: the others move past its LSN.
    round_trip(bmqctl, &other_brokers, "bmq://bmq.test/compose-3", 500)
        .context("round trip while a follower is cut off")?;
    let away = wait_for_cluster(p, &others, "the majority past the cut node", |docs| {
        docs.iter().all(|d| {
            d.metadata.last_lsn != before
                && d.queues.iter().any(|q| q.uri == "bmq://bmq.test/compose-3")
        })
    })
    .await?;
    run(Command::new("docker").args([
        "network",
        "connect",
        "--alias",
        &format!("broker{cut}"),
        &p.network(),
        &cut_container,
    ]))?;
    let back = wait_for_cluster(p, &NODES, "the reconnected node in step", in_step)
        .await
        .context("after reconnecting the cut node")?;
    let rejoined = back.iter().find(|d| d.node_id == cut).unwrap();
    ensure!(
        rejoined
            .queues
            .iter()
            .any(|q| q.uri == "bmq://bmq.test/compose-3"),
        "the rejoined node lacks the queue assigned while it was away"
    );
    ensure!(
        lsn_at_least(
            &rejoined.metadata.committed_lsn,
            &away[0].metadata.committed_lsn
        ),
        "rejoined at {} but the majority had committed {} while it was away",
        rejoined.metadata.committed_lsn,
        away[0].metadata.committed_lsn
    );
    round_trip(bmqctl, &[p.client(cut)], "bmq://bmq.test/compose-4", 500)
        .context("round trip through the reconnected node")?;
    Ok(())
}

/// Every node holds the same last and committed LSN, the same partitions (primary, lease,
/// status) and the same queue assignments, with nothing uncommitted.
fn in_step(docs: &[NodeStatusDoc]) -> bool {
    let first = &docs[0];
    docs.iter().all(|d| {
        d.metadata.last_lsn == first.metadata.last_lsn
            && d.metadata.committed_lsn == first.metadata.committed_lsn
            && d.metadata.uncommitted == 0
            && same_partitions(d, first)
            && d.queues == first.queues
    })
}

fn same_partitions(a: &NodeStatusDoc, b: &NodeStatusDoc) -> bool {
    let key = |d: &NodeStatusDoc| -> Vec<(u32, Option<u32>, u64, String)> {
        d.partitions
            .iter()
            .map(|p| {
                (
                    p.partition_id,
                    p.primary,
                    p.primary_lease_id,
                    p.status.clone(),
                )
            })
            .collect()
    };
    key(a) == key(b)
}

/// `a >= b` for LSNs written `term:sequence`.
fn lsn_at_least(a: &str, b: &str) -> bool {
    let parse = |s: &str| -> Option<(u64, u64)> {
        let (t, q) = s.split_once(':')?;
        Some((t.parse().ok()?, q.parse().ok()?))
    };
    match (parse(a), parse(b)) {
        (Some(a), Some(b)) => a >= b,
        _ => false,
    }
}
