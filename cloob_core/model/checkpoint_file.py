"""Reading one checkpoint file: its checksum checked, its contents read as data. Apart from the rest of
:mod:`cloob_core.training.checkpoint` so that evaluating a checkpoint (``cloob eval --checkpoint``) needs none of the
training loop's code."""

from __future__ import annotations

import hashlib
import io
from typing import Any

from cloob_core import storage
from cloob_core.errors import StageError
from cloob_core.io import UnreadableFile, read_torch


class CheckpointError(StageError):
    """A checkpoint that cannot be resumed from: incomplete, corrupt, or not a checkpoint of ours."""


CHECKSUM_SUFFIX = ".sha256"
# Settings that define a run, added after checkpoints were first written: the value a checkpoint written before a
# setting existed ran with, so that such a run resumes as it began (and is not refused as another run).
PREDATING_SETTINGS = {"objective.start_without_hopfield": 0, "objective.start_until_margin": 0.0,
                      "objective.start_limit_factor": 3.0}


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load(location: str) -> dict[str, Any]:
    """A checkpoint whose bytes match its checksum, read as data (``weights_only``: no code runs)."""
    try:
        data = storage.read_bytes(location)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {location} does not exist") from None
    try:
        expected = storage.read_bytes(str(location) + CHECKSUM_SUFFIX).decode().strip()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {location} has no {CHECKSUM_SUFFIX} file beside it: it was not written "
                              "completely (or by a version before checksums); resume from another") from None
    if sha256_hex(data) != expected:
        raise CheckpointError(f"checkpoint {location} is corrupt: its SHA-256 differs from the one recorded when it "
                              "was written; resume from an earlier one") from None
    try:
        saved = read_torch(io.BytesIO(data), f"checkpoint {location}")
    except UnreadableFile as err:
        raise CheckpointError(str(err)) from None
    config = saved.get("config") if isinstance(saved, dict) else None
    for dotted, value in PREDATING_SETTINGS.items():
        section, key = dotted.split(".")
        if isinstance(config, dict) and isinstance(config.get(section), dict):
            config[section].setdefault(key, value)
    return saved
