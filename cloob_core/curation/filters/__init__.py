"""The curation filters, one module per kind, each with one signature (:class:`Filter`): it reads the score table
(the ``scores`` view of a :class:`~cloob_core.curation.pool.ScoredPool`) and names the samples it removes, by shard
and position, each with its evidence (what the filter saw: the score and the cut, the language and its
confidence, the kept sample it duplicates, the evaluation image it copies), as a query; its ``reason`` is what the
kept table records for them, beside the evidence. A sample is kept when no filter
removes it. The shape is DataComp's ``apply_filter.py`` (a filter reads the scores, a subset comes out) and NeMo
Curator's stages (one job each, chained by the caller)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from cloob_core.config import CurationConfig
from cloob_core.curation.pool import ScoredPool

if TYPE_CHECKING:
    from cloob_core.evaluation.inputs import ImageSet
    from cloob_core.model.source import EvalModel


class Filter(Protocol):
    reason: str  # recorded for each sample the filter removes
    setting: str  # the curation setting that switches it on (curation.SETTING), as a message names it

    def removed(self, pool: ScoredPool) -> str:
        """A SQL query over the pool's connection giving ``shard, position, evidence`` (VARCHAR) of each sample
        removed, one row per sample."""
        ...


def filters_of(settings: CurationConfig, model: EvalModel | None = None, evaluation_sets: tuple[ImageSet, ...] = (),
               reference: ImageSet | None = None, workers: int = 0) -> list[Filter]:
    """The filters ``settings`` sets, in the order their reasons are listed. Decontamination embeds
    ``evaluation_sets`` (``settings.decontaminate``, resolved) and the target filter ``reference``
    (``settings.target_images``) with ``model``, the scoring model."""
    from cloob_core.curation.filters.caption import AspectRatio, CaptionWords, ImageSide, Language
    from cloob_core.curation.filters.near_duplicates import NearDuplicates
    from cloob_core.curation.filters.score import ClipScoreFloor, TopFraction
    from cloob_core.curation.filters.semantic_dedup import SemanticDedup

    chosen: list[Filter] = []
    if settings.min_clip_score is not None:
        chosen.append(ClipScoreFloor(settings.min_clip_score))
    if settings.top_fraction is not None:
        chosen.append(TopFraction(settings.top_fraction))
    if settings.languages is not None:
        chosen.append(Language(tuple(settings.languages), settings.min_language_confidence or 0.0))
    if settings.min_caption_words is not None:
        chosen.append(CaptionWords(settings.min_caption_words))
    if settings.min_image_side is not None:
        chosen.append(ImageSide(settings.min_image_side))
    if settings.max_aspect_ratio is not None:
        chosen.append(AspectRatio(settings.max_aspect_ratio))
    if settings.near_duplicates:
        chosen.append(NearDuplicates(settings.near_duplicate_bits))
    if settings.semantic_dedup_eps is not None:
        chosen.append(SemanticDedup(settings.semantic_dedup_eps, settings.semantic_dedup_clusters, settings.seed))
    if evaluation_sets and model is not None:
        from cloob_core.curation.filters.decontaminate import Decontaminate

        chosen.append(Decontaminate(evaluation_sets, model, settings.decontaminate_bits,
                                    settings.decontaminate_min_cosine, settings.decontaminate_min_similarity,
                                    workers))
    if reference is not None and model is not None:
        from cloob_core.curation.filters.target import TargetDistribution

        chosen.append(TargetDistribution(reference, model, settings.target_clusters, settings.seed, workers))
    return chosen
