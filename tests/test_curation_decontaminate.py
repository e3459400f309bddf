"""Decontamination tells copies from look-alikes (issue 79, point 3): drawn pictures unlike the packaged sets as the
evaluation set; in the pool, their copies (re-encoded smaller, cropped, given a border) beside look-alikes that a
64-bit perceptual hash puts within a few bits (the same drawing in other colours: pHash reads luminance only)."""

from __future__ import annotations

import io
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from crawl import picture
from PIL import Image, ImageOps

from cloob_core.config import load_config
from cloob_core.curation.copies import copy_similarity, copy_view
from cloob_core.curation.curate import KEPT_FILE, curate
from cloob_core.curation.facts import perceptual_hash
from cloob_core.curation.score import ScoreRequest, score
from cloob_core.model.source import ModelSource

SEEDS = range(100, 116)


def _drawing(seed: int) -> Image.Image:
    return Image.open(io.BytesIO(picture(seed, (120 + 7 * seed % 50, 90 + 11 * seed % 60)))).convert("RGB")


def _recoloured(image: Image.Image) -> Image.Image:
    """The same drawing in the complementary colours, its luminance kept: another picture with the same pHash."""
    luma, blue, red = image.convert("YCbCr").split()
    return Image.merge("YCbCr", (luma, blue.point(lambda v: 255 - v), red.point(lambda v: 255 - v))).convert("RGB")


def _smaller_jpeg(image: Image.Image) -> Image.Image:
    return image.resize((image.width * 4 // 5, image.height * 4 // 5), Image.BICUBIC)


def _cropped(image: Image.Image) -> Image.Image:
    dx, dy = round(image.width * 0.06), round(image.height * 0.04)  # not the hashed crop of 5% exactly
    return image.crop((dx, dy, image.width - dx, image.height - dy))


def _bordered(image: Image.Image) -> Image.Image:
    return ImageOps.expand(image, border=round(0.07 * max(image.size)), fill=(250, 250, 250))


COPIES = {"smaller-jpeg": _smaller_jpeg, "cropped": _cropped, "bordered": _bordered}


def _encoded(image: Image.Image, kind: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=kind, quality=80)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def contaminated(tmp_path_factory, untrained_export):
    """An evaluation folder of 16 drawings; a pool of their copies and recoloured look-alikes, with other drawings,
    scored by the untrained model."""
    from cloob_core.data.writer import ShardWriter

    root = tmp_path_factory.mktemp("contaminated")
    (root / "evaluation" / "drawings").mkdir(parents=True)
    (root / "pool").mkdir()
    kinds = {}
    with open(root / "pool" / "00000.tar", "wb") as handle, ShardWriter(handle) as writer:
        for seed in SEEDS:
            drawing = _drawing(seed)
            drawing.save(root / "evaluation" / "drawings" / f"{seed}.png")
            samples = {f"{name}-{seed}": (edit(drawing), "JPEG" if name == "smaller-jpeg" else "PNG")
                       for name, edit in COPIES.items()}
            samples[f"look-alike-{seed}"] = (_recoloured(drawing), "PNG")
            samples[f"other-{seed}"] = (_drawing(seed + 1_000), "PNG")
            for key, (image, kind) in samples.items():
                writer.write(key, _encoded(image, kind), "a drawing", {"url": f"http://crawl.example/{key}"})
                kinds[key] = key.rsplit("-", 1)[0]
    score(ScoreRequest(str(root / "pool"), ModelSource(model=str(untrained_export), device="cpu"),
                       str(root / "scores"), workers=0, progress=False))
    return root, kinds


def _removed(contaminated, untrained_export, output, *settings: str) -> dict[str, list[str]]:
    """Each removed sample's key and evidence."""
    root, _ = contaminated
    config = load_config(overrides=[f"curation.decontaminate=[{root / 'evaluation'}]", *settings])
    curate(str(root / "pool"), str(root / "scores"), str(output), config,
           ModelSource(model=str(untrained_export), device="cpu"))
    return {row["key"]: row["evidence"] for row in pq.read_table(output / KEPT_FILE).to_pylist() if not row["kept"]}


def test_copies_are_removed_and_look_alikes_within_the_hash_kept(contaminated, untrained_export, tmp_path):
    _, kinds = contaminated
    near = [(perceptual_hash(_recoloured(_drawing(seed))) ^ perceptual_hash(_drawing(seed))).bit_count()
            for seed in SEEDS]
    assert sum(bits <= 6 for bits in near) >= 12, near  # within the candidate distance: the hash alone removes them
    removed = _removed(contaminated, untrained_export, tmp_path / "curated")
    copies = {key for key, kind in kinds.items() if kind in COPIES}
    assert copies <= set(removed), sorted(copies - set(removed))
    assert set(removed) == copies, sorted(set(removed) - copies)  # no look-alike, no other drawing
    for key, (evidence,) in removed.items():  # the evaluation image each copies (sorted by name), and how alike
        position = int(key.rsplit("-", 1)[1]) - SEEDS.start
        pattern = rf"copies \S+:{position} \(similarity (0\.9[7-9]\d|1\.000), \d+ bits, cosine -?\d\.\d{{3}}\)"
        assert re.fullmatch(pattern, evidence), (key, evidence)


def test_without_the_pixel_check_a_look_alike_is_taken_for_a_copy(contaminated, untrained_export, tmp_path):
    """min_similarity null: every candidate by hash removed unchecked (the untrained model's embeddings, all
    alike, are left out: at a cosine of 0.95 every image would be a candidate)."""
    _, kinds = contaminated
    removed = _removed(contaminated, untrained_export, tmp_path / "curated",
                       "curation.decontaminate_min_similarity=null", "curation.decontaminate_min_cosine=1.0")
    assert {key for key in removed if kinds[key] == "look-alike"}


def test_a_copy_is_alike_and_a_recolouring_is_not():
    drawing = _drawing(7)
    view = copy_view(drawing)
    assert copy_similarity(view, view) == pytest.approx(1.0, abs=1e-4)
    for edit in COPIES.values():
        edited = copy_view(Image.open(io.BytesIO(_encoded(edit(drawing), "JPEG"))).convert("RGB"))
        assert copy_similarity(edited, view) >= 0.95
        assert copy_similarity(view, edited) == pytest.approx(copy_similarity(edited, view), abs=1e-5)
    assert copy_similarity(copy_view(_recoloured(drawing)), view) < 0.5
    assert copy_similarity(copy_view(_drawing(8)), view) < 0.9
    grey = copy_view(drawing.convert("L").convert("RGB"))  # a grey copy is compared by its luminance
    assert copy_similarity(grey, view) >= 0.95


def test_blank_images_are_one_picture_only_in_one_colour():
    white, black = (copy_view(Image.new("RGB", (40, 30), colour)) for colour in ("white", "black"))
    assert copy_similarity(white, white) == 1.0
    assert copy_similarity(white, black) == 0.0
    noise = copy_view(Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), np.uint8)))
    assert copy_similarity(noise, white) < 0.5
