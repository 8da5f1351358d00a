#!/usr/bin/env bash
# Heartbeat send/receive jitter while `bmqctl bench metadata` commits advisories
# (method in scripts/bench_heartbeat_jitter.py, figures in BENCHMARKS.md).
#   scripts/bench-heartbeat-jitter.sh
#   QUEUES=2000 PARALLEL=8 scripts/bench-heartbeat-jitter.sh     # defaults: 10000 queues, 64 in parallel
#   BIN=/path/to/other/release scripts/bench-heartbeat-jitter.sh   # another build, same method
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${BIN:-}" ] || cargo build --release --bins --locked
exec python3 scripts/bench_heartbeat_jitter.py "$@"
