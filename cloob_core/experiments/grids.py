"""The named grids of ``cloob experiment``: each cell is a set of overrides of the run's configuration, trained
with the same data, steps, schedule and encoders as every other cell of its grid."""

from __future__ import annotations

from dataclasses import dataclass, field

from cloob_core.config import ConfigError


@dataclass(frozen=True)
class Grid:
    name: str
    description: str
    cells: dict[str, tuple[str, ...]]
    quick: tuple[str, ...] = field(default=())  # overrides of a --quick run (a smoke test of the grid, in CI)
    prepared: bool = False  # its cells and data are built by the experiment (grid.PREPARED), not listed here


QUICK = ("train.steps=24", "optim.warmup_steps=4", "train.batch_size=64")
# The sweep is centred on the recipe as it stood when the sweep chose the defaults: 50 warm-up steps. Its
# ``warmup200`` cell is today's default; pinning the centre keeps a rerun the same experiment as reports/sweep.
SWEEP_CENTRE = ("optim.warmup_steps=50", "objective.start_without_hopfield=0")
# The paper's objectives as the paper trains them: Hopfield retrieval from the first step (the default now starts
# without it for the warm-up: docs/objectives.md, "Collapse"); reports/ablation was measured so.
PAPERS_START = ("objective.start_without_hopfield=0",)

GRIDS: dict[str, Grid] = {grid.name: grid for grid in (
    Grid("ablation", "the paper's ablation of objectives (Table 2; Fig. 2, A1): InfoNCE and InfoLOOB, each "
         "without and with Hopfield retrieval",
         {name: (f"train.objective={name}", *PAPERS_START)
          for name in ("clip", "infoloob", "infonce_hopfield", "cloob")},
         quick=QUICK),
    Grid("objectives", "the objective families side by side: CLOOB, InfoLOOB, CLIP's InfoNCE and SigLIP's sigmoid "
         "loss (SigLIP as its paper trains it: a learnt 1/tau from 10 and a learnt bias from -10)",
         {"cloob": ("train.objective=cloob",), "infoloob": ("train.objective=infoloob",),
          "clip": ("train.objective=clip",),
          "siglip": ("train.objective=siglip", "model.inv_tau=10", "model.learn_inv_tau=true")},
         quick=QUICK),
    Grid("sweep", "the recipe sweep behind the pipeline's defaults: around them, the learning rate and warm-up, "
         "fixed or learnt 1/tau, beta, the length and the restarts, for CLOOB and CLIP",
         {f"{objective}-{name}": (f"train.objective={objective}", *SWEEP_CENTRE, *overrides)
          for objective in ("cloob", "clip")
          for name, overrides in (
              ("default", ()),
              ("lr3e-4", ("optim.lr=0.0003",)),
              ("lr3e-3", ("optim.lr=0.003",)),
              ("warmup10", ("optim.warmup_steps=10",)),
              ("warmup200", ("optim.warmup_steps=200",)),
              ("learnt-tau", ("model.learn_inv_tau=true",)),
              ("beta4", ("objective.beta=4.0",)),
              ("beta14", ("objective.beta=14.3",)),
              ("epochs20", ("train.epochs=20",)),
              ("epochs80", ("train.epochs=80",)),
              ("no-restart", ("optim.lr_cycles=1",)),
              ("4-cycles", ("optim.lr_cycles=4",)),
          ) if objective == "cloob" or not name.startswith("beta")},
         quick=QUICK),
    Grid("curation", "the benefit of curation: a scorer trained on one half of the captioned pairs curates the "
         "other half, 30% of whose captions were swapped; CLOOB on it noisy, curated (top 70%) and clean",
         {}, prepared=True),
)}


def grid_named(name: str) -> Grid:
    if name not in GRIDS:
        raise ConfigError(f"no grid {name!r}; there are {', '.join(GRIDS)}")
    return GRIDS[name]
