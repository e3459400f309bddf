"""Shard building: `cloob data download` against img2dataset on the same work, whole command, in one run.

For each source size (the shorter side: 256, 512 and 1,024 px) it makes real-photo JPEGs and serves them from a
lean loopback server (`image_server.py`), then builds WebDataset shards from the same N URLs with both tools for
each output size (64 and 256 px, `keep_ratio`, never enlarged, JPEG quality 95, the same shard size, processes
and threads), and prints images/s for each, the ratio, and the PSNR of our stored images against a full decode
resized the same way.

The sources are collages of crops of scikit-learn's two sample photographs at their own scale (0.6 to 1.0), so a
1,024-px source has a photograph's detail rather than an enlargement's blur; each size has `--distinct` of them,
encoded at quality 75 to 95 and aspect ratios 1 to 1.6, and URL N is source N mod distinct.

img2dataset pins old webdataset/pandas releases, so it is installed into its own virtual environment
(benchmarks/.venv-img2dataset, created on first use with `pip install img2dataset==1.47.0`); if that fails,
the script says why and reports our figures alone.

    python benchmarks/bench_download.py [--images 20000] [--sources 256,512,1024] [--outputs 64,256]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
IMG2DATASET_VENV = ROOT / "benchmarks" / ".venv-img2dataset"
IMG2DATASET_VERSION = "1.47.0"
PSNR_SAMPLES = 200


def make_sources(folder: Path, short: int, count: int, seed: int) -> None:
    """``count`` JPEGs with the shorter side ``short``: collages of native-scale crops of real photographs."""
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = random.Random(seed * 100_003 + short)
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        long = round(short * rng.uniform(1.0, 1.6))
        width, height = (long, short) if rng.random() < 0.7 else (short, long)
        canvas = Image.new("RGB", (width, height))
        cell = rng.randint(200, 320)
        for top in range(0, height, cell):
            for left in range(0, width, cell):
                photo = photos[rng.randrange(len(photos))]
                scale = rng.uniform(0.6, 1.0)
                source = photo.resize((round(photo.width * scale), round(photo.height * scale)),
                                      Image.Resampling.BOX)
                w, h = min(cell, source.width), min(cell, source.height)
                x, y = rng.randint(0, source.width - w), rng.randint(0, source.height - h)
                canvas.paste(source.crop((x, y, x + w, y + h)), (left, top))
        out = io.BytesIO()
        canvas.save(out, format="JPEG", quality=rng.choice((75, 85, 90, 95)))
        (folder / f"{index}.jpg").write_bytes(out.getvalue())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`image_server.py` in a process of its own; `stop()` returns the CPU seconds it spent."""

    def __init__(self, folder: Path, port: int):
        self.process = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "image_server.py"), str(folder),
                                         str(port)], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "ready"

    def stop(self) -> float:
        self.process.send_signal(signal.SIGTERM)
        out, _ = self.process.communicate(timeout=30)
        return float(out.strip() or "nan")


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


@dataclass
class Run:
    seconds: float
    samples: int
    server_cpu: float

    @property
    def rate(self) -> float:
        return self.samples / self.seconds


def timed(command: list[str], output: Path, folder: Path, port: int, env: dict | None = None) -> Run:
    server = Server(folder, port)
    try:
        started = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                       env=env)
        seconds = time.perf_counter() - started
    finally:
        server_cpu = server.stop()
    return Run(seconds, count_samples(output), server_cpu)


def ours(manifest: Path, output: Path, size: int, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "cloob_core.cli", "data", "download", "--manifest", str(manifest),
            "--output", str(output), "--allow-private-network", "--no-progress",
            "--image-size", str(size), "--resize-mode", "keep_ratio", "--jpeg-quality", "95",
            "--shard-size", str(args.shard_size), "--processes", str(args.processes), "--threads", str(args.threads)]


def img2dataset(binary: Path, manifest: Path, output: Path, size: int, args: argparse.Namespace) -> list[str]:
    return [str(binary), "--url_list", str(manifest), "--input_format", "csv", "--url_col", "url",
            "--caption_col", "caption", "--output_format", "webdataset", "--output_folder", str(output),
            "--image_size", str(size), "--resize_mode", "keep_ratio", "--resize_only_if_bigger", "True",
            "--encode_quality", "95", "--number_sample_per_shard", str(args.shard_size),
            "--processes_count", str(args.processes), "--thread_count", str(args.threads), "--enable_wandb", "False"]


def write_manifest(path: Path, images: int, port: int) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["url", "caption"])
        for index in range(images):
            writer.writerow([f"http://127.0.0.1:{port}/{index}.jpg", f"photo number {index}"])


