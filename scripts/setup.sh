#!/usr/bin/env bash
# Create .venv at the repository root (once) and install cloob-pipelines into it with the pinned versions of
# requirements/constraints.txt. Idempotent: a second run finds the install stamp unchanged and does nothing.
# Usage: scripts/setup.sh [EXTRAS]    e.g. scripts/setup.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
python="${PYTHON:-python3}"
spec="."
[ -n "$extras" ] && spec=".[$extras]"

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($python --version 2>&1)"
  "$python" -m venv .venv
fi

stamp=.venv/.cloob-install
want=$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1)
have_extras=$(sed -n 2p "$stamp" 2>/dev/null || true)
if [ "$(sed -n 1p "$stamp" 2>/dev/null || true)" = "$want" ] && [[ ",$have_extras," == *",${extras},"* || -z "$extras" ]]; then
  exit 0
fi

echo "setup: installing cloob-pipelines${extras:+[$extras]} into .venv (first run takes a few minutes)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade "pip>=24"
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
  -c requirements/constraints.txt -e "$spec"
merged=$(printf '%s\n' "$have_extras" "$extras" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
printf '%s\n%s\n' "$want" "$merged" > "$stamp"
echo "setup: done"
