"""clip-retrieval's ``inference`` on shards, timed: the anchor of ``bench_score.py``, run in clip-retrieval's own
environment (it pins numpy<2, pyarrow<16, webdataset<0.3 and open-clip-torch<3, so it does not install beside
this project; it imports nothing of cloob_core):

    python -m venv /tmp/crvenv
    /tmp/crvenv/bin/pip install TORCH_CPU_WHEEL "torchvision==0.28.*" clip-retrieval==2.44.0
    /tmp/crvenv/bin/python benchmarks/clip_retrieval_inference.py --shards 'DIR/{00000..00007}.tar' \\
        --architecture ViT-B-32 --weights MODEL/open_clip_model.safetensors --output /tmp/out

It embeds every image and caption of the shards (webdataset input, the model open_clip builds for the
architecture with the weights given) and prints a line `result JSON`: the seconds ``clip_inference`` took (the model's
loading included, as `cloob data score`'s time includes its own) and the images embedded.
"""

from __future__ import annotations

import argparse
import glob
import json
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", required=True, help="a brace pattern of the tars")
    parser.add_argument("--architecture", required=True)
    parser.add_argument("--weights", required=True, help="an open_clip state dict (.safetensors or .pt)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--config", help="an open_clip model config JSON for an architecture open_clip lacks")
    args = parser.parse_args()
    import open_clip
    from clip_retrieval.clip_inference.main import main as clip_inference

    if args.config:
        open_clip.add_model_config(args.config)
    started = time.perf_counter()
    clip_inference(input_dataset=args.shards, output_folder=args.output, input_format="webdataset",
                   batch_size=args.batch_size, num_prepro_workers=args.workers, enable_text=True, enable_image=True,
                   enable_metadata=False, clip_model=f"open_clip:{args.architecture}/{args.weights}", use_jit=False)
    seconds = time.perf_counter() - started
    images = sum(len(np.load(path)) for path in glob.glob(f"{args.output}/img_emb/*.npy"))
    print("\nresult " + json.dumps({"seconds": seconds, "images": images}))  # after its progress line


if __name__ == "__main__":
    main()
