"""Checkpoints: everything a run needs to continue at the exact next step, written atomically.

:class:`TrainingState` is the one place that knows a checkpoint's layout: what is saved, under which key, and
how it is put back into the model, optimiser, schedule, scaler, objective and RNGs. Saved with ``torch.save``
and read with ``torch.load(weights_only=True)``, so a checkpoint is data, never code: tensors and plain
containers only (numpy RNG state is stored as lists). Local files are written to a temporary name and renamed;
an optional ``s3://`` mirror receives each checkpoint as a completed upload, in the background (:class:`Mirror`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cloob_core import storage
from cloob_core.config import ConfigError
from cloob_core.io import remove_temporaries, write_text, write_torch
from cloob_core.model.checkpoint_file import CHECKSUM_SUFFIX, sha256_hex
from cloob_core.model.checkpoint_file import CheckpointError as CheckpointError  # re-exported, as is load
from cloob_core.model.checkpoint_file import load as load
from cloob_core.training.streams import Position, carry_positions

log = logging.getLogger(__name__)
_NAME = re.compile(r"^step-(\d{8})\.pt$")

# The sections whose keys define a run: what is trained, by which objective and schedule, on what, for how long.
# A resumed run shares every one of their keys with its checkpoint but these, which say how and where it runs, not
# what it computes: train.data_streams among them, as a run may continue on another number of streams, and so of
# ranks (streams.carry_positions); train.shards, as the data may move (the data's fingerprint must not change).
RUN_SECTIONS = ("model", "objective", "optim", "train")
MAY_CHANGE_ON_RESUME = frozenset({
    "train.shards", "train.allow_incomplete_shards", "train.data_streams", "train.workers", "train.prefetch",
    "train.threads", "train.data_timeout_s", "train.sample_cache_mb", "train.precision", "train.accum_freq",
    "train.local_loss", "train.grad_checkpointing", "train.grad_compression", "train.compile",
    "train.sync_batchnorm", "train.device", "train.checkpoint_every", "train.keep_checkpoints",
    "train.checkpoint_sync", "train.log_every", "train.collapse_windows", "train.on_collapse",
    "train.tensorboard", "train.metrics_port", "train.metrics_host",
    "train.pushgateway", "train.eval_every", "train.eval_datasets"})


@dataclass(frozen=True, kw_only=True)
class Trainables:
    """What a checkpoint restores into, besides the RNGs."""

    model: Any  # the CLOOBModel, unwrapped (not DDP)
    optimizer: Any
    scheduler: Any
    scaler: Any
    objective: Any


@dataclass(kw_only=True)
class TrainingState:
    """Where a run stands: the next step, each data stream's position, the logged history."""

    step: int = 0
    positions: dict[int, Position] = field(default_factory=dict)
    history: list[tuple[float, ...]] = field(default_factory=list)  # a row per log window: collapse.HISTORY_COLUMNS
    open_window: tuple[float, int] = (0.0, 0)  # the loss summed since the last logged step, and its steps

    def checkpoint(self, parts: Trainables, config: dict[str, Any], world_size: int,
                   identity: dict[str, str]) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": parts.model.state_dict(),
            "optimizer": parts.optimizer.state_dict(),
            "scheduler": parts.scheduler.state_dict(),  # a pure function of the step; kept for inspection
            "scaler": parts.scaler.state_dict(),
            "objective": parts.objective.checkpoint_state(),  # band schedule step, negative queue
            "positions": {str(v): list(p) for v, p in sorted(self.positions.items())},
            "rng": rng_state(),
            "config": config,
            "identity": identity,  # the data's and the code's fingerprints (run_identity)
            "world_size": world_size,
            "history": [list(row) for row in self.history],
            "window": list(self.open_window),  # so that a run resumed mid-window logs what an uninterrupted one does
        }

    @classmethod
    def restore(cls, saved: dict[str, Any], parts: Trainables, config: dict[str, Any], identity: dict[str, str],
                where: str) -> TrainingState:
        """Put a checkpoint back into ``parts`` and the RNGs; refused when it is of another run."""
        check_compatible(saved, config, identity, where)
        parts.model.load_state_dict(saved["model"])
        parts.optimizer.load_state_dict(saved["optimizer"])
        parts.scheduler.load_state_dict(saved["scheduler"])
        parts.scaler.load_state_dict(saved["scaler"])
        parts.objective.load_checkpoint_state(saved.get("objective", {}))
        set_rng_state(saved["rng"])
        positions = {int(v): (int(p), int(o)) for v, (p, o) in saved["positions"].items()}
        saved_streams = saved["config"]["train"]["data_streams"]
        return cls(step=int(saved["step"]),
                   positions=carry_positions(positions, saved_streams, config["train"]["data_streams"], where),
                   history=[tuple(row) for row in saved["history"]],
                   open_window=tuple(saved.get("window", (0.0, 0))))


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def rng_state() -> dict[str, Any]:
    """The generators of the saving rank. Of CUDA's, only its own device's: a pod that resumes may see fewer
    GPUs (every device's state, restored on one GPU, indexed devices that were not there)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "python_version": 3,
             "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), None))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):  # an earlier checkpoint's states of every device: the first's
        cuda = cuda[0] if cuda else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)  # this rank's device


def save(state: dict[str, Any], folder: Path, step: int, keep: int) -> Path:
    """Write the checkpoint and, before it takes its name, its SHA-256 beside it (``step-N.pt.sha256``): a
    checkpoint without a checksum was not completely written, and one whose bytes differ is corrupt."""
    path = folder / checkpoint_name(step)
    checksum = folder / (path.name + CHECKSUM_SUFFIX)
    remove_temporaries(folder, lambda name: name.startswith("step-"))  # writes killed mid-way (this run's folder)
    write_torch(path, state, before_publish=lambda tmp: write_text(checksum, sha256_hex(tmp.read_bytes()) + "\n"))
    _retain(str(folder), keep)
    return path


class Mirror:
    """Uploads rank 0's checkpoints to an ``s3://`` prefix (``train.checkpoint_sync``) in a thread of its own, so
    the run goes on while one uploads: the other ranks would otherwise wait for it in their next collective,
    under NCCL's timeout, for as long as a 1.8 GB upload takes. The checksum goes first: a mirrored checkpoint is
    complete once its bytes are there too. A checkpoint submitted while another uploads waits; a newer one
    replaces it (retention would delete it anyway). A failed upload stops the run at the next checkpoint or at
    its end, naming the object, as an inline upload did."""

    def __init__(self, location: str, keep: int) -> None:
        self.location, self.keep = location, keep
        self._waiting: Path | None = None
        self._error: BaseException | None = None
        self._busy = False
        self._done = threading.Condition()
        self._closed = False  # set before the thread starts: it reads it at once
        self._thread = threading.Thread(target=self._upload_loop, name="cloob-checkpoint-mirror", daemon=True)
        self._thread.start()

    def submit(self, path: Path) -> None:
        self._raise_failure()
        with self._done:
            self._waiting = path
            self._done.notify_all()

    def finish(self, raise_failure: bool = True) -> None:
        """Wait for the uploads submitted so far, then stop; raises an upload's error (if ``raise_failure``)."""
        with self._done:
            while self._waiting is not None or self._busy:
                self._done.wait()
            self._closed = True
            self._done.notify_all()
        self._thread.join()
        if raise_failure:
            self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _upload_loop(self) -> None:
        while True:
            with self._done:
                while self._waiting is None and not self._closed:
                    self._done.wait()
                if self._waiting is None:
                    return
                path, self._waiting, self._busy = self._waiting, None, True
            try:
                self._upload(path)
            except BaseException as err:  # raised in the loop's thread by submit or finish
                self._error = err
            finally:
                with self._done:
                    self._busy = False
                    self._done.notify_all()

    def _upload(self, path: Path) -> None:
        checksum = path.parent / (path.name + CHECKSUM_SUFFIX)
        try:
            for file in (checksum, path):
                storage.copy_file(file, storage.join(self.location, file.name))
        except FileNotFoundError:  # retention removed it locally while older uploads ran: a newer one follows
            log.info("checkpoint %s was superseded before its upload", path.name)
            return
        _retain(self.location, self.keep)
        log.info("checkpoint %s mirrored to %s", path.name, self.location)


