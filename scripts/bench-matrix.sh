#!/usr/bin/env bash
# The data path beyond one producer and one queue: a matrix of cells, each the same message
# workload (scripts/peer-probe's `messages`) run against our cluster and then against NATS
# JetStream R3, one system at a time on a fresh cluster of its own (loopback, fsync'd storage in
# a temporary directory, as scripts/bench-peers.sh runs them), then a table with the ratio to
# NATS per cell. A cell is: nodes, producers x consumers, queues, message size. For each cell
# and system: msgs/s and MB/s (received), ACK and end-to-end p50/p99, the servers' CPU per
# message (utime + stime of every node, /proc/<pid>/stat, over the run / messages sent) and the
# resident set of each node at the end of the run (/proc/<pid>/status VmRSS, and RssAnon, the
# part that is not mapped files such as journal segments; VmHWM, the peak, beside them in
# results.jsonl), and whether every queue delivered, each message at least once.
#
#   scripts/bench-matrix.sh                                  # the whole matrix (72 cells)
#   PC="1x1 8x8" QUEUES="1 100" SIZES="1024 65536" NODES=3 SECS=5 scripts/bench-matrix.sh
#   CELLS="3:1x1:1:1048576 3:8x8:10000:1024:50000 5:1x1:1:1024" scripts/bench-matrix.sh
#   BIN=/path/to/other/release scripts/bench-matrix.sh       # another build of ours
#
# Queues: ours, Q queues in domain bmq.test (strong consistency); NATS, one stream (file
# storage, R3, work-queue retention) with a subject and a filtered durable pull consumer per
# queue (scripts/peer-probe/src/messages.rs says why subjects rather than streams). Producers
# and consumers are spread over the queues: with Q >= clients each queue has exactly one
# consumer and one producer; a producer sends to its queues in turn.
#
# Settings (environment):
#   PC             producers x consumers of the matrix ("1x1 8x8 64x64")
#   QUEUES         queue counts ("1 100 10000")
#   SIZES          message sizes, bytes ("100 1024 65536 1048576")
#   NODES          node counts ("3 5"); NATS runs as many servers, its streams R3 in every case
#   CELLS          instead of the cross product above, exactly these cells, each
#                  NODES:PxC:QUEUES:SIZE[:MSGS] (MSGS: that cell sends so many messages in all
#                  instead of running SECS seconds)
#   SECS           seconds each cell produces (5); MSGS, when set, a message count instead
#   WINDOW         most unacknowledged PUTs per producer (256), lowered for large messages so
#                  that one producer has at most WINDOW_BYTES (16 MiB) in flight: 16 at 1 MiB
#   MAX_UNCONFIRMED  delivered-but-unconfirmed messages per queue (1000)
#   DRAIN_SECS     how long after producing a cell waits for the last deliveries (30)
#   CELL_TIMEOUT   a probe run that takes longer is stopped and the cell marked failed (600 s)
#   SYSTEMS        "bmq nats" (either alone for a quick look)
#   OUT            results directory (/tmp/bmq-bench-matrix): results.jsonl, report.md,
#                  header.txt, probe.log, logs/<system>-<cell>/ (every node's log)
#   BASE_PORT      first port (24000): ours +100.. (client +101.., bmqp +114.., peer +201..,
#                  admin +301..), NATS +501.. (client), +521.. (cluster), +541.. (monitoring)
#   BIN, PROBE     our release binaries (default: built here) and the probe binary
#
# Installs Debian's nats-server with apt-get when missing (as root, or through sudo). NATS's
# max_payload is raised to 8 MiB here (its default, 1 MiB, refuses a 1 MiB message with its
# headers); nothing else of either system is tuned. NATS 2.9 fsyncs its file store every 60 s,
# ours before a quorum's receipt releases an ACK (BENCHMARKS.md, "Against NATS JetStream").
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PC=${PC:-1x1 8x8 64x64}
QUEUES=${QUEUES:-1 100 10000}
SIZES=${SIZES:-100 1024 65536 1048576}
NODES=${NODES:-3 5}
CELLS=${CELLS:-}
SECS=${SECS:-5}
MSGS=${MSGS:-}
WINDOW=${WINDOW:-256}
WINDOW_BYTES=${WINDOW_BYTES:-16777216}
MAX_UNCONFIRMED=${MAX_UNCONFIRMED:-1000}
DRAIN_SECS=${DRAIN_SECS:-30}
CELL_TIMEOUT=${CELL_TIMEOUT:-600}
SYSTEMS=${SYSTEMS:-bmq nats}
OUT=${OUT:-/tmp/bmq-bench-matrix}
BASE=${BASE_PORT:-24000}
BMQ_BASE=$((BASE + 100))

