"""Typed configuration, in one place. ``params.yaml`` is the DVC view of it; its values are these defaults.

Each default that comes from the paper says where (Fürst et al. 2022, "CLOOB"). A config file or an override
that names an unknown key, or gives a value of the wrong type or out of range, fails with the key's path.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cloob_core.errors import StageError
from cloob_core.objectives.names import OBJECTIVE_NAMES, POLY_VIEW_OBJECTIVES, unknown


class ConfigError(StageError, ValueError):
    """A configuration that cannot run, with the offending key named."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


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
        "(docs/objectives.md, 'Collapse'). warmup: the schedule's warm-up steps; a number: that many; 0: retrieval "
        "from the first step (the paper).")
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


class PreprocessConfig(_Section):
    """How every image and caption is checked, resized and encoded before it enters a shard."""

    image_size: int = Field(256, ge=8, le=8192, description="Target side in pixels (img2dataset's default 256).")
    resize_mode: Literal["keep_ratio", "center_crop", "border", "no"] = Field(
        "keep_ratio",
        description="keep_ratio: shortest side to image_size; center_crop: then a centred square; border: longest "
        "side to image_size, padded to a square; no: keep the original size.",
    )
    resize_only_if_bigger: bool = Field(True, description="Never enlarge: resize only images larger than the target "
                                        "(an enlarged image adds bytes, not detail; training resizes anyway). false: "
                                        "enlarge smaller ones too, as img2dataset does by default.")
    max_side: int | None = Field(1024, ge=8, description="Longest side stored: an image that resizing leaves longer "
                                 "(a panorama under keep_ratio, a large image under no) is scaled down to it, keeping "
                                 "its ratio; null: no bound. At least image_size.")

    @field_validator("resize_mode", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML 1.1 reads an unquoted `no` as false
    jpeg_quality: int = Field(95, ge=1, le=100, description="JPEG quality of the re-encoded image.")
    min_image_side: int = Field(8, ge=0, description="Drop images whose original shorter side is below this (as "
                                "too_small): the gate's validation.min_image_side, so that an image too small to "
                                "enlarge is dropped by name rather than failing the shard gate.")
    max_aspect_ratio: float | None = Field(
        None, ge=1.0, description="Drop images whose original long/short side ratio exceeds this (null: no limit)."
    )
    max_image_pixels: int = Field(
        89_478_485,
        ge=1,
        description="Decompression-bomb guard: refuse images with more pixels than this before decoding "
        "(Pillow's own default limit).",
    )
    min_caption_chars: int = Field(1, ge=0, description="Drop captions shorter than this (1 drops empty captions).")
    max_caption_chars: int | None = Field(2000, ge=1, description="Drop captions longer than this (null: no limit).")
    shard_size: int = Field(256, ge=1, description="Manifest rows per shard. 256 gives the captioned default's "
                            "2,047 training pairs 8 shards, one per data stream; web-scale sets use img2dataset's "
                            "10000.")
    dedup_content: bool = Field(True, description="Keep identical image bytes (sha256) once; later copies are dropped.")

    @model_validator(mode="after")
    def _side_bound_holds_the_target(self) -> PreprocessConfig:
        if self.max_side is not None and self.max_side < self.image_size:
            raise ValueError(f"preprocess.max_side {self.max_side} is below preprocess.image_size {self.image_size}: "
                             "the resized images could never reach the target; raise it or set it to null")
        return self


# Query parameters that carry credentials in the URLs of common stores and CDNs: bearer tokens, API keys, S3 / GCS /
# Azure / CloudFront signatures and session credentials.
SECRET_QUERY_PARAMS = ("token", "access_token", "id_token", "refresh_token", "auth", "authorization", "sig",
                       "signature", "x-amz-signature", "x-amz-credential", "x-amz-security-token",
                       "x-goog-signature", "x-goog-credential", "key", "api_key", "apikey", "api-key", "password",
                       "passwd", "secret", "client_secret", "policy", "key-pair-id", "session", "sessionid", "jwt")


class DownloadConfig(_Section):
    """How manifests are read and URLs fetched. Per-run choices (paths, partition) are command-line options."""

    url_col: str = Field("url", description="Manifest column holding the image URL.")
    caption_col: str = Field("caption", description="Manifest column holding the caption.")
    input_format: Literal["auto", "csv", "tsv", "parquet", "jsonl"] = Field(
        "auto", description="Manifest format of text files (a .parquet file is parquet); auto: from the file "
        "suffix. Header-less caption<TAB>url is detected."
    )
    processes: int = Field(0, ge=0, description="Worker processes (0: one per CPU core).")
    threads: int = Field(32, ge=1, le=1024, description="Download threads per worker process.")
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to establish a connection.")
    read_timeout: float = Field(10.0, gt=0, description="Seconds a read may wait for the next bytes.")
    url_deadline: float = Field(
        30.0, gt=0, description="Seconds one URL may take in all, retries included (a slow drip cannot hold a worker)."
    )
    retries: int = Field(2, ge=0, description="Extra attempts after transient errors (5xx, timeouts, resets).")
    backoff: float = Field(0.5, ge=0, description="First retry delay in seconds; doubles on each retry.")
    max_redirects: int = Field(5, ge=0, description="Redirects followed per URL.")
    max_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="Largest response body accepted, in bytes.")
    respect_opt_out: bool = Field(
        True, description="Skip images whose X-Robots-Tag says noai, noimageai, noindex or noimageindex."
    )
    allow_private_network: bool = Field(
        False,
        description="Allow URLs resolving to loopback, private or link-local addresses (refused by default; "
        "needed for servers on 127.0.0.1). Cloud-metadata endpoints stay refused.",
    )
    dedup_urls: bool = Field(True, description="Fetch a URL repeated in the manifest once; later rows are dropped.")
    redact_query_params: list[str] = Field(
        default_factory=lambda: list(SECRET_QUERY_PARAMS),
        description="Query parameters whose values are replaced by REDACTED wherever a URL is recorded (failure "
        "files, the samples' json, the gate's report, logs); user info is always removed. The fetch uses the full "
        "URL. Case-insensitive.")
    pushgateway: str | None = Field(None, description="Prometheus Pushgateway address; each download (partition) "
                                    "pushes its rows, successes and failures by reason (null: no push).")


