"""Zero-shot evaluation end to end: `cloob eval zeroshot` against CLIP_benchmark's `clip_benchmark eval` on the same
exported model and the same WebDataset set, each as the command a user runs (a process of its own: start-up,
model loading, reading, decoding, embedding, scoring). Prints each one's images/s, its peak memory (the sum over
the process and its data-loader workers of their proportional set sizes, sampled every 250 ms, so that pages the
forked workers share with their parent count once), its main process's peak RSS, the ratio of images/s, and
whether their top-1 agree; and our memory on sets of each size, to show whether it grows with the set.

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


def build_set(workdir: Path, count: int, per_tar: int = 1000) -> Path:
    """The wds set of ``count`` photos, ``per_tar`` to a tar (made once per work folder). CLIP_benchmark deals
    whole tars to its workers and fails with fewer tars than workers."""
    target = workdir / (f"photos{count}" if per_tar == 1000 else f"photos{count}-{per_tar}")
    if (target / "test" / "nshards.txt").exists():
        return target
    folder = workdir / f"photos{count}-folder"
    make_photo_folder(folder, count)
    run([sys.executable, "-m", "cloob_core.cli", "data", "eval-set", "--source", str(folder), "--output",
         str(target), "--shard-size", str(per_tar)])
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


def _proportional(process: psutil.Process) -> int:
    """A process's proportional set size: its private pages and its share of those it shares (forked workers share
    most of their parent's), so that the sum over a process tree counts each page once; read from the kernel's
    one-line summary (smaps_rollup), which costs far less than psutil's walk of every mapping. RSS elsewhere."""
    try:
        with open(f"/proc/{process.pid}/smaps_rollup") as summary:
            for line in summary:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return process.memory_info().rss


def run(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(seconds, peak memory in MB over the process tree (PSS), the main process's peak RSS in MB, stdout) of one
    command; it must succeed."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env={**os.environ, **(env or {})})
    peak = [0.0, 0.0]

    def sample() -> None:  # light: the process list once a second, memory 4 times a second
        root, tree, listed = psutil.Process(process.pid), [], 0.0
        while process.poll() is None:
            try:
                if time.monotonic() - listed > 1.0:
                    tree, listed = [root, *root.children(recursive=True)], time.monotonic()
                peak[0] = max(peak[0], sum(_proportional(p) for p in tree if p.is_running()) / 2**20)
                peak[1] = max(peak[1], root.memory_info().rss / 2**20)
            except psutil.Error:
                pass
            time.sleep(0.25)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    out, err = process.communicate()
    elapsed = time.perf_counter() - started
    watcher.join()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:6])} ... failed ({process.returncode}):\n{err[-3000:]}")
    return elapsed, peak[0], peak[1], out


def ours(model: Path, data: Path, output: Path, batch: int,
         workers: int | None) -> tuple[float, float, float, float]:
    argv = [sys.executable, "-m", "cloob_core.cli", "eval", "zeroshot", "--model", str(model), "--data", str(data),
            "--output", str(output), "--no-cache", "--no-progress", "--batch-size", str(batch)]
    if workers is not None:
        argv += ["--workers", str(workers)]
    seconds, memory, rss, _ = run(argv)
    record = json.loads(next(output.glob("*_zeroshot_classification.json")).read_text())
    return seconds, memory, rss, record["metrics"]["acc1"]


def clip_benchmark(model: Path, architecture: str, data: Path, output: Path,
                   options: list[str]) -> tuple[float, float, float, float]:
    subprocess.run([str(ROOT / "scripts" / "clip_benchmark_env.sh")], check=True)
    argv = [sys.executable, "-m", "cloob_core.evaluation.clip_benchmark_loader", "eval", "--model_type", "cloob",
            "--model", architecture, "--pretrained", str(model), "--dataset", f"wds/{data.name}", "--dataset_root",
            str(data), "--task", "zeroshot_classification", "--output", str(output), *options]
    # the overlay first; what PYTHONPATH held (gpu_check.sh's brought wheels on a GPU machine) after it
    path = ":".join(filter(None, [str(OVERLAY), str(ROOT), os.environ.get("PYTHONPATH")]))
    seconds, memory, rss, _ = run(argv, env={"PYTHONPATH": path})
    return seconds, memory, rss, json.loads(output.read_text())["metrics"]["acc1"]


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

    from cloob_core.threads import plan_eval_threads

    gpu = torch.cuda.is_available()
    workers = plan_eval_threads("cuda" if gpu else "cpu", args.workers).workers
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
    print(f"{'images':>7} {'tool':<12} {'seconds':>8} {'images/s':>9} {'peak MB':>8} {'main RSS MB':>12} "
          f"{'top-1':>8}")
    memory_of_ours = {}
    for size in args.sizes:
        data = build_set(workdir, size)
        seconds, memory, rss, top1 = ours(model, data, workdir / f"ours{size}", args.batch_size, args.workers)
        memory_of_ours[size] = (memory, rss)
        print(f"{size:>7} {'cloob eval':<12} {seconds:8.1f} {size / seconds:9.1f} {memory:8.0f} {rss:12.0f} "
              f"{100 * top1:7.2f}%")
        if size > args.skip_cb_above:
            continue
        for name, options in anchors.items():
            cb_seconds, cb_memory, cb_rss, cb_top1 = clip_benchmark(model, architecture, data,
                                                                    workdir / f"cb{size}.json", options)
            print(f"{size:>7} {name:<12} {cb_seconds:8.1f} {size / cb_seconds:9.1f} {cb_memory:8.0f} "
                  f"{cb_rss:12.0f} "
                  f"{100 * cb_top1:7.2f}%   ours {cb_seconds / seconds:.2f}x its images/s, top-1 "
                  f"{'agree' if abs(top1 - cb_top1) <= 0.001 else 'DIFFER'} ({100 * (top1 - cb_top1):+.2f} pt)")
    if len(memory_of_ours) > 1:
        small, large = min(memory_of_ours), max(memory_of_ours)
        for what, index in (("peak memory", 0), ("main process's peak RSS", 1)):
            print(f"ours, {what}, {large:,} against {small:,} images: {memory_of_ours[large][index]:.0f} / "
                  f"{memory_of_ours[small][index]:.0f} MB = "
                  f"{memory_of_ours[large][index] / memory_of_ours[small][index]:.3f}")


if __name__ == "__main__":
    main()
