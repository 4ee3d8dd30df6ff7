#!/usr/bin/env bash
# Line coverage of fusion_compute by the test suite, the worker processes included ([tool.coverage.run]
# in pyproject.toml: coverage.py follows subprocesses and forks). Arguments go to pytest.
#   Usage: scripts/coverage.sh [PYTEST ARGS]   e.g. scripts/coverage.sh -m "not slow"
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test || exit 1
rm -rf .coverage-data && mkdir .coverage-data
export COVERAGE_FILE="$PWD/.coverage-data/cov"  # absolute: tests start processes in other directories
python3 -m coverage run -m pytest -q -p no:cacheprovider "$@"
status=$?
python3 -m coverage combine -q
python3 -m coverage report > .coverage-data/report.txt
tail -1 .coverage-data/report.txt
exit $status
