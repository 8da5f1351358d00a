#!/usr/bin/env bash
# Metadata A/B benchmark (docs/bench/JOURNAL.md "Metadata without thread hand-offs"): one or
# more release builds side by side, alternating, on a fresh local 3-node cluster per run
# (plain TCP, metadata fsync on every record). Each run: a warm-up of 200 assignments, then
# N queue assignments (`bmqctl bench metadata`: an open of a never-opened queue, then its
# close), PARALLEL (1) in flight, the client on the elector leader. Printed per run: the open
# latency percentiles, and for the three broker processes together, per assignment, their CPU
# time (utime + stime, /proc/<pid>/stat) and their threads' context switches (voluntary and
# not, /proc/<pid>/task/*/status), each read before and after the run. With one build's
# machine load varying by tens of percent between minutes, compare builds within a round.
#
#   scripts/bench-metadata-ab.sh                                # this tree's release build
#   scripts/bench-metadata-ab.sh /tmp/before /tmp/after         # release directories to compare
#   ROUNDS=6 N=3000 scripts/bench-metadata-ab.sh /tmp/before /tmp/after
#   PARALLEL=64 N=20000 scripts/bench-metadata-ab.sh /tmp/before /tmp/after
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
N=${N:-3000}
PARALLEL=${PARALLEL:-1}
BASE=${BASE_PORT:-34700}
DIR=${DIR:-/tmp/bmq-bench-metadata-ab}
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
release_builds "$@"
trap stop_cluster EXIT
trap 'exit 130' INT TERM

echo "# $(date -u +%FT%TZ) N=$N PARALLEL=$PARALLEL ROUNDS=$ROUNDS; builds: ${BUILDS[*]}"
for round in $(seq "$ROUNDS"); do
  for bin in "${BUILDS[@]}"; do
    start_cluster "$bin"
    PARALLEL=1 bench_load "$bin" metadata 200 >/dev/null
    cpu0=$(broker_cpu_ms)
    ctx0=$(broker_context_switches)
    out=$(PARALLEL=$PARALLEL bench_load "$bin" metadata "$N" | grep -E "^open")
    cpu1=$(broker_cpu_ms)
    ctx1=$(broker_context_switches)
    stop_cluster
    echo "round $round $bin: $out | CPU $(((cpu1 - cpu0) * 1000 / N)) us/assignment," \
      "context switches $(awk -v d=$((ctx1 - ctx0)) -v n="$N" 'BEGIN {printf "%.1f", d / n}')/assignment," \
      "load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
