"""One writer per output: a stage that writes an output folder holds its lease for as long as it writes.

A second writer of the same folder is refused at once with one line naming the holder (host, pid, start time), so
two runs never interleave their files and neither reports success over the other's output. The lease is a file
in the folder, ``.cloob-lease[.NAME].json`` (``NAME`` splits a folder that several writers share by design, such
as the partitions of one download), removed when the stage ends:

- locally an exclusive ``flock`` on it: the kernel releases it when the holder dies, so a dead holder's lease is
  taken over at once (and that is logged);
- on S3 an object created with ``If-None-Match: *``, which its holder renews (a conditional write against its own
  version) every third of its time to live. A lease not renewed for that long, judged by the server's clock
  (``Last-Modified`` against the reply's ``Date``; a store that sends no ``Date`` has the lease watched for its
  time to live instead, never judged by this machine's clock), or whose holder runs on this machine and pid
  namespace (boot id and pid namespace beside the host name, which pods and containers reuse) and is no longer
  running, is taken over with ``If-Match`` on the stale version, so exactly one of several contenders gets it.
  A lease whose time to live is not a positive finite number is unreadable, and taken over.

Writes under a lease are fenced: before each write that publishes work, the stage calls :func:`check_held`,
which renews the lease now; a takeover has changed its version, so a holder that was paused past its time to live
learns it there and publishes nothing more (:class:`LeaseLost`). After a renewal no one can take the lease for its
time to live, so the write that follows is the holder's. A holder that finds its lease taken at the end fails
instead of presenting the output as its own.

A stage that calls another on the same folder in the same thread (the suite's report combining reports) holds the
one lease.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import IO, Any, ParamSpec, TypeVar

from cloob_core import conditional_write, scratch, storage
from cloob_core.errors import StageError

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

TTL_S = 60.0  # an S3 lease not renewed for this long is stale; renewed every third of it
MAX_TTL_S = 86400.0  # a lease that claims longer is not trusted (taken over as unreadable)


class OutputBusy(StageError):
    """Another run is writing the same output."""


class LeaseLost(StageError):
    """This run's lease on its output was taken over while it wrote (it stalled past the lease's time to live)."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str
    token: str
    ttl_s: float = TTL_S
    machine: str = ""  # scratch.machine_id(): "" in leases written before it was recorded

    @classmethod
    def me(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   uuid.uuid4().hex, TTL_S, scratch.machine_id())

    @classmethod
    def parse(cls, data: bytes | str) -> Holder | None:
        """The holder a lease file names; None when it cannot be trusted: empty (being written), not ours, or a
        time to live that is not a positive finite number (such a lease would never lapse)."""
        try:
            fields = json.loads(data)
            holder = cls(str(fields["host"]), int(fields["pid"]), str(fields["started"]), str(fields["token"]),
                         float(fields.get("ttl_s", TTL_S)), str(fields.get("machine", "")))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return holder if math.isfinite(holder.ttl_s) and 0 < holder.ttl_s <= MAX_TTL_S else None

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"

    def running_here(self) -> bool | None:
        """Whether the holder's process is alive: None when it may run on another machine, or in another pid
        namespace (unknowable from here; a host name alone does not tell)."""
        if self.host != socket.gethostname() or not self.machine or self.machine != scratch.machine_id():
            return None
        return scratch.alive(self.pid)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


def lease_name(name: str = "") -> str:
    return f"{storage.LEASE_PREFIX}.{name}.json" if name else f"{storage.LEASE_PREFIX}.json"


_held: dict[tuple[int, str], int] = {}  # leases held, by thread and file, with their nesting depth
_held_lock = threading.Lock()


@contextlib.contextmanager
def writing(output: str | os.PathLike, name: str = "", what: str = "") -> Iterator[None]:
    """Hold the lease on ``output`` (a local folder, created if needed, or an ``s3://`` prefix) for the block;
    :class:`OutputBusy` naming the holder when another run has it. ``what`` names the output in messages."""
    storage.ensure_folder(output)
    location = storage.join(str(output), lease_name(name))
    key = threading.get_ident(), location if storage.is_s3(location) else str(Path(location).resolve())
    with _held_lock:
        nested = key in _held
        _held[key] = _held.get(key, 0) + 1
    try:
        if nested:
            yield
            return
        label = what or str(output)
        with (_s3_lease if storage.is_s3(location) else _local_lease)(location, label):
            yield
    finally:
        with _held_lock:
            _held[key] -= 1
            if not _held[key]:
                del _held[key]


