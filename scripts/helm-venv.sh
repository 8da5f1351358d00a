#!/usr/bin/env bash
# Provisions the Python virtualenv of the Helm chart check (scripts/helm_check.py): the Helm
# engine as a Python library (helm-python-sdk, a wheel with Helm's Go SDK compiled in, so no
# helm binary is needed) and kubernetes-validate (the Kubernetes API's JSON schemas for each
# release), at pinned versions, from PyPI.
#
#   scripts/helm-venv.sh             # venv in target/helm-venv (relative to the repo root)
#   scripts/helm-venv.sh DIR         # venv in DIR (relative to the current directory)
#
# Prints the venv's python path as the last line of standard output; everything else goes to
# standard error. Idempotent: nothing is installed again while the venv's marker file records
# exactly these pins and both packages import. Uses `python3 -m venv` ($PYTHON overrides the
# interpreter); installs Debian's python3-venv with apt-get when the venv module is missing.
# Concurrent runs wait for each other.
set -euo pipefail

PINS=("helm-python-sdk==0.2.2" "kubernetes-validate==1.37.0")
PYTHON="${PYTHON:-python3}"
CHECK='import helm_python, kubernetes_validate.utils, yaml, tomllib'

if [ $# -gt 0 ]; then
  mkdir -p "$1"
  VENV="$(cd "$1" && pwd)"
else
  ROOT="$(cd "$(dirname "$0")/.." && pwd)"
  VENV="$ROOT/target/helm-venv"
  mkdir -p "$VENV"
fi
MARKER="$VENV/.helm-venv-pins"
VPY="$VENV/bin/python"

log() { echo "helm-venv: $*" >&2; }

if command -v flock >/dev/null 2>&1; then
  exec 9>"$VENV.lock"
  flock 9
fi

want="$(printf '%s\n' "${PINS[@]}")"
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$want" ] && "$VPY" -c "$CHECK" >/dev/null 2>&1; then
  echo "$VPY"
  exit 0
fi

if ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  log "installing python3-venv (Debian package)"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    sudo apt-get update -qq >&2 && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  else
    log "error: python3-venv missing and neither root nor sudo is available to install it"
    exit 1
  fi
fi
# tomllib (the rendered broker configurations are parsed with it) is in Python 3.11 and later.
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { log "error: $PYTHON is older than 3.11 (no tomllib); set PYTHON"; exit 1; }

if ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
  log "creating $VENV"
  "$PYTHON" -m venv --clear "$VENV" >&2
fi

rm -f "$MARKER"
log "installing ${PINS[*]}"
PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 "$VPY" -m pip install -q "${PINS[@]}" >&2
"$VPY" -c "$CHECK" >&2
echo "$want" >"$MARKER"
echo "$VPY"
