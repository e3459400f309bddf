"""`cloob data curate` on a scored pool: the kept samples resharded as the shard gate and training read them, the
kept table, the report, the same bytes from the same inputs, and refusals that write nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cloob_core.config import load_config
from cloob_core.curation.curate import CONTACT_SHEET, HISTOGRAM, KEPT_FILE, REPORT_JSON, curate
from cloob_core.curation.score import ScoreRequest, score
from cloob_core.model.source import ModelSource


@pytest.fixture(scope="module")
def scored_pool(captioned_train_shards, untrained_export, tmp_path_factory):
    """Three shards of the captioned set scored by the untrained model; read-only."""
    root = tmp_path_factory.mktemp("pool")
    pool = root / "pool"
    pool.mkdir()
    sizes = json.loads((captioned_train_shards / "sizes.json").read_text())
    names = ["00000", "00001", "00002"]
    for name in names:
        shutil.copy(captioned_train_shards / f"{name}.tar", pool / f"{name}.tar")
    (pool / "sizes.json").write_text(json.dumps({f"{n}.tar": sizes[f"{n}.tar"] for n in names}))
    score(ScoreRequest(str(pool), ModelSource(model=str(untrained_export), device="cpu"), str(root / "scores"),
                       workers=0, progress=False))
    return pool, root / "scores"


def _config(**curation):
    return load_config(overrides=[f"curation.{key}={value}" for key, value in curation.items()])


def _keys(folder: Path) -> list[str]:
    keys = []
    for tar in sorted(folder.glob("*.tar")):
        with tarfile.open(tar) as archive:
            keys += sorted({member.name.split(".")[0] for member in archive.getmembers()})
    return keys


def test_the_kept_samples_are_resharded_with_their_scores_and_the_same_inputs_give_the_same_bytes(scored_pool,
                                                                                                  tmp_path):
    pool, scores = scored_pool
    config = _config(top_fraction=0.4, min_caption_words=2)
    result = curate(str(pool), str(scores), str(tmp_path / "one"), config)
    again = curate(str(pool), str(scores), str(tmp_path / "two"), config)
    chosen = result.selection
    assert chosen.rows == sum(json.loads((pool / "sizes.json").read_text()).values())
    assert chosen.kept == again.selection.kept > 0
    kept = pq.read_table(tmp_path / "one" / KEPT_FILE).to_pylist()
    assert [row["key"] for row in kept] == sorted(row["key"] for row in kept) and len(kept) == chosen.rows
    kept_keys = [row["key"] for row in kept if row["kept"]]
    assert all(row["reasons"] for row in kept if not row["kept"]) and not any(r["reasons"] for r in kept if r["kept"])
    assert _keys(tmp_path / "one") == kept_keys  # pool order is key order for `cloob data` shards
    sizes = json.loads((tmp_path / "one" / "sizes.json").read_text())
    assert sum(sizes.values()) == chosen.kept and max(sizes.values()) <= load_config().preprocess.shard_size
    report = json.loads((tmp_path / "one" / REPORT_JSON).read_text())
    assert report["kept"] == chosen.kept and set(report["removed_by"]) == {"top_fraction", "min_caption_words"}
    with tarfile.open(tmp_path / "one" / "00000.tar") as archive:
        meta = json.loads(archive.extractfile(next(m for m in archive.getmembers() if m.name.endswith(".json")))
                          .read())
    assert {"clip_score", "language", "phash", "shard", "position"} <= set(meta["curation"])
    for name in [*sizes, KEPT_FILE, "stats.json", HISTOGRAM, CONTACT_SHEET]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    # (the untrained scorer separates nothing: its cut passes the gate only with the scorer's check off)
    gate = subprocess.run([sys.executable, "-m", "cloob_core.cli", "data", "validate", "--shards",
                           str(tmp_path / "one"), "--set", "curation.min_scorer_auc=0"], capture_output=True,
                          text=True, timeout=300)
    assert gate.returncode == 0, gate.stdout + gate.stderr


def test_a_curation_that_keeps_nothing_is_one_line_naming_the_filter_and_writes_nothing(scored_pool, tmp_path):
    pool, scores = scored_pool
    output = tmp_path / "curated"
    done = subprocess.run([sys.executable, "-m", "cloob_core.cli", "data", "curate", "--shards", str(pool),
                           "--scores", str(scores), "--output", str(output), "--set", "curation.min_clip_score=0.99",
                           "--set", "curation.min_caption_words=2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr and line.startswith("cloob: ")
    assert "keeps none of the" in line and "curation.min_clip_score removed the most" in line
    assert not any(path.suffix in (".tar", ".parquet", ".json") for path in output.glob("*"))


def test_a_curate_that_fails_part_way_leaves_the_previous_output_whole(scored_pool, tmp_path, monkeypatch):
    pool, scores = scored_pool
    output = tmp_path / "curated"
    curate(str(pool), str(scores), str(output), _config(top_fraction=0.5))
    before = {path.name: path.read_bytes() for path in output.iterdir() if path.is_file()}

    def fail(*_args, **_kwargs):
        raise OSError("the disk went away")

    monkeypatch.setattr("cloob_core.curation.curate.write_kept_table", fail)
    with pytest.raises(OSError, match="went away"):
        curate(str(pool), str(scores), str(output), _config(top_fraction=0.2))
    after = {path.name: path.read_bytes() for path in output.iterdir() if path.is_file()}
    assert after == before


@pytest.fixture(scope="module")
def leaky_pool(captioned_train_shards, untrained_export, tmp_path_factory):
    """A pool of one captioned shard and one of 24 tuxpaint test images leaked in as training photos (each
    resized to 80% and re-encoded at JPEG quality 70), scored by the untrained model; read-only."""
    import io

    from PIL import Image

    from cloob_core.data.packaged import load_packaged
    from cloob_core.data.writer import ShardWriter

    root = tmp_path_factory.mktemp("leaky")
    pool = root / "pool"
    pool.mkdir()
    shutil.copy(captioned_train_shards / "00000.tar", pool / "00000.tar")
    tuxpaint = load_packaged("tuxpaint", "test")
    leaked = []
    with open(pool / "00001.tar", "wb") as handle, ShardWriter(handle) as writer:
        for index in range(0, 96, 4):
            image = Image.open(io.BytesIO(tuxpaint.images[index])).convert("RGB")
            image = image.resize((image.width * 4 // 5, image.height * 4 // 5))
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=70)
            key = f"leak{index:04d}"
            writer.write(key, buffer.getvalue(), tuxpaint.captions[index], {"url": f"http://example.com/{key}"})
            leaked.append(key)
    score(ScoreRequest(str(pool), ModelSource(model=str(untrained_export), device="cpu"), str(root / "scores"),
                       workers=0, progress=False))
    return pool, root / "scores", leaked


def test_a_leaked_evaluation_image_is_never_kept(leaky_pool, untrained_export, tmp_path):
    pool, scores, leaked = leaky_pool
    config = _config(decontaminate='["tuxpaint"]', decontaminate_min_cosine=1.0)  # by hash: the model is untrained
    result = curate(str(pool), str(scores), str(tmp_path / "clean"), config,
                    ModelSource(model=str(untrained_export), device="cpu"))
    kept = {row["key"]: row for row in pq.read_table(tmp_path / "clean" / KEPT_FILE).to_pylist()}
    assert all(not kept[key]["kept"] and kept[key]["reasons"] == ["decontaminated"] for key in leaked)
    assert result.selection.removed_by["decontaminated"] >= len(leaked)
    assert not set(leaked) & set(_keys(tmp_path / "clean"))


def _curate_cli(pool: Path, scores: Path, output: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cloob_core.cli", "data", "curate", "--shards", str(pool),
                           "--scores", str(scores), "--output", str(output), "--device", "cpu", *options],
                          capture_output=True, text=True, timeout=300)


def _refused(done: subprocess.CompletedProcess, output: Path) -> str:
    """The one line a refused curate printed; it wrote nothing."""
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert not output.exists() or not any(output.iterdir()), sorted(output.iterdir())
    return done.stderr.strip().splitlines()[-1]


def test_decontamination_refuses_another_model_and_an_unknown_set(leaky_pool, weights, tmp_path):
    pool, scores, _ = leaky_pool
    line = _refused(_curate_cli(pool, scores, tmp_path / "a", "--set", "curation.decontaminate=[tuxpaint]",
                                "--architecture", "cloob-tiny", "--weights", str(weights)), tmp_path / "a")
    assert "is not the one that scored the pool" in line
    line = _refused(_curate_cli(pool, scores, tmp_path / "b", "--set", "curation.decontaminate=[no-such-set]"),
                    tmp_path / "b")
    assert "curation.decontaminate: no-such-set is neither a data set of eval.datasets" in line


def test_a_scoring_model_of_another_width_is_refused_in_one_line(leaky_pool, untrained_export, tmp_path):
    """An open_clip folder (local-dir:) whose embeddings are 32 wide against the scores' 64."""
    import open_clip
    from safetensors.torch import save_file

    pool, scores, _ = leaky_pool
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    config = json.loads((untrained_export / "open_clip_config.json").read_text())
    config["model_cfg"]["embed_dim"] = 32
    (narrow / "open_clip_config.json").write_text(json.dumps(config))
    save_file(open_clip.CLIP(**config["model_cfg"]).state_dict(), narrow / "open_clip_model.safetensors")
    line = _refused(_curate_cli(pool, scores, tmp_path / "c", "--set", "curation.decontaminate=[tuxpaint]",
                                "--model", f"local-dir:{narrow}"), tmp_path / "c")
    assert "embeds images in 32 dimensions, the scores' embeddings have 64" in line


