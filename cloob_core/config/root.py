"""The configuration's one tree (:class:`CloobConfig`, its sections and the checks across them) and the named
recipes (``--preset``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from cloob_core.config.base import _Section
from cloob_core.config.curation import CurationConfig
from cloob_core.config.data import AcquireConfig, DownloadConfig, EngineConfig, PreprocessConfig, ValidationConfig
from cloob_core.config.eval import SUITE_RESULT, EvalConfig
from cloob_core.config.promote import PromoteConfig
from cloob_core.config.train import ModelConfig, ObjectiveConfig, OptimConfig, TrainConfig
from cloob_core.objectives.names import OBJECTIVES, POLY_VIEW_OBJECTIVES

# Named recipes of the paper (§5.1 CC3M, §5.2 YFCC; App. A.2.2). ``--preset`` applies them over the params file
# and under --set overrides.
# Cycles: restarts every ~7 epochs (App. A.2.2), over 31 epochs on CC3M (Table A1) and 28 on YFCC (§5.2).
PRESETS: dict[str, dict[str, Any]] = {
    "cc3m": {"train.batch_size": 512, "optim.lr": 1e-3, "optim.warmup_steps": 20_000, "objective.beta": 8.0,
             "model.architecture": "RN50", "train.epochs": 31, "optim.lr_cycles": 4},
    "yfcc": {"train.batch_size": 1024, "optim.lr": 5e-4, "optim.warmup_steps": 10_000, "objective.beta": 14.3,
             "model.architecture": "RN50", "train.epochs": 28, "optim.lr_cycles": 4},
    # The ViT-B family (ViT-B-32, ViT-B-16 with --architecture): open_clip's ViT-B-32 optimiser recipe (lr 5e-4,
    # 2,000 warm-up steps, weight decay 0.2, one cosine without restarts; beta2 0.98 and eps 1e-6 are the defaults),
    # with the default start without Hopfield retrieval. Wide towers need the lower rate besides the start, and a
    # restart's return to the full rate is where runs fell back into the collapsed fixed point (docs/objectives.md,
    # "Collapse").
    "vit-b": {"model.architecture": "ViT-B-32", "optim.lr": 5e-4, "optim.warmup_steps": 2_000,
              "optim.weight_decay": 0.2, "optim.lr_cycles": 1},
    # ViT-B-32 from scratch on a CPU, the cheapest configuration found in which CLIP learns on it (about 10 s a
    # step on two cores, 20 minutes a run): at open_clip's rate ramped over a few steps both CLIP and CLOOB pull
    # the towers into one direction; at this one both leave their collapsed values (docs/objectives.md, "ViT-B-32
    # itself, on this CPU").
    "vit-b-cpu": {"model.architecture": "ViT-B-32", "train.batch_size": 32, "optim.lr": 1e-4,
                  "optim.warmup_steps": 10, "optim.lr_cycles": 1, "train.steps": 120},
}


class CloobConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig)
    acquire: AcquireConfig = Field(default_factory=AcquireConfig)
    download: DownloadConfig = Field(default_factory=DownloadConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    curation: CurationConfig = Field(default_factory=CurationConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    promote: PromoteConfig = Field(default_factory=PromoteConfig)

    @model_validator(mode="after")
    def _views_need_a_poly_view_objective(self) -> CloobConfig:
        views = (self.train.image_views, self.train.text_views)
        if views != (1, 1) and self.train.objective not in POLY_VIEW_OBJECTIVES:
            raise ValueError(f"train.image_views / text_views {views} need a poly-view objective "
                             f"({', '.join(POLY_VIEW_OBJECTIVES)}), not {self.train.objective!r}")
        return self

    @model_validator(mode="after")
    def _something_trains(self) -> CloobConfig:
        """Both towers locked whole, a fixed temperature and an objective without parameters of its own leave
        the optimiser nothing: refused here, before a model or a shard is read."""
        train = self.train
        image_locked = train.lock_image and not train.lock_image_unlocked_groups
        text_locked = train.lock_text and not train.lock_text_unlocked_layers
        if image_locked and text_locked and not self.model.learn_inv_tau and not OBJECTIVES[train.objective].learns:
            raise ValueError("nothing would train: train.lock_image and train.lock_text lock both towers whole, "
                             "model.inv_tau is fixed and the objective has no parameters of its own; unlock a "
                             "tower (drop a lock, or set train.lock_image_unlocked_groups / "
                             "train.lock_text_unlocked_layers) or set model.learn_inv_tau true")
        return self

    @model_validator(mode="after")
    def _evaluation_while_training_names_the_suites_sets(self) -> CloobConfig:
        train = self.train
        if not train.eval_every:
            return self
        if not train.eval_datasets:
            raise ValueError("train.eval_every needs train.eval_datasets: names of the eval.datasets to evaluate")
        unknown_sets = [name for name in train.eval_datasets if name not in self.eval.datasets]
        if unknown_sets:
            raise ValueError(f"train.eval_datasets {unknown_sets} are not in eval.datasets "
                             f"({', '.join(self.eval.datasets)})")
        if train.eval_every % train.checkpoint_every:
            raise ValueError(f"train.eval_every {train.eval_every} must be a multiple of train.checkpoint_every "
                             f"{train.checkpoint_every}: a step evaluated is one with a checkpoint")
        return self

    @model_validator(mode="after")
    def _promotion_reads_the_suite(self) -> CloobConfig:
        written = self.eval.metric_names()
        for where, metric in (("promote.metric", self.promote.metric),
                              *((f"promote.guards.{key}", key) for key in self.promote.guards),
                              *((f"promote.min_first.{key}", key) for key in self.promote.min_first)):
            result, _, key = metric.partition(".")
            if not key:
                raise ValueError(f"{where}: {metric!r} is not RESULT.KEY")
            if result == SUITE_RESULT and key not in self.eval.aggregates:
                setting = ".".join(where.split(".")[:2])
                raise ValueError(f"{where}: {metric!r} names no aggregate of eval.aggregates "
                                 f"({', '.join(self.eval.aggregates) or 'none'}); name in {setting} a metric "
                                 "this suite writes")
            if result not in written:
                raise ValueError(f"{where}: {metric!r}: the eval suite writes no result {result!r} (it writes "
                                 f"{', '.join(sorted(written))})")
        return self
