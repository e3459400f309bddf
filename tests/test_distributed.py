"""Two ranks on CPU (gloo) each holding half of a batch must reproduce the single-process loss and parameter
gradients of the whole batch, for every objective: features are gathered with gradient and DDP's averaging
is accounted for (see cloob_core.objectives.distributed)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from cloob_core.config import load_config
from cloob_core.objectives.names import OBJECTIVES, POLY_VIEW_OBJECTIVES
from cloob_core.objectives.registry import build_objective, objective_from_config

WORLD_SIZE = 2
BATCH = 12


def configured(name: str):
    """The objective as a run configures it (beta for the Hopfield ones only)."""
    return objective_from_config(load_config(overrides=[f"train.objective={name}"]))


class TwoTowers(nn.Module):
    """A float64 dual encoder small enough to compare gradients to 1e-9."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.image = nn.Linear(8, 5, dtype=torch.float64)
        self.text = nn.Linear(6, 5, dtype=torch.float64)
        self.log_inv_tau = nn.Parameter(torch.tensor(2.5, dtype=torch.float64))
        with torch.no_grad():
            for p in (*self.image.parameters(), *self.text.parameters()):
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))

    def forward(self, images, texts):
        return F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1), self.log_inv_tau.exp()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH, 8, generator=generator, dtype=torch.float64)
    texts = images[:, :6] + 0.5 * torch.randn(BATCH, 6, generator=generator, dtype=torch.float64)
    return images, texts


