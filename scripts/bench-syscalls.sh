#!/usr/bin/env bash
# System calls per message of the three brokers together, by thread name and call:
# a fresh local 3-node cluster (plain TCP), a warm-up, then `perf trace -s` of the three broker
# processes while COUNT (100,000) messages go through, 1 producer / 1 consumer, 1 KiB, strong,
# window 256, the client on the node list. A count, but batching makes it depend on the load:
# the slower the machine, the more each call carries, so compare builds within one run.
# `perf trace` slows every call down, so the rate it prints is not a throughput figure.
#
#   scripts/bench-syscalls.sh                  # this tree's release build
#   scripts/bench-syscalls.sh /tmp/build       # a release directory made elsewhere
#
# Needs root. Installs `perf` (Debian's linux-perf, apt-get) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT=${COUNT:-100000}
BASE=${BASE_PORT:-39700}
DIR=${DIR:-/tmp/bmq-bench-syscalls}
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
need_perf
release_builds "$@"
bin=${BUILDS[0]}
trap 'stop_cluster; [ -n "${TRACE:-}" ] && kill "$TRACE" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
mkdir -p "$DIR.out"
echo "# bench-syscalls $(date -u +%FT%TZ) $bin COUNT=$COUNT; load average $(cut -d' ' -f1-3 /proc/loadavg)"
start_cluster "$bin"
bench_load "$bin" messages 20000 >/dev/null
perf trace -s -p "$(IFS=,; echo "${PIDS[*]}")" -o "$DIR.out/trace.txt" &
TRACE=$!
sleep 1
bench_load "$bin" messages "$COUNT" | grep -E '^(sent|produced|consumed)' || true
sleep 0.3
kill -INT "$TRACE"; wait "$TRACE" || true
TRACE=
# perf trace -s: per thread a line "comm (tid), N events, P%", then one line per call.
awk -v n="$COUNT" '
  /^ .* \([0-9]+\), [0-9]+ events/ {
    comm = $0; sub(/^ +/, "", comm); sub(/ \([0-9]+\),.*/, "", comm)
    sub(/^bmq-sync-[0-9]+$/, "bmq-sync", comm); sub(/^actix-rt\|system$/, "partition (actix-rt|system)", comm)
    if (comm == "broker") comm = "main (broker)"
    next
  }
  comm != "" && $1 ~ /^[a-z_0-9]+$/ && $2 ~ /^[0-9]+$/ { calls[comm] += $2; by[comm, $1] += $2; total += $2 }
  END {
    printf "%-32s %10s   %s\n", "thread (three nodes)", "calls/msg", "largest"
    for (c in calls) {
      line = ""
      for (k in by) { split(k, p, SUBSEP); if (p[1] == c && by[k] / n >= 0.001) line = line sprintf(" %s %.3f", p[2], by[k] / n) }
      printf "%-32s %10.3f  %s\n", c, calls[c] / n, line
    }
    printf "%-32s %10.3f\n", "all", total / n
  }' "$DIR.out/trace.txt"