def _busy(label: str, holder: Holder | None) -> OutputBusy:
    who = holder.describe() if holder else "another process"
    return OutputBusy(f"{label} is being written by another run ({who}); wait for it to end, or write elsewhere")


@contextlib.contextmanager
def _local_lease(location: str, label: str) -> Iterator[None]:
    path = Path(location)
    try:
        handle: IO = conditional_write.hold_lock(path, wait_s=0)
    except TimeoutError:
        raise _busy(label, Holder.parse(_read_quietly(path))) from None
    try:
        previous = Holder.parse(_read_quietly(path))
        if previous is not None:
            log.warning("taking over the lease on %s from %s, which ended without releasing it", label,
                        previous.describe())
        os.ftruncate(handle.fileno(), 0)
        handle.write(Holder.me().encode().decode())
        handle.flush()
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:  # ours, not a successor's
                path.unlink()
        handle.close()


def _read_quietly(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class _Renewal(threading.Thread):
    """Renews an S3 lease every third of its time to live; notes when it was taken over."""

    def __init__(self, location: str, holder: Holder, version: str) -> None:
        super().__init__(daemon=True, name="cloob-lease-renewal")
        self.location, self.holder, self.version = location, holder, version
        self.lost: str | None = None
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._last_renewed = time.monotonic()

    def run(self) -> None:
        while not self._stop_event.wait(self.holder.ttl_s / 3) and self.lost is None:
            try:
                self.renew()
            except Exception as err:  # a flaky store: try again at the next beat, until the lease would lapse
                if time.monotonic() - self._last_renewed > self.holder.ttl_s:
                    self.lost = f"not renewed for {self.holder.ttl_s:g} s ({type(err).__name__}: {err})"

    def renew(self) -> None:
        """One renewal: a conditional write against the version this holder wrote last, which a takeover
        changes. Sets ``lost`` when the lease is another's."""
        with self._lock:
            if self.lost is not None:
                return
            try:
                self.version = conditional_write.write_if_unchanged(self.location, self.holder.encode(), self.version)
                self._last_renewed = time.monotonic()
            except conditional_write.WriteConflict:
                current, version, _ = _read_holder(self.location)
                if current is None or current.token != self.holder.token:
                    self.lost = f"taken over by {current.describe() if current else 'another run'}"
                    return
                self.version = version  # still ours (a renewal whose reply was lost): renew that version
                self.version = conditional_write.write_if_unchanged(self.location, self.holder.encode(), self.version)
                self._last_renewed = time.monotonic()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def _read_holder(location: str) -> tuple[Holder | None, str | None, float | None]:
    """The lease's holder, its version, and its age in seconds by the server's clock (None: no lease)."""
    bucket, key = storage.split_s3(location)
    try:
        reply = storage.s3_client().get_object(Bucket=bucket, Key=key)
    except storage.s3_client().exceptions.NoSuchKey:
        return None, None, None
    body = reply["Body"].read()
    server_now = _server_time(reply)
    age = None if server_now is None else (server_now - reply["LastModified"]).total_seconds()
    return Holder.parse(body), reply["ETag"], age


def _server_time(reply: dict[str, Any]) -> datetime | None:
    """The server's time of the reply (its ``Date`` header); None when it sent none this client can read. Never
    this machine's clock: the holder's renewals are stamped by the server's."""
    date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        when = parsedate_to_datetime(date)
    except (TypeError, ValueError, IndexError):
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)  # HTTP dates are GMT


def _unchanged_for(location: str, version: str, ttl_s: float) -> bool:
    """Whether the lease stays at ``version`` for ``ttl_s`` seconds by this machine's monotonic clock: its age
    where the store gives no time to judge it by (a renewal would change the version within a third of that)."""
    deadline = time.monotonic() + ttl_s
    while time.monotonic() < deadline:
        time.sleep(min(1.0, ttl_s / 10))
        if _read_holder(location)[1] != version:
            return False
    return True


