"""An interrupted `dvc repro` continues training: Ctrl-C (SIGINT to the process group, as a terminal sends it)
during the train stage, then `dvc repro` again ends with the weights and loss history of an uninterrupted run, bit
for bit; after a change of a key that defines the run, the stage starts afresh and says why."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from test_dvc_pipeline import copy_repository, environment, run

pytestmark = pytest.mark.slow  # ~3 minutes: CI runs it (.ci/run), the default suite does not


def _set_params(root: Path, **train: object) -> None:
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"].update(train)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_an_interrupted_dvc_repro_continues_from_its_checkpoint(tmp_path):
    root = copy_repository(tmp_path / "repo")
    env = environment()
    _set_params(root, epochs=2.0, checkpoint_every=10, workers=1)  # 31 steps: interrupted after 20, 11 to go
    run(["git", "commit", "-qam", "a short run, checkpoints every 10 steps"], root, env)
    run(["dvc", "repro", "validate_shards"], root, env)

    # The uninterrupted run, outside DVC (so that no run cache can answer the second `dvc repro`).
    reference = tmp_path / "reference"
    run(["cloob", "train", "--params", "params.yaml", "--output", str(reference), "--no-progress"], root, env)
    steps = json.loads((reference / "metrics.json").read_text())["steps"]
    assert steps >= 30

    stage = subprocess.Popen(["dvc", "repro", "train"], cwd=root, env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    checkpoints = root / "models" / "train" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (checkpoints / "step-00000020.pt.sha256").exists():
        assert stage.poll() is None, stage.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint of step 20 within 5 minutes"
        time.sleep(0.05)
    os.killpg(stage.pid, signal.SIGINT)  # Ctrl-C: dvc and the training it runs
    interrupted = stage.communicate(timeout=120)[0]
    assert stage.returncode != 0, interrupted
    assert "received SIGINT at step" in interrupted, interrupted[-3000:]
    assert not (root / "models" / "train" / "model").exists()
    assert any(name.startswith("step-") for name in os.listdir(checkpoints))

    continued = run(["dvc", "repro", "train"], root, env)
    assert "is of this run; continuing it" in continued and "resuming from" in continued, continued[-3000:]
    metrics = json.loads((root / "models" / "train" / "metrics.json").read_text())
    assert 20 <= metrics["resumed_from_step"] < steps
    model, expected = root / "models" / "train" / "model", reference / "model"
    assert (model / "open_clip_model.safetensors").read_bytes() == \
        (expected / "open_clip_model.safetensors").read_bytes()
    assert (root / "models" / "train" / "loss_history.csv").read_text() == \
        (reference / "loss_history.csv").read_text()

    # A key that defines the run changed: the next `dvc repro` starts afresh, naming it.
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["optim"]["lr"] = params["optim"]["lr"] / 2
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # (stopped once it has said so: the rest would be a whole run again)
    afresh = _output_until(["dvc", "repro", "train"], root, env, "starting afresh")
    assert "is of another run (optim.lr:" in afresh, afresh[-3000:]


def _output_until(args: list[str], root: Path, env: dict[str, str], text: str) -> str:
    """The output of ``args`` up to the line holding ``text``; then the command is interrupted (Ctrl-C)."""
    started = subprocess.Popen(args, cwd=root, env=env, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in started.stdout:
            lines.append(line)
            if text in line:
                break
    finally:
        os.killpg(started.pid, signal.SIGINT)
        started.communicate(timeout=120)
    output = "".join(lines)
    assert text in output, output[-3000:]
    return output
