#!/usr/bin/env bash
# Set up (with test extras), lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
python3 -m ruff check fusion_compute tests scripts
python3 -m ruff format --check fusion_compute tests scripts
python3 -m mypy  # the files pyproject.toml's [tool.mypy] names
# Compile the package once: every `fusion` process a test starts would otherwise compile the modules it
# imports (~0.15 s of CPU each) where PYTHONDONTWRITEBYTECODE is set, as on this project's machines.
python3 -m compileall -q fusion_compute
# Two pytest processes (pytest-xdist), tests handed out as each frees up (worksteal). On the 2-core
# machines this project runs on, two beat one (455-471 s against 650-700 s, measured before the `fusion`
# commands were forked too) and three (479 s: more CPU lost to contention). FUSION_TEST_PROCESSES=0 runs
# it in one process; so does `-n 0` among the arguments, which pytest reads after these.
exec python3 -m pytest -q -n "${FUSION_TEST_PROCESSES:-2}" --dist worksteal "$@"
