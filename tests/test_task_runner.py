"""A pipeline step as a process (cloob_core/ops/task_runner.py), as the Airflow front runs each step: the data steps
of the packaged default chained through their JSON results, a user's error exiting 2 (not retried) in one line,
and a step whose input unit was never completely published refused before it reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARAMS = (REPO / "params.yaml").read_text()


def _step(tmp: Path, step: str, inputs: dict, name: str | None = None) -> tuple[int, object, str]:
    name = name or step
    result = tmp / "results" / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "cloob_core.ops.task_runner", step, "--inputs", json.dumps(inputs),
                           "--output", str(tmp / "run" / name), "--result", str(result)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return done.returncode, None, done.stderr
    record = json.loads(result.read_text())
    assert record["step"] == step, record  # the record of a step that ended well: its name beside its result
    return 0, record["result"], done.stderr


def test_the_data_steps_chain_through_their_results_into_shards(tmp_path):
    code, acquired, err = _step(tmp_path, "acquire", {"params": PARAMS, "store": str(tmp_path / "store")})
    assert code == 0, err
    code, gate, err = _step(tmp_path, "validate_manifest", {"params": PARAMS, "manifest": acquired["manifest"]})
    assert code == 0 and gate["passed"], err
    code, parts, err = _step(tmp_path, "plan_download", {"params": PARAMS, "manifest": acquired["manifest"],
                                                         "most": 2})
    assert code == 0 and parts == ["0/2", "1/2"], err
    done = []
    for index, part in enumerate(parts):
        code, counts, err = _step(tmp_path, "download_partition", {"params": PARAMS, "manifest": acquired["manifest"],
                                                                   "partition": part, "shards": acquired["shards"]},
                                  name=f"download_partition-{index}")
        assert code == 0 and counts["partition"] == part, err
        done.append(counts)
    code, merged, err = _step(tmp_path, "merge_shards", {"shards": acquired["shards"], "parts": done})
    assert code == 0, err
    assert merged["shards"] == acquired["shards"] and merged["samples"] == sum(d["successes"] for d in done) > 0
    # the gate's report is the step's output, published as one unit (what the next reader checks)
    from cloob_core import publish

    unit = publish.unit_of(tmp_path / "run" / "validate_manifest")
    assert unit is not None and "gate.json" in unit.files


def test_a_users_error_exits_2_in_one_line_and_an_unpublished_input_is_refused(tmp_path):
    code, _, err = _step(tmp_path, "plan_evaluation", {"params": "eval: {datasets: 3}"})
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    code, _, err = _step(tmp_path, "trian", {"params": PARAMS})
    assert code == 2 and "no pipeline step 'trian'" in err, err
    half = tmp_path / "model"
    (half / "model").mkdir(parents=True)
    (half / "model" / "open_clip_config.json").write_text("{}")  # a model folder no unit covers: a stopped step's
    code, _, err = _step(tmp_path, "promote", {"params": PARAMS, "model": str(half), "report": str(half)})
    assert code == 2 and "no completely published output" in err, err
