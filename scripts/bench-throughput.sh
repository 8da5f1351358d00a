#!/usr/bin/env bash
# Data-path throughput benchmark (docs/bench/JOURNAL.md "Throughput", 2026-11-25): one or more
# release builds side by side, alternating, on a fresh local 3-node cluster per run (plain TCP,
# strong consistency, 1 KiB messages):
#   max     1 producer, 1 consumer, WINDOW (256) unacknowledged PUTs, COUNT (300,000) messages:
#           msgs/s, ACK p50/p99, and the CPU time of the three broker processes together per
#           message (utime + stime from /proc/<pid>/stat, before and after the run);
#   paced   1 producer, 1 consumer, RATE (50,000) msgs/s for PACED_SECS (10) s: ACK p50/p99/p99.9
#           and broker CPU per message.
# The benchmark client runs on the same machine; its CPU is not counted. Figures depend on the
# machine's load: compare builds within one run (the rounds alternate them) and note the load
# average, printed at the start and the end.
# Placement (PLACEMENT): every run of a round uses one queue (`bmqctl bench messages
# --run-id`); after the warm-up assigned it, the client attaches to a node that is not its
# primary (`proxy`, the default: a proxy hop each way, as for most queues of a real cluster),
# to its primary (`primary`), or to node 1 whatever the queue's primary (`any`, the method
# before 2026-11-26, whose figures swung by ~20% with where the queue landed).
#
#   scripts/bench-throughput.sh                              # this tree's release build
#   scripts/bench-throughput.sh /tmp/before /tmp/after       # release directories to compare
#   ROUNDS=3 COUNT=500000 RATE=50000 scripts/bench-throughput.sh ...
#   PLACEMENT=primary scripts/bench-throughput.sh ...
# The client is one `bmqctl` for every build (BMQCTL, default: the last build's), so only the
# brokers differ; with CLIENT=each every build's runs use its own `bmqctl` (to compare client
# library changes). The last column is the client's CPU per message (user + system, from the
# shell's `times` of the `bmqctl` process; producer and consumer are one process).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
COUNT=${COUNT:-300000}
WINDOW=${WINDOW:-256}
RATE=${RATE:-50000}
PACED_SECS=${PACED_SECS:-10}
PLACEMENT=${PLACEMENT:-proxy}
# The run id (hexadecimal) of every run, so all use the queue bench-tp-<RUN_ID as 8 digits>-0.
RUN_ID=b7
BASE=${BASE_PORT:-35500}
DIR=${DIR:-/tmp/bmq-bench-throughput}
# shellcheck source=lib/cluster.sh
. scripts/lib/cluster.sh
release_builds "$@"
BMQCTL=${BMQCTL:-${BUILDS[${#BUILDS[@]}-1]}/bmqctl}
trap stop_cluster EXIT
trap 'exit 130' INT TERM

# The client address the measured runs attach to (see PLACEMENT).
client_broker() {
  local primary node
  primary=$("$BMQCTL" status --admin 127.0.0.1:$((BASE + 201)) --json | python3 -c '
import json, sys
s = json.load(sys.stdin)[0]["status"]
queue = "/bench-tp-%08x-0" % int(sys.argv[1], 16)
p = next(q["partition_id"] for q in s["queues"] if q["uri"].endswith(queue))
print(next(x["primary"] for x in s["partitions"] if x["partition_id"] == p))' "$RUN_ID")
  case $PLACEMENT in
    proxy) node=$((primary % 3 + 1)) ;;
    primary) node=$primary ;;
    *) node=1 ;;
  esac
  echo "127.0.0.1:$((BASE + node))"
}

# Runs one `bmqctl bench messages` and prints: msgs/s, ACK p50, p99, p99.9 (ms), broker us/msg,
# client us/msg.
measure() {
  local bin=$1; shift
  local c0 c1 json client=$BMQCTL out
  [ "${CLIENT:-}" = each ] && client=$bin/bmqctl
  out=$DIR.measure
  c0=$(broker_cpu_ms)
  # `times` in the subshell: the CPU of its one child, the client (user and system lines).
  (
    "$client" bench messages "$@" --size 1024 --queue-prefix bench-tp --run-id "$RUN_ID" --broker "$CLIENT_BROKER" --no-tls --token "" --json --quiet >"$out.json"
    times >"$out.times"
  )
  c1=$(broker_cpu_ms)
  json=$(cat "$out.json")
  python3 - "$json" "$((c1 - c0))" "$(tail -n 1 "$out.times")" <<'PY'
import json, re, sys
r = json.loads(sys.argv[1]); cpu_ms = int(sys.argv[2])
# `times`' second line: the children's user and system time, "XmY.YYYs XmY.YYYs".
client_s = sum(int(m) * 60 + float(sec) for m, sec in re.findall(r"(\d+)m([\d.]+)s", sys.argv[3]))
a = r["ack_latency"]
n = max(r["consumed"]["messages"], 1)
ok = "" if r["missing"] == 0 and r["errors"] == 0 and not r["nacks"] else f"  (missing {r['missing']} errors {r['errors']} nacks {r['nacks']})"
print(f'{r["consumed"]["msgs_per_sec"]:9.0f} {a["p50_us"]/1000:8.2f} {a["p99_us"]/1000:8.2f} {a["p999_us"]/1000:8.2f} {cpu_ms / 1000 / n * 1e6:9.1f} {client_s / n * 1e6:9.1f}{ok}')
PY
}

echo "# bench-throughput $(date -u +%FT%TZ), load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# builds: ${BUILDS[*]}; client: $BMQCTL"
echo "# placement: $PLACEMENT; columns: msgs/s consumed, ACK p50 / p99 / p99.9 ms, broker CPU us per message, client CPU us per message"
for round in $(seq "$ROUNDS"); do
  for bin in "${BUILDS[@]}"; do
    start_cluster "$bin"
    # Warm-up: queue assignment, connections, caches.
    "$BMQCTL" bench messages --count 20000 --size 1024 --window "$WINDOW" --queue-prefix bench-tp --run-id "$RUN_ID" --broker "$BROKERS" --no-tls --token "" --quiet >/dev/null
    CLIENT_BROKER=$(client_broker)
    printf 'round %s  %-40s max     ' "$round" "$bin"
    measure "$bin" --count "$COUNT" --window "$WINDOW"
    printf 'round %s  %-40s paced   ' "$round" "$bin"
    measure "$bin" --rate "$RATE" --duration-secs "$PACED_SECS" --window 100000
    stop_cluster
  done
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
