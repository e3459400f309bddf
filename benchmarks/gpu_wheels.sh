#!/usr/bin/env bash
# Fetch, here, the wheels benchmarks/gpu_check.sh needs on a GPU machine without network: the packages of the
# training and evaluation paths that a CUDA image with PyTorch lacks (open_clip and its tokenizer's, pydantic,
# webdataset; duckdb for the run manifest; matplotlib, joblib, fsspec, safetensors, psutil, scikit-learn for
# `cloob eval` and the benchmark), at the versions requirements/constraints.txt pins, for that machine's Python
# (default 3.12, x86-64 manylinux).
# Section 9's CLIP_benchmark comes from its overlay (scripts/clip_benchmark_env.sh), carried with the tree.
# They go to .gpu-wheels/ (git-ignored), which travels with the tree and which gpu_check.sh installs from.
#   benchmarks/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${1:-3.12}
packages=(open_clip_torch ftfy wcwidth pydantic pydantic_core annotated-types typing-inspection typing_extensions
          webdataset braceexpand matplotlib contourpy cycler fonttools kiwisolver pyparsing python-dateutil six
          joblib fsspec safetensors psutil scikit-learn threadpoolctl scipy duckdb)
pins=()
for name in "${packages[@]}"; do
  pin=$(grep -i -E "^${name//[-_]/[-_]}==" requirements/constraints.txt || true)
  [ -n "$pin" ] || { echo "gpu_wheels: $name is not pinned in requirements/constraints.txt" >&2; exit 1; }
  pins+=("$pin")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu-wheels "${pins[@]}"
echo "gpu_wheels: $(ls .gpu-wheels | wc -l) wheels in .gpu-wheels ($(du -sh .gpu-wheels | cut -f1)) for Python $python_version"
