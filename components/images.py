"""The container images the components run in: the one place their names live (infra/images/build.sh builds
and tags them from the same variables). Override with CLOOB_IMAGE_CPU / CLOOB_IMAGE_CUDA at compile time, or
`python -m pipelines compile --registry REGISTRY`, e.g. to point at your registry."""

from __future__ import annotations

import os

from components.image_names import VERSION, image_names

__all__ = ["CPU_IMAGE", "CUDA_IMAGE", "VERSION"]

CPU_IMAGE = os.environ.get("CLOOB_IMAGE_CPU", image_names()["CLOOB_IMAGE_CPU"])
CUDA_IMAGE = os.environ.get("CLOOB_IMAGE_CUDA", image_names()["CLOOB_IMAGE_CUDA"])
