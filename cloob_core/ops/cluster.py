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

    def local(value: str) -> bool:  # a path, or a file:// URL; s3://, https:// and the like a pod can reach
        scheme = _SCHEME.match(value)
        return scheme is None or scheme.group(1).lower() == "file"

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


_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")


_MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
_DAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")
# KFP's scheduler parses crons with robfig/cron: six fields, seconds first, each with its range and names.
_CRON_FIELDS = (("seconds", 0, 59, ()), ("minutes", 0, 59, ()), ("hours", 0, 23, ()), ("day of month", 1, 31, ()),
                ("month", 1, 12, _MONTHS), ("day of week", 0, 6, _DAYS))
_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
_EVERY = re.compile(r"^@every\s+(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")


def check_cron(expression: str) -> str:
    """A KFP cron expression: six fields, seconds first (``0 0 3 * * *`` is 03:00 daily), each checked against its
    range (``*``, ``?``, values, names, ``a-b`` ranges, ``/step``, lists), or a descriptor (``@daily``, ``@every
    6h``); else a one-line error naming the field. The API would refuse it only after the upload, or accept an hour
    25 that never comes."""
    text = expression.strip()
    if text in _DESCRIPTORS or _EVERY.match(text):
        return expression
    fields = text.split()
    if len(fields) == 5:
        raise ConfigError(f"--cron {expression!r} has 5 fields; KFP's cron has six, seconds first: "
                          f"'0 {expression}'")
    if len(fields) != 6:
        raise ConfigError(f"--cron {expression!r} is not a six-field cron expression (seconds minutes hours "
                          "day-of-month month day-of-week), e.g. '0 0 3 * * *', or a descriptor such as @daily")
    for field, (name, low, high, names) in zip(fields, _CRON_FIELDS, strict=True):
        problem = _cron_field_problem(field, low, high, names)
        if problem:
            raise ConfigError(f"--cron {expression!r}: {name} {field!r} {problem} (e.g. '0 0 3 * * *': 03:00 "
                              "daily)")
    return expression


def _cron_field_problem(field: str, low: int, high: int, names: tuple[str, ...]) -> str | None:
    def value(word: str) -> int | None:
        if word.upper() in names:
            return names.index(word.upper()) + low
        return int(word) if word.isdigit() else None

    for part in field.split(","):
        span, slash, step = part.partition("/")
        if slash and not (step.isdigit() and int(step) > 0):
            return f"has a step {step!r} that is not a positive whole number"
        if span in ("*", "?"):
            continue
        first, dash, last = span.partition("-")
        bounds = [value(first), value(last) if dash else value(first)]
        if None in bounds:
            return f"has {span!r}, which is neither a number nor a name" + (f" ({', '.join(names)})" if names else "")
        start, end = bounds
        if not (low <= start <= high and low <= end <= high):
            return f"is outside {low}-{high}"
        if start > end:
            return f"has the range {span!r} going backwards"
    return None
