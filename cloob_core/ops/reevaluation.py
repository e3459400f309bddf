"""``cloob eval production``: production's metrics on today's evaluation suite, recorded in the store, so the next
promotion gate compares like with like. The scheduled Kubeflow evaluation pipeline does the same in steps; this is
the one-command form for a DVC user whose gate said "re-evaluate production first"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloob_core import storage
from cloob_core.config import CloobConfig
from cloob_core.evaluation.records import Report
from cloob_core.evaluation.suite import evaluate_suite
from cloob_core.evaluation.suite_report import SUITE_FILE, suite_report
from cloob_core.model.source import ModelSource
from cloob_core.ops.promotion import fetch_production, record_production_metrics


@dataclass(frozen=True)
class ProductionEvaluation:
    model_id: str
    report: Report
    pointer: dict[str, Any]  # production.json as recorded


def reevaluate_production(config: CloobConfig, output: str | Path, *, device: str = "auto", precision: str = "auto",
                          workers: int | None = None, progress: bool = True) -> ProductionEvaluation:
    """Fetch production's model from ``promote.store``, evaluate it on the ``eval`` suite into ``output`` (``model/``,
    ``datasets/``, ``report/``) and record its metrics and the suite's fingerprint in the store."""
    output = Path(output)
    fetched = fetch_production(config.promote.store, output / "model")
    evaluate_suite(config.eval, ModelSource(model=str(output / "model"), device=device, precision=precision),
                   output / "datasets", progress=progress, workers=workers)
    report = suite_report(config.eval, [output / "datasets"], output / "report")
    suite = storage.read_json(output / "report" / SUITE_FILE)
    pointer = record_production_metrics(config.promote, report.metrics, suite, model=fetched["model_id"])
    return ProductionEvaluation(fetched["model_id"], report, pointer)
