//! `bmqctl cluster up`: start an N-node cluster on this machine and supervise it.
//!
//! Writes `<dir>/node-<i>/broker.toml` from [`local_cluster`] (the embedded default
//! configuration), starts one `broker --config <file>` process per node with its standard output
//! and error appended to `<dir>/node-<i>/broker.log`, waits until the cluster agrees on an active
//! leader ([`wait_for_leader`]), prints how to use it, then runs until Ctrl-C or SIGTERM and stops
//! every node (SIGTERM, then SIGKILL after [`STOP_GRACE_PERIOD`]).
//!
//! Security: unless `--no-security`, it first writes a development CA, one
//! certificate per node ([`crate::dev_ca::generate_dev_ca`]) and two random tokens into
//! `<dir>/security/` (`ca.pem`, `node-<i>.pem`, `client.token`, `admin.token`; keys and tokens
//! mode 0600), and the nodes' configurations enable mutual TLS on the peer links, TLS on the
//! client listener, the client token (produce, consume and admin on every domain) and the admin
//! token. `bmqctl produce`/`consume` run from the same directory find the CA and the client
//! token there by default ([`crate::credentials`]).
//!
//! A node that exits during start-up aborts the launch with the tail of its log (a port already
//! in use shows up there). A node that exits later is reported and the others keep running.
//!
//! When a `prometheus` executable is on `PATH` (Debian: `apt-get install prometheus`), it also
//! starts Prometheus with the shipped configuration and alert rules ([`crate::prometheus`])
//! pointed at the new nodes, storing into `<dir>/prometheus/`, on `--prometheus-listen`
//! (default `127.0.0.1:9090`); `--no-prometheus` skips it. It also serves the dashboards as
//! console pages (`/consoles/bmq-cluster.html` and the others, written into
//! `<dir>/prometheus/consoles/`) when the installation's console libraries are found. Prometheus
//! is an extra: if it is missing, its port is taken or it exits, the cluster runs on and a note
//! says why.
//!
//! `--configs-only` writes the same files (the nodes' configurations and, unless
//! `--no-security`, the development CA and tokens), prints their paths and exits 0 without
//! starting a broker or Prometheus: for scripts that run the `broker` processes themselves (to
//! read their memory, signal them by pid, or edit a configuration first). It neither needs the
//! broker binary nor checks that the ports are free, since it binds nothing.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use futures::FutureExt;
use tokio::process::{Child, Command};

use crate::prometheus::{self, ScrapeTarget};
use crate::status::wait_for_leader;
use bmq_config::{local_cluster, BrokerConfig, LOCAL_CLUSTER_BASE_PORT};

/// How long `cluster up` waits for an agreed, active leader after starting the nodes.
pub const LEADER_WAIT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a node may take to exit after SIGTERM before it gets SIGKILL.
pub const STOP_GRACE_PERIOD: Duration = Duration::from_secs(5);

/// Lines of a node's log shown when it exits unexpectedly.
const LOG_TAIL_LINES: usize = 20;

/// Bytes read from the end of a node's log to find its last lines.
const LOG_TAIL_BYTES: u64 = 64 * 1024;

/// Arguments of `bmqctl cluster up`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Start a local cluster (N broker processes on 127.0.0.1) and run it until Ctrl-C",
    after_help = "Examples:\n  \
        bmqctl cluster up\n  \
        bmqctl cluster up --nodes 5 --dir /tmp/bmq --base-port 40000 --clean\n  \
        bmqctl cluster up --configs-only --no-security --dir /tmp/bmq --clean\n\n\
        Node i listens on 127.0.0.1 with client port BASE+i, peer port BASE+100+i and admin \
        port BASE+200+i; its configuration, data and log are in DIR/node-<i>."
)]
pub struct ClusterUpArgs {
    /// Number of broker nodes (1 to 7).
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Directory of the nodes' configurations, data and logs.
    #[arg(long, default_value = ".cluster")]
    pub dir: PathBuf,
    /// Base port: node i uses BASE+i (client), BASE+100+i (peer), BASE+200+i (admin).
    #[arg(long, default_value_t = LOCAL_CLUSTER_BASE_PORT)]
    pub base_port: u16,
    /// The broker binary [default: `broker` next to this bmqctl executable].
    #[arg(long, value_name = "PATH")]
    pub broker_bin: Option<PathBuf>,
    /// Remove DIR first (start from empty data).
    #[arg(long)]
    pub clean: bool,
    /// Do not start Prometheus beside the cluster.
    #[arg(long)]
    pub no_prometheus: bool,
    /// Where the Prometheus started beside the cluster serves its UI and API.
    #[arg(long, default_value = DEFAULT_PROMETHEUS_LISTEN, value_name = "HOST:PORT")]
    pub prometheus_listen: String,
    /// Plain TCP and no tokens (no development CA is written).
    #[arg(long)]
    pub no_security: bool,
    /// Write the nodes' configurations (and the development CA and tokens unless
    /// --no-security), print their paths and exit, starting no broker.
    #[arg(long)]
    pub configs_only: bool,
}

