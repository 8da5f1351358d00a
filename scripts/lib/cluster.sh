# Sourced by the benchmark scripts (bench-local.sh, bench-throughput.sh, bench-stalls.sh,
# profile-flamegraph.sh and others): a local 3-node cluster of one build whose broker processes
# the script starts itself, so it knows their pids (to read their CPU time, to profile them) and
# kills them on every exit. Reads DIR (the cluster's directory, replaced), BASE (its base port:
# clients BASE+1..3, admin BASE+201..203), PARTITIONS (if set: the nodes' partition_count
# instead of the default), SEGMENT_MB (if set: their storage.segment_size_mb), LEDGER_MB (if
# set: their metadata.ledger_max_file_size_bytes, in MiB) and METADATA_FSYNC (if set: their
# metadata.fsync); sets PIDS and BROKERS (the nodes' client addresses, as `bmqctl --broker`
# takes them). The caller traps EXIT with stop_cluster.

# shellcheck source=lib/configs.sh
. "$(dirname "${BASH_SOURCE[0]}")/configs.sh"

PIDS=()
BROKERS=127.0.0.1:$((BASE + 1)),127.0.0.1:$((BASE + 2)),127.0.0.1:$((BASE + 3))

# need_perf: installs `perf` (Debian's linux-perf, apt-get; needs root) when it is missing.
need_perf() {
  if ! command -v perf >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-perf >/dev/null
  fi
}

# release_builds [DIR...]: sets BUILDS to the release directories given (each with broker and
# bmqctl), or, with none, builds this tree and uses its own.
release_builds() {
  BUILDS=("$@")
  if [ ${#BUILDS[@]} -eq 0 ]; then
    cargo build --release --bins --locked
    BUILDS=("$PWD/target/release")
  fi
}

# cluster_leader BIN: the elector leader's node id, as node 1's admin /status names it.
cluster_leader() {
  "$1/bmqctl" status --admin 127.0.0.1:$((BASE + 201)) --json \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["status"]["elector"]["leader"])'
}

# bench_load BIN WORKLOAD N [ARG...]: the benchmark load with BIN's bmqctl, quiet, plain TCP
# (further ARGs go to `bmqctl bench`):
#   messages  N messages, 1 producer / 1 consumer, 1 KiB, strong, window 256, on BROKERS;
#   metadata  N queue assignments (an open and a close each), PARALLEL (64) in flight, the
#             client on the elector leader.
bench_load() {
  local bin=$1 workload=$2 n=$3
  shift 3
  case $workload in
    messages)
      "$bin/bmqctl" bench messages --count "$n" --size 1024 --window 256 --broker "$BROKERS" \
        --no-tls --token "" --quiet "$@" ;;
    metadata)
      "$bin/bmqctl" bench metadata --queues "$n" --parallel "${PARALLEL:-64}" \
        --broker 127.0.0.1:$((BASE + $(cluster_leader "$bin"))) --no-tls --token "" --quiet "$@" ;;
    *) echo "WORKLOAD is messages or metadata" >&2; return 2 ;;
  esac
}

# broker_cpu_ms: the CPU time (utime + stime, /proc/<pid>/stat) of the nodes in PIDS so far, ms.
broker_cpu_ms() {
  local t=0 hz
  hz=$(getconf CLK_TCK)
  for p in "${PIDS[@]}"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done
  echo $((t * 1000 / hz))
}

# broker_context_switches: the context switches (voluntary and involuntary) of every thread of
# the nodes in PIDS so far (/proc/<pid>/task/*/status).
broker_context_switches() {
  local t=0 p f
  for p in "${PIDS[@]}"; do
    for f in /proc/"$p"/task/*/status; do
      t=$((t + $(awk '/ctxt_switches/ {s += $2} END {print s + 0}' "$f" 2>/dev/null || echo 0)))
    done
  done
  echo "$t"
}

# Kills the nodes and waits until they are gone (their ports are free for the next cluster).
stop_cluster() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]:-}"; do
    while [ -n "$p" ] && kill -0 "$p" 2>/dev/null; do sleep 0.05; done
  done
  PIDS=()
}

# start_cluster BIN: a fresh cluster of BIN/broker (configuration from write_configs in
# configs.sh, then the edits the variables above ask for), every node ready; 1 if it does not
# get ready.
start_cluster() {
  local bin=$1
  stop_cluster
  write_configs "$bin" "$DIR" "$BASE" >/dev/null
  if [ -n "${PARTITIONS:-}" ]; then
    # The nodes have not started yet, so no ledger holds the default's partitions.
    for i in 1 2 3; do
      sed -i "s/^partition_count = .*/partition_count = $PARTITIONS/" "$DIR/node-$i/broker.toml"
    done
  fi
  if [ -n "${LEDGER_MB:-}" ]; then
    # Metadata ledger files of another size (metadata.ledger_max_file_size_bytes).
    for i in 1 2 3; do
      sed -i "s/^ledger_max_file_size_bytes = .*/ledger_max_file_size_bytes = $((LEDGER_MB * 1048576))/" "$DIR/node-$i/broker.toml"
    done
  fi
  if [ -n "${SEGMENT_MB:-}" ]; then
    # Journal segments of another size (storage.segment_size_mb): new segments take it.
    for i in 1 2 3; do
      sed -i "s/^segment_size_mb = .*/segment_size_mb = $SEGMENT_MB/" "$DIR/node-$i/broker.toml"
    done
  fi
  if [ -n "${METADATA_FSYNC:-}" ]; then
    # metadata.fsync: the only `fsync` key of the file; added under [metadata] if absent.
    for i in 1 2 3; do
      local config=$DIR/node-$i/broker.toml
      sed -i "s/^fsync = .*/fsync = \"$METADATA_FSYNC\"/" "$config"
      grep -q '^fsync' "$config" || sed -i "s/^\[metadata\]/[metadata]\nfsync = \"$METADATA_FSYNC\"/" "$config"
    done
  fi
  for i in 1 2 3; do
    "$bin/broker" --config "$DIR/node-$i/broker.toml" >>"$DIR/node-$i/bench.log" 2>&1 &
    PIDS+=($!)
    disown # no "Killed" notice when the run ends
  done
  for _ in $(seq 120); do
    local ok=0
    for i in 1 2 3; do "$bin/bmqctl" ready --admin 127.0.0.1:$((BASE + 200 + i)) >/dev/null 2>&1 && ok=$((ok + 1)); done
    [ $ok = 3 ] && return 0
    sleep 0.5
  done
  echo "cluster of $bin not ready" >&2
  return 1
}
