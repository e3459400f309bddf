"""What the Kubeflow components call. Each step runs the very `cloob` subcommand the DVC stage runs, in process,
with the run's parameters (the text of a params.yaml) written to a file, and fills KFP's typed artifacts from
the stage's outputs. Artifacts are duck-typed (``.path``, ``.metadata``, ``log_metric``,
``log_confusion_matrix``), so this module does not import kfp and the steps run without it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class StageFailed(RuntimeError):
    """A stage exited non-zero: the task fails, and the run stops before anything that depends on it."""


Params = dict[str, Any] | str  # a params.yaml as a mapping (KFP's struct parameter) or as its text


def _params_text(params: Params) -> str:
    import yaml

    return params if isinstance(params, str) else yaml.safe_dump(params, sort_keys=False)


def _write_params(params: Params, folder: str) -> str:
    path = Path(folder) / "params.yaml"
    path.write_text(_params_text(params), encoding="utf-8")
    return str(path)


def run_stage(argv: Sequence[str], params: Params | None = None) -> None:
    from cloob_core.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        code = main([*argv, "--params", _write_params(params, tmp)] if params is not None else list(argv))
    if code != 0:
        raise StageFailed(f"cloob {' '.join(argv)} exited with status {code}")


def acquire(params: Params, manifest_dir: str) -> None:
    run_stage(["data", "acquire", "--output", manifest_dir], params)


def validate(params: Params, report_dir: str, manifest_dir: str | None = None, shards_dir: str | None = None) -> None:
    """The gate; a failure raises, so the run stops here."""
    argv = ["data", "validate", "--report", report_dir]
    if manifest_dir:
        argv += ["--manifest", str(Path(manifest_dir) / "manifest.parquet")]
    if shards_dir:
        argv += ["--shards", shards_dir]
    run_stage(argv, params)


def download(params: Params, manifest_dir: str, partition: str, shards_dir: str) -> None:
    run_stage(["data", "download", "--manifest", str(Path(manifest_dir) / "manifest.parquet"), "--output",
               shards_dir, "--partition", partition, "--no-progress"], params)


def merge_partitions(partition_dirs: Sequence[str], shards_dir: str) -> dict[str, Any]:
    """Put the partitions' shards (disjoint by shard number) in one folder and rebuild its summary files."""
    from cloob_core.data.summary import merge_stats

    target = Path(shards_dir)
    target.mkdir(parents=True, exist_ok=True)
    for folder in partition_dirs:
        for file in sorted(Path(folder).iterdir()):
            if file.is_file() and file.name not in ("sizes.json", "stats.json", "failures.jsonl"):
                shutil.copyfile(file, target / file.name)
    summary = merge_stats(str(target))
    return {"samples": sum(summary.sizes.values()), "shards": len(summary.sizes), "failures": len(summary.failures)}


def _record_training(result: dict[str, Any], model: Any = None, metrics: Any = None) -> dict[str, Any]:
    """The run's figures onto KFP ``Metrics`` and its identity onto the ``Model`` artifact's metadata."""
    if metrics is not None:
        for key in ("final_loss", "steps", "samples_per_second", "train_seconds"):
            metrics.log_metric(key, float(result[key]))
    if model is not None:
        model.metadata.update({key: result[key] for key in ("objective", "architecture", "world_size")})
    return result


def train(params: Params, shards_dir: str, output_dir: str, gpus: int = 0, model: Any = None,
          metrics: Any = None) -> dict[str, Any]:
    """``cloob train`` on this node: in process for one device, under torchrun with one process per GPU."""
    argv = ["train", "--output", output_dir, "--no-progress", "--set", f"train.shards={shards_dir}"]
    if gpus > 1:
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                       "-m", "cloob_core.cli", *argv, "--params", _write_params(params, tmp)]
            log.info("running %s", " ".join(command))
            code = subprocess.run(command, env=os.environ.copy(), check=False).returncode
        if code != 0:
            raise StageFailed(f"torchrun cloob train exited with status {code}")
    else:
        run_stage(argv, params)
    return _record_training(json.loads((Path(output_dir) / "metrics.json").read_text()), model, metrics)


