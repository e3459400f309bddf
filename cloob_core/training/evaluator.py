"""Evaluation while training (``train.eval_every``, ``train.eval_datasets``): at every ``eval_every``-th step (a
checkpoint boundary) rank 0 exports the model as it stands into ``OUTPUT/evals/step-N/model`` and starts
``cloob eval suite`` on it, for the named data sets of the ``eval`` section, in a process of its own.

In a process of its own, so the run is untouched: the training process's random generators, threads and data
loader never see the evaluation, the final weights are bit-identical with and without it, and no rank waits in a
collective for it (the other ranks never know). It is the very command a user would run, so its figures at step N
are `cloob eval suite` on that step's weights (``--checkpoint`` of step N gives the same). Its CLIP_benchmark-style
records land in ``OUTPUT/evals/step-N/results/<data set>/`` and its log in ``.../eval.log``. When it ends, its
scalars go to TensorBoard (``eval/<name>``), Prometheus (``cloob_train_eval{metric=...}``) and
``OUTPUT/eval_history.csv`` (a ``dvc plots`` curve, one row per step). One evaluation runs at a time: the steps
reached while one runs wait in order (none is dropped, so the history is the same however fast the evaluations
are; a backlog is said once); a failing one is reported and the run goes on. The run waits for the last one
before it ends.

Bounded and resumable:
- each evaluation has ``train.eval_timeout_s``: one that runs past it (a frozen mount, a hung read, a stopped
  process) is killed with a warning, and the run goes on; nothing waits for it without a limit;
- the evaluation process ends with its trainer: it asks the kernel to kill it when its parent dies
  (``PR_SET_PDEATHSIG``; elsewhere it polls its parent), so a killed run leaves none behind;
- a finished evaluation is recorded in ``evals/step-N/scalars.json`` (written last), and a resumed run rebuilds
  its history from those records: evaluations of steps up to its checkpoint that did not finish are run again
  from their exports (the checkpoint's own step exported again when the kill came before its export), and the
  folders of steps after the checkpoint, which the run trains again, are removed. A resumed run so ends with
  the history an uninterrupted one has.
"""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cloob_core import storage
from cloob_core.config import CloobConfig
from cloob_core.io import write_json, write_text
from cloob_core.model.export import export_model
from cloob_core.model.files import INFO_FILE
from cloob_core.parent import PARENT_ENV

log = logging.getLogger(__name__)
HISTORY = "eval_history.csv"
SCALARS = "scalars.json"  # in evals/step-N: the evaluation finished, and these are its scalars
_STEP_FOLDER = re.compile(r"^step-(\d{8})$")
_KILL_WAIT_S = 30.0  # for a killed evaluation to be reaped


@dataclass
class _Running:
    step: int
    folder: Path
    process: subprocess.Popen
    deadline: float  # time.monotonic() past which it is killed


