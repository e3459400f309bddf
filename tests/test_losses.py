"""Properties of the objectives derived from the CLOOB paper (equation numbers from the main text/appendix).

Reference values are computed here by literal per-anchor loops over the equations, independent of the
vectorised implementation.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cloob_core.config import load_config
from cloob_core.objectives.losses import (
    CLOOBLoss,
    cloob_loss,
    hopfield_retrieval,
    infoloob_loss,
    infonce_hopfield_loss,
    infonce_loss,
    loob,
)
from cloob_core.objectives.names import OBJECTIVES
from cloob_core.objectives.registry import build_objective, objective_from_config

DTYPES = (torch.float32, torch.float64)


def configured(name: str, beta: float = 8.0):
    """The objective as a run configures it: ``objective.beta`` reaches the Hopfield objectives only."""
    return objective_from_config(load_config(overrides=[f"train.objective={name}", f"objective.beta={beta}"]))


def unit(n: int, d: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=dtype), dim=-1)


def correlated_pair(n: int, d: int, seed: int, noise: float = 0.5, dtype=torch.float64):
    """Image/text embeddings whose matched rows are similar, as after some training."""
    x = unit(n, d, seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    y = F.normalize(x + noise * torch.randn(n, d, generator=g, dtype=dtype), dim=-1)
    return x, y


# ----------------------------------------------------------------------------------------------- references
def ref_loob_direction(anchors, samples, inv_tau):
    """Eq. (8), one direction, literally: -1/N sum_i ln( exp(s_ii) / sum_{j != i} exp(s_ij) )."""
    n = anchors.shape[0]
    total = 0.0
    for i in range(n):
        s = [inv_tau * float(anchors[i] @ samples[j]) for j in range(n)]
        negatives = math.log(sum(math.exp(s[j]) for j in range(n) if j != i))
        total += -(s[i] - negatives)
    return total / n


def ref_infonce_direction(anchors, samples, inv_tau):
    n = anchors.shape[0]
    total = 0.0
    for i in range(n):
        s = [inv_tau * float(anchors[i] @ samples[j]) for j in range(n)]
        total += -(s[i] - math.log(sum(math.exp(v) for v in s)))
    return total / n


def ref_retrieve(state, stored, beta):
    """Eq. (1)-(4) row by row: xi_new = U softmax(beta U^T xi), then normalised."""
    out = []
    for xi in state:
        p = torch.softmax(beta * (stored @ xi), dim=0)
        r = stored.T @ p
        out.append(r / r.norm())
    return torch.stack(out)


# ------------------------------------------------------------------------------------------ exact formulas
@pytest.mark.parametrize("dtype", DTYPES)
def test_infonce_matches_eq7_halved(dtype):
    x, y = correlated_pair(9, 6, seed=1, dtype=dtype)
    expected = 0.5 * (ref_infonce_direction(x, y, 30.0) + ref_infonce_direction(y, x, 30.0))
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert infonce_loss(x, y, 30.0).item() == pytest.approx(expected, rel=tol)
    assert infonce_loss(x, y, 30.0).dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_infoloob_matches_eq8_times_tau(dtype):
    x, y = correlated_pair(9, 6, seed=2, dtype=dtype)
    inv_tau = 14.3
    expected = (ref_loob_direction(x, y, inv_tau) + ref_loob_direction(y, x, inv_tau)) / inv_tau
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert infoloob_loss(x, y, inv_tau).item() == pytest.approx(expected, rel=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cloob_matches_eq5_times_tau(dtype):
    x, y = correlated_pair(8, 5, seed=3, dtype=dtype)
    inv_tau, beta = 30.0, 8.0
    u_x, u_y = ref_retrieve(x, x, beta), ref_retrieve(y, x, beta)
    v_x, v_y = ref_retrieve(x, y, beta), ref_retrieve(y, y, beta)
    expected = (ref_loob_direction(u_x, u_y, inv_tau) + ref_loob_direction(v_y, v_x, inv_tau)) / inv_tau
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert cloob_loss(x, y, inv_tau, beta).item() == pytest.approx(expected, rel=tol)


def test_cloob_second_term_anchors_on_text_retrieved_text():
    """Eq. (5)'s second term sums over anchors V_y against V_x (not V_x against V_y): swapping them differs."""
    x, y = correlated_pair(7, 4, seed=4)
    inv_tau, beta = 30.0, 8.0
    u_x, u_y = ref_retrieve(x, x, beta), ref_retrieve(y, x, beta)
    v_x, v_y = ref_retrieve(x, y, beta), ref_retrieve(y, y, beta)
    swapped = (ref_loob_direction(u_x, u_y, inv_tau) + ref_loob_direction(v_x, v_y, inv_tau)) / inv_tau
    right = (ref_loob_direction(u_x, u_y, inv_tau) + ref_loob_direction(v_y, v_x, inv_tau)) / inv_tau
    assert abs(swapped - right) > 1e-6  # the check below can tell the two apart
    assert cloob_loss(x, y, inv_tau, beta).item() == pytest.approx(right, rel=1e-10)


