"""The bodies of the Kubeflow steps: each parses the run's parameters (the text of a params.yaml), calls the same
stage function the ``cloob`` command calls, and fills KFP's typed artifacts from the stage's result object. A
stage that fails raises its typed error, whose message is what the run shows.

The run manifest and the shards are passed by location (an ``s3://`` prefix on a cluster), never as artifacts: the
KFP launcher copies every input artifact into the pod before a step starts, which for a LAION-sized manifest is tens
of GB per download pod and for its shards hundreds of TB. The manifest's KFP artifact holds its index and, in its
metadata, the two locations.
The download partitions write into one folder, the merge only rebuilds its summary files there, and the gate and
training stream the tars from where they lie.

Artifacts are duck-typed (``.path``, ``.metadata``, ``log_metric``, ``log_confusion_matrix``), so this module
does not import kfp and the steps run without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cloob_core import storage
from cloob_core.config import CloobConfig, ConfigError, Values, config_from_mapping, config_from_text
from cloob_core.errors import StageError
from cloob_core.io import write_text
from cloob_core.ops.pods import SPILL_ENV
from cloob_core.threads import limit_spinning

log = logging.getLogger(__name__)
Params = dict[str, Any] | str  # a params.yaml as a mapping (KFP's struct parameter) or as its text


class TrainingFailed(StageError):
    """The torchrun processes of a multi-GPU training step exited with an error (their log says which)."""

    def __init__(self, message: str, exit_code_of_processes: int) -> None:
        super().__init__(message)
        self.exit_code_of_processes = exit_code_of_processes


def _config(params: Params, values: Values | None = None) -> CloobConfig:
    """The run's parameters (params.yaml's text, or its mapping) validated, with a step's own ``values``."""
    if isinstance(params, str):
        return config_from_text(params, source="the run's params", values=values)
    return config_from_mapping(params, values=values)


@contextlib.contextmanager
def _spilling(params: Params) -> Iterator[CloobConfig]:
    """The run's parameters for a step that spills, on its spill volume where the pipeline gave it one
    (``ClusterSettings.spill_disk``): the engine's spill (``engine.spill_dir``) and, while the stage runs, this
    process's temporary files (SemDeDup's buckets, staging) go there. A kfp.local run has none, and spills where
    the params say."""
    spill = os.environ.get(SPILL_ENV)
    if not (spill and Path(spill).is_dir()):
        yield _config(params)
        return
    before = tempfile.tempdir  # this process only: not TMPDIR, which the launcher's own shell would need too
    tempfile.tempdir = spill
    try:
        yield _config(params, values={"engine": {"spill_dir": spill}})
    finally:
        tempfile.tempdir = before


def acquire(params: Params, store: str, index_path: str | None = None) -> dict[str, Any]:
    """The run manifest, written to the folder of ``store`` named by its source (a later run of a grown source
    reads only its new parts), and the folder its shards are built in (named by the source and the shaping
    settings: a rerun resumes, a grown source adds shards); rows, parts, source and both locations. With
    ``index_path``, a copy of the manifest's index is written there (the KFP artifact's content)."""
    from cloob_core.data.acquire import acquire as acquire_stage
    from cloob_core.data.plan import manifest_folder, shards_folder

    with _spilling(params) as config:
        result = acquire_stage(config, manifest_folder(store, config.acquire.source, config.acquire.split))
    shards = shards_folder(store, result.source, config)
    if index_path:
        from cloob_core import storage
        from cloob_core.data.run_manifest import INDEX_NAME

        Path(index_path).parent.mkdir(parents=True, exist_ok=True)
        Path(index_path).write_bytes(storage.read_bytes(storage.join(result.manifest, INDEX_NAME)))
    log.info("acquired %d rows in %d part(s) (%d unchanged) from %s: %s; its shards: %s", result.rows,
             result.parts, result.parts_reused, result.source, result.manifest, shards)
    return {"rows": result.rows, "parts": result.parts, "source": result.source, "manifest": result.manifest,
            "shards": shards}


