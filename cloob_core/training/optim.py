"""The paper's optimiser recipe: AdamW without decay on gains, biases and the temperature, and a cosine
schedule with linear warmup and hard restarts (paper §5.1, following open_clip)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from timm.scheduler import CosineLRScheduler
from torch import nn

from cloob_core.config import ConfigError, OptimConfig


def exempt_from_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Gains and biases (every parameter of fewer than two dims) and the temperature get no decay."""
    return param.ndim < 2 or name.endswith(".bias") or "logit_scale" in name


def build_optimizer(model: nn.Module, config: OptimConfig, objective: nn.Module | None = None) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters and the objective's own (SigLIP's bias), decay as exempted."""
    decayed, exempt = [], []
    named = [*model.named_parameters(), *(objective.named_parameters() if objective is not None else ())]
    for name, param in named:
        if param.requires_grad:
            (exempt if exempt_from_weight_decay(name, param) else decayed).append(param)
    if not decayed and not exempt:  # what the configuration check cannot see (an architecture locked whole)
        raise ConfigError("nothing would train: no parameter of the model or the objective takes a gradient (both "
                          "towers locked, a fixed model.inv_tau); unlock a tower or set model.learn_inv_tau true")
    groups = [{"params": exempt, "weight_decay": 0.0}, {"params": decayed, "weight_decay": config.weight_decay}]
    options = {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps}
    try:
        # One fused kernel for all parameters, on CUDA and on the CPU (6x faster than the per-parameter loop,
        # the CPU default, on 2 cores); deterministic.
        return torch.optim.AdamW(groups, fused=True, **options)
    except RuntimeError:  # a device or dtype without a fused kernel
        return torch.optim.AdamW(groups, foreach=True, **options)


@dataclass(frozen=True)
class Schedule:
    """The schedule a run of ``total`` steps gets from the configuration: ``warmup`` steps of linear warm-up, then
    ``cycles`` cosine cycles of ``cycle_steps`` with hard restarts. ``problem``: how it differs from the configured
    one (a warm-up cut to half the run), or None."""

    warmup: int
    cycles: int
    cycle_steps: int
    total: int
    problem: str | None = None

    def describe(self, lr: float) -> str:
        cycles = "one cosine cycle" if self.cycles == 1 else f"{self.cycles} cosine cycles with hard restarts"
        return (f"{self.warmup} warm-up step(s) to lr {lr:g}, then {cycles} of {self.cycle_steps} step(s), "
                f"{self.total} steps in all")


def plan_schedule(config: OptimConfig, total_steps: int) -> Schedule:
    """The configured schedule over a run of ``total_steps``, with a warm-up of at most half the run. A longer
    warm-up (237 pairs for 40 epochs at the defaults: 74 steps against 200) would leave the rate below
    ``optim.lr`` for the whole run, or nearly; it is cut to half the run, and ``problem`` says so. A run at least
    twice its warm-up runs it as configured, so runs of any such length share their first steps. The length of a
    run cannot change when it resumes (``checkpoint.run_keys``), so its schedule is the same after a resume."""
    warmup, cycles = config.warmup_steps, config.lr_cycles
    problem = None
    if warmup > total_steps // 2:
        problem = (f"optim.warmup_steps {warmup} is more than half of this run's {total_steps} steps: warming up for "
                   f"{total_steps // 2} instead, so that the rate reaches optim.lr and decays over the other half "
                   f"(set optim.warmup_steps to about {max(total_steps // 10, 1)}, a tenth of the run, to keep more "
                   "of it at the peak)")
        warmup = total_steps // 2
    decay = max(total_steps - warmup, 1)
    return Schedule(warmup, cycles, max(decay // cycles, 1), total_steps, problem)


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: Schedule) -> CosineLRScheduler:
    """Per-step schedule (:func:`plan_schedule`): linear warm-up, then cosine cycles to zero that share the
    remaining steps, each restarting at the peak rate (hard restarts). Drive it with
    ``scheduler.step_update(step)``; it is a pure function of the step, so resuming needs only the step."""
    return CosineLRScheduler(
        optimizer,
        t_initial=schedule.cycle_steps,
        lr_min=0.0,
        cycle_limit=schedule.cycles,
        warmup_t=schedule.warmup,
        warmup_lr_init=0.0,
        warmup_prefix=True,
        t_in_epochs=False,
    )


def first_restart(config: OptimConfig, total_steps: int) -> int | None:
    """The step at which the schedule's first hard restart happens (None: a single cycle): the end of the paper's
    reference epoch for Fig. 2."""
    schedule = plan_schedule(config, total_steps)
    if schedule.cycles <= 1:
        return None
    return schedule.warmup + schedule.cycle_steps
