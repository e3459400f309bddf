"""The training images' fast path keeps open_clip's transforms' meaning, and the thread budget its rules."""

from __future__ import annotations

import io
import random
import subprocess
import sys

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image
from torchvision import transforms

from cloob_core.threads import SPIN_COUNTS, plan_threads
from cloob_core.training.images import Normalize, TrainImages


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    smooth = rng.random((height // 8 + 1, width // 8 + 1, 3)) * 255  # blocks, so the JPEG is not all noise
    pixels = np.kron(smooth, np.ones((8, 8, 1)))[:height, :width].astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return out.getvalue()


@pytest.mark.parametrize("width,height", [(256, 300), (300, 256), (1000, 90), (90, 1000), (40, 40)])
def test_the_draft_never_leaves_a_crop_smaller_than_the_output(width, height):
    images = TrainImages(32)
    decoded = images.decode(jpeg(width, height))
    if min(width, height) >= 4 * 40:  # room for at least a 1/2 DCT scale at a 32-px output
        assert decoded.width < width and decoded.height < height
    rng = random.Random(0)
    for _ in range(300):
        _left, _top, w, h = images._box(decoded.width, decoded.height, rng)
        assert w >= 32 or w == decoded.width
        assert h >= 32 or h == decoded.height


def test_the_crop_draws_torchvisions_distribution():
    """Area fraction within scale, aspect within ratio, and the same mean area as torchvision's draws."""
    images, rng = TrainImages(32), random.Random(1)
    ours = [images._box(256, 256, rng) for _ in range(4000)]
    fractions = [w * h / 256**2 for _l, _t, w, h in ours]
    assert min(fractions) >= 0.89 and max(fractions) <= 1.0
    assert all(3 / 4 - 0.02 <= w / h <= 4 / 3 + 0.02 for _l, _t, w, h in ours)
    torch.manual_seed(1)
    theirs = [transforms.RandomResizedCrop.get_params(torch.empty(3, 256, 256), (0.9, 1.0), (3 / 4, 4 / 3))
              for _ in range(4000)]
    assert np.mean(fractions) == pytest.approx(np.mean([h * w / 256**2 for _i, _j, h, w in theirs]), abs=0.004)


def test_uint8_crops_normalised_per_batch_equal_open_clips_transform():
    """Without augmentation, the fast path is open_clip's evaluation transform up to resampling rounding."""
    data = jpeg(64, 80, seed=3)
    images = TrainImages(32, augment=False)
    ours = Normalize(open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)(
        torch.from_numpy(images.crop(images.decode(data), random.Random(0))).permute(2, 0, 1)[None])[0]
    reference = open_clip.image_transform(32, is_train=False)(Image.open(io.BytesIO(data)))
    assert ours.shape == reference.shape == (3, 32, 32)
    assert (ours - reference).abs().mean() < 0.05  # in units of the std; a one-pixel shift gives ~0.5


def test_normalize_is_totensor_then_normalize():
    crops = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.6, 0.7)
    reference = torch.stack([transforms.Normalize(mean, std)(c.float() / 255) for c in crops])
    assert torch.allclose(Normalize(mean, std)(crops), reference, atol=1e-6)


def test_the_thread_budget():
    assert plan_threads(cores=8, ranks_here=1).torch_threads == 8  # the CPU step takes every core
    assert plan_threads(cores=8, ranks_here=2, workers=2).torch_threads == 4  # ranks of a node split them
    assert plan_threads(cores=8, ranks_here=1, workers=6, device_type="cuda").torch_threads == 2  # workers first
    assert plan_threads(cores=4, ranks_here=1, workers=6, device_type="cuda").torch_threads == 1  # at least one
    assert plan_threads(3, cores=8, ranks_here=1).torch_threads == 3  # the setting wins


def test_usable_cores_follow_the_cpu_affinity():
    """A process allowed one core gets a budget of one core, whatever the machine has."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from cloob_core.threads import usable_cores; print(usable_cores())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_loading_cloob_core_limits_openmp_spinning():
    assert int(_spin_count_after("import cloob_core")) < 300_000  # libgomp's default


def _spin_count_after(code: str, environ: dict[str, str] | None = None) -> str:
    """GOMP_SPINCOUNT once ``code`` has run in a fresh interpreter."""
    env = {"PATH": "/usr/bin:/bin", **(environ or {})}
    out = subprocess.run([sys.executable, "-c", code + "\nimport os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         capture_output=True, text=True, check=True, env=env)
    return out.stdout.strip().splitlines()[-1]


def test_an_evaluation_command_spins_less_than_training():
    """`cloob eval` sets the coarse grain's count before its handler loads torch; other commands keep the fine."""
    run = "from cloob_core.cli import main\nmain([{}, '--metrics', '/nonexistent/metrics.json'])"
    evaluation = _spin_count_after(run.format("'eval', 'summary'"))
    assert evaluation == SPIN_COUNTS["coarse"]
    assert int(evaluation) < int(SPIN_COUNTS["fine"])
    assert _spin_count_after("import cloob_core") == SPIN_COUNTS["fine"]


def test_spinning_is_left_alone_once_torch_is_loaded_or_set_by_the_user():
    coarse = "from cloob_core.threads import limit_spinning\nlimit_spinning('coarse')"
    assert _spin_count_after("import cloob_core, torch\n" + coarse) == SPIN_COUNTS["fine"]  # libgomp has read it
    assert _spin_count_after(coarse, {"GOMP_SPINCOUNT": "5"}) == "5"
    # ours, inherited from a parent that imported cloob_core, is not the user's
    assert _spin_count_after(coarse, {"GOMP_SPINCOUNT": SPIN_COUNTS["fine"]}) == SPIN_COUNTS["coarse"]
