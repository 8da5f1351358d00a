//! What the Helm chart renders, run as a kubelet would run it, under docker.
//!
//! `scripts/helm_pods.py` renders `deploy/helm/bmq` (3 replicas, TLS from existing Secrets,
//! an admin token and a client token) and writes down each pod of the StatefulSet: its name and
//! DNS names through the headless Service, command, environment (the downward API's pod name,
//! the Secret's admin token), security context, probes, preStop hook, and the files of every
//! ConfigMap, Secret and projected volume it mounts. The TLS Secrets are those an operator (or
//! cert-manager) would create: a development CA and one certificate per node, from
//! `bmqctl::dev_ca`. Each pod becomes a container of the broker image (built by
//! `scripts/docker-build.sh`) on a private network, with those names as network aliases, a
//! read-only root file system, no capabilities, the mounts, tmpfs for the emptyDirs and one
//! named volume per pod for its PersistentVolumeClaim. Then:
//!
//! 1. the cluster forms from the rendered configuration alone: every pod's `/readyz` (its
//!    readiness probe) answers 200 and every node's `/status` names the same leader;
//! 2. messages round-trip through the client ports with TLS and the client token;
//! 3. a rolling restart as the StatefulSet controller does it, under a paced strong producer
//!    and a consumer (every PUT ACKed and delivered): from the highest ordinal down,
//!    one pod at a time, the preStop hook (a graceful stop) run and the container gone within
//!    `terminationGracePeriodSeconds`, the pod recreated with its volume, and the next one only
//!    once it is ready again; the messages produced before are then all consumed;
//! 4. a scale-up from 3 to 4 as the chart's README says: the pods of `replicas: 4` rendered,
//!    pod 3 started (not a member yet), `bmqctl admin add-member` run inside pod 0 (as with
//!    `kubectl exec`), then pods 2, 1, 0 rolled to the configuration that lists node 4: every
//!    node reports voters 1-4 and no disagreement between its file and the membership, and
//!    messages produced before the scale-up are consumed through node 4.
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
/// Replicas of the rendered StatefulSet.
const REPLICAS: usize = 3;
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
                return Ok(docs);
            }
            last = format!("views {views:?}, leader active: {active}");
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

