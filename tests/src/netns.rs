//! Real network faults for the chaos suite (DESIGN.md §10.5): every broker in its own Linux
//! network namespace with its own address, faults injected by the kernel.
//!
//! Topology of one [`Network`] (`<id>` = `<pid>-<seq>`, unique per test run and per cluster):
//!
//! ```text
//!  root namespace (the test process)                hub namespace bmqchaos-<id>-hub
//!  bqc<pid>x<seq>  10.77.K.1/24  <--veth-->  uplink -+
//!                                                   br0 (bridge) --- v1 <--veth--> eth0 10.77.K.11  bmqchaos-<id>-n1
//!                                                                --- v2 <--veth--> eth0 10.77.K.12  bmqchaos-<id>-n2
//!                                                                --- ...
//! ```
//!
//! The bridge lives in a namespace of its own rather than in the root namespace: a host that
//! runs Docker has `bridge-nf-call-iptables = 1` and a `FORWARD DROP` policy in the root
//! namespace, which silently drops traffic bridged between two nodes there. In a fresh
//! namespace the filter tables are empty, so the harness never edits the host's firewall. The
//! test process reaches every node through the root-side veth (the observer address
//! `10.77.K.1`, K picked free under a file lock so parallel runs never share a subnet).
//!
//! Faults, all made with the kernel:
//! - **cuts** ([`Network::cut`], [`Network::partition`], [`Network::isolate`]): `iptables DROP`
//!   rules inside both nodes' namespaces for the peer's address, both directions. Only
//!   node-to-node traffic is cut: the observer keeps reaching every node, so `/status` polling
//!   and the clients of the test keep working (a client attached to a cut-off node sees what a
//!   client of a partitioned broker would see: its broker stays up, its traffic stalls);
//! - **loss** ([`Network::set_loss`]): `tc netem loss` on the node's `eth0` when the kernel has
//!   `sch_netem`, else `iptables -m statistic --mode random` drops (same effect on packets);
//! - **delay** ([`Network::set_delay`]): `tc netem delay`; an error naming the missing kernel
//!   module when the kernel has no `sch_netem` (there is no kernel-only substitute);
//! - process faults (SIGKILL, SIGSTOP/SIGCONT, restarts) go through [`crate::Cluster`], whose
//!   nodes [`NetCluster`] starts with `ip netns exec <namespace> broker ...` (which execs in
//!   place: the child's pid is the broker's).
//!
//! Clean-up: [`Network`]'s `Drop` deletes every namespace it made (which destroys the veths and
//! the bridge with them) and the root-side link; [`NetCluster`] drops its processes first. Each
//! new network also sweeps leftovers of dead processes (names carry the creating pid), killing
//! any broker still running in such a namespace. A test that cannot create namespaces (not
//! root, no kernel support) fails with the reason when `CI` is set and is skipped with the
//! reason otherwise ([`chaos_enabled`]).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bmq_config::BrokerConfig;
use bmq_proto::admin_doc::NodeStatusDoc;
use bmqctl::status::fetch_status;

use crate::Cluster;

/// Prefix of every namespace this harness creates: `bmqchaos-<pid>-<seq>-{hub,n<i>}`.
pub const NAMESPACE_PREFIX: &str = "bmqchaos-";
/// Prefix of the root-side veth: `bqc<pid>x<seq>` (interface names are at most 15 bytes).
pub const LINK_PREFIX: &str = "bqc";
/// First two octets of every subnet; the third is picked free per network.
pub const SUBNET_PREFIX: [u8; 2] = [10, 77];
/// Client port of every node (each node has its own address, so the ports can be fixed).
pub const CLIENT_PORT: u16 = 7101;
/// Peer port of every node.
pub const PEER_PORT: u16 = 7201;
/// Admin HTTP port of every node.
pub const ADMIN_PORT: u16 = 7301;
/// Lock file serialising subnet selection between processes and threads.
const SUBNET_LOCK_PATH: &str = "/tmp/bmq-chaos-subnet.lock";
/// Timeout of one `/status` request while polling.
pub const STATUS_TIMEOUT: Duration = Duration::from_millis(500);

static NETWORK_SEQ: AtomicU32 = AtomicU32::new(0);

/// Runs `program args..`, returning its stdout; an error carries the command and its stderr.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {program}"))?;
    if !output.status.success() {
        bail!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs a command inside namespace `ns` (`ip netns exec ns program args..`).
fn run_in(ns: &str, program: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["netns", "exec", ns, program];
    all.extend_from_slice(args);
    run("ip", &all)
}

/// Finds `program` on `PATH` or in the sbin directories (root's tools live there).
fn find_program(program: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|dir| PathBuf::from(dir).join(program))
        .find(|p| p.is_file());
    found
}

