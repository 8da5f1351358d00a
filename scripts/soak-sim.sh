#!/usr/bin/env bash
# Simulator soaks (DESIGN.md §10.2): one deterministic simulator over many seeds, in a release
# build. A failing seed is printed with the command that replays it; the exit status is non-zero.
#
# Usage: scripts/soak-sim.sh SIMULATOR [--seeds N] [--start S] [OPTION]
#
#   elector      (figures in docs/ELECTOR_VERIFICATION.md)
#     1. the simulator tests/tests/elector_sim.rs — real Elector cores (3, 4 or 5 nodes, from
#        the seed) on a simulated network with loss, duplication, reordering, partitions, pair
#        and one-way cuts, crashes and restarts; every invariant after every step, then a
#        liveness phase. CI runs 300 seeds;
#     2. the two larger-bound exhaustive model checks of tests/tests/elector_model.rs
#        (stateright, three real cores, every interleaving within the bounds it prints; about
#        16 minutes on 2 cores, 0.7 GB of memory). A failing model check prints its
#        counterexample.
#     --seeds     simulator seeds (default 100000, under a minute)
#     --start     first seed (default 0)
#     --no-model  skip the model checks
#     The model's bounds can be changed with BMQ_MODEL_MAX_TERM, BMQ_MODEL_CRASHES,
#     BMQ_MODEL_CESSIONS and BMQ_MODEL_MISS_COUNT (see elector_model.rs).
#
#   metadata     tests/tests/metadata_sim.rs — real MetadataCores and real ledgers on a
#                simulated network and disk (loss, duplication, delay, isolation, crashes with
#                torn writes, power losses, failing fsyncs), every invariant checked after
#                every event, then a liveness phase. CI runs 40 seeds for 3 nodes and 20 for 5.
#     --seeds     seeds for 3 nodes; 5 nodes run half as many (default 5000)
#     --start     first seed (default 0)
#
#   replication  (docs/REPLICATION_VERIFICATION.md) dataplane/tests/replication_sim.rs — real
#                Partitions over real Stores on a simulated network and disk (loss,
#                duplication, delays, crashes with torn writes, power losses, primary moves,
#                graceful stops, consumers that come and go), every invariant checked at every
#                event, then a liveness phase. CI runs 100 seeds per cluster size. Both cluster
#                sizes run at once (one per core); every failing seed is printed.
#     --seeds     seeds per cluster size, 3 and 5 nodes (default 500000: 10^6 seeds, a
#                 night's run at about 40 seeds per second on two cores)
#     --start     first seed (default 1)
#     --defects   instead: put each old defect back (feature defect-injection) and report the
#                 first seed that finds it and how long that took
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d'; }

sim=${1:-}
case "$sim" in
  elector) seeds=100000; start=0 ;;
  metadata) seeds=5000; start=0 ;;
  replication) seeds=500000; start=1 ;;
  -h|--help) usage; exit 0 ;;
  *) echo "soak-sim: the first argument is the simulator: elector, metadata or replication (see --help)" >&2; exit 2 ;;
esac
shift
model=1
defects=0
while [[ $# -gt 0 ]]; do
  case "$sim:$1" in
    *:--seeds) seeds="$2"; shift 2 ;;
    *:--start) start="$2"; shift 2 ;;
    elector:--no-model) model=0; shift ;;
    replication:--defects) defects=1; shift ;;
    *:-h|*:--help) usage; exit 0 ;;
    *) echo "soak-sim $sim: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

elector() {
  echo "elector simulator: seeds $start..$((start + seeds))"
  t0=$(date +%s)
  BMQ_SIM_SEEDS="$seeds" BMQ_SIM_SEED_START="$start" \
    cargo test --release -p bmq-tests --test elector_sim -- --ignored --exact soak --nocapture
  echo "elector simulator: passed in $(( $(date +%s) - t0 )) s"

  if [[ "$model" == 1 ]]; then
    echo "elector model check: larger bounds (cold start; after a stable leader)"
    t0=$(date +%s)
    # One at a time: each checker already uses every core.
    cargo test --release -p bmq-tests --test elector_model -- \
      --ignored --test-threads 1 within_larger_bounds --nocapture
    echo "elector model check: passed in $(( $(date +%s) - t0 )) s"
  fi
}

metadata() {
  echo "metadata simulator: seeds $start..$((start + seeds)) (3 nodes), $start..$((start + seeds / 2)) (5 nodes, and 3 nodes + 2 spares with membership changes)"
  t0=$(date +%s)
  METADATA_SIM_SEEDS="$seeds" METADATA_SIM_START_SEED="$start" \
    cargo test --release -p bmq-tests --test metadata_sim -- seeds_ --nocapture
  echo "metadata simulator: passed in $(( $(date +%s) - t0 )) s"
}

replication() {
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
  local status=${PIPESTATUS[0]}
  set -e
  local elapsed=$(( $(date +%s) - t0 ))
  echo "replication simulator: $((2 * seeds)) seeds in ${elapsed} s ($(awk -v n=$((2 * seeds)) -v s=$elapsed 'BEGIN {printf "%.1f", n / (s > 0 ? s : 1)}') seeds/s)"
  exit "$status"
}

"$sim"
