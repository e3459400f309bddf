"""A concurrent CPU load for the benchmarks' "under load" runs: busy-looping processes, each ending by itself."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"


@contextlib.contextmanager
def load(processes: int, seconds: float) -> Iterator[None]:
    """``processes`` busy loops, each stopping by itself after ``seconds`` (and killed on exit)."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=seconds)]) for _ in range(processes)]
    try:
        time.sleep(1 if processes else 0)
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()
