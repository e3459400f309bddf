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

    def __init__(self, rotated: Tensor, labels: Tensor, num_classes: int) -> None:
        self.features, self.labels, self.classes = rotated, labels, num_classes
        self.lams = torch.zeros(0, dtype=rotated.dtype, device=rotated.device)  # by row, set by the L-BFGS state
        self.n, self.dim = rotated.shape

    def __call__(self, theta: Tensor, problems: Tensor) -> tuple[Tensor, Tensor]:
        k, c, n, d = len(problems), self.classes, self.n, self.dim
        weight, bias = _split(theta, c)
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
        self.rough = _Objective(self.rotated.rough, labels, num_classes)
        self._exact: _Objective | None = None
        self.state = _LBFGS(history, num_classes, self.rotated.spectrum, len(labels))
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
            self._exact = _Objective(self.rotated.exact, self.labels, self.classes)
        return self._exact

    def _fit(self, row: int) -> ProbeFit:
        weight, bias = _split(self.state.theta[row : row + 1], self.classes)
        plain_weight, plain_bias = self.rotated.from_rotated(weight[0], bias[0])
        return ProbeFit(plain_weight, plain_bias, float(self.state.lams[row]), int(self.state.iterations[row]))


class _LBFGS:
    """L-BFGS state of K problems, one row each (float64, whatever precision the objective evaluates in).
    Problems may be added while it runs; finished ones are dropped at the next iteration.

    It knows the objective's layout (``classes`` rows of ``d`` rotated weights, then the biases) and the features'
    ``spectrum`` in the rotated basis, for its preconditioner and its convergence test."""

    def __init__(self, history: int, num_classes: int, spectrum: Tensor, rows: int) -> None:
        device = spectrum.device
        self.history, self.stored, self.classes, self.rows = history, 0, num_classes, rows
        self.column_slot = 0  # the slot of the pair whose column is due
        self.spectrum = spectrum.to(DTYPE)
        self.size = num_classes * len(spectrum) + num_classes
        self.theta = torch.zeros(0, self.size, dtype=DTYPE, device=device)
        self.lams = torch.zeros(0, dtype=DTYPE, device=device)
        self.numbers = torch.zeros(0, dtype=torch.long, device=device)  # the solver's problem numbers
        self.inverse = torch.zeros(0, len(spectrum), dtype=DTYPE, device=device)  # the preconditioner, by row
        self.steps = torch.zeros(0, history, self.size, dtype=DTYPE, device=device)
        self.changes = torch.zeros_like(self.steps)
        self.inverse_curvature = torch.zeros(0, history, dtype=DTYPE, device=device)  # 0: empty slot
        self.gram = torch.zeros(0, history, history, dtype=DTYPE, device=device)  # [i, j]: s_i . y_j
        # s_i . g at the row's last direction, by slot: the next one gives the newest pair's column of ``gram``
        # as a difference (``_fill_column``), with no pass over the history.
        self.step_dots = torch.zeros(0, history, dtype=DTYPE, device=device)
        self.column_due = torch.zeros(0, dtype=torch.bool, device=device)
        self.scale = torch.zeros(0, dtype=DTYPE, device=device)
        self.iterations = torch.zeros(0, dtype=torch.long, device=device)
        # The step estimates the way to the optimum only once it is scaled by measured curvature: until then (the
        # first step, from zero or from a warm start) it is not a convergence test.
        self.measured = torch.zeros(0, dtype=torch.bool, device=device)
        self.final = torch.zeros(0, dtype=torch.bool, device=device)  # converged, stalled in float64 or out of steps
        self.needs_exact = torch.zeros(0, dtype=torch.bool, device=device)  # stalled in float32

    _ROWS = ("theta", "lams", "numbers", "inverse", "steps", "changes", "inverse_curvature", "gram", "step_dots",
             "column_due", "scale", "iterations", "measured", "final", "needs_exact")

    def add(self, theta: Tensor, lams: Tensor, numbers: Tensor) -> None:
        # ``(Sigma + tau I)^-1`` on each class's weights (diagonal in the eigenbasis), identity on the biases;
        # ``tau = lam C / n`` is the penalty's share of the Hessian at the start (softmax factor ~1/C), floored at
        # 1e-6 of the top eigenvalue so that directions the features do not span stay at rounding level.
        floor = lams * self.classes / self.rows + 1e-6 * self.spectrum[-1].clamp(min=1e-12)
        given = {"theta": theta, "lams": lams, "numbers": numbers,
                 "inverse": 1.0 / (self.spectrum.unsqueeze(0) + floor.unsqueeze(1))}
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
        tiny = torch.finfo(DTYPE).tiny
        active = torch.zeros(0, dtype=torch.bool, device=self.theta.device)
        loss = torch.zeros(0, dtype=DTYPE, device=self.theta.device)
        grad = torch.zeros(0, self.size, dtype=DTYPE, device=self.theta.device)
        active, loss, grad = self._join(objective, active, loss, grad, exact)
        while bool(active.any()):
            idx = torch.nonzero(active).flatten()
            rows = _rows(idx, len(active))  # a slice when every row runs: views, not copies
            g = grad[rows]
            direction, pair_dots = self._direction(g, idx, rows)
            slope = (g * direction).sum(dim=1)
            uphill = slope >= 0  # rounding broke the curvature pairs: fall back to steepest descent
            if uphill.any():
                direction[uphill], slope[uphill] = -g[uphill], -(g[uphill] * g[uphill]).sum(dim=1)
                pair_dots[uphill] = -torch.bmm(self.changes[idx[uphill]], g[uphill].unsqueeze(2)).squeeze(2)
            converged = self.measured[rows] & ~uphill & (self._logit_change(direction) <= tolerance)
            finished = [idx[converged]]
            if converged.any():
                self.final[idx[converged]] = True
                keep = ~converged
                idx, g, direction, slope, pair_dots = idx[keep], g[keep], direction[keep], slope[keep], pair_dots[keep]
                rows = _rows(idx, len(active))
            if len(idx):
                theta = self.theta[rows]
                new_theta, new_loss, new_grad, step = _backtrack(objective, theta, loss[rows], g, direction, slope,
                                                                 idx, halvings)
                moved = step > 0
                s, y = new_theta - theta, new_grad - g
                sy, y_my = (s * y).sum(dim=1), (y * self._precondition(y, rows)).sum(dim=1)
                curved = moved & (sy > 1e-10 * y_my)
                self._store(idx, rows, s, y, sy, torch.where(curved, 1.0 / sy.clamp(min=tiny), 0.0),
                            step.unsqueeze(1) * pair_dots, moved)
                self.scale[rows] = torch.where(curved, sy / y_my.clamp(min=tiny), self.scale[rows])
                self.measured[rows] |= curved
                self.theta[rows], loss[rows], grad[rows] = new_theta, new_loss, new_grad
                self.iterations[rows] += 1
                out_of_steps = self.iterations[rows] >= max_iter
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

    def _store(self, idx: Tensor, rows: Tensor | slice, s: Tensor, y: Tensor, sy: Tensor, rho: Tensor,
               row_dots: Tensor, moved: Tensor) -> None:
        """The pair ``(s, y)`` of each problem into the next slot. Its row of ``gram``, ``s . y_j``, is
        ``row_dots`` (from ``_direction``, as the step is a multiple of the direction); its column, ``s_i . y``,
        is filled at the next direction from ``s_i . g`` there and here (``_fill_column``); a problem that did not
        move stored a zero pair, and zeros."""
        slot = self.stored % self.history
        self.stored += 1
        self.steps[rows, slot], self.changes[rows, slot], self.inverse_curvature[rows, slot] = s, y, rho
        self.gram[rows, slot] = row_dots
        self.gram[rows, slot, slot] = sy
        self.column_due[:] = False
        self.column_due[idx] = moved
        self.column_slot = slot
        self.gram[idx[~moved], :, slot] = 0.0

    def _fill_column(self, rows: Tensor | slice, step_dots: Tensor) -> None:
        """The newest pair's column of ``gram`` (see ``_store``): ``s_i . y = s_i . g_new - s_i . g_old`` for the
        older pairs, which the new direction's ``s_i . g_new`` gives with no pass over the history."""
        due = self.column_due[rows]
        if not bool(due.any()):
            return
        slot = self.column_slot
        column = step_dots - self.step_dots[rows]
        column[:, slot] = self.gram[rows, slot, slot]
        self.gram[rows, :, slot] = torch.where(due.unsqueeze(1), column, self.gram[rows, :, slot])
        self.column_due[rows] = False

    def _direction(self, grad: Tensor, idx: Tensor, rows: Tensor | slice) -> tuple[Tensor, Tensor]:
        """The L-BFGS direction ``-H g`` (initial matrix ``scale * precondition``; empty or skipped slots have
        ``inverse_curvature`` 0 and drop out), and ``y_j . direction`` by slot for the pair it will make.

        Nocedal's two loops, with their vector updates deferred: every inner product the loops need is one of
        ``S g``, ``Y r`` or the kept Gram matrix ``s_i . y_j``, so each loop's recursion is one unit-triangular
        solve on [K, m, m] scalars, and the vectors are touched by four batched products instead of 4m vector
        operations."""
        if self.stored == 0:
            return -self._initial(grad, rows), torch.zeros(len(grad), self.history, dtype=DTYPE, device=grad.device)
        steps, changes, rho = self.steps[rows], self.changes[rows], self.inverse_curvature[rows]
        step_dots = torch.bmm(steps, grad.unsqueeze(2)).squeeze(2)
        self._fill_column(rows, step_dots)
        self.step_dots[rows] = step_dots
        gram = self.gram[rows]
        order = self._order(grad.device)  # slots, newest first
        ordered_gram, ordered_rho = gram[:, order][:, :, order], rho[:, order, None]  # [K, m, m], [K, m, 1]
        unit = torch.eye(len(order), dtype=DTYPE, device=grad.device)
        # alpha_i = rho_i (s_i . g - sum over newer j of alpha_j s_i . y_j)
        newer = ordered_gram.tril(-1)
        alpha = torch.linalg.solve_triangular(unit + ordered_rho * newer, ordered_rho * step_dots[:, order, None],
                                              upper=False, unitriangular=True)
        q = grad - torch.bmm(self._by_slot(alpha, order).transpose(1, 2), changes).squeeze(1)
        r = self._initial(q, rows)
        # beta_i = rho_i (y_i . r + sum over older j of (alpha_j - beta_j) s_j . y_i)
        older = ordered_gram.transpose(1, 2).triu(1)
        change_dots = torch.bmm(changes, r.unsqueeze(2))  # [K, history, 1], by slot
        beta = torch.linalg.solve_triangular(unit + ordered_rho * older,
                                             ordered_rho * (change_dots[:, order] + older @ alpha), upper=True,
                                             unitriangular=True)
        combination = self._by_slot(alpha - beta, order)  # [K, history, 1]
        direction = -(r + torch.bmm(combination.transpose(1, 2), steps).squeeze(1))
        # y_j . direction = -(y_j . r + sum_i c_i s_i . y_j)
        pair_dots = -(change_dots + torch.bmm(gram.transpose(1, 2), combination)).squeeze(2)
        return direction, pair_dots

    def _order(self, device: torch.device) -> Tensor:
        return torch.tensor([(self.stored - 1 - j) % self.history for j in range(min(self.stored, self.history))],
                            device=device)

    def _initial(self, vector: Tensor, rows: Tensor | slice) -> Tensor:
        """The initial inverse Hessian, ``scale * precondition``, applied to ``vector``."""
        return self._precondition(vector, rows).mul_(self.scale[rows].unsqueeze(1))

    def _precondition(self, vector: Tensor, rows: Tensor | slice) -> Tensor:
        """The preconditioner of each row's problem (``add``) applied to ``vector``, as a new tensor."""
        out = vector.clone()
        _split(out, self.classes)[0].mul_(self.inverse[rows].unsqueeze(1))
        return out

    def _logit_change(self, step: Tensor) -> Tensor:
        """Largest root-mean-square change of one class's logit over the training rows that ``step`` makes:
        ``sqrt(d_c^T Sigma d_c + db'_c^2)``, the centred bias being the change at the mean row."""
        weight, bias = _split(step, self.classes)
        return ((weight.pow(2) * self.spectrum).sum(dim=2) + bias.pow(2)).sqrt().amax(dim=1)

    def _by_slot(self, ordered: Tensor, order: Tensor) -> Tensor:
        """[K, m, 1] values in ``order`` to [K, history, 1] by slot, 0 for slots not in it."""
        by_slot = torch.zeros(len(ordered), self.history, 1, dtype=DTYPE, device=ordered.device)
        by_slot[:, order] = ordered
        return by_slot