find_bin() { command -v "$1" 2>/dev/null || { [ -x "/usr/sbin/$1" ] && echo "/usr/sbin/$1"; } || true; }
NATS_SERVER=$(find_bin nats-server)
if [[ " $SYSTEMS " == *" nats "* ]] && [ -z "$NATS_SERVER" ]; then
  echo "== installing nats-server (Debian package)"
  sudo_=""
  [ "$(id -u)" = 0 ] || sudo_=sudo
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends nats-server >/dev/null
  # A machine booted with systemd starts the package's own service: stop it.
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet nats-server 2>/dev/null; then
    $sudo_ systemctl stop nats-server || true
  fi
  NATS_SERVER=$(find_bin nats-server)
fi

if [ -z "${BIN:-}" ]; then
  cargo build --release --bins --locked
  BIN=$ROOT/target/release
fi
if [ -z "${PROBE:-}" ]; then
  echo "== building the probe (scripts/peer-probe, a standalone crate)"
  cargo build --release --locked --manifest-path scripts/peer-probe/Cargo.toml 2>/dev/null ||
    cargo build --release --manifest-path scripts/peer-probe/Cargo.toml
  PROBE=$ROOT/scripts/peer-probe/target/release/peer-probe
fi

rm -rf "$OUT"
mkdir -p "$OUT"
RESULTS=$OUT/results.jsonl
: >"$RESULTS"

# Every process this script starts is in PIDS (node index -> pid) or ALL_PIDS; the trap kills
# them all on every exit.
declare -A PIDS=()
ALL_PIDS=()
cleanup() {
  for p in "${ALL_PIDS[@]:-}"; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# shellcheck source=lib/configs.sh
. scripts/lib/configs.sh # write_configs (3 nodes); 5 nodes are written here the same way

# addrs FIRST_PORT N -> 127.0.0.1:P,...,127.0.0.1:P+N-1
addrs() {
  local i s=""
  for i in $(seq 0 $(($2 - 1))); do s+="${s:+,}127.0.0.1:$(($1 + i))"; done
  echo "$s"
}

# setup SYSTEM N: fresh data directories and configuration files of an N-node cluster.
setup() {
  local sys=$1 n=$2 dir=$OUT/$1 i routes=""
  rm -rf "$dir"
  mkdir -p "$dir"
  case $sys in
    bmq)
      # `bmqctl cluster up --configs-only` as lib/configs.sh calls it, with the node count.
      "$BIN/bmqctl" cluster up --configs-only --nodes "$n" --dir "$dir" --base-port "$BMQ_BASE" \
        --no-security --clean >/dev/null
      ;;
    nats)
      for i in $(seq "$n"); do routes+="    nats-route://127.0.0.1:$((BASE + 520 + i))"$'\n'; done
      for i in $(seq "$n"); do
        cat >"$dir/n$i.conf" <<EOF
server_name: n$i
listen: 127.0.0.1:$((BASE + 500 + i))
http: 127.0.0.1:$((BASE + 540 + i))
max_payload: 8MB
jetstream {
  store_dir: "$dir/n$i"
}
cluster {
  name: bench-matrix
  listen: 127.0.0.1:$((BASE + 520 + i))
  routes: [
$routes  ]
}
EOF
      done
      ;;
  esac
}