def test_the_gate_refuses_curated_shards_that_keep_too_little_naming_the_filter(scored_pool, tmp_path):
    pool, scores = scored_pool
    curate(str(pool), str(scores), str(tmp_path / "thin"), _config(top_fraction=0.005, min_caption_words=2))
    gate = subprocess.run([sys.executable, "-m", "cloob_core.cli", "data", "validate", "--shards",
                           str(tmp_path / "thin")], capture_output=True, text=True, timeout=300)
    assert gate.returncode == 1, gate.stdout + gate.stderr
    failing = [line for line in (gate.stdout + gate.stderr).splitlines() if "curated_fraction" in line]
    assert failing and "FAIL" in failing[0] and "curation.top_fraction removed the most" in failing[0], failing
    # and the untrained scorer's cut is refused for what it is: a cut at chance
    scorer = [line for line in (gate.stdout + gate.stderr).splitlines() if "scorer_auc" in line]
    assert scorer and "FAIL" in scorer[0] and "curation.top_fraction is close to random" in scorer[0], scorer


def test_the_target_distribution_keeps_the_clusters_of_the_reference_images(leaky_pool, untrained_export, tmp_path):
    """A reference of three images keeps the pool's samples in at most three of its clusters; the pool itself as
    the reference keeps every sample (each cluster holds one of its images)."""
    import io

    from PIL import Image

    from cloob_core.data.packaged import load_packaged

    pool, scores, _ = leaky_pool
    model = ModelSource(model=str(untrained_export), device="cpu")
    reference = tmp_path / "reference" / "train" / "things"
    reference.mkdir(parents=True)
    tuxpaint = load_packaged("tuxpaint", "train")
    for index in range(3):
        Image.open(io.BytesIO(tuxpaint.images[index])).convert("RGB").save(reference / f"{index}.png")
    narrow = curate(str(pool), str(scores), str(tmp_path / "narrow"), model=model,
                    config=_config(target_images=str(tmp_path / "reference"), target_clusters=20))
    assert 0 < narrow.selection.kept < narrow.selection.rows
    assert set(narrow.selection.removed_by) == {"target_distribution"}
    whole = curate(str(pool), str(scores), str(tmp_path / "whole"), model=model,
                   config=_config(target_images=f"{pool}/{{00000..00001}}.tar", target_clusters=20))
    assert whole.selection.kept == whole.selection.rows


