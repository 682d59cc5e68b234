#!/usr/bin/env bash
# A throwaway OpenStack Swift with the S3 API (s3api), on loopback, for the
# delta store's S3 backend tests and benchmark. Debian packages, run as root.
#
#   scripts/swift.sh install        install the Debian packages if missing (idempotent)
#   scripts/swift.sh start DIR      write configs + rings under DIR, start the servers,
#                                   wait until an authenticated request succeeds
#   scripts/swift.sh stop DIR       stop the servers started in DIR
#   scripts/swift.sh                install + start in a fresh temp dir, print the endpoint
#
# Ports (environment, defaults as in docs/delta-store.md): SWIFT_PROXY_PORT=8080,
# SWIFT_OBJECT_PORT=6200, SWIFT_CONTAINER_PORT=6201, SWIFT_ACCOUNT_PORT=6202.
# S3 credentials: access key "test:tester", secret "testing", region us-east-1,
# path-style addressing. Without memcached Swift works and only logs errors.
set -euo pipefail

PACKAGES=(swift swift-proxy swift-account swift-container swift-object)
PROXY_PORT=${SWIFT_PROXY_PORT:-8080}
OBJECT_PORT=${SWIFT_OBJECT_PORT:-6200}
CONTAINER_PORT=${SWIFT_CONTAINER_PORT:-6201}
ACCOUNT_PORT=${SWIFT_ACCOUNT_PORT:-6202}
SERVERS=(account container object proxy)

die() { echo "[swift] error: $*" >&2; exit 1; }

installed() {
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
    done
    command -v swift-proxy-server >/dev/null && command -v swift-ring-builder >/dev/null
}

install() {
    if installed; then
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "Swift is not installed and installing it needs root: apt-get install ${PACKAGES[*]}"
    command -v apt-get >/dev/null || die "no apt-get here: install ${PACKAGES[*]} (Debian/Ubuntu packages) by hand"
    echo "[swift] installing ${PACKAGES[*]} (about a minute)"
    export DEBIAN_FRONTEND=noninteractive
    # Update the package lists only when the packages cannot be found in them.
    if ! apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1; then
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null \
            || die "apt-get install ${PACKAGES[*]} failed"
    fi
    installed || die "packages installed but swift-proxy-server / swift-ring-builder are missing"
}

write_configs() {
    local d=$1
    mkdir -p "$d/etc" "$d/srv/sdb1" "$d/log" "$d/run"
    local common="[DEFAULT]
devices = $d/srv
mount_check = false
bind_ip = 127.0.0.1
workers = 0
user = root
swift_dir = $d/etc
disable_fallocate = true
log_level = WARNING
"
    for s in account container object; do
        local port_var="${s^^}_PORT"
        cat >"$d/etc/$s-server.conf" <<EOF
$common
bind_port = ${!port_var}

[pipeline:main]
pipeline = $s-server

[app:$s-server]
use = egg:swift#$s
EOF
    done
    cat >"$d/etc/proxy-server.conf" <<EOF
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = $PROXY_PORT
workers = 0
user = root
swift_dir = $d/etc
log_level = WARNING

[pipeline:main]
pipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats s3api tempauth copy slo dlo proxy-logging proxy-server

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true

[filter:catch_errors]
use = egg:swift#catch_errors
[filter:gatekeeper]
use = egg:swift#gatekeeper
[filter:healthcheck]
use = egg:swift#healthcheck
[filter:proxy-logging]
use = egg:swift#proxy_logging
[filter:cache]
use = egg:swift#memcache
[filter:listing_formats]
use = egg:swift#listing_formats
[filter:s3api]
use = egg:swift#s3api
location = us-east-1
[filter:tempauth]
use = egg:swift#tempauth
user_test_tester = testing .admin
[filter:copy]
use = egg:swift#copy
[filter:slo]
use = egg:swift#slo
[filter:dlo]
use = egg:swift#dlo
EOF
    (
        cd "$d/etc"
        for s in account container object; do
            local port_var="${s^^}_PORT"
            swift-ring-builder "$s.builder" create 10 1 1 >/dev/null
            swift-ring-builder "$s.builder" add "r1z1-127.0.0.1:${!port_var}/sdb1" 100 >/dev/null
            swift-ring-builder "$s.builder" rebalance >/dev/null || true  # exit 1 = "nothing to move" warnings
            [ -f "$s.ring.gz" ] || die "could not build the $s ring in $d/etc"
        done
    )
}

