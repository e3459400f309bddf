"""``cloob ARGV`` as a separate process that is killed (SIGKILL) or paused (SIGSTOP) by itself at a chosen moment.

A *moment* is the point before one write: every ``os.replace`` (each atomic local write ends with one) and every
write, move or delete of :mod:`cloob_core.storage` and :mod:`cloob_core.conditional_write` (what S3 writes go
through). A run with no target counts its moments, so a test can kill at each one in turn: every point between
two writes, not a few random instants. A pause stops the process before the ``n``-th call of one function whose
first argument contains a text, the way a frozen node or a long GC pause would; the test resumes it with SIGCONT.
The processes are forked from a server that has imported torch and cloob_core once (``tests/forked.py``).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import forked
from hostile import Outcome


def _count_moments(kill_at: int, pause: str, moments_file: str) -> None:
    """In the command's process, before cloob runs: each write counts a moment, and kills or pauses at its own."""
    from cloob_core import conditional_write, lease, storage

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

    wrapped(os, "replace")
    for name in ("write_bytes", "upload_file", "copy_file", "move", "delete", "delete_tree"):
        wrapped(storage, name)
    wrapped(conditional_write, "write_if_unchanged")
    wrapped(lease, "check_held")
    if os.environ.get("CLOOB_TEST_LEASE_TTL_S"):
        lease.TTL_S = float(os.environ["CLOOB_TEST_LEASE_TTL_S"])


def start(argv: list, moments: Path, *, kill_at: int = 0, pause: str = "", env: dict | None = None
          ) -> forked.Forked:
    """The process, started; ``pause``: ``"FUNCTION|TEXT|N"``."""
    return forked.start(argv, env={"PYTHONWARNINGS": "ignore", **(env or {})},
                        prepare=functools.partial(_count_moments, kill_at, pause, str(moments)))


def finish(process: forked.Forked, timeout: float = 300) -> Outcome:
    out, err = process.communicate(timeout)
    return Outcome(process.returncode, out, err)


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


def paused(argv: list, moments: Path, pause: str, env: dict | None = None, timeout: float = 120) -> forked.Forked:
    """The process, once it has stopped itself at ``pause``."""
    process = start(argv, moments, pause=pause, env=env)
    marker = Path(str(moments) + ".paused")
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert process.poll() is None, f"it ended before pausing at {pause}: {finish(process)}"
        assert time.monotonic() < deadline, f"no pause at {pause} within {timeout:g} s"
        time.sleep(0.02)
    return process


def resume(process: forked.Forked) -> Outcome:
    process.send_signal(signal.SIGCONT)
    return finish(process)


def chosen(total: int, every: bool, sample: int = 4) -> list[int]:
    """Moments to kill at: all of them, or ``sample`` spread over the run with the last one (the final switch)."""
    if every or total <= sample:
        return list(range(1, total + 1))
    step = total / sample
    return sorted({max(1, round(step * (i + 1))) for i in range(sample - 1)} | {total})
