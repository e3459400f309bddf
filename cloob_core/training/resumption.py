"""Which checkpoint a run continues from, and with which configuration.

Every checkpoint holds its run's configuration and the fingerprints of its data and code (``identity``).

- ``--resume latest`` or a path continues that run: its configuration comes from the checkpoint
  (:func:`resumed_config`), so ``cloob train --output X --resume latest`` needs no other flag. The caller's keys are
  laid over it; one that defines the run (what is trained, how, on what, for how long:
  ``checkpoint.run_keys``) and differs from the checkpoint is refused by name. The keys of how and where it runs
  (workers, logging, checkpoint cadence, device, the shards' location) may change.
- ``--resume auto`` is for a caller that re-runs the same command after an interruption: DVC (whose stage keeps
  ``checkpoints/`` with ``persist``), a scheduler, a restarted pod. The caller's configuration is the run's. The
  newest checkpoint in OUTPUT/checkpoints (then ``train.checkpoint_sync``) is continued when it is of this run:
  the same keys defining it, the same data and the same code. Otherwise the run starts afresh, and the checkpoints
  of the other run are removed from OUTPUT/checkpoints (their retention would mix the two runs).

``latest`` and ``auto`` take the newest checkpoint that is whole: one whose bytes do not match its checksum, or
that does not read, is passed over with a warning for the one before it (then the mirror's). Both are what an
unattended caller runs (DVC, a retried pod, a multi-node job's restarted ranks), and losing the steps since the
checkpoint before costs less than a run that stops until someone resumes it by hand. None whole is the newest's
error. A checkpoint named by its path is that one or an error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from cloob_core import storage
from cloob_core.config import CloobConfig, ConfigError, ConfigLayers
from cloob_core.model.checkpoint_file import CheckpointError
from cloob_core.training import checkpoint

log = logging.getLogger(__name__)
RESUME_CHOICES = "latest, auto or a checkpoint's path"


def resolve_resume(resume: str | None, output: Path) -> str | None:
    """The checkpoint a run without ``latest`` or ``auto`` continues: the path given, or none. No ``resume`` and
    checkpoints in OUTPUT is refused: their retention would mix two runs."""
    if resume is None:
        earlier = checkpoint.latest(str(output / "checkpoints"))
        if earlier is not None:
            raise ConfigError(f"{output}/checkpoints holds checkpoints of an earlier run (newest {earlier}); pass "
                              "--resume latest to continue it, or choose another --output")
    return resume


def newest_whole(output: Path, mirror: str | None) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint in OUTPUT/checkpoints, then in the mirror, that matches its checksum and reads, with
    its contents; one that does not is passed over with a warning. None when there is no checkpoint; the newest's
    :class:`CheckpointError` when none is whole."""
    newest_error = None
    for location in filter(None, (str(output / "checkpoints"), mirror)):
        for name in reversed(checkpoint.complete(location)):
            path = storage.join(location, name)
            try:
                return path, checkpoint.load(path)
            except CheckpointError as err:
                newest_error = newest_error or err
                log.warning("--resume: %s; passing it over for the checkpoint before it", err)
    if newest_error is not None:
        raise newest_error
    return None


def resumed_config(layers: ConfigLayers, output: str | Path, resume: str | None) -> CloobConfig:
    """The run's configuration: with ``--resume latest`` or a path, the checkpoint's with the caller's keys laid
    over it, and a key defining the run that differs from the checkpoint refused by name; otherwise the caller's."""
    requested = layers.build()
    if resume in (None, "auto"):
        return requested
    if resume == "latest":
        found = newest_whole(Path(output), requested.train.checkpoint_sync)
        source, saved = (found[0], found[1]["config"]) if found else (None, None)
        if found is None:
            log.info("--resume latest: no checkpoint yet, starting from step 0")
    else:
        source = resume
        saved = checkpoint.load(source)["config"]
    if source is None:
        return requested
    config = layers.build(base=saved)
    current = config.model_dump()
    conflicts = [f"{key} {checkpoint.setting(current, key)!r} (the run has {checkpoint.setting(saved, key)!r})"
                 for key in sorted(layers.keys()) if key in checkpoint.run_keys(current)
                 and checkpoint.setting(current, key) != checkpoint.setting(saved, key)]
    if conflicts:
        raise ConfigError(f"--resume {resume} continues the run of {source}, whose configuration it takes; these "
                          f"settings would change that run: {'; '.join(conflicts)}. Leave them out, or start a new "
                          "--output")
    log.info("resuming with the configuration of %s", source)
    return config


def auto_resume(config: CloobConfig, output: Path, identity: dict[str, str],
                is_main: bool) -> tuple[str, dict[str, Any]] | None:
    """``--resume auto``: the checkpoint to continue from when it is of this run, with its contents (read once),
    else None (and, on the main rank, the other run's checkpoints removed from OUTPUT/checkpoints)."""
    newest = newest_whole(output, config.train.checkpoint_sync)
    if newest is None:
        log.info("--resume auto: no checkpoint yet, starting from step 0")
        return None
    found, saved = newest
    why = checkpoint.run_differences(saved["config"], config.model_dump())
    why += [f"its {what} changed" for what in checkpoint.identity_differences(saved, identity)]
    if not why:
        log.info("--resume auto: %s is of this run; continuing it", found)
        return found, saved
    log.warning("--resume auto: %s is of another run (%s); starting afresh", found, "; ".join(why))
    if is_main:
        folder = output / "checkpoints"
        for name in storage.list_names(folder):
            if name.startswith("step-"):
                storage.delete(storage.join(folder, name))
    return None
