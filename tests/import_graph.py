"""The import graph of the repository's own code, read from its source (``ast``): every ``cloob_core`` import,
at module level or inside a function, since a lazy import is still code that may run."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "cloob_core"


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(tree: ast.AST, module: str) -> set[str]:
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
def module_imports(module: str) -> frozenset[str]:
    path = module_file(module)
    return frozenset(imported_modules(ast.parse(path.read_text()), module)) if path else frozenset()


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
        todo += module_imports(module)
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


