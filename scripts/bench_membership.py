#!/usr/bin/env python3
"""Membership benchmark: time from `POST /admin/members` (a running node added as a learner)
to its promotion to voter, and of its removal, with PREFILL queues in the cluster state.

Run through scripts/bench-membership.sh, which builds the release binaries first.

Method
- A 3-node cluster with the embedded default configuration (`bmqctl cluster up --configs-only
  --no-security` writes the files; this script runs the `broker` processes itself).
- PREFILL (default 0) queues are assigned first (`bmqctl bench metadata`), so the learner's
  catch-up carries a ledger of that size (the leader's snapshot of the committed state).
- OUTSTANDING_MIB (default 0) MiB of messages are then produced and left unconsumed
  (`bmqctl bench messages --consumers 0`, 64 KiB payloads over 8 queues, so over several
  partitions): the learner's journals must catch them up before its promotion.
- Each run starts a new node (ids 4, 5, ...: a removed id never returns) with its own ports
  and an empty data directory, its file listing the three members and itself; then times
  `POST /admin/members?...` on the leader, which answers once the leader promoted the learner
  (it promotes a learner once the learner reports it applied the membership that added it —
  it then holds the ledger up to that commit — and that every partition's primary has
  synchronised its journal). Then `DELETE /admin/members/<id>` is timed
  (the voter leaves: its primaries move, every partition is re-leased to the remaining
  voters, and once they healed it is removed), and the removed node must exit by itself.
- With PACED (default 10000; 0 = off), each add and each remove runs inside a paced strong
  producer of its own (`bmqctl bench messages --rate PACED --duration-secs 4`, one producer
  and one consumer on one queue, through nodes 1-3, which stay): the change starts 1.5 s into
  it, and the figure is the longest gap between two consecutive ACKs of the producer
  (`ack_gap_max_ms`), beside the same run with no change (baseline). A voter change re-leases
  every partition (its primary heals again under the new voters), and an add may move one
  primary to the new node (rebalancing).
- With REMOVE_LEADER=1 (and PACED), each run instead adds a node, then removes the current
  leader under the paced producer (through every member), and then SIGKILLs the next leader
  under another paced run (restarted afterwards): the longest ACK gap of a removed leader
  beside that of a leader failover, in the same cluster.
- The figures are wall-clock times of the HTTP requests on the same machine; the load average
  is printed with them.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("BIN", os.path.join(ROOT, "target", "release"))
RUNS = int(os.environ.get("RUNS", "10"))
BASE_PORT = int(os.environ.get("BASE_PORT", "31500"))
DIR = os.environ.get("CLUSTER_DIR_BENCH", "/tmp/bmq-bench-membership")
PREFILL = int(os.environ.get("PREFILL", "0"))
PACED = int(os.environ.get("PACED", "10000"))
OUTSTANDING_MIB = int(os.environ.get("OUTSTANDING_MIB", "0"))
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


def leader():
    """The leader nodes 1-3 follow, once they agree and are ready."""
    return wait_leader_among(NODES)


def write_configs():
    subprocess.run(["bash", "-c", '. "$0" && write_configs "$@"',
                    os.path.join(ROOT, "scripts", "lib", "configs.sh"), BIN, DIR, str(BASE_PORT)],
                   check=True, stdout=subprocess.DEVNULL)


def new_node_config(k):
    """Node k's file: node 1's with node k's id, data directory and a [[members]] entry of its
    own (ports BASE+k, BASE+100+k, BASE+200+k)."""
    with open(os.path.join(DIR, "node-1", "broker.toml")) as f:
        text = f.read()
    text = re.sub(r"(?m)^node_id = \d+", f"node_id = {k}", text)
    text = text.replace(os.path.join(DIR, "node-1"), os.path.join(DIR, f"node-{k}"))
    member = (f'\n[[members]]\nid = {k}\nhost = "127.0.0.1"\nclient_port = {BASE_PORT + k}\n'
              f"peer_port = {BASE_PORT + 100 + k}\nadmin_port = {BASE_PORT + 200 + k}\n")
    # Members first in the file: insert before the first section that is not [[members]].
    idx = [m.start() for m in re.finditer(r"(?m)^\[(?!\[members\]\])", text)]
    last_member = [m.end() for m in re.finditer(r"(?ms)^\[\[members\]\].*?(?=^\[|\Z)", text)]
    at = last_member[-1] if last_member else (idx[0] if idx else len(text))
    text = text[:at] + member + text[at:]
    os.makedirs(os.path.join(DIR, f"node-{k}"), exist_ok=True)
    with open(os.path.join(DIR, f"node-{k}", "broker.toml"), "w") as f:
        f.write(text)


def request(method, addr, path, timeout=120):
    """`method path` on admin `addr`, following the 307 of a node that is not (or no longer)
    the leader (urllib follows none for DELETE or POST)."""
    url = f"http://{addr}{path}"
    for _ in range(5):
        req = urllib.request.Request(url, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read().decode()
        except urllib.error.HTTPError as e:
            if e.code != 307 or not e.headers.get("Location"):
                raise SystemExit(f"{method} {url}: {e.code} {e.read().decode().strip()}")
            url = e.headers["Location"]
    raise SystemExit(f"{method} {path}: too many redirects")


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


def summary(name, values):
    ms = [v * 1000 for v in values]
    print(f"{name}: runs {len(ms)}, p50 {statistics.median(ms):.0f} ms, "
          f"p90 {pct(ms, 0.9):.0f} ms, max {max(ms):.0f} ms", flush=True)


def paced_start(tag, through=None):
    """Starts a paced strong producer and a consumer (bmqctl bench messages) through nodes
    `through` (default 1-3) for 4 s; returns the process (its stdout is the JSON report)."""
    if not PACED:
        return None
    through = through or NODES
    return subprocess.Popen(
        [os.path.join(BIN, "bmqctl"), "bench", "messages", "--rate", str(PACED),
         "--duration-secs", "4", "--queues", "1", "--producers", "1", "--consumers", "1",
         "--queue-prefix", f"paced-{tag}", "--broker", ",".join(client(i) for i in through),
         "--no-tls", "--token", "", "--json", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def paced_gap(proc):
    """The paced run's longest gap between two ACKs, ms (None without PACED)."""
    if proc is None:
        return None
    out, _ = proc.communicate(timeout=120)
    report = json.loads(out)
    if report["missing"] or report["nacks"] or report["errors"]:
        raise SystemExit(f"paced run lost or refused messages: {report}")
    return report["ack_gap_max_ms"]


