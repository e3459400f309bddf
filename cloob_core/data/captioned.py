"""The packaged captioned set, the default training data: real image-caption pairs that ship with the package.

2,551 pairs from two sources the package registries carry (built by scripts/build_captioned_set.py, which says
how; licences and attributions in ``captioned/LICENSES``):

- Tux Paint's stamps (Debian ``tuxpaint-stamps-default``, GPL-2): photographs and drawings of objects, animals,
  plants and vehicles, each with the one-sentence description Tux Paint speaks ("A Seville orange, also called a
  bitter orange."); category: the stamp's folder (animals, food, vehicles, ...).
- Microsoft's Fluent Emoji in 3-D (npm ``@lobehub/fluent-emoji-3d``, MIT) named by emojibase (npm
  ``emojibase-data``, MIT): renders of people, animals, food, objects and places with their Unicode names ("man
  surfing") and keywords; category: the Unicode group ("food & drink").

The split is fixed and caption-disjoint: a fifth of the distinct captions of each (source, category), with every
image carrying them, are held out (``test``), so no held-out caption is ever trained on. Images are JPEG, 128 px
on the shorter side (smaller ones kept as they are), on white.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import pandas as pd

SPLITS = ("train", "test")
SOURCES = ("tuxpaint", "fluent-emoji")
COLUMNS = ("key", "source", "split", "caption", "keywords", "category", "subcategory", "image", "width", "height")


@lru_cache(maxsize=1)
def _all_pairs() -> pd.DataFrame:
    with resources.files("cloob_core.data").joinpath("captioned", "pairs.parquet").open("rb") as handle:
        return pd.read_parquet(handle)


def load_captioned(split: str = "all") -> pd.DataFrame:
    """The pairs of ``split`` (``train``, ``test`` or ``all``), in the packaged order, with a fresh index."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"the captioned set has the splits train and test (or all), not {split!r}")
    frame = _all_pairs()
    chosen = frame if split == "all" else frame[frame["split"] == split]
    return chosen.reset_index(drop=True)
