"""``cloob train``: WebDataset shards in, an open_clip-loadable model out, resumable to the exact step.

The step itself holds no host synchronisation: the loss is accumulated on the device and read once per
``log_every`` steps; images go to the device pinned, non-blocking and channels-last on GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import sys
import tarfile
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from cloob_core import lease, storage
from cloob_core.config import CloobConfig, ConfigError, ShardSource, TrainConfig, config_from_mapping
from cloob_core.data import caption_fit
from cloob_core.data.shard_files import missing_shards, shard_list, shards_fingerprint
from cloob_core.devices import choose_device, resolve_precision
from cloob_core.errors import StageError
from cloob_core.io import write_json, write_text
from cloob_core.memory_limit import naming_killed_workers
from cloob_core.model.dual_encoder import build_model, build_tokenizer, lock_towers
from cloob_core.model.export import export_model
from cloob_core.model.starting_weights import load_starting_weights
from cloob_core.objectives.distributed import gather_features
from cloob_core.objectives.registry import objective_from_config
from cloob_core.objectives.start import start_of
from cloob_core.plots import training_curves_png
from cloob_core.publish import publish_copy
from cloob_core.pushgateway import run_label
from cloob_core.threads import core_share, plan_threads
from cloob_core.training import checkpoint
from cloob_core.training.batch_ring import BatchRing
from cloob_core.training.checkpoint import Trainables, TrainingState
from cloob_core.training.collapse import (
    HISTORY_COLUMNS,
    CollapseRule,
    Health,
    TrainingCollapsed,
    embedding_health,
    health_history,
    history_row,
)
from cloob_core.training.env import DistEnv, across_ranks, detect, init_process_group
from cloob_core.training.evaluator import Evaluator
from cloob_core.training.images import Normalize, TrainImages
from cloob_core.training.monitor import Monitor, Snapshot
from cloob_core.training.optim import build_optimizer, build_scheduler, plan_schedule
from cloob_core.training.resumption import auto_resume, newest_whole, resolve_resume
from cloob_core.training.shape import run_shape
from cloob_core.training.step import (
    StepOutput,
    StepParts,
    accumulate_gradients,
    optimizer_step,
    use_fast_kernels,
)
from cloob_core.training.streams import (
    Assembler,
    Batch,
    Chunk,
    Mix,
    StreamChunks,
    StreamSettings,
    StreamStart,
    UnreadableData,
    mixed_streams,
    rank_streams,
    stream_shards,
)
from cloob_core.training.worker_gate import PrefetchTuner, WorkerGate

log = logging.getLogger(__name__)
PREFETCH_STEPS = 4  # the steps each data-loader worker may prepare ahead (its DataLoader prefetch factor)
RING_SLOTS = PREFETCH_STEPS + 2  # so the ring never holds the workers back: the batch held, and one being assembled


class TrainingDiverged(StageError):
    """The loss or the parameters stopped being finite; nothing after the last good checkpoint is kept."""


class TrainingInterrupted(StageError):
    """SIGTERM or SIGINT arrived: the run stopped at a step boundary; ``--resume latest`` continues it."""

    exit_code = 130


@dataclass
class TrainResult:
    output: Path
    metrics: dict[str, Any]
    model: Any  # the trained CLOOBModel (on the training device)
    is_main: bool = True
    published: list[str] = field(default_factory=list)  # files copied to ``publish`` (rank 0)


def plan_steps(config: CloobConfig, total_samples: int | None) -> int:
    train = config.train
    if train.steps:
        return train.steps
    if total_samples is None:
        raise ConfigError("the shards have no sizes.json to count samples; set train.steps")
    steps = math.floor(train.epochs * total_samples / train.batch_size)
    if steps < 1:
        raise ConfigError(f"{train.epochs} epoch(s) of {total_samples} samples is less than one batch of "
                          f"{train.batch_size}")
    return steps


@dataclass(frozen=True, kw_only=True)
class _Setup:
    """One rank's training objects, built once."""

    config: CloobConfig  # the run's configuration with its shape resolved (data streams, workers)
    env: DistEnv
    mirror: checkpoint.Mirror | None  # rank 0's uploads to train.checkpoint_sync
    device: torch.device
    steps: int
    parts: Trainables
    step_parts: StepParts  # what forward and backward run through (the DDP / compiled wrapper)
    images: TrainImages
    normalize: Normalize
    tokenizer: Any
    identity: dict[str, str]  # the data's and the code's fingerprints, saved in each checkpoint


