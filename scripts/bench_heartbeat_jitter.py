#!/usr/bin/env python3
"""Heartbeat jitter under metadata load: does anything delay the leader's heartbeats?

Run through scripts/bench-heartbeat-jitter.sh, which builds the release binaries first.

Method
- A 3-node local cluster with the embedded default configuration (`bmqctl cluster up
  --configs-only --no-security` writes the per-node files; this script then runs the three
  `broker` processes itself). Metadata fsync is the default, `every_record`.
- Each node exports two histograms with 1 ms buckets around the 100 ms heartbeat period:
  `bmq_elector_heartbeat_send_interval_seconds` (leader: time between two heartbeat
  broadcasts) and `bmq_elector_heartbeat_receive_interval_seconds` (followers: time between
  two heartbeats from the leader, as their elector sees them).
- The histograms are scraped from every node, then `bmqctl bench metadata --queues N
  --parallel K` runs (every open of a new queue is one committed advisory: a ledger write and
  fsync on the leader and on the followers), then they are scraped again. The figures are the
  p50, p99 and max of the intervals recorded *during* the benchmark (the difference of the two
  scrapes), each given as the upper bound of its bucket (`<=`), for sends (leader) and
  receives (both followers together).
- `BIN` selects the binaries (default target/release), so a baseline build can be measured in
  the same session: `BIN=/path/to/old/release scripts/bench_heartbeat_jitter.py`.
"""
import os
import re
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("BIN", os.path.join(ROOT, "target", "release"))
BASE_PORT = int(os.environ.get("BASE_PORT", "34100"))
DIR = os.environ.get("CLUSTER_DIR_BENCH", "/tmp/bmq-bench-heartbeat")
QUEUES = int(os.environ.get("QUEUES", "10000"))
PARALLEL = int(os.environ.get("PARALLEL", "64"))
NODES = [1, 2, 3]
SEND = "bmq_elector_heartbeat_send_interval_seconds"
RECEIVE = "bmq_elector_heartbeat_receive_interval_seconds"


def admin(i):
    return f"127.0.0.1:{BASE_PORT + 200 + i}"


def client(i):
    return f"127.0.0.1:{BASE_PORT + i}"


def scrape(i):
    """Cumulative bucket counts {le: count} of both histograms on node i."""
    with urllib.request.urlopen(f"http://{admin(i)}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {SEND: {}, RECEIVE: {}}
    for line in text.splitlines():
        m = re.match(r'^(\w+)_bucket\{(.*)\} (\S+)$', line)
        if not m or m.group(1) not in out:
            continue
        le = re.search(r'le="([^"]+)"', m.group(2)).group(1)
        out[m.group(1)][float(le)] = float(m.group(3))
    return out


def delta(after, before):
    return {le: after.get(le, 0) - before.get(le, 0) for le in after}


def add(a, b):
    return {le: a.get(le, 0) + b.get(le, 0) for le in set(a) | set(b)}


def quantile(cumulative, q):
    """Upper bound (ms) of the bucket holding quantile q of a cumulative histogram."""
    total = cumulative.get(float("inf"), 0)
    if total == 0:
        return None
    for le in sorted(cumulative):
        if cumulative[le] >= q * total:
            return le * 1000
    return float("inf")


def fmt(ms):
    return "-" if ms is None else ("> 2000" if ms == float("inf") else f"<= {ms:g}")


def write_configs():
    """Fresh configuration files in DIR, written by scripts/lib/configs.sh (`bmqctl cluster up
    --configs-only --no-security`: plain TCP, no broker started)."""
    subprocess.run(["bash", "-c", '. "$0" && write_configs "$@"',
                    os.path.join(ROOT, "scripts", "lib", "configs.sh"), BIN, DIR, str(BASE_PORT)],
                   check=True, stdout=subprocess.DEVNULL)


def main():
    write_configs()
    procs = []
    try:
        for i in NODES:
            log = open(f"{DIR}/node-{i}/bench.log", "a")
            procs.append(subprocess.Popen([f"{BIN}/broker", "--config",
                                           f"{DIR}/node-{i}/broker.toml"],
                                          stdout=log, stderr=log))
        for _ in range(120):
            ready = sum(subprocess.run([f"{BIN}/bmqctl", "ready", "--admin", admin(i)],
                                       capture_output=True).returncode == 0 for i in NODES)
            if ready == 3:
                break
            time.sleep(0.5)
        time.sleep(2)  # a few heartbeats so every histogram exists
        before = {i: scrape(i) for i in NODES}
        started = time.time()
        bench = subprocess.run([f"{BIN}/bmqctl", "bench", "metadata", "--queues", str(QUEUES),
                                "--parallel", str(PARALLEL), "--broker",
                                ",".join(client(i) for i in NODES), "--no-tls", "--token", ""],
                               capture_output=True, text=True)
        elapsed = time.time() - started
        after = {i: scrape(i) for i in NODES}
        print(bench.stdout.strip())
        if bench.returncode != 0:
            print(bench.stderr, file=sys.stderr)
            sys.exit(1)
        send, receive = {}, {}
        for i in NODES:
            send = add(send, delta(after[i][SEND], before[i][SEND]))
            receive = add(receive, delta(after[i][RECEIVE], before[i][RECEIVE]))
        load = open("/proc/loadavg").read().split()[:3]
        print(f"# heartbeat intervals during `bench metadata --queues {QUEUES} --parallel "
              f"{PARALLEL}` ({elapsed:.1f} s; load average {' '.join(load)}; bins {BIN})")
        print("| direction | samples | p50 ms | p99 ms | max ms |")
        print("|---|---|---|---|---|")
        for name, h in (("send (leader)", send), ("receive (followers)", receive)):
            print(f"| {name} | {int(h.get(float('inf'), 0))} | {fmt(quantile(h, 0.5))} | "
                  f"{fmt(quantile(h, 0.99))} | {fmt(quantile(h, 1.0))} |")
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
