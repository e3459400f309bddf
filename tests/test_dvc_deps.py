"""dvc.yaml's code dependencies cannot drift from the code: each stage's import closure must be covered.

A stage's command is parsed by the real `cloob` parser, which names its handler; the modules the handler imports
are the stage's entry points. Their closure follows every ``cloob_core`` import, at module level or inside a
function (a lazy import is still code the stage may run), adds each package's ``__init__.py`` and the data files
that sit in a package's folder (model configs, class-name lists). Every file of the closure must be a dependency
of the stage in dvc.yaml, by itself or through a folder that contains it. cli.py itself is left out: it parses
and prints, and the stages' results cannot depend on it.
"""

from __future__ import annotations

import ast
import shlex
from functools import cache
from pathlib import Path

import pytest
import yaml

from cloob_core.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "cloob_core"


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(tree: ast.AST, module: str) -> set[str]:
    """Every cloob_core module an AST imports (``from pkg import name`` may name a module or an attribute)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parent = module.split(".")[: -node.level]
                base = ".".join([*parent, base] if base else parent)
            if base.split(".")[0] != PACKAGE:
                continue
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names if module_file(f"{base}.{alias.name}")}
    return found


@cache
def _module_imports(module: str) -> frozenset[str]:
    path = module_file(module)
    return frozenset(_imported(ast.parse(path.read_text()), module)) if path else frozenset()


def closure(modules: set[str]) -> set[Path]:
    """The files a stage runs: modules, their packages' ``__init__.py``, and the data files they name."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b.c runs a and a.b
        todo += _module_imports(module)
    modules_files = {path for module in seen if (path := module_file(module))}
    return modules_files | {data for path in modules_files for data in _data_files(path)}


def _data_files(module: Path) -> set[Path]:
    """Files beside a module that it names in a string (``resources.files(pkg) / "configs"``): a folder of
    model configs or class-name lists is data the module reads."""
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            target = module.parent / node.value
            if target.is_dir() and not (target / "__init__.py").exists():
                found |= {path for path in target.rglob("*") if path.is_file()}
    return found


def handler_imports(function) -> set[str]:
    """The cloob_core modules a CLI handler imports: the stage it calls."""
    source = ast.parse(Path(function.__code__.co_filename).read_text())
    node = next(n for n in ast.walk(source) if isinstance(n, ast.FunctionDef) and n.name == function.__name__)
    return _imported(node, function.__module__)


def stage_commands() -> dict[str, list[list[str]]]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    commands = {}
    for name, stage in stages.items():
        cmds = stage["cmd"] if isinstance(stage["cmd"], list) else [stage["cmd"]]
        commands[name] = [shlex.split(cmd) for cmd in cmds]
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


STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


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
    assert "cloob_core/cli.py" not in files and not any(f.startswith("cloob_core/evaluation/") for f in files)
    evaluation = {str(p.relative_to(ROOT)) for p in stage_closure(stage_commands()["eval_zeroshot"])}
    assert {"cloob_core/evaluation/zeroshot.py", "cloob_core/model/export.py",
            "cloob_core/evaluation/classnames/cifar10.json", "cloob_core/data/embedded.py"} <= evaluation
    trimmed = {**STAGES["train"], "deps": [d for d in STAGES["train"]["deps"] if d != "cloob_core/training"]}
    assert "cloob_core/training/optim.py" in missing_dependencies(trimmed, stage_closure(stage_commands()["train"]))
