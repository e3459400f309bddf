"""Local paths and ``s3://`` URLs behind one small interface, so every stage reads and writes either.

S3 goes through boto3 with its standard configuration: credentials and region from the environment (or an
attached role), and ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for S3-compatible servers such as MinIO.
Writes are atomic on both: a local file is written beside its target and renamed; an S3 object appears only
when its upload completes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import IO, Any

from cloob_core.io import atomic_path, parse_json

LEASE_PREFIX = ".cloob-lease"  # the files of cloob_core.lease: bookkeeping while a stage writes, never content


def is_s3(location: str | os.PathLike) -> bool:
    return str(location).startswith("s3://")


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/key/part`` → (``bucket``, ``key/part``)."""
    rest = str(url)[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket")
    return bucket, key


@functools.cache
def _client_for_process(pid: int) -> Any:
    import boto3
    from botocore.config import Config

    # Bounded waits (botocore's defaults, stated here): 60 s to connect and for the next bytes of an answer;
    # retries as the environment configures them (AWS_RETRY_MODE, AWS_MAX_ATTEMPTS).
    return boto3.session.Session().client("s3", config=Config(connect_timeout=60, read_timeout=60))


def s3_client() -> Any:
    """One boto3 client per process (clients are thread-safe, but must not cross a fork)."""
    return _client_for_process(os.getpid())


def endpoint() -> str:
    """The S3 endpoint this process talks to (an S3-compatible server's URL, or AWS's regional one)."""
    return s3_client().meta.endpoint_url


def join(base: str | os.PathLike, *parts: str) -> str:
    if is_s3(base):
        return "/".join([str(base).rstrip("/"), *parts])
    return str(Path(base, *parts))


def read_bytes(location: str | os.PathLike) -> bytes:
    if is_s3(location):
        bucket, key = split_s3(str(location))
        try:
            return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except s3_client().exceptions.NoSuchKey:
            raise FileNotFoundError(str(location)) from None
    return Path(location).read_bytes()


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
    if is_s3(location):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(str(location))
        try:
            s3_client().head_object(Bucket=bucket, Key=key)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True
    return Path(location).exists()


def found(location: str | os.PathLike) -> bool:
    """A file or a folder is there: for S3, an object or any object under the prefix."""
    if is_s3(location):
        bucket, key = split_s3(str(location))
        key = key.rstrip("/")
        if key and exists(location):
            return True
        listed = s3_client().list_objects_v2(Bucket=bucket, Prefix=f"{key}/" if key else "", MaxKeys=1)
        return bool(listed.get("KeyCount"))
    return Path(location).exists()


def list_names(folder: str | os.PathLike, suffix: str = "") -> list[str]:
    """Base names of the files directly in ``folder`` that end with ``suffix``, sorted."""
    if is_s3(folder):
        bucket, prefix = split_s3(str(folder))
        prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        names = []
        paginator = s3_client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
            for item in page.get("Contents", []):
                name = item["Key"][len(prefix) :]
                if name.endswith(suffix) and not name.startswith(LEASE_PREFIX):
                    names.append(name)
        return sorted(names)
    path = Path(folder)
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir()
                  if p.is_file() and p.name.endswith(suffix) and not p.name.startswith(LEASE_PREFIX))


def delete(location: str | os.PathLike) -> None:
    if is_s3(location):
        bucket, key = split_s3(str(location))
        s3_client().delete_object(Bucket=bucket, Key=key)
    else:
        Path(location).unlink(missing_ok=True)


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
    or a (multipart) upload to S3, which makes the object visible only once complete."""
    if is_s3(location):
        copy_file(local, location)
        return
    try:
        os.replace(local, location)
    except OSError:
        copy_file(local, location)
        Path(local).unlink(missing_ok=True)


def copy_file(local: str | os.PathLike, location: str) -> None:
    """Publish a copy of a local file at ``location`` (the source stays): an atomic local copy, or a (multipart)
    upload to S3."""
    if is_s3(location):
        bucket, key = split_s3(location)
        s3_client().upload_file(str(local), bucket, key)
        return
    with atomic_path(location) as tmp:
        shutil.copyfile(local, tmp)


def write_bytes(location: str | os.PathLike, data: bytes) -> None:
    if is_s3(location):
        bucket, key = split_s3(str(location))
        s3_client().put_object(Bucket=bucket, Key=key, Body=data)
        return
    with atomic_path(location) as tmp:
        tmp.write_bytes(data)


class WriteConflict(Exception):
    """A conditional write found the object changed since it was read."""


def read_versioned(location: str | os.PathLike) -> tuple[bytes | None, str | None]:
    """The object's bytes and a version token for :func:`write_if_unchanged` (``(None, None)``: no object)."""
    if is_s3(location):
        bucket, key = split_s3(str(location))
        try:
            reply = s3_client().get_object(Bucket=bucket, Key=key)
        except s3_client().exceptions.NoSuchKey:
            return None, None
        return reply["Body"].read(), reply["ETag"]
    try:
        data = Path(location).read_bytes()
    except FileNotFoundError:
        return None, None
    return data, hashlib.sha256(data).hexdigest()


def write_if_unchanged(location: str | os.PathLike, data: bytes, version: str | None) -> str:
    """Write ``data`` only if the object is still at ``version`` (``None``: only if there is none yet); else
    raise :class:`WriteConflict`; the version written otherwise (for the next conditional write). On S3 a
    conditional PUT (``If-Match`` / ``If-None-Match: *``, which AWS S3 and MinIO honour), checked and applied by the
    server in one step. Locally the check and the atomic rename happen
    under an exclusive ``flock`` on ``<location>.lock``, which every writer through here takes."""
    if is_s3(location):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(str(location))
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            return s3_client().put_object(Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict",
                                                             "412", "409"):
                raise WriteConflict(f"{location} changed since it was read") from None
            raise

    path = Path(location)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = hold_lock(path.with_name(path.name + ".lock"), LOCK_WAIT_S)
    except TimeoutError as err:
        raise TimeoutError(f"{err} for over {LOCK_WAIT_S:g} s; is a process stuck?") from None
    with lock:
        if read_versioned(path)[1] != version:
            raise WriteConflict(f"{location} changed since it was read")
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)
    return hashlib.sha256(data).hexdigest()  # the version read_versioned gives


