#!/usr/bin/env bash
# Failover benchmark (issue 8; method in scripts/bench_failover.py and BENCHMARKS.md):
# RUNS (default 20) leader SIGKILLs -> new leader, and RUNS primary SIGKILLs -> first ACK.
#   scripts/bench-failover.sh            # both
#   RUNS=50 scripts/bench-failover.sh leader      # or: metadata, primary
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins --locked
exec python3 scripts/bench_failover.py "$@"
