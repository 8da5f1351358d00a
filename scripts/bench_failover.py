#!/usr/bin/env python3
"""Failover benchmark: every figure of a failover, with a cluster state of PREFILL queues.

Run through scripts/bench-failover.sh (builds the release binaries first), or
scripts/bench-failover-sizes.sh (every mode at 100, 100,000 and 1,000,000 queues, one table).

Modes (the first argument; default `all` = leader, metadata, primary):
- `leader`: SIGKILL of the elector leader -> a survivor reports itself leader with a higher
  term (its /metrics `bmq_elector_state` / `bmq_elector_term`, polled every POLL_MS).
- `metadata`: SIGKILL of the leader -> the next metadata write is committed: right after the
  kill a client opens a never-opened queue through a survivor; the figure is the time until a
  survivor's committed state holds one more queue (`bmq_cluster_queues`). Election + leader
  sync + one commit; the open itself may wait longer for its partition's primary.
- `open`: SIGKILL of the leader -> the first successful open of a never-opened queue, opens
  started every 10 ms from the kill on, alternately through clients of the two survivors
  (`bmqctl bench first-open --kill-pid`: the driver connects first, then kills, so its clock
  starts at the kill). The same runs also give `open-dead-primary`: the first successful open
  of a queue on a partition whose primary was the killed leader (that open also waits for a
  new primary to heal and go active; the broker names the partition in its answer).
- `silent`: SIGSTOP of the leader -> a survivor reports itself leader with a higher term
  (polled as in `leader`); then SIGCONT, and the stopped node rejoins as a follower.
- `restart`: SIGKILL of a node that is not the leader, started again at once -> ready: its
  `/readyz` answers 200, polled every POLL_MS from the process's start. Ready means (admin.rs)
  that the node follows an active leader (or is one) whose metadata term it has caught up with,
  and every partition's journal on this node is open (the outstanding index of each read);
  a node whose ledger (the cluster state) has not been recovered cannot answer at all. The
  runs also report when its committed state held as many queues as the survivors'
  (`caught up`).
- `primary`: `bmqctl bench messages` produces at RATE msg/s through every node; after
  WARMUP_S the queue's primary is SIGKILLed. The figure is the largest ACK latency of the
  run: the PUTs caught by the kill wait for the new primary, so it is the kill -> first ACK
  gap plus at most one inter-PUT interval and one normal ACK latency. Every ACKed message
  must be consumed (`missing == 0`), or the run is reported as a loss. The queue is assigned
  first (`bmqctl bench first-open --opens 1`, which names its partition) so that its primary
  is known without /status.

Every run first waits until the cluster settled: every node answers /readyz, all follow one
leader, every partition has an active primary and every node holds the same number of
queues. Nothing here reads /status: with 1,000,000 queues it is tens of megabytes.

`python3 scripts/bench_failover.py table FILE...` prints RESULTS_JSON files side by side.

Environment: RUNS (20), PREFILL (0: queues assigned before the runs, 64 in flight), BIN (the
build, default target/release), BMQCTL (the bmqctl binary, default BIN's: a newer bmqctl can
drive an older broker), BASE_PORT (31100), POLL_MS (10), RATE, WARMUP_S, BENCH_S (primary),
RESULTS_JSON (a file to write every mode's values to, for bench-failover-sizes.sh).
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("BIN", os.path.join(ROOT, "target", "release"))
BMQCTL = os.environ.get("BMQCTL", os.path.join(BIN, "bmqctl"))
RUNS = int(os.environ.get("RUNS", "20"))
BASE_PORT = int(os.environ.get("BASE_PORT", "31100"))
DIR = os.environ.get("CLUSTER_DIR_BENCH", "/tmp/bmq-bench-failover")
POLL_S = float(os.environ.get("POLL_MS", "10")) / 1000
RATE = int(os.environ.get("RATE", "2000"))
WARMUP_S = float(os.environ.get("WARMUP_S", "1.5"))
BENCH_S = int(os.environ.get("BENCH_S", "5"))
# Queues assigned before the runs (each opened for writing and closed once), so the failover
# carries a cluster state of that size: the new leader's snapshot, every node's ledger.
PREFILL = int(os.environ.get("PREFILL", "0"))
RESULTS_JSON = os.environ.get("RESULTS_JSON")
# RESTART_WIPE_LEDGER=1: a node killed by a run (not by `restart`) starts again with an empty
# metadata ledger, so it catches up from the leader instead of reading its own. A workaround
# for measuring at 1,000,000 queues on builds whose ledger refuses, at open, the snapshot
# records it wrote (LEDGER_RECORD_BODY_MAX, 16 MiB: ~400,000 queues); never on by default.
RESTART_WIPE_LEDGER = os.environ.get("RESTART_WIPE_LEDGER") == "1"
NODES = [1, 2, 3]
LEADER = 3  # bmq_elector_state of a leader


def admin(i):
    return f"127.0.0.1:{BASE_PORT + 200 + i}"


def client(i):
    return f"127.0.0.1:{BASE_PORT + i}"


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def scrape(i, timeout=0.5):
    """Node i's /metrics as {name with labels: value}, or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{admin(i)}/metrics", timeout=timeout) as r:
            found = {}
            for line in r.read().decode().splitlines():
                if not line or line[0] == "#":
                    continue
                name, _, value = line.rpartition(" ")
                try:
                    found[name] = float(value)
                except ValueError:
                    pass
            return found
    except Exception:
        return None


