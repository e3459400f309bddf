"""`python -m pipelines run-local` without a Docker engine: the step names it prints come from the compiled
executor commands, and a missing engine is one line, not a traceback. (The runs themselves, in containers and as
subprocesses, are in tests/test_containers.py and tests/test_kfp_pipeline.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import short_suite
import yaml

from cloob_core.training import checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_each_compiled_executor_names_its_component_function(tmp_path):
    from pipelines.__main__ import main
    from pipelines.local_run import _function_name

    path = tmp_path / "pipeline.yaml"
    assert main(["compile", "--output", str(path)]) == 0
    executors = next(yaml.safe_load_all(path.read_text()))["deploymentSpec"]["executors"]  # then the platform spec
    names = {_function_name(spec["container"]["command"] + spec["container"]["args"])
             for spec in executors.values()}
    assert {"acquire", "train", "evaluate", "report", "promote"} <= names and "step" not in names


def test_a_print_a_step_leaves_swapped_does_not_outlive_the_run():
    """kfp.local's parallel steps can leave ``builtins.print`` swapped for their indenting one (a race between
    threads); the run puts the process's own back, whether the pipeline ends or fails."""
    import builtins

    from pipelines.local_run import LocalRunError, _run

    original = builtins.print

    def leaves_print_indented(fails: bool) -> None:
        builtins.print = lambda *args, **kwargs: original("    ", *args, **kwargs)
        if fails:
            raise RuntimeError("Task 'train' finished with status FAILURE")

    _run(leaves_print_indented, {"fails": False})
    assert builtins.print is original
    with pytest.raises(LocalRunError, match="'train' finished with status FAILURE"):
        _run(leaves_print_indented, {"fails": True})
    assert builtins.print is original


def test_without_a_docker_engine_the_run_stops_with_one_line(tmp_path):
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    done = subprocess.run([sys.executable, "-m", "pipelines", "run-local", "--runner", "docker", "--root",
                           str(tmp_path / "root")], cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("pipelines: no Docker engine answers") and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_local_shards_store_is_mounted_into_every_step_and_an_s3_one_is_refused(tmp_path):
    """The containers have no network, so the store the shards are built in is a host folder mounted into each
    step at its own path, writable by the image's user."""
    from pipelines.local_run import LocalRunError, StepContainer

    container = StepContainer.sharing(str(tmp_path / "store"))
    (mount,) = container.run_args()["mounts"]
    assert mount["Source"] == mount["Target"] == str(tmp_path / "store") and mount["Type"] == "bind"
    assert (tmp_path / "store").stat().st_mode & 0o7777 == 0o1777
    assert container.run_args()["network_mode"] == "none"
    with pytest.raises(LocalRunError, match="must be folders on this machine, not s3://b/shards"):
        StepContainer.sharing("s3://b/shards")


@pytest.mark.slow  # ~3 minutes: the whole pretrain pipeline as subprocesses, its training step killed once
def test_a_killed_training_step_is_retried_and_resumes_from_its_mirrored_checkpoint(tmp_path):
    """The one-node training step under run-local, killed with SIGKILL once its first checkpoint is mirrored to the
    job workdir: kfp.local retries it (as Argo would an evicted pod), and the retry, in a fresh output folder,
    continues from that checkpoint instead of step 0; the run goes on to its report, and its gate, in the run's own
    registry, does not promote a model that short."""
    import contextlib
    import json
    import re
    import time

    import psutil

    root = tmp_path / "root"
    command = [sys.executable, "-m", "pipelines", "run-local", "--runner", "subprocess", "--root", str(root),
               "--set", "train.epochs=1", "--set", "train.checkpoint_every=2", *short_suite.SET, "--partitions", "2",
               "--train-retries", "1", "--train-retry-backoff-s", "0"]
    dvc_registry = sorted((ROOT / "models" / "registry").rglob("*")) if (ROOT / "models" / "registry").is_dir() \
        else []
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})

    def training_step() -> list[psutil.Process]:
        """The training step's process tree: its topmost process (the step's shell, or the executor) and every
        process under it (the executor, its data-loader workers). The function is the argument after
        --function_to_execute: another step may have "train" among its arguments (a split)."""
        for child in psutil.Process(run.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error, IndexError):
                command = child.cmdline()
                if "--function_to_execute" in command and \
                        command[command.index("--function_to_execute") + 1] == "train":
                    return [child, *child.children(recursive=True)]
        return []

    killed: list[str] = []
    seen: dict[str, float] = {}  # when the step was first seen running, and its first checkpoint mirrored
    start = time.monotonic()
    while not killed and run.poll() is None and time.monotonic() < start + 600:
        # a checkpoint every 2 steps and a poll every 20 ms, so that the kill comes while the step still runs
        step = training_step()
        if step:
            seen.setdefault("training", time.monotonic() - start)
        # a whole mirrored checkpoint (its bytes and its checksum, which goes first), as a retry looks for one
        if any(checkpoint.complete(str(folder)) for folder in root.glob("jobs/cloob-train-*/checkpoints")):
            seen.setdefault("mirrored", time.monotonic() - start)
            for process in step:
                with contextlib.suppress(psutil.Error):
                    killed.append(" ".join(process.cmdline())[:200])
                    process.kill()
            if not killed:
                break  # the checkpoint was mirrored and the step has ended: too late to kill it
        time.sleep(0.02)
    out, err = run.communicate(timeout=900)
    assert killed, ("the training step was not killed while it ran", seen, err[-2000:])
    assert run.returncode == 0, err[-2000:]
    log = re.sub(r"\x1b\[[0-9;]*m", "", (root / "run-local.log").read_text())  # kfp.local's colours
    ends = [line.split(" - ")[-1] for line in log.splitlines() if "Task 'train' finished with status" in line]
    assert ends == ["Task 'train' finished with status FAILURE", "Task 'train' finished with status SUCCESS"], (
        killed, ends)  # killed, then retried by kfp.local
    (metrics_file,) = root.glob("cloob-pretrain-evaluate-*/train/model/metrics.json")
    metrics = json.loads(metrics_file.read_text())
    assert metrics["resumed_from_step"] >= 2, metrics  # from the mirrored checkpoint, not from step 0
    assert metrics["steps"] == 15  # 1 epoch of 2,046 pairs at batch 128
    assert "suite.zeroshot_acc1" in out
    # a short run's model is not promoted (promote.min_first), and a local run's gate uses its own registry
    assert "does not reach promote.min_first: suite.retrieval_recall@5" in log
    assert (root / "registry").is_dir() and not (root / "registry" / "production.json").exists()
    assert (sorted((ROOT / "models" / "registry").rglob("*")) if dvc_registry else []) == dvc_registry
