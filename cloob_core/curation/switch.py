"""Curation in a pipeline: the model ``curation.scorer`` names, and ``curation.enabled``'s switch.

DVC cannot leave a stage out by a parameter, so the pipeline's ``scorer``, ``score`` and ``curate`` stages always
run, and training always reads the curate stage's output. While ``curation.enabled`` is false they do almost
nothing: the scorer's record says so, the scores folder holds only that record, and the curated folder is the pool
itself, its files hard-linked (copied across file systems), so training, its gate and its figures are the ones a
pipeline without curation gives, and DVC's cache holds each shard once (the same content, the same hash).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cloob_core import publish, storage
from cloob_core.config import CloobConfig, ConfigError
from cloob_core.io import write_json
from cloob_core.model.starting_weights import PRODUCTION, named_weights
from cloob_core.model.store import production_folder, read_pointer

if TYPE_CHECKING:
    from cloob_core.model.source import ModelSource

OFF_RECORD = "curation_off.json"


def scores_location(shards: str, fingerprint: str) -> str:
    """Where a pipeline keeps the scores of the pool ``shards`` by the model of weights ``fingerprint``: beside the
    pool, one folder per scoring model, so a grown pool's next run scores only its new shards, and a new scorer
    (a new production model) scores afresh without touching the old scores."""
    return f"{shards.rstrip('/')}.scores/{fingerprint}"


def curated_location(shards: str) -> str:
    """Where a pipeline curates the pool ``shards`` to: beside it, one unit that each run republishes whole."""
    return f"{shards.rstrip('/')}.curated"


@dataclass(frozen=True)
class ScorerRecord:
    """Which weights ``curation.scorer`` names now (all None while curation is off)."""

    scorer: str | None
    weights: str | None
    sha256: str | None


def curation_off(config: CloobConfig) -> str | None:
    """Why the pipeline's curation stages pass the pool through this run, or None where they curate: curation is
    off, or its scorer is ``production`` and the store has no production model yet. The first run of a new
    project then trains on the pool as it is and promotes; the next `dvc repro` (the scorer stage sees the new
    production model) scores and curates the pool with it and trains again."""
    curation = config.curation
    if not curation.enabled:
        return "curation.enabled is false"
    if curation.scorer == PRODUCTION:
        pointer, _ = read_pointer(config.promote.store)
        if pointer is None or not isinstance(pointer.get("model"), str):
            return (f"curation.scorer is production and {config.promote.store} has no production model yet: this "
                    "run trains on the pool as it is; once it is promoted, the next `dvc repro` curates with it")
    return None


def scorer_source(config: CloobConfig, device: str = "auto", precision: str = "auto") -> ModelSource:
    """``curation.scorer`` as a model to load; one line when it is not set."""
    from cloob_core.model.source import ModelSource  # here: the scorer stage, run by every `dvc repro`, loads no torch

    name = config.curation.scorer
    if name is None:
        raise ConfigError("no scoring model: give --model (or --checkpoint, or --architecture with --weights), or "
                          "set curation.scorer")
    if name == PRODUCTION:
        name = production_folder(config.promote.store)[0]
    return ModelSource(model=name, device=device, precision=precision)


def record_scorer(config: CloobConfig, output: str) -> ScorerRecord:
    """The ``scorer`` stage: write which weights ``curation.scorer`` names to ``output`` (the same bytes while they
    are the same). The score stage depends on this file, so a new production model or overwritten weights re-score
    the pool under an unchanged value; while curation is off (:func:`curation_off`, a first production model
    included) the record is empty and nothing re-runs."""
    curation = config.curation
    record = ScorerRecord(None, None, None)
    if curation_off(config) is None:
        if curation.scorer is None:
            raise ConfigError("curation.enabled: the pipeline scores the pool with curation.scorer, which is not set "
                              "(a model folder, production, or hf-hub:ORG/NAME)")
        record = ScorerRecord(curation.scorer, *named_weights(curation.scorer, config.promote.store,
                                                              setting="curation.scorer"))
    write_json(output, record.__dict__)
    return record


def record_off(output: str, why: str) -> str:
    """The score stage while curation is off (``why``: :func:`curation_off`): ``output`` holds only a record saying
    so."""
    with publish.staged(output) as staging:
        write_json(Path(staging) / OFF_RECORD, {"curation": "off", "why": why})
    return output


def pass_through(shards: str, output: str) -> int:
    """The curate stage while curation is off: ``output`` is the pool ``shards`` (a local folder) as it is, its
    files hard-linked; the number of files."""
    storage.check_apart(("--output", output), ("--shards", shards))
    source = Path(shards)
    if not (source / "sizes.json").is_file():
        raise ConfigError(f"--shards {shards}: not a local shard folder with sizes.json (the pipeline's pool)")
    names = [path.relative_to(source) for path in sorted(source.rglob("*")) if path.is_file()
             and not any(part.startswith(publish.BOOKKEEPING) for part in path.relative_to(source).parts)]
    with publish.staged(output) as staging:
        for name in names:
            target = Path(staging) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source / name, target)
            except OSError:  # another file system, or links refused
                shutil.copy2(source / name, target)
    return len(names)
