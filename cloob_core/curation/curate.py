"""`cloob data curate`: the filters of the ``curation`` section applied to a scored pool; the kept samples
resharded, the kept table and the report beside them, published as one unit (a killed curate leaves the previous
output whole)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cloob_core import lease, publish, storage
from cloob_core.config import CloobConfig, ConfigError
from cloob_core.curation.figures import contact_sheet_png, removed_sheet_png, score_histogram_png
from cloob_core.curation.filters import filters_of
from cloob_core.curation.pool import SCORES_VIEW, ScoredPool, open_pool
from cloob_core.curation.reshard import reshard
from cloob_core.curation.selection import Selection, select, write_kept_table
from cloob_core.curation.separation import Separation, scorer_separation
from cloob_core.data.engine import connect
from cloob_core.data.shard_files import CURATION_REPORT, score_cut_settings
from cloob_core.errors import StageError
from cloob_core.evaluation.inputs import ImageSet, load_images
from cloob_core.io import write_json, write_text

if TYPE_CHECKING:  # torch and open_clip load only where a filter embeds images: a curate without one needs neither
    from cloob_core.model.source import ModelSource

log = logging.getLogger(__name__)
KEPT_FILE = "kept.parquet"
REPORT_JSON, REPORT_MD = CURATION_REPORT, "curation_report.md"
HISTOGRAM, CONTACT_SHEET = "curation_scores.png", "curation_contact_sheet.png"


def removed_sheet(reason: str) -> str:
    """The file of the sheet of what the filter of ``reason`` removed."""
    return f"curation_removed_{reason}.png"


class CurationError(StageError):
    """A curation that cannot give a training set: its filters keep nothing."""


@dataclass(frozen=True)
class CurateResult:
    output: str
    selection: Selection
    shards: int
    separation: Separation
    min_scorer_auc: float
    shard_size: int  # preprocess.shard_size: the curated shards' samples, at most
    pool_shard_size: int  # the most samples a shard of the pool held

    @property
    def lines(self) -> list[str]:
        chosen = self.selection
        lines = [f"kept {chosen.kept:,} of {chosen.rows:,} samples ({chosen.kept / chosen.rows:.1%}) in "
                 f"{self.shards} shard(s) of up to {self.shard_size:,} (preprocess.shard_size; the pool's held up to "
                 f"{self.pool_shard_size:,})"]
        lines += [f"  {reason}: removed {count:,}" for reason, count in chosen.removed_by.items()]
        lines.append(self.separation.line())
        warning = _weak_scorer_warning(chosen, self.separation, self.min_scorer_auc)
        return [*lines, f"warning: {warning}"] if warning else lines


def _weak_scorer_warning(selection: Selection, separation: Separation, minimum: float) -> str | None:
    """What a cut by score made with a scorer below ``minimum`` means; None where there is no such cut."""
    cuts = score_cut_settings(selection.removed_by)
    if cuts is None or separation.auc is None or separation.auc >= minimum:
        return None
    return (f"the scorer's separation on this pool is below curation.min_scorer_auc ({minimum}): its cut by {cuts} "
            "is close to random, and the shard gate refuses these shards; score with a model that knows this kind "
            "of data")


def _image_side_beyond_the_pool(pool: ScoredPool, config: CloobConfig) -> str | None:
    """A line where curation.min_image_side is above every stored image's shorter side: the download resizes images
    (preprocess.image_size), so the filter reads the stored sides, not the originals'."""
    minimum = config.curation.min_image_side
    if minimum is None:
        return None
    (largest,) = pool.connection.execute(f"SELECT max(least(width, height)) FROM {SCORES_VIEW}").fetchone()
    if largest is None or minimum <= largest:
        return None
    return (f"curation.min_image_side {minimum} is above every stored image's shorter side (at most {largest} px: "
            f"the download resized them to preprocess.image_size {config.preprocess.image_size}), so it removes every "
            "image: the filter reads the stored sides, not the originals'")


def _sentence(line: str) -> str:
    return line[:1].upper() + line[1:]


def _undrawn_line(undrawn: int) -> str:
    return (f"{undrawn:,} line(s) of text on the report's sheets are in a script no font here covers, drawn as "
            "boxes: install a font of it (Debian: fonts-noto-cjk for Chinese, Japanese and Korean; the pipeline's "
            "image has Droid Sans Fallback)")


def _report(selection: Selection, config: CloobConfig, pool: ScoredPool, scores: str, separation: Separation,
            sheets: dict[str, str], undrawn: int) -> dict[str, object]:
    return {"rows": selection.rows, "kept": selection.kept, "removed": selection.removed,
            "removed_by": selection.removed_by, "settings_of_reasons": selection.settings,
            "overlaps": [{"filters": list(pair), "removed": count} for pair, count in selection.overlaps.items()],
            "scorer_separation": separation.as_dict(), "sheets": {"cut": CONTACT_SHEET, **sheets},
            "undrawn_lines": undrawn, "settings": config.curation.model_dump(), "pool": pool.shards,
            "scores": scores, "scorer": asdict(pool.index.model)}


