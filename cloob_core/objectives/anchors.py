"""Which rows of the global batch anchor a process's loss terms: the objectives' one notion of locality.

Every objective is a mean of terms anchored on rows (an image against the texts, a text against the images).
One process, or every rank of the default, anchors on every row of the gathered batch; with ``train.local_loss``
a rank anchors on its own rows only, whose positives sit at columns ``start + i`` of the global batch
(:func:`cloob_core.objectives.distributed.local_anchors` builds those). ``gather`` makes rows computed for the
anchors alone into the global batch's: CLOOB retrieves for its local queries and gathers the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@dataclass(frozen=True)
class Anchors:
    start: int = 0
    stop: int | None = None  # None: to the end
    gather: Callable[[Tensor], Tensor] = _identity

    @property
    def every_row(self) -> bool:
        return self.start == 0 and self.stop is None

    @property
    def rows(self) -> slice:
        return slice(self.start, self.stop)

    def per(self, views: int) -> Anchors:
        """The same anchors counted in samples of ``views`` rows each (poly-view)."""
        return Anchors(self.start // views, None if self.stop is None else self.stop // views, self.gather)


EVERY_ROW = Anchors()
