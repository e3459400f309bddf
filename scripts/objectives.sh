#!/usr/bin/env bash
# The objective families side by side on the current pipeline settings: one DVC experiment each (run in a
# temporary copy, so the workspace keeps its own results), then one table and bar chart of their evaluations.
#   ./scripts/objectives.sh            after ./scripts/pipeline.sh (the workspace run is the cloob baseline)
# Writes reports/objectives/comparison.md, comparison.png and exps.json (`dvc exp show --json`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" DVC_NO_ANALYTICS=1

experiment() {  # NAME SETTING...
  local name=$1; shift
  dvc exp remove "$name" >/dev/null 2>&1 || true  # re-running replaces the earlier result
  local args=()
  for setting in "$@"; do args+=(-S "$setting"); done
  echo "== experiment $name: $*"
  dvc exp run --temp --name "$name" "${args[@]}"
}

experiment clip train.objective=clip
experiment infoloob train.objective=infoloob
experiment siglip train.objective=siglip model.inv_tau=10 model.learn_inv_tau=true
experiment ring train.objective=cloob_ring objective.p_in=0.02 objective.p_out=0.5 objective.anneal_steps=60
experiment pvc train.objective=pvc_geometric train.image_views=2 train.text_views=2

mkdir -p reports/objectives
dvc exp show --no-pager --json > reports/objectives/exps.json
cloob eval compare --dvc-exps reports/objectives/exps.json --output reports/objectives
