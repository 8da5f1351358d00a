#!/usr/bin/env bash
# Where the brokers' CPU and context switches go, per thread and per operation: a
# fresh local 3-node cluster (plain TCP), a warm-up, then one measured run; every thread's
# utime + stime and voluntary / involuntary context switches are read from
# /proc/<pid>/task/*/{stat,status} before and after the run and divided by the operations.
#   WORKLOAD=messages  1 producer / 1 consumer, 1 KiB, strong, window 256, COUNT messages
#                      (default 200,000), the client attached to node 1;
#                      with RATE, the producer is paced at RATE msgs/s (`--rate`), and
#                      CONSUMERS=0 runs it without a consumer (`--consumers`);
#   WORKLOAD=metadata  COUNT (default 20,000) queue assignments with PARALLEL (64) in flight,
#                      the client attached to the leader (an open and a close each).
#   scripts/bench-threads.sh [BIN_DIR]       # default: this tree's release build
#   WORKLOAD=metadata scripts/bench-threads.sh /tmp/other-build
# Thread names: the main thread carries "(main)" (the metadata actor runs there since
# 51de24c); actix arbiters are "actix-rt|system" (elector, one per partition);
# bmq-ledger-sync is the metadata ledger's fsync thread; bmq-sync-<p> / bmq-close-<p> /
# bmq-compact-<p> are a partition's workers. CPU figures are clock ticks (10 ms each) summed over the run: use
# runs of several seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKLOAD=${WORKLOAD:-messages}
BASE=${BASE_PORT:-36300}
DIR=${DIR:-/tmp/bmq-bench-threads}
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
release_builds "$@"
BIN=${BUILDS[0]}
trap stop_cluster EXIT
trap 'exit 130' INT TERM
start_cluster "$BIN"
case $WORKLOAD in
  messages) COUNT=${COUNT:-200000} ;;
  metadata) COUNT=${COUNT:-20000}; echo "leader: node $(cluster_leader "$BIN")" ;;
  *) echo "WORKLOAD is messages or metadata" >&2; exit 2 ;;
esac
echo "nodes 1-3: pids ${PIDS[*]}; load average $(cut -d' ' -f1-3 /proc/loadavg)"
bench_load "$BIN" "$WORKLOAD" 20000 >/dev/null
python3 scripts/lib/thread_cpu.py snap "$DIR/before.json" "${PIDS[@]}"
bench_load "$BIN" "$WORKLOAD" "$COUNT" ${RATE:+--rate "$RATE"} ${CONSUMERS:+--consumers "$CONSUMERS"}
python3 scripts/lib/thread_cpu.py snap "$DIR/after.json" "${PIDS[@]}"
python3 scripts/lib/thread_cpu.py diff "$DIR/before.json" "$DIR/after.json" "$COUNT"
