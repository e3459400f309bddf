"""ViT-B-32's towers learn with CLOOB's default start on this CPU (docs/objectives.md, "ViT-B-32 itself").

`--preset vit-b-cpu` is the cheapest configuration found in which CLIP learns on ViT-B-32 itself here: batch 32, lr
1e-4 after a 10-step warm-up, one cosine, 120 steps on the packaged captioned pairs (at open_clip's ViT-B-32 recipe
scaled to this batch, lr 5e-4 after 20 steps, CLIP's towers fall into one direction within 20 steps, as CLOOB's do).
On ViT-B-32 itself it takes about 10 s a step (`cloob train --preset vit-b-cpu`, 20 minutes a run; the figures are
in the docs). The test runs it on `cloob-vit-b-32-64px`: ViT-B-32's towers, every layer and width the same, at 64-px
images and a 16-token context, so only the positional embeddings are shorter. It starts in ViT-B-32's cone (mean
cosine 0.86 / 0.79 on the captioned photos and captions, against 0.86 / 0.84), sits at ln N with CLIP under the fast
recipe as ViT-B-32 does, and takes about 1.5 s a step. CLOOB with the default start (no retrieval for the warm-up,
then until a batch is 5% below the collapsed value) crosses into Hopfield retrieval and ends below its collapsed
value; with the paper's start, retrieval from the first step, it collapses (+0.0001, the detector's line at step
25)."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.slow

STAND_IN = ["model.architecture=cloob-vit-b-32-64px", "train.steps=40", "train.log_every=10",
            "train.checkpoint_every=1000", "train.tensorboard=false", "train.seed=0"]


def run(shards, output) -> dict:
    from cloob_core.config import load_config
    from cloob_core.training.loop import train

    config = load_config(preset="vit-b-cpu", overrides=[f"train.shards={shards}", *STAND_IN])
    return train(config, output, progress=False).metrics


def test_cloob_with_the_default_start_learns_on_vit_b_32s_towers(captioned_train_shards, tmp_path):
    """CLOOB alone, 40 steps: CLIP's run on the same configuration (+0.4071 below ln 32 at 60 steps) is in
    docs/objectives.md, for CI's time (the two runs of 60 steps took 698 s of a CI worker; CLOOB's is the faster)."""
    cloob = run(captioned_train_shards, tmp_path / "cloob")
    assert cloob["objective"] == "cloob" and cloob["collapsed_loss"] == pytest.approx(2 * math.log(31) / 30, abs=1e-6)
    assert 10 <= cloob["retrieval_from_step"] < 30, cloob  # after the warm-up, with 10 or more steps of retrieval
    # 0.0087 here at 40 steps, 0.0158 at 60 (+0.0001 with the paper's start, which the detector names at step 25):
    # at least 5 times the detector's band of 0.1% of the collapsed value, with room for another CPU's rounding
    assert cloob["collapse_margin"] >= 0.005 and cloob["collapse_detected_at_step"] is None, cloob
