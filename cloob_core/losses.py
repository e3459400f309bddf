"""Contrastive objectives of the CLOOB paper, written as the equations read.

Equation numbers refer to Fürst et al., "CLOOB: Modern Hopfield Networks with InfoLOOB Outperform CLIP"
(NeurIPS 2022). Every function takes embeddings that are already L2-normalised, shape ``[N, d]``, and does
not re-normalise them, so values and gradients are exactly those of the formulas.

The pure functions hold the math. The ``nn.Module`` classes share one call signature,
``objective(image_features, text_features, inv_tau)``, and add only the distribution policy: with
``torch.distributed`` initialised they gather the features of all ranks *with gradient* first
(see :mod:`cloob_core.distributed`), so the loss is always that of the global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cloob_core.config import OBJECTIVE_NAMES
from cloob_core.distributed import gather_features

__all__ = [
    "OBJECTIVES",
    "CLOOBLoss",
    "ClipLoss",
    "ContrastiveObjective",
    "HopfieldInfoNCELoss",
    "InfoLOOBLoss",
    "build_objective",
    "cloob_loss",
    "hopfield_retrieval",
    "infoloob_loss",
    "infonce_hopfield_loss",
    "infonce_loss",
    "loob",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _reduction_dtype(logits: Tensor) -> Tensor:
    """Run softmax / log-sum-exp reductions in at least float32.

    Under autocast the similarity matmuls may produce bf16/fp16; reducing N terms in 8 mantissa bits
    loses the loss value, so reductions are promoted while the matmuls keep the fast dtype.
    """
    return logits.float() if logits.dtype in _LOW_PRECISION else logits


def _logits(anchors: Tensor, samples: Tensor, inv_tau: float | Tensor) -> Tensor:
    """``inv_tau * anchors @ samples.T``, promoted for the reductions that follow."""
    return _reduction_dtype(inv_tau * (anchors @ samples.T))


def _check_pair(anchors: Tensor, samples: Tensor, *, min_batch: int) -> None:
    if anchors.ndim != 2 or samples.ndim != 2:
        raise ValueError(f"expected [N, d] embeddings, got {tuple(anchors.shape)} and {tuple(samples.shape)}")
    if anchors.shape != samples.shape:
        raise ValueError(
            f"anchors and samples must pair up row by row: {tuple(anchors.shape)} vs {tuple(samples.shape)}"
        )
    if anchors.shape[0] < min_batch:
        raise ValueError(f"this objective needs a batch of at least {min_batch} pairs, got {anchors.shape[0]}")


def hopfield_retrieval(state: Tensor, stored: Tensor, beta: float | Tensor) -> Tensor:
    """Modern Hopfield retrieval, Eq. (1)-(4): ``normalize(softmax(beta * state @ stored.T) @ stored)``.

    ``state`` is ``[S, d]`` (the queries), ``stored`` is ``[M, d]`` (the memory). Each retrieved row is
    re-normalised to unit length, as the paper does after retrieval.
    """
    if state.ndim != 2 or stored.ndim != 2 or state.shape[1] != stored.shape[1]:
        raise ValueError(f"expected state [S, d] and stored [M, d], got {tuple(state.shape)} and {tuple(stored.shape)}")
    return _retrieve(state @ stored.T, stored, beta)


def _retrieve(scores: Tensor, stored: Tensor, beta: float | Tensor, transposed: bool = False) -> Tensor:
    """Retrieval from precomputed ``scores = state @ stored.T``, or from ``scores.T`` when ``transposed``
    (softmax down the columns, then a transposed matmul: no strided row softmax, no copy)."""
    if transposed:
        attention = torch.softmax(_reduction_dtype(beta * scores), dim=0).T
    else:
        attention = torch.softmax(_reduction_dtype(beta * scores), dim=-1)
    return F.normalize(attention.to(stored.dtype) @ stored, dim=-1)


def loob(anchors: Tensor, samples: Tensor, inv_tau: float | Tensor) -> Tensor:
    """One direction of InfoLOOB, Eq. (8), un-scaled: ``mean_i -ln( e^{s_ii} / sum_{j != i} e^{s_ij} )``.

    ``s = inv_tau * anchors @ samples.T``; the positive is left out of the denominator, which is what keeps
    the objective from saturating (paper §4). The diagonal is excluded by masking with ``-inf``, so the
    excluded terms contribute exactly nothing to the value or the gradient.
    """
    _check_pair(anchors, samples, min_batch=2)
    return _loob_from_logits(_logits(anchors, samples, inv_tau))


def _loob_from_logits(logits: Tensor, dim: int = 1) -> Tensor:
    """Leave-one-out bound of a square logit matrix whose diagonal holds the positives.

    ``dim=1`` anchors on the rows, ``dim=0`` on the columns. Reducing along ``dim=0`` in place of
    transposing keeps the memory access contiguous, which is markedly faster on CPU.
    """
    n = logits.shape[0]
    diagonal = torch.eye(n, dtype=torch.bool, device=logits.device)
    negatives = torch.logsumexp(logits.masked_fill(diagonal, float("-inf")), dim=dim)
    return (negatives - logits.diagonal()).mean()


def _infonce_from_logits(logits: Tensor, dim: int = 1) -> Tensor:
    """InfoNCE (cross-entropy against the diagonal) of a square logit matrix, anchored along ``dim``."""
    return (torch.logsumexp(logits, dim=dim) - logits.diagonal()).mean()


def infonce_loss(image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor) -> Tensor:
    """CLIP's symmetric InfoNCE: Eq. (7) halved, i.e. the mean of the image->text and text->image
    cross-entropies over ``inv_tau * x @ y.T``."""
    _check_pair(image_features, text_features, min_batch=1)
    logits = _logits(image_features, text_features, inv_tau)
    return 0.5 * (_infonce_from_logits(logits, dim=1) + _infonce_from_logits(logits, dim=0))


def infoloob_loss(image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor) -> Tensor:
    """InfoLOOB without Hopfield, scaled by tau: ``tau * [LOOB(x->y) + LOOB(y->x)]`` (Eq. 8).

    The scaling by ``tau = 1 / inv_tau`` removes the factor ``inv_tau`` from the gradients (paper §5.1,
    App. A.1.4). One similarity matrix serves both directions: rows anchor on images, columns on texts.
    """
    _check_pair(image_features, text_features, min_batch=2)
    logits = _logits(image_features, text_features, inv_tau)
    return (_loob_from_logits(logits, dim=1) + _loob_from_logits(logits, dim=0)) / inv_tau


def _hopfield_views(
    image_features: Tensor,
    text_features: Tensor,
    beta: float | Tensor,
    extra_image_stored: Tensor | None,
    extra_text_stored: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four retrievals of Eq. (5): U_x, U_y from the image memory U, V_x, V_y from the text memory V.

    By default U holds the batch's image embeddings and V its text embeddings; extra stored patterns
    (prototypes, a queue) are appended to the respective memory. The four score matrices need only three
    products, because the text queries' scores against U are the transpose of the image queries' scores
    against V (``y @ x.T == (x @ y.T).T``): 7 instead of 8 matmuls for the retrievals, same numbers.
    """
    x, y = image_features, text_features
    scores_xy = x @ y.T

    def against(extra: Tensor | None, query: Tensor, batch_scores: Tensor) -> Tensor:
        return batch_scores if extra is None else torch.cat([batch_scores, query @ extra.T], dim=1)

    stored_u = x if extra_image_stored is None else torch.cat([x, extra_image_stored])
    stored_v = y if extra_text_stored is None else torch.cat([y, extra_text_stored])
    u_x = _retrieve(against(extra_image_stored, x, x @ x.T), stored_u, beta)
    if extra_image_stored is None:
        u_y = _retrieve(scores_xy, stored_u, beta, transposed=True)
    else:
        u_y = _retrieve(against(extra_image_stored, y, scores_xy.T), stored_u, beta)
    v_x = _retrieve(against(extra_text_stored, x, scores_xy), stored_v, beta)
    v_y = _retrieve(against(extra_text_stored, y, y @ y.T), stored_v, beta)
    return u_x, u_y, v_x, v_y


