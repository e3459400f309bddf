"""``cloob promote``: the promotion gate, recording production's metrics, and recording the GTO stage; each
calls one function of cloob_core.ops.promotion."""

from __future__ import annotations

import argparse

from cloob_core.cli.options import add_command, add_config_options, config_of
from cloob_core.config import ConfigError


def _promote(args: argparse.Namespace) -> int:
    """Compare a model's evaluation metrics with production's; promote (copy it into the store and move the
    production.json pointer atomically) when promote.metric improves by promote.min_improvement and no guarded metric
    regresses beyond its tolerance. Every decision is kept in STORE/history/. Not promoting is a normal outcome (exit
    status 0)."""
    from cloob_core.ops import promotion

    settings = config_of(args).promote
    if args.record_production_metrics:
        pointer = promotion.refresh_production_metrics(settings, metrics_file=args.metrics)
        print(f"recorded {len(pointer['metrics'])} metrics for production model {pointer['model_id']} in "
              f"{settings.store}")
        return 0
    if not args.model:
        raise ConfigError("cloob promote needs --model (or --record-production-metrics)")
    if args.record_stage:
        print(promotion.record_production_stage(settings, args.model, decision_file=args.output))
        return 0
    decision = promotion.promote(settings, model_dir=args.model, metrics_file=args.metrics, decision_file=args.output)
    print(decision.summary())
    if decision.registry:
        print(decision.registry)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "promote", _promote,
                         "the promotion gate: make a model production if it beats the current one")
    parser.add_argument("--model", metavar="DIR", help="the candidate: a `cloob train` model folder")
    parser.add_argument("--metrics", default="reports/metrics.json",
                        help="its `cloob eval report` metrics.json (default: reports/metrics.json)")
    parser.add_argument("--output", metavar="FILE", help="write the decision as JSON here (e.g. for DVC metrics); "
                        "with --record-stage, the gate's decision file to update with the stage")
    parser.add_argument("--record-production-metrics", action="store_true",
                        help="instead: store --metrics as production's current metrics (after re-evaluating it)")
    parser.add_argument("--record-stage", action="store_true",
                        help="instead: record the production model --model as GTO stage promote.registry_stage, "
                        "once its dvc.lock is committed")
    add_config_options(parser, "promote")
