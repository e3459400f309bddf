"""The learning-rate schedule and what the log says of it: the schedule that ran, always; and a warm-up as long as
the run (237 pairs for 40 epochs at the defaults: 74 steps against 200 of warm-up), which never reaches the
configured rate, named with the value that fits. The warm-up does not depend on the run's length, so a longer or
resumed run repeats the same first steps."""

from __future__ import annotations

import pytest
import torch

from cloob_core.config import OptimConfig
from cloob_core.training.optim import build_scheduler, first_restart, plan_schedule


def _rates(schedule, steps) -> list[float]:
    scheduler = build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), schedule)
    rates = []
    for step in steps:
        scheduler.step_update(step)
        rates.append(scheduler.optimizer.param_groups[0]["lr"])
    return rates


def test_a_schedule_that_fits_runs_as_configured():
    schedule = plan_schedule(OptimConfig(), 639)  # the pipeline's run
    assert (schedule.warmup, schedule.cycles, schedule.cycle_steps, schedule.problem) == (200, 2, 219, None)
    assert first_restart(OptimConfig(), 639) == 419
    assert _rates(schedule, [200])[0] == pytest.approx(1e-3)
    assert "200 warm-up step(s) to lr 0.001, then 2 cosine cycles with hard restarts of 219" in \
        schedule.describe(1e-3)


def test_a_warm_up_as_long_as_the_run_is_named_with_the_value_that_fits():
    schedule = plan_schedule(OptimConfig(), 74)
    assert "optim.warmup_steps 200 is not shorter than this run's 74 steps" in schedule.problem
    assert "peaks at 37% of it" in schedule.problem and "about 7" in schedule.problem
    assert max(_rates(schedule, range(74))) < 0.37e-3  # what the problem says
    fitted = plan_schedule(OptimConfig(warmup_steps=7), 74)
    assert fitted.problem is None and _rates(fitted, [7])[0] == pytest.approx(1e-3)


def test_the_warm_up_is_the_same_whatever_the_runs_length():
    short, long = plan_schedule(OptimConfig(), 300), plan_schedule(OptimConfig(), 3000)
    assert _rates(short, range(200)) == _rates(long, range(200))


def test_training_logs_the_schedule_that_ran(mnist_train_shards, tmp_path, caplog):
    import logging

    from cloob_core.cli import main

    caplog.set_level(logging.INFO)
    assert main(["train", "--shards", str(mnist_train_shards), "--output", str(tmp_path / "run"), "--steps", "3",
                 "--set", "train.batch_size=8", "--set", "train.data_streams=1", "--set", "train.workers=0"]) == 0
    assert "optim.warmup_steps 200 is not shorter than this run's 3 steps" in caplog.text
    assert "schedule: 200 warm-up step(s) to lr 0.001, then 2 cosine cycles with hard restarts of 1 step(s), 3 " \
        "steps in all" in caplog.text
