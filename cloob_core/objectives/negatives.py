"""Negatives restricted to a band of difficulty (Wu et al., "On Mutual Information in Contrastive Learning for
Visual Representations", 2020): BALL keeps, for each anchor, only the candidates ranked in the closest
``p_out`` fraction; RING also cuts the closest ``p_in`` fraction (near duplicates, which for web captions are
often false negatives). Both are VINCE estimators: ``log K - L`` with a restricted proposal still lower-bounds
the mutual information (their Lemma 4.2, Thm. 4.1), looser as the band narrows.

What lives here: the band (a fraction pair), its annealing schedule (``p_out`` from 100% down to the target over
``anneal_steps``, and optionally ``p_in`` from 0 up), the eligibility mask computed from similarities without
gradient, and a FIFO queue of past embeddings that adds candidates beyond the batch (the paper's memory bank),
kept apart from the Hopfield memories. The objectives in :mod:`cloob_core.objectives.losses` apply the mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Band:
    """Eligible negatives of an anchor: those ranked in ``[p_in, p_out)`` of its candidates by similarity
    (rank 0 = the most similar). ``p_in = 0, p_out = 1`` keeps every candidate: plain InfoNCE / InfoLOOB."""

    p_in: float = 0.0
    p_out: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_in < self.p_out <= 1.0:
            raise ValueError(f"a band needs 0 <= p_in < p_out <= 1, got p_in={self.p_in}, p_out={self.p_out}")

    def limits(self, candidates: int) -> tuple[int, int]:
        """(first kept rank, first rank past the band) among ``candidates`` negatives; never empty."""
        start = math.floor(round(self.p_in * candidates, 9))
        stop = math.ceil(round(self.p_out * candidates, 9))
        stop = min(max(stop, start + 1), candidates)
        return min(start, stop - 1), stop


@dataclass(frozen=True)
class BandSchedule:
    """The paper's annealing: ``p_out`` falls linearly from 100% to its target over ``anneal_steps`` optimiser
    steps and then holds (early representations are too noisy for hard negatives); with ``anneal_inner`` the
    cut-out neighbourhood ``p_in`` grows from 0 to its target over the same steps. ``anneal_steps = 0``: the
    target band from the first step."""

    p_in: float = 0.0
    p_out: float = 1.0
    anneal_steps: int = 0
    anneal_inner: bool = False

    def __post_init__(self) -> None:
        Band(self.p_in, self.p_out)  # validates the target
        if self.anneal_steps < 0:
            raise ValueError(f"anneal_steps must be >= 0, got {self.anneal_steps}")

    def at(self, step: int) -> Band:
        if self.anneal_steps == 0 or step >= self.anneal_steps:
            return Band(self.p_in, self.p_out)
        done = max(step, 0) / self.anneal_steps
        p_out = 1.0 + (self.p_out - 1.0) * done
        p_in = self.p_in * done if self.anneal_inner else self.p_in
        return Band(min(p_in, p_out * (1 - 1e-12)), p_out)


@torch.no_grad()
def band_columns(similarity: Tensor, band: Band, offset: int = 0) -> Tensor | None:
    """``[A, n]`` column indices of the negatives each anchor (row) keeps, or ``None`` for the full band (every
    candidate but the positive). Column ``offset + i`` of row ``i`` is the anchor's positive: never a negative,
    not ranked. Computed without gradient: the ranking selects terms, it is not differentiated. Only the ``stop``
    most similar candidates are ranked (``topk``, not a full sort), so a narrow band costs little; ties at a
    band's edge are broken the same way on every rank and rerun."""
    anchors, candidates = similarity.shape
    if candidates < offset + anchors:
        raise ValueError(f"expected the positives on diagonal {offset} of [A, C >= {offset} + A], got "
                         f"{tuple(similarity.shape)}")
    start, stop = band.limits(candidates - 1)
    if start == 0 and stop == candidates - 1:
        return None
    scores = similarity.detach().clone()
    scores.diagonal(offset).fill_(float("-inf"))  # the positive ranks last, outside any band
    return torch.topk(scores, stop, dim=1, largest=True, sorted=start > 0).indices[:, start:]


@torch.no_grad()
def eligible_negatives(similarity: Tensor, band: Band) -> Tensor:
    """Boolean ``[A, C]`` mask of the negatives each anchor keeps (see :func:`band_columns`)."""
    anchors, candidates = similarity.shape
    columns = band_columns(similarity, band)
    rows = torch.arange(anchors, device=similarity.device)
    if columns is None:
        mask = torch.ones(anchors, candidates, dtype=torch.bool, device=similarity.device)
    else:
        mask = torch.zeros(anchors, candidates, dtype=torch.bool, device=similarity.device)
        mask.scatter_(1, columns, True)
    mask[rows, rows] = False
    return mask


class EmbeddingQueue:
    """A FIFO of past (detached) image and text embeddings: extra candidate negatives, so a band's percentages
    mean something at small batch sizes. Never stored in a Hopfield memory. Its contents are part of the
    checkpointed state, so a resumed run sees the same candidates."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"queue size must be >= 0, got {size}")
        self.size = size
        self.image: Tensor | None = None
        self.text: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.image is None else self.image.shape[0]

    def push(self, image: Tensor, text: Tensor) -> None:
        """Newest first; the oldest fall out beyond ``size``."""
        if self.size == 0:
            return
        image, text = image.detach(), text.detach()
        if self.image is not None:
            image = torch.cat([image, self.image.to(image.device, image.dtype)])
            text = torch.cat([text, self.text.to(text.device, text.dtype)])
        self.image, self.text = image[: self.size].clone(), text[: self.size].clone()

    def state(self) -> dict[str, Tensor]:
        return {} if self.image is None else {"image": self.image.cpu(), "text": self.text.cpu()}

    def load(self, state: dict[str, Tensor]) -> None:
        self.image, self.text = state.get("image"), state.get("text")
