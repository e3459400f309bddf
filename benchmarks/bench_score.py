"""`cloob data score` against `cloob eval`'s image embedding on the same shards, with the same model, workers and
batch: both decode every image once in the data-loader workers, so scoring should run at the embedding's rate
(goal: at least 0.9x) although it also embeds the captions, hashes each image (SHA-256, the perceptual hash),
identifies each caption's language and writes a part per shard. The outside anchor, which embeds captions too, is
clip-retrieval's ``inference`` (2.44.0) on the same shards with the same model (the architecture and weights),
workers and batch, run in an environment of its own (``--anchor-python``: it pins numpy<2, pyarrow<16,
webdataset<0.3 and open-clip-torch<3, so it does not install beside this project; how to make one:
``benchmarks/clip_retrieval_inference.py``).

    python benchmarks/bench_score.py [--shards DIR] [--architecture cloob-tiny|ViT-B-32] [--workers 2]
                                     [--batch-size 256] [--repeat 3] [--anchor-python /tmp/crvenv/bin/python]

Without ``--shards`` it scores the packaged captioned training split (2,046 photos and drawings, 8 shards), built
into a temporary folder; other shards show other decode costs (``--shards`` any `cloob data` output).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_eval_input import export

from cloob_core.config import load_config
from cloob_core.curation.score import ScoreRequest, score
from cloob_core.data.local import build_shards
from cloob_core.evaluation.features import Encoding, image_features
from cloob_core.evaluation.inputs import shard_set
from cloob_core.model.source import ModelSource, load_model


@dataclass(frozen=True)
class Rates:
    samples: int
    embed: list[float]  # seconds of each repeat
    scoring: list[float]

    @property
    def embed_rate(self) -> float:
        return self.samples / statistics.median(self.embed)

    @property
    def score_rate(self) -> float:
        return self.samples / statistics.median(self.scoring)


def measure(shards: str, source: ModelSource, scratch: Path, workers: int, batch_size: int, repeat: int) -> Rates:
    """``cloob eval``'s image embedding and `cloob data score` on ``shards``, alternately, ``repeat`` times each."""
    images = shard_set(shards, "label")
    loaded = load_model(source)
    embed, scoring, rows = [], [], 0
    for attempt in range(repeat):
        started = time.perf_counter()
        embedded = image_features(loaded, images, Encoding(batch_size=batch_size, progress=False, workers=workers))
        embed.append(time.perf_counter() - started)
        output = scratch / f"scores-{attempt}"
        started = time.perf_counter()
        rows = score(ScoreRequest(shards, source, str(output), batch_size=batch_size, workers=workers,
                                  progress=False)).rows
        scoring.append(time.perf_counter() - started)
        shutil.rmtree(output)
        if rows != len(embedded.features):
            raise AssertionError(f"scored {rows} samples, embedded {len(embedded.features)}")
    return Rates(rows, embed, scoring)


def clip_retrieval_rates(python: str, shards: str, model: Path, scratch: Path, args: argparse.Namespace,
                         samples: int) -> list[float]:
    """The seconds of clip-retrieval's inference on ``shards`` with ``model``'s architecture and weights, ``repeat``
    times, each in a process of its own environment (``python``)."""
    import json
    import subprocess

    tars = sorted(Path(shards).glob("*.tar"))
    pattern = f"{shards}/{{{tars[0].stem}..{tars[-1].stem}}}.tar" if len(tars) > 1 else str(tars[0])
    info = json.loads((model / "open_clip_config.json").read_text())
    config = scratch / f"{args.architecture}.json"  # (an architecture of ours, which open_clip lacks)
    config.write_text(json.dumps(info["model_cfg"]))
    seconds = []
    for attempt in range(args.repeat):
        output = scratch / f"clip-retrieval-{attempt}"
        done = subprocess.run([python, str(Path(__file__).with_name("clip_retrieval_inference.py")), "--shards",
                               pattern, "--architecture", args.architecture, "--weights",
                               str(model / "open_clip_model.safetensors"), "--output", str(output), "--batch-size",
                               str(args.batch_size), "--workers", str(args.workers), "--config", str(config)],
                              capture_output=True, text=True, check=True)
        found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("result "))[7:])
        if found["images"] != samples:
            raise AssertionError(f"clip-retrieval embedded {found['images']} images, we scored {samples}")
        seconds.append(found["seconds"])
        shutil.rmtree(output)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards")
    parser.add_argument("--architecture", default="cloob-tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--anchor-python", help="the python of an environment with clip-retrieval")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        shards = args.shards
        if shards is None:
            shards = str(root / "shards")
            build_shards("captioned", shards, load_config(), split="train", progress=False)
        source = ModelSource(model=str(export(root, args.architecture, steps=0)), device="cpu")
        rates = measure(shards, source, root, args.workers, args.batch_size, args.repeat)
        embed, scoring = rates.embed, rates.scoring
        print(f"{args.architecture}, {rates.samples:,} images, {args.workers} workers, batch {args.batch_size}, "
              f"median of {args.repeat} (spread: embed {min(embed):.1f}-{max(embed):.1f} s, score "
              f"{min(scoring):.1f}-{max(scoring):.1f} s)")
        print(f"cloob eval's embedding: {rates.embed_rate:,.0f} images/s")
        print(f"cloob data score:       {rates.score_rate:,.0f} images/s (model load and index included)")
        print(f"ratio score / embed:    {rates.score_rate / rates.embed_rate:.2f}x (goal >= 0.9x)")
        if args.anchor_python is None:
            print("clip-retrieval's inference: not run (--anchor-python: its own environment)")
            return
        anchor = clip_retrieval_rates(args.anchor_python, shards, Path(source.model), root, args, rates.samples)
        print(f"clip-retrieval inference: {rates.samples / statistics.median(anchor):,.0f} images/s (median of "
              f"{len(anchor)}, {min(anchor):.1f}-{max(anchor):.1f} s; model load included)")
        print(f"ratio score / clip-retrieval: {statistics.median(anchor) / statistics.median(scoring):.2f}x "
              "(goal >= 1x)")


if __name__ == "__main__":
    main()
