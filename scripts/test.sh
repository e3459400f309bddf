#!/usr/bin/env bash
# Set up (if needed) and run the checks: ruff, then the test suite. Extra arguments go to pytest.
# "No tests ran" (pytest exit code 5) is a failure, not a pass.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
.venv/bin/python -m ruff check .
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$status"
