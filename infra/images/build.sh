#!/usr/bin/env bash
# Build (and with --push, push) the CPU and CUDA images under the names the components use
# (components/images.py; CLOOB_IMAGE_CPU / CLOOB_IMAGE_CUDA override both there and here).
#   infra/images/build.sh [--push] [--dry-run]
# Environment: CONTAINER_CLI (docker, podman, ...; default docker), TORCH_INDEX_URL (a CPU-only torch wheel index
# for the CPU image; unset: the CPU image carries the CUDA wheels too, larger but equivalent on CPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
push=0 dry=0
for arg in "$@"; do
  case "$arg" in
    --push) push=1 ;;
    --dry-run) dry=1 ;;
    *) echo "usage: $0 [--push] [--dry-run]" >&2; exit 2 ;;
  esac
done
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python
read -r version cpu cuda < <("$python" -c \
  'from components.images import VERSION, CPU_IMAGE, CUDA_IMAGE; print(VERSION, CPU_IMAGE, CUDA_IMAGE)')
cli=${CONTAINER_CLI:-docker}
run() { echo "+ $*"; [ "$dry" -eq 1 ] || "$@"; }
run "$cli" build -f infra/images/Dockerfile --build-arg VERSION="$version" --build-arg VARIANT=cuda -t "$cuda" .
run "$cli" build -f infra/images/Dockerfile --build-arg VERSION="$version" --build-arg VARIANT=cpu \
  --build-arg TORCH_INDEX_URL="${TORCH_INDEX_URL:-}" -t "$cpu" .
if [ "$push" -eq 1 ]; then
  run "$cli" push "$cuda"
  run "$cli" push "$cpu"
fi
