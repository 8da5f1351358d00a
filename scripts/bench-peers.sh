#!/usr/bin/env bash
# Our cluster against NATS JetStream and etcd (docs/bench/JOURNAL.md "Against NATS JetStream
# and etcd" gives the method and the figures). One system at a time, never two at once: a
# 3-node cluster of it on loopback with fsync'd storage in a temporary directory, the same
# workloads through the same probe (scripts/peer-probe: same measurement code, HDR histograms),
# then it is stopped. At the end a table with every figure, ours / peer. Beside each workload
# run, the CPU time (user + system) its three server processes used over it, per message or
# per metadata write (`server_cpu` lines in results.jsonl; clock-tick resolution, 10 ms).
#
#   scripts/bench-peers.sh                           # everything, one round
#   ROUNDS=3 FAILOVER_RUNS=10 scripts/bench-peers.sh # three alternating rounds, 10 failovers each
#   SYSTEMS="bmq nats" FAILOVER_RUNS=0 scripts/bench-peers.sh
#   BIN=/path/to/other/release scripts/bench-peers.sh # another build of ours (no cargo build)
#
# Installs Debian's nats-server and etcd-server with apt-get when missing (as root, or through
# sudo). Settings (environment):
#   SYSTEMS        systems to run, in this order each round (bmq nats etcd)
#   ROUNDS         rounds; each round runs every system once, so the systems alternate (1)
#   MSG_COUNT      messages of the throughput workload (100000)
#   PRODUCERS, CONSUMERS, SIZE, WINDOW   of the throughput workload (1, 1, 1024, 256)
#   PACED_RATE, PACED_SECS  a second workload paced at this many msgs/s for this long (5000, 10;
#                  PACED_RATE=0 skips it)
#   META_COUNT     metadata writes per run (500)
#   META_PARALLEL  in-flight values of the metadata workload ("1 64")
#   FAILOVER_RUNS  runs of each failover scenario per system (5; 0 skips failover)
#   PROBE          the probe binary (default: scripts/peer-probe's release build, made here);
#                  another build of the probe, to compare two probes on the same systems
#   OUT            results directory (/tmp/bmq-bench-peers): results.jsonl (one JSON line per
#                  run), report.md (the table), logs of every node
#   BASE_PORT      first port (23000, below Linux's ephemeral range 32768-60999, so no
#                  client socket of an earlier run holds one: etcd once failed to bind
#                  41612 that way): ours +100.. (client +101-103, bmqp +114-116, peer
#                  +201-203, admin +301-303), NATS +501-503 (client), +511-513 (cluster),
#                  +521-523 (monitoring), etcd +601-603 (client), +611-613 (peer)
#
# Durability as set here: ours fsyncs its journals before a quorum's receipt releases an ACK and
# each metadata record before it counts (metadata.fsync = "every_record", the default); etcd
# fsyncs its WAL before a member acknowledges an entry (its default); NATS 2.9 has no setting to
# fsync each write (`sync_interval` came in 2.10): its file store writes to the page cache and
# fsyncs every 60 s, so a NATS ACK means "in the memory of a quorum". See BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

SYSTEMS=${SYSTEMS:-bmq nats etcd}
ROUNDS=${ROUNDS:-1}
MSG_COUNT=${MSG_COUNT:-100000}
PRODUCERS=${PRODUCERS:-1}
CONSUMERS=${CONSUMERS:-1}
SIZE=${SIZE:-1024}
WINDOW=${WINDOW:-256}
PACED_RATE=${PACED_RATE:-5000}
PACED_SECS=${PACED_SECS:-10}
META_COUNT=${META_COUNT:-500}
META_PARALLEL=${META_PARALLEL:-1 64}
FAILOVER_RUNS=${FAILOVER_RUNS:-5}
OUT=${OUT:-/tmp/bmq-bench-peers}
BASE=${BASE_PORT:-23000}

apt_install() {
  echo "== installing $* (Debian packages)"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  else
    echo "error: $* missing and neither root nor sudo is available to install them" >&2
    exit 1
  fi
  # On a machine booted with systemd the packages start their own services (etcd on 2379, NATS
  # on 4222): stop them, so that nothing but the cluster under test runs during a measurement.
  if command -v systemctl >/dev/null 2>&1; then
    for unit in etcd nats-server; do
      if systemctl is-active --quiet "$unit" 2>/dev/null; then
        echo "== stopping the $unit service the package started"
        systemctl stop "$unit" 2>/dev/null || sudo systemctl stop "$unit" || true
      fi
    done
  fi
}

