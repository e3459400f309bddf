"""Restricted negatives (Wu et al. 2020): properties derived from the paper. BALL with p_out = 100% and RING with
no inner cut are plain InfoNCE / InfoLOOB / CLOOB exactly; excluded candidates get exactly zero gradient; the VINCE
estimate log K - L falls as the band narrows; the annealing schedule and the queue behave as specified and
survive a checkpoint."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from cloob_core.objectives.losses import (
    cloob_loss,
    infoloob_loss,
    infonce_loss,
    restricted_infonce_loss,
    restricted_terms,
)
from cloob_core.objectives.negatives import Band, BandSchedule, EmbeddingQueue, eligible_negatives
from cloob_core.objectives.registry import build_objective

INV_TAU = 30.0


def pairs(n: int = 24, d: int = 16, noise: float = 0.4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(n, d, generator=generator, dtype=torch.float64), dim=-1)
    y = F.normalize(x + noise * torch.randn(n, d, generator=generator, dtype=torch.float64), dim=-1)
    return x, y


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_full_band_is_plain_infonce_infoloob_and_cloob(seed):
    x, y = pairs(seed=seed)
    full = {"p_in": 0.0, "p_out": 1.0}
    assert restricted_infonce_loss(x, y, INV_TAU, Band(0.0, 1.0)) == pytest.approx(infonce_loss(x, y, INV_TAU).item(),
                                                                                 abs=1e-12)
    assert build_objective("clip_ring", **full)(x, y, INV_TAU).item() == pytest.approx(
        infonce_loss(x, y, INV_TAU).item(), abs=1e-12)
    assert build_objective("infoloob_ring", **full)(x, y, INV_TAU).item() == pytest.approx(
        infoloob_loss(x, y, INV_TAU).item(), abs=1e-12)
    assert build_objective("cloob_ring", beta=8.0, **full)(x, y, INV_TAU).item() == pytest.approx(
        cloob_loss(x, y, INV_TAU, 8.0).item(), abs=1e-12)


def test_a_band_changes_the_loss_and_ball_keeps_the_hardest():
    x, y = pairs()
    similarity = x @ y.T
    mask = eligible_negatives(similarity, Band(0.0, 0.25))
    n = x.shape[0]
    kept = math.ceil(0.25 * (n - 1))
    assert (mask.sum(dim=1) == kept).all() and not mask.diagonal().any()
    for i in range(n):
        negatives = [j for j in range(n) if j != i]
        hardest = sorted(negatives, key=lambda j: -similarity[i, j].item())[:kept]
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(hardest)
    assert restricted_infonce_loss(x, y, INV_TAU, Band(0.0, 0.25)) < infonce_loss(x, y, INV_TAU)


def test_ring_cuts_the_nearest_neighbours():
    x, y = pairs(n=21)
    similarity = x @ y.T
    ring = eligible_negatives(similarity, Band(0.1, 0.5))
    ball = eligible_negatives(similarity, Band(0.0, 0.5))
    cut = ball & ~ring
    assert (cut.sum(dim=1) == 2).all() and (ring.sum(dim=1) == 8).all()  # 20 negatives: ranks [2, 10)
    for i in range(21):  # what was cut is more similar than anything kept
        assert similarity[i][cut[i]].min() >= similarity[i][ring[i]].max()


def test_excluded_candidates_receive_exactly_zero_gradient():
    x, y = pairs(n=16)
    extra = F.normalize(torch.randn(32, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64), dim=-1)
    candidates = torch.cat([y, extra]).requires_grad_(True)
    band = Band(0.1, 0.3)
    losses, counts = restricted_terms(x, candidates, INV_TAU, band)
    losses.mean().backward()
    eligible = eligible_negatives(x @ candidates.detach().T, band)
    used = eligible.any(dim=0)
    used[: x.shape[0]] = True  # the batch rows are positives
    grads = candidates.grad.norm(dim=1)
    assert (grads[~used] == 0).all() and (~used).sum() > 0
    assert (grads[used] > 0).all()
    assert (counts == 1 + eligible.sum(dim=1)).all()


def test_the_estimate_log_k_minus_l_falls_as_the_band_narrows():
    """VINCE (Wu et al. Lemma 4.2) with a narrower proposal is a looser bound. Per anchor this is exact when
    the dropped negatives are no closer than the positive: here the positives are the nearest neighbours."""
    x, y = pairs(n=64, d=32, noise=0.2, seed=3)
    sim = x @ y.T
    assert (sim.diagonal()[:, None] >= sim).all()
    estimates = []
    for p_out in (1.0, 0.8, 0.6, 0.4, 0.2, 0.1, 0.05):
        losses, counts = restricted_terms(x, y, INV_TAU, Band(0.0, p_out))
        estimates.append((counts.double().log() - losses).mean().item())
    assert all(a > b for a, b in itertools.pairwise(estimates)), estimates


def test_the_schedule_anneals_p_out_down_and_p_in_up_then_holds():
    schedule = BandSchedule(p_in=0.02, p_out=0.1, anneal_steps=100, anneal_inner=True)
    assert schedule.at(0) == Band(0.0, 1.0)
    assert schedule.at(50).p_out == pytest.approx(0.55) and schedule.at(50).p_in == pytest.approx(0.01)
    assert schedule.at(100) == Band(0.02, 0.1) == schedule.at(10_000)
    fixed_inner = BandSchedule(p_in=0.02, p_out=0.1, anneal_steps=100)
    assert fixed_inner.at(0) == Band(0.02, 1.0)
    assert BandSchedule(p_in=0.0, p_out=0.1).at(0) == Band(0.0, 0.1)
    with pytest.raises(ValueError, match="p_in < p_out"):
        Band(0.5, 0.5)


def test_the_queue_is_a_fifo_and_survives_a_checkpoint():
    queue = EmbeddingQueue(5)
    for step in range(3):
        queue.push(torch.full((2, 3), float(step)), torch.full((2, 3), -float(step)))
    assert len(queue) == 5 and queue.image[:, 0].tolist() == [2.0, 2.0, 1.0, 1.0, 0.0]  # newest first
    restored = EmbeddingQueue(5)
    restored.load(queue.state())
    assert torch.equal(restored.image, queue.image) and torch.equal(restored.text, queue.text)


def test_an_objective_advances_once_per_step_and_restores_its_state():
    x, y = pairs(n=8)
    objective = build_objective("clip_ring", p_out=0.5, anneal_steps=10, queue_size=16)
    assert objective.band == Band(0.0, 1.0)
    for _ in range(3):
        objective(x, y, INV_TAU)
        objective(x, y, INV_TAU)  # a second micro-batch pass of the same step changes nothing
        objective.end_step()
    assert objective.step == 3 and len(objective.queue) == 16
    assert objective.band.p_out == pytest.approx(1.0 - 0.5 * 0.3)
    state = objective.checkpoint_state()
    resumed = build_objective("clip_ring", p_out=0.5, anneal_steps=10, queue_size=16)
    resumed.load_checkpoint_state(state)
    assert resumed(x, y, INV_TAU).item() == objective(x, y, INV_TAU).item()
    with pytest.raises(ValueError, match="keeps no state"):
        build_objective("clip").load_checkpoint_state(state)


def test_the_queue_adds_candidates_to_both_directions():
    x, y = pairs(n=8)
    past_x, past_y = pairs(n=8, seed=9)
    objective = build_objective("clip_ring", p_out=1.0, queue_size=8)
    objective.queue.push(past_x, past_y)
    expected = 0.5 * (F.cross_entropy(INV_TAU * x @ torch.cat([y, past_y]).T, torch.arange(8))
                      + F.cross_entropy(INV_TAU * y @ torch.cat([x, past_x]).T, torch.arange(8)))
    assert objective(x, y, INV_TAU).item() == pytest.approx(expected.item(), abs=1e-12)


def test_cloob_ring_ranks_by_retrieved_or_raw_similarities():
    x, y = pairs(n=32, noise=0.8)
    by_loss = build_objective("cloob_ring", beta=8.0, p_out=0.2)(x, y, INV_TAU)
    by_raw = build_objective("cloob_ring", beta=8.0, p_out=0.2, ranking="raw")(x, y, INV_TAU)
    assert by_loss.item() != pytest.approx(by_raw.item(), abs=1e-9)
    with pytest.raises(ValueError, match="ranking"):
        build_objective("cloob_ring", ranking="cosine")
