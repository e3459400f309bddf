"""The pretraining-and-evaluation pipeline: acquire -> manifest gate -> download fanned out over partitions ->
merge -> shard gate -> train on GPU nodes -> the evaluation suite fanned out over data set x task -> report ->
promotion. The stages are the DVC pipeline's, run by the components in components/steps.py."""

# No `from __future__ import annotations`: KFP reads the pipeline parameter types from the live annotations.

import contextlib
import math
from typing import Any

from kfp import dsl, kubernetes

from cloob_core.config.cluster import MAX_DOWNLOAD_GROUPS, ClusterSettings
from cloob_core.ops import pods
from cloob_core.ops.trainjob import WORKFLOW_ENV, WORKFLOW_LABEL
from components import steps
from components.images import CUDA_IMAGE
from pipelines.params import DEFAULT_PARAMS


def on(task: dsl.PipelineTask, step: str, settings: ClusterSettings) -> dsl.PipelineTask:
    """The step's pod as :func:`cloob_core.ops.pods.pod` describes it for these settings, as kfp-kubernetes calls:
    the image's non-root user (a namespace under Pod Security "restricted" admits it; the compiler adds no
    privilege escalation, all capabilities dropped and the runtime's seccomp profile), requests, limits and GPUs,
    placement, environment, the S3 secret's keys as environment variables (never pipeline parameters, so they stay
    out of the run's recorded inputs), volumes, deadline and retries. The Airflow DAGs render the same
    description."""
    pod = pods.pod(step, settings)
    kubernetes.set_security_context(task, run_as_user=pod.run_as, run_as_group=pod.run_as, run_as_non_root=True)
    kubernetes.set_image_pull_policy(task, pod.image_pull_policy)
    task.set_cpu_request(pod.cpu).set_memory_request(pod.memory)
    if pod.memory_limit:
        task.set_memory_limit(pod.memory_limit)
    if pod.gpus:
        task.set_accelerator_type(pod.accelerator).set_accelerator_limit(pod.gpus)
    for key, value in pod.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    if pod.tolerations:
        kubernetes.add_toleration_json(task, list(pod.tolerations))
    if pod.node_affinity:
        kubernetes.add_node_affinity_json(task, dict(pod.node_affinity))
    for key, value in pod.labels.items():
        kubernetes.add_pod_label(task, label_key=key, label_value=value)
    for key, value in pod.annotations.items():
        kubernetes.add_pod_annotation(task, annotation_key=key, annotation_value=value)
    if pod.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(pod.image_pull_secrets))
    for secret in pod.secret_env:
        kubernetes.use_secret_as_env(task, secret_name=secret.secret, optional=secret.optional,
                                     secret_key_to_env={key: key for key in secret.keys})
    for key, value in pod.env.items():
        task.set_env_variable(key, value)
    for key, path in pod.field_env.items():
        kubernetes.use_field_path_as_env(task, env_name=key, field_path=path)
    if pod.shm:
        kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path=pods.SHM_PATH, medium="Memory",
                                   size_limit=pod.shm)
    if pod.spill:
        kubernetes.add_ephemeral_volume(task, volume_name="spill", mount_path=pods.SPILL_PATH,
                                        access_modes=["ReadWriteOnce"], size=pod.spill)
    if pod.timeout_s:
        kubernetes.set_timeout(task, pod.timeout_s)
    if pod.retry:
        task.set_retry(num_retries=pod.retry.count, backoff_duration=f"{pod.retry.backoff_s}s",
                       backoff_factor=pod.retry.factor, backoff_max_duration=f"{pods.MAX_BACKOFF_S}s")
    return task