def validate(params: Params, report_dir: str, manifest: str | None = None,
             shards_dir: str | None = None) -> dict[str, Any]:
    """The gate; a failure raises :class:`~cloob_core.data.validate.GateFailed`, so the run stops here."""
    from cloob_core.data.validate import run_gate

    with _spilling(params) as config:
        report = run_gate(config, manifest=manifest, shards=shards_dir, report_dir=report_dir)
    log.info("%s", report.text())
    return {"passed": report.passed, "checks": len(report.checks)}


def plan_download(params: Params, manifest: str, most: int) -> list[str]:
    """The download fan-out: ``min(most, MAX_DOWNLOAD_GROUPS, shards)`` partitions, each a contiguous range of
    shards, from the manifest's index alone. Decided here, at run time, because the shard count is the data's."""
    from cloob_core.config.cluster import MAX_DOWNLOAD_GROUPS
    from cloob_core.data.run_manifest import RunManifest

    shards = RunManifest.open(manifest).shard_count(_config(params).preprocess.shard_size)
    count = max(1, min(most, MAX_DOWNLOAD_GROUPS, shards))
    log.info("%d shards in %d download group(s)", shards, count)
    return [f"{index}/{count}" for index in range(count)]


def download(params: Params, manifest: str, partition: str, shards: str) -> dict[str, Any]:
    """One partition of the shards, written into the shared folder ``shards`` (partitions own disjoint, contiguous
    ranges of shards); its counts."""
    from cloob_core.data.download import download as download_stage
    from cloob_core.data.manifest import Partition
    from cloob_core.data.summary import format_summary

    result = download_stage(manifest, shards, _config(params), partition=Partition.parse(partition), progress=False)
    log.info("partition %s: %s", partition, format_summary(result.summary))
    stats = result.summary.stats
    return {"partition": partition, "rows": stats.get("rows", 0), "successes": stats.get("successes", 0),
            "shards_built": result.shards_done, "shards_resumed": result.shards_skipped}


