"""What a pipeline needs of the run before it is sent to a cluster: locations a pod can read, a valid schedule.
The cluster settings themselves are part of the configuration (:mod:`cloob_core.config.cluster`)."""

from __future__ import annotations

import re

from cloob_core.config import PACKAGED_SETS, PACKAGED_SOURCES, CloobConfig, ConfigError


def unreachable_locations(config: CloobConfig, *, acquires: bool = True, evaluates: bool = True) -> list[str]:
    """The run's locations only this machine can read, each as ``key 'value'``: a pod sees the packaged sets
    (and the packaged class lists) and ``s3://``, not this machine's files. ``acquires`` / ``evaluates``: whether the
    pipeline reads ``acquire.source`` / the suite's sources (an imported-shards pipeline acquires nothing)."""
    from cloob_core.evaluation.class_sets import packaged_class_sets

    def local(value: str) -> bool:
        return not value.startswith("s3://")

    found = []
    if acquires and config.acquire.source not in PACKAGED_SETS and local(config.acquire.source):
        found.append(f"acquire.source {config.acquire.source!r}")
    if evaluates:
        for name, entry in config.eval.datasets.items():
            if entry.source not in PACKAGED_SOURCES and local(entry.source):
                found.append(f"eval.datasets.{name}.source {entry.source!r}")
            if entry.classnames and entry.classnames not in packaged_class_sets() and local(entry.classnames):
                found.append(f"eval.datasets.{name}.classnames {entry.classnames!r}")
    if local(config.promote.store):
        found.append(f"promote.store {config.promote.store!r}")
    return found


def check_reachable(config: CloobConfig, *, acquires: bool = True, evaluates: bool = True) -> None:
    """One line naming every location of the run that no pod can read, before anything is sent."""
    found = unreachable_locations(config, acquires=acquires, evaluates=evaluates)
    if found:
        raise ConfigError(f"a pod cannot read this machine's files: {'; '.join(found)}; put them on S3 (s3://…) "
                          "and name them there (--set KEY=s3://…)")


_CRON_FIELD = re.compile(r"^[0-9A-Za-z*?/,#LW-]+$")


def check_cron(expression: str) -> str:
    """A KFP cron expression: six fields, seconds first (``0 0 3 * * *`` is 03:00 daily), or a one-line error; the
    API would refuse a crontab's five only after the upload."""
    fields = expression.split()
    if len(fields) == 5:
        raise ConfigError(f"--cron {expression!r} has 5 fields; KFP's cron has six, seconds first: "
                          f"'0 {expression}'")
    if len(fields) != 6 or not all(_CRON_FIELD.match(field) for field in fields):
        raise ConfigError(f"--cron {expression!r} is not a six-field cron expression (seconds minutes hours "
                          "day-of-month month day-of-week), e.g. '0 0 3 * * *'")
    return expression