def metrics(i, names, timeout=0.2):
    """The values of the gauges `names` in node i's /metrics (missing ones absent), or None
    when the node does not answer."""
    m = scrape(i, timeout)
    if m is None:
        return None
    return {n: int(m[n]) for n in names if n in m}


def cluster_queues(i):
    """bmq_cluster_queues of node i (queues in its committed state), or None."""
    return (metrics(i, ("bmq_cluster_queues",)) or {}).get("bmq_cluster_queues")


def elector(i, timeout=0.2):
    """(bmq_elector_state, bmq_elector_term) of node i from its /metrics (state 3 = leader), or
    None."""
    found = metrics(i, ("bmq_elector_state", "bmq_elector_term"), timeout) or {}
    if "bmq_elector_state" not in found or "bmq_elector_term" not in found:
        return None
    return found["bmq_elector_state"], found["bmq_elector_term"]


def ready(i, timeout=0.5):
    try:
        with urllib.request.urlopen(f"http://{admin(i)}/readyz", timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def primaries(m):
    """{partition: primary node} of a scrape, with the partitions' announced status."""
    out = {}
    for name, value in m.items():
        if name.startswith("bmq_cluster_partition_primary_node_id{"):
            part = int(name.split('partition="')[1].split('"')[0])
            status = m.get(f'bmq_cluster_partition_status{{partition="{part}"}}', 0)
            out[part] = (int(value), int(status))
    return out


procs = {}


def start(i):
    log = open(os.path.join(DIR, f"node-{i}", "bench.log"), "ab")
    procs[i] = subprocess.Popen(
        [os.path.join(BIN, "broker"), "--config", os.path.join(DIR, f"node-{i}", "broker.toml")],
        stdout=log, stderr=log)


def kill(i):
    procs[i].send_signal(signal.SIGKILL)
    procs[i].wait()


def restart(i):
    """Starts node i again after a run killed it (RESTART_WIPE_LEDGER: with an empty
    ledger)."""
    if RESTART_WIPE_LEDGER:
        ledger = os.path.join(DIR, f"node-{i}", "ledger")
        for name in os.listdir(ledger):
            os.remove(os.path.join(ledger, name))
    start(i)


def settle(timeout=120):
    """Waits until every node is ready, all follow one leader, every partition has an active
    primary and every node holds the same number of queues; returns (leader, term,
    {partition: primary})."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        gone = [i for i in NODES if procs[i].poll() is not None]
        if gone:
            raise SystemExit(f"node {gone[0]} exited with {procs[gone[0]].returncode}")
        scrapes = [scrape(i, timeout=2) for i in NODES]
        if all(scrapes) and all(ready(i, timeout=5) for i in NODES):
            leaders = {int(m.get("bmq_elector_leader_node_id", 0)) for m in scrapes}
            terms = {int(m.get("bmq_elector_term", 0)) for m in scrapes}
            queues = {int(m.get("bmq_cluster_queues", -1)) for m in scrapes}
            parts = primaries(scrapes[0])
            active = parts and all(p and s == 2 for p, s in parts.values())
            last = (leaders, terms, queues, parts)
            if len(leaders) == 1 and 0 not in leaders and len(terms) == 1 and active \
                    and len(queues) == 1:
                return leaders.pop(), terms.pop(), {k: p for k, (p, _) in parts.items()}
        time.sleep(0.2)
    raise SystemExit(f"cluster did not settle: {last}")


def new_leader(survivors, term, t0, limit=30):
    """Polls the survivors' /metrics until one is leader with a term above `term`; returns
    (node, ms since t0)."""
    while True:
        for i in survivors:
            e = elector(i)
            if e and e[0] == LEADER and e[1] > term:
                return i, (time.monotonic() - t0) * 1000
        if time.monotonic() - t0 > limit:
            raise SystemExit(f"no new leader within {limit} s")
        time.sleep(POLL_S)


def prefill(leader):
    """Assigns PREFILL queues through the leader, 64 in flight."""
    t0 = time.monotonic()
    subprocess.run(
        [BMQCTL, "bench", "metadata", "--queues", str(PREFILL),
         "--parallel", "64", "--broker", client(leader), "--no-tls", "--token", "", "--quiet"],
        check=True, stdout=subprocess.DEVNULL)
    print(f"prefill: {PREFILL} queues assigned in {time.monotonic() - t0:.1f} s "
          f"(load {loadavg()})", flush=True)


def readyz_cost(calls=5):
    """The median time of `calls` /readyz answers on each node, ms."""
    out = []
    for i in NODES:
        took = []
        for _ in range(calls):
            t = time.monotonic()
            ready(i, timeout=5)
            took.append((time.monotonic() - t) * 1000)
        out.append(f"node {i} {statistics.median(took):.1f} ms")
    return ", ".join(out)


def rss_mib():
    out = []
    for i in NODES:
        try:
            with open(f"/proc/{procs[i].pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out.append(f"node {i} {int(line.split()[1]) / 1024:.0f} MiB")
        except OSError:
            out.append(f"node {i} -")
    return ", ".join(out)


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


def summary(name, values):
    if not values:
        print(f"{name}: no runs", flush=True)
        return
    print(f"{name}: runs {len(values)}  p50 {pct(values, 0.5):.0f} ms  "
          f"p99 {pct(values, 0.99):.0f} ms  max {max(values):.0f} ms  "
          f"mean {statistics.mean(values):.0f} ms", flush=True)


def leader_runs(results):
    out = results.setdefault("leader", [])
    for run in range(RUNS):
        leader, term, _ = settle()
        t0 = time.monotonic()
        kill(leader)
        seen, ms = new_leader([i for i in NODES if i != leader], term, t0)
        out.append(ms)
        print(f"leader run {run + 1}: killed node {leader} (term {term}), "
              f"node {seen} leads after {ms:.0f} ms (load {loadavg()})", flush=True)
        restart(leader)


def metadata_runs(results):
    """See the module doc (`metadata`)."""
    out = results.setdefault("metadata", [])
    for run in range(RUNS):
        leader, term, _ = settle()
        survivors = [i for i in NODES if i != leader]
        before = max(cluster_queues(i) or 0 for i in survivors)
        t0 = time.monotonic()
        kill(leader)
        writer = subprocess.Popen(
            [BMQCTL, "bench", "metadata", "--queues", "1", "--broker",
             client(survivors[0]), "--no-tls", "--token", "", "--quiet", "--json",
             "--timeout-secs", "20"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        elected = None
        while True:
            if elected is None:
                for i in survivors:
                    e = elector(i)
                    if e and e[0] == LEADER and e[1] > term:
                        elected = (time.monotonic() - t0) * 1000
            if any((cluster_queues(i) or 0) > before for i in survivors):
                break
            if time.monotonic() - t0 > 30:
                raise SystemExit("no metadata write committed within 30 s")
            time.sleep(POLL_S)
        ms = (time.monotonic() - t0) * 1000
        out.append(ms)
        seen = "not seen" if elected is None else f"{elected:.0f} ms"
        print(f"metadata run {run + 1}: killed leader {leader} (term {term}), new leader seen "
              f"after {seen}, next write committed after {ms:.0f} ms (load {loadavg()})",
              flush=True)
        writer.wait(timeout=30)
        restart(leader)


def open_runs(results):
    """See the module doc (`open`, `open-dead-primary`)."""
    first = results.setdefault("open", [])
    dead = results.setdefault("open-dead-primary", [])
    for run in range(RUNS):
        leader, term, parts = settle()
        survivors = [i for i in NODES if i != leader]
        on_leader = sorted(p for p, node in parts.items() if node == leader)
        cmd = [BMQCTL, "bench", "first-open", "--broker",
               ",".join(client(i) for i in survivors), "--interval-ms", "10",
               "--kill-pid", str(procs[leader].pid), "--timeout-secs", "30", "--json",
               "--no-tls", "--token", ""]
        if on_leader:
            cmd += ["--partitions", ",".join(map(str, on_leader))]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs[leader].wait()
        if done.returncode != 0:
            raise SystemExit(f"first-open failed: {done.stderr.strip()}")
        report = json.loads(done.stdout)
        f = report["first"]
        first.append(f["done_ms"])
        line = (f"open run {run + 1}: killed leader {leader} (term {term}, primary of "
                f"partitions {on_leader}), first open {f['done_ms']:.0f} ms "
                f"(partition {f['partition']}, started at {f['started_ms']:.0f} ms)")
        d = report.get("first_on_partitions")
        if d:
            dead.append(d["done_ms"])
            line += (f", first open on a partition of the killed primary {d['done_ms']:.0f} ms "
                     f"(partition {d['partition']}, started at {d['started_ms']:.0f} ms)")
        print(f"{line}; opens started {report['opens_started']}, failed "
              f"{report['opens_failed']} (load {loadavg()})", flush=True)
        restart(leader)


def silent_runs(results):
    """See the module doc (`silent`)."""
    out = results.setdefault("silent", [])
    for run in range(RUNS):
        leader, term, _ = settle()
        t0 = time.monotonic()
        procs[leader].send_signal(signal.SIGSTOP)
        try:
            seen, ms = new_leader([i for i in NODES if i != leader], term, t0)
        finally:
            procs[leader].send_signal(signal.SIGCONT)
        out.append(ms)
        print(f"silent run {run + 1}: stopped node {leader} (term {term}), "
              f"node {seen} leads after {ms:.0f} ms (load {loadavg()})", flush=True)


def restart_runs(results):
    """See the module doc (`restart`)."""
    out = results.setdefault("restart", [])
    caught = results.setdefault("restart-caught-up", [])
    for run in range(RUNS):
        leader, term, _ = settle()
        followers = [i for i in NODES if i != leader]
        node = followers[run % len(followers)]
        others = [i for i in NODES if i != node]
        kill(node)
        t0 = time.monotonic()
        start(node)
        want = max(cluster_queues(i) or 0 for i in others)
        ready_ms = caught_ms = None
        while ready_ms is None or caught_ms is None:
            now = (time.monotonic() - t0) * 1000
            if now > 120_000:
                raise SystemExit(f"node {node} not ready within 120 s")
            if caught_ms is None and (cluster_queues(node) or -1) >= want:
                caught_ms = (time.monotonic() - t0) * 1000
            if procs[node].poll() is not None:
                log = os.path.join(DIR, f"node-{node}", "broker.log")
                tail = open(log, errors="replace").read().strip().splitlines()[-1:] \
                    if os.path.exists(log) else []
                raise SystemExit(f"node {node} exited with {procs[node].returncode} after "
                                 f"its restart: {' '.join(tail)}")
            if ready_ms is None and ready(node, timeout=2):
                ready_ms = (time.monotonic() - t0) * 1000
            time.sleep(POLL_S)
        out.append(ready_ms)
        caught.append(caught_ms)
        print(f"restart run {run + 1}: node {node} SIGKILLed and started, ready after "
              f"{ready_ms:.0f} ms, its state held {want} queues after {caught_ms:.0f} ms "
              f"(load {loadavg()})", flush=True)


def primary_runs(results):
    out, lost = results.setdefault("primary", []), 0
    for run in range(RUNS):
        _, _, parts = settle()
        prefix = f"fo{os.getpid()}r{run}"
        run_id = f"{run:08x}"
        # Assign the queue first: the answer names its partition, hence its primary.
        done = subprocess.run(
            [BMQCTL, "bench", "first-open", "--broker", client(1), "--opens", "1",
             "--queue-prefix", prefix, "--run-id", run_id, "--json", "--no-tls", "--token", ""],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=True)
        part = json.loads(done.stdout)["first"]["partition"]
        _, _, parts = settle()
        primary = parts[part]
        bench = subprocess.Popen(
            [BMQCTL, "bench", "messages", "--queue-prefix", prefix, "--run-id", run_id,
             "--rate", str(RATE), "--duration-secs", str(BENCH_S), "--size", "1024",
             "--window", "10000", "--json", "--quiet", "--no-tls", "--token", "",
             "--broker", ",".join(client(i) for i in NODES if i != primary)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        time.sleep(WARMUP_S)
        kill(primary)
        stdout, _ = bench.communicate(timeout=BENCH_S + 120)
        report = json.loads(stdout)
        gap = report["ack_latency"]["max_us"] / 1000
        out.append(gap)
        lost += report["missing"]
        print(f"primary run {run + 1}: killed node {primary} (partition {part}), "
              f"longest ACK wait {gap:.0f} ms, acked {report['produced']['messages']}, "
              f"missing {report['missing']}, redeliveries {report['redeliveries']} "
              f"(load {loadavg()})", flush=True)
        restart(primary)
    print(f"acknowledged messages lost over all primary runs: {lost}", flush=True)


def write_configs():
    """Fresh configuration files in DIR, written by scripts/lib/configs.sh (`bmqctl cluster up
    --configs-only --no-security`: plain TCP, no broker started)."""
    subprocess.run(["bash", "-c", '. "$0" && write_configs "$@"',
                    os.path.join(ROOT, "scripts", "lib", "configs.sh"), BIN, DIR, str(BASE_PORT)],
                   check=True, stdout=subprocess.DEVNULL)


WHAT = {
    "leader": "leader SIGKILL -> new leader",
    "metadata": "leader SIGKILL -> next metadata write committed",
    "open": "leader SIGKILL -> first open of a new queue",
    "open-dead-primary": "leader SIGKILL -> first open on a partition of the killed leader",
    "silent": "leader SIGSTOP -> new leader",
    "restart": "node SIGKILL + start -> /readyz",
    "restart-caught-up": "node SIGKILL + start -> its state holds every queue",
    "primary": "primary SIGKILL -> first ACK",
}


def table(paths):
    """Prints the RESULTS_JSON files `paths` (one per number of queues) side by side, a
    Markdown table: p50 / p99 / max in ms and the runs, per figure."""
    docs = sorted((json.load(open(p)) for p in paths), key=lambda d: d["queues"])
    print("| figure | " + " | ".join(f"{d['queues']:,} queues" for d in docs) + " |")
    print("|---|" + "---|" * len(docs))
    for name, what in WHAT.items():
        if not any(d["results"].get(name) for d in docs):
            continue
        cells = []
        for d in docs:
            v = d["results"].get(name) or []
            cells.append(f"{pct(v, 0.5):.0f} / {pct(v, 0.99):.0f} / {max(v):.0f} ms ({len(v)})"
                         if v else "-")
        print(f"| {what} | " + " | ".join(cells) + " |")
    print("\np50 / p99 / max (runs); load average at each size's end: " +
          ", ".join(f"{d['queues']:,}: {d['load']}" for d in docs))
    for d in docs:
        for mode, why in (d.get("errors") or {}).items():
            print(f"- {d['queues']:,} queues: `{mode}` stopped: {why}")


def main():
    if sys.argv[1:2] == ["table"]:
        table(sys.argv[2:])
        return
    which = sys.argv[1:] or ["all"]
    if which == ["all"]:
        which = ["leader", "metadata", "primary"]
    write_configs()
    for i in NODES:
        start(i)
    results, errors = {}, {}
    try:
        leader, _, _ = settle(60)  # the fresh cluster's first election
        if PREFILL:
            prefill(leader)
            settle()
            print(f"after the prefill: RSS {rss_mib()}", flush=True)
            print(f"one /readyz (the main thread's time with it): {readyz_cost()}", flush=True)
        print(f"bin {BIN}, queues {PREFILL}, runs {RUNS}, load {loadavg()}", flush=True)
        for mode in which:
            try:
                run_mode(mode, results)
            except SystemExit as e:
                # The cluster is in an unknown state: no later mode runs.
                errors[mode] = str(e)
                print(f"{mode} failed: {e}", flush=True)
                break
            print(f"after {mode}: RSS {rss_mib()}, load {loadavg()}", flush=True)
        for name, values in results.items():
            summary(WHAT[name], values)
    finally:
        if RESULTS_JSON:
            with open(RESULTS_JSON, "w") as f:
                json.dump({"queues": PREFILL, "bin": BIN, "load": loadavg(),
                           "results": results, "errors": errors}, f)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()


def run_mode(mode, results):
    """Runs `mode`, its values appended to `results` run by run (a failure keeps those)."""
    runs = {"leader": leader_runs, "metadata": metadata_runs, "open": open_runs,
            "silent": silent_runs, "restart": restart_runs, "primary": primary_runs}
    if mode not in runs:
        raise SystemExit(f"unknown mode {mode}")
    runs[mode](results)


if __name__ == "__main__":
    main()
