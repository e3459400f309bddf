"""The downloader: one URL to bytes, or a reason why not, within a hard deadline.

Safety is enforced where the socket is opened, not by looking at the URL: every address a host name resolves to
is checked, and the connection goes to the checked address, so DNS tricks and redirects to internal hosts are
refused as well as literal ones. Only transient failures (5xx, 429, timeouts, resets, truncated bodies) are
retried, with exponential backoff, and never past the URL's overall deadline.

Socket timeouts bound each read, not a response: a server that drips its headers a byte a second never trips
them. So each attempt runs under a watchdog that shuts its sockets down just after the URL's deadline passes.
"""

from __future__ import annotations

import contextlib
import heapq
import ipaddress
import itertools
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from urllib.parse import urljoin, urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    LocationParseError,
    NameResolutionError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.util import connection as _connection

from cloob_core import __version__
from cloob_core.config import DownloadConfig

USER_AGENT_TOKEN = "cloob-pipelines"
USER_AGENT = f"{USER_AGENT_TOKEN}/{__version__} (image-text dataset builder; honours X-Robots-Tag noai)"
OPT_OUT_DIRECTIVES = frozenset({"noai", "noimageai", "noindex", "noimageindex"})
TRANSIENT_REASONS = frozenset({"timeout", "connection_error", "truncated", "http_429"})
_CHUNK = 64 * 1024
_WATCHDOG_GRACE_S = 1.0  # socket timeouts (capped at the time left) report a plain stall first, as "timeout"
_ACCEPTED_TYPES = ("image/", "application/octet-stream", "binary/octet-stream")

# Instance-metadata endpoints; most are link-local or private anyway, Azure's wire server is not.
_METADATA_ADDRESSES = {
    ipaddress.ip_address(a) for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200",
                                      "168.63.129.16")
}


class RefusedAddress(ValueError):
    """Raised inside the connection: the host resolves only to addresses the policy refuses."""


# IPv6 prefixes that carry an IPv4 address in their last 32 bits: NAT64 (RFC 6052's well-known prefix and RFC
# 8215's local-use one), IPv4-compatible (deprecated ::a.b.c.d) and IPv4-translated (SIIT) forms.
_NAT64_AND_COMPATIBLE = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "64:ff9b:1::/48", "::/96",
                                                                "::ffff:0:0:0/96"))
_ISATAP_IDS = (0x00005EFE, 0x02005EFE)  # ISATAP interface identifiers: ::0:5efe:a.b.c.d, ::200:5efe:a.b.c.d


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address an IPv6 address can deliver to: mapped, NAT64, compatible, 6to4, Teredo, ISATAP."""
    found = [a for a in (ip.ipv4_mapped, ip.sixtofour) if a is not None]
    if ip.teredo is not None:
        found += list(ip.teredo)  # (server, client)
    low32 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if any(ip in network for network in _NAT64_AND_COMPATIBLE) and int(ip) > 1:  # not :: or ::1
        found.append(low32)
    if (int(ip) >> 32) & 0xFFFFFFFF in _ISATAP_IDS:
        found.append(low32)
    return found


def address_refusal(address: str, allow_private: bool = False) -> str | None:
    """Why connecting to ``address`` is refused, or None. An IPv6 address that embeds an IPv4 one (mapped,
    NAT64, compatible, 6to4, Teredo, ISATAP) is refused when either is. Cloud-metadata endpoints are refused
    even when private networks are allowed: they hand out credentials, and no image lives there."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    candidates = [*(embedded_ipv4(ip) if isinstance(ip, ipaddress.IPv6Address) else []), ip]  # the real target first
    for candidate in candidates:
        if candidate in _METADATA_ADDRESSES:
            return "cloud metadata address" + (f" (embedded in {ip})" if candidate != ip else "")
    if allow_private:
        return None
    for candidate in candidates:
        why = _non_public(candidate)
        if why:
            return why + (f" (embedded in {ip})" if candidate != ip else "")
    return None