/// Default address of the Prometheus that `cluster up` starts (Prometheus's usual port).
pub const DEFAULT_PROMETHEUS_LISTEN: &str = "127.0.0.1:9090";

/// One started broker process.
struct Node {
    id: u32,
    config: BrokerConfig,
    config_path: PathBuf,
    log_path: PathBuf,
    child: Child,
    /// Set once the process has exited and been reaped.
    exit: Option<ExitStatus>,
}

/// What `cluster up` writes before it starts any process.
#[derive(Debug, Clone)]
pub struct WrittenCluster {
    /// The cluster's directory, absolute.
    pub dir: PathBuf,
    /// Every node's configuration and the `broker.toml` it was written to, in node order.
    pub nodes: Vec<(BrokerConfig, PathBuf)>,
    /// `<dir>/security/`, holding the development CA and the tokens; `None` with
    /// `--no-security`.
    pub security: Option<PathBuf>,
}

/// Writes what the cluster needs before its nodes start: removes the directory first with
/// `--clean`, writes the development CA and tokens unless `--no-security` (see
/// [`secure_local_cluster`]), then `<dir>/node-<i>/broker.toml` for every node.
///
/// Errors: invalid arguments (a node count out of range) or a file that cannot be written.
pub fn write_cluster(args: &ClusterUpArgs) -> anyhow::Result<WrittenCluster> {
    let dir = absolute(&args.dir)?;
    if args.clean && dir.exists() {
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    let mut configs = local_cluster(args.nodes, args.base_port, &dir)
        .context("cannot build the cluster configuration")?;
    let security = if args.no_security {
        None
    } else {
        secure_local_cluster(&mut configs, &dir)?;
        Some(dir.join(crate::credentials::SECURITY_DIR))
    };
    let nodes = configs
        .into_iter()
        .map(|config| {
            let path = write_node_config(&config)?;
            Ok((config, path))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(WrittenCluster {
        dir,
        nodes,
        security,
    })
}

/// Writes a node's configuration to `<data_dir>/broker.toml` and returns that path.
pub(crate) fn write_node_config(config: &BrokerConfig) -> anyhow::Result<PathBuf> {
    let node_dir = &config.data_dir;
    std::fs::create_dir_all(node_dir)
        .with_context(|| format!("cannot create {}", node_dir.display()))?;
    let config_path = node_dir.join("broker.toml");
    let text = format!(
        "# Written by `bmqctl cluster up`; rewritten at each start.\n{}",
        config.to_toml_string()
    );
    // The configuration holds the tokens: readable by this user only.
    crate::dev_ca::write_file(&config_path, text.as_bytes(), true)?;
    Ok(config_path)
}

/// Prints the files [`write_cluster`] wrote, for `--configs-only`: one line per configuration,
/// then the security files.
fn print_written(cluster: &WrittenCluster) {
    use crate::credentials::{ADMIN_TOKEN_FILE, CA_FILE, CLIENT_TOKEN_FILE};
    outln!(
        "wrote the configurations of {} nodes in {} (no broker started):",
        cluster.nodes.len(),
        cluster.dir.display()
    );
    for (config, path) in &cluster.nodes {
        outln!("  node {}: {}", config.node_id, path.display());
    }
    if let Some(security) = &cluster.security {
        outln!(
            "security: CA {}, client token {}, admin token {}",
            security.join(CA_FILE).display(),
            security.join(CLIENT_TOKEN_FILE).display(),
            security.join(ADMIN_TOKEN_FILE).display()
        );
    }
    outln!(
        "start node i with: broker --config {}",
        cluster.dir.join("node-<i>").join("broker.toml").display()
    );
}

/// Runs `bmqctl cluster up` until Ctrl-C or SIGTERM; with `--configs-only`, writes the files
/// ([`write_cluster`]), prints their paths and returns.
///
/// Errors: invalid arguments, a missing broker binary, files that cannot be written, a node that
/// fails to start or exits during start-up (with the tail of its log), or no agreed leader within
/// [`LEADER_WAIT_TIMEOUT`]. Every started node is stopped on every exit path.
pub async fn run(args: ClusterUpArgs) -> anyhow::Result<()> {
    if args.configs_only {
        let cluster = write_cluster(&args)?;
        print_written(&cluster);
        return Ok(());
    }
    let broker_bin = match &args.broker_bin {
        Some(path) => path.clone(),
        // The `broker` binary next to this `bmqctl`: `cargo build --release --bins` builds
        // both in one invocation (one feature resolution, nothing compiled twice). bmqctl
        // never runs cargo itself.
        None => std::env::current_exe()
            .context("cannot locate the bmqctl executable")?
            .with_file_name("broker"),
    };
    if !broker_bin.is_file() {
        bail!(
            "broker binary not found at {}: build both binaries with \
             `cargo build --release --bins` (`cargo run --bin bmqctl` builds only bmqctl), \
             or pass --broker-bin",
            broker_bin.display()
        );
    }
    // Checked before anything is written or removed: a second `cluster up` on the ports of a
    // running one fails without touching files.
    let planned = local_cluster(args.nodes, args.base_port, &absolute(&args.dir)?)
        .context("cannot build the cluster configuration")?;
    check_ports_free(&planned)?;
    let WrittenCluster {
        dir,
        nodes: configs,
        ..
    } = write_cluster(&args)?;

    // Both listeners exist before the first node starts: a signal that arrives between two
    // polls of the supervisor is kept by the listener, never lost (a `ctrl_c()` future made
    // after the signal would miss it).
    let mut signals = StopSignals {
        interrupt: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
            .context("cannot listen for SIGINT")?,
        terminate: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("cannot listen for SIGTERM")?,
    };
    let targets: Vec<ScrapeTarget> = configs
        .iter()
        .map(|(c, _)| ScrapeTarget {
            node_id: c.node_id,
            admin_addr: c.self_member().admin_addr(),
        })
        .collect();
    let mut nodes = Vec::with_capacity(configs.len());
    let mut prometheus_child = None;
    let result = async {
        for (config, config_path) in configs {
            nodes.push(start_node(&broker_bin, config, config_path)?);
        }
        if !args.no_prometheus {
            prometheus_child = start_prometheus(&dir, &targets, &args.prometheus_listen);
        }
        supervise(&mut nodes, &mut signals).await
    }
    .await;
    stop_all(&mut nodes).await;
    if let Some(mut child) = prometheus_child {
        stop_prometheus(&mut child).await;
    }
    if result.is_ok() {
        outln!("cluster stopped");
    }
    result
}

/// Writes a development CA, node certificates and fresh tokens into `<dir>/security/` and
/// enables TLS, client tokens and the admin token in every configuration (see the module doc).
///
/// Errors: a file that cannot be written, or a certificate that cannot be generated.
pub fn secure_local_cluster(configs: &mut [BrokerConfig], dir: &Path) -> anyhow::Result<()> {
    use crate::credentials::{ADMIN_TOKEN_FILE, CLIENT_TOKEN_FILE, SECURITY_DIR};
    use bmq_config::{Permission, TokenConfig};
    let security = dir.join(SECURITY_DIR);
    let members: Vec<(u32, String)> = configs
        .first()
        .map(|c| c.members.iter().map(|m| (m.id, m.host.clone())).collect())
        .unwrap_or_default();
    let files = crate::dev_ca::generate_dev_ca(&security, &members)
        .context("cannot generate the development CA and certificates")?;
    let client_token = random_token();
    let admin_token = random_token();
    // Held by nobody: it only carries the permissions of the bmqp listener's clients.
    let sdk_token = random_token();
    crate::dev_ca::write_file(
        &security.join(CLIENT_TOKEN_FILE),
        format!("{client_token}\n").as_bytes(),
        true,
    )?;
    crate::dev_ca::write_file(
        &security.join(ADMIN_TOKEN_FILE),
        format!("{admin_token}\n").as_bytes(),
        true,
    )?;
    for config in configs.iter_mut() {
        let tls = files
            .nodes
            .iter()
            .find(|(id, _)| *id == config.node_id)
            .map(|(_, t)| t.clone())
            .context("no certificate generated for a node")?;
        config.tls = Some(tls);
        config.admin.token = Some(admin_token.clone());
        config.auth.tokens = vec![
            TokenConfig {
                name: "local".into(),
                secret: client_token.clone(),
                domains: vec!["*".into()],
                permissions: vec![Permission::Produce, Permission::Consume, Permission::Admin],
            },
            // What applications on BlazingMQ's SDKs may do on the bmqp port (their protocol
            // carries no token): produce and consume on this local cluster.
            TokenConfig {
                name: "bmqp-sdk".into(),
                secret: sdk_token.clone(),
                domains: vec!["*".into()],
                permissions: vec![Permission::Produce, Permission::Consume],
            },
        ];
        config.auth.bmqp_identity = Some("bmqp-sdk".into());
        // The bmqp port speaks TLS to SDKs that can; the Python SDK 1.2 and the Java SDK
        // cannot, and this development cluster admits them in plain bmqp on loopback.
        config.bmqp.allow_plaintext = true;
    }
    Ok(())
}

/// 32 random bytes from the operating system's CSPRNG-seeded generator, hex: a 64-character
/// token.
fn random_token() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Fails if a port of the new cluster is already taken, typically by a cluster started earlier.
///
/// Without this check, `wait_for_leader` could be answered by the other cluster's nodes before
/// the new ones fail to bind.
fn check_ports_free(configs: &[BrokerConfig]) -> anyhow::Result<()> {
    let Some(first) = configs.first() else {
        return Ok(());
    };
    for m in &first.members {
        for (what, addr) in [
            ("client", m.client_addr()),
            ("peer", m.peer_addr()),
            ("admin", m.admin_addr()),
        ] {
            // std sets SO_REUSEADDR on Unix, as the broker's listeners do, so a port held only by
            // connections in TIME_WAIT counts as free.
            if let Err(e) = std::net::TcpListener::bind(&addr) {
                bail!(
                    "node {} {what} port {addr} is not available ({e}); is another cluster \
                     running? (check with `bmqctl status --admin {}`, or pick other ports \
                     with --base-port)",
                    m.id,
                    m.admin_addr()
                );
            }
        }
    }
    Ok(())
}

/// Starts Prometheus with the shipped configuration for `targets`, or says why not and returns
/// `None` (no `prometheus` on `PATH`, its address taken, files not writable, spawn failure):
/// the cluster is useful without it.
fn start_prometheus(dir: &Path, targets: &[ScrapeTarget], listen: &str) -> Option<Child> {
    let Some(binary) = prometheus::find_on_path("prometheus") else {
        outln!(
            "note: no `prometheus` on PATH, so metrics are only at each node's /metrics \
             (Debian: apt-get install prometheus; see dashboards/README.md)"
        );
        return None;
    };
    if let Err(e) = std::net::TcpListener::bind(listen) {
        outln!(
            "note: not starting Prometheus: {listen} is not available ({e}); \
             pick another address with --prometheus-listen"
        );
        return None;
    }
    let prom_dir = dir.join("prometheus");
    let config = match prometheus::write_config(&prom_dir, targets) {
        Ok(config) => config,
        Err(e) => {
            outln!("note: not starting Prometheus: {e:#}");
            return None;
        }
    };
    // The console pages need the console libraries of the installation; without them
    // Prometheus runs without the pages.
    let consoles_dir = prom_dir.join("consoles");
    let consoles = match (
        prometheus::find_console_libraries(&binary),
        prometheus::write_consoles(&consoles_dir),
    ) {
        (Some(libraries), Ok(())) => Some(prometheus::console_args(&consoles_dir, &libraries)),
        (None, _) => {
            outln!(
                "note: no Prometheus console libraries (prom.lib) found, so no dashboard pages \
                 at /consoles/ (Debian's prometheus package has them in \
                 /usr/share/doc/prometheus/examples/console_libraries; see dashboards/README.md)"
            );
            None
        }
        (_, Err(e)) => {
            outln!("note: no dashboard pages at /consoles/: {e:#}");
            None
        }
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(prom_dir.join("prometheus.log"));
    let (out, err) = match log.and_then(|l| Ok((l.try_clone()?, l))) {
        Ok(pair) => pair,
        Err(e) => {
            outln!("note: not starting Prometheus: cannot open its log: {e}");
            return None;
        }
    };
    let mut command = Command::new(&binary);
    command
        .args(prometheus::server_args(
            &config,
            &prom_dir.join("data"),
            listen,
        ))
        .args(consoles.iter().flatten())
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .kill_on_drop(true);
    #[cfg(target_os = "linux")]
    // SAFETY: as in `start_node`: only prctl and getppid run between fork and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() == 1 {
                return Err(std::io::Error::other("bmqctl exited"));
            }
            Ok(())
        });
    }
    match command.spawn() {
        Ok(child) => {
            outln!(
                "prometheus: http://{listen} (alerts: http://{listen}/alerts), config {}, \
                 log {}",
                config.display(),
                prom_dir.join("prometheus.log").display()
            );
            if consoles.is_some() {
                outln!("dashboards: http://{listen}/consoles/bmq-cluster.html (also bmq-queues, bmq-storage, bmq-node)");
            }
            Some(child)
        }
        Err(e) => {
            outln!("note: cannot start {}: {e}", binary.display());
            None
        }
    }
}