class AcquireConfig(_Section):
    """``cloob data acquire``: where the pipeline's image-text pairs come from."""

    source: str = Field("captioned", description="A packaged set (captioned: 2,551 real image-caption pairs; "
                        "mnist: digits with template captions; all in cloob_core/data/packaged.py), split below, "
                        "or a manifest of image URLs and captions (CSV/TSV/parquet/JSONL, local path or s3://).")
    split: Literal["train", "test", "all"] = Field("train", description="Packaged split to train on; the "
                                                   "evaluation keeps the held-out 'test' split.")


CPU_DATA_STREAMS = 8  # what train.data_streams "auto" gives on the CPU: a shard per stream is needed for all of them


_ENGINE_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(%|[KMGT]i?B|B)", re.IGNORECASE)


class EngineConfig(_Section):
    """The out-of-core engine (DuckDB) of the manifest-wide steps: URL duplicates, the gate's aggregates."""

    memory_limit: str = Field("512MB", description="Most memory the engine holds (DuckDB's memory_limit); beyond it "
                              "it spills to spill_dir. Manifest-wide steps stay within this whatever the rows.")
    threads: int = Field(0, ge=0, description="Engine threads (0: DuckDB's default, one per core it may use).")
    spill_dir: str | None = Field(None, description="Local folder the engine spills to (null: a temporary folder); "
                                  "needs about the size of the manifest's URL column for 10^9 rows.")

    @field_validator("memory_limit")
    @classmethod
    def _size(cls, value: str) -> str:
        """A size DuckDB reads the same way: a positive number with a unit (KB, MiB, GB, ...) or a percentage
        of the machine's memory; DuckDB itself would take ``-5GB`` as its default and ``abc`` only later."""
        found = _ENGINE_SIZE.fullmatch(value.strip())
        if found is None or float(found.group(1)) <= 0 or (found.group(2) == "%" and float(found.group(1)) > 100):
            raise ValueError(f"{value!r} is not a memory size: give a positive number with a unit (512MB, 4GiB, "
                             "1TB) or a percentage of the memory (50%)")
        return value.strip()

    @field_validator("spill_dir")
    @classmethod
    def _local_folder(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or "://" in value):
            raise ValueError(f"{value!r} is not a local folder (the engine spills to a local disk)")
        return value