@dataclass
class Evaluator:
    """Rank 0's evaluations of a run; ``enabled`` False (other ranks, or eval_every 0) does nothing."""

    config: CloobConfig
    output: Path
    enabled: bool
    device: str = "auto"  # the training process's: the evaluation embeds on the same GPU (or the CPU)
    running: _Running | None = None
    waiting: deque[tuple[int, Path]] = field(default_factory=deque)  # steps exported, in order
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    _backlog_said: bool = False

    @property
    def every(self) -> int:
        return self.config.train.eval_every if self.enabled else 0

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def _folder(self, step: int) -> Path:
        return self.output / "evals" / f"step-{step:08d}"

    def resume(self, model: Any, step: int) -> None:
        """A run resumed at ``step``: its history from the finished evaluations up to that step, the unfinished
        ones queued again (the step's own exported first when the kill came before its export), and the folders
        of later steps removed (the run trains them again). A step whose folder is gone keeps its row of
        ``eval_history.csv``, said in the log; one that is neither there nor rebuildable is named as lost."""
        if not self.enabled:
            return
        recorded = self._recorded_history(step)
        evals = self.output / "evals"
        for folder in sorted(evals.iterdir()) if evals.is_dir() else ():
            match = _STEP_FOLDER.match(folder.name)
            if match is None:
                continue
            evaluated = int(match.group(1))
            if evaluated > step:
                shutil.rmtree(folder, ignore_errors=True)
            elif (folder / SCALARS).is_file():
                scalars = _read_scalars(folder / SCALARS)
                if scalars is not None:
                    self.history[evaluated] = scalars
        kept, lost = [], []
        for due in range(self.every, step + 1, self.every):
            if due in self.history:
                continue
            if (self._folder(due) / "model" / INFO_FILE).is_file():  # the export's last file: it is whole
                log.info("evaluation of step %d did not finish before the run stopped: evaluating it again", due)
                self._queue(due, self._folder(due))
            elif due == step:
                self.submit(model, step)
            elif due in recorded:
                self.history[due] = recorded[due]
                kept.append(due)
            else:
                lost.append(due)
        if kept:
            log.warning("evaluations of step(s) %s: their folders under evals/ are gone; their rows of %s are kept",
                        ", ".join(map(str, kept)), HISTORY)
        if lost:
            log.warning("evaluations of step(s) %s cannot be done again (their exports are gone) and %s has no row "
                        "of them: the history lacks them", ", ".join(map(str, lost)), HISTORY)
        if self.history:
            self._write_history()

    def _recorded_history(self, step: int) -> dict[int, dict[str, float]]:
        """The rows of an earlier ``eval_history.csv`` up to ``step`` (none where it is absent or damaged)."""
        path = self.output / HISTORY
        try:
            rows = list(csv.DictReader(io.StringIO(path.read_text(encoding="utf-8"))))
            history = {int(row.pop("step")): {name: float(value) for name, value in row.items() if value}
                       for row in rows}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError) as err:  # a damaged file: what is rebuilt stays
            log.warning("%s does not read (%s: %s); its rows are not kept", path, type(err).__name__, err)
            return {}
        return {at: scalars for at, scalars in history.items() if at <= step}

    def submit(self, model: Any, step: int) -> None:
        """Export the model of ``step`` and evaluate it: now, or after the evaluations before it."""
        folder = self._folder(step)
        export_model(model, folder / "model", {"objective": self.config.train.objective, "steps": step})
        self._queue(step, folder)

    def _queue(self, step: int, folder: Path) -> None:
        self.waiting.append((step, folder))
        if self.running is None:  # (one that has ended is taken in by the loop's poll, with the monitor)
            self._start(*self.waiting.popleft())
        if len(self.waiting) > 1 and not self._backlog_said:
            self._backlog_said = True
            log.warning("evaluations fall behind training: steps %s wait for the evaluation of step %d (each is "
                        "evaluated in turn, the last before the run ends; a larger train.eval_every keeps up)",
                        ", ".join(str(waiting) for waiting, _ in self.waiting), self.running.step)

    def _start(self, step: int, folder: Path) -> None:
        params = self.output / "evals" / "params.yaml"
        if not params.exists():
            write_text(params, yaml.safe_dump(self.config.model_dump(), sort_keys=False))
        shutil.rmtree(folder / "results", ignore_errors=True)  # what an evaluation stopped by a kill left
        command = [sys.executable, "-m", "cloob_core.cli", "eval", "suite", "--params", str(params), "--model",
                   str(folder / "model"), "--output", str(folder / "results"), "--no-progress", "--device", self.device,
                   *(flag for name in self.config.train.eval_datasets for flag in ("--dataset", name))]
        with open(folder / "eval.log", "wb") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**os.environ, PARENT_ENV: str(os.getpid())})
        self.running = _Running(step, folder, process, time.monotonic() + self.config.train.eval_timeout_s)
        log.info("evaluating step %d on %s (log: %s)", step, ", ".join(self.config.train.eval_datasets),
                 folder / "eval.log")

    def poll(self, monitor: Any = None) -> None:
        """Take in a finished evaluation, kill one past its deadline, and start the next one waiting."""
        if self.running is not None and self.running.process.poll() is None:
            if time.monotonic() < self.running.deadline:
                return
            self._kill_late()
        elif self.running is not None:
            running, self.running = self.running, None
            self._take_in(running, monitor)
        if self.running is None and self.waiting:
            self._start(*self.waiting.popleft())

    def _kill_late(self) -> None:
        running, self.running = self.running, None
        running.process.kill()  # SIGKILL: a stopped process ignores SIGTERM until it is continued
        try:
            running.process.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("evaluation process %d of step %d did not end after SIGKILL", running.process.pid,
                        running.step)
        log.warning("evaluation of step %d ran past train.eval_timeout_s (%gs) and was killed; the run goes on "
                    "(its log: %s)", running.step, self.config.train.eval_timeout_s, running.folder / "eval.log")

    def finish(self, monitor: Any = None) -> None:
        """Wait for the running evaluation and those waiting, each up to its deadline: the last step's figures
        belong to the run."""
        while self.running is not None or self.waiting:
            if self.running is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):  # past its deadline: poll kills it
                    self.running.process.wait(timeout=max(0.0, self.running.deadline - time.monotonic()))
            self.poll(monitor)

    def _take_in(self, running: _Running, monitor: Any) -> None:
        if running.process.returncode != 0:
            lines = (running.folder / "eval.log").read_text(errors="replace").strip().splitlines()
            log.warning("evaluation of step %d failed (exit %d): %s; the run goes on", running.step,
                        running.process.returncode, lines[-1] if lines else "no output")
            return
        scalars = _scalars(running.folder / "results")
        write_json(running.folder / SCALARS, scalars)
        self.history[running.step] = scalars
        self._write_history()
        if monitor is not None:
            monitor.evaluated(running.step, scalars)
        shown = ", ".join(f"{name} {value:.4f}" for name, value in sorted(scalars.items())[:6])
        log.info("evaluation of step %d: %s", running.step, shown)

    def stop(self) -> None:
        """The run failed or was stopped: its running evaluation is ended too (killed if it does not end on
        SIGTERM within a few seconds), and none starts."""
        self.waiting.clear()
        if self.running is not None:
            self.running.process.terminate()
            try:
                self.running.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.running.process.kill()
                self.running.process.wait(timeout=_KILL_WAIT_S)
            self.running = None

    def _write_history(self) -> None:
        names = sorted({name for scalars in self.history.values() for name in scalars})
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(["step", *names])
        for step in sorted(self.history):
            writer.writerow([step, *(self.history[step].get(name, "") for name in names)])
        write_text(self.output / HISTORY, text.getvalue())


def _read_scalars(path: Path) -> dict[str, float] | None:
    """A finished evaluation's record: names to numbers, or None (said) when the file is damaged, so that the
    step is evaluated again as an unfinished one."""
    try:
        scalars = storage.read_json(path)
        if not isinstance(scalars, dict):
            raise ValueError(f"a JSON {type(scalars).__name__} where an object of scalars belongs")
        return {str(name): float(value) for name, value in scalars.items()}
    except (OSError, ValueError, TypeError) as err:
        log.warning("%s is damaged (%s); the step counts as not evaluated", path, str(err)[:200])
        return None


def _scalars(results: Path) -> dict[str, float]:
    """``<data set>_<task>.<key>`` -> value over the suite's per-data-set ``metrics.json``."""
    scalars = {}
    for metrics in sorted(results.glob("*/metrics.json")):
        for result, values in storage.read_json(metrics).items():
            scalars.update({f"{result}.{key}": float(value) for key, value in values.items()})
    return scalars