/// Stops the Prometheus started by [`start_prometheus`]: SIGTERM, then SIGKILL after
/// [`STOP_GRACE_PERIOD`].
async fn stop_prometheus(child: &mut Child) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) with the pid of a child we have not reaped yet.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
    match tokio::time::timeout(STOP_GRACE_PERIOD, child.wait()).await {
        Ok(_) => outln!("prometheus stopped"),
        Err(_) => {
            eprintln!(
                "prometheus did not stop within {} s; killing it",
                STOP_GRACE_PERIOD.as_secs()
            );
            let _ = child.kill().await;
        }
    }
}

/// Starts a node's process on its configuration, written at `config_path` by
/// [`write_node_config`].
fn start_node(
    broker_bin: &Path,
    config: BrokerConfig,
    config_path: PathBuf,
) -> anyhow::Result<Node> {
    let id = config.node_id;
    let node_dir = config.data_dir.clone();
    let log_path = config
        .log
        .file
        .clone()
        .unwrap_or_else(|| node_dir.join("broker.log"));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("cannot open {}", log_path.display()))?;
    let log_err = log
        .try_clone()
        .with_context(|| format!("cannot open {}", log_path.display()))?;

    let mut command = Command::new(broker_bin);
    command
        .arg("--config")
        .arg(&config_path)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        // Own process group: the terminal's Ctrl-C reaches bmqctl only, which then stops the
        // nodes in order instead of all of them dying at once.
        .process_group(0)
        .kill_on_drop(true);
    #[cfg(target_os = "linux")]
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl and
    // getppid, which are async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            // If bmqctl dies without stopping the nodes (SIGKILL), they get SIGTERM instead of
            // lingering and holding the ports.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() == 1 {
                // The parent already died between fork and prctl.
                return Err(std::io::Error::other("bmqctl exited"));
            }
            Ok(())
        });
    }
    let child = command.spawn().with_context(|| {
        format!(
            "cannot start node {id}: {} --config {}",
            broker_bin.display(),
            config_path.display()
        )
    })?;
    Ok(Node {
        id,
        config,
        config_path,
        log_path,
        child,
        exit: None,
    })
}

