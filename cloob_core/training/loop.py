"""``cloob train``: WebDataset shards in, an open_clip-loadable model out, resumable to the exact step.

The step itself holds no host synchronisation: the loss is accumulated on the device and read once per
``log_every`` steps; images go to the device pinned, non-blocking and channels-last on GPUs.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import open_clip
import torch
import torch.distributed as dist

from cloob_core import storage
from cloob_core.config import CloobConfig, ConfigError
from cloob_core.data.shard_files import shard_list
from cloob_core.io import write_json, write_text
from cloob_core.model.dual_encoder import build_model, build_tokenizer
from cloob_core.model.export import export_model
from cloob_core.objectives.losses import objective_from_config
from cloob_core.plots import training_curves_png
from cloob_core.training import checkpoint
from cloob_core.training.env import DistEnv, choose_device, detect, init_process_group
from cloob_core.training.monitor import Monitor, Snapshot
from cloob_core.training.optim import build_optimizer, build_scheduler
from cloob_core.training.step import StepParts, accumulate_gradients, optimizer_step
from cloob_core.training.streams import StreamChunks, assemble, rank_streams

log = logging.getLogger(__name__)


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


def _check_batch(config: CloobConfig, env: DistEnv) -> int:
    train = config.train
    if train.batch_size % train.data_streams:
        raise ConfigError(f"train.batch_size ({train.batch_size}) must be a multiple of train.data_streams "
                          f"({train.data_streams})")
    local = train.batch_size // env.world_size
    if train.batch_size % env.world_size or local % train.accum_freq:
        raise ConfigError(f"train.batch_size {train.batch_size} must split into {env.world_size} rank(s) x "
                          f"accum_freq {train.accum_freq} equal micro-batches")
    return train.batch_size // train.data_streams


def resolve_resume(resume: str | None, output: Path, mirror: str | None) -> str | None:
    """``latest``: the newest checkpoint in OUTPUT/checkpoints, else in the S3 mirror; or an explicit path."""
    if resume is None:
        earlier = checkpoint.latest(str(output / "checkpoints"))
        if earlier is not None:  # its retention would mix the two runs, and `--resume latest` pick the wrong one
            raise ConfigError(f"{output}/checkpoints holds checkpoints of an earlier run (newest {earlier}); pass "
                              "--resume latest to continue it, or choose another --output")
        return None
    if resume != "latest":
        return resume
    found = checkpoint.latest(str(output / "checkpoints"))
    if found is None and mirror:
        found = checkpoint.latest(mirror)
    if found is None:
        log.info("--resume latest: no checkpoint yet, starting from step 0")
    return found


def train(config: CloobConfig, output: str | Path, *, resume: str | None = None, progress: bool = True,
          publish: str | None = None) -> TrainResult:
    """Train to ``config.train``'s length; ``resume``: 'latest' or a checkpoint. With ``publish`` (a folder or
    s3:// prefix), rank 0 copies the outputs but checkpoints/ there: how the pods of a multi-node job hand their
    result back."""
    output = Path(output)
    cfg = config.train
    env = detect()
    device = choose_device(cfg.device, env)
    init_process_group(env, device)
    chunk_size = _check_batch(config, env)
    urls, total_samples = shard_list(cfg.shards)
    steps = plan_steps(config, total_samples)
    owned = rank_streams(cfg.data_streams, env.rank, env.world_size)

    torch.manual_seed(cfg.seed)
    model = build_model(config.model).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    if cfg.grad_checkpointing:
        model.encoder.set_grad_checkpointing(True)
    tokenizer = build_tokenizer(config.model.architecture)
    preprocess = getattr(model.encoder.visual, "preprocess_cfg", {}) or {}
    transform = open_clip.image_transform(model.image_size, is_train=cfg.augment, mean=preprocess.get("mean"),
                                          std=preprocess.get("std"))
    objective = objective_from_config(config)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, steps)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")

    start_step, positions, history = 0, {}, []
    source = resolve_resume(resume, output, cfg.checkpoint_sync)
    if source is not None:
        state = checkpoint.load(source)
        checkpoint.check_compatible(state["config"], config.model_dump(), source)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        checkpoint.set_rng_state(state["rng"])
        objective.load_checkpoint_state(state.get("objective", {}))
        start_step = int(state["step"])
        positions = {int(v): (int(p), int(o)) for v, (p, o) in state["positions"].items()}
        history = [tuple(row) for row in state["history"]]
        log.info("resuming from %s at step %d of %d", source, start_step, steps)

    forward_model: torch.nn.Module = model
    if cfg.sync_batchnorm and env.distributed and device.type == "cuda":
        forward_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(forward_model)
    if env.distributed:
        forward_model = torch.nn.parallel.DistributedDataParallel(
            forward_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if cfg.compile:
        forward_model = torch.compile(forward_model)
    parts = StepParts(forward_model, objective, optimizer, scaler, device.type, cfg.precision, cfg.accum_freq,
                      cfg.grad_clip_norm)

    dataset = StreamChunks(urls, cfg.data_streams, owned, chunk_size, start_step, positions, transform, tokenizer,
                           cfg.seed, cfg.shuffle_buffer, cfg.image_views, cfg.text_views)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=cfg.workers,
                                         pin_memory=device.type == "cuda",
                                         prefetch_factor=4 if cfg.workers else None)
    batches = assemble(iter(loader), owned)  # workers fork here, before any monitoring thread starts

    monitor = Monitor(env.is_main, steps, start_step, output, progress, cfg.tensorboard, cfg.metrics_port,
                      cfg.metrics_host, cfg.pushgateway).start()
    if env.is_main:
        log.info("training %s with %s: %d steps of %d pairs (%d rank(s), %s, %d data streams) from %s",
                 config.model.architecture, objective.name, steps, cfg.batch_size, env.world_size, device,
                 cfg.data_streams, cfg.shards)
    started = time.perf_counter()
    window_loss = torch.zeros((), device=device)
    window_steps, window_errors, window_data = 0, 0, 0.0
    window_start = time.perf_counter()
    last_loss = float("nan")
    model.train()
    try:
        for step in range(start_step, steps):
            fetch_start = time.perf_counter()
            batch = next(batches)
            window_data += time.perf_counter() - fetch_start
            if batch.step != step:
                raise RuntimeError(f"data stream out of step: expected batch {step}, got {batch.step}")
            images = batch.images.to(device, non_blocking=True)
            if device.type == "cuda":
                images = images.contiguous(memory_format=torch.channels_last)
            tokens = batch.tokens.to(device, non_blocking=True)
            scheduler.step_update(step)
            loss = accumulate_gradients(parts, images, tokens)
            logging_step = (step + 1) % cfg.log_every == 0 or step + 1 == steps
            grad_norm = optimizer_step(parts, measure_norm=logging_step and env.is_main)
            objective.end_step()  # band schedules and queues advance once per optimiser step
            model.clamp_inv_tau_()
            positions.update(batch.positions)
            window_loss += loss.float()
            window_steps += 1
            window_errors += batch.skipped
            monitor.advance()
            if logging_step:
                last_loss = float(window_loss) / window_steps  # the one host sync, once per window
                elapsed = time.perf_counter() - window_start
                lr = optimizer.param_groups[0]["lr"]
                history.append((step + 1, last_loss, lr))
                snapshot = Snapshot(step + 1, steps, last_loss, lr, float(model.inv_tau),
                                    window_steps * cfg.batch_size / max(elapsed, 1e-9), window_data / window_steps,
                                    None if grad_norm is None else float(grad_norm), (step + 1) * cfg.batch_size,
                                    window_errors)
                monitor.update(snapshot, window_steps, window_steps * cfg.batch_size, window_errors)
                window_loss.zero_()
                window_steps, window_errors, window_data = 0, 0, 0.0
                window_start = time.perf_counter()
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == steps:
                _save_checkpoint(config, env, output, model, optimizer, scheduler, scaler, step + 1, positions,
                                 history, objective.checkpoint_state())
                monitor.checkpointed()
    finally:
        monitor.close()
    seconds = time.perf_counter() - started

    metrics = {
        "objective": objective.name,
        "architecture": config.model.architecture,
        "steps": steps,
        "resumed_from_step": start_step,
        "batch_size": cfg.batch_size,
        "world_size": env.world_size,
        "samples_seen": steps * cfg.batch_size,
        "final_loss": last_loss,
        "train_seconds": round(seconds, 2),
        "samples_per_second": round((steps - start_step) * cfg.batch_size / max(seconds, 1e-9), 2),
        "precision": cfg.precision,
    }
    published: list[str] = []
    if env.is_main:
        _write_outputs(output, model, config, metrics, history)
        if publish:
            published = storage.upload_tree(str(output), publish, exclude=("checkpoints",))
    if env.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return TrainResult(output, metrics, model, env.is_main, published)


def _save_checkpoint(config: CloobConfig, env: DistEnv, output: Path, model, optimizer, scheduler, scaler,
                     step: int, positions: dict, history: list, objective_state: dict) -> None:
    if env.distributed:  # every rank knows only its own streams' positions
        gathered: list[dict] = [{} for _ in range(env.world_size)]
        dist.all_gather_object(gathered, positions)
        positions = {v: p for part in gathered for v, p in part.items()}
    if env.is_main:
        state = {
            "step": step,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),  # a pure function of the step; kept for inspection and tools
            "scaler": scaler.state_dict(),
            "positions": {str(v): list(p) for v, p in sorted(positions.items())},
            "rng": checkpoint.rng_state(),
            "config": config.model_dump(),
            "world_size": env.world_size,
            "history": [list(row) for row in history],
            "objective": objective_state,  # band schedule step, negative queue
        }
        path = checkpoint.save(state, output / "checkpoints", step, config.train.keep_checkpoints,
                               config.train.checkpoint_sync)
        log.info("checkpoint %s", path)
    if env.distributed:
        dist.barrier()


def _write_outputs(output: Path, model, config: CloobConfig, metrics: dict, history: list) -> None:
    export_model(model, output / "model", {"objective": config.train.objective, "beta": config.objective.beta,
                                           "steps": metrics["steps"]})
    write_json(output / "metrics.json", metrics)
    write_text(output / "loss_history.csv",
               "step,loss,lr\n" + "".join(f"{s},{loss!r},{lr!r}\n" for s, loss, lr in history))
    if history:
        steps, losses, lrs = zip(*history, strict=True)
        training_curves_png(output / "training_curves.png", steps, losses, lrs,
                            f"cloob train: {config.train.objective}, {config.model.architecture}")