find_bin() { command -v "$1" 2>/dev/null || { [ -x "/usr/sbin/$1" ] && echo "/usr/sbin/$1"; } || true; }
NATS_SERVER=$(find_bin nats-server)
ETCD=$(find_bin etcd)
missing=()
case " $SYSTEMS " in *" nats "*) [ -n "$NATS_SERVER" ] || missing+=(nats-server) ;; esac
case " $SYSTEMS " in *" etcd "*) [ -n "$ETCD" ] || missing+=(etcd-server) ;; esac
if [ ${#missing[@]} -gt 0 ]; then
  apt_install "${missing[@]}"
  NATS_SERVER=$(find_bin nats-server)
  ETCD=$(find_bin etcd)
fi

if [ -z "${BIN:-}" ]; then
  cargo build --release --bins --locked
  BIN=$ROOT/target/release
fi
echo "== building the probe (scripts/peer-probe, a standalone crate)"
# Its Cargo.lock pins async-nats and the rest; when bmq-client gained a dependency since, cargo
# adds it to the lock (the only change it makes) and says so.
cargo build --release --locked --manifest-path scripts/peer-probe/Cargo.toml 2>/dev/null ||
  cargo build --release --manifest-path scripts/peer-probe/Cargo.toml
PROBE=${PROBE:-$ROOT/scripts/peer-probe/target/release/peer-probe}

rm -rf "$OUT"
mkdir -p "$OUT"
RESULTS=$OUT/results.jsonl
: >"$RESULTS"

# Every process this script starts is in PIDS (node index -> pid of the running system) or
# ALL_PIDS; the trap kills them all (SIGKILL also ends a SIGSTOPped process) on every exit.
declare -A PIDS=()
ALL_PIDS=()
cleanup() {
  for p in "${ALL_PIDS[@]:-}"; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# shellcheck source=lib/configs.sh
. scripts/lib/configs.sh # write_configs

# Addresses of each system, node order 1..3.
BMQ_BASE=$((BASE + 100))
addrs() { # addrs FIRST_PORT -> 127.0.0.1:P,127.0.0.1:P+1,127.0.0.1:P+2
  echo "127.0.0.1:$1,127.0.0.1:$(($1 + 1)),127.0.0.1:$(($1 + 2))"
}
BMQ_CLIENTS=$(addrs $((BMQ_BASE + 1)))
BMQ_ADMINS=$(addrs $((BMQ_BASE + 201)))
NATS_CLIENTS=$(addrs $((BASE + 501)))
NATS_MONITORS=$(addrs $((BASE + 521)))
ETCD_CLIENTS=$(addrs $((BASE + 601)))
clients_of() { case $1 in bmq) echo "$BMQ_CLIENTS" ;; nats) echo "$NATS_CLIENTS" ;; etcd) echo "$ETCD_CLIENTS" ;; esac; }
status_of() { case $1 in bmq) echo "$BMQ_ADMINS" ;; nats) echo "$NATS_MONITORS" ;; etcd) echo "$ETCD_CLIENTS" ;; esac; }

# start_node SYSTEM I: starts node I (1..3) of SYSTEM from its files under $OUT/SYSTEM.
start_node() {
  local sys=$1 i=$2 dir=$OUT/$1
  case $sys in
    bmq) "$BIN/broker" --config "$dir/node-$i/broker.toml" >>"$dir/node-$i.log" 2>&1 & ;;
    nats) "$NATS_SERVER" -c "$dir/n$i.conf" >>"$dir/n$i.log" 2>&1 & ;;
    etcd)
      local cluster="e1=http://127.0.0.1:$((BASE + 611)),e2=http://127.0.0.1:$((BASE + 612)),e3=http://127.0.0.1:$((BASE + 613))"
      "$ETCD" --name "e$i" --data-dir "$dir/e$i" \
        --listen-client-urls "http://127.0.0.1:$((BASE + 600 + i))" \
        --advertise-client-urls "http://127.0.0.1:$((BASE + 600 + i))" \
        --listen-peer-urls "http://127.0.0.1:$((BASE + 610 + i))" \
        --initial-advertise-peer-urls "http://127.0.0.1:$((BASE + 610 + i))" \
        --initial-cluster "$cluster" --initial-cluster-state new \
        --initial-cluster-token bmq-bench-peers --logger zap --log-outputs stderr \
        >>"$dir/e$i.log" 2>&1 &
      ;;
  esac
  PIDS[$i]=$!
  ALL_PIDS+=($!)
}

