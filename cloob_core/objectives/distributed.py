"""Distribution policy for the objectives, kept apart from their math.

Contrastive objectives need the *global* batch: every rank's embeddings are negatives for every other
rank's anchors. :func:`gather_features` concatenates the features of all ranks with a differentiable
all-gather, so each rank computes the same global loss and backpropagates into its own rows the gradient
that all ranks' copies of the loss send them.

Gradient bookkeeping: every rank holds the full loss ``L``. The all-gather's backward sums the gradient of
``L`` with respect to a rank's rows over all ranks, i.e. ``world_size * dL/d(rows)``. DDP then averages
parameter gradients over ``world_size`` ranks, which cancels the factor: the result is exactly the
single-process gradient of ``L`` over the global batch. (Gathering without gradient, as ml-jku/cloob does,
keeps only the local rows' share and loses the rest.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_with_grad(tensor: Tensor) -> Tensor:
    """Concatenate ``tensor`` of every rank along dim 0 (rank order), keeping the autograd graph.

    All ranks must pass the same shape (drop the last incomplete batch per rank). No shape check runs
    here: it would cost a collective and a host sync on every step.
    """
    if not is_distributed():
        return tensor
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(tensor), dim=0)


def gather_features(image_features: Tensor, text_features: Tensor) -> tuple[Tensor, Tensor]:
    """Image and text features of the global batch; a no-op in a single process."""
    if not is_distributed():
        return image_features, text_features
    return gather_with_grad(image_features), gather_with_grad(text_features)
