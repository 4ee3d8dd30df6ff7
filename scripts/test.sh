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
# Four pytest processes (pytest-xdist), tests handed out as each frees up (worksteal). Most of the suite's
# time is waiting (for workers to start, for deadlines and timeouts that faults and liars must run into),
# not computing: on the 2-core machines this project runs on, four took 308 s of pytest (the first run
# after a merge: its caches cold) then 234 s, two 363 s between them (2026-12-05; the quick loop 47 s
# against 51-54 s). Before the
# `fusion` commands were forked and the waits shortened, two had beaten one (455-471 s against 650-700 s)
# and three (479 s). FUSION_TEST_PROCESSES=N runs N (0: one process); so does `-n N` among the
# arguments, which pytest reads after these.
exec python3 -m pytest -q -n "${FUSION_TEST_PROCESSES:-4}" --dist worksteal "$@"
