"""Temporary folders that a later run cleans up when a killed run left them behind.

``tempfile.TemporaryDirectory`` removes its folder when the block ends, but not when the process is killed
(``kill -9``, the OOM killer, a node that is drained), and a manifest's staging folder can hold gigabytes. Here a
folder's name says who made it, ``PREFIX-MACHINE-PID-RANDOM``, so each new folder of a prefix first removes those
of the same prefix whose process is gone from this machine. Folders of other machines or pid namespaces sharing
the temporary folder (containers, pods on a shared volume) are left alone: from here their owner's life is
unknowable.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@functools.cache
def machine_id() -> str:
    """What tells this machine and process namespace apart from others that share its host name (pods and
    containers reuse names): the kernel's boot id and the pid namespace. A pid means the same process only where
    both match."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "unknown-pidns"
    return f"{boot}/{namespace}"


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace is running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _machine_tag() -> str:
    return hashlib.sha256(machine_id().encode()).hexdigest()[:8]


def remove_abandoned(prefix: str, parent: str | os.PathLike | None = None) -> list[Path]:
    """Remove this machine's ``prefix`` folders in ``parent`` (default: the temporary folder) whose process has
    ended; the folders removed."""
    parent = Path(parent or tempfile.gettempdir())
    pattern = re.compile(rf"^{re.escape(prefix)}-{_machine_tag()}-(\d+)-")
    removed = []
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            found = pattern.match(entry.name)
            if found and int(found.group(1)) != os.getpid() and not alive(int(found.group(1))):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def new_folder(prefix: str, parent: str | os.PathLike | None = None) -> Path:
    """A new temporary folder named for this process (the caller removes it); abandoned ones of the same prefix
    are removed first."""
    remove_abandoned(prefix, parent)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-{_machine_tag()}-{os.getpid()}-", dir=parent))


@contextlib.contextmanager
def folder(prefix: str, parent: str | os.PathLike | None = None) -> Iterator[Path]:
    """:func:`new_folder`, removed when the block ends."""
    path = new_folder(prefix, parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
