#!/usr/bin/env bash
# Builds the container images of the broker cluster without a container registry:
#
#   bmq-broker:local      the `broker` and `bmqctl` binaries that cargo built on this machine
#   bmq-prometheus:local  Debian's `prometheus` package with docker/prometheus.yml, the alert
#                         rules of dashboards/prometheus/alerts.yml and the console pages of
#                         dashboards/consoles/
#
# Both Dockerfiles start `FROM ${BASE}`. On a machine with a registry the base is the standard
# `debian:<release>-slim`; with `--local-base` (the default when that image cannot be found
# locally and no registry is configured) this script first makes `bmq-base:<release>` itself:
# `debootstrap --variant=minbase` from the Debian mirror this machine's apt already uses,
# imported with `docker import`. It is made once and reused while the image exists.
#
# The Rust code is never compiled inside a container: the script runs `cargo build` on the host
# (a no-op when the binaries are fresh) and copies them into the build context
# target/docker-context/. The binaries link glibc dynamically, so the base is the Debian release
# this machine runs (/etc/os-release), whose glibc is the one they were linked against.
#
# Usage: scripts/docker-build.sh [--profile release|debug] [--local-base|--registry-base]
#                                [--no-cargo] [--no-prometheus]
#   --profile        cargo profile whose binaries go into the image (default: release)
#   --local-base     make and use bmq-base:<release> (debootstrap; needs root and debootstrap)
#   --registry-base  use debian:<release>-slim (pulled from a registry if not present)
#   --no-cargo       do not run cargo build; use the binaries already in target/<profile>
#   --no-prometheus  build only the broker image
# Environment: BMQ_BROKER_IMAGE, BMQ_PROMETHEUS_IMAGE (image names), BMQ_BASE (a base image
# to use as is), BMQ_DEBIAN_MIRROR (debootstrap mirror; default: from /etc/apt/sources.list*).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

profile=release
base_mode=auto
run_cargo=1
build_prometheus=1
while [ $# -gt 0 ]; do
    case "$1" in
        --profile) profile=${2:?--profile needs release or debug}; shift 2 ;;
        --profile=*) profile=${1#--profile=}; shift ;;
        --local-base) base_mode=local; shift ;;
        --registry-base) base_mode=registry; shift ;;
        --no-cargo) run_cargo=0; shift ;;
        --no-prometheus) build_prometheus=0; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "docker-build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$profile" in
    release|debug) ;;
    *) echo "docker-build.sh: --profile must be release or debug, not $profile" >&2; exit 2 ;;
esac

BROKER_IMAGE=${BMQ_BROKER_IMAGE:-bmq-broker:local}
PROMETHEUS_IMAGE=${BMQ_PROMETHEUS_IMAGE:-bmq-prometheus:local}
log() { echo "docker-build: $*" >&2; }

command -v docker >/dev/null || { log "docker is not installed"; exit 1; }
docker version --format '{{.Server.Version}}' >/dev/null 2>&1 \
    || { log "no Docker engine answers (docker version failed)"; exit 1; }

# The Debian release of this machine: its glibc is what the binaries were linked against.
release=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
if [ -z "$release" ]; then
    release=bookworm
    log "no VERSION_CODENAME in /etc/os-release; assuming Debian $release"
fi

