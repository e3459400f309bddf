"""A stage that writes several files, killed (SIGKILL) before each of its writes in turn, then the next step a
pipeline or a user would run: the output is the previous complete state or the new one, never a mix, and the
next step decides as it would on that state after a clean run. The default suite kills at a few moments spread
over each run, the last write always among them; ``-m slow`` kills at every one.

The case that started this: a suite evaluation of model B killed part-way, then a report over its folder, then
the gate promoted B on a mix of B's linear probe and A's zero-shot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from hostile import snapshot
from killing import chosen, count_moments, killed_at, run

from cloob_core import publish, storage
from cloob_core.data.run_manifest import RunManifest
from cloob_core.data.shard_files import missing_shards, summary_file
from cloob_core.ops import promotion

EVERY = [pytest.param(False, id="sampled"), pytest.param(True, id="every", marks=pytest.mark.slow)]
SUITE = {"mnist": {"source": "mnist", "tasks": ["zeroshot", "retrieval"]}}
METRIC = "mnist_zeroshot_classification.acc1"


def copy(source: Path, target: Path) -> Path:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, symlinks=True)
    return target


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """Models A and B (cloob-tiny exports of two seeds), each evaluated on the suite, and A's report."""
    import torch

    from cloob_core.cli import main
    from cloob_core.config import ModelConfig
    from cloob_core.model.dual_encoder import build_model
    from cloob_core.model.export import export_model

    root = tmp_path_factory.mktemp("evaluated")
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump({"eval": {"datasets": SUITE, "aggregates": {}},
                                      "promote": {"metric": METRIC, "guards": {}, "min_improvement": 0.0,
                                                  "min_first": {}}}))
    folders = {}
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        model = export_model(build_model(ModelConfig()), root / name / "model", {"objective": "none", "steps": 0})
        out = root / name / "eval"
        assert main(["eval", "suite", "--params", str(params), "--output", str(out), "--model", str(model),
                     "--no-progress"]) == 0
        folders[name] = (model, out)
    assert main(["eval", "report", "--params", str(params), "--inputs", str(folders["a"][1]), "--output",
                 str(root / "report_a")]) == 0
    assert main(["eval", "report", "--params", str(params), "--inputs", str(folders["b"][1]), "--output",
                 str(root / "report_b")]) == 0
    return root, params, folders


def report_state(report: Path, clean: dict[str, Path]) -> str:
    """Which complete report ``report`` holds: the name of the clean report whose every file it equals."""
    unit = publish.unit_of(report)
    assert unit is not None, f"{report} holds no complete report"
    for name, folder in clean.items():
        if unit.files == publish.unit_of(folder).files:
            for member in unit.files:
                unit.read(member)  # every file is the one recorded
            return name
    raise AssertionError(f"{report} is neither complete report: {sorted(unit.files)}")


def gate_on(report: Path, model: Path, store: Path, moments: Path):
    """The next step: the promotion gate of ``model`` on ``report``; its outcome."""
    return run(["promote", "--model", model, "--metrics", report / "metrics.json", "--store", store, "--metric",
                METRIC, "--guards", "{}", "--min-first", "{}", "--min-improvement", "0"], moments)


@pytest.mark.parametrize("every", EVERY)
def test_a_report_killed_at_any_write_leaves_the_previous_or_the_new_report(evaluated, tmp_path, every):
    root, params, folders = evaluated
    (model_b, eval_b) = folders["b"]
    clean = {"a": root / "report_a", "b": root / "report_b"}
    argv = ["eval", "report", "--params", params, "--inputs", eval_b, "--output", tmp_path / "report"]
    copy(clean["a"], tmp_path / "report")
    total = count_moments(argv, tmp_path / "moments")
    for moment in chosen(total, every):
        report = copy(clean["a"], tmp_path / "report")
        killed_at(argv, tmp_path / "moments", moment)
        state = report_state(report, clean)
        store = tmp_path / f"store{moment}"
        gate = gate_on(report, model_b, store, tmp_path / "moments")
        if state == "a":  # B's report was never published: A's metrics are not B's
            assert gate.code == 2 and "holds the results of model" in gate.error_line(), gate.err
            assert not store.exists() or promotion.read_production(str(store)) is None
        else:
            assert gate.code == 0 and "promotion gate: PROMOTED" in gate.out, gate.err
            assert promotion.read_production(str(store))["model_id"] == promotion.model_id(model_b)