def test_extra_stored_patterns_join_the_memories():
    x, y = correlated_pair(6, 5, seed=5)
    proto_u, proto_v = unit(4, 5, seed=50), unit(3, 5, seed=51)
    inv_tau, beta = 30.0, 8.0
    mem_u, mem_v = torch.cat([x, proto_u]), torch.cat([y, proto_v])
    u_x, u_y = ref_retrieve(x, mem_u, beta), ref_retrieve(y, mem_u, beta)
    v_x, v_y = ref_retrieve(x, mem_v, beta), ref_retrieve(y, mem_v, beta)
    expected = (ref_loob_direction(u_x, u_y, inv_tau) + ref_loob_direction(v_y, v_x, inv_tau)) / inv_tau
    got = cloob_loss(x, y, inv_tau, beta, extra_image_stored=proto_u, extra_text_stored=proto_v)
    assert got.item() == pytest.approx(expected, rel=1e-10)
    assert got.item() != pytest.approx(cloob_loss(x, y, inv_tau, beta).item(), rel=1e-6)
    via_module = CLOOBLoss(beta=beta)(x, y, inv_tau, extra_image_stored=proto_u, extra_text_stored=proto_v)
    assert via_module.item() == pytest.approx(expected, rel=1e-10)


def test_infonce_hopfield_is_infonce_on_retrievals():
    x, y = correlated_pair(8, 5, seed=6)
    inv_tau, beta = 30.0, 8.0
    u_x, u_y = ref_retrieve(x, x, beta), ref_retrieve(y, x, beta)
    v_x, v_y = ref_retrieve(x, y, beta), ref_retrieve(y, y, beta)
    expected = 0.5 * (ref_infonce_direction(u_x, u_y, inv_tau) + ref_infonce_direction(v_y, v_x, inv_tau))
    assert infonce_hopfield_loss(x, y, inv_tau, beta).item() == pytest.approx(expected, rel=1e-10)


def test_inputs_are_not_renormalised():
    """The functions take normalised embeddings as given; scaling the inputs must change the value."""
    x, y = correlated_pair(6, 4, seed=7)
    scaled = 2.0 * x
    expected = 0.5 * (ref_infonce_direction(scaled, y, 10.0) + ref_infonce_direction(y, scaled, 10.0))
    assert infonce_loss(scaled, y, 10.0).item() == pytest.approx(expected, rel=1e-10)
    assert infonce_loss(scaled, y, 10.0).item() != pytest.approx(infonce_loss(x, y, 10.0).item(), rel=1e-6)


# --------------------------------------------------------------------------------------- Hopfield retrieval
def test_retrieval_small_beta_returns_mean_of_stored():
    """beta -> 0: softmax is uniform, the retrieval is the (normalised) mean of the stored patterns."""
    state, stored = unit(5, 8, seed=8), unit(11, 8, seed=9)
    mean = stored.mean(dim=0)
    expected = (mean / mean.norm()).expand(5, -1)
    torch.testing.assert_close(hopfield_retrieval(state, stored, 1e-9), expected, rtol=1e-7, atol=1e-7)


def test_retrieval_large_beta_with_self_storage_returns_state():
    """beta -> inf with stored = state: each state pattern is a fixed point and retrieves itself."""
    state = unit(16, 32, seed=10)
    torch.testing.assert_close(hopfield_retrieval(state, state, 1e4), state, rtol=1e-9, atol=1e-9)


