"""A broken image (a dependency removed) fails the pipeline run in containers at its first step, in one line naming
the step. Its own file, so that scripts/container_test.sh runs it on a second worker beside the pipeline run of
tests/test_containers.py: most of its time is kfp.local waiting out the step's retry backoff (60 s, then 120 s)."""

from __future__ import annotations

import os

import pytest
from test_containers import container_lines, docker, image, run_local, step

pytestmark = pytest.mark.container
BROKEN = "cloob-pipelines:broken-test"
__all__ = ["image"]  # the fixture, shared with tests/test_containers.py


def test_an_image_missing_a_dependency_fails_the_run_naming_the_step(image, tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    # pyarrow: the first step (acquire, which writes the manifest's parquet parts) fails, not the fifth
    dockerfile.write_text(f"FROM {image}\nUSER 0\nRUN rm -rf /opt/cloob/lib/python3.11/site-packages/pyarrow\n"
                          "USER 10001:10001\n")
    docker("build", "--network", "none", "-q", "-t", BROKEN, str(tmp_path))
    try:
        env = {**os.environ, "CLOOB_IMAGE_CPU": BROKEN, "CLOOB_IMAGE_CUDA": BROKEN}
        done = run_local(tmp_path / "root", "docker", env)
    finally:
        docker("rmi", "-f", BROKEN, check=False)
    print(done.stdout[-3000:], done.stderr[-1000:])
    assert done.returncode != 0
    output = done.stdout + (tmp_path / "root" / "run-local.log").read_text()  # kfp.local's echo is in the log
    failed = [line for line in container_lines(output) if not line.endswith("exit status 0")]
    assert failed, output[-3000:]
    assert "pyarrow is required" in output + done.stderr  # pandas' words, reading the packaged parquet
    error = done.stderr.strip().splitlines()[-1]  # one line naming the failed task
    task = step(failed[0]).replace("_", "-")
    assert error.startswith("pipelines: ") and f"'{task}'" in error and "FAILURE" in error, error
