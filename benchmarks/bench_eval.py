"""Linear probe with CLIP's lambda search: ours (warm-started, preconditioned torch L-BFGS) vs scikit-learn's L-BFGS
running the same search, on the same features; plus zero-shot image embedding throughput on the CPU.

Three kinds of n x d features, split 80/20 into train / test; every probe searches lambda on a random half of
train, refits on all of train and scores on test:
- ``embedding``: what image embeddings look like (unit vectors in a narrow cone around a common mean, a power-law
  eigen-spectrum, weak class signal), so the problem is ill-conditioned, as real probes are;
- ``isotropic``: unit vectors, class-conditional Gaussians with white noise: the easy case for a first-order solver;
- ``unnormalised``: not L2-normalised (an offset of 1 and a scale of 3), class means plus anisotropic power-law
  noise; with 100 classes nearly separable, so the weakest lambdas win and take the most iterations;
- ``illconditioned``: a Gaussian mixture whose noise covariance has a power-law spectrum of condition number
  ``CONDITION`` (1e4) in a random basis, class means with the same spectrum (equal signal-to-noise in every
  direction): the weights that matter are large where the features are small, so an unpreconditioned L-BFGS
  needs many iterations.
scikit-learn runs at CLIP's published setting (default tol 1e-4, max_iter 1000), and at each further ``--sklearn-tol``.
CLIP_benchmark's probe is reported when `clip_benchmark` is importable.

    python benchmarks/bench_eval.py [--n 10000] [--d 512] [--classes 10 100] [--kinds ...] [--sklearn-tol 1e-8]
                                    [--load 6] [--repeat 3]

``--load N`` runs everything beside N busy processes (``busy_load.py``, as ``bench_train.py --stage``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from functools import partial

# isort: off
from cloob_core.threads import limit_spinning

# Before torch: OpenMP's spin count, read when libgomp loads, as `cloob eval` sets it (cloob_core.threads).
# scikit-learn's own libgomp reads the same; its probe's time did not change with it (docs/performance.md).
limit_spinning("coarse")
import torch  # noqa: E402
# isort: on
from busy_load import load  # noqa: E402

from cloob_core.evaluation.tasks.linear_probe import INITIAL_INDICES, LAMBDA_GRID, SPANS, accuracy, linear_probe  # noqa: E402

KINDS = ("embedding", "isotropic", "unnormalised", "illconditioned")
CONDITION = 1e4  # of the ``illconditioned`` kind's noise covariance


def features(n: int, d: int, classes: int, kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=generator)
    if kind == "illconditioned":
        exponent = torch.log(torch.tensor(CONDITION)) / torch.log(torch.tensor(float(d)))
        scales = torch.arange(1, d + 1, dtype=torch.float32) ** (-exponent / 2)  # variances: rank^-exponent
        rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=generator))
        centers = torch.randn(classes, d, generator=generator) * scales * 0.15  # equal signal-to-noise everywhere
        return (centers[labels] + torch.randn(n, d, generator=generator) * scales) @ rotation.T, labels
    if kind == "isotropic":
        centers = torch.randn(classes, d, generator=generator)
        x = centers[labels] * 0.02 + torch.randn(n, d, generator=generator) / d**0.5 * 3
    elif kind == "unnormalised":
        scales = torch.arange(1, d + 1, dtype=torch.float32) ** -0.5  # eigenvalues ~ rank^-1
        rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=generator))
        centers = torch.randn(classes, d, generator=generator) * 0.015
        x = (centers[labels] + torch.randn(n, d, generator=generator) * scales) @ rotation.T * 3 + 1
        return x, labels
    else:
        scales = torch.arange(1, d + 1, dtype=torch.float32) ** -0.75  # eigenvalues ~ rank^-1.5
        rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=generator))
        centers = torch.randn(classes, d, generator=generator) * scales * 0.1
        mean = torch.nn.functional.normalize(torch.randn(d, generator=generator), dim=0) * scales.norm()
        x = (centers[labels] + torch.randn(n, d, generator=generator) * scales) @ rotation.T + mean
    return torch.nn.functional.normalize(x, dim=1), labels


def sklearn_probe(train_x, train_y, test_x, test_y, tol: float, max_iter: int, seed: int = 0) -> tuple[float, float]:
    """CLIP's search (same grid, same visiting order, ties to larger lambda) with scikit-learn fits."""
    from sklearn.linear_model import LogisticRegression

    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train_y), generator=generator)
    half = len(order) // 2
    fit_x, fit_y = train_x[order[:half]].numpy(), train_y[order[:half]].numpy()
    val_x, val_y = train_x[order[half:]].numpy(), train_y[order[half:]].numpy()
    scores: dict[int, float] = {}

    def evaluate(index: int) -> float:
        if index not in scores:
            model = LogisticRegression(C=1 / LAMBDA_GRID[index], max_iter=max_iter, tol=tol)
            scores[index] = model.fit(fit_x, fit_y).score(val_x, val_y)
        return scores[index]

    def best(indices):
        return max(indices, key=lambda i: (evaluate(i), i))

    peak = best(INITIAL_INDICES)
    for span in SPANS:
        peak = best(sorted({max(peak - span, 0), peak, min(peak + span, len(LAMBDA_GRID) - 1)}))
    final = LogisticRegression(C=1 / LAMBDA_GRID[peak], max_iter=max_iter, tol=tol).fit(train_x.numpy(),
                                                                                     train_y.numpy())
    return LAMBDA_GRID[peak], final.score(test_x.numpy(), test_y.numpy())