def members_now(via):
    """The ids of the committed membership, as node `via` holds it."""
    doc = status(via, timeout=2)
    return sorted(m["node_id"] for m in doc["membership"]["members"])


def wait_leader_among(ids, timeout=60):
    """The leader every node of `ids` follows, once they agree and are ready."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        docs = [status(i) for i in ids]
        if all(d and d["ready"] for d in docs):
            leaders = {d["elector"]["leader"] for d in docs}
            if len(leaders) == 1 and None not in leaders:
                return leaders.pop()
        time.sleep(0.05)
    raise SystemExit(f"nodes {ids} did not settle")


def leader_runs():
    """REMOVE_LEADER: a removed leader against a killed one (see the module doc)."""
    gaps = {"remove leader": [], "SIGKILL leader": []}
    for run in range(RUNS):
        k = 4 + run
        new_node_config(k)
        start(k)
        alive = members_now(wait_leader_among(
            [i for i in procs if procs[i].poll() is None and i != k]))
        lead = wait_leader_among(alive)
        # The next change waits until every partition healed under the current voters (the
        # last run's failover): the leader answers 503 until then.
        deadline = time.time() + 60
        while not all(p["status"] == "active" for p in (status(lead, 2) or {}).get("partitions", [{"status": ""}])):
            if time.time() > deadline:
                doc = status(lead, 2) or {}
                raise SystemExit(f"partitions did not heal: leader {lead}: "
                                 f"{[(p['partition_id'], p['primary'], p['status']) for p in doc.get('partitions', [])]}")
            time.sleep(0.05)
        while status(k) is None:
            time.sleep(0.02)
        path = (f"/admin/members?id={k}&host=127.0.0.1&client_port={BASE_PORT + k}"
                f"&peer_port={BASE_PORT + 100 + k}&admin_port={BASE_PORT + 200 + k}"
                "&timeout_ms=110000")
        answer = request("POST", admin(lead), path)
        if "promoted to voter" not in answer:
            raise SystemExit(f"run {run}: add answered {answer!r}")
        members = members_now(lead)
        lead = wait_leader_among(members)
        paced = paced_start(f"rm-leader-{run}", members)
        time.sleep(1.5)
        answer = request("DELETE", admin(lead), f"/admin/members/{lead}?timeout_ms=60000")
        if "removed" not in answer:
            raise SystemExit(f"run {run}: removing leader {lead} answered {answer!r}")
        gaps["remove leader"].append(paced_gap(paced))
        procs[lead].wait(timeout=20)
        members = [m for m in members if m != lead]
        lead = wait_leader_among(members)
        paced = paced_start(f"kill-leader-{run}", members)
        time.sleep(1.5)
        procs[lead].kill()
        procs[lead].wait()
        gaps["SIGKILL leader"].append(paced_gap(paced))
        start(lead)
        wait_leader_among(members)
        print(f"run {run}: longest ACK gap at {PACED} msg/s: remove leader "
              f"{gaps['remove leader'][-1]:.1f} ms, SIGKILL leader "
              f"{gaps['SIGKILL leader'][-1]:.1f} ms", flush=True)
    print(f"load average: {os.getloadavg()}")
    for name, values in gaps.items():
        summary(f"longest ACK gap at {PACED} msg/s, {name}", [v / 1000 for v in values])


def main():
    write_configs()
    for i in NODES:
        start(i)
    added, removed = [], []
    gaps = {"none": [], "add": [], "remove": []}
    try:
        lead = leader()
        if PREFILL:
            t0 = time.monotonic()
            subprocess.run(
                [os.path.join(BIN, "bmqctl"), "bench", "metadata", "--queues", str(PREFILL),
                 "--parallel", "64", "--broker", client(lead), "--no-tls", "--token", "",
                 "--quiet"], check=True, stdout=subprocess.DEVNULL)
            print(f"prefill: {PREFILL} queues in {time.monotonic() - t0:.1f} s", flush=True)
        if OUTSTANDING_MIB:
            t0 = time.monotonic()
            subprocess.run(
                [os.path.join(BIN, "bmqctl"), "bench", "messages", "--consumers", "0",
                 "--queues", "8", "--producers", "8", "--size", "65536",
                 "--count", str(OUTSTANDING_MIB * 16), "--queue-prefix", "outstanding",
                 "--broker", ",".join(client(i) for i in NODES), "--no-tls", "--token", "",
                 "--quiet"], check=True, stdout=subprocess.DEVNULL)
            print(f"outstanding: {OUTSTANDING_MIB} MiB in {time.monotonic() - t0:.1f} s",
                  flush=True)
        if os.environ.get("REMOVE_LEADER") == "1":
            leader_runs()
            return
        for run in range(RUNS):
            k = 4 + run
            new_node_config(k)
            start(k)
            lead = leader()
            # The leader asks the joiner's /status first: wait until it answers.
            deadline = time.time() + 30
            while status(k) is None:
                if time.time() > deadline:
                    raise SystemExit(f"node {k} did not start")
                time.sleep(0.02)
            path = (f"/admin/members?id={k}&host=127.0.0.1&client_port={BASE_PORT + k}"
                    f"&peer_port={BASE_PORT + 100 + k}&admin_port={BASE_PORT + 200 + k}"
                    "&timeout_ms=110000")
            if PACED:
                gaps["none"].append(paced_gap(paced_start(f"none-{run}")))
            paced = paced_start(f"add-{run}")
            time.sleep(1.5 if paced else 0)
            t0 = time.monotonic()
            answer = request("POST", admin(lead), path)
            added.append(time.monotonic() - t0)
            if "promoted to voter" not in answer:
                raise SystemExit(f"run {run}: add answered {answer!r}")
            gap_add = paced_gap(paced)
            lead = leader()
            paced = paced_start(f"remove-{run}")
            time.sleep(1.5 if paced else 0)
            t0 = time.monotonic()
            answer = request("DELETE", admin(lead), f"/admin/members/{k}?timeout_ms=60000")
            removed.append(time.monotonic() - t0)
            if "removed" not in answer:
                raise SystemExit(f"run {run}: remove answered {answer!r}")
            gap_remove = paced_gap(paced)
            procs[k].wait(timeout=20)
            line = (f"run {run}: node {k} voter after {added[-1] * 1000:.0f} ms, removed after "
                    f"{removed[-1] * 1000:.0f} ms")
            if PACED:
                gaps["add"].append(gap_add)
                gaps["remove"].append(gap_remove)
                line += (f"; longest ACK gap at {PACED} msg/s: none {gaps['none'][-1]:.1f} ms, "
                         f"add {gap_add:.1f} ms, remove {gap_remove:.1f} ms")
            print(line, flush=True)
        print(f"load average: {os.getloadavg()}")
        held = f"{PREFILL} queues, {OUTSTANDING_MIB} MiB outstanding"
        summary(f"add-member -> voter ({held})", added)
        summary(f"remove-member -> removed ({held})", removed)
        for name, values in gaps.items():
            if values:
                summary(f"longest ACK gap at {PACED} msg/s, {name}", [v / 1000 for v in values])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
