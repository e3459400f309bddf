"""Poly-view contrastive objectives (Shidani et al., "Poly-View Contrastive Learning", ICLR 2024), cross-modal.

Each of K samples has ``Mx`` image views and ``My`` text views (augmentations, several captions), embedded as
``[K, Mx, d]`` and ``[K, My, d]``. The positives of an image view are the text views of the same sample and vice
versa; the candidates of an anchor are every view of the *other* modality: the positive and all views of the
other samples. The other views of the anchor's own sample in the candidate modality are masked out of the
denominator, as Eq. 14 prescribes (they are neither the positive nor a negative).

``log_ell`` below is ``log l_{i,alpha,beta}`` of Eq. 14: anchored at view ``beta`` of sample ``i`` (one
modality), positive view ``alpha`` of sample ``i`` (the other):

    l_{i,a,b} = e^{s(a,b)} / ( e^{s(a,b)} + sum_{j != i} sum_gamma e^{s((j,gamma), b)} ),  s = inv_tau * dot.

- Geometric PVC (Eq. 10, Thm. 2.2): ``-mean_{i,a,b} log l_{i,a,b}``.
- Arithmetic PVC (Eq. 9, Thm. 2.2): ``-mean_{i,a} log( mean_b l_{i,a,b} )`` (from the equations; the paper's
  Algorithm 1 gets this branch wrong).
- Multi-Crop (Eq. 1): the mean over view pairs (a, b) of the two-view loss on views a and b alone.
- Sufficient statistics (Eq. 22, 24): each view against the mean embedding ``Q`` of the other modality's views
  of every sample, ``-mean log( e^{T.Q_i} / sum_j e^{T.Q_j} )``; each other sample counts once.

Bounds: with the InfoNCE denominator, Geometric and Arithmetic PVC give ``I(x_a; rest) >= c(B, M) - L`` with
``c(B, M) = log(B - M + 1)``, ``B = K * M`` candidate views (Thm. 2.2), and their gap does not grow with M
(Thm. 2.3). Sufficient statistics as built here (one mean per other sample, K candidates) is InfoNCE against
that statistic: ``log K - L`` bounds I(view; the other modality's views). Multi-Crop keeps the two-view bound
``log K - L`` whatever M (Prop. 2.1; it lowers the variance only). With ``leave_one_out`` (CLOOB's InfoLOOB
denominator, positive left out) none of these bounds holds: InfoLOOB is not a lower bound on MI.
At M = 1 view per modality, Geometric = Arithmetic = sufficient statistics = Multi-Crop = CLIP's symmetric
InfoNCE (and their leave-one-out forms = InfoLOOB).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cloob_core.objectives.anchors import EVERY_ROW, Anchors


def check_views(image_views: Tensor, text_views: Tensor) -> None:
    if image_views.ndim != 3 or text_views.ndim != 3:
        raise ValueError(f"expected views [K, M, d], got {tuple(image_views.shape)} and {tuple(text_views.shape)}")
    if image_views.shape[0] != text_views.shape[0] or image_views.shape[2] != text_views.shape[2]:
        raise ValueError(f"image and text views must share K and d: {tuple(image_views.shape)} vs "
                         f"{tuple(text_views.shape)}")
    if image_views.shape[0] < 2:
        raise ValueError("poly-view objectives need at least 2 samples")


def _promote(logits: Tensor) -> Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def log_ell(anchor_views: Tensor, candidate_views: Tensor, inv_tau: float | Tensor,
            leave_one_out: bool = False, offset: int = 0) -> Tensor:
    """``log l_{i,a,b}`` of Eq. 14 as ``[k, Mb, Ma]``: anchor view ``b`` (of ``anchor_views [k, Mb, d]``) of
    sample i, positive view ``a`` (of ``candidate_views [K, Ma, d]``) of the same sample, which is candidate
    sample ``offset + i`` (the anchors may be some samples of the batch: :mod:`.anchors`)."""
    k, m_anchor, d = anchor_views.shape
    samples, m_cand = candidate_views.shape[:2]
    logits = _promote(inv_tau * (anchor_views.reshape(k * m_anchor, d)
                                 @ candidate_views.reshape(samples * m_cand, d).T))
    logits = logits.reshape(k, m_anchor, samples, m_cand)
    same = torch.zeros(k, samples, dtype=torch.bool, device=logits.device)
    same.diagonal(offset).fill_(True)
    negatives = torch.logsumexp(logits.masked_fill(same[:, None, :, None], float("-inf"))
                                .reshape(k, m_anchor, samples * m_cand), dim=-1)
    rows = torch.arange(k, device=logits.device)
    positives = logits[rows, :, rows + offset, :]  # [k, Mb, Ma]
    denominator = negatives[..., None] if leave_one_out else torch.logaddexp(positives, negatives[..., None])
    return positives - denominator


def geometric_pvc_loss(image_views: Tensor, text_views: Tensor, inv_tau: float | Tensor,
                       leave_one_out: bool = False, anchors: Anchors = EVERY_ROW) -> Tensor:
    """Geometric PVC, both directions averaged (the terms of the ``anchors``' samples)."""
    check_views(image_views, text_views)
    rows, offset = anchors.rows, anchors.start
    return -0.5 * (log_ell(text_views[rows], image_views, inv_tau, leave_one_out, offset).mean()
                   + log_ell(image_views[rows], text_views, inv_tau, leave_one_out, offset).mean())


def arithmetic_pvc_loss(image_views: Tensor, text_views: Tensor, inv_tau: float | Tensor,
                        leave_one_out: bool = False, anchors: Anchors = EVERY_ROW) -> Tensor:
    """Arithmetic PVC: for each view, the log of the mean of its l over the other modality's views (the
    denominators' anchors), both directions averaged."""
    check_views(image_views, text_views)

    def one_vs_rest(views: Tensor, candidates: Tensor) -> Tensor:
        terms = log_ell(views[rows], candidates, inv_tau, leave_one_out, offset)  # [k, M_anchor, M_candidate]
        return (torch.logsumexp(terms, dim=1) - math.log(views.shape[1])).mean()

    rows, offset = anchors.rows, anchors.start
    return -0.5 * (one_vs_rest(text_views, image_views) + one_vs_rest(image_views, text_views))


def multicrop_loss(image_views: Tensor, text_views: Tensor, inv_tau: float | Tensor,
                   leave_one_out: bool = False, anchors: Anchors = EVERY_ROW) -> Tensor:
    """Multi-Crop: the two-view loss of every (image view, text view) pair, averaged (Eq. 1). In pair (a, b)
    the negatives are the other samples' views a and b, so unlike PVC it depends on how views are indexed
    across samples (only in a realisation: the views are exchangeable in expectation)."""
    check_views(image_views, text_views)
    return torch.stack([geometric_pvc_loss(image_views[:, a : a + 1], text_views[:, b : b + 1], inv_tau, leave_one_out,
                                           anchors)
                        for a in range(image_views.shape[1]) for b in range(text_views.shape[1])]).mean()


def sufficient_statistics_loss(image_views: Tensor, text_views: Tensor, inv_tau: float | Tensor,
                               anchors: Anchors = EVERY_ROW) -> Tensor:
    """Sufficient statistics (Eq. 22 with Q the mean of Eq. 24, cross-modal): every view against the mean
    of the other modality's views of each sample, InfoNCE over samples; both directions averaged."""
    check_views(image_views, text_views)

    def direction(views: Tensor, other: Tensor) -> Tensor:
        k, m, d = views[anchors.rows].shape
        logits = _promote(inv_tau * (views[anchors.rows].reshape(k * m, d) @ other.mean(dim=1).T))  # [k*M, K]
        targets = (anchors.start + torch.arange(k, device=views.device)).repeat_interleave(m)
        return torch.nn.functional.cross_entropy(logits, targets)

    return 0.5 * (direction(image_views, text_views) + direction(text_views, image_views))
