//! What the Helm chart renders, run as a kubelet would run it, under docker.
//!
//! `scripts/helm_pods.py` renders `deploy/helm/bmq` (3 replicas, 3 initial members, TLS from
//! existing Secrets, an admin token and a client token) and writes down each pod of the
//! StatefulSet: its name and DNS names through the headless Service, command, environment (the
//! downward API's pod name, the Secret's admin token), security context, probes, preStop hook, and
//! the files of every ConfigMap, Secret and projected volume it mounts. The TLS Secrets are those
//! an operator (or cert-manager) would create: a development CA and one certificate per node (5,
//! for the scale-up), from `bmqctl::dev_ca`. Each pod becomes a container of the broker image
//! (built by `scripts/docker-build.sh`) on a private network, with those names as network aliases,
//! a read-only root file system, no capabilities, the mounts, tmpfs for the emptyDirs and one named
//! volume per pod for its PersistentVolumeClaim. Then:
//!
//! 1. the cluster forms from the rendered configuration alone: every pod's `/readyz` (its
//!    readiness probe) answers 200 and every node's `/status` names the same leader;
//! 2. messages round-trip through the client ports with TLS and the client token;
//! 3. a rolling restart as the StatefulSet controller does it, under a paced strong producer
//!    and a consumer (every PUT ACKed and delivered): from the highest ordinal down,
//!    one pod at a time, the preStop hook (a graceful stop) run and the container gone within
//!    `terminationGracePeriodSeconds`, the pod recreated with its volume, and the next one only
//!    once it is ready again; the messages produced before are then all consumed;
//! 4. a scale-up from 3 to 5 and back through the live membership, under a paced strong
//!    producer (every PUT ACKed and delivered): the chart rendered with `cluster.initialMembers`
//!    3 and `replicas: 5` gives pods 0-2 exactly what they run (same plan, same files: nothing
//!    rolls); pods 3 and 4 of that render start, learn the membership through `join` and wait,
//!    not ready and with no membership, until `bmqctl admin add-member` (run inside pod 0, as
//!    with `kubectl exec`) adds and promotes each; every node then reports voters 1-5 at one
//!    epoch. Then node 5, then node 4, removed with `bmqctl admin remove-member` before the
//!    StatefulSet shrinks: the removed node exits, refuses to run again on its data when the
//!    kubelet restarts it, its pod and claim are deleted, and every remaining node reports the
//!    voters left and the node removed; the messages produced before are consumed through
//!    node 5 and then node 1;
//! 5. the pod of a partition's primary, holding 100 unconsumed messages, is killed (no preStop
//!    hook: a lost node, or a forced delete) and recreated on its volume: it recovers the
//!    partition's journal from the volume (its log's `partition journal recovered` line counts
//!    the outstanding messages), becomes ready, every node agrees on voters 1-3 at one epoch,
//!    and the 100 messages are consumed through it.
//!
//! Every container, volume and the network are removed on every exit path (a guard's `Drop`).
//! Where no Docker engine answers, the test prints why and passes without running (the only
//! skip; provisioning the chart's Python environment fails the test under CI).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use bmq_proto::admin_doc::NodeStatusDoc;
use bmq_tests::run_checked as run;
use bmq_tests::{broker_binary, docker_unavailable, free_ports, repo_root, venv_python};
use bmqctl::status::fetch_status;
use rand::Rng;
use serde_json::{json, Value};

/// The image the chart's values name (built here, apart from the operator's `:local`).
const IMAGE_REPOSITORY: &str = "bmq-broker";
const IMAGE_TAG: &str = "helm-test";
/// Replicas of the rendered StatefulSet, and its initial members (`cluster.initialMembers`).
const REPLICAS: usize = 3;
/// Replicas of the scale-up.
const SCALED: usize = 5;
/// Prefix of the TLS Secrets the chart is told to read (`tls.secretPrefix`).
const TLS_SECRET_PREFIX: &str = "bmq-test-certs";
/// Bound of every wait on the cluster.
const WAIT: Duration = Duration::from_secs(90);