def complete(location: str) -> list[str]:
    """The checkpoints in ``location`` that have their checksum file, oldest first."""
    names = set(storage.list_names(location))
    return sorted(n for n in names if _NAME.match(n) and n + CHECKSUM_SUFFIX in names)


def _retain(location: str, keep: int) -> None:
    names = set(storage.list_names(location))
    done = complete(location)
    kept = set(done[-keep:])
    for name in sorted(names):
        checkpoint = name.removesuffix(CHECKSUM_SUFFIX)
        if _NAME.match(checkpoint) and checkpoint not in kept and (checkpoint in done or name != checkpoint):
            storage.delete(storage.join(location, name))


def latest(location: str) -> str | None:
    """The newest complete checkpoint (with its checksum) in a local folder or under an ``s3://`` prefix."""
    done = complete(location)
    return storage.join(location, done[-1]) if done else None


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """The version of the code that computes a run (the training loop, the objectives, the model, the
    configuration): a digest of its sources, so that a run re-done after a code change is not taken for the same
    run by ``--resume auto``."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(file for folder in ("config", "training", "objectives", "model")
                       for file in (package / folder).rglob("*") if file.suffix in (".py", ".json")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def setting(config: dict[str, Any], dotted: str) -> Any:
    section, key = dotted.split(".", 1)
    return config.get(section, {}).get(key)


def run_keys(config: dict[str, Any]) -> list[str]:
    """The ``section.key`` names that define a run, in a configuration's ``model_dump()``."""
    return [f"{section}.{key}" for section in RUN_SECTIONS for key in config.get(section, {})
            if f"{section}.{key}" not in MAY_CHANGE_ON_RESUME]


def run_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: checkpoint's value → current value`` for each key defining the run that differs."""
    return [f"{key}: {setting(saved, key)!r} in the checkpoint, {setting(current, key)!r} now"
            for key in run_keys(current) if setting(saved, key) != setting(current, key)]


def identity_differences(saved: dict[str, Any], identity: dict[str, str]) -> list[str]:
    """What of the data and code fingerprints differs (a checkpoint from before fingerprints differs in nothing)."""
    recorded = saved.get("identity") or {}
    return [what for what in ("data", "code") if what in recorded and recorded[what] != identity.get(what)]


def check_compatible(saved: dict[str, Any], current: dict[str, Any], identity: dict[str, str], where: str) -> None:
    """A checkpoint continues only its own run: the same keys defining it, and the same data."""
    differences = run_differences(saved["config"], current)
    if "data" in identity_differences(saved, identity):
        differences.append(f"train.shards: {setting(current, 'train.shards')!r} holds other data than the run's "
                           "(another shard list, or shards of other sizes)")
    if differences:
        raise ConfigError(f"checkpoint {where} is of another run: " + "; ".join(differences)
                          + ". Resume with its settings (`cloob train --output … --resume …` takes them from the "
                          "checkpoint), or start a new --output")
