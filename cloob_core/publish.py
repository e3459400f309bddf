"""Outputs of several files published as one unit: a reader sees the previous complete output or the new one,
never a mix of two runs, and a stage that fails or refuses leaves its output as it was.

A stage writes the unit's whole new content into a staging folder (locally inside the output,
``.cloob-staging-TOKEN``; for an ``s3://`` output a local folder, uploaded under that prefix when done), so
nothing it writes is visible until it is done. Then it publishes:

1. ``.cloob-unit.pending.json``: every file of the new unit with its SHA-256, and the files of the old unit that go;
2. each staged file moved into place (a rename; on S3 a server-side copy), the files that go removed;
3. ``.cloob-unit.json`` replaced by the new record (one atomic write): the unit is complete;
4. the pending record and the staging folder removed.

A kill before step 1 leaves the previous unit untouched (its staging folder is removed by the next run). A kill
after it leaves every new file staged or in place, so whoever reads or writes the output next completes the
publication first (a roll-forward: the pending record says everything, and doing it twice changes nothing). A
reader that cannot write there refuses in one line (:class:`IncompleteOutput`), as it does for a file that does
not match the record (changed after it was published). The record has no time or token in it: the same content
gives the same bytes, which DVC's hashes rely on.

Why not one rename of the whole folder (``renameat2(RENAME_EXCHANGE)``): the output folder is often a mount point
(a Kubeflow artifact, a container volume), shares its folder with other files (a shard folder's summary), or is
an S3 prefix; and it holds the run's lease, which a folder swap would move away.
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

from cloob_core import lease, scratch, storage
from cloob_core.errors import StageError
from cloob_core.io import atomic_path, file_digest, json_bytes, parse_json, remove_temporaries

UNIT_FILE = ".cloob-unit.json"
PENDING_FILE = ".cloob-unit.pending.json"
STAGING_PREFIX = ".cloob-staging-"
BOOKKEEPING = (UNIT_FILE, PENDING_FILE, STAGING_PREFIX, storage.LEASE_PREFIX)  # never content of a unit


class IncompleteOutput(StageError):
    """An output was not published completely (a run stopped while publishing it), or changed afterwards."""


@dataclass(frozen=True)
class Unit:
    """A published unit: its files' SHA-256 by relative path (``/``-separated)."""

    folder: str
    files: dict[str, str]

    def read(self, name: str) -> bytes:
        """The bytes of member ``name``, checked against the record."""
        location = storage.join(self.folder, *name.split("/"))
        if name not in self.files:
            raise IncompleteOutput(f"{location} is not part of the output published in {self.folder}")
        try:
            data = storage.read_bytes(location)
        except FileNotFoundError:
            raise self.missing(name) from None
        if hashlib.sha256(data).hexdigest() != self.files[name]:
            raise IncompleteOutput(f"{location} does not match the output published in {self.folder} (changed "
                                   "after it was published, or left by another run); run the stage that writes it "
                                   "again")
        return data

    def missing(self, name: str) -> IncompleteOutput:
        """The error for member ``name`` not found where the unit says it is."""
        return IncompleteOutput(f"{storage.join(self.folder, *name.split('/'))} is missing from the output published "
                                f"in {self.folder}; run the stage that writes it again")

    def read_json(self, name: str) -> Any:
        return parse_json(self.read(name), storage.join(self.folder, *name.split("/")))

    def copy(self, name: str, target: Path) -> None:
        """Member ``name`` into the local file ``target`` (streamed, then checked against the record; atomic)."""
        location = storage.join(self.folder, *name.split("/"))
        with atomic_path(target) as tmp:
            try:
                storage.download_file(location, tmp)
            except FileNotFoundError:
                raise self.missing(name) from None
            self.check_copy(name, tmp)

    def check(self, name: str) -> None:
        """Member ``name``, read where it lies (a local unit), matches the record."""
        location = storage.join(self.folder, *name.split("/"))
        if not Path(location).is_file():
            raise self.missing(name)
        self.check_copy(name, Path(location))

    def check_copy(self, name: str, path: Path) -> None:
        """The local file ``path`` (member ``name`` or a copy of it) matches the record."""
        if file_digest(path) != self.files[name]:
            raise IncompleteOutput(f"{storage.join(self.folder, *name.split('/'))} does not match the output "
                                   f"published in {self.folder} (changed after it was published, or left by another "
                                   "run); run the stage that writes it again")


def _is_bookkeeping(name: str) -> bool:
    return name.startswith(BOOKKEEPING)


