"""Local paths and ``s3://`` URLs behind one small interface, so every stage reads and writes either.

Reads, listings, copies and deletes go through fsspec: its local filesystem, and s3fs for ``s3://`` (installed
with dvc-s3). Here is only what fsspec lacks: local writes that are atomic (written beside the target, fsynced and
renamed, so a reader sees the old file or the new one; an S3 object appears only when its upload completes
anyway), an S3 error that names the object and S3's error code, and a missing bucket told apart from a missing
file. The conditional write is :mod:`cloob_core.conditional_write`.

S3 is configured the standard way: credentials and region from the environment (or an attached role),
``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for S3-compatible servers such as MinIO, and retries from
``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS``. s3fs's own retry loop is turned off, so that one policy holds.
botocore's retries end when the answer's headers arrive; a body cut short after them (a dropped connection, a
proxy's reset) is an aiohttp error no one retries, so the whole-object reads here try again themselves, as many
times, and end in one error naming the object.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from cloob_core.errors import StageError
from cloob_core.io import atomic_path, parse_json

log = logging.getLogger(__name__)
T = TypeVar("T")


class StorageSettingError(StageError, ValueError):
    """An S3 setting from the environment that botocore cannot read, named."""


LEASE_PREFIX = ".cloob-lease"  # the files of cloob_core.lease: bookkeeping while a stage writes, never content
STREAM_BLOCK = 16 * 1024 * 1024  # an S3 object read from start to end is fetched in ranges of this size
RANGE_BLOCK = 2 * 1024 * 1024  # a reader that seeks (parquet: footer, then row groups) fetches ranges this small


def is_s3(location: str | os.PathLike) -> bool:
    return str(location).startswith("s3://")


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/key/part`` → (``bucket``, ``key/part``)."""
    rest = str(url)[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket")
    return bucket, key


@dataclass(frozen=True)
class _S3:
    client: Any  # boto3: the conditional writes and the leases
    files: Any  # s3fs: everything else


@functools.cache
def _s3_for_process(pid: int) -> _S3:
    """This process's S3 clients. Both are thread-safe, but neither may cross a fork (a data-loader worker
    makes its own): hence the cache by process id."""
    import boto3
    import s3fs
    from botocore.config import Config

    # Bounded waits, stated here: 60 s to connect and for the next bytes of an answer (s3fs would give 5 and 15).
    # Listings are not cached, since a stage lists what another process has just written.
    client = boto3.session.Session().client("s3", config=Config(connect_timeout=60, read_timeout=60))
    files = s3fs.S3FileSystem(config_kwargs={"connect_timeout": 60, "read_timeout": 60}, use_listings_cache=False,
                              skip_instance_cache=True)
    files.retries = 1  # one try of s3fs's loop (a class attribute, not an argument): botocore's retries hold
    return _S3(client, files)


def s3_client() -> Any:
    """This process's boto3 S3 client."""
    _retry_environment()  # one line naming a variable botocore cannot read, whenever S3 is used
    return _s3_for_process(os.getpid()).client


def s3_filesystem() -> Any:
    """This process's s3fs filesystem (what engines such as DuckDB and pyarrow read through)."""
    _retry_environment()
    return _s3_for_process(os.getpid()).files


def endpoint() -> str:
    """The S3 endpoint this process talks to (an S3-compatible server's URL, or AWS's regional one)."""
    return s3_client().meta.endpoint_url


@contextlib.contextmanager
def _filesystem(location: str | os.PathLike) -> Iterator[tuple[Any, str]]:
    """The fsspec filesystem that holds ``location``, and the path it knows it by. An S3 failure inside the block
    is re-raised naming ``location`` and S3's error code, which s3fs's errors leave out ("[Errno 16] Please reduce
    your request rate."); a missing file is left to the caller."""
    if not is_s3(location):
        import fsspec

        yield fsspec.filesystem("file"), str(location)
        return
    try:
        yield s3_filesystem(), str(location)[len("s3://") :]
    except FileNotFoundError:
        raise
    except OSError as err:
        if str(location) in str(err):
            raise
        raise _named(err, location) from err


def _named(err: OSError, location: str | os.PathLike) -> OSError:
    """``err`` of s3fs as one line naming ``location`` and S3's error code."""
    code = getattr(err.__cause__, "response", {}).get("Error", {}).get("Code")
    message = f"{location}: {err.strerror or err}" + (f" ({code})" if code else "")
    named = type(err)(message)  # a message alone, so it reads as one line without "[Errno 16]" before it
    named.errno = err.errno  # what callers test (a full disk, say) is kept
    return named


class OverlappingLocations(StageError, ValueError):
    """A stage's output that is one of its inputs, lies inside one, or holds one."""


def _folder_of(location: str) -> str:
    """The folder a location's files lie in, as one compares it with another: a brace pattern's folder, a file's
    folder, a folder itself; local paths resolved (symlinks followed), S3 prefixes without their last slash."""
    text = str(location)
    if "{" in text:
        text = text[:text.index("{")].rpartition("/")[0] or "."
    elif text.endswith(".tar"):
        text = text.rpartition("/")[0] or "."
    if is_s3(text):
        return text.rstrip("/")
    return str(Path(text).resolve())


def _within(inner: str, outer: str) -> bool:
    return inner.startswith(outer.rstrip("/") + "/")


def check_apart(output: tuple[str, str], *inputs: tuple[str, str]) -> None:
    """Refuse an output (``(option, location)``) that is an input's folder, lies inside it, or holds it: a stage
    that wrote there would replace what it reads. Local paths compare after their symlinks are followed."""
    option, location = output
    written = _folder_of(location)
    for read_option, read in inputs:
        source = _folder_of(read)
        where = "is" if written == source else "lies inside" if _within(written, source) \
            else "holds" if _within(source, written) else None
        if where is not None:
            raise OverlappingLocations(f"{option} {location} {where} the folder of {read_option} {read} ({written}): "
                                       "writing there "
                                       f"would replace what this stage reads; give {option} a folder of its own")


def join(base: str | os.PathLike, *parts: str) -> str:
    if is_s3(base):
        return "/".join([str(base).rstrip("/"), *parts])
    return str(Path(base, *parts))


# What a read of an object's body meets on a flaky network after botocore's own retries are spent (they cover
# the request, not the body that follows it): the body cut short, the connection dropped or timed out mid-read.
_TRANSIENT = frozenset({"ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "ClientOSError",
                        "ResponseStreamingError", "IncompleteReadError", "ConnectionClosedError", "ReadTimeoutError",
                        "EndpointConnectionError", "ProtocolError", "IncompleteRead", "ConnectionResetError",
                        "TimeoutError", "ServerTimeoutError"})


def _transient(err: BaseException) -> bool:
    return any(kind.__name__ in _TRANSIENT for kind in type(err).__mro__)


def _read_attempts() -> int:
    """Tries of a whole-object read: botocore's ``AWS_MAX_ATTEMPTS`` (its legacy mode's 5 when unset)."""
    value = _retry_environment()
    return max(1, value) if value is not None else 5


_RETRY_MODES = ("legacy", "standard", "adaptive")


def _retry_environment() -> int | None:
    """``AWS_MAX_ATTEMPTS`` as a number (None: unset), once ``AWS_RETRY_MODE`` and it are known to be what
    botocore reads: otherwise botocore's ``invalid literal for int()`` would name neither the variable nor its
    use."""
    mode = os.environ.get("AWS_RETRY_MODE", "")
    if mode and mode not in _RETRY_MODES:
        raise StorageSettingError(f"AWS_RETRY_MODE={mode[:40]!r}: botocore's retry mode is one of "
                                  f"{', '.join(_RETRY_MODES)}")
    value = os.environ.get("AWS_MAX_ATTEMPTS", "")
    if not value:
        return None
    if not value.strip().isdigit():
        raise StorageSettingError(f"AWS_MAX_ATTEMPTS={value[:40]!r}: the tries of each S3 request (and of a "
                                  "whole-object read) must be a whole number, e.g. 5")
    return int(value)


class ReadFault(OSError):
    """An object whose bytes storage did not give, after the tries: a network or storage fault, not a bad file."""


def is_read_fault(err: BaseException) -> bool:
    """Whether ``err``, met reading a file, says that storage did not give its bytes (an S3 answer of 503 or 500
    after botocore's tries, a body cut short after ours, a local I/O error, a file gone), as opposed to bytes that
    are there and wrong (tarfile's ``ReadError`` for a tar cut at rest, a bad image): a stage fails what it could not
    read, for a later run to read again, rather than recording it as broken."""
    return isinstance(err, OSError) or _transient(err)


def _backoff(attempt: int) -> float:
    return min(0.5 * 2 ** (attempt - 1), 8.0) * (0.5 + random.random() / 2)


def _retried_read(location: str | os.PathLike, read: Callable[[], T]) -> T:
    """``read()`` of an object (idempotent), tried again with backoff when the body fails on the way; what
    remains after the tries is one error naming the object (an OSError: the user's storage, exit 2)."""
    attempts = _read_attempts()
    for attempt in range(1, attempts + 1):
        try:
            return read()
        except FileNotFoundError:
            raise
        except Exception as err:  # only the transient kinds are retried; the rest re-raised
            if not _transient(err):
                raise
            if attempt == attempts:
                raise _exhausted(location, attempts, err) from err
            delay = _backoff(attempt)
            log.warning("%s: %s while reading (try %d of %d); again in %.1fs", location, type(err).__name__,
                        attempt, attempts, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _exhausted(location: str | os.PathLike, attempts: int, err: BaseException, at: int | None = None) -> ReadFault:
    where = "" if at is None else f" at byte {at:,}"
    return ReadFault(f"{location}: reading it failed {attempts} times{where}, the last with {type(err).__name__}: "
                     f"{str(err).splitlines()[0] if str(err) else ''} (a network or storage fault; AWS_MAX_ATTEMPTS "
                     "sets the tries)")


def read_bytes(location: str | os.PathLike) -> bytes:
    try:
        with _filesystem(location) as (files, path):
            return _retried_read(location, lambda: files.cat_file(path))
    except FileNotFoundError as err:
        _unless_no_bucket(err, location)
        raise FileNotFoundError(f"{location} does not exist") from None


def _unless_no_bucket(err: OSError, location: str | os.PathLike) -> None:
    """Let the caller take ``err`` for "no such file", unless it says the bucket is missing: that is a wrong
    address, not an empty folder, and s3fs's message names neither the bucket nor the file."""
    if type(err.__cause__).__name__ == "NoSuchBucket":
        raise FileNotFoundError(f"{location}: its bucket does not exist (NoSuchBucket)") from None


def read_json(location: str | os.PathLike) -> Any:
    """JSON from a local or S3 file; one that does not parse is an error naming it."""
    return parse_json(read_bytes(location), str(location))


def read_json_or(location: str | os.PathLike, default: Any) -> Any:
    """The JSON at ``location``, or ``default`` when there is no such file yet."""
    try:
        return read_json(location)
    except FileNotFoundError:
        return default


def exists(location: str | os.PathLike) -> bool:
    """A file or a folder is there: for S3, an object or any object under the prefix. A missing bucket is an
    error, not an absent file (fsspec's ``exists`` would say False)."""
    return _info(location) is not None


def file_version(location: str | os.PathLike) -> tuple[int, str] | None:
    """``(size, version)`` of the file at ``location`` (see :func:`tree_entries`); None when no file is there."""
    if not is_s3(location):
        try:
            stat = os.stat(location)  # follows a link
        except (FileNotFoundError, NotADirectoryError):
            if os.path.islink(location):
                raise FileNotFoundError(f"{location} is a symbolic link to {os.readlink(location)}, which does "
                                        "not exist") from None
            return None
        return (stat.st_size, local_version(stat)) if os.path.isfile(location) else None
    info = _info(location)
    if info is None or info["type"] != "file":
        return None
    return int(info["size"]), _version(info["name"], info)


def _info(location: str | os.PathLike) -> dict[str, Any] | None:
    """fsspec's description of the file or folder at ``location``; None when there is neither."""
    try:
        with _filesystem(location) as (files, path):
            return files.info(path)
    except (FileNotFoundError, NotADirectoryError) as err:
        _unless_no_bucket(err, location)
        return None


def _version(path: str, info: dict[str, Any]) -> str:
    """What changes when a file is rewritten: the S3 ETag, or locally :func:`local_version`."""
    return str(info["ETag"]) if "ETag" in info else local_version(os.stat(path))


def local_version(stat: os.stat_result) -> str:
    """A local file's change signal: modification time, inode change time (ctime) and identity (device, inode),
    in nanoseconds. Size and mtime alone miss a same-size rewrite whose mtime is put back (``rsync -t``,
    ``cp -p``, ``touch -r``); the ctime cannot be set back by any tool (only the clock could), and a file
    replaced by a rename has another inode. A content digest would also catch an edit through the raw device,
    at the cost of reading every part on each run."""
    return f"{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_dev}:{stat.st_ino}"


def _local_tree(root: str) -> list[tuple[str, int, str]]:
    """:func:`tree_entries` of a local folder. Symbolic links are followed, to files and to folders, once per
    folder (a link back to a folder above is not walked twice); a link whose target is missing is an error
    naming it."""
    found, seen = [], set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        identity = (os.stat(folder).st_dev, os.stat(folder).st_ino)
        if identity in seen:
            log.warning("%s leads back to a folder already listed (a symbolic link loop); not listed again", folder)
            dirs[:] = []
            continue
        seen.add(identity)
        relative = os.path.relpath(folder, root)
        for name in files:
            if name.startswith(LEASE_PREFIX):
                continue
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)  # follows a link
            except FileNotFoundError:
                raise FileNotFoundError(f"{path} is a symbolic link to {os.readlink(path)}, which does not "
                                        "exist") from None
            entry = name if relative == "." else f"{relative.replace(os.sep, '/')}/{name}"
            found.append((entry, stat.st_size, local_version(stat)))
    return sorted(found)


def tree_entries(location: str) -> list[tuple[str, int, str]]:
    """``(path, size, version)`` of every file under the folder ``location``, sorted by path (``/``-separated,
    relative to it); the version is the S3 ETag, or locally :func:`local_version`."""
    if not is_s3(location):
        return _local_tree(str(location)) if os.path.isdir(location) else []
    try:
        with _filesystem(location) as (files, path):
            root = files._strip_protocol(path).rstrip("/") + "/"
            found = files.find(path, detail=True)
    except (FileNotFoundError, NotADirectoryError) as err:
        _unless_no_bucket(err, location)
        return []
    return sorted((name[len(root):], int(info["size"]), _version(name, info)) for name, info in found.items()
                  if info["type"] == "file" and name.startswith(root)
                  and not name.rpartition("/")[2].startswith(LEASE_PREFIX))


def list_names(folder: str | os.PathLike, suffix: str = "") -> list[str]:
    """Base names of the files directly in ``folder`` that end with ``suffix``, sorted."""
    try:
        with _filesystem(folder) as (files, path):
            root = files._strip_protocol(path).rstrip("/")
            listed = files.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError) as err:
        _unless_no_bucket(err, folder)
        return []
    names = (entry["name"].rstrip("/").rpartition("/") for entry in listed if entry["type"] == "file")
    return sorted(name for parent, _, name in names
                  if parent == root and name.endswith(suffix) and not name.startswith(LEASE_PREFIX))


