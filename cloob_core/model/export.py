"""The trained model as a folder that plain open_clip loads, locally or pushed to the Hugging Face Hub::

    import open_clip
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:models/train/model")
    tokenizer = open_clip.get_tokenizer("local-dir:models/train/model")

The folder is what open_clip's own ``save_for_hf`` writes (its config, safetensors weights, an HF tokenizer's
files where the architecture has one), plus ``model_info.json`` with what open_clip does not keep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import open_clip
import torch

from cloob_core import storage
from cloob_core.io import UnreadableFile, read_safetensors, read_torch, write_json, write_safetensors
from cloob_core.model.dual_encoder import CLOOBModel, image_stats, without_random_init_warning
from cloob_core.model.files import CONFIG_FILE, EARLIER_STATE_FILE, INFO_FILE, LOCAL_DIR, STATE_FILE


def export_model(model: CLOOBModel, folder: Path, extra: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    architecture = model.config.architecture
    write_safetensors(folder / STATE_FILE, model.encoder.state_dict())
    model_cfg = open_clip.get_model_config(architecture)
    mean, std = image_stats(model.encoder.visual)
    # the evaluation's preprocessing, spelled out so that open_clip builds the same one from the folder
    preprocess_cfg = {"mean": list(mean), "std": list(std), "interpolation": "bicubic", "resize_mode": "shortest"}
    write_json(folder / CONFIG_FILE, {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg})
    if model_cfg["text_cfg"].get("hf_tokenizer_name"):  # an HF tokenizer: local-dir: reads its files from here
        open_clip.get_tokenizer(architecture).save_pretrained(str(folder))
    info = {
        "architecture": architecture,
        "context_length": int(model_cfg["text_cfg"].get("context_length", 77)),  # what the tokenizer pads to
        "image_size": model.image_size,
        "inv_tau": float(model.inv_tau),
        "open_clip_version": open_clip.__version__,
        **extra,
    }
    write_json(folder / INFO_FILE, info)
    return folder


@dataclass(frozen=True)
class Exported:
    """An export loaded back: the model, its ``model_info.json``, its tokenizer and the file its weights came
    from (what identifies them)."""

    model: open_clip.CLIP
    info: dict[str, Any]
    tokenizer: Callable[[Sequence[str]], torch.Tensor]
    weights: Path


def load_exported(folder: str | Path) -> Exported:
    """Rebuild an exported model through open_clip's ``local-dir:`` loader, as any user of the folder does; the
    weights are read here so that a damaged or misfit file is one line, not torch's key lists. A folder in the
    earlier layout (``open_clip_model.pt`` and ``<architecture>.json``: a production model promoted before) is
    read as it was written."""
    folder = Path(folder)
    info = storage.read_json(folder / INFO_FILE)
    missing = [key for key in ("architecture", "inv_tau") if not isinstance(info, dict) or key not in info]
    if missing:
        raise UnreadableFile(f"{folder / INFO_FILE} does not describe an exported model: no {', '.join(missing)}")
    if not (folder / CONFIG_FILE).exists() and (folder / EARLIER_STATE_FILE).exists():
        return _load_earlier_layout(folder, info)
    config = storage.read_json(folder / CONFIG_FILE)
    if not isinstance(config, dict) or not isinstance(config.get("model_cfg"), dict):
        raise UnreadableFile(f"{folder / CONFIG_FILE} is not an open_clip config: no model_cfg")
    with without_random_init_warning():  # the trained weights are loaded next
        model = open_clip.create_model(LOCAL_DIR + str(folder), load_weights=False)
    load_weights(model, read_state_dict(folder / STATE_FILE), str(folder / STATE_FILE))
    return Exported(model, info, open_clip.get_tokenizer(LOCAL_DIR + str(folder)), folder / STATE_FILE)


def _load_earlier_layout(folder: Path, info: dict[str, Any]) -> Exported:
    architecture = info["architecture"]
    if architecture not in open_clip.list_models():
        open_clip.add_model_config(folder / f"{architecture}.json")
    with without_random_init_warning():  # the trained weights are loaded next
        model = open_clip.create_model(architecture, pretrained=None)
    weights = folder / EARLIER_STATE_FILE
    load_weights(model, read_state_dict(weights), str(weights))
    return Exported(model, info, open_clip.get_tokenizer(architecture), weights)


def read_state_dict(path: str | Path) -> Any:
    """A weights file: safetensors by its suffix, else a torch archive read as data only."""
    if str(path).endswith(".safetensors"):
        return read_safetensors(path)
    return read_torch(path, str(path))


def load_weights(model: torch.nn.Module, state: Any, name: str) -> None:
    """Load a state dict (bare, under ``state_dict``, or saved from DistributedDataParallel with ``module.``
    prefixes); weights that do not fit the architecture are one line naming ``name``, not torch's key lists."""
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UnreadableFile(f"{name} does not hold a state dict (a mapping of parameter names to tensors)")
    state = {key.removeprefix("module."): value for key, value in state.items()}
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
    if missing or unexpected or misshapen:
        example = (missing or unexpected or misshapen)[0]
        raise UnreadableFile(f"{name} does not fit the architecture: {len(missing)} missing, {len(unexpected)} "
                             f"unexpected, {len(misshapen)} misshapen parameters (e.g. {example}); is it the "
                             "architecture the weights were trained with?")
    model.load_state_dict(state)
