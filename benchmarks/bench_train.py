"""Training-step throughput on the CPU: our CLOOB step, our CLIP step, and open_clip_train's CLIP step.

All three train the same model configuration with the same AdamW settings on the same random batch:
- ours, CLOOB: `CLOOBModel` + `CLOOBLoss` through `cloob_core.training.step` (the step `cloob train` runs,
  channels-last);
- ours, CLIP: the same with our `ClipLoss` (InfoNCE);
- open_clip_train: `open_clip.create_model` + `open_clip.ClipLoss(output_dict=True)` + the loop body of
  open_clip_train's `train_one_epoch` (autocast, sum of losses, backward, step, clamp logit_scale).

Throughput: the three run interleaved in one process (rounds of a few steps each, so every variant sees the
same machine state), median samples/s per variant. Peak memory: each variant alone in its own process (max
RSS on the CPU; max allocated on CUDA).

``--stage``: the training stage against its step. ``cloob train`` with the default settings on real shards
(decoding, augmenting, tokenising in its data-loader workers on the same cores) against open_clip_train's step
alone on random tensors, same model and batch, at torch's default threads; both measured quiet, then both under
``--load`` busy processes (the loaded machine of a shared CI runner or laptop). The stage's rate is the median of
its log windows after the first (steady state); the whole run's rate is printed beside it.

    python benchmarks/bench_train.py [--model cloob-tiny] [--batch 256] [--steps 5] [--rounds 12]
    python benchmarks/bench_train.py --stage [--shards data/shards] [--stage-steps 150] [--load 6]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from busy_load import load


def build_variant(variant: str, model_name: str, batch: int, precision: str = "fp32"):
    """(step function, device) for one variant, on its own model and optimiser; ``precision`` bf16: autocast, as
    open_clip_train's ``--precision amp_bf16`` and our ``train.precision: bf16``."""
    import open_clip
    import torch

    from cloob_core.config import load_config
    from cloob_core.devices import AUTOCAST_DTYPES
    from cloob_core.model.dual_encoder import build_model, register_project_configs
    from cloob_core.objectives.registry import build_objective
    from cloob_core.training.images import Normalize
    from cloob_core.training.optim import build_optimizer
    from cloob_core.training.step import StepParts, accumulate_gradients, optimizer_step

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_config(overrides=[f"model.architecture={model_name}"])
    register_project_configs()
    size = open_clip.get_model_config(model_name)["vision_cfg"]["image_size"]
    context = open_clip.get_model_config(model_name)["text_cfg"]["context_length"]
    images = torch.randn(batch, 3, size, size, device=device)
    tokens = torch.randint(1, 49000, (batch, context), device=device)

    if variant == "open_clip_train":
        model = open_clip.create_model(model_name, pretrained=None, output_dict=True).to(device)
        loss_fn = open_clip.ClipLoss()
        optimizer = build_optimizer(model, config.optim)

        dtype = AUTOCAST_DTYPES[precision]
        autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext

        def step() -> None:
            with autocast():
                model_out = model(images, tokens)
                losses = loss_fn(**model_out, output_dict=True)
                total = sum(losses.values())
            optimizer.zero_grad()
            total.backward()
            optimizer.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
    else:  # as the loop runs it: channels-last, on the CPU too
        model = build_model(config.model).to(device, memory_format=torch.channels_last)
        pixels = torch.randint(0, 256, images.shape, dtype=torch.uint8, device=device).contiguous(
            memory_format=torch.channels_last)  # the loop's input: uint8 crops, normalised on the device
        normalize = Normalize.of(model.encoder.visual)
        objective = build_objective("cloob", beta=8.0) if variant == "ours_cloob" else build_objective("clip")
        parts = StepParts(model=model, objective=objective, optimizer=build_optimizer(model, config.optim),
                          scaler=torch.amp.GradScaler(device.type, enabled=False), device_type=device.type,
                          precision=precision)

        def step() -> None:
            accumulate_gradients(parts, normalize(pixels), tokens)
            optimizer_step(parts)
            model.clamp_inv_tau_()

    model.train()
    return step, device


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory(variant: str, model_name: str, batch: int, steps: int) -> int:
    """Peak bytes of one variant alone: max RSS of its own process (CUDA: max allocated)."""
    import torch

    step, device = build_variant(variant, model_name, batch)
    for _ in range(steps):
        step()
    _sync(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


WINDOW = re.compile(r"step \d+/\d+ loss \S+ lr \S+ ([\d.]+) samples/s")


def step_alone(model_name: str, batch: int, steps: int) -> float:
    """open_clip_train's step on random tensors, in its own process at torch's default threads: samples/s."""
    code = ("import sys, time; sys.path.insert(0, {here!r}); from bench_train import build_variant, _sync\n"
            "step, device = build_variant('open_clip_train', {model!r}, {batch})\nstep(); step(); _sync(device)\n"
            "t = time.perf_counter()\nfor _ in range({steps}): step()\n_sync(device)\n"
            "print({steps} * {batch} / (time.perf_counter() - t))")
    here = str(Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", code.format(here=here, model=model_name, batch=batch, steps=steps)],
                         check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def training_stage(shards: str, model_name: str, steps: int) -> tuple[float, float]:
    """``cloob train`` with the default settings: (median samples/s of its windows after the first, whole run)."""
    with tempfile.TemporaryDirectory() as scratch:
        run = subprocess.run([sys.executable, "-c", "from cloob_core.cli import main; raise SystemExit(main())",
                              "train", "--shards", shards, "--output", scratch + "/run", "--steps", str(steps),
                              "--set", f"model.architecture={model_name}", "--no-progress", "--no-tensorboard",
                              "--checkpoint-every", str(steps)], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"cloob train failed: {run.stderr[-2000:]}")
        windows = [float(rate) for rate in WINDOW.findall(run.stderr)]
        whole = json.loads((Path(scratch) / "run" / "metrics.json").read_text())
    return statistics.median(windows[1:]), whole["samples_per_second"]


def stage_versus_step(args: argparse.Namespace) -> None:
    from cloob_core.config import CloobConfig

    batch = CloobConfig().train.batch_size
    print(f"training stage vs its step: {args.model}, batch {batch} (the default), `cloob train` on {args.shards} "
          f"for {args.stage_steps} steps; open_clip_train's step alone on random tensors, torch's default threads")
    print(f"  {'machine':<24} {'step alone':>11} {'stage':>9} {'stage, whole run':>17} {'stage / step':>13}")
    for label, processes in (("quiet", 0), (f"under a load of {args.load}", args.load)):
        if label != "quiet" and not processes:
            continue
        with load(processes, seconds=1800):
            anchor = step_alone(args.model, batch, args.step_steps)
            stage, whole = training_stage(args.shards, args.model, args.stage_steps)
            anchor = (anchor + step_alone(args.model, batch, args.step_steps)) / 2  # before and after the stage
        print(f"  {label:<24} {anchor:>11.1f} {stage:>9.1f} {whole:>17.1f} {stage / anchor:>13.2f}")
    print("  (samples/s; goal: stage / step >= 0.9)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cloob-tiny")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--stage", action="store_true", help="the training stage against its step alone")
    parser.add_argument("--shards", default="data/shards", help="--stage: real shards (`dvc repro download`)")
    parser.add_argument("--stage-steps", type=int, default=150)
    parser.add_argument("--step-steps", type=int, default=60, help="--stage: steps of the step alone")
    parser.add_argument("--load", type=int, default=6, help="--stage: busy processes of the loaded run (0: none)")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_of:
        print(json.dumps({"peak_bytes": peak_memory(args.memory_of, args.model, args.batch, 3)}))
        return
    if args.stage:
        stage_versus_step(args)
        return

    variants = ("ours_cloob", "ours_clip", "open_clip_train")
    steps = {v: build_variant(v, args.model, args.batch) for v in variants}
    for step, _device in steps.values():  # warm up every variant
        step()
        step()
    device = steps["ours_cloob"][1]
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):  # interleaved rounds: every variant sees the same machine state
        for variant in variants:
            step, _ = steps[variant]
            _sync(device)
            started = time.perf_counter()
            for _ in range(args.steps):
                step()
            _sync(device)
            rates[variant].append(args.steps * args.batch / (time.perf_counter() - started))
    memory = {}
    for variant in variants:
        out = subprocess.run([sys.executable, __file__, "--memory-of", variant, "--model", args.model,
                              "--batch", str(args.batch)], check=True, capture_output=True, text=True)
        memory[variant] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
    median = {v: statistics.median(r) for v, r in rates.items()}
    print(f"training step, {args.model}, batch {args.batch}, fp32 on {device}; median of {args.rounds} interleaved "
          f"rounds of {args.steps} steps; peak memory of each variant alone")
    print(f"  {'variant':<18} {'samples/s':>10} {'peak memory':>12}")
    for variant in variants:
        print(f"  {variant:<18} {median[variant]:>10.1f} {memory[variant] / 2**20:>9.0f} MiB")
    cloob, clip, anchor = (median[v] for v in variants)
    print(f"  CLOOB / CLIP (ours)            : {cloob / clip:.2f}  (goal >= 0.95; paper Table A9: 141/148 GPU-h)")
    print(f"  ours CLIP / open_clip_train    : {clip / anchor:.2f}  (goal >= 1.0)")
    print(f"  ours CLOOB / open_clip_train   : {cloob / anchor:.2f}")


if __name__ == "__main__":
    main()
