"""The GPU check: the training path on one GPU, in one command (run by ``benchmarks/gpu_check.sh``).

Each section prints its figures and goes on if another failed; the exit status is 1 if any section failed.
Full mode needs CUDA: about 5 minutes on one H100/H200 with 16 cores, and section 8 about 9 more (run it as a
command of its own, ``--sections 8``, where a command's time is limited); ``--quick`` runs every
section on the CPU with a tiny model and small sizes, in CI, so the script does not rot (its figures mean
nothing there).

Sections:
1. our CLIP step against open_clip_train's, same model and batch, bf16 autocast (ViT-B-32 and RN50, batch 256);
2. our CLOOB step against our CLIP step;
3. ``cloob train`` with the defaults a GPU pod gets (device cuda, precision/workers/streams auto) on JPEG shards
   against its step alone, and the host synchronisations per step (``torch.cuda.set_sync_debug_mode``);
4. the CLOOB and InfoNCE losses (forward + backward) against the matmul bound, N = 1k to 16k;
5. NCCL: the gather with gradient, DDP with accumulation and a learnable temperature, and DDP with the bf16
   compression hook, on a world-size-1 group;
6. an "8-GPU" checkpoint (every device's CUDA RNG state, as earlier versions saved it) resumed on one GPU;
7. (only when asked: ``--sections 7``) the stage against its step under variants: twice the batch, half the
   workers, smaller source JPEGs (a cheaper decode: is decoding the limit?); about 2 minutes on a GPU;
8. the models learn: ``cloob train`` with the defaults (ViT-B-32: ``--preset vit-b``), CLOOB and CLIP on ViT-B-32
   and RN50, batch 256, on the packaged captioned pairs stored at 224 px, 600 steps past the warm-up (ViT-B-32:
   2,600 steps, the preset's 2,000 warm-up steps; RN50: 800, the defaults' 200), so CLOOB's start has ended and it
   trains with Hopfield retrieval (a CLOOB run that never did fails the section); each run's loss against its
   collapsed value, its effective rank and mean cosine, the step its retrieval began at, and held-out retrieval R@5
   on the 504 test pairs against chance (1%). Goals: the loss 0.02 or more below the collapsed value, an image rank
   above 32, R@5 at least 5x chance. About 3 minutes a ViT-B-32 run on an H100 (``--sections 8`` alone: about 9);
9. evaluation against CLIP_benchmark (``benchmarks/bench_eval_input.py``): ``cloob eval zeroshot`` and
   ``clip_benchmark eval`` on the same ViT-B-32 export (section 8's CLOOB run when it ran, else the seeded initial
   weights) and the same 10,000 real photos (256-384 px) in CLIP_benchmark's wds layout; images/s, peak memory and
   top-1 of each. Goals: ours at least CLIP_benchmark's images/s (with its defaults: amp, batch 64, 4 workers) and
   2,000 images/s. CLIP_benchmark runs from its overlay (.venv-clip-benchmark, scripts/clip_benchmark_env.sh; carry
   it to a machine without network). About 2 minutes;
10. curation's scoring (``benchmarks/bench_score.py``): ``cloob data score`` against ``cloob eval``'s image
   embedding on the same 20,000 JPEG photos (288 px) in shards, ViT-B-32, bf16 autocast, batch 256, a worker per
   core but one. Goal: at least 3,000 samples/s scored (LAION-5B embedded 1,800 per A100). About 1 minute.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import logging
import os
import socket
import statistics
import sys
import tarfile
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_train import build_variant

RESULTS: list[str] = []
FAILED: list[str] = []


@dataclass(frozen=True)
class Sizes:
    device: str
    models: tuple[str, ...]  # (a ViT, a ResNet)
    batch: int
    warmup: int
    steps: int
    loss_sizes: tuple[int, ...]
    dim: int
    images: int  # distinct JPEGs in the shards of the training-stage section
    image_side: int
    stage_steps: int
    backend: str


FULL = Sizes("cuda", ("ViT-B-32", "RN50"), 256, 10, 30, (1024, 2048, 4096, 8192, 16384), 512, 4096, 288, 70,
             "nccl")
QUICK = Sizes("cpu", ("cloob-tiny-vit", "cloob-tiny"), 16, 1, 2, (64, 128), 32, 96, 48, 6, "gloo")
# Section 8's run lengths: 600 steps past the ViT-B-32 preset's 2,000 warm-up steps and the RN50 defaults' 200, the
# least CLOOB's start lasts (then it lasts while a batch is near the collapsed value, three warm-ups at most); and a
# CI smoke run's, which its start ends inside.
LEARNING_STEPS = {"ViT-B-32": 2_600, "RN50": 800, "cpu": 8}
LEARNING_WARMUP = {"cuda": None, "cpu": 2}  # None: the preset's or the defaults'; 2: CLOOB's start ends by step 6


def say(line: str) -> None:
    print(line, flush=True)
    RESULTS.append(line)


def section(title: str) -> Callable:
    def wrap(fn: Callable) -> Callable:
        def run(*args, **kwargs):
            say(f"== {title}")
            started = time.perf_counter()
            try:
                fn(*args, **kwargs)
            except Exception as err:  # a section's failure is reported; the others still run
                FAILED.append(title)
                say(f"   FAILED: {type(err).__name__}: {err}")
                traceback.print_exc()
            say(f"   ({time.perf_counter() - started:.1f} s)")
        return run
    return wrap


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rate(step: Callable[[], None], device: torch.device, batch: int, warmup: int, steps: int) -> float:
    """Samples/s of ``step`` after ``warmup`` steps (three timed blocks, their median)."""
    for _ in range(warmup):
        step()
    sync(device)
    rates = []
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        rates.append(steps * batch / (time.perf_counter() - started))
    return statistics.median(rates)


@section("1-2. training step: ours against open_clip_train's, CLOOB against CLIP (bf16 autocast)")
def steps_against_open_clip(sizes: Sizes) -> None:
    for model in sizes.models:
        measured = {}
        for variant in ("open_clip_train", "ours_clip", "ours_cloob"):
            step, device = build_variant(variant, model, sizes.batch, precision="bf16")
            measured[variant] = rate(step, device, sizes.batch, sizes.warmup, sizes.steps)
            del step
            if device.type == "cuda":
                torch.cuda.empty_cache()
        say(f"   {model}, batch {sizes.batch}: open_clip_train {measured['open_clip_train']:.0f}, ours CLIP "
            f"{measured['ours_clip']:.0f}, ours CLOOB {measured['ours_cloob']:.0f} samples/s")
        say(f"   {model}: ours CLIP / open_clip_train = {measured['ours_clip'] / measured['open_clip_train']:.3f} "
            f"(goal >= 0.95); CLOOB / CLIP = {measured['ours_cloob'] / measured['ours_clip']:.3f} (goal >= 0.9)")


def photo_jpegs(count: int, side: int) -> Iterator[tuple[bytes, str]]:
    """``count`` (JPEG, caption) pairs: the packaged captioned photos (128 px) enlarged to ``side`` px wide and
    re-encoded at quality 90, so decoding costs what a photo of that size costs; past the photos' number, mirrored
    and turned copies, so that no two samples are the same."""
    import pyarrow.parquet as pq
    from PIL import Image

    import cloob_core.data as data_package

    rows = pq.read_table(Path(data_package.__file__).parent / "captioned" / "pairs.parquet",
                         columns=["image", "caption"]).to_pylist()
    for index in range(count):
        row = rows[index % len(rows)]
        image = Image.open(io.BytesIO(row["image"])).convert("RGB")
        image = image.resize((side, side * image.height // image.width), Image.Resampling.BICUBIC)
        if index >= len(rows):
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT).rotate(index % 7, expand=False)
        encoded = io.BytesIO()
        image.save(encoded, "JPEG", quality=90)
        yield encoded.getvalue(), row["caption"]


def write_shards(folder: Path, count: int, side: int, per_shard: int) -> int:
    """:func:`photo_jpegs` in WebDataset tars of ``per_shard`` samples, with their sizes.json. Returns the shards."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = (count + per_shard - 1) // per_shard
    samples = photo_jpegs(count, side)
    for shard in range(shards):
        with tarfile.open(folder / f"{shard:05d}.tar", "w") as tar:
            for index in range(shard * per_shard, min(count, (shard + 1) * per_shard)):
                jpeg, caption = next(samples)
                for suffix, payload in (("jpg", jpeg), ("txt", caption.encode())):
                    info = tarfile.TarInfo(f"{index:08d}.{suffix}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    (folder / "sizes.json").write_text("{" + ", ".join(
        f'"{shard:05d}.tar": {min(per_shard, count - shard * per_shard)}' for shard in range(shards)) + "}")
    return shards


