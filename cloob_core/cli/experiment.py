"""``cloob experiment``: a grid of training runs with seeds (the paper's ablation, the recipe sweep) through
cloob_core.experiments.grid.experiment, printing each run as it finishes and the table at the end."""

from __future__ import annotations

import argparse

from cloob_core.cli.options import add_command, add_config_options, config_of


def _print_run(result: dict) -> None:
    if "diverged" in result:
        print(f"{result['cell']} seed {result['seed']}: diverged ({result['diverged']})", flush=True)
        return
    final = result["trajectory"][-1]
    shown = ", ".join(f"{key} {100 * value:.1f}%" for key, value in final.items()
                      if key.endswith(("zeroshot_acc1", "recall@5")))
    print(f"{result['cell']} seed {result['seed']}: {result['steps']} steps, "
          f"{result['seconds_per_step']:.3f} s/step; {shown}", flush=True)


def _experiment(args: argparse.Namespace) -> int:
    from cloob_core.experiments.grid import experiment

    result = experiment(config_of(args), args.grid, args.output, seeds=args.seeds, points=args.points,
                        quick=args.quick, on_result=_print_run)
    print()
    print(result.report.table.read_text(), end="")
    print(f"wrote {result.report.table}, {result.report.summary.name} and {len(result.report.figures)} figures; "
          f"each run's measurements in {args.output}/runs/*/result.json")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from cloob_core.experiments.grids import GRIDS

    description = ("Train every cell of a grid (" + "; ".join(f"{g.name}: {g.description}" for g in GRIDS.values())
                   + ") on train.shards with seeds 0..SEEDS-1, measure each run at its checkpoints on the eval suite "
                   "(zero-shot, retrieval, diagnostics), and write OUTPUT/table.md (mean ± std over seeds), "
                   "summary.json and the figures. A rerun resumes: finished runs are kept.")
    parser = add_command(sub, "experiment", _experiment,
                         "a grid of training runs with seeds: the paper's ablation, or the recipe sweep", description)
    parser.add_argument("grid", choices=sorted(GRIDS), help="which grid")
    parser.add_argument("--output", required=True, metavar="DIR", help="results folder")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell (default: 3)")
    parser.add_argument("--points", type=int, default=8, help="checkpoints measured per run (default: 8)")
    parser.add_argument("--quick", action="store_true", help="the grid's short smoke-test settings (CI)")
    add_config_options(parser)