/// Installs iproute2 and iptables with apt-get when `ip`, `tc` or `iptables` is missing.
fn ensure_tools() -> Result<(), String> {
    let missing = |tools: &[(&str, &str)]| -> Vec<String> {
        tools
            .iter()
            .filter(|(bin, _)| find_program(bin).is_none())
            .map(|(_, pkg)| pkg.to_string())
            .collect()
    };
    let tools = [
        ("ip", "iproute2"),
        ("tc", "iproute2"),
        ("iptables", "iptables"),
    ];
    let mut packages = missing(&tools);
    if packages.is_empty() {
        return Ok(());
    }
    packages.dedup();
    if find_program("apt-get").is_none() {
        return Err(format!(
            "missing packages {packages:?} and no apt-get to install them"
        ));
    }
    eprintln!("chaos harness: installing {packages:?} with apt-get");
    let quiet = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map_err(|e| format!("cannot run apt-get: {e}"))
    };
    quiet(&["update", "-qq"])?;
    let mut install = vec!["install", "-y", "-qq", "--no-install-recommends"];
    install.extend(packages.iter().map(String::as_str));
    let status = quiet(&install)?;
    let still = missing(&tools);
    if !status.success() || !still.is_empty() {
        return Err(format!("apt-get could not install {still:?} ({status})"));
    }
    Ok(())
}

/// Whether this machine can run the chaos suite: root, the tools (installed when missing), and
/// a network namespace that can actually be created. `Err` holds the reason. Checked once per
/// process.
pub fn availability() -> Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            // SAFETY: geteuid has no preconditions.
            let uid = unsafe { libc::geteuid() };
            if uid != 0 {
                return Err(format!(
                    "network namespaces and iptables need root; running as uid {uid}"
                ));
            }
            ensure_tools()?;
            let probe = format!("{NAMESPACE_PREFIX}{}-probe", std::process::id());
            run("ip", &["netns", "add", &probe])
                .map_err(|e| format!("cannot create a network namespace: {e:#}"))?;
            run("ip", &["netns", "del", &probe])
                .map_err(|e| format!("cannot delete network namespace {probe}: {e:#}"))?;
            Ok(())
        })
        .clone()
}

/// Gate for a chaos test: `true` when it can run. Otherwise, with `CI` set (`true` or `1`) it
/// panics with the reason — CI runs as root and must not silently skip — and elsewhere it
/// prints why the test is skipped and returns `false`.
pub fn chaos_enabled(test: &str) -> bool {
    match availability() {
        Ok(()) => true,
        Err(reason) => {
            let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
            if ci {
                panic!("chaos test {test} cannot run on CI: {reason}");
            }
            eprintln!("SKIPPED chaos test {test}: {reason} (set up root + netns to run it)");
            false
        }
    }
}

/// Whether the kernel has the `netem` queueing discipline (checked once, in a scratch
/// namespace).
pub fn netem_available() -> bool {
    static RESULT: OnceLock<bool> = OnceLock::new();
    *RESULT.get_or_init(|| {
        let ns = format!("{NAMESPACE_PREFIX}{}-netem", std::process::id());
        if run("ip", &["netns", "add", &ns]).is_err() {
            return false;
        }
        let ok = run_in(&ns, "ip", &["link", "set", "lo", "up"]).is_ok()
            && run_in(
                &ns,
                "tc",
                &["qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            )
            .is_ok();
        let _ = run("ip", &["netns", "del", &ns]);
        ok
    })
}

/// The pid encoded in a harness name after `prefix` (digits up to the first non-digit).
fn pid_in_name(name: &str, prefix: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?;
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes namespaces and root links left by harness runs whose process is gone, killing any
/// broker still running inside such a namespace. Runs once per process.
pub fn sweep_leftovers() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        if let Ok(list) = run("ip", &["netns", "list"]) {
            for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
                let Some(pid) = pid_in_name(name, NAMESPACE_PREFIX) else {
                    continue;
                };
                if pid_alive(pid) {
                    continue;
                }
                if let Ok(pids) = run("ip", &["netns", "pids", name]) {
                    for p in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                        // SAFETY: kill(2); the process runs in a namespace this harness made.
                        unsafe { libc::kill(p, libc::SIGKILL) };
                    }
                }
                eprintln!("chaos harness: removing leftover namespace {name}");
                let _ = run("ip", &["netns", "del", name]);
            }
        }
        if let Ok(links) = run("ip", &["-o", "link", "show"]) {
            for line in links.lines() {
                // "12: bqc123x0@if11: <...>"
                let Some(name) = line.split(": ").nth(1) else {
                    continue;
                };
                let name = name.split('@').next().unwrap_or(name);
                if let Some(pid) = pid_in_name(name, LINK_PREFIX) {
                    if !pid_alive(pid) {
                        eprintln!("chaos harness: removing leftover link {name}");
                        let _ = run("ip", &["link", "del", name]);
                    }
                }
            }
        }
    });
}

