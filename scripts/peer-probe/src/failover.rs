//! `peer-probe failover`: one failover run, measured the same way on every system. The caller
//! (scripts/bench-peers.sh) owns the processes: it passes their pids, restarts a killed node
//! (whose index this writes to `--killed-file`) and calls again for the next run.
//!
//! Scenarios (each run first waits until every node is healthy, then 1 s more):
//! - `leader-stop`: SIGSTOP of the leader (ours: the elector's leader; etcd: the Raft leader;
//!   NATS: the JetStream meta leader) -> a survivor reports a new leader. The survivors' status
//!   is polled every `--poll-ms`; the gap includes up to one poll period. SIGCONT afterwards.
//! - `leader-kill` (ours, etcd): SIGKILL of the leader -> the first successful metadata write
//!   (as in `metadata`) among writes started every `--poll-ms` from the kill on, by a client
//!   connected to a survivor. Writes started before the kill do not count, so a client's own
//!   request timeout is never measured.
//! - `primary-kill` (ours, NATS): a producer connected to a survivor puts at `--rate` msgs/s;
//!   after `--warmup-ms`, SIGKILL of the node that is the queue's partition primary (NATS: the
//!   stream's Raft leader) -> the first ACK of a PUT sent after the kill. PUTs that fail
//!   meanwhile (NATS answers "no responders" while the stream has no leader) are counted and
//!   not retried: later PUTs, every 1/rate s, probe again.
//!
//! Status endpoints (`--status`, one per node, in node order): ours the admin address
//! (`GET /status`, `/readyz`); NATS the monitoring address (`GET /jsz`, `/varz`, `/healthz`);
//! etcd the client address (`POST /v3/maintenance/status`, `GET /health`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use async_nats::jetstream;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use bmq_proto::admin_doc::NodeStatusDoc;

use crate::measure;
use crate::systems::{self, http_json, MetaWriter, Producer, System};

/// A failover scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// SIGSTOP of the leader -> a new leader.
    LeaderStop,
    /// SIGKILL of the leader -> the next metadata write succeeds.
    LeaderKill,
    /// SIGKILL of the primary (NATS: the stream leader) -> the first ACK.
    PrimaryKill,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::LeaderStop => "leader SIGSTOP -> new leader",
            Scenario::LeaderKill => "leader SIGKILL -> next metadata write",
            Scenario::PrimaryKill => "primary SIGKILL -> first ACK",
        }
    }
}

/// Arguments of `peer-probe failover`.
#[derive(Debug, Clone, clap::Args)]
pub struct FailoverArgs {
    /// The system.
    #[arg(long, value_enum)]
    pub system: System,
    /// The scenario.
    #[arg(long, value_enum)]
    pub scenario: Scenario,
    /// Client addresses of the nodes, host:port, comma-separated, in node order.
    #[arg(long, value_delimiter = ',', required = true)]
    pub servers: Vec<String>,
    /// Status addresses of the nodes (see the module doc), in node order.
    #[arg(long, value_delimiter = ',', required = true)]
    pub status: Vec<String>,
    /// Process ids of the nodes, in node order.
    #[arg(long, value_delimiter = ',', required = true)]
    pub pids: Vec<i32>,
    /// Where to write the 0-based index of the node killed or stopped.
    #[arg(long)]
    pub killed_file: Option<std::path::PathBuf>,
    /// Poll and probe period, milliseconds.
    #[arg(long, default_value_t = 10)]
    pub poll_ms: u64,
    /// primary-kill: PUTs per second.
    #[arg(long, default_value_t = 1000)]
    pub rate: u64,
    /// primary-kill: producing before the kill, milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub warmup_ms: u64,
    /// Give up on recovery after this many seconds (the run then counts as not recovered).
    #[arg(long, default_value_t = 30)]
    pub timeout_secs: u64,
    /// Wait at most this long for a healthy cluster before the run, seconds.
    #[arg(long, default_value_t = 90)]
    pub ready_timeout_secs: u64,
    /// Domain of our queues.
    #[arg(long, default_value = "bmq.test")]
    pub domain: String,
}