def test_retrieval_matches_eq_rowwise_and_is_unit_norm():
    state, stored = unit(7, 6, seed=11), unit(13, 6, seed=12)
    got = hopfield_retrieval(state, stored, 8.0)
    torch.testing.assert_close(got, ref_retrieve(state, stored, 8.0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(7, dtype=torch.float64))


# ------------------------------------------------------------------------------- gradient identities (A.1.4)
def _single_anchor_losses(y, x_all, inv_tau):
    """Per-anchor Eq. (9) and (10) for anchor y with positive x_all[0] and negatives x_all[1:]."""
    s = inv_tau * (x_all @ y)
    nce = -s[0] + torch.logsumexp(s, dim=0)
    loob_value = -s[0] + torch.logsumexp(s[1:], dim=0)
    return nce, loob_value, torch.softmax(s, dim=0)[0]


def test_gradient_identity_nce_is_one_minus_p1_times_loob_wrt_anchor():
    """Eq. (A110): dL_NCE/dy = (1 - p_1) dL_LOOB/dy."""
    inv_tau = 5.0
    x_all = unit(12, 7, seed=13)
    y = F.normalize(x_all[0] + 0.3 * unit(1, 7, seed=14)[0], dim=0).requires_grad_()
    nce, loob_value, p1 = _single_anchor_losses(y, x_all, inv_tau)
    (grad_nce,) = torch.autograd.grad(nce, y, retain_graph=True)
    (grad_loob,) = torch.autograd.grad(loob_value, y)
    assert 0.05 < p1.item() < 0.95  # a regime where the factor is far from both 0 and 1
    torch.testing.assert_close(grad_nce, (1 - p1.detach()) * grad_loob, rtol=1e-12, atol=1e-12)


def test_gradient_identity_loob_wrt_positive_is_minus_inv_tau_y():
    """Eq. (A121): dL_LOOB/dx_1 = -inv_tau * y, whatever the negatives; InfoNCE's is scaled by (1 - p1)."""
    inv_tau = 7.0
    x_all = unit(10, 5, seed=15).requires_grad_()
    y = unit(1, 5, seed=16)[0]
    nce, loob_value, p1 = _single_anchor_losses(y, x_all, inv_tau)
    (grad_loob,) = torch.autograd.grad(loob_value, x_all, retain_graph=True)
    (grad_nce,) = torch.autograd.grad(nce, x_all)
    torch.testing.assert_close(grad_loob[0], -inv_tau * y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_nce[0], -inv_tau * (1 - p1.detach()) * y, rtol=1e-12, atol=1e-12)


def test_batched_loob_gradient_wrt_positive():
    """The batched implementation obeys Eq. (A121) row-wise: the positive x_i of anchor y_i receives
    -inv_tau * y_i / N from its own term plus only the negative-side terms of the other anchors."""
    n, inv_tau = 6, 9.0
    x, y = correlated_pair(n, 4, seed=17)
    x = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(loob(y, x, inv_tau), x)
    s = inv_tau * (y @ x.detach().T)
    masked = s.masked_fill(torch.eye(n, dtype=torch.bool), float("-inf"))
    weights = torch.softmax(masked, dim=1)  # zero on the diagonal: the positive is not a negative
    expected = (-inv_tau * y + inv_tau * weights.T @ y) / n
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------- bounds, values
def test_infonce_per_direction_is_non_negative():
    for seed in range(5):
        x, y = correlated_pair(16, 8, seed=100 + seed, noise=0.05)
        assert ref_infonce_direction(x, y, 50.0) >= 0
        assert infonce_loss(x, y, 50.0).item() >= 0
    # even for a perfectly aligned batch the value stays >= 0 (it tends to 0, never below)
    x = torch.eye(8, dtype=torch.float64)
    assert 0 <= infonce_loss(x, x, 100.0).item() < 1e-30


@pytest.mark.parametrize("n", [2, 3, 17])
def test_loob_with_equal_logits_is_ln_n_minus_1(n):
    same = F.normalize(torch.ones(n, 4, dtype=torch.float64), dim=-1)
    assert loob(same, same, 30.0).item() == pytest.approx(math.log(n - 1), rel=1e-12)
    assert infoloob_loss(same, same, 30.0).item() == pytest.approx(2 * math.log(n - 1) / 30.0, rel=1e-12)
    # InfoNCE with equal logits is ln N: the positive sits in its own denominator
    assert infonce_loss(same, same, 30.0).item() == pytest.approx(math.log(n), rel=1e-12)


def test_loob_can_be_negative_unlike_infonce():
    """InfoLOOB is not bounded below by 0: a well aligned batch drives it negative (no saturation)."""
    x = torch.eye(6, dtype=torch.float64)
    assert loob(x, x, 30.0).item() < -20


# ------------------------------------------------------------------------------------------- invariances
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_invariant_to_joint_permutation_and_rotation(name):
    x, y = correlated_pair(10, 6, seed=18)
    objective = configured(name)
    base = objective(x, y, 30.0)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(objective(x[perm], y[perm], 30.0), base, rtol=1e-12, atol=1e-12)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    torch.testing.assert_close(objective(x @ q, y @ q, 30.0), base, rtol=1e-12, atol=1e-12)
    # ...but not to permuting only one side, which breaks the pairs
    assert not torch.allclose(objective(x[perm], y, 30.0), base)


# ------------------------------------------------------------------------------------ numerics, precision
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_finite_values_and_gradients_in_extreme_regimes(name, dtype):
    """Near-duplicate rows and a large inv_tau push logits far apart; nothing may become NaN/inf."""
    x = unit(32, 16, seed=19, dtype=dtype)
    x[1] = x[0]  # an exact duplicate pair (a false negative)
    y = x.clone()
    x.requires_grad_()
    y.requires_grad_()
    loss = configured(name, beta=14.3)(x, y, 100.0)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(x.grad).all() and torch.isfinite(y.grad).all()


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_bf16_autocast_on_cpu_is_finite_and_close_to_fp32(name):
    x, y = correlated_pair(64, 32, seed=20, dtype=torch.float32)
    objective = configured(name)
    reference = objective(x, y, 30.0)
    xa, ya = x.clone().requires_grad_(), y.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = objective(xa, ya, 30.0)
    loss.backward()
    assert loss.dtype == torch.float32  # reductions run in float32 even under autocast
    assert torch.isfinite(loss) and torch.isfinite(xa.grad).all() and torch.isfinite(ya.grad).all()
    assert loss.item() == pytest.approx(reference.item(), rel=0.05, abs=0.05)


def test_masked_diagonal_gets_exactly_zero_weight():
    """The positive must carry no weight in LOOB's denominator however far apart the logits are. A -1000
    constant (ml-jku/cloob) is wrong once the negatives' logits fall below -1000: here they are -2000."""
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)
    # positives: +2000; the single negative of each anchor: -2000
    assert loob(x, x, 2000.0).item() == pytest.approx(-4000.0, rel=1e-12)
    # with the positive far above the negatives, it must not leak in either (no +2000 in the denominator)
    y = torch.eye(4, dtype=torch.float64)
    assert loob(y, y, 2000.0).item() == pytest.approx(-2000.0 + math.log(3), rel=1e-12)


