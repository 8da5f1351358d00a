#!/usr/bin/env python3
"""Failover benchmark: leader SIGKILL -> new leader, primary SIGKILL -> first ACK, and
leader SIGKILL -> the next metadata write committed (`metadata`, see metadata_runs).

Run through scripts/bench-failover.sh, which builds the release binaries first.

Method
- A 3-node cluster with the embedded default configuration (`bmqctl cluster up --configs-only
  --no-security` writes the per-node files, then this script runs the three `broker`
  processes itself so it can kill and restart them one by one).
- Leader runs: find the leader on /status, SIGKILL it, poll the survivors' /status every
  POLL_S until one reports `elector.state == "leader"` with a higher term. The figure is the
  time from the kill to that observation (an upper bound: it includes up to one poll
  interval). The killed node is restarted and the cluster is let settle (every node ready,
  one leader) before the next run.
- Primary runs: `bmqctl bench messages` produces at RATE msg/s through a node that is not the
  queue's primary; after WARMUP_S the queue's primary (from /status) is SIGKILLed. The figure is
  the largest ACK latency of the run: the PUTs caught by the kill wait for the new primary, so it
  is the kill -> first ACK gap plus at most one inter-PUT interval and one normal ACK latency.
  Every ACKed message must be consumed (`missing == 0`), or the run is reported as a loss.
- PREFILL (default 0): queues assigned before the runs, so failovers carry a cluster state of
  that size.
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
NODES = [1, 2, 3]


def admin(i):
    return f"127.0.0.1:{BASE_PORT + 200 + i}"


def client(i):
    return f"127.0.0.1:{BASE_PORT + i}"


def status(i, timeout=0.5):
    try:
        with urllib.request.urlopen(f"http://{admin(i)}/status", timeout=timeout) as r:
            return json.load(r)
    except Exception:
        return None


procs = {}


def start(i):
    log = open(os.path.join(DIR, f"node-{i}", "bench.log"), "ab")
    procs[i] = subprocess.Popen(
        [os.path.join(BIN, "broker"), "--config", os.path.join(DIR, f"node-{i}", "broker.toml")],
        stdout=log, stderr=log)


def kill(i):
    procs[i].send_signal(signal.SIGKILL)
    procs[i].wait()


def settle(timeout=30):
    """Waits until every node is ready and all agree on one leader; returns (leader, term)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        docs = [status(i) for i in NODES]
        if all(d and d["ready"] for d in docs):
            leaders = {d["elector"]["leader"] for d in docs}
            actives = all(p["status"] == "active" and p["primary"] is not None
                          for p in docs[0]["partitions"])
            if len(leaders) == 1 and None not in leaders and actives:
                leader = leaders.pop()
                return leader, docs[0]["elector"]["term"]
        time.sleep(0.05)
    raise SystemExit("cluster did not settle: " + json.dumps([status(i) for i in NODES]))


def metrics(i, names, timeout=0.2):
    """The values of the unlabelled gauges `names` in node i's /metrics (missing ones absent),
    or None when the node does not answer."""
    try:
        with urllib.request.urlopen(f"http://{admin(i)}/metrics", timeout=timeout) as r:
            found = {}
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if name in names:
                    found[name] = int(float(value.split()[0]))
            return found
    except Exception:
        return None


def cluster_queues(i):
    """bmq_cluster_queues of node i (queues in its committed state), or None."""
    return (metrics(i, ("bmq_cluster_queues",)) or {}).get("bmq_cluster_queues")


def elector(i):
    """(bmq_elector_state, bmq_elector_term) of node i from its /metrics (state 3 = leader), or
    None: as /status says, without listing every queue (a cluster state of 100,000 queues
    makes /status megabytes long)."""
    found = metrics(i, ("bmq_elector_state", "bmq_elector_term")) or {}
    if "bmq_elector_state" not in found or "bmq_elector_term" not in found:
        return None
    return found["bmq_elector_state"], found["bmq_elector_term"]


def prefill(leader):
    """Assigns PREFILL queues through the leader, 64 in flight."""
    t0 = time.monotonic()
    subprocess.run(
        [os.path.join(BIN, "bmqctl"), "bench", "metadata", "--queues", str(PREFILL),
         "--parallel", "64", "--broker", client(leader), "--no-tls", "--token", "", "--quiet"],
        check=True, stdout=subprocess.DEVNULL)
    print(f"prefill: {PREFILL} queues assigned in {time.monotonic() - t0:.1f} s", flush=True)


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


def summary(name, values):
    print(f"{name}: runs {len(values)}  p50 {pct(values, 0.5):.0f} ms  "
          f"p99 {pct(values, 0.99):.0f} ms  max {max(values):.0f} ms  "
          f"mean {statistics.mean(values):.0f} ms", flush=True)


