"""Continuing from an existing model against starting from scratch, on new data: how many steps each needs to reach
the from-scratch run's final held-out retrieval R@5 (issue 45's benchmark line).

The packaged captioned set's 8 training shards are split in two: the old data trains the existing model; the new
data trains two runs of the same length and recipe, one from random weights and one with ``train.init_from`` that
model. ``--split interleaved`` (the default: even shards old, odd shards new) is a crawl that grew with more of the
same; ``--split ordered`` (shards 0-3 old, 4-7 new) is a shift of domain, as the set is ordered by source: the old
half is mostly Tux Paint pictures, the new half Fluent Emoji only. Both runs are evaluated while they train
(``train.eval_every``) on the captioned set's held-out test split, by `cloob eval suite`; the figure is the mean of
image->text and text->image R@5, as the promotion gate reads it. Seeds give the spread.

    .venv/bin/python benchmarks/bench_init_from.py [--steps 300] [--every 30] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

METRIC = ("captioned_zeroshot_retrieval.image_retrieval_recall@5",
          "captioned_zeroshot_retrieval.text_retrieval_recall@5")


def cloob(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "cloob_core.cli", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"cloob {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def curve(run: Path) -> list[tuple[int, float]]:
    with (run / "eval_history.csv").open() as handle:
        return [(int(row["step"]), (float(row[METRIC[0]]) + float(row[METRIC[1]])) / 2)
                for row in csv.DictReader(handle)]


def first_reaching(points: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, value in points if value >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--architecture", default="cloob-tiny")
    parser.add_argument("--split", choices=["interleaved", "ordered"], default="interleaved")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-init-") as scratch:
        root = Path(scratch)
        cloob("data", "shards", "--source", "captioned", "--output", str(root / "shards"), "--no-progress")
        shards = root / "shards"
        old, new = ((str(shards / "{00000..00006..2}.tar"), str(shards / "{00001..00007..2}.tar"))
                    if args.split == "interleaved" else
                    (str(shards / "{00000..00003}.tar"), str(shards / "{00004..00007}.tar")))
        common = ["--steps", str(args.steps), "--checkpoint-every", str(args.every), "--no-progress",
                  "--no-tensorboard", "--set", "optim.warmup_steps=30", "--architecture", args.architecture]
        cloob("train", "--shards", old, "--output", str(root / "existing"), *common)
        rows = []
        for seed in args.seeds:
            evaluated = [*common, "--seed", str(seed), "--eval-every", str(args.every), "--set",
                         "train.eval_datasets=[captioned]"]
            cloob("train", "--shards", new, "--output", str(root / f"scratch-{seed}"), *evaluated)
            cloob("train", "--shards", new, "--output", str(root / f"continued-{seed}"), *evaluated, "--set",
                  f"train.init_from={root / 'existing' / 'model'}")
            scratch_curve, continued_curve = curve(root / f"scratch-{seed}"), curve(root / f"continued-{seed}")
            target = scratch_curve[-1][1]
            rows.append((seed, target, first_reaching(scratch_curve, target), continued_curve[-1][1],
                         first_reaching(continued_curve, target)))
            print(f"seed {seed}: from scratch   {' '.join(f'{s}:{v:.3f}' for s, v in scratch_curve)}")
            print(f"seed {seed}: continued      {' '.join(f'{s}:{v:.3f}' for s, v in continued_curve)}")
    print(f"\n{args.architecture}, {args.split} split, {args.steps} steps on the new half of the captioned set (4 of "
          "8 shards), mean R@5 on its test split")
    print(f"{'seed':>4}  {'scratch final':>13}  {'scratch reaches it at':>21}  {'continued final':>15}  "
          f"{'continued reaches it at':>23}  {'steps ratio':>11}")
    for seed, target, scratch_at, final, continued_at in rows:
        ratio = f"{continued_at / scratch_at:.2f}" if continued_at and scratch_at else "-"
        print(f"{seed:>4}  {target:>13.4f}  {scratch_at!s:>21}  {final:>15.4f}  {continued_at!s:>23}  {ratio:>11}")
    finals = [final - target for _, target, _, final, _ in rows]
    print(f"continued minus scratch at the end: mean {statistics.mean(finals):+.4f} over {len(rows)} seed(s)")


if __name__ == "__main__":
    main()