def train_multinode(params: Params, shards_dir: str, shards_uri: str, output_dir: str, job: str,
                    run_id: str, model: Any = None, metrics: Any = None) -> dict[str, Any]:
    """``cloob train`` on several nodes as a PyTorchJob / TrainJob (``job``: JobSettings as JSON); waits for it
    and fetches the published result into ``output_dir``, the layout the one-node step writes."""
    from cloob_core import storage, trainjob

    settings = trainjob.JobSettings.from_json(job)
    name = trainjob.job_name(run_id)
    workdir = storage.join(settings.workdir, name)
    shards = shards_uri
    if not (storage.is_s3(shards_uri) and storage.exists(storage.join(shards_uri, "sizes.json"))):
        shards = storage.join(workdir, "shards")  # the pods cannot read this pod's artifact folder
        log.info("copying the shards to %s for the job's pods", shards)
        storage.upload_tree(shards_dir, shards)
    trainjob.run(trainjob.manifest(settings, name, _params_text(params), shards, workdir), settings)
    storage.download_tree(storage.join(workdir, "output"), output_dir)
    return _record_training(json.loads((Path(output_dir) / "metrics.json").read_text()), model, metrics)


def evaluate(task: str, model_dir: str, output_dir: str, extra: Sequence[str] = ()) -> None:
    run_stage(["eval", task, "--model", model_dir, "--output", output_dir, "--no-progress", *extra])


def report(eval_dirs: Sequence[str], output_dir: str, metrics: Any = None, markdown_path: str | None = None,
           classification: Any = None) -> dict[str, dict]:
    """``cloob eval report``, then the scalars onto a KFP ``Metrics`` artifact, the Markdown page onto a
    ``Markdown`` artifact and the first zero-shot confusion matrix onto a ``ClassificationMetrics`` one."""
    run_stage(["eval", "report", "--inputs", *eval_dirs, "--output", output_dir])
    combined = json.loads((Path(output_dir) / "metrics.json").read_text())
    if metrics is not None:
        for name, scalars in combined.items():
            for key, value in scalars.items():
                metrics.log_metric(f"{name}.{key}", float(value))
    if markdown_path:
        Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(output_dir) / "report.md", markdown_path)
    if classification is not None:
        for record in sorted((Path(output_dir) / "results").glob("*_zeroshot_classification.json")):
            result = json.loads(record.read_text())
            matrix = result["metrics"].get("confusion_matrix")
            names = result["metrics"].get("classnames") or [str(i) for i in range(len(matrix or []))]
            if matrix:
                classification.log_confusion_matrix(list(names), [list(map(int, row)) for row in matrix])
                break
    return combined


def promote(params: Params, model_dir: str, metrics_file: str, decision_metrics: Any = None) -> dict[str, Any]:
    """`cloob promote`; the decision's numbers onto a KFP ``Metrics`` artifact. Not promoting is not a failure."""
    with tempfile.TemporaryDirectory() as tmp:
        output = str(Path(tmp) / "decision.json")
        run_stage(["promote", "--model", model_dir, "--metrics", metrics_file, "--output", output], params)
        decision = json.loads(Path(output).read_text())
    if decision_metrics is not None:
        decision_metrics.log_metric("promoted", float(decision["promoted"]))
        for key in ("candidate_value", "production_value", "improvement"):
            if decision.get(key) is not None:
                decision_metrics.log_metric(key, float(decision[key]))
        decision_metrics.metadata["reason"] = decision["reason"]
    return decision


def fetch_production(params: Params, output_dir: str) -> dict[str, Any]:
    """The production model of ``promote.store`` into ``output_dir/model`` (the layout `cloob train` writes)."""
    from cloob_core import storage
    from cloob_core.config import load_config
    from cloob_core.promotion import read_production

    with tempfile.TemporaryDirectory() as tmp:
        store = load_config(_write_params(params, tmp)).promote.store
    pointer = read_production(store)
    if pointer is None:
        raise StageFailed(f"{store} has no production model yet: run the training pipeline first")
    storage.download_tree(pointer["model"], Path(output_dir) / "model")
    return pointer


def record_production_metrics(params: Params, metrics_file: str) -> None:
    run_stage(["promote", "--record-production-metrics", "--metrics", metrics_file], params)
