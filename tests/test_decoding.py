"""Decoding at the scale the output needs (cloob_core/data/decoding.py), for the download stage and training.

The reduction taken is the largest that still covers the need (so nothing the output needs is lost, and the odd
side of an exact 2:1 shrink no longer forces a full decode); the stored result is what a full decode gives up to
a measured difference, in every EXIF orientation; and training decodes by the same rule.
"""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_sample_images

from cloob_core.config import PreprocessConfig
from cloob_core.data.decoding import decode_reduced, reduction
from cloob_core.data.imaging import full_decode_reference, process_image
from cloob_core.training.images import TrainImages


def _photo(width: int, height: int, seed: int = 0, quality: int = 90, exif: Image.Exif | None = None) -> bytes:
    """A real photograph at its own scale (a crop of scikit-learn's samples, tiled to reach larger sizes)."""
    rng = random.Random(seed)
    photos = [Image.fromarray(a) for a in load_sample_images().images]
    canvas = Image.new("RGB", (width, height))
    for top in range(0, height, 400):
        for left in range(0, width, 600):
            photo = photos[rng.randrange(2)]
            x, y = rng.randint(0, photo.width - 600), rng.randint(0, photo.height - 400)
            canvas.paste(photo.crop((x, y, x + 600, y + 400)), (left, top))
    out = io.BytesIO()
    canvas.save(out, format="JPEG", quality=quality, **({"exif": exif} if exif is not None else {}))
    return out.getvalue()


def _psnr(a: bytes, b: bytes) -> float:
    x, y = (np.asarray(Image.open(io.BytesIO(v)), dtype=np.float64) for v in (a, b))
    assert x.shape == y.shape
    return 10 * math.log10(255**2 / max(np.mean((x - y) ** 2), 1e-12))


def test_the_reduction_is_the_largest_whose_scale_is_at_least_the_outputs():
    rng = random.Random(0)
    for _ in range(20_000):
        width, height = rng.randint(1, 3000), rng.randint(1, 3000)
        need_w, need_h = rng.uniform(1, width * 1.2), rng.uniform(1, height * 1.2)
        k = reduction(width, height, need_w, need_h)
        assert k in (1, 2, 4, 8)
        if k > 1:  # the decoded image, ceil(size / k), holds the need, and so does its whole-pixel rounding
            assert width / k >= need_w and height / k >= need_h
            assert math.ceil(width / k) >= round(need_w) and math.ceil(height / k) >= round(need_h)
        if k < 8:  # the next reduction would lose detail the output can hold
            assert width / (2 * k) < need_w or height / (2 * k) < need_h
        if need_w == int(need_w) and need_h == int(need_h):  # whole pixels: Pillow's own rule
            floor = min(width // int(need_w), height // int(need_h))
            assert k == next((s for s in (8, 4, 2) if floor >= s), 1)


def test_a_jpeg_decodes_at_the_reduction_and_reports_where_the_original_lies():
    data = _photo(703, 512)  # an odd side: 2:1 is 351.5 (stored as 352), which libjpeg's rounded-up 352 px holds
    for need, k in (((351.5, 256), 2), ((175.75, 128), 4), ((87.875, 64), 8), ((352, 256), 1), ((30, 20), 8)):
        image = Image.open(io.BytesIO(data))
        box = decode_reduced(image, *need)
        assert image.size == (math.ceil(703 / k), math.ceil(512 / k)), need
        assert box == (0, 0, 703 / k, 512 / k)
    png = io.BytesIO()
    Image.open(io.BytesIO(data)).save(png, format="PNG")
    image = Image.open(png)
    assert decode_reduced(image, 88, 64) == (0, 0, 703, 512) and image.size == (703, 512)  # only JPEGs reduce


@pytest.mark.parametrize(("source", "target"), [((1024, 683), 64), ((1024, 683), 256), ((683, 512), 256),
                                                ((512, 771), 64), ((341, 256), 64)])
def test_the_stored_image_is_a_full_decodes_up_to_a_measured_difference(source, target):
    """At most half the source's size, the output takes the reduced path; its size is the full path's and its
    pixels are within 30 dB of it (measured over real photographs: 32-36 dB, docs/performance.md)."""
    config = PreprocessConfig(image_size=target)
    for seed in range(3):
        data = _photo(*source, seed=seed, quality=(75, 90, 95)[seed])
        reduced, full = process_image(data, config), full_decode_reference(data, config)
        assert reduced.jpeg != full  # the reduced path was taken
        assert _psnr(reduced.jpeg, full) > 30, (source, target, seed)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_comes_out_upright_on_the_reduced_path(orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _photo(900, 600, seed=orientation, exif=exif)
    config = PreprocessConfig(image_size=96)
    reduced, full = process_image(data, config), full_decode_reference(data, config)
    expected = (96, 144) if orientation in (5, 6, 7, 8) else (144, 96)
    assert (reduced.width, reduced.height) == expected
    assert Image.open(io.BytesIO(reduced.jpeg)).size == expected == Image.open(io.BytesIO(full)).size
    assert _psnr(reduced.jpeg, full) > 32  # 33.6-35.1 measured; a wrong turn or mirror is ~12 dB


def test_what_needs_no_shrink_of_2x_takes_the_full_path_unchanged():
    """Images shrunk by less than 2x, enlarged, or kept (the packaged sets' 128-px pictures at 256 px), and every
    image that is not a JPEG, give the very bytes of a full decode."""
    for data, target in ((_photo(300, 200), 128), (_photo(300, 200), 256), (_photo(300, 200), 200)):
        config = PreprocessConfig(image_size=target)
        assert process_image(data, config).jpeg == full_decode_reference(data, config)
    png = io.BytesIO()
    Image.open(io.BytesIO(_photo(800, 600))).save(png, format="PNG")
    config = PreprocessConfig(image_size=64)
    assert process_image(png.getvalue(), config).jpeg == full_decode_reference(png.getvalue(), config)


def test_training_decodes_by_the_same_rule():
    images = TrainImages(size=224)
    for width, height in ((2048, 1365), (1024, 683), (703, 512), (300, 200)):
        decoded = images.decode(_photo(width, height))
        k = reduction(width, height, *images._needed(width, height))
        assert decoded.size == (math.ceil(width / k), math.ceil(height / k)) and decoded.mode == "RGB"
    assert reduction(2048, 1365, *images._needed(2048, 1365)) == 4
