"""Distribution policy for the objectives, kept apart from their math.

Contrastive objectives need the *global* batch: every rank's embeddings are negatives for every other
rank's anchors. :func:`gather_features` concatenates the features of all ranks with a differentiable
all-gather. Then either every rank computes the whole global loss (the default), or, with ``train.local_loss``,
each rank computes only the terms anchored on its own rows against the global batch (:class:`Anchors`):
O(n·N) instead of O(N²) per rank, open_clip's ``--local-loss --gather-with-grad``.

Gradient bookkeeping: the all-gather's backward sums, for a rank's rows, the gradients that every rank's loss
sends them. Global loss on every rank: that sum is ``world_size * dL/d(rows)``, and DDP's average over the ranks
cancels the factor. Local loss: rank r's loss L_r is the mean of its own anchors' terms, so the sum is
``d(sum_r L_r)/d(rows)`` and DDP's average gives the gradient of ``mean_r L_r``, the global loss (the ranks hold
equal shares). Either way the result is exactly the single-process gradient over the global batch. (Gathering
without gradient, as ml-jku/cloob does, keeps only the local rows' share and loses the rest.)

The gather is ours, a small autograd function on c10d's public tensor collectives, because torch's differentiable
``torch.distributed.nn.functional.all_gather`` is deprecated and its replacements are private modules whose names
change between releases.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cloob_core.objectives.anchors import Anchors


def is_distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# all_gather_single / reduce_scatter_single where this torch has them (2.14 deprecates the *_tensor names)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherWithGrad(torch.autograd.Function):
    """Rows of every rank, in rank order; backward: each rank's rows get the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
        _ALL_GATHER(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        group, world = ctx.group, dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        rows = grad.shape[0] // world
        if dist.get_backend(group) == "nccl":
            out = grad.new_empty((rows, *grad.shape[1:]))
            _REDUCE_SCATTER(out, grad, group=group)
            return out, None
        summed = grad.clone()  # gloo has no reduce-scatter: the sum everywhere, then this rank's rows
        dist.all_reduce(summed, group=group)
        rank = dist.get_rank(group)
        return summed[rank * rows : (rank + 1) * rows].contiguous(), None


def all_gather_with_grad(tensor: Tensor, group: Any = None) -> Tensor:
    """The collective itself, on any group (also of one rank: how a GPU check exercises NCCL on one GPU). All
    ranks must pass the same shape; no check runs here, as it would cost a collective and a host sync a step."""
    return _GatherWithGrad.apply(tensor, group)


def gather_with_grad(tensor: Tensor) -> Tensor:
    """Concatenate ``tensor`` of every rank along dim 0 (rank order), keeping the autograd graph; itself in
    a single process."""
    return all_gather_with_grad(tensor) if is_distributed() else tensor


def gather_features(image_features: Tensor, text_features: Tensor) -> tuple[Tensor, Tensor]:
    """Image and text features of the global batch; a no-op in a single process."""
    if not is_distributed():
        return image_features, text_features
    return gather_with_grad(image_features), gather_with_grad(text_features)


def local_anchors(local_rows: int) -> Anchors:
    """This rank's rows of the gathered batch, and the gather that makes its retrieved rows global."""
    rank = dist.get_rank()
    return Anchors(rank * local_rows, (rank + 1) * local_rows, gather_with_grad)


def mean_over_ranks(value: Tensor) -> Tensor:
    """A tensor's mean over the ranks (itself outside a process group); asynchronous on the device, no host read."""
    if not is_distributed():
        return value
    value = value.clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()
