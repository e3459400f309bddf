"""The promotion gate: a better model is promoted atomically (pointer last, model complete), a worse one or one
that breaks a guard is not, every decision is kept, and the same works on S3."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cloob_core import storage
from cloob_core.cli import main
from cloob_core.config import PromoteConfig
from cloob_core.ops import promotion
from reports import report_of

METRIC = "mnist_zeroshot_classification.acc1"
GUARD = "mnist_linear_probe.lp_acc1"


def model(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "open_clip_model.safetensors").write_bytes(os.urandom(64) + bytes([seed]))
    (folder / "model_info.json").write_text(json.dumps({"seed": seed}))
    return folder


def metrics(top1: float, probe: float, rank: float = 10.0) -> dict:
    return {"mnist_zeroshot_classification": {"acc1": top1, "chance": 0.1},
            "mnist_linear_probe": {"lp_acc1": probe},
            "mnist_zeroshot_retrieval": {"text_retrieval_mean_rank": rank}}


def settings(store: str, guards: dict[str, float] | None = None, min_first: dict[str, float] | None = None
             ) -> PromoteConfig:
    return PromoteConfig(store=store, metric=METRIC, min_improvement=0.01, guards={GUARD: 0.02} if guards is None
                         else guards, min_first=min_first or {})


def test_first_model_is_promoted_then_only_a_better_one(tmp_path):
    store = str(tmp_path / "store")
    first = promotion.decide_and_publish(model(tmp_path / "a", 1), metrics(0.50, 0.80), settings(store))
    assert first.promoted and first.reason == "no production model yet"
    pointer = json.loads((tmp_path / "store" / "production.json").read_text())
    assert pointer["model_id"] == first.candidate and pointer["metrics"][METRIC] == 0.50
    stored = tmp_path / "store" / "models" / first.candidate
    weights = "open_clip_model.safetensors"
    assert (stored / weights).read_bytes() == (tmp_path / "a" / weights).read_bytes()

    # +0.005 < 0.01
    worse = promotion.decide_and_publish(model(tmp_path / "b", 2), metrics(0.505, 0.80), settings(store))
    assert not worse.promoted and "less than promote.min_improvement" in worse.reason
    assert json.loads((tmp_path / "store" / "production.json").read_text())["model_id"] == first.candidate
    assert not (tmp_path / "store" / "models" / worse.candidate).exists()

    better = promotion.decide_and_publish(model(tmp_path / "c", 3), metrics(0.60, 0.79), settings(store))
    assert better.promoted and better.improvement == pytest.approx(0.10) and better.production_before == first.candidate
    pointer = json.loads((tmp_path / "store" / "production.json").read_text())
    assert pointer["model_id"] == better.candidate and pointer["previous"] == first.candidate

    history = sorted((tmp_path / "store" / "history").iterdir())
    assert [json.loads(p.read_text())["promoted"] for p in history] == [True, False, True]
    assert (tmp_path / "store" / "models" / first.candidate).exists()  # the old model stays, for rollback


def test_a_guarded_metric_that_regresses_blocks_promotion(tmp_path):
    store = str(tmp_path / "store")
    promotion.decide_and_publish(model(tmp_path / "a", 1), metrics(0.50, 0.80, rank=10.0), settings(store))
    # the probe -0.03
    blocked = promotion.decide_and_publish(model(tmp_path / "b", 2), metrics(0.70, 0.77), settings(store))
    assert not blocked.promoted and "mnist_linear_probe.lp_acc1 fell by 0.03" in blocked.reason
    assert blocked.guards[GUARD]["ok"] is False
    # lower is better for ranks: a rank that grows is a regression
    ranked = settings(store, guards={"mnist_zeroshot_retrieval.text_retrieval_mean_rank": 1.0})
    worse_rank = promotion.decide_and_publish(model(tmp_path / "c", 3), metrics(0.70, 0.80, rank=15.0), ranked)
    assert not worse_rank.promoted and "mean_rank fell by 5" in worse_rank.reason


def test_metrics_missing_on_one_side_stop_the_promotion_with_advice(tmp_path):
    store = str(tmp_path / "store")
    promotion.decide_and_publish(model(tmp_path / "a", 1), {"mnist_zeroshot_classification": {"acc1": 0.5}},
                      settings(store, guards={}))
    decision = promotion.decide_and_publish(model(tmp_path / "b", 2), metrics(0.9, 0.9), settings(store))
    assert not decision.promoted and "re-evaluate production" in decision.reason
    promotion.record_production_metrics(settings(store), metrics(0.5, 0.8))  # the evaluation pipeline's step
    assert promotion.decide_and_publish(model(tmp_path / "c", 3), metrics(0.9, 0.9), settings(store)).promoted
    with pytest.raises(promotion.PromotionError, match="not in the candidate's metrics"):
        promotion.decide_and_publish(model(tmp_path / "d", 4), {"other": {"top1": 1.0}}, settings(store))
    # a guard the candidate's evaluation did not produce is an error too, and nothing moves
    before = (tmp_path / "store" / "production.json").read_bytes()
    with pytest.raises(promotion.PromotionError, match=f"promote.guards {GUARD}: not in the candidate's metrics"):
        promotion.decide_and_publish(model(tmp_path / "e", 5), {"mnist_zeroshot_classification": {"acc1": 0.99}},
                          settings(store))
    assert (tmp_path / "store" / "production.json").read_bytes() == before


def test_production_metrics_from_another_suite_are_not_compared(tmp_path):
    store = str(tmp_path / "store")
    suite_a, suite_b = {"digest": "a" * 64, "datasets": {}}, {"digest": "b" * 64, "datasets": {}}
    first = promotion.decide_and_publish(model(tmp_path / "a", 1), metrics(0.5, 0.8), settings(store), suite_a)
    assert first.promoted and json.loads((tmp_path / "store" / "production.json").read_text())["suite"] == "a" * 64
    stored = tmp_path / "store" / "models" / first.candidate / "suite.json"
    assert json.loads(stored.read_text()) == suite_a
    candidate = model(tmp_path / "b", 2)
    other = promotion.decide_and_publish(candidate, metrics(0.9, 0.9), settings(store), suite_b)
    assert not other.promoted and "re-evaluate production first" in other.reason and "suite aaaaaaaaaaaa" in \
        other.reason and other.production_value is None  # no comparison was made
    unfingerprinted = promotion.decide_and_publish(model(tmp_path / "c", 3), metrics(0.9, 0.9), settings(store))
    assert not unfingerprinted.promoted and "no suite fingerprint" in unfingerprinted.reason
    # the evaluation pipeline re-evaluates production on suite b: its metrics replace the earlier ones
    pointer = promotion.record_production_metrics(settings(store), {"mnist_zeroshot_classification": {"acc1": 0.45},
                                                          "mnist_linear_probe": {"lp_acc1": 0.8}}, suite_b)
    assert pointer["suite"] == "b" * 64 and pointer["metrics"] == {METRIC: 0.45, GUARD: 0.8}
    again = promotion.decide_and_publish(candidate, metrics(0.9, 0.9), settings(store), suite_b)
    assert again.promoted and again.improvement == pytest.approx(0.45)


def test_cli_reports_a_failed_gate_as_a_normal_outcome(tmp_path, capsys):
    store = tmp_path / "store"
    for name, top1 in (("a", 0.5), ("b", 0.4)):
        report = report_of(model(tmp_path / name, ord(name)), metrics(top1, 0.8), tmp_path / f"{name}_report")
        code = main(["promote", "--model", str(tmp_path / name), "--metrics", str(report), "--output",
                     str(tmp_path / f"{name}_decision.json"),
                     "--store", str(store), "--metric", METRIC, "--guards", json.dumps({GUARD: 0.02}),
                     "--min-first", "{}"])
        assert code == 0
    assert "NOT PROMOTED" in capsys.readouterr().out.splitlines()[-1]
    assert json.loads((tmp_path / "b_decision.json").read_text())["promoted"] is False


def test_a_first_model_under_the_floor_is_not_promoted(tmp_path):
    """With no production to beat, promote.min_first decides: a smoke run's model stays out of production."""
    store = str(tmp_path / "store")
    floors = {METRIC: 0.3, "mnist_zeroshot_retrieval.text_retrieval_mean_rank": 20.0}
    smoke = model(tmp_path / "smoke", 1)
    low = promotion.decide_and_publish(smoke, metrics(0.12, 0.5), settings(store, min_first=floors))
    assert not low.promoted and promotion.read_production(store) is None
    assert low.reason == (f"no production model yet, and the candidate does not reach promote.min_first: {METRIC} = "
                          "0.12 (under 0.3)")
    ranked = promotion.decide_and_publish(smoke, metrics(0.5, 0.5, rank=35.0), settings(store, min_first=floors))
    assert not ranked.promoted and "text_retrieval_mean_rank = 35 (above 20)" in ranked.reason  # lower is better
    good = promotion.decide_and_publish(smoke, metrics(0.5, 0.5), settings(store, min_first=floors))
    assert good.promoted and good.reason == "no production model yet"
    default = PromoteConfig(store=str(tmp_path / "other"))  # the default floor: suite R@5 of 10%
    with pytest.raises(promotion.PromotionError, match=r"promote\.min_first suite\.retrieval_recall@5: "
                                                       "not in the candidate's metrics"):
        promotion.decide_and_publish(smoke, metrics(0.5, 0.5), default)


