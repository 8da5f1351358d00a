#!/usr/bin/env bash
# The data path with the duplicate window full (docs/bench/JOURNAL.md "The duplicate window
# full"): one or more release builds side by side, alternating, on a fresh local 3-node cluster
# per run. Each run first sends WARM (1,050,000) messages to one queue, so that the window of
# its partition holds its bound (duplicate_guid_window_max, 1,000,000 by default) on every
# node, then COUNT (400,000) more to the same queue (1 producer / 1 consumer, 1 KiB, strong,
# window 256, client on any node; paced at RATE msgs/s when RATE is set, else as fast as it
# goes) while `perf record` samples the brokers (cpu-clock, 499 Hz, no call graphs). It prints
# msgs/s of the measured part, the brokers' CPU per message (utime + stime,
# /proc/<pid>/stat) and the share of the brokers' samples in the window's and the
# index's tables (symbols of guid_window, guid_index, position_table, bucket_table and
# hashbrown's tables), with the four largest. `scripts/bench-throughput.sh` never fills the
# window (300,000 messages): this measures the steady state a long-running cluster is in.
#
#   scripts/bench-full-window.sh                          # this tree's release build
#   scripts/bench-full-window.sh /tmp/before /tmp/after   # release directories to compare
#   ROUNDS=3 WARM=1050000 COUNT=400000 scripts/bench-full-window.sh ...
#   RATE=50000 scripts/bench-full-window.sh ...         # the measured part paced
#
# Installs `perf` when missing (apt-get, root). Compare builds made the same way (docs/bench/JOURNAL.md,
# "The targets on a faster host").
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
WARM=${WARM:-1050000}
COUNT=${COUNT:-400000}
RATE=${RATE:-0}
BASE=${BASE_PORT:-35800}
DIR=${DIR:-/tmp/bmq-bench-full-window}
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
release_builds "$@"
need_perf
trap stop_cluster EXIT
trap 'exit 130' INT TERM
TABLES='guid_window|guid_index|position_table|bucket_table|GuidWindow|GuidIndex|PositionTable|BucketTable|hashbrown::raw|hashbrown::table'

echo "# bench-full-window $(date -u +%FT%TZ), load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# builds: ${BUILDS[*]}; warm-up $WARM messages, measured $COUNT at rate $RATE (0: unpaced), one queue"
for round in $(seq "$ROUNDS"); do
  for bin in "${BUILDS[@]}"; do
    start_cluster "$bin"
    # One queue for both parts (a fixed run id), so the measured part finds its window full.
    bench_load "$bin" messages "$WARM" --queue-prefix bench-fw --run-id b8 >/dev/null
    c0=$(broker_cpu_ms)
    perf record -e cpu-clock -F 499 -p "$(IFS=,; echo "${PIDS[*]}")" -o "$DIR.perf" 2>/dev/null &
    rec=$!
    t0=$(date +%s.%N)
    bench_load "$bin" messages "$COUNT" --queue-prefix bench-fw --run-id b8 --rate "$RATE" >/dev/null
    t1=$(date +%s.%N)
    kill -INT "$rec"
    wait "$rec" || true
    c1=$(broker_cpu_ms)
    stop_cluster
    perf report -i "$DIR.perf" --no-children --sort symbol --stdio 2>/dev/null \
      | grep -E '^ +[0-9.]+%' | grep -E "$TABLES" >"$DIR.tables" || true
    python3 - "$round" "$bin" "$COUNT" "$t0" "$t1" "$((c1 - c0))" "$DIR.tables" <<'PY'
import sys
round_, bin_, n, t0, t1, cpu_ms, tables = sys.argv[1:]
n = int(n)
rows = [line.split() for line in open(tables)]
share = sum(float(r[0].rstrip("%")) for r in rows)
top = "; ".join(f"{r[0]} {r[2].split('::', 1)[-1]}" for r in rows[:4])
print(f"round {round_}  {bin_:<32} {n / (float(t1) - float(t0)):8.0f} msgs/s  "
      f"broker {int(cpu_ms) * 1000 / n:5.1f} us/msg  tables {share:5.2f}%  [{top}]")
PY
  done
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
