"""Checkpoints: everything a run needs to continue at the exact next step, written atomically.

Saved with ``torch.save`` and read with ``torch.load(weights_only=True)``, so a checkpoint is data, never code:
tensors and plain containers only (numpy RNG state is stored as lists). Local files are written to a temporary
name and renamed; an optional ``s3://`` mirror receives each checkpoint as a completed upload.
"""

from __future__ import annotations

import logging
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cloob_core import storage
from cloob_core.config import ConfigError
from cloob_core.io import atomic_path

log = logging.getLogger(__name__)
_NAME = re.compile(r"^step-(\d{8})\.pt$")

# Settings a resumed run must share with its checkpoint: they fix parameter shapes or the data order.
MUST_MATCH = ("model.architecture", "train.objective", "train.batch_size", "train.data_streams", "train.seed",
              "train.shuffle_buffer", "train.augment")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "python_version": 3,
             "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), None))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(state: dict[str, Any], folder: Path, step: int, keep: int, mirror: str | None = None) -> Path:
    path = folder / checkpoint_name(step)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    if mirror:
        if storage.is_s3(mirror):
            storage.upload_file(path, storage.join(mirror, path.name))  # an upload; the local file stays
        else:
            storage.write_bytes(storage.join(mirror, path.name), path.read_bytes())
    _retain(str(folder), keep)
    if mirror:
        _retain(mirror, keep)
    return path


def _retain(location: str, keep: int) -> None:
    names = sorted(n for n in storage.list_names(location) if _NAME.match(n))
    for name in names[:-keep]:
        storage.delete(storage.join(location, name))


def latest(location: str) -> str | None:
    """The newest complete checkpoint in a local folder or under an ``s3://`` prefix."""
    names = sorted(n for n in storage.list_names(location) if _NAME.match(n))
    return storage.join(location, names[-1]) if names else None


def load(location: str) -> dict[str, Any]:
    if storage.is_s3(location):
        with tempfile.NamedTemporaryFile(suffix=".pt") as handle:
            handle.write(storage.read_bytes(location))
            handle.flush()
            return torch.load(handle.name, map_location="cpu", weights_only=True)
    return torch.load(location, map_location="cpu", weights_only=True)


def check_compatible(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    def get(config: dict[str, Any], dotted: str) -> Any:
        section, key = dotted.split(".")
        return config.get(section, {}).get(key)

    differences = [f"{key}: {get(saved, key)!r} in the checkpoint, {get(current, key)!r} now"
                   for key in MUST_MATCH if get(saved, key) != get(current, key)]
    if differences:
        raise ConfigError(f"checkpoint {where} comes from an incompatible configuration:\n  "
                          + "\n  ".join(differences) + "\nStart a new output folder, or resume with its settings.")
