//! Test support for the workspace-level tests: real `broker` processes on loopback.
//!
//! [`Cluster`] writes one configuration per node (free ports below the ephemeral range, see
//! [`free_ports`]; a temporary data directory per cluster), starts `broker` processes, and
//! kills them all when dropped — so a failing test (a panic) cleans up too. The `broker` and
//! `bmqctl` binaries are the ones cargo built for this profile; [`broker_binary`] builds them
//! once (`cargo build --workspace --all-targets`, the same feature resolution as `cargo test
//! --workspace`, so it is a no-op after the test build) if the test run did not.
#![warn(missing_docs)]

pub mod bmqp;
pub mod history;
pub mod netns;
pub mod prometheus;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bmq_config::{local_cluster, BrokerConfig, MEMBERS_MAX};
use bmq_proto::admin_doc::NodeStatusDoc;
use bmqctl::status::fetch_status;

/// Path of the `broker` binary of this build profile, building it (and `bmqctl`) first if
/// needed.
pub fn broker_binary() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        // target/<profile>/deps/<test-binary> -> target/<profile>
        let exe = std::env::current_exe().expect("current test executable");
        let profile_dir = exe
            .parent()
            .and_then(|d| d.parent())
            .expect("test executable lives in target/<profile>/deps")
            .to_path_buf();
        let broker = profile_dir.join("broker");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-q", "--workspace", "--all-targets"]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build for the broker binary");
        assert!(
            status.success(),
            "cargo build --workspace --all-targets failed"
        );
        assert!(
            broker.exists(),
            "broker binary missing at {}",
            broker.display()
        );
        broker
    })
    .clone()
}

/// First port [`free_ports`] hands out; with [`PORT_SPAN`], 10000-19999: below Linux's
/// ephemeral range (`ip_local_port_range`, 32768-60999 by default), so no outgoing connection
/// of any process can take a port between the moment it is picked and the moment the broker
/// binds it (a port picked by binding port 0 came from that range, and an outgoing connection
/// of another test's cluster once took one first: a node that could not bind, a failed test),
/// and below the 20000-29999 bases that `graceful.rs` probes for `bmqctl cluster up`.
const PORT_FIRST: u16 = 10_000;
/// How many ports [`free_ports`] cycles through from [`PORT_FIRST`].
const PORT_SPAN: u16 = 10_000;

/// The repository's root directory (the workspace).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the repository")
        .to_path_buf()
}

/// The python of a virtual environment that `scripts/<script>` provisions (if needed) and
/// names on the last line of its output (scripts/sdk-venv.sh, scripts/helm-venv.sh).
///
/// Errors: the script failed (its status and output), or printed no path.
pub fn venv_python(script: &str) -> anyhow::Result<PathBuf> {
    use anyhow::Context as _;
    let root = repo_root();
    let out = Command::new("bash")
        .arg(root.join("scripts").join(script))
        .current_dir(&root)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("run scripts/{script}"))?;
    anyhow::ensure!(
        out.status.success(),
        "scripts/{script} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    let stdout = String::from_utf8(out.stdout)?;
    let python = stdout
        .lines()
        .last()
        .with_context(|| format!("scripts/{script} printed no path"))?;
    Ok(PathBuf::from(python.trim()))
}