/// The signals that stop `cluster up`: SIGINT (Ctrl-C) and SIGTERM.
struct StopSignals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

/// Waits for the leader, prints the summary, then watches the nodes until Ctrl-C or SIGTERM.
async fn supervise(nodes: &mut [Node], signals: &mut StopSignals) -> anyhow::Result<()> {
    let admins: Vec<String> = nodes
        .iter()
        .map(|n| n.config.self_member().admin_addr())
        .collect();
    outln!(
        "started {} nodes in {}; waiting for a leader...",
        nodes.len(),
        nodes[0]
            .config
            .data_dir
            .parent()
            .unwrap_or(Path::new("."))
            .display()
    );

    // Start-up: any node exit is fatal, with its log shown.
    let leader = {
        let wait = wait_for_leader(&admins, LEADER_WAIT_TIMEOUT);
        tokio::pin!(wait);
        tokio::select! {
            r = &mut wait => r,
            (i, status) = wait_any(nodes) => {
                let node = &nodes[i];
                bail!(
                    "node {} exited during start-up ({}); last lines of {}:\n{}",
                    node.id,
                    describe_exit(status),
                    node.log_path.display(),
                    log_tail(&node.log_path)
                );
            }
            _ = signals.interrupt.recv() => {
                outln!("interrupted; stopping the cluster");
                return Ok(());
            }
            _ = signals.terminate.recv() => {
                outln!("terminated; stopping the cluster");
                return Ok(());
            }
        }
    };
    let (leader, term) = match leader {
        Ok(found) => found,
        Err(e) => {
            let logs: Vec<String> = nodes
                .iter()
                .map(|n| n.log_path.display().to_string())
                .collect();
            return Err(e.context(format!(
                "the cluster did not elect a leader; see the logs: {}",
                logs.join(", ")
            )));
        }
    };
    print_summary(nodes, leader, term);

    loop {
        tokio::select! {
            (i, status) = wait_any(nodes) => {
                let node = &nodes[i];
                eprintln!(
                    "node {} exited unexpectedly ({}); the other nodes keep running. \
                     Last lines of {}:\n{}",
                    node.id,
                    describe_exit(status),
                    node.log_path.display(),
                    log_tail(&node.log_path)
                );
                if nodes.iter().all(|n| n.exit.is_some()) {
                    bail!("every node has exited");
                }
            }
            _ = signals.interrupt.recv() => {
                outln!("interrupted; stopping the cluster");
                return Ok(());
            }
            _ = signals.terminate.recv() => {
                outln!("terminated; stopping the cluster");
                return Ok(());
            }
        }
    }
}

