"""The Kubeflow step bodies call the stage functions: they hand back result figures for the artifacts, and a
failing stage reaches the run as its typed error and message, not as an exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloob_core.data.validate import GateFailed
from cloob_core.errors import StageError
from cloob_core.ops import kubeflow

PARAMS = {"acquire": {"source": "mnist", "split": "test"}, "preprocess": {"resize_mode": "no", "shard_size": 500}}


def test_the_data_steps_build_the_shards_in_one_folder_named_by_their_content(tmp_path):
    store = str(tmp_path / "store")
    facts = kubeflow.acquire(PARAMS, store, index_path=str(tmp_path / "artifact" / "index.json"))
    manifest, shards = facts.pop("manifest"), facts.pop("shards")
    assert facts == {"rows": 1000, "parts": 1, "source": "packaged mnist (test split)"}
    assert json.loads((tmp_path / "artifact" / "index.json").read_text())["rows"] == 1000  # the artifact: the index
    for folder, prefix in ((manifest, "manifest-"), (shards, "shards-")):
        assert Path(folder).parent == Path(store) and Path(folder).name.startswith(prefix)
    gate = kubeflow.validate(PARAMS, str(tmp_path / "gate"), manifest=manifest)
    assert gate["passed"] and gate["checks"] == 12  # 5 exact counts, 4 row-level expectations, 3 caption checks
    assert kubeflow.plan_download(PARAMS, manifest, 2) == ["0/2", "1/2"]
    assert kubeflow.plan_download(PARAMS, manifest, 1000) == ["0/2", "1/2"]  # no more groups than shards
    parts = [kubeflow.download(PARAMS, manifest, f"{i}/2", shards) for i in (1, 0)]
    assert parts[0] == {"partition": "1/2", "rows": 500, "successes": 500, "shards_built": 1, "shards_resumed": 0}
    assert kubeflow.merge_partitions(shards, parts) == {"samples": 1000, "shards": 2, "failures": 0}
    assert json.loads((Path(shards) / "sizes.json").read_text()) == {"00000.tar": 500, "00001.tar": 500}
    assert kubeflow.validate(PARAMS, str(tmp_path / "gate2"), shards_dir=shards)["passed"]

    # The same source and settings name the same folders (a rerun resumes); settings that change the shards, another.
    again = kubeflow.acquire(PARAMS, store)
    assert (again["manifest"], again["shards"]) == (manifest, shards)
    assert kubeflow.download(PARAMS, manifest, "0/2", shards)["shards_resumed"] == 1
    resized = {**PARAMS, "preprocess": {"resize_mode": "center_crop", "image_size": 32}}
    assert kubeflow.acquire(resized, store)["shards"] != shards


def test_the_download_loop_has_at_most_256_groups_whatever_the_shards(tmp_path):
    params = {**PARAMS, "preprocess": {"shard_size": 1}}  # 1,000 shards
    manifest = kubeflow.acquire(params, str(tmp_path / "store"))["manifest"]
    groups = kubeflow.plan_download(params, manifest, 1000)
    assert len(groups) == 256 and groups[0] == "0/256" and groups[-1] == "255/256"


def test_an_acquired_manifest_reads_back_whatever_the_sources_format(tmp_path):
    """download.input_format describes the user's source (here a header-less CC3M-style TSV named .txt); the
    acquired manifest is parquet, and the steps after acquire read it as such."""
    source = tmp_path / "pairs.txt"
    source.write_text("".join(f"caption {i}\thttp://127.0.0.1:9/{i}.jpg\n" for i in range(3)))
    params = {"acquire": {"source": str(source)}, "download": {"input_format": "tsv"},
              "validation": {"min_rows": 1}}
    facts = kubeflow.acquire(params, str(tmp_path / "store"))
    assert facts["rows"] == 3
    assert kubeflow.validate(params, str(tmp_path / "gate"), manifest=facts["manifest"])["checks"]


def test_a_failing_gate_raises_its_report_and_a_bad_configuration_its_key(tmp_path):
    manifest = kubeflow.acquire(PARAMS, str(tmp_path / "store"))["manifest"]
    strict = json.dumps({**PARAMS, "validation": {"min_rows": 5000}})  # as the run parameter arrives: text
    with pytest.raises(GateFailed, match="data gate FAILED: 1 of 12 checks") as failed:
        kubeflow.validate(strict, str(tmp_path / "gate"), manifest=manifest)
    assert "FAIL manifest: expect_column_values_to_be_between [rows] {'min_value': 5000.0}" in failed.value.details
    assert json.loads((tmp_path / "gate" / "gate.json").read_text())["passed"] is False  # the report is kept
    with pytest.raises(StageError, match=r"train\.batch_size"):
        kubeflow.train({"train": {"batch_size": 1}}, str(tmp_path / "shards"), str(tmp_path / "model"))
    with pytest.raises(StageError, match=r"unknown task \['zero-shot'\]"):
        kubeflow.evaluate(PARAMS, "mnist", "zero-shot", str(tmp_path / "model"), str(tmp_path / "eval"))
    missing = {**PARAMS, "eval": {"datasets": {"imagenet": {"source": str(tmp_path / "imagenet")}}},
               "promote": {"metric": "suite.zeroshot_acc1", "guards": {}, "min_first": {}}}
    with pytest.raises(StageError, match=r"eval.datasets.imagenet: source .* does not exist"):
        kubeflow.plan_evaluation(json.dumps(missing))  # before any model is loaded


@pytest.mark.slow  # ~40 s: two processes train under torchrun (gloo on CPU)
def test_the_one_node_step_starts_its_ranks_from_the_config_it_validated(mnist_train_shards, tmp_path, monkeypatch):
    """With several processes the step validates once, writes that configuration, and every rank trains on it:
    the step's own setting (the shards) reaches the ranks, and a bad configuration fails before torchrun starts."""
    import subprocess

    started = []
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: started.append(command) or real_run(command, **kw))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    params = {"model": {"architecture": "cloob-tiny-vit"},  # two "GPUs" as CPU processes: device cpu, explicitly
              "train": {"steps": 2, "batch_size": 32, "data_streams": 2, "workers": 0, "tensorboard": False,
                        "device": "cpu"}}
    metrics = kubeflow.train(json.dumps(params), str(mnist_train_shards), str(tmp_path / "run"), gpus=2)
    assert metrics["world_size"] == 2 and metrics["steps"] == 2
    (command,) = started
    assert "--nproc-per-node=2" in command and "--set" not in command
    assert command[command.index("cloob_core.cli"):command.index("--params")] == ["cloob_core.cli", "train"]
    with pytest.raises(StageError, match=r"train\.batch_size"):
        kubeflow.train({"train": {"batch_size": 1}}, str(mnist_train_shards), str(tmp_path / "bad"), gpus=2)
    assert len(started) == 1