/// Runs `cmd` to completion (stdin closed).
///
/// Errors: it cannot start, or it exits other than 0 (the error holds its stdout and stderr).
pub fn run_checked(cmd: &mut Command) -> anyhow::Result<std::process::Output> {
    use anyhow::Context as _;
    let shown = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {shown}"))?;
    if !out.status.success() {
        anyhow::bail!(
            "{shown} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

/// Why a test that needs Docker cannot run here, when no Docker engine answers.
pub fn docker_unavailable() -> Option<String> {
    match Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .stdin(Stdio::null())
        .output()
    {
        Err(e) => Some(format!("the docker command cannot run: {e}")),
        Ok(out) if !out.status.success() => Some(format!(
            "no Docker engine answers: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(_) => None,
    }
}

/// Picks `n` distinct free loopback ports in 10000-19999 (see [`PORT_FIRST`]).
///
/// Each candidate is bound (so a port in use anywhere is skipped) and held until all `n` are
/// found, then released for the broker to bind. Within one test binary a counter hands out
/// every port once per cycle, so parallel tests never pick the same one; the cycle starts at
/// an offset derived from the process id, so consecutive test binaries start apart.
///
/// # Panics
/// When fewer than `n` free ports are found in the whole span.
pub fn free_ports(n: usize) -> Vec<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    let next = NEXT.get_or_init(|| AtomicU32::new(std::process::id().wrapping_mul(7919)));
    let mut held: Vec<TcpListener> = Vec::with_capacity(n);
    for _ in 0..PORT_SPAN {
        if held.len() == n {
            break;
        }
        let port =
            PORT_FIRST + (next.fetch_add(1, Ordering::Relaxed) % u32::from(PORT_SPAN)) as u16;
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
            held.push(listener);
        }
    }
    assert!(
        held.len() == n,
        "only {} of {n} free ports in {PORT_FIRST}..{}",
        held.len(),
        PORT_FIRST + PORT_SPAN
    );
    held.iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect()
}

/// One node of a test cluster.
pub struct TestNode {
    /// Node id (1-based).
    pub id: u32,
    /// The node's configuration as written to `config_path`.
    pub config: BrokerConfig,
    /// Path of the written TOML configuration.
    pub config_path: PathBuf,
    /// Command words put before the broker binary when starting the node (empty: run it
    /// directly); e.g. `ip netns exec <namespace>`, which execs the broker in place, so the
    /// child's pid stays the broker's (see [`netns`]).
    pub launch_prefix: Vec<String>,
    child: Option<Child>,
}

impl TestNode {
    /// `host:port` of the client listener.
    pub fn client_addr(&self) -> String {
        self.config.self_member().client_addr()
    }

    /// `host:port` of the bmqp (BlazingMQ SDK) listener; every harness node has one.
    pub fn bmqp_addr(&self) -> String {
        self.config
            .self_member()
            .bmqp_addr()
            .expect("the harness gives every node a bmqp port")
    }

    /// `host:port` of the admin listener.
    pub fn admin_addr(&self) -> String {
        self.config.self_member().admin_addr()
    }

    /// The OS process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The name and CPU scheduling policy (`sched(7)`: 0 `SCHED_OTHER`, 3 `SCHED_BATCH`) of
    /// each of the running process's threads, from `/proc/<pid>/task/*/stat` (field 41);
    /// the main thread first.
    ///
    /// Errors: the node is not running, or `/proc` cannot be read (not Linux).
    pub fn thread_policies(&self) -> anyhow::Result<Vec<(String, u32)>> {
        let pid = self.pid().context("node not running")?;
        let mut tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))?
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        tids.sort_by_key(|t| (*t != pid, *t));
        let mut out = Vec::new();
        for tid in tids {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")) else {
                continue; // the thread ended meanwhile
            };
            // "tid (comm) state ...": comm may hold spaces and parentheses; fields 3.. follow
            // the last ')'.
            let open = stat.find('(').context("stat without comm")?;
            let close = stat.rfind(')').context("stat without comm")?;
            let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
            let policy = fields.get(41 - 3).context("stat too short")?.parse()?;
            out.push((stat[open + 1..close].to_string(), policy));
        }
        Ok(out)
    }

    /// Whether the process was started and has not been stopped by the test.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The node's log file.
    pub fn log_path(&self) -> PathBuf {
        self.config.data_dir.join("broker.log")
    }
}

/// The admin path of `POST /admin/members` that adds `member` with its addresses (the request
/// waits up to 30 s for the change, DESIGN.md §5a).
pub fn add_member_path(member: &bmq_config::MemberConfig) -> String {
    let m = member;
    let mut path = format!(
        "/admin/members?id={}&host={}&client_port={}&peer_port={}&admin_port={}&timeout_ms=30000",
        m.id, m.host, m.client_port, m.peer_port, m.admin_port
    );
    if let Some(p) = m.bmqp_port {
        path.push_str(&format!("&bmqp_port={p}"));
    }
    path
}

/// A cluster of real `broker` processes on loopback; dropped = every process killed.
pub struct Cluster {
    /// The nodes, index `i` is node id `i + 1`.
    pub nodes: Vec<TestNode>,
    dir: tempfile::TempDir,
}

