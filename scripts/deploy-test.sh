#!/usr/bin/env bash
# Deploys that have run: build every service image of deploy/ and run the compose stack on this
# machine, check it through the running containers, and take it down again.
#
#   bash scripts/deploy-test.sh          (as root, on Debian/Ubuntu; tests/deploy/test_compose_run.py runs it)
#
# 0. One run at a time (a lock in /var/lock); scripts/setup.sh (idempotent): .venv, for the checks.
# 1. docker.io, docker-compose and debootstrap from the distribution if missing; dockerd started
#    if none runs (no default bridge: --bridge=none), and stopped again at the end.
# 2. The base image: BASE_IMAGE if set, else python:3.11-slim if it is here or can be pulled, else
#    one made from Debian's packages (debootstrap from the mirror apt uses; python3, this machine's
#    CA bundle) and imported as bitdelta/base:bookworm.
# 3. Every image built with --network host and this machine's pip settings
#    (deploy/local/pip_relay.py); docker's layer cache keeps the pip installs between runs.
#    Sizes, and the checks of what each image holds, in the report.
# 4. The family: BITDELTA_BASE_DIR and BITDELTA_DELTAS_DIR, else data/ when the family is built,
#    else the converted base and two short real fine-tunes, as the tests use (built once, cached).
# 5. docker-compose with deploy/docker-compose.yml plus deploy/local/docker-compose.local.yml
#    (host networking, loopback ports, rotel and Debian's Prometheus; merged, as published ports do
#    not go with host networking): seed the deltas volume, up,
#    every service healthy, then scripts/deploy_check.py against the containers, then down.
#
# Writes DEPLOY_TEST_OUT (default .tmp/deploy-test): report.json, build and service logs, spans.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${DEPLOY_TEST_OUT:-$ROOT/.tmp/deploy-test}
PROJECT=bitdelta-deploy-test
LOCAL_BASE=bitdelta/base:bookworm
RELAY_PORT=${DEPLOY_TEST_PIP_PORT:-25999}
COMPOSE=(docker-compose -p "$PROJECT" -f "$OUT/docker-compose.yml")  # both files merged (deploy_check.py compose)
export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0  # the classic builder: Debian's docker.io has no buildx