/// Starts `bmqctl bench messages`: one strong producer paced at 100 PUTs/s for 30 s and one
/// consumer, on a queue of its own, through every pod's client port (TLS and the token).
fn start_paced(p: &Pods, bmqctl: &Path, c: &Credentials) -> anyhow::Result<std::process::Child> {
    let brokers: Vec<String> = (0..p.pods.len()).map(|i| p.client(i)).collect();
    Command::new(bmqctl)
        .args([
            "bench",
            "messages",
            "--rate",
            "100",
            "--duration-secs",
            "30",
        ])
        .args(["--queues", "1", "--producers", "1", "--consumers", "1"])
        .args([
            "--size",
            "256",
            "--queue-prefix",
            "helm-paced",
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
fn check_paced(child: std::process::Child) -> anyhow::Result<()> {
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
        "paced producer across the roll: {} PUTs, all ACKed and delivered, longest ACK gap {} ms",
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

async fn scenario(
    p: &mut Pods,
    bmqctl: &Path,
    c: &Credentials,
    scaled: Vec<Value>,
) -> anyhow::Result<()> {
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
    let paced = start_paced(p, bmqctl, c)?;
    rolling_update(p, &same, "rolling restart").await?;
    check_paced(paced).context("the paced producer across the rolling restart")?;
    consume(p, bmqctl, c, "bmq://bmq.test/helm", 200, 1)?;

    // 4. Scale-up to 4 as the chart's README says: the upgrade to `replicas: 4` with
    //    `rollingUpdatePartition: 3` starts pod 3 (not a member yet) and leaves pods 0-2 as
    //    they are, `bmqctl admin add-member` adds node 4 at its stable name, and the upgrade to
    //    `rollingUpdatePartition: 0` rolls pods 2, 1, 0 to the configuration that lists it.
    produce(p, bmqctl, c, "bmq://bmq.test/helm-scale", 100, 2)?;
    let new = scaled.len() - 1;
    p.pods.push(scaled[new].clone());
    p.start(new)?;
    // The leader asks the joiner's /status before it adds it: wait until it answers (as an
    // operator waits for the pod to run).
    let deadline = Instant::now() + Duration::from_secs(60);
    while bmqctl::http::get(&p.admin(new), "/healthz").await.is_err() {
        ensure!(Instant::now() < deadline, "pod {new} did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pod = &scaled[new];
    let host = pod["aliases"][0]
        .as_str()
        .context("plan: no DNS name")?
        .to_string();
    let (client, peer, admin) = (
        port(pod, "client")?,
        port(pod, "peer")?,
        port(pod, "admin")?,
    );
    // As an operator does it: `kubectl exec` into a member and run bmqctl there, where the
    // members' names resolve (the leader the request is redirected to is named by its DNS
    // name) and the pod's BMQ_ADMIN_TOKEN is the admin token.
    let container = p.container(0);
    let admin_local = format!("127.0.0.1:{}", port(&p.pods[0], "admin")?);
    let mut add = vec![
        "exec".to_string(),
        container,
        "bmqctl".into(),
        "admin".into(),
        "add-member".into(),
        "--id".into(),
        (new + 1).to_string(),
        "--host".into(),
        host,
        "--client-port".into(),
        client.to_string(),
        "--peer-port".into(),
        peer.to_string(),
        "--admin-port".into(),
        admin.to_string(),
    ];
    if let Ok(bmqp) = port(pod, "bmqp") {
        add.extend(["--bmqp-port".into(), bmqp.to_string()]);
    }
    add.extend([
        "--admin".into(),
        admin_local,
        "--timeout-ms".into(),
        "60000".into(),
    ]);
    run(Command::new("docker").args(&add)).context("bmqctl admin add-member in pod 0")?;
    let docs = wait_for_cluster(p, "node 4 to join").await?;
    let upgraded = scaled[..new].to_vec();
    rolling_update(p, &upgraded, "scale-up").await?;
    let docs_after = wait_for_cluster(p, "the 4-node cluster").await?;
    for d in docs.iter().chain(&docs_after) {
        let membership = d.membership.as_ref().context("no membership in /status")?;
        let voters: Vec<u32> = membership
            .members
            .iter()
            .filter(|m| m.role == "voter")
            .map(|m| m.node_id)
            .collect();
        ensure!(
            voters == [1, 2, 3, 4],
            "node {}: voters {voters:?} after the scale-up",
            d.node_id
        );
    }
    for d in &docs_after {
        let disagrees = d.membership.as_ref().and_then(|m| m.file_disagrees.clone());
        ensure!(
            disagrees.is_none(),
            "node {}'s rendered file disagrees with the membership after the upgrade: {disagrees:?}",
            d.node_id
        );
    }
    println!("scaled up to 4 nodes: voters 1, 2, 3, 4 on every node");
    consume(p, bmqctl, c, "bmq://bmq.test/helm-scale", 100, new)?;
    Ok(())
}

#[test]
fn helm_rendered_pods_form_a_cluster_roll_and_scale_up() -> anyhow::Result<()> {
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
    let hosts: Vec<(u32, String)> = (0..=REPLICAS)
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
    // What `helm upgrade --set replicas=4` renders: the pods of the scale-up.
    let mut scaled_values = values.clone();
    scaled_values["replicas"] = json!(REPLICAS + 1);
    let (_, scaled) = plan_pods(
        &python,
        &scaled_values,
        &work.path().join("pods-scaled"),
        &secrets,
    )?;
    ensure!(
        scaled.len() == REPLICAS + 1,
        "the chart rendered {} pods for {} replicas",
        scaled.len(),
        REPLICAS + 1
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
    let ports = free_ports(2 * (REPLICAS + 1));
    let mut p = Pods {
        prefix,
        network,
        pods,
        admin_ports: ports[..=REPLICAS].to_vec(),
        client_ports: ports[REPLICAS + 1..].to_vec(),
        volumes: Vec::new(),
    };
    let credentials = Credentials {
        ca: ca.ca_cert.clone(),
        token,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    let result = runtime.block_on(scenario(&mut p, &bmqctl, &credentials, scaled));
    if result.is_err() {
        for ordinal in 0..p.pods.len() {
            eprintln!("--- pod {ordinal} ---\n{}", p.logs(ordinal, 40));
        }
    }
    result
}
