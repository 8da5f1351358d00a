#!/usr/bin/env bash
# Membership benchmark (method in scripts/bench_membership.py and BENCHMARKS.md): RUNS (default
# 10) times a running node added (add-member -> voter) and removed, with PREFILL queues and
# OUTSTANDING_MIB MiB of unconsumed messages.
#   scripts/bench-membership.sh
#   PREFILL=100000 RUNS=5 scripts/bench-membership.sh
#   OUTSTANDING_MIB=1024 PACED=0 RUNS=3 scripts/bench-membership.sh   # 1 GiB to catch up
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins --locked
exec python3 scripts/bench_membership.py "$@"
