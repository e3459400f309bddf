"""The container images the components run in: the one place their names live (infra/images/build.sh builds
and tags them from the same variables). Override with CLOOB_IMAGE_CPU / CLOOB_IMAGE_CUDA at compile time,
e.g. to point at your registry."""

from __future__ import annotations

import os

VERSION = "0.1.0"
CPU_IMAGE = os.environ.get("CLOOB_IMAGE_CPU", f"cloob-pipelines:{VERSION}-cpu")
CUDA_IMAGE = os.environ.get("CLOOB_IMAGE_CUDA", f"cloob-pipelines:{VERSION}-cuda")