/// Waits until a running node exits, records its status and returns its index and status.
/// Never completes when no node is running.
async fn wait_any(nodes: &mut [Node]) -> (usize, ExitStatus) {
    let waits: Vec<_> = nodes
        .iter_mut()
        .enumerate()
        .filter(|(_, n)| n.exit.is_none())
        .map(|(i, n)| n.child.wait().map(move |r| (i, r)).boxed())
        .collect();
    if waits.is_empty() {
        return std::future::pending().await;
    }
    let ((i, result), _, _) = futures::future::select_all(waits).await;
    // `wait` only fails if the child was already reaped, which `exit` tracking rules out; treat
    // such a failure as an unknown exit rather than spinning on it.
    let status = match result {
        Ok(status) => status,
        Err(_) => std::os::unix::process::ExitStatusExt::from_raw(-1),
    };
    nodes[i].exit = Some(status);
    (i, status)
}

fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}

/// Stops every running node: SIGTERM to all, up to [`STOP_GRACE_PERIOD`] for them to exit, then
/// SIGKILL for the rest.
async fn stop_all(nodes: &mut [Node]) {
    for node in nodes.iter_mut() {
        if node.exit.is_some() {
            continue;
        }
        // `id()` is `None` once the child has been reaped, so the pid cannot have been reused.
        if let Some(pid) = node.child.id() {
            // SAFETY: kill(2) with a pid we own and a valid signal number.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
    }
    let stops = nodes
        .iter_mut()
        .filter(|n| n.exit.is_none())
        .map(|node| async move {
            match tokio::time::timeout(STOP_GRACE_PERIOD, node.child.wait()).await {
                Ok(Ok(status)) => {
                    node.exit = Some(status);
                    outln!("node {} stopped ({})", node.id, describe_exit(status));
                }
                Ok(Err(e)) => eprintln!("node {}: cannot wait for exit: {e}", node.id),
                Err(_) => {
                    eprintln!(
                        "node {} did not stop within {} s; killing it",
                        node.id,
                        STOP_GRACE_PERIOD.as_secs()
                    );
                    if let Err(e) = node.child.kill().await {
                        eprintln!("node {}: cannot kill: {e}", node.id);
                    }
                    node.exit = node.child.try_wait().ok().flatten();
                }
            }
        });
    futures::future::join_all(stops).await;
}

fn print_summary(nodes: &[Node], leader: u32, term: u64) {
    outln!("\ncluster is up: leader is node {leader}, term {term}\n");
    let rows: Vec<[String; 4]> = nodes
        .iter()
        .map(|n| {
            let m = n.config.self_member();
            [
                n.id.to_string(),
                m.client_addr(),
                m.admin_addr(),
                n.log_path.display().to_string(),
            ]
        })
        .collect();
    let headers = ["NODE", "CLIENT", "ADMIN", "LOG"];
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let print_row = |cells: &[&str]| {
        let line: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        outln!("  {}", line.join("  ").trim_end());
    };
    print_row(&headers);
    for row in &rows {
        print_row(&row.iter().map(String::as_str).collect::<Vec<_>>());
    }
    if let Some(dir) = nodes.first().and_then(|n| n.config_path.parent()?.parent()) {
        outln!(
            "\nconfigurations: {}",
            dir.join("node-<i>").join("broker.toml").display()
        );
    }
    let admins: Vec<String> = nodes
        .iter()
        .map(|n| n.config.self_member().admin_addr())
        .collect();
    let clients: Vec<String> = nodes
        .iter()
        .map(|n| n.config.self_member().client_addr())
        .collect();
    // The tools default to the default cluster's addresses; otherwise name them.
    let broker_flag = if clients.join(",") == crate::connect::DEFAULT_BROKERS {
        String::new()
    } else {
        format!(" --broker {}", clients.join(","))
    };
    let admin_flag = if admins.join(",") == crate::status::DEFAULT_ADMINS {
        String::new()
    } else {
        format!(" --admin {}", admins.join(","))
    };
    outln!("\ntry:");
    outln!("  bmqctl produce --queue bmq://bmq.test/orders --count 10000 --size 1024{broker_flag}");
    outln!("  bmqctl consume --queue bmq://bmq.test/orders --count 10000{broker_flag}");
    outln!("  bmqctl status{admin_flag}");
    if let (Some(tls), Some(dir)) = (
        nodes.first().and_then(|n| n.config.tls.as_ref()),
        nodes.first().and_then(|n| n.config_path.parent()?.parent()),
    ) {
        let security = dir.join(crate::credentials::SECURITY_DIR);
        outln!(
            "\nsecurity: TLS on every link (development CA {}),",
            tls.ca_file.display()
        );
        outln!(
            "  client token in {} (produce, consume, admin on every domain),",
            security
                .join(crate::credentials::CLIENT_TOKEN_FILE)
                .display()
        );
        outln!(
            "  admin token in {}.",
            security
                .join(crate::credentials::ADMIN_TOKEN_FILE)
                .display()
        );
        let default_dir = std::env::current_dir()
            .map(|d| d.join(".cluster"))
            .is_ok_and(|d| d == dir);
        if default_dir {
            outln!(
                "  bmqctl produce, consume and admin run from this directory use them by default."
            );
        } else {
            outln!(
                "  for bmqctl produce, consume and admin: export BMQ_CLUSTER_DIR={}",
                dir.display()
            );
        }
    }
    outln!("\nCtrl-C stops the cluster.");
}

/// The last [`LOG_TAIL_LINES`] lines of a log file, indented, or a note why there are none.
fn log_tail(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let read = || -> std::io::Result<String> {
        let mut file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        let start = len.saturating_sub(LOG_TAIL_BYTES);
        file.seek(SeekFrom::Start(start))?;
        let mut bytes = Vec::new();
        file.take(LOG_TAIL_BYTES).read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            if lines.is_empty() {
                return "  (the log is empty)".to_string();
            }
            lines[lines.len().saturating_sub(LOG_TAIL_LINES)..]
                .iter()
                .map(|l| format!("  {l}"))
                .collect::<Vec<_>>()
                .join("\n")
        }
        Err(e) => format!("  (cannot read the log: {e})"),
    }
}

