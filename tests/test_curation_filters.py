"""The curation filters on a score table with a known truth (written directly, as `cloob data score` writes one):
what each removes and keeps, their combination, and the kept table."""

from __future__ import annotations

import itertools
import math
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cloob_core.config import CurationConfig, EngineConfig
from cloob_core.curation.filters import filters_of
from cloob_core.curation.filters.near_duplicates import bands
from cloob_core.curation.pool import open_pool
from cloob_core.curation.score_table import (
    FACTS,
    ModelStamp,
    PartRecord,
    ScoreIndex,
    ScoresError,
    part_file,
    schema,
    write_index,
    write_part,
)
from cloob_core.curation.selection import select, write_kept_table
from cloob_core.data.engine import connect
from cloob_core.data.shard_files import shard_list, shards_fingerprint

STAMP = ModelStamp("0123456789abcdef", "cloob-tiny", "fp32")
BASE_HASH = 0x9F3A_5C71_0E2B_D468


def _row(key: str, **facts) -> dict:
    row = {"key": key, "url": f"http://example.com/{key}.jpg", "caption": "a photo of a thing on a table",
           "sha256": "0" * 64, "clip_score": 0.3, "caption_words": 7, "caption_chars": 30, "language": "en",
           "language_confidence": 0.9, "phash": int(key) * 0x0101_0101_0101_0101 % (1 << 64), "width": 256,
           "height": 256}
    return row | facts


def _write_pool(folder: Path, parts: dict[str, list[dict]], width: int = 4) -> tuple[str, str]:
    """Shards (their bytes do not matter here) and their scores: one part per shard, in the rows' order; a row's
    ``embedding`` (else zeros) is its image embedding."""
    shards, scores = folder / "shards", folder / "scores"
    shards.mkdir(parents=True)
    records = []
    for name, rows in parts.items():
        (shards / f"{name}.tar").write_bytes(name.encode() * 100)
        columns = {column: [row.get(column) for row in rows] for column in schema().names}
        columns["shard"] = [name] * len(rows)
        columns["position"] = list(range(len(rows)))
        table = pa.Table.from_pydict(columns, schema=schema())
        embeddings = np.array([row.get("embedding", np.zeros(width)) for row in rows], np.float16)
        records.append(write_part(str(scores), partial(PartRecord, name, None, None, len(rows), 0, width, STAMP,
                                                                    facts=FACTS),
                                  table, embeddings, embeddings))
    urls, _ = shard_list(str(shards))
    write_index(str(scores), ScoreIndex(STAMP, shards_fingerprint(urls), width, records))
    return str(shards), str(scores)


def _kept_keys(folder: Path, parts: dict[str, list[dict]], width: int = 4, **settings) -> tuple[set[str], object]:
    shards, scores = _write_pool(folder, parts, width)
    with connect(EngineConfig()) as connection:
        pool = open_pool(shards, scores, connection)
        selection = select(pool, filters_of(CurationConfig(**settings)))
        kept = {key for (key,) in connection.execute(
            "SELECT key FROM scores WHERE (shard, position) NOT IN (SELECT (shard, position) FROM removed)"
        ).fetchall()}
    assert len(kept) == selection.kept
    return kept, selection


def test_a_score_floor_removes_what_is_below_it_and_a_nan(tmp_path):
    parts = {"00000": [_row("1", clip_score=0.1), _row("2", clip_score=0.28), _row("3", clip_score=float("nan"))],
             "00001": [_row("4", clip_score=0.2799), _row("5", clip_score=0.9)]}
    kept, selection = _kept_keys(tmp_path, parts, min_clip_score=0.28)
    assert kept == {"2", "5"}
    assert selection.removed_by == {"min_clip_score": 3}


