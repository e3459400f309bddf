"""Submission and schedules through the KFP API (kfp.Client): a one-off run, and recurring runs for scheduled
retraining or re-evaluation (one at a time, no catch-up after downtime). The run parameter is the whole
configuration, validated here first so that a bad key fails on the laptop, not in the cluster.

Every call to the endpoint has a deadline: kfp.Client sets none, so an endpoint that accepts a connection and
never answers would hold a scheduled job forever. Its failures (unreachable, refused, HTTP errors) become one
line naming the endpoint."""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloob_core.config import load_config
from cloob_core.config.cluster import ClusterSettings
from cloob_core.errors import StageError
from cloob_core.ops.cluster import check_no_credentials, check_reachable
from pipelines.copied_inputs import read_spec

DEFAULT_TIMEOUT_S = 60.0
ACQUIRING_PIPELINE = "cloob-pretrain-evaluate"  # the one that reads acquire.source (not --data import, not evaluate)


def unregistered_images(package: str) -> list[str]:
    """The images of a compiled pipeline that name no registry (``name:tag``): a node pulls them from Docker Hub,
    where they are not, unless they were loaded onto it."""
    executors = read_spec(package).get("deploymentSpec", {}).get("executors", {})
    images = sorted({executor["container"]["image"] for executor in executors.values() if "container" in executor})
    return [image for image in images if "/" not in image]


