"""``cloob data validate``: the gate between data and GPU hours, as Great Expectations (1.x) suites.

Suites, thresholds from the ``validation`` config section:
- manifest: exact counts over every row, computed out of core by the engine (:mod:`cloob_core.data.engine`):
  rows; URLs present and http(s) (or rows of a packaged set), unique; captions non-empty and within length. Each
  is a fraction of the rows, checked against ``max_bad_row_fraction`` (empty captions: ``max_empty_caption_fraction``,
  since the download drops them), with a few breaking rows as examples and the setting that allows them;
- manifest_rows: the same as row-level expectations on a bounded sample (``manifest_sample`` rows picked by a
  hash of the row). When the sample is the whole manifest it decides with the rest; when it is a true sample it
  is reported and decides nothing (a sample's share of bad rows scatters around the exact one);
- shards: every shard of the manifest is complete and has samples; its tar holds exactly the samples its record
  and ``sizes.json`` claim, each with jpg, txt and json; a sample of them decodes (the image in full, the caption
  as UTF-8, the metadata as a JSON object), so random bytes under the right names do not pass; stored image
  sides within bounds; overall success ratio above the threshold.
- captions: how the captions of the manifest's sample, or of the shards' decoded samples, fit the text context
  of ``model.architecture``'s tokenizer (:mod:`cloob_core.data.caption_fit`): the share cut short and the share of
  distinct captions that cutting makes identical, and the share of the most common caption (captions that do not
  differ carry no signal), each against its threshold. This sample decides.
A failed expectation is reported with how many rows broke it and a few examples, cut short.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pandas as pd

from cloob_core import lease, storage
from cloob_core.config import CloobConfig, ConfigError
from cloob_core.data import caption_fit, engine
from cloob_core.data.acquire import opened
from cloob_core.data.packaged import URL_PATTERN as PACKAGED_URL
from cloob_core.data.run_manifest import RunManifest
from cloob_core.data.shard_files import CURATION_REPORT, IMAGE_KEYS, score_cut_settings, summary_file
from cloob_core.data.summary import summarize
from cloob_core.data.writer import read_records, tar_samples
from cloob_core.errors import StageError
from cloob_core.io import json_bytes, parse_json
from cloob_core.redact import Redactor

log = logging.getLogger(__name__)
_SAMPLE_PARTS = {"txt", "json"}  # and one of IMAGE_KEYS
URL_PATTERN = rf"^(?:https?://[^\s/]+\S*|{PACKAGED_URL})$"  # packaged rows: `cloob data acquire`


@dataclass
class Check:
    suite: str
    expectation: str
    column: str | None
    success: bool
    unexpected: int | None
    observed: Any
    examples: list[Any]
    kwargs: dict[str, Any]
    decides: bool = True
    advice: str | None = None  # what to change, when a failing check's numbers do not say it

    def line(self) -> str:
        mark = ("PASS" if self.success else "FAIL") if self.decides else ("pass" if self.success else "fail")
        columns = [self.kwargs[k] for k in ("column", "column_A", "column_B") if k in self.kwargs]
        target = f" [{' = '.join(columns)}]" if columns else ""
        bounds = {k: v for k, v in self.kwargs.items() if k not in ("batch_id", "column", "column_A", "column_B")}
        text = f"{mark} {self.suite}: {self.expectation}{target} {bounds or ''}".rstrip()
        shown = f"e.g. [{', '.join(_short(e) for e in self.examples[:3])}]"
        if self.unexpected:
            text += f" — {self.unexpected} row(s) break it, {shown}"
        elif self.observed is not None:
            text += f" — observed {_short(self.observed)}"
        if self.examples and not self.unexpected:
            text += f", {shown}"
        text += f": {self.advice}" if self.advice and not self.success else ""
        return text + ("" if self.decides else " (a sample: informs, does not decide)")


def _short(value: Any, limit: int = 200) -> str:
    """A value as printed in the report: a 40 MB caption is shown by its start and its length."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"


