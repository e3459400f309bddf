"""What every adversarial case checks: the exit code, one line on stderr that names the problem, no traceback,
and nothing lost or changed outside the command's output."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
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
