"""A lean loopback image server for the download benchmark: every file of a folder held in memory, answered by
one asyncio process with keep-alive, so the server's share of the two cores both tools share stays small.

Python's ``http.server`` spends a few hundred microseconds of CPU on each request, on the same cores as the tools
it serves, which shrinks any difference between them; a real download's server is elsewhere and costs it
nothing. ``/N.jpg`` answers the folder's JPEG ``N mod count`` (in name order) with a comment segment naming N
after its start marker: the same pixels, but distinct bytes for each URL (a downloader that drops duplicate
content keeps them all), from ``count`` files. On SIGTERM it prints its CPU seconds.

    python benchmarks/image_server.py FOLDER PORT
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import ClassVar

NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


def answer(jpeg: bytes, number: int) -> bytes:
    comment = b"url %d" % number
    body = (jpeg[:2], b"\xff\xfe", (len(comment) + 2).to_bytes(2, "big"), comment, memoryview(jpeg)[2:])
    return b"".join((b"HTTP/1.1 200 OK\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n"
                     % sum(map(len, body)), *body))


class Answer(asyncio.Protocol):
    jpegs: ClassVar[list[bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.pending = b""

    def data_received(self, data: bytes) -> None:
        self.pending += data
        while b"\r\n\r\n" in self.pending:
            head, _, self.pending = self.pending.partition(b"\r\n\r\n")
            request_line, _, headers = head.partition(b"\r\n")
            parts = request_line.split(b" ")
            path = parts[1] if len(parts) == 3 else b""
            name = path.rsplit(b"/", 1)[-1].split(b".", 1)[0]
            number = int(name) if name.isdigit() else -1
            self.transport.write(answer(self.jpegs[number % len(self.jpegs)], number) if number >= 0 else NOT_FOUND)
            if parts[-1] == b"HTTP/1.0" or b"connection: close" in headers.lower():
                self.transport.close()
                return


def main() -> None:
    folder, port = Path(sys.argv[1]), int(sys.argv[2])
    Answer.jpegs = [p.read_bytes() for p in sorted(folder.iterdir(), key=lambda p: int(p.stem))]
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(loop.create_server(Answer, "127.0.0.1", port, backlog=1024))

    def stop() -> None:
        times = os.times()
        print(f"{times.user + times.system:.3f}", flush=True)
        server.close()
        loop.stop()

    loop.add_signal_handler(signal.SIGTERM, stop)
    print("ready", flush=True)
    loop.run_forever()


if __name__ == "__main__":
    main()