healthy() {
    # Create a bucket and write + read an object through the S3 API (signature
    # v2, stdlib only): that goes through proxy, tempauth and all three
    # storage servers. (tempauth's Swift tokens need memcached; S3 does not.)
    # The probe's error goes to $1 (start prints the last one if it times out).
    /usr/bin/python3 - "$PROXY_PORT" <<'PY' >/dev/null 2>"$1"
import base64, hmac, http.client, sys
from email.utils import formatdate

def req(method, path, body=b"", ok=()):
    date = formatdate(usegmt=True)
    sig = base64.b64encode(hmac.new(b"testing", f"{method}\n\n\n{date}\n{path}".encode(), "sha1").digest()).decode()
    c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=3)
    c.request(method, path, body, {"Date": date, "Authorization": f"AWS test:tester:{sig}"})
    r = c.getresponse()
    data = r.read()
    if r.status >= 300 and r.status not in ok:
        sys.exit(f"{method} {path}: {r.status}")
    return data

# 409: the bucket exists, made by an earlier try of this probe whose answer came too soon (an
# account server not yet up) or was lost; the directory is new, so no other bucket has its name
req("PUT", "/swift-sh-probe", ok=(409,))
req("PUT", "/swift-sh-probe/ok", b"ok")
assert req("GET", "/swift-sh-probe/ok") == b"ok"
PY
}

start() {
    local d=${1:?usage: swift.sh start DIR}
    installed || die "Swift is not installed; run: scripts/swift.sh install"
    [ -f /etc/swift/swift.conf ] || die "/etc/swift/swift.conf is missing (the Debian package installs it)"
    mkdir -p "$d"
    d=$(cd "$d" && pwd)
    write_configs "$d"
    for s in "${SERVERS[@]}"; do
        nohup "swift-$s-server" "$d/etc/$s-server.conf" >"$d/log/$s.log" 2>&1 &
        echo $! >"$d/run/$s.pid"
    done
    local deadline=$((SECONDS + ${SWIFT_START_TIMEOUT:-60}))
    until healthy "$d/run/probe.err"; do
        for s in "${SERVERS[@]}"; do
            if ! kill -0 "$(cat "$d/run/$s.pid")" 2>/dev/null; then
                tail -n 20 "$d/log/$s.log" >&2
                stop "$d"
                die "swift-$s-server exited during start-up (log above, $d/log/$s.log)"
            fi
        done
        if [ $SECONDS -ge $deadline ]; then
            tail -n 20 "$d"/log/*.log >&2
            echo "[swift] the last health probe (S3 PUT bucket, PUT and GET an object on port $PROXY_PORT) said:" >&2
            tail -n 5 "$d/run/probe.err" >&2
            stop "$d"
            die "Swift did not become healthy within ${SWIFT_START_TIMEOUT:-60}s"
        fi
        sleep 0.3
    done
    echo "[swift] up: S3 endpoint http://127.0.0.1:$PROXY_PORT (key test:tester, secret testing), dir $d"
}

stop() {
    local d=${1:?usage: swift.sh stop DIR}
    local pids=()
    for f in "$d"/run/*.pid; do
        [ -f "$f" ] || continue
        pids+=("$(cat "$f")")
        rm -f "$f"
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 "${pids[@]}" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

case "${1:-}" in
    install) install ;;
    start) start "${2:-}" ;;
    stop) stop "${2:-}" ;;
    "") install; start "$(mktemp -d /tmp/swift.XXXXXX)" ;;
    *) die "unknown command $1 (install | start DIR | stop DIR)" ;;
esac