def _build(config: CloobConfig, steps: int, shards: int, identity: dict[str, str], fresh: bool) -> _Setup:
    env = detect()
    device = choose_device(config.train.device, local_rank=env.local_rank)
    shape = run_shape(config.train, device_type=device.type, ranks=env.world_size, cores_per_rank=core_share(),
                      shards=shards)
    config = config_from_mapping(config.model_dump(), values={"train": {"data_streams": shape.streams,
                                                                        "workers": shape.workers}})
    cfg = config.train  # (its shape was checked in _train; auto counts are valid by construction)
    plan_threads(cfg.threads, workers=cfg.workers, device_type=device.type).apply()
    init_process_group(env, device)
    use_fast_kernels(device)
    precision = resolve_precision(cfg.precision, device)
    random.seed(cfg.seed)  # nothing of ours draws from Python's or numpy's global generators, but a checkpoint
    np.random.seed(cfg.seed)  # stores them: seeded, two runs write the same checkpoint bytes
    torch.manual_seed(cfg.seed)
    model = build_model(config.model).to(device, memory_format=torch.channels_last)  # CPU too: +18% (performance.md)
    if fresh and cfg.init_from:  # a resumed run's weights come from its checkpoint
        digest = load_starting_weights(model, cfg.init_from, config.promote.store)
        identity["init_from"] = f"{cfg.init_from} (sha256 {digest})"
        if env.is_main:
            log.info("starting from the weights of %s (sha256 %s)", cfg.init_from, digest[:16])
    lock_towers(model, cfg)  # before the optimiser: a locked tower's parameters are not among its groups
    if cfg.grad_checkpointing:
        model.encoder.set_grad_checkpointing(True)
    schedule = plan_schedule(config.optim, steps)
    objective = objective_from_config(config, warmup_steps=schedule.warmup).to(device)
    optimizer = build_optimizer(model, config.optim, objective)
    if schedule.problem and env.is_main:
        log.warning("%s", schedule.problem)
    if env.is_main:
        log.info("schedule: %s", schedule.describe(config.optim.lr))
        start = start_of(objective)
        if start is not None and not start.retrieving:
            log.info("%s: without Hopfield retrieval for %d step(s)%s (objective.start_without_hopfield, "
                     "start_until_margin, start_limit_factor)", objective.name, start.least,
                     f", then until a batch is {start.until_margin:.1%} below the collapsed value, {start.most} steps "
                     "at most" if start.until_margin and start.most > start.least else "")
    parts = Trainables(model=model, optimizer=optimizer, scheduler=build_scheduler(optimizer, schedule),
                       scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
                       objective=objective)
    forward_model = across_ranks(model, env, device, sync_batchnorm=cfg.sync_batchnorm,
                                 grad_compression=cfg.grad_compression)
    if cfg.compile:
        forward_model = torch.compile(forward_model)
    step_parts = StepParts(model=forward_model, objective=parts.objective, optimizer=optimizer, scaler=parts.scaler,
                           device_type=device.type, precision=precision, accum_freq=cfg.accum_freq,
                           grad_clip_norm=cfg.grad_clip_norm)
    mirror = checkpoint.Mirror(cfg.checkpoint_sync, cfg.keep_checkpoints) if cfg.checkpoint_sync and env.is_main \
        else None
    return _Setup(config=config, env=env, mirror=mirror, device=device, steps=steps, parts=parts, step_parts=step_parts,
                  images=TrainImages(model.image_size, augment=cfg.augment),
                  normalize=Normalize.of(model.encoder.visual), tokenizer=build_tokenizer(config.model.architecture),
                  identity=identity)


def _log_start(setup: _Setup, step: int, logging_step: bool) -> None:
    """The step a Hopfield objective's retrieval began at, and why; while it has not, each log window's margin."""
    start = start_of(setup.parts.objective)
    if start is None or not setup.env.is_main:
        return
    if start.retrieving_from == step:
        log.info("%s: Hopfield retrieval from step %d: %s", setup.parts.objective.name, step, start.reason)
    elif logging_step and not start.retrieving and start.last_margin is not None:
        margin = start.last_margin
        log.info("%s: without retrieval at step %d: a batch %.1f%% %s the collapsed value (retrieval from %.1f%% "
                 "below)", setup.parts.objective.name, step, 100 * abs(margin), "below" if margin >= 0 else "above",
                 100 * start.until_margin)


