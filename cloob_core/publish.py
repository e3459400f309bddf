"""Outputs of several files published as one unit: a reader sees the previous complete output or the new one,
never a mix of two runs, and a stage that fails or refuses leaves its output as it was.

A stage writes the unit's whole new content into a staging folder inside the output (``.cloob-staging-TOKEN``),
so nothing it writes is visible until it is done. Then it publishes:

1. ``.cloob-unit.pending.json``: every file of the new unit with its SHA-256, and the files of the old unit that go;
2. each staged file renamed into place, the files that go removed;
3. ``.cloob-unit.json`` replaced by the new record (one atomic rename): the unit is complete;
4. the pending record and the staging folder removed.

A kill before step 1 leaves the previous unit untouched (its staging folder is removed by the next run). A kill
after it leaves every new file in the staging folder or in place, so the next run of the stage, before it writes
anything, completes the publication (a roll-forward); a reader meanwhile refuses in one line
(:class:`IncompleteOutput`), as it does for a file that does not match the record (changed after it was published).
The record has no time or token in it: the same content gives the same bytes, which DVC's hashes rely on.

Why not one rename of the whole folder (``renameat2(RENAME_EXCHANGE)``): the output folder is often a mount point
(a Kubeflow artifact, a container volume) or holds the run's lease and caches, which a folder swap would move away.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloob_core import storage
from cloob_core.errors import StageError
from cloob_core.io import file_digest, parse_json, write_json

UNIT_FILE = ".cloob-unit.json"
PENDING_FILE = ".cloob-unit.pending.json"
STAGING_PREFIX = ".cloob-staging-"
BOOKKEEPING = (UNIT_FILE, PENDING_FILE, STAGING_PREFIX, storage.LEASE_PREFIX)  # never content of a unit


class IncompleteOutput(StageError):
    """An output was not published completely (a run stopped while publishing it), or changed afterwards."""


@dataclass(frozen=True)
class Unit:
    """A published unit: its files' SHA-256 by relative path."""

    folder: Path
    files: dict[str, str]

    def read(self, name: str) -> bytes:
        """The bytes of member ``name``, checked against the record."""
        path = self.folder / name
        if name not in self.files:
            raise IncompleteOutput(f"{path} is not part of the output published in {self.folder}")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise IncompleteOutput(f"{path} is missing from the output published in {self.folder}; run the stage "
                                   "that writes it again") from None
        if hashlib.sha256(data).hexdigest() != self.files[name]:
            raise IncompleteOutput(f"{path} does not match the output published in {self.folder} (changed after "
                                   "it was published, or left by another run); run the stage that writes it again")
        return data

    def read_json(self, name: str) -> Any:
        return parse_json(self.read(name), str(self.folder / name))


def _is_bookkeeping(name: str) -> bool:
    return name.startswith(BOOKKEEPING)


def unit_of(folder: str | Path) -> Unit | None:
    """The unit published in ``folder``; None when there is none (nothing published there, or an output written
    before units). A publication that did not complete is :class:`IncompleteOutput`."""
    folder = Path(folder)
    if (folder / PENDING_FILE).exists():
        raise IncompleteOutput(f"{folder} was not completely published (a run stopped while publishing it); run "
                               "the stage that writes it again, which completes it")
    try:
        record = parse_json((folder / UNIT_FILE).read_bytes(), str(folder / UNIT_FILE))
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise IncompleteOutput(f"{folder / UNIT_FILE} is not a unit record; run the stage that writes it again")
    return Unit(folder, dict(record["files"]))


def _members(folder: Path, outside: tuple[str, ...]) -> list[str]:
    """The relative paths of the files under ``folder`` that a unit may hold (not bookkeeping, not ``outside``)."""
    found = []
    for root, dirs, files in os.walk(folder):
        relative = Path(root).relative_to(folder)
        top = relative.parts[0] if relative.parts else None
        if top is None:
            dirs[:] = [d for d in dirs if not _is_bookkeeping(d) and d not in outside]
            files = [f for f in files if not _is_bookkeeping(f) and f not in outside]
        found += [(relative / name).as_posix() for name in files]
    return sorted(found)


def settle(folder: str | Path) -> None:
    """Before a stage writes ``folder``: complete a publication a killed run left half-done, and remove staging
    folders of runs that died before publishing. The caller holds the folder's lease."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    pending = folder / PENDING_FILE
    if pending.exists():
        _install(folder, parse_json(pending.read_bytes(), str(pending)))
    for entry in folder.iterdir():
        if entry.name.startswith(STAGING_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def staged(folder: str | Path, *, keep: bool = False, outside: tuple[str, ...] = ()) -> Iterator[Path]:
    """A staging folder for the new content of the unit in the local folder ``folder``, published when the block
    ends without an error (see the module docstring); on an error the staging folder is removed and ``folder``
    is as it was. ``keep``: the stage adds to the previous unit (its files are in the staging folder at the start,
    as hard links, so they cost no copy); else the new unit replaces it, and the previous unit's files not in the
    new one go. Files that were never part of a unit are not removed (a folder written before units, a user's
    file). ``outside``: top-level names in ``folder`` that are not part of the unit (a cache the stage writes in
    place). The block replaces files (atomic writes do), never changes one in place: a kept file is a hard link
    to the published one. The caller holds the folder's lease."""
    folder = Path(folder)
    storage.ensure_folder(folder)
    settle(folder)
    previous = unit_of(folder)
    staging = folder / f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        if keep:
            for name in sorted(previous.files) if previous else _members(folder, outside):
                target = staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(folder / name, target)
                except OSError:
                    shutil.copy2(folder / name, target)
        yield staging
        new = {name: file_digest(staging / name) for name in _members(staging, ())}
        gone = sorted(set(previous.files) - set(new)) if previous else []
        write_json(folder / PENDING_FILE, {"files": new, "staging": staging.name, "remove": gone})
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _install(folder, parse_json((folder / PENDING_FILE).read_bytes(), str(folder / PENDING_FILE)))


def _install(folder: Path, pending: dict[str, Any]) -> None:
    """Steps 2-4 of a publication; idempotent, so a roll-forward after a kill at any point completes it."""
    staging = folder / pending["staging"]
    for name in pending["files"]:
        source = staging / name
        if source.exists():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, folder / name)
    for name in pending["remove"]:
        (folder / name).unlink(missing_ok=True)
        for parent in (folder / name).parents:
            if parent == folder:
                break
            with contextlib.suppress(OSError):
                parent.rmdir()  # only when empty
    write_json(folder / UNIT_FILE, {"files": pending["files"]})
    (folder / PENDING_FILE).unlink(missing_ok=True)
    shutil.rmtree(staging, ignore_errors=True)
