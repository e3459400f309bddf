"""A researcher's first hour on their own data, through the CLI only, as issue 44's trial went: a folder of real
images (the package's Tux Paint and Fluent Emoji pictures, written out as files) with a captions CSV of its own
column names and relative paths; the same kind of images behind a URL manifest on a loopback server, with other
column names; an ImageFolder test set with its own class names. Shards, training, evaluation (zero-shot, linear
probe, retrieval), export and resume, and on the way each thing the trial tripped on: captions cut to the context,
a schedule longer than the run, too few shards, enlarged images, column flags that differ between commands, two
rules for relative paths, a resume that needs its flags again, downloads that fail but say success, a cluster run
with local paths."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import pytest
from image_server import ImageServer, image_folder
from PIL import Image
from safetensors.torch import load_file

from cloob_core.cli import main
from cloob_core.data.packaged import load_packaged

PHOTOS = 96  # the folder's pictures: 6 shards of 16 at --shard-size 16
CLASSES = ["ceramic mug", "desk lamp", "wool scarf"]  # the test set's own class names
BOILERPLATE = "Acme home catalogue 2026, everything for the modern household, item number and description: "


def _lines(captured) -> list[str]:
    return captured.err.strip().splitlines()


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> Path:
    """``products/photos/*`` (real pictures at their own sizes), ``products/captions.csv`` (file,text, paths
    relative to the CSV), ``products/catalogue.csv`` (the same files under boilerplate captions) and
    ``testset/{train,test}/CLASS/*.jpg``."""
    root = tmp_path_factory.mktemp("own")
    photos = root / "products" / "photos"
    photos.mkdir(parents=True)
    packaged = load_packaged("captioned", "train")
    rows = []
    for i in range(PHOTOS):
        image = Image.open(io.BytesIO(packaged.images[i]))
        name = f"item{i:03d}.{(image.format or 'png').lower()}"
        (photos / name).write_bytes(packaged.images[i])
        rows.append((f"photos/{name}", packaged.captions[i]))
    for table, captions in (("captions.csv", [c for _, c in rows]),
                            ("catalogue.csv", [f"{BOILERPLATE}{i:05d}" for i in range(PHOTOS)])):
        with (root / "products" / table).open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["file", "text"])
            writer.writerows(zip([f for f, _ in rows], captions, strict=True))
    image_folder(root / "testset", CLASSES, {"train": 6, "test": 4})
    return root


@pytest.fixture(scope="module")
def shards(own, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("shards") / "shards"
    assert main(["data", "shards", "--source", str(own / "products"), "--manifest", str(own / "products" /
                 "captions.csv"), "--url-col", "file", "--caption-col", "text", "--shard-size", "16",
                 "--output", str(output), "--no-progress"]) == 0
    return output


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "--shards", str(shards), "--output", str(output), "--batch-size", "16", "--epochs", "2",
                 "--checkpoint-every", "4", "--workers", "0", "--no-progress", "--no-tensorboard"]) == 0
    return output


def test_too_few_shards_are_named_with_the_size_that_gives_enough(own, tmp_path, capsys):
    assert main(["data", "shards", "--source", str(own / "products"), "--manifest", str(own / "products" /
                 "captions.csv"), "--url-col", "file", "--caption-col", "text", "--output", str(tmp_path / "one"),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "warning: 1 shard(s) feed at most 1 training data stream(s)" in out
    assert "--shard-size 12" in out  # 96 pairs over train.data_streams' 8


def test_no_picture_is_enlarged(own, shards):
    originals = {path.stem: Image.open(path).size for path in (own / "products" / "photos").iterdir()}
    stored = []
    for tar in sorted(shards.glob("*.tar")):
        with tarfile.open(tar) as archive:
            for member in archive.getmembers():
                if member.name.endswith(".jpg"):
                    meta = json.loads(archive.extractfile(member.name.replace(".jpg", ".json")).read())
                    size = Image.open(archive.extractfile(member)).size
                    stored.append((size, originals[Path(meta["url"]).stem]))
    assert len(stored) == PHOTOS and len(list(shards.glob("*.tar"))) == 6
    assert all(size == original for size, original in stored)  # all under 256 px: kept as they are


def test_every_command_that_reads_a_table_takes_the_same_column_flags(capsys):
    for command in (["data", "acquire"], ["data", "download"], ["data", "validate"], ["data", "shards"],
                    ["data", "eval-set"], ["eval", "retrieval"], ["eval", "zeroshot"], ["eval", "linear-probe"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = capsys.readouterr().out
        assert "--url-col" in text and "--caption-col" in text, command


def test_relative_paths_are_read_from_the_tables_folder_by_every_command(own, shards, trained, tmp_path, capsys):
    table = own / "products" / "captions.csv"
    # data shards read it (the fixture); eval-set and eval retrieval read it the same way
    assert main(["data", "eval-set", "--source", str(table), "--url-col", "file", "--caption-col", "text",
                 "--type", "retrieval", "--output", str(tmp_path / "set")]) == 0
    first, second = [row["file"] for row in csv.DictReader(table.open())][:2]
    broken = own / "products" / "broken.csv"  # its second row names its file relative to photos/, not to itself
    broken.write_text(f"file,text\n{first},a thing\n{Path(second).name},another thing\n")
    for argv in (["data", "eval-set", "--source", str(broken), "--type", "retrieval", "--output",
                  str(tmp_path / "b")],
                 ["eval", "retrieval", "--data", str(broken), "--model", str(trained / "model"), "--output",
                  str(tmp_path / "r")]):
        capsys.readouterr()
        assert main([*argv, "--url-col", "file", "--caption-col", "text"]) == 2
        (line,) = _lines(capsys.readouterr())
        assert f"row 2, column 'file': '{Path(second).name}' is not a file" in line, line
        assert f"read from the table's own folder, {own / 'products'}" in line


def test_captions_that_the_context_makes_identical_fail_the_gate_and_training(own, tmp_path, capsys):
    catalogue = own / "products" / "catalogue.csv"
    assert main(["data", "validate", "--manifest", str(catalogue), "--url-col", "file", "--caption-col", "text",
                 "--set", "validation.max_bad_row_fraction=1"]) == 1  # local paths are not http(s) URLs
    out = capsys.readouterr().out
    assert "FAIL manifest_captions" in out and "validation.max_merged_caption_fraction" in out
    assert main(["data", "shards", "--source", str(own / "products"), "--manifest", str(catalogue), "--url-col",
                 "file", "--caption-col", "text", "--shard-size", "16", "--output", str(tmp_path / "s"),
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", "--shards", str(tmp_path / "s"), "--output", str(tmp_path / "run"), "--batch-size", "16",
                 "--no-progress", "--no-tensorboard"]) == 2
    (line,) = _lines(capsys.readouterr())
    assert "cutting captions to cloob-tiny's 16 tokens makes 100.0% of the 96 distinct ones" in line
    assert "model.architecture" in line


def test_a_short_run_warms_up_for_half_of_it_and_says_so(trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["steps"] == 12  # 2 epochs of 96 pairs in batches of 16
    history = [row.split(",") for row in (trained / "loss_history.csv").read_text().splitlines()[1:]]
    assert max(float(row[2]) for row in history) == pytest.approx(1e-3)  # the peak rate is reached
    assert metrics["caption_truncated_fraction"] > 0 and metrics["caption_merged_fraction"] == 0


def test_a_resume_needs_no_flag_and_refuses_one_that_changes_the_run(trained, tmp_path, capsys):
    finished = load_file(trained / "model" / "open_clip_model.safetensors")
    for name in ("step-00000012.pt", "step-00000012.pt.sha256"):
        (trained / "checkpoints" / name).unlink()  # as if stopped after step 8
    assert main(["train", "--output", str(trained), "--resume", "latest", "--steps", "40"]) == 2
    (line,) = _lines(capsys.readouterr())
    assert "train.steps 40 (the run has 0)" in line and "would change that run" in line
    assert main(["train", "--output", str(trained), "--resume", "latest", "--no-progress"]) == 0
    resumed = load_file(trained / "model" / "open_clip_model.safetensors")
    assert all((resumed[key] == finished[key]).all() for key in finished)
    assert json.loads((trained / "metrics.json").read_text())["resumed_from_step"] == 8


def test_the_model_evaluates_on_the_users_sets_and_loads_in_open_clip(own, trained, tmp_path, capsys):
    import open_clip

    model = str(trained / "model")
    assert main(["eval", "zeroshot", "--model", model, "--data", str(own / "testset"), "--output",
                 str(tmp_path / "zs"), "--no-progress"]) == 0
    assert main(["eval", "linear-probe", "--model", model, "--data", str(own / "testset"), "--output",
                 str(tmp_path / "lp"), "--no-progress"]) == 0
    assert main(["eval", "retrieval", "--model", model, "--data", str(own / "products" / "captions.csv"),
                 "--url-col", "file", "--caption-col", "text", "--output", str(tmp_path / "rt"),
                 "--no-progress"]) == 0
    def record(folder: str, task: str) -> dict:
        (path,) = [p for p in (tmp_path / folder).glob(f"*{task}*.json") if "metrics" in json.loads(p.read_text())]
        return json.loads(path.read_text())["metrics"]

    zeroshot = record("zs", "zeroshot_classification")
    assert zeroshot["classnames"] == CLASSES and len(zeroshot["templates"]) == 7  # CLIP's general prompts
    assert 0 <= record("lp", "linear_probe")["lp_acc1"] <= 1
    assert 0 <= record("rt", "retrieval")["image_retrieval_recall@5"] <= 1
    loaded, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{model}")
    assert sum(p.numel() for p in loaded.parameters()) > 0 and preprocess is not None


def test_a_download_that_fetches_nothing_fails_and_a_rerun_with_the_fix_builds_it(tmp_path, capsys):
    with ImageServer() as server:
        table = tmp_path / "urls.csv"
        with table.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["image_url", "description"])
            writer.writerows((server.url(f"/img/{i}.jpg"), f"a photo of item {i}") for i in range(12))
        argv = ["data", "download", "--manifest", str(table), "--url-col", "image_url", "--caption-col",
                "description", "--output", str(tmp_path / "dl"), "--no-progress"]
        assert main(argv) == 2
        (line,) = _lines(capsys.readouterr())[-1:]
        assert "0 of 12 rows became samples" in line and "blocked_address" in line
        assert "--allow-private-network" in line
        assert main([*argv, "--allow-private-network"]) == 0  # the shard of no sample is built again
    out = capsys.readouterr().out
    assert "samples written 12 (100.0%)" in out
    assert json.loads((tmp_path / "dl" / "sizes.json").read_text()) == {"00000.tar": 12}


def test_a_cluster_run_with_this_machines_paths_is_refused_before_it_is_sent(own, tmp_path, capsys):
    from kfp_api_server import KfpApiServer

    from pipelines.__main__ import main as pipelines

    package = tmp_path / "pipeline.yaml"
    assert pipelines(["compile", "--output", str(package)]) == 0
    with KfpApiServer() as api:
        assert pipelines(["submit", "--host", api.url, "--package", str(package), "--run-name", "mine",
                          "--set", f"acquire.source={own / 'products' / 'captions.csv'}",
                          "--set", "promote.store=s3://cloob/registry"]) == 2
        assert not api.calls("POST", "/apis/v2beta1/runs")
    line = _lines(capsys.readouterr())[-1]
    assert f"acquire.source '{own / 'products' / 'captions.csv'}'" in line


@pytest.mark.slow  # ~50 s, in the slow phase for the default one's budget (docs/development.md)
def test_the_walk_through_in_docs_data_md_runs_as_written(tmp_path):
    """docs/data.md's "Your own data" commands, each run as written in a folder holding my-data (240 of the
    package's pictures, captions.csv with columns file,text) and my-testset (an ImageFolder of 3 classes)."""
    import os
    import re
    import subprocess
    import sys

    text = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    section = text[text.index("## Your own data"):]
    block = section[section.index("```bash\n") + len("```bash\n"):section.index("```\n", section.index("```bash"))]
    commands = [re.sub(r"\s+# .*$", "", line).strip() for line in block.replace("\\\n", " ").splitlines()
                if not line.startswith("#")]
    commands = [command for command in commands if command]
    assert [c.split()[:3] for c in commands][:3] == [["cloob", "data", "shards"], ["cloob", "data", "validate"],
                                                     ["cloob", "train", "--shards"]]
    photos = tmp_path / "my-data" / "photos"
    photos.mkdir(parents=True)
    packaged = load_packaged("captioned", "train")
    with (tmp_path / "my-data" / "captions.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "text"])
        for i in range(240):
            suffix = (Image.open(io.BytesIO(packaged.images[i])).format or "png").lower()
            (photos / f"{i:04d}.{suffix}").write_bytes(packaged.images[i])
            writer.writerow([f"photos/{i:04d}.{suffix}", packaged.captions[i]])
    image_folder(tmp_path / "my-testset", CLASSES, {"train": 6, "test": 4})
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        if command.startswith("cloob data shards"):
            assert "warning" not in done.stdout and "shards 8" in done.stdout, done.stdout
        if command.startswith("cloob train --shards"):
            assert "warming up for 4 instead" in done.stderr and "schedule: 4 warm-up step(s)" in done.stderr
    assert json.loads((tmp_path / "my-run" / "metrics.json").read_text())["resumed_from_step"] == 9