def _training_data(cfg: TrainConfig) -> tuple[list[tuple[str, list[str], float]], int | None]:
    """(location, shard URLs, weight) of each source (``train.sources``, or ``train.shards`` alone), each checked
    for shards and completeness, and the samples of them all (None when a source has no sizes.json)."""
    given = cfg.sources or [ShardSource(shards=cfg.shards)]
    found, total = [], 0
    for index, source in enumerate(given):
        where = f"train.sources[{index}] {source.shards}" if cfg.sources else f"train.shards {source.shards}"
        try:
            urls, samples = shard_list(source.shards)
        except FileNotFoundError as err:
            if not cfg.sources:
                raise
            raise ConfigError(f"{where}: {err}") from None
        if samples == 0:
            raise ConfigError(f"{where} holds no samples")
        if not cfg.allow_incomplete_shards and (missing := missing_shards(source.shards)):
            raise ConfigError(f"{where} is incomplete: {missing} (partitions still downloading, or a download to "
                              "resume); finish it and run `cloob data merge-stats`, or set "
                              "train.allow_incomplete_shards: true to train on what is there")
        found.append((source.shards, urls, source.weight))
        total = None if samples is None or total is None else total + samples
    return found, total


def _log_shares(mix: Mix, sources: list[tuple[str, list[str], float]], streams: int) -> None:
    """The realised share of each source, and a warning where whole streams cannot come near the weights."""
    weights = sum(weight for _, _, weight in sources)
    log.info("train.sources: %s of every batch (of %d data streams)", ", ".join(
        f"{name} {share:.1%}" for name, share in mix.shares.items()), streams)
    worst = max(abs(mix.shares[name] - weight / weights) for name, _, weight in sources)
    if worst > 0.02:
        log.warning("train.sources: whole data streams give shares up to %.1f points from the weights; more "
                    "train.data_streams come nearer", 100 * worst)


def _caption_fit(config: CloobConfig, urls: list[str], env: DistEnv) -> caption_fit.CaptionFit | None:
    """How the shards' captions fit the model's context, measured by rank 0 alone (a sample read from up to 8
    shards: once per job, not once per rank) and its verdict sent to every rank, so all refuse together."""
    if not config.validation.caption_sample:
        return None
    outcome: list[caption_fit.CaptionFit | str | None] = [None]
    if env.is_main:
        try:
            outcome = [caption_fit.check(caption_fit.shard_captions(urls, config.validation.caption_sample), config)]
        except caption_fit.CaptionsDoNotFit as err:
            outcome = [str(err)]
        except (OSError, tarfile.TarError) as err:  # the ranks waiting below must hear of it too
            outcome = [f"the captions of {urls[0]}… could not be read to check them: {err}"]
    if env.distributed:
        dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], str):
        raise caption_fit.CaptionsDoNotFit(outcome[0])
    return outcome[0]


def _resume(config: CloobConfig, output: Path, source: str | None, saved: dict[str, Any] | None, parts: Trainables,
            steps: int, identity: dict[str, str]) -> TrainingState:
    """The state at ``source`` (``saved``: its contents, when already read), or a fresh one."""
    if source is None:
        return TrainingState()
    saved = saved if saved is not None else checkpoint.load(source)
    state = TrainingState.restore(saved, parts, config.model_dump(), identity, source)
    if "init_from" in (saved.get("identity") or {}):  # where the run's weights started, for its model_info
        identity["init_from"] = saved["identity"]["init_from"]
    log.info("resuming from %s at step %d of %d", source, state.step, steps)
    return state


def _batches(config: CloobConfig, setup: _Setup, per_stream: list[list[str]],
             state: TrainingState) -> Generator[Batch, None, None]:
    cfg = config.train
    owned = rank_streams(cfg.data_streams, setup.env.rank, setup.env.world_size)
    gate = _gate(cfg, setup.device)
    settings = StreamSettings.from_config(cfg)
    ring = BatchRing.for_run(RING_SLOTS, len(owned), settings.chunk_size, cfg.image_views, cfg.text_views,
                             setup.images.size, setup.tokenizer, state.step)
    dataset = StreamChunks(per_stream, settings, StreamStart(owned, state.step, state.positions), setup.images,
                           setup.tokenizer, ring, gate)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=cfg.workers,
                                         prefetch_factor=PREFETCH_STEPS if cfg.workers else None,
                                         timeout=cfg.data_timeout_s if cfg.workers else 0,
                                         worker_init_fn=_background if setup.device.type == "cuda"
                                         else _signals_to_the_main_process)
    loading = iter(loader)  # workers fork here, before any thread
    items = _bounded(loading, cfg.data_timeout_s)
    ring.pin(setup.device)  # after the fork (batch_ring.py)
    batches = _ring_closed_at_end(Assembler(owned, ring).batches(items), ring)
    return _Feed(batches if gate is None else gate.batches(batches), ring, gate, loading)


