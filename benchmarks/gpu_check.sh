#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): the training path on one GPU in one command, about 5 minutes on one
# H100/H200 with 16 cores and section 8 (the models learn, past the warm-up) about 9 more: `--sections 8` runs it
# alone. `--quick` runs the same sections on the CPU with tiny sizes (CI runs it).
#   benchmarks/gpu_check.sh [--quick]
# Python: .venv's where it exists (this project's install), else the machine's python3 (a CUDA image with PyTorch).
# What that Python lacks of the training path it installs from .gpu-wheels/ (benchmarks/gpu_wheels.sh fetches them
# where there is network) into a temporary folder, and the first line printed says what was brought. With $OUT set
# (the device machine), the result lines are also written to $OUT/gpu_check.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
needed="open_clip pydantic webdataset braceexpand ftfy duckdb matplotlib joblib fsspec safetensors psutil sklearn"
missing=$("$python" - "$needed" <<'PY'
import importlib.util, sys
print(" ".join(name for name in sys.argv[1].split() if importlib.util.find_spec(name) is None))
PY
)
brought=""
if [ -n "$missing" ]; then
  if ! ls .gpu-wheels/*.whl >/dev/null 2>&1; then
    echo "gpu_check: $python lacks $missing, and there is no .gpu-wheels/ to install them from (run benchmarks/gpu_wheels.sh where there is network)" >&2
    exit 2
  fi
  # only the distributions this Python does not have: the machine's own versions of the rest stay in use
  wheels=$("$python" - .gpu-wheels/*.whl <<'PY'
import importlib.metadata, re, sys
for wheel in sys.argv[1:]:
    name = re.split(r"-\d", wheel.rsplit("/", 1)[-1], maxsplit=1)[0]
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
PY
)
  site=$(mktemp -d)
  # shellcheck disable=SC2086
  "$python" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" $wheels || exit 2
  export PYTHONPATH="$PYTHONPATH:$site"
  brought="$(for w in $wheels; do basename "$w" | sed -E 's/-(py|cp)[0-9].*//'; done | tr '\n' ' ')(for: $missing)"
fi
export GPU_CHECK_BROUGHT="$brought"
args=("$@")
[ -n "${OUT:-}" ] && args+=(--out "$OUT/gpu_check.txt")
exec "$python" benchmarks/gpu_check.py "${args[@]}"
