"""The packaged captioned set as committed: real pairs from both sources, small, licensed, and a held-out split
that shares no caption with the training split."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from PIL import Image

from cloob_core.data.captioned import COLUMNS, SOURCES, load_captioned

FOLDER = Path(__file__).resolve().parents[1] / "cloob_core" / "data" / "captioned"


def test_the_set_is_real_pairs_from_both_sources_and_small():
    pairs = load_captioned()
    assert tuple(pairs.columns) == COLUMNS
    assert len(pairs) >= 1500 and set(pairs["source"]) == set(SOURCES)
    assert (FOLDER / "pairs.parquet").stat().st_size <= 20e6
    assert pairs["caption"].str.strip().str.len().gt(0).all()
    assert pairs["key"].is_unique
    assert len({hashlib.sha256(image).digest() for image in pairs["image"]}) == len(pairs)  # no image twice


def test_no_held_out_caption_is_ever_trained_on_and_every_large_category_is_held_out_from():
    train, test = load_captioned("train"), load_captioned("test")
    assert set(train["caption"]).isdisjoint(test["caption"])
    assert 0.15 < len(test) / (len(train) + len(test)) < 0.25
    captions = load_captioned().groupby(["source", "category"])["caption"].nunique()
    held = test.groupby(["source", "category"])["caption"].nunique()
    for stratum, count in captions.items():
        if count >= 5:
            assert held.get(stratum, 0) >= 1, stratum


def test_the_images_are_small_rgb_jpegs():
    for row in load_captioned().sample(200, random_state=0).itertuples():
        with Image.open(io.BytesIO(row.image)) as image:
            assert image.format == "JPEG" and image.mode == "RGB" and image.size == (row.width, row.height)
            assert min(image.size) <= 128


def test_the_licences_ship_with_the_data():
    names = {path.name for path in (FOLDER / "LICENSES").iterdir()}
    assert names == {"GPL-2.txt", "tuxpaint-stamps.copyright", "emojibase-data.LICENSE", "fluent-emoji-3d.LICENSE"}
    assert "GNU GENERAL PUBLIC LICENSE" in (FOLDER / "LICENSES" / "GPL-2.txt").read_text()
    for name in ("emojibase-data.LICENSE", "fluent-emoji-3d.LICENSE"):
        assert "Permission is hereby granted" in (FOLDER / "LICENSES" / name).read_text()
