"""An HTTP proxy between boto3 and the loopback S3 server that does to requests what a flaky network or a
half-compatible store does: answer 503 SlowDown, apply a request and then answer 500 or reset the connection (the
client never learns that it was applied), cut an answer's body short (the headers promise the whole object, half
of it comes, then the connection drops), add latency, or strip the conditional headers (a store without
compare-and-swap). Faults are scheduled by the test, per method and key, for a number of requests.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import struct
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

FAULTS = ("slowdown", "error-after", "reset-after", "cut-body", "latency", "strip-conditions")
_CONDITIONS = ("if-match", "if-none-match")
_HOP_BY_HOP = ("connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade")


@dataclass
class Fault:
    kind: str
    method: str | None  # None: any
    key: str  # a substring of the request path ("" for every path)
    times: int | None  # None: for ever
    seconds: float = 0.0  # latency
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (self.method in (None, method) and self.key in path
                and (self.times is None or self.hits < self.times))


class FaultProxy:
    """``FaultProxy(upstream).start()`` → its endpoint URL; ``add(...)`` schedules faults; ``stop()``."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, str]] = []  # (method, path, what happened)
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None

    def add(self, kind: str, *, method: str | None = "PUT", key: str = "", times: int | None = 1,
            seconds: float = 0.0) -> Fault:
        assert kind in FAULTS, kind
        fault = Fault(kind, method, key, times, seconds)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def _take(self, method: str, path: str) -> list[Fault]:
        """The faults this request meets (their counts taken), in the order they were added."""
        with self._lock:
            chosen = [fault for fault in self.faults if fault.matches(method, path)]
            for fault in chosen:
                fault.hits += 1
            return chosen

    def start(self) -> str:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, status: int, code: str, message: str) -> None:
                body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}'
                        "</Message></Error>").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _reset(self) -> None:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True

            def _forward(self, body: bytes, headers: dict[str, str]) -> tuple[int, list[tuple[str, str]], bytes]:
                connection = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    connection.request(self.command, self.path, body=body if body or self.command in (
                        "PUT", "POST") else None, headers=headers)
                    reply = connection.getresponse()
                    return reply.status, reply.getheaders(), reply.read()
                finally:
                    connection.close()

            def _handle(self) -> None:
                body = self._body()
                faults = proxy._take(self.command, self.path)
                kinds = {fault.kind for fault in faults}
                for fault in faults:
                    if fault.kind == "latency":
                        time.sleep(fault.seconds)
                if "slowdown" in kinds:
                    proxy.log.append((self.command, self.path, "slowdown"))
                    self._answer(503, "SlowDown", "Please reduce your request rate.")
                    return
                headers = {name: value for name, value in self.headers.items()
                           if name.lower() not in _HOP_BY_HOP
                           and not ("strip-conditions" in kinds and name.lower() in _CONDITIONS)}
                if "transfer-encoding" in {name.lower() for name in self.headers}:
                    headers["Content-Length"] = str(len(body))
                status, reply_headers, reply_body = self._forward(body, headers)
                if "error-after" in kinds:
                    proxy.log.append((self.command, self.path, f"applied ({status}), answered 500"))
                    self._answer(500, "InternalError", "We encountered an internal error. Please try again.")
                    return
                if "reset-after" in kinds:
                    proxy.log.append((self.command, self.path, f"applied ({status}), connection reset"))
                    self._reset()
                    return
                proxy.log.append((self.command, self.path, str(status)))
                self.send_response(status)
                for name, value in reply_headers:  # (send_response wrote Date and Server already)
                    if name.lower() not in (*_HOP_BY_HOP, "content-length", "date", "server"):
                        self.send_header(name, value)
                upstream_length = next((value for name, value in reply_headers if name.lower() == "content-length"),
                                       "0")
                # a HEAD's length is the object's, not its (empty) body's: readers size ranged reads by it
                self.send_header("Content-Length", upstream_length if self.command == "HEAD" else str(len(reply_body)))
                self.end_headers()
                if self.command != "HEAD" and "cut-body" in kinds and len(reply_body) > 1:
                    proxy.log[-1] = (self.command, self.path, f"{status}, body cut at half")
                    self.wfile.write(reply_body[: len(reply_body) // 2])
                    self.wfile.flush()
                    self._reset()
                elif self.command != "HEAD":
                    self.wfile.write(reply_body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
