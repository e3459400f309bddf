"""The learning-rate schedule fitted to the run: a warm-up as long as the run (237 pairs for 40 epochs at the
defaults: 74 steps against 200 of warm-up) would never reach the configured rate, so it becomes a tenth of the run,
and the log says which schedule ran; a configuration that fits runs as configured."""

from __future__ import annotations

import pytest
import torch

from cloob_core.config import OptimConfig
from cloob_core.training.optim import Schedule, build_scheduler, first_restart, plan_schedule


def _rates(schedule, steps) -> list[float]:
    scheduler = build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), schedule)
    rates = []
    for step in steps:
        scheduler.step_update(step)
        rates.append(scheduler.optimizer.param_groups[0]["lr"])
    return rates


def test_a_schedule_that_fits_runs_as_configured():
    schedule = plan_schedule(OptimConfig(), 639)  # the pipeline's run
    assert (schedule.warmup, schedule.cycles, schedule.cycle_steps, schedule.adapted) == (200, 2, 219, None)
    assert first_restart(OptimConfig(), 639) == 419
    assert _rates(schedule, [200])[0] == pytest.approx(1e-3)
    assert "200 warm-up step(s) to lr 0.001, then 2 cosine cycles with hard restarts of 219" in \
        schedule.describe(1e-3)


def test_a_warm_up_as_long_as_the_run_becomes_a_tenth_of_it_and_says_so():
    schedule = plan_schedule(OptimConfig(), 74)
    assert (schedule.warmup, schedule.cycles, schedule.cycle_steps) == (7, 2, 33)
    assert "optim.warmup_steps 200 is not shorter than this run's 74 steps" in schedule.adapted
    peak, restart_before, restart = _rates(schedule, [7, 39, 40])
    assert peak == pytest.approx(1e-3)  # the configured rate is reached (before: 74/200 of it, at the last step)
    assert restart_before < 1e-4 and restart == pytest.approx(1e-3)
    # the configured schedule, unfitted, would have peaked at 37% of the rate at the run's last step
    assert max(_rates(Schedule(warmup=200, cycles=2, cycle_steps=1, total=74), range(74))) < 0.37e-3


def test_more_cycles_than_steps_become_one_step_each():
    schedule = plan_schedule(OptimConfig(warmup_steps=0, lr_cycles=10), 4)
    assert (schedule.cycles, schedule.cycle_steps) == (4, 1) and "optim.lr_cycles 10" in schedule.adapted


def test_training_logs_the_schedule_that_ran(mnist_train_shards, tmp_path, caplog):
    import logging

    from cloob_core.cli import main

    caplog.set_level(logging.INFO)
    assert main(["train", "--shards", str(mnist_train_shards), "--output", str(tmp_path / "run"), "--steps", "3",
                 "--set", "train.batch_size=8", "--set", "train.data_streams=1", "--set", "train.workers=0"]) == 0
    assert "optim.warmup_steps 200 is not shorter than this run's 3 steps" in caplog.text
    assert "schedule: 0 warm-up step(s) to lr 0.001, then 2 cosine cycles with hard restarts of 1 step(s), 3 " \
        "steps in all" in caplog.text
