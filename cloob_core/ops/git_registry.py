"""A promotion, also as DVC's model registry records it: a GTO stage assignment (git tags) on the commit whose
``dvc.lock`` holds the promoted weights, for the artifact ``dvc.yaml`` declares at the model folder. ``gto show``,
``dvc artifacts get cloob-model --stage prod`` and DVC Studio then find the production model.

The store's ``production.json`` stays the source of truth (Kubeflow runs have no git repository); this is a view
of it. A tag names a commit, so it is made only when that commit records exactly these weights: right after
`dvc repro` the new ``dvc.lock`` is not committed yet, and tagging HEAD would point DVC's tools at the previous
model. Then the record waits for ``cloob promote --record-stage`` after the commit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from cloob_core.errors import StageError
from cloob_core.io import file_digest
from cloob_core.model.files import STATE_FILE


class RegistryError(StageError):
    """The git repository or its DVC files do not allow the record."""


@dataclass(frozen=True)
class StageRecord:
    recorded: bool
    line: str  # what was done, or why not


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)


def _repository(model_dir: Path) -> Path | None:
    if shutil.which("git") is None:  # a pipeline step's image: no git, so no repository to record in
        return None
    found = _git(model_dir if model_dir.is_dir() else model_dir.parent, "rev-parse", "--show-toplevel")
    return Path(found.stdout.strip()) if found.returncode == 0 else None


def _artifact(root: Path, model_path: str) -> str | None:
    """The name under which dvc.yaml's ``artifacts:`` declares the model folder."""
    try:
        declared = (yaml.safe_load((root / "dvc.yaml").read_text(encoding="utf-8")) or {}).get("artifacts") or {}
    except (OSError, yaml.YAMLError):
        return None
    return next((name for name, spec in declared.items() if Path(spec.get("path", "")) == Path(model_path)), None)


def _committed_weights_md5(root: Path, model_path: str) -> str | None:
    """The MD5 of the weights file as HEAD's dvc.lock records the model folder (through DVC's ``.dir`` listing)."""
    shown = _git(root, "show", "HEAD:dvc.lock")
    if shown.returncode != 0:
        return None
    stages = (yaml.safe_load(shown.stdout) or {}).get("stages", {})
    outs = [out for stage in stages.values() for out in stage.get("outs", []) if out.get("path") == model_path]
    if not outs or not str(outs[0].get("md5", "")).endswith(".dir"):
        return None
    digest = outs[0]["md5"].removesuffix(".dir")
    listing = root / ".dvc" / "cache" / "files" / "md5" / digest[:2] / f"{digest[2:]}.dir"
    if not listing.is_file():
        return None
    entries = json.loads(listing.read_text(encoding="utf-8"))
    return next((entry["md5"] for entry in entries if entry.get("relpath") == STATE_FILE), None)


def record_stage(model_dir: str | Path, stage: str, model_id: str, store: str) -> StageRecord:
    """Assign ``stage`` to the model folder's artifact at HEAD, when HEAD records these weights."""
    model_dir = Path(model_dir).resolve()
    root = _repository(model_dir)
    if root is None:
        return StageRecord(False, "no git repository: the store's pointer is the only record")
    model_path = model_dir.relative_to(root).as_posix()
    name = _artifact(root, model_path)
    if name is None:
        return StageRecord(False, f"dvc.yaml declares no artifact at {model_path}: no GTO record")
    if _committed_weights_md5(root, model_path) != file_digest(model_dir / STATE_FILE, "md5"):
        return StageRecord(False, f"GTO stage {stage!r} of {name} not recorded yet: HEAD's dvc.lock does not hold "
                           "these weights; commit dvc.lock, then run `cloob promote --record-stage` with the gate's "
                           "--model and --output")
    from gto import api
    from gto.exceptions import WrongArgs

    try:
        api.assign(root, name, stage, ref="HEAD", message=f"promoted by the gate: model {model_id} (store {store})")
    except WrongArgs as err:
        if "already in stage" not in str(err):
            raise RegistryError(f"GTO could not assign stage {stage!r} to {name} at HEAD: {err}") from None
        return StageRecord(True, f"GTO: {name} at HEAD was already in stage {stage!r}")
    except Exception as err:  # GTO's and git's own (no tagger identity, a broken repository, ...)
        raise RegistryError(f"GTO could not assign stage {stage!r} to {name} at HEAD: {err}") from err
    return StageRecord(True, f"GTO: {name} at HEAD is in stage {stage!r} (`gto show {name}`)")
