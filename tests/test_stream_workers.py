"""Every split of a rank's data streams over its data-loader workers feeds the loop in step order with a bounded
number of chunks waiting (issue: 3 streams on 2 workers grew by one chunk a step and, through the CLI, stalled)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cloob_core.config import load_config
from cloob_core.training import loop
from cloob_core.training.streams import Assembler, Chunk, StreamChunks

STEPS = 200


class CheapChunks(StreamChunks):
    """The real worker split and per-step items, with chunks made of nothing (no shard is read)."""

    def _chunk(self, step, stream, source, handler, decoded_in):
        size = self.settings.chunk_size
        return Chunk(step, stream, torch.full((size, 3, 2, 2), stream, dtype=torch.uint8),
                     torch.full((size, 4), step), (0, step), 0)


class WatchedAssembler(Assembler):
    most_waiting = 0

    def batches(self, items):
        for batch in super().batches(items):
            WatchedAssembler.most_waiting = max(WatchedAssembler.most_waiting, self.waiting)
            yield batch


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # more workers than this machine's cores
@pytest.mark.parametrize("workers", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("streams", [1, 2, 3, 4, 5, 7])
def test_any_streams_over_any_workers_keeps_the_waiting_chunks_bounded(streams, workers, monkeypatch):
    monkeypatch.setattr(loop, "StreamChunks", CheapChunks)
    monkeypatch.setattr(loop, "Assembler", WatchedAssembler)
    WatchedAssembler.most_waiting = 0
    config = load_config(overrides=[f"train.data_streams={streams}", f"train.workers={workers}",
                                    f"train.batch_size={2 * streams}", "train.data_timeout_s=60"])
    setup = SimpleNamespace(env=SimpleNamespace(rank=0, world_size=1), device=torch.device("cpu"), images=None,
                            tokenizer=None)
    batches = loop._batches(config, setup, [f"shard-{i}.tar" for i in range(streams)], loop.TrainingState())
    try:
        for step in range(STEPS):
            batch = next(batches)
            assert batch.step == step
            assert batch.images[:, 0, 0, 0].tolist() == [v for v in range(streams) for _ in range(2)]  # stream order
            assert bool((batch.tokens == step).all())
    finally:
        batches.close()
    # at most one step's chunks of the workers other than the one that completes the batch
    assert WatchedAssembler.most_waiting <= max(streams - 1, 0), WatchedAssembler.most_waiting
