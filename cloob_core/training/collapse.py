"""The collapse detector: is the run still learning, or sitting where every embedding is the same?

A contrastive run can fall into the collapsed fixed point, where the encoders map every input to (nearly) one
vector. The loss then sits at the value of a batch of identical embeddings (each objective's
``collapsed_loss``: ``2 ln(N-1) / inv_tau`` for CLOOB and InfoLOOB, ``ln N`` for CLIP), and its gradient
vanishes, so nothing brings the run back (docs/objectives.md, "Collapse"). Two figures tell it apart from a run
that has not started learning yet, measured on the batch of every log window's last step:

- the **collapse margin**: the collapsed value minus the window's loss, > 0 once the model scores its pairs
  better than any collapsed model can;
- the embeddings' **effective rank** (RankMe: Garrido et al., ICML 2023, ``exp`` of the entropy of the
  normalised singular values), of the *centred* embeddings, so that a narrow cone around a common direction,
  how many towers start, is not read as collapse, and their **mean pairwise cosine** (how narrow the cone is).

A window is *flat* when the loss is within ``MARGIN_TOLERANCE`` of the collapsed value and a tower's embeddings
have shrunk to nearly one vector (mean cosine above ``COSINE_LIMIT``) or to a few directions (effective rank below
``RANK_FRACTION`` of the most it can have, ``min(N - 1, d)``). The second condition keeps a freshly initialised
run, whose loss also starts at the collapsed value, from being called collapsed. The two shapes differ: the
collapse measured on the CPU reproduction keeps a centred effective rank of 10-36 of 63, as a learning run does
(9-22), since RankMe sees the shape of the spread around the common vector, not how small it is; the mean cosine
of its most collapsed tower (0.986-0.997, against at most 0.98 at initialisation) tells them apart. One tower is
enough: CLOOB's loss reaches its collapsed value when one memory is collapsed and Hopfield retrieval averages the
other (image towers at 0.92 beside text towers at 0.995). A collapse to a few directions (4 effective eigenvalues
on the GPU run that prompted this) is what the rank sees. After
``train.collapse_windows`` flat windows in a row the run is called collapsed: one warning line, and with
``train.on_collapse: stop`` a checkpoint and exit 2. The verdict is read from the run's history, so a resumed
run judges exactly as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cloob_core.errors import StageError

# Measured on the reproduction (docs/objectives.md, "Collapse"), relative to the collapsed value: collapsed windows
# 0.00001-0.02%, initialised ones 0.06-0.08%, learning ones 0.6% and more from their second window on.
MARGIN_TOLERANCE = 0.001
# The most collapsed tower's mean cosine: 0.986-0.997 in collapsed windows of the reproduction, 0.967-0.981 in its
# initialised ones (measured on the GPU, RN50's image tower starts at 0.9997: docs/objectives.md, "Collapse").
COSINE_LIMIT = 0.98
# Below a tenth of the rank the batch allows, a tower uses a few directions only.
RANK_FRACTION = 0.1
HEALTH_FIELDS = ("effective_rank_image", "effective_rank_text", "mean_cosine_image", "mean_cosine_text")
# A log window as the run's history keeps it (checkpoints, loss_history.csv). Rows of checkpoints written before
# the detector have the first three only.
HISTORY_COLUMNS = ("step", "loss", "lr", "collapsed_loss", "collapse_margin", *HEALTH_FIELDS)


class TrainingCollapsed(StageError):
    """``train.on_collapse: stop``: the run collapsed; it was checkpointed, and ends here."""


def _at_least_float32(features: Tensor) -> Tensor:
    return features.float() if features.dtype in (torch.float16, torch.bfloat16) else features


def effective_rank(features: Tensor) -> Tensor:
    """RankMe of the centred rows of ``features`` ``[N, d]``: ``exp(-sum p_k ln p_k)``, ``p`` the singular values
    over their sum (a 0-dim tensor on the features' device, no host synchronisation)."""
    features = _at_least_float32(features)
    finite = torch.isfinite(features).all()  # a diverged step's: NaN, never an SVD that fails (no host sync)
    features = torch.where(finite, features, torch.zeros_like(features))
    centred = features - features.mean(dim=0, keepdim=True)
    singular = torch.linalg.svdvals(centred)
    p = singular / singular.sum().clamp_min(1e-12)
    rank = torch.exp(-torch.special.xlogy(p, p).sum())
    return torch.where(finite, rank, torch.full_like(rank, float("nan")))


def mean_cosine(features: Tensor) -> Tensor:
    """The mean cosine over the distinct pairs of rows (the rows re-normalised, so any features will do):
    ``(|sum x_i|^2 - N) / (N (N - 1))`` for unit rows, without forming the N x N matrix."""
    unit = torch.nn.functional.normalize(_at_least_float32(features), dim=-1)
    n = unit.shape[0]
    return (unit.sum(dim=0).square().sum() - n) / max(n * (n - 1), 1)


@torch.no_grad()
def embedding_health(image_features: Tensor, text_features: Tensor) -> Tensor:
    """``[4]``: the effective ranks and mean cosines of the image and the text embeddings (HEALTH_FIELDS' order),
    on the device, read when the log window closes."""
    return torch.stack([effective_rank(image_features), effective_rank(text_features),
                        mean_cosine(image_features), mean_cosine(text_features)])


@dataclass(frozen=True)
class Health:
    """One log window's figures (HEALTH_FIELDS, the collapsed value and the margin)."""

    collapsed_loss: float
    collapse_margin: float
    effective_rank_image: float
    effective_rank_text: float
    mean_cosine_image: float
    mean_cosine_text: float

    @classmethod
    def of(cls, loss: float, collapsed_loss: float, measured: Tensor) -> Health:
        rank_image, rank_text, cosine_image, cosine_text = (float(v) for v in measured.tolist())
        return cls(collapsed_loss, collapsed_loss - loss, rank_image, rank_text, cosine_image, cosine_text)

    def flat(self, max_rank: int) -> bool:
        """The loss at the collapsed value, and one tower's embeddings down to nearly one vector or a few
        directions."""
        at_collapse = abs(self.collapse_margin) < MARGIN_TOLERANCE * abs(self.collapsed_loss)
        one_vector = max(self.mean_cosine_image, self.mean_cosine_text) > COSINE_LIMIT
        few_directions = min(self.effective_rank_image, self.effective_rank_text) < RANK_FRACTION * max_rank
        return at_collapse and (one_vector or few_directions)

    def as_dict(self) -> dict[str, float]:
        return {name: round(getattr(self, name), 6) for name in HISTORY_COLUMNS[3:]}


def history_row(step: int, loss: float, lr: float, health: Health) -> tuple[float, ...]:
    """One window of the run's history, in HISTORY_COLUMNS' order."""
    return (step, loss, lr, *(getattr(health, name) for name in HISTORY_COLUMNS[3:]))


def health_history(rows: list[tuple[float, ...]]) -> list[tuple[int, Health | None]]:
    """(step, health) of each window of the run's history (None where a row predates the detector)."""
    return [(int(row[0]), Health(*row[3:]) if len(row) == len(HISTORY_COLUMNS) else None) for row in rows]


@dataclass(frozen=True)
class CollapseRule:
    """``train.collapse_windows`` flat windows in a row (0: never judged) of a batch of ``batch`` rows of ``width``
    dimensions."""

    windows: int
    batch: int
    width: int

    @property
    def max_rank(self) -> int:
        return min(self.batch - 1, self.width)

    def _flat_run(self, history: list[tuple[int, Health | None]]) -> int:
        """How many windows at the end of ``history`` are flat, counted up to one past ``windows``."""
        run = 0
        for _, health in reversed(history):
            if run > self.windows or health is None or not health.flat(self.max_rank):
                break
            run += 1
        return run

    def first_collapse(self, history: list[tuple[int, Health | None]]) -> int | None:
        """The step whose window completed the first collapsed stretch of ``history``, or None."""
        run = 0
        for step, health in history:
            run = run + 1 if health is not None and health.flat(self.max_rank) else 0
            if self.windows and run == self.windows:
                return step
        return None

    def verdict(self, history: list[tuple[int, Health | None]]) -> str | None:
        """The collapse line, when the window just closed is the ``windows``-th flat one in a row (said once per
        such stretch), else None."""
        if not self.windows or self._flat_run(history) != self.windows:
            return None
        first, last = history[-self.windows][0], history[-1][0]
        health = history[-1][1]
        assert health is not None
        return (f"training has collapsed: for {self.windows} log windows (steps {first}-{last}) the loss sat at its "
                f"collapsed value {health.collapsed_loss:.4f} (margin {health.collapse_margin:+.4f}), mean cosine "
                f"{health.mean_cosine_image:.3f} / {health.mean_cosine_text:.3f} (image / text), effective rank "
                f"{health.effective_rank_image:.1f} / {health.effective_rank_text:.1f} of {self.max_rank}; lower "
                "optim.lr or lengthen optim.warmup_steps (docs/objectives.md, Collapse)")