@dataclass
class GateReport:
    checks: list[Check] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(check.success for check in self.checks if check.decides)

    def text(self) -> str:
        failed = sum(not c.success for c in self.checks if c.decides)
        deciding = sum(c.decides for c in self.checks)
        head = "data gate PASSED" if self.passed else f"data gate FAILED: {failed} of {deciding} checks"
        return "\n".join([head, *("  " + c.line() for c in self.checks)])


def _gx() -> tuple[Any, Any, Any]:
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    return gx, gxe, context


def _validate(
    context: Any, gx: Any, name: str, frame: pd.DataFrame, expectations: list[Any], redactor: Redactor
) -> tuple[list[Check], dict]:
    """GX's verdict on the full values; what it reports (the examples of failing rows) redacted."""
    source = context.data_sources.add_pandas(f"cloob-{name}")
    batch_definition = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe("all")
    suite = context.suites.add(gx.ExpectationSuite(name=f"cloob-{name}"))
    for expectation in expectations:
        suite.add_expectation(expectation)
    result = batch_definition.get_batch(batch_parameters={"dataframe": frame}).validate(suite, result_format="SUMMARY")
    checks = []
    for item in result.results:
        config = item.expectation_config
        details = item.result or {}
        checks.append(Check(
            suite=name, expectation=config.type, column=config.kwargs.get("column"), success=bool(item.success),
            unexpected=details.get("unexpected_count"), observed=details.get("observed_value"),
            examples=redactor.value(list(details.get("partial_unexpected_list") or [])[:5]),
            kwargs={k: v for k, v in config.kwargs.items() if v is not None},
        ))
    return checks, redactor.value(_reproducible(result.to_json_dict()))


def _reproducible(raw: dict[str, Any]) -> dict[str, Any]:
    """GX's result without what differs between two runs on the same data (random ids, the load time), so the
    gate's report is a reproducible DVC output."""
    raw = {key: value for key, value in raw.items() if key != "id"}
    raw["meta"] = {key: value for key, value in raw.get("meta", {}).items() if key != "batch_markers"}
    for item in raw.get("results", []):
        item["expectation_config"] = {k: v for k, v in item["expectation_config"].items() if k != "id"}
    return raw


def manifest_expectations(gxe: Any, config: CloobConfig, url_col: str, caption_col: str) -> list[Any]:
    """The row-level expectations (on the sample)."""
    val = config.validation
    mostly = 1.0 - val.max_bad_row_fraction
    return [
        gxe.ExpectColumnValuesToMatchRegex(column=url_col, regex=URL_PATTERN, mostly=mostly),
        gxe.ExpectColumnValuesToBeUnique(column=url_col, mostly=mostly),
        gxe.ExpectColumnValuesToMatchRegex(column=caption_col, regex=r"\S",
                                           mostly=1.0 - val.max_empty_caption_fraction),
        gxe.ExpectColumnValueLengthsToBeBetween(column=caption_col, max_value=val.max_caption_chars, mostly=mostly),
    ]


# The exact counts: (column of the aggregates' row, SQL condition a breaking row meets). {url} and {caption} are
# the quoted columns; a URL repeated by an earlier row is counted from the manifest's duplicates table.
_BREAKING = {
    "bad_url_rows": "NOT regexp_full_match({url}, $pattern)",
    "empty_caption_rows": "NOT regexp_matches({caption}, '\\S')",
    "long_caption_rows": "length({caption}) > $longest",
}


@dataclass
class ManifestFacts:
    """What the engine found in one pass of queries: the exact counts (one row), examples of breaking rows, and
    the sample the row-level expectations check."""

    aggregates: pd.DataFrame
    counts: dict[str, int]
    examples: dict[str, list[Any]]
    sample: pd.DataFrame
    sample_is_everything: bool


