#!/usr/bin/env bash
# What one queue assignment costs with 64 in flight (docs/bench/JOURNAL.md "Metadata commits
# with 64 in flight: where the time goes"): a fresh local 3-node cluster (plain TCP), a
# warm-up, then ROUNDS runs of `bmqctl bench metadata` (COUNT fresh queues, PARALLEL clients,
# each opening a never-opened queue and closing it; the clients on the metadata leader). Per
# assignment, the three brokers together: socket, eventfd, epoll, futex and disk system calls
# and context switches (`perf stat` tracepoints: counting, not tracing, so the rate stays
# near the untraced one), the brokers' user and system CPU (/proc/<pid>/stat), and the
# client's CPU (`/usr/bin/time`). Counts are what to compare; the rate moves with the host.
#
#   scripts/bench-metadata-costs.sh                  # this tree's release build
#   scripts/bench-metadata-costs.sh /tmp/build       # a release directory made elsewhere
#   ROUNDS=3 COUNT=40000 PARALLEL=64 scripts/bench-metadata-costs.sh
#
# Needs root (tracepoints). Installs `perf` (Debian's linux-perf, apt-get) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
COUNT=${COUNT:-20000}
PARALLEL=${PARALLEL:-64}
BASE=${BASE_PORT:-39900}
DIR=${DIR:-/tmp/bmq-bench-metadata-costs}
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
need_perf
release_builds "$@"
bin=${BUILDS[0]}
trap stop_cluster EXIT
trap 'exit 130' INT TERM
mkdir -p "$DIR.out"
EVENTS=writev,write,recvfrom,epoll_wait,futex,pwrite64,fdatasync
echo "# bench-metadata-costs $(date -u +%FT%TZ) $bin COUNT=$COUNT PARALLEL=$PARALLEL; load average $(cut -d' ' -f1-3 /proc/loadavg)"
start_cluster "$bin"
PARALLEL=$PARALLEL bench_load "$bin" metadata 5000 >/dev/null
leader=127.0.0.1:$((BASE + $(cluster_leader "$bin")))
hz=$(getconf CLK_TCK)
# User and system clock ticks of the three brokers.
ticks() {
  local u=0 s=0 a b p
  for p in "${PIDS[@]}"; do
    read -r a b < <(awk '{print $14, $15}' "/proc/$p/stat")
    u=$((u + a)); s=$((s + b))
  done
  echo "$u $s"
}
for round in $(seq "$ROUNDS"); do
  read -r u0 s0 < <(ticks)
  perf stat -x, -o "$DIR.out/stat.csv" \
    -e "$(echo "$EVENTS" | sed 's/\([a-z_0-9]*\)/syscalls:sys_enter_\1/g'),context-switches" \
    -p "$(IFS=,; echo "${PIDS[*]}")" -- \
    /usr/bin/time -o "$DIR.out/client.time" -f "%U %S" \
    "$bin/bmqctl" bench metadata --queues "$COUNT" --parallel "$PARALLEL" --broker "$leader" \
    --no-tls --token "" --quiet >"$DIR.out/bench.txt"
  read -r u1 s1 < <(ticks)
  echo "## round $round $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"
  grep -E "committed|latency|open \(commit\)" "$DIR.out/bench.txt"
  awk -F, -v n="$COUNT" '$3 != "" && $1 ~ /^[0-9]+$/ {
      name = $3; sub(/^syscalls:sys_enter_/, "", name); printf "  %-18s %6.2f per assignment\n", name, $1 / n }' \
    "$DIR.out/stat.csv"
  read -r cu cs <"$DIR.out/client.time"
  awk -v n="$COUNT" -v hz="$hz" -v u=$((u1 - u0)) -v s=$((s1 - s0)) -v cu="$cu" -v cs="$cs" 'BEGIN {
      printf "  brokers CPU        %6.1f us per assignment (user %.1f, system %.1f)\n", (u + s) / hz / n * 1e6, u / hz / n * 1e6, s / hz / n * 1e6
      printf "  client CPU         %6.1f us per assignment (user %.1f, system %.1f)\n", (cu + cs) / n * 1e6, cu / n * 1e6, cs / n * 1e6 }'
done