def unit_of(folder: str | os.PathLike) -> Unit | None:
    """The unit published in ``folder`` (local or ``s3://``); None when there is none (nothing published there,
    or an output written before units). A publication a killed run left half-done is completed first; where this
    reader cannot complete it (no write access), :class:`IncompleteOutput`."""
    folder = str(folder)
    pending = storage.read_json_or(storage.join(folder, PENDING_FILE), None)
    if pending is not None:
        try:
            _install(folder, pending)
        except OSError as err:
            raise IncompleteOutput(f"{folder} was not completely published (a run stopped while publishing it), "
                                   f"and completing it failed ({err}); run the stage that writes it again") from None
    record = storage.read_json_or(storage.join(folder, UNIT_FILE), None)
    if record is None:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise IncompleteOutput(f"{storage.join(folder, UNIT_FILE)} is not a unit record; run the stage that writes "
                               "it again")
    return Unit(folder, dict(record["files"]))


def _members(folder: Path, outside: tuple[str, ...] = ()) -> list[str]:
    """The relative paths of the files under the local ``folder`` that a unit may hold (not bookkeeping, not
    ``outside``)."""
    found = []
    for root, dirs, files in os.walk(folder):
        relative = Path(root).relative_to(folder)
        if not relative.parts:
            dirs[:] = [d for d in dirs if not _is_bookkeeping(d) and d not in outside]
            files = [f for f in files if not _is_bookkeeping(f) and f not in outside]
        found += [(relative / name).as_posix() for name in files]
    return sorted(found)


