"""One pipeline step as a process, for a front that runs each step as a command (the Airflow DAGs: a local task or
a pod): ``python -m cloob_core.ops.task_runner STEP --inputs JSON --output LOCATION --result FILE``.

The step's body is the one the Kubeflow component calls (:mod:`cloob_core.ops.kubeflow`). What KFP's launcher does
around a body is done here: the folders a step reads (a model, features, results, a report) are units published
by the steps before it, read through their record (fetched first when they are on S3), so a step whose output was
never completely published fails the next step in one line, never feeds it half a model; what the step writes is
published as one unit at ``--output``; its small result (locations, counts, the fan-out's items) is written as
JSON to ``--result``, which the front passes on (Airflow's XCom), as ``{"step": STEP, "result": ...}`` and only
once the step has ended well: a front that finds no such record knows the step did not finish, whatever its
runner says (a pod stopped mid-step is reported as a success by Airflow's KubernetesPodOperator, apache/airflow
#73006). Data never goes through the result.

Exit status: 0; 2 for a failure no retry changes (a user's error, a failure recorded as final), which the front
does not retry; 1 for any other failure, which it retries with backoff. The reason is one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cloob_core import publish, storage
from cloob_core.errors import StageError, fail, user_facing
from cloob_core.io import write_text

PERMANENT_EXIT = 2
TRANSIENT_EXIT = 1
Inputs = dict[str, Any]


class _Folders:
    """The units a step reads, as local folders: in place where they are local (checked complete), else fetched
    into a scratch folder that goes with the step."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.count = 0

    def local(self, location: str) -> str:
        if publish.unit_of(location) is None:
            raise publish.IncompleteOutput(f"{location} holds no completely published output: the step that writes "
                                           "it did not finish (was it stopped?); run it again")
        if not storage.is_s3(location):
            return str(location)
        self.count += 1
        folder = self.scratch / f"input-{self.count}"
        publish.fetch(location, folder)
        return str(folder)


def _body(step: str) -> Callable[[Inputs, Path, str, _Folders], Any]:
    """The body of ``step``: (inputs, the local folder it writes, where that folder is published, the inputs'
    folders) -> its result."""
    from cloob_core.ops import kubeflow

    def model_of(inputs: Inputs, folders: _Folders) -> str:
        return str(Path(folders.local(inputs["model"])) / "model")

    def train(i: Inputs, work: Path, output: str, folders: _Folders) -> Any:
        from cloob_core.ops.trainjob import job_name

        run_folder = storage.join(i["workdir"], job_name(i["run_id"]))
        result = kubeflow.train(i["params"], i["shards"], str(work), int(i.get("gpus", 0)), run_folder=run_folder,
                                keep_checkpoints=bool(i.get("keep_checkpoints", True)))
        return {**result, "model": output}

    def prepare_features(i: Inputs, work: Path, output: str, folders: _Folders) -> Any:
        tasks = kubeflow.prepare_features(i["params"], i["dataset"], model_of(i, folders), str(work))
        return [{"dataset": i["dataset"], "task": task, "features": output} for task in tasks]

    def evaluate(i: Inputs, work: Path, output: str, folders: _Folders) -> Any:
        kubeflow.evaluate(i["params"], i["dataset"], i["task"], model_of(i, folders), str(work),
                          folders.local(i["features"]))
        return {"dataset": i["dataset"], "task": i["task"], "results": output}

    def collect_dataset(i: Inputs, work: Path, output: str, folders: _Folders) -> Any:
        parts = [folders.local(part["results"]) for part in i["parts"] if part["dataset"] == i["dataset"]]
        kubeflow.collect_dataset(i["dataset"], parts, str(work))
        return {"dataset": i["dataset"], "results": output}

    def report(i: Inputs, work: Path, output: str, folders: _Folders) -> Any:
        datasets = [folders.local(part["results"]) for part in sorted(i["datasets"], key=lambda p: p["dataset"])]
        metrics = kubeflow.report(i["params"], datasets, str(work), model_dir=model_of(i, folders))
        return {"folder": output, "suite": metrics.get("suite", {})}

    bodies: dict[str, Callable[[Inputs, Path, str, _Folders], Any]] = {
        "acquire": lambda i, work, output, folders: kubeflow.acquire(i["params"], i["store"]),
        "validate_manifest": lambda i, work, output, folders: kubeflow.validate(i["params"], str(work),
                                                                                manifest=i["manifest"]),
        "plan_download": lambda i, work, output, folders: kubeflow.plan_download(i["params"], i["manifest"],
                                                                                 int(i["most"])),
        "download_partition": lambda i, work, output, folders: kubeflow.download(i["params"], i["manifest"],
                                                                                 i["partition"], i["shards"]),
        "merge_shards": lambda i, work, output, folders: {**kubeflow.merge_partitions(i["shards"], i["parts"]),
                                                          "shards": i["shards"]},
        "plan_scoring": lambda i, work, output, folders: kubeflow.plan_scoring(i["params"], i["shards"],
                                                                               int(i["most"])),
        "score_partition": lambda i, work, output, folders: kubeflow.score(i["params"], i["shards"], i["partition"]),
        "curate": lambda i, work, output, folders: kubeflow.curate(i["params"], i["shards"], i["parts"],
                                                                   str(work / "report.md")),
        "validate_shards": lambda i, work, output, folders: {
            **kubeflow.validate(i["params"], str(work), shards_dir=i["shards"]), "shards": i["shards"]},
        "train": train,
        "train_multinode": lambda i, work, output, folders: {
            **kubeflow.train_multinode(i["params"], i["shards"], str(work), i["job"], i["run_id"]), "model": output},
        "end_training_job": lambda i, work, output, folders: kubeflow.end_training_job(i["job"], i["run_id"]),
        "plan_evaluation": lambda i, work, output, folders: kubeflow.plan_evaluation(i["params"]),
        "prepare_features": prepare_features,
        "evaluate": evaluate,
        "collect_dataset": collect_dataset,
        "report": report,
        "promote": lambda i, work, output, folders: kubeflow.promote(
            i["params"], model_of(i, folders), str(Path(folders.local(i["report"])) / "metrics.json")),
        "production_model": lambda i, work, output, folders: {**kubeflow.fetch_production(i["params"], str(work)),
                                                              "model": output},
        "record_production_metrics": lambda i, work, output, folders: kubeflow.record_production_metrics(
            i["params"], str(Path(folders.local(i["report"])) / "metrics.json")),
    }
    if step not in bodies:
        raise StageError(f"no pipeline step {step!r} (the steps: {', '.join(sorted(bodies))})")
    return bodies[step]


