#!/usr/bin/env bash
# Set up (if needed) and run the checks: ruff, then the test suite. Extra arguments go to pytest.
# The suite runs on PYTEST_WORKERS processes (pytest-xdist; default two more than the cores: a worker waits on its
# test's processes, servers and files part of the time; on CI's 2 cores a third worker took the default tests from
# 929 s to 795 s, a fourth the slow ones from 1,678 s to 1,594 s; 0 runs it in this process), each taking whole test
# files (--dist loadfile), so that a module's fixtures are built once, in tests/conftest.py's order (longest
# first; xdist's own reordering, by number of tests, off). docs/development.md#tests-and-ci has the figures.
# "No tests ran" (pytest exit code 5) is a failure, not a pass.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
.venv/bin/python -m ruff check .
workers=${PYTEST_WORKERS:-$(( $(nproc) + 2 ))}
# Each worker plans its threads for its share of the cores, as the ranks of a node split it (cloob_core/threads.py),
# unless LOKY_MAX_CPU_COUNT is set: two workers that each planned for both cores oversubscribed them (the quick
# ablation beside kfp.local's pipeline: 205 s and 224 s, against 96 s and 180 s with a core each).
if [ "$workers" -gt 0 ] && [ -z "${LOKY_MAX_CPU_COUNT:-}" ]; then
  LOKY_MAX_CPU_COUNT=$(( $(nproc) / workers > 0 ? $(nproc) / workers : 1 ))
  export LOKY_MAX_CPU_COUNT
fi
# The same share for the torch and BLAS a test runs itself (the stages plan theirs): a test's own small models
# started a thread per core in each worker, and under the others' load OpenMP's spinning took the Poly-View toy
# from 13 s alone to 190 s in CI (107 s against 17 s beside three busy loops, OMP_NUM_THREADS unset against 1).
if [ "$workers" -gt 0 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$LOKY_MAX_CPU_COUNT}
fi
status=0
.venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$status"
