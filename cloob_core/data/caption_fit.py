"""How the captions fit the model's text context: the share the tokenizer cuts short, and the distinct captions that
cutting makes identical; and whether they differ at all: the share of the most common caption.

A caption longer than the context (16 tokens for ``cloob-tiny``, 77 for CLIP's architectures) is cut without a
word by the tokenizer. Cutting alone loses the caption's end; when captions share a long prefix (a catalogue's
boilerplate, then the product) it also makes distinct captions the same token sequence, and a contrastive run
then has nothing to tell their images apart by. Both the data gate and training measure this on a sample of
captions with the model's own tokenizer (``model.architecture``) and judge it by the ``validation`` thresholds:
above ``warn_truncated_caption_fraction`` a warning, above ``max_truncated_caption_fraction`` or
``max_merged_caption_fraction`` a one-line refusal that names the setting.

Captions that are one sentence repeated (a scraper's placeholder, a broken join: "image", "photo.jpg") pass every
row check, and a contrastive run on them trains to the end learning nothing: every positive pair's text is the
same. The share of the sample's most common caption above ``max_top_caption_share`` fails the gate and makes
training warn (class-name captions, ten classes say, stay far below it).

A sample decides here, unlike the gate's row expectations: the thresholds are shares of a tenth and more, which a
sample of thousands estimates to about a percent, and reading every caption of a 50M-row manifest through a
Python tokenizer would take the better part of an hour.
"""

from __future__ import annotations

import logging
import tarfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from cloob_core import storage
from cloob_core.config import CloobConfig
from cloob_core.errors import StageError

log = logging.getLogger(__name__)


class CaptionsDoNotFit(StageError):
    """Too many captions are cut short, or cutting makes too many distinct captions identical."""


@dataclass(frozen=True)
class CaptionFit:
    architecture: str
    context: int
    sampled: int
    truncated: int  # captions longer than the context
    distinct: int  # distinct captions in the sample
    merged: int  # distinct captions whose cut tokens equal another distinct caption's
    merged_examples: list[str] = field(default_factory=list)
    repeated: int = 0  # how often the most common caption occurs in the sample
    repeated_caption: str = ""

    @property
    def top_share(self) -> float:
        return self.repeated / self.sampled if self.sampled else 0.0

    @property
    def truncated_fraction(self) -> float:
        return self.truncated / self.sampled if self.sampled else 0.0

    @property
    def merged_fraction(self) -> float:
        return self.merged / self.distinct if self.distinct else 0.0

    def line(self) -> str:
        return (f"captions: {self.truncated_fraction:.1%} of {self.sampled:,} sampled are longer than "
                f"{self.architecture}'s {self.context}-token context and are cut; cutting makes "
                f"{self.merged_fraction:.1%} of the {self.distinct:,} distinct ones identical to another; the most "
                f"common caption is {self.top_share:.1%} of them")

    def as_dict(self) -> dict:
        return {"architecture": self.architecture, "context_tokens": self.context, "sampled": self.sampled,
                "truncated_fraction": round(self.truncated_fraction, 6), "distinct": self.distinct,
                "merged_fraction": round(self.merged_fraction, 6), "top_caption_share": round(self.top_share, 6)}


def measure(captions: Sequence[str], architecture: str) -> CaptionFit:
    """The fit of ``captions`` to ``architecture``'s tokenizer, whatever tokenizer it is: a caption is cut when
    its tokens at one more position than the context reach that position (the pad of an empty text does not)."""
    from cloob_core.model.dual_encoder import build_tokenizer  # torch: only when there are captions to measure

    tokenizer = build_tokenizer(architecture)
    context = int(tokenizer.context_length)
    captions = list(captions)
    if not captions:
        return CaptionFit(architecture, context, 0, 0, 0, 0)
    pad = int(tokenizer([""], context_length=context + 1)[0, context])
    longer = tokenizer(captions, context_length=context + 1)[:, context] != pad
    distinct = sorted(set(captions))
    owners: dict[bytes, list[str]] = {}
    for caption, row in zip(distinct, tokenizer(distinct, context_length=context), strict=True):
        owners.setdefault(row.numpy().tobytes(), []).append(caption)
    groups = [group for group in owners.values() if len(group) > 1]
    ((repeated_caption, repeated),) = Counter(captions).most_common(1)
    return CaptionFit(architecture, context, len(captions), int(longer.sum()), len(distinct),
                      sum(map(len, groups)), [caption for group in groups[:2] for caption in group[:2]],
                      repeated, repeated_caption)


# The fewest sampled captions the diversity check decides from: in a sample of n the top share is at least 1/n, so
# a manifest of one row "repeats" its caption 100% and one of two 50%, whatever the captions are.
MIN_DIVERSITY_SAMPLE = 20


