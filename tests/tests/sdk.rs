//! BlazingMQ's official Python SDK (`blazingmq==1.2.2` from PyPI, with the C++ libbmq inside)
//! against a real cluster: real `broker` processes, their bmqp listeners, and the
//! pytest suite in `tests/sdk/` run by the SDK's own interpreter.
//!
//! `scripts/sdk-venv.sh` provisions the virtual environment (`target/sdk-venv`) on first use;
//! it needs PyPI. The suite's tests (tests/sdk/test_sdk.py): open/post/ACK/consume/confirm
//! with properties, 10,000 messages round trip with contents checked, an SDK producer with a
//! `bmqctl` consumer and the other way round, redelivery of an unconfirmed message, a refused
//! open, readers of two fanout apps (`?id=foo`, `?id=bar`) each getting every message; and (marked `destructive`, on a cluster of its own) SIGKILL of the queue's primary
//! while an SDK producer posts: every ACKed message is delivered.
//!
//! Each run must pass every test it selects and skip none (a skipped test fails here).

use std::io::Read;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use bmq_tests::{broker_binary, repo_root, venv_python, Cluster};

/// Longest a pytest run may take before it is killed and the test fails.
const PYTEST_TIMEOUT: Duration = Duration::from_secs(600);

/// A child process killed (and reaped) when dropped, so a failing test leaves nothing behind.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs the suite with `-m marker` against `cluster`; returns pytest's output.
fn pytest(cluster: &Cluster, marker: &str) -> anyhow::Result<String> {
    let python = venv_python("sdk-venv.sh")?;
    let nodes: Vec<_> = (1..=3).map(|id| cluster.node(id)).collect();
    let join = |f: &dyn Fn(&bmq_tests::TestNode) -> String| {
        nodes.iter().map(|n| f(n)).collect::<Vec<_>>().join(",")
    };
    let log = tempfile::NamedTempFile::new()?;
    let child = Command::new(python)
        .args([
            "-B",
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-m",
            marker,
        ])
        .arg(repo_root().join("tests/sdk"))
        .current_dir(repo_root().join("tests/sdk"))
        .env("BMQ_BROKER_URI", format!("tcp://{}", nodes[0].bmqp_addr()))
        .env(
            "BMQ_SDK_BROKERS",
            join(&|n| format!("tcp://{}", n.bmqp_addr())),
        )
        .env("BMQ_SDK_DOMAIN", "bmq.test.mmap.priority")
        .env("BMQ_SDK_FANOUT_DOMAIN", FANOUT_DOMAIN)
        .env("BMQCTL", broker_binary().with_file_name("bmqctl"))
        .env("BMQ_BROKERS", join(&|n| n.client_addr()))
        .env(
            "BMQ_TEST_NODES",
            join(&|n| {
                format!(
                    "{}:{}:{}",
                    n.id,
                    n.pid().unwrap_or(0),
                    n.admin_addr().replace("localhost", "127.0.0.1")
                )
            }),
        )
        .stdout(log.reopen()?)
        .stderr(log.reopen()?)
        .spawn()
        .context("start pytest")?;
    let mut child = Reaped(child);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait()? {
            break status;
        }
        if started.elapsed() > PYTEST_TIMEOUT {
            bail!("pytest did not finish within {PYTEST_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let mut output = String::new();
    log.reopen()?.read_to_string(&mut output)?;
    eprintln!("{output}");
    ensure!(status.success(), "pytest -m {marker:?} failed ({status})");
    let summary = output
        .lines()
        .rev()
        .find(|l| l.contains(" passed"))
        .context("no pytest summary line")?;
    ensure!(
        !summary.contains("skipped"),
        "tests were skipped: {summary}"
    );
    Ok(output)
}

/// The fanout domain the suite opens: BlazingMQ's development domain (app ids foo, bar and
/// baz), as the embedded default configuration serves it.
const FANOUT_DOMAIN: &str = "bmq.test.mmap.fanout";

/// Three nodes of the embedded default configuration, which serves BlazingMQ's development
/// domains (`bmq.test.mmap.priority`, `bmq.test.mmap.fanout`) the suite opens, as the SDKs'
/// examples do against BlazingMQ's local setup.
fn started_cluster() -> anyhow::Result<Cluster> {
    let mut cluster = Cluster::configure(3, |_| {})?;
    for id in 1..=3 {
        cluster.start_node(id)?;
    }
    tokio::runtime::Runtime::new()?
        .block_on(cluster.wait_for_leader(Duration::from_secs(30)))
        .with_context(|| cluster.log_tails(30))?;
    Ok(cluster)
}

#[test]
fn python_sdk_suite_against_a_cluster() -> anyhow::Result<()> {
    let cluster = started_cluster()?;
    let output = pytest(&cluster, "not destructive").with_context(|| cluster.log_tails(40))?;
    ensure!(output.contains(" passed"), "{output}");
    Ok(())
}

#[test]
fn python_sdk_producer_through_a_primary_kill() -> anyhow::Result<()> {
    let cluster = started_cluster()?;
    pytest(&cluster, "destructive").with_context(|| cluster.log_tails(40))?;
    Ok(())
}

/// The node an SDK producer is connected to — the queue's primary — is SIGKILLed while the
/// producer posts (400/s), and restarted a second later: libbmq reconnects to it, reopens the
/// queue and resends what was not ACKed; every message ACKed SUCCESS is then delivered to a
/// consumer on another node (once at least: a resend after a lost ACK is dropped by GUID).
#[test]
fn python_sdk_reconnects_to_its_restarted_node() -> anyhow::Result<()> {
    use bmq_client::{Client, ClientConfig, OpenOptions};
    use bmq_proto::client::ConsumerOptions;
    use std::collections::BTreeSet;

    let mut cluster = started_cluster()?;
    let rt = tokio::runtime::Runtime::new()?;
    let uri = "bmq://bmq.test/sdk-restart";
    let primary = rt.block_on(async {
        // Opening the queue assigns it; its partition's primary is the node to restart.
        let opener =
            Client::connect(ClientConfig::new(vec![cluster.node(1).client_addr()])).await?;
        opener.open_queue(uri, OpenOptions::write()).await?;
        let (_, primary) =
            bmq_tests::primary_of_queue(&cluster, uri, Duration::from_secs(30)).await?;
        let _ = opener.disconnect().await;
        anyhow::Ok(primary)
    })?;
    let out = tempfile::NamedTempFile::new()?;
    let log = tempfile::NamedTempFile::new()?;
    let producer = Command::new(venv_python("sdk-venv.sh")?)
        .arg("-B")
        .arg(repo_root().join("tests/sdk/sdk_producer.py"))
        .args(["--uri", uri, "--count", "2000", "--rate", "400", "--out"])
        .arg(out.path())
        .arg("--broker")
        .arg(format!("tcp://{}", cluster.node(primary).bmqp_addr()))
        .stdout(log.reopen()?)
        .stderr(log.reopen()?)
        .spawn()
        .context("start the SDK producer")?;
    let mut producer = Reaped(producer);
    std::thread::sleep(Duration::from_millis(1500));
    cluster.kill_node(primary)?;
    std::thread::sleep(Duration::from_secs(1));
    cluster.start_node(primary)?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = producer.0.try_wait()? {
            break status;
        }
        if started.elapsed() > Duration::from_secs(180) {
            bail!("the SDK producer did not finish within 180 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let mut text = String::new();
    log.reopen()?.read_to_string(&mut text)?;
    ensure!(status.success(), "SDK producer failed ({status}): {text}");
    let result: serde_json::Value = serde_json::from_reader(out.reopen()?)?;
    let acked: BTreeSet<u64> = result["acked"]
        .as_array()
        .context("acked")?
        .iter()
        .filter_map(|v| v.as_u64())
        .collect();
    let count = |key: &str| {
        result[key]
            .as_object()
            .map(|o| o.len())
            .or_else(|| result[key].as_array().map(|a| a.len()))
            .unwrap_or(0)
    };
    let summary = format!(
        "{} ACKed, {} NACKed, {} posts refused by the SDK, {} unanswered; session events {}",
        acked.len(),
        count("nacked"),
        count("refused"),
        count("unacked"),
        result["session_events"]
    );
    eprintln!("SDK producer through a restart of its node: {summary}");
    ensure!(
        result["session_events"].to_string().contains("Reconnected"),
        "the SDK did not reconnect: {summary}"
    );
    ensure!(
        acked.len() == 2000,
        "every post should be ACKed through the restart: {summary}"
    );
    let other = if primary == 1 { 2 } else { 1 };
    let delivered = rt.block_on(async {
        let consumer =
            Client::connect(ClientConfig::new(vec![cluster.node(other).client_addr()])).await?;
        consumer
            .open_queue(uri, OpenOptions::read(ConsumerOptions::default()))
            .await?;
        let mut delivered = BTreeSet::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !acked.is_subset(&delivered) {
            let Ok(Some(m)) = tokio::time::timeout_at(deadline, consumer.next_message()).await
            else {
                break;
            };
            let text = String::from_utf8_lossy(&m.payload).to_string();
            if let Some(i) = text
                .strip_prefix("sdk-producer ")
                .and_then(|n| n.parse().ok())
            {
                delivered.insert(i);
            }
            consumer.confirm(uri, m.guid.clone()).await?;
        }
        anyhow::Ok(delivered)
    })?;
    let missing: Vec<_> = acked.difference(&delivered).take(10).collect();
    ensure!(
        missing.is_empty(),
        "ACKed messages never delivered, e.g. {missing:?} ({} missing)\n{}",
        acked.difference(&delivered).count(),
        cluster.log_tails(30)
    );
    Ok(())
}