def run_step(step: str, inputs: Inputs, output: str) -> Any:
    """``step`` on ``inputs``; what it writes published as one unit at ``output``; its result."""
    body = _body(step)
    with tempfile.TemporaryDirectory(prefix=f"cloob-{step}-") as scratch:
        work = Path(scratch) / "output"
        work.mkdir()
        result = body(inputs, work, output, _Folders(Path(scratch)))
        if any(work.iterdir()):
            publish.publish_copy(work, output)
    return result


def finished(step: str, result: Any) -> dict[str, Any]:
    """The record a step that ended well leaves: its name and its result."""
    return {"step": step, "result": result}


def permanent(err: BaseException) -> bool:
    """Whether no retry changes ``err``: a user's error (a stage's exit status 2) or a failure recorded as final."""
    from cloob_core.ops import final_failure

    return final_failure.permanent(err) or (isinstance(err, StageError) and err.exit_code == PERMANENT_EXIT) or (
        not isinstance(err, StageError) and user_facing(err) and not isinstance(err, OSError))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cloob_core.ops.task_runner", description=__doc__.split("\n")[0])
    parser.add_argument("step")
    parser.add_argument("--inputs", required=True, help="the step's inputs as a JSON object, or @FILE: the file "
                        "that holds it (a long list of parts stays off the command line)")
    parser.add_argument("--output", required=True, help="where the step's files are published (a folder or s3://)")
    parser.add_argument("--result", required=True, help="the file its JSON result is written to")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        inputs = json.loads(Path(args.inputs[1:]).read_text("utf-8") if args.inputs.startswith("@") else args.inputs)
        if not isinstance(inputs, dict):
            raise StageError(f"--inputs: a JSON object, not {type(inputs).__name__}")
        result = run_step(args.step, inputs, args.output)
        write_text(args.result, json.dumps(finished(args.step, result)))
    except (Exception, KeyboardInterrupt) as err:  # every failure: one line and a status
        code = PERMANENT_EXIT if permanent(err) else TRANSIENT_EXIT
        return fail(err, verbose=False, exit_code=code, program=f"step {args.step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