def build(settings: ClusterSettings | None = None):
    """The pipeline function for these cluster settings (fixed at compile time: resources and scheduling are part
    of the pod spec, not run parameters). ``nodes`` > 1 trains through the Training Operator (``job_kind``
    pytorchjob or trainjob, pods sharing ``job_workdir``). ``data``: ``acquire`` builds the shards in
    ``shards_store`` (acquire -> gate -> download fan-out -> merge); ``import`` takes shards already on S3 (e.g.
    a DVC worktree remote) by their URI. Either way the shards reach the gate and training as a location, not
    an artifact, so no pod copies them."""
    settings = settings or ClusterSettings()
    if settings.nodes > 1 and not settings.image:
        settings = settings.model_copy(update={"image": CUDA_IMAGE})

    def train_and_promote(params: str, shards: Any) -> None:
        if settings.curation:
            shards = curated(params, shards, settings)
        shard_gate = on(steps.validate_shards(params=params, shards=shards), "validate_shards", settings)
        # the shards' folder keeps its name as a crawl grows: a cache hit would skip the last check before GPU hours
        shard_gate.set_caching_options(False)
        trained = train_task(params, shards, settings)
        trained.after(shard_gate)
        trained.set_caching_options(False)  # a retraining run must train, even on unchanged inputs
        reported = evaluate_and_report(params, trained.outputs["model"], settings)
        gate = on(steps.promote(params=params, model=trained.outputs["model"], report=reported.outputs["folder"]),
                  "promote", settings)
        gate.set_caching_options(False)  # production may have moved since a cached decision

    def acquire_train_and_promote(params: str) -> None:
        acquired = on(steps.acquire(params=params, store=settings.shards_store), "acquire", settings)
        acquired.set_caching_options(False)  # the source (a URL or bucket) can change under the same name
        # The shards' folder; the partitions read it from the manifest's metadata instead (kfp.local 2.17 hands a
        # ParallelFor body the loop item in place of any task-output parameter passed into it).
        shards = acquired.outputs["Output"]
        gate = on(steps.validate_manifest(params=params, manifest=acquired.outputs["manifest"]),
                  "validate_manifest", settings)
        gate.set_caching_options(False)  # a gate checks what is there now, never a cached verdict on older data
        # the loop's items are planned at run time from the manifest's index: at most 256 contiguous ranges of
        # shards, so Argo's node status stays far below etcd's object limit whatever the data (docs/kubernetes.md)
        planned = on(steps.plan_download(params=params, manifest=acquired.outputs["manifest"],
                                         most=min(settings.partitions, MAX_DOWNLOAD_GROUPS)), "plan_download", settings)
        planned.after(gate)
        planned.set_caching_options(False)
        with dsl.ParallelFor(items=planned.output,
                             parallelism=min(settings.download_parallelism, settings.partitions)) as part:
            downloaded = steps.download_partition(params=params, manifest=acquired.outputs["manifest"],
                                                  partition=part)
            downloaded.after(gate)
            downloaded.set_caching_options(False)  # it resumes: finished shards in the folder are skipped
            # its memory is bounded (docs/scale.md), so limited: a leak or a runaway worker ends this pod alone
            on(downloaded, "download_partition", settings)
        merged = on(steps.merge_shards(shards=shards, parts=dsl.Collected(downloaded.output)), "merge_shards",
                    settings)
        merged.set_caching_options(False)  # rebuilt from what the folder holds now
        train_and_promote(params, merged.outputs["Output"])

    config = run_config(settings)

    if settings.data == "import":
        @dsl.pipeline(name="cloob-pretrain-evaluate-imported", pipeline_config=config,
                      description="CLOOB pretraining and evaluation on shards already on S3 (imported).")
        def pretrain_imported(shards_uri: str, params: str = DEFAULT_PARAMS):
            with ended_by(settings):
                train_and_promote(params, shards_uri)

        return pretrain_imported

    @dsl.pipeline(name="cloob-pretrain-evaluate", pipeline_config=config,
                  description="CLOOB pretraining and evaluation: data gate, sharded download, training, report.")
    def pretrain_evaluate(params: str = DEFAULT_PARAMS):
        with ended_by(settings):
            acquire_train_and_promote(params)

    return pretrain_evaluate


def run_config(settings: ClusterSettings) -> dsl.PipelineConfig | None:
    """The run's own deadline (``run_timeout_s``, its Workflow's activeDeadlineSeconds): what ends a step whose
    pod is never scheduled, whose own deadline counts from its start."""
    if not settings.run_timeout_s:
        return None
    return dsl.PipelineConfig(active_deadline_seconds=math.ceil(settings.run_timeout_s))


def curated(params: str, shards: Any, settings: ClusterSettings) -> Any:
    """The pool scored (a fan-out over ranges of its shards, one GPU pod each where training has GPUs, as the
    evaluation's features step), then curated beside it: the curated shards' location."""
    planned = on(steps.plan_scoring(params=params, shards=shards, most=min(settings.partitions, MAX_DOWNLOAD_GROUPS)),
                 "plan_scoring", settings)
    planned.set_caching_options(False)  # the pool grows under the same name
    with dsl.ParallelFor(items=planned.outputs["Output"], parallelism=settings.scoring_parallelism) as part:
        scored = steps.score_partition(params=params, pool=planned.outputs["pool"], partition=part)
        scored.set_display_name("score")
        scored.set_caching_options(False)  # retried, it resumes: scored shards keep their parts
        on(scored, "score_partition", settings)
    curation = on(steps.curate(params=params, shards=shards, parts=dsl.Collected(scored.output)), "curate", settings)
    curation.set_caching_options(False)  # the filters are run parameters; the scores grow with the pool
    return curation.outputs["Output"]


