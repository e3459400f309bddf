"""The promotion gate when the store misbehaves: a write applied whose reply is lost (a 500 or a reset after the
server applied it), SlowDown, latency, a store that ignores conditional writes, and a crash (a full disk, a
failing store) between moving production and recording the decision. The S3 cases run against the loopback S3
server behind tests/s3_fault_proxy.py. After every trial, production, each gate's printed decision and the
history must agree."""

from __future__ import annotations

import errno
import json
import random
from pathlib import Path

import pytest
from gates import SETTINGS, Gate, candidate, check_agreement, history, run_gates
from hostile import cli

from cloob_core import storage
from cloob_core.ops import promotion
from reports import report_of


def gate(capsys, store: str, folder, value: float, *extra: str) -> Gate:
    """One ``cloob promote`` in this process."""
    model, report = candidate(folder, value)
    done = cli(capsys, "promote", "--model", model, "--metrics", report, "--store", store, *SETTINGS, *extra)
    return Gate(model, value, done.code, done.out, done.err)


@pytest.mark.parametrize("fault", ["error-after", "reset-after"])
def test_a_lost_reply_to_the_switch_is_recognised_for_the_first_and_a_later_model(capsys, tmp_path, s3_bucket,
                                                                                   fault_proxy, fault):
    for trial in range(4):
        store = f"s3://{s3_bucket}/lost{trial}"
        gates = []
        for step, value in enumerate((0.5, 0.6)):  # If-None-Match: * for the first model, If-Match for the next
            injected = fault_proxy.add(fault, key=f"/lost{trial}/production.json")
            gates.append(gate(capsys, store, tmp_path / f"t{trial}" / f"m{step}", value))
            assert injected.hits == 1  # the write was applied and its reply lost
            assert gates[-1].printed.startswith("promotion gate: PROMOTED"), gates[-1].out
            assert "recorded now" not in gates[-1].printed  # recognised as its own write, not as a crash
        production = check_agreement(store, gates)
        assert production["model_id"] == promotion.model_id(gates[1].model)
        assert production["previous"] == promotion.model_id(gates[0].model)


def test_concurrent_gates_agree_with_production_under_lost_replies_and_latency(tmp_path, s3_bucket, fault_proxy):
    rng = random.Random(7)
    for trial in range(5):
        store = f"s3://{s3_bucket}/busy{trial}"
        fault_proxy.clear()
        fault_proxy.add("latency", method=None, times=None, seconds=0.02)
        fault_proxy.add("error-after", key=f"/busy{trial}/production.json", times=2)
        fault_proxy.add("reset-after", key=f"/busy{trial}/production.json", times=1)
        fault_proxy.add("slowdown", method=None, key=f"/busy{trial}/", times=3)
        values = rng.sample([0.30, 0.40, 0.50, 0.60, 0.70], 3)
        gates = run_gates(store, tmp_path / f"trial{trial}", values)
        production = check_agreement(store, gates)
        best = max(gates, key=lambda g: g.value)
        assert production["model_id"] == promotion.model_id(best.model), [g.printed for g in gates]


def test_a_store_that_ignores_conditional_writes_is_refused_unless_single_writer_is_configured(
        capsys, tmp_path, s3_bucket, fault_proxy):
    fault_proxy.add("strip-conditions", method=None, times=None)
    for trial in range(3):
        store = f"s3://{s3_bucket}/nocas{trial}"
        for outcome in run_gates(store, tmp_path / f"trial{trial}", [0.4, 0.5, 0.6, 0.7]):
            assert outcome.code == 2, outcome.out
            lines = [line for line in outcome.err.splitlines() if line.startswith("cloob: ")]
            assert len(lines) == 1 and "Traceback" not in outcome.err, outcome.err
            assert f"the store {store} " in lines[0] and "ignores conditional writes" in lines[0]
            assert "promote.single_writer" in lines[0] and "PROMOTED" not in outcome.out
        assert promotion.read_production(store) is None and history(store) == []
        assert storage.list_names(f"{store}/.cas-probe") == []  # the probes clean up
    store = f"s3://{s3_bucket}/single"
    first = gate(capsys, store, tmp_path / "single", 0.5, "--single-writer")
    assert first.printed.startswith("promotion gate: PROMOTED")
    check_agreement(store, [first])


def _full_disk_on_history(monkeypatch):
    """Every file written under history/ fails as on a full disk."""
    write = Path.write_bytes

    def failing(path, data):
        if path.parent.name == "history":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, data)

    monkeypatch.setattr(Path, "write_bytes", failing)


