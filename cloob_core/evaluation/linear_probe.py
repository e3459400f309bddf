"""Linear probe as CLIP evaluates it (Radford et al. 2021, App. A.3): multinomial logistic regression on frozen
image features, fit with L-BFGS, with the L2 strength chosen by CLIP's parametric binary search.

The objective is scikit-learn's ``LogisticRegression(C=1/lambda)``: ``sum_i CE_i + lambda/2 ||W||^2`` (no penalty
on the bias), divided by n as scikit-learn does, so its tolerance means the same. It is minimised in torch,
float32, on the features' device.

The search: 97 values of lambda, log-spaced over [1e-6, 1e6] (8 per decade). Evaluate every 16th (1e-6, 1e-4,
..., 1e6) on the validation split, then around the best one at distance 8, 4, 2 and 1 grid steps, keeping the
best; ties go to the larger lambda (the simpler model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

log = logging.getLogger(__name__)
LAMBDA_GRID = torch.logspace(-6, 6, 97, dtype=torch.float64).tolist()
INITIAL_INDICES = list(range(0, 97, 16))
SPANS = (8, 4, 2, 1)


@dataclass
class ProbeFit:
    weight: Tensor  # [C, d]
    bias: Tensor  # [C]
    lam: float
    iterations: int

    def predict_scores(self, features: Tensor) -> Tensor:
        return features @ self.weight.T + self.bias


def fit_logistic(features: Tensor, labels: Tensor, num_classes: int, lam: float, init: ProbeFit | None = None,
                 max_iter: int = 1000, tolerance: float = 1e-6) -> ProbeFit:
    """Minimise ``mean CE + lam / (2 n) ||W||^2`` with L-BFGS (strong Wolfe line search) until the largest
    gradient entry is below ``tolerance``.

    The default converges to the optimum, which is unique for lam > 0, so the result is the model lam defines,
    not a point on the solver's path. (scikit-learn's default tol=1e-4 on the same objective stops early when
    lam is small, and its accuracy there depends on where it stopped; converged, the two agree.)
    """
    n, d = features.shape
    weight = torch.zeros(num_classes, d, dtype=features.dtype, device=features.device)
    bias = torch.zeros(num_classes, dtype=features.dtype, device=features.device)
    if init is not None:
        weight.copy_(init.weight)
        bias.copy_(init.bias)
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=max_iter, tolerance_grad=tolerance,
                                  tolerance_change=1e-12, history_size=20, line_search_fn="strong_wolfe")
    scale = lam / (2.0 * n)

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(features @ weight.T + bias, labels) + scale * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    iterations = optimizer.state[optimizer._params[0]].get("n_iter", 0)
    return ProbeFit(weight.detach(), bias.detach(), lam, int(iterations))


def accuracy(fit: ProbeFit, features: Tensor, labels: Tensor) -> float:
    return float((fit.predict_scores(features).argmax(dim=1) == labels).float().mean())


@dataclass
class SearchResult:
    lam: float
    validation_accuracy: float
    tried: dict[float, float] = field(default_factory=dict)  # lambda -> validation accuracy


def search_lambda(train_x: Tensor, train_y: Tensor, val_x: Tensor, val_y: Tensor, num_classes: int,
                  max_iter: int = 1000, tolerance: float = 1e-6) -> SearchResult:
    """CLIP's parametric binary search over ``LAMBDA_GRID``; see the module docstring. Every fit converges
    (``tolerance``), so each lambda is judged by the model it defines, whatever the path to it."""
    scores: dict[int, float] = {}

    def evaluate(index: int) -> float:
        if index not in scores:
            # Cold start, as scikit-learn: with weak regularisation (nearly separable features) L-BFGS stops on a
            # flat valley floor, and where depends on the starting point; a warm start would make the lambda
            # choice depend on the order of the search.
            fit = fit_logistic(train_x, train_y, num_classes, LAMBDA_GRID[index], max_iter=max_iter,
                               tolerance=tolerance)
            scores[index] = accuracy(fit, val_x, val_y)
            log.debug("lambda %.3g: validation accuracy %.4f (%d iterations)", LAMBDA_GRID[index], scores[index],
                      fit.iterations)
        return scores[index]

    def best(indices: list[int]) -> int:
        return max(indices, key=lambda i: (evaluate(i), i))  # ties: the larger lambda

    peak = best(INITIAL_INDICES)
    for span in SPANS:
        candidates = sorted({max(peak - span, 0), peak, min(peak + span, len(LAMBDA_GRID) - 1)})
        peak = best(candidates)
    return SearchResult(LAMBDA_GRID[peak], scores[peak], {LAMBDA_GRID[i]: s for i, s in sorted(scores.items())})


def few_shot_indices(labels: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """``k`` random examples of every class (all of a class that has fewer)."""
    chosen = []
    for c in labels.unique().tolist():
        members = torch.nonzero(labels == c).flatten()
        chosen.append(members[torch.randperm(len(members), generator=generator)[:k]])
    return torch.cat(chosen).sort().values


def linear_probe(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, num_classes: int,
                 val_x: Tensor | None = None, val_y: Tensor | None = None, seed: int = 0,
                 max_iter: int = 1000) -> tuple[ProbeFit, SearchResult]:
    """Search lambda on the validation split (or a random half of train), refit on train (+ val), return the
    final fit; score it on ``test_x`` with :func:`accuracy`."""
    if val_x is None:
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(train_y), generator=generator)
        half = len(order) // 2
        search = search_lambda(train_x[order[:half]], train_y[order[:half]], train_x[order[half:]],
                               train_y[order[half:]], num_classes, max_iter)
        final_x, final_y = train_x, train_y
    else:
        search = search_lambda(train_x, train_y, val_x, val_y, num_classes, max_iter)
        final_x, final_y = torch.cat([train_x, val_x]), torch.cat([train_y, val_y])
    fit = fit_logistic(final_x, final_y, num_classes, search.lam, max_iter=max_iter)
    return fit, search
