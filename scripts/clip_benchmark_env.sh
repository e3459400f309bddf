#!/usr/bin/env bash
# CLIP_benchmark 1.6.2 beside the project, for tests/test_clip_benchmark.py and for users who want its CLI on our
# exports: an overlay folder put first on PYTHONPATH, holding CLIP_benchmark, the two packages of its own that
# the project lacks, and numpy 2.3. Why its own numpy: CLIP_benchmark's accuracy() calls float() on a
# one-element array, which numpy 2.4 (the project's pin) refuses ("only 0-dimensional arrays can be converted
# to Python scalars"); numpy 2.3 still accepts it. Everything else (torch, open_clip, webdataset, sklearn) is the
# project's own, so CLIP_benchmark runs on exactly the libraries our evaluation uses.
#   usage: scripts/clip_benchmark_env.sh            # creates .venv-clip-benchmark/ (once)
#          PYTHONPATH=.venv-clip-benchmark .venv/bin/cloob-clip-benchmark eval --model_type cloob ...
set -euo pipefail
cd "$(dirname "$0")/.."
overlay=.venv-clip-benchmark
if [ -f "$overlay/.complete" ]; then exit 0; fi
rm -rf "$overlay"
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps --target "$overlay" \
  clip-benchmark==1.6.2 pycocoevalcap==1.2 pycocotools==2.0.11 numpy==2.3.5
touch "$overlay/.complete"