def loss_and_grads(model: nn.Module, objective, images, texts):
    model.zero_grad()
    loss = objective(*model(images, texts))
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _rank_main(rank: int, port: int, result_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        images, texts = batch()
        local = slice(rank * BATCH // WORLD_SIZE, (rank + 1) * BATCH // WORLD_SIZE)
        model = nn.parallel.DistributedDataParallel(TwoTowers())
        results = {}
        for name in sorted(OBJECTIVES):
            loss, grads = loss_and_grads(model, configured(name), images[local], texts[local])
            results[name] = {"loss": loss, **{k.removeprefix("module."): v for k, v in grads.items()}}
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_gloo_ranks_match_single_process_gradients(tmp_path):
    result_path = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(_free_port(), str(result_path)), nprocs=WORLD_SIZE, join=True)
    distributed = torch.load(result_path, weights_only=True)

    images, texts = batch()
    model = TwoTowers()
    for name in sorted(OBJECTIVES):
        loss, grads = loss_and_grads(model, configured(name), images, texts)
        for param, grad in grads.items():
            assert grad.abs().max() > 0, f"{name}: {param} has no gradient, the comparison would be vacuous"
        assert_same(distributed[name], loss, grads, name)


def assert_same(got: dict[str, torch.Tensor], loss: torch.Tensor, grads: dict[str, torch.Tensor], name: str) -> None:
    """Rank 0's loss and gradients (after DDP's averaging) equal the single process's."""
    torch.testing.assert_close(got["loss"], loss, rtol=1e-9, atol=0)
    for param, grad in grads.items():
        torch.testing.assert_close(got[param], grad, rtol=1e-9, atol=1e-12, msg=f"{name}: {param}")


def test_gathering_without_gradient_would_be_caught(tmp_path):
    """Guard for the test above: the gradient of only the local rows' share differs from the full one,
    so a no-grad gather (ml-jku/cloob's) cannot pass it."""
    images, texts = batch()
    model = TwoTowers()
    objective = build_objective("cloob", beta=8.0)
    _, full = loss_and_grads(model, objective, images, texts)
    half = BATCH // WORLD_SIZE
    model.zero_grad()
    shares = []
    for rank in range(WORLD_SIZE):
        model.zero_grad()
        x, y, inv_tau = model(images, texts)
        keep = torch.zeros(BATCH, 1, dtype=torch.bool)
        keep[rank * half : (rank + 1) * half] = True
        x = torch.where(keep, x, x.detach())
        y = torch.where(keep, y, y.detach())
        objective(x, y, inv_tau).backward()
        shares.append(model.image.weight.grad.clone())
    no_grad_gather = sum(shares) / WORLD_SIZE
    assert not torch.allclose(no_grad_gather, full["image.weight"], rtol=1e-3)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_single_process_objectives_do_not_gather(name):
    assert not dist.is_initialized()
    x, y = (
        F.normalize(torch.randn(4, 3, dtype=torch.float64), dim=-1),
        F.normalize(torch.randn(4, 3, dtype=torch.float64), dim=-1),
    )
    assert torch.isfinite(configured(name)(x, y, 30.0))


VIEWS = (2, 3)  # image and text views per sample


def view_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Sample-major views: sample i's image views are rows i*2..i*2+1, its text views rows i*3..i*3+2."""
    generator = torch.Generator().manual_seed(2)
    centre = torch.randn(BATCH, 1, 8, generator=generator, dtype=torch.float64)
    images = (centre + 0.5 * torch.randn(BATCH, VIEWS[0], 8, generator=generator, dtype=torch.float64))
    texts = (centre[..., :6] + 0.5 * torch.randn(BATCH, VIEWS[1], 6, generator=generator, dtype=torch.float64))
    return images.reshape(-1, 8), texts.reshape(-1, 6)


def _views_rank_main(rank: int, port: int, result_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        images, texts = view_batch()
        half = BATCH // WORLD_SIZE  # each rank holds whole samples: all views of its half of them
        mine = (images[rank * half * VIEWS[0] : (rank + 1) * half * VIEWS[0]],
                texts[rank * half * VIEWS[1] : (rank + 1) * half * VIEWS[1]])
        model = nn.parallel.DistributedDataParallel(TwoTowers())
        results = {}
        for name in POLY_VIEW_OBJECTIVES:
            objective = build_objective(name, image_views=VIEWS[0], text_views=VIEWS[1])
            loss, grads = loss_and_grads(model, objective, *mine)
            results[name] = {"loss": loss, **{k.removeprefix("module."): v for k, v in grads.items()}}
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()


def test_poly_view_batches_split_by_sample_across_ranks_match_one_process(tmp_path):
    result_path = tmp_path / "rank0.pt"
    mp.spawn(_views_rank_main, args=(_free_port(), str(result_path)), nprocs=WORLD_SIZE, join=True)
    distributed = torch.load(result_path, weights_only=True)
    images, texts = view_batch()
    model = TwoTowers()
    for name in POLY_VIEW_OBJECTIVES:
        objective = build_objective(name, image_views=VIEWS[0], text_views=VIEWS[1])
        loss, grads = loss_and_grads(model, objective, images, texts)
        assert_same(distributed[name], loss, grads, name)


ACCUM = 2  # micro-batches per step
STEPS = 3


def _step_batch(step: int, views: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: BATCH samples, sample-major views (one view each for the two-view objectives)."""
    generator = torch.Generator().manual_seed(100 + step)
    centre = torch.randn(BATCH, 1, 8, generator=generator, dtype=torch.float64)
    images = centre + 0.5 * torch.randn(BATCH, views[0], 8, generator=generator, dtype=torch.float64)
    texts = centre[..., :6] + 0.5 * torch.randn(BATCH, views[1], 6, generator=generator, dtype=torch.float64)
    return images.reshape(-1, 8), texts.reshape(-1, 6)


def _objective_and_views(name: str):
    if name in POLY_VIEW_OBJECTIVES:
        return build_objective(name, image_views=VIEWS[0], text_views=VIEWS[1]), VIEWS
    return configured(name), (1, 1)


def _train_steps(model: nn.Module, name: str, accum_freq: int, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """STEPS optimiser steps of ``training.step`` on this rank's share of each global batch; the parameters after."""
    from cloob_core.training.step import StepParts, accumulate_gradients, optimizer_step

    objective, views = _objective_and_views(name)
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.05, weight_decay=0.1)
    parts = StepParts(model=model, objective=objective, optimizer=optimizer,
                      scaler=torch.amp.GradScaler("cpu", enabled=False), device_type="cpu", accum_freq=accum_freq)
    per_rank = BATCH // world_size
    for step in range(STEPS):
        images, texts = _step_batch(step, views)
        accumulate_gradients(parts, images[rank * per_rank * views[0] : (rank + 1) * per_rank * views[0]],
                             texts[rank * per_rank * views[1] : (rank + 1) * per_rank * views[1]])
        optimizer_step(parts)
        objective.end_step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _accumulating_rank_main(rank: int, port: int, result_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        results = {name: _train_steps(nn.parallel.DistributedDataParallel(TwoTowers()), name, ACCUM, rank, WORLD_SIZE)
                   for name in sorted(OBJECTIVES)}
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()


def test_two_ranks_accumulating_with_a_learnt_temperature_equal_one_process_on_the_global_batch(tmp_path):
    """DDP x accum_freq x a learnable temperature x every objective: 3 steps on 2 gloo ranks with 2 micro-batches
    each give the parameters of one process stepping on the whole batch (the temperature's gradient is taken in
    the pass that synchronises; taken in an earlier one, DDP fails at the second step)."""
    result_path = tmp_path / "rank0.pt"
    mp.spawn(_accumulating_rank_main, args=(_free_port(), str(result_path)), nprocs=WORLD_SIZE, join=True)
    distributed = torch.load(result_path, weights_only=True)
    start = TwoTowers().state_dict()
    for name in sorted(OBJECTIVES):
        single = _train_steps(TwoTowers(), name, 1, 0, 1)
        assert not torch.equal(single["log_inv_tau"], start["log_inv_tau"]), f"{name}: the temperature did not learn"
        for key, value in single.items():
            torch.testing.assert_close(distributed[name][key], value, rtol=1e-9, atol=1e-12, msg=f"{name}: {key}")


def _local_loss_rank_main(rank: int, port: int, result_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        model = nn.parallel.DistributedDataParallel(TwoTowers())
        results = {}
        for name in sorted(OBJECTIVES):
            objective, views = _objective_and_views(name)
            objective.local_loss = True
            images, texts = _step_batch(0, views)
            per_rank = BATCH // WORLD_SIZE
            mine = (images[rank * per_rank * views[0] : (rank + 1) * per_rank * views[0]],
                    texts[rank * per_rank * views[1] : (rank + 1) * per_rank * views[1]])
            own, grads = loss_and_grads(model, objective, *mine)
            losses = [torch.zeros((), dtype=torch.float64) for _ in range(WORLD_SIZE)]
            dist.all_gather(losses, own)
            results[name] = {"loss": torch.stack(losses).mean(), "own": own,
                             **{k.removeprefix("module."): v for k, v in grads.items()}}
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()


def test_local_loss_on_two_ranks_gives_the_global_batch_gradient_for_every_objective(tmp_path):
    """train.local_loss: each rank's terms of its own rows against the gathered batch (CLOOB: its own queries'
    retrievals, gathered), averaged by DDP, are the single process's gradient over the global batch, ≤ 1e-12
    relative in float64; the ranks' local losses average to the global loss."""
    result_path = tmp_path / "rank0.pt"
    mp.spawn(_local_loss_rank_main, args=(_free_port(), str(result_path)), nprocs=WORLD_SIZE, join=True)
    distributed = torch.load(result_path, weights_only=True)
    model = TwoTowers()
    for name in sorted(OBJECTIVES):
        objective, views = _objective_and_views(name)
        loss, grads = loss_and_grads(model, objective, *_step_batch(0, views))
        torch.testing.assert_close(distributed[name]["loss"], loss, rtol=1e-12, atol=0, msg=name)
        assert not torch.allclose(distributed[name]["own"], loss), f"{name}: rank 0 computed the global loss"
        for param, grad in grads.items():
            assert grad.abs().max() > 0, f"{name}: {param} has no gradient, the comparison would be vacuous"
            torch.testing.assert_close(distributed[name][param], grad, rtol=1e-12, atol=1e-15, msg=f"{name}: {param}")


def test_local_anchors_change_the_loss_terms_a_rank_computes():
    """Guard for the test above: one rank's local terms are not the global loss (else local mode did nothing)."""
    from cloob_core.objectives.anchors import Anchors

    images, texts = batch()
    model = TwoTowers()
    x, y, inv_tau = model(images, texts)
    for name in ("clip", "infoloob", "clip_ring"):  # (CLOOB's anchored retrievals need a gather to be global)
        objective = configured(name)
        whole = objective.compute(x, y, inv_tau)
        first = objective.compute(x, y, inv_tau, Anchors(0, BATCH // 2))
        second = objective.compute(x, y, inv_tau, Anchors(BATCH // 2, BATCH))
        assert not torch.allclose(first, whole)
        torch.testing.assert_close((first + second) / 2, whole, rtol=1e-12, atol=0)


def _compressed_rank_main(rank: int, port: int, result_path: str) -> None:
    from cloob_core.training.env import DistEnv, across_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        results = {}
        for compression in ("none", "bf16"):
            model = across_ranks(TwoTowers().float(), DistEnv(rank, WORLD_SIZE), torch.device("cpu"),
                                 grad_compression=compression)
            images, texts = (t.float() for t in batch())
            half = slice(rank * BATCH // WORLD_SIZE, (rank + 1) * BATCH // WORLD_SIZE)
            _, grads = loss_and_grads(model, configured("cloob"), images[half], texts[half])
            results[compression] = {k.removeprefix("module."): v for k, v in grads.items()}
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()


def test_bf16_gradient_compression_averages_the_gradients_in_bfloat16(tmp_path):
    """train.grad_compression bf16: DDP's all-reduce carries bfloat16, so the averaged gradient is the exact one
    up to bf16's rounding (8 bits of mantissa), and differs from it."""
    result_path = tmp_path / "rank0.pt"
    mp.spawn(_compressed_rank_main, args=(_free_port(), str(result_path)), nprocs=WORLD_SIZE, join=True)
    results = torch.load(result_path, weights_only=True)
    differs = False
    for name, exact in results["none"].items():
        compressed = results["bf16"][name]
        # each rank's gradient rounded to bf16, summed in bf16: errors of 2^-8 of the summands' size
        torch.testing.assert_close(compressed, exact, rtol=0, atol=2 ** -7 * float(exact.abs().max()), msg=name)
        differs |= not torch.equal(compressed, exact)
    assert differs, "the compressed gradients equal the exact ones: no compression ran"


START = {"start_without_hopfield": 1, "start_until_margin": 0.01, "start_longest": 50}


def paired_features() -> tuple[torch.Tensor, torch.Tensor]:
    """Unit embeddings whose pairs match (a batch well below the collapsed value): the start's switching path."""
    generator = torch.Generator().manual_seed(2)
    x = F.normalize(torch.randn(BATCH, 5, generator=generator, dtype=torch.float64), dim=-1)
    return x, F.normalize(x + 0.3 * torch.randn(BATCH, 5, generator=generator, dtype=torch.float64), dim=-1)


def _start_rank_main(rank: int, port: int, result_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        x, y = paired_features()
        per_rank = BATCH // WORLD_SIZE
        mine = (x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
        results = {}
        for name in ("cloob", "cloob_ring", "infonce_hopfield"):
            objective = build_objective(name, local_loss=True, **START)
            for _ in range(3):
                objective(*mine, 30.0)
                objective.end_step()
            start = objective.retrieval_start
            since = -1 if start.retrieving_from is None else start.retrieving_from
            every = [torch.zeros(2, dtype=torch.float64) for _ in range(WORLD_SIZE)]
            dist.all_gather(every, torch.tensor([start.last_margin, since], dtype=torch.float64))
            results[name] = torch.stack(every)
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()


def test_under_local_loss_every_rank_ends_the_start_at_the_single_processs_step(tmp_path):
    """The start's margin is the global batch's (each rank's local loss averaged over the ranks), so every rank, and
    a single process on the whole batch, reads the same margin and starts retrieving at the same step."""
    result_path = tmp_path / "rank0.pt"
    mp.spawn(_start_rank_main, args=(_free_port(), str(result_path)), nprocs=WORLD_SIZE, join=True)
    distributed = torch.load(result_path, weights_only=True)
    for name, ranks in distributed.items():
        objective = build_objective(name, **START)
        for _ in range(3):
            objective(*paired_features(), 30.0)
            objective.end_step()
        start = objective.retrieval_start
        assert start.retrieving_from == 2, name  # the margin is there: the test takes the switching path
        expected = torch.tensor([start.last_margin, start.retrieving_from], dtype=torch.float64)
        for rank in ranks:
            torch.testing.assert_close(rank, expected, rtol=1e-9, atol=1e-12, msg=name)
