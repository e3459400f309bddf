"""Trust, sixth round: scoring and curation on a pool unlike the packaged set (drawn pictures of other sizes and
shapes, short captions in several languages, tars written by GNU tar, a key that appears twice, images that do not
decode) never damage the pool, never pair a caption with another sample's score, and never lose a shard to a
passing storage fault; each refusal is one line that names the setting or the file."""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import typing
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from crawl import crawl_samples, gnu_tar, picture, write_tar
from hostile import cli

from cloob_core import storage
from cloob_core.config import ConfigError, load_config
from cloob_core.curation.curate import KEPT_FILE, curate
from cloob_core.curation.score import ScoreRequest, score
from cloob_core.curation.score_table import part_file, read_index, read_part_table
from cloob_core.model.source import ModelSource


@pytest.fixture(scope="module")
def crawl(untrained_export, tmp_path_factory):
    """A pool of three shards scored by the untrained model (read-only): 00000 by GNU tar (``./KEY.EXT``),
    00001 a plain tar, 00002 with an undecodable image first, the key ``twin`` twice (two pictures, two
    captions) and one picture twice under two keys. Returns (root, pool, scores)."""
    root = tmp_path_factory.mktemp("crawl")
    pool = root / "pool"
    pool.mkdir()
    gnu_tar(pool / "00000.tar", crawl_samples(0, 12), root)
    write_tar(pool / "00001.tar", crawl_samples(12, 12))
    copy = picture(99, (90, 60))
    third = [("broken", b"\xff\xd8\xff\xe0 not a picture", "nothing decodes"), *crawl_samples(24, 3),
             ("twin", picture(200, (64, 64)), "the first twin"), ("copy-a", copy, "a copy"), *crawl_samples(27, 2),
             ("twin", picture(201, (70, 50)), "the second twin"), ("copy-b", copy, "the same copy"),
             *crawl_samples(29, 2)]
    write_tar(pool / "00002.tar", third)
    sizes = {"00000.tar": 12, "00001.tar": 12, "00002.tar": len(third)}
    (pool / "sizes.json").write_text(json.dumps(sizes))
    score(ScoreRequest(str(pool), _model(untrained_export), str(root / "scores"), workers=0, progress=False))
    return root, pool, root / "scores"


def _model(export: Path) -> ModelSource:
    return ModelSource(model=str(export), device="cpu")


def _config(**curation: object):
    return load_config(overrides=[f"curation.{key}={value}" for key, value in curation.items()])


