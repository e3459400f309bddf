"""When the data-loader workers may prepare the next batch: while the step runs, or only between steps.

On a GPU the step runs on the device, and the workers fill the gap on the host. On the CPU the step's intra-op
threads take every core the process may use, and a worker that wakes during the step preempts one of them: the
others then wait for it at the next OpenMP barrier, so the step loses far more time than the worker takes
(docs/performance.md). Held between steps, the workers prepare each batch on every core while the step waits for
it, and the step then runs alone. Holding them costs the batch's making on the step's clock, though, which loses
where the step is short against the data work (a small batch, the first pass's decoding): ``PrefetchTuner``
measures both ways within the run and keeps the faster.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import statistics
import time
from collections.abc import Generator, Iterator
from itertools import count
from typing import TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_SECONDS = 1.0  # how often a held worker checks that its main process still exists
UNLIMITED = 1 << 62  # the steps a released worker may begin


class PrefetchTuner:
    """Chooses, from the run's own step times, whether the workers are held between steps.

    After ``warmup`` steps held, a trial alternates held and released blocks of ``block`` steps (``blocks`` in all,
    so a drift in the data work, such as the first pass's decoding ending, falls on both ways alike) and keeps
    the way whose median step, from asking for the batch to asking for the next, is shorter. The first ``settle``
    steps of each block are not counted: the batch the workers made ahead, or did not, belongs to the way before.
    The trial repeats every ``every`` steps, since the data work changes as the sample cache fills.
    """

    def __init__(self, warmup: int = 8, block: int = 8, settle: int = 2, blocks: int = 8, every: int = 500) -> None:
        if not (0 <= settle < block and blocks >= 2 and blocks % 2 == 0 and every >= block * blocks):
            raise ValueError(f"inconsistent tuner ({warmup=}, {block=}, {settle=}, {blocks=}, {every=})")
        self.warmup, self.block, self.settle, self.blocks, self.every = warmup, block, settle, blocks, every
        self.chosen_held = True
        self._times: dict[bool, list[float]] = {True: [], False: []}

    def _trial(self, step: int) -> tuple[int, int] | None:
        """The trial block ``step`` falls in and its place in that block, or None outside a trial."""
        if step < self.warmup:
            return None
        offset = (step - self.warmup) % self.every
        return divmod(offset, self.block) if offset < self.block * self.blocks else None

    def held(self, step: int) -> bool:
        trial = self._trial(step)
        return self.chosen_held if trial is None else trial[0] % 2 == 0

    def record(self, step: int, seconds: float) -> None:
        """The time of ``step``, asked for by ``held(step)``; the trial's last step decides."""
        trial = self._trial(step)
        if trial is None:
            return
        block, place = trial
        if place >= self.settle:
            self._times[block % 2 == 0].append(seconds)
        if (block, place) == (self.blocks - 1, self.block - 1):
            held, released = (statistics.median(self._times[way]) for way in (True, False))
            self.chosen_held = held <= released
            self._times = {True: [], False: []}
            log.info("data-loader workers %s: median step %.0f ms held between steps, %.0f ms released",
                     "held between steps" if self.chosen_held else "prefetching during the step", held * 1e3,
                     released * 1e3)


class WorkerGate:
    """How many steps the data-loader workers may begin: held, one more each time the main process asks for a
    batch; released, any number (the DataLoader's prefetch bounds them). A worker counts the steps it begins and
    waits at one it may not begin yet. Closed, it holds no one, so the DataLoader can end its workers as usual.

    ``tuner`` None holds the workers at every step (``train.prefetch: between_steps``)."""

    def __init__(self, workers: int, tuner: PrefetchTuner | None = None) -> None:
        ctx = multiprocessing.get_context()
        self._wakeups = [ctx.Semaphore(0) for _ in range(workers)]
        self._allowed = ctx.RawValue("q", 0)  # written by the main process only
        self._main = os.getpid()
        self._begun = 0  # in a worker: the steps it has begun
        self._closed = False
        self.tuner = tuner

    def allow(self, steps: int) -> None:
        """Let the workers begin ``steps`` steps in all (``UNLIMITED``: release them) and wake the waiting."""
        if self._closed:
            return
        self._allowed.value = steps
        for wakeup in self._wakeups:
            wakeup.release()

    def close(self) -> None:
        self.allow(UNLIMITED)
        self._closed = True

    def wait(self) -> None:
        """In a worker, before each step: until the main process allows it, closes the gate or dies. Outside a
        worker at once."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return
        step, self._begun = self._begun, self._begun + 1
        wakeup = self._wakeups[info.id]
        while step >= self._allowed.value:
            if not wakeup.acquire(timeout=POLL_SECONDS) and os.getppid() != self._main:
                return  # the DataLoader's watchdog ends this worker once it is back in its loop
        while wakeup.acquire(block=False):  # wakeups for steps already allowed: the count stays bounded
            pass

    def batches(self, batches: Iterator[T]) -> Generator[T, None, None]:
        """``batches``, each asked of held workers only when the caller asks for it, timed for the tuner from one
        ask to the next; closing this (or its end) closes the gate."""
        try:
            for step in count():
                held = self.tuner is None or self.tuner.held(step)
                if held or self._allowed.value != UNLIMITED:
                    self.allow(step + 1 if held else UNLIMITED)
                asked = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    return
                yield batch
                if self.tuner is not None:
                    self.tuner.record(step, time.perf_counter() - asked)
        finally:
            self.close()
