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


def push_download_summary(gateway: str | None, stats: dict[str, Any], partition: str) -> bool:
    """A download's outcome: rows, successes, failures by reason and the completion time, per partition."""
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
    return push(gateway, "cloob-download", registry, {"partition": partition})
