"""A complete evaluation report as `cloob eval report` publishes it, for tests of what reads one (the promotion
gate) that need given metrics rather than an evaluated model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cloob_core.evaluation.records import Results, publish_report
from cloob_core.ops.promotion import model_id


def report_of(model_dir: Path, metrics: dict[str, dict[str, Any]], folder: Path | None = None,
              suite: dict[str, Any] | None = None) -> Path:
    """Publish a report whose results are ``metrics``, of the model in ``model_dir``, into ``folder`` (default:
    ``model_dir``); its ``metrics.json``. ``suite``: the suite fingerprint it carries (``suite.json``)."""
    folder = folder or model_dir
    folder.mkdir(parents=True, exist_ok=True)
    identity = model_id(model_dir)
    entries = {name: {"record": f"results/{name}.json", "plots": [], "model": "test", "pretrained": str(model_dir),
                      "model_id": identity, "warnings": [], "scalars": scalars}
               for name, scalars in metrics.items()}
    files = {entry["record"]: json.dumps({"dataset": name, "metrics": entry["scalars"]}).encode()
             for name, entry in entries.items()}
    publish_report(Results(entries, files), folder, extra={"suite.json": suite} if suite else None)
    return folder / "metrics.json"
