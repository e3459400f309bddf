"""``cloob demo``: train the tiny CLOOB model on the embedded digits on CPU and report zero-shot accuracy.

The first job a newcomer runs. It keeps the whole pairs set in memory (4,000 small images), so it needs no
shards; the training stage proper (``cloob train``) streams WebDataset shards instead.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from torch import Tensor
from tqdm.auto import tqdm

from cloob_core import embedded_data
from cloob_core.config import CloobConfig
from cloob_core.io import write_json, write_text
from cloob_core.losses import objective_from_config
from cloob_core.model import CLOOBModel, build_model, build_tokenizer
from cloob_core.optim import build_optimizer, build_scheduler
from cloob_core.plots import training_summary_png
from cloob_core.zeroshot import class_embeddings, classification_metrics

log = logging.getLogger(__name__)

_MNIST_CANVAS = 32  # MNIST's 28x28 digits padded by 2 px, the classic LeNet input
_MAX_SHIFT = 2  # pixels; MNIST digits are centred in a 20x20 box, so small shifts keep them whole


@dataclass(frozen=True)
class DemoResult:
    metrics: dict
    output_dir: Path


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def digits_to_canvas(images: np.ndarray) -> Tensor:
    """uint8 ``[N, 28, 28]`` -> float ``[N, 1, 32, 32]`` in [0, 1], digit centred on black."""
    pixels = torch.from_numpy(images).float().div_(255.0)[:, None]
    pad = (_MNIST_CANVAS - pixels.shape[-1]) // 2
    return F.pad(pixels, (pad, pad, pad, pad))


def random_shift(canvas: Tensor, generator: torch.Generator) -> Tensor:
    """Shift each digit by up to ``_MAX_SHIFT`` px in x and y, filling with black (no wrap-around)."""
    size = canvas.shape[-1]
    padded = F.pad(canvas, (_MAX_SHIFT,) * 4)
    offsets = torch.randint(0, 2 * _MAX_SHIFT + 1, (canvas.shape[0], 2), generator=generator).tolist()
    return torch.stack(
        [img[:, top : top + size, left : left + size] for img, (top, left) in zip(padded, offsets, strict=True)]
    )


@dataclass(frozen=True)
class InputFormat:
    """The model's input size and per-channel mean/std, read once per run rather than once per batch."""

    size: int
    mean: Tensor
    std: Tensor

    @classmethod
    def of(cls, model: CLOOBModel) -> InputFormat:
        preprocess = getattr(model.encoder.visual, "preprocess_cfg", {}) or {}
        mean = torch.tensor(preprocess.get("mean", OPENAI_DATASET_MEAN)).view(1, 3, 1, 1)
        std = torch.tensor(preprocess.get("std", OPENAI_DATASET_STD)).view(1, 3, 1, 1)
        return cls(size=model.image_size, mean=mean, std=std)


def to_model_input(canvas: Tensor, fmt: InputFormat) -> Tensor:
    """Grey canvas -> normalised RGB at the model's input size, with the model's mean/std."""
    if fmt.size != canvas.shape[-1]:
        canvas = F.interpolate(canvas, size=fmt.size, mode="bilinear", align_corners=False)
    return (canvas.expand(-1, 3, -1, -1) - fmt.mean) / fmt.std


@torch.no_grad()
def zero_shot_on(model: CLOOBModel, tokenizer, split: embedded_data.CaptionedImages, batch_size: int) -> dict:
    was_training = model.training
    model.eval()
    classes = class_embeddings(model.encode_text, tokenizer, split.classnames, embedded_data.ZERO_SHOT_TEMPLATES)
    canvas = digits_to_canvas(split.images)
    fmt = InputFormat.of(model)
    features = torch.cat([model.encode_image(to_model_input(chunk, fmt)) for chunk in canvas.split(batch_size)])
    model.train(was_training)
    return classification_metrics(features @ classes.T, torch.from_numpy(split.labels), len(split.classnames))


def run_demo(config: CloobConfig, output_dir: str | Path, progress: bool = True) -> DemoResult:
    """Train on the embedded training split, evaluate zero-shot on the held-out split, write the results."""
    output_dir = Path(output_dir)
    demo = config.demo
    seed_everything(demo.seed)
    train = embedded_data.load_embedded("train")
    test = embedded_data.load_embedded("test")

    model = build_model(config.model)
    model.train()
    tokenizer = build_tokenizer(config.model.architecture)
    if (config.train.image_views, config.train.text_views) != (1, 1):
        raise ValueError("cloob demo trains on one view of each pair; use `cloob train` for poly-view runs")
    objective = objective_from_config(config)
    tokens = tokenizer(list(train.captions))
    canvas = digits_to_canvas(train.images)
    input_format = InputFormat.of(model)

    steps_per_epoch = len(train) // demo.batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"demo.batch_size {demo.batch_size} exceeds the {len(train)} training pairs")
    total_steps = demo.epochs * steps_per_epoch
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, total_steps)

    untrained = zero_shot_on(model, tokenizer, test, demo.eval_batch_size)
    log.info(
        "training %s with objective %s on %d embedded pairs: %d epochs x %d steps of %d pairs",
        config.model.architecture,
        objective.name,
        len(train),
        demo.epochs,
        steps_per_epoch,
        demo.batch_size,
    )
    generator = torch.Generator().manual_seed(demo.seed)
    losses: list[float] = []
    learning_rates: list[float] = []
    started = time.perf_counter()
    bar = tqdm(total=total_steps, desc=f"demo [{objective.name}]", unit="step", disable=not progress)
    step = 0
    for _epoch in range(demo.epochs):
        order = torch.randperm(len(train), generator=generator)
        for batch in order[: steps_per_epoch * demo.batch_size].split(demo.batch_size):
            scheduler.step_update(step)
            images = canvas[batch]
            if demo.augment:
                images = random_shift(images, generator)
            image_features, text_features, inv_tau = model(to_model_input(images, input_format), tokens[batch])
            loss = objective(image_features, text_features, inv_tau)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            objective.end_step()
            model.clamp_inv_tau_()
            step += 1
            losses.append(loss.item())
            learning_rates.append(optimizer.param_groups[0]["lr"])
            bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{learning_rates[-1]:.2e}", refresh=False)
            bar.update()
    bar.close()
    train_seconds = time.perf_counter() - started

    zero_shot = zero_shot_on(model, tokenizer, test, demo.eval_batch_size)
    metrics = {
        "objective": objective.name,
        "architecture": config.model.architecture,
        "seed": demo.seed,
        "steps": total_steps,
        "train_pairs": len(train),
        "held_out_images": len(test),
        "train_seconds": round(train_seconds, 2),
        "final_loss": losses[-1],
        "zero_shot": zero_shot,
        "zero_shot_untrained_top1": untrained["top1"],
        "zero_shot_templates": list(embedded_data.ZERO_SHOT_TEMPLATES),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    write_json(output_dir / "metrics.json", metrics)
    history = "step,loss,lr\n" + "".join(
        f"{i},{loss!r},{lr!r}\n" for i, (loss, lr) in enumerate(zip(losses, learning_rates, strict=True), start=1)
    )
    write_text(output_dir / "loss_history.csv", history)
    training_summary_png(
        output_dir / "training_summary.png",
        losses,
        learning_rates,
        test.classnames,
        zero_shot["per_class_accuracy"],
        zero_shot["chance"],
        title=f"cloob demo: {objective.name} on embedded MNIST pairs ({config.model.architecture})",
    )
    return DemoResult(metrics=metrics, output_dir=output_dir)