# healthy SYSTEM I: node I answers its health endpoint as healthy.
healthy() {
  local sys=$1 i=$2
  case $sys in
    bmq) "$BIN/bmqctl" ready --admin "127.0.0.1:$((BMQ_BASE + 200 + i))" >/dev/null 2>&1 ;;
    nats) curl -fsS -m 2 "http://127.0.0.1:$((BASE + 520 + i))/healthz" >/dev/null 2>&1 ;;
    etcd) curl -fsS -m 2 "http://127.0.0.1:$((BASE + 600 + i))/health" 2>/dev/null | grep -q '"true"' ;;
  esac
}

wait_healthy() {
  local sys=$1
  for _ in $(seq 240); do
    local ok=0
    for i in 1 2 3; do healthy "$sys" "$i" && ok=$((ok + 1)); done
    [ $ok = 3 ] && return 0
    sleep 0.5
  done
  echo "error: $sys did not become healthy on all 3 nodes (logs in $OUT/$sys)" >&2
  return 1
}

# setup SYSTEM: fresh data directories and configuration files.
setup() {
  local sys=$1 dir=$OUT/$1
  rm -rf "$dir"
  mkdir -p "$dir"
  case $sys in
    bmq)
      # The per-node configuration files (lib/configs.sh: plain TCP, fsync every_record, the
      # default); the nodes are run directly so the probe can signal them by pid.
      write_configs "$BIN" "$dir" "$BMQ_BASE" >/dev/null
      ;;
    nats)
      for i in 1 2 3; do
        cat >"$dir/n$i.conf" <<EOF
server_name: n$i
listen: 127.0.0.1:$((BASE + 500 + i))
http: 127.0.0.1:$((BASE + 520 + i))
jetstream {
  store_dir: "$dir/n$i"
}
cluster {
  name: bench-peers
  listen: 127.0.0.1:$((BASE + 510 + i))
  routes: [
    nats-route://127.0.0.1:$((BASE + 511))
    nats-route://127.0.0.1:$((BASE + 512))
    nats-route://127.0.0.1:$((BASE + 513))
  ]
}
EOF
      done
      ;;
    etcd) ;;
  esac
}

start_cluster() {
  local sys=$1
  setup "$sys"
  for i in 1 2 3; do start_node "$sys" "$i"; done
  wait_healthy "$sys"
  echo "== $sys: 3 nodes up (pids ${PIDS[1]} ${PIDS[2]} ${PIDS[3]})"
}

stop_cluster() {
  local sys=$1
  for i in 1 2 3; do kill -TERM "${PIDS[$i]}" 2>/dev/null || true; done
  for _ in $(seq 50); do
    local alive=0
    for i in 1 2 3; do kill -0 "${PIDS[$i]}" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for i in 1 2 3; do kill -9 "${PIDS[$i]}" 2>/dev/null || true; wait "${PIDS[$i]}" 2>/dev/null || true; done
  echo "== $sys: stopped"
}

# server_cpu_us: the CPU time (utime + stime, /proc/<pid>/stat, every thread) of the running
# system's three server processes so far, µs (clock-tick resolution, 10 ms).
server_cpu_us() {
  local t=0 i
  for i in 1 2 3; do t=$((t + $(awk '{print $14 + $15}' "/proc/${PIDS[$i]}/stat"))); done
  echo $((t * 1000000 / $(getconf CLK_TCK)))
}

# measured SYSTEM WORKLOAD LABEL PROBE-ARGS...: one probe run, then a `server_cpu` line in the
# results: the servers' CPU over the run per operation (the messages it sent or the metadata
# writes it made, as its own result line says).
measured() {
  local sys=$1 workload=$2 label=$3 before after ops="" lines
  shift 3
  lines=$(wc -l <"$RESULTS")
  before=$(server_cpu_us)
  "$PROBE" "$workload" --system "$sys" --servers "$(clients_of "$sys")" --label "$label" "$@" --out "$RESULTS"
  after=$(server_cpu_us)
  # Only a result line this run added counts (a run that wrote none gets no CPU line).
  if [ "$(wc -l <"$RESULTS")" -gt "$lines" ]; then
    case $workload in
      messages) ops=$(tail -n 1 "$RESULTS" | sed -n 's/.*"sent":\([0-9]*\).*/\1/p') ;;
      metadata) ops=$(tail -n 1 "$RESULTS" | sed -n 's/.*"writes":\([0-9]*\).*/\1/p') ;;
    esac
  fi
  if [ -n "$ops" ] && [ "$ops" -gt 0 ]; then
    echo "{\"kind\":\"server_cpu\",\"system\":\"$sys\",\"label\":\"$label\",\"workload\":\"$workload\",\"ops\":$ops,\"cpu_us_per_op\":$(awk "BEGIN {printf \"%.3f\", ($after - $before) / $ops}")}" >>"$RESULTS"
    echo "$sys $workload [$label]: servers' CPU $(((after - before) / 1000)) ms, $(awk "BEGIN {printf \"%.1f\", ($after - $before) / $ops}") us per operation"
  fi
}

