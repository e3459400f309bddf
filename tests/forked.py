"""``cloob ARGV`` in a process of its own, forked from a server that has imported torch and cloob_core once.

Tests that kill, pause or signal a command need it in a process of its own, but not a fresh interpreter: one
importing torch, open_clip and cloob_core took about 4.5 s on the CI machine, more than most of the commands
these tests start. multiprocessing's fork server imports them once per test worker and forks each command from
there. The process is still the command's own: its pid, environment, stdout and stderr, its
default start method (its data loaders fork, as in a fresh process), its exit handlers, and its exit status from
``waitpid`` (``-9`` when killed). What stays a fresh ``python -m cloob_core.cli`` (the entry point itself, torchrun's
ranks, DVC's and kfp.local's steps) is started as one by the tests that check it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# imported by the server before it forks (an import that fails there only costs each command its own import)
PRELOAD = ["forked", "torch", "open_clip", "boto3", "pyarrow.parquet", "cloob_core.cli", "cloob_core.storage",
           "cloob_core.conditional_write", "cloob_core.lease", "cloob_core.ops.promotion", "cloob_core.publish",
           "cloob_core.evaluation.suite", "cloob_core.evaluation.suite_report", "cloob_core.data.acquire",
           "cloob_core.data.validate", "cloob_core.data.eval_set", "cloob_core.data.summary",
           "cloob_core.training.train"]
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(PRELOAD)


def _command(argv: list[str], env: dict[str, str], out: str, err: str, append: bool,
             prepare: Callable[[], None] | None) -> None:
    """In the forked process: its environment and output files, then ``prepare()``, then cloob."""
    os.environ.clear()
    os.environ.update(env)
    for descriptor, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o600)
        os.dup2(opened, descriptor)
        os.close(opened)
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a fresh process
    if prepare is not None:
        prepare()
    from cloob_core.cli import main

    code = main(argv)
    atexit._run_exitfuncs()  # multiprocessing ends its processes with os._exit, which skips them
    sys.exit(code)


@dataclass
class Forked:
    """A started ``cloob ARGV``; ``out`` and ``err`` are the files its stdout and stderr go to."""

    process: multiprocessing.process.BaseProcess
    out: Path
    err: Path
    scratch: Path | None  # the folder of those files, when this module chose it

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return None if self.process.is_alive() else self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status; kills it, and fails, past ``timeout``."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
            raise AssertionError(f"cloob still ran after {timeout:g} s: {self.err.read_text()[-3000:]}")
        return self.process.exitcode

    def send_signal(self, number: int) -> None:
        os.kill(self.process.pid, number)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its stdout and stderr once it has ended (the files are removed if this module chose them)."""
        try:
            self.wait(timeout)
            return tuple((path.read_text() if path.exists() else "") for path in (self.out, self.err))
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)


def start(argv: list, *, env: dict | None = None, log: Path | None = None,
          prepare: Callable[[], None] | None = None) -> Forked:
    """``cloob ARGV`` started, with ``os.environ`` updated by ``env``; ``log``: a file its stderr is appended to
    (stdout then goes to /dev/null), else both go to files of a scratch folder, read by ``communicate``.
    ``prepare``: a picklable callable run in the process before cloob (to wrap functions, for example)."""
    if log is None:
        scratch = Path(tempfile.mkdtemp(prefix="cloob-forked-"))
        out, err = scratch / "out", scratch / "err"
    else:
        scratch, out, err = None, Path(os.devnull), log
    process = _SERVER.Process(target=_command, args=(
        [str(arg) for arg in argv], {**os.environ, **(env or {})}, str(out), str(err),
        log is not None, prepare))
    process.start()
    return Forked(process, out, err, scratch)
