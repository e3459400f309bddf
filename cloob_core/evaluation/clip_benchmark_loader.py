"""A model loader for CLIP_benchmark, so its own `clip_benchmark eval` runs on our exports.

CLIP_benchmark's loaders take ``(model_name, pretrained, cache_dir, device)`` and return
``(model, transform, tokenizer)``. Architectures open_clip knows (RN50, ViT-B-32, ...) need nothing of ours:

    clip_benchmark eval --model_type open_clip --model RN50 --pretrained runs/train/model/open_clip_model.pt ...

For the project's own configurations (cloob-tiny, ...), register this loader before running CLIP_benchmark's
CLI in the same process (see README), with ``pretrained`` = the export folder:

    from clip_benchmark.models import TYPE2FUNC
    from cloob_core.evaluation.clip_benchmark_loader import load_cloob
    TYPE2FUNC["cloob"] = load_cloob
"""

from __future__ import annotations

from typing import Any

from cloob_core.evaluation.inputs import load_model


def load_cloob(
    model_name: str, pretrained: str, cache_dir: str | None = None, device: str = "cpu"
) -> tuple[Any, Any, Any]:
    loaded = load_model(model=pretrained, device=device)
    if model_name and model_name != loaded.architecture:
        raise ValueError(f"{pretrained} holds a {loaded.architecture} model, not {model_name}")
    return loaded.model, loaded.transform, loaded.tokenizer
