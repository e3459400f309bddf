"""The model store's production pointer, read: which model is in production and where its folder is. The
promotion gate (:mod:`cloob_core.ops.promotion`) writes it; training reads it to start from production's weights
(``train.init_from: production``), so the reading lives here, below both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cloob_core import conditional_write, storage
from cloob_core.errors import StageError
from cloob_core.io import file_digest

POINTER = "production.json"


class StoreError(StageError):
    """The model store's pointer cannot be read, or names no model."""


def read_pointer(store: str) -> tuple[dict[str, Any] | None, str | None]:
    """The production pointer and its version (for the conditional write that replaces it); None when absent."""
    location = storage.join(store, POINTER)
    raw, version = conditional_write.read_versioned(location)
    if raw is None:
        return None, None
    try:
        return json.loads(raw), version
    except ValueError as err:
        raise StoreError(f"{location} is not valid JSON ({err}); restore it from {store}/history") from None


def production_folder(store: str) -> tuple[str, dict[str, Any]]:
    """The folder of the production model of ``store`` and its pointer."""
    pointer, _ = read_pointer(store)
    if pointer is None or not isinstance(pointer.get("model"), str):
        raise StoreError(f"{store} has no production model yet: run the training pipeline first")
    return pointer["model"], pointer


def weights_id(weights: str | Path) -> str:
    """A model's id in the store: the first 16 hex digits of its weights file's SHA-256 (content-addressed)."""
    return file_digest(weights)[:16]


def check_production_weights(weights: str | Path, pointer: dict[str, Any], folder: str) -> None:
    """The production model's weights, read from ``folder``, are the ones the pointer names by id."""
    if pointer.get("model_id") and weights_id(weights) != pointer["model_id"]:
        raise StoreError(f"{storage.join(folder, Path(weights).name)} is not the weights of production model "
                         f"{pointer['model_id']} (their digest begins {weights_id(weights)}): changed after they "
                         "were promoted; restore them, or promote a model again")