def manifest_facts(manifest: RunManifest, config: CloobConfig) -> ManifestFacts:
    val = config.validation
    locations = [storage.join(manifest.location, part.name) for part in manifest.parts]
    url, caption = engine.quoted(manifest.url_col), engine.quoted(manifest.caption_col)
    conditions = {name: sql.format(url=url, caption=caption) for name, sql in _BREAKING.items()}
    rows = len(manifest)
    counts = {name: 0 for name in conditions}
    examples: dict[str, list[Any]] = {name: [] for name in [*conditions, "duplicate_url_rows"]}
    sample = pd.DataFrame({manifest.url_col: pd.Series([], dtype=str), manifest.caption_col: pd.Series([], dtype=str)})
    with engine.connect(config.engine, locations) as db:
        if locations:
            scan = "read_parquet($parts, union_by_name = true)"
            parameters = {"pattern": URL_PATTERN, "longest": val.max_caption_chars, "parts": locations}
            counted = ", ".join(f"count(*) FILTER (WHERE {sql}) AS {name}" for name, sql in conditions.items())
            found = db.execute(*_bound(f"SELECT {counted} FROM {scan}", parameters)).fetchone()
            counts = dict(zip(conditions, map(int, found), strict=True))
            for name, sql in conditions.items():
                if counts[name]:
                    shown = url if name == "bad_url_rows" else caption
                    examples[name] = [value for (value,) in db.execute(
                        *_bound(f"SELECT {shown} FROM {scan} WHERE {sql} LIMIT 5", parameters)).fetchall()]
            picked = "" if rows <= val.manifest_sample else \
                f"ORDER BY hash({url}, {caption}) LIMIT {val.manifest_sample}"
            sample = db.execute(f"SELECT {url}, {caption} FROM {scan} {picked}", {"parts": locations}).df()
        if manifest.duplicate_rows:
            first = db.execute("SELECT row FROM read_parquet($dups) LIMIT 5",
                               {"dups": storage.join(manifest.location, manifest.duplicates)}).fetchall()
            examples["duplicate_url_rows"] = [row.url for row in manifest.rows(sorted(r for (r,) in first))]
    counts["duplicate_url_rows"] = manifest.duplicate_rows
    table = {"rows": rows, **{name.replace("_rows", "_fraction"): (value / rows if rows else 0.0)
                              for name, value in counts.items()}}
    examples = {name.replace("_rows", "_fraction"): values for name, values in examples.items()}
    counts = {name.replace("_rows", "_fraction"): value for name, value in counts.items()}
    return ManifestFacts(pd.DataFrame([table]), counts, examples, sample, rows <= val.manifest_sample)


def _bound(query: str, parameters: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``query`` with the parameters it names (DuckDB refuses any it does not use)."""
    return query, {name: value for name, value in parameters.items() if f"${name}" in query}


def aggregate_expectations(gxe: Any, config: CloobConfig) -> list[Any]:
    val = config.validation
    return [gxe.ExpectColumnValuesToBeBetween(column="rows", min_value=val.min_rows),
            *(gxe.ExpectColumnValuesToBeBetween(column=column, max_value=bound) for column, bound in (
                ("bad_url_fraction", val.max_bad_row_fraction), ("duplicate_url_fraction", val.max_bad_row_fraction),
                ("empty_caption_fraction", val.max_empty_caption_fraction),
                ("long_caption_fraction", val.max_bad_row_fraction)))]


# what a failing manifest count's line advises: the setting that allows it, and what it usually means
_MANIFEST_ADVICE = {
    "bad_url_fraction": "fix or drop those rows, or raise validation.max_bad_row_fraction",
    "duplicate_url_fraction": "the download fetches each URL once; raise validation.max_bad_row_fraction to allow "
                              "them",
    "empty_caption_fraction": "the download drops rows without a caption (preprocess.min_caption_chars); raise "
                              "validation.max_empty_caption_fraction to allow more, or check --caption-col",
    "long_caption_fraction": "raise validation.max_caption_chars, or validation.max_bad_row_fraction to allow them",
}


def _picked(key: str, fraction: float) -> bool:
    """Whether the gate decodes this sample: a hash of its key, so the same samples are checked every run."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") < fraction * 2**64


def _undecodable(members: dict[str, bytes | None]) -> str | None:
    """Why a sample's members do not decode, or None (the exception's type only: the report must be the same
    bytes on every run, and messages carry object addresses)."""
    from PIL import Image

    image = next((members[k] for k in IMAGE_KEYS if members.get(k) is not None), None)
    if image is None:
        return "no image"
    try:
        with Image.open(io.BytesIO(image)) as opened:
            opened.load()
    except Exception as err:  # whatever the codecs raise
        return f"image ({type(err).__name__})"
    try:
        if not (members["txt"] or b"").decode("utf-8").strip():
            return "caption (empty)"
    except UnicodeDecodeError:
        return "caption (not UTF-8)"
    try:
        meta = json.loads(members["json"] or b"")
    except ValueError as err:
        return f"json ({type(err).__name__})"
    return None if isinstance(meta, dict) else "json (not an object)"