/// What one failover run measured (one JSON line of the results file).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailoverResult {
    /// Always `"failover"`.
    pub kind: String,
    /// The system.
    pub system: System,
    /// The scenario's name.
    pub scenario: String,
    /// Index of the node stopped or killed.
    pub node_index: usize,
    /// Signal -> recovery, ms; `None` when it did not recover within the timeout.
    pub gap_ms: Option<f64>,
    /// Writes or PUTs that failed during the run.
    pub errors: u64,
    /// `/proc/loadavg` (1-minute) before and after the run.
    pub loadavg: (f64, f64),
}

fn signal(pid: i32, sig: libc::c_int) -> anyhow::Result<()> {
    // SAFETY: kill(2) has no memory effects; the pid is one the caller started.
    let rc = unsafe { libc::kill(pid, sig) };
    if rc != 0 {
        bail!("kill({pid}, {sig}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Sends SIGCONT to a stopped process when dropped, so no exit path leaves it stopped.
struct Resume(i32);

impl Drop for Resume {
    fn drop(&mut self) {
        let _ = signal(self.0, libc::SIGCONT);
    }
}

/// Reads the cluster's state through the status endpoints.
struct View {
    system: System,
    status: Vec<String>,
    http: reqwest::Client,
    timeout: Duration,
    /// NATS: server name -> index; etcd: member id -> index.
    names: HashMap<String, usize>,
}

/// Who a node says the leader is, and in which term (0 where the system has none to report).
#[derive(Debug, Clone, PartialEq)]
struct LeaderSeen {
    leader: usize,
    term: u64,
}

impl View {
    async fn new(system: System, status: Vec<String>) -> anyhow::Result<View> {
        let http = reqwest::Client::builder().build()?;
        let mut view = View {
            system,
            status,
            http,
            timeout: Duration::from_millis(500),
            names: HashMap::new(),
        };
        for i in 0..view.status.len() {
            let name = match system {
                System::Bmq => continue,
                System::Nats => {
                    let v = view.get(i, "/varz").await?;
                    v["server_name"].as_str().unwrap_or_default().to_string()
                }
                System::Etcd => {
                    let v = view.etcd_status(i).await?;
                    v["header"]["member_id"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string()
                }
            };
            view.names.insert(name, i);
        }
        Ok(view)
    }

    async fn get(&self, i: usize, path: &str) -> anyhow::Result<serde_json::Value> {
        let url = format!("http://{}{path}", self.status[i]);
        http_json(&self.http, &url, None, self.timeout).await
    }

    async fn etcd_status(&self, i: usize) -> anyhow::Result<serde_json::Value> {
        let url = format!("http://{}/v3/maintenance/status", self.status[i]);
        http_json(&self.http, &url, Some(&serde_json::json!({})), self.timeout).await
    }

    /// The leader as node `i` reports it.
    async fn leader_seen_by(&self, i: usize) -> anyhow::Result<Option<LeaderSeen>> {
        Ok(match self.system {
            System::Bmq => {
                let doc: NodeStatusDoc = serde_json::from_value(self.get(i, "/status").await?)?;
                // Only a node that is leader itself says so with certainty; node ids are 1-based
                // in node order.
                (doc.elector.state == "leader").then(|| LeaderSeen {
                    leader: doc.node_id as usize - 1,
                    term: doc.elector.term,
                })
            }
            System::Nats => {
                let v = self.get(i, "/jsz").await?;
                let name = v["meta_cluster"]["leader"].as_str().unwrap_or_default();
                self.names
                    .get(name)
                    .map(|&leader| LeaderSeen { leader, term: 0 })
            }
            System::Etcd => {
                let v = self.etcd_status(i).await?;
                let id = v["leader"].as_str().unwrap_or_default();
                let term = v["raftTerm"]
                    .as_str()
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(0);
                self.names
                    .get(id)
                    .map(|&leader| LeaderSeen { leader, term })
            }
        })
    }

    /// Whether node `i` answers its health endpoint as healthy.
    async fn healthy(&self, i: usize) -> bool {
        let path = match self.system {
            System::Bmq => "/readyz",
            System::Nats => "/healthz",
            System::Etcd => "/health",
        };
        let url = format!("http://{}{path}", self.status[i]);
        match self.http.get(&url).timeout(self.timeout).send().await {
            Ok(r) if r.status().is_success() => match self.system {
                System::Etcd => r.text().await.is_ok_and(|t| t.contains("\"true\"")),
                _ => true,
            },
            _ => false,
        }
    }

    /// Waits until every node is healthy and one leader is reported by every node (ours: by
    /// itself), then returns it.
    async fn wait_stable(&self, timeout: Duration) -> anyhow::Result<LeaderSeen> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut all_healthy = true;
            for i in 0..self.status.len() {
                all_healthy &= self.healthy(i).await;
            }
            if all_healthy {
                let mut seen = Vec::new();
                for i in 0..self.status.len() {
                    if let Ok(Some(l)) = self.leader_seen_by(i).await {
                        seen.push(l);
                    }
                }
                let agreed = match self.system {
                    System::Bmq => seen.len() == 1,
                    _ => {
                        seen.len() == self.status.len()
                            && seen.iter().all(|l| l.leader == seen[0].leader)
                    }
                };
                if agreed {
                    return Ok(seen[0].clone());
                }
            }
            if Instant::now() >= deadline {
                bail!("the cluster was not healthy with one leader within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls the `survivors` every `period` until one reports a leader other than `old` (ours:
    /// itself leader in a higher term); returns when that was seen.
    async fn wait_new_leader(
        &self,
        old: &LeaderSeen,
        survivors: &[usize],
        period: Duration,
        deadline: Instant,
    ) -> Option<Instant> {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while Instant::now() < deadline {
            tick.tick().await;
            let polls = survivors.iter().map(|&i| self.leader_seen_by(i));
            for seen in futures::future::join_all(polls)
                .await
                .into_iter()
                .flatten()
                .flatten()
            {
                let new = seen.leader != old.leader && survivors.contains(&seen.leader);
                let higher = self.system != System::Bmq || seen.term > old.term;
                if new && higher {
                    return Some(Instant::now());
                }
            }
        }
        None
    }
}

/// Runs one failover run (see the module doc).
///
/// Errors: mismatched argument lists, a cluster that does not become healthy, a workload that
/// cannot start. A run that does not recover within the timeout is a result (`gap_ms: None`),
/// not an error.
pub async fn run(args: FailoverArgs) -> anyhow::Result<FailoverResult> {
    let n = args.servers.len();
    if args.status.len() != n || args.pids.len() != n || n < 3 {
        bail!("--servers, --status and --pids need one entry per node (at least 3)");
    }
    match (args.system, args.scenario) {
        (System::Nats, Scenario::LeaderKill) => {
            bail!("leader-kill measures metadata writes: bmq or etcd")
        }
        (System::Etcd, Scenario::PrimaryKill) => bail!("primary-kill measures ACKs: bmq or nats"),
        _ => {}
    }
    let view = View::new(args.system, args.status.clone()).await?;
    let leader = view
        .wait_stable(Duration::from_secs(args.ready_timeout_secs))
        .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let leader = view
        .wait_stable(Duration::from_secs(args.ready_timeout_secs))
        .await
        .unwrap_or(leader);
    let loadavg_start = crate::loadavg();
    let period = Duration::from_millis(args.poll_ms.max(1));
    let timeout = Duration::from_secs(args.timeout_secs.max(1));
    let (node_index, gap, errors) = match args.scenario {
        Scenario::LeaderStop => {
            let victim = leader.leader;
            let survivors: Vec<usize> = (0..n).filter(|&i| i != victim).collect();
            write_killed(&args, victim)?;
            signal(args.pids[victim], libc::SIGSTOP)?;
            let t0 = Instant::now();
            let _resume = Resume(args.pids[victim]);
            let seen = view
                .wait_new_leader(&leader, &survivors, period, t0 + timeout)
                .await;
            (victim, seen.map(|t| t - t0), 0)
        }
        Scenario::LeaderKill => leader_kill(&args, leader.leader, period, timeout).await?,
        Scenario::PrimaryKill => primary_kill(&args, &view, timeout).await?,
    };
    Ok(FailoverResult {
        kind: "failover".into(),
        system: args.system,
        scenario: args.scenario.name().into(),
        node_index,
        gap_ms: gap.map(|d| d.as_secs_f64() * 1000.0),
        errors,
        loadavg: (loadavg_start, crate::loadavg()),
    })
}

fn write_killed(args: &FailoverArgs, index: usize) -> anyhow::Result<()> {
    if let Some(path) = &args.killed_file {
        std::fs::write(path, format!("{index}\n"))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// SIGKILL of the leader, then a metadata write started every `period` by a client of a
/// survivor until one succeeds.
async fn leader_kill(
    args: &FailoverArgs,
    victim: usize,
    period: Duration,
    timeout: Duration,
) -> anyhow::Result<(usize, Option<Duration>, u64)> {
    let survivors: Vec<String> = (0..args.servers.len())
        .filter(|&i| i != victim)
        .map(|i| args.servers[i].clone())
        .collect();
    let writer = Arc::new(match args.system {
        System::Bmq => MetaWriter::Bmq {
            client: systems::bmq_connect(survivors.clone(), 1, "failover").await?,
            domain: args.domain.clone(),
        },
        _ => MetaWriter::etcd(&survivors[0], timeout)?,
    });
    let run_id: u32 = rand::random();
    writer
        .write(&format!("fo-{run_id:08x}-warmup"))
        .await
        .context("warm-up write")?;
    write_killed(args, victim)?;
    signal(args.pids[victim], libc::SIGKILL)?;
    let t0 = Instant::now();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Result<Instant, ()>>();
    let mut errors = 0u64;
    let mut tick = tokio::time::interval(period);
    let mut i = 0u64;
    let gap = loop {
        tokio::select! {
            _ = tick.tick(), if t0.elapsed() < timeout => {
                let (w, tx) = (writer.clone(), done_tx.clone());
                let key = format!("fo-{run_id:08x}-{i}");
                i += 1;
                tokio::spawn(async move {
                    let r = tokio::time::timeout(timeout, w.write(&key)).await;
                    let _ = tx.send(match r {
                        Ok(Ok(())) => Ok(Instant::now()),
                        _ => Err(()),
                    });
                });
            }
            Some(r) = done_rx.recv() => match r {
                Ok(t) => break Some(t - t0),
                Err(()) => errors += 1,
            },
            _ = tokio::time::sleep_until((t0 + timeout + Duration::from_secs(1)).into()) => break None,
        }
    };
    if let Ok(w) = Arc::try_unwrap(writer) {
        w.close().await;
    }
    Ok((victim, gap, errors))
}

/// Finds the primary (NATS: stream leader) of a fresh queue, puts at `rate` through a survivor,
/// SIGKILLs the primary after the warm-up and waits for the first ACK of a PUT sent after it.
async fn primary_kill(
    args: &FailoverArgs,
    view: &View,
    timeout: Duration,
) -> anyhow::Result<(usize, Option<Duration>, u64)> {
    let n = args.servers.len();
    let run_id: u32 = rand::random();
    let uri = format!("bmq://{}/fo-{run_id:08x}", args.domain);
    let subject = format!("fo.{run_id:08x}");
    let stream = format!("FO_{run_id:08x}");
    let nats_timeout = Duration::from_secs(10);
    // Where the queue lives.
    let victim = match args.system {
        System::Bmq => {
            let probe = systems::bmq_connect(args.servers.clone(), 1, "failover-probe").await?;
            probe
                .open_queue(&uri, bmq_client::OpenOptions::write())
                .await
                .with_context(|| format!("open {uri}"))?;
            let _ = probe.disconnect().await;
            bmq_primary_of(view, &uri, timeout).await?
        }
        _ => {
            let c = systems::nats_connect(&args.servers).await?;
            let js = systems::nats_js(c.clone(), nats_timeout);
            let mut s = systems::nats_create_stream(&js, &stream, &subject, 3).await?;
            let deadline = Instant::now() + timeout;
            let leader = loop {
                let info = s.info().await.map_err(|e| anyhow!("stream info: {e}"))?;
                let cluster = info.cluster.clone().unwrap_or_default();
                let current = cluster.replicas.iter().filter(|r| r.current).count();
                if let Some(l) = cluster.leader.as_deref().and_then(|l| view.names.get(l)) {
                    if current == n - 1 {
                        break *l;
                    }
                }
                if Instant::now() > deadline {
                    bail!("stream {stream} has no leader with current replicas");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            let _ = c.drain().await;
            leader
        }
    };
    let survivors: Vec<String> = (1..n)
        .map(|k| args.servers[(victim + k) % n].clone())
        .collect();
    let window = (args.rate.max(1) * (args.timeout_secs + 2)) as usize;
    let producer = match args.system {
        System::Bmq => {
            let client = systems::bmq_connect(survivors.clone(), window, "failover").await?;
            client
                .open_queue(&uri, bmq_client::OpenOptions::write())
                .await
                .with_context(|| format!("open {uri}"))?;
            Producer::Bmq { client, uri }
        }
        _ => {
            let c = systems::nats_connect(&survivors).await?;
            let js = jetstream::context::ContextBuilder::new()
                .timeout(nats_timeout)
                .max_ack_inflight(window)
                .build(c);
            Producer::Nats { js, subject }
        }
    };
    let filler = vec![0x5a_u8; 1024];
    let start = Instant::now();
    let kill_at = start + Duration::from_millis(args.warmup_ms);
    let mut killed: Option<Instant> = None;
    let mut in_flight = FuturesUnordered::new();
    let mut errors = 0u64;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate.max(1) as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let gap = loop {
        if killed.is_none() && Instant::now() >= kill_at {
            write_killed(args, victim)?;
            signal(args.pids[victim], libc::SIGKILL)?;
            killed = Some(Instant::now());
        }
        if killed.is_some_and(|t| t.elapsed() > timeout) {
            break None;
        }
        tokio::select! {
            _ = tick.tick() => {
                let sent_at = Instant::now();
                match producer.put(measure::encode(&filler, sent_at - start)).await {
                    Ok(ack) => {
                        in_flight.push(async move { (sent_at, ack.await) });
                    }
                    Err(_) => errors += 1,
                }
            }
            Some((sent_at, r)) = in_flight.next(), if !in_flight.is_empty() => {
                let done = Instant::now();
                match (r, killed) {
                    (Ok(()), Some(t0)) if sent_at >= t0 => break Some(done - t0),
                    (Ok(()), _) => {}
                    (Err(_), _) => errors += 1,
                }
            }
        }
    };
    drop(in_flight);
    producer.close().await;
    if args.system == System::Nats {
        // Free the stream's disk (best effort; a later run can also do without it).
        if let Ok(c) = systems::nats_connect(&survivors).await {
            let _ = systems::nats_js(c.clone(), nats_timeout)
                .delete_stream(&stream)
                .await;
            let _ = c.drain().await;
        }
    }
    Ok((victim, gap, errors))
}

/// The index of the node that is primary of `uri`'s partition, as the active leader reports it.
async fn bmq_primary_of(view: &View, uri: &str, timeout: Duration) -> anyhow::Result<usize> {
    let deadline = Instant::now() + timeout;
    loop {
        for i in 0..view.status.len() {
            let Ok(v) = view.get(i, "/status").await else {
                continue;
            };
            let Ok(doc) = serde_json::from_value::<NodeStatusDoc>(v) else {
                continue;
            };
            if doc.metadata.role != "active_leader" {
                continue;
            }
            let primary = doc
                .queues
                .iter()
                .find(|q| q.uri == uri)
                .and_then(|q| {
                    doc.partitions
                        .iter()
                        .find(|p| p.partition_id == q.partition_id)
                })
                .filter(|p| p.status == "active")
                .and_then(|p| p.primary);
            if let Some(node_id) = primary {
                return Ok(node_id as usize - 1);
            }
        }
        if Instant::now() > deadline {
            bail!("no active primary for {uri} within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
