"""One component per pipeline stage. Each body only calls its step in ``cloob_core.ops.kubeflow``, which calls the
stage function the `cloob` command (and so the DVC stage) calls, and fills the artifacts from its result; the
image already holds cloob_core, so nothing is installed at run time (``install_kfp_package=False``: the image
carries kfp too).

The shards go from step to step as a location (a string parameter), not as an artifact: KFP's launcher copies
each input artifact into the pod before the step starts, and shards are the pipeline's one large data. The
manifest, features, reports and the model stay artifacts (`python -m pipelines inputs` lists what is copied)."""

# No `from __future__ import annotations` here: KFP reads the artifact types from the live annotations.
from kfp import dsl
from kfp.dsl import ClassificationMetrics, Dataset, Input, Markdown, Metrics, Model, Output

from components.images import CPU_IMAGE, CUDA_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def acquire(params: str, store: str, manifest: Output[Dataset]) -> str:
    """The run's image-text pairs as the run manifest in ``store`` (acquire.source: the packaged captioned default,
    or a manifest file or folder of parts). The artifact holds its index, and in its metadata where the manifest
    and its shards lie (passed by location: the launcher would copy an artifact into every pod). Returns the
    shards' folder."""
    from cloob_core.ops import kubeflow

    facts = kubeflow.acquire(params, store, index_path=manifest.path)
    manifest.metadata.update(facts)
    return facts["shards"]


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def validate_manifest(params: str, manifest: Input[Dataset], report: Output[Dataset]):
    """The data gate on the manifest: fails the task (and stops the run) when an expectation fails."""
    from cloob_core.ops import kubeflow

    report.metadata.update(kubeflow.validate(params, report.path, manifest=manifest.metadata["manifest"]))


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def plan_download(params: str, manifest: Input[Dataset], most: int) -> list:
    """The download loop's items: at most ``most`` (and 256) partitions I/N, each a contiguous range of shards."""
    from cloob_core.ops import kubeflow

    return kubeflow.plan_download(params, manifest.metadata["manifest"], most)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def download_partition(params: str, manifest: Input[Dataset], partition: str) -> dict:
    """Part I/N of the shards (a contiguous range) into the folder named in the manifest's metadata (so the two
    cannot disagree), which all parts share; reads only its row groups of the manifest; resumable, so a retry or
    a rerun continues. Returns its counts."""
    from cloob_core.ops import kubeflow

    return kubeflow.download(params, manifest.metadata["manifest"], partition, manifest.metadata["shards"])


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def merge_shards(shards: str, parts: list, summary: Output[Metrics]) -> str:
    """sizes.json / stats.json / failures.jsonl of ``shards`` rebuilt in place once every partition (``parts``:
    their counts) is done; returns ``shards`` for the steps that read them."""
    from cloob_core.ops import kubeflow

    for key, value in kubeflow.merge_partitions(shards, parts).items():
        summary.log_metric(key, value)
    summary.metadata["shards"] = shards
    return shards


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def plan_scoring(params: str, shards: str, most: int, pool: Output[Dataset]) -> list:
    """The scoring loop's items: at most ``most`` partitions I/N of the pool's shards. The pool's location goes in
    the artifact's metadata, which the scoring steps read (as the download's partitions read the manifest's)."""
    from cloob_core.ops import kubeflow

    pool.metadata["shards"] = shards
    return kubeflow.plan_scoring(params, shards, most)


@dsl.component(base_image=CUDA_IMAGE, install_kfp_package=False)  # CUDA torch: a GPU pod where it has one
def score_partition(params: str, pool: Input[Dataset], partition: str) -> dict:
    """Part I/N of the pool scored by curation.scorer, beside the pool; resumable. Returns its counts and the
    scores folder."""
    from cloob_core.ops import kubeflow

    return kubeflow.score(params, pool.metadata["shards"], partition)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def curate(params: str, shards: str, parts: list, report: Output[Markdown], summary: Output[Metrics]) -> str:
    """The scored pool curated by the run's curation section beside it (kept.parquet, the report and the curated
    shards, one unit); returns the curated shards' location for the gate and training."""
    from cloob_core.ops import kubeflow

    facts = kubeflow.curate(params, shards, parts, report.path)
    for key, value in facts.items():
        if key != "curated":
            summary.log_metric(key, value)
    summary.metadata["curated"] = facts["curated"]
    return facts["curated"]


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def validate_shards(params: str, shards: str, report: Output[Dataset]):
    """The data gate on the built shards, read where they lie: the last check before GPU hours."""
    from cloob_core.ops import kubeflow

    report.metadata.update({**kubeflow.validate(params, report.path, shards_dir=shards), "shards": shards})


