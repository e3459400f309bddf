"""Where this process sits in a (possibly multi-node) job, from the environment the launcher set.

torchrun and the Kubeflow Training Operator (PyTorchJob; Trainer v2 runs torchrun) set ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; SLURM sets ``SLURM_PROCID``,
``SLURM_NTASKS`` and ``SLURM_LOCALID`` (the batch script exports ``MASTER_ADDR``/``MASTER_PORT``). Without any
of them the run is a single process.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from cloob_core.config import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "single process"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect(environ: dict[str, str] | None = None) -> DistEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "RANK/WORLD_SIZE (Training Operator)"
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), launcher)
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "SLURM")
    return DistEnv()


# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA compatibility table).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


def choose_device(requested: str, env: DistEnv) -> torch.device:
    """``cuda`` must be usable, or the run stops in one line saying why; ``auto`` takes the CPU only where no
    NVIDIA GPU is there to use, and warns where one is but CUDA does not work."""
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    if requested == "cuda":
        raise ConfigError(f"train.device is cuda, but CUDA is unusable here: {cuda_problem()}")
    if nvidia_driver() is not None or Path("/dev/nvidia0").exists():
        log.warning("train.device auto: an NVIDIA GPU is here but CUDA is unusable (%s); training on the CPU",
                    cuda_problem())
    return torch.device("cpu")


def nvidia_driver() -> str | None:
    """The loaded NVIDIA kernel driver's version, or None."""
    try:
        found = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s",
                          Path("/proc/driver/nvidia/version").read_text())
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False).stdout.split()
        return out[0] if out else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def cuda_problem() -> str:
    """Why torch sees no CUDA device, naming the build and the driver."""
    build = torch.version.cuda
    if build is None:
        return f"torch {torch.__version__} is a CPU-only build; install a CUDA build"
    needed = MIN_DRIVER.get(int(build.split(".")[0]))
    need = f", which needs an NVIDIA driver >= {needed}" if needed else ""
    driver = nvidia_driver()
    if driver is None:
        return f"torch {torch.__version__} is a CUDA {build} build{need}, and no NVIDIA driver is loaded"
    if needed and _version(driver) < _version(needed):
        return f"torch {torch.__version__} is a CUDA {build} build{need}; the driver here is {driver}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"driver {driver} and torch {torch.__version__} (CUDA {build}) see no GPU"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))


def init_process_group(env: DistEnv, device: torch.device) -> None:
    if not env.distributed or dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size)
    log.info("rank %d of %d (%s, %s backend)", env.rank, env.world_size, env.launcher, backend)


def across_ranks(model: torch.nn.Module, env: DistEnv, device: torch.device, *, sync_batchnorm: bool = False,
                 grad_compression: str = "none") -> torch.nn.Module:
    """What forward runs through: ``model`` itself in one process; else DDP around it (SyncBatchNorm first on
    GPUs, if asked), with ``grad_compression`` bf16 all-reducing the gradients in bfloat16 (half the bytes
    between nodes; each gradient is rounded to 8 bits of mantissa before the average, as torch's
    ``bf16_compress_hook`` does)."""
    if not env.distributed:
        return model
    if sync_batchnorm and device.type == "cuda":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                        else None)
    if grad_compression == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return wrapped
