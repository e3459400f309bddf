"""Every split of a rank's data streams over its data-loader workers feeds the loop in step order with a bounded
number of chunks waiting (issue: 3 streams on 2 workers grew by one chunk a step and, through the CLI, stalled)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cloob_core.config import load_config
from cloob_core.training import loop
from cloob_core.training.images import TrainImages
from cloob_core.training.streams import Assembler, Chunk, StreamChunks

STEPS = 200


class CheapChunks(StreamChunks):
    """The real worker split and per-step items, with chunks made of nothing (no shard is read): each image is
    its stream's number, each token its step."""

    def _chunk(self, step, stream, source, handler, decoded_in):
        size, place = self.settings.chunk_size, self.start.owned.index(stream)
        self.ring.write(step, place * size, [np.full((2, 2, 3), stream, dtype=np.uint8)] * size, place * size,
                        torch.full((size, 4), step))
        return Chunk(step, stream, (0, step), 0)


class WatchedAssembler(Assembler):
    most_waiting = 0

    def batches(self, items):
        for batch in super().batches(items):
            WatchedAssembler.most_waiting = max(WatchedAssembler.most_waiting, self.waiting)
            yield batch


def _setup(size: int = 2) -> SimpleNamespace:
    return SimpleNamespace(env=SimpleNamespace(rank=0, world_size=1), device=torch.device("cpu"),
                           images=TrainImages(size), tokenizer=lambda texts: torch.zeros(len(texts), 4))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # more workers than this machine's cores
@pytest.mark.parametrize("workers", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("streams", [1, 2, 3, 4, 5, 7])
def test_any_streams_over_any_workers_keeps_the_waiting_chunks_bounded(streams, workers, monkeypatch):
    monkeypatch.setattr(loop, "StreamChunks", CheapChunks)
    monkeypatch.setattr(loop, "Assembler", WatchedAssembler)
    WatchedAssembler.most_waiting = 0
    config = load_config(overrides=[f"train.data_streams={streams}", f"train.workers={workers}",
                                    f"train.batch_size={2 * streams}", "train.data_timeout_s=60"])
    batches = loop._batches(config, _setup(), [f"shard-{i}.tar" for i in range(streams)], loop.TrainingState())
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
    """Chunks of 224-px crops, each pixel a function of its place, stream and step."""

    def _chunk(self, step, stream, source, handler, decoded_in):
        size, place = self.settings.chunk_size, self.start.owned.index(stream)
        views = list(_pixels(size) + stream + step)
        self.ring.write(step, place * size, views, place * size, torch.full((size, 4), step))
        return Chunk(step, stream, (0, step), 0)


def _pixels(size: int) -> np.ndarray:
    return (np.arange(size * 224 * 224 * 3, dtype=np.int64) % 251).astype(np.uint8).reshape(size, 224, 224, 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_is_intact_channels_last_and_stays_so_until_the_next_is_asked_for(workers, monkeypatch):
    """The workers write into the ring's slots while the main process holds a batch: a slot is not written again
    before the main process asks for the next batch, however far ahead the workers are (here the main process
    dawdles for 20 ms a step, the workers do not, and the ring is smaller than the DataLoader's prefetch)."""
    monkeypatch.setattr(loop, "StreamChunks", LargeChunks)
    monkeypatch.setattr(loop, "RING_SLOTS", 2)
    config = load_config(overrides=["train.data_streams=4", f"train.workers={workers}", "train.batch_size=64",
                                    "train.data_timeout_s=60", "train.prefetch=during_step"])  # workers not held
    batches = loop._batches(config, _setup(224), [f"shard-{i}.tar" for i in range(4)], loop.TrainingState())
    try:
        for step in range(12):  # each slot written six times
            batch = next(batches)
            assert batch.images.shape == (64, 3, 224, 224)
            assert batch.images.is_contiguous(memory_format=torch.channels_last)
            time.sleep(0.02)
            images, tokens = batch.to(torch.device("cpu"))
            for stream in range(4):
                got = images[16 * stream : 16 * (stream + 1)].permute(0, 2, 3, 1).numpy()
                assert np.array_equal(got, _pixels(16) + stream + step), (step, stream)
            assert bool((tokens == step).all())
    finally:
        batches.close()


def test_a_shared_memory_too_small_for_the_batch_ring_is_one_line_before_training(mnist_train_shards, tmp_path,
                                                                                   monkeypatch, capsys):
    """A container's default /dev/shm (64 MiB) cannot hold a GPU batch's ring; writing past it would end the run
    with SIGBUS, so the run refuses before its first step, naming what to change."""
    import shutil

    from cloob_core.cli import main
    from cloob_core.training import batch_ring

    usage = shutil.disk_usage(batch_ring.SHARED_MEMORY)
    monkeypatch.setattr(batch_ring.shutil, "disk_usage", lambda folder: usage._replace(free=1 << 20))
    code = main(["train", "--shards", str(mnist_train_shards), "--output", str(tmp_path / "run"), "--no-progress",
                 "--no-tensorboard", "--steps", "2", "--batch-size", "64", "--workers", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "MiB of shared memory" in err[0] and "--shm-size" in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
