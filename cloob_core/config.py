"""Typed configuration, in one place. ``params.yaml`` is the DVC view of it; its values are these defaults.

Each default that comes from the paper says where (Fürst et al. 2022, "CLOOB"). A config file or an override
that names an unknown key, or gives a value of the wrong type or out of range, fails with the key's path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(ValueError):
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
    name: str = Field("cloob", description="Objective from the registry: cloob, clip, infoloob, infonce_hopfield.")
    beta: float = Field(
        8.0,
        gt=0.0,
        description="Inverse temperature of the Hopfield retrieval; 8 for CC3M, 14.3 for YFCC (paper §5.1-5.2). "
        "Used by the Hopfield objectives only.",
    )

    @field_validator("name")
    @classmethod
    def _known_objective(cls, name: str) -> str:
        from cloob_core.losses import OBJECTIVES

        if name not in OBJECTIVES:
            raise ValueError(f"unknown objective {name!r}; choose one of {sorted(OBJECTIVES)}")
        return name


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0.0, description="AdamW peak learning rate; 1e-3 on CC3M (paper §5.1).")
    weight_decay: float = Field(
        0.1, ge=0.0, description="Decoupled weight decay, not applied to gains, biases, temperature (paper §5.1)."
    )
    beta1: float = Field(0.9, gt=0.0, lt=1.0, description="AdamW beta1 (open_clip default).")
    beta2: float = Field(0.98, gt=0.0, lt=1.0, description="AdamW beta2 (open_clip default for transformers).")
    eps: float = Field(1e-6, gt=0.0, description="AdamW epsilon (open_clip default for transformers).")
    warmup_steps: int = Field(30, ge=0, description="Linear warmup steps; the paper uses 20k on CC3M.")
    lr_cycles: int = Field(
        1, ge=1, description="Cosine cycles with hard restarts (paper §5.1: cosine annealing with restarts)."
    )


class DemoConfig(_Section):
    seed: int = Field(0, description="Seed for initialisation, caption draws, batches and augmentation.")
    epochs: int = Field(15, ge=1, description="Passes over the embedded training split.")
    batch_size: int = Field(128, ge=2, description="Contrastive batch size (pairs per step).")
    augment: bool = Field(True, description="Random shifts of the digits during training.")
    eval_batch_size: int = Field(500, ge=1, description="Batch size for embedding the held-out split.")


class CloobConfig(_Section):
    model: ModelConfig = ModelConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    optim: OptimConfig = OptimConfig()
    demo: DemoConfig = DemoConfig()


def _describe(err: ValidationError) -> str:
    lines = []
    for problem in err.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "<root>"
        if problem["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        else:
            lines.append(f"{key}: {problem['msg']} (got {problem.get('input')!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> CloobConfig:
    """Defaults, then the YAML file at ``path`` (if given), then ``section.key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    for override in overrides:
        keys, value = _parse_override(override)
        node = data
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {override!r}: {key} is not a section")
            node = child
        node[keys[-1]] = value
    try:
        return CloobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def dump_defaults() -> str:
    """The defaults as YAML: what ``params.yaml`` holds."""
    header = "# The DVC view of cloob_core.config. Descriptions and sources: cloob_core/config.py.\n"
    return header + yaml.safe_dump(CloobConfig().model_dump(), sort_keys=False)
