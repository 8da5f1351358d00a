//! Chaos scenarios on real processes over a real network (DESIGN.md §10.5): every broker in its
//! own network namespace, faults injected by the kernel (iptables cuts, SIGKILL, SIGSTOP), a
//! recorded workload of producers and consumers, and the history checker of
//! `bmq_tests::history` at the end of every scenario.
//!
//! Each scenario: start the cluster, pick queues whose primaries the fault leaves alone (unless
//! the scenario is about a primary), run the workload, inject the fault, check the
//! scenario's own expectation (sticky leader, new leader within a bound, step-down), heal,
//! require convergence (same leader, term, LSN and state everywhere), drain, then check the
//! whole history. Needs root; see `bmq_tests::netns::chaos_enabled` for what happens without.
//! `scripts/chaos-soak.sh` runs the randomized schedule of `soak` below for a given time.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use bmq_client::{Client, ClientConfig, OpenOptions};
use bmq_tests::history::{
    log_field, scan_logs, Event, LeaderPoller, Recorder, Report, Violation, Workload,
    WorkloadConfig,
};
use bmq_tests::netns::{chaos_enabled, netem_available, NetCluster};
use rand::{Rng, SeedableRng};

/// Bound on electing a leader after a fault or after healing.
const LEADER_BOUND: Duration = Duration::from_secs(15);
/// Bound on every node reaching the same LSN and state after healing.
const CONVERGE_BOUND: Duration = Duration::from_secs(20);
/// Bound on delivering every acked message once producers stop.
const DRAIN_BOUND: Duration = Duration::from_secs(20);
/// How long a partition or isolation is held: several ElectionScouting rounds (leader loss
/// after 800 ms, random wait up to 300 ms, scouting timeout 500 ms).
const HOLD: Duration = Duration::from_secs(4);

/// One running scenario: the cluster, its history, the leader poller and the workload.
struct Ctx {
    name: String,
    nc: NetCluster,
    recorder: Recorder,
    poller: Option<LeaderPoller>,
    workload: Option<Workload>,
    leader: u32,
    term: u64,
    /// Violations found while the scenario ran (e.g. a soak round that did not converge).
    violations: Vec<Violation>,
}

impl Ctx {
    /// Starts `n` nodes in their namespaces and the leader poller; waits for a leader.
    async fn start(name: &str, n: usize) -> anyhow::Result<Ctx> {
        Ctx::start_with_spares(name, n, 0).await
    }

    /// [`Ctx::start`] with `spares` more nodes configured but not started, to join the
    /// cluster at run time ([`NetCluster::start_with_spares`]); the poller watches them too.
    async fn start_with_spares(name: &str, n: usize, spares: usize) -> anyhow::Result<Ctx> {
        let nc = NetCluster::start_with_spares(n, spares, |_| {})?;
        let recorder = Recorder::new();
        let poller = LeaderPoller::start(nc.admin_addrs(), recorder.clone());
        let mut ctx = Ctx {
            name: name.to_string(),
            nc,
            recorder,
            poller: Some(poller),
            workload: None,
            leader: 0,
            term: 0,
            violations: Vec::new(),
        };
        let ids = ctx.nc.ids();
        let (leader, term) = match ctx
            .nc
            .wait_for_leader_among(&ids, Duration::from_secs(30))
            .await
        {
            Ok(found) => found,
            // The cluster (and its logs) is removed on return: keep the evidence in the error.
            Err(e) => bail!("initial leader: {e:#}\n{}", ctx.nc.cluster.log_tails(60)),
        };
        ctx.leader = leader;
        ctx.term = term;
        ctx.recorder.fault(format!(
            "started {n} nodes ({spares} spares): leader n{leader} term {term}"
        ));
        Ok(ctx)
    }

    /// Opens candidate queues until `want` of them live on partitions whose primary is not in
    /// `avoid` (and, with `on`, is that node); returns them.
    async fn pick_queues(
        &self,
        avoid: &[u32],
        on: Option<u32>,
        want: usize,
    ) -> anyhow::Result<Vec<String>> {
        let client = Client::connect(ClientConfig::new(self.nc.client_addrs())).await?;
        let mut picked = Vec::new();
        for i in 0..16 {
            let uri = format!("bmq://bmq.test/{}-{i}", self.name.replace('_', "-"));
            client.open_queue(&uri, OpenOptions::write()).await?;
            let statuses = self.nc.statuses_of(&[self.leader]).await;
            let status = statuses[0]
                .1
                .as_ref()
                .map_err(|e| anyhow::anyhow!("{e:#}"))?;
            let Some(queue) = status.queues.iter().find(|q| q.uri == uri) else {
                continue;
            };
            let primary = status
                .partitions
                .iter()
                .find(|p| p.partition_id == queue.partition_id)
                .and_then(|p| p.primary);
            if let Some(primary) = primary {
                if !avoid.contains(&primary) && on.is_none_or(|o| o == primary) {
                    picked.push(uri);
                    if picked.len() == want {
                        break;
                    }
                }
            }
        }
        let _ = client.disconnect().await;
        ensure!(
            !picked.is_empty(),
            "no queue landed on a primary outside {avoid:?} (on {on:?})"
        );
        self.recorder.fault(format!(
            "workload queues {picked:?} (primaries avoid {avoid:?}, on {on:?})"
        ));
        Ok(picked)
    }

    /// The committed primary of `queue`'s partition, as the leader reports it.
    async fn primary_of(&self, queue: &str) -> anyhow::Result<u32> {
        let statuses = self.nc.statuses_of(&[self.leader]).await;
        let status = statuses[0]
            .1
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e:#}"))?;
        let partition = status
            .queues
            .iter()
            .find(|q| q.uri == queue)
            .context("queue assigned")?
            .partition_id;
        status
            .partitions
            .iter()
            .find(|p| p.partition_id == partition)
            .and_then(|p| p.primary)
            .context("primary")
    }

    /// The local port of node `on`'s newest DATA connection to `peer`, from the `peer link up`
    /// lines of its log.
    fn data_connection_port(&self, on: u32, peer: u32) -> anyhow::Result<u16> {
        let path = self.nc.cluster.node(on).log_path();
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        let peer = peer.to_string();
        let local = text
            .lines()
            .rev()
            .filter(|l| l.contains("peer link up"))
            .filter(|l| {
                log_field(l, "peer").as_deref() == Some(peer.as_str())
                    && log_field(l, "channel").as_deref() == Some("data")
            })
            .find_map(|l| log_field(l, "local"))
            .with_context(|| format!("no DATA link of n{on} to n{peer} in its log"))?;
        local
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .with_context(|| format!("local address {local:?}"))
    }