class StepClock:
    """Called at the end of each step (``Monitor.advance``): the host synchronisations (sync-debug warnings) each
    step made, and the time between the ends of steps ``first`` and ``last``, where it synchronises once each
    (those two steps' counts then include its own sync and are left out)."""

    def __init__(self, first: int, last: int, device: torch.device) -> None:
        self.first, self.last, self.device = first, last, device
        self.syncs: list[int] = []
        self.caught: list = []
        self.started = self.ended = 0.0
        self._seen = 0

    def tick(self) -> None:
        step = len(self.syncs)
        if step in (self.first, self.last):
            sync(self.device)
            if step == self.first:
                self.started = time.perf_counter()
            else:
                self.ended = time.perf_counter()
        self.syncs.append(len(self.caught) - self._seen)
        self._seen = len(self.caught)

    def samples_per_second(self, batch: int) -> float:
        return (self.last - self.first) * batch / (self.ended - self.started)

    def syncs_per_step(self) -> list[int]:
        return self.syncs[self.first + 1 : self.last]


@dataclass
class StageRun:
    stage: float  # samples/s of the stage, steady state
    alone: float  # samples/s of its step alone, same model and batch
    result: object  # the stage's TrainResult
    clock: StepClock
    caught: list


def run_stage(sizes: Sizes, scratch: Path, name: str, batch: int, extra: tuple[str, ...] = (),
              image_side: int | None = None) -> StageRun:
    """``cloob train`` with a GPU pod's defaults (plus ``extra`` overrides) on the check's shards (of
    ``image_side``-px JPEGs, by default the check's), and its step alone on random tensors at the same model and
    batch."""
    from cloob_core.config import load_config
    from cloob_core.training import monitor as monitor_module
    from cloob_core.training.loop import train

    model = sizes.models[0]
    side = image_side or sizes.image_side
    shards = scratch / ("shards" if side == sizes.image_side else f"shards-{side}")
    if not shards.exists():
        write_shards(shards, sizes.images, side, per_shard=max(sizes.images // 64, 8))
    step, device = build_variant("ours_cloob", model, batch, precision="bf16" if sizes.device == "cuda" else "fp32")
    alone = rate(step, device, batch, sizes.warmup, sizes.steps)
    del step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    overrides = [f"train.shards={shards}", f"model.architecture={model}", f"train.batch_size={batch}",
                 f"train.steps={sizes.stage_steps}", f"train.checkpoint_every={sizes.stage_steps}",
                 f"train.log_every={sizes.stage_steps}", "train.tensorboard=false", "train.sample_cache_mb=0",
                 f"train.device={'cuda' if sizes.device == 'cuda' else 'auto'}", *extra]
    config = load_config(overrides=overrides)
    settled = max(sizes.stage_steps // 4, 2)  # workers started, first batches decoded
    clock = StepClock(settled, sizes.stage_steps - 2, device)  # (the last step writes its checkpoint)
    real_advance = monitor_module.Monitor.advance

    def advance(self, *args, **kwargs):
        clock.tick()
        return real_advance(self, *args, **kwargs)

    monitor_module.Monitor.advance = advance
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            clock.caught = caught
            result = train(config, scratch / name, progress=False)
    finally:
        monitor_module.Monitor.advance = real_advance
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    return StageRun(clock.samples_per_second(batch), alone, result, clock, caught)


@section("3. the training stage with a GPU pod's defaults against its step alone; host syncs per step")
def stage_against_step(sizes: Sizes, scratch: Path) -> None:
    run = run_stage(sizes, scratch, "run", sizes.batch)
    syncs = run.clock.syncs_per_step()
    metrics = run.result.metrics
    device = torch.device(sizes.device)
    say(f"   {sizes.models[0]}, batch {sizes.batch}, {sizes.images} {sizes.image_side}-px JPEGs: precision "
        f"{metrics['precision']} on {device}; shape: {_shape_line(scratch / 'run')}")
    say(f"   stage {run.stage:.0f} samples/s (steps {run.clock.first + 1}-{run.clock.last}), step alone "
        f"{run.alone:.0f}: stage / step = {run.stage / run.alone:.3f} (goal >= 0.9); whole run "
        f"{metrics['samples_per_second']:.0f}")
    if device.type == "cuda":
        detail = [str(w.message)[:120] for w in run.caught if "synchroniz" in str(w.message)][:3]
        say(f"   host syncs per step: {statistics.mean(syncs):.2f} (max {max(syncs)}; goal 0)"
            + (f"; e.g. {detail}" if max(syncs) else ""))
    else:
        say("   host syncs per step: not measured on the CPU")


@section("7. the training stage against its step under variants (what closes the gap; opt-in: --sections 7)")
def stage_variants(sizes: Sizes, scratch: Path) -> None:
    smaller = max(sizes.image_side * 7 // 9, 16)  # 224 px from the check's 288: a cheaper decode, same crop
    variants = (("defaults", sizes.batch, (), None),
                ("twice the batch", 2 * sizes.batch, (), None),
                ("half the workers", sizes.batch, ("train.workers=8" if sizes.device == "cuda" else "train.workers=1",),
                 None),
                (f"{smaller}-px JPEGs", sizes.batch, (), smaller))
    for index, (label, batch, extra, side) in enumerate(variants):
        run = run_stage(sizes, scratch, f"variant-{index}", batch, extra, side)
        say(f"   {label:<20} batch {batch}: stage {run.stage:.0f}, step alone {run.alone:.0f} samples/s: "
            f"stage / step = {run.stage / run.alone:.3f}")


def _shape_line(run: Path) -> str:
    saved = torch.load(sorted((run / "checkpoints").glob("step-*.pt"))[-1], weights_only=True, mmap=True)
    train = saved["config"]["train"]
    return f"{train['data_streams']} data streams, {train['workers']} workers, device {train['device']}"


@section("4. losses (forward + backward) against the matmul bound")
def losses_against_matmul(sizes: Sizes) -> None:
    from cloob_core.objectives.losses import cloob_loss, infonce_loss

    device = torch.device(sizes.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    side = 8192 if device.type == "cuda" else 256
    a = torch.randn(side, side, device=device, dtype=dtype)
    product = lambda: a @ a  # noqa: E731
    for _ in range(3):
        product()
    sync(device)
    started = time.perf_counter()
    for _ in range(10):
        product()
    sync(device)
    peak = 10 * 2 * side**3 / (time.perf_counter() - started)
    say(f"   matmul rate ({side}^3, {str(dtype).removeprefix('torch.')}): {peak / 1e12:.1f} TFLOP/s")
    # GEMMs of N x N x d, forward + backward (each GEMM's backward is two): InfoNCE 1 + 2, CLOOB 9 + 18
    gemms = {"infonce": 3, "cloob": 27}
    functions = {"infonce": lambda x, y: infonce_loss(x, y, 30.0), "cloob": lambda x, y: cloob_loss(x, y, 30.0, 8.0)}
    for n in sizes.loss_sizes:
        x = torch.nn.functional.normalize(torch.randn(n, sizes.dim, device=device), dim=-1).to(dtype)
        y = torch.nn.functional.normalize(x.float() + 0.5 * torch.randn_like(x.float()), dim=-1).to(dtype)
        x.requires_grad_(True)
        y.requires_grad_(True)
        cells = []
        for name, fn in functions.items():
            def run(fn: Callable = fn, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                    loss = fn(x, y)
                loss.backward()
            seconds = 1 / rate(run, device, 1, 2, 5)
            bound = gemms[name] * 2 * n * n * sizes.dim / peak
            cells.append(f"{name} {seconds * 1e3:.2f} ms (bound {bound * 1e3:.2f} ms, {bound / seconds:.0%})")
            x.grad = y.grad = None
        memory = f"; peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else ""
        say(f"   N={n}: " + ", ".join(cells) + memory)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@section("5. a world-size-1 process group: gather with gradient, DDP with accumulation and a learnt temperature, "
         "DDP with bf16 compression")
def collectives(sizes: Sizes) -> None:
    import torch.distributed as dist
    from torch import nn

    from cloob_core.objectives.distributed import all_gather_with_grad
    from cloob_core.objectives.registry import build_objective
    from cloob_core.training.step import StepParts, accumulate_gradients, optimizer_step

    device = torch.device(sizes.device, 0) if sizes.device == "cuda" else torch.device("cpu")
    dist.init_process_group(sizes.backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        x = torch.randn(6, 4, device=device, requires_grad=True)
        weights = torch.randn(6, 4, device=device)
        gathered = all_gather_with_grad(x)
        (gathered * weights).sum().backward()
        ok = torch.equal(gathered, x) and torch.equal(x.grad, weights)
        say(f"   {dist.get_backend()} gather with gradient: {'equal' if ok else 'DIFFERENT'}")
        if not ok:
            raise AssertionError("the gather or its backward is wrong")

        class Towers(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.image, self.text = nn.Linear(8, 5), nn.Linear(6, 5)
                self.log_inv_tau = nn.Parameter(torch.tensor(2.5))

            def forward(self, images, texts):
                return (nn.functional.normalize(self.image(images), dim=-1),
                        nn.functional.normalize(self.text(texts), dim=-1), self.log_inv_tau.exp())

        torch.manual_seed(0)
        reference = Towers().to(device)
        wrapped_module = copy.deepcopy(reference)
        wrapped = nn.parallel.DistributedDataParallel(wrapped_module, device_ids=[0] if device.type == "cuda" else None)
        results = []
        for model, module, accum in ((wrapped, wrapped_module, 2), (reference, reference, 1)):
            parts = StepParts(model=model, objective=build_objective("cloob", beta=8.0),
                              optimizer=torch.optim.AdamW(module.parameters(), lr=0.05),
                              scaler=torch.amp.GradScaler(device.type, enabled=False), device_type=device.type,
                              accum_freq=accum)
            generator = torch.Generator().manual_seed(1)
            for _ in range(3):
                images, texts = torch.randn(12, 8, generator=generator), torch.randn(12, 6, generator=generator)
                accumulate_gradients(parts, images.to(device), texts.to(device))
                optimizer_step(parts)
            results.append(torch.cat([p.detach().flatten() for p in module.parameters()]))
        worst = (results[0] - results[1]).abs().max().item()
        say(f"   DDP, accum_freq 2, learnt temperature, 3 steps: ran; largest difference from one process on the "
            f"whole batch {worst:.1e}")
        if worst > 1e-4:
            raise AssertionError(f"DDP with accumulation differs from one process by {worst}")
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # train.grad_compression bf16

        plain, compressed = copy.deepcopy(reference), copy.deepcopy(reference)
        hooked = nn.parallel.DistributedDataParallel(compressed, device_ids=[0] if device.type == "cuda" else None)
        hooked.register_comm_hook(None, default_hooks.bf16_compress_hook)
        images, texts = torch.randn(12, 8, device=device), torch.randn(12, 6, device=device)
        for model in (plain, hooked):
            build_objective("cloob", beta=8.0)(*model(images, texts)).backward()
        gap = max((a.grad - b.grad).abs().max().item() / max(a.grad.abs().max().item(), 1e-12)
                  for a, b in zip(plain.parameters(), compressed.parameters(), strict=True))
        say(f"   DDP with the bf16 compression hook: ran; gradients within {gap:.1e} of the exact ones (relative)")
        if gap > 2 ** -6:
            raise AssertionError(f"bf16-compressed gradients differ by {gap}")
    finally:
        dist.destroy_process_group()


@section("6. an 8-GPU checkpoint resumed on one GPU")
def resume_from_eight(sizes: Sizes, scratch: Path) -> None:
    from cloob_core.config import load_config
    from cloob_core.training.checkpoint import CHECKSUM_SUFFIX
    from cloob_core.training.loop import train

    shards = scratch / "shards"
    if not shards.exists():
        write_shards(shards, sizes.images, sizes.image_side, per_shard=max(sizes.images // 64, 8))
    base = [f"train.shards={shards}", "model.architecture=cloob-tiny-vit", "train.batch_size=64",
            "train.tensorboard=false", "train.checkpoint_every=2", "train.steps=4", "train.data_streams=8",
            "train.workers=2", "train.log_every=2"]
    train(load_config(overrides=base), scratch / "whole", progress=False)
    saved_path = scratch / "whole" / "checkpoints" / "step-00000002.pt"
    saved = torch.load(saved_path, weights_only=True)
    if torch.cuda.is_available():  # as rank 0 of an 8-GPU pod saved it before: every device's state
        saved["rng"]["cuda"] = [torch.cuda.get_rng_state()] * 8
    saved["world_size"] = 8
    eight = scratch / "eight" / "step-00000002.pt"
    eight.parent.mkdir(parents=True)
    torch.save(saved, eight)
    (eight.parent / (eight.name + CHECKSUM_SUFFIX)).write_text(hashlib.sha256(eight.read_bytes()).hexdigest() + "\n")
    result = train(load_config(overrides=base), scratch / "resumed", resume=str(eight), progress=False)
    final = torch.load(scratch / "resumed" / "checkpoints" / "step-00000004.pt", weights_only=True)
    reference = torch.load(scratch / "whole" / "checkpoints" / "step-00000004.pt", weights_only=True)
    same_data = final["positions"] == reference["positions"]
    worst = max((final["model"][k].float() - reference["model"][k].float()).abs().max().item() for k in final["model"])
    say(f"   resumed at step {result.metrics['resumed_from_step']} of {result.metrics['steps']} on "
        f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s): data positions "
        f"{'as the uninterrupted run' if same_data else 'DIFFERENT'}, largest weight difference {worst:.1e}")
    if not same_data:
        raise AssertionError("the resumed run read other data")


@section("8. the models learn: loss against its collapsed value, effective rank, held-out R@5 (CLOOB and CLIP)")
def models_learn(sizes: Sizes, scratch: Path, steps: int | None, warmup: int | None) -> None:
    """``steps`` (None: LEARNING_STEPS by model) and ``warmup`` (None: LEARNING_WARMUP): CLOOB's start without retrieval
    lasts the warm-up, then until a batch has left the collapsed value (at most three warm-ups), so a run past it
    trains with Hopfield retrieval; a CLOOB run that never did fails the section, on the CPU too."""
    from cloob_core.config import load_config
    from cloob_core.data.local import build_shards
    from cloob_core.evaluation.run import evaluate
    from cloob_core.evaluation.tasks.common import EvalOptions
    from cloob_core.evaluation.tasks.retrieval import RetrievalTask
    from cloob_core.model.source import ModelSource
    from cloob_core.training.loop import train

    side = 224 if sizes.device == "cuda" else 32
    shards = scratch / f"captioned-{side}"
    if not shards.exists():  # the packaged pictures (128 px) stored enlarged, as the towers' input needs
        build_shards("captioned", str(shards), load_config(overrides=[
            f"preprocess.image_size={side}", "preprocess.resize_only_if_bigger=false", "preprocess.shard_size=64"]),
            split="train", progress=False)
    failed, asked = [], steps
    warmup = LEARNING_WARMUP[sizes.device] if warmup is None else warmup
    warmup_setting = [] if warmup is None else [f"optim.warmup_steps={warmup}"]
    for model in sizes.models:
        steps = asked or LEARNING_STEPS[model if sizes.device == "cuda" else "cpu"]
        for objective in ("cloob", "clip"):
            run = scratch / f"learn-{model}-{objective}"
            started = time.perf_counter()
            # a ViT takes its family's preset (open_clip's ViT-B-32 optimiser recipe), RN50 the defaults
            config = load_config(preset="vit-b" if model.startswith("ViT-B") else None, overrides=[
                f"train.shards={shards}", f"model.architecture={model}", f"train.objective={objective}",
                f"train.batch_size={sizes.batch}", f"train.steps={steps}", f"train.checkpoint_every={steps}",
                "train.log_every=10", "train.tensorboard=false",
                f"train.device={'cuda' if sizes.device == 'cuda' else 'auto'}", *warmup_setting])
            metrics = train(config, run, progress=False).metrics
            seconds = time.perf_counter() - started
            retrieval = evaluate(RetrievalTask(), ModelSource(model=str(run / "model"), device=sizes.device),
                                 scratch / f"eval-{model}-{objective}", EvalOptions(progress=False))
            (recall,) = retrieval.metrics.values()  # the one image set: the captioned test split
            r5 = (recall["image_retrieval_recall@5"] + recall["text_retrieval_recall@5"]) / 2
            chance = 5 / recall["images"]
            met = (metrics["collapse_margin"] >= 0.02 and metrics["effective_rank_image"] > 32 and r5 >= 5 * chance)
            crossed = metrics.get("retrieval_from_step", -1)  # -1: an objective without retrieval
            if crossed is None or crossed >= steps:
                failed.append(f"{model} {objective}: no Hopfield retrieval in {steps} steps")
            say(f"   {model:<9} {objective:<5} {steps} steps (warm-up {config.optim.warmup_steps}"
                f"{'' if crossed == -1 else f', retrieval from step {crossed}'}) in {seconds:.0f} s: "
                f"loss {metrics['final_loss']:.4f}, "
                f"collapsed value {metrics['collapsed_loss']:.4f} (margin {metrics['collapse_margin']:+.4f}), "
                f"effective rank {metrics['effective_rank_image']:.1f} / {metrics['effective_rank_text']:.1f}, "
                f"mean cosine {metrics['mean_cosine_image']:.3f} / {metrics['mean_cosine_text']:.3f} (image / text), "
                f"collapse detected at {metrics['collapse_detected_at_step']}; held-out R@5 {100 * r5:.1f}% "
                f"(chance {100 * chance:.1f}%): {'goals met' if met else 'GOALS NOT MET'}")
            if not met and sizes.device == "cuda":  # a CI smoke run of 8 steps on a tiny model learns nothing
                failed.append(f"{model} {objective}")
    if failed:
        raise AssertionError(f"not learning: {', '.join(failed)}")


EVAL_IMAGES = {"cuda": 10_000, "cpu": 200}  # section 9's set: the issue's size on a GPU, a smoke run's on the CPU


@section("9. evaluation against CLIP_benchmark: zero-shot images/s and top-1 on 10,000 photos (ViT-B-32)")
def evaluation_against_clip_benchmark(sizes: Sizes, scratch: Path) -> None:
    import bench_eval_input as bench

    architecture = sizes.models[0]
    learnt = scratch / f"learn-{architecture}-cloob" / "model"
    model = learnt if learnt.exists() else bench.export(scratch, architecture, steps=0)
    count = EVAL_IMAGES[sizes.device]
    data = bench.build_set(scratch, count, per_tar=max(1, count // 32))  # a tar for each of CLIP_benchmark's workers
    seconds, memory, _, top1 = bench.ours(model, data, scratch / "eval-ours", 256, None)
    say(f"   {'cloob eval':<12} {count / seconds:8.0f} images/s ({seconds:.1f} s, peak {memory:.0f} MB), top-1 "
        f"{100 * top1:.2f}% ({'trained' if learnt.exists() else 'initial'} {architecture} weights)")
    gpu = sizes.device == "cuda"
    matched = ["--batch_size", "256", "--num_workers", str(max(1, (os.cpu_count() or 2) - 1))]
    anchors = {"CB defaults": [], "CB matched": matched + ([] if gpu else ["--no_amp"])}
    ratios = []
    for name, options in anchors.items():
        cb_seconds, cb_memory, _, cb_top1 = bench.clip_benchmark(model, architecture, data, scratch / "cb.json",
                                                                 options)
        ratios.append(cb_seconds / seconds)
        say(f"   {name:<12} {count / cb_seconds:8.0f} images/s ({cb_seconds:.1f} s, peak {cb_memory:.0f} MB), top-1 "
            f"{100 * cb_top1:.2f}%: ours {cb_seconds / seconds:.2f}x, top-1 {100 * (top1 - cb_top1):+.2f} pt")
    met = ratios[0] >= 1.0 and count / seconds >= 2000
    say(f"   goals (ours >= 1.0x CLIP_benchmark's defaults and >= 2,000 images/s): {'met' if met else 'NOT MET'}")
    if gpu and not met:
        raise AssertionError("evaluation below its goals")


SCORE_IMAGES = {"cuda": 20_000, "cpu": 96}  # section 10's pool: about 7 s of scoring at the goal; a smoke run's


@section("10. curation: scoring (ViT-B-32, bf16) against cloob eval's embedding on the same shards")
def scoring_against_embedding(sizes: Sizes, scratch: Path) -> None:
    import bench_eval_input
    import bench_score

    from cloob_core.model.source import ModelSource

    architecture = sizes.models[0]
    count = SCORE_IMAGES[sizes.device]
    shards = scratch / "pool"
    write_shards(shards, count, sizes.image_side, per_shard=max(1, count // 32))
    model = bench_eval_input.export(scratch, architecture, steps=0)
    workers = max(1, (os.cpu_count() or 2) - 1)
    rates = bench_score.measure(str(shards), ModelSource(model=str(model), device=sizes.device), scratch, workers,
                                256, repeat=2)
    say(f"   {architecture}, {rates.samples:,} images, {workers} workers, batch 256: cloob eval's embedding "
        f"{rates.embed_rate:,.0f} images/s, cloob data score {rates.score_rate:,.0f} samples/s "
        f"({rates.score_rate / rates.embed_rate:.2f}x; medians of 2)")
    met = rates.score_rate >= 3000
    say(f"   goal (>= 3,000 samples/s scored): {'met' if met else 'NOT MET'}")
    if sizes.device == "cuda" and not met:
        raise AssertionError("scoring below its goal")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every section on the CPU, tiny sizes (CI)")
    parser.add_argument("--out", type=Path, help="also write the result lines to this file")
    parser.add_argument("--sections", default="1,3,4,5,6,8,9,10",
                        help="which sections to run (1 runs 1-2; 7 only when named; default the others)")
    parser.add_argument("--learning-steps", type=int,
                        help="section 8's steps (default on a GPU 2,600 for ViT-B-32 and 800 for RN50; 8 quick)")
    parser.add_argument("--learning-warmup", type=int,
                        help="section 8's warm-up steps (default: the preset's on a GPU, 2 quick): CLOOB's start "
                             "without retrieval lasts at least this, and at most objective.start_limit_factor times it")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sizes = QUICK if args.quick else FULL
    if sizes.device == "cuda" and not torch.cuda.is_available():
        from cloob_core.devices import cuda_problem

        print(f"gpu_check: no usable GPU ({cuda_problem()}); use --quick on the CPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if sizes.device == "cuda" else "CPU (quick mode)"
    say(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), {name}, {os.cpu_count()} cores; "
        f"brought: {os.environ.get('GPU_CHECK_BROUGHT') or 'nothing'}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        chosen = set(args.sections.replace("2", "1").split(","))
        for number, run in (("5", lambda: collectives(sizes)), ("1", lambda: steps_against_open_clip(sizes)),
                            ("3", lambda: stage_against_step(sizes, scratch)),
                            ("4", lambda: losses_against_matmul(sizes)),
                            ("6", lambda: resume_from_eight(sizes, scratch)),
                            ("7", lambda: stage_variants(sizes, scratch)),
                            ("8", lambda: models_learn(sizes, scratch, args.learning_steps, args.learning_warmup)),
                            ("9", lambda: evaluation_against_clip_benchmark(sizes, scratch)),
                            ("10", lambda: scoring_against_embedding(sizes, scratch))):
            if number in chosen:
                run()
    say(f"gpu_check: {'FAILED: ' + ', '.join(FAILED) if FAILED else 'all sections ran'} in "
        f"{time.perf_counter() - started:.0f} s")
    if args.out:
        args.out.write_text("\n".join(RESULTS) + "\n")
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
