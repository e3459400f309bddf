"""The exported model folder is what open_clip's own loaders read: checked with plain open_clip in a fresh
process that imports nothing of ours, against what our evaluation computes from the same folder."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cloob_core.config import ModelConfig
from cloob_core.model.dual_encoder import build_model
from cloob_core.model.export import export_model
from cloob_core.model.files import CONFIG_FILE, INFO_FILE, STATE_FILE
from cloob_core.model.source import ModelSource, load_model

CAPTIONS = ["a photo of a dog.", "the digit 3, written by hand."]

# What a user of the folder runs: nothing but open_clip. It prints what it computed as JSON, and which modules of
# ours were imported (none may be).
PLAIN_OPEN_CLIP = """
import json, sys, torch, open_clip
from PIL import Image
name, image = sys.argv[1], Image.open(sys.argv[2])
model, _, preprocess = open_clip.create_model_and_transforms(name)
model.eval()  # as open_clip's README does
tokenizer = open_clip.get_tokenizer(name)
tokens = tokenizer(json.loads(sys.argv[3]))
with torch.no_grad():
    pixels = preprocess(image)[None]
    print(json.dumps({"pixels": pixels.tolist(), "tokens": tokens.tolist(),
                      "image": model.encode_image(pixels, normalize=True).tolist(),
                      "text": model.encode_text(tokens, normalize=True).tolist(),
                      "inv_tau": model.logit_scale.exp().item(),
                      "ours": sorted(m for m in sys.modules if m.startswith("cloob"))}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = build_model(ModelConfig(architecture="cloob-tiny", inv_tau=20.0))
    with torch.no_grad():  # away from the initial values, so that loading nothing cannot pass
        for name, parameter in model.encoder.named_parameters():
            if name != "logit_scale":  # ln(inv_tau), checked below
                parameter.add_(0.01 * torch.randn_like(parameter))
    folder = export_model(model, tmp_path_factory.mktemp("export") / "model", {"steps": 1})
    image = tmp_path_factory.mktemp("image") / "photo.png"
    pixels = np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8)  # not square, not 32×32
    Image.fromarray(pixels).save(image)
    return folder, image


def plain_open_clip(name: str, image: Path, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", PLAIN_OPEN_CLIP, name, str(image), json.dumps(CAPTIONS)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
                          cwd=image.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_same_as_our_evaluation(plain: dict, folder: Path, image: Path) -> None:
    ours = load_model(ModelSource(model=str(folder)))
    assert not plain["ours"], f"plain open_clip imported {plain['ours']}"
    pixels = ours.transform(Image.open(image))[None]
    torch.testing.assert_close(torch.tensor(plain["pixels"]), pixels)
    tokens = ours.tokenizer(CAPTIONS)
    assert plain["tokens"] == tokens.tolist() and tokens.shape[1] == 16  # cloob-tiny's context, not 77
    torch.testing.assert_close(torch.tensor(plain["image"]), ours.encode_images(pixels))
    torch.testing.assert_close(torch.tensor(plain["text"]), ours.encode_texts(tokens))
    assert plain["inv_tau"] == pytest.approx(ours.inv_tau) == pytest.approx(20.0)


def test_plain_open_clip_loads_the_export_with_local_dir(exported):
    folder, image = exported
    assert_same_as_our_evaluation(plain_open_clip(f"local-dir:{folder}", image), folder, image)


def test_a_folder_pushed_to_the_hugging_face_hub_loads_with_hf_hub(exported, tmp_path):
    """The Hub's client, offline, reads the folder from its cache as it would after ``hf download``: the files
    of the repository at its root, under a snapshot that ``refs/main`` names."""
    folder, image = exported
    revision = "0" * 40
    snapshot = tmp_path / "hub" / "models--cloob--tiny" / "snapshots" / revision
    shutil.copytree(folder, snapshot)
    (tmp_path / "hub" / "models--cloob--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--cloob--tiny" / "refs" / "main").write_text(revision)
    plain = plain_open_clip("hf-hub:cloob/tiny", image, {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert_same_as_our_evaluation(plain, folder, image)


def test_the_export_holds_no_pickle(exported):
    folder, _ = exported
    assert sorted(path.name for path in folder.iterdir()) == sorted([CONFIG_FILE, INFO_FILE, STATE_FILE])
    header = int.from_bytes((folder / STATE_FILE).read_bytes()[:8], "little")  # safetensors: length, then JSON
    assert json.loads((folder / STATE_FILE).read_bytes()[8:8 + header])
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert config["model_cfg"]["embed_dim"] == 64 and config["preprocess_cfg"]["interpolation"] == "bicubic"


def test_a_folder_in_the_earlier_layout_still_loads(exported, tmp_path):
    """A production model promoted before the export moved to safetensors (``open_clip_model.pt``, the
    architecture's config as ``cloob-tiny.json``) is evaluated as it was, to the same embeddings."""
    import open_clip

    from cloob_core.io import file_digest

    folder, image = exported
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    state = load_model(ModelSource(model=str(folder))).model.state_dict()
    torch.save(state, earlier / "open_clip_model.pt")
    (earlier / "cloob-tiny.json").write_text(json.dumps(open_clip.get_model_config("cloob-tiny")))
    info = json.loads((folder / INFO_FILE).read_text())
    (earlier / INFO_FILE).write_text(json.dumps({**info, "open_clip_config": "cloob-tiny.json",
                                                 "state_dict": "open_clip_model.pt", "tokenizer": "cloob-tiny"}))
    now, then = load_model(ModelSource(model=str(folder))), load_model(ModelSource(model=str(earlier)))
    pixels = now.transform(Image.open(image))[None]
    torch.testing.assert_close(then.encode_images(then.transform(Image.open(image))[None]), now.encode_images(pixels))
    assert then.tokenizer(CAPTIONS).tolist() == now.tokenizer(CAPTIONS).tolist()
    assert then.fingerprint == file_digest(earlier / "open_clip_model.pt")[:16] != now.fingerprint