/// A held `flock(2)` on [`SUBNET_LOCK_PATH`], released when dropped.
struct SubnetLock(std::fs::File);

impl SubnetLock {
    fn acquire() -> anyhow::Result<SubnetLock> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(SUBNET_LOCK_PATH)
            .with_context(|| format!("open {SUBNET_LOCK_PATH}"))?;
        // SAFETY: flock on a descriptor we own; blocks until the lock is ours.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        anyhow::ensure!(rc == 0, "flock {SUBNET_LOCK_PATH} failed");
        Ok(SubnetLock(file))
    }
}

impl Drop for SubnetLock {
    fn drop(&mut self) {
        // SAFETY: unlocking the descriptor we locked.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// The packet-level faults applied to one node, so [`Network::heal`] can undo them.
#[derive(Debug, Default, Clone)]
struct NodeFaults {
    qdisc: bool,
    loss_rules: bool,
}

/// A private network of `n` nodes, each in its own namespace (see the module doc). Dropping it
/// deletes every namespace and link it made.
pub struct Network {
    id: String,
    hub: String,
    root_link: String,
    third_octet: u8,
    nodes: Vec<String>,
    cuts: BTreeSet<(u32, u32)>,
    faults: Vec<NodeFaults>,
    created: Vec<String>,
}

impl Network {
    /// Creates the hub, the bridge and `n` node namespaces with their addresses.
    ///
    /// Errors: any `ip` command failing (with its stderr), or no free `10.77.K.0/24` subnet.
    /// Whatever was created before an error is removed again.
    pub fn create(n: usize) -> anyhow::Result<Network> {
        sweep_leftovers();
        let pid = std::process::id();
        let seq = NETWORK_SEQ.fetch_add(1, Ordering::Relaxed);
        let id = format!("{pid}-{seq}");
        let mut net = Network {
            hub: format!("{NAMESPACE_PREFIX}{id}-hub"),
            root_link: format!("{LINK_PREFIX}{pid}x{seq}"),
            nodes: (1..=n)
                .map(|i| format!("{NAMESPACE_PREFIX}{id}-n{i}"))
                .collect(),
            id,
            third_octet: 0,
            cuts: BTreeSet::new(),
            faults: vec![NodeFaults::default(); n],
            created: Vec::new(),
        };
        // On error `net` is dropped here, removing what was made.
        net.build()?;
        Ok(net)
    }

    fn build(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.root_link.len() <= 15, "link name too long");
        let hub = self.hub.clone();
        run("ip", &["netns", "add", &hub])?;
        self.created.push(hub.clone());
        run_in(&hub, "ip", &["link", "set", "lo", "up"])?;
        run_in(&hub, "ip", &["link", "add", "br0", "type", "bridge"])?;
        run_in(&hub, "ip", &["link", "set", "br0", "up"])?;
        {
            let _lock = SubnetLock::acquire()?;
            let used = run("ip", &["-4", "-o", "addr", "show"])?;
            let [a, b] = SUBNET_PREFIX;
            self.third_octet = (1..=254u8)
                .find(|k| !used.contains(&format!(" {a}.{b}.{k}.")))
                .context("no free 10.77.K.0/24 subnet")?;
            run(
                "ip",
                &[
                    "link",
                    "add",
                    &self.root_link,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "uplink",
                    "netns",
                    &hub,
                ],
            )?;
            run(
                "ip",
                &[
                    "addr",
                    "add",
                    &format!("{}/24", self.observer_ip()),
                    "dev",
                    &self.root_link,
                ],
            )?;
        }
        run("ip", &["link", "set", &self.root_link, "up"])?;
        run_in(
            &hub,
            "ip",
            &["link", "set", "uplink", "master", "br0", "up"],
        )?;
        for i in 0..self.nodes.len() {
            let ns = self.nodes[i].clone();
            let id = i as u32 + 1;
            run("ip", &["netns", "add", &ns])?;
            self.created.push(ns.clone());
            let hub_end = format!("v{id}");
            run_in(
                &hub,
                "ip",
                &[
                    "link", "add", &hub_end, "type", "veth", "peer", "name", "eth0", "netns", &ns,
                ],
            )?;
            run_in(
                &hub,
                "ip",
                &["link", "set", &hub_end, "master", "br0", "up"],
            )?;
            run_in(&ns, "ip", &["link", "set", "lo", "up"])?;
            run_in(
                &ns,
                "ip",
                &[
                    "addr",
                    "add",
                    &format!("{}/24", self.node_ip(id)),
                    "dev",
                    "eth0",
                ],
            )?;
            run_in(&ns, "ip", &["link", "set", "eth0", "up"])?;
        }
        Ok(())
    }

    /// The run-unique id `<pid>-<seq>` in every name of this network.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the network has no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Address of node `id` (1-based): `10.77.K.(10 + id)`.
    pub fn node_ip(&self, id: u32) -> Ipv4Addr {
        let [a, b] = SUBNET_PREFIX;
        Ipv4Addr::new(a, b, self.third_octet, 10 + id as u8)
    }

    /// Address of the test process on this network: `10.77.K.1`.
    pub fn observer_ip(&self) -> Ipv4Addr {
        let [a, b] = SUBNET_PREFIX;
        Ipv4Addr::new(a, b, self.third_octet, 1)
    }

    /// Namespace name of node `id`.
    pub fn namespace(&self, id: u32) -> &str {
        &self.nodes[(id - 1) as usize]
    }

    /// Command words that run a program inside node `id`'s namespace.
    pub fn launch_prefix(&self, id: u32) -> Vec<String> {
        vec![
            "ip".into(),
            "netns".into(),
            "exec".into(),
            self.namespace(id).to_string(),
        ]
    }

    fn drop_rules(&self, on: u32, peer: u32, action: &str) -> anyhow::Result<()> {
        let ns = self.namespace(on);
        let peer_ip = self.node_ip(peer).to_string();
        run_in(
            ns,
            "iptables",
            &["-w", action, "INPUT", "-s", &peer_ip, "-j", "DROP"],
        )?;
        run_in(
            ns,
            "iptables",
            &["-w", action, "OUTPUT", "-d", &peer_ip, "-j", "DROP"],
        )?;
        Ok(())
    }

    /// Cuts every packet between nodes `a` and `b`, both directions (other pairs untouched).
    /// Idempotent.
    pub fn cut(&mut self, a: u32, b: u32) -> anyhow::Result<()> {
        anyhow::ensure!(a != b, "cannot cut node {a} from itself");
        let pair = (a.min(b), a.max(b));
        if self.cuts.insert(pair) {
            self.drop_rules(a, b, "-A")?;
            self.drop_rules(b, a, "-A")?;
        }
        Ok(())
    }

    /// Restores the link between `a` and `b` cut by [`Network::cut`].
    pub fn uncut(&mut self, a: u32, b: u32) -> anyhow::Result<()> {
        let pair = (a.min(b), a.max(b));
        if self.cuts.remove(&pair) {
            self.drop_rules(a, b, "-D")?;
            self.drop_rules(b, a, "-D")?;
        }
        Ok(())
    }

    /// Cuts every pair of nodes that are in different groups; nodes in no group are cut from
    /// every grouped node.
    pub fn partition(&mut self, groups: &[&[u32]]) -> anyhow::Result<()> {
        let group_of = |id: u32| groups.iter().position(|g| g.contains(&id));
        let n = self.nodes.len() as u32;
        for a in 1..=n {
            for b in (a + 1)..=n {
                if group_of(a).is_none() || group_of(a) != group_of(b) {
                    self.cut(a, b)?;
                }
            }
        }
        Ok(())
    }

    /// Cuts node `id` from every other node (the observer still reaches it).
    pub fn isolate(&mut self, id: u32) -> anyhow::Result<()> {
        let n = self.nodes.len() as u32;
        for other in (1..=n).filter(|&o| o != id) {
            self.cut(id, other)?;
        }
        Ok(())
    }

    /// The pairs currently cut, each `(smaller, larger)`.
    pub fn cuts(&self) -> Vec<(u32, u32)> {
        self.cuts.iter().copied().collect()
    }

    /// Drops `percent` % of the packets node `id` sends and receives: `tc netem loss` on egress
    /// when the kernel has netem, else random `iptables` drops on both directions.
    pub fn set_loss(&mut self, id: u32, percent: f64) -> anyhow::Result<()> {
        anyhow::ensure!(
            (0.0..=100.0).contains(&percent),
            "loss {percent}% is not a percentage"
        );
        let ns = self.namespace(id).to_string();
        if netem_available() {
            run_in(
                &ns,
                "tc",
                &[
                    "qdisc",
                    "replace",
                    "dev",
                    "eth0",
                    "root",
                    "netem",
                    "loss",
                    &format!("{percent}%"),
                ],
            )?;
            self.faults[(id - 1) as usize].qdisc = true;
        } else {
            let probability = format!("{:.4}", percent / 100.0);
            for (chain, dir) in [("INPUT", "-i"), ("OUTPUT", "-o")] {
                run_in(
                    &ns,
                    "iptables",
                    &[
                        "-w",
                        "-I",
                        chain,
                        dir,
                        "eth0",
                        "-m",
                        "statistic",
                        "--mode",
                        "random",
                        "--probability",
                        &probability,
                        "-j",
                        "DROP",
                    ],
                )?;
            }
            self.faults[(id - 1) as usize].loss_rules = true;
        }
        Ok(())
    }

    /// Delays every packet node `id` sends by `delay` ± `jitter` (`tc netem delay`).
    ///
    /// Errors: the kernel has no `sch_netem` (no kernel-only substitute exists), or `tc` fails.
    pub fn set_delay(&mut self, id: u32, delay: Duration, jitter: Duration) -> anyhow::Result<()> {
        if !netem_available() {
            bail!("packet delay needs the kernel's sch_netem queueing discipline, which this kernel does not have");
        }
        run_in(
            self.namespace(id),
            "tc",
            &[
                "qdisc",
                "replace",
                "dev",
                "eth0",
                "root",
                "netem",
                "delay",
                &format!("{}ms", delay.as_millis()),
                &format!("{}ms", jitter.as_millis()),
            ],
        )?;
        self.faults[(id - 1) as usize].qdisc = true;
        Ok(())
    }

    /// Silences one TCP connection of node `id`, the one whose local port is `local_port`:
    /// every packet node `id` sends from that port is dropped from now on (the peer gets
    /// nothing more on it, not even the reset of [`Network::abort_connection`], so it keeps
    /// its end open). Other connections of the node are untouched; [`Network::heal`] lifts it.
    pub fn silence_connection(&mut self, id: u32, local_port: u16) -> anyhow::Result<()> {
        let port = local_port.to_string();
        run_in(
            self.namespace(id),
            "iptables",
            &[
                "-w", "-A", "OUTPUT", "-p", "tcp", "--sport", &port, "-j", "DROP",
            ],
        )?;
        Ok(())
    }

    /// Refuses node `id`'s new TCP connections to node `to`'s peer port ([`PEER_PORT`]): their
    /// SYNs are dropped, so a dial waits out its timeout and fails, while the connections
    /// already open (either way) carry on. [`Network::heal`] lifts it.
    pub fn refuse_new_peer_connections(&mut self, id: u32, to: u32) -> anyhow::Result<()> {
        let to_ip = self.node_ip(to).to_string();
        let port = PEER_PORT.to_string();
        run_in(
            self.namespace(id),
            "iptables",
            &[
                "-w", "-A", "OUTPUT", "-p", "tcp", "--syn", "-d", &to_ip, "--dport", &port, "-j",
                "DROP",
            ],
        )?;
        Ok(())
    }

    /// Bytes node `id` has written to its TCP connection from `local_port` that the peer has
    /// not acknowledged (the socket's send queue, from `ss`); an error when no such connection
    /// is open.
    pub fn unacknowledged_bytes(&self, id: u32, local_port: u16) -> anyhow::Result<u64> {
        let filter = format!("sport = :{local_port}");
        let out = run_in(
            self.namespace(id),
            "ss",
            &["-Htn", "state", "established", &filter],
        )?;
        // With a state filter, ss leaves out the State column: Recv-Q Send-Q Local Peer.
        let line = out.lines().next().with_context(|| {
            format!("no established connection from port {local_port} on node {id}")
        })?;
        let send_q = line
            .split_whitespace()
            .nth(1)
            .with_context(|| format!("unexpected ss line {line:?}"))?;
        send_q
            .parse()
            .with_context(|| format!("send queue {send_q:?} in {line:?}"))
    }

    /// Destroys node `id`'s TCP connection from `local_port` in the kernel (`ss -K`, as if the
    /// connection had been lost): the process's next read or write on it fails. Errors when no
    /// such connection was open.
    pub fn abort_connection(&mut self, id: u32, local_port: u16) -> anyhow::Result<()> {
        let filter = format!("sport = :{local_port}");
        let out = run_in(
            self.namespace(id),
            "ss",
            &["-HtnK", "state", "established", &filter],
        )?;
        anyhow::ensure!(
            out.lines().any(|l| !l.trim().is_empty()),
            "no established connection from port {local_port} on node {id} to abort"
        );
        Ok(())
    }

    /// Removes every cut, loss and delay: the network is whole again.
    pub fn heal(&mut self) -> anyhow::Result<()> {
        for i in 0..self.nodes.len() {
            let ns = self.nodes[i].clone();
            run_in(&ns, "iptables", &["-w", "-F"])?;
            let faults = std::mem::take(&mut self.faults[i]);
            if faults.qdisc {
                run_in(&ns, "tc", &["qdisc", "del", "dev", "eth0", "root"])?;
            }
        }
        self.cuts.clear();
        Ok(())
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Deleting a namespace destroys its interfaces, and a veth dies with either end, so this
        // removes the bridge, every veth and the root-side link.
        for ns in self.created.iter().rev() {
            if let Err(e) = run("ip", &["netns", "del", ns]) {
                eprintln!("chaos harness: {e:#}");
            }
        }
        if run("ip", &["link", "show", &self.root_link]).is_ok() {
            let _ = run("ip", &["link", "del", &self.root_link]);
        }
    }
}

/// A [`Cluster`] whose nodes run in the namespaces of a [`Network`]: node `i` listens on
/// `10.77.K.(10+i)` ports [`CLIENT_PORT`], [`PEER_PORT`], [`ADMIN_PORT`].
///
/// Field order matters: the cluster (its processes) is dropped before the network.
pub struct NetCluster {
    /// The broker processes (start, kill, signal, logs).
    pub cluster: Cluster,
    /// The namespaces and the faults.
    pub net: Network,
    /// The committed members as last settled ([`NetCluster::settle_membership`]): the seeded
    /// nodes at first, in id order.
    members: Vec<u32>,
    /// Ids that left for ever: removed members, and joiners whose add was never committed
    /// (an id is never used twice).
    retired: BTreeSet<u32>,
}

impl NetCluster {
    /// Creates the network and starts `n` brokers in it; `edit` may adjust each node's
    /// configuration first.
    pub fn start(n: usize, edit: impl Fn(&mut BrokerConfig)) -> anyhow::Result<NetCluster> {
        NetCluster::start_with_spares(n, 0, edit)
    }

