"""The committed dvc.lock is what the code produces: the stages before training, re-run from scratch in a copy
of the repository, must record exactly the dependencies, parameters and output hashes the lock holds. Their
outputs are byte-reproducible on any machine with the pinned versions (no timings, random ids or temporary
names in them). Training and what follows are reproducible on one machine but not across CPU types; see
docs/pipeline.md."""

from __future__ import annotations

import yaml
from test_dvc_pipeline import REPO, copy_repository, environment, run, stages_run

BEFORE_TRAINING = ["acquire", "validate", "download", "score", "curate", "validate_shards"]


def stage_entries(lock_file) -> dict:
    return yaml.safe_load(lock_file.read_text())["stages"]


def test_the_committed_lock_is_what_the_code_produces_before_training(tmp_path):
    committed = stage_entries(REPO / "dvc.lock")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    listed = set()
    for name, stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].items():
        if "foreach" in stage:  # foreach: ${section.key} over a mapping of params.yaml: one stage per key
            node = params
            for key in stage["foreach"].strip("${}").split("."):
                node = node[key]
            listed |= {f"{name}@{item}" for item in node}
        else:
            listed.add(name)
    assert set(committed) == listed, "dvc.lock holds other stages than dvc.yaml: run dvc repro and commit"
    root = copy_repository(tmp_path / "repo", keep=("dvc.lock",))
    output = run(["dvc", "repro", "--force", *BEFORE_TRAINING], root, environment())
    assert stages_run(output) == BEFORE_TRAINING, output
    produced = stage_entries(root / "dvc.lock")
    for stage in BEFORE_TRAINING:
        differ = {key: (committed[stage].get(key), produced[stage].get(key))
                  for key in ("cmd", "deps", "params", "outs") if committed[stage].get(key) != produced[stage].get(key)}
        assert not differ, f"dvc.lock's {stage!r} is not what the code produces: {differ}"