start_node() {
  local sys=$1 i=$2 dir=$OUT/$1
  case $sys in
    bmq) "$BIN/broker" --config "$dir/node-$i/broker.toml" >>"$dir/node-$i.log" 2>&1 & ;;
    nats) "$NATS_SERVER" -c "$dir/n$i.conf" >>"$dir/n$i.log" 2>&1 & ;;
  esac
  PIDS[$i]=$!
  ALL_PIDS+=($!)
}

healthy() {
  case $1 in
    bmq) "$BIN/bmqctl" ready --admin "127.0.0.1:$((BMQ_BASE + 200 + $2))" >/dev/null 2>&1 ;;
    # JetStream ready (a meta leader elected), not only the server up.
    nats) curl -fsS -m 2 "http://127.0.0.1:$((BASE + 540 + $2))/healthz" >/dev/null 2>&1 &&
      curl -fsS -m 2 "http://127.0.0.1:$((BASE + 540 + $2))/jsz" 2>/dev/null | grep -q '"leader"' ;;
  esac
}

start_cluster() {
  local sys=$1 n=$2 i ok
  setup "$sys" "$n"
  PIDS=()
  for i in $(seq "$n"); do start_node "$sys" "$i"; done
  for _ in $(seq 240); do
    ok=0
    for i in $(seq "$n"); do healthy "$sys" "$i" && ok=$((ok + 1)); done
    [ "$ok" = "$n" ] && return 0
    sleep 0.5
  done
  echo "error: $sys did not become healthy on all $n nodes (logs in $OUT/$sys)" >&2
  return 1
}

stop_cluster() {
  local i alive
  for i in "${!PIDS[@]}"; do kill -TERM "${PIDS[$i]}" 2>/dev/null || true; done
  for _ in $(seq 100); do
    alive=0
    for i in "${!PIDS[@]}"; do kill -0 "${PIDS[$i]}" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for i in "${!PIDS[@]}"; do kill -9 "${PIDS[$i]}" 2>/dev/null || true; wait "${PIDS[$i]}" 2>/dev/null || true; done
}

# server_cpu_us N: CPU time (utime + stime, every thread) of the N running nodes so far, µs.
server_cpu_us() {
  local t=0 i
  for i in $(seq "$1"); do t=$((t + $(awk '{print $14 + $15}' "/proc/${PIDS[$i]}/stat"))); done
  echo $((t * 1000000 / $(getconf CLK_TCK)))
}

# status_kib N FIELD: FIELD (VmRSS, VmHWM) of each of the N nodes, KiB, as a JSON array.
status_kib() {
  local i s=""
  for i in $(seq "$1"); do
    s+="${s:+,}$(awk -v f="$2:" '$1 == f {print $2}' "/proc/${PIDS[$i]}/status" 2>/dev/null || echo 0)"
  done
  echo "[$s]"
}

