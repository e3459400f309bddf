"""The resizer's parts, one image at a time on one core: decoders, resizers and encoders side by side.

What `cloob data download` and training's input spend per image, and the alternatives the choice was made
among: Pillow's full and reduced-DCT decode (``draft``), simplejpeg's scaled decode (libjpeg-turbo's scaling
factors) and OpenCV's ``imdecode`` (full and ``IMREAD_REDUCED_COLOR_k``); Pillow's area average and bicubic
against OpenCV's ``INTER_AREA``; Pillow's JPEG encoder with its settings against simplejpeg's and OpenCV's. The
last lines put our whole resizer (`imaging.process_image`) against img2dataset's (full ``cv2.imdecode``,
``INTER_AREA``, ``cv2.imencode``) and give the PSNR of each against a full decode with Pillow's area average.
A last table gives the PSNR of our stored images against a full decode's on the packaged Tux Paint photographs
(128 px) enlarged to each source size and re-encoded at quality 90: smoother sources than the collages.

Sources are `bench_download.make_sources`' real-photo collages (shorter side 256, 512 and 1,024 px). simplejpeg
and OpenCV are optional: a missing one is left out (img2dataset's venv has OpenCV; ours need not).

    python benchmarks/bench_decode.py [--images 40] [--sources 256,512,1024] [--outputs 64,256]
"""

from __future__ import annotations

import argparse
import io
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_download import make_sources

from cloob_core.config import PreprocessConfig
from cloob_core.data.decoding import reduction
from cloob_core.data.imaging import full_decode_reference, process_image, target_scale, target_size

try:
    import cv2

    cv2.setNumThreads(1)
except ImportError:
    cv2 = None
try:
    import simplejpeg
except ImportError:
    simplejpeg = None


def per_image_us(work: Callable[[bytes], object], data: list[bytes], repeat: int = 3) -> float:
    best = math.inf
    for _ in range(repeat):
        started = time.perf_counter()
        for item in data:
            work(item)
        best = min(best, time.perf_counter() - started)
    return best / len(data) * 1e6


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def target(data: bytes, size: int) -> tuple[int, int]:
    return target_size(*Image.open(io.BytesIO(data)).size, PreprocessConfig(image_size=size))


def need(data: bytes, size: int) -> tuple[float, float]:
    """The unrounded target, which the reduction is chosen by (as `imaging.process_image` does)."""
    width, height = Image.open(io.BytesIO(data)).size
    scale = target_scale(width, height, PreprocessConfig(image_size=size))
    return width * scale, height * scale


def decoders(data: list[bytes], size: int) -> dict[str, float]:
    """Each decoder at the reduction the output allows (the header's reading in the time, the choice not)."""
    needs = {id(d): need(d, size) for d in data}
    reductions = {id(d): reduction(*Image.open(io.BytesIO(d)).size, *needs[id(d)]) for d in data}

    def pillow(item: bytes, reduce: bool) -> None:
        image = Image.open(io.BytesIO(item))
        if reduce:
            k = reductions[id(item)]
            image.draft("RGB", (image.width // k, image.height // k))
        image.load()

    found = {"Pillow full": per_image_us(lambda d: pillow(d, False), data),
             "Pillow draft (ours)": per_image_us(lambda d: pillow(d, True), data)}
    if simplejpeg is not None:
        found["simplejpeg full"] = per_image_us(simplejpeg.decode_jpeg, data)
        found["simplejpeg scaled"] = per_image_us(
            lambda d: simplejpeg.decode_jpeg(d, min_width=math.ceil(needs[id(d)][0]),
                                             min_height=math.ceil(needs[id(d)][1])), data)
    if cv2 is not None:
        flags = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
                 8: cv2.IMREAD_REDUCED_COLOR_8}
        found["OpenCV full (img2dataset)"] = per_image_us(
            lambda d: cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_UNCHANGED), data)
        found["OpenCV reduced"] = per_image_us(
            lambda d: cv2.imdecode(np.frombuffer(d, np.uint8), flags[reductions[id(d)]]), data)
    return found