def _stale(holder: Holder | None, age: float | None) -> str | None:
    """Why a lease may be taken over, or None while its holder may still be writing."""
    if holder is None:
        return "unreadable"
    if holder.running_here() is False:
        return "its process is no longer running"
    if age is not None and age > holder.ttl_s:
        return f"not renewed for {age:.0f} s"
    return None


@contextlib.contextmanager
def _s3_lease(location: str, label: str) -> Iterator[None]:
    me = Holder.me()
    version = _acquire_s3(location, label, me)
    renewal = _Renewal(location, me, version)
    renewal.start()
    _renewals[location] = renewal
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        _renewals.pop(location, None)
        renewal.stop()
        current = _read_holder(location)[0]
        if current is not None and current.token == me.token:
            storage.delete(location)
        elif renewal.lost is None:
            renewal.lost = f"taken over by {current.describe() if current else 'another run, which released it'}"
        if renewal.lost and not failed:
            raise LeaseLost(f"the lease on {label} was lost while this run wrote it ({renewal.lost}): another run "
                            "may have written there too, so this run's output is not trusted; run it again")


def _acquire_s3(location: str, label: str, me: Holder) -> str:
    """Create the lease, or take over a stale one; the version held. A conflict is read back: our own write whose
    reply was lost, a live holder (busy), a stale one, or a lease released in between."""
    for _attempt in range(5):
        try:
            return conditional_write.write_if_unchanged(location, me.encode(), None)
        except conditional_write.WriteConflict:
            pass
        holder, version, age = _read_holder(location)
        if holder is not None and holder.token == me.token:  # our own create or takeover; its reply was lost
            return version
        if version is None:  # released in between: try again
            continue
        why = _stale(holder, age)
        if why is None and age is None and holder is not None:
            log.warning("%s: the store sends no Date header to judge the lease's age by; watching it for %g s",
                        label, holder.ttl_s)
            why = f"not renewed for {holder.ttl_s:g} s (watched)" if _unchanged_for(location, version,
                                                                                     holder.ttl_s) else None
        if why is None:
            raise _busy(label, holder)
        try:
            taken = conditional_write.write_if_unchanged(location, me.encode(), version)
        except conditional_write.WriteConflict:
            continue  # another contender took it first (or our takeover's reply was lost): look again
        log.warning("taking over the lease on %s from %s (%s)", label,
                    holder.describe() if holder else "an unreadable holder", why)
        return taken
    raise _busy(label, _read_holder(location)[0])


_renewals: dict[str, _Renewal] = {}  # the S3 leases this process holds, by location


def check_held(output: str | os.PathLike, name: str = "", what: str = "") -> None:
    """Fence a publication: call it right before a write that makes work visible (an index, a part, a shard).
    On S3 it renews the lease now, a conditional write against this holder's version, which a takeover changes;
    a writer whose lease was taken (it was paused past the lease's time to live) gets :class:`LeaseLost` and
    publishes nothing more. After a renewal no other run can take the lease for its time to live, so the write
    that follows is this holder's. Locally the ``flock`` is held until the process dies: nothing to check."""
    if not storage.is_s3(output):
        return
    location = storage.join(str(output), lease_name(name))
    renewal = _renewals.get(location)
    if renewal is None:
        return  # not written under a lease (a temporary folder)
    renewal.renew()
    if renewal.lost:
        raise LeaseLost(f"the lease on {what or output} was lost while this run wrote it ({renewal.lost}): another "
                        "run took over, so this run publishes nothing more; run it again")


def holding(parameter: str, name: str = "") -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A stage function that holds the lease on its argument ``parameter`` (an output folder; None: nothing to
    hold) while it runs."""

    def decorate(stage: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(stage)

        @functools.wraps(stage)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            output = signature.bind(*args, **kwargs).arguments.get(parameter)
            if output is None:
                return stage(*args, **kwargs)
            with writing(output, name):
                return stage(*args, **kwargs)

        return run

    return decorate