def _digests(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def _copy(crawl, tmp_path: Path) -> tuple[Path, Path]:
    _, pool, scores = crawl
    shutil.copytree(pool, tmp_path / "pool")
    shutil.copytree(scores, tmp_path / "scores")
    return tmp_path / "pool", tmp_path / "scores"


def test_an_output_that_is_in_or_holds_the_pool_or_its_scores_is_refused_and_the_pool_stays(crawl, untrained_export,
                                                                                              tmp_path, capsys):
    pool, scores = _copy(crawl, tmp_path)  # a copy: the code before this check curated into the pool itself
    root = tmp_path
    before = _digests(root)
    (tmp_path / "link").symlink_to(pool)
    for output in (pool, pool / "curated", root, tmp_path / "link", scores, scores / "parts"):
        done = cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", output)
        assert done.code == 2, (output, done.err)
        line = done.error_line()
        assert f"--output {output} " in line and "would replace what this stage reads" in line, line
    done = cli(capsys, "data", "score", "--shards", pool, "--output", pool / "scores", "--model", untrained_export)
    assert done.code == 2 and "--output" in done.error_line() and "--shards" in done.error_line()
    assert _digests(root) == before and not (pool / "curated").exists() and not (pool / "scores").exists()
    with pytest.raises(storage.OverlappingLocations, match="is the folder of --shards"):
        storage.check_apart(("--output", "s3://bucket/pool/"), ("--shards", "s3://bucket/pool"))
    with pytest.raises(storage.OverlappingLocations, match="lies inside"):
        storage.check_apart(("--output", "s3://bucket/pool/curated"), ("--shards", "s3://bucket/pool/{0..7}.tar"))
    storage.check_apart(("--output", "s3://bucket/pool.curated"), ("--shards", "s3://bucket/pool"))  # beside it


def test_a_shard_rebuilt_in_place_after_scoring_is_refused_by_name_and_rescoring_mends_it(crawl, untrained_export,
                                                                                          tmp_path, capsys,
                                                                                          monkeypatch):
    """Its captions moved one sample on, at the same tar size: curate refuses it naming the shard and the command;
    that command scores it again, and then each kept sample carries its own caption's score."""
    pool, scores = _copy(crawl, tmp_path)
    score(ScoreRequest(str(pool), _model(untrained_export), str(scores), workers=0, progress=False))  # the copy's
    tar = pool / "00001.tar"
    samples = crawl_samples(12, 12)
    moved = [(key, image, samples[(i + 1) % len(samples)][2]) for i, (key, image, _) in enumerate(samples)]
    size = tar.stat().st_size
    write_tar(tar, moved)
    assert tar.stat().st_size == size
    monkeypatch.chdir(tmp_path)  # the paths as a user types them: the line is cut at 400 characters
    done = cli(capsys, "data", "curate", "--shards", "pool", "--scores", "scores", "--output", "out",
               "--set", "curation.top_fraction=1.0")
    line = done.error_line()
    assert done.code == 2 and "pool/00001.tar changed since it was scored (its sample 0 has another caption)" in line
    assert "`cloob data score --shards pool --output scores` scores it again" in line, line
    again = score(ScoreRequest(str(pool), _model(untrained_export), str(scores), workers=0, progress=False))
    assert again.scored == 1
    curate(str(pool), str(scores), str(tmp_path / "out"), _config(top_fraction=1.0))
    _assert_each_written_sample_is_its_scored_row(tmp_path / "out", pool, scores)


def _assert_each_written_sample_is_its_scored_row(output: Path, pool: Path, scores: Path) -> int:
    """Every curated sample's caption, image and score are those of the scored row at its shard and position;
    their number is the kept table's. Returns it."""
    index = read_index(str(scores))
    rows = {(row["shard"], row["position"]): row for part in index.parts
            for row in read_part_table(str(scores), part).to_pylist()}
    kept = [row for row in pq.read_table(output / KEPT_FILE).to_pylist() if row["kept"]]
    written = 0
    for tar in sorted(output.glob("*.tar")):
        samples: list[dict[str, bytes]] = []  # members grouped as readers group them: a run of one key
        with tarfile.open(tar) as archive:
            last = None
            for member in archive.getmembers():
                key, _, suffix = member.name.rpartition(".")
                if key != last:
                    samples.append({})
                    last = key
                samples[-1][suffix] = archive.extractfile(member).read()
        for sample in samples:
            meta = json.loads(sample["json"])["curation"]
            row = rows[meta["shard"], meta["position"]]
            image = next(sample[s] for s in ("jpg", "png") if s in sample)
            assert (sample["txt"].decode(), hashlib.sha256(image).hexdigest()) == (row["caption"], row["sha256"])
            assert meta["clip_score"] == pytest.approx(row["clip_score"])
            written += 1
    sizes = json.loads((output / "sizes.json").read_text())
    assert written == len(kept) == sum(sizes.values()) > 0
    return written


def test_samples_are_taken_at_their_scored_position_in_tars_of_any_layout(crawl, tmp_path):
    """GNU tar's ``./KEY.EXT`` members, and a key that appears twice: the cut between the twins' scores keeps the
    better twin, and the one written is that twin, with its own caption; what is written is what is kept."""
    _, pool, scores = crawl
    table = {(row["shard"], row["position"]): row for part in read_index(str(scores)).parts
             for row in read_part_table(str(scores), part).to_pylist()}
    twins = sorted((row for row in table.values() if row["key"] == "twin"), key=lambda row: row["clip_score"])
    assert len(twins) == 2 and twins[0]["clip_score"] < twins[1]["clip_score"]
    assert {row["key"] for row in table.values() if row["shard"] == "00000"} == {f"./crawl{i:04d}" for i in range(12)}
    floor = (twins[0]["clip_score"] + twins[1]["clip_score"]) / 2
    result = curate(str(pool), str(scores), str(tmp_path / "out"), _config(min_clip_score=floor))
    assert result.shards > 0
    written = _assert_each_written_sample_is_its_scored_row(tmp_path / "out", pool, scores)
    assert written == result.selection.kept
    kept = {(row["shard"], row["position"]) for row in pq.read_table(tmp_path / "out" / KEPT_FILE).to_pylist()
            if row["kept"]}
    assert ("00002", twins[1]["position"]) in kept and ("00002", twins[0]["position"]) not in kept
    assert any(shard == "00000" for shard, _ in kept)


def test_filters_that_read_embeddings_remove_the_sample_at_its_position_and_take_an_empty_part(crawl, untrained_export,
                                                                                                tmp_path, capsys):
    """00002's first image does not decode, so its rows start at position 1: SemDeDup removes one of the two
    copies of one picture (not the sample before it); a shard in which nothing decodes is a part without rows that
    SemDeDup, decontamination and the target filter take as one (not numpy's words)."""
    pool, scores = _copy(crawl, tmp_path)
    write_tar(pool / "00003.tar", [(f"bad{i}", b"\x89PNG broken", "nothing") for i in range(3)])
    sizes = json.loads((pool / "sizes.json").read_text()) | {"00003.tar": 3}
    (pool / "sizes.json").write_text(json.dumps(sizes))
    score(ScoreRequest(str(pool), _model(untrained_export), str(scores), workers=0, progress=False))
    index = read_index(str(scores))
    assert [part.rows for part in index.parts] == [12, 12, 11, 0]
    _spread_embeddings(scores)  # the untrained model embeds every picture within 1e-5 of the others
    result = curate(str(pool), str(scores), str(tmp_path / "dedup"), _config(semantic_dedup_eps=0.01,
                                                                                semantic_dedup_clusters=1))
    removed = [(row["key"], row["position"]) for row in pq.read_table(tmp_path / "dedup" / KEPT_FILE).to_pylist()
               if not row["kept"]]
    assert removed in ([("copy-a", 5)], [("copy-b", 9)]), removed
    assert result.selection.rows == 35
    reference = tmp_path / "reference" / "train" / "drawn"
    reference.mkdir(parents=True)
    for i in range(3):
        (reference / f"{i}.png").write_bytes(picture(2 * i + 1, (64, 64)))
    for setting in ({"decontaminate": "[tuxpaint]"}, {"target_images": str(tmp_path / "reference")}):
        output = tmp_path / next(iter(setting))
        done = cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", output, "--model",
                   str(untrained_export), "--device", "cpu",
                   *[f"--set=curation.{key}={value}" for key, value in setting.items()])
        assert done.code == 0, done.err
        assert sum(json.loads((output / "sizes.json").read_text()).values()) > 0


