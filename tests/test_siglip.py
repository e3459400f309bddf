"""SigLIP's sigmoid loss (Zhai et al. 2023, Eq. 1), checked against a float64 reference written from the paper's
formula: value and gradients (images, texts, temperature, bias) to 1e-12 relative; anchored on a rank's rows it is
that rank's share of the pairs; on 2 gloo ranks, with and without train.local_loss, the model's and the bias's
gradients equal one process on the global batch; it trains in a grid cell beside CLOOB, InfoLOOB and CLIP."""

from __future__ import annotations

import json
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from cloob_core.cli import main
from cloob_core.objectives.anchors import Anchors
from cloob_core.objectives.losses import SigLipLoss, siglip_loss
from cloob_core.objectives.registry import build_objective
from cloob_core.training.step import average_objective_gradients


def _features(n: int = 7, d: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(n, d, generator=generator, dtype=torch.float64), dim=1)
    y = F.normalize(x + 0.7 * torch.randn(n, d, generator=generator, dtype=torch.float64), dim=1)
    return x, y


def _reference(x: list[list[float]], y: list[list[float]], t: float, b: float):
    """The paper's loss and its gradients, by hand: -1/|B| sum_ij log sigmoid(z_ij (t x_i.y_j + b))."""
    n = len(x)
    loss, gx, gy = 0.0, [[0.0] * len(x[0]) for _ in x], [[0.0] * len(y[0]) for _ in y]
    gt = gb = 0.0
    for i in range(n):
        for j in range(n):
            z = 1.0 if i == j else -1.0
            dot = sum(a * c for a, c in zip(x[i], y[j], strict=True))
            logit = t * dot + b
            loss += math.log1p(math.exp(-z * logit)) / n  # -log sigmoid(z l)
            slope = -z / (1.0 + math.exp(z * logit)) / n  # d/dl of -log sigmoid(z l), over n
            gb += slope
            gt += slope * dot
            for k in range(len(x[0])):
                gx[i][k] += slope * t * y[j][k]
                gy[j][k] += slope * t * x[i][k]
    return loss, gx, gy, gt, gb


@pytest.mark.parametrize(("t", "b"), [(10.0, -10.0), (1.0, 0.0), (37.0, -3.5)])
def test_the_loss_and_its_gradients_equal_the_papers_formula(t, b):
    x, y = _features()
    x.requires_grad_(True)
    y.requires_grad_(True)
    inv_tau = torch.tensor(t, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    loss = siglip_loss(x, y, inv_tau, bias)
    loss.backward()
    expected, gx, gy, gt, gb = _reference(x.tolist(), y.tolist(), t, b)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(x.grad, torch.tensor(gx, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(y.grad, torch.tensor(gy, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert inv_tau.grad.item() == pytest.approx(gt, rel=1e-12)
    assert bias.grad.item() == pytest.approx(gb, rel=1e-12)


def test_a_ranks_rows_are_its_share_of_the_pairs():
    x, y = _features(n=8)
    whole = siglip_loss(x, y, 10.0, -10.0)
    halves = [siglip_loss(x, y, 10.0, -10.0, Anchors(start, start + 4)) for start in (0, 4)]
    assert torch.stack(halves).mean().item() == pytest.approx(whole.item(), rel=1e-14)


def test_the_objective_keeps_its_bias_in_checkpoints():
    objective = build_objective("siglip", bias_init=-7.0)
    assert isinstance(objective, SigLipLoss) and objective.logit_bias.item() == -7.0
    with torch.no_grad():
        objective.logit_bias.fill_(-6.5)
    restored = build_objective("siglip", bias_init=-10.0)
    restored.load_checkpoint_state(objective.checkpoint_state())
    assert restored.logit_bias.item() == -6.5


WORLD, BATCH = 2, 8


def _rank_main(rank: int, port: int, local_loss: bool, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        grads = _one_step(rank, WORLD, local_loss)
        if rank == 0:
            queue.put({key: value.tolist() for key, value in grads.items()})
    finally:
        dist.destroy_process_group()


class _Towers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = torch.nn.Linear(6, 4, dtype=torch.float64), torch.nn.Linear(6, 4, dtype=torch.float64)

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.image(images), dim=1), F.normalize(self.text(texts), dim=1)


def _one_step(rank: int, world: int, local_loss: bool) -> dict:
    """A float64 linear dual encoder under DDP (when distributed) and the siglip objective: one backward."""
    torch.manual_seed(0)
    towers = _Towers()
    model = torch.nn.parallel.DistributedDataParallel(towers) if world > 1 else towers
    objective = build_objective("siglip", local_loss=local_loss, bias_init=-2.0).double()
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH, 6, generator=generator, dtype=torch.float64)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    objective(*model(inputs[mine], inputs[mine] + 0.3), 5.0).backward()
    average_objective_gradients(objective)  # what optimizer_step does first: over the ranks, as DDP does the model's
    return {"image": towers.image.weight.grad.clone(), "text": towers.text.weight.grad.clone(),
            "bias": objective.logit_bias.grad.clone()}


@pytest.mark.parametrize("local_loss", [False, True])
def test_two_gloo_ranks_equal_one_process_on_the_global_batch(local_loss):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(port, local_loss, queue), nprocs=WORLD, join=True)
    distributed = queue.get()
    single = _one_step(0, 1, local_loss=False)
    for key in ("image", "text", "bias"):
        torch.testing.assert_close(torch.tensor(distributed[key], dtype=torch.float64), single[key], rtol=1e-12,
                                   atol=1e-15, msg=key)


@pytest.mark.slow  # ~55-85 s, in the slow phase for the default one's budget (docs/development.md)
def test_siglip_trains_in_a_grid_cell_beside_the_others(tmp_path, capsys, captioned_train_shards):
    assert main(["experiment", "objectives", "--quick", "--seeds", "1", "--points", "2", "--output",
                 str(tmp_path / "out"), "--set", f"train.shards={captioned_train_shards}"]) == 0
    results = {json.loads(path.read_text())["cell"]: json.loads(path.read_text())
               for path in (tmp_path / "out" / "runs").glob("*/result.json")}
    assert set(results) == {"cloob", "infoloob", "clip", "siglip"}
    assert math.isfinite(results["siglip"]["final_loss"])
    assert "captioned.image_retrieval_recall@5" in results["siglip"]["trajectory"][-1]
