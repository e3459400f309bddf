"""Decontamination's precision and recall: copies of evaluation images beside look-alikes that are not copies.

The evaluation sets are the packaged ``mnist``, ``tuxpaint`` and ``fluent-emoji`` test splits. The pool holds,
for each, copies of its first ``--copies`` test images under eight edits (a PNG re-encoding, JPEG quality 50 at
half size, twice the size, grey, 15% brighter, 5% cropped off each side, 10% cropped off and JPEG 75, an 8% white
border) and the set's training images as look-alikes (MNIST's other digits, Tux Paint's colour variants of one
drawing, the emoji of one render in other genders and colours): a look-alike is not a copy, and removing it costs
training data for nothing. The pool is scored by ``--model`` (a `cloob train` export: the embedding candidates
need a model that knows the images) and curated under each rule; for each, what it removed of each edit
(recall) and of the look-alikes, and the precision of what it removed. The anchor is the rule before the pixel
check: a hash within 6 bits (of the evaluation image as it is, without the crop and border hashes) or a cosine of
at least 0.95, each taken for a copy.

    python benchmarks/bench_decontaminate.py --model models/train/model [--copies 40] [--look-alikes 600]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from PIL import Image, ImageEnhance, ImageOps

SETS = ("mnist", "tuxpaint", "fluent-emoji")


def _encoded(image: Image.Image, kind: str = "PNG", quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=kind, quality=quality)
    return buffer.getvalue()


def _crop(image: Image.Image, fraction: float) -> Image.Image:
    dx, dy = round(image.width * fraction), round(image.height * fraction)
    return image.crop((dx, dy, image.width - dx, image.height - dy))


EDITS: dict[str, Callable[[Image.Image], bytes]] = {
    "png": lambda im: _encoded(im),
    "jpeg50_half": lambda im: _encoded(im.resize((max(8, im.width // 2), max(8, im.height // 2)), Image.BICUBIC),
                                       "JPEG", 50),
    "twice": lambda im: _encoded(im.resize((im.width * 2, im.height * 2), Image.BICUBIC)),
    "grey": lambda im: _encoded(im.convert("L").convert("RGB")),
    "brighter": lambda im: _encoded(ImageEnhance.Brightness(im).enhance(1.15)),
    "crop5": lambda im: _encoded(_crop(im, 0.05)),
    "crop10_jpeg": lambda im: _encoded(_crop(im, 0.10), "JPEG", 75),
    "border8": lambda im: _encoded(ImageOps.expand(im, border=max(1, round(0.08 * im.width)), fill="white")),
}
ANCHOR = "anchor: hash 6 or cosine 0.95, unchecked"  # the rule before: the evaluation image hashed as it is only
RULES = {  # name: (bits, min_cosine, min_similarity)
    ANCHOR: (6, 0.95, None),
    "hash 6 or cosine 0.95 (+ crop/border hashes), unchecked": (6, 0.95, None),
    "hash 6 alone, unchecked": (6, 1.0, None),
    "candidates 6/0.95, similarity 0.90": (6, 0.95, 0.90),
    "candidates 6/0.95, similarity 0.95": (6, 0.95, 0.95),
    "candidates 6/0.95, similarity 0.97 (default)": (6, 0.95, 0.97),
}


@contextlib.contextmanager
def _hashed_as_it_is_only(anchor: bool) -> Iterator[None]:
    """For the anchor, each evaluation image hashed as it is, as before the crop and border hashes."""
    from cloob_core.curation.filters import decontaminate

    kept = dict(decontaminate.HASHED_AS)
    if anchor:
        decontaminate.HASHED_AS.clear()
        decontaminate.HASHED_AS["as it is"] = kept["as it is"]
    try:
        yield
    finally:
        decontaminate.HASHED_AS.clear()
        decontaminate.HASHED_AS.update(kept)


def build_pool(folder: Path, copies: int, look_alikes: int) -> dict[str, str]:
    """The pool's shards (one per set) and each sample's kind (``copy:EDIT`` or ``look-alike``) by key."""
    from cloob_core.data.packaged import load_packaged
    from cloob_core.data.writer import ShardWriter

    kinds = {}
    for number, name in enumerate(SETS):
        test, train = load_packaged(name, "test"), load_packaged(name, "train")
        with open(folder / f"{number:05d}.tar", "wb") as handle, ShardWriter(handle) as writer:
            for index in range(min(copies, len(test))):
                original = Image.open(io.BytesIO(test.images[index])).convert("RGB")
                for edit, make in EDITS.items():
                    key = f"{name}-{edit}-{index:04d}"
                    writer.write(key, make(original), test.captions[index], {"url": f"http://pool.example/{key}"})
                    kinds[key] = f"copy:{edit}"
            for index in range(min(look_alikes, len(train))):
                key = f"{name}-train-{index:04d}"
                writer.write(key, train.images[index], train.captions[index], {"url": f"http://pool.example/{key}"})
                kinds[key] = "look-alike"
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the scoring model: a `cloob train` export folder")
    parser.add_argument("--copies", type=int, default=40, help="test images per set copied under each edit")
    parser.add_argument("--look-alikes", type=int, default=600, help="training images per set in the pool")
    args = parser.parse_args()

    import pyarrow.parquet as pq

    from cloob_core.config import load_config
    from cloob_core.curation.curate import KEPT_FILE, curate
    from cloob_core.curation.score import ScoreRequest, score
    from cloob_core.model.source import ModelSource

    model = ModelSource(model=args.model, device="cpu")
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        (root / "pool").mkdir()
        kinds = build_pool(root / "pool", args.copies, args.look_alikes)
        score(ScoreRequest(str(root / "pool"), model, str(root / "scores"), workers=0, progress=False))
        edits = [f"copy:{edit}" for edit in EDITS]
        print(f"pool: {len(kinds):,} images, {sum(k != 'look-alike' for k in kinds.values()):,} copies of "
              f"{', '.join(SETS)} test images under {len(EDITS)} edits, "
              f"{sum(k == 'look-alike' for k in kinds.values()):,} training images as look-alikes; model "
              f"{args.model}")
        print(f"{'rule':58s} {'precision':>9s} {'recall':>6s} {'look-alikes removed':>19s} {'s':>5s}  "
              + " ".join(f"{edit[5:]:>11s}" for edit in edits) + "  look-alikes removed of " + ", ".join(SETS))
        figures = {}
        for number, (rule, (bits, cosine, similarity)) in enumerate(RULES.items()):
            config = load_config(overrides=[f"curation.decontaminate={json.dumps(list(SETS))}",
                                            f"curation.decontaminate_bits={bits}",
                                            f"curation.decontaminate_min_cosine={cosine}",
                                            f"curation.decontaminate_min_similarity={json.dumps(similarity)}"])
            started = time.perf_counter()
            with _hashed_as_it_is_only(rule == ANCHOR):
                curate(str(root / "pool"), str(root / "scores"), str(root / f"curated{number}"), config, model)
            seconds = time.perf_counter() - started
            rows = pq.read_table(root / f"curated{number}" / KEPT_FILE, columns=["key", "kept"]).to_pylist()
            removed = {row["key"] for row in rows if not row["kept"]}
            by_kind = {kind: sum(kinds[key] == kind for key in removed) for kind in [*edits, "look-alike"]}
            totals = {kind: sum(value == kind for value in kinds.values()) for kind in by_kind}
            copies_removed = sum(by_kind[kind] for kind in edits)
            precision = copies_removed / len(removed) if removed else 1.0
            recall = copies_removed / sum(totals[kind] for kind in edits)
            figures[rule] = precision, recall, by_kind["look-alike"] / totals["look-alike"]
            per_set = [sum(key.startswith(f"{name}-train-") for key in removed)
                       / sum(key.startswith(f"{name}-train-") for key in kinds) for name in SETS]
            print(f"{rule:58s} {precision:9.3f} {recall:6.3f} {figures[rule][2]:19.3f} {seconds:5.1f}  "
                  + " ".join(f"{by_kind[kind] / totals[kind]:11.2f}" for kind in edits) + "  "
                  + " ".join(f"{fraction:.3f}" for fraction in per_set))
        anchor, ours = figures[ANCHOR], figures["candidates 6/0.95, similarity 0.97 (default)"]
        print(f"ours against the anchor: precision {ours[0] / anchor[0]:.2f}x, recall {ours[1] / anchor[1]:.2f}x, "
              f"look-alikes removed {ours[2]:.3f} against {anchor[2]:.3f}")


if __name__ == "__main__":
    main()
