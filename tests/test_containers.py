"""The pipeline's steps inside the project's CPU image, on a real Docker engine: the image's hygiene, and the pretrain
pipeline run in containers (kfp.local's DockerRunner, each step's compiled executor command in the image) giving the
metrics of the same pipeline run as subprocesses. scripts/container_test.sh starts the engine, builds the image and
runs these (CI does); without an engine they are skipped, except under CI, where that is a failure."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import short_suite

pytestmark = pytest.mark.container
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")
ROOT = Path(__file__).resolve().parents[1]
RUNNERS = ("docker", "subprocess")


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def image() -> str:
    from components.images import CPU_IMAGE

    if shutil.which(DOCKER) is None or docker("info", check=False).returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("no Docker engine answers; scripts/container_test.sh starts one")
        pytest.skip("no Docker engine answers (infra/images/engine.sh start)")
    if docker("image", "inspect", CPU_IMAGE, check=False).returncode != 0:
        pytest.fail(f"{CPU_IMAGE} is not built; infra/images/build.sh --variant cpu builds it")
    return CPU_IMAGE


def in_image(image: str, script: str, *options: str) -> str:
    return docker("run", "--rm", "--network", "none", *options, image, "sh", "-c", script).stdout


def test_the_image_runs_as_its_user_on_a_read_only_root_with_writable_scratch(image):
    out = in_image(image, "id -u; id -g; echo $HOME; cloob --version; touch /workspace/a /tmp/b && echo writable; "
                   "touch /opt/cloob/c 2>/dev/null || echo read-only",
                   "--read-only", "--tmpfs", "/tmp", "--tmpfs", "/workspace:uid=10001,gid=10001").split("\n")
    assert out[:3] == ["10001", "10001", "/home/cloob"]
    assert importlib.metadata.version("cloob-pipelines") in out[3]
    assert out[4:6] == ["writable", "read-only"]


def test_the_image_has_no_compiler_and_its_packages_are_consistent(image):
    assert in_image(image, "command -v gcc cc c++ g++ || echo none").strip() == "none"
    assert "No broken requirements found" in in_image(image, "pip check")


def test_the_image_draws_chinese_and_japanese_captions_on_the_curation_sheets(image):
    """The image has a font of the CJK scripts, which lettering finds (docs/curation.md: the report's sheets)."""
    code = ("from cloob_core.curation.lettering import font_for; "
            "print(*(font_for(t)[1] for t in ('一只绿色的三角形。', '赤い丸', '고양이', 'Кошка')))")
    assert in_image(image, f'python -c "{code}"').split() == ["True"] * 4


def test_a_cpu_quota_sets_the_thread_budget(image):
    """A container limited to one CPU by a cgroup quota (what a pod's limits.cpu sets) plans one torch thread,
    however many cores the host shows it; without the quota it plans one per core."""
    code = ("from cloob_core.threads import plan_threads, usable_cores; "
            "print(usable_cores(), plan_threads().torch_threads)")
    assert in_image(image, f'python -c "{code}"', "--cpus", "1").split() == ["1", "1"]
    cores = str(len(os.sched_getaffinity(0)))
    assert in_image(image, f'python -c "{code}"').split() == [cores, cores]


def test_no_credentials_are_baked_into_the_image(image):
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    config = docker("image", "inspect", "--format", "{{json .Config.Env}}", image).stdout
    for text in (history, config):
        assert "AWS_" not in text and "SECRET" not in text.upper() and "TOKEN" not in text.upper()


def run_local(root: Path, runner: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pipelines", "run-local", "--runner", runner, "--root", str(root),
               "--set", "train.epochs=1", *short_suite.SET, "--partitions", "2", *extra]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)


def container_lines(stdout: str) -> list[str]:
    """run-local's ``[container] step NAME: image …, user …, network …, exit status N`` lines."""
    return [line.strip() for line in stdout.splitlines() if line.strip().startswith("[container] step ")]


def step(line: str) -> str:
    return line.split()[2].rstrip(":")


