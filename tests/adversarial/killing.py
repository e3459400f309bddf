"""``cloob ARGV`` as a separate process that is killed (SIGKILL) or paused (SIGSTOP) by itself at a chosen moment.

A *moment* is the point before one write: every ``os.replace`` (each atomic local write ends with one) and every
write, move or delete of :mod:`cloob_core.storage` and :mod:`cloob_core.conditional_write` (what S3 writes go
through). A run with no target counts its moments, so a test can kill at each one in turn: every point between
two writes, not a few random instants. A pause stops the process before the ``n``-th call of one function whose
first argument contains a text, the way a frozen node or a long GC pause would; the test resumes it with SIGCONT.

Each process is forked by multiprocessing's fork server, which has imported cloob_core, torch and the libraries
the commands load once per test worker: a fresh interpreter importing them took about 4.5 s on the CI machine,
more than most of the commands these tests kill. The process is still one of its own (its own pid, environment,
working folder, stdout and stderr; killed by the kernel, its exit status from ``waitpid``), which is what the
tests need of it.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from hostile import Outcome

# what the killed commands import; the server imports them before it forks (an import error here only costs time)
PRELOAD = ["killing", "torch", "open_clip", "boto3", "pyarrow.parquet", "cloob_core.cli", "cloob_core.storage",
           "cloob_core.conditional_write", "cloob_core.lease", "cloob_core.ops.promotion", "cloob_core.publish",
           "cloob_core.evaluation.suite", "cloob_core.evaluation.suite_report", "cloob_core.data.acquire",
           "cloob_core.data.validate", "cloob_core.data.eval_set", "cloob_core.data.summary"]
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(PRELOAD)


def _command(argv: list[str], kill_at: int, pause: str, moments_file: str, env: dict[str, str], cwd: str | None,
             out: str, err: str) -> None:
    """In the forked process: its environment, folder and output files, the counting of moments, then cloob."""
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    for descriptor, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, descriptor)
        os.close(opened)
    warnings.simplefilter("ignore")  # as PYTHONWARNINGS=ignore would
    multiprocessing.set_start_method(None, force=True)  # a process's own default (its data loaders fork), not ours
    count = [0]
    pause_name, pause_text, pause_at = [*pause.split("|"), "", "", "0"][:3] if pause else ("", "", "0")
    pause_seen = [0]

    def wrapped(owner, name: str) -> None:
        function = getattr(owner, name)

        def call(*args, **kwargs):
            count[0] += 1
            Path(moments_file).write_text(str(count[0]))
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if name == pause_name and pause_text in str(args[0] if args else ""):
                pause_seen[0] += 1
                if pause_seen[0] == int(pause_at):
                    Path(moments_file + ".paused").touch()
                    os.kill(os.getpid(), signal.SIGSTOP)
            return function(*args, **kwargs)
        setattr(owner, name, call)

    from cloob_core import conditional_write, lease, storage
    from cloob_core.cli import main

    wrapped(os, "replace")
    for name in ("write_bytes", "upload_file", "copy_file", "move", "delete", "delete_tree"):
        wrapped(storage, name)
    wrapped(conditional_write, "write_if_unchanged")
    wrapped(lease, "check_held")
    if env.get("CLOOB_TEST_LEASE_TTL_S"):
        lease.TTL_S = float(env["CLOOB_TEST_LEASE_TTL_S"])
    sys.exit(main(argv))


@dataclass
class Running:
    """A started ``cloob ARGV``: its process and the folder of its stdout and stderr."""

    process: multiprocessing.process.BaseProcess
    folder: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return None if self.process.is_alive() else self.process.exitcode

    def send_signal(self, number: int) -> None:
        os.kill(self.process.pid, number)


def start(argv: list, moments: Path, *, kill_at: int = 0, pause: str = "", env: dict | None = None,
          cwd: Path | None = None) -> Running:
    """The process, started; ``pause``: ``"FUNCTION|TEXT|N"``."""
    folder = Path(tempfile.mkdtemp(prefix="cloob-killed-"))
    process = _SERVER.Process(target=_command, args=(
        [str(arg) for arg in argv], kill_at, pause, str(moments), {**os.environ, **(env or {})},
        str(cwd) if cwd else None, str(folder / "out"), str(folder / "err")))
    process.start()
    return Running(process, folder)


def finish(running: Running, timeout: float = 300) -> Outcome:
    """Its exit status, stdout and stderr once it has ended (killed, and failing the test, past ``timeout``)."""
    running.process.join(timeout)
    overran = running.process.is_alive()
    if overran:
        running.process.kill()
        running.process.join()
    try:
        out, err = ((running.folder / name).read_text() for name in ("out", "err"))
    finally:
        shutil.rmtree(running.folder, ignore_errors=True)
    assert not overran, f"still running after {timeout:g} s: {err[-3000:]}"
    return Outcome(running.process.exitcode, out, err)


def run(argv: list, moments: Path, *, kill_at: int = 0, env: dict | None = None) -> Outcome:
    """``cloob ARGV`` killed before its ``kill_at``-th write (0: never)."""
    return finish(start(argv, moments, kill_at=kill_at, env=env))


def count_moments(argv: list, moments: Path, env: dict | None = None) -> int:
    """How many moments a whole run of ``cloob ARGV`` has (it must succeed)."""
    done = run(argv, moments, env=env)
    assert done.code == 0, done.err
    return int(moments.read_text())


def killed_at(argv: list, moments: Path, moment: int, env: dict | None = None) -> Outcome:
    done = run(argv, moments, kill_at=moment, env=env)
    assert done.code == -signal.SIGKILL, (moment, done.code, done.err)
    return done


def paused(argv: list, moments: Path, pause: str, env: dict | None = None, timeout: float = 120) -> Running:
    """The process, once it has stopped itself at ``pause``."""
    process = start(argv, moments, pause=pause, env=env)
    marker = Path(str(moments) + ".paused")
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert process.poll() is None, f"it ended before pausing at {pause}: {finish(process)}"
        assert time.monotonic() < deadline, f"no pause at {pause} within {timeout:g} s"
        time.sleep(0.02)
    return process


def resume(process: Running) -> Outcome:
    process.send_signal(signal.SIGCONT)
    return finish(process)


def chosen(total: int, every: bool, sample: int = 4) -> list[int]:
    """Moments to kill at: all of them, or ``sample`` spread over the run with the last one (the final switch)."""
    if every or total <= sample:
        return list(range(1, total + 1))
    step = total / sample
    return sorted({max(1, round(step * (i + 1))) for i in range(sample - 1)} | {total})