log() { echo "[deploy-test] $(date +%T) $*"; }
die() { echo "[deploy-test] error: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts dockerd)"
# One run at a time on a machine: runs share dockerd, the project's name and its ports.
exec 9>/var/lock/bitdelta-deploy-test.lock
flock -n 9 || { log "waiting for another deploy test on this machine"; flock -w 1500 9; } || die "the other deploy test did not finish in 25 minutes"
bash scripts/setup.sh >/dev/null  # .venv and the generated code, for the checks and the reference system
mkdir -p "$OUT" && rm -f "$OUT/report.json" "$OUT/spans.jsonl" "$OUT/times.json"  # report.json is merged into
T0=$(date +%s)

STARTED_DOCKERD="" RELAY_PID="" STACK_UP=""
cleanup() {
    local rc=$?
    if [ -n "$STACK_UP" ]; then
        "${COMPOSE[@]}" logs --no-color >"$OUT/compose.log" 2>&1 || true
        "${COMPOSE[@]}" down --volumes --remove-orphans >/dev/null 2>&1 || true
    fi
    [ -n "$RELAY_PID" ] && kill "$RELAY_PID" 2>/dev/null
    if [ -n "$STARTED_DOCKERD" ]; then
        log "stopping the dockerd this script started"
        kill "$STARTED_DOCKERD" 2>/dev/null && timeout 60 tail --pid="$STARTED_DOCKERD" -f /dev/null || true
    fi
    [ "$rc" = 0 ] || echo "[deploy-test] FAILED (exit $rc); logs in $OUT" >&2
    exit "$rc"
}
trap cleanup EXIT

# -- 1. tools and the daemon ----------------------------------------------------------------------
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || die "no apt-get: install ${missing[*]} by hand"
    log "installing ${missing[*]} (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${missing[@]}" >"$OUT/apt.log" 2>&1 \
        || { apt-get update -q >>"$OUT/apt.log" 2>&1 && apt-get install -y -q "${missing[@]}" >>"$OUT/apt.log" 2>&1; } \
        || die "apt-get install ${missing[*]} failed: $OUT/apt.log"
fi
if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (--bridge=none: containers use the host's network only)"
    dockerd --bridge=none --iptables=false --ip6tables=false >"$OUT/dockerd.log" 2>&1 9>&- &  # not holding the lock
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || die "dockerd did not start: $OUT/dockerd.log"
fi

# -- 2. the base image ----------------------------------------------------------------------------
apt_mirror() {  # the Debian mirror apt uses here (deb822 .sources or a one-line sources.list)
    local f
    for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk '/^URIs:/ && $2 !~ /security/ {print $2; exit} /^deb / && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' "$f"
    done | head -n1
}

make_base() {  # bitdelta/base:bookworm: Debian minbase, python3 (venv, libpython) as `python`, this machine's CA bundle
    local mirror dir cert
    mirror=$(apt_mirror)
    [ -n "$mirror" ] || die "no Debian mirror found in /etc/apt/sources.list*"
    dir=$(mktemp -d /var/tmp/bitdelta-base.XXXXXX)
    log "making $LOCAL_BASE with debootstrap from $mirror"
    debootstrap --variant=minbase --include=python3,python3-venv,libpython3.11,ca-certificates bookworm "$dir" "$mirror" \
        >"$OUT/debootstrap.log" 2>&1 || { rm -rf "$dir"; die "debootstrap failed: $OUT/debootstrap.log"; }
    ln -s /usr/bin/python3 "$dir/usr/local/bin/python"
    cert=$(sed -n 's/^PIP_CERT=//p' "$OUT/pip.env")
    if [ -n "$cert" ]; then  # pip's CA bundle here (a TLS proxy's CA, say), at the same path in the image
        mkdir -p "$dir$(dirname "$cert")" && cp -L "$cert" "$dir$cert"
    fi
    rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir"/usr/share/doc/* "$dir"/usr/share/man/*
    tar -C "$dir" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
        --change 'CMD ["python"]' - "$LOCAL_BASE" >/dev/null
    rm -rf "$dir"
}

# pip's settings, with local places served on loopback for the builds
"$ROOT/.venv/bin/python" deploy/local/pip_relay.py --port "$RELAY_PORT" >"$OUT/pip.env" 2>"$OUT/pip_relay.log" 9>&- &
RELAY_PID=$!
for _ in $(seq 50); do [ -s "$OUT/pip.env" ] && break; kill -0 "$RELAY_PID" 2>/dev/null || break; sleep 0.2; done
[ -s "$OUT/pip.env" ] || die "deploy/local/pip_relay.py did not start: $OUT/pip_relay.log"

BUILD_ARGS=()
if [ -n "${BASE_IMAGE:-}" ]; then
    log "base image: $BASE_IMAGE (given)"
elif docker image inspect python:3.11-slim >/dev/null 2>&1 || timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    BASE_IMAGE=python:3.11-slim
    log "base image: $BASE_IMAGE"
else
    docker image inspect "$LOCAL_BASE" >/dev/null 2>&1 || make_base
    BASE_IMAGE=$LOCAL_BASE
    log "base image: $BASE_IMAGE (no registry reachable: made from Debian's packages)"
    while IFS= read -r kv; do BUILD_ARGS+=(--build-arg "$kv"); done < <(grep -v '^#' "$OUT/pip.env")
    BUILD_ARGS+=(--build-arg TORCH_INDEX_URL=)  # the CPU wheel as pip finds it here
fi

# -- 3. the images --------------------------------------------------------------------------------
IMAGES=(  # tag dockerfile (the compose files name the same tags)
    bitdelta/router:latest deploy/docker/router.Dockerfile
    bitdelta/gateway:latest deploy/docker/gateway.Dockerfile
    bitdelta/delta-store:latest deploy/docker/delta_store.Dockerfile
    bitdelta/worker:cpu deploy/docker/gpu_worker-cpu.Dockerfile
    bitdelta/rotel:local deploy/local/rotel.Dockerfile
    bitdelta/prometheus:local deploy/local/prometheus.Dockerfile
)
: >"$OUT/build-times.txt"
for ((i = 0; i < ${#IMAGES[@]}; i += 2)); do
    tag=${IMAGES[i]} file=${IMAGES[i + 1]} t=$(date +%s)
    docker build --network host -f "$file" -t "$tag" --build-arg BASE_IMAGE="$BASE_IMAGE" "${BUILD_ARGS[@]}" . \
        >"$OUT/build-$(basename "$file" .Dockerfile).log" 2>&1 || die "docker build of $tag failed: see $OUT/build-$(basename "$file" .Dockerfile).log"
    echo "$tag $(($(date +%s) - t))" >>"$OUT/build-times.txt"
    log "built $tag in $(($(date +%s) - t)) s"
done
kill "$RELAY_PID" 2>/dev/null; RELAY_PID=""
log "images built in $(($(date +%s) - T0)) s so far"
"$ROOT/.venv/bin/python" scripts/deploy_check.py images --out "$OUT"

# -- 4. the family --------------------------------------------------------------------------------
if [ -z "${BITDELTA_BASE_DIR:-}" ] || [ -z "${BITDELTA_DELTAS_DIR:-}" ]; then
    family=$("$ROOT/.venv/bin/python" scripts/deploy_check.py family) || die "no family to serve"
    eval "$family"
fi
export BITDELTA_BASE_DIR BITDELTA_DELTAS_DIR
log "family: base $BITDELTA_BASE_DIR, deltas $BITDELTA_DELTAS_DIR"
chmod -R a+rX "$BITDELTA_BASE_DIR" "$BITDELTA_DELTAS_DIR"  # the containers run as uid 10001

# -- 5. the stack ---------------------------------------------------------------------------------
"$ROOT/.venv/bin/python" scripts/deploy_check.py compose --project "$PROJECT" --out "$OUT/docker-compose.yml"
STACK_UP=1
t=$(date +%s)
"${COMPOSE[@]}" --profile seed run --rm seed-deltas >"$OUT/seed.log" 2>&1 || die "seeding the deltas volume failed: $OUT/seed.log"
"${COMPOSE[@]}" up -d --no-build >"$OUT/up.log" 2>&1 || die "docker-compose up failed: $OUT/up.log"
"$ROOT/.venv/bin/python" scripts/deploy_check.py stack --out "$OUT" --project "$PROJECT" \
    --base "$BITDELTA_BASE_DIR" --deltas "$BITDELTA_DELTAS_DIR"
"${COMPOSE[@]}" ps >"$OUT/ps.txt"
"${COMPOSE[@]}" logs --no-color >"$OUT/compose.log" 2>&1
"${COMPOSE[@]}" down --volumes --remove-orphans >"$OUT/down.log" 2>&1 || die "docker-compose down failed: $OUT/down.log"
STACK_UP=""
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"; docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT"; docker network ls -q --filter "label=com.docker.compose.project=$PROJECT")
[ -z "$left" ] || die "docker-compose down left behind: $left"
echo "{\"stack_s\": $(($(date +%s) - t)), \"total_s\": $(($(date +%s) - T0))}" >"$OUT/times.json"
log "passed in $(($(date +%s) - T0)) s (stack $(($(date +%s) - t)) s); report: $OUT/report.json"