    /// Waits (up to 10 s) until node `on`'s connection from `local_port` holds at least
    /// `bytes` unacknowledged by its peer (a silenced connection filling up); an error names
    /// what it holds then.
    async fn wait_unacknowledged(
        &self,
        on: u32,
        local_port: u16,
        bytes: u64,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let queued = self.nc.net.unacknowledged_bytes(on, local_port)?;
            if queued >= bytes {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "n{on}'s silenced connection from port {local_port} holds {queued} bytes \
                 unacknowledged, not {bytes}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the recorded workload on `queues` (two producers and one consumer per queue),
    /// its clients attached to every configured node except `avoid` (spares too: a client
    /// fails over along its list, and a spare serves once it has joined).
    async fn start_workload(&mut self, queues: Vec<String>, avoid: &[u32]) -> anyhow::Result<()> {
        self.start_workload_holding(queues, avoid, 0).await
    }

    /// [`Ctx::start_workload`], each consumer holding its first `hold_first` messages
    /// unconfirmed until the workload stops.
    async fn start_workload_holding(
        &mut self,
        queues: Vec<String>,
        avoid: &[u32],
        hold_first: usize,
    ) -> anyhow::Result<()> {
        let brokers = self
            .nc
            .all_ids()
            .into_iter()
            .filter(|id| !avoid.contains(id))
            .map(|id| self.nc.cluster.node(id).client_addr())
            .collect();
        self.recorder
            .fault(format!("workload clients avoid brokers {avoid:?}"));
        let config = WorkloadConfig {
            brokers,
            queues,
            producers_per_queue: 2,
            put_interval: Duration::from_millis(10),
            payload_size: 256,
            hold_first,
        };
        self.workload = Some(Workload::start(config, self.recorder.clone()).await?);
        Ok(())
    }

    fn acked(&self) -> usize {
        self.recorder
            .snapshot()
            .iter()
            .filter(|e| {
                matches!(
                    e.event,
                    Event::Ack {
                        outcome: bmq_tests::history::AckOutcome::Success,
                        ..
                    }
                )
            })
            .count()
    }

    /// Waits until `more` further PUTs were acked: traffic flows.
    async fn wait_progress(&self, more: usize, timeout: Duration) -> anyhow::Result<()> {
        let target = self.acked() + more;
        let deadline = Instant::now() + timeout;
        while self.acked() < target {
            if Instant::now() > deadline {
                bail!(
                    "no progress: {} of {target} acks within {timeout:?}",
                    self.acked()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Keeps a fault in place for `hold`. The hold *is* the fault's duration (long enough for
    /// the timeouts under test to fire), not a wait for a condition.
    async fn hold(&self, hold: Duration) {
        tokio::time::sleep(hold).await;
    }

    /// Leadership observations with `state == leader` recorded so far: `(node, term)`.
    fn leaders_seen(&self) -> BTreeSet<(u32, u64)> {
        self.recorder
            .snapshot()
            .iter()
            .filter_map(|e| match &e.event {
                Event::Observation {
                    node, state, term, ..
                } if state == "leader" => Some((*node, *term)),
                _ => None,
            })
            .collect()
    }

    /// The highest term any node reported.
    fn max_term_seen(&self) -> u64 {
        self.recorder
            .snapshot()
            .iter()
            .filter_map(|e| match &e.event {
                Event::Observation { term, .. } => Some(*term),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Waits until node `id` no longer reports itself leader in a term below `term` (it
    /// stepped down or moved to a newer term).
    async fn wait_stepped_down(&self, id: u32, term: u64, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.nc.statuses_of(&[id]).await;
            if let Ok(s) = &s[0].1 {
                if s.elector.state != "leader" || s.elector.term >= term {
                    self.recorder.fault(format!(
                        "n{id} stepped down: {} term {} reason {}",
                        s.elector.state, s.elector.term, s.elector.reason
                    ));
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("n{id} still claims leadership below term {term} after {timeout:?}: {s:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Sends a membership change (`method path`, e.g. [`NetCluster::add_path`]) to node
    /// `via`'s admin port; the answer or the error, as one line.
    async fn change(&self, via: u32, method: &str, path: &str) -> String {
        let addr = self.nc.cluster.node(via).admin_addr();
        answer_line(&bmqctl::http::request(&addr, method, path, None).await)
    }

    /// Whether the committed membership of the current leader among the members holds node
    /// `id` (in any role).
    async fn membership_holds(&self, id: u32) -> bool {
        let ids = self.nc.ids();
        let Ok((leader, _)) = self.nc.wait_for_leader_among(&ids, LEADER_BOUND).await else {
            return false;
        };
        let s = self.nc.statuses_of(&[leader]).await;
        s[0].1
            .as_ref()
            .ok()
            .and_then(|s| s.membership.as_ref())
            .is_some_and(|m| m.members.iter().any(|m| m.node_id == id))
    }

    /// Settles the membership ([`NetCluster::settle_membership`]), requires `expected` as
    /// its members, waits (up to 30 s) until every member reports them all as voters (a
    /// learner is promoted once it caught up), and requires convergence.
    async fn settled_with(&mut self, expected: &[u32]) -> anyhow::Result<()> {
        let found = self.nc.settle_membership(CONVERGE_BOUND).await?;
        self.recorder.fault(found);
        ensure!(
            self.nc.ids() == expected,
            "members {:?}, expected {expected:?}",
            self.nc.ids()
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let statuses = self.nc.statuses_of(expected).await;
            let all_voters = statuses.iter().all(|(_, s)| {
                s.as_ref()
                    .ok()
                    .and_then(|s| s.membership.as_ref())
                    .is_some_and(|m| {
                        m.members.len() == expected.len()
                            && m.members
                                .iter()
                                .all(|m| m.role == "voter" && expected.contains(&m.node_id))
                    })
            });
            if all_voters {
                break;
            }
            if Instant::now() >= deadline {
                let views: Vec<String> = statuses
                    .iter()
                    .map(|(id, s)| match s {
                        Ok(s) => format!(
                            "n{id} ({} t{}): {:?}",
                            s.metadata.role,
                            s.elector.term,
                            s.membership.as_ref().map(|m| (
                                m.epoch,
                                m.members
                                    .iter()
                                    .map(|m| (m.node_id, m.role.clone(), m.catch_up.clone()))
                                    .collect::<Vec<_>>()
                            ))
                        ),
                        Err(e) => format!("n{id}: {e:#}"),
                    })
                    .collect();
                bail!("members {expected:?} not all voters everywhere within 30 s: {views:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (leader, term, lsn) = self.nc.wait_converged(CONVERGE_BOUND).await?;
        (self.leader, self.term) = (leader, term);
        self.recorder.fault(format!(
            "voters {expected:?} everywhere; converged: leader n{leader} term {term} LSN {lsn}"
        ));
        Ok(())
    }

    /// Heals, requires convergence, drains the workload, and checks the history and the
    /// logs. Returns the report and, when the scenario failed (an error or any violation), a
    /// failure message with the nodes' log tails.
    async fn conclude(mut self, result: anyhow::Result<()>) -> (Report, Option<String>) {
        let mut extra = std::mem::take(&mut self.violations);
        if let Err(e) = self.nc.net.heal() {
            extra.push(Violation::NotConverged {
                detail: format!("heal failed: {e:#}"),
            });
        }
        for id in self.nc.ids() {
            // A paused node would block convergence forever; resume it.
            if self.nc.cluster.node(id).is_running() {
                let _ = self.nc.cluster.signal_node(id, libc::SIGCONT);
            }
        }
        match self.nc.wait_converged(CONVERGE_BOUND).await {
            Ok((leader, term, lsn)) => self.recorder.fault(format!(
                "converged: leader n{leader} term {term} committed LSN {lsn}"
            )),
            Err(e) => extra.push(Violation::NotConverged {
                detail: format!("{e:#}"),
            }),
        }
        if let Some(workload) = self.workload.take() {
            let summary = workload.stop_and_drain(DRAIN_BOUND).await;
            eprintln!("{}: {summary}", self.name);
        }
        if let Some(poller) = self.poller.take() {
            poller.stop().await;
        }
        // Where undelivered messages sit, if anywhere: tells "stuck at the primary" from "gone".
        let running: Vec<u32> = self
            .nc
            .ids()
            .into_iter()
            .filter(|&id| self.nc.cluster.node(id).is_running())
            .collect();
        for (id, status) in self.nc.statuses_of(&running).await {
            if let Ok(s) = status {
                for p in s.partitions.iter().filter(|p| p.primary == Some(id)) {
                    self.recorder.fault(format!(
                        "final: n{id} is primary of partition {} (lease {}) holding {} messages",
                        p.partition_id, p.primary_lease_id, p.messages
                    ));
                }
            }
        }
        let mut history = self.recorder.snapshot();
        let (log_entries, log_violations) = scan_logs(&self.nc.log_paths());
        history.extend(log_entries);
        extra.extend(log_violations);
        let report = Report::new(&self.name, &history, extra);
        eprintln!("{report}");
        let failure = (result.is_err() || !report.violations.is_empty()).then(|| {
            format!(
                "scenario {} failed: {}\n{report}\n{}",
                self.name,
                result
                    .err()
                    .map_or("violations".into(), |e| format!("{e:#}")),
                self.nc.cluster.log_tails(30)
            )
        });
        (report, failure)
    }

    /// [`Ctx::conclude`], panicking with the failure message if the scenario failed.
    async fn finish(self, result: anyhow::Result<()>) {
        if let (_, Some(failure)) = self.conclude(result).await {
            panic!("{failure}");
        }
    }
}

/// Scenarios run one at a time: several clusters of debug brokers at once on a small machine
/// starve the link heartbeats (1 s timeout), and the spurious failovers that follow would make
/// the outcome depend on the load rather than on the fault under test.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs a scenario body against a started context; skips (or fails on CI) without netns.
macro_rules! scenario {
    ($name:expr, $nodes:expr, |$ctx:ident| $body:block) => {{
        if !chaos_enabled($name) {
            return;
        }
        // An async lock: held across the scenario's awaits (a failed scenario releases it as
        // it unwinds; the next one may still run).
        let _serial = SERIAL.lock().await;
        let mut $ctx = match Ctx::start($name, $nodes).await {
            Ok(ctx) => ctx,
            Err(e) => panic!("scenario {} could not start: {e:#}", $name),
        };
        let result: anyhow::Result<()> = async { $body }.await;
        $ctx.finish(result).await;
    }};
}

/// The seed article's *non-sticky leader*: a follower B of a 4-node cluster is isolated long
/// enough to scout several times. With ElectionScouting it never bumps its term, and when the
/// network heals it follows the old leader A at the old term: no leadership change at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_sticky_leader_isolated_follower_rejoins_without_stealing() {
    scenario!("non_sticky_leader", 4, |ctx| {
        let (a, t) = (ctx.leader, ctx.term);
        let b = ctx.nc.ids().into_iter().find(|&i| i != a).unwrap();
        let queues = ctx.pick_queues(&[a, b], None, 2).await?;
        ctx.start_workload(queues, &[b]).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await?;
        ctx.nc.net.isolate(b)?;
        ctx.recorder.fault(format!("isolate n{b} from every peer"));
        ctx.hold(HOLD).await;
        let s = ctx.nc.statuses_of(&[b]).await;
        let s = s[0].1.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
        ensure!(
            s.elector.term == t,
            "isolated n{b} moved from term {t} to {} (ElectionScouting must not bump it)",
            s.elector.term
        );
        ctx.wait_progress(100, Duration::from_secs(20)).await?;
        ctx.nc.net.heal()?;
        ctx.recorder.fault("heal");
        let (leader, term, _) = ctx.nc.wait_converged(CONVERGE_BOUND).await?;
        ensure!(
            (leader, term) == (a, t),
            "leadership changed from n{a} term {t} to n{leader} term {term}"
        );
        ensure!(
            ctx.leaders_seen() == BTreeSet::from([(a, t)]),
            "leaders seen: {:?}",
            ctx.leaders_seen()
        );
        ensure!(
            ctx.max_term_seen() == t,
            "a node reached term {}",
            ctx.max_term_seen()
        );
        ctx.wait_progress(100, Duration::from_secs(20)).await
    });
}

/// The seed article's *leader ping-pong*: only the link between the leader A and a follower B
/// is cut (B still sees C and D). Without ElectionScouting B and A would take turns leading;
/// with it C and D refuse B's scouting because they follow A, so A leads at its term
/// throughout and B follows it again after the cut heals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_ping_pong_asymmetric_cut_keeps_the_leader() {
    scenario!("leader_ping_pong", 4, |ctx| {
        let (a, t) = (ctx.leader, ctx.term);
        let b = ctx.nc.ids().into_iter().find(|&i| i != a).unwrap();
        let queues = ctx.pick_queues(&[a, b], None, 2).await?;
        ctx.start_workload(queues, &[]).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await?;
        ctx.nc.net.cut(a, b)?;
        ctx.recorder.fault(format!("cut n{a} <-> n{b} only"));
        ctx.hold(HOLD).await;
        ensure!(
            ctx.leaders_seen() == BTreeSet::from([(a, t)]),
            "leadership moved during the cut: {:?}",
            ctx.leaders_seen()
        );
        ctx.wait_progress(100, Duration::from_secs(20)).await?;
        ctx.nc.net.heal()?;
        ctx.recorder.fault("heal");
        let (leader, term, _) = ctx.nc.wait_converged(CONVERGE_BOUND).await?;
        ensure!(
            (leader, term) == (a, t),
            "leadership changed from n{a} term {t} to n{leader} term {term}"
        );
        ensure!(
            ctx.max_term_seen() == t,
            "a node reached term {}",
            ctx.max_term_seen()
        );
        ctx.wait_progress(100, Duration::from_secs(20)).await
    });
}

/// SIGKILL of the leader (not the primary of the workload's queues): the others elect a new
/// leader with a higher term within the bound, traffic keeps flowing, the old leader restarts
/// and catches up, nothing acked is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_leader_under_load() {
    scenario!("kill_leader", 3, |ctx| {
        let (a, t) = (ctx.leader, ctx.term);
        let queues = ctx.pick_queues(&[a], None, 2).await?;
        ctx.start_workload(queues, &[]).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await?;
        ctx.nc.cluster.kill_node(a)?;
        ctx.recorder.fault(format!("SIGKILL leader n{a}"));
        let others: Vec<u32> = ctx.nc.ids().into_iter().filter(|&i| i != a).collect();
        let (leader, term) = ctx.nc.wait_for_leader_among(&others, LEADER_BOUND).await?;
        ensure!(
            term > t,
            "new leader n{leader} has term {term}, not above {t}"
        );
        ctx.recorder
            .fault(format!("new leader n{leader} term {term}"));
        ctx.wait_progress(200, Duration::from_secs(20)).await?;
        ctx.nc.cluster.start_node(a)?;
        ctx.recorder.fault(format!("restart n{a}"));
        ctx.nc.wait_converged(CONVERGE_BOUND).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await
    });
}

/// SIGKILL of the primary (not the leader) of the workload's queues while messages are in
/// flight: the leader reassigns the partition (lease + 1) and traffic resumes; every acked
/// message must still be delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_primary_under_load() {
    scenario!("kill_primary", 3, |ctx| {
        let a = ctx.leader;
        let p = ctx.nc.ids().into_iter().find(|&i| i != a).unwrap();
        let queues = ctx.pick_queues(&[a], Some(p), 2).await?;
        ctx.start_workload(queues, &[]).await?;
        ctx.wait_progress(300, Duration::from_secs(20)).await?;
        ctx.nc.cluster.kill_node(p)?;
        ctx.recorder.fault(format!("SIGKILL primary n{p}"));
        ctx.wait_progress(200, Duration::from_secs(30)).await?;
        ctx.nc.cluster.start_node(p)?;
        ctx.recorder.fault(format!("restart n{p}"));
        ctx.nc.wait_converged(CONVERGE_BOUND).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await
    });
}

/// A 5-node cluster split 2/3 with the leader in the minority: the majority elects a new
/// leader with a higher term within the bound, the old leader steps down (quorum lost), and
/// after healing everyone converges. Queues live on majority primaries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_leader_into_minority() {
    scenario!("partition_leader", 5, |ctx| {
        let (a, t) = (ctx.leader, ctx.term);
        let x = ctx.nc.ids().into_iter().find(|&i| i != a).unwrap();
        let majority: Vec<u32> = ctx
            .nc
            .ids()
            .into_iter()
            .filter(|&i| i != a && i != x)
            .collect();
        let queues = ctx.pick_queues(&[a, x], None, 2).await?;
        ctx.start_workload(queues, &[a, x]).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await?;
        ctx.nc.net.partition(&[&[a, x], &majority])?;
        ctx.recorder
            .fault(format!("partition [n{a} n{x}] | {majority:?}"));
        let (leader, term) = ctx
            .nc
            .wait_for_leader_among(&majority, LEADER_BOUND)
            .await?;
        ensure!(
            term > t,
            "majority leader n{leader} has term {term}, not above {t}"
        );
        ctx.recorder
            .fault(format!("majority leader n{leader} term {term}"));
        ctx.wait_stepped_down(a, term, LEADER_BOUND).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await?;
        ctx.nc.net.heal()?;
        ctx.recorder.fault("heal");
        ctx.nc.wait_converged(CONVERGE_BOUND).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await
    });
}

/// The leader is paused (SIGSTOP) well past the heartbeat timeout, the others elect a new
/// leader, then the old one resumes (SIGCONT): it must step down as soon as it hears the
/// higher term, never lead alongside the new leader in one term. `clients_on_leader`: whether
/// workload clients may be attached to the paused node.
async fn pause_leader(ctx: &mut Ctx, clients_on_leader: bool) -> anyhow::Result<()> {
    let (a, t) = (ctx.leader, ctx.term);
    let queues = ctx.pick_queues(&[a], None, 2).await?;
    let avoid = if clients_on_leader { vec![] } else { vec![a] };
    ctx.start_workload(queues, &avoid).await?;
    ctx.wait_progress(100, Duration::from_secs(20)).await?;
    ctx.nc.cluster.signal_node(a, libc::SIGSTOP)?;
    ctx.recorder.fault(format!("SIGSTOP leader n{a}"));
    let others: Vec<u32> = ctx.nc.ids().into_iter().filter(|&i| i != a).collect();
    let (leader, term) = ctx.nc.wait_for_leader_among(&others, LEADER_BOUND).await?;
    ensure!(
        term > t,
        "new leader n{leader} has term {term}, not above {t}"
    );
    ctx.recorder
        .fault(format!("new leader n{leader} term {term}"));
    ctx.wait_progress(100, Duration::from_secs(20)).await?;
    ctx.nc.cluster.signal_node(a, libc::SIGCONT)?;
    ctx.recorder.fault(format!("SIGCONT n{a}"));
    ctx.wait_stepped_down(a, term, LEADER_BOUND).await?;
    ctx.nc.wait_converged(CONVERGE_BOUND).await?;
    ctx.wait_progress(100, Duration::from_secs(20)).await
}

/// Pause and resume of the leader, with the workload's clients attached to the other nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_leader_then_resume_steps_down() {
    scenario!("pause_leader", 3, |ctx| {
        pause_leader(&mut ctx, false).await
    });
}

/// The same with clients attached to the paused leader too: a consumer whose broker proxies to
/// a primary over a DATA link that dropped while the broker was paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_leader_with_clients_attached_to_it() {
    scenario!("pause_leader_clients", 3, |ctx| {
        pause_leader(&mut ctx, true).await
    });
}

/// Every node in turn is stopped gracefully (SIGTERM) and restarted under load; after each
/// restart the cluster converges before the next node goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_under_load() {
    scenario!("rolling_restart", 3, |ctx| {
        let queues = ctx.pick_queues(&[], None, 2).await?;
        ctx.start_workload(queues, &[]).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await?;
        for id in ctx.nc.ids() {
            ctx.nc.cluster.stop_node(id)?;
            ctx.recorder.fault(format!("SIGTERM n{id}"));
            let others: Vec<u32> = ctx.nc.ids().into_iter().filter(|&i| i != id).collect();
            ctx.nc.wait_for_leader_among(&others, LEADER_BOUND).await?;
            ctx.wait_progress(100, Duration::from_secs(20)).await?;
            ctx.nc.cluster.start_node(id)?;
            ctx.recorder.fault(format!("restart n{id}"));
            ctx.nc.wait_converged(CONVERGE_BOUND).await?;
        }
        ctx.wait_progress(100, Duration::from_secs(20)).await
    });
}

/// A queue's primary is cut off from both replicas by the kernel (iptables) while its producer
/// and consumer stay connected to it: one PUT is neither ACKed nor delivered (no quorum holds
/// it). The primary is then killed and the network healed: the survivors heal without that
/// record, the producer's client resends it, and it is ACKed and delivered once — never read
/// while only the isolated primary held it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolated_primary_no_dirty_read() {
    scenario!("isolated_primary", 3, |ctx| {
        let leader = ctx.leader;
        let queue = ctx
            .pick_queues(&[leader], None, 1)
            .await?
            .pop()
            .context("a queue")?;
        let primary = ctx.primary_of(&queue).await?;
        // Both clients start on the primary and may fail over to the others.
        let mut brokers = ctx.nc.client_addrs();
        brokers.rotate_left((primary - 1) as usize);
        let mut config = ClientConfig::new(brokers.clone());
        config.request_timeout = Duration::from_secs(20);
        let producer = Client::connect(config.clone()).await?;
        producer.open_queue(&queue, OpenOptions::write()).await?;
        let consumer = Client::connect(config).await?;
        consumer
            .open_queue(&queue, OpenOptions::read(Default::default()))
            .await?;
        producer
            .put(&queue, bytes::Bytes::from_static(b"before"), vec![])
            .await?
            .await?;
        let before = tokio::time::timeout(Duration::from_secs(10), consumer.next_message())
            .await?
            .context("first message")?;
        consumer.confirm(&before.uri, before.guid).await?;

        for other in ctx.nc.ids().into_iter().filter(|&i| i != primary) {
            ctx.nc.net.cut(primary, other)?;
            ctx.recorder.fault(format!("cut n{primary} - n{other}"));
        }
        let pending = producer
            .put(&queue, bytes::Bytes::from_static(b"isolated"), vec![])
            .await?;
        let early =
            tokio::time::timeout(Duration::from_millis(1500), consumer.next_message()).await;
        ensure!(
            early.is_err(),
            "dirty read: the consumer got {:?} while only the isolated primary held it",
            early.ok().flatten().map(|m| m.payload)
        );
        ctx.nc.cluster.kill_node(primary)?;
        ctx.recorder.fault(format!("SIGKILL n{primary}"));
        ctx.nc.net.heal()?;
        ctx.recorder.fault("heal");
        let ack = tokio::time::timeout(Duration::from_secs(30), pending).await??;
        ensure!(
            ack.status == bmq_proto::client::AckStatus::Success as i32,
            "the resent PUT was not ACKed: {ack:?}"
        );
        let message = tokio::time::timeout(Duration::from_secs(30), consumer.next_message())
            .await?
            .context("the resent message")?;
        ensure!(message.payload == "isolated", "got {:?}", message.payload);
        consumer.confirm(&message.uri, message.guid).await?;
        if let Ok(Some(again)) =
            tokio::time::timeout(Duration::from_millis(500), consumer.next_message()).await
        {
            bail!("delivered twice: {:?}", again.payload);
        }
        ctx.nc.cluster.start_node(primary)?;
        ctx.recorder.fault(format!("restart n{primary}"));
        ctx.nc.wait_converged(CONVERGE_BOUND).await?;
        let _ = producer.disconnect().await;
        let _ = consumer.disconnect().await;
        Ok(())
    });
}

/// A DATA connection lost on one side only: the primary's DATA connection to a proxy node —
/// the one carrying its PUSHes to the consumer attached there — goes silent, takes a PUSH, and
/// is destroyed on the primary, while both CONTROL connections stay up and the proxy never
/// sees the loss (the reset is dropped too). The pushed message must still reach the
/// consumer: the primary reports its data link lost, releases the proxy's consumers, and on the
/// new DATA connection tells the proxy, whose session reopens and gets the message again.
/// (Before, the message stayed held by a consumer that never got it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_connection_lost_on_one_side_redelivers() {
    scenario!("data_connection_lost", 3, |ctx| {
        let queue = ctx
            .pick_queues(&[], None, 1)
            .await?
            .pop()
            .context("a queue")?;
        let primary = ctx.primary_of(&queue).await?;
        let proxy = ctx
            .nc
            .ids()
            .into_iter()
            .find(|&i| i != primary)
            .context("a node that is not the primary")?;
        let addrs = ctx.nc.client_addrs();
        // The producer attaches to the primary (its ACKs do not cross the connection under
        // test), the consumer to the proxy; neither may move to another broker.
        let mut config = ClientConfig::new(vec![addrs[(primary - 1) as usize].clone()]);
        config.request_timeout = Duration::from_secs(20);
        let producer = Client::connect(config).await?;
        producer.open_queue(&queue, OpenOptions::write()).await?;
        let mut config = ClientConfig::new(vec![addrs[(proxy - 1) as usize].clone()]);
        config.request_timeout = Duration::from_secs(20);
        let consumer = Client::connect(config).await?;
        consumer
            .open_queue(&queue, OpenOptions::read(Default::default()))
            .await?;
        producer
            .put(&queue, bytes::Bytes::from_static(b"first"), vec![])
            .await?
            .await?;
        let first = tokio::time::timeout(Duration::from_secs(10), consumer.next_message())
            .await?
            .context("first message")?;
        consumer.confirm(&first.uri, first.guid).await?;

        let port = ctx.data_connection_port(primary, proxy)?;
        ctx.nc.net.silence_connection(primary, port)?;
        ctx.recorder.fault(format!(
            "silence n{primary}'s DATA connection to n{proxy} (local port {port})"
        ));
        let queued_before = ctx.nc.net.unacknowledged_bytes(primary, port)?;
        const SIZE: usize = 8192;
        let payload = bytes::Bytes::from(vec![b'x'; SIZE]);
        let ack = producer.put(&queue, payload.clone(), vec![]).await?.await?;
        ensure!(
            ack.status == bmq_proto::client::AckStatus::Success as i32,
            "the PUT was not ACKed: {ack:?}"
        );
        // The record replicated to the proxy node and the PUSH to its consumer both went into
        // the silenced connection: wait until the socket holds both, unacknowledged.
        ctx.wait_unacknowledged(primary, port, queued_before + 2 * SIZE as u64)
            .await
            .context("the record and the PUSH")?;
        ctx.nc.net.abort_connection(primary, port)?;
        ctx.recorder.fault(format!(
            "destroy that connection on n{primary} (the reset is dropped)"
        ));
        let again = tokio::time::timeout(Duration::from_secs(30), consumer.next_message())
            .await
            .context("the message lost with the connection was not delivered again")?
            .context("consumer closed")?;
        ensure!(
            again.payload == payload,
            "got {} bytes",
            again.payload.len()
        );
        consumer.confirm(&again.uri, again.guid).await?;
        let _ = producer.disconnect().await;
        let _ = consumer.disconnect().await;
        Ok(())
    });
}

/// A proxy's DATA connection to the primary lost while producers attached to the proxy keep
/// sending: the PUTs written into the dead connection are resent only after the proxy's queue
/// reopens, so neither what the proxy queued while no DATA connection was up nor what its
/// session forwards before it hears of the link's return may reach the primary first
/// (ARCHITECTURE.md, "a producer's order across a peer link's loss"). Every client sits on the
/// proxy; the proxy's own DATA connection to the primary goes silent, collects PUTs, and is
/// destroyed on the proxy alone (the primary never gets the reset), and the proxy's dials to
/// the primary fail for 1.5 s while its producers go on sending. The history checker then
/// requires every ACKed PUT delivered and each producer's first deliveries in order. (Found by
/// the chaos soak as 5,797 unflagged out-of-order deliveries, seed 28721754162385; against the
/// brokers of the commit before the fix, this scenario counts 1,119 reordered deliveries.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_connection_lost_under_producers_keeps_order() {
    // Longer than one dial's timeout (1 s), so at least one dial fails and the proxy's dialer
    // backs off while PUTs arrive.
    const REDIAL_REFUSED: Duration = Duration::from_millis(1500);
    scenario!("data_connection_order", 3, |ctx| {
        let queues = ctx.pick_queues(&[], None, 1).await?;
        let primary = ctx.primary_of(&queues[0]).await?;
        let proxy = ctx
            .nc
            .ids()
            .into_iter()
            .find(|&i| i != primary)
            .context("a node that is not the primary")?;
        let others: Vec<u32> = ctx.nc.ids().into_iter().filter(|&i| i != proxy).collect();
        ctx.start_workload(queues, &others).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await?;

        for round in 0..3 {
            let port = ctx.data_connection_port(proxy, primary)?;
            ctx.nc.net.silence_connection(proxy, port)?;
            ctx.recorder.fault(format!(
                "round {round}: silence n{proxy}'s DATA connection to primary n{primary} \
                 (local port {port})"
            ));
            // Let PUTs pile up unacknowledged in the silenced socket: at least 32 of them
            // (256-byte payloads) before the connection is destroyed.
            let queued_before = ctx.nc.net.unacknowledged_bytes(proxy, port)?;
            ctx.wait_unacknowledged(proxy, port, queued_before + 32 * 256)
                .await
                .context("32 PUTs")?;
            // The proxy's next dials fail for a while (their SYNs are dropped), so PUTs its
            // producers send meanwhile queue up behind the lost ones: the window in which they
            // could overtake them.
            ctx.nc.net.refuse_new_peer_connections(proxy, primary)?;
            ctx.nc.net.abort_connection(proxy, port)?;
            ctx.recorder.fault(format!(
                "round {round}: destroy that connection on n{proxy} (the reset is dropped); \
                 its dials to n{primary} fail for {REDIAL_REFUSED:?}"
            ));
            ctx.hold(REDIAL_REFUSED).await;
            ctx.nc.net.heal()?;
            ctx.recorder.fault(format!("round {round}: heal"));
            // The new DATA connection leaves from another port; the old one stays open and
            // silent on the primary until its read timeout.
            ctx.wait_progress(200, Duration::from_secs(30)).await?;
        }
        Ok(())
    });
}

/// Two rounds of rolling graceful restarts (six primary moves, more than the domain's
/// `max_delivery_attempts` of 5) while every consumer holds its first 20 messages unconfirmed:
/// a move or a stop must not count as a delivery attempt, so the held messages are never
/// dropped (the checker's "silent drop") and are confirmed at the end; nothing is read before
/// a quorum holds it ("dirty read").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_holding_unconfirmed() {
    scenario!("rolling_restart_holding", 3, |ctx| {
        let queues = ctx.pick_queues(&[], None, 2).await?;
        ctx.start_workload_holding(queues, &[], 20).await?;
        ctx.wait_progress(100, Duration::from_secs(20)).await?;
        for round in 0..2 {
            for id in ctx.nc.ids() {
                ctx.nc.cluster.stop_node(id)?;
                ctx.recorder.fault(format!("round {round}: SIGTERM n{id}"));
                let others: Vec<u32> = ctx.nc.ids().into_iter().filter(|&i| i != id).collect();
                ctx.nc.wait_for_leader_among(&others, LEADER_BOUND).await?;
                ctx.wait_progress(50, Duration::from_secs(20)).await?;
                ctx.nc.cluster.start_node(id)?;
                ctx.recorder.fault(format!("round {round}: restart n{id}"));
                ctx.nc.wait_converged(CONVERGE_BOUND).await?;
            }
        }
        ctx.wait_progress(100, Duration::from_secs(20)).await
    });
}

/// An admin answer or its error, as one line for the fault log.
fn answer_line(answer: &anyhow::Result<String>) -> String {
    match answer {
        Ok(text) => text.trim().replace('\n', " "),
        Err(e) => format!("error: {e:#}"),
    }
}

/// Spare nodes of the soak: ids never reused, so this bounds the adds of one run (a round
/// finding none left removes a member, or changes nothing at three members).
const SOAK_SPARES: usize = 12;

/// Most members the soak grows to (the supported maximum of voters is 7).
const SOAK_MAX_MEMBERS: usize = 6;

/// One membership change of the soak (DESIGN.md §5a), with a fault in its middle or none:
/// adds the next spare (started with `join`, added through a random member) or removes a
/// random member (the leader too), keeping at least three; then SIGKILLs the leader, or
/// another member, or the joiner during its catch-up, 0-300 ms into the change. The request
/// may fail with the fault; what was committed is learned afterwards
/// ([`NetCluster::settle_membership`]). Returns the joiner, to be restarted if killed.
async fn change_membership(
    ctx: &mut Ctx,
    rng: &mut rand_chacha::ChaCha8Rng,
    leader: u32,
) -> anyhow::Result<Option<u32>> {
    let members = ctx.nc.ids();
    let spares = ctx.nc.spares();
    let remove = members.len() > 3
        && (spares.is_empty() || members.len() >= SOAK_MAX_MEMBERS || rng.gen_bool(0.5));
    if !remove && spares.is_empty() {
        ctx.recorder
            .fault("membership: no spare left and three members: no change");
        return Ok(None);
    }
    let via = members[rng.gen_range(0..members.len())];
    let (method, path, what, changed) = if remove {
        let id = members[rng.gen_range(0..members.len())];
        (
            "DELETE",
            NetCluster::remove_path(id),
            format!("remove n{id}"),
            id,
        )
    } else {
        let id = spares[0];
        ctx.nc.start_joiner(id).await?;
        ("POST", ctx.nc.add_path(id), format!("add n{id}"), id)
    };
    let addr = ctx.nc.cluster.node(via).admin_addr();
    ctx.recorder
        .fault(format!("membership: {what} through n{via}"));
    let request =
        tokio::spawn(async move { bmqctl::http::request(&addr, method, &path, None).await });
    let fault = rng.gen_range(0..4);
    tokio::time::sleep(Duration::from_millis(rng.gen_range(0..300))).await;
    let killed = match fault {
        1 => Some(leader),
        2 => members
            .iter()
            .copied()
            .find(|&m| m != leader && m != changed && m != via),
        3 if !remove => Some(changed),
        _ => None,
    };
    if let Some(id) = killed {
        if ctx.nc.cluster.node(id).is_running() {
            ctx.nc.cluster.kill_node(id)?;
            ctx.recorder
                .fault(format!("membership: SIGKILL n{id} during {what}"));
        }
    }
    let answer = request.await.context("the change's request task")?;
    ctx.recorder.fault(format!(
        "membership: {what} answered {}",
        answer_line(&answer)
    ));
    Ok((!remove).then_some(changed))
}

/// Membership changes with faults in their middle (DESIGN.md §5a), on three seeded nodes and
/// two spares, under the recorded workload (its clients know the spares' addresses too): node
/// 4 joins with 20% packet loss on it during its catch-up; the leader is removed while a
/// follower is SIGKILLed in the middle of the change; node 5 joins and the leader is
/// SIGKILLed right after the add is sent. After each step the committed membership is
/// settled (a lost add is sent again to the new leader), the removed node must exit by
/// itself, and everything converges; at the end no ACKed message is lost, per-producer order
/// holds and one leader led each term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_changes_with_faults_in_their_middle() {
    let name = "membership_changes_with_faults_in_their_middle";
    if !chaos_enabled(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut ctx = match Ctx::start_with_spares(name, 3, 2).await {
        Ok(ctx) => ctx,
        Err(e) => panic!("scenario {name} could not start: {e:#}"),
    };
    let result: anyhow::Result<()> = async {
        let queues = ctx.pick_queues(&[], None, 3).await?;
        ctx.start_workload(queues, &[]).await?;
        ctx.wait_progress(50, Duration::from_secs(20)).await?;

        // 1: node 4 joins through a lossy link.
        ctx.nc.start_joiner(4).await?;
        ctx.nc.net.set_loss(4, 20.0)?;
        ctx.recorder.fault("loss 20% on joiner n4");
        // Over such a link a request may fail (the joiner's probe, the 30 s wait): sent
        // again, as an operator would, until the membership holds node 4.
        for attempt in 1..=3 {
            let answer = ctx.change(ctx.leader, "POST", &ctx.nc.add_path(4)).await;
            ctx.recorder
                .fault(format!("add n4 (attempt {attempt}) answered {answer}"));
            if ctx.membership_holds(4).await {
                break;
            }
        }
        ctx.nc.net.heal()?;
        ctx.settled_with(&[1, 2, 3, 4]).await?;
        ctx.wait_progress(50, Duration::from_secs(20)).await?;

        // 2: the leader is removed; a follower dies in the middle of it.
        let (leader, _) = ctx
            .nc
            .wait_for_leader_among(&ctx.nc.ids(), LEADER_BOUND)
            .await?;
        let follower = ctx.nc.ids().into_iter().find(|&m| m != leader).unwrap_or(4);
        let addr = ctx.nc.cluster.node(follower).admin_addr();
        let path = NetCluster::remove_path(leader);
        let request =
            tokio::spawn(async move { bmqctl::http::request(&addr, "DELETE", &path, None).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let victim = ctx
            .nc
            .ids()
            .into_iter()
            .find(|&m| m != leader && m != follower)
            .context("a third member")?;
        ctx.nc.cluster.kill_node(victim)?;
        ctx.recorder.fault(format!(
            "remove leader n{leader} through n{follower}; SIGKILL n{victim} 100 ms in"
        ));
        let answer = request.await?;
        ctx.recorder.fault(format!(
            "remove n{leader} answered {}",
            answer_line(&answer)
        ));
        ctx.nc.cluster.start_node(victim)?;
        let expected: Vec<u32> = [1, 2, 3, 4].into_iter().filter(|&m| m != leader).collect();
        ctx.settled_with(&expected).await?;
        ctx.wait_progress(50, Duration::from_secs(20)).await?;

        // 3: node 5 joins; the leader dies right after the add is sent.
        let (leader, _) = ctx
            .nc
            .wait_for_leader_among(&ctx.nc.ids(), LEADER_BOUND)
            .await?;
        ctx.nc.start_joiner(5).await?;
        let addr = ctx.nc.cluster.node(leader).admin_addr();
        let path = ctx.nc.add_path(5);
        let request =
            tokio::spawn(async move { bmqctl::http::request(&addr, "POST", &path, None).await });
        tokio::time::sleep(Duration::from_millis(30)).await;
        ctx.nc.cluster.kill_node(leader)?;
        ctx.recorder.fault(format!(
            "add n5 through leader n{leader}; SIGKILL it 30 ms in"
        ));
        let answer = request.await?;
        ctx.recorder
            .fault(format!("add n5 answered {}", answer_line(&answer)));
        ctx.nc.cluster.start_node(leader)?;
        // The add may have died with the leader: then it is sent again, to the new one.
        let (new_leader, _) = ctx
            .nc
            .wait_for_leader_among(&expected, LEADER_BOUND)
            .await?;
        if !ctx.membership_holds(5).await {
            let answer = ctx.change(new_leader, "POST", &ctx.nc.add_path(5)).await;
            ctx.recorder
                .fault(format!("add n5 again through n{new_leader}: {answer}"));
        }
        let mut expected = expected;
        expected.push(5);
        ctx.settled_with(&expected).await?;
        ctx.wait_progress(50, Duration::from_secs(20)).await
    }
    .await;
    ctx.finish(result).await;
}

/// Randomized fault schedule for `BMQ_CHAOS_SECONDS` (default 60) with `BMQ_CHAOS_SEED`
/// (default random, printed) on `BMQ_CHAOS_NODES` nodes (default 5) with [`SOAK_SPARES`]
/// spares, `BMQ_CHAOS_MEMBERSHIP_PERCENT` (default 10) of the rounds membership changes
/// ([`change_membership`]), the others faults; writes the report to
/// `BMQ_CHAOS_REPORT` (default `chaos-report-<seed>.json` in the temp dir) as JSON and next to
/// it as text. Run through `scripts/chaos-soak.sh`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long-running soak: scripts/chaos-soak.sh"]
async fn soak() {
    let env = |k: &str| std::env::var(k).ok();
    let seconds: u64 = env("BMQ_CHAOS_SECONDS")
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let seed: u64 = env("BMQ_CHAOS_SEED")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let nodes: usize = env("BMQ_CHAOS_NODES")
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let membership_share: u32 = env("BMQ_CHAOS_MEMBERSHIP_PERCENT")
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let report_path = env("BMQ_CHAOS_REPORT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join(format!("chaos-report-{seed}.json")));
    eprintln!(
        "chaos soak: {seconds} s, {nodes} nodes, seed {seed}, report {}",
        report_path.display()
    );
    if !chaos_enabled("soak") {
        return;
    }
    // The report's directory exists before the run, not only when the report is written at
    // its end: a path in a missing directory once lost a whole soak's report.
    if let Some(dir) = report_path.parent() {
        std::fs::create_dir_all(dir).expect("create the report's directory");
    }
    let _serial = SERIAL.lock().await;
    let mut ctx = Ctx::start_with_spares("soak", nodes, SOAK_SPARES)
        .await
        .expect("start soak cluster");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let result: anyhow::Result<()> = async {
        if !netem_available() {
            ctx.recorder.fault(
                "kernel has no sch_netem: delay faults are not drawn, loss uses iptables statistic",
            );
        }
        let queues = ctx.pick_queues(&[], None, 3).await?;
        ctx.start_workload(queues, &[]).await?;
        let end = Instant::now() + Duration::from_secs(seconds);
        let mut round = 0u64;
        while Instant::now() < end {
            round += 1;
            // The members change with the membership rounds.
            let ids = ctx.nc.ids();
            let mut joiner = None;
            let mut changed = false;
            let victim = ids[rng.gen_range(0..ids.len())];
            let other = loop {
                let o = ids[rng.gen_range(0..ids.len())];
                if o != victim {
                    break o;
                }
            };
            let hold = Duration::from_millis(rng.gen_range(500..5000));
            let current = ctx.nc.wait_for_leader_among(&ids, LEADER_BOUND).await.ok();
            let leader = current.map(|(l, _)| l).unwrap_or(victim);
            let membership_round = rng.gen_range(0..100) < membership_share;
            match if membership_round {
                9
            } else {
                rng.gen_range(0..9)
            } {
                9 => {
                    joiner = change_membership(&mut ctx, &mut rng, leader).await?;
                    changed = true;
                }
                0 => {
                    ctx.nc.net.isolate(victim)?;
                    ctx.recorder
                        .fault(format!("isolate n{victim} for {hold:?}"));
                }
                1 => {
                    let mut shuffled = ids.clone();
                    for i in (1..shuffled.len()).rev() {
                        shuffled.swap(i, rng.gen_range(0..=i));
                    }
                    let (minority, majority) = shuffled.split_at(ids.len().div_ceil(2) - 1);
                    ctx.nc.net.partition(&[minority, majority])?;
                    ctx.recorder.fault(format!(
                        "partition {minority:?} | {majority:?} for {hold:?}"
                    ));
                }
                2 => {
                    // `other` differs from the victim, not from the leader; when it is the
                    // leader, the victim is not (no new draw: a seed's later rounds stay).
                    let peer = if other == leader { victim } else { other };
                    ctx.nc.net.cut(leader, peer)?;
                    ctx.recorder
                        .fault(format!("cut leader n{leader} <-> n{peer} for {hold:?}"));
                }
                3 => {
                    let loss = rng.gen_range(5..40) as f64;
                    ctx.nc.net.set_loss(victim, loss)?;
                    ctx.recorder
                        .fault(format!("loss {loss}% on n{victim} for {hold:?}"));
                }
                4 if netem_available() => {
                    let delay = Duration::from_millis(rng.gen_range(20..400));
                    ctx.nc.net.set_delay(victim, delay, delay / 4)?;
                    ctx.recorder
                        .fault(format!("delay {delay:?} on n{victim} for {hold:?}"));
                }
                4 | 5 => {
                    ctx.nc.cluster.kill_node(victim)?;
                    ctx.recorder
                        .fault(format!("SIGKILL n{victim} for {hold:?}"));
                }
                6 => {
                    ctx.nc.cluster.signal_node(leader, libc::SIGSTOP)?;
                    ctx.recorder
                        .fault(format!("SIGSTOP leader n{leader} for {hold:?}"));
                }
                7 => {
                    ctx.nc.cluster.kill_node(leader)?;
                    ctx.recorder
                        .fault(format!("SIGKILL leader n{leader} for {hold:?}"));
                }
                _ => {
                    ctx.nc.cluster.stop_node(victim)?;
                    ctx.recorder
                        .fault(format!("SIGTERM n{victim} for {hold:?}"));
                }
            }
            ctx.hold(hold).await;
            ctx.nc.net.heal()?;
            // A member removed while it was down is restarted too: it must learn it was
            // removed and exit ([`NetCluster::settle_membership`] checks).
            for id in ids.iter().copied().chain(joiner) {
                if ctx.nc.cluster.node(id).is_running() {
                    ctx.nc.cluster.signal_node(id, libc::SIGCONT)?;
                } else {
                    ctx.nc.cluster.start_node(id)?;
                }
            }
            ctx.recorder.fault("heal, resume and restart everything");
            if changed {
                match ctx.nc.settle_membership(CONVERGE_BOUND).await {
                    Ok(found) => ctx.recorder.fault(found),
                    Err(e) => {
                        ctx.recorder.fault(format!("MEMBERSHIP NOT SETTLED: {e:#}"));
                        ctx.violations.push(Violation::NotConverged {
                            detail: format!("membership after round {round}: {e:#}"),
                        });
                    }
                }
            }
            if let Err(e) = ctx.nc.wait_converged(CONVERGE_BOUND).await {
                ctx.recorder.fault(format!("NOT CONVERGED: {e:#}"));
                ctx.violations.push(Violation::NotConverged {
                    detail: format!("after round {round}: {e:#}"),
                });
            }
        }
        Ok(())
    }
    .await;
    // The report is written whatever happened, then a failure fails the test.
    let (report, failure) = ctx.conclude(result).await;
    let mut json = report.to_json();
    json["seed"] = seed.into();
    json["seconds"] = seconds.into();
    json["nodes"] = nodes.into();
    std::fs::write(&report_path, serde_json::to_string_pretty(&json).unwrap())
        .expect("write the JSON report");
    std::fs::write(
        report_path.with_extension("txt"),
        format!("seed {seed}\n{report}"),
    )
    .expect("write the text report");
    eprintln!("chaos soak report: {} (seed {seed})", report_path.display());
    if let Some(failure) = failure {
        panic!("{failure}");
    }
}
