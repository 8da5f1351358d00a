#!/usr/bin/env bash
# Throughput, latency, memory and metadata benchmarks on a local 3-node cluster
# (BENCHMARKS.md gives the method and the figures). Plain TCP, release build.
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
# The nodes are run directly (lib/cluster.sh) so the fsync policy can be changed and their
# memory read.
METADATA_FSYNC=$FSYNC
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
trap stop_cluster EXIT
start_cluster "$BIN"
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
