"""A real HTTP server on 127.0.0.1 for the data tests: real photos plus every way a web server misbehaves."""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from PIL import Image


@cache
def photos() -> tuple[Image.Image, ...]:
    from sklearn.datasets import load_sample_images

    return tuple(Image.fromarray(array) for array in load_sample_images().images)  # china.jpg, flower.jpg


def photo_bytes(index: int, fmt: str = "JPEG") -> bytes:
    """A distinct real image per index: a crop of one of the two sample photos, at a varying size."""
    base = photos()[index % 2]
    left, top = (index * 7) % 200, (index * 5) % 120
    width, height = 200 + (index * 13) % 240, 150 + (index * 11) % 150
    crop = base.crop((left, top, left + width, top + height))
    out = io.BytesIO()
    crop.save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def image_folder(root: Path, classes: Sequence[str], counts: dict[str, int]) -> Path:
    """An ImageFolder tree of distinct real photos, ``root/SPLIT/CLASS/I.jpg``, with ``counts[SPLIT]`` per class."""
    for split, count in counts.items():
        for c, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                (root / split / name / f"{i}.jpg").write_bytes(photo_bytes(100 * c + 10 * (split == "test") + i))
    return root


@cache
def bomb_png() -> bytes:
    out = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(out, format="PNG")  # 144 Mpx, a few kB on the wire
    return out.getvalue()


@cache
def alpha_png() -> bytes:
    image = photos()[1].crop((0, 0, 300, 200)).convert("RGBA")
    image.putalpha(128)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class ImageServer:
    """Routes: /img/N.jpg, /png/N.png, /alpha.png, /404, /403, /flaky/ID (500 then 200), /down/ID (503 the
    first ``down_times`` calls), /stall (no answer), /drip (a body byte every 0.2 s), /drip-headers (a header byte every
    0.2 s), /truncated, /corrupt.jpg,
    /bomb.png, /html, /loop, /redirect/N, /optout.jpg, /optout-other.jpg, /reset, /huge.
    ``delay`` slows every image response (for the kill test)."""

    def __init__(self, delay: float = 0.0, down_times: int = 3):
        self.delay = delay
        self.down_times = down_times
        self.hits: Counter[str] = Counter()
        self.user_agents: set[str] = set()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                with server._lock:
                    server.hits[self.path] += 1
                    server.user_agents.add(self.headers.get("User-Agent", ""))
                    count = server.hits[self.path]
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    server.route(self, self.path.split("?")[0], count)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda *args: None  # misbehaving routes end connections rudely on purpose
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> ImageServer:
        bomb_png(), alpha_png()  # built before serving: building them inside a request stalls the others
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @staticmethod
    def send(handler, status: int, body: bytes, content_type: str = "image/jpeg", headers: dict | None = None):
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(body)

    def route(self, h, path: str, count: int) -> None:
        if path.startswith("/img/"):
            time.sleep(self.delay)
            self.send(h, 200, photo_bytes(int(path[5:].split(".")[0])))
        elif path.startswith("/png/"):
            self.send(h, 200, photo_bytes(int(path[5:].split(".")[0]), "PNG"), "image/png")
        elif path == "/alpha.png":
            self.send(h, 200, alpha_png(), "image/png")
        elif path == "/404":
            self.send(h, 404, b"not found", "text/plain")
        elif path == "/403":
            self.send(h, 403, b"forbidden", "text/plain")
        elif path.startswith("/flaky/"):
            if count == 1:
                self.send(h, 500, b"try again", "text/plain")
            else:
                self.send(h, 200, photo_bytes(1000 + int(path[7:])))
        elif path.startswith("/down/"):
            if count <= self.down_times:
                self.send(h, 503, b"down", "text/plain")
            else:
                self.send(h, 200, photo_bytes(2000 + int(path[6:])))
        elif path == "/stall":
            time.sleep(30)
        elif path == "/drip":
            h.send_response(200)
            h.send_header("Content-Type", "image/jpeg")
            h.send_header("Content-Length", "1000000")
            h.end_headers()
            for _ in range(300):
                h.wfile.write(b"\xff")
                h.wfile.flush()
                time.sleep(0.2)
        elif path == "/drip-headers":  # every read is quick, the response never completes
            for byte in b"HTTP/1.1 200 OK\r\nContent-Type: image/jpeg\r\nX-Padding: " + b"x" * 300:
                h.wfile.write(bytes([byte]))
                h.wfile.flush()
                time.sleep(0.2)
            h.close_connection = True
        elif path == "/truncated":
            body = photo_bytes(3)
            h.send_response(200)
            h.send_header("Content-Type", "image/jpeg")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.connection.shutdown(socket.SHUT_RDWR)
            h.close_connection = True
        elif path == "/corrupt.jpg":
            body = photo_bytes(4)
            self.send(h, 200, body[:200] + bytes(range(256)) * 40)
        elif path == "/bomb.png":
            self.send(h, 200, bomb_png(), "image/png")
        elif path == "/html":
            self.send(h, 200, b"<html><body>not an image</body></html>", "text/html; charset=utf-8")
        elif path == "/loop":
            self.send(h, 302, b"", "text/plain", {"Location": "/loop"})
        elif path.startswith("/redirect/"):
            self.send(h, 302, b"", "text/plain", {"Location": f"/img/{path[10:]}.jpg"})
        elif path == "/optout.jpg":
            self.send(h, 200, photo_bytes(5), headers={"X-Robots-Tag": "noai, noimageai"})
        elif path == "/optout-other.jpg":
            self.send(h, 200, photo_bytes(6), headers={"X-Robots-Tag": "otherbot: noai"})
        elif path == "/reset":
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            h.connection.close()
            h.close_connection = True
        elif path == "/huge":
            self.send(h, 200, b"\xff" * (3 * 1024 * 1024))
        else:
            self.send(h, 404, b"no route", "text/plain")