def numbers(metrics: dict) -> dict[str, float]:
    return {f"{name}.{key}": value for name, values in metrics.items() if isinstance(values, dict)
            for key, value in values.items() if isinstance(value, (int, float))}


def test_the_pretrain_pipeline_in_containers_gives_the_metrics_of_subprocesses(image, tmp_path):
    from pipelines.local_run import final_metrics

    env = {**os.environ, "CLOOB_IMAGE_CUDA": image}  # no GPU here: the training step runs in the CPU image
    dvc_registry = sorted((ROOT / "models" / "registry").rglob("*"))
    runs, logs = {}, {}
    # both at once (CI's time: each run leaves a core idle for much of it; the same threads either way)
    with ThreadPoolExecutor(2) as pool:
        finished = dict(zip(RUNNERS, pool.map(lambda runner: run_local(tmp_path / runner, runner, env), RUNNERS),
                            strict=True))
    for runner, done in finished.items():
        assert done.returncode == 0, done.stderr[-2000:]
        (run,) = (tmp_path / runner).glob("cloob-pretrain-evaluate-*")
        assert len(done.stdout.splitlines()) < 40, done.stdout[-2000:]  # kfp.local's echo goes to the log file
        runs[runner], logs[runner] = final_metrics(run), (tmp_path / runner / "run-local.log").read_text() + done.stdout
    containers = container_lines(logs["docker"])
    summary = [line.strip() for line in logs["docker"].splitlines()
               if "finished (docker)" in line or line.strip().startswith("suite.")]
    print("\n".join(containers + summary))  # each step's container, user and exit status, and the final metrics
    assert any(line.startswith("suite.zeroshot_acc1") for line in summary), logs["docker"][-2000:]
    assert containers and all(f"image {image}, user 10001:10001, network none, exit status 0" in line
                              for line in containers), containers
    assert {"train", "report", "promote"} <= {step(line) for line in containers}
    assert "[container]" not in logs["subprocess"]
    (sizes,) = (tmp_path / "docker" / "shards").glob("shards-*/sizes.json")  # built in the mounted store
    assert sum(json.loads(sizes.read_text()).values()) == 2046  # 2,047 pairs, a 7-px one too_small
    assert not list((tmp_path / "docker").glob("cloob-pretrain-evaluate-*/**/*.tar"))  # and never copied
    ours, reference = numbers(runs["docker"]), numbers(runs["subprocess"])
    assert ours.keys() == reference.keys() and len(ours) > 20
    assert ours == pytest.approx(reference, abs=1e-9)
    # a 1-epoch model is not promoted (promote.min_first), and a local run's gate keeps to the run's own registry,
    # never the DVC pipeline's (params.yaml's promote.store)
    for runner in RUNNERS:
        assert "does not reach promote.min_first: suite.retrieval_recall@5" in logs[runner], logs[runner][-2000:]
        registry = tmp_path / runner / "registry"
        assert registry.is_dir() and not (registry / "production.json").exists()
    assert sorted((ROOT / "models" / "registry").rglob("*")) == dvc_registry


def test_the_cuda_image_carries_cuda_and_nccl_and_starts_the_trainer(image):
    """No GPU here: what can be checked without one. (The CPU image carries the same wheels unless built with
    TORCH_INDEX_URL, so it passes this too; the CUDA image is the one the training step names.)"""
    from components.images import CUDA_IMAGE

    if docker("image", "inspect", CUDA_IMAGE, check=False).returncode != 0:
        pytest.fail(f"{CUDA_IMAGE} is not built; infra/images/build.sh --variant cuda builds it")
    probe = ("import torch, torch.distributed as dist; "
             "print(torch.version.cuda, dist.is_nccl_available(), torch.cuda.is_available())")
    cuda, nccl, available = in_image(CUDA_IMAGE, f'python -c "{probe}"').split()
    assert cuda != "None" and nccl == "True" and available == "False"
    assert "usage: cloob train" in in_image(CUDA_IMAGE, "cloob train --help")
