#!/usr/bin/env bash
# Provisions the Python virtualenv of the BlazingMQ SDK acceptance suite (tests/sdk/): the
# official Python SDK (blazingmq, from PyPI; a self-contained wheel, no compiler needed) and
# pytest, at pinned versions.
#
#   scripts/sdk-venv.sh              # venv in target/sdk-venv (relative to the repo root)
#   scripts/sdk-venv.sh DIR          # venv in DIR (relative to the current directory)
#
# Prints the venv's python path as the last line of standard output; everything else goes to
# standard error, and pip runs quietly. Idempotent: nothing is installed again when the venv's
# marker file records exactly these pins and `import blazingmq` works. Uses `python3 -m venv`
# ($PYTHON overrides the interpreter; the wheel exists for CPython 3.9-3.13); when the venv
# module (ensurepip) is missing, installs Debian's python3-venv with apt-get (as root, or with
# sudo), like scripts/test.sh does for its packages. Concurrent runs wait for each other.
set -euo pipefail

PINS=("blazingmq==1.2.2" "pytest==8.4.2")
PYTHON="${PYTHON:-python3}"

if [ $# -gt 0 ]; then
  mkdir -p "$1"
  VENV="$(cd "$1" && pwd)"
else
  ROOT="$(cd "$(dirname "$0")/.." && pwd)"
  VENV="$ROOT/target/sdk-venv"
  mkdir -p "$VENV"
fi
MARKER="$VENV/.sdk-venv-pins"
VPY="$VENV/bin/python"

log() { echo "sdk-venv: $*" >&2; }

apt_install() {
  local packages=("$@")
  log "installing ${packages[*]} (Debian packages)"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    sudo apt-get update -qq >&2 && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  else
    log "error: ${packages[*]} missing and neither root nor sudo is available to install them"
    exit 1
  fi
}

# One provisioning at a time per venv (parallel test runs may call this script together). The
# lock file sits next to the venv, since `venv --clear` empties the venv's directory.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$VENV.lock"
  flock 9
fi

want="$(printf '%s\n' "${PINS[@]}")"
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$want" ] \
  && "$VPY" -c 'import blazingmq, pytest' >/dev/null 2>&1; then
  echo "$VPY"
  exit 0
fi

if ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  apt_install python3-venv
fi

# A venv whose interpreter no longer runs (moved, or its base python upgraded) is rebuilt.
if ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
  log "creating $VENV"
  "$PYTHON" -m venv --clear "$VENV" >&2
fi

rm -f "$MARKER"
log "installing ${PINS[*]}"
PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 "$VPY" -m pip install -q "${PINS[@]}" >&2
"$VPY" -c 'import blazingmq, pytest' >&2
echo "$want" >"$MARKER"
echo "$VPY"
