"""The learning-rate schedule and what the log says of it: the schedule that ran, always; and a warm-up longer than
half the run (237 pairs for 40 epochs at the defaults: 74 steps against 200 of warm-up), which would keep the rate
under optim.lr, cut to half the run and said so. A run at least twice its warm-up runs the configured one, so such
runs share their first steps whatever their length."""

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
    assert plan_schedule(OptimConfig(), 400).problem is None  # exactly twice the warm-up


@pytest.mark.parametrize("steps", [74, 13, 399, 2])
def test_a_warm_up_longer_than_half_the_run_is_cut_to_half_and_reaches_the_peak(steps):
    schedule = plan_schedule(OptimConfig(), steps)
    assert schedule.warmup == steps // 2
    assert f"optim.warmup_steps 200 is more than half of this run's {steps} steps" in schedule.problem
    rates = _rates(schedule, range(steps))
    assert max(rates) == pytest.approx(1e-3)  # the configured rate is reached ...
    assert rates.index(max(rates)) == steps // 2  # ... at the end of the warm-up
    if steps >= 13:  # and then it decays, over the other half
        assert rates[-1] < 0.5e-3


def test_runs_at_least_twice_the_warm_up_share_their_first_steps():
    short, long = plan_schedule(OptimConfig(), 400), plan_schedule(OptimConfig(), 3000)
    assert _rates(short, range(200)) == _rates(long, range(200))


def test_training_logs_the_schedule_that_ran(mnist_train_shards, tmp_path, caplog):
    import logging

    from cloob_core.cli import main

    caplog.set_level(logging.INFO)
    assert main(["train", "--shards", str(mnist_train_shards), "--output", str(tmp_path / "run"), "--steps", "4",
                 "--set", "train.batch_size=8", "--set", "train.data_streams=1", "--set", "train.workers=0"]) == 0
    assert "optim.warmup_steps 200 is more than half of this run's 4 steps: warming up for 2 instead" in caplog.text
    assert "schedule: 2 warm-up step(s) to lr 0.001, then 2 cosine cycles with hard restarts of 1 step(s), 4 " \
        "steps in all" in caplog.text
