"""mode local: each task's step a process of the project's venv on the Airflow worker, forked by a step server
(cloob_core/ops/step_server.py) that imported torch and the stages once, as `dvc repro` runs a stage. Failures
keep their meaning: exit 2 (a user's error, a failure recorded as final) fails the task for good
(``AirflowFailException``: no retry); anything else is retried with the step's backoff."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from cloob_core.config.airflow import AirflowSettings
from pipelines.airflow_task import PERMANENT_EXIT, StepTask, finished_result

REPO = Path(__file__).resolve().parents[1]
SERVER_START_S = 120  # the step server's imports (torch, open_clip, the stages) on a slow disk


class LocalStep(StepTask):
    """The step as a process of the project's venv, forked by its step server (cloob_core/ops/step_server.py,
    started by the first task that finds none); its output goes to the task's log."""

    ui_color = "#d9ead3"

    def execute(self, context: Any) -> Any:
        inputs, output = self._resolved(context)
        python = AirflowSettings.model_validate_json(self.settings).python
        if not Path(python).exists():
            raise AirflowFailException(f"mode local runs each step with {python}, which is not there: create the "
                                       "project's venv (scripts/setup.sh) or set `python` in the Airflow settings")
        with tempfile.TemporaryDirectory(prefix=f"cloob-{self.step}-") as scratch:
            given, result = Path(scratch) / "inputs.json", Path(scratch) / "result.json"
            given.write_text(json.dumps(inputs), "utf-8")
            self.log.info("step %s -> %s", self.step, output)
            code, last = self._run(python, [self.step, "--inputs", f"@{given}", "--output", output, "--result",
                                            str(result)])
            if code == PERMANENT_EXIT:
                raise AirflowFailException(last)  # a user's error or a final failure: no retry changes it
            if code != 0:
                raise AirflowException(f"step {self.step} exited {code}: {last}")
            return finished_result(self.step, json.loads(result.read_text("utf-8")))

    def _run(self, python: str, argv: list[str]) -> tuple[int, str]:
        """The step's exit status and its last line of output, which went to this task's log line by line."""
        read, write = os.pipe()
        try:
            self._server, self.step_pid = _request(python, {"argv": argv, "env": dict(os.environ), "cwd": str(REPO)},
                                                   write)
        finally:
            os.close(write)
        last, pending, code = "", b"", None
        with os.fdopen(read, "rb", buffering=0) as output:
            open_ends = [output, self._server]
            while open_ends:
                for ready in select.select(open_ends, [], [])[0]:
                    if ready is output:
                        chunk = output.read(65536)
                        if not chunk:
                            open_ends.remove(output)
                        pending += chunk
                        *lines, pending = pending.split(b"\n")
                        for line in (*lines, *([pending] if not chunk and pending else [])):
                            text = line.decode(errors="replace")
                            last = text if text.strip() else last
                            self.log.info("%s", text)
                    else:
                        answer = _line(self._server)
                        open_ends.remove(self._server)
                        if answer:
                            code = json.loads(answer)["exit"]
                        if output in open_ends and not _readable(output):
                            open_ends.remove(output)  # a left-over grandchild holds the pipe: not waited for
            self._server.close()
        if code is None:
            raise AirflowException(f"step {argv[0]}: the step server ended before the step (its log: "
                                   f"{_server_log(python)})")
        return code, last

    def on_kill(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:  # the server stops the step's session when its client goes away
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()


def _line(connection: socket.socket) -> bytes:
    """One answer of the server, read a byte at a time: nothing of the next is buffered away from ``select``."""
    line = b""
    while not line.endswith(b"\n"):
        byte = connection.recv(1)
        if not byte:
            break
        line += byte
    return line


def _readable(output: Any) -> bool:
    return bool(select.select([output], [], [], 0.5)[0])


def _socket_path(python: str) -> str:
    """One step server per project venv and repository (a short path: a socket's name has 107 bytes at most)."""
    digest = hashlib.sha256(f"{python}\0{REPO}".encode()).hexdigest()[:16]
    return str(Path(tempfile.gettempdir()) / f"cloob-steps-{os.getuid()}-{digest}.sock")


def _server_log(python: str) -> str:
    return _socket_path(python)[:-len(".sock")] + ".log"


def _request(python: str, request: dict[str, Any], output: int) -> tuple[socket.socket, int]:
    """``request`` sent to the step server of ``python`` (started if none answers), with ``output``: the
    connection and the step's pid, once the server has forked it."""
    path = _socket_path(python)
    for _ in range(3):
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one task starts a server; the others connect to it
            connection = _connect(path) or _start_server(python, path)
        socket.send_fds(connection, [json.dumps(request).encode()], [output])
        answer = json.loads(_line(connection) or b"{}")
        if "pid" in answer:
            return connection, int(answer["pid"])
        connection.close()  # a server that imported code since changed: it leaves, the next try starts a fresh one
    raise AirflowException(f"the step server at {path} refused the step three times (its log: {_server_log(python)})")


def _connect(path: str) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        connection.close()
        return None
    return connection


def _start_server(python: str, path: str) -> socket.socket:
    with open(_server_log(python), "ab") as log:
        server = subprocess.Popen([python, "-m", "cloob_core.ops.step_server", path], cwd=REPO, stdout=log,
                                  stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AirflowFailException(f"the step server ({python} -m cloob_core.ops.step_server) exited "
                                       f"{server.returncode}: {_server_log(python)}")
        connection = _connect(path)
        if connection is not None:
            return connection
        time.sleep(0.2)
    server.kill()
    raise AirflowException(f"the step server did not listen within {SERVER_START_S} s: {_server_log(python)}")
