# Sourced by the scripts in this folder: creates or reuses .venv and installs the project into it.
# Reinstalls only when a requirements file or pyproject.toml changed (a hash stamp in .venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  echo "[earl_jax] creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi
STAMP=.venv/.earl_jax_installed
WANT="$(cat pyproject.toml requirements.txt requirements-test.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[earl_jax] installing dependencies into .venv" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[test]'
  echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$ROOT/.jax_cache}"
