"""Every reader of a published model goes through the unit's digests: a member changed after publishing is
refused in one line by evaluation (`--model`), by `train.init_from`, by the promotion gate's candidate check and by
the fetch of production, on S3 and on a local disk alike. `publish.fetch` refused such a member; `cloob eval
zeroshot --model s3://…/model` on the same prefix scored the changed weights as the published model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hostile import cli

from cloob_core import publish, storage
from cloob_core.model.files import STATE_FILE
from cloob_core.ops import promotion


def _published(untrained_export: Path, tmp_path: Path, prefix: str) -> str:
    """A run's outputs (its model and metrics) published as one unit at ``prefix``; its model's location."""
    run = tmp_path / "run"
    shutil.copytree(untrained_export, run / "model")
    (run / "metrics.json").write_text('{"steps": 0}')
    publish.publish_copy(run, prefix)
    return storage.join(prefix, "model")


def _tamper(model: str) -> None:
    """The published weights replaced by other bytes of the same size (a re-upload, a bit flip)."""
    weights = storage.join(model, STATE_FILE)
    data = bytearray(storage.read_bytes(weights))
    data[-1] ^= 0xFF
    if storage.is_s3(weights):
        storage.write_bytes(weights, bytes(data))
    else:
        Path(weights).write_bytes(bytes(data))


@pytest.fixture(params=["s3", "local"])
def tampered(request, untrained_export, tmp_path) -> str:
    if request.param == "s3":
        prefix = f"s3://{request.getfixturevalue('s3_bucket')}/runs/nightly"
    else:
        prefix = str(tmp_path / "published")
    model = _published(untrained_export, tmp_path, prefix)
    _tamper(model)
    return model


def test_evaluation_refuses_a_model_changed_after_it_was_published(capsys, tmp_path, tampered):
    done = cli(capsys, "eval", "zeroshot", "--model", tampered, "--data", "mnist", "--output", tmp_path / "out",
               "--no-cache", "--no-progress", "--workers", "0")
    line = done.error_line()
    assert done.code == 2, line
    assert f"{storage.join(tampered, STATE_FILE)} does not match the output published in" in line, line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("*.json"))


def test_init_from_refuses_a_model_changed_after_it_was_published(capsys, tmp_path, tampered):
    done = cli(capsys, "starting-weights", "--output", tmp_path / "starting.json", "--set",
               f"train.init_from={tampered}")
    line = done.error_line()
    assert done.code == 2 and "does not match the output published in" in line, line


def test_the_gate_refuses_a_candidate_changed_after_it_was_published(untrained_export, tmp_path):
    model = _published(untrained_export, tmp_path, str(tmp_path / "published"))
    (Path(model) / "notes.txt").write_text("added later: a unit need not own every file of its folder")
    promotion._check_candidate(Path(model))  # as published: a candidate
    _tamper(model)
    with pytest.raises(publish.IncompleteOutput, match="does not match the output published"):
        promotion._check_candidate(Path(model))


def test_the_readers_of_production_refuse_weights_changed_after_the_promotion(untrained_export, tmp_path):
    from cloob_core.config import PromoteConfig
    from cloob_core.model.starting_weights import record_starting_weights
    from cloob_core.model.store import StoreError

    store = tmp_path / "store"
    settings = PromoteConfig(store=str(store), min_first={}, guards={}, registry_stage=None,
                             metric="mnist_zeroshot_classification.acc1")
    metrics = {"mnist_zeroshot_classification": {"acc1": 0.5}}
    assert promotion.decide_and_publish(untrained_export, metrics, settings).promoted
    promotion.fetch_production(str(store), tmp_path / "fetched")
    _tamper(str(store / "models" / promotion.model_id(untrained_export)))
    with pytest.raises(StoreError, match="is not the weights of production model"):
        promotion.fetch_production(str(store), tmp_path / "fetched-again")
    with pytest.raises(StoreError, match="is not the weights of production model"):  # train.init_from: production
        record_starting_weights("production", str(store), tmp_path / "starting.json")
