"""This process's memory limit (a pod's, from its cgroup) and how many of its processes the kernel's OOM killer
has ended: what tells a worker killed for memory from one that crashed, so the error can name the setting."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from cloob_core.errors import StageError

CGROUP = Path("/sys/fs/cgroup")  # cgroup v2's unified hierarchy, as a container sees its own


def oom_kills() -> int | None:
    """Processes of this cgroup the OOM killer ended so far (cgroup v2 ``memory.events``), or None where unknown."""
    try:
        for line in (CGROUP / "memory.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def limit_text() -> str:
    """The cgroup's memory limit as text ("2.0 GiB"), or "no limit"."""
    try:
        raw = (CGROUP / "memory.max").read_text().strip()
    except OSError:
        return "unknown"
    return "no limit" if raw == "max" else f"{int(raw) / 2**30:.1f} GiB"


class WorkerKilled(StageError):
    """A data-loader worker was killed (most likely by the OOM killer): one line with the setting to lower."""


def killed_worker(err: BaseException) -> str | None:
    """What ``err`` says when it is torch's report of a data-loader worker killed from outside ("exited
    unexpectedly", "is killed by signal"), as the start of one line; None for any other error."""
    text = str(err)
    if not isinstance(err, RuntimeError) or "DataLoader worker" not in text or not (
            "exited unexpectedly" in text or "killed by signal" in text):
        return None
    kills = oom_kills()
    seen = f"; this container's OOM kills so far: {kills}, its memory limit: {limit_text()}" if kills else ""
    return f"a data-loader worker was killed, most likely by the kernel's OOM killer for memory{seen}"


@contextlib.contextmanager
def naming_killed_workers(line: Callable[[str], str]) -> Iterator[None]:
    """Torch's report of a data-loader worker killed from outside, raised in the block, becomes
    :class:`WorkerKilled` with ``line(what killed_worker says)``: the caller adds the settings to lower."""
    try:
        yield
    except RuntimeError as err:
        killed = killed_worker(err)
        if killed is None:
            raise
        raise WorkerKilled(line(killed)) from None