@dsl.component(base_image=CUDA_IMAGE, install_kfp_package=False)
def train(params: str, shards: str, gpus: int, workdir: str, run_id: str, keep_checkpoints: bool,
          model: Output[Model], metrics: Output[Metrics]):
    """`cloob train` on one node, streaming the shards from where they lie; several GPUs run under torchrun,
    one process each. Checkpoints are mirrored to the run's folder of ``workdir``, from which a retry resumes;
    deleted once the run succeeded unless ``keep_checkpoints``."""
    from cloob_core import storage
    from cloob_core.ops import kubeflow, trainjob

    kubeflow.train(params, shards, model.path, gpus, model=model, metrics=metrics,
                   run_folder=storage.join(workdir, trainjob.job_name(run_id)), keep_checkpoints=keep_checkpoints)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def plan_evaluation(params: str) -> list:
    """The eval suite's data sets (each entry checked before any model loads): what the evaluation fans out over."""
    from cloob_core.ops import kubeflow

    return kubeflow.plan_evaluation(params)


@dsl.component(base_image=CUDA_IMAGE, install_kfp_package=False)  # CUDA torch: a GPU pod where it has one
def prepare_features(params: str, dataset: str, model: Input[Model], features: Output[Dataset]) -> list:
    """One data set's image features, computed once for all its task steps; returns the data set's tasks."""
    from cloob_core.ops import kubeflow

    features.metadata["dataset"] = dataset
    return kubeflow.prepare_features(params, dataset, model.path + "/model", features.path)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def evaluate(params: str, task: str, model: Input[Model], features: Input[Dataset], results: Output[Dataset]):
    """One `cloob eval` task on one data set of the suite: the data set whose shared features it reads (named in
    their metadata, so the two cannot disagree)."""
    from cloob_core.ops import kubeflow

    dataset = features.metadata["dataset"]
    results.metadata.update({"dataset": dataset, "task": task})
    results.metadata["results"] = sorted(kubeflow.evaluate(params, dataset, task, model.path + "/model",
                                                           results.path, features.path))


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def collect_dataset(dataset: str, parts: Input[list[Dataset]], results: Output[Dataset], metrics: Output[Metrics],
                    confusion: Output[ClassificationMetrics]):
    """One data set's task results in one folder: its scalars as KFP metrics, its zero-shot confusion matrix."""
    from cloob_core.ops import kubeflow

    results.metadata["dataset"] = dataset
    kubeflow.collect_dataset(dataset, [part.path for part in parts], results.path, metrics=metrics,
                             classification=confusion)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def report(params: str, model: Input[Model], datasets: Input[list[Dataset]], folder: Output[Dataset],
           metrics: Output[Metrics], page: Output[Markdown]):
    """The suite's report: every data set's scalars and the suite means as KFP metrics, the Markdown page (which
    describes the model: how it was trained, from which weights, on which sources)."""
    from cloob_core.ops import kubeflow

    kubeflow.report(params, [dataset.path for dataset in datasets], folder.path, metrics=metrics,
                    markdown_path=page.path, model_dir=model.path + "/model")


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def promote(params: str, model: Input[Model], report: Input[Dataset], decision: Output[Metrics]):
    """The promotion gate: production moves to the new model only when it is better (promote.* settings)."""
    from cloob_core.ops import kubeflow

    kubeflow.promote(params, model.path + "/model", report.path + "/metrics.json", decision)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def production_model(params: str, model: Output[Model]):
    """The model production.json in promote.store points to, for scheduled re-evaluation."""
    from cloob_core.ops import kubeflow

    model.metadata.update({"model_id": kubeflow.fetch_production(params, model.path)["model_id"]})


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def record_production_metrics(params: str, report: Input[Dataset]):
    """Production's metrics on today's evaluation sets, so the next promotion compares like with like."""
    from cloob_core.ops import kubeflow

    kubeflow.record_production_metrics(params, report.path + "/metrics.json")


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def train_multinode(params: str, shards: str, job: str, run_id: str, model: Output[Model],
                    metrics: Output[Metrics]):
    """`cloob train` on several GPU nodes: creates a PyTorchJob / TrainJob (job: its settings) whose pods
    stream the shards from S3, waits for it and fetches the result. This pod only watches, so it needs no GPU
    and no copy of the data, only RBAC for the job kind."""
    from cloob_core.ops import kubeflow

    kubeflow.train_multinode(params, shards, model.path, job, run_id, model=model, metrics=metrics)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def end_training_job(job: str, run_id: str):
    """The run's exit handler, whatever its end: deletes its multi-node training job if one is left (job: its
    settings). A watcher pod deleted by a drain ends its step as Error, which KFP's retry does not cover, and no
    watcher is left then to end the job: without this it would hold its GPUs to its deadline."""
    from cloob_core.ops import kubeflow

    kubeflow.end_training_job(job, run_id)
