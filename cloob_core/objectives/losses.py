"""Contrastive objectives of the CLOOB paper, written as the equations read.

Equation numbers refer to Fürst et al., "CLOOB: Modern Hopfield Networks with InfoLOOB Outperform CLIP"
(NeurIPS 2022). Every function takes embeddings that are already L2-normalised, shape ``[N, d]``, and does
not re-normalise them, so values and gradients are exactly those of the formulas.

The pure functions hold the math. The ``nn.Module`` classes share one call signature,
``objective(image_features, text_features, inv_tau)``, and add only the distribution policy: with
``torch.distributed`` initialised they gather the features of all ranks *with gradient* first
(see :mod:`cloob_core.objectives.distributed`), so the loss is always that of the global batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cloob_core.objectives import polyview
from cloob_core.objectives.anchors import EVERY_ROW, Anchors
from cloob_core.objectives.distributed import gather_features, is_distributed, local_anchors, mean_over_ranks
from cloob_core.objectives.names import OBJECTIVES
from cloob_core.objectives.negatives import Band, BandSchedule, EmbeddingQueue, band_columns
from cloob_core.objectives.start import RetrievalStart

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


def _started(objective: Any, loss: Tensor, batch: int, inv_tau: float | Tensor, anchors: Anchors) -> Tensor:
    """A Hopfield objective's loss without retrieval, recorded once per step against the collapsed value of the
    global batch: under ``train.local_loss`` each rank's share is averaged over the ranks first, so every rank
    switches at the same step. ``inv_tau`` stays a tensor on its device (no host read)."""
    start = objective.retrieval_start
    if start.wants_margin():
        value = loss.detach().float()
        if not anchors.every_row:
            value = mean_over_ranks(value)
        inv_tau = inv_tau.detach() if isinstance(inv_tau, Tensor) else inv_tau
        start.record(value, objective.collapsed_loss(batch, inv_tau))
    return loss


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


def _positive_mask(logits: Tensor, offset: int) -> Tensor:
    """``[n, C]``, True at each anchor's positive: row i's is column ``offset + i``."""
    mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    mask.diagonal(offset).fill_(True)
    return mask


def _loob_rows(logits: Tensor, offset: int) -> Tensor:
    """Leave-one-out bound of anchors on the rows of ``[n, C]`` logits, row i's positive at column offset + i."""
    negatives = torch.logsumexp(logits.masked_fill(_positive_mask(logits, offset), float("-inf")), dim=1)
    return (negatives - logits.diagonal(offset)).mean()


def _infonce_rows(logits: Tensor, offset: int) -> Tensor:
    """InfoNCE of anchors on the rows of ``[n, C]`` logits, row i's positive at column offset + i."""
    return (torch.logsumexp(logits, dim=1) - logits.diagonal(offset)).mean()


def infonce_loss(image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor,
                 anchors: Anchors = EVERY_ROW) -> Tensor:
    """CLIP's symmetric InfoNCE: Eq. (7) halved, i.e. the mean of the image->text and text->image
    cross-entropies over ``inv_tau * x @ y.T`` (the terms of ``anchors``' rows: :mod:`.anchors`)."""
    _check_pair(image_features, text_features, min_batch=1)
    if not anchors.every_row:
        rows, offset = anchors.rows, anchors.start
        return 0.5 * (_infonce_rows(_logits(image_features[rows], text_features, inv_tau), offset)
                      + _infonce_rows(_logits(text_features[rows], image_features, inv_tau), offset))
    logits = _logits(image_features, text_features, inv_tau)
    return 0.5 * (_infonce_from_logits(logits, dim=1) + _infonce_from_logits(logits, dim=0))


