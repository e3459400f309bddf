#!/usr/bin/env bash
# The Airflow front on this machine: Airflow's own venv (.venv-airflow, pinned by requirements/airflow-constraints.txt;
# it cannot share the project's: docs/airflow.md), its database in runs/airflow/home, then
# `airflow dags test cloob_pretrain` in local mode on the packaged default (each task a process of the project's
# .venv, as `dvc repro` runs a stage), and the run's suite table. `--setup` only creates the venv and the database.
# Extra arguments go to `airflow dags test` (e.g. `-c '{"params": "..."}'`).
set -euo pipefail
cd "$(dirname "$0")/.."
# The project's venv (the tasks' interpreter) installs while Airflow's is made and its database migrated: the two
# are independent until the DAG runs (on a fresh clone this saves about a minute of the five).
scripts/setup.sh &
project_setup=$!
venv=.venv-airflow
constraints=requirements/airflow-constraints.txt
stamp=$venv/.installed
if [ ! -f "$stamp" ] || [ "$constraints" -nt "$stamp" ]; then
  echo "airflow: creating $venv (Airflow 3 and the Kubernetes provider, pinned by $constraints)"
  [ -x "$venv/bin/python" ] || python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
  # its own uv: the project's may be half-installed by the setup running beside this
  [ -x "$venv/bin/uv" ] || "$venv/bin/pip" install -q --disable-pip-version-check uv >"$venv/uv-install.log" 2>&1 \
    || { cat "$venv/uv-install.log" >&2; exit 1; }
  # the constraints file pins every package of the resolve; installing it as requirements installs exactly them
  PIP_CONSTRAINT='' "$venv/bin/uv" pip install -q --python "$venv/bin/python" -r "$constraints"
  touch "$stamp"
fi
export AIRFLOW_HOME=${AIRFLOW_HOME:-$PWD/runs/airflow/home} AIRFLOW__CORE__DAGS_FOLDER=$PWD/dags \
  AIRFLOW__CORE__LOAD_EXAMPLES=False
mkdir -p "$AIRFLOW_HOME"
if [ ! -f "$AIRFLOW_HOME/airflow.db" ]; then
  "$venv/bin/airflow" db migrate >"$AIRFLOW_HOME/migrate.log" 2>&1 || { tail -20 "$AIRFLOW_HOME/migrate.log"; exit 1; }
fi
wait "$project_setup" || { echo "airflow: the project's venv could not be set up (scripts/setup.sh)" >&2; exit 1; }
[ "${1:-}" = "--setup" ] && exit 0
log=$AIRFLOW_HOME/dags-test.log
echo "airflow: airflow dags test cloob_pretrain (local mode; the tasks' log: $log)"
started=$(date +%s)
status=0
"$venv/bin/airflow" dags test cloob_pretrain "$@" >"$log" 2>&1 || status=$?
run=$(grep -o "run_id=manual__[^,]*" "$log" | tail -1 | cut -d= -f2)
state=$(grep -o "DagRun Finished: .*state=[a-z]*" "$log" | tail -1 | grep -o "state=[a-z]*$" | cut -d= -f2)
echo "airflow: run $run ended ${state:-without a state} in $(( $(date +%s) - started )) s"
if [ "$status" -ne 0 ] || [ "$state" != success ]; then
  grep -E "new_state=(failed|up_for_retry)|AirflowFailException|exited [0-9]" "$log" | tail -5 >&2 || true
  exit 1
fi
report=$(.venv/bin/python -c "import sys; from pathlib import Path; from cloob_core.config.airflow import \
AirflowSettings; print(AirflowSettings.load().located(Path.cwd()).output_of('cloob_pretrain', sys.argv[1], 'report'))" "$run")
echo
.venv/bin/cloob eval summary --metrics "$report/metrics.json"
