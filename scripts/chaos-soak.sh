#!/usr/bin/env bash
# Randomized chaos soak (DESIGN.md §10.5): runs the `soak` test of tests/tests/chaos.rs, which
# starts a cluster with every broker in its own network namespace, runs a recorded workload,
# and applies random faults (isolation, minority/majority partitions, a cut between the leader
# and one node, packet loss, delay when the kernel has sch_netem, SIGKILL, SIGSTOP, SIGTERM +
# restart) and membership changes (a spare node joins through `join` and is added, or a member,
# the leader too, is removed; a SIGKILL of the leader, of another member or of the joiner in the
# middle of it, or none) for the given time, healing and requiring convergence after each (and
# after a change, the committed membership settled: a removed node must exit). At the end it
# checks the history (no acked message lost, nothing phantom, per-producer order, one leader
# per term) and writes a report: faults applied, operation counts, violations.
#
# Needs root (network namespaces, iptables); installs iproute2/iptables with apt-get if missing.
#
# Usage: scripts/chaos-soak.sh [--seconds N] [--seed S] [--nodes N] [--report PATH] [--release]
#   --seconds  how long faults are injected (default 300)
#   --seed     seed of the fault schedule (default random; printed, and in the report)
#   --nodes    cluster size, 3..7 (default 5)
#   --membership-percent P  share of rounds that change the membership (default 10)
#   --report   JSON report path (default target/chaos/report-<seed>.json; a .txt sits next to it)
#   --release  build and run optimised
# Exit status: 0 when the run found no violation, non-zero otherwise (the report says why).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=300
seed=""
nodes=5
membership=10
report=""
profile=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --nodes) nodes="$2"; shift 2 ;;
    --membership-percent) membership="$2"; shift 2 ;;
    --report) report="$2"; shift 2 ;;
    --release) profile=(--release); shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "chaos-soak: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

if [[ "$(id -u)" != 0 ]]; then
  echo "chaos-soak: needs root (network namespaces and iptables)" >&2
  exit 2
fi
if [[ -z "$seed" ]]; then
  seed=$(( (RANDOM << 30) | (RANDOM << 15) | RANDOM ))
fi
if [[ -z "$report" ]]; then
  report="$PWD/target/chaos/report-$seed.json"
fi
# Absolute: the test runs in the tests crate's directory, not this one (the test makes the
# report's directory).
report=$(realpath -m "$report")

echo "chaos-soak: ${seconds}s, ${nodes} nodes, seed ${seed}, report ${report}"
cargo build -q "${profile[@]}" --workspace --all-targets
status=0
BMQ_CHAOS_SECONDS="$seconds" BMQ_CHAOS_SEED="$seed" BMQ_CHAOS_NODES="$nodes" \
  BMQ_CHAOS_MEMBERSHIP_PERCENT="$membership" BMQ_CHAOS_REPORT="$report" \
  cargo test -q "${profile[@]}" -p bmq-tests --test chaos -- --ignored --exact soak --nocapture \
  || status=$?
if [[ -f "${report%.json}.txt" ]]; then
  echo "== report (${report%.json}.txt)"
  cat "${report%.json}.txt"
fi
exit "$status"