@dataclass
class _Feed:
    """The run's batches; :meth:`close` stops the data-loader workers whether or not a batch was asked for (the
    generators' own cleanup runs only once they started: a resume that failed before the first step left forked
    workers waiting at the ring, and the process hung at exit)."""

    batches: Generator[Batch, None, None]
    ring: BatchRing
    gate: WorkerGate | None
    loading: Any  # the DataLoader's iterator

    def __iter__(self) -> _Feed:
        return self

    def __next__(self) -> Batch:
        return next(self.batches)

    def close(self) -> None:
        self.batches.close()
        self.ring.close()  # (all three: idempotent)
        if self.gate is not None:
            self.gate.close()
        shutdown = getattr(self.loading, "_shutdown_workers", None)  # a multi-process loader's
        if shutdown is not None:
            shutdown()
        self.ring.unpin()


def _ring_closed_at_end(batches: Generator[Batch, None, None], ring: BatchRing) -> Generator[Batch, None, None]:
    """``batches``; at their end the ring lets waiting workers go before the loader ends them (else it waits for
    each in turn) and is unpinned."""
    try:
        for batch in batches:  # not ``yield from``: that would close ``batches`` before the ring  # noqa: UP028
            yield batch
    finally:
        ring.close()
        batches.close()
        ring.unpin()


def _gate(cfg: TrainConfig, device: torch.device) -> WorkerGate | None:
    """``train.prefetch``: ``auto`` tunes the gate on the CPU and leaves a GPU's workers free (worker_gate.py)."""
    if not cfg.workers or cfg.prefetch == "during_step" or (cfg.prefetch == "auto" and device.type != "cpu"):
        return None
    return WorkerGate(cfg.workers, PrefetchTuner() if cfg.prefetch == "auto" else None)


def _signals_to_the_main_process(_worker_id: int) -> None:
    """SIGTERM and SIGINT sent to the whole process group (a container runtime, ``timeout``, a shell's Ctrl-C) must
    not kill the data-loader workers before the main process can stop at a step and save: it ends them itself
    (and a worker whose main process died exits on its own)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


WORKER_NICENESS = 10  # on a GPU, below the main process: it must launch the step's kernels the moment they are due


def _background(worker_id: int) -> None:
    """A GPU run's data-loader worker: as :func:`_signals_to_the_main_process`, at a lower priority. With a
    worker per core the main process otherwise waits for a core to launch the step's kernels and assemble the
    batch, and the GPU idles (measured on an H200 with 16 cores: 2,433 samples/s against 3,892 for the step
    alone; docs/performance.md, "Feeding a GPU")."""
    _signals_to_the_main_process(worker_id)
    os.nice(WORKER_NICENESS)


def _bounded(items: Iterator[list[Chunk]], seconds: float) -> Iterator[list[Chunk]]:
    """The loader's own time-out as a stage error: a stuck read or decoder in a worker."""
    try:
        yield from items
    except RuntimeError as err:
        if "timed out" not in str(err):
            raise
        raise UnreadableData(f"no data from the data-loader workers within {seconds:g} s: a read or a decoder "
                             "is stuck (raise train.data_timeout_s if the storage is that slow)") from None


@dataclass
class _Window:
    """What happened since the last log line: summed on the device, read once when the window closes."""

    device: torch.device
    loss: torch.Tensor = field(init=False)
    steps: int = 0
    errors: int = 0
    data_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.loss = torch.zeros((), device=self.device)

    def close(self, *, step: int, total: int, batch_size: int, lr: float, inv_tau: float,
              grad_norm: torch.Tensor | None, collapsed_loss: float, measured: torch.Tensor) -> Snapshot:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        loss = float(self.loss) / self.steps
        return Snapshot(step=step, total_steps=total, loss=loss, lr=lr, inv_tau=inv_tau,
                        samples_per_second=self.steps * batch_size / elapsed,
                        data_seconds=self.data_seconds / self.steps,
                        grad_norm=None if grad_norm is None else float(grad_norm), samples=step * batch_size,
                        data_errors=self.errors, health=Health.of(loss, collapsed_loss, measured))


