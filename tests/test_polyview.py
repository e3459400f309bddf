"""Poly-view objectives (Shidani et al. 2024), cross-modal: each checked against a loop-by-loop reading of the
paper's equations, and against properties the paper proves: one view per modality gives CLIP's symmetric
InfoNCE; constant embeddings give log(B - M + 1); Geometric >= Arithmetic (Jensen); invariance to permuting
samples or views and to rotations; and, on the paper's Gaussian toy (Eq. 26), a learned bound that grows with M
and stays below the true MI."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from cloob_core.config import load_config
from cloob_core.objectives import polyview
from cloob_core.objectives.losses import infoloob_loss, infonce_loss
from cloob_core.objectives.registry import build_objective, objective_from_config

INV_TAU = 10.0
POLY = ("pvc_geometric", "pvc_arithmetic", "multicrop", "suffstats")


def views(k: int, mx: int, my: int, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    centre = torch.randn(k, 1, d, generator=generator, dtype=torch.float64)
    x = F.normalize(centre + 0.7 * torch.randn(k, mx, d, generator=generator, dtype=torch.float64), dim=-1)
    y = F.normalize(centre + 0.7 * torch.randn(k, my, d, generator=generator, dtype=torch.float64), dim=-1)
    return x, y


def reference_log_ell(anchors, candidates, inv_tau, leave_one_out=False):
    """Eq. 14 term by term: anchor view b of sample i, positive view a of sample i; the denominator sums the
    positive (unless leave-one-out) and every candidate view of every other sample."""
    k, mb, _ = anchors.shape
    ma = candidates.shape[1]
    out = torch.empty(k, mb, ma, dtype=torch.float64)
    for i in range(k):
        for b in range(mb):
            anchor = anchors[i, b]
            negatives = [math.exp(inv_tau * float(anchor @ candidates[j, g])) for j in range(k) if j != i
                         for g in range(ma)]
            for a in range(ma):
                positive = math.exp(inv_tau * float(anchor @ candidates[i, a]))
                out[i, b, a] = math.log(positive / ((0 if leave_one_out else positive) + sum(negatives)))
    return out


def reference_losses(x, y, inv_tau):
    t_anchor = reference_log_ell(y, x, inv_tau)  # anchors text views, candidates image views
    i_anchor = reference_log_ell(x, y, inv_tau)
    geometric = -0.5 * (t_anchor.mean() + i_anchor.mean())
    arithmetic = -0.5 * (t_anchor.exp().mean(dim=1).log().mean() + i_anchor.exp().mean(dim=1).log().mean())
    pairwise = []
    for a in range(x.shape[1]):
        for b in range(y.shape[1]):
            logits = inv_tau * x[:, a] @ y[:, b].T
            targets = torch.arange(x.shape[0])
            pairwise.append(0.5 * (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)))
    multicrop = torch.stack(pairwise).mean()

    def suff(anchor_views, other_views):
        q = other_views.mean(dim=1)
        terms = [-F.log_softmax(inv_tau * anchor_views[i, a] @ q.T, dim=0)[i] for i in range(x.shape[0])
                 for a in range(anchor_views.shape[1])]
        return torch.stack(terms).mean()

    suffstats = 0.5 * (suff(x, y) + suff(y, x))
    return {"pvc_geometric": geometric, "pvc_arithmetic": arithmetic, "multicrop": multicrop,
            "suffstats": suffstats}


@pytest.mark.parametrize(("k", "mx", "my"), [(5, 2, 3), (4, 3, 1), (6, 2, 2)])
def test_each_objective_matches_the_papers_equations(k, mx, my):
    x, y = views(k, mx, my, seed=k)
    assert torch.allclose(polyview.log_ell(y, x, INV_TAU), reference_log_ell(y, x, INV_TAU), atol=1e-12)
    assert torch.allclose(polyview.log_ell(y, x, INV_TAU, True), reference_log_ell(y, x, INV_TAU, True), atol=1e-12)
    expected = reference_losses(x, y, INV_TAU)
    for name in POLY:
        objective = build_objective(name, image_views=mx, text_views=my)
        got = objective(x.reshape(k * mx, -1), y.reshape(k * my, -1), INV_TAU)
        assert got.item() == pytest.approx(expected[name].item(), abs=1e-12), name


@pytest.mark.parametrize("seed", [0, 1])
def test_one_view_per_modality_is_clips_symmetric_infonce(seed):
    x, y = views(12, 1, 1, seed=seed)
    flat_x, flat_y = x[:, 0], y[:, 0]
    clip = infonce_loss(flat_x, flat_y, INV_TAU).item()
    for name in POLY:
        assert build_objective(name)(flat_x, flat_y, INV_TAU).item() == pytest.approx(clip, abs=1e-12), name
    loob = infoloob_loss(flat_x, flat_y, INV_TAU).item()
    for name in ("pvc_geometric", "pvc_arithmetic", "multicrop"):
        got = build_objective(name, leave_one_out=True)(flat_x, flat_y, INV_TAU).item()
        assert got == pytest.approx(loob, abs=1e-12), name


@pytest.mark.parametrize(("k", "m"), [(4, 1), (5, 2), (3, 4), (8, 3)])
def test_constant_embeddings_give_log_b_minus_m_plus_one(k, m):
    d = 6
    same = F.normalize(torch.ones(k * m, d, dtype=torch.float64), dim=-1)
    b = k * m
    for name in ("pvc_geometric", "pvc_arithmetic"):
        loss = build_objective(name, image_views=m, text_views=m)(same, same.clone(), INV_TAU)
        assert loss.item() == pytest.approx(math.log(b - m + 1), abs=1e-12), name
    # the two-view objectives keep their two-view value: one candidate per other sample
    for name in ("multicrop", "suffstats"):
        loss = build_objective(name, image_views=m, text_views=m)(same, same.clone(), INV_TAU)
        assert loss.item() == pytest.approx(math.log(k), abs=1e-12), name


@pytest.mark.parametrize("seed", range(5))
def test_geometric_is_never_below_arithmetic(seed):
    x, y = views(6, 3, 2, seed=seed)
    geometric = polyview.geometric_pvc_loss(x, y, INV_TAU)
    arithmetic = polyview.arithmetic_pvc_loss(x, y, INV_TAU)
    assert geometric >= arithmetic - 1e-12
    assert polyview.geometric_pvc_loss(x, y, INV_TAU, True) >= polyview.arithmetic_pvc_loss(x, y, INV_TAU, True)


def test_invariant_to_sample_order_view_order_and_rotation():
    """The PVC losses and sufficient statistics treat a sample's views as a set: any per-sample reordering
    leaves them unchanged. Multi-Crop pairs view a of every sample with view b of every sample, so only a
    reordering shared by all samples leaves it unchanged (its negatives are the other samples' view a)."""
    k, mx, my, d = 6, 3, 2, 8
    x, y = views(k, mx, my, d)
    generator = torch.Generator().manual_seed(7)
    order = torch.randperm(k, generator=generator)
    x_views = torch.stack([x[i, torch.randperm(mx, generator=generator)] for i in range(k)])
    y_views = torch.stack([y[i, torch.randperm(my, generator=generator)] for i in range(k)])
    shared = (x[:, torch.randperm(mx, generator=generator)], y[:, torch.randperm(my, generator=generator)])
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    for name in POLY:
        objective = build_objective(name, image_views=mx, text_views=my)
        base = objective(x.reshape(-1, d), y.reshape(-1, d), INV_TAU).item()
        cases = [(x[order], y[order]), shared, (x @ rotation, y @ rotation)]
        if name != "multicrop":
            cases.append((x_views, y_views))
        for xs, ys in cases:
            assert objective(xs.reshape(-1, d), ys.reshape(-1, d), INV_TAU).item() == pytest.approx(base, abs=1e-12)
    multicrop = build_objective("multicrop", image_views=mx, text_views=my)
    assert multicrop(x_views.reshape(-1, d), y_views.reshape(-1, d), INV_TAU).item() != pytest.approx(
        multicrop(x.reshape(-1, d), y.reshape(-1, d), INV_TAU).item(), abs=1e-6)


@pytest.mark.parametrize("m", [2, 3, 5, 8])
def test_any_number_of_views_runs_through_the_same_code_with_finite_gradients(m):
    x, y = views(4, m, max(1, m - 1), seed=m)
    x.requires_grad_(True)
    for name in POLY:
        objective = build_objective(name, image_views=m, text_views=max(1, m - 1))
        loss = objective(x.reshape(-1, 8), y.reshape(-1, 8), INV_TAU)
        (grad,) = torch.autograd.grad(loss, x)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_views_must_split_evenly_and_need_a_poly_view_objective():
    with pytest.raises(ValueError, match="do not split"):
        build_objective("pvc_geometric", image_views=2, text_views=2)(torch.randn(6, 4), torch.randn(4, 4), 10.0)
    with pytest.raises(ValueError, match="need a poly-view objective"):
        load_config(overrides=["train.image_views=2"])
    config = load_config(overrides=["train.objective=pvc_arithmetic", "train.image_views=2", "train.text_views=4"])
    objective = objective_from_config(config)
    assert (objective.image_views, objective.text_views, objective.leave_one_out) == (2, 4, False)
    with pytest.raises(ValueError, match="no leave-one-out form"):
        build_objective("suffstats", leave_one_out=True)


def gaussian_views(k: int, m: int, generator: torch.Generator, sigma0: float = 1.0, sigma: float = 1.0):
    """Shidani et al. §3.1: c ~ N(0, sigma0^2), each view = c + N(0, sigma^2); here m image and m text views."""
    c = sigma0 * torch.randn(k, 1, 1, generator=generator)
    image = c + sigma * torch.randn(k, m, 1, generator=generator)
    return image, c + sigma * torch.randn(k, m, 1, generator=generator)


def true_one_vs_rest_mi(m_rest: int, sigma0: float = 1.0, sigma: float = 1.0) -> float:
    """I(x; Y_1..m) for x, Y_j = c + independent noise: the mean of the Y is sufficient, so it is the MI of two
    correlated Gaussians, -1/2 log(1 - rho^2) (the paper's Eq. 26 with M = m + 1 views)."""
    rho2 = sigma0**4 / ((sigma0**2 + sigma**2) * (sigma0**2 + sigma**2 / m_rest))
    return -0.5 * math.log(1 - rho2)


@pytest.mark.slow  # ~1 minute: small MLPs trained for each M
def test_the_learned_one_vs_rest_bound_grows_with_m_on_the_gaussian_toy():
    """Theorem 2.2/2.3: with the InfoNCE denominator, c(B, M) - L_Arith lower-bounds the one-vs-rest MI and its
    gap does not grow with M. Trained MLP encoders on Eq. 26's toy: the bound is non-decreasing in M and below
    the true MI."""
    k, d, inv_tau = 64, 8, 8.0
    bounds = {}
    for m in (1, 2, 4, 8):
        torch.manual_seed(0)
        encoders = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.GELU(),
                                                            torch.nn.Linear(64, d)) for _ in range(2)])
        optimizer = torch.optim.Adam(encoders.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(1)

        def loss_of(x, y, encoders=encoders):
            return polyview.arithmetic_pvc_loss(F.normalize(encoders[0](x), dim=-1),
                                                F.normalize(encoders[1](y), dim=-1), inv_tau)

        for _ in range(600):
            loss = loss_of(*gaussian_views(k, m, generator))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            held_out = torch.Generator().manual_seed(2)
            loss = torch.stack([loss_of(*gaussian_views(k, m, held_out)) for _ in range(200)]).mean().item()
        bounds[m] = math.log(k * m - m + 1) - loss
        assert bounds[m] <= true_one_vs_rest_mi(m) + 0.02, (m, bounds[m], true_one_vs_rest_mi(m))
    print("one-vs-rest bound by M:", {m: round(b, 4) for m, b in bounds.items()},
          "true:", {m: round(true_one_vs_rest_mi(m), 4) for m in bounds})
    ms = sorted(bounds)
    assert all(bounds[b] >= bounds[a] - 0.01 for a, b in itertools.pairwise(ms)), bounds
