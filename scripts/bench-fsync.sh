#!/usr/bin/env bash
# What a journal fsync costs: for one or more release builds, alternating, a fresh
# local 3-node cluster (plain TCP), a warm-up past the first segment's roll-over (WARMUP,
# 40,000 messages), then COUNT (200,000) messages, 1 producer / 1 consumer, 1 KiB, strong,
# window 256, the client on the node list.
# Printed per build and round, over the measured messages only (three nodes together):
#   fdatasync calls (syscalls:sys_enter_fdatasync of the broker processes);
#   block requests issued per fdatasync (block:block_rq_issue, the writes and the cache flush);
#   the mean fsync time, µs, and the fsyncs over 10 ms (bmq_journal_fsync_seconds of every
#   node's /metrics: sum / count, and the count above the 10 ms bucket);
#   msgs/s and broker CPU µs per message, for what they are worth beside the counts.
#
#   scripts/bench-fsync.sh                         # this tree's release build
#   ROUNDS=3 scripts/bench-fsync.sh /tmp/before /tmp/after
#
# Needs root. Installs `perf` (Debian's linux-perf, apt-get) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
COUNT=${COUNT:-200000}
WARMUP=${WARMUP:-40000}
BASE=${BASE_PORT:-39900}
DIR=${DIR:-/tmp/bmq-bench-fsync}
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
need_perf
release_builds "$@"
trap 'stop_cluster; [ -n "${STAT:-}" ] && kill "$STAT" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
mkdir -p "$DIR.out"

# fsync_sum_count: "sum count fast" of bmq_journal_fsync_seconds over the three nodes (fast:
# the fsyncs of 10 ms or less).
fsync_sum_count() {
  local node
  for node in 1 2 3; do
    curl -s "http://127.0.0.1:$((BASE + 200 + node))/metrics"
  done | awk '/^bmq_journal_fsync_seconds_sum/ {s += $2} /^bmq_journal_fsync_seconds_count/ {c += $2}
    /^bmq_journal_fsync_seconds_bucket\{le="0.01"\}/ {f += $2} END {printf "%.9f %d %d\n", s, c, f}'
}

echo "# bench-fsync $(date -u +%FT%TZ); load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# builds: ${BUILDS[*]}; WARMUP=$WARMUP COUNT=$COUNT"
printf "%-28s %5s %10s %12s %14s %12s %9s %9s\n" build round fdatasync "blk_rq/sync" "mean fsync us" "over 10 ms" "msgs/s" "us/msg"
for round in $(seq 1 "$ROUNDS"); do
  for bin in "${BUILDS[@]}"; do
    start_cluster "$bin"
    bench_load "$bin" messages "$WARMUP" >/dev/null
    read -r s0 n0 f0 < <(fsync_sum_count)
    c0=$(broker_cpu_ms)
    perf stat -x, -e syscalls:sys_enter_fdatasync,block:block_rq_issue \
      -p "$(IFS=,; echo "${PIDS[*]}")" -o "$DIR.out/stat.txt" &
    STAT=$!
    sleep 0.5
    out=$(bench_load "$bin" messages "$COUNT" --json)
    kill -INT "$STAT"; wait "$STAT" || true
    STAT=
    c1=$(broker_cpu_ms)
    read -r s1 n1 f1 < <(fsync_sum_count)
    stop_cluster
    python3 - "$bin" "$round" "$DIR.out/stat.txt" "$s0" "$n0" "$s1" "$n1" "$(( (n1 - f1) - (n0 - f0) ))" "$((c1 - c0))" "$out" <<'PY'
import json, sys
bin_, rnd, stat, s0, n0, s1, n1, slow, cpu_ms, out = sys.argv[1:]
ev = {}
for line in open(stat):
    f = line.strip().split(",")
    if len(f) > 2 and f[0].replace(".", "").isdigit():
        ev[f[2]] = float(f[0])
sync = ev.get("syscalls:sys_enter_fdatasync", 0)
rq = ev.get("block:block_rq_issue", 0)
n = int(n1) - int(n0)
mean = (float(s1) - float(s0)) / n * 1e6 if n else 0
r = json.loads(out[out.index("{"):])
msgs = max(r["consumed"]["messages"], 1)
print(f"{bin_[-28:]:28} {rnd:>5} {sync:10.0f} {rq / max(sync, 1):12.2f} {mean:14.0f} {int(slow):12d} {r['consumed']['msgs_per_sec']:9.0f} {int(cpu_ms) / 1000 / msgs * 1e6:9.1f}")
PY
  done
done
echo "# load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
