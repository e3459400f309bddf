"""`python -m pipelines run-local` without a Docker engine: the step names it prints come from the compiled
executor commands, and a missing engine is one line, not a traceback. (The runs themselves, in containers and as
subprocesses, are in tests/test_containers.py and tests/test_kfp_pipeline.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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


def test_the_root_loggers_handlers_two_interleaved_steps_swap_are_put_back():
    """kfp.local's own ``local_logger_context`` (each step's, swapping the root logger's handlers for one on the
    sys.stdout of the moment), entered and left as two threads interleave them: the second restores the first's
    handler, which outlived the run and wrote to a closed test capture (the CI run of 14ac501)."""
    import logging
    from contextlib import ExitStack

    from kfp.local.logging_utils import local_logger_context

    from pipelines.local_run import _run

    root = logging.getLogger()
    before, level = root.handlers[:], root.level

    def interleaved_steps() -> None:
        first, second = ExitStack(), ExitStack()
        first.enter_context(local_logger_context())
        second.enter_context(local_logger_context())  # saves the first step's handler as "the original"
        first.close()
        second.close()
        assert root.handlers != before  # what kfp.local alone leaves: the first step's handler

    _run(interleaved_steps, {})
    assert root.handlers == before and root.level == level


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
