"""The evaluation's math on inputs with known answers, and the linear probe against scikit-learn."""

from __future__ import annotations

import math
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from cloob_core.evaluation import logistic
from cloob_core.evaluation.features import Embedded
from cloob_core.evaluation.logistic import ProbeFit, RotatedFeatures, fit_logistic_batch
from cloob_core.evaluation.tasks import linear_probe
from cloob_core.evaluation.tasks.diagnostics import (
    ajne_statistic,
    alignment,
    effective_eigenvalues,
    eigen_spectrum,
    matched_vs_unmatched,
    positive_probability,
)
from cloob_core.evaluation.tasks.linear_probe import LAMBDA_GRID, accuracy, fit_logistic, path_start, search_lambda
from cloob_core.evaluation.tasks.retrieval import retrieval_metrics


def blobs(seed: int, n: int, d: int, classes: int, spread: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, d, generator=generator)
    labels = torch.randint(0, classes, (n,), generator=generator)
    features = centers[labels] * spread + torch.randn(n, d, generator=generator)
    return torch.nn.functional.normalize(features, dim=1), labels


@pytest.mark.parametrize(("seed", "n", "d", "classes"), [(0, 4000, 128, 20), (1, 3000, 64, 10), (2, 2000, 256, 50)])
@pytest.mark.parametrize("lam", [1e-4, 1e-2, 1.0, 100.0])
def test_linear_probe_matches_scikit_learn_at_the_same_lambda(seed, n, d, classes, lam):
    from sklearn.linear_model import LogisticRegression

    x, y = blobs(seed, n, d, classes)
    train, test = slice(0, 3 * n // 4), slice(3 * n // 4, n)
    ours = accuracy(fit_logistic(x[train], y[train], classes, lam), x[test], y[test])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sklearn's FutureWarnings about multi_class
        reference = LogisticRegression(C=1 / lam, max_iter=10_000, tol=1e-8).fit(
            x[train].double().numpy(), y[train].numpy()
        )
    theirs = reference.score(x[test].double().numpy(), y[test].numpy())
    assert abs(ours - theirs) <= 0.005 + 1e-9, (ours, theirs)


def cone(seed: int, n: int, d: int, classes: int):
    """Embedding-like features: a narrow cone around a common mean with a steep spectrum (ill-conditioned)."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.arange(1, d + 1, dtype=torch.float32) ** -1.0
    centers = torch.randn(classes, d, generator=generator) * scales * 0.3
    labels = torch.randint(0, classes, (n,), generator=generator)
    mean = torch.nn.functional.normalize(torch.randn(d, generator=generator), dim=0) * 2 * scales.norm()
    features = centers[labels] + torch.randn(n, d, generator=generator) * scales + mean
    return torch.nn.functional.normalize(features, dim=1), labels


@pytest.mark.parametrize("lam", [1e-3, 1.0, 30.0])
def test_probabilities_match_scikit_learn_on_ill_conditioned_embeddings(lam):
    """Centring and preconditioning change the path, not the optimum: the fitted model's probabilities equal
    scikit-learn's converged ones on features where the mean dominates and the spectrum spans decades."""
    from sklearn.linear_model import LogisticRegression

    x, y = cone(4, 1500, 48, 6)
    fit = fit_logistic(x[:1000], y[:1000], 6, lam)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = LogisticRegression(C=1 / lam, max_iter=100_000, tol=1e-10).fit(x[:1000].double().numpy(),
                                                                                   y[:1000].numpy())
    ours = torch.softmax(fit.predict_scores(x[1000:]), dim=1)
    theirs = torch.from_numpy(reference.predict_proba(x[1000:].double().numpy()))
    assert (ours - theirs).abs().max() < 1e-4, float((ours - theirs).abs().max())
    assert fit.iterations < 200  # plain L-BFGS needs thousands here; the preconditioner is what makes it fast


def test_objective_gradient_is_the_gradient_of_the_plain_objective():
    """The written-out gradient (rotated, centred features and bias, chunked rows) against autograd of
    ``mean CE(x W^T + b) + lam/(2n) ||W||^2`` with ``W = W' V^T`` and ``b = b' - W mu``."""
    x, y = cone(5, 300, 16, 4)
    x = x.double()
    lams = torch.tensor([0.5, 7.0], dtype=torch.float64)
    geometry = RotatedFeatures(x)
    objective = logistic._Objective(geometry.exact, y, 4)
    objective.lams = lams
    theta = torch.randn(2, 4 * 16 + 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    loss, grad = objective(theta, torch.arange(2))
    for k in range(2):
        params = theta[k].clone().requires_grad_(True)
        weight, centred_bias = params[: 4 * 16].view(4, 16) @ geometry.basis.T, params[4 * 16 :]
        plain = torch.nn.functional.cross_entropy(x @ weight.T + centred_bias - weight @ geometry.mean, y)
        plain = plain + lams[k] / (2 * len(y)) * weight.pow(2).sum()
        plain.backward()
        assert float(loss[k]) == pytest.approx(float(plain.detach()), rel=1e-12)
        torch.testing.assert_close(grad[k], params.grad, rtol=1e-10, atol=1e-12)


def test_a_batch_of_lambdas_fits_each_as_alone_and_row_chunks_do_not_matter(monkeypatch):
    x, y = blobs(6, 800, 32, 5)
    lams = [1e-2, 1.0, 100.0]
    together = fit_logistic_batch(x, y, 5, lams)
    monkeypatch.setattr(logistic, "CHUNK_ELEMENTS", 64)  # ~13 rows per chunk
    for lam, fit in zip(lams, together, strict=True):
        alone = fit_logistic(x, y, 5, lam)
        torch.testing.assert_close(torch.softmax(alone.predict_scores(x), 1), torch.softmax(fit.predict_scores(x), 1),
                                   rtol=0, atol=1e-5)


def test_lambda_search_visits_clips_grid_and_breaks_ties_towards_more_regularisation():
    # Constant features: every lambda predicts the majority class, so every accuracy ties -> the largest lambda.
    x = torch.ones(60, 4)
    y = torch.tensor([0] * 40 + [1] * 20)
    result = search_lambda(x, y, x, y, 2)
    assert result.lam == LAMBDA_GRID[-1] == pytest.approx(1e6)
    assert set(result.tried) >= {LAMBDA_GRID[i] for i in range(0, 97, 16)}  # 1e-6, 1e-4, ..., 1e6
    # Separable blobs with label noise on the validation side: the peak is interior and refined to 1/8 decade.
    x, y = blobs(3, 1500, 32, 5, spread=0.6)
    result = search_lambda(x[:1000], y[:1000], x[1000:], y[1000:], 5)
    best = max(result.tried.values())
    assert result.validation_accuracy == best
    assert result.lam == max(lam for lam, acc in result.tried.items() if acc == best)
    assert len(result.tried) <= 7 + 2 * 4  # the initial decades, then two neighbours per halving
    assert math.log10(result.lam) * 8 == pytest.approx(round(math.log10(result.lam) * 8))


def test_a_fit_added_while_the_solver_runs_reaches_its_own_optimum_and_finished_ones_are_dropped():
    x, y = separable(9, 400, 16, 4, 1.0)  # lambda 1e-6 takes about 190 iterations, 1e-2 70
    solver = logistic.LogisticSolver(x, y, 4)
    reported, rows = [], []

    def on_fit(problem: int, fit: ProbeFit) -> None:
        reported.append(fit.lam)
        rows.append(len(solver.state.theta))
        if fit.lam == 100.0:  # the strong lambda finishes first: one more joins the weak one still iterating
            solver.add([1e-2])
        elif fit.lam == 1e-2:
            solver.stop()

    solver.add([100.0, 1e-6])
    fits = solver.run(on_fit)
    assert reported == [100.0, 1e-2]  # 1e-6 was still iterating: stopped, never reported
    assert rows == [2, 2]  # a finished fit's L-BFGS memory is dropped: 100's by the time 1e-2 finishes
    assert len(solver.state.theta) == 0
    assert sorted(fits) == [0, 2]
    alone = fit_logistic(x, y, 4, 1e-2)
    torch.testing.assert_close(torch.softmax(fits[2].predict_scores(x), 1), torch.softmax(alone.predict_scores(x), 1),
                               rtol=0, atol=1e-4)


def _clips_search(score) -> tuple[int, set[int]]:
    """CLIP's search written out plainly: the chosen grid index and the indices it visits."""
    tried = {i: score(i) for i in range(0, 97, 16)}
    peak = max(tried, key=lambda i: (tried[i], i))
    for span in (8, 4, 2, 1):
        around = {max(peak - span, 0), peak, min(peak + span, 96)}
        tried.update({i: score(i) for i in around if i not in tried})
        peak = max(around, key=lambda i: (tried[i], i))
    return peak, set(tried)


@pytest.mark.parametrize("profile", ["peak at lambda 1", "a bump at lambda 1, the weakest best"])
def test_the_fits_the_search_guesses_it_will_need_never_change_its_answer(monkeypatch, profile):
    """Scores scripted by lambda: with few classes the search fits the later rounds around the best lambda so far
    while the first round's weak ones still iterate. Where a weak one then wins, those guesses are wasted, and
    the search must still visit and choose exactly what CLIP's does."""
    def score(index: int) -> float:
        if profile == "peak at lambda 1":
            return 1 - abs(index - 45) / 100
        return 0.9 if index == 0 else 0.8 - abs(index - 48) / 100  # 1e-2 loses to 1, then 1e-6 beats both

    monkeypatch.setattr(linear_probe, "accuracy", lambda fit, *_: score(LAMBDA_GRID.index(fit.lam)))
    x, y = separable(9, 400, 16, 4, 1.0)  # the weak lambdas take 70-190 iterations: time for guesses
    result = search_lambda(x, y, x, y, 4)
    peak, visited = _clips_search(score)
    assert result.lam == LAMBDA_GRID[peak]
    assert set(result.tried) == {LAMBDA_GRID[i] for i in visited}
    fitted = {LAMBDA_GRID.index(fit.lam) for fit in result.path.values()}
    if profile == "peak at lambda 1":
        assert fitted == visited  # every guess was needed
    else:
        assert fitted > visited  # the guesses around lambda 1 were fitted, and not used


def pairs(owners: list[int]) -> torch.Tensor:
    """(caption, image) matches for one image per caption."""
    return torch.tensor(list(enumerate(owners)))


def test_retrieval_ranks_with_several_captions_per_image():
    images = torch.eye(3)  # image i points along axis i
    # captions 0,1 -> image 0; caption 2 -> image 1; caption 3 -> image 2
    texts = torch.tensor([[0.1, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.9, 0.5]])
    metrics = retrieval_metrics(images, texts, pairs([0, 0, 1, 2]))
    # text -> image ranks: caption0 prefers image1 (rank 2), caption1 rank 1, caption2 rank 1, caption3 rank 2
    assert metrics["image_retrieval_recall@1"] == 0.5 and metrics["image_retrieval_recall@5"] == 1.0
    assert metrics["image_retrieval_mean_rank"] == 1.5 and metrics["image_retrieval_median_rank"] == 1.0
    # image -> text: image0's best own caption (caption1, 1.0) is top -> rank 1; image1: caption0 (1.0) and
    # caption3 (0.9) beat caption2? caption2 scores 1.0 = caption0's 1.0 (tie, not counted) -> rank 1;
    # image2: own caption3 scores 0.5, no other text scores above 0.5 on axis 2 -> rank 1
    assert metrics["text_retrieval_recall@1"] == 1.0 and metrics["text_retrieval_mean_rank"] == 1.0


def test_a_caption_shared_by_several_images_has_them_all_as_correct_answers():
    """One caption ("a red apple.") for images 0 and 1: retrieving either is correct, and neither counts against
    the other; the same rule in both directions."""
    images = torch.eye(3)
    texts = torch.tensor([[0.2, 1.0, 0.0], [0.0, 0.0, 1.0]])  # the shared caption points at image 1
    shared = torch.tensor([[0, 0], [0, 1], [1, 2]])
    metrics = retrieval_metrics(images, texts, shared)
    assert metrics["image_retrieval_recall@1"] == 1.0  # image 1 is top, and it is a correct image
    assert metrics["text_retrieval_recall@1"] == 1.0  # image 0's best text is its own caption
    # had the caption been matched to image 0 alone, image 1 (scored higher) would count as an error
    alone = retrieval_metrics(images, torch.cat([texts, texts[:1]]), torch.tensor([[0, 0], [2, 1], [1, 2]]))
    assert alone["image_retrieval_mean_rank"] == pytest.approx((2 + 1 + 1) / 3)


def test_identical_captions_become_one_query():
    from cloob_core.evaluation.tasks.retrieval import distinct_captions

    texts, matches, first = distinct_captions([["a red apple."], ["a red apple.", "fruit"], ["a pear."]])
    assert texts == ["a red apple.", "fruit", "a pear."] and first == [0, 0, 2]
    assert matches.tolist() == [[0, 0], [0, 1], [1, 1], [2, 2]]
    with pytest.raises(ValueError, match="every image needs at least one caption"):
        distinct_captions([["x"], []])


def test_retrieval_worst_case_ranks():
    images = torch.eye(4)
    texts = torch.eye(4).flip(0)  # every caption points at the wrong image
    metrics = retrieval_metrics(images, texts, pairs(list(range(4))))
    assert metrics["image_retrieval_mean_rank"] == 2.0  # correct image scores 0, one image scores 1
    with pytest.raises(ValueError, match="every image needs at least one match"):
        retrieval_metrics(images, texts[:3], pairs(list(range(3))))


def test_effective_eigenvalues_isotropic_vs_rank_k():
    generator = torch.Generator().manual_seed(0)
    isotropic = torch.randn(20000, 16, generator=generator, dtype=torch.float64)
    assert effective_eigenvalues(eigen_spectrum(isotropic)) == 16
    basis = torch.linalg.qr(torch.randn(16, 3, generator=generator, dtype=torch.float64)).Q
    rank3 = torch.randn(5000, 3, generator=generator, dtype=torch.float64) @ basis.T
    spectrum = eigen_spectrum(rank3)
    assert effective_eigenvalues(spectrum) == 3 and spectrum[3:].abs().max() < 1e-10
    assert effective_eigenvalues(torch.tensor([90.0, 9.0, 1.0], dtype=torch.float64)) == 2  # 99% reached at 2
    assert effective_eigenvalues(torch.tensor([90.0, 8.9, 1.1], dtype=torch.float64)) == 3
    assert effective_eigenvalues(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)) == 1


def test_ajne_statistic_uniform_vs_collapsed():
    generator = torch.Generator().manual_seed(1)
    uniform = torch.randn(3000, 32, generator=generator)
    assert ajne_statistic(uniform) == pytest.approx(0.25, abs=0.1)
    collapsed = torch.ones(1000, 32)
    assert ajne_statistic(collapsed) == pytest.approx(1000 / 4, rel=1e-3)
    orthonormal = torch.eye(64)
    assert ajne_statistic(orthonormal) == pytest.approx(64 / 4 - (64 * 63 / 2) * (math.pi / 2) / (math.pi * 64))
    assert ajne_statistic(uniform, block=100) == pytest.approx(ajne_statistic(uniform, block=5000))


def test_alignment_similarities_and_saturation():
    x = torch.nn.functional.normalize(torch.randn(50, 8, generator=torch.Generator().manual_seed(2)), dim=1)
    assert alignment(x, x) == {"matched_cosine_mean": pytest.approx(1.0), "matched_squared_distance_mean":
                               pytest.approx(0.0, abs=1e-12)}
    matched, unmatched = matched_vs_unmatched(x, x, top_k=10)
    assert matched.shape == (50,) and unmatched.shape == (500,) and unmatched.max() < 1.0
    identity = torch.eye(10)
    assert positive_probability(identity, identity, 30.0) == pytest.approx(math.e**30 / (math.e**30 + 9))
    assert positive_probability(identity, identity, 1e-9) == pytest.approx(0.1)


def separable(seed: int, n: int, d: int, classes: int, scale: float):
    """Un-normalised features with class means and power-law noise, nearly separable: weak lambdas win there, and
    a gradient near zero says little about how far the logits still are from the optimum's."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=generator)
    noise = torch.randn(n, d, generator=generator) * torch.arange(1, d + 1) ** -0.5
    features = torch.randn(classes, d, generator=generator)[labels] * 0.3 + noise
    return features * scale + 1.0, labels


@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])
def test_convergence_is_scale_free(scale):
    """Scaling the features by s and lambda by s^2 gives the same optimum logits: the stopping test lives in logit
    units, so the fit stops equally close to it at every scale. (A largest-gradient test, 1e-8, stops 0.03 away at
    s = 0.1 and s = 1, 0.001 at s = 30.)"""
    x, y = separable(7, 600, 40, 8, 1.0)
    reference = fit_logistic(x, y, 8, 1e-4, tolerance=1e-8, max_iter=5000).predict_scores(x)
    scaled = fit_logistic(x * scale, y, 8, 1e-4 * scale**2).predict_scores(x * scale)
    difference = (scaled - scaled.mean(1, keepdim=True)) - (reference - reference.mean(1, keepdim=True))
    assert float(difference.abs().max()) < 5e-3, float(difference.abs().max())


def test_a_warm_start_from_another_lambda_reaches_the_same_optimum():
    x, y = separable(8, 800, 32, 6, 3.0)
    for lam, other in ((1e-5, 1e-3), (1.0, 1e-5)):
        cold = fit_logistic(x, y, 6, lam)
        warm = fit_logistic(x, y, 6, lam, start=fit_logistic(x, y, 6, other))
        assert warm.iterations < cold.iterations or lam == 1.0
        # Both stop within the tolerance (1e-4 rms logit) of the one optimum, so within a few 1e-4 of each other.
        torch.testing.assert_close(torch.softmax(warm.predict_scores(x), 1), torch.softmax(cold.predict_scores(x), 1),
                                   rtol=0, atol=5e-4)


def test_the_warm_started_search_scores_every_lambda_as_a_cold_fit_does():
    """The search's path (warm starts) changes no lambda's validation accuracy beyond rows that are ties within
    the tolerance (top two logits closer than 1e-3), so not the lambda it picks."""
    x, y = separable(9, 1600, 24, 5, 4.0)
    result = search_lambda(x[:800], y[:800], x[800:], y[800:], 5)
    for lam, score in result.tried.items():
        cold = fit_logistic(x[:800], y[:800], 5, lam)
        top2 = cold.predict_scores(x[800:]).topk(2, dim=1).values
        near_ties = int((top2[:, 0] - top2[:, 1] < 1e-3).sum())
        assert abs(accuracy(cold, x[800:], y[800:]) - score) * 800 <= near_ties + 1e-6, lam
    assert result.fit.lam == result.lam
    assert 0.5 < result.validation_accuracy < 1.0  # not a degenerate case where every lambda ties


def test_float32_cross_entropy_resolves_a_well_classified_row():
    """A row classified by a margin of 20 has loss ~2e-9: the usual ``logsumexp - picked`` rounds it to 0 in
    float32; taken relative to the margins it keeps float32's relative precision, and so does its gradient."""
    logits = torch.tensor([[30.0, 10.0, 5.0], [1.0, 3.0, 2.0]], dtype=torch.float64)
    truth = torch.tensor([0, 2])
    exact = torch.nn.functional.cross_entropy(logits, truth, reduction="none")
    expected_residual = torch.softmax(logits, 1) - torch.nn.functional.one_hot(truth, 3)
    assert float(torch.nn.functional.cross_entropy(logits.float(), truth, reduction="none")[0]) == 0.0
    margins = (logits - logits.gather(1, truth[:, None])).float().unsqueeze(1)  # [m, k=1, C]
    loss, residual = logistic._cross_entropy(margins, truth.view(2, 1, 1))
    torch.testing.assert_close(loss.squeeze(1).double(), exact, rtol=1e-6, atol=0)
    torch.testing.assert_close(residual.squeeze(1).double(), expected_residual, rtol=1e-6, atol=1e-30)


def test_the_deferred_two_loop_equals_nocedals_two_loop():
    """Driven as the solver drives it (each step a multiple of the direction, the new gradient the old plus the
    change): the kept Gram matrix, whose newest row and column come from the directions' inner products and not
    from passes over the history, is ``S^T Y``, and the direction is Nocedal's; with the ring buffer wrapped
    around, a skipped pair (rho 0), two problems with their own scales, and one problem alone."""
    generator = torch.Generator().manual_seed(3)
    classes, d, history = 3, 4, 5
    size = classes * d + classes
    state = logistic._LBFGS(history, classes, torch.rand(d, generator=generator, dtype=torch.float64), 10)
    state.add(torch.zeros(2, size, dtype=torch.float64), torch.tensor([0.5, 2.0], dtype=torch.float64),
              torch.arange(2))
    state.scale = torch.tensor([0.7, 1.3], dtype=torch.float64)
    curvature = torch.rand(size, dtype=torch.float64, generator=generator) + 0.5
    grad, pairs, everyone = torch.randn(2, size, dtype=torch.float64, generator=generator), [], torch.arange(2)
    for step in range(8):  # wraps the buffer of 5
        direction, pair_dots = state._direction(grad, everyone, slice(None))
        length = torch.rand(2, 1, dtype=torch.float64, generator=generator) + 0.5
        s = length * direction
        y = s * curvature + 0.1 * torch.randn(2, size, dtype=torch.float64, generator=generator)
        sy = (s * y).sum(1)
        rho = 1 / sy * (0.0 if step == 6 else 1.0)  # step 6 skipped
        state._store(everyone, slice(None), s, y, sy, rho, length * pair_dots, torch.ones(2, dtype=torch.bool))
        pairs.append((s, y, rho))
        grad = grad + y
    q, alphas = grad.clone(), []
    for s, y, rho in reversed(pairs[-history:]):
        alphas.append(rho * (s * q).sum(1))
        q -= alphas[-1][:, None] * y
    r = state._precondition(q, slice(None)) * state.scale[:, None]
    for (s, y, rho), alpha in zip(pairs[-history:], reversed(alphas), strict=True):
        r += (alpha - rho * (y * r).sum(1))[:, None] * s
    torch.testing.assert_close(state._direction(grad[1:], torch.tensor([1]), torch.tensor([1]))[0], -r[1:],
                               rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(state._direction(grad, everyone, slice(None))[0], -r, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(state.gram, torch.bmm(state.steps, state.changes.transpose(1, 2)), rtol=1e-9,
                               atol=1e-9)


def test_path_starts_interpolate_between_fits_and_extrapolate_beyond_them():
    def fit(value: float, lam: float) -> ProbeFit:
        return ProbeFit(torch.full((2, 3), value), torch.full((2,), -value), lam, 1)

    fits = {10: fit(1.0, LAMBDA_GRID[10]), 20: fit(3.0, LAMBDA_GRID[20])}
    between = path_start(fits, 15)
    assert torch.equal(between.weight, torch.full((2, 3), 2.0)) and torch.equal(between.bias, torch.full((2,), -2.0))
    assert between.lam == pytest.approx(LAMBDA_GRID[15])
    assert torch.equal(path_start(fits, 30).weight, torch.full((2, 3), 5.0))  # beyond: along the same line
    assert torch.equal(path_start(fits, 0).weight, torch.full((2, 3), -1.0))
    assert path_start(fits, 20) is fits[20]
    assert path_start({4: fits[10]}, 30) is fits[10] and path_start({}, 3) is None


def test_a_few_shot_probe_with_a_validation_split_fits_k_images_per_class_only(monkeypatch):
    """CLIP_benchmark #125: refitting on train + validation gives a "k-shot" probe more than k images per class.
    The validation split picks lambda; the final fit sees the k-shot training images alone."""
    from types import SimpleNamespace

    generator = torch.Generator().manual_seed(0)
    features = {name: torch.randn(rows, 8, generator=generator) for name, rows in
                (("train", 60), ("val", 30), ("test", 20))}
    sets = {name: SimpleNamespace(name=name) for name in features}
    embedded = {name: Embedded(x, [i % 3 for i in range(len(x))], None, {}, 0, "fp32") for name, x in features.items()}
    monkeypatch.setattr(linear_probe, "image_features", lambda model, images, encoding: embedded[images.name])
    fitted_rows = []
    real_fit = linear_probe.fit_logistic

    def fit(x, *args, **kwargs):
        fitted_rows.append(len(x))
        return real_fit(x, *args, **kwargs)

    class Fitted(Exception):
        pass

    def probe(*args, **kwargs):  # the real probe, then stop before the records (which need a real model)
        linear_probe_fit(*args, **kwargs)
        raise Fitted

    linear_probe_fit = linear_probe.linear_probe
    monkeypatch.setattr(linear_probe, "fit_logistic", fit)
    monkeypatch.setattr(linear_probe, "linear_probe", probe)
    for few_shot, rows in ((2, 6), (None, 90)):  # 2 per class, validation apart; a full probe refits on both
        with pytest.raises(Fitted):
            linear_probe.linear_probe_task(None, sets["train"], sets["test"], Path(tempfile.mkdtemp()), None,
                                           validation=sets["val"], few_shot=few_shot, seed=0)
        assert fitted_rows[-1] == rows, (few_shot, fitted_rows)