    /// [`NetCluster::start`] with `spares` more namespaces and configured nodes (ids `n + 1 ..=
    /// n + spares`) that are not started: the files of the `n` seeded nodes list only those,
    /// and a spare joins the running cluster through [`NetCluster::start_joiner`] and an add
    /// (DESIGN.md §5a).
    pub fn start_with_spares(
        n: usize,
        spares: usize,
        edit: impl Fn(&mut BrokerConfig),
    ) -> anyhow::Result<NetCluster> {
        let total = n + spares;
        let net = Network::create(total)?;
        let hosts: Vec<String> = (1..=total as u32)
            .map(|i| net.node_ip(i).to_string())
            .collect();
        let seeded = n as u32;
        let mut cluster = Cluster::configure(total, |config| {
            for m in config.members.iter_mut() {
                m.host = hosts[(m.id - 1) as usize].clone();
                m.client_port = CLIENT_PORT;
                m.peer_port = PEER_PORT;
                m.admin_port = ADMIN_PORT;
            }
            // The harness reads /status from each namespace's address, not its loopback.
            config.admin.listen_host = Some(hosts[(config.node_id - 1) as usize].clone());
            if config.node_id <= seeded {
                config.members.retain(|m| m.id <= seeded);
            } else {
                let own = config.node_id;
                config.members.retain(|m| m.id == own);
            }
            edit(config);
        })?;
        for node in cluster.nodes.iter_mut() {
            node.launch_prefix = net.launch_prefix(node.id);
        }
        let mut this = NetCluster {
            cluster,
            net,
            members: (1..=seeded).collect(),
            retired: BTreeSet::new(),
        };
        for id in 1..=seeded {
            this.cluster.start_node(id)?;
        }
        Ok(this)
    }

