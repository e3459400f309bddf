"""Forward+backward time of the objectives vs open_clip's ClipLoss and a naive CLOOB, in one run.

    .venv/bin/python benchmarks/bench_losses.py [--sizes 256 1024 4096] [--dim 512] [--repeats 3]

Anchors:
  * open_clip ``ClipLoss`` (the InfoNCE everyone uses) against our ``infonce_loss``;
  * CLOOB as published (paper Pseudocode 1 / ml-jku/cloob): four separate Hopfield retrievals and a
    ``-1000`` constant masking the positives, against our ``cloob_loss`` (two retrievals sharing a memory
    matmul, ``-inf`` masking).
Each row also gives the fraction of this machine's measured float32 GEMM throughput the variant reaches,
counting only its matrix-multiply FLOPs (the bound for these objectives).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from cloob_core.objectives.losses import cloob_loss, infoloob_loss, infonce_loss

INV_TAU = 30.0
BETA = 8.0


def naive_cloob(x: torch.Tensor, y: torch.Tensor, inv_tau: float, beta: float) -> torch.Tensor:
    """CLOOB exactly as the paper's pseudocode and reference code write it."""

    def retrieve(state, stored):
        return F.normalize(torch.softmax(beta * state @ stored.T, dim=-1) @ stored, dim=-1)

    def info_loob(anchors, samples):
        tau = 1.0 / inv_tau
        k = anchors @ samples.T / tau
        eye = torch.eye(k.shape[0], dtype=k.dtype, device=k.device)
        positives = -torch.mean(torch.sum(k * eye, dim=1))
        negatives = torch.mean(torch.logsumexp(k * (1 - eye) + eye * -1000.0, dim=1))
        return tau * (positives + negatives)

    u_x, u_y = retrieve(x, x), retrieve(y, x)
    v_x, v_y = retrieve(x, y), retrieve(y, y)
    return info_loob(u_x, u_y) + info_loob(v_y, v_x)


def open_clip_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    loss = ClipLoss()
    scale = torch.tensor(INV_TAU)
    return lambda x, y: loss(x, y, scale)


def matmul_flops(name: str, n: int, d: int) -> float:
    """Matrix-multiply FLOPs of forward+backward (backward = 2x forward for a matmul)."""
    nnd = 2.0 * n * n * d  # one [n, d] x [d, n] product
    forward = {
        "infonce_loss": 1,  # one similarity matrix serves both directions
        "infoloob_loss": 1,
        "open_clip ClipLoss": 2,  # logits_per_image and logits_per_text are two products
        "cloob_loss": 9,  # 3 score products (x@y.T serves both memories) + 4 readouts + 2 similarity matrices
        "naive CLOOB": 10,  # 4 retrievals x (scores + readout) = 8, plus 2 similarity matrices
    }[name]
    return 3 * forward * nnd


def measure_gemm_flops(n: int, d: int, repeats: int = 5) -> float:
    """Best float32 GEMM rate of this machine for the objectives' own shape, ``[n, d] @ [d, n]`` (FLOP/s)."""
    a, b = torch.randn(n, d), torch.randn(d, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * n * n * d / best


def time_fwd_bwd(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n: int, d: int, repeats: int) -> float:
    generator = torch.Generator().manual_seed(n)
    x = F.normalize(torch.randn(n, d, generator=generator), dim=-1).requires_grad_()
    y = F.normalize(torch.randn(n, d, generator=generator), dim=-1).requires_grad_()
    times = []
    for i in range(repeats + 1):  # the first run warms up allocators and kernels
        x.grad = y.grad = None
        start = time.perf_counter()
        fn(x, y).backward()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median reported)")
    args = parser.parse_args()

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, d={args.dim}")
    print("GEMM peak = best measured rate of one [N, d] @ [d, N] product on this machine\n")
    variants: dict[str, Callable] = {
        "infonce_loss": lambda x, y: infonce_loss(x, y, INV_TAU),
        "open_clip ClipLoss": open_clip_loss(),
        "infoloob_loss": lambda x, y: infoloob_loss(x, y, INV_TAU),
        "cloob_loss": lambda x, y: cloob_loss(x, y, INV_TAU, BETA),
        "naive CLOOB": lambda x, y: naive_cloob(x, y, INV_TAU, BETA),
    }
    header = f"{'N':>5}  {'objective':<20} {'fwd+bwd ms':>11} {'% of GEMM peak':>15}  ratio (anchor time / ours)"
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        repeats = max(1, args.repeats if n <= 1024 else args.repeats - 1)
        peak = measure_gemm_flops(n, args.dim)
        times = {name: time_fwd_bwd(fn, n, args.dim, repeats) for name, fn in variants.items()}
        ratios = {
            "infonce_loss": f"open_clip ClipLoss / ours = {times['open_clip ClipLoss'] / times['infonce_loss']:.2f}",
            "cloob_loss": f"naive CLOOB / ours = {times['naive CLOOB'] / times['cloob_loss']:.2f}",
            "infoloob_loss": f"infonce_loss / ours = {times['infonce_loss'] / times['infoloob_loss']:.2f}",
        }
        for name, seconds in times.items():
            efficiency = matmul_flops(name, n, args.dim) / seconds / peak
            print(f"{n:>5}  {name:<20} {1e3 * seconds:>11.2f} {100 * efficiency:>14.0f}%  {ratios.get(name, '')}")
        print(f"{'':>5}  GEMM peak {peak / 1e9:.1f} GFLOP/s\n")


if __name__ == "__main__":
    main()
