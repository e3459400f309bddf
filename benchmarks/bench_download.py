"""Download throughput: `cloob data download` vs img2dataset on the same manifest, server and settings.

Serves N real photos (crops of scikit-learn's two sample photographs, re-encoded at web-like sizes of
400-1200 px) from a loopback HTTP server, then builds WebDataset shards with both tools: the same image size,
resize mode, JPEG quality, shard size, process and thread counts. Prints images/s for each and the ratio.

img2dataset pins old webdataset/pandas releases, so it is installed into its own virtual environment
(benchmarks/.venv-img2dataset, created on first use with `pip install img2dataset==1.47.0`); if that fails,
the script says why and reports our figure alone.

    python benchmarks/bench_download.py [--images 3000] [--processes 2] [--threads 16] [--repeat 2]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
IMG2DATASET_VENV = ROOT / "benchmarks" / ".venv-img2dataset"
IMG2DATASET_VERSION = "1.47.0"


def make_images(folder: Path, count: int, seed: int = 0) -> None:
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        photo = photos[index % len(photos)]
        width, height = rng.randint(300, 640), rng.randint(220, 427)
        left, top = rng.randint(0, 640 - width), rng.randint(0, 427 - height)
        crop = photo.crop((left, top, left + width, top + height))
        scale = rng.uniform(400, 1200) / max(width, height)
        crop = crop.resize((round(width * scale), round(height * scale)), Image.Resampling.BICUBIC)
        out = io.BytesIO()
        crop.save(out, format="JPEG", quality=90)
        (folder / f"{index}.jpg").write_bytes(out.getvalue())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_img2dataset() -> Path | None:
    binary = IMG2DATASET_VENV / "bin" / "img2dataset"
    if binary.exists():
        return binary
    print(f"installing img2dataset {IMG2DATASET_VERSION} into {IMG2DATASET_VENV} (once) ...", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(IMG2DATASET_VENV)], check=True)
        subprocess.run([str(IMG2DATASET_VENV / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
                        f"img2dataset=={IMG2DATASET_VERSION}"], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as err:
        print(f"img2dataset could not be installed: {err}\n{(err.stderr or '')[-2000:]}")
        return None
    return binary


def count_samples(folder: Path) -> int:
    total = 0
    for stats in folder.glob("*_stats.json"):
        data = json.loads(stats.read_text())
        total += data.get("successes", data.get("success", 0))
    return total


def run_ours(manifest: Path, output: Path, args: argparse.Namespace) -> float:
    command = [sys.executable, "-m", "cloob_core.cli", "data", "download", "--manifest", str(manifest),
               "--output", str(output), "--allow-private-network", "--no-progress",
               "--image-size", str(args.image_size), "--resize-mode", "keep_ratio", "--jpeg-quality", "95",
               "--shard-size", str(args.shard_size), "--processes", str(args.processes),
               "--threads", str(args.threads)]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - started


def run_img2dataset(binary: Path, manifest: Path, output: Path, args: argparse.Namespace) -> float:
    command = [str(binary), "--url_list", str(manifest), "--input_format", "csv", "--url_col", "url",
               "--caption_col", "caption", "--output_format", "webdataset", "--output_folder", str(output),
               "--image_size", str(args.image_size), "--resize_mode", "keep_ratio", "--encode_quality", "95",
               "--number_sample_per_shard", str(args.shard_size), "--processes_count", str(args.processes),
               "--thread_count", str(args.threads), "--enable_wandb", "False"]
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1")
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=2, help="runs per tool; the best is reported")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-download-"))
    try:
        print(f"making {args.images} images ...", flush=True)
        make_images(work / "www", args.images)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                   "--directory", str(work / "www")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        manifest = work / "manifest.csv"
        with manifest.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["url", "caption"])
            for index in range(args.images):
                writer.writerow([f"http://127.0.0.1:{port}/{index}.jpg", f"photo number {index}"])
        binary = ensure_img2dataset()
        ours, theirs = [], []
        try:
            for attempt in range(args.repeat):
                out = work / f"ours-{attempt}"
                ours.append(run_ours(manifest, out, args))
                ours_count = count_samples(out)
                if binary is not None:
                    out = work / f"img2dataset-{attempt}"
                    theirs.append(run_img2dataset(binary, manifest, out, args))
                    theirs_count = count_samples(out)
        finally:
            server.terminate()
        print(f"\n{args.images} images, {args.image_size} px keep_ratio, JPEG q95, {args.processes} processes x "
              f"{args.threads} threads, shards of {args.shard_size}; best of {args.repeat} (wall clock, "
              "process start included)")
        ours_rate = ours_count / min(ours)
        print(f"  cloob data download : {ours_count} images in {min(ours):6.2f} s = {ours_rate:7.1f} images/s")
        if theirs:
            theirs_rate = theirs_count / min(theirs)
            print(f"  img2dataset {IMG2DATASET_VERSION}  : {theirs_count} images in {min(theirs):6.2f} s = "
                  f"{theirs_rate:7.1f} images/s")
            print(f"  ratio (ours / img2dataset images/s): {ours_rate / theirs_rate:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
