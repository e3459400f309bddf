"""Starting a run from existing weights (train.init_from): every parameter at step 0 is the source's (the
temperature is the run's own); a run from our export, from a folder open_clip wrote itself (local-dir:), and from
`production` in a store on moto S3 each train and export a model plain open_clip loads; another architecture is
refused in one line naming the differing keys; a CLIP checkpoint starts a CLOOB run; a resumed run does not read
init_from again; model_info records the starting weights' digest."""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
from types import SimpleNamespace

import open_clip
import pytest
import torch
from safetensors.torch import load_file

from cloob_core import storage
from cloob_core.cli import main
from cloob_core.config import ConfigError, load_config
from cloob_core.model.dual_encoder import build_model
from cloob_core.model.starting_weights import load_starting_weights

RUN = ["--batch-size", "32", "--workers", "0", "--data-streams", "4", "--no-progress", "--no-tensorboard"]


@pytest.fixture(scope="module")
def source(mnist_train_shards, tmp_path_factory):
    """A trained export of cloob-tiny (4 steps), the weights runs start from."""
    output = tmp_path_factory.mktemp("source") / "run"
    assert main(["train", "--shards", str(mnist_train_shards), "--output", str(output), "--steps", "4", *RUN]) == 0
    return output / "model"


def _start(init_from: str, store: str = "models/registry", architecture: str = "cloob-tiny"):
    config = load_config(overrides=[f"model.architecture={architecture}", "model.inv_tau=20"])
    model = build_model(config.model)
    digest = load_starting_weights(model, init_from, store)
    return model, digest


def test_every_parameter_at_step_zero_is_the_sources_but_the_temperature(source):
    model, digest = _start(str(source))
    exported = load_file(source / "open_clip_model.safetensors")
    state = model.encoder.state_dict()
    assert set(state) == set(exported)
    assert all(torch.equal(state[key], exported[key]) for key in state if key != "logit_scale")
    assert float(model.inv_tau) == pytest.approx(20.0)  # the run's model.inv_tau, not the source's 30
    assert digest == hashlib.sha256((source / "open_clip_model.safetensors").read_bytes()).hexdigest()


def test_a_run_from_our_export_trains_records_its_start_and_exports_for_open_clip(source, mnist_train_shards,
                                                                                    tmp_path):
    output = tmp_path / "run"
    assert main(["train", "--shards", str(mnist_train_shards), "--output", str(output), "--steps", "3",
                 "--set", f"train.init_from={source}", *RUN]) == 0
    info = json.loads((output / "model" / "model_info.json").read_text())
    digest = hashlib.sha256((source / "open_clip_model.safetensors").read_bytes()).hexdigest()
    assert info["init_from"] == f"{source} (sha256 {digest})"
    loaded, _, _ = open_clip.create_model_and_transforms(f"local-dir:{output / 'model'}")
    assert loaded.visual is not None


def test_a_folder_open_clip_wrote_starts_a_run(mnist_train_shards, tmp_path):
    save_for_hf = importlib.import_module("open_clip.push_to_hf_hub").save_for_hf
    from cloob_core.model.dual_encoder import register_project_configs

    register_project_configs()
    torch.manual_seed(7)
    theirs = open_clip.create_model("cloob-tiny")
    folder = tmp_path / "theirs"
    no_hf_tokenizer = SimpleNamespace(save_pretrained=lambda folder: None)  # CLIP's BPE ships with open_clip
    save_for_hf(theirs, no_hf_tokenizer, open_clip.get_model_config("cloob-tiny"), str(folder),
                safe_serialization=True)
    model, _ = _start(f"local-dir:{folder}")
    ours = model.encoder.state_dict()
    assert all(torch.equal(ours[key], value) for key, value in theirs.state_dict().items() if key != "logit_scale")
    output = tmp_path / "run"
    assert main(["train", "--shards", str(mnist_train_shards), "--output", str(output), "--steps", "2",
                 "--set", f"train.init_from=local-dir:{folder}", *RUN]) == 0
    open_clip.create_model_and_transforms(f"local-dir:{output / 'model'}")


