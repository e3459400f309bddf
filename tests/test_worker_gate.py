"""The worker gate (``train.prefetch: between_steps``): data-loader workers make a step's chunks only when the
main process asks for that step's batch, and they end with the loader, or on their own when the main process
dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from itertools import count

import torch

from cloob_core.training.loop import _signals_to_the_main_process
from cloob_core.training.worker_gate import WorkerGate

WORKERS, CHUNKS = 2, 3  # chunks per worker and step


class _Counted(torch.utils.data.IterableDataset):
    """Per step, CHUNKS items from each worker, each one counted in shared memory when it is made."""

    def __init__(self, gate: WorkerGate | None, made: torch.Tensor) -> None:
        super().__init__()
        self.gate, self.made = gate, made

    def __iter__(self):
        worker = torch.utils.data.get_worker_info().id
        for step in count():
            if self.gate is not None:
                self.gate.wait()
            for _ in range(CHUNKS):
                self.made[worker] += 1
                yield step


def _steps(items):
    """Items (worker-interleaved) to one list per step."""
    while True:
        yield [next(items) for _ in range(WORKERS * CHUNKS)]


def _made_while_the_step_runs(gate: WorkerGate | None) -> list[int]:
    """Items made after each batch was handed over, while the caller 'trains' for 0.3 s."""
    made = torch.zeros(WORKERS, dtype=torch.long).share_memory_()
    loader = torch.utils.data.DataLoader(_Counted(gate, made), batch_size=None, num_workers=WORKERS,
                                         prefetch_factor=4)
    batches = _steps(iter(loader))
    batches = batches if gate is None else gate.batches(batches)
    ahead = []
    for step in range(3):
        assert next(batches) == [step] * WORKERS * CHUNKS
        handed = int(made.sum())
        time.sleep(0.3)
        ahead.append(int(made.sum()) - handed)
    batches.close()
    return ahead


def test_gated_workers_make_nothing_while_the_step_runs():
    assert _made_while_the_step_runs(WorkerGate(WORKERS)) == [0, 0, 0]
    assert sum(_made_while_the_step_runs(None)) > 0  # the test can tell: ungated, the loader prefetches


def test_closing_the_batches_lets_the_loader_end_its_workers():
    """A held worker would never read the loader's stop message, and training's workers ignore the SIGTERM the
    loader falls back on: closing opens the gate for good."""
    made = torch.zeros(WORKERS, dtype=torch.long).share_memory_()
    gate = WorkerGate(WORKERS)
    loader = torch.utils.data.DataLoader(_Counted(gate, made), batch_size=None, num_workers=WORKERS,
                                         worker_init_fn=_signals_to_the_main_process)
    items = iter(loader)
    batches = gate.batches(_steps(items))
    next(batches)
    workers = list(items._workers)
    batches.close()
    items._shutdown_workers()
    assert not any(worker.is_alive() for worker in workers)


def test_held_workers_exit_when_the_main_process_is_killed(tmp_path):
    """Workers ignore SIGTERM and SIGINT during training (the main process ends them): held at the gate, they
    must notice on their own that it died."""
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_worker_gate import WORKERS, _Counted, _steps
        from cloob_core.training.loop import _signals_to_the_main_process
        from cloob_core.training.worker_gate import WorkerGate

        gate = WorkerGate(WORKERS)
        made = torch.zeros(WORKERS, dtype=torch.long).share_memory_()
        items = iter(torch.utils.data.DataLoader(_Counted(gate, made), batch_size=None, num_workers=WORKERS,
                                                 worker_init_fn=_signals_to_the_main_process))
        batches = gate.batches(_steps(items))  # kept: closing it would open the gate
        next(batches)
        print(*(worker.pid for worker in items._workers), flush=True)
        time.sleep(600)
    """))
    main = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in main.stdout.readline().split()]
    assert len(workers) == WORKERS
    main.send_signal(signal.SIGKILL)
    main.wait()
    deadline = time.monotonic() + 30  # the gate's poll, then the DataLoader's watchdog (5 s)
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
