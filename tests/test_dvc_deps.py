"""dvc.yaml's code dependencies cannot drift from the code: each stage's import closure must be covered.

A stage's command is parsed by the real `cloob` parser, which names its handler; the modules the handler imports
are the stage's entry points. Their closure follows every ``cloob_core`` import, at module level or inside a
function (a lazy import is still code the stage may run), adds each package's ``__init__.py`` and the data files
that sit in a package's folder (model configs, class-name lists). Every file of the closure must be a dependency
of the stage in dvc.yaml, by itself or through a folder that contains it. The CLI itself is left out: it
parses and prints, and the stages' results cannot depend on it.
"""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

import pytest
import yaml
from import_graph import ROOT, closure, imported_modules

from cloob_core.cli import build_parser


def handler_imports(function) -> set[str]:
    """The cloob_core modules a CLI handler imports: the stage it calls."""
    source = ast.parse(Path(function.__code__.co_filename).read_text())
    node = next(n for n in ast.walk(source) if isinstance(n, ast.FunctionDef) and n.name == function.__name__)
    return imported_modules(node, function.__module__)


def _stages() -> dict[str, dict]:
    """dvc.yaml's stages, a ``foreach`` stage as its ``do`` (the closure is the same for every item)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: stage.get("do", stage) for name, stage in stages.items()}


def stage_commands() -> dict[str, list[list[str]]]:
    commands = {}
    for name, stage in _stages().items():
        cmds = stage["cmd"] if isinstance(stage["cmd"], list) else [stage["cmd"]]
        commands[name] = [shlex.split(cmd.replace("${key}", "ITEM")) for cmd in cmds]
    return commands


def stage_closure(commands: list[list[str]]) -> set[Path]:
    parser = build_parser()
    modules: set[str] = set()
    for argv in commands:
        assert argv[0] == "cloob", f"a DVC stage runs the cloob command, not {argv[0]!r}"
        modules |= handler_imports(parser.parse_args(argv[1:]).func)
    assert modules, f"{commands}: its handler imports no stage"
    return closure(modules)


def missing_dependencies(stage: dict, files: set[Path]) -> list[str]:
    deps = [ROOT / (dep if isinstance(dep, str) else next(iter(dep))) for dep in stage.get("deps", [])]
    return sorted(str(path.relative_to(ROOT)) for path in files
                  if not any(path == dep or dep in path.parents for dep in deps))


STAGES = _stages()


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_file_a_stage_runs_is_one_of_its_dependencies(name):
    files = stage_closure(stage_commands()[name])
    missing = missing_dependencies(STAGES[name], files)
    assert not missing, f"dvc.yaml stage {name!r} runs these files but does not depend on them: {missing}"


def test_the_closure_follows_lazy_imports_and_data_files():
    """The test can fail: train's closure holds what the issue found missing, and dropping a dependency fails."""
    files = {str(p.relative_to(ROOT)) for p in stage_closure(stage_commands()["train"])}
    assert {"cloob_core/training/optim.py", "cloob_core/data/shard_files.py",
            "cloob_core/model/configs/cloob-tiny.json", "cloob_core/objectives/losses.py"} <= files
    assert not any(f.startswith(("cloob_core/cli/", "cloob_core/evaluation/")) for f in files)
    evaluation = {str(p.relative_to(ROOT)) for p in stage_closure(stage_commands()["eval"])}
    assert {"cloob_core/evaluation/tasks/zeroshot.py", "cloob_core/model/export.py",
            "cloob_core/evaluation/classnames/cifar10.json", "cloob_core/data/mnist.py",
            "cloob_core/data/packaged.py", "cloob_core/data/captioned/pairs.parquet"} <= evaluation
    trimmed = {**STAGES["train"], "deps": [d for d in STAGES["train"]["deps"] if d != "cloob_core/training"]}
    assert "cloob_core/training/optim.py" in missing_dependencies(trimmed, stage_closure(stage_commands()["train"]))
