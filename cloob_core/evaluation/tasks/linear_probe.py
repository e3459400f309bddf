"""Linear probe as CLIP evaluates it (Radford et al. 2021, App. A.3): multinomial logistic regression on frozen
image features, fit with L-BFGS, with the L2 strength chosen by CLIP's parametric binary search.

The fits are scikit-learn's ``LogisticRegression(C=1/lambda)`` objective, minimised in torch on the features'
device (see ``logistic.py``) to each lambda's own optimum, so the path to it is free. The first round walks down
from the strongest lambda, each fit starting from the path extrapolated through the previous ones (with few
classes it runs as one batch instead: ``NARROW_COLUMNS``). Later rounds start each new lambda from the path
interpolated between its fitted neighbours; with few classes they run while the first round's weakest lambdas
are still iterating, on the guess that those lose (``search_lambda``). The final refit starts from the search's
path at the lambda that weighs as much on the search's rows as the chosen one does on all of them.

The search: 97 values of lambda, log-spaced over [1e-6, 1e6] (8 per decade). Evaluate every 16th (1e-6, 1e-4,
..., 1e6) on the validation split, then around the best one at distance 8, 4, 2 and 1 grid steps, keeping the
best; ties go to the larger lambda (the simpler model).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from cloob_core.config import ConfigError
from cloob_core.evaluation.features import Embedded, Encoding, image_features
from cloob_core.evaluation.figures import per_class_png
from cloob_core.evaluation.inputs import ImageSet
from cloob_core.evaluation.logistic import TOLERANCE, LogisticSolver, ProbeFit, fit_logistic
from cloob_core.evaluation.records import write_result
from cloob_core.evaluation.tasks.common import EvalOptions, EvalResult, need, task_record
from cloob_core.evaluation.tasks.zeroshot import classification_metrics
from cloob_core.model.source import EvalModel

log = logging.getLogger(__name__)
LAMBDA_GRID = torch.logspace(-6, 6, 97, dtype=torch.float64).tolist()
INITIAL_INDICES = list(range(0, 97, 16))
SPANS = (8, 4, 2, 1)


def accuracy(fit: ProbeFit, features: Tensor, labels: Tensor) -> float:
    """In the features' precision: the search scores every lambda, and a float64 copy of the features for each
    would cost as much as some of the fits."""
    scores = features @ fit.weight.T.to(features.dtype) + fit.bias.to(features.dtype)
    return float((scores.argmax(dim=1) == labels).float().mean())


@dataclass
class SearchResult:
    lam: float
    validation_accuracy: float | None  # None: no search (see linear_probe)
    fit: ProbeFit  # the chosen lambda's model on the search's training split
    tried: dict[float, float] = field(default_factory=dict)  # lambda -> validation accuracy
    warnings: list[str] = field(default_factory=list)
    path: dict[int, ProbeFit] = field(default_factory=dict)  # every fit of the search, by grid index
    rows: int = 0  # the search's training rows


# A first round whose fits together have at most this many classes runs as one batch from zero instead of walking
# the path: a matmul that narrow is bound by reading the features, so the batch costs little more per iteration
# than one fit (10 classes: 0.48 s instead of 0.64 s on 4,000 x 512 features; 100 classes: 2.8 s instead of 1.7).
# Fits the search may need next join a batch only while it stays this narrow.
NARROW_COLUMNS = 128
UNSEARCHED_LAMBDA = 1.0  # scikit-learn's LogisticRegression default, C = 1


def search_lambda(train_x: Tensor, train_y: Tensor, val_x: Tensor, val_y: Tensor, num_classes: int,
                  max_iter: int = 1000, tolerance: float = TOLERANCE) -> SearchResult:
    """CLIP's parametric binary search over ``LAMBDA_GRID``; see the module docstring. Every fit converges
    (``tolerance``), so each lambda is judged by the model it defines, whatever the path to it: a new lambda
    starts from the regularisation path through the ones already fitted (``path_start``).

    The decisions read only the scores of the lambdas the search visits (``_walk``). The fits run on one solver,
    each started as soon as it is known to be needed; and while the batch is narrow, also those the search will
    need if the first round's weak lambdas, still iterating, lose to the best one so far, once a weaker lambda has
    already lost to it (they usually do). Beside them those fits cost little, and any fit is its lambda's optimum,
    so a wrong guess costs time, never an answer."""
    scores: dict[int, float] = {}
    fits: dict[int, ProbeFit] = {}
    running: dict[int, int] = {}  # solver problem -> grid index
    solver = LogisticSolver(train_x, train_y, num_classes, max_iter=max_iter, tolerance=tolerance)
    narrow = len(INITIAL_INDICES) * num_classes <= NARROW_COLUMNS

    def start(indices: list[int], guess: bool = False) -> None:
        new = [i for i in indices if i not in fits and i not in running.values()]
        if not new or (guess and (len(running) + len(new)) * num_classes > NARROW_COLUMNS):
            return
        problems = solver.add([LAMBDA_GRID[i] for i in new], [path_start(fits, i) for i in new])
        running.update(zip(problems, new, strict=True))

    def schedule() -> None:
        needed, peak, _ = _walk(scores, INITIAL_INDICES)
        if peak is not None:
            solver.stop()
            return
        first_round = all(i in INITIAL_INDICES for i in needed)
        start(needed if narrow or not first_round else [max(needed)])  # wide: walk down from the strongest
        known = [i for i in INITIAL_INDICES if i in scores]
        if narrow and known and min(known) < max(known, key=lambda i: (scores[i], i)):
            start(_walk(scores, known)[0], guess=True)

    def on_fit(problem: int, fit: ProbeFit) -> None:
        index = running.pop(problem)
        fits[index], scores[index] = fit, accuracy(fit, val_x, val_y)
        log.debug("lambda %.3g: validation accuracy %.4f (%d iterations)", fit.lam, scores[index], fit.iterations)
        schedule()

    schedule()
    solver.run(on_fit)
    _, peak, visited = _walk(scores, INITIAL_INDICES)
    assert peak is not None  # every fit the walk needs has run
    return SearchResult(LAMBDA_GRID[peak], scores[peak], fits[peak], {LAMBDA_GRID[i]: scores[i] for i in visited},
                        path=fits, rows=len(train_y))


def _walk(scores: dict[int, float], first_round: list[int]) -> tuple[list[int], int | None, list[int]]:
    """The search from the scores known so far, with ``first_round`` as its first round: the grid points it needs
    next and no peak, or none and its peak; and the points it has visited."""
    visited = sorted(first_round)
    missing = [i for i in first_round if i not in scores]
    if missing or not first_round:
        return missing, None, visited
    peak = max(first_round, key=lambda i: (scores[i], i))  # ties: the larger lambda
    for span in SPANS:
        candidates = sorted({max(peak - span, 0), peak, min(peak + span, len(LAMBDA_GRID) - 1)})
        visited = sorted({*visited, *candidates})
        missing = [i for i in candidates if i not in scores]
        if missing:
            return missing, None, visited
        peak = max(candidates, key=lambda i: (scores[i], i))
    return [], peak, visited


def path_start(fits: dict[int, ProbeFit], index: float) -> ProbeFit | None:
    """A start for grid point ``index`` on the regularisation path through the fitted ones: interpolated between
    the nearest fits on either side, else extrapolated from the two nearest on one side, linearly in log lambda
    (the grid's spacing). Weakly regularised weights grow about linearly in log(1/lambda) as the classes
    separate, so this lands much nearer the optimum than the nearest fit alone; any start converges to the same
    optimum."""
    if not fits or index in fits:
        return fits.get(index)  # a float equal to a fitted index finds it
    below = sorted(i for i in fits if i < index)
    above = sorted(i for i in fits if i > index)
    if below and above:
        near, far = below[-1], above[0]
    elif len(below) >= 2 or len(above) >= 2:
        near, far = (below[-1], below[-2]) if below else (above[0], above[1])
    else:  # a single fit
        return fits[(below or above)[0]]
    t = (index - near) / (far - near)  # in (0, 1) between, negative beyond ``near``
    a, b = fits[near], fits[far]
    return ProbeFit((1 - t) * a.weight + t * b.weight, (1 - t) * a.bias + t * b.bias, a.lam * (b.lam / a.lam) ** t, 0)


def few_shot_indices(labels: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """``k`` random examples of every class (all of a class that has fewer)."""
    chosen = []
    for c in labels.unique().tolist():
        members = torch.nonzero(labels == c).flatten()
        chosen.append(members[torch.randperm(len(members), generator=generator)[:k]])
    return torch.cat(chosen).sort().values


def linear_probe(train_x: Tensor, train_y: Tensor, num_classes: int, *, val_x: Tensor | None = None,
                 val_y: Tensor | None = None, seed: int = 0, max_iter: int = 1000,
                 refit_with_validation: bool = True) -> tuple[ProbeFit, SearchResult]:
    """Search lambda on the validation split (or a random half of train), refit on train (+ val, unless
    ``refit_with_validation`` is off: a few-shot probe must see k images per class, not k plus the validation
    split, CLIP_benchmark #125), return the final fit; the test split is never seen here (score it with
    :func:`accuracy`).

    Every fit is bounded (``max_iter`` L-BFGS iterations of at most 21 loss evaluations, at most 16 fits), however
    degenerate the data. With one training image per class and no validation split, no half of train holds a
    class of the other, so no lambda can be judged: the probe is fitted once at ``UNSEARCHED_LAMBDA``, with a
    warning; fewer than two classes is an error."""
    counts = torch.bincount(train_y, minlength=num_classes)
    present = int((counts > 0).sum())
    if present < 2:
        raise ValueError(f"the linear probe's training images hold {present} class(es): a classifier needs two")
    warnings = []
    if val_x is None and int(counts.max()) < 2:
        warnings.append(f"one training image per class ({present} classes) and no validation split: no lambda "
                        f"can be judged, so the probe was fitted once at lambda {UNSEARCHED_LAMBDA:g} (scikit-learn's "
                        "default C=1); a rough figure")
        fit = fit_logistic(train_x, train_y, num_classes, UNSEARCHED_LAMBDA, max_iter=max_iter)
        return fit, SearchResult(UNSEARCHED_LAMBDA, None, fit, {}, warnings)
    if val_x is None and int(counts[counts > 0].min()) < 2:
        warnings.append(f"{int(((counts > 0) & (counts < 2)).sum())} of {present} classes have one training image: "
                        "the lambda search's validation half cannot hold them on both sides")
    if val_x is None:
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(train_y), generator=generator)
        half = len(order) // 2
        search = search_lambda(train_x[order[:half]], train_y[order[:half]], train_x[order[half:]],
                               train_y[order[half:]], num_classes, max_iter)
        final_x, final_y = train_x, train_y
    else:
        search = search_lambda(train_x, train_y, val_x, val_y, num_classes, max_iter)
        final_x, final_y = (torch.cat([train_x, val_x]), torch.cat([train_y, val_y])) if refit_with_validation \
            else (train_x, train_y)
    # The penalty is lam/(2n) per row: on n' rows, lam weighs as much as lam * n/n' did on the search's n, so the
    # search's path there is the nearer start.
    shift = math.log(len(final_y) / search.rows) / math.log(LAMBDA_GRID[1] / LAMBDA_GRID[0])
    start = path_start(search.path, LAMBDA_GRID.index(search.lam) - shift)
    fit = fit_logistic(final_x, final_y, num_classes, search.lam, max_iter=max_iter, start=start)
    search.warnings += warnings
    return fit, search


@dataclass(frozen=True)
class LinearProbeTask:
    """L-BFGS logistic regression on frozen image features with CLIP's lambda search."""

    name: ClassVar[str] = "linear-probe"
    train_data: str = "captioned"
    train_split: str = "train"
    test_data: str | None = None  # None: train_data
    test_split: str = "test"
    val_data: str | None = None  # None: a random half of train
    val_split: str = "val"
    few_shot: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.few_shot is not None and self.few_shot < 1:
            raise ConfigError(f"--few-shot must be at least 1 image per class, got {self.few_shot}")

    def run(self, model: EvalModel, options: EvalOptions, output: Path) -> EvalResult:
        train = options.images(self.train_data, self.train_split)
        test = options.images(self.test_data or self.train_data, self.test_split)
        if test.identity == train.identity:
            raise ConfigError(f"the linear probe's test images would be its training images ({train.name}): give "
                              "--test-data, or a folder with train/ and test/ inside")
        validation = options.images(self.val_data, self.val_split) if self.val_data else None
        metrics = linear_probe_task(model, train, test, output, options.encoding, validation=validation,
                                           few_shot=self.few_shot, seed=self.seed)
        searched = metrics["validation_accuracy"]
        line = (f"{test.name} linear probe: top-1 {100 * metrics['lp_acc1']:.2f}% with lambda "
                f"{metrics['lambda_']:.3g} ("
                + (f"validation {100 * searched:.2f}%" if searched is not None else "not searched: see the report")
                + f", {metrics['train_size']} training images)")
        return EvalResult(self.name, output, {test.name: metrics}, [line])


def linear_probe_task(model: EvalModel, train: ImageSet, test: ImageSet, output: Path, encoding: Encoding, *,
                       validation: ImageSet | None = None, few_shot: int | None = None,
                       seed: int = 0) -> dict[str, Any]:
    """CLIP's linear probe; its accuracies under CLIP_benchmark's names (``lp_acc1``, ``lp_acc5``,
    ``lp_mean_per_class_recall``), the other figures as zero-shot classification names them."""
    def labelled(images: ImageSet) -> tuple[torch.Tensor, torch.Tensor, Embedded]:
        embedded = image_features(model, images, encoding)
        need(images.name, labels=embedded.labels)
        return embedded.features, torch.tensor(embedded.labels), embedded

    train_x, train_y, _ = labelled(train)
    test_x, test_y, tested = labelled(test)
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    if few_shot:
        keep = few_shot_indices(train_y, few_shot, torch.Generator().manual_seed(seed))
        train_x, train_y = train_x[keep], train_y[keep]
    val_x = val_y = None
    if validation is not None:
        val_x, val_y, _ = labelled(validation)
    fit, search = linear_probe(train_x, train_y, num_classes, val_x=val_x, val_y=val_y, seed=seed,
                               refit_with_validation=not few_shot)
    scores = fit.predict_scores(test_x)
    metrics = {f"lp_{key}" if key.startswith("acc") or key == "mean_per_class_recall" else key: value
               for key, value in classification_metrics(scores, test_y, num_classes).items()}
    metrics.update(lambda_=search.lam, validation_accuracy=search.validation_accuracy,
                   lambda_search={f"{k:.3g}": v for k, v in search.tried.items()}, train_size=len(train_y),
                   few_shot=few_shot or 0)
    metrics["lp_acc1_check"] = accuracy(fit, test_x, test_y)
    for warning in search.warnings:
        log.warning("%s linear probe: %s", test.name, warning)
    output.mkdir(parents=True, exist_ok=True)
    names = test.classnames or [str(c) for c in range(num_classes)]
    task = "linear_probe"
    plots = [per_class_png(output / f"{test.name}_{task}_per_class.png", names, metrics["per_class_accuracy"],
                           metrics["chance"], f"{test.name}: linear probe per class (lambda {search.lam:.3g})")]
    write_result(output, task_record(model, test, task, metrics, search.warnings, tested), model.fingerprint,
                 plots)
    return metrics