# run_cell SYSTEM N P C Q SIZE [MSGS]: one cell on a fresh N-node cluster of SYSTEM; appends the
# probe's `messages` line and a `cell` line (CPU, RSS, outcome) to the results.
run_cell() {
  local sys=$1 n=$2 p=$3 c=$4 q=$5 size=$6 msgs=${7:-$MSGS} window label before after rc lines
  window=$((WINDOW_BYTES / size))
  [ "$window" -gt "$WINDOW" ] && window=$WINDOW
  [ "$window" -lt 1 ] && window=1
  label="${n}n ${p}x${c} q${q} ${size}B"
  local amount=(--duration-secs "$SECS")
  [ -n "$msgs" ] && amount=(--count "$msgs")
  echo "== $sys [$label] window $window, ${amount[*]}, load $(cut -d' ' -f1 /proc/loadavg)"
  if ! start_cluster "$sys" "$n"; then
    stop_cluster
    echo "{\"kind\":\"cell\",\"system\":\"$sys\",\"label\":\"$label\",\"nodes\":$n,\"ok\":false,\"error\":\"cluster did not start\"}" >>"$RESULTS"
    return
  fi
  lines=$(wc -l <"$RESULTS")
  before=$(server_cpu_us "$n")
  set +e
  timeout "$CELL_TIMEOUT" "$PROBE" messages --system "$sys" --servers "$(clients "$sys" "$n")" \
    --label "$label" --producers "$p" --consumers "$c" --queues "$q" --size "$size" \
    --window "$window" --max-unconfirmed "$MAX_UNCONFIRMED" --drain-timeout-secs "$DRAIN_SECS" \
    "${amount[@]}" --out "$RESULTS" 2>&1 | tee -a "$OUT/probe.log"
  rc=${PIPESTATUS[0]}
  set -e
  after=$(server_cpu_us "$n")
  local rss hwm anon sent=0 err=""
  rss=$(status_kib "$n" VmRSS)
  hwm=$(status_kib "$n" VmHWM)
  anon=$(status_kib "$n" RssAnon)
  if [ "$(wc -l <"$RESULTS")" -gt "$lines" ]; then
    sent=$(tail -n 1 "$RESULTS" | sed -n 's/.*"sent":\([0-9]*\).*/\1/p')
  else
    err="the probe exited with status $rc and no result"
  fi
  local cpu=null
  [ "${sent:-0}" -gt 0 ] && cpu=$(awk "BEGIN {printf \"%.3f\", ($after - $before) / $sent}")
  echo "{\"kind\":\"cell\",\"system\":\"$sys\",\"label\":\"$label\",\"nodes\":$n,\"window\":$window,\"ok\":$([ -z "$err" ] && echo true || echo false),\"error\":\"$err\",\"cpu_us_per_msg\":$cpu,\"rss_kib\":$rss,\"hwm_kib\":$hwm,\"anon_kib\":$anon}" >>"$RESULTS"
  echo "   $sys: servers' CPU $(((after - before) / 1000)) ms ($cpu us/msg), VmRSS KiB $rss"
  stop_cluster
  # The nodes' logs of every cell are kept (the data directories are not: the next cell's setup
  # removes them), to look into a cell afterwards.
  mkdir -p "$OUT/logs/$sys-${label// /-}"
  find "$OUT/$sys" -maxdepth 2 -name '*.log' -exec cp {} "$OUT/logs/$sys-${label// /-}/" \;
}

clients() { # clients SYSTEM N: the client addresses of its N nodes
  case $1 in
    bmq) addrs $((BMQ_BASE + 1)) "$2" ;;
    nats) addrs $((BASE + 501)) "$2" ;;
  esac
}

# The cells, one per line: N P C Q SIZE [MSGS].
cells() {
  local cell n pc q size
  if [ -n "$CELLS" ]; then
    for cell in $CELLS; do
      IFS=: read -r n pc q size msgs <<<"$cell"
      echo "$n ${pc%x*} ${pc#*x} $q $size ${msgs:-}"
    done
    return
  fi
  for n in $NODES; do for pc in $PC; do for q in $QUEUES; do for size in $SIZES; do
    echo "$n ${pc%x*} ${pc#*x} $q $size"
  done; done; done; done
}

{
  echo "# scripts/bench-matrix.sh, $(date -u +%FT%TZ)"
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "ours: $BIN/broker; nats-server: $("$NATS_SERVER" --version 2>&1 | head -n 1)"
  echo "machine: $(nproc) cores, $(uname -r), $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)"
  echo "settings: SYSTEMS='$SYSTEMS' SECS=$SECS MSGS=$MSGS WINDOW=$WINDOW WINDOW_BYTES=$WINDOW_BYTES MAX_UNCONFIRMED=$MAX_UNCONFIRMED DRAIN_SECS=$DRAIN_SECS"
  echo "cells (nodes:PxC:queues:size[:messages]): $(cells | awk '{printf "%s:%sx%s:%s:%s%s ", $1, $2, $3, $4, $5, ($6 ? ":" $6 : "")}')"
  echo "load average at start: $(cat /proc/loadavg)"
} | tee "$OUT/header.txt"

while read -r n p c q size msgs; do
  for sys in $SYSTEMS; do run_cell "$sys" "$n" "$p" "$c" "$q" "$size" "$msgs"; done
done < <(cells)

echo "load average at end: $(cat /proc/loadavg)" | tee -a "$OUT/header.txt"