def _measure_health(setup: _Setup, stepped: StepOutput) -> torch.Tensor:
    """The step's embeddings of the whole global batch measured (collapse.py): each rank's gathered, so every rank
    reads the same figures and reaches the same verdict."""
    image_features, text_features = stepped.image_features, stepped.text_features
    if setup.env.distributed:
        with torch.no_grad():
            image_features, text_features = gather_features(image_features, text_features)
    return embedding_health(image_features, text_features)


def _check_finite(setup: _Setup, state: TrainingState, window: _Window, output: Path, monitor: Monitor) -> None:
    """Before anything is saved: the window's loss and every parameter must be finite (one host sync). A run that
    diverged says so to its monitoring first (the loss gauge, ``cloob_train_diverged``, a push), so the alert
    fires although the process ends right after."""
    finite = torch.stack([window.loss.isfinite(),
                          *(p.isfinite().all() for p in setup.parts.model.parameters())]).all()
    if not bool(finite):
        monitor.diverged(state.step, float(window.loss) / max(window.steps, 1))
        kept = checkpoint.latest(str(output / "checkpoints"))
        raise TrainingDiverged(
            f"training diverged by step {state.step}: the loss or the parameters are no longer finite (window "
            f"loss {float(window.loss) / max(window.steps, 1):.4g}); nothing of it was saved, the last good "
            f"checkpoint is {kept or 'none'}; lower optim.lr or set train.grad_clip_norm")


def _save_checkpoint(config: CloobConfig, setup: _Setup, output: Path, state: TrainingState) -> None:
    positions = state.positions
    if setup.env.distributed:  # each rank moves only its own streams (the others' it holds are where they resumed)
        owned = rank_streams(config.train.data_streams, setup.env.rank, setup.env.world_size)
        gathered: list[dict] = [{} for _ in range(setup.env.world_size)]
        dist.all_gather_object(gathered, {v: positions[v] for v in owned if v in positions})
        positions = {v: p for part in gathered for v, p in part.items()}
    if setup.env.is_main:
        whole = TrainingState(step=state.step, positions=positions, history=state.history,
                              open_window=state.open_window)
        path = checkpoint.save(whole.checkpoint(setup.parts, config.model_dump(), setup.env.world_size, setup.identity),
                               output / "checkpoints", state.step, config.train.keep_checkpoints)
        log.info("checkpoint %s", path)
        if setup.mirror is not None:
            setup.mirror.submit(path)
    if setup.env.distributed:
        dist.barrier()


def _run_steps(config: CloobConfig, setup: _Setup, batches: Iterator[Batch], state: TrainingState,
               monitor: Monitor, output: Path, stop: _StopSignal, evaluator: Evaluator) -> float:
    """Train from ``state.step`` to the end, checkpointing on the way; the last logged loss."""
    cfg, parts, device = config.train, setup.parts, setup.device
    window = _Window(device)
    window.loss += state.open_window[0]  # a window the checkpoint cut: float32 values, so the sum goes on exactly
    window.steps = state.open_window[1]
    last_loss = state.history[-1][1] if state.history else float("nan")  # a run resumed at its end trains no step
    rule = _collapse_rule(config, setup)
    parts.model.train()
    for step in range(state.step, setup.steps):
        if stop.signal is not None:
            state.open_window = _open(window)
            _stop(config, setup, output, state, stop.signal)
        fetch_start = time.perf_counter()
        batch = next(batches)
        window.data_seconds += time.perf_counter() - fetch_start
        if batch.step != step:
            raise RuntimeError(f"data stream out of step: expected batch {step}, got {batch.step}")
        images, tokens = batch.to(device)
        images = setup.normalize(images).contiguous(memory_format=torch.channels_last)
        parts.scheduler.step_update(step)
        stepped = accumulate_gradients(setup.step_parts, images, tokens)
        logging_step = (step + 1) % cfg.log_every == 0 or step + 1 == setup.steps
        measured = _measure_health(setup, stepped) if logging_step else None
        grad_norm = optimizer_step(setup.step_parts, measure_norm=logging_step and setup.env.is_main)
        parts.objective.end_step()  # band schedules and queues advance once per optimiser step
        parts.model.clamp_inv_tau_()
        state.step = step + 1
        _log_start(setup, state.step, logging_step)
        state.positions.update(batch.positions)
        window.loss += stepped.loss.float()
        window.steps += 1
        window.errors += batch.skipped
        monitor.advance()
        if state.step % cfg.checkpoint_every == 0 or state.step == setup.steps:
            _check_finite(setup, state, window, output, monitor)
        if logging_step:
            lr = parts.optimizer.param_groups[0]["lr"]
            inv_tau = float(parts.model.inv_tau.detach())
            snapshot = window.close(step=state.step, total=setup.steps, batch_size=cfg.batch_size, lr=lr,
                                    inv_tau=inv_tau, grad_norm=grad_norm, measured=measured,
                                    collapsed_loss=parts.objective.collapsed_loss(cfg.batch_size, inv_tau))
            last_loss = snapshot.loss  # the one host sync, once per window
            if not math.isfinite(last_loss):
                _check_finite(setup, state, window, output, monitor)
            state.history.append(history_row(state.step, last_loss, lr, snapshot.health))
            monitor.update(snapshot, window.steps, window.steps * cfg.batch_size, window.errors)
            window = _Window(device)
            # the verdict reads the last windows only: a long run's whole history is not rebuilt every window
            collapse = _agreed(setup, rule.verdict(health_history(state.history[-(rule.windows + 1):])))
            if collapse is not None:
                _collapsed(config, setup, output, state, monitor, collapse)
        if state.step % cfg.checkpoint_every == 0 or state.step == setup.steps:
            state.open_window = _open(window)
            _save_checkpoint(config, setup, output, state)
            monitor.checkpointed()
            if evaluator.due(state.step):
                evaluator.submit(parts.model, state.step)
        evaluator.poll(monitor)
    return last_loss


