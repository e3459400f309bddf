"""A helper process that must not outlive the process that started it (an evaluation while training).

The parent names itself in ``CLOOB_PARENT_PID`` when it starts the child; the child, first thing in ``cloob``,
asks the kernel for SIGKILL when its parent dies (Linux's ``PR_SET_PDEATHSIG``), then checks that the parent is
still the one named (it may have died before the request). Where there is no ``prctl``, a daemon thread polls the
parent once a second. Set in the child rather than through ``subprocess``'s ``preexec_fn``, which is unsafe in a
parent with threads (a training process has several).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)
PARENT_ENV = "CLOOB_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def end_with_parent() -> None:
    """When ``CLOOB_PARENT_PID`` names this process's parent: end this process when the parent ends."""
    named = os.environ.pop(PARENT_ENV, "")
    if not named.isdigit():
        return
    parent = int(named)
    if not _kernel_kills_on_parent_death():
        threading.Thread(target=_watch, args=(parent,), name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the request above: it would never come
        log.warning("the process that started this one (%d) has ended; ending too", parent)
        sys.exit(1)


def _kernel_kills_on_parent_death() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