def test_a_succeeded_run_deletes_its_mirrored_checkpoints_unless_kept(mnist_train_shards, tmp_path):
    """`jobs/cloob-train-<id>/checkpoints` grew without end: once the model is out, nothing resumes from them."""
    params = {"model": {"architecture": "cloob-tiny-vit"},
              "train": {"steps": 2, "batch_size": 16, "workers": 0, "tensorboard": False, "checkpoint_every": 1,
                        "device": "cpu"}}
    kept, dropped = tmp_path / "jobs" / "cloob-train-a", tmp_path / "jobs" / "cloob-train-b"
    kubeflow.train(params, str(mnist_train_shards), str(tmp_path / "a"), run_folder=str(kept), keep_checkpoints=True)
    assert any((kept / "checkpoints").iterdir())
    kubeflow.train(params, str(mnist_train_shards), str(tmp_path / "b"), run_folder=str(dropped),
                   keep_checkpoints=False)
    assert not (dropped / "checkpoints").exists() and (tmp_path / "b" / "metrics.json").is_file()


def test_acquire_spills_to_the_steps_volume_where_it_has_one(tmp_path, monkeypatch):
    """The pipeline mounts acquire's spill disk and names it in CLOOB_SPILL_DIR: the engine spills there when it
    exists, and where the params say when it does not (a kfp.local run has no such volume)."""
    from cloob_core.data import acquire as acquire_module

    seen = []

    import tempfile

    def stage(config, folder):
        seen.append((config.engine.spill_dir, tempfile.gettempdir()))
        raise RuntimeError("stop here")

    monkeypatch.setattr(acquire_module, "acquire", stage)
    volume = tmp_path / "spill"
    volume.mkdir()
    before = tempfile.gettempdir()
    for named in (volume, tmp_path / "absent"):
        monkeypatch.setenv(kubeflow.SPILL_ENV, str(named))
        with pytest.raises(RuntimeError, match="stop here"):
            kubeflow.acquire({}, str(tmp_path / "store"))
    # the engine's spill and the stage's temporary files on the volume, while the stage runs, and only then
    assert seen == [(str(volume), str(volume)), (None, before)] and tempfile.gettempdir() == before