def shard_table(folder: str, config: CloobConfig) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """Per-shard facts (record vs tar vs sizes.json, sampled decoding) and the whole-output totals, as frames to
    validate, and the captions of the decoded samples."""
    val = config.validation
    records = read_records(folder)
    try:
        sizes = parse_json(summary_file(folder, "sizes.json"), storage.join(folder, "sizes.json"))
    except FileNotFoundError:
        sizes = {}
    rows, captions = [], []
    for record in records:
        samples = incomplete = unreadable = 0
        problems: list[str] = []
        fraction = min(1.0, val.decode_sample / max(record.successes, 1))
        if record.tar:
            try:
                for key, members in tar_samples(storage.join(folder, record.tar), partial(_picked, fraction=fraction)):
                    samples += 1
                    complete = set(members) >= _SAMPLE_PARTS and not set(members).isdisjoint(IMAGE_KEYS)
                    incomplete += not complete
                    if complete and members["txt"] is not None:  # picked and complete
                        problem = _undecodable(members)
                        problems.append(f"{key}: {problem}" if problem else "")
                        if not problem:
                            captions.append(members["txt"].decode("utf-8"))
            except (tarfile.TarError, OSError, EOFError) as err:  # missing, truncated or not a tar
                log.warning("shard %s cannot be read: %s", record.tar, err)
                unreadable = 1
        failed = [p for p in problems if p]
        rows.append({
            "shard": record.name, "successes": record.successes, "tar_samples": samples,
            "sizes_json": sizes.get(record.tar, 0) if record.tar else 0, "incomplete_samples": incomplete,
            "unreadable_tar": unreadable,
            "undecodable": (f"{record.tar}: {len(failed)} of {len(problems)} sampled samples do not decode, e.g. "
                            f"{failed[0]}") if failed and len(failed) > val.max_undecodable_fraction * len(problems)
            else None,
            "side_min": record.image_sides.get("min", 0), "side_max": record.image_sides.get("max", 0),
        })
    listed_missing = sorted(set(sizes) - {r.tar for r in records if r.tar})
    stats = summarize(folder, records).stats
    totals = pd.DataFrame([{
        "success_ratio": stats["success_ratio"], "shards": len(records),
        "sizes_json_without_record": len(listed_missing), "missing_shards": stats["missing_shards"] or 0,
    }])
    columns = ["shard", "successes", "tar_samples", "sizes_json", "incomplete_samples", "unreadable_tar",
               "undecodable", "side_min", "side_max"]
    return pd.DataFrame(rows, columns=columns), totals, captions


def shard_expectations(gxe: Any, config: CloobConfig) -> tuple[list[Any], list[Any]]:
    val = config.validation
    per_shard = [
        gxe.ExpectColumnValuesToBeBetween(column="successes", min_value=1),
        gxe.ExpectColumnValuesToBeBetween(column="unreadable_tar", max_value=0),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="tar_samples", column_B="successes"),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="sizes_json", column_B="tar_samples"),
        gxe.ExpectColumnValuesToBeBetween(column="incomplete_samples", max_value=0),
        gxe.ExpectColumnValuesToBeNull(column="undecodable"),  # its examples name the shards and the problem
        gxe.ExpectColumnValuesToBeBetween(column="side_min", min_value=val.min_image_side),
        gxe.ExpectColumnValuesToBeBetween(column="side_max", max_value=val.max_image_side),
    ]
    totals = [
        gxe.ExpectColumnValuesToBeBetween(column="shards", min_value=1),
        gxe.ExpectColumnValuesToBeBetween(column="success_ratio", min_value=val.min_success_ratio),
        gxe.ExpectColumnValuesToBeBetween(column="sizes_json_without_record", max_value=0),
        gxe.ExpectColumnValuesToBeBetween(column="missing_shards", max_value=0),
    ]
    return per_shard, totals


