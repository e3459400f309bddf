"""Where this process sits in a (possibly multi-node) job, from the environment the launcher set.

torchrun and the Kubeflow Training Operator (PyTorchJob; Trainer v2 runs torchrun) set ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; SLURM sets ``SLURM_PROCID``,
``SLURM_NTASKS`` and ``SLURM_LOCALID`` (the batch script exports ``MASTER_ADDR``/``MASTER_PORT``). Without any
of them the run is a single process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