def _collapse_rule(config: CloobConfig, setup: _Setup) -> CollapseRule:
    """The detector for this run: the global batch's rows of the tower with fewer views, the embedding's width."""
    cfg = config.train
    return CollapseRule(cfg.collapse_windows, batch=cfg.batch_size * min(cfg.image_views, cfg.text_views),
                        width=setup.parts.model.encoder.text_projection.shape[1])


def _resumed_after_collapse(config: CloobConfig, setup: _Setup, state: TrainingState, source: str | None) -> None:
    """A resumed run whose history already collapsed: with ``train.on_collapse: stop`` it stops again before any
    step (a retried pod, ``dvc repro`` or ``--resume`` must not turn the stop into a finished model); with
    ``warn`` it says so and trains on."""
    collapsed_at = _collapse_rule(config, setup).first_collapse(health_history(state.history))
    if collapsed_at is None:
        return
    if config.train.on_collapse == "stop":
        raise TrainingCollapsed(
            f"the run resumed from {source} collapsed at step {collapsed_at} and train.on_collapse: stop ended it; "
            "resuming would train a collapsed model on: give --set train.on_collapse=warn to train on anyway, or "
            "start a new --output with a changed recipe")
    if setup.env.is_main:
        log.warning("the run resumed from %s collapsed at step %d (train.on_collapse: warn): training on",
                    source, collapsed_at)


def _agreed(setup: _Setup, verdict: str | None) -> str | None:
    """Rank 0's verdict on every rank: the figures are the whole batch's on each, but with train.local_loss each
    rank's loss is its own rows', and ranks that disagreed would wait for each other in the checkpoint."""
    if not setup.env.distributed:
        return verdict
    agreed = [verdict]
    dist.broadcast_object_list(agreed, src=0)
    return agreed[0]


def _collapsed(config: CloobConfig, setup: _Setup, output: Path, state: TrainingState, monitor: Monitor,
               line: str) -> None:
    """The collapse line, once; with ``train.on_collapse: stop`` the run is checkpointed where it stands and ends
    (exit 2): continuing it cannot help, and the checkpoint lets a changed recipe start from it or inspect it."""
    monitor.collapsed()
    if config.train.on_collapse == "warn":
        if setup.env.is_main:
            log.warning("%s", line)
        return
    state.open_window = (0.0, 0)  # the window just closed
    if not (checkpoint.latest(str(output / "checkpoints")) or "").endswith(checkpoint.checkpoint_name(state.step)):
        _save_checkpoint(config, setup, output, state)
    kept = checkpoint.latest(str(output / "checkpoints"))
    raise TrainingCollapsed(f"stopped at step {state.step} (train.on_collapse: stop; checkpoint {kept}): {line}")


def _open(window: _Window) -> tuple[float, int]:
    """The window's loss sum and steps, as a checkpoint keeps them (a host sync only when it has steps)."""
    return (float(window.loss), window.steps) if window.steps else (0.0, 0)