class ValidationConfig(_Section):
    """Thresholds of the data gate (``cloob data validate``)."""

    min_rows: int = Field(1, ge=0, description="Fewest manifest rows accepted.")
    max_caption_chars: int = Field(2000, ge=1, description="Longest caption accepted in the manifest.")
    max_bad_row_fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of manifest rows allowed to break a row expectation (bad URL, empty caption...).",
    )
    min_success_ratio: float = Field(
        0.5, ge=0.0, le=1.0, description="Fewest successes per manifest row attempted, over the whole output."
    )
    min_image_side: int = Field(8, ge=1, description="Smallest stored image side accepted in the shards.")
    max_image_side: int = Field(8192, ge=1, description="Largest stored image side accepted in the shards.")
    manifest_sample: int = Field(10_000, ge=0, description="Manifest rows the row-level expectations check, "
                                 "picked by a hash of the row (plus up to 20 rows breaking each exact check, as "
                                 "examples); the counts come from exact aggregates over every row.")
    decode_sample: int = Field(64, ge=0, description="Samples per shard the gate decodes in full (image, UTF-8 "
                               "caption, JSON metadata), picked by a hash of their keys; 0 checks presence only.")
    max_undecodable_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Fraction of a shard's decoded "
                                            "samples allowed to fail; a shard above it fails the gate, by name.")
    caption_sample: int = Field(10_000, ge=0, description="Captions tokenised with model.architecture's "
                                "tokenizer to measure how they fit its text context: by the manifest gate from its "
                                "sample, by the shard gate from its decoded samples, by training from its shards "
                                "before the first step. 0 measures nothing.")
    warn_truncated_caption_fraction: float = Field(0.1, ge=0.0, le=1.0, description="Share of sampled "
                                                   "captions longer than the model's text context above which "
                                                   "the gate and training warn (their ends do not train).")
    max_truncated_caption_fraction: float = Field(0.5, ge=0.0, le=1.0, description="Share of sampled captions "
                                                  "longer than the model's text context above which the gate "
                                                  "fails and training refuses to start.")
    max_merged_caption_fraction: float = Field(0.05, ge=0.0, le=1.0, description="Share of distinct sampled "
                                               "captions that cutting to the model's context makes identical "
                                               "to another, above which the gate fails and training refuses.")


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
    shards: str = Field("data/shards", description="Training shards: a folder with sizes.json (local or "
                        "s3://), a brace pattern or a .tar; from `cloob data download|shards`.")
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
    seed: int = Field(0, description="Seed of initialisation, data order and augmentation.")
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


# The evaluation suite's vocabulary. `cloob eval TASK` -> the result it writes, named as CLIP_benchmark names its
# tasks: results are <data set>_<result> (mnist_zeroshot_classification), metrics <data set>_<result>.<key>.
TASK_RESULTS: dict[str, str] = {"zeroshot": "zeroshot_classification", "linear-probe": "linear_probe",
                                "retrieval": "zeroshot_retrieval", "diagnostics": "diagnostics"}
TaskName = Literal["zeroshot", "linear-probe", "retrieval", "diagnostics"]  # the keys of TASK_RESULTS
# Data sets that ship inside this package (cloob_core/data/packaged.py); they need no path.
PACKAGED_SETS = ("captioned", "tuxpaint", "fluent-emoji", "mnist")
# Evaluation sources read from installed packages: ours and scikit-learn's 8x8 digits.
PACKAGED_SOURCES = (*PACKAGED_SETS, "sklearn-digits")
SUITE_RESULT = "suite"  # the result holding the aggregates: suite.<aggregate> beside <data set>_<result>.<key>
# Data-set and aggregate names become folder names, DVC stage names (eval@NAME) and the first part of metric
# names, so they may not hold a dot (the separator of RESULT.KEY), a slash or spaces.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_@+-]*")


def result_name(dataset: str, task: str) -> str:
    return f"{dataset}_{TASK_RESULTS[task]}"



class SplitsConfig(_Section):
    """Which split of a data set each role reads (subfolders of an ImageFolder tree, of a wds set)."""

    test: str = Field("test", description="The split every task scores.")
    train: str = Field("train", description="The linear probe's training split.")
    val: str | None = Field(None, description="The linear probe's validation split for the lambda search "
                            "(null: a random half of train, CLIP's recipe).")


