"""``auto`` data streams and workers: today's 8 and 2 on the CPU; on GPUs a worker per core of the rank's share,
its streams split evenly, every count dividing the batch and capped by the shards."""

from __future__ import annotations

import pytest

from cloob_core.config import ConfigError, load_config
from cloob_core.training.shape import RunShape, run_shape


def shape(device: str, ranks: int, cores: int, shards: int = 1000, *overrides: str) -> RunShape:
    train = load_config(overrides=list(overrides)).train
    return run_shape(train, device_type=device, ranks=ranks, cores_per_rank=cores, shards=shards)


@pytest.mark.parametrize(("device", "ranks", "cores", "batch", "expected"), [
    ("cpu", 1, 2, 128, RunShape(8, 2)),  # the laptop: as before
    ("cpu", 2, 1, 128, RunShape(8, 2)),
    ("cuda", 1, 16, 256, RunShape(16, 16)),  # one H100 pod with 16 cores
    ("cuda", 8, 12, 2048, RunShape(128, 8)),  # 16 streams a rank over 12 cores: 8 workers of 2 streams each
    ("cuda", 8, 16, 4096, RunShape(128, 16)),
    ("cuda", 4, 6, 96, RunShape(24, 6)),
    ("cuda", 1, 10, 100, RunShape(10, 10)),
    ("cuda", 2, 3, 4, RunShape(4, 2)),  # as many streams as the batch allows
])
def test_auto_shapes(device, ranks, cores, batch, expected):
    got = shape(device, ranks, cores, 1000, f"train.batch_size={batch}")
    assert got == expected
    assert batch % got.streams == 0 and got.streams % ranks == 0 and (got.streams // ranks) % got.workers == 0


def test_the_shards_cap_the_streams_and_too_few_are_refused_in_one_line():
    assert shape("cuda", 1, 16, 12, "train.batch_size=256") == RunShape(8, 8)
    assert shape("cpu", 1, 2, 3, "train.batch_size=128") == RunShape(2, 2)
    with pytest.raises(ConfigError, match="3 shard\\(s\\) cannot feed 4 rank\\(s\\)"):
        shape("cuda", 4, 8, 3, "train.batch_size=128")


def test_explicit_numbers_are_kept():
    assert shape("cuda", 1, 16, 1000, "train.data_streams=4", "train.workers=3") == RunShape(4, 3)
    assert shape("cuda", 2, 16, 1000, "train.data_streams=4") == RunShape(4, 2)  # workers auto: 2 streams a rank
