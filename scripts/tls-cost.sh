#!/usr/bin/env bash
# Measures what TLS and tokens cost: the same produce/consume runs against a local
# 3-node cluster started by `bmqctl cluster up` with security (mutual TLS between nodes, TLS
# and a token on the client link) and with --no-security.
#
# Usage: [ORDER="tls plain"] scripts/tls-cost.sh [RUNS]   (release binaries in target/release; build them first
# with `cargo build --release --bins`). Ports 42000-42303 and 43000-43303 must be free.
#
# Per mode and run:
#   throughput: bmqctl produce --count 20000 --size 1024 --window 1000, then consume 20000;
#   latency:    bmqctl produce --count 2000 --size 1024 --window 1: one PUT in flight, so
#               elapsed / count is the mean PUT -> ACK round trip seen by the client
#               (strong consistency: the ACK waits for a quorum's fsync-less journal write).
set -euo pipefail
RUNS=${1:-3}
BIN=${BIN:-target/release}
WORK=$(mktemp -d)
CLUSTER_PID=
cleanup() {
  if [ -n "$CLUSTER_PID" ]; then kill "$CLUSTER_PID" 2>/dev/null || true; wait "$CLUSTER_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

field() { sed -n "s/.*\"$1\": *\([0-9.e+-]*\).*/\1/p" | head -1; }

run_mode() {
  local mode=$1 base=$2 flags=$3
  local dir="$WORK/$mode"
  mkdir -p "$dir"
  (cd "$dir" && exec "$OLDPWD/$BIN/bmqctl" cluster up --base-port "$base" --no-prometheus \
      --broker-bin "$OLDPWD/$BIN/broker" $flags >"$dir/up.log" 2>&1) &
  CLUSTER_PID=$!
  for _ in $(seq 1 100); do grep -q "cluster is up" "$dir/up.log" 2>/dev/null && break; sleep 0.2; done
  grep -q "cluster is up" "$dir/up.log" || { cat "$dir/up.log"; exit 1; }
  local brokers="127.0.0.1:$((base+1)),127.0.0.1:$((base+2)),127.0.0.1:$((base+3))"
  export BMQ_CLUSTER_DIR="$dir/.cluster"
  for run in $(seq 1 "$RUNS"); do
    local q="bmq://bmq.test/cost-$run"
    local p c l
    p=$("$BIN/bmqctl" produce --queue "$q" --count 20000 --size 1024 --window 1000 --broker "$brokers" --json | field rate_msgs_per_sec)
    c=$("$BIN/bmqctl" consume --queue "$q" --count 20000 --broker "$brokers" --json | field rate_msgs_per_sec)
    l=$("$BIN/bmqctl" produce --queue "$q-lat" --count 2000 --size 1024 --window 1 --broker "$brokers" --json | field elapsed_secs)
    "$BIN/bmqctl" consume --queue "$q-lat" --count 2000 --broker "$brokers" >/dev/null
    printf '%s run %s: produce %.0f msg/s, consume %.0f msg/s, mean ACK round trip %.3f ms\n' \
      "$mode" "$run" "$p" "$c" "$(awk -v l="$l" 'BEGIN { print l * 1000 / 2000 }')"
  done
  unset BMQ_CLUSTER_DIR
  kill "$CLUSTER_PID"; wait "$CLUSTER_PID" 2>/dev/null || true
  CLUSTER_PID=
}

# ORDER="tls plain" runs the secured cluster first (to check for an order bias).
for mode in ${ORDER:-plain tls}; do
  case $mode in
    plain) run_mode plain 43000 --no-security ;;
    tls) run_mode tls 42000 "" ;;
  esac
done