def train_task(params: str, shards: Any, settings: ClusterSettings) -> dsl.PipelineTask:
    """One GPU pod (torchrun over its GPUs), or, for several nodes, a small pod that runs the multi-node job and
    waits for it (its service account needs the RBAC in infra/k8s/base/rbac.yaml)."""
    if settings.nodes > 1:
        watcher = steps.train_multinode(params=params, shards=shards, job=settings.to_json(),
                                        run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        # the run's Argo Workflow (ops/trainjob.py): the job's owner, and what tells a stopped run from a drain
        kubernetes.use_field_path_as_env(watcher, env_name=WORKFLOW_ENV,
                                         field_path=f"metadata.labels['{WORKFLOW_LABEL}']")
        return on(watcher, "train_multinode", settings)  # not moved by a consolidation while it watches GPUs
    trained = steps.train(params=params, shards=shards, gpus=settings.gpus, workdir=settings.job_workdir,
                          run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, keep_checkpoints=settings.keep_checkpoints)
    # NCCL's settings (it joins the GPUs of one node too); retried, it resumes from the checkpoints mirrored to
    # workdir; bounded as a multi-node job is (its activeDeadlineSeconds): a hung step does not hold a GPU node for
    # ever; labelled for the PodMonitor in infra/k8s and for Kueue's pod integration (ops/pods.py)
    return on(trained, "train", settings)


@contextlib.contextmanager
def ended_by(settings: ClusterSettings):
    """The pipeline's tasks under an exit handler that deletes the run's multi-node training job, if one is left,
    however the run ends (a watcher deleted by a drain is not retried, and nothing else would end the job before
    its deadline); no handler for one-node training, which is a step of the run."""
    if settings.nodes == 1:
        yield
        return
    ending = steps.end_training_job(job=settings.to_json(), run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
    ending.set_display_name("end training job")
    on(ending, "end_training_job", settings)
    with dsl.ExitHandler(ending, name="the run"):
        yield


def evaluate_and_report(params: str, model: Any, settings: ClusterSettings) -> dsl.PipelineTask:
    """The eval suite of ``params`` (a run parameter, so a recurring run can change it without recompiling),
    fanned out: per data set, its image features once (on a GPU where the settings give one), then one task per
    data set x task on them (CPU pods; retried: they only read), the task results collected per data set; then
    the report over all data sets."""
    planned = on(steps.plan_evaluation(params=params), "plan_evaluation", settings)
    planned.set_caching_options(False)  # it checks that each entry's source is there now; a cache hit would not
    with dsl.ParallelFor(items=planned.output) as dataset:
        features = steps.prepare_features(params=params, dataset=dataset, model=model)
        features.set_display_name("eval features")
        on(features, "prepare_features", settings)  # on a GPU where the settings give it one, else a CPU pod
        with dsl.ParallelFor(items=features.outputs["Output"]) as task:
            evaluated = steps.evaluate(params=params, task=task, model=model, features=features.outputs["features"])
            evaluated.set_display_name("eval task")
            on(evaluated, "evaluate", settings)
        collected = on(steps.collect_dataset(dataset=dataset, parts=dsl.Collected(evaluated.outputs["results"])),
                       "collect_dataset", settings)
        collected.set_display_name("eval data set")
    reported = steps.report(params=params, model=model, datasets=dsl.Collected(collected.outputs["results"]))
    return on(reported, "report", settings)


def build_evaluation(settings: ClusterSettings | None = None):
    """Scheduled re-evaluation of the production model: the same evaluations, and production's stored metrics
    refreshed so the next promotion compares both models on the same sets."""
    settings = settings or ClusterSettings()

    @dsl.pipeline(name="cloob-evaluate-production", pipeline_config=run_config(settings),
                  description="Re-evaluate the production model of promote.store and record its metrics.")
    def evaluate_production(params: str = DEFAULT_PARAMS):
        current = on(steps.production_model(params=params), "production_model", settings)
        current.set_caching_options(False)  # the pointer moves
        reported = evaluate_and_report(params, current.outputs["model"], settings)
        recorded = on(steps.record_production_metrics(params=params, report=reported.outputs["folder"]),
                      "record_production_metrics", settings)
        recorded.set_caching_options(False)

    return evaluate_production
