"""The worker gate (``train.prefetch``): held, data-loader workers make a step's chunks only when the main process
asks for that step's batch; released, they prefetch; the tuner keeps the way the run measures faster; and the
workers end with the loader, or on their own when the main process dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from itertools import count

import pytest
import torch

from cloob_core.training.loop import _signals_to_the_main_process
from cloob_core.training.worker_gate import PrefetchTuner, WorkerGate

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


def _lead_after_each_step(gate: WorkerGate | None, steps: int = 3) -> list[int]:
    """Items made beyond those handed over, after each batch, once the caller has 'trained' for 0.3 s.

    The lead, not what is made during the step: the items are so cheap that a released loader may fill its whole
    prefetch before the batch is even handed over, and then make nothing while the step runs."""
    made = torch.zeros(WORKERS, dtype=torch.long).share_memory_()
    loader = torch.utils.data.DataLoader(_Counted(gate, made), batch_size=None, num_workers=WORKERS,
                                         prefetch_factor=4)
    batches = _steps(iter(loader))
    batches = batches if gate is None else gate.batches(batches)
    lead = []
    for step in range(steps):
        assert next(batches) == [step] * WORKERS * CHUNKS
        time.sleep(0.3)
        lead.append(int(made.sum()) - (step + 1) * WORKERS * CHUNKS)
    batches.close()
    return lead


def test_gated_workers_make_nothing_ahead_of_the_step():
    assert _lead_after_each_step(WorkerGate(WORKERS)) == [0, 0, 0]
    assert sum(_lead_after_each_step(None)) > 0  # the test can tell: ungated, the loader prefetches


class _Schedule(PrefetchTuner):
    """Held at the steps given, released at the others; records nothing."""

    def __init__(self, held: set[int]) -> None:
        super().__init__()
        self.steps = held

    def held(self, step: int) -> bool:
        return step in self.steps

    def record(self, step: int, seconds: float) -> None:
        pass


def test_released_workers_prefetch_and_held_again_they_stop_once_their_lead_is_used():
    lead = _lead_after_each_step(WorkerGate(WORKERS, _Schedule({0, 1, 4, 5, 6, 7, 8})), steps=9)
    assert lead[:2] == [0, 0]
    assert min(lead[2:4]) > 0  # released: the loader prefetches
    assert lead[5:] == [0, 0, 0, 0]  # held again: the workers are past no allowed step, so the lead is used up


def _decide(held_ms: float, released_ms: float, outlier_ms: float = 0.0, **shape) -> PrefetchTuner:
    """A whole trial in which every held step takes ``held_ms`` and every released one ``released_ms``, except the
    held steps settling after a switch, which take ``outlier_ms`` when it is given."""
    tuner = PrefetchTuner(**shape)
    for step in range(tuner.warmup + tuner.block * tuner.blocks):
        settling = step >= tuner.warmup and (step - tuner.warmup) % tuner.block < tuner.settle
        ms = held_ms if tuner.held(step) else released_ms
        ms = outlier_ms if settling and tuner.held(step) and outlier_ms else ms
        tuner.record(step, ms / 1e3)
    return tuner


def test_the_tuner_keeps_the_faster_way_and_alternates_them_while_it_measures():
    tuner = PrefetchTuner(warmup=4, block=3, settle=1, blocks=4, every=20)
    assert [tuner.held(step) for step in range(18)] == [True] * 4 + [True, True, True, False, False, False] * 2 + \
        [True] * 2
    assert not _decide(200, 180).chosen_held
    assert _decide(180, 200).chosen_held
    assert _decide(180, 200, outlier_ms=1e4, block=4, settle=3).chosen_held  # settling steps are not counted


def test_the_tuner_measures_again_every_so_many_steps():
    tuner = _decide(200, 180, warmup=2, block=2, settle=0, blocks=2, every=10)
    assert [tuner.held(step) for step in range(6, 16)] == [False] * 6 + [True, True, False, False]
    for step in range(6, 16):  # held is faster now
        tuner.record(step, 0.1 if tuner.held(step) else 0.3)
    assert tuner.chosen_held


def test_a_repeated_trial_keeps_its_blocks_when_the_period_is_not_a_multiple_of_a_block():
    tuner = _decide(200, 180, warmup=2, block=4, settle=2, blocks=2, every=10)  # trials at steps 2-9, 12-19
    assert not tuner.chosen_held
    for step in range(10, 20):  # held is faster now, but its settling steps (12 and 13) are outliers against it
        tuner.record(step, 1.0 if step in (12, 13) else 0.1 if tuner.held(step) else 0.3)
    assert tuner.chosen_held


def test_an_inconsistent_tuner_is_refused():
    with pytest.raises(ValueError, match="inconsistent tuner"):
        PrefetchTuner(block=8, settle=8)


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
