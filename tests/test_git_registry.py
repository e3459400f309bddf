"""DVC's model-registry conventions: the trained model is a `model` artifact of dvc.yaml, and a promotion is also a
GTO stage assignment on the commit whose dvc.lock holds the promoted weights; real DVC and GTO, in a temporary git
repository."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from reports import report_of

BIN = Path(sys.executable).parent
GATE = ["--store", "store", "--metric", "mnist_zeroshot_classification.acc1", "--guards", "{}", "--min-first", "{}"]
DVC_YAML = {"artifacts": {"cloob-model": {"path": "models/train/model", "type": "model"}},
            "stages": {"train": {"cmd": "rm -rf models/train/model && mkdir -p models/train && cp -r src "
                                        "models/train/model", "deps": ["src"], "outs": ["models/train/model"]}}}


def run(root: Path, *args: str, ok: bool = True) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    done = subprocess.run(list(args), cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode == 0) == ok, f"{args}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def train(root: Path, seed: int, accuracy: float) -> None:
    """A new model folder through a real DVC stage (so dvc.lock and DVC's cache record it), and its metrics."""
    (root / "src" / "open_clip_model.safetensors").write_bytes(bytes([seed]) * 64)
    run(root, "dvc", "repro", "-q")
    report_of(root / "models" / "train" / "model", {"mnist_zeroshot_classification": {"acc1": accuracy}},
              root / "report")


def production_stage(root: Path) -> str | None:
    shown = json.loads(run(root, "gto", "show", "--json"))
    return shown.get("cloob-model", {}).get("stage", {}).get("prod")


def test_the_pipeline_declares_the_model_as_a_dvc_model_artifact():
    declared = yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())["artifacts"]
    assert declared["cloob-model"]["type"] == "model" and declared["cloob-model"]["path"] == "models/train/model"


def test_a_promotion_is_a_gto_stage_once_the_commit_holds_its_weights(tmp_path):
    root = tmp_path / "repo"
    (root / "src").mkdir(parents=True)
    (root / "src" / "model_info.json").write_text("{}")
    run(root, "git", "init", "-q")
    run(root, "git", "config", "user.name", "ci")
    run(root, "git", "config", "user.email", "ci@localhost")
    run(root, "dvc", "init", "-q")
    (root / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML))
    train(root, 1, 0.5)
    run(root, "git", "add", "-A")
    run(root, "git", "commit", "-qm", "model 1")
    # the committed model is promoted: the gate records the stage at once
    out = run(root, "cloob", "promote", "--model", "models/train/model", "--metrics", "report/metrics.json", *GATE)
    assert "PROMOTED" in out and "GTO: cloob-model at HEAD is in stage 'prod'" in out
    assert production_stage(root) == "v0.0.1"
    # right after dvc repro the lock is not committed: tagging HEAD would name the old model, so it waits
    train(root, 2, 0.6)
    out = run(root, "cloob", "promote", "--model", "models/train/model", "--metrics", "report/metrics.json",
              "--output", "promotion.json", *GATE)
    assert "PROMOTED model" in out and "not recorded yet: HEAD's dvc.lock does not hold these weights" in out
    assert production_stage(root) == "v0.0.1"
    waiting = json.loads((root / "promotion.json").read_text())
    assert "not recorded yet" in waiting["registry"]
    run(root, "git", "commit", "-qam", "model 2")
    assert "is in stage 'prod'" in run(root, "cloob", "promote", "--model", "models/train/model", "--record-stage",
                                       "--output", "promotion.json", *GATE)
    assert production_stage(root) == "v0.0.2"
    # the decision file, as `dvc metrics show` reads it, now tells the truth; the decision itself is unchanged
    recorded = json.loads((root / "promotion.json").read_text())
    assert recorded == {**waiting, "registry": "GTO: cloob-model at HEAD is in stage 'prod' (`gto show cloob-model`)"}
    assert "already in stage" in run(root, "cloob", "promote", "--model", "models/train/model", "--record-stage",
                                     *GATE)
    # a folder that is not production's gets no stage
    train(root, 3, 0.1)
    run(root, "git", "commit", "-qam", "model 3")
    out = run(root, "cloob", "promote", "--model", "models/train/model", "--record-stage", "--output",
              "promotion.json", *GATE, ok=False)
    assert "only the production model gets the stage" in out.strip().splitlines()[-1]
    assert production_stage(root) == "v0.0.2"
    assert json.loads((root / "promotion.json").read_text()) == recorded


def test_without_git_the_store_pointer_is_the_only_record(tmp_path, monkeypatch):
    """A pipeline step's image has no git: promotion still decides and points the store, and says why no GTO
    record was made (found by running the promote step in the image)."""
    from cloob_core.ops.git_registry import record_stage

    monkeypatch.setenv("PATH", str(tmp_path))  # no git on it
    record = record_stage(tmp_path, "prod", "0123456789abcdef", str(tmp_path / "store"))
    assert not record.recorded and record.line.startswith("no git repository")


def test_recording_the_stage_leaves_another_models_decision_file_alone(tmp_path, monkeypatch):
    """Only the decision about the model whose stage was recorded is updated; a file left by a later gate run for
    another candidate keeps what that gate decided."""
    from cloob_core.config import PromoteConfig
    from cloob_core.ops import git_registry, promotion

    model = tmp_path / "model"
    model.mkdir()
    (model / promotion.STATE_FILE).write_bytes(b"weights")
    candidate = promotion.model_id(model)
    monkeypatch.setattr(promotion, "read_production", lambda store: {"model_id": candidate})
    monkeypatch.setattr(git_registry, "record_stage", lambda *a: git_registry.StageRecord(True, "GTO: recorded"))
    settings = PromoteConfig(store=str(tmp_path / "store"))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"candidate": "another", "registry": "not recorded yet"}))
    assert promotion.record_production_stage(settings, model, decision_file=other) == "GTO: recorded"
    assert json.loads(other.read_text()) == {"candidate": "another", "registry": "not recorded yet"}
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"candidate": candidate, "promoted": True, "registry": "not recorded yet"}))
    promotion.record_production_stage(settings, model, decision_file=mine)
    assert json.loads(mine.read_text()) == {"candidate": candidate, "promoted": True, "registry": "GTO: recorded"}
    promotion.record_production_stage(settings, model, decision_file=tmp_path / "absent.json")
    assert not (tmp_path / "absent.json").exists()