def test_while_curation_is_off_the_pipeline_scores_nothing_and_trains_on_the_pool_as_it_is(scored_pool, tmp_path):
    """The DVC pipeline's switch (`--if-enabled`): no scoring model is needed, the scores folder says curation is
    off, and the curated folder holds the pool's files byte for byte."""
    pool, _ = scored_pool
    cli = [sys.executable, "-m", "cloob_core.cli", "data"]
    run = subprocess.run([*cli, "score", "--shards", str(pool), "--output", str(tmp_path / "scores"), "--if-enabled"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "curation is off" in run.stdout, run.stderr
    assert [p.name for p in (tmp_path / "scores").iterdir() if not p.name.startswith(".")] == ["curation_off.json"]
    run = subprocess.run([*cli, "curate", "--shards", str(pool), "--scores", str(tmp_path / "scores"), "--output",
                          str(tmp_path / "curated"), "--if-enabled"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "curation is off" in run.stdout, run.stderr
    for name in ("00000.tar", "00002.tar", "sizes.json"):
        assert (tmp_path / "curated" / name).read_bytes() == (pool / name).read_bytes()
    enabled = subprocess.run([*cli, "scorer", "--output", str(tmp_path / "scorer.json"), "--set",
                              "curation.enabled=true"], capture_output=True, text=True, timeout=300)
    assert enabled.returncode == 2 and "Traceback" not in enabled.stderr
    assert "curation.scorer, which is not set" in enabled.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "scorer.json").exists()


def test_a_first_run_curating_with_production_trains_on_the_pool_then_curates_with_what_it_promoted(
        scored_pool, untrained_export, tmp_path):
    """The docs' DVC settings (curation.enabled, scorer production) on a fresh clone, before any promotion (issue
    79, point 8): each curation stage says why it passes the pool through, in one line, and succeeds; once a model
    is promoted, the scorer names its weights and the pool is scored."""
    pool, _ = scored_pool
    store = tmp_path / "registry"
    cli = [sys.executable, "-m", "cloob_core.cli", "data"]
    settings = ["--set", "curation.enabled=true", "--set", "curation.scorer=production", "--set",
                f"promote.store={store}"]
    why = f"curation.scorer is production and {store} has no production model yet"
    for step in (["scorer", "--output", str(tmp_path / "scorer.json")],
                 ["score", "--shards", str(pool), "--output", str(tmp_path / "scores"), "--if-enabled"],
                 ["curate", "--shards", str(pool), "--scores", str(tmp_path / "scores"), "--output",
                  str(tmp_path / "curated"), "--if-enabled"]):
        run = subprocess.run([*cli, *step, *settings], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and why in run.stdout, run.stdout + run.stderr
    assert json.loads((tmp_path / "scorer.json").read_text()) == {"scorer": None, "sha256": None, "weights": None}
    assert (tmp_path / "curated" / "00000.tar").read_bytes() == (pool / "00000.tar").read_bytes()
    store.mkdir()
    (store / "production.json").write_text(json.dumps({"model": str(untrained_export)}))  # promoted since
    run = subprocess.run([*cli, "scorer", "--output", str(tmp_path / "scorer.json"), *settings],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "scorer: production (open_clip_model.safetensors" in run.stdout, run.stderr


def test_the_kubeflow_scoring_plan_refuses_params_without_curation_and_cuts_the_pool_into_ranges(scored_pool,
                                                                                                untrained_export):
    from cloob_core.config import ConfigError
    from cloob_core.ops import kubeflow

    pool, _ = scored_pool
    with pytest.raises(ConfigError, match=r"set curation\.enabled and curation\.scorer in the run's params"):
        kubeflow.plan_scoring(_config().model_dump(), str(pool), 8)
    with pytest.raises(ConfigError, match="no scoring model"):
        kubeflow.plan_scoring(_config(enabled="true").model_dump(), str(pool), 8)
    params = _config(enabled="true", scorer=str(untrained_export)).model_dump()
    assert kubeflow.plan_scoring(params, str(pool), 8) == ["0/3", "1/3", "2/3"]  # no more ranges than shards
    assert kubeflow.plan_scoring(params, str(pool), 2) == ["0/2", "1/2"]
