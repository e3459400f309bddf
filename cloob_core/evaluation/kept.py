"""Inputs kept in memory for the next model: a caller that embeds the same image sets and texts with many models
(the grid and the diagnostics over training measure every checkpoint on the same sets) decodes the images and
tokenizes the texts once. In the quick ablation, decoding again was 50 of a measurement's 94 s, and tokenizing
the same prompts again half of what was left."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from torch import Tensor


class _Images(Protocol):  # image_loader's Batch, without importing it (image_loader imports this module)
    images: Tensor


Batch = TypeVar("Batch", bound=_Images)


class KeptInputs:
    """Image batches (per set and transform) kept after their first whole read, and token tensors (per tokenizer
    and texts), while all fit ``budget_bytes``; a set that does not fit is read again each time, and what is kept
    stays."""

    def __init__(self, budget_bytes: int = 1 << 30):
        self.budget_bytes = budget_bytes
        self._batches: dict[tuple[str, str], list[Any]] = {}
        self._tokens: dict[tuple[str, str], Tensor] = {}
        self._used = 0

    def batches(self, key: tuple[str, str], read: Callable[[], Iterator[Batch]]) -> Iterator[Batch]:
        """The batches under ``key`` (a set's identity and transform): kept ones, or ``read()``'s, kept if whole
        and within the budget."""
        if key in self._batches:
            yield from self._batches[key]
            return
        kept: list[Batch] | None = []
        size = 0
        for batch in read():
            if kept is not None:
                size += batch.images.nbytes
                if self._used + size <= self.budget_bytes:
                    kept.append(batch)
                else:
                    kept = None
            yield batch
        if kept is not None:
            self._batches[key] = kept
            self._used += size

    def tokens(self, key: tuple[str, str], tokenize: Callable[[], Tensor]) -> Tensor:
        """The tokens under ``key`` (a tokenizer and a digest of the texts): kept, or ``tokenize()``'s."""
        if key in self._tokens:
            return self._tokens[key]
        tokens = tokenize()
        if self._used + tokens.nbytes <= self.budget_bytes:
            self._tokens[key] = tokens
            self._used += tokens.nbytes
        return tokens
