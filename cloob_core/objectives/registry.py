"""Building an objective by name (:mod:`cloob_core.objectives.names`), with the settings of a configuration."""

from __future__ import annotations

import math
from typing import Any

from cloob_core.objectives import losses
from cloob_core.objectives.names import OBJECTIVES, unknown


def objective_class(name: str) -> type[losses.ContrastiveObjective]:
    if name not in OBJECTIVES:
        raise ValueError(unknown(name))
    return getattr(losses, OBJECTIVES[name].class_name)


def objective_options(name: str, config: Any, warmup_steps: int | None = None) -> dict[str, Any]:
    """The settings of a :class:`~cloob_core.config.CloobConfig` that objective ``name`` takes: ``beta`` and the start
    without retrieval for the Hopfield ones, the band and queue for the restricted ones, the views for the poly-view
    ones. ``warmup_steps``: the run's warm-up as its schedule has it (``optim.warmup_steps`` when not given), which
    ``objective.start_without_hopfield: warmup`` means."""
    cls = objective_class(name)
    o, t = config.objective, config.train
    options: dict[str, Any] = {}
    if cls.takes_beta:
        options["beta"] = o.beta
        start = o.start_without_hopfield
        least = (config.optim.warmup_steps if warmup_steps is None else warmup_steps) if start == "warmup" else start
        options.update(start_without_hopfield=least, start_until_margin=o.start_until_margin,
                       start_longest=math.ceil(least * o.start_limit_factor))
    if cls.takes_band:
        options.update(p_in=o.p_in, p_out=o.p_out, anneal_steps=o.anneal_steps, anneal_inner=o.anneal_inner,
                       queue_size=o.queue_size, ranking=o.ranking)
    if cls.takes_bias:
        options["bias_init"] = o.siglip_bias_init
    if OBJECTIVES[name].poly_view:
        options.update(image_views=t.image_views, text_views=t.text_views)
        if cls.takes_leave_one_out:
            options["leave_one_out"] = o.leave_one_out
    return options


def objective_from_config(config: Any, warmup_steps: int | None = None) -> losses.ContrastiveObjective:
    """The objective ``train.objective`` with its settings from ``objective.*`` and ``train.*_views``."""
    return build_objective(config.train.objective, local_loss=config.train.local_loss,
                           **objective_options(config.train.objective, config, warmup_steps))


def build_objective(name: str, *, local_loss: bool = False, **options: Any) -> losses.ContrastiveObjective:
    """Instantiate an objective by name; an unknown name, or an option the objective does not take, fails.
    ``local_loss``: under DDP each rank computes the terms of its own rows (:mod:`.anchors`)."""
    cls = objective_class(name)
    try:
        objective = cls(**options)
    except TypeError as err:
        raise ValueError(f"objective {name!r} does not take options {sorted(options)}: {err}") from None
    objective.local_loss = local_loss
    return objective