def _check_curation(context: Any, gx: Any, gxe: Any, shards: str, config: CloobConfig, redactor: Redactor,
                    report: GateReport) -> None:
    """Curated shards keep at least ``validation.min_curated_fraction`` of their pool; the failing line names the
    filter that removed the most. Shards without a curation report are not curated: nothing to judge."""
    location = storage.join(shards, CURATION_REPORT)
    try:
        curation = parse_json(storage.read_bytes(location), location)
        rows, kept, removed_by = int(curation["rows"]), int(curation["kept"]), dict(curation["removed_by"])
        settings = dict(curation.get("settings_of_reasons") or {})  # (a report from before it: the reasons)
    except FileNotFoundError:
        return
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ConfigError(f"{location} is not a report of `cloob data curate` ({err})") from None
    fraction = kept / rows if rows else 0.0
    worst = max(sorted(removed_by), key=lambda name: removed_by[name], default="(none)")
    frame = pd.DataFrame([{"curated_fraction": fraction}])
    expectation = gxe.ExpectColumnValuesToBeBetween(column="curated_fraction",
                                                    min_value=config.validation.min_curated_fraction)
    checks, raw = _validate(context, gx, "shard_curation", frame, [expectation], redactor)
    for check in checks:
        check.unexpected, check.examples = None, []
        check.observed = f"{kept:,} of {rows:,} kept ({fraction:.1%})"
        check.advice = (f"curation.{settings.get(worst, worst)} removed the most ({removed_by.get(worst, 0):,}); "
                        "loosen it, or lower "
                        "validation.min_curated_fraction")
    report.checks += checks
    report.raw["shard_curation"] = raw
    _check_scorer(context, gx, gxe, curation, removed_by, config, redactor, report)


def _check_scorer(context: Any, gx: Any, gxe: Any, curation: dict[str, Any], removed_by: dict[str, int],
                  config: CloobConfig, redactor: Redactor, report: GateReport) -> None:
    """Shards cut by score (curation.min_clip_score, top_fraction) were scored by a model that separates the pool's
    captions from other samples' at least ``curation.min_scorer_auc`` (the report's ROC AUC; 0.5 is chance): a
    scorer at chance cuts at random. A report without the figure (from before it) or without a score cut passes."""
    cuts = score_cut_settings(removed_by)
    auc = (curation.get("scorer_separation") or {}).get("auc")
    if cuts is None or not isinstance(auc, (int, float)):
        return
    minimum = config.curation.min_scorer_auc
    expectation = gxe.ExpectColumnValuesToBeBetween(column="scorer_auc", min_value=minimum)
    checks, raw = _validate(context, gx, "shard_scorer", pd.DataFrame([{"scorer_auc": float(auc)}]), [expectation],
                            redactor)
    for check in checks:
        check.unexpected, check.examples = None, []
        check.observed = f"the scorer's separation on the pool: AUC {auc:.3f} (0.5 is chance)"
        check.advice = (f"the cut by {cuts} is close to random: score with a model that knows this kind of data, "
                        "or lower curation.min_scorer_auc")
    report.checks += checks
    report.raw["shard_scorer"] = raw


def _check_captions(context: Any, gx: Any, gxe: Any, suite: str, captions: list[str], config: CloobConfig,
                    redactor: Redactor, report: GateReport) -> None:
    """The captions' fit to the model's text context as a suite of one row; its failing line says what to change."""
    val = config.validation
    if not val.caption_sample or not captions:
        return
    fit = caption_fit.measure(captions[: val.caption_sample], config.model.architecture)
    caption_fit.judge(fit, config)
    found = caption_fit.problems(fit, config)
    repeated = caption_fit.diversity_problem(fit, config)
    if repeated:
        found["top_caption_share"] = repeated
    frame = pd.DataFrame([fit.as_dict()])
    expectations = [
        gxe.ExpectColumnValuesToBeBetween(column="truncated_fraction", max_value=val.max_truncated_caption_fraction),
        gxe.ExpectColumnValuesToBeBetween(column="merged_fraction", max_value=val.max_merged_caption_fraction),
    ]
    if fit.sampled >= caption_fit.MIN_DIVERSITY_SAMPLE:  # a smaller sample's top share measures nothing
        expectations.append(gxe.ExpectColumnValuesToBeBetween(column="top_caption_share",
                                                              max_value=val.max_top_caption_share))
    checks, raw = _validate(context, gx, suite, frame, expectations, redactor)
    for check in checks:
        check.unexpected, check.examples = None, []  # the one row is the sample's figure, not a row of the data
        check.observed = (f"{frame.at[0, check.column]:.1%} of {fit.sampled} sampled, " +
                          (f"{fit.distinct} distinct" if check.column == "top_caption_share"
                           else f"{fit.context}-token context"))
        check.advice = found.get(check.column)
    report.checks += checks
    report.raw[suite] = raw