def settle(folder: str | os.PathLike) -> Unit | None:
    """Before a stage writes ``folder``: complete a publication a killed run left half-done, and remove staging
    folders of runs that died before publishing; the unit published there. The caller holds the folder's lease,
    so no other run is staging there."""
    folder = str(folder)
    unit = unit_of(folder)
    if storage.is_s3(folder):
        bucket, key = storage.split_s3(folder.rstrip("/") + "/" + STAGING_PREFIX)
        pages = storage.s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
        for entry in (item for page in pages for item in page.get("Contents", [])):
            storage.delete(f"s3://{bucket}/{entry['Key']}")
        return unit
    if Path(folder).is_dir():
        for entry in Path(folder).iterdir():
            if entry.name.startswith(STAGING_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
        remove_temporaries(folder, lambda name: name in (UNIT_FILE, PENDING_FILE))
    return unit


@contextlib.contextmanager
def staged(folder: str | os.PathLike, *, keep: bool = False, outside: tuple[str, ...] = (),
           lease_name: str = "") -> Iterator[Path]:
    """A local staging folder for the new content of the unit in ``folder`` (local or ``s3://``), published when
    the block ends without an error (see the module docstring); on an error nothing in ``folder`` changes.
    ``keep``: the stage adds to the previous unit (a local folder's files are in the staging folder at the start,
    as hard links, so they cost no copy); else the new unit replaces it, and the previous unit's files not in the
    new one go. Files that were never part of a unit are not removed (a folder written before units, a shard
    folder's shards, a user's file). ``outside``: top-level names that are not part of the unit (a cache the stage
    writes in place). The block replaces files (atomic writes do), never changes one in place: a kept file is a
    hard link to the published one. The caller holds the folder's lease (``lease_name``), which is checked
    before the publication starts (:func:`cloob_core.lease.check_held`): a writer that lost it publishes
    nothing."""
    folder = str(folder)
    remote = storage.is_s3(folder)
    if keep and remote:
        raise ValueError("keep is for local folders")
    storage.ensure_folder(folder)
    previous = settle(folder)
    name = f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    local = scratch.new_folder("cloob-publish") if remote else Path(folder, name)
    local.mkdir(exist_ok=True)
    try:
        if keep:
            _link_previous(Path(folder), local, sorted(previous.files) if previous else
                           _members(Path(folder), outside))
        yield local
        new = {member: file_digest(local / member) for member in _members(local)}
        if remote:
            for member in new:
                storage.copy_file(local / member, storage.join(folder, name, *member.split("/")))
        gone = sorted(set(previous.files) - set(new)) if previous else []
        pending = {"files": new, "staging": name, "remove": gone}
        lease.check_held(folder, lease_name)
        storage.write_bytes(storage.join(folder, PENDING_FILE), json_bytes(pending))
    except BaseException:
        storage.delete_tree(storage.join(folder, name))
        raise
    finally:
        if remote:
            shutil.rmtree(local, ignore_errors=True)
    _install(folder, pending)


def publish_copy(source: str | os.PathLike, folder: str, exclude: tuple[str, ...] = ()) -> list[str]:
    """Publish the files under the local folder ``source`` (top-level names in ``exclude`` left out) as the unit
    in ``folder`` (local or ``s3://``), under its lease: a reader sees the previous unit or this one, never today's
    metrics beside yesterday's weights. The relative paths published."""
    names = [name for name, _, _ in storage.tree_entries(str(source))
             if name.split("/", 1)[0] not in exclude and not _is_bookkeeping(name)]
    with lease.writing(folder), staged(folder) as staging:
        _link_previous(Path(source), staging, names)
    return names


def fetch(folder: str, local: str | os.PathLike) -> list[str]:
    """Copy the unit published in ``folder`` (local or ``s3://``) into the local folder ``local``, each file
    checked against the unit's record; :class:`IncompleteOutput` when ``folder`` holds no complete unit (only a
    publication that failed part-way, or files no unit names)."""
    unit = unit_of(folder)
    if unit is None:
        raise IncompleteOutput(f"{folder} holds no completely published output ({UNIT_FILE} is missing): the run "
                               "that writes it did not finish publishing; run it again")
    for name in sorted(unit.files):
        with atomic_path(Path(local, *name.split("/"))) as tmp:
            tmp.write_bytes(unit.read(name))
    return sorted(unit.files)


def covering_unit(location: str, is_file: bool) -> tuple[Unit, str] | None:
    """The unit published at ``location`` (a folder, or a file where ``is_file``; local or ``s3://``) or at the
    nearest folder above it that has one, with ``location``'s path inside it ("" for the unit's own folder); None
    where none is. A model folder is often a member of a larger unit (a run's outputs published under a prefix).
    A file is not probed as a folder: on S3 that is a listing under its name, a request for nothing."""
    current, inside = str(location).rstrip("/"), ""
    while True:
        if not is_file:
            unit = unit_of(current)
            if unit is not None:
                return unit, inside
        is_file = False
        parent = current.rpartition("/")[0] if storage.is_s3(current) else str(Path(current).parent)
        if parent in ("s3:/", "s3:", current) or not parent:
            return None
        name = current.rpartition("/")[2] if storage.is_s3(current) else Path(current).name
        current, inside = parent, f"{name}/{inside}" if inside else name


def checked_local(location: str, scratch: Path) -> Path:
    """``location`` (a folder or a file, local or ``s3://``) as a local path to read, each file of it that a unit
    published at it or above it names checked against the unit's record (:func:`covering_unit`; a unit need not
    own every file of its folder): an S3 location is copied into ``scratch`` and checked there, a local one is
    checked in place (:func:`check_in_place`)."""
    if not storage.is_s3(location):
        check_in_place(Path(location))
        return Path(location)
    is_file = storage.file_version(location) is not None
    found = covering_unit(location, is_file)
    if is_file:
        target = scratch / location.rpartition("/")[2]
        if found is not None and found[1] in found[0].files:
            found[0].copy(found[1], target)
        else:
            storage.download_file(location, target)
        return target
    storage.download_tree(location, scratch)
    if found is not None:
        unit, inside = found
        for relative, name in _members_under(unit, inside).items():
            if not scratch.joinpath(*relative.split("/")).is_file():
                raise unit.missing(name)
            unit.check_copy(name, scratch.joinpath(*relative.split("/")))
    return scratch


def check_in_place(location: Path) -> None:
    """Each file of the local folder or file ``location`` that a unit published at it or above it names matches
    the unit's record, and none it names is missing."""
    found = covering_unit(str(location), location.is_file())
    if found is None:
        return
    unit, inside = found
    if inside in unit.files:
        unit.check(inside)
        return
    for name in _members_under(unit, inside).values():
        unit.check(name)


def _members_under(unit: Unit, inside: str) -> dict[str, str]:
    """The unit's members under its folder ``inside`` ("": all): path relative to it -> member name."""
    prefix = f"{inside}/" if inside else ""
    return {name[len(prefix):]: name for name in unit.files if name.startswith(prefix)}


def _link_previous(folder: Path, staging: Path, names: list[str]) -> None:
    for member in names:
        target = staging / member
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(folder / member, target)
        except OSError:
            shutil.copy2(folder / member, target)


def _install(folder: str, pending: dict[str, Any]) -> None:
    """Steps 2-4 of a publication; idempotent, so a roll-forward after a kill at any point completes it."""
    staging = storage.join(folder, pending["staging"])
    for member in pending["files"]:
        source = storage.join(staging, *member.split("/"))
        if storage.exists(source):
            with contextlib.suppress(FileNotFoundError):  # a reader completing it at the same time moved it first
                storage.move(source, storage.join(folder, *member.split("/")))
    for member in pending["remove"]:
        storage.delete(storage.join(folder, *member.split("/")))
        if not storage.is_s3(folder):
            for parent in Path(folder, member).parents:
                if parent == Path(folder):
                    break
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only when empty
    storage.write_bytes(storage.join(folder, UNIT_FILE), json_bytes({"files": pending["files"]}))
    storage.delete(storage.join(folder, PENDING_FILE))
    storage.delete_tree(staging)