def _split(theta: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Flat ``[K, C*d + C]`` parameters as views of their ``[K, C, d]`` weights and ``[K, C]`` biases."""
    weights = theta.shape[1] - num_classes
    return theta[:, :weights].view(len(theta), num_classes, -1), theta[:, weights:]


def _rows(idx: Tensor, total: int) -> Tensor | slice:
    """Rows ``idx`` of the state as an index: all of them as a slice, so that reads are views, not copies."""
    return slice(None) if len(idx) == total else idx


def fit_logistic(features: Tensor, labels: Tensor, num_classes: int, lam: float, max_iter: int = 1000,
                 tolerance: float = TOLERANCE, start: ProbeFit | None = None) -> ProbeFit:
    return fit_logistic_batch(features, labels, num_classes, [lam], max_iter, tolerance, starts=[start])[0]


def _backtrack(objective: _Objective, theta: Tensor, loss: Tensor, grad: Tensor, direction: Tensor, slope: Tensor,
               problems: Tensor, halvings: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backtracking per problem: accept a step that passes Armijo's test or the approximate Wolfe test, else halve
    it and re-evaluate only the problems still pending. Returns the new points, losses, gradients and the step
    lengths taken (0 where none was acceptable)."""
    step = torch.ones_like(loss)
    pending = torch.arange(len(problems), device=theta.device)
    new_theta = new_loss = new_grad = None
    for halving in range(halvings):
        everyone = halving == 0  # the first trial, of every problem at its full step: no copies
        trial = theta + direction if everyone else theta[pending] + step[pending].unsqueeze(1) * direction[pending]
        trial_loss, trial_grad = objective(trial.to(objective.features.dtype), problems[pending])
        trial_loss, trial_grad = trial_loss.to(DTYPE), trial_grad.to(DTYPE)
        start_loss, start_slope = loss[pending], slope[pending]
        trial_slope = (trial_grad * (direction if everyone else direction[pending])).sum(dim=1)
        armijo = trial_loss <= start_loss + ARMIJO * step[pending] * start_slope
        approximate_wolfe = ((trial_loss <= start_loss + LOSS_SLACK * start_loss.abs())
                             & (trial_slope >= CURVATURE * start_slope)
                             & (trial_slope <= -APPROXIMATE_SLOPE * start_slope))
        accept = armijo | approximate_wolfe
        if everyone and bool(accept.all()):
            return trial, trial_loss, trial_grad, step
        if new_theta is None:
            new_theta, new_loss, new_grad = theta.clone(), loss.clone(), grad.clone()
        done = pending[accept]
        new_theta[done], new_loss[done], new_grad[done] = trial[accept], trial_loss[accept], trial_grad[accept]
        pending = pending[~accept]
        if len(pending) == 0:
            break
        step[pending] *= 0.5
    # Problems still pending found no acceptable step at rounding level: they have converged where they are.
    step[pending] = 0.0
    return new_theta, new_loss, new_grad, step