def merge_partitions(shards: str, parts: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The whole folder's summary files (sizes.json, stats.json, failures.jsonl), rebuilt in place from the
    partitions' shard records once all have finished (``parts``: what :func:`download` returned for each, logged);
    nothing is copied."""
    from cloob_core.data.summary import format_summary, merge_stats

    for part in sorted(parts, key=lambda part: str(part.get("partition"))):
        log.info("partition %s: %s", part.get("partition"), ", ".join(f"{k} {v}" for k, v in part.items()
                                                                     if k != "partition"))
    summary = merge_stats(shards)
    log.info("%s: %s", shards, format_summary(summary))
    return {"samples": sum(summary.sizes.values()), "shards": len(summary.sizes), "failures": summary.stats["failures"]}


def plan_scoring(params: Params, shards: str, most: int) -> list[str]:
    """The scoring fan-out over the pool ``shards``: ``min(most, shards)`` contiguous ranges, one pod each. Refused
    in one line before any pod starts when the run's params do not enable curation or name no scorer."""
    from cloob_core.curation.switch import scorer_source
    from cloob_core.data.shard_files import shard_list

    config = _config(params)
    if not config.curation.enabled:
        raise ConfigError("this pipeline curates (compiled with curation): set curation.enabled and curation.scorer "
                          "in the run's params, or run a pipeline compiled without curation")
    scorer_source(config)  # named, or one line now
    count = max(1, min(most, len(shard_list(shards)[0])))
    log.info("%s: scored in %d partition(s)", shards, count)
    return [f"{index}/{count}" for index in range(count)]


def score(params: Params, shards: str, partition: str) -> dict[str, Any]:
    """One partition of the pool scored by ``curation.scorer`` into the scores folder of that model beside the pool
    (:func:`~cloob_core.curation.switch.scores_location`); a retry or a grown pool scores only what lacks a part."""
    from cloob_core.curation.score import ScoreRequest
    from cloob_core.curation.score import score as score_stage
    from cloob_core.curation.switch import scorer_source, scores_location
    from cloob_core.data.manifest import Partition
    from cloob_core.model.source import load_model

    source = scorer_source(_config(params))
    model = load_model(source)
    scores = scores_location(shards, model.fingerprint)
    result = score_stage(ScoreRequest(shards, source, scores, Partition.parse(partition), progress=False), model)
    for line in result.lines:
        log.info("partition %s: %s", partition, line)
    return {"partition": partition, "scores": scores, "scored": result.scored, "rows": result.rows,
            "unreadable": result.unreadable}


def curate(params: Params, shards: str, parts: Sequence[dict[str, Any]], report_path: str) -> dict[str, Any]:
    """The pool ``shards``, scored by the partitions ``parts`` (what :func:`score` returned for each), curated by
    the run's curation section into the curated folder beside it (one unit, republished whole); its report's
    markdown copied to ``report_path`` (the run's page); the counts and the curated location."""
    from cloob_core.curation.curate import REPORT_MD
    from cloob_core.curation.curate import curate as curate_stage
    from cloob_core.curation.switch import curated_location, scorer_source

    folders = sorted({str(part["scores"]) for part in parts})
    if len(folders) != 1:
        raise StageError(f"the scoring partitions wrote {len(folders)} scores folders ({', '.join(folders)}): each "
                         "loaded another model (did production move during the run?); run again")
    output = curated_location(shards)
    with _spilling(params) as config:
        result = curate_stage(shards, folders[0], output, config, scorer_source(config))
    for line in result.lines:
        log.info("%s", line)
    write_text(report_path, storage.read_bytes(storage.join(output, REPORT_MD)).decode())
    selection = result.selection
    return {"curated": output, "rows": selection.rows, "kept": selection.kept,
            **{f"removed_{reason}": count for reason, count in selection.removed_by.items()}}


def _record_training(result: dict[str, Any], shards: str, model: Any = None, metrics: Any = None) -> dict[str, Any]:
    """The run's figures onto KFP ``Metrics``; its identity and the shards it read (its data lineage, as they
    are no input artifact) onto the ``Model`` artifact's metadata."""
    if metrics is not None:
        for key in ("final_loss", "steps", "samples_per_second", "train_seconds"):
            metrics.log_metric(key, float(result[key]))
    if model is not None:
        model.metadata.update({key: result[key] for key in ("objective", "architecture", "world_size")})
        model.metadata["shards"] = shards
    return result


def train(params: Params, shards: str, output_dir: str, gpus: int = 0, model: Any = None,
          metrics: Any = None, run_folder: str | None = None, keep_checkpoints: bool = True) -> dict[str, Any]:
    """Training on this node, streaming the shards from ``shards`` (a folder or ``s3://`` prefix): in process for
    one device; with several GPUs, torchrun starts one `cloob train` process per GPU (each a rank of the same
    stage function) on the configuration validated here. A step given GPUs trains on them or fails in one line,
    never on its CPU (:func:`launch.on_gpus`). ``run_folder``: the run's folder, where each checkpoint is mirrored
    (``checkpoints/``), where a retry of the step (a fresh pod, an empty output folder) resumes from (``--resume
    auto``: only this run's), and where a failure no retry changes is recorded, so that the retries end at once
    (:mod:`final_failure`). Without ``keep_checkpoints`` the mirrored checkpoints are deleted once the run
    succeeded: nothing resumes from them then."""
    if not run_folder:
        return _train_here(params, shards, output_dir, gpus, model, metrics, None)
    from cloob_core.ops import final_failure

    final_failure.refuse_if_failed(run_folder)
    checkpoints = storage.join(run_folder, "checkpoints")
    try:
        result = _train_here(params, shards, output_dir, gpus, model, metrics, checkpoints)
    except Exception as err:
        if final_failure.permanent(err):
            final_failure.record(run_folder, err)
        raise
    if not keep_checkpoints:
        _delete_checkpoints(checkpoints)
    return result


def _delete_checkpoints(checkpoints: str) -> None:
    """A succeeded run's mirrored checkpoints, deleted (best effort: the model is out either way)."""
    try:
        storage.delete_tree(checkpoints)
        log.info("deleted the run's checkpoints at %s (keep them with the cluster setting keep_checkpoints)",
                 checkpoints)
    except OSError as err:
        log.warning("could not delete the run's checkpoints at %s: %s", checkpoints, err)


def _train_here(params: Params, shards: str, output_dir: str, gpus: int, model: Any, metrics: Any,
                checkpoints: str | None) -> dict[str, Any]:
    from cloob_core.ops import launch
    from cloob_core.training.loop import train as train_stage

    values: dict[str, Any] = {"shards": shards}
    if checkpoints:
        values["checkpoint_sync"] = checkpoints
    config = launch.on_gpus(_config(params, values={"train": values}), gpus)  # fails here, not per rank
    config.train.check_shape(max(gpus, 1))
    if gpus <= 1:
        return _record_training(train_stage(config, output_dir, resume="auto", progress=False).metrics, shards,
                                model, metrics)
    with tempfile.TemporaryDirectory() as tmp:
        params_file = write_text(Path(tmp) / launch.PARAMS_FILE, launch.config_text(config))
        command = launch.torchrun_train(str(params_file), output_dir, processes=gpus, extra=["--resume", "auto"])
        log.info("running %s", " ".join(command))
        code = subprocess.run(command, env=os.environ.copy(), check=False).returncode
    if code != 0:
        raise TrainingFailed(f"torchrun cloob train exited with status {code}; the ranks' log above says why", code)
    return _record_training(storage.read_json(Path(output_dir) / "metrics.json"), shards, model, metrics)


def train_multinode(params: Params, shards: str, output_dir: str, job: str, run_id: str, model: Any = None,
                    metrics: Any = None) -> dict[str, Any]:
    """Training on several nodes as a PyTorchJob / TrainJob (``job``: the ClusterSettings as JSON) whose pods
    stream the shards from ``shards`` (an ``s3://`` prefix: they share nothing else); waits for it and fetches
    the published result into ``output_dir``, the layout the one-node step writes."""
    from cloob_core import publish, storage
    from cloob_core.config import ConfigError
    from cloob_core.config.cluster import ClusterSettings
    from cloob_core.ops import final_failure, trainjob

    config = _config(params)  # a bad configuration fails here, before any pod starts
    if not storage.is_s3(shards):
        raise ConfigError(f"a multi-node job's pods share only object storage: its shards must be an s3:// "
                          f"prefix, not {shards!r} (compile with --shards-store s3://…)")
    settings = ClusterSettings.from_json(job)
    config.train.check_shape(settings.nodes * max(settings.gpus, 1))
    name = trainjob.job_name(run_id)
    workdir = storage.join(settings.job_workdir, name)
    final_failure.refuse_if_failed(workdir)  # before any job is created or adopted
    job = trainjob.job_config(config, shards, workdir, settings.gpus, settings.metrics_port)
    try:
        trainjob.run(trainjob.manifest(settings, name, job, workdir), settings)
    except trainjob.JobFailed as err:
        if final_failure.permanent(err):
            final_failure.record(workdir, err)
        raise
    publish.fetch(storage.join(workdir, "output"), output_dir)  # the unit rank 0 published: old or new, whole
    if not settings.keep_checkpoints:
        _delete_checkpoints(storage.join(workdir, "checkpoints"))
    return _record_training(storage.read_json(Path(output_dir) / "metrics.json"), shards, model, metrics)


def end_training_job(job: str, run_id: str) -> str:
    """The run's multi-node training job deleted if it is still there (the run has ended: nothing watches it any
    more); what was done, as a line."""
    from cloob_core.config.cluster import ClusterSettings
    from cloob_core.ops import trainjob

    line = trainjob.end_job(ClusterSettings.from_json(job), trainjob.job_name(run_id))
    log.info("%s", line)
    return line


def plan_evaluation(params: Params) -> list[str]:
    """The suite's data sets, every entry checked (its source there, its class list known) before any model is
    loaded: the Kubeflow pipelines fan out over this list."""
    from cloob_core.evaluation.suite_plan import plan_suite

    return list(plan_suite(_config(params).eval))


def prepare_features(params: Params, dataset: str, model_dir: str, features_dir: str) -> list[str]:
    """The image features of one data set, computed once for all its task steps; returns its tasks."""
    from cloob_core.evaluation.suite import prepare_features as prepare
    from cloob_core.model.source import ModelSource

    return prepare(_config(params).eval, dataset, ModelSource(model=model_dir), features_dir, progress=False)


def evaluate(params: Params, dataset: str, task: str, model_dir: str, output_dir: str,
             features_dir: str | None = None) -> dict[str, dict[str, Any]]:
    """One task on one data set of the suite, into ``output_dir/<data set>``; its metrics by result name."""
    limit_spinning("coarse")  # before torch loads: a task's math is a few large ops (cloob_core.threads)
    from cloob_core.evaluation.suite import evaluate_suite
    from cloob_core.model.source import ModelSource

    (result,) = evaluate_suite(_config(params).eval, ModelSource(model=model_dir), output_dir, datasets=[dataset],
                               tasks=[task], shared_features=Path(features_dir) if features_dir else None,
                               progress=False)
    for line in result.lines:
        log.info("%s", line)
    return result.metrics


def collect_dataset(dataset: str, part_dirs: Sequence[str], output_dir: str, metrics: Any = None,
                    classification: Any = None) -> dict[str, dict]:
    """One data set's task results in one folder; its scalars onto a KFP ``Metrics`` artifact and its zero-shot
    confusion matrix onto a ``ClassificationMetrics`` one (a data set without zero-shot leaves it empty)."""
    from cloob_core.evaluation.records import combine_reports

    combined = combine_reports([Path(folder) / dataset for folder in part_dirs], Path(output_dir)).metrics
    _log_metrics(combined, metrics)
    if classification is not None:
        for record in sorted((Path(output_dir) / "results").glob("*_zeroshot_classification.json")):
            result = storage.read_json(record)["metrics"]
            matrix = result.get("confusion_matrix")
            if matrix:
                names = result.get("classnames") or [str(i) for i in range(len(matrix))]
                classification.log_confusion_matrix(list(names), [list(map(int, row)) for row in matrix])
    return combined


def _log_metrics(combined: dict[str, dict], metrics: Any) -> None:
    if metrics is not None:
        for name, scalars in combined.items():
            for key, value in scalars.items():
                metrics.log_metric(f"{name}.{key}", float(value))


def report(params: Params, dataset_dirs: Sequence[str], output_dir: str, metrics: Any = None,
           markdown_path: str | None = None, model_dir: str | None = None) -> dict[str, dict]:
    """The suite's report over the data sets' folders (describing the model of ``model_dir``): every result and
    the suite means onto a KFP ``Metrics`` artifact, the Markdown page onto a ``Markdown`` one."""
    from cloob_core.evaluation.suite_report import suite_report
    from cloob_core.evaluation.tables import summary_table

    combined = suite_report(_config(params).eval, dataset_dirs, output_dir, model=model_dir).metrics
    log.info("%s", summary_table(combined))
    _log_metrics(combined, metrics)
    if markdown_path:
        Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(output_dir) / "report.md", markdown_path)
    return combined


