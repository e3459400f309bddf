"""Promotion gates as scheduled runs start them: candidates, gates run as real processes released at one instant,
and the check every trial ends with: production, what each gate printed and the history agree."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hostile import poised, wait_for

from reports import report_of

METRIC = "mnist_zeroshot_classification.acc1"
GUARD = "mnist_linear_probe.lp_acc1"
SETTINGS = ["--metric", METRIC, "--min-improvement", "0.005", "--guards", f"{GUARD}=0.01", "--min-first", "{}"]

def candidate(folder: Path, top1: float) -> tuple[Path, Path]:
    """A model folder with its own weights, and a report whose metric is ``top1``."""
    folder.mkdir(parents=True)
    (folder / "open_clip_model.safetensors").write_bytes(os.urandom(256))
    (folder / "model_info.json").write_text("{}")
    return folder, report_of(folder, {"mnist_zeroshot_classification": {"acc1": top1},
                                      "mnist_linear_probe": {"lp_acc1": 0.8}})


@dataclass
class Gate:
    model: Path
    value: float
    code: int
    out: str
    err: str

    @property
    def printed(self) -> str:
        lines = [line for line in self.out.splitlines() if line.startswith("promotion gate: ")]
        assert len(lines) == 1, (self.out, self.err)
        return lines[0]


def run_gates(store: str, root: Path, values: list[float], *extra: str) -> list[Gate]:
    """One ``cloob promote`` process per value, released together; their outcomes."""
    models = [candidate(root / f"c{i}", value) for i, value in enumerate(values)]
    go = root / "go"
    processes = [poised(root / f"ready{i}", go, ["promote", "--model", folder, "--metrics", report, "--store", store,
                                                 *SETTINGS, *extra], preload=("cloob_core.ops.promotion",))
                 for i, (folder, report) in enumerate(models)]
    wait_for(lambda: all((root / f"ready{i}").exists() for i in range(len(values))), "every gate ready",
             processes=tuple(processes))
    go.touch()  # the gates' read-decide-write sections overlap as closely as processes allow
    outputs = [process.communicate(timeout=300) for process in processes]
    return [Gate(folder, value, process.returncode, out, err)
            for (folder, _), value, process, (out, err) in zip(models, values, processes, outputs, strict=True)]


def history(store: str) -> list[dict]:
    from cloob_core import storage

    folder = storage.join(store, "history")
    return [json.loads(storage.read_bytes(storage.join(folder, name))) for name in storage.list_names(folder, ".json")]


def check_agreement(store: str, gates: list[Gate]) -> dict | None:
    """Production, the printed decisions and ``history/`` tell one story; the production pointer (or None)."""
    from cloob_core.ops import promotion

    production = promotion.read_production(store)
    decisions = history(store)
    by_candidate = {}
    for decision in decisions:
        by_candidate.setdefault(decision["candidate"], []).append(decision)
    for gate in gates:
        assert gate.code == 0, gate.err
        mine = by_candidate.get(promotion.model_id(gate.model), [])
        assert len(mine) == 1, (gate.printed, mine)  # one decision per gate, recorded once
        assert ("NOT PROMOTED" not in gate.printed) == mine[0]["promoted"], (gate.printed, mine[0])
    promoted = sorted((d for d in decisions if d["promoted"]), key=lambda d: d["decision_id"])
    if production is None:
        assert not promoted, promoted
        return None
    assert promoted, "production moved without a promoted decision in the history"
    assert production["model_id"] == promoted[-1]["candidate"], (production, promoted)
    assert production["decision"]["decision_id"] == promoted[-1]["decision_id"]  # (its metrics may be re-recorded)
    assert production["decision"] == {**promoted[-1], "registry": production["decision"]["registry"]}
    return production
