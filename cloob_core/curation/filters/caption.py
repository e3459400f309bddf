"""DataComp's basic filtering, from the score table's facts: the caption's language (and the identifier's
confidence), its length in words, the image's shorter side and its aspect ratio."""

from __future__ import annotations

from dataclasses import dataclass

from cloob_core.curation.pool import SCORES_VIEW, ScoredPool


def _where(condition: str, evidence: str) -> str:
    return f"SELECT shard, position, {evidence} AS evidence FROM {SCORES_VIEW} WHERE {condition}"


@dataclass(frozen=True)
class Language:
    """Removes captions identified as another language than ``languages`` with at least ``min_confidence``: an
    identification less sure than that is no evidence, and the caption stays. (Keeping only captions identified
    as one of ``languages`` with that confidence, as this filter did, removed 27% of short English captions at 0.3:
    docs/curation.md, "Which language identifier".)"""

    languages: tuple[str, ...]
    min_confidence: float = 0.0
    reason: str = "language"
    setting: str = "languages"

    def removed(self, pool: ScoredPool) -> str:
        listed = ", ".join(f"'{code}'" for code in self.languages)  # codes are checked: [a-z]{2,3}
        return _where(f"language NOT IN ({listed}) AND language_confidence >= {self.min_confidence!r}",
                      f"printf('language %s (confidence %.2f), not {', '.join(self.languages)}', language, "
                      "language_confidence)")


@dataclass(frozen=True)
class CaptionWords:
    """Removes captions of fewer than ``minimum`` words."""

    minimum: int
    reason: str = "min_caption_words"
    setting: str = "min_caption_words"

    def removed(self, pool: ScoredPool) -> str:
        return _where(f"caption_words < {int(self.minimum)}",
                      f"printf('%d word(s), fewer than {int(self.minimum)}', caption_words)")


@dataclass(frozen=True)
class ImageSide:
    """Removes images whose shorter stored side is below ``minimum`` pixels."""

    minimum: int
    reason: str = "min_image_side"
    setting: str = "min_image_side"

    def removed(self, pool: ScoredPool) -> str:
        return _where(f"least(width, height) < {int(self.minimum)}",
                      f"printf('%dx%d: shorter side %d < {int(self.minimum)}', width, height, least(width, height))")


@dataclass(frozen=True)
class AspectRatio:
    """Removes images whose long side is more than ``maximum`` times their short side."""

    maximum: float
    reason: str = "max_aspect_ratio"
    setting: str = "max_aspect_ratio"

    def removed(self, pool: ScoredPool) -> str:
        return _where(f"greatest(width, height) > {self.maximum!r} * least(width, height)",
                      f"printf('%dx%d: aspect %.2f > {self.maximum!r}', width, height, "
                      "greatest(width, height) / greatest(least(width, height), 1))")