def cloob_loss(
    image_features: Tensor,
    text_features: Tensor,
    inv_tau: float | Tensor,
    beta: float | Tensor,
    extra_image_stored: Tensor | None = None,
    extra_text_stored: Tensor | None = None,
) -> Tensor:
    """CLOOB, Eq. (5) scaled by tau: ``tau * [LOOB(U_x, U_y) + LOOB(V_y, V_x)]``.

    The first term anchors on image-retrieved image embeddings U_x against text-retrieved ones U_y; the
    second anchors on text-retrieved text embeddings V_y against image-retrieved ones V_x, exactly as the
    paper's pseudocode (``loss = (info_loob(U_x, U_y) + info_loob(V_y, V_x)) * tau``).
    """
    _check_pair(image_features, text_features, min_batch=2)
    u_x, u_y, v_x, v_y = _hopfield_views(image_features, text_features, beta, extra_image_stored, extra_text_stored)
    return (loob(u_x, u_y, inv_tau) + loob(v_y, v_x, inv_tau)) / inv_tau


def infonce_hopfield_loss(
    image_features: Tensor,
    text_features: Tensor,
    inv_tau: float | Tensor,
    beta: float | Tensor,
    extra_image_stored: Tensor | None = None,
    extra_text_stored: Tensor | None = None,
) -> Tensor:
    """The paper's ablation "InfoNCE with Hopfield": CLOOB's retrieved embeddings with CLIP's InfoNCE,
    i.e. the mean of the cross-entropies of (U_x anchors, U_y samples) and (V_y anchors, V_x samples)."""
    _check_pair(image_features, text_features, min_batch=1)
    u_x, u_y, v_x, v_y = _hopfield_views(image_features, text_features, beta, extra_image_stored, extra_text_stored)
    return 0.5 * (_infonce_from_logits(_logits(u_x, u_y, inv_tau)) + _infonce_from_logits(_logits(v_y, v_x, inv_tau)))


