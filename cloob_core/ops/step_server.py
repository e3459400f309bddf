"""A local fork server for pipeline steps: ``python -m cloob_core.ops.step_server SOCKET``. It imports torch,
open_clip and the stages once, then forks one process per request, each running
``python -m cloob_core.ops.task_runner`` 's main on its own arguments, environment, folder and output. The Airflow
DAGs' local mode sends every task's step here: a fresh interpreter spent about 9 s of each step on those imports
(open_clip alone 7.7 s on this machine), more than most steps' work, so a DAG of ~35 steps ran twice as long as
`dvc repro` (whose stages are few).

Each step is still a process of its own: its session (a stop ends its whole tree: data-loader workers, torchrun),
its environment and its exit status. Protocol, on a Unix socket: the client sends one JSON line ``{"argv", "env",
"cwd"}`` with the file descriptor its output goes to; the server answers ``{"pid"}``, then ``{"exit"}`` once the step
has ended. A client that goes away first (its task was stopped or killed) has the step's session terminated. The
server exits after ``IDLE_S`` with nothing to do, and when a module it imported has changed on disk since (the next
client starts a fresh one), so an edit is never run as the old code."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import time

# what the steps import: torch and open_clip (most of the cost), the stages of every step
PRELOAD = ("torch", "open_clip", "pyarrow.parquet", "cloob_core.ops.task_runner", "cloob_core.ops.kubeflow",
           "cloob_core.evaluation.suite", "cloob_core.evaluation.suite_report", "cloob_core.data.acquire",
           "cloob_core.data.validate", "cloob_core.data.download", "cloob_core.training.train",
           "cloob_core.ops.promotion")
IDLE_S = 600.0
STOP_GRACE_S = 30.0  # a step whose client went away: SIGTERM, then SIGKILL after this
EXIT_STALE = "stale"  # the answer to a request once a preloaded module has changed


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # a step that needs it fails in its own process, in one line
            importlib.import_module(name)


def _sources() -> dict[str, float]:
    """The modification times of the imported modules of this project and of the packages it preloaded."""
    times = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and "cloob_core" in path:
            with contextlib.suppress(OSError):
                times[path] = os.stat(path).st_mtime
    return times


def _child(request: dict, output: int) -> None:
    """In the forked process: its own session, output, folder and environment, then the step."""
    code = 1
    try:
        os.setsid()
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(name, signal.SIG_DFL)
        sys.argv = ["cloob_core.ops.task_runner", *request["argv"]]
        from cloob_core.ops import task_runner

        code = task_runner.main(request["argv"])
        import atexit

        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _send(connection: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):
        connection.sendall((json.dumps(message) + "\n").encode())


def _stop(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)


def serve(path: str) -> None:
    _preload()
    sources = _sources()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    own = os.stat(path).st_ino
    listener.listen(64)
    steps: dict[int, socket.socket] = {}  # pid -> its client
    stopping: dict[int, float] = {}  # pid -> when it was sent SIGTERM
    idle_since = time.monotonic()

    def close() -> None:
        """No more requests: the socket's name freed for a fresh server (unless one has taken it already)."""
        nonlocal listener
        if listener is not None:
            listener.close()
            listener = None
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == own:
                    os.unlink(path)

    try:
        while steps or (listener is not None and time.monotonic() - idle_since < IDLE_S):
            waiting = [*([listener] if listener is not None else []), *steps.values()]
            for ready in select.select(waiting, [], [], 0.2)[0]:
                if ready is listener:
                    connection, _ = listener.accept()
                    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 1)
                    if _sources() != sources:  # an edit since: this server must not run it as the old code
                        _send(connection, {"error": EXIT_STALE})
                        connection.close()
                        for fd in fds:
                            os.close(fd)
                        close()
                        break
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        _child(json.loads(message.decode()), fds[0])
                    os.close(fds[0])
                    steps[pid] = connection
                    _send(connection, {"pid": pid})
                elif not ready.recv(1):  # the client went away (its task was stopped): so is its step
                    for pid, connection in steps.items():
                        if connection is ready and pid not in stopping:
                            _stop(pid)
                            stopping[pid] = time.monotonic()
            for pid, since in list(stopping.items()):
                if time.monotonic() - since > STOP_GRACE_S:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
            while steps:
                pid, raw = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if pid in steps:
                    connection = steps.pop(pid)
                    stopping.pop(pid, None)
                    _send(connection, {"exit": _status(raw)})
                    connection.close()
                    idle_since = time.monotonic()
    finally:
        close()


if __name__ == "__main__":
    serve(sys.argv[1])
