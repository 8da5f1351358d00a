#!/usr/bin/env bash
# Failover benchmark (method in scripts/bench_failover.py and BENCHMARKS.md):
# RUNS (default 20) leader SIGKILLs -> new leader, and RUNS primary SIGKILLs -> first ACK.
#   scripts/bench-failover.sh            # both
#   RUNS=50 scripts/bench-failover.sh leader      # or: metadata, primary
#   PREFILL=100000 RUNS=10 scripts/bench-failover.sh metadata   # with 100,000 queues assigned
#   PREFILL=100000 scripts/bench-failover.sh open silent restart primary   # several modes
# Modes: leader, metadata, open (and open on a partition of the killed leader), silent,
# restart, primary. Every mode at 100, 100,000 and 1,000,000 queues: bench-failover-sizes.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins --locked
exec python3 scripts/bench_failover.py "$@"