class _StopSignal:
    """SIGTERM (Kubernetes stopping the pod) and SIGINT are noted, and the loop stops at the next step boundary."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, _frame: Any) -> None:
        self.signal = signal.Signals(signum).name

    def __exit__(self, *_: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _stop(config: CloobConfig, setup: _Setup, output: Path, state: TrainingState, received: str) -> None:
    """A single process saves where it stands; ranks of a job keep their last periodic checkpoint (they may stop
    at different steps, so no collective save is safe)."""
    kept = checkpoint.latest(str(output / "checkpoints"))
    if not setup.env.distributed and state.step and not (kept or "").endswith(checkpoint.checkpoint_name(state.step)):
        _save_checkpoint(config, setup, output, state)
        kept = checkpoint.latest(str(output / "checkpoints"))
    raise TrainingInterrupted(f"received {received} at step {state.step}: the last checkpoint is {kept or 'none'}; "
                              "re-run with --resume latest to continue (a DVC stage: dvc repro continues it)")


def train(config: CloobConfig, output: str | Path, *, resume: str | None = None, progress: bool = True,
          publish: str | None = None) -> TrainResult:
    """Train to ``config.train``'s length; ``resume``: 'latest', 'auto' or a checkpoint
    (:mod:`cloob_core.training.resumption`). With ``publish`` (a folder or
    s3:// prefix), rank 0 copies the outputs but checkpoints/ there: how the pods of a multi-node job hand their
    result back. Rank 0, the one that writes ``output``, holds its lease (:mod:`cloob_core.lease`)."""
    with lease.writing(output) if detect().is_main else contextlib.nullcontext():
        return _train(config, Path(output), resume, progress, publish)


def _train(config: CloobConfig, output: Path, resume: str | None, progress: bool, publish: str | None) -> TrainResult:
    cfg = config.train
    cfg.check_shape(detect().world_size)  # before the model is built and the process group starts
    storage.ensure_folder(output)
    sources, total_samples = _training_data(cfg)
    urls = [url for _, source_urls, _ in sources for url in source_urls]
    identity = {"data": shards_fingerprint(urls), "code": checkpoint.code_fingerprint()}
    # decided before any collective, alike on every rank
    if resume == "auto":
        source, saved = auto_resume(config, output, identity, detect().is_main) or (None, None)
    elif resume == "latest":
        source, saved = newest_whole(output, cfg.checkpoint_sync) or (None, None)
    else:
        source, saved = resolve_resume(resume, output), None
    setup = _build(config, plan_steps(config, total_samples), len(urls), identity, fresh=source is None)
    config, cfg, env = setup.config, setup.config.train, setup.env
    mix = mixed_streams(sources, cfg.data_streams) if cfg.sources else Mix(stream_shards(urls, cfg.data_streams), {})
    if mix.shares and env.is_main:
        _log_shares(mix, sources, cfg.data_streams)
    fit = _caption_fit(config, urls, env)
    state = _resume(config, output, source, saved, setup.parts, setup.steps, identity)
    del saved  # restored: its tensors are not held for the run
    start_step = state.step
    if start_step:
        _resumed_after_collapse(config, setup, state, source)
    # A run resumed at its end trains no step: no data-loader workers (held by their gate, they would wait forever)
    batches = _batches(config, setup, mix.per_stream, state) if state.step < setup.steps else (b for b in ())
    def killed_line(killed: str) -> str:
        kept = checkpoint.latest(str(output / "checkpoints"))
        return (f"{killed}: lower train.workers (--workers; here {cfg.workers}) or train.batch_size; "
                + (f"--resume latest continues from {kept}" if kept else "no checkpoint yet"))

    try:
        with naming_killed_workers(killed_line):
            return _train_with(config, setup, output, batches, state, _Inputs(mix, fit, start_step), progress,
                               publish)
    finally:
        batches.close()  # the data-loader workers end on every way out, a failure before the first step included


@dataclass(frozen=True)
class _Inputs:
    """What the run read before its first step, for its metrics: the sources' mix, the captions' fit, and the
    step it starts at."""

    mix: Mix
    fit: caption_fit.CaptionFit | None
    start_step: int


def _train_with(config: CloobConfig, setup: _Setup, output: Path, batches: Iterator[Batch], state: TrainingState,
                inputs: _Inputs, progress: bool, publish: str | None) -> TrainResult:
    cfg, env = config.train, setup.env
    mix, fit, start_step = inputs.mix, inputs.fit, inputs.start_step
    monitor = Monitor(enabled=env.is_main, total_steps=setup.steps, start_step=start_step, output=output,
                      progress=progress, tensorboard=cfg.tensorboard, metrics_port=cfg.metrics_port,
                      metrics_host=cfg.metrics_host, pushgateway=cfg.pushgateway, linger_s=cfg.metrics_linger_s,
                      run=run_label(cfg.checkpoint_sync or str(output.resolve()))).start()
    if env.is_main:
        log.info("training %s with %s: %d steps of %d pairs (%d rank(s), %s, %d data streams) from %s",
                 config.model.architecture, setup.parts.objective.name, setup.steps, cfg.batch_size,
                 env.world_size, setup.device, cfg.data_streams, cfg.shards)
    evaluator = Evaluator(config, output, enabled=env.is_main and cfg.eval_every > 0, device=str(setup.device))
    if start_step:
        evaluator.resume(setup.parts.model, start_step)  # the history so far, and what a kill left unevaluated
    started = time.perf_counter()
    try:
        with _StopSignal() as stop:
            last_loss = _run_steps(config, setup, batches, state, monitor, output, stop, evaluator)
        evaluator.finish(monitor)  # the last evaluation's scalars belong to this run
    except BaseException:
        evaluator.stop()
        if setup.mirror is not None:  # the uploads begun go on to their end; the run's own error is the one raised
            setup.mirror.finish(raise_failure=False)
        raise
    finally:
        batches.close()  # ends the data-loader workers now, whatever stopped the loop
        # a stopped run (SIGTERM: a pod's grace period is short) keeps nothing up: its series are to end now
        stopped = isinstance(sys.exc_info()[1], (TrainingInterrupted, KeyboardInterrupt))
        monitor.close(ended=state.step >= setup.steps, linger=not stopped)
    seconds = time.perf_counter() - started
    windows = health_history(state.history)
    last_health = windows[-1][1] if windows else None
    metrics = {
        "objective": setup.parts.objective.name,
        "architecture": config.model.architecture,
        "steps": setup.steps,
        "resumed_from_step": start_step,
        "batch_size": cfg.batch_size,
        "world_size": env.world_size,
        "samples_seen": setup.steps * cfg.batch_size,
        "final_loss": last_loss,
        **(last_health.as_dict() if last_health is not None else {}),
        "collapse_detected_at_step": _collapse_rule(config, setup).first_collapse(windows),
        **({"retrieval_from_step": start.retrieving_from}
           if (start := start_of(setup.parts.objective)) is not None else {}),
        "train_seconds": round(seconds, 2),
        "samples_per_second": round((setup.steps - start_step) * cfg.batch_size / max(seconds, 1e-9), 2),
        "precision": setup.step_parts.precision,
        **({"init_from": setup.identity["init_from"]} if "init_from" in setup.identity else {}),
        **({"logit_bias": setup.parts.objective.logit_bias.item()} if setup.parts.objective.takes_bias else {}),
        **({"source_shares": mix.shares,
            "source_samples": {name: round(share * setup.steps * cfg.batch_size) for name, share in mix.shares.items()}}
           if mix.shares else {}),
        **({"caption_truncated_fraction": round(fit.truncated_fraction, 6),
            "caption_merged_fraction": round(fit.merged_fraction, 6)} if fit else {}),
    }
    if env.distributed:  # the ranks part here: none waits in a collective while rank 0 writes and uploads
        dist.barrier()
        dist.destroy_process_group()
    published: list[str] = []
    if env.is_main:
        _write_outputs(output, setup.parts.model, config, metrics, state.history)
        if publish:
            published = publish_copy(output, publish, exclude=("checkpoints",))  # as one unit
        if setup.mirror is not None:
            setup.mirror.finish()
    return TrainResult(output, metrics, setup.parts.model, env.is_main, published)


def _write_outputs(output: Path, model, config: CloobConfig, metrics: dict, history: list) -> None:
    export_model(model, output / "model", {"objective": config.train.objective, "beta": config.objective.beta,
                                           "steps": metrics["steps"],
                                           **{key: metrics[key] for key in ("init_from", "logit_bias", "source_shares")
                                              if key in metrics}})
    write_json(output / "metrics.json", metrics)
    write_text(output / "loss_history.csv", ",".join(HISTORY_COLUMNS) + "\n" + "".join(
        ",".join(repr(v) for v in row) + "," * (len(HISTORY_COLUMNS) - len(row)) + "\n" for row in history))
    if history:
        steps, losses, lrs = zip(*(row[:3] for row in history), strict=True)
        training_curves_png(output / "training_curves.png", steps, losses, lrs,
                            f"cloob train: {config.train.objective}, {config.model.architecture}")
