"""``cloob experiment``: a grid of training runs on the pipeline's shards, each cell with several seeds, measured at
every checkpoint on the evaluation suite. It serves the paper's ablation of objectives (§4: CLIP, InfoLOOB,
InfoNCE with Hopfield, CLOOB; Fig. 2 and A1 follow the embeddings *during* learning) and the recipe sweep behind
the pipeline's defaults (``grids.py``).

Each run trains in ``OUTPUT/runs/CELL-sSEED`` and is measured at each checkpoint: zero-shot top-1 on the suite's
zero-shot sets, retrieval R@1/R@5 on its retrieval sets, and the diagnostics (effective eigenvalues and spectra,
Ajne uniformity, InfoNCE saturation p1) on its diagnostics sets. Its ``result.json`` is written last, and then its
checkpoints and model are deleted, so an interrupted grid resumes where it stopped and a finished one keeps its
results and training logs only.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cloob_core import lease, storage
from cloob_core.config import CloobConfig, ConfigError, config_from_mapping
from cloob_core.data.shard_files import shard_list
from cloob_core.evaluation.features import Encoding, image_features
from cloob_core.evaluation.inputs import ImageSet, load_images
from cloob_core.evaluation.kept import KeptInputs
from cloob_core.evaluation.tasks.diagnostics import embedding_diagnostics, matched_features
from cloob_core.evaluation.tasks.retrieval import caption_pairs, retrieval_metrics
from cloob_core.evaluation.tasks.zeroshot import class_embeddings, classification_metrics, ranked_classes
from cloob_core.evaluation.trajectory import run_checkpoints
from cloob_core.experiments.curation_benefit import curation_grid
from cloob_core.experiments.grid_report import GridReport, grid_report
from cloob_core.experiments.grids import Grid, grid_named
from cloob_core.io import write_json
from cloob_core.model.source import EvalModel, model_from_checkpoint
from cloob_core.training.loop import TrainingDiverged, plan_steps, train
from cloob_core.training.optim import first_restart

log = logging.getLogger(__name__)
RESULT_FILE = "result.json"
# the grids whose data and cells the experiment builds: (configuration, output) -> (base configuration, grid)
PREPARED: dict[str, Callable[[CloobConfig, Path], tuple[CloobConfig, Grid]]] = {"curation": curation_grid}


@dataclass(frozen=True)
class Measured:
    """The suite's image sets by role: what each checkpoint is measured on; each set is read once, and its
    decoded images are kept for the next checkpoint (within ``KeptInputs``' budget)."""

    zeroshot: dict[str, ImageSet]
    retrieval: dict[str, ImageSet]
    diagnostics: dict[str, ImageSet]
    encoding: Encoding = field(default_factory=lambda: Encoding(progress=False, kept=KeptInputs()))

    @classmethod
    def from_suite(cls, config: CloobConfig) -> Measured:
        sets: dict[str, dict[str, ImageSet]] = {"zeroshot": {}, "retrieval": {}, "diagnostics": {}}
        for name, entry in config.eval.datasets.items():
            tasks = set(entry.tasks) & set(sets)
            if tasks:
                images = load_images(entry.source, entry.splits.test, entry.label_key, entry.classnames)
                for task in tasks:
                    sets[task][name] = images
        if not any(sets.values()):
            raise ConfigError("the eval suite has no zeroshot, retrieval or diagnostics task to measure runs on")
        return cls(**sets)


@torch.no_grad()
def measure(model: EvalModel, sets: Measured) -> dict[str, Any]:
    """One model's figures, as ``<data set>.<metric>``; the diagnostics' spectra are lists. A set that is both
    retrieved and diagnosed is embedded once."""
    encoding = sets.encoding
    found: dict[str, Any] = {}
    for name, images in sets.zeroshot.items():
        embedded = image_features(model, images, encoding)
        classnames, templates = ranked_classes(images, embedded)
        scores = embedded.features @ class_embeddings(model, classnames, templates, encoding).T
        found[f"{name}.zeroshot_acc1"] = classification_metrics(scores, torch.tensor(embedded.labels),
                                                                len(classnames))["acc1"]
    pairs = {name: caption_pairs(model, images, encoding)
             for name, images in {**sets.retrieval, **sets.diagnostics}.items()}
    for name in sets.retrieval:
        found.update({f"{name}.{key}": value for key, value in retrieval_metrics(
            pairs[name].image, pairs[name].text, pairs[name].matches).items() if "recall@" in key})
    for name in sets.diagnostics:
        diagnosed = embedding_diagnostics(*matched_features(pairs[name]), model.inv_tau)
        found.update({f"{name}.{key}": value for key, value in diagnosed.metrics.items()})
    return found


def cell_config(base: CloobConfig, overrides: tuple[str, ...], seed: int, points: int) -> CloobConfig:
    """The base configuration under a cell's overrides and the seed, checkpointing about ``points`` times per run
    (each kept until measured), one checkpoint exactly at the first learning-rate restart."""
    config = config_from_mapping(base.model_dump(), [*overrides, f"train.seed={seed}"])
    steps = plan_steps(config, shard_list(config.train.shards)[1])
    restart = first_restart(config.optim, steps)
    if restart is None:
        every = max(1, math.ceil(steps / points))
    else:  # a whole number of checkpoints up to the restart
        every = max(1, restart // max(1, round(points * restart / steps)))
    return config_from_mapping(config.model_dump(), values={"train": {
        "checkpoint_every": every, "keep_checkpoints": math.ceil(steps / every) + 1, "tensorboard": False,
        "metrics_port": 0, "pushgateway": None}})


def reference_step(steps: list[int], restart: int | None) -> int:
    """The paper's reference point for Fig. 2: the checkpoint of the last epoch before the first learning-rate
    restart (``restart``); without restarts, the first checkpoint."""
    before_restart = [step for step in steps if restart is not None and step <= restart]
    return before_restart[-1] if before_restart else steps[0]


def _trained_by(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The settings that make a run what it is: all but when it checkpoints (the measured points)."""
    if config is None:
        return None
    train_section = {k: v for k, v in config["train"].items() if k not in ("checkpoint_every", "keep_checkpoints")}
    return {**config, "train": train_section}


def run_cell(base: CloobConfig, grid: Grid, cell: str, seed: int, folder: Path, sets: Measured,
             points: int) -> dict[str, Any]:
    """Train one cell with one seed and measure it at each checkpoint (or read its result, if done)."""
    overrides = grid.cells[cell]
    config = cell_config(base, overrides, seed, points)
    result_file = folder / RESULT_FILE
    if result_file.exists():
        done = storage.read_json(result_file)
        if _trained_by(done.get("config")) != _trained_by(config.model_dump()):
            raise ConfigError(f"{folder} holds a run of other settings (another grid, --quick or params); "
                              "choose another --output")
        return done
    run = folder / "train"
    described = {"grid": grid.name, "cell": cell, "seed": seed, "overrides": list(overrides),
                 "objective": config.train.objective, "config": config.model_dump()}
    try:
        trained = train(config, run, resume="latest", progress=False)
    except TrainingDiverged as err:  # a finding of a sweep, not the end of the grid
        log.warning("%s seed %d diverged: %s", cell, seed, err)
        write_json(result_file, {**described, "diverged": str(err), "trajectory": []})
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
        return storage.read_json(result_file)
    started = time.monotonic()
    checkpoints = run_checkpoints(str(run))
    trajectory = []
    for path in checkpoints:
        model, step = model_from_checkpoint(path)
        trajectory.append({"step": step, **measure(model, sets)})
    steps = [point["step"] for point in trajectory]
    result = {**described, "steps": trained.metrics["steps"],
              "train_seconds": trained.metrics["train_seconds"],
              "seconds_per_step": trained.metrics["train_seconds"] / max(1, trained.metrics["steps"]),
              "final_loss": trained.metrics["final_loss"], "measure_seconds": time.monotonic() - started,
              "reference_step": reference_step(steps, first_restart(config.optim, trained.metrics["steps"])),
              "trajectory": trajectory}
    write_json(result_file, result)
    for measured in ("checkpoints", "model"):  # 75 MB a checkpoint at the CPU scale; the run's logs stay
        shutil.rmtree(run / measured, ignore_errors=True)
    return result


@dataclass(frozen=True)
class GridResult:
    output: Path
    results: list[dict[str, Any]]


def run_grid(base: CloobConfig, grid: Grid, output: str | Path, *, seeds: int,
             points: int = 8, on_result: Callable[[dict[str, Any]], None] | None = None) -> GridResult:
    """Every cell of ``grid`` with seeds ``0 .. seeds-1``, into ``output/runs``; finished runs are kept."""
    if seeds < 1 or points < 2:
        raise ConfigError(f"a grid needs at least 1 seed and 2 measured points per run (got {seeds}, {points})")
    output = Path(output)
    sets = Measured.from_suite(base)
    results = []
    for seed in range(seeds):  # seed-major: after the first pass every cell has one run
        for cell in grid.cells:
            result = run_cell(base, grid, cell, seed, output / "runs" / f"{cell}-s{seed}", sets, points)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return GridResult(output, results)


@dataclass(frozen=True)
class ExperimentResult:
    grid: GridResult
    report: GridReport


@lease.holding("output")
def experiment(config: CloobConfig, grid_name: str, output: str | Path, *, seeds: int, points: int = 8,
               quick: bool = False,
               on_result: Callable[[dict[str, Any]], None] | None = None) -> ExperimentResult:
    """`cloob experiment`: run the named grid on ``config.train.shards`` (``quick``: the grid's short smoke-test
    settings over ``config``) and write its table and figures into ``output``."""
    grid = grid_named(grid_name)
    if quick:
        config = config_from_mapping(config.model_dump(), grid.quick)
    data = f"{config.train.shards} (train.shards), measured on the eval suite's held-out splits"
    if grid.prepared:
        config, grid = PREPARED[grid.name](config, Path(output))
        data = f"the training sets it built in {Path(output) / 'data'}, measured on the eval suite's held-out splits"
    ran = run_grid(config, grid, output, seeds=seeds, points=points, on_result=on_result)
    return ExperimentResult(ran, grid_report(ran.results, output, data))