@pytest.mark.parametrize("every", EVERY)
def test_a_suite_killed_at_any_write_leaves_each_data_set_whole(evaluated, tmp_path, every):
    root, params, folders = evaluated
    (model_a, eval_a), (model_b, eval_b) = folders["a"], folders["b"]
    out = tmp_path / "eval"
    argv = ["eval", "suite", "--params", params, "--output", out, "--model", model_b, "--no-progress"]
    copy(eval_a, out)
    total = count_moments(argv, tmp_path / "moments")
    clean = {"a": eval_a / "mnist", "b": eval_b / "mnist"}
    for moment in chosen(total, every, sample=3):
        copy(eval_a, out)
        killed_at(argv, tmp_path / "moments", moment)
        state = report_state(out / "mnist", clean)
        # the next step: the report over the folder is that model's whole report, and the gate takes it for that
        # model only
        done = run(["eval", "report", "--params", params, "--inputs", out, "--output", tmp_path / "report"],
                   tmp_path / "moments")
        assert done.code == 0, done.err
        assert report_state(tmp_path / "report", {"a": root / "report_a", "b": root / "report_b"}) == state
        model = model_a if state == "a" else model_b
        other = model_b if state == "a" else model_a
        assert gate_on(tmp_path / "report", other, tmp_path / f"store{moment}o", tmp_path / "moments").code == 2
        assert gate_on(tmp_path / "report", model, tmp_path / f"store{moment}", tmp_path / "moments").code == 0


def _manifest(path: Path, rows: int, seed: int) -> Path:
    lines = ["url,caption"] + [f"http://example.com/{(i * seed) % (rows // 2 + 1)}.jpg,caption {seed} {i}"
                               for i in range(rows)]  # about half the URLs repeat
    path.write_text("\n".join(lines) + "\n")
    return path


def _read_back(location: str) -> tuple:
    manifest = RunManifest.open(location)
    rows = manifest.rows(list(range(len(manifest))))
    return (manifest.fingerprint(), [(r.url, r.caption) for r in rows],
            sorted(manifest.duplicates_between(0, len(manifest)).items()))


@pytest.mark.parametrize("every", EVERY)
def test_acquire_killed_at_any_write_leaves_the_previous_or_the_new_manifest(tmp_path, every):
    sources = tmp_path / "sources"
    sources.mkdir()
    first = _manifest(sources / "first.csv", 40, 3)
    second = _manifest(sources / "second.csv", 60, 7)
    clean = {}
    for name, source in (("first", first), ("second", second)):
        assert run(["data", "acquire", "--source", source, "--output", tmp_path / name], tmp_path / "m").code == 0
        clean[name] = _read_back(str(tmp_path / name))
    argv = ["data", "acquire", "--source", second, "--output", tmp_path / "out"]
    copy(tmp_path / "first", tmp_path / "out")
    total = count_moments(argv, tmp_path / "moments")
    for moment in chosen(total, every):
        copy(tmp_path / "first", tmp_path / "out")
        killed_at(argv, tmp_path / "moments", moment)
        assert _read_back(str(tmp_path / "out")) in clean.values(), moment
        # the next run completes it, and leaves only the new manifest's files
        assert run(argv, tmp_path / "moments").code == 0
        assert _read_back(str(tmp_path / "out")) == clean["second"]
        listed = {name for name, _, _ in storage.tree_entries(str(tmp_path / "out"))}
        assert listed == {name for name, _, _ in storage.tree_entries(str(tmp_path / "second"))}


def test_acquire_on_s3_killed_at_its_last_writes_leaves_a_whole_manifest(tmp_path, s3_bucket, fault_proxy):
    fault_proxy.add("slowdown", times=2)  # behind a store that pushes back
    fault_proxy.add("latency", method=None, times=20, seconds=0.05)
    sources = tmp_path / "sources"
    sources.mkdir()
    first, second = _manifest(sources / "first.csv", 30, 3), _manifest(sources / "second.csv", 50, 7)
    out = f"s3://{s3_bucket}/manifest"
    assert run(["data", "acquire", "--source", second, "--output", tmp_path / "second"], tmp_path / "m").code == 0
    assert run(["data", "acquire", "--source", first, "--output", out], tmp_path / "m").code == 0
    clean = {"first": _read_back(out), "second": _read_back(str(tmp_path / "second"))}
    argv = ["data", "acquire", "--source", second, "--output", out]
    total = count_moments(argv, tmp_path / "moments")
    for moment in chosen(total, False, sample=3):
        assert run(["data", "acquire", "--source", first, "--output", out], tmp_path / "m").code == 0
        killed_at(argv, tmp_path / "moments", moment)
        assert _read_back(out) in clean.values(), moment
        assert run(argv, tmp_path / "moments").code == 0 and _read_back(out) == clean["second"]


