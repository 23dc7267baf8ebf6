#!/usr/bin/env bash
# Sets up .venv if needed, checks formatting and lint, then runs the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k dispatch -x).
source "$(dirname "$0")/_env.sh"

echo "[earl_jax] ruff format --check && ruff check" >&2
ruff format --check --quiet .
ruff check --quiet .

set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[earl_jax] pytest collected no tests: failing on purpose (exit code 5 must never pass)." >&2
  exit 1
fi
exit "$rc"