def _report_md(selection: Selection, separation: Separation, minimum: float, sheets: dict[str, str],
               undrawn: int) -> str:
    rows = [f"| {reason} | {count:,} | {count / selection.rows:.1%} |"
            for reason, count in selection.removed_by.items()]
    overlaps = [f"| {a} | {b} | {count:,} |" for (a, b), count in selection.overlaps.items()]
    weak = _weak_scorer_warning(selection, separation, minimum)
    warning = [f"**Warning**: {weak}.", ""] if weak else []
    removed_sheets = [line for reason, name in sheets.items() for line in (
        f"What {reason} removed ({selection.removed_by[reason]:,} samples; a seeded sample of them, each with the "
        "filter's evidence in red):", "",
        f"![removed by {reason}]({name})", "")]
    drawn = [f"**Note**: {_undrawn_line(undrawn)}.", ""] if undrawn else []
    return "\n".join([
        "# Curation", "", f"Kept **{selection.kept:,}** of {selection.rows:,} samples "
        f"({selection.kept / selection.rows:.1%}).", "", f"{_sentence(separation.line())} (docs/curation.md, \"The "
        "scorer's separation\").", "", *warning, "| filter | removed | of the pool |", "|---|---|---|", *rows,
        "", "A sample removed by two filters counts in both; removed by both:", "",
        "| filter | filter | removed by both |", "|---|---|---|", *overlaps, "",
        f"![scores, kept and removed]({HISTOGRAM})", "",
        "The samples at the cut: the lowest-scored kept (top), the highest-scored removed (bottom).", "",
        f"![the samples at the cut]({CONTACT_SHEET})", "", *removed_sheets, *drawn])


def evaluation_sets(config: CloobConfig) -> tuple[ImageSet, ...]:
    """``curation.decontaminate``'s sets: a data set of ``eval.datasets`` (its test split), or a set `cloob eval`
    reads; refused in one line before anything runs when it is neither."""
    found = []
    for name in config.curation.decontaminate:
        entry = config.eval.datasets.get(name)
        try:
            found.append(load_images(entry.source, entry.splits.test, entry.label_key) if entry is not None
                         else load_images(name, "test"))
        except (FileNotFoundError, ConfigError) as err:
            raise ConfigError(f"curation.decontaminate: {name} is neither a data set of eval.datasets "
                              f"({', '.join(config.eval.datasets)}) nor a set `cloob eval` reads ({err})") from None
    return tuple(found)


def target_set(config: CloobConfig) -> ImageSet | None:
    """``curation.target_images`` (its ``target_split``), refused in one line before anything runs when unreadable."""
    curation = config.curation
    if curation.target_images is None:
        return None
    try:
        return load_images(curation.target_images, curation.target_split)
    except (FileNotFoundError, ConfigError) as err:
        raise ConfigError(f"curation.target_images {curation.target_images}: not a set `cloob eval` reads "
                          f"({err})") from None


def curate(shards: str, scores: str, output: str, config: CloobConfig, model: ModelSource | None = None,
           workers: int = 0) -> CurateResult:
    """Apply ``config.curation``'s filters to the pool ``shards`` scored in ``scores``; write ``output``.
    Decontamination embeds the evaluation sets with ``model``, the scoring model. An ``output`` that is, lies in or
    holds the pool or its scores is refused before anything is written there."""
    storage.check_apart(("--output", output), ("--shards", shards), ("--scores", scores))
    return _curate(shards, scores, output, config, model, workers)


@lease.holding("output")
def _curate(shards: str, scores: str, output: str, config: CloobConfig, model: ModelSource | None,
            workers: int) -> CurateResult:
    sets, reference = evaluation_sets(config), target_set(config)
    embeds = "curation.decontaminate" if sets else "curation.target_images" if reference is not None else None
    if embeds and model is None:
        raise ConfigError(f"{embeds} embeds images with the model that scored the pool: give it (--model, "
                          "--checkpoint, or --architecture with --weights)")
    loaded = None
    if embeds and model is not None:
        from cloob_core.model.source import load_model

        loaded = load_model(model)
    filters = filters_of(config.curation, loaded, sets, reference, workers)
    if not filters:
        log.warning("no curation filter is set: every sample is kept (set curation.* in params.yaml)")
    with connect(config.engine, [shards, scores]) as connection:
        pool = open_pool(shards, scores, connection)
        if pool.rows == 0:
            raise CurationError(f"the pool {shards} is empty: its scores ({scores}) hold no sample, since none of "
                                "its images decoded (see the score stage's unreadable count); nothing to curate")
        side = _image_side_beyond_the_pool(pool, config)
        selection = select(pool, filters)
        if selection.kept == 0:
            worst = selection.most_removing() or ""
            raise CurationError(f"the curation keeps none of the {selection.rows:,} samples; "
                                f"curation.{selection.settings[worst]} removed the most "
                                f"({selection.removed_by[worst]:,}): loosen it"
                                + (f" ({side})" if side and selection.settings[worst] == "min_image_side" else ""))
        if side:
            log.warning("%s", side)
        separation = scorer_separation(pool, config.curation.seed)
        minimum = config.curation.min_scorer_auc
        with publish.staged(output) as staging:
            folder = Path(staging)
            summary = reshard(pool, folder, config.preprocess.shard_size, selection.kept)
            write_kept_table(pool, folder / KEPT_FILE)
            score_histogram_png(pool, folder / HISTOGRAM)
            images, seed = config.curation.report_images, config.curation.seed
            undrawn = contact_sheet_png(pool, folder / CONTACT_SHEET, images)
            sheets = {reason: removed_sheet(reason) for reason, count in selection.removed_by.items() if count}
            undrawn += sum(removed_sheet_png(pool, reason, folder / name, images, seed)
                           for reason, name in sheets.items())
            if undrawn:
                log.warning("%s", _undrawn_line(undrawn))
            write_json(folder / REPORT_JSON, _report(selection, config, pool, scores, separation, sheets, undrawn))
            write_text(folder / REPORT_MD, _report_md(selection, separation, minimum, sheets, undrawn))
    return CurateResult(output, selection, len(summary.sizes), separation, minimum, config.preprocess.shard_size,
                        max((part.rows for part in pool.index.parts), default=0))