# ------------------------------------------------------------------------------------------------ registry
def test_registry_covers_the_ablation_grid_and_the_other_families():
    assert {"clip", "infoloob", "infonce_hopfield", "cloob"} <= set(OBJECTIVES)  # the paper's ablation grid
    assert {"clip_ring", "infoloob_ring", "cloob_ring"} <= set(OBJECTIVES)  # Wu et al.
    assert {"pvc_geometric", "pvc_arithmetic", "multicrop", "suffstats"} <= set(OBJECTIVES)  # Shidani et al.
    assert build_objective("cloob", beta=14.3).beta == 14.3


def test_registry_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown objective"):
        build_objective("simclr")
    with pytest.raises(ValueError, match="does not take options"):
        build_objective("cloob", queue_size=5)
    with pytest.raises(ValueError, match="does not take options"):  # beta parameterises Hopfield memories only
        build_objective("clip", beta=8.0)
    with pytest.raises(ValueError, match="beta must be > 0"):
        build_objective("cloob", beta=0.0)


def test_beta_changes_the_cloob_loss():
    x, y = correlated_pair(8, 5, seed=21)
    assert build_objective("cloob", beta=1.0)(x, y, 30.0) != build_objective("cloob", beta=14.3)(x, y, 30.0)


def test_loob_needs_two_pairs():
    x = unit(1, 4, seed=22)
    with pytest.raises(ValueError, match="at least 2"):
        infoloob_loss(x, x, 30.0)
    with pytest.raises(ValueError, match="pair up"):
        infoloob_loss(unit(3, 4, seed=1), unit(4, 4, seed=2), 30.0)


def test_learnable_inv_tau_receives_gradient():
    x, y = correlated_pair(8, 5, seed=23)
    inv_tau = torch.tensor(30.0, dtype=torch.float64, requires_grad=True)
    for name in OBJECTIVES:
        (grad,) = torch.autograd.grad(configured(name)(x, y, inv_tau), inv_tau)
        assert torch.isfinite(grad) and grad.item() != 0.0