def test_production_on_s3_starts_a_run(source, mnist_train_shards, s3_bucket, tmp_path):
    store = f"s3://{s3_bucket}/store"
    storage.upload_tree(source, f"{store}/models/abc")
    storage.write_bytes(f"{store}/production.json", json.dumps({"model": f"{store}/models/abc"}).encode())
    model, _ = _start("production", store)
    exported = load_file(source / "open_clip_model.safetensors")
    assert torch.equal(model.encoder.state_dict()["visual.conv1.weight"], exported["visual.conv1.weight"])
    output = tmp_path / "run"
    assert main(["train", "--shards", str(mnist_train_shards), "--output", str(output), "--steps", "2",
                 "--set", "train.init_from=production", "--set", f"promote.store={store}", *RUN]) == 0
    open_clip.create_model_and_transforms(f"local-dir:{output / 'model'}")


def test_another_architecture_is_refused_in_one_line(source, mnist_train_shards, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"is another architecture than model.architecture cloob-tiny-vit: "):
        _start(str(source), architecture="cloob-tiny-vit")
    assert main(["train", "--shards", str(mnist_train_shards), "--output", str(tmp_path / "run"), "--steps", "2",
                 "--set", f"train.init_from={source}", "--architecture", "cloob-tiny-vit", *RUN]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "vision_cfg.layers: [1, 1, 1, 1] in the weights' config, 2 in the run's" in line
    weights = tmp_path / "weights.pt"  # a bare file has no config: the shapes decide, named
    torch.save(load_file(source / "open_clip_model.safetensors"), weights)
    assert main(["train", "--shards", str(mnist_train_shards), "--output", str(tmp_path / "run2"), "--steps", "2",
                 "--set", f"train.init_from={weights}", "--architecture", "cloob-tiny-vit", *RUN]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "does not fit the architecture" in line and "missing" in line


def test_a_clip_checkpoint_starts_a_cloob_run_with_the_runs_temperature(source, tmp_path):
    """open_clip_train's checkpoint layout: the weights under state_dict, with DDP's module. prefixes, and CLIP's
    learned logit_scale (here 100), which a CLOOB run with its fixed inv_tau does not take."""
    state = {f"module.{key}": value for key, value in load_file(source / "open_clip_model.safetensors").items()}
    state["module.logit_scale"] = torch.tensor(4.6052)
    checkpoint = tmp_path / "epoch_32.pt"
    torch.save({"epoch": 32, "name": "clip", "state_dict": state}, checkpoint)
    model, _ = _start(str(checkpoint))
    assert float(model.inv_tau) == pytest.approx(20.0)
    assert torch.equal(model.encoder.state_dict()["visual.conv1.weight"], state["module.visual.conv1.weight"])


def test_a_resumed_run_does_not_read_init_from_again(source, mnist_train_shards, tmp_path):
    start = tmp_path / "start"
    shutil.copytree(source, start)
    output = tmp_path / "run"
    assert main(["train", "--shards", str(mnist_train_shards), "--output", str(output), "--steps", "4",
                 "--checkpoint-every", "2", "--set", f"train.init_from={start}", *RUN]) == 0
    finished = load_file(output / "model" / "open_clip_model.safetensors")
    recorded = json.loads((output / "model" / "model_info.json").read_text())["init_from"]
    for name in ("step-00000004.pt", "step-00000004.pt.sha256"):
        (output / "checkpoints" / name).unlink()
    shutil.rmtree(start)  # gone: a resume must not need it
    assert main(["train", "--output", str(output), "--resume", "latest", "--no-progress"]) == 0
    resumed = load_file(output / "model" / "open_clip_model.safetensors")
    assert all(torch.equal(resumed[key], finished[key]) for key in finished)
    assert json.loads((output / "model" / "model_info.json").read_text())["init_from"] == recorded


def test_the_kubeflow_training_step_starts_from_production_in_the_store(source, mnist_train_shards, s3_bucket,
                                                                         tmp_path):
    """A scheduled retraining's step: the run parameters say train.init_from production, the step reads the
    store's pointer on S3 and continues from that model."""
    from cloob_core.ops import kubeflow

    store = f"s3://{s3_bucket}/store"
    storage.upload_tree(source, f"{store}/models/prod")
    storage.write_bytes(f"{store}/production.json", json.dumps({"model": f"{store}/models/prod"}).encode())
    params = {"train": {"init_from": "production", "steps": 2, "batch_size": 32, "workers": 0, "data_streams": 4,
                        "tensorboard": False}, "promote": {"store": store}}
    facts = kubeflow.train(params, str(mnist_train_shards), str(tmp_path / "out"))
    info = json.loads((tmp_path / "out" / "model" / "model_info.json").read_text())
    digest = hashlib.sha256((source / "open_clip_model.safetensors").read_bytes()).hexdigest()
    assert info["init_from"] == f"production (sha256 {digest})" and facts
