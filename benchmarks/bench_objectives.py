"""What the restricted-negative and poly-view objectives cost over the plain ones, forward+backward, in one run.

    .venv/bin/python benchmarks/bench_objectives.py [--samples 256 1024] [--dim 512] [--views 2 4] [--repeats 3]

Anchors: each restricted objective against its full-band twin on the same batch (the ranking is a sort per
anchor), and each poly-view objective on K samples x M views against CLIP's InfoNCE (open_clip's ``ClipLoss``)
on the same number of embeddings, K*M pairs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_losses import INV_TAU, open_clip_loss, time_fwd_bwd  # this folder, run as a script

from cloob_core.objectives.registry import build_objective


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--views", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, d={args.dim}\n")
    print(f"{'N':>5}  {'objective':<34} {'fwd+bwd ms':>11}  {'anchor':<26} {'anchor ms':>10}  ours / anchor")
    for n in args.samples:
        pairs = [("clip_ring p_out=0.1", build_objective("clip_ring", p_out=0.1), "clip", build_objective("clip")),
                 ("cloob_ring p_in=.02 p_out=.5", build_objective("cloob_ring", p_in=0.02, p_out=0.5),
                  "cloob", build_objective("cloob"))]
        for name, ours, anchor_name, anchor in pairs:
            mine = time_fwd_bwd(lambda x, y, f=ours: f(x, y, INV_TAU), n, args.dim, args.repeats)
            base = time_fwd_bwd(lambda x, y, f=anchor: f(x, y, INV_TAU), n, args.dim, args.repeats)
            print(f"{n:>5}  {name:<34} {1e3 * mine:>11.2f}  {anchor_name:<26} {1e3 * base:>10.2f}  "
                  f"{mine / base:.2f}")
        for m in args.views:
            k = n // m
            clip_time = time_fwd_bwd(open_clip_loss(), k * m, args.dim, args.repeats)
            for name in ("pvc_geometric", "pvc_arithmetic", "multicrop", "suffstats"):
                objective = build_objective(name, image_views=m, text_views=m)
                mine = time_fwd_bwd(lambda x, y, f=objective: f(F.normalize(x, dim=-1), F.normalize(y, dim=-1),
                                                                INV_TAU), k * m, args.dim, args.repeats)
                print(f"{n:>5}  {f'{name} K={k} M={m}':<34} {1e3 * mine:>11.2f}  "
                      f"{f'open_clip ClipLoss N={k * m}':<26} {1e3 * clip_time:>10.2f}  {mine / clip_time:.2f}")
        print()


if __name__ == "__main__":
    main()
