"""Evaluation while training (``train.eval_every``, ``train.eval_datasets``): at every ``eval_every``-th step (a
checkpoint boundary) rank 0 exports the model as it stands into ``OUTPUT/evals/step-N/model`` and starts
``cloob eval suite`` on it, for the named data sets of the ``eval`` section, in a process of its own.

In a process of its own, so the run is untouched: the training process's random generators, threads and data
loader never see the evaluation, the final weights are bit-identical with and without it, and no rank waits in a
collective for it (the other ranks never know). It is the very command a user would run, so its figures at step N
are `cloob eval suite` on that step's weights (``--checkpoint`` of step N gives the same). Its CLIP_benchmark-style
records land in ``OUTPUT/evals/step-N/results/<data set>/`` and its log in ``.../eval.log``. When it ends, its
scalars go to TensorBoard (``eval/<name>``), Prometheus (``cloob_train_eval{metric=...}``) and
``OUTPUT/eval_history.csv`` (a ``dvc plots`` curve, one row per step). One evaluation runs at a time: the step
reached while one runs waits for it (a later one replaces it, and that is said); a failing one is reported and the
run goes on. The run waits for the last one before it ends.
"""

from __future__ import annotations

import csv
import io
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cloob_core import storage
from cloob_core.config import CloobConfig
from cloob_core.io import write_text
from cloob_core.model.export import export_model

log = logging.getLogger(__name__)
HISTORY = "eval_history.csv"


@dataclass
class _Running:
    step: int
    folder: Path
    process: subprocess.Popen


@dataclass
class Evaluator:
    """Rank 0's evaluations of a run; ``enabled`` False (other ranks, or eval_every 0) does nothing."""

    config: CloobConfig
    output: Path
    enabled: bool
    device: str = "auto"  # the training process's: the evaluation embeds on the same GPU (or the CPU)
    running: _Running | None = None
    waiting: tuple[int, Path] | None = None  # the latest step exported while another was evaluated
    history: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def every(self) -> int:
        return self.config.train.eval_every if self.enabled else 0

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def submit(self, model: Any, step: int) -> None:
        """Export the model of ``step`` and evaluate it: now, or when the running evaluation ends (the latest
        step waiting replaces an earlier one, which is said)."""
        folder = self.output / "evals" / f"step-{step:08d}"
        export_model(model, folder / "model", {"objective": self.config.train.objective, "steps": step})
        self.poll()
        if self.running is None:
            self._start(step, folder)
            return
        if self.waiting is not None:
            log.warning("evaluation of step %d still running: step %d is not evaluated (step %d is next)",
                        self.running.step, self.waiting[0], step)
        self.waiting = (step, folder)

    def _start(self, step: int, folder: Path) -> None:
        params = self.output / "evals" / "params.yaml"
        if not params.exists():
            write_text(params, yaml.safe_dump(self.config.model_dump(), sort_keys=False))
        command = [sys.executable, "-m", "cloob_core.cli", "eval", "suite", "--params", str(params), "--model",
                   str(folder / "model"), "--output", str(folder / "results"), "--no-progress", "--device", self.device,
                   *(flag for name in self.config.train.eval_datasets for flag in ("--dataset", name))]
        with open(folder / "eval.log", "wb") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.running = _Running(step, folder, process)
        log.info("evaluating step %d on %s (log: %s)", step, ", ".join(self.config.train.eval_datasets),
                 folder / "eval.log")

    def poll(self, monitor: Any = None) -> None:
        """Take in a finished evaluation, and start the one waiting."""
        if self.running is None or self.running.process.poll() is None:
            return
        running, self.running = self.running, None
        self._take_in(running, monitor)
        if self.waiting is not None:
            (step, folder), self.waiting = self.waiting, None
            self._start(step, folder)

    def finish(self, monitor: Any = None) -> None:
        """Wait for the running evaluation and the one waiting: the last step's figures belong to the run."""
        while self.running is not None:
            self.running.process.wait()
            self.poll(monitor)

    def _take_in(self, running: _Running, monitor: Any) -> None:
        if running.process.returncode != 0:
            lines = (running.folder / "eval.log").read_text(errors="replace").strip().splitlines()
            log.warning("evaluation of step %d failed (exit %d): %s; the run goes on", running.step,
                        running.process.returncode, lines[-1] if lines else "no output")
            return
        scalars = _scalars(running.folder / "results")
        self.history[running.step] = scalars
        self._write_history()
        if monitor is not None:
            monitor.evaluated(running.step, scalars)
        shown = ", ".join(f"{name} {value:.4f}" for name, value in sorted(scalars.items())[:6])
        log.info("evaluation of step %d: %s", running.step, shown)

    def stop(self) -> None:
        """The run failed or was stopped: its running evaluation is ended too, and none starts."""
        self.waiting = None
        if self.running is not None:
            self.running.process.terminate()
            self.running.process.wait()
            self.running = None

    def _write_history(self) -> None:
        names = sorted({name for scalars in self.history.values() for name in scalars})
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(["step", *names])
        for step in sorted(self.history):
            writer.writerow([step, *(self.history[step].get(name, "") for name in names)])
        write_text(self.output / HISTORY, text.getvalue())


def _scalars(results: Path) -> dict[str, float]:
    """``<data set>_<task>.<key>`` -> value over the suite's per-data-set ``metrics.json``."""
    scalars = {}
    for metrics in sorted(results.glob("*/metrics.json")):
        for result, values in storage.read_json(metrics).items():
            scalars.update({f"{result}.{key}": float(value) for key, value in values.items()})
    return scalars
