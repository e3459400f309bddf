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

echo "setup: installing cloob-pipelines${extras:+[$extras]} into .venv"
# uv installs the ~200 pinned packages in about 30 s where pip takes about 2 minutes (docs/development.md). It is
# used when it is on PATH or pip can install it into .venv, with pip's configured index, extra indexes, local
# wheel folders and CA file passed on (and pip's rule of taking the best match over all of them); else pip.
uv=$(command -v uv || true)
if [ -z "$uv" ] && .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c requirements/constraints.txt uv >/dev/null 2>&1; then
  uv=.venv/bin/uv
fi
pip_setting() { .venv/bin/python -m pip config get "global.$1" 2>/dev/null || true; }
installed=""
if [ -n "$uv" ]; then
  # --compile-bytecode: pip compiles at install, uv does not, and with PYTHONDONTWRITEBYTECODE set (as on CI) every
  # process would otherwise compile torch again (about 10 s each)
  args=(--index-strategy unsafe-best-match --compile-bytecode)
  index=${PIP_INDEX_URL:-$(pip_setting index-url)}
  [ -n "$index" ] && args+=(--default-index "$index")
  for url in ${PIP_EXTRA_INDEX_URL:-$(pip_setting extra-index-url)}; do args+=(--index "$url"); done
  for link in ${PIP_FIND_LINKS:-$(pip_setting find-links)}; do args+=(--find-links "$link"); done
  cert=${PIP_CERT:-$(pip_setting cert)}
  if SSL_CERT_FILE="${SSL_CERT_FILE:-$cert}" VIRTUAL_ENV="$PWD/.venv" "$uv" pip install --quiet "${args[@]}" \
      -c requirements/constraints.txt -e "$spec"; then
    installed=uv
  else
    echo "setup: uv could not install; falling back to pip"
  fi
fi
if [ -z "$installed" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade "pip>=24"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c requirements/constraints.txt -e "$spec"
fi
merged=$(printf '%s\n' "$have_extras" "$extras" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
printf '%s\n%s\n' "$want" "$merged" > "$stamp"
echo "setup: done"
