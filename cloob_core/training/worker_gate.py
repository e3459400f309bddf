"""When the data-loader workers may prepare the next batch: while the step runs, or only between steps.

On a GPU the step runs on the device, and the workers fill the gap on the host. On the CPU the step's intra-op
threads take every core the process may use, and a worker that wakes during the step preempts one of them: the
others then wait for it at the next OpenMP barrier, so the step loses far more time than the worker takes
(docs/performance.md). Held between steps, the workers prepare each batch on every core while the step waits for
it, and the step then runs alone.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Generator, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")
POLL_SECONDS = 1.0  # how often a held worker checks that the gate and its main process still exist


class WorkerGate:
    """One permit per data-loader worker and step: a worker takes one before each step's chunks, and the main
    process gives each worker one when it asks for that step's batch. Closed, it holds no one, so the
    DataLoader can end its workers as usual."""

    def __init__(self, workers: int) -> None:
        ctx = multiprocessing.get_context()
        self._permits = [ctx.Semaphore(0) for _ in range(workers)]
        self._closed = ctx.Event()
        self._main = os.getpid()

    def open(self) -> None:
        for permit in self._permits:
            permit.release()

    def close(self) -> None:
        self._closed.set()
        self.open()

    def wait(self) -> None:
        """In a worker, until the main process opens the next step, closes the gate or dies; at once in the main
        process (``train.workers: 0``)."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return
        permit = self._permits[info.id]
        while not self._closed.is_set() and not permit.acquire(timeout=POLL_SECONDS):
            if os.getppid() != self._main:
                return  # the DataLoader's watchdog ends this worker once it is back in its loop

    def batches(self, batches: Iterator[T]) -> Generator[T, None, None]:
        """``batches``, each asked of the workers only when the caller asks for it; closing this (or its end)
        closes the gate."""
        try:
            self.open()
            for batch in batches:
                yield batch
                self.open()
        finally:
            self.close()