# Prints the first http(s) Debian mirror named in this machine's apt sources (deb822 .sources
# files and one-line .list files) that serves $release, e.g. http://deb.debian.org/debian.
apt_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        # deb822 stanzas are separated by blank lines; take URIs of a stanza whose Suites has
        # the release itself (not only -security or -updates).
        awk -v rel="$release" '
            BEGIN { RS = ""; FS = "\n" }
            {
                uris = ""; ok = 0
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", $i); split($i, u, /[ \t]+/); uris = u[1] }
                    if ($i ~ /^Suites:/) { n = split($i, s, /[ \t]+/); for (j = 2; j <= n; j++) if (s[j] == rel) ok = 1 }
                }
                if (ok && uris ~ /^https?:\/\//) { print uris; exit }
            }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk -v rel="$release" '
            $1 == "deb" {
                i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                if ($(i + 1) == rel && $i ~ /^https?:\/\//) { print $i; exit }
            }' "$f"
    done
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

make_local_base() {
    local image=$1
    if have_image "$image"; then
        log "base image $image exists; reusing it"
        return
    fi
    command -v debootstrap >/dev/null || {
        log "debootstrap is missing; install it (apt-get install -y debootstrap) or use --registry-base"
        exit 1
    }
    local mirror=${BMQ_DEBIAN_MIRROR:-$(apt_mirror | head -n 1)}
    [ -n "$mirror" ] || { log "no Debian mirror for $release in /etc/apt/sources*; set BMQ_DEBIAN_MIRROR"; exit 1; }
    local dir
    dir=$(mktemp -d /var/tmp/bmq-base.XXXXXX)
    # shellcheck disable=SC2064
    trap "rm -rf '$dir'" EXIT
    log "debootstrap --variant=minbase $release from $mirror (once; cached as $image)"
    debootstrap --variant=minbase "$release" "$dir" "$mirror" >"$dir.log" 2>&1 || {
        tail -n 30 "$dir.log" >&2
        log "debootstrap failed (full log: $dir.log)"
        exit 1
    }
    rm -f "$dir.log"
    # Keep the image small: no package lists or caches (an image build runs apt-get update).
    rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb
    # Apt inside the image uses the same mirror.
    echo "deb $mirror $release main" >"$dir/etc/apt/sources.list"
    tar -C "$dir" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
    rm -rf "$dir"
    trap - EXIT
    log "base image $image imported"
}

if [ -n "${BMQ_BASE:-}" ]; then
    base=$BMQ_BASE
else
    if [ "$base_mode" = auto ]; then
        if have_image "debian:$release-slim"; then base_mode=registry; else base_mode=local; fi
    fi
    if [ "$base_mode" = registry ]; then
        base="debian:$release-slim"
    else
        base="bmq-base:$release"
        make_local_base "$base"
    fi
fi
log "base image: $base"

# The binaries: built on the host, copied into the build context.
if [ "$run_cargo" = 1 ]; then
    cargo_flags=(build -q -p bmq-broker -p bmq-ctl --bins)
    [ "$profile" = release ] && cargo_flags+=(--release)
    log "cargo ${cargo_flags[*]}"
    cargo "${cargo_flags[@]}"
fi
target_dir=${CARGO_TARGET_DIR:-$ROOT/target}
context="$target_dir/docker-context"
rm -rf "$context"
mkdir -p "$context/bin"
for bin in broker bmqctl; do
    src="$target_dir/$profile/$bin"
    [ -x "$src" ] || { log "$src is missing; run cargo build --bins (with --release for --profile release)"; exit 1; }
    # Debug information is dropped (a debug build's binaries shrink from ~130 MB to ~15 MB).
    if command -v strip >/dev/null; then
        strip --strip-debug -o "$context/bin/$bin" "$src"
    else
        cp "$src" "$context/bin/$bin"
    fi
done
cp docker/config/default.toml "$context/broker.toml"

# The classic builder is used (DOCKER_BUILDKIT=0): it needs no buildx plugin and works with
# older engines; nothing here needs BuildKit.
log "building $BROKER_IMAGE"
DOCKER_BUILDKIT=0 docker build -q --build-arg "BASE=$base" -t "$BROKER_IMAGE" \
    -f docker/Dockerfile "$context" >/dev/null

if [ "$build_prometheus" = 1 ]; then
    log "building $PROMETHEUS_IMAGE"
    # Its context: the compose cluster's scrape configuration, the project's alert rules and
    # the dashboards' console pages.
    prom_context="$target_dir/docker-context-prometheus"
    rm -rf "$prom_context"
    mkdir -p "$prom_context"
    cp docker/prometheus.yml "$prom_context/prometheus.yml"
    cp dashboards/prometheus/alerts.yml "$prom_context/alerts.yml"
    cp -r dashboards/consoles "$prom_context/consoles"
    DOCKER_BUILDKIT=0 docker build -q --build-arg "BASE=$base" -t "$PROMETHEUS_IMAGE" \
        -f docker/prometheus.Dockerfile "$prom_context" >/dev/null
fi
# Images replaced by this build (now untagged) are removed; nothing else is touched.
docker image prune -f --filter label=org.bmq.image >/dev/null
log "done: $BROKER_IMAGE${build_prometheus:+ }$( [ "$build_prometheus" = 1 ] && echo "$PROMETHEUS_IMAGE")"
