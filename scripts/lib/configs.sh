# Sourced by the scripts that run a local cluster's broker processes themselves (lib/cluster.sh,
# soak-storage.sh, bench-peers.sh; bench_failover.py and bench_heartbeat_jitter.py through
# bash): the one place that writes such a cluster's configuration files. Defines functions
# only, so it can be sourced beside any other variables.

# write_configs BIN DIR BASE: fresh configuration files of a local 3-node cluster in DIR
# (DIR/node-<i>/broker.toml; node i on ports BASE+i client, BASE+100+i peer, BASE+200+i admin;
# plain TCP; the embedded defaults), written by BIN/bmqctl's `cluster up --configs-only`, which
# starts no broker and prints the files' paths. DIR is replaced. Each build writes its own
# files, since an older broker may refuse a newer build's keys. Fails as bmqctl does.
write_configs() {
  local bin=$1 dir=$2 base_port=$3 help
  # Captured, not piped into `grep -q`: under pipefail an early grep exit could fail the test.
  help=$("$bin/bmqctl" cluster up --help 2>/dev/null || true)
  if [[ $help == *--configs-only* ]]; then
    "$bin/bmqctl" cluster up --configs-only --dir "$dir" --base-port "$base_port" --no-security --clean
    return
  fi
  # A build older than --configs-only (an A/B baseline): its `cluster up` writes the files,
  # then starts the nodes; it is interrupted once node 1 is ready, and what the nodes wrote is
  # removed so that their state is as fresh as with the flag.
  rm -rf "$dir"
  "$bin/bmqctl" cluster up --dir "$dir" --base-port "$base_port" --no-security --no-prometheus --clean >/dev/null 2>&1 &
  local up=$! i
  for _ in $(seq 120); do
    [ -f "$dir/node-3/broker.toml" ] && "$bin/bmqctl" ready --admin 127.0.0.1:$((base_port + 201)) >/dev/null 2>&1 && break
    sleep 0.5
  done
  kill -INT $up 2>/dev/null || true
  wait $up || true
  # Its nodes stop on the interrupt: wait until node 1's admin port no longer answers.
  for _ in $(seq 100); do "$bin/bmqctl" ready --admin 127.0.0.1:$((base_port + 201)) >/dev/null 2>&1 || break; sleep 0.1; done
  for i in 1 2 3; do
    [ -f "$dir/node-$i/broker.toml" ] || { echo "error: $bin/bmqctl wrote no $dir/node-$i/broker.toml" >&2; return 1; }
    find "$dir/node-$i" -mindepth 1 -maxdepth 1 ! -name broker.toml -exec rm -rf {} +
  done
  echo "wrote the configurations of 3 nodes in $dir"
}
