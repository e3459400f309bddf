#!/usr/bin/env bash
# Set up (if needed) and run the main job: train a tiny CLOOB model on the embedded digits on CPU and report
# zero-shot accuracy on the held-out split. Extra arguments go to `cloob demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/cloob demo "$@"
