"""A batch ring for tests that read ``StreamChunks`` directly, step after step without an ``Assembler`` to
release slots: it keeps every chunk's crops and token rows, by step and stream."""

from __future__ import annotations

import numpy as np
import torch

from cloob_core.training.batch_ring import BatchRing
from cloob_core.training.streams import Chunk, StreamSettings


class KeptRing(BatchRing):
    def __init__(self, owned: list[int], settings: StreamSettings) -> None:
        self.place = {stream: index for index, stream in enumerate(owned)}
        self.per_chunk = settings.chunk_size * settings.image_views
        self.kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, step, image_offset, views, text_offset, tokens) -> None:
        images = torch.from_numpy(np.stack(views)).permute(0, 3, 1, 2)
        self.kept[step, image_offset // self.per_chunk] = images, torch.as_tensor(tokens).clone()

    def of(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's images ([n, 3, size, size] uint8) and token rows."""
        return self.kept[chunk.step, self.place[chunk.stream]]