def delete(location: str | os.PathLike) -> None:
    with contextlib.suppress(FileNotFoundError), _filesystem(location) as (files, path):
        files.rm_file(path)  # S3 deletes a missing key without a word; so does this, locally


def move(source: str, target: str) -> None:
    """Give the file at ``source`` the name ``target`` in the same store: a rename locally, a server-side copy
    and a delete on S3 (the object appears whole at ``target`` when its copy completes)."""
    if not is_s3(source):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
        return
    with _filesystem(source) as (files, path):
        files.copy(path, str(target)[len("s3://"):])
    delete(source)


def delete_tree(location: str | os.PathLike) -> None:
    """Remove the folder (or S3 prefix) ``location`` and everything under it; nothing there is no error."""
    if not is_s3(location):
        shutil.rmtree(location, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError), _filesystem(location) as (files, path):
        files.rm(path, recursive=True)


def ensure_folder(folder: str | os.PathLike) -> None:
    """Create a local output folder; stages call it before any work, so that a file in its place or a folder
    they may not write fails at once, not after the compute is spent."""
    if is_s3(folder):
        return
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{folder} is a file, not a folder to write into")
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{folder} is not writable")


def upload_file(local: str | os.PathLike, location: str) -> None:
    """Publish a finished local file at ``location``: a rename (a copy first when it crosses file systems),
    or an upload to S3."""
    if is_s3(location):
        copy_file(local, location)
        return
    try:
        os.replace(local, location)
    except OSError:
        copy_file(local, location)
        Path(local).unlink(missing_ok=True)