class GateFailed(StageError):
    """An expectation failed: the data must not go on to the next stage. ``details`` is the whole report."""

    exit_code = 1

    def __init__(self, report: GateReport):
        failed = sum(not check.success for check in report.checks)
        super().__init__(f"data gate FAILED: {failed} of {len(report.checks)} checks")
        self.report, self.details = report, report.text()


@lease.holding("report_dir")
def run_gate(config: CloobConfig, *, manifest: str | None = None, shards: str | None = None,
             report_dir: str | None = None) -> GateReport:
    """The manifest suite and/or the shard suite; the report is written (when ``report_dir``) before a failing
    gate raises :class:`GateFailed`."""
    if not manifest and not shards:
        raise ConfigError("the data gate needs a manifest, shards or both")
    if report_dir:
        storage.ensure_folder(report_dir)
    gx, gxe, context = _gx()
    report = GateReport()
    redactor = Redactor.of(config.download.redact_query_params)
    if manifest:
        with opened(manifest, config) as run_manifest:
            facts = manifest_facts(run_manifest, config)
            expectations = manifest_expectations(gxe, config, run_manifest.url_col, run_manifest.caption_col)
        checks, raw = _validate(context, gx, "manifest", facts.aggregates, aggregate_expectations(gxe, config),
                                redactor)
        for check in checks:  # the manifest's rows that break it, not the one row of counts
            if check.column == "rows":
                check.observed = f"{len(run_manifest)} rows"
            if check.column in facts.counts:
                count = facts.counts[check.column]
                check.unexpected = count or None
                check.observed = f"{count} of {len(run_manifest)} rows"
                check.examples = redactor.value(facts.examples.get(check.column, []))
                check.advice = _MANIFEST_ADVICE.get(check.column)
        report.checks += checks
        report.raw["manifest"] = raw
        checks, raw = _validate(context, gx, "manifest_rows", facts.sample, expectations, redactor)
        for check in checks:
            check.decides = facts.sample_is_everything
        report.checks += checks
        report.raw["manifest_rows"] = raw
        _check_captions(context, gx, gxe, "manifest_captions", facts.sample[run_manifest.caption_col].dropna()
                        .astype(str).tolist(), config, redactor, report)
    if shards:
        per_shard, totals, captions = shard_table(shards, config)
        shard_checks, total_checks = shard_expectations(gxe, config)
        checks, raw = _validate(context, gx, "shards", per_shard, shard_checks, redactor)
        report.checks += checks
        report.raw["shards"] = raw
        checks, raw = _validate(context, gx, "shard_totals", totals, total_checks, redactor)
        report.checks += checks
        report.raw["shard_totals"] = raw
        _check_captions(context, gx, gxe, "shard_captions", captions, config, redactor, report)
        _check_curation(context, gx, gxe, shards, config, redactor, report)
    if report_dir:
        storage.write_bytes(storage.join(report_dir, "gx_results.json"),
                            json_bytes(report.raw, default=str))
        storage.write_bytes(storage.join(report_dir, "summary.md"), ("```\n" + report.text() + "\n```\n").encode())
        # The verdict alone, without thresholds or observed values: what a later stage may depend on, so that
        # retuning a threshold re-runs the gate, not everything after it.
        storage.write_bytes(storage.join(report_dir, "gate.json"),
                            json_bytes({"passed": report.passed, "suites": sorted(report.raw)}))
    if not report.passed:
        raise GateFailed(report)
    log.debug("data gate passed")
    return report