@pytest.mark.parametrize("fraction", [0.3, 0.5, 1.0, 0.01])
def test_the_top_fraction_is_cut_over_every_part_at_once_with_ties_broken_by_place(tmp_path, fraction):
    rng = np.random.default_rng(0)
    scores = np.round(rng.uniform(0, 1, 60), 1)  # many ties
    parts = {f"0000{p}": [_row(str(p * 20 + i), clip_score=float(scores[p * 20 + i])) for i in range(20)]
             for p in range(3)}
    kept, _ = _kept_keys(tmp_path, parts, top_fraction=fraction)
    order = sorted(range(60), key=lambda i: (-scores[i], i // 20, i % 20))  # score, then shard, then position
    assert kept == {str(i) for i in order[:math.ceil(fraction * 60)]}


def test_basic_filtering_removes_by_language_words_side_and_aspect(tmp_path):
    parts = {"00000": [
        _row("1"),
        _row("2", language="de"),
        _row("3", language_confidence=0.3),
        _row("4", caption_words=2),
        _row("5", width=199, height=400),
        _row("6", width=700, height=200),  # 3.5 : 1
        _row("7", width=600, height=200),  # 3 : 1, kept
        _row("8", language="und", language_confidence=0.0),
        _row("9", language="eo", language_confidence=0.49),  # another language, not surely: kept
        _row("10", language="zh", language_confidence=0.5),
    ]}
    kept, selection = _kept_keys(tmp_path, parts, languages=["en"], min_language_confidence=0.5,
                                 min_caption_words=3, min_image_side=200, max_aspect_ratio=3.0)
    assert kept == {"1", "3", "7", "8", "9"}
    assert selection.removed_by == {"language": 2, "max_aspect_ratio": 1, "min_caption_words": 1,
                                    "min_image_side": 1}
    kept, _ = _kept_keys(tmp_path / "any", parts, languages=["en"])  # no floor: every other identification
    assert kept == {"1", "3", "4", "5", "6", "7"}


def _flip(value: int, *bits: int) -> int:
    for bit in bits:
        value ^= 1 << bit
    return value


def test_near_duplicates_keep_the_best_scored_image_of_each_group(tmp_path):
    near = [_flip(BASE_HASH, 3), _flip(BASE_HASH, 10, 40), _flip(BASE_HASH, 1, 33, 63)]  # 1, 2, 3 bits away
    far = _flip(BASE_HASH, 0, 9, 18, 27, 36)  # 5 bits away
    parts = {
        "00000": [_row("1", phash=BASE_HASH, clip_score=0.5), _row("2", phash=near[0], clip_score=0.6),
                  _row("3", phash=far, clip_score=0.1)],
        "00001": [_row("4", phash=near[1], clip_score=0.4), _row("5", phash=near[2], clip_score=0.7),
                  _row("6", phash=BASE_HASH, clip_score=0.7),  # an exact copy of 1, better scored than it
                  _row("7", phash=BASE_HASH ^ (0xFFFF << 24), clip_score=0.2)],  # 16 bits away
    }
    kept, selection = _kept_keys(tmp_path / "3", parts, near_duplicates=True, near_duplicate_bits=3)
    # 1, 2, 4, 5 and 6 are within 3 bits of one another's group: 5 and 6 tie at 0.7 and 5 (shard 00001,
    # position 1) comes first; 3 is 5 bits from 1 but 2 + 3 from 2 ... all pairs with 3 exceed 3 bits
    assert kept == {"5", "3", "7"}
    assert selection.removed_by == {"near_duplicate": 4}
    exact, _ = _kept_keys(tmp_path / "0", parts, near_duplicates=True, near_duplicate_bits=0)
    assert exact == {"2", "3", "4", "5", "6", "7"}  # only 1, the exact copy of the better-scored 6


def test_semantic_duplicates_keep_the_best_scored_of_each_group_and_distinct_images_stay(tmp_path):
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(12, 32))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)

    def near(centre: np.ndarray) -> np.ndarray:  # cosine about 0.995 to its centre
        jitter = rng.normal(size=32) * 0.015
        vector = centre + jitter
        return vector / np.linalg.norm(vector)

    groups = {0: [0.2, 0.5, 0.4], 1: [0.3, 0.3]}  # scores of each group's copies; 1's tie: place decides
    rows, truth = [], set()
    for group, scores in groups.items():
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        for i, score in enumerate(scores):
            key = str(len(rows))
            rows.append(_row(key, clip_score=score, embedding=near(centres[group])))
            truth |= {key} if i == best else set()
    for centre in centres[2:]:  # ten distinct images
        key = str(len(rows))
        rows.append(_row(key, clip_score=0.1, embedding=centre))
        truth.add(key)
    parts = {"00000": rows[:7], "00001": rows[7:]}
    kept, selection = _kept_keys(tmp_path / "a", parts, width=32, semantic_dedup_eps=0.03,
                                 semantic_dedup_clusters=4)
    assert kept == truth and selection.removed_by == {"semantic_duplicate": 3}
    again, _ = _kept_keys(tmp_path / "b", parts, width=32, semantic_dedup_eps=0.03, semantic_dedup_clusters=4)
    assert again == kept


