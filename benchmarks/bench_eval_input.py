"""Zero-shot evaluation end to end: `cloob eval zeroshot` against CLIP_benchmark's `clip_benchmark eval` on the same
exported model and the same WebDataset set, each as the command a user runs (a process of its own: start-up,
model loading, reading, decoding, embedding, scoring). Prints each one's images/s and peak RSS (the sum over the
process and its data-loader workers, sampled every 50 ms), the ratio, and whether their top-1 agree; and our peak
RSS on sets of each size, to show whether it grows with the set.

The set: real photos (scikit-learn's china.jpg and flower.jpg, matplotlib's grace_hopper.jpg: the photos every
install of our dependencies carries), each image a random crop of one of them (scale 5-100% of its area, aspect
3:4 to 4:3, flipped half the time) resized so its shorter side is 256-384 px and saved as a JPEG (quality 90); its
class is its photo. `cloob data eval-set` writes it in CLIP_benchmark's wds layout (1,000 images per tar). The model
is the architecture trained for a few hundred steps on the packaged captioned pairs (seed 0), so that its answers
vary from image to image: both tools must then give the same top-1 on the same weights. Throughput does not depend
on what the weights learnt.

CLIP_benchmark 1.6.2 runs from its overlay (scripts/clip_benchmark_env.sh) through `cloob-clip-benchmark`, its CLI
with our model type registered, twice: as `clip_benchmark eval` runs with its defaults (batch 64, 4 workers, amp:
bf16 autocast, on the CPU too), and matched to ours (our batch size and worker count; --no_amp on the CPU, where
ours is fp32).

    python benchmarks/bench_eval_input.py [--sizes 10000 40000] [--architecture cloob-tiny] [--batch-size 256]
                                          [--cb-workers N] [--workdir DIR] [--skip-cb-above 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / ".venv-clip-benchmark"
CLASSES = {"pagoda": "china.jpg", "flower": "flower.jpg", "woman in uniform": "grace_hopper.jpg"}


def photo_paths() -> dict[str, Path]:
    import matplotlib
    import sklearn.datasets

    sklearn_images = Path(sklearn.datasets.__file__).parent / "images"
    found = {"china.jpg": sklearn_images / "china.jpg", "flower.jpg": sklearn_images / "flower.jpg",
             "grace_hopper.jpg": Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"}
    return {name: found[file] for name, file in CLASSES.items()}


def make_photo_folder(folder: Path, count: int, seed: int = 0) -> None:
    """``count`` random crops of the photos as CLASS/NNNNNNN.jpg (an ImageFolder tree)."""
    rng = random.Random(seed)
    photos = {name: Image.open(path).convert("RGB") for name, path in photo_paths().items()}
    names = sorted(photos)
    for name in names:
        (folder / name).mkdir(parents=True, exist_ok=True)
    for index in range(count):
        name = names[index % len(names)]
        photo = photos[name]
        width, height = photo.size
        for _ in range(20):
            area = rng.uniform(0.05, 1.0) * width * height
            aspect = rng.uniform(3 / 4, 4 / 3)
            w, h = round((area * aspect) ** 0.5), round((area / aspect) ** 0.5)
            if w <= width and h <= height:
                break
        else:
            w, h = width, height
        left, top = rng.randint(0, width - w), rng.randint(0, height - h)
        crop = photo.crop((left, top, left + w, top + h))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        short = rng.randint(256, 384)
        scale = short / min(w, h)
        crop = crop.resize((max(short, round(w * scale)), max(short, round(h * scale))), Image.Resampling.BICUBIC)
        crop.save(folder / name / f"{index:07d}.jpg", quality=90)


def build_set(workdir: Path, count: int) -> Path:
    """The wds set of ``count`` photos (made once per work folder)."""
    target = workdir / f"photos{count}"
    if (target / "test" / "nshards.txt").exists():
        return target
    folder = workdir / f"photos{count}-folder"
    make_photo_folder(folder, count)
    run([sys.executable, "-m", "cloob_core.cli", "data", "eval-set", "--source", str(folder), "--output",
         str(target), "--shard-size", "1000"])
    return target


def export(workdir: Path, architecture: str, steps: int) -> Path:
    """The architecture after ``steps`` steps of `cloob train` on the packaged captioned pairs (seed 0), so that its
    predictions differ from image to image; with 0 steps, its seeded initial weights."""
    import torch

    from cloob_core.config import load_config
    from cloob_core.model.dual_encoder import build_model
    from cloob_core.model.export import export_model
    from cloob_core.training.loop import train

    folder = workdir / f"model-{architecture}-{steps}"
    if (folder / "open_clip_config.json").exists():
        return folder
    config = load_config(overrides=[f"model.architecture={architecture}", f"train.steps={max(steps, 1)}",
                                    "train.tensorboard=false"])
    if steps:
        train(config, workdir / f"train-{architecture}", progress=False)
        (workdir / f"train-{architecture}" / "model").rename(folder)
    else:
        torch.manual_seed(0)
        export_model(build_model(config.model), folder, {"objective": "none", "steps": 0})
    return folder


def run(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(seconds, peak RSS in MB over the process tree, stdout) of one command; it must succeed."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env={**os.environ, **(env or {})})
    peak = [0.0]

    def sample() -> None:
        root = psutil.Process(process.pid)
        while process.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree if p.is_running()) / 2**20)
            except psutil.Error:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    out, err = process.communicate()
    elapsed = time.perf_counter() - started
    watcher.join()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:6])} ... failed ({process.returncode}):\n{err[-3000:]}")
    return elapsed, peak[0], out


def ours(model: Path, data: Path, output: Path, batch: int, workers: int | None) -> tuple[float, float, float]:
    argv = [sys.executable, "-m", "cloob_core.cli", "eval", "zeroshot", "--model", str(model), "--data", str(data),
            "--output", str(output), "--no-cache", "--no-progress", "--batch-size", str(batch)]
    if workers is not None:
        argv += ["--workers", str(workers)]
    seconds, rss, _ = run(argv)
    record = json.loads(next(output.glob("*_zeroshot_classification.json")).read_text())
    return seconds, rss, record["metrics"]["acc1"]


def clip_benchmark(model: Path, architecture: str, data: Path, output: Path,
                   options: list[str]) -> tuple[float, float, float]:
    subprocess.run([str(ROOT / "scripts" / "clip_benchmark_env.sh")], check=True)
    argv = [sys.executable, "-m", "cloob_core.evaluation.clip_benchmark_loader", "eval", "--model_type", "cloob",
            "--model", architecture, "--pretrained", str(model), "--dataset", f"wds/{data.name}", "--dataset_root",
            str(data), "--task", "zeroshot_classification", "--output", str(output), *options]
    seconds, rss, _ = run(argv, env={"PYTHONPATH": f"{OVERLAY}:{ROOT}"})
    return seconds, rss, json.loads(output.read_text())["metrics"]["acc1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 40_000])
    parser.add_argument("--architecture", default="cloob-tiny")
    parser.add_argument("--model", type=Path, default=None, help="an exported model to use instead of training one")
    parser.add_argument("--train-steps", type=int, default=300,
                        help="steps of `cloob train` on the packaged pairs before exporting (0: initial weights)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=None, help="ours (default: from the thread budget)")
    parser.add_argument("--skip-cb-above", type=int, default=10_000,
                        help="run CLIP_benchmark only on sets up to this size (its memory is not what is measured)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the sets and model here (default: temp)")
    args = parser.parse_args()

    import torch

    from cloob_core.threads import eval_workers

    gpu = torch.cuda.is_available()
    workers = args.workers if args.workers is not None else eval_workers("cuda" if gpu else "cpu")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-eval-input-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = args.model or export(workdir, args.architecture, args.train_steps)
    architecture = json.loads((model / "model_info.json").read_text())["architecture"]
    device = torch.cuda.get_device_name(0) if gpu else f"CPU, {psutil.cpu_count()} cores"
    anchors = {"CB defaults": [],
               "CB matched": ["--batch_size", str(args.batch_size), "--num_workers", str(max(1, workers))]
               + ([] if gpu else ["--no_amp"])}
    print(f"zero-shot on real-photo wds sets, {model.name} ({architecture}), {device}; ours: batch "
          f"{args.batch_size}, {workers} worker(s); CB defaults: batch 64, 4 workers, amp; CB matched: "
          f"{anchors['CB matched'][1:]}")
    print(f"{'images':>7} {'tool':<12} {'seconds':>8} {'images/s':>9} {'peak RSS MB':>12} {'top-1':>8}")
    rss_of_ours = {}
    for size in args.sizes:
        data = build_set(workdir, size)
        seconds, rss, top1 = ours(model, data, workdir / f"ours{size}", args.batch_size, args.workers)
        rss_of_ours[size] = rss
        print(f"{size:>7} {'cloob eval':<12} {seconds:8.1f} {size / seconds:9.1f} {rss:12.0f} {100 * top1:7.2f}%")
        if size > args.skip_cb_above:
            continue
        for name, options in anchors.items():
            cb_seconds, cb_rss, cb_top1 = clip_benchmark(model, architecture, data, workdir / f"cb{size}.json",
                                                         options)
            print(f"{size:>7} {name:<12} {cb_seconds:8.1f} {size / cb_seconds:9.1f} {cb_rss:12.0f} "
                  f"{100 * cb_top1:7.2f}%   ours {cb_seconds / seconds:.2f}x its images/s, top-1 "
                  f"{'agree' if abs(top1 - cb_top1) <= 0.001 else 'DIFFER'} ({100 * (top1 - cb_top1):+.2f} pt)")
    if len(rss_of_ours) > 1:
        small, large = min(rss_of_ours), max(rss_of_ours)
        print(f"our peak RSS, {large:,} against {small:,} images: {rss_of_ours[large]:.0f} / "
              f"{rss_of_ours[small]:.0f} MB = {rss_of_ours[large] / rss_of_ours[small]:.3f}")


if __name__ == "__main__":
    main()
