"""One optimiser step, with gradient accumulation that does not shrink the contrastive batch.

With ``accum_freq = k`` the local batch is cut into k micro-batches. All their features are first computed
without gradient and cached; then each micro-batch is run again with gradient, its fresh features put in
place of its cached ones, and the loss over the *whole* batch back-propagated. The loss is the same number in
each pass and only the fresh micro-batch carries gradient, so the k backward passes sum to exactly the
full-batch gradient (open_clip's ``accum_freq``). A learnable temperature takes its gradient in one pass only, or
it would be counted k times: the last, the one in which DDP synchronises, since DDP expects every parameter that
needs a gradient to get one in the pass that reduces (with the temperature's gradient in an earlier, ``no_sync``
pass, its bucket never completes and the next step fails).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cloob_core.devices import autocast


def use_fast_kernels(device: torch.device) -> None:
    """On CUDA: TF32 for what stays in float32 (the loss's matmuls, the optimiser's) and cuDNN's autotuner, whose
    search pays off since every step has the same shapes (ResNet towers)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.benchmark = True


@dataclass(kw_only=True)
class StepParts:
    model: nn.Module  # what forward runs through: the DDP wrapper when distributed
    objective: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device_type: str
    precision: str = "fp32"
    accum_freq: int = 1
    grad_clip_norm: float | None = None

    def autocast(self) -> Any:
        return autocast(self.precision, self.device_type)


class StepOutput(NamedTuple):
    """What a step leaves for the log window (detached, on the device, no host sync): its loss, and the local
    batch's embeddings, which the collapse detector measures (:mod:`cloob_core.training.collapse`)."""

    loss: Tensor
    image_features: Tensor
    text_features: Tensor


def accumulate_gradients(parts: StepParts, images: Tensor, tokens: Tensor) -> StepOutput:
    """Back-propagate the step's loss into ``.grad``; returns the loss and the embeddings."""
    model, k = parts.model, parts.accum_freq
    if k == 1:
        with parts.autocast():
            image_features, text_features, inv_tau = model(images, tokens)
            loss = parts.objective(image_features, text_features, inv_tau)
        parts.scaler.scale(loss).backward()
        return StepOutput(loss.detach(), image_features.detach(), text_features.detach())
    if images.shape[0] % k:
        raise ValueError(f"the local batch of {images.shape[0]} does not split into accum_freq={k} micro-batches")
    image_chunks, token_chunks = images.chunk(k), tokens.chunk(k)
    with torch.no_grad(), parts.autocast():
        cached = [model(i, t)[:2] for i, t in zip(image_chunks, token_chunks, strict=True)]
    no_sync = getattr(model, "no_sync", None)
    for j in range(k):
        sync = contextlib.nullcontext() if (no_sync is None or j == k - 1) else no_sync()
        with sync, _own_gradient(parts.objective, j == k - 1):
            with parts.autocast():
                image_j, text_j, inv_tau = model(image_chunks[j], token_chunks[j])
                image_features = torch.cat([image_j if m == j else c[0] for m, c in enumerate(cached)])
                text_features = torch.cat([text_j if m == j else c[1] for m, c in enumerate(cached)])
                loss = parts.objective(image_features, text_features, inv_tau if j == k - 1 else inv_tau.detach())
            parts.scaler.scale(loss).backward()
    return StepOutput(loss.detach(), image_features.detach(), text_features.detach())


@contextlib.contextmanager
def _own_gradient(objective: torch.nn.Module, taken: bool) -> Iterator[None]:
    """The objective's own parameters take their gradient in one pass of the step only: each pass's loss is the
    whole step's (the other micro-batches from the cache), as for the temperature, detached but in the last."""
    own = [p for p in objective.parameters() if p.requires_grad]
    if taken or not own:
        yield
        return
    for p in own:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in own:
            p.requires_grad_(True)


def average_objective_gradients(objective: torch.nn.Module) -> None:
    """An objective's own parameters (SigLIP's bias) are outside DDP: their gradients are averaged over the ranks
    here, as DDP averages the model's (each rank's is its share of the loss under train.local_loss)."""
    grads = [p.grad for p in objective.parameters() if p.grad is not None]
    if grads and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for grad in grads:
            dist.all_reduce(grad)
            grad.div_(dist.get_world_size())


def optimizer_step(parts: StepParts, measure_norm: bool = False) -> Tensor | None:
    """Unscale, clip, step, zero. Returns the gradient norm when clipping or asked (a tensor: no sync)."""
    norm = None
    average_objective_gradients(parts.objective)
    if parts.grad_clip_norm is not None or measure_norm:
        parts.scaler.unscale_(parts.optimizer)
        params = [p for group in parts.optimizer.param_groups for p in group["params"] if p.grad is not None]
        limit = parts.grad_clip_norm if parts.grad_clip_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
    parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    return norm
