"""The pipelines' graphs, declared once: their steps, the order between them and their fan-outs, for the
:class:`ClusterSettings` a pipeline is built for (curation on or off, shards acquired or imported, one node or
several). Each step's pod is :func:`cloob_core.ops.pods.pod`; its body is the function of the same name in
:mod:`cloob_core.ops.kubeflow`'s callers (``components/steps.py``). The Kubeflow pipeline (``pipelines/pretrain.py``)
and the Airflow DAGs are both checked against this declaration (tests/test_pipeline_graph.py), so a stage added
here and not there, or wired otherwise, fails a test. Imports neither kfp nor torch."""

from __future__ import annotations

from dataclasses import dataclass

from cloob_core.config.cluster import ClusterSettings

Pipeline = str  # "pretrain" or "evaluate"


@dataclass(frozen=True)
class Step:
    """One step: ``after``, the steps it directly follows (the transitive reduction: nothing implied is listed);
    ``maps_over``, the step whose list of items it fans out over, one task per item (a ParallelFor in KFP, a
    mapped task in Airflow); ``at_end``, a step that runs once the rest has ended, however it ended (KFP's exit
    handler, Airflow's teardown)."""

    name: str
    after: tuple[str, ...] = ()
    maps_over: str | None = None
    at_end: bool = False


def _evaluation(model: str) -> list[Step]:
    """The suite on the model of step ``model``: per data set its features once, then one task per data set x task,
    the results collected per data set, one report."""
    return [Step("plan_evaluation"),
            Step("prepare_features", after=("plan_evaluation", model), maps_over="plan_evaluation"),
            Step("evaluate", after=("prepare_features",), maps_over="prepare_features"),
            Step("collect_dataset", after=("evaluate",), maps_over="plan_evaluation"),
            Step("report", after=("collect_dataset",))]


def pretrain(settings: ClusterSettings) -> list[Step]:
    """The pretraining pipeline: (acquire -> manifest gate -> download fan-out -> merge) or imported shards ->
    (scoring fan-out -> curate) with curation -> shard gate -> training -> the suite -> report -> promotion."""
    steps: list[Step] = []
    last: tuple[str, ...] = ()
    if settings.data == "acquire":
        steps += [Step("acquire"), Step("validate_manifest", after=("acquire",)),
                  Step("plan_download", after=("validate_manifest",)),
                  Step("download_partition", after=("plan_download",), maps_over="plan_download"),
                  Step("merge_shards", after=("download_partition",))]
        last = ("merge_shards",)
    if settings.curation:
        steps += [Step("plan_scoring", after=last),
                  Step("score_partition", after=("plan_scoring",), maps_over="plan_scoring"),
                  Step("curate", after=("score_partition",))]
        last = ("curate",)
    train = "train" if settings.nodes == 1 else "train_multinode"
    steps += [Step("validate_shards", after=last), Step(train, after=("validate_shards",)), *_evaluation(train),
              Step("promote", after=("report",))]
    if settings.nodes > 1:
        steps.append(Step("end_training_job", at_end=True))
    return steps


def evaluate(settings: ClusterSettings) -> list[Step]:
    """Scheduled re-evaluation: the production model on today's suite, its metrics recorded."""
    del settings  # the same graph whatever the cluster: no training, no data steps
    return [Step("production_model"), *_evaluation("production_model"),
            Step("record_production_metrics", after=("report",))]


def graph(pipeline: Pipeline, settings: ClusterSettings) -> list[Step]:
    return pretrain(settings) if pipeline == "pretrain" else evaluate(settings)