def _summary(folder: Path | str) -> tuple[bytes, ...]:
    return tuple(summary_file(str(folder), name) for name in ("sizes.json", "stats.json", "failures.jsonl"))


def _upload(folder: Path, location: str) -> str:
    storage.delete_tree(location)
    storage.upload_tree(folder, location)
    return location


def test_merge_stats_on_s3_killed_at_its_writes_leaves_the_previous_or_the_new_summary(mnist_train_shards,
                                                                                        tmp_path, s3_bucket,
                                                                                        fault_proxy):
    from cloob_core.data.summary import merge_stats

    fault_proxy.add("latency", method=None, times=30, seconds=0.05)
    partial = copy(mnist_train_shards, tmp_path / "partial")
    for path in partial.glob("00015[._]*"):
        path.unlink()
    merge_stats(str(partial))
    shards = f"s3://{s3_bucket}/shards"
    clean = {"partial": _summary(partial), "whole": _summary(_upload(mnist_train_shards, f"{shards}-whole"))}
    argv = ["data", "merge-stats", "--output", shards]
    _upload(partial, shards)
    for name in ("00015.tar", "00015_stats.json", "00015_failures.jsonl"):  # the late shard arrives
        storage.copy_file(mnist_train_shards / name, storage.join(shards, name))
    total = count_moments(argv, tmp_path / "moments")
    for moment in chosen(total, False, sample=3):
        _upload(partial, shards)
        for name in ("00015.tar", "00015_stats.json", "00015_failures.jsonl"):
            storage.copy_file(mnist_train_shards / name, storage.join(shards, name))
        killed_at(argv, tmp_path / "moments", moment)
        state = next(name for name, summary in clean.items() if summary == _summary(shards))
        assert bool(missing_shards(shards)) == (state == "partial"), moment


@pytest.mark.parametrize("every", EVERY)
def test_merge_stats_killed_at_any_write_leaves_the_previous_or_the_new_summary(mnist_train_shards, tmp_path,
                                                                                every):
    from cloob_core.data.summary import merge_stats

    # the earlier merge ran while a partition was still writing its last shard: that shard's files came later
    partial = copy(mnist_train_shards, tmp_path / "partial")
    (partial / ".cloob-unit.json").unlink()
    last = sorted(partial.glob("*.tar"))[-1].name.removesuffix(".tar")
    late = {path.name: path.read_bytes() for path in partial.glob(f"{last}[._]*")}
    for name in late:
        (partial / name).unlink()
    merge_stats(str(partial))
    for name, data in late.items():
        (partial / name).write_bytes(data)
    whole = copy(partial, tmp_path / "whole")
    merge_stats(str(whole))
    clean = {"partial": _summary(partial), "whole": _summary(whole)}
    assert clean["partial"] != clean["whole"] and missing_shards(str(partial)) and not missing_shards(str(whole))
    argv = ["data", "merge-stats", "--output", tmp_path / "shards"]
    copy(partial, tmp_path / "shards")
    total = count_moments(argv, tmp_path / "moments")
    for moment in chosen(total, every):
        shards = copy(partial, tmp_path / "shards")
        before = snapshot(*(shards / name for name in late))
        killed_at(argv, tmp_path / "moments", moment)
        state = next(name for name, summary in clean.items() if summary == _summary(shards))
        # the next step, training, refuses the incomplete set and takes the complete one
        assert bool(missing_shards(str(shards))) == (state == "partial")
        assert snapshot(*(shards / name for name in late)) == before  # the shards themselves untouched


@pytest.mark.parametrize("every", EVERY)
def test_the_gate_killed_at_any_write_then_run_again_tells_one_story(tmp_path, every):
    from gates import Gate, candidate, check_agreement, history

    first, first_report = candidate(tmp_path / "first", 0.5)
    store = tmp_path / "store"
    settings = ["--metric", "mnist_zeroshot_classification.acc1", "--min-improvement", "0.005", "--guards",
                "mnist_linear_probe.lp_acc1=0.01", "--min-first", "{}"]
    assert run(["promote", "--model", first, "--metrics", first_report, "--store", store, *settings],
               tmp_path / "m").code == 0
    clean = copy(store, tmp_path / "clean")
    better, better_report = candidate(tmp_path / "better", 0.7)
    argv = ["promote", "--model", better, "--metrics", better_report, "--store", store, *settings]
    total = count_moments(argv, tmp_path / "moments")
    for moment in chosen(total, every):
        copy(clean, store)
        killed_at(argv, tmp_path / "moments", moment)
        production = promotion.read_production(str(store))
        assert production["model_id"] in (promotion.model_id(first), promotion.model_id(better))
        again = run(argv, tmp_path / "moments")  # the scheduler runs the gate again
        assert again.code == 0 and again.out.startswith("promotion gate: PROMOTED"), again.err
        check_agreement(str(store), [Gate(first, 0.5, 0, "promotion gate: PROMOTED", ""),
                                     Gate(better, 0.7, again.code, again.out, again.err)])
        assert len(history(str(store))) == 2
        assert json.loads((store / "production.json").read_text())["model_id"] == promotion.model_id(better)