def resizers(data: list[bytes], size: int) -> dict[str, float]:
    full = [Image.open(io.BytesIO(d)).convert("RGB") for d in data]
    sizes = [target(d, size) for d in data]
    reduced = []
    for d in data:
        image = Image.open(io.BytesIO(d))
        k = reduction(*image.size, *need(d, size))
        box = image.draft("RGB", (image.width // k, image.height // k))
        image.load()
        reduced.append((image, box[1] if box else None))
    index = {id(d): i for i, d in enumerate(data)}
    found = {"Pillow BOX from full": per_image_us(lambda d: full[index[id(d)]].resize(sizes[index[id(d)]],
                                                                                     Image.Resampling.BOX), data),
             "Pillow BICUBIC from reduced (ours)": per_image_us(
                 lambda d: reduced[index[id(d)]][0].resize(sizes[index[id(d)]], Image.Resampling.BICUBIC,
                                                           box=reduced[index[id(d)]][1]), data)}
    if cv2 is not None:
        arrays = [np.asarray(image) for image in full]
        found["OpenCV INTER_AREA from full (img2dataset)"] = per_image_us(
            lambda d: cv2.resize(arrays[index[id(d)]], sizes[index[id(d)]], interpolation=cv2.INTER_AREA), data)
        small = [np.asarray(image) for image, _ in reduced]
        found["OpenCV INTER_AREA from reduced"] = per_image_us(
            lambda d: cv2.resize(small[index[id(d)]], sizes[index[id(d)]], interpolation=cv2.INTER_AREA), data)
    return found


def encoders(data: list[bytes], size: int) -> dict[str, tuple[float, float]]:
    """µs per image and mean KB, at quality 95."""
    images = [Image.open(io.BytesIO(d)).convert("RGB").resize(target(d, size), Image.Resampling.BOX) for d in data]
    index = {id(d): i for i, d in enumerate(data)}
    variants: dict[str, Callable[[Image.Image], bytes]] = {}

    def pillow(**options: object) -> Callable[[Image.Image], bytes]:
        def encode(image: Image.Image) -> bytes:
            out = io.BytesIO()
            image.save(out, format="JPEG", quality=95, **options)
            return out.getvalue()
        return encode

    variants["Pillow q95 (ours)"] = pillow()
    variants["Pillow q95 optimize"] = pillow(optimize=True)
    variants["Pillow q95 4:4:4"] = pillow(subsampling=0)
    if simplejpeg is not None:
        variants["simplejpeg q95 4:2:0"] = lambda image: simplejpeg.encode_jpeg(np.asarray(image), 95, "RGB", "420")
    if cv2 is not None:
        variants["OpenCV q95 (img2dataset)"] = lambda image: cv2.imencode(
            ".jpg", np.asarray(image)[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes()
    return {name: (per_image_us(lambda d, f=encode: f(images[index[id(d)]]), data),
                   float(np.mean([len(encode(image)) for image in images])) / 1000)
            for name, encode in variants.items()}


def img2dataset_resizer(data: bytes, size: int) -> bytes:
    """img2dataset 1.47's resizer for keep_ratio, never enlarging: full decode, INTER_AREA, imencode at q95."""
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    height, width = image.shape[:2]
    if min(height, width) > size:
        scale = size / min(height, width)
        image = cv2.resize(image, (round(width * scale), round(height * scale)), interpolation=cv2.INTER_AREA)
    return cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes()


def tuxpaint_psnr(sources: list[int], outputs: list[int], count: int) -> None:
    """PSNR (over all pixels, and the worst image) of our stored images against a full decode's, per size."""
    from cloob_core.data.packaged import load_packaged

    pictures = load_packaged("tuxpaint", "test").images[:count]
    print(f"\nPSNR against a full decode, {len(pictures)} packaged Tux Paint photographs enlarged (bicubic) and "
          "re-encoded at quality 90")
    for short in sources:
        data = []
        for picture in pictures:
            image = Image.open(io.BytesIO(picture)).convert("RGB")
            scale = short / min(image.size)
            out = io.BytesIO()
            image.resize((round(image.width * scale), round(image.height * scale)),
                         Image.Resampling.BICUBIC).save(out, format="JPEG", quality=90)
            data.append(out.getvalue())
        for size in outputs:
            if size * 2 > short:
                continue
            config = PreprocessConfig(image_size=size)
            errors = []
            for item in data:
                ours = np.asarray(Image.open(io.BytesIO(process_image(item, config).jpeg)), dtype=np.float64)
                full = np.asarray(Image.open(io.BytesIO(full_decode_reference(item, config))), dtype=np.float64)
                errors.append(float(np.mean((ours - full) ** 2)))
            overall, worst = (10 * math.log10(255**2 / e) if e else math.inf for e in (np.mean(errors), max(errors)))
            print(f"  {short:>5} px -> {size:>3} px: {overall:5.1f} dB (worst image {worst:5.1f} dB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=40)
    parser.add_argument("--sources", default="256,512,1024")
    parser.add_argument("--outputs", default="64,256")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"per image on one core, best of 3 passes over {args.images} real-photo collages; "
          f"simplejpeg {'absent' if simplejpeg is None else simplejpeg.__version__}, "
          f"OpenCV {'absent' if cv2 is None else cv2.__version__}, Pillow {Image.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        for short in map(int, args.sources.split(",")):
            make_sources(Path(folder) / str(short), short, args.images, args.seed)
            data = [p.read_bytes() for p in sorted((Path(folder) / str(short)).iterdir(), key=lambda p: int(p.stem))]
            for size in map(int, args.outputs.split(",")):
                if size > short:
                    continue
                print(f"\n{short} px sources -> {size} px (keep_ratio)")
                for name, us in decoders(data, size).items():
                    print(f"  decode  {name:<42} {us:8.0f} us")
                for name, us in resizers(data, size).items():
                    print(f"  resize  {name:<42} {us:8.0f} us")
                for name, (us, kb) in encoders(data, size).items():
                    print(f"  encode  {name:<42} {us:8.0f} us  {kb:6.1f} KB")
                config = PreprocessConfig(image_size=size)
                ours = per_image_us(lambda d, c=config: process_image(d, c), data)
                line = f"  whole resizer: ours {ours:.0f} us"
                reference = [np.asarray(Image.open(io.BytesIO(full_decode_reference(d, config)))) for d in data]
                quality = min(psnr(np.asarray(Image.open(io.BytesIO(process_image(d, config).jpeg))), r)
                              for d, r in zip(data, reference, strict=True))
                if cv2 is not None:
                    theirs = per_image_us(lambda d, s=size: img2dataset_resizer(d, s), data)
                    worst = min(psnr(np.asarray(Image.open(io.BytesIO(img2dataset_resizer(d, size)))), r)
                                for d, r in zip(data, reference, strict=True))
                    line += f", img2dataset's {theirs:.0f} us ({theirs / ours:.2f}x)"
                    line += f"; worst PSNR against a full decode: ours {quality:.1f} dB, img2dataset's {worst:.1f} dB"
                else:
                    line += f"; worst PSNR against a full decode {quality:.1f} dB"
                print(line)
    tuxpaint_psnr(list(map(int, args.sources.split(","))), list(map(int, args.outputs.split(","))), 100)


if __name__ == "__main__":
    main()