def infoloob_loss(image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor,
                  anchors: Anchors = EVERY_ROW) -> Tensor:
    """InfoLOOB without Hopfield, scaled by tau: ``tau * [LOOB(x->y) + LOOB(y->x)]`` (Eq. 8).

    The scaling by ``tau = 1 / inv_tau`` removes the factor ``inv_tau`` from the gradients (paper §5.1,
    App. A.1.4). One similarity matrix serves both directions: rows anchor on images, columns on texts.
    """
    _check_pair(image_features, text_features, min_batch=2)
    if not anchors.every_row:
        rows, offset = anchors.rows, anchors.start
        return (_loob_rows(_logits(image_features[rows], text_features, inv_tau), offset)
                + _loob_rows(_logits(text_features[rows], image_features, inv_tau), offset)) / inv_tau
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


def _anchored_hopfield_views(
    image_features: Tensor,
    text_features: Tensor,
    beta: float | Tensor,
    extra_image_stored: Tensor | None,
    extra_text_stored: Tensor | None,
    anchors: Anchors,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Eq. (5)'s retrievals for the anchors' rows only, each against the whole memory: U_x and V_y of the anchors
    (they anchor the two LOOB terms), U_y and V_x retrieved for the anchors' texts and images and then gathered
    (``anchors.gather``) into the whole batch's, the terms' candidates."""
    x, y = image_features, text_features
    stored_u = x if extra_image_stored is None else torch.cat([x, extra_image_stored])
    stored_v = y if extra_text_stored is None else torch.cat([y, extra_text_stored])
    x_a, y_a = x[anchors.rows], y[anchors.rows]
    u_x, v_y = hopfield_retrieval(x_a, stored_u, beta), hopfield_retrieval(y_a, stored_v, beta)
    u_y = anchors.gather(hopfield_retrieval(y_a, stored_u, beta))
    v_x = anchors.gather(hopfield_retrieval(x_a, stored_v, beta))
    return u_x, u_y, v_x, v_y


def cloob_loss(
    image_features: Tensor,
    text_features: Tensor,
    inv_tau: float | Tensor,
    beta: float | Tensor,
    extra_image_stored: Tensor | None = None,
    extra_text_stored: Tensor | None = None,
    anchors: Anchors = EVERY_ROW,
) -> Tensor:
    """CLOOB, Eq. (5) scaled by tau: ``tau * [LOOB(U_x, U_y) + LOOB(V_y, V_x)]``.

    The first term anchors on image-retrieved image embeddings U_x against text-retrieved ones U_y; the
    second anchors on text-retrieved text embeddings V_y against image-retrieved ones V_x, exactly as the
    paper's pseudocode (``loss = (info_loob(U_x, U_y) + info_loob(V_y, V_x)) * tau``).
    """
    _check_pair(image_features, text_features, min_batch=2)
    if not anchors.every_row:
        u_x, u_y, v_x, v_y = _anchored_hopfield_views(image_features, text_features, beta, extra_image_stored,
                                                      extra_text_stored, anchors)
        return (_loob_rows(_logits(u_x, u_y, inv_tau), anchors.start)
                + _loob_rows(_logits(v_y, v_x, inv_tau), anchors.start)) / inv_tau
    u_x, u_y, v_x, v_y = _hopfield_views(image_features, text_features, beta, extra_image_stored, extra_text_stored)
    return (loob(u_x, u_y, inv_tau) + loob(v_y, v_x, inv_tau)) / inv_tau


def infonce_hopfield_loss(
    image_features: Tensor,
    text_features: Tensor,
    inv_tau: float | Tensor,
    beta: float | Tensor,
    extra_image_stored: Tensor | None = None,
    extra_text_stored: Tensor | None = None,
    anchors: Anchors = EVERY_ROW,
) -> Tensor:
    """The paper's ablation "InfoNCE with Hopfield": CLOOB's retrieved embeddings with CLIP's InfoNCE,
    i.e. the mean of the cross-entropies of (U_x anchors, U_y samples) and (V_y anchors, V_x samples)."""
    _check_pair(image_features, text_features, min_batch=1)
    if not anchors.every_row:
        u_x, u_y, v_x, v_y = _anchored_hopfield_views(image_features, text_features, beta, extra_image_stored,
                                                      extra_text_stored, anchors)
        return 0.5 * (_infonce_rows(_logits(u_x, u_y, inv_tau), anchors.start)
                      + _infonce_rows(_logits(v_y, v_x, inv_tau), anchors.start))
    u_x, u_y, v_x, v_y = _hopfield_views(image_features, text_features, beta, extra_image_stored, extra_text_stored)
    return 0.5 * (_infonce_from_logits(_logits(u_x, u_y, inv_tau)) + _infonce_from_logits(_logits(v_y, v_x, inv_tau)))


def restricted_terms(
    anchors: Tensor,
    candidates: Tensor,
    inv_tau: float | Tensor,
    band: Band,
    leave_one_out: bool = False,
    rank_by: Tensor | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """Per-anchor losses and denominator sizes of one direction with negatives restricted to ``band``
    (Wu et al.'s BALL / RING): ``-ln( e^{s_ii} / sum_{j in D_i} e^{s_ij} )`` where ``D_i`` is the positive plus
    the eligible negatives (InfoNCE), or the eligible negatives alone (``leave_one_out``: InfoLOOB, Eq. 8).

    ``candidates`` ``[C >= A, d]`` hold the anchors' positives in rows ``offset`` to ``offset + A`` (the anchors'
    rows of the batch: :mod:`.anchors`); further rows (a queue) are negatives only. Negatives are ranked by
    ``rank_by`` (``[A, C]`` similarities; default: these logits) and the excluded ones are masked with ``-inf``,
    so they add nothing to the value and receive exactly zero gradient. Returns (losses ``[A]``, ``K`` ``[A]``:
    terms in each denominator)."""
    if anchors.ndim != 2 or candidates.ndim != 2 or candidates.shape[0] < offset + anchors.shape[0]:
        raise ValueError(f"expected anchors [A, d] and candidates [C >= A, d], got {tuple(anchors.shape)} and "
                         f"{tuple(candidates.shape)}")
    if anchors.shape[0] < 2:
        raise ValueError("restricted negatives need a batch of at least 2 pairs")
    logits = _logits(anchors, candidates, inv_tau)
    positives = logits.diagonal(offset)
    columns = band_columns(logits if rank_by is None else rank_by, band, offset)
    if columns is None:  # the full band: the plain denominators
        terms = logits.masked_fill(_positive_mask(logits, offset), float("-inf")) if leave_one_out else logits
        count = logits.shape[1] - (1 if leave_one_out else 0)
    else:  # only the kept terms: the others take no part in the value and get exactly zero gradient
        terms = logits.gather(1, columns)
        if not leave_one_out:
            terms = torch.cat([positives[:, None], terms], dim=1)
        count = terms.shape[1]
    counts = torch.full((anchors.shape[0],), count, dtype=torch.long, device=logits.device)
    return torch.logsumexp(terms, dim=1) - positives, counts


def restricted_infonce_loss(
    image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor, band: Band
) -> Tensor:
    """Symmetric InfoNCE with BALL / RING negatives (in-batch candidates); with ``Band(0, 1)`` it is
    :func:`infonce_loss` exactly."""
    _check_pair(image_features, text_features, min_batch=2)
    return 0.5 * (restricted_terms(image_features, text_features, inv_tau, band)[0].mean()
                  + restricted_terms(text_features, image_features, inv_tau, band)[0].mean())


def siglip_loss(image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor, logit_bias: float | Tensor,
                anchors: Anchors = EVERY_ROW) -> Tensor:
    """SigLIP's sigmoid loss (Zhai et al. 2023, Eq. 1): ``-1/|B| sum_i sum_j log sigmoid(z_ij (t x_i.y_j + b))``,
    ``z_ij = 1`` for a pair (i = j) and -1 otherwise, ``t = inv_tau``, ``b`` the learnable bias. Every pair is a
    binary term of its own, so the image rows of ``anchors`` against every text are a rank's whole share of the
    sum: with ``train.local_loss`` no rank forms the N x N matrix."""
    _check_pair(image_features, text_features, min_batch=1)
    logits = _logits(image_features[anchors.rows], text_features, inv_tau) + logit_bias
    signs = torch.where(_positive_mask(logits, anchors.start), 1.0, -1.0).to(logits.dtype)
    return -F.logsigmoid(signs * logits).sum(dim=1).mean()


def infonce_collapsed(batch: int) -> float:
    """InfoNCE's value when every similarity of the batch is the same (complete collapse): ``ln N``."""
    return math.log(batch)


def infoloob_collapsed(batch: int, inv_tau: float) -> float:
    """InfoLOOB's and CLOOB's value at complete collapse, ``2 ln(N - 1) / inv_tau``: each of the two LOOB terms
    is ``ln(N - 1)`` (N - 1 equal negatives against an equal positive), scaled by tau. Hopfield retrieval from a
    memory of identical patterns returns that pattern, so CLOOB's retrieved embeddings collapse with the
    encoders' and its value is InfoLOOB's."""
    return 2.0 * math.log(batch - 1) / inv_tau


def siglip_collapsed(batch: int) -> float:
    """SigLIP's least value when every logit is the same: ``-[ln p + (N - 1) ln(1 - p)]`` is least at ``p = 1/N``,
    ``ln N + (N - 1) ln(N / (N - 1))``. Its bias is learnt, so a collapsed model reaches this constant, whatever
    the bias it started from; a model that scores pairs above non-pairs goes below it."""
    return math.log(batch) + (batch - 1) * math.log(batch / (batch - 1))


class ContrastiveObjective(nn.Module):
    """Shared signature of every objective: ``(image_features, text_features, inv_tau) -> scalar loss``.

    Subclasses implement :meth:`compute` on the global batch; this class gathers the features of all ranks
    with gradient when ``torch.distributed`` is initialised, so the math never sees the distribution.
    """

    name: str = ""  # set from the registry (cloob_core.objectives.registry)
    takes_beta = False  # the Hopfield memories' inverse temperature
    takes_band = False  # the restricted-negative band and queue
    takes_leave_one_out = False
    takes_bias = False  # SigLIP's learnable logit bias: a parameter of the objective, trained with the model
    local_loss = False  # train.local_loss: each rank computes its own rows' terms (set by the registry)

    def compute(
        self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor, anchors: Anchors = EVERY_ROW,
        **memories: Tensor | None
    ) -> Tensor:
        raise NotImplementedError

    def anchors(self, local_rows: int) -> Anchors:
        return local_anchors(local_rows) if self.local_loss and is_distributed() else EVERY_ROW

    def forward(
        self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor, **memories: Tensor | None
    ) -> Tensor:
        anchors = self.anchors(image_features.shape[0])
        image_features, text_features = gather_features(image_features, text_features)
        return self.compute(image_features, text_features, inv_tau, anchors, **memories)

    def collapsed_loss(self, batch: int, inv_tau: float) -> float:
        """The loss of a global batch of ``batch`` samples at complete collapse, every embedding the same (so every
        similarity too): what a run stuck in the collapsed fixed point logs, the reference of the collapse
        detector (:mod:`cloob_core.training.collapse`). Here: the objective evaluated on such a batch, in float64;
        the objectives with a closed form override it with that."""
        views = (getattr(self, "image_views", 1), getattr(self, "text_views", 1))
        image, text = (torch.ones(batch * v, 1, dtype=torch.float64) for v in views)
        with torch.no_grad():
            return float(self.compute(image, text, float(inv_tau)))

    def end_step(self) -> None:
        """Called once per optimiser step, after the (accumulated) backward: stateful objectives advance
        their schedules and queues here, never between the micro-batches of one step."""

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint must keep for an exact resume (tensors and numbers only: loaded weights-only)."""
        return {}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"objective {self.name!r} keeps no state, but the checkpoint has {sorted(state)}")

    def extra_repr(self) -> str:
        return f"name={self.name!r}"


class ClipLoss(ContrastiveObjective):
    """CLIP's symmetric InfoNCE (the paper's baseline)."""

    def collapsed_loss(self, batch: int, inv_tau: float) -> float:
        return infonce_collapsed(batch)

    def compute(self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor,
                anchors: Anchors = EVERY_ROW) -> Tensor:
        return infonce_loss(image_features, text_features, inv_tau, anchors)


class InfoLOOBLoss(ContrastiveObjective):
    """InfoLOOB without Hopfield retrieval (ablation "InfoLOOB")."""

    def collapsed_loss(self, batch: int, inv_tau: float) -> float:
        return infoloob_collapsed(batch, inv_tau)

    def compute(self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor,
                anchors: Anchors = EVERY_ROW) -> Tensor:
        return infoloob_loss(image_features, text_features, inv_tau, anchors)


class _HopfieldObjective(ContrastiveObjective):
    """An objective over Hopfield-retrieved embeddings, with inverse temperature ``beta`` of the memories.

    The start (:mod:`cloob_core.objectives.start`): its first ``start_without_hopfield`` steps compute the same
    objective on the encoders' embeddings, without retrieval (``plain_fn``: InfoLOOB for CLOOB), and the next ones
    too until a batch is ``start_until_margin`` below the collapsed value, up to ``start_longest`` steps. Towers that
    start in a narrow cone (ViTs, RN50) give Hopfield retrieval nearly identical patterns, which it averages into
    one vector: the loss is then at its collapsed value and its gradient hundreds of times smaller than InfoLOOB's,
    and AdamW's normalised steps, guided by that noise, carry the run into the collapsed fixed point
    (docs/objectives.md, "Collapse")."""

    loss_fn: Callable[..., Tensor]
    plain_fn: Callable[..., Tensor]
    takes_beta = True

    def __init__(self, beta: float = 8.0, start_without_hopfield: int = 0, start_until_margin: float = 0.0,
                 start_longest: int | None = None) -> None:
        super().__init__()
        if not beta > 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        self.beta = float(beta)
        self.retrieval_start = RetrievalStart(start_without_hopfield, start_until_margin, start_longest)

    @property
    def retrieving(self) -> bool:
        """Whether this step's loss goes through Hopfield retrieval."""
        return self.retrieval_start.retrieving

    def end_step(self) -> None:
        self.retrieval_start.end_step()

    def checkpoint_state(self) -> dict[str, Any]:
        return self.retrieval_start.state()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.retrieval_start.load(state)

    def compute(
        self,
        image_features: Tensor,
        text_features: Tensor,
        inv_tau: float | Tensor,
        anchors: Anchors = EVERY_ROW,
        extra_image_stored: Tensor | None = None,
        extra_text_stored: Tensor | None = None,
    ) -> Tensor:
        """Extra stored patterns (prototypes, a queue) join the memories as given; they are not gathered
        across ranks, since a caller that keeps them holds the same global copy on every rank."""
        if not self.retrieving:
            return _started(self, type(self).plain_fn(image_features, text_features, inv_tau, anchors),
                            image_features.shape[0], inv_tau, anchors)
        return type(self).loss_fn(
            image_features, text_features, inv_tau, self.beta, extra_image_stored, extra_text_stored, anchors
        )

    def extra_repr(self) -> str:
        return f"name={self.name!r}, beta={self.beta}, {self.retrieval_start!r}"


