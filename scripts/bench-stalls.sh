#!/usr/bin/env bash
# ACK tail while the per-message tables grow (docs/bench/JOURNAL.md "No stop-the-world
# rehash"): builds side by side, alternating, on a fresh local 3-node cluster per run (plain TCP,
# strong consistency, 1 KiB messages, window 256), each run paced at RATE msgs/s for SECS s:
#   window   1 producer, 1 consumer: RATE x SECS GUIDs pass through every node's duplicate window
#            (1,000,000 by default), which grows past 917,504 GUIDs at the default 30,000 x 40;
#   backlog  1 producer, no consumer: as many messages stay outstanding in every node's index.
#   compaction  one partition; a queue without consumer takes HELD msgs/s (default a fifth of
#            RATE) beside 1 producer / 1 consumer at the rest, so every closed segment keeps a
#            fifth of its records live and each node compacts about one segment a second; the
#            flowing queue's ACKs are shown, and the compactions the nodes logged.
# Prints msgs/s, ACK p50 / p99 / p99.9 / max (ms), the load average, and from the nodes' metrics
# the partition-thread turns over 10 and 25 ms, the compactions and the journal fsyncs over 5 ms,
# per run. A resize that
# rehashes a whole table shows as a max of 100-300 ms (every node stops at about the same
# message), a compaction on the partition's thread as 60-160 ms; the rest of the tail is this
# machine's scheduling and disk.
#
#   scripts/bench-stalls.sh                          # this tree's release build
#   scripts/bench-stalls.sh /tmp/before /tmp/after   # release directories (broker, bmqctl)
#   ROUNDS=3 RATE=30000 SECS=40 scripts/bench-stalls.sh ...
#   SCENARIOS=compaction scripts/bench-stalls.sh ...   # some of: window backlog compaction
# Needs about RATE x SECS x 1.1 KiB of disk per node for the backlog runs (1.3 GB at the defaults).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
RATE=${RATE:-30000}
SECS=${SECS:-40}
HELD=${HELD:-$((RATE / 5))}
SCENARIOS=${SCENARIOS:-window backlog compaction}
BASE=${BASE_PORT:-36500}
DIR=${DIR:-/tmp/bmq-bench-stalls}
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
release_builds "$@"
CTL=${BMQCTL:-${BUILDS[-1]}/bmqctl}
trap 'stop_cluster; rm -rf "$DIR"' EXIT
trap 'exit 130' INT TERM
run() { # build-dir scenario
  local build=$1 scenario=$2
  local partitions=
  [ "$scenario" = compaction ] && partitions=1
  if ! PARTITIONS=$partitions start_cluster "$build"; then
    printf 'round %s  %-10s %-40s (cluster not ready)\n' "$ROUND" "$scenario" "$build"
    return 0
  fi
  local consumers=1 rate=$RATE held=
  [ "$scenario" = backlog ] && consumers=0
  if [ "$scenario" = compaction ]; then
    rate=$((RATE - HELD))
    "$CTL" bench messages --rate "$HELD" --duration-secs "$SECS" --size 1024 --window 256 \
      --consumers 0 --queue-prefix held --broker "$BROKERS" --no-tls --token "" --quiet \
      >/dev/null 2>&1 &
    held=$!
  fi
  local out
  out=$("$CTL" bench messages --rate "$rate" --duration-secs "$SECS" --size 1024 --window 256 \
    --consumers "$consumers" --broker "$BROKERS" --no-tls --token "" --quiet 2>&1 || true)
  [ -n "$held" ] && { wait "$held" || true; }
  # From every node's /metrics: partition-thread turns over 10 and 25 ms, compactions, and the share
  # of journal fsyncs over 5 ms.
  local slow=0 slow10=0 compactions=0 fsyncs=0 fsyncs_slow=0 m
  for i in 1 2 3; do
    m=$(curl -sf "http://127.0.0.1:$((BASE + 200 + i))/metrics" || true)
    fsyncs=$((fsyncs + $(awk '/^bmq_journal_fsync_seconds_count/ {c += $2} END {printf "%d", c}' <<<"$m")))
    fsyncs_slow=$((fsyncs_slow + $(awk '/^bmq_journal_fsync_seconds_count/ {c += $2} /^bmq_journal_fsync_seconds_bucket.*le="0.005"/ {b += $2} END {printf "%d", c - b}' <<<"$m")))
    slow=$((slow + $(awk '/^bmq_partition_turn_seconds_count/ {c += $2} /^bmq_partition_turn_seconds_bucket.*le="0.025"/ {b += $2} END {printf "%d", c - b}' <<<"$m")))
    slow10=$((slow10 + $(awk '/^bmq_partition_turn_seconds_count/ {c += $2} /^bmq_partition_turn_seconds_bucket.*le="0.01"/ {b += $2} END {printf "%d", c - b}' <<<"$m")))
    compactions=$((compactions + $(awk '/^bmq_journal_compactions_total/ {c += $2} END {printf "%d", c}' <<<"$m")))
  done
  local extra="  turns>10ms $slow10  turns>25ms $slow  compactions $compactions  fsyncs>5ms $fsyncs_slow/$fsyncs"
  local ack
  rate=$(awk '/^produced/ {print $3}' <<<"$out")
  ack=$(awk '/^ack/ {printf "%8s %8s %8s %8s", $2, $4, $5, $6}' <<<"$out")
  printf 'round %s  %-10s %-40s %8s  %s  load %s%s\n' "$ROUND" "$scenario" "$build" "${rate:-?}" \
    "${ack:-(no result)}" "$(cut -d' ' -f1 /proc/loadavg)" "$extra"
}
echo "# bench-stalls $(date -u +%FT%TZ), rate $RATE msgs/s for $SECS s, load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# columns: msgs/s produced, ACK p50 / p99 / p99.9 / max ms (compaction: the flowing queue's)"
for ROUND in $(seq "$ROUNDS"); do
  for scenario in $SCENARIOS; do
    for build in "${BUILDS[@]}"; do
      run "$build" "$scenario"
    done
  done
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
