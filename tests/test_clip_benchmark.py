"""CLIP_benchmark's own code scores a `cloob train` export on wds sets that `cloob data eval-set` wrote, and
agrees with `cloob eval`: zero-shot classification through the `cloob-clip-benchmark` entry point (its CLI with
`--model_type cloob` registered), image-text retrieval through its stock CLI and open_clip's `local-dir:` loader.

CLIP_benchmark 1.6.2 runs from the overlay scripts/clip_benchmark_env.sh creates (its own numpy 2.3; see there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cloob_core.cli import main
from cloob_core.config import load_config
from cloob_core.training.loop import train

pytestmark = pytest.mark.slow  # ~1 minute: a short training run and two evaluations; CI runs it (.ci/run)
ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / ".venv-clip-benchmark"


@pytest.fixture(scope="module")
def export(tmp_path_factory, mnist_train_shards) -> Path:
    run = tmp_path_factory.mktemp("cb") / "run"
    train(load_config(overrides=[f"train.shards={mnist_train_shards}", "train.steps=60", "train.batch_size=64",
                                 "train.tensorboard=false", "train.workers=0"]), run, progress=False)
    return run / "model"


def clip_benchmark(*argv: str, module: str = "cloob_core.evaluation.clip_benchmark_loader"
                   ) -> subprocess.CompletedProcess:
    subprocess.run([str(ROOT / "scripts" / "clip_benchmark_env.sh")], check=True, timeout=600)
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(OVERLAY)})


def retrieval_both_ways(export: Path, source: str, tmp_path: Path) -> tuple[dict, dict]:
    """A retrieval set from ``source``, scored by stock CLIP_benchmark (open_clip's local-dir: loader, no
    registration) and by `cloob eval retrieval`: (theirs, ours)."""
    bench = tmp_path / source
    assert main(["data", "eval-set", "--source", source, "--type", "retrieval", "--output", str(bench)]) == 0
    done = clip_benchmark("eval", "--model_type", "open_clip", "--model", f"local-dir:{export}", "--dataset",
                          f"wds/{source}", "--dataset_root", str(bench), "--task", "zeroshot_retrieval",
                          "--recall_k", "1", "5", "10", "--no_amp", "--num_workers", "1", "--batch_size", "128",
                          "--output", str(tmp_path / "theirs.json"), module="clip_benchmark.cli")
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["eval", "retrieval", "--model", str(export), "--data", str(bench), "--output", str(tmp_path / "ours"),
                 "--no-cache", "--no-progress"]) == 0
    ours = json.loads((tmp_path / "ours" / f"{source}-test_zeroshot_retrieval.json").read_text())["metrics"]
    return json.loads((tmp_path / "theirs.json").read_text())["metrics"], ours


def test_clip_benchmark_scores_our_export_on_our_wds_set_as_cloob_eval_does(capsys, export, tmp_path):
    bench = tmp_path / "mnist"
    assert main(["data", "eval-set", "--source", "mnist", "--output", str(bench)]) == 0
    done = clip_benchmark("eval", "--model_type", "cloob", "--model", "cloob-tiny", "--pretrained", str(export),
                          "--dataset", "wds/mnist", "--dataset_root", str(bench), "--task", "zeroshot_classification",
                          "--no_amp", "--num_workers", "1", "--batch_size", "250", "--output",
                          str(tmp_path / "theirs.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads((tmp_path / "theirs.json").read_text())["metrics"]
    assert main(["eval", "zeroshot", "--model", str(export), "--data", str(bench), "--output", str(tmp_path / "ours"),
                 "--no-cache", "--no-progress"]) == 0
    ours = json.loads((tmp_path / "ours" / "mnist-test_zeroshot_classification.json").read_text())["metrics"]
    assert theirs["acc1"] == pytest.approx(ours["acc1"], abs=1e-6)  # 1000 images: one is 1e-3
    assert theirs["acc5"] == pytest.approx(ours["acc5"], abs=1e-6)
    assert theirs["mean_per_class_recall"] == pytest.approx(ours["mean_per_class_recall"], abs=1e-6)
    assert 0.1 < ours["acc1"] < 1.0  # a trained model, not a tie at chance


def test_the_registration_is_what_makes_the_model_type_valid(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import clip_benchmark.cli as c; import sys; "
                           "sys.argv = ['clip_benchmark', 'eval', '--model_type', 'cloob']; c.main()"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(OVERLAY)})
    assert done.returncode != 0 and "invalid choice: 'cloob'" in done.stderr  # without our entry point


def test_clip_benchmark_retrieval_on_our_retrieval_set_agrees_with_cloob_eval(capsys, export, tmp_path):
    """fluent-emoji's 371 test captions are all different, so both count the same queries and candidates."""
    theirs, ours = retrieval_both_ways(export, "fluent-emoji", tmp_path)
    assert ours["images"] == ours["captions"] == 371
    for k in (1, 5, 10):
        for direction in ("image_retrieval", "text_retrieval"):
            assert theirs[f"{direction}_recall@{k}"] == pytest.approx(ours[f"{direction}_recall@{k}"], abs=1e-6)
    assert 1 / 371 < ours["image_retrieval_recall@10"] < 1.0  # better than chance, not a tie at the top


def test_clip_benchmark_counts_a_repeated_caption_once_per_row(capsys, export, tmp_path):
    """MNIST's 1,000 test images carry 100 different captions. CLIP_benchmark makes a query of every row, with
    only its own image correct; `cloob eval` makes one query of each distinct caption, with every image that
    carries it correct. Copies of a caption embed identically, so they retrieve the same top image: in a group,
    one row hits exactly when the merged query does. Hence theirs x rows = ours x distinct captions at R@1."""
    theirs, ours = retrieval_both_ways(export, "mnist", tmp_path)
    assert ours["images"] == 1000 and ours["captions"] == 100
    assert theirs["image_retrieval_recall@1"] * 1000 == pytest.approx(ours["image_retrieval_recall@1"] * 100,
                                                                      abs=1e-3)
    assert ours["image_retrieval_recall@1"] > 0  # so the relation is not 0 = 0: the figures differ tenfold
