"""What a pipeline needs of the run before it is sent to a cluster: locations a pod can read, a valid schedule.
The cluster settings themselves are part of the configuration (:mod:`cloob_core.config.cluster`)."""

from __future__ import annotations

import datetime
import itertools
import re
from typing import Any

from cloob_core.config import PACKAGED_SETS, PACKAGED_SOURCES, CloobConfig, ConfigError
from cloob_core.redact import redacted


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


def credentials_in_urls(value: Any, where: str = "") -> list[str]:
    """Each setting of ``value`` (a configuration as a mapping) whose URL carries credentials (user info, a token
    or signature in its query), as ``key 'redacted URL'``."""
    if isinstance(value, dict):
        return [found for key, item in value.items()
                for found in credentials_in_urls(item, f"{where}.{key}" if where else str(key))]
    if isinstance(value, list):
        return [found for index, item in enumerate(value) for found in credentials_in_urls(item, f"{where}[{index}]")]
    if isinstance(value, str) and _SCHEME.match(value) and redacted(value) != value:
        return [f"{where} {redacted(value)!r}"]
    return []


def check_no_credentials(config: CloobConfig) -> None:
    """A cluster run records its parameters (the KFP run's inputs, every job pod's CLOOB_PARAMS environment): a URL
    with credentials in them would be kept and shown verbatim. Refused in one line that does not repeat them."""
    found = credentials_in_urls(config.model_dump())
    if found:
        raise ConfigError(f"credentials in a URL of the run's parameters, which the run records and its pods show: "
                          f"{'; '.join(found)}; give them to the pods instead (S3: the cloob-s3 secret's AWS_* "
                          "keys), or put the file on S3")


_MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
_DAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")
# KFP's scheduler parses crons with robfig/cron: six fields, seconds first, each with its range and names.
_CRON_FIELDS = (("seconds", 0, 59, ()), ("minutes", 0, 59, ()), ("hours", 0, 23, ()), ("day of month", 1, 31, ()),
                ("month", 1, 12, _MONTHS), ("day of week", 0, 6, _DAYS))
_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
_EVERY = re.compile(r"^@every\s+(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")


_DESCRIPTOR_PERIOD_S = {"@yearly": 365 * 86400, "@annually": 365 * 86400, "@monthly": 28 * 86400,
                        "@weekly": 7 * 86400, "@daily": 86400, "@midnight": 86400, "@hourly": 3600}
_EVERY_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_CRON_YEARS = (2024, 2029)  # the window a cron's fire times are read in: every weekday on every date, a leap year


def check_cron(expression: str) -> str:
    """A KFP cron expression: six fields, seconds first (``0 0 3 * * *`` is 03:00 daily), each checked against its
    range (``*``, ``?``, values, names, ``a-b`` ranges, ``/step``, lists), or a descriptor (``@daily``, ``@every
    6h``); else a one-line error naming the field. The API would refuse it only after the upload, or accept an hour
    25 or a 31 February that never comes, or ``@every 0s``."""
    cron_period_s(expression)
    return expression


def cron_period_s(expression: str) -> float:
    """The shortest time between two runs of a valid KFP cron (robfig/cron's reading: a day matches when its day
    of month or its day of week does, if both are restricted), found over five years of dates; a
    :class:`ConfigError` for an invalid one or one that never fires."""
    text = expression.strip()
    if text in _DESCRIPTOR_PERIOD_S:
        return float(_DESCRIPTOR_PERIOD_S[text])
    if _EVERY.match(text):
        period = sum(float(number) * _EVERY_UNITS[unit] for number, _, unit in
                     re.findall(r"(\d+(\.\d+)?)(ns|us|µs|ms|s|m|h)", text[len("@every"):]))
        if period < 1:
            raise ConfigError(f"--cron {expression!r} fires more than once a second, or never: give @every a period "
                              "of at least 1s (e.g. @every 6h)")
        return period
    fields = text.split()
    if len(fields) == 5:
        raise ConfigError(f"--cron {expression!r} has 5 fields; KFP's cron has six, seconds first: "
                          f"'0 {expression}'")
    if len(fields) != 6:
        raise ConfigError(f"--cron {expression!r} is not a six-field cron expression (seconds minutes hours "
                          "day-of-month month day-of-week), e.g. '0 0 3 * * *', or a descriptor such as @daily")
    values = []
    for field, (name, low, high, names) in zip(fields, _CRON_FIELDS, strict=True):
        problem = _cron_field_problem(field, low, high, names)
        if problem:
            raise ConfigError(f"--cron {expression!r}: {name} {field!r} {problem} (e.g. '0 0 3 * * *': 03:00 "
                              "daily)")
        values.append(_cron_field_values(field, low, high, names))
    seconds, minutes, hours, days, months, weekdays = values
    times = sorted(h * 3600 + m * 60 + s for h in hours for m in minutes for s in seconds)
    either = fields[3] not in ("*", "?") and fields[5] not in ("*", "?")  # robfig: then either day field matches
    day, end, dates = datetime.date(_CRON_YEARS[0], 1, 1), datetime.date(_CRON_YEARS[1], 12, 31), []
    while day <= end:
        weekday = (day.weekday() + 1) % 7  # cron counts from Sunday = 0
        hit = (day.day in days or weekday in weekdays) if either else (day.day in days and weekday in weekdays)
        if day.month in months and hit:
            dates.append(day.toordinal())
        day += datetime.timedelta(days=1)
    if not dates:
        raise ConfigError(f"--cron {expression!r} never fires: no date has that day of the month and month (e.g. "
                          "31 February)")
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    gaps += [(after - before) * 86400 - times[-1] + times[0] for before, after in itertools.pairwise(dates)]
    return float(min(gaps)) if gaps else float("inf")


def _cron_field_values(field: str, low: int, high: int, names: tuple[str, ...]) -> set[int]:
    """The values a checked cron field stands for."""
    found: set[int] = set()
    for part in field.split(","):
        span, _, step = part.partition("/")
        if span in ("*", "?"):
            start, end = low, high
        else:
            first, dash, last = span.partition("-")
            start = names.index(first.upper()) + low if first.upper() in names else int(first)
            end = (names.index(last.upper()) + low if last.upper() in names else int(last)) if dash else start
            if step and not dash:
                end = high  # robfig: "a/step" runs from a to the end of the range
        found.update(range(start, end + 1, int(step) if step else 1))
    return found


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
