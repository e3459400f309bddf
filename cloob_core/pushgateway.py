"""Pushing a batch step's metrics to a Prometheus Pushgateway: steps that end before Prometheus would scrape
them (a download partition, a short training run) leave their last values there for the alert rules."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def push(gateway: str | None, job: str, registry: Any, grouping: dict[str, str] | None = None) -> bool:
    """Replace this job's (and grouping's) metrics on the gateway. Never raises: monitoring must not fail the
    work it watches; a failure is logged."""
    if not gateway:
        return False
    from prometheus_client import push_to_gateway

    try:
        push_to_gateway(gateway, job=job, registry=registry, grouping_key=grouping or {}, timeout=5)
    except OSError as err:
        log.warning("could not push metrics to %s: %s", gateway, err)
        return False
    return True


def delete(gateway: str | None, job: str, grouping: dict[str, str] | None = None) -> bool:
    """Delete this job's (and grouping's) metrics from the gateway: a run that ended well leaves no group behind.
    Never raises, as :func:`push`."""
    if not gateway:
        return False
    from prometheus_client import delete_from_gateway

    try:
        delete_from_gateway(gateway, job=job, grouping_key=grouping or {}, timeout=5)
    except OSError as err:
        log.warning("could not delete metrics from %s: %s", gateway, err)
        return False
    return True


def push_download_summary(gateway: str | None, stats: dict[str, Any], partition: str, run: str) -> bool:
    """A download's outcome: rows, successes, failures by reason and the completion time, per run (its output's
    :func:`run_label`: concurrent downloads into other folders keep their own groups) and partition."""
    if not gateway:
        return False
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    Gauge("cloob_download_rows", "Manifest rows attempted", registry=registry).set(stats.get("rows", 0))
    Gauge("cloob_download_successes", "Images written to shards", registry=registry).set(stats.get("successes", 0))
    failures = Gauge("cloob_download_failures", "Rows that failed, by reason", ["reason"], registry=registry)
    for reason, count in (stats.get("failures_by_reason") or {}).items():
        failures.labels(reason=reason).set(count)
    Gauge("cloob_download_success_ratio", "Successes / rows", registry=registry).set(stats.get("success_ratio", 0.0))
    Gauge("cloob_download_last_completion_timestamp_seconds", "Unix time the download finished",
          registry=registry).set_to_current_time()
    return push(gateway, "cloob-download", registry, {"run": run, "partition": partition})


def push_promotion(gateway: str | None, store: str, decided_at: float, promoted: bool, candidate: str,
                   production: str | None, production_since: float | None) -> bool:
    """A promotion gate's decision, grouped by the model store (one group per store, replaced by each decision):
    when it was made, whether it promoted, the models, and since when production holds."""
    if not gateway:
        return False
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    Gauge("cloob_promotion_decision_timestamp_seconds", "Unix time of the gate's last decision",
          registry=registry).set(decided_at)
    Gauge("cloob_promotion_promoted", "1 if the last decision promoted its candidate", registry=registry).set(
        float(promoted))
    Gauge("cloob_promotion_info", "The last decision's candidate and the production model after it",
          ["candidate", "production"], registry=registry).labels(candidate=candidate,
                                                                 production=production or "").set(1)
    if production_since is not None:
        Gauge("cloob_promotion_production_since_timestamp_seconds", "Unix time the production model was promoted",
              registry=registry).set(production_since)
    return push(gateway, "cloob-promote", registry, {"store": store})


def run_label(location: str) -> str:
    """A run's name in its metrics' grouping key: stable across restarts of the run (it comes from where the run
    writes: a training run's checkpoints, the S3 mirror on a cluster, else its output folder; a download's shards
    folder), distinct between runs, and short.
    ``s3://b/jobs/cloob-train-abc/checkpoints`` -> ``cloob-train-abc-checkpoints-1a2b3c4d``."""
    import hashlib
    import re

    tail = "-".join(part for part in location.rstrip("/").split("/")[-2:] if part)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", tail).strip("-")[-48:] or "run"
    return f"{slug}-{hashlib.sha1(location.encode()).hexdigest()[:8]}"
