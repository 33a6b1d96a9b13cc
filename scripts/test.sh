#!/usr/bin/env bash
# Set up (scripts/setup.sh), check lint (ruff) and types (mypy), and run the test suite. Extra arguments go to pytest,
# e.g. `scripts/test.sh -m "not integration"` or `scripts/test.sh -m slow` for the long chaos runs.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
# lint and types first: seconds, and a finding fails the run like a failing test
.venv/bin/ruff check . || { echo "scripts/test.sh: ruff found problems (settings in pyproject.toml)" >&2; exit 1; }
.venv/bin/mypy || { echo "scripts/test.sh: mypy found problems (settings in pyproject.toml)" >&2; exit 1; }
.venv/bin/python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests; that is a failure, not a pass" >&2
    exit 1
fi
exit "$status"
