#!/usr/bin/env bash
# Replication simulator soak (issue 16, docs/REPLICATION_VERIFICATION.md): runs
# dataplane/tests/replication_sim.rs over many seeds in a release build — real Partitions over
# real Stores on a simulated network and disk (loss, duplication, delays, crashes with torn
# writes, power losses, primary moves, graceful stops, consumers that come and go), every
# invariant checked at every event, then a liveness phase. CI runs 100 seeds per cluster size.
#
# Usage: scripts/soak-replication-sim.sh [--seeds N] [--start S] [--defects]
#   --seeds    seeds per cluster size, 3 and 5 nodes (default 1000000)
#   --start    first seed (default 1)
#   --defects  instead: put each old defect back (feature defect-injection) and report the
#              first seed that finds it and how long that took
# Both cluster sizes run at once (one per core). Every failing seed is printed with the command
# that replays it; the exit status is non-zero if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."

seeds=1000000
start=1
defects=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seeds) seeds="$2"; shift 2 ;;
    --start) start="$2"; shift 2 ;;
    --defects) defects=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "soak-replication-sim: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

t0=$(date +%s)
if [[ $defects == 1 ]]; then
  REPLICATION_SIM_SEEDS="$seeds" REPLICATION_SIM_FIRST_SEED="$start" \
    cargo test --release -p bmq-dataplane --features defect-injection --test replication_sim \
    -- defects_are_found --nocapture 2>&1 | grep -E '^defect|test result|was not found'
  exit "${PIPESTATUS[0]}"
fi
echo "replication simulator: seeds $start..$((start + seeds - 1)) for 3 and for 5 nodes"
set +e
REPLICATION_SIM_SEEDS="$seeds" REPLICATION_SIM_FIRST_SEED="$start" \
  cargo test --release -p bmq-dataplane --test replication_sim -- --test-threads 2 three_nodes five_nodes \
  2>&1 | grep -E '^seed [0-9]+ \(|seeds failed|seeds \(|replay:|test result'
status=${PIPESTATUS[0]}
set -e
elapsed=$(( $(date +%s) - t0 ))
echo "replication simulator: $((2 * seeds)) seeds in ${elapsed} s ($(awk -v n=$((2 * seeds)) -v s=$elapsed 'BEGIN {printf "%.1f", n / (s > 0 ? s : 1)}') seeds/s)"
exit "$status"
