"""The model store's production pointer, read: which model is in production and where its folder is. The
promotion gate (:mod:`cloob_core.ops.promotion`) writes it; training reads it to start from production's weights
(``train.init_from: production``), so the reading lives here, below both."""

from __future__ import annotations

import json
from typing import Any

from cloob_core import conditional_write, storage
from cloob_core.errors import StageError

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
