#!/usr/bin/env bash
# docker-compose (v1, the Debian package) for validating deploy/docker-compose.yml without a
# Docker daemon: `docker-compose -f deploy/docker-compose.yml config -q`.
#
#   scripts/compose.sh install     install the Debian package if missing (idempotent; needs root)
#   scripts/compose.sh check       validate the compose file (each profile)
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "[compose] error: $*" >&2; exit 1; }

install() {
    command -v docker-compose >/dev/null && return 0
    [ "$(id -u)" = 0 ] || die "docker-compose is not installed and installing it needs root: apt-get install docker-compose"
    command -v apt-get >/dev/null || die "no apt-get here: install docker-compose (v1.29, Debian/Ubuntu) by hand"
    echo "[compose] installing docker-compose (Debian package)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q docker-compose >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q docker-compose >/dev/null; }
    command -v docker-compose >/dev/null || die "docker-compose did not install"
}

check() {
    install
    for profile in "" "--profile cuda" "--profile seed"; do
        # shellcheck disable=SC2086
        docker-compose -f deploy/docker-compose.yml $profile config -q
    done
    echo "[compose] deploy/docker-compose.yml ok"
}

case "${1:-check}" in
    install) install ;;
    check) check ;;
    *) die "usage: $0 install|check" ;;
esac
