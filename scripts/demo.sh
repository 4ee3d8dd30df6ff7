#!/usr/bin/env bash
# Set up (scripts/setup.sh: it says what it installs and skips what is already there), then ask the
# bundled SmolLM2-135M-Instruct a question through 3 workers that each hold only a third of the state.
#   Environment: WORKERS (default 3), PROMPT, MAX_NEW_TOKENS (default 64), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
# The prompt goes through the model's chat template: by default where `generate` has --raw to opt out,
# with --chat where it does not.
chat=()
usage=$("$PY" -m fusion_compute generate --help)
if [[ "$usage" != *--raw* ]]; then chat=(--chat); fi
workers=${WORKERS:-3}
echo "demo.sh: fusion generate --workers $workers: $workers local worker processes each load their slices of" \
  "the model, then the answer prints as it is generated" >&2
exec "$PY" -m fusion_compute generate --workers "$workers" "${chat[@]}" \
  --prompt "${PROMPT:-What is the capital of France?}" --max-new-tokens "${MAX_NEW_TOKENS:-64}"