class DatasetConfig(_Section):
    """One data set of the evaluation suite; its name is its key in ``eval.datasets``."""

    source: str = Field(description="A packaged set (captioned, tuxpaint, fluent-emoji, mnist), "
                        "'sklearn-digits' (scikit-learn's 8x8 digits), an ImageFolder tree, CLIP_benchmark wds "
                        "shards (`cloob data eval-set`), `cloob data` shards or an image,caption .csv; a local "
                        "path or s3://.")
    tasks: list[TaskName] = Field(["zeroshot"], min_length=1, description="zeroshot, linear-probe, "
                                  "retrieval, diagnostics.")
    splits: SplitsConfig = Field(default_factory=SplitsConfig)
    classnames: str | None = Field(None, description="Class names and templates: a packaged set (imagenet, "
                                   "cifar10, ...) or a JSON file (null: from the source).")
    label_key: str = Field("label", description="The class field in the json of `cloob data` shards.")
    few_shot: int | None = Field(None, ge=1, description="Linear probe on K training images per class "
                                 "(null: all).")
    batch_size: int = Field(256, ge=1, description="Images per encoding batch.")

    @field_validator("tasks")
    @classmethod
    def _once_each(cls, tasks: list[str]) -> list[str]:
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"a task is named twice in {tasks}")
        return tasks


