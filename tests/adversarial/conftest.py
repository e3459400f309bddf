"""Fixtures the adversarial cases share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def weights(tmp_path_factory) -> Path:
    """A state dict of the cloob-tiny architecture, as ``cloob eval --architecture cloob-tiny --weights`` reads."""
    import torch

    from cloob_core.config import ModelConfig
    from cloob_core.model.dual_encoder import build_model

    path = tmp_path_factory.mktemp("model") / "weights.pt"
    torch.save(build_model(ModelConfig()).encoder.state_dict(), path)
    return path
