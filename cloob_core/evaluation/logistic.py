"""Multinomial logistic regression fitted for several L2 strengths at once, with a batched L-BFGS.

The objective is scikit-learn's ``LogisticRegression(C=1/lam)``: ``mean CE + lam/(2n) ||W||^2`` (no penalty on the
bias). The lambda search of the linear probe fits one model per lambda on the same features; fitting them as one
batch shares every pass over the features (one matmul with K*C columns instead of K with C), which is where the
time goes for probes with few classes. Each problem keeps its own L-BFGS history, step length and stopping test,
so it converges to the same optimum as a fit on its own.

Gradients are written out (softmax minus one-hot) rather than taken by autograd, and the features are visited in
row chunks, so memory stays bounded for large probe sets (ImageNet-sized n x C logits never exist at once).
Most iterations run in float32 and the last ones in float64, as scikit-learn's: in float32 alone the loss stops
resolving progress before an ill-conditioned probe has converged. The features are centred and cast once (a
float64 and a float32 copy: three times their float32 memory).
"""

from __future__ import annotations

from collections.abc import Sequence
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


@dataclass
class FeatureGeometry:
    """Mean and covariance eigenbasis of a probe's training features.

    Two exact reparametrisations make L-BFGS fast on real embeddings, which sit in a narrow cone (large common
    mean) with a steep eigen-spectrum: the bias is taken relative to the centred features (``b = b' - W mu``,
    the same set of models, the penalty untouched), and the search direction starts from
    ``(Sigma + tau I)^-1`` (the Hessian at the start, up to the softmax factor) instead of the identity. The
    optimum is the same; only the path to it is shorter.
    """

    mean: Tensor  # [d]
    basis: Tensor  # [d, d], eigenvectors of the centred covariance
    spectrum: Tensor  # [d], its eigenvalues

    def to(self, dtype: torch.dtype) -> FeatureGeometry:
        return FeatureGeometry(self.mean.to(dtype), self.basis.to(dtype), self.spectrum.to(dtype))

    @classmethod
    def of(cls, features: Tensor) -> FeatureGeometry:
        features = features.to(DTYPE)
        n, d = features.shape
        mean = features.mean(dim=0)
        covariance = torch.zeros(d, d, dtype=DTYPE, device=features.device)
        for start in range(0, n, max(1, CHUNK_ELEMENTS // d)):
            centred = features[start : start + CHUNK_ELEMENTS // d] - mean
            covariance.addmm_(centred.T, centred)
        spectrum, basis = torch.linalg.eigh(covariance / n)
        return cls(mean, basis, spectrum.clamp(min=0))


class _Objective:
    """Loss and gradient of K independent problems on shared, centred features (``features - geometry.mean``);
    parameters are flat ``[K, C*d + C]`` (weights, then biases relative to the centred features). Centred, the
    sums over rows do not cancel a large common mean, so float32 resolves the gradient much closer to the optimum."""

    def __init__(self, centred: Tensor, labels: Tensor, num_classes: int, lams: Tensor,
                 geometry: FeatureGeometry) -> None:
        self.features, self.labels, self.classes, self.lams = centred, labels, num_classes, lams
        self.geometry = geometry
        self.n, self.dim = centred.shape

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
            log_norm = logits.logsumexp(dim=2)  # [m, k]
            picked = logits.gather(2, y.view(m, 1, 1).expand(m, k, 1)).squeeze(2)
            loss += (log_norm - picked).sum(dim=0, dtype=DTYPE)
            residual = logits.sub_(log_norm.unsqueeze(2)).exp_()  # softmax, in place of the logits
            residual[torch.arange(m, device=y.device), :, y] -= 1.0
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
        spread = ((weight @ self.geometry.basis).pow(2) * self.geometry.spectrum).sum(dim=2)
        return (spread + bias.pow(2)).sqrt().amax(dim=1)

    def precondition(self, vector: Tensor, problems: Tensor) -> Tensor:
        """``(Sigma + tau_k I)^-1`` on each class's weights, identity on the biases; ``tau_k = lam_k C / n`` is
        the penalty's share of the Hessian at the start (softmax factor ~1/C), floored at 1e-6 of the top
        eigenvalue so that directions the features do not span stay at rounding level."""
        geometry = self.geometry
        weight, bias = self.split(vector)
        floor = self.lams[problems] * self.classes / self.n + 1e-6 * geometry.spectrum[-1].clamp(min=1e-12)
        inverse = 1.0 / (geometry.spectrum.unsqueeze(0) + floor.unsqueeze(1))  # [k, d]
        weight = ((weight @ geometry.basis) * inverse.unsqueeze(1)) @ geometry.basis.T
        return torch.cat([weight.reshape(len(vector), -1), bias], dim=1)


def fit_logistic_batch(features: Tensor, labels: Tensor, num_classes: int, lams: Sequence[float],
                       max_iter: int = 1000, tolerance: float = TOLERANCE, history: int = 20,
                       geometry: FeatureGeometry | None = None,
                       starts: Sequence[ProbeFit | None] | None = None) -> list[ProbeFit]:
    """Fit one model per lambda; each stops when its L-BFGS step would move no logit by more than ``tolerance``
    (see ``TOLERANCE``), when no step along its direction is acceptable any more (rounding level), or after
    ``max_iter`` iterations.

    Converged, the result is the optimum lambda defines, whatever the path to it: so a fit may start from another
    lambda's model (``starts``, a warm start along the regularisation path) and still give the same answer.
    (scikit-learn's default tol=1e-4 stops weakly regularised fits of nearly separable features well before it,
    and their accuracy then depends on where the solver stopped.) ``geometry`` may be passed when calls share
    features.

    The iterations run in float32 (half the memory traffic) until the fit converges or float32 stops resolving
    progress; the same L-BFGS state then continues in float64 for the fits float32 could not finish.
    """
    device = features.device
    geometry = geometry or FeatureGeometry.of(features)
    lam_tensor = torch.tensor(lams, dtype=DTYPE, device=device)
    centred = features.to(DTYPE) - geometry.mean
    rough = _Objective(centred.float(), labels, num_classes, lam_tensor.float(), geometry.to(torch.float32))
    exact = _Objective(centred, labels, num_classes, lam_tensor, geometry)
    state = _LBFGS(len(lams), num_classes * features.shape[1] + num_classes, history, num_classes, device)
    for i, start in enumerate(starts or []):
        if start is not None:  # to the centred-bias coordinates the objective uses
            state.theta[i] = torch.cat([start.weight.flatten(), start.bias + start.weight @ geometry.mean]).to(DTYPE)
    state.run(rough, tolerance, max_iter, ROUGH_HALVINGS)
    state.run(exact, tolerance, max_iter)
    weight, centred_bias = exact.split(state.theta)
    bias = centred_bias - weight @ geometry.mean
    return [ProbeFit(weight[i].clone(), bias[i].clone(), float(lams[i]), int(state.iterations[i]))
            for i in range(len(lams))]


class _LBFGS:
    """L-BFGS state of K problems (float64, whatever precision the objective evaluates in)."""

    def __init__(self, problems: int, size: int, history: int, num_classes: int, device: torch.device) -> None:
        self.theta = torch.zeros(problems, size, dtype=DTYPE, device=device)
        self.steps = torch.zeros(history, problems, size, dtype=DTYPE, device=device)
        self.changes = torch.zeros_like(self.steps)
        self.inverse_curvature = torch.zeros(history, problems, dtype=DTYPE, device=device)  # 0: empty slot
        # At W = 0 the softmax Hessian is ~ (1/C) Sigma per class: C times the preconditioner is a Newton step.
        self.scale = torch.full((problems,), float(num_classes), dtype=DTYPE, device=device)
        self.iterations = torch.zeros(problems, dtype=torch.long, device=device)
        # The step estimates the way to the optimum only once it is scaled by measured curvature: until then (the
        # first step, from zero or from a warm start) it is not a convergence test.
        self.measured = torch.zeros(problems, dtype=torch.bool, device=device)
        self.converged = torch.zeros(problems, dtype=torch.bool, device=device)
        self.history, self.stored = history, 0

    def run(self, objective: _Objective, tolerance: float, max_iter: int, halvings: int = MAX_HALVINGS) -> None:
        """Iterate the problems not yet converged (by an earlier run) until they pass the test, stall or run out."""
        dtype, tiny = objective.features.dtype, torch.finfo(DTYPE).tiny
        active = ~self.converged & (self.iterations < max_iter)
        if not bool(active.any()):
            return
        loss = torch.zeros(len(self.theta), dtype=DTYPE, device=self.theta.device)
        grad = torch.zeros_like(self.theta)
        pending = torch.nonzero(active).flatten()
        start_loss, start_grad = objective(self.theta[pending].to(dtype), pending)
        loss[pending], grad[pending] = start_loss.to(DTYPE), start_grad.to(DTYPE)
        while bool(active.any()):
            idx = torch.nonzero(active).flatten()
            g = grad[idx]
            direction = -self._two_loop(g, idx, objective)
            slope = (g * direction).sum(dim=1)
            uphill = slope >= 0  # rounding broke the curvature pairs: fall back to steepest descent
            if uphill.any():
                direction[uphill], slope[uphill] = -g[uphill], -(g[uphill] * g[uphill]).sum(dim=1)
            converged = self.measured[idx] & ~uphill & (objective.logit_change(direction.to(dtype)) <= tolerance)
            if converged.any():
                active[idx[converged]] = False
                self.converged[idx[converged]] = True
                idx, g, direction, slope = idx[~converged], g[~converged], direction[~converged], slope[~converged]
                if len(idx) == 0:
                    break
            new_theta, new_loss, new_grad, moved = _backtrack(objective, self.theta[idx], loss[idx], g, direction,
                                                               slope, idx, halvings)
            s, y = new_theta - self.theta[idx], new_grad - g
            sy, y_my = (s * y).sum(dim=1), (y * objective.precondition(y.to(dtype), idx).to(DTYPE)).sum(dim=1)
            curved = moved & (sy > 1e-10 * y_my)
            slot = self.stored % self.history
            self.stored += 1
            self.steps[slot, idx], self.changes[slot, idx] = s, y
            self.inverse_curvature[slot, idx] = torch.where(curved, 1.0 / sy.clamp(min=tiny), 0.0)
            self.scale[idx] = torch.where(curved, sy / y_my.clamp(min=tiny), self.scale[idx])
            self.measured[idx] |= curved
            self.theta[idx], loss[idx], grad[idx] = new_theta, new_loss, new_grad
            self.iterations[idx] += 1
            done = ~moved | (self.iterations[idx] >= max_iter)
            active[idx[done]] = False

    def _two_loop(self, grad: Tensor, idx: Tensor, objective: _Objective) -> Tensor:
        """The inverse-Hessian product with the initial matrix ``scale * precondition``; empty or skipped slots
        have ``inverse_curvature`` 0 and drop out."""
        order = [(self.stored - 1 - j) % self.history for j in range(min(self.stored, self.history))]  # newest first
        if len(idx) == len(self.theta):  # all problems active: no copy of the history
            steps, changes, rho = self.steps, self.changes, self.inverse_curvature
        else:
            steps, changes, rho = self.steps[:, idx], self.changes[:, idx], self.inverse_curvature[:, idx]
        q = grad.clone()
        alphas = {}
        for slot in order:
            alphas[slot] = rho[slot] * (steps[slot] * q).sum(dim=1)
            q -= alphas[slot].unsqueeze(1) * changes[slot]
        r = objective.precondition(q.to(objective.features.dtype), idx).to(DTYPE) * self.scale[idx].unsqueeze(1)
        for slot in reversed(order):
            beta = rho[slot] * (changes[slot] * r).sum(dim=1)
            r += (alphas[slot] - beta).unsqueeze(1) * steps[slot]
        return r


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