def ours_probe(x: torch.Tensor, y: torch.Tensor, cut: int, classes: int) -> tuple[float, float]:
    fit, search = linear_probe(x[:cut], y[:cut], classes)
    return search.lam, accuracy(fit, x[cut:], y[cut:])


def time_alternately(probes: list, repeat: int) -> tuple[list[list[float]], list[tuple[float, float]]]:
    """Each probe ``repeat`` times, in turn, the order reversed every other round so that no probe always runs
    first or last after the others; their seconds, and each one's (lambda, test accuracy), which do not vary."""
    seconds: list[list[float]] = [[] for _ in probes]
    results: list[tuple[float, float]] = [(0.0, 0.0)] * len(probes)
    for round_ in range(repeat):
        order = range(len(probes)) if round_ % 2 == 0 else reversed(range(len(probes)))
        for i in order:
            started = time.perf_counter()
            results[i] = probes[i]()
            seconds[i].append(time.perf_counter() - started)
    return seconds, results


def warm_up() -> None:
    """Pay both libraries' one-time costs (imports, thread pools) before any clock starts."""
    x, y = features(400, 16, 4, "isotropic")
    linear_probe(x[:300], y[:300], 4)
    sklearn_probe(x[:300], y[:300], x[300:], y[300:], 1e-4, 100)


def zero_shot_throughput(architecture: str, batch: int, batches: int) -> float:
    import open_clip

    from cloob_core.model.dual_encoder import register_project_configs

    register_project_configs()
    model = open_clip.create_model(architecture, pretrained=None).eval()
    size = model.visual.image_size
    size = size if isinstance(size, int) else size[0]
    images = torch.randn(batch, 3, size, size)
    with torch.no_grad():
        model.encode_image(images[:2])
        started = time.perf_counter()
        for _ in range(batches):
            model.encode_image(images, normalize=True)
    return batch * batches / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--classes", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--sklearn-tol", type=float, nargs="*", default=[],
                        help="further scikit-learn runs at these tolerances (max_iter 20000), e.g. 1e-8")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the whole run (0: quiet)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each probe per case, taken in turn; the median is reported (this machine's "
                             "speed drifts by a third within minutes)")
    args = parser.parse_args()
    with load(args.load, seconds=4 * 3600):
        compare(args)


def compare(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    warm_up()
    print(f"linear probe with CLIP's lambda search, {args.n} x {args.d} features (80% train, 20% test), CPU, "
          f"{torch.get_num_threads()} threads, " + (f"under a load of {args.load}" if args.load else "quiet"))
    print(f"seconds: median of {args.repeat} run(s) of each probe, taken in turn (the order alternating), and "
          "their range")
    print(f"  {'features':<14} {'classes':>7}  {'probe':<34} {'seconds':>8} {'range':>13} {'lambda':>9} "
          f"{'test acc':>9} {'ours faster':>11} {'acc diff':>9}")
    sklearn_runs = [("scikit-learn L-BFGS, CLIP's setting", 1e-4, 1000)]
    sklearn_runs += [(f"scikit-learn L-BFGS, tol {tol:g}", tol, 20_000) for tol in args.sklearn_tol]
    for kind in args.kinds:
        for classes in args.classes:
            x, y = features(args.n, args.d, classes, kind)
            cut = int(0.8 * args.n)
            probes = [("ours (torch L-BFGS)", partial(ours_probe, x, y, cut, classes))]
            probes += [(label, partial(sklearn_probe, x[:cut], y[:cut], x[cut:], y[cut:], tol, max_iter))
                       for label, tol, max_iter in sklearn_runs]
            seconds, results = time_alternately([probe for _, probe in probes], args.repeat)
            ours_s, (_, ours_acc) = statistics.median(seconds[0]), results[0]
            for i, ((label, _), times, (lam, acc)) in enumerate(zip(probes, seconds, results, strict=True)):
                row = (f"  {kind:<14} {classes:>7}  {label:<34} {statistics.median(times):>8.2f} "
                       f"{min(times):>6.2f}-{max(times):<6.2f} {lam:>9.3g} {100 * acc:>8.2f}%")
                if i > 0:  # against ours
                    row += f" {statistics.median(times) / ours_s:>10.1f}x {100 * (ours_acc - acc):>+8.2f}pt"
                print(row, flush=True)
    try:
        import clip_benchmark  # noqa: F401

        print("  clip_benchmark is importable, but its probe trains on a DataLoader of features with SGD; "
              "not compared here")
    except ImportError:
        print("  CLIP_benchmark's probe: skipped, clip_benchmark is not installed in this environment (it runs "
              "from its own overlay, scripts/clip_benchmark_env.sh)")
    print("\nzero-shot image embedding throughput, CPU, fp32")
    for architecture, batch, batches in (("cloob-tiny", 256, 8), ("RN50", 16, 3)):
        print(f"  {architecture:<11} {zero_shot_throughput(architecture, batch, batches):8.1f} images/s")


if __name__ == "__main__":
    main()
