#!/usr/bin/env bash
# Heap allocations per operation of the three brokers together (docs/bench/JOURNAL.md "Fewer
# allocations per message"): a count, not a time, so it does not move with this machine's load.
# For each build, alternating ROUNDS times: a fresh local 3-node cluster (plain TCP), a warm-up,
# then `perf stat` of uprobes on libc's malloc and realloc in the three broker processes while
# one fixed-size run goes through:
#   WORKLOAD=messages  COUNT (100,000) messages, 1 producer / 1 consumer, 1 KiB, strong,
#                      window 256, the client on the node list;
#   WORKLOAD=metadata  COUNT (10,000) queue assignments (an open and a close each), PARALLEL
#                      (64) in flight, the client on the elector leader.
# Printed per run: mallocs and reallocs per operation (a few come from the brokers' timers
# and heartbeats during the run, not from the operations).
#
#   scripts/bench-allocs.sh                              # this tree's release build
#   scripts/bench-allocs.sh /tmp/before /tmp/after       # release directories to compare
#   WORKLOAD=metadata ROUNDS=3 scripts/bench-allocs.sh /tmp/before /tmp/after
#
# Needs root (uprobes). Installs `perf` (Debian's linux-perf, apt-get) when missing. Where a
# call comes from: `perf record -e probe_libc:malloc -g` of a frame-pointer build
# (RUSTFLAGS="-C force-frame-pointers=yes"), folded with inferno as in profile-flamegraph.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKLOAD=${WORKLOAD:-messages}
ROUNDS=${ROUNDS:-2}
BASE=${BASE_PORT:-38700}
DIR=${DIR:-/tmp/bmq-bench-allocs}
case $WORKLOAD in
  messages) COUNT=${COUNT:-100000}; WARMUP=20000; unit=message ;;
  metadata) COUNT=${COUNT:-10000}; WARMUP=1000; unit=assignment ;;
  *) echo "WORKLOAD is messages or metadata" >&2; exit 2 ;;
esac
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
need_perf
LIBC=$(ldconfig -p | awk '/libc\.so\.6 .*x86-64/ {print $NF; exit}')
for fn in malloc realloc; do
  perf probe -l 2>/dev/null | grep -q "probe_libc:$fn " \
    || perf probe -q -x "$LIBC" --add "$fn" >/dev/null
done
release_builds "$@"
trap 'stop_cluster; [ -n "${STAT:-}" ] && kill "$STAT" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
mkdir -p "$DIR.out"
echo "# bench-allocs $(date -u +%FT%TZ) WORKLOAD=$WORKLOAD COUNT=$COUNT ROUNDS=$ROUNDS; load average $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$ROUNDS"); do
  for bin in "${BUILDS[@]}"; do
    start_cluster "$bin"
    bench_load "$bin" "$WORKLOAD" "$WARMUP" >/dev/null
    out=$DIR.out/stat.txt
    perf stat -x, -e probe_libc:malloc -e probe_libc:realloc \
      -p "$(IFS=,; echo "${PIDS[*]}")" -o "$out" &
    STAT=$!
    sleep 0.5
    bench_load "$bin" "$WORKLOAD" "$COUNT" >"$DIR.out/run.txt"
    kill -INT "$STAT"; wait "$STAT" || true
    STAT=
    awk -F, -v r="$round" -v b="$bin" -v n="$COUNT" -v u="$unit" '
      /probe_libc:malloc/ {m = $1 / n} /probe_libc:realloc/ {re = $1 / n}
      END {printf "round %d %-28s mallocs %.2f, reallocs %.2f per %s\n", r, b, m, re, u}' "$out"
    stop_cluster
  done
done
