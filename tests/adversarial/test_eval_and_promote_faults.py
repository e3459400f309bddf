"""Evaluation and promotion under hostile input: weights that are a pickle with code in it, garbage or another
architecture's, shards with broken images, result files that are not JSON, an output that is a file, and a
candidate whose metrics are not numbers."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from hostile import cli, snapshot

from reports import report_of

MODEL = ["--architecture", "cloob-tiny", "--no-cache", "--no-progress"]


@pytest.fixture(scope="module")
def test_shards(tmp_path_factory) -> Path:
    from cloob_core.config import load_config
    from cloob_core.data.local import build_shards

    out = tmp_path_factory.mktemp("eval") / "digits"
    build_shards("mnist", str(out), load_config(overrides=["preprocess.resize_mode=no",
                                                                "preprocess.shard_size=100"]),
                 split="test", progress=False)
    return out


def _break_images(tar_path: Path, keys: set[str]) -> None:
    with tarfile.open(tar_path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for member, data in members:
            if member.name.endswith(".jpg") and member.name.split(".")[0] in keys:
                data = b"\xff\xd8 not a jpeg at all"
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    tar_path.write_bytes(buffer.getvalue())


def test_unreadable_images_in_evaluation_shards_are_skipped_and_counted(capsys, tmp_path, weights, test_shards):
    shards = tmp_path / "digits"
    shutil.copytree(test_shards, shards)
    first = sorted(shards.glob("*.tar"))[0]
    with tarfile.open(first) as tar:
        keys = sorted({name.split(".")[0] for name in tar.getnames()})[:7]
    _break_images(first, set(keys))
    done = cli(capsys, "eval", "retrieval", "--data", shards, "--weights", weights, "--output", tmp_path / "out",
               *MODEL)
    assert done.code == 0, done.err
    record = json.loads((tmp_path / "out" / "digits_zeroshot_retrieval.json").read_text())
    assert record["metrics"]["skipped_unreadable"] == 7 and record["metrics"]["images"] == 1000 - 7


def _pickle_with_an_object(path: Path) -> Path:
    torch.save({"visual.proj": torch.zeros(2), "settings": argparse.Namespace(lr=1)}, path)
    return path


@pytest.mark.parametrize(("make", "expected"), [
    (_pickle_with_an_object, "holds a pickled argparse.Namespace, which is never unpickled"),
    (lambda path: path.write_bytes(b"\x80\x04garbage" * 100) and path, "is not a tensor file written by torch.save"),
    (lambda path: path.write_bytes(b"PK\x03\x04" + bytes(200)) and path, "the archive is damaged or incomplete"),
    (lambda path: torch.save({"fc.weight": torch.zeros(3, 3)}, path) or path, "does not fit the architecture: "),
    (lambda path: torch.save([1, 2, 3], path) or path, "does not hold a state dict"),
])
def test_weights_that_are_not_this_models_are_one_line(capsys, tmp_path, make, expected):
    path = make(tmp_path / "weights.pt")
    done = cli(capsys, "eval", "zeroshot", "--weights", path, "--output", tmp_path / "out", *MODEL)
    line = done.error_line()
    assert done.code == 2 and str(path) in line and expected in line and "weights_only=False" not in line


def test_an_evaluation_output_that_is_a_file_is_refused_before_the_model_loads(capsys, tmp_path, weights):
    taken = tmp_path / "out"
    taken.write_text("keep me")
    done = cli(capsys, "eval", "zeroshot", "--weights", weights, "--output", taken, *MODEL)
    assert done.code == 2 and "is a file, not a folder" in done.error_line() and taken.read_text() == "keep me"


@pytest.mark.parametrize("command", [
    lambda broken: ["eval", "summary", "--metrics", broken],
    lambda broken: ["eval", "compare", "--run", f"a={broken}", "--output", broken.parent / "cmp.md"],
])
def test_a_result_file_that_is_not_json_is_named(capsys, tmp_path, command):
    broken = tmp_path / "metrics.json"
    broken.write_text('{"zeroshot": {"top1": 0.5')
    done = cli(capsys, *command(broken))
    assert done.code == 2 and f"{broken} is not valid JSON" in done.error_line()


def _candidate(tmp_path: Path, top1: object) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "open_clip_model.safetensors").write_bytes(b"weights of " + str(tmp_path).encode())  # a model of its own
    (model / "model_info.json").write_text("{}")
    return model, report_of(model, {"mnist_zeroshot_classification": {"acc1": top1}}, tmp_path / "report")


PROMOTE = ["--metric", "mnist_zeroshot_classification.acc1", "--guards", "{}", "--min-first", "{}"]


def test_a_nan_candidate_is_not_promoted_and_production_is_untouched(capsys, tmp_path):
    store = tmp_path / "store"
    model, metrics = _candidate(tmp_path / "good", 0.5)
    assert cli(capsys, "promote", "--model", model, "--metrics", metrics, "--store", store, *PROMOTE).code == 0
    before = snapshot(store)
    model, metrics = _candidate(tmp_path / "nan", float("nan"))
    done = cli(capsys, "promote", "--model", model, "--metrics", metrics, "--store", store, *PROMOTE)
    assert done.code == 0 and "NOT PROMOTED" in done.out and "non-finite" in done.out
    after = snapshot(store)
    assert set(before) < set(after) and all(after[k] == v for k, v in before.items())
    assert [k for k in after if k not in before] == [k for k in after if "/history/" in k and k not in before]
    assert len(after) == len(before) + 1  # only the decision was added


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda model, metrics: metrics.write_text("{nope"), "is not valid JSON"),
    (lambda model, metrics: shutil.rmtree(model), "does not exist"),
    (lambda model, metrics: (model / "model_info.json").write_text("[1, 2"), "model_info.json is not valid JSON"),
])
def test_a_broken_candidate_is_one_line_and_production_is_untouched(capsys, tmp_path, damage, expected):
    store = tmp_path / "store"
    model, metrics = _candidate(tmp_path / "good", 0.5)
    assert cli(capsys, "promote", "--model", model, "--metrics", metrics, "--store", store, *PROMOTE).code == 0
    before = snapshot(store)
    model, metrics = _candidate(tmp_path / "bad", 0.9)
    damage(model, metrics)
    done = cli(capsys, "promote", "--model", model, "--metrics", metrics, "--store", store, *PROMOTE)
    assert done.code == 2 and expected in done.error_line()
    assert snapshot(store) == before


def test_a_store_that_is_a_file_is_one_line(capsys, tmp_path):
    store = tmp_path / "store"
    store.write_text("not a folder")
    model, metrics = _candidate(tmp_path / "a", 0.5)
    done = cli(capsys, "promote", "--model", model, "--metrics", metrics, "--store", store, *PROMOTE)
    assert done.code == 2 and "is a file, not a folder" in done.error_line() and store.read_text() == "not a folder"
