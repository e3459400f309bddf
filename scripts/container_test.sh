#!/usr/bin/env bash
# The container phase of CI: a Docker engine (started here where none runs), the base and the CPU image
# (infra/images/build.sh; docker's layer cache and the base rootfs tarball are kept between runs on one machine),
# then tests/test_containers.py: image hygiene and the pretrain pipeline run in containers. Prints each phase's time.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev >/dev/null
started_engine=0
if ! infra/images/engine.sh status >/dev/null 2>&1; then
  started_engine=1
fi
cleanup() { if [ "$started_engine" -eq 1 ]; then infra/images/engine.sh stop; fi; }
trap cleanup EXIT
phase() {  # name command...
  local name=$1 started rc=0
  shift
  started=$(date +%s)
  "$@" || rc=$?
  echo "phase $name: $(( $(date +%s) - started )) s$( [ "$rc" -eq 0 ] || echo ", failed ($rc)")"
  return "$rc"
}
phase engine infra/images/engine.sh start
# the package registry is the only index here, and it has no CPU build of the pinned torch: the CPU image takes the
# default wheels (CUDA's libraries included), as TORCH_INDEX_URL set but empty says (infra/images/build.sh)
phase "cpu image" env TORCH_INDEX_URL= infra/images/build.sh --variant cpu
phase "cuda image" infra/images/build.sh --variant cuda
status=0
# -rP: the passed tests' output too, so that the log shows each step's container, user and exit status, and the
# final metrics.
# two workers, a file each: the broken image's run (tests/test_container_failure.py) mostly waits out kfp.local's
# retry backoff, beside the pipeline's runs (they took 187 s and 124 s one after the other)
phase "containers" .venv/bin/python -m pytest -m container -rP -p no:cacheprovider -n 2 --dist loadfile \
  tests/test_containers.py tests/test_container_failure.py "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "container test: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$status"
