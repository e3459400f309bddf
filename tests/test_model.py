import math

import open_clip
import pytest
import torch

from cloob_core.config import ModelConfig
from cloob_core.model.dual_encoder import PAPER_ARCHITECTURES, available_architectures, build_model, build_tokenizer


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model(ModelConfig())


def test_paper_and_project_architectures_are_available():
    assert set(PAPER_ARCHITECTURES) | {"cloob-tiny"} <= set(available_architectures())


def test_forward_returns_unit_embeddings_and_fixed_inv_tau(tiny):
    tokens = build_tokenizer("cloob-tiny")(["a handwritten seven.", "the digit 3, written by hand."])
    images = torch.randn(2, 3, tiny.image_size, tiny.image_size)
    image_features, text_features, inv_tau = tiny(images, tokens)
    assert image_features.shape == text_features.shape == (2, 64)
    torch.testing.assert_close(image_features.norm(dim=-1), torch.ones(2))
    torch.testing.assert_close(text_features.norm(dim=-1), torch.ones(2))
    assert inv_tau.item() == pytest.approx(30.0, rel=1e-6)
    assert not tiny.encoder.logit_scale.requires_grad


def test_learnable_inv_tau_is_clamped_to_1_100():
    model = build_model(ModelConfig(learn_inv_tau=True, inv_tau=50.0))
    assert model.encoder.logit_scale.requires_grad
    with torch.no_grad():
        model.encoder.logit_scale.fill_(math.log(1000.0))
    model.clamp_inv_tau_()
    assert model.inv_tau.item() == pytest.approx(100.0, rel=1e-6)
    with torch.no_grad():
        model.encoder.logit_scale.fill_(math.log(0.01))
    model.clamp_inv_tau_()
    assert model.inv_tau.item() == pytest.approx(1.0, rel=1e-6)


def test_state_dict_loads_into_plain_open_clip(tiny):
    """What we train is a plain open_clip model: create_model(<config>) + load_state_dict takes it."""
    plain = open_clip.create_model("cloob-tiny", pretrained=None)
    plain.load_state_dict(tiny.encoder.state_dict())
    tokens = build_tokenizer("cloob-tiny")(["a handwritten seven."])
    torch.testing.assert_close(plain.encode_text(tokens, normalize=True), tiny.encode_text(tokens))


def test_paper_architecture_builds_without_network():
    model = build_model(ModelConfig(architecture="RN50"))
    assert model.image_size == 224
    assert model.encoder.text_projection.shape[1] == 1024  # RN50's embedding width


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown architecture 'RN5'"):
        build_model(ModelConfig(architecture="RN5"))


def test_building_and_tokenising_never_touch_the_network(monkeypatch):
    """No weights, vocabularies or configs are fetched: any connection attempt fails the test."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    model = build_model(ModelConfig(architecture="ViT-B-32"))
    tokens = build_tokenizer("ViT-B-32")(["a photo of a dog."])
    assert tokens.shape == (1, 77)
    assert model.encode_text(tokens).shape == (1, 512)
