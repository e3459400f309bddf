"""What a GPU pod gets, checked on the CPU: CUDA required where GPUs were asked for (one line naming the build and
the driver), the precision each device resolves to, batches assembled once into page-locked memory, and a
normalisation that copies nothing to the device after its first call."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from cloob_core import devices as env
from cloob_core.config import load_config
from cloob_core.devices import resolve_precision
from cloob_core.ops import launch, trainjob
from cloob_core.training.batch_ring import BatchRing
from cloob_core.training.images import Normalize
from cloob_core.training.streams import Assembler, Chunk

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


@needs_no_cuda
def test_train_device_cuda_without_cuda_exits_2_in_one_line_naming_build_and_driver(mnist_train_shards, tmp_path):
    done = subprocess.run([sys.executable, "-m", "cloob_core.cli", "train", "--shards", str(mnist_train_shards),
                           "--output", str(tmp_path / "run"), "--no-progress", "--set", "train.device=cuda"],
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "train.device is cuda, but CUDA is unusable here" in lines[0]
    assert f"CUDA {torch.version.cuda} build" in lines[0] and "driver" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(("text", "version"), [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n", "535.104.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U22)\n",
     "580.95.05"),
])
def test_the_driver_version_is_read_from_the_kernel_module_line(text, version, monkeypatch, tmp_path):
    proc = tmp_path / "version"
    proc.write_text(text)
    real_path = env.Path
    monkeypatch.setattr(env, "Path", lambda p: proc if p == "/proc/driver/nvidia/version" else real_path(p))
    assert env.nvidia_driver() == version
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    if version.startswith("535"):
        assert "needs an NVIDIA driver >= 580.65.06; the driver here is 535.104.05" in env.cuda_problem()
    else:
        assert "see no GPU" in env.cuda_problem()


def test_a_step_given_gpus_requires_cuda_unless_the_params_say_cpu():
    config = load_config()
    assert config.train.device == "auto"
    assert launch.on_gpus(config, 0).train.device == "auto"
    assert launch.on_gpus(config, 1).train.device == "cuda"
    assert launch.on_gpus(load_config(overrides=["train.device=cpu"]), 8).train.device == "cpu"
    assert trainjob.job_config(config, "s3://d", "s3://w", gpus=8).train.device == "cuda"
    assert trainjob.job_config(config, "s3://d", "s3://w").train.device == "auto"


def test_precision_auto_is_fp32_on_the_cpu_and_bf16_or_fp16_on_a_gpu(monkeypatch):
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"  # today's CPU behaviour and results
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_precision("auto", torch.device("cuda", 0)) == "fp16"
    assert resolve_precision("fp32", torch.device("cuda", 0)) == "fp32"


def test_normalisation_builds_its_constants_once_and_keeps_the_input(monkeypatch):
    normalize = Normalize((0.5, 0.25, 0.0), (0.5, 0.5, 1.0))
    images = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    first = normalize(images)
    expected = (images.float() / 255 - torch.tensor([0.5, 0.25, 0.0]).view(1, 3, 1, 1)) / torch.tensor(
        [0.5, 0.5, 1.0]).view(1, 3, 1, 1)
    torch.testing.assert_close(first, expected)
    assert first.is_contiguous(memory_format=torch.channels_last)
    made = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real_tensor(*a, **k))
    as_float = images.float()
    torch.testing.assert_close(normalize(as_float), expected)
    assert made == []  # no new constants (on a GPU: no host-to-device copy) after the first call
    torch.testing.assert_close(as_float, images.float())  # float input is not normalised in place


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_page_locked_ring_gives_the_batch_to_the_gpu_on_its_own_stream_in_stream_order():
    ring = BatchRing(2, 6, 4, 6, torch.zeros(3, dtype=torch.long))
    device = torch.device("cuda")
    ring.pin(device)
    try:
        for stream in (2, 0, 1):  # as workers write, in any order
            ring.write(0, 2 * stream, [np.full((4, 4, 3), stream, dtype=np.uint8)] * 2, 2 * stream,
                       torch.full((2, 3), stream))
        (batch,) = Assembler([0, 1, 2], ring).batches(iter([[Chunk(0, 2, (0, 2), 0), Chunk(0, 0, (0, 2), 0)],
                                                             [Chunk(0, 1, (0, 2), 0)]]))
        assert batch.images.is_pinned() and batch.tokens.is_pinned()
        assert batch.images.is_contiguous(memory_format=torch.channels_last)
        images, tokens = batch.to(device)
        assert images[:, 0, 0, 0].tolist() == [0, 0, 1, 1, 2, 2] and tokens[:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    finally:
        ring.unpin()
