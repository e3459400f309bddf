"""The trained model in the form open_clip loads: its state dict, its open_clip config and tokenizer name.

    import open_clip, torch, json
    open_clip.add_model_config("model/cloob-tiny.json")            # only for configs open_clip lacks
    model = open_clip.create_model("cloob-tiny")
    model.load_state_dict(torch.load("model/open_clip_model.pt", weights_only=True))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import open_clip
import torch

from cloob_core.io import UnreadableFile, read_json, read_torch, write_json, write_torch
from cloob_core.model.dual_encoder import CLOOBModel, image_stats, without_random_init_warning
from cloob_core.model.files import INFO_FILE, STATE_FILE


def export_model(model: CLOOBModel, folder: Path, extra: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    architecture = model.config.architecture
    write_torch(folder / STATE_FILE, {k: v.detach().cpu() for k, v in model.encoder.state_dict().items()})
    config = open_clip.get_model_config(architecture)
    write_json(folder / f"{architecture}.json", config)
    mean, std = image_stats(model.encoder.visual)
    info = {
        "architecture": architecture,
        "open_clip_config": f"{architecture}.json",
        "state_dict": STATE_FILE,
        "tokenizer": architecture,  # open_clip.get_tokenizer(<this>), once the config beside it is registered
        "context_length": int(config["text_cfg"].get("context_length", 77)),  # what that tokenizer pads to
        "image_size": model.image_size,
        "image_mean": list(mean),
        "image_std": list(std),
        "inv_tau": float(model.inv_tau),
        "open_clip_version": open_clip.__version__,
        **extra,
    }
    write_json(folder / INFO_FILE, info)
    return folder


def load_exported(folder: str | Path) -> tuple[open_clip.CLIP, dict[str, Any]]:
    """Rebuild an exported model with plain open_clip (what the evaluation stage and CLIP_benchmark do)."""
    folder = Path(folder)
    info = read_json(folder / INFO_FILE)
    missing = [key for key in ("architecture", "open_clip_config", "state_dict", "inv_tau")
               if not isinstance(info, dict) or key not in info]
    if missing:
        raise UnreadableFile(f"{folder / INFO_FILE} does not describe an exported model: no {', '.join(missing)}")
    if info["architecture"] not in open_clip.list_models():
        open_clip.add_model_config(folder / info["open_clip_config"])
    with without_random_init_warning():  # the trained weights are loaded next
        model = open_clip.create_model(info["architecture"], pretrained=None)
    load_weights(model, read_torch(folder / info["state_dict"], str(folder / info["state_dict"])),
                 str(folder / info["state_dict"]))
    return model, info


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