pub(crate) fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    if path.is_absolute() {
        Ok(path.to_path_buf())
    } else {
        Ok(std::env::current_dir()
            .context("cannot read the current directory")?
            .join(path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn log_tail_keeps_the_last_lines() {
        // Only the last lines of a long log are shown, and a missing log says so.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broker.log");
        let text: String = (1..=100).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&path, text).unwrap();
        let tail = log_tail(&path);
        let lines: Vec<&str> = tail.lines().collect();
        assert_eq!(lines.len(), LOG_TAIL_LINES);
        assert_eq!(lines[0], "  line 81");
        assert_eq!(lines[LOG_TAIL_LINES - 1], "  line 100");
        assert!(log_tail(&dir.path().join("none.log")).contains("cannot read the log"));
        std::fs::write(&path, "").unwrap();
        assert_eq!(log_tail(&path), "  (the log is empty)");
    }

    #[test]
    fn defaults_match_the_local_cluster() {
        // Without flags: 3 nodes in .cluster from port 30100.
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: ClusterUpArgs,
        }
        let cli = Cli::try_parse_from(["t"]).unwrap();
        assert_eq!(cli.args.nodes, 3);
        assert_eq!(cli.args.dir, PathBuf::from(".cluster"));
        assert_eq!(cli.args.base_port, 30100);
        assert_eq!(cli.args.broker_bin, None);
        assert!(!cli.args.clean);
        assert!(!cli.args.no_prometheus);
        assert_eq!(cli.args.prometheus_listen, DEFAULT_PROMETHEUS_LISTEN);
        assert!(!cli.args.configs_only);
        let cli = Cli::try_parse_from(["t", "--configs-only", "--no-security"]).unwrap();
        assert!(cli.args.configs_only);
        assert!(cli.args.no_security);
    }

    /// A "broker" that leaves a marker file when it is started, so a test can tell that no
    /// broker was run.
    fn marker_broker(dir: &Path) -> (PathBuf, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let marker = dir.join("broker-was-started");
        let fake = dir.join("fake-broker");
        std::fs::write(
            &fake,
            format!("#!/bin/sh\ntouch '{}'\nexit 0\n", marker.display()),
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        (fake, marker)
    }

    #[tokio::test]
    async fn configs_only_writes_the_secured_configs_and_starts_nothing() {
        // `--configs-only` with security writes every node's configuration, the development CA
        // and the tokens, removes what --clean removes, and returns without running a broker.
        let dir = tempfile::tempdir().unwrap();
        let (fake, marker) = marker_broker(dir.path());
        let cluster_dir = dir.path().join("c");
        std::fs::create_dir_all(&cluster_dir).unwrap();
        std::fs::write(cluster_dir.join("stale"), "x").unwrap();
        let args = ClusterUpArgs {
            nodes: 3,
            dir: cluster_dir.clone(),
            // Nothing binds, so the default ports may be taken by a running cluster.
            base_port: LOCAL_CLUSTER_BASE_PORT,
            broker_bin: Some(fake),
            clean: true,
            no_prometheus: false,
            prometheus_listen: DEFAULT_PROMETHEUS_LISTEN.into(),
            no_security: false,
            configs_only: true,
        };
        run(args).await.unwrap();
        assert!(!marker.exists(), "a broker was started");
        assert!(!cluster_dir.join("stale").exists());
        assert!(!cluster_dir.join("prometheus").exists());
        let security = cluster_dir.join(crate::credentials::SECURITY_DIR);
        let client_token =
            std::fs::read_to_string(security.join(crate::credentials::CLIENT_TOKEN_FILE)).unwrap();
        let admin_token =
            std::fs::read_to_string(security.join(crate::credentials::ADMIN_TOKEN_FILE)).unwrap();
        assert!(security.join(crate::credentials::CA_FILE).is_file());
        for id in 1..=3u32 {
            let node_dir = cluster_dir.join(format!("node-{id}"));
            let loaded = BrokerConfig::load(node_dir.join("broker.toml")).unwrap();
            assert_eq!(loaded.node_id, id);
            assert_eq!(
                loaded.self_member().admin_port,
                LOCAL_CLUSTER_BASE_PORT + 200 + id as u16
            );
            assert!(loaded.tls.is_some(), "node {id} has no TLS");
            assert_eq!(loaded.admin.token.as_deref(), Some(admin_token.trim()));
            assert!(loaded
                .auth
                .tokens
                .iter()
                .any(|t| t.secret == client_token.trim()));
            assert!(!node_dir.join("broker.log").exists());
        }
    }

    #[tokio::test]
    async fn configs_only_without_security_needs_no_broker_binary() {
        // `--configs-only --no-security` writes plain configurations and no security directory,
        // and does not look for a broker binary it would not run.
        let dir = tempfile::tempdir().unwrap();
        let cluster_dir = dir.path().join("c");
        let args = ClusterUpArgs {
            nodes: 2,
            dir: cluster_dir.clone(),
            base_port: 30100,
            broker_bin: Some(dir.path().join("no-such-broker")),
            clean: false,
            no_prometheus: true,
            prometheus_listen: DEFAULT_PROMETHEUS_LISTEN.into(),
            no_security: true,
            configs_only: true,
        };
        run(args).await.unwrap();
        assert!(!cluster_dir.join(crate::credentials::SECURITY_DIR).exists());
        let entries: Vec<String> = std::fs::read_dir(&cluster_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(entries.len(), 2, "{entries:?}");
        for id in 1..=2u32 {
            let loaded =
                BrokerConfig::load(cluster_dir.join(format!("node-{id}/broker.toml"))).unwrap();
            assert_eq!(loaded.node_id, id);
            assert!(loaded.tls.is_none());
            assert!(loaded.auth.tokens.is_empty());
        }
    }

    #[tokio::test]
    async fn missing_broker_binary_is_a_clear_error() {
        // A missing broker binary says how to build it.
        let dir = tempfile::tempdir().unwrap();
        let args = ClusterUpArgs {
            nodes: 1,
            dir: dir.path().join("c"),
            base_port: 30100,
            broker_bin: Some(dir.path().join("no-such-broker")),
            clean: false,
            no_prometheus: true,
            prometheus_listen: DEFAULT_PROMETHEUS_LISTEN.into(),
            no_security: false,
            configs_only: false,
        };
        let e = run(args).await.unwrap_err().to_string();
        assert!(e.contains("cargo build --release --bins"), "{e}");
        assert!(!dir.path().join("c").exists());
    }

    #[tokio::test]
    async fn early_exit_shows_the_node_log() {
        // A "broker" that prints an error and exits during start-up aborts the launch with its
        // log lines and exit code.
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("fake-broker");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho \"error: cannot bind 127.0.0.1:30101: Address already in use\" >&2\nexit 3\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        // A base whose node ports are free right now, so parallel runs do not collide.
        let base_port = (0..200)
            .map(|_| 20_000 + rand::random::<u16>() % 9_000)
            .find(|base| {
                (1..=2u16).all(|i| {
                    [base + i, base + 100 + i, base + 200 + i]
                        .iter()
                        .all(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
                })
            })
            .expect("a free port range");
        let args = ClusterUpArgs {
            nodes: 2,
            dir: dir.path().join("c"),
            base_port,
            broker_bin: Some(fake),
            clean: true,
            no_prometheus: true,
            prometheus_listen: DEFAULT_PROMETHEUS_LISTEN.into(),
            no_security: false,
            configs_only: false,
        };
        let e = format!("{:#}", run(args).await.unwrap_err());
        assert!(e.contains("exited during start-up (exit code 3)"), "{e}");
        assert!(e.contains("Address already in use"), "{e}");
        let config = dir.path().join("c/node-2/broker.toml");
        let loaded = BrokerConfig::load(&config).unwrap();
        assert_eq!(loaded.node_id, 2);
        assert_eq!(loaded.self_member().admin_port, base_port + 202);
    }
}
