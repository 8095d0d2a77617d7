#!/usr/bin/env bash
# What a newcomer does first, on the runtime-only install (no test extra, so no torch), in a
# fresh virtual environment of its own: the README's serve command, exactly as written there,
# must answer the README's chat completion; `jaxpaged generate` must answer too.
#   bash scripts/check_fresh_install.sh      (CI runs it before the tests)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-runtime
LOG=$(mktemp -t jaxpaged-serve.XXXXXX.log)
# A newcomer's empty cache: the built-in model's tokenizer is converted again
export JAXPAGED_CACHE
JAXPAGED_CACHE=$(mktemp -d -t jaxpaged-cache.XXXXXX)
QUESTION="What is the capital of France?"

rm -rf "$VENV"
JAXPAGED_VENV=$VENV bash scripts/setup.sh
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "FAIL: torch is installed in the runtime environment; the check would prove nothing" >&2; exit 1
fi

# The README's first command, with its .venv swapped for this environment.
CMD=$(grep -m1 -E '^bash scripts/setup.sh && \.venv/bin/jaxpaged serve' README.md) \
  || { echo "FAIL: README.md has no 'bash scripts/setup.sh && .venv/bin/jaxpaged serve' line" >&2; exit 1; }
CMD=${CMD//.venv\//$VENV/}
echo "== $CMD"
START=$(date +%s)
JAXPAGED_VENV=$VENV setsid bash -c "$CMD" >"$LOG" 2>&1 &
SERVER=$!
stop_server() { kill -TERM -- "-$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; }
trap stop_server EXIT

until curl -sf http://127.0.0.1:8000/health >/dev/null; do
  if ! kill -0 "$SERVER" 2>/dev/null; then
    echo "FAIL: the server exited before it was ready; its log:" >&2; cat "$LOG" >&2; exit 1
  fi
  if (( $(date +%s) - START > 900 )); then
    echo "FAIL: the server was not ready after 900 s; its log:" >&2; tail -50 "$LOG" >&2; exit 1
  fi
  sleep 2
done
echo "server ready after $(( $(date +%s) - START )) s"

# The README's curl example.
REPLY=$(curl -sf http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"SmolLM2-135M-Instruct\", \"messages\": [{\"role\": \"user\", \"content\": \"$QUESTION\"}], \"temperature\": 0}")
ANSWER=$(printf '%s' "$REPLY" | "$VENV/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])')
echo "chat completion: $ANSWER"
[[ "$ANSWER" == *Paris* ]] || { echo "FAIL: the answer does not mention Paris: $REPLY" >&2; exit 1; }
stop_server
trap - EXIT

OUT=$("$VENV/bin/jaxpaged" generate --prompt "$QUESTION")
echo "$OUT"
[[ "$OUT" == *Paris* ]] || { echo "FAIL: jaxpaged generate does not mention Paris" >&2; exit 1; }
# its environment (~1 GB) goes too: CI installs the test extra next, on the same disk; the server's log
# (kept on a failure) too
rm -rf "$JAXPAGED_CACHE" "$VENV" "$LOG"
echo "fresh install: OK in $(( $(date +%s) - START )) s"