def test_promotion_on_an_s3_store(tmp_path, s3_bucket):
    store = f"s3://{s3_bucket}/registry"
    first = promotion.decide_and_publish(model(tmp_path / "a", 1), metrics(0.5, 0.8), settings(store))
    second = promotion.decide_and_publish(model(tmp_path / "b", 2), metrics(0.6, 0.8), settings(store))
    assert first.promoted and second.promoted
    pointer = json.loads(storage.read_bytes(f"{store}/production.json"))
    assert pointer["model_id"] == second.candidate and pointer["model"] == f"{store}/models/{second.candidate}"
    assert storage.read_bytes(f"{store}/models/{second.candidate}/open_clip_model.safetensors") == (
        tmp_path / "b" / "open_clip_model.safetensors").read_bytes()
    assert len(storage.list_names(f"{store}/history", ".json")) == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_metric_is_never_promotable_on_either_side(tmp_path, bad):
    store = str(tmp_path / "store")
    first = promotion.decide_and_publish(model(tmp_path / "nan", 1), metrics(bad, 0.80), settings(store))
    assert not first.promoted and "non-finite" in first.reason and first.candidate_value is None
    assert promotion.read_production(store) is None  # not even as the first model
    assert promotion.decide_and_publish(model(tmp_path / "a", 2), metrics(0.50, 0.80), settings(store)).promoted
    guard_broken = promotion.decide_and_publish(model(tmp_path / "g", 3), metrics(0.90, bad), settings(store))
    assert not guard_broken.promoted and "non-finite" in guard_broken.reason
    # a production record that went non-finite blocks every comparison until production is re-evaluated
    pointer = Path(store) / "production.json"
    record = json.loads(pointer.read_text())
    record["metrics"][METRIC] = bad
    pointer.write_text(json.dumps(record))
    blocked = promotion.decide_and_publish(model(tmp_path / "b", 4), metrics(0.99, 0.99), settings(store))
    assert not blocked.promoted and "production's recorded" in blocked.reason
    with pytest.raises(promotion.PromotionError, match="non-finite metrics"):
        promotion.record_production_metrics(settings(store), metrics(bad, 0.8))
    promotion.record_production_metrics(settings(store), metrics(0.5, 0.8))
    assert promotion.decide_and_publish(model(tmp_path / "c", 5), metrics(0.99, 0.99), settings(store)).promoted


