"""`cloob eval compare`: several runs' reports side by side, from metrics files or `dvc exp show --json`."""

from __future__ import annotations

import json

import pytest

from cloob_core.cli import main
from cloob_core.evaluation.comparison import runs_from_dvc_exp_show
from cloob_core.evaluation.records import comparison_rows


def report(zeroshot: float, probe: float) -> dict[str, dict]:
    return {
        "digits_zeroshot_classification": {"acc1": zeroshot, "mean_per_class_recall": zeroshot},
        "digits_linear_probe": {"lp_acc1": probe, "lambda_": 0.01},
        "digits_zeroshot_retrieval": {"text_retrieval_recall@1": 0.25, "image_retrieval_recall@1": 0.125,
                                      "text_retrieval_recall@5": 0.5},
        "digits_diagnostics": {"effective_eigenvalues_image": 34.0},
        "other-set_zeroshot_classification": {"acc1": 0.5},
        "suite": {"zeroshot_acc1": (zeroshot + 0.5) / 2, "linear_probe_acc1": probe},
    }


def test_rows_per_run_and_data_set_with_missing_cells_marked():
    header, rows, numbers = comparison_rows({"cloob": report(0.643, 0.887), "clip": report(0.612, 0.874)})
    assert header[:4] == ["run", "data set", "zero-shot acc1", "linear-probe acc1"]
    assert rows[0] == ["cloob", "digits", "64.30%", "88.70%", "25.00%", "50.00%", "12.50%", "-", "34"]
    assert rows[1] == ["cloob", "other-set", "50.00%", "-", "-", "-", "-", "-", "-"]
    assert [row[0] for row in rows] == ["cloob", "cloob", "clip", "clip"]
    assert numbers["zero-shot acc1"] == pytest.approx([64.3, 50.0, 61.2, 50.0])


# The shape `dvc exp show --json` prints (DVC 3): the workspace, the baseline commit, and its experiments.
def shown(metrics: dict[str, dict], objective: str) -> dict:
    return {"metrics": {"reports/metrics.json": {"data": metrics}},
            "params": {"params.yaml": {"data": {"train": {"objective": objective}}}}}


DVC_EXP_SHOW = [
    {"rev": "workspace", "name": None, "data": {"rev": "workspace", **shown(report(0.643, 0.887), "cloob")},
     "error": None, "experiments": None},
    {"rev": "3f1c2aa9d", "name": "main", "data": {"rev": "3f1c2aa9d", **shown(report(0.643, 0.887), "cloob")},
     "error": None,
     "experiments": [
         {"executor": None, "name": "clip", "revs": [
             {"rev": "77ab0e1", "name": "clip", "data": {"rev": "77ab0e1", **shown(report(0.612, 0.874), "clip")},
              "error": None, "experiments": None}]},
         {"executor": None, "name": "pvc", "revs": [
             {"rev": "8c9d1f2", "name": "pvc", "data": {"rev": "8c9d1f2", **shown(report(0.7, 0.9),
                                                                                  "pvc_geometric")},
              "error": None, "experiments": None}]},
         {"executor": None, "name": "failed", "revs": [
             {"rev": "9e0a", "name": "failed", "data": {"rev": "9e0a", "metrics": {}, "params": {}},
              "error": {"msg": "stage failed"}, "experiments": None}]},
     ]},
]


def test_dvc_experiments_are_labelled_by_name_and_objective():
    runs = runs_from_dvc_exp_show(DVC_EXP_SHOW)
    assert list(runs) == ["main (cloob)", "clip", "pvc (pvc_geometric)"]  # the workspace repeats main: left out
    assert runs["clip"]["digits_linear_probe"]["lp_acc1"] == 0.874


def test_the_cli_writes_the_table_and_chart(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(report(0.643, 0.887)))
    (tmp_path / "exps.json").write_text(json.dumps(DVC_EXP_SHOW))
    assert main(["eval", "compare", "--run", f"baseline={tmp_path / 'a.json'}", "--dvc-exps",
                 str(tmp_path / "exps.json"), "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "| pvc (pvc_geometric) | digits | 70.00% | 90.00% |" in out
    table = (tmp_path / "out" / "comparison.md").read_text()
    assert table.count("\n") == (2 + 8) + 1 + (2 + 4)  # data sets of each run, then the suite means of each run
    assert "| run | suite.zeroshot_acc1 | suite.linear_probe_acc1 |" in table
    assert "| clip | 55.60% | 87.40% |" in table
    assert (tmp_path / "out" / "comparison.png").stat().st_size > 5_000
    assert main(["eval", "compare", "--run", "x=missing.json"]) == 2
    assert "expected LABEL=PATH" in capsys.readouterr().err
