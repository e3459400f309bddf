"""`cloob experiment`: the grid's configurations, its reference point and its table from synthetic results (fast),
and the ablation's --quick run end to end on the captioned shards (slow, in CI)."""

from __future__ import annotations

import json
import re

import pytest

from cloob_core.cli import main
from cloob_core.config import ConfigError, load_config
from cloob_core.experiments.grid import cell_config, reference_step, run_cell
from cloob_core.experiments.grid_report import markdown_table, summary
from cloob_core.experiments.grids import GRIDS, grid_named
from cloob_core.io import write_json


def test_the_ablation_grid_is_the_papers_four_objectives_and_nothing_else_differs():
    cells = GRIDS["ablation"].cells
    assert list(cells) == ["clip", "infoloob", "infonce_hopfield", "cloob"]
    # the paper's recipe for each: Hopfield retrieval (where there is one) from the first step
    assert all(overrides == (f"train.objective={name}", "objective.start_without_hopfield=0")
               for name, overrides in cells.items())
    with pytest.raises(ConfigError, match="no grid 'ablations'; there are ablation, objectives, sweep"):
        grid_named("ablations")


def test_every_sweep_cell_is_a_valid_configuration_that_differs_from_its_objectives_centre():
    cells = GRIDS["sweep"].cells
    for name, overrides in cells.items():
        config = load_config(overrides=list(overrides))
        objective = name.split("-")[0]
        assert config.train.objective == objective
        if not name.endswith("-default"):
            centre = load_config(overrides=list(cells[f"{objective}-default"]))
            assert config.model_dump() != centre.model_dump(), name
    # the sweep chose today's default warm-up: its cell is the default recipe, its centre is not
    # (and the paper's start, Hopfield retrieval from the first step, which the default has left since)
    assert load_config(overrides=list(cells["cloob-warmup200"])) == load_config(
        overrides=["objective.start_without_hopfield=0"])
    assert load_config(overrides=list(cells["cloob-default"])) != load_config()


def test_a_cell_checkpoints_about_points_times_and_keeps_every_checkpoint_until_measured(mnist_train_shards):
    base = load_config(overrides=[f"train.shards={mnist_train_shards}", "train.batch_size=64", "train.epochs=2"])
    config = cell_config(base, ("train.objective=clip",), seed=3, points=5)
    steps = 2 * 4000 // 64  # plan_steps: two passes over the 4,000 training pairs
    assert (config.train.objective, config.train.seed) == ("clip", 3)
    checkpoints = -(-steps // config.train.checkpoint_every)
    assert 4 <= checkpoints <= 6 and config.train.keep_checkpoints > checkpoints  # about 5, all kept
    assert config.optim == base.optim and config.model == base.model  # nothing else changes


def test_a_run_folder_holding_other_settings_is_refused_not_reused(mnist_train_shards, tmp_path):
    base = load_config(overrides=[f"train.shards={mnist_train_shards}"])
    done = cell_config(base, GRIDS["ablation"].cells["clip"], seed=0, points=4).model_dump()
    write_json(tmp_path / "clip-s0" / "result.json", {"config": done, "cell": "clip"})
    assert run_cell(base, GRIDS["ablation"], "clip", 0, tmp_path / "clip-s0", None, points=4)["cell"] == "clip"
    # measured at other points, the same training is the same run
    assert run_cell(base, GRIDS["ablation"], "clip", 0, tmp_path / "clip-s0", None, points=8)["cell"] == "clip"
    quick = load_config(overrides=[f"train.shards={mnist_train_shards}", *GRIDS["ablation"].quick])
    with pytest.raises(ConfigError, match="clip-s0 holds a run of other settings"):
        run_cell(quick, GRIDS["ablation"], "clip", 0, tmp_path / "clip-s0", None, points=4)


@pytest.mark.parametrize("steps, restart, expected", [
    ([80, 160, 240, 320], None, 80),   # no restart: the first checkpoint
    ([80, 160, 240, 320], 160, 160),   # the checkpoint at the restart
    ([100, 200, 300], 160, 100),       # the last one before it
    ([200, 320], 160, 200),            # none before it: the first
])
def test_the_reference_point_is_the_checkpoint_before_the_first_restart(steps, restart, expected):
    assert reference_step(steps, restart) == expected


def test_a_cell_checkpoints_exactly_at_the_first_restart_of_the_schedule(mnist_train_shards):
    from cloob_core.training.optim import build_scheduler, first_restart, plan_schedule

    base = load_config(overrides=[f"train.shards={mnist_train_shards}", "train.batch_size=64", "train.epochs=2",
                                  "optim.warmup_steps=10", "optim.lr_cycles=3"])
    config = cell_config(base, (), seed=0, points=8)
    restart = first_restart(config.optim, 125)
    assert restart == 10 + 115 // 3 and restart % config.train.checkpoint_every == 0
    import torch

    scheduler = build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                                plan_schedule(config.optim, 125))
    rates = []
    for step in (restart - 1, restart):
        scheduler.step_update(step)
        rates.append(scheduler.optimizer.param_groups[0]["lr"])
    assert rates[0] < 0.01 and rates[1] == pytest.approx(1.0)  # the end of a cycle, then the peak again


def _result(cell: str, seed: int, acc: float, eigen: int) -> dict:
    def point(step: int, acc: float, eigen: int) -> dict:
        return {"step": step, "set.zeroshot_acc1": acc, "set.effective_eigenvalues_image": eigen,
                "set.effective_eigenvalues_text": 3, "set.spectrum_image": [3.0, 2.0, 1.0],
                "set.spectrum_text": [2.0, 1.0, 1.0], "set.ajne_image": 1.0, "set.ajne_text": 2.0,
                "set.positive_probability_p1": 0.5}

    return {"grid": "ablation", "cell": cell, "seed": seed, "steps": 10, "seconds_per_step": 0.5,
            "reference_step": 5, "trajectory": [point(5, acc / 2, 10), point(10, acc, eigen)]}


