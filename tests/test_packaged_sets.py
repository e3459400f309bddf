"""The packaged data sets by name: splits that never share an image or (for the captioned set) a caption, manifest
rows the download engine fetches from the package, and one-line errors for names that do not exist."""

from __future__ import annotations

import hashlib
import io
import re

import pandas as pd
import pytest
from PIL import Image

from cloob_core.config import PACKAGED_SETS, load_config
from cloob_core.data.acquire import acquire
from cloob_core.data.manifest import ManifestError
from cloob_core.data.packaged import SPLITS, URL_PATTERN, load_packaged, parse_url
from cloob_core.data.sources import packaged_frame, packaged_source
from cloob_core.evaluation.inputs import load_images


@pytest.mark.parametrize("name", PACKAGED_SETS)
def test_each_set_has_disjoint_splits_one_labelling_and_prompts_that_are_not_captions(name):
    train, test = (load_packaged(name, split) for split in SPLITS)
    assert len(train) > len(test) > 0
    assert train.classnames == test.classnames and set(test.labels) <= set(range(len(test.classnames)))
    assert {hashlib.sha256(i).digest() for i in train.images}.isdisjoint(hashlib.sha256(i).digest()
                                                                           for i in test.images)
    prompts = {t.format(c) for t in test.templates for c in test.classnames}
    assert prompts.isdisjoint(train.captions) and all(v[0] == c for v, c in zip(train.variants, train.captions,
                                                                                   strict=True))
    with Image.open(io.BytesIO(test.images[0])) as image:
        image.load()


def test_the_captioned_set_is_the_union_of_its_sources_with_their_own_classes():
    union = load_packaged("captioned", "test")
    tux, emoji = load_packaged("tuxpaint", "test"), load_packaged("fluent-emoji", "test")
    assert (len(tux.classnames), len(emoji.classnames)) == (15, 9)
    assert set(union.images) == set(tux.images) | set(emoji.images) and len(union) == len(tux) + len(emoji)
    assert set(union.classnames) == set(tux.classnames) | set(emoji.classnames)
    assert set(load_packaged("captioned", "train").captions).isdisjoint(union.captions)  # held-out captions


def test_rows_name_their_image_and_the_source_fetches_exactly_it():
    frame, source = packaged_frame("captioned", "all")
    assert len(frame) == sum(len(load_packaged("captioned", s)) for s in SPLITS)
    assert frame["url"].str.fullmatch(URL_PATTERN).all() and frame["url"].is_unique
    row = frame[frame["split"] == "test"].iloc[7]
    assert source.fetch(row["url"]).data == load_packaged("captioned", "test").images[7]
    assert parse_url(row["url"]) == ("captioned", "test", 7)
    assert packaged_source([("captioned", "test")]).fetch(row["url"]).data == source.fetch(row["url"]).data
    missing = source.fetch("packaged:captioned/test/99999")
    assert missing.data is None and missing.reason == "missing_file"


@pytest.mark.parametrize("url, message", [
    ("packaged:cifar/train/1", "no packaged data set 'cifar'; there are captioned, "),
    ("packaged:mnist/val/1", "packaged set mnist has the splits train and test, not 'val'"),
    ("packaged:mnist/train/x", "'packaged:mnist/train/x' is not packaged:NAME/SPLIT/INDEX"),
    ("packaged:mnist/train/1/2", "is not packaged:NAME/SPLIT/INDEX"),
])
def test_a_malformed_row_is_a_one_line_manifest_error(url, message):
    with pytest.raises(ManifestError, match=re.escape(message)):
        parse_url(url)
    assert not re.fullmatch(URL_PATTERN, url)


def test_acquire_lists_the_captioned_training_split_by_default(tmp_path):
    result = acquire(load_config(), str(tmp_path))
    frame = pd.read_parquet(result.manifest)
    assert result.source == "packaged captioned (train split)" and result.rows == len(frame) == 2047
    assert set(frame["split"]) == {"train"} and set(frame["source"]) == {"tuxpaint", "fluent-emoji"}


def test_evaluation_reads_a_packaged_set_with_its_captions_and_classes():
    images = load_images("fluent-emoji", "test")
    data = load_packaged("fluent-emoji", "test")
    assert images.reader.size == len(data) and images.reader.record(0).captions == (data.captions[0],)
    assert images.classnames == list(data.classnames) and images.templates == list(data.templates)
    assert images.reader.open(0).mode == "RGB"


def test_an_emoji_caption_is_its_name_with_the_keywords_the_name_lacks():
    from cloob_core.data.captioned import load_captioned

    raw = load_captioned("test")
    emoji = load_packaged("fluent-emoji", "test")
    name, keywords = raw[raw["source"] == "fluent-emoji"].iloc[0][["caption", "keywords"]]
    own = emoji.captions[0]
    assert own.startswith(name) and emoji.variants[0] == ((own, name) if own != name else (own,))
    extra = [k for k in keywords if k.lower() not in name.lower().split()]
    assert all(k in own for k in extra)
    assert load_packaged("tuxpaint", "test").captions == tuple(raw[raw["source"] == "tuxpaint"]["caption"])
