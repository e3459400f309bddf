#!/usr/bin/env bash
# The main command: set up (if needed), run the DVC pipeline (acquire -> validate -> download -> train -> eval ->
# report -> promote) on the packaged captioned set, and print the evaluation summary when this run produced one.
# Extra arguments go to `dvc repro` (e.g. `train` stops after training).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" DVC_NO_ANALYTICS=1
metrics=reports/metrics.json
before=$(stat -c %y "$metrics" 2>/dev/null || true)
dvc repro "$@"
if [ -f "$metrics" ] && [ "$(stat -c %y "$metrics")" != "$before" ]; then
  echo
  cloob eval summary --metrics "$metrics"
else
  echo "(this run left the report as it was; \`cloob eval summary\` prints its figures)"
fi