# The table: one row per cell, ours / NATS beside each figure.
python3 - "$RESULTS" "$OUT/header.txt" >"$OUT/report.md" <<'PY'
import json, sys
rows, order = {}, []
for line in open(sys.argv[1]):
    r = json.loads(line)
    key = (r["label"], r["system"])
    if key not in rows:
        rows[key] = {}
        if r["label"] not in order:
            order.append(r["label"])
    rows[key][r["kind"]] = r

def fig(label, sys):
    d = rows.get((label, sys), {})
    m, c = d.get("messages"), d.get("cell", {})
    if not m:
        return None, c.get("error") or "not run"
    mbps = m["consumed_per_sec"] * m["size"] / 1e6
    rss = c.get("rss_kib") or [0]
    anon = c.get("anon_kib") or [0]
    return {
        "msgs": m["consumed_per_sec"], "mb": mbps,
        "ack50": m["ack"]["p50_ms"], "ack99": m["ack"]["p99_ms"],
        "e2e50": m["e2e"]["p50_ms"], "e2e99": m["e2e"]["p99_ms"],
        "cpu": c.get("cpu_us_per_msg"), "rss": max(rss) / 1024, "anon": max(anon) / 1024,
        "ok": (m["missing"] == 0 and m["errors"] == 0
               and m.get("duplicates", 0) <= m["redeliveries"]
               and m.get("queues_delivered", 1) == m.get("queues", 1) and m["received"] > 0),
        "note": f'{m.get("queues_delivered", "?")}/{m.get("queues", 1)} queues delivered, '
                f'missing {m["missing"]}, errors {m["errors"]}, '
                f'duplicates {m.get("duplicates", "?")} ({m["redeliveries"]} flagged)',
        "load": m["loadavg"],
    }, None

def f(x, d=0):
    return "—" if x is None else f"{x:,.{d}f}"

def ratio(a, b, higher_better=True):
    if a is None or b is None or a == 0 or b == 0:
        return "—"
    return f"{(a / b if higher_better else b / a):.2f}x"

print(open(sys.argv[2]).read().strip().replace("\n", "  \n"))
print()
print("Each cell: ours | NATS | ours/NATS (for latencies, CPU and RSS: NATS/ours, so > 1 is ours better).")
print("msgs/s and MB/s received; ACK and e2e in ms; CPU = all nodes' µs per message; RSS = largest node's VmRSS at the end, MiB (anon = its RssAnon, without the file pages mapped).")
print()
print("| cell | msgs/s | MB/s | ACK p50 | ACK p99 | e2e p50 | e2e p99 | CPU µs/msg | RSS MiB | anon MiB | limits | target |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for label in order:
    o, oerr = fig(label, "bmq")
    n, nerr = fig(label, "nats")
    def col(k, d, hb=True):
        a = o[k] if o else None
        b = n[k] if n else None
        return f"{f(a, d)} \\| {f(b, d)} \\| {ratio(a, b, hb)}"
    limits = []
    for name, x, err in (("ours", o, oerr), ("NATS", n, nerr)):
        if x is None:
            limits.append(f"{name}: FAILED ({err})")
        elif not x["ok"]:
            limits.append(f"{name}: {x['note']}")
    size = int(label.split()[-1].rstrip("B"))
    want = 4.0 if size == 1024 else 2.0
    if o and n and n["msgs"]:
        r = o["msgs"] / n["msgs"]
        target = f"{'met' if r >= want else 'missed'} (≥ {want:.0f}x)"
    else:
        target = "—"
    print(f"| {label} | {col('msgs', 0)} | {col('mb', 1)} | {col('ack50', 2, False)} | "
          f"{col('ack99', 2, False)} | {col('e2e50', 2, False)} | {col('e2e99', 2, False)} | "
          f"{col('cpu', 1, False)} | {col('rss', 0, False)} | {col('anon', 0, False)} | {'; '.join(limits) or 'ok'} | {target} |")
PY
echo
cat "$OUT/report.md"
echo
echo "results: $RESULTS, table: $OUT/report.md"