def copy_file(local: str | os.PathLike, location: str) -> None:
    """Publish a copy of a local file at ``location`` (the source stays): an atomic local copy, or an upload to
    S3 (multipart when large), which makes the object visible only once complete."""
    if is_s3(location):
        with _filesystem(location) as (files, path):
            files.put_file(str(local), path)
        return
    with atomic_path(location) as tmp:
        shutil.copyfile(local, tmp)


def write_bytes(location: str | os.PathLike, data: bytes) -> None:
    if is_s3(location):
        with _filesystem(location) as (files, path):
            files.pipe_file(path, data)
        return
    with atomic_path(location) as tmp:
        tmp.write_bytes(data)


def open_read(location: str) -> IO[bytes]:
    """A reader of a file from start to end (a tar shard): local, or an S3 object fetched in large ranges that
    survives a body cut short (:class:`_ResumingRead`)."""
    if not is_s3(location):
        return open(location, "rb")
    return _ResumingRead(location, _open(location, STREAM_BLOCK))


class _ResumingRead(io.RawIOBase):
    """An S3 object read front to back, opened again where the read stopped when its body is cut short (botocore
    retries a request, not the body that follows it), as often in a row as a whole-object read tries; then a
    :class:`ReadFault` naming the object and the byte. Any other S3 error is raised naming the object."""

    def __init__(self, location: str, first: IO[bytes]):
        self._location, self._file, self._offset = location, first, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        attempts = _read_attempts()
        for attempt in range(1, attempts + 1):
            try:
                if self._file is None:
                    self._file = _open(self._location, STREAM_BLOCK)
                    self._file.seek(self._offset)
                data = self._file.read(len(buffer))
            except FileNotFoundError:
                raise
            except Exception as err:  # only the transient kinds are tried again; the rest named and raised
                if not _transient(err):
                    raise (_named(err, self._location) if isinstance(err, OSError)
                           and self._location not in str(err) else err) from err
                self._drop()
                if attempt == attempts:
                    raise _exhausted(self._location, attempts, err, self._offset) from err
                delay = _backoff(attempt)
                log.warning("%s: %s at byte %d (try %d of %d); reading on from there in %.1fs", self._location,
                            type(err).__name__, self._offset, attempt, attempts, delay)
                time.sleep(delay)
                continue
            buffer[:len(data)] = data
            self._offset += len(data)
            return len(data)
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None

    def close(self) -> None:
        self._drop()
        super().close()


