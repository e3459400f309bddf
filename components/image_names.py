"""How the images are named, apart from the names the components are built with (``images.py`` reads them once,
when first imported): so that `python -m pipelines compile --registry` can set them first.

A tag names one build: the version and the commit (``0.1.0-1a2b3c4d5e6f-cpu``), never reused, so a node never runs
a stale image under a tag it already pulled and a run's pods never mix two builds (before, ``0.1.0`` was rebuilt in
place). infra/images/build.sh tags with the same names, and refuses to push a tree whose image inputs have
uncommitted changes. ``CLOOB_IMAGE_TAG`` overrides the version-commit part (a release tag, a CI build number)."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

VERSION = "0.1.0"
_ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def image_tag() -> str:
    """``CLOOB_IMAGE_TAG``, else ``VERSION-<commit>``; the version alone outside a git checkout."""
    if os.environ.get("CLOOB_IMAGE_TAG"):
        return os.environ["CLOOB_IMAGE_TAG"]
    try:
        commit = subprocess.run(["git", "-C", str(_ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return VERSION
    return f"{VERSION}-{commit}" if commit else VERSION


def image_names(registry: str = "") -> dict[str, str]:
    """The images' variables, named under ``registry`` (e.g. ``ghcr.io/acme``) when one is given."""
    prefix = f"{registry.rstrip('/')}/" if registry else ""
    return {"CLOOB_IMAGE_CPU": f"{prefix}cloob-pipelines:{image_tag()}-cpu",
            "CLOOB_IMAGE_CUDA": f"{prefix}cloob-pipelines:{image_tag()}-cuda"}