def test_more_clusters_than_samples_is_one_line(tmp_path):
    from cloob_core.curation.clusters import TooFewSamples

    with pytest.raises(TooFewSamples, match="semantic_dedup_clusters 5 is more than the pool's 2 samples"):
        _kept_keys(tmp_path, {"00000": [_row("1"), _row("2")]}, semantic_dedup_eps=0.05, semantic_dedup_clusters=5)


def test_the_bands_tile_the_64_bits():
    for bits in range(17):
        found = bands(bits)
        assert len(found) == bits + 1
        assert sum(width for _, width in found) == 64 and found[0][0] == 0
        assert all(a + w == b for (a, w), (b, _) in itertools.pairwise(found))


def test_a_sample_is_kept_only_when_every_filter_keeps_it_and_the_kept_table_says_why(tmp_path):
    parts = {"00000": [_row("3", clip_score=0.1, language="fr"), _row("1", clip_score=0.5),
                       _row("2", clip_score=0.5, caption_words=1)]}
    shards, scores = _write_pool(tmp_path, parts)
    settings = CurationConfig(min_clip_score=0.2, languages=["en"], min_caption_words=2)
    with connect(EngineConfig()) as connection:
        pool = open_pool(shards, scores, connection)
        selection = select(pool, filters_of(settings))
        write_kept_table(pool, tmp_path / "kept.parquet")
        write_kept_table(pool, tmp_path / "again.parquet")
    assert (selection.kept, selection.removed) == (1, 2)
    assert selection.overlaps == {("language", "min_clip_score"): 1}
    assert selection.most_removing() == "language"  # 1 each, ties by name
    rows = pq.read_table(tmp_path / "kept.parquet").to_pylist()
    assert [(r["key"], r["kept"], r["reasons"]) for r in rows] == [
        ("1", True, []), ("2", False, ["min_caption_words"]), ("3", False, ["language", "min_clip_score"])]
    assert (tmp_path / "kept.parquet").read_bytes() == (tmp_path / "again.parquet").read_bytes()


def test_scores_of_other_shards_or_a_damaged_part_are_one_line(tmp_path):
    parts = {"00000": [_row("1")], "00001": [_row("2")]}
    shards, scores = _write_pool(tmp_path, parts)
    (Path(shards) / "00001.tar").write_bytes(b"rebuilt since")
    with connect(EngineConfig()) as connection, pytest.raises(ScoresError, match="made for other shards"):
        open_pool(shards, scores, connection)
    (Path(shards) / "00001.tar").write_bytes(b"00001" * 100)
    table = Path(part_file(scores, "00001", ".parquet"))
    table.write_bytes(table.read_bytes() + b"\0")
    with connect(EngineConfig()) as connection, pytest.raises(ScoresError, match=r"00001\.parquet does not match"):
        open_pool(shards, scores, connection)
    table.unlink()
    with connect(EngineConfig()) as connection, pytest.raises(ScoresError, match=r"00001\.parquet is missing"):
        open_pool(shards, scores, connection)