def _spread_embeddings(scores: Path) -> None:
    """Every part's image embeddings replaced by random unit vectors (pairwise cosines far below 0.99), the two
    copies of one picture (copy-a, copy-b) given one vector; the records and the index rewritten to match."""
    from functools import partial

    import numpy as np

    from cloob_core.curation.score_table import PartRecord, ScoreIndex, read_part_embeddings, write_index, write_part

    rng = np.random.default_rng(0)
    index = read_index(str(scores))
    records = []
    for part in index.parts:
        table = read_part_table(str(scores), part)
        _, text = read_part_embeddings(str(scores), part)
        image = rng.standard_normal((part.rows, part.width)).astype(np.float32)  # (a part without rows: 0 x 0)
        keys = table.column("key").to_pylist()
        if "copy-a" in keys:
            image[keys.index("copy-b")] = image[keys.index("copy-a")]
        image /= np.linalg.norm(image, axis=1, keepdims=True) if part.rows else 1
        records.append(write_part(str(scores), partial(PartRecord, part.name, part.shard_size, part.shard_version,
                                                       part.rows, part.unreadable, part.width, part.model,
                                                       facts=part.facts),
                                  table, image, text))
    write_index(str(scores), ScoreIndex(index.model, index.shards_fingerprint, index.embedding_width, records))


def test_a_shard_storage_does_not_give_fails_the_run_and_is_scored_on_the_next(crawl, untrained_export, tmp_path,
                                                                              s3_bucket, fault_proxy, monkeypatch,
                                                                              capsys):
    """Every GET of one shard answers 503: scoring exits 1 naming it, it has no part and there is no index; the
    next run scores that shard alone (a body cut half way on the way is read on from where it stopped), and
    curate on S3 names the object when its reads fail for good."""
    _, pool, _ = crawl
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    bucket = f"s3://{s3_bucket}"
    storage.upload_tree(pool, f"{bucket}/pool")
    fault_proxy.add("slowdown", method="GET", key="pool/00001.tar", times=None)
    done = cli(capsys, "data", "score", "--shards", f"{bucket}/pool", "--output", f"{bucket}/scores", "--model",
               str(untrained_export), "--device", "cpu", "--workers", "0", "--no-progress")
    line = done.error_line()
    assert done.code == 1 and "1 of this run's 3 shard(s) could not be read from storage" in line, done.err
    assert f"{bucket}/pool/00001.tar" in line and "run the same command again" in line
    assert not storage.exists(f"{bucket}/scores/parts/00001.json")
    assert not storage.exists(f"{bucket}/scores/scores.json")
    fault_proxy.clear()
    fault_proxy.add("cut-body", method="GET", key="pool/00001.tar", times=1)
    again = score(ScoreRequest(f"{bucket}/pool", _model(untrained_export), f"{bucket}/scores", workers=0,
                               progress=False))
    assert (again.scored, again.owned) == (1, 3) and again.index is not None
    assert again.index.rows == read_index(str(crawl[2])).rows == 35
    assert any("body cut" in what for _, path, what in fault_proxy.log if "00001.tar" in path)
    fault_proxy.add("cut-body", method="GET", key="pool/00002.tar", times=None)
    done = cli(capsys, "data", "curate", "--shards", f"{bucket}/pool", "--scores", f"{bucket}/scores", "--output",
               tmp_path / "out")
    line = done.error_line()
    assert done.code == 2 and f"{bucket}/pool/00002.tar: reading it failed 2 times" in line, line
    assert "AWS_MAX_ATTEMPTS sets the tries" in line


