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


class LargeChunks(StreamChunks):
    """Chunks of 224-px images (2.4 MB each): past ``SHARED_BYTES``, so they travel in shared memory."""

    def _chunk(self, step, stream, source, handler, decoded_in):
        size = self.settings.chunk_size
        pixels = torch.arange(size * 224 * 224 * 3, dtype=torch.int64).remainder(251).to(torch.uint8)
        images = (pixels.reshape(size, 224, 224, 3) + stream).permute(0, 3, 1, 2)  # channels-last, as crops are
        return Chunk(step, stream, images, torch.full((size, 4), step), (0, step), 0)


def test_large_chunks_reach_the_main_process_in_shared_memory_intact_and_channels_last(monkeypatch):
    from cloob_core.training.streams import SHARED_BYTES

    monkeypatch.setattr(loop, "StreamChunks", LargeChunks)
    config = load_config(overrides=["train.data_streams=4", "train.workers=2", "train.batch_size=64",
                                    "train.data_timeout_s=60"])
    setup = SimpleNamespace(env=SimpleNamespace(rank=0, world_size=1), device=torch.device("cpu"), images=None,
                            tokenizer=None)
    batches = loop._batches(config, setup, [f"shard-{i}.tar" for i in range(4)], loop.TrainingState())
    expected = torch.arange(16 * 224 * 224 * 3, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(
        16, 224, 224, 3)
    try:
        for step in range(3):
            batch = next(batches)
            assert batch.images.shape == (64, 3, 224, 224) and SHARED_BYTES <= 16 * 224 * 224 * 3
            assert batch.images.is_contiguous(memory_format=torch.channels_last)
            for stream in range(4):
                got = batch.images[16 * stream : 16 * (stream + 1)].permute(0, 2, 3, 1)
                assert torch.equal(got, expected + stream), (step, stream)
    finally:
        batches.close()
