"""The class-name and template sets shipped in ``cloob_core/evaluation/classnames`` (the paper's 20 zero-shot data
sets), apart from the evaluation's inputs so that reading them needs no torch."""

from __future__ import annotations

from importlib import resources

_CLASS_SETS = resources.files("cloob_core.evaluation") / "classnames"


def packaged_class_sets() -> list[str]:
    """Names of the packaged sets (cifar10, imagenet, ...)."""
    return sorted(p.name.removesuffix(".json") for p in _CLASS_SETS.iterdir() if p.name.endswith(".json"))


def packaged_class_set(name: str) -> str:
    """The JSON text of a packaged set."""
    return (_CLASS_SETS / f"{name}.json").read_text(encoding="utf-8")
