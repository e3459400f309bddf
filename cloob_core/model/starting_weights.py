"""A run's starting weights (``train.init_from``): where they come from, read without unpickling, checked against
the run's architecture, loaded into its model.

``init_from`` is one of:
- a model folder: our export, or any folder open_clip's ``local-dir:`` loads (``open_clip_config.json`` beside
  ``open_clip_model.safetensors`` or ``open_clip_pytorch_model.bin``), local or ``s3://``; ``local-dir:PATH`` too;
- ``hf-hub:ORG/NAME``: such a folder in the Hugging Face cache, resolved offline (no network is reached);
- a weights file: an open_clip checkpoint (``.pt``, ``.bin``: a state dict, bare or under ``state_dict``, with
  DDP's ``module.`` prefixes or without) or ``.safetensors``;
- ``production``: the promotion store's current model (``promote.store``).

Weights are read as safetensors or with ``torch.load(weights_only=True)``. A folder's ``model_cfg`` that differs
from the run's architecture is refused naming the differing keys, and weights whose names or shapes do not fit are
refused naming them. The temperature is the run's own (``model.inv_tau``): a CLIP checkpoint's learned
``logit_scale`` would otherwise become a CLOOB run's fixed one. Only the weights start the run: the optimiser's
state, the schedule and the data order are the run's.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloob_core import publish, storage
from cloob_core.config import ConfigError
from cloob_core.io import file_digest, write_json
from cloob_core.model.files import CONFIG_FILE, EARLIER_STATE_FILE, LOCAL_DIR, STATE_FILE
from cloob_core.model.store import check_production_weights, production_folder

if TYPE_CHECKING:
    from cloob_core.model.dual_encoder import CLOOBModel

HF_HUB = "hf-hub:"
PRODUCTION = "production"
_WEIGHTS_FILES = (STATE_FILE, "open_clip_pytorch_model.bin", EARLIER_STATE_FILE)  # in a folder, the first found


def load_starting_weights(model: CLOOBModel, init_from: str, store: str) -> str:
    """Load ``init_from``'s weights into ``model`` (see the module); the weights file's SHA-256, as recorded."""
    import open_clip  # here, not above: the starting_weights stage, run by every `dvc repro`, only records
    import torch

    from cloob_core.model.export import load_weights, read_state_dict

    with tempfile.TemporaryDirectory(prefix="cloob-init-") as scratch:
        weights, source_cfg = _locate(init_from, store, Path(scratch))
        architecture = model.config.architecture
        if source_cfg is not None:
            differing = _differences(source_cfg, open_clip.get_model_config(architecture) or {})
            if differing:
                raise ConfigError(f"train.init_from {init_from} is another architecture than model.architecture "
                                  f"{architecture}: {'; '.join(differing[:6])}")
        digest = file_digest(weights)
        state = read_state_dict(weights)
    configured = model.encoder.logit_scale.detach().clone()
    load_weights(model.encoder, state, f"train.init_from {init_from}")
    with torch.no_grad():
        model.encoder.logit_scale.copy_(configured)
    return digest


@dataclass(frozen=True)
class StartingWeights:
    """Which weights ``train.init_from`` names now: the value, the weights file's name and SHA-256 (all None when
    the run starts from random weights)."""

    init_from: str | None
    weights: str | None
    sha256: str | None


def record_starting_weights(init_from: str | None, store: str, output: str | Path) -> StartingWeights:
    """The ``starting_weights`` stage: write which weights ``init_from`` names to ``output`` (JSON, the same bytes
    while they are the same). DVC's train stage depends on this file, so it re-runs when the weights' content
    changes under an unchanged value (a new ``production`` model, a folder overwritten), not only when the value
    changes."""
    record = StartingWeights(None, None, None)
    if init_from:
        record = StartingWeights(init_from, *named_weights(init_from, store))
    write_json(output, asdict(record))
    return record


def named_weights(value: str, store: str, setting: str = "train.init_from") -> tuple[str, str]:
    """The name and SHA-256 of the weights file ``value`` names now (any form of ``init_from``; ``setting`` names
    the value in an error): what a DVC stage records, so a stage re-runs when the weights behind an unchanged
    value change."""
    with tempfile.TemporaryDirectory(prefix="cloob-init-") as scratch:
        weights, _ = _locate(value, store, Path(scratch), setting)
        return weights.name, file_digest(weights)


def _locate(init_from: str, store: str, scratch: Path, setting: str = "train.init_from",
            ) -> tuple[Path, dict[str, Any] | None]:
    """The weights file and, for a folder, its ``model_cfg``."""
    pointer = None
    if init_from == PRODUCTION:
        location, pointer = production_folder(store)
    elif init_from.startswith(HF_HUB):
        return _from_hf_cache(init_from.removeprefix(HF_HUB), setting)
    else:
        location = init_from.removeprefix(LOCAL_DIR)
    if not storage.is_s3(location) and not Path(location).exists():  # (nothing on S3: download_tree names it)
        raise FileNotFoundError(f"{setting} {init_from}: {location} is neither a model folder nor a weights file")
    # checked against a unit published at it or above it (a run's published outputs); S3 fetched into scratch
    local = publish.checked_local(location, scratch / "folder")
    weights, model_cfg = _in_folder(local, f"{setting} {init_from}") if local.is_dir() else (local, None)
    if pointer is not None:
        check_production_weights(weights, pointer, location)
    return weights, model_cfg


def _in_folder(folder: Path, named: str) -> tuple[Path, dict[str, Any] | None]:
    weights = next((folder / name for name in _WEIGHTS_FILES if (folder / name).is_file()), None)
    if weights is None:
        raise FileNotFoundError(f"{named}: {folder} holds none of {', '.join(_WEIGHTS_FILES)}")
    config = folder / CONFIG_FILE
    return weights, _model_cfg(config) if config.is_file() else None


def _from_hf_cache(repo: str, setting: str = "train.init_from") -> tuple[Path, dict[str, Any] | None]:
    """A Hugging Face Hub model folder from the local cache only: a run never reaches the network."""
    from huggingface_hub import try_to_load_from_cache

    def cached(name: str) -> Path | None:
        # the cache's files alone: hf_hub_download, even with local_files_only, asks the Hub for its agent
        # registry (huggingface_hub 1.x's user-agent), and waits out a network that does not answer
        try:
            found = try_to_load_from_cache(repo, name)
        except (ValueError, OSError):  # a name the Hub would not take
            return None
        return Path(found) if isinstance(found, str) and Path(found).is_file() else None

    weights = next(filter(None, map(cached, _WEIGHTS_FILES[:2])), None)
    if weights is None:
        raise FileNotFoundError(f"{setting} {HF_HUB}{repo}: not in the Hugging Face cache (looked for "
                                f"{', '.join(_WEIGHTS_FILES[:2])}); runs read it offline: download it once where the "
                                f"network is (`huggingface-cli download {repo}`, into HF_HOME)")
    config = cached(CONFIG_FILE)
    return weights, _model_cfg(config) if config else None


def hub_folder(name: str) -> Path:
    """The cached snapshot folder of the Hub model ``hf-hub:ORG/NAME``, which open_clip loads as ``local-dir:``
    without reaching the network (a Hub name online would wait out its retries, offline, before failing); one line
    when it is not cached."""
    weights, _ = _from_hf_cache(name.removeprefix(HF_HUB), setting="the model")
    return weights.parent


def _model_cfg(path: Path) -> dict[str, Any]:
    try:
        model_cfg = json.loads(path.read_text(encoding="utf-8")).get("model_cfg")
    except (ValueError, AttributeError) as err:
        raise ConfigError(f"train.init_from: {path} is not an open_clip config ({err})") from None
    if not isinstance(model_cfg, dict):
        raise ConfigError(f"train.init_from: {path} has no model_cfg")
    return model_cfg


def _differences(source: dict[str, Any], target: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: source value ≠ run value`` for each differing leaf of two open_clip model configs."""
    found = []
    for key in sorted(set(source) | set(target)):
        a, b = source.get(key), target.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}: {a!r} in the weights' config, {b!r} in the run's")
    return found
