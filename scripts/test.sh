#!/usr/bin/env bash
# Set up (scripts/setup.sh), check lint (ruff) and types (mypy), and run the test suite. Extra arguments go to pytest,
# e.g. `scripts/test.sh -m "not integration"` or `scripts/test.sh -m slow` for the long chaos runs.
# `scripts/test.sh --torch 2.14.1 [pytest arguments]` does the same in that release's environment
# (.venv-torch2.14.1, which scripts/setup.sh --torch 2.14.1 creates).
set -uo pipefail
cd "$(dirname "$0")/.."
TORCH=2.13.0
case "${1:-}" in
    --torch) [ $# -ge 2 ] || { echo "scripts/test.sh: --torch needs a release, e.g. --torch 2.14.1" >&2; exit 2; }
             TORCH=$2; shift 2 ;;
    --torch=*) TORCH=${1#--torch=}; shift ;;
esac
if [ "$TORCH" = 2.13.0 ]; then VENV=.venv; else VENV=".venv-torch$TORCH"; fi
scripts/setup.sh --torch "$TORCH" || exit 1
# lint and types first: seconds, and a finding fails the run like a failing test
"$VENV/bin/ruff" check . || { echo "scripts/test.sh: ruff found problems (settings in pyproject.toml)" >&2; exit 1; }
"$VENV/bin/mypy" || { echo "scripts/test.sh: mypy found problems with torch $TORCH (settings in pyproject.toml)" >&2; exit 1; }
"$VENV/bin/python" -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests; that is a failure, not a pass" >&2
    exit 1
fi
exit "$status"