def stored_psnr(output: Path, sources: Path, distinct: int, size: int) -> tuple[float, float]:
    """PSNR of our stored JPEGs (the first ``PSNR_SAMPLES``) against what a full decode gives (the same steps:
    area-averaged to the stored size, encoded at the same quality): over all their pixels, and of the worst image.
    """
    from cloob_core.config import PreprocessConfig
    from cloob_core.data.imaging import full_decode_reference

    config = PreprocessConfig(image_size=size, resize_mode="keep_ratio", jpeg_quality=95)
    errors = []
    with tarfile.open(next(iter(sorted(output.glob("*.tar"))))) as tar:
        for member in tar:
            if not member.name.endswith(".jpg") or len(errors) >= PSNR_SAMPLES:
                continue
            meta = json.loads(tar.extractfile(member.name[:-4] + ".json").read())  # type: ignore[union-attr]
            source = (sources / f"{meta['row'] % distinct}.jpg").read_bytes()
            stored = np.asarray(Image.open(io.BytesIO(tar.extractfile(member).read())), dtype=np.float64)  # type: ignore[union-attr]
            reference = np.asarray(Image.open(io.BytesIO(full_decode_reference(source, config))), dtype=np.float64)
            errors.append(np.mean((stored - reference) ** 2))
    return decibels(float(np.mean(errors))), decibels(max(errors))


def decibels(mse: float) -> float:
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000, help="URLs per case")
    parser.add_argument("--distinct", type=int, default=1000, help="distinct source images per source size")
    parser.add_argument("--sources", default="256,512,1024", help="source sizes (shorter side, px)")
    parser.add_argument("--outputs", default="64,256", help="output sizes (shorter side, px)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ours-only", action="store_true", help="skip img2dataset")
    args = parser.parse_args()

    binary = None if args.ours_only else ensure_img2dataset()
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1")
    work = Path(tempfile.mkdtemp(prefix="bench-download-"))
    rows = []
    try:
        manifest = work / "manifest.csv"
        port = free_port()
        write_manifest(manifest, args.images, port)
        for short in map(int, args.sources.split(",")):
            sources = work / f"sources-{short}"
            print(f"making {args.distinct} sources of {short} px ...", flush=True)
            make_sources(sources, short, args.distinct, args.seed)
            for size in map(int, args.outputs.split(",")):
                out = work / f"ours-{short}-{size}"
                mine = timed(ours(manifest, out, size, args), out, sources, port)
                quality = stored_psnr(out, sources, args.distinct, size)
                shutil.rmtree(out)
                theirs = None
                if binary is not None:
                    out = work / f"img2dataset-{short}-{size}"
                    theirs = timed(img2dataset(binary, manifest, out, size, args), out, sources, port, env)
                    shutil.rmtree(out)
                rows.append((short, size, mine, theirs, quality))
                print(f"  {short} -> {size} px: ours {mine.rate:.0f}/s"
                      + (f", img2dataset {theirs.rate:.0f}/s" if theirs else ""), flush=True)
            shutil.rmtree(sources)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{args.images} URLs per case, keep_ratio, never enlarged, JPEG q95, {args.processes} processes x "
          f"{args.threads} threads, shards of {args.shard_size}, {os.cpu_count()} cores; wall clock of the whole "
          "command, start-up included; server CPU is the loopback server's share of the same cores")
    print(f"{'source':>6} {'output':>6} {'ours img/s':>10} {'img2dataset':>11} {'ratio':>6} {'goal':>5} "
          f"{'PSNR dB (worst)':>16} {'server CPU s':>13}")
    for short, size, mine, theirs, quality in rows:
        goal = 2.0 if size * 2 <= short else 1.2
        ratio = f"{mine.rate / theirs.rate:5.2f}x" if theirs else "  -   "
        server = f"{mine.server_cpu:.1f} / {theirs.server_cpu:.1f}" if theirs else f"{mine.server_cpu:.1f}"
        print(f"{short:>6} {size:>6} {mine.rate:>10.0f} {theirs.rate if theirs else float('nan'):>11.0f} "
              f"{ratio:>6} {goal:>4.1f}x {quality[0]:>8.1f} ({quality[1]:4.1f}) {server:>13}")
    if any(mine.samples != args.images for _, _, mine, _, _ in rows):
        print("warning: some of our runs stored fewer samples than URLs: "
              + ", ".join(f"{s}->{o}: {m.samples}" for s, o, m, _, _ in rows))


if __name__ == "__main__":
    main()
