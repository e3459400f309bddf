#!/usr/bin/env bash
# The main command: set up (if needed), run the DVC pipeline (acquire -> validate -> shards -> train -> eval ->
# report) on the embedded default, and print the results. Extra arguments go to `dvc repro`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" DVC_NO_ANALYTICS=1
dvc repro "$@"
echo
cloob eval summary --metrics reports/metrics.json
