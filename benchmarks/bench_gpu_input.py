"""Feeding a GPU: the training input's CPU decode per core and on every core, against nvJPEG on the device.

For JPEG sources of several sizes (the packaged captioned photos enlarged and re-encoded at quality 90), the
samples/s of:
- ours, one process: what a data-loader worker does per sample (``TrainImages.decode`` with its reduced-DCT
  draft, the random resized crop to 224 px, bicubic) plus the caption's tokenisation (open_clip's tokenizer, in
  chunks of 16 as a worker tokenises);
- ours on every core: the same in one process per core (what ``train.workers`` auto runs), aggregate;
- nvJPEG: ``torchvision.io.decode_jpeg(device="cuda")`` on batches of 256, then the same random resized crop on
  the device (torchvision's ``resized_crop``, bicubic), per image.
The ratio printed is every-core CPU against nvJPEG. Then the real loader of ``cloob train`` alone (its
data-loader workers, the batches assembled in page-locked memory, no model), on shards of 288-px JPEGs, at
several worker counts: what the input can give the step. docs/performance.md ("Feeding a GPU") uses these
numbers.

    python benchmarks/bench_gpu_input.py [--images 768] [--workers 8,16] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import photo_jpegs, write_shards

SIZE = 224


def _cpu_rate(samples: list[tuple[bytes, str]]) -> float:
    """Samples/s of one process doing a worker's per-sample work."""
    import numpy as np
    import torch

    from cloob_core.model.dual_encoder import build_tokenizer
    from cloob_core.training.images import TrainImages

    torch.set_num_threads(1)
    images, tokenizer, rng = TrainImages(SIZE), build_tokenizer("ViT-B-32"), random.Random(0)
    started = time.perf_counter()
    for first in range(0, len(samples), 16):
        chunk = samples[first : first + 16]
        np.stack([images.crop(images.decode(data), rng) for data, _ in chunk])  # as into the batch ring
        tokenizer([caption for _, caption in chunk])
    return len(samples) / (time.perf_counter() - started)


def cpu_every_core(samples: list[tuple[bytes, str]], processes: int) -> float:
    """Aggregate samples/s of ``processes`` processes each doing all of ``samples`` at once."""
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.map(_cpu_rate, [samples[:32]] * processes)  # imports and tokenizer loaded in every process
        started = time.perf_counter()
        pool.map(_cpu_rate, [samples] * processes)
        return processes * len(samples) / (time.perf_counter() - started)


def gpu_rate(samples: list[tuple[bytes, str]], batch: int = 256) -> float:
    """Samples/s of nvJPEG decode plus the random resized crop on the device."""
    import torch
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2 import functional as F

    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b, _ in samples]

    def run() -> None:
        for first in range(0, len(data), batch):
            decoded = decode_jpeg(data[first : first + batch], device="cuda")
            torch.stack([F.resized_crop(image, *_box(image), size=[SIZE, SIZE],
                                        interpolation=F.InterpolationMode.BICUBIC, antialias=True)
                         for image in decoded])

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return len(data) / statistics.median(times)


def _box(image) -> tuple[int, int, int, int]:
    """A random resized crop's box (top, left, height, width) of scale 0.9-1, aspect 3/4-4/3, as ours draws."""
    height, width = image.shape[-2:]
    for _ in range(10):
        area = height * width * random.uniform(0.9, 1.0)
        aspect = random.uniform(3 / 4, 4 / 3)
        w, h = round((area * aspect) ** 0.5), round((area / aspect) ** 0.5)
        if 0 < w <= width and 0 < h <= height:
            return random.randint(0, height - h), random.randint(0, width - w), h, w
    return 0, 0, height, width


def loader_rate(shards: Path, workers: int, batch: int, steps: int, device: str) -> tuple[float, float]:
    """``cloob train``'s loader alone (16 streams; ``workers`` processes), after a warm-up: (samples/s, the main
    process's CPU milliseconds per batch). The second is what the loader takes from the thread that launches a
    GPU step's kernels: it can be compared on any machine, GPU or not."""
    from types import SimpleNamespace

    import torch

    from cloob_core.config import load_config
    from cloob_core.model.dual_encoder import build_tokenizer
    from cloob_core.training import loop
    from cloob_core.training.images import TrainImages

    config = load_config(overrides=[f"train.shards={shards}", "train.data_streams=16", f"train.workers={workers}",
                                    f"train.batch_size={batch}", "train.sample_cache_mb=0"])
    setup = SimpleNamespace(env=SimpleNamespace(rank=0, world_size=1), device=torch.device(device),
                            images=TrainImages(SIZE), tokenizer=build_tokenizer("ViT-B-32"))
    from cloob_core.data.shard_files import shard_list
    from cloob_core.training.streams import stream_shards

    batches = loop._batches(config, setup, stream_shards(shard_list(str(shards))[0], 16), loop.TrainingState())
    try:
        warm = max(steps // 4, 2)
        for _ in range(warm):
            next(batches)
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps - warm):
            next(batches)
        used = time.process_time() - cpu
        return (steps - warm) * batch / (time.perf_counter() - started), 1e3 * used / (steps - warm)
    finally:
        batches.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=768)
    parser.add_argument("--sides", default="256,288,512")
    parser.add_argument("--processes", type=int, default=os.cpu_count())
    parser.add_argument("--workers", default="8,16", help="worker counts of the loader measurement")
    parser.add_argument("--batch", type=int, default=256, help="batch of the loader measurement")
    parser.add_argument("--loader-only", action="store_true", help="only the loader measurement")
    parser.add_argument("--quick", action="store_true", help="a few images, no GPU part (CI)")
    args = parser.parse_args()
    import torch

    count = 48 if args.quick else args.images
    gpu = torch.cuda.is_available() and not args.quick
    print(f"training input at {SIZE} px: ours per core and on {args.processes} cores, against nvJPEG on "
          f"{torch.cuda.get_device_name(0) if gpu else 'no GPU'}; {count} JPEGs per source size (samples/s)")
    print(f"  {'source':>8} {'ours, 1 core':>13} {'ours, all cores':>16} {'nvJPEG + crop':>14} "
          f"{'all cores / nvJPEG':>19}")
    for side in (int(s) for s in args.sides.split(",") if not args.loader_only):
        samples = list(photo_jpegs(count, side))
        one = statistics.median(_cpu_rate(samples) for _ in range(2))
        every = cpu_every_core(samples, args.processes)
        device = gpu_rate(samples) if gpu else float("nan")
        print(f"  {side:>6}px {one:>13.0f} {every:>16.0f} {device:>14.0f} {every / device:>19.2f}", flush=True)
    import tempfile


    batch, steps = (16, 8) if args.quick else (args.batch, 40)
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        write_shards(shards, 128 if args.quick else 4096, 48 if args.quick else 288, per_shard=8 if args.quick else 64)
        for workers in (int(w) for w in args.workers.split(",")):
            got, main_ms = loader_rate(shards, workers, batch, steps, "cuda" if gpu else "cpu")
            print(f"  cloob train's loader alone, {workers} workers, batch {batch}: {got:.0f} samples/s; main "
                  f"process {main_ms:.1f} CPU ms per batch", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
