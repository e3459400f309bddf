"""The ``cloob`` command: one subcommand per stage, each a thin caller of a plain function in cloob_core.

DVC stages and KFP components call these same subcommands, so no logic lives outside the library.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from cloob_core import __version__
from cloob_core.config import ConfigError, dump_defaults, load_config


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        metavar="PATH",
        help="YAML file with config sections (e.g. params.yaml); defaults are used where it is silent",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="override one value, e.g. --set objective.name=clip (repeatable)",
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    from cloob_core.demo import run_demo

    config = load_config(args.params, args.overrides)
    result = run_demo(config, args.output, progress=not args.no_progress)
    zero_shot = result.metrics["zero_shot"]
    print(
        f"zero-shot top-1 on the held-out split ({result.metrics['held_out_images']} images): "
        f"{100 * zero_shot['top1']:.1f}%  (chance {100 * zero_shot['chance']:.1f}%, "
        f"untrained {100 * result.metrics['zero_shot_untrained_top1']:.1f}%, "
        f"mean per-class recall {100 * zero_shot['mean_per_class_recall']:.1f}%)"
    )
    print(
        f"objective {result.metrics['objective']}, {result.metrics['steps']} steps in "
        f"{result.metrics['train_seconds']:.0f} s, final loss {result.metrics['final_loss']:.4f}"
    )
    print(f"wrote {result.output_dir}/metrics.json, loss_history.csv and training_summary.png")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    if args.params or args.overrides:
        import yaml

        print(yaml.safe_dump(load_config(args.params, args.overrides).model_dump(), sort_keys=False), end="")
    else:
        print(dump_defaults(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cloob",
        description="CLOOB contrastive image-text pretraining: every pipeline stage as a subcommand.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="train a tiny CLOOB model on the embedded digits (CPU) and report held-out zero-shot accuracy",
        description="Train the tiny CLOOB model on the embedded MNIST image-caption pairs and report "
        "zero-shot top-1 accuracy on the held-out split next to chance. Writes metrics.json, "
        "loss_history.csv and training_summary.png.",
    )
    _add_config_options(demo)
    demo.add_argument("--output", default="runs/demo", help="output folder (default: runs/demo)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=_cmd_demo)

    config = sub.add_parser(
        "config",
        help="print the configuration (defaults, or a params file with overrides applied)",
        description="Print the typed configuration as YAML. Without options: the defaults, which is what "
        "params.yaml holds. With --params/--set: the validated result.",
    )
    _add_config_options(config)
    config.set_defaults(func=_cmd_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"cloob: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
