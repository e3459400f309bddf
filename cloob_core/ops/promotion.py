"""``cloob promote``: the gate scheduled retraining needs between a new model and production.

The model store (a local folder or an ``s3://`` prefix) holds:
- ``models/<id>/``: every promoted model (the `cloob train` export) with the metrics it was promoted on; ``id`` is a
  prefix of its weights' SHA-256, so the same weights are stored once;
- ``production.json``: the pointer to the production model and its metrics, replaced in one atomic write (a
  rename locally, a single PUT on S3) and only after the model's files are complete;
- ``history/<time>-<id>.json``: every decision, promoted or not, never rewritten.

A candidate is promoted when the configured metric beats production's by at least ``min_improvement`` and no
guarded metric falls by more than its tolerance. Not promoting is a normal outcome: it is reported and recorded,
and the command succeeds. Comparisons use the metrics production was promoted with (or re-evaluated on, see
:func:`record_production_metrics`), and only when both sides were computed on the same evaluation suite: the
report's ``suite.json`` fingerprint (data sets, splits, settings, sources' content) is stored with production's
metrics, and when the candidate's differs the decision is "re-evaluate production first". A metric or guard the
candidate's evaluation did not produce is an error, raised before anything is promoted.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cloob_core import conditional_write, publish, storage
from cloob_core.config import PromoteConfig
from cloob_core.errors import StageError
from cloob_core.evaluation.records import INDEX_FILE, parse_metrics, read_metrics
from cloob_core.evaluation.suite_report import SUITE_FILE
from cloob_core.io import json_bytes, write_json
from cloob_core.model.files import INFO_FILE, STATE_FILE
from cloob_core.model.store import POINTER, check_production_weights, production_folder, weights_id
from cloob_core.model.store import read_pointer as _read_pointer

log = logging.getLogger(__name__)


class PromotionError(StageError):
    """The store or the metrics do not allow a decision (nothing in production, a metric missing)."""


@dataclass
class Decision:
    promoted: bool
    reason: str
    candidate: str  # model id
    production_before: str | None
    metric: str
    candidate_value: float | None = None
    production_value: float | None = None
    improvement: float | None = None
    guards: dict[str, dict[str, float | bool]] = field(default_factory=dict)
    decided_at: str = ""
    decision_id: str = ""  # time-ordered and unique: names its history entry, marks the pointer it wrote
    registry: str | None = None  # the GTO record of a promotion (or why there is none yet)

    def summary(self) -> str:
        verdict = "PROMOTED" if self.promoted else "NOT PROMOTED"
        return f"promotion gate: {verdict} model {self.candidate} — {self.reason}"


def flatten(metrics: dict[str, dict[str, Any]]) -> dict[str, float]:
    """``{"RESULT": {"KEY": value}}`` (a report's metrics.json) → ``{"RESULT.KEY": value}`` for numbers."""
    return {f"{name}.{key}": float(value) for name, scalars in metrics.items() for key, value in scalars.items()
            if isinstance(value, int | float) and not isinstance(value, bool)}


def model_id(model_dir: str | Path) -> str:
    return weights_id(Path(model_dir) / STATE_FILE)


def _check_candidate(model_dir: Path) -> None:
    """A model folder a later stage can load: the weights are there and the description parses."""
    if not model_dir.is_dir():
        raise PromotionError(f"candidate model folder {model_dir} does not exist")
    publish.check_in_place(model_dir)  # inside a published unit (a run's outputs): as it was published
    missing = [name for name in (STATE_FILE, INFO_FILE) if not (model_dir / name).is_file()]
    if missing:
        raise PromotionError(f"{model_dir} has no {' or '.join(missing)}: not a `cloob train` model folder")
    if not isinstance(storage.read_json(model_dir / INFO_FILE), dict):
        raise PromotionError(f"{model_dir / INFO_FILE} does not describe a model (not a JSON object)")


def _lower_is_better(key: str) -> bool:
    return key.endswith("_rank")


def decide(candidate: dict[str, float], production: dict[str, float] | None, settings: PromoteConfig,
           candidate_id: str, production_id: str | None, candidate_suite: str | None = None,
           production_suite: str | None = None) -> Decision:
    """The gate's decision; ``*_suite``: the digests of the suites each side's metrics were computed on."""
    unproduced = [f"promote.{'metric' if key == settings.metric else 'guards'} {key}"
                  for key in (settings.metric, *settings.guards) if key not in candidate]
    if production is None:
        unproduced += [f"promote.min_first {key}" for key in settings.min_first if key not in candidate]
    if unproduced:
        raise PromotionError(f"{'; '.join(unproduced)}: not in the candidate's metrics, its evaluation did not "
                             f"produce it (it has {', '.join(sorted(candidate)[:8])}"
                             f"{', ...' if len(candidate) > 8 else ''})")
    value = candidate[settings.metric]
    decision = Decision(promoted=False, reason="", candidate=candidate_id, production_before=production_id,
                        metric=settings.metric, candidate_value=value if math.isfinite(value) else None)
    checked = (settings.metric, *settings.guards)
    broken = [f"{key} = {candidate[key]}" for key in checked if key in candidate and not math.isfinite(candidate[key])]
    if broken:
        decision.reason = f"the candidate's {', '.join(broken)}: a non-finite metric is never promotable"
        return decision
    if production is None:
        short = [f"{key} = {candidate[key]:.4g} ({'above' if _lower_is_better(key) else 'under'} {floor:g})"
                 for key, floor in settings.min_first.items()
                 if not math.isfinite(candidate[key])
                 or (candidate[key] > floor if _lower_is_better(key) else candidate[key] < floor)]
        if short:
            decision.reason = (f"no production model yet, and the candidate does not reach promote.min_first: "
                               f"{'; '.join(short)}")
        else:
            decision.promoted, decision.reason = True, "no production model yet"
        return decision
    if candidate_suite != production_suite:
        decision.reason = (f"production's metrics were computed on another evaluation suite "
                           f"({_short(production_suite)}, the candidate's {_short(candidate_suite)}): re-evaluate "
                           "production first (the evaluation pipeline, or `cloob eval production`)")
        return decision
    missing = [key for key in (settings.metric, *settings.guards) if key not in production]
    if missing:
        decision.reason = (f"{missing} missing on one side; evaluate both models on the same sets (re-evaluate "
                           "production with the evaluation pipeline)")
        return decision
    broken = [f"{key} = {production[key]}" for key in checked if not math.isfinite(production[key])]
    if broken:
        decision.reason = (f"production's recorded {', '.join(broken)}: no comparison with a non-finite value; "
                           "re-evaluate production (the evaluation pipeline) first")
        return decision
    decision.production_value = production[settings.metric]
    sign = -1.0 if _lower_is_better(settings.metric) else 1.0
    decision.improvement = sign * (candidate[settings.metric] - production[settings.metric])
    regressions = []
    for key, tolerance in settings.guards.items():
        direction = -1.0 if _lower_is_better(key) else 1.0
        change = direction * (candidate[key] - production[key])
        decision.guards[key] = {"candidate": candidate[key], "production": production[key], "change": change,
                                "tolerance": tolerance, "ok": change >= -tolerance}
        if change < -tolerance:
            regressions.append(f"{key} fell by {-change:.4g} (> {tolerance:g})")
    if decision.improvement < settings.min_improvement:
        decision.reason = (f"{settings.metric} improved by {decision.improvement:+.4g}, less than "
                           f"promote.min_improvement {settings.min_improvement:g}")
    elif regressions:
        decision.reason = "guarded metrics regressed: " + "; ".join(regressions)
    else:
        decision.promoted = True
        decision.reason = f"{settings.metric} improved by {decision.improvement:+.4g}; guards held"
    return decision


def _short(suite_digest: str | None) -> str:
    return f"suite {suite_digest[:12]}" if suite_digest else "no suite fingerprint"


def read_production(store: str) -> dict[str, Any] | None:
    return _read_pointer(store)[0]


def fetch_production(store: str, output_dir: str | Path) -> dict[str, Any]:
    """The production model of ``store`` into ``output_dir`` (the folder `cloob train` exports), its weights
    checked against the id the pointer names (their digest's first 16 hex digits); its pointer."""
    folder, pointer = production_folder(store)
    storage.download_tree(folder, output_dir)
    check_production_weights(Path(output_dir) / STATE_FILE, pointer, folder)
    return pointer


# Concurrent gates each retry against the production they lost to; more rounds than this means something keeps
# rewriting the pointer (or the store keeps failing).
CAS_ATTEMPTS = 20


def _swap_pointer(store: str, pointer: dict[str, Any], version: str | None,
                  recorded: Callable[[], bool] = lambda: False) -> bool:
    """Replace the pointer if it is still at ``version``: True when this write took effect. A conflict may be our
    own write whose reply was lost (the server applied it, the client saw a 500 or a reset, and its retry met its
    own write: 412), and another gate may already have replaced it since. So the pointer carries ``write_id`` and
    ``replaced`` (the write it replaced), and ``recorded`` tells whether the write's decision is in the history:
    whoever replaces a pointer records its decision first (:func:`_complete_interrupted`)."""
    location = storage.join(store, POINTER)
    try:
        conditional_write.write_if_unchanged(location, json_bytes(pointer), version)
        return True
    except conditional_write.WriteConflict:
        pass
    except Exception as err:
        if not conditional_write.outcome_unknown(err):
            raise
        log.warning("writing %s failed (%s); reading it back to see whether the write was applied", location,
                    type(err).__name__)
    current, _ = _read_pointer(store)
    landed = bool(current) and pointer["write_id"] in (current.get("write_id"), current.get("replaced"))
    if landed or recorded():
        log.warning("%s: the write was applied although its reply was lost", location)
        return True
    return False


def check_store(settings: PromoteConfig) -> None:
    """Refuse a store on which concurrent gates could overwrite each other: one that ignores conditional writes,
    unless ``promote.single_writer`` says only one gate ever writes. Probed on every run (three small requests),
    so a proxy put in front of a store that passed once is caught too."""
    storage.ensure_folder(settings.store)
    if settings.single_writer or conditional_write.honours_conditional_writes(settings.store):
        return
    raise PromotionError(
        f"the store {settings.store} (endpoint {storage.endpoint()}) ignores conditional writes (If-None-Match / "
        "If-Match): concurrent gates would overwrite each other's promotions; use a store that honours them, or "
        "set promote.single_writer: true if only one gate ever runs at a time")


def _history_name(decision: Decision) -> str:
    return f"{decision.decision_id}-{decision.candidate}.json"


def _record(store: str, decision: Decision) -> None:
    """The decision's entry in ``history/``; its name and bytes follow from the decision, so writing it again
    (a rerun completing an interrupted decision) changes nothing."""
    history = storage.join(store, "history")
    storage.ensure_folder(history)
    storage.write_bytes(storage.join(history, _history_name(decision)), json_bytes(asdict(decision)))


def _is_recorded(store: str, decision: Decision) -> bool:
    return storage.exists(storage.join(store, "history", _history_name(decision)))


def _decision_in(store: str, production: dict[str, Any] | None) -> Decision | None:
    """The decision the pointer carries (None for a pointer of an earlier version, which had none)."""
    if not production or "decision" not in production:
        return None
    try:
        return Decision(**production["decision"])
    except TypeError as err:
        raise PromotionError(f"{store}/{POINTER} holds a decision this version cannot read ({err}); restore the "
                             f"pointer from {store}/history") from None


def _complete_interrupted(store: str, decision: Decision | None) -> bool:
    """Record the pointer's decision in ``history/`` if the gate that made it stopped before that (a crash or a
    full disk between the switch and the record); whether it had to."""
    if decision is None or _is_recorded(store, decision):
        return False
    log.warning("production's promotion of model %s (%s) is not in %s/history (its gate stopped, or has not got "
                "there yet): recording it", decision.candidate, decision.decided_at, store)
    _record(store, decision)
    return True


def _new_decision_id(now: datetime) -> str:
    """Sorts by time (the history's order), unique across gates: ``20261124T010203123456Z-<12 hex>``."""
    return f"{now.strftime('%Y%m%dT%H%M%S%fZ')}-{uuid.uuid4().hex[:12]}"


def decide_and_publish(model_dir: str | Path, metrics: dict[str, dict[str, Any]], settings: PromoteConfig,
                       suite: dict[str, Any] | None = None) -> Decision:
    """Decide against the current production, and on success publish the model and move the pointer with a
    compare-and-swap: if another gate moved production meanwhile, decide again against the new one. So however
    many gates run at once, production ends at the best candidate that passed, and every decision is recorded.
    ``suite``: the fingerprint of the suite the metrics were computed on (a suite report's ``suite.json``).

    The writes are ordered so that a crash anywhere leaves no decision or a complete one: the model's files,
    then the pointer, which carries the whole decision (the switch), then its ``history/`` entry. A gate that
    finds a promotion in the pointer without its entry records it first. A rerun of the production model's gate
    decides nothing new: it reports the decision in force (recording it, if it was interrupted)."""
    store = settings.store
    _check_candidate(Path(model_dir))
    check_store(settings)
    candidate_id = model_id(model_dir)
    candidate = flatten(metrics)
    suite_digest = suite["digest"] if suite else None
    for _attempt in range(CAS_ATTEMPTS):
        production, version = _read_pointer(store)
        earlier = _decision_in(store, production)
        interrupted = _complete_interrupted(store, earlier)
        if earlier is not None and earlier.candidate == candidate_id:  # a rerun: report the decision in force
            earlier.reason += (f" (decided at {earlier.decided_at}; recorded now, that gate stopped before)"
                               if interrupted else f" (decided at {earlier.decided_at}; already in production)")
            return earlier
        now = datetime.now(timezone.utc)
        decision = decide(candidate, production and production["metrics"], settings, candidate_id,
                          production and production["model_id"], suite_digest, production and production.get("suite"))
        decision.decided_at, decision.decision_id = now.isoformat(timespec="seconds"), _new_decision_id(now)
        if not decision.promoted:
            break
        target = storage.join(store, "models", candidate_id)  # content-addressed: a lost race leaves a copy only
        storage.ensure_folder(target)
        storage.upload_tree(model_dir, target)
        storage.write_bytes(storage.join(target, "metrics.json"), json_bytes(metrics))
        if suite:
            storage.write_bytes(storage.join(target, SUITE_FILE), json_bytes(suite))
        pointer = {"model_id": candidate_id, "model": target, "metrics": candidate, "suite": suite_digest,
                   "promoted_at": decision.decided_at, "previous": decision.production_before,
                   "write_id": decision.decision_id, "replaced": production and production.get("write_id"),
                   "decision": asdict(decision)}
        if _swap_pointer(store, pointer, version, lambda d=decision: _is_recorded(store, d)):
            break
        log.info("production moved while model %s was decided on; deciding again", candidate_id)
    else:
        raise PromotionError(f"{store}/{POINTER} changed {CAS_ATTEMPTS} times while deciding; nothing promoted")
    _record(store, decision)
    log.debug(decision.summary())
    return decision


def promote(settings: PromoteConfig, *, model_dir: str | Path, metrics_file: str | Path,
            decision_file: str | Path | None = None) -> Decision:
    """The promotion gate (``cloob promote``, the DVC stage and the Kubeflow step of that name):
    :func:`decide_and_publish` on a report's metrics file, which must be one complete report of this model
    (:func:`read_report`); the decision also as JSON at ``decision_file`` (a DVC metric, a Kubeflow artifact)."""
    report = read_report(metrics_file)
    _check_candidate(Path(model_dir))
    _of_model(report, metrics_file, model_id(model_dir))
    decision = decide_and_publish(model_dir, report.metrics, settings, report.suite)
    _push_decision(settings, decision)
    if decision.promoted and settings.registry_stage:
        from cloob_core.ops.git_registry import record_stage

        decision.registry = record_stage(model_dir, settings.registry_stage, decision.candidate, settings.store).line
    if decision_file is not None:
        write_json(decision_file, asdict(decision))
    return decision


def _push_decision(settings: PromoteConfig, decision: Decision) -> None:
    """The decision to the Pushgateway (``promote.pushgateway``), for the alerts on no decision and no promotion."""
    if not settings.pushgateway:
        return
    from cloob_core.pushgateway import push_promotion

    production = read_production(settings.store) or {}
    since = production.get("promoted_at")
    push_promotion(settings.pushgateway, settings.store, _unix(decision.decided_at) or datetime.now(
        timezone.utc).timestamp(), decision.promoted, decision.candidate, production.get("model_id"),
        _unix(since) if since else None)


def _unix(stamp: str) -> float | None:
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def record_production_stage(settings: PromoteConfig, model_dir: str | Path,
                            decision_file: str | Path | None = None) -> str:
    """``cloob promote --record-stage``: after committing the dvc.lock of a promoted model, its GTO stage. The
    gate's decision file (``decision_file``, when it is this model's) then says so too, as ``dvc metrics show``
    reads it, instead of the gate's "not recorded yet"."""
    from cloob_core.ops.git_registry import RegistryError, record_stage

    pointer = read_production(settings.store)
    candidate = model_id(model_dir)
    if pointer is None or pointer["model_id"] != candidate:
        raise RegistryError(f"{model_dir} holds model {candidate}, and production in {settings.store} is "
                            f"{pointer and pointer['model_id']}: only the production model gets the stage")
    if not settings.registry_stage:
        raise RegistryError("promote.registry_stage is null: no GTO stage to record")
    record = record_stage(model_dir, settings.registry_stage, candidate, settings.store)
    if not record.recorded:
        raise RegistryError(record.line)
    decision = storage.read_json_or(decision_file, None) if decision_file is not None else None
    if isinstance(decision, dict) and decision.get("candidate") == candidate:
        write_json(decision_file, {**decision, "registry": record.line})
    return record.line


@dataclass(frozen=True)
class ReportMetrics:
    """What the gate takes from an evaluation report: its metrics, the suite they were computed on (None for a
    report made without a suite) and the model they are of."""

    metrics: dict[str, dict[str, Any]]
    suite: dict[str, Any] | None
    model: str | None


def read_report(metrics_file: str | Path) -> ReportMetrics:
    """The metrics of one complete report (``cloob eval report``'s output folder): every file is read through
    the report's published unit and checked against its digest, so metrics of an interrupted or mixed report,
    or edited since, are refused; so are results of more than one model."""
    path = Path(metrics_file)
    read_metrics(path)  # a missing file or one that is not a metrics.json: named as such
    unit = publish.unit_of(path.parent)
    if unit is None or path.name not in unit.files or INDEX_FILE not in unit.files:
        raise PromotionError(f"{path} is not part of a complete evaluation report ({publish.UNIT_FILE} beside it "
                             "does not list it): give the metrics.json of a `cloob eval report` output folder")
    metrics = parse_metrics(unit.read(path.name), path)
    models = sorted({str(entry.get("model_id")) for entry in unit.read_json(INDEX_FILE).values()})
    if len(models) != 1:
        raise PromotionError(f"{path} holds results of {len(models)} models ({', '.join(models)}), not of one")
    suite = unit.read_json(SUITE_FILE) if SUITE_FILE in unit.files else None
    return ReportMetrics(metrics, suite, models[0])


def _of_model(report: ReportMetrics, metrics_file: str | Path, model: str) -> None:
    if report.model != model:
        raise PromotionError(f"{metrics_file} holds the results of model {report.model}, not of model {model}: "
                             "evaluate that model and report again")


def refresh_production_metrics(settings: PromoteConfig, *, metrics_file: str | Path) -> dict[str, Any]:
    """``cloob promote --record-production-metrics``: :func:`record_production_metrics` from a report's file,
    which must be of the production model."""
    report = read_report(metrics_file)
    return record_production_metrics(settings, report.metrics, report.suite, model=report.model)


def record_production_metrics(settings: PromoteConfig, metrics: dict[str, dict[str, Any]],
                              suite: dict[str, Any] | None = None, *, model: str | None = None) -> dict[str, Any]:
    """After re-evaluating production (the scheduled evaluation pipeline): its metrics on today's suite (they
    replace the earlier ones, with the suite's fingerprint), so the next gate compares like with like. The pointer
    is rewritten with a compare-and-swap (a promotion in between wins, and these metrics, measured on the old
    model, are not recorded); the model does not change. ``model``: the id of the model the metrics are of (when
    known), which must be production's."""
    measured = flatten(metrics)
    broken = sorted(key for key, value in measured.items() if not math.isfinite(value))
    if broken:
        raise PromotionError(f"non-finite metrics {broken[:5]}: not recorded for production")
    store = settings.store
    check_store(settings)
    production, version = _read_pointer(store)
    if production is None:
        raise PromotionError(f"{store} has no {POINTER}: nothing is in production yet")
    if model is not None and model != production["model_id"]:
        raise PromotionError(f"the metrics are of model {model}, and production in {store} is model "
                             f"{production['model_id']}: re-evaluate the production model")
    _complete_interrupted(store, _decision_in(store, production))  # who replaces a pointer records its decision
    production = {**production, "metrics": measured, "suite": suite["digest"] if suite else None,
                  "evaluated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "write_id": uuid.uuid4().hex, "replaced": production.get("write_id")}
    if not _swap_pointer(store, production, version):
        raise PromotionError(f"production in {store} changed while its metrics were recorded (a promotion); "
                             "re-evaluate the new production model")
    return production
