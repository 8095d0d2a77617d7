#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check): kernels, bandwidth, swap, the engine's start-up and step
# (issue #12: compilations after start-up, decode step time against the bytes floor) and the engine end
# to end per backend, in one call of the device tool. See pallas_kernels/RESULTS.md.
#
#   bash scripts/gpu_check.sh --prepare [--dry]  here, with PyPI access: download the small wheels the GPU
#                                                image lacks into .gpu_wheels/ (--dry: print the commands
#                                                only), then print the device call
#   bash scripts/gpu_check.sh --print-carry      print the device call: {"carry": [...], "command": ..., ...}
#   bash scripts/gpu_check.sh [ARGS...]          on the GPU machine (no network): install the carried wheels,
#                                                then python -m benchmarks.gpu_check ARGS (--dry-run, ...)
#
# Results: $OUT/gpu_check.md (the table, also printed last), gpu_check.json, gpu_check.log.
# Environment: PYTHON (default python3), GPU_CHECK_WHEELS (default .gpu_wheels), GPU_CHECK_SITE (where
# wheels are installed, default /tmp/gpu_check), GPU_CHECK_EDITABLE=0 (skip `pip install -e .`).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=${GPU_CHECK_WHEELS:-.gpu_wheels}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check}
PY=${PYTHON:-python3}
# The GPU image has triton 3.6.0 and no jax-triton. jax-triton 0.3.1 declares triton>=3.6; 0.4.1 (the
# project's pin) needs triton>=3.7, and a triton wheel (~190 MB) cannot travel. Each version travels in
# its own folder (two versions in one install stop it); the check uses the first that works.
JAX_TRITON_VERSIONS=(0.3.1 0.4.1)
# Packages the image lacks (pydantic: the server's protocol; pydantic-core is its one binary wheel, ~2 MB);
# their other dependencies (anyio, click, h11, numpy, pyyaml, requests, tqdm, typing-extensions) are on it.
COMMON=(starlette==1.10.0 uvicorn==0.54.0 gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5)
MAX_WHEEL_BYTES=$((4 * 1024 * 1024))   # all of them: the call carries 64 MiB with the tree
TIMEOUT_S=600                          # the driver's own budget is 450 s (--budget-s)

print_carry() {
  printf '{"carry": ["%s"], "command": "bash scripts/gpu_check.sh", "timeout_s": %d}\n' "$WHEELS" "$TIMEOUT_S"
}

prepare() {
  local run="" dest spec
  [[ "${1:-}" == "--dry" ]] && run="echo"
  local pip_download=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
                      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
                      --platform manylinux2014_x86_64)
  $run rm -rf "$WHEELS"
  for spec in "${COMMON[@]}"; do
    $run "${pip_download[@]}" -d "$WHEELS/common" "$spec"
  done
  for version in "${JAX_TRITON_VERSIONS[@]}"; do
    $run "${pip_download[@]}" -d "$WHEELS/jax-triton-$version" "jax-triton==$version"
  done
  if [[ -z "$run" ]]; then
    local bytes
    bytes=$(find "$WHEELS" -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    find "$WHEELS" -name '*.whl' -printf '%s\t%p\n'
    if (( bytes > MAX_WHEEL_BYTES )); then
      echo "[gpu_check.sh] the wheels take $bytes bytes, over $MAX_WHEEL_BYTES: too much to carry" >&2
      exit 1
    fi
    git check-ignore -q "$WHEELS" 2>/dev/null || echo "[gpu_check.sh] warning: $WHEELS is not git-ignored" >&2
  fi
  echo "[gpu_check.sh] device call (tool run):"
  print_carry
}

install_wheels() {
  local pip_install=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
  if compgen -G "$WHEELS/common/*.whl" >/dev/null; then
    "${pip_install[@]}" --target "$SITE/site" "$WHEELS"/common/*.whl
    export PYTHONPATH="$SITE/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "[gpu_check.sh] installed $(ls "$WHEELS"/common/*.whl | wc -l) wheel(s) into $SITE/site"
  else
    echo "[gpu_check.sh] no wheels in $WHEELS/common: starlette, uvicorn, gguf, pydantic only if the machine has them"
  fi
  local candidates=() version
  for version in "${JAX_TRITON_VERSIONS[@]}"; do
    if compgen -G "$WHEELS/jax-triton-$version/*.whl" >/dev/null; then
      "${pip_install[@]}" --target "$SITE/jax-triton-$version" "$WHEELS/jax-triton-$version"/*.whl
      candidates+=("$SITE/jax-triton-$version")
    fi
  done
  if (( ${#candidates[@]} )); then
    GPU_CHECK_JAX_TRITON=$(IFS=:; echo "${candidates[*]}")
    export GPU_CHECK_JAX_TRITON
  fi
  if [[ "${GPU_CHECK_EDITABLE:-1}" != 0 ]]; then
    # No network: no build isolation (setuptools is on the image). PYTHONPATH below covers a failure.
    timeout 180 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
      || echo "[gpu_check.sh] editable install of jaxpaged failed: running from this tree"
  fi
}

case "${1:-}" in
  --prepare) shift; prepare "$@" ;;
  --print-carry) print_carry ;;
  *)
    install_wheels
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    export GPU_CHECK_COMMIT=${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
    exec "$PY" -m benchmarks.gpu_check "$@"
    ;;
esac