def open_seekable(location: str) -> IO[bytes]:
    """A reader that seeks: local, or an S3 object fetched in small ranges, so that a parquet reader fetches the
    footer and the row groups it needs, not the object."""
    return _open(location, RANGE_BLOCK)


def _open(location: str, block_size: int) -> IO[bytes]:
    if not is_s3(location):
        return open(location, "rb")
    with _filesystem(location) as (files, path):
        return files.open(path, "rb", block_size=block_size, cache_type="readahead")


def upload_tree(local: str | os.PathLike, location: str, exclude: tuple[str, ...] = ()) -> list[str]:
    """Publish a copy of every file under the local folder at ``location`` (top-level names in ``exclude`` are
    skipped); each file appears whole. Returns the relative paths copied."""
    copied = []
    for name, _, _ in tree_entries(str(local)):
        if name.split("/", 1)[0] in exclude:
            continue
        copy_file(Path(local, name), join(location, *name.split("/")))
        copied.append(name)
    return copied


def download_tree(location: str, local: str | os.PathLike) -> list[str]:
    """Every file under ``location`` (local or s3://) into the local folder, each written atomically."""
    names = [name for name, _, _ in tree_entries(location)]
    if not names:
        raise FileNotFoundError(f"{location} holds no files")
    for name in names:
        download_file(join(location, name), Path(local, name))
    return names


def download_file(location: str, local: str | os.PathLike) -> None:
    """The file at ``location`` (local or s3://) into the local path ``local``, atomically, its read retried."""
    with _filesystem(location) as (files, source), atomic_path(local) as tmp:
        _retried_read(location, lambda: files.get_file(source, str(tmp)))
