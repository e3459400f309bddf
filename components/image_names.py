"""How the images are named, apart from the names the components are built with (``images.py`` reads them once,
when first imported): so that `python -m pipelines compile --registry` can set them first."""

from __future__ import annotations

VERSION = "0.1.0"


def image_names(registry: str = "") -> dict[str, str]:
    """The images' variables, named under ``registry`` (e.g. ``ghcr.io/acme``) when one is given."""
    prefix = f"{registry.rstrip('/')}/" if registry else ""
    return {"CLOOB_IMAGE_CPU": f"{prefix}cloob-pipelines:{VERSION}-cpu",
            "CLOOB_IMAGE_CUDA": f"{prefix}cloob-pipelines:{VERSION}-cuda"}
