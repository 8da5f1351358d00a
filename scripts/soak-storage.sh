#!/usr/bin/env bash
# Storage soak (docs/bench/JOURNAL.md "Storage for months"): memory and disk of every node of a
# local 3-node cluster (release build, plain TCP, strong consistency) while many messages pass,
# while many stay outstanding, across a restart, and while they drain.
#
#   scripts/soak-storage.sh                                   # 10,000,000 passed, 1,000,000 outstanding
#   MESSAGES=300000 OUTSTANDING=50000 scripts/soak-storage.sh # a short run
#   BIN=/path/to/release scripts/soak-storage.sh              # another build (no cargo build)
#   BASE_PORT=42000 scripts/soak-storage.sh                   # ports 42001.. (default 34100)
#   HOLD_SECS=60 scripts/soak-storage.sh                      # hold the outstanding state longer
#
# Phases (the PNG marks where each begins):
#   flow         `bmqctl bench messages --count $MESSAGES --size $SIZE` (1 producer, 1 consumer);
#   outstanding  `bmqctl produce` of $OUTSTANDING messages to a queue nobody consumes;
#   restart      node 1 is killed (SIGKILL) and started again: seconds until it is ready
#                (`bmqctl ready`: it follows the leader and has opened every journal), and the
#                journal open time from its log;
#   drain        `bmqctl consume` of the outstanding messages (each checked and confirmed);
#   idle         20 s more, to show what the disk comes back to.
# A sampler writes `elapsed_s,phase,node,rss_bytes,journal_bytes` every second into
# $OUT/samples.csv (RSS from /proc/<pid>/status, journal = bytes under the node's partitions
# directory); $OUT/summary.txt has the per-phase maxima and results, and every node's VmHWM
# (peak RSS since it started, so spikes between two samples count) at the end of the
# outstanding phase and of the run; $OUT/soak.png the plot (scripts/soak-plot, built on demand).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MESSAGES=${MESSAGES:-10000000}
OUTSTANDING=${OUTSTANDING:-1000000}
SIZE=${SIZE:-1024}
OUT=${OUT:-/tmp/bmq-soak-storage}
BASE=${BASE_PORT:-34100}
# Seconds the cluster is left with the messages outstanding before the restart (time to look
# at the nodes: gdb, heaptrack, /proc/<pid>/smaps; the pids are in $OUT/pid-<node>).
HOLD_SECS=${HOLD_SECS:-5}
if [ -z "${BIN:-}" ]; then
  cargo build --release --bins --locked
  BIN=$ROOT/target/release