workloads() {
  local sys=$1
  if [ "$sys" != etcd ]; then
    measured "$sys" messages "${PRODUCERS}p/${CONSUMERS}c, window $WINDOW" \
      --producers "$PRODUCERS" --consumers "$CONSUMERS" --size "$SIZE" --window "$WINDOW" \
      --count "$MSG_COUNT"
    if [ "$PACED_RATE" != 0 ]; then
      measured "$sys" messages "${PRODUCERS}p/${CONSUMERS}c paced at $PACED_RATE msgs/s" \
        --producers "$PRODUCERS" --consumers "$CONSUMERS" --size "$SIZE" --window "$WINDOW" \
        --rate "$PACED_RATE" --duration-secs "$PACED_SECS"
    fi
  fi
  if [ "$sys" != nats ]; then
    for k in $META_PARALLEL; do
      measured "$sys" metadata "metadata writes, $k in flight" --count "$META_COUNT" --parallel "$k"
    done
  fi
}

failovers() {
  local sys=$1 scenarios
  case $sys in
    bmq) scenarios="leader-stop leader-kill primary-kill" ;;
    nats) scenarios="leader-stop primary-kill" ;;
    etcd) scenarios="leader-stop leader-kill" ;;
  esac
  for scenario in $scenarios; do
    for _ in $(seq "$FAILOVER_RUNS"); do
      rm -f "$OUT/killed"
      "$PROBE" failover --system "$sys" --scenario "$scenario" --servers "$(clients_of "$sys")" \
        --status "$(status_of "$sys")" --pids "${PIDS[1]},${PIDS[2]},${PIDS[3]}" \
        --killed-file "$OUT/killed" --out "$RESULTS" ||
        echo "warning: a $sys $scenario run could not be made (see above); going on"
      if [ "$scenario" != leader-stop ] && [ -f "$OUT/killed" ]; then
        local i=$(($(cat "$OUT/killed") + 1))
        wait "${PIDS[$i]}" 2>/dev/null || true
        start_node "$sys" "$i"
        wait_healthy "$sys"
      fi
    done
  done
}

{
  echo "# scripts/bench-peers.sh, $(date -u +%FT%TZ)"
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "ours: $BIN/broker; nats-server: $("$NATS_SERVER" --version 2>&1 | head -n 1); etcd: $("$ETCD" --version 2>&1 | head -n 1)"
  echo "machine: $(nproc) cores, $(uname -r)"
  echo "settings: SYSTEMS='$SYSTEMS' ROUNDS=$ROUNDS MSG_COUNT=$MSG_COUNT PRODUCERS=$PRODUCERS CONSUMERS=$CONSUMERS SIZE=$SIZE WINDOW=$WINDOW PACED_RATE=$PACED_RATE PACED_SECS=$PACED_SECS META_COUNT=$META_COUNT META_PARALLEL='$META_PARALLEL' FAILOVER_RUNS=$FAILOVER_RUNS"
  echo "load average at start: $(cat /proc/loadavg)"
} | tee "$OUT/header.txt"

for round in $(seq "$ROUNDS"); do
  for sys in $SYSTEMS; do
    echo "== round $round: $sys"
    start_cluster "$sys"
    workloads "$sys"
    stop_cluster "$sys"
  done
done
if [ "$FAILOVER_RUNS" != 0 ]; then
  for sys in $SYSTEMS; do
    echo "== failover: $sys ($FAILOVER_RUNS runs per scenario)"
    start_cluster "$sys"
    # Without bash's notice of each node this script's probe SIGKILLed ("... Killed ...").
    failovers "$sys" 2> >(grep --line-buffered -v '^.*line [0-9]*: *[0-9]* Killed' >&2)
    stop_cluster "$sys"
  done
fi

echo "load average at end: $(cat /proc/loadavg)" | tee -a "$OUT/header.txt"
echo
"$PROBE" report "$RESULTS" | tee "$OUT/report.md"
echo
echo "results: $RESULTS, table: $OUT/report.md, node logs: $OUT/<system>/"