@pytest.mark.parametrize("every", EVERY)
def test_an_eval_set_killed_at_any_write_leaves_the_previous_or_the_new_set(tmp_path, every):
    import torch
    from image_server import image_folder

    from cloob_core.evaluation.image_loader import image_batches
    from cloob_core.evaluation.inputs import wds_set

    def build(source: Path, output: Path):
        return ["data", "eval-set", "--source", source, "--output", output, "--shard-size", "3"]

    old = image_folder(tmp_path / "old", ["cat", "dog"], {"train": 2, "test": 4})
    new = image_folder(tmp_path / "new", ["ant", "bee", "cow"], {"train": 3, "test": 2})
    clean = {}
    for name, source in (("old", old), ("new", new)):
        assert run(build(source, tmp_path / f"{name}_set"), tmp_path / "m").code == 0
        clean[name] = publish.unit_of(tmp_path / f"{name}_set").files
    argv = build(new, tmp_path / "set")
    copy(tmp_path / "old_set", tmp_path / "set")
    total = count_moments(argv, tmp_path / "moments")
    for moment in chosen(total, every):
        copy(tmp_path / "old_set", tmp_path / "set")
        killed_at(argv, tmp_path / "moments", moment)
        images = wds_set(str(tmp_path / "set"), "test")  # the next step reads the set: either set, whole
        state = next(name for name, files in clean.items() if files == publish.unit_of(tmp_path / "set").files)
        assert images.classnames == (["cat", "dog"] if state == "old" else ["ant", "bee", "cow"]), moment
        labels = [r.label for batch in image_batches(images, lambda image: torch.zeros(1), batch_size=4, workers=0)
                  for r in batch.records]
        assert len(labels) == (8 if state == "old" else 6) and None not in labels


@pytest.mark.slow  # ~55 s, in the slow phase for the default one's budget (docs/development.md)
def test_a_failed_publish_leaves_the_previous_model_for_its_readers_and_the_gate(mnist_train_shards, tmp_path,
                                                                                 s3_bucket, fault_proxy):
    """`cloob train --publish` over an earlier publication on S3, failing part-way: while the new files are
    uploaded (the weights refused), and while they are switched into place (metrics.json's move answered 500).
    The run exits 2 in one line; the reader the multi-node step uses (publish.fetch), and the gate's checks on
    what it fetched, see yesterday's set whole or today's whole, never today's metrics beside yesterday's
    weights."""
    import subprocess
    import sys

    prefix = f"s3://{s3_bucket}/publish"
    base = ["--shards", str(mnist_train_shards), "--batch-size", "32", "--workers", "0", "--no-progress",
            "--no-tensorboard", "--publish", prefix]

    def train(name: str, steps: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cloob_core.cli", "train", "--output", str(tmp_path / name),
                               "--steps", steps, *base], capture_output=True, text=True, timeout=600)

    def fetched(name: str) -> tuple[int, str]:
        local = tmp_path / "fetched" / name
        publish.fetch(prefix, local)
        promotion._check_candidate(local / "model")
        return json.loads((local / "metrics.json").read_text())["steps"], promotion.model_id(local / "model")

    done = train("yesterday", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    yesterday = (1, promotion.model_id(tmp_path / "yesterday" / "model"))
    assert fetched("first") == yesterday
    fault_proxy.add("slowdown", method="PUT", key="open_clip_model.safetensors", times=None)
    done = train("today", "2")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len([line for line in done.stderr.splitlines() if line.startswith("cloob: ")]) == 1
    assert fetched("after-upload-failed") == yesterday
    fault_proxy.clear()
    fault_proxy.add("error-after", method="PUT", key="/publish/metrics.json", times=None)
    done = train("today-again", "2")
    assert done.returncode == 2, done.stderr[-2000:]
    fault_proxy.clear()
    today = (2, promotion.model_id(tmp_path / "today-again" / "model"))
    assert fetched("after-switch-failed") == today  # the reader completed the switch the run began
    assert storage.read_json(f"{prefix}/metrics.json")["steps"] == 2
    assert "as one unit" in train("tomorrow", "1").stdout