def test_a_deleted_part_is_scored_again_by_the_remedy_curate_prints(crawl, untrained_export, tmp_path, capsys):
    pool, scores = _copy(crawl, tmp_path)
    score(ScoreRequest(str(pool), _model(untrained_export), str(scores), workers=0, progress=False))  # the copy's
    Path(part_file(str(scores), "00001", ".parquet")).unlink()
    done = cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", tmp_path / "out")
    line = done.error_line()
    assert done.code == 2 and "00001.parquet is missing" in line and "into the same --output" in line, line
    again = score(ScoreRequest(str(pool), _model(untrained_export), str(scores), workers=0, progress=False))
    assert (again.scored, again.index is not None) == (1, True)
    cut = Path(part_file(str(scores), "00002", ".npz"))
    cut.write_bytes(cut.read_bytes()[:-64])  # cut after its record was written: its size no longer matches
    assert score(ScoreRequest(str(pool), _model(untrained_export), str(scores), workers=0, progress=False)).scored == 1
    assert cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", tmp_path / "out").code == 0


def _numeric_settings() -> list[tuple[str, type]]:
    """Every numeric setting of the configuration, as ``section.key`` (nested sections' keys dotted)."""
    from pydantic import BaseModel

    from cloob_core.config import CloobConfig

    found: list[tuple[str, type]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            kinds = [field.annotation, *typing.get_args(field.annotation)]
            if typing.get_origin(field.annotation) in (list, dict, tuple):
                continue  # a list of sections (train.sources): each checked as its section is
            section = next((kind for kind in kinds if isinstance(kind, type) and issubclass(kind, BaseModel)), None)
            if section is not None:
                walk(section, f"{prefix}{name}.")
            elif int in kinds or float in kinds:
                found.append((f"{prefix}{name}", float if float in kinds else int))

    walk(CloobConfig, "")
    return found


def test_every_numeric_setting_is_bounded_by_what_the_code_computes_with_at_config_time(capsys):
    settings = _numeric_settings()
    assert len(settings) > 60 and ("objective.start_limit_factor", float) in settings
    for key, kind in settings:
        value = "1e308" if kind is float else str(10**30)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(overrides=[f"{key}={value}"])
    done = cli(capsys, "config", "--set", "objective.start_limit_factor=1e308")
    assert done.code == 2 and "objective.start_limit_factor" in done.error_line()


def test_the_line_names_the_setting_and_says_when_the_pool_is_empty(crawl, untrained_export, tmp_path, capsys):
    _, pool, scores = crawl
    for setting, named in (("--set=curation.languages=[zz]", "curation.languages removed the most"),
                           ("--set=curation.near_duplicates=true", None),
                           ("--set=curation.min_caption_words=50", "curation.min_caption_words removed the most")):
        done = cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", tmp_path / "o",
                   setting)
        if named is None:
            assert done.code == 0, done.err
            shutil.rmtree(tmp_path / "o")
            continue
        assert done.code == 2 and named in done.error_line(), done.err
    done = cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", tmp_path / "d",
               "--model", str(untrained_export), "--device", "cpu", "--set=curation.decontaminate=[tuxpaint]",
               "--set=curation.decontaminate_bits=16", "--set=curation.decontaminate_min_cosine=0",
               "--set=curation.decontaminate_min_similarity=null")
    assert done.code == 2 and "curation.decontaminate removed the most" in done.error_line(), done.err
    empty = tmp_path / "empty"
    empty.mkdir()
    write_tar(empty / "00000.tar", [(f"bad{i}", b"GIF89a broken", "nothing") for i in range(2)])
    (empty / "sizes.json").write_text(json.dumps({"00000.tar": 2}))
    score(ScoreRequest(str(empty), _model(untrained_export), str(tmp_path / "empty-scores"), workers=0,
                       progress=False))
    done = cli(capsys, "data", "curate", "--shards", empty, "--scores", tmp_path / "empty-scores", "--output",
               tmp_path / "e", "--set=curation.top_fraction=0.5")
    assert done.code == 2 and f"the pool {empty} is empty" in done.error_line(), done.err


