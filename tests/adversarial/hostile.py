"""What every adversarial case checks: the exit code, one line on stderr that names the problem, no traceback,
and nothing lost or changed outside the command's output."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    code: int
    out: str
    err: str

    def error_line(self, program: str = "cloob", internal: bool = False) -> str:
        """The one line naming the problem; fails on a traceback, on several error lines, and on a user's
        mistake reported as an internal error (or the other way round)."""
        assert "Traceback" not in self.err, self.err
        lines = [line for line in self.err.splitlines() if line.startswith(f"{program}: ")]
        assert len(lines) == 1, self.err
        assert self.err.rstrip().endswith(lines[0]), self.err  # the last thing printed
        assert ("an internal error" in lines[0]) == internal, lines[0]
        return lines[0]


def cli(capsys, *argv: str) -> Outcome:
    """``cloob ARGV`` in this process (no interpreter start per case)."""
    from cloob_core.cli import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err)


def run(*argv: str, timeout: float = 300, cwd: Path = ROOT) -> Outcome:
    """``python -m ARGV`` as a separate process, as a user or a scheduler starts it."""
    done = subprocess.run([sys.executable, "-m", *map(str, argv)], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return Outcome(done.returncode, done.stdout, done.stderr)


def snapshot(*roots: Path) -> dict[str, str]:
    """Every file under ``roots`` with a digest of its bytes: compare before and after a command."""
    files = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if path.is_file():
                files[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


# `cloob ARGV[4:]` that imports cloob and the modules named in argv[3] first, creates argv[1], and starts when argv[2]
# exists: so several start within milliseconds of the moment the test chooses.
POISED = """
import importlib, pathlib, sys, time
from cloob_core.cli import main
for module in filter(None, sys.argv[3].split(",")):
    importlib.import_module(module)
pathlib.Path(sys.argv[1]).touch()
while not pathlib.Path(sys.argv[2]).exists():
    time.sleep(0.002)
sys.exit(main(sys.argv[4:]))
"""


def poised(ready: Path, go: Path, argv: list[str], preload: tuple[str, ...]) -> subprocess.Popen:
    """A ``cloob`` process that has imported ``preload``, says so by creating ``ready`` and starts once ``go``
    exists (wait for ``ready`` with :func:`wait_for`)."""
    return subprocess.Popen([sys.executable, "-c", POISED, str(ready), str(go), ",".join(preload), *map(str, argv)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, what: str, timeout: float = 120.0, processes: tuple[subprocess.Popen, ...] = ()) -> None:
    """Until ``condition()`` holds; fails after ``timeout`` seconds, or when one of ``processes`` ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert all(process.poll() is None for process in processes), f"a process ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.02)
