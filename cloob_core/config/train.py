"""The training run's sections: the model, the objective, the optimiser and ``train``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cloob_core.config.base import ConfigError, _Section
from cloob_core.objectives.names import OBJECTIVE_NAMES, unknown


class ModelConfig(_Section):
    architecture: str = Field(
        "cloob-tiny",
        description="open_clip config name: RN50, RN101, RN50x4, ViT-B-32 (paper) or cloob-tiny (CPU demo).",
    )
    inv_tau: float = Field(
        30.0,
        ge=1.0,
        le=100.0,
        description="Inverse temperature 1/tau of the objectives; fixed at 30 in the paper (§5.1, App. A.2.2).",
    )
    learn_inv_tau: bool = Field(
        False,
        description="Learn inv_tau (clamped to [1, 100]); the paper fixes it because learnable inv_tau "
        "with InfoLOOB misbehaves (App. A.1.4).",
    )


class ObjectiveConfig(_Section):
    """Hyperparameters of the objectives; which one trains is ``train.objective``."""

    beta: float = Field(
        8.0,
        gt=0.0,
        description="Inverse temperature of the Hopfield retrieval; 8 for CC3M, 14.3 for YFCC (paper §5.1-5.2). "
        "Used by the Hopfield objectives only.",
    )
    start_without_hopfield: int | Literal["warmup"] = Field(
        "warmup", description="Hopfield objectives (cloob, cloob_ring, infonce_hopfield): the first steps train the "
        "same objective on the encoders' embeddings, without retrieval (InfoLOOB for CLOOB), so that towers starting "
        "in a narrow cone (ViTs, RN50) leave it before retrieval averages them into the collapsed fixed point "
        "(docs/objectives.md, 'Collapse'). The start lasts at least this: warmup: the schedule's warm-up steps; a "
        "number: that many; 0: retrieval from the first step (the paper).")
    start_until_margin: float = Field(
        0.05, ge=0.0, lt=1.0, description="Hopfield objectives: after start_without_hopfield's steps the start goes "
        "on until a batch's loss is this fraction of the collapsed value below it (the run has left the collapsed "
        "value), for at most start_limit_factor times as many steps. 0: it ends at start_without_hopfield.")
    start_limit_factor: float = Field(
        3.0, ge=1.0, le=1000.0, allow_inf_nan=False, description="Hopfield objectives: the start without retrieval "
        "lasts at most this many times start_without_hopfield's steps, whatever the margin (at most 1000).")
    p_out: float = Field(0.1, gt=0.0, le=1.0, description="*_ring objectives (Wu et al.): each anchor keeps the "
                         "negatives ranked in its closest p_out fraction of candidates (BALL; paper: 10% on "
                         "CIFAR10, 0.3% on ImageNet).")
    p_in: float = Field(0.0, ge=0.0, lt=1.0, description="*_ring objectives: also cut the closest p_in fraction "
                        "(RING; near duplicates, often false negatives for web captions; paper: 1%). 0: BALL.")
    anneal_steps: int = Field(0, ge=0, description="*_ring objectives: p_out falls linearly from 100% to its "
                              "target over these optimiser steps, then holds (paper: half of training). 0: off.")
    anneal_inner: bool = Field(False, description="*_ring objectives: p_in also grows from 0 to its target over "
                               "anneal_steps.")
    queue_size: int = Field(0, ge=0, description="*_ring objectives: past embeddings kept as extra candidate "
                            "negatives (FIFO; never in a Hopfield memory), so percentages mean something at small "
                            "batches. 0: the batch only.")
    ranking: Literal["loss", "raw"] = Field("loss", description="*_ring objectives: rank negatives by the "
                                            "similarities the loss uses (Hopfield-retrieved for cloob_ring) or "
                                            "by the raw embeddings.")
    leave_one_out: bool = Field(False, description="Poly-view objectives (but suffstats): InfoLOOB's denominator "
                                "(positive left out, scaled by tau). Their MI bounds then no longer hold.")
    siglip_bias_init: float = Field(-10.0, allow_inf_nan=False, description="siglip: the starting value of its "
                                    "learnable logit bias b (paper: -10, with a learnable inverse temperature "
                                    "starting at 10: model.inv_tau 10, model.learn_inv_tau true).")

    @field_validator("start_without_hopfield")
    @classmethod
    def _steps_or_warmup(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be warmup or a number of steps >= 0")
        return value

    @model_validator(mode="after")
    def _band(self) -> ObjectiveConfig:
        if self.p_in >= self.p_out:
            raise ValueError(f"p_in ({self.p_in}) must be below p_out ({self.p_out})")
        return self


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0.0, description="AdamW peak learning rate; 1e-3 on CC3M (paper §5.1).")
    weight_decay: float = Field(
        0.1, ge=0.0, description="Decoupled weight decay, not applied to gains, biases, temperature (paper §5.1)."
    )
    beta1: float = Field(0.9, gt=0.0, lt=1.0, description="AdamW beta1 (open_clip default).")
    beta2: float = Field(0.98, gt=0.0, lt=1.0, description="AdamW beta2 (open_clip default for transformers).")
    eps: float = Field(1e-6, gt=0.0, description="AdamW epsilon (open_clip default for transformers).")
    warmup_steps: int = Field(200, ge=0, description="Linear warmup steps; the paper uses 20k on CC3M "
                              "(`--preset cc3m`); 200 of the CPU default's 639 steps converge CLOOB as well as "
                              "CLIP (docs/recipe.md).")
    lr_cycles: int = Field(
        2, ge=1, description="Cosine cycles with hard restarts (paper §5.1: cosine annealing with restarts; its "
        "Fig. 2 measures against the end of the first cycle)."
    )


CPU_DATA_STREAMS = 8  # what train.data_streams "auto" gives on the CPU: a shard per stream is needed for all of them


class ShardSource(_Section):
    """One source of a mixed run (``train.sources``): its shards and its weight."""

    shards: str = Field(description="A shard location as train.shards takes it.")
    weight: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="Its share of every batch, relative to "
                          "the other sources' weights (positive and finite).")


class TrainConfig(_Section):
    """``cloob train``: the loop around the objective. Optimiser and schedule live in ``optim``."""

    objective: str = Field("cloob", description="Objective from the registry: cloob, clip, infoloob, "
                           "infonce_hopfield (the paper's ablation grid); clip_ring, infoloob_ring, cloob_ring "
                           "(restricted negatives, objective.p_*); pvc_geometric, pvc_arithmetic, multicrop, "
                           "suffstats (poly-view, train.*_views).")
    image_views: int = Field(1, ge=1, le=16, description="Augmented image views drawn per sample (poly-view "
                             "objectives; 1 otherwise).")
    text_views: int = Field(1, ge=1, le=16, description="Captions drawn per sample (poly-view objectives; 1 "
                            "otherwise): distinct ones while the sample has enough, then repeats.")
    shards: str = Field("data/curated", description="Training shards: a folder with sizes.json (local or "
                        "s3://), a brace pattern or a .tar; from `cloob data download|shards|curate`. The default is "
                        "the DVC pipeline's curate stage's output, the downloaded shards as they are while "
                        "curation.enabled is false.")
    sources: list[ShardSource] = Field(default_factory=list, description="Several shard locations mixed by weight "
                                       "(in place of train.shards when given): each batch takes from each source "
                                       "its weight's share of the samples, as whole data streams (data_streams "
                                       "apportioned to the weights; the log and metrics.json give the realised "
                                       "shares).")
    allow_incomplete_shards: bool = Field(False, description="Train on a shard folder whose stats.json counts "
                                          "missing shards (partitions still downloading); refused otherwise.")
    batch_size: int = Field(128, ge=2, description="Global contrastive batch over all ranks (paper: 512 on CC3M, "
                            "1024 on YFCC).")
    epochs: float = Field(40.0, gt=0, description="Training length in passes over the shards' samples "
                          "(used when steps is 0); 40 converges every objective on the captioned default "
                          "(docs/recipe.md).")
    steps: int = Field(0, ge=0, description="Training length in optimiser steps; 0: from epochs.")
    accum_freq: int = Field(1, ge=1, description="Micro-batches per step; features are cached (as open_clip's "
                            "accum_freq) so the contrastive batch stays batch_size.")
    local_loss: bool = Field(False, description="With several ranks, each computes the loss terms of its own samples "
                             "against the gathered batch (O(n·N) per rank instead of O(N²); CLOOB retrieves for its "
                             "own queries and gathers the result): the same gradient, less memory and time at large "
                             "global batches (open_clip's --local-loss --gather-with-grad). The logged loss is rank "
                             "0's share.")
    data_streams: int | Literal["auto"] = Field(
        "auto", description="Independent shard streams making up each batch; must divide batch_size and be a "
        "multiple of the number of ranks. A number fixes the data order whatever the world size (resume exact on "
        "any ranks that divide it). auto: 8 on the CPU; on GPUs one per data-loader worker the cores allow "
        "(docs/training.md, \"The run's shape\").")
    workers: int | Literal["auto"] = Field(
        "auto", description="Data-loader worker processes per rank. auto: 2 on the CPU (the step takes the "
        "cores); on a GPU, the rank's share of the cores, as its streams split evenly.")
    prefetch: Literal["auto", "during_step", "between_steps"] = Field(
        "auto", description="When the workers prepare the next batch: during_step overlaps them with the step; "
        "between_steps holds them while it runs (on the CPU a worker that wakes mid-step stalls the step's "
        "threads); auto: on the CPU, whichever of the two the run measures faster, on a GPU during_step "
        "(docs/training.md, Threads).")
    threads: int = Field(0, ge=0, description="torch threads of each rank's main process; 0: derived from the "
                         "cores it may use (affinity, cgroup quota), the workers and the device (docs/training.md, "
                         "Threads).")
    data_timeout_s: float = Field(600.0, gt=0, description="Seconds to wait for the next batch from the "
                                  "data-loader workers before failing: a read or a decoder that hangs.")
    shuffle_buffer: int = Field(1000, ge=0, description="Samples in each stream's shuffle buffer.")
    sample_cache_mb: int = Field(256, ge=0, description="Decoded samples (pixels and tokens) each data-loader "
                                 "worker keeps for the next passes, in MiB; 0 keeps none. The stream is the same "
                                 "either way; a small set then skips its tars, JPEG decoding and tokeniser "
                                 "after the first pass (docs/training.md, \"The sample cache\").")
    augment: bool = Field(True, description="open_clip's training transform (random resized crop) instead of "
                          "the evaluation one.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of initialisation, data order and augmentation "
                      "(0 to 2**32 - 1, numpy's range).")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Autocast precision; fp16 adds a GradScaler. auto: bf16 on a GPU that has it (fp16 on "
        "one without), fp32 on the CPU (where bf16 runs too, but slower).")
    grad_clip_norm: float | None = Field(None, gt=0, description="Clip the global gradient norm to this (null: off).")
    grad_checkpointing: bool = Field(False, description="Recompute activations in backward (saves memory).")
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (a multiple of checkpoint_every; 0: "
                            "never) on train.eval_datasets, by `cloob eval suite` in a process of its own: records in "
                            "OUTPUT/evals/step-N, scalars in TensorBoard, Prometheus and OUTPUT/eval_history.csv. The "
                            "run's weights are the same with or without it.")
    eval_datasets: list[str] = Field(default_factory=list, description="Names of eval.datasets that train.eval_every "
                                     "evaluates.")
    eval_timeout_s: float = Field(3600.0, gt=0, allow_inf_nan=False, description="Seconds one evaluation of "
                                  "train.eval_every may run; one past it (a hung read, a frozen mount) is killed "
                                  "with a warning and the run goes on.")
    init_from: str | None = Field(None, description="Start from these weights, not random ones: a model folder "
                                  "(our export or an open_clip local-dir: one; local or s3://), local-dir:PATH, "
                                  "hf-hub:ORG/NAME (from the Hugging Face cache, offline), an open_clip checkpoint "
                                  "file (.pt, .bin, .safetensors), or production (promote.store's current model). "
                                  "Weights only: the optimiser, schedule and data order are the run's; a resumed "
                                  "run continues from its checkpoint instead.")
    lock_image: bool = Field(False, description="Train without the image tower: its parameters get no gradient and "
                             "are left out of the optimiser (LiT; open_clip's --lock-image).")
    lock_image_unlocked_groups: int = Field(0, ge=0, description="With lock_image, the image tower's last N groups "
                                            "of layers stay trainable (a ViT's: the stem, each block, the last "
                                            "block with its norm, the projection); a ResNet tower locks whole.")
    lock_image_freeze_bn_stats: bool = Field(False, description="With lock_image, its BatchNorm layers keep their "
                                             "running statistics (frozen) too, as open_clip's flag of that name.")
    lock_text: bool = Field(False, description="Train without the text tower (open_clip's --lock-text): its "
                            "parameters, LayerNorm included, get no gradient and leave the optimiser.")
    lock_text_unlocked_layers: int = Field(0, ge=0, description="With lock_text, its last N transformer blocks (and "
                                           "the final norm and projection) stay trainable.")
    grad_compression: Literal["none", "bf16"] = Field(
        "none", description="bf16: DDP all-reduces the gradients in bfloat16, half the bytes between nodes (for "
        "several nodes without a fast interconnect; the averaged gradient is rounded to bf16).")
    compile: bool = Field(False, description="torch.compile the model.")
    sync_batchnorm: bool = Field(False, description="SyncBatchNorm across ranks (ResNet encoders on GPUs).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cuda (cuda:LOCAL_RANK; fails in one line when CUDA is unusable: what a GPU pod sets), "
        "cpu, or auto (cuda if usable, else cpu).")
    checkpoint_every: int = Field(100, ge=1, description="Steps between checkpoints (one is always written at "
                                  "the end).")
    keep_checkpoints: int = Field(3, ge=1, description="Checkpoints kept (older ones are deleted).")
    checkpoint_sync: str | None = Field(None, description="s3:// prefix to which each checkpoint is also "
                                        "uploaded (null: local only).")
    log_every: int = Field(10, ge=1, description="Steps between log lines and metric updates.")
    collapse_windows: int = Field(3, ge=0, description="Log windows in a row at the objective's collapsed loss with "
                                  "a tower's embeddings shrunk to nearly one vector or a few directions before the run "
                                  "is called collapsed (one warning line; docs/objectives.md, 'Collapse'). 0: not "
                                  "judged.")
    on_collapse: Literal["warn", "stop"] = Field("warn", description="What follows a collapse: warn and train on, "
                                                 "or stop: checkpoint, then exit 2 with the collapse line.")
    tensorboard: bool = Field(True, description="Write TensorBoard scalars to OUTPUT/tensorboard.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Rank 0 serves Prometheus /metrics on this port "
                              "(0: off).")
    metrics_host: str = Field("127.0.0.1", description="Address the /metrics server binds (0.0.0.0 in a pod).")
    pushgateway: str | None = Field(None, description="Prometheus Pushgateway address for short runs "
                                    "(null: no push).")
    metrics_linger_s: float = Field(60.0, ge=0, description="Seconds the final metrics stay up after the loop "
                                    "ended, at the process's exit: /metrics keeps serving them and, once this has "
                                    "passed, a run that reached its end deletes its Pushgateway group. Two scrapes "
                                    "at 30 s: else a scrape rarely sees progress 1 or a diverged run's NaN, and "
                                    "CloobTrainingGone fires on a run that succeeded. 0: stop at once, keep the "
                                    "group.")

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, name: str) -> str:
        if name not in OBJECTIVE_NAMES:
            raise ValueError(unknown(name))
        return name

    @model_validator(mode="after")
    def _batch_splits_on_one_rank(self) -> TrainConfig:
        problem = self.shape_problem(ranks=1)
        if problem:
            raise ValueError(problem)
        return self

    @field_validator("data_streams", "workers")
    @classmethod
    def _at_least(cls, value: int | str, info: Any) -> int | str:
        least = 1 if info.field_name == "data_streams" else 0
        if isinstance(value, int) and value < least:
            raise ValueError(f"must be auto or a number >= {least}")
        return value

    def shape_problem(self, ranks: int) -> str | None:
        """Why the batch cannot split over ``ranks`` ranks (None: it can): into ``data_streams`` equal chunks,
        the streams evenly over the ranks, and each rank's share into ``accum_freq`` equal micro-batches. Read
        with the configuration for one rank; again, with the ranks, wherever a launch knows their number, before
        anything starts. ``auto`` streams are chosen to fit (:func:`cloob_core.training.shape.run_shape`)."""
        if self.data_streams != "auto" and self.batch_size % self.data_streams:
            return (f"train.batch_size ({self.batch_size}) must be a multiple of train.data_streams "
                    f"({self.data_streams})")
        if self.data_streams != "auto" and self.data_streams % ranks:
            return f"train.data_streams ({self.data_streams}) must be a multiple of the number of ranks ({ranks})"
        if self.batch_size % ranks or (self.batch_size // ranks) % self.accum_freq:
            return (f"train.batch_size {self.batch_size} must split into {ranks} rank(s) x train.accum_freq "
                    f"{self.accum_freq} equal micro-batches")
        return None

    def check_shape(self, ranks: int) -> None:
        """:meth:`shape_problem` as a :class:`ConfigError`."""
        problem = self.shape_problem(ranks)
        if problem:
            raise ConfigError(problem)
