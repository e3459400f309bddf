"""A crawl unlike the packaged sets, for the curation tests: drawn pictures of other sizes and shapes (PNG and JPEG),
short captions in several languages and scripts, written into tars as a generic tool writes them."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

CAPTIONS = ["Ein roter Kreis.", "un carré bleu", "一只绿色的三角形。", "Folder bookmark icon.", "赤い丸", "a dog",
            "Una estrella amarilla sobre fondo gris", "Кошка", "two boxes", "x", "Dwa koła i linia", "ok"]


def picture(seed: int, size: tuple[int, int]) -> bytes:
    """A drawn picture (shapes in colours from ``seed``), PNG or JPEG by seed: not a photo of the packaged sets."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x0, y0 = rng.randrange(size[0]), rng.randrange(size[1])
        box = (x0, y0, min(size[0], x0 + rng.randrange(8, 60)), min(size[1], y0 + rng.randrange(8, 60)))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=tuple(rng.randrange(256) for _ in range(3)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG" if seed % 2 else "JPEG", quality=85)
    return buffer.getvalue()


def image_ext(image: bytes) -> str:
    return "png" if image.startswith(b"\x89PNG") else "jpg"


def write_tar(path: Path, samples: list[tuple[str, bytes, str]], prefix: str = "") -> None:
    """A tar of (key, image, caption) samples with members ``PREFIX+KEY.EXT``, as a generic tool writes them."""
    with tarfile.open(path, "w") as archive:
        for key, image, caption in samples:
            for suffix, data in ((image_ext(image), image), ("txt", caption.encode()),
                                 ("json", json.dumps({"url": f"http://crawl.example/{key}"}).encode())):
                info = tarfile.TarInfo(f"{prefix}{key}.{suffix}")
                info.size, info.mtime = len(data), 1_700_000_000
                archive.addfile(info, io.BytesIO(data))


def gnu_tar(path: Path, samples: list[tuple[str, bytes, str]], work: Path) -> None:
    """``tar -C DIR -cf X.tar .``: members named ``./KEY.EXT`` after a ``./`` folder entry."""
    folder = work / path.stem
    folder.mkdir()
    for key, image, caption in samples:
        (folder / f"{key}.{image_ext(image)}").write_bytes(image)
        (folder / f"{key}.txt").write_text(caption)
        (folder / f"{key}.json").write_text(json.dumps({"url": f"http://crawl.example/{key}"}))
    subprocess.run(["tar", "--sort=name", "-C", str(folder), "-cf", str(path), "."], check=True)


def crawl_samples(start: int, count: int) -> list[tuple[str, bytes, str]]:
    return [(f"crawl{i:04d}", picture(i, (48 + 37 * i % 120, 40 + 53 * i % 140)), CAPTIONS[i % len(CAPTIONS)])
            for i in range(start, start + count)]
