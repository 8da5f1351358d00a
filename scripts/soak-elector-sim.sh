#!/usr/bin/env bash
# Elector soak (issue 3, DESIGN.md §10.2; figures in docs/ELECTOR_VERIFICATION.md), in a release
# build:
#  1. the deterministic simulator tests/tests/elector_sim.rs over many seeds — real Elector cores
#     (3, 4 or 5 nodes, from the seed) on a simulated network with loss, duplication, reordering,
#     partitions, pair and one-way cuts, crashes and restarts; every invariant after every step,
#     then a liveness phase. CI runs 300 seeds;
#  2. the two larger-bound exhaustive model checks of tests/tests/elector_model.rs (stateright,
#     three real cores, every interleaving within the bounds it prints; about 16 minutes on 2
#     cores, 0.7 GB of memory).
#
# Usage: scripts/soak-elector-sim.sh [--seeds N] [--start S] [--no-model]
#   --seeds     simulator seeds (default 100000, under a minute)
#   --start     first seed (default 0)
#   --no-model  skip the model checks
# The model's bounds can be changed with BMQ_MODEL_MAX_TERM, BMQ_MODEL_CRASHES,
# BMQ_MODEL_CESSIONS and BMQ_MODEL_MISS_COUNT (see elector_model.rs).
# A failing seed is printed with the command that replays it, a failing model check with its
# counterexample; the exit status is non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

seeds=100000
start=0
model=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seeds) seeds="$2"; shift 2 ;;
    --start) start="$2"; shift 2 ;;
    --no-model) model=0; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "soak-elector-sim: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

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
