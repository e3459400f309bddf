#!/usr/bin/env bash
# Set up (if needed) and run the checks: ruff, then the test suite. Extra arguments go to pytest.
# The suite runs on PYTEST_WORKERS processes (pytest-xdist; default 2, both cores of the CI machine; 0 runs it in
# this process), each taking whole test files (--dist loadfile), so that a module's fixtures are built once.
# "No tests ran" (pytest exit code 5) is a failure, not a pass.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
.venv/bin/python -m ruff check .
status=0
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$status"
