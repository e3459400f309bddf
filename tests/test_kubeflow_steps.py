"""The Kubeflow step bodies call the stage functions: they hand back result figures for the artifacts, and a
failing stage reaches the run as its typed error and message, not as an exit status."""

from __future__ import annotations

import json

import pytest

from cloob_core.data.validate import GateFailed
from cloob_core.errors import StageError
from cloob_core.ops import kubeflow

PARAMS = {"acquire": {"source": "embedded", "split": "test"}, "preprocess": {"resize_mode": "no"}}


def test_the_data_steps_return_what_their_artifacts_record(tmp_path):
    assert kubeflow.acquire(PARAMS, str(tmp_path / "manifest")) == {"rows": 1000, "source": "embedded (test split)"}
    gate = kubeflow.validate(PARAMS, str(tmp_path / "gate"), manifest_dir=str(tmp_path / "manifest"))
    assert gate["passed"] and gate["checks"] == 5
    part = kubeflow.download(PARAMS, str(tmp_path / "manifest"), "1/2", str(tmp_path / "part1"))
    assert part == {"partition": "1/2", "rows": 500, "successes": 500, "shards_built": 1, "shards_resumed": 0}


def test_a_failing_gate_raises_its_report_and_a_bad_configuration_its_key(tmp_path):
    (tmp_path / "manifest").mkdir()
    kubeflow.acquire(PARAMS, str(tmp_path / "manifest"))
    strict = json.dumps({**PARAMS, "validation": {"min_rows": 5000}})  # as the run parameter arrives: text
    with pytest.raises(GateFailed, match="data gate FAILED: 1 of 5 checks") as failed:
        kubeflow.validate(strict, str(tmp_path / "gate"), manifest_dir=str(tmp_path / "manifest"))
    assert "FAIL manifest: expect_table_row_count_to_be_between" in failed.value.details
    assert json.loads((tmp_path / "gate" / "gate.json").read_text())["passed"] is False  # the report is kept
    with pytest.raises(StageError, match=r"train\.batch_size"):
        kubeflow.train({"train": {"batch_size": 1}}, str(tmp_path / "shards"), str(tmp_path / "model"))
    with pytest.raises(StageError, match=r"unknown task \['zero-shot'\]"):
        kubeflow.evaluate(PARAMS, "mnist", "zero-shot", str(tmp_path / "model"), str(tmp_path / "eval"))
    missing = {**PARAMS, "eval": {"datasets": {"imagenet": {"source": str(tmp_path / "imagenet")}}},
               "promote": {"guards": {}}}
    with pytest.raises(StageError, match=r"eval.datasets.imagenet: source .* does not exist"):
        kubeflow.plan_evaluation(json.dumps(missing))  # before any model is loaded
