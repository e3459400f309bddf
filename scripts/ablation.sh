#!/usr/bin/env bash
# The paper's ablation at small scale: clip, infoloob, infonce_hopfield and cloob with the pipeline's recipe
# (params.yaml), 3 seeds each, on the pipeline's captioned shards; 32–51 minutes on two CPU cores.
#   ./scripts/ablation.sh            reports/ablation/: table.md, summary.json, figures, runs/*/result.json
#   ./scripts/ablation.sh --quick    a 24-step smoke test of the same into reports/ablation-quick/
# Extra arguments go to `cloob experiment` (--seeds, --points, --set KEY=VALUE). A rerun resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" DVC_NO_ANALYTICS=1
dvc repro validate_shards  # the pipeline's shards, through both data gates
output=reports/ablation
for arg in "$@"; do [ "$arg" = "--quick" ] && output=reports/ablation-quick; done
cloob experiment ablation --params params.yaml --output "$output" --seeds 3 "$@"
