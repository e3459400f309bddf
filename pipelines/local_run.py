"""Run a pipeline on this machine with kfp.local, either as subprocesses of this environment or inside the project's
images, as a cluster runs it: each step's compiled executor command in its component's image, as the image's user,
with no network, a read-only root filesystem and writable ``/tmp``, ``HOME`` and ``/workspace``; artifacts pass
between containers through the mounted pipeline root, and the shards through the mounted shards store (the
cluster's S3 prefix stands in for a host folder here). Nothing is pulled or installed at run time: a missing image is
an error that says how to build it.

kfp.local's own container launcher starts each container with auto-remove and, when the container is gone before it
is waited on, reports success; here a failing step must fail the run, so the launcher is replaced by one that waits
for the exit status, prints it with the step, image and user, and removes the container afterwards.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cloob_core.errors import StageError
from cloob_core.ops.trainjob import IMAGE_UID

Runner = Literal["subprocess", "docker"]
IMAGE_USER = f"{IMAGE_UID}:{IMAGE_UID}"  # infra/images/Dockerfile's USER
IMAGE_HOME = "/home/cloob"


class LocalRunError(StageError):
    """A local run that could not start or whose step failed."""


@dataclass(frozen=True)
class StepContainer:
    """How each step's container runs: the image's user, no network, a read-only root with writable scratch,
    and the ``shared`` host folders mounted read-write at their own paths."""

    user: str = IMAGE_USER
    network: str = "none"
    shared: tuple[str, ...] = ()

    @classmethod
    def sharing(cls, *stores: str) -> StepContainer:
        """The containers of a run whose shards and checkpoints are kept in ``stores``: folders of this machine,
        made writable for the image's user and mounted into every step (with no network, S3 is out of reach)."""
        from cloob_core import storage

        folders = []
        for store in stores:
            if storage.is_s3(store):
                raise LocalRunError(f"with --runner docker the steps have no network, so the shards store and the "
                                    f"job workdir must be folders on this machine, not {store}; or use --runner "
                                    "subprocess")
            folder = Path(store).resolve()
            folder.mkdir(parents=True, exist_ok=True)
            os.chmod(folder, 0o1777)
            folders.append(str(folder))
        return cls(shared=tuple(folders))

    def run_args(self) -> dict[str, Any]:
        from docker.types import Mount

        writable = f"uid={self.user.split(':')[0]},gid={self.user.split(':')[1]},mode=0755"
        return {"user": self.user, "network_mode": self.network, "read_only": True,
                "tmpfs": {"/tmp": "mode=1777", IMAGE_HOME: writable, "/workspace": writable},
                "mounts": [Mount(target=folder, source=folder, type="bind") for folder in self.shared]}


def _function_name(command: list[str]) -> str:
    """The component's function, from the compiled executor command (``--function_to_execute NAME``)."""
    for flag, value in itertools.pairwise(command):
        if flag == "--function_to_execute":
            return value
    return "step"


def _launch(client: Any, image: str, command: list[str], volumes: dict[str, Any], **run_args: Any) -> int:
    """Run one step's container to its end; returns its exit status (printed with the step, image and user)."""
    import docker

    if ":" not in image.rsplit("/", 1)[-1]:
        image = f"{image}:latest"
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise LocalRunError(f"image {image} is not on this Docker engine; build it with infra/images/build.sh "
                            "(nothing is pulled for a local run)") from None
    step = _function_name(command)
    container = client.containers.run(image=image, command=command, detach=True, volumes=volumes, **run_args)
    try:
        for line in container.logs(stream=True, follow=True):
            print(line.decode("utf-8", errors="replace"), end="")
        code = int(container.wait()["StatusCode"])
        user = container.attrs["Config"].get("User") or "root"
    finally:
        container.remove(force=True)
    print(f"[container] step {step}: image {image}, user {user}, network {run_args.get('network_mode', 'default')}, "
          f"exit status {code}", flush=True)
    return code


@contextmanager
def _our_launcher() -> Iterator[None]:
    from kfp.local import docker_task_handler

    original = docker_task_handler.run_docker_container
    docker_task_handler.run_docker_container = _launch
    try:
        yield
    finally:
        docker_task_handler.run_docker_container = original


def run_pipeline(pipeline: Any, parameters: dict[str, str], root: Path, runner: Runner,
                 container: StepContainer | None = None) -> Path:
    """Run ``pipeline`` (a pipeline function) with its run ``parameters`` (``pipelines.client.run_parameters``)
    under ``root``; returns the run's folder. Raises :class:`LocalRunError` when a step fails."""
    from kfp import local

    root.mkdir(parents=True, exist_ok=True)
    before = set(root.iterdir())
    if runner == "docker":
        import docker

        try:
            docker.from_env().ping()
        except docker.errors.DockerException as err:
            raise LocalRunError(f"no Docker engine answers ({err}); start one, e.g. infra/images/engine.sh start") \
                from None
        os.chmod(root, 0o1777)  # the steps run as the image's user and write their outputs here
        local.init(runner=local.DockerRunner(**(container or StepContainer()).run_args()), pipeline_root=str(root),
                   raise_on_error=True)
        with _our_launcher():
            _run(pipeline, parameters)
    else:
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
        _run(pipeline, parameters)
    runs = [path for path in set(root.iterdir()) - before if path.name.startswith(f"{pipeline.name}-")]
    if len(runs) != 1:
        raise LocalRunError(f"expected one new run folder of {pipeline.name} under {root}, found {len(runs)}")
    return runs[0]


@contextmanager
def output_to(log: Path) -> Iterator[None]:
    """Everything this process and the steps it starts write to stdout and stderr goes to ``log`` instead (kfp.local
    echoes each executor's input JSON and logs: thousands of lines); a failure names the log."""
    import sys

    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except LocalRunError as err:
            raise LocalRunError(f"{err}; the steps' output is in {log}") from None
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


@contextmanager
def kfp_local_state_kept() -> Iterator[None]:
    """``builtins.print`` and the root logger's handlers and level as they were before, once the block ends.
    kfp.local runs a ParallelFor's iterations in threads, and each step swaps both (print for one that indents by
    4 spaces, the root's handlers for one StreamHandler on the sys.stdout of the moment), restoring what it saw on
    entry: interleaved, the steps leave one of theirs in place (kfp 2.17). A print left indented every later line
    of the process (the run's summary, a test's next command); a handler left writes to a stream that may since
    have closed (a test's capture: every later log line of that process came with a logging error)."""
    import builtins

    root = logging.getLogger()
    original_print, original_handlers, original_level = builtins.print, root.handlers[:], root.level
    try:
        yield
    finally:
        builtins.print = original_print
        root.handlers[:] = original_handlers
        root.setLevel(original_level)


def _run(pipeline: Any, parameters: dict[str, str]) -> None:
    try:
        with kfp_local_state_kept():
            pipeline(**parameters)
    except RuntimeError as err:  # kfp.local: "Task 'NAME' finished with status FAILURE" (with colour codes)
        message = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()
        raise LocalRunError(message[0] if message else "a step failed") from None


def final_metrics(run: Path) -> dict[str, Any]:
    """The report step's metrics.json of a finished run."""
    reports = sorted(run.glob("report/folder/metrics.json"))
    if not reports:
        raise LocalRunError(f"{run} has no report/folder/metrics.json: the run did not reach its report step")
    return json.loads(reports[0].read_text("utf-8"))
