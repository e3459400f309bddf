"""The collapse detector: each objective's collapsed value, the embeddings' effective rank and mean cosine, and the
rule that calls a run collapsed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cloob_core.objectives.losses import siglip_loss
from cloob_core.objectives.names import OBJECTIVE_NAMES, POLY_VIEW_OBJECTIVES
from cloob_core.objectives.registry import build_objective
from cloob_core.training.collapse import (
    HISTORY_COLUMNS,
    CollapseRule,
    Health,
    effective_rank,
    embedding_health,
    health_history,
    history_row,
    mean_cosine,
)


def identical_rows(rows: int, d: int = 8, seed: int = 0) -> torch.Tensor:
    """``rows`` copies of one random unit vector: a completely collapsed batch."""
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(1, d, generator=g, dtype=torch.float64), dim=-1).expand(rows, d).clone()


@pytest.mark.parametrize("name", [n for n in OBJECTIVE_NAMES if n != "siglip"])
@pytest.mark.parametrize(("batch", "inv_tau"), [(2, 1.0), (7, 30.0), (64, 14.3)])
def test_the_collapsed_value_is_the_objective_on_a_batch_of_identical_embeddings(name, batch, inv_tau):
    """What the detector compares with is what the objective computes when every embedding is the same, a random
    direction (not the all-ones vector the default evaluates): the closed forms of CLIP, InfoLOOB, CLOOB and the
    restricted objectives, and the evaluated value of the poly-view ones."""
    views = {"image_views": 2, "text_views": 3} if name in POLY_VIEW_OBJECTIVES else {}
    objective = build_objective(name, **views)
    image = identical_rows(batch * views.get("image_views", 1))
    text = identical_rows(batch * views.get("text_views", 1))
    expected = float(objective(image, text, inv_tau))
    assert objective.collapsed_loss(batch, inv_tau) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_the_closed_forms():
    assert build_objective("clip").collapsed_loss(256, 30.0) == pytest.approx(math.log(256))
    # the GPU run: 0.3694 at N = 256, inv_tau 30
    assert build_objective("cloob").collapsed_loss(256, 30.0) == pytest.approx(2 * math.log(255) / 30)
    assert round(build_objective("cloob").collapsed_loss(256, 30.0), 4) == 0.3694
    assert build_objective("infoloob").collapsed_loss(64, 30.0) == pytest.approx(0.27621, abs=1e-5)


def test_a_restricted_objective_counts_its_band_and_queue():
    """At collapse only the band's K kept negatives of the batch and the queue enter a denominator."""
    objective = build_objective("infoloob_ring", p_out=0.25, queue_size=16)
    batch = 9
    x = identical_rows(batch)
    for _ in range(2):  # fill the queue with the same collapsed embeddings
        objective(x, x, 30.0)
        objective.end_step()
    assert len(objective.queue) == 16
    assert objective.collapsed_loss(batch, 30.0) == pytest.approx(float(objective(x, x, 30.0)), rel=1e-12)
    clip_ring = build_objective("clip_ring", p_in=0.1, p_out=0.5, anneal_steps=10)
    assert clip_ring.collapsed_loss(batch, 30.0) == pytest.approx(float(clip_ring(x, x, 30.0)), rel=1e-12)


@pytest.mark.parametrize("batch", [2, 16, 256])
def test_siglips_collapsed_value_is_the_least_loss_of_identical_logits(batch):
    """SigLIP learns its bias, so a collapsed model settles at the best constant logit: p = 1/N. Any other bias on
    identical embeddings scores worse; the detector's value is that least one."""
    objective = build_objective("siglip")
    x = identical_rows(batch)
    inv_tau = 10.0
    best_bias = math.log(1 / (batch - 1)) - inv_tau  # logit(1/N) - inv_tau * cos, cos = 1
    at_best = float(siglip_loss(x, x, inv_tau, best_bias))
    assert objective.collapsed_loss(batch, inv_tau) == pytest.approx(at_best, rel=1e-12)
    for other in {best_bias - 1, best_bias + 1, -10.0} - {best_bias}:
        assert float(siglip_loss(x, x, inv_tau, other)) > at_best