fn docker(args: &[&str]) -> anyhow::Result<String> {
    let out = run(Command::new("docker").args(args))?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn text(v: &Value, key: &str) -> anyhow::Result<String> {
    v[key]
        .as_str()
        .map(String::from)
        .with_context(|| format!("plan: {key} is not a string in {v}"))
}

fn port(v: &Value, name: &str) -> anyhow::Result<u16> {
    v["ports"][name]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .with_context(|| format!("plan: no {name} port"))
}

/// The rendered pods running as containers; every container, volume and the network are
/// removed on drop.
struct Pods {
    prefix: String,
    network: String,
    pods: Vec<Value>,
    /// Host ports published for each pod's admin and client ports (loopback only).
    admin_ports: Vec<u16>,
    client_ports: Vec<u16>,
    volumes: Vec<String>,
}

impl Pods {
    fn container(&self, ordinal: usize) -> String {
        format!(
            "{}-{}",
            self.prefix,
            self.pods[ordinal]["name"].as_str().unwrap_or("pod")
        )
    }

    fn admin(&self, ordinal: usize) -> String {
        format!("127.0.0.1:{}", self.admin_ports[ordinal])
    }

    fn client(&self, ordinal: usize) -> String {
        format!("127.0.0.1:{}", self.client_ports[ordinal])
    }

    /// `docker run` of pod `ordinal` as the kubelet would start it.
    fn start(&mut self, ordinal: usize) -> anyhow::Result<()> {
        let pod = &self.pods[ordinal];
        let name = text(pod, "name")?;
        let mut args: Vec<String> = vec![
            "run".into(),
            "-d".into(),
            "--name".into(),
            self.container(ordinal),
            "--hostname".into(),
            text(pod, "hostname")?,
            "--network".into(),
            self.network.clone(),
            "--user".into(),
            text(pod, "user")?,
            "--stop-timeout".into(),
            pod["grace_seconds"].as_u64().unwrap_or(30).to_string(),
        ];
        for alias in pod["aliases"].as_array().into_iter().flatten() {
            args.extend([
                "--network-alias".into(),
                alias.as_str().unwrap_or_default().into(),
            ]);
        }
        // The pod's fsGroup is a supplementary group of its processes, as under Kubernetes.
        if let Some((_, group)) = text(pod, "user")?.split_once(':') {
            args.extend(["--group-add".into(), group.into()]);
        }
        if pod["read_only_root"] == true {
            args.push("--read-only".into());
        }
        if pod["drop_all_capabilities"] == true {
            args.extend(["--cap-drop".into(), "ALL".into()]);
        }
        if pod["no_new_privileges"] == true {
            args.extend(["--security-opt".into(), "no-new-privileges".into()]);
        }
        for target in pod["tmpfs"].as_array().into_iter().flatten() {
            args.extend([
                "--tmpfs".into(),
                format!("{}:rw,mode=1777", target.as_str().unwrap_or_default()),
            ]);
        }
        for m in pod["mounts"].as_array().into_iter().flatten() {
            let ro = if m["read_only"] == true {
                ",readonly"
            } else {
                ""
            };
            args.extend([
                "--mount".into(),
                format!(
                    "type=bind,source={},target={}{ro}",
                    text(m, "source")?,
                    text(m, "target")?
                ),
            ]);
        }
        for claim in pod["claims"].as_array().into_iter().flatten() {
            // The claim <template>-<pod> of the StatefulSet: one named volume per pod, kept
            // when the pod's container is removed.
            let volume = format!("{}-{}-{name}", self.prefix, text(claim, "name")?);
            if !self.volumes.contains(&volume) {
                docker(&["volume", "create", &volume])?;
                self.volumes.push(volume.clone());
            }
            args.extend([
                "--mount".into(),
                format!(
                    "type=volume,source={volume},target={}",
                    text(claim, "target")?
                ),
            ]);
        }
        for (key, value) in pod["env"].as_object().into_iter().flatten() {
            args.extend([
                "--env".into(),
                format!("{key}={}", value.as_str().unwrap_or_default()),
            ]);
        }
        args.extend([
            "--publish".into(),
            format!("{}:{}", self.admin(ordinal), port(pod, "admin")?),
            "--publish".into(),
            format!("{}:{}", self.client(ordinal), port(pod, "client")?),
        ]);
        let command: Vec<String> = pod["command"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c.as_str().map(String::from))
            .collect();
        ensure!(!command.is_empty(), "plan: pod {name} has no command");
        args.extend(["--entrypoint".into(), command[0].clone()]);
        args.push(text(pod, "image")?);
        args.extend(command[1..].iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        docker(&args).with_context(|| format!("start pod {name}"))?;
        Ok(())
    }

    /// Deletes pod `ordinal` as Kubernetes does: its preStop hook, then the container stopped
    /// (SIGTERM, SIGKILL after the grace period) and removed; its volume stays. Errors unless
    /// the broker exited on its own, with status 0, within the grace period.
    fn delete(&self, ordinal: usize) -> anyhow::Result<Duration> {
        let pod = &self.pods[ordinal];
        let container = self.container(ordinal);
        let grace = Duration::from_secs(pod["grace_seconds"].as_u64().unwrap_or(30));
        let hook: Vec<&str> = pod["pre_stop"]
            .as_array()
            .context("plan: no preStop hook")?
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let started = Instant::now();
        let mut exec = vec!["exec", container.as_str()];
        exec.extend(hook);
        // The hook waits until the broker exits: docker exec ends with the container.
        let hook_output = Command::new("docker")
            .args(&exec)
            .stdin(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        ensure!(
            !hook_output.contains("sending SIGTERM"),
            "pod {ordinal}'s preStop hook could not stop the node through the admin endpoint: {hook_output}"
        );
        println!("pod {ordinal}: {}", hook_output.trim());
        loop {
            let state = docker(&[
                "inspect",
                "--format",
                "{{.State.Running}} {{.State.ExitCode}}",
                &container,
            ])?;
            if state.starts_with("false") {
                let elapsed = started.elapsed();
                docker(&["rm", "-f", &container])?;
                ensure!(
                    state == "false 0",
                    "pod {ordinal}'s broker exited with status {state} after its preStop hook"
                );
                return Ok(elapsed);
            }
            if started.elapsed() > grace {
                bail!("pod {ordinal} still runs {grace:?} after its preStop hook began");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Whether pod `ordinal`'s container still runs, and its exit status.
    fn state(&self, ordinal: usize) -> anyhow::Result<(bool, i64)> {
        let state = docker(&[
            "inspect",
            "--format",
            "{{.State.Running}} {{.State.ExitCode}}",
            &self.container(ordinal),
        ])?;
        let (running, code) = state
            .split_once(' ')
            .with_context(|| format!("docker inspect said {state:?}"))?;
        Ok((running == "true", code.parse()?))
    }

    /// Waits (bounded by [`WAIT`]) until pod `ordinal`'s broker has exited; its exit status.
    async fn wait_for_exit(&self, ordinal: usize) -> anyhow::Result<i64> {
        let deadline = Instant::now() + WAIT;
        loop {
            let (running, code) = self.state(ordinal)?;
            if !running {
                return Ok(code);
            }
            ensure!(
                Instant::now() < deadline,
                "pod {ordinal} still runs after {WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits (bounded) until pod `ordinal`'s admin port answers `/healthz`: the process serves
    /// (a joining node listens only once it learned the committed membership).
    async fn wait_for_health(&self, ordinal: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + WAIT;
        while bmqctl::http::get(&self.admin(ordinal), "/healthz")
            .await
            .is_err()
        {
            ensure!(
                Instant::now() < deadline,
                "pod {ordinal} does not answer /healthz after {WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// The names of pod `ordinal`'s volumes for its PersistentVolumeClaims.
    fn claim_volumes(&self, ordinal: usize) -> anyhow::Result<Vec<String>> {
        let pod = &self.pods[ordinal];
        let name = text(pod, "name")?;
        pod["claims"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|claim| Ok(format!("{}-{}-{name}", self.prefix, text(claim, "name")?)))
            .collect()
    }

    /// The StatefulSet scaled down by one: its highest pod (`ordinal`, the last) deleted at
    /// once, then the pod's PersistentVolumeClaim deleted by the operator.
    fn scale_down_last(&mut self, ordinal: usize) -> anyhow::Result<()> {
        ensure!(
            ordinal + 1 == self.pods.len(),
            "a StatefulSet removes its highest ordinal only"
        );
        docker(&["rm", "-f", &self.container(ordinal)])?;
        for volume in self.claim_volumes(ordinal)? {
            docker(&["volume", "rm", &volume])?;
            self.volumes.retain(|v| *v != volume);
        }
        self.pods.pop();
        Ok(())
    }

    /// `bmqctl admin <args>` inside pod `ordinal`, as `kubectl exec` runs it: the members'
    /// DNS names resolve there (the leader the request is redirected to is named by its DNS
    /// name) and the pod's BMQ_ADMIN_TOKEN is the admin token. Its standard output.
    fn admin_exec(&self, ordinal: usize, args: &[String]) -> anyhow::Result<String> {
        let admin = format!("127.0.0.1:{}", port(&self.pods[ordinal], "admin")?);
        let mut exec: Vec<String> = vec![
            "exec".into(),
            self.container(ordinal),
            "bmqctl".into(),
            "admin".into(),
        ];
        exec.extend(args.iter().cloned());
        exec.extend([
            "--admin".into(),
            admin,
            "--timeout-ms".into(),
            "60000".into(),
        ]);
        let out = run(Command::new("docker").args(&exec))
            .with_context(|| format!("bmqctl admin {} in pod {ordinal}", args.join(" ")))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn logs(&self, ordinal: usize, lines: usize) -> String {
        Command::new("docker")
            .args([
                "logs",
                "--tail",
                &lines.to_string(),
                &self.container(ordinal),
            ])
            .output()
            .map(|o| {
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                )
            })
            .unwrap_or_default()
    }
}

impl Drop for Pods {
    fn drop(&mut self) {
        for ordinal in 0..self.pods.len() {
            if std::thread::panicking() {
                eprintln!("--- pod {ordinal} ---\n{}", self.logs(ordinal, 40));
            }
            let _ = Command::new("docker")
                .args(["rm", "-f", &self.container(ordinal)])
                .output();
        }
        for volume in &self.volumes {
            let _ = Command::new("docker")
                .args(["volume", "rm", volume])
                .output();
        }
        let _ = Command::new("docker")
            .args(["network", "rm", &self.network])
            .output();
    }
}

/// Waits until every pod's readiness probe answers 200 and every node's `/status` names one
/// leader at one term, the leader's metadata active.
async fn wait_for_cluster(p: &Pods, what: &str) -> anyhow::Result<Vec<NodeStatusDoc>> {
    wait_for_cluster_where(p, what, |_| Ok(())).await
}

/// [`wait_for_cluster`], until `holds` also accepts every pod's `/status` (or says why not).
async fn wait_for_cluster_where(
    p: &Pods,
    what: &str,
    holds: impl Fn(&[NodeStatusDoc]) -> Result<(), String>,
) -> anyhow::Result<Vec<NodeStatusDoc>> {
    let deadline = Instant::now() + WAIT;
    let mut last = String::new();
    loop {
        let mut docs = Vec::new();
        for ordinal in 0..p.pods.len() {
            let readiness = &p.pods[ordinal]["readiness"];
            let path = readiness["path"].as_str().unwrap_or("/readyz");
            match bmqctl::http::get(&p.admin(ordinal), path).await {
                Ok(_) => {}
                Err(e) => {
                    last = format!("pod {ordinal} not ready: {e:#}");
                    continue;
                }
            }
            match fetch_status(&p.admin(ordinal), Duration::from_secs(2)).await {
                Ok(doc) => docs.push(doc),
                Err(e) => last = format!("pod {ordinal}: {e:#}"),
            }
        }
        if docs.len() == p.pods.len() {
            let views: BTreeSet<(Option<u32>, u64)> = docs
                .iter()
                .map(|d| (d.elector.leader, d.elector.term))
                .collect();
            let active = docs.iter().any(|d| d.metadata.role == "active_leader");
            if views.len() == 1 && views.iter().all(|(l, _)| l.is_some()) && active {
                match holds(&docs) {
                    Ok(()) => return Ok(docs),
                    Err(why) => last = why,
                }
            } else {
                last = format!("views {views:?}, leader active: {active}");
            }
        }
        if Instant::now() > deadline {
            bail!("timed out after {WAIT:?} waiting for {what}; last: {last}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What a client outside the cluster holds: the CA of the TLS Secrets and a client token.
struct Credentials {
    ca: PathBuf,
    token: String,
}

/// `bmqctl produce` or `consume` of `count` messages on `queue` through `broker` with TLS and
/// the client token; the JSON report.
fn bmqctl_json(
    bmqctl: &Path,
    verb: &str,
    queue: &str,
    count: u64,
    broker: &str,
    c: &Credentials,
) -> anyhow::Result<Value> {
    let count = count.to_string();
    let mut args = vec!["--queue", queue, "--count", &count, "--broker", broker];
    if verb == "produce" {
        args.extend(["--size", "256"]);
    }
    let ca = c.ca.to_string_lossy();
    args.extend([
        "--tls-ca",
        &ca,
        "--token",
        &c.token,
        "--timeout-secs",
        "60",
        "--json",
    ]);
    let out = run(Command::new(bmqctl)
        .arg(verb)
        .args(&args)
        .env_remove("BMQ_CLUSTER_DIR")
        .current_dir(std::env::temp_dir()))
    .with_context(|| format!("bmqctl {verb}"))?;
    serde_json::from_slice(&out.stdout).with_context(|| format!("bmqctl {verb} printed no JSON"))
}

/// Starts `bmqctl bench messages`: one strong producer paced at 100 PUTs/s for `seconds` and
/// one consumer, on a queue of its own (named after `what`), through the client ports of pods
/// `0..pods` (TLS and the token).
fn start_paced(
    p: &Pods,
    bmqctl: &Path,
    c: &Credentials,
    pods: usize,
    seconds: u64,
    what: &str,
) -> anyhow::Result<std::process::Child> {
    let brokers: Vec<String> = (0..pods).map(|i| p.client(i)).collect();
    Command::new(bmqctl)
        .args(["bench", "messages", "--rate", "100", "--duration-secs"])
        .arg(seconds.to_string())
        .args(["--queues", "1", "--producers", "1", "--consumers", "1"])
        .args([
            "--size",
            "256",
            "--queue-prefix",
            &format!("helm-paced-{what}"),
            "--json",
            "--quiet",
        ])
        .args(["--drain-timeout-secs", "90", "--broker", &brokers.join(",")])
        .arg("--tls-ca")
        .arg(&c.ca)
        .args(["--token", &c.token])
        .env_remove("BMQ_CLUSTER_DIR")
        .current_dir(std::env::temp_dir())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("start bmqctl bench messages")
}

/// Waits for the paced run of [`start_paced`]: every PUT ACKed (no NACK, no client error) and
/// every ACKed message delivered.
fn check_paced(child: std::process::Child, what: &str) -> anyhow::Result<()> {
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "bmqctl bench messages failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).context("no JSON report")?;
    let count = |k: &str| report[k].as_u64().unwrap_or(u64::MAX);
    let nacks: u64 = report["nacks"]
        .as_object()
        .map_or(u64::MAX, |m| m.values().filter_map(Value::as_u64).sum());
    ensure!(
        count("sent") > 1000 && nacks == 0 && count("errors") == 0 && count("missing") == 0,
        "paced run: {report}"
    );
    println!(
        "paced producer across the {what}: {} PUTs, all ACKed and delivered, longest ACK gap {} ms",
        count("sent"),
        report["ack_gap_max_ms"]
    );
    Ok(())
}

/// The pods of the chart rendered with `values` (scripts/helm_pods.py into `dir`).
fn plan_pods(
    python: &Path,
    values: &Value,
    dir: &Path,
    secrets: &Path,
) -> anyhow::Result<(String, Vec<Value>)> {
    run(Command::new(python)
        .arg("-B")
        .arg(repo_root().join("scripts/helm_pods.py"))
        .arg("--values")
        .arg(values.to_string())
        .arg("--out")
        .arg(dir)
        .arg("--secrets")
        .arg(secrets)
        .stderr(Stdio::inherit()))?;
    let plan: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json"))?)?;
    let pods = plan["pods"].as_array().context("plan: no pods")?.clone();
    Ok((text(&plan, "network")?, pods))
}

fn random_hex(bytes: usize) -> String {
    let mut rng = rand::thread_rng();
    (0..bytes)
        .map(|_| format!("{:02x}", rng.gen::<u8>()))
        .collect()
}

/// Produces `count` messages on `queue` through pod `ordinal`; all must be ACKed.
fn produce(
    p: &Pods,
    bmqctl: &Path,
    c: &Credentials,
    queue: &str,
    count: u64,
    ordinal: usize,
) -> anyhow::Result<()> {
    let report = bmqctl_json(bmqctl, "produce", queue, count, &p.client(ordinal), c)?;
    ensure!(
        report["acked"] == count && report["nacked"] == 0,
        "produce {queue} through pod {ordinal}: {report}"
    );
    Ok(())
}

/// Consumes `count` distinct messages of `queue` through pod `ordinal`.
fn consume(
    p: &Pods,
    bmqctl: &Path,
    c: &Credentials,
    queue: &str,
    count: u64,
    ordinal: usize,
) -> anyhow::Result<()> {
    let report = bmqctl_json(bmqctl, "consume", queue, count, &p.client(ordinal), c)?;
    ensure!(
        report["distinct"] == count && report["corrupt"] == 0,
        "consume {queue} through pod {ordinal}: {report}"
    );
    Ok(())
}

/// The StatefulSet controller's rolling update of pods `0..next.len()` to the pod templates
/// `next`: highest ordinal first, one pod at a time (preStop hook, container gone, recreated with its volume), the
/// next only once every pod is ready again.
async fn rolling_update(p: &mut Pods, next: &[Value], what: &str) -> anyhow::Result<()> {
    for ordinal in (0..next.len()).rev() {
        let stopped = p.delete(ordinal)?;
        p.pods[ordinal] = next[ordinal].clone();
        p.start(ordinal)?;
        wait_for_cluster(p, &format!("pod {ordinal} to be ready again ({what})"))
            .await
            .with_context(|| p.logs(ordinal, 30))?;
        println!(
            "{what}: pod {ordinal} stopped gracefully in {:.1} s, ready again",
            stopped.as_secs_f64()
        );
    }
    Ok(())
}

/// `text` without its ANSI escape sequences (the broker colours its log on standard error).
fn without_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            // CSI: ESC [ parameters, then one final byte in @..~.
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}

/// The voters of a node's committed membership, by id.
fn voters(d: &NodeStatusDoc) -> Vec<u32> {
    d.membership
        .as_ref()
        .map(|m| {
            m.members
                .iter()
                .filter(|m| m.role == "voter")
                .map(|m| m.node_id)
                .collect()
        })
        .unwrap_or_default()
}

/// Every node's committed membership has the voters `want` (and no other member) at one
/// epoch; or why not.
fn agree_on_voters(docs: &[NodeStatusDoc], want: &[u32]) -> Result<(), String> {
    let mut epochs = BTreeSet::new();
    for d in docs {
        let Some(m) = d.membership.as_ref() else {
            return Err(format!("node {}: no membership in /status", d.node_id));
        };
        if voters(d) != want || m.members.len() != want.len() {
            return Err(format!(
                "node {}: voters {:?} of {} members, want {want:?}",
                d.node_id,
                voters(d),
                m.members.len()
            ));
        }
        epochs.insert(m.epoch);
    }
    if epochs.len() != 1 {
        return Err(format!("membership epochs {epochs:?} differ between nodes"));
    }
    Ok(())
}

/// The same pod as `a` (a running pod's plan), in `b` (the plan of a later render): what the
/// StatefulSet controller compares, the pod template, here the plan (command, environment,
/// security context, probes, mounts) and the content of every file mounted from a ConfigMap,
/// Secret or projected volume. Where they are equal the upgrade leaves the pod running.
fn same_pod(a: &Value, b: &Value) -> anyhow::Result<bool> {
    let without_sources = |v: &Value| {
        let mut v = v.clone();
        for m in v["mounts"].as_array_mut().into_iter().flatten() {
            m["source"] = Value::Null;
        }
        v
    };
    if without_sources(a) != without_sources(b) {
        return Ok(false);
    }
    let mounts = |v: &Value| -> Vec<String> {
        v["mounts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["source"].as_str().map(String::from))
            .collect()
    };
    for (x, y) in mounts(a).iter().zip(mounts(b)) {
        if files_under(Path::new(x))? != files_under(Path::new(&y))? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Every file under `dir`: its path relative to `dir`, and its content.
fn files_under(dir: &Path) -> anyhow::Result<Vec<(PathBuf, Vec<u8>)>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).with_context(|| format!("read {}", d.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                todo.push(path);
            } else {
                let rel = path.strip_prefix(dir)?.to_path_buf();
                out.push((rel, std::fs::read(&path)?));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Steps 1 to 3 of the module doc: the cluster forms, messages round-trip, and a rolling
/// restart under a paced producer keeps every message.
async fn form_and_roll(p: &mut Pods, bmqctl: &Path, c: &Credentials) -> anyhow::Result<()> {
    // 1. Parallel pod management: every pod starts at once, and the cluster forms.
    let started = Instant::now();
    for ordinal in 0..p.pods.len() {
        p.start(ordinal)?;
    }
    let docs = wait_for_cluster(p, "the rendered cluster to form").await?;
    let ids: Vec<u32> = docs.iter().map(|d| d.node_id).collect();
    ensure!(ids == [1, 2, 3], "pod ordinals 0..3 run node ids {ids:?}");
    println!(
        "cluster formed in {:.1} s: leader {:?}, term {}",
        started.elapsed().as_secs_f64(),
        docs[0].elector.leader,
        docs[0].elector.term
    );

    // 2. Messages through the client ports, with TLS and the client token.
    produce(p, bmqctl, c, "bmq://bmq.test/helm", 200, 0)?;
    produce(p, bmqctl, c, "bmq://bmq.test/helm-rt", 50, 1)?;
    consume(p, bmqctl, c, "bmq://bmq.test/helm-rt", 50, 2)?;

    // 3. A rolling restart (same templates) under a strong producer paced at 100 PUTs/s and
    //    a consumer, through every pod: each PUT ACKed and delivered; the messages produced
    //    before survive it.
    let same = p.pods.clone();
    let paced = start_paced(p, bmqctl, c, REPLICAS, 30, "roll")?;
    rolling_update(p, &same, "rolling restart").await?;
    check_paced(paced, "rolling restart")
        .context("the paced producer across the rolling restart")?;
    consume(p, bmqctl, c, "bmq://bmq.test/helm", 200, 1)?;
    Ok(())
}

/// Step 4 of the module doc: 3 to 5 pods and back to 3 through the live membership, the
/// running pods left as they are, under a paced strong producer.
async fn scale_up_and_down(
    p: &mut Pods,
    bmqctl: &Path,
    c: &Credentials,
    scaled: &[Value],
) -> anyhow::Result<()> {
    let all: Vec<u32> = (1..=scaled.len() as u32).collect();
    // `helm upgrade --set replicas=5` with cluster.initialMembers at 3: the running pods' plan
    // is what they run, so the StatefulSet controller rolls none of them.
    for (ordinal, pod) in p.pods.iter().enumerate() {
        ensure!(
            same_pod(pod, &scaled[ordinal])?,
            "pod {ordinal} of the 5-replica render differs from the running one: it would roll"
        );
    }
    produce(p, bmqctl, c, "bmq://bmq.test/helm-scale", 100, 2)?;
    // Through the pods that stay, for longer than both changes take (about 12 s).
    const PACED_SECS: u64 = 30;
    let paced = start_paced(p, bmqctl, c, REPLICAS, PACED_SECS, "scale")?;
    let scaling = Instant::now();

    // Scale-up: the StatefulSet creates pods 3 and 4 at once (Parallel). Each learns the
    // committed membership through `join` and waits, serving nothing, to be added.
    for (ordinal, pod) in scaled.iter().enumerate().skip(REPLICAS) {
        p.pods.push(pod.clone());
        p.start(ordinal)?;
    }
    for ordinal in REPLICAS..scaled.len() {
        p.wait_for_health(ordinal)
            .await
            .with_context(|| p.logs(ordinal, 30))?;
        let before = fetch_status(&p.admin(ordinal), Duration::from_secs(2)).await?;
        let ready = bmqctl::http::get(&p.admin(ordinal), "/readyz").await;
        ensure!(
            before.membership.is_none() && ready.is_err(),
            "pod {ordinal} before its addition: membership {:?}, /readyz {ready:?}",
            before.membership
        );
    }
    // The operator adds them one at a time (one membership change at a time), each answered
    // once it is promoted to voter.
    for (ordinal, pod) in scaled.iter().enumerate().skip(REPLICAS) {
        let host = pod["aliases"][0]
            .as_str()
            .context("plan: no DNS name")?
            .to_string();
        let mut add = vec![
            "add-member".to_string(),
            "--id".into(),
            (ordinal + 1).to_string(),
            "--host".into(),
            host,
            "--client-port".into(),
            port(pod, "client")?.to_string(),
            "--peer-port".into(),
            port(pod, "peer")?.to_string(),
            "--admin-port".into(),
            port(pod, "admin")?.to_string(),
        ];
        if let Ok(bmqp) = port(pod, "bmqp") {
            add.extend(["--bmqp-port".into(), bmqp.to_string()]);
        }
        let answer = p.admin_exec(0, &add)?;
        ensure!(
            answer.contains("promoted to voter"),
            "add-member {} answered {answer:?}",
            ordinal + 1
        );
        println!("scale-up: node {} added and promoted to voter", ordinal + 1);
    }
    let docs =
        wait_for_cluster_where(p, "the 5-node cluster", |docs| agree_on_voters(docs, &all)).await?;
    for d in &docs[REPLICAS..] {
        let disagrees = d.membership.as_ref().and_then(|m| m.file_disagrees.clone());
        ensure!(
            disagrees.is_none(),
            "joined node {}: its file disagrees with the membership: {disagrees:?}",
            d.node_id
        );
    }
    println!("scaled up to 5 nodes: voters {all:?} on every node");
    consume(
        p,
        bmqctl,
        c,
        "bmq://bmq.test/helm-scale",
        50,
        scaled.len() - 1,
    )?;

    // Scale-down: the highest node first, removed from the membership BEFORE the
    // StatefulSet's replicas shrink. The removed node exits; the kubelet restarts it, and it
    // refuses to run on its data; then the pod goes (replicas - 1) and its claim is deleted.
    for ordinal in (REPLICAS..scaled.len()).rev() {
        let id = ordinal + 1;
        let answer = p.admin_exec(0, &["remove-member".into(), "--id".into(), id.to_string()])?;
        ensure!(
            answer.contains("removed"),
            "remove-member {id} answered {answer:?}"
        );
        let status = p.wait_for_exit(ordinal).await?;
        let log = p.logs(ordinal, 20);
        ensure!(
            status != 0 && log.contains("was removed from the cluster"),
            "node {id} after its removal: exit status {status}, log:\n{log}"
        );
        // restartPolicy Always: the kubelet starts the pod's container again, on the same
        // volume (here a new container: docker does not restore the tmpfs modes on a restart).
        docker(&["rm", &p.container(ordinal)])?;
        p.start(ordinal)?;
        let status = p.wait_for_exit(ordinal).await?;
        let log = p.logs(ordinal, 20);
        ensure!(
            status != 0 && log.contains("it never votes or serves again"),
            "node {id} restarted on its data after its removal: exit status {status}, log:\n{log}"
        );
        p.scale_down_last(ordinal)?;
        let want = &all[..ordinal];
        let docs = wait_for_cluster_where(p, &format!("voters {want:?} everywhere"), |docs| {
            agree_on_voters(docs, want)
        })
        .await?;
        ensure!(
            docs.iter().all(|d| d
                .membership
                .as_ref()
                .is_some_and(|m| m.removed.contains(&(id as u32)))),
            "node {id} is not listed as removed everywhere"
        );
        println!(
            "scale-down: node {id} removed, exited, refused to run again on its data; \
             pod and claim deleted; voters {want:?} on every node"
        );
    }
    println!(
        "scaled from 3 to 5 and back in {:.1} s, the paced producer running for {PACED_SECS} s",
        scaling.elapsed().as_secs_f64()
    );
    check_paced(paced, "scale-up and scale-down")
        .context("the paced producer across the scale-up and scale-down")?;
    consume(p, bmqctl, c, "bmq://bmq.test/helm-scale", 50, 0)?;
    Ok(())
}

/// Step 5 of the module doc: the primary of a queue holding unconsumed messages is killed
/// (its pod deleted at once), recreated on its volume, and rejoins with its data.
async fn recreate_primary_on_its_volume(
    p: &mut Pods,
    bmqctl: &Path,
    c: &Credentials,
) -> anyhow::Result<()> {
    const QUEUE: &str = "bmq://bmq.test/helm-recreate";
    produce(p, bmqctl, c, QUEUE, 100, 0)?;
    // The queue's partition, and that partition's primary, as the nodes report them.
    let docs = wait_for_cluster(p, "the cluster before the kill").await?;
    let partition = docs
        .iter()
        .flat_map(|d| &d.queues)
        .find(|q| q.uri == QUEUE)
        .with_context(|| format!("no node's /status lists {QUEUE}"))?
        .partition_id;
    let primary = docs[0]
        .partitions
        .iter()
        .find(|x| x.partition_id == partition)
        .and_then(|x| x.primary)
        .with_context(|| format!("partition {partition} has no primary"))?;
    let ordinal = primary as usize - 1;
    // SIGKILL, no preStop hook: as a node lost, or `kubectl delete pod --grace-period=0
    // --force`. The journal on the volume is all the node keeps.
    docker(&["kill", "--signal", "KILL", &p.container(ordinal)])?;
    docker(&["rm", "-f", &p.container(ordinal)])?;
    println!("pod {ordinal} (node {primary}, primary of partition {partition}) killed");
    p.start(ordinal)?;
    let docs = wait_for_cluster_where(p, &format!("pod {ordinal} recreated to be ready"), |docs| {
        agree_on_voters(docs, &[1, 2, 3])
    })
    .await
    .with_context(|| p.logs(ordinal, 30))?;
    // Its journal came back from the volume: the partition's records, the messages still
    // outstanding, recovered before it talked to any peer.
    let log = without_ansi(&p.logs(ordinal, 100_000));
    let dir = format!("dir=/var/lib/bmq/partitions/{partition} ");
    let outstanding = log
        .lines()
        .filter(|l| l.contains("partition journal recovered") && l.contains(&dir))
        .find_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("outstanding="))
                .and_then(|n| {
                    n.trim_end_matches(|ch: char| !ch.is_ascii_digit())
                        .parse::<u64>()
                        .ok()
                })
        })
        .with_context(|| format!("no 'partition journal recovered' line for {dir} in:\n{log}"))?;
    ensure!(
        outstanding >= 100,
        "pod {ordinal} recovered {outstanding} messages of partition {partition}, not 100"
    );
    println!(
        "pod {ordinal} recreated on its volume: {outstanding} outstanding messages of \
         partition {partition} recovered; ready; voters 1-3 at epoch {:?} everywhere",
        docs[0].membership.as_ref().map(|m| m.epoch)
    );
    consume(p, bmqctl, c, QUEUE, 100, ordinal)?;
    Ok(())
}

/// The chart's pods, run as a kubelet would, form a cluster, roll, grow from 3 to 5 and shrink
/// back through the live membership, and rejoin with their data when a primary's pod is
/// killed and recreated on its volume (the steps of the module doc, in order).
#[test]
fn helm_rendered_pods_form_a_cluster_roll_scale_and_recover_a_pod() -> anyhow::Result<()> {
    if let Some(reason) = docker_unavailable() {
        println!("skipped helm pods test: {reason}");
        return Ok(());
    }
    let root = repo_root();
    let python = venv_python("helm-venv.sh")?;
    let work = tempfile::tempdir()?;
    let prefix = format!("bmqhelm{}", std::process::id());

    // The TLS Secrets an operator or cert-manager would create: node n's certificate names
    // node-<n> (what its peers check) and its stable DNS name.
    let hosts: Vec<(u32, String)> = (0..SCALED)
        .map(|i| {
            (
                i as u32 + 1,
                format!("rel-bmq-{i}.rel-bmq-headless.bmq-ns.svc.cluster.local"),
            )
        })
        .collect();
    let ca = bmqctl::dev_ca::generate_dev_ca(&work.path().join("ca"), &hosts)?;
    let secrets = work.path().join("secrets");
    for (id, tls) in &ca.nodes {
        let dir = secrets.join(format!("{TLS_SECRET_PREFIX}-{id}"));
        std::fs::create_dir_all(&dir)?;
        std::fs::copy(&ca.ca_cert, dir.join("ca.crt"))?;
        std::fs::copy(&tls.cert_file, dir.join("tls.crt"))?;
        std::fs::copy(&tls.key_file, dir.join("tls.key"))?;
    }
    let token = random_hex(24);
    let admin_token = random_hex(24);
    let values = json!({
        "replicas": REPLICAS,
        "cluster": {"initialMembers": REPLICAS},
        "image": {"repository": IMAGE_REPOSITORY, "tag": IMAGE_TAG},
        "tls": {"enabled": true, "secretPrefix": TLS_SECRET_PREFIX},
        "auth": {
            "enabled": true,
            "adminToken": admin_token,
            "tokens": [{"name": "helm-test", "secret": token, "domains": ["*"],
                        "permissions": ["produce", "consume"]}],
        },
    });
    let (network, pods) = plan_pods(&python, &values, &work.path().join("pods"), &secrets)?;
    ensure!(
        pods.len() == REPLICAS,
        "the chart rendered {} pods",
        pods.len()
    );
    // What `helm upgrade --set replicas=5` renders: the pods of the scale-up.
    let mut scaled_values = values.clone();
    scaled_values["replicas"] = json!(SCALED);
    let (_, scaled) = plan_pods(
        &python,
        &scaled_values,
        &work.path().join("pods-scaled"),
        &secrets,
    )?;
    ensure!(
        scaled.len() == SCALED,
        "the chart rendered {} pods for {SCALED} replicas",
        scaled.len()
    );

    // The image, from the binaries of this build profile.
    let broker = broker_binary();
    let bmqctl = broker.with_file_name("bmqctl");
    let profile = broker
        .parent()
        .and_then(|d| d.file_name())
        .and_then(|n| n.to_str())
        .context("target/<profile>/broker")?
        .to_string();
    let built = Instant::now();
    run(Command::new(root.join("scripts/docker-build.sh"))
        .args(["--profile", &profile, "--no-cargo", "--no-prometheus"])
        .env(
            "BMQ_BROKER_IMAGE",
            format!("{IMAGE_REPOSITORY}:{IMAGE_TAG}"),
        )
        .current_dir(&root))?;
    println!("image built in {:.1} s", built.elapsed().as_secs_f64());

    let network = format!("{prefix}-{network}");
    docker(&["network", "create", &network])?;
    // Host ports for every pod of the scale-up too.
    let ports = free_ports(2 * SCALED);
    let mut p = Pods {
        prefix,
        network,
        pods,
        admin_ports: ports[..SCALED].to_vec(),
        client_ports: ports[SCALED..].to_vec(),
        volumes: Vec::new(),
    };
    let credentials = Credentials {
        ca: ca.ca_cert.clone(),
        token,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    let result = runtime.block_on(async {
        form_and_roll(&mut p, &bmqctl, &credentials)
            .await
            .context("forming and rolling the cluster")?;
        scale_up_and_down(&mut p, &bmqctl, &credentials, &scaled)
            .await
            .context("scaling from 3 to 5 pods and back")?;
        recreate_primary_on_its_volume(&mut p, &bmqctl, &credentials)
            .await
            .context("a primary's pod recreated on its volume")
    });
    if result.is_err() {
        for ordinal in 0..p.pods.len() {
            eprintln!("--- pod {ordinal} ---\n{}", p.logs(ordinal, 40));
        }
    }
    result
}