    /// The members' ids (the seeded nodes until a change is settled), in id order.
    pub fn ids(&self) -> Vec<u32> {
        self.members.clone()
    }

    /// Every configured id, members, spares and retired ones: `1..=n + spares`.
    pub fn all_ids(&self) -> Vec<u32> {
        (1..=self.cluster.nodes.len() as u32).collect()
    }

    /// Spare ids that are neither members nor retired, in id order (the next joiners).
    pub fn spares(&self) -> Vec<u32> {
        self.all_ids()
            .into_iter()
            .filter(|id| !self.members.contains(id) && !self.retired.contains(id))
            .collect()
    }

    /// Starts spare `id` as a joining node: its file lists itself alone and `join` names the
    /// peer addresses of the current members, so at its first start it learns the committed
    /// membership from them; waits (up to 20 s) until its admin port answers. The add itself
    /// is the caller's ([`NetCluster::add_path`]).
    ///
    /// Errors: `id` is not a spare, the file cannot be written, the process does not start.
    pub async fn start_joiner(&mut self, id: u32) -> anyhow::Result<()> {
        anyhow::ensure!(self.spares().contains(&id), "n{id} is no spare");
        let join: Vec<String> = self
            .members
            .iter()
            .map(|&m| format!("{}:{PEER_PORT}", self.net.node_ip(m)))
            .collect();
        let node = &mut self.cluster.nodes[(id - 1) as usize];
        node.config.join = join;
        std::fs::write(&node.config_path, node.config.to_toml_string())?;
        if !node.is_running() {
            self.cluster.start_node(id)?;
        }
        let admin = self.cluster.node(id).admin_addr();
        let deadline = Instant::now() + Duration::from_secs(20);
        while bmqctl::http::get(&admin, "/healthz").await.is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "joiner n{id} did not answer on {admin}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// The admin path of `POST /admin/members` that adds node `id` with its configured
    /// addresses (the request waits up to 30 s for the change).
    pub fn add_path(&self, id: u32) -> String {
        crate::add_member_path(self.cluster.node(id).config.self_member())
    }

    /// The admin path of `DELETE /admin/members/{id}` (waits up to 30 s for the change).
    pub fn remove_path(id: u32) -> String {
        format!("/admin/members/{id}?timeout_ms=30000")
    }

    /// Learns what a change left behind, whatever happened to its request: waits (up to
    /// `timeout`) for an active leader whose metadata has nothing uncommitted, takes its
    /// committed membership as the members, then stops every joiner the membership does not
    /// hold (retired: its add was lost with a failed leader) and waits for every removed
    /// member to exit by itself (it must, DESIGN.md §5a). Returns a line telling what it
    /// found, for the fault log.
    ///
    /// Errors: no settled leader within `timeout`, or a removed member still running after it.
    pub async fn settle_membership(&mut self, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        let running: Vec<u32> = self
            .all_ids()
            .into_iter()
            .filter(|&id| self.cluster.node(id).is_running())
            .collect();
        let membership = loop {
            let mut best: Option<(u64, bmq_proto::admin_doc::MembershipDoc)> = None;
            for (_, s) in self.statuses_of(&running).await {
                let Ok(s) = s else { continue };
                if s.metadata.role != "active_leader" || s.metadata.uncommitted != 0 {
                    continue;
                }
                if let Some(m) = s.membership {
                    if best.as_ref().is_none_or(|(t, _)| s.elector.term > *t) {
                        best = Some((s.elector.term, m));
                    }
                }
            }
            if let Some((_, m)) = best {
                break m;
            }
            if Instant::now() > deadline {
                bail!("no active leader with its ledger committed within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let before = std::mem::replace(
            &mut self.members,
            membership.members.iter().map(|m| m.node_id).collect(),
        );
        let mut told = format!(
            "membership epoch {}: members {:?} (roles {:?}), before {before:?}",
            membership.epoch,
            self.members,
            membership
                .members
                .iter()
                .map(|m| m.role.as_str())
                .collect::<Vec<_>>()
        );
        for id in running {
            if self.members.contains(&id) {
                continue;
            }
            self.retired.insert(id);
            if before.contains(&id) || membership.removed.contains(&id) {
                let left = deadline.saturating_duration_since(Instant::now());
                let exited = self
                    .cluster
                    .wait_for_exit(id, left.max(Duration::from_secs(5)))?;
                anyhow::ensure!(exited.is_some(), "removed n{id} is still running");
                let _ = write!(told, "; removed n{id} exited");
            } else {
                self.cluster.kill_node(id)?;
                let _ = write!(told, "; joiner n{id} never added: stopped, retired");
            }
        }
        Ok(told)
    }

    /// Client addresses of every node, in id order.
    pub fn client_addrs(&self) -> Vec<String> {
        self.cluster.client_addrs()
    }

    /// `(id, admin address)` of every node.
    pub fn admin_addrs(&self) -> Vec<(u32, String)> {
        self.cluster
            .nodes
            .iter()
            .map(|n| (n.id, n.admin_addr()))
            .collect()
    }

    /// `/status` of the nodes `ids`, fetched concurrently (an error for a node that does not
    /// answer within [`STATUS_TIMEOUT`], e.g. a paused one).
    pub async fn statuses_of(&self, ids: &[u32]) -> Vec<(u32, anyhow::Result<NodeStatusDoc>)> {
        let fetches = ids.iter().map(|&id| {
            let addr = self.cluster.node(id).admin_addr();
            async move { (id, fetch_status(&addr, STATUS_TIMEOUT).await) }
        });
        futures::future::join_all(fetches).await
    }

    /// Waits until every node of `ids` answers, all follow one leader (a member of `ids`) at
    /// one term and are ready, and that leader's metadata is active. Returns `(leader, term)`.
    pub async fn wait_for_leader_among(
        &self,
        ids: &[u32],
        timeout: Duration,
    ) -> anyhow::Result<(u32, u64)> {
        let deadline = Instant::now() + timeout;
        loop {
            let statuses = self.statuses_of(ids).await;
            let mut views = BTreeSet::new();
            let mut all_ready = true;
            let mut active = None;
            let mut summary = String::new();
            for (id, s) in &statuses {
                match s {
                    Ok(s) => {
                        views.insert(s.elector.leader.map(|l| (l, s.elector.term)));
                        all_ready &= s.ready;
                        if s.metadata.role == "active_leader" {
                            active = Some(*id);
                        }
                        let _ = write!(
                            summary,
                            "[n{id} {} t{} leader {:?} ready {}] ",
                            s.elector.state, s.elector.term, s.elector.leader, s.ready
                        );
                    }
                    Err(e) => {
                        views.insert(None);
                        let _ = write!(summary, "[n{id} {e:#}] ");
                    }
                }
            }
            if let (1, Some(Some((leader, term)))) = (views.len(), views.first()) {
                if all_ready && active == Some(*leader) && ids.contains(leader) {
                    return Ok((*leader, *term));
                }
            }
            if Instant::now() > deadline {
                bail!("no agreed active leader among {ids:?} within {timeout:?}: {summary}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every running member agrees on one active leader and term, and all report the
    /// same committed and last LSN (the last one is the leader's commit record), no uncommitted
    /// advisory, and the same partitions (primary, lease, status) and queue assignments. Returns `(leader, term, committed_lsn)`; the error
    /// describes the last disagreement seen.
    pub async fn wait_converged(&self, timeout: Duration) -> anyhow::Result<(u32, u64, String)> {
        let deadline = Instant::now() + timeout;
        let running: Vec<u32> = self
            .members
            .iter()
            .copied()
            .filter(|&id| self.cluster.node(id).is_running())
            .collect();
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let (leader, term) = self.wait_for_leader_among(&running, remaining).await?;
            let statuses = self.statuses_of(&running).await;
            let mut states = BTreeSet::new();
            let mut detail = String::new();
            for (id, s) in &statuses {
                match s {
                    Ok(s) => {
                        let partitions: Vec<_> = s
                            .partitions
                            .iter()
                            .map(|p| {
                                (
                                    p.partition_id,
                                    p.primary,
                                    p.primary_lease_id,
                                    p.status.clone(),
                                )
                            })
                            .collect();
                        let queues: Vec<_> = s
                            .queues
                            .iter()
                            .map(|q| (q.uri.clone(), q.partition_id, q.queue_key))
                            .collect();
                        states.insert(format!(
                            "leader {:?} term {} committed {} last {} partitions {partitions:?} queues {queues:?}",
                            s.elector.leader, s.elector.term, s.metadata.committed_lsn, s.metadata.last_lsn
                        ));
                        let _ = writeln!(
                            detail,
                            "  n{id}: committed {} last {} uncommitted {} partitions {partitions:?} queues {}",
                            s.metadata.committed_lsn,
                            s.metadata.last_lsn,
                            s.metadata.uncommitted,
                            queues.len()
                        );
                    }
                    Err(e) => {
                        states.insert(format!("n{id} unreachable"));
                        let _ = writeln!(detail, "  n{id}: {e:#}");
                    }
                }
            }
            let nothing_pending = statuses
                .iter()
                .all(|(_, s)| s.as_ref().is_ok_and(|s| s.metadata.uncommitted == 0));
            if states.len() == 1 && nothing_pending {
                let committed = statuses[0]
                    .1
                    .as_ref()
                    .map(|s| s.metadata.committed_lsn.clone())
                    .unwrap_or_default();
                return Ok((leader, term, committed));
            }
            if Instant::now() > deadline {
                bail!("nodes did not converge within {timeout:?}:\n{detail}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `(node id, log path)` of every node, for [`crate::history::scan_logs`].
    pub fn log_paths(&self) -> Vec<(u32, PathBuf)> {
        self.cluster
            .nodes
            .iter()
            .map(|n| (n.id, n.log_path()))
            .collect()
    }
}
