"""Evaluation while training (train.eval_every): the final weights are bit-identical with and without it, on one
process and on 2 gloo ranks; the figures at step N are those of `cloob eval suite --checkpoint` on step N's
checkpoint; they reach TensorBoard, Prometheus and eval_history.csv; an evaluation that fails is reported and the
run goes on."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import forked
import pytest
from safetensors.torch import load_file

from cloob_core.cli import main

EVAL = ["--set", "train.eval_datasets=[captioned]"]  # retrieval and diagnostics on the captioned set's test split


def _cli(shards: Path, output: Path, *extra: str) -> list[str]:
    return ["train", "--shards", str(shards), "--output", str(output), "--steps", "8", "--batch-size", "32",
            "--data-streams", "4", "--workers", "0", "--checkpoint-every", "4", "--log-every", "4", "--no-progress",
            "--set", "model.architecture=cloob-tiny-vit", *extra]


def _weights(output: Path) -> dict:
    return load_file(output / "model" / "open_clip_model.safetensors")


def _same(one: dict, two: dict) -> bool:
    return set(one) == set(two) and all(bool((one[key] == two[key]).all()) for key in one)


@pytest.fixture(scope="module")
def runs(mnist_train_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-while-training")
    assert main(_cli(mnist_train_shards, root / "plain")) == 0
    assert main(_cli(mnist_train_shards, root / "evaluated", "--eval-every", "4", *EVAL)) == 0
    return root


def test_the_weights_are_the_same_with_and_without_evaluation(runs):
    root = runs
    assert _same(_weights(root / "plain"), _weights(root / "evaluated"))
    plain, evaluated = ((root / name / "loss_history.csv").read_text() for name in ("plain", "evaluated"))
    assert plain == evaluated


def test_the_figures_at_a_step_are_cloob_evals_on_its_checkpoint(runs, tmp_path):
    root = runs
    checkpoint = root / "evaluated" / "checkpoints" / "step-00000004.pt"
    assert main(["eval", "suite", "--checkpoint", str(checkpoint), "--dataset", "captioned", "--output",
                 str(tmp_path / "by-hand"), "--no-progress"]) == 0
    by_hand = json.loads((tmp_path / "by-hand" / "captioned" / "metrics.json").read_text())
    during = json.loads((root / "evaluated" / "evals" / "step-00000004" / "results" / "captioned" /
                         "metrics.json").read_text())
    assert by_hand == during and by_hand["captioned_zeroshot_retrieval"]["image_retrieval_recall@5"] >= 0


def test_the_scalars_reach_tensorboard_and_the_plots_file(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = runs
    with (root / "evaluated" / "eval_history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["step"] for row in rows] == ["4", "8"]
    assert float(rows[0]["captioned_zeroshot_retrieval.image_retrieval_recall@5"]) >= 0
    events = EventAccumulator(str(root / "evaluated" / "tensorboard")).Reload()
    points = events.Scalars("eval/captioned_zeroshot_retrieval.image_retrieval_recall@5")
    assert [point.step for point in points] == [4, 8]
    assert float(rows[1]["captioned_zeroshot_retrieval.image_retrieval_recall@5"]) == pytest.approx(points[1].value)


def test_a_failing_evaluation_is_reported_and_the_run_goes_on(mnist_train_shards, tmp_path, caplog):
    import logging

    import yaml

    caplog.set_level(logging.WARNING)
    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    params["eval"]["datasets"]["broken"] = {"source": str(tmp_path / "nowhere"), "tasks": ["zeroshot"]}
    params["train"].pop("shards")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert main(_cli(mnist_train_shards, tmp_path / "run", "--params", str(tmp_path / "params.yaml"),
                     "--eval-every", "4", "--set", "train.eval_datasets=[broken]")) == 0
    assert "evaluation of step 4 failed (exit 2)" in caplog.text and "the run goes on" in caplog.text
    assert (tmp_path / "run" / "model" / "open_clip_model.safetensors").exists()


@pytest.mark.slow  # ~40 s, in the slow phase for the default one's budget (docs/development.md)
def test_two_gloo_ranks_train_the_same_weights_with_and_without_evaluation(mnist_train_shards, tmp_path,
                                                                           pushgateway):
    address, received = pushgateway
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                "cloob_core.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, extra in (("plain", []), ("evaluated", ["--eval-every", "4", "--pushgateway", address, *EVAL])):
        done = subprocess.run([*launcher, *_cli(mnist_train_shards, tmp_path / name, *extra)], capture_output=True,
                              text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    assert _same(_weights(tmp_path / "plain"), _weights(tmp_path / "evaluated"))
    assert (tmp_path / "evaluated" / "evals" / "step-00000008" / "results" / "captioned" / "metrics.json").exists()
    bodies = "\n".join(body for _, body in received)  # rank 0's Prometheus metrics, pushed
    assert 'cloob_train_eval{metric="captioned_zeroshot_retrieval.image_retrieval_recall@5"}' in bodies
    assert "cloob_train_eval_step 8.0" in bodies


def _trainer(output: Path, *extra: str, shards: Path) -> forked.Forked:
    """`cloob train` with an evaluation every 4 steps, in a process of its own (forked: tests/forked.py); its
    stderr appended to OUTPUT.log (a file, so that a run nobody reads while it is watched never blocks on a full
    pipe). Its evaluations are processes the trainer starts, as in any run."""
    return forked.start(_cli(shards, output, "--eval-every", "4", *EVAL, *extra),
                        log=output.parent / f"{output.name}.log")


def _stderr(output: Path) -> str:
    return (output.parent / f"{output.name}.log").read_text()


def _evaluations(trainer: forked.Forked) -> list:
    import psutil

    found = []
    for child in psutil.Process(trainer.pid).children(recursive=True):
        try:
            if "suite" in child.cmdline() and "eval" in child.cmdline():
                found.append(child)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow  # ~35 s, in the slow phase for the default one's budget (docs/development.md)
def test_a_stopped_evaluation_is_killed_at_its_deadline_and_the_run_ends_whole(mnist_train_shards, tmp_path):
    """The evaluation of step 4 is SIGSTOPped as soon as it starts (a frozen mount looks the same): at
    train.eval_timeout_s it is killed with a warning, step 8's evaluation runs, and the run ends with its model."""
    import signal
    import time

    # the deadline counts from an evaluation's start (a new process importing torch): 90 s leaves step 8's own
    # evaluation time to finish on a loaded 2-core machine (8 s did not, once, nor 30 s in a CI run of 4 workers
    # on a machine half as fast: no history row)
    trainer = _trainer(tmp_path / "run", "--set", "train.eval_timeout_s=90", shards=mnist_train_shards)
    stopped = None
    deadline = time.monotonic() + 300
    while stopped is None and trainer.poll() is None and time.monotonic() < deadline:
        for child in _evaluations(trainer):
            if "step-00000004" in " ".join(child.cmdline()):
                child.send_signal(signal.SIGSTOP)
                stopped = child
        time.sleep(0.05)
    trainer.wait(timeout=600)
    err = _stderr(tmp_path / "run")
    assert stopped is not None and trainer.returncode == 0, err[-3000:]
    assert "evaluation of step 4 ran past train.eval_timeout_s (90s) and was killed; the run goes on" in err
    assert not _alive(stopped)
    with (tmp_path / "run" / "eval_history.csv").open() as handle:
        assert [row["step"] for row in csv.DictReader(handle)] == ["8"]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 8
    assert (tmp_path / "run" / "model" / "open_clip_model.safetensors").exists()