def _package_documents(package: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A compiled package's pipeline spec, its Kubernetes platform settings per executor, and its pipeline-level
    Kubernetes settings (kfp's PipelineConfig), from one read."""
    import yaml

    documents = [doc for doc in yaml.safe_load_all(Path(package).read_text("utf-8")) if doc]
    platform: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for document in documents[1:]:
        kubernetes = document.get("platforms", {}).get("kubernetes", {})
        platform.update(kubernetes.get("deploymentSpec", {}).get("executors", {}))
        config.update(kubernetes.get("pipelineConfig", {}))
    return documents[0], platform, config


def job_settings(package: str) -> ClusterSettings | None:
    """The cluster settings a compiled package's multi-node training step runs its job with (its ``job``
    parameter), checked as this version reads them: a package written by another version, or edited by hand (an
    unknown field, ``trainer_release: v2.2`` where it is not known), is refused in one line before anything is
    sent, not at its training step after the data steps ran. None for a package that trains on one node."""
    from pydantic import ValidationError

    from cloob_core.config import ConfigError
    from cloob_core.config.base import describe

    spec, _, _ = _package_documents(package)
    for dag in (spec.get("root", {}), *spec.get("components", {}).values()):  # a loop body is a sub-DAG
        for task in dag.get("dag", {}).get("tasks", {}).values():
            job = task.get("inputs", {}).get("parameters", {}).get("job", {}).get("runtimeValue", {}).get("constant")
            if task.get("taskInfo", {}).get("name") == "train-multinode" and job:
                try:
                    return ClusterSettings.model_validate_json(job).for_cluster()
                except ValidationError as err:
                    raise ConfigError(f"{package}: its training job's settings are not this version's ("
                                      f"{describe(err, 'job settings')}); compile it again with `python -m "
                                      "pipelines compile`") from None
    return None


def training_bound_s(package: str) -> float | None:
    """The longest a run of a compiled pipeline may train: the one-node training step's deadline, or the
    multi-node job's ``job_timeout_s``; None for a pipeline that does not train."""
    _, platform, _ = _package_documents(package)
    if "activeDeadlineSeconds" in platform.get("exec-train", {}):
        return float(platform["exec-train"]["activeDeadlineSeconds"])
    settings = job_settings(package)
    return settings.job_timeout_s if settings is not None else None


def run_bound_s(package: str) -> float | None:
    """The longest a run of a compiled pipeline may take: its own deadline (``run_timeout_s``), else its training
    bound; None for a package with neither."""
    deadline = _package_documents(package)[2].get("activeDeadlineSeconds")
    return float(deadline) if deadline else training_bound_s(package)


def check_schedule_fits(package: str, cron: str) -> None:
    """A recurring run runs one at a time and does not catch up: a run that may outlast the schedule's period would
    skip the runs in between without a word, for as long as it hangs. So the package's bounds, its training's and
    the whole run's, must be shorter than the period."""
    from cloob_core.config import ConfigError
    from cloob_core.ops.cluster import cron_period_s

    period = cron_period_s(cron)
    for bound, what, flag in ((training_bound_s(package), "train", "--job-timeout-s"),
                              (run_bound_s(package), "run", "--run-timeout-s")):
        if bound is not None and bound >= period:
            raise ConfigError(f"a run of {package} may {what} for up to {bound / 3600:.1f} h (its "
                              f"{flag.removeprefix('--').replace('-', '_')}), as long as or longer than the "
                              f"schedule's period of {period / 3600:.1f} h ({cron}): with one run at a time and no "
                              "catch-up, a hung run would skip the runs in between without a word; compile with "
                              f"{flag} below {period:.0f}")


class EndpointError(StageError):
    """The KFP endpoint could not be reached, did not answer in time, or refused the request."""


def run_parameters(params_file: str | None, overrides: Sequence[str] = (),
                   shards_uri: str | None = None, package: str | None = None) -> dict[str, str]:
    """``{"params": <the configuration as JSON>}`` after the same validation every `cloob` command applies;
    plus ``shards_uri`` for the pipeline compiled with ``--data import``. With the compiled ``package`` it is
    going to (a cluster's run), the locations that pipeline reads must be ones a pod can read."""
    config = load_config(params_file, list(overrides))
    if package is not None:
        name = read_spec(package)["pipelineInfo"]["name"]
        check_reachable(config, acquires=name == ACQUIRING_PIPELINE)
        check_no_credentials(config)
        job_settings(package)  # a job its training step could not run, refused before the data steps run
    parameters = {"params": json.dumps(config.model_dump())}
    if shards_uri:
        parameters["shards_uri"] = shards_uri
    return parameters


def dvc_data_url(path: str, repo: str | None = None, rev: str | None = None, remote: str | None = None) -> str:
    """Where a DVC-tracked folder (e.g. ``data/shards`` at a tag) lies on its S3 remote, for the importer.

    Only a remote that keeps the workspace layout (``dvc remote modify NAME worktree true``, or
    ``version_aware true`` for versioned buckets) holds the folder as files under that path; a default,
    content-addressed remote holds a ``.dir`` listing and hashed objects, which the training reader cannot use."""
    import dvc.api
    from dvc.exceptions import DvcException

    try:
        url = dvc.api.get_url(path, repo=repo, rev=rev, remote=remote)
    except DvcException as err:
        raise ValueError(f"cannot resolve {path} through DVC: {err}") from err
    if url.endswith(".dir") or "/files/md5/" in url:
        raise ValueError(f"{path} is stored content-addressed at {url}: push it to a remote with 'worktree true' "
                         "(or 'version_aware true') to import it by URI")
    if not url.startswith("s3://"):
        raise ValueError(f"{path} resolves to {url}, not an s3:// URL the cluster can read")
    _check_unchanged(path, url, repo, rev)
    return url


def _check_unchanged(path: str, url: str, repo: str | None, rev: str | None) -> None:
    """The importer reads the remote folder as it is now: refuse when it no longer holds exactly the files
    (by ETag) that ``rev`` recorded, which happens once a later revision was pushed over it."""
    from dvc.api import DVCFileSystem

    from cloob_core import storage

    recorded = {}
    for name, info in DVCFileSystem(repo, rev=rev).find(path, detail=True).items():
        meta = getattr((info.get("dvc_info") or {}).get("entry"), "meta", None)
        recorded[name[len(path):].lstrip("/")] = getattr(meta, "etag", None)
    current = {name: version.strip('"') for name, _, version in storage.tree_entries(url)}  # one listing
    moved = [name for name, etag in sorted(recorded.items()) if etag is None or current.get(name) != etag]
    if moved:
        raise ValueError(f"{url} no longer holds {path} as {rev or 'the workspace'} recorded it ({len(moved)} of "
                         f"{len(recorded)} files differ, e.g. {moved[0]}): `dvc push` that revision again, or "
                         "submit the revision the remote holds")


def connect(host: str, namespace: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """A client for ``host`` whose every call ends within ``timeout`` seconds; a bearer token, where the cluster
    needs one, comes from ``KFP_TOKEN``."""
    import kfp

    warnings.filterwarnings("ignore", "This client only works with", FutureWarning)  # true of every endpoint today
    client = _within(timeout, host, "connecting", lambda: kfp.Client(
        host=host, namespace=namespace, existing_token=os.environ.get("KFP_TOKEN") or None))
    return _Bounded(client, host, timeout)


class _Bounded:
    """kfp.Client with a deadline on each method call."""

    def __init__(self, client: Any, host: str, timeout: float):
        self._client, self._host, self._timeout = client, host, timeout

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute
        return lambda *args, **kwargs: _within(self._timeout, self._host, name,
                                               lambda: attribute(*args, **kwargs))


def _within(timeout: float, host: str, what: str, call: Callable[[], Any]) -> Any:
    """``call()`` in a daemon thread, abandoned when the deadline passes (the process then exits: nothing of it
    needs cleaning up), its endpoint failures as one line."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed to the caller's thread below
            outcome["error"] = err

    worker = threading.Thread(target=run, daemon=True, name=f"kfp-{what}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise EndpointError(f"{host} did not answer {what} within {timeout:g} s (raise --timeout if it is slow)")
    error = outcome.get("error")
    if error is None:
        return outcome.get("value")
    converted = _endpoint_error(error, host, what)
    if converted is error:
        raise error
    raise converted from error


def _endpoint_error(error: BaseException, host: str, what: str) -> BaseException:
    module = type(error).__module__.split(".")[0]
    if module == "kfp_server_api" and hasattr(error, "status"):
        body = " ".join(str(getattr(error, "body", "") or "").split())[:200]
        return EndpointError(f"{host} refused {what}: HTTP {error.status} {error.reason or ''} {body}".rstrip())
    if module == "urllib3" or isinstance(error, (ConnectionError, TimeoutError)):
        cause = str(getattr(error, "reason", None) or error)
        return EndpointError(f"cannot reach {host} ({what}): {' '.join(cause.split())[:200]}")
    return error


def experiment_id(client: Any, name: str, namespace: str | None = None) -> str:
    """The experiment's id, creating it on first use."""
    return client.create_experiment(name, namespace=namespace).experiment_id


@dataclass(frozen=True)
class Submitted:
    run_id: str
    experiment_id: str


def submit(client: Any, package: str, *, experiment: str, run_name: str, parameters: dict[str, str],
           namespace: str | None = None, enable_caching: bool | None = None,
           service_account: str | None = None) -> Submitted:
    """One run; ``service_account``: the account its steps run as (the endpoint's default when None)."""
    result = client.create_run_from_pipeline_package(package, arguments=parameters, run_name=run_name,
                                                     experiment_name=experiment, namespace=namespace,
                                                     enable_caching=enable_caching, service_account=service_account)
    return Submitted(result.run_id, experiment_id(client, experiment, namespace))


class ScheduleExists(StageError):
    """A recurring run of that name is already in the experiment: a second would run beside it."""


def schedule(client: Any, package: str, *, experiment: str, name: str, cron: str, parameters: dict[str, str],
             namespace: str | None = None, enabled: bool = True, replace: bool = False,
             service_account: str | None = None) -> str:
    """A recurring run on a cron schedule (KFP's six fields, seconds first: ``0 0 3 * * *`` is 03:00 daily),
    at most one run at a time and no backfill of the times missed while paused or down. ``max_concurrency`` holds
    per schedule only, so a second schedule of the same name would overlap the first: it is refused, or with
    ``replace`` the earlier one is deleted once the new one exists."""
    experiment_key = experiment_id(client, experiment, namespace)
    earlier = [entry for entry in _schedules(client, experiment_key) if entry["name"] == name]
    if earlier and not replace:
        raise ScheduleExists(f"experiment {experiment} already has a recurring run named {name!r} "
                             f"({', '.join(entry['id'] for entry in earlier)}); a second would run beside it: "
                             "pass --replace to swap it for this one, or choose another --name")
    recurring = client.create_recurring_run(
        experiment_id=experiment_key, job_name=name, cron_expression=cron,
        max_concurrency=1, no_catchup=True, pipeline_package_path=package, params=parameters, enabled=enabled,
        service_account=service_account)
    for entry in earlier:
        client.delete_recurring_run(entry["id"])
    return recurring.recurring_run_id


def list_schedules(client: Any, experiment: str, namespace: str | None = None) -> list[dict[str, Any]]:
    return _schedules(client, experiment_id(client, experiment, namespace))


def _schedules(client: Any, experiment_key: str) -> list[dict[str, Any]]:
    listed = client.list_recurring_runs(experiment_id=experiment_key, page_size=100)
    return [{"id": r.recurring_run_id, "name": r.display_name, "status": str(r.status),
             "cron": getattr(getattr(getattr(r, "trigger", None), "cron_schedule", None), "cron", None)}
            for r in listed.recurring_runs or []]


def delete_schedule(client: Any, recurring_run_id: str) -> None:
    client.delete_recurring_run(recurring_run_id)