fi
DIR=$OUT/cluster
BROKERS=127.0.0.1:$((BASE + 1)),127.0.0.1:$((BASE + 2)),127.0.0.1:$((BASE + 3))
CLIENT=(--broker "$BROKERS" --no-tls --token "")
QUEUE=bmq://bmq.test/soak-outstanding
declare -A PIDS=()
SAMPLER=
cleanup() {
  [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null || true
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
rm -rf "$OUT"
mkdir -p "$OUT"

ready() { "$BIN/bmqctl" ready --admin 127.0.0.1:$((BASE + 200 + $1)) >/dev/null 2>&1; }
start_node() {
  "$BIN/broker" --config "$DIR/node-$1/broker.toml" >>"$OUT/node-$1.log" 2>&1 &
  PIDS[$1]=$!
}
phase() { echo "$1" >"$OUT/phase"; echo "== $(date -u +%T) phase $1" | tee -a "$OUT/summary.txt"; }
# Every node's peak RSS since it started (VmHWM: catches spikes shorter than the sampling
# period) and its RSS now.
peaks() {
  for i in 1 2 3; do
    awk -v what="$1" -v node="$i" '/^VmHWM/ {hwm = $2} /^VmRSS/ {rss = $2}
      END {printf "%s: node %s VmHWM %.1f MiB, VmRSS %.1f MiB\n", what, node, hwm / 1024, rss / 1024}' \
      /proc/"$(cat "$OUT/pid-$i")"/status
  done | tee -a "$OUT/summary.txt"
}

# The per-node configuration files (lib/configs.sh); the nodes are run directly so one can be
# killed and restarted and their memory read.
# shellcheck source=lib/configs.sh
. scripts/lib/configs.sh
write_configs "$BIN" "$DIR" "$BASE" >"$OUT/cluster-up.log"
for i in 1 2 3; do start_node $i; done
for _ in $(seq 120); do ready 1 && ready 2 && ready 3 && break; sleep 0.5; done

echo "setup" >"$OUT/phase"
echo "elapsed_s,phase,node,rss_bytes,journal_bytes" >"$OUT/samples.csv"
(
  t0=$(date +%s.%N)
  while true; do
    now=$(date +%s.%N)
    ph=$(cat "$OUT/phase")
    for i in 1 2 3; do
      pid=$(cat "$OUT/pid-$i" 2>/dev/null || true)
      rss=$(awk '/^VmRSS/ {print $2 * 1024}' /proc/"$pid"/status 2>/dev/null || true)
      journal=$(du -sb "$DIR/node-$i/partitions" 2>/dev/null | cut -f1 || true)
      printf '%.1f,%s,%s,%s,%s\n' "$(awk -v a="$now" -v b="$t0" 'BEGIN {print a - b}')" "$ph" "$i" "${rss:-0}" "${journal:-0}"
    done >>"$OUT/samples.csv"
    sleep 1
  done
) &
SAMPLER=$!
for i in 1 2 3; do echo "${PIDS[$i]}" >"$OUT/pid-$i"; done
{
  echo "# soak-storage $(date -u +%FT%TZ): MESSAGES=$MESSAGES OUTSTANDING=$OUTSTANDING SIZE=$SIZE"
  echo "# $(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} >>"$OUT/summary.txt"
sleep 2

phase flow
"$BIN/bmqctl" bench messages --count "$MESSAGES" --size "$SIZE" "${CLIENT[@]}" --quiet --json >"$OUT/flow.json"
python3 - "$OUT/flow.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
p, c, a = r["produced"], r["consumed"], r["ack_latency"]
print(f"flow: produced {p['messages']} at {p['msgs_per_sec']:.0f} msg/s, consumed {c['messages']}, "
      f"ACK p50 {a['p50_us'] / 1000:.1f} ms p99 {a['p99_us'] / 1000:.1f} ms, missing {r['missing']}, "
      f"nacks {r['nacks']}, errors {r['errors']}")
PY

phase outstanding
"$BIN/bmqctl" produce --queue "$QUEUE" --count "$OUTSTANDING" --size "$SIZE" --window 1000 \
  --timeout-secs 3600 "${CLIENT[@]}" --json >"$OUT/outstanding.json"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("outstanding:", {k: r[k] for k in r if k not in ("uri",)})' "$OUT/outstanding.json" | tee -a "$OUT/summary.txt"
echo "hold" >"$OUT/phase.hold"
sleep "$HOLD_SECS"
rm -f "$OUT/phase.hold"
peaks "outstanding (peak since start)"

phase restart
kill -9 "${PIDS[1]}"
wait "${PIDS[1]}" 2>/dev/null || true
sleep 1
t0=$(date +%s.%N)
start_node 1
echo "${PIDS[1]}" >"$OUT/pid-1"
until ready 1; do sleep 0.05; done
t1=$(date +%s.%N)
printf 'restart: node 1 (SIGKILL) ready %.2f s after start\n' "$(awk -v a="$t1" -v b="$t0" 'BEGIN {print a - b}')" | tee -a "$OUT/summary.txt"
# The node logs to the file its configuration names (`[log] file`).
{ grep -a "partition journal opened" "$DIR/node-1/broker.log" || true; } | tail -n "$(ls "$DIR/node-1/partitions" | wc -l)" \
  | sed 's/\x1b\[[0-9;]*m//g; s/^.*partition journal opened /restart: journal opened: /' | tee -a "$OUT/summary.txt"
sleep 5

phase drain
"$BIN/bmqctl" consume --queue "$QUEUE" --count "$OUTSTANDING" --timeout-secs 3600 "${CLIENT[@]}" --json >"$OUT/drain.json"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("drain:", {k: r[k] for k in r if k not in ("uri","producers")})' "$OUT/drain.json" | tee -a "$OUT/summary.txt"

phase idle
sleep 20
peaks "idle (peak since start; node 1 since its restart)"
kill "$SAMPLER"; SAMPLER=

python3 - "$OUT/samples.csv" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
phases = []
for r in rows:
    if r["phase"] not in phases:
        phases.append(r["phase"])
mib = lambda b: int(b) / 1048576
for ph in phases:
    sel = [r for r in rows if r["phase"] == ph]
    for node in sorted({r["node"] for r in sel}):
        n = [r for r in sel if r["node"] == node]
        print(f"{ph:12s} node {node}: RSS max {max(mib(r['rss_bytes']) for r in n):7.1f} MiB, "
              f"journal max {max(mib(r['journal_bytes']) for r in n):8.1f} MiB, last {mib(n[-1]['journal_bytes']):8.1f} MiB")
PY
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/summary.txt"

CARGO_TARGET_DIR=$ROOT/target/soak-plot cargo run --release --quiet --manifest-path "$ROOT/scripts/soak-plot/Cargo.toml" -- \
  "$OUT/samples.csv" "$OUT/soak.png" "soak-storage: $MESSAGES x $SIZE B passed, $OUTSTANDING outstanding, 3 nodes (strong)"
echo "plot: $OUT/soak.png"
