#!/usr/bin/env bash
# A Docker engine for machines that have none running (CI, a fresh VM): install Debian's docker.io if dockerd is
# missing, start the daemon, stop it again. Where an engine already answers, `start` uses it and `stop` leaves it.
#   infra/images/engine.sh start|stop|status
# The daemon runs without iptables, IP forwarding or the default bridge, so it needs no kernel networking setup:
# builds and runs then use `--network host` (builds) or `--network none` (steps that need no network).
# Environment: ENGINE_STATE (default /var/lib/cloob-engine: pid file and log), DOCKER (the CLI; Debian's
# /usr/bin/docker where present, whose BuildKit works with this daemon).
set -euo pipefail
state=${ENGINE_STATE:-/var/lib/cloob-engine}
docker_cli=${DOCKER:-$( [ -x /usr/bin/docker ] && echo /usr/bin/docker || echo docker )}

answers() { "$docker_cli" info >/dev/null 2>&1; }

start() {
  if answers; then
    echo "engine: a Docker engine already answers ($("$docker_cli" version -f '{{.Server.Version}}'))"
    return
  fi
  if ! command -v dockerd >/dev/null; then
    echo "engine: installing Debian's docker.io"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
    docker_cli=${DOCKER:-/usr/bin/docker}
  fi
  mkdir -p "$state"
  dockerd --iptables=false --ip-forward=false --bridge=none --storage-driver=overlay2 \
    --pidfile "$state/dockerd.pid" >"$state/dockerd.log" 2>&1 &
  for _ in $(seq 60); do
    if answers; then
      echo "engine: dockerd $("$docker_cli" version -f '{{.Server.Version}}') started (pid $(cat "$state/dockerd.pid"))"
      return
    fi
    sleep 0.5
  done
  echo "engine: dockerd did not answer within 30 s; its log: $state/dockerd.log" >&2
  tail -5 "$state/dockerd.log" >&2
  exit 1
}

stop() {
  if [ -f "$state/dockerd.pid" ]; then
    pid=$(cat "$state/dockerd.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    rm -f "$state/dockerd.pid"
    echo "engine: stopped dockerd (pid $pid)"
  else
    echo "engine: none started by this script; nothing to stop"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) if answers; then echo "engine: answering"; else echo "engine: not answering"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
