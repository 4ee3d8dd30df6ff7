#!/usr/bin/env bash
# Set up, then ask the bundled SmolLM2-135M-Instruct a question through 3 workers that each hold
# only a third of the state.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m fusion_compute generate --workers "${WORKERS:-3}" --chat \
  --prompt "${PROMPT:-What is the capital of France?}" --max-new-tokens "${MAX_NEW_TOKENS:-64}"