impl Cluster {
    /// Writes configurations for `n` nodes on free ports (not started yet). `edit` may adjust
    /// each node's configuration before it is written. Nodes beyond the most members a file
    /// may list ([`MEMBERS_MAX`]) list themselves alone: nodes to join the running cluster.
    pub fn configure(n: usize, edit: impl Fn(&mut BrokerConfig)) -> anyhow::Result<Cluster> {
        let dir = tempfile::Builder::new().prefix("bmq-cluster-").tempdir()?;
        let listed = n.min(MEMBERS_MAX);
        let mut configs = local_cluster(listed, 30100, dir.path())?;
        for id in listed as u32 + 1..=n as u32 {
            let mut config = configs[0].clone();
            let mut own = config.members[0].clone();
            own.id = id;
            config.node_id = id;
            config.members = vec![own];
            config.data_dir = dir.path().join(format!("node-{id}"));
            configs.push(config);
        }
        let ports = free_ports(4 * n);
        for config in configs.iter_mut() {
            for m in config.members.iter_mut() {
                let i = (m.id - 1) as usize;
                m.client_port = ports[4 * i];
                m.peer_port = ports[4 * i + 1];
                m.admin_port = ports[4 * i + 2];
                m.bmqp_port = Some(ports[4 * i + 3]);
            }
            config.log.file = Some(config.data_dir.join("broker.log"));
            edit(config);
        }
        let mut nodes = Vec::new();
        for config in configs {
            std::fs::create_dir_all(&config.data_dir)?;
            let config_path = dir.path().join(format!("node-{}.toml", config.node_id));
            std::fs::write(&config_path, config.to_toml_string())?;
            nodes.push(TestNode {
                id: config.node_id,
                config,
                config_path,
                launch_prefix: Vec::new(),
                child: None,
            });
        }
        Ok(Cluster { nodes, dir })
    }

    /// Configures and starts `n` nodes with the default settings.
    pub fn start(n: usize) -> anyhow::Result<Cluster> {
        Cluster::start_with(n, |_| {})
    }

    /// [`Cluster::start`] with every node's configuration changed by `edit` first.
    pub fn start_with(n: usize, edit: impl Fn(&mut BrokerConfig)) -> anyhow::Result<Cluster> {
        let mut cluster = Cluster::configure(n, edit)?;
        for id in 1..=n as u32 {
            cluster.start_node(id)?;
        }
        Ok(cluster)
    }

    /// The cluster's temporary directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The node with `id`.
    pub fn node(&self, id: u32) -> &TestNode {
        &self.nodes[(id - 1) as usize]
    }

