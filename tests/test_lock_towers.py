"""Locking a tower (LiT, open_clip's --lock-image / --lock-text): after 20 training steps a locked tower is
bit-identical to its start and none of its parameters is in the optimiser's groups; with unlocked groups or layers,
exactly those change. A ResNet image tower locks only whole, said in one line."""

from __future__ import annotations

import pytest
import torch

from cloob_core.config import ConfigError, load_config
from cloob_core.model.dual_encoder import build_model, lock_towers
from cloob_core.training.loop import train


def _state(run) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in run.model.state_dict().items()}


def _run(shards, tmp_path, *settings: str):
    config = load_config(overrides=[f"train.shards={shards}", "train.steps=20", "train.batch_size=32",
                                    "train.workers=0", "train.tensorboard=false", "train.data_streams=4",
                                    "model.architecture=cloob-tiny-vit", "optim.warmup_steps=2", *settings])
    torch.manual_seed(0)
    start = {name: value.detach().clone() for name, value in build_model(config.model).state_dict().items()}
    result = train(config, tmp_path / "run", progress=False)
    return config, start, {name: value.detach() for name, value in result.model.state_dict().items()}


def _changed(start, end, prefix: str) -> set[str]:
    return {name for name in start if name.startswith(prefix) and not torch.equal(start[name], end[name])}


def test_a_locked_tower_stays_bit_identical_and_leaves_the_optimiser(mnist_train_shards, tmp_path):
    config, start, end = _run(mnist_train_shards, tmp_path, "train.lock_image=true", "train.lock_text=true",
                              "train.lock_text_unlocked_layers=1")
    assert not _changed(start, end, "encoder.visual.")  # the whole image tower, bit for bit
    text = _changed(start, end, "encoder.")
    assert text and all(name.startswith(("encoder.transformer.resblocks.1.", "encoder.ln_final",
                                         "encoder.text_projection")) for name in text), sorted(text)
    model = build_model(config.model)
    lock_towers(model, config.train)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert not any(name.startswith("encoder.visual.") for name in trainable)
    assert "encoder.transformer.resblocks.0.attn.in_proj_weight" not in trainable
    from cloob_core.training.optim import build_optimizer

    optimised = {id(p) for group in build_optimizer(model, config.optim).param_groups for p in group["params"]}
    assert optimised == {id(p) for p in model.parameters() if p.requires_grad}


def test_unlocked_image_groups_are_exactly_the_ones_that_change(mnist_train_shards, tmp_path):
    _, start, end = _run(mnist_train_shards, tmp_path, "train.lock_image=true", "train.lock_image_unlocked_groups=1")
    assert _changed(start, end, "encoder.visual.") == {"encoder.visual.proj"}  # the last group: the projection
    assert _changed(start, end, "encoder.token_embedding")  # the text tower trains


def test_a_resnet_image_tower_locks_only_whole():
    config = load_config(overrides=["train.lock_image=true", "train.lock_image_unlocked_groups=2"])
    with pytest.raises(ConfigError, match=r"locks only whole"):
        lock_towers(build_model(config.model), config.train)


def test_a_resnet_tower_locked_with_frozen_statistics_stays_whole_and_exports(mnist_train_shards, tmp_path):
    import open_clip

    config = load_config(overrides=[f"train.shards={mnist_train_shards}", "train.steps=6", "train.batch_size=32",
                                    "train.workers=0", "train.tensorboard=false", "train.data_streams=4",
                                    "train.lock_image=true", "train.lock_image_freeze_bn_stats=true"])
    torch.manual_seed(0)
    start = {name: value.detach().clone() for name, value in build_model(config.model).state_dict().items()}
    end = train(config, tmp_path / "run", progress=False).model.state_dict()
    visual = [name for name in start if name.startswith("encoder.visual.") and "num_batches_tracked" not in name]
    assert visual and all(torch.equal(start[name], end[name]) for name in visual)  # running statistics included
    loaded, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'run' / 'model'}")
    assert torch.equal(loaded.state_dict()["visual.bn1.running_mean"], start["encoder.visual.bn1.running_mean"])


NOTHING_TO_TRAIN = [
    ("train.lock_image=true", "train.lock_text=true"),
    ("train.lock_image=true", "train.lock_text=true", "train.objective=clip"),
    ("train.lock_image=true", "train.lock_text=true", "train.objective=pvc_geometric", "train.image_views=2"),
]


@pytest.mark.parametrize("settings", NOTHING_TO_TRAIN)
def test_a_configuration_with_nothing_to_train_is_refused_when_it_is_checked(tmp_path, settings, capsys):
    """Both towers locked whole with a fixed temperature leaves no parameter to train: refused by the configuration
    check (`cloob config` refuses it too), in one line naming the ways out, before a model or a shard is read (the
    shards here do not exist). The commands run in this process; the first case also as `python -m cloob_core.cli`,
    the entry point a user starts."""
    import subprocess
    import sys

    from cloob_core.cli import main

    with pytest.raises(ConfigError, match=r"nothing would train.*model\.learn_inv_tau"):
        load_config(overrides=list(settings))
    overrides = [flag for setting in settings for flag in ("--set", setting)]
    for command in (["config"], ["train", "--shards", str(tmp_path / "none"), "--output", str(tmp_path / "run")]):
        outcomes = [(main([*command, *overrides]), capsys.readouterr().err)]
        if settings == NOTHING_TO_TRAIN[0]:
            done = subprocess.run([sys.executable, "-m", "cloob_core.cli", *command, *overrides],
                                  capture_output=True, text=True, timeout=120)
            outcomes.append((done.returncode, done.stderr))
        for code, err in outcomes:
            assert code == 2 and "Traceback" not in err, err
            (line,) = err.strip().splitlines()
            assert "nothing would train" in line and "unlock a tower" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("way_out", ["model.learn_inv_tau=true", "train.objective=siglip",
                                     "train.lock_text_unlocked_layers=1", "train.lock_image=false"])
def test_each_way_out_named_leaves_something_to_train(way_out):
    config = load_config(overrides=["train.lock_image=true", "train.lock_text=true",
                                    "model.architecture=cloob-tiny-vit", way_out])
    from cloob_core.objectives.registry import objective_from_config
    from cloob_core.training.optim import build_optimizer

    model = build_model(config.model)
    lock_towers(model, config.train)
    optimiser = build_optimizer(model, config.optim, objective_from_config(config))
    assert sum(p.numel() for group in optimiser.param_groups for p in group["params"]) > 0


def test_the_optimiser_refuses_a_model_with_nothing_to_train():
    """What the configuration check cannot see (a model whose every parameter is frozen another way) is refused
    by the optimiser in one line, not by autograd's "element 0 of tensors does not require grad" at the first
    backward."""
    config = load_config()
    model = build_model(config.model)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    from cloob_core.training.optim import build_optimizer

    with pytest.raises(ConfigError, match="nothing would train"):
        build_optimizer(model, config.optim)
