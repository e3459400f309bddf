#!/usr/bin/env bash
# Build (and with --push, push) the CPU and CUDA images under the names the components use
# (components/images.py; CLOOB_IMAGE_CPU / CLOOB_IMAGE_CUDA override both there and here), and print each one's
# build time and size.
#   infra/images/build.sh [--variant cpu|cuda|all] [--network MODE] [--push] [--dry-run]
# The Dockerfile's base image is made sure of first (infra/images/base.sh: present, pulled, or built locally where no
# registry can be reached). --network defaults to `host` when the engine has no default bridge (infra/images/engine.sh
# starts it so), else to the engine's default.
# Environment: CONTAINER_CLI (docker, podman, ...; default Debian's /usr/bin/docker where present, else docker),
# CLOOB_BUILD_CACHE (the most BuildKit's cache keeps after a build; default 24GB),
# TORCH_INDEX_URL (the CPU image's torch wheel index; unset: PyTorch's CPU index, https://download.pytorch.org/whl/cpu,
# so the CPU image carries no CUDA libraries; set but empty: the package index's default wheels, CUDA's included,
# several GB larger but equivalent on CPU, as CI builds it where only the package registry is reachable).
# Tags name one build (components/image_names.py: VERSION-<commit>): --push refuses a tree whose image inputs have
# uncommitted changes, and a build removes this repository's images of other tags, which their layers mostly share.
set -euo pipefail
cd "$(dirname "$0")/../.."
push=0 dry=0 variant=all network=""
while [ $# -gt 0 ]; do
  case "$1" in
    --push) push=1 ;;
    --dry-run) dry=1 ;;
    --variant) variant=${2:?--variant needs cpu, cuda or all}; shift ;;
    --network) network=${2:?--network needs a mode}; shift ;;
    *) echo "usage: $0 [--variant cpu|cuda|all] [--network MODE] [--push] [--dry-run]" >&2; exit 2 ;;
  esac
  shift
done
case "$variant" in cpu|cuda|all) ;; *) echo "build: --variant must be cpu, cuda or all, not '$variant'" >&2; exit 2 ;; esac
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python
read -r version cpu cuda < <("$python" -c \
  'from components.images import VERSION, CPU_IMAGE, CUDA_IMAGE; print(VERSION, CPU_IMAGE, CUDA_IMAGE)')
cli=${CONTAINER_CLI:-$( [ -x /usr/bin/docker ] && echo /usr/bin/docker || echo docker )}
base=$(awk -F= '/^ARG BASE_IMAGE=/{print $2; exit}' infra/images/Dockerfile)
inputs=(cloob_core pyproject.toml README.md requirements/constraints.txt infra/images/Dockerfile)
if [ "$push" -eq 1 ] && [ -n "$(git status --porcelain -- "${inputs[@]}" 2>/dev/null)" ]; then
  echo "build: uncommitted changes to the image's inputs (${inputs[*]}): commit them first, so that the pushed" \
       "tag $cpu names one build" >&2
  exit 2
fi
run() { echo "+ $*"; [ "$dry" -eq 1 ] || "$@"; }

if [ "$dry" -eq 0 ]; then
  DOCKER=$cli infra/images/base.sh "$base"
  if [ -z "$network" ] && ! "$cli" network inspect bridge >/dev/null 2>&1; then
    network=host
  fi
fi
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-1}

build() {  # variant tag [extra build args]
  local variant=$1 tag=$2 started
  shift 2
  started=$(date +%s)
  run "$cli" build -f infra/images/Dockerfile ${network:+--network "$network"} --build-arg VERSION="$version" \
    --build-arg VARIANT="$variant" "$@" -t "$tag" .
  if [ "$dry" -eq 0 ]; then
    echo "built $tag in $(( $(date +%s) - started )) s, $(( $("$cli" image inspect -f '{{.Size}}' "$tag") / 1000000 )) MB"
  fi
}
if [ "$variant" != cuda ]; then
  build cpu "$cpu" --build-arg TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
fi
if [ "$variant" != cpu ]; then build cuda "$cuda"; fi
# A rebuild leaves the image it replaced untagged, its layers held by BuildKit's cache: drop those images (ours
# only, by label) and keep the cache under CLOOB_BUILD_CACHE (most recently used first, so the dependency layers
# stay), or repeated CI runs on one machine fill its disk.
if [ "$dry" -eq 0 ]; then
  for image in $("$cli" image ls --filter "label=org.opencontainers.image.title=cloob-pipelines" \
                   --format '{{.Repository}}:{{.Tag}}'); do  # earlier builds' tags: each commit has its own
    case "$image" in "$cpu"|"$cuda"|*"<none>"*) ;; *) "$cli" rmi "$image" >/dev/null 2>&1 || true ;; esac
  done
  "$cli" image prune -f --filter "label=org.opencontainers.image.title=cloob-pipelines" >/dev/null
  if [ "$DOCKER_BUILDKIT" = 1 ] && "$cli" builder prune --help 2>/dev/null | grep -q -- --keep-storage; then
    "$cli" builder prune -f --keep-storage "${CLOOB_BUILD_CACHE:-24GB}" >/dev/null
  fi
fi
if [ "$push" -eq 1 ]; then
  if [ "$variant" != cuda ]; then run "$cli" push "$cpu"; fi
  if [ "$variant" != cpu ]; then run "$cli" push "$cuda"; fi
fi