    /// Starts (or restarts) node `id` with its configuration and data directory.
    pub fn start_node(&mut self, id: u32) -> anyhow::Result<()> {
        let binary = broker_binary();
        let node = &mut self.nodes[(id - 1) as usize];
        anyhow::ensure!(node.child.is_none(), "node {id} is already running");
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(node.config.data_dir.join("stderr.log"))?;
        let mut command = match node.launch_prefix.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(binary);
                c
            }
            None => Command::new(binary),
        };
        let child = command
            .arg("--config")
            .arg(&node.config_path)
            .env(
                "RUST_LOG",
                std::env::var("BMQ_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .spawn()
            .with_context(|| format!("spawn broker node {id}"))?;
        node.child = Some(child);
        Ok(())
    }

    /// Sends `signal` to node `id` (e.g. `libc::SIGKILL`); for SIGKILL and SIGTERM the process
    /// is also reaped and the node marked stopped.
    pub fn signal_node(&mut self, id: u32, signal: i32) -> anyhow::Result<()> {
        let node = &mut self.nodes[(id - 1) as usize];
        let Some(child) = node.child.as_mut() else {
            bail!("node {id} is not running");
        };
        // SAFETY: kill(2) on a pid we spawned and have not reaped yet.
        let rc = unsafe { libc::kill(child.id() as i32, signal) };
        anyhow::ensure!(rc == 0, "kill({}, {signal}) failed", child.id());
        if signal == libc::SIGKILL || signal == libc::SIGTERM {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if child.try_wait()?.is_some() {
                    break;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            node.child = None;
        }
        Ok(())
    }

    /// Waits up to `timeout` for node `id`'s process to exit by itself. Returns its exit status
    /// (the node is then marked stopped), or `None` if it is still running at the timeout.
    pub fn wait_for_exit(
        &mut self,
        id: u32,
        timeout: Duration,
    ) -> anyhow::Result<Option<std::process::ExitStatus>> {
        let node = &mut self.nodes[(id - 1) as usize];
        let Some(child) = node.child.as_mut() else {
            bail!("node {id} is not running");
        };
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                node.child = None;
                return Ok(Some(status));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills node `id` with SIGKILL.
    pub fn kill_node(&mut self, id: u32) -> anyhow::Result<()> {
        self.signal_node(id, libc::SIGKILL)
    }

    /// Stops node `id` gracefully with SIGTERM.
    pub fn stop_node(&mut self, id: u32) -> anyhow::Result<()> {
        self.signal_node(id, libc::SIGTERM)
    }

    /// Client addresses of every node, in id order.
    pub fn client_addrs(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.client_addr()).collect()
    }

    /// `/status` of every running node (an error per node that did not answer).
    pub async fn statuses(&self) -> Vec<(u32, anyhow::Result<NodeStatusDoc>)> {
        let mut out = Vec::new();
        for node in self.nodes.iter().filter(|n| n.is_running()) {
            let status = fetch_status(&node.admin_addr(), Duration::from_secs(1)).await;
            out.push((node.id, status));
        }
        out
    }

    /// Waits until every running node answers `/status`, all follow one leader at one term,
    /// and that leader's metadata is active. Returns `(leader, term)`.
    pub async fn wait_for_leader(&self, timeout: Duration) -> anyhow::Result<(u32, u64)> {
        let deadline = Instant::now() + timeout;
        let mut last = String::new();
        loop {
            let statuses = self.statuses().await;
            let mut agreed: Option<(u32, u64)> = None;
            let mut ok = !statuses.is_empty();
            for (id, status) in &statuses {
                match status {
                    Ok(s) => {
                        let view = s.elector.leader.map(|l| (l, s.elector.term));
                        match (view, agreed) {
                            (None, _) => ok = false,
                            (Some(v), None) => agreed = Some(v),
                            (Some(v), Some(a)) if v != a => ok = false,
                            _ => {}
                        }
                        if !s.ready {
                            ok = false;
                        }
                    }
                    Err(e) => {
                        ok = false;
                        last = format!("node {id}: {e:#}");
                    }
                }
            }
            if ok {
                if let Some((leader, term)) = agreed {
                    let leader_status = statuses.iter().find(|(id, _)| *id == leader);
                    if let Some((_, Ok(s))) = leader_status {
                        if s.metadata.role == "active_leader" {
                            return Ok((leader, term));
                        }
                    }
                }
            } else if last.is_empty() {
                last = format!(
                    "{:?}",
                    statuses
                        .iter()
                        .map(|(id, s)| (
                            id,
                            s.as_ref()
                                .map(|s| (s.elector.leader, s.elector.term, s.ready))
                                .ok()
                        ))
                        .collect::<Vec<_>>()
                );
            }
            if Instant::now() > deadline {
                bail!("no agreed leader with active metadata within {timeout:?}; last: {last}");
            }
            last.clear();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until `check` holds for the `/status` of every running node.
    pub async fn wait_for_all(
        &self,
        timeout: Duration,
        what: &str,
        check: impl Fn(&NodeStatusDoc) -> bool,
    ) -> anyhow::Result<Vec<NodeStatusDoc>> {
        let deadline = Instant::now() + timeout;
        loop {
            let statuses = self.statuses().await;
            let docs: Vec<NodeStatusDoc> =
                statuses.into_iter().filter_map(|(_, s)| s.ok()).collect();
            if docs.len() == self.nodes.iter().filter(|n| n.is_running()).count()
                && docs.iter().all(&check)
            {
                return Ok(docs);
            }
            if Instant::now() > deadline {
                bail!("timed out after {timeout:?} waiting for: {what}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every running node answers `/status` and `key` gives the same value for
    /// all of them (for example the committed LSN, which followers reach a moment after the
    /// leader). Returns that value; the error names the values last seen.
    pub async fn wait_for_agreement<K: Ord + std::fmt::Debug>(
        &self,
        timeout: Duration,
        what: &str,
        key: impl Fn(&NodeStatusDoc) -> K,
    ) -> anyhow::Result<K> {
        let deadline = Instant::now() + timeout;
        loop {
            let docs = self
                .wait_for_all(timeout, "every node answers", |_| true)
                .await?;
            let mut values: std::collections::BTreeSet<K> = docs.iter().map(&key).collect();
            if values.len() == 1 {
                return Ok(values.pop_first().expect("one value"));
            }
            if Instant::now() > deadline {
                bail!("nodes disagree on {what} after {timeout:?}: {values:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Panics with `result`'s error and the last 40 lines of every node's log, if it is an
    /// error: the end of a test's body.
    pub fn assert_ok(&self, result: anyhow::Result<()>) {
        if let Err(e) = result {
            panic!("{e:#}\n--- logs ---\n{}", self.log_tails(40));
        }
    }

    /// The last `lines` lines of every node's log, for failure messages.
    pub fn log_tails(&self, lines: usize) -> String {
        let mut out = String::new();
        for node in &self.nodes {
            for path in [node.log_path(), node.config.data_dir.join("stderr.log")] {
                if let Ok(text) = std::fs::read_to_string(&path) {
                    let all: Vec<&str> = text.lines().collect();
                    let start = all.len().saturating_sub(lines);
                    out.push_str(&format!("--- node {} {} ---\n", node.id, path.display()));
                    for l in &all[start..] {
                        out.push_str(l);
                        out.push('\n');
                    }
                }
            }
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if std::thread::panicking() || std::env::var_os("BMQ_TEST_KEEP").is_some() {
            // Keep the logs of a failed run for inspection.
            let kept = self.dir.path().to_path_buf();
            eprintln!("test cluster directory kept at {}", kept.display());
            std::mem::forget(std::mem::replace(
                &mut self.dir,
                tempfile::tempdir().expect("placeholder tempdir"),
            ));
        }
    }
}

/// The sum of every sample of the metric family `name` (all label sets) on the node whose admin
/// address is `admin`, read from a real `GET /metrics`; 0 when the family is absent.
pub async fn metric(admin: &str, name: &str) -> anyhow::Result<f64> {
    let body = bmqctl::http::get(admin, "/metrics").await?;
    Ok(String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// The partition of queue `uri` and its committed primary, once the queue is assigned and the
/// partition has a primary (waits up to `timeout`, reading every node's `/status`).
pub async fn primary_of_queue(
    cluster: &Cluster,
    uri: &str,
    timeout: Duration,
) -> anyhow::Result<(u32, u32)> {
    let docs = cluster
        .wait_for_all(timeout, "queue assigned with a primary", |s| {
            s.queues.iter().any(|q| {
                q.uri == uri
                    && s.partitions
                        .iter()
                        .any(|p| p.partition_id == q.partition_id && p.primary.is_some())
            })
        })
        .await?;
    let doc = &docs[0];
    let partition = doc
        .queues
        .iter()
        .find(|q| q.uri == uri)
        .context("queue listed")?
        .partition_id;
    let primary = doc
        .partitions
        .iter()
        .find(|p| p.partition_id == partition)
        .and_then(|p| p.primary)
        .context("partition has a primary")?;
    Ok((partition, primary))
}

/// A client of the test clusters: `id` as its client id, `brokers` to connect to, a 20 s
/// request timeout (opens across a failover wait for a new leader or primary).
pub fn client_config(brokers: Vec<String>, id: &str) -> bmq_client::ClientConfig {
    let mut config = bmq_client::ClientConfig::new(brokers);
    config.client_id = id.to_string();
    config.request_timeout = Duration::from_secs(20);
    config
}

/// Produces `count` self-checking 1 KiB messages to `queue` through a producer on
/// `producer_brokers` and consumes them through a consumer on `consumer_brokers`, confirming
/// each: every PUT ACKed, every payload intact, every sequence of `producer_id` delivered
/// (within 120 s).
///
/// Errors: a NACK, a corrupt payload, a missing sequence, a timeout, a client error.
pub async fn round_trip(
    queue: &str,
    producer_brokers: Vec<String>,
    consumer_brokers: Vec<String>,
    producer_id: u64,
    count: u64,
) -> anyhow::Result<()> {
    tokio::try_join!(
        consume(queue, consumer_brokers, producer_id, count),
        produce(queue, producer_brokers, producer_id, count),
    )?;
    Ok(())
}

/// Produces `count` self-checking 1 KiB messages (sequences `0..count` of `producer_id`) to
/// `queue` through a producer on `brokers`, all sent before the ACKs are awaited.
///
/// Errors: a NACK, a client error (an open or an ACK not answered within 20 s).
pub async fn produce(
    queue: &str,
    brokers: Vec<String>,
    producer_id: u64,
    count: u64,
) -> anyhow::Result<()> {
    use bmq_proto::client::AckStatus;
    let producer = open_producer(queue, brokers, "test-producer").await?;
    let mut pending = Vec::with_capacity(count as usize);
    for seq in 0..count {
        let ack = producer
            .put(
                queue,
                bmqctl::payload::encode(producer_id, seq, 1024),
                vec![],
            )
            .await?;
        pending.push(ack);
    }
    for ack in pending {
        let ack = ack.await?;
        anyhow::ensure!(ack.status == AckStatus::Success as i32, "nack: {ack:?}");
    }
    producer.disconnect().await.ok();
    Ok(())
}

/// Consumes from `queue` through a consumer on `brokers`, confirming each message, until
/// every sequence `0..count` of `producer_id` was delivered intact, in order (within 120 s;
/// see [`receive_all`]).
///
/// Errors: a corrupt payload, a message out of order, a timeout, a client error.
pub async fn consume(
    queue: &str,
    brokers: Vec<String>,
    producer_id: u64,
    count: u64,
) -> anyhow::Result<()> {
    let consumer = open_consumer(queue, brokers, "test-consumer").await?;
    receive_all(&consumer, producer_id, count, Duration::from_secs(120)).await?;
    consumer.disconnect().await.ok();
    Ok(())
}

/// A client `id` on `brokers` with `queue` open for writing.
///
/// Errors: the connection or the open failed.
pub async fn open_producer(
    queue: &str,
    brokers: Vec<String>,
    id: &str,
) -> anyhow::Result<bmq_client::Client> {
    let producer = bmq_client::Client::connect(client_config(brokers, id)).await?;
    producer
        .open_queue(queue, bmq_client::OpenOptions::write())
        .await
        .context("producer open")?;
    Ok(producer)
}

/// A client `id` on `brokers` with `queue` open for reading (at most 1,000 unconfirmed).
///
/// Errors: the connection or the open failed.
pub async fn open_consumer(
    queue: &str,
    brokers: Vec<String>,
    id: &str,
) -> anyhow::Result<bmq_client::Client> {
    use bmq_client::{Client, OpenOptions};
    use bmq_proto::client::ConsumerOptions;
    let consumer = Client::connect(client_config(brokers, id)).await?;
    consumer
        .open_queue(
            queue,
            OpenOptions {
                read: true,
                write: false,
                consumer: ConsumerOptions {
                    max_unconfirmed_messages: 1000,
                    ..Default::default()
                },
            },
        )
        .await
        .context("consumer open")?;
    Ok(consumer)
}

/// Receives and confirms messages on `consumer` until every sequence `0..count` of
/// `producer_id` was delivered intact, within `timeout`. A first delivery not flagged
/// `out_of_order` must come after the ones before it (per-producer order; redeliveries
/// aside).
///
/// Errors: a corrupt payload, a message out of order, a timeout, a client error.
pub async fn receive_all(
    consumer: &bmq_client::Client,
    producer_id: u64,
    count: u64,
    timeout: Duration,
) -> anyhow::Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    let mut last_in_order = None;
    let deadline = Instant::now() + timeout;
    while (seen.len() as u64) < count {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let msg = tokio::time::timeout(remaining, consumer.next_message())
            .await
            .with_context(|| format!("consumer timed out with {} of {count}", seen.len()))?
            .context("consumer stream ended")?;
        let (pid, seq) = bmqctl::payload::verify(&msg.payload)
            .map_err(|e| anyhow::anyhow!("corrupt payload: {e}"))?;
        consumer.confirm(&msg.uri, msg.guid.clone()).await?;
        if pid != producer_id || seq >= count {
            continue;
        }
        if !msg.out_of_order && !seen.contains(&seq) {
            anyhow::ensure!(
                last_in_order.is_none_or(|l| seq > l),
                "sequence {seq} of producer {pid} delivered after {last_in_order:?}"
            );
            last_in_order = Some(seq);
        }
        seen.insert(seq);
    }
    Ok(())
}
