#!/usr/bin/env bash
# Metadata commit benchmark (method and figures in docs/bench/JOURNAL.md, "Metadata commits",
# 2026-11-25). Starts a 3-node local cluster (plain TCP, metadata fsync on every record), then
# measures queue assignments (`bmqctl bench metadata`: each open of a never-opened queue is one
# committed QueueAssignmentAdvisory) sequentially and with 64 in flight, first on a fresh
# cluster (~100 queues assigned), then again after PREFILL queues were assigned.
#   scripts/bench-metadata.sh                       # this worktree's release build
#   BIN=/path/to/release scripts/bench-metadata.sh  # another build (no cargo build)
#   BROKER_BIN=/old/release/broker scripts/bench-metadata.sh   # old nodes, this bmqctl
#   PREFILLS="10000 100000" SEQ=500 PAR=5000 scripts/bench-metadata.sh
# The bench client is always $BIN/bmqctl (with --admin: the leader's own commit latency).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --release --bins --locked
  BIN=$PWD/target/release
fi
DIR=${DIR:-/tmp/bmq-bench-metadata}
BASE=${BASE_PORT:-33400}
PREFILLS=${PREFILLS-100000}
BROKER_BIN=${BROKER_BIN:-$BIN/broker}
SEQ=${SEQ:-1000}
PAR=${PAR:-20000}
UP_PID=
cleanup() { [ -n "$UP_PID" ] && kill -INT "$UP_PID" 2>/dev/null && wait "$UP_PID" 2>/dev/null || true; }
trap cleanup EXIT

"$BIN/bmqctl" cluster up --dir "$DIR" --base-port "$BASE" --no-security --no-prometheus --clean \
  --broker-bin "$BROKER_BIN" \
  >"$DIR.up.log" 2>&1 &
UP_PID=$!
for _ in $(seq 240); do
  ok=0
  for i in 1 2 3; do "$BIN/bmqctl" ready --admin 127.0.0.1:$((BASE + 200 + i)) >/dev/null 2>&1 && ok=$((ok + 1)); done
  [ $ok = 3 ] && break
  sleep 0.5
done
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh # for cluster_leader (this script starts its cluster with `cluster up`)
leader=$(cluster_leader "$BIN")
follower=$(( leader % 3 + 1 ))
LEADER=127.0.0.1:$((BASE + leader))
FOLLOWER=127.0.0.1:$((BASE + follower))
queues() {
  "$BIN/bmqctl" status --admin 127.0.0.1:$((BASE + 200 + leader)) --json \
    | python3 -c 'import json,sys; print(len(json.load(sys.stdin)[0]["status"]["queues"]))'
}
bench() {
  echo "## $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg); queues assigned $(queues); bmqctl bench metadata $*"
  "$BIN/bmqctl" bench metadata "$@" --admin 127.0.0.1:$((BASE + 200 + leader)) --no-tls --token "" --quiet
}
round() {
  bench --queues "$SEQ" --parallel 1 --broker "$LEADER"
  bench --queues "$SEQ" --parallel 1 --broker "$FOLLOWER"
  bench --queues "$PAR" --parallel 64 --broker "$LEADER"
}

echo "# nodes $BROKER_BIN, client $BIN/bmqctl; leader node $leader (client on $LEADER; follower client on $FOLLOWER)"
bench --queues 100 --parallel 1 --broker "$LEADER" >/dev/null
round
for PREFILL in $PREFILLS; do
  have=$(queues)
  if [ "$PREFILL" -gt "$have" ]; then
    echo "## prefill to $PREFILL queues"
    bench --queues $((PREFILL - have)) --parallel 64 --broker "$LEADER"
  fi
  round
done
