#!/usr/bin/env bash
# Throughput, latency, memory and metadata benchmarks on a local 3-node cluster (issue 8;
# BENCHMARKS.md gives the method and the figures). Plain TCP, release build.
#   scripts/bench-local.sh                 # everything
#   FSYNC=never scripts/bench-local.sh     # the same with metadata.fsync = "never"
#   BIN=/path/to/other/release scripts/bench-local.sh   # another build (no cargo build), same method
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --release --bins --locked
  BIN=$PWD/target/release
fi
DIR=${DIR:-/tmp/bmq-bench-local}
BASE=${BASE_PORT:-33100}
FSYNC=${FSYNC:-every_record}
BROKERS=127.0.0.1:$((BASE + 1)),127.0.0.1:$((BASE + 2)),127.0.0.1:$((BASE + 3))
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# `cluster up` writes the per-node configuration files; the nodes are then run directly so the
# fsync policy can be changed and their memory read.
rm -rf "$DIR"
"$BIN/bmqctl" cluster up --dir "$DIR" --base-port "$BASE" --no-security --clean >/dev/null 2>&1 &
UP=$!
for _ in $(seq 120); do
  "$BIN/bmqctl" ready --admin 127.0.0.1:$((BASE + 201)) >/dev/null 2>&1 && break
  sleep 0.5
done
kill -INT $UP; wait $UP || true
for i in 1 2 3; do
  sed -i "s/^fsync = .*/fsync = \"$FSYNC\"/" "$DIR/node-$i/broker.toml"
  grep -q '^fsync' "$DIR/node-$i/broker.toml" || sed -i "s/^\[metadata\]/[metadata]\nfsync = \"$FSYNC\"/" "$DIR/node-$i/broker.toml"
  "$BIN/broker" --config "$DIR/node-$i/broker.toml" >>"$DIR/node-$i/bench.log" 2>&1 &
  PIDS+=($!)
done
for _ in $(seq 120); do
  ok=0
  for i in 1 2 3; do "$BIN/bmqctl" ready --admin 127.0.0.1:$((BASE + 200 + i)) >/dev/null 2>&1 && ok=$((ok + 1)); done
  [ $ok = 3 ] && break
  sleep 0.5
done
rss() { for p in "${PIDS[@]}"; do awk -v p="$p" '/VmRSS|VmHWM/ {printf "%s %s=%s kB  ", "pid " p, $1, $2} END {print ""}' /proc/"$p"/status; done; }
bench() { echo "## bmqctl bench $*"; "$BIN/bmqctl" bench "$@" --broker "$BROKERS" --no-tls --token "" --quiet; }

echo "# fsync = $FSYNC"
echo "## memory at start"; rss
"$BIN/bmqctl" produce --queue bmq://bmq.test/rss-queued --count 10000 --size 1024 --broker "$BROKERS" --no-tls --token ""
echo "## memory with 10,000 x 1 KiB messages queued"; rss
bench metadata --queues 200
bench metadata --queues 200 --parallel 8
bench messages --count 100000 --size 1024
bench messages --count 100000 --size 1024 --window 100
bench messages --count 100000 --size 1024 --domain bmq.test.eventual
bench messages --count 100000 --size 1024 --producers 4 --consumers 4 --queues 4
bench messages --rate 5000 --duration-secs 10 --size 1024
echo "## memory after the runs (peak = VmHWM)"; rss