def _alive(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_when(output: Path, trainer: forked.Forked, point: str) -> list:
    """SIGKILL ``trainer`` at ``point``; the evaluation processes it had then."""
    import signal
    import time

    evals = output / "evals"
    reached = {
        "checkpoint 4 written": lambda: (output / "checkpoints" / "step-00000004.pt.sha256").exists(),
        "evaluating step 4": lambda: any("step-00000004" in " ".join(c.cmdline()) for c in _evaluations(trainer)),
        "step 4 evaluated": lambda: (evals / "step-00000004" / "scalars.json").exists(),
        "evaluating step 8": lambda: any("step-00000008" in " ".join(c.cmdline()) for c in _evaluations(trainer)),
    }[point]
    deadline = time.monotonic() + 300
    while trainer.poll() is None and time.monotonic() < deadline:
        try:
            if reached():
                break
        except Exception:  # a process that ended between the listing and its command line
            pass
        time.sleep(0.02)
    assert trainer.poll() is None, f"the run ended before {point}"
    orphans = _evaluations(trainer)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(timeout=60)
    return orphans


@pytest.fixture(scope="module")
def whole_run(mnist_train_shards, tmp_path_factory) -> Path:
    """The run that the killed ones must end as: the same process and settings, never killed."""
    output = tmp_path_factory.mktemp("whole") / "run"
    assert _trainer(output, shards=mnist_train_shards).wait(timeout=600) == 0, _stderr(output)[-3000:]
    return output


@pytest.mark.slow  # ~2.5 minutes: four runs killed at points around an evaluation, each resumed
def test_a_run_killed_around_an_evaluation_resumes_to_the_same_history_and_weights(mnist_train_shards, tmp_path,
                                                                                    whole_run):
    """kill -9 of the trainer at each point around an evaluation (its checkpoint written, the evaluation running,
    the evaluation recorded, the last step's evaluation running), then `--resume` (``auto``, as DVC's stage resumes,
    and ``latest``, two points each): the evaluation process dies with its trainer, and the resumed run ends with
    the eval_history.csv and the weights of a run never killed."""
    import time

    expected = (whole_run / "eval_history.csv").read_text()
    assert [line.split(",")[0] for line in expected.splitlines()[1:]] == ["4", "8"]
    for number, (point, resume) in enumerate([("checkpoint 4 written", "auto"), ("evaluating step 4", "latest"),
                                              ("step 4 evaluated", "auto"), ("evaluating step 8", "latest")]):
        output = tmp_path / f"killed-{number}"
        orphans = _kill_when(output, _trainer(output, shards=mnist_train_shards), point)
        living = orphans
        for _ in range(200):  # the evaluation at once (PR_SET_PDEATHSIG); its data-loader workers, if any, by
            living = [p.pid for p in orphans if _alive(p)]  # torch's watchdog
            if not living:
                break
            time.sleep(0.1)
        assert not living, point  # none outlives its trainer
        resumed = _trainer(output, "--resume", resume, shards=mnist_train_shards)
        assert resumed.wait(timeout=600) == 0, (point, _stderr(output)[-3000:])
        assert (output / "eval_history.csv").read_text() == expected, point
        assert _same(_weights(output), _weights(whole_run)), point


def _killed_at_step_8(mnist_train_shards: Path, tmp_path: Path) -> Path:
    """A run of 12 steps evaluated at steps 4, 8 and 12, as a kill between steps 8 and 12 leaves it: its
    checkpoint of step 12 and its outputs gone."""
    output = tmp_path / "run"
    assert main([*_cli(mnist_train_shards, output, "--eval-every", "4", *EVAL), "--steps", "12"]) == 0
    (output / "checkpoints" / "step-00000012.pt").unlink()
    shutil.rmtree(output / "model")
    return output


@pytest.mark.slow  # ~75 s (a run of 12 steps, then its resume in a process of its own), over the default's budget
def test_a_resume_keeps_lost_rows_evaluates_a_damaged_record_again_and_ends_its_workers(mnist_train_shards, tmp_path):
    """Resumed at step 8 with step 4's folder deleted by hand and step 8's `scalars.json` damaged (a JSON list):
    step 4's row of eval_history.csv, which cannot be evaluated again (its export is gone), was dropped without a
    word; the list gave an AttributeError (an internal error), and it and garbage hung at times: the data-loader
    workers forked before the resume read the record and never stopped. Now the row is kept and said so, the
    damaged step is evaluated again from its export, and the run (data-loader workers and all) ends."""
    run = _killed_at_step_8(mnist_train_shards, tmp_path)
    shutil.rmtree(run / "evals" / "step-00000004")
    (run / "evals" / "step-00000008" / "scalars.json").write_text("[1, 2]")  # garbage takes the same way
    argv = [*_cli(mnist_train_shards, run, "--eval-every", "4", *EVAL), "--steps", "12", "--resume", "latest",
            "--workers", "2"]
    done = subprocess.run([sys.executable, "-m", "cloob_core.cli", *argv], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "an internal error" not in done.stderr
    assert "step-00000008/scalars.json is damaged" in done.stderr
    assert "evaluations of step(s) 4: their folders under evals/ are gone; their rows of eval_history.csv are " \
           "kept" in done.stderr
    with (run / "eval_history.csv").open() as handle:
        assert [row["step"] for row in csv.DictReader(handle)] == ["4", "8", "12"]
