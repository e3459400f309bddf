"""`cloob data score`: every sample of a pool scored with its facts, the embeddings in the table's row order, a
part per shard, the index written last; a killed, grown or partitioned run scores only what lacks a part."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cloob_core.curation.facts import caption_language, caption_words, perceptual_hash
from cloob_core.curation.score import ScoreRequest, score
from cloob_core.curation.score_table import (
    COLUMNS,
    INDEX_FILE,
    ScoresError,
    part_file,
    read_index,
    read_part_embeddings,
    read_part_table,
)
from cloob_core.data.manifest import Partition
from cloob_core.model.source import ModelSource


def _pool(captioned_train_shards: Path, folder: Path, names: list[str]) -> Path:
    """Some shards of the packaged captioned set, with their sizes.json."""
    folder.mkdir(parents=True)
    sizes = json.loads((captioned_train_shards / "sizes.json").read_text())
    for name in names:
        shutil.copy(captioned_train_shards / f"{name}.tar", folder / f"{name}.tar")
    (folder / "sizes.json").write_text(json.dumps({f"{name}.tar": sizes[f"{name}.tar"] for name in names}))
    return folder


def _score(pool: Path, output: Path, model: Path, **options) -> object:
    return score(ScoreRequest(str(pool), ModelSource(model=str(model), device="cpu"), str(output), progress=False,
                              workers=options.pop("workers", 0), batch_size=options.pop("batch_size", 100),
                              **options))


@pytest.fixture(scope="module")
def scored(captioned_train_shards, untrained_export, tmp_path_factory):
    """Two shards scored (one worker); read-only."""
    root = tmp_path_factory.mktemp("scored")
    pool = _pool(captioned_train_shards, root / "pool", ["00000", "00001"])
    result = _score(pool, root / "scores", untrained_export, workers=1)
    return pool, root / "scores", result


def _members(tar: Path) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(tar) as archive:
        for member in archive.getmembers():
            key, _, suffix = member.name.partition(".")
            samples.setdefault(key, {})[suffix] = archive.extractfile(member).read()
    return samples


def test_every_sample_is_scored_with_its_facts_and_its_embeddings_in_the_same_order(scored):
    pool, scores, result = scored
    sizes = json.loads((pool / "sizes.json").read_text())
    index = read_index(str(scores))
    assert result.index == index and result.scored == 2 and result.unreadable == 0
    assert [part.name for part in index.parts] == ["00000", "00001"]
    assert index.rows == sum(sizes.values()) == result.rows
    assert index.embedding_width == 64  # cloob-tiny's
    for part in index.parts:
        table = read_part_table(str(scores), part)
        assert tuple(table.column_names) == COLUMNS
        image, text = read_part_embeddings(str(scores), part)
        assert image.dtype == np.float16 and image.shape == (part.rows, 64)
        # the score is the cosine of the two unit-norm embeddings stored in the same row
        stored = (image.astype(np.float32) * text.astype(np.float32)).sum(axis=1)
        assert np.abs(stored - table["clip_score"].to_numpy()).max() < 2e-3
        assert np.allclose(np.linalg.norm(image.astype(np.float32), axis=1), 1, atol=2e-3)
        samples = _members(pool / f"{part.name}.tar")
        rows = table.to_pylist()
        assert [row["key"] for row in rows] == sorted(samples)  # the shard's order
        assert [row["position"] for row in rows] == list(range(part.rows))
        for row in rows[:40]:
            sample = samples[row["key"]]
            assert row["sha256"] == hashlib.sha256(sample["jpg"]).hexdigest()
            decoded = Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
            assert (row["width"], row["height"]) == decoded.size
            assert row["phash"] == perceptual_hash(decoded)
            caption = sample["txt"].decode()
            assert (row["caption"], row["caption_words"], row["caption_chars"]) == (caption, caption_words(caption),
                                                                                   len(caption))
            assert row["url"] == json.loads(sample["json"])["url"]
            assert 0 <= row["language_confidence"] <= 1


def test_the_language_is_found_offline_and_text_without_letters_has_none():
    assert caption_language("ein brauner Hund läuft über die grüne Wiese")[0] == "de"
    assert caption_language("a brown dog runs across the green meadow")[0] == "en"
    assert caption_language("un chien marron court dans la prairie verte")[0] == "fr"
    for blank in ("", "   ", "12345 - 678"):
        assert caption_language(blank) == ("und", 0.0)


def test_the_perceptual_hash_sees_a_re_encoding_and_a_resize_as_near_and_another_image_as_far(scored):
    pool, _, _ = scored
    samples = list(_members(pool / "00000.tar").values())
    photo = Image.open(io.BytesIO(samples[0]["jpg"])).convert("RGB")
    buffer = io.BytesIO()
    photo.resize((photo.width // 2, photo.height // 2)).save(buffer, format="JPEG", quality=60)
    again = Image.open(io.BytesIO(buffer.getvalue()))

    def bits(a: int, b: int) -> int:
        return bin(a ^ b).count("1")

    assert bits(perceptual_hash(photo), perceptual_hash(again)) <= 6
    others = [Image.open(io.BytesIO(sample["jpg"])).convert("RGB") for sample in samples[1:21]]
    assert min(bits(perceptual_hash(photo), perceptual_hash(other)) for other in others) > 6


def test_a_killed_run_scores_only_the_shard_it_lacks(scored, untrained_export, tmp_path):
    pool, scores, _ = scored
    copy = tmp_path / "scores"
    shutil.copytree(scores, copy)
    kept = Path(part_file(str(copy), "00000", ".json")).read_bytes()
    (copy / INDEX_FILE).unlink()  # killed after the first part's record, before the second's and the index
    Path(part_file(str(copy), "00001", ".json")).unlink()
    result = _score(pool, copy, untrained_export)
    assert (result.owned, result.scored) == (2, 1)
    assert Path(part_file(str(copy), "00000", ".json")).read_bytes() == kept
    again, before = read_index(str(copy)), read_index(str(scores))
    assert [(p.name, p.rows) for p in again.parts] == [(p.name, p.rows) for p in before.parts]
    rescored, first = (read_part_table(str(folder), index.parts[1]).to_pylist()
                       for folder, index in ((copy, again), (scores, before)))
    assert [row["key"] for row in rescored] == [row["key"] for row in first]
    # other batches (in this process, not a worker's): the same scores but for the last bits of a sum
    assert max(abs(a["clip_score"] - b["clip_score"]) for a, b in zip(rescored, first, strict=True)) < 1e-5


def test_a_part_of_an_earlier_facts_definition_is_refused_by_curate_and_scored_again(scored, untrained_export,
                                                                                       tmp_path):
    """A part scored before the facts were versioned (its record without ``facts``: the whitespace words, lid.176
    on the raw caption) holds other languages and words than the filters now mean: curate names it in one line,
    and scoring into the same folder scores that part again, not the other."""
    from cloob_core.config import EngineConfig
    from cloob_core.curation.pool import open_pool
    from cloob_core.data.engine import connect

    pool, scores, _ = scored
    copy = tmp_path / "scores"
    shutil.copytree(scores, copy)
    record = Path(part_file(str(copy), "00001", ".json"))
    data = json.loads(record.read_text())
    del data["facts"]
    record.write_text(json.dumps(data))
    index = json.loads((copy / INDEX_FILE).read_text())
    del index["parts"][1]["facts"]
    (copy / INDEX_FILE).write_text(json.dumps(index))
    refused = r"scored by an earlier cloob: its facts .* are facts/1, now facts/2"
    with connect(EngineConfig()) as connection, pytest.raises(ScoresError, match=refused):
        open_pool(str(pool), str(copy), connection)
    kept = Path(part_file(str(copy), "00000", ".json")).read_bytes()
    result = _score(pool, copy, untrained_export)
    assert (result.owned, result.scored) == (2, 1)
    assert Path(part_file(str(copy), "00000", ".json")).read_bytes() == kept
    assert [part.facts for part in read_index(str(copy)).parts] == ["facts/2", "facts/2"]
    with connect(EngineConfig()) as connection:
        assert open_pool(str(pool), str(copy), connection).rows == read_index(str(scores)).rows


def test_a_grown_pool_scores_only_its_new_shard_and_a_changed_shard_again(captioned_train_shards,
                                                                         untrained_export, tmp_path):
    pool = _pool(captioned_train_shards, tmp_path / "pool", ["00000", "00001"])
    output = tmp_path / "scores"
    assert _score(pool, output, untrained_export).scored == 2
    sizes = json.loads((captioned_train_shards / "sizes.json").read_text())
    shutil.copy(captioned_train_shards / "00002.tar", pool / "00002.tar")
    (pool / "sizes.json").write_text(json.dumps({f"0000{i}.tar": sizes[f"0000{i}.tar"] for i in range(3)}))
    result = _score(pool, output, untrained_export)
    assert (result.owned, result.scored) == (3, 1)
    assert [part.name for part in read_index(str(output)).parts] == ["00000", "00001", "00002"]
    shutil.copy(captioned_train_shards / "00003.tar", pool / "00001.tar")  # rebuilt in place: other samples
    (pool / "sizes.json").write_text(json.dumps({"00000.tar": sizes["00000.tar"], "00001.tar": sizes["00003.tar"],
                                                 "00002.tar": sizes["00002.tar"]}))
    result = _score(pool, output, untrained_export)
    assert result.scored == 1
    keys = read_part_table(str(output), read_index(str(output)).parts[1]).column("key").to_pylist()
    assert keys == sorted(_members(captioned_train_shards / "00003.tar"))


def test_partitions_share_the_pool_and_the_one_that_scores_the_last_shard_writes_the_index(
        captioned_train_shards, untrained_export, tmp_path):
    pool = _pool(captioned_train_shards, tmp_path / "pool", ["00004", "00005", "00006"])
    first = _score(pool, tmp_path / "scores", untrained_export, partition=Partition(1, 2))
    assert (first.owned, first.scored, first.index) == (2, 2, None)  # shards 1 and 2 of 0..2
    assert not (tmp_path / "scores" / INDEX_FILE).exists()
    last = _score(pool, tmp_path / "scores", untrained_export, partition=Partition(0, 2))
    assert (last.owned, last.scored) == (1, 1) and last.index is not None
    assert [part.name for part in last.index.parts] == ["00004", "00005", "00006"]


def test_workers_sharing_one_shard_give_the_rows_of_one_process(scored, untrained_export, tmp_path):
    """One shard, two workers: each reads the tar and scores its positions; the part is written once both have
    marked the shard's end, with the rows of one process in the shard's order."""
    pool, scores, _ = scored
    single = tmp_path / "pool"
    single.mkdir()
    shutil.copy(pool / "00001.tar", single / "00001.tar")
    result = _score(single, tmp_path / "scores", untrained_export, workers=2, batch_size=32)
    index = read_index(str(scores))
    alone = read_part_table(str(tmp_path / "scores"), result.index.parts[0]).to_pylist()
    before = read_part_table(str(scores), index.parts[1]).to_pylist()
    assert [row["key"] for row in alone] == [row["key"] for row in before]
    assert max(abs(a["clip_score"] - b["clip_score"]) for a, b in zip(alone, before, strict=True)) < 1e-5
    assert result.index.parts[0].unreadable is None  # no sizes.json in this folder: not known


def test_scores_by_another_model_are_refused_in_one_line(scored, weights, tmp_path):
    pool, scores, _ = scored
    copy = tmp_path / "scores"
    shutil.copytree(scores, copy)
    done = subprocess.run([sys.executable, "-m", "cloob_core.cli", "data", "score", "--shards", str(pool),
                           "--architecture", "cloob-tiny", "--weights", str(weights), "--output", str(copy),
                           "--device", "cpu", "--workers", "0", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("cloob: ") and "holds scores by another model" in line and "new --output" in line


def test_one_model_spelled_three_ways_keeps_its_parts_and_other_activations_are_another_model(
        scored, untrained_export, tmp_path, monkeypatch):
    """The scores' model is its weights and its open_clip configuration, not how --model names it (issue 79,
    point 5): an absolute path, ``local-dir:`` of a relative one, and a copy of the folder elsewhere score
    nothing again; the same weights under another activation (quick_gelu) are another model."""
    pool, scores, _ = scored
    copy = tmp_path / "scores"
    shutil.copytree(scores, copy)
    shutil.copytree(untrained_export, tmp_path / "elsewhere" / "model")
    monkeypatch.chdir(untrained_export.parent)
    for spelling in (f"local-dir:{untrained_export.name}", f"local-dir:{tmp_path / 'elsewhere' / 'model'}",
                     str(tmp_path / "elsewhere" / "model")):
        result = score(ScoreRequest(str(pool), ModelSource(model=spelling, device="cpu"), str(copy),
                                    progress=False, workers=0))
        assert (result.owned, result.scored) == (2, 0), spelling
    other = tmp_path / "quick"
    shutil.copytree(untrained_export, other)
    config = json.loads((other / "open_clip_config.json").read_text())
    config["model_cfg"]["quick_gelu"] = True
    (other / "open_clip_config.json").write_text(json.dumps(config))
    with pytest.raises(ScoresError, match="holds scores by another model"):
        score(ScoreRequest(str(pool), ModelSource(model=f"local-dir:{other}", device="cpu"), str(copy),
                           progress=False, workers=0))


def test_a_copied_pool_keeps_its_parts_by_content_and_a_changed_shard_says_why(scored, untrained_export, tmp_path,
                                                                                caplog):
    """A pool copied elsewhere (new file times) with its scores keeps every part, its samples compared with what
    was scored (issue 79, point 6); a shard edited to the same size is scored again, the log saying how it
    differs."""
    import logging
    import os

    pool, scores, _ = scored
    copied = tmp_path / "pool"
    copied.mkdir()
    for path in pool.iterdir():
        (copied / path.name).write_bytes(path.read_bytes())  # a copy: new file times
        os.utime(copied / path.name, ns=(1_800_000_000_000_000_000,) * 2)
    copy = tmp_path / "scores"
    shutil.copytree(scores, copy)
    with caplog.at_level(logging.INFO, logger="cloob_core.curation.score"):
        result = _score(copied, copy, untrained_export)
    assert (result.owned, result.scored) == (2, 0)
    assert "its samples did not (a copy): its part is kept" in caplog.text
    caplog.clear()
    again = _score(copied, copy, untrained_export)  # the records took the new times: nothing is read again
    assert again.scored == 0 and "a copy" not in caplog.text
    tar = copied / "00001.tar"
    with tarfile.open(tar) as archive:
        caption = next(member for member in archive.getmembers() if member.name.endswith(".txt"))
    data = bytearray(tar.read_bytes())
    data[caption.offset_data] = ord("X") if data[caption.offset_data] != ord("X") else ord("Y")
    tar.write_bytes(bytes(data))  # a caption edited, the size the same
    with caplog.at_level(logging.INFO, logger="cloob_core.curation.score"):
        result = _score(copied, copy, untrained_export)
    assert result.scored == 1
    assert "00001.tar changed since it was scored (its sample" in caplog.text and "scoring it again" in caplog.text


def test_a_part_changed_after_it_was_scored_is_named_when_read(scored, tmp_path):
    _, scores, _ = scored
    copy = tmp_path / "scores"
    shutil.copytree(scores, copy)
    index = read_index(str(copy))
    table = Path(part_file(str(copy), "00001", ".parquet"))
    table.write_bytes(table.read_bytes()[:-100])
    with pytest.raises(ScoresError, match=r"00001\.parquet does not match the digest its index records"):
        read_part_table(str(copy), index.parts[1])
    Path(part_file(str(copy), "00000", ".npz")).unlink()
    with pytest.raises(ScoresError, match=r"00000\.npz is missing"):
        read_part_embeddings(str(copy), index.parts[0])


def _hub_cache(export: Path, cache: Path) -> None:
    """``export`` in a Hugging Face cache as the model cloob/tiny, pushed from it."""
    snapshot = cache / "models--cloob--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(export, snapshot)
    (cache / "models--cloob--tiny" / "refs").mkdir()
    (cache / "models--cloob--tiny" / "refs" / "main").write_text("0" * 40)


def test_a_cached_hub_model_is_read_from_the_cache_without_reaching_the_network(scored, untrained_export,
                                                                                tmp_path):
    """Without HF_HUB_OFFLINE, behind a network that takes connections and never answers (issue 79, point 10: an
    hf-hub name waited out its retries for 30 s), a cached model scores and nothing is asked of the Hub."""
    import os
    import socket
    import threading

    pool, _, _ = scored
    _hub_cache(untrained_export, tmp_path / "hub")
    silent = socket.create_server(("127.0.0.1", 0))
    asked = []

    def take() -> None:
        while True:
            try:
                connection, _ = silent.accept()
            except OSError:
                return
            asked.append(connection)  # held open, never answered

    threading.Thread(target=take, daemon=True).start()
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    env |= {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}"}
    try:
        done = subprocess.run([sys.executable, "-m", "cloob_core.cli", "data", "score", "--shards", str(pool),
                               "--model", "hf-hub:cloob/tiny", "--output", str(tmp_path / "scores"), "--device",
                               "cpu", "--workers", "0", "--no-progress"], capture_output=True, text=True, timeout=300,
                              env=env)
    finally:
        silent.close()
    assert done.returncode == 0, done.stderr
    assert not asked, f"{len(asked)} connection(s) to the Hub"
    missing = subprocess.run([sys.executable, "-m", "cloob_core.cli", "data", "score", "--shards", str(pool),
                              "--model", "hf-hub:cloob/other", "--output", str(tmp_path / "other")],
                             capture_output=True, text=True, timeout=300, env=env)
    assert missing.returncode == 2 and "not in the Hugging Face cache" in missing.stderr.strip().splitlines()[-1]


def test_an_open_clip_hub_model_scores_as_the_same_weights_in_our_export(scored, untrained_export, tmp_path):
    """`--model hf-hub:ORG/NAME` (a DFN or OpenAI CLIP where the network allows; here the Hub's cache, offline)
    is the same model as the export it was pushed from: the same fingerprint, the same scores."""
    import os

    pool, scores, _ = scored
    _hub_cache(untrained_export, tmp_path / "hub")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    done = subprocess.run([sys.executable, "-m", "cloob_core.cli", "data", "score", "--shards", str(pool),
                           "--model", "hf-hub:cloob/tiny", "--output", str(tmp_path / "hub-scores"), "--device", "cpu",
                           "--workers", "0", "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    ours, theirs = read_index(str(scores)), read_index(str(tmp_path / "hub-scores"))
    assert theirs.model.fingerprint == ours.model.fingerprint and theirs.model.architecture == "hf-hub:cloob/tiny"
    for mine, hub in zip(ours.parts, theirs.parts, strict=True):
        np.testing.assert_allclose(read_part_table(str(tmp_path / "hub-scores"), hub).column("clip_score").to_numpy(),
                                   read_part_table(str(scores), mine).column("clip_score").to_numpy(), atol=1e-6)
