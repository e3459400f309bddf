"""Linear probe with CLIP's lambda search: ours (torch L-BFGS, warm starts) vs scikit-learn's L-BFGS running the
same search (CLIP's original tool: cold fits, the same convergence criterion), on the same features; plus
zero-shot image embedding throughput on the CPU.

Features: n x d unit vectors from class-conditional Gaussians with overlap (so the best lambda is interior),
split into train / test; both probes search lambda on a random half of train, refit on all of train and score
on test. CLIP_benchmark's probe is included when `clip_benchmark` is importable.

    python benchmarks/bench_eval.py [--n 10000] [--d 512] [--classes 10 100]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from cloob_core.evaluation.linear_probe import INITIAL_INDICES, LAMBDA_GRID, SPANS, accuracy, linear_probe


def features(n: int, d: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, d, generator=generator)
    labels = torch.randint(0, classes, (n,), generator=generator)
    x = centers[labels] * 0.02 + torch.randn(n, d, generator=generator) / d**0.5 * 3
    return torch.nn.functional.normalize(x, dim=1), labels


# Both probes stop at the same criterion on the same objective (largest gradient entry of mean CE + lambda/(2n)
# ||W||^2 below 1e-6), i.e. both fit each lambda's model. (At scikit-learn's default tol=1e-4, weakly
# regularised fits stop early, and which lambda wins then depends on where each solver happened to stop.)
TOLERANCE = 1e-6
MAX_ITER = 20_000  # enough for scikit-learn to reach TOLERANCE at every lambda of the grid (1000 is not at 1e-6)


def sklearn_probe(train_x, train_y, test_x, test_y, seed: int = 0) -> tuple[float, float]:
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
            model = LogisticRegression(C=1 / LAMBDA_GRID[index], max_iter=MAX_ITER, tol=TOLERANCE)
            scores[index] = model.fit(fit_x, fit_y).score(val_x, val_y)
        return scores[index]

    def best(indices):
        return max(indices, key=lambda i: (evaluate(i), i))

    peak = best(INITIAL_INDICES)
    for span in SPANS:
        peak = best(sorted({max(peak - span, 0), peak, min(peak + span, len(LAMBDA_GRID) - 1)}))
    final = LogisticRegression(C=1 / LAMBDA_GRID[peak], max_iter=MAX_ITER, tol=TOLERANCE).fit(train_x.numpy(),
                                                                                           train_y.numpy())
    return LAMBDA_GRID[peak], final.score(test_x.numpy(), test_y.numpy())


def zero_shot_throughput(architecture: str, batch: int, batches: int) -> float:
    import open_clip

    from cloob_core.model import register_project_configs

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
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"linear probe with CLIP's lambda search, {args.n} x {args.d} features (80% train, 20% test), CPU")
    print(f"  {'classes':>7}  {'probe':<22} {'seconds':>8} {'lambda':>9} {'test acc':>9}")
    for classes in args.classes:
        x, y = features(args.n, args.d, classes)
        cut = int(0.8 * args.n)
        started = time.perf_counter()
        fit, search = linear_probe(x[:cut], y[:cut], x[cut:], y[cut:], classes)
        ours_s, ours_acc = time.perf_counter() - started, accuracy(fit, x[cut:], y[cut:])
        started = time.perf_counter()
        sk_lambda, sk_acc = sklearn_probe(x[:cut], y[:cut], x[cut:], y[cut:])
        sk_s = time.perf_counter() - started
        print(f"  {classes:>7}  {'ours (torch L-BFGS)':<22} {ours_s:>8.2f} {search.lam:>9.3g} {100 * ours_acc:>8.2f}%")
        print(f"  {classes:>7}  {'scikit-learn L-BFGS':<22} {sk_s:>8.2f} {sk_lambda:>9.3g} {100 * sk_acc:>8.2f}%")
        print(f"  {classes:>7}  speed-up {sk_s / ours_s:.1f}x, accuracy difference {100 * (ours_acc - sk_acc):+.2f} pt")
    try:
        import clip_benchmark  # noqa: F401

        print("  clip_benchmark is importable, but its probe trains on a DataLoader of features with SGD; "
              "not compared here")
    except ImportError:
        print("  CLIP_benchmark's probe: skipped, clip_benchmark is not installed in this environment (its "
              "requirements pin other torch/open_clip releases than this project's)")
    print("\nzero-shot image embedding throughput, CPU, fp32")
    for architecture, batch, batches in (("cloob-tiny", 256, 8), ("RN50", 16, 3)):
        print(f"  {architecture:<11} {zero_shot_throughput(architecture, batch, batches):8.1f} images/s")


if __name__ == "__main__":
    main()
