"""Multinomial logistic regression fitted for several L2 strengths at once, with a batched L-BFGS.

The objective is scikit-learn's ``LogisticRegression(C=1/lam)``: ``mean CE + lam/(2n) ||W||^2`` (no penalty on the
bias). The lambda search of the linear probe fits one model per lambda on the same features; fitting them as one
batch shares every pass over the features (one matmul with K*C columns instead of K with C), which is where the
time goes for probes with few classes. Each problem keeps its own L-BFGS history, step length and stopping test,
so it converges to the same optimum as a fit on its own.

Gradients are written out (softmax minus one-hot) rather than taken by autograd, and the features are visited in
row chunks, so memory stays bounded for large probe sets (ImageNet-sized n x C logits never exist at once).
The iterations run in float32, with each row's loss resolved relative to its margins (``_cross_entropy``); a fit
goes on in float64 only where float32 stops resolving progress before it has converged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

ARMIJO = 1e-4  # sufficient-decrease constant of the backtracking line search
# Hager & Zhang's approximate Wolfe test (SIAM J. Optim. 2005), for steps near the optimum where float32 losses no
# longer resolve the decrease but the directional derivative does: slope within [0.9, -0.8] of the start's and the
# loss up by at most 1e-6 of itself.
CURVATURE, APPROXIMATE_SLOPE, LOSS_SLACK = 0.9, 0.8, 1e-6
MAX_HALVINGS = 20
ROUGH_HALVINGS = 4  # a float32 line search that needs more has hit float32's resolution: go on in float64
# Convergence: the L-BFGS step, its estimate of the way to the optimum, moves no class's logit by more than this
# (root mean square over the training rows). Logits are scale-free, unlike the gradient: on un-normalised or nearly
# separable features a weakly regularised fit has a largest gradient entry below 1e-8 while its logits are still
# far from the optimum's (validation accuracy 14 points off, docs/performance.md).
TOLERANCE = 1e-4
CHUNK_ELEMENTS = 1 << 23  # logits per chunk of rows (64 MiB)
DTYPE = torch.float64


@dataclass
class ProbeFit:
    weight: Tensor  # [C, d]
    bias: Tensor  # [C]
    lam: float
    iterations: int

    def predict_scores(self, features: Tensor) -> Tensor:
        return features.to(self.weight.dtype) @ self.weight.T + self.bias


class RotatedFeatures:
    """A probe's training features, centred and rotated into their covariance eigenbasis, once for every fit.

    Three exact reparametrisations make L-BFGS fast on real embeddings, which sit in a narrow cone (large common
    mean) with a steep eigen-spectrum: the features become ``z = (x - mu) V`` (the weights become ``W V``, the
    bias ``b + W mu``: the same set of models with the penalty untouched, as ``V`` is orthogonal), and the search
    direction starts from ``(Sigma + tau I)^-1`` (the Hessian at the start, up to the softmax factor) instead of
    the identity, diagonal in that basis. The optimum is the same; only the path to it is shorter, and no
    iteration multiplies by a d x d matrix.

    The covariance is summed in float32 (it only shapes the path; ``V`` is orthogonal to float64 precision
    whatever it is) and ``z`` is kept in float32; its float64 copy (twice the features' float32 memory) is made
    only for a fit that float32 cannot finish.
    """

    def __init__(self, features: Tensor) -> None:
        n, d = features.shape
        self.features, self.rows = features, max(1, CHUNK_ELEMENTS // d)
        self.mean = features.to(DTYPE).mean(dim=0)
        covariance = torch.zeros(d, d, dtype=torch.float32, device=features.device)
        for start in range(0, n, self.rows):
            centred = self._centred(start, torch.float32)
            covariance.addmm_(centred.T, centred)
        spectrum, self.basis = torch.linalg.eigh(covariance.to(DTYPE) / n)
        self.spectrum = spectrum.clamp(min=0)
        self.rough = self._rotate(torch.float32)
        self._exact: Tensor | None = None

    @property
    def exact(self) -> Tensor:
        if self._exact is None:
            self._exact = self._rotate(DTYPE)
        return self._exact

    def _centred(self, start: int, dtype: torch.dtype) -> Tensor:
        return self.features[start : start + self.rows].to(dtype) - self.mean.to(dtype)

    def _rotate(self, dtype: torch.dtype) -> Tensor:
        rotated = torch.empty(self.features.shape, dtype=dtype, device=self.features.device)
        basis = self.basis.to(dtype)
        for start in range(0, len(rotated), self.rows):
            torch.mm(self._centred(start, dtype), basis, out=rotated[start : start + self.rows])
        return rotated

    def to_rotated(self, fit: ProbeFit) -> Tensor:
        """A model as the objective's flat parameters: ``W V``, then ``b + W mu``."""
        weight = fit.weight.to(DTYPE)
        return torch.cat([(weight @ self.basis).flatten(), fit.bias.to(DTYPE) + weight @ self.mean])

    def from_rotated(self, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """The inverse of ``to_rotated`` for one model's ``[C, d]`` weights and ``[C]`` bias."""
        weight = weight @ self.basis.T
        return weight, bias - weight @ self.mean


def _cross_entropy(margins: Tensor, truth: Tensor) -> tuple[Tensor, Tensor]:
    """Cross-entropy and ``softmax - one-hot`` from the margins ``l_c - l_y`` ([m, k, C], overwritten), resolved
    relative to their own size: a well-classified row's loss ``log(1 + sum_{c != y} e^{l_c - l_y})`` is taken with
    ``log1p``, not as the difference of two large logits, and its true class's residual as minus the sum of the
    others. In float32 the loss then still resolves a weakly regularised fit's progress, where the usual form
    rounds it to zero."""
    margins.scatter_(2, truth, float("-inf"))  # the other classes only
    top = margins.amax(dim=2, keepdim=True).clamp_(min=0)  # [m, k, 1]
    others = margins.sub_(top).exp_()  # e^{l_c - l_y - top}, 0 at the true class
    total = others.sum(dim=2, keepdim=True)
    cross_entropy = top + torch.log1p(torch.expm1(-top) + total)  # log(e^{-top} + total) + top
    residual = others.mul_(torch.exp(top - cross_entropy))  # p_c = e^{l_c - l_y - CE}
    residual.scatter_(2, truth, -residual.sum(dim=2, keepdim=True))  # p_y - 1 = -sum of the others
    return cross_entropy.squeeze(2), residual


class _Objective:
    """Loss and gradient of K independent problems on shared, rotated features (``RotatedFeatures``);
    parameters are flat ``[K, C*d + C]`` (rotated weights, then biases relative to the centred features).
    Centred, the sums over rows do not cancel a large common mean, so float32 resolves the gradient much closer to
    the optimum."""

    def __init__(self, rotated: Tensor, labels: Tensor, num_classes: int, spectrum: Tensor) -> None:
        self.features, self.labels, self.classes = rotated, labels, num_classes
        self.lams = torch.zeros(0, dtype=rotated.dtype, device=rotated.device)  # by row, set by the L-BFGS state
        self.spectrum = spectrum
        self.n, self.dim = rotated.shape

    def split(self, theta: Tensor) -> tuple[Tensor, Tensor]:
        c, d = self.classes, self.dim
        return theta[:, : c * d].reshape(len(theta), c, d), theta[:, c * d :]

    def __call__(self, theta: Tensor, problems: Tensor) -> tuple[Tensor, Tensor]:
        k, c, n, d = len(problems), self.classes, self.n, self.dim
        weight, bias = self.split(theta)
        flat_weight = weight.reshape(k * c, d)
        loss = torch.zeros(k, dtype=DTYPE, device=theta.device)
        grad_weight = torch.zeros_like(flat_weight)
        grad_bias = torch.zeros_like(bias)
        rows = max(1, CHUNK_ELEMENTS // (k * c))
        for start in range(0, n, rows):
            x, y = self.features[start : start + rows], self.labels[start : start + rows]
            m = len(y)
            logits = (x @ flat_weight.T).view(m, k, c) + bias
            truth = y.view(m, 1, 1).expand(m, k, 1)
            margins = logits.sub_(logits.gather(2, truth))  # l_c - l_y, in place; 0 at the true class
            cross_entropy, residual = _cross_entropy(margins, truth)
            loss += cross_entropy.sum(dim=0, dtype=DTYPE)
            grad_weight.addmm_(residual.view(m, k * c).T, x)
            grad_bias += residual.sum(dim=0)
        lams = self.lams[problems]
        loss = loss / n + lams / (2 * n) * weight.pow(2).sum(dim=(1, 2))
        grad_weight = grad_weight.view(k, c, d) / n + (lams / n).view(k, 1, 1) * weight
        return loss, torch.cat([grad_weight.reshape(k, c * d), grad_bias / n], dim=1)

    def logit_change(self, step: Tensor) -> Tensor:
        """Largest root-mean-square change of one class's logit over the training rows that ``step`` makes:
        ``sqrt(d_c^T Sigma d_c + db'_c^2)``, the centred bias being the change at the mean row."""
        weight, bias = self.split(step)
        return ((weight.pow(2) * self.spectrum).sum(dim=2) + bias.pow(2)).sqrt().amax(dim=1)

    def precondition(self, vector: Tensor, problems: Tensor) -> Tensor:
        """``(Sigma + tau_k I)^-1`` on each class's weights (diagonal in the eigenbasis), identity on the biases;
        ``tau_k = lam_k C / n`` is the penalty's share of the Hessian at the start (softmax factor ~1/C), floored
        at 1e-6 of the top eigenvalue so that directions the features do not span stay at rounding level."""
        weight, bias = self.split(vector)
        floor = self.lams[problems] * self.classes / self.n + 1e-6 * self.spectrum[-1].clamp(min=1e-12)
        inverse = 1.0 / (self.spectrum.unsqueeze(0) + floor.unsqueeze(1))  # [k, d]
        return torch.cat([(weight * inverse.unsqueeze(1)).reshape(len(vector), -1), bias], dim=1)


def fit_logistic_batch(features: Tensor, labels: Tensor, num_classes: int, lams: Sequence[float],
                       max_iter: int = 1000, tolerance: float = TOLERANCE, history: int = 10,
                       rotated: RotatedFeatures | None = None,
                       starts: Sequence[ProbeFit | None] | None = None) -> list[ProbeFit]:
    """Fit one model per lambda (see ``LogisticSolver``); ``rotated`` (of ``features``) may be passed when calls
    share features."""
    solver = LogisticSolver(features, labels, num_classes, max_iter=max_iter, tolerance=tolerance, history=history,
                            rotated=rotated)
    problems = solver.add(lams, starts)
    fits = solver.run()
    return [fits[p] for p in problems]


class LogisticSolver:
    """One model per lambda on shared features, fitted by one batched L-BFGS; each stops when its L-BFGS step would
    move no logit by more than ``tolerance`` (see ``TOLERANCE``), when no step along its direction is acceptable
    any more (rounding level), or after ``max_iter`` iterations.

    Converged, the result is the optimum lambda defines, whatever the path to it: so a fit may start from another
    lambda's model (a warm start along the regularisation path) and still give the same answer.
    (scikit-learn's default tol=1e-4 stops weakly regularised fits of nearly separable features well before it,
    and their accuracy then depends on where the solver stopped.)

    Lambdas may be added while it runs: ``run`` hands each fit to ``on_fit`` as it finishes, which may ``add``
    more, and they join the batch at the next iteration. A search so starts the fits it will need next beside
    the weak lambdas still iterating, whose products have room for more columns. A finished fit's L-BFGS memory
    is dropped, so memory follows the problems running, not all the search has fitted.

    The iterations run in float32 (half the memory traffic) until a fit converges or float32 stops resolving its
    progress; the same L-BFGS state then continues in float64 for the fits float32 could not finish.
    """

    def __init__(self, features: Tensor, labels: Tensor, num_classes: int, *, max_iter: int = 1000,
                 tolerance: float = TOLERANCE, history: int = 10, rotated: RotatedFeatures | None = None) -> None:
        self.rotated = rotated or RotatedFeatures(features)
        self.labels, self.classes, self.max_iter, self.tolerance = labels, num_classes, max_iter, tolerance
        self.rough = _Objective(self.rotated.rough, labels, num_classes, self.rotated.spectrum.float())
        self._exact: _Objective | None = None
        self.state = _LBFGS(num_classes * features.shape[1] + num_classes, history, num_classes, features.device)
        self.problems = 0

    def add(self, lams: Sequence[float], starts: Sequence[ProbeFit | None] | None = None) -> list[int]:
        """New problems (their numbers), each starting from its ``starts`` model or from zero."""
        device = self.state.theta.device
        theta = torch.zeros(len(lams), self.state.size, dtype=DTYPE, device=device)
        for i, start in enumerate(starts or []):
            if start is not None:
                theta[i] = self.rotated.to_rotated(start)
        numbers = list(range(self.problems, self.problems + len(lams)))
        self.problems += len(lams)
        self.state.add(theta, torch.tensor(lams, dtype=DTYPE, device=device), torch.tensor(numbers, device=device))
        return numbers

    def stop(self) -> None:
        """End the problems still running, unreported (from ``on_fit``: the fits they were for are not needed)."""
        self.state.final[:] = True

    def run(self, on_fit: Callable[[int, ProbeFit], None] | None = None) -> dict[int, ProbeFit]:
        """Iterate until every problem has finished (or ``stop``); the fits by problem number."""
        fits: dict[int, ProbeFit] = {}

        def report(rows: Tensor) -> None:
            for row in rows.tolist():
                number = int(self.state.numbers[row])
                fits[number] = self._fit(row)
                if on_fit is not None:
                    on_fit(number, fits[number])

        while bool(self.state.runnable(exact=False).any() or self.state.runnable(exact=True).any()):
            self.state.run(self.rough, self.tolerance, self.max_iter, ROUGH_HALVINGS, report, exact=False)
            if bool(self.state.runnable(exact=True).any()):
                self.state.run(self.exact, self.tolerance, self.max_iter, MAX_HALVINGS, report, exact=True)
        return fits

    @property
    def exact(self) -> _Objective:
        if self._exact is None:
            self._exact = _Objective(self.rotated.exact, self.labels, self.classes, self.rotated.spectrum)
        return self._exact

    def _fit(self, row: int) -> ProbeFit:
        weight, bias = self.rough.split(self.state.theta[row : row + 1])
        plain_weight, plain_bias = self.rotated.from_rotated(weight[0], bias[0])
        return ProbeFit(plain_weight, plain_bias, float(self.state.lams[row]), int(self.state.iterations[row]))


class _LBFGS:
    """L-BFGS state of K problems, one row each (float64, whatever precision the objective evaluates in).
    Problems may be added while it runs; finished ones are dropped at the next iteration."""

    def __init__(self, size: int, history: int, num_classes: int, device: torch.device) -> None:
        self.size, self.history, self.stored, self.classes = size, history, 0, num_classes
        self.theta = torch.zeros(0, size, dtype=DTYPE, device=device)
        self.lams = torch.zeros(0, dtype=DTYPE, device=device)
        self.numbers = torch.zeros(0, dtype=torch.long, device=device)  # the solver's problem numbers
        self.steps = torch.zeros(0, history, size, dtype=DTYPE, device=device)
        self.changes = torch.zeros_like(self.steps)
        self.inverse_curvature = torch.zeros(0, history, dtype=DTYPE, device=device)  # 0: empty slot
        self.gram = torch.zeros(0, history, history, dtype=DTYPE, device=device)  # [i, j]: s_i . y_j
        self.scale = torch.zeros(0, dtype=DTYPE, device=device)
        self.iterations = torch.zeros(0, dtype=torch.long, device=device)
        # The step estimates the way to the optimum only once it is scaled by measured curvature: until then (the
        # first step, from zero or from a warm start) it is not a convergence test.
        self.measured = torch.zeros(0, dtype=torch.bool, device=device)
        self.final = torch.zeros(0, dtype=torch.bool, device=device)  # converged, stalled in float64 or out of steps
        self.needs_exact = torch.zeros(0, dtype=torch.bool, device=device)  # stalled in float32

    _ROWS = ("theta", "lams", "numbers", "steps", "changes", "inverse_curvature", "gram", "scale", "iterations",
             "measured", "final", "needs_exact")

    def add(self, theta: Tensor, lams: Tensor, numbers: Tensor) -> None:
        given = {"theta": theta, "lams": lams, "numbers": numbers}
        for name in self._ROWS:
            rows = getattr(self, name)
            # At W = 0 the softmax Hessian is ~ (1/C) Sigma per class: C times the preconditioner is a Newton step.
            fill = float(self.classes) if name == "scale" else 0
            new = given[name] if name in given else torch.full((len(theta), *rows.shape[1:]), fill, dtype=rows.dtype,
                                                               device=rows.device)
            setattr(self, name, torch.cat([rows, new]))

    def runnable(self, exact: bool) -> Tensor:
        return ~self.final & (self.needs_exact == exact)

    def run(self, objective: _Objective, tolerance: float, max_iter: int, halvings: int,
            report: Callable[[Tensor], None], exact: bool) -> None:
        """Iterate this phase's problems (float32 or float64) until each passes the test, stalls or runs out;
        after each iteration ``report`` gets the rows that finished in it, and may add problems, which join a
        float32 phase at once and a float64 one at the next float32 phase."""
        dtype, tiny = objective.features.dtype, torch.finfo(DTYPE).tiny
        active = torch.zeros(0, dtype=torch.bool, device=self.theta.device)
        loss = torch.zeros(0, dtype=DTYPE, device=self.theta.device)
        grad = torch.zeros(0, self.size, dtype=DTYPE, device=self.theta.device)
        active, loss, grad = self._join(objective, active, loss, grad, exact)
        while bool(active.any()):
            idx = torch.nonzero(active).flatten()
            g = grad[idx]
            direction = -self._two_loop(g, idx, objective)
            slope = (g * direction).sum(dim=1)
            uphill = slope >= 0  # rounding broke the curvature pairs: fall back to steepest descent
            if uphill.any():
                direction[uphill], slope[uphill] = -g[uphill], -(g[uphill] * g[uphill]).sum(dim=1)
            converged = self.measured[idx] & ~uphill & (objective.logit_change(direction.to(dtype)) <= tolerance)
            finished = [idx[converged]]
            self.final[idx[converged]] = True
            idx, g, direction, slope = idx[~converged], g[~converged], direction[~converged], slope[~converged]
            if len(idx):
                new_theta, new_loss, new_grad, moved = _backtrack(objective, self.theta[idx], loss[idx], g,
                                                                   direction, slope, idx, halvings)
                s, y = new_theta - self.theta[idx], new_grad - g
                sy, y_my = (s * y).sum(dim=1), (y * objective.precondition(y.to(dtype), idx).to(DTYPE)).sum(dim=1)
                curved = moved & (sy > 1e-10 * y_my)
                slot = self.stored % self.history
                self.stored += 1
                self._store(slot, idx, s, y, torch.where(curved, 1.0 / sy.clamp(min=tiny), 0.0))
                self.scale[idx] = torch.where(curved, sy / y_my.clamp(min=tiny), self.scale[idx])
                self.measured[idx] |= curved
                self.theta[idx], loss[idx], grad[idx] = new_theta, new_loss, new_grad
                self.iterations[idx] += 1
                out_of_steps = self.iterations[idx] >= max_iter
                stalled = ~moved & ~out_of_steps
                ended = out_of_steps | stalled if exact else out_of_steps  # float32 hands a stalled fit on
                self.needs_exact[idx[stalled]] = True
                self.final[idx[ended]] = True
                finished.append(idx[ended])
            finished_now = torch.cat(finished)
            if len(finished_now):
                report(finished_now)  # may add problems or end the others
            active, loss, grad = self._join(objective, active, loss, grad, exact)

    def _join(self, objective: _Objective, active: Tensor, loss: Tensor, grad: Tensor,
              exact: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``active`` (this phase's running rows), ``loss`` and ``grad`` brought up to date: finished rows dropped
        (reported already), problems added since the last call in, with their starting losses and gradients."""
        keep = ~self.final
        if not bool(keep.all()):
            for name in self._ROWS:
                setattr(self, name, getattr(self, name)[keep])
            known = keep[: len(active)]
            active, loss, grad = active[known], loss[known], grad[known]
            objective.lams = self.lams.to(objective.features.dtype)
        known, total = len(active), len(self.theta)
        if total > known:
            objective.lams = self.lams.to(objective.features.dtype)
            active = torch.cat([active, self.runnable(exact)[known:]])
            loss = torch.cat([loss, torch.zeros(total - known, dtype=DTYPE, device=loss.device)])
            grad = torch.cat([grad, torch.zeros(total - known, self.size, dtype=DTYPE, device=grad.device)])
            new = known + torch.nonzero(active[known:]).flatten()
            if len(new):
                start_loss, start_grad = objective(self.theta[new].to(objective.features.dtype), new)
                loss[new], grad[new] = start_loss.to(DTYPE), start_grad.to(DTYPE)
        return active & self.runnable(exact), loss, grad

    def _store(self, slot: int, idx: Tensor, s: Tensor, y: Tensor, rho: Tensor) -> None:
        self.steps[idx, slot], self.changes[idx, slot], self.inverse_curvature[idx, slot] = s, y, rho
        steps, changes, _, _ = self._history(idx)
        self.gram[idx, slot] = torch.bmm(changes, s.unsqueeze(2)).squeeze(2)
        self.gram[idx, :, slot] = torch.bmm(steps, y.unsqueeze(2)).squeeze(2)

    def _history(self, idx: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Steps, changes, inverse curvatures and Gram matrices of problems ``idx`` (no copy when that is all)."""
        if len(idx) == len(self.theta):
            return self.steps, self.changes, self.inverse_curvature, self.gram
        return self.steps[idx], self.changes[idx], self.inverse_curvature[idx], self.gram[idx]

    def _two_loop(self, grad: Tensor, idx: Tensor, objective: _Objective) -> Tensor:
        """The inverse-Hessian product with the initial matrix ``scale * precondition``; empty or skipped slots
        have ``inverse_curvature`` 0 and drop out.

        Nocedal's two loops, with their vector updates deferred: every inner product the loops need is one of
        ``S g``, ``Y r`` or the kept Gram matrix ``s_i . y_j``, so each loop's recursion is one unit-triangular
        solve on [K, m, m] scalars, and the vectors are touched by four batched products instead of 4m vector
        operations."""
        if self.stored == 0:
            return self._initial(grad, idx, objective)
        steps, changes, rho, gram = self._history(idx)
        order = torch.tensor([(self.stored - 1 - j) % self.history for j in range(min(self.stored, self.history))],
                             device=grad.device)  # slots, newest first
        ordered_gram, ordered_rho = gram[:, order][:, :, order], rho[:, order, None]  # [K, m, m], [K, m, 1]
        unit = torch.eye(len(order), dtype=DTYPE, device=grad.device)
        # alpha_i = rho_i (s_i . g - sum over newer j of alpha_j s_i . y_j)
        newer = ordered_gram.tril(-1)
        step_dots = torch.bmm(steps, grad.unsqueeze(2))[:, order]
        alpha = torch.linalg.solve_triangular(unit + ordered_rho * newer, ordered_rho * step_dots, upper=False,
                                              unitriangular=True)
        q = grad - torch.bmm(self._by_slot(alpha, order).transpose(1, 2), changes).squeeze(1)
        r = self._initial(q, idx, objective)
        # beta_i = rho_i (y_i . r + sum over older j of (alpha_j - beta_j) s_j . y_i)
        older = ordered_gram.transpose(1, 2).triu(1)
        change_dots = torch.bmm(changes, r.unsqueeze(2))[:, order]
        beta = torch.linalg.solve_triangular(unit + ordered_rho * older,
                                             ordered_rho * (change_dots + older @ alpha), upper=True,
                                             unitriangular=True)
        return r + torch.bmm(self._by_slot(alpha - beta, order).transpose(1, 2), steps).squeeze(1)

    def _initial(self, vector: Tensor, idx: Tensor, objective: _Objective) -> Tensor:
        """The initial inverse Hessian, ``scale * precondition``, applied to ``vector``."""
        return objective.precondition(vector.to(objective.features.dtype), idx).to(DTYPE) * self.scale[idx, None]

    def _by_slot(self, ordered: Tensor, order: Tensor) -> Tensor:
        """[K, m, 1] values in ``order`` to [K, history, 1] by slot, 0 for slots not in it."""
        by_slot = torch.zeros(len(ordered), self.history, 1, dtype=DTYPE, device=ordered.device)
        by_slot[:, order] = ordered
        return by_slot


def fit_logistic(features: Tensor, labels: Tensor, num_classes: int, lam: float, max_iter: int = 1000,
                 tolerance: float = TOLERANCE, start: ProbeFit | None = None) -> ProbeFit:
    return fit_logistic_batch(features, labels, num_classes, [lam], max_iter, tolerance, starts=[start])[0]


def _backtrack(objective: _Objective, theta: Tensor, loss: Tensor, grad: Tensor, direction: Tensor, slope: Tensor,
               problems: Tensor, halvings: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backtracking per problem: accept a step that passes Armijo's test or the approximate Wolfe test, else halve
    it and re-evaluate only the problems still pending. Returns the new points, losses, gradients and whether each
    problem moved."""
    new_theta, new_loss, new_grad = theta.clone(), loss.clone(), grad.clone()
    step = torch.ones_like(loss)
    pending = torch.arange(len(problems), device=theta.device)
    moved = torch.zeros(len(problems), dtype=torch.bool, device=theta.device)
    for _ in range(halvings):
        trial = theta[pending] + step[pending].unsqueeze(1) * direction[pending]
        trial_loss, trial_grad = objective(trial.to(objective.features.dtype), problems[pending])
        trial_loss, trial_grad = trial_loss.to(DTYPE), trial_grad.to(DTYPE)
        start_loss, start_slope = loss[pending], slope[pending]
        trial_slope = (trial_grad * direction[pending]).sum(dim=1)
        armijo = trial_loss <= start_loss + ARMIJO * step[pending] * start_slope
        approximate_wolfe = ((trial_loss <= start_loss + LOSS_SLACK * start_loss.abs())
                             & (trial_slope >= CURVATURE * start_slope)
                             & (trial_slope <= -APPROXIMATE_SLOPE * start_slope))
        accept = armijo | approximate_wolfe
        done = pending[accept]
        new_theta[done], new_loss[done], new_grad[done] = trial[accept], trial_loss[accept], trial_grad[accept]
        moved[done] = True
        pending = pending[~accept]
        if len(pending) == 0:
            break
        step[pending] *= 0.5
    # Problems still pending found no acceptable step at rounding level: they have converged where they are.
    return new_theta, new_loss, new_grad, moved
