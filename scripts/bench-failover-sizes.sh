#!/usr/bin/env bash
# Every failover figure at 100, 100,000 and 1,000,000 assigned queues, side by side (issue
# "failover flat in the size of the cluster state"; method in scripts/bench_failover.py):
# leader SIGKILL -> first open of a new queue (and of one on a partition whose primary died
# with the leader), leader SIGSTOP -> new leader, node SIGKILL + start -> ready, primary
# SIGKILL -> first ACK. One fresh cluster per size, its queues assigned first (1,000,000 take
# about a minute at 20,000 per second).
#   scripts/bench-failover-sizes.sh                       # 20 runs of every mode at each size
#   RUNS=5 SIZES="100 100000" MODES="open restart" scripts/bench-failover-sizes.sh
#   BIN=/tmp/base/release OUT=/tmp/fo-base scripts/bench-failover-sizes.sh   # another build
# BIN: the build whose broker runs (default: target/release, built here); BMQCTL: the bmqctl
# that drives it (default BIN's; it needs `bench first-open`); RESTART_WIPE_LEDGER=1 (see
# bench_failover.py) lets runs at 1,000,000 queues go on where a node cannot read its ledger. OUT keeps each size's JSON and
# log, and the nodes' logs (info: a line per state change, with timestamps); the table is printed at the end (again: python3 scripts/bench_failover.py table OUT/*.json).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --release --bins --locked
  export BIN=$PWD/target/release
fi
export BIN
SIZES=${SIZES:-100 100000 1000000}
MODES=${MODES:-open silent restart primary}
OUT=${OUT:-/tmp/bmq-failover-sizes}
mkdir -p "$OUT"
echo "$(date -u +%FT%TZ) bin $BIN ($(git rev-parse --short HEAD)), sizes $SIZES, modes $MODES, runs ${RUNS:-20}, load $(cut -d' ' -f1-3 /proc/loadavg)"
files=()
for n in $SIZES; do
  echo "== $n queues"
  # A size whose cluster fails (the harness says why in its JSON) does not stop the others.
  PREFILL=$n RESULTS_JSON="$OUT/$n.json" python3 scripts/bench_failover.py $MODES 2>&1 | tee "$OUT/$n.log" || true
  for i in 1 2 3; do cp "${CLUSTER_DIR_BENCH:-/tmp/bmq-bench-failover}/node-$i/broker.log" "$OUT/$n-node-$i.log" 2>/dev/null || true; done
  [ -f "$OUT/$n.json" ] && files+=("$OUT/$n.json")
done
echo "== $(date -u +%FT%TZ)"
python3 scripts/bench_failover.py table "${files[@]}"
