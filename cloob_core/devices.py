"""Which device a stage runs on and at which precision: what training and evaluation share.

``auto`` takes a usable NVIDIA GPU where there is one and the CPU otherwise (where a GPU is present but CUDA does
not work, it says why); ``cuda`` (or ``cuda:N``) must be usable, or the stage stops in one line naming the problem:
the torch build, the driver, or ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from cloob_core.config import ConfigError

log = logging.getLogger(__name__)

# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA compatibility table).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def choose_device(requested: str, *, local_rank: int = 0, setting: str = "train.device") -> torch.device:
    """``cpu``; ``cuda`` (this rank's GPU, ``local_rank`` over the visible ones) or ``cuda:N``, which must be
    usable; ``auto``: the GPU where CUDA works, else the CPU (with a warning where an NVIDIA GPU is present).
    ``setting`` names the option in the messages."""
    try:
        device = torch.device(requested) if requested != "auto" else None
    except RuntimeError:
        raise ConfigError(f"{setting} {requested!r} is not a device (auto, cpu, cuda, cuda:1, ...)") from None
    if device is not None and device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{setting} {requested!r}: only auto, cpu and cuda devices are supported")
    if device is not None and device.type == "cpu":
        return device
    if torch.cuda.is_available():
        if device is not None and device.index is not None:
            if device.index >= torch.cuda.device_count():
                raise ConfigError(f"{setting} is {requested}, but only {torch.cuda.device_count()} CUDA device(s) "
                                  "are visible")
            return device
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if device is not None:
        raise ConfigError(f"{setting} is {requested}, but CUDA is unusable here: {cuda_problem()}")
    if nvidia_driver() is not None or Path("/dev/nvidia0").exists():
        log.warning("%s auto: an NVIDIA GPU is here but CUDA is unusable (%s); running on the CPU", setting,
                    cuda_problem())
    return torch.device("cpu")


def resolve_precision(requested: str, device: torch.device) -> str:
    """``auto``: bf16 autocast on a GPU with bf16 units (Ampere and later; open_clip_train's choice too), fp16 on
    an older one (training adds a GradScaler), fp32 on the CPU; any other value as it is."""
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


def autocast(precision: str, device_type: str) -> Any:
    """The autocast context of a resolved ``precision`` (none for fp32)."""
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


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


