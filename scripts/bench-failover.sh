#!/usr/bin/env bash
# Failover benchmark (method in scripts/bench_failover.py and BENCHMARKS.md):
# RUNS (default 20) leader SIGKILLs -> new leader, and RUNS primary SIGKILLs -> first ACK.
#   scripts/bench-failover.sh            # both
#   RUNS=50 scripts/bench-failover.sh leader      # or: metadata, primary
#   PREFILL=100000 RUNS=10 scripts/bench-failover.sh metadata   # with 100,000 queues assigned
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins --locked
exec python3 scripts/bench_failover.py "$@"
