"""The caption facts the language and word filters read, on captions as a crawl has them: two to six words,
capitalised, with a full stop, in many languages and scripts (tuxpaint-stamps' descriptions, GPL-2:
cloob_core/data/captioned/LICENSES/tuxpaint-stamps.copyright), not the packaged set's long English ones.
benchmarks/bench_language.py measures the identifier on 43,635 such captions."""

from __future__ import annotations

import pytest

from cloob_core.config import CurationConfig
from cloob_core.curation.facts import caption_language, caption_words

# short English captions lid.176 (compressed) calls another language at 0.5 to 0.92 as written
ENGLISH = ["A brown hen.", "A great blue heron.", "An ostrich.", "A ladybug.", "A caribou.", "A wapiti.",
           "An hippopotamus.", "A male black rhino.", "A yellow lemon.", "A watermelon.", "Eat your broccoli!",
           "Folder bookmark icon.", "A photo of Navajo."]
OTHERS = {"de": ["Ein schlafendes Wasserschwein.", "Der Buchstabe u."],
          "fr": ["Une antilope."], "es": ["Un camión de bomberos."], "ru": ["Жёлтый флаг.", "Синяя птица."],
          "zh": ["一只蜥蜴。", "欧元五分硬币。"], "ja": ["きいろい レモン", "「トイレ」"],
          "el": ["Διπλωμένο μπλουζάκι"], "pl": ["Śpiewający dinozaur!"], "ko": ["녹색 깃발"]}


def _removed(caption: str, settings: CurationConfig) -> bool:
    """Whether the language filter ``settings`` choose removes ``caption``: its query on a one-row score table."""
    import duckdb

    from cloob_core.curation.filters import filters_of
    from cloob_core.curation.pool import SCORES_VIEW

    (language_filter,) = filters_of(settings)
    language, confidence = caption_language(caption)
    with duckdb.connect() as connection:
        connection.execute(f"CREATE TABLE {SCORES_VIEW} AS SELECT 'a' AS shard, 0 AS position, ? AS language, "
                           "CAST(? AS FLOAT) AS language_confidence", [language, confidence])
        return bool(connection.execute(language_filter.removed(None)).fetchall())


@pytest.mark.parametrize("caption", ENGLISH)
def test_a_short_english_caption_is_not_removed_as_another_language(caption):
    settings = CurationConfig(languages=["en"], min_language_confidence=0.5)
    assert not _removed(caption, settings), caption_language(caption)


@pytest.mark.parametrize(("language", "caption"), [(code, text) for code, texts in OTHERS.items() for text in texts])
def test_a_short_caption_of_another_language_is_identified_and_removed(language, caption):
    found, confidence = caption_language(caption)
    assert found == language and confidence >= 0.5
    assert _removed(caption, CurationConfig(languages=["en"], min_language_confidence=0.5))
    assert not _removed(caption, CurationConfig(languages=[language], min_language_confidence=0.5))


def test_han_text_without_kana_is_chinese_and_with_kana_japanese():
    assert caption_language("一只蜥蜴。")[0] == "zh"  # lid.176: Japanese, 0.52 (0.45, and Chinese 0.41, in lower case)
    assert caption_language("大阪城")[0] == "zh"  # (a Japanese name in kanji alone reads as Chinese: the price)
    assert caption_language("東京タワーの写真")[0] == "ja"


def test_words_of_scripts_without_spaces_are_counted_by_character():
    assert caption_words("一只蜥蜴。") == 4
    assert caption_words("東京タワーの写真") == 8
    assert caption_words("a ラッコ") == 4
    assert caption_words("녹색 깃발") == 2  # Hangul is written with spaces
    assert caption_words("A photo of Navajo.") == 4
    assert caption_words("a - b") == 2  # a dash alone is no word
    assert caption_words("") == 0