def _non_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    for attribute, why in (("is_loopback", "loopback"), ("is_unspecified", "unspecified"),
                           ("is_link_local", "link-local"), ("is_multicast", "multicast"),
                           ("is_private", "private")):
        if getattr(ip, attribute):
            return f"{why} address"
    if not ip.is_global:
        return "non-global address"
    return None


_resolver: ThreadPoolExecutor | None = None


def _resolve(host: str, port: int, timeout: float | None) -> list:
    """getaddrinfo with a deadline: the C resolver has none of its own that we control."""
    global _resolver
    if _resolver is None:
        _resolver = ThreadPoolExecutor(max_workers=16, thread_name_prefix="dns")
    future = _resolver.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    try:
        return future.result(timeout=timeout)
    except FutureTimeout:
        raise socket.gaierror(f"DNS lookup of {host} took longer than {timeout} s") from None


class _Alarms:
    """One thread that fires each registered watchdog when its time comes: a thread per attempt (``threading.Timer``)
    cost a thread's start, a handful of context switches and a fifth of a worker's CPU on a small image."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, _Watchdog]] = []  # a heap; cancelled entries are dropped when reached
        self._count = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, when: float, watchdog: _Watchdog) -> None:
        with self._wake:
            heapq.heappush(self._due, (when, next(self._count), watchdog))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fetch-deadlines", daemon=True)
                self._thread.start()
            elif self._due[0][2] is watchdog:  # a new earliest deadline: the thread sleeps until a later one
                self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._wake.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, watchdog = heapq.heappop(self._due)
            watchdog.fire()


_alarms = _Alarms()


class _Watchdog:
    """Cuts this thread's sockets when the deadline passes, whatever phase the exchange is in (connect, TLS
    handshake, headers, body). Sockets register themselves as they are created or reused."""

    _current = threading.local()

    def __init__(self, deadline: float):
        self.sockets: list[socket.socket] = []
        self.fired = False
        self._done = False
        self._lock = threading.Lock()
        self._deadline = deadline + _WATCHDOG_GRACE_S

    def __enter__(self) -> _Watchdog:
        _Watchdog._current.value = self
        _alarms.add(self._deadline, self)
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._done = True
            self.sockets.clear()
        _Watchdog._current.value = None

    @classmethod
    def watch(cls, sock: socket.socket | None) -> None:
        watchdog = getattr(cls._current, "value", None)
        if watchdog is None or sock is None:
            return
        with watchdog._lock:
            if watchdog.fired:
                _cut(sock)
            else:
                watchdog.sockets.append(sock)

    def fire(self) -> None:
        with self._lock:
            if self._done:  # the attempt ended in time; its sockets may be another attempt's by now
                return
            self.fired = True
            for sock in self.sockets:
                _cut(sock)


def _cut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)  # a blocked recv returns at once; the pool discards the connection


def _guarded_new_conn(conn: HTTPConnection, allow_private: bool) -> socket.socket:
    timeout = conn.timeout if isinstance(conn.timeout, (int, float)) else None
    try:
        infos = _resolve(conn._dns_host, conn.port, timeout)
    except socket.gaierror as err:
        raise NameResolutionError(conn.host, conn, err) from err
    candidates, refused = [], []
    for info in infos:
        address = info[4][0]
        why = address_refusal(address, allow_private)
        (refused.append(f"{address} ({why})") if why else candidates.append(address))
    if not candidates:
        raise RefusedAddress(f"{conn.host} resolves to {', '.join(refused)}")
    last: Exception | None = None
    for address in candidates:
        try:
            sock = _connection.create_connection(
                (address, conn.port), conn.timeout, source_address=conn.source_address,
                socket_options=conn.socket_options,
            )
            _Watchdog.watch(sock)
            return sock
        except TimeoutError as err:
            last = ConnectTimeoutError(conn, f"connection to {conn.host} timed out (timeout={conn.timeout})")
            last.__cause__ = err
        except OSError as err:
            last = NewConnectionError(conn, f"failed to connect to {conn.host}: {err}")
    assert last is not None
    raise last


def _pool_manager(allow_private: bool, maxsize: int) -> urllib3.PoolManager:
    class GuardedHTTP(HTTPConnection):
        def _new_conn(self) -> socket.socket:
            return _guarded_new_conn(self, allow_private)

        def getresponse(self):  # a pooled connection is reused without _new_conn: watch it here too
            _Watchdog.watch(self.sock)
            return super().getresponse()

    class GuardedHTTPS(HTTPSConnection):
        def _new_conn(self) -> socket.socket:
            return _guarded_new_conn(self, allow_private)

        def getresponse(self):
            _Watchdog.watch(self.sock)
            return super().getresponse()

    class GuardedHTTPPool(HTTPConnectionPool):
        ConnectionCls = GuardedHTTP

    class GuardedHTTPSPool(HTTPSConnectionPool):
        ConnectionCls = GuardedHTTPS

    manager = urllib3.PoolManager(num_pools=256, maxsize=maxsize, block=False)
    manager.pool_classes_by_scheme = {"http": GuardedHTTPPool, "https": GuardedHTTPSPool}
    return manager


def opted_out(header_values: list[str], user_agent_token: str = USER_AGENT_TOKEN) -> bool:
    """True when an ``X-Robots-Tag`` value opts this image out for every agent or for ours.

    ``googlebot: noindex`` addresses another agent and is ignored; ``noai, nofollow`` applies to all.
    """
    for value in header_values:
        agent, sep, directives = value.partition(":")
        if not sep:
            agent, directives = "", value
        agent = agent.strip().lower()
        if agent and agent not in ("*", user_agent_token.lower()):
            continue
        if OPT_OUT_DIRECTIVES & {d.strip().lower() for d in directives.split(",")}:
            return True
    return False


@dataclass(frozen=True)
class FetchPolicy:
    """The fetch settings of ``DownloadConfig``, under its names; their defaults and meanings are kept there."""

    connect_timeout: float
    read_timeout: float
    url_deadline: float
    retries: int
    backoff: float
    max_redirects: int
    max_bytes: int
    respect_opt_out: bool
    allow_private_network: bool

    @classmethod
    def from_config(cls, config: DownloadConfig) -> FetchPolicy:
        return cls(**{field.name: getattr(config, field.name) for field in fields(cls)})


@dataclass
class FetchResult:
    data: bytes | None
    reason: str | None = None
    detail: str = ""
    status: int | None = None
    attempts: int = 0
    final_url: str = ""

    @property
    def ok(self) -> bool:
        return self.data is not None


class _Failure(Exception):
    def __init__(self, reason: str, detail: str = "", status: int | None = None):
        super().__init__(detail)
        self.reason, self.detail, self.status = reason, detail, status


def _retryable(reason: str) -> bool:
    return reason in TRANSIENT_REASONS or reason.startswith("http_5")


class Fetcher:
    """Thread-safe: one per process, shared by its download threads (connections are pooled per host)."""

    def __init__(self, policy: FetchPolicy, pool_size: int = 32):
        self.policy = policy
        self.http = _pool_manager(policy.allow_private_network, pool_size)

    def fetch(self, url: str) -> FetchResult:
        policy = self.policy
        deadline = time.monotonic() + policy.url_deadline
        attempts = 0
        while True:
            attempts += 1
            try:
                data, final_url = self._attempt(url, deadline)
                return FetchResult(data, attempts=attempts, final_url=final_url, status=200)
            except _Failure as failure:
                remaining = deadline - time.monotonic()
                delay = policy.backoff * 2 ** (attempts - 1)
                if not _retryable(failure.reason) or attempts > policy.retries or delay >= remaining:
                    return FetchResult(None, failure.reason, failure.detail, failure.status, attempts, url)
                time.sleep(delay)

    def _attempt(self, url: str, deadline: float) -> tuple[bytes, str]:
        with _Watchdog(deadline) as watchdog:
            try:
                answer = self._exchange(url, deadline)
            except _Failure as failure:
                if not watchdog.fired or failure.reason == "deadline_exceeded":
                    raise
            if not watchdog.fired:  # a cut socket reads as a clean end of a body without a length
                return answer
        raise _Failure("deadline_exceeded", f"no complete answer within {self.policy.url_deadline:g} s")

    def _exchange(self, url: str, deadline: float) -> tuple[bytes, str]:
        policy = self.policy
        current = url
        for _hop in range(policy.max_redirects + 1):
            scheme = urlsplit(current).scheme.lower()
            if scheme not in ("http", "https"):
                raise _Failure("unsupported_scheme", f"{scheme or 'no'} scheme in {current[:200]!r}")
            response = self._open(current, deadline)
            try:
                if response.status in (301, 302, 303, 307, 308) and response.headers.get("Location"):
                    current = urljoin(current, response.headers["Location"])
                    response.close()  # never drain a redirect's body: it could be endless
                    continue
                body = self._body(response, deadline)
            except BaseException:
                response.close()  # a half-read connection must not go back to the pool
                raise
            response.release_conn()
            return body, current
        raise _Failure("too_many_redirects", f"more than {policy.max_redirects} redirects")

    def _open(self, url: str, deadline: float) -> urllib3.BaseHTTPResponse:
        policy = self.policy
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Failure("deadline_exceeded", f"no answer within {policy.url_deadline:g} s")
        timeout = urllib3.Timeout(connect=min(policy.connect_timeout, remaining),
                                  read=min(policy.read_timeout, remaining))
        try:
            return self.http.request(
                "GET", url, headers={"User-Agent": USER_AGENT, "Accept": "image/*,*/*;q=0.5"},
                redirect=False, retries=False, preload_content=False, timeout=timeout,
            )
        except RefusedAddress as err:
            raise _Failure("blocked_address", str(err)) from None
        except NameResolutionError as err:
            raise _Failure("dns_error", str(err.__cause__ or err)) from None
        except (NewConnectionError, ProtocolError, ConnectionError) as err:  # before timeouts: a subclass of one
            raise _Failure("connection_error", str(err)) from None
        except (ConnectTimeoutError, ReadTimeoutError, TimeoutError) as err:
            raise _Failure("timeout", str(err)) from None
        except SSLError as err:
            raise _Failure("tls_error", str(err)) from None
        except (LocationParseError, ValueError) as err:
            raise _Failure("invalid_url", str(err)) from None
        except HTTPError as err:
            raise _Failure("connection_error", f"{type(err).__name__}: {err}") from None

    def _body(self, response: urllib3.BaseHTTPResponse, deadline: float) -> bytes:
        policy = self.policy
        status = response.status
        if status != 200:
            raise _Failure(f"http_{status}", f"HTTP {status} {response.reason or ''}".strip(), status)
        if policy.respect_opt_out and opted_out(response.headers.getlist("X-Robots-Tag")):
            raise _Failure("opted_out", "X-Robots-Tag: " + ", ".join(response.headers.getlist("X-Robots-Tag")))
        content_type = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type and not content_type.startswith(_ACCEPTED_TYPES):
            raise _Failure("not_an_image", f"Content-Type {content_type}")
        declared = response.headers.get("Content-Length")
        if declared and declared.isdigit() and int(declared) > policy.max_bytes:
            raise _Failure("too_large", f"Content-Length {declared} > {policy.max_bytes}")
        chunks, size = [], 0
        try:
            while True:
                if time.monotonic() > deadline:
                    raise _Failure("deadline_exceeded", f"body not complete within {policy.url_deadline:g} s")
                chunk = response.read1(_CHUNK)  # what has arrived, so a slow drip meets the deadline
                if not chunk:
                    break
                size += len(chunk)
                if size > policy.max_bytes:
                    raise _Failure("too_large", f"body exceeds {policy.max_bytes} bytes")
                chunks.append(chunk)
        except (ReadTimeoutError, TimeoutError) as err:
            raise _Failure("timeout", f"read timed out: {err}") from None
        except ProtocolError as err:
            raise _Failure("truncated", f"body ended early: {err}") from None
        except (HTTPError, OSError) as err:
            raise _Failure("connection_error", f"{type(err).__name__}: {err}") from None
        return b"".join(chunks)