def promote(params: Params, model_dir: str, metrics_file: str, decision_metrics: Any = None) -> dict[str, Any]:
    """The promotion gate; the decision's numbers onto a KFP ``Metrics`` artifact. Not promoting is not a
    failure."""
    from dataclasses import asdict

    from cloob_core.ops.promotion import promote as promote_stage

    gate = promote_stage(_config(params).promote, model_dir=model_dir, metrics_file=metrics_file)
    log.info("%s", gate.summary())
    decision = asdict(gate)
    if decision_metrics is not None:
        decision_metrics.log_metric("promoted", float(decision["promoted"]))
        for key in ("candidate_value", "production_value", "improvement"):
            if decision.get(key) is not None:
                decision_metrics.log_metric(key, float(decision[key]))
        decision_metrics.metadata["reason"] = decision["reason"]
    return decision


def fetch_production(params: Params, output_dir: str) -> dict[str, Any]:
    """The production model of ``promote.store`` into ``output_dir/model`` (the layout `cloob train` writes)."""
    from cloob_core.ops.promotion import fetch_production as fetch

    return fetch(_config(params).promote.store, Path(output_dir) / "model")


def record_production_metrics(params: Params, metrics_file: str) -> None:
    from cloob_core.ops.promotion import refresh_production_metrics

    refresh_production_metrics(_config(params).promote, metrics_file=metrics_file)