class CLOOBLoss(_HopfieldObjective):
    """CLOOB: modern Hopfield retrieval plus InfoLOOB (Eq. 5)."""

    loss_fn = staticmethod(cloob_loss)
    plain_fn = staticmethod(infoloob_loss)

    def collapsed_loss(self, batch: int, inv_tau: float) -> float:
        return infoloob_collapsed(batch, inv_tau)


class HopfieldInfoNCELoss(_HopfieldObjective):
    """Ablation "InfoNCE with Hopfield": retrieval as in CLOOB, CLIP's InfoNCE as objective."""

    loss_fn = staticmethod(infonce_hopfield_loss)
    plain_fn = staticmethod(infonce_loss)

    def collapsed_loss(self, batch: int, inv_tau: float) -> float:
        return infonce_collapsed(batch)


class _RestrictedObjective(ContrastiveObjective):
    """Negatives restricted to an annealed band, candidates from the batch plus an optional queue of past
    embeddings. ``ranking``: ``loss`` ranks by the similarities the loss uses (Hopfield-retrieved for CLOOB),
    ``raw`` by the encoders' embeddings. The step counter and the queue are checkpointed."""

    leave_one_out = False
    takes_band = True

    def __init__(self, p_in: float = 0.0, p_out: float = 0.1, anneal_steps: int = 0, anneal_inner: bool = False,
                 queue_size: int = 0, ranking: str = "loss") -> None:
        super().__init__()
        if ranking not in ("loss", "raw"):
            raise ValueError(f"ranking must be 'loss' or 'raw', got {ranking!r}")
        self.schedule = BandSchedule(p_in, p_out, anneal_steps, anneal_inner)
        self.queue = EmbeddingQueue(queue_size)
        self.ranking = ranking
        self.step = 0
        self._last: tuple[Tensor, Tensor] | None = None

    @property
    def band(self) -> Band:
        return self.schedule.at(self.step)

    def forward(self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor,
                **memories: Tensor | None) -> Tensor:
        anchors = self.anchors(image_features.shape[0])
        image_features, text_features = gather_features(image_features, text_features)
        self._last = (image_features.detach(), text_features.detach())
        return self.compute(image_features, text_features, inv_tau, anchors, **memories)

    def candidates(self, image_features: Tensor, text_features: Tensor) -> tuple[Tensor, Tensor]:
        """(image candidates, text candidates): the batch, then the queue (detached, oldest last)."""
        if len(self.queue) == 0:
            return image_features, text_features
        queued_image = self.queue.image.to(image_features.device, image_features.dtype)
        queued_text = self.queue.text.to(text_features.device, text_features.dtype)
        return torch.cat([image_features, queued_image]), torch.cat([text_features, queued_text])

    def end_step(self) -> None:
        if self._last is not None:
            self.queue.push(*self._last)
            self._last = None
        self.step += 1

    def checkpoint_state(self) -> dict[str, Any]:
        return {"step": self.step, "queue": self.queue.state()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.step = int(state.get("step", 0))
        self.queue.load(state.get("queue", {}))

    def collapsed_loss(self, batch: int, inv_tau: float) -> float:
        """At collapse every kept term is equal: each anchor's denominator holds the band's K negatives of its
        ``batch - 1 + queued`` candidates (and the positive, for InfoNCE), at the current step's band."""
        start, stop = self.band.limits(batch - 1 + len(self.queue))
        kept = stop - start
        return 2.0 * math.log(kept) / inv_tau if self.leave_one_out else math.log(kept + 1)

    def _direction(self, anchors: Tensor, candidates: Tensor, inv_tau: float | Tensor,
                   raw_anchors: Tensor, raw_candidates: Tensor, offset: int) -> Tensor:
        rank_by = raw_anchors @ raw_candidates.T if self.ranking == "raw" else None
        return restricted_terms(anchors, candidates, inv_tau, self.band, self.leave_one_out, rank_by,
                                offset)[0].mean()

    def extra_repr(self) -> str:
        s = self.schedule
        return (f"name={self.name!r}, p_in={s.p_in}, p_out={s.p_out}, anneal_steps={s.anneal_steps}, "
                f"queue={self.queue.size}, ranking={self.ranking!r}")


class ClipRingLoss(_RestrictedObjective):
    """CLIP's InfoNCE with BALL / RING negatives (Wu et al.): ``objective.p_in = 0`` is BALL."""


    def compute(self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor,
                anchors: Anchors = EVERY_ROW) -> Tensor:
        """Both directions over the embeddings themselves: their mean (InfoNCE), or with the leave-one-out
        denominator their sum scaled by tau (InfoLOOB, Eq. 8)."""
        _check_pair(image_features, text_features, min_batch=2)
        images, texts = self.candidates(image_features, text_features)
        x, y, offset = image_features[anchors.rows], text_features[anchors.rows], anchors.start
        total = (self._direction(x, texts, inv_tau, x, texts, offset)
                 + self._direction(y, images, inv_tau, y, images, offset))
        return total / inv_tau if self.leave_one_out else 0.5 * total


class InfoLOOBRingLoss(ClipRingLoss):
    """InfoLOOB (leave-one-out denominator, scaled by tau) with BALL / RING negatives."""

    leave_one_out = True


class CLOOBRingLoss(_RestrictedObjective):
    """CLOOB (Eq. 5) with BALL / RING negatives. Queued embeddings are retrieved from the current batch's
    memories like the batch's own (U for texts, V for images) but never join a memory."""

    leave_one_out = True
    takes_beta = True

    def __init__(self, beta: float = 8.0, start_without_hopfield: int = 0, start_until_margin: float = 0.0,
                 start_longest: int | None = None, **band: Any) -> None:
        super().__init__(**band)
        if not beta > 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        self.beta = float(beta)
        self.retrieval_start = RetrievalStart(start_without_hopfield, start_until_margin, start_longest)

    def end_step(self) -> None:
        super().end_step()
        self.retrieval_start.end_step()

    def checkpoint_state(self) -> dict[str, Any]:
        return {**super().checkpoint_state(), "start": self.retrieval_start.state()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        start = state.pop("start", {"step": state.get("step", 0)})
        super().load_checkpoint_state(state)
        self.retrieval_start.load(start)

    def compute(self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor,
                anchors: Anchors = EVERY_ROW) -> Tensor:
        """As :class:`CLOOBLoss`: InfoLOOB's with the same band until the start ends."""
        if not self.retrieval_start.retrieving:
            return _started(self, InfoLOOBRingLoss.compute(self, image_features, text_features, inv_tau, anchors),
                            image_features.shape[0], inv_tau, anchors)
        _check_pair(image_features, text_features, min_batch=2)
        x, y = image_features, text_features
        if anchors.every_row:
            u_x, u_y, v_x, v_y = _hopfield_views(x, y, self.beta, None, None)
        else:
            u_x, u_y, v_x, v_y = _anchored_hopfield_views(x, y, self.beta, None, None, anchors)
        images, texts = self.candidates(x, y)
        if len(self.queue):
            queued_x, queued_y = images[x.shape[0]:], texts[y.shape[0]:]
            u_y = torch.cat([u_y, hopfield_retrieval(queued_y, x, self.beta)])
            v_x = torch.cat([v_x, hopfield_retrieval(queued_x, y, self.beta)])
        rows, offset = anchors.rows, anchors.start
        return (self._direction(u_x, u_y, inv_tau, x[rows], texts, offset)
                + self._direction(v_y, v_x, inv_tau, y[rows], images, offset)) / inv_tau

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, beta={self.beta}, {self.retrieval_start!r}"


class _PolyViewObjective(ContrastiveObjective):
    """A poly-view objective over ``image_views`` image and ``text_views`` text embeddings per sample, laid
    out sample-major (``[K * M, d]``: sample 0's views, then sample 1's, ...), as the training loader
    produces them. ``leave_one_out`` swaps in CLOOB's InfoLOOB denominator (scaled by tau as InfoLOOB is); the
    MI bounds of the paper do not hold then (see :mod:`cloob_core.objectives.polyview`)."""

    loss_fn: Callable[..., Tensor]
    takes_leave_one_out = True

    def __init__(self, image_views: int = 1, text_views: int = 1, leave_one_out: bool = False) -> None:
        super().__init__()
        if image_views < 1 or text_views < 1:
            raise ValueError(f"views must be >= 1, got image_views={image_views}, text_views={text_views}")
        if leave_one_out and not self.takes_leave_one_out:
            raise ValueError(f"objective {self.name!r} has no leave-one-out form")
        self.image_views, self.text_views, self.leave_one_out = image_views, text_views, leave_one_out

    def split_views(self, image_features: Tensor, text_features: Tensor) -> tuple[Tensor, Tensor]:
        n_image, n_text = image_features.shape[0], text_features.shape[0]
        if n_image % self.image_views or n_text % self.text_views or (
                n_image // self.image_views != n_text // self.text_views):
            raise ValueError(f"{n_image} image and {n_text} text embeddings do not split into the same number of "
                             f"samples of {self.image_views} image and {self.text_views} text views")
        samples = n_image // self.image_views
        return (image_features.reshape(samples, self.image_views, -1),
                text_features.reshape(samples, self.text_views, -1))

    def compute(self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor,
                anchors: Anchors = EVERY_ROW) -> Tensor:
        image_views, text_views = self.split_views(image_features, text_features)
        samples = anchors.per(self.image_views)  # the anchors' rows are image rows, sample-major
        if not self.takes_leave_one_out:
            return type(self).loss_fn(image_views, text_views, inv_tau, anchors=samples)
        loss = type(self).loss_fn(image_views, text_views, inv_tau, self.leave_one_out, anchors=samples)
        return 2.0 * loss / inv_tau if self.leave_one_out else loss

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, image_views={self.image_views}, text_views={self.text_views}, "
                f"leave_one_out={self.leave_one_out}")


class GeometricPVCLoss(_PolyViewObjective):
    """Geometric poly-view contrastive loss (Shidani et al. Eq. 10): the tightest MI bound in their study."""

    loss_fn = staticmethod(polyview.geometric_pvc_loss)


class ArithmeticPVCLoss(_PolyViewObjective):
    """Arithmetic poly-view contrastive loss (Shidani et al. Eq. 9)."""

    loss_fn = staticmethod(polyview.arithmetic_pvc_loss)


class MultiCropLoss(_PolyViewObjective):
    """Multi-Crop: the average of the two-view losses of all (image view, text view) pairs."""

    loss_fn = staticmethod(polyview.multicrop_loss)


class SufficientStatisticsLoss(_PolyViewObjective):
    """Sufficient-statistics contrastive loss (Shidani et al. Eq. 22, mean-pooled Q)."""

    loss_fn = staticmethod(polyview.sufficient_statistics_loss)
    takes_leave_one_out = False


class SigLipLoss(ContrastiveObjective):
    """SigLIP (Zhai et al. 2023): the pairwise sigmoid loss, with its learnable bias ``b`` a parameter of this
    module. The training loop gives the optimiser the objective's parameters beside the model's, averages their
    gradients over the ranks, and a checkpoint keeps the bias (exact resume); the export records it in
    ``model_info.json``, as a ranking does not depend on it."""

    takes_bias = True

    def __init__(self, bias_init: float = -10.0) -> None:
        super().__init__()
        self.logit_bias = nn.Parameter(torch.tensor(float(bias_init)))

    def compute(self, image_features: Tensor, text_features: Tensor, inv_tau: float | Tensor,
                anchors: Anchors = EVERY_ROW) -> Tensor:
        return siglip_loss(image_features, text_features, inv_tau, self.logit_bias, anchors)

    def collapsed_loss(self, batch: int, inv_tau: float) -> float:
        return siglip_collapsed(batch)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"logit_bias": self.logit_bias.detach().clone()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.logit_bias.copy_(state["logit_bias"])

    def extra_repr(self) -> str:
        return f"name={self.name!r}, logit_bias={float(self.logit_bias):.4g}"


def _name_the_classes() -> None:
    """Each class takes its registry name; the registry's poly-view flags must match the classes."""
    for name, entry in OBJECTIVES.items():
        cls = globals()[entry.class_name]
        if issubclass(cls, _PolyViewObjective) != entry.poly_view:
            raise ImportError(f"registry entry {name!r}: poly_view={entry.poly_view} does not match {cls.__name__}")
        cls.name = name


_name_the_classes()

