#!/usr/bin/env bash
# CPU profile of the three brokers of a local cluster under the throughput benchmark's load
# (scripts/bench-throughput.sh), drawn as a flame graph: `perf record` (cpu-clock, call graphs
# through frame pointers) of every broker process while `bmqctl bench messages` runs 1 producer / 1 consumer,
# 1 KiB, strong consistency, window 256; folded and drawn with inferno.
#
#   scripts/profile-flamegraph.sh OUT.svg                 # this tree, built with frame pointers
#   BIN=/path/to/release scripts/profile-flamegraph.sh OUT.svg   # a build made elsewhere
#   SECS=5 COUNT=300000 scripts/profile-flamegraph.sh OUT.svg
#   WORKLOAD=metadata scripts/profile-flamegraph.sh OUT.svg   # queue assignments, 64 in flight,
#                                                    # with the client on the metadata leader
#
# Installs what it needs when missing: `perf` (Debian's linux-perf, apt-get) and inferno
# (`cargo install inferno`). The build it makes lives in target/profile-fp (RUSTFLAGS
# "-C force-frame-pointers=yes", release profile), so it does not disturb target/release.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/profile-flamegraph.sh OUT.svg}
SECS=${SECS:-5}
COUNT=${COUNT:-300000}
BASE=${BASE_PORT:-35700}
DIR=${DIR:-/tmp/bmq-profile}
WORKLOAD=${WORKLOAD:-messages}
case $WORKLOAD in
  messages) what="1p/1c 1 KiB strong, window 256" ;;
  metadata) what="queue assignments (bmqctl bench metadata), 64 in flight, client on the leader" ;;
  *) echo "WORKLOAD is messages or metadata" >&2; exit 2 ;;
esac
TITLE=${TITLE:-"bmq brokers, $what ($(git rev-parse --short HEAD))"}
command -v inferno-flamegraph >/dev/null 2>&1 || cargo install --locked inferno >/dev/null
if [ -z "${BIN:-}" ]; then
  RUSTFLAGS="-C force-frame-pointers=yes" CARGO_TARGET_DIR=target/profile-fp cargo build --release --bins --locked
  BIN=$PWD/target/profile-fp/release
fi
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
need_perf
trap stop_cluster EXIT
trap 'exit 130' INT TERM
start_cluster "$BIN"
bench_load "$BIN" "$WORKLOAD" 20000 >/dev/null
PERF_DATA=$DIR/perf.data
perf record -e cpu-clock -F 999 -g -p "$(IFS=,; echo "${PIDS[*]}")" -o "$PERF_DATA" -- sleep "$SECS" 2>/dev/null &
REC=$!
bench_load "$BIN" "$WORKLOAD" "$COUNT"
wait $REC || true
perf script -i "$PERF_DATA" 2>/dev/null | inferno-collapse-perf >"$DIR/folded"
inferno-flamegraph --title "$TITLE" <"$DIR/folded" >"$OUT"
echo "flame graph: $OUT (load average $(cut -d' ' -f1-3 /proc/loadavg))"