def test_a_corrupt_production_pointer_is_named(tmp_path, capsys):
    store = tmp_path / "store"
    store.mkdir()
    (store / "production.json").write_text("{not json")
    candidate = model(tmp_path / "a", 1)
    report = report_of(candidate, metrics(0.5, 0.8), tmp_path / "report")
    assert main(["promote", "--model", str(candidate), "--metrics", str(report), "--store", str(store),
                 "--metric", METRIC, "--guards", json.dumps({GUARD: 0.02})]) == 2
    error = capsys.readouterr().err
    assert "production.json is not valid JSON" in error and "Traceback" not in error


def test_each_decision_is_pushed_for_the_alerts_on_no_decision_and_no_promotion(tmp_path, pushgateway):
    """Nothing alerted on a failed nightly run or on weeks without a promotion: each decision now pushes its time,
    its verdict, the models and since when production holds, grouped by the store."""
    import re

    address, received = pushgateway
    store = str(tmp_path / "store")
    gate = settings(store).model_copy(update={"pushgateway": address, "registry_stage": None})
    first = model(tmp_path / "a", 1)
    promotion.promote(gate, model_dir=first, metrics_file=report_of(first, metrics(0.5, 0.8), tmp_path / "ra"))
    path, body = received[-1]
    assert path.startswith("/metrics/job/cloob-promote/store") and "cloob_promotion_promoted 1.0" in body
    since = float(re.search(r"^cloob_promotion_production_since_timestamp_seconds (\S+)$", body, re.M).group(1))
    decided = float(re.search(r"^cloob_promotion_decision_timestamp_seconds (\S+)$", body, re.M).group(1))
    assert since == decided  # production holds since this decision
    second = model(tmp_path / "b", 2)
    promotion.promote(gate, model_dir=second, metrics_file=report_of(second, metrics(0.4, 0.8), tmp_path / "rb"))
    path_again, body = received[-1]
    assert path_again == path and "cloob_promotion_promoted 0.0" in body  # the same group, replaced
    assert float(re.search(r"^cloob_promotion_production_since_timestamp_seconds (\S+)$", body, re.M).group(1)) \
        == since  # not promoted: production still holds since the first
    assert f'candidate="{promotion.model_id(second)}",production="{promotion.model_id(first)}"' in body
