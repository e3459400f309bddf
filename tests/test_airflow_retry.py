"""A killed training task of the Airflow front (mode local) is a retryable failure, and its retry resumes from the
run's mirrored checkpoint to the weights of an uninterrupted run, bit for bit. The operator runs in Airflow's venv
as a worker runs it (its execute, twice), the step through the step server."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from airflow_harness import REPO, VENV, run_params

pytestmark = pytest.mark.airflow


_KILL = """
import json, os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from cloob_core.config.airflow import AirflowSettings
from pipelines.airflow_steps import step_operator

settings = AirflowSettings(runs={runs!r}).located(Path({repo!r}))
class TI:
    dag_id, task_id, map_index = "cloob_pretrain", "train", -1

def run(run_id, kill_at=None):
    task = step_operator("train", settings)(inputs={inputs!r} | {{"run_id": run_id}})
    if kill_at:
        def killer():
            while not list(Path({workdir!r}).glob("*" + run_id + "/checkpoints/" + kill_at + "*")):
                time.sleep(0.05)
            os.killpg(task.step_pid, signal.SIGKILL)
        threading.Thread(target=killer, daemon=True).start()
    return task.execute({{"ti": TI, "run_id": run_id}})

outcome = {{"whole": run("whole")}}
try:
    run("killed", kill_at="step-00000012")
    outcome["first try"] = "finished"
except AirflowFailException as err:
    outcome["first try"] = "failed for good: " + str(err)
except AirflowException as err:
    outcome["first try"] = "retryable: " + str(err)
outcome["retry"] = run("killed")
Path({result!r}).write_text(json.dumps(outcome))
"""


@pytest.mark.slow  # three short trainings: about 2 minutes
def test_a_killed_training_step_is_retried_and_resumes_bit_identical(airflow_venv, mnist_train_shards, tmp_path):
    from safetensors.torch import load_file

    params = run_params()
    params["train"].update(steps=24, batch_size=64, checkpoint_every=4, log_every=4, workers=2,
                           tensorboard=False)
    workdir = tmp_path / "jobs"
    inputs = {"params": json.dumps(params), "shards": str(mnist_train_shards), "gpus": 0, "workdir": str(workdir),
              "keep_checkpoints": True}
    result = tmp_path / "outcome.json"
    script = _KILL.format(repo=str(REPO), runs=str(tmp_path / "runs"), inputs=inputs, workdir=str(workdir),
                          result=str(result))
    done = subprocess.run([str(VENV / "bin" / "python"), "-c", script], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    outcome = json.loads(result.read_text())
    assert outcome["first try"].startswith("retryable: step train exited -9"), outcome["first try"]
    whole, resumed = Path(outcome["whole"]["model"]), Path(outcome["retry"]["model"])
    assert whole != resumed
    first, second = (load_file(next((folder / "model").glob("*.safetensors"))) for folder in (whole, resumed))
    assert first.keys() == second.keys()
    assert all(first[name].equal(second[name]) for name in first)
