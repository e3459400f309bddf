"""The run's shape: how many data streams make up each batch, and how many data-loader workers each rank runs.

Explicit numbers are kept as configured (and checked by ``TrainConfig.shape_problem``). ``auto``:

- on the CPU, today's 8 streams and 2 workers: the step itself takes the cores (cloob_core/threads.py);
- on GPUs the step runs on the device and the workers decode on the host, so a rank gets one worker per core of
  its share (``usable_cores() / local ranks``) and one stream per worker. The streams must divide the batch and
  split evenly over the ranks, so the count is the valid one nearest the cores (the smallest not below them,
  while that is at most twice the cores; else the largest below). A rank's workers then split its streams
  evenly: a worker with one stream more than another would set the pace of every step.

Either way the count is capped by the shards (a stream reads whole shards), and the resolved numbers are what
the checkpoint records: an ``auto`` run resumed on other hardware may get another count, and then continues as
:func:`cloob_core.training.streams.carry_positions` says.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from cloob_core.config import CPU_DATA_STREAMS, ConfigError, TrainConfig

log = logging.getLogger(__name__)
CPU_WORKERS = 2


@dataclass(frozen=True)
class RunShape:
    streams: int  # data streams of the whole run
    workers: int  # data-loader workers of each rank


def run_shape(train: TrainConfig, *, device_type: str, ranks: int, cores_per_rank: int, shards: int) -> RunShape:
    """The streams and workers of a run of ``ranks`` ranks on ``device_type`` (``auto`` resolved, see the module)."""
    if train.data_streams != "auto":
        streams = train.data_streams
    else:
        target = CPU_DATA_STREAMS if device_type == "cpu" else ranks * cores_per_rank
        streams = _valid_streams(train.batch_size, ranks, min(target, shards), shards)
    per_rank = streams // ranks
    if train.workers != "auto":
        workers = train.workers
    elif device_type == "cpu":
        workers = min(CPU_WORKERS, per_rank)
    else:
        workers = per_rank // math.ceil(per_rank / max(cores_per_rank, 1))  # an equal number of streams each
    return RunShape(streams, workers)


def _valid_streams(batch_size: int, ranks: int, target: int, shards: int) -> int:
    """The stream count nearest ``target`` that divides the batch, is a multiple of the ranks and has a shard
    per stream."""
    valid = [s for s in range(ranks, min(batch_size, shards) + 1, ranks) if batch_size % s == 0]
    if not valid:
        raise ConfigError(f"{shards} shard(s) cannot feed {ranks} rank(s) a data stream each with a batch of "
                          f"{batch_size}; write smaller shards (preprocess.shard_size) or use fewer ranks")
    above = [s for s in valid if target <= s <= 2 * max(target, 1)]
    return above[0] if above else max(s for s in valid if s <= max(target, ranks))