def outcome_unknown(err: BaseException) -> bool:
    """Whether a failed request may still have been applied: the server answered 5xx (after its retries) or the
    connection broke after the request was sent. A conditional write that ends so must be checked by reading."""
    from botocore import exceptions

    if isinstance(err, exceptions.ClientError):
        return int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0) >= 500
    return isinstance(err, (exceptions.ConnectionError, exceptions.HTTPClientError))


def honours_conditional_writes(folder: str) -> bool:
    """Probe whether the store under ``folder`` applies conditional writes: a second create of one object
    (``If-None-Match: *``) and a write against a wrong version (``If-Match``) must both be refused. Some
    S3-compatible servers and proxies ignore the headers and overwrite. Local folders use a lock: always True.
    The probe object has a unique name and is removed; a reply lost on the way is recognised by reading it."""
    if not is_s3(folder):
        return True
    import uuid

    probe = join(folder, ".cas-probe", uuid.uuid4().hex)
    token = uuid.uuid4().hex.encode()
    try:
        try:
            write_if_unchanged(probe, token, None)
        except WriteConflict:
            if read_bytes(probe) != token:  # the name is unique: only a lost reply of our own create explains it
                return False
        refused = 0
        for version in (None, '"0123456789abcdef0123456789abcdef"'):
            try:
                write_if_unchanged(probe, b"overwritten", version)
            except WriteConflict:
                refused += 1
        return refused == 2 and read_bytes(probe) == token
    finally:
        delete(probe)


LOCK_WAIT_S = 60.0  # a writer holds the lock for one read and one rename: a minute means it is stuck


def hold_lock(path: Path, wait_s: float) -> IO:
    """An exclusive ``flock`` on ``path`` (created if missing), waiting at most ``wait_s`` seconds, else
    ``TimeoutError``. Released when the returned handle closes, also when the process dies. A holder may remove
    the file as it lets go: then the fresh file is locked instead."""
    import fcntl

    deadline = time.monotonic() + wait_s
    while True:
        handle = open(path, "a")  # noqa: SIM115 - the caller holds it open
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{path} is locked by another process") from None
            time.sleep(0.02)
            continue
        try:
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                return handle
        except FileNotFoundError:
            pass
        handle.close()


def open_read(location: str) -> IO[bytes]:
    """A streaming binary reader: a local file, or the body of an S3 object."""
    if is_s3(location):
        bucket, key = split_s3(location)
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"]
    return open(location, "rb")


def open_seekable(location: str, block_size: int = 2 * 1024 * 1024) -> IO[bytes]:
    """A seekable binary reader: a local file, or an S3 object read by ranges of ``block_size`` through s3fs, so
    that a parquet reader fetches the footer and the row groups it needs, not the object."""
    if is_s3(location):
        return s3_filesystem().open(location, "rb", block_size=block_size, cache_type="readahead")
    return open(location, "rb")


def s3_filesystem() -> Any:
    """fsspec's S3 filesystem on this process's endpoint (what engines such as DuckDB and pyarrow read through)."""
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint()})


def tree_entries(location: str) -> list[tuple[str, int, str]]:
    """``(path, size, version)`` of every file under the folder ``location``, sorted by path (``/``-separated,
    relative to it); the version is the S3 ETag, or locally the modification time in nanoseconds."""
    if is_s3(location):
        bucket, prefix = split_s3(location)
        prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        entries = []
        for page in s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            entries += [(item["Key"][len(prefix):], item["Size"], item["ETag"]) for item in page.get("Contents", [])
                        if not item["Key"].endswith("/") and not item["Key"].rpartition("/")[2].startswith(
                            LEASE_PREFIX)]
        return sorted(entries)
    root = Path(location)
    files = (p for p in root.rglob("*") if p.is_file() and not p.name.startswith(LEASE_PREFIX)) if root.is_dir() \
        else ()
    return sorted((p.relative_to(root).as_posix(), p.stat().st_size, str(p.stat().st_mtime_ns)) for p in files)


def _tree_files(location: str) -> list[str]:
    """Paths (``/``-separated, relative to ``location``) of every file under it, sorted."""
    return [path for path, _, _ in tree_entries(location)]


def upload_tree(local: str | os.PathLike, location: str, exclude: tuple[str, ...] = ()) -> list[str]:
    """Publish a copy of every file under the local folder at ``location`` (top-level names in ``exclude`` are
    skipped); each file appears whole. Returns the relative paths copied."""
    copied = []
    for name in _tree_files(str(local)):
        if name.split("/", 1)[0] in exclude:
            continue
        target = join(location, *name.split("/"))
        if not is_s3(target):
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        copy_file(Path(local, name), target)
        copied.append(name)
    return copied


def download_tree(location: str, local: str | os.PathLike) -> list[str]:
    """Every file under ``location`` (local or s3://) into the local folder, each written atomically."""
    names = _tree_files(location)
    if not names:
        raise FileNotFoundError(f"{location} holds no files")
    for name in names:
        target = Path(local, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        source = join(location, *name.split("/"))
        if is_s3(source):
            with atomic_path(target) as tmp:
                bucket, key = split_s3(source)
                s3_client().download_file(bucket, key, str(tmp))
        else:
            copy_file(source, str(target))
    return names