def test_a_crash_between_the_switch_and_the_record_is_completed_by_the_rerun(capsys, tmp_path, monkeypatch):
    store = str(tmp_path / "store")
    base = gate(capsys, store, tmp_path / "base", 0.4)
    with monkeypatch.context() as patch:
        _full_disk_on_history(patch)
        crashed = gate(capsys, store, tmp_path / "better", 0.6)
    line = crashed.err.strip().splitlines()[-1]
    assert crashed.code == 2 and line.startswith("cloob: no space left on device writing ") and "/history/" in line
    pointer = promotion.read_production(store)
    assert pointer["model_id"] == promotion.model_id(crashed.model)  # the switch happened ...
    assert len(history(store)) == 1  # ... and its record did not
    # the rerun of the same gate reports the decision it had made, and records it
    model, report = crashed.model, crashed.model / "metrics.json"
    again = cli(capsys, "promote", "--model", model, "--metrics", report, "--store", store, *SETTINGS)
    assert again.code == 0 and again.out.startswith("promotion gate: PROMOTED") and "recorded now" in again.out
    rerun = Gate(model, 0.6, again.code, again.out, again.err)
    check_agreement(store, [base, rerun])
    assert [d["promoted"] for d in history(store)] == [True, True]


def test_another_gate_completes_an_interrupted_decision_before_its_own(capsys, tmp_path, monkeypatch):
    store = str(tmp_path / "store")
    with monkeypatch.context() as patch:
        _full_disk_on_history(patch)
        crashed = gate(capsys, store, tmp_path / "first", 0.5)
    assert crashed.code == 2 and promotion.read_production(store) is not None and history(store) == []
    worse = gate(capsys, store, tmp_path / "worse", 0.3)
    assert "NOT PROMOTED" in worse.printed
    decisions = history(store)
    assert sorted(d["promoted"] for d in decisions) == [False, True]
    assert promotion.read_production(store)["decision"] == next(d for d in decisions if d["promoted"])


def test_a_record_the_store_keeps_refusing_is_completed_by_the_rerun_on_s3(capsys, tmp_path, s3_bucket,
                                                                          fault_proxy):
    store = f"s3://{s3_bucket}/slow"
    fault_proxy.add("slowdown", key="/slow/history/", times=None)
    crashed = gate(capsys, store, tmp_path / "first", 0.5)
    assert crashed.code == 2 and "SlowDown" in crashed.err.strip().splitlines()[-1]
    assert promotion.read_production(store) is not None and history(store) == []
    fault_proxy.clear()
    model = crashed.model
    again = cli(capsys, "promote", "--model", model, "--metrics", model / "metrics.json", "--store", store, *SETTINGS)
    assert again.code == 0 and again.out.startswith("promotion gate: PROMOTED")
    check_agreement(store, [Gate(model, 0.5, again.code, again.out, again.err)])


def test_a_store_on_a_full_disk_is_one_line_and_promotes_nothing(capsys, tmp_path, small_disk):
    store = small_disk(64 * 1024)
    model, _ = candidate(tmp_path / "big", 0.5)
    (model / "open_clip_model.safetensors").write_bytes(bytes(256 * 1024))  # larger than the disk
    report = report_of(model, {"mnist_zeroshot_classification": {"acc1": 0.5}, "mnist_linear_probe": {"lp_acc1": 0.8}})
    done = cli(capsys, "promote", "--model", model, "--metrics", report, "--store", store, *SETTINGS)
    line = done.error_line()
    assert done.code == 2 and line.startswith(f"cloob: no space left on device writing {store}/models/")
    assert promotion.read_production(str(store)) is None and history(str(store)) == []
    assert not list(store.rglob("*.tmp"))
    assert json.loads(json.dumps(done.out)) == ""  # nothing printed as a decision


def test_a_rerun_of_the_production_models_gate_reports_the_decision_in_force(capsys, tmp_path):
    store = str(tmp_path / "store")
    first = gate(capsys, store, tmp_path / "first", 0.5)
    model = first.model
    again = cli(capsys, "promote", "--model", model, "--metrics", model / "metrics.json", "--store", store, *SETTINGS)
    assert again.code == 0 and again.out.startswith("promotion gate: PROMOTED") and "already in production" in again.out
    check_agreement(store, [Gate(model, 0.5, again.code, again.out, again.err)])  # one decision, recorded once


def test_recording_productions_metrics_survives_a_lost_reply(capsys, tmp_path, s3_bucket, fault_proxy):
    from cloob_core.config import PromoteConfig

    store = f"s3://{s3_bucket}/reeval"
    first = gate(capsys, store, tmp_path / "first", 0.5)
    fault_proxy.add("error-after", key="/reeval/production.json")
    settings = PromoteConfig(store=store, metric=SETTINGS[1], guards={}, min_first={})
    pointer = promotion.record_production_metrics(settings, {"mnist_zeroshot_classification": {"acc1": 0.45},
                                                             "mnist_linear_probe": {"lp_acc1": 0.8}})
    stored = promotion.read_production(store)
    assert stored["write_id"] == pointer["write_id"] and stored["metrics"][SETTINGS[1]] == 0.45
    check_agreement(store, [first])  # the promotion's decision is still the one in force
