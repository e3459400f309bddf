"""``cloob data validate``: the gate between data and GPU hours, as Great Expectations (1.x) suites.

Two suites, thresholds from the ``validation`` config section:
- manifest: URLs present and http(s) (or rows of the embedded set), unique; captions non-empty and within
  length; enough rows;
- shards: every shard of the manifest is complete and has samples; its tar holds exactly the samples its record
  and ``sizes.json`` claim, each with jpg, txt and json; stored image sides within bounds; overall success ratio
  above the threshold.
A failed expectation is reported with how many rows broke it and a few examples.
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from cloob_core import storage
from cloob_core.config import CloobConfig, ConfigError
from cloob_core.data.manifest import read_manifest
from cloob_core.data.summary import summarize
from cloob_core.data.writer import read_records, tar_sample_counts
from cloob_core.errors import StageError
from cloob_core.io import json_bytes

log = logging.getLogger(__name__)
_SAMPLE_PARTS = {"jpg", "txt", "json"}
URL_PATTERN = r"^(?:https?://[^\s/]+\S*|embedded:(?:train|test)/\d+)$"  # the embedded rows of `cloob data acquire`


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

    def line(self) -> str:
        mark = "PASS" if self.success else "FAIL"
        columns = [self.kwargs[k] for k in ("column", "column_A", "column_B") if k in self.kwargs]
        target = f" [{' = '.join(columns)}]" if columns else ""
        bounds = {k: v for k, v in self.kwargs.items() if k not in ("batch_id", "column", "column_A", "column_B")}
        text = f"{mark} {self.suite}: {self.expectation}{target} {bounds or ''}".rstrip()
        if self.unexpected:
            text += f" — {self.unexpected} row(s) break it, e.g. {self.examples[:3]}"
        elif self.observed is not None:
            text += f" — observed {self.observed}"
        return text


@dataclass
class GateReport:
    checks: list[Check] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(check.success for check in self.checks)

    def text(self) -> str:
        failed = sum(not c.success for c in self.checks)
        head = "data gate PASSED" if self.passed else f"data gate FAILED: {failed} of {len(self.checks)} checks"
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
    context: Any, gx: Any, name: str, frame: pd.DataFrame, expectations: list[Any]
) -> tuple[list[Check], dict]:
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
            examples=list(details.get("partial_unexpected_list") or [])[:5],
            kwargs={k: v for k, v in config.kwargs.items() if v is not None},
        ))
    return checks, _reproducible(result.to_json_dict())


def _reproducible(raw: dict[str, Any]) -> dict[str, Any]:
    """GX's result without what differs between two runs on the same data (random ids, the load time), so the
    gate's report is a reproducible DVC output."""
    raw = {key: value for key, value in raw.items() if key != "id"}
    raw["meta"] = {key: value for key, value in raw.get("meta", {}).items() if key != "batch_markers"}
    for item in raw.get("results", []):
        item["expectation_config"] = {k: v for k, v in item["expectation_config"].items() if k != "id"}
    return raw


def manifest_expectations(gxe: Any, config: CloobConfig) -> list[Any]:
    dl, val = config.download, config.validation
    mostly = 1.0 - val.max_bad_row_fraction
    return [
        gxe.ExpectTableRowCountToBeBetween(min_value=val.min_rows),
        gxe.ExpectColumnValuesToMatchRegex(column=dl.url_col, regex=URL_PATTERN, mostly=mostly),
        gxe.ExpectColumnValuesToBeUnique(column=dl.url_col, mostly=mostly),
        gxe.ExpectColumnValuesToMatchRegex(column=dl.caption_col, regex=r"\S", mostly=mostly),
        gxe.ExpectColumnValueLengthsToBeBetween(column=dl.caption_col, min_value=1,
                                                max_value=val.max_caption_chars, mostly=mostly),
    ]


def shard_table(folder: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-shard facts (record vs tar vs sizes.json) and the whole-output totals, as frames to validate."""
    records = read_records(folder)
    try:
        sizes = json.loads(storage.read_bytes(storage.join(folder, "sizes.json")))
    except FileNotFoundError:
        sizes = {}
    rows = []
    for record in records:
        tar_samples = incomplete = unreadable = 0
        if record.tar:
            try:
                for _key, parts in tar_sample_counts(storage.join(folder, record.tar)):
                    tar_samples += 1
                    incomplete += not parts >= _SAMPLE_PARTS
            except (tarfile.TarError, OSError, EOFError) as err:  # missing, truncated or not a tar
                log.warning("shard %s cannot be read: %s", record.tar, err)
                unreadable = 1
        rows.append({
            "shard": record.name, "successes": record.successes, "tar_samples": tar_samples,
            "sizes_json": sizes.get(record.tar, 0) if record.tar else 0, "incomplete_samples": incomplete,
            "unreadable_tar": unreadable,
            "side_min": record.image_sides.get("min", 0), "side_max": record.image_sides.get("max", 0),
        })
    listed_missing = sorted(set(sizes) - {r.tar for r in records if r.tar})
    stats = summarize(folder, records).stats
    totals = pd.DataFrame([{
        "success_ratio": stats["success_ratio"], "shards": len(records),
        "sizes_json_without_record": len(listed_missing), "missing_shards": stats["missing_shards"] or 0,
    }])
    columns = ["shard", "successes", "tar_samples", "sizes_json", "incomplete_samples", "unreadable_tar",
               "side_min", "side_max"]
    return pd.DataFrame(rows, columns=columns), totals


def shard_expectations(gxe: Any, config: CloobConfig) -> tuple[list[Any], list[Any]]:
    val = config.validation
    per_shard = [
        gxe.ExpectColumnValuesToBeBetween(column="successes", min_value=1),
        gxe.ExpectColumnValuesToBeBetween(column="unreadable_tar", max_value=0),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="tar_samples", column_B="successes"),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="sizes_json", column_B="tar_samples"),
        gxe.ExpectColumnValuesToBeBetween(column="incomplete_samples", max_value=0),
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


class GateFailed(StageError):
    """An expectation failed: the data must not go on to the next stage. ``details`` is the whole report."""

    exit_code = 1

    def __init__(self, report: GateReport):
        failed = sum(not check.success for check in report.checks)
        super().__init__(f"data gate FAILED: {failed} of {len(report.checks)} checks")
        self.report, self.details = report, report.text()


def run_gate(config: CloobConfig, *, manifest: str | None = None, shards: str | None = None,
             report_dir: str | None = None) -> GateReport:
    """The manifest suite and/or the shard suite; the report is written (when ``report_dir``) before a failing
    gate raises :class:`GateFailed`."""
    if not manifest and not shards:
        raise ConfigError("the data gate needs a manifest, shards or both")
    gx, gxe, context = _gx()
    report = GateReport()
    if manifest:
        dl = config.download
        frame = read_manifest(manifest, dl.url_col, dl.caption_col, dl.input_format)
        checks, raw = _validate(context, gx, "manifest", frame, manifest_expectations(gxe, config))
        report.checks += checks
        report.raw["manifest"] = raw
    if shards:
        per_shard, totals = shard_table(shards)
        shard_checks, total_checks = shard_expectations(gxe, config)
        checks, raw = _validate(context, gx, "shards", per_shard, shard_checks)
        report.checks += checks
        report.raw["shards"] = raw
        checks, raw = _validate(context, gx, "shard_totals", totals, total_checks)
        report.checks += checks
        report.raw["shard_totals"] = raw
    if report_dir:
        storage.ensure_folder(report_dir)
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
