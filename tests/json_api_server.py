"""The part every stand-in API server of the tests shares: a JSON-over-HTTP server on 127.0.0.1 that records
each request (method, path, query, body, Authorization header) and answers with what ``_answer`` returns."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JsonApiServer:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def calls(self, method: str, path_pattern: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == method and re.fullmatch(path_pattern, r["path"])]

    def _answer(self, method: str, path: str, query: str, body: dict) -> tuple[int, dict | str]:
        raise NotImplementedError

    def _fault(self, method: str, path: str) -> str | int | None:
        """A fault to inject before answering: "reset" (the connection closed with no reply), "hang" (no reply
        for ``hang_s`` seconds, then the answer), an HTTP status to answer with instead, or None."""
        return None

    hang_s = 2.0

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                path, _, query = self.path.partition("?")
                fault = server._fault(self.command, path)
                server.requests.append({"method": self.command, "path": path, "query": query, "body": body,
                                        "authorization": self.headers.get("Authorization"), "fault": fault})
                if fault == "reset":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault == "hang":
                    time.sleep(server.hang_s)
                if isinstance(fault, int):
                    status, answer = fault, {"kind": "Status", "status": "Failure", "code": fault}
                else:
                    status, answer = server._answer(self.command, path, query, body)
                text = isinstance(answer, str)  # a pod's log is plain text
                data = answer.encode() if text else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = _serve

            def log_message(self, *args: object) -> None:
                pass

        return Handler