def test_a_full_disk_under_curate_names_the_file_it_was_writing(crawl, tmp_path, small_disk, capsys):
    _, pool, scores = crawl
    output = small_disk(24 * 1024) / "curated"
    done = cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", output,
               "--set=curation.top_fraction=1.0")
    line = done.error_line()
    assert done.code == 2 and line.startswith(f"cloob: no space left on device writing {output}/"), line


def test_every_removal_says_why_in_the_kept_table(crawl, tmp_path):
    """Each reason in kept.parquet comes with its evidence (issue 79, point 7): the cut and the rank, the language
    and its confidence, the words, the shape, the better-scored sample a duplicate copies."""
    import re

    _, pool, scores = crawl
    curate(str(pool), str(scores), str(tmp_path / "o"),
           _config(top_fraction=0.7, languages="[en]", min_language_confidence=0.5, min_caption_words=2,
                   near_duplicates="true", max_aspect_ratio=1.6))
    rows = pq.read_table(tmp_path / "o" / KEPT_FILE).to_pylist()
    removed = [row for row in rows if not row["kept"]]
    assert removed and all(row["evidence"] == [] for row in rows if row["kept"])
    patterns = {"top_fraction": r"clip_score -?\d\.\d{4}: rank [\d,]+ of 35, below the top 25",
                "language": r"language [a-z]{2,3} \(confidence (0\.[5-9]\d|1\.00)\), not en",
                "min_caption_words": r"1 word\(s\), fewer than 2",
                "max_aspect_ratio": r"\d+x\d+: aspect \d\.\d\d > 1\.6",
                "near_duplicate": r"the same hash as copy-[ab] \(better scored\)"}
    seen = set()
    for row in removed:
        assert len(row["evidence"]) == len(row["reasons"]), row
        for reason, evidence in zip(row["reasons"], row["evidence"], strict=True):
            assert re.fullmatch(patterns[reason], evidence), (reason, evidence)
            seen.add(reason)
    assert seen == set(patterns)
    duplicate = next(row for row in removed if "near_duplicate" in row["reasons"])
    assert duplicate["key"] in ("copy-a", "copy-b") and duplicate["key"] not in duplicate["evidence"][0]


def test_the_command_line_takes_lists_as_a_user_writes_them_and_says_what_it_did(crawl, tmp_path, capsys):
    """Issue 79, point 10: `--set curation.languages=en` and `--languages en,de` are lists of one and two
    languages, --help says the flag repeats; the lines say the curated shards' size against the pool's, and the
    report names the pool and the scorer's fingerprint."""
    _, pool, scores = crawl
    for flags in (["--set", "curation.languages=en"], ["--languages", "en,de"], ["--languages", "en",
                                                                                 "--languages", "de"]):
        done = cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", tmp_path / "o",
                   *flags, "--set", "curation.min_language_confidence=0.5", "--set", "preprocess.shard_size=7")
        assert done.code == 0, done.err
        report = json.loads((tmp_path / "o" / "curation_report.json").read_text())
        assert report["settings"]["languages"] == (["en"] if flags[1] == "curation.languages=en" else ["de", "en"])
        shutil.rmtree(tmp_path / "o")
    assert "of up to 7 (preprocess.shard_size; the pool's held up to 12)" in done.out
    assert report["pool"] == str(pool) and report["scorer"]["fingerprint"] == read_index(str(scores)).model.fingerprint
    with pytest.raises(SystemExit):
        cli(capsys, "data", "curate", "--help")
    assert "Repeat the flag, or separate items by commas" in " ".join(capsys.readouterr().out.split())


def test_a_min_image_side_above_every_stored_side_says_the_download_resized_them(crawl, tmp_path, capsys):
    _, pool, scores = crawl
    done = cli(capsys, "data", "curate", "--shards", pool, "--scores", scores, "--output", tmp_path / "o",
               "--set", "curation.min_image_side=300")
    line = done.error_line()
    assert done.code == 2 and "curation.min_image_side removed the most" in line, done.err
    assert "is above every stored image's shorter side (at most" in line and "preprocess.image_size" in line
