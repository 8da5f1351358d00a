#!/usr/bin/env bash
# Metadata simulator soak (issue 4, DESIGN.md §10.2): runs tests/tests/metadata_sim.rs over many
# seeds in a release build — real MetadataCores and real ledgers on a simulated network and disk
# (loss, duplication, delay, isolation, crashes with torn writes, power losses), every invariant
# checked after every event, then a liveness phase. CI runs 40 seeds for 3 nodes and 20 for 5.
#
# Usage: scripts/soak-metadata-sim.sh [--seeds N] [--start S]
#   --seeds  seeds per cluster size for 3 nodes; 5 nodes run half as many (default 5000)
#   --start  first seed (default 0)
# A failing seed is printed with the command that replays it; the exit status is non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

seeds=5000
start=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seeds) seeds="$2"; shift 2 ;;
    --start) start="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "soak-metadata-sim: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

echo "metadata simulator: seeds $start..$((start + seeds)) (3 nodes), $start..$((start + seeds / 2)) (5 nodes)"
t0=$(date +%s)
METADATA_SIM_SEEDS="$seeds" METADATA_SIM_START_SEED="$start" \
  cargo test --release -p bmq-tests --test metadata_sim -- seeds_ --nocapture
echo "metadata simulator: passed in $(( $(date +%s) - t0 )) s"