class ContrastiveObjective(nn.Module):
    """Shared signature of every objective: ``(image_features, text_features, inv_tau) -> scalar loss``.

    Subclasses implement :meth:`compute` on the global batch; this class gathers the features of all ranks
    with gradient when ``torch.distributed`` is initialised, so the math never sees the distribution.
    """

    name: str = ""

    def compute(
        self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor, **memories: Tensor | None
    ) -> Tensor:
        raise NotImplementedError

    def forward(
        self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor, **memories: Tensor | None
    ) -> Tensor:
        image_features, text_features = gather_features(image_features, text_features)
        return self.compute(image_features, text_features, inv_tau, **memories)

    def extra_repr(self) -> str:
        return f"name={self.name!r}"


class ClipLoss(ContrastiveObjective):
    """CLIP's symmetric InfoNCE (the paper's baseline)."""

    name = "clip"

    def compute(self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor) -> Tensor:
        return infonce_loss(image_features, text_features, inv_tau)


class InfoLOOBLoss(ContrastiveObjective):
    """InfoLOOB without Hopfield retrieval (ablation "InfoLOOB")."""

    name = "infoloob"

    def compute(self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor) -> Tensor:
        return infoloob_loss(image_features, text_features, inv_tau)


class _HopfieldObjective(ContrastiveObjective):
    """An objective over Hopfield-retrieved embeddings, with inverse temperature ``beta`` of the memories."""

    loss_fn: Callable[..., Tensor]

    def __init__(self, beta: float = 8.0) -> None:
        super().__init__()
        if not beta > 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        self.beta = float(beta)

    def compute(
        self,
        image_features: Tensor,
        text_features: Tensor,
        inv_tau: float | Tensor,
        extra_image_stored: Tensor | None = None,
        extra_text_stored: Tensor | None = None,
    ) -> Tensor:
        """Extra stored patterns (prototypes, a queue) join the memories as given; they are not gathered
        across ranks, since a caller that keeps them holds the same global copy on every rank."""
        return type(self).loss_fn(
            image_features, text_features, inv_tau, self.beta, extra_image_stored, extra_text_stored
        )

    def extra_repr(self) -> str:
        return f"name={self.name!r}, beta={self.beta}"


class CLOOBLoss(_HopfieldObjective):
    """CLOOB: modern Hopfield retrieval plus InfoLOOB (Eq. 5)."""

    name = "cloob"
    loss_fn = staticmethod(cloob_loss)


class HopfieldInfoNCELoss(_HopfieldObjective):
    """Ablation "InfoNCE with Hopfield": retrieval as in CLOOB, CLIP's InfoNCE as objective."""

    name = "infonce_hopfield"
    loss_fn = staticmethod(infonce_hopfield_loss)


OBJECTIVES: dict[str, type[ContrastiveObjective]] = {
    cls.name: cls for cls in (ClipLoss, InfoLOOBLoss, HopfieldInfoNCELoss, CLOOBLoss)
}
if set(OBJECTIVES) != set(OBJECTIVE_NAMES):
    raise ImportError(f"config.OBJECTIVE_NAMES {OBJECTIVE_NAMES} must list the registry {sorted(OBJECTIVES)}")


def build_objective(name: str, **options: Any) -> ContrastiveObjective:
    """Instantiate an objective of the registry by name; unknown names and options fail loudly."""
    try:
        cls = OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; choose one of {sorted(OBJECTIVES)}") from None
    if not issubclass(cls, _HopfieldObjective):
        options.pop("beta", None)  # beta parameterises the Hopfield memories only
    try:
        return cls(**options)
    except TypeError as err:
        raise ValueError(f"objective {name!r} does not take options {sorted(options)}: {err}") from None