def diversity_problem(fit: CaptionFit, config: CloobConfig) -> str | None:
    """One line when the most common caption is above ``validation.max_top_caption_share`` of the sample; none
    from a sample under :data:`MIN_DIVERSITY_SAMPLE` captions, which measures nothing (said in the log)."""
    limit = config.validation.max_top_caption_share
    if fit.sampled < MIN_DIVERSITY_SAMPLE:
        if fit.sampled:
            log.info("captions: %d sampled, under the %d the check of their diversity decides from: not checked",
                     fit.sampled, MIN_DIVERSITY_SAMPLE)
        return None
    if fit.top_share <= limit:
        return None
    return (f"{fit.top_share:.1%} of {fit.sampled:,} sampled captions (the check decides from "
            f"{MIN_DIVERSITY_SAMPLE} or more) are the same caption "
            f"({_shown(fit.repeated_caption)}; {fit.distinct:,} distinct in all), above "
            f"validation.max_top_caption_share {limit:g}: captions that repeat tell no images apart, so the run "
            "would learn nothing from them; fix the captions, or raise the threshold")


def problems(fit: CaptionFit, config: CloobConfig) -> dict[str, str]:
    """Each threshold the fit breaks (``merged_fraction``, ``truncated_fraction``) → one line naming the settings."""
    val = config.validation
    found = {}
    if fit.merged_fraction > val.max_merged_caption_fraction:
        shown = "; ".join(map(_shown, fit.merged_examples))
        found["merged_fraction"] = (
            f"cutting captions to {fit.architecture}'s {fit.context} tokens makes {fit.merged_fraction:.1%} of the "
            f"{fit.distinct:,} distinct ones sampled identical to another, above "
            f"validation.max_merged_caption_fraction {val.max_merged_caption_fraction:g}: pick a model.architecture "
            f"with a longer text context or shorten the captions' shared text (e.g. {shown})")
    if fit.truncated_fraction > val.max_truncated_caption_fraction:
        found["truncated_fraction"] = (
            f"{fit.truncated_fraction:.1%} of {fit.sampled:,} sampled captions are longer than {fit.architecture}'s "
            f"{fit.context}-token context and would be cut, above validation.max_truncated_caption_fraction "
            f"{val.max_truncated_caption_fraction:g}: pick a model.architecture with a longer text context, shorten "
            "the captions, or raise the threshold")
    return found


def _shown(caption: str) -> str:
    """A caption as an example: its end too, where captions that differ only there are told apart."""
    return repr(caption if len(caption) <= 60 else f"{caption[:20]}…{caption[-35:]}")


def judge(fit: CaptionFit, config: CloobConfig) -> str | None:
    """Why the captions cannot train this model (one line naming the settings), or None; logs the fit, and a
    warning above ``validation.warn_truncated_caption_fraction`` or ``validation.max_top_caption_share`` (the
    gate fails on the latter; training warns, as a set of few distinct captions may be meant)."""
    val = config.validation
    log.info("%s", fit.line())
    found = problems(fit, config)
    repeated = diversity_problem(fit, config)
    if repeated:
        log.warning("%s", repeated)
    if not found and fit.truncated_fraction > val.warn_truncated_caption_fraction:
        log.warning("%.1f%% of sampled captions are cut to %s's %d-token context (above "
                    "validation.warn_truncated_caption_fraction %g): their ends do not train",
                    100 * fit.truncated_fraction, fit.architecture, fit.context,
                    val.warn_truncated_caption_fraction)
    return next(iter(found.values()), None)


def check(captions: Sequence[str], config: CloobConfig) -> CaptionFit:
    """Measure and judge; raise :class:`CaptionsDoNotFit` when the captions cannot train this model."""
    fit = measure(captions, config.model.architecture)
    problem = judge(fit, config)
    if problem:
        raise CaptionsDoNotFit(problem)
    return fit


def shard_captions(urls: Sequence[str], limit: int, spread: int = 8) -> list[str]:
    """Up to ``limit`` captions (``.txt`` members) from up to ``spread`` shards evenly spaced over ``urls``, an
    equal share from each: what training measures before its first step. Only the captions are read."""
    count = min(spread, len(urls))
    picked = list(dict.fromkeys(urls[round(i * (len(urls) - 1) / max(count - 1, 1))] for i in range(count)))
    captions: list[str] = []
    for number, url in enumerate(picked):
        share = (limit - len(captions)) // (len(picked) - number)
        with storage.open_read(url) as stream, tarfile.open(fileobj=stream, mode="r|") as reader:
            for member in reader:
                if len(captions) >= limit or share <= 0:
                    break
                if member.isfile() and member.name.endswith(".txt") and (handle := reader.extractfile(member)):
                    captions.append(handle.read().decode("utf-8", errors="replace"))
                    share -= 1
    return captions
