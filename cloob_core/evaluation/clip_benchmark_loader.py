"""CLIP_benchmark with our exports: ``cloob-clip-benchmark`` is CLIP_benchmark's own command with a ``cloob``
model type registered, so its code, not ours, scores a `cloob train` export::

    cloob-clip-benchmark eval --model_type cloob --model cloob-tiny --pretrained runs/train/model \\
        --dataset wds/mnist --dataset_root bench/mnist --task zeroshot_classification --no_amp --output r.json

``--pretrained`` is the export folder (local or s3://); ``--model`` its architecture (checked against the folder).
A local folder also runs with CLIP_benchmark's stock ``--model_type open_clip --model local-dir:FOLDER``.

Registration has two parts: the loader goes into ``clip_benchmark.models.TYPE2FUNC``, and its name into
``clip_benchmark.models.MODEL_TYPES`` in place, because CLIP_benchmark's CLI imported that list object and uses it
as the ``--model_type`` choices (adding to ``TYPE2FUNC`` alone gives "invalid choice: 'cloob'").
"""

from __future__ import annotations

import sys
from typing import Any

from cloob_core.model.source import ModelSource, load_model

MODEL_TYPE = "cloob"


def load_cloob(model_name: str, pretrained: str, cache_dir: str | None = None,
               device: Any = "cpu") -> tuple[Any, Any, Any]:
    """CLIP_benchmark's loader signature: ``(model, transform, tokenizer)`` for an export folder."""
    loaded = load_model(ModelSource(model=pretrained, device=str(device)))
    if model_name and model_name != loaded.architecture:
        raise ValueError(f"{pretrained} holds a {loaded.architecture} model, not {model_name}")
    return loaded.model, loaded.transform, loaded.tokenizer


def register() -> None:
    from clip_benchmark import models

    models.TYPE2FUNC[MODEL_TYPE] = load_cloob
    if MODEL_TYPE not in models.MODEL_TYPES:
        models.MODEL_TYPES.append(MODEL_TYPE)


def main() -> int:
    """``cloob-clip-benchmark ARGS``: CLIP_benchmark's CLI, ``--model_type cloob`` included."""
    try:
        from clip_benchmark import cli
    except ImportError as err:
        print(f"cloob-clip-benchmark: CLIP_benchmark is not importable ({err}); see docs/evaluation.md",
              file=sys.stderr)
        return 2
    register()
    return cli.main() or 0


if __name__ == "__main__":
    sys.exit(main())
