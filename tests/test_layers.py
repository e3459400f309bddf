"""The package structure holds: no import cycle (lazy imports included), imports only go down the layers, and
nothing but the console entry point imports the CLI (the Kubeflow steps call the stage functions)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from import_graph import ROOT, module_imports

# Lowest first; a module may import its own layer and the ones below it.
LAYERS = (
    ("cloob_core", "cloob_core.errors", "cloob_core.redact", "cloob_core.io", "cloob_core.storage",
     "cloob_core.pushgateway", "cloob_core.flags", "cloob_core.plots"),
    ("cloob_core.config", "cloob_core.objectives.names", "cloob_core.objectives"),
    ("cloob_core.objectives.", "cloob_core.model", "cloob_core.data", "cloob_core.devices"),
    ("cloob_core.training", "cloob_core.evaluation", "cloob_core.curation"),
    ("cloob_core.ops", "cloob_core.experiments"),
    ("cloob_core.cli",),
)


def modules() -> list[str]:
    found = []
    for path in sorted((ROOT / "cloob_core").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def layer(module: str) -> int:
    """The layer of the most specific prefix naming the module."""
    best, level = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix if prefix.endswith(".") else prefix + ".")
            if matches and len(prefix) > best:
                best, level = len(prefix), index
    assert level is not None, f"{module} is in no layer of tests/test_layers.py"
    return level


def test_no_import_cycles():
    graph = {module: {m for m in module_imports(module) if m != module} for module in modules()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for child in sorted(graph.get(module, ())):
            if state.get(child) == 1:
                cycle = [*path[path.index(child):], child] if child in path else [module, child]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if child not in state:
                visit(child, [*path, child])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_imports_only_go_down_the_layers():
    upward = [f"{module} (layer {layer(module)}) imports {imported} (layer {layer(imported)})"
              for module in modules() for imported in sorted(module_imports(module))
              if layer(imported) > layer(module)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("folder", ["cloob_core", "components", "pipelines", "benchmarks", "scripts"])
def test_only_the_console_entry_point_imports_the_cli(folder):
    importers = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if ROOT / "cloob_core" / "cli" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            if "cloob_core.cli" in names:
                importers.append(str(path.relative_to(ROOT)))
    assert not importers, f"these import cloob_core.cli: {importers}"
    entry = (ROOT / "pyproject.toml").read_text()
    assert 'cloob = "cloob_core.cli:run"' in entry


def test_the_layer_check_can_fail():
    assert layer("cloob_core.ops.kubeflow") > layer("cloob_core.training.loop") > layer("cloob_core.config")
    assert layer("cloob_core.objectives.losses") > layer("cloob_core.objectives.names")
    assert Path(ROOT / "cloob_core" / "cli" / "__init__.py").is_file()


def test_a_download_worker_imports_neither_pandas_nor_torch():
    """Every spawned download worker imports what it runs; pandas (a quarter second) or torch (seconds) there is
    paid per process on every download."""
    import subprocess
    import sys

    probe = ("import sys, cloob_core.data.worker, cloob_core.data.sources, cloob_core.data.decoding; "
             "print(sorted(m for m in ('pandas', 'torch', 'pyarrow', 'duckdb') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.strip() == "[]"


def test_the_evaluation_plan_step_loads_neither_torch_nor_open_clip():
    """The Kubeflow pipelines' fan-out step checks every entry of the suite and lists its data sets: torch and
    open_clip there (5 s of CPU a step, most of the step) planned nothing."""
    import subprocess
    import sys

    probe = ("import sys; from cloob_core.ops import kubeflow; "
             "print(kubeflow.plan_evaluation(open('params.yaml').read())); "
             "print(sorted(m for m in ('torch', 'open_clip', 'torchvision', 'matplotlib') if m in sys.modules))")
    planned = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert planned.stdout.split("\n")[:2] == ["['captioned', 'tuxpaint', 'emoji', 'mnist']", "[]"], planned.stdout


def test_the_dvc_curation_stages_load_no_torch_while_curation_is_off(captioned_train_shards, tmp_path):
    """Every `dvc repro` runs scorer, score and curate; while curation.enabled is false they must not pay for
    torch and open_clip (about 5 s of CPU a stage), which the scoring model would need."""
    import subprocess
    import sys

    commands = (["scorer", "--output", str(tmp_path / "scorer.json")],
                ["score", "--shards", str(captioned_train_shards), "--output", str(tmp_path / "s"), "--if-enabled"],
                ["curate", "--shards", str(captioned_train_shards), "--scores", str(tmp_path / "s"), "--output",
                 str(tmp_path / "c"), "--if-enabled"])
    for command in commands:
        probe = ("import sys; from cloob_core.cli import main; main(['data', *sys.argv[1:]]); "
                 "print(sorted(m for m in ('torch', 'open_clip', 'torchvision') if m in sys.modules))")
        done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0 and done.stdout.strip().endswith("[]"), (command, done.stdout, done.stderr)
