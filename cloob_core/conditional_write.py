"""The conditional write that fsspec lacks: replace an object only if it is still the version that was read.

The promotion pointer and the S3 leases rest on it. On S3 it is a conditional PUT (``If-Match`` on a version,
``If-None-Match: *`` for a create), which the server checks and applies in one step; s3fs can create exclusively
but cannot write against a version, so these calls use boto3 with the same settings (``storage.s3_client``).
Locally an exclusive ``flock`` stands in for it, which every writer through here takes.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import IO

from cloob_core import storage
from cloob_core.io import atomic_path

LOCK_WAIT_S = 60.0  # a writer holds the lock for one read and one rename: a minute means it is stuck


class WriteConflict(Exception):
    """A conditional write found the object changed since it was read."""


def read_versioned(location: str | os.PathLike) -> tuple[bytes | None, str | None]:
    """The object's bytes and a version token for :func:`write_if_unchanged` (``(None, None)``: no object)."""
    if storage.is_s3(location):
        bucket, key = storage.split_s3(str(location))
        try:
            reply = storage.s3_client().get_object(Bucket=bucket, Key=key)
        except storage.s3_client().exceptions.NoSuchKey:
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
    if storage.is_s3(location):
        from botocore.exceptions import ClientError

        bucket, key = storage.split_s3(str(location))
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            return storage.s3_client().put_object(Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict",
                                                             "412", "409", "NoSuchKey", "404"):  # 404: gone since
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
    if not storage.is_s3(folder):
        return True
    import uuid

    probe = storage.join(folder, ".cas-probe", uuid.uuid4().hex)
    token = uuid.uuid4().hex.encode()
    try:
        try:
            write_if_unchanged(probe, token, None)
        except WriteConflict:
            # the name is unique: only a lost reply of our own create explains a conflict on it
            if storage.read_bytes(probe) != token:
                return False
        refused = 0
        for version in (None, '"0123456789abcdef0123456789abcdef"'):
            try:
                write_if_unchanged(probe, b"overwritten", version)
            except WriteConflict:
                refused += 1
        _remove_abandoned_probes(storage.join(folder, ".cas-probe"), probe)
        return refused == 2 and storage.read_bytes(probe) == token
    finally:
        storage.delete(probe)


PROBE_ABANDONED_S = 600.0  # a probe takes seconds: one this much older than ours was left by a killed gate


def _remove_abandoned_probes(prefix: str, ours: str) -> None:
    """Remove probe objects a killed gate left, judged by the server's clock: older than ours by
    :data:`PROBE_ABANDONED_S` (a running gate's probe is seconds old)."""
    bucket, key = storage.split_s3(prefix)
    listed = storage.s3_client().list_objects_v2(Bucket=bucket, Prefix=key + "/").get("Contents", [])
    now = next((entry["LastModified"] for entry in listed if entry["Key"] == storage.split_s3(ours)[1]), None)
    if now is None:
        return
    for entry in listed:
        if (now - entry["LastModified"]).total_seconds() > PROBE_ABANDONED_S:
            storage.delete(f"s3://{bucket}/{entry['Key']}")


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
