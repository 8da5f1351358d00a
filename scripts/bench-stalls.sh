#!/usr/bin/env bash
# ACK tail while the per-message tables grow (issue 18; BENCHMARKS.md "No stop-the-world
# rehash"): builds side by side, alternating, on a fresh local 3-node cluster per run (plain TCP,
# strong consistency, 1 KiB messages, window 256), each run paced at RATE msgs/s for SECS s:
#   window   1 producer, 1 consumer: RATE x SECS GUIDs pass through every node's duplicate window
#            (1,000,000 by default), which grows past 917,504 GUIDs at the default 30,000 x 40;
#   backlog  1 producer, no consumer: as many messages stay outstanding in every node's index.
# Prints msgs/s, ACK p50 / p99 / p99.9 / max (ms) and the load average per run. A resize that
# rehashes a whole table shows as a max of 100-300 ms (every node stops at about the same
# message); the rest of the tail is this machine's scheduling and disk.
#
#   scripts/bench-stalls.sh                          # this tree's release build
#   scripts/bench-stalls.sh /tmp/before /tmp/after   # release directories (broker, bmqctl)
#   ROUNDS=3 RATE=30000 SECS=40 scripts/bench-stalls.sh ...
# Needs about RATE x SECS x 1.1 KiB of disk per node for the backlog runs (1.3 GB at the defaults).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
RATE=${RATE:-30000}
SECS=${SECS:-40}
BASE=${BASE_PORT:-36500}
DIR=${DIR:-/tmp/bmq-bench-stalls}
BUILDS=("$@")
if [ ${#BUILDS[@]} -eq 0 ]; then
  cargo build --release --bins --locked
  BUILDS=("$PWD/target/release")
fi
CTL=${BMQCTL:-${BUILDS[-1]}/bmqctl}
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
trap 'stop_cluster; rm -rf "$DIR"' EXIT
trap 'exit 130' INT TERM
run() { # build-dir scenario
  local build=$1 scenario=$2
  local brokers=127.0.0.1:$((BASE + 1)),127.0.0.1:$((BASE + 2)),127.0.0.1:$((BASE + 3))
  if ! start_cluster "$build"; then
    printf 'round %s  %-8s %-40s (cluster not ready)\n' "$ROUND" "$scenario" "$build"
    return 0
  fi
  local consumers=1
  [ "$scenario" = backlog ] && consumers=0
  local out
  out=$("$CTL" bench messages --rate "$RATE" --duration-secs "$SECS" --size 1024 --window 256 \
    --consumers "$consumers" --broker "$brokers" --no-tls --token "" --quiet 2>&1 || true)
  local rate ack
  rate=$(awk '/^produced/ {print $3}' <<<"$out")
  ack=$(awk '/^ack/ {printf "%8s %8s %8s %8s", $2, $4, $5, $6}' <<<"$out")
  printf 'round %s  %-8s %-40s %8s  %s  load %s\n' "$ROUND" "$scenario" "$build" "${rate:-?}" \
    "${ack:-(no result)}" "$(cut -d' ' -f1 /proc/loadavg)"
}
echo "# bench-stalls $(date -u +%FT%TZ), rate $RATE msgs/s for $SECS s, load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# columns: msgs/s produced, ACK p50 / p99 / p99.9 / max ms"
for ROUND in $(seq "$ROUNDS"); do
  for scenario in window backlog; do
    for build in "${BUILDS[@]}"; do
      run "$build" "$scenario"
    done
  done
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