class AggregateConfig(_Section):
    """A suite-level figure: the mean of per-data-set metrics, written as ``suite.<name>``."""

    of: list[str] = Field(min_length=1, description="RESULT.KEY of each data set's metrics, e.g. "
                          "zeroshot_classification.acc1; several are averaged together.")
    datasets: list[str] | None = Field(None, description="The data sets averaged over (null: every data set "
                                       "that writes the result).")

    @field_validator("of", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


def _default_datasets() -> dict[str, DatasetConfig]:
    # Retrieval and diagnostics on the held-out captions of the training distribution; zero-shot and linear
    # probes on its two sources' categories, and on MNIST digits, which the captioned set never shows.
    return {"captioned": DatasetConfig(source="captioned", tasks=["retrieval", "diagnostics"]),
            "tuxpaint": DatasetConfig(source="tuxpaint", tasks=["zeroshot", "linear-probe"]),
            "emoji": DatasetConfig(source="fluent-emoji", tasks=["zeroshot", "linear-probe"]),
            "mnist": DatasetConfig(source="mnist", tasks=["zeroshot", "linear-probe"])}


def _default_aggregates() -> dict[str, AggregateConfig]:
    return {"zeroshot_acc1": AggregateConfig(of=["zeroshot_classification.acc1"]),
            "linear_probe_acc1": AggregateConfig(of=["linear_probe.lp_acc1"]),
            "retrieval_recall@1": AggregateConfig(of=["zeroshot_retrieval.image_retrieval_recall@1",
                                                      "zeroshot_retrieval.text_retrieval_recall@1"]),
            "retrieval_recall@5": AggregateConfig(of=["zeroshot_retrieval.image_retrieval_recall@5",
                                                      "zeroshot_retrieval.text_retrieval_recall@5"])}


class EvalConfig(_Section):
    """The evaluation suite: what `dvc repro`, the Kubeflow pipelines and the promotion gate evaluate on."""

    datasets: dict[str, DatasetConfig] = Field(default_factory=_default_datasets, min_length=1,
                                               description="Data sets by name (unique: they are mapping keys).")
    aggregates: dict[str, AggregateConfig] = Field(default_factory=_default_aggregates,
                                                   description="Suite means by name, as suite.<name>.")

    @model_validator(mode="after")
    def _names_and_references(self) -> EvalConfig:
        for kind, names in (("data set", self.datasets), ("aggregate", self.aggregates)):
            for name in names:
                if not NAME_PATTERN.fullmatch(name) or name == SUITE_RESULT:
                    raise ValueError(f"{kind} name {name!r} must be letters, digits, _ @ + - (no dots, not "
                                     f"{SUITE_RESULT!r})")
        results = {TASK_RESULTS[task]: task for task in TASK_RESULTS}
        if "aggregates" not in self.model_fields_set:  # the defaults apply where the user's suite has their tasks
            kept = {name: aggregate for name, aggregate in self.aggregates.items()
                    if all(self.contributors(name, metric.partition(".")[0]) for metric in aggregate.of)}
            object.__setattr__(self, "aggregates", kept)
        for name, aggregate in self.aggregates.items():
            for metric in aggregate.of:
                result, _, key = metric.partition(".")
                if result not in results or not key:
                    raise ValueError(f"aggregates.{name}: {metric!r} is not RESULT.KEY with RESULT one of "
                                     f"{sorted(results)}")
                unknown_sets = sorted(set(aggregate.datasets or ()) - set(self.datasets))
                if unknown_sets:
                    raise ValueError(f"aggregates.{name}: no data set named {unknown_sets} in eval.datasets")
                if not self.contributors(name, result):
                    raise ValueError(f"aggregates.{name}: no data set of the suite runs "
                                     f"{results[result]!r}, so {metric!r} has nothing to average")
        return self

    def contributors(self, aggregate: str, result: str) -> list[str]:
        """The data sets whose ``result`` an aggregate averages."""
        chosen = self.aggregates[aggregate].datasets or list(self.datasets)
        return [name for name in chosen if any(TASK_RESULTS[t] == result for t in self.datasets[name].tasks)]

    def metric_names(self) -> set[str]:
        """The RESULT names the suite writes (``<data set>_<result>`` and ``suite``)."""
        return {SUITE_RESULT} | {result_name(name, task) for name, entry in self.datasets.items()
                                 for task in entry.tasks}


class PromoteConfig(_Section):
    """``cloob promote``: the gate between a retrained model and production."""

    store: str = Field("models/registry", description="Model store: a local folder or an s3:// prefix holding "
                       "production.json (the pointer), models/<id>/ and history/.")
    metric: str = Field("suite.retrieval_recall@5", description="The metric that must improve, as RESULT.KEY of the "
                        "evaluation report's metrics.json: suite.<aggregate> or <data set>_<result>.<key> of "
                        "the eval suite.")
    min_improvement: float = Field(0.005, ge=0.0, description="Least improvement of `metric` over production "
                                   "(0.005 = half a point of accuracy).")
    guards: dict[str, float] = Field(
        default_factory=lambda: {"suite.linear_probe_acc1": 0.01},
        description="Metrics that may not regress by more than their tolerance (RESULT.KEY: tolerance). Keys ending "
        "in _rank count lower as better.")
    registry_stage: str | None = Field("prod", description="In a git repository whose dvc.yaml declares the model "
                                       "folder as an artifact, a promotion is also recorded as this GTO stage "
                                       "(DVC's model registry), once the commit holds the weights (null: no record).")
    single_writer: bool = Field(False, description="The store ignores conditional writes (some older MinIO or Ceph "
                                "releases, some proxies) and you guarantee that one gate writes at a time (one "
                                "scheduled pipeline, no manual runs). Otherwise the gate probes the store and refuses "
                                "one that would let concurrent gates overwrite each other.")


# Named recipes of the paper (§5.1 CC3M, §5.2 YFCC; App. A.2.2). ``--preset`` applies them over the params file
# and under --set overrides.
# Cycles: restarts every ~7 epochs (App. A.2.2), over 31 epochs on CC3M (Table A1) and 28 on YFCC (§5.2).
PRESETS: dict[str, dict[str, Any]] = {
    "cc3m": {"train.batch_size": 512, "optim.lr": 1e-3, "optim.warmup_steps": 20_000, "objective.beta": 8.0,
             "model.architecture": "RN50", "train.epochs": 31, "optim.lr_cycles": 4},
    "yfcc": {"train.batch_size": 1024, "optim.lr": 5e-4, "optim.warmup_steps": 10_000, "objective.beta": 14.3,
             "model.architecture": "RN50", "train.epochs": 28, "optim.lr_cycles": 4},
    # The ViT-B family (ViT-B-32, ViT-B-16 with --architecture): open_clip's ViT-B-32 optimiser recipe (lr 5e-4,
    # 2,000 warm-up steps, weight decay 0.2; beta2 0.98 and eps 1e-6 are the defaults), with the default start without
    # Hopfield retrieval. Wide towers need the lower rate besides the start (docs/objectives.md, "Collapse").
    "vit-b": {"model.architecture": "ViT-B-32", "optim.lr": 5e-4, "optim.warmup_steps": 2_000,
              "optim.weight_decay": 0.2},
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
                              *((f"promote.guards.{key}", key) for key in self.promote.guards)):
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


def describe(err: ValidationError, what: str = "configuration") -> str:
    """A pydantic error as one line that names each offending key (its value cut short: it may be huge)."""
    lines = []
    for problem in err.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "<root>"
        if problem["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        elif problem["type"] == "value_error":  # our own checks: their message says what was wrong
            message = problem["msg"].removeprefix("Value error, ")
            named = key == "<root>" or message.startswith(f"{key}.")  # the message names its keys itself
            lines.append(message if named else f"{key}: {message}")
        else:
            lines.append(f"{key}: {problem['msg']} (got {_short(repr(problem.get('input')))})")
    return f"invalid {what}: " + "; ".join(lines)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping: PyYAML keeps the last silently, which would drop a
    data set of the evaluation suite (they are keyed by name) without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


Values = Mapping[str, Mapping[str, Any]]  # {section: {key: value}}, typed values (a command's flags)


@dataclass(frozen=True)
class ConfigLayers:
    """A configuration as its caller gave it, the layers kept apart: a params file's sections, a preset,
    ``section.key=value`` overrides, typed flag values. :meth:`build` lays them over the defaults (or over a base,
    such as a checkpoint's configuration); :meth:`keys` says which keys the caller set."""

    data: Mapping[str, Any] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()
    preset: str | None = None
    values: Values | None = None

    def build(self, base: Mapping[str, Any] | None = None) -> CloobConfig:
        return config_from_mapping(_merged(base or {}, self.data), self.overrides, self.preset, self.values)

    def keys(self) -> set[str]:
        """The ``section.key`` names the layers set (a params file's every key included)."""
        named = {f"{section}.{key}" for section, fields in self.data.items() if isinstance(fields, Mapping)
                 for key in fields}
        named |= set(PRESETS.get(self.preset, {})) if self.preset else set()
        named |= {".".join(_parse_override(text)[0][:2]) for text in self.overrides}
        named |= {f"{section}.{key}" for section, fields in (self.values or {}).items() for key in fields}
        return named


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` section by section (a section ``over`` names replaces only the keys it gives)."""
    merged = copy.deepcopy(dict(base))
    for section, fields in over.items():
        if isinstance(fields, Mapping) and isinstance(merged.get(section), Mapping):
            merged[section] = {**merged[section], **copy.deepcopy(dict(fields))}
        else:
            merged[section] = copy.deepcopy(fields)
    return merged


def load_layers(path: str | Path | None = None, overrides: Sequence[str] = (), preset: str | None = None,
                values: Values | None = None) -> ConfigLayers:
    """The layers of :func:`load_config`, the YAML file at ``path`` read and parsed, nothing validated yet."""
    text = None
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not UTF-8 text (is it a YAML file?)") from None
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return ConfigLayers(_parsed(text, f"config file {path}"), tuple(overrides), preset, values)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), preset: str | None = None,
                values: Values | None = None) -> CloobConfig:
    """Defaults, then the YAML file at ``path`` (if given), then a named preset, then ``section.key=value``
    overrides (text, as ``--set`` gives them), then ``values``; validated once, at the end."""
    return load_layers(path, overrides, preset, values).build()


def config_from_text(text: str | None, overrides: Sequence[str] = (), preset: str | None = None,
                     source: str = "the parameters", values: Values | None = None) -> CloobConfig:
    """:func:`load_config` for a params.yaml given as text (a Kubeflow run parameter); ``None``: the defaults."""
    return config_from_mapping(_parsed(text, source), overrides, preset, values)


def _parsed(text: str | None, source: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError(f"{source} is not valid YAML: {err}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{source} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded or {}


def config_from_mapping(data: Mapping[str, Any], overrides: Sequence[str] = (), preset: str | None = None,
                        values: Values | None = None) -> CloobConfig:
    """:func:`load_config` for the sections as a mapping (a configuration's ``model_dump()``, a KFP struct)."""
    merged = copy.deepcopy(dict(data))
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        for key, value in PRESETS[preset].items():
            _put(merged, key.split("."), value, key)
    for override in overrides:
        keys, value = _parse_override(override)
        _put(merged, keys, value, override)
    for section, fields in (values or {}).items():
        for key, value in fields.items():
            _put(merged, [section, key], value, f"{section}.{key}")
    try:
        return CloobConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(describe(err)) from None


def _put(data: dict[str, Any], keys: list[str], value: Any, named: str) -> None:
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {named!r}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def dump_defaults() -> str:
    """The defaults as YAML: what ``params.yaml`` holds."""
    header = "# The DVC view of cloob_core.config. Descriptions and sources: cloob_core/config.py.\n"
    return header + yaml.safe_dump(CloobConfig().model_dump(), sort_keys=False)
