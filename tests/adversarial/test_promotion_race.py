"""Concurrent promotion gates, as scheduled retraining runs can start them: real processes, released at one
instant, into one store on local disk and on the loopback S3 server. Production must end at the best candidate
that passed, and the history must hold one decision per candidate."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

METRIC = "mnist_zeroshot_classification.acc1"
GUARD = "mnist_linear_probe.lp_acc1"
TRIALS = 20

# Each process imports everything first, says it is ready, then waits for the start signal, so the gates'
# read-decide-write sections overlap as closely as processes allow.
GATE = textwrap.dedent("""
    import pathlib, sys, time
    from cloob_core.cli import main
    import cloob_core.ops.promotion  # noqa: F401  (the imports happen before the start)
    ready, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    ready.touch()
    while not go.exists():
        time.sleep(0.002)
    sys.exit(main(sys.argv[3:]))
""")


def candidate(folder: Path, top1: float) -> tuple[Path, Path]:
    folder.mkdir(parents=True)
    (folder / "open_clip_model.pt").write_bytes(os.urandom(256))
    (folder / "model_info.json").write_text("{}")
    report = folder / "metrics.json"
    report.write_text(json.dumps({"mnist_zeroshot_classification": {"acc1": top1},
                                  "mnist_linear_probe": {"lp_acc1": 0.8}}))
    return folder, report


def run_trial(store: str, root: Path, rng: random.Random) -> None:
    count = rng.randint(2, 4)
    values = rng.sample([0.30, 0.40, 0.50, 0.60, 0.70], count)  # apart by more than min_improvement
    models = [candidate(root / f"c{i}", value) for i, value in enumerate(values)]
    go = root / "go"
    settings = ["--store", store, "--metric", METRIC, "--min-improvement", "0.005", "--guards", f"{GUARD}=0.01"]
    processes = [subprocess.Popen([sys.executable, "-c", GATE, str(root / f"ready{i}"), str(go), "promote",
                                   "--model", str(folder), "--metrics", str(report), *settings],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i, (folder, report) in enumerate(models)]
    deadline = time.monotonic() + 60
    while not all((root / f"ready{i}").exists() for i in range(count)) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    outputs = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs

    from cloob_core import storage
    from cloob_core.ops import promotion

    production = promotion.read_production(store)
    best = max(range(count), key=lambda i: values[i])
    assert production["model_id"] == promotion.model_id(models[best][0]), (values, outputs)
    assert production["metrics"][METRIC] == values[best]
    decisions = [json.loads(storage.read_bytes(storage.join(store, "history", name)))
                 for name in storage.list_names(storage.join(store, "history"), ".json")]
    assert sorted(d["candidate"] for d in decisions) == sorted(promotion.model_id(m) for m, _ in models)
    assert sum(d["promoted"] for d in decisions) >= 1
    assert production["previous"] in {None, *(d["candidate"] for d in decisions)}


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_concurrent_gates_leave_the_best_candidate_in_production(backend, tmp_path, request):
    rng = random.Random(13)
    for trial in range(TRIALS):
        if backend == "local":
            store = str(tmp_path / f"store{trial}")
        else:
            bucket = request.getfixturevalue("s3_bucket")
            store = f"s3://{bucket}/trial{trial}"
        run_trial(store, tmp_path / f"trial{trial}", rng)