def leader_runs():
    out = []
    for run in range(RUNS):
        leader, term = settle()
        t0 = time.monotonic()
        kill(leader)
        survivors = [i for i in NODES if i != leader]
        while True:
            seen = None
            for i in survivors:
                d = status(i, timeout=0.2)
                if d and d["elector"]["state"] == "leader" and d["elector"]["term"] > term:
                    seen = i
            if seen:
                break
            if time.monotonic() - t0 > 30:
                raise SystemExit("no new leader within 30 s")
            time.sleep(POLL_S)
        ms = (time.monotonic() - t0) * 1000
        out.append(ms)
        print(f"leader run {run + 1}: killed node {leader} (term {term}), "
              f"node {seen} leads after {ms:.0f} ms", flush=True)
        start(leader)
    return out


def metadata_runs():
    """Leader SIGKILL -> the next metadata write is committed: right after the kill a
    client opens a never-opened queue through a survivor; the figure is the time until a
    survivor's committed state holds one more queue (its /metrics `bmq_cluster_queues`, polled
    every POLL_S). Election + the new leader's sync + one commit; the open itself may wait
    longer for the queue's partition primary, which is not measured here."""
    out = []
    for run in range(RUNS):
        leader, term = settle()
        survivors = [i for i in NODES if i != leader]
        before = max(cluster_queues(i) or 0 for i in survivors)
        t0 = time.monotonic()
        kill(leader)
        writer = subprocess.Popen(
            [os.path.join(BIN, "bmqctl"), "bench", "metadata", "--queues", "1", "--broker",
             client(survivors[0]), "--no-tls", "--token", "", "--quiet", "--json",
             "--timeout-secs", "20"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        elected = None
        while True:
            if elected is None:
                for i in survivors:
                    e = elector(i)
                    if e and e[0] == 3 and e[1] > term:
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
              f"after {seen}, next write committed after {ms:.0f} ms", flush=True)
        writer.wait(timeout=30)
        start(leader)
    return out


def primary_runs():
    out, lost = [], 0
    for run in range(RUNS):
        settle()
        prefix = f"fo{os.getpid()}r{run}"
        bench = subprocess.Popen(
            [os.path.join(BIN, "bmqctl"), "bench", "messages", "--queue-prefix", prefix,
             "--rate", str(RATE), "--duration-secs", str(BENCH_S), "--size", "1024",
             "--window", "10000", "--json", "--quiet", "--no-tls", "--token", "",
             "--broker", ",".join(client(i) for i in NODES)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        time.sleep(WARMUP_S)
        doc = status(1) or status(2) or status(3)
        queue = [q for q in doc["queues"] if prefix in q["uri"]]
        if not queue:
            bench.kill()
            raise SystemExit(f"queue {prefix} not assigned after {WARMUP_S} s")
        part = queue[0]["partition_id"]
        primary = [p["primary"] for p in doc["partitions"] if p["partition_id"] == part][0]
        kill(primary)
        stdout, _ = bench.communicate(timeout=BENCH_S + 120)
        report = json.loads(stdout)
        gap = report["ack_latency"]["max_us"] / 1000
        out.append(gap)
        lost += report["missing"]
        print(f"primary run {run + 1}: killed node {primary} (partition {part}), "
              f"longest ACK wait {gap:.0f} ms, acked {report['produced']['messages']}, "
              f"missing {report['missing']}, redeliveries {report['redeliveries']}", flush=True)
        start(primary)
    return out, lost


def write_configs():
    """Fresh configuration files in DIR, written by scripts/lib/configs.sh (`bmqctl cluster up
    --configs-only --no-security`: plain TCP, no broker started)."""
    subprocess.run(["bash", "-c", '. "$0" && write_configs "$@"',
                    os.path.join(ROOT, "scripts", "lib", "configs.sh"), BIN, DIR, str(BASE_PORT)],
                   check=True, stdout=subprocess.DEVNULL)


def main():
    write_configs()
    for i in NODES:
        start(i)
    try:
        leader, _ = settle(60)  # the fresh cluster's first election
        if PREFILL:
            prefill(leader)
        which = sys.argv[1] if len(sys.argv) > 1 else "all"
        results = {}
        if which in ("all", "leader"):
            results["leader"] = leader_runs()
        if which in ("all", "metadata"):
            results["metadata"] = metadata_runs()
        if which in ("all", "primary"):
            results["primary"], lost = primary_runs()
            print(f"acknowledged messages lost over all primary runs: {lost}")
        for name, values in results.items():
            what = {"leader": "leader SIGKILL -> new leader",
                    "metadata": "leader SIGKILL -> next metadata write committed",
                    "primary": "primary SIGKILL -> first ACK"}[name]
            summary(what, values)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
