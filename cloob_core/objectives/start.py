"""When a Hopfield objective starts retrieving: the start without retrieval (docs/objectives.md, "Collapse").

Towers that start in a narrow cone give Hopfield retrieval nearly identical patterns, which it averages into one
vector: retrieval from the first step puts the run at the collapsed value with a vanishing gradient. So the first
steps train the objective on the encoders' embeddings (InfoLOOB for CLOOB). The start lasts ``least`` steps (the
warm-up, by default), and then until it has left the collapsed value: to the first step whose batch loss is at least
``until_margin`` of the collapsed value below it, and at the latest to step ``most``. A step count alone switches a
run whose towers are still in the cone when a shorter warm-up, a higher rate or other data make the count come
early; the margin, relative to the collapsed value, means the same at any batch size, rate or data.

The margin of a step is read at the end of the next one, so the start adds no host synchronisation to a step.
Everything is checkpointed: a resumed run switches where an uninterrupted one does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


class RetrievalStart:
    """The step count of a Hopfield objective and the step its retrieval began at.

    ``least``: the steps without retrieval at least (0: retrieval from the first step, the paper's start);
    ``until_margin``: after them, the start goes on until a batch's loss is this fraction of the collapsed value
    below it (0: it ends at ``least``); ``most``: the steps without retrieval at most."""

    def __init__(self, least: int, until_margin: float = 0.0, most: int | None = None) -> None:
        most = least if most is None else most
        if least < 0:
            raise ValueError(f"start_without_hopfield must be >= 0, got {least}")
        if not 0.0 <= until_margin < 1.0:
            raise ValueError(f"start_until_margin must be in [0, 1), got {until_margin}")
        if most < least:
            raise ValueError(f"the start's longest ({most} steps) is shorter than its least ({least})")
        self.least, self.most = int(least), int(most)
        self.until_margin = float(until_margin)
        self.step = 0
        self.retrieving_from: int | None = 0 if self.least == 0 else None
        self.reason = "retrieval from the first step (the paper's start)" if self.least == 0 else ""
        self.last_margin: float | None = None  # the latest margin read (for the log)
        self._measured_at = -1
        self._current: Tensor | None = None  # this step's margin, on the device
        self._previous: Tensor | None = None  # the last step's, read at this step's end

    def __repr__(self) -> str:
        return f"start: {self.least} to {self.most} steps, until a margin of {self.until_margin}"

    @property
    def retrieving(self) -> bool:
        return self.retrieving_from is not None

    def wants_margin(self) -> bool:
        """Whether this step's loss is to be recorded (once per step, however many micro-batches)."""
        return not self.retrieving and self.until_margin > 0 and self._measured_at != self.step

    def record(self, loss: Tensor, collapsed_loss: float | Tensor) -> None:
        """This step's loss without retrieval, against the collapsed value: kept on the device until read."""
        self._measured_at = self.step
        self._current = (collapsed_loss - loss.detach().float()) / collapsed_loss

    def end_step(self) -> None:
        """Advance one optimiser step; reads the previous step's margin and switches when the start is over."""
        pending, self._previous, self._current = self._previous, self._current, None
        self.step += 1
        if self.retrieving:
            return
        if pending is not None:
            self.last_margin = float(pending)
        if self.step >= self.most:
            self._switch(f"the start's longest, {self.most} step(s) (objective.start_without_hopfield "
                         "× start_limit_factor)" if self.most > self.least else
                         f"{self.least} step(s) without it (objective.start_without_hopfield)")
        elif self.step >= self.least and self.until_margin == 0:
            self._switch(f"{self.least} step(s) without it (objective.start_without_hopfield)")
        elif self.step >= self.least and self.last_margin is not None and self.last_margin >= self.until_margin:
            self._switch(f"a batch {self.last_margin:.1%} below the collapsed value without retrieval "
                         f"(objective.start_until_margin {self.until_margin:.1%})")

    def _switch(self, reason: str) -> None:
        self.retrieving_from, self.reason = self.step, reason
        self._previous = None

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (numbers only: loaded weights-only)."""
        return {"step": self.step, "retrieving_from": -1 if self.retrieving_from is None else self.retrieving_from,
                "pending_margin": math.nan if self._previous is None else float(self._previous),
                "last_margin": math.nan if self.last_margin is None else self.last_margin}

    def load(self, state: dict[str, Any]) -> None:
        """A checkpoint's state; one written before the margin (``step`` alone) switched at its count, as here."""
        self.step = int(state.get("step", 0))  # a checkpoint from before the count: its run started with retrieval
        since = int(state.get("retrieving_from", self.least if self.step >= self.least else -1))
        self.retrieving_from = None if since < 0 else since
        pending, last = (float(state.get(key, math.nan)) for key in ("pending_margin", "last_margin"))
        self._previous = None if math.isnan(pending) else torch.tensor(pending)
        self.last_margin = None if math.isnan(last) else last
        self._current, self._measured_at = None, -1


def start_of(objective: object) -> RetrievalStart | None:
    """A Hopfield objective's start; None for an objective without retrieval."""
    start = getattr(objective, "retrieval_start", None)
    return start if isinstance(start, RetrievalStart) else None