def test_the_table_shows_each_cells_final_mean_and_sample_std_over_seeds_and_marks_the_best():
    results = [_result("clip", 0, 0.50, 20), _result("clip", 1, 0.70, 24), _result("cloob", 0, 0.40, 30),
               _result("cloob", 1, 0.40, 30)]
    table = summary(results)
    assert table["clip"]["set.zeroshot_acc1"]["mean"] == pytest.approx(0.6)
    assert table["clip"]["set.zeroshot_acc1"]["std"] == pytest.approx(0.1414, abs=1e-4)  # sample std (n-1)
    assert table["cloob"]["set.effective_eigenvalues_image"] == {"mean": 30, "std": 0, "seeds": [0, 1]}
    lines = markdown_table(results).splitlines()
    assert lines[2].startswith("| clip | 2 | **60.0 ± 14.1** | 22.0 ± 2.8 |")
    assert lines[3].startswith("| cloob | 2 | 40.0 ± 0.0 | 30.0 ± 0.0 |")  # eigenvalues: not a score, no bold


def test_a_run_that_diverged_is_listed_under_the_table_not_averaged_into_it(tmp_path):
    from cloob_core.experiments.grid_report import grid_report

    diverged = {"grid": "sweep", "cell": "clip", "seed": 1, "diverged": "the loss is nan at step 7", "trajectory": []}
    report = grid_report([_result("clip", 0, 0.5, 20), diverged], tmp_path, "test data")
    text = report.table.read_text()
    assert "| clip | 1 | 50.0 ± 0.0 |" in text and "- clip, seed 1: diverged (the loss is nan at step 7)" in text
    assert len(report.figures) == 4 and all(path.read_bytes().startswith(b"\x89PNG") for path in report.figures)


@pytest.mark.slow  # ~1.5 minutes in CI: eight short runs, each measured at four checkpoints; CI runs it (.ci/run)
def test_the_quick_ablation_trains_every_objective_with_two_seeds_and_resumes(tmp_path, capsys,
                                                                             captioned_train_shards):
    args = ["experiment", "ablation", "--quick", "--seeds", "2", "--points", "3", "--output", str(tmp_path / "out"),
            "--set", f"train.shards={captioned_train_shards}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\| (clip|infoloob|infonce_hopfield|cloob) \| 2 \|", line)]
    assert len(rows) == 4
    runs = sorted((tmp_path / "out" / "runs").iterdir())
    assert len(runs) == 8 and not any((run / "train" / "checkpoints").exists() for run in runs)
    results = [json.loads((run / "result.json").read_text()) for run in runs]
    losses = {}
    for result in results:
        steps = [point["step"] for point in result["trajectory"]]
        # 24 steps, 4 of warm-up, two cycles: the restart at 4 + 20 // 2 = 14 is the reference point
        assert result["objective"] == result["cell"] and steps == [7, 14, 21, 24] and result["reference_step"] == 14
        final = result["trajectory"][-1]
        assert len(final["captioned.spectrum_image"]) == 64 and final["captioned.effective_eigenvalues_text"] >= 1
        assert {"tuxpaint.zeroshot_acc1", "emoji.zeroshot_acc1", "mnist.zeroshot_acc1",
                "captioned.image_retrieval_recall@5"} <= set(final)
        losses.setdefault(result["cell"], []).append(result["final_loss"])
    # InfoNCE is a cross-entropy over 64 candidates (near log 64 at the start); tau-scaled InfoLOOB is far smaller
    assert min(losses["clip"]) > 1.0 > max(losses["cloob"])
    figures = {path.name for path in (tmp_path / "out").glob("*.png")}
    assert figures == {"captioned_eigenvalues_relative_change.png", "captioned_spectra.png",
                       "captioned_uniformity_p1.png", "convergence.png"}
    table = (tmp_path / "out" / "table.md").read_text()
    written = {run: (run / "result.json").stat().st_mtime_ns for run in runs}
    assert main(args) == 0  # every run is done: nothing trains again, the same table comes back
    assert {run: (run / "result.json").stat().st_mtime_ns for run in runs} == written
    assert (tmp_path / "out" / "table.md").read_text() == table


def test_the_curation_experiment_swaps_the_captions_of_30_percent_of_the_pool_only():
    """Its halves are disjoint and cover the packaged training pairs; the noisy pool differs from the clean one in
    exactly the swapped pairs' captions (a cycle: no pair keeps its own), and the scorer's half is untouched."""
    from cloob_core.data.sources import packaged_frame
    from cloob_core.experiments.curation_benefit import SOURCE, _halves

    frame, _ = packaged_frame(*SOURCE)
    scorer_half, clean, noisy, swapped = _halves(frame, 0.3, seed=0)
    assert set(scorer_half["url"]).isdisjoint(clean["url"]) and len(scorer_half) + len(clean) == len(frame)
    assert list(clean["url"]) == list(noisy["url"]) and list(clean["key"]) == list(noisy["key"])
    changed = {url for url, a, b in zip(clean["url"], clean["caption"], noisy["caption"], strict=True) if a != b}
    assert changed == swapped and abs(len(swapped) - 0.3 * len(clean)) <= 2  # (pairs that shared a caption)
    assert sorted(noisy["caption"]) == sorted(clean["caption"])  # the same captions, moved
    assert grid_named("curation").prepared and not grid_named("curation").cells  # its cells are built, not listed
