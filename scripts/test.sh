#!/usr/bin/env bash
# Set up (with test extras), lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
python3 -m ruff check fusion_compute tests scripts
python3 -m ruff format --check fusion_compute tests scripts
python3 -m mypy  # the files pyproject.toml's [tool.mypy] names
exec python3 -m pytest -q "$@"
