#!/usr/bin/env bash
# Does the data path stay flat in the number of queues? (The same figures with 100
# and with 100,000 queues assigned; docs/bench/JOURNAL.md "Flat in the number of queues".) For each
# release build given (alternating, ROUNDS rounds), on a fresh local 3-node cluster (plain TCP,
# strong consistency, 4 partitions):
#   1. messages, no other queue: 1 producer / 1 consumer, 1 KiB, window 256, N messages:
#      msgs/s and ACK p50 / p99 (the client on node 1, the queue wherever it lands: the same
#      queue in 5, so the two runs of a cluster differ only by the queues beside it);
#   2. assigns Q queues (`bmqctl bench metadata`, 64 in flight: each queue opened for writing and
#      closed once, so every primary keeps an entry per queue of its partitions): assignments/s;
#   3. RSS of each node (after a 12 s pause: the heap trim runs every 10 s);
#   4. the brokers' CPU over IDLE_SECS with nothing to do (timer ticks, heartbeats);
#   5. messages again, as in 1, now beside the Q queues;
#   6. client churn: CHURN times, 8 producers and 8 consumers connect, pass 64 messages and
#      leave: the brokers' CPU and the wall time.
# CPU is utime + stime of the three broker processes (/proc/<pid>/stat), before and after.
# Figures depend on the machine's load: compare builds within one run, note the load average.
#
#   scripts/bench-many-queues.sh /tmp/before /tmp/after     # release directories to compare
#   scripts/bench-many-queues.sh                            # this tree's release build
#   Q=10000 ROUNDS=3 scripts/bench-many-queues.sh ...
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
Q=${Q:-100000}
N=${N:-100000}
IDLE_SECS=${IDLE_SECS:-10}
CHURN=${CHURN:-20}
BASE=${BASE_PORT:-35900}
DIR=${DIR:-/tmp/bmq-bench-many-queues}
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
release_builds "$@"
trap stop_cluster EXIT
trap 'exit 130' INT TERM
rss_mib() {
  local out=""
  for p in "${PIDS[@]}"; do out+="$(awk '/VmRSS/{printf "%d", $2 / 1024}' "/proc/$p/status") "; done
  echo "$out"
}
# messages BIN: "msgs/s ACK-p50 ACK-p99" of one 1p/1c run, on the same queue every time in a
# cluster (the run id), so both message runs of a cluster have the same primary and placement.
messages() {
  bench_load "$1" messages "$N" --run-id b8 \
    | awk '/^produced/{r=$3} /^ack/{p50=$2; p99=$4} END{print r, p50, p99}'
}

echo "# bench-many-queues $(date -u +%FT%TZ), load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# builds: ${BUILDS[*]}; Q=$Q queues, N=$N messages, IDLE_SECS=$IDLE_SECS, CHURN=$CHURN"
for round in $(seq "$ROUNDS"); do
  for bin in "${BUILDS[@]}"; do
    start_cluster "$bin" || { echo "cluster of $bin not ready" >&2; exit 1; }
    read -r r0 p50_0 p99_0 <<<"$(messages "$bin")"
    assigned=$(PARALLEL=64 bench_load "$bin" metadata "$Q" | sed -n 's/.*(\([0-9.]*\)\/s).*/\1/p')
    sleep 12
    rss=$(rss_mib)
    a=$(broker_cpu_ms); sleep "$IDLE_SECS"; z=$(broker_cpu_ms)
    idle=$(((z - a) * 1000 / (IDLE_SECS * 1000)))
    read -r r1 p50_1 p99_1 <<<"$(messages "$bin")"
    a=$(broker_cpu_ms); t0=$(date +%s%N)
    for _ in $(seq "$CHURN"); do
      "$bin/bmqctl" bench messages --count 64 --size 1024 --window 16 --producers 8 --consumers 8 \
        --broker "$BROKERS" --no-tls --token "" --quiet >/dev/null
    done
    z=$(broker_cpu_ms); t1=$(date +%s%N)
    printf 'round %s %s\n' "$round" "$bin"
    printf '  messages, no other queue:   %s msgs/s, ACK p50 %s / p99 %s ms\n' "$r0" "$p50_0" "$p99_0"
    printf '  %s queues assigned:     %s per s\n' "$Q" "$assigned"
    printf '  RSS of the nodes (MiB):     %s\n' "$rss"
    printf '  idle brokers CPU:           %s ms per s\n' "$idle"
    printf '  messages beside %s queues: %s msgs/s, ACK p50 %s / p99 %s ms\n' "$Q" "$r1" "$p50_1" "$p99_1"
    printf '  churn (%s x 16 clients):    brokers CPU %s ms, wall %s ms\n' "$CHURN" "$((z - a))" "$(((t1 - t0) / 1000000))"
    printf '  load average: %s\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
    stop_cluster
  done
done