def test_effective_rank_counts_equally_used_directions_and_ignores_the_common_one():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 32, generator=g, dtype=torch.float64))[0]
    for k in (1, 3, 8):
        # 4k rows spread with equal weight over k orthogonal directions, centred, plus a large common offset
        rows = torch.stack([basis[i % k] * (-1) ** (i // k) for i in range(4 * k)]) + 10 * basis[-1]
        assert float(effective_rank(rows)) == pytest.approx(k, rel=1e-6)
    assert float(effective_rank(torch.randn(4096, 8, generator=g))) > 7.5  # isotropic: nearly the full width


def test_mean_cosine_is_the_mean_over_distinct_pairs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 16, generator=g, dtype=torch.float64) * torch.rand(50, 1, generator=g, dtype=torch.float64)
    unit = F.normalize(x, dim=-1)
    cosines = unit @ unit.T
    brute = (cosines.sum() - cosines.diagonal().sum()) / (50 * 49)
    assert float(mean_cosine(x)) == pytest.approx(float(brute), rel=1e-10)
    assert float(mean_cosine(identical_rows(10))) == pytest.approx(1.0)
    measured = embedding_health(x, identical_rows(50, 16))
    assert measured.tolist()[2:] == pytest.approx([float(brute), 1.0])


def test_a_diverged_batch_measures_nan_and_raises_nothing():
    rows = torch.randn(16, 8)
    rows[3, 2] = float("nan")
    rank, _, cosine, _ = embedding_health(rows, torch.randn(16, 8)).tolist()
    assert math.isnan(rank) and math.isnan(cosine)
    assert not Health(0.2762, float("nan"), rank, 5.0, cosine, 0.5).flat(max_rank=15)


def health(margin: float, cosine: float = 0.999, rank: float = 30.0, collapsed: float = 0.2762) -> Health:
    return Health(collapsed, margin, rank, rank, cosine, cosine)


def test_a_window_is_flat_at_the_collapsed_value_with_one_vector_or_few_directions():
    assert health(0.0).flat(max_rank=63)  # nearly one vector
    assert health(-0.0002).flat(max_rank=63)  # just above it (the GPU run: 0.3695 against 0.3694)
    assert health(0.0, cosine=0.5, rank=3.0).flat(max_rank=63)  # a few directions
    fresh = Health(0.2762, 0.0002, 22.8, 42.9, 0.967, 0.66)  # an initialised ViT: at the value, in a wide cone
    assert not fresh.flat(max_rank=63)
    one_memory = Health(0.2762, 0.00002, 10.0, 34.8, 0.92, 0.996)  # CLOOB at its value with one tower collapsed
    assert one_memory.flat(max_rank=63)
    assert not health(0.0017).flat(max_rank=63)  # 0.6% below the collapsed value: learning
    assert not health(-0.05).flat(max_rank=63)  # far above it: not sitting at it


def test_the_rule_speaks_once_after_k_flat_windows_in_a_row():
    rule = CollapseRule(windows=3, batch=64, width=64)
    history: list[tuple[int, Health | None]] = []
    said = []
    margins = [0.0, 0.0, 0.02, 0.0, 0.0, 0.0, 0.0, 0.0, 0.02, 0.0, 0.0, 0.0]
    for window, margin in enumerate(margins):
        history.append(((window + 1) * 10, health(margin)))
        line = rule.verdict(history)
        if line:
            said.append((history[-1][0], line))
    assert [step for step, _ in said] == [60, 120]  # windows 4-6, then 10-12: once per flat stretch
    assert "steps 40-60" in said[0][1] and "collapsed value 0.2762" in said[0][1]
    assert rule.first_collapse(history) == 60
    assert CollapseRule(windows=0, batch=64, width=64).first_collapse(history) is None


def test_the_history_keeps_what_the_rule_reads_and_old_rows_are_unmeasured():
    row = history_row(10, 0.27, 1e-3, health(0.0062))
    assert len(row) == len(HISTORY_COLUMNS)
    (step, read), (old_step, old) = health_history([row, (20, 0.26, 1e-3)])
    assert (step, read) == (10, health(0.0062)) and (old_step, old) == (20, None)


@pytest.mark.parametrize(("name", "plain"), [("cloob", "infoloob"), ("infonce_hopfield", "clip"),
                                             ("cloob_ring", "infoloob_ring")])
def test_the_start_without_hopfield_is_the_plain_objective_then_retrieval_and_resumes_where_it_was(name, plain):
    """``objective.start_without_hopfield``: the first steps compute the objective on the embeddings themselves; the
    step count is checkpointed, so an objective restored mid-way switches at the same step."""
    g = torch.Generator().manual_seed(3)
    x, y = (F.normalize(torch.randn(12, 8, generator=g, dtype=torch.float64), dim=-1) for _ in range(2))
    started = build_objective(name, start_without_hopfield=2)
    without, with_retrieval = build_objective(plain), build_objective(name)
    values = []
    for _ in range(4):
        values.append(float(started(x, y, 30.0)))
        started.end_step()
    expected = [float(without(x, y, 30.0))] * 2 + [float(with_retrieval(x, y, 30.0))] * 2
    assert values == pytest.approx(expected, rel=1e-12) and values[0] != pytest.approx(values[2])
    restored = build_objective(name, start_without_hopfield=2)
    halfway = build_objective(name, start_without_hopfield=2)
    halfway.end_step()
    restored.load_checkpoint_state(halfway.checkpoint_state())
    assert float(restored(x, y, 30.0)) == pytest.approx(expected[1], rel=1e-12)
    restored.end_step()
    assert float(restored(x, y, 30.0)) == pytest.approx(expected[2], rel=1e-12)
    with pytest.raises(ValueError, match="start_without_hopfield"):
        build_objective(name, start_without_hopfield=-1)


def test_warmup_means_the_schedules_warmup_as_the_run_has_it():
    from cloob_core.config import load_config
    from cloob_core.objectives.registry import objective_from_config

    config = load_config()
    start = objective_from_config(config).retrieval_start
    assert (start.least, start.most, start.until_margin) == (config.optim.warmup_steps, 600, 0.05)
    assert objective_from_config(config, warmup_steps=30).retrieval_start.least == 30  # a warm-up cut to half a run
    fixed = load_config(overrides=["objective.start_without_hopfield=7", "objective.start_until_margin=0.2",
                                   "objective.start_limit_factor=1.5"])
    start = objective_from_config(fixed, warmup_steps=30).retrieval_start
    assert (start.least, start.most, start.until_margin) == (7, 11, 0.2)
    assert not hasattr(objective_from_config(load_config(overrides=["train.objective=clip"])), "retrieval_start")


@pytest.mark.parametrize(("name", "plain"), [("cloob", "infoloob"), ("infonce_hopfield", "clip"),
                                             ("cloob_ring", "infoloob_ring")])
def test_the_start_ends_once_a_batch_leaves_the_collapsed_value_or_at_its_longest(name, plain):
    """``objective.start_until_margin``: after its least steps, the start ends two steps after the first batch whose
    loss without retrieval is that fraction of the collapsed value below it (its margin is read at the end of the
    next step, so the step has no host read); batches that stay near the collapsed value keep it to its longest;
    the margin pending at a checkpoint switches a resumed run where the uninterrupted one switched."""
    g = torch.Generator().manual_seed(5)
    x = F.normalize(torch.randn(16, 8, generator=g, dtype=torch.float64), dim=-1)
    paired = F.normalize(x + 0.05 * torch.randn(16, 8, generator=g, dtype=torch.float64), dim=-1)
    cone = F.normalize(torch.ones(16, 8, dtype=torch.float64) + 0.01 * torch.randn(16, 8, generator=g,
                                                                                     dtype=torch.float64), dim=-1)
    unpaired = cone[torch.randperm(16, generator=g)]
    without, with_retrieval = build_objective(plain), build_objective(name)

    def run(objective, a, b, steps):
        values = []
        for _ in range(steps):
            values.append(float(objective(a, b, 30.0)))
            objective.end_step()
        return values

    def started(least=1, longest=50):
        return build_objective(name, start_without_hopfield=least, start_until_margin=0.05, start_longest=longest)

    learnt = started()
    assert float(without(x, paired, 30.0)) < 0.95 * learnt.collapsed_loss(16, 30.0)  # the batch shows the margin
    assert run(learnt, x, paired, 4) == pytest.approx([float(without(x, paired, 30.0))] * 2
                                                      + [float(with_retrieval(x, paired, 30.0))] * 2, rel=1e-12)
    assert learnt.retrieval_start.retrieving_from == 2
    late = started(least=3)
    run(late, x, paired, 3)
    assert late.retrieval_start.retrieving_from == 3  # never before its least steps, however learnt the batch
    in_the_cone = started(longest=3)
    assert float(without(cone, unpaired, 30.0)) > 0.95 * in_the_cone.collapsed_loss(16, 30.0)
    run(in_the_cone, cone, unpaired, 2)
    assert not in_the_cone.retrieval_start.retrieving  # past its least, still near the collapsed value
    run(in_the_cone, cone, unpaired, 1)
    assert in_the_cone.retrieval_start.retrieving_from == 3  # its longest
    stopped = started()
    run(stopped, x, paired, 1)
    resumed = started()
    resumed.load_checkpoint_state(stopped.checkpoint_state())
    run(resumed, x, paired, 1)
    assert resumed.retrieval_start.retrieving_from == 2
    with pytest.raises(ValueError, match="start_until_margin"):
        build_objective(name, start_until_margin=1.0)
    with pytest.raises(ValueError, match="longest"):
        build_objective(name, start_without_hopfield=4, start_longest=3)


def test_a_checkpoint_from_before_the_start_resumes_with_the_papers_start(tmp_path):
    """A run checkpointed before ``objective.start_without_hopfield`` existed used retrieval from the first step: read
    back, its configuration says so, and it is not refused as another run (nor switched to the new default)."""
    from cloob_core.model.checkpoint_file import CHECKSUM_SUFFIX, load, sha256_hex

    path = tmp_path / "step-00000004.pt"
    torch.save({"step": 4, "config": {"objective": {"beta": 8.0}, "train": {"objective": "cloob"}}}, path)
    (tmp_path / (path.name + CHECKSUM_SUFFIX)).write_text(sha256_hex(path.read_bytes()))
    assert load(str(path))["config"]["objective"] == {"beta": 8.0, "start_without_hopfield": 0,
                                                      "start_until_margin": 0.0, "start_limit_factor": 3.0}


def test_a_checkpoint_from_before_the_margin_resumes_switching_at_its_bound(tmp_path):
    """A run checkpointed before ``objective.start_until_margin`` switched at its step count: read back, its
    configuration has no margin, and its objective's state (the step alone) switches at the bound."""
    from cloob_core.model.checkpoint_file import CHECKSUM_SUFFIX, load, sha256_hex

    path = tmp_path / "step-00000004.pt"
    torch.save({"step": 4, "config": {"objective": {"beta": 8.0, "start_without_hopfield": "warmup"}}}, path)
    (tmp_path / (path.name + CHECKSUM_SUFFIX)).write_text(sha256_hex(path.read_bytes()))
    assert load(str(path))["config"]["objective"]["start_until_margin"] == 0.0
    before, after = (build_objective("cloob", start_without_hopfield=10, start_until_margin=0.05, start_longest=30)
                     for _ in range(2))
    before.load_checkpoint_state({"step": 7})
    after.load_checkpoint_state({"step": 12})
    assert (before.retrieval_start.retrieving_from, after.retrieval_start.retrieving_from) == (None, 10)
