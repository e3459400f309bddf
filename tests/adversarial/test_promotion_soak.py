"""Scheduled promotion runs, one after another, each a report then a gate, with random candidate metrics and random
faults: S3 answers 5xx or resets after applying a write, SlowDown, latency, and kill -9 of the report or of the
gate at a random write. What a scheduler does after a killed step: run it again. After every run production, the
history and the printed decisions agree, a gate never takes a report of another model, and production never
holds a model worse than one the gate saw complete before (by more than ``min_improvement``, which a better
candidate must clear). The faults come in turn, in a shuffled order (every one in each 7 gates), the kills at random.
The default suite runs a few; ``-m slow`` runs 20 (each fault about three times)."""

from __future__ import annotations

import itertools
import random

import pytest
from gates import Gate, check_agreement
from killing import run

from cloob_core.ops import promotion
from reports import report_of

METRIC = "mnist_zeroshot_classification.acc1"
MIN_IMPROVEMENT = 0.005
FAULTS = [
    None,
    dict(kind="error-after", method="PUT", key="production.json"),
    dict(kind="reset-after", method="PUT", key="production.json"),
    dict(kind="error-after", method="PUT", key="history/"),
    dict(kind="reset-after", method="PUT", key="/models/"),
    dict(kind="slowdown", method="PUT", key="", times=2),
    dict(kind="latency", method=None, key="", times=6, seconds=0.2),
]


def _model(folder, rng: random.Random):
    folder.mkdir(parents=True)
    (folder / "open_clip_model.safetensors").write_bytes(rng.randbytes(256))
    (folder / "model_info.json").write_text("{}")
    return folder


@pytest.mark.parametrize("runs", [pytest.param(6, id="6-runs"), pytest.param(20, id="20-runs", marks=pytest.mark.slow)])
def test_scheduled_promotions_under_faults_and_kills_tell_one_story(tmp_path, fault_proxy, s3_bucket, runs):
    rng = random.Random(43)
    store = f"s3://{s3_bucket}/registry"
    report = tmp_path / "report"  # the pipeline's report folder, as each run leaves it
    gate_args = ["--store", store, "--metric", METRIC, "--guards", "{}", "--min-first", "{}",
                 "--min-improvement", str(MIN_IMPROVEMENT)]
    gates: list[Gate] = []
    seen: dict[str, float] = {}  # model id -> its metric, for every model a gate decided on
    moments = tmp_path / "moments"
    happened: set[str] = set()  # what the random schedule did, so the test can tell it covered the faults
    faults = itertools.cycle(rng.sample(FAULTS, len(FAULTS)))
    for index in range(runs):
        model = _model(tmp_path / f"model{index}", rng)
        value = round(rng.uniform(0.3, 0.9), 3)
        evaluated = tmp_path / f"eval{index}"
        report_of(model, {"mnist_zeroshot_classification": {"acc1": value}}, evaluated)
        make_report = ["eval", "report", "--inputs", evaluated, "--output", report]
        gate = ["promote", "--model", model, "--metrics", report / "metrics.json", *gate_args]
        if rng.random() < 0.3:  # the report is killed at a random write
            happened.add(f"report {run(make_report, moments, kill_at=rng.randint(1, 12)).code}")
            if rng.random() < 0.5:  # and the gate runs anyway, on whatever report is there
                before = promotion.read_production(store)
                early = run(gate, moments)
                if early.code == 2:  # another model's report, or none yet
                    line = early.error_line()
                    assert any(why in line for why in ("holds the results of model", "does not exist",
                                                       "not part of a complete evaluation report")), line
                    assert promotion.read_production(store) == before
                else:  # the report had been published before the kill
                    assert early.code == 0, early.err
                    gates.append(Gate(model, value, early.code, early.out, early.err))
                    seen[promotion.model_id(model)] = value
                    check_agreement(store, gates)
                    continue
        assert run(make_report, moments).code == 0
        fault = next(faults)
        if fault:
            fault_proxy.add(**fault)
            happened.add(f"{fault['kind']} {fault['key']}")
        done = run(gate, moments, kill_at=rng.randint(1, 15) if rng.random() < 0.3 else 0)
        happened.add(f"gate {done.code}")
        fault_proxy.clear()
        if done.code != 0:  # killed (or failed under the fault): the scheduler runs the gate again
            assert done.code == -9 or "cloob: " in done.err, done.err
            done = run(gate, moments)
        assert done.code == 0, done.err
        gates.append(Gate(model, value, done.code, done.out, done.err))
        seen[promotion.model_id(model)] = value
        production = check_agreement(store, gates)
        assert production is not None
        assert production["metrics"][METRIC] >= max(seen.values()) - MIN_IMPROVEMENT - 1e-9, (production, seen)
        assert production["model_id"] in seen
    if runs >= 20:
        assert {"report -9", "gate -9"} | {f"{f['kind']} {f['key']}" for f in FAULTS if f} <= happened, happened
